"""Spark ingest + snapshot against the pyarrow baseline, side by side, and DuckDB's fold.

    .venv/bin/python scripts/bench_store.py --records 100000,1000000 [--streams 4]
        [--engines baseline,pool,spark] [--workers 2] [--stage-times] [--workdir DIR]

Engines: `baseline` (pyarrow, one process: one core), `pool` (the same tasks in a pool of
--workers processes: as many cores as Spark's `local[--workers]`), `spark`. After them,
DuckDB folds the baseline store's records into snapshot rows (DuckDB reads the records,
pyarrow expands the change lists, DuckDB's window function keeps the last change per key),
timed beside the engines' snapshots and checked against them.

For each size: generate N committed records (correct chains) over --streams streams and
write the spools of --relays relays (every relay holds every record, segment boundaries
shifted so segments of different relays overlap), made and written in chunks so memory
stays bounded at any size; then build a fresh store with each engine (ingest, then
snapshot) and print the time, tx/s, the CPU time and peak memory of this process and its
children (the JVM, the Python workers), the share of the time in which some task on the
machine waited for a CPU ("CPU stall": the machine is shared) and the ratio. With
--repeat N the engines alternate N times and the best time of each is compared. The
stores must end at the generated chains' last points, with the same snapshots (checked).
The Spark session is started once, before the timings. --stage-times writes Spark's event
log and prints each job's stages: wall time, tasks, summed task time, input and shuffle
bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from relay.store.ingest import ingest
from relay.store.reader import StoreReader
from relay.store.snapshot import snapshot
from relay.store.spark import get_session
from relay.tools import store_baseline
from relay.tools.synthetic import generate, write_spools, write_spools_in_chunks

ENGINES = ("baseline", "pool", "spark")
# How often the memory sampler sums the resident memory of this process tree.
MEMORY_SAMPLE_S = 0.25
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
WARM_UP_STREAMS = 8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", default="100000,1000000", help="comma-separated sizes")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--relays", type=int, default=3)
    parser.add_argument("--segment-records", type=int, default=50_000)
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated")
    parser.add_argument("--repeat", type=int, default=1, help="runs per engine, best kept")
    parser.add_argument("--workers", type=int, default=2, help="processes of `pool`")
    parser.add_argument("--master", default=None, help="default local[--workers]")
    parser.add_argument("--stage-times", action="store_true", help="print Spark's stages")
    parser.add_argument("--workdir", default=None, help="kept if given; else a temp dir")
    parser.add_argument(
        "--reuse-spools", action="store_true", help="use the spools a run left in --workdir"
    )
    args = parser.parse_args(argv)
    args.master = args.master or f"local[{args.workers}]"
    sizes = [int(s) for s in args.records.split(",") if s]
    engines = [e for e in args.engines.split(",") if e]
    if not set(engines) <= set(ENGINES):
        parser.error(f"--engines: choose from {', '.join(ENGINES)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="relay-bench-store-"))
    workdir.mkdir(parents=True, exist_ok=True)
    events = None
    extra_config = {}
    if args.stage_times:
        events = workdir / "spark-events"
        shutil.rmtree(events, ignore_errors=True)
        events.mkdir(parents=True)
        extra_config = {
            "spark.eventLog.enabled": "true",
            "spark.eventLog.dir": events.as_uri(),
            "spark.eventLog.compress": "false",
            "spark.eventLog.rolling.enabled": "false",  # one file to follow
        }
    started = time.perf_counter()
    spark = get_session(args.master, app_name="relay-bench-store", extra_config=extra_config)
    print(f"spark session ({args.master}) started in {time.perf_counter() - started:.1f} s")
    stages = StageLog(events) if events else None
    # One small run first: JVM warm-up and Python worker start are paid once per session.
    started = time.perf_counter()
    _warm_up(spark, workdir / "warm-up")
    print(f"warm-up run (1000 records) took {time.perf_counter() - started:.1f} s")
    if stages:
        stages.read_new()  # skip the warm-up's stages
    failed = False
    try:
        for size in sizes:
            failed |= not _bench(spark, size, args, engines, workdir / f"n{size}", stages)
    finally:
        spark.stop()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


def _warm_up(spark: object, folder: Path) -> None:
    # Several streams, so that every core's Python worker starts (and imports) here.
    streams = [generate(f"warm-up-{i}", 1000, seed=i) for i in range(WARM_UP_STREAMS)]
    write_spools(str(folder / "spool"), streams, segment_records=300)
    ingest(spark, str(folder / "spool"), str(folder / "store"))
    snapshot(spark, str(folder / "store"))
    shutil.rmtree(folder, ignore_errors=True)


def _bench(
    spark: object,
    size: int,
    args: argparse.Namespace,
    engines: list[str],
    folder: Path,
    stages: StageLog | None,
) -> bool:
    spool = folder / "spool"
    points_file = folder / "spool-points.json"  # the generated chains' last points
    started = time.perf_counter()
    per_stream = size // args.streams
    if args.reuse_spools and points_file.exists():
        saved = json.loads(points_file.read_text())
        expected = {name: (seq, bytes.fromhex(digest)) for name, (seq, digest) in saved.items()}
        segments = sum(1 for _ in spool.rglob("*.parquet"))
    else:
        shutil.rmtree(folder, ignore_errors=True)
        segments, expected = write_spools_in_chunks(
            str(spool),
            {f"stream-{i}": per_stream for i in range(args.streams)},
            relays=args.relays,
            segment_records=args.segment_records,
        )
        points_file.write_text(
            json.dumps({name: (seq, digest.hex()) for name, (seq, digest) in expected.items()})
        )
    spool_bytes = sum(p.stat().st_size for p in spool.rglob("*.parquet"))
    total = per_stream * args.streams
    print(
        f"\n{total} records, {args.streams} streams, {args.relays} relays: {segments} "
        f"segments ({spool_bytes / 2**20:.0f} MiB) generated and written in "
        f"{time.perf_counter() - started:.1f} s"
    )

    timings: dict[str, tuple[float, float, float, float]] = {}
    for _run in range(args.repeat):  # engines alternate: both see the same machine load
        for engine in engines:
            store = folder / f"store-{engine}"
            shutil.rmtree(store, ignore_errors=True)
            pressure_start = _cpu_pressure_total_us()
            with ProcessTreeMeter() as meter:
                started = time.perf_counter()
                if engine == "spark":
                    ingest(spark, str(spool), str(store))
                    ingested = time.perf_counter()
                    snapshot(spark, str(store))
                else:
                    workers = args.workers if engine == "pool" else 1
                    store_baseline.ingest_baseline(str(spool), str(store), workers=workers)
                    ingested = time.perf_counter()
                    store_baseline.snapshot_baseline(str(store), workers=workers)
                done = time.perf_counter()
            ingest_s, snapshot_s, total_s = ingested - started, done - ingested, done - started
            stalled = (_cpu_pressure_total_us() - pressure_start) / 1e6 / total_s
            if engine not in timings or total_s < timings[engine][2]:
                timings[engine] = (ingest_s, snapshot_s, total_s, meter.cpu_s)
            print(
                f"  {engine:8}  ingest {ingest_s:7.1f} s  snapshot {snapshot_s:6.1f} s  "
                f"total {total_s:7.1f} s  {total / total_s:9.0f} tx/s  "
                f"CPU {meter.cpu_s:6.1f} s  peak memory {meter.peak_bytes / 2**30:.1f} GiB  "
                f"CPU stall {stalled:4.0%}"
            )
            if engine == "spark" and stages:
                stages.print_new()
    best = "best of each" if args.repeat > 1 else "one run each"
    if "spark" in timings:
        for other in ("baseline", "pool"):
            if other in timings:
                spark_t, other_t = timings["spark"], timings[other]
                print(
                    f"  spark / {other} ({best}): time {spark_t[2] / other_t[2]:.2f}x "
                    f"(ingest {spark_t[0] / other_t[0]:.2f}x, snapshot "
                    f"{spark_t[1] / other_t[1]:.2f}x), CPU {spark_t[3] / other_t[3]:.2f}x"
                )
    if "baseline" in engines:
        fold_s, sql_s, cpu_s, same = _duckdb_fold(folder / "store-baseline", args.workers)
        snapshots = ", ".join(f"{e} {t[1]:.1f} s" for e, t in timings.items())
        print(
            f"  duckdb fold ({args.workers} threads): {fold_s:.1f} s of which the SQL fold "
            f"{sql_s:.1f} s, CPU {cpu_s:.1f} s; the engines' snapshots: {snapshots}; "
            f"{'same rows as' if same else 'FAILED: other rows than'} the baseline's snapshots"
        )
        if not same:
            return False

    stores = [folder / f"store-{engine}" for engine in engines]
    for store in stores:
        points = {name: (p.seq, p.digest) for name, p in StoreReader(store).last_points().items()}
        if points != expected:
            print(f"  FAILED: {store.name} does not end at the generated chains' last points")
            return False
    if len(stores) == 2 and not _same_result(*stores):
        print("  FAILED: the stores' snapshots differ")
        return False
    print("  the stores end at the generated chains' last points with equal snapshots")
    return True


def _duckdb_fold(store: Path, threads: int) -> tuple[float, float, float, bool]:
    """DuckDB's fold of every stream of `store` into snapshot rows: total and SQL seconds,
    CPU seconds, and whether the rows equal the store's snapshots."""
    import duckdb
    import pyarrow as pa  # type: ignore[import-untyped]

    from relay.store.plan import CHANGE_SCHEMA, expand_changes
    from relay.store.tables import load_store

    connection = duckdb.connect()
    connection.execute(f"SET threads = {threads}")
    reader = StoreReader(store)
    same = True
    sql_s = 0.0
    cpu_start = time.process_time()
    started = time.perf_counter()
    for stream, state in load_store(store, digests=False).streams.items():
        files = [str(store / f.path) for f in state.files]
        records = connection.sql(
            "SELECT stream, seq, key, value, kind FROM read_parquet($files) WHERE NOT duplicate",
            params={"files": files},
        ).to_arrow_reader(64 * 1024)
        changes = pa.Table.from_batches((expand_changes(b) for b in records), CHANGE_SCHEMA)
        connection.register("changes", changes)
        sql_started = time.perf_counter()
        live = connection.sql(
            "SELECT entity, key, value, seq FROM changes QUALIFY row_number() OVER "
            "(PARTITION BY entity, key ORDER BY seq DESC, change_index DESC) = 1 AND op = 0"
        ).to_arrow_table()
        connection.unregister("changes")
        sql_s += time.perf_counter() - sql_started
        order = [("entity", "ascending"), ("key", "ascending")]
        stored = reader.snapshot(stream)
        got = pa.table(live).sort_by(order)
        same &= stored is not None and stored.rows.sort_by(order).equals(
            got.cast(stored.rows.schema)
        )
    return time.perf_counter() - started, sql_s, time.process_time() - cpu_start, same


def _same_result(left: Path, right: Path) -> bool:
    a, b = StoreReader(left), StoreReader(right)
    if a.last_points() != b.last_points():
        return False
    for stream in a.streams():
        snap_a, snap_b = a.snapshot(stream), b.snapshot(stream)
        if snap_a is None or snap_b is None:
            return False
        order = [("entity", "ascending"), ("key", "ascending")]
        if (snap_a.seq, snap_a.digest) != (snap_b.seq, snap_b.digest) or not snap_a.rows.sort_by(
            order
        ).equals(snap_b.rows.sort_by(order)):
            return False
    return True


class ProcessTreeMeter:
    """The peak resident memory and the CPU time of this process and all its descendants
    (the JVM, the Python workers) while in use. The machine is shared: CPU seconds show
    the work done whatever the wall time lost to other loads."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> ProcessTreeMeter:
        self._cpu_start_s = _tree_usage(os.getpid())[1]
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        cpu_end_s = _tree_usage(os.getpid())[1]
        # A process that ended meanwhile (an idle Python worker) is left out, not negative.
        self.cpu_s = sum(
            cpu_s - self._cpu_start_s.get(pid, 0.0) for pid, cpu_s in cpu_end_s.items()
        )

    def _sample(self) -> None:
        while True:
            self.peak_bytes = max(self.peak_bytes, _tree_usage(os.getpid())[0])
            if self._stop.wait(MEMORY_SAMPLE_S):
                return


def _cpu_pressure_total_us() -> int:
    """Microseconds in which some runnable task on the machine waited for a CPU (Linux PSI;
    0 where unavailable): how much other loads stood in the way."""
    try:
        with open("/proc/pressure/cpu") as pressure:
            some = pressure.readline().split()
    except OSError:
        return 0
    return int(some[-1].split("=")[1])


def _tree_usage(root: int) -> tuple[int, dict[int, float]]:
    """The resident bytes of `root` and its descendants, and the CPU seconds of each
    (including its reaped children)."""
    children: dict[int, list[int]] = {}
    usage: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1]: ppid
        # utime, stime, cutime, cstime (clock ticks); rss (pages)
        ticks = sum(int(f) for f in fields[11:15])
        usage[pid] = (int(fields[21]), ticks)
    rss_pages, todo = 0, [root]
    cpu_s: dict[int, float] = {}
    while todo:
        pid = todo.pop()
        if pid in usage:
            pid_rss, pid_ticks = usage[pid]
            rss_pages += pid_rss
            cpu_s[pid] = pid_ticks / CLOCK_TICKS_PER_S
        todo.extend(children.get(pid, []))
    return rss_pages * PAGE_BYTES, cpu_s


class StageLog:
    """Reads Spark's event log as it grows and prints the jobs and stages it finished."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.offset = 0
        self.jobs: dict[int, dict[str, Any]] = {}

    def read_new(self) -> list[dict[str, Any]]:
        [log] = [p for p in self.folder.iterdir() if p.is_file()]
        with open(log) as source:
            source.seek(self.offset)
            text = source.read()
        complete = text[: text.rfind("\n") + 1]
        self.offset += len(complete.encode())
        return [json.loads(line) for line in complete.splitlines() if line]

    def print_new(self) -> None:
        stage_rows = {}
        job_rows = []
        for event in self.read_new():
            kind = event["Event"]
            if kind == "SparkListenerJobStart":
                description = event.get("Properties", {}).get("spark.job.description", "")
                self.jobs[event["Job ID"]] = {
                    "start": event["Submission Time"],
                    "stages": event["Stage IDs"],
                    "description": description,
                }
            elif kind == "SparkListenerJobEnd":
                job = self.jobs[event["Job ID"]]
                job_rows.append((event["Job ID"], job, event["Completion Time"] - job["start"]))
            elif kind == "SparkListenerStageCompleted":
                info = event["Stage Info"]
                metrics = {a["Name"]: a.get("Value") for a in info.get("Accumulables", [])}
                stage_rows[info["Stage ID"]] = (info, metrics)
        for job_id, job, wall_ms in job_rows:
            print(f"    job {job_id} {job['description'] or ''}: {wall_ms / 1000:.1f} s")
            for stage_id in job["stages"]:
                if stage_id not in stage_rows:
                    continue  # skipped (its output was reused)
                info, metrics = stage_rows[stage_id]
                wall_s = (info["Completion Time"] - info["Submission Time"]) / 1000
                run_s = _metric(metrics, "internal.metrics.executorRunTime") / 1000
                cpu_s = _metric(metrics, "internal.metrics.executorCpuTime") / 1e9
                input_mib = _metric(metrics, "internal.metrics.input.bytesRead") / 2**20
                written_mib = (
                    _metric(metrics, "internal.metrics.shuffle.write.bytesWritten") / 2**20
                )
                read_mib = (
                    _metric(metrics, "internal.metrics.shuffle.read.localBytesRead")
                    + _metric(metrics, "internal.metrics.shuffle.read.remoteBytesRead")
                ) / 2**20
                name = info["Stage Name"].split(" at ")[0]
                print(
                    f"      stage {stage_id} {name:14} {wall_s:6.1f} s wall  "
                    f"{info['Number of Tasks']:4} tasks  task time {run_s:6.1f} s "
                    f"(JVM CPU {cpu_s:5.1f} s)  input {input_mib:6.0f} MiB  "
                    f"shuffle write {written_mib:5.0f} MiB read {read_mib:5.0f} MiB"
                )


def _metric(metrics: dict[str, Any], name: str) -> float:
    value = metrics.get(name)
    return float(value) if value is not None else 0.0


if __name__ == "__main__":
    sys.exit(main())
