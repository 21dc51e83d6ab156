"""Fingerprint the protocol's behaviour, to show that a restructuring changed none of it.

    python scripts/behaviour_fingerprint.py --write FILE     # record
    python scripts/behaviour_fingerprint.py --compare FILE   # record again and compare
    python scripts/behaviour_fingerprint.py --compare OLD --write NEW   # both, one run

One line per simulator seed (seeds 0..N-1, every fault kind, 3-7 relays picked by the seed):
whether it passed, the event hash (every fault, frame send/drop with its size and due time,
delivery and fence/join change, with its millisecond) and a hash of the run's statistics
(outcomes, frame counts, reconnects). Then one line per explorer run (depth first, breadth
first, random walks; the default bound of 20,000 states): states explored, distinct states,
transitions, depth, coverage and core counters seen. Two versions of the code behave alike
on these runs exactly when every line is equal. `--compare` prints how many seeds and
explorer runs differ, the first `--show` differing lines, and exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import xxhash

from relay.sim.explore import run_explore
from relay.sim.runner import run_many

SEEDS = 500
EXPLORE_RUNS = (("dfs", 0), ("bfs", 0), ("walk", 0))
SHOW = 20


def sim_lines(seeds: int, jobs: int) -> list[str]:
    lines = []
    for result in run_many(range(seeds), 0, "all", jobs):
        stats = json.dumps(result.stats, sort_keys=True)
        lines.append(
            f"sim seed={result.seed} relays={result.relays} ok={int(result.ok)} "
            f"events={result.event_hash} stats={xxhash.xxh3_64_hexdigest(stats.encode())}"
        )
    return lines


def explore_lines() -> list[str]:
    lines = []
    for strategy, seed in EXPLORE_RUNS:
        r = run_explore(strategy=strategy, seed=seed)
        lines.append(
            f"explore strategy={strategy} seed={seed} ok={int(r.ok)} explored={r.states_explored} "
            f"distinct={r.distinct_states} transitions={r.transitions} depth={r.max_depth} "
            f"coverage={json.dumps(r.coverage, sort_keys=True)} "
            f"counters={json.dumps(r.counters, sort_keys=True)}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", type=Path, metavar="FILE", help="record the fingerprint")
    ap.add_argument("--compare", type=Path, metavar="FILE", help="compare with a record")
    ap.add_argument("--seeds", type=int, default=SEEDS, help=f"seeds 0..N-1 (default {SEEDS})")
    ap.add_argument("--jobs", type=int, default=0, help="processes (default: one per CPU)")
    ap.add_argument("--show", type=int, default=SHOW, help=f"differing lines shown ({SHOW})")
    args = ap.parse_args(argv)
    if args.write is None and args.compare is None:
        ap.error("give --write FILE, --compare FILE, or both")
    # Read the record before running: --write and --compare may name the same file.
    want = args.compare.read_text().splitlines() if args.compare else []
    started = time.monotonic()
    lines = sim_lines(args.seeds, args.jobs) + explore_lines()
    elapsed = time.monotonic() - started
    if args.write:
        args.write.write_text("\n".join(lines) + "\n")
        print(f"recorded {len(lines)} lines to {args.write} in {elapsed:.0f} s")
    if args.compare is None:
        return 0
    if len(want) != len(lines):
        print(f"different run shapes: {len(want)} recorded lines, {len(lines)} now")
    differ = [(w, g) for w, g in zip(want, lines, strict=False) if w != g]
    for w, g in differ[: args.show]:
        print(f"- {w}\n+ {g}")
    sims = sum(line.startswith("sim ") for line in lines)
    sims_differ = sum(g.startswith("sim ") for _, g in differ)
    print(
        f"compared {len(lines)} lines in {elapsed:.0f} s: {len(differ)} differ "
        f"({sims_differ} of {sims} seeds, {len(differ) - sims_differ} of "
        f"{len(lines) - sims} explorer runs)"
    )
    return 1 if differ or len(want) != len(lines) else 0


if __name__ == "__main__":
    sys.exit(main())
