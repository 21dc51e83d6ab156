"""Read the store without Spark (pyarrow only): what a consumer needs to bootstrap.

    reader = StoreReader(store_path)
    reader.last_points()                -> {stream: StoredPoint(seq, digest)}
    reader.snapshot(stream)             -> StoredSnapshot(seq, digest, rows) | None
    reader.records_after(stream, seq)   -> iterator of StoredRecord, in seq order

It reads the store's Delta tables (relay.store.tables). A reader sees each stream's records
table at the version current when it was made (`refresh()` moves it on); the files that
version names stay in place while newer commits happen (only a vacuum past the retention
window removes them). Records are read file by file in row groups, so memory stays
bounded whatever the stream's length.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from relay.segment import to_unsigned64
from relay.store.errors import StoreCorrupt, UnknownStoredStream
from relay.store.plan import SNAPSHOT_SCHEMA
from relay.store.tables import StoreState, StreamState, latest_snapshot, load_store

RECORD_READ_COLUMNS = ["seq", "key", "value", "producer_id", "producer_seq", "kind", "duplicate"]


@dataclass(frozen=True, slots=True)
class StoredPoint:
    seq: int
    digest: bytes


@dataclass(frozen=True, slots=True)
class StoredRecord:
    seq: int
    key: bytes | None
    value: bytes
    producer_id: bytes
    producer_seq: int
    kind: int


@dataclass(frozen=True, slots=True)
class StoredSnapshot:
    seq: int
    digest: bytes
    rows: pa.Table  # columns entity (str), key (bytes), value (bytes), seq (int64)


class StoreReader:
    def __init__(self, store_path: str | os.PathLike[str]) -> None:
        self.store_path = Path(store_path)
        self._store: StoreState = load_store(self.store_path)

    def refresh(self) -> None:
        self._store = load_store(self.store_path)

    @property
    def versions(self) -> dict[str, int]:
        """Per stream the version of its records table this reader reads."""
        return self._store.versions()

    def streams(self) -> list[str]:
        return sorted(s for s, st in self._store.streams.items() if st.records)

    def last_points(self) -> dict[str, StoredPoint]:
        """Per stream the last stored (seq, digest)."""
        return {
            stream: StoredPoint(state.last_seq, bytes.fromhex(state.last_digest))
            for stream, state in self._store.streams.items()
            if state.records
        }

    def retained_after(self, stream: str) -> int:
        """The seq of the snapshot the stream's kept records continue from, once retention
        removed older ones (-1: the records start at the beginning)."""
        return self._state(stream).retained_after

    def snapshot(self, stream: str) -> StoredSnapshot | None:
        """The latest snapshot of `stream`, or None if it has none yet."""
        info = latest_snapshot(self.store_path, stream, self._state(stream))
        if info is None:
            return None
        columns = ["entity", "key", "value", "seq"]
        tables = [self._read(path, columns=columns) for path in info.files]
        rows = pa.concat_tables(tables) if tables else SNAPSHOT_SCHEMA.empty_table().select(columns)
        return StoredSnapshot(info.seq, bytes.fromhex(info.digest), rows)

    def records_after(self, stream: str, after_seq: int = -1) -> Iterator[StoredRecord]:
        """The stored records of `stream` with seq > after_seq in seq order, duplicates
        skipped (as consumers get them from a relay)."""
        for record_file in self._state(stream).files:
            if record_file.last_seq <= after_seq:
                continue
            path = self.store_path / record_file.path
            try:
                parquet = pq.ParquetFile(path)
            except OSError as error:
                raise StoreCorrupt(f"store file {path} unreadable: {error}") from None
            for batch in parquet.iter_batches(columns=RECORD_READ_COLUMNS):
                # Past every seq yielded so far too: files that overlap (a table written
                # by hand; verify names it) never yield a seq twice.
                keep = pc.and_(
                    pc.greater(batch.column("seq"), after_seq),
                    pc.invert(batch.column("duplicate")),
                )
                rows = batch.filter(keep)
                if rows.num_rows:
                    after_seq = max(after_seq, pc.max(rows.column("seq")).as_py())
                for seq, key, value, producer_id, producer_seq, kind in zip(
                    rows.column("seq").to_pylist(),
                    rows.column("key").to_pylist(),
                    rows.column("value").to_pylist(),
                    rows.column("producer_id").to_pylist(),
                    rows.column("producer_seq").to_pylist(),
                    rows.column("kind").to_pylist(),
                    strict=True,
                ):
                    yield StoredRecord(
                        seq, key, value, producer_id, to_unsigned64(producer_seq), kind
                    )

    def _state(self, stream: str) -> StreamState:
        state = self._store.streams.get(stream)
        if state is None:
            raise UnknownStoredStream(f"the store at {self.store_path} has no stream {stream!r}")
        return state

    def _read(self, relative: str, columns: list[str]) -> pa.Table:
        path = self.store_path / relative
        try:
            return pq.read_table(path, columns=columns)
        except OSError as error:
            raise StoreCorrupt(f"store file {path} unreadable: {error}") from None
