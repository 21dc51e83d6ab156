"""What a spool reads from the core: committed records with their chain digests."""

from __future__ import annotations

from relay.core import digest as dg
from relay.core.config import Limits, Topology
from relay.core.messages import Transaction
from relay.core.shell import ProduceRequest
from relay.sim.script import START_UNIX_MS, Mesh


def committed_mesh(count: int) -> Mesh:
    mesh = Mesh(Topology({0: ("s",), 1: ("s",), 2: ("s",)}), Limits())
    for _ in range(300):  # join
        mesh.step_ms()
    core = mesh.running(0)
    for n in range(count):
        tx = Transaction(b"p", n, None, b"v%d" % n, kind=n % 2)
        core.produce(ProduceRequest(n + 1, "s", tx), START_UNIX_MS + mesh.now, mesh.now)
    for _ in range(100):
        mesh.step_ms()
    return mesh


def test_records_carry_the_chain_and_every_relay_agrees() -> None:
    mesh = committed_mesh(5)
    seen = []
    for r in (0, 1, 2):
        base_point, base_digest, records = mesh.running(r).committed_records("s", -1, 100)
        assert [tx.value for _, _, tx, _ in records] == [b"v%d" % n for n in range(5)]
        assert [tx.kind for _, _, tx, _ in records] == [0, 1, 0, 1, 0]
        digest = base_digest
        for seq, after, tx, duplicate in records:
            assert seq > base_point and not duplicate
            digest = dg.chain(digest, seq, dg.tx_hash(tx))
            assert after == digest
        seen.append(records)
    assert seen[0] == seen[1] == seen[2]


def test_records_after_a_seq_and_bounded() -> None:
    mesh = committed_mesh(5)
    _, _, records = mesh.running(1).committed_records("s", -1, 100)
    _, _, tail = mesh.running(1).committed_records("s", records[1][0], 2)
    assert tail == records[2:4]
    assert mesh.running(1).committed_records("s", records[-1][0], 10)[2] == []
    assert mesh.running(1).committed_records("nope", -1, 10) == (-1, bytes(16), [])
