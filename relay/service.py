"""The relay's side of the client protocol (relay.wire), without sockets.

A `ClientService` turns client requests into core inputs and the core's answers into
client responses, for one relay. The ZeroMQ node (relay/node.py) feeds it the frames of its
ROUTER socket; the simulator (relay/sim/world.py) feeds it the frames of simulated client
links, so the simulated clients talk to the same code as real ones.

* `on_request(envelope, frame, ...)`: one request frame from the client behind `envelope`
  (the shell's address of that client; its first part identifies the client). A frame
  that does not decode is answered with an ErrorResp naming the problem.
  - ProduceReq, ProduceBatchReq: every transaction goes to the core on its own (a core
    request id each); its answer comes back through `on_replies`. A ProduceReq is answered
    with a ProduceResp; the items of ProduceBatchReqs that settle in one turn are answered
    together (one ProduceBatchResp per client, at `flush`).
  - ReadReq: answered at once, or parked (a long poll) until entries arrive, the stream's
    state changes, or `wait_ms` passes. A client that leaves more than
    `limits.max_unread_reply_bytes` of earlier answers unread (`unread(identity)`, what the
    shell's socket still queues for it) gets an ErrorResp "SlowConsumer" instead of
    entries, so a reader that does not read costs a relay a bounded amount of memory.
    A read of a pattern name (`orders.*`) is refused (ErrorResp "FieldError"): it would
    open a stream that no produce can ever reach.
  - StatusReq: the relay's status as JSON.
  - ReloadReq: read the topology file again, as on SIGHUP (`reload`), and say what it did.
  - StreamsReq: the streams this relay serves matching a pattern (those the client may
    consume), for a consumer of a pattern.
  A request that would open a stream (a new name of a pattern this relay serves) counts
  against its client's `max_new_streams_per_client` (per client name with CurveZMQ, else per
  connection) while the stream stays open (`closed`: the core closes a stream nobody
  writes once no read reached it for `limits.idle_stream_close_ms`); beyond it, and
  beyond the relay's `max_streams`, a produce is rejected `too_many_streams` and a read
  gets an ErrorResp "TooManyStreams".
  With an access policy (CurveZMQ on: relay/access.py, docs/security.md) each request is
  first checked against the rights of the client named with it: a produce needs `produce`
  on its stream and a producer id of the client's own (else it is rejected,
  `not_authorized`), a read `consume` on its stream, a status or reload request `admin` (else an
  ErrorResp "NotAuthorized"); each refusal is counted (`not_authorized_<right>`). The
  metadata stream is guarded by key: a metadata operation produced to it (a read barrier
  on another key than the client library's one too, relay.meta.guarded_key), a MetaReq
  get, and a MetaReq outcome (by its operation's key), need `metadata` on the key; a
  list shows only such keys; a StreamsReq lists only streams the client may consume.
* The shell passes on what the core's `Ready` says: `on_replies(replies)`, and `wake(stream)`
  after a delivery or a rebase of the stream (and when it fenced).
* `expire(mono_ms)` answers produces the core never answered (a backstop) and parked reads
  whose wait is over; `next_deadline_ms()` says when it next has something to expire (the
  shell may sleep until then); `flush()` sends the turn's batch answers; `close()` tells
  every waiting producer `unknown` (retrying is safe).

Time comes in as milliseconds of the shell's clocks, and as the shell's `clock` (seconds)
where produce latency is measured; nothing here waits or reads a clock of its own.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from relay import wire
from relay.access import (
    AccessPolicy,
    Right,
    owns_producer_id,
    pattern_matches,
    producer_id_prefix,
)
from relay.core import (
    Limits,
    Outcome,
    ProduceReply,
    ProduceRequest,
    ReadResult,
    ReadStatus,
    RejectReason,
    RelayCore,
    Transaction,
)
from relay.errors import FieldError, FrameError, MalformedFrame
from relay.meta import (
    KIND_META,
    METADATA_STREAM,
    InvalidMetaOp,
    MetaView,
    decode_op,
    guarded_key,
)
from relay.produce_metrics import LatencyHistogram, RefusalCounts
from relay.topology import pattern_refusal

log = logging.getLogger("relay.node")

MAX_PARKED_READS = 10_000  # long-polls held at once; more are answered at once
STREAMS_FOUND_MAX = 256  # StreamsReq answers kept, per (client, pattern)
# Clients whose opened streams are counted (the least recently seen are forgotten beyond
# it: without CurveZMQ a client is a connection, and connections come and go).
MAX_COUNTED_CLIENTS = 100_000
# Who opened each stream is kept for this many times max_streams names (streams left
# for another relay's configuration are never closed here, so their names may pile up).
OPENERS_KEPT_PER_MAX_STREAMS = 2
# A produce the core has not answered this long after its deadline is answered `unknown`
# here (the core answers every produce within produce_timeout_ms; this only guards that).
PRODUCE_BACKSTOP_GRACE_MS = 1_000
# A read answer is bounded by max_batch_bytes, counting each entry's bytes and this much
# for its seq and framing (at least one entry is sent, whatever its size).
READ_ENTRY_OVERHEAD_BYTES = 16

Envelope = list[bytes]  # how the shell addresses a client; [0] identifies it
SendFn = Callable[[Envelope, bytes], bool]  # False: the response could not be sent
WarnFn = Callable[..., None]  # (counter name, message, *args): a rate-limited warning
StatusFn = Callable[[], dict[str, object]]
# Read the topology file again (RelayNode.reload_answer): (taken, words, file digest).
ReloadFn = Callable[[], tuple[bool, str, bytes]]
UnreadFn = Callable[[bytes], int]

ClockFn = Callable[[], float]  # seconds of a monotonic clock (produce latency)

# A produce waiting for the core's answer: (client envelope, the client's request or item
# id, stream, whether it came in a ProduceBatchReq, when its frame arrived by `clock`). A
# tuple: one is made per transaction.
PendingProduce = tuple[Envelope, int, str, bool, float]


@dataclass
class ParkedRead:
    envelope: Envelope
    request: wire.ReadReq
    client: bytes | str  # whose share a stream this read opens counts against (`_crowded`)


class ClientService:
    """One relay's client protocol: requests in, core calls, responses out."""

    def __init__(
        self,
        core: RelayCore,
        limits: Limits,
        *,
        members: Callable[[str], tuple[int, ...]],
        send: SendFn,
        counters: Counter[str],
        status: StatusFn,
        warn: WarnFn,
        relay_id: int,
        access: AccessPolicy | None = None,
        unread: UnreadFn | None = None,
        clock: ClockFn | None = None,
        reload: ReloadFn | None = None,
    ) -> None:
        """`members`: the relays serving a stream (`RelayCore.members`: by its
        configuration). `access`: the rights of identified clients (None: clients are not
        identified, and every request is allowed). `unread`: the bytes of answers the shell
        still queues for a client (by its envelope's first part; None: the shell queues
        none).
        `clock`: the shell's monotonic clock in seconds, read once per produce frame and
        once per batch of answers for the produce-latency histogram (None: not measured).
        `reload`: what a ReloadReq does (None: the relay reads no topology file, as in the
        simulator; the request is answered as refused)."""
        self.core = core
        self._access = access
        self._unread = unread
        # StreamsReq answers, per (client, pattern): (the sorted names they were found
        # among, the streams found), while the core's sorted names are that same list.
        self._streams_found: OrderedDict[tuple[str | None, str], tuple[list[str], list[str]]] = (
            OrderedDict()
        )
        # streams opened by first use and still open, per client (name, or connection
        # identity), and who opened each (the core closes a blank idle one: `closed`)
        self._opened: OrderedDict[bytes | str, int] = OrderedDict()
        self._opener: OrderedDict[str, bytes | str] = OrderedDict()
        self.limits = limits
        # The relays serving a stream: whether this relay opens it for a request, or leaves
        # it to the core to redirect and forward. The node gives the core's answer (its
        # configuration, docs/protocol.md 5.15), which outlives a change of the topology.
        self._members = members
        self.counters = counters  # shared with the shell's own counters
        self._send = send
        self._status = status
        self._reload = reload
        self._warn = warn
        self._relay_id = relay_id
        self.request_limit = wire.request_frame_limit(limits)  # (`set_limits` changes both)
        self._next_core_id = 1  # the core request id of the next produce
        self._produces: dict[int, PendingProduce] = {}  # by core request id
        # (deadline, first core id, last core id) per request frame: deadlines and ids
        # only grow, so a FIFO stays sorted.
        self._produce_deadlines: deque[tuple[int, int, int]] = deque()
        # Results of batched produces settled in this turn, per client (identity): sent
        # as one ProduceBatchResp per client at `flush`.
        self._batch_results: dict[bytes, tuple[Envelope, list[wire.BatchResult]]] = {}
        self._parked: dict[str, dict[int, ParkedRead]] = {}  # stream -> parked id -> read
        self._parked_count = 0
        self._parked_deadlines: list[tuple[int, int, str]] = []  # (deadline, id, stream)
        self._next_parked = itertools.count(1)
        self.meta = MetaView()  # this relay's fold of the metadata stream
        # What the relay's metrics show (relay/produce_metrics.py): produce latency,
        # refusals by (stream, outcome, reason), records served to consumers per stream.
        self._clock = clock
        self.latency = LatencyHistogram()
        self.refusals = RefusalCounts()
        self.served: Counter[str] = Counter()

    @property
    def pending_produces(self) -> int:
        return len(self._produces)

    @property
    def parked_reads(self) -> int:
        return self._parked_count

    # --- requests ---------------------------------------------------------------------

    @property
    def produces_taken(self) -> int:
        """Produces taken from clients so far (each item of a batch counts)."""
        return self.counters["produce_requests"]

    def on_request(
        self,
        envelope: Envelope,
        frame: bytes,
        now_ms: int,
        mono_ms: int,
        client: str | None = None,
    ) -> None:
        """One request frame from a client (wall and monotonic clock in ms); `client`: its
        authenticated name (None without CurveZMQ)."""
        try:
            msg = wire.decode(frame, self.request_limit, self.limits.max_batch_entries)
        except FrameError as error:
            self.counters["client_frame_invalid"] += 1
            self.counters["client_" + error.counter] += 1
            self.refuse(envelope, wire.peek_request_id(frame), error)
            return
        if isinstance(msg, wire.ProduceBatchReq):
            self._on_produce_batch(envelope, msg, now_ms, mono_ms, client)
        elif isinstance(msg, wire.ProduceReq):
            self._on_produce(envelope, msg, now_ms, mono_ms, client)
        elif isinstance(msg, wire.ReadReq):
            pattern = pattern_refusal(msg.stream)
            if pattern:  # it would open a stream no produce can reach (5.11)
                self.counters["read_refused_pattern"] += 1
                self.refuse(envelope, msg.request_id, FieldError(f"read: {pattern}"))
                return
            denied = self._denied(client, Right.CONSUME, msg.stream)
            if denied:
                self._respond(envelope, wire.ErrorResp(msg.request_id, "NotAuthorized", denied))
                return
            crowded = self._crowded(client or envelope[0], msg.stream)
            if crowded:
                self._respond(envelope, wire.ErrorResp(msg.request_id, "TooManyStreams", crowded))
                return
            self._on_read(envelope, msg, mono_ms, client or envelope[0])
        elif isinstance(msg, wire.MetaReq):
            # A get names its key; a list shows only the keys the client may use.
            denied = self._denied(client, Right.METADATA, msg.key if msg.op == "get" else "")
            if denied:
                self._respond(envelope, wire.ErrorResp(msg.request_id, "NotAuthorized", denied))
                return
            self.counters["meta_requests"] += 1
            self._respond(envelope, self._answer_meta(msg, client))
        elif isinstance(msg, wire.StreamsReq):
            self.counters["streams_requests"] += 1
            self._respond(envelope, self._answer_streams(msg, client))
        elif isinstance(msg, wire.StatusReq):
            denied = self._denied(client, Right.ADMIN)
            if denied:
                self._respond(envelope, wire.ErrorResp(msg.request_id, "NotAuthorized", denied))
                return
            body = json.dumps(self._status(), default=str, sort_keys=True).encode()
            self._respond(envelope, wire.StatusResp(msg.request_id, body))
        elif isinstance(msg, wire.ReloadReq):
            denied = self._denied(client, Right.ADMIN)
            if denied:
                self._respond(envelope, wire.ErrorResp(msg.request_id, "NotAuthorized", denied))
                return
            self.counters["reload_requests"] += 1
            taken, words, digest = (
                self._reload() if self._reload is not None else (False, "no topology file", b"")
            )
            words = words[: wire.MAX_TEXT_CHARS]
            self._respond(envelope, wire.ReloadResp(msg.request_id, taken, words, digest))
        else:  # a response type sent as a request
            self.counters["client_frame_invalid"] += 1
            self.counters["client_not_a_request"] += 1
            wrong = MalformedFrame(f"{type(msg).__name__} is not a request")
            self.refuse(envelope, msg.request_id, wrong)

    def set_limits(self, limits: Limits) -> None:
        """Bounds from a reloaded topology, for every request from now on."""
        self.limits = limits
        self.request_limit = wire.request_frame_limit(limits)

    def set_access(self, access: AccessPolicy | None) -> None:
        """Clients' rights from a reloaded topology: every request from now on is checked
        against them (a request under way keeps the answer it had)."""
        self._access = access
        self._streams_found.clear()

    def refuse(self, envelope: Envelope, request_id: int, error: FrameError) -> None:
        """Answer a frame that is not a valid request with an ErrorResp naming why."""
        name = type(error).__name__
        self._warn(
            "client_" + error.counter,
            "relay=%d refused a client frame: %s: %s",
            self._relay_id,
            name,
            error,
        )
        self._respond(envelope, wire.ErrorResp(request_id, name, str(error)[:1000]))

    def _denied(
        self,
        client: str | None,
        right: Right,
        stream: str = "",
        producer_id: bytes = b"",
        *,
        named: str = "",
    ) -> str:
        """Why `client` may not do this ("" if it may), counted when it may not. `named`:
        how the reason names the stream or key, where the client must not learn it."""
        access = self._access
        if access is None or client is None:
            return ""
        if not access.allows(client, right, stream):
            why = f"client {client!r} has no {right.value} right"
            if stream:
                kind = "key" if right is Right.METADATA else "stream"
                why += f" on {named or f'{kind} {stream!r}'}"
        elif producer_id and not owns_producer_id(client, producer_id):
            prefix = producer_id_prefix(client).decode()
            why = (
                f"client {client!r} may produce only under producer ids starting with "
                f"{prefix!r}, not {producer_id[:64]!r}"
            )
        else:
            return ""
        self.counters["not_authorized_" + right.value] += 1
        self._warn("not_authorized_" + right.value, "relay=%d refused: %s", self._relay_id, why)
        return why

    def _crowded(self, client: bytes | str, stream: str) -> str:
        """Why `client` may not open `stream` here ("" if it may, or need not): a request
        for a stream this relay does not track yet but would open counts against the
        client's share and the relay's max_streams."""
        core = self.core
        if core.has_stream(stream) or self._relay_id not in self._members(stream):
            return ""
        opened = self._opened.get(client, 0)
        limits = self.limits
        if opened >= limits.max_new_streams_per_client:
            why = (
                f"this client holds {opened} streams it opened on relay {self._relay_id} "
                f"(limits.max_new_streams_per_client; one nobody writes closes once no "
                f"read reached it for limits.idle_stream_close_ms); {stream!r} is not opened"
            )
        elif not core.can_open(stream):
            why = (
                f"relay {self._relay_id} tracks its maximum of {limits.max_streams} streams "
                f"(limits.max_streams); {stream!r} is not opened"
            )
        else:
            self._opened[client] = opened + 1
            self._opened.move_to_end(client)
            if len(self._opened) > MAX_COUNTED_CLIENTS:
                self._opened.popitem(last=False)
            self._opener[stream] = client
            if len(self._opener) > OPENERS_KEPT_PER_MAX_STREAMS * limits.max_streams:
                self._opener.popitem(last=False)  # (its client's count stays: it errs high)
            return ""
        self.counters["refused_too_many_streams"] += 1
        self._warn("refused_too_many_streams", "relay=%d refused: %s", self._relay_id, why)
        return why

    def _produce_refusal(
        self, envelope: Envelope, client: str | None, stream: str, producer_id: bytes
    ) -> str:
        """The reject reason of a produce its client may not make here ("" if it may)."""
        pattern = pattern_refusal(stream)
        if pattern:
            return f"{wire.INVALID}: {pattern}"
        denied = self._denied(client, Right.PRODUCE, stream, producer_id)
        if denied:
            return f"{wire.NOT_AUTHORIZED} ({denied})"
        crowded = self._crowded(client or envelope[0], stream)
        if crowded:
            return f"{RejectReason.TOO_MANY_STREAMS.value} ({crowded})"
        return ""

    def _meta_refusal(self, client: str | None, producer_id: bytes, kind: int, value: bytes) -> str:
        """The reject reason of a produce to the metadata stream ("" if it may be made):
        only metadata operations go there, so that every committed record of it means
        something, each on a key its client may use (the client library's read barrier
        names none: `guarded_key`)."""
        if kind != KIND_META:
            why = f"the metadata stream takes kind {KIND_META} operations, not kind {kind}"
            return f"{wire.INVALID}: {why}"
        try:
            op = decode_op(value)
        except InvalidMetaOp as e:
            return f"{wire.INVALID}: {e}"
        denied = self._denied(client, Right.METADATA, guarded_key(op), producer_id)
        return f"{wire.NOT_AUTHORIZED} ({denied})" if denied else ""

    def _on_produce(
        self,
        envelope: Envelope,
        req: wire.ProduceReq,
        now_ms: int,
        mono_ms: int,
        client: str | None,
    ) -> None:
        if req.stream == METADATA_STREAM:
            refused = self._meta_refusal(client, req.producer_id, req.kind, req.value)
        else:
            refused = self._produce_refusal(envelope, client, req.stream, req.producer_id)
        if refused:
            self._answer_produce(
                envelope, req.request_id, False, Outcome.REJECTED, -1, refused, stream=req.stream
            )
            return
        first = self._next_core_id
        if not self._members(req.stream):
            self.counters["client_unknown_stream"] += 1  # the core answers unknown_stream
        tx = Transaction(req.producer_id, req.producer_seq, req.key, req.value, req.kind)
        arrived = self._clock() if self._clock is not None else 0.0
        core_id = self._register(envelope, req.request_id, req.stream, False, arrived)
        if core_id >= 0:
            self._hand_to_core([ProduceRequest(core_id, req.stream, tx)], now_ms, mono_ms)
        self._track_produces(first, mono_ms)

    def _on_produce_batch(
        self,
        envelope: Envelope,
        req: wire.ProduceBatchReq,
        now_ms: int,
        mono_ms: int,
        client: str | None,
    ) -> None:
        self.counters["produce_batches"] += 1
        first = self._next_core_id
        producer_id = req.producer_id
        arrived = self._clock() if self._clock is not None else 0.0
        checked = ""  # the items of a batch mostly share one stream: look it up once
        denied = ""
        taken: list[ProduceRequest] = []  # for the core, in one call
        try:
            for item_id, stream, producer_seq, key, value, kind in req.items:
                if stream == METADATA_STREAM:  # each operation names its own key
                    why = self._meta_refusal(client, producer_id, kind, value)
                else:
                    if stream != checked:
                        checked = stream
                        denied = self._produce_refusal(envelope, client, stream, producer_id)
                        if not denied and not self._members(stream):
                            self.counters["client_unknown_stream"] += 1
                    why = denied
                if why:
                    self._answer_produce(
                        envelope, item_id, True, Outcome.REJECTED, -1, why, stream=stream
                    )
                    continue
                core_id = self._register(envelope, item_id, stream, True, arrived)
                if core_id >= 0:
                    tx = Transaction(producer_id, producer_seq, key, value, kind)
                    taken.append(ProduceRequest(core_id, stream, tx))
        finally:
            # Should a check fail on a later item (a bug), the items registered before it
            # still reach the core and get their deadline: none is left pending for good.
            self._hand_to_core(taken, now_ms, mono_ms)
            self._track_produces(first, mono_ms)

    def _register(
        self, envelope: Envelope, request_id: int, stream: str, batched: bool, arrived: float
    ) -> int:
        """The core's id for one produce, or -1 if too many are in flight (answered)."""
        counters = self.counters
        counters["produce_requests"] += 1
        if len(self._produces) >= self.limits.max_pending_produces:
            counters["produce_refused_busy"] += 1
            reason = RejectReason.BUFFER_FULL.value
            self._answer_produce(
                envelope, request_id, batched, Outcome.REJECTED, -1, reason, stream=stream
            )
            return -1
        core_id = self._next_core_id
        self._next_core_id = core_id + 1
        self._produces[core_id] = (envelope, request_id, stream, batched, arrived)
        return core_id

    def _hand_to_core(self, requests: list[ProduceRequest], now_ms: int, mono_ms: int) -> None:
        """Give the core produces; their answers come back through `on_replies`. Should the
        core fail (a bug), those not yet answered are told `unknown`: always safe to retry."""
        if not requests:
            return
        try:
            self.core.produce_many(requests, now_ms, mono_ms)
        except Exception:
            self.counters["produce_core_error"] += 1
            log.exception(
                "relay=%d stream=%s core failed on a produce", self._relay_id, requests[0].stream
            )
            for request in requests:
                pending = self._produces.pop(request.request_id, None)
                if pending is not None:
                    envelope, request_id, stream, batched, _ = pending
                    self._answer_produce(
                        envelope, request_id, batched, Outcome.UNKNOWN, stream=stream
                    )

    def _track_produces(self, first_core_id: int, mono_ms: int) -> None:
        """One deadline for the produces of one request frame (core ids first.. so far)."""
        last_core_id = self._next_core_id - 1
        if last_core_id >= first_core_id:
            deadline = mono_ms + 2 * self.limits.produce_timeout_ms + PRODUCE_BACKSTOP_GRACE_MS
            self._produce_deadlines.append((deadline, first_core_id, last_core_id))

    # --- answers ------------------------------------------------------------------------

    def on_replies(self, replies: list[ProduceReply]) -> None:
        """The core's answers to produces: each to the client that sent it. (Once per
        transaction: the common answer, a batched item committed, is made inline.)"""
        produces, counters = self._produces, self.counters
        debug = log.isEnabledFor(logging.DEBUG)
        committed = 0
        observe = self.latency.observe if self._clock is not None else None
        answered = self._clock() if self._clock is not None else 0.0
        answers_of: bytes | None = None  # a turn's answers mostly go to one client
        answers: list[wire.BatchResult] = []
        for reply in replies:
            pending = produces.pop(reply.request_id, None)
            if pending is None:
                counters["produce_reply_unmatched"] += 1
                continue
            envelope, request_id, stream, batched, arrived = pending
            if observe is not None:
                observe(answered - arrived)
            outcome = reply.outcome
            if debug:
                log.debug(
                    "relay=%d stream=%s seq=%d produce %s %s",
                    self._relay_id,
                    stream,
                    reply.seq,
                    outcome.value,
                    reply.reason,
                )
            if outcome is Outcome.COMMITTED and batched:
                committed += 1
                if envelope[0] is not answers_of:
                    answers_of, answers = envelope[0], self._batch_answers(envelope)
                answers.append((request_id, outcome, reply.seq, reply.reason, reply.redirect))
                continue
            counters["produce_" + outcome._value_] += 1  # (`.value` is a slower property)
            self._answer_produce(
                envelope,
                request_id,
                batched,
                outcome,
                reply.seq,
                reply.reason,
                reply.redirect,
                stream=stream,
            )
        if committed:
            counters["produce_committed"] += committed

    def _answer_produce(
        self,
        envelope: Envelope,
        request_id: int,
        batched: bool,
        outcome: Outcome,
        seq: int = -1,
        reason: str = "",
        redirect: tuple[int, ...] = (),
        *,
        stream: str,
    ) -> None:
        """A ProduceResp now, or (batched) a result for this turn's ProduceBatchResp; an
        outcome other than `committed` is counted by stream, outcome and reason."""
        if outcome is not Outcome.COMMITTED:
            self._count_refusal(stream, outcome, reason)
        if not batched:
            self._respond(envelope, wire.ProduceResp(request_id, outcome, seq, reason, redirect))
            return
        self._batch_answers(envelope).append((request_id, outcome, seq, reason, redirect))

    def _count_refusal(self, stream: str, outcome: Outcome, reason: str) -> None:
        """Counted under the stream's name if this relay has it, else under "": names a
        client makes up must not make the label set grow (nor do reasons: RefusalCounts
        bounds them)."""
        if not self.core.has_stream(stream):
            stream = ""
        self.refusals.count(stream, outcome.value, reason)

    def _batch_answers(self, envelope: Envelope) -> list[wire.BatchResult]:
        """This turn's results for the client behind `envelope` (its ProduceBatchResp)."""
        pending = self._batch_results.get(envelope[0])
        if pending is None:
            pending = self._batch_results[envelope[0]] = (envelope, [])
        return pending[1]

    def flush(self) -> None:
        """Send this turn's ProduceBatchResps: one per client (more if they are many)."""
        if not self._batch_results:
            return
        # As many results per frame as a ReadResp has entries (each is far smaller).
        per_frame = min(self.limits.max_batch_entries, wire.MAX_BATCH_ITEMS)
        for envelope, results in self._batch_results.values():
            for start in range(0, len(results), per_frame):
                chunk = tuple(results[start : start + per_frame])
                self.counters["produce_batch_answers"] += 1
                self._respond(envelope, wire.ProduceBatchResp(-1, chunk))
        self._batch_results.clear()

    def close(self) -> None:
        """The relay stops: tell every waiting producer `unknown` (always safe to retry)."""
        for envelope, request_id, stream, batched, _ in self._produces.values():
            self._answer_produce(envelope, request_id, batched, Outcome.UNKNOWN, stream=stream)
        self._produces.clear()
        self.flush()

    # --- reads --------------------------------------------------------------------------

    def _on_read(
        self, envelope: Envelope, req: wire.ReadReq, mono_ms: int, client: bytes | str
    ) -> None:
        self.counters["read_requests"] += 1
        result = self._read(req)
        if result.status is ReadStatus.OK and not result.entries and req.wait_ms > 0:
            if self._parked_count < MAX_PARKED_READS:
                pid = next(self._next_parked)
                deadline = mono_ms + req.wait_ms
                self._parked.setdefault(req.stream, {})[pid] = ParkedRead(envelope, req, client)
                self._parked_count += 1
                heapq.heappush(self._parked_deadlines, (deadline, pid, req.stream))
                return
            self.counters["read_park_refused"] += 1
        self._answer_read(envelope, req, result)

    def _read(self, req: wire.ReadReq) -> ReadResult:
        limit = min(req.max_entries, self.limits.max_batch_entries)
        result = self.core.read(req.stream, req.after_seq, limit)
        if result.status is not ReadStatus.OK:
            self.counters["read_" + result.status.value] += 1
            if result.status is ReadStatus.UNKNOWN_STREAM:
                self.counters["client_unknown_stream"] += 1
            return result
        budget = self.limits.max_batch_bytes
        used = 0
        for i, (_, tx) in enumerate(result.entries):
            used += tx.size_bytes() + READ_ENTRY_OVERHEAD_BYTES
            if used > budget and i > 0:
                return ReadResult(
                    result.status,
                    result.entries[:i],
                    result.redirect,
                    result.oldest,
                    result.committed,
                )
        return result

    def _answer_read(self, envelope: Envelope, req: wire.ReadReq, result: ReadResult) -> None:
        if result.entries and self._unread is not None:
            unread = self._unread(envelope[0])
            if unread >= self.limits.max_unread_reply_bytes:
                self.counters["read_refused_slow_consumer"] += 1
                why = (
                    f"{unread} bytes of earlier answers to this connection are still unread "
                    f"(at most {self.limits.max_unread_reply_bytes}); read them first"
                )
                self._warn(
                    "read_refused_slow_consumer", "relay=%d refused a read: %s", self._relay_id, why
                )
                self._respond(envelope, wire.ErrorResp(req.request_id, "SlowConsumer", why))
                return
        entries = tuple(
            (seq, tx.key, tx.value, tx.producer_id, tx.producer_seq, tx.kind)
            for seq, tx in result.entries
        )
        self.counters["read_entries"] += len(entries)
        if entries:
            self.served[req.stream] += len(entries)
        resp = wire.ReadResp(
            req.request_id,
            result.status,
            entries,
            result.redirect,
            result.oldest,
            result.committed,
        )
        self._respond(envelope, resp)

    # --- metadata (docs/metadata.md) -------------------------------------------------------

    def _answer_streams(
        self, req: wire.StreamsReq, client: str | None
    ) -> wire.StreamsResp | wire.ErrorResp:
        """The streams this relay serves that match the pattern and `client` may consume
        (the others are left out, not refused: a pattern names what it may read). Kept
        per (client, pattern) while the relay tracks the same streams: matching thousands
        of names against a pattern and the client's rights takes milliseconds, and a
        consumer of a pattern asks again and again."""
        names = self.core.stream_names_sorted()
        asked = (client, req.pattern)
        cached = self._streams_found.get(asked)
        if cached is not None and cached[0] is names:  # the same list: no stream came or went
            found = cached[1]
        else:
            access = self._access
            found = [
                name
                for name in names
                if pattern_matches(req.pattern, name)
                and (access is None or client is None or access.allows(client, Right.CONSUME, name))
            ]
            self._streams_found[asked] = (names, found)
            if len(self._streams_found) > STREAMS_FOUND_MAX:
                self._streams_found.popitem(last=False)
        listed_bytes = sum(len(name.encode()) + 3 for name in found)  # msgpack str headers
        if len(found) > wire.MAX_STREAMS_LISTED or listed_bytes > self.limits.max_frame_bytes // 2:
            why = (
                f"{req.pattern!r} matches {len(found)} streams on relay {self._relay_id} "
                f"({listed_bytes} bytes of names), more than one answer may list "
                f"({wire.MAX_STREAMS_LISTED}); give a narrower pattern"
            )
            return wire.ErrorResp(req.request_id, "TooManyStreams", why)
        return wire.StreamsResp(req.request_id, tuple(found))

    def _answer_meta(self, req: wire.MetaReq, client: str | None) -> wire.MetaResp | wire.ErrorResp:
        view = self.meta
        view.feed(self.core)
        state = view.state
        if not view.complete:
            why = view.gap or "this relay has not joined the metadata stream yet"
            return wire.MetaResp(req.request_id, "not_ready", state.applied, detail=why)
        if req.seq > state.applied:  # the client has seen later operations: not yet here
            return wire.MetaResp(req.request_id, "pending", state.applied)
        if req.op == "get":
            held = state.get(req.key)
            items = () if held is None else ((held.key, held.version, held.value),)
            return wire.MetaResp(req.request_id, "ok", state.applied, items)
        if req.op == "list":
            access = self._access
            visible = None  # a client sees only the keys it may use
            if access is not None and client is not None:
                visible = functools.partial(access.allows, client, Right.METADATA)
            found = tuple((v.key, v.version, v.value) for v in state.list(req.key, visible=visible))
            return wire.MetaResp(req.request_id, "ok", state.applied, found)
        outcome = state.outcome(req.seq)
        if outcome is None and req.seq <= state.outcomes_from:
            why = f"this relay's metadata was copied from a peer as of seq {state.outcomes_from}"
            return wire.MetaResp(req.request_id, "not_ready", state.applied, detail=why)
        if outcome is None:
            why = (
                f"seq {req.seq} is older than the oldest outcome remembered "
                f"({state.oldest_outcome}), or was not a metadata operation"
            )
            return wire.MetaResp(req.request_id, "forgotten", state.applied, detail=why)
        # An outcome carries its key's version (a commit seq, so a time): only for a client
        # that may read that key, and without naming the key to one that may not.
        named = f"the key of the metadata operation at seq {req.seq}"
        denied = self._denied(client, Right.METADATA, outcome.key, named=named)
        if denied:
            return wire.ErrorResp(req.request_id, "NotAuthorized", denied)
        return wire.MetaResp(
            req.request_id,
            "ok",
            state.applied,
            (),
            outcome.result.value,
            outcome.version,
            outcome.detail[: wire.MAX_TEXT_CHARS],
        )

    def wake(self, stream: str) -> None:
        """Answer the parked reads of `stream` that can now get entries or a new status."""
        if stream == METADATA_STREAM:
            self.meta.feed(self.core)
        parked = self._parked.get(stream)
        if not parked:
            return
        for pid, read in list(parked.items()):
            result = self._read(read.request)
            if result.entries or result.status is not ReadStatus.OK:
                del parked[pid]
                self._parked_count -= 1
                self._answer_read(read.envelope, read.request, result)
        if not parked:
            del self._parked[stream]

    def closed(self, stream: str) -> None:
        """The core closed `stream` (blank and idle, docs/protocol.md 5.11): it no
        longer counts against the client that opened it. Its parked reads stay: a read
        at the end of its wait opens it again, counted against its own client's share
        (`expire`), and so does a first produce anywhere, whose deliveries answer them."""
        client = self._opener.pop(stream, None)
        if client is None or client not in self._opened:
            return
        if self._opened[client] > 1:
            self._opened[client] -= 1
        else:
            del self._opened[client]

    def expire(self, mono_ms: int) -> None:
        """Answer produces the core left unanswered too long, and reads whose wait is over."""
        deadlines = self._produce_deadlines
        while deadlines and deadlines[0][0] <= mono_ms:
            _, first_core_id, last_core_id = deadlines.popleft()
            for core_id in range(first_core_id, last_core_id + 1):
                pending = self._produces.pop(core_id, None)
                if pending is not None:
                    self.counters["produce_node_timeout"] += 1
                    envelope, request_id, stream, batched, _ = pending
                    self._answer_produce(
                        envelope, request_id, batched, Outcome.UNKNOWN, stream=stream
                    )
        parked_heap = self._parked_deadlines
        while parked_heap and parked_heap[0][0] <= mono_ms:
            _, pid, stream = heapq.heappop(parked_heap)
            parked = self._parked.get(stream)
            read = parked.pop(pid, None) if parked is not None else None
            if read is None:
                continue
            self._parked_count -= 1
            if not parked:
                del self._parked[stream]
            # The stream may have closed while the read waited (5.11): reading opens it
            # again, on the share of the client that asked, as its next request would.
            crowded = self._crowded(read.client, stream)
            if crowded:
                error = wire.ErrorResp(read.request.request_id, "TooManyStreams", crowded)
                self._respond(read.envelope, error)
                continue
            self._answer_read(read.envelope, read.request, self._read(read.request))

    def next_deadline_ms(self) -> int | None:
        """The monotonic time by which `expire` must next be called; None if nothing waits.
        It may be early (a parked read answered since leaves its deadline behind until it
        is due), never late."""
        due: int | None = None
        if self._produce_deadlines:
            due = self._produce_deadlines[0][0]
        if self._parked_deadlines:
            parked = self._parked_deadlines[0][0]
            due = parked if due is None else min(due, parked)
        return due

    def _respond(self, envelope: Envelope, msg: wire.ClientMessage) -> None:
        if not self._send(envelope, wire.encode(msg)):
            self.counters["client_reply_dropped"] += 1
