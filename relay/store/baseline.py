"""The same ingest, snapshot and verify as the Spark jobs, in one pyarrow process: the
yardstick of `scripts/bench_store.py`, and a way to build a store without a JVM.

It writes the same store (same files, same manifest) through the same shared code
(`chaincheck`, `plan`); it differs in holding a run's whole input in memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from relay.store import chaincheck
from relay.store.changes import Op
from relay.store.manifest import SnapshotInfo, StreamState, load_manifest, new_run, vacuum
from relay.store.plan import (
    CHANGE_SCHEMA,
    SNAPSHOT_SCHEMA,
    BeforeCommit,
    IngestResult,
    SnapshotWriter,
    expand_all,
    finish_ingest,
    finish_snapshot,
    live_rows,
    plan_ingest,
    plan_snapshot,
)
from relay.store.verify import judge

# Rows per batch handed to the checker (as Spark's Arrow batches).
BATCH_ROWS = 20_000


def ingest_baseline(
    spool_root: str, store_path: str, *, before_commit: BeforeCommit | None = None
) -> IngestResult:
    Path(store_path).mkdir(parents=True, exist_ok=True)
    vacuum(store_path)
    manifest = load_manifest(store_path)
    plan = plan_ingest(spool_root, manifest)
    _run, staging = new_run(store_path)
    summaries: list[dict[str, object]] = []
    if plan.to_read:
        start = plan.start
        tables = []
        for segment in plan.to_read:
            table = pq.read_table(segment.path)
            tables.append(table.filter(pc.greater(table.column("seq"), start[segment.stream][0])))
        records = chaincheck.sort_for_check(pa.concat_tables(tables))
        for summary_batch in chaincheck.check_and_write(
            records.to_batches(max_chunksize=BATCH_ROWS), str(staging)
        ):
            summaries.extend(summary_batch.to_pylist())
    return finish_ingest(store_path, plan, summaries, staging, before_commit)


def snapshot_baseline(
    store_path: str,
    *,
    as_of: dict[str, int] | None = None,
    before_commit: BeforeCommit | None = None,
) -> dict[str, SnapshotInfo]:
    manifest = load_manifest(store_path)
    targets = plan_snapshot(manifest, as_of)
    if not targets:
        return {}
    store = Path(store_path)
    run, staging = new_run(store_path)
    writer = SnapshotWriter(str(staging), run)
    for target in targets:
        parts: list[pa.RecordBatch] = []
        for record_file in target.delta_files:
            table = pq.read_table(
                store / record_file.path,
                columns=["stream", "seq", "key", "value", "kind", "duplicate"],
            )
            seq = table.column("seq")
            keep = pc.and_(
                pc.and_(pc.greater(seq, target.base_seq), pc.less_equal(seq, target.seq)),
                pc.invert(table.column("duplicate")),
            )
            parts.extend(expand_all(table.filter(keep).to_batches(max_chunksize=BATCH_ROWS)))
        changes = pa.Table.from_batches(parts, CHANGE_SCHEMA)
        if target.base:
            base = pa.concat_tables(
                [pq.read_table(store / p, schema=SNAPSHOT_SCHEMA) for p in target.base.files]
                or [SNAPSHOT_SCHEMA.empty_table()]
            )
            count = base.num_rows
            base_changes = pa.table(
                [
                    base.column("stream"),
                    base.column("entity"),
                    base.column("key"),
                    pa.array([int(Op.PUT)] * count, pa.int8()),
                    base.column("value"),
                    base.column("seq"),
                    pa.array([0] * count, pa.int32()),
                ],
                schema=CHANGE_SCHEMA,
            )
            changes = pa.concat_tables([base_changes, changes])
        latest = live_rows(changes)
        for batch in latest.to_batches(max_chunksize=BATCH_ROWS):
            writer.write(batch)
    written = writer.close()
    return finish_snapshot(store_path, manifest, targets, written, staging, before_commit)


def verify_baseline(store_path: str) -> dict[str, tuple[int, bytes]]:
    manifest = load_manifest(store_path)
    summaries: list[dict[str, object]] = []
    for state in manifest.streams.values():
        summaries.extend(chaincheck.check_sorted(_stored_batches(store_path, state), _discard))
    return judge(manifest, summaries)


def _stored_batches(store_path: str, state: StreamState) -> Iterator[pa.RecordBatch]:
    for record_file in state.files:
        table = pq.read_table(Path(store_path) / record_file.path)
        table = table.append_column("relay", pa.array([0] * table.num_rows, pa.int32()))
        yield from table.to_batches(max_chunksize=BATCH_ROWS)


def _discard(stream: str, rows: pa.RecordBatch) -> None:
    pass
