"""What is wrong with a stream of one relay, in words: the one rule `relay status`
(relay/tools/status.py) and each relay's `/readyz` (relay/opsserver.py) both state, from
a stream's entry in the relay's status document (relay/core/machine.py `status`), and
from its `not_member` entries. Nothing here imports anything heavy: `relay status` must
start fast.

Every problem makes `relay status` say the mesh is degraded (exit 1). Some also fail the
relay's readiness (`/readyz` 503): those of a relay that cannot serve the stream now.

    fails readiness (the relay cannot serve the stream)
        fenced, for any reason (quorum, not_admitted, clock, config_mismatch, ...)
        not joined yet
        history lost: every relay of the stream came back without its history
        diverged: its history disagrees with a commit the members announced, for longer
            than DIVERGED_REPORT_MS
        waiting: something has waited to commit for longer than WAITING_REPORT_MS
            while the committed point did not move, and the stream is joined and not
            fenced (a fence, or the join, says why already)
    degraded only (it serves the stream; /readyz lists them under "degraded")
        stalled without a fence (view_change, split, spool_full, ...)
        a configuration disagreement that does not fence it: peers state another
            configuration, and the stream serves on under its established one
        the topology file names other relays than the configuration it runs under
        not a member: the topology names this relay, the stream's configuration leaves
            it out (its reads are redirected, its produces forwarded)

A stream opened by a read and never written (no view was ever established, nothing held
or waiting: `never_written`) has no problem at all: it is not in use, and the first
produce to it establishes its view. Otherwise one read of a new name would take every
relay out of a load balancer's rotation until someone wrote there.

During a planned rolling change of a topology file every relay is in one of the last
three states for a while: a load balancer must not take them all out of rotation. A
configuration disagreement that does hold the stream fences it (`config_mismatch`), and
fails readiness as a fence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

__all__ = [
    "DIVERGED_REPORT_MS",
    "STALL_WORDS",
    "WAITING_REPORT_MS",
    "Problem",
    "configuration_words",
    "disagreement_words",
    "history_lost_words",
    "never_written",
    "not_member_words",
    "relay_list",
    "relay_problems",
    "stall_words",
    "stream_problem",
    "stream_problems",
    "topology_words",
]

# A relay whose digest disagrees with a commit the members announced repairs at once (or
# after limits.repair_grace_ms, 50 ms by default) and agrees again within a few round
# trips: disagreeing this long means the repair does not succeed.
DIVERGED_REPORT_MS = 1_000
# Something waiting to commit (an entry held above the committed point, a produce being
# coordinated) commits within a few round trips, or is answered within a produce timeout
# (2 s by default) and resolved (5.7): waiting this long without a fence to say why means
# the stream does not commit through this relay.
WAITING_REPORT_MS = 2_000

STALL_WORDS = {
    "quorum": "fewer than a quorum of its relays are heard",
    "joining": "it is still joining (it has no history of the stream yet)",
    "not_admitted": "the stream's view does not admit this relay (yet)",
    "clock": "this relay's clock is too far from the others'",
    "view_change": "a view change is under way",
    "split": "a split is being rebuilt",
    "spool_full": "this relay's spool is full: it votes on no stream until the store ingests",
    "store_backlog_full": "fewer than a quorum of its relays have room in their spools "
    "(relay store ingest frees it)",
    "config_mismatch": "relays state another configuration of the stream (other relays "
    "serve it, by their record or their topology file): it does not commit until they agree",
}


class Problem(NamedTuple):
    """One thing wrong with a stream of one relay: in words, and whether it fails the
    relay's readiness (`unready`) or only makes `relay status` degraded."""

    words: str
    unready: bool


def stream_problem(info: Mapping[str, Any]) -> str:
    """Everything wrong with a stream of one relay, in words ("" if nothing)."""
    return "; ".join(p.words for p in stream_problems(info))


def never_written(info: Mapping[str, Any]) -> bool:
    """Whether a stream of one relay (its entry in `streams`) is opened but was never
    written in this mesh's memory: no view was ever established (a first produce
    establishes view 1, 5.11), nothing is held, nothing waits. A read of a new name
    opens such a stream; it commits as soon as someone writes to it, so it is nothing an
    operator or a load balancer should act on."""
    return (
        bool(info.get("joined"))
        and int(info.get("view") or 0) == 0
        and not info.get("admitted")
        and not info.get("held")
        and not info.get("pending")
        and not info.get("uncommitted")
        and not info.get("history_lost")
    )


def stream_problems(info: Mapping[str, Any]) -> list[Problem]:
    """What is wrong with a stream of one relay (its entry in `streams`), most urgent
    first ([] if nothing, and for a stream `never_written`)."""
    found: list[Problem] = []
    if never_written(info):
        return found
    fenced = bool(info.get("fenced"))
    stall = info.get("stall")
    if fenced or stall:
        reason = (stall or {}).get("reason") or info.get("fence_reason") or "no reason given"
        words = ("fenced" if fenced else "stalled") + f": {stall_words(reason)}"
        if stall:
            waiting = ", ".join(str(r) for r in stall.get("waiting_for") or []) or "none"
            words += f" (waiting for relays {waiting}; for {stall.get('for_ms', 0) / 1000:.1f} s)"
        if not info.get("joined"):
            words += "; not joined yet"
        found.append(Problem(words, unready=fenced or not info.get("joined")))
    elif not info.get("joined"):
        found.append(Problem("not joined yet", unready=True))
    if info.get("history_lost"):
        found.append(Problem(history_lost_words(), unready=True))
    diverged_ms = int(info.get("diverged_ms") or 0)
    if diverged_ms > DIVERGED_REPORT_MS:
        found.append(
            Problem(
                f"diverged for {diverged_ms / 1000:.1f} s: its history disagrees with a "
                "commit the stream's relays announced, and repairing it from them has not "
                "made it agree",
                unready=True,
            )
        )
    waiting_ms = int(info.get("waiting_ms") or 0)
    if waiting_ms > WAITING_REPORT_MS and not fenced and info.get("joined"):
        found.append(
            Problem(
                f"nothing has committed for {waiting_ms / 1000:.1f} s while entries or "
                "produces wait to commit here",
                unready=True,
            )
        )
    config = info.get("config")
    if isinstance(config, Mapping):
        if config.get("disagree"):
            found.append(Problem(disagreement_words(config, info), unready=False))
        if list(config.get("relays") or []) != list(config.get("topology") or []):
            found.append(Problem(topology_words(config), unready=False))
    return found


def relay_problems(status: Mapping[str, Any]) -> list[tuple[str, Problem]]:
    """(stream, problem) of every stream of one relay's status document: the streams it
    tracks, then those its topology names it for and their configuration does not."""
    found = [
        (name, problem)
        for name, info in sorted((status.get("streams") or {}).items())
        for problem in stream_problems(info)
    ]
    for name, config in sorted((status.get("not_member") or {}).items()):
        found.append((name, Problem(not_member_words(config), unready=False)))
        if config.get("disagree"):
            found.append((name, Problem(disagreement_words(config, {}), unready=False)))
    return found


def stall_words(reason: str) -> str:
    words = STALL_WORDS.get(reason)
    return f"{words} [{reason}]" if words else reason


# --- configurations (docs/protocol.md 5.15) ---------------------------------------------------

_CHANGES = "docs/deploy.md section 9"


def relay_list(relays: Iterable[object]) -> str:
    """`relays 0, 1, 2`; `no relays`."""
    ids = [str(r) for r in relays]
    return "relays " + ", ".join(ids) if ids else "no relays"


def configuration_words(version: int | str, relays: Iterable[object]) -> str:
    """`relays 0, 1, 2 (configuration 1)`; version 0 is provisional (not established).
    (JSON output has the version as a string: `version` is a seq's key, relay/seqtext.py.)"""
    number = int(version)
    which = f"configuration {number}" + (", provisional" if number == 0 else "")
    return f"{relay_list(relays)} ({which})"


def change_words(config: Mapping[str, Any]) -> str:
    """What becomes of a stream whose topology file names other relays than its
    configuration (docs/protocol.md 5.15 changes): the live relays whose files name others
    hold the change (`change_held_by`, a stale file among them), else the mesh makes it."""
    held = config.get("change_held_by") or {}
    if held:
        files = "; ".join(
            f"relay {peer}'s file names {relay_list(relays)}"
            for peer, relays in sorted(held.items(), key=lambda item: int(item[0]))
        )
        return (
            "the change waits until the file of every live relay of the stream names the "
            f"same relays: {files} ({_CHANGES})"
        )
    return (
        "the mesh changes the stream's relays to those, step by step, once the files of "
        f"every live relay of the stream (a quorum at least) name them ({_CHANGES})"
    )


def topology_words(config: Mapping[str, Any]) -> str:
    """A stream whose topology names other relays than the configuration it runs under."""
    return (
        f"runs on {configuration_words(config['version'], config['relays'])}; "
        f"the topology file names {relay_list(config['topology'])}: {change_words(config)}"
    )


def not_member_words(config: Mapping[str, Any]) -> str:
    """A stream this relay does not serve because its configuration leaves it out (it was
    established on other relays, or a change took this relay off it)."""
    words = (
        "not served here: it runs on "
        f"{configuration_words(config['version'], config['relays'])}, which leaves this "
        "relay out; its reads are redirected and its produces forwarded to those relays"
    )
    if list(config["topology"]) != list(config["relays"]):
        words += (
            f"; the topology file names {relay_list(config['topology'])}: the relays of the "
            f"stream add the others once their files name them too ({_CHANGES})"
        )
    return words


def disagreement_words(config: Mapping[str, Any], info: Mapping[str, Any]) -> str:
    """Peers whose last word about the stream named another configuration than ours
    (`config.disagree`), grouped by the configuration they state; `info`: the stream's
    entry (whether the disagreement holds it), or {} for a stream not served here."""
    stated: dict[tuple[int, tuple[object, ...]], list[str]] = {}
    for peer, theirs in sorted(config["disagree"].items(), key=lambda item: int(item[0])):
        stated.setdefault((int(theirs["version"]), tuple(theirs["relays"])), []).append(peer)
    others = "; ".join(
        ("relay " if len(peers) == 1 else "relays ")
        + ", ".join(peers)
        + (" states " if len(peers) == 1 else " state ")
        + configuration_words(version, relays)
        for (version, relays), peers in sorted(stated.items())
    )
    ours = configuration_words(config["version"], config["relays"])
    if not info:
        return f"relays disagree about its configuration: it runs on {ours}; {others}"
    if info.get("fence_reason") == "config_mismatch":
        held = "this holds the stream until they agree"
    else:
        held = "it serves on under its own (what they say under theirs is not taken)"
    return (
        f"relays disagree about its configuration: this relay runs it on {ours}; {others}: {held}"
    )


def history_lost_words() -> str:
    return (
        "history lost: every relay of the stream came back without its history and no spool "
        "or store held it, so it began again at the genesis; records committed before are "
        "gone, and reads from positions among them are answered out_of_range"
    )
