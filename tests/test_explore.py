"""The bounded model checker (relay.sim.explore): its checks catch what they must, and the
protocol core passes a bounded exploration."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from relay.cli import main
from relay.core import commit
from relay.core.machine import RelayCore
from relay.core.messages import PeerMessage
from relay.core.state import PeerState
from relay.sim.explore import ExploreResult, run_explore


def _assert_sound(result: ExploreResult, min_states: int) -> None:
    assert result.ok, "\n".join(str(v) for v in result.violations)
    assert result.distinct_states >= min_states
    assert 0 < result.states_explored <= result.transitions
    # Not vacuous: commits were reached, answered and delivered on the explored paths.
    assert result.coverage.get("some tx committed and delivered", 0) > 0
    assert result.coverage.get("producer told committed", 0) > 0
    assert result.counters.get("delivered", 0) > 0


# --- exploring the real core --------------------------------------------------------------


class TrustingCore(RelayCore):
    """Planted bug: delivers every commit it hears of without comparing its own digest."""

    def _dispatch(self, msg: PeerMessage, peer: PeerState, now_ms: int) -> None:
        self._trust()
        super()._dispatch(msg, peer, now_ms)

    def tick(self, now_ms: int, mono_ms: int | None = None) -> None:
        self._trust()
        super().tick(now_ms, mono_ms)

    def _trust(self) -> None:
        for st in self.streams.values():
            point, digest = st.known_commit
            if st.join is None and point > st.timeline.committed_point:
                commit.deliver(self, st, point, digest)


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


def test_cli_prints_the_verdict() -> None:
    result = CliRunner().invoke(main, ["explore", "--max-states", "300"])
    assert result.exit_code == 0, result.output
    assert "distinct states:" in result.output
    assert result.output.rstrip().endswith("1 passed, 0 failed")


@pytest.mark.slow
def test_large_exploration_finds_no_violation() -> None:
    # About 4 minutes. ("random", a shuffled DFS, can stay in a subtree without commits.)
    for strategy, seed, steps in (("dfs", 0, 0), ("walk", 1, 0), ("walk", 2, 2)):
        result = run_explore(
            max_states=150_000, strategy=strategy, seed=seed, max_clock_steps=steps
        )
        _assert_sound(result, 150_000)
