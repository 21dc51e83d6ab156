"""What the Spark jobs and the pyarrow baseline share: choosing the inputs of a run and
committing its results to the store's tables (relay.store.tables). Neither needs Spark.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from relay.segment import SegmentRef, find_segments, stream_dir_name
from relay.store.chaincheck import StreamOutcome, check_segment_range, start_point, stitch
from relay.store.changes import KIND_CHANGES, KIND_PLAIN, PLAIN_ENTITY, Op, decode_changes
from relay.store.errors import ChainProblem, IngestFailed, InvalidChanges
from relay.store.location import Folder, StoreArg, StoreLocation
from relay.store.tables import (
    RecordFile,
    SnapshotInfo,
    StagedFile,
    StoreState,
    StreamState,
    commit_records,
    commit_snapshot,
    digest_at,
    drop_staging,
    load_snapshot,
    parquet_file,
    position_metadata,
)

log = logging.getLogger("relay.store")

# Called before each commit of a job's files (they are staged or in place): tests inject a
# crash here.
BeforeCommit = Callable[[], None]

# --- ingest -------------------------------------------------------------------------------


@dataclass(slots=True)
class IngestPlan:
    store: StoreState
    # Segments holding records above their stream's last stored seq. (A segment all of
    # whose records are stored is ingested: its relay may remove it.)
    to_read: list[SegmentRef]

    @property
    def input_bytes(self) -> int:
        return sum(s.size_bytes for s in self.to_read)

    @property
    def start(self) -> dict[str, tuple[int, bytes]]:
        """Per stream the point the new records must continue."""
        points = {}
        for segment in self.to_read:
            state = self.store.streams.get(segment.stream)
            if state is None:
                points[segment.stream] = start_point(segment.stream, None, None)
            else:
                points[segment.stream] = start_point(
                    segment.stream, state.last_seq, state.last_digest_bytes
                )
        return points


def plan_ingest(spool_root: str | os.PathLike[str], store: StoreState) -> IngestPlan:
    to_read = []
    for segment in find_segments(spool_root):
        state = store.streams.get(segment.stream)
        if state is None or segment.last_seq > state.last_seq:
            to_read.append(segment)
    return IngestPlan(store, to_read)


# Segment bytes (all relays' copies, compressed) per range task, at most: bounds a task's
# memory (a few times this: the copies' seq and digest, the stored rows, the Python
# objects of one chain-loop window).
RANGE_INPUT_MAX_BYTES = 48 * 1024 * 1024
# ... and at least: below this a task's fixed cost (tens of ms in Spark) starts to count.
RANGE_INPUT_MIN_BYTES = 1024 * 1024
# Tasks per core when the input is small: several, so that uneven streams still keep
# every core busy to the end.
RANGES_PER_CORE = 4


def range_bytes_for(input_bytes: int, cores: int) -> int:
    """The segment bytes per range task for a run reading `input_bytes` on `cores`."""
    per_task = input_bytes // max(1, cores * RANGES_PER_CORE)
    return max(RANGE_INPUT_MIN_BYTES, min(RANGE_INPUT_MAX_BYTES, per_task))


@dataclass(frozen=True, slots=True)
class IngestRange:
    """One task of an ingest: the records of `stream` in (after_seq, last_seq], and every
    segment (any relay) holding some of them."""

    stream: str
    after_seq: int
    last_seq: int
    segments: tuple[SegmentRef, ...]
    # The digest at after_seq when the store holds it (the first range), else the segments
    # holding the record at after_seq (the previous range's last): the range's first
    # record is checked against it, so a corrupt first copy can be outvoted here too.
    after_digest: bytes | None = None
    before: tuple[SegmentRef, ...] = ()

    @property
    def input_bytes(self) -> int:
        return sum(s.size_bytes for s in self.segments)


def plan_ranges(plan: IngestPlan, range_bytes: int) -> list[IngestRange]:
    """Cut each stream's new records into ranges of about `range_bytes` of segments (all
    relays' copies counted), at segment ends, biggest first (so the longest tasks start
    first). A segment that straddles a cut is read by both ranges, each keeping its part."""
    start = plan.start
    by_stream: dict[str, list[SegmentRef]] = {}
    for segment in plan.to_read:
        by_stream.setdefault(segment.stream, []).append(segment)
    ranges = []
    for stream, segments in sorted(by_stream.items()):
        segments.sort(key=lambda s: s.last_seq)
        stored_seq = start[stream][0]
        cuts: list[int] = []
        gathered_bytes = 0
        for segment in segments:
            gathered_bytes += segment.size_bytes
            if gathered_bytes >= range_bytes and (not cuts or segment.last_seq > cuts[-1]):
                cuts.append(segment.last_seq)
                gathered_bytes = 0
        if not cuts or cuts[-1] < segments[-1].last_seq:
            cuts.append(segments[-1].last_seq)
        after_seq = stored_seq
        after_digest: bytes | None = start[stream][1]
        for last_seq in cuts:
            holding = tuple(
                s for s in segments if s.last_seq > after_seq and s.first_seq <= last_seq
            )
            before = tuple(s for s in segments if s.first_seq <= after_seq <= s.last_seq)
            ranges.append(IngestRange(stream, after_seq, last_seq, holding, after_digest, before))
            after_seq, after_digest = last_seq, None
    ranges.sort(key=lambda r: r.input_bytes, reverse=True)
    return ranges


def check_range(ingest_range: IngestRange, directory: Folder) -> list[dict[str, object]]:
    """Check and write one range (`chaincheck.check_segment_range`); its summary rows."""
    return check_segment_range(
        ingest_range.stream,
        ingest_range.after_seq,
        ingest_range.last_seq,
        ingest_range.segments,
        directory,
        after_digest=ingest_range.after_digest,
        before=ingest_range.before,
    )


@dataclass(slots=True)
class IngestResult:
    versions: dict[str, int]  # stream -> its records table's version after the run
    records_added: int
    segments_read: int
    streams: dict[str, tuple[int, bytes]]  # stream -> (last seq, last digest) after the run
    problems: list[ChainProblem] = field(default_factory=list)
    # (stream, relay, seq) of every relay copy the others outvoted (a corrupt or divergent
    # copy: another relay's was stored), and where their segments were moved
    outvoted: list[tuple[str, int, int]] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    copies_checked: int = 0  # other relays' copies of stored records compared in content


def finish_ingest(
    store: StoreLocation,
    plan: IngestPlan,
    summaries: Iterable[dict[str, object]],
    staging: str,
    run: str,
    before_commit: BeforeCommit | None = None,
) -> IngestResult:
    """Stitch the ranges' summaries and commit each stream's verified files to its records
    table (even when the stream has a problem: its verified prefix is kept), then raise
    IngestFailed if any stream had a problem."""
    by_stream: dict[str, list[dict[str, object]]] = {}
    for summary in summaries:
        by_stream.setdefault(str(summary["stream"]), []).append(summary)
    outcomes: list[StreamOutcome] = []
    versions = plan.store.versions()
    points = {s: (st.last_seq, st.last_digest_bytes or b"") for s, st in plan.store.streams.items()}
    for stream, (start_seq, start_digest) in sorted(plan.start.items()):
        outcome = stitch(stream, by_stream.get(stream, []), start_seq, start_digest)
        outcomes.append(outcome)
        if not outcome.records:
            continue
        files = [
            StagedFile(path, records, first, last) for path, first, last, records in outcome.paths
        ]
        if before_commit is not None:
            before_commit()
        metadata = position_metadata(
            "ingest",
            run,
            files,
            outcome.last_digest,
            len(outcome.outvoted),
            outcome.copies_checked,
        )
        state = plan.store.streams.get(stream)
        versions[stream] = commit_records(
            store, stream, state or StreamState(), files, staging, metadata
        )
        points[stream] = (outcome.last_seq, outcome.last_digest)
    drop_staging(store, staging)
    outvoted = [(o.stream, relay, seq) for o in outcomes for relay, seq in o.outvoted]
    quarantined = quarantine(plan.to_read, outvoted)
    problems = [o.problem for o in outcomes if o.problem is not None]
    result = IngestResult(
        versions=versions,
        records_added=sum(o.records for o in outcomes),
        segments_read=len(plan.to_read),
        streams=points,
        problems=problems,
        outvoted=outvoted,
        quarantined=quarantined,
        copies_checked=sum(o.copies_checked for o in outcomes),
    )
    if problems:
        for problem in problems:
            log.error("ingest: %s", problem)
        raise IngestFailed(
            f"ingest found {len(problems)} chain problem(s); the verified records before "
            "each were stored, nothing after it: " + "; ".join(str(p) for p in problems),
            problems=tuple(problems),
        )
    return result


QUARANTINE_DIR = "quarantine"  # beside the relays' folders in the spool


def quarantine(
    segments: Iterable[SegmentRef], outvoted: Iterable[tuple[str, int, int]]
) -> list[str]:
    """Move every segment that holds an outvoted copy out of its relay's spool, to
    `<spool>/quarantine/relay=<id>/...` (kept for a look; never read again), logging the
    relay and seq; returns the new paths."""
    moved: list[str] = []
    bad = sorted(set(outvoted))
    for segment in segments:
        hits = [
            seq
            for stream, relay, seq in bad
            if stream == segment.stream
            and relay == segment.relay
            and segment.first_seq <= seq <= segment.last_seq
        ]
        if not hits:
            continue
        source = Path(segment.path)
        target = source.parents[2] / QUARANTINE_DIR / source.parent.parent.name / source.parent.name
        try:
            target.mkdir(parents=True, exist_ok=True)
            os.replace(source, target / source.name)
        except OSError as error:
            log.error("ingest: cannot quarantine %s: %s", source, error)
            continue
        moved.append(str(target / source.name))
        log.warning(
            "ingest: relay %d's copy of stream %r at seq %s was outvoted by the other relays' "
            "copies (corrupt or divergent); its segment moved to %s",
            segment.relay,
            segment.stream,
            ", ".join(map(str, hits[:5])) + (" ..." if len(hits) > 5 else ""),
            target / source.name,
        )
    return moved


# --- snapshot -----------------------------------------------------------------------------

# One change, flattened: the order of changes is (seq, index within the transaction).
CHANGE_SCHEMA = pa.schema(
    [
        pa.field("stream", pa.string(), nullable=False),
        pa.field("entity", pa.string(), nullable=False),
        pa.field("key", pa.binary(), nullable=False),
        pa.field("op", pa.int8(), nullable=False),
        pa.field("value", pa.binary(), nullable=True),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("change_index", pa.int32(), nullable=False),
    ]
)
# The rows of a snapshot file: the value of every live (entity, key) and the seq that set it.
SNAPSHOT_SCHEMA = pa.schema(
    [
        pa.field("stream", pa.string(), nullable=False),
        pa.field("entity", pa.string(), nullable=False),
        pa.field("key", pa.binary(), nullable=False),
        pa.field("value", pa.binary(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
    ]
)
SNAPSHOT_WRITE_SUMMARY = pa.schema(
    [pa.field("stream", pa.string()), pa.field("path", pa.string()), pa.field("rows", pa.int64())]
)
SNAPSHOT_FILE_COMPRESSION = "zstd"


def expand_changes(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The changes of a batch of records (stream, seq, key, value, kind), in CHANGE_SCHEMA.
    Plain records are expanded without a Python loop. A change list that does not decode
    changes nothing (it was committed, so it cannot be refused any more): it is logged."""
    kinds = batch.column("kind")
    plain = batch.filter(pc.equal(kinds, KIND_PLAIN))
    parts = []
    if plain.num_rows:
        count = plain.num_rows
        parts.append(
            pa.record_batch(
                [
                    plain.column("stream"),
                    pa.array([PLAIN_ENTITY] * count, pa.string()),
                    pc.fill_null(plain.column("key"), pa.scalar(b"", pa.binary())),
                    pa.array([int(Op.PUT)] * count, pa.int8()),
                    plain.column("value"),
                    plain.column("seq"),
                    pa.array([0] * count, pa.int32()),
                ],
                schema=CHANGE_SCHEMA,
            )
        )
    lists = batch.filter(pc.equal(kinds, KIND_CHANGES))
    if lists.num_rows:
        columns: tuple[list[object], ...] = ([], [], [], [], [], [], [])
        for stream, seq, value in zip(
            lists.column("stream").to_pylist(),
            lists.column("seq").to_pylist(),
            lists.column("value").to_pylist(),
            strict=True,
        ):
            try:
                changes = decode_changes(value)
            except InvalidChanges as error:
                log.error("stream %r seq %d: change list ignored: %s", stream, seq, error)
                continue
            for index, change in enumerate(changes):
                for column, item in zip(
                    columns,
                    (stream, change.entity, change.key, int(change.op), change.value, seq, index),
                    strict=True,
                ):
                    column.append(item)
        parts.append(pa.record_batch([pa.array(c) for c in columns], schema=CHANGE_SCHEMA))
    if not parts:
        return pa.RecordBatch.from_pylist([], schema=CHANGE_SCHEMA)
    if len(parts) == 1:
        return parts[0]
    return pa.Table.from_batches(parts).combine_chunks().to_batches()[0]


def expand_all(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        expanded = expand_changes(batch)
        if expanded.num_rows:
            yield expanded


# Changes a task gathers before it folds them to the last change per key: bounds a
# task's memory to this many changes plus the distinct keys it has seen.
FOLD_EVERY_CHANGES = 500_000
_KEY_ORDER = [
    ("stream", "ascending"),
    ("entity", "ascending"),
    ("key", "ascending"),
    ("seq", "ascending"),
    ("change_index", "ascending"),
]


def last_change_per_key(changes: pa.Table) -> pa.Table:
    """The last change (by seq, then index in its transaction) of every (stream, entity,
    key), deletes included (they still override older puts elsewhere), in CHANGE_SCHEMA."""
    count = changes.num_rows
    if count <= 1:
        return changes
    ordered = changes.sort_by(_KEY_ORDER)
    # A row is the last of its key when the next row has another stream, entity or key.
    differs = None
    for name in ("stream", "entity", "key"):
        column = ordered.column(name)
        step = pc.not_equal(column.slice(0, count - 1), column.slice(1))
        differs = step if differs is None else pc.or_(differs, step)
    assert differs is not None
    is_last = pa.chunked_array([*differs.chunks, pa.array([True])], pa.bool_())
    return ordered.filter(is_last)


def expand_and_fold(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """A task's changes, folded to the last change per key (the map side of a snapshot)."""
    gathered: list[pa.RecordBatch] = []
    gathered_rows = 0
    folded = CHANGE_SCHEMA.empty_table()
    for expanded in expand_all(batches):
        gathered.append(expanded)
        gathered_rows += expanded.num_rows
        if gathered_rows >= FOLD_EVERY_CHANGES:
            folded = last_change_per_key(_concat([folded, *gathered]))
            gathered, gathered_rows = [], 0
    folded = last_change_per_key(_concat([folded, *gathered]))
    yield from folded.to_batches()


# The record columns a snapshot reads, and the rows per batch it reads them in.
DELTA_COLUMNS = ["stream", "seq", "key", "value", "kind", "duplicate"]
DELTA_BATCH_ROWS = 64 * 1024


def read_delta(
    location: StoreLocation, path: str, after_seq: int, upto_seq: int
) -> Iterator[pa.RecordBatch]:
    """The records of a record file (`path` relative to the store) with a seq in
    (after_seq, upto_seq], duplicates left out (they change nothing), batch by batch (a
    file is read in bounded memory)."""
    source = parquet_file(location, path)
    for batch in source.iter_batches(batch_size=DELTA_BATCH_ROWS, columns=DELTA_COLUMNS):
        seqs = batch.column("seq")
        keep = pc.and_(
            pc.and_(pc.greater(seqs, after_seq), pc.less_equal(seqs, upto_seq)),
            pc.invert(batch.column("duplicate")),
        )
        kept = batch.filter(keep)
        if kept.num_rows:
            yield kept


def expand_and_fold_files(
    location: StoreLocation, tasks: Iterable[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """The map side of a Spark snapshot: `tasks` are rows (path, after_seq, upto_seq[,
    tag]) of record files (paths relative to the store); their changes, read straight from
    the files and folded to the last change per key (CHANGE_SCHEMA; with a tag, the tag is
    their stream)."""

    def records() -> Iterator[pa.RecordBatch]:
        for batch in tasks:
            count = batch.num_rows
            tags = (
                batch.column("tag").to_pylist() if "tag" in batch.schema.names else [None] * count
            )
            for path, after_seq, upto_seq, tag in zip(
                batch.column("path").to_pylist(),
                batch.column("after_seq").to_pylist(),
                batch.column("upto_seq").to_pylist(),
                tags,
                strict=True,
            ):
                for part in read_delta(location, path, after_seq, upto_seq):
                    yield part if tag is None else _tagged(part, tag)

    return expand_and_fold(records())


def _tagged(batch: pa.RecordBatch, tag: str) -> pa.RecordBatch:
    """`batch` with `tag` in place of its stream (snapshot checks: check_tag)."""
    columns = list(batch.columns)
    columns[batch.schema.get_field_index("stream")] = pa.array([tag] * batch.num_rows, pa.string())
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


def live_rows(changes: pa.Table) -> pa.Table:
    """Snapshot rows (SNAPSHOT_SCHEMA) from changes: the last per key, deletes dropped."""
    last = last_change_per_key(changes)
    live = last.filter(pc.equal(last.column("op"), int(Op.PUT)))
    return live.select(SNAPSHOT_SCHEMA.names).cast(SNAPSHOT_SCHEMA)


def _concat(parts: list[pa.Table | pa.RecordBatch]) -> pa.Table:
    tables = [
        (p if isinstance(p, pa.Table) else pa.Table.from_batches([p])).cast(CHANGE_SCHEMA)
        for p in parts
    ]
    return pa.concat_tables(tables) if tables else CHANGE_SCHEMA.empty_table()


def fold_live(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The reduce side of a snapshot check: every change of a set of keys in, their live
    rows out (SNAPSHOT_SCHEMA)."""
    yield from live_rows(_concat(list(batches))).to_batches()


def fold_and_write(
    batches: Iterable[pa.RecordBatch], directory: Folder
) -> Iterator[pa.RecordBatch]:
    """The reduce side of a snapshot: every change of a set of keys in, their live rows
    written per stream under `directory`; yields what was written."""
    import uuid

    changes = _concat(list(batches))
    writer = SnapshotWriter(directory, uuid.uuid4().hex)
    for batch in live_rows(changes).to_batches():
        writer.write(batch)
    yield pa.RecordBatch.from_pylist(writer.close(), schema=SNAPSHOT_WRITE_SUMMARY)


@dataclass(slots=True)
class SnapshotTarget:
    stream: str
    seq: int  # snapshot as of this seq (a stored record's)
    digest: bytes  # the stored digest at seq
    base: SnapshotInfo | None  # the snapshot below it that it builds on
    delta_files: list[RecordFile]  # record files holding seqs in (base seq, seq]

    @property
    def base_seq(self) -> int:
        return self.base.seq if self.base else -1


def plan_snapshot(
    store_path: StoreArg,
    store: StoreState,
    as_of: dict[str, int] | None = None,
    streams: Collection[str] | None = None,
) -> list[SnapshotTarget]:
    """Per stream (of `streams`, if given) with no snapshot yet at its last stored seq (at
    the last stored record at or below `as_of[stream]`, if given): what to build, on the
    highest snapshot below that point."""
    targets = []
    for stream, state in sorted(store.streams.items()):
        if state.records == 0 or (streams is not None and stream not in streams):
            continue
        wanted = min(as_of.get(stream, state.last_seq), state.last_seq) if as_of else state.last_seq
        seq, digest = digest_at(store_path, state, wanted)
        if seq in state.snapshot_seqs:
            continue
        below = [s for s in state.snapshot_seqs if s < seq]
        base = load_snapshot(store_path, stream, below[-1]) if below else None
        base_seq = base.seq if base else -1
        files = [f for f in state.files if f.last_seq > base_seq and f.first_seq <= seq]
        targets.append(SnapshotTarget(stream, seq, digest, base, files))
    return targets


class SnapshotWriter:
    """Writes snapshot rows (SNAPSHOT_SCHEMA) to one file per stream under `directory`
    (the paths it returns are relative to the store)."""

    def __init__(self, directory: Folder, prefix: str) -> None:
        self.directory = directory
        self.prefix = prefix
        self._files: dict[str, tuple[pq.ParquetWriter, str, int]] = {}

    def write(self, batch: pa.RecordBatch) -> None:
        streams = batch.column("stream")
        for stream in pc.unique(streams).to_pylist():
            rows = batch.filter(pc.equal(streams, stream))
            if not rows.schema.equals(SNAPSHOT_SCHEMA):  # Spark's batches: all nullable
                rows = rows.cast(SNAPSHOT_SCHEMA)
            entry = self._files.get(stream)
            if entry is None:
                name = f"{stream_dir_name(stream)}/{self.prefix}.parquet"
                path = f"{self.directory.relative}/{name}"
                writer = self.directory.parquet_writer(
                    name, SNAPSHOT_SCHEMA, compression=SNAPSHOT_FILE_COMPRESSION
                )
                entry = (writer, path, 0)
            entry[0].write_batch(rows)
            self._files[stream] = (entry[0], entry[1], entry[2] + rows.num_rows)

    def close(self) -> list[dict[str, object]]:
        written = []
        for stream, (writer, path, rows) in self._files.items():
            writer.close()
            written.append({"stream": stream, "path": path, "rows": rows})
        self._files = {}
        return written


def finish_snapshot(
    store: StoreLocation,
    targets: list[SnapshotTarget],
    written: Iterable[dict[str, object]],
    staging: str,
    before_commit: BeforeCommit | None = None,
) -> dict[str, SnapshotInfo]:
    """Create each target's snapshot table from the files written for its stream."""
    files: dict[str, list[StagedFile]] = {}
    for entry in written:
        count = entry["rows"]
        assert isinstance(count, int)
        files.setdefault(str(entry["stream"]), []).append(StagedFile(str(entry["path"]), count))
    made = {}
    for target in targets:
        if before_commit is not None:
            before_commit()
        made[target.stream] = commit_snapshot(
            store, target.stream, target.seq, target.digest, files.get(target.stream, []), staging
        )
    drop_staging(store, staging)
    return made


# --- checking snapshots (verify) --------------------------------------------------------


@dataclass(slots=True)
class SnapshotCheck:
    """A snapshot to compare with the fold of the one below it (`base`; none: from the
    first record) and the records in between. Checking every snapshot of a stream this way
    checks each against the fold of the whole stream: the base is checked too (except the
    snapshot the kept records continue from after retention, whose records are gone)."""

    stream: str
    snapshot: SnapshotInfo
    base: SnapshotInfo | None
    delta_files: list[RecordFile]

    @property
    def tag(self) -> str:
        return check_tag(self.stream, self.snapshot.seq)


def check_tag(stream: str, seq: int) -> str:
    """The stream column of a snapshot check's rows: the checks of one stream fold in one
    job, each apart from the others. (A stream name never holds NUL: the topology and the
    relays refuse it.)"""
    return f"{stream}\0{seq}"


def plan_snapshot_checks(
    store_path: StoreArg, store: StoreState
) -> tuple[list[SnapshotCheck], int]:
    """Every snapshot of every stream as a check, and how many snapshots cannot be checked
    (taken at or before the first kept record, after retention: their records are gone)."""
    checks: list[SnapshotCheck] = []
    unchecked = 0
    for stream, state in sorted(store.streams.items()):
        previous: SnapshotInfo | None = None
        for seq in state.snapshot_seqs:
            info = load_snapshot(store_path, stream, seq)
            if seq <= state.retained_after:
                unchecked += 1
            else:
                base_seq = previous.seq if previous else -1
                files = [f for f in state.files if f.last_seq > base_seq and f.first_seq <= seq]
                checks.append(SnapshotCheck(stream, info, previous, files))
            previous = info
    return checks, unchecked


def snapshot_difference(
    stream: str, seq: int, missing: int, unexpected: int, example: str
) -> ChainProblem:
    return ChainProblem(
        f"stream {stream!r}: the snapshot at seq {seq} is not the fold of the records up to "
        f"it: {missing} rows of the fold are not in it, {unexpected} rows in it are not in "
        f"the fold (e.g. {example})",
        stream=stream,
        seq=seq,
        relays=(),
    )
