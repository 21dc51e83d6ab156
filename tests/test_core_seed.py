"""A relay starting without history takes the stored last point (RelayCore.seed)."""

from __future__ import annotations

import pytest

from relay.core import digest as dg
from relay.core.config import Limits, Topology
from relay.core.messages import Transaction
from relay.core.seq import EPOCH_MS
from relay.core.shell import ProduceRequest
from relay.sim.script import START_UNIX_MS, Mesh

STREAM = "s"
# A committed point from "before the restart": a flake seq one second before the start.
STORED_POINT = (START_UNIX_MS - EPOCH_MS - 1_000) << 22
STORED_DIGEST = dg.chain(dg.genesis(STREAM), STORED_POINT, b"\x07" * 16)


def fresh_mesh(relays: int = 3) -> Mesh:
    return Mesh(Topology({r: (STREAM,) for r in range(relays)}), Limits())


def run(mesh: Mesh, ms: int) -> None:
    for _ in range(ms):
        mesh.step_ms()


def produce(mesh: Mesh, relay: int, count: int) -> None:
    core = mesh.running(relay)
    for n in range(count):
        tx = Transaction(b"p", n, None, b"v%d" % n)
        core.produce(ProduceRequest(n + 1, STREAM, tx), START_UNIX_MS + mesh.now, mesh.now)


def check_chain_from(mesh: Mesh, relay: int, point: int, digest: bytes, count: int) -> None:
    base_point, base_digest, records = mesh.running(relay).committed_records(STREAM, -1, 1000)
    assert (base_point, base_digest) == (point, digest)
    assert len(records) == count
    for seq, after, tx, _ in records:
        assert seq > point
        digest = dg.chain(digest, seq, dg.tx_hash(tx))
        assert after == digest


@pytest.mark.parametrize("seeded", [(0,), (0, 1, 2), (2,)])
def test_every_member_continues_the_highest_seed(seeded: tuple[int, ...]) -> None:
    mesh = fresh_mesh()
    for r in seeded:
        assert mesh.running(r).seed(STREAM, STORED_POINT, STORED_DIGEST)
    run(mesh, 300)
    produce(mesh, 1, 5)
    run(mesh, 100)
    for r in range(3):
        check_chain_from(mesh, r, STORED_POINT, STORED_DIGEST, 5)
        assert mesh.running(r).counters["joined_from_seed"] == 1


def test_the_highest_of_different_seeds_wins() -> None:
    mesh = fresh_mesh()
    lower = STORED_POINT - 5_000
    assert mesh.running(0).seed(STREAM, lower, b"\x01" * 16)
    assert mesh.running(1).seed(STREAM, STORED_POINT, STORED_DIGEST)
    run(mesh, 300)
    produce(mesh, 0, 3)
    run(mesh, 100)
    for r in range(3):
        check_chain_from(mesh, r, STORED_POINT, STORED_DIGEST, 3)


def test_a_stream_of_one_relay_takes_its_seed() -> None:
    mesh = fresh_mesh(1)
    assert mesh.running(0).seed(STREAM, STORED_POINT, STORED_DIGEST)
    run(mesh, 50)
    produce(mesh, 0, 2)
    run(mesh, 50)
    check_chain_from(mesh, 0, STORED_POINT, STORED_DIGEST, 2)


def test_without_seeds_the_stream_starts_at_genesis() -> None:
    mesh = fresh_mesh()
    run(mesh, 300)
    produce(mesh, 0, 2)
    run(mesh, 100)
    base_point, base_digest, _ = mesh.running(2).committed_records(STREAM, -1, 10)
    assert (base_point, base_digest) == (0, dg.genesis(STREAM))
    assert mesh.running(2).counters["joined_from_seed"] == 0


def test_members_holding_history_win_over_a_seed() -> None:
    mesh = fresh_mesh()
    run(mesh, 300)
    produce(mesh, 0, 4)
    run(mesh, 100)
    _, _, held = mesh.running(0).committed_records(STREAM, -1, 10)
    mesh.crash(2)
    mesh.restart(2)
    # An old stored point, below what the others hold: relay 2 takes their base.
    assert mesh.running(2).seed(STREAM, held[0][0], held[0][1])
    run(mesh, 300)
    assert mesh.running(2).counters["joined_from_seed"] == 0
    assert mesh.running(2).committed_point(STREAM) == held[-1][0]


def test_seed_is_refused_once_joined_or_when_not_served() -> None:
    mesh = fresh_mesh()
    core = mesh.running(0)
    assert not core.seed("other", STORED_POINT, STORED_DIGEST)
    with pytest.raises(ValueError):
        core.seed(STREAM, 0, STORED_DIGEST)
    with pytest.raises(ValueError):
        core.seed(STREAM, STORED_POINT, b"short")
    run(mesh, 300)
    assert not core.seed(STREAM, STORED_POINT, STORED_DIGEST)
    assert core.counters["joined_from_seed"] == 0
