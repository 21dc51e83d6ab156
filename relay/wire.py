"""The client protocol: producers and consumers talk to a relay over ZeroMQ.

Sockets: the client uses a DEALER connected to the relay's `client_endpoint`; the relay
answers from a ROUTER bound there. Every message is ONE msgpack frame (on the relay side it
follows the ROUTER identity frame; a REQ client's empty delimiter frame is accepted too).
A frame is a msgpack array `[type_code, request_id, field, ...]`; fields are positional, in
the order of the dataclasses below. `request_id` is chosen by the client (0..2**63-1) and
echoed in the answer, so a client may keep many requests in flight on one socket.

Requests (client -> relay) and their answers:

    ProduceReq  [1, request_id, stream, producer_id, producer_seq, key, value, kind]
        Produce one transaction. stream: str, 1..255 UTF-8 bytes, no NUL or '|';
        producer_id: bin 1..64 bytes; producer_seq: int 0..2**64-1 (retrying with the same
        producer_id and producer_seq never creates a duplicate); key: nil or bin; value: bin;
        kind: int 0..255, how the value is read (0 a plain value, 1 a change list: see
        docs/store.md; part of the transaction's hash).
    ProduceResp [2, request_id, outcome, seq, reason, redirect]
        outcome: "committed" (seq is the committed sequence number), "rejected" (reason:
        "late", "unknown_stream", "too_large", "buffer_full", "invalid" (followed by why:
        e.g. the stream is a pattern, or a metadata stream's value is not an operation),
        "duplicate_mismatch": another transaction holds this producer_id and producer_seq,
        "not_authorized": the client's identity may not produce to the stream, or under this
        producer_id; the reason goes on to say which, docs/security.md; "too_many_streams":
        the stream would be a new one beyond the client's or the relay's bound;
        "store_backlog_full": fewer than a quorum of the stream's relays can spool more,
        retry later, docs/protocol.md 5.14),
        "fenced" (try a relay in redirect) or "unknown" (no definite answer in time: retry
        with the same producer_seq). seq: -1 unless committed. redirect: array of relay
        ids (map them to endpoints with the topology).

    ReadReq     [3, request_id, stream, after_seq, max_entries, wait_ms]
        Pull committed entries with seq > after_seq (-1: from the oldest held), at most
        max_entries (1..65536; the relay may return fewer). If none is available the relay
        parks the request (long poll) until entries commit or wait_ms (0..600000) passes,
        then answers (possibly with no entries). The relay keeps nothing per consumer beyond
        a parked request: the consumer resumes with after_seq = the last seq it received.
    ReadResp    [4, request_id, status, entries, redirect, oldest, committed]
        status: "ok", "redirect" (the relay does not serve the stream: try redirect),
        "fenced" (it cannot reach a quorum: try redirect), "not_ready" (still joining),
        "out_of_range" (after_seq is older than what the relay holds: resume at `oldest`),
        "unknown_stream" (no relay serves it). entries: array of
        [seq, key, value, producer_id, producer_seq, kind], ascending seq, no gaps in the committed
        timeline, duplicates removed. oldest: the lowest after_seq still readable (-1 if
        unknown); committed: the relay's committed point for the stream (-1 if unknown).

    ProduceBatchReq  [8, request_id, producer_id, items]
        Produce many transactions of one producer in one frame. items: array of
        1..MAX_BATCH_ITEMS (and at most the relay's limits.max_batch_entries)
        [item_id, stream, producer_seq, key, value, kind]; item_id: int 0..2**63-1, chosen by the
        client like a request id (unique among its requests in flight); the other fields
        as in ProduceReq. Every item is produced on its own, exactly as a ProduceReq would
        be: each gets its own result, in a ProduceBatchResp. A frame with any bad field is
        refused whole (ErrorResp with this request_id) and changes nothing.
    ProduceBatchResp [9, request_id, results]
        results: array of 1..MAX_BATCH_ITEMS [item_id, outcome, seq, reason, redirect], the
        fields of a ProduceResp for the item with that item_id. One answer may hold results
        of several batch requests of the same client (the relay answers all that settled
        in one turn together), so request_id is always -1: match results by item_id.

    StatusReq   [5, request_id]
    StatusResp  [6, request_id, status_json]
        status_json: bin, UTF-8 JSON of the relay's status (core status and node counters).

    MetaReq     [10, request_id, op, key, seq]
        Ask the relay's fold of the metadata stream (docs/metadata.md). op: "get" (the key
        `key`), "list" (the keys starting with `key`, at most META_LIST_MAX) or "outcome"
        (what the metadata operation committed at `seq` did; key ""). seq: for "get" and
        "list" the lowest seq the answer must reflect (-1: any), for "outcome" the seq.
    MetaResp    [11, request_id, status, applied, items, result, version, detail]
        status: "ok"; "not_ready" (this relay cannot know the state: still joining, or
        its history of the metadata stream does not reach back to the genesis; detail says
        which: ask another relay); "pending" (`seq` is above what this relay folded so far:
        ask again); "forgotten" (the outcome is older than the outcomes it
        remembers). applied: the last seq folded (-1 if none). items: array of [key,
        version, value]. For "outcome": result "applied", "bad_version" (version: the
        version found) or "invalid" (detail says why), else "".

    StreamsReq  [12, request_id, pattern]
    StreamsResp [13, request_id, streams]
        The streams this relay serves whose names match `pattern` (fnmatch: `*`, `?`,
        `[...]`; an exact name matches itself), sorted, at most MAX_STREAMS_LISTED: those it
        tracks and the declared ones it is a member of. Only streams the client may consume
        are listed; internal streams (named `_relay.` ...) only for a pattern that starts
        with `_relay.`. A consumer of a pattern asks every relay and reads the union.

    ReloadReq   [14, request_id]
    ReloadResp  [15, request_id, taken, words, file_digest]
        The relay reads its topology file again, as on SIGHUP (docs/deploy.md section 9;
        the admin right). taken: bool, whether it took the file (only a change of which
        relays serve which streams is taken while it runs); words: what the file changes,
        or why it was refused (at most MAX_TEXT_CHARS); file_digest: the SHA-256 of the
        file's bytes as the relay read them (32 bytes; empty if it could not read it), so
        `relay reconfigure` can tell a relay that read another file than the operator's.

    ErrorResp   [7, request_id, error, message]
        The relay could not accept a frame: error is the name of the relay.errors class
        ("MalformedFrame", "FieldError", "OversizedFrame", "UnknownMessageType"; for a read
        or status request: "NotAuthorized", the client's rights do not allow it,
        "SlowConsumer", the connection left too many answers unread, "TooManyStreams", the
        stream would be a new one beyond the client's or the relay's bound, or a
        StreamsReq's pattern matches more streams than one answer may list);
        message says what was wrong. request_id is -1 when it could not be read from the
        frame.

Bounds: a request frame may be at most `request_frame_limit(limits)` bytes:
min(max_frame_bytes, max_tx_bytes + REQUEST_OVERHEAD_BYTES). Answers are at most
max_frame_bytes (a ReadResp holds at most max_batch_entries / about max_batch_bytes, a
ProduceBatchResp at most max_batch_entries results). `batch_item_bytes` bounds what one
item adds to a ProduceBatchReq, so a client can pack a frame that surely fits.

`decode` is where remote bytes enter: it validates every field and raises only subclasses
of relay.errors.FrameError (MalformedFrame, FieldError, OversizedFrame, UnknownMessageType),
whatever the bytes are. `encode` trusts its input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgpack
from msgspec import Meta

from relay.core import codec
from relay.core.config import Limits
from relay.core.fields import (
    MAX_TX_KIND,
    MAX_U63,
    MAX_U64,
    U63,
    U64,
    ProducerId,
    RelayId,
    TxKind,
    U63OrNone,
    u63,
    u63_or_none,
    u64,
)
from relay.core.fields import array as _array
from relay.core.fields import bad as _bad
from relay.core.fields import enum as _enum
from relay.core.fields import producer_id as _producer_id
from relay.core.fields import stream as _stream
from relay.core.messages import Outcome, ReadStatus
from relay.core.seq import MAX_RELAY_ID
from relay.errors import FieldError

__all__ = [
    "BATCH_FRAME_OVERHEAD_BYTES",
    "MAX_BATCH_ITEMS",
    "BatchItem",
    "BatchResult",
    "ClientMessage",
    "ErrorResp",
    "MetaReq",
    "MetaResp",
    "ProduceBatchReq",
    "ProduceBatchResp",
    "ProduceReq",
    "ProduceResp",
    "ReadReq",
    "ReadResp",
    "ReloadReq",
    "ReloadResp",
    "StatusReq",
    "StatusResp",
    "StreamsReq",
    "StreamsResp",
    "batch_item_bytes",
    "decode",
    "encode",
    "peek_request_id",
    "request_frame_limit",
]

MAX_READ_ENTRIES = 65_536
MAX_WAIT_MS = 600_000
MAX_TEXT_CHARS = 4_096  # reason, error, message
NOT_AUTHORIZED = "not_authorized"  # the reject reason of a produce the client may not make
INVALID = "invalid"  # the reject reason of a produce that names a pattern or breaks a rule
# Room for everything in a ProduceReq besides the transaction's own bytes (stream name,
# producer id, ints, msgpack headers), so a frame carrying a max_tx_bytes transaction fits.
REQUEST_OVERHEAD_BYTES = 1_024
# Items (or results) in one ProduceBatchReq (ProduceBatchResp); a relay may allow fewer
# (limits.max_batch_entries).
MAX_BATCH_ITEMS = 65_536
# The unit of pipelining through the mesh: the produces a client puts in one
# ProduceBatchReq, and (whole frames at a time) a relay takes in one turn of its loop. A
# coordinator publishes what one turn took before it takes more, so its members insert
# and report one part of a large window while it takes the next. Taken whole, a window
# of 4,096 crossed client, coordinator, members and back as one lump, one process busy
# at a time: measured at 1,024 and 4,096 in flight, 20-32k tx/s in lumps against 37-47k
# in parts of 512.
PIPELINE_BATCH_ITEMS = 512
# Upper bounds of the msgpack bytes around the payload: a ProduceBatchReq's own fields
# (array header, type code, request id, producer id of up to 64 bytes, items header) and
# one item's (array header, item id, stream header, producer seq, key and value headers).
BATCH_FRAME_OVERHEAD_BYTES = 128
BATCH_ITEM_OVERHEAD_BYTES = 40


def request_frame_limit(limits: Limits) -> int:
    """The largest request frame a relay accepts."""
    return min(limits.max_frame_bytes, limits.max_tx_bytes + REQUEST_OVERHEAD_BYTES)


def batch_item_bytes(stream: str, key: bytes | None, value: bytes) -> int:
    """At most the bytes one item adds to a ProduceBatchReq frame."""
    key_bytes = len(key) if key is not None else 0
    return len(stream.encode()) + key_bytes + len(value) + BATCH_ITEM_OVERHEAD_BYTES


# (seq, key, value, producer_id, producer_seq, kind)
WireEntry = tuple[int, bytes | None, bytes, bytes, int, int]
# (item_id, stream, producer_seq, key, value, kind): one transaction of a ProduceBatchReq
BatchItem = tuple[int, str, int, bytes | None, bytes, int]
# (item_id, outcome, seq, reason, redirect): one result of a ProduceBatchResp
BatchResult = tuple[int, Outcome, int, str, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class ProduceReq:
    request_id: int
    stream: str
    producer_id: bytes
    producer_seq: int
    key: bytes | None
    value: bytes
    kind: int = 0


@dataclass(frozen=True, slots=True)
class ProduceResp:
    request_id: int
    outcome: Outcome
    seq: int = -1
    reason: str = ""
    redirect: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ReadReq:
    request_id: int
    stream: str
    after_seq: int = -1
    max_entries: int = 1_000
    wait_ms: int = 0


@dataclass(frozen=True, slots=True)
class ReadResp:
    request_id: int
    status: ReadStatus
    entries: tuple[WireEntry, ...] = ()
    redirect: tuple[int, ...] = ()
    oldest: int = -1
    committed: int = -1


@dataclass(frozen=True, slots=True)
class StatusReq:
    request_id: int


@dataclass(frozen=True, slots=True)
class StatusResp:
    request_id: int
    status_json: bytes


@dataclass(frozen=True, slots=True)
class ErrorResp:
    request_id: int  # -1: not known
    error: str
    message: str


@dataclass(frozen=True, slots=True)
class ProduceBatchReq:
    request_id: int
    producer_id: bytes
    items: tuple[BatchItem, ...]


@dataclass(frozen=True, slots=True)
class ProduceBatchResp:
    request_id: int  # always -1: the results name their items
    results: tuple[BatchResult, ...]


META_OPS = ("get", "list", "outcome")
META_STATUSES = ("ok", "not_ready", "pending", "forgotten")
META_RESULTS = ("", "applied", "bad_version", "invalid")
MAX_META_ITEMS = 10_000  # items in one MetaResp (relay.meta.META_LIST_MAX)
MAX_META_KEY_CHARS = 512  # a key or prefix (relay.meta.MAX_META_KEY_BYTES bytes at most)
# (key, version, value)
MetaItem = tuple[str, int, bytes]
MAX_STREAMS_LISTED = 10_000  # stream names in one StreamsResp


@dataclass(frozen=True, slots=True)
class MetaReq:
    request_id: int
    op: str  # one of META_OPS
    key: str = ""
    seq: int = -1


@dataclass(frozen=True, slots=True)
class MetaResp:
    request_id: int
    status: str  # one of META_STATUSES
    applied: int = -1
    items: tuple[MetaItem, ...] = ()
    result: str = ""  # one of META_RESULTS
    version: int = 0
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ReloadReq:
    request_id: int


FILE_DIGEST_BYTES = 32  # SHA-256


@dataclass(frozen=True, slots=True)
class ReloadResp:
    request_id: int
    taken: bool
    words: str
    file_digest: bytes = b""


@dataclass(frozen=True, slots=True)
class StreamsReq:
    request_id: int
    pattern: str


@dataclass(frozen=True, slots=True)
class StreamsResp:
    request_id: int
    streams: tuple[str, ...] = ()


ClientMessage = (
    ProduceReq
    | ProduceResp
    | ReadReq
    | ReadResp
    | StatusReq
    | StatusResp
    | ErrorResp
    | ProduceBatchReq
    | ProduceBatchResp
    | MetaReq
    | MetaResp
    | StreamsReq
    | StreamsResp
    | ReloadReq
    | ReloadResp
)

TYPE_CODES: dict[type, int] = {
    ProduceReq: 1,
    ProduceResp: 2,
    ReadReq: 3,
    ReadResp: 4,
    StatusReq: 5,
    StatusResp: 6,
    ErrorResp: 7,
    ProduceBatchReq: 8,
    ProduceBatchResp: 9,
    MetaReq: 10,
    MetaResp: 11,
    StreamsReq: 12,
    StreamsResp: 13,
    ReloadReq: 14,
    ReloadResp: 15,
}


# --- encoding -----------------------------------------------------------------------------


def encode(msg: ClientMessage) -> bytes:
    """One msgpack frame for `msg`. Raises TypeError for anything else."""
    body: tuple[Any, ...]
    if isinstance(msg, ProduceReq):
        body = (
            1,
            msg.request_id,
            msg.stream,
            msg.producer_id,
            msg.producer_seq,
            msg.key,
            msg.value,
            msg.kind,
        )
    elif isinstance(msg, ProduceBatchReq):
        body = (8, msg.request_id, msg.producer_id, msg.items)
    elif isinstance(msg, ProduceBatchResp):
        # Per result, `_value_` (a plain attribute) rather than `.value` (a property).
        results = [(i, o._value_, seq, why, to) for i, o, seq, why, to in msg.results]
        body = (9, msg.request_id, results)
    elif isinstance(msg, ProduceResp):
        body = (2, msg.request_id, msg.outcome.value, msg.seq, msg.reason, msg.redirect)
    elif isinstance(msg, ReadReq):
        body = (3, msg.request_id, msg.stream, msg.after_seq, msg.max_entries, msg.wait_ms)
    elif isinstance(msg, ReadResp):
        body = (
            4,
            msg.request_id,
            msg.status.value,
            msg.entries,
            msg.redirect,
            msg.oldest,
            msg.committed,
        )
    elif isinstance(msg, StatusReq):
        body = (5, msg.request_id)
    elif isinstance(msg, StatusResp):
        body = (6, msg.request_id, msg.status_json)
    elif isinstance(msg, ErrorResp):
        body = (7, msg.request_id, msg.error, msg.message)
    elif isinstance(msg, MetaReq):
        body = (10, msg.request_id, msg.op, msg.key, msg.seq)
    elif isinstance(msg, MetaResp):
        body = (
            11,
            msg.request_id,
            msg.status,
            msg.applied,
            msg.items,
            msg.result,
            msg.version,
            msg.detail,
        )
    elif isinstance(msg, StreamsReq):
        body = (12, msg.request_id, msg.pattern)
    elif isinstance(msg, StreamsResp):
        body = (13, msg.request_id, msg.streams)
    elif isinstance(msg, ReloadReq):
        body = (14, msg.request_id)
    elif isinstance(msg, ReloadResp):
        body = (15, msg.request_id, msg.taken, msg.words, msg.file_digest)
    else:
        raise TypeError(f"not a client message: {type(msg).__name__}")
    return codec.ENCODER.encode(body)


# --- decoding: field validators -------------------------------------------------------------


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        _bad(name, f"int {lo}..{hi}", v)
    return v


def _bytes(v: Any, name: str) -> bytes:
    if type(v) is not bytes:
        _bad(name, "bin", v)
    return v


def _key(v: Any, name: str) -> bytes | None:
    if v is not None and type(v) is not bytes:
        _bad(name, "bin or nil", v)
    return v


def _text(v: Any, name: str) -> str:
    if type(v) is not str or len(v) > MAX_TEXT_CHARS:
        _bad(name, f"str of at most {MAX_TEXT_CHARS} characters", v)
    return v


def _redirect(v: Any, name: str) -> tuple[int, ...]:
    items = _array(v, name)
    if len(items) > MAX_RELAY_ID + 1:
        _bad(name, f"at most {MAX_RELAY_ID + 1} relay ids", f"{len(items)} items")
    return tuple(_int(r, f"{name}[{i}]", 0, MAX_RELAY_ID) for i, r in enumerate(items))


_OUTCOMES = {o.value: o for o in Outcome}
_READ_STATUSES = {s.value: s for s in ReadStatus}
_META_OPS = {op: op for op in META_OPS}
_META_STATUSES = {status: status for status in META_STATUSES}
_META_RESULTS = {result: result for result in META_RESULTS}


def _kind(v: Any, name: str) -> int:
    return _int(v, name, 0, MAX_TX_KIND)


def _entries(v: Any, name: str) -> tuple[WireEntry, ...]:
    out: list[WireEntry] = []
    for i, raw in enumerate(_array(v, name)):
        at = f"{name}[{i}]"
        seq, key, value, pid, pseq, kind = _array(raw, at, 6)
        out.append(
            (
                u63(seq, at + ".seq"),
                _key(key, at + ".key"),
                _bytes(value, at + ".value"),
                _producer_id(pid, at + ".producer_id"),
                u64(pseq, at + ".producer_seq"),
                _kind(kind, at + ".kind"),
            )
        )
    return tuple(out)


def _dec_produce_req(a: list[Any]) -> ProduceReq:
    return ProduceReq(
        u63(a[1], "ProduceReq.request_id"),
        _stream(a[2], "ProduceReq.stream"),
        _producer_id(a[3], "ProduceReq.producer_id"),
        u64(a[4], "ProduceReq.producer_seq"),
        _key(a[5], "ProduceReq.key"),
        _bytes(a[6], "ProduceReq.value"),
        _kind(a[7], "ProduceReq.kind"),
    )


def _dec_produce_resp(a: list[Any]) -> ProduceResp:
    return ProduceResp(
        u63(a[1], "ProduceResp.request_id"),
        _enum(a[2], _OUTCOMES, "ProduceResp.outcome"),
        u63_or_none(a[3], "ProduceResp.seq"),
        _text(a[4], "ProduceResp.reason"),
        _redirect(a[5], "ProduceResp.redirect"),
    )


def _batch_array(v: Any, name: str) -> list[Any]:
    items = _array(v, name)
    if not 0 < len(items) <= MAX_BATCH_ITEMS:
        _bad(name, f"1..{MAX_BATCH_ITEMS} items", f"{len(items)} items")
    return items


def _is_stream(v: str) -> bool:
    try:
        _stream(v, "stream")
    except FieldError:
        return False
    return True


def _batch_item(raw: Any, at: str) -> BatchItem:
    item_id, stream, producer_seq, key, value, kind = _array(raw, at, 6)
    return (
        u63(item_id, at + ".item_id"),
        _stream(stream, at + ".stream"),
        u64(producer_seq, at + ".producer_seq"),
        _key(key, at + ".key"),
        _bytes(value, at + ".value"),
        _kind(kind, at + ".kind"),
    )


def _dec_produce_batch_req(a: list[Any]) -> ProduceBatchReq:
    request_id = u63(a[1], "ProduceBatchReq.request_id")
    producer_id = _producer_id(a[2], "ProduceBatchReq.producer_id")
    raw_items = _batch_array(a[3], "ProduceBatchReq.items")
    items: list[BatchItem] = []
    append = items.append
    valid_stream = ""  # the items of a batch mostly share one stream: check it once
    for i, raw in enumerate(raw_items):
        # The common, valid case is checked inline (this runs per transaction); anything
        # else goes through the named validators, which say what was wrong.
        if type(raw) is list and len(raw) == 6:
            item_id, stream, producer_seq, key, value, kind = raw
            if (
                type(item_id) is int
                and 0 <= item_id <= MAX_U63
                and type(producer_seq) is int
                and 0 <= producer_seq <= MAX_U64
                and (key is None or type(key) is bytes)
                and type(value) is bytes
                and type(kind) is int
                and 0 <= kind <= MAX_TX_KIND
                and type(stream) is str
                and (stream == valid_stream or _is_stream(stream))
            ):
                valid_stream = stream
                append((item_id, stream, producer_seq, key, value, kind))
                continue
        append(_batch_item(raw, f"ProduceBatchReq.items[{i}]"))
    return ProduceBatchReq(request_id, producer_id, tuple(items))


def _batch_result(raw: Any, at: str) -> BatchResult:
    item_id, outcome, seq, reason, redirect = _array(raw, at, 5)
    return (
        u63(item_id, at + ".item_id"),
        _enum(outcome, _OUTCOMES, at + ".outcome"),
        u63_or_none(seq, at + ".seq"),
        _text(reason, at + ".reason"),
        _redirect(redirect, at + ".redirect"),
    )


def _dec_produce_batch_resp(a: list[Any]) -> ProduceBatchResp:
    request_id = _int(a[1], "ProduceBatchResp.request_id", -1, -1)
    raw_results = _batch_array(a[2], "ProduceBatchResp.results")
    results: list[BatchResult] = []
    append = results.append
    outcomes = _OUTCOMES
    for i, raw in enumerate(raw_results):
        # Inline fast path for the common result (no redirect), as in the request.
        if type(raw) is list and len(raw) == 5:
            item_id, text, seq, reason, redirect = raw
            outcome = outcomes.get(text) if type(text) is str else None
            if (
                outcome is not None
                and type(item_id) is int
                and 0 <= item_id <= MAX_U63
                and type(seq) is int
                and -1 <= seq <= MAX_U63
                and type(reason) is str
                and len(reason) <= MAX_TEXT_CHARS
                and redirect == []
            ):
                append((item_id, outcome, seq, reason, ()))
                continue
        append(_batch_result(raw, f"ProduceBatchResp.results[{i}]"))
    return ProduceBatchResp(request_id, tuple(results))


def _dec_read_req(a: list[Any]) -> ReadReq:
    return ReadReq(
        u63(a[1], "ReadReq.request_id"),
        _stream(a[2], "ReadReq.stream"),
        u63_or_none(a[3], "ReadReq.after_seq"),
        _int(a[4], "ReadReq.max_entries", 1, MAX_READ_ENTRIES),
        _int(a[5], "ReadReq.wait_ms", 0, MAX_WAIT_MS),
    )


def _dec_read_resp(a: list[Any]) -> ReadResp:
    return ReadResp(
        u63(a[1], "ReadResp.request_id"),
        _enum(a[2], _READ_STATUSES, "ReadResp.status"),
        _entries(a[3], "ReadResp.entries"),
        _redirect(a[4], "ReadResp.redirect"),
        u63_or_none(a[5], "ReadResp.oldest"),
        u63_or_none(a[6], "ReadResp.committed"),
    )


def _dec_status_req(a: list[Any]) -> StatusReq:
    return StatusReq(u63(a[1], "StatusReq.request_id"))


def _dec_status_resp(a: list[Any]) -> StatusResp:
    return StatusResp(u63(a[1], "StatusResp.request_id"), _bytes(a[2], "StatusResp.status_json"))


def _dec_error_resp(a: list[Any]) -> ErrorResp:
    return ErrorResp(
        u63_or_none(a[1], "ErrorResp.request_id"),
        _text(a[2], "ErrorResp.error"),
        _text(a[3], "ErrorResp.message"),
    )


def _meta_key(v: Any, name: str) -> str:
    if type(v) is not str or len(v) > MAX_META_KEY_CHARS:
        _bad(name, f"str of at most {MAX_META_KEY_CHARS} characters", v)
    return v


def _dec_meta_req(a: list[Any]) -> MetaReq:
    return MetaReq(
        u63(a[1], "MetaReq.request_id"),
        _enum(a[2], _META_OPS, "MetaReq.op"),
        _meta_key(a[3], "MetaReq.key"),
        u63_or_none(a[4], "MetaReq.seq"),
    )


def _meta_items(v: Any, name: str) -> tuple[MetaItem, ...]:
    raw_items = _array(v, name)
    if len(raw_items) > MAX_META_ITEMS:
        _bad(name, f"at most {MAX_META_ITEMS} items", f"{len(raw_items)} items")
    out: list[MetaItem] = []
    for i, raw in enumerate(raw_items):
        at = f"{name}[{i}]"
        key, version, value = _array(raw, at, 3)
        out.append((_meta_key(key, at + ".key"), u63(version, at + ".version"), _bytes(value, at)))
    return tuple(out)


def _dec_meta_resp(a: list[Any]) -> MetaResp:
    return MetaResp(
        u63(a[1], "MetaResp.request_id"),
        _enum(a[2], _META_STATUSES, "MetaResp.status"),
        u63_or_none(a[3], "MetaResp.applied"),
        _meta_items(a[4], "MetaResp.items"),
        _enum(a[5], _META_RESULTS, "MetaResp.result"),
        u63(a[6], "MetaResp.version"),
        _text(a[7], "MetaResp.detail"),
    )


def _dec_streams_req(a: list[Any]) -> StreamsReq:
    return StreamsReq(u63(a[1], "StreamsReq.request_id"), _stream(a[2], "StreamsReq.pattern"))


def _dec_streams_resp(a: list[Any]) -> StreamsResp:
    names = _array(a[2], "StreamsResp.streams")
    if len(names) > MAX_STREAMS_LISTED:
        _bad("StreamsResp.streams", f"at most {MAX_STREAMS_LISTED} names", f"{len(names)} names")
    return StreamsResp(
        u63(a[1], "StreamsResp.request_id"),
        tuple(_stream(n, f"StreamsResp.streams[{i}]") for i, n in enumerate(names)),
    )


def _dec_reload_req(a: list[Any]) -> ReloadReq:
    return ReloadReq(u63(a[1], "ReloadReq.request_id"))


def _dec_reload_resp(a: list[Any]) -> ReloadResp:
    if type(a[2]) is not bool:
        _bad("ReloadResp.taken", "bool", a[2])
    digest = _bytes(a[4], "ReloadResp.file_digest")
    if len(digest) not in (0, FILE_DIGEST_BYTES):
        _bad("ReloadResp.file_digest", f"0 or {FILE_DIGEST_BYTES} bytes", f"{len(digest)} bytes")
    return ReloadResp(
        u63(a[1], "ReloadResp.request_id"), a[2], _text(a[3], "ReloadResp.words"), digest
    )


# --- the hot frames, decoded in C (codec.decode_with) --------------------------------------

_Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
_Redirect = Annotated[tuple[RelayId, ...], Meta(max_length=MAX_RELAY_ID + 1)]
_BatchItemShape = tuple[U63, str, U64, bytes | None, bytes, TxKind]
_BatchResultShape = tuple[U63, Outcome, U63OrNone, _Text, _Redirect]
_ProduceBatchReqShape = tuple[
    Literal[8],
    U63,
    ProducerId,
    Annotated[tuple[_BatchItemShape, ...], Meta(min_length=1, max_length=MAX_BATCH_ITEMS)],
]
_ProduceBatchRespShape = tuple[
    Literal[9],
    Literal[-1],
    Annotated[tuple[_BatchResultShape, ...], Meta(min_length=1, max_length=MAX_BATCH_ITEMS)],
]
_ProduceReqShape = tuple[Literal[1], U63, str, ProducerId, U64, bytes | None, bytes, TxKind]
_ProduceRespShape = tuple[Literal[2], U63, Outcome, U63OrNone, _Text, _Redirect]
_ReadReqShape = tuple[
    Literal[3],
    U63,
    str,
    U63OrNone,
    Annotated[int, Meta(ge=1, le=MAX_READ_ENTRIES)],
    Annotated[int, Meta(ge=0, le=MAX_WAIT_MS)],
]
_ReadRespShape = tuple[
    Literal[4],
    U63,
    ReadStatus,
    tuple[tuple[U63, bytes | None, bytes, ProducerId, U64, TxKind], ...],
    _Redirect,
    U63OrNone,
    U63OrNone,
]


def _build_produce_batch_req(a: Any) -> ProduceBatchReq:
    items: tuple[BatchItem, ...] = a[3]
    valid_stream = ""  # the items of a batch mostly share one stream: check it once
    for item in items:
        if item[1] != valid_stream:
            valid_stream = _stream(item[1], "ProduceBatchReq.items[].stream")
    return ProduceBatchReq(a[1], a[2], items)


def _build_produce_req(a: Any) -> ProduceReq:
    return ProduceReq(a[1], _stream(a[2], "ProduceReq.stream"), a[3], a[4], a[5], a[6], a[7])


def _build_read_req(a: Any) -> ReadReq:
    return ReadReq(a[1], _stream(a[2], "ReadReq.stream"), a[3], a[4], a[5])


_FAST_DECODERS: dict[int, codec.FastDecoder[Any]] = {
    1: codec.FastDecoder(_ProduceReqShape, _build_produce_req),
    2: codec.FastDecoder(_ProduceRespShape, lambda a: ProduceResp(*a[1:])),
    3: codec.FastDecoder(_ReadReqShape, _build_read_req),
    4: codec.FastDecoder(_ReadRespShape, lambda a: ReadResp(*a[1:])),
    8: codec.FastDecoder(_ProduceBatchReqShape, _build_produce_batch_req),
    9: codec.FastDecoder(_ProduceBatchRespShape, lambda a: ProduceBatchResp(a[1], a[2])),
}

# type code -> (name, array length including the code, decoder)
_DECODERS: dict[int, tuple[str, int, Callable[[list[Any]], Any]]] = {
    1: ("ProduceReq", 8, _dec_produce_req),
    2: ("ProduceResp", 6, _dec_produce_resp),
    3: ("ReadReq", 6, _dec_read_req),
    4: ("ReadResp", 7, _dec_read_resp),
    5: ("StatusReq", 2, _dec_status_req),
    6: ("StatusResp", 3, _dec_status_resp),
    7: ("ErrorResp", 4, _dec_error_resp),
    8: ("ProduceBatchReq", 4, _dec_produce_batch_req),
    9: ("ProduceBatchResp", 3, _dec_produce_batch_resp),
    10: ("MetaReq", 5, _dec_meta_req),
    11: ("MetaResp", 8, _dec_meta_resp),
    12: ("StreamsReq", 3, _dec_streams_req),
    13: ("StreamsResp", 3, _dec_streams_resp),
    14: ("ReloadReq", 2, _dec_reload_req),
    15: ("ReloadResp", 5, _dec_reload_resp),
}


def decode(
    frame: object, max_frame_bytes: int, max_batch_items: int = MAX_BATCH_ITEMS
) -> ClientMessage:
    """The client message in `frame`; raises only `FrameError` subclasses, for any input.
    `max_batch_items`: the most items a ProduceBatchReq may hold (a relay passes its
    limits.max_batch_entries)."""
    msg: ClientMessage = codec.decode_with(
        frame, max_frame_bytes, _DECODERS, "client message", _FAST_DECODERS
    )
    if type(msg) is ProduceBatchReq and len(msg.items) > max_batch_items:
        _bad("ProduceBatchReq.items", f"1..{max_batch_items} items", f"{len(msg.items)} items")
    return msg


def peek_request_id(frame: bytes) -> int:
    """The request id of a frame `decode` refused, if its first bytes show one; else -1.
    Reads at most the first 64 bytes; never raises."""
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=128)
        unpacker.feed(bytes(frame[:64]))
        if unpacker.read_array_header() < 2:
            return -1
        code = unpacker.unpack()
        request_id = unpacker.unpack()
        if type(code) is int and type(request_id) is int and 0 <= request_id <= MAX_U63:
            return request_id
    except Exception:
        pass
    return -1
