"""Attacks on a live mesh (docs/security.md): each one as a hostile client or outsider
would try it, with real relay processes and real sockets, and what it can no longer do.

A 3-relay mesh (relays 0-2 serve `orders.*`), security off: these are the bounds that hold
whatever the configuration. The attacks by an outsider on the mesh links use a second
mesh whose topology has a relay 3 (serving only `hostile`): it is killed at once and the
test binds a PUB at its mesh endpoint, so the SUBs of relays 0-2 take whatever it
publishes as peer traffic, and it forges frames in relay 1's name.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from relay.client import Consumer, Producer
from relay.core import codec
from relay.core.messages import Heartbeat, Reports
from relay.errors import Rejected
from relay.launcher import Mesh, write_loopback_topology
from relay.node import HEARTBEAT_TOPIC, stream_topic
from waiting import wait_until

STREAM = "orders.eu"
START_TIMEOUT_S = 60.0
HONEST = (0, 1, 2)
FORGER = 3  # its mesh endpoint is the forging PUB's
VICTIM = 1  # the relay whose name the forged frames take
MAX_U63 = (1 << 63) - 1
# Two parts: a mesh message has one, so each relay counts it (`peer_bad_parts`) and drops
# it. Once every relay counted one, its SUB is connected to the forging PUB.
MARKER = [b"H|attacks-marker", b"two parts"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    directory = tmp_path_factory.mktemp("attacks")
    path = write_loopback_topology(directory, {r: ["orders.*"] for r in range(3)}, [STREAM])
    running = Mesh(path, log_level="warning", log_dir=directory / "logs")
    try:
        running.start(timeout_s=START_TIMEOUT_S)
        yield running
    finally:
        running.stop()


def relays(mesh: Mesh) -> dict[int, str]:
    return {r: e.client for r, e in sorted(mesh.endpoints.items())}


def test_a_client_cannot_take_over_another_producers_sequence(mesh: Mesh) -> None:
    """The attack: write the victim's next producer sequences with other values. They
    commit (the attacker's own writes), but the victim is no longer told `committed` for
    content that never went in: its sends are rejected `duplicate_mismatch`, and readers
    see the attacker's values only once, the victim's never as committed."""
    with Producer(relays(mesh), producer_id=b"victim") as victim:
        before = victim.send(STREAM, b"genuine 1")
        taken = victim.next_producer_seq
        with Producer(relays(mesh), producer_id=b"victim", first_producer_seq=taken) as thief:
            forged = thief.send(STREAM, b"forged")
        with pytest.raises(Rejected, match="duplicate_mismatch") as refused:
            victim.send(STREAM, b"genuine 2")
        assert refused.value.reason == "duplicate_mismatch"
        after = victim.send(STREAM, b"genuine 3")  # its next sequence is its own again
    values = {}
    with Consumer(relays(mesh), timeout_s=30).subscribe(STREAM, "earliest") as consumer:
        for record in consumer:
            values[record.seq] = record.value
            if record.seq >= after:
                break
    assert values[before] == b"genuine 1"
    assert values[forged] == b"forged"
    assert values[after] == b"genuine 3"
    assert b"genuine 2" not in values.values()


# --- forged frames on the mesh links ---------------------------------------------------------


@pytest.fixture(scope="module")
def forger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, zmq.Socket[Any]]]:
    """A mesh of relays 0-2 (`orders.*`) whose relay 3 is replaced by a forging PUB."""
    directory = tmp_path_factory.mktemp("forger")
    subscriptions = {r: ["orders.*"] for r in HONEST}
    subscriptions[FORGER] = ["hostile"]
    path = write_loopback_topology(directory, subscriptions, [STREAM])
    running = Mesh(path, log_level="warning", log_dir=directory / "logs")
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        running.start(timeout_s=START_TIMEOUT_S)
        running.kill(FORGER)
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(running.endpoints[FORGER].mesh)
        base = {r: node_counter(running, r, "peer_bad_parts") for r in HONEST}

        def connected() -> bool:
            pub.send_multipart(MARKER)  # (a SUB not yet connected misses it: send again)
            return all(node_counter(running, r, "peer_bad_parts") > base[r] for r in HONEST)

        wait_until(connected, "every relay's SUB to connect to the forging PUB", poll_s=0.1)
        yield running, pub
    finally:
        ctx.destroy(linger=0)
        running.stop()


def status(mesh: Mesh, relay: int) -> dict[str, Any]:
    found = mesh.status(relay, timeout_s=5.0)
    assert found is not None, f"relay {relay} did not answer a StatusReq"
    return found


def node_counter(mesh: Mesh, relay: int, name: str) -> int:
    return int(status(mesh, relay)["node"]["counters"].get(name, 0))


def core_counter(mesh: Mesh, relay: int, name: str) -> int:
    return int(status(mesh, relay)["counters"].get(name, 0))


def hears(mesh: Mesh, relay: int, peer: int) -> bool:
    return peer in status(mesh, relay)["peers_heard"]


def reported(mesh: Mesh, relay: int, point: int) -> bool:
    return int(status(mesh, relay)["streams"][STREAM]["reported"]) >= point


def commit_through(mesh: Mesh, relay: int, value: bytes) -> int:
    """Produce through `relay` alone: it must coordinate and commit it itself."""
    with Producer({relay: mesh.endpoints[relay].client}, send_timeout_s=30) as producer:
        return producer.send(STREAM, value)


def test_a_forged_heartbeat_with_a_huge_incarnation_cannot_silence_a_relay(
    forger: tuple[Mesh, zmq.Socket[Any]],
) -> None:
    """Before: relays 0 and 2 took relay 1 for restarted with incarnation 2**63-1 and
    dropped every later frame of its real incarnation as stale, for good (it was cut
    from every view). Now the incarnation is beyond any relay's clock: refused."""
    mesh, pub = forger
    stale = {r: core_counter(mesh, r, "stale_incarnation") for r in HONEST}
    lie = Heartbeat(sender=VICTIM, incarnation=MAX_U63, floor=0, streams=(), hears=(0, 2))
    pub.send(HEARTBEAT_TOPIC + codec.encode(lie))
    others = [r for r in HONEST if r != VICTIM]
    wait_until(
        lambda: all(core_counter(mesh, r, "incarnation_implausible") >= 1 for r in others),
        "relays 0 and 2 to refuse the forged incarnation",
    )
    commit_through(mesh, VICTIM, b"after a forged heartbeat")
    for r in others:
        wait_until(functools.partial(hears, mesh, r, VICTIM), f"relay {r} to hear relay 1")
        assert core_counter(mesh, r, "stale_incarnation") == stale[r]


def test_a_forged_huge_link_counter_cannot_make_a_relay_drop_anothers_messages(
    forger: tuple[Mesh, zmq.Socket[Any]],
) -> None:
    """Before: relays 0 and 2 took every later message of relay 1 on the stream for a
    duplicate of one below the forged counter, and stopped reporting (their watermark
    waited on relay 1's floor there for good). Now relay 1's next real message, never
    received yet below that counter, makes them follow relay 1's counter again."""
    mesh, pub = forger
    incarnation = int(status(mesh, VICTIM)["incarnation"])
    lie = Reports(
        sender=VICTIM,
        incarnation=incarnation,
        floor=0,
        stream=STREAM,
        link_seq=MAX_U63,
        points=(),
        committed_point=-1,
        committed_digest=bytes(16),
    )
    pub.send(stream_topic(STREAM) + codec.encode(lie))
    others = [r for r in HONEST if r != VICTIM]
    wait_until(
        lambda: all(core_counter(mesh, r, "link_rewound") >= 1 for r in others),
        "relays 0 and 2 to follow relay 1's link counter again",
    )
    seq = 0
    for n in range(3):
        seq = commit_through(mesh, VICTIM, b"after a forged link counter %d" % n)
    for r in others:  # each reports it itself: it took relay 1's messages since
        wait_until(functools.partial(reported, mesh, r, seq), f"relay {r} to report {seq}")
