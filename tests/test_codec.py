"""The wire codec: round trips for every message type, and a decoder that only ever raises
FrameError subclasses, whatever bytes arrive."""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from relay.core import codec
from relay.core.codec import (
    TYPE_CODES,
    AcceptorRecord,
    decode,
    decode_acceptor,
    encode,
    encode_acceptor,
)
from relay.core.messages import (
    Forward,
    ForwardReply,
    Heartbeat,
    Interval,
    JoinReply,
    JoinRequest,
    Outcome,
    Relayed,
    RepairReply,
    RepairRequest,
    RepairStatus,
    Reports,
    StreamStatus,
    Transaction,
    TxBatch,
    ViewDecided,
    ViewPhase,
    ViewReply,
    ViewRequest,
    ViewValue,
)
from relay.errors import (
    FieldError,
    FrameError,
    MalformedFrame,
    OversizedFrame,
    UnknownMessageType,
)

MAX = 64 * 1024 * 1024
U63 = 2**63 - 1
U64 = 2**64 - 1
D = b"\x11" * 16
T = Transaction(b"p", 1, None, b"v")

# --- strategies -----------------------------------------------------------------------------

relay_ids = st.integers(0, 1023)
incarnations = st.integers(0, U64)
u63 = st.integers(0, U63)
u63_or_none = st.integers(-1, U63)
u64 = st.integers(0, U64)
digests = st.binary(min_size=16, max_size=16)
producer_ids = st.binary(min_size=1, max_size=64)
reasons = st.text(max_size=40)
streams = st.one_of(
    st.text(
        alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00|"),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from(["orders.eu", "a", "x" * 255, "é" * 127]),
).filter(lambda s: len(s.encode()) <= 255)
transactions = st.builds(
    Transaction,
    producer_ids,
    u64,
    st.none() | st.binary(max_size=32),
    st.binary(max_size=64),
    st.integers(0, 255),
)
entries = st.lists(st.tuples(u63, transactions), max_size=5).map(tuple)
report_points = st.lists(st.tuples(u63, digests), max_size=5).map(tuple)
acks = st.lists(st.tuples(relay_ids, u63), max_size=5).map(tuple)
intervals = st.builds(Interval, relay_ids, u64, u63_or_none, u63_or_none)
# a configuration's relays (5.15): ascending, each once
members = st.sets(relay_ids, max_size=6).map(lambda ids: tuple(sorted(ids)))
view_values = st.builds(
    ViewValue,
    u63,
    u63_or_none,
    u63_or_none,
    st.lists(intervals, max_size=4).map(tuple),
    entries,
    u63,
    members,
)
stream_statuses = st.builds(
    StreamStatus,
    streams,
    u63,
    u63_or_none,
    digests,
    st.booleans(),
    acks,
    report_points,
    u63_or_none,
    u63,
    st.booleans(),
    acks,
    st.booleans(),
    u63,
    members,
)
dedupe_keys = st.tuples(producer_ids, u64, u63, digests)

messages: dict[type, st.SearchStrategy[Any]] = {
    TxBatch: st.builds(TxBatch, relay_ids, incarnations, u63, streams, u63, entries),
    Reports: st.builds(
        Reports,
        relay_ids,
        incarnations,
        u63,
        streams,
        u63,
        report_points,
        u63_or_none,
        digests,
        acks,
        u63_or_none,
        u63,
    ),
    JoinRequest: st.builds(
        JoinRequest, relay_ids, incarnations, u63, streams, u63, u63_or_none, u63, members
    ),
    Heartbeat: st.builds(
        Heartbeat,
        relay_ids,
        incarnations,
        u63,
        st.lists(stream_statuses, max_size=4).map(tuple),
        u63,
        st.lists(relay_ids, max_size=5).map(tuple),
        u63,
        st.booleans(),
        st.booleans(),
    ),
    Forward: st.builds(
        Forward, relay_ids, incarnations, u63, relay_ids, streams, u63, transactions
    ),
    ForwardReply: st.builds(
        ForwardReply,
        relay_ids,
        incarnations,
        u63,
        relay_ids,
        u63,
        st.sampled_from(Outcome),
        u63_or_none,
        reasons,
        st.lists(relay_ids, max_size=5).map(tuple),
    ),
    JoinReply: st.builds(
        JoinReply,
        relay_ids,
        incarnations,
        u63,
        relay_ids,
        streams,
        st.booleans(),
        u63_or_none,
        digests,
        u63_or_none,
        st.none() | st.lists(dedupe_keys, max_size=4).map(tuple),
        report_points,
        st.none() | view_values,
        u63,
        members,
    ),
    RepairRequest: st.builds(
        RepairRequest,
        relay_ids,
        incarnations,
        u63,
        relay_ids,
        streams,
        u63,
        u63,
        u63,
        st.integers(-1, 1023),
    ),
    RepairReply: st.builds(
        RepairReply,
        relay_ids,
        incarnations,
        u63,
        relay_ids,
        streams,
        u63,
        st.sampled_from(RepairStatus),
        u63,
        u63,
        st.booleans(),
        entries,
        report_points,
        u63,
    ),
    ViewRequest: st.builds(
        ViewRequest,
        relay_ids,
        incarnations,
        u63,
        relay_ids,
        streams,
        st.sampled_from(ViewPhase),
        u63,
        u63,
        st.lists(relay_ids, max_size=4).map(tuple),
        st.none() | view_values,
        u63,
        members,
    ),
    ViewReply: st.builds(
        ViewReply,
        relay_ids,
        incarnations,
        u63,
        relay_ids,
        streams,
        st.sampled_from(ViewPhase),
        u63,
        u63,
        st.booleans(),
        u63_or_none,
        u63_or_none,
        u63_or_none,
        u63_or_none,
        st.none() | view_values,
        entries,
        u63,
        members,
    ),
    ViewDecided: st.builds(
        ViewDecided, relay_ids, incarnations, u63, relay_ids, streams, view_values
    ),
    Relayed: st.builds(
        Relayed, relay_ids, incarnations, u63, relay_ids, relay_ids, st.binary(min_size=1)
    ),
}
any_message = st.one_of(*messages.values())

# msgpack values of any shape, to put where a field is expected
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64)
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)


def outcome_of(frame: bytes) -> object:
    """decode's result, or the FrameError it raised; anything else propagates and fails."""
    try:
        return decode(frame, MAX)
    except FrameError as e:
        return e


def wire(frame: bytes) -> list[Any]:
    decoded: list[Any] = msgpack.unpackb(frame, raw=False)
    return decoded


def frame_of(*items: Any) -> bytes:
    packed: bytes = msgpack.packb(list(items), use_bin_type=True)
    return packed


def tx_batch(**changes: Any) -> TxBatch:
    base = TxBatch(
        sender=1,
        incarnation=2,
        floor=3,
        stream="orders.eu",
        link_seq=4,
        entries=((5, Transaction(b"p", 6, None, b"v")), (7, Transaction(b"q", 8, b"k", b""))),
    )
    return msgspec.structs.replace(base, **changes)


def as_list(m: Any) -> list[Any]:
    return wire(encode(m))


# --- round trips ----------------------------------------------------------------------------


def test_type_codes() -> None:
    expected = {
        TxBatch: 1,
        Reports: 2,
        JoinRequest: 3,
        Heartbeat: 4,
        Forward: 5,
        ForwardReply: 6,
        JoinReply: 7,
        RepairRequest: 8,
        RepairReply: 9,
        ViewRequest: 11,
        ViewReply: 12,
        ViewDecided: 13,
        Relayed: 14,
    }
    assert expected == TYPE_CODES


@pytest.mark.parametrize("cls", list(messages), ids=lambda c: c.__name__)
@settings(max_examples=150)
@given(data=st.data())
def test_round_trip_each_type(cls: type, data: st.DataObject) -> None:
    m = data.draw(messages[cls])
    frame = encode(m)
    assert isinstance(frame, bytes)
    assert wire(frame)[0] == TYPE_CODES[cls]
    back = decode(frame, MAX)
    assert back == m
    assert type(back) is cls
    hash(back)  # every container came back as a tuple, so the whole message is hashable


@given(any_message)
def test_decoded_frame_fits_exactly(m: Any) -> None:
    frame = encode(m)
    assert decode(frame, len(frame)) == m
    with pytest.raises(OversizedFrame):
        decode(frame, len(frame) - 1)


def test_wire_layout() -> None:
    assert as_list(tx_batch()) == [
        1,
        1,
        2,
        3,
        "orders.eu",
        4,
        [[5, b"p", 6, None, b"v", 0], [7, b"q", 8, b"k", b"", 0]],
    ]
    assert as_list(Forward(1, 2, 3, 4, "s", 5, Transaction(b"p", 6, b"", b"v"))) == [
        5,
        1,
        2,
        3,
        4,
        "s",
        5,
        [b"p", 6, b"", b"v", 0],
    ]
    reports = Reports(1, 2, 3, "s", 4, ((5, D),), -1, D)
    assert as_list(reports) == [2, 1, 2, 3, "s", 4, [[5, D]], -1, D, [], -1, 0]
    reports = msgspec.structs.replace(reports, acks=((6, 7), (8, 9)), lead=10, config=3)
    assert as_list(reports)[-3:] == [[[6, 7], [8, 9]], 10, 3]
    hb = Heartbeat(1, 2, 3, (StreamStatus("s", 4, -1, D, True),))
    assert as_list(hb) == [
        4,
        1,
        2,
        3,
        [["s", 4, -1, D, True, [], [], -1, 0, False, [], False, 0, [], []]],
        0,
        [],
        0,
        False,
        False,
    ]
    status = StreamStatus(
        "s", 4, -1, D, True, ((5, 6),), ((7, D),), 8, 9, True, ((1, 3),), True, 1, (0, 1, 2), (0, 1)
    )
    hb = Heartbeat(1, 2, 3, (status,), 10, (0, 2), 500, True, True)
    assert as_list(hb) == [
        4,
        1,
        2,
        3,
        [
            [
                *("s", 4, -1, D, True, [[5, 6]], [[7, D]], 8, 9, True, [[1, 3]], True, 1),
                *([0, 1, 2], [0, 1]),
            ]
        ],
        10,
        [0, 2],
        500,
        True,
        True,
    ]
    assert as_list(JoinRequest(1, 2, 3, "s", 4, -1)) == [3, 1, 2, 3, "s", 4, -1, 0, []]
    request = JoinRequest(1, 2, 3, "s", 4, -1, 1, (1, 2, 5))
    assert as_list(request) == [3, 1, 2, 3, "s", 4, -1, 1, [1, 2, 5]]
    reply = ForwardReply(1, 2, 3, 4, 5, Outcome.REJECTED, -1, "late", (7, 8))
    assert as_list(reply) == [6, 1, 2, 3, 4, 5, "rejected", -1, "late", [7, 8]]
    join = JoinReply(1, 2, 3, 4, "s", False, 5, D, -1, None)
    assert as_list(join) == [7, 1, 2, 3, 4, "s", False, 5, D, -1, None, [], None, 0, []]
    join = msgspec.structs.replace(
        join, dedupe=((b"p", 1, 2, D),), your_votes=((6, D),), config=2, members=(0, 4)
    )
    assert as_list(join)[-5:] == [[[b"p", 1, 2, D]], [[6, D]], None, 2, [0, 4]]
    rr = RepairReply(1, 2, 3, 4, "s", 5, RepairStatus.TOO_OLD, 6, 7, True, (), ())
    assert as_list(rr) == [9, 1, 2, 3, 4, "s", 5, "too_old", 6, 7, True, [], [], 0]
    intervals = (Interval(1, 2, 3), Interval(0, 1, 2, 6))
    value = ViewValue(5, 6, 7, intervals, ((7, T),), 1, (0, 1, 2))
    wire_value = [
        5,
        6,
        7,
        [[1, 2, 3, -1], [0, 1, 2, 6]],
        [[7, b"p", 1, None, b"v", 0]],
        1,
        [0, 1, 2],
    ]
    view_request = ViewRequest(1, 2, 3, 4, "s", ViewPhase.ACCEPT, 5, 6, (0,), value, 1, (0, 1, 2))
    assert as_list(view_request) == [
        11, 1, 2, 3, 4, "s", "accept", 5, 6, [0], wire_value, 1, [0, 1, 2], []
    ]  # fmt: skip
    change = msgspec.structs.replace(view_request, moving_to=(1, 2))
    assert as_list(change)[-1] == [1, 2]
    promise = ViewReply(1, 2, 3, 4, "s", ViewPhase.PROMISE, 5, 6, True, 7, 8, 9, 10, None, ())
    assert as_list(promise) == [
        12, 1, 2, 3, 4, "s", "promise", 5, 6, True, 7, 8, 9, 10, None, [], 0, [], -1
    ]  # fmt: skip
    assert as_list(msgspec.structs.replace(promise, holds=11))[-1] == 11
    assert as_list(ViewDecided(1, 2, 3, 4, "s", value)) == [13, 1, 2, 3, 4, "s", wire_value]


def test_acceptor_record_round_trip() -> None:
    value = ViewValue(5, 6, 7, (Interval(1, 2, 3),), ((7, T),), 1, (0, 1, 2))
    left = ViewValue(4, 6, 7, (Interval(1, 2, 3),), (), 2, (1, 2))
    for accepted in (None, value):
        for version, members in ((0, (0, 1, 2)), (1, (0, 1, 2)), (2, (1, 2))):
            for committed in (False, True):
                record = AcceptorRecord(
                    5,
                    1026,
                    1026 if accepted else -1,
                    accepted,
                    version,
                    members,
                    committed,
                    left if version == 2 else None,
                )
                assert decode_acceptor(encode_acceptor(record), MAX) == record
    # A record of code 21 (before a left stream's view was kept) reads without one.
    unleft = msgspec.msgpack.encode([21, 5, 1026, -1, None, 2, [1, 2], True])
    assert decode_acceptor(unleft, MAX) == AcceptorRecord(5, 1026, -1, None, 2, (1, 2), True)
    # A record an earlier release wrote (code 20, a view without its configuration) reads
    # as one without a configuration, and with nothing committed.
    legacy_value = [5, 6, 7, [[1, 2, 3, -1]], []]
    legacy = msgspec.msgpack.encode([20, 5, 1026, 1026, legacy_value])
    assert decode_acceptor(legacy, MAX) == AcceptorRecord(
        5, 1026, 1026, ViewValue(5, 6, 7, (Interval(1, 2, 3),))
    )
    with pytest.raises(FieldError, match="members"):  # relays out of order
        decode_acceptor(encode_acceptor(AcceptorRecord(1, -1, -1, None, 1, (2, 1))), MAX)
    with pytest.raises(FrameError):
        decode_acceptor(b"\x93\x01\x02\x03", MAX)  # a 3-array, not a record
    with pytest.raises(FrameError):
        decode_acceptor(encode(tx_batch()), MAX)  # a message is not a record


def test_bytes_use_the_bin_type() -> None:
    frame = encode(tx_batch())
    # str and bin must stay distinct on the wire: raw=True would otherwise not tell them apart
    raw = msgpack.unpackb(frame, raw=True)
    assert raw[4] == b"orders.eu"
    assert msgpack.unpackb(frame, raw=False)[6][0][1] == b"p"


def test_encode_rejects_non_messages() -> None:
    with pytest.raises(TypeError):
        encode(Transaction(b"p", 1, None, b"v"))  # type: ignore[arg-type]


def test_boundary_values_round_trip() -> None:
    m = TxBatch(1023, U64, U63, "x" * 255, U63, ((U63, Transaction(b"p" * 64, U64, b"", b"")),))
    assert decode(encode(m), MAX) == m
    m = TxBatch(0, 0, 0, "x", 0, ((0, Transaction(b"p", 0, None, b"")),))
    assert decode(encode(m), MAX) == m


# --- any bytes: only FrameError ------------------------------------------------------------


@settings(max_examples=500)
@given(st.binary(max_size=200))
@example(b"")
@example(b"\x91" * 100_000)  # nesting deeper than the unpacker's stack
@example(b"\xdd\xff\xff\xff\xff")  # an array header claiming 4 billion items
@example(b"\xdf\xff\xff\xff\xff")  # a map header claiming 4 billion pairs
@example(b"\xc6\xff\xff\xff\xff")  # a bin header claiming 4 GiB
@example(b"\xc1")  # the one byte msgpack never uses
@example(b"\xd6\xff\x00\x00\x00\x00")  # a timestamp extension
def test_arbitrary_bytes_raise_only_frame_errors(frame: bytes) -> None:
    result = outcome_of(frame)
    if not isinstance(result, FrameError):
        assert type(result) in TYPE_CODES


@settings(max_examples=300)
@given(any_message, st.data())
def test_truncated_frames_raise_only_frame_errors(m: Any, data: st.DataObject) -> None:
    frame = encode(m)
    cut = data.draw(st.integers(0, len(frame) - 1))
    assert isinstance(outcome_of(frame[:cut]), MalformedFrame)


@settings(max_examples=500)
@given(any_message, st.data())
def test_mutated_frames_raise_only_frame_errors(m: Any, data: st.DataObject) -> None:
    frame = bytearray(encode(m))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    result = outcome_of(bytes(frame))
    if not isinstance(result, FrameError):
        # whatever decodes must be a valid message again
        assert type(result) in TYPE_CODES
        assert decode(encode(result), MAX) == result  # type: ignore[arg-type]


@settings(max_examples=500)
@given(any_message, st.data())
def test_fields_replaced_by_any_value_raise_only_frame_errors(m: Any, data: st.DataObject) -> None:
    items = wire(encode(m))
    i = data.draw(st.integers(1, len(items) - 1))
    items[i] = data.draw(msgpack_values)
    result = outcome_of(frame_of(*items))
    if not isinstance(result, FrameError):
        assert type(result) is type(m)
        assert decode(encode(result), MAX) == result  # type: ignore[arg-type]


# --- the C fast path (msgspec) against the validators ----------------------------------------

hot_messages = st.one_of(messages[TxBatch], messages[Reports])


def reference_outcome(frame: bytes) -> object:
    """What the hand-written validators alone make of `frame` (no msgspec fast path)."""
    try:
        return codec.decode_with(frame, MAX, codec._DECODERS_BY_NAME, "message")
    except FrameError as e:
        return e


def assert_same_as_reference(frame: bytes) -> None:
    fast, reference = outcome_of(frame), reference_outcome(frame)
    assert type(fast) is type(reference)
    if isinstance(reference, FrameError):
        assert str(fast) == str(reference)
    else:
        assert fast == reference
        hash(fast)


def replace_anywhere(tree: Any, data: st.DataObject) -> Any:
    """`tree` with one value at any depth (a whole array, or one leaf) replaced."""
    if type(tree) is list and tree and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(tree) - 1))
        return [*tree[:i], replace_anywhere(tree[i], data), *tree[i + 1 :]]
    return data.draw(msgpack_values)


@settings(max_examples=500)
@given(hot_messages, st.data())
def test_fast_path_agrees_with_the_validators_on_mutated_bytes(m: Any, data: st.DataObject) -> None:
    frame = bytearray(encode(m))
    quick = codec._FAST_DECODERS[TYPE_CODES[type(m)]]
    assert quick.build(quick.decoder.decode(bytes(frame))) == m  # valid frames take it
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    assert_same_as_reference(bytes(frame))


@settings(max_examples=500)
@given(hot_messages, st.data())
def test_fast_path_agrees_with_the_validators_on_any_value_anywhere(
    m: Any, data: st.DataObject
) -> None:
    items = wire(encode(m))
    i = data.draw(st.integers(1, len(items) - 1))
    items[i] = replace_anywhere(items[i], data)
    assert_same_as_reference(frame_of(*items))


def test_fast_path_edges() -> None:
    entry = [U63, b"p" * 64, U64, None, b"", 255]
    for frame in (
        frame_of(1, 1023, U64, U63, "x" * 255, U63, [entry]),
        frame_of(1, 1, 2, 3, "é" * 128, 4, [entry]),  # 256 UTF-8 bytes
        frame_of(1, 1, 2, 3, "s", 4, [[*entry[:5], 256]]),
        frame_of(1, 1, 2, 3, "s", 4, [[U63 + 1, *entry[1:]]]),
        frame_of(1, 1, 2, 3, "s", 4, [[0, b"", *entry[2:]]]),
        frame_of(1, 1, 2, 3, "s", 4, [[0, b"p" * 65, *entry[2:]]]),
        frame_of(1, 1, 2, 3, "s", 4, [[*entry[:3], "key", *entry[4:]]]),
        frame_of(1, 1, 2, 3, "s", 4, [[*entry[:5], True]]),
        frame_of(2, 1, 2, 3, "s", 4, [[5, D]], -1, D, [[1023, U63]], -1, 0),
        frame_of(2, 1, 2, 3, "s", 4, [[5, D[:15]]], -1, D, [], -1, 0),
        frame_of(2, 1, 2, 3, "s", 4, [], -2, D, [], -1, 0),
        frame_of(2, 1024, 2, 3, "s", 4, [], -1, D, [], -1, 0),
    ):
        assert_same_as_reference(frame)


@settings(max_examples=300)
@given(st.integers(-(2**63), 1000), st.lists(msgpack_values, max_size=14))
def test_any_array_raises_only_frame_errors(code: int, fields: list[Any]) -> None:
    result = outcome_of(frame_of(code, *fields))
    if code not in TYPE_CODES.values():
        assert isinstance(result, UnknownMessageType)


def test_non_bytes_input_is_malformed() -> None:
    with pytest.raises(MalformedFrame):
        decode(None, MAX)
    with pytest.raises(MalformedFrame):
        decode("not bytes", MAX)


# --- each error, by name --------------------------------------------------------------------


def test_oversized_is_checked_before_unpacking() -> None:
    with pytest.raises(OversizedFrame):
        decode(encode(tx_batch()), 10)
    with pytest.raises(OversizedFrame):
        decode(b"\xc1" * 11, 10)  # garbage, but too long is what is reported


def test_empty_frame() -> None:
    with pytest.raises(MalformedFrame):
        decode(b"", MAX)


def test_truncated() -> None:
    frame = encode(tx_batch())
    with pytest.raises(MalformedFrame):
        decode(frame[:-1], MAX)
    with pytest.raises(MalformedFrame):
        decode(frame[:1], MAX)


def test_trailing_garbage_after_a_valid_frame() -> None:
    frame = encode(tx_batch())
    with pytest.raises(MalformedFrame, match="trailing"):
        decode(frame + b"\x00", MAX)
    with pytest.raises(MalformedFrame):
        decode(frame + frame, MAX)


def test_not_msgpack() -> None:
    with pytest.raises(MalformedFrame):
        decode(b"\xc1", MAX)


def test_invalid_utf8_is_malformed() -> None:
    with pytest.raises(MalformedFrame):
        decode(b"\x92\x01\xa2\xff\xfe", MAX)


@pytest.mark.parametrize(
    "frame",
    [
        frame_of(),  # empty array
        msgpack.packb(1),  # not an array
        msgpack.packb({"a": 1}),
        msgpack.packb(b"bytes"),
        frame_of("1", 1, 2, 3),  # type code is not an int
        frame_of(True, 1, 2, 3),  # type code is a bool
        frame_of(1.0, 1, 2, 3),
    ],
)
def test_wrong_top_level_shape(frame: bytes) -> None:
    with pytest.raises(MalformedFrame):
        decode(frame, MAX)


def test_unknown_type_code() -> None:
    with pytest.raises(UnknownMessageType):
        decode(frame_of(99, 1, 2, 3), MAX)
    with pytest.raises(UnknownMessageType):
        decode(frame_of(0), MAX)
    with pytest.raises(UnknownMessageType):
        decode(frame_of(-1, 1), MAX)


def test_wrong_array_lengths() -> None:
    items = as_list(tx_batch())
    with pytest.raises(MalformedFrame):
        decode(frame_of(*items[:-1]), MAX)
    with pytest.raises(MalformedFrame):
        decode(frame_of(*items, 0), MAX)
    entry = items[6][0]
    with pytest.raises(MalformedFrame):
        decode(frame_of(*items[:6], [entry[:5]]), MAX)
    with pytest.raises(MalformedFrame):
        decode(frame_of(*items[:6], [[*entry, b""]]), MAX)
    with pytest.raises(MalformedFrame):  # entries not an array
        decode(frame_of(*items[:6], b""), MAX)
    with pytest.raises(MalformedFrame):  # an entry not an array
        decode(frame_of(*items[:6], [5]), MAX)
    with pytest.raises(MalformedFrame, match=r"points\[0\]"):  # a report not a pair
        decode(frame_of(2, 1, 2, 3, "s", 4, [[5, D, 6]], -1, D, [], -1, 0), MAX)
    for status in (
        ["s", 4, -1, D],
        ["s", 4, -1, D, True],  # the layout before acks and inherited votes
        ["s", 4, -1, D, True, [], [], -1],  # the layout before views
        ["s", 4, -1, D, True, [], [], -1, 0],
        ["s", 4, -1, D, True, [], [], -1, 0, False],  # the layout before inherited acks
        ["s", 4, -1, D, True, [], [], -1, 0, False, []],  # before inherited_omitted
        ["s", 4, -1, D, True, [], [], -1, 0, False, [], False],  # before configurations
        ["s", 4, -1, D, True, [], [], -1, 0, False, [], False, 0, []],  # before `wanted`
    ):
        with pytest.raises(MalformedFrame, match=r"streams\[0\]"):  # status of the wrong length
            decode(frame_of(4, 1, 2, 3, [status], 0, [], 0, False, False), MAX)
    with pytest.raises(MalformedFrame):  # the heartbeat layout before quiet (5.11)
        decode(frame_of(4, 1, 2, 3, [], 0, []), MAX)
    with pytest.raises(MalformedFrame):  # the heartbeat layout before spooling (5.14)
        decode(frame_of(4, 1, 2, 3, [], 0, [], 0, False), MAX)
    with pytest.raises(MalformedFrame):  # a forwarded transaction of the wrong length
        decode(frame_of(5, 1, 2, 3, 4, "s", 5, [b"p", 6, None, b"v"]), MAX)


def test_reports_lead_out_of_range() -> None:
    for lead in (-2, U63 + 1, "x"):
        with pytest.raises(FieldError, match=r"Reports\.lead"):
            decode(frame_of(2, 1, 2, 3, "s", 4, [], -1, D, [], lead, 0), MAX)


def test_wrong_digest_length() -> None:
    with pytest.raises(FieldError, match="digest"):
        decode(frame_of(2, 1, 2, 3, "s", 4, [[5, b"\x00" * 15]], -1, D, [], -1, 0), MAX)
    with pytest.raises(FieldError, match="committed_digest"):
        decode(frame_of(2, 1, 2, 3, "s", 4, [], -1, D + b"\x00", [], -1, 0), MAX)
    with pytest.raises(FieldError):  # a digest must be bin, not str
        decode(frame_of(2, 1, 2, 3, "s", 4, [], -1, "x" * 16, [], -1, 0), MAX)


@pytest.mark.parametrize(
    "stream", ["orders|eu", "|", "a\x00b", "", "x" * 256, "é" * 128, b"orders", 5, None]
)
def test_bad_stream_names(stream: Any) -> None:
    with pytest.raises(FieldError, match="stream"):
        decode(frame_of(3, 1, 2, 3, stream, 4, -1, 0, []), MAX)


def test_stream_name_limit_is_in_utf8_bytes() -> None:
    assert decode(frame_of(3, 1, 2, 3, "é" * 127, 4, -1, 0, []), MAX) == JoinRequest(
        1, 2, 3, "é" * 127, 4, -1
    )


def test_bool_where_int_expected() -> None:
    items = as_list(tx_batch())
    for i in (1, 2, 3, 5):
        bad = list(items)
        bad[i] = True
        with pytest.raises(FieldError, match=r"expected .*, got True"):
            decode(frame_of(*bad), MAX)
    with pytest.raises(FieldError, match="seq"):
        decode(frame_of(*items[:6], [[False, b"p", 6, None, b"v", 0]]), MAX)
    with pytest.raises(FieldError, match="producer_seq"):
        decode(frame_of(*items[:6], [[5, b"p", True, None, b"v", 0]]), MAX)
    with pytest.raises(FieldError, match="kind"):
        decode(frame_of(*items[:6], [[5, b"p", 6, None, b"v", True]]), MAX)


def test_int_where_bool_expected() -> None:
    with pytest.raises(FieldError, match="joined"):
        status = ["s", 4, -1, D, 1, [], [], -1, 0, False, [], False, 0, [], []]
        decode(frame_of(4, 1, 2, 3, [status], 0, [], 0, False, False), MAX)
    with pytest.raises(FieldError, match="want_in"):
        status = ["s", 4, -1, D, True, [], [], -1, 0, 1, [], False, 0, [], []]
        decode(frame_of(4, 1, 2, 3, [status], 0, [], 0, False, False), MAX)
    with pytest.raises(FieldError, match="hears"):
        decode(frame_of(4, 1, 2, 3, [], 0, [True], 0, False, False), MAX)
    with pytest.raises(FieldError, match="inherited_omitted"):
        status = ["s", 4, -1, D, True, [], [], -1, 0, False, [], 1, 0, [], []]
        decode(frame_of(4, 1, 2, 3, [status], 0, [], 0, False, False), MAX)
    with pytest.raises(FieldError, match="settled"):
        decode(frame_of(4, 1, 2, 3, [], 0, [], 0, 1, False), MAX)
    with pytest.raises(FieldError, match="interval_ms"):
        decode(frame_of(4, 1, 2, 3, [], 0, [], -1, True, False), MAX)
    with pytest.raises(FieldError, match="spool_full"):
        decode(frame_of(4, 1, 2, 3, [], 0, [], 0, True, 1), MAX)


def test_wanted_and_moving_to_are_relay_sets() -> None:
    """The relays a status wants and a change moves to (5.15 changes) are configurations:
    ascending relay ids, each once."""
    for wanted in ([2, 1], [1, 1], [1024], [True]):
        status = ["s", 4, -1, D, True, [], [], -1, 0, False, [], False, 0, [], wanted]
        with pytest.raises(FieldError, match="wanted"):
            decode(frame_of(4, 1, 2, 3, [status], 0, [], 0, False, False), MAX)
    request = [11, 1, 2, 3, 4, "s", "prepare", 5, 6, [0], None, 1, [0, 1, 2]]
    view_request = decode(msgpack.packb([*request, [1, 2]]), MAX)
    assert isinstance(view_request, ViewRequest) and view_request.moving_to == (1, 2)
    with pytest.raises(FieldError, match="moving_to"):
        decode(msgpack.packb([*request, [2, 1]]), MAX)
    reply = [12, 1, 2, 3, 4, "s", "promise", 5, 6, True, 7, 8, 9, 10, None, [], 0, []]
    view_reply = decode(msgpack.packb([*reply, 11]), MAX)
    assert isinstance(view_reply, ViewReply) and view_reply.holds == 11
    with pytest.raises(FieldError, match="holds"):
        decode(msgpack.packb([*reply, -2]), MAX)


def test_negative_relay_id() -> None:
    items = as_list(tx_batch())
    items[1] = -1
    with pytest.raises(FieldError, match="sender"):
        decode(frame_of(*items), MAX)


def test_relay_id_1024() -> None:
    items = as_list(tx_batch())
    items[1] = 1024
    with pytest.raises(FieldError, match="sender"):
        decode(frame_of(*items), MAX)
    with pytest.raises(FieldError, match="target"):
        decode(frame_of(6, 1, 2, 3, 1024, 5, "rejected", -1, "why", []), MAX)
    with pytest.raises(FieldError, match="redirect"):
        decode(frame_of(6, 1, 2, 3, 4, 5, "fenced", -1, "", [1, 1024]), MAX)


def test_repair_origin_is_minus_one_or_a_relay_id() -> None:
    for origin in (-1, 0, 1023):
        m = decode(frame_of(8, 1, 2, 3, 4, "s", 5, 6, 7, origin), MAX)
        assert isinstance(m, RepairRequest)
        assert m.origin == origin
    for bad in (-2, 1024, True, None, -1.0):
        with pytest.raises(FieldError, match="origin"):
            decode(frame_of(8, 1, 2, 3, 4, "s", 5, 6, 7, bad), MAX)


def test_minus_one_only_where_documented() -> None:
    assert decode(frame_of(3, 1, 2, 3, "s", 4, -1, 0, []), MAX) == JoinRequest(1, 2, 3, "s", 4, -1)
    with pytest.raises(FieldError, match="need_point"):
        decode(frame_of(3, 1, 2, 3, "s", 4, -2, 0, []), MAX)
    with pytest.raises(FieldError, match="floor"):
        decode(frame_of(3, 1, 2, -1, "s", 4, 0, 0, []), MAX)
    with pytest.raises(FieldError, match="incarnation"):
        decode(frame_of(3, 1, -1, 3, "s", 4, 0, 0, []), MAX)
    with pytest.raises(FieldError, match="link_seq"):
        decode(frame_of(3, 1, 2, 3, "s", -1, 0, 0, []), MAX)
    with pytest.raises(FieldError, match="point"):
        decode(frame_of(2, 1, 2, 3, "s", 4, [[-1, D]], -1, D, [], -1, 0), MAX)
    with pytest.raises(FieldError, match="seq"):
        decode(frame_of(1, 1, 2, 3, "s", 4, [[-1, b"p", 1, None, b"", 0]]), MAX)
    with pytest.raises(FieldError, match="kind"):
        decode(frame_of(1, 1, 2, 3, "s", 4, [[1, b"p", 1, None, b"", -1]]), MAX)
    with pytest.raises(FieldError, match="kind"):
        decode(frame_of(1, 1, 2, 3, "s", 4, [[1, b"p", 1, None, b"", 256]]), MAX)
    with pytest.raises(FieldError, match="request_id"):
        decode(frame_of(8, 1, 2, 3, 4, "s", -1, 6, 7, -1), MAX)
    with pytest.raises(FieldError, match="lo"):
        decode(frame_of(8, 1, 2, 3, 4, "s", 5, -1, 7, -1), MAX)
    with pytest.raises(FieldError, match="committed_point"):
        decode(frame_of(2, 1, 2, 3, "s", 4, [], -2, D, [], -1, 0), MAX)
    with pytest.raises(FieldError, match="max_seen_reported"):
        decode(frame_of(7, 1, 2, 3, 4, "s", True, -1, D, -2, None, [], None, 0, []), MAX)


def test_forward_reply_seq_may_be_minus_one() -> None:
    # ProduceReply.seq defaults to -1 for every outcome but `committed`; a forwarded reply
    # relays it unchanged, so the wire must accept it.
    reply = ForwardReply(1, 2, 3, 4, 5, Outcome.UNKNOWN, -1, "", ())
    assert decode(encode(reply), MAX) == reply


def test_sequence_fields_above_int63_are_refused() -> None:
    with pytest.raises(FieldError, match="floor"):
        decode(frame_of(3, 1, 2, 2**63, "s", 4, -1, 0, []), MAX)
    with pytest.raises(FieldError, match="seq"):
        decode(frame_of(1, 1, 2, 3, "s", 4, [[2**63, b"p", 1, None, b"", 0]]), MAX)
    # producer sequences use the full unsigned 64-bit range
    m = decode(frame_of(1, 1, 2, 3, "s", 4, [[1, b"p", U64, None, b"", 0]]), MAX)
    assert isinstance(m, TxBatch)
    assert m.entries[0][1].producer_seq == U64


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ([5, b"", 6, None, b"v", 0], "producer_id"),
        ([5, b"p" * 65, 6, None, b"v", 0], "producer_id"),
        ([5, "p", 6, None, b"v", 0], "producer_id"),
        ([5, b"p", -1, None, b"v", 0], "producer_seq"),
        ([5, b"p", 6, "k", b"v", 0], "key"),
        ([5, b"p", 6, 0, b"v", 0], "key"),
        ([5, b"p", 6, None, "v", 0], "value"),
        ([5, b"p", 6, None, None, 0], "value"),
        ([5.0, b"p", 6, None, b"v", 0], "seq"),
        ([5, b"p", 6, None, b"v", "0"], "kind"),
    ],
)
def test_bad_transaction_fields(entry: list[Any], field: str) -> None:
    with pytest.raises(FieldError, match=field):
        decode(frame_of(1, 1, 2, 3, "s", 4, [entry]), MAX)
    if field != "seq":
        with pytest.raises(FieldError, match=field):
            decode(frame_of(5, 1, 2, 3, 4, "s", 5, entry[1:]), MAX)
        with pytest.raises(FieldError, match=field):
            decode(frame_of(9, 1, 2, 3, 4, "s", 5, "ok", 0, 9, False, [entry], [], 0), MAX)


def test_bad_enum_values() -> None:
    with pytest.raises(FieldError, match="outcome"):
        decode(frame_of(6, 1, 2, 3, 4, 5, "COMMITTED", 6, "", []), MAX)
    with pytest.raises(FieldError, match="outcome"):
        decode(frame_of(6, 1, 2, 3, 4, 5, 1, 6, "", []), MAX)
    with pytest.raises(FieldError, match="status"):
        decode(frame_of(9, 1, 2, 3, 4, "s", 5, "stale", 0, 9, False, [], [], 0), MAX)


def test_bad_dedupe_keys() -> None:
    ok = decode(
        frame_of(7, 1, 2, 3, 4, "s", True, -1, D, -1, [[b"p", 1, 2, D]], [], None, 0, []), MAX
    )
    assert isinstance(ok, JoinReply)
    assert ok.dedupe == ((b"p", 1, 2, D),)
    with pytest.raises(MalformedFrame, match=r"dedupe\[0\]"):
        decode(frame_of(7, 1, 2, 3, 4, "s", True, -1, D, -1, [[b"p", 1, 2]], [], None, 0, []), MAX)
    with pytest.raises(FieldError, match="producer_id"):
        decode(
            frame_of(7, 1, 2, 3, 4, "s", True, -1, D, -1, [[b"", 1, 2, D]], [], None, 0, []), MAX
        )
    with pytest.raises(FieldError, match="content"):
        decode(
            frame_of(7, 1, 2, 3, 4, "s", True, -1, D, -1, [[b"p", 1, 2, b"x"]], [], None, 0, []),
            MAX,
        )
    with pytest.raises(MalformedFrame, match="dedupe"):  # dedupe must be nil or an array
        decode(frame_of(7, 1, 2, 3, 4, "s", True, -1, D, -1, b"", [], None, 0, []), MAX)


def test_reason_must_be_str() -> None:
    with pytest.raises(FieldError, match="reason"):
        decode(frame_of(6, 1, 2, 3, 4, 5, "rejected", -1, b"why", []), MAX)


def test_maps_and_extensions_where_fields_belong() -> None:
    with pytest.raises(FrameError):
        decode(frame_of(6, 1, 2, 3, 4, 5, "rejected", -1, {"a": 1}, []), MAX)
    with pytest.raises(FrameError):
        decode(frame_of(6, 1, 2, 3, 4, 5, "rejected", -1, msgpack.ExtType(5, b"x"), []), MAX)
    with pytest.raises(MalformedFrame):  # a map with an int key (strict_map_key)
        decode(msgpack.packb([10, 1, 2, 3, 4, {1: 2}]), MAX)


def test_decoded_containers_are_tuples() -> None:
    m = decode(encode(tx_batch()), MAX)
    assert isinstance(m, TxBatch)
    assert type(m.entries) is tuple
    assert all(type(e) is tuple for e in m.entries)
    reply = decode(frame_of(6, 1, 2, 3, 4, 5, "fenced", -1, "", [1, 2]), MAX)
    assert isinstance(reply, ForwardReply)
    assert reply.redirect == (1, 2)
    assert reply.outcome is Outcome.FENCED


# --- acks, inherited votes ------------------------------------------------------------------


def reports_frame(acks: Any) -> bytes:
    return frame_of(2, 1, 2, 3, "s", 4, [[5, D]], 5, D, acks, -1, 0)


def status_frame(acks: Any = (), inherited: Any = (), votes_final_through: Any = -1) -> bytes:
    """A heartbeat with one stream status, with the given acks and inherited votes (view 0,
    not asking in; wall clock 0, hearing nobody)."""
    # tuples pack as msgpack arrays, so the defaults go on the wire as empty arrays
    status = [
        "s", 4, -1, D, True, acks, inherited, votes_final_through, 0, False, [], False, 0, [], []
    ]  # fmt: skip
    return frame_of(4, 1, 2, 3, [status], 0, [], 0, False, False)


def heartbeat_frame(acks: Any) -> bytes:
    return status_frame(acks=acks)


@given(acks)
def test_acks_round_trip(a: tuple[tuple[int, int], ...]) -> None:
    reports = Reports(1, 2, 3, "s", 4, ((5, D),), 5, D, a)
    assert decode(encode(reports), MAX) == reports
    statuses = (StreamStatus("s", 4, -1, D, True, a), StreamStatus("t", 0, 0, D, False))
    hb = Heartbeat(1, 2, 3, statuses)
    back = decode(encode(hb), MAX)
    assert back == hb
    assert isinstance(back, Heartbeat)
    assert back.streams[0].acks == a
    assert back.streams[1].acks == ()


def test_acks_boundaries_and_containers() -> None:
    edge = ((0, 0), (1023, U63))
    m = decode(reports_frame([list(p) for p in edge]), MAX)
    assert isinstance(m, Reports)
    assert m.acks == edge
    assert type(m.acks) is tuple
    assert all(type(p) is tuple for p in m.acks)
    hb = decode(heartbeat_frame([[1023, U63]]), MAX)
    assert isinstance(hb, Heartbeat)
    assert hb.streams[0].acks == ((1023, U63),)
    hash(m)
    hash(hb)


@pytest.mark.parametrize(
    ("ack", "field"),
    [
        ([1024, 5], "relay"),
        ([-1, 5], "relay"),
        ([True, 5], "relay"),
        ([None, 5], "relay"),
        ([5, -1], "point"),
        ([5, 2**63], "point"),
        ([5, 1.0], "point"),
        ([5, False], "point"),
    ],
)
@pytest.mark.parametrize("make", [reports_frame, heartbeat_frame], ids=["reports", "heartbeat"])
def test_bad_ack_fields(make: Any, ack: list[Any], field: str) -> None:
    with pytest.raises(FieldError, match=rf"acks\[1\]\.{field}"):
        decode(make([[0, 0], ack]), MAX)


@pytest.mark.parametrize("ack", [[5], [5, 6, 7], [], 5, b"\x05\x06", None])
@pytest.mark.parametrize("make", [reports_frame, heartbeat_frame], ids=["reports", "heartbeat"])
def test_ack_of_wrong_arity(make: Any, ack: Any) -> None:
    with pytest.raises(MalformedFrame, match=r"acks\[0\]"):
        decode(make([ack]), MAX)


@pytest.mark.parametrize("acks_value", [None, b"", 5, "acks", {"a": 1}])
@pytest.mark.parametrize("make", [reports_frame, heartbeat_frame], ids=["reports", "heartbeat"])
def test_acks_must_be_an_array(make: Any, acks_value: Any) -> None:
    with pytest.raises(MalformedFrame, match="acks"):
        decode(make(acks_value), MAX)


def test_votes_final_through_may_be_minus_one() -> None:
    for through in (-1, 0, U63):
        m = decode(status_frame(votes_final_through=through), MAX)
        assert m == Heartbeat(1, 2, 3, (StreamStatus("s", 4, -1, D, True, (), (), through),))
    m = decode(status_frame(inherited=([6, D], [7, D]), votes_final_through=7), MAX)
    assert isinstance(m, Heartbeat)
    assert m.streams[0].inherited == ((6, D), (7, D))
    for bad in (-2, 2**63, True, None, -1.0):
        with pytest.raises(FieldError, match="votes_final_through"):
            decode(status_frame(votes_final_through=bad), MAX)


def test_bad_inherited_and_your_votes() -> None:
    with pytest.raises(FieldError, match=r"inherited\[0\]\.digest"):
        decode(status_frame(inherited=([6, D[:15]],)), MAX)
    with pytest.raises(FieldError, match=r"inherited\[0\]\.point"):
        decode(status_frame(inherited=([-1, D],)), MAX)
    with pytest.raises(MalformedFrame, match=r"inherited\[0\]"):
        decode(status_frame(inherited=([6, D, 7],)), MAX)
    with pytest.raises(MalformedFrame, match="inherited"):
        decode(status_frame(inherited=None), MAX)
    votes = decode(frame_of(7, 1, 2, 3, 4, "s", False, 5, D, -1, None, [[6, D]], None, 0, []), MAX)
    assert isinstance(votes, JoinReply)
    assert votes.your_votes == ((6, D),)
    with pytest.raises(FieldError, match=r"your_votes\[0\]\.digest"):
        decode(frame_of(7, 1, 2, 3, 4, "s", False, 5, D, -1, None, [[6, b"x"]], None, 0, []), MAX)
    with pytest.raises(MalformedFrame, match="your_votes"):
        decode(frame_of(7, 1, 2, 3, 4, "s", False, 5, D, -1, None, None, None, 0, []), MAX)


# --- bundles: consecutive frames of one topic sent as one (docs/protocol.md section 3) ------


@settings(max_examples=100)
@given(st.lists(any_message, min_size=1, max_size=codec.BUNDLE_MAX_FRAMES))
def test_a_bundle_gives_back_its_frames_in_order(messages: list[Any]) -> None:
    frames = [encode(m) for m in messages]
    bundle = codec.encode_bundle(frames)
    assert codec.is_bundle(bundle)
    assert codec.decode_bundle(bundle, MAX) == frames
    assert [decode(f, MAX) for f in codec.decode_bundle(bundle, MAX)] == messages
    # What a sender budgets for a bundle covers what it encodes to.
    budget = codec.BUNDLE_OVERHEAD_BYTES + sum(
        len(f) + codec.BUNDLE_ITEM_OVERHEAD_BYTES for f in frames
    )
    assert len(bundle) <= budget


def test_no_message_looks_like_a_bundle() -> None:
    assert codec.BUNDLE_CODE not in TYPE_CODES.values()
    for m in (tx_batch(), Reports(1, 1, 1, "s", 1, ((5, D),), -1, D)):
        assert not codec.is_bundle(encode(m))


@pytest.mark.parametrize(
    "frame",
    [
        b"\x92\x00\xc1",  # not msgpack after the prefix
        msgpack.packb([0, []]),  # nothing inside
        msgpack.packb([0, [b""]]),  # an empty frame inside
        msgpack.packb([0, ["text"]]),  # a string, not a frame
        msgpack.packb([0, [b"x"] * (codec.BUNDLE_MAX_FRAMES + 1)]),
        msgpack.packb([0, [b"x"], 1]),  # a third item
        msgpack.packb([0, [b"x"]]) + b"\x00",  # trailing data
    ],
)
def test_a_bad_bundle_raises_a_named_frame_error(frame: bytes) -> None:
    with pytest.raises(MalformedFrame):
        codec.decode_bundle(frame, MAX)


def test_an_oversized_bundle_is_refused_before_unpacking() -> None:
    bundle = codec.encode_bundle([b"x" * 100])
    with pytest.raises(OversizedFrame):
        codec.decode_bundle(bundle, 10 - codec.RELAYED_OVERHEAD_BYTES)


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_any_bytes_after_the_bundle_prefix_raise_only_frame_errors(rest: bytes) -> None:
    try:
        frames = codec.decode_bundle(codec.BUNDLE_PREFIX + rest, MAX)
    except FrameError:
        return
    assert frames and all(type(f) is bytes and f for f in frames)


def test_configuration_relays_ascend_each_once() -> None:
    # 5.15: a configuration's relays, as every message that states one carries them.
    ok = decode(frame_of(3, 1, 2, 3, "s", 4, -1, 1, [0, 2, 5]), MAX)
    assert isinstance(ok, JoinRequest) and (ok.config, ok.members) == (1, (0, 2, 5))
    for members in ([2, 1], [1, 1], [0, 1024], "x", [True]):
        with pytest.raises(FrameError, match=r"JoinRequest\.members"):
            decode(frame_of(3, 1, 2, 3, "s", 4, -1, 1, members), MAX)
    with pytest.raises(FieldError, match=r"JoinRequest\.config"):
        decode(frame_of(3, 1, 2, 3, "s", 4, -1, -1, []), MAX)
    with pytest.raises(FieldError, match=r"Reports\.config"):
        decode(frame_of(2, 1, 2, 3, "s", 4, [], -1, D, [], -1, -1), MAX)
