"""relay/sockets.py on real ZeroMQ sockets: waiting from sync code and from asyncio, and
the endpoints a socket monitor reports when a connection closes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from relay.sockets import DisconnectMonitor, ReadableWaiter

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
