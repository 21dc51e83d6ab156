"""Each simulated relay's spool, and the check of the spooling rules (docs/protocol.md 5.14).

A simulated spool is a budget and the seqs it took, per stream. It is written at once (a
crash loses nothing of it) and kept across restarts, like a spool on disk whose segments
were flushed. Before every turn the world tells the core the room left, as the node does;
after the core's output it hands the spool what `RelayCore.spool_records` gives.

A `spool_full` fault shrinks a relay's budget to what it holds plus what it owes for its
votes plus a little (the room a real spool has left when the store falls behind: the
disk budget never shrinks under what the relay already counted on); the fault's end, or
the heal, frees it (the store ingested the spool and the relay reclaimed it).

Checked: at every turn, what a relay voted for and has not spooled fits in its room
(`broken_promise`), and at the end, every acknowledged transaction is in some spool
(relay/sim/checkers.py `spooled_acknowledged`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from relay.core import spooling
from relay.core.machine import RelayCore

UNLIMITED_BYTES = 1 << 60
SPOOL_PULL_MAX = 1 << 20  # records handed over per call: all of them, in the simulation


@dataclass
class SimSpool:
    capacity_bytes: int = UNLIMITED_BYTES
    used_bytes: int = 0
    seqs: dict[str, set[int]] = field(default_factory=dict)  # what reached the spool
    cursor: dict[str, int] = field(default_factory=dict)  # this incarnation's, per stream
    gaps: int = 0  # records evicted or rebased before the spool took them

    def room_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def restarted(self) -> None:
        self.cursor.clear()

    def tell(self, core: RelayCore) -> None:
        core.set_spool_room(self.room_bytes())

    def feed(self, core: RelayCore, streams: Iterable[str]) -> None:
        for stream in streams:
            cursor = self.cursor.get(stream, -1)
            base, _, records = core.spool_records(stream, cursor, SPOOL_PULL_MAX)
            if cursor < base:
                if stream in self.cursor:
                    self.gaps += 1
                cursor = base
            if records:
                taken = self.seqs.setdefault(stream, set())
                for seq, _, tx, _ in records:
                    taken.add(seq)
                    self.used_bytes += spooling.record_bytes(tx.producer_id, tx.key, tx.value)
                cursor = records[-1][0]
            self.cursor[stream] = cursor

    def shrink(self, core: RelayCore | None, extra_bytes: int) -> None:
        """The spool_full fault: room only for what is owed for votes, plus extra_bytes."""
        owed = 0 if core is None else voted_unspooled_bytes(core, self)
        self.capacity_bytes = min(self.capacity_bytes, self.used_bytes + owed + extra_bytes)

    def free(self) -> None:
        self.capacity_bytes = UNLIMITED_BYTES

    def broken_promise(self, core: RelayCore) -> str:
        """Why the relay's votes are not covered by its room ("" when they are)."""
        owed = voted_unspooled_bytes(core, self)
        if owed <= self.room_bytes():
            return ""
        return (
            f"voted for {owed} bytes of records its spool has not taken, "
            f"with room for {self.room_bytes()}"
        )


def voted_unspooled_bytes(core: RelayCore, spool: SimSpool) -> int:
    """The records of held entries at or below the point this incarnation voted through,
    above what its spool took: what its spool must still take."""
    total = 0
    for name, st in core.streams.items():
        tl = st.timeline
        cursor = spool.cursor.get(name, -1)
        start = tl.index_after(cursor)
        end = tl.index_after(tl.voted_through)
        for tx in tl.txs[start:end]:
            total += spooling.record_bytes(tx.producer_id, tx.key, tx.value)
    return total
