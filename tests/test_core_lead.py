"""Leads (docs/protocol.md 5.2): a member that coordinated nothing of a stream for
LEAD_IDLE_MS promises in its Reports not to coordinate it at or below its lead, and keeps
that promise when it coordinates after all."""

from __future__ import annotations

from relay.core import coordinate
from relay.core.config import Limits, Topology
from relay.core.messages import Outcome, Transaction
from relay.core.seq import ms_of
from relay.core.shell import ProduceRequest
from relay.sim.script import START_UNIX_MS, Mesh


def joined_mesh() -> Mesh:
    mesh = Mesh(Topology({0: ("s",), 1: ("s",), 2: ("s",)}), Limits())
    for _ in range(300):  # join
        mesh.step_ms()
    return mesh


def produce(mesh: Mesh, relay: int, request_id: int) -> int:
    """The committed seq of a fresh transaction produced through `relay`."""
    tx = Transaction(b"p", request_id, None, b"v")
    mesh.running(relay).produce(
        ProduceRequest(request_id, "s", tx), START_UNIX_MS + mesh.now, mesh.now
    )
    for _ in range(50):
        mesh.step_ms()
    reply = next(r for r in mesh.all_replies if r.request_id == request_id)
    assert reply.outcome is Outcome.COMMITTED, reply
    return reply.seq


def test_a_member_coordinates_only_above_its_lead_and_then_leads_no_more() -> None:
    mesh = joined_mesh()
    produce(mesh, 0, 1)  # relays 1 and 2 report it: their Reports carry leads
    member = mesh.running(1)
    st = member.streams["s"]
    led = st.lead
    assert led > 0 and ms_of(led) > ms_of(member.clock.floor)  # ahead of its floor
    seq = produce(mesh, 1, 2)
    assert seq > led  # the promise held
    assert ms_of(seq) - ms_of(led) <= 1  # right past it, not further
    assert coordinate.lead(member, st, mesh.now) == -1  # it coordinates now: no lead
    assert st.lead == led  # and the old one still binds


def test_a_member_leads_again_after_lead_idle_ms() -> None:
    mesh = joined_mesh()
    produce(mesh, 1, 1)
    member = mesh.running(1)
    st = member.streams["s"]
    assert coordinate.lead(member, st, mesh.now) == -1
    for _ in range(coordinate.LEAD_IDLE_MS):
        mesh.step_ms()
    lead = coordinate.lead(member, st, mesh.now)
    assert ms_of(lead) >= ms_of(member.clock.floor) + coordinate.LEAD_MS
