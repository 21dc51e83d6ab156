"""The store's manifest: which files make up the store, and where each stream stands.

    <store>/_manifest/<version, 20 digits>.json   one per commit; the highest is current
    <store>/data/stream=<escaped>/<run>-<first_seq>.parquet       committed records
    <store>/snapshots/stream=<escaped>/<run>-....parquet           snapshot rows
    <store>/_staging/<run>/                                      a job's files before commit

A job writes its files under `_staging/<run>`, moves them to their place (still invisible:
no manifest names them) and commits by creating the next manifest version, exclusively
(a hard link of a complete, flushed temporary file: it either appears whole or not at
all, and a concurrent writer of the same version fails with ConcurrentCommit). A crash at
any point before the link leaves the store as the previous manifest describes it; the
unlisted files it left are removed by `vacuum`.

Per stream the manifest keeps: the last stored point (seq, digest), the record count, the
record files in seq order (path, first seq, last seq, records), the spool segments already
ingested, and the latest snapshot (seq, digest, rows, files).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relay.store.errors import ConcurrentCommit, StoreCorrupt

FORMAT_VERSION = 1
MANIFEST_DIR = "_manifest"
DATA_DIR = "data"
SNAPSHOT_DIR = "snapshots"
STAGING_DIR = "_staging"
MANIFEST_NAME = re.compile(r"^(\d{20})\.json$")
# Manifests (and the files only they name) kept by `vacuum` for readers still on them.
VACUUM_KEEP_VERSIONS = 10


@dataclass(slots=True)
class RecordFile:
    path: str  # relative to the store
    first_seq: int
    last_seq: int
    records: int


@dataclass(slots=True)
class SnapshotInfo:
    seq: int
    digest: str  # hex
    rows: int
    files: list[str]  # relative to the store


@dataclass(slots=True)
class StreamState:
    last_seq: int = -1
    last_digest: str = ""  # hex; "" until the first record (the genesis digest)
    records: int = 0
    files: list[RecordFile] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)  # "relay=<id>/<first>-<last>.parquet"
    snapshot: SnapshotInfo | None = None

    @property
    def last_digest_bytes(self) -> bytes | None:
        return bytes.fromhex(self.last_digest) if self.last_digest else None


@dataclass(slots=True)
class Manifest:
    version: int = 0
    committed_ms: int = 0
    streams: dict[str, StreamState] = field(default_factory=dict)

    def to_json(self) -> str:
        document = {"format": FORMAT_VERSION, **asdict(self)}
        return json.dumps(document, separators=(",", ":"), sort_keys=True)

    @staticmethod
    def from_json(text: str, where: str) -> Manifest:
        try:
            document = json.loads(text)
            if document.get("format") != FORMAT_VERSION:
                raise StoreCorrupt(f"{where}: unknown manifest format {document.get('format')!r}")
            streams = {}
            for name, raw in document["streams"].items():
                snapshot = raw.get("snapshot")
                streams[name] = StreamState(
                    last_seq=raw["last_seq"],
                    last_digest=raw["last_digest"],
                    records=raw["records"],
                    files=[RecordFile(**f) for f in raw["files"]],
                    segments=list(raw["segments"]),
                    snapshot=SnapshotInfo(**snapshot) if snapshot else None,
                )
            return Manifest(document["version"], document["committed_ms"], streams)
        except (ValueError, KeyError, TypeError) as error:
            raise StoreCorrupt(f"{where}: unreadable manifest: {error!r}") from None


def manifest_versions(store: str | os.PathLike[str]) -> list[int]:
    folder = Path(store) / MANIFEST_DIR
    if not folder.is_dir():
        return []
    return sorted(
        int(match.group(1)) for name in os.listdir(folder) if (match := MANIFEST_NAME.match(name))
    )


def manifest_path(store: str | os.PathLike[str], version: int) -> Path:
    return Path(store) / MANIFEST_DIR / f"{version:020d}.json"


def load_manifest(store: str | os.PathLike[str], version: int | None = None) -> Manifest:
    """The current manifest (or a given version); an empty one for a new store."""
    if version is None:
        versions = manifest_versions(store)
        if not versions:
            return Manifest()
        version = versions[-1]
    path = manifest_path(store, version)
    try:
        text = path.read_text()
    except OSError as error:
        raise StoreCorrupt(f"cannot read manifest {path}: {error}") from None
    return Manifest.from_json(text, str(path))


def commit_manifest(store: str | os.PathLike[str], manifest: Manifest) -> None:
    """Make `manifest` (whose version must be the current one + 1) the store's state."""
    folder = Path(store) / MANIFEST_DIR
    folder.mkdir(parents=True, exist_ok=True)
    manifest.committed_ms = int(time.time() * 1000)
    temporary = folder / f".{manifest.version:020d}.{uuid.uuid4().hex}.tmp"
    with open(temporary, "w") as sink:
        sink.write(manifest.to_json())
        sink.flush()
        os.fsync(sink.fileno())
    try:
        os.link(temporary, manifest_path(store, manifest.version))
    except FileExistsError:
        raise ConcurrentCommit(
            f"store {store}: manifest version {manifest.version} was committed by another "
            "writer; run the job again"
        ) from None
    finally:
        temporary.unlink()
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def new_run(store: str | os.PathLike[str]) -> tuple[str, Path]:
    """A fresh run id and its empty staging folder."""
    run = f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:12]}"
    staging = Path(store) / STAGING_DIR / run
    staging.mkdir(parents=True)
    return run, staging


def publish(store: str | os.PathLike[str], staged_path: str, kind_dir: str) -> str:
    """Move a staged file to its place under `kind_dir` (same sub-path); the new path
    relative to the store. The file stays invisible until a manifest names it."""
    store_path = Path(store)
    staged = Path(staged_path)
    # staged = <store>/_staging/<run>/<sub>/<name>
    relative = staged.relative_to(store_path / STAGING_DIR)
    sub = Path(*relative.parts[1:])
    target = store_path / kind_dir / sub
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged, target)
    return str(Path(kind_dir) / sub)


def drop_staging(store: str | os.PathLike[str], staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


def vacuum(store: str | os.PathLike[str]) -> int:
    """Remove what no recent manifest names: leftovers of crashed or failed runs, files
    replaced long ago, old manifests. Single writer: run it only from the job that
    commits. Returns the number of files removed."""
    store_path = Path(store)
    versions = manifest_versions(store)
    keep = versions[-VACUUM_KEEP_VERSIONS:]
    referenced: set[str] = set()
    for version in keep:
        for state in load_manifest(store, version).streams.values():
            referenced.update(f.path for f in state.files)
            if state.snapshot:
                referenced.update(state.snapshot.files)
    removed = 0
    shutil.rmtree(store_path / STAGING_DIR, ignore_errors=True)
    for kind_dir in (DATA_DIR, SNAPSHOT_DIR):
        for directory, _subdirs, files in os.walk(store_path / kind_dir):
            for name in files:
                path = Path(directory) / name
                if str(path.relative_to(store_path)) not in referenced:
                    with contextlib.suppress(OSError):
                        path.unlink()
                        removed += 1
    for version in versions[: -VACUUM_KEEP_VERSIONS or None]:
        if version not in keep:
            with contextlib.suppress(OSError):
                manifest_path(store, version).unlink()
                removed += 1
    return removed
