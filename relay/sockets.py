"""Waiting on several ZeroMQ sockets, and hearing that their connections closed: the
socket mechanics the relay process (`relay.node`) and the clients (`relay.client`) share.

`ReadableWaiter` waits until one of its sockets may be readable, either in zmq_poll
(`poll`, from synchronous code, or from a task that has its event loop to itself) or
through the asyncio event loop (`wait`): a reader callback on every socket's file
descriptor resolves the one future the waiter awaits, a timer bounds the wait. ZeroMQ's
descriptors only signal that a socket's state may have changed, so each socket's EVENTS
say what is readable. (zmq.asyncio's Poller does the same with a future and reader
registrations per socket and per wait, at about twice the CPU, a cost that showed in the
latency of every answer.)

`DisconnectMonitor` is a socket monitor that reports the endpoints whose connection
closed (ZMQ_EVENT_DISCONNECTED).

Both take plain (synchronous) sockets: a socket of a zmq.asyncio context is used through
its plain view, `zmq.Socket.shadow(sock.underlying)`, without a Future per call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

# pyzmq's flags are enum members; plain ints skip an enum operation per call.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
MONITOR_EVENTS_MAX = 10_000  # monitor events read per call of `disconnected`


class ReadableWaiter:
    """Waits until one of `socks` may be readable and says which are."""

    def __init__(self, socks: Sequence[zmq.Socket[Any]]) -> None:
        self.socks = tuple(socks)
        self._poller = zmq.Poller()
        for sock in self.socks:
            self._poller.register(sock, zmq.POLLIN)
        self._fds = [int(sock.getsockopt(zmq.FD)) for sock in self.socks]
        self._loop: asyncio.AbstractEventLoop | None = None  # where the readers are
        self._future: asyncio.Future[None] | None = None  # what a reader callback resolves

    def readable(self) -> set[zmq.Socket[Any]]:
        """The sockets with something to read now."""
        return {sock for sock in self.socks if int(sock.get(_EVENTS)) & _POLLIN}

    def poll(self, timeout_ms: int) -> set[zmq.Socket[Any]]:
        """Wait in zmq_poll up to `timeout_ms` (-1: until one is readable); the readable
        sockets. Blocks the thread, event loop included."""
        self._unwatch()  # the loop need not call back while this waits for itself
        return {sock for sock, _ in self._poller.poll(timeout_ms)}

    async def wait(
        self, timeout_s: float | None, wakeup: asyncio.Future[None] | None = None
    ) -> set[zmq.Socket[Any]]:
        """Wait through the running event loop up to `timeout_s` (None: no limit), or until
        `wakeup` is done; the readable sockets (none after a timeout or a wake-up)."""
        loop = asyncio.get_running_loop()
        self._watch(loop)
        readable = self.readable()
        if not readable:
            future = wakeup if wakeup is not None else loop.create_future()
            if not future.done():
                self._future = future
                timer = None if timeout_s is None else loop.call_later(timeout_s, self._wake)
                try:
                    await future
                finally:
                    self._future = None
                    if timer is not None:
                        timer.cancel()
            readable = self.readable()
        return readable

    def close(self) -> None:
        """Drop the reader callbacks: call it before the sockets close."""
        self._unwatch()

    def _wake(self) -> None:
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)
        elif future is None:
            # Nobody waits (the caller is busy elsewhere): a descriptor that stays readable
            # would make the loop call this on every turn. The next wait watches again.
            self._unwatch()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not loop:
            self._unwatch()
            self._loop = loop
            for fd in self._fds:
                loop.add_reader(fd, self._wake)

    def _unwatch(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            for fd in self._fds:
                loop.remove_reader(fd)


class DisconnectMonitor:
    """Reports the endpoints whose connection of `sock` closed: a socket monitor of
    ZMQ_EVENT_DISCONNECTED and the PAIR socket (`socket`, to wait on) receiving its events.
    `ctx` is a plain context (`zmq.Context.shadow` of an asyncio one), so the PAIR is
    plain too."""

    def __init__(self, ctx: zmq.Context[Any], sock: zmq.Socket[Any]) -> None:
        self.sock = sock
        address = f"inproc://relay-monitor-{id(self)}"
        sock.monitor(address, zmq.EVENT_DISCONNECTED)
        self.socket: zmq.Socket[Any] = ctx.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def disconnected(self) -> list[str]:
        """The endpoints whose connection closed since the last call, one per event (at
        most MONITOR_EVENTS_MAX events are read per call; the rest wait for the next)."""
        endpoints: list[str] = []
        socket = self.socket
        for _ in range(MONITOR_EVENTS_MAX):
            if not int(socket.get(_EVENTS)) & _POLLIN:
                break
            try:
                message = socket.recv_multipart(_NOBLOCK)
            except zmq.ZMQError:
                break
            try:
                event = parse_monitor_message(message)
            except (RuntimeError, ValueError):  # pyzmq's words for a malformed event
                continue
            if event["event"] == zmq.EVENT_DISCONNECTED:
                raw = event["endpoint"]
                endpoints.append(raw.decode() if isinstance(raw, bytes) else str(raw))
        return endpoints

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the socket may have closed already
            self.sock.disable_monitor()
        self.socket.close(linger=0)
