"""The coordinator's buffer bound: committed entries make room, uncommitted ones do not."""

from __future__ import annotations

from relay.core.config import Limits, Topology
from relay.core.messages import Outcome, Transaction
from relay.core.shell import ProduceRequest
from relay.sim.script import START_UNIX_MS, Mesh

STREAM = "s"
BUFFER_MAX_ENTRIES = 5


def joined_mesh() -> Mesh:
    limits = Limits(buffer_max_entries=BUFFER_MAX_ENTRIES)
    mesh = Mesh(Topology({0: (STREAM,), 1: (STREAM,), 2: (STREAM,)}), limits)
    for _ in range(300):
        mesh.step_ms()
    return mesh


def produce(mesh: Mesh, n: int) -> None:
    tx = Transaction(b"p", n, None, b"v%d" % n)
    mesh.running(0).produce(ProduceRequest(n + 1, STREAM, tx), START_UNIX_MS + mesh.now, mesh.now)


def outcomes(mesh: Mesh) -> list[tuple[Outcome, str]]:
    return [(reply.outcome, reply.reason) for _, reply in mesh.replies]


def test_a_buffer_full_of_committed_entries_evicts_to_take_more() -> None:
    mesh = joined_mesh()
    for n in range(4 * BUFFER_MAX_ENTRIES):
        produce(mesh, n)
        for _ in range(20):
            mesh.step_ms()
    assert outcomes(mesh) == [(Outcome.COMMITTED, "")] * (4 * BUFFER_MAX_ENTRIES)
    core = mesh.running(0)
    assert core.status()["streams"][STREAM]["held"] == BUFFER_MAX_ENTRIES  # type: ignore[index]


def test_uncommitted_entries_fill_the_buffer() -> None:
    mesh = joined_mesh()
    mesh.crash(1)
    mesh.crash(2)  # nothing commits now
    for n in range(BUFFER_MAX_ENTRIES + 2):
        produce(mesh, n)
    mesh.step_ms()
    refused = [o for o in outcomes(mesh) if o == (Outcome.REJECTED, "buffer_full")]
    assert len(refused) == 2
