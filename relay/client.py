"""The client library: producers and consumers of the relay mesh (relay.wire over ZeroMQ).

    with Producer(topology="config/topology.yaml") as producer:
        seq = producer.send("orders", b"payload", key=b"customer-7")
        seqs = producer.send_many("orders", [b"a", b"b", (b"key", b"c")])

    with Consumer(topology="config/topology.yaml").subscribe("orders", "earliest") as c:
        for record in c:
            print(record.seq, record.value)

`AsyncProducer` and `AsyncConsumer` are the asyncio (zmq.asyncio) flavours.

Relays are given either as `relays=[endpoint, ...]` (or `{relay_id: endpoint}` so that
redirects naming relay ids can be followed) or as `topology=path | MeshConfig`: then every
relay's `client_endpoint` is used, the members of a stream are tried first, redirects are
mapped to endpoints, and the topology's limits bound frames.

Producing (docs/protocol.md G3): every transaction carries the producer's id and the next
producer sequence number. On `unknown`, `fenced`, a timeout, a lost connection or a relay
that is not connected, the SAME producer sequence is retried on another relay (the relays
a `fenced` answer lists first), up to `max_attempts` attempts within `send_timeout_s`;
retries never create a duplicate. A `rejected` answer is final (`Rejected`, or
`UnknownStream` when no relay serves the stream), except that once an earlier attempt of
the same producer sequence ended without a definite answer, the final error is `Unknown`:
that earlier copy may still commit. Running out of attempts raises `Unknown` (some attempt
may have reached a relay) or `Fenced` (every answer was `fenced`). With `window` > 1,
messages sent together are in flight at once, so their commit order may differ from the
order they were given in. Attempts bound for the same relay at the same moment travel
together in ProduceBatchReq frames (within the topology's max_batch_entries and request
frame limit, or the default limits without a topology); each keeps its own request id,
answer, retries and error. Should a relay refuse a whole batch (ErrorResp: it changed
nothing), its transactions are sent again one per frame.

Consuming: `subscribe(stream, start)` with start "earliest" (the whole history: the
store's records, then the relays'; without a store the oldest entry a relay holds),
"latest" (the relay's committed point, learnt by the first read, i.e. at the first
`next()`), a position: a seq, meaning "the records after it" (resume with the last seq
processed, `Consumer.position`), or "snapshot" (the stream's latest stored snapshot, loaded
at subscribe as `Consumer.snapshot`, then the records after it; "earliest" when there is no
snapshot yet). A consumer reads one stream with long polls (`ReadReq` with `wait_ms`) of at
most `max_batch` entries, and asks for the next batch only after the previous one was
consumed, so a slow consumer costs a relay nothing. It resumes after the last sequence
number it yielded (never yielding a seq at or below it) on another relay when its relay
redirects, is fenced, is not ready, does not answer or goes away.

The store (docs/store.md 5; `store=` a path, or by default the topology's `store_dir` once
a store was ingested there; `store=False` never) holds every stream's history from its
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

Neither flavour is thread-safe: use one client per thread (or per event loop).
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import os
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeAlias, TypeVar, overload

import zmq
import zmq.asyncio

from relay import wire
from relay.core.config import Limits
from relay.core.fields import MAX_TX_KIND
from relay.core.messages import Outcome, ReadStatus
from relay.errors import (
    ClientError,
    Fenced,
    FrameError,
    OutOfRange,
    Rejected,
    Unknown,
    UnknownStream,
)
from relay.sockets import DisconnectMonitor, ReadableWaiter
from relay.store.changes import KIND_CHANGES, KIND_PLAIN, Change, changes_of, encode_changes
from relay.store.errors import UnknownStoredStream
from relay.store.manifest import MANIFEST_DIR
from relay.topology import MeshConfig, load

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
MAX_WINDOW = 1_000
SEND_HWM = 2 * MAX_WINDOW  # frames queued per relay connection (more: the send fails)
DEFAULT_SEND_TIMEOUT_S = 30.0  # total time one send may take, all attempts included
DEFAULT_MAX_ATTEMPTS = 30  # attempts (relays asked) per send
DEFAULT_REQUEST_TIMEOUT_S = 5.0  # one attempt without an answer (a relay answers within
#                                   produce_timeout_ms, 2 s by default, with `unknown`)
DEFAULT_CONNECT_GRACE_S = 0.25  # how long a new client waits for its first connections
DEFAULT_MAX_BATCH = 1_000  # entries a consumer asks for at once
DEFAULT_WAIT_MS = 1_000  # a consumer's long poll
BACKOFF_BASE_S = 0.05  # pause after every relay failed once; doubles per round
BACKOFF_MAX_S = 1.0
CONNECT_POLL_S = 0.005  # while connecting: how often a send is tried again
EMPTY_RETRY_S = 0.05  # pause after an empty answer that came early (not a full long poll)
OUT_OF_RANGE_ROUNDS = 5  # rounds over all relays before out_of_range is final anyway
# A relay's `oldest` when its history starts at the stream's genesis (the core's
# GENESIS_POINT; real seqs are flake ids, never 0). Anything above it is a base: the
# history before it is not on that relay.
GENESIS_POINT = 0
MAX_NOTES = 8  # attempt descriptions kept for an error message
DRAIN_MAX = 10_000  # frames taken from one socket per wake
MAX_CACHED_ORDERS = 10_000  # streams whose relay order a producer remembers
NO_BATCH = -1  # an op's batch_rid when its attempt is not in a ProduceBatchReq
# pyzmq's flags are enum members: plain ints skip an enum operation per call.
_NOBLOCK = int(zmq.NOBLOCK)

MAX_U63 = (1 << 63) - 1
MAX_U64 = (1 << 64) - 1
MAX_PRODUCER_ID_BYTES = 64
MAX_STREAM_NAME_BYTES = 255
MAX_READ_ENTRIES = 65_536
MAX_WAIT_MS = 600_000

RelayEndpoints: TypeAlias = Sequence[str] | Mapping[int, str]
TopologySource: TypeAlias = str | Path | MeshConfig
Start: TypeAlias = Literal["earliest", "latest", "snapshot"] | int
StoreSource: TypeAlias = str | os.PathLike[str] | Literal[False] | None
Source: TypeAlias = Literal["store", "relays"]  # where a consumer is reading from
Item: TypeAlias = bytes | tuple[bytes | None, bytes]
SendFn: TypeAlias = Callable[[str, bytes], bool]

_REJECT_TEXT = {
    "late": "a committed prefix past its sequence number left it out",
    "too_large": "the transaction exceeds max_tx_bytes",
    "buffer_full": "the relay's buffer or pending produces are full",
    "invalid": "the relay found the transaction invalid",
    "unknown_stream": "no relay serves the stream",
}


@dataclass(frozen=True, slots=True)
class Record:
    """One committed transaction of a stream, as a consumer yields it."""

    stream: str
    seq: int
    key: bytes | None
    value: bytes
    producer_id: bytes
    producer_seq: int
    kind: int = KIND_PLAIN  # how the value is read: 0 one plain value, 1 a change list

    def changes(self) -> list[Change]:
        """The changes this transaction makes (a plain value is one put of entity "" and
        the record's key); InvalidChanges if its change list does not decode."""
        return changes_of(self.kind, self.key, self.value)


# --- checks ------------------------------------------------------------------------------


def _check_stream(stream: object) -> str:
    if (
        not isinstance(stream, str)
        or not stream
        or "\x00" in stream
        or "|" in stream
        or len(stream.encode("utf-8", "surrogatepass")) > MAX_STREAM_NAME_BYTES
    ):
        raise ValueError(
            f"{stream!r} is not a stream name (1..{MAX_STREAM_NAME_BYTES} UTF-8 bytes, "
            "no NUL or '|')"
        )
    try:
        stream.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{stream!r} is not valid Unicode text") from None
    return stream


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


def _check_range(name: str, value: float, lo: float, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _backoff(rounds: int) -> float:
    return float(min(BACKOFF_MAX_S, BACKOFF_BASE_S * (2 ** min(rounds - 1, 16))))


class _RequestIds:
    """Request ids unique within one client: a random start, then counting."""

    def __init__(self) -> None:
        self._next = int.from_bytes(os.urandom(8), "big") >> 2  # leaves room to count

    def __call__(self) -> int:
        rid = self._next
        self._next = rid + 1 if rid < MAX_U63 else 0
        return rid


# --- where the relays are ----------------------------------------------------------------


class _Relays:
    """The relays a client may talk to: endpoints, relay ids, and the topology if given."""

    def __init__(self, relays: RelayEndpoints | None, topology: TopologySource | None) -> None:
        if (relays is None) == (topology is None):
            raise ValueError("give exactly one of relays=[endpoints] or topology=path|MeshConfig")
        self.config: MeshConfig | None = None
        self.by_id: dict[int, str] = {}
        endpoints: list[str]
        if topology is not None:
            config = topology if isinstance(topology, MeshConfig) else load(topology)
            self.config = config
            self.by_id = {rid: spec.client_endpoint for rid, spec in config.relays.items()}
            endpoints = list(self.by_id.values())
        elif isinstance(relays, Mapping):
            for rid, endpoint in relays.items():
                if isinstance(rid, bool) or not isinstance(rid, int):
                    raise TypeError(f"relay ids must be ints, got {rid!r}")
                if not isinstance(endpoint, str):
                    raise TypeError(f"endpoints must be strings, got {endpoint!r}")
            self.by_id = dict(relays)
            endpoints = list(relays.values())
        else:
            assert relays is not None
            endpoints = [relays] if isinstance(relays, str) else list(relays)
            for endpoint in endpoints:
                if not isinstance(endpoint, str):
                    raise TypeError(f"endpoints must be strings, got {endpoint!r}")
        self.endpoints: tuple[str, ...] = tuple(dict.fromkeys(endpoints))
        if not self.endpoints:
            raise ValueError("no relay endpoint given")
        self.limits = self.config.limits if self.config is not None else Limits()
        # Spread the clients of a topology over the members of a stream.
        self._spin = random.Random(os.urandom(8)).randrange(1 << 16)

    def order(self, stream: str) -> list[str]:
        """The endpoints to try for `stream`: its members first (when the topology is
        known), then the others."""
        if self.config is None:
            return list(self.endpoints)
        members = [self.by_id[r] for r in self.config.members(stream) if r in self.by_id]
        if members:
            cut = self._spin % len(members)
            members = members[cut:] + members[:cut]
        return members + [e for e in self.endpoints if e not in members]

    def redirect(self, ids: Iterable[int]) -> list[str]:
        """The endpoints of the relay ids a relay sent us to (ids we cannot map are
        skipped: without a topology or id map the client just tries the next relay)."""
        return [self.by_id[i] for i in ids if i in self.by_id]


def _prepend(candidates: deque[str], endpoints: Sequence[str], skip: set[str]) -> None:
    fresh = [e for e in dict.fromkeys(endpoints) if e not in skip]
    for endpoint in reversed(fresh):
        if endpoint in candidates:
            candidates.remove(endpoint)
        candidates.appendleft(endpoint)


# --- producing (no I/O: the drivers below feed frames and time in) ----------------------


class _Op:
    """One transaction being produced, across all its attempts. (A plain class with slots:
    one is made per transaction, so it allocates only what every transaction needs.)"""

    __slots__ = (
        "alone",
        "attempts",
        "batch_rid",
        "candidates",
        "deadline",
        "done",
        "due",
        "endpoint",
        "error",
        "item_bytes",
        "key",
        "kind",
        "last_fenced",
        "notes",
        "pseq",
        "retry_same",
        "rid",
        "rids",
        "rounds",
        "saw_unknown",
        "seq",
        "started_at",
        "stream",
        "timer",
        "tried",
        "value",
    )

    def __init__(self, stream: str, key: bytes | None, value: bytes, pseq: int, kind: int) -> None:
        self.stream = stream
        self.key = key
        self.value = value
        self.kind = kind
        self.pseq = pseq
        self.item_bytes = wire.batch_item_bytes(stream, key, value)  # in a batch frame
        self.started_at = 0.0
        self.deadline = 0.0
        self.due = 0.0  # when the op's timer is due (its attempt times out, or retry)
        self.attempts = 0
        self.rounds = 0
        self.saw_unknown = False  # an attempt may have reached a relay without an answer
        self.last_fenced: tuple[int, ...] | None = None  # the last answer's redirect if fenced
        self.candidates: deque[str] = deque()
        # Tuples, not a set and a list: they are rarely more than one item long, and fewer
        # containers per transaction leave the garbage collector less to walk.
        self.tried: tuple[str, ...] = ()  # in this round
        self.endpoint = ""  # of the current or last attempt
        self.rid: int | None = None  # the attempt in flight
        self.rids: tuple[int, ...] = ()  # every attempt's request id
        self.batch_rid = NO_BATCH  # the ProduceBatchReq carrying the attempt in flight
        self.alone = False  # send in a frame of its own (a relay refused its batch)
        self.retry_same = False  # still connecting: send to the same endpoint again
        self.timer: _Timer | None = None  # the op's live timer
        self.notes: deque[str] | None = None  # what went wrong, made on the first failure
        self.done = False
        self.seq = -1
        self.error: ClientError | None = None

    def result(self) -> int:
        if self.error is not None:
            raise self.error
        return self.seq


class _Timer:
    """A timer shared by the ops sent (or paused) together. It lets go of them once none
    waits on it any more: most timers outlive their ops (answered long before the request
    timeout), and should not keep finished ops alive until then."""

    __slots__ = ("ops", "waiting")

    def __init__(self, ops: list[_Op]) -> None:
        self.ops = ops
        self.waiting = len(ops)


def _disarm(op: _Op) -> None:
    timer = op.timer
    if timer is not None:
        op.timer = None
        timer.waiting -= 1
        if not timer.waiting:
            timer.ops = []


class _ProduceEngine:
    """The retry and pipelining rules of a producer, without I/O. Attempts that go to the
    same relay in one step are packed into ProduceBatchReq frames; every transaction keeps
    its own request id (the batch item id), answer, retries and errors."""

    def __init__(
        self,
        relays: _Relays,
        producer_id: bytes,
        first_seq: int,
        *,
        window: int,
        send_timeout_s: float,
        request_timeout_s: float,
        max_attempts: int,
        connect_grace_s: float,
        now: float,
    ) -> None:
        self.relays = relays
        self.producer_id = producer_id
        self.next_seq = first_seq
        self.window = window
        self.send_timeout_s = send_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max_attempts
        self.connect_until = now + connect_grace_s
        self.frame_limit = relays.limits.max_frame_bytes
        # Known limits (from the topology) are checked here; without a topology only the
        # default frame bound is (a relay refuses what its own limits do not allow).
        self.request_limit = (
            wire.request_frame_limit(relays.limits)
            if relays.config is not None
            else relays.limits.max_frame_bytes
        )
        # A batch frame stays within what a relay with these limits (the defaults without
        # a topology) accepts; should a relay still refuse one, its items go alone.
        self.batch_limit_bytes = wire.request_frame_limit(relays.limits)
        self.max_batch_items = min(relays.limits.max_batch_entries, wire.MAX_BATCH_ITEMS)
        self.stats: Counter[str] = Counter()
        self._rid = _RequestIds()
        self._queue: deque[_Op] = deque()  # submitted, not started
        self._live: dict[int, _Op] = {}  # started, not done; by producer seq
        self._by_rid: dict[int, _Op] = {}
        self._batches: dict[int, list[_Op]] = {}  # batch request id -> its ops, until answered
        self._ready: deque[_Op] = deque()  # to attempt at the next step
        # (when, token, timer) for the ops sent (or paused) together; tokens keep the heap
        # from comparing timers
        self._timers: list[tuple[float, int, _Timer]] = []
        self._tokens = itertools.count(1)
        self._completed: list[_Op] = []
        self._preferred: dict[str, str] = {}  # stream -> the endpoint that last committed
        self._orders: dict[str, tuple[str, ...]] = {}  # stream -> endpoints to try, in order

    @property
    def load(self) -> int:
        """Submitted and not done."""
        return len(self._queue) + len(self._live)

    def submit(self, stream: str, key: bytes | None, value: bytes, kind: int = KIND_PLAIN) -> _Op:
        if self.next_seq > MAX_U64:
            raise OverflowError("the producer sequence is exhausted; use a new producer id")
        op = _Op(stream, key, value, self.next_seq, kind)
        self.next_seq += 1
        self._queue.append(op)
        return op

    def take_completed(self) -> list[_Op]:
        done, self._completed = self._completed, []
        return done

    def next_wakeup(self) -> float | None:
        if self._ready or (self._queue and len(self._live) < self.window):
            return 0.0
        return self._timers[0][0] if self._timers else None

    def step(self, now: float, send: SendFn) -> None:
        while self._queue and len(self._live) < self.window:
            op = self._queue.popleft()
            op.started_at = now
            op.deadline = now + self.send_timeout_s
            op.candidates = deque(self._order(op.stream))
            self._live[op.pseq] = op
            self._ready.append(op)
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, timer = heapq.heappop(timers)
            for op in timer.ops:
                if op.done or op.timer is not timer:
                    continue
                _disarm(op)
                if op.due > now:  # shared a timer with ops due earlier
                    self._arm([op])
                    continue
                if op.rid is not None:
                    self.stats["timeouts"] += 1
                    self._failed(op, now, f"{op.endpoint}: no answer in time", unknown=True)
                else:
                    self._ready.append(op)
        ready = self._ready
        while ready:  # a failed send puts ops back, for their next relay
            outbox: dict[str, list[_Op]] = {}
            while ready:
                op = ready.popleft()
                if not op.done:
                    endpoint = self._next_endpoint(op, now)
                    if endpoint:
                        outbox.setdefault(endpoint, []).append(op)
            for endpoint, ops in outbox.items():
                self._send_packed(endpoint, ops, now, send)

    def on_frame(self, endpoint: str, frame: bytes, now: float) -> None:
        try:
            msg = wire.decode(frame, self.frame_limit)
        except FrameError:
            self.stats["bad_frames"] += 1
            return
        kind = type(msg)
        if kind is wire.ProduceBatchResp:
            assert isinstance(msg, wire.ProduceBatchResp)
            for item_id, outcome, seq, reason, redirect in msg.results:
                self._on_answer(endpoint, item_id, outcome, seq, reason, redirect, now)
        elif kind is wire.ProduceResp:
            assert isinstance(msg, wire.ProduceResp)
            rid = msg.request_id
            self._on_answer(endpoint, rid, msg.outcome, msg.seq, msg.reason, msg.redirect, now)
        elif kind is wire.ErrorResp and msg.request_id in self._batches:
            assert isinstance(msg, wire.ErrorResp)
            self._on_batch_refused(endpoint, msg)
        else:
            op = self._by_rid.get(msg.request_id)
            if op is None or op.done:
                self.stats["stale_answers"] += 1
            elif not isinstance(msg, wire.ErrorResp):
                self.stats["bad_frames"] += 1
            elif msg.request_id == op.rid:
                reason = f"invalid ({msg.error}: {msg.message})"
                self._finish(op, error=self._rejected(op, endpoint, reason))

    def on_disconnect(self, endpoint: str, now: float) -> None:
        self.stats["disconnects"] += 1
        for op in list(self._live.values()):
            if op.rid is not None and op.endpoint == endpoint:
                self._failed(op, now, f"{endpoint}: connection lost", unknown=True)

    def abandon(self, why: str) -> None:
        """Finish every message not done yet with `Unknown` (the producer is closing)."""
        for op in [*self._live.values(), *self._queue]:
            if not op.done:
                self._live.setdefault(op.pseq, op)
                error = Unknown(
                    f"stream {op.stream!r} producer seq {op.pseq}: {why} before a definite "
                    "answer; retrying with the same producer id and producer seq is safe"
                )
                self._finish(op, error=error)
        self._queue.clear()

    # --- answers ----------------------------------------------------------------------

    def _on_answer(
        self,
        endpoint: str,
        rid: int,
        outcome: Outcome,
        seq: int,
        reason: str,
        redirect: tuple[int, ...],
        now: float,
    ) -> None:
        op = self._by_rid.get(rid)
        if op is None or op.done:
            self.stats["stale_answers"] += 1
            return
        current = rid == op.rid
        if current:
            self._forget_batch(op)  # the relay took the batch: no ErrorResp can follow
        if outcome is Outcome.COMMITTED:  # from any attempt: the same transaction
            if self._preferred.get(op.stream) != endpoint:
                self._preferred[op.stream] = endpoint
                self._orders.pop(op.stream, None)
            self._finish(op, seq=seq)
        elif not current:
            self.stats["stale_answers"] += 1
            if outcome is Outcome.UNKNOWN:
                op.saw_unknown = True
        elif outcome is Outcome.REJECTED:
            self._finish(op, error=self._rejected(op, endpoint, reason))
        elif outcome is Outcome.FENCED:
            self.stats["fenced"] += 1
            note = f"{endpoint}: fenced"
            self._failed(op, now, note, unknown=False, redirect=redirect, fenced=True)
        else:
            self.stats["unknown"] += 1
            self._failed(op, now, f"{endpoint}: unknown", unknown=True)

    def _on_batch_refused(self, endpoint: str, error: wire.ErrorResp) -> None:
        """A relay refused a whole ProduceBatchReq (it changed nothing): send each of its
        transactions again on its own, to the same relay, so that only what the relay
        refuses alone is rejected (e.g. it allows fewer items per batch than we assumed)."""
        batch_rid = error.request_id
        self.stats["batches_refused"] += 1
        for op in self._batches.pop(batch_rid, ()):
            if op.done or op.batch_rid != batch_rid:
                continue
            op.batch_rid = NO_BATCH
            op.rid = None
            _disarm(op)
            op.attempts -= 1  # not an attempt: the relay did not look at the transaction
            op.alone = True
            op.retry_same = True
            self._ready.append(op)

    def _forget_batch(self, op: _Op) -> None:
        if op.batch_rid != NO_BATCH:
            self._batches.pop(op.batch_rid, None)
            op.batch_rid = NO_BATCH

    # --- attempts ---------------------------------------------------------------------

    def _order(self, stream: str) -> tuple[str, ...]:
        order = self._orders.get(stream)
        if order is None:
            relays = self.relays.order(stream)
            preferred = self._preferred.get(stream)
            if preferred in relays:
                i = relays.index(preferred)
                relays = relays[i:] + relays[:i]
            order = tuple(relays)
            if len(self._orders) < MAX_CACHED_ORDERS:
                self._orders[stream] = order
        return order

    def _arm(self, ops: list[_Op]) -> None:
        """One timer for `ops`, due when the first of them is (`op.due`)."""
        timer = _Timer(ops)
        when = ops[0].due
        for op in ops:
            op.timer = timer
            if op.due < when:
                when = op.due
        heapq.heappush(self._timers, (when, next(self._tokens), timer))

    def _next_endpoint(self, op: _Op, now: float) -> str:
        """The relay for the op's next attempt ("" if it has run out of attempts)."""
        if now >= op.deadline or op.attempts >= self.max_attempts:
            self._finish(op, error=self._exhausted(op, now))
            return ""
        if not (op.retry_same and op.endpoint):
            op.endpoint = op.candidates.popleft()
            op.tried += (op.endpoint,)
        op.retry_same = False
        return op.endpoint

    def _send_packed(self, endpoint: str, ops: list[_Op], now: float, send: SendFn) -> None:
        """Send `ops` to `endpoint` in as few frames as the batch bounds allow."""
        batch: list[_Op] = []
        size = wire.BATCH_FRAME_OVERHEAD_BYTES
        for op in ops:
            if op.alone or op.item_bytes + wire.BATCH_FRAME_OVERHEAD_BYTES > self.batch_limit_bytes:
                self._send_frame(endpoint, [op], now, send)
                continue
            if batch and (
                len(batch) >= self.max_batch_items or size + op.item_bytes > self.batch_limit_bytes
            ):
                self._send_frame(endpoint, batch, now, send)
                batch = []
                size = wire.BATCH_FRAME_OVERHEAD_BYTES
            batch.append(op)
            size += op.item_bytes
        if batch:
            self._send_frame(endpoint, batch, now, send)

    def _send_frame(self, endpoint: str, ops: list[_Op], now: float, send: SendFn) -> None:
        """One attempt of every op in `ops`: a ProduceReq for one, else a ProduceBatchReq."""
        batch_rid = NO_BATCH
        if len(ops) == 1:
            op = ops[0]
            rids = [self._rid()]
            req = wire.ProduceReq(
                rids[0], op.stream, self.producer_id, op.pseq, op.key, op.value, op.kind
            )
            frame = wire.encode(req)
            if len(frame) > self.request_limit:
                reason = f"too_large (a {len(frame)}-byte request frame)"
                self._finish(op, error=self._rejected(op, "the client", reason))
                return
        else:
            batch_rid = self._rid()
            rids = [self._rid() for _ in ops]
            items = tuple(
                (rid, op.stream, op.pseq, op.key, op.value, op.kind)
                for rid, op in zip(rids, ops, strict=True)
            )
            frame = wire.encode(wire.ProduceBatchReq(batch_rid, self.producer_id, items))
        if not send(endpoint, frame):
            if now < self.connect_until:  # the first connections are still being made
                for op in ops:
                    op.retry_same = True
                    op.due = now + CONNECT_POLL_S
                self._arm(ops)
                return
            self.stats["unreachable"] += len(ops)
            for op in ops:
                op.attempts += 1
                self._failed(op, now, f"{endpoint}: not connected", unknown=False)
            return
        stats = self.stats
        stats["frames"] += 1
        stats["attempts"] += len(ops)
        if batch_rid != NO_BATCH:
            stats["batches"] += 1
            self._batches[batch_rid] = ops
        by_rid = self._by_rid
        timeout_at = now + self.request_timeout_s
        retries = 0
        for op, rid in zip(ops, rids, strict=True):
            op.attempts += 1
            if op.attempts > 1:
                retries += 1
            op.rid = rid
            op.rids += (rid,)
            op.batch_rid = batch_rid
            by_rid[rid] = op
            op.due = timeout_at if timeout_at < op.deadline else op.deadline
        if retries:
            stats["retries"] += retries
        self._arm(ops)

    def _failed(
        self,
        op: _Op,
        now: float,
        note: str,
        *,
        unknown: bool,
        redirect: tuple[int, ...] = (),
        fenced: bool = False,
    ) -> None:
        """The current attempt failed: go on with the next relay (redirects first)."""
        self._forget_batch(op)
        op.rid = None
        _disarm(op)
        if op.notes is None:
            op.notes = deque(maxlen=MAX_NOTES)
        op.notes.append(note)
        op.saw_unknown = op.saw_unknown or unknown
        op.last_fenced = redirect if fenced else None
        if self._preferred.get(op.stream) == op.endpoint:
            del self._preferred[op.stream]
            self._orders.pop(op.stream, None)
        _prepend(op.candidates, self.relays.redirect(redirect), {*op.tried, op.endpoint})
        if op.candidates:
            self._ready.append(op)
            return
        # Every relay was tried in this round: pause, then start over.
        op.rounds += 1
        op.tried = ()
        op.candidates = deque(self._order(op.stream))
        op.due = min(now + _backoff(op.rounds), op.deadline)
        self._arm([op])

    def _finish(self, op: _Op, *, seq: int = -1, error: ClientError | None = None) -> None:
        self._forget_batch(op)
        op.done = True
        op.seq = seq
        op.error = error
        op.rid = None
        _disarm(op)
        op.value = b""  # the caller has it; do not keep it twice
        by_rid = self._by_rid
        for rid in op.rids:
            by_rid.pop(rid, None)
        self._live.pop(op.pseq, None)
        self.stats["committed" if error is None else "failed"] += 1
        self._completed.append(op)

    def _what(self, op: _Op) -> str:
        return f"stream {op.stream!r} producer seq {op.pseq}"

    def _rejected(self, op: _Op, endpoint: str, reason: str) -> ClientError:
        name = reason.split(" ", 1)[0]
        text = _REJECT_TEXT.get(name, "")
        detail = f"rejected ({reason}) by {endpoint}" + (f": {text}" if text else "")
        if op.saw_unknown:
            return Unknown(
                f"{self._what(op)}: {detail}, but an earlier attempt ended without a definite "
                "answer and that copy may still commit; retrying with the same producer id "
                "and producer seq is safe"
            )
        if name == "unknown_stream":
            return UnknownStream(f"{self._what(op)}: {detail}")
        return Rejected(f"{self._what(op)}: {detail}; this copy will never be delivered")

    def _exhausted(self, op: _Op, now: float) -> ClientError:
        notes = "; ".join(op.notes or ()) or "none sent"
        why = (
            f"after {op.attempts} attempt{'s' if op.attempts != 1 else ''} in "
            f"{now - op.started_at:.1f} s ({notes})"
        )
        if op.saw_unknown:
            return Unknown(
                f"{self._what(op)}: no definite answer {why}; retrying with the same "
                "producer id and producer seq is safe"
            )
        if op.last_fenced is not None:
            return Fenced(
                f"{self._what(op)}: no relay could take it {why}; the last relay was fenced "
                "(it cannot reach a quorum)",
                redirect_to=op.last_fenced,
            )
        return Unknown(f"{self._what(op)}: no relay reachable {why}; it was not sent")


# --- consuming (no I/O) ------------------------------------------------------------------

# Answers after which a relay cannot serve the position now (anything but fenced and
# not_ready, which may clear): a round made only of these, with at least one out_of_range,
# makes out_of_range final.
_NOT_SERVING = frozenset({"out_of_range", "redirect", "unreachable", "timeout", "disconnected"})


@dataclass(frozen=True, slots=True, eq=False)
class _StoreRead:
    """A read of the store the engine asks its driver for: the stored records after
    `after_seq`, the manifest refreshed first when `refresh` (the first read at a new
    position: an ingest may have moved the store on since)."""

    after_seq: int
    refresh: bool


@dataclass(frozen=True, slots=True)
class _StoreBatch:
    """What the driver read for a _StoreRead: at most max_batch records, in seq order."""

    request: _StoreRead
    records: list[Record]
    store_last: int | None  # the store's last seq of the stream; None: it holds none
    exhausted: bool  # no stored record of that manifest is left after `records`


class _ReadEngine:
    """One consumer's reading rules (long poll, fail-over, resume, the store when the
    relays cannot serve), without I/O: frames, store batches and time come in."""

    def __init__(
        self,
        relays: _Relays,
        *,
        max_batch: int,
        wait_ms: int,
        request_timeout_s: float,
        connect_grace_s: float,
        now: float,
        store_path: str | None = None,
    ) -> None:
        self.relays = relays
        self.max_batch = max_batch
        self.wait_ms = wait_ms
        self.request_timeout_s = request_timeout_s
        self.connect_until = now + connect_grace_s
        self.frame_limit = relays.limits.max_frame_bytes
        self.store_path = store_path  # None: no store, the relays only
        self.stats: Counter[str] = Counter()
        self.records: deque[Record] = deque()
        self.error: ClientError | None = None
        self.stream: str | None = None
        self.last: int | None = -1  # None: "latest", not resolved yet
        self.endpoint: str | None = None  # the relay being read from
        self.oldest_available: int | None = None
        self.source: Source = "relays"
        self.store_end: int | None = None  # the store's last seq of the stream, as last read
        self._rid_source = _RequestIds()
        self._rid: int | None = None
        self._sent_at = 0.0
        self._deadline = 0.0
        self._timer: float | None = None
        self._candidates: deque[str] = deque()
        self._tried: set[str] = set()
        self._round: dict[str, str] = {}  # endpoint -> what it answered in this round
        self._oldest: dict[str, int] = {}  # endpoint -> its oldest readable position
        self._rounds = 0
        self._notes: deque[str] = deque(maxlen=MAX_NOTES)
        self._store_read: _StoreRead | None = None  # asked of the driver, not answered yet
        self._store_from = -1  # the position the current store episode started at
        self._store_asked_at: int | None = None  # position the store was asked at this round

    def subscribe(self, stream: str, start: Start, *, from_store: bool = False) -> None:
        """Start reading `stream`. "snapshot" here means "earliest": the consumer resolves a
        snapshot to its seq (with `from_store`: read the store after it first)."""
        _check_stream(stream)
        last: int | None
        if start in ("earliest", "snapshot"):
            last = -1
            from_store = self.store_path is not None  # the whole history: the store first
        elif start == "latest":
            last = None
        elif isinstance(start, int) and not isinstance(start, bool):
            if not -1 <= start <= MAX_U63:
                raise ValueError(f"start must be -1..2**63-1, got {start}")
            last = start
        else:
            raise ValueError(
                f"start must be 'earliest', 'latest', 'snapshot' or a seq, got {start!r}"
            )
        self.stream = stream
        self.last = last
        self.records.clear()
        self.error = None
        self.endpoint = None
        self.oldest_available = None
        self.source = "relays"
        self.store_end = None
        self._rid = None
        self._timer = None
        self._candidates = deque(self.relays.order(stream))
        self._tried.clear()
        self._round.clear()
        self._oldest.clear()
        self._rounds = 0
        self._store_read = None
        self._store_asked_at = None
        if from_store:
            self._ask_store()

    @property
    def store_request(self) -> _StoreRead | None:
        """The store read the driver should do now. Flow control as for relays: asked only
        once the records read before were consumed."""
        if self.records or self.error is not None:
            return None
        return self._store_read

    def next_wakeup(self) -> float | None:
        if self._rid is not None:
            return self._deadline
        return self._timer

    def step(self, now: float, send: SendFn) -> None:
        # Flow control: nothing is asked while records wait to be consumed.
        if self.stream is None or self.error is not None or self.records:
            return
        if self._store_read is not None:  # the relays wait until the store was read
            return
        if self._rid is not None:
            if now < self._deadline:
                return
            self.stats["timeouts"] += 1
            self._leave(now, "timeout", f"{self.endpoint}: no answer in time")
        if self._timer is not None:
            if now < self._timer:
                return
            self._timer = None
        while self.error is None and self._timer is None:
            if self.endpoint is None:
                self.endpoint = self._pick(now)
                if self.endpoint is None:
                    return
            rid = self._rid_source()
            if self.last is None:  # "latest": learn the committed point first
                req = wire.ReadReq(rid, self.stream, -1, 1, 0)
                wait_s = 0.0
            else:
                req = wire.ReadReq(rid, self.stream, self.last, self.max_batch, self.wait_ms)
                wait_s = self.wait_ms / 1000
            if send(self.endpoint, wire.encode(req)):
                self.stats["reads"] += 1
                self._rid = rid
                self._sent_at = now
                self._deadline = now + wait_s + self.request_timeout_s
                return
            if now < self.connect_until:
                self._timer = now + CONNECT_POLL_S
                return
            self.stats["unreachable"] += 1
            self._leave(now, "unreachable", f"{self.endpoint}: not connected")

    def on_frame(self, endpoint: str, frame: bytes, now: float) -> None:
        try:
            msg = wire.decode(frame, self.frame_limit)
        except FrameError:
            self.stats["bad_frames"] += 1
            return
        if self._rid is None or msg.request_id != self._rid or endpoint != self.endpoint:
            self.stats["stale_answers"] += 1
            return
        self._rid = None
        stream = self.stream
        if isinstance(msg, wire.ErrorResp):
            self.error = Rejected(
                f"stream {stream!r}: {endpoint} refused the read: {msg.error}: {msg.message}"
            )
            return
        if not isinstance(msg, wire.ReadResp):
            self.stats["bad_frames"] += 1
            self._leave(now, "timeout", f"{endpoint}: answered {type(msg).__name__}")
            return
        status = msg.status
        if status is ReadStatus.OK:
            if self.last == -1 and msg.oldest > GENESIS_POINT and self.store_path is not None:
                # From the beginning, a relay serves what it holds after its base (after a
                # restart from the store's last point, or a rebase): the history before it
                # must come from the store or another relay. (Without a store "earliest"
                # means the oldest entry held, as it always did.)
                self._cannot_serve(
                    endpoint,
                    msg.oldest,
                    now,
                    f"{endpoint}: its history starts after seq {msg.oldest}",
                )
                return
            self._good(endpoint)
            if self.last is None:
                self.last = max(msg.committed, -1)
                return
            assert stream is not None
            last = self.last
            for seq, key, value, pid, pseq, kind in msg.entries:
                if seq > last:  # never a seq at or below one already yielded
                    self.records.append(Record(stream, seq, key, value, pid, pseq, kind))
                    last = seq
                else:
                    self.stats["dropped_old_entries"] += 1
            self.last = last
            early = max(self.wait_ms / 2000, EMPTY_RETRY_S)
            if not self.records and now - self._sent_at < early:
                self._timer = now + EMPTY_RETRY_S  # answered early and empty: do not spin
        elif status is ReadStatus.UNKNOWN_STREAM:
            self.error = UnknownStream(f"stream {stream!r}: no relay serves it ({endpoint})")
        elif status is ReadStatus.OUT_OF_RANGE:
            note = f"{endpoint}: out_of_range (oldest {msg.oldest})"
            self._cannot_serve(endpoint, msg.oldest, now, note)
        else:  # redirect, fenced, not_ready
            self.stats[status.value] += 1
            self._leave(now, status.value, f"{endpoint}: {status.value}", msg.redirect)

    def on_disconnect(self, endpoint: str, now: float) -> None:
        self.stats["disconnects"] += 1
        if self._rid is not None and endpoint == self.endpoint:
            self._leave(now, "disconnected", f"{endpoint}: connection lost")

    def on_store_batch(self, batch: _StoreBatch) -> None:
        """The driver's answer to `store_request`."""
        if batch.request is not self._store_read:  # asked before a new subscribe
            self.stats["stale_store_batches"] += 1
            return
        self._store_read = None
        self.stats["store_reads"] += 1
        self.store_end = batch.store_last
        assert self.last is not None  # the store is asked only at a known position
        self.records.extend(batch.records)  # each after the position: the reader's promise
        self.stats["stored_records"] += len(batch.records)
        last = batch.records[-1].seq if batch.records else self.last
        if not batch.exhausted:
            self.last = last
            self._store_read = _StoreRead(last, refresh=False)
            return
        # Every stored record was read: the relays carry on after the store's last point.
        # (Readers skip a duplicate there, as relays do, so no record may carry that seq.)
        if batch.store_last is not None:
            last = max(last, batch.store_last)
        self.last = last
        self.source = "relays"
        if last > self._store_from:  # progress: every relay may serve the new position
            self._rounds = 0
            self._round.clear()
            self._oldest.clear()
            self._tried.clear()
            assert self.stream is not None
            self._candidates = deque(self.relays.order(self.stream))
        # Otherwise the store could not serve the position either: the fail-over goes on.

    # --- fail-over --------------------------------------------------------------------

    def _good(self, endpoint: str) -> None:
        if self._round or self._rounds:
            self._rounds = 0
            self._round.clear()
            self._oldest.clear()
        self._tried = {endpoint}
        assert self.stream is not None
        # Should this relay fail: every other relay, then (after a pause) all again.
        self._candidates = deque(e for e in self.relays.order(self.stream) if e != endpoint)

    def _leave(self, now: float, status: str, note: str, redirect: Sequence[int] = ()) -> None:
        endpoint = self.endpoint
        self.endpoint = None
        self._rid = None
        if endpoint is not None:
            self._round[endpoint] = status
            self.stats["failovers"] += 1
        self._notes.append(note)
        _prepend(self._candidates, self.relays.redirect(redirect), self._tried)

    def _cannot_serve(self, endpoint: str, oldest: int, now: float, note: str) -> None:
        """`endpoint` holds nothing at or before the position (its history starts after
        `oldest`): try the store, then the other relays."""
        self.stats["out_of_range"] += 1
        self._oldest[endpoint] = oldest
        self._leave(now, "out_of_range", note)
        self._ask_store()

    def _ask_store(self) -> None:
        """Ask the driver for the stored records after the position, unless there is no
        store or it was asked at this position in this round already (one manifest
        refresh per round is enough to notice an ingest)."""
        if self.store_path is None or self.last is None or self._store_asked_at == self.last:
            return
        self._store_asked_at = self._store_from = self.last
        self._store_read = _StoreRead(self.last, refresh=True)
        self.source = "store"

    def _pick(self, now: float) -> str | None:
        if self._candidates:
            endpoint = self._candidates.popleft()
            self._tried.add(endpoint)
            return endpoint
        # A round is over: every relay was tried since the last good answer.
        self._rounds += 1
        if self._oldest and (
            all(s in _NOT_SERVING for s in self._round.values())
            or self._rounds >= OUT_OF_RANGE_ROUNDS
        ):
            oldest = min(self._oldest.values())
            self.oldest_available = oldest
            self.error = OutOfRange(
                f"stream {self.stream!r}: no relay still holds the entries after seq "
                f"{self.last} ({'; '.join(self._notes)}){self._store_text()}; the oldest "
                f"position that can be read is after seq {oldest} (subscribe with "
                f"start={oldest} to resume there)"
            )
            return None
        assert self.stream is not None
        self._candidates = deque(self.relays.order(self.stream))
        self._tried.clear()
        self._round.clear()
        self._store_asked_at = None
        self._timer = now + _backoff(self._rounds)
        return None

    def _store_text(self) -> str:
        """For OutOfRange: where the store ends, if there is one."""
        if self.store_path is None:
            return ""
        if self.store_end is None:
            return f", and the store at {self.store_path} holds no records of the stream"
        return f", and the store at {self.store_path} ends at seq {self.store_end}"


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


class _Links:
    """A DEALER (plus a monitor for lost connections) per relay endpoint, and a waiter on
    all of them; the drain logic shared by both flavours. `shadow`: the context is an
    asyncio one, whose sockets are used through their plain views."""

    def __init__(self, ctx: Any, endpoints: Sequence[str], shadow: bool) -> None:
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
            for _ in range(DRAIN_MAX):
                try:
                    frame = sock.recv(_NOBLOCK)
                except zmq.Again:
                    break
                engine.on_frame(endpoint, frame, now)

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
    def __init__(self, endpoints: Sequence[str]) -> None:
        super().__init__(zmq.Context(), endpoints, shadow=False)

    def wait(self, engine: _Engine, timeout_s: float | None) -> None:
        """Wait up to `timeout_s` (None: until something arrives) and feed the engine."""
        timeout_ms = -1 if timeout_s is None else max(0, int(timeout_s * 1000 + 0.999))
        readable = self.waiter.poll(timeout_ms)
        if readable:
            self.drain(engine, time.monotonic(), readable)


class _AsyncLinks(_Links):
    """Waits through the event loop (`ReadableWaiter.wait`); a producer's wake-up future
    ends the wait too."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        super().__init__(zmq.asyncio.Context(), endpoints, shadow=True)

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
    ) -> None:
        pid = _check_producer_args(
            producer_id,
            first_producer_seq,
            window,
            send_timeout_s,
            request_timeout_s,
            max_attempts,
            connect_grace_s,
        )
        self._relays = _Relays(relays, topology)
        self._window = int(window)
        self._closed = False
        self._engine = _ProduceEngine(
            self._relays,
            pid,
            first_producer_seq,
            window=self._window,
            send_timeout_s=send_timeout_s,
            request_timeout_s=request_timeout_s,
            max_attempts=max_attempts,
            connect_grace_s=connect_grace_s,
            now=time.monotonic(),
        )
        self._links: _L = self._links_type(self._relays.endpoints)
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
        self._check_open()
        _check_stream(stream)
        key, value = _check_tx(key, value)
        op = self._engine.submit(stream, key, value, _check_kind(kind))
        self._run(lambda: op.done)
        return op.result()

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
        _check_stream(stream)
        items = iter(values)
        # Results by position, and only the unsettled transactions by op: a settled one
        # is let go at once (a long send_many would otherwise keep every op alive, and
        # the garbage collector would walk them all again and again).
        results: list[int | ClientError] = []
        unsettled: dict[_Op, int] = {}
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

        def settle(ops: list[_Op]) -> None:
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
        settle: Callable[[list[_Op]], None] | None = None,
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


class AsyncProducer(_ProducerBase[_AsyncLinks]):
    """An asyncio producer. Many tasks may send at once; at most `window` transactions
    are in flight (`send_async` waits for room, then returns a future)."""

    _links_type = _AsyncLinks

    def _start(self) -> None:
        self._slots = asyncio.Semaphore(self._window)
        self._futures: dict[_Op, asyncio.Future[int]] = {}
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
        _check_stream(stream)
        key, value = _check_tx(key, value)
        _check_kind(kind)
        await self._slots.acquire()
        if self._closed or self._broken is not None:
            self._slots.release()
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
            self._slots.release()
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

    def __init__(self, path: Path) -> None:
        try:
            from relay.store.reader import StoreReader
        except ImportError as error:
            raise ImportError(
                f"reading the store at {path} needs pyarrow ({error}): install the store "
                "extra (pip install 'relay[store]'), or pass store=False"
            ) from error
        self.path = path
        self._reader: StoreReader = StoreReader(path)
        self._records: Iterator[StoredRecord] | None = None  # the read being continued
        self._stream = ""  # ... of this stream
        self._after = -1  # ... which continues after this seq
        self._last_seq = -1  # ... and ends at this seq (its manifest's last point)

    def read(self, stream: str, request: _StoreRead, max_records: int) -> _StoreBatch:
        records = self._records
        if (
            records is None
            or request.refresh
            or stream != self._stream
            or request.after_seq != self._after
        ):
            if request.refresh:
                self._reader.refresh()
            point = self._reader.last_points().get(stream)
            if point is None or point.seq <= request.after_seq:
                self._records = None
                return _StoreBatch(request, [], None if point is None else point.seq, True)
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
        return _StoreBatch(request, batch, self._last_seq, exhausted)

    def snapshot(self, stream: str) -> StoredSnapshot | None:
        """The latest snapshot of `stream` (None: none yet, or the stream is not stored)."""
        self._reader.refresh()
        try:
            return self._reader.snapshot(stream)
        except UnknownStoredStream:
            return None


def ingested_store(config: MeshConfig) -> Path | None:
    """The topology's store_dir once a store was ingested there (it has a manifest
    folder), else None: the store a consumer of that topology reads by default."""
    return config.store_dir if (config.store_dir / MANIFEST_DIR).is_dir() else None


def _open_store(store: StoreSource, config: MeshConfig | None) -> _StoreFeed | None:
    """The store a consumer reads: `store` False none, a path that store, None the
    topology's ingested store (`ingested_store`)."""
    if store is False:
        return None
    if store is None:
        path = None if config is None else ingested_store(config)
        return None if path is None else _StoreFeed(path)
    if isinstance(store, bool) or not isinstance(store, str | os.PathLike):
        raise TypeError(f"store must be a path, None or False, got {store!r}")
    return _StoreFeed(Path(store))


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
    ) -> None:
        _check_range("max_batch", max_batch, 1, MAX_READ_ENTRIES)
        _check_range("wait_ms", wait_ms, 0, MAX_WAIT_MS)
        _check_range("request_timeout_s", request_timeout_s, 0.001)
        _check_range("connect_grace_s", connect_grace_s, 0)
        if timeout_s is not None:
            _check_range("timeout_s", timeout_s, 0)
        if count is not None:
            _check_range("count", count, 0)
        self._relays = _Relays(relays, topology)
        self._store = _open_store(store, self._relays.config)
        self._snapshot: StoredSnapshot | None = None
        self._timeout_s = timeout_s
        self._count = count
        self._yielded = 0
        self._closed = False
        self._engine = _ReadEngine(
            self._relays,
            max_batch=int(max_batch),
            wait_ms=int(wait_ms),
            request_timeout_s=request_timeout_s,
            connect_grace_s=connect_grace_s,
            now=time.monotonic(),
            store_path=None if self._store is None else str(self._store.path),
        )
        self._links: _L = self._links_type(self._relays.endpoints)

    def _subscribe(self, stream: str, start: Start) -> None:
        if self._closed:
            raise RuntimeError("the consumer is closed")
        snapshot = None
        if start == "snapshot":
            if self._store is None:
                raise ValueError(
                    "start='snapshot' needs a store: pass store=path, or a topology whose "
                    "store_dir holds one (relay store ingest)"
                )
            snapshot = self._store.snapshot(_check_stream(stream))
        if snapshot is None:
            self._engine.subscribe(stream, start)
        else:  # the records after the snapshot: the store's first, then the relays'
            self._engine.subscribe(stream, snapshot.seq, from_store=True)
        self._snapshot = snapshot
        self._yielded = 0

    def _store_reading(self, request: _StoreRead) -> Callable[[], _StoreBatch]:
        """The store read the engine asked for, to run (it blocks) here or in a thread."""
        stream = self._engine.stream
        assert self._store is not None and stream is not None  # asked only with a store
        return functools.partial(self._store.read, stream, request, self._engine.max_batch)

    @property
    def stream(self) -> str | None:
        return self._engine.stream

    @property
    def position(self) -> int | None:
        """The last seq yielded (or the start position); resume with start=position.
        None while a "latest" start is not resolved yet."""
        return self._engine.last if not self._engine.records else self._engine.records[0].seq - 1

    @property
    def endpoint(self) -> str | None:
        """The relay being read from (None between relays, and while reading the store)."""
        return self._engine.endpoint

    @property
    def source(self) -> Source:
        """Where the records come from now: "store" or "relays"."""
        return self._engine.source

    @property
    def snapshot(self) -> StoredSnapshot | None:
        """After subscribe(stream, "snapshot"): the snapshot loaded (seq, digest, rows: a
        pyarrow Table of entity, key, value, seq); the records yielded are those after its
        seq. None for other starts, or when the stream had no snapshot yet."""
        return self._snapshot

    @property
    def oldest_available(self) -> int | None:
        """After OutOfRange: the oldest position any relay can still serve."""
        return self._engine.oldest_available

    @property
    def stats(self) -> Counter[str]:
        """Counters: reads, failovers, timeouts, unreachable, fenced, redirect,
        out_of_range, store_reads, stored_records (yielded from the store), ..."""
        return self._engine.stats

    def _take(self) -> Record | None:
        """The next record if one is buffered; raises the engine's error if any."""
        engine = self._engine
        if engine.stream is None:
            raise RuntimeError("subscribe(stream) first")
        if engine.records:
            self._yielded += 1
            return engine.records.popleft()
        if engine.error is not None:
            raise engine.error
        return None

    def _finished(self) -> bool:
        return self._closed or (self._count is not None and self._yielded >= self._count)


class Consumer(_ConsumerBase[_SyncLinks]):
    """A synchronous consumer of one stream: `subscribe`, then iterate over `Record`s.

    `store`: the persistent store that serves the history the relays no longer hold (a
    path; by default the topology's store_dir if a store was ingested there; False:
    never). Iteration ends after `count` records (counted from the last `subscribe`), or
    when one `next()` waited `timeout_s` seconds without a record (both optional; by
    default it waits forever). Errors: UnknownStream, OutOfRange (see
    `oldest_available`), Rejected (a relay refused the request frame), StoreError (the
    store is unreadable)."""

    _links_type = _SyncLinks

    def subscribe(self, stream: str, start: Start = "earliest") -> Consumer:
        """Read `stream` from `start`: "earliest" (the whole history, the store's first),
        "latest" (what commits from now on), a position (a seq: records after it), or
        "snapshot" (the latest stored snapshot, see `snapshot`, then the records after
        it; ValueError without a store)."""
        self._subscribe(stream, start)
        return self

    def __iter__(self) -> Consumer:
        return self

    def __next__(self) -> Record:
        if self._finished():
            raise StopIteration
        engine, links = self._engine, self._links
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        while True:
            record = self._take()
            if record is not None:
                return record
            request = engine.store_request
            if request is not None:
                engine.on_store_batch(self._store_reading(request)())
                continue
            now = time.monotonic()
            engine.step(now, links.send)
            if engine.records or engine.error is not None:
                continue
            if deadline is not None and now >= deadline:
                raise StopIteration
            wake = engine.next_wakeup()
            limits = [t - now for t in (wake, deadline) if t is not None]
            links.wait(engine, max(0.0, min(limits)) if limits else None)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._links.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class AsyncConsumer(_ConsumerBase[_AsyncLinks]):
    """The asyncio consumer: `subscribe`, then `async for record in consumer`. Store reads
    run in a worker thread, so they do not hold up the event loop."""

    _links_type = _AsyncLinks
    # A store read under way in its thread (it cannot be cancelled): awaited again by the
    # next __anext__ when the one that started it was cancelled, so the store is never
    # read by two threads at once.
    _store_read_under_way: asyncio.Future[_StoreBatch] | None = None

    def subscribe(self, stream: str, start: Start = "earliest") -> AsyncConsumer:
        """Like Consumer.subscribe (reading a snapshot blocks while it loads)."""
        self._subscribe(stream, start)
        return self

    def __aiter__(self) -> AsyncConsumer:
        return self

    async def __anext__(self) -> Record:
        if self._finished():
            raise StopAsyncIteration
        engine, links = self._engine, self._links
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        while True:
            record = self._take()
            if record is not None:
                return record
            request = engine.store_request
            if request is not None or self._store_read_under_way is not None:
                await self._read_store_in_thread(request)
                continue
            now = time.monotonic()
            engine.step(now, links.send)
            if engine.records or engine.error is not None:
                continue
            if deadline is not None and now >= deadline:
                raise StopAsyncIteration
            wake = engine.next_wakeup()
            limits = [t - now for t in (wake, deadline) if t is not None]
            await links.wait(engine, max(0.0, min(limits)) if limits else None)

    async def _read_store_in_thread(self, request: _StoreRead | None) -> None:
        reading = self._store_read_under_way
        if reading is None:
            assert request is not None
            reading = asyncio.ensure_future(asyncio.to_thread(self._store_reading(request)))
            self._store_read_under_way = reading
        try:
            batch = await asyncio.shield(reading)
        finally:
            if reading.done():
                self._store_read_under_way = None
        self._engine.on_store_batch(batch)  # a read begun before a new subscribe is dropped

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._links.close()

    async def __aenter__(self) -> AsyncConsumer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
