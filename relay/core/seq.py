"""Sequence numbers: 64-bit, k-sorted, flake layout, issued from a hybrid logical clock.

Layout of a sequence number (63 bits used, so it is always a non-negative int64):

    | 41 bits: milliseconds since EPOCH_MS | 10 bits: relay id | 12 bits: counter |

Ordering by the integer value is ordering by (millisecond, relay id, counter).

The clock is hybrid: a relay's *floor* is a promise that it will never coordinate a
transaction with a sequence number at or below it. The floor only moves up: it follows the
wall clock, every transaction and floor heard from a peer, and every sequence number the
relay issues. So sequence numbers stay monotonic when the wall clock steps back, and a
relay whose clock lags is pulled up to its peers instead of holding the mesh back.
"""

from __future__ import annotations

from dataclasses import dataclass

from mypy_extensions import mypyc_attr

EPOCH_MS = 1_704_067_200_000  # 2024-01-01T00:00:00Z
MS_BITS = 41
RELAY_ID_BITS = 10
COUNTER_BITS = 12

MAX_MS = (1 << MS_BITS) - 1
MAX_RELAY_ID = (1 << RELAY_ID_BITS) - 1
MAX_COUNTER = (1 << COUNTER_BITS) - 1
MAX_SEQ = (1 << (MS_BITS + RELAY_ID_BITS + COUNTER_BITS)) - 1

_RELAY_SHIFT = COUNTER_BITS
_MS_SHIFT = COUNTER_BITS + RELAY_ID_BITS


def compose(ms: int, relay_id: int, counter: int) -> int:
    """Build a sequence number from milliseconds since EPOCH_MS, relay id and counter."""
    if not 0 <= ms <= MAX_MS:
        raise ValueError(f"milliseconds {ms} outside 0..{MAX_MS}")
    if not 0 <= relay_id <= MAX_RELAY_ID:
        raise ValueError(f"relay id {relay_id} outside 0..{MAX_RELAY_ID}")
    if not 0 <= counter <= MAX_COUNTER:
        raise ValueError(f"counter {counter} outside 0..{MAX_COUNTER}")
    return (ms << _MS_SHIFT) | (relay_id << _RELAY_SHIFT) | counter


def ms_of(seq: int) -> int:
    return seq >> _MS_SHIFT


def relay_of(seq: int) -> int:
    return (seq >> _RELAY_SHIFT) & MAX_RELAY_ID


def counter_of(seq: int) -> int:
    return seq & MAX_COUNTER


def split(seq: int) -> tuple[int, int, int]:
    return ms_of(seq), relay_of(seq), counter_of(seq)


def end_of_ms(ms: int) -> int:
    """The highest sequence number of millisecond `ms` (any relay, any counter)."""
    return compose(ms, MAX_RELAY_ID, MAX_COUNTER)


def wall_ms(unix_ms: int) -> int:
    """Milliseconds since EPOCH_MS, clamped into the layout's range."""
    return min(max(unix_ms - EPOCH_MS, 0), MAX_MS)


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass
class HybridClock:
    """Issues sequence numbers for one relay; pure: the caller passes the wall time in.

    `now_ms` arguments are Unix milliseconds as read by the shell (or the simulator).
    """

    relay_id: int
    floor: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.relay_id <= MAX_RELAY_ID:
            raise ValueError(f"relay id {self.relay_id} outside 0..{MAX_RELAY_ID}")

    def follow_wall(self, now_ms: int) -> None:
        """Close every millisecond before now: nothing will be issued in them any more."""
        ms = wall_ms(now_ms)
        if ms > 0:
            self.raise_floor(end_of_ms(ms - 1))

    def raise_floor(self, seq: int) -> None:
        if seq > self.floor:
            self.floor = min(seq, MAX_SEQ)

    def next_seq(self, now_ms: int) -> int:
        """The smallest sequence number of this relay above the floor, and not before now."""
        floor = self.floor
        if self.has_next_seqs(now_ms, 1):
            # The next counter of our own millisecond, which the wall clock has not passed:
            # the common case.
            self.floor = floor + 1
            return floor + 1
        rid = relay_of(floor)
        if rid == self.relay_id and counter_of(floor) < MAX_COUNTER:
            seq = floor + 1  # the next counter of our own millisecond, the wall clock past it
        elif rid < self.relay_id:
            seq = compose(ms_of(floor), self.relay_id, 0)
        elif ms_of(floor) < MAX_MS:
            seq = compose(ms_of(floor) + 1, self.relay_id, 0)
        else:
            raise OverflowError("sequence space exhausted")
        wall = wall_ms(now_ms)
        if wall > ms_of(seq):
            seq = compose(wall, self.relay_id, 0)
        self.floor = seq
        return seq

    def has_next_seqs(self, now_ms: int, count: int) -> bool:
        """Whether the next `count` calls of `next_seq(now_ms)` would give the next
        counters of our floor's millisecond (see `next_seqs`)."""
        floor = self.floor
        return (
            floor >> _RELAY_SHIFT & MAX_RELAY_ID == self.relay_id
            and (floor & MAX_COUNTER) + count <= MAX_COUNTER
            and now_ms - EPOCH_MS <= floor >> _MS_SHIFT
        )

    def next_seqs(self, count: int) -> range:
        """The next `count` sequence numbers when `has_next_seqs` said so: what as many
        calls of `next_seq` give, at once."""
        first = self.floor + 1
        self.floor += count
        return range(first, first + count)

    def ahead_by_ms(self, peer_floor: int, now_ms: int) -> int:
        """How far a peer's floor runs ahead of our wall clock, in milliseconds (<= 0: not)."""
        return ms_of(peer_floor) - wall_ms(now_ms)
