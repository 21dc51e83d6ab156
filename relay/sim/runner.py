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
from relay.sim.world import SimError, World

MIN_RELAYS = 3
MAX_RELAYS = 7


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
    return f"relay sim --seed {seed} --relays {relays} --faults {faults}"


def run_seed(
    seed: int, relays: int = 0, faults: FaultConfig | str = "all", **world_kwargs: Any
) -> SeedResult:
    """Build the world for `seed`, run every phase, check the history."""
    config = FaultConfig.parse(faults)
    count = relays_for(seed, relays)
    started = time.process_time()
    world = World(seed, count, config, **world_kwargs)
    try:
        history = world.run()
        violations = check_all(history, world.phase_info())
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
        faults=config.spec(),
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
    **world_kwargs: Any,
) -> Iterator[SeedResult]:
    """Results in seed order; `jobs` > 1 runs seeds in that many processes (0: one per CPU)."""
    spec = FaultConfig.parse(faults).spec()
    work = [(s, relays, spec, world_kwargs) for s in seeds]
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
    out: Callable[[str], None] = print,
) -> int:
    """`relay sim`: 0 if every seed passed, else 1. The last line is `N passed, M failed`."""
    config = FaultConfig.parse(faults)  # ValueError names an unknown fault
    if relays != 0 and not MIN_RELAYS <= relays <= 64:
        raise ValueError(f"relays must be 0 (each seed picks 3..7) or 3..64, got {relays}")
    if seed is not None:
        result = run_seed(seed, relays, config)
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
    for result in run_many(range(first_seed, first_seed + seeds), relays, config, jobs):
        if result.ok:
            passed += 1
        else:
            failed += 1
            out(format_failure(result))
    elapsed = max(time.perf_counter() - started, 1e-9)
    out(f"{(passed + failed) * 60 / elapsed:.0f} seeds per minute")
    out(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1
