"""How much CPU an idle relay uses: each relay process of a mesh, measured while nothing
is produced or read.

    .venv/bin/python scripts/idle_cpu.py [--config FILE] [--seconds N] [--settle-s T]
        [--heartbeat-interval-ms MS] [--suspect-timeout-ms MS] [--json]

Starts every relay of the topology (default config/topology.yaml) as child processes
(`relay.launcher.Mesh`), on free ports of 127.0.0.1 with a temporary data directory (the
same relays, streams, limits and spool settings; `--heartbeat-interval-ms` and
`--suspect-timeout-ms` override the limits), waits until every relay is ready, lets the
mesh settle for `--settle-s`, then reads each relay's utime + stime from /proc/<pid>/stat
before and after `--seconds` of idleness. Prints per relay the percentage of one core and
its wake-ups per second (the node's `loop_turns` counter, when the relay reports it), and
the mean over the relays. The resolution of /proc/<pid>/stat is one clock tick (usually
10 ms), so 10 s resolve 0.1 % of a core. The mesh is always stopped.

Exit codes: 0; 2 usage or configuration error; 3 if the mesh could not start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from relay.errors import ConfigError
from relay.launcher import Mesh, MeshError, write_loopback_topology
from relay.topology import MeshConfig, load

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "config" / "topology.yaml"
START_TIMEOUT_S = 60.0
STATUS_TIMEOUT_S = 5.0
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")

EXIT_OK, EXIT_USAGE, EXIT_MESH = 0, 2, 3


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        stat = f.read()
    # The command name (field 2) may hold spaces: count fields after its closing paren.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / CLOCK_TICKS_PER_S


def loop_turns(status: dict[str, Any] | None) -> int | None:
    if status is None:
        return None
    counters = status.get("node", {}).get("counters", {})
    turns = counters.get("loop_turns")
    return int(turns) if isinstance(turns, int) else None


def local_copy(config: MeshConfig, directory: Path, overrides: dict[str, int]) -> Path:
    """The topology on free ports of 127.0.0.1 with its data under `directory`."""
    limits = {**dataclasses.asdict(config.limits), **overrides}
    spool = dataclasses.asdict(config.spool) if config.spool.enabled else None
    subscriptions = {r: spec.streams for r, spec in config.relays.items()}
    return write_loopback_topology(directory, subscriptions, config.streams, limits, spool)


def measure(mesh: Mesh, seconds: float) -> dict[int, tuple[float, float | None]]:
    """relay id -> (% of a core, wake-ups per second or None) over `seconds` idle."""
    pids = mesh.pids
    turns_before = {r: loop_turns(mesh.status(r, STATUS_TIMEOUT_S)) for r in pids}
    started = time.monotonic()
    cpu_before = {r: cpu_seconds(pid) for r, pid in pids.items()}
    time.sleep(seconds)  # the measurement itself: the mesh is left alone
    cpu_after = {r: cpu_seconds(pid) for r, pid in pids.items()}
    elapsed = time.monotonic() - started
    result: dict[int, tuple[float, float | None]] = {}
    for relay in pids:
        turns_after = loop_turns(mesh.status(relay, STATUS_TIMEOUT_S))
        before = turns_before[relay]
        rate = None
        if before is not None and turns_after is not None:
            rate = (turns_after - before) / elapsed
        result[relay] = (100.0 * (cpu_after[relay] - cpu_before[relay]) / elapsed, rate)
    return result


LIMIT_OPTIONS = ("heartbeat_interval_ms", "suspect_timeout_ms")


def add_limit_options(parser: argparse.ArgumentParser) -> None:
    """--heartbeat-interval-ms and --suspect-timeout-ms (also used by heal_time.py)."""
    for name in LIMIT_OPTIONS:
        option = "--" + name.replace("_", "-")
        parser.add_argument(option, type=int, default=None, metavar="MS", help="limit override")


def limit_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The limits given by `add_limit_options`' options."""
    values = {name: getattr(args, name) for name in LIMIT_OPTIONS}
    return {name: value for name, value in values.items() if value is not None}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="idle_cpu.py",
        description="Measure the CPU each relay of an idle mesh uses (% of one core).",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        metavar="FILE",
        help="the topology (run on free ports; default config/topology.yaml)",
    )
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="idle time measured (default 10)"
    )
    parser.add_argument(
        "--settle-s", type=float, default=2.0, help="idle time before measuring (default 2)"
    )
    add_limit_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.settle_s < 0:
        parser.error("--seconds must be positive and --settle-s not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = limit_overrides(args)
    with tempfile.TemporaryDirectory(prefix="relay-idle-") as tmp:
        directory = Path(tmp)
        try:
            config = load(args.config)
            path = local_copy(config, directory, overrides)
            mesh = Mesh(path, log_level="warning", log_dir=directory / "logs")
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
        limits = mesh.config.limits
        try:
            try:
                mesh.start(timeout_s=START_TIMEOUT_S)
            except MeshError as e:
                print(f"error: the mesh did not start: {e}", file=sys.stderr)
                return EXIT_MESH
            time.sleep(args.settle_s)  # let joins, first heartbeats and GC settle
            result = measure(mesh, args.seconds)
        finally:
            mesh.stop()
    mean = statistics.fmean(cpu for cpu, _ in result.values())
    if args.json:
        doc = {
            "config": str(args.config),
            "seconds": args.seconds,
            "heartbeat_interval_ms": limits.heartbeat_interval_ms,
            "suspect_timeout_ms": limits.suspect_timeout_ms,
            "relays": {
                str(r): {"cpu_percent": cpu, "wakeups_per_s": rate}
                for r, (cpu, rate) in result.items()
            },
            "mean_cpu_percent": mean,
        }
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    print(
        f"{len(result)} relays of {args.config}, idle {args.seconds:g} s; "
        f"heartbeat_interval_ms {limits.heartbeat_interval_ms}, "
        f"suspect_timeout_ms {limits.suspect_timeout_ms}"
    )
    for relay, (cpu, rate) in result.items():
        wakeups = "-" if rate is None else f"{rate:.0f}"
        print(f"relay {relay}: {cpu:5.2f} % of a core, {wakeups} wake-ups/s")
    print(f"mean: {mean:.2f} % of a core per relay")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
