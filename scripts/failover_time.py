"""How long a relay mesh stalls when one relay is killed with SIGKILL.

    .venv/bin/python scripts/failover_time.py [--runs N] [--config FILE | --free-ports]
        [--stream S] [--warmup-s T] [--after-s T] [--coordinating] [--json]

Starts every relay of the topology (default config/topology.yaml; if one of its ports is
taken, a temporary copy of it on free ports of the same hosts; `--free-ports` always uses
such a copy) as child processes. Each run:

1. picks the victim (run i kills the i-th relay serving the stream, round robin) and runs a
   producer with one transaction in flight, as fast as they commit, through the relays
   that survive (the first survivor first). With `--coordinating` there is one such
   producer per relay of the stream instead, each asking its own relay first (the victim
   too) and failing over to the others;
2. after `--warmup-s` kills the victim with SIGKILL, keeps producing for `--after-s`,
   restarts the victim, waits until it has rejoined (`rejoin_s`), and produces 0.5 s more;
3. measures, over the commits of all its producers,
   - `first_ms`: from the kill to the first commit of a transaction sent after the kill
     (none within `--after-s`: the run `stalled`, and `resume_ms` is from the restart to
     the next commit; docs/protocol.md section 8 allows such a stall when the victim was
     coordinating),
   - `gap_ms`: the longest time between two consecutive commits from `--warmup-s`/2 before
     the kill to the restart, and `base_gap_ms`, the longest before that window,
   - `lat_ms`: the median commit latency before the kill;
4. reads the stream back from a survivor and counts acknowledged transactions that are
   missing (`lost`, must be 0).

Prints one table row per run and a summary, or with `--json` one JSON document. The mesh
is always stopped. Exit codes: 0; 1 if a transaction acknowledged as committed was lost, a
relay did not rejoin or a run could not be measured (a stall alone is not a failure);
2 usage or configuration error; 3 if the mesh could not start.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped, unused-ignore]

from relay.client import Consumer, Producer
from relay.errors import ClientError, ConfigError
from relay.launcher import Mesh, MeshError
from relay.topology import MeshConfig, load

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "config" / "topology.yaml"
DEFAULT_STREAM = "orders.eu"
START_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 20.0

EXIT_OK, EXIT_BAD, EXIT_USAGE, EXIT_MESH = 0, 1, 2, 3


# --- the topology -------------------------------------------------------------------------


def busy_ports(config: MeshConfig) -> list[str]:
    busy = []
    for spec in config.relays.values():
        for port in (spec.mesh_port, spec.client_port):
            family = socket.AF_INET6 if ":" in spec.bind_host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((spec.bind_host, port))
                except OSError:
                    busy.append(f"{spec.bind_host}:{port}")
    return busy


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def copy_on_free_ports(config_path: Path, directory: Path) -> Path:
    """The topology with every port replaced by a free one (same relays, streams, limits)."""
    doc = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    for relay in doc["relays"]:
        relay["mesh_port"] = free_port(str(relay["host"]))
        relay["client_port"] = free_port(str(relay["host"]))
    doc["data_dir"] = str(directory / "data")
    path = directory / "topology.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


# --- one run ------------------------------------------------------------------------------


@dataclass
class Run:
    run: int
    killed: int
    via: list[int]
    commits: int = 0
    errors: int = 0
    retries: int = 0
    lat_ms: float | None = None  # median commit latency before the kill
    first_ms: float | None = None  # kill -> first commit of a send started after it
    stalled: bool = False  # no such commit within --after-s
    resume_ms: float | None = None  # if stalled: restart -> the next commit
    gap_ms: float | None = None  # longest commit gap around the kill
    gap_from_kill_ms: float | None = None  # where that gap started, relative to the kill
    base_gap_ms: float | None = None  # longest commit gap before that window
    lost: int = 0  # acknowledged transactions missing from the read-back
    rejoin_s: float | None = None
    problems: list[str] = field(default_factory=list)


class Pump(threading.Thread):
    """One transaction in flight, as fast as they commit; keeps (started, done, seq)."""

    def __init__(self, relays: dict[int, str], stream: str) -> None:
        super().__init__(name="pump", daemon=True)
        self.relays = relays
        self.stream = stream
        self.stopping = threading.Event()
        self.commits: list[tuple[float, float, int]] = []
        self.errors: list[str] = []
        self.retries = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with Producer(self.relays, window=1, send_timeout_s=SEND_TIMEOUT_S) as producer:
                n = 0
                while not self.stopping.is_set():
                    started = time.monotonic()
                    try:
                        seq = producer.send(self.stream, b"failover-%d" % n)
                    except ClientError as e:
                        self.errors.append(f"{type(e).__name__}: {e}")
                    else:
                        self.commits.append((started, time.monotonic(), seq))
                    n += 1
                self.retries = producer.stats["retries"]
        except BaseException as e:
            self.failure = e


def measure(
    mesh: Mesh,
    run: Run,
    stream: str,
    args: argparse.Namespace,
    members: list[int],
) -> tuple[list[Pump], dict[str, float]]:
    """Produce, kill, wait, restart; return the producers and the times of the events."""
    endpoint = {r: mesh.endpoints[r].client for r in members}
    if args.coordinating:
        orders = [[m, *(o for o in members if o != m)] for m in members]
    else:
        orders = [run.via]
    pumps = [Pump({r: endpoint[r] for r in order}, stream) for order in orders]
    times: dict[str, float] = {}
    for pump in pumps:
        pump.start()
    try:
        time.sleep(args.warmup_s)
        if not any(pump.commits for pump in pumps):
            run.problems.append(f"nothing committed in the {args.warmup_s:g} s warm-up")
        times["kill"] = time.monotonic()
        mesh.kill(run.killed, signal.SIGKILL)
        time.sleep(args.after_s)
        times["restart"] = time.monotonic()
        try:
            mesh.restart(run.killed, timeout_s=START_TIMEOUT_S)
            times["ready"] = time.monotonic()
            run.rejoin_s = round(times["ready"] - times["restart"], 3)
            time.sleep(0.5)
        except MeshError as e:
            run.problems.append(f"relay {run.killed} did not rejoin: {e}")
    finally:
        for pump in pumps:
            pump.stopping.set()
        for pump in pumps:
            pump.join(SEND_TIMEOUT_S + 5)
    for pump in pumps:
        if pump.is_alive():
            run.problems.append("a producer did not stop")
        if pump.failure is not None:
            run.problems.append(f"a producer failed: {pump.failure!r}")
    return pumps, times


def analyse(run: Run, pumps: list[Pump], times: dict[str, float], warmup_s: float) -> None:
    t_kill, t_restart = times["kill"], times["restart"]
    commits = sorted((c for pump in pumps for c in pump.commits), key=lambda c: c[1])
    errors = [e for pump in pumps for e in pump.errors]
    run.commits = len(commits)
    run.errors = len(errors)
    run.retries = sum(pump.retries for pump in pumps)
    run.problems += [f"send failed: {e}" for e in errors[:3]]
    before = [done - started for started, done, _ in commits if done < t_kill]
    if before:
        run.lat_ms = round(1000 * statistics.median(before), 2)
    after = [done for started, done, _ in commits if started >= t_kill]
    if after and after[0] < t_restart:
        run.first_ms = round(1000 * (after[0] - t_kill), 1)
    else:
        run.stalled = True
        resumed = [done for _, done, _ in commits if done >= t_restart]
        if resumed:
            run.resume_ms = round(1000 * (resumed[0] - t_restart), 1)
        else:
            run.problems.append("nothing committed after the restart either")
    window_start = t_kill - warmup_s / 2
    times_done = [done for _, done, _ in commits]
    gaps = list(itertools.pairwise(times_done))
    around = [(a, b) for a, b in gaps if b >= window_start and a <= t_restart]
    base = [(a, b) for a, b in gaps if b < window_start and a > times_done[0]]
    if around:
        a, b = max(around, key=lambda g: g[1] - g[0])
        run.gap_ms = round(1000 * (b - a), 1)
        run.gap_from_kill_ms = round(1000 * (a - t_kill), 1)
    if base:
        run.base_gap_ms = round(1000 * max(b - a for a, b in base), 1)


def read_back(mesh: Mesh, run: Run, stream: str, pumps: list[Pump]) -> None:
    """Count acknowledged transactions missing from a survivor's timeline."""
    seqs = sorted(seq for pump in pumps for _, _, seq in pump.commits)
    if not seqs:
        return
    survivor = run.via[-1]
    got: set[int] = set()
    previous = -1
    with Consumer(
        {survivor: mesh.endpoints[survivor].client}, timeout_s=READ_TIMEOUT_S
    ) as consumer:
        consumer.subscribe(stream, seqs[0] - 1)
        for record in consumer:
            if record.seq <= previous:
                run.problems.append(f"relay {survivor}: seq {record.seq} after {previous}")
            previous = record.seq
            got.add(record.seq)
            if record.seq >= seqs[-1]:
                break
    run.lost = len([s for s in seqs if s not in got])
    if run.lost:
        run.problems.append(f"{run.lost} acknowledged transactions missing on relay {survivor}")


# --- output -------------------------------------------------------------------------------

COLUMNS = [
    ("run", "run", "{}"),
    ("killed", "killed", "{}"),
    ("via", "survivors", "{}"),
    ("commits", "commits", "{}"),
    ("errors", "errors", "{}"),
    ("retries", "retries", "{}"),
    ("lat_ms", "lat ms", "{:.1f}"),
    ("first_ms", "first commit ms", "{:.0f}"),
    ("stalled", "stalled", "{}"),
    ("resume_ms", "resume ms", "{:.0f}"),
    ("gap_ms", "max gap ms", "{:.0f}"),
    ("gap_from_kill_ms", "gap at ms", "{:+.0f}"),
    ("base_gap_ms", "base gap ms", "{:.0f}"),
    ("lost", "lost", "{}"),
    ("rejoin_s", "rejoin s", "{:.2f}"),
]


def cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return fmt.format(value)


def table(runs: list[Run]) -> str:
    rows = [[title for _, title, _ in COLUMNS]]
    rows += [[cell(getattr(r, key), fmt) for key, _, fmt in COLUMNS] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def summary(runs: list[Run]) -> dict[str, dict[str, float]]:
    out = {}
    for key in ("first_ms", "resume_ms", "gap_ms", "lat_ms", "rejoin_s"):
        values = [getattr(r, key) for r in runs if getattr(r, key) is not None]
        if values:
            out[key] = {
                "min": min(values),
                "median": statistics.median(values),
                "max": max(values),
            }
    return out


# --- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="failover_time.py",
        description="Kill one relay of a running mesh with SIGKILL under a steady producer "
        "and measure how long commits stall.",
    )
    parser.add_argument("--runs", type=int, default=5, metavar="N", help="runs (default 5)")
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="the topology, used as is (default: config/topology.yaml, on free ports "
        "if its own are taken)",
    )
    parser.add_argument(
        "--free-ports",
        action="store_true",
        help="run a copy of the topology on free ports",
    )
    parser.add_argument("--stream", default=DEFAULT_STREAM, help="stream (default orders.eu)")
    parser.add_argument(
        "--warmup-s", type=float, default=1.0, help="producing before the kill (default 1)"
    )
    parser.add_argument(
        "--after-s", type=float, default=2.0, help="producing after the kill (default 2)"
    )
    parser.add_argument(
        "--coordinating",
        action="store_true",
        help="one producer per relay, the victim included (it coordinates when killed)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.warmup_s <= 0 or args.after_s <= 0:
        parser.error("--warmup-s and --after-s must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = args.config if args.config is not None else DEFAULT_CONFIG
    try:
        config = load(source)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    members = list(config.members(args.stream))
    if len(members) < 3:
        print(
            f"error: stream {args.stream!r} has {len(members)} relays in {source}; "
            "a failover needs at least 3",
            file=sys.stderr,
        )
        return EXIT_USAGE
    log = (lambda *_: None) if args.json else (lambda text: print(text, flush=True))

    with tempfile.TemporaryDirectory(prefix="relay-failover-") as tmp:
        directory = Path(tmp)
        path = source
        busy = busy_ports(config)
        if args.free_ports or (busy and args.config is None):
            path = copy_on_free_ports(source, directory)
            why = "as asked" if args.free_ports else f"{busy[0]} is taken"
            log(f"topology: a copy of {source} on free ports ({why})")
        elif busy:
            print(f"error: ports of {source} are in use: {', '.join(busy)}", file=sys.stderr)
            return EXIT_MESH
        else:
            log(f"topology: {source}")
        mesh = Mesh(path, log_level="warning", log_dir=directory / "logs")
        runs: list[Run] = []
        try:
            try:
                mesh.start(timeout_s=START_TIMEOUT_S)
            except MeshError as e:
                print(f"error: the mesh did not start: {e}", file=sys.stderr)
                return EXIT_MESH
            log(
                f"mesh up: relays {list(mesh.relay_ids)}, stream {args.stream} on "
                f"{members}; suspect_timeout_ms {mesh.config.limits.suspect_timeout_ms}"
            )
            for i in range(args.runs):
                victim = members[i % len(members)]
                survivors = [m for m in members if m != victim]
                run = Run(i + 1, victim, survivors)
                pumps, times = measure(mesh, run, args.stream, args, members)
                if "kill" in times and "restart" in times:
                    analyse(run, pumps, times, args.warmup_s)
                    try:
                        read_back(mesh, run, args.stream, pumps)
                    except ClientError as e:
                        run.problems.append(f"read-back failed: {e}")
                runs.append(run)
                if not args.json:
                    outcome = (
                        f"stalled until the restart, resumed {cell(run.resume_ms, '{:.0f}')} "
                        "ms after it"
                        if run.stalled
                        else f"first commit after {cell(run.first_ms, '{:.0f}')} ms"
                    )
                    print(
                        f"run {run.run}: killed {victim}, {outcome}, max gap "
                        f"{cell(run.gap_ms, '{:.0f}')} ms",
                        flush=True,
                    )
                if run.rejoin_s is None:
                    break
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
        finally:
            mesh.stop()

    bad = [p for r in runs for p in r.problems]
    if args.json:
        doc = {
            "topology": str(source) if path == source else f"copy of {source} on free ports",
            "stream": args.stream,
            "suspect_timeout_ms": config.limits.suspect_timeout_ms,
            "coordinating": args.coordinating,
            "stalls": sum(r.stalled for r in runs),
            "runs": [asdict(r) for r in runs],
            "summary": summary(runs),
            "ok": not bad and len(runs) == args.runs,
        }
        print(json.dumps(doc, indent=2))
    else:
        print()
        print(table(runs))
        for key, stats in summary(runs).items():
            print(
                f"{key}: min {stats['min']:.1f}, median {stats['median']:.1f}, "
                f"max {stats['max']:.1f}"
            )
        stalls = sum(r.stalled for r in runs)
        if stalls:
            print(f"stalled until the restart in {stalls} of {len(runs)} runs")
        for problem in bad:
            print(f"problem: {problem}")
    return EXIT_OK if not bad and len(runs) == args.runs else EXIT_BAD


if __name__ == "__main__":
    sys.exit(main())
