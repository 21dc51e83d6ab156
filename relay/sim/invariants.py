"""The guarantees of docs/protocol.md section 1, as checks over what the harnesses observed.

Every harness that runs real cores checks these same invariants: the simulator's checkers
(relay/sim/checkers.py, over a run's history), the explorer (relay/sim/explore, in every
state it reaches) and the scenario interpreter (relay/sim/script.py, after every command).
Each harness maps its records onto plain values: labelled logs of `(seq, transaction)`
entries, the stream's timeline as `{seq: transaction}`, the producers' answers. Each check
returns a list of violations (empty: it holds); a violation's first word names its kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise

from relay.core.messages import Entry, Transaction

Key = tuple[bytes, int]  # (producer id, producer seq)
Timeline = dict[int, Transaction]  # seq -> transaction: one stream's committed timeline
# (label, stream, entries in the order observed)
LabelledLog = tuple[str, str, Sequence[Entry]]


def key_of(tx: Transaction) -> Key:
    return (tx.producer_id, tx.producer_seq)


def describe(tx: Transaction) -> str:
    return f"{tx.producer_id.decode(errors='replace')}#{tx.producer_seq}"


# --- G1: one timeline ------------------------------------------------------------------------


def one_timeline(logs: Iterable[LabelledLog]) -> tuple[dict[str, Timeline], list[str]]:
    """Merge the logs of each stream into its timeline: every log must be a piece of it.
    Violations: a seq that holds two transactions, or one transaction at two seqs
    (`divergence:`), each reported once."""
    timelines: dict[str, Timeline] = {}
    where: dict[Key, tuple[str, int]] = {}
    problems: list[str] = []
    seen_conflicts: set[tuple[str, int]] = set()
    seen_moves: set[Key] = set()
    for label, stream, log in logs:
        timeline = timelines.setdefault(stream, {})
        for seq, tx in log:
            known = timeline.get(seq)
            if known is None:
                timeline[seq] = tx
            elif known != tx and (stream, seq) not in seen_conflicts:
                seen_conflicts.add((stream, seq))
                problems.append(
                    f"divergence: {stream} seq {seq} is {describe(known)} elsewhere but "
                    f"{describe(tx)} at {label}"
                )
            key = key_of(tx)
            placed = where.get(key)
            if placed is None:
                where[key] = (stream, seq)
            elif placed != (stream, seq) and key not in seen_moves:
                seen_moves.add(key)
                problems.append(
                    f"divergence: {describe(tx)} at {placed[0]} seq {placed[1]} elsewhere but "
                    f"at {stream} seq {seq} at {label}"
                )
    return timelines, problems


def in_order(label: str, stream: str, log: Sequence[Entry], verb: str = "delivered") -> list[str]:
    """One log: seqs strictly increase, and no transaction comes twice (`reorder:`,
    `duplicate:`)."""
    out: list[str] = []
    seqs: set[int] = set()
    keys: set[Key] = set()
    prev: int | None = None
    for seq, tx in log:
        if seq in seqs:
            out.append(f"duplicate: {label} {verb} {stream} seq {seq} twice")
        elif prev is not None and seq < prev:
            out.append(f"reorder: {label} {verb} {stream} seq {seq} after {prev}")
        key = key_of(tx)
        if key in keys:
            out.append(f"duplicate: {label} {verb} {stream} {describe(tx)} twice")
        seqs.add(seq)
        keys.add(key)
        prev = seq
    return out


class TimelineIndex:
    """A timeline's seqs in order, and each seq's position: for `gap_free`."""

    def __init__(self, timeline: Timeline) -> None:
        self.order = sorted(timeline)
        self.position = {seq: i for i, seq in enumerate(self.order)}


def gap_free(label: str, stream: str, log: Sequence[Entry], index: TimelineIndex) -> list[str]:
    """Consecutive entries of a log are neighbours in the timeline (`gap:`); every entry
    of the log must be in it."""
    position = index.position
    out: list[str] = []
    for (a, _), (b, _) in pairwise(log):
        if b > a and position[b] - position[a] > 1:
            missing = index.order[position[a] + 1 : position[b]]
            out.append(
                f"gap: {label} {stream} went from seq {a} to {b}, skipping {len(missing)} "
                f"committed entr{'y' if len(missing) == 1 else 'ies'} (first {missing[0]})"
            )
    return out


def agree_over(
    logs: Mapping[int, Sequence[Entry]],
    committed: Mapping[int, int] | None = None,
    bases: Mapping[int, int] | None = None,
    label: str = "delivered",
) -> list[str]:
    """G1 between relays: each log's seqs strictly increase, and any two logs hold the same
    entries over their common range: seqs above both bases and at or below the lower of
    the two committed points (default: each log's last seq). So a log missing an entry the
    other has in that range, or holding another transaction at a seq, is a violation."""
    problems: list[str] = []
    top: dict[int, int] = {}
    for r, log in logs.items():
        for (a, _), (b, _) in pairwise(log):
            if b <= a:
                problems.append(f"{label} log of relay {r}: seq {b} after {a} (not increasing)")
                break
        if committed is not None and r in committed:
            top[r] = committed[r]
        else:
            top[r] = log[-1][0] if log else -1
    rids = sorted(logs)
    for i, a in enumerate(rids):
        for b in rids[i + 1 :]:
            hi = min(top[a], top[b])
            lo = max(bases.get(a, -1), bases.get(b, -1)) if bases else -1
            la = [e for e in logs[a] if lo < e[0] <= hi]
            lb = [e for e in logs[b] if lo < e[0] <= hi]
            if la == lb:
                continue
            k = next(
                (j for j, (x, y) in enumerate(zip(la, lb, strict=False)) if x != y),
                min(len(la), len(lb)),
            )
            ea = f"({la[k][0]}, {describe(la[k][1])})" if k < len(la) else "nothing"
            eb = f"({lb[k][0]}, {describe(lb[k][1])})" if k < len(lb) else "nothing"
            problems.append(
                f"{label} logs of relays {a} and {b} disagree in ({lo}, {hi}]: "
                f"entry {k} is {ea} at relay {a} but {eb} at relay {b}"
            )
    return problems


# --- nothing invented, nothing rejected delivered ---------------------------------------------


def nothing_invented(
    logs: Iterable[LabelledLog], produced: Mapping[Key, tuple[str, Transaction]]
) -> list[str]:
    """Every logged transaction is one a producer sent to that stream (`invented:`)."""
    out: list[str] = []
    reported: set[tuple[str, int]] = set()
    for label, stream, log in logs:
        for seq, tx in log:
            found = produced.get(key_of(tx))
            if found == (stream, tx) or (stream, seq) in reported:
                continue
            reported.add((stream, seq))
            if found is None:
                out.append(
                    f"invented: {label} {stream} seq {seq} holds {describe(tx)}, never produced"
                )
            else:
                out.append(
                    f"invented: {label} {stream} seq {seq} holds {describe(tx)} unlike the "
                    f"produced one (stream {found[0]}, key {found[1].key!r}, value "
                    f"{found[1].value[:40]!r} vs {tx.key!r}, {tx.value[:40]!r})"
                )
    return out


def rejected_not_delivered(logs: Iterable[LabelledLog], rejected: set[Key]) -> list[str]:
    """A producer told `rejected` never sees that transaction delivered (G3)."""
    if not rejected:
        return []
    out: list[str] = []
    reported: set[Key] = set()
    for label, stream, log in logs:
        for seq, tx in log:
            key = key_of(tx)
            if key in rejected and key not in reported:
                reported.add(key)
                out.append(f"rejected delivered: {describe(tx)} at {label} {stream} seq {seq}")
    return out


# --- G3: committed answers ---------------------------------------------------------------------


def committed_answers(
    name: str, tx: Transaction, seqs: Sequence[int], timeline: Timeline, *, must_hold: bool
) -> list[str]:
    """The `committed(seq)` answers a producer got for `tx`: they all name the same seq
    (`committed twice:`), and the timeline holds `tx` there (`wrong seq:`; with
    `must_hold`, also when the timeline holds nothing there)."""
    out: list[str] = []
    if len(set(seqs)) > 1:
        out.append(f"committed twice: {name} answered committed at seqs {sorted(set(seqs))}")
    for seq in dict.fromkeys(seqs):
        at = timeline.get(seq)
        if at is None:
            if must_hold:
                out.append(f"wrong seq: {name} committed at seq {seq}, where nothing committed")
        elif at != tx:
            out.append(f"wrong seq: {name} committed at seq {seq}, which holds {describe(at)}")
    return out


def placed_at(timelines: Mapping[str, Timeline]) -> dict[Key, int]:
    """Where each transaction sits in its stream's timeline (its first seq)."""
    placed: dict[Key, int] = {}
    for stream in sorted(timelines):
        for seq, tx in timelines[stream].items():
            placed.setdefault(key_of(tx), seq)
    return placed
