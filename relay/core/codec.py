"""The wire codec: every peer message is one msgpack array `[type_code, field1, field2, ...]`.

Fields follow the message's field order. Nested values:

    Transaction   -> [producer_id, producer_seq, key (nil or bin), value, kind]
    Entry         -> [seq, producer_id, producer_seq, key, value, kind]   (flattened)
    Report        -> [point, digest]
    StreamStatus  -> [stream, last_link_seq, committed_point, committed_digest, joined,
                      acks, inherited, votes_final_through, view, want_in,
                      inherited_acks, inherited_omitted, config, members, wanted]
    DedupeKey     -> [producer_id, producer_seq, seq, content hash (16 bytes)]
    enums         -> their `.value` string;  `dedupe=None` -> nil
    view changes  -> relay/core/codec_views.py

`encode` trusts its input (it comes from our own core) and is on the hot path: one
hand-written function per type, no reflection. `decode` is where remote bytes enter: it
validates every field and raises only subclasses of `relay.errors.FrameError`, whatever the
bytes are:

    OversizedFrame      the frame is longer than `max_frame_bytes` (checked before unpacking)
    MalformedFrame      not msgpack, trailing data, not an array of the expected shape/length
                        (also a nested array where a scalar was expected, or vice versa)
    UnknownMessageType  the type code is an int this version does not know
    FieldError          a scalar field has the wrong type or lies outside its range

The frequent frames (TxBatch, Reports) are decoded first in C by msgspec (`FastDecoder`), into
types with the validators' bounds (relay.core.fields); whatever it refuses is decoded again
by the validators, so a bad frame gets the same named error either way.

Wire-level bounds are fixed here (the core may enforce tighter configured ones): stream
names 1..255 UTF-8 bytes without NUL or '|', producer ids 1..64 bytes, digests 16 bytes,
relay ids 0..1023, sequence-like fields 0..2**63-1 (-1 allowed where a field documents "none"),
producer sequences 0..2**64-1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, Literal, NamedTuple, TypeVar

import msgpack
import msgspec

from relay.core import fields
from relay.core.codec_views import (
    dec_value,
    dec_view_decided,
    dec_view_reply,
    dec_view_request,
    enc_entries,
    enc_value,
    enc_view_decided,
    enc_view_reply,
    enc_view_request,
)
from relay.core.fields import array as _array
from relay.core.fields import enum as _enum
from relay.core.fields import producer_id as _producer_id
from relay.core.fields import show as _show
from relay.core.fields import stream as _stream
from relay.core.messages import (
    DedupeKey,
    Forward,
    ForwardReply,
    Heartbeat,
    JoinReply,
    JoinRequest,
    Outcome,
    PeerMessage,
    Relayed,
    RepairReply,
    RepairRequest,
    RepairStatus,
    Reports,
    StreamStatus,
    TxBatch,
    ViewDecided,
    ViewReply,
    ViewRequest,
    ViewValue,
)
from relay.errors import FieldError, FrameError, MalformedFrame, OversizedFrame, UnknownMessageType

__all__ = [
    "RELAYED_OVERHEAD_BYTES",
    "TYPE_CODES",
    "AcceptorRecord",
    "decode",
    "decode_bundle",
    "encode",
    "encode_bundle",
    "is_bundle",
    "peer_frame_limit",
]

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
    # 10 was Refusal (clocks too far apart were refused; now they fence themselves, 5.2)
    ViewRequest: 11,
    ViewReply: 12,
    ViewDecided: 13,
    Relayed: 14,
}

# A Relayed frame wraps a peer frame of up to max_frame_bytes: its own header (type code,
# four ids and numbers, the bin header) takes at most this much more.
RELAYED_OVERHEAD_BYTES = 64
# The largest frame a Relayed may carry: the wire-level bound (the core checks the
# configured max_frame_bytes when it decodes what is inside).
MAX_CARRIED_FRAME_BYTES = 1 << 30


# A bundle is not a message: consecutive frames one relay sends in one turn to one topic,
# carried as one (`[0, [frame, ...]]`, docs/protocol.md section 3). Its receiver takes the
# frames inside in order, each exactly as if it had come alone.
BUNDLE_CODE = 0
BUNDLE_PREFIX = bytes((0x92, BUNDLE_CODE))  # a 2-array (fixarray) starting with the code
BUNDLE_MAX_FRAMES = 64  # frames in one bundle (a turn's output for one topic is a few)
# Bytes in one bundle at most (and at most the sender's max_frame_bytes): relays whose
# max_frame_bytes differ (a roll onto a new value, docs/deploy.md section 4) never send
# each other a bundle the other refuses while both hold at least this much; a larger
# bundle would save nothing worth having.
BUNDLE_MAX_BYTES = 1 << 20
# What a bundle adds to its frames: its headers, and each frame's bin header.
BUNDLE_OVERHEAD_BYTES = 8
BUNDLE_ITEM_OVERHEAD_BYTES = 5


def peer_frame_limit(max_frame_bytes: int) -> int:
    """The largest frame that may arrive from a peer: a message of up to max_frame_bytes,
    or one passed on inside a Relayed."""
    return max_frame_bytes + RELAYED_OVERHEAD_BYTES


T = TypeVar("T")


# --- encoding -----------------------------------------------------------------------------
#
# Tuples pack as msgpack arrays, so tuples of plain values (points, redirect, dedupe) are
# handed to the packer as they are.


def _enc_tx_batch(m: TxBatch) -> tuple[Any, ...]:
    return (1, m.sender, m.incarnation, m.floor, m.stream, m.link_seq, enc_entries(m.entries))


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
        m.lead,
        m.config,
    )


def _enc_join_request(m: JoinRequest) -> tuple[Any, ...]:
    return (
        3,
        m.sender,
        m.incarnation,
        m.floor,
        m.stream,
        m.link_seq,
        m.need_point,
        m.config,
        m.members,
    )


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
            s.view,
            s.want_in,
            s.inherited_acks,
            s.inherited_omitted,
            s.config,
            s.members,
            s.wanted,
        )
        for s in m.streams
    ]
    return (
        4,
        m.sender,
        m.incarnation,
        m.floor,
        streams,
        m.wall_ms,
        m.hears,
        m.interval_ms,
        m.settled,
        m.spool_full,
    )


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
        enc_value(m.view),
        m.config,
        m.members,
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
        enc_entries(m.entries),
        m.reports,
        m.config,
    )


def _enc_relayed(m: Relayed) -> tuple[Any, ...]:
    return (14, m.sender, m.incarnation, m.floor, m.target, m.to, m.frame)


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
    ViewRequest: enc_view_request,
    ViewReply: enc_view_reply,
    ViewDecided: enc_view_decided,
    Relayed: _enc_relayed,
}

# One msgspec encoder for every frame: it packs the same bytes as msgpack's Packer, about
# twice as fast, and keeps no state between calls (each returns a new bytes object).
ENCODER = msgspec.msgpack.Encoder()


def encode(msg: PeerMessage) -> bytes:
    """One msgpack frame for `msg`. Raises TypeError for a type that is not a peer message."""
    try:
        enc = _ENCODERS[type(msg)]
    except KeyError:
        raise TypeError(f"not a peer message: {type(msg).__name__}") from None
    return ENCODER.encode(enc(msg))


def encode_bundle(frames: list[bytes]) -> bytes:
    """One frame that carries `frames` (1..BUNDLE_MAX_FRAMES encoded messages) in order."""
    return ENCODER.encode((BUNDLE_CODE, frames))


_OUTCOMES = {o.value: o for o in Outcome}
_REPAIR_STATUSES = {s.value: s for s in RepairStatus}


# --- decoding: one function per message type ------------------------------------------------
#
# Each receives the whole top-level array, its length already checked against the type.


def _dec_tx_batch(a: list[Any]) -> TxBatch:
    return TxBatch(
        fields.relay_id(a[1], "TxBatch.sender"),
        fields.u64(a[2], "TxBatch.incarnation"),
        fields.u63(a[3], "TxBatch.floor"),
        _stream(a[4], "TxBatch.stream"),
        fields.u63(a[5], "TxBatch.link_seq"),
        fields.entries(a[6], "TxBatch.entries"),
    )


def _dec_reports(a: list[Any]) -> Reports:
    return Reports(
        fields.relay_id(a[1], "Reports.sender"),
        fields.u64(a[2], "Reports.incarnation"),
        fields.u63(a[3], "Reports.floor"),
        _stream(a[4], "Reports.stream"),
        fields.u63(a[5], "Reports.link_seq"),
        fields.reports(a[6], "Reports.points"),
        fields.u63_or_none(a[7], "Reports.committed_point"),
        fields.digest(a[8], "Reports.committed_digest"),
        fields.acks(a[9], "Reports.acks"),
        fields.u63_or_none(a[10], "Reports.lead"),
        fields.u63(a[11], "Reports.config"),
    )


def _dec_join_request(a: list[Any]) -> JoinRequest:
    return JoinRequest(
        fields.relay_id(a[1], "JoinRequest.sender"),
        fields.u64(a[2], "JoinRequest.incarnation"),
        fields.u63(a[3], "JoinRequest.floor"),
        _stream(a[4], "JoinRequest.stream"),
        fields.u63(a[5], "JoinRequest.link_seq"),
        fields.u63_or_none(a[6], "JoinRequest.need_point"),
        fields.u63(a[7], "JoinRequest.config"),
        fields.members(a[8], "JoinRequest.members"),
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
            view,
            want_in,
            inherited_acks,
            inherited_omitted,
            config,
            members,
            wanted,
        ) = _array(s, f"Heartbeat.streams[{i}]", 15)
        name = f"Heartbeat.streams[{i}]"
        streams.append(
            StreamStatus(
                _stream(stream, name + ".stream"),
                fields.u63(last_link_seq, name + ".last_link_seq"),
                fields.u63_or_none(committed_point, name + ".committed_point"),
                fields.digest(committed_digest, name + ".committed_digest"),
                fields.boolean(joined, name + ".joined"),
                fields.acks(acks, name + ".acks"),
                fields.reports(inherited, name + ".inherited"),
                fields.u63_or_none(votes_final_through, name + ".votes_final_through"),
                fields.u63(view, name + ".view"),
                fields.boolean(want_in, name + ".want_in"),
                fields.acks(inherited_acks, name + ".inherited_acks"),
                fields.boolean(inherited_omitted, name + ".inherited_omitted"),
                fields.u63(config, name + ".config"),
                fields.members(members, name + ".members"),
                fields.members(wanted, name + ".wanted"),
            )
        )
    return Heartbeat(
        fields.relay_id(a[1], "Heartbeat.sender"),
        fields.u64(a[2], "Heartbeat.incarnation"),
        fields.u63(a[3], "Heartbeat.floor"),
        tuple(streams),
        fields.u63(a[5], "Heartbeat.wall_ms"),
        fields.relay_ids(a[6], "Heartbeat.hears"),
        fields.u63(a[7], "Heartbeat.interval_ms"),
        fields.boolean(a[8], "Heartbeat.settled"),
        fields.boolean(a[9], "Heartbeat.spool_full"),
    )


def _dec_forward(a: list[Any]) -> Forward:
    return Forward(
        fields.relay_id(a[1], "Forward.sender"),
        fields.u64(a[2], "Forward.incarnation"),
        fields.u63(a[3], "Forward.floor"),
        fields.relay_id(a[4], "Forward.target"),
        _stream(a[5], "Forward.stream"),
        fields.u63(a[6], "Forward.request_id"),
        fields.transaction(a[7], "Forward.tx"),
    )


def _dec_forward_reply(a: list[Any]) -> ForwardReply:
    redirect = tuple(
        fields.relay_id(r, f"ForwardReply.redirect[{i}]")
        for i, r in enumerate(_array(a[9], "ForwardReply.redirect"))
    )
    return ForwardReply(
        fields.relay_id(a[1], "ForwardReply.sender"),
        fields.u64(a[2], "ForwardReply.incarnation"),
        fields.u63(a[3], "ForwardReply.floor"),
        fields.relay_id(a[4], "ForwardReply.target"),
        fields.u63(a[5], "ForwardReply.request_id"),
        _enum(a[6], _OUTCOMES, "ForwardReply.outcome"),
        # -1 when the outcome is not `committed` (ProduceReply's default, relayed as is)
        fields.u63_or_none(a[7], "ForwardReply.seq"),
        fields.string(a[8], "ForwardReply.reason"),
        redirect,
    )


def _dec_join_reply(a: list[Any]) -> JoinReply:
    raw = a[10]
    dedupe: tuple[DedupeKey, ...] | None = None
    if raw is not None:
        keys = []
        for i, k in enumerate(_array(raw, "JoinReply.dedupe")):
            pid, pseq, seq, content = _array(k, f"JoinReply.dedupe[{i}]", 4)
            name = f"JoinReply.dedupe[{i}]"
            keys.append(
                (
                    _producer_id(pid, name + ".producer_id"),
                    fields.u64(pseq, name + ".producer_seq"),
                    fields.u63(seq, name + ".seq"),
                    fields.digest(content, name + ".content"),
                )
            )
        dedupe = tuple(keys)
    return JoinReply(
        fields.relay_id(a[1], "JoinReply.sender"),
        fields.u64(a[2], "JoinReply.incarnation"),
        fields.u63(a[3], "JoinReply.floor"),
        fields.relay_id(a[4], "JoinReply.target"),
        _stream(a[5], "JoinReply.stream"),
        fields.boolean(a[6], "JoinReply.fresh"),
        fields.u63_or_none(a[7], "JoinReply.committed_point"),
        fields.digest(a[8], "JoinReply.committed_digest"),
        fields.u63_or_none(a[9], "JoinReply.max_seen_reported"),
        dedupe,
        fields.reports(a[11], "JoinReply.your_votes"),
        dec_value(a[12], "JoinReply.view"),
        fields.u63(a[13], "JoinReply.config"),
        fields.members(a[14], "JoinReply.members"),
    )


def _dec_repair_request(a: list[Any]) -> RepairRequest:
    origin = a[9]
    if not (type(origin) is int and origin == -1):
        fields.relay_id(origin, "RepairRequest.origin (-1 or relay id)")
    return RepairRequest(
        fields.relay_id(a[1], "RepairRequest.sender"),
        fields.u64(a[2], "RepairRequest.incarnation"),
        fields.u63(a[3], "RepairRequest.floor"),
        fields.relay_id(a[4], "RepairRequest.target"),
        _stream(a[5], "RepairRequest.stream"),
        fields.u63(a[6], "RepairRequest.request_id"),
        fields.u63(a[7], "RepairRequest.lo"),
        fields.u63(a[8], "RepairRequest.hi"),
        origin,
    )


def _dec_repair_reply(a: list[Any]) -> RepairReply:
    return RepairReply(
        fields.relay_id(a[1], "RepairReply.sender"),
        fields.u64(a[2], "RepairReply.incarnation"),
        fields.u63(a[3], "RepairReply.floor"),
        fields.relay_id(a[4], "RepairReply.target"),
        _stream(a[5], "RepairReply.stream"),
        fields.u63(a[6], "RepairReply.request_id"),
        _enum(a[7], _REPAIR_STATUSES, "RepairReply.status"),
        fields.u63(a[8], "RepairReply.lo"),
        fields.u63(a[9], "RepairReply.hi"),
        fields.boolean(a[10], "RepairReply.more"),
        fields.entries(a[11], "RepairReply.entries"),
        fields.reports(a[12], "RepairReply.reports"),
        fields.u63(a[13], "RepairReply.config"),
    )


def _dec_relayed(a: list[Any]) -> Relayed:
    return Relayed(
        fields.relay_id(a[1], "Relayed.sender"),
        fields.u64(a[2], "Relayed.incarnation"),
        fields.u63(a[3], "Relayed.floor"),
        fields.relay_id(a[4], "Relayed.target"),
        fields.relay_id(a[5], "Relayed.to"),
        fields.frame(a[6], "Relayed.frame", MAX_CARRIED_FRAME_BYTES),
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
    ViewRequest: dec_view_request,
    ViewReply: dec_view_reply,
    ViewDecided: dec_view_decided,
    Relayed: _dec_relayed,
}

# type code -> (message type, array length including the code, decoder)
_DECODERS: dict[int, tuple[type, int, Callable[[list[Any]], Any]]] = {
    code: (cls, 1 + len(msgspec.structs.fields(cls)), _DECODER_OF[cls])
    for cls, code in TYPE_CODES.items()
}

_DECODERS_BY_NAME = {code: (cls.__name__, n, dec) for code, (cls, n, dec) in _DECODERS.items()}

assert set(_ENCODERS) == set(TYPE_CODES) == set(_DECODER_OF)
assert len(set(TYPE_CODES.values())) == len(TYPE_CODES)


# Not messages: a relay's acceptor memory on its own disk. Code 22 also keeps the stream's
# configuration, whether anything committed under it, and the decided view that took this
# relay off the stream (5.15); a record of code 21 (an earlier release's) has no such view,
# and one of code 20 has none of the three.
ACCEPTOR_RECORD_CODE = 22
UNLEFT_ACCEPTOR_RECORD_CODE = 21
LEGACY_ACCEPTOR_RECORD_CODE = 20


class AcceptorRecord(NamedTuple):
    number: int
    promised: int
    accepted_ballot: int
    accepted: ViewValue | None
    config: int = 0  # the configuration's version (0: provisional, or none recorded)
    members: tuple[int, ...] = ()
    committed: bool = False  # something committed above the genesis under it
    left: ViewValue | None = None  # the decided change that removed us (RelayState.left_views)


def encode_acceptor(record: AcceptorRecord) -> bytes:
    """What a relay must remember of a stream to take part in its view change `number`
    (5.12) after a restart, and the configuration it runs the stream under (5.15): one
    msgpack array."""
    body = (
        ACCEPTOR_RECORD_CODE,
        record.number,
        record.promised,
        record.accepted_ballot,
        enc_value(record.accepted),
        record.config,
        record.members,
        record.committed,
        enc_value(record.left),
    )
    return ENCODER.encode(body)


def decode_acceptor(record: bytes, max_frame_bytes: int) -> AcceptorRecord:
    """`encode_acceptor`'s record from its bytes (no view that removed us for a record of
    code 21; version 0, no relays and nothing committed either for one of code 20);
    raises only `FrameError` subclasses, for any input."""
    out: AcceptorRecord = decode_with(
        record, max_frame_bytes, _ACCEPTOR_DECODERS, "acceptor record"
    )
    return out


def _dec_acceptor(a: list[Any]) -> AcceptorRecord:
    head = (
        fields.u63(a[1], "AcceptorRecord.number"),
        fields.u63_or_none(a[2], "AcceptorRecord.promised"),
        fields.u63_or_none(a[3], "AcceptorRecord.accepted_ballot"),
    )
    if a[0] == LEGACY_ACCEPTOR_RECORD_CODE:
        return AcceptorRecord(*head, dec_value(a[4], "AcceptorRecord.accepted", legacy=True))
    return AcceptorRecord(
        *head,
        dec_value(a[4], "AcceptorRecord.accepted"),
        fields.u63(a[5], "AcceptorRecord.config"),
        fields.members(a[6], "AcceptorRecord.members"),
        fields.boolean(a[7], "AcceptorRecord.committed"),
        dec_value(a[8], "AcceptorRecord.left") if a[0] == ACCEPTOR_RECORD_CODE else None,
    )


_ACCEPTOR_DECODERS = {
    ACCEPTOR_RECORD_CODE: ("AcceptorRecord", 9, _dec_acceptor),
    UNLEFT_ACCEPTOR_RECORD_CODE: ("AcceptorRecord", 8, _dec_acceptor),
    LEGACY_ACCEPTOR_RECORD_CODE: ("AcceptorRecord", 5, _dec_acceptor),
}


# --- the hot frames, decoded in C (decode_with) --------------------------------------------


class FastDecoder(Generic[T]):
    """Decodes the frames of one type code in C with msgspec: `shape` is the whole frame as
    a msgspec type with the same bounds as the type's validators (relay.core.fields), and
    `build` makes the message of what msgspec returns, raising a FrameError for whatever
    msgspec could not check (e.g. stream names)."""

    __slots__ = ("build", "decoder")

    def __init__(self, shape: Any, build: Callable[[Any], T]) -> None:
        self.decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(shape)
        self.build = build


_TxBatchShape = tuple[
    Literal[1], fields.RelayId, fields.U64, fields.U63, str, fields.U63, list[fields.WireEntry]
]
_ReportsShape = tuple[
    Literal[2],
    fields.RelayId,
    fields.U64,
    fields.U63,
    str,
    fields.U63,
    tuple[tuple[fields.U63, fields.Digest], ...],
    fields.U63OrNone,
    fields.Digest,
    tuple[tuple[fields.RelayId, fields.U63], ...],
    fields.U63OrNone,
    fields.U63,
]


def _build_tx_batch(a: Any) -> TxBatch:
    stream = _stream(a[4], "TxBatch.stream")
    return TxBatch(a[1], a[2], a[3], stream, a[5], fields.checked_entries(a[6]))


def _build_reports(a: Any) -> Reports:
    stream = _stream(a[4], "Reports.stream")
    return Reports(a[1], a[2], a[3], stream, a[5], a[6], a[7], a[8], a[9], a[10], a[11])


_FAST_DECODERS: dict[int, FastDecoder[PeerMessage]] = {
    1: FastDecoder(_TxBatchShape, _build_tx_batch),
    2: FastDecoder(_ReportsShape, _build_reports),
}


_BUNDLE_DECODER = msgspec.msgpack.Decoder(tuple[Literal[0], list[bytes]])


def is_bundle(frame: bytes) -> bool:
    return frame[:2] == BUNDLE_PREFIX


def decode_bundle(frame: bytes, max_frame_bytes: int) -> list[bytes]:
    """The frames a bundle carries, for the core to take one by one (each is decoded and
    checked there, as if it came alone). Raises only `FrameError` subclasses: the bundle
    is longer than a peer frame may be, not `[0, [bin, ...]]`, or holds no frame, more
    than BUNDLE_MAX_FRAMES or an empty one. A frame inside that is itself a bundle is
    not split again: the core finds type code 0 unknown."""
    if len(frame) > peer_frame_limit(max_frame_bytes):
        raise OversizedFrame(f"bundle of {len(frame)} bytes exceeds {max_frame_bytes}")
    try:
        _, frames = _BUNDLE_DECODER.decode(frame)
    except msgspec.MsgspecError as e:
        raise MalformedFrame(f"not a bundle of frames ({e})") from None
    if not 0 < len(frames) <= BUNDLE_MAX_FRAMES or not all(frames):
        raise MalformedFrame(
            f"a bundle must carry 1..{BUNDLE_MAX_FRAMES} non-empty frames, got {len(frames)}"
        )
    return frames


def decode(frame: object, max_frame_bytes: int) -> PeerMessage:
    """The peer message in `frame`; raises only `FrameError` subclasses, for any input."""
    msg: PeerMessage = decode_with(
        frame, max_frame_bytes, _DECODERS_BY_NAME, "message", _FAST_DECODERS
    )
    return msg


def decode_with(
    frame: object,
    max_frame_bytes: int,
    decoders: Mapping[int, tuple[str, int, Callable[[list[Any]], T]]],
    what: str,
    fast: Mapping[int, FastDecoder[T]] | None = None,
) -> T:
    """Decode a frame `[type code, field, ...]` with `decoders` (code -> name, array
    length, field decoder): the one place where remote bytes become values, for peer
    and client protocols alike. Raises only `FrameError` subclasses, for any input.
    A type code in `fast` is tried with its FastDecoder first; a frame that one refuses
    is decoded again by `decoders`, which say what was wrong (or accept it: the
    validators, not msgspec, define what is valid)."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise MalformedFrame(f"frame is not bytes: {type(frame).__name__}")
    size = len(frame)
    if size > max_frame_bytes:
        raise OversizedFrame(f"frame of {size} bytes exceeds the maximum of {max_frame_bytes}")
    if size == 0:
        raise MalformedFrame("empty frame")
    # A fixarray header (0x90..0x9f) and then a positive fixint type code.
    if fast is not None and type(frame) is bytes and size > 1 and frame[0] & 0xF0 == 0x90:
        quick = fast.get(frame[1])
        if quick is not None:
            try:
                return quick.build(quick.decoder.decode(frame))
            except Exception:  # DecodeError, ValidationError, UnicodeDecodeError, FrameError
                pass  # the validators below say what was wrong
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
