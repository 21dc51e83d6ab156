"""`relay chaos`: the history check (pure, always run), the network's clean-up (as root),
and a short run of every scenario against real relays (slow, as root with the tools).

The slow runs check safety only (nothing lost, duplicated, invented or diverging) and
that no namespace, link or rule is left behind; how fast the mesh recovers is what the
harness measures, not something these tests assert.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.tools import chaos_history as h
from relay.tools.chaos import SCENARIOS, Options, ScenarioResult, parse_scenarios, table

# --- the history check --------------------------------------------------------------------

S = "chaos.a"
P = b"p0"


def attempt(pseq: int, outcome: str = h.COMMITTED, seq: int | None = None) -> h.Attempt:
    committed_seq = (100 + pseq) if outcome == h.COMMITTED and seq is None else seq
    return h.Attempt(S, P, pseq, b"v%d" % pseq, 0.0, 1.0, outcome, committed_seq)


def rec(pseq: int, seq: int | None = None, producer: bytes = P) -> h.HistoryRecord:
    return h.HistoryRecord(100 + pseq if seq is None else seq, producer, pseq, b"v%d" % pseq)


def relay(relay_id: int, *records: h.HistoryRecord) -> h.RelayHistory:
    return h.RelayHistory(relay_id, S, tuple(records))


def three(*records: h.HistoryRecord) -> list[h.RelayHistory]:
    return [relay(r, *records) for r in (0, 1, 2)]


def test_a_clean_history_passes_and_counts_outcomes() -> None:
    attempts = [attempt(0), attempt(1), attempt(2, h.UNKNOWN), attempt(3, h.FENCED)]
    verdict = h.check(attempts, three(rec(0), rec(1)))
    assert verdict.ok, verdict.problems
    assert (verdict.attempts, verdict.committed, verdict.unknown, verdict.fenced) == (4, 2, 1, 1)
    assert verdict.unknown_appeared == 0


def test_an_unknown_write_may_appear() -> None:
    verdict = h.check([attempt(0), attempt(1, h.UNKNOWN)], three(rec(0), rec(1)))
    assert verdict.ok, verdict.problems
    assert verdict.unknown_appeared == 1


def test_an_acknowledged_write_held_nowhere_is_lost() -> None:
    verdict = h.check([attempt(0), attempt(1), attempt(2)], three(rec(0), rec(2)))
    assert verdict.lost == 1
    assert not verdict.divergent
    assert any("p0#1" in p and "held by no one" in p for p in verdict.problems)


def test_an_acknowledged_write_at_another_seq_is_lost() -> None:
    verdict = h.check([attempt(0)], three(rec(0, seq=555)))
    assert verdict.lost == 1


def test_a_relay_missing_a_write_inside_its_range_diverges() -> None:
    histories = [relay(0, rec(0), rec(1), rec(2)), relay(1, rec(0), rec(1), rec(2))]
    histories.append(relay(2, rec(0), rec(2)))
    verdict = h.check([attempt(0), attempt(1), attempt(2)], histories)
    assert verdict.divergent == ["relay 2"]
    assert verdict.lost == 0


def test_a_relay_with_another_write_at_a_seq_diverges() -> None:
    histories = three(rec(0), rec(1))
    histories[1] = relay(1, rec(0), h.HistoryRecord(101, P, 2, b"v2"))
    attempts = [attempt(0), attempt(1), attempt(2, h.UNKNOWN)]
    verdict = h.check(attempts, histories)
    assert verdict.divergent == ["relay 1"]
    assert verdict.lost == 0


def test_a_tie_marks_every_side() -> None:
    histories = [relay(0, rec(0), rec(1)), relay(1, rec(0), h.HistoryRecord(101, P, 2, b"v2"))]
    verdict = h.check([attempt(0), attempt(1, h.UNKNOWN), attempt(2, h.UNKNOWN)], histories)
    assert verdict.divergent == ["relay 0", "relay 1"]


def test_a_restarted_relay_may_hold_only_a_suffix() -> None:
    histories = three(rec(0), rec(1), rec(2))
    histories[2] = relay(2, rec(2))
    verdict = h.check([attempt(0), attempt(1), attempt(2)], histories)
    assert verdict.ok, verdict.problems


def test_a_relay_ending_before_an_acknowledged_write_diverges() -> None:
    histories = three(rec(0), rec(1))
    histories[0] = relay(0, rec(0))
    verdict = h.check([attempt(0), attempt(1)], histories)
    assert verdict.divergent == ["relay 0"]
    assert verdict.lost == 0


def test_an_empty_relay_covers_nothing_and_no_readable_relay_verifies_nothing() -> None:
    histories = three(rec(0))
    histories[1] = relay(1)  # restarted after the last write: it holds nothing yet
    assert h.check([attempt(0)], histories).ok
    verdict = h.check([attempt(0)], [])
    assert verdict.ok and (verdict.lost, verdict.unverified) == (0, 1)
    assert any("no relay's history" in p for p in verdict.problems)


def test_history_every_relay_forgot_is_checked_against_the_consumers() -> None:
    attempts = [attempt(0), attempt(1), attempt(2), attempt(3)]
    restarted = [relay(0, rec(2), rec(3)), relay(1, rec(3)), relay(2, rec(2), rec(3))]
    full = h.ConsumerLog("c0", S, (rec(0), rec(1), rec(2), rec(3)))
    verdict = h.check(attempts, restarted, [full])
    assert verdict.ok and (verdict.lost, verdict.unverified) == (0, 0), verdict.problems
    verdict = h.check(attempts, restarted)  # no log: seqs 100 and 101 are unverified
    assert verdict.ok and (verdict.lost, verdict.unverified) == (0, 2), verdict.problems
    holes = h.ConsumerLog("c0", S, (rec(0), rec(2), rec(3)))
    verdict = h.check(attempts, restarted, [holes])
    assert verdict.lost == 1  # seq 101 lies inside what the log covers


def test_a_write_at_two_seqs_is_a_duplicate() -> None:
    verdict = h.check([attempt(0)], three(rec(0), rec(0, seq=200)))
    assert verdict.duplicates == 1


def test_records_out_of_order_diverge() -> None:
    histories = three(rec(0), rec(1))
    histories[0] = relay(0, rec(1), rec(0))
    verdict = h.check([attempt(0), attempt(1)], histories)
    assert "relay 0" in verdict.divergent


def test_phantoms_unwritten_altered_or_definitely_failed() -> None:
    stranger = h.HistoryRecord(103, b"nobody", 0, b"x")
    altered = h.HistoryRecord(101, P, 1, b"not what was written")
    attempts = [attempt(0), attempt(1, h.UNKNOWN), attempt(2, h.FENCED, seq=None)]
    histories = three(rec(0), altered, rec(2), stranger)
    verdict = h.check(attempts, histories)
    assert verdict.phantom == 3
    assert not verdict.ok


def test_a_consumer_that_skips_or_reorders_diverges() -> None:
    attempts = [attempt(0), attempt(1), attempt(2)]
    good = h.ConsumerLog("c0", S, (rec(1), rec(2)))  # may start anywhere
    skipped = h.ConsumerLog("c1", S, (rec(0), rec(2)))
    backwards = h.ConsumerLog("c2", S, (rec(1), rec(0)))
    twice = h.ConsumerLog("c3", S, (rec(0), rec(0, seq=150)))
    verdict = h.check(attempts, three(rec(0), rec(1), rec(2)), [good, skipped, backwards, twice])
    assert verdict.divergent == ["consumer c1", "consumer c2", "consumer c3"]
    assert verdict.duplicates == 1


def test_problems_are_capped_but_counted() -> None:
    attempts = [attempt(i) for i in range(h.MAX_PROBLEMS + 5)]
    verdict = h.check(attempts, three())  # relays that answered, holding nothing
    assert verdict.lost == len(attempts)
    verdict = h.check(attempts, three(rec(0)))
    assert verdict.lost == len(attempts) - 1
    assert len(verdict.problems) == h.MAX_PROBLEMS < verdict.problem_count


def test_commit_gaps_count_the_edges() -> None:
    assert h.commit_gaps([1.0, 1.5, 4.0], 0.0, 5.0) == 2.5
    assert h.commit_gaps([], 0.0, 5.0) == 5.0
    assert h.commit_gaps([0.5], 0.0, 10.0) == 9.5  # a stall until the end


def test_recovery_is_heal_to_the_next_commit_or_to_the_end() -> None:
    assert h.recovery_times([1.0, 3.0], [0.5, 1.25, 2.0, 9.0], 10.0) == [0.25, 6.0]
    assert h.recovery_times([5.0], [1.0], 8.0) == [3.0]
    assert h.summary([]) == (None, None)
    assert h.summary([1.0, 3.0, 2.0]) == (3.0, 2.0)


def test_parse_scenarios() -> None:
    assert parse_scenarios([]) == SCENARIOS
    assert parse_scenarios(["all"]) == SCENARIOS
    assert parse_scenarios(["kill,pause", "kill", "mix"]) == ("kill", "pause", "mix")
    with pytest.raises(ValueError, match="unknown scenario 'nap'"):
        parse_scenarios(["nap"])


def test_table_has_a_row_per_scenario() -> None:
    result = ScenarioResult("kill", 3, 10.0, attempts=5, committed=4, unknown=1)
    result.divergent = ["relay 1"]
    result.max_gap_s, result.recover_s, result.recover_median_s = 1.5, 0.5, 0.25
    text = table([result, ScenarioResult("pause", 3, 10.0)])
    header, kill, pause = text.splitlines()
    assert header.split()[:3] == ["scenario", "attempts", "committed"]
    assert kill.split() == ["kill", "5", "4", "1", "0", "0", "0", "0", "1", "0", "1.50",
                            "0.50/0.25", "-", "-"]  # fmt: skip
    assert pause.split()[0] == "pause"
    roll = ScenarioResult("roll", 3, 10.0, change_s=14.125)
    assert table([roll]).splitlines()[1].split()[-1] == "14.12"


# --- real namespaces and relays (root) ------------------------------------------------------

TOOLS = ("ip", "iptables")
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(t) is None for t in TOOLS),
    reason="needs root with ip and iptables (bash scripts/chaos-deps.sh)",
)


@pytest.fixture
def netns() -> Iterator[None]:
    """Skip while another chaos run holds the lock; afterwards nothing may be left."""
    from relay.tools.netns import NetError, leftovers

    probe = None
    try:
        from relay.tools.netns import ChaosNet

        probe = ChaosNet(1)
        probe._take_lock()
    except NetError as e:
        pytest.skip(str(e))
    finally:
        if probe is not None and probe._lock is not None:
            probe.teardown()
    yield
    assert leftovers() == []


@needs_root
def test_the_network_is_removed_on_failure(netns: None) -> None:
    from relay.tools.netns import ChaosNet, leftovers

    with pytest.raises(RuntimeError, match="boom"), ChaosNet(2) as net:
        net.isolate(0)
        assert any(name.startswith(f"netns {net.prefix}-") for name in leftovers())
        raise RuntimeError("boom")
    assert leftovers() == []


@needs_root
def test_a_crashed_runs_leftovers_are_removed_at_the_next_start(netns: None) -> None:
    from relay.tools.netns import ChaosNet, leftovers

    subprocess.run(["ip", "netns", "add", "rcdead-n0"], check=True)
    subprocess.run(["ip", "link", "add", "rcdead-br", "type", "bridge"], check=True)
    assert sorted(leftovers()) == ["link rcdead-br", "netns rcdead-n0"]
    with ChaosNet(1) as net:
        assert sorted(net.removed_leftovers) == ["link rcdead-br", "netns rcdead-n0"]
    assert leftovers() == []


def _libfaketime_missing() -> bool:
    from relay.tools.chaos import ChaosError, libfaketime

    try:
        libfaketime()
    except ChaosError:
        return True
    return False


@needs_root
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(_libfaketime_missing(), reason="needs libfaketime (scripts/chaos-deps.sh)")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_short_run_keeps_every_acknowledged_write(netns: None, scenario: str) -> None:
    from relay.tools.chaos import run_scenarios

    [result] = run_scenarios(Options(relays=3, scenarios=(scenario,), duration_s=12.0, seed=1))
    summary = (result.problems, result.log_dir)
    assert result.committed > 0, summary
    assert result.faults and all(f.heal_s is not None for f in result.faults), result.faults
    assert (result.lost, result.dup, result.phantom, result.divergent) == (0, 0, 0, []), summary
    if result.log_dir is not None:  # kept because a relay got stuck: a liveness matter
        shutil.rmtree(result.log_dir, ignore_errors=True)


@needs_root
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", ["replace-relay", "add-relay"])
def test_a_short_curve_run_adds_and_lets_go_relays_keeping_every_write(
    netns: None, scenario: str
) -> None:
    """`--curve`: the same run with CurveZMQ on every socket, where adding a relay lets its
    key in and letting one go rebinds the mesh ports (the relay let go must then hear
    nobody), with a kill -9 half way."""
    from relay.tools.chaos import run_scenarios

    options = Options(relays=4, scenarios=(scenario,), duration_s=12.0, seed=1, curve=True)
    [result] = run_scenarios(options)
    summary = (result.problems, result.log_dir)
    assert result.committed > 0 and not result.problems, summary
    assert (result.lost, result.dup, result.phantom, result.divergent) == (0, 0, 0, []), summary
    if result.log_dir is not None:
        shutil.rmtree(result.log_dir, ignore_errors=True)


# A build that speaks this peer protocol (1), for the upgrade run: the last commit before
# the upgrade scenario. A release that changes the wire makes it a build the mesh cannot
# roll from, and this moves on (docs/deploy.md section 9).
UPGRADE_FROM = "d62c180"
ROOT = Path(__file__).resolve().parent.parent


@needs_root
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_upgrade_run_keeps_every_acknowledged_write(netns: None, tmp_path: Path) -> None:
    """docs/deploy.md section 9's upgrade: the mesh on an earlier build (this repository
    at UPGRADE_FROM), every relay restarted in turn onto this one (and back, time
    permitting), with a kill -9 half way of each roll."""
    from relay.tools.chaos import run_scenarios

    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", UPGRADE_FROM], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    options = Options(
        relays=3, scenarios=("upgrade",), duration_s=20.0, seed=1, from_build=tmp_path
    )
    [result] = run_scenarios(options)
    summary = (result.problems, result.log_dir)
    assert result.committed > 0 and not result.problems, summary
    rolls = [f for f in result.faults if f.kind == "upgrade"]
    assert rolls and rolls[0].heal_s is not None, result.faults  # (onto this build, at least)
    assert (result.lost, result.dup, result.phantom, result.divergent) == (0, 0, 0, []), summary
    if result.log_dir is not None:
        shutil.rmtree(result.log_dir, ignore_errors=True)
