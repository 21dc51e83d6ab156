"""relay/sockets.py on real ZeroMQ sockets: waiting from sync code and from asyncio, the
endpoints a socket monitor reports when a connection closes (and whether libzmq connects
again by itself), and the mesh sockets' heartbeat and reconnect options."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from relay.core import Limits
from relay.sockets import (
    HEARTBEAT_TTL_MAX_MS,
    DisconnectMonitor,
    LinkMonitor,
    MeshLinkTimings,
    ReadableWaiter,
)

pytestmark = pytest.mark.timeout(30)

WAIT_S = 10.0  # bound of every wait for something that must happen


@pytest.fixture
def pairs() -> Iterator[tuple[list[zmq.Socket[Any]], list[zmq.Socket[Any]]]]:
    """Two connected PAIR sockets: (the senders, the receivers)."""
    ctx = zmq.Context()
    senders, receivers = [], []
    for n in range(2):
        receiver = ctx.socket(zmq.PAIR)
        receiver.bind(f"inproc://test-sockets-{n}")
        sender = ctx.socket(zmq.PAIR)
        sender.connect(f"inproc://test-sockets-{n}")
        senders.append(sender)
        receivers.append(receiver)
    yield senders, receivers
    ctx.destroy(linger=0)


def test_poll_says_which_sockets_are_readable(
    pairs: tuple[list[zmq.Socket[Any]], list[zmq.Socket[Any]]],
) -> None:
    senders, receivers = pairs
    waiter = ReadableWaiter(receivers)
    assert waiter.poll(0) == set()
    senders[1].send(b"x")
    assert waiter.poll(int(WAIT_S * 1000)) == {receivers[1]}
    assert waiter.readable() == {receivers[1]}
    receivers[1].recv()
    assert waiter.readable() == set()


def test_poll_ends_when_the_wake_descriptor_is_readable(
    pairs: tuple[list[zmq.Socket[Any]], list[zmq.Socket[Any]]],
) -> None:
    _, receivers = pairs
    wake_r, wake_w = socket.socketpair()
    try:
        waiter = ReadableWaiter(receivers, wake_r.fileno())
        assert waiter.poll(0) == set()
        wake_w.send(b"\0")
        assert waiter.poll(-1) == set()  # returns (without it: never), naming no socket
    finally:
        wake_r.close()
        wake_w.close()


def test_wait_through_the_event_loop(
    pairs: tuple[list[zmq.Socket[Any]], list[zmq.Socket[Any]]],
) -> None:
    senders, receivers = pairs
    waiter = ReadableWaiter(receivers)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        # Nothing to read: the timer ends the wait.
        assert await waiter.wait(0.01) == set()
        # A frame sent while the waiter waits wakes it through the loop's reader.
        loop.call_soon(senders[0].send, b"x")
        assert await waiter.wait(WAIT_S) == {receivers[0]}
        receivers[0].recv()
        # A wake-up future ends the wait with nothing readable.
        wakeup: asyncio.Future[None] = loop.create_future()
        loop.call_soon(wakeup.set_result, None)
        started = time.monotonic()
        assert await waiter.wait(WAIT_S, wakeup) == set()
        assert time.monotonic() - started < WAIT_S
        waiter.close()

    asyncio.run(scenario())


def test_monitor_names_the_endpoint_whose_connection_closed() -> None:
    ctx = zmq.Context()
    try:
        server = ctx.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        monitor = DisconnectMonitor(ctx, client)
        client.connect(endpoint)
        client.send(b"hello")
        assert server.poll(int(WAIT_S * 1000)), "the connection never came up"
        server.close(linger=0)
        deadline = time.monotonic() + WAIT_S
        closed: list[str] = []
        while not closed and time.monotonic() < deadline:
            monitor.socket.poll(int(WAIT_S * 1000))
            closed = monitor.disconnected()
        assert endpoint in closed
        monitor.close()
        client.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def monitor_events(monitor: LinkMonitor, until: int) -> list[tuple[int, str]]:
    """The monitor's events up to and including the first `until` event."""
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        monitor.socket.poll(int(WAIT_S * 1000))
        seen += monitor.events()
        if any(event == until for event, _ in seen):
            return seen
    raise AssertionError(f"no event {until} within {WAIT_S} s: {seen}")


def test_link_monitor_tells_whether_libzmq_connects_again() -> None:
    """A peer that went away: libzmq retries by itself (CONNECT_RETRIED follows the
    DISCONNECTED). A frame above MAXMSGSIZE closes the link too, and libzmq then never
    connects again (a protocol error): that is why the node connects a link that closed
    without a CONNECT_RETRIED again itself (test_node's garbage test)."""
    ctx = zmq.Context()
    wanted = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED

    def linked(pub: zmq.Socket[Any]) -> tuple[zmq.Socket[Any], LinkMonitor, str]:
        endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, 100)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        MeshLinkTimings.from_limits(Limits()).apply(sub)
        monitor = LinkMonitor(ctx, sub, wanted)
        sub.connect(endpoint)
        monitor_events(monitor, zmq.EVENT_CONNECTED)
        return sub, monitor, endpoint

    try:
        pub = ctx.socket(zmq.PUB)
        sub, monitor, endpoint = linked(pub)
        pub.close(linger=0)  # the peer goes away
        seen = monitor_events(monitor, zmq.EVENT_CONNECT_RETRIED)
        assert seen.index((zmq.EVENT_DISCONNECTED, endpoint)) < seen.index(
            (zmq.EVENT_CONNECT_RETRIED, endpoint)
        )
        monitor.close()

        pub = ctx.socket(zmq.PUB)
        sub, monitor, endpoint = linked(pub)
        seen = []
        deadline = time.monotonic() + WAIT_S
        # Subscriptions travel asynchronously: send until the link closes over it.
        while (zmq.EVENT_DISCONNECTED, endpoint) not in seen and time.monotonic() < deadline:
            pub.send(b"x" * 1_000)  # above MAXMSGSIZE
            monitor.socket.poll(10)
            seen += monitor.events()
        assert (zmq.EVENT_DISCONNECTED, endpoint) in seen, seen
        assert sub.poll(0) == 0  # the oversized frame never arrived
        monitor.close()
    finally:
        ctx.destroy(linger=0)


def test_mesh_link_timings_follow_the_limits() -> None:
    timings = MeshLinkTimings.from_limits(Limits())  # 20 ms heartbeats, 150 ms suspicion
    assert timings == MeshLinkTimings(
        heartbeat_ivl_ms=150,
        heartbeat_timeout_ms=300,
        reconnect_ivl_ms=20,
        reconnect_ivl_max_ms=20,
        connect_timeout_ms=150,
    )
    slow = MeshLinkTimings.from_limits(Limits(heartbeat_interval_ms=500, suspect_timeout_ms=3_000))
    assert slow.heartbeat_ivl_ms == 3_000 and slow.heartbeat_timeout_ms == 6_000
    assert slow.reconnect_ivl_ms == slow.reconnect_ivl_max_ms == 500  # no back-off
    # Whatever the limits: the transport gives up on a link only after the core
    # suspected the peer, and connects again within one heartbeat interval.
    for hb, suspect in ((1, 2), (20, 150), (100, 101), (1_000, 60_000)):
        t = MeshLinkTimings.from_limits(
            Limits(heartbeat_interval_ms=hb, suspect_timeout_ms=suspect)
        )
        assert t.heartbeat_timeout_ms > suspect and t.heartbeat_ivl_ms >= 1
        # the peer closes a link on the TTL sent with each PING: PINGs must come sooner
        assert t.heartbeat_ivl_ms < t.heartbeat_timeout_ms
        assert t.reconnect_ivl_ms <= hb and t.reconnect_ivl_max_ms <= hb
        assert t.connect_timeout_ms >= suspect // 2


def test_mesh_link_timings_are_set_on_a_socket() -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        timings = MeshLinkTimings.from_limits(Limits())
        timings.apply(sock)
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == timings.heartbeat_ivl_ms
        assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == timings.heartbeat_timeout_ms
        assert sock.getsockopt(zmq.HEARTBEAT_TTL) == timings.heartbeat_timeout_ms
        assert sock.getsockopt(zmq.RECONNECT_IVL) == timings.reconnect_ivl_ms
        assert sock.getsockopt(zmq.RECONNECT_IVL_MAX) == timings.reconnect_ivl_max_ms
        assert sock.getsockopt(zmq.CONNECT_TIMEOUT) == timings.connect_timeout_ms
        huge = MeshLinkTimings.from_limits(
            Limits(heartbeat_interval_ms=1_000, suspect_timeout_ms=10_000_000)
        )
        huge.apply(sock)  # ZMTP's TTL is bounded: it is capped, never refused
        assert sock.getsockopt(zmq.HEARTBEAT_TTL) == HEARTBEAT_TTL_MAX_MS
        sock.close()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        timings.apply(pub, pings=False)  # answers PINGs, sends none
        assert pub.getsockopt(zmq.HEARTBEAT_IVL) == 0
        assert pub.getsockopt(zmq.HEARTBEAT_TIMEOUT) == timings.heartbeat_timeout_ms
        pub.close()
    finally:
        ctx.destroy(linger=0)


# A child process: a mesh SUB that does not read while its peer publishes far more than
# libzmq's default queue (1,000) for twice the transport's heartbeat timeout, then reads.
# With a receive mark, libzmq 4.3.5 stops reading the full link, its heartbeat times out
# and the process aborts (`_input_stopped` or `!_io_error`) or the link's queue is lost.
_BUSY_READER = textwrap.dedent(
    """
    import time
    import zmq
    from relay.core import Limits
    from relay.sockets import LinkMonitor, MeshLinkTimings, mesh_subscriber

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    timings = MeshLinkTimings.from_limits(
        Limits(heartbeat_interval_ms=20, suspect_timeout_ms=100)
    )
    sub = mesh_subscriber(ctx, timings, max_msg_bytes=1 << 20)
    sub.subscribe(b"")
    monitor = LinkMonitor(ctx, sub, zmq.EVENT_DISCONNECTED)
    sub.connect(f"tcp://127.0.0.1:{port}")
    while not sub.poll(10):  # the link carries
        pub.send(b"hello")
    while sub.poll(0):
        sub.recv()
    count = 20_000
    for i in range(count):
        pub.send(b"%d" % i)
    # The reader is busy elsewhere: it only watches for the link failing, for twice the
    # transport's heartbeat timeout (with a receive mark it fails within one).
    assert not monitor.socket.poll(2 * timings.heartbeat_timeout_ms), monitor.events()
    got = []
    while len(got) < count and sub.poll(10_000):
        got.append(int(sub.recv()))
    assert got == list(range(count)), (len(got), got[:3])
    assert monitor.events() == [], monitor.events()
    print("ok")
    """
)


def test_a_busy_mesh_reader_keeps_its_link_and_queue() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _BUSY_READER], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2_000:]
