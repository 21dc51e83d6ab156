"""The store's tables: each stream's records, and each snapshot of it, are Delta Lake tables
written through delta-rs (`deltalake`), so any Delta reader (Polars, pandas, Spark with
delta-spark, DuckDB's delta extension, or the file list `DeltaTable.file_uris()` gives) reads
them, with time travel over the versions of a records table.

    <store>/streams/<name>/records/                     the stream's records, append-only
    <store>/streams/<name>/snapshots/seq=<20 digits>/   one table per snapshot, written once
    <store>/_staging/<run>/                             a job's files before they commit
    <store>/_writer.lock                                held by the job that commits

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
its run wrote first). One writer at a time: jobs that commit hold `WriterLock`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from relay.store import STREAMS_DIR
from relay.store.errors import ConcurrentCommit, StoreCorrupt, StoreLocked

RECORDS_TABLE = "records"
SNAPSHOTS_DIR = "snapshots"
STAGING_DIR = "_staging"
LOCK_FILE = "_writer.lock"
SNAPSHOT_TABLE = re.compile(r"^seq=(\d{20})$")
# What a run moved into tables before committing: `sweep` removes those no version names.
PUBLISHING_FILE = "publishing.json"
INGEST_APP_ID = "relay.ingest"
# How often a writer waiting for the lock looks again.
LOCK_POLL_S = 0.5


# --- names ------------------------------------------------------------------------------


def table_dir_name(stream: str) -> str:
    """A stream's folder under `streams/`: percent-escaped, `~` for `%`, no leading dot."""
    escaped = quote(stream, safe="").replace("~", "%7E")
    if escaped.startswith("."):
        escaped = "%2E" + escaped[1:]
    return escaped.replace("%", "~")


def stream_of_dir(name: str) -> str:
    return unquote(name.replace("~", "%"))


def records_table(store: str | os.PathLike[str], stream: str) -> Path:
    return Path(store) / STREAMS_DIR / table_dir_name(stream) / RECORDS_TABLE


def snapshot_table(store: str | os.PathLike[str], stream: str, seq: int) -> Path:
    return Path(store) / STREAMS_DIR / table_dir_name(stream) / SNAPSHOTS_DIR / f"seq={seq:020d}"


def is_table(path: Path) -> bool:
    """A folder holds a Delta table once its first commit is there."""
    return (path / "_delta_log" / f"{0:020d}.json").is_file()


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


def stream_names(store: str | os.PathLike[str]) -> list[str]:
    folder = Path(store) / STREAMS_DIR
    if not folder.is_dir():
        return []
    return sorted(stream_of_dir(entry.name) for entry in os.scandir(folder) if entry.is_dir())


def load_store(store: str | os.PathLike[str], *, digests: bool = True) -> StoreState:
    """Every stream's state, at the latest version of its records table. `digests=False`
    leaves `last_digest` empty (it costs a read of each stream's last file; a spool's
    reclaim needs only the seqs)."""
    state = StoreState()
    for stream in stream_names(store):
        state.streams[stream] = load_stream(store, stream, digests=digests)
    return state


def load_stream(store: str | os.PathLike[str], stream: str, *, digests: bool = True) -> StreamState:
    state = StreamState(snapshot_seqs=snapshot_seqs(store, stream))
    path = records_table(store, stream)
    if not is_table(path):
        return state
    table = _open(path)
    state.version = table.version()
    prefix = str(path.relative_to(store))
    actions = pa.table(table.get_add_actions(flatten=True))
    if actions.num_rows:
        names = ["path", "min.seq", "max.seq", "num_records", "size_bytes"]
        state.files = sorted(
            (
                RecordFile(f"{prefix}/{path}", first, last, records, size)
                for path, first, last, records, size in zip(
                    *(actions.column(n).to_pylist() for n in names), strict=True
                )
            ),
            key=lambda f: f.first_seq,
        )
        state.records = sum(f.records for f in state.files)
        state.last_seq = state.files[-1].last_seq
        if digests:
            state.last_digest = _digest_in(Path(store) / state.files[-1].path, state.last_seq).hex()
        below = [s for s in state.snapshot_seqs if s < state.files[0].first_seq]
        state.retained_after = below[-1] if below else -1
    return state


def _open(path: Path) -> Any:
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError

    try:
        return DeltaTable(str(path))
    except (DeltaError, OSError) as error:
        raise StoreCorrupt(f"table {path} unreadable: {error}") from None


def _digest_in(path: Path, seq: int) -> bytes:
    try:
        table = pq.read_table(path, columns=["seq", "digest"], filters=[("seq", "==", seq)])
    except OSError as error:
        raise StoreCorrupt(f"store file {path} unreadable: {error}") from None
    if table.num_rows != 1:
        raise StoreCorrupt(f"store file {path} holds {table.num_rows} records at seq {seq}")
    digest = table.column("digest")[0].as_py()
    assert isinstance(digest, bytes)
    return digest


def digest_at(store: str | os.PathLike[str], state: StreamState, seq: int) -> tuple[int, bytes]:
    """The stored point at or below `seq`: (seq of the last record <= seq, its digest)."""
    if seq >= state.last_seq and state.last_digest:
        return state.last_seq, bytes.fromhex(state.last_digest)
    for record_file in reversed(state.files):
        if record_file.first_seq <= seq:
            path = Path(store) / record_file.path
            table = pq.read_table(path, columns=["seq", "digest"], filters=[("seq", "<=", seq)])
            if table.num_rows == 0:
                break
            last = pc.max(table.column("seq")).as_py()
            return last, _digest_in(path, last)
    raise StoreCorrupt(f"no stored record at or below seq {seq}")


def snapshot_seqs(store: str | os.PathLike[str], stream: str) -> list[int]:
    """The seqs of the stream's committed snapshots, ascending."""
    folder = Path(store) / STREAMS_DIR / table_dir_name(stream) / SNAPSHOTS_DIR
    if not folder.is_dir():
        return []
    seqs = []
    for entry in os.scandir(folder):
        match = SNAPSHOT_TABLE.match(entry.name)
        if match and is_table(Path(entry.path)):
            seqs.append(int(match.group(1)))
    return sorted(seqs)


def load_snapshot(store: str | os.PathLike[str], stream: str, seq: int) -> SnapshotInfo:
    path = snapshot_table(store, stream, seq)
    table = _open(path)
    commit = table.history(1)[-1] if table.version() == 0 else _first_commit(table)
    try:
        digest = str(commit["relay.snapshot_digest"])
        taken_at = int(commit["relay.snapshot_seq"])
    except (KeyError, ValueError) as error:
        raise StoreCorrupt(f"snapshot table {path} lacks its point: {error!r}") from None
    if taken_at != seq:
        raise StoreCorrupt(f"snapshot table {path} says it was taken at seq {taken_at}")
    prefix = str(path.relative_to(store))
    actions = pa.table(table.get_add_actions(flatten=True))
    files = tuple(sorted(f"{prefix}/{p}" for p in actions.column("path").to_pylist()))
    rows = sum(actions.column("num_records").to_pylist()) if actions.num_rows else 0
    return SnapshotInfo(seq, digest, rows, files)


def _first_commit(table: Any) -> dict[str, Any]:
    for commit in table.history():
        if commit.get("version") == 0:
            return dict(commit)
    raise StoreCorrupt(f"table {table.table_uri} has no first commit in its log")


def latest_snapshot(
    store: str | os.PathLike[str], stream: str, state: StreamState
) -> SnapshotInfo | None:
    """The snapshot with the highest seq."""
    seqs = state.snapshot_seqs
    return load_snapshot(store, stream, seqs[-1]) if seqs else None


# --- writing ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StagedFile:
    """A file a job wrote under its staging folder, with what its table's log says of it."""

    path: str  # absolute
    records: int
    first_seq: int = -1  # records files: the seqs they hold
    last_seq: int = -1


def new_run(store: str | os.PathLike[str]) -> tuple[str, Path]:
    """A fresh run id and its empty staging folder."""
    run = f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:12]}"
    staging = Path(store) / STAGING_DIR / run
    staging.mkdir(parents=True)
    return run, staging


def drop_staging(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


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
    store: str | os.PathLike[str],
    stream: str,
    state: StreamState,
    files: list[StagedFile],
    staging: Path,
    metadata: dict[str, str],
) -> int:
    """Add the staged record files (in seq order, continuing `state`) to the stream's table
    in one transaction whose version follows `state.version`; its new version.
    ConcurrentCommit if another writer committed the stream since `state` was read."""
    from deltalake import CommitProperties, Transaction

    from relay.store.chaincheck import RECORD_SCHEMA

    path = records_table(store, stream)
    last_seq = files[-1].last_seq
    actions = _publish(store, path, files, staging, _seq_stats)
    properties = CommitProperties(
        custom_metadata={"relay.stream": stream, **metadata},
        app_transactions=[Transaction(INGEST_APP_ID, last_seq)],
    )
    return _commit(path, state.version, RECORD_SCHEMA, actions, properties)


def commit_snapshot(
    store: str | os.PathLike[str],
    stream: str,
    seq: int,
    digest: bytes,
    files: list[StagedFile],
    staging: Path,
) -> SnapshotInfo:
    """Create the snapshot table of `stream` at `seq` from the staged files (none: the
    snapshot is empty) in one commit naming its point."""
    from deltalake import CommitProperties

    from relay.store.plan import SNAPSHOT_SCHEMA

    path = snapshot_table(store, stream, seq)
    if path.exists() and not is_table(path):
        shutil.rmtree(path)  # a crashed run's files (only the lock holder writes here)
    actions = _publish(store, path, files, staging, _row_stats)
    rows = sum(f.records for f in files)
    properties = CommitProperties(
        custom_metadata={
            "relay.stream": stream,
            "relay.snapshot_seq": str(seq),
            "relay.snapshot_digest": digest.hex(),
            "relay.rows": str(rows),
        }
    )
    _commit(path, -1, SNAPSHOT_SCHEMA, actions, properties)
    prefix = str(path.relative_to(store))
    return SnapshotInfo(
        seq, digest.hex(), rows, tuple(sorted(f"{prefix}/{a.path}" for a in actions))
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
    store: str | os.PathLike[str],
    table: Path,
    files: list[StagedFile],
    staging: Path,
    stats: Any,
) -> list[Any]:
    """Move staged files into `table`'s folder (after noting them in the run's publishing
    list, for `sweep`); their add actions."""
    from deltalake.transaction import AddAction

    table.mkdir(parents=True, exist_ok=True)
    targets = [table / Path(f.path).name for f in files]
    listed = staging / PUBLISHING_FILE
    previous = json.loads(listed.read_text()) if listed.exists() else []
    listed.write_text(json.dumps(previous + [str(t.relative_to(store)) for t in targets]))
    actions = []
    for staged, target in zip(files, targets, strict=True):
        os.replace(staged.path, target)
        size = target.stat().st_size
        mtime_ms = int(target.stat().st_mtime * 1000)
        actions.append(AddAction(target.name, size, {}, mtime_ms, True, stats(staged)))
    return actions


def _commit(
    path: Path, version: int, schema: pa.Schema, actions: list[Any], properties: Any
) -> int:
    from deltalake import DeltaTable, Schema
    from deltalake.exceptions import CommitFailedError, DeltaError
    from deltalake.transaction import create_table_with_add_actions

    delta_schema = Schema.from_arrow(schema)
    try:
        if version < 0:
            create_table_with_add_actions(
                str(path), delta_schema, actions, mode="error", commit_properties=properties
            )
            return 0
        table = DeltaTable(str(path), version=version)
        table.create_write_transaction(
            actions, mode="append", schema=delta_schema, commit_properties=properties
        )
        return int(table.version())
    except CommitFailedError as error:
        raise ConcurrentCommit(
            f"table {path}: another writer committed since version {version}; run the job "
            f"again ({error})"
        ) from None
    except DeltaError as error:
        if version < 0 and "already exists" in str(error):
            raise ConcurrentCommit(
                f"table {path} was created by another writer; run the job again"
            ) from None
        raise


def sweep(store: str | os.PathLike[str]) -> int:
    """Remove what crashed runs left: staging folders, files moved into a table that no
    version names (from each run's publishing list), snapshot folders never committed.
    Only the lock holder may call it. The number of files removed."""
    store_path = Path(store)
    removed = 0
    staging_root = store_path / STAGING_DIR
    for run in sorted(staging_root.iterdir()) if staging_root.is_dir() else []:
        listed = run / PUBLISHING_FILE
        if listed.exists():
            for relative in json.loads(listed.read_text()):
                target = store_path / relative
                if target.exists() and not _named_by_table(target):
                    with contextlib.suppress(OSError):
                        target.unlink()
                        removed += 1
        shutil.rmtree(run, ignore_errors=True)
    for stream in stream_names(store):
        folder = store_path / STREAMS_DIR / table_dir_name(stream) / SNAPSHOTS_DIR
        for entry in os.scandir(folder) if folder.is_dir() else []:
            if SNAPSHOT_TABLE.match(entry.name) and not is_table(Path(entry.path)):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
    return removed


def _named_by_table(file: Path) -> bool:
    """Whether the latest version of the table holding `file` names it. (A crashed run's
    commit, if it happened, is the latest: no job commits before sweeping.)"""
    table = file.parent
    if not is_table(table):
        return False
    actions = pa.table(_open(table).get_add_actions(flatten=True))
    return file.name in set(actions.column("path").to_pylist())


# --- one writer at a time ---------------------------------------------------------------


class WriterLock:
    """The store's writer lock (`<store>/_writer.lock`, an advisory file lock the kernel
    drops when its holder dies): a second job waits up to `wait_s` for it, then raises
    StoreLocked naming the holder (its job, process, host and since when)."""

    def __init__(self, store: str | os.PathLike[str], job: str, *, wait_s: float = 0.0) -> None:
        self.path = Path(store) / LOCK_FILE
        self.job = job
        self.wait_s = wait_s
        self._file: Any = None

    def __enter__(self) -> WriterLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.seek(0)
                    holder = handle.read().strip() or "an unknown job"
                    handle.close()
                    raise StoreLocked(
                        f"store {self.path.parent} is being written by {holder}; "
                        "wait for it to finish (or pass a longer wait)",
                        holder=holder,
                    ) from None
                time.sleep(LOCK_POLL_S)
        handle.seek(0)
        handle.truncate()
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        handle.write(f"{self.job} (pid {os.getpid()} on {socket.gethostname()} since {since})")
        handle.flush()
        self._file = handle
        return self

    def __exit__(self, *exc: object) -> None:
        handle, self._file = self._file, None
        if handle is not None:
            handle.seek(0)
            handle.truncate()
            handle.close()  # closing drops the lock


@contextlib.contextmanager
def writing(store: str | os.PathLike[str], job: str, wait_s: float = 0.0) -> Iterator[None]:
    """Hold the writer lock, clear what crashed runs left and convert a store of the earlier
    layout (relay.store.migrate), for a job that commits."""
    from relay.store.migrate import migrate_manifest_store

    Path(store).mkdir(parents=True, exist_ok=True)
    with WriterLock(store, job, wait_s=wait_s):
        sweep(store)
        migrate_manifest_store(store)
        yield
