"""The metadata model (relay/meta.py, docs/metadata.md): operations, their encoding, and
the fold every relay applies in commit order, checked against a plain sequential model."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.access import AccessPolicy, ClientGrant, Right
from relay.meta import (
    ABSENT,
    ANY_VERSION,
    KIND_META,
    MAX_META_KEY_BYTES,
    MAX_META_VALUE_BYTES,
    OP_DELETE,
    OP_READ,
    OP_WRITE,
    READ_BARRIER_KEY,
    InvalidMetaOp,
    Mark,
    MetaOp,
    MetaState,
    Result,
    check_durable_name,
    decode_mark,
    decode_op,
    encode_mark,
    encode_op,
    guarded_key,
    mark_key,
    split_mark_key,
)

# READ_BARRIER_KEY among them: the library's barrier, and writes to a key of that name.
KEYS = ("a", "b", "consumers/x/s", READ_BARRIER_KEY)

ops = st.builds(
    MetaOp,
    op=st.sampled_from((OP_WRITE, OP_DELETE, OP_READ)),
    key=st.sampled_from(KEYS),
    expected_version=st.integers(ANY_VERSION, 12),  # small: often a version that exists
    value=st.binary(max_size=8),
).map(lambda op: op if op.op == OP_WRITE else MetaOp(op.op, op.key, op.expected_version, None))


@dataclass
class Model:
    """The contract in its plainest form: key -> (version, value); a condition either
    holds (the operation takes effect, the key's version becomes the operation's seq) or
    the operation changes nothing."""

    items: dict[str, tuple[int, bytes]]

    def run(self, seq: int, op: MetaOp) -> tuple[Result, int]:
        version = self.items[op.key][0] if op.key in self.items else ABSENT
        if op.op == OP_READ:  # the library's barrier shows no version (issue 48, 8)
            return Result.APPLIED, ABSENT if op.key == READ_BARRIER_KEY else version
        if op.op == OP_DELETE and op.key not in self.items:
            return Result.BAD_VERSION, ABSENT
        if op.expected_version not in (ANY_VERSION, version):
            return Result.BAD_VERSION, version
        if op.op == OP_DELETE:
            del self.items[op.key]
            return Result.APPLIED, ABSENT
        assert op.value is not None
        self.items[op.key] = (seq, op.value)
        return Result.APPLIED, seq


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=40))
def test_the_fold_agrees_with_the_sequential_model(script: list[MetaOp]) -> None:
    state, model = MetaState(), Model({})
    for seq, op in enumerate(script, start=1):
        outcome = state.apply(seq, KIND_META, encode_op(op), duplicate=False)
        assert outcome is not None
        assert (outcome.result, outcome.version) == model.run(seq, op)
        assert state.outcome(seq) == outcome
    assert {k: (v.version, v.value) for k, v in state.items.items()} == model.items
    assert state.list("") == sorted(state.items.values(), key=lambda v: v.key)


# Metadata rights of one client: key patterns (none: no metadata right at all).
grants = st.lists(st.sampled_from(("a", "b*", "consumers/*", READ_BARRIER_KEY, "*")), max_size=3)


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=40), grants)
def test_an_outcome_a_client_may_see_carries_no_version_of_a_key_it_may_not_read(
    script: list[MetaOp], patterns: list[str]
) -> None:
    """issue 48, 8: a barrier on any key was taken with any metadata right, and its
    outcome carried that key's version (a commit time). The relay checks the right on
    `guarded_key(op)` before it takes an operation and on the outcome's key before it
    shows the outcome (relay/service.py); whatever the script and the rights, an outcome
    so shown carries no version of a key the client may not read."""
    policy = AccessPolicy({"c": ClientGrant(metadata=tuple(patterns))})
    state = MetaState()
    for seq, op in enumerate(script, start=1):
        outcome = state.apply(seq, KIND_META, encode_op(op), duplicate=False)
        assert outcome is not None and outcome.key == guarded_key(op)
        if outcome.version != ABSENT and policy.allows("c", Right.METADATA, outcome.key):
            assert policy.allows("c", Right.METADATA, op.key)
        if op.op == OP_READ and op.key == READ_BARRIER_KEY:
            assert (outcome.key, outcome.version) == ("", ABSENT)


@pytest.mark.parametrize(
    "patterns, op, allowed",
    [
        # The library's barrier: every client with some metadata right, whatever its keys.
        (("consumers/app-*",), MetaOp(OP_READ, READ_BARRIER_KEY, ANY_VERSION, None), True),
        ((), MetaOp(OP_READ, READ_BARRIER_KEY, ANY_VERSION, None), False),
        # A barrier on another key: the right on that key, as for a write.
        (("consumers/app-*",), MetaOp(OP_READ, "jobs/nightly", ANY_VERSION, None), False),
        (("jobs/*",), MetaOp(OP_READ, "jobs/nightly", ANY_VERSION, None), True),
        (("consumers/app-*",), MetaOp(OP_READ, "consumers/app-x/s", ANY_VERSION, None), True),
        # A write to a key named like the barrier's is a write like any other.
        (("consumers/app-*",), MetaOp(OP_WRITE, READ_BARRIER_KEY, ANY_VERSION, b"v"), False),
        ((READ_BARRIER_KEY,), MetaOp(OP_WRITE, READ_BARRIER_KEY, ANY_VERSION, b"v"), True),
    ],
)
def test_the_right_an_operation_needs(patterns: tuple[str, ...], op: MetaOp, allowed: bool) -> None:
    policy = AccessPolicy({"c": ClientGrant(metadata=patterns)})
    assert policy.allows("c", Right.METADATA, guarded_key(op)) is allowed


@settings(max_examples=200, deadline=None)
@given(ops)
def test_an_operation_survives_its_encoding(op: MetaOp) -> None:
    assert decode_op(encode_op(op)) == op


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=64)
    | st.builds(msgpack.packb, st.lists(st.integers(-(2**63), 2**64 - 1) | st.text() | st.none()))
)
def test_any_bytes_decode_to_an_operation_or_a_named_error(value: bytes) -> None:
    try:
        decode_op(value)
    except InvalidMetaOp as e:
        assert str(e)


# Wrong types where integers belong: equal to an op or a version (2.0 == 2, True == 1),
# huge, or not numbers at all.
_loose = (
    st.floats(allow_nan=True)
    | st.booleans()
    | st.none()
    | st.integers(-(2**63), 2**64 - 1)
    | st.sampled_from([0.0, 1.0, 2.0, -1.0])
    | st.text(max_size=4)
    | st.binary(max_size=4)
)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 4), _loose, st.sampled_from([OP_WRITE, OP_DELETE, OP_READ]))
def test_an_operation_of_loose_types_is_refused_by_name(
    which: int, loose: object, known: int
) -> None:
    """issue 48: an op of 2.0 passed as the read barrier's 2, then failed in the relay's
    client service. Whatever one field holds (the others right for the op), an operation
    decodes with exactly the types MetaOp names, or is refused with a named error."""
    fields: list[object] = [1, known, "k", -1, b"v" if known == OP_WRITE else None]
    fields[which] = loose
    raw = msgpack.packb(fields, use_bin_type=True)
    try:
        decoded = decode_op(raw)
    except InvalidMetaOp as e:
        assert str(e)
        return
    assert type(decoded.op) is int and decoded.op in (OP_WRITE, OP_DELETE, OP_READ)
    assert type(decoded.expected_version) is int and type(decoded.key) is str
    assert decoded.value is None or type(decoded.value) is bytes
    assert decode_op(encode_op(decoded)) == decoded


@pytest.mark.parametrize(
    "op, problem",
    [
        (MetaOp(OP_WRITE, "", 0, b"v"), "metadata key"),
        (MetaOp(OP_WRITE, "k" * (MAX_META_KEY_BYTES + 1), 0, b"v"), "metadata key"),
        (MetaOp(OP_WRITE, "k", -2, b"v"), "expected_version"),
        (MetaOp(OP_WRITE, "k", 0, b"v" * (MAX_META_VALUE_BYTES + 1)), "metadata value"),
        (MetaOp(OP_WRITE, "k", 0, None), "metadata value"),
        (MetaOp(OP_DELETE, "k", 0, b"v"), "op is"),
        (MetaOp(7, "k", 0, None), "op is"),
        (MetaOp(2.0, "k", 0, None), "op is"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_operation_is_refused_before_it_is_sent(op: MetaOp, problem: str) -> None:
    with pytest.raises(InvalidMetaOp, match=problem):
        encode_op(op)


def test_what_is_not_an_operation_commits_but_changes_nothing() -> None:
    state = MetaState()
    state.apply(1, KIND_META, encode_op(MetaOp(OP_WRITE, "a", ABSENT, b"1")), False)
    other_kind = state.apply(2, 0, b"plain", False)
    garbage = state.apply(3, KIND_META, b"\xc1", False)
    assert other_kind is not None and other_kind.result is Result.INVALID
    assert garbage is not None and garbage.result is Result.INVALID and "msgpack" in garbage.detail
    assert state.items["a"].version == 1 and state.applied == 3


def test_a_duplicate_changes_nothing_and_the_order_is_checked() -> None:
    state = MetaState()
    write = encode_op(MetaOp(OP_WRITE, "a", ANY_VERSION, b"1"))
    state.apply(5, KIND_META, write, False)
    assert state.apply(6, KIND_META, write, duplicate=True) is None
    assert state.items["a"].version == 5 and state.outcome(6) is None
    with pytest.raises(ValueError, match="out of order"):
        state.apply(6, KIND_META, write, False)


def test_outcomes_are_remembered_up_to_their_bound() -> None:
    state = MetaState(outcomes_max=3)
    for seq in range(1, 6):
        state.apply(seq, KIND_META, encode_op(MetaOp(OP_READ, "a", ANY_VERSION, None)), False)
    assert [state.outcome(seq) is not None for seq in range(1, 6)] == [False] * 2 + [True] * 3
    assert state.oldest_outcome == 3


@settings(max_examples=100, deadline=None)
@given(
    st.one_of(st.none(), st.integers(-1, 2**63 - 1)),
    st.text(max_size=40),
    st.integers(0, 3_600_000),
)
def test_a_mark_survives_its_encoding(seq: int | None, holder: str, ttl_ms: int) -> None:
    mark = Mark(seq, holder, ttl_ms)
    assert decode_mark(encode_mark(mark)) == mark


def test_marks_are_named_by_consumer_and_stream() -> None:
    assert mark_key("billing", "orders.eu") == "consumers/billing/orders.eu"
    assert split_mark_key("consumers/billing/a/b") == ("billing", "a/b")
    assert split_mark_key("leases/x") is None
    with pytest.raises(ValueError, match="durable consumer's name"):
        check_durable_name("has/slash")
    with pytest.raises(InvalidMetaOp, match="not a consumer mark"):
        decode_mark(b"\x93\x01\x02\x03")
