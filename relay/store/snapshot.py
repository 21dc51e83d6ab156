"""Snapshot: per stream, the last value of every (entity type, key) as of a seq, deletes
removed (a PySpark job), run by `relay store snapshot --config TOPOLOGY [--stream S
[--as-of SEQ]]` (relay.storecmd; docs/store.md 4).

Incremental: the new snapshot is the previous one plus the changes of the records after
it (`plan.plan_snapshot` picks only the record files that hold them). Map side: one task
per record file reads it (only the seqs after the previous snapshot), expands the changes
(`plan.expand_changes`) and folds them to the last change of each (stream, entity, key) by
(seq, index in its transaction), deletes kept. Reduce side: hash-partitioned by (stream,
entity, key) with the previous snapshot's rows, folded again, deleted keys dropped, and
each task writes its rows per stream to Parquet; the driver creates each stream's snapshot
table from them, named by the snapshot's seq, with that seq and the stored digest there in
its commit (relay.store.tables).
"""

from __future__ import annotations

from collections.abc import Collection
from functools import partial, reduce
from typing import Any

from relay.store.changes import Op
from relay.store.location import Folder, StoreArg, StoreLocation
from relay.store.plan import (
    BeforeCommit,
    expand_and_fold_files,
    finish_snapshot,
    fold_and_write,
    plan_snapshot,
)
from relay.store.spark import (
    CHANGE_DDL,
    SNAPSHOT_DDL,
    SNAPSHOT_WRITE_DDL,
    parallelism,
    read_store_files,
)
from relay.store.tables import SnapshotInfo, load_store, new_run, writing

# The map tasks: a record file and the seqs of it the snapshot takes.
DELTA_TASK_DDL = "path STRING, after_seq BIGINT, upto_seq BIGINT"


def snapshot(
    spark: Any,
    store_path: StoreArg,
    *,
    as_of: dict[str, int] | None = None,
    streams: Collection[str] | None = None,
    before_commit: BeforeCommit | None = None,
    lock_wait_s: float = 0.0,
) -> dict[str, SnapshotInfo]:
    """Build the snapshot of every stream (of `streams`, if given) as of its last stored
    seq (as of `as_of[stream]` if given), unless it has one there. Returns the new
    snapshots by stream."""
    with writing(store_path, "snapshot", lock_wait_s) as location:
        return _snapshot(spark, location, as_of, streams, before_commit)


def _snapshot(
    spark: Any,
    location: StoreLocation,
    as_of: dict[str, int] | None,
    streams: Collection[str] | None,
    before_commit: BeforeCommit | None,
) -> dict[str, SnapshotInfo]:
    from pyspark.sql import functions as F

    targets = plan_snapshot(location, load_store(location), as_of, streams)
    if not targets:
        return {}
    _run, staging = new_run(location)
    parts = []
    # One map task per record file: it reads the file itself (only the delta's seqs).
    delta_files = [(f.path, t.base_seq, t.seq) for t in targets for f in t.delta_files]
    if delta_files:
        tasks = spark.createDataFrame(
            spark.sparkContext.parallelize(delta_files, len(delta_files)), DELTA_TASK_DDL
        )
        parts.append(tasks.mapInArrow(partial(expand_and_fold_files, location), CHANGE_DDL))
    base_paths = [p for t in targets if t.base for p in t.base.files]
    if base_paths:
        base = read_store_files(spark, location, base_paths, SNAPSHOT_DDL).select(
            "stream",
            "entity",
            "key",
            F.lit(int(Op.PUT)).cast("tinyint").alias("op"),
            "value",
            "seq",
            F.lit(0).alias("change_index"),
        )
        parts.append(base)
    changes = reduce(lambda a, b: a.unionByName(b), parts)
    folder = Folder(location, staging)

    def write_rows(batches: Any) -> Any:
        return fold_and_write(batches, folder)

    spark.sparkContext.setJobDescription(f"snapshot {len(delta_files)} record files")
    written = [
        row.asDict()
        for row in changes.repartition(parallelism(spark), "stream", "entity", "key")
        .mapInArrow(write_rows, SNAPSHOT_WRITE_DDL)
        .collect()
    ]
    spark.sparkContext.setJobDescription(None)
    return finish_snapshot(location, targets, written, staging, before_commit)
