"""The same ingest, snapshot and verify as the Spark jobs, with pyarrow and no JVM: the
yardstick of `scripts/bench_store.py`, and a way to build a store without Spark.

It writes the same store (the same tables) through the same shared code (`chaincheck`,
`plan`): ingest runs the Spark job's range tasks, snapshot folds each stream. With
`workers=1` (the default) everything runs in this process, one task after the other; with
more, the tasks run in a pool of that many processes (the same number of cores as a Spark
`local[N]`, for a fair comparison).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]

from relay.store import chaincheck
from relay.store.changes import Op
from relay.store.errors import ChainProblem
from relay.store.location import Folder, StoreArg, StoreLocation, as_location
from relay.store.plan import (
    CHANGE_SCHEMA,
    SNAPSHOT_SCHEMA,
    BeforeCommit,
    IngestResult,
    SnapshotCheck,
    SnapshotTarget,
    SnapshotWriter,
    check_range,
    expand_and_fold,
    finish_ingest,
    finish_snapshot,
    live_rows,
    plan_ingest,
    plan_ranges,
    plan_snapshot,
    plan_snapshot_checks,
    range_bytes_for,
    read_delta,
    snapshot_difference,
)
from relay.store.tables import (
    RecordFile,
    SnapshotInfo,
    StreamState,
    load_store,
    new_run,
    read_parquet,
    writing,
)
from relay.store.verify import Verified, judge

# Rows per batch handed to the checker (as Spark's Arrow batches).
BATCH_ROWS = 20_000


def ingest_baseline(
    spool_root: str,
    store_path: StoreArg,
    *,
    before_commit: BeforeCommit | None = None,
    lock_wait_s: float = 0.0,
    workers: int = 1,
) -> IngestResult:
    with writing(store_path, "ingest (baseline)", lock_wait_s) as location:
        plan = plan_ingest(spool_root, load_store(location))
        run, staging = new_run(location)
        # The same range tasks as the Spark job, sized for `workers` cores.
        ranges = plan_ranges(plan, range_bytes_for(plan.input_bytes, cores=workers))
        folders = [Folder(location, staging)] * len(ranges)
        summaries = [row for rows in _map(check_range, workers, ranges, folders) for row in rows]
        return finish_ingest(location, plan, summaries, staging, run, before_commit)


def _map(function: Any, workers: int, *arguments: list[Any]) -> list[Any]:
    """`function` over `arguments` here (one worker) or in a pool of `workers` processes."""
    if workers <= 1:
        return list(map(function, *arguments))
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(function, *arguments))


def snapshot_baseline(
    store_path: StoreArg,
    *,
    as_of: dict[str, int] | None = None,
    streams: Collection[str] | None = None,
    before_commit: BeforeCommit | None = None,
    lock_wait_s: float = 0.0,
    workers: int = 1,
) -> dict[str, SnapshotInfo]:
    with writing(store_path, "snapshot (baseline)", lock_wait_s) as location:
        targets = plan_snapshot(location, load_store(location), as_of, streams)
        if not targets:
            return {}
        run, staging = new_run(location)
        count = len(targets)
        written = _map(
            _fold_and_write,
            workers,
            targets,
            [Folder(location, staging)] * count,
            [f"{run}-{i}" for i in range(count)],
        )
        entries = [entry for entries in written for entry in entries]
        return finish_snapshot(location, targets, entries, staging, before_commit)


def _fold_and_write(
    target: SnapshotTarget, staging: Folder, prefix: str
) -> list[dict[str, object]]:
    """One stream's snapshot rows, written under `staging` (a task of the pool)."""
    writer = SnapshotWriter(staging, prefix)
    latest = _fold(staging.location, target.base, target.delta_files, target.seq)
    for batch in latest.to_batches(max_chunksize=BATCH_ROWS):
        writer.write(batch)
    return writer.close()


def _fold(
    store: StoreLocation, base: SnapshotInfo | None, delta_files: list[RecordFile], upto_seq: int
) -> pa.Table:
    """The snapshot rows at `upto_seq`: `base`'s rows (none: from the first record) plus
    the changes of the records after it in `delta_files`, folded as they are read (memory
    holds the changes of a few batches and the keys)."""
    after_seq = base.seq if base else -1
    delta = (
        batch
        for record_file in delta_files
        for batch in read_delta(store, record_file.path, after_seq, upto_seq)
    )
    changes = pa.Table.from_batches(expand_and_fold(delta), CHANGE_SCHEMA)
    if base:
        rows = _snapshot_rows(store, base)
        count = rows.num_rows
        base_changes = pa.table(
            [
                rows.column("stream"),
                rows.column("entity"),
                rows.column("key"),
                pa.array([int(Op.PUT)] * count, pa.int8()),
                rows.column("value"),
                rows.column("seq"),
                pa.array([0] * count, pa.int32()),
            ],
            schema=CHANGE_SCHEMA,
        )
        changes = pa.concat_tables([base_changes, changes])
    return live_rows(changes)


def _snapshot_rows(store: StoreLocation, info: SnapshotInfo) -> pa.Table:
    return pa.concat_tables(
        [read_parquet(store, p, schema=SNAPSHOT_SCHEMA) for p in info.files]
        or [SNAPSHOT_SCHEMA.empty_table()]
    )


def verify_baseline(store_path: StoreArg) -> Verified:
    location = as_location(store_path)
    store = load_store(location)
    summaries: list[dict[str, object]] = []
    for state in store.streams.values():
        summaries.extend(chaincheck.check_sorted(_stored_batches(location, state), _discard))
    checks, unchecked = plan_snapshot_checks(location, store)
    differences = []
    for check in checks:
        expected = _fold(location, check.base, check.delta_files, check.snapshot.seq)
        actual = _snapshot_rows(location, check.snapshot)
        difference = _difference(check, expected, actual)
        if difference is not None:
            differences.append(difference)
    return judge(location, store, summaries, differences, len(checks), unchecked)


def _difference(check: SnapshotCheck, expected: pa.Table, actual: pa.Table) -> ChainProblem | None:
    columns = ["entity", "key", "value", "seq"]
    order = [("entity", "ascending"), ("key", "ascending")]
    want = expected.select(columns).sort_by(order)
    got = actual.select(columns).sort_by(order)
    if want.equals(got):
        return None
    want_rows = {tuple(r.values()) for r in want.to_pylist()}
    got_rows = {tuple(r.values()) for r in got.to_pylist()}
    missing, unexpected = want_rows - got_rows, got_rows - want_rows
    example = min(missing or unexpected)
    text = f"entity {example[0]!r} key {example[1]!r}"
    return snapshot_difference(
        check.stream, check.snapshot.seq, len(missing), len(unexpected), text
    )


def _stored_batches(location: StoreLocation, state: StreamState) -> Iterator[pa.RecordBatch]:
    for record_file in state.files:
        table = read_parquet(location, record_file.path)
        table = table.append_column("relay", pa.array([0] * table.num_rows, pa.int32()))
        yield from table.to_batches(max_chunksize=BATCH_ROWS)


def _discard(stream: str, rows: pa.RecordBatch) -> None:
    pass


class BaselineEngine:
    """The baseline as an engine of `relay store run` (relay.storerun.Engine): no JVM
    (`relay store run --engine baseline`), in this process or a pool of `workers`."""

    name = "baseline"

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers

    def ingest(self, spool_root: str, store: StoreArg, lock_wait_s: float) -> IngestResult:
        return ingest_baseline(spool_root, store, lock_wait_s=lock_wait_s, workers=self.workers)

    def snapshot(self, store: StoreArg, lock_wait_s: float) -> dict[str, SnapshotInfo]:
        return snapshot_baseline(store, lock_wait_s=lock_wait_s, workers=self.workers)

    def close(self) -> None:
        pass
