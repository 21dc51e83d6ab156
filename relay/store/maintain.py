"""Keeping a store in shape: retention, compaction and vacuum of its Delta tables
(through deltalake, no Spark), run by `relay store run` (relay.storerun) under the
store's writer lock (docs/store.md 7).

- **Retention** (`retire`): a stream's records older than a cut are kept only as
  snapshots. The records removed are whole files up to a snapshot taken at a file's last
  seq (the scheduled snapshots are: they are taken at the last stored seq), so the first
  kept record continues from that snapshot's digest, a consumer that starts from it
  misses nothing, and verify checks the kept chain from there. The last file always
  stays (where the stream stands is read from it). Snapshots beyond the newest
  `keep_snapshots` go too, never the one the kept records continue from, nor one per
  period above the cut (`spread_ms`: the points the cut will reach later).
- **Compaction** (`compact`): runs of consecutive small record files are rewritten as one
  file in seq order, in one commit that removes them (a Delta overwrite with a predicate
  on their seq range), never across a snapshot's seq (retention cuts there). Delta's own
  `optimize` bin-packs files in no particular order, and readers rely on each file
  holding its records in seq order.
- **Vacuum** (`vacuum`): files that no version of the last `retention_hours` needs are
  deleted (readers pinned to an older version, and time travel further back, lose them),
  and the expired part of the log with them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from relay.core.seq import ms_of
from relay.store.chaincheck import RECORD_SCHEMA
from relay.store.errors import StoreCorrupt
from relay.store.location import StoreArg, StoreLocation, as_location
from relay.store.lock import check
from relay.store.tables import (
    RecordFile,
    is_table,
    load_store,
    open_table,
    read_parquet,
    records_table,
    snapshot_table,
    stream_names,
)

log = logging.getLogger("relay.store")


@dataclass(slots=True)
class RetireResult:
    files_removed: int = 0
    records_removed: int = 0
    snapshots_removed: int = 0
    # stream -> the snapshot its kept records now continue from
    retained_after: dict[str, int] = field(default_factory=dict)


def retire(
    store: StoreArg,
    cut_seq: int,
    keep_snapshots: int,
    spread_ms: int | None = None,
) -> RetireResult:
    """Remove each stream's records at or below the newest snapshot point at or below
    `cut_seq` that ends a record file (not the last file), and its snapshots beyond the
    newest `keep_snapshots`, never the one its kept records continue from, nor (with
    `spread_ms`) the newest in each `spread_ms` of seq time above the cut: those are the
    points later cuts will need as the cut moves on."""
    from deltalake import CommitProperties

    location = as_location(store)
    result = RetireResult()
    for stream, state in load_store(location, digests=False).streams.items():
        ends = {f.last_seq for f in state.files[:-1]}
        points = [s for s in state.snapshot_seqs if s <= cut_seq and s in ends]
        retained_after = state.retained_after
        if points:
            through = points[-1]
            going = [f for f in state.files if f.last_seq <= through]
            properties = CommitProperties(
                custom_metadata={
                    "relay.job": "retire",
                    "relay.stream": stream,
                    "relay.retained_after": str(through),
                }
            )
            open_table(location, records_table(stream)).delete(
                f"seq <= {through}", commit_properties=properties
            )
            result.files_removed += len(going)
            result.records_removed += sum(f.records for f in going)
            retained_after = result.retained_after[stream] = through
            log.info(
                "store: retired %d records of %r (%d files) through seq %d; they live on in "
                "the snapshot at that seq",
                sum(f.records for f in going),
                stream,
                len(going),
                through,
            )
        keep = set(state.snapshot_seqs[-keep_snapshots:]) | {retained_after}
        if spread_ms is not None:
            newest_per_period = {
                ms_of(s) // spread_ms: s for s in state.snapshot_seqs if s > cut_seq
            }
            keep |= set(newest_per_period.values())
        for seq in state.snapshot_seqs:
            if seq not in keep:
                location.delete_dir(snapshot_table(stream, seq))
                result.snapshots_removed += 1
    return result


@dataclass(slots=True)
class CompactResult:
    files_before: int = 0  # the small files rewritten
    files_after: int = 0
    records: int = 0


def compact(store: StoreArg, below_bytes: int, target_bytes: int) -> CompactResult:
    """Rewrite each run of consecutive record files smaller than `below_bytes` (at least
    two, at most about `target_bytes` together, none running past a snapshot's seq) as
    one file."""
    location = as_location(store)
    result = CompactResult()
    for stream, state in load_store(location, digests=False).streams.items():
        snapshots = set(state.snapshot_seqs)
        for group in _small_runs(state.files, below_bytes, target_bytes, snapshots):
            written = _rewrite(location, stream, group, target_bytes)
            result.files_before += len(group)
            result.files_after += written
            result.records += sum(f.records for f in group)
    if result.files_before:
        log.info(
            "store: compacted %d small record files (%d records) into %d",
            result.files_before,
            result.records,
            result.files_after,
        )
    return result


def _small_runs(
    files: list[RecordFile], below_bytes: int, target_bytes: int, ends: set[int]
) -> list[list[RecordFile]]:
    """The runs to merge. A run ends at a file whose last seq is in `ends` (a snapshot's
    seq): retention removes records only up to a snapshot at a file end, so compaction
    keeps those ends."""
    runs: list[list[RecordFile]] = []
    current: list[RecordFile] = []
    total = 0

    def close() -> None:
        nonlocal current, total
        if len(current) > 1:
            runs.append(current)
        current, total = [], 0

    for record_file in files:
        small = record_file.size_bytes < below_bytes
        if not small or total + record_file.size_bytes > target_bytes:
            close()
        if small:
            current.append(record_file)
            total += record_file.size_bytes
            if record_file.last_seq in ends:
                close()
    close()
    return runs


def _rewrite(
    location: StoreLocation, stream: str, group: list[RecordFile], target_bytes: int
) -> int:
    from deltalake import CommitProperties, WriterProperties, write_deltalake

    table_name = records_table(stream)
    # One chunk: delta-rs writes the batches of a multi-chunk table in no fixed order.
    data = pa.concat_tables(
        [read_parquet(location, f.path, schema=RECORD_SCHEMA) for f in group]
    ).combine_chunks()
    first, last = group[0].first_seq, group[-1].last_seq
    properties = CommitProperties(
        custom_metadata={
            "relay.job": "compact",
            "relay.stream": stream,
            "relay.first_seq": str(first),
            "relay.last_seq": str(last),
            "relay.files": str(len(group)),
        }
    )
    check(location)
    write_deltalake(
        location.uri(table_name),
        data,
        storage_options=location.storage_options,
        mode="overwrite",
        predicate=f"seq >= {first} AND seq <= {last}",
        target_file_size=target_bytes,
        writer_properties=WriterProperties(compression="ZSTD"),  # as RECORD_FILE_COMPRESSION
        commit_properties=properties,
    )
    actions = pa.table(open_table(location, table_name).get_add_actions(flatten=True))
    written = [
        name
        for name, seq in zip(
            actions.column("path").to_pylist(), actions.column("min.seq").to_pylist(), strict=True
        )
        if first <= seq <= last
    ]
    for name in written:  # readers rely on it: say so loudly should it ever not hold
        seqs = read_parquet(location, f"{table_name}/{name}", columns=["seq"]).column("seq")
        if len(seqs) > 1 and not pc.all(pc.less(seqs[:-1], seqs[1:])).as_py():
            raise StoreCorrupt(
                f"compaction wrote {location.uri(table_name)}/{name} out of seq order"
            )
    return len(written)


@dataclass(slots=True)
class VacuumResult:
    files_removed: int = 0


def vacuum(store: StoreArg, retention_hours: int) -> VacuumResult:
    """Delete the files of every records table that no version of the last
    `retention_hours` names, and the log entries that expired with them."""
    location = as_location(store)
    result = VacuumResult()
    for stream in stream_names(location):
        table_name = records_table(stream)
        if not is_table(location, table_name):
            continue
        table = open_table(location, table_name)
        removed = table.vacuum(
            retention_hours=retention_hours, enforce_retention_duration=False, dry_run=False
        )
        table.cleanup_metadata()
        result.files_removed += len(removed)
    if result.files_removed:
        log.info("store: vacuum deleted %d files no longer needed", result.files_removed)
    return result
