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

`LinkMonitor` is a socket monitor that reports the endpoints whose connection closed
(ZMQ_EVENT_DISCONNECTED) and, if asked, those libzmq is connecting again by itself
(ZMQ_EVENT_CONNECT_RETRIED); `DisconnectMonitor` reports only the first.

`shut_connection` ends one connection of a socket libzmq owns, which libzmq has no call
for (a ROUTER cannot drop one client), from the descriptor a message came on.

`MeshLinkTimings` derives the ZeroMQ heartbeat and reconnect options of the mesh sockets
from the topology's limits, so that a link that died is noticed and one that heals
carries traffic again within about a heartbeat interval.

Both take plain (synchronous) sockets: a socket of a zmq.asyncio context is used through
its plain view, `zmq.Socket.shadow(sock.underlying)`, without a Future per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from relay.topology import is_ipv6

if TYPE_CHECKING:
    from relay.core import Limits

# pyzmq's flags are enum members; plain ints skip an enum operation per call.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
MONITOR_EVENTS_MAX = 10_000  # monitor events read per call of `events`
HEARTBEAT_TTL_MAX_MS = 6_553_500  # ZMTP carries the TTL in deciseconds, in 16 bits


class ReadableWaiter:
    """Waits until one of `socks` may be readable and says which are. `wake_fd`: a plain
    descriptor that also ends a wait when readable (a self-pipe the caller writes to from
    another thread or a signal handler); `woken` then says so, and draining it is the
    caller's business.

    A ZeroMQ socket's descriptor signals that the socket's state may have changed, not that
    a message is there, so each signal costs a look at the socket's ZMQ_EVENTS. A wait
    through the event loop looks only at the sockets that may have changed: those whose
    descriptor signalled, those it last found readable (their drain may stop early), and
    those the caller `mark`s after sending on them (a send takes in the socket's pending
    commands, and with them the signal an answer would have given). Looking at all six
    sockets of a three-relay client before and after every wait cost the asyncio producer
    a fifth of its time at one transaction in flight."""

    def __init__(self, socks: Sequence[zmq.Socket[Any]], wake_fd: int | None = None) -> None:
        self.socks = tuple(socks)
        self._poller = zmq.Poller()
        for sock in self.socks:
            self._poller.register(sock, zmq.POLLIN)
        self._wake_fd = wake_fd
        self.woken = False  # the wake descriptor was readable when a wait ended
        if wake_fd is not None:
            self._poller.register(wake_fd, zmq.POLLIN)
        self._fds = [(int(sock.getsockopt(zmq.FD)), sock) for sock in self.socks]
        self._look: set[zmq.Socket[Any]] = set(self.socks)  # ZMQ_EVENTS to read next wait
        self._loop: asyncio.AbstractEventLoop | None = None  # where the readers are
        self._future: asyncio.Future[None] | None = None  # what a reader callback resolves

    def readable(self) -> set[zmq.Socket[Any]]:
        """The sockets with something to read now (a look at every socket)."""
        self._look.clear()
        return {sock for sock in self.socks if int(sock.get(_EVENTS)) & _POLLIN}

    def mark(self, sock: zmq.Socket[Any]) -> None:
        """`sock` was sent on: the next wait looks at it."""
        self._look.add(sock)

    def poll(self, timeout_ms: int) -> set[zmq.Socket[Any]]:
        """Wait in zmq_poll up to `timeout_ms` (-1: until one is readable, or `wake_fd`);
        the readable sockets. Blocks the thread, event loop included."""
        self._unwatch()  # the loop need not call back while this waits for itself
        readable = set()
        for sock, _ in self._poller.poll(timeout_ms):
            if isinstance(sock, int):
                self.woken = True
            else:
                readable.add(sock)
        return readable

    async def wait(
        self, timeout_s: float | None, wakeup: asyncio.Future[None] | None = None
    ) -> set[zmq.Socket[Any]]:
        """Wait through the running event loop up to `timeout_s` (None: no limit), or until
        `wakeup` is done; the readable sockets (none after a timeout or a wake-up)."""
        loop = asyncio.get_running_loop()
        self._watch(loop)
        readable = self._looked_at()
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
            readable = self._looked_at()
        self._look |= readable
        return readable

    def _looked_at(self) -> set[zmq.Socket[Any]]:
        look, self._look = self._look, set()
        return {sock for sock in look if int(sock.get(_EVENTS)) & _POLLIN}

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

    def _signalled(self, sock: zmq.Socket[Any]) -> None:
        self._look.add(sock)
        self._wake()

    def _on_wake_fd(self) -> None:
        self.woken = True
        self._wake()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not loop:
            self._unwatch()
            self._loop = loop
            self._look.update(self.socks)  # their descriptors may have signalled unwatched
            for fd, sock in self._fds:
                loop.add_reader(fd, self._signalled, sock)
            if self._wake_fd is not None:
                loop.add_reader(self._wake_fd, self._on_wake_fd)

    def _unwatch(self) -> None:
        # Any: compiled, a call typed as asyncio's remove_reader checks that a bool came
        # back, and uvloop's always returns None.
        loop: Any = self._loop
        self._loop = None
        if loop is not None and not loop.is_closed():
            for fd, _ in self._fds:
                loop.remove_reader(fd)
            if self._wake_fd is not None:
                loop.remove_reader(self._wake_fd)


def allow_ipv6(sock: zmq.Socket[Any], address: str) -> None:
    """Let `sock` bind or connect `address` (a host or an endpoint) if it is an IPv6 one
    (`::` too, which then takes IPv4 as well): libzmq refuses them unless told."""
    if is_ipv6(address):
        sock.setsockopt(zmq.IPV6, 1)


def shut_connection(fd: int) -> str:
    """Shut down both directions of the connection on descriptor `fd` (ZMQ_SRCFD of a
    message that came on it): libzmq sees the connection end as if its peer had closed it,
    and closes it. The peer's address ("host:port"; "" if it has none, "?" if the
    descriptor is no connection any more)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:  # a duplicate: libzmq closes fd
            try:
                peer = conn.getpeername()
            except OSError:
                peer = None
            conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        return "?"
    if isinstance(peer, tuple):
        return f"{peer[0]}:{peer[1]}" if ":" not in str(peer[0]) else f"[{peer[0]}]:{peer[1]}"
    return str(peer or "")


class LinkMonitor:
    """Reports what happened to the connections of `sock`: a socket monitor of `events`
    (ZMQ_EVENT_* flags) and the PAIR socket (`socket`, to wait on) receiving them. `ctx`
    is a plain context (`zmq.Context.shadow` of an asyncio one), so the PAIR is plain too."""

    def __init__(
        self, ctx: zmq.Context[Any], sock: zmq.Socket[Any], events: int = zmq.EVENT_DISCONNECTED
    ) -> None:
        self.sock = sock
        address = f"inproc://relay-monitor-{id(self)}"
        sock.monitor(address, events)
        self.socket: zmq.Socket[Any] = ctx.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def events(self) -> list[tuple[int, str]]:
        """(event, endpoint) of the events since the last call, in order (at most
        MONITOR_EVENTS_MAX are read per call; the rest wait for the next)."""
        return [(event, endpoint) for event, endpoint, _ in self.events_with_values()]

    def events_with_values(self) -> list[tuple[int, str, int]]:
        """As `events`, with each event's value (a descriptor, an error or status code:
        zmq_socket_monitor(3) says which)."""
        events: list[tuple[int, str, int]] = []
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
            raw = event["endpoint"]
            endpoint = raw.decode() if isinstance(raw, bytes) else str(raw)
            events.append((int(event["event"]), endpoint, int(event["value"])))
        return events

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the socket may have closed already
            self.sock.disable_monitor()
        self.socket.close(linger=0)


class DisconnectMonitor(LinkMonitor):
    """Reports the endpoints whose connection of `sock` closed (ZMQ_EVENT_DISCONNECTED)."""

    def __init__(self, ctx: zmq.Context[Any], sock: zmq.Socket[Any]) -> None:
        super().__init__(ctx, sock, zmq.EVENT_DISCONNECTED)

    def disconnected(self) -> list[str]:
        """The endpoints whose connection closed since the last call, one per event."""
        return [endpoint for event, endpoint in self.events() if event == _DISCONNECTED]


@dataclass(frozen=True)
class MeshLinkTimings:
    """The ZeroMQ options of the mesh sockets (PUB and SUB), derived from the limits by
    `from_limits`; every time in milliseconds.

    * `heartbeat_ivl_ms` (ZMQ_HEARTBEAT_IVL) = suspect_timeout_ms, on the SUB side only:
      the transport's PINGs only have to find a connection that died silently (a peer
      frozen, a network that drops everything), so that libzmq drops it and connects
      again; the core's own heartbeats already decide suspicion. One PING per suspect
      timeout keeps that detection within heartbeat_ivl + heartbeat_timeout (a link cut
      for less heals by TCP's own retransmission, its first two within 0.6 s). The PUB
      side sends no PINGs: the TTL in the SUB's PINGs closes its end as well. On an idle
      (quiet) relay these PINGs are most of its CPU: more would cost more than the core.
    * `heartbeat_timeout_ms` (ZMQ_HEARTBEAT_TIMEOUT, and ZMQ_HEARTBEAT_TTL for the peer)
      = 2 x suspect_timeout_ms: well after the core suspected the peer, so the transport
      never closes a link the core still counts on (closing drops what the link queued).
    * `reconnect_ivl_ms` (ZMQ_RECONNECT_IVL) = heartbeat_interval_ms, and
      `reconnect_ivl_max_ms` (ZMQ_RECONNECT_IVL_MAX) = the same: no exponential back-off,
      so a link that heals is connected again within one or two heartbeat intervals (libzmq
      adds up to one interval of jitter), even after a long outage.
    * `connect_timeout_ms` (ZMQ_CONNECT_TIMEOUT) = suspect_timeout_ms: a TCP handshake
      whose SYN was lost (a partition) is given up and tried again then, instead of after
      the kernel's SYN back-off (1, 3, 7 s ...). A handshake must never take that long on a
      mesh whose relays suspect each other after that much silence.
    """

    heartbeat_ivl_ms: int
    heartbeat_timeout_ms: int
    reconnect_ivl_ms: int
    reconnect_ivl_max_ms: int
    connect_timeout_ms: int

    @classmethod
    def from_limits(cls, limits: Limits) -> MeshLinkTimings:
        suspect_ms = limits.suspect_timeout_ms
        return cls(
            heartbeat_ivl_ms=suspect_ms,
            heartbeat_timeout_ms=2 * suspect_ms,
            reconnect_ivl_ms=limits.heartbeat_interval_ms,
            reconnect_ivl_max_ms=limits.heartbeat_interval_ms,
            connect_timeout_ms=suspect_ms,
        )

    def apply(self, sock: zmq.Socket[Any], *, pings: bool = True) -> None:
        """Set the options on a mesh socket (before it binds or connects); `pings`: it
        sends ZMTP PINGs (the SUB side), else it only answers them."""
        sock.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ivl_ms if pings else 0)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat_timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, min(self.heartbeat_timeout_ms, HEARTBEAT_TTL_MAX_MS))
        sock.setsockopt(zmq.RECONNECT_IVL, self.reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, self.reconnect_ivl_max_ms)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, self.connect_timeout_ms)


def mesh_subscriber(
    ctx: zmq.Context[Any], timings: MeshLinkTimings, *, max_msg_bytes: int
) -> zmq.Socket[Any]:
    """A SUB for the mesh links (not yet subscribed or connected): frames above
    `max_msg_bytes` refused, `timings` applied, and no receive high-water mark.

    libzmq 4.3.5 aborts the whole process when a link's receive queue is full and the
    link fails: `Assertion failed: _input_stopped` once the queue drains after the link
    was replaced, `!_io_error` when the transport's heartbeat fires on the failed link
    (libzmq issues 3937, 4364, 4767; both seen here on relays busy opening thousands of
    streams). A link whose queue is full stops reading, so it also stops hearing the
    heartbeats that keep it open: the failure follows the full queue. Without a mark the
    queue is never full, and nothing of that path is reachable. What a relay queues is
    bounded by what its peers publish while it is busy (each peer's PUB still drops above
    MESH_HWM when a link's TCP buffers fill). An outsider that can bind a peer's mesh
    endpoint could queue more: nothing closes the mesh to outsiders yet."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        timings.apply(sock)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock
