"""The buffer bounds count real memory (5.10, relay/core/memory.py): what a timeline says it
holds is what Python allocated for it, within 1.5x either way; the relay-wide bound holds
across streams; the relay's budget is always the sum of its timelines'."""

from __future__ import annotations

import dataclasses
import gc
import tracemalloc

import pytest

from relay.core import codec, memory
from relay.core.config import CoreConfig, Limits, Topology
from relay.core.memory import MemoryBudget, entry_cost
from relay.core.messages import Outcome, Transaction, TxBatch
from relay.core.shell import ProduceRequest
from relay.core.timeline import Timeline
from relay.errors import ConfigError
from relay.sim.script import START_UNIX_MS, Mesh

ENTRIES = 20_000
MAX_RATIO = 1.5  # what the issue asks: the bounds match real memory within 1.5x
FIRST_SEQ = 1 << 40


def decoded_entries(value_bytes: int, key_bytes: int) -> tuple[tuple[int, Transaction], ...]:
    """Entries as a member gets them: decoded from a TxBatch frame, fresh objects each."""
    key = b"k" * key_bytes if key_bytes else None
    txs = tuple(
        (FIRST_SEQ + i, Transaction(b"p" * 16, i, key, bytes([i % 256]) * value_bytes))
        for i in range(ENTRIES)
    )
    frame = codec.encode(TxBatch(0, 1, 0, "s", 1, txs))
    msg = codec.decode(frame, 1 << 30)
    assert isinstance(msg, TxBatch)
    return msg.entries


@pytest.mark.parametrize("value_bytes", [0, 10, 100, 1_000, 10_000])
@pytest.mark.parametrize("key_bytes", [0, 16])
def test_what_a_timeline_counts_is_what_it_allocates(value_bytes: int, key_bytes: int) -> None:
    budget = MemoryBudget(1 << 40)
    tl = Timeline("s", ENTRIES, 0, budget)
    tl.base_point = 0
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for seq, tx in decoded_entries(value_bytes, key_bytes):
            tl.insert(seq, tx)
        tl.digest_through(len(tl) - 1)
        tl.deliver_through(tl.last_seq(), tl.digests[-1])
        gc.collect()
        measured = [(tracemalloc.get_traced_memory()[0] - before, tl.memory_bytes)]
        # Evicting half keeps their dedupe keys (and what those keep alive).
        tl.evict(ENTRIES // 2, 1 << 40)
        gc.collect()
        measured.append((tracemalloc.get_traced_memory()[0] - before, tl.memory_bytes))
    finally:
        tracemalloc.stop()
    assert len(tl) == ENTRIES // 2
    assert budget.used_bytes == tl.memory_bytes
    for allocated, counted in measured:
        assert 1 / MAX_RATIO <= allocated / counted <= MAX_RATIO, measured


# --- the relay-wide bound, through the simulator's mesh --------------------------------

STREAMS = ("a", "b")
VALUE_BYTES = 100
RELAY_MAX_ENTRIES = 40  # what the relay bound holds, in entries of VALUE_BYTES


def relay_max_bytes() -> int:
    return RELAY_MAX_ENTRIES * entry_cost(value_tx(0))


def value_tx(n: int) -> Transaction:
    return Transaction(b"p", n, None, bytes([n % 256]) * VALUE_BYTES)


def joined_mesh() -> Mesh:
    # Few dedupe keys and reports to speak of, so the bound is mostly held entries.
    limits = Limits(
        relay_buffer_max_bytes=relay_max_bytes(), dedupe_window_entries=1, report_log_entries=4
    )
    mesh = Mesh(Topology({r: STREAMS for r in range(3)}), limits)
    for _ in range(300):
        mesh.step_ms()
    return mesh


def produce(mesh: Mesh, stream: str, n: int) -> None:
    request = ProduceRequest(len(mesh.replies) + 10_000 + n, stream, value_tx(n))
    mesh.running(0).produce(request, START_UNIX_MS + mesh.now, mesh.now)


def check_budgets(mesh: Mesh) -> None:
    for relay in range(3):
        assert memory.accounting_errors(mesh.running(relay)) == []


def test_a_busy_stream_evicts_another_streams_committed_entries() -> None:
    mesh = joined_mesh()
    for n in range(RELAY_MAX_ENTRIES):  # stream a fills the relay's budget
        produce(mesh, "a", n)
        for _ in range(20):
            mesh.step_ms()
    for n in range(2 * RELAY_MAX_ENTRIES):  # b takes its room, committed entries of a go
        produce(mesh, "b", n)
        for _ in range(20):
            mesh.step_ms()
            check_budgets(mesh)
    assert all(reply.outcome == Outcome.COMMITTED for _, reply in mesh.replies)
    core = mesh.running(0)
    assert core.memory.used_bytes <= core.memory.max_bytes
    held = {name: len(st.timeline) for name, st in core.streams.items()}
    assert abs(held["b"] - held["a"]) <= 2, held  # equal shares of the relay's bound
    assert core.counters["evicted_for_relay_bound"] > 0


def test_uncommitted_entries_of_all_streams_fill_the_relay() -> None:
    mesh = joined_mesh()
    mesh.crash(1)
    mesh.crash(2)  # nothing commits now
    for n in range(RELAY_MAX_ENTRIES + 4):
        produce(mesh, STREAMS[n % 2], n)
    mesh.step_ms()
    outcomes = [(reply.outcome, reply.reason) for _, reply in mesh.replies]
    assert outcomes.count((Outcome.REJECTED, "buffer_full")) == 4, outcomes
    core = mesh.running(0)
    # Entries were admitted within the bound; the reports on them came after (5.10).
    reports = sum(st.timeline.report_log_bytes for st in core.streams.values())
    assert core.memory.used_bytes - reports <= core.memory.max_bytes


def test_a_reload_resizes_what_the_limits_sized_and_the_accounts_stay_right() -> None:
    """RelayCore.reload_topology with other limits (a reloaded file): the relay-wide
    budget, the report log, the late pile and the vote tally take the new bounds at once;
    the memory accounts still match what the streams hold, and the mesh commits on. A
    limit every relay must hold alike, or one the links were made with, is refused."""
    mesh = joined_mesh()
    for n in range(8):
        produce(mesh, "a", n)
        for _ in range(20):
            mesh.step_ms()
    core = mesh.running(0)
    assert len(core.streams["a"].report_log) == 4  # full: report_log_entries
    before = mesh.limits
    wider = dataclasses.replace(
        before,
        relay_buffer_max_bytes=2 * before.relay_buffer_max_bytes,
        report_log_entries=2,
        late_max_entries=7,
        max_pending_vote_points=99,
    )
    for relay in range(3):
        running = mesh.running(relay)
        running.reload_topology(CoreConfig(relay, mesh.topology, wider))
        assert running.limits is wider and running.memory.max_bytes == wider.relay_buffer_max_bytes
        for st in running.streams.values():
            assert st.report_log.maxlen == 2 and len(st.report_log) <= 2
            assert st.timeline.late_max_entries == 7 and st.votes.max_points == 99
        assert memory.accounting_errors(running) == []
    for n in range(8, 16):
        produce(mesh, "b", n)
        for _ in range(20):
            mesh.step_ms()
            check_budgets(mesh)
    assert [reply.outcome for _, reply in mesh.replies] == [Outcome.COMMITTED] * 16
    for name in ("dedupe_window_entries", "heartbeat_interval_ms"):
        other = dataclasses.replace(wider, **{name: getattr(wider, name) + 1})
        with pytest.raises(ConfigError, match=f"changes limits \\['{name}'\\]"):
            core.reload_topology(CoreConfig(0, mesh.topology, other))
    assert core.limits is wider


def test_a_relay_with_a_lower_max_tx_bytes_fills_a_larger_transaction_from_its_peers() -> None:
    """Half way through a reload of a higher max_tx_bytes (relays 0 and 1 took it, relay 2
    not yet): relay 2 drops the TxBatch of a transaction above its bound, as a bad frame,
    and fills it from its peers like a lost frame, so every relay delivers it."""
    mesh = Mesh(Topology({r: STREAMS for r in range(3)}), Limits(max_tx_bytes=4_096))
    for _ in range(300):
        mesh.step_ms()
    higher = dataclasses.replace(mesh.limits, max_tx_bytes=4 * mesh.limits.max_tx_bytes)
    for relay in (0, 1):
        mesh.running(relay).reload_topology(CoreConfig(relay, mesh.topology, higher))
    big = Transaction(b"p", 1, None, b"v" * (2 * mesh.limits.max_tx_bytes))
    mesh.running(0).produce(ProduceRequest(1, "a", big), START_UNIX_MS + mesh.now, mesh.now)
    for _ in range(2_000):
        mesh.step_ms()
        if all(mesh.delivered(r, "a") for r in range(3)):
            break
    assert [reply.outcome for _, reply in mesh.replies] == [Outcome.COMMITTED]
    assert mesh.running(2).counters["frame_bad_field"] > 0
    assert all(len(mesh.delivered(r, "a")) == 1 for r in range(3))
