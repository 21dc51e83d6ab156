"""The wire codec: every peer message is one msgpack array `[type_code, field1, field2, ...]`.

Fields follow the dataclass field order. Nested values:

    Transaction   -> [producer_id, producer_seq, key (nil or bin), value, kind]
    Entry         -> [seq, producer_id, producer_seq, key, value, kind]   (flattened)
    Report        -> [point, digest]
    StreamStatus  -> [stream, last_link_seq, committed_point, committed_digest, joined]
    DedupeKey     -> [producer_id, producer_seq, seq]
    enums         -> their `.value` string;  `dedupe=None` -> nil

`encode` trusts its input (it comes from our own core) and is on the hot path: one
hand-written function per type, no reflection. `decode` is where remote bytes enter: it
validates every field and raises only subclasses of `relay.errors.FrameError`, whatever the
bytes are:

    OversizedFrame      the frame is longer than `max_frame_bytes` (checked before unpacking)
    MalformedFrame      not msgpack, trailing data, not an array of the expected shape/length
                        (also a nested array where a scalar was expected, or vice versa)
    UnknownMessageType  the type code is an int this version does not know
    FieldError          a scalar field has the wrong type or lies outside its range

Wire-level bounds are fixed here (the core may enforce tighter configured ones): stream
names 1..255 UTF-8 bytes without NUL or '|', producer ids 1..64 bytes, digests 16 bytes,
relay ids 0..1023, sequence-like fields 0..2**63-1 (-1 allowed where a field documents "none"),
producer sequences 0..2**64-1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, NoReturn, TypeVar

import msgpack

from relay.core.digest import DIGEST_BYTES
from relay.core.fields import MAX_PRODUCER_ID_BYTES, MAX_TX_KIND
from relay.core.fields import array as _array
from relay.core.fields import bad as _bad
from relay.core.fields import enum as _enum
from relay.core.fields import producer_id as _producer_id
from relay.core.fields import show as _show
from relay.core.fields import stream as _stream
from relay.core.messages import (
    Forward,
    ForwardReply,
    Heartbeat,
    JoinReply,
    JoinRequest,
    Outcome,
    PeerMessage,
    Refusal,
    RepairReply,
    RepairRequest,
    RepairStatus,
    Reports,
    StreamStatus,
    Transaction,
    TxBatch,
)
from relay.core.seq import MAX_RELAY_ID
from relay.errors import FieldError, FrameError, MalformedFrame, OversizedFrame, UnknownMessageType

__all__ = ["TYPE_CODES", "decode", "encode"]

TYPE_CODES: dict[type, int] = {
    TxBatch: 1,
    Reports: 2,
    JoinRequest: 3,
    Heartbeat: 4,
    Forward: 5,
    ForwardReply: 6,
    JoinReply: 7,
    RepairRequest: 8,
    RepairReply: 9,
    Refusal: 10,
}

T = TypeVar("T")

MAX_U63 = (1 << 63) - 1
MAX_U64 = (1 << 64) - 1


# --- encoding -----------------------------------------------------------------------------
#
# Tuples pack as msgpack arrays, so tuples of plain values (points, redirect, dedupe) are
# handed to the packer as they are.


def _enc_entries(entries: tuple[tuple[int, Transaction], ...]) -> list[tuple[Any, ...]]:
    return [(s, t.producer_id, t.producer_seq, t.key, t.value, t.kind) for s, t in entries]


def _enc_tx_batch(m: TxBatch) -> tuple[Any, ...]:
    return (1, m.sender, m.incarnation, m.floor, m.stream, m.link_seq, _enc_entries(m.entries))


def _enc_reports(m: Reports) -> tuple[Any, ...]:
    return (
        2,
        m.sender,
        m.incarnation,
        m.floor,
        m.stream,
        m.link_seq,
        m.points,
        m.committed_point,
        m.committed_digest,
        m.acks,
    )


def _enc_join_request(m: JoinRequest) -> tuple[Any, ...]:
    return (3, m.sender, m.incarnation, m.floor, m.stream, m.link_seq, m.need_point)


def _enc_heartbeat(m: Heartbeat) -> tuple[Any, ...]:
    streams = [
        (
            s.stream,
            s.last_link_seq,
            s.committed_point,
            s.committed_digest,
            s.joined,
            s.acks,
            s.inherited,
            s.votes_final_through,
        )
        for s in m.streams
    ]
    return (4, m.sender, m.incarnation, m.floor, streams)


def _enc_forward(m: Forward) -> tuple[Any, ...]:
    t = m.tx
    tx = (t.producer_id, t.producer_seq, t.key, t.value, t.kind)
    return (5, m.sender, m.incarnation, m.floor, m.target, m.stream, m.request_id, tx)


def _enc_forward_reply(m: ForwardReply) -> tuple[Any, ...]:
    return (
        6,
        m.sender,
        m.incarnation,
        m.floor,
        m.target,
        m.request_id,
        m.outcome.value,
        m.seq,
        m.reason,
        m.redirect,
    )


def _enc_join_reply(m: JoinReply) -> tuple[Any, ...]:
    return (
        7,
        m.sender,
        m.incarnation,
        m.floor,
        m.target,
        m.stream,
        m.fresh,
        m.committed_point,
        m.committed_digest,
        m.max_seen_reported,
        m.dedupe,
        m.your_votes,
    )


def _enc_repair_request(m: RepairRequest) -> tuple[Any, ...]:
    return (
        8,
        m.sender,
        m.incarnation,
        m.floor,
        m.target,
        m.stream,
        m.request_id,
        m.lo,
        m.hi,
        m.origin,
    )


def _enc_repair_reply(m: RepairReply) -> tuple[Any, ...]:
    return (
        9,
        m.sender,
        m.incarnation,
        m.floor,
        m.target,
        m.stream,
        m.request_id,
        m.status.value,
        m.lo,
        m.hi,
        m.more,
        _enc_entries(m.entries),
        m.reports,
    )


def _enc_refusal(m: Refusal) -> tuple[Any, ...]:
    return (10, m.sender, m.incarnation, m.floor, m.target, m.reason)


_ENCODERS: dict[type, Callable[[Any], tuple[Any, ...]]] = {
    TxBatch: _enc_tx_batch,
    Reports: _enc_reports,
    JoinRequest: _enc_join_request,
    Heartbeat: _enc_heartbeat,
    Forward: _enc_forward,
    ForwardReply: _enc_forward_reply,
    JoinReply: _enc_join_reply,
    RepairRequest: _enc_repair_request,
    RepairReply: _enc_repair_reply,
    Refusal: _enc_refusal,
}

# Packers are reused (building one per call costs more than packing a small message).
# list.pop/append are atomic, so concurrent callers never share a packer. A packer keeps its
# grown buffer, so one that packed a large frame is dropped rather than pooled.
_POOL: list[msgpack.Packer] = []
_POOL_MAX = 8
_POOL_KEEP_BYTES = 1 << 20


def encode(msg: PeerMessage) -> bytes:
    """One msgpack frame for `msg`. Raises TypeError for a type that is not a peer message."""
    try:
        enc = _ENCODERS[type(msg)]
    except KeyError:
        raise TypeError(f"not a peer message: {type(msg).__name__}") from None
    body = enc(msg)
    try:
        packer = _POOL.pop()
    except IndexError:
        packer = msgpack.Packer(use_bin_type=True)
    frame: bytes = packer.pack(body)  # resets itself on error too
    if len(frame) <= _POOL_KEEP_BYTES and len(_POOL) < _POOL_MAX:
        _POOL.append(packer)
    return frame


# --- decoding: field validators -------------------------------------------------------------


def _relay_id(v: Any, name: str) -> int:
    if type(v) is not int or not 0 <= v <= MAX_RELAY_ID:
        _bad(name, f"relay id 0..{MAX_RELAY_ID}", v)
    return v


def _u63(v: Any, name: str) -> int:
    if type(v) is not int or not 0 <= v <= MAX_U63:
        _bad(name, "int 0..2**63-1", v)
    return v


def _u63_or_none(v: Any, name: str) -> int:
    """A sequence-like field where -1 means "none"."""
    if type(v) is not int or not -1 <= v <= MAX_U63:
        _bad(name, "int -1..2**63-1", v)
    return v


def _u64(v: Any, name: str) -> int:
    if type(v) is not int or not 0 <= v <= MAX_U64:
        _bad(name, "int 0..2**64-1", v)
    return v


def _bool(v: Any, name: str) -> bool:
    if type(v) is not bool:
        _bad(name, "bool", v)
    return v


def _str(v: Any, name: str) -> str:
    if type(v) is not str:
        _bad(name, "str", v)
    return v


def _digest(v: Any, name: str) -> bytes:
    if type(v) is not bytes or len(v) != DIGEST_BYTES:
        _bad(name, f"{DIGEST_BYTES}-byte digest", v)
    return v


def _tx_ok(pid: Any, pseq: Any, key: Any, value: Any, kind: Any) -> bool:
    return (
        type(kind) is int
        and 0 <= kind <= MAX_TX_KIND
        and type(pid) is bytes
        and 0 < len(pid) <= MAX_PRODUCER_ID_BYTES
        and type(pseq) is int
        and 0 <= pseq <= MAX_U64
        and (key is None or type(key) is bytes)
        and type(value) is bytes
    )


def _bad_tx(pid: Any, pseq: Any, key: Any, value: Any, kind: Any, name: str) -> NoReturn:
    """Raise the FieldError naming the first bad field of a transaction `_tx_ok` refused."""
    _producer_id(pid, name + ".producer_id")
    _u64(pseq, name + ".producer_seq")
    if key is not None and type(key) is not bytes:
        _bad(name + ".key", "bytes or nil", key)
    if type(value) is not bytes:
        _bad(name + ".value", "bytes", value)
    _bad(name + ".kind", f"integer 0..{MAX_TX_KIND}", kind)


def _transaction(v: Any, name: str) -> Transaction:
    pid, pseq, key, value, kind = _array(v, name, 5)
    if not _tx_ok(pid, pseq, key, value, kind):
        _bad_tx(pid, pseq, key, value, kind, name)
    return Transaction(pid, pseq, key, value, kind)


def _entries(v: Any, name: str) -> tuple[tuple[int, Transaction], ...]:
    # The hot path of decoding: no per-entry calls or string formatting unless a field is bad.
    out: list[tuple[int, Transaction]] = []
    append = out.append
    for e in _array(v, name):
        if type(e) is not list or len(e) != 6:
            _array(e, f"{name}[{len(out)}]", 6)
        seq, pid, pseq, key, value, kind = e
        if (
            type(seq) is not int
            or not 0 <= seq <= MAX_U63
            or type(pid) is not bytes
            or not 0 < len(pid) <= MAX_PRODUCER_ID_BYTES
            or type(pseq) is not int
            or not 0 <= pseq <= MAX_U64
            or (key is not None and type(key) is not bytes)
            or type(value) is not bytes
            or type(kind) is not int
            or not 0 <= kind <= MAX_TX_KIND
        ):
            where = f"{name}[{len(out)}]"
            _u63(seq, where + ".seq")
            _bad_tx(pid, pseq, key, value, kind, where)
        append((seq, Transaction(pid, pseq, key, value, kind)))
    return tuple(out)


def _reports(v: Any, name: str) -> tuple[tuple[int, bytes], ...]:
    out = []
    for i, r in enumerate(_array(v, name)):
        point, digest = _array(r, f"{name}[{i}]", 2)
        out.append((_u63(point, f"{name}[{i}].point"), _digest(digest, f"{name}[{i}].digest")))
    return tuple(out)


def _acks(v: Any, name: str) -> tuple[tuple[int, int], ...]:
    out = []
    for i, r in enumerate(_array(v, name)):
        relay, point = _array(r, f"{name}[{i}]", 2)
        out.append((_relay_id(relay, f"{name}[{i}].relay"), _u63(point, f"{name}[{i}].point")))
    return tuple(out)


_OUTCOMES = {o.value: o for o in Outcome}
_REPAIR_STATUSES = {s.value: s for s in RepairStatus}


# --- decoding: one function per message type ------------------------------------------------
#
# Each receives the whole top-level array, its length already checked against the type.


def _dec_tx_batch(a: list[Any]) -> TxBatch:
    return TxBatch(
        _relay_id(a[1], "TxBatch.sender"),
        _u64(a[2], "TxBatch.incarnation"),
        _u63(a[3], "TxBatch.floor"),
        _stream(a[4], "TxBatch.stream"),
        _u63(a[5], "TxBatch.link_seq"),
        _entries(a[6], "TxBatch.entries"),
    )


def _dec_reports(a: list[Any]) -> Reports:
    return Reports(
        _relay_id(a[1], "Reports.sender"),
        _u64(a[2], "Reports.incarnation"),
        _u63(a[3], "Reports.floor"),
        _stream(a[4], "Reports.stream"),
        _u63(a[5], "Reports.link_seq"),
        _reports(a[6], "Reports.points"),
        _u63_or_none(a[7], "Reports.committed_point"),
        _digest(a[8], "Reports.committed_digest"),
        _acks(a[9], "Reports.acks"),
    )


def _dec_join_request(a: list[Any]) -> JoinRequest:
    return JoinRequest(
        _relay_id(a[1], "JoinRequest.sender"),
        _u64(a[2], "JoinRequest.incarnation"),
        _u63(a[3], "JoinRequest.floor"),
        _stream(a[4], "JoinRequest.stream"),
        _u63(a[5], "JoinRequest.link_seq"),
        _u63_or_none(a[6], "JoinRequest.need_point"),
    )


def _dec_heartbeat(a: list[Any]) -> Heartbeat:
    streams = []
    for i, s in enumerate(_array(a[4], "Heartbeat.streams")):
        (
            stream,
            last_link_seq,
            committed_point,
            committed_digest,
            joined,
            acks,
            inherited,
            votes_final_through,
        ) = _array(s, f"Heartbeat.streams[{i}]", 8)
        name = f"Heartbeat.streams[{i}]"
        streams.append(
            StreamStatus(
                _stream(stream, name + ".stream"),
                _u63(last_link_seq, name + ".last_link_seq"),
                _u63_or_none(committed_point, name + ".committed_point"),
                _digest(committed_digest, name + ".committed_digest"),
                _bool(joined, name + ".joined"),
                _acks(acks, name + ".acks"),
                _reports(inherited, name + ".inherited"),
                _u63_or_none(votes_final_through, name + ".votes_final_through"),
            )
        )
    return Heartbeat(
        _relay_id(a[1], "Heartbeat.sender"),
        _u64(a[2], "Heartbeat.incarnation"),
        _u63(a[3], "Heartbeat.floor"),
        tuple(streams),
    )


def _dec_forward(a: list[Any]) -> Forward:
    return Forward(
        _relay_id(a[1], "Forward.sender"),
        _u64(a[2], "Forward.incarnation"),
        _u63(a[3], "Forward.floor"),
        _relay_id(a[4], "Forward.target"),
        _stream(a[5], "Forward.stream"),
        _u63(a[6], "Forward.request_id"),
        _transaction(a[7], "Forward.tx"),
    )


def _dec_forward_reply(a: list[Any]) -> ForwardReply:
    redirect = tuple(
        _relay_id(r, f"ForwardReply.redirect[{i}]")
        for i, r in enumerate(_array(a[9], "ForwardReply.redirect"))
    )
    return ForwardReply(
        _relay_id(a[1], "ForwardReply.sender"),
        _u64(a[2], "ForwardReply.incarnation"),
        _u63(a[3], "ForwardReply.floor"),
        _relay_id(a[4], "ForwardReply.target"),
        _u63(a[5], "ForwardReply.request_id"),
        _enum(a[6], _OUTCOMES, "ForwardReply.outcome"),
        # -1 when the outcome is not `committed` (ProduceReply's default, relayed as is)
        _u63_or_none(a[7], "ForwardReply.seq"),
        _str(a[8], "ForwardReply.reason"),
        redirect,
    )


def _dec_join_reply(a: list[Any]) -> JoinReply:
    raw = a[10]
    dedupe: tuple[tuple[bytes, int, int], ...] | None = None
    if raw is not None:
        keys = []
        for i, k in enumerate(_array(raw, "JoinReply.dedupe")):
            pid, pseq, seq = _array(k, f"JoinReply.dedupe[{i}]", 3)
            name = f"JoinReply.dedupe[{i}]"
            keys.append(
                (
                    _producer_id(pid, name + ".producer_id"),
                    _u64(pseq, name + ".producer_seq"),
                    _u63(seq, name + ".seq"),
                )
            )
        dedupe = tuple(keys)
    return JoinReply(
        _relay_id(a[1], "JoinReply.sender"),
        _u64(a[2], "JoinReply.incarnation"),
        _u63(a[3], "JoinReply.floor"),
        _relay_id(a[4], "JoinReply.target"),
        _stream(a[5], "JoinReply.stream"),
        _bool(a[6], "JoinReply.fresh"),
        _u63_or_none(a[7], "JoinReply.committed_point"),
        _digest(a[8], "JoinReply.committed_digest"),
        _u63_or_none(a[9], "JoinReply.max_seen_reported"),
        dedupe,
        _reports(a[11], "JoinReply.your_votes"),
    )


def _dec_repair_request(a: list[Any]) -> RepairRequest:
    origin = a[9]
    if not (type(origin) is int and origin == -1):
        _relay_id(origin, "RepairRequest.origin (-1 or relay id)")
    return RepairRequest(
        _relay_id(a[1], "RepairRequest.sender"),
        _u64(a[2], "RepairRequest.incarnation"),
        _u63(a[3], "RepairRequest.floor"),
        _relay_id(a[4], "RepairRequest.target"),
        _stream(a[5], "RepairRequest.stream"),
        _u63(a[6], "RepairRequest.request_id"),
        _u63(a[7], "RepairRequest.lo"),
        _u63(a[8], "RepairRequest.hi"),
        origin,
    )


def _dec_repair_reply(a: list[Any]) -> RepairReply:
    return RepairReply(
        _relay_id(a[1], "RepairReply.sender"),
        _u64(a[2], "RepairReply.incarnation"),
        _u63(a[3], "RepairReply.floor"),
        _relay_id(a[4], "RepairReply.target"),
        _stream(a[5], "RepairReply.stream"),
        _u63(a[6], "RepairReply.request_id"),
        _enum(a[7], _REPAIR_STATUSES, "RepairReply.status"),
        _u63(a[8], "RepairReply.lo"),
        _u63(a[9], "RepairReply.hi"),
        _bool(a[10], "RepairReply.more"),
        _entries(a[11], "RepairReply.entries"),
        _reports(a[12], "RepairReply.reports"),
    )


def _dec_refusal(a: list[Any]) -> Refusal:
    return Refusal(
        _relay_id(a[1], "Refusal.sender"),
        _u64(a[2], "Refusal.incarnation"),
        _u63(a[3], "Refusal.floor"),
        _relay_id(a[4], "Refusal.target"),
        _str(a[5], "Refusal.reason"),
    )


_DECODER_OF: dict[type, Callable[[list[Any]], Any]] = {
    TxBatch: _dec_tx_batch,
    Reports: _dec_reports,
    JoinRequest: _dec_join_request,
    Heartbeat: _dec_heartbeat,
    Forward: _dec_forward,
    ForwardReply: _dec_forward_reply,
    JoinReply: _dec_join_reply,
    RepairRequest: _dec_repair_request,
    RepairReply: _dec_repair_reply,
    Refusal: _dec_refusal,
}

# type code -> (message type, array length including the code, decoder)
_DECODERS: dict[int, tuple[type, int, Callable[[list[Any]], Any]]] = {
    code: (cls, 1 + len(fields(cls)), _DECODER_OF[cls]) for cls, code in TYPE_CODES.items()
}

_DECODERS_BY_NAME = {code: (cls.__name__, n, dec) for code, (cls, n, dec) in _DECODERS.items()}

assert set(_ENCODERS) == set(TYPE_CODES) == set(_DECODER_OF)
assert len(set(TYPE_CODES.values())) == len(TYPE_CODES)


def decode(frame: bytes, max_frame_bytes: int) -> PeerMessage:
    """The peer message in `frame`; raises only `FrameError` subclasses, for any input."""
    msg: PeerMessage = decode_with(frame, max_frame_bytes, _DECODERS_BY_NAME, "message")
    return msg


def decode_with(
    frame: bytes,
    max_frame_bytes: int,
    decoders: Mapping[int, tuple[str, int, Callable[[list[Any]], T]]],
    what: str,
) -> T:
    """Decode a frame `[type code, field, ...]` with `decoders` (code -> name, array
    length, field decoder): the one place where remote bytes become values, for peer
    and client protocols alike. Raises only `FrameError` subclasses, for any input."""
    try:
        size = len(frame)
    except TypeError:
        raise MalformedFrame(f"frame is not bytes: {type(frame).__name__}") from None
    if size > max_frame_bytes:
        raise OversizedFrame(f"frame of {size} bytes exceeds the maximum of {max_frame_bytes}")
    if size == 0:
        raise MalformedFrame("empty frame")
    try:
        # No string, bin, array or map can be longer than the frame itself; bounding them
        # by its size stops a 5-byte header from making the unpacker pre-allocate gigabytes.
        obj = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size,
            max_ext_len=size,
        )
    except msgpack.ExtraData:
        raise MalformedFrame("trailing data after the message") from None
    except Exception as e:  # ValueError, FormatError, StackError, UnicodeDecodeError, ...
        raise MalformedFrame(f"not a msgpack message ({type(e).__name__}: {e})") from None

    if type(obj) is not list or not obj:
        raise MalformedFrame(f"expected a non-empty array, got {_show(obj)}")
    code = obj[0]
    if type(code) is not int:
        raise MalformedFrame(f"type code is not an int: {_show(code)}")
    found = decoders.get(code)
    if found is None:
        raise UnknownMessageType(f"unknown {what} type code {code}")
    name, length, dec = found
    if len(obj) != length:
        raise MalformedFrame(f"{name}: expected an array of {length} items, got {len(obj)}")
    try:
        return dec(obj)
    except FrameError:
        raise
    except Exception as e:  # a gap in the validators must still not escape the boundary
        raise FieldError(f"{name}: invalid field ({type(e).__name__}: {e})") from None
