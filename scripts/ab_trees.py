"""Compare the relays of two source trees on this machine, side by side (a benchmark).

    .venv/bin/python scripts/ab_trees.py OTHER_TREE [--rounds N] [--one-in-flight N]
        [--windows 16,256] [--duration-s S]

OTHER_TREE is another checkout of the project with its own `.venv` and compiled build
(`bash scripts/setup.sh` there; e.g. `git worktree add ../base <commit>`). Two 3-relay
meshes on free 127.0.0.1 ports are up at once: A runs OTHER_TREE's relays (its package
and its build, through PYTHONPATH and RELAY_NATIVE_DIR), B this tree's. The same client
(this tree's sync `Producer`) drives both, in rounds that alternate which side goes first:
one in flight (p50 and p90 of the round trip, relay CPU and client CPU per transaction),
then each window for `--duration-s` (tx/s, CPU of relays and client per transaction).
Prints each round, then the medians and in how many rounds B's one-in-flight p50 was
lower. A machine's speed drifts by more than most changes, so only rounds run side by
side mean anything. The meshes are always stopped.

Exit codes: 0; 2 usage error; 3 if a mesh could not start or a relay does not run its
tree's compiled build (checked in /proc/PID/maps: from this checkout, `python -m relay`
would import this tree first and run it interpreted, whatever PYTHONPATH says).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from relay import native
from relay.client import Producer
from relay.launcher import Mesh, MeshError, write_loopback_topology
from relay.tools.bench import STREAM, _cpu_s

START_TIMEOUT_S = 60.0
WARMUP_TX = 200
VALUE = b"x" * 100


def _mesh(directory: Path, tree: Path | None) -> Mesh:
    config = write_loopback_topology(directory, {r: [STREAM] for r in range(3)}, [STREAM])
    wrappers = None
    if tree is not None:
        # In the other tree's directory: `python -m relay` puts the working directory
        # first on the search path, before PYTHONPATH, so started from this checkout the
        # relays would import this tree (interpreted: the other build does not match it).
        run_as = [
            "env",
            f"--chdir={tree}",
            f"PYTHONPATH={tree}",
            f"RELAY_NATIVE_DIR={tree}/.venv/relay-native",
        ]
        wrappers = {r: run_as for r in range(3)}
    return Mesh(config, log_dir=directory / "logs", log_level="warning", wrappers=wrappers)


def _check_build(mesh: Mesh, builds: Path, side: str) -> None:
    """Every relay of `mesh` runs compiled modules from `builds` (/proc/PID/maps): a relay
    that imported another tree, or runs interpreted, would make the comparison a lie."""
    for relay_id, pid in mesh.pids.items():
        maps = Path(f"/proc/{pid}/maps").read_text()
        if str(builds.resolve()) not in maps:
            raise MeshError(f"side {side}, relay {relay_id}: not running the build in {builds}")


def _relay_cpu_s(mesh: Mesh) -> float:
    return sum(_cpu_s(pid) or 0.0 for pid in mesh.pids.values())


def _one_in_flight(mesh: Mesh, count: int) -> tuple[float, float, float, float]:
    """p50 and p90 round trip (us), relay and client CPU per transaction (us)."""
    relays = {r: e.client for r, e in mesh.endpoints.items()}
    with Producer(relays=relays, window=1) as producer:
        for _ in range(WARMUP_TX):
            producer.send(STREAM, VALUE)
        relay_before, client_before = _relay_cpu_s(mesh), time.process_time()
        took = []
        for _ in range(count):
            started = time.perf_counter()
            producer.send(STREAM, VALUE)
            took.append(time.perf_counter() - started)
        relay_used = _relay_cpu_s(mesh) - relay_before
        client_used = time.process_time() - client_before
    took.sort()
    p50, p90 = took[len(took) // 2], took[int(len(took) * 0.9)]
    return p50 * 1e6, p90 * 1e6, relay_used / count * 1e6, client_used / count * 1e6


def _window(mesh: Mesh, window: int, duration_s: float) -> tuple[float, float]:
    """tx/s and CPU of relays and client per transaction (us)."""
    relays = {r: e.client for r, e in mesh.endpoints.items()}
    with Producer(relays=relays, window=window) as producer:
        producer.send_many(STREAM, [VALUE] * max(window, WARMUP_TX), return_exceptions=True)
        sent = 0
        deadline = time.perf_counter() + duration_s

        def items() -> Iterator[bytes]:
            nonlocal sent
            while time.perf_counter() < deadline:
                sent += 1
                yield VALUE

        relay_before, client_before = _relay_cpu_s(mesh), time.process_time()
        started = time.perf_counter()
        producer.send_many(STREAM, items(), return_exceptions=True)
        elapsed = time.perf_counter() - started
        used = _relay_cpu_s(mesh) - relay_before + time.process_time() - client_before
    return sent / elapsed, used / max(sent, 1) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other_tree", type=Path)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--one-in-flight", type=int, default=2_000, metavar="N")
    parser.add_argument("--windows", default="16,256")
    parser.add_argument("--duration-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    tree = args.other_tree.resolve()
    if not (tree / "relay").is_dir() or not (tree / ".venv").is_dir():
        parser.error(f"{tree} is not a checkout with a .venv (run bash scripts/setup.sh there)")
    try:
        windows = [int(w) for w in args.windows.split(",")]
    except ValueError:
        parser.error(f"--windows must be comma-separated integers, got {args.windows!r}")
    if args.rounds < 1 or args.one_in_flight < 10 or min(windows) < 1:
        parser.error("--rounds >= 1, --one-in-flight >= 10 and windows >= 1")
    rows: dict[str, list[tuple[tuple[float, float, float, float], list[tuple[float, float]]]]]
    rows = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="relay-bench-ab-") as scratch:
        meshes = {"A": _mesh(Path(scratch) / "a", tree), "B": _mesh(Path(scratch) / "b", None)}
        try:
            for mesh in meshes.values():
                mesh.start(START_TIMEOUT_S)
            _check_build(meshes["A"], tree / ".venv" / "relay-native", "A")
            _check_build(meshes["B"], native.builds_dir(), "B")
            for round_no in range(args.rounds):
                order = ("A", "B") if round_no % 2 == 0 else ("B", "A")
                for side in order:
                    one = _one_in_flight(meshes[side], args.one_in_flight)
                    runs = [_window(meshes[side], w, args.duration_s) for w in windows]
                    rows[side].append((one, runs))
                    shapes = "  ".join(
                        f"w{w} {rate:,.0f} tx/s {cpu:.0f} us"
                        for w, (rate, cpu) in zip(windows, runs, strict=True)
                    )
                    print(
                        f"{side} one in flight p50 {one[0]:,.0f} us p90 {one[1]:,.0f} relay CPU "
                        f"{one[2]:,.0f} us client CPU {one[3]:,.0f} us | {shapes}",
                        flush=True,
                    )
        except MeshError as e:
            print(f"ab_trees: {e}", file=sys.stderr)
            return 3
        finally:
            for mesh in meshes.values():
                mesh.stop()

    def median(side: str, pick: int, window: int | None = None) -> float:
        if window is None:
            return statistics.median(one[pick] for one, _ in rows[side])
        return statistics.median(runs[window][pick] for _, runs in rows[side])

    b_faster = sum(b[0][0] < a[0][0] for a, b in zip(rows["A"], rows["B"], strict=True))
    print(f"A = {tree}, B = this tree; medians of {args.rounds} rounds, A / B:")
    print(
        f"  one in flight p50 {median('A', 0):,.0f} / {median('B', 0):,.0f} us (B lower in "
        f"{b_faster} of {args.rounds}), relay CPU {median('A', 2):,.0f} / {median('B', 2):,.0f}"
        " us per transaction"
    )
    for i, w in enumerate(windows):
        print(
            f"  window {w}: {median('A', 0, i):,.0f} / {median('B', 0, i):,.0f} tx/s, CPU "
            f"{median('A', 1, i):.0f} / {median('B', 1, i):.0f} us per transaction"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
