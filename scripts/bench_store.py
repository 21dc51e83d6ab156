"""Spark ingest + snapshot against the single-process pyarrow baseline, side by side.

    .venv/bin/python scripts/bench_store.py --records 100000,1000000 [--streams 4]

For each size: generate N committed records (correct chains) over --streams streams,
write the spools of --relays relays (every relay holds every record, segment boundaries
shifted so segments of different relays overlap), then build a fresh store with each
engine (ingest, then snapshot) and print the time, tx/s and the ratio. Both stores must
end at the same points with the same snapshots (checked). The Spark session is started
once, before the timings.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from relay.store import baseline
from relay.store.ingest import ingest
from relay.store.reader import StoreReader
from relay.store.snapshot import snapshot
from relay.store.spark import get_session
from relay.store.synthetic import generate, write_spools


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", default="100000,1000000", help="comma-separated sizes")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--relays", type=int, default=3)
    parser.add_argument("--segment-records", type=int, default=50_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--workdir", default=None, help="kept if given; else a temp dir")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.records.split(",") if s]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="relay-bench-store-"))
    started = time.perf_counter()
    spark = get_session(args.master, app_name="relay-bench-store")
    print(f"spark session ({args.master}) started in {time.perf_counter() - started:.1f} s")
    # One small run first: JVM warm-up and Python worker start are paid once per session.
    started = time.perf_counter()
    _warm_up(spark, workdir / "warm-up")
    print(f"warm-up run (1000 records) took {time.perf_counter() - started:.1f} s")
    failed = False
    try:
        for size in sizes:
            failed |= not _bench(spark, size, args, workdir / f"n{size}")
    finally:
        spark.stop()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


def _warm_up(spark: object, folder: Path) -> None:
    write_spools(str(folder / "spool"), [generate("warm-up", 1000)], segment_records=300)
    ingest(spark, str(folder / "spool"), str(folder / "store"))
    snapshot(spark, str(folder / "store"))
    shutil.rmtree(folder, ignore_errors=True)


def _bench(spark: object, size: int, args: argparse.Namespace, folder: Path) -> bool:
    shutil.rmtree(folder, ignore_errors=True)
    spool = folder / "spool"
    started = time.perf_counter()
    per_stream = size // args.streams
    streams = [generate(f"stream-{i}", per_stream, seed=i) for i in range(args.streams)]
    generated_s = time.perf_counter() - started
    started = time.perf_counter()
    segments = write_spools(
        str(spool), streams, relays=args.relays, segment_records=args.segment_records
    )
    spool_bytes = sum(p.stat().st_size for p in spool.rglob("*.parquet"))
    written_s = time.perf_counter() - started
    total = per_stream * args.streams
    print(
        f"\n{total} records, {args.streams} streams, {args.relays} relays: generated in "
        f"{generated_s:.1f} s, {segments} segments ({spool_bytes / 2**20:.0f} MiB) written "
        f"in {written_s:.1f} s"
    )

    timings = {}
    for engine in ("baseline", "spark"):
        store = folder / f"store-{engine}"
        started = time.perf_counter()
        if engine == "spark":
            ingest(spark, str(spool), str(store))
            ingested = time.perf_counter()
            snapshot(spark, str(store))
        else:
            baseline.ingest_baseline(str(spool), str(store))
            ingested = time.perf_counter()
            baseline.snapshot_baseline(str(store))
        done = time.perf_counter()
        timings[engine] = (ingested - started, done - ingested, done - started)
        ingest_s, snapshot_s, total_s = timings[engine]
        print(
            f"  {engine:8}  ingest {ingest_s:7.1f} s  snapshot {snapshot_s:6.1f} s  "
            f"total {total_s:7.1f} s  {total / total_s:9.0f} tx/s"
        )
    ratio = timings["spark"][2] / timings["baseline"][2]
    print(f"  spark / baseline time: {ratio:.2f}x")

    same = _same_result(folder / "store-spark", folder / "store-baseline")
    expected = {s.stream: (s.seqs[-1], s.digests[-1]) for s in streams}
    points = {
        name: (p.seq, p.digest)
        for name, p in StoreReader(folder / "store-spark").last_points().items()
    }
    if points != expected or not same:
        print("  FAILED: the stores differ from each other or from the generated chains")
        return False
    print("  both stores end at the generated chains' last points with equal snapshots")
    return True


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


if __name__ == "__main__":
    sys.exit(main())
