"""Run simulation seeds and report: `run_seed` for one, `run_cli` for `relay sim`."""

from __future__ import annotations

import multiprocessing
import os
import random
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from relay.sim.checkers import check_all
from relay.sim.faults import FaultConfig
from relay.sim.history import event_hash
from relay.sim.single import fault_ms, single_fault_liveness
from relay.sim.world import SINGLE_LULL_BEFORE_MS, SimError, World

MIN_RELAYS = 3
MAX_RELAYS = 7
# A single-fault run (relay/sim/single.py): a warm-up, then the fault for the rest.
SINGLE_WARMUP_MS = 800
SINGLE_FAULT_MS = 3_000
SINGLE_QUIET_MS = 1_500
SINGLE_PREFIX = "single:"  # SeedResult.faults of a single-fault run: "single:<kind>"


@dataclass
class SeedResult:
    seed: int
    ok: bool
    violations: list[str]
    event_hash: str
    stats: dict[str, int]
    relays: int = 0
    faults: str = "all"
    seconds: float = 0.0  # CPU time of the run (not part of the deterministic result)

    @property
    def replay(self) -> str:
        return replay_command(self.seed, self.relays, self.faults)


def relays_for(seed: int, relays: int) -> int:
    """`relays` if positive, else a count in 3..7 picked by the seed."""
    if relays > 0:
        return relays
    return random.Random(seed * 1_000_003 + 7).randint(MIN_RELAYS, MAX_RELAYS)


def replay_command(seed: int, relays: int, faults: str) -> str:
    if faults.startswith(SINGLE_PREFIX):
        return f"relay sim --seed {seed} --relays {relays} --single {faults[len(SINGLE_PREFIX) :]}"
    return f"relay sim --seed {seed} --relays {relays} --faults {faults}"


def single_warmup_ms(seed: int) -> int:
    """A single-fault run's warm-up: SINGLE_WARMUP_MS of writes, and on an odd seed, whose
    mesh goes quiet before the fault strikes, the lull after them: so that the fault
    strikes a mesh whose streams are all established (by their first view, on first use;
    a stream first written while one of its relays is down waits for it, docs/protocol.md
    5.15 and 7, and tests/scenarios/first_view.txt shows it)."""
    return SINGLE_WARMUP_MS + (SINGLE_LULL_BEFORE_MS if seed % 2 else 0)


def single_for(seed: int, kinds: Sequence[str]) -> str:
    """The single fault seed `seed` runs, of `kinds` (each seed one, in turn)."""
    return kinds[seed % len(kinds)]


def run_seed(
    seed: int,
    relays: int = 0,
    faults: FaultConfig | str = "all",
    *,
    single: str | None = None,
    **world_kwargs: Any,
) -> SeedResult:
    """Build the world for `seed`, run every phase, check the history. With `single`, a
    single-fault run of that kind (relay/sim/single.py) instead of the random faults."""
    config = FaultConfig.parse("none" if single is not None else faults)
    count = relays_for(seed, relays)
    started = time.process_time()
    if single is not None:
        world_kwargs = {
            "safety_ms": single_warmup_ms(seed),
            "liveness_ms": fault_ms(single, count, SINGLE_FAULT_MS),
            "quiet_ms": SINGLE_QUIET_MS,
            **world_kwargs,
        }
    world = World(seed, count, config, single=single, **world_kwargs)
    try:
        history = world.run()
        violations = check_all(history, world.phase_info())
        if single is not None:
            violations += single_fault_liveness(history, world.single_info())
    except SimError as exc:
        violations = [f"error: {exc}"]
    except Exception as exc:  # the final state queries or a checker: still a failed seed
        violations = [
            f"error: seed {seed} after the run: {type(exc).__name__}: {exc}\n"
            + "".join(traceback.format_exception(exc)[-6:])
        ]
    digest = event_hash(world.events)
    return SeedResult(
        seed=seed,
        ok=not violations,
        violations=violations,
        event_hash=digest,
        stats=world.summary(),
        relays=count,
        faults=config.spec() if single is None else SINGLE_PREFIX + single,
        seconds=time.process_time() - started,
    )


def _run_job(job: tuple[int, int, str, dict[str, Any]]) -> SeedResult:
    seed, relays, faults, kwargs = job
    return run_seed(seed, relays, faults, **kwargs)


def run_many(
    seeds: Iterable[int],
    relays: int = 0,
    faults: FaultConfig | str = "all",
    jobs: int = 1,
    *,
    single: Sequence[str] = (),
    **world_kwargs: Any,
) -> Iterator[SeedResult]:
    """Results in seed order; `jobs` > 1 runs seeds in that many processes (0: one per CPU).
    With `single` kinds, each seed is a single-fault run of one of them (`single_for`)."""
    spec = FaultConfig.parse(faults).spec()
    work = [
        (
            s,
            relays,
            spec,
            {**world_kwargs, "single": single_for(s, single)} if single else world_kwargs,
        )
        for s in seeds
    ]
    if jobs == 0:
        jobs = os.cpu_count() or 1
    if jobs <= 1 or len(work) <= 1:
        for job in work:
            yield _run_job(job)
        return
    with multiprocessing.get_context("fork").Pool(min(jobs, len(work))) as pool:
        yield from pool.imap(_run_job, work, chunksize=1)


def format_failure(result: SeedResult, limit: int = 3) -> str:
    shown = "; ".join(v.splitlines()[0] for v in result.violations[:limit])
    more = len(result.violations) - limit
    if more > 0:
        shown += f"; ... {more} more"
    return (
        f"seed {result.seed} FAILED ({result.relays} relays, {len(result.violations)} "
        f"violations): {shown}\n  replay: {result.replay}"
    )


def run_cli(
    seeds: int = 100,
    seed: int | None = None,
    relays: int = 0,
    faults: str | Sequence[str] | FaultConfig = "all",
    first_seed: int = 0,
    *,
    jobs: int = 1,
    single: Sequence[str] = (),
    out: Callable[[str], None] = print,
) -> int:
    """`relay sim`: 0 if every seed passed, else 1. The last line is `N passed, M failed`.
    With `single` kinds, single-fault runs (relay/sim/single.py) instead of random faults."""
    config = FaultConfig.parse(faults)  # ValueError names an unknown fault
    if relays != 0 and not MIN_RELAYS <= relays <= 64:
        raise ValueError(f"relays must be 0 (each seed picks 3..7) or 3..64, got {relays}")
    if seed is not None:
        kind = single_for(seed, single) if single else None
        result = run_seed(seed, relays, config, single=kind)
        out(
            f"seed {seed}: {result.relays} relays, faults {result.faults}, "
            f"{'ok' if result.ok else 'FAILED'}, event hash {result.event_hash}, "
            f"{result.seconds:.2f} s"
        )
        out("stats: " + ", ".join(f"{k}={v}" for k, v in result.stats.items()))
        for v in result.violations:
            out(f"  {v}")
        if not result.ok:
            out(f"  replay: {result.replay}")
        out(f"{int(result.ok)} passed, {int(not result.ok)} failed")
        return 0 if result.ok else 1
    if seeds <= 0:
        raise ValueError(f"seeds must be positive, got {seeds}")
    started = time.perf_counter()
    passed = failed = 0
    seed_range = range(first_seed, first_seed + seeds)
    for result in run_many(seed_range, relays, config, jobs, single=single):
        if result.ok:
            passed += 1
        else:
            failed += 1
            out(format_failure(result))
    elapsed = max(time.perf_counter() - started, 1e-9)
    out(f"{(passed + failed) * 60 / elapsed:.0f} seeds per minute")
    out(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1
