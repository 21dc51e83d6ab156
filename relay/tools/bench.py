"""`relay bench`: a real 3-relay mesh on loopback, side by side with raw ZeroMQ PUB/SUB.

One run starts the mesh (a temporary topology on free 127.0.0.1 ports, relays as child
processes through `relay.launcher.Mesh`, always stopped) and measures, for each value size:

* throughput: committed transactions per second of a pipelined `Producer` (window 128 and
  1000) sending to relay 0 for `duration_s`, in a process of its own (relay/tools/
  isolated.py says why); the clock stops when the last transaction is settled;
* latency at one transaction in flight (`Producer.send` in a loop) and at a fixed rate
  (1,000 tx/s, open loop: `AsyncProducer.send_async` at scheduled times, on uvloop where
  installed, relay/loop.py): produce-to-commit (the producer's answer) and
  produce-to-delivery (a consumer of relay 1 yields the record: a `Consumer` in a thread
  of this process at one in flight, an `AsyncConsumer` in the producer's event loop at a
  rate). Every timestamp is `time.perf_counter()` in this process.

The baseline sends the same payloads through one PUB and two SUBs (one thread, one poller,
tcp on 127.0.0.1), measured the same way: fan-out msgs/s with the same windows (at most W
messages published and not yet received by both subscribers) and one-way latency (publish
to receipt, both subscribers' receipts counted) at one message in flight and at the same
rate. Ratios are relay / baseline.

The targets (>= 50,000 committed tx/s at 100 B pipelined; p50 <= 1 ms at one in flight;
p99 <= 5 ms at 1,000 tx/s) are reported, never asserted. `--profile` runs relay 0 (the
coordinator of every produce) under cProfile and profiles this process's producer during
the 100 B throughput run, so the report can say where the time goes (wall time: on a
machine other processes keep busy, the functions that wake another thread or process, such
as zmq sends, absorb their turns on the CPUs); CPU seconds of every relay and of the client
are recorded for each throughput run in any case (Linux /proc).

`--security` measures the cost of CurveZMQ instead (docs/security.md): two meshes run at
once, one plain and one with CurveZMQ on every socket (its producer and consumer are the
`admin` client); every run above is made on both, one right after the other, and the
report shows them side by side with curve/plain ratios (no PUB/SUB baseline).
`--metrics` does the same for the relays' HTTP endpoints (relay/opsserver.py): one mesh
without them, one with them and every relay's /metrics scraped every METRICS_SCRAPE_S.
Both compare throughput, the relays' CPU per committed transaction and commit latency;
`--rounds N` makes every pair N times, each side first in every other round, and reports
the ratio of each round and their median (a single round is at the mercy of the order);
so does `--peers nats --rounds N` for the relay and NATS JetStream.

    relay bench [--duration-s S] [--sizes 100,1024] [--quick] [--json] [--profile]
    relay bench --security [--rounds N] [--duration-s S] [--sizes 100] [--quick] [--json]
    relay bench --metrics [--rounds N] [--duration-s S] [--sizes 100] [--quick] [--json]
    relay bench --peers nats [--rounds N] [--duration-s S] [--sizes 100] [--quick] [--json]
    relay bench --hops [--duration-s S] [--sizes 100] [--json]   (relay/tools/hops.py)
    relay bench --memory [--duration-s S] [--rate TX_S] [--buffer-mib MIB]  (tools/membench.py)
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import functools
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import zmq

from relay import loop, native
from relay.client import MAX_WINDOW, AsyncConsumer, AsyncProducer, Consumer, Producer
from relay.errors import ClientError, ConfigError
from relay.launcher import Mesh, MeshError, write_loopback_topology
from relay.security import ClientCurve
from relay.tools.isolated import run_isolated

__all__ = [
    "DEFAULT_DURATION_S",
    "DEFAULT_SIZES",
    "DEFAULT_WINDOWS",
    "BenchOptions",
    "parse_sizes",
    "run",
    "run_cli",
]

DEFAULT_DURATION_S = 5.0  # per measured run
QUICK_DURATION_S = 0.25
DEFAULT_MEMORY_DURATION_S = 600.0  # `--memory`: ten minutes at a fixed rate
QUICK_MEMORY_DURATION_S = 15.0
DEFAULT_SIZES = (100, 1024)
DEFAULT_WINDOWS = (128, 1_000)
DEFAULT_RATE_TX_S = 1_000
STREAM = "bench"
MIN_VALUE_BYTES = 8  # the header: run id (2 bytes) and index (6 bytes)
MAX_VALUE_BYTES = 512 * 1024
WARMUP_TX = 200  # unmeasured transactions before each relay run
WARMUP_S = 0.2  # and unmeasured baseline traffic
ONE_IN_FLIGHT_MAX = 20_000  # bounds the samples kept per run
QUICK_ONE_IN_FLIGHT_MAX = 200
CONSUMER_START_S = 10.0  # a latency run's consumer must have its position by then
DELIVERY_WAIT_S = 5.0  # after a latency run: how long to wait for the last deliveries
START_TIMEOUT_S = 30.0
BASELINE_STALL_S = 2.0  # no progress this long: the baseline run ends (messages lost)
PROFILE_TOP = 25

TARGET_TX_S = 50_000.0
TARGET_P50_ONE_MS = 1.0
TARGET_P99_RATE_MS = 5.0

_HEADER = struct.Struct(">HIH")  # run id, index (low 32 bits), index (high 16 bits)


@dataclass(frozen=True)
class BenchOptions:
    duration_s: float = DEFAULT_DURATION_S
    sizes: tuple[int, ...] = DEFAULT_SIZES
    windows: tuple[int, ...] = DEFAULT_WINDOWS
    rate_tx_s: int = DEFAULT_RATE_TX_S
    quick: bool = False
    profile: bool = False
    rounds: int = 1  # --security, --metrics, --peers: rounds of every run on both sides


def parse_sizes(text: str) -> tuple[int, ...]:
    """Parse a list of sizes: "100,1k" -> (100, 1024). Raises ValueError naming a bad item."""
    sizes: list[int] = []
    for raw in text.split(","):
        item = raw.strip().lower()
        scale = 1
        if item.endswith("k"):
            item, scale = item[:-1], 1024
        try:
            size = int(item) * scale
        except ValueError:
            raise ValueError(f"{raw.strip()!r} is not a size in bytes") from None
        if not MIN_VALUE_BYTES <= size <= MAX_VALUE_BYTES:
            raise ValueError(f"size {size} is outside {MIN_VALUE_BYTES}..{MAX_VALUE_BYTES} bytes")
        if size not in sizes:
            sizes.append(size)
    if not sizes:
        raise ValueError("no size given")
    return tuple(sizes)


# --- payloads and statistics ------------------------------------------------------------


def _payload(run_id: int, index: int, size: int, pad: bytes) -> bytes:
    return _HEADER.pack(run_id, index & 0xFFFFFFFF, index >> 32) + pad[: size - _HEADER.size]


def _unpack(value: bytes) -> tuple[int, int]:
    if len(value) < _HEADER.size:
        return -1, -1
    run_id, low, high = _HEADER.unpack_from(value)
    return run_id, (high << 32) | low


def _percentile(ordered: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of sorted samples."""
    if not ordered:
        return float("nan")
    rank = max(1, min(len(ordered), int(-(-p * len(ordered) // 100))))
    return ordered[rank - 1]


def _summary_ms(samples_s: Sequence[float]) -> dict[str, float | int | None]:
    if not samples_s:
        return {"count": 0, "p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    ordered = sorted(s * 1000.0 for s in samples_s)
    return {
        "count": len(ordered),
        "p50": round(_percentile(ordered, 50), 4),
        "p90": round(_percentile(ordered, 90), 4),
        "p99": round(_percentile(ordered, 99), 4),
        "mean": round(sum(ordered) / len(ordered), 4),
        "max": round(ordered[-1], 4),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 4)


# --- CPU accounting ---------------------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), None where unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


class _CpuMeter:
    """CPU seconds used by each server process (`<label><id>_s`: the relays, or a peer
    system's servers) and by this process between two points."""

    def __init__(self, pids: dict[int, int], label: str = "relay") -> None:
        self.pids = pids
        self.label = label
        self._start = {r: _cpu_s(p) for r, p in pids.items()}
        self._self = time.process_time()

    def read(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for relay_id, pid in self.pids.items():
            before, after = self._start[relay_id], _cpu_s(pid)
            out[f"{self.label}{relay_id}_s"] = (
                None if before is None or after is None else round(after - before, 3)
            )
        out["client_s"] = round(time.process_time() - self._self, 3)
        return out


# --- the mesh -----------------------------------------------------------------------------


def _write_topology(directory: Path, curve: bool = False, http: bool = False) -> Path:
    subscriptions = {i: [STREAM] for i in range(3)}
    access: dict[str, dict[str, Any]] | None = {} if curve else None
    return write_loopback_topology(directory, subscriptions, [STREAM], access=access, http=http)


class _ProfiledMesh(Mesh):
    """The mesh with one relay run under cProfile (its stats are written when it stops:
    the relay exits through SystemExit on SIGTERM, which cProfile catches)."""

    def __init__(self, *args: Any, profiled: int, stats_path: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.profiled = profiled
        self.stats_path = stats_path

    def _command(self, relay_id: int) -> list[str]:
        # The launcher has no hook to wrap a relay's command; its command is
        # [python, "-m", "relay", "run", ...].
        command = super()._command(relay_id)
        if relay_id != self.profiled:
            return command
        # Interpreted (relay/native.py): cProfile sees the Python functions only.
        python, rest = command[0], command[1:]
        profiled = [python, "-m", "cProfile", "-o", str(self.stats_path), *rest]
        return ["env", f"{native.DISABLE_ENV}=0", *profiled]


# --- relay runs -----------------------------------------------------------------------------


class _Deliveries(threading.Thread):
    """A Consumer of relay 1 (a thread of this process, so that it shares the clock) that
    reads from "latest" and stamps the arrival of every record of one run (value header:
    run id, index). One per latency run: it runs only while that run does."""

    def __init__(self, relays: dict[int, str], run_id: int, curve: ClientCurve | None) -> None:
        super().__init__(name="bench-consumer", daemon=True)
        self.relays = relays
        self.curve = curve
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.run_id = run_id
        self.arrivals: dict[int, float] = {}
        self.error: BaseException | None = None
        self.records = 0

    def run(self) -> None:
        try:
            with Consumer(
                relays=self.relays, timeout_s=0.05, wait_ms=1_000, curve=self.curve
            ) as consumer:
                consumer.subscribe(STREAM, "latest")
                while not self.stopping.is_set():
                    record = next(consumer, None)
                    if record is None:
                        if consumer.position is not None:
                            self.ready.set()
                        continue
                    now = time.perf_counter()
                    self.records += 1
                    run_id, index = _unpack(record.value)
                    if run_id == self.run_id:
                        self.arrivals.setdefault(index, now)
        except BaseException as e:  # reported by the run that waits for deliveries
            self.error = e
            self.ready.set()


class _LoopDeliveries:
    """The consumer of an at-rate run as a task of the producer's event loop, as the NATS
    side's subscriber is: a consumer thread would share the interpreter with the asyncio
    producer and hold it up (the GIL). Reads relay 1 from "latest" and stamps the
    arrival of every record of run `run_id` (`async with`; then `wait_for`)."""

    def __init__(self, relays: dict[int, str], run_id: int, curve: ClientCurve | None) -> None:
        self.run_id = run_id
        self.arrivals: dict[int, float] = {}
        self.error: BaseException | None = None
        self._consumer = AsyncConsumer(relays=relays, timeout_s=0.05, wait_ms=1_000, curve=curve)
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _LoopDeliveries:
        self._consumer.subscribe(STREAM, "latest")
        self._task = asyncio.ensure_future(self._run())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), CONSUMER_START_S)
        if not self._ready.is_set() or self.error is not None:
            await self.__aexit__()
            raise RuntimeError(f"the consumer of relay 1 did not start: {self.error!r}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._consumer.close()

    async def _run(self) -> None:
        consumer = self._consumer
        try:
            while True:
                try:
                    record = await consumer.__anext__()
                except StopAsyncIteration:  # nothing within timeout_s
                    if consumer.position is not None:
                        self._ready.set()
                    continue
                now = time.perf_counter()
                run_id, index = _unpack(record.value)
                if run_id == self.run_id:
                    self.arrivals.setdefault(index, now)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # reported with the run's figures
            self.error = e
            self._ready.set()

    async def wait_for(self, want: set[int]) -> None:
        deadline = time.monotonic() + DELIVERY_WAIT_S
        while time.monotonic() < deadline and not want.issubset(self.arrivals):
            if self.error is not None:
                return
            await asyncio.sleep(0.01)


@contextlib.contextmanager
def _consuming(ctx: _Context, run_id: int) -> Iterator[_Deliveries]:
    deliveries = _Deliveries(ctx.consumer_relays, run_id, ctx.curve)
    deliveries.start()
    try:
        if not deliveries.ready.wait(CONSUMER_START_S) or deliveries.error is not None:
            raise RuntimeError(f"the consumer of relay 1 did not start: {deliveries.error!r}")
        yield deliveries
    finally:
        deliveries.stopping.set()
        deliveries.join(2.0)


@dataclass
class _Context:
    options: BenchOptions
    producer_relays: dict[int, str]
    consumer_relays: dict[int, str]
    pids: dict[int, int]
    mesh: Mesh
    client_profile: cProfile.Profile | None = None
    curve: ClientCurve | None = None  # the client's CurveZMQ settings (a CurveZMQ mesh)
    run_ids: Iterator[int] = field(default_factory=lambda: iter(range(1, 1 << 16)))


def _context(options: BenchOptions, mesh: Mesh) -> _Context:
    """A started mesh's runs: produce through relay 0 first, read from relay 1 first."""
    ends = mesh.endpoints
    return _Context(
        options,
        producer_relays={r: ends[r].client for r in (0, 1, 2)},
        consumer_relays={r: ends[r].client for r in (1, 2, 0)},
        pids=mesh.pids,
        mesh=mesh,
        curve=mesh.curve,
    )


def _mesh_frames(ctx: _Context) -> int:
    """Peer frames received so far by all relays together (node counters)."""
    total = 0
    for reply in ctx.mesh.statuses(2.0).values():
        node = (reply.status or {}).get("node") or {}
        total += int((node.get("counters") or {}).get("peer_frames", 0))
    return total


def _produce_for(
    producer: Producer,
    gate: Callable[[], None],
    run_id: int,
    size: int,
    window: int,
    duration_s: float,
) -> dict[str, Any]:
    """Warm `producer` up, pass `gate`, then keep `window` transactions in flight for
    `duration_s`: what was sent, committed and how long it took."""
    pad = os.urandom(size)
    warm = [_payload(0, i, size, pad) for i in range(max(WARMUP_TX, window))]
    producer.send_many(STREAM, warm, return_exceptions=True)
    deadline = 0.0
    sent = 0

    def items() -> Iterator[bytes]:
        nonlocal sent
        while time.perf_counter() < deadline:
            yield _payload(run_id, sent, size, pad)
            sent += 1

    gate()
    started = time.perf_counter()
    deadline = started + duration_s
    results = producer.send_many(STREAM, items(), return_exceptions=True)
    elapsed = time.perf_counter() - started
    committed = sum(1 for r in results if not isinstance(r, ClientError))
    return {
        "sent": len(results),
        "committed": committed,
        "elapsed_s": elapsed,
        "retries": producer.stats.get("retries", 0),
    }


def _throughput_client(
    gate: Callable[[], None],
    relays: dict[int, str],
    curve: ClientCurve | None,
    run_id: int,
    size: int,
    window: int,
    duration_s: float,
) -> dict[str, Any]:
    """The producer of a throughput run, in a process of its own (relay/tools/isolated.py)."""
    with Producer(relays=relays, window=window, curve=curve) as producer:
        return _produce_for(producer, gate, run_id, size, window, duration_s)


def _relay_throughput(ctx: _Context, size: int, window: int, profile: bool) -> dict[str, Any]:
    """Committed tx/s of a producer keeping `window` in flight. The producer runs in a
    process of its own; with `profile`, in this one under cProfile (not a measurement)."""
    run_id = next(ctx.run_ids)
    duration = ctx.options.duration_s

    def at_gate() -> tuple[int, _CpuMeter]:
        return _mesh_frames(ctx), _CpuMeter(ctx.pids)

    if profile:
        profiler = cProfile.Profile()
        meters: list[tuple[int, _CpuMeter]] = []

        def gate() -> None:
            meters.append(at_gate())
            profiler.enable()

        with Producer(relays=ctx.producer_relays, window=window, curve=ctx.curve) as producer:
            try:
                got = _produce_for(producer, gate, run_id, size, window, duration)
            finally:
                profiler.disable()
            frames_before, cpu = meters[0]
            used = cpu.read()
        ctx.client_profile = profiler
    else:
        args = (ctx.producer_relays, ctx.curve, run_id, size, window, duration)
        got, (frames_before, cpu) = run_isolated(
            _throughput_client, args, at_gate=at_gate, duration_s=duration
        )
        used = {**cpu.read(), "client_s": got["client_s"]}
    frames = _mesh_frames(ctx) - frames_before
    committed, elapsed = got["committed"], got["elapsed_s"]
    per_tx = {
        k.replace("_s", "_us_per_tx"): (None if v is None or not committed else v * 1e6 / committed)
        for k, v in used.items()
    }
    return {
        "value_bytes": size,
        "window": window,
        "sent": got["sent"],
        "committed": committed,
        "failed": got["sent"] - committed,
        "elapsed_s": round(elapsed, 4),
        "tx_per_s": round(committed / elapsed, 1) if elapsed > 0 else 0.0,
        "retries": got["retries"],
        "mesh_frames_per_tx": round(frames / committed, 3) if committed else None,
        "cpu_s": used,
        "cpu_us_per_tx": {k: None if v is None else round(v, 1) for k, v in per_tx.items()},
    }


def _wait_deliveries(deliveries: _Deliveries, want: set[int]) -> None:
    deadline = time.monotonic() + DELIVERY_WAIT_S
    while time.monotonic() < deadline and not want.issubset(deliveries.arrivals):
        if deliveries.error is not None:
            return
        time.sleep(0.01)


def _latency_result(
    ctx: _Context,
    size: int,
    mode: str,
    sent_at: dict[int, float],
    committed_at: dict[int, float],
    failed: int,
    elapsed: float,
    deliveries: _Deliveries | _LoopDeliveries | None,
    frames: int,
    rate_tx_s: int | None = None,
) -> dict[str, Any]:
    """The figures of a latency run; `deliveries` has waited for the committed records
    (None: a run without a consumer)."""
    arrivals = {} if deliveries is None else deliveries.arrivals
    error = None if deliveries is None else deliveries.error
    commit = [committed_at[i] - sent_at[i] for i in committed_at]
    delivery = [arrivals[i] - sent_at[i] for i in committed_at if i in arrivals]
    return {
        "value_bytes": size,
        "mode": mode,
        "rate_tx_s": rate_tx_s,
        "sent": len(sent_at),
        "committed": len(committed_at),
        "failed": failed,
        "delivered": len(delivery),
        "achieved_tx_s": round(len(sent_at) / elapsed, 1) if elapsed > 0 else 0.0,
        "mesh_frames_per_tx": round(frames / len(committed_at), 3) if committed_at else None,
        "commit_ms": _summary_ms(commit),
        "delivery_ms": _summary_ms(delivery),
        "consumer_error": repr(error) if error is not None else None,
    }


@contextlib.contextmanager
def one_at_a_time(
    ctx: _Context, run_id: int, size: int, consume: bool = True
) -> Iterator[tuple[_Deliveries | None, Producer, bytes]]:
    """A consumer of relay 1 stamping run `run_id`'s records (unless not `consume`), and
    a warmed-up `Producer` with one transaction in flight; the random padding of the
    values."""
    pad = os.urandom(size)
    with (
        _consuming(ctx, run_id) if consume else contextlib.nullcontext() as deliveries,
        Producer(relays=ctx.producer_relays, window=1, curve=ctx.curve) as producer,
    ):
        for i in range(WARMUP_TX // 4):
            with contextlib.suppress(ClientError):
                producer.send(STREAM, _payload(0, i, size, pad))
        yield deliveries, producer, pad


def _relay_one_in_flight(ctx: _Context, size: int, consume: bool = True) -> dict[str, Any]:
    """One transaction in flight: produce-to-commit, and with `consume` produce-to-delivery
    to a consumer of relay 1 (a thread of this process: it holds up the producer now and
    then, so the side-by-side run with NATS, whose run has no consumer, goes without)."""
    run_id = next(ctx.run_ids)
    limit = QUICK_ONE_IN_FLIGHT_MAX if ctx.options.quick else ONE_IN_FLIGHT_MAX
    sent_at: dict[int, float] = {}
    committed_at: dict[int, float] = {}
    failed = 0
    with one_at_a_time(ctx, run_id, size, consume) as (deliveries, producer, pad):
        frames_before = _mesh_frames(ctx)
        started = time.perf_counter()
        deadline = started + ctx.options.duration_s
        i = 0
        while i < limit and time.perf_counter() < deadline:
            value = _payload(run_id, i, size, pad)
            sent_at[i] = time.perf_counter()
            try:
                producer.send(STREAM, value)
            except ClientError:
                failed += 1
            else:
                committed_at[i] = time.perf_counter()
            i += 1
        elapsed = time.perf_counter() - started
        frames = _mesh_frames(ctx) - frames_before
        if deliveries is not None:
            _wait_deliveries(deliveries, set(committed_at))
        return _latency_result(
            ctx, size, "one_in_flight", sent_at, committed_at, failed, elapsed, deliveries, frames
        )


def _relay_at_rate(ctx: _Context, size: int, rate_tx_s: int | None = None) -> dict[str, Any]:
    """Open loop at `rate_tx_s` (default: the options' rate): produce-to-commit and
    produce-to-delivery (a consumer of relay 1)."""
    run_id = next(ctx.run_ids)
    pad = os.urandom(size)
    rate = rate_tx_s or ctx.options.rate_tx_s
    count = max(1, int(rate * ctx.options.duration_s))
    sent_at: dict[int, float] = {}
    committed_at: dict[int, float] = {}
    failures = [0]
    elapsed = [0.0]
    frames = [0]

    def stamp(index: int) -> Callable[[asyncio.Future[int]], None]:
        def done(future: asyncio.Future[int]) -> None:
            if future.cancelled() or future.exception() is not None:
                failures[0] += 1
            else:
                committed_at[index] = time.perf_counter()

        return done

    async def main() -> _LoopDeliveries:
        # Open loop: the i-th transaction is sent at start + i / rate whatever came back.
        producer = AsyncProducer(relays=ctx.producer_relays, window=MAX_WINDOW, curve=ctx.curve)
        deliveries = _LoopDeliveries(ctx.consumer_relays, run_id, ctx.curve)
        async with producer, deliveries:
            warm = [_payload(0, i, size, pad) for i in range(WARMUP_TX)]
            await producer.send_many(STREAM, warm, return_exceptions=True)
            frames[0] = -_mesh_frames(ctx)
            futures: list[asyncio.Future[int]] = []
            started = time.perf_counter()
            for i in range(count):
                delay = started + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                value = _payload(run_id, i, size, pad)
                sent_at[i] = time.perf_counter()
                future = await producer.send_async(STREAM, value)
                future.add_done_callback(stamp(i))
                futures.append(future)
            await asyncio.gather(*futures, return_exceptions=True)
            await asyncio.sleep(0)  # let the last done callbacks run
            elapsed[0] = time.perf_counter() - started
            frames[0] += _mesh_frames(ctx)
            await deliveries.wait_for(set(committed_at))
        return deliveries

    deliveries = loop.run(main())
    return _latency_result(
        ctx,
        size,
        "rate",
        sent_at,
        committed_at,
        failures[0],
        elapsed[0],
        deliveries,
        frames[0],
        rate,
    )


# --- the baseline: raw PUB/SUB fan-out ---------------------------------------------------


class _Baseline:
    """One PUB and two SUBs on 127.0.0.1, driven by one thread and one poller."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.subs: list[zmq.Socket[Any]] = []
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # the window bounds what is queued
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.poller = zmq.Poller()
        for _ in range(2):
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{port}")
            self.subs.append(sub)
            self.poller.register(sub, zmq.POLLIN)
        self._join()

    def _join(self) -> None:
        """Publish until both subscribers receive (PUB/SUB drops before they join)."""
        seen = [False, False]
        deadline = time.monotonic() + 10.0
        while not all(seen):
            if time.monotonic() > deadline:
                raise RuntimeError("baseline subscribers did not connect within 10 s")
            self.pub.send(b"")
            for sock, _ in self.poller.poll(10):
                k = self.subs.index(sock)
                while True:
                    try:
                        sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    seen[k] = True
        self._drain(lambda k, frame, now: None)

    def close(self) -> None:
        for sock in [self.pub, *self.subs]:
            sock.close(linger=0)
        self.ctx.term()

    def _drain(self, on: Callable[[int, bytes, float], None]) -> int:
        got = 0
        for k, sock in enumerate(self.subs):
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                on(k, frame, time.perf_counter())
                got += 1
        return got

    def throughput(self, size: int, window: int, duration_s: float) -> dict[str, Any]:
        pad = os.urandom(size)
        received = [0, 0]

        def count(k: int, frame: bytes, now: float) -> None:
            received[k] += 1

        for warm in (True, False):
            received[0] = received[1] = 0
            sent = 0
            started = time.perf_counter()
            deadline = started + (WARMUP_S if warm else duration_s)
            last_progress = time.monotonic()
            while True:
                now = time.perf_counter()
                if now < deadline:
                    while sent - min(received) < window:
                        self.pub.send(_payload(1, sent, size, pad), copy=True)
                        sent += 1
                elif min(received) >= sent:
                    break
                if self._drain(count):
                    last_progress = time.monotonic()
                else:
                    if time.monotonic() - last_progress > BASELINE_STALL_S:
                        break
                    self.poller.poll(1)
            elapsed = time.perf_counter() - started
        delivered = min(received)
        return {
            "value_bytes": size,
            "window": window,
            "msgs": sent,
            "delivered_to_both": delivered,
            "lost": sent - delivered,
            "elapsed_s": round(elapsed, 4),
            "msgs_per_s": round(delivered / elapsed, 1) if elapsed > 0 else 0.0,
            "deliveries_per_s": round(sum(received) / elapsed, 1) if elapsed > 0 else 0.0,
        }

    def latency(
        self, size: int, mode: str, duration_s: float, rate: int, limit: int
    ) -> dict[str, Any]:
        pad = os.urandom(size)
        sent_at: dict[int, float] = {}
        samples: list[float] = []
        outstanding: dict[int, int] = {}  # index -> subscribers still to receive it

        def receipt(k: int, frame: bytes, now: float) -> None:
            _, index = _unpack(frame)
            if index in sent_at:
                samples.append(now - sent_at[index])
                left = outstanding.get(index, 0) - 1
                if left <= 0:
                    outstanding.pop(index, None)
                else:
                    outstanding[index] = left

        count = max(1, int(rate * duration_s)) if mode == "rate" else limit
        started = time.perf_counter()
        deadline = started + duration_s
        i = 0
        last_progress = time.monotonic()
        while True:
            now = time.perf_counter()
            if mode == "one_in_flight":
                may_send = not outstanding and i < count and now < deadline
                next_at = now
            else:
                next_at = started + i / rate
                may_send = i < count and now >= next_at
            if may_send:
                t0 = time.perf_counter()
                sent_at[i] = t0
                outstanding[i] = len(self.subs)
                self.pub.send(_payload(2, i, size, pad), copy=True)
                i += 1
                continue
            done_sending = i >= count or (mode == "one_in_flight" and now >= deadline)
            if done_sending and not outstanding:
                break
            if self._drain(receipt):
                last_progress = time.monotonic()
                continue
            if time.monotonic() - last_progress > BASELINE_STALL_S:
                break
            if mode == "rate" and not done_sending:
                wait_ms = max(0, int((next_at - time.perf_counter()) * 1000))
            else:
                wait_ms = 1
            self.poller.poll(wait_ms)
        elapsed = time.perf_counter() - started
        return {
            "value_bytes": size,
            "mode": mode,
            "rate_tx_s": rate if mode == "rate" else None,
            "sent": i,
            "lost_receipts": len(self.subs) * i - len(samples),
            "achieved_msgs_s": round(i / elapsed, 1) if elapsed > 0 else 0.0,
            "one_way_ms": _summary_ms(samples),
        }


# --- the run ---------------------------------------------------------------------------------


_IMPORT_NOISE = (
    "importlib",
    "<built-in method _imp.",
    "marshal.loads",
    "builtins.compile",
    "builtins.__build_class__",
    "posix.stat",
    "builtins.exec",
)

# (label, file suffix, function) whose cumulative time says where a relay's loop goes
RELAY_STAGES = (
    ("loop turns (busy)", "relay/node.py", "_turn"),
    ("  peer frames: drain", "relay/node.py", "_drain_peers"),
    ("    core.receive", "relay/core/machine.py", "receive"),
    ("    codec.decode", "relay/core/codec.py", "decode"),
    ("  client frames: drain", "relay/node.py", "_drain_clients"),
    ("    wire.decode", "relay/wire.py", "decode"),
    ("    core.produce", "relay/core/machine.py", "produce_many"),
    ("  core.tick", "relay/core/machine.py", "tick"),
    ("  flush: ready + publish + replies", "relay/node.py", "_flush"),
    ("    core.ready", "relay/core/machine.py", "ready"),
    ("    codec.encode", "relay/core/codec.py", "encode"),
    ("    publish to peers", "relay/node.py", "_publish"),
    ("    replies to clients", "relay/node.py", "_send_client"),
    ("    wake parked reads", "relay/node.py", "_wake_reads"),
    ("  expire", "relay/node.py", "_expire"),
    ("  produce batch answers", "relay/node.py", "_send_batch_results"),
    ("zmq send (all)", "zmq/sugar/socket.py", "send"),
    ("zmq recv_multipart (all)", "zmq/sugar/socket.py", "recv_multipart"),
    ("waiting in zmq poll (idle)", "zmq/sugar/poll.py", "poll"),
    ("waiting in epoll (idle)", "~", "<method 'poll' of 'select.epoll' objects>"),
)


def _is_wait(filename: str, name: str) -> bool:
    """Where a relay or client waits for input (its own time is not busy time)."""
    return "select.epoll" in name or (
        name == "poll" and filename.replace(os.sep, "/").endswith("zmq/sugar/poll.py")
    )


def _short_name(filename: str, line: int, name: str) -> str:
    short = filename
    marker = f"{os.sep}relay{os.sep}"
    if marker in filename:
        short = "relay/" + filename.rsplit(marker, 1)[1]
    elif "site-packages" in filename:
        short = filename.rsplit("site-packages" + os.sep, 1)[1]
    elif os.sep in filename:
        short = filename.rsplit(os.sep, 1)[1]
    return f"{short}:{line}({name})"


def _profile_rows(stats: pstats.Stats, top: int = PROFILE_TOP) -> list[dict[str, Any]]:
    """The `top` functions by own time (import-time work left out), with cumulative time;
    shares are of the profiled time outside waits for input."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    idle = sum(tt for (f, _, n), (_, _, tt, _, _) in raw.items() if _is_wait(f, n))
    total = (sum(tt for _, _, tt, _, _ in raw.values()) - idle) or 1.0
    rows = []
    ranked = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)
    for (filename, line, name), (_, calls, tt, ct, _) in ranked:
        label = _short_name(filename, line, name)
        if _is_wait(filename, name) or any(noise in label for noise in _IMPORT_NOISE):
            continue
        rows.append(
            {
                "function": label,
                "calls": calls,
                "tottime_s": round(tt, 4),
                "cumtime_s": round(ct, 4),
                "share_of_busy": round(tt / total, 4),
            }
        )
        if len(rows) >= top:
            break
    return rows


def _stage_rows(stats: pstats.Stats) -> list[dict[str, Any]]:
    """Cumulative time of the relay loop's stages (RELAY_STAGES), as shares of the busy
    loop time."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    found: dict[str, tuple[int, float]] = {}
    for (filename, _, name), (_, calls, _, ct, _) in raw.items():
        for label, suffix, func in RELAY_STAGES:
            if name == func and filename.replace(os.sep, "/").endswith(suffix):
                old_calls, old_ct = found.get(label, (0, 0.0))
                found[label] = (old_calls + calls, old_ct + ct)
    busy = found.get(RELAY_STAGES[0][0], (0, 0.0))[1] or 1.0
    return [
        {
            "stage": label,
            "calls": found[label][0],
            "cumtime_s": round(found[label][1], 4),
            "share_of_busy": round(found[label][1] / busy, 4),
        }
        for label, _, _ in RELAY_STAGES
        if label in found
    ]


def _targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    tput = [r["tx_per_s"] for r in report["relay"]["throughput"] if r["value_bytes"] == 100]
    one = [
        r["commit_ms"]["p50"]
        for r in report["relay"]["latency"]
        if r["mode"] == "one_in_flight"
        and r["value_bytes"] == 100
        and r["commit_ms"]["p50"] is not None
    ]
    rate = [
        r["commit_ms"]["p99"]
        for r in report["relay"]["latency"]
        if r["mode"] == "rate" and r["commit_ms"]["p99"] is not None
    ]
    out = []
    for name, target, measured, better in (
        (
            "committed tx/s at 100 B, pipelined (best window)",
            TARGET_TX_S,
            max(tput) if tput else None,
            "higher",
        ),
        (
            "produce-to-commit p50 ms at one in flight, 100 B",
            TARGET_P50_ONE_MS,
            min(one) if one else None,
            "lower",
        ),
        (
            f"produce-to-commit p99 ms at {report['config']['rate_tx_s']} tx/s (worst size)",
            TARGET_P99_RATE_MS,
            max(rate) if rate else None,
            "lower",
        ),
    ):
        met = None
        if measured is not None:
            met = measured >= target if better == "higher" else measured <= target
        out.append({"target": name, "goal": target, "measured": measured, "met": met})
    return out


def _config(options: BenchOptions) -> dict[str, Any]:
    """What a report says of the run and the machine."""
    return {
        "duration_s": options.duration_s,
        "sizes": list(options.sizes),
        "windows": list(options.windows),
        "rate_tx_s": options.rate_tx_s,
        "quick": options.quick,
        "profile": options.profile,
        "relays": 3,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "pyzmq": zmq.pyzmq_version(),
        "libzmq": zmq.zmq_version(),
        "event_loop": loop.NAME,  # of the asyncio clients (both sides' in --peers)
        # relays started from here load what this process does (relay/native.py)
        "compiled": native.active(),
    }


def _compiled(cfg: dict[str, Any]) -> str:
    return "yes" if cfg["compiled"] else "no (interpreted)"


def run(options: BenchOptions, *, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the whole benchmark; return the report (see `relay bench --json`)."""
    say = log or (lambda text: None)
    workdir = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    keep = False
    topology = _write_topology(workdir)
    stats_path = workdir / "relay0.prof"
    mesh: Mesh
    if options.profile:
        mesh = _ProfiledMesh(
            topology,
            log_level="warning",
            log_dir=workdir / "logs",
            profiled=0,
            stats_path=stats_path,
        )
    else:
        mesh = Mesh(topology, log_level="warning", log_dir=workdir / "logs")
    report: dict[str, Any] = {
        "config": _config(options),
        "relay": {"throughput": [], "latency": []},
        "baseline": {"throughput": [], "latency": []},
    }
    baseline: _Baseline | None = None
    try:
        say("starting the 3-relay mesh ...")
        mesh.start(START_TIMEOUT_S)
        ctx = _context(options, mesh)
        baseline = _Baseline()
        limit = QUICK_ONE_IN_FLIGHT_MAX if options.quick else ONE_IN_FLIGHT_MAX
        for size in options.sizes:
            for window in options.windows:
                say(f"throughput: {size} B, window {window}")
                report["baseline"]["throughput"].append(
                    baseline.throughput(size, window, options.duration_s)
                )
                profile = (
                    options.profile and size == options.sizes[0] and window == max(options.windows)
                )
                report["relay"]["throughput"].append(_relay_throughput(ctx, size, window, profile))
            say(f"latency: {size} B, one in flight")
            report["baseline"]["latency"].append(
                baseline.latency(size, "one_in_flight", options.duration_s, 0, limit)
            )
            report["relay"]["latency"].append(_relay_one_in_flight(ctx, size))
            say(f"latency: {size} B, {options.rate_tx_s} tx/s")
            report["baseline"]["latency"].append(
                baseline.latency(size, "rate", options.duration_s, options.rate_tx_s, 0)
            )
            report["relay"]["latency"].append(_relay_at_rate(ctx, size))
        report["relay_counters"] = {
            r: {
                **((reply.status or {}).get("counters") or {}),
                **(((reply.status or {}).get("node") or {}).get("counters") or {}),
            }
            for r, reply in mesh.statuses().items()
        }
        if options.profile and ctx.client_profile is not None:
            text = io.StringIO()
            rows = _profile_rows(pstats.Stats(ctx.client_profile, stream=text))
            report.setdefault("profile", {})["client"] = {
                "run": f"throughput {options.sizes[0]} B window {max(options.windows)}",
                "top_by_own_time": rows,
            }
    except BaseException:
        keep = True
        raise
    finally:
        if baseline is not None:
            baseline.close()
        mesh.stop()
        if options.profile and stats_path.exists():
            relay_stats = pstats.Stats(str(stats_path), stream=io.StringIO())
            report.setdefault("profile", {})["relay0"] = {
                "run": "relay 0 (coordinator of every produce) over the whole bench",
                "top_by_own_time": _profile_rows(relay_stats),
                "stages": _stage_rows(relay_stats),
            }
        if keep:
            say(f"relay logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report["ratios"] = _ratios(report)
    report["targets"] = _targets(report)
    return report


# --- the cost of CurveZMQ, of the metrics endpoints ---------------------------------------------

SECURITY_SIDES = ("plain", "curve")
METRICS_SIDES = ("off", "on")
COMPARISON_WIDTH = 120  # columns of the comparison's tables when not printed to a terminal
METRICS_SCRAPE_S = 1.0  # how often the "on" side's /metrics are read (Prometheus: 15 s)
SCRAPE_TIMEOUT_S = 5.0  # one scrape (a relay answers within its STATUS_WAIT_S)


@dataclass(frozen=True)
class Comparison:
    """Two meshes that differ in one setting: the sides' names (base first) and how each
    side's topology is written."""

    title: str
    sides: tuple[str, str]
    write: Callable[[Path, str], Path]


SECURITY = Comparison(
    "two 3-relay meshes on 127.0.0.1 (plain, CurveZMQ)",
    SECURITY_SIDES,
    lambda directory, side: _write_topology(directory, curve=side == "curve"),
)
METRICS = Comparison(
    "two 3-relay meshes on 127.0.0.1 (HTTP endpoints off; on, /metrics of every relay "
    f"scraped every {METRICS_SCRAPE_S:g} s)",
    METRICS_SIDES,
    lambda directory, side: _write_topology(directory, http=side == "on"),
)


class _Scraper:
    """Reads every relay's /metrics every METRICS_SCRAPE_S in a thread, as a monitoring
    system would, while the runs go on (`scrapes`, `failures`: what it did)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.scrapes = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)

    def __enter__(self) -> _Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import urllib.request

        while not self._stop.wait(METRICS_SCRAPE_S):
            for url in self.urls:
                try:
                    with urllib.request.urlopen(url + "/metrics", timeout=SCRAPE_TIMEOUT_S) as resp:
                        resp.read()
                    self.scrapes += 1
                except OSError:
                    self.failures += 1


def run_comparison(
    options: BenchOptions, comparison: Comparison, *, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The same runs on the two meshes of `comparison`, each pair back to back, in
    `options.rounds` rounds that alternate which side goes first (whichever runs second
    meets another machine: swapping the order of one pair once moved its ratio from 0.85
    to 1.05). The report
    (`relay bench --security|--metrics --json`): per side the runs (each with its round),
    and per kind of run the ratios of every round and their median."""
    say = log or (lambda text: None)
    workdir = Path(tempfile.mkdtemp(prefix="relay-bench-compare-"))
    keep = False
    sides = comparison.sides
    meshes: dict[str, Mesh] = {}
    report: dict[str, Any] = {
        "config": _config(options),
        "title": comparison.title,
        "sides": list(sides),
        "rounds": options.rounds,
        "order": [list(_round_order(sides, n)) for n in range(options.rounds)],
        **{side: {"throughput": [], "latency": []} for side in sides},
    }
    try:
        contexts: dict[str, _Context] = {}
        for side in sides:
            say(f"starting the {side} 3-relay mesh ...")
            directory = workdir / side
            mesh = Mesh(comparison.write(directory, side), log_dir=directory / "logs")
            meshes[side] = mesh
            mesh.start(START_TIMEOUT_S)
            contexts[side] = _context(options, mesh)
        urls = [
            url
            for mesh in meshes.values()
            for spec in mesh.config.relays.values()
            if (url := spec.http_url) is not None
        ]

        def each_side(
            number: int, kind: str, what: str, measure: Callable[[_Context], dict[str, Any]]
        ) -> None:
            runs = {side: partial(measure, contexts[side]) for side in sides}
            _run_pair(report, sides, (number, options.rounds), kind, what, runs, say)

        with _Scraper(urls) as scraper:
            for number in range(options.rounds):
                for size in options.sizes:
                    for window in options.windows:
                        each_side(
                            number,
                            "throughput",
                            f"{size} B, window {window}",
                            functools.partial(
                                _relay_throughput, size=size, window=window, profile=False
                            ),
                        )
                    each_side(
                        number,
                        "latency",
                        f"{size} B, one in flight",
                        functools.partial(_relay_one_in_flight, size=size),
                    )
                    each_side(
                        number,
                        "latency",
                        f"{size} B, {options.rate_tx_s} tx/s",
                        functools.partial(_relay_at_rate, size=size),
                    )
        if urls:
            report["scrapes"] = {"done": scraper.scrapes, "failed": scraper.failures}
    except BaseException:
        keep = True
        raise
    finally:
        for mesh in meshes.values():
            mesh.stop()
        if keep:
            say(f"relay logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report["ratios"] = _comparison_ratios(report)
    return report


def _round_order(sides: tuple[str, str], number: int) -> tuple[str, str]:
    """Which side runs first in round `number`: each in every other round."""
    return sides if number % 2 == 0 else (sides[1], sides[0])


def _run_pair(
    report: dict[str, Any],
    sides: tuple[str, str],
    round_of: tuple[int, int],
    kind: str,
    what: str,
    runs: Mapping[str, Callable[[], dict[str, Any]]],
    say: Callable[[str], None],
) -> None:
    """One pair of runs of round `round_of` (number, rounds), back to back in the round's
    order; each run is added to its side's `kind` runs with its round."""
    number, rounds = round_of
    for side in _round_order(sides, number):
        say(f"round {number + 1}/{rounds}, {kind}, {side}: {what}")
        report[side][kind].append({**runs[side](), "round": number})


def _run_name(run: dict[str, Any]) -> str:
    if "window" in run:
        return f"throughput {run['value_bytes']} B window {run['window']}"
    load = "one in flight" if run["mode"] == "one_in_flight" else f"{run['rate_tx_s']} tx/s"
    return f"latency {run['value_bytes']} B {load}"


def _run_figures(run: dict[str, Any]) -> dict[str, float | None]:
    """What is compared of a run: throughput and the relays' CPU per committed
    transaction, or the commit latency."""
    if "window" in run:
        return {"tx_s": run["tx_per_s"], "relay_cpu_us_per_tx": _relays_us_per_tx(run)}
    return {"commit_p50": run["commit_ms"]["p50"], "commit_p99": run["commit_ms"]["p99"]}


def _relays_us_per_tx(run: dict[str, Any]) -> float | None:
    """CPU microseconds of the three relays together per committed transaction."""
    per_tx = run["cpu_us_per_tx"]
    relays: list[float | None] = [v for k, v in per_tx.items() if k.startswith("relay")]
    if not relays or any(v is None for v in relays):
        return None
    return round(sum(v for v in relays if v is not None), 1)


def _comparison_ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per kind of run: the second side / the first (`_round_ratios`)."""
    base_side, other_side = report["sides"]
    return _round_ratios(
        report, other_side, base_side, lambda other, base: _run_name(base), _run_figures
    )


def _round_ratios(
    report: dict[str, Any],
    over: str,
    under: str,
    name_of: Callable[[dict[str, Any], dict[str, Any]], str],
    figures_of: Callable[[dict[str, Any]], dict[str, float | None]],
) -> list[dict[str, Any]]:
    """Per run (named by `name_of(over's run, under's run)`, in the order of the first
    round): for each figure, `over` / `under` of every round (`<figure>_rounds`: each
    round's pair ran back to back, so a ratio is never taken across rounds) and their
    median (`<figure>`)."""
    rows: dict[str, dict[str, Any]] = {}
    for kind in ("throughput", "latency"):
        for ours, theirs in zip(report[over][kind], report[under][kind], strict=True):
            name = name_of(ours, theirs)
            row = rows.setdefault(name, {"run": name})
            under_figures = figures_of(theirs)
            for figure, value in figures_of(ours).items():
                ratio = _ratio(value, under_figures.get(figure))
                row.setdefault(f"{figure}_rounds", []).append(ratio)
    for row in rows.values():
        for key in [k for k in row if k.endswith("_rounds")]:
            median = _median(row[key])
            row[key.removesuffix("_rounds")] = None if median is None else round(median, 3)
    return list(rows.values())


def _ratio_cell(row: dict[str, Any], figure: str) -> str:
    """A row's median ratio of `figure`, and with several rounds the lowest and highest;
    "-" where it has none."""
    if row.get(figure) is None:
        return "-"
    shown = _fmt(row[figure], 2)
    known = [r for r in row[f"{figure}_rounds"] if r is not None]
    if len(known) > 1:
        shown += f" ({_fmt(min(known), 2)}-{_fmt(max(known), 2)})"
    return shown


def print_comparison_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # a file or a pipe: no screen to fit, so nothing is cut
        console = Console(width=COMPARISON_WIDTH)
    cfg = report["config"]
    first, second = report["sides"]
    ratio = f"{second}/{first}"
    rounds = report["rounds"]
    console.print(
        f"relay bench: {report['title']}, "
        f"{cfg['cpus']} CPUs, pyzmq {cfg['pyzmq']} (libzmq {cfg['libzmq']}); "
        f"{cfg['duration_s']:g} s per run; {rounds} round{'s' if rounds > 1 else ''}, "
        "each side first in every other one; medians over the rounds, ratios as "
        "median (lowest-highest round)"
    )
    if "scrapes" in report:
        console.print(
            f"scrapes of /metrics: {report['scrapes']['done']} "
            f"({report['scrapes']['failed']} failed)"
        )
    ratios = {row["run"]: row for row in report["ratios"]}

    def medians(side: str, kind: str) -> dict[str, dict[str, float | None]]:
        by_run: dict[str, list[dict[str, float | None]]] = {}
        for run in report[side][kind]:
            by_run.setdefault(_run_name(run), []).append(_run_figures(run))
        return {
            name: {figure: _median([f[figure] for f in figures]) for figure in figures[0]}
            for name, figures in by_run.items()
        }

    def ratio_cell(name: str, figure: str) -> str:
        return _ratio_cell(ratios[name], figure)

    table = Table(title="throughput: committed tx/s; CPU us of the three relays per tx")
    for name in ("run", f"{first} tx/s", f"{second} tx/s", ratio):
        table.add_column(name, justify="right")
    for name in (f"CPU {first}", f"CPU {second}", ratio):
        table.add_column(name, justify="right")
    base, other = medians(first, "throughput"), medians(second, "throughput")
    for name in base:
        b, o = base[name], other[name]
        table.add_row(
            name.removeprefix("throughput ").replace("window ", "w"),
            _fmt(b["tx_s"], 0),
            _fmt(o["tx_s"], 0),
            ratio_cell(name, "tx_s"),
            _fmt(b["relay_cpu_us_per_tx"], 0),
            _fmt(o["relay_cpu_us_per_tx"], 0),
            ratio_cell(name, "relay_cpu_us_per_tx"),
        )
    console.print(table)
    table = Table(title="latency ms, produce->commit")
    for name in ("run", f"{first} p50 / p99", f"{second} p50 / p99"):
        table.add_column(name, justify="right")
    for name in (f"{ratio} p50", f"{ratio} p99"):
        table.add_column(name, justify="right")
    base, other = medians(first, "latency"), medians(second, "latency")
    for name in base:
        b, o = base[name], other[name]
        table.add_row(
            name.removeprefix("latency "),
            f"{_fmt(b['commit_p50'])} / {_fmt(b['commit_p99'])}",
            f"{_fmt(o['commit_p50'])} / {_fmt(o['commit_p99'])}",
            ratio_cell(name, "commit_p50"),
            ratio_cell(name, "commit_p99"),
        )
    console.print(table)


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


# --- side by side with NATS JetStream (issue 12) --------------------------------------------------

PEER_WINDOWS = (16, 64, 256, 1_024, MAX_WINDOW)  # the windows
PEER_FIXED_RATE_TX_S = 1_000  # the delivery runs: this rate, and
PEER_MAX_RATE_SHARE = 0.8  # ... this share of each side's best throughput at the size
QUICK_RATE_TX_S = 200
PEER_SETTLE_S = 2.0  # after start, before idle CPU is measured
PEER_IDLE_S = 5.0  # idle CPU is measured over this long
QUICK_IDLE_S = 0.5
PEER_SIDES = ("relay", "nats")


def _per_tx_us(used: dict[str, float | None], done: int) -> float | None:
    """CPU microseconds per committed (acknowledged) transaction, all processes together."""
    if not done or any(v is None for v in used.values()):
        return None
    return round(sum(v for v in used.values() if v is not None) * 1e6 / done, 1)


def _with_cpu(
    pids: dict[int, int], label: str, run: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """A latency run with the CPU its servers and this process (producer and consumer)
    used, per committed transaction: at a fixed rate, transactions come one at a time, and
    what each costs is another figure than at full load. The warm-up and the consumer's
    start are counted too (short next to the run)."""
    cpu = _CpuMeter(pids, label=label)
    result = run()
    result["cpu_s"] = cpu.read()
    result["cpu_us_per_tx_all"] = _per_tx_us(result["cpu_s"], result["committed"])
    return result


def _nats_throughput_client(
    gate: Callable[[], None], urls: list[str], value: bytes, window: int, duration_s: float
) -> dict[str, Any]:
    """nats-py's side of a throughput run, in a process of its own (as the relay's)."""
    from relay.tools import nats_peer

    nats_peer.throughput(urls, value, window, min(duration_s, WARMUP_S))
    gate()
    return nats_peer.throughput(urls, value, window, duration_s)


def _nats_throughput(cluster: Any, size: int, window: int, duration_s: float) -> dict[str, Any]:
    args = (list(cluster.urls), os.urandom(size), window, duration_s)
    got, cpu = run_isolated(
        _nats_throughput_client,
        args,
        at_gate=lambda: _CpuMeter(cluster.pids, label="server"),
        duration_s=duration_s,
    )
    used = {**cpu.read(), "client_s": got["client_s"]}
    elapsed = got["elapsed_s"]
    return {
        "value_bytes": size,
        "window": window,
        "committed": got["acked"],
        "failed": got["failed"],
        "elapsed_s": round(elapsed, 4),
        "tx_per_s": round(got["acked"] / elapsed, 1) if elapsed > 0 else 0.0,
        "cpu_s": used,
        "cpu_us_per_tx_all": _per_tx_us(used, got["acked"]),
    }


def _nats_one_in_flight(cluster: Any, size: int, options: BenchOptions) -> dict[str, Any]:
    from relay.tools import nats_peer

    limit = QUICK_ONE_IN_FLIGHT_MAX if options.quick else ONE_IN_FLIGHT_MAX
    value = os.urandom(size)
    got = nats_peer.one_in_flight(cluster.urls, value, options.duration_s, limit)
    return {
        "value_bytes": size,
        "mode": "one_in_flight",
        "committed": len(got["samples_s"]),
        "failed": got["failed"],
        "commit_ms": _summary_ms(got["samples_s"]),
    }


def _nats_at_rate(cluster: Any, size: int, rate_tx_s: int, duration_s: float) -> dict[str, Any]:
    from relay.tools import nats_peer

    got = nats_peer.at_rate(cluster.urls, os.urandom(size), rate_tx_s, duration_s)
    return {
        "value_bytes": size,
        "mode": "rate",
        "rate_tx_s": rate_tx_s,
        "sent": got["sent"],
        "committed": len(got["ack_s"]),
        "failed": got["failed"],
        "delivered": len(got["delivery_s"]),
        "commit_ms": _summary_ms(got["ack_s"]),
        "delivery_ms": _summary_ms(got["delivery_s"]),
    }


def _idle_cpu(sides: dict[str, dict[int, int]], seconds: float) -> dict[str, list[float | None]]:
    """Per side, each server's CPU over `seconds` with nothing asked of it, in % of a core
    (the sides measured over the same interval)."""
    meters = {side: _CpuMeter(pids, label="server") for side, pids in sides.items()}
    started = time.perf_counter()
    time.sleep(seconds)
    elapsed = time.perf_counter() - started
    out: dict[str, list[float | None]] = {}
    for side, meter in meters.items():
        used = meter.read()
        out[side] = [
            None if v is None else round(100 * v / elapsed, 2)
            for k, v in used.items()
            if k != "client_s"
        ]
    return out


def _rates(report: dict[str, Any], side: str, size: int, quick: bool, number: int) -> list[int]:
    """The fixed rates of round `number`'s delivery runs: 1,000 tx/s and 80 % of the
    side's best throughput in that round."""
    best = max(
        (
            r["tx_per_s"]
            for r in report[side]["throughput"]
            if r["value_bytes"] == size and r["round"] == number
        ),
        default=0.0,
    )
    fixed = QUICK_RATE_TX_S if quick else PEER_FIXED_RATE_TX_S
    return [fixed, max(1, int(PEER_MAX_RATE_SHARE * best))]


def run_peers(options: BenchOptions, *, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The relay mesh and a 3-server NATS JetStream cluster (R3 memory stream, nats-py),
    both running, the same shapes through each, every pair of runs back to back, in
    `options.rounds` rounds that alternate which side goes first; the clients alike: each
    throughput client in a process of its own, the asyncio ones on the same loop
    (relay/loop.py), producer and consumer of a rate run in one loop, no consumer at one
    in flight. The report (`relay bench --peers nats --json`): per side the runs (each
    with its round), and per shape the relay/NATS ratios of every round and their median
    (NATS's figures here vary by a quarter from one run to the next)."""
    from relay.tools.nats_peer import NatsCluster

    say = log or (lambda text: None)
    cluster = NatsCluster()  # (first: it says at once what is missing)
    workdir = Path(tempfile.mkdtemp(prefix="relay-bench-peers-"))
    keep = False
    mesh = Mesh(_write_topology(workdir / "relay"), log_dir=workdir / "relay" / "logs")
    report: dict[str, Any] = {
        "config": _config(options),
        "rounds": options.rounds,
        "order": [list(_round_order(PEER_SIDES, n)) for n in range(options.rounds)],
        **{side: {"throughput": [], "latency": []} for side in PEER_SIDES},
    }
    try:
        say("starting the 3-relay mesh and the 3-server NATS JetStream cluster ...")
        mesh.start(START_TIMEOUT_S)
        cluster.start(workdir / "nats")
        ctx = _context(options, mesh)
        idle_s = QUICK_IDLE_S if options.quick else PEER_IDLE_S
        say(f"idle CPU over {idle_s:g} s")
        time.sleep(PEER_SETTLE_S)  # (an idle mesh goes quiet after quiet_after_ms)
        report["idle_cpu_percent"] = _idle_cpu({"relay": mesh.pids, "nats": cluster.pids}, idle_s)

        def pair(number: int, kind: str, what: str, runs: dict[str, Callable[[], Any]]) -> None:
            _run_pair(report, PEER_SIDES, (number, options.rounds), kind, what, runs, say)

        for number in range(options.rounds):
            for size in options.sizes:
                for window in options.windows:
                    pair(
                        number,
                        "throughput",
                        f"{size} B, window {window}",
                        {
                            "relay": partial(_peer_relay_throughput, ctx, size, window),
                            "nats": partial(
                                _nats_throughput, cluster, size, window, options.duration_s
                            ),
                        },
                    )
                pair(
                    number,
                    "latency",
                    f"{size} B, one in flight",
                    {
                        "relay": partial(
                            _with_cpu,
                            mesh.pids,
                            "relay",
                            partial(_relay_one_in_flight, ctx, size, False),
                        ),
                        "nats": partial(
                            _with_cpu,
                            cluster.pids,
                            "server",
                            partial(_nats_one_in_flight, cluster, size, options),
                        ),
                    },
                )
                relay_rates = _rates(report, "relay", size, options.quick, number)
                nats_rates = _rates(report, "nats", size, options.quick, number)
                for relay_rate, nats_rate in zip(relay_rates, nats_rates, strict=True):
                    pair(
                        number,
                        "latency",
                        f"{size} B at {relay_rate:,} / {nats_rate:,} tx/s",
                        {
                            "relay": partial(
                                _with_cpu,
                                mesh.pids,
                                "relay",
                                partial(_relay_at_rate, ctx, size, relay_rate),
                            ),
                            "nats": partial(
                                _with_cpu,
                                cluster.pids,
                                "server",
                                partial(
                                    _nats_at_rate, cluster, size, nats_rate, options.duration_s
                                ),
                            ),
                        },
                    )
    except BaseException:
        keep = True
        raise
    finally:
        cluster.stop()
        mesh.stop()
        if keep:
            say(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report["ratios"] = _peer_ratios(report)
    return report


def _peer_relay_throughput(ctx: _Context, size: int, window: int) -> dict[str, Any]:
    run = _relay_throughput(ctx, size, window, False)
    run["cpu_us_per_tx_all"] = _per_tx_us(run["cpu_s"], run["committed"])
    return run


def _peer_shape(relay: dict[str, Any], nats: dict[str, Any]) -> str:
    """The shape of a pair of runs: a window, one in flight, a rate both sides ran at, or
    each side's own share of its best."""
    size = relay["value_bytes"]
    if "window" in relay:
        return f"{size} B window {relay['window']}"
    if relay["mode"] == "one_in_flight":
        return f"{size} B one in flight"
    if relay["rate_tx_s"] == nats["rate_tx_s"]:
        return f"{size} B at {relay['rate_tx_s']:,} tx/s"
    return f"{size} B at {PEER_MAX_RATE_SHARE:.0%} of each side's best"


def _peer_figures(run: dict[str, Any]) -> dict[str, float | None]:
    """What is compared of a peer run: throughput (higher is better) or latency (lower
    is), and the CPU of every process per committed transaction."""
    if "window" in run:
        return {"tx_s": run["tx_per_s"], "cpu_us_per_tx": run["cpu_us_per_tx_all"]}
    figures: dict[str, float | None] = {
        "commit_p50": run["commit_ms"]["p50"],
        "commit_p99": run["commit_ms"]["p99"],
    }
    if run.get("delivery_ms"):
        figures["delivery_p50"] = run["delivery_ms"]["p50"]
        figures["delivery_p99"] = run["delivery_ms"]["p99"]
    figures["cpu_us_per_tx"] = run.get("cpu_us_per_tx_all")
    return figures


def _peer_ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per shape: relay/NATS (`_round_ratios`)."""
    return _round_ratios(report, "relay", "nats", _peer_shape, _peer_figures)


def print_peers_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # a file or a pipe: no screen to fit, so nothing is cut
        console = Console(width=COMPARISON_WIDTH)
    cfg = report["config"]
    rounds = report["rounds"]
    console.print(
        f"relay bench --peers nats: a 3-relay mesh and 3 nats-servers (JetStream, R3 memory "
        f"stream, nats-py) on 127.0.0.1, {cfg['cpus']} CPUs; {cfg['duration_s']:g} s per run; "
        f"{rounds} round{'s' if rounds > 1 else ''}, each side first in every other one; "
        f"compiled modules: {_compiled(cfg)}; each throughput client in a process of its own; "
        f"asyncio clients on {cfg.get('event_loop', 'asyncio')}"
    )
    table = Table(title="throughput: committed (acknowledged) tx/s, CPU us per tx (all processes)")
    columns = ("round", "value", "window", "relay tx/s", "nats tx/s", "relay/nats")
    for name in (*columns, "relay us", "nats us"):
        table.add_column(name, justify="right")
    for r, n in zip(report["relay"]["throughput"], report["nats"]["throughput"], strict=True):
        table.add_row(
            str(r["round"] + 1),
            f"{r['value_bytes']} B",
            str(r["window"]),
            _fmt(r["tx_per_s"], 0),
            _fmt(n["tx_per_s"], 0),
            _fmt(_ratio(r["tx_per_s"], n["tx_per_s"]), 3),
            _fmt(r["cpu_us_per_tx_all"], 1),
            _fmt(n["cpu_us_per_tx_all"], 1),
        )
    console.print(table)
    table = Table(
        title="latency ms p50 / p99: produce -> commit (ack), and -> delivery to a consumer "
        "of another server"
    )
    for name in (
        "round",
        "value",
        "load (relay / nats)",
        "what",
        "relay",
        "nats",
        "relay/nats",
        "CPU us/tx relay / nats",
    ):
        table.add_column(name, justify="right")
    for r, n in zip(report["relay"]["latency"], report["nats"]["latency"], strict=True):
        if r["mode"] == "one_in_flight":
            load = "1 in flight"
        else:
            load = f"{r['rate_tx_s']:,} / {n['rate_tx_s']:,} tx/s"
        for what in ("commit", "delivery"):
            rc, nc = r.get(f"{what}_ms"), n.get(f"{what}_ms")
            if rc is None or nc is None:
                continue
            table.add_row(
                str(r["round"] + 1),
                f"{r['value_bytes']} B",
                load,
                what,
                f"{_fmt(rc['p50'])} / {_fmt(rc['p99'])}",
                f"{_fmt(nc['p50'])} / {_fmt(nc['p99'])}",
                f"{_fmt(_ratio(rc['p50'], nc['p50']))} / {_fmt(_ratio(rc['p99'], nc['p99']))}",
                (
                    f"{_fmt(r.get('cpu_us_per_tx_all'), 0)} / {_fmt(n.get('cpu_us_per_tx_all'), 0)}"
                    if what == "commit"
                    else ""
                ),
            )
    console.print(table)
    if rounds > 1:
        table = Table(
            title=f"relay/nats over {rounds} rounds: median (lowest-highest round); "
            "above 1 is better for tx/s, below 1 for latency and CPU"
        )
        figures = ("tx_s", "commit_p50", "commit_p99", "delivery_p50", "cpu_us_per_tx")
        table.add_column("shape")
        for figure in figures:
            table.add_column(figure, justify="right")
        for row in report["ratios"]:
            table.add_row(row["run"], *(_ratio_cell(row, figure) for figure in figures))
        console.print(table)
    idle = report.get("idle_cpu_percent") or {}
    for side in PEER_SIDES:
        shown = ", ".join(_fmt(v) for v in idle.get(side, []))
        console.print(f"idle CPU, % of a core per server: {side} {shown}")


def _ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    base_t = {(b["value_bytes"], b["window"]): b for b in report["baseline"]["throughput"]}
    for r in report["relay"]["throughput"]:
        b = base_t.get((r["value_bytes"], r["window"]))
        if b is not None:
            out.append(
                {
                    "metric": "throughput",
                    "value_bytes": r["value_bytes"],
                    "window": r["window"],
                    "relay": r["tx_per_s"],
                    "baseline": b["msgs_per_s"],
                    "ratio": _ratio(r["tx_per_s"], b["msgs_per_s"]),
                }
            )
    base_l = {(b["value_bytes"], b["mode"]): b for b in report["baseline"]["latency"]}
    for r in report["relay"]["latency"]:
        b = base_l.get((r["value_bytes"], r["mode"]))
        if b is None:
            continue
        for what in ("commit", "delivery"):
            for p in ("p50", "p99"):
                relay_ms = r[f"{what}_ms"][p]
                base_ms = b["one_way_ms"][p]
                out.append(
                    {
                        "metric": f"{what}_latency_{p}",
                        "value_bytes": r["value_bytes"],
                        "mode": r["mode"],
                        "relay": relay_ms,
                        "baseline": base_ms,
                        "ratio": _ratio(relay_ms, base_ms),
                    }
                )
    return out


# --- output ------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cfg = report["config"]
    console.print(
        f"relay bench: 3 relays on 127.0.0.1, {cfg['cpus']} CPUs, Python {cfg['python']}, "
        f"pyzmq {cfg['pyzmq']} (libzmq {cfg['libzmq']}); {cfg['duration_s']:g} s per run; "
        f"compiled modules: {_compiled(cfg)}"
        + ("; relay 0 interpreted under cProfile (slower)" if cfg["profile"] else "")
    )
    base_t = {(b["value_bytes"], b["window"]): b for b in report["baseline"]["throughput"]}
    table = Table(title="throughput: committed tx/s (relay) vs fan-out msgs/s (PUB -> 2 SUB)")
    for name in (
        "value",
        "window",
        "relay tx/s",
        "failed",
        "baseline msgs/s",
        "ratio",
        "CPU µs/tx r0/r1/r2/client",
        "mesh frames/tx",
    ):
        table.add_column(name, justify="right")
    for r in report["relay"]["throughput"]:
        b = base_t.get((r["value_bytes"], r["window"]), {})
        cpu = r["cpu_us_per_tx"]
        cpu_text = "/".join(
            _fmt(cpu.get(k), 0)
            for k in (
                "relay0_us_per_tx",
                "relay1_us_per_tx",
                "relay2_us_per_tx",
                "client_us_per_tx",
            )
        )
        table.add_row(
            f"{r['value_bytes']} B",
            str(r["window"]),
            _fmt(r["tx_per_s"], 0),
            str(r["failed"]),
            _fmt(b.get("msgs_per_s"), 0),
            _fmt(_ratio(r["tx_per_s"], b.get("msgs_per_s")), 3),
            cpu_text,
            _fmt(r["mesh_frames_per_tx"], 2),
        )
    console.print(table)

    base_l = {(b["value_bytes"], b["mode"]): b for b in report["baseline"]["latency"]}
    table = Table(
        title="latency ms, p50 / p99 (relay: produce->commit, produce->delivery "
        "on relay 1; baseline: PUB->SUB one way)"
    )
    for name in (
        "value",
        "load",
        "relay commit",
        "relay delivery",
        "baseline one-way",
        "commit ratio p50/p99",
        "achieved tx/s",
        "mesh frames/tx",
    ):
        table.add_column(name, justify="right")
    for r in report["relay"]["latency"]:
        b = base_l.get((r["value_bytes"], r["mode"]), {})
        bw = b.get("one_way_ms", {})
        cm, dm = r["commit_ms"], r["delivery_ms"]
        load = "1 in flight" if r["mode"] == "one_in_flight" else f"{r['rate_tx_s']} tx/s"
        table.add_row(
            f"{r['value_bytes']} B",
            load,
            f"{_fmt(cm['p50'], 3)} / {_fmt(cm['p99'], 3)}",
            f"{_fmt(dm['p50'], 3)} / {_fmt(dm['p99'], 3)}",
            f"{_fmt(bw.get('p50'), 3)} / {_fmt(bw.get('p99'), 3)}",
            f"{_fmt(_ratio(cm['p50'], bw.get('p50')), 1)} / "
            f"{_fmt(_ratio(cm['p99'], bw.get('p99')), 1)}",
            _fmt(r["achieved_tx_s"], 0),
            _fmt(r["mesh_frames_per_tx"], 1),
        )
    console.print(table)

    table = Table(title="targets (reported, not asserted)")
    for name in ("target", "goal", "measured", "met"):
        table.add_column(name)
    for t in report["targets"]:
        met = "-" if t["met"] is None else ("[green]yes[/green]" if t["met"] else "[red]no[/red]")
        table.add_row(t["target"], _fmt(t["goal"]), _fmt(t["measured"], 3), met)
    console.print(table)

    for who, prof in (report.get("profile") or {}).items():
        if prof.get("stages"):
            table = Table(title=f"profile {who}: where the loop's time goes (cumulative)")
            for name in ("stage", "calls", "cum s", "of busy loop"):
                table.add_column(name, justify="left" if name == "stage" else "right")
            for row in prof["stages"]:
                table.add_row(
                    row["stage"],
                    str(row["calls"]),
                    f"{row['cumtime_s']:.3f}",
                    f"{100 * row['share_of_busy']:.1f}%",
                )
            console.print(table)
        table = Table(title=f"profile {who}: {prof['run']} (top by own time)")
        for name in ("function", "calls", "own s", "cum s", "of busy"):
            table.add_column(name, justify="left" if name == "function" else "right")
        for row in prof["top_by_own_time"]:
            table.add_row(
                row["function"],
                str(row["calls"]),
                f"{row['tottime_s']:.3f}",
                f"{row['cumtime_s']:.3f}",
                f"{100 * row['share_of_busy']:.1f}%",
            )
        console.print(table)


def run_cli(
    *,
    duration_s: float | None,
    sizes: tuple[int, ...],
    windows: tuple[int, ...] | None = None,
    rate_tx_s: int = DEFAULT_RATE_TX_S,
    quick: bool,
    as_json: bool,
    profile: bool,
    security: bool = False,
    metrics: bool = False,
    rounds: int = 1,
    peers: str | None = None,
    hops: bool = False,
    memory: bool = False,
    memory_rate_tx_s: int | None = None,
    buffer_mib: int | None = None,
) -> int:
    """The `relay bench` command: 0 when every run produced figures, 1 otherwise."""
    from relay.tools.nats_peer import NatsUnavailable

    if duration_s is None and memory:
        duration_s = QUICK_MEMORY_DURATION_S if quick else DEFAULT_MEMORY_DURATION_S
    if duration_s is None:
        duration_s = QUICK_DURATION_S if quick else DEFAULT_DURATION_S
    if windows is None:  # each mode's own shapes
        windows = PEER_WINDOWS if peers is not None else DEFAULT_WINDOWS
    options = BenchOptions(duration_s, sizes, windows, rate_tx_s, quick, profile, rounds)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        if memory:
            from relay.tools import membench

            rate = memory_rate_tx_s or membench.DEFAULT_RATE_TX_S
            mib = buffer_mib or membench.DEFAULT_BUFFER_MIB
            report = membench.run_memory(duration_s, rate, sizes[0], mib, log=log)
            if as_json:
                print(json.dumps(report, indent=2, sort_keys=True))
            else:
                membench.print_memory_report(report)
            return 0 if report["samples"] else 1
        if hops:
            from relay.tools.hops import print_hops_report, run_hops

            report = run_hops(options, log=log)
            if as_json:
                print(json.dumps(report, indent=2, sort_keys=True))
            else:
                print_hops_report(report)
            return 0 if report["traced"] > 0 else 1
        if peers is not None:
            report = run_peers(options, log=log)
        elif security or metrics:
            report = run_comparison(options, SECURITY if security else METRICS, log=log)
        else:
            report = run(options, log=log)
    except MeshError as e:
        print(f"error: the mesh did not start: {e}", file=sys.stderr)
        return 1
    except NatsUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:  # `--buffer-mib`: a bound the limits refuse
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True))
    elif peers is not None:
        print_peers_report(report)
    elif security or metrics:
        print_comparison_report(report)
    else:
        print_report(report)
    sides: tuple[str, ...] = ("relay",)
    if peers is not None:
        sides = PEER_SIDES
    elif security or metrics:
        sides = tuple(report["sides"])
    ok = all(
        r["committed"] > 0
        for side in sides
        for r in (*report[side]["throughput"], *report[side]["latency"])
    )
    return 0 if ok else 1
