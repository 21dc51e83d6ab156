"""Verify: re-check every stream's chain in the store end to end (a PySpark job), run by
`relay store verify --config TOPOLOGY` (relay.storecmd; docs/store.md 4).

1. The stored records of all streams are range-partitioned on (stream, seq); each task
   checks the links inside its range (`chaincheck.check_sorted`, writing nothing) and the
   driver stitches the ranges from each stream's genesis digest (after retention: from
   the digest of the snapshot the kept records continue). Every stream must end at the
   last point and record count its records table names, and no two of its files may hold
   the same seq (each seq is stored once).
2. Every snapshot must equal the fold of the snapshot below it and the records in between
   (`plan.plan_snapshot_checks`): one job folds them all, each check's rows apart from the
   others (`plan.check_tag`), and compares the fold with the snapshot's rows both ways.
Raises VerifyFailed listing every problem (exit status 2 from the command).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from relay.store import chaincheck
from relay.store.errors import ChainProblem, VerifyFailed
from relay.store.location import StoreArg, StoreLocation, as_location
from relay.store.plan import (
    SnapshotCheck,
    expand_and_fold_files,
    fold_live,
    plan_snapshot_checks,
    snapshot_difference,
)
from relay.store.spark import (
    CHANGE_DDL,
    RECORD_DDL,
    SNAPSHOT_DDL,
    SUMMARY_DDL,
    parallelism,
    read_store_files,
)
from relay.store.tables import StoreState, load_snapshot, load_store

# Stored bytes per range task.
RANGE_INPUT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Verified:
    points: dict[str, tuple[int, bytes]]  # stream -> (last seq, last digest), checked
    records: dict[str, int]  # stream -> records stored (kept)
    snapshots_checked: int  # each equal to the fold of the records up to its seq
    snapshots_unchecked: int  # at or before the first kept record (their records retired)


# The snapshot-check map tasks: a record file, the seqs of it a check takes, the check.
CHECK_TASK_DDL = "path STRING, after_seq BIGINT, upto_seq BIGINT, tag STRING"


def verify(spark: Any, store_path: StoreArg) -> Verified:
    """Check every stream's chain from its start and every snapshot against the fold of
    the records. Raises VerifyFailed."""
    from pyspark.sql import functions as F

    location = as_location(store_path)
    store = load_store(location)
    files = [f for s in store.streams.values() for f in s.files]
    summaries: list[dict[str, object]] = []
    if files:
        input_bytes = sum(f.size_bytes for f in files)
        ranges = max(parallelism(spark), math.ceil(input_bytes / RANGE_INPUT_BYTES))

        def check_range(batches: Any) -> Any:
            import pyarrow as pa  # type: ignore[import-untyped]

            def discard(stream: str, rows: pa.RecordBatch) -> None:
                pass

            rows = chaincheck.check_sorted(batches, discard)
            yield pa.RecordBatch.from_pylist(rows, schema=chaincheck.SUMMARY_SCHEMA)

        checked = (
            read_store_files(spark, location, [f.path for f in files], RECORD_DDL)
            .withColumn("relay", F.lit(0))
            .repartitionByRange(ranges, F.col("stream"), F.col("seq"))
            .sortWithinPartitions("stream", "seq")
            .mapInArrow(check_range, SUMMARY_DDL)
        )
        summaries = [
            {k: bytes(v) if isinstance(v, bytearray) else v for k, v in row.asDict().items()}
            for row in checked.collect()
        ]
    checks, unchecked = plan_snapshot_checks(location, store)
    differences = _check_snapshots(spark, location, checks) if checks else []
    return judge(location, store, summaries, differences, len(checks), unchecked)


def _check_snapshots(
    spark: Any, location: StoreLocation, checks: list[SnapshotCheck]
) -> list[ChainProblem]:
    """Fold every check in one job and compare with the snapshots' rows both ways."""
    from functools import partial, reduce

    from pyspark.sql import functions as F

    tasks = [
        (f.path, c.base.seq if c.base else -1, c.snapshot.seq, c.tag)
        for c in checks
        for f in c.delta_files
    ]
    parts = []
    if tasks:
        frame = spark.createDataFrame(
            spark.sparkContext.parallelize(tasks, len(tasks)), CHECK_TASK_DDL
        )
        parts.append(frame.mapInArrow(partial(expand_and_fold_files, location), CHANGE_DDL))
    for check in checks:
        if check.base is not None and check.base.files:
            base = read_store_files(spark, location, list(check.base.files), SNAPSHOT_DDL)
            parts.append(
                base.select(
                    F.lit(check.tag).alias("stream"),
                    "entity",
                    "key",
                    F.lit(0).cast("tinyint").alias("op"),
                    "value",
                    "seq",
                    F.lit(0).alias("change_index"),
                )
            )
    columns = ["stream", "entity", "key", "value", "seq"]
    if parts:
        changes = reduce(lambda a, b: a.unionByName(b), parts)
        expected = changes.repartition(parallelism(spark), "stream", "entity", "key").mapInArrow(
            fold_live, SNAPSHOT_DDL
        )
    else:
        expected = spark.createDataFrame([], SNAPSHOT_DDL)
    actual_parts = [
        read_store_files(spark, location, list(c.snapshot.files), SNAPSHOT_DDL)
        .withColumn("stream", F.lit(c.tag))
        .select(*columns)
        for c in checks
        if c.snapshot.files
    ]
    actual = (
        reduce(lambda a, b: a.unionByName(b), actual_parts)
        if actual_parts
        else spark.createDataFrame([], SNAPSHOT_DDL)
    )
    spark.sparkContext.setJobDescription(f"verify {len(checks)} snapshots")
    missing = expected.select(*columns).exceptAll(actual).withColumn("side", F.lit("missing"))
    unexpected = actual.exceptAll(expected.select(*columns)).withColumn("side", F.lit("extra"))
    rows = (
        missing.unionByName(unexpected)
        .groupBy("stream", "side")
        .agg(F.count("*").alias("rows"), F.min(F.struct("entity", "key")).alias("example"))
        .collect()
    )
    spark.sparkContext.setJobDescription(None)
    found: dict[str, dict[str, Any]] = {}
    for row in rows:
        entry = found.setdefault(row["stream"], {"missing": 0, "extra": 0, "example": None})
        entry[row["side"]] = row["rows"]
        example = row["example"]
        entry["example"] = (
            entry["example"] or f"entity {example['entity']!r} key {bytes(example['key'])!r}"
        )
    by_tag = {c.tag: c for c in checks}
    return [
        snapshot_difference(
            by_tag[tag].stream, by_tag[tag].snapshot.seq, e["missing"], e["extra"], e["example"]
        )
        for tag, e in sorted(found.items())
    ]


def judge(
    store_path: StoreArg,
    store: StoreState,
    summaries: list[dict[str, object]],
    snapshot_problems: list[ChainProblem],
    snapshots_checked: int,
    snapshots_unchecked: int,
) -> Verified:
    """Stitch each stream from its genesis (or from the snapshot its kept records continue
    from, after retention) and compare with where its table says it ends; no two files of
    a stream may hold the same seq. Raises VerifyFailed with these problems and
    `snapshot_problems`."""
    by_stream: dict[str, list[dict[str, object]]] = {}
    for summary in summaries:
        by_stream.setdefault(str(summary["stream"]), []).append(summary)
    problems = []
    points = {}
    records = {}
    for stream, state in sorted(store.streams.items()):
        for before, after in zip(state.files, state.files[1:], strict=False):
            if after.first_seq <= before.last_seq:
                problems.append(
                    ChainProblem(
                        f"stream {stream!r}: files {before.path} and {after.path} both hold seqs "
                        f"{after.first_seq}..{min(before.last_seq, after.last_seq)} (a seq is "
                        "stored more than once)",
                        stream=stream,
                        seq=after.first_seq,
                        relays=(),
                    )
                )
        start_seq, start_digest = chaincheck.start_point(stream, None, None)
        if state.retained_after >= 0:
            anchor = load_snapshot(store_path, stream, state.retained_after)
            start_seq, start_digest = anchor.seq, bytes.fromhex(anchor.digest)
        outcome = chaincheck.stitch(stream, by_stream.get(stream, []), start_seq, start_digest)
        if outcome.problem is not None:
            problems.append(outcome.problem)
        elif (outcome.records, outcome.last_seq, outcome.last_digest.hex()) != (
            state.records,
            state.last_seq,
            state.last_digest or outcome.last_digest.hex(),
        ):
            problems.append(
                ChainProblem(
                    f"stream {stream!r}: the stored records end at seq {outcome.last_seq} "
                    f"({outcome.records} records, digest {outcome.last_digest.hex()}) but the "
                    f"table says seq {state.last_seq} ({state.records} records, digest "
                    f"{state.last_digest})",
                    stream=stream,
                    seq=outcome.last_seq,
                    relays=(),
                )
            )
        points[stream] = (outcome.last_seq, outcome.last_digest)
        records[stream] = outcome.records
    problems.extend(snapshot_problems)
    if problems:
        raise VerifyFailed(
            f"{len(problems)} stream(s) fail verification: " + "; ".join(str(p) for p in problems),
            problems=tuple(problems),
        )
    return Verified(points, records, snapshots_checked, snapshots_unchecked)
