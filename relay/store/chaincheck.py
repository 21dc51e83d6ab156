"""The chain check shared by the Spark jobs and the pyarrow baseline.

Checking a stream's chain is sequential (each digest depends on the one before), but it
can be split into seq ranges checked in parallel: each range checks the links inside it
and reports its first record (its seq, transaction hash and digest) and its last digest;
`stitch` then checks, in seq order, that each range's first record chains from the digest
the previous range (or the store) ended with. Spark gives each task one contiguous range
of a stream (a range partitioning on (stream, seq)), so the work is spread over all cores
even when there is one stream.

`RangeChecker` takes rows sorted by (stream, seq, relay) in Arrow batches, keeps one row
per (stream, seq) (the copies of every relay must carry the same digest), checks the links
and hands the verified rows to a sink. At the first problem in a stream it stops taking
that stream's rows: nothing at or after the problem is passed on.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from relay.core.digest import chain, genesis, tx_hash
from relay.core.messages import Transaction
from relay.store.errors import ChainProblem
from relay.store.layout import stream_dir_name, to_unsigned64

# The columns of the store's record files, in order (a segment's columns minus `relay`).
RECORD_SCHEMA = pa.schema(
    [
        pa.field("stream", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("digest", pa.binary(), nullable=False),
        pa.field("producer_id", pa.binary(), nullable=False),
        pa.field("producer_seq", pa.int64(), nullable=False),
        pa.field("key", pa.binary(), nullable=True),
        pa.field("value", pa.binary(), nullable=False),
        pa.field("kind", pa.int8(), nullable=False),
        pa.field("duplicate", pa.bool_(), nullable=False),
    ]
)
RECORD_COLUMNS = RECORD_SCHEMA.names

# What each range reports about each stream it holds (one row per (range, stream)).
SUMMARY_SCHEMA = pa.schema(
    [
        pa.field("stream", pa.string()),
        pa.field("head_seq", pa.int64()),
        pa.field("head_tx_hash", pa.binary()),
        pa.field("head_digest", pa.binary()),
        pa.field("head_relays", pa.string()),
        pa.field("last_seq", pa.int64()),
        pa.field("last_digest", pa.binary()),
        pa.field("records", pa.int64()),
        pa.field("path", pa.string()),
        pa.field("file_first_seq", pa.int64()),
        pa.field("problem_seq", pa.int64()),
        pa.field("problem", pa.string()),
        pa.field("problem_relays", pa.string()),
    ]
)

RECORD_FILE_COMPRESSION = "zstd"
# Rows per row group of a store file: small enough to read a file in bounded memory.
RECORD_FILE_ROW_GROUP_ROWS = 128 * 1024

# A sink takes a stream's verified rows (a RecordBatch of RECORD_SCHEMA) in order.
Sink = Callable[[str, pa.RecordBatch], None]


def tx_hash_of(producer_id: bytes, producer_seq: int, key: bytes | None, value: bytes) -> bytes:
    return tx_hash(Transaction(producer_id, to_unsigned64(producer_seq), key, value))


def _relays_text(relays: Iterable[int]) -> str:
    return ",".join(str(r) for r in sorted(set(relays)))


@dataclass(slots=True)
class _StreamRange:
    head_seq: int = -1
    head_tx_hash: bytes = b""
    head_digest: bytes = b""
    head_relays: str = ""
    last_seq: int = -1
    last_digest: bytes = b""
    records: int = 0
    problem_seq: int | None = None
    problem: str | None = None
    problem_relays: str | None = None
    path: str | None = None
    file_first_seq: int | None = None


@dataclass(slots=True)
class _Group:
    """The copies of one (stream, seq): rows [index, end) of `batch`, plus copies that
    arrived at the start of the next batch (`more`). Held until the next seq shows up."""

    stream: str
    seq: int
    digest: bytes
    tx_hash: bytes
    batch: pa.RecordBatch  # the rows (RECORD_COLUMNS) holding the first copy
    index: int
    end: int
    relays: pa.Array
    digests: pa.Array
    disagree: bool
    more: list[tuple[bytes, int]]

    def relays_by_digest(self) -> dict[bytes, list[int]]:
        copies = list(
            zip(
                self.digests.slice(self.index, self.end - self.index).to_pylist(),
                self.relays.slice(self.index, self.end - self.index).to_pylist(),
                strict=True,
            )
        )
        by_digest: dict[bytes, list[int]] = {}
        for digest, relay in copies + self.more:
            by_digest.setdefault(digest, []).append(relay)
        return by_digest


class RangeChecker:
    """Checks one contiguous seq range per stream (rows sorted by stream, seq, relay)."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._ranges: dict[str, _StreamRange] = {}
        self._group: _Group | None = None
        # Verified rows not yet passed on: per stream, (batch, row indices) in order.
        self._pending: dict[str, list[tuple[pa.RecordBatch, list[int]]]] = {}

    def feed(self, batch: pa.RecordBatch) -> None:
        """Rows with columns RECORD_COLUMNS + `relay`, continuing the previous batch.

        The copies of a seq are found with vectorised comparisons of each row with the
        one before; Python only touches the first copy of each seq."""
        count = batch.num_rows
        if count == 0:
            return
        stream_col = batch.column("stream")
        seq_col = batch.column("seq")
        digest_col = batch.column("digest")
        relay_col = batch.column("relay")
        first = 0
        held = self._group
        while (
            held is not None
            and first < count
            and seq_col[first].as_py() == held.seq
            and stream_col[first].as_py() == held.stream
        ):
            copy = (digest_col[first].as_py(), relay_col[first].as_py())
            held.more.append(copy)
            held.disagree |= copy[0] != held.digest
            first += 1
        if first == count:
            return
        rest = count - first
        if rest > 1:
            same = pc.and_(
                pc.equal(stream_col.slice(first + 1), stream_col.slice(first, rest - 1)),
                pc.equal(seq_col.slice(first + 1), seq_col.slice(first, rest - 1)),
            )
            later_starts = pc.add(pc.indices_nonzero(pc.invert(same)), first + 1)
            starts = [first, *later_starts.to_pylist()]
            differs = pc.and_(
                same, pc.not_equal(digest_col.slice(first + 1), digest_col.slice(first, rest - 1))
            )
            differing = pc.add(pc.indices_nonzero(differs), first + 1).to_pylist()
        else:
            starts, differing = [first], []
        take = pa.array(starts, pa.int64())
        streams = stream_col.take(take).to_pylist()
        seqs = seq_col.take(take).to_pylist()
        digests = digest_col.take(take).to_pylist()
        producer_ids = batch.column("producer_id").take(take).to_pylist()
        producer_seqs = batch.column("producer_seq").take(take).to_pylist()
        keys = batch.column("key").take(take).to_pylist()
        values = batch.column("value").take(take).to_pylist()
        records = batch.select(RECORD_COLUMNS)
        ranges = self._ranges
        ends = [*starts[1:], count]
        for position, start in enumerate(starts):
            if self._group is not None:
                self._settle(self._group)
                self._group = None
            stream = streams[position]
            state = ranges.get(stream)
            if state is None:
                state = ranges[stream] = _StreamRange()
            if state.problem is not None:
                continue
            end = ends[position]
            self._group = _Group(
                stream,
                seqs[position],
                digests[position],
                tx_hash_of(
                    producer_ids[position],
                    producer_seqs[position],
                    keys[position],
                    values[position],
                ),
                records,
                start,
                end,
                relay_col,
                digest_col,
                bool(differing) and any(start < row < end for row in differing),
                [],
            )
        self._flush_rows()

    def finish(self) -> list[dict[str, object]]:
        """Settle the last group; one summary row (SUMMARY_SCHEMA) per stream seen."""
        if self._group is not None:
            self._settle(self._group)
            self._group = None
        self._flush_rows()
        return [
            {
                "stream": stream,
                "head_seq": state.head_seq if state.records else state.problem_seq,
                "head_tx_hash": state.head_tx_hash,
                "head_digest": state.head_digest,
                "head_relays": state.head_relays,
                "last_seq": state.last_seq,
                "last_digest": state.last_digest,
                "records": state.records,
                "path": state.path,
                "file_first_seq": state.file_first_seq,
                "problem_seq": state.problem_seq,
                "problem": state.problem,
                "problem_relays": state.problem_relays,
            }
            for stream, state in self._ranges.items()
        ]

    def _flush_rows(self) -> None:
        for stream, parts in self._pending.items():
            for batch, indices in parts:
                if len(indices) == batch.num_rows:
                    self._sink(stream, batch)
                else:
                    self._sink(stream, batch.take(pa.array(indices, pa.int32())))
        self._pending = {}

    def _settle(self, group: _Group) -> None:
        """Check a complete group; pass its row on if it is good."""
        state = self._ranges[group.stream]
        if group.disagree:
            by_digest = group.relays_by_digest()
            sides = "; ".join(
                f"relays {_relays_text(rs)} have {digest.hex()}"
                for digest, rs in sorted(by_digest.items())
            )
            state.problem_seq = group.seq
            state.problem = f"relays disagree on the digest at seq {group.seq}: {sides}"
            state.problem_relays = _relays_text(r for rs in by_digest.values() for r in rs)
            return
        if state.records == 0:
            state.head_seq = group.seq
            state.head_tx_hash = group.tx_hash
            state.head_digest = group.digest
            state.head_relays = _relays_text(group.relays_by_digest()[group.digest])
        elif chain(state.last_digest, group.seq, group.tx_hash) != group.digest:
            state.problem_seq = group.seq
            state.problem = (
                f"the record at seq {group.seq} does not chain from seq {state.last_seq} "
                f"(records missing in between, or corrupt)"
            )
            state.problem_relays = _relays_text(group.relays_by_digest()[group.digest])
            return
        state.last_seq = group.seq
        state.last_digest = group.digest
        state.records += 1
        parts = self._pending.setdefault(group.stream, [])
        if parts and parts[-1][0] is group.batch:
            parts[-1][1].append(group.index)
        else:
            parts.append((group.batch, [group.index]))


def check_sorted(batches: Iterable[pa.RecordBatch], sink: Sink) -> list[dict[str, object]]:
    checker = RangeChecker(sink)
    for batch in batches:
        checker.feed(batch)
    return checker.finish()


@dataclass(slots=True)
class StreamOutcome:
    """What `stitch` decided for one stream: the files to commit, the new last point."""

    stream: str
    paths: list[tuple[str, int, int, int]]  # (path, first_seq, last_seq, records)
    last_seq: int
    last_digest: bytes
    records: int
    problem: ChainProblem | None


def stitch(
    stream: str,
    summaries: list[dict[str, object]],
    start_seq: int,
    start_digest: bytes,
) -> StreamOutcome:
    """Join the ranges of one stream (any order) into one chain from (start_seq,
    start_digest); keep the ranges up to the first problem."""
    outcome = StreamOutcome(stream, [], start_seq, start_digest, 0, None)
    for summary in sorted(summaries, key=lambda s: _int(s["head_seq"])):
        # (a range whose first seq already failed reports head_seq = problem_seq)
        records = _int(summary["records"])
        if records:
            head_seq = _int(summary["head_seq"])
            head_digest = _bytes(summary["head_digest"])
            if chain(outcome.last_digest, head_seq, _bytes(summary["head_tx_hash"])) != head_digest:
                relays = str(summary["head_relays"])
                outcome.problem = ChainProblem(
                    f"stream {stream!r}: the record at seq {head_seq} (relays {relays}) does not "
                    f"chain from seq {outcome.last_seq} (records missing in between, or "
                    "corrupt)",
                    stream=stream,
                    seq=head_seq,
                    relays=_relay_tuple(relays),
                )
                return outcome
            if summary["path"] is not None:
                outcome.paths.append(
                    (
                        str(summary["path"]),
                        _int(summary["file_first_seq"]),
                        _int(summary["last_seq"]),
                        records,
                    )
                )
            outcome.last_seq = _int(summary["last_seq"])
            outcome.last_digest = _bytes(summary["last_digest"])
            outcome.records += records
        if summary["problem"] is not None:
            outcome.problem = ChainProblem(
                f"stream {stream!r}: {summary['problem']}",
                stream=stream,
                seq=_int(summary["problem_seq"]),
                relays=_relay_tuple(str(summary["problem_relays"])),
            )
            return outcome
    return outcome


def _int(value: object) -> int:
    assert isinstance(value, int), value
    return value


def _bytes(value: object) -> bytes:
    assert isinstance(value, bytes), value
    return value


def _relay_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(r) for r in text.split(",") if r)


def start_point(stream: str, last_seq: int | None, last_digest: bytes | None) -> tuple[int, bytes]:
    if last_seq is None or last_digest is None:
        return -1, genesis(stream)
    return last_seq, last_digest


class RecordFileWriter:
    """A sink that writes each stream's verified rows to one Parquet file per range under
    `directory`/stream=<escaped>/, named `<prefix>-<first_seq>.parquet`, in row groups of
    RECORD_FILE_ROW_GROUP_ROWS."""

    def __init__(self, directory: str, prefix: str) -> None:
        self.directory = directory
        self.prefix = prefix
        self._files: dict[str, _OpenFile] = {}

    def __call__(self, stream: str, rows: pa.RecordBatch) -> None:
        if rows.num_rows == 0:
            return
        entry = self._files.get(stream)
        if entry is None:
            first_seq = rows.column("seq")[0].as_py()
            folder = os.path.join(self.directory, stream_dir_name(stream))
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"{self.prefix}-{first_seq}.parquet")
            writer = pq.ParquetWriter(
                path,
                RECORD_SCHEMA,
                compression=RECORD_FILE_COMPRESSION,
                use_dictionary=["stream", "kind", "duplicate"],
            )
            entry = self._files[stream] = _OpenFile(writer, path, first_seq)
        if not rows.schema.equals(RECORD_SCHEMA):  # Spark's batches: every field nullable
            rows = rows.cast(RECORD_SCHEMA)
        entry.buffered.append(rows)
        entry.buffered_rows += rows.num_rows
        if entry.buffered_rows >= RECORD_FILE_ROW_GROUP_ROWS:
            entry.write_buffered()

    def close(self) -> dict[str, tuple[str, int]]:
        """Close every file: stream -> (path, first seq)."""
        paths = {}
        for stream, entry in self._files.items():
            entry.write_buffered()
            entry.writer.close()
            paths[stream] = (entry.path, entry.first_seq)
        self._files = {}
        return paths


@dataclass(slots=True)
class _OpenFile:
    writer: pq.ParquetWriter
    path: str
    first_seq: int
    buffered: list[pa.RecordBatch] = field(default_factory=list)
    buffered_rows: int = 0

    def write_buffered(self) -> None:
        if self.buffered:
            table = pa.Table.from_batches(self.buffered, RECORD_SCHEMA)
            self.writer.write_table(table, row_group_size=max(1, table.num_rows))
            self.buffered = []
            self.buffered_rows = 0


def check_and_write(
    batches: Iterable[pa.RecordBatch], directory: str, prefix: str | None = None
) -> Iterator[pa.RecordBatch]:
    """Check one range and write its verified rows; yields its summary rows (one batch).
    The body of the Spark task (`mapInArrow`) and of the baseline alike."""
    writer = RecordFileWriter(directory, prefix or uuid.uuid4().hex)
    summaries = check_sorted(batches, writer)
    paths = writer.close()
    for summary in summaries:
        written = paths.get(str(summary["stream"]))
        if written is not None:
            summary["path"], summary["file_first_seq"] = written
    yield pa.RecordBatch.from_pylist(summaries, schema=SUMMARY_SCHEMA)


def sort_for_check(table: pa.Table) -> pa.Table:
    return table.sort_by([("stream", "ascending"), ("seq", "ascending"), ("relay", "ascending")])


__all__ = [
    "RECORD_COLUMNS",
    "RECORD_SCHEMA",
    "SUMMARY_SCHEMA",
    "RangeChecker",
    "RecordFileWriter",
    "StreamOutcome",
    "check_and_write",
    "check_sorted",
    "sort_for_check",
    "start_point",
    "stitch",
    "tx_hash_of",
]
