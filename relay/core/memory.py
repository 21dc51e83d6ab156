"""What a relay's buffers cost in memory, and the relay-wide bound over them (5.10).

A held entry costs far more than its payload: the transaction object and its bytes, its
seq, content hash and chain digest, and a slot in each of the timeline's parallel lists.
A dedupe key (5.6) costs its own tuples and dictionary node, and keeps the producer id,
seq and content hash alive after its entry is evicted; an entry of the report log (our
own reports, kept to answer gap fills and to tell dead points, 5.2 and 5.7) keeps its
digest alive. Keys and report log entries are bounded by counts and never evicted for
memory (both are part of the protocol), but they count against the byte bounds. The
bounds (`buffer_max_bytes` per stream, `relay_buffer_max_bytes` per relay) count those
costs, measured with
`tracemalloc` on CPython 3.11 (tests/test_core_memory.py checks them against what is
really allocated), so that what a relay is configured to hold is what it holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mypy_extensions import mypyc_attr

from relay.core.messages import Transaction

if TYPE_CHECKING:
    from relay.core.state import RelayState, StreamState

# Beyond `Transaction.size_bytes()` (the lengths of its bytes plus 16): the Struct (72),
# the headers of its bytes objects (33 each), its producer seq, the entry's seq, content
# hash and digest (49 each), five list slots. Measured: 340 bytes over the lengths.
HELD_ENTRY_OVERHEAD_BYTES = 330
# A key of the dedupe window: its two tuples and ordered-dict node (217 measured; the dict
# with a deque of its keys that replaced it takes about 45 less), plus the producer id,
# seq and content hash it keeps alive once its entry is evicted (130).
DEDUPE_KEY_BYTES = 350
# An entry of a stream's report log (4): its tuple, point and digest, and a deque slot
# (149 measured with a digest of its own, as once the entry is evicted).
REPORT_LOG_ENTRY_BYTES = 150


def entry_cost(tx: Transaction) -> int:
    """The memory one held entry of `tx` costs, as the bounds count it."""
    return tx.size_bytes() + HELD_ENTRY_OVERHEAD_BYTES


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class MemoryBudget:
    """The bytes every timeline of one relay holds (entries and dedupe keys), against the
    relay-wide bound. Timelines charge it as they change."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used_bytes = 0
        # Every entry cost ever charged (only grows): what entries added since a moment
        # cost, for the spool's count of what the relay owes it (5.14, spooling.owed_bytes).
        self.added_bytes = 0
        # With a spool, eviction keeps what we voted for until the spool took it (5.14).
        self.spool_pin = False


def make_room(core: RelayState, st: StreamState, tx: Transaction) -> bool:
    """Whether the stream's timeline can take `tx` within its own bounds and the relay's,
    evicting committed entries to make room (see `_free`)."""
    limits = core.limits
    tl = st.timeline
    cost = entry_cost(tx)
    if not tl.make_room(limits.buffer_max_entries, limits.buffer_max_bytes, cost):
        return False
    budget = tl.budget
    if budget.used_bytes + cost > budget.max_bytes:
        _free(core, st, budget.used_bytes + cost - budget.max_bytes)
    return budget.used_bytes + cost <= budget.max_bytes


def evict(core: RelayState, st: StreamState) -> None:
    """After a commit: the stream's oldest committed entries go while it is over its own
    bounds, and committed entries go while the relay is over its bound (see `_free`)."""
    limits = core.limits
    tl = st.timeline
    tl.evict(limits.buffer_max_entries, limits.buffer_max_bytes)
    if tl.budget.used_bytes > tl.budget.max_bytes:
        _free(core, st, tl.budget.used_bytes - tl.budget.max_bytes)


def _free(core: RelayState, st: StreamState, excess_bytes: int) -> None:
    """Evict committed entries worth `excess_bytes` for stream `st`: its own while it holds
    more than a fair share of the relay's bound, then the largest streams'. Streams that
    want memory end with about equal shares: a busy stream neither starves beside idle
    ones holding old history nor pushes them out below its own share."""
    budget = st.timeline.budget
    target_bytes = budget.used_bytes - excess_bytes
    fair_bytes = budget.max_bytes // len(core.streams)
    evicted = st.timeline.evict_bytes(min(excess_bytes, st.timeline.memory_bytes - fair_bytes))
    candidates = [s.timeline for s in core.streams.values() if s.timeline.evictable()]
    while candidates and budget.used_bytes > target_bytes:
        largest = max(candidates, key=lambda tl: tl.memory_bytes)
        candidates.remove(largest)
        evicted += largest.evict_bytes(budget.used_bytes - target_bytes)
    core.counters["evicted_for_relay_bound"] += evicted


def accounting_errors(core: RelayState) -> list[str]:
    """Where the relay's counts of memory disagree with what it holds (for the simulator
    and tests: the bounds are only as honest as these counts)."""
    out = []
    for name, st in core.streams.items():
        tl = st.timeline
        held = sum(entry_cost(tx) for tx in tl.txs[tl.head :])
        if held != tl.held_bytes:
            out.append(f"stream {name}: held_bytes {tl.held_bytes}, its entries cost {held}")
        if tl.dedupe_bytes != len(tl.dedupe) * DEDUPE_KEY_BYTES:
            out.append(f"stream {name}: dedupe_bytes {tl.dedupe_bytes} for {len(tl.dedupe)} keys")
        if tl.report_log_bytes != len(st.report_log) * REPORT_LOG_ENTRY_BYTES:
            out.append(
                f"stream {name}: report_log_bytes {tl.report_log_bytes} "
                f"for {len(st.report_log)} reports"
            )
    total = sum(st.timeline.memory_bytes for st in core.streams.values())
    if total != core.memory.used_bytes:
        out.append(f"relay budget counts {core.memory.used_bytes} bytes, its streams {total}")
    return out
