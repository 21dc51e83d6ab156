"""Spooling: when a member may vote, and what it hands its spool (docs/protocol.md 5.14).

With spooling on, each relay writes the committed entries of the streams it serves to a
spool on its disk, from which the store is built; the store must never lack an entry a
producer was told is committed. The shell tells the core, between turns, how many bytes
its spool can still take (`RelayCore.set_spool_room`), and which streams it cannot take at
all (a write failed). The rules:

- **Votes need room.** A member reports on a stream (5.3) only while what it owes its
  spool (the records of every held entry not yet handed over, `owed_bound`) fits in the
  room, and its spool takes the stream. An entry commits only on a quorum's reports, and
  each of those members then held it with room for it, so every member that voted spools
  it unless it crashes first: a full spool withholds votes (its stream stalls, or commits
  through members with room) and never loses an acknowledged entry.
- **The spool gets what was voted.** `take` hands the shell the committed records after
  its cursor: all of them while the spool is not full; while it is full only those at or
  below the point this member voted through (it reserved their room when it reported).
  What does not fit waits for room; what is evicted meanwhile is a gap in this spool
  that the spools of the members that voted for it cover.
- **Producers hear why.** Heartbeats say whether the sender's spool is full; a relay that
  counts fewer than a quorum of a stream's members with room (itself included) answers a
  new produce `rejected(store_backlog_full)` (retriable: room comes back as the store
  ingests and the spools are reclaimed) instead of letting it wait for its deadline.
"""

from __future__ import annotations

from relay.core.state import RelayState, StreamState
from relay.core.timeline import CommittedRecord

# What a spooled record takes beyond its producer id, key and value (seq, digest, producer
# seq, flags, column offsets): the spool's estimate of a segment's size (relay/spool.py).
SPOOL_RECORD_OVERHEAD_BYTES = 48
# While the quick bound on what we owe exceeds the room, the exact count (a walk over what
# is not yet spooled, which grows while the spool is full) runs at most this often: the
# bound stays an upper bound in between, so a spool getting room is seen this much later.
SPOOL_RECOUNT_INTERVAL_MS = 50


def record_bytes(producer_id: bytes, key: bytes | None, value: bytes) -> int:
    """What one record takes in a spool, as the room is counted (relay/spool.py)."""
    return SPOOL_RECORD_OVERHEAD_BYTES + len(producer_id) + len(value) + (len(key) if key else 0)


def owed_bound(core: RelayState) -> int:
    """At least what this relay owes its spool: the records of every held entry not yet
    handed to it (those it may vote for, or voted for already)."""
    return core.spool_owed_bytes + core.memory.added_bytes - core.spool_added_mark


def owed_bytes(core: RelayState) -> int:
    """Exactly what this relay owes its spool now (a walk over what is not yet spooled)."""
    total = 0
    for st in core.streams.values():
        tl = st.timeline
        if tl.last_seq() <= tl.spooled_through:
            continue
        for tx in tl.txs[tl.index_after(tl.spooled_through) :]:
            total += record_bytes(tx.producer_id, tx.key, tx.value)
    return total


def full(core: RelayState) -> bool:
    """Whether this relay's spool lacks room for what it owes (it then votes nowhere)."""
    room = core.spool_room_bytes
    return room is not None and owed_bound(core) > room


def may_report(core: RelayState, st: StreamState) -> bool:
    """Whether this member may report on `st` now (votes need room)."""
    if core.spool_room_bytes is None:
        return True
    return not full(core) and st.stream not in core.spool_refused


def short_of_room(core: RelayState, st: StreamState) -> tuple[int, ...]:
    """The members of `st` whose spools are full, when fewer than a quorum have room (a new
    produce is then refused `store_backlog_full`); () when a quorum has room."""
    if not (core.spool_full_peers or core.spool_blocked or core.spool_refused):
        return ()
    full_members = [m for m in st.peers if m in core.spool_full_peers]
    if core.spool_blocked or st.stream in core.spool_refused:
        full_members.append(core.id)
    if len(st.members) - len(full_members) >= st.q:
        return ()
    return tuple(sorted(full_members))


def take(
    core: RelayState, st: StreamState, after_seq: int, max_entries: int
) -> list[CommittedRecord]:
    """The committed records after `after_seq` the shell hands its spool now, at most
    `max_entries`: all of them while the spool has room for what we owe; else only those
    at or below the point we voted through (their room was counted when we voted), and the
    rest waits. The room and what we owe shrink by what they take."""
    records = st.timeline.records_after(after_seq, max_entries)
    room = core.spool_room_bytes
    if room is None or not records:
        return records
    if full(core):
        voted = st.timeline.voted_through
        keep = 0
        while keep < len(records) and records[keep][0] <= voted:
            keep += 1
        if keep < len(records):
            core.spool_held_back.add(st.stream)
            del records[keep:]
    else:
        core.spool_held_back.discard(st.stream)
    taken = 0
    for _, _, tx, _ in records:
        taken += record_bytes(tx.producer_id, tx.key, tx.value)
    core.spool_room_bytes = room - taken
    core.spool_owed_bytes -= taken
    if records:
        st.timeline.spooled_through = records[-1][0]
    return records


def set_room(core: RelayState, room_bytes: int | None, refused: frozenset[str]) -> bool:
    """The shell's count of its spool's room; True when whether this relay's spool is full
    changed (its peers must hear it, and its streams look again whether they may report).
    What we owe is counted exactly only when the quick bound says the room is short."""
    core.spool_room_bytes = room_bytes
    core.spool_refused = refused
    core.memory.spool_pin = room_bytes is not None
    # Two upper bounds of what we owe: the last count carried forward, and the memory of
    # everything held (an entry costs more than its record).
    owed = min(owed_bound(core), core.memory.used_bytes)
    core.spool_added_mark = core.memory.added_bytes
    if (
        room_bytes is not None
        and owed > room_bytes
        and core.now_ms - core.spool_counted_ms >= SPOOL_RECOUNT_INTERVAL_MS
    ):
        owed = owed_bytes(core)
        core.spool_counted_ms = core.now_ms
    core.spool_owed_bytes = owed
    blocked = full(core)
    if blocked == core.spool_blocked:
        return False
    core.spool_blocked = blocked
    core.counters["spool_full" if blocked else "spool_room_again"] += 1
    return True


def on_heartbeat(core: RelayState, sender: int, spool_full: bool) -> None:
    if spool_full:
        core.spool_full_peers.add(sender)
    else:
        core.spool_full_peers.discard(sender)
