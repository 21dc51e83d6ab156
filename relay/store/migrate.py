"""Converting a store of the earlier layout (a JSON manifest beside Parquet files) into the
Delta tables of relay.store.tables, in place, by the first job that writes the store.

The earlier layout: `<store>/_manifest/<version, 20 digits>.json` (the highest is current)
naming, per stream, the record files under `data/` (path, first and last seq, records),
the last stored point and the latest snapshot (seq, digest, files under `snapshots/`).
Each stream's record files are linked into its records table and added in one commit that
carries the last point, as an ingest's would; its snapshot becomes a snapshot table. The
old files stay until every stream is converted (hard links: nothing is copied), so a crash
part way loses nothing: the next job's sweep removes the links no commit names, and it
converts what has no table yet. At the end the old folders are removed and the manifests
move to `_manifest.migrated/` (kept for a look).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from relay.store.errors import StoreCorrupt
from relay.store.location import StoreLocation, as_location
from relay.store.tables import (
    StagedFile,
    StreamState,
    commit_records,
    commit_snapshot,
    drop_staging,
    is_table,
    new_run,
    position_metadata,
    records_table,
    snapshot_table,
)

log = logging.getLogger("relay.store")

OLD_MANIFEST_DIR = "_manifest"
OLD_FOLDERS = ("data", "snapshots")
MIGRATED_DIR = "_manifest.migrated"
_OLD_MANIFEST_NAME = re.compile(r"^(\d{20})\.json$")


def migrate_manifest_store(store: str | os.PathLike[str]) -> list[str]:
    """Convert the local store if it has the earlier layout (only local stores had it);
    the streams converted. Only the writer lock's holder may call it."""
    root = Path(store)
    folder = root / OLD_MANIFEST_DIR
    versions = sorted(
        name
        for name in (os.listdir(folder) if folder.is_dir() else [])
        if _OLD_MANIFEST_NAME.match(name)
    )
    if not versions:
        return []
    where = folder / versions[-1]
    try:
        document = json.loads(where.read_text())
        streams = document["streams"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise StoreCorrupt(
            f"{where}: unreadable manifest of the earlier layout: {error!r}"
        ) from None
    converted = []
    location = as_location(root)
    run, staging = new_run(location)
    try:
        for stream, state in sorted(streams.items()):
            if _convert_stream(location, stream, state, run, staging):
                converted.append(stream)
    finally:
        drop_staging(location, staging)
    for old in OLD_FOLDERS:
        shutil.rmtree(root / old, ignore_errors=True)
    os.replace(folder, root / MIGRATED_DIR)
    log.warning(
        "store %s: converted from the manifest layout (version %s) to Delta tables: %d "
        "streams; the old manifests are in %s",
        root,
        versions[-1].split(".")[0].lstrip("0") or "0",
        len(converted),
        root / MIGRATED_DIR,
    )
    return converted


def _convert_stream(
    location: StoreLocation, stream: str, state: dict[str, Any], run: str, staging: str
) -> bool:
    root = location.local_root
    converted = False
    if state.get("files") and not is_table(location, records_table(stream)):
        files = [
            StagedFile(
                _link(root, entry["path"], staging),
                entry["records"],
                entry["first_seq"],
                entry["last_seq"],
            )
            for entry in sorted(state["files"], key=lambda f: f["first_seq"])
        ]
        digest = bytes.fromhex(state["last_digest"])
        metadata = position_metadata("migrate", run, files, digest, 0, 0)
        commit_records(location, stream, StreamState(), files, staging, metadata)
        converted = True
    snapshot = state.get("snapshot")
    if snapshot and not is_table(location, snapshot_table(stream, snapshot["seq"])):
        staged = []
        for path in snapshot["files"]:
            linked = _link(root, path, staging)
            staged.append(StagedFile(linked, _rows_in(root / linked)))
        digest = bytes.fromhex(snapshot["digest"])
        commit_snapshot(location, stream, snapshot["seq"], digest, staged, staging)
        converted = True
    return converted


def _link(root: Path, relative: str, staging: str) -> str:
    """A second name for an old file under this run's staging folder (a copy where the
    file system has no hard links), relative to the store; the old file stays until the
    migration is done. (Old names are unique within their folder and free of `%`, which a
    Delta log would decode.)"""
    source = root / relative
    linked = f"{staging}/{Path(relative).parent.name}/{Path(relative).name}"
    target = root / linked
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
    return linked


def _rows_in(path: Path) -> int:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    return int(pq.ParquetFile(path).metadata.num_rows)
