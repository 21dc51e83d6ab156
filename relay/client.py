"""The client library: producers and consumers of the relay mesh (relay.wire over ZeroMQ).

    with Producer(topology="config/topology.yaml") as producer:
        seq = producer.send("orders", b"payload", key=b"customer-7")
        seqs = producer.send_many("orders", [b"a", b"b", (b"key", b"c")])

    with Consumer(topology="config/topology.yaml").subscribe("orders", "earliest") as c:
        for record in c:
            print(record.seq, record.value)

`AsyncProducer` and `AsyncConsumer` are the asyncio (zmq.asyncio) flavours; they run on
asyncio's loop and on uvloop's (`uvloop.run(main())`), which costs them about a fifth
less CPU per transaction here (relay/loop.py has the figures).

Relays are given either as `relays=[endpoint, ...]` (or `{relay_id: endpoint}` so that
redirects naming relay ids can be followed) or as `topology=path | MeshConfig`: then every
relay's `client_endpoint` is used, the members of a stream are tried first, redirects are
mapped to endpoints, and the topology's limits bound frames.

Producing (docs/protocol.md G3): every transaction carries the producer's id and the next
producer sequence number. On `unknown`, `fenced`, `rejected` as `late` (that copy was left
out), as `store_backlog_full` (back-pressure: fewer than a quorum of the stream's relays
can spool more, docs/protocol.md 5.14) or as `buffer_full` (back-pressure: the relay's
buffer or pending produces are full, 5.10), a timeout, a lost connection (also one
whose relay stopped answering ZMTP heartbeats for CLIENT_HEARTBEAT_TIMEOUT_MS, e.g. a
stopped process) or a relay that is not connected, the SAME producer sequence is retried
on another relay (the relays
a `fenced` answer lists first; once every relay was tried, after a pause of 50 ms
doubling up to 1 s, relay.engines BACKOFF_*), up to `max_attempts` attempts within
`send_timeout_s`; retries never create a duplicate. Any other `rejected` answer is final
(`Rejected`, or `UnknownStream` when no relay serves the stream), except that once an
earlier attempt of the same producer sequence ended without a definite answer, the final
error is `Unknown`: that earlier copy may still commit. Running out of attempts raises
`Unknown` (some attempt may have reached a relay), `Fenced` (the last answer was
`fenced`), `StoreBacklogFull` (the last answer was `store_backlog_full`: retriable, the
room comes back as the store ingests), `BufferFull` (the last answer was `buffer_full`:
retriable, room comes back as the relays drain) or `Rejected` (the last answer was
`late`).
With `window` > 1,
messages sent together are in flight at once, so their commit order may differ from the
order they were given in. Attempts bound for the same relay at the same moment travel
together in ProduceBatchReq frames of at most wire.PIPELINE_BATCH_ITEMS (and within the
topology's max_batch_entries and request frame limit, or the default limits without a
topology), so that a large window travels through the mesh in parts; each keeps its own
request id, answer, retries and error. Should a relay refuse a whole batch (ErrorResp: it
changed nothing), its transactions are sent again one per frame.

Consuming: `subscribe(stream, start)` with start "earliest" (the whole history: the
store's records, then the relays'; a relay whose history starts after a base, e.g. one
restarted empty, hands over to the store or another relay; when none holds the beginning,
reading starts at the oldest history held and `history_gone_before` says up to where it
is gone), a moment (a timezone-aware datetime),
"latest" (the relay's committed point, learnt by the first read, i.e. at the first
`next()`), a position: a seq, meaning "the records after it" (resume with the last seq
processed, `Consumer.position`), or "snapshot" (the stream's latest stored snapshot, loaded
at subscribe as `Consumer.snapshot`, then the records after it; "earliest" when there is no
snapshot yet). A consumer reads one stream with long polls (`ReadReq` with `wait_ms`) of at
most `max_batch` entries, and asks for the next batch only after the previous one was
consumed, so a slow consumer costs a relay nothing. It resumes after the last sequence
number it yielded (never yielding a seq at or below it) on another relay when its relay
redirects, is fenced, is not ready, does not answer or goes away.

A pattern (`subscribe("orders.*")`, fnmatch) reads every stream it names, each by the rules
above with its own position (`positions`): the relays are asked which of their streams
match (StreamsReq, every `pattern_refresh_s`, so streams that appear later are read too,
from their beginning), and the next record yielded is the oldest one buffered of any of
them; all share one connection per relay.

The store (docs/store.md 5; `store=` a path or URI, or by default the topology's store
location once a store was ingested there; `store=False` never) holds every stream's history from its
genesis up to its last ingested point, so it covers what the relays' bounded buffers no
longer hold. Whenever the relays cannot serve the consumer's position (they answer
`out_of_range`, also mid-stream after a slow consumer fell behind, or, from the beginning,
their history starts after a base rather than at the genesis), the consumer refreshes the
store's manifest and, if the store goes past the position, yields the stored records after
it (`max_batch` at a time, continuing one reader, again only once consumed), then goes back
to the relays after the store's last point: no gap and no duplicate, and `position` stays
valid throughout (`Consumer.source` says which of the two is being read). `OutOfRange` is
raised only when neither the store nor any relay that answered can serve the position; it
says where the store ends and names the oldest position that can still be read
(`Consumer.oldest_available`; subscribe with `start=` that value to resume there).
Reading the store needs pyarrow (the `store` extra), imported only when a store is used.

Security (docs/security.md): with a topology whose `security.curve` is on, every
connection is CurveZMQ. The client's key pair is `key_file=`, else $RELAY_KEY_FILE, else the
topology's `security.client_key_file`; its name is the one the topology's `access:` section
gives that key (with `relays=`, pass `curve=relay.security.client_curve(config, key_file)`).
A producer's default id is then `<name>/` and 16 random bytes (relays accept from a client
only producer ids that start with its name). What the client's rights do not allow raises
`NotAuthorized` (final), naming the right and the stream.

Neither flavour is thread-safe: use one client per thread (or per event loop).

These rules are carried out by the engines of relay/engines.py, which do no I/O; this
module drives them with ZeroMQ sockets, and the simulator drives the same engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import random
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeAlias, TypeVar, overload

import zmq
import zmq.asyncio

from relay import wire
from relay.access import producer_id_prefix
from relay.core.config import Limits
from relay.core.fields import MAX_PRODUCER_ID_BYTES, MAX_TX_KIND, MAX_U63, MAX_U64
from relay.engines import (
    Op,
    ProduceEngine,
    ReadEngine,
    Record,
    Relays,
    Source,
    Start,
    StoreBatch,
    StoreRead,
    StreamWatch,
    check_produce_target,
    check_stream,
    decode_answer,
    position_at,
)
from relay.errors import (
    BadVersion,
    Busy,
    ClientError,
    FrameError,
    LeaseLost,
    MetadataUnavailable,
    NotAuthorized,
    Rejected,
    Unknown,
)
from relay.meta import (
    ABSENT,
    ANY_VERSION,
    KIND_META,
    METADATA_STREAM,
    OP_DELETE,
    OP_READ,
    OP_WRITE,
    READ_BARRIER_KEY,
    Mark,
    MetaOp,
    Versioned,
    check_durable_name,
    check_key,
    decode_mark,
    encode_mark,
    encode_op,
    mark_key,
)
from relay.security import ClientCurve, client_curve
from relay.seqtext import parse_seq
from relay.sockets import DisconnectMonitor, ReadableWaiter, allow_ipv6
from relay.store import STREAMS_DIR
from relay.store.changes import KIND_CHANGES, KIND_PLAIN, Change, encode_changes
from relay.store.errors import UnknownStoredStream
from relay.store.location import StoreLocation, as_location
from relay.topology import MeshConfig, is_pattern, load
from relay.wire import MAX_READ_ENTRIES, MAX_WAIT_MS

if TYPE_CHECKING:  # pyarrow (the store extra) is imported only when a store is used
    from relay.store.reader import StoredRecord, StoredSnapshot, StoreReader

__all__ = [
    "DEFAULT_CONNECT_GRACE_S",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "DEFAULT_SEND_TIMEOUT_S",
    "DEFAULT_WAIT_MS",
    "DEFAULT_WINDOW",
    "MAX_WINDOW",
    "AsyncConsumer",
    "AsyncProducer",
    "Consumer",
    "Metadata",
    "Producer",
    "Record",
    "RelayEndpoints",
    "Source",
    "Start",
    "StoreSource",
    "TopologySource",
    "ingested_store",
]

# --- named limits ------------------------------------------------------------------------

DEFAULT_WINDOW = 64  # produce requests in flight at once per producer
MAX_WINDOW = 4_096
SEND_HWM = 2 * MAX_WINDOW  # frames queued per relay connection (more: the send fails)
DEFAULT_SEND_TIMEOUT_S = 30.0  # total time one send may take, all attempts included
DEFAULT_MAX_ATTEMPTS = 30  # attempts (relays asked) per send
DEFAULT_REQUEST_TIMEOUT_S = 5.0  # one attempt without an answer (a relay answers within
#                                   produce_timeout_ms, 2 s by default, with `unknown`)
DEFAULT_CONNECT_GRACE_S = 0.25  # how long a new client waits for its first connections
DEFAULT_MAX_BATCH = 1_000  # entries a consumer asks for at once
# How often a consumer of a pattern asks the relays for streams that appeared since (a
# relay's pattern opens a stream on its first produce); each round is one small request
# per relay.
DEFAULT_PATTERN_REFRESH_S = 5.0
MIN_PATTERN_REFRESH_S = 0.01
DEFAULT_WAIT_MS = 1_000  # a consumer's long poll
DRAIN_MAX = 10_000  # frames taken from one socket per wake
DEFAULT_LEASE_TTL_S = 5.0  # a holder that stops renewing is replaced this long after
MIN_LEASE_TTL_S = 0.1
# A contender waits this much beyond a lease's TTL before taking it over: room for the two
# processes' clocks running at slightly different rates.
LEASE_MARGIN_S = 0.25
LEASE_RENEW_FRACTION = 3  # a holder renews after a third of its TTL
LEASE_POLL_S = 0.5  # how often a waiting contender looks at the lease at most
# ZMTP heartbeats on every relay connection: a relay whose process stopped (SIGSTOP, a
# frozen VM) keeps its TCP connection open, so without them an attempt waits out
# request_timeout_s. libzmq's I/O thread answers PINGs whatever the relay's own thread
# is doing, so a busy relay is never taken for a stopped one; a connection silent for
# the timeout is closed, and its requests are retried on another relay at once.
CLIENT_HEARTBEAT_IVL_MS = 200
CLIENT_HEARTBEAT_TIMEOUT_MS = 1_000
# pyzmq's flags are enum members: plain ints skip an enum operation per call.
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)


RelayEndpoints: TypeAlias = Sequence[str] | Mapping[int, str]
TopologySource: TypeAlias = str | Path | MeshConfig
StoreSource: TypeAlias = str | os.PathLike[str] | StoreLocation | Literal[False] | None
KeyFile: TypeAlias = str | os.PathLike[str] | None
# Where a subscription starts: for one stream, or for each stream of a pattern (a mapping:
# per stream, None meaning "latest", as in Consumer.positions; the others from their
# beginning).
PatternStart: TypeAlias = Start | datetime | Mapping[str, Start | datetime | None]
PRODUCER_ID_RANDOM_BYTES = 16  # after the client's name and "/" (with CurveZMQ)
Item: TypeAlias = bytes | tuple[bytes | None, bytes]


# --- checks ------------------------------------------------------------------------------


def _check_tx(key: object, value: object) -> tuple[bytes | None, bytes]:
    if not isinstance(value, bytes):
        raise TypeError(f"value must be bytes, got {type(value).__name__}")
    if key is not None and not isinstance(key, bytes):
        raise TypeError(f"key must be bytes or None, got {type(key).__name__}")
    return key, value


def _check_kind(kind: object) -> int:
    if type(kind) is not int or not 0 <= kind <= MAX_TX_KIND:
        raise ValueError(f"kind must be an int 0..{MAX_TX_KIND}, got {kind!r}")
    return kind


def _split(item: object) -> tuple[bytes | None, bytes]:
    if isinstance(item, tuple):
        if len(item) != 2:
            raise TypeError("an item is a value (bytes) or a (key, value) pair")
        return _check_tx(item[0], item[1])
    return _check_tx(None, item)


def _relays(
    relays: RelayEndpoints | None, topology: TopologySource | None
) -> tuple[Relays, MeshConfig | None]:
    """The relays a client talks to, from `relays=` or `topology=` (exactly one)."""
    if (relays is None) == (topology is None):
        raise ValueError("give exactly one of relays=[endpoints] or topology=path|MeshConfig")
    # Each client starts at another member of a stream, so clients spread over them.
    spin = random.Random(os.urandom(8)).randrange(1 << 16)
    if topology is not None:
        config = topology if isinstance(topology, MeshConfig) else load(topology)
        ids = {rid: spec.client_endpoint for rid, spec in config.relays.items()}
        found = Relays(
            list(ids.values()), ids, limits=config.limits, members=config.members, spin=spin
        )
        return found, config
    by_id: dict[int, str] = {}
    if isinstance(relays, Mapping):
        for rid, endpoint in relays.items():
            if isinstance(rid, bool) or not isinstance(rid, int):
                raise TypeError(f"relay ids must be ints, got {rid!r}")
            if not isinstance(endpoint, str):
                raise TypeError(f"endpoints must be strings, got {endpoint!r}")
        by_id = dict(relays)
        endpoints = list(relays.values())
    else:
        assert relays is not None
        endpoints = [relays] if isinstance(relays, str) else list(relays)
        for endpoint in endpoints:
            if not isinstance(endpoint, str):
                raise TypeError(f"endpoints must be strings, got {endpoint!r}")
    return Relays(endpoints, by_id, limits=Limits(), spin=spin), None


def _curve(
    config: MeshConfig | None, key_file: str | os.PathLike[str] | None, curve: ClientCurve | None
) -> ClientCurve | None:
    """The client's CurveZMQ settings: `curve` as given (with `relays=`), else from the
    topology and `key_file` (relay.security.client_curve)."""
    if curve is not None:
        return curve
    if config is None:
        if key_file is not None:
            raise ValueError(
                "key_file= needs topology= (the relays' public keys come from the topology), "
                "or give curve=relay.security.client_curve(topology, key_file)"
            )
        return None
    return client_curve(config, key_file)


def _random_request_id() -> int:
    """A client's first request id: random, leaving room to count."""
    return int.from_bytes(os.urandom(8), "big") >> 2


def _check_range(name: str, value: float, lo: float, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"{name} must be {bound}, got {value}")


# --- sockets -----------------------------------------------------------------------------


class _Engine(Protocol):
    def on_frame(self, endpoint: str, frame: bytes, now: float) -> None: ...

    def on_disconnect(self, endpoint: str, now: float) -> None: ...


def _configure(sock: Any) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    # Queue only on a connected relay: a send to a relay that is down fails at once
    # (zmq.Again) instead of waiting in a queue for a relay that may never come.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.HEARTBEAT_IVL, CLIENT_HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, CLIENT_HEARTBEAT_TIMEOUT_MS)
    # The relay drops the connection of a client silent this long (a stopped client),
    # and with it the replies queued for it.
    sock.setsockopt(zmq.HEARTBEAT_TTL, CLIENT_HEARTBEAT_TIMEOUT_MS)


class _Links:
    """A DEALER (plus a monitor for lost connections) per relay endpoint, and a waiter on
    all of them; the drain logic shared by both flavours. `shadow`: the context is an
    asyncio one, whose sockets are used through their plain views."""

    def __init__(
        self, ctx: Any, endpoints: Sequence[str], shadow: bool, curve: ClientCurve | None
    ) -> None:
        self.ctx = ctx
        self.closed = False
        self.socks: dict[str, Any] = {}  # endpoint -> DEALER (the context's socket class)
        self.monitors: dict[str, DisconnectMonitor] = {}
        # (endpoint, DEALER as the waiter knows it, its monitor)
        self._links: list[tuple[str, zmq.Socket[Any], DisconnectMonitor]] = []
        plain_ctx: zmq.Context[Any] = zmq.Context.shadow(ctx.underlying) if shadow else ctx
        try:
            for endpoint in endpoints:
                sock = ctx.socket(zmq.DEALER)
                self.socks[endpoint] = sock
                _configure(sock)
                allow_ipv6(sock, endpoint)
                if curve is not None:
                    curve.apply(sock, endpoint)
                plain: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying) if shadow else sock
                monitor = self.monitors[endpoint] = DisconnectMonitor(plain_ctx, plain)
                sock.connect(endpoint)
                self._links.append((endpoint, plain, monitor))
        except BaseException:
            self.close()
            raise
        self._by_endpoint = {endpoint: plain for endpoint, plain, _ in self._links}
        self.waiter = ReadableWaiter(
            [sock for _, plain, monitor in self._links for sock in (plain, monitor.socket)]
        )

    def send(self, endpoint: str, frame: bytes) -> bool:
        try:
            self._by_endpoint[endpoint].send(frame, _NOBLOCK)
        except zmq.Again:
            return False
        return True

    def drain(self, engine: _Engine, now: float, readable: Container[zmq.Socket[Any]]) -> None:
        """Feed the engine what arrived on the sockets in `readable` (trying the others
        would only fail)."""
        for endpoint, sock, monitor in self._links:
            if monitor.socket in readable:
                for _ in monitor.disconnected():
                    engine.on_disconnect(endpoint, now)
            if sock not in readable:
                continue
            # A poll of the socket alone says whether another frame waits: reading until
            # recv raised Again cost more than the read (3.4 us against 1.2, as in the
            # relay's drain).
            poll_self = [(sock, _POLLIN)]
            for _ in range(DRAIN_MAX):
                try:
                    frame = sock.recv(_NOBLOCK)
                except zmq.Again:
                    break
                engine.on_frame(endpoint, frame, now)
                if not zmq.zmq_poll(poll_self, 0):
                    break

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        waiter = getattr(self, "waiter", None)  # none if a socket failed to open
        if waiter is not None:
            waiter.close()  # before the descriptors go away with their sockets
        for monitor in self.monitors.values():
            monitor.close()
        for sock in self.socks.values():
            sock.close(linger=0)
        self.ctx.destroy(linger=0)


class _SyncLinks(_Links):
    def __init__(self, endpoints: Sequence[str], curve: ClientCurve | None) -> None:
        super().__init__(zmq.Context(), endpoints, False, curve)

    def wait(self, engine: _Engine, timeout_s: float | None) -> None:
        """Wait up to `timeout_s` (None: until something arrives) and feed the engine."""
        timeout_ms = -1 if timeout_s is None else max(0, int(timeout_s * 1000 + 0.999))
        readable = self.waiter.poll(timeout_ms)
        if readable:
            self.drain(engine, time.monotonic(), readable)


class _AsyncLinks(_Links):
    """Waits through the event loop (`ReadableWaiter.wait`); a producer's wake-up future
    ends the wait too."""

    def __init__(self, endpoints: Sequence[str], curve: ClientCurve | None) -> None:
        super().__init__(zmq.asyncio.Context(), endpoints, True, curve)

    def send(self, endpoint: str, frame: bytes) -> bool:
        self.waiter.mark(self._by_endpoint[endpoint])  # (ReadableWaiter says why)
        return super().send(endpoint, frame)

    async def wait(
        self,
        engine: _Engine,
        timeout_s: float | None,
        wakeup: asyncio.Future[None] | None = None,
    ) -> None:
        """Wait up to `timeout_s`, or until `wakeup` is done, and feed the engine."""
        readable = await self.waiter.wait(timeout_s, wakeup)
        if readable:
            self.drain(engine, time.monotonic(), readable)


# --- producers ---------------------------------------------------------------------------


_L = TypeVar("_L", _SyncLinks, _AsyncLinks)


def _check_producer_args(
    producer_id: bytes | None,
    first_producer_seq: int,
    window: int,
    send_timeout_s: float,
    request_timeout_s: float,
    max_attempts: int,
    connect_grace_s: float,
) -> bytes:
    pid = os.urandom(16) if producer_id is None else producer_id
    if not isinstance(pid, bytes) or not 0 < len(pid) <= MAX_PRODUCER_ID_BYTES:
        raise ValueError(f"producer_id must be 1..{MAX_PRODUCER_ID_BYTES} bytes, got {pid!r}")
    if isinstance(first_producer_seq, bool) or not isinstance(first_producer_seq, int):
        raise TypeError("first_producer_seq must be an int")
    _check_range("first_producer_seq", first_producer_seq, 0, MAX_U64)
    _check_range("window", window, 1, MAX_WINDOW)
    _check_range("send_timeout_s", send_timeout_s, 0.001)
    _check_range("request_timeout_s", request_timeout_s, 0.001)
    _check_range("max_attempts", max_attempts, 1)
    _check_range("connect_grace_s", connect_grace_s, 0)
    return pid


class _ProducerBase(Generic[_L]):
    _links_type: type[_L]  # the sync or the asyncio way of talking to relays

    def __init__(
        self,
        relays: RelayEndpoints | None = None,
        *,
        topology: TopologySource | None = None,
        producer_id: bytes | None = None,
        first_producer_seq: int = 0,
        window: int = DEFAULT_WINDOW,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        connect_grace_s: float = DEFAULT_CONNECT_GRACE_S,
        key_file: KeyFile = None,
        curve: ClientCurve | None = None,
    ) -> None:
        self._relays, config = _relays(relays, topology)
        curve = _curve(config, key_file, curve)
        if producer_id is None and curve is not None:
            # Relays accept from a client only producer ids that start with its name.
            producer_id = producer_id_prefix(curve.name) + os.urandom(PRODUCER_ID_RANDOM_BYTES)
        pid = _check_producer_args(
            producer_id,
            first_producer_seq,
            window,
            send_timeout_s,
            request_timeout_s,
            max_attempts,
            connect_grace_s,
        )
        self._window = int(window)
        self._closed = False
        self._engine = ProduceEngine(
            self._relays,
            pid,
            first_producer_seq,
            window=self._window,
            send_timeout_s=send_timeout_s,
            request_timeout_s=request_timeout_s,
            max_attempts=max_attempts,
            connect_grace_s=connect_grace_s,
            now=time.monotonic(),
            first_request_id=_random_request_id(),
        )
        self._links: _L = self._links_type(self._relays.endpoints, curve)
        self._start()

    def _start(self) -> None:
        """State of one flavour beyond the links (none by default)."""

    @property
    def producer_id(self) -> bytes:
        return self._engine.producer_id

    @property
    def next_producer_seq(self) -> int:
        """The producer sequence number the next message will carry."""
        return self._engine.next_seq

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._relays.endpoints

    @property
    def stats(self) -> Counter[str]:
        """Counters: attempts, retries, timeouts, unreachable, fenced, unknown, ..."""
        return self._engine.stats

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the producer is closed")


class Producer(_ProducerBase[_SyncLinks]):
    """A synchronous producer. `send` blocks until the transaction's outcome is definite
    (or the retries run out); `send_many` keeps up to `window` transactions in flight."""

    _links_type = _SyncLinks

    def send(
        self, stream: str, value: bytes, key: bytes | None = None, *, kind: int = KIND_PLAIN
    ) -> int:
        """Produce one transaction; return its committed sequence number. Raises
        Rejected, UnknownStream, Unknown or Fenced (relay.errors). `kind` says how the
        value is read (0: a plain value, one change; see `send_changes`)."""
        return self._send_op(stream, value, key, kind).result()

    def _send_op(self, stream: str, value: bytes, key: bytes | None, kind: int) -> Op:
        """`send`, returning the settled op (which relay answered: `op.endpoint`)."""
        self._check_open()
        check_produce_target(stream)
        key, value = _check_tx(key, value)
        op = self._engine.submit(stream, key, value, _check_kind(kind))
        self._run(lambda: op.done)
        return op

    def send_changes(self, stream: str, changes: Sequence[Change], key: bytes | None = None) -> int:
        """Produce one transaction carrying a list of changes (puts and deletes of
        (entity, key) values), applied together; InvalidChanges names a bad change."""
        return self.send(stream, encode_changes(list(changes)), key, kind=KIND_CHANGES)

    @overload
    def send_many(
        self,
        stream: str,
        values: Iterable[Item],
        *,
        return_exceptions: Literal[False] = False,
    ) -> list[int]: ...

    @overload
    def send_many(
        self, stream: str, values: Iterable[Item], *, return_exceptions: Literal[True]
    ) -> list[int | ClientError]: ...

    def send_many(
        self, stream: str, values: Iterable[Item], *, return_exceptions: bool = False
    ) -> list[int] | list[int | ClientError]:
        """Produce many transactions (values, or (key, value) pairs), up to `window` in
        flight; return their sequence numbers in the given order. Every transaction is
        settled before this returns; then the first failure is raised, unless
        `return_exceptions` puts the errors in the list instead."""
        self._check_open()
        check_produce_target(stream)
        items = iter(values)
        # Results by position, and only the unsettled transactions by op: a settled one
        # is let go at once (a long send_many would otherwise keep every op alive, and
        # the garbage collector would walk them all again and again).
        results: list[int | ClientError] = []
        unsettled: dict[Op, int] = {}
        bad: Exception | None = None
        exhausted = False

        def feed() -> None:
            nonlocal bad, exhausted
            if exhausted:
                return
            submit = self._engine.submit
            for _ in range(self._window - self._engine.load):  # room in the window
                try:
                    key, value = _split(next(items))
                except StopIteration:
                    exhausted = True
                    return
                except (TypeError, ValueError) as e:  # stop feeding; settle what was sent
                    bad, exhausted = e, True
                    return
                unsettled[submit(stream, key, value)] = len(results)
                results.append(-1)

        def settle(ops: list[Op]) -> None:
            for op in ops:
                position = unsettled.pop(op, None)
                if position is not None:
                    results[position] = op.error if op.error is not None else op.seq

        self._run(lambda: exhausted and not unsettled, feed, settle)
        if bad is not None:
            raise bad
        if not return_exceptions:
            for result in results:
                if isinstance(result, ClientError):
                    raise result
        return results

    def _run(
        self,
        done: Callable[[], bool],
        feed: Callable[[], None] | None = None,
        settle: Callable[[list[Op]], None] | None = None,
    ) -> None:
        engine, links = self._engine, self._links
        while True:
            if feed is not None:
                feed()
            now = time.monotonic()
            engine.step(now, links.send)
            completed = engine.take_completed()
            if settle is not None:
                settle(completed)
            if done():
                return
            wake = engine.next_wakeup()
            links.wait(engine, None if wake is None else max(0.0, wake - now))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.abandon("the producer closed")
            self._links.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Room:
    """Places in an asyncio producer's window: `take` waits for one, first come first
    served; `give` frees one, handing it straight to the oldest waiter. (asyncio.Semaphore
    looks through all its waiters on every acquire in Python 3.11: an eighth of a busy
    producer's time.)"""

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def take(self) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        place: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(place)
        try:
            await place  # woken with a place handed over (`give`)
        except asyncio.CancelledError:
            if place.done() and not place.cancelled():
                self.give()  # handed a place, then cancelled: pass it on
            raise

    def give(self) -> None:
        waiters = self._waiters
        while waiters:
            place = waiters.popleft()
            if not place.done():  # (a cancelled waiter is skipped)
                place.set_result(None)
                return
        self._free += 1


class AsyncProducer(_ProducerBase[_AsyncLinks]):
    """An asyncio producer. Many tasks may send at once; at most `window` transactions
    are in flight (`send_async` waits for room, then returns a future)."""

    _links_type = _AsyncLinks

    def _start(self) -> None:
        self._slots = _Room(self._window)
        self._futures: dict[Op, asyncio.Future[int]] = {}
        self._pump_task: asyncio.Task[None] | None = None
        self._broken: Exception | None = None
        self._wakeup: asyncio.Future[None] | None = None

    async def send(
        self, stream: str, value: bytes, key: bytes | None = None, *, kind: int = KIND_PLAIN
    ) -> int:
        """Like Producer.send."""
        return await (await self.send_async(stream, value, key, kind=kind))

    async def send_changes(
        self, stream: str, changes: Sequence[Change], key: bytes | None = None
    ) -> int:
        """Like Producer.send_changes."""
        value = encode_changes(list(changes))
        return await self.send(stream, value, key, kind=KIND_CHANGES)

    async def send_async(
        self, stream: str, value: bytes, key: bytes | None = None, *, kind: int = KIND_PLAIN
    ) -> asyncio.Future[int]:
        """Wait for room in the window, start producing, and return a future of the
        committed sequence number (or of the error)."""
        self._check_open()
        check_produce_target(stream)
        key, value = _check_tx(key, value)
        _check_kind(kind)
        await self._slots.take()
        if self._closed or self._broken is not None:
            self._slots.give()
            raise RuntimeError("the producer is closed") from self._broken
        op = self._engine.submit(stream, key, value, kind)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._futures[op] = future
        if self._pump_task is None:
            self._pump_task = asyncio.create_task(self._pump(), name="relay-producer")
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)
        return future

    @overload
    async def send_many(
        self,
        stream: str,
        values: Iterable[Item],
        *,
        return_exceptions: Literal[False] = False,
    ) -> list[int]: ...

    @overload
    async def send_many(
        self, stream: str, values: Iterable[Item], *, return_exceptions: Literal[True]
    ) -> list[int | ClientError]: ...

    async def send_many(
        self, stream: str, values: Iterable[Item], *, return_exceptions: bool = False
    ) -> list[int] | list[int | ClientError]:
        """Like Producer.send_many."""
        futures: list[asyncio.Future[int]] = []
        bad: Exception | None = None
        try:
            for item in values:
                key, value = _split(item)
                futures.append(await self.send_async(stream, value, key))
        except (TypeError, ValueError) as e:
            bad = e
        results = await asyncio.gather(*futures, return_exceptions=True)
        if bad is not None:
            raise bad
        out: list[int | ClientError] = []
        for result in results:
            if isinstance(result, ClientError):
                if not return_exceptions:
                    raise result
                out.append(result)
            elif isinstance(result, BaseException):
                raise result
            else:
                out.append(result)
        return out

    async def _pump(self) -> None:
        engine, links = self._engine, self._links
        loop = asyncio.get_running_loop()
        try:
            while True:
                now = time.monotonic()
                engine.step(now, links.send)
                self._settle()
                wake = engine.next_wakeup()
                self._wakeup = loop.create_future()
                timeout = None if wake is None else max(0.0, wake - now)
                await links.wait(engine, timeout, self._wakeup)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never leave a sender hanging
            self._broken = e
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(e)
            raise

    def _settle(self) -> None:
        for op in self._engine.take_completed():
            future = self._futures.pop(op, None)
            self._slots.give()
            if future is None or future.done():
                continue
            if op.error is not None:
                future.set_exception(op.error)
            else:
                future.set_result(op.seq)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        task, self._pump_task = self._pump_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                pass  # already given to the senders
        self._engine.abandon("the producer closed")
        self._settle()
        self._links.close()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


# --- consumers ---------------------------------------------------------------------------


class _StoreFeed:
    """A consumer's reads of the persistent store (docs/store.md 5), done by its driver
    when the engine asks (the engine does no I/O). Consecutive reads continue one
    iterator instead of scanning the store again for every batch; the iterator and the
    last point it runs to come from the same manifest, so once it is exhausted every
    stored record up to that point was read."""

    def __init__(self, location: StoreLocation) -> None:
        try:
            from relay.store.reader import StoreReader
        except ImportError as error:
            raise ImportError(
                f"reading the store at {location} needs pyarrow ({error}): install the store "
                "extra (pip install 'relay[store]'), or pass store=False"
            ) from error
        self.location = location
        self._reader: StoreReader = StoreReader(location)
        self._records: Iterator[StoredRecord] | None = None  # the read being continued
        self._stream = ""  # ... of this stream
        self._after = -1  # ... which continues after this seq
        self._last_seq = -1  # ... and ends at this seq (its manifest's last point)

    def read(self, stream: str, request: StoreRead, max_records: int) -> StoreBatch:
        records = self._records
        if (
            records is None
            or request.refresh
            or stream != self._stream
            or request.after_seq != self._after
        ):
            if request.refresh:
                self._reader.refresh()
            point = self._reader.last_point(stream)
            if point is not None and -1 < request.after_seq < self._reader.retained_after(stream):
                # Retention removed the records right after the position (they live on
                # only in snapshots): the store cannot serve it. ("From the beginning"
                # reads from the first record it keeps.)
                self._records = None
                return StoreBatch(request, [], None, True)
            if point is None or point.seq <= request.after_seq:
                self._records = None
                return StoreBatch(request, [], None if point is None else point.seq, True)
            records = self._records = self._reader.records_after(stream, request.after_seq)
            self._stream, self._last_seq = stream, point.seq
        batch = [
            Record(stream, r.seq, r.key, r.value, r.producer_id, r.producer_seq, r.kind)
            for r in itertools.islice(records, max_records)
        ]
        exhausted = len(batch) < max_records or batch[-1].seq >= self._last_seq
        self._after = batch[-1].seq if batch else request.after_seq
        if exhausted:
            self._records = None
        return StoreBatch(request, batch, self._last_seq, exhausted)

    def snapshot(self, stream: str) -> StoredSnapshot | None:
        """The latest snapshot of `stream` (None: none yet, or the stream is not stored)."""
        self._reader.refresh()
        try:
            return self._reader.snapshot(stream)
        except UnknownStoredStream:
            return None


def ingested_store(config: MeshConfig) -> StoreLocation | None:
    """The topology's store location once a store was ingested there (it has a folder of
    stream tables), else None: the store a consumer of that topology reads by default."""
    location = config.store_location
    return location if location.is_dir(STREAMS_DIR) else None


def _open_store(store: StoreSource, config: MeshConfig | None) -> _StoreFeed | None:
    """The store a consumer reads: `store` False none, a path, URI or location that store,
    None the topology's ingested store (`ingested_store`)."""
    if store is False:
        return None
    if store is None:
        location = None if config is None else ingested_store(config)
        return None if location is None else _StoreFeed(location)
    if isinstance(store, bool) or not isinstance(store, str | os.PathLike | StoreLocation):
        raise TypeError(f"store must be a path, URI, StoreLocation, None or False, got {store!r}")
    return _StoreFeed(as_location(store))


class _Lane:
    """One stream a consumer reads: its reading rules (engine), its durable mark, and the
    snapshot it started from."""

    __slots__ = ("engine", "mark", "snapshot")

    def __init__(
        self, engine: ReadEngine, mark: DurableMark | None, snapshot: StoredSnapshot | None
    ) -> None:
        self.engine = engine
        self.mark = mark
        self.snapshot = snapshot

    @property
    def position(self) -> int | None:
        engine = self.engine
        return engine.last if not engine.records else engine.records[0].seq - 1


class _Router:
    """Hands each answer frame, decoded once, to the engine whose request it answers (the
    streams of a pattern share one connection per relay)."""

    def __init__(self, frame_limit: int) -> None:
        self.frame_limit = frame_limit
        self.engines: list[ReadEngine | StreamWatch] = []
        self.stats: Counter[str] = Counter()

    def on_frame(self, endpoint: str, frame: bytes, now: float) -> None:
        msg = decode_answer(frame, self.frame_limit, self.stats)
        if msg is None:
            return
        for engine in self.engines:
            if engine.asked(msg.request_id):
                engine.on_answer(endpoint, msg, now)
                return
        self.stats["stale_answers"] += 1

    def on_disconnect(self, endpoint: str, now: float) -> None:
        for engine in self.engines:
            engine.on_disconnect(endpoint, now)


class _ConsumerBase(Generic[_L]):
    _links_type: type[_L]  # the sync or the asyncio way of talking to relays

    def __init__(
        self,
        relays: RelayEndpoints | None = None,
        *,
        topology: TopologySource | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        wait_ms: int = DEFAULT_WAIT_MS,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        timeout_s: float | None = None,
        count: int | None = None,
        connect_grace_s: float = DEFAULT_CONNECT_GRACE_S,
        store: StoreSource = None,
        key_file: KeyFile = None,
        curve: ClientCurve | None = None,
        durable: str | None = None,
        auto_commit_interval_s: float | None = None,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        lease_wait_s: float | None = 0.0,
        pattern_refresh_s: float = DEFAULT_PATTERN_REFRESH_S,
    ) -> None:
        _check_range("max_batch", max_batch, 1, MAX_READ_ENTRIES)
        _check_range("lease_ttl_s", lease_ttl_s, MIN_LEASE_TTL_S)
        _check_range("pattern_refresh_s", pattern_refresh_s, MIN_PATTERN_REFRESH_S)
        if lease_wait_s is not None:
            _check_range("lease_wait_s", lease_wait_s, 0)
        if durable is not None:
            check_durable_name(durable)
        if auto_commit_interval_s is not None:
            if durable is None:
                raise ValueError("auto_commit_interval_s needs durable=NAME (where to commit)")
            _check_range("auto_commit_interval_s", auto_commit_interval_s, 0)
        _check_range("wait_ms", wait_ms, 0, MAX_WAIT_MS)
        _check_range("request_timeout_s", request_timeout_s, 0.001)
        _check_range("connect_grace_s", connect_grace_s, 0)
        if timeout_s is not None:
            _check_range("timeout_s", timeout_s, 0)
        if count is not None:
            _check_range("count", count, 0)
        self._relays, config = _relays(relays, topology)
        curve = _curve(config, key_file, curve)
        self._store = _open_store(store, config)
        self._timeout_s = timeout_s
        self._count = count
        self._yielded = 0
        self._closed = False
        self._max_batch = int(max_batch)
        self._wait_ms = int(wait_ms)
        self._request_timeout_s = request_timeout_s
        self._connect_grace_s = connect_grace_s
        self._pattern_refresh_s = pattern_refresh_s
        self._router = _Router(self._relays.limits.max_frame_bytes)
        self._links: _L = self._links_type(self._relays.endpoints, curve)
        # What subscribe named (a stream, or a pattern read through a StreamWatch), and
        # each stream read: one lane per stream, in the order opened.
        self._subscribed: str | None = None
        self._watch: StreamWatch | None = None
        self._pattern_start: PatternStart = "earliest"
        self._lanes: dict[str, _Lane] = {}
        self._unopened: deque[tuple[str, Start | datetime]] = deque()  # found, to open
        self._current: _Lane | None = None  # the lane of the last record yielded
        self._others_head = -1  # then: the lowest first seq buffered in any other lane
        # A durable consumer's marks and leases, one per stream read (docs/metadata.md),
        # taken as each stream's lane opens; its Metadata client is made then.
        self._durable = durable
        self._auto_commit_s = auto_commit_interval_s
        self._lease_ttl_s = lease_ttl_s
        self._lease_wait_s = lease_wait_s
        self._meta_source = (relays, topology, curve)
        self._meta: Metadata | None = None
        self._committed_at = time.monotonic()
        self._renew_at: float | None = None  # the earliest renewal due of the marks held

    @property
    def durable(self) -> str | None:
        """The durable name whose marks this consumer resumes from and commits to."""
        return self._durable

    # --- subscribing ------------------------------------------------------------------

    def _subscribe(self, stream: str, start: PatternStart | str) -> None:
        if self._closed:
            raise RuntimeError("the consumer is closed")
        check_stream(stream)
        pattern = is_pattern(stream)
        start = _seq_from_text(start)
        _check_start(stream, start, pattern)
        self._release_marks(commit=False)
        self._lanes.clear()
        self._unopened.clear()
        self._router.engines.clear()
        self._current = None
        self._others_head = -1
        self._watch = None
        self._yielded = 0
        self._subscribed = stream
        self._committed_at = time.monotonic()
        if not pattern:
            assert not isinstance(start, Mapping)
            self._open_lane(stream, start)
            return
        self._pattern_start = start
        self._watch = StreamWatch(
            self._relays,
            stream,
            refresh_s=self._pattern_refresh_s,
            request_timeout_s=self._request_timeout_s,
            connect_grace_s=self._connect_grace_s,
            now=time.monotonic(),
            first_request_id=_random_request_id(),
        )
        self._router.engines.append(self._watch)

    def _take_found(self) -> None:
        """Queue the streams a pattern's watch found since last asked, with where each
        starts: the subscription's start; for "latest", a stream that appeared after the
        first round of asking starts at its beginning (all of it came after the
        subscription); with a mapping, the stream's entry, else its beginning."""
        watch = self._watch
        if watch is None:
            return
        start = self._pattern_start
        for name, in_first_round in watch.take_new():
            if isinstance(start, Mapping):
                each = start.get(name, "earliest")
                self._unopened.append((name, "latest" if each is None else each))
            elif start == "latest" and not in_first_round:
                self._unopened.append((name, "earliest"))
            else:
                self._unopened.append((name, start))

    def _take_mark(self, stream: str, start: Start | datetime) -> tuple[DurableMark | None, Start]:
        """A durable consumer takes its lease on `stream` and starts after its mark (at
        `start` if it has none yet). Blocks (lease_wait_s); Busy if held."""
        if isinstance(start, datetime):
            start = position_at(start)
        if self._durable is None:
            return None, start
        if self._meta is None:
            relays, topology, curve = self._meta_source
            self._meta = Metadata(relays, topology=topology, curve=curve)
        mark = DurableMark(self._meta, self._durable, stream, self._lease_ttl_s, self._lease_wait_s)
        resume = mark.take()
        return mark, start if resume is None else resume

    def _open_lane(self, stream: str, start: Start | datetime) -> None:
        mark, resolved = self._take_mark(stream, start)
        self._add_lane(stream, resolved, mark)

    def _add_lane(self, stream: str, start: Start, mark: DurableMark | None) -> None:
        snapshot = None
        if start == "snapshot":
            if self._store is None:
                raise ValueError(
                    "start='snapshot' needs a store: pass store=path or URI, or a topology "
                    "whose store location holds one (relay store ingest)"
                )
            snapshot = self._store.snapshot(stream)
        engine = ReadEngine(
            self._relays,
            max_batch=self._max_batch,
            wait_ms=self._wait_ms,
            request_timeout_s=self._request_timeout_s,
            connect_grace_s=self._connect_grace_s,
            now=time.monotonic(),
            first_request_id=_random_request_id(),
            store_path=None if self._store is None else str(self._store.location),
        )
        if snapshot is None:
            engine.subscribe(stream, start)
        else:  # the records after the snapshot: the store's first, then the relays'
            engine.subscribe(stream, snapshot.seq, from_store=True)
        lane = _Lane(engine, mark, snapshot)
        self._lanes[stream] = lane
        if mark is not None:
            self._leases_written()
        self._router.engines.append(engine)
        if self._current is None:
            self._current = lane

    # --- durable marks ----------------------------------------------------------------

    def _commit(self) -> None:
        """Store every stream's position as its durable mark (a stream whose mark holds
        its position already and whose lease needs no renewal is left alone)."""
        if self._durable is None or self._subscribed is None:
            raise RuntimeError(
                "commit() needs a durable consumer that subscribed: Consumer(..., durable=NAME)"
            )
        now = self._committed_at = time.monotonic()
        try:
            for lane in self._lanes.values():
                mark = lane.mark
                if mark is None:
                    continue
                position = lane.position
                stored = position if position is not None else mark.seq
                if stored != mark.seq or now >= mark.renew_at:
                    mark.store(stored)
        finally:
            self._leases_written()

    def _lease_work_due(self) -> bool:
        """Whether a lease needs renewing, or auto-commit is due, before the next record."""
        if self._renew_at is None:
            return False
        due = self._lease_due()
        return due is not None and time.monotonic() >= due

    def _tend_lease(self) -> None:
        """Renew the leases due (committing the positions if auto-commit is on). LeaseLost
        if another instance took over."""
        if self._auto_commit_s is not None:
            self._commit()  # what was yielded before this call is processed
            return
        now = time.monotonic()
        try:
            for lane in self._lanes.values():
                mark = lane.mark
                if mark is not None and now >= mark.renew_at:
                    mark.store(mark.seq)
        finally:
            self._leases_written()

    def _release_marks(self, commit: bool) -> None:
        """Give the leases up (storing the positions when auto-commit is on and `commit`),
        so the next instance need not wait for them to run out."""
        try:
            for lane in self._lanes.values():
                mark, lane.mark = lane.mark, None
                if mark is None:
                    continue
                position = lane.position if commit and self._auto_commit_s is not None else None
                mark.release(mark.seq if position is None else position)
        finally:
            self._leases_written()

    def _leases_written(self) -> None:
        """After marks were taken, written or given up: when the next lease renewal is
        due (kept, not recomputed per record)."""
        due = [lane.mark.renew_at for lane in self._lanes.values() if lane.mark is not None]
        self._renew_at = min(due) if due else None

    def _lease_due(self) -> float | None:
        """When a lease (or auto-commit) next needs the consumer's attention."""
        renew_at = self._renew_at
        if renew_at is None or self._auto_commit_s is None:
            return renew_at
        return min(renew_at, self._committed_at + self._auto_commit_s)

    def _close_meta(self) -> None:
        if self._meta is not None:
            self._meta.close()
            self._meta = None

    # --- reading ----------------------------------------------------------------------

    @property
    def _is_pattern(self) -> bool:
        return self._watch is not None

    def _take(self) -> Record | None:
        """The next record if one is buffered (of the stream whose next record is the
        oldest); raises a stream's error once its records are yielded."""
        current = self._current
        if current is not None and current.engine.records:
            # Records arrive only while no lane has any left to yield (a next() that
            # found none waits for frames), so the lane chosen last stays the oldest
            # while its next record is at or below the others' first.
            records = current.engine.records
            if records[0].seq <= self._others_head:
                self._yielded += 1
                return records.popleft()
        if self._subscribed is None:
            raise RuntimeError("subscribe(stream) first")
        best: _Lane | None = None
        head = second = MAX_U63
        for lane in self._lanes.values():
            records = lane.engine.records
            if records:
                first = records[0].seq
                if best is None or first < head:
                    best, head, second = lane, first, head
                elif first < second:
                    second = first
        if best is not None:
            self._yielded += 1
            self._current = best
            self._others_head = second
            return best.engine.records.popleft()
        self._others_head = -1  # every lane is empty: what arrives next is scanned first
        for lane in self._lanes.values():
            if lane.engine.error is not None:
                self._current = lane
                raise lane.engine.error
        if self._watch is not None and self._watch.error is not None:
            raise self._watch.error
        return None

    def _step(self, now: float) -> bool:
        """Let every engine send what it needs; whether a record or an error came of it."""
        send = self._links.send
        if self._watch is not None:
            self._watch.step(now, send)
        ready = False
        for lane in self._lanes.values():
            engine = lane.engine
            engine.step(now, send)
            ready = ready or bool(engine.records) or engine.error is not None
        return ready

    def _wait_s(self, now: float, deadline: float | None) -> float | None:
        """How long to wait for a frame before something is due (None: until one comes)."""
        times = [lane.engine.next_wakeup() for lane in self._lanes.values()]
        if self._watch is not None:
            times.append(self._watch.next_wakeup())
        times += [deadline, self._lease_due()]
        limits = [t - now for t in times if t is not None]
        return max(0.0, min(limits)) if limits else None

    def _store_request(self) -> tuple[_Lane, StoreRead] | None:
        """A store read one of the engines asks for."""
        for lane in self._lanes.values():
            request = lane.engine.store_request
            if request is not None:
                return lane, request
        return None

    def _store_reading(self, lane: _Lane, request: StoreRead) -> Callable[[], StoreBatch]:
        """The store read an engine asked for, to run (it blocks) here or in a thread."""
        stream = lane.engine.stream
        assert self._store is not None and stream is not None  # asked only with a store
        return functools.partial(self._store.read, stream, request, self._max_batch)

    # --- what it reads ----------------------------------------------------------------

    @property
    def stream(self) -> str | None:
        """The stream, or the pattern, subscribed."""
        return self._subscribed

    @property
    def streams(self) -> tuple[str, ...]:
        """The streams being read: the one subscribed, or those of the pattern found so far
        (relays are asked for new ones every `pattern_refresh_s`)."""
        return tuple(self._lanes)

    @property
    def positions(self) -> dict[str, int | None]:
        """Each stream's position (see `position`); resume a pattern with
        subscribe(pattern, positions)."""
        return {stream: lane.position for stream, lane in self._lanes.items()}

    @property
    def position(self) -> int | None:
        """The last seq yielded (or the start position); resume with start=position.
        None while a "latest" start is not resolved yet. One stream only: a pattern's
        streams have a position each (`positions`)."""
        if self._is_pattern:
            raise RuntimeError(
                f"{self._subscribed!r} is a pattern: each of its streams has its own position "
                "(Consumer.positions)"
            )
        lane = self._current
        return None if lane is None else lane.position

    @property
    def endpoint(self) -> str | None:
        """The relay being read from (None between relays, and while reading the store);
        with a pattern, for the stream of the last record yielded."""
        lane = self._current
        return None if lane is None else lane.engine.endpoint

    @property
    def source(self) -> Source:
        """Where the records come from now: "store" or "relays" (with a pattern, for the
        stream of the last record yielded)."""
        lane = self._current
        return "relays" if lane is None else lane.engine.source

    @property
    def snapshot(self) -> StoredSnapshot | None:
        """After subscribe(stream, "snapshot"): the snapshot loaded (seq, digest, rows: a
        pyarrow Table of entity, key, value, seq); the records yielded are those after its
        seq. None for other starts, or when the stream had no snapshot yet."""
        lane = self._current
        return None if lane is None else lane.snapshot

    @property
    def history_gone_before(self) -> int | None:
        """Read from the beginning: None while the records yielded start at the stream's
        genesis (or the store's first record); else the seq up to which history is gone
        (evicted from every relay asked and not in the store), the records yielded being
        those after it. Known from the stream's first record on; with a pattern, for the
        stream of the last record yielded."""
        lane = self._current
        return None if lane is None else lane.engine.history_gone_before

    @property
    def oldest_available(self) -> int | None:
        """After OutOfRange: the oldest position any relay can still serve (of the stream
        the error names)."""
        lane = self._current
        return None if lane is None else lane.engine.oldest_available

    @property
    def stats(self) -> Counter[str]:
        """Counters: reads, failovers, timeouts, unreachable, fenced, redirect,
        out_of_range, store_reads, stored_records (yielded from the store), ..., over
        every stream read."""
        total = Counter(self._router.stats)
        if self._watch is not None:
            total.update(self._watch.stats)
        for lane in self._lanes.values():
            total.update(lane.engine.stats)
        return total

    def _finished(self) -> bool:
        return self._closed or (self._count is not None and self._yielded >= self._count)


_NAMED_STARTS: dict[str, Start] = {
    "earliest": "earliest",
    "latest": "latest",
    "snapshot": "snapshot",
}


def _start_of_text(text: str) -> Start:
    named = _NAMED_STARTS.get(text)
    if named is not None:
        return named
    try:
        return parse_seq(text)
    except ValueError as e:
        raise ValueError(
            f"start must be 'earliest', 'latest', 'snapshot', a seq or a timezone-aware "
            f"datetime: {e}"
        ) from None


def _seq_from_text(start: PatternStart | str) -> PatternStart:
    """A seq given as decimal text (as the `relay` command's JSON prints seqs), also in a
    mapping of starts, as an int; any other start as it is. ValueError for other text."""
    if isinstance(start, str):
        return _start_of_text(start)
    if isinstance(start, Mapping):
        return {
            name: _start_of_text(each) if isinstance(each, str) else each
            for name, each in start.items()
        }
    return start


def _check_start(stream: str, start: object, pattern: bool) -> None:
    """ValueError/TypeError unless `start` can start reading `stream` (or a pattern)."""
    if isinstance(start, Mapping):
        if not pattern:
            raise TypeError(
                f"{stream!r} is one stream: a start per stream (a mapping) is for a pattern"
            )
        for name, each in start.items():
            check_stream(name)
            if each is not None:  # a position not resolved yet: "latest"
                _check_start(name, each, False)
        return
    if pattern and start == "snapshot":
        raise ValueError(
            f"start='snapshot' reads one stream's snapshot; {stream!r} is a pattern "
            "(subscribe to each stream, or start at 'earliest')"
        )
    if isinstance(start, datetime):
        position_at(start)  # ValueError for a naive or out-of-range moment
    elif start not in ("earliest", "latest", "snapshot") and (
        not isinstance(start, int) or isinstance(start, bool) or not -1 <= start <= MAX_U63
    ):
        raise ValueError(
            "start must be 'earliest', 'latest', 'snapshot', a seq (-1..2**63-1) or a "
            f"timezone-aware datetime, got {start!r}"
        )


class Consumer(_ConsumerBase[_SyncLinks]):
    """A synchronous consumer of one stream, or of every stream a pattern names:
    `subscribe`, then iterate over `Record`s (`record.stream` says whose).

    `store`: the persistent store that serves the history the relays no longer hold (a
    path or URI; by default the topology's store location if a store was ingested there; False:
    never). Iteration ends after `count` records (counted from the last `subscribe`), or
    when one `next()` waited `timeout_s` seconds without a record (both optional; by
    default it waits forever). Errors: UnknownStream, OutOfRange (see
    `oldest_available`), Rejected (a relay refused the request frame), StoreError (the
    store is unreadable)."""

    _links_type = _SyncLinks

    def subscribe(self, stream: str, start: PatternStart | str = "earliest") -> Consumer:
        """Read `stream` from `start`: "earliest" (the whole history, the store's first),
        "latest" (what commits from now on), a position (a seq, an int or its decimal
        text as the `relay` command's JSON prints it: the records after it), a
        moment (a timezone-aware datetime: the records committed from then on, by the seqs'
        milliseconds), or "snapshot" (the latest stored snapshot, see `snapshot`, then the
        records after it; ValueError without a store). A durable consumer starts there
        only when it has no mark yet.

        `stream` may be a pattern (`orders.*`; fnmatch `*`, `?`, `[...]`): then every
        stream it names is read, each in its own order (the next record yielded is the
        oldest one buffered), those that appear later included (the relays are asked for
        new ones every `pattern_refresh_s`; such a stream is read from its beginning even
        with "latest", all of it being newer than the subscription). `start` then applies
        to each stream, or is a mapping of starts per stream (`positions`: None there
        means "latest"; a stream not in it starts at its beginning); "snapshot" is for
        one stream only. A durable consumer keeps a mark and a lease per stream, taken as
        each is found."""
        self._subscribe(stream, start)
        return self

    def __iter__(self) -> Consumer:
        return self

    def commit(self) -> int | None:
        """Store `position` (every stream's, with a pattern) as this durable consumer's
        mark: the next run with the same name resumes after it. Commit after processing:
        delivery is at least once. LeaseLost if another instance took a stream over.
        Returns the position stored (None with a pattern: see `positions`)."""
        self._commit()
        return None if self._is_pattern else self.position

    def __next__(self) -> Record:
        if self._finished():
            raise StopIteration
        links = self._links
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        while True:
            self._take_found()
            while self._unopened:  # a stream stays queued until its lane opened
                self._open_lane(*self._unopened[0])
                self._unopened.popleft()
            if self._lease_work_due():
                self._tend_lease()
            record = self._take()
            if record is not None:
                return record
            asked = self._store_request()
            if asked is not None:
                lane, request = asked
                lane.engine.on_store_batch(self._store_reading(lane, request)())
                continue
            now = time.monotonic()
            if self._step(now):
                continue
            if deadline is not None and now >= deadline:
                raise StopIteration
            links.wait(self._router, self._wait_s(now, deadline))

    def close(self, commit: bool = True) -> None:
        """Close; a durable consumer gives its leases up, with auto-commit on committing
        the positions first (unless `commit` is False, as on leaving a `with` block by an
        exception)."""
        if not self._closed:
            try:
                self._release_marks(commit)
            finally:
                self._closed = True
                self._close_meta()
                self._links.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(commit=exc is None)


class AsyncConsumer(_ConsumerBase[_AsyncLinks]):
    """The asyncio consumer: `subscribe`, then `async for record in consumer`. Store reads
    and durable marks' metadata calls run in worker threads, so they do not hold up the
    event loop."""

    _links_type = _AsyncLinks
    # A store read under way in its thread (it cannot be cancelled), and the lane that
    # asked: awaited again by the next __anext__ when the one that started it was
    # cancelled, so the store is never read by two threads at once.
    _store_read_under_way: tuple[_Lane, asyncio.Future[StoreBatch]] | None = None

    def subscribe(self, stream: str, start: PatternStart | str = "earliest") -> AsyncConsumer:
        """Like Consumer.subscribe (reading a snapshot, and a durable consumer's mark of
        one stream, block while they load)."""
        self._subscribe(stream, start)
        return self

    def __aiter__(self) -> AsyncConsumer:
        return self

    async def commit(self) -> int | None:
        """Like Consumer.commit (the metadata calls run in a worker thread)."""
        await asyncio.to_thread(self._commit)
        return None if self._is_pattern else self.position

    async def __anext__(self) -> Record:
        if self._finished():
            raise StopAsyncIteration
        links = self._links
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        while True:
            self._take_found()
            while self._unopened:  # a stream stays queued until its lane opened
                stream, start = self._unopened[0]
                mark, resolved = await asyncio.to_thread(self._take_mark, stream, start)
                self._add_lane(stream, resolved, mark)
                self._unopened.popleft()
            if self._lease_work_due():
                await asyncio.to_thread(self._tend_lease)
            record = self._take()
            if record is not None:
                return record
            if self._store_read_under_way is not None:
                await self._read_store_in_thread(None)
                continue
            asked = self._store_request()
            if asked is not None:
                await self._read_store_in_thread(asked)
                continue
            now = time.monotonic()
            if self._step(now):
                continue
            if deadline is not None and now >= deadline:
                raise StopAsyncIteration
            await links.wait(self._router, self._wait_s(now, deadline))

    async def _read_store_in_thread(self, asked: tuple[_Lane, StoreRead] | None) -> None:
        under_way = self._store_read_under_way
        if under_way is None:
            assert asked is not None
            lane, request = asked
            started: asyncio.Future[StoreBatch] = asyncio.ensure_future(
                asyncio.to_thread(self._store_reading(lane, request))
            )
            under_way = self._store_read_under_way = (lane, started)
        lane, reading = under_way
        try:
            batch = await asyncio.shield(reading)
        finally:
            if reading.done():
                self._store_read_under_way = None
        lane.engine.on_store_batch(batch)  # a read begun before a new subscribe is dropped

    async def close(self, commit: bool = True) -> None:
        """Like Consumer.close."""
        if not self._closed:
            try:
                await asyncio.to_thread(self._release_marks, commit)
            finally:
                self._closed = True
                self._close_meta()
                self._links.close()

    async def __aenter__(self) -> AsyncConsumer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close(commit=exc is None)


# --- metadata (docs/metadata.md) --------------------------------------------------------

DEFAULT_META_TIMEOUT_S = 10.0  # one metadata call, every relay and retry included
META_PENDING_RETRY_S = 0.002  # first wait before asking again for an outcome not folded yet
META_PENDING_RETRY_MAX_S = 0.1


class _MetaAnswers:
    """Collects the MetaResp (or ErrorResp) answering one request id."""

    def __init__(self, request_id: int, frame_limit: int) -> None:
        self.request_id = request_id
        self._frame_limit = frame_limit
        self.answer: wire.MetaResp | wire.ErrorResp | None = None
        self.lost = False  # the connection of the relay asked went away

    def on_frame(self, endpoint: str, frame: bytes, now: float) -> None:
        try:
            msg = wire.decode(frame, self._frame_limit)
        except FrameError:
            return  # not ours to judge: the answer then times out, and another relay is asked
        if isinstance(msg, wire.MetaResp | wire.ErrorResp) and msg.request_id == self.request_id:
            self.answer = msg

    def on_disconnect(self, endpoint: str, now: float) -> None:
        self.lost = True


class Metadata:
    """The mesh's versioned key/value metadata (docs/metadata.md): compare-and-set over a
    stream every relay serves, readable from every relay.

        with Metadata(topology="config/topology.yaml") as meta:
            version = meta.write("jobs/nightly", b"owner=a", ABSENT)   # create
            current = meta.read("jobs/nightly")                        # Versioned | None
            meta.write("jobs/nightly", b"owner=b", current.version)    # update
            meta.delete("jobs/nightly", version)                       # BadVersion: stale

    A write or delete names the version it expects (`ABSENT`: the key must not exist;
    `ANY_VERSION`: whatever it holds) and returns once committed; if another writer changed
    the key first it raises `BadVersion` carrying the version found. Reads are answered by
    one relay from its fold of the committed operations (as of `applied`, which a read
    following one's own write always covers). Errors: BadVersion (final for that
    operation), MetadataUnavailable (retriable), NotAuthorized, and the producer's errors
    for the write itself (Unknown: it may still have committed; read to find out)."""

    def __init__(
        self,
        relays: RelayEndpoints | None = None,
        *,
        topology: TopologySource | None = None,
        timeout_s: float = DEFAULT_META_TIMEOUT_S,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        key_file: KeyFile = None,
        curve: ClientCurve | None = None,
    ) -> None:
        _check_range("timeout_s", timeout_s, 0.001)
        _check_range("request_timeout_s", request_timeout_s, 0.001)
        self._relays, config = _relays(relays, topology)
        curve = _curve(config, key_file, curve)
        self._timeout_s = timeout_s
        self._request_timeout_s = request_timeout_s
        self._links = _SyncLinks(self._relays.endpoints, curve)
        try:
            self._producer = Producer(
                relays, topology=topology, window=1, curve=curve, send_timeout_s=timeout_s
            )
        except BaseException:
            self._links.close()
            raise
        self._next_request_id = itertools.count(_random_request_id())
        self._first = random.randrange(len(self._relays.endpoints))  # spread readers
        self.applied = -1  # the highest metadata seq an answer reflected
        self.last_seq = -1  # the seq the last operation (or read barrier) committed at

    def read(self, key: str, *, linearizable: bool = False) -> Versioned | None:
        """The key's value and version, or None if it does not exist. By default as of
        what one relay folded, never before what this client saw (its own writes, earlier
        reads); `linearizable`: as of this call or later (a read operation is committed
        first, one round more)."""
        answer = self._ask("get", check_key(key), self._reflect(linearizable))
        return Versioned(*answer.items[0]) if answer.items else None

    def list(self, prefix: str = "", *, linearizable: bool = False) -> list[Versioned]:
        """The keys starting with `prefix`, in key order (at most META_LIST_MAX); as of
        the same point as `read`."""
        if prefix:
            check_key(prefix)
        answer = self._ask("list", prefix, self._reflect(linearizable))
        return [Versioned(*item) for item in answer.items]

    def _reflect(self, linearizable: bool) -> int:
        """The lowest seq a read's answer must reflect."""
        if not linearizable:
            return self.applied
        encoded = encode_op(MetaOp(OP_READ, READ_BARRIER_KEY, ANY_VERSION, None))
        self.last_seq = self._producer.send(METADATA_STREAM, encoded, kind=KIND_META)
        return self.last_seq

    def write(self, key: str, value: bytes, expected_version: int) -> int:
        """Set `key` to `value` if its version is `expected_version`; the new version."""
        return self._apply(MetaOp(OP_WRITE, key, expected_version, value))

    def delete(self, key: str, expected_version: int) -> None:
        """Remove `key` if its version is `expected_version` (BadVersion if it does not
        exist: current_version 0)."""
        self._apply(MetaOp(OP_DELETE, key, expected_version, None))

    def _apply(self, op: MetaOp) -> int:
        encoded = encode_op(op)  # InvalidMetaOp (a FieldError) before anything is sent
        sent = self._producer._send_op(METADATA_STREAM, encoded, None, KIND_META)
        seq = self.last_seq = sent.result()
        # The relay that answered has folded the operation already (it answers a produce
        # once committed there): ask it first, not one that may still be behind.
        endpoints = self._relays.endpoints
        if sent.endpoint in endpoints:
            self._first = endpoints.index(sent.endpoint)
        answer = self._ask("outcome", "", seq)
        if answer.result == "applied":
            return answer.version
        if answer.result == "bad_version":
            found = "does not exist" if answer.version == ABSENT else f"is at {answer.version}"
            raise BadVersion(
                f"{op.key!r}: expected version {op.expected_version}, but the key {found}",
                key=op.key,
                expected_version=op.expected_version,
                current_version=answer.version,
            )
        raise Rejected(f"{op.key!r}: the metadata operation is invalid: {answer.detail}")

    def _ask(self, op: str, key: str, seq: int = -1) -> wire.MetaResp:
        """Ask relays in turn until one can answer; MetadataUnavailable if none can."""
        endpoints = self._relays.endpoints
        deadline = time.monotonic() + self._timeout_s
        last: dict[str, str] = {}
        pending_wait = META_PENDING_RETRY_S
        turn = 0
        while time.monotonic() < deadline:
            endpoint = endpoints[(self._first + turn) % len(endpoints)]
            answer = self._ask_one(endpoint, wire.MetaReq(0, op, key, seq), deadline)
            if isinstance(answer, wire.ErrorResp):
                if answer.error == "NotAuthorized":
                    raise NotAuthorized(answer.message, right="metadata", stream=METADATA_STREAM)
                last[endpoint] = f"{answer.error}: {answer.message}"
            elif answer is None:
                last[endpoint] = "no answer"
            elif answer.status == "ok":
                self._first = (self._first + turn) % len(endpoints)  # stay with a good one
                self.applied = max(self.applied, answer.applied)
                return answer
            elif answer.status == "pending":  # not folded that far there yet: ask again
                time.sleep(pending_wait)
                pending_wait = min(2 * pending_wait, META_PENDING_RETRY_MAX_S)
                continue
            elif answer.status == "forgotten":
                raise Unknown(f"the outcome of metadata seq {seq} is forgotten: {answer.detail}")
            else:
                last[endpoint] = f"{answer.status}: {answer.detail}"
            turn += 1
            if turn % len(endpoints) == 0:  # every relay asked: pause before the next round
                time.sleep(min(META_PENDING_RETRY_MAX_S, max(0.0, deadline - time.monotonic())))
        said = "; ".join(f"{e}: {why}" for e, why in last.items()) or "no relay answered"
        raise MetadataUnavailable(f"no relay could answer a metadata {op} in time ({said})")

    def _ask_one(
        self, endpoint: str, req: wire.MetaReq, deadline: float
    ) -> wire.MetaResp | wire.ErrorResp | None:
        answers = _MetaAnswers(next(self._next_request_id), self._relays.limits.max_frame_bytes)
        frame = wire.encode(wire.MetaReq(answers.request_id, req.op, req.key, req.seq))
        if not self._links.send(endpoint, frame):
            return None
        until = min(deadline, time.monotonic() + self._request_timeout_s)
        while answers.answer is None and not answers.lost:
            left = until - time.monotonic()
            if left <= 0:
                return None
            self._links.wait(answers, left)
        return answers.answer

    def close(self) -> None:
        self._producer.close()
        self._links.close()

    def __enter__(self) -> Metadata:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --- durable consumers: a mark with a lease (docs/metadata.md) -----------------------------


class DurableMark:
    """One durable consumer instance's lease on, and position in, one stream: the key
    `consumers/<name>/<stream>`, whose value (relay.meta.Mark) holds both, so that every
    commit renews the lease and every takeover fences the previous holder's commits (both
    are compare-and-set on the same key's version).

    `take` gets the lease: at once when nobody holds it (or this name's previous holder
    released it), else after the holder let it run out: its version stayed unchanged for
    its TTL (plus LEASE_MARGIN_S) as seen by this process's monotonic clock, which began
    counting only after the holder's last write committed. The holder yields records only
    within a third of its TTL after it sent its last write, renewing before it yields
    more, so the two never read at once while their clocks run at about the same rate; a
    renewal after a takeover fails (LeaseLost). `lease_wait_s` 0: a held lease raises
    Busy at once; None: wait forever."""

    def __init__(
        self, meta: Metadata, name: str, stream: str, ttl_s: float, wait_s: float | None
    ) -> None:
        self._meta = meta
        self.name = name
        self.stream = stream
        self.key = mark_key(name, stream)
        self.holder = f"{socket.gethostname()}/{os.getpid()}/{os.urandom(4).hex()}"
        self._ttl_ms = int(ttl_s * 1000)
        self._wait_s = wait_s
        self.version = ABSENT
        self.seq: int | None = None
        self.held = False  # this instance's last write of the mark succeeded
        self.renew_at = 0.0  # monotonic: renew from then on

    def take(self) -> int | None:
        """Take the lease; the stored position (None: none yet). Busy if another instance
        holds it beyond lease_wait_s."""
        meta = self._meta
        deadline = None if self._wait_s is None else time.monotonic() + self._wait_s
        seen: tuple[int, float] | None = None  # (holder's version, when first seen here)
        while True:
            held = meta.read(self.key, linearizable=True)
            mark = Mark(None) if held is None else decode_mark(held.value)
            now = time.monotonic()
            if held is not None and mark.holder not in ("", self.holder):
                if seen is None or seen[0] != held.version:
                    seen = (held.version, now)
                expires = seen[1] + mark.ttl_ms / 1000 + LEASE_MARGIN_S
                if now < expires:
                    if deadline is not None and now >= deadline:
                        raise Busy(
                            f"durable consumer {self.name!r} on stream {self.stream!r} is "
                            f"held by {mark.holder} (free within {expires - now:.1f} s if it "
                            "stops renewing)",
                            holder=mark.holder,
                            free_in_s=expires - now,
                        )
                    until = expires if deadline is None else min(expires, deadline)
                    time.sleep(max(0.0, min(until - now, LEASE_POLL_S)))
                    continue
            try:
                self._write(mark.seq, self.holder, ABSENT if held is None else held.version)
            except BadVersion:
                seen = None  # renewed, released or taken meanwhile: look again
                continue
            return mark.seq

    def store(self, seq: int | None) -> None:
        """Store `seq` as the position and renew the lease. LeaseLost if another instance
        took over: its takeover moved the mark's version. (A renewal after the TTL ran out
        is still safe when it succeeds: a contender writes before it reads.)"""
        try:
            self._write(seq, self.holder, self.version)
        except BadVersion as e:
            self.held = False
            raise LeaseLost(
                f"durable consumer {self.name!r} lost its lease on stream {self.stream!r}: "
                "another instance took over"
            ) from e

    def release(self, seq: int | None) -> None:
        """Store `seq` and give the lease up, if this instance still holds it."""
        if self.held:
            with contextlib.suppress(BadVersion):  # taken over already: nothing to give up
                self._write(seq, "", self.version)
        self.held = False

    def _write(self, seq: int | None, holder: str, expected_version: int) -> None:
        started = time.monotonic()  # the lease counts from before the write is sent
        encoded = encode_mark(Mark(seq, holder, self._ttl_ms))
        self.version = self._meta.write(self.key, encoded, expected_version)
        self.seq = seq
        self.held = True
        self.renew_at = started + self._ttl_ms / 1000 / LEASE_RENEW_FRACTION
