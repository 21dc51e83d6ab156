"""One stream's timeline at one relay: the in-memory ring buffer and its digest chain.

Regions of the timeline, by sequence number:

    base_point < ... committed_point  : committed and delivered (frozen; evicted oldest first)
    committed_point < ... reported    : reported but not yet committed (frozen: a point is
                                        reported at most once, so nothing may enter here)
    reported < ...                    : open; new transactions are inserted in seq order

A transaction that arrives for a frozen region is *late*: it is kept aside (bounded) and
can still enter through repair. Digests are computed lazily, only up to where they are
needed (reports, commits), and recomputed above any insertion point.
"""

from __future__ import annotations

import enum
from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from mypy_extensions import mypyc_attr

from relay.core import digest as dg
from relay.core.memory import (
    DEDUPE_KEY_BYTES,
    HELD_ENTRY_OVERHEAD_BYTES,
    REPORT_LOG_ENTRY_BYTES,
    MemoryBudget,
    entry_cost,
)
from relay.core.messages import DedupeKey, Entry, Transaction

NO_DIGEST = bytes(dg.DIGEST_BYTES)  # stands for "no digest yet" on the wire
# In place of an evicted entry until compaction (indexes below `head` are never read)
EVICTED = Transaction(b"", 0, None, b"")
EVICTED_SEQ = -1
# (seq, chain digest after the entry, transaction, duplicate: skipped by delivery)
CommittedRecord = tuple[int, bytes, Transaction, bool]


class Insert(enum.Enum):
    """What became of a transaction offered to the timeline. The values name counters
    (`tx_<value>`, `fill_<value>`, `sync_<value>`: by where the transaction came from)."""

    INSERTED = "inserted"
    DUPLICATE = "duplicate"  # this transaction is held at this seq already
    LATE = "late"  # for the frozen region: kept aside in the late pile
    CONFLICT = "conflict"  # a different transaction is held at this seq


# A newly committed entry: (seq, transaction, seq of the first copy, same content as it)
Delivered = tuple[int, Transaction, int, bool]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class DedupeWindow:
    """(producer id, producer seq) -> (seq, content hash) of the first committed copy, for
    the last `capacity` committed (non-duplicate) entries. A pure function of the committed
    prefix, so every relay skips the same copies. The content hash tells a retry (same
    hash) from another transaction reusing the producer sequence (5.6)."""

    def __init__(self, capacity: int, keys: tuple[DedupeKey, ...] = ()) -> None:
        self.capacity = capacity
        # A dict and its keys in a deque, oldest first: a third faster per key than an
        # OrderedDict (every relay adds a key per transaction it commits).
        self.first_of: dict[tuple[bytes, int], tuple[int, bytes]] = {}
        self.order: deque[tuple[bytes, int]] = deque()
        for pid, pseq, seq, content in keys:
            self.add(pid, pseq, seq, content)

    def first_copy(self, key: tuple[bytes, int]) -> tuple[int, bytes] | None:
        """(seq, content hash) of the committed copy of (producer id, producer seq), if
        the window holds one."""
        return self.first_of.get(key)

    def add(self, pid: bytes, pseq: int, seq: int, content: bytes) -> None:
        key = (pid, pseq)
        if key not in self.first_of:
            self.order.append(key)
        self.first_of[key] = (seq, content)
        if len(self.first_of) > self.capacity:
            del self.first_of[self.order.popleft()]

    def keys(self) -> tuple[DedupeKey, ...]:
        return tuple(
            (pid, pseq, seq, content) for (pid, pseq), (seq, content) in self.first_of.items()
        )

    def __len__(self) -> int:
        return len(self.first_of)


def _first_change(old: list[Entry], new: list[Entry]) -> int:
    """The lowest seq where two runs of entries differ (-1: they do not)."""
    for (old_seq, old_tx), (new_seq, new_tx) in zip(old, new, strict=False):
        if old_seq != new_seq or old_tx != new_tx:
            return min(old_seq, new_seq)
    if len(old) == len(new):
        return -1
    return (old if len(old) > len(new) else new)[min(len(old), len(new))][0]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Timeline:
    def __init__(
        self, stream: str, dedupe_capacity: int, late_max_entries: int, budget: MemoryBudget
    ) -> None:
        self.stream = stream
        self.base_point = -1  # -1: no base yet (joining); everything <= base is summarised
        self.base_digest = NO_DIGEST
        self.committed_point = -1
        self.committed_digest = NO_DIGEST
        self.reported = -1  # highest point this relay reported (or froze by adoption)
        # 5.14 spooling: the highest point at which a report of ours may have counted
        # (lowered where the entries it covered changed), and the last seq handed to
        # the spool. With a spool (budget.spool_pin), the committed entries between the
        # two are kept from eviction until the spool took them (our vote may have
        # committed them).
        self.voted_through = -1
        self.spooled_through = -1
        self.dedupe = DedupeWindow(dedupe_capacity)
        self.late: OrderedDict[int, Transaction] = OrderedDict()
        self.late_max_entries = late_max_entries
        # Held entries live in parallel lists from index `head` on (eviction moves head).
        self.head = 0
        self.seqs: list[int] = []
        self.txs: list[Transaction] = []
        self.hashes: list[bytes] = []
        self.digests: list[bytes] = []  # valid for indexes < digested
        self.skip: list[bool] = []  # a committed duplicate: not delivered
        self.digested = 0
        self.delivered = 0  # index one past the last committed entry
        # Memory (relay.core.memory) of the held entries, of the dedupe window's keys and
        # of the stream's report log (kept by StreamState, which tells its length); the
        # relay's budget is charged with every change of any.
        self.held_bytes = 0
        self.dedupe_bytes = 0
        self.report_log_bytes = 0
        self.budget = budget

    def _charge(self, held_delta: int) -> None:
        self.held_bytes += held_delta
        self.budget.used_bytes += held_delta

    def _charge_dedupe(self) -> None:
        now = len(self.dedupe) * DEDUPE_KEY_BYTES
        self.budget.used_bytes += now - self.dedupe_bytes
        self.dedupe_bytes = now

    def charge_report_log(self, entries: int) -> None:
        """The stream's report log now holds `entries` reports."""
        now = entries * REPORT_LOG_ENTRY_BYTES
        self.budget.used_bytes += now - self.report_log_bytes
        self.report_log_bytes = now

    @property
    def memory_bytes(self) -> int:
        """What the per-stream byte bound counts: held entries, dedupe keys, report log."""
        return self.held_bytes + self.dedupe_bytes + self.report_log_bytes

    # --- shape ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.seqs) - self.head

    @property
    def has_base(self) -> bool:
        return self.base_point >= 0

    def last_seq(self) -> int:
        return self.seqs[-1] if len(self) else self.base_point

    def uncommitted(self) -> int:
        """Held entries above the committed point (status only)."""
        return len(self.seqs) - self.index_after(self.committed_point)

    def index_after(self, point: int) -> int:
        """Index of the first held entry with seq > point."""
        return bisect_right(self.seqs, point, self.head)

    def contains(self, seq: int) -> bool:
        i = bisect_left(self.seqs, seq, self.head)
        return i < len(self.seqs) and self.seqs[i] == seq

    # --- inserting ----------------------------------------------------------------------

    def insert(self, seq: int, tx: Transaction) -> Insert:
        if seq <= self.reported or seq <= self.base_point:
            if self.contains(seq):
                return Insert.DUPLICATE
            self._keep_late(seq, tx)
            return Insert.LATE
        i = bisect_left(self.seqs, seq, self.head)
        if i < len(self.seqs) and self.seqs[i] == seq:
            return Insert.DUPLICATE if self.txs[i] == tx else Insert.CONFLICT
        self.seqs.insert(i, seq)
        self.txs.insert(i, tx)
        self.hashes.insert(i, dg.tx_hash(tx))
        self.skip.insert(i, False)
        if i < len(self.digests):
            del self.digests[i:]
        self.digested = min(self.digested, i)
        cost = tx.size_bytes() + HELD_ENTRY_OVERHEAD_BYTES  # entry_cost, inline: per entry
        self.held_bytes += cost
        budget = self.budget
        budget.used_bytes += cost
        budget.added_bytes += cost
        return Insert.INSERTED

    def append_run(self, entries: Sequence[Entry], size_bytes: int = -1) -> bool:
        """Insert a run of entries, in strictly ascending seq order (a coordinator's run
        or TxBatch, which the codec checked), in one go when they all go after
        everything held and reported (nearly always): one extend per list instead of a
        bisect and an insert each. False, and nothing done, when they do not (the caller
        inserts them one by one). `size_bytes`: the sum of their transactions' sizes
        (Transaction.size_bytes) if the caller knows it."""
        first = entries[0][0]
        if first <= self.reported or first <= self.base_point:
            return False
        if self.seqs and first <= self.seqs[-1]:
            return False
        seqs = [seq for seq, _ in entries]
        txs = [tx for _, tx in entries]
        self.seqs.extend(seqs)
        self.txs.extend(txs)
        self.hashes.extend(map(dg.tx_hash, txs))
        self.skip.extend([False] * len(txs))
        if size_bytes < 0:
            size_bytes = sum(map(Transaction.size_bytes, txs))
        cost = size_bytes + len(txs) * HELD_ENTRY_OVERHEAD_BYTES
        self.held_bytes += cost
        budget = self.budget
        budget.used_bytes += cost
        budget.added_bytes += cost
        return True

    def _keep_late(self, seq: int, tx: Transaction) -> None:
        if seq <= self.committed_point:
            return  # below the committed prefix: can never enter again
        self.late[seq] = tx
        while len(self.late) > self.late_max_entries:
            self.late.popitem(last=False)

    # --- digests ------------------------------------------------------------------------

    def digest_through(self, index: int) -> None:
        """Make digests valid for every held index <= `index`."""
        digests = self.digests
        start = max(self.digested, self.head)
        if start > index:
            return
        prev = digests[start - 1] if start > self.head else self.base_digest
        chain = dg.chain
        seqs, hashes = self.seqs, self.hashes
        del digests[start:]
        for i in range(start, index + 1):
            prev = chain(prev, seqs[i], hashes[i])
            digests.append(prev)
        self.digested = index + 1

    def digest_at(self, point: int) -> bytes | None:
        """Digest of this relay's prefix up to `point`; None if the point lies below base."""
        if not self.has_base or point < self.base_point:
            return None
        i = self.index_after(point) - 1
        if i < self.head:
            return self.base_digest
        self.digest_through(i)
        return self.digests[i]

    def entries_between(self, lo: int, hi: int) -> list[Entry]:
        """Held entries with lo < seq <= hi."""
        a = self.index_after(lo)
        b = self.index_after(hi)
        return list(zip(self.seqs[a:b], self.txs[a:b], strict=True))

    # --- committing -------------------------------------------------------------------

    def deliver_through(self, point: int, digest: bytes) -> list[Delivered]:
        """Commit the prefix up to `point` (whose digest must match) and return the newly
        committed entries as (seq, tx, first_seq, same): first_seq != seq marks a
        duplicate, skipped; `same` says whether its content is that of the first copy."""
        end = self.index_after(point)
        out: list[Delivered] = []
        # The window's first copy of each, or this one added (one lookup for both), inline:
        # once per transaction on every relay. Added is told by the window's growth, not by
        # `first is mine`: compiled code (relay/native.py) keeps a tuple unboxed and boxes
        # it anew for each use, so a tuple is never identical to itself there.
        window = self.dedupe
        first_of, order, capacity = window.first_of, window.order, window.capacity
        seqs, txs, hashes = self.seqs, self.txs, self.hashes
        for i in range(max(self.delivered, self.head), end):
            seq, tx, content = seqs[i], txs[i], hashes[i]
            key = (tx.producer_id, tx.producer_seq)
            held = len(first_of)
            first = first_of.setdefault(key, (seq, content))
            if len(first_of) > held:
                order.append(key)
                if len(first_of) > capacity:
                    del first_of[order.popleft()]
                out.append((seq, tx, seq, True))
            else:
                self.skip[i] = True
                out.append((seq, tx, first[0], first[1] == content))
        self._charge_dedupe()
        self.delivered = max(self.delivered, end)
        self.committed_point = point
        self.committed_digest = digest
        self.reported = max(self.reported, point)
        self._drop_late_through(point)
        return out

    def _drop_late_through(self, point: int) -> None:
        while self.late:
            seq = next(iter(self.late))
            if seq > point:
                break
            self.late.popitem(last=False)

    # --- adopting what the quorum committed ------------------------------------------------

    def replace_range(self, lo: int, hi: int, entries: list[Entry]) -> list[int]:
        """Replace held entries in (lo, hi] with `entries` (already verified against the
        committed digest). Returns the seqs that were held there and are now dropped."""
        a = self.index_after(lo)
        b = self.index_after(hi)
        keep = {seq for seq, _ in entries}
        dropped = [s for s in self.seqs[a:b] if s not in keep]
        changed = _first_change(list(zip(self.seqs[a:b], self.txs[a:b], strict=True)), entries)
        if changed >= 0:
            # Our reports from the first changed entry on covered other entries: they
            # never counted towards what commits here (5.14).
            self.voted_through = min(self.voted_through, changed - 1)
        self._splice(a, b, entries)
        self.reported = max(self.reported, hi)
        return dropped

    def _splice(self, a: int, b: int, entries: list[Entry]) -> None:
        """Held entries at indexes [a, b) become `entries` (sorted, in (seqs[a-1], seqs[b]))."""
        txs = [t for _, t in entries]
        added = sum(map(entry_cost, txs))
        self._charge(added - sum(map(entry_cost, self.txs[a:b])))
        self.budget.added_bytes += added
        self.seqs[a:b] = [s for s, _ in entries]
        self.txs[a:b] = txs
        self.hashes[a:b] = [dg.tx_hash(t) for t in txs]
        self.skip[a:b] = [False] * len(entries)
        del self.digests[a:]
        self.digested = min(self.digested, a)
        for seq, _ in entries:
            self.late.pop(seq, None)

    def adopt_base(self, point: int, digest: bytes, dedupe: DedupeWindow) -> list[int]:
        """Start over from a committed point: drop everything at or below it. Returns the
        dropped seqs."""
        end = self.index_after(point)
        dropped = self.seqs[self.head : end]
        self._charge(-sum(map(entry_cost, self.txs[self.head : end])))
        for lst in (self.seqs, self.txs, self.hashes, self.skip):
            del lst[:end]
        self.digests.clear()
        self.head = 0
        self.digested = 0
        self.delivered = 0
        self.base_point = point
        self.base_digest = digest
        self.committed_point = point
        self.committed_digest = digest
        self.reported = max(self.reported, point)
        # Our reports above the base were made on a history we did not keep (5.14).
        self.voted_through = min(self.voted_through, point)
        self.dedupe = dedupe
        self._charge_dedupe()
        self._drop_late_through(point)
        return dropped

    def apply_view(
        self, decided: int, admits: Callable[[int], bool], entries: tuple[Entry, ...]
    ) -> tuple[list[int], int]:
        """Make the uncommitted region above `decided` what a view change decided (5.12):
        drop the entries it no longer admits, add those it carries. At and below `decided`
        the view's promisers had all committed, so nothing there is the view's to change
        (a relay behind them learns that history by the commit rule and repair). Returns
        the dropped seqs and the lowest seq where the region changed (-1: unchanged). A
        change at or below `reported` voids our reports from there on (5.12: no quorum
        used them)."""
        floor = max(self.committed_point, decided)
        start = self.index_after(floor)
        old = self.seqs[start:]
        region = {seq: tx for seq, tx in zip(old, self.txs[start:], strict=True) if admits(seq)}
        dropped = [seq for seq in old if seq not in region]
        for seq, tx in entries:
            if seq > floor:
                region.setdefault(seq, tx)
        for seq in [s for s in self.late if s > floor and not admits(s)]:
            del self.late[seq]
        merged = sorted(region.items())
        new = [seq for seq, _ in merged]
        if new == old:
            return dropped, -1
        changed_at = min(set(old) ^ set(new))
        self.voted_through = min(self.voted_through, changed_at - 1)  # void from there (5.14)
        self._splice(start, len(self.seqs), merged)
        return dropped, changed_at

    # --- bounding -----------------------------------------------------------------------

    def evict(self, max_entries: int, max_bytes: int) -> int:
        """Drop the oldest committed entries while over a bound (`max_bytes` counts
        `memory_bytes`); returns how many."""
        evicted = 0
        over_entries = len(self) - max_entries
        over_bytes = self.memory_bytes - max_bytes
        if over_entries <= 0 and over_bytes <= 0:
            return 0
        freed = 0
        while (evicted < over_entries or freed < over_bytes) and self.head < self.delivered:
            i = self.head
            if self.budget.spool_pin and self.spooled_through < self.seqs[i] <= self.voted_through:
                break  # voted for and not yet spooled (5.14)
            self.digest_through(i)
            self.base_point = self.seqs[i]
            self.base_digest = self.digests[i]
            freed += entry_cost(self.txs[i])
            # Free it now, not at the next compaction (which may be as many evictions
            # away as entries are held): nothing reads below `head`.
            self.seqs[i] = EVICTED_SEQ
            self.txs[i] = EVICTED
            self.hashes[i] = NO_DIGEST
            self.digests[i] = NO_DIGEST
            self.head += 1
            evicted += 1
        self._charge(-freed)
        if self.head > 1024 and self.head * 2 > len(self.seqs):
            self._compact()
        return evicted

    def _compact(self) -> None:
        h = self.head
        if self.digested < h:
            self.digest_through(h - 1)
        for lst in (self.seqs, self.txs, self.hashes, self.skip):
            del lst[:h]
        del self.digests[: min(h, len(self.digests))]
        self.digested = max(self.digested - h, 0)
        self.delivered = max(self.delivered - h, 0)
        self.head = 0

    def evictable(self) -> bool:
        """Whether a committed entry is held (the only kind eviction may drop)."""
        return self.head < self.delivered

    def evict_bytes(self, excess_bytes: int) -> int:
        """Drop the oldest committed entries until `excess_bytes` are freed or none is
        left to drop; returns how many."""
        return self.evict(len(self), self.memory_bytes - excess_bytes)

    def make_room(self, max_entries: int, max_bytes: int, cost_bytes: int) -> bool:
        """Whether one more entry costing `cost_bytes` fits within the bounds, evicting
        the oldest committed entries to make room if needed. (Eviction after a commit
        keeps the buffer at the bounds, so without this a buffer full of committed
        entries would refuse every new one.)"""
        self.evict(max_entries - 1, max_bytes - cost_bytes)
        return len(self) < max_entries and self.memory_bytes + cost_bytes <= max_bytes

    # --- reading ------------------------------------------------------------------------

    def records_after(self, after_seq: int, max_entries: int) -> list[CommittedRecord]:
        """Committed entries with seq > after_seq, duplicates included and flagged, each
        with the chain digest after it: what a spool writes, so that a reader can re-check
        the chain from the records alone."""
        start = self.index_after(after_seq)
        end = min(self.delivered, start + max_entries)
        if end <= start:
            return []
        self.digest_through(end - 1)
        seqs, digests, txs, skip = self.seqs, self.digests, self.txs, self.skip
        return [(seqs[i], digests[i], txs[i], skip[i]) for i in range(start, end)]

    def committed_after(self, after_seq: int, max_entries: int) -> list[Entry]:
        """Committed, non-duplicate entries with seq > after_seq, oldest first."""
        i = self.index_after(after_seq)
        out: list[Entry] = []
        while i < self.delivered and len(out) < max_entries:
            if not self.skip[i]:
                out.append((self.seqs[i], self.txs[i]))
            i += 1
        return out
