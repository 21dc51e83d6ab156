"""Checkers: pure functions over a `History`, each returning violations (empty = ok).

They map the history onto the shared invariants (relay/sim/invariants.py); the last two
are the simulator's own: they need the whole run (its phases and final states).

Safety checkers hold at every moment; `acknowledged_delivered` and `liveness` assume the run
ended with a fault-free liveness phase and a quiet period (see `PhaseInfo`).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

from relay.core.messages import Transaction
from relay.sim import invariants
from relay.sim.history import COMMITTED, REJECTED, History, PhaseInfo
from relay.sim.invariants import LabelledLog

Canonical = dict[str, dict[int, Transaction]]  # stream -> seq -> tx


def _relay_logs(history: History) -> Iterator[LabelledLog]:
    """(label, stream, log) for every piece of a relay's delivered history, in a fixed
    order: one per incarnation, split again where the relay restarted from a base."""
    for relay, inc in sorted(history.delivered):
        per_stream = history.delivered[(relay, inc)]
        for stream in sorted(per_stream):
            log = per_stream[stream]
            cuts = [0, *history.rebases.get((relay, inc, stream), []), len(log)]
            for part, (a, b) in enumerate(pairwise(sorted(set(cuts)))):
                suffix = f" part {part}" if len(cuts) > 3 else ""
                yield f"relay {relay}/{inc}{suffix}", stream, log[a:b]


def _consumer_logs(history: History) -> Iterator[LabelledLog]:
    for cid in sorted(history.consumers):
        log = history.consumers[cid]
        yield f"consumer {cid}", log.stream, log.received


def _all_logs(history: History) -> Iterator[LabelledLog]:
    yield from _relay_logs(history)
    yield from _consumer_logs(history)


def canonical(history: History) -> tuple[Canonical, list[str]]:
    """The timeline every log must be a gap-free piece of, and the conflicts found building
    it: a seq mapped to two different transactions, or one transaction at two seqs."""
    return invariants.one_timeline(_all_logs(history))


def no_reorder_no_duplicate(history: History) -> list[str]:
    out: list[str] = []
    for label, stream, log in _relay_logs(history):
        out.extend(invariants.in_order(label, stream, log))
    return out


def timelines_agree(history: History) -> list[str]:
    canon, out = canonical(history)
    index = {stream: invariants.TimelineIndex(tl) for stream, tl in canon.items()}
    for label, stream, log in _relay_logs(history):
        if log:
            out.extend(invariants.gap_free(label, stream, log, index[stream]))
    for label, stream, log in _consumer_logs(history):
        out.extend(invariants.in_order(label, stream, log, verb="received"))
        if log:
            out.extend(invariants.gap_free(label, stream, log, index[stream]))
    return out


def nothing_invented(history: History) -> list[str]:
    return invariants.nothing_invented(_all_logs(history), history.produced)


def no_rejected_delivered(history: History) -> list[str]:
    """Neither a relay's final answer nor the client's conclusion `rejected` is ever
    followed by a delivery of that transaction."""
    rejected = {
        key
        for key, f in history.finals.items()
        if f.outcome == REJECTED or f.client_outcome == REJECTED
    }
    return invariants.rejected_not_delivered(_all_logs(history), rejected)


def client_conclusions(history: History) -> list[str]:
    """The client engine concluded `committed(seq)` only from a relay's committed answer at
    that seq, and `rejected` only when no relay answered committed."""
    out: list[str] = []
    for key in sorted(history.finals):
        final = history.finals[key]
        name = invariants.describe(final.tx)
        if final.client_outcome == COMMITTED and final.client_seq not in final.committed_seqs:
            out.append(
                f"client: {name} concluded committed({final.client_seq}), which no relay "
                f"answered (answers: {final.outcome} {final.committed_seqs})"
            )
        elif final.client_outcome == REJECTED and final.outcome == COMMITTED:
            out.append(f"client: {name} concluded rejected, but a relay answered committed")
    return out


def committed_seq_matches(history: History) -> list[str]:
    canon, _ = canonical(history)
    placed = invariants.placed_at(canon)
    out: list[str] = []
    for key in sorted(history.finals):
        final = history.finals[key]
        if final.outcome != COMMITTED:
            continue
        name = invariants.describe(final.tx)
        answers = final.committed_seqs or [final.seq]
        timeline = canon.get(final.stream, {})
        out.extend(invariants.committed_answers(name, final.tx, answers, timeline, must_hold=False))
        where = placed.get(key)
        if where is not None and where != final.seq:
            out.append(f"wrong seq: {name} committed at seq {final.seq} but delivered at {where}")
    return out


def acknowledged_delivered(history: History) -> list[str]:
    """Every COMMITTED answer is in the canonical timeline and in the final log of every up,
    joined member whose current incarnation's log starts at or below it (a relay starting
    with empty memory joins at its peers' committed point and need not hold older ones)."""
    canon, _ = canonical(history)
    out: list[str] = []
    seqsets: dict[tuple[int, int, str], set[int]] = {}
    for key in sorted(history.finals):
        final = history.finals[key]
        if final.outcome != COMMITTED:
            continue
        name = invariants.describe(final.tx)
        if canon.get(final.stream, {}).get(final.seq) is None:
            out.append(
                f"lost: {name} committed at {final.stream} seq {final.seq} "
                "is in no relay's timeline"
            )
        for relay in history.members.get(final.stream, ()):
            rf = history.relay_finals.get(relay)
            if rf is None or not rf.up or not rf.joined.get(final.stream, False):
                continue
            log = history.log_since_rebase(relay, rf.incarnation, final.stream)
            if not log or log[0][0] > final.seq:
                continue  # this incarnation joined after it: it need not hold it
            ks = (relay, rf.incarnation, final.stream)
            if ks not in seqsets:
                seqsets[ks] = {s for s, _ in log}
            if final.seq not in seqsets[ks]:
                out.append(
                    f"missing: {name} committed at {final.stream} seq {final.seq} "
                    f"is not in relay {relay}/{rf.incarnation}'s delivered log"
                )
    return out


def liveness(history: History, phase: PhaseInfo) -> list[str]:
    out: list[str] = []
    for key in sorted(history.finals):
        final = history.finals[key]
        settling = final.issued_ms < phase.safety_end_ms + phase.settle_ms
        if settling and final.outcome == REJECTED:
            continue  # a definite answer; see PhaseInfo.settle_ms
        if phase.safety_end_ms <= final.issued_ms < phase.liveness_end_ms and (
            final.outcome != COMMITTED
        ):
            out.append(
                f"not committed: {invariants.describe(final.tx)} to {final.stream} issued at "
                f"{final.issued_ms} ms (liveness phase) ended {final.outcome}"
            )
    bound = phase.safety_end_ms + phase.heal_bound_ms
    state: dict[tuple[int, str], tuple[int, bool, bool]] = {}  # last sample at or before bound
    late_bad: dict[tuple[int, str], int] = {}
    for s in history.fence_samples:
        ks = (s.relay, s.stream)
        if s.t <= bound:
            state[ks] = (s.t, s.fenced, s.joined)
        elif (s.fenced or not s.joined) and ks not in late_bad:
            late_bad[ks] = s.t
    for ks in sorted(state):
        _, fenced, joined = state[ks]
        if fenced or not joined:
            what = "fenced" if fenced else "not joined"
            out.append(
                f"stuck: relay {ks[0]} still {what} on {ks[1]} at {bound} ms "
                f"({phase.heal_bound_ms} ms after healing)"
            )
    for ks in sorted(late_bad):
        if ks in state and (state[ks][1] or not state[ks][2]):
            continue  # already reported
        out.append(
            f"relapse: relay {ks[0]} fenced or unjoined on {ks[1]} at {late_bad[ks]} ms, "
            "after healing"
        )
    for stream in sorted(history.members):
        points: dict[int, int] = {}
        for relay in history.members[stream]:
            rf = history.relay_finals.get(relay)
            if rf is None or not rf.up:
                out.append(f"down: relay {relay} is not up at the end")
                continue
            if rf.fenced.get(stream, False) or not rf.joined.get(stream, False):
                out.append(f"stuck: relay {relay} ends fenced or unjoined on {stream}")
            points[relay] = rf.committed_point.get(stream, -1)
        if len(set(points.values())) > 1:
            out.append(
                f"unsettled: members of {stream} end at different committed points "
                + ", ".join(f"{r}:{p}" for r, p in sorted(points.items()))
            )
    return sorted(set(out), key=out.index)


def spooled_acknowledged(history: History) -> list[str]:
    """Every COMMITTED answer is in some relay's spool (5.14), so the store can have it."""
    out: list[str] = []
    for key in sorted(history.finals):
        final = history.finals[key]
        if final.outcome != COMMITTED:
            continue
        if not any(final.seq in per.get(final.stream, ()) for per in history.spooled.values()):
            out.append(
                f"unspooled: {invariants.describe(final.tx)} committed at {final.stream} "
                f"seq {final.seq} is in no relay's spool"
            )
    return out


SAFETY_CHECKERS = (
    no_reorder_no_duplicate,
    timelines_agree,
    nothing_invented,
    no_rejected_delivered,
    committed_seq_matches,
    client_conclusions,
    spooled_acknowledged,
)


def check_all(history: History, phase: PhaseInfo) -> list[str]:
    out: list[str] = [f"anomaly: {a}" for a in history.anomalies]
    for checker in SAFETY_CHECKERS:
        out.extend(checker(history))
    if phase.check_liveness:
        out.extend(acknowledged_delivered(history))
        out.extend(liveness(history, phase))
    return out
