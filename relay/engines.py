"""The client's rules, without I/O: how a producer retries, pipelines and batches, and how
a consumer long-polls, fails over, resumes and hands over between the store and the relays.

The socket clients (relay/client.py) and the simulator's clients (relay/sim/clients.py)
drive these same engines: frames and time come in (`on_frame`, `on_disconnect`, `step`
with seconds of a monotonic clock), frames go out through a `send(endpoint, frame)`
callback that returns False when the endpoint cannot take it now (not connected). Nothing
here reads a clock, draws a random number or touches a socket: a client's randomness (its
first request id, where it starts among a stream's members) comes in with its
construction. The rules themselves are documented in relay/client.py.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, TypeAlias

import msgspec

from relay import wire
from relay.access import pattern_matches
from relay.core import Limits, Outcome, ReadStatus, RejectReason
from relay.core.fields import MAX_STREAM_NAME_BYTES, MAX_U63, MAX_U64
from relay.core.seq import EPOCH_MS, MAX_MS, compose
from relay.core.structs import IdentityStruct
from relay.errors import (
    BufferFull,
    ClientError,
    Fenced,
    FrameError,
    NotAuthorized,
    OutOfRange,
    Rejected,
    SlowConsumer,
    StoreBacklogFull,
    TooManyStreams,
    Unknown,
    UnknownStream,
)
from relay.meta import METADATA_STREAM
from relay.store.changes import KIND_PLAIN, Change, changes_of
from relay.topology import pattern_refusal

BACKOFF_BASE_S = 0.05  # pause after every relay failed once; doubles per round
BACKOFF_MAX_S = 1.0
CONNECT_POLL_S = 0.005  # while connecting: how often a send is tried again
EMPTY_RETRY_S = 0.05  # pause after an empty answer that came early (not a full long poll)
# How long out_of_range answers may meet relays answering `fenced` or `not_ready` (which
# may hold the position, once they can serve again: a relay of the stream waiting for its
# quorum, as while a change of its relays goes on) before out_of_range is final anyway.
OUT_OF_RANGE_WAIT_S = 60.0
# A relay's `oldest` when its history starts at the stream's genesis (the core's
# GENESIS_POINT; real seqs are flake ids, never 0). Anything above it is a base: the
# history before it is not on that relay.
GENESIS_POINT = 0
MAX_NOTES = 8  # attempt descriptions kept for an error message
MAX_CACHED_ORDERS = 10_000  # streams whose relay order a producer remembers
NO_BATCH = -1  # an op's batch_rid when its attempt is not in a ProduceBatchReq

Start: TypeAlias = Literal["earliest", "latest", "snapshot"] | int
Source: TypeAlias = Literal["store", "relays"]  # where a consumer is reading from
SendFn: TypeAlias = Callable[[str, bytes], bool]

_REJECT_TEXT = {
    "late": "a committed prefix past its sequence number left it out",
    "too_large": "the transaction exceeds max_tx_bytes",
    "buffer_full": "the relay's buffer or pending produces are full; retry later",
    "invalid": "the relay found the transaction invalid",
    "unknown_stream": "no relay serves the stream",
    "duplicate_mismatch": "another transaction already holds this producer id and producer seq",
    "too_many_streams": "the relay would have to open a stream beyond its bounds",
    "store_backlog_full": "fewer than a quorum of the stream's relays can spool more until "
    "the store ingests their spools; retry later",
}

# Rejections that are back-pressure, not final: that relay took nothing and will have room
# again; the producer retries them until its deadline. Reason -> (its stats counter, the
# retriable error raised once the attempts run out).
_BACKPRESSURE: dict[str, tuple[str, type[Rejected]]] = {
    RejectReason.STORE_BACKLOG_FULL.value: ("rejected_backlog", StoreBacklogFull),
    RejectReason.BUFFER_FULL.value: ("rejected_buffer_full", BufferFull),
}


# ErrorResp names a read may get, as the errors a consumer raises (others: Rejected)
_READ_REFUSALS: dict[str, type[ClientError]] = {
    SlowConsumer.__name__: SlowConsumer,
    TooManyStreams.__name__: TooManyStreams,
}


def position_at(moment: datetime) -> int:
    """The position (a seq: the records after it are read) at which the records committed
    at or after `moment` (timezone-aware) begin: a seq carries the millisecond of its
    coordinator's clock, so this is as exact as the relays' clocks agree."""
    if moment.tzinfo is None:
        raise ValueError(f"{moment.isoformat()} has no timezone: give one (e.g. UTC)")
    ms = int(moment.timestamp() * 1000) - EPOCH_MS
    if ms <= 0:
        return -1  # before the first possible seq: the whole history
    return compose(min(ms, MAX_MS), 0, 0) - 1


def check_produce_target(stream: object) -> str:
    """A stream a producer may write to: a name (check_stream) that is not a pattern."""
    name = check_stream(stream)
    refused = pattern_refusal(name)
    if refused:
        raise ValueError(f"{refused}: produce to one stream")
    return name


def check_stream(stream: object) -> str:
    """The stream name, or ValueError saying why it cannot be one."""
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


def decode_answer(frame: bytes, frame_limit: int, stats: Counter[str]) -> wire.ClientMessage | None:
    """A relay's answer frame decoded; None (counted as bad_frames) if it does not decode."""
    try:
        return wire.decode(frame, frame_limit)
    except FrameError:
        stats["bad_frames"] += 1
        return None


def _backoff(rounds: int) -> float:
    return float(min(BACKOFF_MAX_S, BACKOFF_BASE_S * (2 ** min(rounds - 1, 16))))


class RequestIds:
    """Request ids unique within one client: from `start` (random, so that two clients of
    one relay rarely share ids), counting."""

    def __init__(self, start: int) -> None:
        self._next = start

    def __call__(self) -> int:
        rid = self._next
        self._next = rid + 1 if rid < MAX_U63 else 0
        return rid


# --- where the relays are ----------------------------------------------------------------


class Relays:
    """The relays a client may talk to: their endpoints, the relay id of each where known,
    which relays serve a stream (when the topology is known), and the limits every frame
    must keep."""

    def __init__(
        self,
        endpoints: Sequence[str],
        by_id: Mapping[int, str],
        *,
        limits: Limits,
        members: Callable[[str], Sequence[int]] | None = None,
        spin: int = 0,
    ) -> None:
        self.endpoints: tuple[str, ...] = tuple(dict.fromkeys(endpoints))
        if not self.endpoints:
            raise ValueError("no relay endpoint given")
        self.by_id = dict(by_id)
        self.limits = limits
        self.members = members  # None: the topology is not known
        # Spreads the clients of a topology over the members of a stream (each client
        # starts at another member).
        self._spin = spin

    @property
    def topology_known(self) -> bool:
        return self.members is not None

    def order(self, stream: str) -> list[str]:
        """The endpoints to try for `stream`: its members first (when the topology is
        known), then the others."""
        if self.members is None:
            return list(self.endpoints)
        members = [self.by_id[r] for r in self.members(stream) if r in self.by_id]
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


class Op(IdentityStruct, eq=False):
    """One transaction being produced, across all its attempts. (A msgspec Struct: one is
    made per transaction, and a Struct is built in C with its defaults, several times
    faster than a class setting its slots one by one. eq=False: ops compare and hash by
    identity.)"""

    stream: str
    key: bytes | None
    value: bytes
    pseq: int
    kind: int
    item_bytes: int  # in a batch frame (wire.batch_item_bytes)
    started_at: float = 0.0
    deadline: float = 0.0
    due: float = 0.0  # when the op's timer is due (its attempt times out, or retry)
    attempts: int = 0
    rounds: int = 0
    saw_unknown: bool = False  # an attempt may have reached a relay without an answer
    last_fenced: tuple[int, ...] | None = None  # the last answer's redirect if fenced
    # the reason of the last answer if it was a rejection retried (`late`, or one of
    # _BACKPRESSURE), else None
    last_rejected: str | None = None
    candidates: deque[str] = msgspec.field(default_factory=deque)
    # Tuples, not a set and a list: they are rarely more than one item long, and fewer
    # containers per transaction leave the garbage collector less to walk.
    tried: tuple[str, ...] = ()  # in this round
    endpoint: str = ""  # of the current or last attempt
    rid: int | None = None  # the attempt in flight
    rids: tuple[int, ...] = ()  # every attempt's request id
    batch_rid: int = NO_BATCH  # the ProduceBatchReq carrying the attempt in flight
    alone: bool = False  # send in a frame of its own (a relay refused its batch)
    retry_same: bool = False  # still connecting: send to the same endpoint again
    timer: _Timer | None = None  # the op's live timer
    notes: deque[str] | None = None  # what went wrong, made on the first failure
    done: bool = False
    seq: int = -1
    error: ClientError | None = None

    def result(self) -> int:
        if self.error is not None:
            raise self.error
        return self.seq


class _Timer:
    """A timer shared by the ops sent (or paused) together. It lets go of them once none
    waits on it any more: most timers outlive their ops (answered long before the request
    timeout), and should not keep finished ops alive until then."""

    __slots__ = ("ops", "waiting")

    def __init__(self, ops: list[Op]) -> None:
        self.ops = ops
        self.waiting = len(ops)


def _disarm(op: Op) -> None:
    timer = op.timer
    if timer is not None:
        op.timer = None
        timer.waiting -= 1
        if not timer.waiting:
            timer.ops = []


class ProduceEngine:
    """The retry and pipelining rules of a producer, without I/O. Attempts that go to the
    same relay in one step are packed into ProduceBatchReq frames; every transaction keeps
    its own request id (the batch item id), answer, retries and errors."""

    def __init__(
        self,
        relays: Relays,
        producer_id: bytes,
        first_seq: int,
        *,
        window: int,
        send_timeout_s: float,
        request_timeout_s: float,
        max_attempts: int,
        connect_grace_s: float,
        now: float,
        first_request_id: int,
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
            if relays.topology_known
            else relays.limits.max_frame_bytes
        )
        # A batch frame stays within what a relay with these limits (the defaults without
        # a topology) accepts; should a relay still refuse one, its items go alone.
        self.batch_limit_bytes = wire.request_frame_limit(relays.limits)
        self.max_batch_items = min(
            relays.limits.max_batch_entries, wire.MAX_BATCH_ITEMS, wire.PIPELINE_BATCH_ITEMS
        )
        self.stats: Counter[str] = Counter()
        self._rid = RequestIds(first_request_id)
        self._queue: deque[Op] = deque()  # submitted, not started
        self._live: dict[int, Op] = {}  # started, not done; by producer seq
        self._by_rid: dict[int, Op] = {}
        self._batches: dict[int, list[Op]] = {}  # batch request id -> its ops, until answered
        self._ready: deque[Op] = deque()  # to attempt at the next step
        # (when, token, timer) for the ops sent (or paused) together; tokens keep the heap
        # from comparing timers
        self._timers: list[tuple[float, int, _Timer]] = []
        self._tokens = itertools.count(1)
        self._completed: list[Op] = []
        self._preferred: dict[str, str] = {}  # stream -> the endpoint that last committed
        self._orders: dict[str, tuple[str, ...]] = {}  # stream -> endpoints to try, in order

    @property
    def load(self) -> int:
        """Submitted and not done."""
        return len(self._queue) + len(self._live)

    def submit(self, stream: str, key: bytes | None, value: bytes, kind: int = KIND_PLAIN) -> Op:
        if self.next_seq > MAX_U64:
            raise OverflowError("the producer sequence is exhausted; use a new producer id")
        op = Op(stream, key, value, self.next_seq, kind, wire.batch_item_bytes(stream, key, value))
        self.next_seq += 1
        self._queue.append(op)
        return op

    def take_completed(self) -> list[Op]:
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
            op.candidates.extend(self._order(op.stream))  # empty until its start
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
            outbox: dict[str, list[Op]] = {}
            while ready:
                op = ready.popleft()
                if not op.done:
                    endpoint = self._next_endpoint(op, now)
                    if endpoint:
                        outbox.setdefault(endpoint, []).append(op)
            for endpoint, ops in outbox.items():
                self._send_packed(endpoint, ops, now, send)

    def on_frame(self, endpoint: str, frame: bytes, now: float) -> None:
        msg = decode_answer(frame, self.frame_limit, self.stats)
        if msg is None:
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
            word = reason.split(" ", 1)[0]
            if word == RejectReason.LATE.value:
                # That copy will never be delivered (a committed prefix, or a view change,
                # left it out): another attempt with the same producer seq is safe, and is
                # what a producer wants, as after `fenced`.
                self.stats["rejected_late"] += 1
                self._failed(op, now, f"{endpoint}: rejected (late)", unknown=False, rejected=word)
            elif word in _BACKPRESSURE:
                # Back-pressure: that relay took nothing. Room comes back as the store
                # ingests the spools (`store_backlog_full`, docs/protocol.md 5.14: another
                # relay may know of it already, from its peers' heartbeats), or as the
                # relay's buffer and pending produces drain (`buffer_full`, 5.10: another
                # relay may have room now). Retried as after `fenced`: the next relay, a
                # pause once every relay said so, until the deadline (then the reason's
                # own error, still retriable).
                self.stats[_BACKPRESSURE[word][0]] += 1
                note = f"{endpoint}: rejected ({word})"
                self._failed(op, now, note, unknown=False, rejected=word)
            else:
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

    def _forget_batch(self, op: Op) -> None:
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

    def _arm(self, ops: list[Op]) -> None:
        """One timer for `ops`, due when the first of them is (`op.due`)."""
        timer = _Timer(ops)
        when = ops[0].due
        for op in ops:
            op.timer = timer
            if op.due < when:
                when = op.due
        heapq.heappush(self._timers, (when, next(self._tokens), timer))

    def _next_endpoint(self, op: Op, now: float) -> str:
        """The relay for the op's next attempt ("" if it has run out of attempts)."""
        if now >= op.deadline or op.attempts >= self.max_attempts:
            self._finish(op, error=self._exhausted(op, now))
            return ""
        if not (op.retry_same and op.endpoint):
            op.endpoint = op.candidates.popleft()
            op.tried += (op.endpoint,)
        op.retry_same = False
        return op.endpoint

    def _send_packed(self, endpoint: str, ops: list[Op], now: float, send: SendFn) -> None:
        """Send `ops` to `endpoint` in as few frames as the batch bounds allow."""
        batch: list[Op] = []
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

    def _send_frame(self, endpoint: str, ops: list[Op], now: float, send: SendFn) -> None:
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
        op: Op,
        now: float,
        note: str,
        *,
        unknown: bool,
        redirect: tuple[int, ...] = (),
        fenced: bool = False,
        rejected: str | None = None,
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
        op.last_rejected = rejected
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

    def _finish(self, op: Op, *, seq: int = -1, error: ClientError | None = None) -> None:
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

    def _what(self, op: Op) -> str:
        return f"stream {op.stream!r} producer seq {op.pseq}"

    def _rejected(self, op: Op, endpoint: str, reason: str) -> ClientError:
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
        if name == wire.NOT_AUTHORIZED:
            # On the metadata stream, rights are per key (relay.access.Right.METADATA).
            right = "metadata" if op.stream == METADATA_STREAM else "produce"
            return NotAuthorized(f"{self._what(op)}: {detail}", right=right, stream=op.stream)
        return Rejected(
            f"{self._what(op)}: {detail}; this copy will never be delivered", reason=name
        )

    def _exhausted(self, op: Op, now: float) -> ClientError:
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
        if op.last_rejected == RejectReason.LATE.value:
            return Rejected(
                f"{self._what(op)}: every copy was left out {why}: "
                f"{_REJECT_TEXT['late']}; no copy will be delivered",
                reason="late",
            )
        if op.last_rejected in _BACKPRESSURE:
            name = op.last_rejected
            return _BACKPRESSURE[name][1](
                f"{self._what(op)}: still refused {why}: rejected ({name}) by "
                f"{op.endpoint}: {_REJECT_TEXT[name]}; this copy was not taken",
                reason=name,
            )
        if op.last_fenced is not None:
            return Fenced(
                f"{self._what(op)}: no relay could take it {why}; the last relay was fenced "
                "(it cannot reach a quorum)",
                redirect_to=op.last_fenced,
            )
        return Unknown(
            f"{self._what(op)}: no relay answered in {op.attempts} attempt"
            f"{'s' if op.attempts != 1 else ''} over {now - op.started_at:.1f} s (tried "
            f"{_tried_text(op.notes or ())}); it was not sent"
        )


def _tried_text(notes: Iterable[str]) -> str:
    """The relays a produce tried and what each last said, those that said the same
    together: `tcp://h:7200, tcp://h:7201: not connected; tcp://h:7202: timeout`."""
    last: dict[str, str] = {}
    for note in notes:
        endpoint, _, said = note.partition(": ")
        last.pop(endpoint, None)  # in the order they were last tried
        last[endpoint] = said
    together: dict[str, list[str]] = {}
    for endpoint, said in last.items():
        together.setdefault(said, []).append(endpoint)
    return "; ".join(f"{', '.join(ends)}: {said}" for said, ends in together.items()) or "none"


# --- consuming (no I/O) ------------------------------------------------------------------

# Answers after which a relay cannot serve the position now (anything but fenced and
# not_ready, which may clear): a round made only of these, with at least one out_of_range,
# makes out_of_range final (else OUT_OF_RANGE_WAIT_S after the first out_of_range).
_NOT_SERVING = frozenset({"out_of_range", "redirect", "unreachable", "timeout", "disconnected"})


@dataclass(frozen=True, slots=True, eq=False)
class StoreRead:
    """A read of the store the engine asks its driver for: the stored records after
    `after_seq`, the manifest refreshed first when `refresh` (the first read at a new
    position: an ingest may have moved the store on since)."""

    after_seq: int
    refresh: bool


@dataclass(frozen=True, slots=True)
class StoreBatch:
    """What the driver read for a StoreRead: at most max_batch records, in seq order."""

    request: StoreRead
    records: list[Record]
    store_last: int | None  # the store's last seq of the stream; None: it holds none
    exhausted: bool  # no stored record of that manifest is left after `records`


class ReadEngine:
    """One consumer's reading rules (long poll, fail-over, resume, the store when the
    relays cannot serve), without I/O: frames, store batches and time come in."""

    def __init__(
        self,
        relays: Relays,
        *,
        max_batch: int,
        wait_ms: int,
        request_timeout_s: float,
        connect_grace_s: float,
        now: float,
        first_request_id: int,
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
        # Reading from the beginning found every relay's history starting after this seq
        # and no store holding what came before: it is gone; reading went on from there.
        self.history_gone_before: int | None = None
        self._rid_source = RequestIds(first_request_id)
        self._rid: int | None = None
        self._sent_at = 0.0
        self._deadline = 0.0
        self._timer: float | None = None
        self._candidates: deque[str] = deque()
        self._tried: set[str] = set()
        self._round: dict[str, str] = {}  # endpoint -> what it answered in this round
        self._oldest: dict[str, int] = {}  # endpoint -> its oldest readable position
        self._oldest_since = 0.0  # when the first of `_oldest` answered (monotonic)
        self._rounds = 0
        self._notes: deque[str] = deque(maxlen=MAX_NOTES)
        self._store_read: StoreRead | None = None  # asked of the driver, not answered yet
        self._store_from = -1  # the position the current store episode started at
        self._store_asked_at: int | None = None  # position the store was asked at this round

    def subscribe(self, stream: str, start: Start, *, from_store: bool = False) -> None:
        """Start reading `stream`. "snapshot" here means "earliest": the consumer resolves a
        snapshot to its seq (with `from_store`: read the store after it first)."""
        check_stream(stream)
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
        self.history_gone_before = None
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
    def store_request(self) -> StoreRead | None:
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
        msg = decode_answer(frame, self.frame_limit, self.stats)
        if msg is None:
            return
        if not self.asked(msg.request_id):
            self.stats["stale_answers"] += 1
            return
        self.on_answer(endpoint, msg, now)

    def asked(self, request_id: int) -> bool:
        """Whether `request_id` is the read this engine waits for."""
        return self._rid is not None and request_id == self._rid

    def on_answer(self, endpoint: str, msg: wire.ClientMessage, now: float) -> None:
        """The decoded answer to the request `asked` recognised."""
        if endpoint != self.endpoint:
            self.stats["stale_answers"] += 1
            return
        self._rid = None
        stream = self.stream
        if isinstance(msg, wire.ErrorResp):
            text = f"stream {stream!r}: {endpoint} refused the read: {msg.error}: {msg.message}"
            if msg.error == NotAuthorized.__name__:
                self.error = NotAuthorized(text, right="consume", stream=stream or "")
            else:
                self.error = _READ_REFUSALS.get(msg.error, Rejected)(text)
            return
        if not isinstance(msg, wire.ReadResp):
            self.stats["bad_frames"] += 1
            self._leave(now, "timeout", f"{endpoint}: answered {type(msg).__name__}")
            return
        status = msg.status
        if status is ReadStatus.OK:
            if self.last == -1 and msg.oldest > GENESIS_POINT:
                # From the beginning, a relay serves what it holds after its base (a relay
                # restarted empty, a restart from the store's last point, an eviction): the
                # history before it must come from the store or another relay. If none
                # has it, `_pick` says it is gone and reads on from the oldest held.
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

    def on_store_batch(self, batch: StoreBatch) -> None:
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
            self._store_read = StoreRead(last, refresh=False)
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
        if not self._oldest:
            self._oldest_since = now
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
        self._store_read = StoreRead(self.last, refresh=True)
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
            or now - self._oldest_since >= OUT_OF_RANGE_WAIT_S
        ):
            oldest = min(self._oldest.values())
            if self.last == -1:  # from the beginning: what no one holds any more is gone
                return self._read_on_after_gone(oldest)
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

    def _read_on_after_gone(self, oldest: int) -> str:
        """Every relay's history starts after `oldest` (the lowest) and the store does not
        hold what came before: say so, and read from the relay that holds the most."""
        self.history_gone_before = oldest
        self.stats["history_gone"] += 1
        self.last = oldest
        assert self.stream is not None
        first = min(self._oldest, key=self._oldest.__getitem__)
        self._candidates = deque(e for e in self.relays.order(self.stream) if e != first)
        self._tried = {first}
        self._round.clear()
        self._oldest.clear()
        self._rounds = 0
        return first

    def _store_text(self) -> str:
        """For OutOfRange: where the store ends, if there is one."""
        if self.store_path is None:
            return ""
        if self.store_end is None:
            return f", and the store at {self.store_path} holds no records of the stream"
        return f", and the store at {self.store_path} ends at seq {self.store_end}"


class StreamWatch:
    """Which streams a consumer's pattern names, without I/O: every relay is asked
    (StreamsReq) which of the streams it serves match, at once and then every
    `refresh_s`; the names not seen before are `take_new`'s. A pattern's streams can
    appear at any time (a relay's pattern opens a stream on its first produce), so the
    watch never ends. A relay that does not answer within `request_timeout_s` is asked
    again in the next round."""

    def __init__(
        self,
        relays: Relays,
        pattern: str,
        *,
        refresh_s: float,
        request_timeout_s: float,
        connect_grace_s: float,
        now: float,
        first_request_id: int,
    ) -> None:
        self.relays = relays
        self.pattern = pattern
        self.refresh_s = refresh_s
        self.request_timeout_s = request_timeout_s
        self.connect_until = now + connect_grace_s
        self.stats: Counter[str] = Counter()
        self.error: ClientError | None = None
        self.rounds = 0  # rounds over: every relay answered, timed out or was unreachable
        self._found: set[str] = set()
        self._new: list[tuple[str, bool]] = []
        self._rid = RequestIds(first_request_id)
        self._asked: dict[int, tuple[str, float]] = {}  # request id -> (endpoint, deadline)
        self._unsent: list[str] = []  # this round's relays not connected yet
        self._in_round = False
        self._wake = now  # the next round, or within a round the next connect poll

    def take_new(self) -> list[tuple[str, bool]]:
        """The streams found since the last call, in the order found, each with whether
        the first round found it (the streams there at the start)."""
        new, self._new = self._new, []
        return new

    def asked(self, request_id: int) -> bool:
        return request_id in self._asked

    def next_wakeup(self) -> float | None:
        if self.error is not None:
            return None
        times = [deadline for _, deadline in self._asked.values()]
        if not self._in_round or self._unsent:
            times.append(self._wake)
        return min(times)

    def step(self, now: float, send: SendFn) -> None:
        if self.error is not None:
            return
        for rid, (_, deadline) in list(self._asked.items()):
            if now >= deadline:
                del self._asked[rid]
                self.stats["streams_timeouts"] += 1
        if not self._in_round:
            if now < self._wake:
                return
            self._in_round = True
            self._unsent = list(self.relays.endpoints)
        if self._unsent and now >= self._wake:
            waiting = []
            for endpoint in self._unsent:
                rid = self._rid()
                if send(endpoint, wire.encode(wire.StreamsReq(rid, self.pattern))):
                    self._asked[rid] = (endpoint, now + self.request_timeout_s)
                    self.stats["streams_asked"] += 1
                elif now < self.connect_until:
                    waiting.append(endpoint)
                else:
                    self.stats["streams_unreachable"] += 1
            self._unsent = waiting
            self._wake = now + CONNECT_POLL_S
        self._end_round_if_over(now)

    def on_answer(self, endpoint: str, msg: wire.ClientMessage, now: float) -> None:
        self._asked.pop(msg.request_id, None)
        if isinstance(msg, wire.StreamsResp):
            for name in msg.streams:
                # A relay lists what matches; a name that does not is not read.
                if name not in self._found and pattern_matches(self.pattern, name):
                    self._found.add(name)
                    self._new.append((name, self.rounds == 0))
        elif isinstance(msg, wire.ErrorResp) and msg.error == TooManyStreams.__name__:
            self.error = TooManyStreams(f"{endpoint}: {msg.message}")
        else:  # an old relay that does not know the request, or a refusal: ask again later
            self.stats["streams_refused"] += 1
        self._end_round_if_over(now)

    def on_disconnect(self, endpoint: str, now: float) -> None:
        for rid, (asked, _) in list(self._asked.items()):
            if asked == endpoint:
                del self._asked[rid]
        self._end_round_if_over(now)

    def _end_round_if_over(self, now: float) -> None:
        if self._in_round and not self._unsent and not self._asked:
            self._in_round = False
            self.rounds += 1
            self._wake = now + self.refresh_s
