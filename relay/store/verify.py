"""Verify: re-check every stream's chain in the store end to end (a PySpark job), run by
`relay store verify --config TOPOLOGY` (relay.storecmd; docs/store.md 4).

The stored records of all streams are range-partitioned on (stream, seq); each task
checks the links inside its range (`chaincheck.check_sorted`, writing nothing) and the
driver stitches the ranges from each stream's genesis digest. Every stream must end at
the last point and record count its records table names. Raises VerifyFailed listing every
problem (exit status 2 from the command).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from relay.store import chaincheck
from relay.store.errors import ChainProblem, VerifyFailed
from relay.store.spark import RECORD_DDL, SUMMARY_DDL, parallelism
from relay.store.tables import StoreState, load_snapshot, load_store

# Stored bytes per range task.
RANGE_INPUT_BYTES = 64 * 1024 * 1024


def verify(spark: Any, store_path: str) -> dict[str, tuple[int, bytes]]:
    """Every stream's (last seq, last digest), checked from genesis. Raises VerifyFailed."""
    from pyspark.sql import functions as F

    store = load_store(store_path)
    paths = [str(Path(store_path) / f.path) for s in store.streams.values() for f in s.files]
    summaries: list[dict[str, object]] = []
    if paths:
        input_bytes = sum(Path(p).stat().st_size for p in paths)
        ranges = max(parallelism(spark), math.ceil(input_bytes / RANGE_INPUT_BYTES))

        def check_range(batches: Any) -> Any:
            import pyarrow as pa  # type: ignore[import-untyped]

            def discard(stream: str, rows: pa.RecordBatch) -> None:
                pass

            rows = chaincheck.check_sorted(batches, discard)
            yield pa.RecordBatch.from_pylist(rows, schema=chaincheck.SUMMARY_SCHEMA)

        checked = (
            spark.read.schema(RECORD_DDL)
            .parquet(*paths)
            .withColumn("relay", F.lit(0))
            .repartitionByRange(ranges, F.col("stream"), F.col("seq"))
            .sortWithinPartitions("stream", "seq")
            .mapInArrow(check_range, SUMMARY_DDL)
        )
        summaries = [
            {k: bytes(v) if isinstance(v, bytearray) else v for k, v in row.asDict().items()}
            for row in checked.collect()
        ]
    return judge(store_path, store, summaries)


def judge(
    store_path: str, store: StoreState, summaries: list[dict[str, object]]
) -> dict[str, tuple[int, bytes]]:
    """Stitch each stream from its genesis (or from the snapshot its kept records continue
    from, after retention) and compare with where its table says it ends."""
    by_stream: dict[str, list[dict[str, object]]] = {}
    for summary in summaries:
        by_stream.setdefault(str(summary["stream"]), []).append(summary)
    problems = []
    points = {}
    for stream, state in sorted(store.streams.items()):
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
    if problems:
        raise VerifyFailed(
            f"{len(problems)} stream(s) fail verification: " + "; ".join(str(p) for p in problems),
            problems=tuple(problems),
        )
    return points
