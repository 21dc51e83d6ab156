"""A produce's deadline (5.4): a produce still pending when it passes is answered
`unknown`, at that millisecond and in the order the produces came; a produce or forward
answered before leaves no deadline behind for the relay to wake up for."""

from __future__ import annotations

from relay.core.config import Limits, Topology
from relay.core.messages import Outcome, Transaction
from relay.core.shell import ProduceRequest
from relay.sim.script import Mesh

MEMBERS = Topology({0: ("s",), 1: ("s",), 2: ("s",), 3: ("t",)})  # relay 3 forwards "s"
JOIN_MS = 300
ANSWER_WITHIN_MS = 1_000


def joined_mesh(limits: Limits) -> Mesh:
    mesh = Mesh(MEMBERS, limits)
    for _ in range(JOIN_MS):
        mesh.step_ms()
    return mesh


def produce(mesh: Mesh, relay: int, request_id: int) -> int:
    """A produce of stream s at `relay`; its deadline."""
    tx = Transaction(b"p", request_id, None, b"v%d" % request_id)
    mesh.running(relay).produce(ProduceRequest(request_id, "s", tx), mesh.clock(relay), mesh.now)
    return mesh.now + mesh.limits.produce_timeout_ms


def answers_until(mesh: Mesh, count: int, last_ms: int) -> dict[int, tuple[int, Outcome]]:
    """Step until `count` replies came (or `last_ms`): request id -> (when, outcome)."""
    seen: dict[int, tuple[int, Outcome]] = {}
    while len(seen) < count and mesh.now <= last_ms:
        mesh.step_ms()
        for _, reply in mesh.replies:
            seen.setdefault(reply.request_id, (mesh.now, reply.outcome))
        mesh.replies.clear()
    return seen


def test_an_answered_produce_or_forward_names_no_deadline() -> None:
    mesh = joined_mesh(Limits())
    coordinator, forwarder = mesh.running(0), mesh.running(3)
    produce_due = produce(mesh, 0, 1)
    forward_due = produce(mesh, 3, 2)
    assert coordinator.next_deadline_ms() <= produce_due
    assert len(forwarder.forwards) == 1
    answers = answers_until(mesh, 2, mesh.now + ANSWER_WITHIN_MS)
    assert {rid: outcome for rid, (_, outcome) in answers.items()} == {
        1: Outcome.COMMITTED,
        2: Outcome.COMMITTED,
    }
    assert not coordinator.streams["s"].pending.by_seq and not forwarder.forwards
    # Until the deadlines pass, neither relay is due at them: between two heartbeats each
    # would otherwise be woken at its answered produce's deadline.
    while mesh.now <= max(produce_due, forward_due):
        assert coordinator.next_deadline_ms() != produce_due, mesh.now
        assert forwarder.next_deadline_ms() != forward_due, mesh.now
        mesh.step_ms()


def test_produces_pending_at_their_deadlines_are_unknown_then_in_order() -> None:
    timeout_ms = 40  # well within suspect_timeout_ms: nobody is suspected meanwhile
    limits = Limits(produce_timeout_ms=timeout_ms)
    assert limits.suspect_timeout_ms > 2 * timeout_ms
    mesh = joined_mesh(limits)
    for member in (1, 2):  # relay 0 publishes, but hears no report: nothing commits
        mesh.links[(member, 0)].held = True
    for member in (0, 1, 2):  # and relay 3 no answer to its forward
        mesh.links[(member, 3)].held = True
    first = produce(mesh, 0, 1)
    forwarded = produce(mesh, 3, 2)
    for _ in range(10):
        mesh.step_ms()
    second = produce(mesh, 0, 3)
    answers = answers_until(mesh, 3, second + 1)
    assert answers == {
        1: (first, Outcome.UNKNOWN),
        2: (forwarded, Outcome.UNKNOWN),
        3: (second, Outcome.UNKNOWN),
    }
    assert not mesh.running(0).streams["s"].pending.by_seq and not mesh.running(3).forwards
