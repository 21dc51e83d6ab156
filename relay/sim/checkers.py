"""Checkers: pure functions over a `History`, each returning violations (empty = ok).

Safety checkers hold at every moment; `acknowledged_delivered` and `liveness` assume the run
ended with a fault-free liveness phase and a quiet period (see `PhaseInfo`).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

from relay.core.messages import Transaction
from relay.sim.history import COMMITTED, REJECTED, DelivEntry, History, OpKey, PhaseInfo

Canonical = dict[str, dict[int, Transaction]]  # stream -> seq -> tx


def _fmt_tx(tx: Transaction) -> str:
    return f"{tx.producer_id.decode(errors='replace')}#{tx.producer_seq}"


def _relay_logs(history: History) -> Iterator[tuple[str, str, list[DelivEntry]]]:
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


def _consumer_logs(history: History) -> Iterator[tuple[str, str, list[DelivEntry]]]:
    for cid in sorted(history.consumers):
        log = history.consumers[cid]
        yield f"consumer {cid}", log.stream, log.received


def _all_logs(history: History) -> Iterator[tuple[str, str, list[DelivEntry]]]:
    yield from _relay_logs(history)
    yield from _consumer_logs(history)


def canonical(history: History) -> tuple[Canonical, list[str]]:
    """The timeline every log must be a gap-free piece of, and the conflicts found building
    it: a seq mapped to two different transactions, or one transaction at two seqs."""
    canon: Canonical = {}
    where: dict[OpKey, tuple[str, int]] = {}
    problems: list[str] = []
    seen_conflicts: set[tuple[str, int]] = set()
    seen_moves: set[OpKey] = set()
    for label, stream, log in _all_logs(history):
        timeline = canon.setdefault(stream, {})
        for seq, tx in log:
            known = timeline.get(seq)
            if known is None:
                timeline[seq] = tx
            elif known != tx and (stream, seq) not in seen_conflicts:
                seen_conflicts.add((stream, seq))
                problems.append(
                    f"divergence: {stream} seq {seq} is {_fmt_tx(known)} elsewhere but "
                    f"{_fmt_tx(tx)} at {label}"
                )
            key = (tx.producer_id, tx.producer_seq)
            placed = where.get(key)
            if placed is None:
                where[key] = (stream, seq)
            elif placed != (stream, seq) and key not in seen_moves:
                seen_moves.add(key)
                problems.append(
                    f"divergence: {_fmt_tx(tx)} at {placed[0]} seq {placed[1]} elsewhere but "
                    f"at {stream} seq {seq} at {label}"
                )
    return canon, problems


def no_reorder_no_duplicate(history: History) -> list[str]:
    out: list[str] = []
    for label, stream, log in _relay_logs(history):
        seqs: set[int] = set()
        keys: set[OpKey] = set()
        prev = None
        for seq, tx in log:
            key = (tx.producer_id, tx.producer_seq)
            if seq in seqs:
                out.append(f"duplicate: {label} delivered {stream} seq {seq} twice")
            elif prev is not None and seq < prev:
                out.append(f"reorder: {label} delivered {stream} seq {seq} after {prev}")
            if key in keys:
                out.append(f"duplicate: {label} delivered {stream} {_fmt_tx(tx)} twice")
            seqs.add(seq)
            keys.add(key)
            prev = seq
    return out


def timelines_agree(history: History) -> list[str]:
    canon, out = canonical(history)
    index = {stream: {seq: i for i, seq in enumerate(sorted(tl))} for stream, tl in canon.items()}
    for label, stream, log in _relay_logs(history):
        out.extend(_gaps(label, stream, log, index[stream] if log else {}))
    for label, stream, log in _consumer_logs(history):
        prev = None
        keys: set[OpKey] = set()
        for seq, tx in log:
            if prev is not None and seq <= prev:
                kind = "duplicate" if seq == prev else "reorder"
                out.append(f"{kind}: {label} received {stream} seq {seq} after {prev}")
            key = (tx.producer_id, tx.producer_seq)
            if key in keys:
                out.append(f"duplicate: {label} received {stream} {_fmt_tx(tx)} twice")
            keys.add(key)
            prev = seq
        out.extend(_gaps(label, stream, log, index[stream] if log else {}))
    return out


def _gaps(label: str, stream: str, log: list[DelivEntry], index: dict[int, int]) -> list[str]:
    out: list[str] = []
    order = sorted(index, key=index.__getitem__)
    for (a, _), (b, _) in pairwise(log):
        if b > a and index[b] - index[a] > 1:
            missing = order[index[a] + 1 : index[b]]
            out.append(
                f"gap: {label} {stream} went from seq {a} to {b}, skipping {len(missing)} "
                f"committed entr{'y' if len(missing) == 1 else 'ies'} (first {missing[0]})"
            )
    return out


def nothing_invented(history: History) -> list[str]:
    out: list[str] = []
    reported: set[tuple[str, int]] = set()
    for label, stream, log in _all_logs(history):
        for seq, tx in log:
            produced = history.produced.get((tx.producer_id, tx.producer_seq))
            if produced == (stream, tx) or (stream, seq) in reported:
                continue
            reported.add((stream, seq))
            if produced is None:
                out.append(
                    f"invented: {label} {stream} seq {seq} holds {_fmt_tx(tx)}, never produced"
                )
            else:
                out.append(
                    f"invented: {label} {stream} seq {seq} holds {_fmt_tx(tx)} unlike the "
                    f"produced one (stream {produced[0]}, key {produced[1].key!r}, value "
                    f"{produced[1].value[:40]!r} vs {tx.key!r}, {tx.value[:40]!r})"
                )
    return out


def no_rejected_delivered(history: History) -> list[str]:
    rejected = {key for key, f in history.finals.items() if f.outcome == REJECTED}
    if not rejected:
        return []
    out: list[str] = []
    reported: set[OpKey] = set()
    for label, stream, log in _all_logs(history):
        for seq, tx in log:
            key = (tx.producer_id, tx.producer_seq)
            if key in rejected and key not in reported:
                reported.add(key)
                out.append(f"rejected delivered: {_fmt_tx(tx)} at {label} {stream} seq {seq}")
    return out


def committed_seq_matches(history: History) -> list[str]:
    canon, _ = canonical(history)
    placed: dict[OpKey, int] = {}
    for stream in sorted(canon):
        for seq, tx in canon[stream].items():
            placed.setdefault((tx.producer_id, tx.producer_seq), seq)
    out: list[str] = []
    for key in sorted(history.finals):
        final = history.finals[key]
        if final.outcome != COMMITTED:
            continue
        name = _fmt_tx(final.tx)
        if len(set(final.committed_seqs)) > 1:
            out.append(
                f"committed twice: {name} answered committed at seqs "
                f"{sorted(set(final.committed_seqs))}"
            )
        at = canon.get(final.stream, {}).get(final.seq)
        if at is not None and at != final.tx:
            out.append(
                f"wrong seq: {name} committed at {final.stream} seq {final.seq}, "
                f"which holds {_fmt_tx(at)}"
            )
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
        name = _fmt_tx(final.tx)
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
                f"not committed: {_fmt_tx(final.tx)} to {final.stream} issued at "
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


SAFETY_CHECKERS = (
    no_reorder_no_duplicate,
    timelines_agree,
    nothing_invented,
    no_rejected_delivered,
    committed_seq_matches,
)


def check_all(history: History, phase: PhaseInfo) -> list[str]:
    out: list[str] = [f"anomaly: {a}" for a in history.anomalies]
    for checker in SAFETY_CHECKERS:
        out.extend(checker(history))
    if phase.check_liveness:
        out.extend(acknowledged_delivered(history))
        out.extend(liveness(history, phase))
    return out
