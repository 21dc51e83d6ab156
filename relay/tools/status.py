"""What `relay status` makes of the relays' answers: the mesh's health in one word, each
problem in words, and the figures; as one JSON document (seqs as strings) or as plain
lines that read at any width (no table: nothing is cut when piped or in a narrow
terminal; a long line wraps).

Health, and the exit code of `relay status` (`EXIT_CODES`):

    healthy   0  every relay answers, and every stream it serves is joined, unfenced and
                 not stalled, its relays agree about its configuration and its topology
                 names the relays of that configuration, its history is not lost, it has
                 not diverged or waited long to commit; no relay is named by its topology
                 for a stream whose configuration leaves it out; no spool is full or
                 stopped a stream
    degraded  1  some relay answers, but another does not (or refuses the request: this
                 client lacks the admin right), or any stream problem of
                 relay/streamhealth.py (it says which of them also fail the relay's
                 /readyz), or a spool is full or stopped a stream
    down      2  no relay answers

Counters of things that went wrong at some time since a relay started (invalid frames,
refused handshakes, internal errors: `NOTE_COUNTERS`) are listed as notes, in words; they
are history, not state, and leave the health alone. Routine events are no problem: a
client that left before its answer came (`client_reply_dropped`), a view change a relay
refused while another went on (`view_refused`), a slow consumer asked to read its replies
first (`read_refused_slow_consumer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from relay.seqtext import seqs_as_text
from relay.streamhealth import configuration_words, relay_list, relay_problems

if TYPE_CHECKING:
    from relay.launcher import StatusReply

__all__ = [
    "DEGRADED",
    "DOWN",
    "EXIT_CODES",
    "HEALTHY",
    "KEY_COUNTERS",
    "NOTE_COUNTERS",
    "mesh_status",
    "status_lines",
]

HEALTHY, DEGRADED, DOWN = "healthy", "degraded", "down"
EXIT_CODES = {HEALTHY: 0, DEGRADED: 1, DOWN: 2}

# Counters worth a glance (core and node), in this order, when not zero.
KEY_COUNTERS = (
    "produce_requests",
    "produce_committed",
    "produce_rejected",
    "produce_fenced",
    "produce_unknown",
    "read_requests",
    "delivered_entries",
    "repair_started",
    "rebases",
)

# Counters of something that went wrong, each with what it means: (counter names, words).
# Several names under one meaning are added up.
NOTE_COUNTERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        (
            "frame_invalid",
            "peer_bad_parts",
            "peer_bad_topic",
            "peer_bad_bundle",
            "peer_bad_announcement",
        ),
        "malformed frames from peers, dropped",
    ),
    (
        ("peer_frames_other_protocol",),
        "frames from relays of another peer protocol, dropped unread",
    ),
    (("peer_recv_error", "client_recv_error"), "socket receive errors"),
    (("peer_sender_mismatch",), "peer frames whose sender was not the link's relay, dropped"),
    (
        ("frame_not_member",),
        "frames about a stream from relays outside its configuration (their topology file "
        "differs), dropped",
    ),
    (("client_frame_invalid",), "invalid requests from clients, answered with an error"),
    (
        ("peer_frame_core_error", "client_frame_node_error", "produce_core_error"),
        "internal errors (each in the relay's log, with its traceback)",
    ),
    (("acceptor_save_failed",), "failures to save acceptor records to disk"),
    (("publish_dropped",), "frames to peers that could not be published"),
    (("repair_mismatch",), "repair answers that did not match the digest chain, ignored"),
    (("spool_gaps",), "gaps in this relay's spool (the other relays' spools cover them)"),
    (("produce_node_timeout",), "produces answered unknown after the relay's own backstop"),
)
_NOT_AUTHORIZED = "not_authorized_"  # + the right: requests refused for lack of rights

# --- the document -------------------------------------------------------------------------


def mesh_status(
    config_path: str,
    replies: Mapping[int, StatusReply],
    store: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The document `relay status --json` prints (seqs as strings): "health", "problems"
    and "notes" in words, and per relay its endpoint, whether it answered and its own
    status document."""
    relays = []
    problems: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    for relay_id, reply in sorted(replies.items()):
        status = reply.status
        streams = (status or {}).get("streams") or {}
        relays.append(
            {
                "relay": relay_id,
                "client_endpoint": reply.endpoint,
                "reachable": reply.reachable,
                "refused": reply.refused,
                "error": reply.error,
                "fenced_streams": sorted(n for n, info in streams.items() if info.get("fenced")),
                "status": status,
            }
        )
        if status is None:
            words = "refuses the status request" if reply.refused else "does not answer"
            problems.append(
                _problem(relay_id, None, f"{words} on {reply.endpoint} ({reply.error})")
            )
            continue
        problems += [_problem(relay_id, name, p.words) for name, p in relay_problems(status)]
        problems += [_problem(relay_id, None, words) for words in _spool_problems(status)]
        problems += [_problem(relay_id, None, words) for words in _protocol_problems(status)]
        notes += [
            {"relay": relay_id, "count": count, "note": words, "counters": list(names)}
            for names, count, words in _counter_notes(status)
        ]
    answering = sum(1 for reply in replies.values() if reply.reachable or reply.refused)
    health = DOWN if answering == 0 else DEGRADED if problems else HEALTHY
    return {
        "config": config_path,
        "health": health,
        "relays_answering": answering,
        "relays_total": len(relays),
        "all_reachable": answering == len(relays),
        "problems": problems,
        "notes": notes,
        "relays": seqs_as_text(relays),
        "store": store,  # its runner writes its seqs as strings already (relay.storerun)
    }


def _problem(relay: int, stream: str | None, words: str) -> dict[str, Any]:
    return {"relay": relay, "stream": stream, "problem": words}


def _spool_problems(status: Mapping[str, Any]) -> list[str]:
    found = []
    spool = status.get("spool") or {}
    if status.get("spool_full"):
        found.append(
            f"spool full ({spool.get('room_bytes', '?')} bytes of room): it votes on no stream "
            "until `relay store ingest` takes its segments"
        )
    for stream, why in sorted((spool.get("stopped_streams") or {}).items()):
        found.append(f"spool stopped stream {stream!r}: {why}")
    return found


def _protocol_problems(status: Mapping[str, Any]) -> list[str]:
    """Peers with no peer protocol in common with this relay, and peers holding limits the
    mesh must hold alike at other values (relay/peerprotocol.py)."""
    peers = (status.get("node") or {}).get("peer_protocols") or {}
    return [
        info[key]
        for _, info in sorted(peers.items())
        for key in ("problem", "limits_problem")
        if info.get(key)
    ]


def _counter_notes(status: Mapping[str, Any]) -> list[tuple[tuple[str, ...], int, str]]:
    """(counter names, count, words) of the relay's counters of things that went wrong."""
    counters = _all_counters(status)
    found = []
    for names, words in NOTE_COUNTERS:
        count = sum(counters.get(name, 0) for name in names)
        if count > 0:
            found.append((tuple(n for n in names if counters.get(n)), count, words))
    refused = {k: v for k, v in counters.items() if k.startswith(_NOT_AUTHORIZED) and v > 0}
    if refused:
        rights = ", ".join(k.removeprefix(_NOT_AUTHORIZED) for k in sorted(refused))
        found.append(
            (
                tuple(sorted(refused)),
                sum(refused.values()),
                f"requests refused for lack of rights ({rights})",
            )
        )
    handshakes = int((status.get("node") or {}).get("handshakes_refused") or 0)
    if handshakes:
        found.append(
            (
                ("handshakes_refused",),
                handshakes,
                "CurveZMQ handshakes refused (keys the topology does not list)",
            )
        )
    return found


def _all_counters(status: Mapping[str, Any]) -> dict[str, int]:
    """The core's and the node's counters of one relay, added up by name."""
    counters: dict[str, int] = dict(status.get("counters") or {})
    for name, value in ((status.get("node") or {}).get("counters") or {}).items():
        counters[name] = counters.get(name, 0) + value
    return counters


# --- as text ------------------------------------------------------------------------------

Emphasis = Callable[[str, str], str]  # (text, "good" | "warn" | "bad") -> text to print


def _plain(text: str, level: str) -> str:
    return text


def status_lines(doc: Mapping[str, Any], emphasize: Emphasis = _plain) -> list[str]:
    """`doc` (from `mesh_status`) as lines of text: the health and the problems first, then
    each relay's streams and figures, the notes and the store."""
    health = doc["health"]
    level = {HEALTHY: "good", DEGRADED: "warn"}.get(health, "bad")
    lines = [
        f"mesh {doc['config']}: {emphasize(health, level)} "
        f"({doc['relays_answering']} of {doc['relays_total']} relays answer)"
    ]
    if doc["problems"]:
        lines.append("problems:")
        lines += [f"  {_where(p)}: {p['problem']}" for p in doc["problems"]]
    for entry in doc["relays"]:
        lines += _relay_lines(entry, emphasize)
    if doc["notes"]:
        lines.append("notes (counted since each relay started):")
        lines += [
            f"  relay {n['relay']}: {n['count']} {n['note']} ({', '.join(n['counters'])})"
            for n in doc["notes"]
        ]
    lines += _store_lines(doc.get("store"))
    return lines


def _where(problem: Mapping[str, Any]) -> str:
    stream = problem.get("stream")
    return f"relay {problem['relay']}" + (f", stream {stream}" if stream else "")


def _relay_lines(entry: Mapping[str, Any], emphasize: Emphasis) -> list[str]:
    relay = entry["relay"]
    status = entry["status"]
    if status is None:
        words = "refused the request" if entry["refused"] else "no answer"
        return [f"relay {relay}: {emphasize(words, 'bad')} ({entry['client_endpoint']})"]
    node = status.get("node") or {}
    peers = ", ".join(str(p) for p in status.get("peers_heard") or []) or "none"
    lines = [
        f"relay {relay}: {emphasize('up', 'good')}, incarnation {status.get('incarnation')}, "
        f"peers heard {peers}",
        f"  clients {entry['client_endpoint']}, mesh {node.get('mesh_endpoint', '?')}",
    ]
    for name, info in sorted((status.get("streams") or {}).items()):
        state = "joined" if info.get("joined") else emphasize("not joined", "warn")
        if info.get("fenced"):
            state += ", " + emphasize(f"fenced ({info.get('fence_reason') or '?'})", "warn")
        if info.get("history_lost"):
            state += ", " + emphasize("history lost", "bad")
        lines.append(
            f"  stream {name}: {state}, committed seq {info.get('committed')}, "
            f"held {info.get('held')} ({info.get('held_bytes')} bytes)"
            + _configuration_text(info.get("config"), emphasize)
        )
    for name, config in sorted((status.get("not_member") or {}).items()):
        lines.append(
            f"  stream {name}: {emphasize('not a member', 'warn')}"
            + _configuration_text(config, emphasize, always=True)
        )
    counters = _all_counters(status)
    shown = [f"{name}={counters[name]}" for name in KEY_COUNTERS if counters.get(name)]
    lines.append("  counters: " + (" ".join(shown) or "none yet"))
    spool = status.get("spool")
    if spool is not None:
        lines.append(
            f"  spool: {spool.get('segments_written')} segments, {spool.get('records_written')} "
            f"records, {spool.get('bytes_written')} bytes written; "
            f"{spool.get('segments_reclaimed')} reclaimed, {spool.get('records_dropped')} "
            f"records dropped; room {spool.get('room_bytes')} bytes"
        )
    return lines


def _configuration_text(
    config: Mapping[str, Any] | None, emphasize: Emphasis, *, always: bool = False
) -> str:
    """A stream's configuration (docs/protocol.md 5.15) when there is something to say
    (`always`, or the topology names other relays, or peers state another one): "" else."""
    if not config:
        return ""
    relays, topology, disagree = config["relays"], config["topology"], config["disagree"]
    if not always and relays == topology and not disagree:
        return ""
    text = f"; runs on {configuration_words(config['version'], relays)}"
    if topology != relays:
        text += ", " + emphasize(f"the topology file names {relay_list(topology)}", "warn")
    if disagree:
        stated = ", ".join(
            f"relay {peer} states {configuration_words(c['version'], c['relays'])}"
            for peer, c in sorted(disagree.items(), key=lambda item: int(item[0]))
        )
        text += ", " + emphasize(f"disagreement: {stated}", "warn")
    return text


def _store_lines(store: Mapping[str, Any] | None) -> list[str]:
    """The store runner's last jobs and where each stream stands in the store."""
    if not store:
        return []
    runner = store["runner"]
    now_ms = time.time() * 1000
    seen_s = (now_ms - runner.get("updated_ms", now_ms)) / 1000
    lines = [
        f"store runner: pid {runner.get('pid')} on {runner.get('host')}, "
        f"{runner.get('engine')}, last seen {seen_s:.0f} s ago; store {store.get('location', '?')}"
    ]
    for job, last in sorted((runner.get("last") or {}).items()):
        ago_s = (now_ms - last.get("started_ms", now_ms)) / 1000
        figures = ", ".join(
            f"{k}={v}" for k, v in (last.get("figures") or {}).items() if k != "changed"
        )
        result = figures if last.get("ok") else f"failed: {last.get('error')}"
        runs = (runner.get("runs") or {}).get(job, 0)
        failed = (runner.get("failures") or {}).get(job, 0)
        lines.append(
            f"  job {job}: {ago_s:.0f} s ago, took {last.get('duration_ms', 0)} ms, "
            f"{result or 'nothing to do'}; {runs} runs, {failed} failed"
        )
    for name, stream in sorted((runner.get("streams") or {}).items()):
        if not isinstance(stream, dict):
            continue
        behind = store["behind_ms"].get(name)
        lines.append(
            f"  stream {name}: stored seq {stream.get('last_seq')}, "
            + (
                "behind the relays: ?"
                if behind is None
                else f"{behind / 1000:.1f} s behind the relays"
            )
            + f", {stream.get('records')} records in {stream.get('files')} files, "
            f"snapshot seq {stream.get('snapshot_seq') or '-'}"
        )
    return lines


def store_status(store: Any, replies: Mapping[int, StatusReply]) -> dict[str, Any] | None:
    """What `relay store run` last left in the store (relay.storerun), and per stream how
    far the store is behind the relays' commits (by the time in the seqs); None when no
    runner ran there."""
    from relay.core.seq import ms_of
    from relay.storerun import read_status

    runner = read_status(store)
    if runner is None:
        return None
    committed: dict[str, int] = {}
    for reply in replies.values():
        for name, info in ((reply.status or {}).get("streams") or {}).items():
            if isinstance(info.get("committed"), int):
                committed[name] = max(committed.get(name, -1), info["committed"])
    behind: dict[str, int | None] = {}
    for name, stream in (runner.get("streams") or {}).items():
        if isinstance(stream, dict) and committed.get(name, -1) >= 0:
            stored = int(stream.get("last_seq", -1))
            behind[name] = max(0, ms_of(committed[name]) - ms_of(stored)) if stored >= 0 else None
    return {"location": str(store), "runner": runner, "behind_ms": behind}
