"""The chain check shared by the Spark jobs and the pyarrow baseline.

Checking a stream's chain is sequential (each digest depends on the one before), but it
can be split into seq ranges checked in parallel: each range checks the links inside it
and reports its first record (its seq, transaction hash and digest) and its last digest;
`stitch` then checks, in seq order, that each range's first record chains from the digest
the previous range (or the store) ended with. Spark gives each task one contiguous range
of a stream (a range partitioning on (stream, seq)), so the work is spread over all cores
even when there is one stream.

Ingest checks a range straight from the relays' segments (`check_segment_range`): the
segments of each relay are named by their first and last seq, so the driver knows which
ones hold a range and no shuffle is needed to bring the copies of a seq together. The
copies are grouped by (seq, relay); the digest more than half of a seq's copies carry wins
(the others are outvoted, and named), and one copy per seq is stored, another relay's if
the first one's content does not chain. `RangeChecker` (used by verify) takes rows
already sorted by (stream, seq, relay) in Arrow batches and checks that every copy agrees
(a stored store has one copy per seq). Both stop at a stream's first problem: nothing at
or after it is passed on.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from relay.core.digest import chain, genesis, tx_hash
from relay.core.messages import Transaction
from relay.segment import SEGMENT_SCHEMA, SegmentRef, stream_dir_name, to_unsigned64
from relay.store.errors import ChainProblem
from relay.store.location import Folder

# The columns of the store's record files, in order: a segment's columns minus `relay`.
RECORD_SCHEMA = SEGMENT_SCHEMA.remove(SEGMENT_SCHEMA.get_field_index("relay"))
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
        # copies the others outvoted: "relay:seq" joined by ","
        pa.field("outvoted", pa.string()),
        # copies of stored records whose content was compared with the stored one's
        pa.field("copies_checked", pa.int64()),
    ]
)

RECORD_FILE_COMPRESSION = "zstd"
# Rows per row group of a store file: small enough to read a file in bounded memory.
RECORD_FILE_ROW_GROUP_ROWS = 128 * 1024

# A sink takes a stream's verified rows (a RecordBatch of RECORD_SCHEMA) in order.
Sink = Callable[[str, pa.RecordBatch], None]


def tx_hash_of(
    producer_id: bytes, producer_seq: int, key: bytes | None, value: bytes, kind: int
) -> bytes:
    """The relay's hash of a stored transaction (`producer_seq` as stored: signed)."""
    return tx_hash(Transaction(producer_id, to_unsigned64(producer_seq), key, value, kind))


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
    outvoted: str | None = None
    copies_checked: int = 0


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
        kinds = batch.column("kind").take(take).to_pylist()
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
                    kinds[position],
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
        for state in self._ranges.values():
            if not state.records:  # the range's first seq already failed
                state.head_seq = state.problem_seq if state.problem_seq is not None else -1
        return [_summary_row(stream, state) for stream, state in self._ranges.items()]

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
    # (relay, seq) of every copy the other relays' copies outvoted (module docstring)
    outvoted: list[tuple[int, int]] = field(default_factory=list)
    copies_checked: int = 0  # other relays' copies of stored records compared in content


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
            outcome.outvoted.extend(parse_outvoted(summary.get("outvoted")))
            outcome.copies_checked += _int(summary.get("copies_checked") or 0)
        if summary["problem"] is not None:
            outcome.problem = ChainProblem(
                f"stream {stream!r}: {summary['problem']}",
                stream=stream,
                seq=_int(summary["problem_seq"]),
                relays=_relay_tuple(str(summary["problem_relays"])),
            )
            return outcome
    return outcome


def parse_outvoted(text: object) -> list[tuple[int, int]]:
    """The (relay, seq) pairs of a summary's `outvoted` text."""
    if not text:
        return []
    pairs = []
    for item in str(text).split(","):
        relay, seq = item.split(":")
        pairs.append((int(relay), int(seq)))
    return pairs


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
    RECORD_FILE_ROW_GROUP_ROWS; the paths it returns are relative to the store."""

    def __init__(self, directory: Folder, prefix: str) -> None:
        self.directory = directory
        self.prefix = prefix
        self._files: dict[str, _OpenFile] = {}

    def __call__(self, stream: str, rows: pa.RecordBatch) -> None:
        if rows.num_rows == 0:
            return
        entry = self._files.get(stream)
        if entry is None:
            first_seq = rows.column("seq")[0].as_py()
            name = f"{stream_dir_name(stream)}/{self.prefix}-{first_seq}.parquet"
            path = f"{self.directory.relative}/{name}"
            writer = self.directory.parquet_writer(
                name,
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


# --- checking a range of a stream straight from the relays' segments ----------------------

# The columns read from every copy (to group the copies and check they agree), and the
# ones read only for the copy that is stored.
COPY_COLUMNS = ["seq", "digest"]
STORED_ONLY_COLUMNS = ["producer_id", "producer_seq", "key", "value", "kind", "duplicate"]
# Records turned into Python objects at a time by the chain loop: bounds a task's memory.
CHAIN_LOOP_ROWS = 64 * 1024


def check_segment_range(
    stream: str,
    after_seq: int,
    last_seq: int,
    segments: Sequence[SegmentRef],
    directory: Folder,
    prefix: str | None = None,
    *,
    after_digest: bytes | None = None,
    before: Sequence[SegmentRef] = (),
) -> list[dict[str, object]]:
    """Check the records of `stream` in (after_seq, last_seq] and write the verified ones
    to one record file under `directory`. `segments` must be every segment (of any relay)
    holding records in the range. Returns the range's summary (one SUMMARY_SCHEMA row, or
    none if the range holds no record). The body of a Spark ingest task and of the
    baseline alike.

    Only `seq` and `digest` are read from every copy: the copies are grouped with
    vectorised comparisons, and the other columns are read for the stored copy only (the
    lowest relay's). Python touches each stored record once, to recompute its link."""
    ordered = sorted(segments, key=lambda s: (s.relay, s.first_seq))
    copies = _read_copies(ordered, after_seq, last_seq)
    if copies.num_rows == 0:
        return []
    groups = _CopyGroups(copies, [s.relay for s in ordered])
    choice = groups.choose()
    agreeing = len(choice.rows)
    start_digest = after_digest if after_digest is not None else _digest_at(after_seq, before)
    while True:
        chosen = copies.take(pa.array(choice.rows, pa.int64()))
        records = _stored_records(stream, ordered, chosen)
        checked, head_tx_hash = _check_links(records)
        # A copy that does not chain from the record before it (the first one: from the
        # digest at after_seq, when known): another relay's copy with the same digest may
        # (the chosen one's content is corrupt).
        if checked and start_digest is not None:
            head = chain(start_digest, groups.seq_of(0), head_tx_hash)
            if head != records.column("digest")[0].as_py():
                checked = 0
        if checked >= records.num_rows or (checked == 0 and start_digest is None):
            break
        previous_digest = records.column("digest")[checked - 1].as_py() if checked else start_digest
        assert previous_digest is not None
        better = groups.copy_that_chains(checked, choice.rows[checked], previous_digest, ordered)
        if better is None:
            if checked == 0:  # the driver names the problem, as for any first record
                checked, head_tx_hash = _check_links(records)
            break
        choice.outvoted.append((groups.relay_of_row(choice.rows[checked]), groups.seq_of(checked)))
        choice.rows[checked] = better
    state = _StreamRange()
    if checked:
        state.head_seq = records.column("seq")[0].as_py()
        state.head_tx_hash = head_tx_hash
        state.head_digest = records.column("digest")[0].as_py()
        state.head_relays = groups.relays_text(0)
        state.last_seq = records.column("seq")[checked - 1].as_py()
        state.last_digest = records.column("digest")[checked - 1].as_py()
        state.records = checked
    if checked < records.num_rows:
        broken_seq = records.column("seq")[checked].as_py()
        state.problem_seq = broken_seq
        state.problem = (
            f"the record at seq {broken_seq} does not chain from seq {state.last_seq} "
            "(records missing in between, or corrupt)"
        )
        state.problem_relays = groups.relays_text(checked)
    elif agreeing < groups.count:
        state.problem_seq = groups.seq_of(agreeing)
        state.problem = groups.disagreement_text(agreeing) + " (no majority of the copies)"
        state.problem_relays = groups.relays_text(agreeing)
    if not checked:
        state.head_seq = state.problem_seq if state.problem_seq is not None else -1
    stored = [(relay, seq) for relay, seq in choice.outvoted if checked and seq <= state.last_seq]
    if checked:
        # Every other copy of a stored record, with the same digest, must hold the same
        # content (the digest covers it, so a copy that differs is corrupt on its relay).
        stored_parts = chosen.column("part").combine_chunks().slice(0, checked)
        differing, state.copies_checked = _differing_copies(
            ordered, records.slice(0, checked), stored_parts
        )
        stored = sorted(set(stored) | set(differing))
    if stored:
        state.outvoted = ",".join(f"{relay}:{seq}" for relay, seq in stored)
    writer = RecordFileWriter(directory, prefix or uuid.uuid4().hex)
    for batch in records.slice(0, checked).to_batches(max_chunksize=RECORD_FILE_ROW_GROUP_ROWS):
        writer(stream, batch)
    written = writer.close().get(stream)
    if written is not None:
        state.path, state.file_first_seq = written
    return [_summary_row(stream, state)]


# The content of a record a copy must match (its relay's own duplicate flag may differ).
CONTENT_COLUMNS = ["producer_id", "producer_seq", "key", "value", "kind"]


def _differing_copies(
    segments: Sequence[SegmentRef], stored: pa.Table, parts: pa.Array
) -> tuple[list[tuple[int, int]], int]:
    """The (relay, seq) of every copy in `segments` of a stored record with the stored
    digest but other content, and how many copies were compared (`parts`: the index in
    `segments` each stored record was read from, itself not compared). One segment at a
    time, column by column: no Python per record."""
    import numpy as np

    stored_seqs = stored.column("seq").to_numpy()  # ascending
    first, last = int(stored_seqs[0]), int(stored_seqs[-1])
    stored_parts = parts.to_numpy()
    differing: list[tuple[int, int]] = []
    compared = 0
    for part, segment in enumerate(segments):
        if segment.last_seq < first or segment.first_seq > last:
            continue
        seqs = pq.read_table(segment.path, columns=["seq"]).column("seq").to_numpy()
        # The position of each of the segment's seqs among the stored ones (both sorted).
        at = np.minimum(np.searchsorted(stored_seqs, seqs), len(stored_seqs) - 1)
        # Stored, and not the very copy that was stored.
        wanted = (stored_seqs[at] == seqs) & (stored_parts[at] != part)
        rows = pa.array(np.flatnonzero(wanted))
        at = pa.array(at[wanted])
        if len(rows) == 0:
            continue
        copy = pq.read_table(segment.path, columns=["digest", *CONTENT_COLUMNS]).take(rows)
        reference = stored.select(["digest", *CONTENT_COLUMNS]).take(at)
        same_digest = pc.equal(copy.column("digest"), reference.column("digest"))
        compared += pc.sum(same_digest).as_py() or 0
        same = same_digest
        for name in CONTENT_COLUMNS:
            mine, theirs = copy.column(name), reference.column(name)
            equal = pc.fill_null(
                pc.equal(mine, theirs), pc.and_(pc.is_null(mine), pc.is_null(theirs))
            )
            same = pc.and_(same, equal)
        # Copies with another digest were outvoted by the digest vote already.
        bad = pc.and_(same_digest, pc.invert(same))
        for seq in pa.array(seqs).take(rows.filter(bad)).to_pylist():
            differing.append((segment.relay, seq))
    return differing, compared


def _digest_at(seq: int, segments: Sequence[SegmentRef]) -> bytes | None:
    """The digest most copies of the record at `seq` in `segments` carry (None: no copy,
    or no majority)."""
    copies = _read_copies(segments, seq - 1, seq)
    if copies.num_rows == 0:
        return None
    counts: dict[bytes, int] = {}
    for digest in copies.column("digest").to_pylist():
        counts[digest] = counts.get(digest, 0) + 1
    digest, count = max(counts.items(), key=lambda item: item[1])
    return digest if count * 2 > copies.num_rows else None


def _read_copies(segments: Sequence[SegmentRef], after_seq: int, last_seq: int) -> pa.Table:
    """`seq`, `digest`, `part` (index in `segments`) and `row` (in its segment) of every copy
    in (after_seq, last_seq], sorted by (seq, part): the copies of a seq together, the
    lowest relay's first (`segments` is in relay order)."""
    parts = []
    for part, segment in enumerate(segments):
        table = pq.read_table(segment.path, columns=COPY_COLUMNS)
        seqs = table.column("seq")
        rows = pc.indices_nonzero(
            pc.and_(pc.greater(seqs, after_seq), pc.less_equal(seqs, last_seq))
        )
        if len(rows) == 0:
            continue
        parts.append(
            pa.table(
                {
                    "seq": seqs.take(rows),
                    "digest": table.column("digest").take(rows),
                    "part": pa.repeat(pa.scalar(part, pa.int32()), len(rows)),
                    "row": rows,
                }
            )
        )
    if not parts:
        return pa.table({"seq": pa.array([], pa.int64())})
    copies = pa.concat_tables(parts)
    order = pc.sort_indices(copies, sort_keys=[("seq", "ascending"), ("part", "ascending")])
    return copies.take(order).combine_chunks()


@dataclass(slots=True)
class _Choice:
    """The row of the copy stored for each seq (in order, as far as a majority decides),
    and the (relay, seq) of the copies outvoted."""

    rows: list[int]
    outvoted: list[tuple[int, int]]


class _CopyGroups:
    """The groups of copies (one group per seq) of a sorted copies table."""

    def __init__(self, copies: pa.Table, relay_of_part: list[int]) -> None:
        self.copies = copies
        self.relay_of_part = relay_of_part
        seqs = copies.column("seq").combine_chunks()
        rows = len(seqs)
        self.rows = rows
        if rows > 1:
            later_starts = pc.not_equal(seqs.slice(1), seqs.slice(0, rows - 1))
            is_start = pa.concat_arrays([pa.array([True]), later_starts])
        else:
            is_start = pa.array([True])
        self.starts = pc.indices_nonzero(is_start)
        self.count = len(self.starts)
        self._group_of_row = pc.subtract(pc.cumulative_sum(is_start.cast(pa.int64())), 1)

    def choose(self) -> _Choice:
        """One copy per seq, in order, up to the first seq whose copies hold no majority
        digest: the lowest relay's copy where all agree, else the lowest relay's copy of
        the digest more than half of the copies hold; the other copies are outvoted."""
        rows: list[int] = self.starts.to_pylist()
        outvoted: list[tuple[int, int]] = []
        digests = self.copies.column("digest").combine_chunks()
        first_digest = digests.take(self.starts.take(self._group_of_row))
        differing = pc.indices_nonzero(pc.not_equal(digests, first_digest))
        disagreeing = pc.unique(self._group_of_row.take(differing)).to_pylist()
        for group in sorted(disagreeing):
            by_digest: dict[bytes, list[tuple[int, int]]] = {}
            for row, (digest, relay) in self._rows_of(group):
                by_digest.setdefault(digest, []).append((relay, row))
            total = sum(len(held) for held in by_digest.values())
            winner = max(by_digest.values(), key=len)
            if len(winner) * 2 <= total:
                return _Choice(rows[:group], outvoted)
            rows[group] = min(winner)[1]
            seq = self.seq_of(group)
            outvoted.extend(
                (relay, seq)
                for held in by_digest.values()
                if held is not winner
                for relay, _ in held
            )
        return _Choice(rows, outvoted)

    def copy_that_chains(
        self, group: int, tried: int, previous_digest: bytes, segments: Sequence[SegmentRef]
    ) -> int | None:
        """Another copy in `group` with the digest of row `tried` whose content chains from
        `previous_digest` (None: there is none)."""
        digests = self.copies.column("digest")
        digest = digests[tried].as_py()
        seq = self.seq_of(group)
        for row, (other_digest, _relay) in self._rows_of(group):
            if row == tried or other_digest != digest:
                continue
            part = self.copies.column("part")[row].as_py()
            at = self.copies.column("row")[row].as_py()
            content = pq.read_table(segments[part].path, columns=STORED_ONLY_COLUMNS).slice(at, 1)
            hashed = tx_hash_of(
                content.column("producer_id")[0].as_py(),
                content.column("producer_seq")[0].as_py(),
                content.column("key")[0].as_py(),
                content.column("value")[0].as_py(),
                content.column("kind")[0].as_py(),
            )
            if chain(previous_digest, seq, hashed) == digest:
                return row
        return None

    def relay_of_row(self, row: int) -> int:
        return self.relay_of_part[int(self.copies.column("part")[row].as_py())]

    def _rows_of(self, group: int) -> list[tuple[int, tuple[bytes, int]]]:
        """(row, (digest, relay)) of every copy in `group`."""
        start = self.starts[group].as_py()
        return list(enumerate(self._copies_of(group), start=start))

    def seq_of(self, group: int) -> int:
        return int(self.copies.column("seq")[self.starts[group].as_py()].as_py())

    def _copies_of(self, group: int) -> list[tuple[bytes, int]]:
        """(digest, relay) of every copy in `group`."""
        start = self.starts[group].as_py()
        end = self.starts[group + 1].as_py() if group + 1 < self.count else self.rows
        rows = self.copies.slice(start, end - start)
        return [
            (digest, self.relay_of_part[part])
            for digest, part in zip(
                rows.column("digest").to_pylist(), rows.column("part").to_pylist(), strict=True
            )
        ]

    def relays_text(self, group: int) -> str:
        return _relays_text(relay for _digest, relay in self._copies_of(group))

    def disagreement_text(self, group: int) -> str:
        by_digest: dict[bytes, list[int]] = {}
        for digest, relay in self._copies_of(group):
            by_digest.setdefault(digest, []).append(relay)
        sides = "; ".join(
            f"relays {_relays_text(relays)} have {digest.hex()}"
            for digest, relays in sorted(by_digest.items())
        )
        return f"relays disagree on the digest at seq {self.seq_of(group)}: {sides}"


def _stored_records(stream: str, segments: Sequence[SegmentRef], chosen: pa.Table) -> pa.Table:
    """The chosen copies (seq order) as RECORD_SCHEMA rows: the stored-only columns are read
    from the segments holding them, one segment at a time."""
    parts = chosen.column("part").combine_chunks()
    rows = chosen.column("row").combine_chunks()
    pieces = []
    positions = []
    for part in pc.unique(parts).to_pylist():
        where = pc.indices_nonzero(pc.equal(parts, part))
        columns = pq.read_table(segments[part].path, columns=STORED_ONLY_COLUMNS)
        pieces.append(columns.take(rows.take(where)))
        positions.append(where)
    if pieces:
        rest = pa.concat_tables(pieces)
        rest = rest.take(pc.sort_indices(pa.chunked_array(positions)))
    else:
        rest = pa.table({name: [] for name in STORED_ONLY_COLUMNS})
    count = chosen.num_rows
    columns = {
        "stream": pa.repeat(pa.scalar(stream, pa.string()), count),
        "seq": chosen.column("seq"),
        "digest": chosen.column("digest"),
        **{name: rest.column(name) for name in STORED_ONLY_COLUMNS},
    }
    return pa.table([columns[name] for name in RECORD_COLUMNS], schema=RECORD_SCHEMA)


def _check_links(records: pa.Table) -> tuple[int, bytes]:
    """How many records, from the first, chain each from the one before (the first is
    stitched by the driver), and the first record's transaction hash."""
    checked = 0
    head_tx_hash = b""
    previous_digest = b""
    for offset in range(0, records.num_rows, CHAIN_LOOP_ROWS):
        window = records.slice(offset, CHAIN_LOOP_ROWS)
        producer_seqs = pc.cast(window.column("producer_seq"), pa.uint64(), safe=False)
        for seq, digest, producer_id, producer_seq, key, value, kind in zip(
            window.column("seq").to_pylist(),
            window.column("digest").to_pylist(),
            window.column("producer_id").to_pylist(),
            producer_seqs.to_pylist(),
            window.column("key").to_pylist(),
            window.column("value").to_pylist(),
            window.column("kind").to_pylist(),
            strict=True,
        ):
            content_hash = tx_hash(Transaction(producer_id, producer_seq, key, value, kind))
            if checked == 0:
                head_tx_hash = content_hash
            elif chain(previous_digest, seq, content_hash) != digest:
                return checked, head_tx_hash
            previous_digest = digest
            checked += 1
    return checked, head_tx_hash


def _summary_row(stream: str, state: _StreamRange) -> dict[str, object]:
    return {
        "stream": stream,
        "head_seq": state.head_seq,
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
        "outvoted": state.outvoted,
        "copies_checked": state.copies_checked,
    }


__all__ = [
    "RECORD_COLUMNS",
    "RECORD_SCHEMA",
    "SUMMARY_SCHEMA",
    "RangeChecker",
    "RecordFileWriter",
    "StreamOutcome",
    "check_segment_range",
    "check_sorted",
    "start_point",
    "stitch",
    "tx_hash_of",
]
