"""Transit (docs/protocol.md 5.13): frames for a relay that does not hear the sender go
through one that it hears, and what arrives that way is checked like any peer frame.
(Whole meshes with cut links: tests/scenarios/transit.txt and the simulator's
crash-cut-link single fault.)"""

from __future__ import annotations

import itertools

from relay.core import CoreConfig, Limits, RelayCore, Topology, codec
from relay.core.messages import Heartbeat, Relayed, RepairRequest

T0 = 1_800_000_000_000
LIMITS = Limits(heartbeat_interval_ms=20, suspect_timeout_ms=150, max_frame_bytes=4096)
TOPOLOGY = Topology({0: ("s",), 1: ("s",), 2: ("s",)})


def relay(relay_id: int) -> RelayCore:
    core = RelayCore(CoreConfig(relay_id, TOPOLOGY, LIMITS), 1, T0)
    core.tick(T0, 0)
    core.ready()
    return core


def heartbeat(sender: int, hears: tuple[int, ...], wall_ms: int = T0) -> bytes:
    return codec.encode(Heartbeat(sender, 1, 0, (), wall_ms=wall_ms, hears=hears))


def relayed(sender: int, target: int, to: int, frame: bytes) -> bytes:
    return codec.encode(Relayed(sender, 1, 0, target, to, frame))


def test_a_peer_not_heard_directly_is_reached_through_a_relay_that_passes_its_frames_on() -> None:
    core = relay(0)
    core.receive(heartbeat(2, (0, 1)), T0, 1)  # 2 hears everyone, straight to us
    core.receive(relayed(2, 0, 0, heartbeat(1, (2,))), T0, 1)  # 1 only through 2
    core.tick(T0, 2)
    status = core.status()
    assert status["peers_heard"] == [1, 2]  # 1 is live: it reaches us through 2
    assert core.counters["transit_received"] == 1
    # Our heartbeat says whom we hear directly: 2 only, so 1 knows to go through 2.
    beats = [
        codec.decode(out.frame, 1 << 20) for out in core.ready().outgoing if out.target is None
    ]
    assert beats and all(isinstance(b, Heartbeat) and b.hears == (2,) for b in beats)


def test_messages_for_a_peer_that_does_not_hear_us_go_through_one_that_does() -> None:
    core = relay(0)
    core.receive(heartbeat(2, (0, 1)), T0, 1)
    core.receive(relayed(2, 0, 0, heartbeat(1, (2,))), T0, 1)  # 1 does not hear us
    core.tick(T0, 2)
    core.ready()
    core.send(RepairRequest(0, 1, 0, 1, "s", 9, 0, 10, -1))  # addressed to relay 1
    (out,) = core.ready().outgoing
    assert out.target == 2  # the relay that hears us and that 1 hears
    hop = codec.decode(out.frame, codec.peer_frame_limit(LIMITS.max_frame_bytes))
    assert isinstance(hop, Relayed) and hop.to == 1 and hop.target == 2
    inner = codec.decode(hop.frame, LIMITS.max_frame_bytes)
    assert isinstance(inner, RepairRequest) and inner.target == 1


def test_the_relay_in_between_passes_the_frame_on_unchanged() -> None:
    core = relay(2)
    inner = codec.encode(RepairRequest(0, 1, 0, 1, "s", 9, 0, 10, -1))
    core.receive(relayed(0, 2, 1, inner), T0, 1)
    (out,) = [o for o in core.ready().outgoing if o.target is not None]
    hop = codec.decode(out.frame, codec.peer_frame_limit(LIMITS.max_frame_bytes))
    assert out.target == 1 and isinstance(hop, Relayed)
    assert (hop.sender, hop.to, hop.frame) == (2, 1, inner)
    assert core.counters["transit_passed"] == 1


def test_bad_relayed_frames_are_counted_and_change_nothing() -> None:
    core = relay(0)
    bad = [
        # the relay in between claims the frame inside is its own
        relayed(2, 0, 0, heartbeat(2, (0, 1))),
        # a Relayed inside a Relayed
        relayed(2, 0, 0, relayed(1, 0, 0, heartbeat(1, (2,)))),
        # the frame inside is about us, from us
        relayed(2, 0, 0, heartbeat(0, (1, 2))),
        # not a frame at all inside
        relayed(2, 0, 0, b"\xc1"),
        # passed on to a relay outside the topology, or back to its sender
        relayed(2, 0, 9, heartbeat(2, (0, 1))),
        relayed(2, 0, 2, heartbeat(2, (0, 1))),
        # a frame inside larger than max_frame_bytes
        relayed(2, 0, 0, b"\x00" * (LIMITS.max_frame_bytes + 1)),
    ]
    for frame in bad:
        core.receive(frame, T0, 1)
    assert core.counters["transit_received"] == 0
    assert core.counters["transit_passed"] == 0
    assert not [o for o in core.ready().outgoing if o.target is not None]
    assert core.peers[1].incarnation == -1  # nothing of relay 1's was taken
    errors = (
        core.counters["frame_bad_field"]
        + core.counters["frame_malformed"]
        + core.counters["frame_oversized"]
    )
    assert errors == len(bad), dict(core.counters)


def test_a_plain_frame_above_max_frame_bytes_is_refused_even_within_a_relayeds_allowance() -> None:
    core = relay(0)
    padded = Heartbeat(1, 1, 0, (), hears=(2,) * (LIMITS.max_frame_bytes + 8))
    frame = codec.encode(padded)
    assert LIMITS.max_frame_bytes < len(frame) <= codec.peer_frame_limit(LIMITS.max_frame_bytes)
    core.receive(frame, T0, 1)
    assert core.counters["frame_oversized"] == 1
    assert core.status()["peers_heard"] == []


def test_a_heartbeat_passed_on_from_a_peer_heard_directly_is_ignored() -> None:
    core = relay(0)
    core.receive(heartbeat(1, (0, 2)), T0, 1)
    core.tick(T0, 2)
    core.receive(relayed(2, 0, 0, heartbeat(1, (2,))), T0, 3)  # an older path's copy
    assert core.counters["transit_received"] == 0
    assert core.peers[1].hears == frozenset({0, 2})


# --- outages do not widen a peer's timeout (5.2 suspicion) -------------------------------------


def _beats(core: RelayCore, sender: int, start_ms: int, count: int) -> int:
    """`count` heartbeats of `sender`, one per heartbeat interval from `start_ms`; the
    time of the last."""
    for k in range(count):
        at = start_ms + k * LIMITS.heartbeat_interval_ms
        core.receive(heartbeat(sender, (0, 1, 2), T0 + at), T0 + at, at)
        core.tick(T0 + at, at)
    return start_ms + (count - 1) * LIMITS.heartbeat_interval_ms


def test_a_late_heartbeat_widens_the_timeout_but_an_outage_does_not() -> None:
    from relay.core import links

    core = relay(0)
    last = _beats(core, 1, 1, 10)
    base = LIMITS.suspect_timeout_ms
    assert links.timeout_ms(core, core.peers[1]) == base
    # 400 ms late, the connection open all along: a slow pace, the timeout widens.
    last = _beats(core, 1, last + 400, 1)
    assert links.timeout_ms(core, core.peers[1]) == 3 * 400
    # Its gaps decay back to the base timeout.
    last = _beats(core, 1, last + LIMITS.heartbeat_interval_ms, 60)
    assert links.timeout_ms(core, core.peers[1]) == base
    # A partition: silent for longer than any timeout, then heard again.
    last = _beats(core, 1, last + 5_000, 2)
    assert links.timeout_ms(core, core.peers[1]) == base
    # 400 ms again, but its connection closed meanwhile (a cut link the transport gave up
    # on, a stopped process): an outage too.
    core.peer_lost(1, T0 + last + 200, last + 200)
    last = _beats(core, 1, last + 400, 1)
    assert links.timeout_ms(core, core.peers[1]) == base
    assert core.counters["heartbeat_gap_outage"] == 2


def test_a_relay_that_dies_just_after_a_heal_is_cut_within_its_usual_timeout() -> None:
    """5 relays, stream b on relays 0-2; a partition {0, 1} | {2, 3, 4} for 2 s heals
    with the links to relays 3 and 4 first (relays 0 and 1 hear relay 2 through them for
    a moment, 5.13), and relay 2 crashes 100 ms later. Before outages were told from
    slow heartbeats, the partition's silence kept relay 2's timeout at its longest
    (SUSPECT_MAX_FACTOR x suspect_timeout_ms), its frames passed on through relays 3 and 4
    kept it live past the crash, and b committed nothing for 1.1 s (`relay chaos --relays
    5 --scenario replace`: 0.8-1.2 s)."""
    from relay.core.config import Limits as MeshLimits
    from relay.core.messages import Transaction
    from relay.core.shell import ProduceRequest
    from relay.sim.script import START_UNIX_MS, Mesh

    both, one = ("a", "b"), ("a",)
    mesh = Mesh(Topology({0: both, 1: both, 2: both, 3: one, 4: one}), MeshLimits())
    for _ in range(300):
        mesh.step_ms()
    commits: list[int] = []

    def run(ms: int) -> None:
        for t in range(ms):
            if t % 3 == 0:
                n = len(mesh.all_replies) + t + 1_000_000 * len(commits)
                tx = Transaction(b"p", mesh.now, None, b"v")
                mesh.running(1).produce(
                    ProduceRequest(n, "b", tx), START_UNIX_MS + mesh.now, mesh.now
                )
            seen = len(mesh.replies)
            mesh.step_ms()
            commits.extend(mesh.now for _, reply in mesh.replies[seen:] if reply.seq >= 0)

    def cut(pairs: set[tuple[int, int]], on: bool) -> None:
        for (a, b), link in mesh.links.items():
            if (a, b) in pairs or (b, a) in pairs:
                link.cut = on

    cut({(a, b) for a in (0, 1) for b in (2, 3, 4)}, True)
    run(2_000)
    healed = mesh.now
    cut({(a, b) for a in (0, 1) for b in (3, 4)}, False)
    run(30)
    cut({(0, 2), (1, 2)}, False)
    run(100)
    mesh.crash(2)
    run(1_500)
    after = [t for t in commits if t >= healed]
    longest = max(b - a for a, b in itertools.pairwise(after))
    assert longest < 2 * LIMITS.suspect_timeout_ms, longest
