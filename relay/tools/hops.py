"""`relay bench --hops`: where the time of one transaction goes, hop by hop.

Starts the 3-relay bench mesh with every relay tracing its frames (relay/hoptrace.py),
sends transactions one at a time through relay 0 (the sync `Producer`, window 1) while a
`Consumer` of relay 1 reads them, stops the mesh (the relays write their traces) and lines
the relays' stamps up with the client's: all are CLOCK_MONOTONIC of this machine
(`time.monotonic_ns` in the relays, `time.perf_counter` here, the same clock on Linux).

For each transaction (its client send S and reply R; the coordinator C is the relay that
took the request, relay 0; the members M are the two others) it finds:

    client_in     C takes the ProduceReq                  one-way: client -> C
    batch_out     C publishes the TxBatch with the seq    C's turn
    batch_in[M]   M takes that TxBatch                    one-way: C -> M
    report_out[M] M publishes a Reports at the seq        M's turn (the third member leads)
    report_in[M]  C takes M's Reports                     one-way: M -> C
    reply_out     C sends the ProduceResp with the seq    C commits: q reports agree
    reply         the client has the answer               one-way: C -> client
    read_out      relay 1 sends the ReadResp with the seq
    delivered     the consumer has the record             one-way: relay 1 -> consumer

and reports, per stage, the median and 90th percentile over the transactions, plus what
each member heard last before it reported (its *trigger*: the TxBatch itself, or another
member's frame that raised its watermark, 5.3 and section 7 of docs/protocol.md). A member
that took the TxBatch only after the others' reports committed the seq does not report
there (its vote is no longer needed) and is left out of that transaction's path. Each
stage names the one-way delays it holds: the four between processes on the path. Only
relay 0 coordinates, so the members lead (5.2) and none waits for the other's floor before
it reports: four, as section 7 counts (five where several relays coordinate a stream).
"""

from __future__ import annotations

import bisect
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from relay.errors import ClientError
from relay.hoptrace import CLIENT_IN, CLIENT_OUT, PEER_IN, PEER_OUT, read_trace
from relay.launcher import Mesh
from relay.tools.bench import (
    START_TIMEOUT_S,
    STREAM,
    BenchOptions,
    _context,
    _payload,
    _percentile,
    _write_topology,
    one_at_a_time,
)

HOPS_MAX_TX = 5_000  # transactions traced per run (each costs ~20 stamps per relay)
QUICK_HOPS_MAX_TX = 100
COORDINATOR = 0  # the producer sends to relay 0 first
READER = 1  # the consumer reads from relay 1 first
_PRODUCE_ANSWERS = ("ProduceResp", "ProduceBatchResp")
NO_LATER_SEQ = 1 << 64  # above every seq (u63): the last transaction has no next one

# The stages, in the order of the path: (name, what it measures, the one-way delays in it).
# A member reports on the TxBatch: the other member leads (docs/protocol.md 5.2 and 7).
STAGES: tuple[tuple[str, str, int], ...] = (
    ("client_in", "client -> coordinator takes the request", 1),
    ("batch_out", "coordinator: request -> TxBatch published", 0),
    ("batch_in", "TxBatch: coordinator -> member takes it (first member)", 1),
    ("report_out", "member: TxBatch -> its Reports at the seq", 0),
    ("report_in", "Reports: member -> coordinator takes it (first to arrive)", 1),
    ("reply_out", "coordinator: first Reports -> answer sent (commit)", 0),
    ("reply", "answer: coordinator -> client has it", 1),
)
DELIVERY_STAGES: tuple[tuple[str, str, int], ...] = (
    ("read_out", "reader relay sends the ReadResp (from client send)", 0),
    ("delivered", "ReadResp -> consumer has the record", 1),
)


class _TracedMesh(Mesh):
    """The bench mesh with every relay writing a hop trace to `directory` when it stops."""

    def __init__(self, *args: Any, directory: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.directory = directory

    def trace_path(self, relay_id: int) -> Path:
        return self.directory / f"relay-{relay_id}.hops"

    def _command(self, relay_id: int) -> list[str]:
        return [*super()._command(relay_id), "--hop-trace", str(self.trace_path(relay_id))]


class _Events:
    """One relay's trace, indexed for lookups by time."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self.ns = [e["ns"] for e in events]

    def after(self, ns: int, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        """The first event at or after `ns` that `match`es."""
        for i in range(bisect.bisect_left(self.ns, ns), len(self.events)):
            if match(self.events[i]):
                return self.events[i]
        return None

    def last_before(
        self, ns: int, match: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any] | None:
        """The last event strictly before `ns` that `match`es."""
        for i in range(bisect.bisect_left(self.ns, ns) - 1, -1, -1):
            if match(self.events[i]):
                return self.events[i]
        return None


def _holds(seq: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: seq in e.get("seqs", ())


def _reports_in(lo: int, below: int) -> Callable[[dict[str, Any]], bool]:
    """A Reports with a point in [lo, below): a report at seq `lo`, not at the next
    transaction's seq `below` or later (no point of a report made before that seq was
    given reaches it: a member reports up to its watermark only, 5.3)."""
    return lambda e: e["kind"] == "Reports" and any(lo <= p < below for p in e.get("points", ()))


def _from(relay: int, match: Callable[[dict[str, Any]], bool]) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["dir"] == PEER_IN and e["peer"] == relay and match(e)


def _path_of_one(
    traces: dict[int, _Events], sent_ns: int, reply_ns: int, delivered_ns: int | None
) -> dict[str, Any] | None:
    """The stamps of one transaction's path (see the module docstring), or None if a
    stamp is missing (the trace lost it, or the transaction took another way)."""
    coord = traces[COORDINATOR]
    took = coord.after(sent_ns, lambda e: e["dir"] == CLIENT_IN)
    reply = coord.after(sent_ns, lambda e: e["dir"] == CLIENT_OUT and e["kind"] in _PRODUCE_ANSWERS)
    if took is None or reply is None or not reply.get("seqs") or reply["ns"] > reply_ns:
        return None
    seq = reply["seqs"][0]
    batch = coord.after(took["ns"], lambda e: e["dir"] == PEER_OUT and _holds(seq)(e))
    if batch is None:
        return None
    later = coord.after(batch["ns"] + 1, lambda e: e["dir"] == PEER_OUT and e["kind"] == "TxBatch")
    at_seq = _reports_in(seq, min(later["seqs"]) if later else NO_LATER_SEQ)
    taken: list[int] = []  # when each member took the TxBatch
    members: list[dict[str, Any]] = []
    for relay, events in traces.items():
        if relay == COORDINATOR:
            continue
        batch_in = events.after(
            batch["ns"],
            lambda e: e["dir"] == PEER_IN and e["peer"] == COORDINATOR and _holds(seq)(e),
        )
        if batch_in is None:
            continue  # it took the TxBatch another way (passed on by a peer, 5.13)
        taken.append(batch_in["ns"])
        report_out = events.after(batch_in["ns"], lambda e: e["dir"] == PEER_OUT and at_seq(e))
        report_in = coord.after(batch["ns"], _from(relay, at_seq))
        if report_out is None or report_in is None:
            # It did not report at the seq: the others' reports had committed it before
            # its watermark reached it (a member slower than the others votes no more).
            continue
        trigger = events.last_before(report_out["ns"], lambda e: e["dir"] == PEER_IN)
        members.append(
            {
                "relay": relay,
                "batch_in": batch_in["ns"],
                "report_out": report_out["ns"],
                "report_in": report_in["ns"],
                "trigger": (
                    "none"
                    if trigger is None
                    else "the TxBatch"
                    if trigger is batch_in
                    else f"{trigger['kind']} from relay {trigger['peer']}"
                ),
            }
        )
    if not members:
        return None
    first_report = min(members, key=lambda m: m["report_in"])
    stamps = {
        "sent": sent_ns,
        "client_in": took["ns"],
        "batch_out": batch["ns"],
        "batch_in": min(taken),
        "report_out": first_report["report_out"],
        "report_in": first_report["report_in"],
        "reply_out": reply["ns"],
        "reply": reply_ns,
    }
    reader = traces[READER].after(
        batch["ns"], lambda e: e["dir"] == CLIENT_OUT and e["kind"] == "ReadResp" and _holds(seq)(e)
    )
    if reader is not None and delivered_ns is not None:
        stamps["read_out"] = reader["ns"]
        stamps["delivered"] = delivered_ns
    return {"seq": seq, "stamps": stamps, "members": members}


def _stage_rows(
    paths: Sequence[dict[str, Any]], stages: Sequence[tuple[str, str, int]], start: str
) -> list[dict[str, Any]]:
    rows = []
    previous = start
    for name, what, one_way in stages:
        deltas = sorted(
            (p["stamps"][name] - p["stamps"][previous]) / 1_000
            for p in paths
            if name in p["stamps"]
        )
        rows.append(
            {
                "stage": name,
                "what": what,
                "one_way": one_way,
                "samples": len(deltas),
                "p50_us": _percentile(deltas, 50) if deltas else None,
                "p90_us": _percentile(deltas, 90) if deltas else None,
            }
        )
        previous = name
    return rows


def analyse(
    traces: dict[int, list[dict[str, Any]]],
    client: Sequence[tuple[int, int, int | None]],
) -> dict[str, Any]:
    """The per-stage figures of `client`'s transactions (sent ns, reply ns, delivered ns)
    in the relays' `traces`."""
    indexed = {relay: _Events(events) for relay, events in traces.items()}
    paths = [
        p
        for sent, reply, delivered in client
        if (p := _path_of_one(indexed, sent, reply, delivered)) is not None
    ]
    totals = sorted((p["stamps"]["reply"] - p["stamps"]["sent"]) / 1_000 for p in paths)
    delivered = sorted(
        (p["stamps"]["delivered"] - p["stamps"]["sent"]) / 1_000
        for p in paths
        if "delivered" in p["stamps"]
    )
    triggers = Counter(m["trigger"] for p in paths for m in p["members"])
    frames: Counter[str] = Counter()
    if client:
        start, end = client[0][0], client[-1][1]
        for events in traces.values():
            frames.update(
                e["kind"] for e in events if e["dir"] == PEER_OUT and start <= e["ns"] <= end
            )
    second_report = sorted(
        (max(m["report_in"] for m in p["members"]) - p["stamps"]["report_in"]) / 1_000
        for p in paths
        if len(p["members"]) > 1
    )
    return {
        "transactions": len(client),
        "traced": len(paths),
        "stages": _stage_rows(paths, STAGES, "sent"),
        "delivery_stages": _stage_rows(paths, DELIVERY_STAGES, "sent"),
        "commit_p50_us": _percentile(totals, 50) if totals else None,
        "commit_p90_us": _percentile(totals, 90) if totals else None,
        "delivery_p50_us": _percentile(delivered, 50) if delivered else None,
        "second_report_after_first_p50_us": (
            _percentile(second_report, 50) if second_report else None
        ),
        "member_triggers": dict(triggers.most_common()),
        # Frames the relays published per transaction, by kind (each reaches 2 peers).
        "frames_per_tx": {k: round(v / len(client), 2) for k, v in frames.most_common()},
        "one_way_delays": sum(one_way for _, _, one_way in STAGES),
    }


def run_hops(options: BenchOptions, *, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Trace `options.duration_s` of one-in-flight transactions of the first size."""
    say = log or (lambda text: None)
    workdir = Path(tempfile.mkdtemp(prefix="relay-bench-hops-"))
    keep = False
    size = options.sizes[0]
    limit = QUICK_HOPS_MAX_TX if options.quick else HOPS_MAX_TX
    mesh = _TracedMesh(
        _write_topology(workdir),
        log_level="warning",
        log_dir=workdir / "logs",
        directory=workdir / "traces",
    )
    client: list[tuple[int, int, int | None]] = []
    try:
        say("starting the 3-relay mesh with hop traces ...")
        mesh.start(START_TIMEOUT_S)
        ctx = _context(options, mesh)
        run_id = next(ctx.run_ids)
        sent: list[tuple[int, int, int]] = []  # index, sent ns, reply ns
        say(f"one in flight, {size} B, {options.duration_s} s (at most {limit} tx)")
        with one_at_a_time(ctx, run_id, size) as (deliveries, producer, pad):
            assert deliveries is not None  # (it consumes)
            deadline = time.perf_counter() + options.duration_s
            i = 0
            while i < limit and time.perf_counter() < deadline:
                value = _payload(run_id, i, size, pad)
                started = time.perf_counter_ns()
                try:
                    producer.send(STREAM, value)
                except ClientError:
                    pass
                else:
                    sent.append((i, started, time.perf_counter_ns()))
                i += 1
            wait_until = time.perf_counter() + 5.0
            while len(deliveries.arrivals) < len(sent) and time.perf_counter() < wait_until:
                time.sleep(0.01)
            arrivals = dict(deliveries.arrivals)
        for index, started, answered in sent:
            at = arrivals.get(index)
            client.append((started, answered, None if at is None else int(at * 1e9)))
    except BaseException:
        keep = True
        raise
    finally:
        mesh.stop()
        traces = {
            r: read_trace(mesh.trace_path(r)) for r in (0, 1, 2) if mesh.trace_path(r).exists()
        }
        if keep:
            say(f"relay logs and traces kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if len(traces) != 3:
        raise RuntimeError(f"only relays {sorted(traces)} wrote their hop trace")
    report = analyse(traces, client)
    report["config"] = {"size": size, "duration_s": options.duration_s, "relays": 3}
    return report


def print_hops_report(report: dict[str, Any]) -> None:
    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}"

    print(
        f"one transaction in flight, {report['config']['size']} B: "
        f"{report['traced']} of {report['transactions']} transactions traced"
    )
    print(f"{'stage':<11} {'p50 us':>8} {'p90 us':>8}  what")
    for row in (*report["stages"], *report["delivery_stages"]):
        hop = " (one-way)" if row["one_way"] else ""  # the stages hold one at most
        print(
            f"{row['stage']:<11} {cell(row['p50_us']):>8} {cell(row['p90_us']):>8}  "
            f"{row['what']}{hop}"
        )
    print(
        f"commit p50/p90 {cell(report['commit_p50_us'])}/{cell(report['commit_p90_us'])} us, "
        f"delivery p50 {cell(report['delivery_p50_us'])} us; "
        f"{report['one_way_delays']} one-way delays on the commit path; the second member's "
        f"Reports came {cell(report['second_report_after_first_p50_us'])} us (p50) after the first"
    )
    triggers = ", ".join(f"{k}: {v}" for k, v in report["member_triggers"].items())
    print(f"what a member heard last before reporting: {triggers}")
    frames = report["frames_per_tx"]
    listed = ", ".join(f"{k} {v}" for k, v in frames.items())
    print(f"frames published per transaction (all relays): {sum(frames.values()):.2f} ({listed})")
