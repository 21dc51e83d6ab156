"""Spooling (docs/protocol.md 5.14): a member votes only while its spool has room for what
it holds, hands its spool what it voted for, and producers hear when fewer than a quorum
of members can spool."""

from __future__ import annotations

from typing import Any

from relay.core.config import Limits, Topology
from relay.core.machine import RelayCore
from relay.core.messages import Outcome, RejectReason, Transaction
from relay.core.shell import ProduceReply, ProduceRequest
from relay.sim.script import START_UNIX_MS, Mesh
from relay.sim.spools import SimSpool, voted_unspooled_bytes

STREAM = "s"


class SpooledMesh:
    """A scripted mesh whose relays each keep a simulated spool, told and fed every turn
    as the node does."""

    def __init__(self) -> None:
        self.mesh = Mesh(Topology({0: (STREAM,), 1: (STREAM,), 2: (STREAM,)}), Limits())
        self.spools = {r: SimSpool() for r in self.mesh.ids}
        self.request_id = 0
        self.step(300)  # join

    def step(self, ms: int = 1) -> None:
        mesh = self.mesh
        for _ in range(ms):
            for r, spool in self.spools.items():
                spool.tell(mesh.running(r))
            mesh.step_ms()
            for r, spool in self.spools.items():
                core = mesh.running(r)
                spool.feed(core, [STREAM])
                assert not spool.broken_promise(core), f"relay {r}: {spool.broken_promise(core)}"

    def produce(self, relay: int, n: int) -> int:
        self.request_id += 1
        tx = Transaction(b"p", n, None, b"v%d" % n)
        core = self.mesh.running(relay)
        core.produce(ProduceRequest(self.request_id, STREAM, tx), START_UNIX_MS + self.mesh.now)
        return self.request_id

    def reply(self, request_id: int) -> ProduceReply | None:
        return next((r for r in self.mesh.all_replies if r.request_id == request_id), None)

    def fill(self, relay: int) -> None:
        """Leave the spool room only for what the relay owes for its votes."""
        self.spools[relay].shrink(self.mesh.running(relay), 0)

    def spooled(self, relay: int) -> set[int]:
        return self.spools[relay].seqs.get(STREAM, set())


def stall_of(core: RelayCore) -> dict[str, Any]:
    streams = core.status()["streams"]
    assert isinstance(streams, dict)
    stall: dict[str, Any] = streams[STREAM]["stall"]
    return stall


def test_a_full_spool_withholds_votes_and_the_others_commit_without_it() -> None:
    m = SpooledMesh()
    m.fill(0)  # room for nothing more: full as soon as it holds something
    core0 = m.mesh.running(0)
    voted_before = core0.streams[STREAM].timeline.voted_through
    ids = [m.produce(1, n) for n in range(5)]
    m.step(50)
    assert core0.status()["spool_full"]
    assert stall_of(core0)["reason"] == "spool_full"
    replies = [m.reply(i) for i in ids]
    assert all(r is not None and r.outcome is Outcome.COMMITTED for r in replies)
    seqs = {r.seq for r in replies if r is not None}
    # Relay 0 reported nothing more, yet learnt the commit; its spool took none of what it
    # did not vote for, the others' spools took all of it.
    assert core0.streams[STREAM].timeline.voted_through == voted_before
    assert core0.committed_point(STREAM) >= max(seqs)
    assert not seqs & m.spooled(0)
    assert seqs <= m.spooled(1) and seqs <= m.spooled(2)
    assert core0.spool_waiting_streams() == [STREAM]
    # The store took its spool: room again, and the records that waited are handed over.
    m.spools[0].free()
    m.step(20)
    assert not core0.status()["spool_full"]
    assert seqs <= m.spooled(0)
    assert core0.spool_waiting_streams() == []


def test_fewer_than_a_quorum_with_room_refuses_new_produces_until_room_returns() -> None:
    m = SpooledMesh()
    m.fill(0)
    m.fill(1)
    stuck = m.produce(2, 0)  # taken: nobody is full yet; then 0 and 1 hold it, full
    m.step(50)  # their heartbeats tell relay 2
    core2 = m.mesh.running(2)
    assert m.reply(stuck) is None  # relay 2's vote alone cannot commit it
    assert core2.status()["spool_full_peers"] == [0, 1]
    stall = stall_of(core2)
    assert stall["reason"] == "store_backlog_full" and stall["waiting_for"] == [0, 1]
    refused = m.produce(2, 1)
    m.step(5)
    reply = m.reply(refused)
    assert reply is not None and reply.outcome is Outcome.REJECTED
    assert reply.reason == RejectReason.STORE_BACKLOG_FULL.value
    assert core2.counters["produce_store_backlog_full"] == 1
    # One of them gets room back: a quorum can spool, produces commit again.
    m.spools[1].free()
    m.step(20)
    accepted = m.produce(2, 2)
    m.step(50)
    for request in (stuck, accepted):
        reply = m.reply(request)
        assert reply is not None and reply.outcome is Outcome.COMMITTED
        assert reply.seq in m.spooled(1) and reply.seq in m.spooled(2)


def test_what_a_member_voted_for_before_its_spool_filled_is_spooled() -> None:
    m = SpooledMesh()
    ids = [m.produce(0, n) for n in range(3)]
    m.step(1)  # issued and sent; the members report as the batch arrives
    for relay in (0, 1, 2):
        m.fill(relay)  # room for exactly what each owes for its votes so far
    m.step(60)
    committed = {r.seq for i in ids if (r := m.reply(i)) and r.outcome is Outcome.COMMITTED}
    for relay in (0, 1, 2):
        core = m.mesh.running(relay)
        voted = core.streams[STREAM].timeline.voted_through
        owed = {seq for seq in committed if seq <= voted}
        assert owed <= m.spooled(relay)
        assert voted_unspooled_bytes(core, m.spools[relay]) <= m.spools[relay].room_bytes()
    # Every acknowledged write reached a spool.
    everywhere = m.spooled(0) | m.spooled(1) | m.spooled(2)
    assert committed <= everywhere


def test_without_a_spool_nothing_changes() -> None:
    mesh = Mesh(Topology({0: (STREAM,), 1: (STREAM,), 2: (STREAM,)}), Limits())
    for _ in range(300):
        mesh.step_ms()
    core = mesh.running(0)
    core.produce(ProduceRequest(1, STREAM, Transaction(b"p", 1, None, b"v")), START_UNIX_MS + 300)
    for _ in range(50):
        mesh.step_ms()
    assert core.status()["spool_full"] is False
    _, _, records = core.spool_records(STREAM, -1, 10)
    assert [tx.value for _, _, tx, _ in records] == [b"v"]
