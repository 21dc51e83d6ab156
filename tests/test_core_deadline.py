"""The core says when it next needs a tick (RelayCore.next_deadline_ms), so an idle shell
can sleep until then."""

from __future__ import annotations

from relay.core import CoreConfig, Limits, ProduceRequest, RelayCore, Topology, Transaction

T0 = 1_800_000_000_000


def test_next_deadline_is_the_next_heartbeat_or_an_earlier_produce_deadline() -> None:
    limits = Limits(heartbeat_interval_ms=50, suspect_timeout_ms=200, produce_timeout_ms=30)
    topology = Topology({0: ("s",), 1: ("s",), 2: ("s",)})
    core = RelayCore(CoreConfig(0, topology, limits), 1, T0)
    core.tick(T0, 1_000)  # sends the first heartbeat
    assert core.next_deadline_ms() == 1_000 + 50
    core.tick(T0 + 20, 1_020)
    assert core.next_deadline_ms() == 1_050  # ticking early changes nothing
    # A forwarded or coordinated produce has its own deadline: relay 0 cannot coordinate
    # yet (not joined), so a non-member's forward is what waits here.
    other = RelayCore(CoreConfig(0, Topology({0: ("t",), 1: ("s",), 2: ("s",)}), limits), 1, T0)
    other.tick(T0, 1_000)
    for peer in (1, 2):  # hear the members, so the forward has a live target
        other.peers[peer].last_heard_ms = 1_000
    other.produce(ProduceRequest(7, "s", Transaction(b"p", 1, None, b"v")), T0 + 1, 1_001)
    assert other.next_deadline_ms() == 1_001 + 30
