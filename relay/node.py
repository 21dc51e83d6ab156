"""The relay process: a thin asyncio shell around `RelayCore`.

Sockets (one zmq.asyncio context per node; LINGER 0 on every socket):

* PUB, bound at the relay's `mesh_endpoint`: every frame the core emits, on all four
  channels, so each ordered pair of relays is one FIFO link. One message part, the topic
  followed by the frame (`topic + frame`: when libzmq drops a link's queue, a reader that
  took the first part of a message aborts in libzmq 4.3.5, `Assertion failed: !_more`;
  one part cannot be cut); topics end in `|`, so none is a prefix of another, and the
  receiver cuts the topic off at its end:
      b"S|<stream>|"   a stream message (Outgoing.stream set)
      b"D|<relay id>|" a message to one relay (Outgoing.target set)
      b"H|"            a heartbeat (neither)
  A subscription longer than any topic (or, with CurveZMQ, than a handshake) drops the
  connection (ZMQ_MAXMSGSIZE). libzmq keeps every subscription a subscriber makes (an
  XPUB taking them by hand, ZMQ_XPUB_MANUAL, keeps them too: measured, 200,000 of them
  cost it more than a PUB), so only keys bound their number: with CurveZMQ only the
  topology's relays can subscribe.
* One SUB per peer, connected to its `mesh_endpoint`, subscribed to `S|<name>|` for each
  exact stream name this relay serves, `S|<literal prefix>` for each pattern (`orders.*` ->
  `S|orders.`; the core drops frames of streams it does not serve), `S|<name>|` for each
  stream it serves by its acceptor record and not by its topology (a stream's
  configuration outlives a change of the topology file, docs/protocol.md 5.15:
  `RelayCore.recorded_streams`, known once the acceptor memory is loaded, before the
  sockets open), `D|<own id>|`, `H|`. Subscriptions are added, never removed, when the
  relay comes to serve more: a topology file read again on SIGHUP (`reload`), a stream a
  change of its configuration added this relay to (5.15 changes; `_subscribe_new`).
  A frame read from peer j's SUB must name j as its sender, or the core drops it
  (`peer_sender_mismatch`): with CurveZMQ the link is j's key, so no other process can
  speak for j.
* ROUTER, bound at the relay's `client_endpoint`: the client protocol of `relay.wire`.

With `security.curve` (relay/security.py, docs/security.md) every socket is CurveZMQ: the
PUB and the ROUTER are servers with the relay's key pair, each SUB a client that accepts
only its peer's public key, and the context's ZAP handler (`MeshAuthenticator`) lets only
the topology's relays subscribe and only its clients connect; a client's messages carry
its name (ZMTP User-Id), which the service's access checks use.

The mesh sockets carry ZeroMQ's own heartbeats and reconnect at the pace of the limits
(`relay.sockets.MeshLinkTimings`): libzmq drops a link that died silently and connects
again within about a heartbeat interval once the peer can be reached; the node connects
again only a link libzmq gave up on (`_PeerLinks`).

An idle relay sleeps: each turn of the loop waits until a socket may be readable (a peer's
frame, a client's request, a link closing), `stop()` is called, or the next deadline: the
core's (`RelayCore.next_deadline_ms`, at least every heartbeat interval), the service's
(parked reads, produce backstops), housekeeping (every STATE_LOG_MS) or a link due to be
connected again. A node alone in its event loop (`relay run`) waits in zmq_poll
(`relay.sockets.ReadableWaiter.poll`), the cheapest and fastest wake-up; one sharing its
loop with other tasks waits through the loop on the sockets' descriptors
(`ReadableWaiter.wait`). `stop()` ends either wait at once (a byte on the node's wake-up
socket, the wait's future), from any thread or signal handler. A turn drains what is
readable (bounded per turn: DRAIN_MAX frames per peer socket; client requests are read
into the intake, relay/intake.py, and served one client after the other, DRAIN_MAX at
most and only until they brought wire.PIPELINE_BATCH_ITEMS produces, so that what one
turn took is published before the next is taken; a client flooding the intake is cut
off), feeds peer frames to the core and client requests to its `ClientService`
(relay/service.py: the client protocol without sockets) with the wall clock and the
monotonic clock (ms), ticks the core when its deadline came or an input
waited FED_TICK_MS for a tick, then drains the core's `Ready` (relay/core/shell.py):
publishes every `Outgoing` in order (consecutive frames for one topic as one bundle,
docs/protocol.md section 3), passes producers' answers and deliveries to the service, and
hands new committed records to the spool. The turns are counted
(`loop_turns`).
Nothing a peer or client sends can stop the loop: frames are validated, errors are counted
(`RelayNode.counters`, next to the core's own counters) and logged at a bounded rate. A
node that owns its process (`relay run`) also keeps the long-lived buffer out of the
garbage collector's way (`_tend_gc`).

Run one relay:  relay run --config TOPOLOGY.yaml --relay ID [--log-level info]
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import signal
import socket
import sys
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import zmq
import zmq.asyncio

from relay import __version__, peerprotocol
from relay.acceptors import AcceptorFiles
from relay.core import (
    FED_TICK_MS,
    CommittedRecord,
    CoreConfig,
    Delivery,
    Limits,
    Outgoing,
    ProduceReply,
    RelayCore,
    codec,
    configuration_status,
    drain,
)
from relay.core.codec import peer_frame_limit
from relay.core.fields import MAX_STREAM_NAME_BYTES
from relay.core.shell import NO_FED_TICK
from relay.errors import (
    AcceptorMemoryError,
    ConfigError,
    FrameError,
    MalformedFrame,
    PortUnavailable,
)
from relay.handshakes import COUNTERS as HANDSHAKES_REFUSED
from relay.handshakes import HANDSHAKE_FAILED, refusal
from relay.hoptrace import CLIENT_IN, CLIENT_OUT, PEER_IN, PEER_OUT, HopTrace
from relay.incarnation import RelayLock, next_incarnation, relay_directory
from relay.intake import Intake
from relay.logs import STATE_CHANGE
from relay.meta import METADATA_STREAM
from relay.metasync import META_SYNC_MARK, DurableFold, MetaSync, fold_durable_history
from relay.security import (
    CLIENT_DOMAIN,
    MESH_DOMAIN,
    Identity,
    KeyRing,
    curve_client,
    curve_server,
    relay_key_name,
)
from relay.service import ClientService
from relay.sockets import (
    LinkMonitor,
    MeshLinkTimings,
    ReadableWaiter,
    allow_ipv6,
    mesh_subscriber,
    shut_connection,
)
from relay.store import STREAMS_DIR
from relay.streamhealth import (
    configuration_words,
    disagreement_words,
    history_lost_words,
    not_member_words,
    topology_words,
)
from relay.wire import PIPELINE_BATCH_ITEMS
from relay.zap import MeshAuthenticator

if TYPE_CHECKING:
    from relay.opsserver import OpsServer
    from relay.spool import Spool, SpoolRecord
    from relay.topology import MeshConfig
    from relay.topology.change import TopologyChange

log = logging.getLogger("relay.node")

HEARTBEAT_TOPIC = b"H|"
# The longest topic: b"S|" + a stream name of MAX_STREAM_NAME_BYTES + b"|".
TOPIC_MAX_BYTES = 3 + MAX_STREAM_NAME_BYTES
MESH_HWM = 10_000  # messages queued per peer link (PUB drops above it; the core repairs)
# What a subscriber sends the mesh PUB: (un)subscriptions, a flag byte and a topic prefix;
# with CurveZMQ also its handshake, a few hundred bytes (the limit applies to every frame).
SUBSCRIPTION_MAX_BYTES = 1 + TOPIC_MAX_BYTES
CURVE_SUBSCRIBER_MESSAGE_MAX_BYTES = 4_096
# Answers queued per client connection: well above a client's largest window (1,000 in
# relay.client) plus its parked reads, so a burst of replies is queued, never dropped.
CLIENT_HWM = 10_000
WAKE_DRAIN_BYTES = 4_096  # read from the wake-up socket at once
DRAIN_MAX = 2_048  # frames taken from one socket per loop iteration
# Client requests read into the intake per turn, ahead of serving them (relay/intake.py):
# reading is cheap next to serving, and what a client has queued is known only once read.
INTAKE_READ_MAX = 4 * DRAIN_MAX
# Requests of every client the intake holds at most: beyond, they wait in libzmq.
INTAKE_MAX = 100_000
# How long one turn serves client requests at most, looked at every so many requests.
SERVE_BUDGET_NS = 10_000_000
SERVE_CLOCK_EVERY = 16
# A client name whose connections were cut for flooding: its requests on any connection
# are dropped, and that connection cut too, for this long (a reconnect does not start
# the flood again at once).
FLOOD_HOLD_MS = 5_000
# Connections known closed (cut, or an answer found them gone), whose requests still
# queued in libzmq are dropped unserved; the oldest are forgotten beyond this many.
CLOSED_CONNECTIONS_MAX = 100_000
# How often joined/fenced transitions are looked for (and GC and the spool tended): at the
# first turn this long after the last, so at most a heartbeat interval later.
STATE_LOG_MS = 100
# Lines one look at the streams writes about single streams joining or fencing; the rest
# are told by kind, with this many of their names.
STREAM_LINES_PER_WATCH = 32
STREAM_NAMES_PER_LINE = 8
MALLOC_TRIM_MS = 10_000  # how often a relay owning its process trims its heap (_trim_heap)
LOOP_YIELD_MS = 1  # a relay alone in its event loop lets the loop run this often when busy
GC_FULL_COLLECT_MS = 600_000  # how often a relay owning its process runs a full collection
# The youngest generation's threshold in a relay owning its process (Python's default:
# 700). Most of what a relay allocates and keeps is held until evicted (each committed
# transaction adds several objects to its buffer), so at the default the collector ran
# every 1-3 ms at full load, walking thousands of live objects each time and finding
# nothing: 100-135 ms of every 2 s at window 4,096 in the coordinator. With this
# threshold a collection comes only after this many more objects stayed alive, which at
# tens of thousands of transactions a second takes longer than the STATE_LOG_MS after
# which `_tend_gc` freezes them anyway.
GC_YOUNG_THRESHOLD = 50_000
# At most one warning per kind of bad frame per second, and one line per stream and kind
# of configuration news (5.15: a disagreement, a topology naming other relays, ...).
BAD_FRAME_LOG_MS = 1_000
# Binding the mesh port again after unbinding it (`_rebind_mesh_port`): libzmq closes the
# old listener on its I/O thread, so the port is busy for a moment (about a millisecond
# here); the relay tries this often, this far apart, then again at its next state turn.
REBIND_TRIES = 200
REBIND_PAUSE_S = 0.001
SPOOL_PULL_MAX = 4_096  # committed records taken from the core per spool batch
# Of a client connection's answers, one per this many bytes is sent without a copy and
# tracked, to learn how much of what was sent it has taken (`_UnreadReplies`); closer
# together when one client name has many connections, so that what is counted unread
# for a client that reads (at most the spacing, per connection) stays within
# 1/PROBE_SHARE of limits.max_unread_reply_bytes, but never closer than the minimum.
PROBE_SPACING_BYTES = 4 * 1024 * 1024
PROBE_MIN_SPACING_BYTES = 64 * 1024
PROBE_SHARE = 8
# A connection with answers counted unread and nothing sent to it for this many prunes
# (STATE_LOG_MS apart: a minute) is forgotten: it closed, or it reads nothing more.
UNREAD_IDLE_PRUNES = 600


def stream_topic(stream: str) -> bytes:
    return b"S|" + stream.encode() + b"|"


def direct_topic(relay_id: int) -> bytes:
    return b"D|%d|" % relay_id


def strip_topic(message: bytes) -> bytes | None:
    """The frame after a mesh message's topic (None: no topic of ours starts it)."""
    if message.startswith(HEARTBEAT_TOPIC):
        return message[len(HEARTBEAT_TOPIC) :]
    if message.startswith((b"S|", b"D|")):
        end = message.find(b"|", 2, TOPIC_MAX_BYTES)
        if end > 2:
            return message[end + 1 :]
    return None


def subscription_prefix(pattern: str) -> bytes:
    """The SUB prefix for one subscription: the exact topic of a stream name, or the
    longest literal prefix of an fnmatch pattern (`orders.*` -> b"S|orders.")."""
    cut = [i for i in (pattern.find(c) for c in "*?[") if i >= 0]
    if not cut:
        return stream_topic(pattern)
    return b"S|" + pattern[: min(cut)].encode()


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def mono_ms() -> int:
    return time.monotonic_ns() // 1_000_000


_Answer = TypeVar("_Answer")


def _answer_all(queue: deque[Future[_Answer]], answer: _Answer) -> None:
    """Answer every request another thread queued for the loop (`RelayNode._ask_loop`),
    but those that gave up waiting."""
    while queue:
        request = queue.popleft()
        if request.set_running_or_notify_cancel():
            request.set_result(answer)


def _glibc_malloc_trim() -> Any:
    """glibc's malloc_trim, or None elsewhere (another libc, another system)."""
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


@dataclass
class _StreamView:
    joined: bool = False
    fenced: bool = True
    fence_reason: str = ""
    # 5.15, what was last logged: the peers' other configurations (peer -> (version,
    # relays)), the (configuration, topology's relays, relays holding the change) found
    # to differ, the history lost
    disagree: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    differs: tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]] | None = None
    history_lost: bool = False


@dataclass
class _Sockets:
    pub: zmq.Socket[Any]
    subs: dict[zmq.Socket[Any], int]  # one SUB per peer -> the peer's relay id
    router: zmq.Socket[Any]
    links: _PeerLinks
    closers: list[zmq.Socket[Any]] = field(default_factory=list)
    authenticator: MeshAuthenticator | None = None
    # The router's connections opening and closing (the client connections metric) and
    # its refused handshakes; the PUB's refused handshakes (relay/handshakes.py).
    client_events: LinkMonitor | None = None
    mesh_events: LinkMonitor | None = None


# pyzmq's flags are enum members; plain ints skip an enum operation per call.
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK


_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_ACCEPTED = int(zmq.EVENT_ACCEPTED)
_CONNECT_RETRIED = int(zmq.EVENT_CONNECT_RETRIED)


class _PeerLinks:
    """Watches the mesh SUBs' connections to the peers (`subs`: relay id -> (SUB, the
    peer's mesh endpoint)). A connection closes when the peer's process dies, when libzmq's
    heartbeat finds it dead, when libzmq drops it for a frame above ZMQ_MAXMSGSIZE, or when
    the CurveZMQ handshake fails. Either way the core hears at once that the peer is lost
    (`peer_lost`: no need to wait suspect_timeout_ms of silence before the others carry
    on). libzmq connects again by itself (ZMQ_EVENT_CONNECT_RETRIED follows at once),
    except after a protocol error such as the oversized frame: a link closed without that
    event is connected again here, `grace_ms` after it closed."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        subs: dict[int, tuple[zmq.Socket[Any], str]],
        grace_ms: int,
    ) -> None:
        self.ctx = ctx
        self.subs = subs
        self.grace_ms = grace_ms
        self.reconnect_at: dict[int, int] = {}  # relay id -> monotonic ms
        self.monitors: dict[int, LinkMonitor] = {}
        try:
            for relay, (sub, _) in subs.items():
                self.monitors[relay] = LinkMonitor(ctx, sub, _DISCONNECTED | _CONNECT_RETRIED)
        except BaseException:
            self.close()
            raise

    def add(self, relay: int, sub: zmq.Socket[Any], endpoint: str) -> None:
        """Watch the link of a relay added to the mesh while the relay runs."""
        self.subs[relay] = (sub, endpoint)
        self.monitors[relay] = LinkMonitor(self.ctx, sub, _DISCONNECTED | _CONNECT_RETRIED)

    def remove(self, relay: int) -> LinkMonitor:
        """Stop watching the link of a relay let go; returns its monitor, for the caller
        to close once the loop no longer waits on it."""
        del self.subs[relay]
        self.reconnect_at.pop(relay, None)
        return self.monitors.pop(relay)

    def sockets(self) -> list[zmq.Socket[Any]]:
        """The monitors' sockets, to wait on."""
        return [monitor.socket for monitor in self.monitors.values()]

    def next_due(self) -> int | None:
        """When a link is next due to be connected again here (None: none is)."""
        return min(self.reconnect_at.values()) if self.reconnect_at else None

    def poll(self, mono: int, readable: set[zmq.Socket[Any]]) -> list[int]:
        """The relays whose link closed since the last call (by the monitors among the
        `readable` sockets: the others have no event); reconnect the links due."""
        lost: list[int] = []
        for relay, monitor in self.monitors.items():
            if monitor.socket not in readable:
                continue
            for event, _ in monitor.events():
                if event == _CONNECT_RETRIED:  # libzmq connects again by itself
                    self.reconnect_at.pop(relay, None)
                else:
                    lost.append(relay)
                    self.reconnect_at.setdefault(relay, mono + self.grace_ms)
        for relay, due in list(self.reconnect_at.items()):
            if due <= mono:
                del self.reconnect_at[relay]
                sub, endpoint = self.subs[relay]
                with contextlib.suppress(zmq.ZMQError):  # libzmq may have dropped it already
                    sub.disconnect(endpoint)
                sub.connect(endpoint)
        return lost

    def close(self) -> None:
        for monitor in self.monitors.values():
            monitor.close()


class _Probed:
    """What was sent to one client connection, and what is known to have gone out."""

    __slots__ = ("idle", "out", "probe", "probe_end", "probe_start", "pruned_at", "sent")

    def __init__(self) -> None:
        self.sent = 0  # bytes of answers sent
        self.pruned_at = 0  # `sent` at the last prune
        self.idle = 0  # prunes since something was last sent
        self.out = 0  # of which libzmq is known to have let go
        self.probe: zmq.MessageTracker | None = None  # the tracked answer not yet out
        self.probe_start = 0  # `sent` before and after the last tracked answer
        self.probe_end = 0


class _Owner:
    """The client name a connection is one of (`_UnreadReplies.note_owner`), and the prunes
    since the connection was last named or had answers counted: its requests may wait in
    the intake a while before any answer, so it is not forgotten at once."""

    __slots__ = ("idle", "name")

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.idle = 0


_Queued = tuple[list[bytes], int]  # a client request's parts, its connection's descriptor


class _UnreadReplies:
    """An upper bound on the bytes of answers the ROUTER still queues, per client: a
    connection, or with CurveZMQ every connection of one client name (`note_owner`), so
    that opening more connections gives a client no more room. Every answer is counted;
    one per PROBE_SPACING_BYTES of a connection's goes without a copy and is tracked
    (pyzmq's MessageTracker is done once libzmq let go of it: wrote it to the connection or
    dropped the connection). A connection's queue drains in order, so when a tracked
    answer is out, so is everything sent before it: what is still queued is at most what
    was sent after it. Each tracked answer wakes pyzmq's garbage-collector thread, which
    must take the interpreter lock from the relay's loop: one per 4 MiB keeps that rare
    for a fast reader."""

    def __init__(self, max_unread_bytes: int) -> None:
        self.max_unread_bytes = max_unread_bytes
        self._clients: dict[bytes, _Probed] = {}  # by connection identity
        self._owner: dict[bytes, _Owner] = {}  # connection identity -> its client
        self._owned: dict[bytes, set[bytes]] = {}  # client name -> its connections

    def note_owner(self, client: bytes, name: bytes) -> None:
        """Connection `client` is one of client `name`'s (CurveZMQ's User-Id)."""
        owner = self._owner.get(client)
        if owner is not None and owner.name == name:
            owner.idle = 0
            return
        self._forget_owner(client)
        self._owner[client] = _Owner(name)
        self._owned.setdefault(name, set()).add(client)

    def wants_probe(self, client: bytes) -> bool:
        """Whether the next answer to `client` should be tracked: none is under way, and
        the probe spacing was sent since the last began (or none ever was)."""
        known = self._clients.get(client)
        if known is None:
            return True
        self._update(known)
        return known.probe is None and known.sent - known.probe_start >= self._spacing(client)

    def _spacing(self, client: bytes) -> int:
        owner = self._owner.get(client)
        connections = 1 if owner is None else len(self._owned[owner.name])
        share = self.max_unread_bytes // (PROBE_SHARE * connections)
        return max(PROBE_MIN_SPACING_BYTES, min(PROBE_SPACING_BYTES, share))

    def add(self, client: bytes, size: int, tracker: zmq.MessageTracker | None) -> None:
        known = self._clients.get(client)
        if known is None:
            known = self._clients[client] = _Probed()
        known.sent += size
        if tracker is not None:
            known.probe = tracker
            known.probe_start, known.probe_end = known.sent - size, known.sent

    def of(self, client: bytes) -> int:
        """At least the bytes of answers libzmq still holds for connection `client` and
        the other connections of its client name, at most that plus what was sent to
        each after its last tracked answer that went out."""
        owner = self._owner.get(client)
        if owner is None:
            return self._of_connection(client)
        return sum(self._of_connection(c) for c in self._owned[owner.name])

    def _of_connection(self, client: bytes) -> int:
        known = self._clients.get(client)
        if known is None:
            return 0
        self._update(known)
        return known.sent - known.out

    def prune(self) -> None:
        """Forget the connections known to have taken every answer, and those with none
        tracked under way and nothing sent for UNREAD_IDLE_PRUNES prunes (housekeeping:
        connections come and go); an idle one is known again from its next answer on."""
        for client, known in list(self._clients.items()):
            self._update(known)
            if known.probe is not None:
                continue
            if known.sent == known.pruned_at:
                known.idle += 1
            else:
                known.idle, known.pruned_at = 0, known.sent
            if known.sent == known.out or known.idle >= UNREAD_IDLE_PRUNES:
                del self._clients[client]
        idle = []
        for client, owner in self._owner.items():
            owner.idle = 0 if client in self._clients else owner.idle + 1
            if owner.idle >= UNREAD_IDLE_PRUNES:
                idle.append(client)
        for client in idle:
            self._forget_owner(client)

    def _forget_owner(self, client: bytes) -> None:
        owner = self._owner.pop(client, None)
        if owner is not None:
            owned = self._owned[owner.name]
            owned.discard(client)
            if not owned:
                del self._owned[owner.name]

    @staticmethod
    def _update(known: _Probed) -> None:
        if known.probe is not None and known.probe.done:
            known.out, known.probe = known.probe_end, None


class RelayNode:
    """One relay of the mesh. `await run()` until `stop()` (or SIGINT/SIGTERM)."""

    def __init__(
        self,
        config: MeshConfig,
        relay_id: int,
        *,
        handle_signals: bool = True,
        incarnation: int | None = None,
        manage_gc: bool | None = None,
        hop_trace: Path | None = None,
    ) -> None:
        """`handle_signals`: stop on SIGINT/SIGTERM. `manage_gc`: the node owns its process
        and tends the garbage collector (see `_tend_gc`); by default when it handles the
        process's signals (`relay run`), never when it is one of several (tests).
        `hop_trace`: stamp every frame in and out and write them to this file when the
        node stops (relay/hoptrace.py, `relay bench --hops`).

        Takes the relay's lock and its incarnation (relay/incarnation.py; an explicit
        `incarnation` skips the file): raises RelayAlreadyRunning if another process of
        this machine runs the relay, IncarnationError if the incarnation cannot be kept.
        The lock is held until `run()` returns or `close()`."""
        self.config = config
        self.id = relay_id
        core_config = config.core_config(relay_id)  # ConfigError naming the file if unknown
        self.spec = config.relays[relay_id]
        self.limits = config.limits
        self.handle_signals = handle_signals
        self.manage_gc = handle_signals if manage_gc is None else manage_gc
        self._trace = HopTrace(hop_trace) if hop_trace is not None else None
        directory = relay_directory(config.data_dir, relay_id)
        self._lock = RelayLock.acquire(directory, relay_id)
        try:
            now = wall_ms()
            if incarnation is None:
                ran_before = self._ran_before()
                incarnation = next_incarnation(directory, relay_id, now, ran_before=ran_before)
            self.incarnation = incarnation
            self._start(core_config, now)
        except BaseException:
            self._lock.release()
            raise

    def _start(self, core_config: CoreConfig, now: int) -> None:
        """The rest of the construction, once the relay's identity is locked."""
        # With CurveZMQ: this relay's key pair and who may talk to it, read before any
        # socket opens (a missing or wrong key stops the start with the file named).
        self._identity: Identity | None = None
        self._allowed: dict[str, dict[bytes, str]] = {}
        self._peer_keys: dict[int, bytes] = {}
        if self.config.security.curve:
            ring = KeyRing(self.config)
            self._identity = ring.relay_identity(self.id)
            self._peer_keys = ring.relay_public_keys()
            self._allowed = {
                MESH_DOMAIN: {key: relay_key_name(rid) for rid, key in self._peer_keys.items()},
                CLIENT_DOMAIN: ring.client_names(),
            }
        self.core = RelayCore(core_config, self.incarnation, now)
        self._acceptors = self._open_acceptor_memory()
        # Streams served by their acceptor record alone (5.15): subscribed to as well.
        self._recorded_streams = self.core.recorded_streams()
        self.counters: Counter[str] = Counter()
        self.clients = ClientService(
            self.core,
            self.limits,
            # Who serves a stream is its configuration's answer (5.15), not the topology's.
            members=self.core.members,
            send=self._send_client,
            counters=self.counters,
            status=self.status,
            warn=self._warn,
            relay_id=self.id,
            access=self.config.access if self._identity is not None else None,
            unread=self._unread_bytes,
            clock=time.perf_counter,
            reload=self.reload_answer,
        )
        # The metadata view's transfer from a peer when this relay joined above its
        # genesis (relay/metasync.py, docs/metadata.md 3).
        self._metasync = MetaSync(
            self.id,
            tuple(r for r in self.core.members(METADATA_STREAM) if r != self.id),
            self._send_meta_sync,
        )
        self._unread = _UnreadReplies(self.limits.max_unread_reply_bytes)
        # Requests read and not served yet, per client (relay/intake.py): (parts, the
        # descriptor of the connection they came on, or -1).
        self._intake: Intake[_Queued] = Intake(self.limits.max_queued_requests_per_client)
        self._closed_connections: OrderedDict[bytes, None] = OrderedDict()
        self._held_clients: dict[bytes, int] = {}  # client name -> held until (mono ms)
        self._stopping = False
        self._wakeup: asyncio.Future[None] | None = None  # ends a wait through the loop
        self._wake_r: socket.socket | None = None  # a byte here ends a wait in zmq_poll
        self._wake_w: socket.socket | None = None
        self._signalled: signal.Signals | None = None
        self._reload_wanted = False  # SIGHUP came: read the topology file again (`reload`)
        self._ctx: zmq.asyncio.Context | None = None  # the sockets' context, once running
        self._waiter_stale = False  # sockets came or went: the loop's waiter is made again
        # Relays a reloaded file removed from the mesh that a stream still counts: kept
        # (link, key) until none does (`_forget_peers`).
        self._leaving: set[int] = set()
        self._closing: list[Callable[[], None]] = []  # their sockets, closed between turns
        self._mesh_unbound = False  # the mesh port is to be bound again (`_bind_mesh_port`)
        self._subscribed: list[bytes] = []  # the SUB sockets' prefixes (`_subscriptions`)
        self._readmitted = 0  # the core's `config_readmitted` when last subscribed
        # Peers' protocol announcements (relay/peerprotocol.py), those with no protocol in
        # common (their frames are dropped unread), and when this relay last announced.
        self._peer_protocols: dict[int, peerprotocol.Announcement] = {}
        self._incompatible: set[int] = set()
        # peer -> the line naming the mesh limits it holds at other values (when it
        # announced them), so that each difference is logged once
        self._limits_differ: dict[int, str] = {}
        self._announced_ms = -peerprotocol.ANNOUNCE_MS
        # Whether the node is the only task of its event loop (looked at every STATE_LOG_MS):
        # then it waits in zmq_poll, else through the loop.
        self._alone_in_loop = False
        self._yielded_ms = 0  # when the loop last got a pass (LOOP_YIELD_MS)
        self._trimmed_ms = 0  # when the heap was last trimmed (_trim_heap)
        self._malloc_trim = _glibc_malloc_trim() if self.manage_gc else None
        self._running = False
        self._topics: dict[str, bytes] = {}
        # Frames of this turn for one topic, not yet published (`_publish`).
        self._held: list[bytes] = []
        self._held_topic = b""
        self._held_bytes = 0
        self._bundle_max_bytes = min(self.limits.max_frame_bytes, codec.BUNDLE_MAX_BYTES)
        self._views: dict[str, _StreamView] = {}
        self._left: set[str] = set()  # streams left (5.15), logged
        self._delivered: set[str] = set()  # streams with entries delivered here
        self._last_state_log = 0
        self._gc_full_at = mono_ms()
        self._last_tick = -1
        self._fed_tick_due = NO_FED_TICK  # the tick an input asked for (FED_TICK_MS)
        self._core_due = 0  # the core's next deadline as of the end of the last turn
        self._bad_logged: dict[str, int] = {}
        # Peers whose link closed and has not carried a frame since: logged once when it
        # closes and once when it carries frames again, not at every reconnect.
        self._links_down: set[int] = set()
        self._sockets: _Sockets | None = None
        # The HTTP endpoint (relay/opsserver.py) when the relay has an http_port; its
        # threads ask for the status document here, or only that the loop comes round
        # (/healthz), and the loop answers between turns.
        self._ops: OpsServer | None = None
        self._status_wanted: deque[Future[dict[str, object]]] = deque()
        self._turn_wanted: deque[Future[bool]] = deque()
        self._client_connections = 0
        self._committed_records: Counter[str] = Counter()  # per stream, since the start
        self._spool: Spool | None = None
        self._spool_cursor: dict[str, int] = {}  # stream -> last seq handed to the spool
        # The metadata stream's durable history, folded in a worker thread (it may be
        # long: the relay serves its other streams meanwhile) once every peer was asked
        # for its copy in vain, as after a restart of the whole mesh; a relay that
        # restarts alone copies a peer's and never reads it.
        self._fold_wanted = False
        self._durable_fold: asyncio.Future[DurableFold | None] | None = None
        self._seed_from_history()

    def _ran_before(self) -> bool:
        """Whether this relay ran here before, as far as anything besides its incarnation
        file shows: its acceptor records (relay/acceptors.py) or its spool (relay/spool.py).
        Then its first incarnation is behind it, whatever became of the file."""
        acceptors = self.config.data_dir / "acceptors" / f"relay-{self.id}"
        spool = self.config.spool_dir / f"relay={self.id}"
        return acceptors.is_dir() or spool.is_dir()

    # --- public -------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to end; `run()` then closes every socket and returns. Safe from any
        thread and from signal handlers: it ends the loop's wait, in zmq_poll (a byte on
        the node's wake-up socket) or through the event loop (its wake-up future)."""
        self._stopping = True
        self._poke()

    def _poke(self) -> None:
        """End the loop's wait (safe from any thread): a byte on the wake-up socket for a
        wait in zmq_poll, the wake-up future for a wait through the event loop."""
        wake = self._wake_w
        if wake is not None:
            with contextlib.suppress(OSError):  # full (a byte is there) or just closed
                wake.send(b"\0")
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing waits
                wakeup.get_loop().call_soon_threadsafe(_wake, wakeup)

    def close(self) -> None:
        """Release the relay's lock without running (`run()` releases it when it ends)."""
        if not self._running:
            self._release()

    def _release(self) -> None:
        if self._acceptors is not None:
            self._acceptors.close()
        self._lock.release()

    @property
    def running(self) -> bool:
        """True once the sockets are bound and the loop runs."""
        return self._running

    def status(self) -> dict[str, object]:
        # The sockets' monitor events up to now: the connections and refused handshakes
        # the document counts (else taken every STATE_LOG_MS).
        self._count_client_connections()
        status = self.core.status()
        status["node"] = {
            "mesh_endpoint": self.spec.mesh_endpoint,
            "client_endpoint": self.spec.client_endpoint,
            "incarnation": self.incarnation,
            "pending_produces": self.clients.pending_produces,
            "parked_reads": self.clients.parked_reads,
            "curve": self._identity is not None,
            "handshakes_refused": self._handshakes_refused(),
            "counters": dict(self.counters),
            "protocol": {
                "version": peerprotocol.PROTOCOL_VERSION,
                "speaks": list(peerprotocol.SPEAKS),
            },
            "peer_protocols": self._peer_protocol_status(),
            "limits": asdict(self.limits),  # (a reload may have changed them)
            # For the metrics and the status page (relay/metrics.py, relay/page.html).
            "version": __version__,
            "wall_ms": wall_ms(),
            "peers": sorted(r for r in self.config.relays if r != self.id),
            # removed from the mesh by a reload, still counted by a stream (`_forget_peers`)
            "leaving": sorted(self._leaving),
            "http": {
                str(rid): spec.http_url
                for rid, spec in sorted(self.config.relays.items())
                if spec.http_url is not None
            },
            "client_connections": self._client_connections,
            "produce_latency": self.clients.latency.document(),
            "refusals": self.clients.refusals.document(),
        }
        streams = status["streams"]
        assert isinstance(streams, dict)
        for name, st in streams.items():
            st["committed_records"] = self._committed_records.get(name, 0)
            st["served_records"] = self.clients.served.get(name, 0)
        if self._spool is not None:
            spooled = self._spool.status()
            status["spool"] = {name: getattr(spooled, name) for name in type(spooled).__slots__}
        view = self.clients.meta
        status["metadata"] = {
            "complete": view.complete,
            "gap": view.gap,
            "applied": view.state.applied,
            "keys": len(view.state.items),
            "folding_history": self._durable_fold is not None,
            "sync": dict(self._metasync.counters),
        }
        return status

    def status_from_loop(self, wait_s: float) -> dict[str, object] | None:
        """The status document, built by the loop between two turns (from any other
        thread: the HTTP endpoint's); None if the loop did not build it within `wait_s`."""
        return self._ask_loop(self._status_wanted, wait_s)

    def turn_from_loop(self, wait_s: float) -> bool:
        """Whether the loop comes round within `wait_s` (from any other thread: the HTTP
        endpoint's /healthz). Liveness for the price of a turn: no status document."""
        return self._ask_loop(self._turn_wanted, wait_s) is not None

    def _ask_loop(self, queue: deque[Future[_Answer]], wait_s: float) -> _Answer | None:
        wanted: Future[_Answer] = Future()
        queue.append(wanted)
        self._poke()
        try:
            return wanted.result(wait_s)
        except TimeoutError:
            wanted.cancel()
            return None

    def _answer_status_requests(self) -> None:
        if not self._status_wanted:
            return
        _answer_all(self._status_wanted, self.status())

    def _count_client_connections(self) -> None:
        """Take the listening sockets' monitor events: client connections opened and
        closed, and handshakes refused (each counted and logged, `_refused_handshake`)."""
        socks = self._sockets
        if socks is None:
            return
        if socks.client_events is not None:
            for event, endpoint, value in socks.client_events.events_with_values():
                if event == _ACCEPTED:
                    self._client_connections += 1
                elif event == _DISCONNECTED:
                    self._client_connections -= 1
                else:
                    self._refused_handshake(CLIENT_DOMAIN, event, endpoint, value)
            self._client_connections = max(self._client_connections, 0)
        if socks.mesh_events is not None:
            for event, endpoint, value in socks.mesh_events.events_with_values():
                self._refused_handshake(MESH_DOMAIN, event, endpoint, value)

    def _refused_handshake(self, domain: str, event: int, endpoint: str, value: int) -> None:
        """Count a refused handshake on the `domain` socket (clients or mesh) and log it
        (at most one line per kind per BAD_FRAME_LOG_MS) with the peer's address where
        known: for a key ZAP refused (relay/handshakes.py says why only then)."""
        refused = refusal(event, value)
        if refused is None:
            return
        self.counters[refused.counter] += 1
        socks = self._sockets
        address = ""
        if refused.by_zap and socks is not None and socks.authenticator is not None:
            address = socks.authenticator.refused_address(domain)
        self._warn(
            refused.counter,
            "relay=%d refused a %s handshake at %s from %s: %s",
            self.id,
            domain,
            endpoint,
            address or "an address libzmq does not report",
            refused.why,
        )

    def _open_http(self) -> None:
        """Serve HTTP for operators if the relay has an http_port (relay/opsserver.py,
        imported only then: without it the relay loads no HTTP or Prometheus code)."""
        spec = self.spec
        if spec.http_port is None:
            return
        from relay.opsserver import OpsServer

        try:
            self._ops = OpsServer(
                spec.bind_host,
                spec.http_port,
                self.status_from_loop,
                self.id,
                liveness=self.turn_from_loop,
                incarnation=self.incarnation,
                expose_status=self.config.http.expose_status,
            )
        except OSError as e:
            bound = f" (binding {spec.bind})" if spec.bind else ""
            raise PortUnavailable(
                f"relay {self.id} cannot serve HTTP on {spec.http_url}{bound}: {e.strerror or e}"
            ) from e
        self._ops.start()

    def _handshakes_refused(self) -> int:
        """Handshakes refused on the client and mesh sockets, of every kind."""
        counters = self.counters
        return sum(counters[name] for name in HANDSHAKES_REFUSED)

    async def run(self) -> None:
        ctx = zmq.asyncio.Context()
        self._ctx = ctx
        previous: dict[signal.Signals, Any] = {}  # the signal handlers to put back
        previous_wakeup_fd: int | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        try:
            self._sockets = self._open(ctx)
            self._open_http()  # after the relay's own ports: a port taken fails like theirs
            if self.handle_signals:
                previous_wakeup_fd = self._handle_signals(previous)
            log.info(
                "relay=%d incarnation=%d started: mesh %s, clients %s, peers %s",
                self.id,
                self.incarnation,
                self.spec.mesh_endpoint,
                self.spec.client_endpoint,
                sorted(r for r in self.config.relays if r != self.id),
                extra={"relay": self.id, "incarnation": self.incarnation, STATE_CHANGE: True},
            )
            self._log_recorded_streams()
            self._open_spool()
            self._running = True
            thresholds = gc.get_threshold()
            if self.manage_gc:
                gc.set_threshold(GC_YOUNG_THRESHOLD, *thresholds[1:])
            try:
                await self._loop(self._sockets)
            finally:
                gc.set_threshold(*thresholds)
        finally:
            self._running = False
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if previous_wakeup_fd is not None:
                signal.set_wakeup_fd(previous_wakeup_fd)
            if self._signalled is not None:
                log.info("relay=%d received %s, stopping", self.id, self._signalled.name)
            wake_r, wake_w, self._wake_w = self._wake_r, self._wake_w, None
            wake_r.close()
            wake_w.close()
            try:
                if self._ops is not None:
                    self._ops.close()
                    self._ops = None
                self._shutdown()
                self._close_spool()
                ctx.term()
                if self._trace is not None:
                    self._trace.write()
            finally:
                self._release()
            log.info("relay=%d stopped; counters %s", self.id, dict(self.counters))

    # --- history: the store and the spool ---------------------------------------------

    def _seed_from_history(self) -> None:
        """Tell the core where durable history ends (the store's last points, and this
        relay's own spool, which may be further on): should the mesh start with no relay
        holding a stream, it carries on from there instead of from the genesis."""
        points: dict[str, tuple[int, bytes]] = {}
        points.update(self._stored_points())
        if self.config.spool.enabled:
            from relay.spool import last_spooled_points

            for stream, point in last_spooled_points(self.config.spool_dir, self.id).items():
                if point[0] > points.get(stream, (-1, b""))[0]:
                    points[stream] = point
        for stream, (seq, digest) in sorted(points.items()):
            try:
                seeded = self.core.seed(stream, seq, digest)
            except ValueError as error:
                log.error("relay=%d stream=%s bad stored point: %s", self.id, stream, error)
                continue
            if seeded:
                self.counters["seeded_streams"] += 1
                log.info("relay=%d stream=%s history ends at seq %d", self.id, stream, seq)
        self._fold_wanted = METADATA_STREAM in points

    def _stored_points(self) -> dict[str, tuple[int, bytes]]:
        """Per stream the store's last (seq, digest); none when there is no store or it is
        unreadable (pyarrow and deltalake, the store's: imported only when a store is
        there)."""
        location = self.config.store_location
        try:
            if not location.is_dir(STREAMS_DIR):
                return {}
        except OSError as error:  # an object store out of reach: carry on without it
            log.error(
                "relay=%d store %s unreachable, not seeding from it: %s", self.id, location, error
            )
            return {}
        try:
            from relay.store.errors import StoreError
            from relay.store.tables import load_store
        except ImportError as error:
            log.error("relay=%d cannot read the store, not seeding from it: %s", self.id, error)
            return {}
        try:
            stored = load_store(location)
        except (StoreError, OSError) as error:
            log.error("relay=%d store unreadable, not seeding from it: %s", self.id, error)
            return {}
        return {
            stream: (state.last_seq, digest)
            for stream, state in stored.streams.items()
            if state.records and (digest := state.last_digest_bytes) is not None
        }

    def _fold_metadata_history(self) -> DurableFold | None:
        """Fold the metadata stream's durable history, for when no peer has the state
        either (the whole mesh restarted): docs/metadata.md 3. Runs in a worker thread."""
        spool = self.config.spool_dir if self.config.spool.enabled else None
        try:
            durable = fold_durable_history(self.config.store_location, spool, self.id)
        except Exception as error:  # unreadable history must not stop the relay: peers may help
            log.error("relay=%d metadata history unreadable, not folded: %s", self.id, error)
            return None
        if durable is not None:
            log.info(
                "relay=%d metadata folded from durable history: %d keys as of seq %d",
                self.id,
                len(durable.items),
                durable.as_of,
            )
        return durable

    def _open_spool(self) -> None:
        settings = self.config.spool
        if not settings.enabled:
            return
        from relay.spool import Spool

        self._spool = Spool(
            self.config.spool_dir,
            self.id,
            segment_max_bytes=settings.segment_max_bytes,
            segment_max_age_ms=settings.segment_max_age_ms,
            disk_max_bytes=settings.disk_max_bytes,
            store=self.config.store_location,
        )
        log.info("relay=%d spooling to %s", self.id, self._spool.root)

    def _count_spool_room(self) -> None:
        """Tell the core what the spool can take (it votes only within it, 5.14), and hand
        over what waited for room once there is room again."""
        spool = self._spool
        assert spool is not None
        core = self.core
        was_blocked = core.spool_blocked
        core.set_spool_room(spool.room_bytes(), spool.refused_streams())
        if core.spool_blocked != was_blocked:
            if core.spool_blocked:
                log.warning(
                    "relay=%d spool full (%s): this relay votes on no stream until the "
                    "store ingests and the spool is reclaimed",
                    self.id,
                    _spool_figures(spool),
                    extra={"relay": self.id, STATE_CHANGE: True},
                )
            else:
                log.info(
                    "relay=%d spool has room again: voting again",
                    self.id,
                    extra={"relay": self.id, STATE_CHANGE: True},
                )
        if not core.spool_blocked:
            waiting = core.spool_waiting_streams()
            if waiting:
                self._feed_spool(waiting)

    def _feed_spool(self, streams: Iterable[str]) -> None:
        """Hand the committed records of `streams` not yet spooled to the spool (which
        never blocks: its writer thread does the disk), as far as the core lets it (5.14:
        records it did not vote for wait while the spool is full)."""
        spool = self._spool
        assert spool is not None
        for stream in streams:
            cursor = self._spool_cursor.get(stream, -1)
            while True:
                base, _, records = self.core.spool_records(stream, cursor, SPOOL_PULL_MAX)
                if cursor < base:
                    if stream in self._spool_cursor:
                        # Evicted or rebased before we took it: this relay's spool has a
                        # gap there, which the other relays' spools cover.
                        self.counters["spool_gaps"] += 1
                        self._warn("spool_gaps", "relay=%d stream=%s spool gap", self.id, stream)
                    cursor = base
                if not records:
                    break
                spool.append(stream, [_spool_record(record) for record in records])
                cursor = records[-1][0]
                if len(records) < SPOOL_PULL_MAX:
                    break
            self._spool_cursor[stream] = cursor

    def _close_spool(self) -> None:
        spool = self._spool
        if spool is None:
            return
        try:
            self._feed_spool(self.core.stream_names())
        finally:
            self._spool = None
            spool.close()
        log.info("relay=%d spool closed: %s", self.id, spool.status())

    # --- sockets ------------------------------------------------------------------------

    def _open(self, ctx: zmq.asyncio.Context) -> _Sockets:
        max_frame = self.limits.max_frame_bytes
        timings = MeshLinkTimings.from_limits(self.limits)
        plain_ctx: zmq.Context[Any] = zmq.Context.shadow(ctx.underlying)
        identity = self._identity
        closers: list[zmq.Socket[Any]] = []
        authenticator = None
        try:
            if identity is not None:
                # Before the first bind: libzmq asks ZAP of every handshake from then on.
                authenticator = MeshAuthenticator(plain_ctx, self._allowed)
                authenticator.start()
            pub = ctx.socket(zmq.PUB)
            closers.append(pub)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, MESH_HWM)
            pub.setsockopt(
                zmq.MAXMSGSIZE,
                CURVE_SUBSCRIBER_MESSAGE_MAX_BYTES
                if identity is not None
                else SUBSCRIPTION_MAX_BYTES,
            )
            timings.apply(pub, pings=False)
            if identity is not None:
                curve_server(pub, identity, MESH_DOMAIN)
            allow_ipv6(pub, self.spec.bind_host)
            pub.bind(self.spec.mesh_bind_endpoint)  # peers connect to mesh_endpoint

            subs: dict[int, tuple[zmq.Socket[Any], str]] = {}  # plain views
            self._subscribed = self._subscriptions()
            for relay_id in sorted(self.config.relays):
                if relay_id != self.id:
                    subs[relay_id] = self._open_sub(ctx, relay_id, closers)

            router = ctx.socket(zmq.ROUTER)
            closers.append(router)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, CLIENT_HWM)
            # No receive mark: libzmq 4.3.5 aborts the process (`Assertion failed:
            # !_io_error`) when a connection whose receive queue is full closes while a
            # ZMTP PING waits in its buffer (scripts/libzmq_router_abort.py shows it), which
            # any client can arrange. Unmarked, a client's requests queue until the loop
            # takes them (DRAIN_MAX per turn, in order).
            router.setsockopt(zmq.RCVHWM, 0)
            # The transport refuses (drops the connection of) anything above
            # max_frame_bytes; a request above request_limit gets an ErrorResp.
            router.setsockopt(zmq.MAXMSGSIZE, max_frame)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone client fails
            if identity is not None:
                curve_server(router, identity, CLIENT_DOMAIN)
            allow_ipv6(router, self.spec.bind_host)
            router.bind(self.spec.client_bind_endpoint)  # clients connect to client_endpoint
            client_events = LinkMonitor(
                plain_ctx, router, _ACCEPTED | _DISCONNECTED | HANDSHAKE_FAILED
            )
            closers.append(client_events.socket)
            mesh_events = LinkMonitor(plain_ctx, pub, HANDSHAKE_FAILED)
            closers.append(mesh_events.socket)
            links = _PeerLinks(plain_ctx, subs, grace_ms=timings.reconnect_ivl_ms)
        except BaseException:
            for sock in closers:
                sock.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            raise
        # Plain (synchronous) views of the same sockets, for non-blocking drains and sends
        # without a Future per frame; the asyncio sockets are only used to wait.
        return _Sockets(
            pub=zmq.Socket.shadow(pub.underlying),
            subs={sub: relay_id for relay_id, (sub, _) in subs.items()},
            router=zmq.Socket.shadow(router.underlying),
            links=links,
            closers=closers,
            authenticator=authenticator,
            client_events=client_events,
            mesh_events=mesh_events,
        )

    def _open_sub(
        self, ctx: zmq.asyncio.Context, relay_id: int, closers: list[zmq.Socket[Any]]
    ) -> tuple[zmq.Socket[Any], str]:
        """The SUB of the link from relay `relay_id` (its plain view and the endpoint it
        connects to), subscribed to `_subscribed`; added to `closers`."""
        spec = self.config.relays[relay_id]
        timings = MeshLinkTimings.from_limits(self.limits)
        # a peer's frame may be another's passed on inside a Relayed (5.13)
        max_peer_frame = peer_frame_limit(self.limits.max_frame_bytes)
        sub = mesh_subscriber(ctx, timings, max_msg_bytes=max_peer_frame + TOPIC_MAX_BYTES)
        closers.append(sub)
        if self._identity is not None:
            curve_client(sub, self._identity, self._peer_keys[relay_id])
        for prefix in self._subscribed:
            sub.setsockopt(zmq.SUBSCRIBE, prefix)
        allow_ipv6(sub, spec.host)
        sub.connect(spec.mesh_endpoint)
        return zmq.Socket.shadow(sub.underlying), spec.mesh_endpoint

    def _add_peers(self, socks: _Sockets, added: Sequence[int], keys: dict[int, bytes]) -> None:
        """Relays a reloaded file adds to the mesh (relay/topology/change.py): their keys
        are let in (`keys`, with CurveZMQ), a SUB connects to each, watched like the others,
        and the loop waits on it from its next turn (`_waiter_stale`)."""
        assert self._ctx is not None
        for relay_id in added:
            if self._identity is not None:
                self._peer_keys[relay_id] = keys[relay_id]
                self._allowed[MESH_DOMAIN][keys[relay_id]] = relay_key_name(relay_id)
            sub, endpoint = self._open_sub(self._ctx, relay_id, socks.closers)
            socks.subs[sub] = relay_id
            socks.links.add(relay_id, sub, endpoint)
        self._waiter_stale = True

    def _forget_peers(self, socks: _Sockets) -> None:
        """Let go of the relays removed from the mesh that no stream here counts any
        more (`RelayCore.forget_relays`): their SUB closed, their key no longer let in
        (a handshake from now on is refused; a connection made before stays until the
        relay stops, which the operator does once it has left, docs/deploy.md section 9)."""
        gone = self.core.forget_relays(self._leaving)
        if self._mesh_unbound:
            self._bind_mesh_port(socks)
        for relay_id in gone:
            self._leaving.discard(relay_id)
            sub = next(s for s, r in socks.subs.items() if r == relay_id)
            del socks.subs[sub]
            # Closed once the loop's waiter, which may be waiting on them, is made again.
            self._closing.append(socks.links.remove(relay_id).close)
            owned = next(c for c in socks.closers if c.underlying == sub.underlying)
            socks.closers.remove(owned)
            self._closing.append(functools.partial(owned.close, linger=0))
            key = self._peer_keys.pop(relay_id, None)
            if key is not None:
                self._allowed[MESH_DOMAIN].pop(key, None)
            self._peer_protocols.pop(relay_id, None)
            self._incompatible.discard(relay_id)
            self._limits_differ.pop(relay_id, None)
            self._links_down.discard(relay_id)
            log.warning(
                "relay=%d let relay %d go: it left the mesh and no stream here counts it",
                self.id,
                relay_id,
                extra={"relay": self.id, "peer": relay_id, STATE_CHANGE: True},
            )
        if gone:
            self._waiter_stale = True
            if socks.authenticator is not None:
                self._rebind_mesh_port(socks)

    def _rebind_mesh_port(self, socks: _Sockets) -> None:
        """Drop every connection to our PUB: libzmq closes those a listener accepted when
        it is unbound. A relay let go then gets nothing more of ours over a connection it
        made before (its key is no longer let in, so it cannot connect again); the
        others reconnect within reconnect_ivl_ms and fill what they missed meanwhile as
        any lost frame (docs/protocol.md 5.2). Only with CurveZMQ: without it anyone may
        connect, so there is nothing to keep out."""
        endpoint = socks.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        socks.pub.unbind(endpoint)
        self._mesh_unbound = True
        self._bind_mesh_port(socks)

    def _bind_mesh_port(self, socks: _Sockets) -> None:
        """Bind the mesh port again (`_rebind_mesh_port`), or say why not and try again
        at the next state turn: meanwhile no peer hears us, and we are suspected."""
        error: zmq.ZMQError | None = None
        for _ in range(REBIND_TRIES):
            try:
                socks.pub.bind(self.spec.mesh_bind_endpoint)
            except zmq.ZMQError as e:
                error = e
                time.sleep(REBIND_PAUSE_S)
                continue
            self._mesh_unbound = False
            log.info(
                "relay=%d mesh port bound again: connections made before are closed",
                self.id,
                extra={"relay": self.id},
            )
            return
        log.error(
            "relay=%d cannot bind the mesh port %s again (%s): no peer hears this relay "
            "until it can; trying again",
            self.id,
            self.spec.mesh_bind_endpoint,
            error,
            extra={"relay": self.id},
        )

    def _subscriptions(self) -> list[bytes]:
        prefixes = [subscription_prefix(p) for p in self.spec.streams]
        prefixes += [stream_topic(stream) for stream in self._recorded_streams]
        prefixes += [direct_topic(self.id), HEARTBEAT_TOPIC, peerprotocol.TOPIC]
        return list(dict.fromkeys(prefixes))

    def _subscribe_new(self, socks: _Sockets) -> None:
        """Subscribe every peer link to what the relay serves now and did not when its
        sockets opened: streams a reloaded file names for it, and streams a change of
        their configuration added it to (5.15 changes: `RelayCore.recorded_streams`).
        Nothing is unsubscribed: frames of a stream no longer served are dropped by the
        core, and libzmq keeps every subscription anyway."""
        self._recorded_streams = self.core.recorded_streams()
        known = set(self._subscribed)
        new = [prefix for prefix in self._subscriptions() if prefix not in known]
        for prefix in new:
            for sock in socks.subs:
                sock.setsockopt(zmq.SUBSCRIBE, prefix)
        self._subscribed += new

    def _close_let_go(self) -> None:
        """Close the sockets of the relays let go (`_forget_peers`)."""
        closing, self._closing = self._closing, []
        for close in closing:
            close()

    def _shutdown(self) -> None:
        socks = self._sockets
        if socks is None:
            return
        self._close_let_go()
        self.clients.close()  # best effort: waiting producers hear `unknown` (safe to retry)
        self._sockets = None
        socks.links.close()
        for monitor in (socks.client_events, socks.mesh_events):
            if monitor is not None:
                monitor.close()
        for sock in socks.closers:
            sock.close(linger=0)
        if socks.authenticator is not None:
            socks.authenticator.stop()

    def _handle_signals(self, previous: dict[signal.Signals, Any]) -> int | None:
        """Stop on SIGINT and SIGTERM: plain Python handlers rather than the event loop's
        (which would only run once the loop ran again, not while the node waits in
        zmq_poll), and the node's wake-up socket as the signal wake-up descriptor: a signal
        that comes just before the wait starts still ends it. Records the handlers
        replaced in `previous`; returns the wake-up descriptor replaced (None if none
        was set here: e.g. not the main thread)."""
        assert self._wake_w is not None
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                handler = self._on_hangup if sig == signal.SIGHUP else self._on_signal
                previous[sig] = signal.signal(sig, handler)
            except (OSError, ValueError) as e:  # e.g. not the main thread
                log.warning("relay=%d cannot handle %s: %s", self.id, sig.name, e)
        if not previous:
            return None
        return signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)

    def _on_signal(self, signum: int, frame: object) -> None:
        """SIGINT or SIGTERM: stop. It runs as soon as the main thread runs Python code:
        a wait in zmq_poll is interrupted by the signal, or ended by the byte the signal
        wrote to the wake-up descriptor."""
        self._signalled = signal.Signals(signum)
        self.stop()

    def _on_hangup(self, signum: int, frame: object) -> None:
        """SIGHUP: read the topology file again, between two turns (`reload`)."""
        self._reload_wanted = True
        self._poke()

    def reload(self) -> TopologyChange | None:
        """Read the topology file again and take it if a running relay can
        (relay/topology/change.py): each stream's wanted relays follow it, and the mesh
        changes the streams' relays once their relays' files agree (5.15 changes); the
        relay subscribes to the streams it names for it. A file that cannot be read or
        checked, or that changes what only a restart applies, is refused with one line
        naming why, and the relay runs on as before. Returns the change taken, None if
        the file was refused."""
        return self._reload_file()[0]

    def reload_answer(self) -> tuple[bool, str, bytes]:
        """A ReloadReq (relay/service.py): `reload`, answered with whether the file was
        taken, what it changes or why it was refused, and the digest of the text read."""
        change, words, digest = self._reload_file()
        return change is not None, words, digest

    def _reload_file(self) -> tuple[TopologyChange | None, str, bytes]:
        from relay.topology import load_text, read_text, text_digest
        from relay.topology.change import compare

        path = self.config.path
        digest = b""
        try:
            text = read_text(path)
            digest = text_digest(text)
            new = load_text(text, path)
        except ConfigError as e:
            return None, self._refuse_reload(str(e)), digest
        change = compare(self.config, new, self.id, self.core.stream_names())
        if change.refused:
            refused = "; ".join(change.refused)
            if self.id not in change.removed_relays:
                refused += " (these apply only at a restart)"
            return None, self._refuse_reload(f"{path}: {refused}"), digest
        core_config = new.core_config(self.id)
        clients = None
        relay_keys: dict[int, bytes] = {}
        if self._identity is not None and (change.clients or change.added_relays):
            try:  # the public keys, inline or in keys_dir: all found, or nothing changes
                ring = KeyRing(new)
                clients = ring.client_names() if change.clients else None
                relay_keys = ring.relay_public_keys() if change.added_relays else {}
            except ConfigError as e:
                return None, self._refuse_reload(str(e)), digest
        self.core.reload_topology(core_config)
        if change.limits:
            self._take_limits(new.limits)
        if clients is not None:
            # The handshakes from now on (the ZAP thread reads the entry), and the rights
            # of every request.
            self._allowed[CLIENT_DOMAIN] = clients
            self.clients.set_access(new.access)
        self.config = new
        self.spec = new.relays[self.id]
        if self._sockets is not None:
            # A relay named again before it was let go still has its link and key.
            added = [r for r in change.added_relays if r not in self._leaving]
            self._leaving.difference_update(change.added_relays)
            if added:
                self._add_peers(self._sockets, added, relay_keys)
            self._subscribe_new(self._sockets)
            self._leaving.update(change.removed_relays)
            self._forget_peers(self._sockets)
        self.counters["topology_reloaded"] += 1
        words = change.words()
        log.warning(
            "relay=%d reloaded %s: %s",
            self.id,
            path,
            words,
            extra={"relay": self.id, "reload": words, STATE_CHANGE: True},
        )
        return change, words, digest

    def _take_limits(self, limits: Limits) -> None:
        """The shell's bounds from a reloaded file (the core took its own): each applies to
        what comes from then on."""
        self.limits = limits
        self.clients.set_limits(limits)
        self._unread.max_unread_bytes = limits.max_unread_reply_bytes
        self._intake.max_queued = limits.max_queued_requests_per_client

    def _refuse_reload(self, why: str) -> str:
        self.counters["topology_reload_refused"] += 1
        log.error(
            "relay=%d reload refused, running on as before: %s",
            self.id,
            why,
            extra={"relay": self.id, "reload_refused": why, STATE_CHANGE: True},
        )
        return why

    # --- the loop -----------------------------------------------------------------------

    async def _loop(self, socks: _Sockets) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake_r is not None
        waiter = ReadableWaiter(
            (*socks.subs, socks.router, *socks.links.sockets()), self._wake_r.fileno()
        )
        self._alone_in_loop = len(asyncio.all_tasks(loop)) == 1
        try:
            while not self._stopping:
                wait_ms = self._next_wake_ms(socks) - mono_ms()
                yielded = False
                if self._alone_in_loop:
                    # Alone in its event loop (`relay run`): wait in zmq_poll, the fastest
                    # and cheapest wake-up, which also says what is readable already (no
                    # look at each socket's EVENTS first: 3.5 us per socket per turn). The
                    # loop's callbacks run between two turns; `stop()` and signals end the
                    # poll through the wake-up socket.
                    readable = waiter.poll(max(wait_ms, 0))
                else:
                    readable = waiter.readable()
                    if not readable and wait_ms > 0:
                        # Sharing the loop with other tasks (several nodes, clients, in
                        # tests): wait through the loop, which serves them meanwhile.
                        readable = await self._wait(waiter, wait_ms)
                        yielded = True
                if waiter.woken:
                    waiter.woken = False
                    self._drain_wake()
                if self._stopping:
                    break
                if self._reload_wanted:
                    self._reload_wanted = False
                    self.reload()
                self._turn(socks, readable)
                if self._waiter_stale:  # relays added or let go (`_add_peers`, `_forget_peers`)
                    self._waiter_stale = False
                    waiter.close()
                    self._close_let_go()
                    waiter = ReadableWaiter(
                        (*socks.subs, socks.router, *socks.links.sockets()),
                        self._wake_r.fileno(),
                    )
                if not yielded and (
                    not self._alone_in_loop or mono_ms() - self._yielded_ms >= LOOP_YIELD_MS
                ):
                    # Let other tasks and callbacks (signals) run. Not after a wait through
                    # the loop, which just did: an extra pass would find the sockets'
                    # descriptors signalling again and cost a round of reader changes.
                    # Alone in the loop, only every LOOP_YIELD_MS: a pass of the loop is
                    # a system call (5-9 us), and a busy relay turns thousands of times a
                    # second.
                    self._yielded_ms = mono_ms()
                    await asyncio.sleep(0)
        finally:
            self._wakeup = None
            waiter.close()

    async def _wait(self, waiter: ReadableWaiter, wait_ms: int) -> set[zmq.Socket[Any]]:
        """Wait through the event loop until a socket is readable, `stop()`, or `wait_ms`
        passed. A descriptor that signals with nothing to read (ZeroMQ's descriptors signal
        state changes, e.g. a command about a message the last turn already took) does not
        end the wait: that would cost a turn for nothing."""
        loop = asyncio.get_running_loop()
        due = mono_ms() + wait_ms
        try:
            while True:
                self._wakeup = loop.create_future()
                readable = await waiter.wait(wait_ms / 1000, self._wakeup)
                wait_ms = due - mono_ms()
                if readable or wait_ms <= 0 or self._stopping or waiter.woken:
                    return readable
                self.counters["loop_idle_signals"] += 1
        finally:
            self._wakeup = None

    def _drain_wake(self) -> None:
        """Empty the wake-up socket (bytes from `stop()` or a signal), so that it signals
        again only for what comes next."""
        assert self._wake_r is not None
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(WAKE_DRAIN_BYTES):
                pass

    def _next_wake_ms(self, socks: _Sockets) -> int:
        """The monotonic time of the next turn if nothing arrives before: the core's next
        deadline, the service's, a link due to be connected again; now while the intake
        holds requests. (Housekeeping rides on the turns: the core's deadline comes at
        least every heartbeat interval.)"""
        if self._intake:
            return mono_ms()
        self._core_due = self.core.next_deadline_ms()
        # The core is ticked at most once per millisecond: a deadline it already saw at
        # this millisecond is looked at again at the next one.
        due = max(min(self._core_due, self._fed_tick_due), self._last_tick + 1)
        for other in (self.clients.next_deadline_ms(), socks.links.next_due()):
            if other is not None and other < due:
                due = other
        return due

    def _turn(self, socks: _Sockets, readable: set[zmq.Socket[Any]]) -> None:
        now, mono = wall_ms(), mono_ms()
        self.counters["loop_turns"] += 1
        if self._spool is not None:
            self._count_spool_room()
        fed = False
        for sock, relay in socks.subs.items():
            if sock in readable:
                self._drain_peer(sock, relay, now, mono)
                fed = True
        if socks.router in readable or self._intake:
            self._drain_clients(socks, socks.router in readable, now, mono)
            fed = True
        for relay in socks.links.poll(mono, readable):
            self.counters["peer_link_closed"] += 1
            if relay not in self._links_down:
                self._links_down.add(relay)
                log.warning(
                    "relay=%d link from relay %d closed; reconnecting",
                    self.id,
                    relay,
                    extra={"relay": self.id, "peer": relay, STATE_CHANGE: True},
                )
            self.core.peer_lost(relay, now, mono)
            fed = True
        if fed and self._fed_tick_due == NO_FED_TICK:
            self._fed_tick_due = mono + FED_TICK_MS
        # The core is ticked by its deadline and within FED_TICK_MS of an input
        # (relay/core/shell.py), not after every input. The deadline is read again: an
        # input may have made a timer due (the heartbeat of a relay that was quiet).
        if mono != self._last_tick and (
            mono >= min(self._core_due, self._fed_tick_due) or mono >= self.core.next_deadline_ms()
        ):
            self._last_tick = mono
            self._fed_tick_due = NO_FED_TICK
            self.core.tick(now, mono)
        self._flush(socks)
        self.clients.expire(mono)
        self.clients.flush()
        if self._turn_wanted:
            _answer_all(self._turn_wanted, True)
        if self._status_wanted:
            self._answer_status_requests()
        if mono - self._last_state_log >= STATE_LOG_MS:
            self._last_state_log = mono
            self._count_client_connections()
            self._alone_in_loop = len(asyncio.all_tasks()) == 1
            self._watch_streams()
            self._announce(socks, mono)
            readmitted = self.core.counters.get("config_readmitted", 0)
            if readmitted != self._readmitted:
                self._readmitted = readmitted  # streams the relay was added to: subscribe
                self._subscribe_new(socks)
            self._unread.prune()
            if self._leaving:
                self._forget_peers(socks)
            if self.manage_gc:
                self._tend_gc(mono)
                self._trim_heap(mono)
            if self._spool is not None:
                self._spool.tick(mono)
            self._tend_metadata(mono)

    def _tend_metadata(self, mono: int) -> None:
        """Complete the metadata view: from a peer's copy, else from durable history."""
        meta = self.clients.meta
        if self._fold_wanted and not meta.complete and self._metasync.asked_every_peer:
            self._fold_wanted = False
            loop = asyncio.get_running_loop()
            self._durable_fold = loop.run_in_executor(None, self._fold_metadata_history)
        fold = self._durable_fold
        if fold is not None and fold.done():
            self._durable_fold = None
            self._metasync.durable = fold.result()  # errors were logged: None then
        self._metasync.tend(meta, self.core, mono)

    def _send_meta_sync(self, peer: int, frame: bytes) -> None:
        socks = self._sockets
        if socks is not None:
            self._publish(socks, Outgoing(frame, target=peer))
            self._send_held(socks)

    def _received(
        self,
        sock: zmq.Socket[Any],
        side: str,
        *,
        with_user: bool = False,
        with_fd: bool = False,
        most: int = DRAIN_MAX,
    ) -> Iterator[tuple[list[bytes], int]]:
        """The messages waiting on `sock` (which the last poll found readable), at most
        `most` per turn; counted as `<side>_frames`, a receive error as
        `<side>_recv_error` (and the drain ends). `with_user` (a CurveZMQ ROUTER): each
        message with the name of its client (the ZMTP User-Id its ZAP handshake gave it)
        put in front: [name, identity, ...]. With each message the descriptor of the
        connection it came on if `with_fd` (ZMQ_SRCFD), else -1.
        Each part is read as a Frame, whose `more` says whether another follows, and a
        poll of the socket alone says whether another message waits: pyzmq's
        recv_multipart asks RCVMORE through getsockopt, and a drain read until it raised
        Again, which together cost more than the reads (4.7 us per message and 8.8 us per
        drain, against 2.2 and 2.2)."""
        frames, errors = side + "_frames", side + "_recv_error"
        poll_self = [(sock, _POLLIN)]
        fd = -1
        for _ in range(most):
            parts = []
            try:
                part = sock.recv(_NOBLOCK, copy=False)
                if with_user:
                    parts.append(str(part.get("User-Id")).encode())
                if with_fd:
                    fd = int(part.get(zmq.SRCFD))
                parts.append(part.bytes)
                while part.more:
                    part = sock.recv(_NOBLOCK, copy=False)
                    parts.append(part.bytes)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                self.counters[errors] += 1
                self._warn(errors, "relay=%d %s receive failed: %s", self.id, side, e)
                return
            self.counters[frames] += 1
            yield parts, fd
            if not zmq.zmq_poll(poll_self, 0):
                return

    def _drain_peer(self, sub: zmq.Socket[Any], relay: int, now: int, mono: int) -> None:
        if relay in self._links_down:
            self._links_down.discard(relay)
            log.info(
                "relay=%d link from relay %d carries frames again",
                self.id,
                relay,
                extra={"relay": self.id, "peer": relay, STATE_CHANGE: True},
            )
        for parts, _ in self._received(sub, "peer"):
            if len(parts) != 1:
                self.counters["peer_bad_parts"] += 1
                self._warn(
                    "peer_bad_parts",
                    "relay=%d dropped a mesh message of %d parts",
                    self.id,
                    len(parts),
                )
                continue
            if (
                self._incompatible
                and relay in self._incompatible
                and not parts[0].startswith(peerprotocol.TOPIC)
            ):
                self.counters["peer_frames_other_protocol"] += 1
                continue
            frame = strip_topic(parts[0])
            if frame is None:
                # (not on the hot path: the rare announcement's topic is no frame topic)
                if parts[0].startswith(peerprotocol.TOPIC):
                    self._on_announcement(relay, parts[0][len(peerprotocol.TOPIC) :])
                    continue
                self.counters["peer_bad_topic"] += 1
                self._warn(
                    "peer_bad_topic", "relay=%d dropped a mesh message without topic", self.id
                )
                continue
            if codec.is_bundle(frame):
                try:
                    inner = codec.decode_bundle(frame, self.limits.max_frame_bytes)
                except FrameError as error:
                    self.counters["peer_bad_bundle"] += 1
                    self._warn("peer_bad_bundle", "relay=%d dropped a bundle: %s", self.id, error)
                    continue
                for one in inner:
                    self._take_peer_frame(one, relay, now, mono)
            else:
                self._take_peer_frame(frame, relay, now, mono)

    def _on_announcement(self, relay: int, frame: bytes) -> None:
        """A peer's protocol announcement (relay/peerprotocol.py): kept for the status; a
        peer with no protocol in common is named once, and its other frames dropped
        until it announces one this relay speaks."""
        try:
            heard = peerprotocol.parse(frame)
        except ValueError as e:
            self.counters["peer_bad_announcement"] += 1
            self._warn("peer_bad_announcement", "relay=%d bad announcement: %s", self.id, e)
            return
        if heard.relay != relay:
            self.counters["peer_sender_mismatch"] += 1
            return
        self._peer_protocols[relay] = heard
        fits = heard.compatible()
        if not fits and relay not in self._incompatible:
            self._incompatible.add(relay)
            self.counters["peer_protocol_mismatch"] += 1
            log.error(
                "relay=%d %s",
                self.id,
                peerprotocol.mismatch_words(heard),
                extra={"relay": self.id, "peer": relay, STATE_CHANGE: True},
            )
        elif fits and relay in self._incompatible:
            self._incompatible.discard(relay)
            log.warning(
                "relay=%d relay %d speaks peer protocol %d now: its frames are taken again",
                self.id,
                relay,
                heard.protocol,
                extra={"relay": self.id, "peer": relay, STATE_CHANGE: True},
            )
        self._compare_limits(heard)

    def _compare_limits(self, heard: peerprotocol.Announcement) -> None:
        """Name, once per difference, a peer holding limits every relay must hold alike at
        other values than this relay (after a reload here, the next announcement shows)."""
        relay = heard.relay
        words = peerprotocol.limits_words(heard, self.limits)
        if words == self._limits_differ.get(relay, ""):
            return
        if words:
            self._limits_differ[relay] = words
            self.counters["peer_limits_mismatch"] += 1
            log.error(
                "relay=%d %s",
                self.id,
                words,
                extra={"relay": self.id, "peer": relay, STATE_CHANGE: True},
            )
        else:
            del self._limits_differ[relay]
            log.warning(
                "relay=%d relay %d holds this relay's mesh limits now",
                self.id,
                relay,
                extra={"relay": self.id, "peer": relay, STATE_CHANGE: True},
            )

    def _announce(self, socks: _Sockets, mono: int) -> None:
        """Every ANNOUNCE_MS, the protocol this relay speaks, to every peer."""
        if mono - self._announced_ms < peerprotocol.ANNOUNCE_MS:
            return
        self._announced_ms = mono
        try:
            frame = peerprotocol.announcement(self.id, self.limits)
            socks.pub.send(peerprotocol.TOPIC + frame, _NOBLOCK)
        except zmq.ZMQError as e:
            self.counters["publish_dropped"] += 1
            self._warn("publish_dropped", "relay=%d publish failed: %s", self.id, e)

    def _peer_protocol_status(self) -> dict[str, object]:
        return {
            str(relay): {
                "protocol": heard.protocol,
                "speaks": list(heard.speaks),
                "release": heard.release,
                "problem": "" if heard.compatible() else peerprotocol.mismatch_words(heard),
                "limits_problem": self._limits_differ.get(relay, ""),
            }
            for relay, heard in sorted(self._peer_protocols.items())
        }

    def _take_peer_frame(self, frame: bytes, relay: int, now: int, mono: int) -> None:
        if self._trace is not None:
            self._trace.record(PEER_IN, relay, frame)
        if frame.startswith(META_SYNC_MARK):  # the node's, not the core's (metasync.py)
            self._metasync.on_frame(frame, relay, self.clients.meta, self.core, mono)
            return
        try:
            self.core.receive(frame, now, mono, relay)
        except Exception:  # the core promises not to raise; never let a frame kill us
            self.counters["peer_frame_core_error"] += 1
            log.exception("relay=%d core failed on a peer frame (dropped)", self.id)

    def _drain_clients(self, socks: _Sockets, readable: bool, now: int, mono: int) -> None:
        """Read what clients sent into the intake (`readable`: the ROUTER has some), then
        serve the intake's clients in turn until the requests served brought
        PIPELINE_BATCH_ITEMS produces (a frame is taken whole), DRAIN_MAX were served, or
        SERVE_BUDGET_NS passed (requests that cost much, a StreamsReq over thousands of
        streams, do not hold the others' answers for long): the rest waits for the next
        turn, after this turn's output went out."""
        if readable:
            self._read_clients(socks.router, mono)
        intake = self._intake
        closed = self._closed_connections
        named = self._identity is not None
        budget_end = self.clients.produces_taken + PIPELINE_BATCH_ITEMS
        deadline_ns = time.monotonic_ns() + SERVE_BUDGET_NS
        for served in range(DRAIN_MAX):
            if served % SERVE_CLOCK_EVERY == 0 and time.monotonic_ns() >= deadline_ns:
                return
            taken = intake.take()
            if taken is None:
                return
            parts = taken[1][0]
            if parts[1 if named else 0] in closed:  # its answer could not go anywhere
                self.counters["client_requests_of_closed_connections"] += 1
                continue
            try:
                self._on_client(parts, now, mono)
            except Exception:
                self.counters["client_frame_node_error"] += 1
                log.exception("relay=%d failed on a client frame (dropped)", self.id)
            if self.clients.produces_taken >= budget_end:
                return

    def _read_clients(self, router: zmq.Socket[Any], mono: int) -> None:
        """Requests from the ROUTER into the intake, while it has room, at most
        INTAKE_READ_MAX a turn. A request of a connection known closed is dropped (it
        could only be answered to nobody); a client that has more queued than
        limits.max_queued_requests_per_client is flooding, and is cut off (`_cut`)."""
        intake = self._intake
        closed = self._closed_connections
        held = self._held_clients
        named = self._identity is not None
        most = min(INTAKE_READ_MAX, INTAKE_MAX - len(intake))
        for parts, fd in self._received(
            router, "client", with_user=named, with_fd=True, most=max(most, 0)
        ):
            identity = parts[1] if named else parts[0]  # a ROUTER puts it first
            if identity in closed:
                self.counters["client_requests_of_closed_connections"] += 1
                continue
            client = parts[0] if named else identity
            if named:
                self._unread.note_owner(identity, client)
                if client in held:
                    if mono < held[client]:
                        self._cut(client, [(parts, fd)], mono, again=True)
                        continue
                    del held[client]
            if not intake.add(client, (parts, fd)):
                self._cut(client, intake.drop(client), mono)

    def _cut(self, client: bytes, queued: list[_Queued], mono: int, *, again: bool = False) -> None:
        """Cut the connections `queued` came on (their client flooded the relay, or
        `again` sent on while held after that), drop what they queued, and name the
        client in the log. With CurveZMQ the client's name is held for FLOOD_HOLD_MS."""
        named = self._identity is not None
        addresses = sorted(shut_connection(fd) for fd in {fd for _, fd in queued if fd >= 0})
        for identity in {parts[1] if named else parts[0] for parts, _ in queued}:
            self._mark_closed(identity)
        self.counters["client_requests_dropped_flooding"] += len(queued)
        who = f"client {client.decode(errors='replace')!r}" if named else "a client connection"
        at = ", ".join(addresses) or "an address libzmq does not give"
        if again:
            self.counters["client_cut_held"] += 1
            self._warn(
                "client_cut_held",
                "relay=%d cut a connection of %s from %s: it flooded the relay less than %d ms ago",
                self.id,
                who,
                at,
                FLOOD_HOLD_MS,
            )
            return
        if named:
            self._held_clients[client] = mono + FLOOD_HOLD_MS
        self.counters["client_cut_flooding"] += 1
        self._warn(
            "client_cut_flooding",
            "relay=%d cut %s from %s: it had more than %d requests queued and not served "
            "(limits.max_queued_requests_per_client); %d dropped",
            self.id,
            who,
            at,
            self.limits.max_queued_requests_per_client,
            len(queued),
        )

    # --- clients --------------------------------------------------------------------------

    def _on_client(self, parts: list[bytes], now: int, mono: int) -> None:
        client: str | None = None
        if self._identity is not None:  # [client name, identity, ...] (see above)
            client = parts[0].decode()
            parts = parts[1:]
        if len(parts) == 2:  # DEALER: [identity, frame]
            envelope, frame = parts[:1], parts[1]
        elif len(parts) == 3 and parts[1] == b"":  # REQ: [identity, b"", frame]
            envelope, frame = parts[:2], parts[2]
        else:
            self.counters["client_frame_invalid"] += 1
            self.counters["client_bad_envelope"] += 1
            bad = MalformedFrame(f"expected one frame per message, got {len(parts) - 1}")
            self.clients.refuse(parts[:1], -1, bad)
            return
        if self._trace is not None:
            self._trace.record(CLIENT_IN, -1, frame)
        self.clients.on_request(envelope, frame, now, mono, client)

    def _send_client(self, envelope: list[bytes], frame: bytes) -> bool:
        socks = self._sockets
        if socks is None:
            return False
        if self._trace is not None:  # stamped before: the client may have it before send returns
            self._trace.record(CLIENT_OUT, -1, frame)
        try:
            router = socks.router
            for part in envelope:
                router.send(part, _SNDMORE_NOBLOCK)
            client = envelope[0]
            if self._unread.wants_probe(client):
                # A Frame of its own: Socket.send copies an answer under pyzmq's
                # copy_threshold (64 KiB) whatever it is told, and its tracker is then
                # done at once, while the copy may still be queued.
                probe = zmq.Frame(frame, track=True, copy=False)
                router.send(probe, _NOBLOCK, copy=False)
                assert probe.tracker is not None
                self._unread.add(client, len(frame), probe.tracker)
            else:
                router.send(frame, _NOBLOCK)
                self._unread.add(client, len(frame), None)
        except zmq.ZMQError as e:  # gone (EHOSTUNREACH) or not reading (EAGAIN)
            log.debug("relay=%d reply dropped: %s", self.id, e)
            if e.errno == zmq.EHOSTUNREACH:  # what it still has queued goes nowhere
                self._mark_closed(envelope[0])
            return False
        return True

    def _mark_closed(self, identity: bytes) -> None:
        """Connection `identity` is gone: its requests still queued are dropped unserved
        (at most CLOSED_CONNECTIONS_MAX remembered, the oldest forgotten first)."""
        closed = self._closed_connections
        closed[identity] = None
        closed.move_to_end(identity)
        if len(closed) > CLOSED_CONNECTIONS_MAX:
            closed.popitem(last=False)

    def _unread_bytes(self, client: bytes) -> int:
        return self._unread.of(client)

    # --- acceptor memory (docs/protocol.md 5.12) ------------------------------------------

    def _open_acceptor_memory(self) -> AcceptorFiles | None:
        """Give the core what earlier incarnations kept. Without a usable directory the
        relay runs without acceptor memory: after a restart it then abstains from each
        stream's next view change, as the protocol requires of a relay that forgot."""
        try:
            files = AcceptorFiles.of_relay(self.config.data_dir, self.id)
            records = files.load()
        except OSError as e:
            log.error("relay=%d runs without acceptor memory: %s", self.id, e)
            return None
        forgotten = self.core.remember_acceptors(records)
        if forgotten:
            log.error(
                "relay=%d unreadable acceptor records in %s for %s: abstaining from their "
                "next view change",
                self.id,
                files.directory,
                ", ".join(sorted(forgotten)),
            )
        return files

    def _persist_acceptors(self, records: list[tuple[str, bytes]]) -> None:
        assert self._acceptors is not None  # the core asks only once it was given memory
        try:
            self._acceptors.save_all(records)
        except OSError as e:
            self.counters["acceptor_save_failed"] += 1
            streams = ", ".join(repr(stream) for stream, _ in records[:3])
            more = f" and {len(records) - 3} more" if len(records) > 3 else ""
            raise AcceptorMemoryError(
                f"relay {self.id}: cannot keep the acceptor records of stream {streams}{more} "
                f"in {self._acceptors.path}: {e}"
            ) from e

    # --- core output ------------------------------------------------------------------------

    def _flush(self, socks: _Sockets) -> None:
        ready = drain(self.core, _Outlet(self, socks))
        self._send_held(socks)
        if self._spool is not None and (ready.deliveries or ready.rebases):
            due = {d.stream for d in ready.deliveries}
            self._feed_spool(due.union(stream for stream, _ in ready.rebases))

    def _on_rebase(self, stream: str, point: int) -> None:
        self.counters["rebases"] += 1
        # A base taken while joining is routine; one taken after delivering means the
        # consumers of this relay skip a range (they get out_of_range across it).
        # Looked at before this turn's deliveries, which follow the base.
        after_delivery = stream in self._delivered
        log.log(
            logging.WARNING if after_delivery else logging.INFO,
            "relay=%d stream=%s %s: delivered history now starts after seq %d",
            self.id,
            stream,
            "rebased" if after_delivery else "took its base",
            point,
            extra={"relay": self.id, "stream": stream, "seq": point, STATE_CHANGE: True},
        )
        self.clients.wake(stream)

    def _on_closed(self, stream: str) -> None:
        """The core closed a blank idle stream (docs/protocol.md 5.11): forget it here."""
        self.clients.closed(stream)
        self._views.pop(stream, None)
        self._delivered.discard(stream)
        self._topics.pop(stream, None)

    def _on_delivery(self, delivery: Delivery) -> None:
        if delivery.entries:
            if len(self._delivered) < self.limits.max_streams:
                self._delivered.add(delivery.stream)
            self.counters["delivered_entries"] += len(delivery.entries)
            self._committed_records[delivery.stream] += len(delivery.entries)
            log.debug(
                "relay=%d stream=%s delivered seq %d..%d (%d entries)",
                self.id,
                delivery.stream,
                delivery.entries[0][0],
                delivery.entries[-1][0],
                len(delivery.entries),
            )
        self.clients.wake(delivery.stream)

    def _publish(self, socks: _Sockets, out: Outgoing) -> None:
        """Hold `out` for its topic: consecutive frames of a turn for one topic go as one
        bundle (docs/protocol.md section 3; `_send_held` sends them)."""
        if out.stream is not None:
            topic = self._topics.get(out.stream)
            if topic is None:
                topic = stream_topic(out.stream)
                if len(self._topics) < 2 * self.limits.max_streams:
                    self._topics[out.stream] = topic
        elif out.target is not None:
            topic = direct_topic(out.target)
        else:
            topic = HEARTBEAT_TOPIC
        if self._trace is not None:  # stamped before: a peer may take it before send returns
            self._trace.record(PEER_OUT, -1, out.frame)
        held = self._held
        size = len(out.frame) + codec.BUNDLE_ITEM_OVERHEAD_BYTES
        if (
            held
            and topic == self._held_topic
            and len(held) < codec.BUNDLE_MAX_FRAMES
            and self._held_bytes + size <= self._bundle_max_bytes
        ):
            held.append(out.frame)
            self._held_bytes += size
            return
        self._send_held(socks)
        self._held_topic = topic
        self._held.append(out.frame)
        self._held_bytes = codec.BUNDLE_OVERHEAD_BYTES + size

    def _send_held(self, socks: _Sockets) -> None:
        """Publish the frames `_publish` holds: one alone as it is, several as a bundle."""
        held = self._held
        if not held:
            return
        if len(held) == 1:
            frame = held[0]
        else:
            frame = codec.encode_bundle(held)
            self.counters["peer_bundles_sent"] += 1
        held.clear()
        try:
            socks.pub.send(self._held_topic + frame, _NOBLOCK)
        except zmq.ZMQError as e:
            self.counters["publish_dropped"] += 1
            self._warn("publish_dropped", "relay=%d publish failed: %s", self.id, e)

    def _watch_streams(self) -> None:
        """Log joined/fenced transitions and configuration news (5.15); answer parked reads
        of a stream that fenced, or that this relay left."""
        if len(self.core.foreign) > len(self._left):
            self._watch_left()
        # Beyond STREAM_LINES_PER_WATCH lines, transitions are told by kind in one line
        # each: a fence of thousands of streams (a client opened them) is a few lines.
        lines = 0
        untold: dict[str, list[str]] = {}
        for stream in self.core.stream_names():
            view = self._views.get(stream)
            if view is None:
                if len(self._views) >= self.limits.max_streams:
                    continue
                view = self._views[stream] = _StreamView()
            self._watch_configuration(stream, view)
            joined, fenced = self.core.joined(stream), self.core.fenced(stream)
            if joined != view.joined:
                view.joined = joined
                committed = self.core.committed_point(stream)
                lines += 1
                if lines > STREAM_LINES_PER_WATCH:
                    untold.setdefault("joined" if joined else "rejoining", []).append(stream)
                else:
                    log.info(
                        "relay=%d stream=%s %s (committed seq %d)",
                        self.id,
                        stream,
                        "joined" if joined else "rejoining",
                        committed,
                        extra={
                            "relay": self.id,
                            "stream": stream,
                            "committed": committed,
                            STATE_CHANGE: True,
                        },
                    )
            why, waiting = self.core.stall(stream) if fenced else ("", ())
            if fenced != view.fenced or why != view.fence_reason:
                view.fenced, view.fence_reason = fenced, why
                if fenced:
                    self.clients.wake(stream)
                lines += 1
                if lines > STREAM_LINES_PER_WATCH:
                    untold.setdefault(f"fenced: {why}" if fenced else "unfenced", []).append(stream)
                else:
                    log.log(
                        logging.WARNING if fenced and joined else logging.INFO,
                        "relay=%d stream=%s %s",
                        self.id,
                        stream,
                        f"fenced: {why}, waiting for relays {list(waiting)}"
                        if fenced
                        else "unfenced",
                        extra={
                            "relay": self.id,
                            "stream": stream,
                            "fenced": fenced,
                            "why": why,
                            STATE_CHANGE: True,
                        },
                    )
        for change, streams in untold.items():
            log.warning(
                "relay=%d %d more streams %s (%s%s)",
                self.id,
                len(streams),
                change,
                ", ".join(streams[:STREAM_NAMES_PER_LINE]),
                ", ..." if len(streams) > STREAM_NAMES_PER_LINE else "",
                extra={"relay": self.id, "streams": len(streams), STATE_CHANGE: True},
            )

    def _watch_configuration(self, stream: str, view: _StreamView) -> None:
        """Log a stream's configuration news (5.15), each once, when it comes (a line held
        back by the rate bound is written at a later look, with the state then): peers
        that state another configuration, or no longer do; a topology that names other
        relays than the configuration the stream runs under; the history lost. (Looked at
        every STATE_LOG_MS for every stream: the words are made only for news.)"""
        st = self.core.streams.get(stream)
        if st is None:
            return
        if st.disagree != view.disagree:
            config = configuration_status(st.configuration, st.desired, st.disagree)
            if st.disagree:
                stands = {"fence_reason": self.core.fence_reason(stream)}
                said = self._note(
                    "config", logging.WARNING, stream, disagreement_words(config, stands), config
                )
            else:
                words = "no peer states another configuration any more: it runs on "
                words += configuration_words(*st.configuration)
                said = self._note("config", logging.INFO, stream, words, config)
            if said:
                view.disagree = dict(st.disagree)
        if st.members != st.desired:
            # Said again when the relays whose files hold the change change (5.15 changes).
            held = self.core.change_held_by(stream)
            differs = (st.members, st.desired, tuple(sorted(held.items())))
            if differs != view.differs:
                config = configuration_status(st.configuration, st.desired, st.disagree, held)
                words = topology_words(config)
                if self._note("topology", logging.WARNING, stream, words, config):
                    view.differs = differs
        if st.history_lost_below >= 0 and not view.history_lost:
            config = configuration_status(st.configuration, st.desired, st.disagree)
            if self._note("history", logging.ERROR, stream, history_lost_words(), config):
                view.history_lost = True

    def _watch_left(self) -> None:
        """Log each stream this relay left because its configuration leaves it out (5.15),
        and answer its parked reads (they are redirected now)."""
        for stream, configuration in sorted(self.core.foreign.items()):
            if stream in self._left:
                continue
            config = configuration_status(configuration, self.config.members(stream), {})
            if self._note("left", logging.WARNING, stream, not_member_words(config), config):
                self._left.add(stream)
                self._views.pop(stream, None)
                self.clients.wake(stream)

    def _log_recorded_streams(self) -> None:
        """Name, once at the start, each stream this relay serves by its acceptor record
        and not by its topology (5.15): it runs under the recorded configuration."""
        for stream in self._recorded_streams:
            recorded = self.core.recorded.get(stream)
            if recorded is None or len(self._views) >= self.limits.max_streams:
                continue  # opened already: `_watch_configuration` says it
            topology = self.config.members(stream)
            config = configuration_status(recorded, topology, {})
            if self._note("topology", logging.WARNING, stream, topology_words(config), config):
                # Said: not again when the stream opens under it.
                self._views[stream] = _StreamView(differs=(recorded[1], topology, ()))

    def _note(self, kind: str, level: int, stream: str, words: str, config: dict[str, Any]) -> bool:
        """Log news of a stream's configuration (its `config` as the status gives it, a
        field of the JSON line) as a state change, at most once per BAD_FRAME_LOG_MS per
        kind and stream; False if it was held back."""
        if not self._may_log(f"{kind} {stream}"):
            return False
        extra = {"relay": self.id, "stream": stream, "config": config, STATE_CHANGE: True}
        log.log(level, "relay=%d stream=%s %s", self.id, stream, words, extra=extra)
        return True

    def _trim_heap(self, mono: int) -> None:
        """Every MALLOC_TRIM_MS, have glibc give the free pages of its heap back.

        A relay's largest objects are its buffers' lists and dictionary tables, MiBs each,
        reallocated as buffers fill and turn over. glibc serves them from its heap once it
        has raised its mmap threshold (it does so at the first such block freed), and a
        heap keeps what is freed in it: RSS crept up for minutes after the buffers were
        full (`relay bench --memory`). malloc_trim releases those pages (a few ms for
        hundreds of MiB). A fixed low mmap threshold did it too, but made every large frame
        an mmap and a page-faulting munmap: a quarter of the throughput at window 1,000."""
        if mono - self._trimmed_ms < MALLOC_TRIM_MS or self._malloc_trim is None:
            return
        self._trimmed_ms = mono
        self._malloc_trim(0)

    def _tend_gc(self, mono: int) -> None:
        """Keep what survived so far out of the cyclic collector's full collections.

        A relay keeps up to buffer_max_entries transactions (and their dedupe keys) alive;
        a full collection walks every one of them (about 60 ms per 300,000 here) and finds
        nothing: what the relay keeps forms no cycles, so reference counting frees it on
        eviction. Freezing every STATE_LOG_MS leaves full collections only what came since;
        every GC_FULL_COLLECT_MS everything is thawed and collected once, so that a cycle
        that did form is still freed."""
        if mono - self._gc_full_at >= GC_FULL_COLLECT_MS:
            self._gc_full_at = mono
            gc.unfreeze()
            gc.collect()
        gc.freeze()

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """Log a warning about something dropped, at most once per kind per second. The
        count is the counter `kind` (the status; a JSON line's fields), not in the text:
        identical lines are what the log's repeat filter counts (relay/logs.py)."""
        if self._may_log(kind):
            fields = {"relay": self.id, "counter": kind, "count": self.counters[kind]}
            log.warning(message, *args, extra=fields)

    def _may_log(self, key: str) -> bool:
        """Whether a line of `key` may be written now: at most one per BAD_FRAME_LOG_MS."""
        now = mono_ms()
        if now - self._bad_logged.get(key, -BAD_FRAME_LOG_MS) < BAD_FRAME_LOG_MS:
            return False
        self._bad_logged[key] = now
        return True


class _Outlet:
    """Where the core's `Ready` goes (relay/core/shell.py): frames onto the PUB socket
    (topics route them), answers to clients, rebases and deliveries to parked reads."""

    __slots__ = ("node", "socks")

    def __init__(self, node: RelayNode, socks: _Sockets) -> None:
        self.node = node
        self.socks = socks

    def persist(self, records: list[tuple[str, bytes]]) -> None:
        self.node._persist_acceptors(records)

    def publish(self, out: Outgoing) -> None:
        self.node._publish(self.socks, out)

    # Frames go out before what follows them in `Ready` (its order is the contract).

    def answer(self, replies: list[ProduceReply]) -> None:
        self.node._send_held(self.socks)
        self.node.clients.on_replies(replies)

    def rebase(self, stream: str, point: int) -> None:
        self.node._send_held(self.socks)
        self.node._on_rebase(stream, point)

    def deliver(self, delivery: Delivery) -> None:
        self.node._send_held(self.socks)
        self.node._on_delivery(delivery)

    def closed(self, stream: str) -> None:
        self.node._on_closed(stream)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _spool_figures(spool: Spool) -> str:
    status = spool.status()
    return (
        f"{status.disk_used_bytes} bytes on disk, {status.pending_bytes} waiting, "
        f"disk_max_bytes={spool.disk_max_bytes}"
    )


def _spool_record(record: CommittedRecord) -> SpoolRecord:
    seq, digest, tx, duplicate = record
    return (seq, digest, tx.producer_id, tx.producer_seq, tx.key, tx.value, tx.kind, duplicate)
