"""A client's batch handed to the core at once (`produce_many`) is taken exactly as the
same produces one by one: the same answers, the same committed timeline."""

from __future__ import annotations

from relay.core.config import Limits, Topology
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
