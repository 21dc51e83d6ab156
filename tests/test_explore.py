"""The bounded model checker (relay.sim.explore): its checks catch what they must, and the
protocol core passes a bounded exploration."""

from __future__ import annotations

import msgspec
import pytest
from click.testing import CliRunner

from relay.cli import main
from relay.core import commit, membership, view
from relay.core.machine import RelayCore
from relay.core.messages import PeerMessage, ViewPhase, ViewReply, ViewRequest
from relay.core.state import GENESIS_POINT, PROVISIONAL, PeerState, StreamState
from relay.sim.explore import ExploreResult, run_explore

# Stale topologies: the stream opens on its first produce; these ticks leave time for its
# join, its first view and the later produces (spread over the ticks) to commit.
STALE_MAX_TICKS = 12
CLOSED_MAX_TICKS = 24


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


# --- relays on topologies that disagree (5.15) --------------------------------------------


def test_stale_topologies_find_no_violation() -> None:
    # Relay 2's file adds it to stream s, which relays 0 and 1 serve alone: they establish
    # it, relay 2 learns that it is left out and forwards its produces to them.
    result = run_explore(max_states=8_000, topologies="stale", max_ticks=STALE_MAX_TICKS)
    _assert_sound(result, 8_000)
    assert result.coverage.get("relay 0 holds 's' established", 0) > 0
    assert result.coverage.get("relay 2 left 's' (its configuration leaves it out)", 0) > 0
    assert result.coverage.get("a produce forwarded", 0) > 0
    # Walks sample the opening: joins under configurations that disagree, drops, repairs.
    walks = run_explore(
        max_states=8_000, strategy="walk", seed=1, topologies="stale", max_ticks=STALE_MAX_TICKS
    )
    assert walks.ok, "\n".join(str(v) for v in walks.violations)
    assert walks.coverage.get("relay 2 holds 's' provisionally", 0) > 0
    assert walks.coverage.get("relay 2 left 's' (its configuration leaves it out)", 0) > 0
    assert walks.counters.get("config_mismatch", 0) > 0
    assert walks.coverage.get("producer told committed", 0) > 0


REFILE_MAX_TICKS = 20  # (each relay reads its new file once it ticked 8 times)


def test_files_that_move_while_first_views_are_accepted_find_no_violation() -> None:
    # Relays 0 and 1 serve s alone, then every relay reads a file in which all three do:
    # first views of relays 0-1, accepted or decided, meet proposals of relays 0-2, which
    # their acceptors follow (5.15 establishment).
    walks = run_explore(
        max_states=8_000, strategy="walk", seed=8, topologies="refile", max_ticks=REFILE_MAX_TICKS
    )
    assert walks.ok, "\n".join(str(v) for v in walks.violations)
    assert walks.distinct_states >= 8_000
    assert walks.coverage.get("every relay read its new file", 0) > 0
    assert walks.coverage.get("relay 2 holds 's' established", 0) > 0
    assert walks.counters.get("config_followed", 0) > 0
    # (the walks end before a producer hears its answer: commits are delivered)
    assert walks.coverage.get("some tx committed and delivered", 0) > 0


class ForgettingCore(RelayCore):
    """Planted bug (5.15 establishment, the carry rule): a first view's proposer does not
    hear what its promisers accepted before, so it never carries an earlier first view
    and makes its own value even where one may have been decided."""

    def _dispatch(self, msg: PeerMessage, peer: PeerState, now_ms: int) -> None:
        if (
            isinstance(msg, ViewReply)
            and msg.phase is ViewPhase.PROMISE
            and msg.view == 1
            and msg.accepted is not None
        ):
            msg = msgspec.structs.replace(msg, accepted=None, accepted_ballot=-1)
        super()._dispatch(msg, peer, now_ms)


def _carrying_walk(core_class: type[RelayCore]) -> ExploreResult:
    # (this walk reaches a first view to carry after about 58,000 states)
    return run_explore(
        max_states=60_000,
        strategy="walk",
        seed=5,
        core_class=core_class,
        shrink=False,
        topologies="refile",
        max_ticks=REFILE_MAX_TICKS,
    )


def test_first_views_carried_across_files_keep_one_value() -> None:
    walks = _carrying_walk(RelayCore)
    assert walks.ok, "\n".join(str(v) for v in walks.violations)
    assert walks.counters.get("config_carried", 0) > 0  # (the carry rule was used)


def test_a_first_view_not_carried_is_caught() -> None:
    # Relays 0 and 1 both accept relay 0's first view of relays 0-1, which decides it
    # before anyone learns so; the files move, and relay 1's first view of relays 0-2,
    # made with promises that told of that acceptance, is decided as well. The agreement
    # check sees it at once; the configuration checks only once a relay adopts the first.
    result = _carrying_walk(ForgettingCore)
    assert not result.ok
    message = result.violations[0].message
    assert message.startswith("view 1 decided 2 values: at ballot "), message
    assert "by relays [0, 1, 2]" in message, message


# --- a stream closed at the relays no read reached (5.11 closing) -------------------------


def test_a_closed_stream_opened_again_by_its_produces_finds_no_violation() -> None:
    # Stream s, a pattern's, is read through relay 0: relays 1 and 2, where only relay 0's
    # join opened it, closed it before the exploration starts. Its first produces open it
    # there again, with drops and duplicates around their joins and the first view.
    result = run_explore(max_states=8_000, topologies="closed", max_ticks=STALE_MAX_TICKS)
    assert result.ok, "\n".join(str(v) for v in result.violations)
    assert result.coverage.get("relay 1 does not hold 's'", 0) > 0
    assert result.coverage.get("relay 1 holds 's' established", 0) > 0
    # Walks of more ticks: the joins at the relays that closed it come before the first
    # view, so commits need more of them than with "stale".
    walks = run_explore(
        max_states=8_000, strategy="walk", seed=4, topologies="closed", max_ticks=CLOSED_MAX_TICKS
    )
    _assert_sound(walks, 8_000)
    assert walks.coverage.get("relay 2 does not hold 's'", 0) > 0


class InclusiveCore(RelayCore):
    """Planted bug (5.15): relays 0 and 1 count relay 2 among the relays of a stream their
    own topology does not give it (they take relay 2's word for it), and decide the first
    view by a quorum of them, not by every one: relays 0-2 are established without relay
    2's acceptance, which the topologies cannot establish."""

    def stream(self, stream: str) -> StreamState:
        opened = stream not in self.streams
        st = super().stream(stream)
        if opened and self.id != 2 and st.config_version == PROVISIONAL:
            membership.set_config(self, st, PROVISIONAL, (0, 1, 2))
        return st

    def _dispatch(self, msg: PeerMessage, peer: PeerState, now_ms: int) -> None:
        super()._dispatch(msg, peer, now_ms)
        for st in list(self.streams.values()):
            prop = st.proposal
            if (
                prop is not None
                and prop.phase is ViewPhase.ACCEPT
                and st.config_version == PROVISIONAL
                and len(prop.accepted_by) >= st.q
            ):
                prop.accepted_by.update(st.members)  # as if every relay had accepted
                view._advance(self, st, prop, now_ms)


class ProvisionalAgainCore(RelayCore):
    """Planted bug (5.15): relay 1 goes back to a provisional configuration once it has
    committed something (as a relay that did not keep its configuration would)."""

    def _dispatch(self, msg: PeerMessage, peer: PeerState, now_ms: int) -> None:
        super()._dispatch(msg, peer, now_ms)
        for st in self.streams.values():
            if self.id == 1 and st.timeline.committed_point > GENESIS_POINT:
                st.config_version = PROVISIONAL


class StaysCore(RelayCore):
    """Planted bug (5.15): a relay that an established configuration leaves out goes on
    serving the stream under it."""

    def _dispatch(self, msg: PeerMessage, peer: PeerState, now_ms: int) -> None:
        held = dict(self.streams)
        super()._dispatch(msg, peer, now_ms)
        for name, st in held.items():
            if name not in self.streams and self.foreign.pop(name, None) is not None:
                self.streams[name] = st
                self.invalidate_names()


class LoneCommitCore(RelayCore):
    """Planted bug: once a stream is established, relay 0 counts its own reports at once,
    unacknowledged, and one vote as a quorum."""

    def _dispatch(self, msg: PeerMessage, peer: PeerState, now_ms: int) -> None:
        super()._dispatch(msg, peer, now_ms)
        self._alone()

    def tick(self, now_ms: int, mono_ms: int | None = None) -> None:
        super().tick(now_ms, mono_ms)
        self._alone()

    def _alone(self) -> None:
        for st in self.streams.values():
            if self.id == 0 and st.config_version > PROVISIONAL and st.own_unacked:
                st.q = st.votes.q = 1
                st.own_acked_through = max(st.own_acked_through, st.own_unacked[-1][0])
                commit.count_acked_own(self, st)


@pytest.mark.parametrize(
    ("core_class", "found"),
    [
        (InclusiveCore, "configuration (1, (0, 1, 2)) established, but only (1, (0, 1)) can be"),
        (ProvisionalAgainCore, "under configuration (0, (0, 1)), not (1, (0, 1))"),
        (StaysCore, "relay 2: holds configuration (1, (0, 1)), which leaves it out"),
        (LoneCommitCore, "has a digest no quorum reported"),
    ],
)
def test_planted_configuration_bugs_are_caught(core_class: type[RelayCore], found: str) -> None:
    result = run_explore(
        max_states=20_000,
        core_class=core_class,
        shrink=False,
        topologies="stale",
        max_ticks=STALE_MAX_TICKS,
    )
    assert not result.ok
    assert found in result.violations[0].message, result.violations[0].message


# --- a change of a stream's relays (5.15 changes) -----------------------------------------


def test_change_of_relays_finds_no_violation() -> None:
    # Stream s is established on relays 0-2; each relay then reads a file that takes relay
    # 2 off it (an explored action), and the mesh changes s to relays 0-1.
    result = run_explore(max_states=6_000, topologies="change")
    _assert_sound(result, 6_000)
    # Not vacuous: the change was held while a file still named relay 2, decided and
    # adopted (relays 0 and 1 under version 2, relay 2 gone), and commits were counted
    # under it.
    assert result.coverage.get("a relay read its new file", 0) > 0
    assert result.coverage.get("relay 1 holds a change back (a file names other relays)", 0) > 0
    assert result.counters.get("config_change_proposed", 0) > 0
    assert result.counters.get("config_moved", 0) > 0
    for r in (0, 1):
        assert result.coverage.get(f"relay {r} holds 's' under version 2 (changed)", 0) > 0
        assert result.coverage.get(f"relay {r} committed under version 2", 0) > 0
    assert result.coverage.get("relay 2 left 's' (its configuration leaves it out)", 0) > 0


class AloneChangeCore(RelayCore):
    """Planted bug (5.15 changes): a relay decides a change of a stream's relays alone: it
    asks none of the old configuration's relays to promise or accept, and takes its own
    promise and acceptance for theirs. The others, not frozen, go on reporting under the
    old configuration above the change's start, and adopt the change when they hear of it:
    what a quorum of the old relays reported there (relay 2's transactions, which the
    change cuts) is not in the history the new relays report."""

    def send(self, msg: PeerMessage, stream: str | None = None, *, busy: bool = True) -> None:
        if isinstance(msg, ViewRequest) and msg.moving_to:
            return
        super().send(msg, stream, busy=busy)

    def tick(self, now_ms: int, mono_ms: int | None = None) -> None:
        super().tick(now_ms, mono_ms)
        for st in list(self.streams.values()):
            prop = st.proposal
            if prop is None or not prop.moving_to or self.id not in prop.promises:
                continue
            if prop.phase is ViewPhase.PREPARE:
                for m in st.peers:
                    prop.promises.setdefault(m, prop.promises[self.id])
                view._advance(self, st, prop, self.now_ms)
            if st.proposal is prop and prop.phase is ViewPhase.ACCEPT:
                prop.accepted_by.update(st.members)
                view._advance(self, st, prop, self.now_ms)


def test_change_decided_alone_is_caught_across_configurations() -> None:
    # Random walks reach it (after about 6,000 states with this seed); without the check
    # across configurations this run finds nothing: the old relays' reports that the new
    # history contradicts are void (5.12) where they adopted the change, and nobody had
    # counted them yet.
    result = run_explore(
        max_states=20_000,
        strategy="walk",
        seed=3,
        core_class=AloneChangeCore,
        shrink=False,
        topologies="change",
    )
    assert not result.ok
    message = result.violations[0].message
    assert "conflicting commits across configurations" in message, message
    assert "a quorum of (2, (0, 1)) reported" in message, message
    assert "a quorum of (1, (0, 1, 2)) reported there" in message, message


def test_cli_prints_the_verdict() -> None:
    result = CliRunner().invoke(main, ["explore", "--max-states", "300"])
    assert result.exit_code == 0, result.output
    assert "distinct states:" in result.output
    assert result.output.rstrip().endswith("1 passed, 0 failed")
    stale = CliRunner().invoke(main, ["explore", "--max-states", "300", "--topologies", "stale"])
    assert stale.exit_code == 0, stale.output
    assert "topologies=stale" in stale.output
    change = CliRunner().invoke(main, ["explore", "--max-states", "300", "--topologies", "change"])
    assert change.exit_code == 0, change.output
    assert "topologies=change" in change.output


@pytest.mark.slow
def test_large_stale_exploration_finds_no_violation() -> None:
    # About half a minute: walks reach a forwarded produce coordinated, and commits.
    result = run_explore(
        max_states=60_000, strategy="walk", seed=1, topologies="stale", max_ticks=STALE_MAX_TICKS
    )
    _assert_sound(result, 60_000)
    assert result.coverage.get("a member coordinated a forwarded produce", 0) > 0


@pytest.mark.slow
def test_large_exploration_finds_no_violation() -> None:
    # About 4 minutes. ("random", a shuffled DFS, can stay in a subtree without commits.)
    for strategy, seed, steps in (("dfs", 0, 0), ("walk", 1, 0), ("walk", 2, 2)):
        result = run_explore(
            max_states=150_000, strategy=strategy, seed=seed, max_clock_steps=steps
        )
        _assert_sound(result, 150_000)
