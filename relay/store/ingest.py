"""Ingest: append the relays' spooled segments to the store (a PySpark job).

    python -m relay.store.ingest SPOOL_ROOT STORE [--master local[2]]
    spark-submit relay/store/ingest.py SPOOL_ROOT STORE

1. List the closed segments of every relay; skip those the store lists as ingested, and
   read the others (only their records above the stream's last stored seq).
2. Range-partition the records on (stream, seq) and sort each range by (stream, seq,
   relay): every copy of a (stream, seq) lands in one task, next to each other.
3. Each task (`chaincheck.check_and_write`, in `mapInArrow`) keeps one copy per seq,
   checks that all relays agree on its digest, recomputes the chain inside its range with
   `relay.core.digest`, and writes its verified rows to Parquet in the run's staging
   folder. It returns one small summary row per stream: no record goes to the driver.
4. The driver stitches the ranges of each stream to the store's last point
   (`chaincheck.stitch`), moves the verified files into `data/` and commits the next
   manifest: the records, the new last points and the ingested segments at once.

A stream with a problem (relays disagree on a digest, or the chain breaks) keeps its
verified records up to the problem; nothing at or after it is written; the job raises
IngestFailed naming stream, seq and relays (exit status 2 from the command line).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from functools import reduce
from pathlib import Path
from typing import Any

from relay.store import chaincheck
from relay.store.errors import IngestFailed, StoreError
from relay.store.manifest import load_manifest, new_run, vacuum
from relay.store.plan import BeforeCommit, IngestResult, finish_ingest, plan_ingest
from relay.store.spark import DEFAULT_MASTER, SEGMENT_DDL, SUMMARY_DDL, get_session, parallelism

log = logging.getLogger("relay.store.ingest")

# Compressed segment bytes per range task: big enough to amortise a task, small enough
# for its sort to stay in memory on a small machine.
RANGE_INPUT_BYTES = 48 * 1024 * 1024
# Up to this many streams the "above the last stored seq" filter is one expression;
# beyond it, a broadcast join with the streams' last points.
FILTER_EXPRESSION_MAX_STREAMS = 256


def ingest(
    spark: Any,
    spool_root: str,
    store_path: str,
    *,
    before_commit: BeforeCommit | None = None,
) -> IngestResult:
    """Append every new closed segment under `spool_root` to the store at `store_path`.
    Raises IngestFailed (after committing the verified part) on a chain problem."""
    from pyspark.sql import functions as F

    Path(store_path).mkdir(parents=True, exist_ok=True)
    vacuum(store_path)  # leftovers of a crashed run
    manifest = load_manifest(store_path)
    plan = plan_ingest(spool_root, manifest)
    _run, staging = new_run(store_path)
    summaries: list[dict[str, object]] = []
    if plan.to_read:
        records = spark.read.schema(SEGMENT_DDL).parquet(*[s.path for s in plan.to_read])
        records = _above_stored(spark, records, plan.start)
        input_bytes = sum(s.size_bytes for s in plan.to_read)
        ranges = max(parallelism(spark), math.ceil(input_bytes / RANGE_INPUT_BYTES))
        staging_dir = str(staging)

        def check_range(batches: Any) -> Any:
            return chaincheck.check_and_write(batches, staging_dir)

        checked = (
            records.repartitionByRange(ranges, F.col("stream"), F.col("seq"))
            .sortWithinPartitions("stream", "seq", "relay")
            .mapInArrow(check_range, SUMMARY_DDL)
        )
        summaries = [_plain(row.asDict()) for row in checked.collect()]
    return finish_ingest(store_path, plan, summaries, staging, before_commit)


def _above_stored(spark: Any, records: Any, start: dict[str, tuple[int, bytes]]) -> Any:
    from pyspark.sql import functions as F

    if len(start) <= FILTER_EXPRESSION_MAX_STREAMS:
        conditions = [
            (F.col("stream") == stream) & (F.col("seq") > last_seq)
            for stream, (last_seq, _digest) in start.items()
        ]
        return records.where(reduce(lambda a, b: a | b, conditions))
    points = spark.createDataFrame(
        [(stream, last_seq) for stream, (last_seq, _digest) in start.items()],
        "stream STRING, stored_seq BIGINT",
    )
    return (
        records.join(F.broadcast(points), "stream")
        .where(F.col("seq") > F.col("stored_seq"))
        .drop("stored_seq")
    )


def _plain(row: dict[str, object]) -> dict[str, object]:
    """Spark hands binary columns back as bytearray."""
    return {k: bytes(v) if isinstance(v, bytearray) else v for k, v in row.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relay.store.ingest", description=__doc__.split("\n")[0])
    parser.add_argument("spool_root")
    parser.add_argument("store")
    parser.add_argument("--master", default=DEFAULT_MASTER, help="ignored under spark-submit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    spark = get_session(args.master, app_name="relay-store-ingest")
    try:
        result = ingest(spark, args.spool_root, args.store)
    except IngestFailed as error:
        print(f"ingest FAILED: {error}", file=sys.stderr)
        return 2
    except StoreError as error:
        print(f"ingest FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
    print(
        f"ingest: {result.records_added} records from {result.segments_read} segments, "
        f"manifest version {result.version}"
    )
    for stream, (seq, digest) in sorted(result.streams.items()):
        print(f"  {stream}: last seq {seq} digest {digest.hex()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
