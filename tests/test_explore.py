"""The bounded model checker (relay.sim.explore): its checks catch what they must, and the
protocol core passes a bounded exploration."""

from __future__ import annotations

from typing import Any

import pytest

from relay.core.messages import Transaction
from relay.core.relay import RelayCore
from relay.sim.explore import ExploreResult, check_timelines, main, run_explore

A = Transaction(b"p0", 1, None, b"a")
B = Transaction(b"p1", 1, None, b"b")
C = Transaction(b"p2", 1, None, b"c")


def _assert_sound(result: ExploreResult, min_states: int) -> None:
    assert result.ok, "\n".join(str(v) for v in result.violations)
    assert result.distinct_states >= min_states
    assert 0 < result.states_explored <= result.transitions
    # Not vacuous: commits were reached, answered and delivered on the explored paths.
    assert result.coverage.get("some tx committed and delivered", 0) > 0
    assert result.coverage.get("producer told committed", 0) > 0
    assert result.counters.get("delivered", 0) > 0


# --- the safety check itself ------------------------------------------------------------


def test_consistent_logs_pass() -> None:
    logs = {0: [(1, A), (2, B), (5, C)], 1: [(1, A), (2, B)], 2: []}
    assert check_timelines(logs) == []


def test_divergent_logs_are_caught() -> None:
    logs = {0: [(1, A), (2, B)], 1: [(1, A), (2, C)]}
    problems = check_timelines(logs)
    assert len(problems) == 1 and "relays 0 and 1" in problems[0]


def test_gap_in_common_range_is_caught() -> None:
    # Relay 1 skipped seq 2 although it delivered past it.
    problems = check_timelines({0: [(1, A), (2, B), (3, C)], 1: [(1, A), (3, C)]})
    assert problems and "disagree" in problems[0]


def test_missing_entry_below_committed_point_is_caught() -> None:
    # Both committed through 3, but relay 1 lacks seq 3.
    logs = {0: [(1, A), (3, B)], 1: [(1, A)]}
    assert check_timelines(logs) == []  # by last seq alone the common range is (., 1]
    assert check_timelines(logs, committed={0: 3, 1: 3})


def test_repeated_or_decreasing_seq_is_caught() -> None:
    assert check_timelines({0: [(1, A), (1, A)]})
    assert check_timelines({0: [(2, A), (1, B)]})


def test_bases_limit_the_compared_range() -> None:
    logs = {0: [(1, A), (2, B)], 1: [(2, B)]}
    assert check_timelines(logs, committed={0: 2, 1: 2})
    assert check_timelines(logs, committed={0: 2, 1: 2}, bases={0: 0, 1: 1}) == []


# --- exploring the real core --------------------------------------------------------------


class TrustingCore(RelayCore):
    """Planted bug: delivers every commit it hears of without comparing its own digest."""

    def _advance(self, st: Any, now_ms: int) -> None:
        point, digest = st.known_commit
        if st.join is None and point > st.timeline.committed_point:
            self._deliver(st, point, digest)
            return
        super()._advance(st, now_ms)


def test_bounded_exploration_finds_no_violation() -> None:
    result = run_explore(max_states=20_000, transactions=3, max_drops=2)
    _assert_sound(result, 20_000)
    assert result.bound_hit and result.bound_reasons == ["max_states"]
    assert result.max_depth > 20


def test_random_walks_find_no_violation() -> None:
    result = run_explore(max_states=20_000, strategy="walk", seed=7)
    _assert_sound(result, 20_000)
    # Walks reach the fault paths: gap fills, repairs, timeouts.
    assert result.counters.get("hole_closed", 0) > 0
    assert result.counters.get("repair_adopted", 0) > 0
    assert result.coverage.get("producer told unknown", 0) > 0


def test_wall_clock_steps_keep_safety() -> None:
    # G4: sequence numbers come from a wall clock that steps back and forth.
    result = run_explore(max_states=4_000, strategy="walk", seed=2, max_clock_steps=2)
    _assert_sound(result, 4_000)
    assert result.coverage.get("a wall clock stepped", 0) > 0


def test_other_orders_find_no_violation() -> None:
    for strategy in ("random", "bfs"):
        result = run_explore(max_states=1_500, strategy=strategy, seed=3)
        assert result.ok, "\n".join(str(v) for v in result.violations)
        assert result.distinct_states >= 1_500


def test_exhausted_scope_reports_no_bound() -> None:
    result = run_explore(max_states=1_000, transactions=0, max_ticks=0)
    assert result.ok and not result.bound_hit and result.distinct_states == 1


def test_planted_bug_is_caught_with_a_trace() -> None:
    result = run_explore(max_states=50_000, strategy="walk", seed=0, core_class=TrustingCore)
    assert not result.ok
    violation = result.violations[0]
    assert violation.trace and any(step.startswith("deliver") for step in violation.trace)
    assert "VIOLATION" in str(violation)


def test_main_prints_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--max-states", "300"]) == 0
    out = capsys.readouterr().out
    assert "distinct states:" in out
    assert out.rstrip().endswith("1 passed, 0 failed")


@pytest.mark.slow
def test_large_exploration_finds_no_violation() -> None:
    # About 4 minutes. ("random", a shuffled DFS, can stay in a subtree without commits.)
    for strategy, seed, steps in (("dfs", 0, 0), ("walk", 1, 0), ("walk", 2, 2)):
        result = run_explore(
            max_states=150_000, strategy=strategy, seed=seed, max_clock_steps=steps
        )
        _assert_sound(result, 150_000)
