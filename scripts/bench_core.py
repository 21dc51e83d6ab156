"""Micro-benchmark: CPU cost of the protocol core per committed transaction per relay.

Three `RelayCore`s of one stream ("bench") run in this process, wired by an in-memory
router that hands every outgoing frame at once to its destinations (FIFO, so every link
stays ordered): `stream` -> the stream's other members, `target` -> that relay, neither ->
every other relay. Time is simulated: integer milliseconds, +1 per round (and +1 more
whenever the mesh goes quiet before the round's transactions committed: a *stall*).

Each round produces B transactions (at relay 0, or round-robin over all three relays:
`spread`) and runs the exchange (receive every queued frame, then `ready()` on every core,
route, repeat) until all B got a COMMITTED reply and every relay delivered everything.
The time spent inside the cores -- `receive`, `produce`, `tick`, `ready`, codec included
-- is bracketed with `perf_counter_ns` (the bracketing's own cost, calibrated, is
subtracted) and divided by committed transactions x 3 relays. `harness` is the process CPU
time (`process_time_ns`) of the whole measured loop, router and bracketing included: an
upper bound.

The baseline is the irreducible work per transaction per relay of any implementation of
this protocol, batched at the same B and divided the same way: msgpack-encode the
transaction once, decode it twice, one xxh3-128 content hash (`digest.tx_hash`) and one
chain digest (`digest.chain`), and one report tuple (point, digest) encoded and decoded.

    .venv/bin/python scripts/bench_core.py                     # full run, table
    .venv/bin/python scripts/bench_core.py --json              # machine-readable
    .venv/bin/python scripts/bench_core.py --profile           # + top 20 (B=128) by cumtime
    .venv/bin/python scripts/bench_core.py --cold              # caches evicted between relays
    .venv/bin/python scripts/bench_core.py --quick             # a small run (tests)

`--cold` evicts the CPU caches (writes COLD_EVICT_MIB) before every core call that is not
the same relay's as the call before, outside the timed brackets. Live relays share two
cores with each other and their clients, so each turn starts with what the others' turns
left in the caches. Cold, the cores cost about twice what a warm loop measures (here, per
transaction per relay: 76 against 40 µs at B=1, 9.8 against 5.6 at B=16), nearer what perf
finds in live relays (about 118 µs for a member's core at one in flight). A change that
saves instructions but touches more memory can look better warm than it runs; `--cold`
shows it. The baseline stays warm (it is the irreducible work), so with `--cold` the ratio
includes what cold caches cost.

Performance is measured here, never asserted in a unit test.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import subprocess
import sys
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter_ns, process_time_ns
from typing import Any

try:  # run as a file without the package installed: import `relay` from this checkout
    import relay  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack

from relay import native
from relay.core import digest as dg
from relay.core.config import CoreConfig, Topology
from relay.core.machine import RelayCore
from relay.core.messages import Outcome, Transaction
from relay.core.seq import EPOCH_MS
from relay.core.shell import ProduceRequest

STREAM = "bench"
RELAYS = (0, 1, 2)
START_MS = EPOCH_MS + 86_400_000  # a day after the sequence epoch (Unix ms)
MAX_WARMUP_MS = 5_000
MAX_STALLS_PER_ROUND = 1_000
TARGET_TXS = 8_192  # auto rounds: about this many transactions per run
BASELINE_MIN_TXS = 65_536  # the baseline runs at least this many transactions per repeat
PROFILE_BATCH = 128
# What --cold writes between two relays' turns: beyond a core's L2 (1 MiB per core here),
# a tenth of the shared L3.
COLD_EVICT_MIB = 4
CACHE_LINE_BYTES = 64
MODES = ("relay0", "spread")


class BenchError(RuntimeError):
    """The core did not behave: a transaction did not commit, or an exception escaped."""


@dataclass
class RunResult:
    mode: str
    value_bytes: int
    batch: int
    rounds: int
    committed: int
    delivered: list[int]
    core_calls: int
    frames: int
    frame_bytes: int
    stalls: int
    evictions: int  # cache evictions of --cold (0 without)
    core_us: float  # per committed tx per relay, bracketing overhead subtracted
    harness_us: float  # process CPU of the whole loop per committed tx per relay
    baseline_us: float
    ratio: float  # core_us / baseline_us
    repeats: list[float] = field(default_factory=list)  # core_us of every repeat
    core_us_median: float = 0.0  # median over the repeats (core_us is the fastest)


# --- the mesh -----------------------------------------------------------------------------


class CacheEvictor:
    """Writes one byte of every cache line of `mib` MiB: what the other processes' turns
    do to the caches of a relay whose turn comes next."""

    def __init__(self, mib: int) -> None:
        self.buffer = bytearray(mib << 20)
        self.lines = bytes(len(self.buffer) // CACHE_LINE_BYTES)
        self.count = 0

    def evict(self) -> None:
        self.buffer[::CACHE_LINE_BYTES] = self.lines
        self.count += 1


class Mesh:
    """Three cores and an immediate, FIFO router. Every core call goes through `_call`, with
    the relay whose core it calls (`evictor`: caches evicted whenever that relay changes)."""

    def __init__(
        self,
        calibration_ns: int,
        profiler: cProfile.Profile | None = None,
        evictor: CacheEvictor | None = None,
    ) -> None:
        topology = Topology({r: (STREAM,) for r in RELAYS})
        self.now = START_MS
        self.cores = [RelayCore(CoreConfig(r, topology), 1, self.now) for r in RELAYS]
        self.members = topology.members(STREAM)
        self.queue: deque[tuple[int, bytes]] = deque()
        self.profiler = profiler
        self.calibration_ns = calibration_ns
        self.core_ns = 0
        self.core_calls = 0
        self.frames = 0
        self.frame_bytes = 0
        self.committed = 0
        self.bad_replies: list[str] = []
        self.delivered = [0] * len(RELAYS)
        self.evictor = evictor
        self.last_relay = -1

    def reset_counters(self) -> None:
        self.core_ns = self.core_calls = self.frames = self.frame_bytes = self.committed = 0
        if self.evictor is not None:
            self.evictor.count = 0

    def _call(self, relay: int, fn: Callable[..., Any], *args: Any) -> Any:
        if self.evictor is not None and relay != self.last_relay:
            self.evictor.evict()
        self.last_relay = relay
        prof = self.profiler
        if prof is not None:
            prof.enable()
        t0 = perf_counter_ns()
        try:
            out = fn(*args)
        except Exception as e:
            raise BenchError(f"{fn.__qualname__} raised {type(e).__name__}: {e}") from e
        finally:
            t1 = perf_counter_ns()
            if prof is not None:
                prof.disable()
        self.core_ns += t1 - t0
        self.core_calls += 1
        return out

    def tick_all(self) -> None:
        for relay, core in enumerate(self.cores):
            self._call(relay, core.tick, self.now)

    def produce(self, relay: int, request: ProduceRequest) -> None:
        self._call(relay, self.cores[relay].produce, request, self.now)

    def exchange(self) -> None:
        """Deliver until nothing is in flight: ready() on every core, route, receive."""
        queue = self.queue
        while True:
            for i, core in enumerate(self.cores):
                ready = self._call(i, core.ready)
                for out in ready.outgoing:
                    if out.stream is not None:
                        dests: Sequence[int] = [m for m in self.members if m != i]
                    elif out.target is not None:
                        dests = (out.target,)
                    else:
                        dests = [r for r in RELAYS if r != i]
                    for d in dests:
                        queue.append((d, out.frame))
                        self.frames += 1
                        self.frame_bytes += len(out.frame)
                for reply in ready.replies:
                    if reply.outcome is Outcome.COMMITTED:
                        self.committed += 1
                    else:
                        self.bad_replies.append(
                            f"relay {i}: request {reply.request_id} {reply.outcome.value}"
                            f" reason={reply.reason!r} redirect={reply.redirect}"
                        )
                for delivery in ready.deliveries:
                    self.delivered[i] += len(delivery.entries)
            if not queue:
                return
            now = self.now
            while queue:
                dest, frame = queue.popleft()
                self._call(dest, self.cores[dest].receive, frame, now)

    def warm_up(self) -> None:
        """Run until every core joined the stream and is not fenced."""
        for _ in range(MAX_WARMUP_MS):
            self.now += 1
            self.tick_all()
            self.exchange()
            if all(c.joined(STREAM) and not c.fenced(STREAM) for c in self.cores):
                return
        states = [(c.id, c.joined(STREAM), c.fenced(STREAM)) for c in self.cores]
        raise BenchError(f"not joined after {MAX_WARMUP_MS} ms: (relay, joined, fenced)={states}")


# --- workloads ----------------------------------------------------------------------------


class Producers:
    """Pre-built produce requests (the client's cost is not the core's)."""

    def __init__(self, value_bytes: int) -> None:
        self.value = bytes((i * 131 + 7) & 0xFF for i in range(value_bytes))
        self.pseq = [0] * len(RELAYS)
        self.request_id = 0

    def batch(self, mode: str, size: int) -> list[tuple[int, ProduceRequest]]:
        out = []
        for k in range(size):
            relay = 0 if mode == "relay0" else k % len(RELAYS)
            self.pseq[relay] += 1
            self.request_id += 1
            tx = Transaction(b"bench-%d" % relay, self.pseq[relay], None, self.value)
            out.append((relay, ProduceRequest(self.request_id, STREAM, tx)))
        return out


def run_rounds(mesh: Mesh, producers: Producers, mode: str, batch: int, rounds: int) -> int:
    """Run `rounds` rounds of `batch` produces; returns the stalls (extra ms needed)."""
    stalls = 0
    expected = sum(mesh.delivered) // len(RELAYS)
    for _ in range(rounds):
        requests = producers.batch(mode, batch)
        goal = mesh.committed + batch
        expected += batch
        mesh.now += 1
        mesh.tick_all()
        for relay, request in requests:
            mesh.produce(relay, request)
        round_stalls = 0
        while True:
            mesh.exchange()
            if mesh.bad_replies:
                raise BenchError("produce not committed: " + "; ".join(mesh.bad_replies[:5]))
            if mesh.committed >= goal and all(d >= expected for d in mesh.delivered):
                break
            round_stalls += 1
            if round_stalls > MAX_STALLS_PER_ROUND:
                raise BenchError(
                    f"round did not commit after {MAX_STALLS_PER_ROUND} extra ms: "
                    f"{mesh.committed - goal + batch}/{batch} committed, delivered "
                    f"{mesh.delivered} of {expected}; status: "
                    + json.dumps([c.status() for c in mesh.cores], default=str)
                )
            mesh.now += 1
            mesh.tick_all()
        stalls += round_stalls
    return stalls


def calibrate() -> int:
    """The bracketing's own cost inside the timed window (median of a no-op call)."""
    mesh = Mesh(0)
    samples = []
    for _ in range(20_001):
        before = mesh.core_ns
        mesh._call(0, _noop)
        samples.append(mesh.core_ns - before)
    samples.sort()
    return samples[len(samples) // 2]


def _noop() -> None:
    return None


def measure_core(
    mode: str,
    value_bytes: int,
    batch: int,
    rounds: int,
    calibration_ns: int,
    profiler: cProfile.Profile | None = None,
    cold: bool = False,
) -> dict[str, Any]:
    mesh = Mesh(calibration_ns, evictor=CacheEvictor(COLD_EVICT_MIB) if cold else None)
    mesh.warm_up()
    producers = Producers(value_bytes)
    run_rounds(mesh, producers, mode, batch, max(2, min(rounds, 16)))  # warm caches, pools
    mesh.reset_counters()
    mesh.profiler = profiler
    gc.collect()
    cpu0 = process_time_ns()
    stalls = run_rounds(mesh, producers, mode, batch, rounds)
    cpu = process_time_ns() - cpu0
    units = mesh.committed * len(RELAYS)
    core_ns = max(mesh.core_ns - mesh.core_calls * calibration_ns, 0)
    expected_delivered = producers.request_id
    if any(d != expected_delivered for d in mesh.delivered) or mesh.committed != batch * rounds:
        raise BenchError(
            f"committed {mesh.committed} of {batch * rounds}; delivered {mesh.delivered} of "
            f"{expected_delivered}"
        )
    return {
        "committed": mesh.committed,
        "delivered": list(mesh.delivered),
        "core_calls": mesh.core_calls,
        "frames": mesh.frames,
        "frame_bytes": mesh.frame_bytes,
        "stalls": stalls,
        "evictions": 0 if mesh.evictor is None else mesh.evictor.count,
        "core_us": core_ns / units / 1000,
        "harness_us": cpu / units / 1000,
    }


# --- the baseline -------------------------------------------------------------------------


def measure_baseline(value_bytes: int, batch: int, rounds: int, min_txs: int = 0) -> float:
    """µs per tx per relay of the irreducible work, batched at `batch` like the core."""
    producers = Producers(value_bytes)
    packer = msgpack.Packer(use_bin_type=True)
    unpackb = msgpack.unpackb
    tx_hash, chain = dg.tx_hash, dg.chain
    prev = [dg.genesis(STREAM)] * len(RELAYS)
    seq = 1 << 40

    def one_round(txs: list[Transaction], first_seq: int) -> int:
        ns = 0
        for r in RELAYS:
            t0 = perf_counter_ns()
            frame = packer.pack(
                [
                    (first_seq + k, t.producer_id, t.producer_seq, t.key, t.value)
                    for k, t in enumerate(txs)
                ]
            )
            unpackb(frame, raw=False)
            unpackb(frame, raw=False)
            d = prev[r]
            reports = []
            for k, t in enumerate(txs):
                d = chain(d, first_seq + k, tx_hash(t))
                reports.append((first_seq + k, d))
            prev[r] = d
            unpackb(packer.pack(reports), raw=False)
            ns += perf_counter_ns() - t0
        return ns

    for _ in range(max(2, min(rounds, 16))):  # warm-up
        txs = [req.tx for _, req in producers.batch("relay0", batch)]
        one_round(txs, seq)
        seq += batch
    rounds = max(rounds, -(-min_txs // batch))  # cheap: run long enough to be stable
    gc.collect()
    total = 0
    for _ in range(rounds):
        txs = [req.tx for _, req in producers.batch("relay0", batch)]
        total += one_round(txs, seq)
        seq += batch
    return total / (batch * rounds * len(RELAYS)) / 1000


# --- driver -------------------------------------------------------------------------------


def auto_rounds(batch: int, quick: bool) -> int:
    if quick:
        return 3
    return max(8, min(2_000, TARGET_TXS // batch))


PROFILE_CHILD = "--profile-child"  # profile_top run interpreted in a child process


def profile_top(
    mode: str, value_bytes: int, rounds: int, calibration_ns: int, top: int = 20
) -> tuple[str, list[dict[str, Any]]]:
    if native.active():
        # cProfile sees the Python functions only: the interpreted core is profiled, in a
        # child process that never loads the compiled modules.
        args = [mode, str(value_bytes), str(rounds), str(calibration_ns), str(top)]
        child = subprocess.run(
            [sys.executable, __file__, PROFILE_CHILD, *args],
            env=native.interpreted_env(),
            capture_output=True,
            text=True,
            check=True,
        )
        text, rows = json.loads(child.stdout)
        return text, rows
    profiler = cProfile.Profile()
    measure_core(mode, value_bytes, PROFILE_BATCH, rounds, calibration_ns, profiler)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats(pstats.SortKey.CUMULATIVE).print_stats(top)
    rows = []
    for func in stats.fcn_list[:top]:  # type: ignore[attr-defined]
        _cc, nc, tt, ct, _ = stats.stats[func]  # type: ignore[attr-defined]
        filename, line, name = func
        rows.append(
            {
                "function": f"{_short(filename)}:{line}({name})",
                "ncalls": nc,
                "tottime_s": round(tt, 6),
                "cumtime_s": round(ct, 6),
            }
        )
    return text.getvalue(), rows


def _short(filename: str) -> str:
    parts = Path(filename).parts
    if "relay" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("relay") :])
    return parts[-1] if parts else filename


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _mode_list(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {text!r}")
    return modes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="CPU cost of the protocol core per committed transaction per relay."
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"rounds per run (default: about {TARGET_TXS} txs per run; 3 if --quick)",
    )
    p.add_argument(
        "--batches",
        type=_int_list,
        default=None,
        help="batch sizes B (default 1,16,128,1024; 1,16,128 if --quick)",
    )
    p.add_argument(
        "--value-bytes",
        type=_int_list,
        default=None,
        help="value sizes, comma-separated (default 100,1024; 100 if --quick)",
    )
    p.add_argument(
        "--modes",
        type=_mode_list,
        default=list(MODES),
        help="relay0 (all produces at relay 0), spread (round-robin); default both",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="runs per case, the fastest is reported (default 5; 1 if --quick)",
    )
    p.add_argument("--quick", action="store_true", help="a small run (for tests)")
    p.add_argument(
        "--cold",
        action="store_true",
        help=f"evict the caches ({COLD_EVICT_MIB} MiB written) before each relay's turn",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help=f"also print the top 20 functions by cumulative time (B={PROFILE_BATCH})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds <= 0:
        p.error("--rounds must be positive")
    if args.repeat is not None and args.repeat <= 0:
        p.error("--repeat must be positive")
    if args.batches is None:
        args.batches = [1, 16, 128] if args.quick else [1, 16, 128, 1024]
    if args.value_bytes is None:
        args.value_bytes = [100] if args.quick else [100, 1024]
    if args.repeat is None:
        args.repeat = 1 if args.quick else 5
    if max(args.batches) > 4_096:
        p.error("batch sizes above 4096 exceed one millisecond's sequence counter")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    calibration_ns = calibrate()
    min_txs = 0 if args.quick else BASELINE_MIN_TXS
    results: list[RunResult] = []
    for value_bytes in args.value_bytes:
        for mode in args.modes:
            for batch in args.batches:
                rounds = args.rounds or auto_rounds(batch, args.quick)
                best: dict[str, Any] | None = None
                repeats = []
                for _ in range(args.repeat):
                    got = measure_core(
                        mode, value_bytes, batch, rounds, calibration_ns, cold=args.cold
                    )
                    repeats.append(got["core_us"])
                    if best is None or got["core_us"] < best["core_us"]:
                        best = got
                assert best is not None
                baseline = min(
                    measure_baseline(value_bytes, batch, rounds, min_txs)
                    for _ in range(args.repeat)
                )
                results.append(
                    RunResult(
                        mode=mode,
                        value_bytes=value_bytes,
                        batch=batch,
                        rounds=rounds,
                        baseline_us=baseline,
                        ratio=best["core_us"] / baseline if baseline > 0 else float("inf"),
                        repeats=repeats,
                        core_us_median=statistics.median(repeats),
                        **best,
                    )
                )
    report: dict[str, Any] = {
        "config": {
            "relays": len(RELAYS),
            "batches": args.batches,
            "value_bytes": args.value_bytes,
            "modes": args.modes,
            "rounds": args.rounds,
            "repeat": args.repeat,
            "quick": args.quick,
            "cold_evict_mib": COLD_EVICT_MIB if args.cold else 0,
            "calibration_ns_per_call": calibration_ns,
            "python": sys.version.split()[0],
            "core_module": sys.modules[RelayCore.__module__].__file__,
        },
        "unit": "microseconds per committed transaction per relay",
        "results": [asdict(r) for r in results],
    }
    if args.profile:
        mode = args.modes[0]
        rounds = args.rounds or auto_rounds(PROFILE_BATCH, args.quick)
        text, rows = profile_top(mode, args.value_bytes[0], rounds, calibration_ns)
        report["profile"] = {
            "mode": mode,
            "batch": PROFILE_BATCH,
            "value_bytes": args.value_bytes[0],
            "rounds": rounds,
            "top": rows,
            "text": text,
        }
    return report


def format_table(report: dict[str, Any]) -> str:
    cfg = report["config"]
    head = (
        f"{'mode':<7} {'value':>6} {'B':>5} {'rounds':>6} {'committed':>9} {'core µs':>8} "
        f"{'median':>7} {'harness':>8} {'baseline':>8} {'ratio':>6} {'frames/tx':>9} "
        f"{'stalls':>6}"
    )
    lines = [
        "protocol core cost, µs per committed transaction per relay (3 relays, 1 stream)",
        f"core: fastest of {cfg['repeat']} runs, bracketing overhead subtracted "
        f"({cfg['calibration_ns_per_call']} ns per core call); median: of those runs",
        "harness: process CPU of the fastest run's whole loop, router included; "
        "ratio: core / baseline",
        *(
            [
                f"cold: {cfg['cold_evict_mib']} MiB written before each relay's turn (not "
                "timed); the baseline runs warm"
            ]
            if cfg["cold_evict_mib"]
            else []
        ),
        "",
        head,
        "-" * len(head),
    ]
    for r in report["results"]:
        lines.append(
            f"{r['mode']:<7} {r['value_bytes']:>6} {r['batch']:>5} {r['rounds']:>6} "
            f"{r['committed']:>9} {r['core_us']:>8.2f} {r['core_us_median']:>7.2f} "
            f"{r['harness_us']:>8.2f} {r['baseline_us']:>8.2f} {r['ratio']:>6.1f} "
            f"{r['frames'] / max(r['committed'], 1):>9.3f} {r['stalls']:>6}"
        )
    prof = report.get("profile")
    if prof:
        lines += [
            "",
            f"profile: mode={prof['mode']} B={prof['batch']} value={prof['value_bytes']} "
            f"rounds={prof['rounds']} (core calls only)",
            prof["text"].rstrip(),
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [PROFILE_CHILD]:  # profile_top's child: [mode, value, rounds, ns, top]
        mode, value_bytes, rounds, calibration_ns, top = argv[1:]
        found = profile_top(mode, int(value_bytes), int(rounds), int(calibration_ns), int(top))
        print(json.dumps(found))
        return 0
    args = parse_args(argv)
    try:
        report = run(args)
    except BenchError as e:
        if e.__cause__ is not None:  # an exception escaped the core: show where
            traceback.print_exception(e.__cause__, file=sys.stderr)
        print(f"bench_core: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
