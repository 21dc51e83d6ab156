"""Sequence numbers: the flake layout and the hybrid logical clock that issues them."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from relay.core.seq import (
    EPOCH_MS,
    MAX_COUNTER,
    MAX_MS,
    MAX_RELAY_ID,
    MAX_SEQ,
    HybridClock,
    compose,
    counter_of,
    end_of_ms,
    ms_of,
    relay_of,
    split,
    wall_ms,
)

ms_values = st.integers(0, MAX_MS)
relay_ids = st.integers(0, MAX_RELAY_ID)
counters = st.integers(0, MAX_COUNTER)
components = st.tuples(ms_values, relay_ids, counters)
# Unix milliseconds around "now" in the layout, including before the epoch and past its end
unix_ms = st.one_of(
    st.integers(EPOCH_MS - 10_000, EPOCH_MS + 10_000),
    st.integers(EPOCH_MS + 2**40 - 10_000, EPOCH_MS + 2**40 + 10_000),
    st.integers(EPOCH_MS - 1000, EPOCH_MS + MAX_MS + 1000),
)
# a walk of wall-clock readings that mostly advance, sometimes stand still or step back
wall_walks = st.tuples(
    st.integers(EPOCH_MS, EPOCH_MS + 2**40),
    st.lists(st.integers(-5_000, 5_000) | st.just(0), min_size=1, max_size=60),
)


def walk(start: int, steps: list[int]) -> list[int]:
    out, now = [], start
    for step in steps:
        now += step
        out.append(now)
    return out


def test_layout_constants() -> None:
    assert MAX_SEQ == 2**63 - 1
    assert compose(MAX_MS, MAX_RELAY_ID, MAX_COUNTER) == MAX_SEQ
    assert compose(0, 0, 0) == 0
    assert compose(0, 0, 1) == 1
    assert compose(0, 1, 0) == 1 << 12
    assert compose(1, 0, 0) == 1 << 22


@given(components)
def test_compose_split_round_trip(parts: tuple[int, int, int]) -> None:
    seq = compose(*parts)
    assert 0 <= seq <= MAX_SEQ
    assert split(seq) == parts
    assert (ms_of(seq), relay_of(seq), counter_of(seq)) == parts


@given(st.integers(0, MAX_SEQ))
def test_split_compose_round_trip(seq: int) -> None:
    assert compose(*split(seq)) == seq


@given(components, components)
def test_seq_order_is_tuple_order(a: tuple[int, int, int], b: tuple[int, int, int]) -> None:
    assert (compose(*a) < compose(*b)) == (a < b)
    assert (compose(*a) == compose(*b)) == (a == b)


@pytest.mark.parametrize(
    "parts",
    [
        (-1, 0, 0),
        (MAX_MS + 1, 0, 0),
        (0, -1, 0),
        (0, MAX_RELAY_ID + 1, 0),
        (0, 0, -1),
        (0, 0, MAX_COUNTER + 1),
    ],
)
def test_compose_rejects_out_of_range_components(parts: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        compose(*parts)


@pytest.mark.parametrize("relay_id", [-1, MAX_RELAY_ID + 1])
def test_clock_rejects_out_of_range_relay_id(relay_id: int) -> None:
    with pytest.raises(ValueError):
        HybridClock(relay_id)


@given(ms_values)
def test_end_of_ms(ms: int) -> None:
    end = end_of_ms(ms)
    assert split(end) == (ms, MAX_RELAY_ID, MAX_COUNTER)
    if ms < MAX_MS:
        assert end + 1 == compose(ms + 1, 0, 0)


def test_wall_ms_clamps() -> None:
    assert wall_ms(EPOCH_MS) == 0
    assert wall_ms(EPOCH_MS - 1) == 0
    assert wall_ms(EPOCH_MS + 1234) == 1234
    assert wall_ms(EPOCH_MS + MAX_MS + 5) == MAX_MS


@given(relay_ids, wall_walks)
def test_next_seq_strictly_increasing_even_when_the_wall_steps_back(
    relay_id: int, walk_args: tuple[int, list[int]]
) -> None:
    clock = HybridClock(relay_id)
    issued = []
    for now in walk(*walk_args):
        floor_before = clock.floor
        seq = clock.next_seq(now)
        assert seq > floor_before
        assert relay_of(seq) == relay_id
        # k-sorted: never before the wall clock; exactly at it unless the floor was ahead
        assert ms_of(seq) >= wall_ms(now)
        if ms_of(floor_before) < wall_ms(now):
            assert ms_of(seq) == wall_ms(now)
        assert clock.floor == seq
        issued.append(seq)
    assert issued == sorted(set(issued))


@given(
    relay_ids,
    st.lists(
        st.tuples(st.sampled_from(["seq", "raise", "follow"]), st.integers(0, MAX_SEQ), unix_ms),
        min_size=1,
        max_size=40,
    ),
)
def test_never_issues_at_or_below_the_floor(relay_id: int, ops: list[tuple[str, int, int]]) -> None:
    clock = HybridClock(relay_id)
    last = -1
    for op, value, now in ops:
        before = clock.floor
        if op == "raise":
            clock.raise_floor(value)
            assert clock.floor == max(before, value)
        elif op == "follow":
            clock.follow_wall(now)
            assert clock.floor >= before
            if wall_ms(now) > 0:
                assert clock.floor >= end_of_ms(wall_ms(now) - 1)
        else:
            try:
                seq = clock.next_seq(now)
            except OverflowError:
                # only when no seq of this relay lies above the floor
                assert ms_of(before) == MAX_MS and relay_of(before) >= relay_id
                assert before >= compose(MAX_MS, relay_id, MAX_COUNTER)
                continue
            assert seq > before
            assert seq > last
            assert ms_of(seq) >= wall_ms(now)
            last = seq
        assert clock.floor >= before  # the floor only moves up


@given(relay_ids, st.integers(-(2**70), 2**70))
def test_raise_floor_with_any_value(relay_id: int, value: int) -> None:
    clock = HybridClock(relay_id, floor=compose(100, 0, 0))
    before = clock.floor
    clock.raise_floor(value)
    assert clock.floor == min(max(before, value), MAX_SEQ)
    assert 0 <= clock.floor <= MAX_SEQ
    try:
        seq = clock.next_seq(EPOCH_MS)
    except OverflowError:
        assert clock.floor >= compose(MAX_MS, relay_id, MAX_COUNTER)
    else:
        assert seq > max(before, min(value, MAX_SEQ))


def test_seq_after_another_relays_seq_in_the_same_ms() -> None:
    clock = HybridClock(5)
    clock.raise_floor(compose(1000, 3, 77))
    assert split(clock.next_seq(EPOCH_MS)) == (1000, 5, 0)  # lower relay: same ms
    clock.raise_floor(compose(1000, 5, 10))
    assert split(clock.next_seq(EPOCH_MS)) == (1000, 5, 11)  # own relay: next counter
    clock.raise_floor(compose(1000, 9, 0))
    assert split(clock.next_seq(EPOCH_MS)) == (1001, 5, 0)  # higher relay: next ms


def test_counter_overflow_moves_to_the_next_ms() -> None:
    clock = HybridClock(7)
    now = EPOCH_MS + 5_000
    seqs = [clock.next_seq(now) for _ in range(MAX_COUNTER + 2)]
    assert [split(s) for s in seqs[:2]] == [(5_000, 7, 0), (5_000, 7, 1)]
    assert split(seqs[MAX_COUNTER]) == (5_000, 7, MAX_COUNTER)
    assert split(seqs[MAX_COUNTER + 1]) == (5_001, 7, 0)
    assert seqs == sorted(set(seqs))


def test_wall_clock_jumps_forward_resets_counter() -> None:
    clock = HybridClock(2)
    assert split(clock.next_seq(EPOCH_MS + 10)) == (10, 2, 0)
    assert split(clock.next_seq(EPOCH_MS + 10)) == (10, 2, 1)
    assert split(clock.next_seq(EPOCH_MS + 50)) == (50, 2, 0)


def test_wall_clock_step_back_keeps_issuing_above_the_floor() -> None:
    clock = HybridClock(2)
    first = clock.next_seq(EPOCH_MS + 10_000)
    second = clock.next_seq(EPOCH_MS + 1_000)  # the wall stepped back 9 s
    assert split(second) == (10_000, 2, 1)
    assert second > first


def test_follow_wall_closes_the_previous_ms() -> None:
    clock = HybridClock(3)
    clock.follow_wall(EPOCH_MS + 500)
    assert clock.floor == end_of_ms(499)
    # nothing of this relay in ms 499 can be issued any more; ms 500 is still open
    assert split(clock.next_seq(EPOCH_MS + 400)) == (500, 3, 0)
    clock.follow_wall(EPOCH_MS + 100)  # the wall stepped back: the floor stays
    assert clock.floor == compose(500, 3, 0)


def test_follow_wall_before_or_at_the_epoch_is_a_no_op() -> None:
    clock = HybridClock(3)
    clock.follow_wall(EPOCH_MS - 10_000)
    clock.follow_wall(EPOCH_MS)
    assert clock.floor == 0


def test_raise_floor_only_moves_up_and_clamps() -> None:
    clock = HybridClock(1)
    clock.raise_floor(compose(10, 0, 0))
    clock.raise_floor(compose(5, 0, 0))
    assert clock.floor == compose(10, 0, 0)
    clock.raise_floor(MAX_SEQ + 12345)
    assert clock.floor == MAX_SEQ
    with pytest.raises(OverflowError):
        clock.next_seq(EPOCH_MS)


def test_last_seq_of_the_layout_is_issued_then_overflow() -> None:
    clock = HybridClock(MAX_RELAY_ID, floor=compose(MAX_MS, MAX_RELAY_ID, MAX_COUNTER - 1))
    assert clock.next_seq(EPOCH_MS) == MAX_SEQ
    with pytest.raises(OverflowError):
        clock.next_seq(EPOCH_MS)


@given(st.integers(0, MAX_SEQ), unix_ms)
def test_ahead_by_ms(peer_floor: int, now: int) -> None:
    clock = HybridClock(0)
    assert clock.ahead_by_ms(peer_floor, now) == ms_of(peer_floor) - wall_ms(now)


def test_ahead_by_ms_examples() -> None:
    clock = HybridClock(0)
    now = EPOCH_MS + 10_000
    assert clock.ahead_by_ms(compose(15_000, 4, 9), now) == 5_000
    assert clock.ahead_by_ms(compose(10_000, 1023, 4095), now) == 0
    assert clock.ahead_by_ms(compose(9_000, 0, 0), now) == -1_000


@given(relay_ids, relay_ids, wall_walks)
def test_two_clocks_exchanging_floors_never_collide(
    a_id: int, b_id: int, walk_args: tuple[int, list[int]]
) -> None:
    assume(a_id != b_id)
    a, b = HybridClock(a_id), HybridClock(b_id)
    seen: set[int] = set()
    for i, now in enumerate(walk(*walk_args)):
        sender, receiver = (a, b) if i % 2 == 0 else (b, a)
        seq = sender.next_seq(now)
        assert seq not in seen
        seen.add(seq)
        receiver.raise_floor(seq)
        reply = receiver.next_seq(now)
        assert reply > seq  # causally after what it heard
        assert reply not in seen
        seen.add(reply)
