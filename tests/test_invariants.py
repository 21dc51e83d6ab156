"""The shared invariants (relay.sim.invariants) that the simulator's checkers, the explorer
and the scenario interpreter all use: each flags what it must and passes what it must."""

from __future__ import annotations

from relay.core.messages import Transaction
from relay.sim import invariants

A = Transaction(b"p0", 1, None, b"a")
B = Transaction(b"p1", 1, None, b"b")
C = Transaction(b"p2", 1, None, b"c")


# --- agree_over: logs of different relays --------------------------------------------------


def test_consistent_logs_pass() -> None:
    logs = {0: [(1, A), (2, B), (5, C)], 1: [(1, A), (2, B)], 2: []}
    assert invariants.agree_over(logs) == []


def test_divergent_logs_are_caught() -> None:
    logs = {0: [(1, A), (2, B)], 1: [(1, A), (2, C)]}
    problems = invariants.agree_over(logs)
    assert len(problems) == 1 and "relays 0 and 1" in problems[0]


def test_gap_in_common_range_is_caught() -> None:
    # Relay 1 skipped seq 2 although it delivered past it.
    problems = invariants.agree_over({0: [(1, A), (2, B), (3, C)], 1: [(1, A), (3, C)]})
    assert problems and "disagree" in problems[0]


def test_missing_entry_below_committed_point_is_caught() -> None:
    # Both committed through 3, but relay 1 lacks seq 3.
    logs = {0: [(1, A), (3, B)], 1: [(1, A)]}
    assert invariants.agree_over(logs) == []  # by last seq alone the common range is (., 1]
    assert invariants.agree_over(logs, committed={0: 3, 1: 3})


def test_repeated_or_decreasing_seq_is_caught() -> None:
    assert invariants.agree_over({0: [(1, A), (1, A)]})
    assert invariants.agree_over({0: [(2, A), (1, B)]})


def test_bases_limit_the_compared_range() -> None:
    logs = {0: [(1, A), (2, B)], 1: [(2, B)]}
    assert invariants.agree_over(logs, committed={0: 2, 1: 2})
    assert invariants.agree_over(logs, committed={0: 2, 1: 2}, bases={0: 0, 1: 1}) == []


# --- one timeline, order, gaps -------------------------------------------------------------


def test_one_timeline_merges_and_flags_divergence() -> None:
    timelines, problems = invariants.one_timeline(
        [("r0", "s", [(1, A), (2, B)]), ("r1", "s", [(2, B), (3, C)])]
    )
    assert problems == [] and timelines == {"s": {1: A, 2: B, 3: C}}
    _, problems = invariants.one_timeline([("r0", "s", [(1, A)]), ("r1", "s", [(1, B)])])
    assert len(problems) == 1 and problems[0].startswith("divergence:") and "r1" in problems[0]
    _, problems = invariants.one_timeline([("r0", "s", [(1, A)]), ("r1", "s", [(2, A)])])
    assert len(problems) == 1 and problems[0].startswith("divergence:")


def test_in_order() -> None:
    assert invariants.in_order("r0", "s", [(1, A), (2, B)]) == []
    assert invariants.in_order("r0", "s", [(2, A), (1, B)])[0].startswith("reorder:")
    assert invariants.in_order("r0", "s", [(1, A), (1, A)])[0].startswith("duplicate:")
    found = invariants.in_order("c1", "s", [(1, A), (2, A)], verb="received")
    assert found == ["duplicate: c1 received s p0#1 twice"]


def test_gap_free() -> None:
    index = invariants.TimelineIndex({1: A, 2: B, 3: C})
    assert invariants.gap_free("r0", "s", [(2, B), (3, C)], index) == []
    found = invariants.gap_free("r0", "s", [(1, A), (3, C)], index)
    assert len(found) == 1 and found[0].startswith("gap:") and "first 2" in found[0]


# --- nothing invented, rejected, committed answers ------------------------------------------


def test_nothing_invented() -> None:
    produced = {(b"p0", 1): ("s", A)}
    assert invariants.nothing_invented([("r0", "s", [(1, A)])], produced) == []
    assert "never produced" in invariants.nothing_invented([("r0", "s", [(2, B)])], produced)[0]
    forged = Transaction(b"p0", 1, None, b"forged")
    assert (
        "unlike the produced"
        in invariants.nothing_invented([("r0", "s", [(1, forged)])], produced)[0]
    )
    assert invariants.nothing_invented([("r0", "t", [(1, A)])], produced)  # another stream


def test_rejected_not_delivered() -> None:
    logs = [("r0", "s", [(1, A), (2, B)])]
    assert invariants.rejected_not_delivered(logs, {(b"p9", 1)}) == []
    found = invariants.rejected_not_delivered(logs, {(b"p1", 1)})
    assert len(found) == 1 and found[0].startswith("rejected delivered:")


def test_committed_answers() -> None:
    timeline = {1: A, 2: B}
    assert invariants.committed_answers("p0#1", A, [1, 1], timeline, must_hold=True) == []
    assert invariants.committed_answers("p0#1", A, [1, 2], timeline, must_hold=True)[0].startswith(
        "committed twice:"
    )
    assert invariants.committed_answers("p0#1", A, [2], timeline, must_hold=False)[0].startswith(
        "wrong seq:"
    )
    assert invariants.committed_answers("p0#1", A, [7], timeline, must_hold=False) == []
    assert invariants.committed_answers("p0#1", A, [7], timeline, must_hold=True)
