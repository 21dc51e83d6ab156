"""Ingest: append the relays' spooled segments to the store (a PySpark job), run by
`relay store ingest --config TOPOLOGY` (relay.storecmd; docs/store.md 4).

1. List the closed segments of every relay; skip those the store lists as ingested.
2. Cut each stream's new records (above its last stored seq) into seq ranges at segment
   ends (`plan.plan_ranges`). A segment's name gives its first and last seq, so the
   driver knows, without reading anything, which segments of which relays hold a range:
   the copies of a seq meet in one task without a shuffle.
3. Spark runs one task per range (`chaincheck.check_segment_range`): it reads `seq` and
   `digest` of every copy and the other columns of the stored copy only, checks that all
   relays agree on each digest, recomputes the chain inside the range with
   `relay.core.digest`, and writes its verified rows to Parquet in the run's staging
   folder. It returns one small summary row: no record goes to the driver.
4. The driver stitches the ranges of each stream to the store's last point
   (`chaincheck.stitch`) and commits each stream's verified files to its records table
   in one Delta transaction (relay.store.tables).

A stream with a problem (relays disagree on a digest, or the chain breaks) keeps its
verified records up to the problem; nothing at or after it is written; the job raises
IngestFailed naming stream, seq and relays (exit status 2 from the command).
"""

from __future__ import annotations

from typing import Any

from relay.store.location import Folder, StoreArg, StoreLocation
from relay.store.plan import (
    BeforeCommit,
    IngestResult,
    check_range,
    finish_ingest,
    plan_ingest,
    plan_ranges,
    range_bytes_for,
)
from relay.store.spark import parallelism
from relay.store.tables import load_store, new_run, writing


def ingest(
    spark: Any,
    spool_root: str,
    store_path: StoreArg,
    *,
    before_commit: BeforeCommit | None = None,
    lock_wait_s: float = 0.0,
) -> IngestResult:
    """Append every new closed segment under `spool_root` to the store at `store_path`.
    Raises IngestFailed (after committing the verified part) on a chain problem, and
    StoreLocked if another job holds the store after `lock_wait_s`."""
    with writing(store_path, "ingest", lock_wait_s) as location:
        return _ingest(spark, spool_root, location, before_commit)


def _ingest(
    spark: Any, spool_root: str, location: StoreLocation, before_commit: BeforeCommit | None
) -> IngestResult:
    plan = plan_ingest(spool_root, load_store(location))
    run, staging = new_run(location)
    summaries: list[dict[str, object]] = []
    if plan.to_read:
        ranges = plan_ranges(plan, range_bytes_for(plan.input_bytes, parallelism(spark)))
        folder = Folder(location, staging)

        def check_ranges(tasks: Any) -> Any:
            for task in tasks:
                yield from check_range(task, folder)

        # One partition per range (biggest first); the summaries are the only output.
        tasks = spark.sparkContext.parallelize(ranges, len(ranges))
        spark.sparkContext.setJobDescription(f"ingest {len(ranges)} ranges")
        summaries = tasks.mapPartitions(check_ranges).collect()
        spark.sparkContext.setJobDescription(None)
    return finish_ingest(location, plan, summaries, staging, run, before_commit)
