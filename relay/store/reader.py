"""Read the store without Spark (pyarrow only): what a consumer needs to bootstrap.

    reader = StoreReader(store_path)
    reader.last_point(stream)           -> StoredPoint(seq, digest) | None
    reader.last_points()                -> {stream: StoredPoint(seq, digest)}
    reader.snapshot(stream)             -> StoredSnapshot(seq, digest, rows) | None
    reader.records_after(stream, seq)   -> iterator of StoredRecord, in seq order

It reads the store's Delta tables (relay.store.tables), a stream's when it is first asked
about (a consumer reads one stream: it does not load the others). A reader then sees that
stream's records table at that version (`refresh()` moves it on); the files that version
names stay in place while newer commits happen (only a vacuum past the retention window
removes them). Records are read file by file in row groups, so memory stays
bounded whatever the stream's length.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from relay.segment import to_unsigned64
from relay.store.errors import UnknownStoredStream
from relay.store.location import StoreArg, as_location
from relay.store.plan import SNAPSHOT_SCHEMA
from relay.store.tables import (
    StreamState,
    has_stream,
    latest_snapshot,
    load_stream,
    parquet_file,
    read_parquet,
    stream_names,
)

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
    def __init__(self, store_path: StoreArg) -> None:
        self.location = as_location(store_path)
        self._streams: dict[str, StreamState] = {}  # loaded so far

    def refresh(self) -> None:
        self._streams = {}

    def streams(self) -> list[str]:
        return sorted(s for s in stream_names(self.location) if self._state(s).records)

    def last_point(self, stream: str) -> StoredPoint | None:
        """The last stored (seq, digest) of `stream`; None when it has no stored record."""
        if stream not in self._streams and not has_stream(self.location, stream):
            return None
        state = self._state(stream)
        if not state.records:
            return None
        return StoredPoint(state.last_seq, bytes.fromhex(state.last_digest))

    def last_points(self) -> dict[str, StoredPoint]:
        """Per stream the last stored (seq, digest)."""
        points = {s: self.last_point(s) for s in stream_names(self.location)}
        return {stream: point for stream, point in points.items() if point is not None}

    def retained_after(self, stream: str) -> int:
        """The seq of the snapshot the stream's kept records continue from, once retention
        removed older ones (-1: the records start at the beginning)."""
        return self._state(stream).retained_after

    def snapshot(self, stream: str) -> StoredSnapshot | None:
        """The latest snapshot of `stream`, or None if it has none yet."""
        info = latest_snapshot(self.location, stream, self._state(stream))
        if info is None:
            return None
        columns = ["entity", "key", "value", "seq"]
        tables = [read_parquet(self.location, path, columns=columns) for path in info.files]
        rows = pa.concat_tables(tables) if tables else SNAPSHOT_SCHEMA.empty_table().select(columns)
        return StoredSnapshot(info.seq, bytes.fromhex(info.digest), rows)

    def records_after(self, stream: str, after_seq: int = -1) -> Iterator[StoredRecord]:
        """The stored records of `stream` with seq > after_seq in seq order, duplicates
        skipped (as consumers get them from a relay)."""
        for record_file in self._state(stream).files:
            if record_file.last_seq <= after_seq:
                continue
            parquet = parquet_file(self.location, record_file.path)
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
        state = self._streams.get(stream)
        if state is None:
            if not has_stream(self.location, stream):
                raise UnknownStoredStream(f"the store at {self.location} has no stream {stream!r}")
            state = self._streams[stream] = load_stream(self.location, stream)
        return state
