"""The simulator: harness self-tests (with a toy core) and seeded runs of the real core.

The seeded runs take the seed count from the `sim_seeds` fixture (tests/conftest.py,
`--sim-seeds N`, default 120) and run in one process per CPU.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from relay import native
from relay.core.config import CoreConfig, Limits
from relay.core.machine import RelayCore
from relay.core.shell import Delivery, Ready
from relay.sim import FAULT_KINDS, FaultConfig
from relay.sim.checkers import check_all
from relay.sim.network import NetParams, Network
from relay.sim.runner import relays_for, run_cli, run_many, run_seed
from relay.sim.single import RESTART_FAULTS, SINGLE_FAULTS
from relay.sim.topologies import (
    GROUPS,
    GROW_BY,
    alternate_topology,
    build_topology,
    groups_of,
    grown_topology,
    topology_of,
)
from relay.sim.world import World, configuration_of

ROOT = Path(__file__).resolve().parents[1]
JOBS = os.cpu_count() or 1
DEFAULT_SIM_SEEDS = 120


@pytest.fixture
def seed_window(request: pytest.FixtureRequest) -> tuple[int, int]:
    """(first seed, count), from conftest's fixtures when present."""
    try:
        count = request.getfixturevalue("sim_seeds")
    except pytest.FixtureLookupError:
        count = DEFAULT_SIM_SEEDS
    try:
        first = request.getfixturevalue("sim_first_seed")
    except pytest.FixtureLookupError:
        first = 0
    return first, count


def _report(results: list) -> str:
    failed = [r for r in results if not r.ok]
    lines = [f"{len(failed)} of {len(results)} seeds failed:"]
    for r in failed[:25]:
        lines.append(f"  seed {r.seed} ({r.relays} relays): {r.violations[0][:300]}")
        lines.append(f"    ({len(r.violations)} violations) replay: {r.replay}")
    if len(failed) > 25:
        lines.append(f"  ... and {len(failed) - 25} more: {[r.seed for r in failed[25:]]}")
    return "\n".join(lines)


# --- harness self-tests -------------------------------------------------------------------


def short_world(seed: int, relays: int, faults: str, **kwargs: Any) -> World:
    """A world with short phases."""
    return World(
        seed,
        relays,
        faults,
        safety_ms=600,
        liveness_ms=600,
        quiet_ms=400,
        heal_bound_ms=200,
        **kwargs,
    )


class SkippingCore(RelayCore):
    """The real core with a planted bug: relay 1 silently drops every 7th entry it should
    hand to consumers. The checkers must notice."""

    def __init__(self, config: CoreConfig, incarnation: int, now_ms: int) -> None:
        super().__init__(config, incarnation, now_ms)
        self._handed = 0

    def ready(self) -> Ready:
        out = super().ready()
        if self.id != 1:
            return out
        kept = []
        for delivery in out.deliveries:
            entries = []
            for entry in delivery.entries:
                self._handed += 1
                if self._handed % 7:
                    entries.append(entry)
            kept.append(Delivery(delivery.stream, tuple(entries)))
        out.deliveries = kept
        return out


def test_planted_bug_is_caught() -> None:
    world = short_world(3, 3, "none", core_factory=SkippingCore)
    violations = check_all(world.run(), world.phase_info())
    assert any(v.startswith("gap:") for v in violations), violations[:5]
    assert any(v.startswith("missing:") for v in violations), violations[:5]


def test_short_fault_free_run_passes_and_does_work() -> None:
    world = short_world(11, 5, "none")
    history = world.run()
    assert check_all(history, world.phase_info()) == []
    summary = world.summary()
    assert summary["committed"] > 20
    assert summary["consumer_entries"] > 0


def test_clients_are_the_real_engines_through_the_client_service() -> None:
    world = short_world(5, 3, "none")
    history = world.run()
    assert check_all(history, world.phase_info()) == []
    summary = world.summary()
    # Every attempt went to a relay's ClientService as a wire frame, and consumers read
    # with long polls through it too.
    assert summary["produce_requests"] == summary["attempts"] > 0
    assert summary["read_requests"] > 0
    finals = list(history.finals.values())
    # The engines' own conclusions agree with the relays' answers (client_conclusions).
    assert {f.client_outcome for f in finals if f.outcome == "committed"} == {"committed"}


def test_crash_rule_keeps_a_quorum_joined() -> None:
    world = short_world(1, 3, "none")
    for r in world.ids:
        world._start(r)
    for now in range(300):  # long enough for every relay to join every stream
        world.now = now
        world._step(now, world.safety_end + world.heal_bound_ms)
    assert world.may_crash(0)
    world._crash(0)
    assert not world.may_crash(1)  # stream `all` on 3 relays needs 2 up and joined
    assert not world.may_crash(2)


def test_faults_end_before_safety_phase_ends() -> None:
    world = short_world(2, 5, "all")
    for t, _, kind, args in world._faults_heap:
        assert t < world.safety_end, (t, kind)
        if kind in ("partition", "oneway", "pause", "crash"):
            assert args[0] < world.safety_end, (kind, args)


def test_network_links_are_fifo_and_duplicates_adjacent() -> None:
    rng = random.Random(9)
    params = NetParams(jitter_ms=6, delay_p=0.1, delay_ms=(5, 50), duplicate_p=0.2)
    net = Network(rng, params)
    for t in range(200):
        for src, dst in ((0, 1), (1, 0), (0, 2)):
            net.send(t, src, dst, b"%d:%d:%d" % (src, dst, t), 0)
    got: dict[tuple[int, int], list[int]] = {}
    arrivals: list[int] = []
    for t in range(1000):
        for src, dst, _, frame in net.due(t):
            got.setdefault((src, dst), []).append(int(frame.split(b":")[2]))
            arrivals.append(int(frame.split(b":")[2]))
    for link, sent_times in got.items():
        assert sent_times == sorted(sent_times), link  # never overtakes on a link
        assert set(sent_times) == set(range(200))
    assert net.stats.duplicated > 0
    assert sum(len(v) for v in got.values()) == 600 + net.stats.duplicated
    assert arrivals != sorted(arrivals)  # but links interleave: reordering across links


def test_network_drops_and_cuts() -> None:
    net = Network(random.Random(1), NetParams(drop_p=0.5))
    for t in range(100):
        net.send(t, 0, 1, b"x", 0)
    assert 20 < net.stats.dropped < 80
    net = Network(random.Random(1), NetParams())
    net.cut([(0, 1)])
    net.send(0, 0, 1, b"x", 0)
    net.send(0, 1, 0, b"y", 0)
    assert [f for *_, f in net.due(5)] == [b"y"]
    net.uncut([(0, 1)])
    net.send(6, 0, 1, b"z", 0)
    net.cut([(0, 1)])  # cut while in flight: dropped on arrival
    assert net.due(10) == []
    net.heal()
    net.send(11, 0, 1, b"w", 0)
    assert [f for *_, f in net.due(20)] == [b"w"]


def test_fault_config_parsing() -> None:
    assert FaultConfig.parse("all").enabled() == FAULT_KINDS
    assert FaultConfig.parse("none").enabled() == ()
    assert FaultConfig.parse("drop, crash").enabled() == ("drop", "crash")
    assert FaultConfig.parse(("clock-step",)).clock_step
    for kind in FAULT_KINDS:
        assert FaultConfig.parse(kind).enabled() == (kind,)
        assert FaultConfig.parse(FaultConfig.parse(kind).spec()) == FaultConfig.parse(kind)


def test_bogus_fault_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match="unknown fault 'bogus'"):
        FaultConfig.parse("bogus")
    with pytest.raises(ValueError, match="bogus"):
        FaultConfig.parse("drop,bogus")
    with pytest.raises(ValueError, match="bogus"):
        run_cli(seeds=1, seed=None, relays=3, faults="bogus", first_seed=0)
    with pytest.raises(ValueError, match="bogus"):
        run_seed(0, 3, "bogus")


def test_relays_for_seed_is_stable_and_in_range() -> None:
    counts = [relays_for(s, 0) for s in range(200)]
    assert set(counts) == {3, 4, 5, 6, 7}
    assert counts == [relays_for(s, 0) for s in range(200)]
    assert relays_for(5, 4) == 4


def test_alternate_and_grown_topologies() -> None:
    """An alternate topology moves some groups by one relay each (never below two), a
    grown one adds GROW_BY relays to one group (or every relay it lacks); both list every
    relay, and every relay still serves `all`."""
    moved = 0
    for seed in range(200):
        rng = random.Random(seed)
        n = rng.randint(3, 7)
        topology = build_topology(rng, n)
        groups = groups_of(topology)
        alternate = alternate_topology(rng, topology)
        assert alternate != topology
        assert alternate.relay_ids == topology.relay_ids
        assert all("all" in p for p in alternate.subscriptions.values())
        for g, relays in groups_of(alternate).items():
            assert len(relays ^ groups[g]) <= 2 and len(relays) >= 2, (seed, g)
            assert abs(len(relays) - len(groups[g])) <= 1
            moved += relays != groups[g]
        grown = groups_of(grown_topology(rng, topology))
        changed = [g for g in GROUPS if grown[g] != groups[g]]
        if all(len(groups[g]) == n for g in GROUPS):
            assert changed == []  # nothing left to grow
        else:
            (g,) = changed
            assert grown[g] > groups[g]
            assert len(grown[g]) == min(n, len(groups[g]) + GROW_BY)
    assert moved > 200  # groups did move


# --- the real core ------------------------------------------------------------------------


def test_seeds_all_faults(seed_window: tuple[int, int]) -> None:
    first, count = seed_window
    seeds = range(first, first + count)
    results = []
    for r in run_many(seeds, 0, "all", jobs=JOBS):
        results.append(r)
    failed = [r for r in results if not r.ok]
    if failed:
        print(_report(results))
    assert not failed, _report(results)
    assert {r.relays for r in results} >= ({3, 4, 5, 6, 7} if count >= 50 else set())


@pytest.mark.parametrize("kind", ["retopology", "stale"])
def test_seeds_with_other_topologies(kind: str, seed_window: tuple[int, int]) -> None:
    """5.15: relays restarted onto other topology files (retopology), or one relay with
    another file from the start (stale), under each fault kind alone: safety always, and
    liveness for every stream the files do not block (relay/sim/checkers.py)."""
    first, count = seed_window
    seeds = range(first, first + max(8, count // 10))
    results = list(run_many(seeds, 0, kind, jobs=JOBS))
    assert all(r.ok for r in results), _report(results)
    if kind == "retopology":
        assert sum(r.stats["retopologies"] for r in results) >= len(results)
    else:  # one relay of each seed's world runs another file than the others
        for seed in seeds:
            world = World(seed, relays_for(seed, 0), kind)
            assert sum(world.nodes[r].config.topology != world.topology for r in world.ids) == 1


def test_a_relay_retired_from_the_running_mesh_goes_unnoticed() -> None:
    """The retire single fault (relay/sim/single.py): taking a relay off every stream by
    reloaded files, then out of the mesh, is held to the single-fault bound throughout,
    and every stream ends on the relays the files name."""
    results = list(run_many(range(500, 506), 0, jobs=JOBS, single=("retire",)))
    assert all(r.ok for r in results), _report(results)
    assert [r.stats["retired"] for r in results] == [1] * len(results)


@pytest.mark.parametrize("kind", RESTART_FAULTS)
def test_restarts_onto_other_topologies_go_unnoticed(kind: str) -> None:
    """The roll and stale single faults (relay/sim/single.py): each restart onto another
    topology is held to the single-fault bound from the moment it happens."""
    results = list(run_many(range(500, 506), 0, jobs=JOBS, single=(kind,)))
    assert all(r.ok for r in results), _report(results)
    # The fault happened: roll restarts every relay in turn, stale one relay.
    assert [r.stats["restarts"] for r in results] == [
        r.relays if kind == "roll" else 1 for r in results
    ]


@pytest.mark.parametrize(
    ("seed", "kind"),
    [
        # a relay outside a stream forwarded its produces to relays its own topology names
        # for it; one that the stream's configuration leaves out dropped the Forward (its
        # producer heard `unknown` after produce_timeout_ms) instead of answering `fenced`
        # with the configuration's relays (5.15)
        (14, "roll"),
        (34, "roll"),
        (268, "roll"),
        (37, "stale"),
        # the target of a forward restarted at once (roll): retargeting looked only for a
        # target fallen silent, and the restarted one had forgotten the forward (5.1)
        (793, "roll"),
        (958, "roll"),
        (1018, "roll"),
        (1393, "roll"),
        # the target's incoming links were cut while the mesh was quiet: it said it heard
        # the forwarder and never got the forward (5.1: retried once after a timeout)
        (919, "oneway-in"),
    ],
)
def test_seeds_that_once_failed_forwarding(seed: int, kind: str) -> None:
    result = run_seed(seed, 0, single=kind)
    assert result.ok, _report([result])


def test_seed_that_once_failed_on_store_backlog_full() -> None:
    """Seed 479: a produce right after the heal was answered `unknown`, then `rejected
    (store_backlog_full)` by a member that had not yet heard that its peer's spool had room
    again (the peer's heartbeat sat behind a latency spike on their link); the producer
    gave up on that back-pressure answer instead of retrying it within its deadline."""
    result = run_seed(479, 4, "all")
    assert result.ok, _report([result])


@pytest.mark.parametrize(
    ("seed", "relays"),
    [(1314, 7), (1348, 7), (1294, 4), (1036, 7), (1313, 7)],
)
def test_seeds_that_once_failed_first_views_across_changing_files(seed: int, relays: int) -> None:
    """5.15 establishment: files changed while a stream's first view was being decided.
    1314 and 1348: two groups of relays bound to two first views, each needing a relay of
    the other, held the stream for ever. 1294: a first view that may have been decided
    needed a relay whose file no longer named it. 1036: a proposer outside the relays of
    the first view it had to carry kept them frozen. 1313: three such proposers in turn
    kept its one holder frozen past the liveness bound."""
    result = run_seed(seed, relays, "all")
    assert result.ok, _report([result])


def test_restart_onto_another_topology_keeps_recorded_streams() -> None:
    """A relay restarted onto a topology that no longer names it for a group of streams
    keeps serving them under the configuration its acceptor records keep (5.15): it
    subscribes to them (RelayCore.recorded_streams), joins them again and delivers what
    commits. With its disk wiped it serves them too: it hears its peers state the
    established configuration, which still has it among its relays, and is readmitted
    (5.15 changes: `membership.readmit`); the configuration changes only once every live
    relay's file names the same relays."""
    for wiped in (False, True):
        world = short_world(13, 5, "none")
        group = groups_of(world.topology)
        relay = min(group["a.*"])
        elsewhere = topology_of(list(world.ids), {**group, "a.*": group["a.*"] - {relay}})
        for r in world.ids:
            world._start(r)
        bound = world.safety_end + world.heal_bound_ms
        for now in range(world.end):
            world.now = now
            if now == 300:
                world._crash(relay)
                world._retopologize(relay, elsewhere)
                if wiped:
                    world.nodes[relay].disk.clear()
                world._restart(relay)
            world._step(now, bound)
        world.now = world.end
        world._sample()
        history = world._finish()
        core = world.nodes[relay].core
        assert core is not None and not core.topology.serves(relay, "a.one")
        assert (core.counters["config_readmitted"] > 0) == wiped, core.counters
        assert check_all(history, world.phase_info()) == []
        for stream in ("a.one", "a.two"):
            assert core.serves(stream), stream
            assert stream in core.recorded_streams()
            version, relays = configuration_of(core, stream)
            assert version > 0 and relays == tuple(sorted(group["a.*"]))
            assert core.joined(stream) and not core.fenced(stream)
        # it delivered what committed after its restart
        assert history.log_for(relay, 2, "a.one") or history.log_for(relay, 2, "a.two")


def test_seeds_with_heartbeats_giving_statuses_in_turn() -> None:
    """With few streams every heartbeat gives every stream's status; with one repeated
    per heartbeat (docs/protocol.md 5.11) statuses come only when they change, while the
    stream has something to commit, or in turn, and the guarantees hold all the same."""
    limits = Limits(heartbeat_repeated_statuses=1)
    results = list(run_many(range(400, 408), 0, "all", jobs=JOBS, limits=limits))
    assert all(r.ok for r in results), _report(results)
    results = list(
        run_many(
            range(400, 400 + len(SINGLE_FAULTS)), 0, jobs=JOBS, single=SINGLE_FAULTS, limits=limits
        )
    )
    assert all(r.ok for r in results), _report(results)


def test_seeds_with_the_relay_bound_evicting() -> None:
    """A relay-wide buffer bound small enough that relays evict committed entries of one
    stream for another (docs/protocol.md 5.10), under every fault: the guarantees hold
    and the counts of memory agree with what is held (checked at the end of each seed)."""
    # A full window of 300 keys and a full log of 200 reports take 135,000 bytes per
    # stream; in a seed they fill to about a third, so entries, keys and reports of the
    # seven streams (a.late's from 0.4 s on) pass 310,000 bytes.
    limits = Limits(
        relay_buffer_max_bytes=310_000, dedupe_window_entries=300, report_log_entries=200
    )
    results = list(run_many(range(3, 11), 0, "all", jobs=JOBS, limits=limits))
    assert all(r.ok for r in results), _report(results)
    assert sum(r.stats["evicted_for_relay_bound"] for r in results) > 0


def test_replay_gives_same_event_hash() -> None:
    first = run_seed(17, 0, "all")
    second = run_seed(17, 0, "all")
    assert first.event_hash == second.event_hash
    assert first.stats == second.stats
    assert first.violations == second.violations


def test_replay_independent_of_hash_seed() -> None:
    """Determinism must not hang on Python's string hashing (set/dict of str order)."""
    code = "from relay.sim.runner import run_seed; print(run_seed(23, 4, 'all').event_hash)"
    hashes = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        hashes.add(out.stdout.strip())
    assert len(hashes) == 1, hashes


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_single_fault_kind(kind: str) -> None:
    results = list(run_many(range(100, 104), 0, kind, jobs=JOBS))
    assert all(r.ok for r in results), _report(results)


def test_connected_majority_commits_after_each_single_fault() -> None:
    """Liveness (docs/protocol.md 7): one seed per single-fault kind (a fault that never
    heals; each seed picks 3 to 7 relays), in one process per CPU; the connected majority
    must commit within the bound (relay/sim/single.py). `relay sim --single all` runs more."""
    seeds = range(300, 300 + len(SINGLE_FAULTS))
    results = list(run_many(seeds, 0, jobs=JOBS, single=SINGLE_FAULTS))
    assert sorted(r.faults for r in results) == sorted("single:" + k for k in SINGLE_FAULTS)
    assert all(r.ok for r in results), _report(results)


def test_liveness_checker_catches_a_stalled_majority() -> None:
    """The single-fault checker is not vacuous: with views never changing (a core that
    never proposes), a crash of a member leaves the others stalled, and it says so. (In a
    child process with the interpreted core: compiled callers do not see a patched
    module function.)"""
    code = (
        "from relay.core import view\n"
        "view.propose = lambda *args, **kwargs: None\n"
        "from relay.sim.runner import run_seed\n"
        "result = run_seed(300, 3, single='crash')\n"
        "print(result.ok)\n"
        "print(*result.violations, sep='\\n')\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", code],
        env=native.interpreted_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr
    ok, *violations = child.stdout.splitlines()
    assert ok == "False"
    assert any(v.startswith("stall:") for v in violations), violations


def test_cli_summary_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(seeds=2, seed=None, relays=3, faults="none", first_seed=0)
    lines = capsys.readouterr().out.strip().splitlines()
    verdict = re.fullmatch(r"(\d+) passed, (\d+) failed", lines[-1])
    assert verdict is not None, lines[-1]
    passed, failed = map(int, verdict.groups())
    assert passed + failed == 2
    assert code == (0 if failed == 0 else 1)
    assert re.fullmatch(r"\d+ seeds per minute", lines[-2])
    for line in lines[:-2]:
        if line.startswith("  replay: "):
            assert re.fullmatch(r"  replay: relay sim --seed \d+ --relays 3 --faults none", line)
    code = run_cli(seeds=1, seed=4, relays=3, faults=("none",), first_seed=0)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("seed 4: 3 relays, faults none")
    assert lines[-1] in ("1 passed, 0 failed", "0 passed, 1 failed")


@pytest.mark.slow
def test_many_seeds_all_faults_slow(seed_window: tuple[int, int]) -> None:
    first, count = seed_window
    if count >= 2000:
        pytest.skip(f"test_seeds_all_faults already ran {count} seeds")
    results = list(run_many(range(first, first + 2000), 0, "all", jobs=JOBS))
    assert all(r.ok for r in results), _report(results)
