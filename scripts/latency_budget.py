"""The latency budget of one transaction in flight on this machine: the relay's commit path
modelled on ZeroMQ (relays in plain pyzmq, or in C), with a chosen amount of work per frame.

Four processes shaped like `relay bench`'s one-in-flight run: a client DEALER sends a
100-byte request to the coordinator's ROUTER; the coordinator publishes it (PUB) to two
members; each member publishes a report (PUB) that the coordinator and the other member
both take, as the relays' `Reports` are; the coordinator answers the client on the first
report for the request. That is the protocol's four one-way delays (docs/protocol.md,
section 7) and its frames (a member takes the other member's report too). Every relay
process spins for W microseconds on each frame it takes: W stands for the protocol's work
per frame, W = 0 is the floor of any relay built on pyzmq here.

    .venv/bin/python scripts/latency_budget.py [--work-us 0,20,40,60,80] [--duration-s 4]
        [--free-peer-reports] [--native] [--relay] [--peers nats] [--json] [--quick]

For each W it prints the round trip's p50/p90 at the client and the CPU per transaction of
each process (utime + stime: libzmq's I/O thread included), to set beside `relay bench
--peers nats` (NATS JetStream's one-in-flight p50 and CPU) and `relay bench --hops` (the
relays' own work per frame). `--free-peer-reports`: members take each other's reports
without the work, to price that traffic. `--native`: each W also with the three relay
processes written in C (scripts/latency_budget_relay.c, built here with gcc against the
libzmq pyzmq loads), the client unchanged, the two runs back to back: what pyzmq and the
interpreter cost per frame, and where a relay in native code would start.

`--relay` and `--peers nats` measure, in the same run and before the sweep, this project's
3-relay mesh (a `Producer`, one transaction in flight, no consumer) and a 3-server NATS
JetStream cluster (R3 memory stream, nats-py; `bash scripts/peer-deps.sh` installs them)
the same way, and place each on the sweep: the work per frame at which the model's p50
equals theirs (linear between the two rows around it). NATS's is the budget a relay on
pyzmq (or, with --native, in C) has for its own work per frame to match NATS's latency;
the mesh's is the work per frame it runs like. Performance is measured here, never
asserted in a test.

Exit codes: 0; 2 usage error; 3 a process of the model failed (or, with --native, the C
relay could not be built; with --relay or --peers, the mesh or NATS did not start).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

try:  # run as a file without the package installed: import `relay` from this checkout
    import relay  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zmq

from relay.client import Producer
from relay.errors import ClientError
from relay.launcher import Mesh, MeshError, free_ports, write_loopback_topology

DEFAULT_WORK_US = (0, 20, 40, 60, 80)
DEFAULT_DURATION_S = 4.0
QUICK_DURATION_S = 0.3
VALUE_BYTES = 100
WARMUP_TX = 300  # unmeasured round trips before each measured run
QUICK_WARMUP_TX = 20
MEMBERS = (1, 2)  # relay 0 coordinates
READY_TIMEOUT_S = 30.0  # every process bound, connected and subscribed
ANSWER_TIMEOUT_MS = 10_000  # one round trip; longer means a process of the model died
NATIVE_SOURCE = Path(__file__).resolve().with_name("latency_budget_relay.c")
PYTHON, NATIVE = "python", "c"  # what the model's relay processes are written in
CONNECT_SETTLE_S = 0.3  # PUB/SUB subscriptions propagate after connect (no handshake to wait on)
MESH_STREAM = "budget"  # the stream of --relay's mesh
COMPARED_START_TIMEOUT_S = 60.0  # the mesh's start, and NATS's warm-up, take at most this
MESH, NATS = "relay", "nats"  # what --relay and --peers nats measure
BATCH, REPORT = b"B", b"R"
SEQ_BYTES = 8


class ModelFailed(Exception):
    """A process of the model died or stopped answering."""


class NativeBuildFailed(ModelFailed):
    """The C relay of the model could not be built (no compiler, a compile or link error)."""


class ComparisonFailed(ModelFailed):
    """The mesh of --relay or the NATS cluster of --peers did not start or did not answer."""


def _spin(seconds: float) -> None:
    """Busy work standing for the protocol's per-frame work (a sleep would free the core)."""
    if seconds > 0:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


def _relay(relay_id: int, ports: dict[str, int], work_s: float, free_peer_reports: bool) -> None:
    """One relay of the model (a child process: `--serve-relay`), until it is terminated;
    says "ready" on stdout once bound, connected and subscribed."""
    with contextlib.suppress(Exception):  # follow the parent out if it dies (Linux)
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{ports[f'pub{relay_id}']}")
    poller = zmq.Poller()
    for peer in (0, *MEMBERS):
        if peer != relay_id:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{ports[f'pub{peer}']}")
            poller.register(sub, zmq.POLLIN)
    router = None
    if relay_id == 0:
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"tcp://127.0.0.1:{ports['client']}")
        poller.register(router, zmq.POLLIN)
    time.sleep(CONNECT_SETTLE_S)
    print("ready", flush=True)
    waiting: dict[bytes, bytes] = {}  # seq -> the client's identity (coordinator)
    seq = 0
    while True:
        for sock, _ in poller.poll():
            if sock is router:
                _spin(work_s)
                identity, body = router.recv_multipart()
                seq += 1
                key = seq.to_bytes(SEQ_BYTES, "big")
                waiting[key] = identity
                pub.send(BATCH + key + body)
                continue
            frame = sock.recv()
            kind, key = frame[:1], frame[1 : 1 + SEQ_BYTES]
            if relay_id == 0 or kind == BATCH or not free_peer_reports:
                _spin(work_s)
            if kind == BATCH and relay_id != 0:
                pub.send(REPORT + key)
            elif kind == REPORT and router is not None and key in waiting:
                router.send_multipart([waiting.pop(key), b"ok"])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(ordered: Sequence[float], p: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def _libzmq() -> list[str]:
    """How to link the libzmq that pyzmq loads (its wheel bundles one), else the
    system's (`-lzmq`: the linker says if there is none)."""
    wheel_libs = Path(zmq.__file__).resolve().parent.parent / "pyzmq.libs"
    bundled = sorted(wheel_libs.glob("libzmq*.so*"))
    if not bundled:
        return ["-lzmq"]
    return [str(bundled[0]), f"-Wl,-rpath,{wheel_libs}"]


def build_native(directory: Path) -> Path:
    """Compile the C relay of the model into `directory`; its path. The socket types and
    options come from pyzmq, so the C file needs no zmq.h."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise NativeBuildFailed("no C compiler (gcc or cc) on PATH")
    binary = directory / "latency_budget_relay"
    names = ("PUB", "SUB", "ROUTER", "SUBSCRIBE", "POLLIN", "DONTWAIT", "SNDMORE")
    command = [compiler, "-O2", "-o", str(binary), str(NATIVE_SOURCE)]
    command += [f"-DZMQ_{name}={int(getattr(zmq, name))}" for name in names]
    command += _libzmq()
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode != 0:
        raise NativeBuildFailed(f"{' '.join(command)} failed: {built.stderr.strip()}")
    return binary


def _relay_command(
    relay_id: int,
    ports: dict[str, int],
    work_us: float,
    free_peer_reports: bool,
    native: Path | None,
) -> list[str]:
    if native is not None:
        pubs = [str(ports[f"pub{r}"]) for r in (0, *MEMBERS)]
        free = str(int(free_peer_reports))
        return [str(native), str(relay_id), str(ports["client"]), *pubs, str(work_us), free]
    command = [sys.executable, __file__, "--serve-relay", str(relay_id)]
    command += ["--ports", json.dumps(ports), "--work-us", str(work_us)]
    return command + (["--free-peer-reports"] if free_peer_reports else [])


def measure(
    work_us: float,
    duration_s: float,
    free_peer_reports: bool,
    warmup_tx: int,
    native: Path | None = None,
) -> dict[str, Any]:
    """Start the model with `work_us` per frame (its relays the C binary `native`, else
    pyzmq), run one transaction in flight for `duration_s`, stop it; the figures."""
    names = ["client", *(f"pub{r}" for r in (0, *MEMBERS))]
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    children: dict[int, subprocess.Popen[str]] = {}
    try:
        for relay_id in (0, *MEMBERS):
            command = _relay_command(relay_id, ports, work_us, free_peer_reports, native)
            children[relay_id] = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for relay_id, proc in children.items():
            assert proc.stdout is not None
            wait_s = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([proc.stdout], [], [], wait_s)
            if not readable or proc.stdout.readline() != "ready\n":  # (EOF if it died)
                raise ModelFailed(f"relay {relay_id} of the model did not start")
        return _run_client(ports, children, duration_s, warmup_tx) | {
            "work_us": work_us,
            "relays": PYTHON if native is None else NATIVE,
            "free_peer_reports": free_peer_reports,
        }
    finally:
        for proc in children.values():
            proc.terminate()
        for proc in children.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _run_client(
    ports: dict[str, int],
    children: dict[int, subprocess.Popen[str]],
    duration_s: float,
    warmup_tx: int,
) -> dict[str, Any]:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{ports['client']}")
    body = os.urandom(VALUE_BYTES)

    def round_trip() -> None:
        dealer.send(body)
        if not dealer.poll(ANSWER_TIMEOUT_MS):
            dead = [r for r, proc in children.items() if proc.poll() is not None]
            raise ModelFailed(f"no answer in {ANSWER_TIMEOUT_MS} ms (dead relays: {dead})")
        dealer.recv()

    try:
        pids = {relay_id: proc.pid for relay_id, proc in children.items()}
        return _one_in_flight(round_trip, pids, duration_s, warmup_tx)
    finally:
        ctx.destroy(linger=0)


def _one_in_flight(
    round_trip: Callable[[], object], pids: dict[int, int], duration_s: float, warmup_tx: int
) -> dict[str, Any]:
    """`round_trip` `warmup_tx` times, then for `duration_s`, timed: the figures, with the
    CPU of this process (the client) and of the relays `pids` (relay id -> pid)."""
    for _ in range(warmup_tx):
        round_trip()
    cpu_before = {relay_id: _cpu_s(pid) for relay_id, pid in pids.items()}
    client_before = os.times()
    samples: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < duration_s:
        sent = time.perf_counter()
        round_trip()
        samples.append(time.perf_counter() - sent)
    client_after = os.times()
    cpu = {f"relay{r}": _cpu_s(pid) - cpu_before[r] for r, pid in pids.items()}
    return _figures(samples, _cpu_used(client_before, client_after) | cpu)


def _cpu_used(before: os.times_result, after: os.times_result) -> dict[str, float]:
    """This process's CPU seconds between two `os.times()`, as the client's."""
    return {"client": (after.user + after.system) - (before.user + before.system)}


def _figures(samples_s: Sequence[float], cpu_s: dict[str, float]) -> dict[str, Any]:
    """Round trips (seconds) and CPU seconds by process -> the row's figures."""
    n = len(samples_s)
    if n == 0:
        raise ModelFailed("no transaction completed")
    ordered = sorted(samples_s)
    per_tx = {name: used / n * 1e6 for name, used in cpu_s.items()}
    return {
        "transactions": n,
        "p50_us": _percentile(ordered, 0.5) * 1e6,
        "p90_us": _percentile(ordered, 0.9) * 1e6,
        "mean_us": statistics.fmean(samples_s) * 1e6,
        "cpu_us_per_tx": per_tx,
        "cpu_us_per_tx_all": sum(per_tx.values()),
    }


def measure_mesh(duration_s: float, warmup_tx: int) -> dict[str, Any]:
    """This project's 3-relay mesh on 127.0.0.1 (always stopped), a `Producer` with one
    transaction in flight for `duration_s`, no consumer: the figures."""
    directory = Path(tempfile.mkdtemp(prefix="latency-budget-mesh-"))
    try:
        subscriptions = {relay_id: [MESH_STREAM] for relay_id in (0, *MEMBERS)}
        topology = write_loopback_topology(directory, subscriptions, [MESH_STREAM])
        mesh = Mesh(topology, log_level="warning", log_dir=directory / "logs")
        with mesh.start(COMPARED_START_TIMEOUT_S):
            relays = {r: ends.client for r, ends in mesh.endpoints.items()}
            with Producer(relays=relays, window=1) as producer:
                body = os.urandom(VALUE_BYTES)
                figures = _one_in_flight(
                    lambda: producer.send(MESH_STREAM, body), mesh.pids, duration_s, warmup_tx
                )
    except (MeshError, ClientError) as e:
        raise ComparisonFailed(f"the mesh: {e}") from e
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return figures | {"relays": MESH}


def measure_nats(duration_s: float, warmup_tx: int) -> dict[str, Any]:
    """A 3-server NATS JetStream cluster (R3 memory stream; always stopped), nats-py
    publishing one message at a time for `duration_s`: the figures."""
    from relay.tools import nats_peer  # nats-py is an extra: imported only when asked for

    directory = Path(tempfile.mkdtemp(prefix="latency-budget-nats-"))
    body = os.urandom(VALUE_BYTES)
    cluster: nats_peer.NatsCluster | None = None
    try:
        cluster = nats_peer.NatsCluster()
        cluster.start(directory)
        nats_peer.one_in_flight(cluster.urls, body, COMPARED_START_TIMEOUT_S, warmup_tx)
        pids = cluster.pids
        cpu_before = {i: _cpu_s(pid) for i, pid in pids.items()}
        client_before = os.times()
        got = nats_peer.one_in_flight(cluster.urls, body, duration_s, sys.maxsize)
        client_after = os.times()
        cpu = {f"server{i}": _cpu_s(pid) - cpu_before[i] for i, pid in pids.items()}
    except nats_peer.NatsUnavailable as e:
        raise ComparisonFailed(f"NATS: {e}") from e
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)
    if got["failed"]:
        raise ComparisonFailed(f"NATS: {got['failed']} publishes failed")
    used = _cpu_used(client_before, client_after) | cpu
    return _figures(got["samples_s"], used) | {"relays": NATS}


def work_at(runs: Sequence[dict[str, Any]], relays: str, p50_us: float) -> float | None:
    """The work per frame at which the model with `relays` (python or c) has `p50_us`:
    linear between the first two consecutive rows (by work) whose p50s bracket it; None
    when the sweep does not reach it (below its first row's p50 or above its last's)."""
    curve: list[tuple[float, float]] = sorted(
        (run["work_us"], run["p50_us"]) for run in runs if run["relays"] == relays
    )
    for (w0, p0), (w1, p1) in itertools.pairwise(curve):
        if min(p0, p1) <= p50_us <= max(p0, p1):
            return w0 if p1 == p0 else w0 + (w1 - w0) * (p50_us - p0) / (p1 - p0)
    return None


def _work_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"want non-negative microseconds: {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="The commit path's four one-way delays in plain pyzmq, with W us of "
        "work per frame: one transaction in flight, latency and CPU per transaction."
    )
    p.add_argument(
        "--work-us",
        type=_work_list,
        default=list(DEFAULT_WORK_US),
        help="work per frame in each relay, comma-separated microseconds "
        f"(default {','.join(map(str, DEFAULT_WORK_US))}; 0,40 with --quick)",
    )
    p.add_argument("--duration-s", type=float, default=None, help="per W (default 4)")
    p.add_argument(
        "--free-peer-reports",
        action="store_true",
        help="members take each other's reports without the work",
    )
    p.add_argument(
        "--native",
        action="store_true",
        help="each W also with the relays in C (built with gcc), side by side",
    )
    p.add_argument(
        "--relay",
        action="store_true",
        help="also this project's 3-relay mesh, one in flight, placed on the sweep",
    )
    p.add_argument(
        "--peers",
        choices=[NATS],
        default=None,
        help="also a 3-server NATS JetStream cluster (nats-py), one in flight, placed on "
        "the sweep (bash scripts/peer-deps.sh installs it)",
    )
    p.add_argument("--quick", action="store_true", help="short runs (a smoke test)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--serve-relay", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ports", type=json.loads, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.duration_s is not None and args.duration_s <= 0:
        p.error("--duration-s must be positive")
    if args.quick and args.work_us == list(DEFAULT_WORK_US):
        args.work_us = [0.0, 40.0]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_relay is not None:  # a child of `measure`
        _relay(args.serve_relay, args.ports, args.work_us[0] / 1e6, args.free_peer_reports)
        return 0
    duration_s = args.duration_s or (QUICK_DURATION_S if args.quick else DEFAULT_DURATION_S)
    warmup = QUICK_WARMUP_TX if args.quick else WARMUP_TX
    runs = []
    compared = []  # the mesh and NATS, measured first (side by side with the sweep)
    build_dir = Path(tempfile.mkdtemp(prefix="latency-budget-"))
    try:
        native = build_native(build_dir) if args.native else None
        if args.peers == NATS:
            compared.append(measure_nats(duration_s, warmup))
        if args.relay:
            compared.append(measure_mesh(duration_s, warmup))
        for work_us in args.work_us:
            runs.append(measure(work_us, duration_s, args.free_peer_reports, warmup))
            if native is not None:
                runs.append(measure(work_us, duration_s, args.free_peer_reports, warmup, native))
    except ModelFailed as e:
        print(f"latency_budget: {e}", file=sys.stderr)
        return 3
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    kinds = [PYTHON] + ([NATIVE] if args.native else [])
    for row in compared:
        row["work_us_like"] = {kind: work_at(runs, kind, row["p50_us"]) for kind in kinds}
    if args.json:
        print(json.dumps({"duration_s": duration_s, "runs": runs, "compared": compared}, indent=2))
        return 0
    print(
        "one transaction in flight through the commit path on ZeroMQ (4 one-way delays), "
        f"{VALUE_BYTES} B, {duration_s:g} s per row"
        + (", members take each other's reports for free" if args.free_peer_reports else "")
    )
    print(
        f"{'work/frame us':>13} {'relays':>6} {'p50 us':>7} {'p90 us':>7}  "
        "CPU us per tx: client, relays, all"
    )
    for run in runs:
        print(f"{run['work_us']:>13g} {run['relays']:>6} {_row_figures(run)}")
    for row in compared:
        print(f"{'-':>13} {row['relays']:>6} {_row_figures(row)}")
    for row in compared:
        like = ", ".join(
            f"{kind} {_fmt_work(row['work_us_like'][kind], runs, kind)}" for kind in kinds
        )
        what = (
            "NATS JetStream's p50: the model matches it at work/frame us"
            if row["relays"] == NATS
            else "this project's mesh runs like the model at work/frame us"
        )
        print(f"{what}: {like}")
    return 0


def _row_figures(run: dict[str, Any]) -> str:
    cpu = run["cpu_us_per_tx"]
    servers = " / ".join(f"{used:.0f}" for name, used in cpu.items() if name != "client")
    return (
        f"{run['p50_us']:>7.0f} {run['p90_us']:>7.0f}  "
        f"{cpu['client']:.0f}, {servers}, {run['cpu_us_per_tx_all']:.0f}"
    )


def _fmt_work(work_us: float | None, runs: Sequence[dict[str, Any]], relays: str) -> str:
    """A place on the sweep, or that the p50 fell outside it."""
    if work_us is not None:
        return f"{work_us:.0f}"
    works = [run["work_us"] for run in runs if run["relays"] == relays]
    return f"outside the sweep ({min(works):g}-{max(works):g})"


if __name__ == "__main__":
    sys.exit(main())
