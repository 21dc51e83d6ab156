"""The store's tables: each stream's records, and each snapshot of it, are Delta Lake tables
written through delta-rs (`deltalake`), so any Delta reader (Polars, pandas, Spark with
delta-spark, DuckDB's delta extension, or the file list `DeltaTable.file_uris()` gives) reads
them, with time travel over the versions of a records table.

    <store>/streams/<name>/records/                     the stream's records, append-only
    <store>/streams/<name>/snapshots/seq=<20 digits>/   one table per snapshot, written once
    <store>/_staging/<run>/                             a job's files before they commit
    <store>/_writer.lock                                held by the job that commits (lock.py)

`<name>` is the stream name percent-escaped with `~` in place of `%` (delta-rs decodes `%`
in table paths). A records table holds the store's record columns (`RECORD_SCHEMA`) in seq
order, one file per ingest range; each ingest commit of a stream is one Delta transaction
that adds its files, carries the chain position in its commit metadata (`relay.last_seq`,
`relay.last_digest`, ...) and an application transaction `relay.ingest` whose version is
that last seq: a second writer that committed the same stream since this one read it makes
this commit fail (ConcurrentCommit) instead of appending the records twice. Where a stream
stands is read from the table itself: the last seq from the files' statistics, its digest
from the last file's row (the data is the truth; the commit metadata is for people and
tools).

A snapshot is a table of the last value per key (`SNAPSHOT_SCHEMA`) created in one commit
whose metadata names the seq and digest it was taken at (`relay.snapshot_seq`,
`relay.snapshot_digest`, `relay.rows`); the latest snapshot is the one with the highest
seq, so a snapshot as of an older seq adds a point in time and never moves the latest.

Files reach a table's folder only just before the commit that adds them; a crash between
the two leaves files no version names, which the next job removes (`sweep`, from the list
its run wrote first). One writer at a time: jobs that commit hold the writer lock
(relay.store.lock). `<store>` is a local folder or an S3 prefix (relay.store.location):
names here are relative to it.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from relay.store import STREAMS_DIR
from relay.store.errors import ConcurrentCommit, StoreCorrupt
from relay.store.location import StoreArg, StoreLocation, as_location
from relay.store.lock import WriterLock, check

RECORDS_TABLE = "records"
SNAPSHOTS_DIR = "snapshots"
STAGING_DIR = "_staging"
SNAPSHOT_TABLE = re.compile(r"^seq=(\d{20})$")
# What a run moved into tables before committing: `sweep` removes those no version names.
PUBLISHING_FILE = "publishing.json"
INGEST_APP_ID = "relay.ingest"
FIRST_COMMIT = f"_delta_log/{0:020d}.json"


# --- names (relative to the store) -----------------------------------------------------


def table_dir_name(stream: str) -> str:
    """A stream's folder under `streams/`: percent-escaped, `~` for `%`, no leading dot."""
    escaped = quote(stream, safe="").replace("~", "%7E")
    if escaped.startswith("."):
        escaped = "%2E" + escaped[1:]
    return escaped.replace("%", "~")


def stream_of_dir(name: str) -> str:
    return unquote(name.replace("~", "%"))


def stream_folder(stream: str) -> str:
    return f"{STREAMS_DIR}/{table_dir_name(stream)}"


def records_table(stream: str) -> str:
    return f"{stream_folder(stream)}/{RECORDS_TABLE}"


def snapshot_table(stream: str, seq: int) -> str:
    return f"{stream_folder(stream)}/{SNAPSHOTS_DIR}/seq={seq:020d}"


def is_table(location: StoreLocation, table: str) -> bool:
    """A folder holds a Delta table once its first commit is there."""
    return location.is_file(f"{table}/{FIRST_COMMIT}")


def has_stream(location: StoreLocation, stream: str) -> bool:
    return location.is_dir(stream_folder(stream))


def open_table(location: StoreLocation, table: str, version: int | None = None) -> Any:
    """The Delta table at `table` (at `version`; default the latest). StoreCorrupt if it
    cannot be read."""
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError

    try:
        return DeltaTable(
            location.uri(table), version=version, storage_options=location.storage_options
        )
    except (DeltaError, OSError) as error:
        raise StoreCorrupt(f"table {location.uri(table)} unreadable: {error}") from None


def read_parquet(location: StoreLocation, relative: str, **arguments: Any) -> pa.Table:
    """A store file's rows (pyarrow.parquet.read_table's arguments). StoreCorrupt if it
    cannot be read."""
    try:
        return pq.read_table(location.path(relative), filesystem=location.fs, **arguments)
    except (OSError, pa.ArrowException) as error:
        raise StoreCorrupt(f"store file {location.uri(relative)} unreadable: {error}") from None


def parquet_file(location: StoreLocation, relative: str) -> pq.ParquetFile:
    """A store file opened for reading in batches. StoreCorrupt if it cannot be read."""
    try:
        return pq.ParquetFile(location.fs.open_input_file(location.path(relative)))
    except (OSError, pa.ArrowException) as error:
        raise StoreCorrupt(f"store file {location.uri(relative)} unreadable: {error}") from None


# --- what a store holds -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecordFile:
    path: str  # relative to the store
    first_seq: int
    last_seq: int
    records: int
    size_bytes: int = 0


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    seq: int
    digest: str  # hex
    rows: int
    files: tuple[str, ...]  # relative to the store


@dataclass(slots=True)
class StreamState:
    """Where one stream stands in the store, as of one version of its records table."""

    last_seq: int = -1
    last_digest: str = ""  # hex; "" until the first record (the genesis digest)
    records: int = 0
    files: list[RecordFile] = field(default_factory=list)  # in seq order
    version: int = -1  # of the records table; -1: no table yet
    snapshot_seqs: list[int] = field(default_factory=list)  # ascending
    # The snapshot the first kept record continues from when retention removed the
    # records before it (relay.store.maintain); -1: the records start at the genesis.
    retained_after: int = -1

    @property
    def last_digest_bytes(self) -> bytes | None:
        return bytes.fromhex(self.last_digest) if self.last_digest else None


@dataclass(slots=True)
class StoreState:
    streams: dict[str, StreamState] = field(default_factory=dict)

    def versions(self) -> dict[str, int]:
        return {stream: state.version for stream, state in self.streams.items()}


def stream_names(store: StoreArg) -> list[str]:
    location = as_location(store)
    return sorted(
        stream_of_dir(entry.name) for entry in location.list_dir(STREAMS_DIR) if entry.is_dir
    )


def load_store(store: StoreArg, *, digests: bool = True) -> StoreState:
    """Every stream's state, at the latest version of its records table. `digests=False`
    leaves `last_digest` empty (it costs a read of each stream's last file; a spool's
    reclaim needs only the seqs)."""
    location = as_location(store)
    state = StoreState()
    for stream in stream_names(location):
        state.streams[stream] = load_stream(location, stream, digests=digests)
    return state


def load_stream(store: StoreArg, stream: str, *, digests: bool = True) -> StreamState:
    location = as_location(store)
    state = StreamState(snapshot_seqs=snapshot_seqs(location, stream))
    table_name = records_table(stream)
    if not is_table(location, table_name):
        return state
    table = open_table(location, table_name)
    state.version = table.version()
    actions = pa.table(table.get_add_actions(flatten=True))
    if actions.num_rows:
        names = ["path", "min.seq", "max.seq", "num_records", "size_bytes"]
        state.files = sorted(
            (
                RecordFile(f"{table_name}/{path}", first, last, records, size)
                for path, first, last, records, size in zip(
                    *(actions.column(n).to_pylist() for n in names), strict=True
                )
            ),
            key=lambda f: f.first_seq,
        )
        state.records = sum(f.records for f in state.files)
        state.last_seq = state.files[-1].last_seq
        if digests:
            state.last_digest = _digest_in(location, state.files[-1].path, state.last_seq).hex()
        below = [s for s in state.snapshot_seqs if s < state.files[0].first_seq]
        state.retained_after = below[-1] if below else -1
    return state


def _digest_in(location: StoreLocation, relative: str, seq: int) -> bytes:
    table = read_parquet(
        location, relative, columns=["seq", "digest"], filters=[("seq", "==", seq)]
    )
    if table.num_rows != 1:
        raise StoreCorrupt(
            f"store file {location.uri(relative)} holds {table.num_rows} records at seq {seq}"
        )
    digest = table.column("digest")[0].as_py()
    assert isinstance(digest, bytes)
    return digest


def digest_at(store: StoreArg, state: StreamState, seq: int) -> tuple[int, bytes]:
    """The stored point at or below `seq`: (seq of the last record <= seq, its digest)."""
    location = as_location(store)
    if seq >= state.last_seq and state.last_digest:
        return state.last_seq, bytes.fromhex(state.last_digest)
    for record_file in reversed(state.files):
        if record_file.first_seq <= seq:
            table = read_parquet(
                location, record_file.path, columns=["seq", "digest"], filters=[("seq", "<=", seq)]
            )
            if table.num_rows == 0:
                break
            last = pc.max(table.column("seq")).as_py()
            return last, _digest_in(location, record_file.path, last)
    raise StoreCorrupt(f"no stored record at or below seq {seq}")


def snapshot_seqs(store: StoreArg, stream: str) -> list[int]:
    """The seqs of the stream's committed snapshots, ascending."""
    location = as_location(store)
    folder = f"{stream_folder(stream)}/{SNAPSHOTS_DIR}"
    seqs = []
    for entry in location.list_dir(folder):
        match = SNAPSHOT_TABLE.match(entry.name)
        if match and is_table(location, f"{folder}/{entry.name}"):
            seqs.append(int(match.group(1)))
    return sorted(seqs)


def load_snapshot(store: StoreArg, stream: str, seq: int) -> SnapshotInfo:
    location = as_location(store)
    table_name = snapshot_table(stream, seq)
    table = open_table(location, table_name)
    commit = table.history(1)[-1] if table.version() == 0 else _first_commit(table)
    try:
        digest = str(commit["relay.snapshot_digest"])
        taken_at = int(commit["relay.snapshot_seq"])
    except (KeyError, ValueError) as error:
        raise StoreCorrupt(
            f"snapshot table {location.uri(table_name)} lacks its point: {error!r}"
        ) from None
    if taken_at != seq:
        raise StoreCorrupt(
            f"snapshot table {location.uri(table_name)} says it was taken at seq {taken_at}"
        )
    actions = pa.table(table.get_add_actions(flatten=True))
    files = tuple(sorted(f"{table_name}/{p}" for p in actions.column("path").to_pylist()))
    rows = sum(actions.column("num_records").to_pylist()) if actions.num_rows else 0
    return SnapshotInfo(seq, digest, rows, files)


def _first_commit(table: Any) -> dict[str, Any]:
    for commit in table.history():
        if commit.get("version") == 0:
            return dict(commit)
    raise StoreCorrupt(f"table {table.table_uri} has no first commit in its log")


def latest_snapshot(store: StoreArg, stream: str, state: StreamState) -> SnapshotInfo | None:
    """The snapshot with the highest seq."""
    seqs = state.snapshot_seqs
    return load_snapshot(store, stream, seqs[-1]) if seqs else None


# --- writing ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StagedFile:
    """A file a job wrote under its staging folder, with what its table's log says of it."""

    path: str  # relative to the store
    records: int
    first_seq: int = -1  # records files: the seqs they hold
    last_seq: int = -1


def new_run(store: StoreArg) -> tuple[str, str]:
    """A fresh run id and its staging folder (relative to the store; empty)."""
    location = as_location(store)
    run = f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:12]}"
    staging = f"{STAGING_DIR}/{run}"
    location.make_dir(staging)
    return run, staging


def drop_staging(store: StoreArg, staging: str) -> None:
    with contextlib.suppress(OSError):
        as_location(store).delete_dir(staging)


def position_metadata(
    job: str, run: str, files: list[StagedFile], last_digest: bytes, outvoted: int, checked: int
) -> dict[str, str]:
    """The commit metadata of records added (files in seq order): the chain position."""
    return {
        "relay.job": job,
        "relay.run": run,
        "relay.first_seq": str(files[0].first_seq),
        "relay.last_seq": str(files[-1].last_seq),
        "relay.last_digest": last_digest.hex(),
        "relay.records_added": str(sum(f.records for f in files)),
        "relay.outvoted": str(outvoted),
        "relay.copies_checked": str(checked),
    }


def commit_records(
    store: StoreArg,
    stream: str,
    state: StreamState,
    files: list[StagedFile],
    staging: str,
    metadata: dict[str, str],
) -> int:
    """Add the staged record files (in seq order, continuing `state`) to the stream's table
    in one transaction whose version follows `state.version`; its new version.
    ConcurrentCommit if another writer committed the stream since `state` was read."""
    from deltalake import CommitProperties, Transaction

    from relay.store.chaincheck import RECORD_SCHEMA

    location = as_location(store)
    table_name = records_table(stream)
    last_seq = files[-1].last_seq
    actions = _publish(location, table_name, files, staging, _seq_stats)
    properties = CommitProperties(
        custom_metadata={"relay.stream": stream, **metadata},
        app_transactions=[Transaction(INGEST_APP_ID, last_seq)],
    )
    return _commit(location, table_name, state.version, RECORD_SCHEMA, actions, properties)


def commit_snapshot(
    store: StoreArg,
    stream: str,
    seq: int,
    digest: bytes,
    files: list[StagedFile],
    staging: str,
) -> SnapshotInfo:
    """Create the snapshot table of `stream` at `seq` from the staged files (none: the
    snapshot is empty) in one commit naming its point."""
    from deltalake import CommitProperties

    from relay.store.plan import SNAPSHOT_SCHEMA

    location = as_location(store)
    table_name = snapshot_table(stream, seq)
    if not is_table(location, table_name):
        location.delete_dir(table_name)  # a crashed run's files (only the lock holder writes)
    actions = _publish(location, table_name, files, staging, _row_stats)
    rows = sum(f.records for f in files)
    properties = CommitProperties(
        custom_metadata={
            "relay.stream": stream,
            "relay.snapshot_seq": str(seq),
            "relay.snapshot_digest": digest.hex(),
            "relay.rows": str(rows),
        }
    )
    _commit(location, table_name, -1, SNAPSHOT_SCHEMA, actions, properties)
    return SnapshotInfo(
        seq, digest.hex(), rows, tuple(sorted(f"{table_name}/{a.path}" for a in actions))
    )


def _seq_stats(staged: StagedFile) -> str:
    return json.dumps(
        {
            "numRecords": staged.records,
            "minValues": {"seq": staged.first_seq},
            "maxValues": {"seq": staged.last_seq},
            "nullCount": {"seq": 0},
        }
    )


def _row_stats(staged: StagedFile) -> str:
    return json.dumps({"numRecords": staged.records})


def _publish(
    location: StoreLocation,
    table: str,
    files: list[StagedFile],
    staging: str,
    stats: Any,
) -> list[Any]:
    """Move staged files into `table`'s folder (after noting them in the run's publishing
    list, for `sweep`); their add actions."""
    from deltalake.transaction import AddAction

    check(location)
    for staged in files:
        _check_staged(location, staged)
    targets = [f"{table}/{f.path.rpartition('/')[2]}" for f in files]
    listed = f"{staging}/{PUBLISHING_FILE}"
    previous = json.loads(location.read_bytes(listed)) if location.is_file(listed) else []
    location.write_bytes(listed, json.dumps(previous + targets).encode())
    actions = []
    for staged, target in zip(files, targets, strict=True):
        entry = location.move_in(location.path(staged.path), target)
        actions.append(
            AddAction(entry.name, entry.size_bytes, {}, entry.mtime_ms, True, stats(staged))
        )
    return actions


def _check_staged(location: StoreLocation, staged: StagedFile) -> None:
    """A staged file must be the Parquet file its task says it wrote (its footer holds that
    many rows) before a commit names it: a write that went wrong on the way (a truncated
    upload, a store that kept something else) stops the job instead of entering a table."""
    try:
        rows = pq.read_metadata(location.path(staged.path), filesystem=location.fs).num_rows
    except (OSError, pa.ArrowException) as error:
        raise StoreCorrupt(
            f"staged file {location.uri(staged.path)} is not a readable Parquet file: {error}"
        ) from None
    if rows != staged.records:
        raise StoreCorrupt(
            f"staged file {location.uri(staged.path)} holds {rows} rows, its task wrote "
            f"{staged.records}"
        )


def _commit(
    location: StoreLocation,
    table_name: str,
    version: int,
    schema: pa.Schema,
    actions: list[Any],
    properties: Any,
) -> int:
    from deltalake import Schema
    from deltalake.exceptions import CommitFailedError, DeltaError
    from deltalake.transaction import create_table_with_add_actions

    delta_schema = Schema.from_arrow(schema)
    uri = location.uri(table_name)
    check(location)
    try:
        if version < 0:
            create_table_with_add_actions(
                uri,
                delta_schema,
                actions,
                mode="error",
                storage_options=location.storage_options,
                commit_properties=properties,
            )
            return 0
        table = open_table(location, table_name, version)
        table.create_write_transaction(
            actions, mode="append", schema=delta_schema, commit_properties=properties
        )
        return int(table.version())
    except CommitFailedError as error:
        raise ConcurrentCommit(
            f"table {uri}: another writer committed since version {version}; run the job "
            f"again ({error})"
        ) from None
    except DeltaError as error:
        if version < 0 and "already exists" in str(error):
            raise ConcurrentCommit(
                f"table {uri} was created by another writer; run the job again"
            ) from None
        raise


def sweep(store: StoreArg) -> int:
    """Remove what crashed runs left: staging folders, files moved into a table that no
    version names (from each run's publishing list), snapshot folders never committed.
    Only the lock holder may call it. The number of files removed."""
    location = as_location(store)
    removed = 0
    for run in location.list_dir(STAGING_DIR):
        listed = f"{STAGING_DIR}/{run.name}/{PUBLISHING_FILE}"
        if location.is_file(listed):
            for target in json.loads(location.read_bytes(listed)):
                if location.is_file(target) and not _named_by_table(location, target):
                    with contextlib.suppress(OSError):
                        location.delete_file(target)
                        removed += 1
        with contextlib.suppress(OSError):
            location.delete_dir(f"{STAGING_DIR}/{run.name}")
    for stream in stream_names(location):
        folder = f"{stream_folder(stream)}/{SNAPSHOTS_DIR}"
        for entry in location.list_dir(folder):
            table = f"{folder}/{entry.name}"
            if SNAPSHOT_TABLE.match(entry.name) and not is_table(location, table):
                with contextlib.suppress(OSError):
                    location.delete_dir(table)
                    removed += 1
    return removed


def _named_by_table(location: StoreLocation, file: str) -> bool:
    """Whether the latest version of the table holding `file` names it. (A crashed run's
    commit, if it happened, is the latest: no job commits before sweeping.)"""
    table, _, name = file.rpartition("/")
    if not is_table(location, table):
        return False
    actions = pa.table(open_table(location, table).get_add_actions(flatten=True))
    return name in set(actions.column("path").to_pylist())


@contextlib.contextmanager
def writing(store: StoreArg, job: str, wait_s: float = 0.0) -> Iterator[StoreLocation]:
    """Hold the writer lock, clear what crashed runs left and convert a local store of the
    earlier layout (relay.store.migrate), for a job that commits; the store's location."""
    from relay.store.migrate import migrate_manifest_store

    location = as_location(store)
    location.make_dir("")
    with WriterLock(location, job, wait_s=wait_s):
        sweep(location)
        if location.is_local:
            migrate_manifest_store(location.local_root)
        yield location
