"""A client's batch handed to the core at once (`produce_many`) is taken exactly as the
same produces one by one: the same answers, the same committed timeline."""

from __future__ import annotations

import copy
import functools

from hypothesis import given, settings
from hypothesis import strategies as hs

from relay.core.config import Limits, Topology
from relay.core.machine import RelayCore
from relay.core.messages import Outcome, Transaction
from relay.core.shell import ProduceReply, ProduceRequest
from relay.sim.script import START_UNIX_MS, Mesh


def joined_mesh() -> Mesh:
    mesh = Mesh(Topology({0: ("s",), 1: ("s",), 2: ("s",)}), Limits(max_tx_bytes=200))
    for _ in range(300):  # join
        mesh.step_ms()
    return mesh


def batch() -> list[ProduceRequest]:
    """Fresh transactions, a retry within the batch, another transaction under a taken
    producer seq, one too large, and a stream nobody serves."""
    txs = [Transaction(b"p", n, None, b"v%d" % n) for n in range(5)]
    return [
        *(ProduceRequest(n + 1, "s", tx) for n, tx in enumerate(txs)),
        ProduceRequest(6, "s", txs[2]),
        ProduceRequest(7, "s", Transaction(b"p", 3, None, b"other")),
        ProduceRequest(8, "s", Transaction(b"p", 9, None, b"x" * 300)),
        ProduceRequest(9, "nope", Transaction(b"p", 10, None, b"v")),
    ]


def run(mesh: Mesh, together: bool) -> tuple[list[ProduceReply], list[tuple[int, bytes]]]:
    core = mesh.running(0)
    requests = batch()
    if together:
        core.produce_many(requests, START_UNIX_MS + mesh.now, mesh.now)
    else:
        for request in requests:
            core.produce(request, START_UNIX_MS + mesh.now, mesh.now)
    for _ in range(100):
        mesh.step_ms()
    replies = sorted(mesh.all_replies, key=lambda r: r.request_id)
    committed = [(seq, tx.value) for seq, tx in sorted(mesh.committed["s"].items())]
    return replies, committed


def test_a_batch_is_taken_like_its_produces_one_by_one() -> None:
    replies, committed = run(joined_mesh(), together=True)
    assert (replies, committed) == run(joined_mesh(), together=False)
    outcomes = [(r.request_id, r.outcome, r.reason) for r in replies]
    assert outcomes[:6] == [(n, Outcome.COMMITTED, "") for n in range(1, 7)]
    assert replies[5].seq == replies[2].seq  # the retry got the first copy's seq
    assert [o[1:] for o in outcomes[6:]] == [
        (Outcome.REJECTED, "duplicate_mismatch"),
        (Outcome.REJECTED, "too_large"),
        (Outcome.REJECTED, "unknown_stream"),
    ]
    assert [value for _, value in committed] == [b"v%d" % n for n in range(5)]


def test_a_fenced_stream_fences_every_produce_of_a_batch() -> None:
    mesh = joined_mesh()
    mesh.crash(1)
    mesh.crash(2)
    for _ in range(1000):  # the survivor notices it lost its quorum
        mesh.step_ms()
    core = mesh.running(0)
    assert core.fenced("s")
    core.produce_many(batch()[:5], START_UNIX_MS + mesh.now, mesh.now)
    mesh.step_ms()
    assert {r.outcome for r in mesh.all_replies} == {Outcome.FENCED}
    assert len(mesh.all_replies) == 5


# --- any batch, tight bounds ----------------------------------------------------------------

# The buffer's bound in entries binds first (committed entries make room, then it is
# full), or its bound in bytes, or the relay's, or the pending produces' bound does.
SMALL = {"max_tx_bytes": 200, "dedupe_window_entries": 4, "report_log_entries": 4}
TIGHT = (
    Limits(**SMALL, buffer_max_entries=6, max_pending_produces=8),
    Limits(**SMALL, buffer_max_bytes=5_000, max_pending_produces=8),
    Limits(**SMALL, relay_buffer_max_bytes=5_000, max_pending_produces=8),
    Limits(**SMALL, buffer_max_entries=12, max_pending_produces=4),
)


@functools.cache
def _tight_mesh(limits: Limits) -> Mesh:
    """Relay 0 serves "s" and forwards "t"; four produces of "s" are committed, so the
    dedupe window and eviction come into play."""
    mesh = Mesh(Topology({0: ("s",), 1: ("s", "t"), 2: ("s", "t")}), limits)
    for _ in range(300):
        mesh.step_ms()
    core = mesh.running(0)
    for n in range(4):
        tx = Transaction(b"p", n, None, b"v%d" % n)
        core.produce(ProduceRequest(1000 + n, "s", tx), START_UNIX_MS + mesh.now, mesh.now)
    for _ in range(100):
        mesh.step_ms()
    assert len(mesh.committed["s"]) == 4
    return mesh


def _state(core: RelayCore) -> object:
    """What taking produces changes in the core, before anything is published."""
    st = core.streams["s"]
    return (
        st.timeline.seqs[st.timeline.head :],
        st.timeline.memory_bytes,
        st.out_entries,
        [
            (seq, p.tx, [(w.request_id, w.origin) for w in p.waiters], p.deadline_ms)
            for seq, p in st.pending.by_seq.items()
        ],
        dict(core.counters),
        core.outbox,
    )


def _together_as_alone(limits: Limits, requests: list[ProduceRequest]) -> None:
    """`requests` as one batch and one by one, each on a copy of the tight mesh: the same
    core state, within the bounds, then the same answers and commits."""
    together, alone = copy.deepcopy(_tight_mesh(limits)), copy.deepcopy(_tight_mesh(limits))
    now = together.now
    together.running(0).produce_many(requests, START_UNIX_MS + now, now)
    for request in requests:
        alone.running(0).produce(request, START_UNIX_MS + now, now)
    assert _state(together.running(0)) == _state(alone.running(0))
    tl = together.running(0).streams["s"].timeline
    assert len(tl) <= limits.buffer_max_entries
    assert tl.memory_bytes <= limits.buffer_max_bytes
    assert tl.budget.used_bytes <= limits.relay_buffer_max_bytes
    for mesh in (together, alone):
        for _ in range(100):
            mesh.step_ms()
    assert together.all_replies == alone.all_replies
    assert together.committed == alone.committed


produces = hs.lists(
    hs.tuples(
        hs.sampled_from(["s"] * 6 + ["t", "nope"]),
        hs.integers(0, 20),  # producer seq: 0-3 committed, the rest may repeat in the batch
        hs.sampled_from([b"v", b"v", b"v", b"w", b"x" * 300]),  # w: another value; x...: too large
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=300)  # bounds bind at one point of a batch: let many batches find it
@given(hs.sampled_from(TIGHT), produces)
def test_any_batch_is_taken_like_its_produces_one_by_one_within_the_bounds(
    limits: Limits, items: list[tuple[str, int, bytes]]
) -> None:
    requests = [
        ProduceRequest(n, stream, Transaction(b"p", pseq, None, value))
        for n, (stream, pseq, value) in enumerate(items)
    ]
    _together_as_alone(limits, requests)


@settings(max_examples=300)
@given(hs.sampled_from(TIGHT), hs.lists(hs.integers(0, 150), min_size=2, max_size=30))
def test_a_plain_batch_at_the_bounds_evicts_what_its_produces_one_by_one_would(
    limits: Limits, lengths: list[int]
) -> None:
    """The common batch (fresh produces of one stream) meeting a buffer its committed
    entries fill: taken at once, it evicts what its produces would one by one, or, where
    the relay's bound or the room runs out, goes one by one from there."""
    requests = [
        ProduceRequest(n, "s", Transaction(b"q", 100 + n, None, b"v" * length))
        for n, length in enumerate(lengths)
    ]
    _together_as_alone(limits, requests)
