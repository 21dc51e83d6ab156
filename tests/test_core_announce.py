"""Who announces a commit at once (docs/protocol.md 5.4): only a member that others may need
it from; the rest announce lazily, with their next Reports or a heartbeat interval later."""

from __future__ import annotations

from relay.core.commit import others_announce
from relay.sim.script import Interpreter

POINT = 10**17  # any point above what the stream committed


def mesh(*commands: str) -> Interpreter:
    interp = Interpreter()
    for command in ("topology 0:s 1:s 2:s", "stabilize", *commands):
        interp.execute(command)
    return interp


def lazy(interp: Interpreter, relay: int, reporters: tuple[int, ...]) -> bool:
    core = interp.m.nodes[relay].core
    assert core is not None
    mask = sum(1 << r for r in reporters)
    return others_announce(core, core.streams["s"], POINT, mask)


def test_the_lowest_member_that_commits_without_its_own_report_announces_at_once() -> None:
    interp = mesh()
    # Relay 0 coordinated; relays 1 and 2 reported. Relay 2's report came last, so its own
    # is not acknowledged: it needs an announcement. Relay 0 counts both reports, needs
    # none of its own, and is the lowest such member: it announces at once.
    assert not lazy(interp, 0, (1, 2))
    # The members leave it to relay 0.
    assert lazy(interp, 1, (1, 2))
    assert lazy(interp, 2, (1, 2))
    # Reports of 0 and 1: relay 2 is live and has joined, so its report is counted on
    # (each of 0 and 1 then hears two besides its own): 0 and 1 leave it. Relay 2, which
    # committed without a report of its own, will not report there any more: it
    # announces at once.
    assert lazy(interp, 0, (0, 1))
    assert lazy(interp, 1, (0, 1))
    assert not lazy(interp, 2, (0, 1))


def test_a_member_that_will_not_report_is_not_counted_on() -> None:
    # Relay 2 down: relays 0 and 1 may each lack the other's ack, and nobody lower than
    # them commits without its own report: both announce at once.
    interp = mesh("crash 2", "tick 400")  # suspected by now
    assert not lazy(interp, 0, (0, 1))
    assert not lazy(interp, 1, (0, 1))
    # Live but not joined (as its heartbeats said): not counted on either.
    interp = mesh()
    core = interp.m.nodes[0].core
    assert core is not None
    core.peers[2].joined["s"] = False
    assert not lazy(interp, 0, (0, 1))
    # Joined, live, but deaf by its last heartbeat: it holds nothing to report.
    interp = mesh()
    core = interp.m.nodes[0].core
    assert core is not None
    assert core.peers[2].heartbeat_ms >= 0  # it said whom it hears
    core.peers[2].hears = frozenset()
    assert not lazy(interp, 0, (0, 1))


def test_nobody_needs_it_when_every_member_counts_alone_or_another_announced() -> None:
    interp = mesh()
    for relay in (0, 1, 2):
        assert lazy(interp, relay, (0, 1, 2))  # more than a quorum reported
    core = interp.m.nodes[0].core
    assert core is not None
    core.streams["s"].others_announced = POINT  # another member announced it already
    assert lazy(interp, 0, (1, 2))


def test_a_silent_lower_member_is_not_relied_on() -> None:
    interp = mesh("crash 0", "tick 400")  # suspected by now
    assert not lazy(interp, 1, (1, 2))
    assert not lazy(interp, 2, (1, 2))
