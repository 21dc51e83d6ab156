"""The history check of a fault run (`relay chaos`): pure functions over what was seen.

What went in: every produce attempt with its outcome (`Attempt`: committed with its seq,
unknown, fenced, rejected). What came out: each relay's committed history of each stream
as read from it alone after the run (`RelayHistory`), and what the live consumers yielded
during the run (`ConsumerLog`). `check` compares them:

- every acknowledged write appears exactly once, at the seq its producer was told, on every
  relay whose history covers that seq (a relay restarted with an empty memory holds only a
  suffix: it covers the seqs from its first record on; one restarted after the last write
  holds nothing, which the harness's convergence wait on committed points vouches for),
  and on at least one relay: a write
  held nowhere is `lost`. Where no relay covers a seq any more (each was restarted since;
  without a store nothing keeps the old history) the live consumers' logs are the
  evidence; a write older than all of them is `unverified`, not lost;
- every relay holds the same write at every seq it shares with the others, and no relay
  lacks a seq the others hold inside its own range: where relays disagree the minority
  (every side on a tie) is `divergent`, as is a relay still missing acknowledged writes
  after its last record (lagging after the convergence wait) and a live consumer that
  yielded an order, or skipped a write, the relays' majority does not show;
- a write appearing twice (two seqs) on a relay or to a consumer is a duplicate;
- nothing appears that no producer wrote, that differs from what was written, or whose
  producer was told it definitely failed (fenced, rejected): `phantom`;
- unknown outcomes are counted; they may or may not appear (`unknown_appeared`).

`commit_gaps` and `recovery_times` give the availability figures from the times of the
acknowledgements and of the heals. Times are seconds on one monotonic clock.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "COMMITTED",
    "DEFINITE_FAILURES",
    "FENCED",
    "REJECTED",
    "UNKNOWN",
    "Attempt",
    "ConsumerLog",
    "HistoryRecord",
    "RelayHistory",
    "Verdict",
    "check",
    "commit_gaps",
    "recovery_times",
]

COMMITTED = "committed"
UNKNOWN = "unknown"  # no definite answer (also a client failure we could not classify)
FENCED = "fenced"  # every relay asked answered fenced: never written
REJECTED = "rejected"  # a definite no: never delivered
DEFINITE_FAILURES = frozenset({FENCED, REJECTED})
MAX_PROBLEMS = 20  # problem descriptions kept per check (the counts are always complete)

WriteId = tuple[bytes, int]  # (producer id, producer seq)


@dataclass(frozen=True)
class Attempt:
    """One produce: what was sent and what the producer was told, when."""

    stream: str
    producer_id: bytes
    producer_seq: int
    value: bytes
    started_s: float
    ended_s: float
    outcome: str  # COMMITTED, UNKNOWN, FENCED or REJECTED
    seq: int | None = None  # the committed seq

    @property
    def write(self) -> WriteId:
        return (self.producer_id, self.producer_seq)


@dataclass(frozen=True)
class HistoryRecord:
    seq: int
    producer_id: bytes
    producer_seq: int
    value: bytes

    @property
    def write(self) -> WriteId:
        return (self.producer_id, self.producer_seq)


@dataclass(frozen=True)
class RelayHistory:
    """A relay's committed history of one stream, in the order it was read."""

    relay: int
    stream: str
    records: tuple[HistoryRecord, ...]


@dataclass(frozen=True)
class ConsumerLog:
    """What one live consumer of a stream yielded, in order."""

    name: str
    stream: str
    records: tuple[HistoryRecord, ...]


@dataclass
class Verdict:
    attempts: int = 0
    committed: int = 0
    unknown: int = 0
    fenced: int = 0
    rejected: int = 0
    unknown_appeared: int = 0  # unknown outcomes found in the history after all
    lost: int = 0
    unverified: int = 0  # acknowledged, but older than what any relay or consumer still shows
    duplicates: int = 0
    phantom: int = 0
    divergent: list[str] = field(default_factory=list)  # "relay 2", "consumer c1"
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicates or self.phantom or self.divergent)

    def problem(self, text: str) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)


def _label(relay: int) -> str:
    return f"relay {relay}"


def check(
    attempts: Iterable[Attempt],
    histories: Iterable[RelayHistory],
    consumers: Iterable[ConsumerLog] = (),
) -> Verdict:
    """Check the run's history (see the module doc)."""
    attempts = list(attempts)
    verdict = Verdict(attempts=len(attempts))
    outcomes = Counter(a.outcome for a in attempts)
    verdict.committed = outcomes[COMMITTED]
    verdict.unknown = outcomes[UNKNOWN]
    verdict.fenced = outcomes[FENCED]
    verdict.rejected = outcomes[REJECTED]
    by_stream: dict[str, list[RelayHistory]] = defaultdict(list)
    for history in histories:
        by_stream[history.stream].append(history)
    attempts_by_stream: dict[str, list[Attempt]] = defaultdict(list)
    for attempt in attempts:
        attempts_by_stream[attempt.stream].append(attempt)
    consumers_by_stream: dict[str, list[ConsumerLog]] = defaultdict(list)
    for log in consumers:
        consumers_by_stream[log.stream].append(log)
    divergent: set[str] = set()
    for stream in sorted(set(by_stream) | set(attempts_by_stream) | set(consumers_by_stream)):
        _check_stream(
            stream,
            attempts_by_stream[stream],
            by_stream[stream],
            consumers_by_stream[stream],
            verdict,
            divergent,
        )
    verdict.divergent = sorted(divergent)
    return verdict


def _check_stream(
    stream: str,
    attempts: list[Attempt],
    histories: list[RelayHistory],
    consumers: list[ConsumerLog],
    verdict: Verdict,
    divergent: set[str],
) -> None:
    written = {a.write: a for a in attempts}
    # One relay: its own order, its duplicates, its phantoms.
    held: dict[int, dict[int, HistoryRecord]] = {}
    span: dict[int, tuple[int, int]] = {}
    duplicated: set[WriteId] = set()
    phantoms: set[WriteId] = set()
    for history in histories:
        seqs: dict[int, HistoryRecord] = {}
        copies: Counter[WriteId] = Counter()
        previous = -1
        for record in history.records:
            if record.seq <= previous:
                divergent.add(_label(history.relay))
                verdict.problem(
                    f"{stream}: relay {history.relay} holds seq {record.seq} after {previous}"
                )
            previous = max(previous, record.seq)
            seqs[record.seq] = record
            copies[record.write] += 1
            _phantom(stream, f"relay {history.relay}", record, written, phantoms, verdict)
        for write, n in copies.items():
            if n > 1 and write not in duplicated:
                duplicated.add(write)
                verdict.problem(
                    f"{stream}: {_name(write)} appears {n} times on relay {history.relay}"
                )
        held[history.relay] = seqs
        if seqs:
            span[history.relay] = (min(seqs), max(seqs))

    # The relays against each other: at each seq, the majority of the relays covering it.
    reference: dict[int, WriteId] = {}
    for seq in sorted({s for seqs in held.values() for s in seqs}):
        covering = [r for r, (lo, hi) in span.items() if lo <= seq <= hi]
        votes: Counter[WriteId | None] = Counter(
            held[r][seq].write if seq in held[r] else None for r in covering
        )
        (top, top_n), *rest = votes.most_common()
        tie = bool(rest) and rest[0][1] == top_n
        if top is not None and not tie:
            reference[seq] = top
        if len(votes) == 1:
            continue
        for r in covering:
            mine = held[r][seq].write if seq in held[r] else None
            if tie or mine != top:
                divergent.add(_label(r))
        verdict.problem(
            f"{stream}: relays disagree at seq {seq}: "
            + ", ".join(
                f"relay {r} {_name(held[r][seq].write) if seq in held[r] else 'nothing'}"
                for r in covering
            )
        )

    # Seqs no relay covers any more (each relay was restarted since, holding a suffix):
    # there the live consumers' logs are the evidence, again the majority of those
    # covering a seq (the consumer check below flags the others).
    def relay_covers(seq: int) -> bool:
        return any(lo <= seq <= hi for lo, hi in span.values())

    seen_by = {log.name: {r.seq: r for r in log.records} for log in consumers}
    consumer_span = {name: (min(at), max(at)) for name, at in seen_by.items() if at}
    for seq in sorted({q for at in seen_by.values() for q in at if not relay_covers(q)}):
        logs = [n for n, (lo, hi) in consumer_span.items() if lo <= seq <= hi]
        votes = Counter(seen_by[n][seq].write if seq in seen_by[n] else None for n in logs)
        (top, top_n), *rest = votes.most_common()
        if top is not None and not (rest and rest[0][1] == top_n):
            reference[seq] = top

    # The acknowledged writes: at their seq, on every relay covering it, on at least one.
    where: dict[WriteId, list[int]] = defaultdict(list)
    for seq, write in reference.items():
        where[write].append(seq)
    for write, at in where.items():
        if len(at) > 1 and write not in duplicated:
            duplicated.add(write)
            verdict.problem(f"{stream}: {_name(write)} at seqs {sorted(at)}")
    acknowledged = [a for a in attempts if a.outcome == COMMITTED]
    if not histories and acknowledged:
        verdict.problem(f"{stream}: no relay's history could be read")
    relays_end = max((hi for _, hi in span.values()), default=-1)

    def covered(seq: int) -> bool:
        return (
            relay_covers(seq)
            or any(lo <= seq <= hi for lo, hi in consumer_span.values())
            or (bool(held) and seq > relays_end)  # past every relay's end: missing, not gone
        )

    for attempt in attempts:
        if attempt.outcome == UNKNOWN and attempt.write in where:
            verdict.unknown_appeared += 1
        if attempt.outcome != COMMITTED:
            continue
        assert attempt.seq is not None, "a committed attempt has its seq"
        if reference.get(attempt.seq) != attempt.write:
            if not covered(attempt.seq) and attempt.write not in where:
                verdict.unverified += 1  # older than every relay's memory and every log
                continue
            verdict.lost += 1
            found = where.get(attempt.write)
            verdict.problem(
                f"{stream}: acknowledged {_name(attempt.write)} at seq {attempt.seq} "
                + (f"is at seq {sorted(found)} instead" if found else "is held by no one")
            )
            continue
        for relay, (_lo, hi) in span.items():
            if attempt.seq > hi:
                divergent.add(_label(relay))
                verdict.problem(
                    f"{stream}: relay {relay} ends at seq {hi}, before acknowledged seq "
                    f"{attempt.seq}"
                )

    # The live consumers against the majority's order.
    ordered = sorted(reference)
    position = {seq: i for i, seq in enumerate(ordered)}
    for log in consumers:
        seen: Counter[WriteId] = Counter()
        previous_index: int | None = None
        previous_seq = -1
        for record in log.records:
            seen[record.write] += 1
            _phantom(stream, f"consumer {log.name}", record, written, phantoms, verdict)
            bad = None
            if record.seq <= previous_seq:
                bad = f"yielded seq {record.seq} after {previous_seq}"
            elif reference.get(record.seq) != record.write:
                bad = f"yielded {_name(record.write)} at seq {record.seq}, not the majority's"
            elif previous_index is not None and position[record.seq] != previous_index + 1:
                skipped = ordered[previous_index + 1]
                bad = f"skipped seq {skipped} between {previous_seq} and {record.seq}"
            if bad is not None:
                divergent.add(f"consumer {log.name}")
                verdict.problem(f"{stream}: consumer {log.name} {bad}")
            previous_seq = max(previous_seq, record.seq)
            previous_index = position.get(record.seq, previous_index)
        for write, n in seen.items():
            if n > 1 and write not in duplicated:
                duplicated.add(write)
                verdict.problem(f"{stream}: consumer {log.name} yielded {_name(write)} {n} times")
    verdict.duplicates += len(duplicated)
    verdict.phantom += len(phantoms)


def _phantom(
    stream: str,
    holder: str,
    record: HistoryRecord,
    written: dict[WriteId, Attempt],
    phantoms: set[WriteId],
    verdict: Verdict,
) -> None:
    attempt = written.get(record.write)
    if attempt is None:
        why = "no producer wrote it"
    elif attempt.value != record.value:
        why = "its value differs from what was written"
    elif attempt.outcome in DEFINITE_FAILURES:
        why = f"its producer was told {attempt.outcome}"
    else:
        return
    if record.write not in phantoms:
        phantoms.add(record.write)
        verdict.problem(f"{stream}: {holder} holds {_name(record.write)} at {record.seq}: {why}")


def _name(write: WriteId) -> str:
    producer_id, producer_seq = write
    return f"{producer_id.decode('utf-8', 'replace')}#{producer_seq}"


# --- availability ---------------------------------------------------------------------------


def commit_gaps(ack_times_s: Sequence[float], start_s: float, end_s: float) -> float:
    """The longest time without a commit acknowledgement between `start_s` and `end_s`
    (the edges count: a stall until the end is a gap)."""
    points = [start_s, *sorted(t for t in ack_times_s if start_s <= t <= end_s), end_s]
    return max(b - a for a, b in itertools.pairwise(points))


def recovery_times(
    heal_times_s: Sequence[float], ack_times_s: Sequence[float], end_s: float
) -> list[float]:
    """For each heal, the time to the next commit acknowledgement (to `end_s` when none
    came: the mesh had not recovered when the run ended)."""
    acks = sorted(ack_times_s)
    out = []
    for heal in heal_times_s:
        after = next((t for t in acks if t >= heal), None)
        out.append((after if after is not None else end_s) - heal)
    return out


def summary(values: Sequence[float]) -> tuple[float | None, float | None]:
    """(max, median) of `values`, or (None, None) when empty."""
    if not values:
        return None, None
    return max(values), statistics.median(values)
