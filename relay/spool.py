"""The spool: each relay writes its streams' committed entries to Parquet segments on disk
(the format: `relay.segment`), from which the store is built (`relay.store.ingest`).

The relay's event loop must never wait for the disk. `append` only checks the records'
order and hands them to a writer thread through a queue; the writer gathers them per
stream, and writes a segment when it reaches `segment_max_bytes` or is older than
`segment_max_age_ms` (`tick`). A segment is written under a hidden temporary name, flushed
to disk and renamed into place (`<first_seq>-<last_seq>.parquet`), so a reader never sees
half a segment.

Room, not refusal: the spool never drops records for want of space. `room_bytes` says how
much more it can take: what is left of the disk budget `disk_max_bytes` after what is on
disk and what waits to be written, and no more than `pending_max_bytes` waiting in memory.
The relay votes only while what it holds fits in that room (docs/protocol.md 5.14), so a
spool that fills up (a store not ingested, a slow disk) withholds the relay's votes instead
of losing what the relay voted for. Sizes are estimated before writing (the records'
lengths plus `relay.core.spooling.SPOOL_RECORD_OVERHEAD_BYTES`, and
`SEGMENT_FILE_OVERHEAD_BYTES` per segment still to write); compressed Parquet is usually
smaller.

What does stop a stream: a write that fails, or records out of order. The spool then logs
one clear error, counts it, drops the stream's later records and names the stream in
`refused_streams` (the relay stops voting on it). It never raises into the caller and
never blocks it. Restarting the relay starts the stream again.

Disk: given the store (`store`, a location), the writer removes this relay's segments that the
store lists as ingested, and counts the disk again, every RECLAIM_INTERVAL_MS; so a mesh
whose store is ingested regularly keeps its spools small, and a full spool gets room back.

`last_spooled_points` reads where a relay's spool ends, stream by stream: with the store's
last points, what a relay restarting without history continues from (RelayCore.seed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from relay.core import spooling
from relay.segment import (
    find_segments,
    segment_name,
    segment_table,
    stream_dir_name,
    to_signed64,
    write_segment_file,
)
from relay.store.errors import StoreError
from relay.store.location import StoreLocation
from relay.store.tables import load_store

log = logging.getLogger("relay.spool")

# (seq, digest, producer_id, producer_seq, key, value, kind, duplicate)
SpoolRecord = tuple[int, bytes, bytes, int, bytes | None, bytes, int, bool]

DEFAULT_SEGMENT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_SEGMENT_MAX_AGE_MS = 10_000
DEFAULT_DISK_MAX_BYTES = 10 * 1024 * 1024 * 1024
# What may wait in memory for the disk: a slow disk withholds votes beyond it.
DEFAULT_PENDING_MAX_BYTES = 256 * 1024 * 1024
# A segment file's footer, schema and statistics (about 2 KiB measured), with a margin.
SEGMENT_FILE_OVERHEAD_BYTES = 8 * 1024
CLOSE_TIMEOUT_S = 60.0
TICKS_QUEUED_MAX = 64  # ticks are skipped while the writer has this much to do
RECLAIM_INTERVAL_MS = 10_000  # how often ingested segments are looked for and removed


@dataclass(slots=True)
class SpoolStatus:
    segments_written: int = 0
    segments_reclaimed: int = 0  # removed once the store had ingested them
    bytes_written: int = 0
    records_written: int = 0
    records_dropped: int = 0
    errors: int = 0
    queue_depth: int = 0
    disk_used_bytes: int = 0  # segments on disk
    pending_bytes: int = 0  # appended, not yet written (estimated)
    room_bytes: int = 0  # what it can still take (see Spool.room_bytes)
    stopped_streams: dict[str, str] = field(default_factory=dict)  # stream -> why


@dataclass(slots=True)
class _OpenSegment:
    """The records of a stream not yet written, column by column."""

    opened_ms: int
    seqs: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    producer_ids: list[bytes] = field(default_factory=list)
    producer_seqs: list[int] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)
    duplicates: list[bool] = field(default_factory=list)
    size_bytes: int = 0


class _Close:
    pass


class Spool:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        relay_id: int,
        *,
        segment_max_bytes: int = DEFAULT_SEGMENT_MAX_BYTES,
        segment_max_age_ms: int = DEFAULT_SEGMENT_MAX_AGE_MS,
        disk_max_bytes: int = DEFAULT_DISK_MAX_BYTES,
        pending_max_bytes: int = DEFAULT_PENDING_MAX_BYTES,
        store: StoreLocation | None = None,
    ) -> None:
        for name, value in (
            ("segment_max_bytes", segment_max_bytes),
            ("segment_max_age_ms", segment_max_age_ms),
            ("disk_max_bytes", disk_max_bytes),
            ("pending_max_bytes", pending_max_bytes),
        ):
            if value <= 0:
                raise ValueError(f"spool limit {name} must be positive, got {value}")
        self.relay_id = relay_id
        self.root = Path(directory) / f"relay={relay_id}"
        self.root.mkdir(parents=True, exist_ok=True)
        self.segment_max_bytes = segment_max_bytes
        self.segment_max_age_ms = segment_max_age_ms
        self.disk_max_bytes = disk_max_bytes
        self.pending_max_bytes = pending_max_bytes
        self.store = store
        # Unbounded in batches: what waits is bounded in bytes, by the room the relay
        # respects (room_bytes).
        self._queue: queue.Queue[tuple[str, Sequence[SpoolRecord], int] | int | _Close] = (
            queue.Queue()
        )
        # Guards _status and what room_bytes reads: the bytes queued (the caller adds, the
        # writer takes off), in open segments and on disk (the writer's counts).
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self._refused: frozenset[str] = frozenset()  # replaced whole, so read without the lock
        self._open_bytes = 0
        self._open_segments = 0
        self._status = SpoolStatus()
        self._last_seq: dict[str, int] = {}  # caller thread only
        # Writer thread only:
        self._open: dict[str, _OpenSegment] = {}
        self._writer_stopped: set[str] = set()  # streams the writer gave up on
        self._now_ms = 0
        self._reclaimed_ms: int | None = None  # when ingested segments were last removed
        self._disk_used_bytes = self._scan_disk_bytes()  # changed by the writer thread only
        self._over_budget_logged = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"spool-{relay_id}", daemon=True)
        self._thread.start()

    # --- the caller's side (the relay's event loop): never blocks ------------------------

    def append(self, stream: str, records: Sequence[SpoolRecord]) -> bool:
        """Spool committed records of `stream` (in seq order, continuing the last append).
        False if the stream is not being spooled (stopped; see `status()`)."""
        if not records:
            return True
        if self._closed or stream in self._status.stopped_streams:
            self._count_dropped(len(records))
            return False
        first_seq = records[0][0]
        last_seq = self._last_seq.get(stream, -1)
        if first_seq <= last_seq or any(
            records[i][0] >= records[i + 1][0] for i in range(len(records) - 1)
        ):
            self._stop(stream, f"records out of order (got seq {first_seq} after {last_seq})")
            self._count_dropped(len(records))
            return False
        size_bytes = sum(map(_record_bytes, records))
        with self._lock:
            self._queued_bytes += size_bytes
        self._queue.put((stream, records, size_bytes))
        self._last_seq[stream] = records[-1][0]
        return True

    def room_bytes(self) -> int:
        """How many more bytes of records (as `spooling.record_bytes` counts them) it can
        take: the disk budget left after what is on disk, what waits to be written and a
        footer per segment still open, and at most `pending_max_bytes` waiting."""
        with self._lock:
            return self._room_locked()

    def refused_streams(self) -> frozenset[str]:
        """The streams the spool stopped taking (a write failed, records out of order). Asked
        every loop turn: a set built when a stream stops, not per call."""
        return self._refused

    def _room_locked(self) -> int:
        pending = self._queued_bytes + self._open_bytes
        footers = (self._open_segments + 1) * SEGMENT_FILE_OVERHEAD_BYTES
        disk_room = self.disk_max_bytes - self._disk_used_bytes - pending - footers
        return min(disk_room, self.pending_max_bytes - pending)

    def tick(self, now_mono_ms: int) -> None:
        """Let time pass: segments older than `segment_max_age_ms` are written."""
        if self._queue.qsize() < TICKS_QUEUED_MAX:  # a busy writer: the next tick rotates
            self._queue.put(now_mono_ms)

    def close(self) -> None:
        """Write every open segment and stop the writer (this may wait for the disk)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_Close(), timeout=CLOSE_TIMEOUT_S)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.error(
                "spool of relay %d: writer did not stop in %.0f s", self.relay_id, CLOSE_TIMEOUT_S
            )

    def status(self) -> SpoolStatus:
        with self._lock:
            snapshot = SpoolStatus(
                **{name: getattr(self._status, name) for name in SpoolStatus.__slots__}
            )
            snapshot.stopped_streams = dict(self._status.stopped_streams)
            snapshot.disk_used_bytes = self._disk_used_bytes
            snapshot.pending_bytes = self._queued_bytes + self._open_bytes
            snapshot.room_bytes = self._room_locked()
        snapshot.queue_depth = self._queue.qsize()
        return snapshot

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- shared ---------------------------------------------------------------------------

    def _stop(self, stream: str, why: str) -> None:
        with self._lock:
            if stream in self._status.stopped_streams:
                return
            self._status.stopped_streams[stream] = why
            self._refused = frozenset(self._status.stopped_streams)
            self._status.errors += 1
        log.error("spool of relay %d stops spooling stream %r: %s", self.relay_id, stream, why)

    def _count_dropped(self, count: int) -> None:
        with self._lock:
            self._status.records_dropped += count

    # --- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, _Close):
                for stream in list(self._open):
                    self._write_segment(stream)
                return
            if isinstance(item, int):
                try:
                    self._on_tick(item)
                except Exception:  # never let the writer die; the next tick tries again
                    log.exception("spool of relay %d: a timed duty failed", self.relay_id)
                continue
            stream, records, size_bytes = item
            with self._lock:
                self._queued_bytes -= size_bytes
            try:
                self._add(stream, records)
            except Exception as error:  # never let the writer die: stop the stream instead
                self._open.pop(stream, None)
                self._writer_stopped.add(stream)
                self._stop(stream, f"cannot spool records: {error!r}")
            self._count_open()

    def _count_open(self) -> None:
        """What the open segments hold, for room_bytes."""
        open_bytes = sum(segment.size_bytes for segment in self._open.values())
        with self._lock:
            self._open_bytes = open_bytes
            self._open_segments = len(self._open)

    def _on_tick(self, now_ms: int) -> None:
        """Write the segments older than segment_max_age_ms; reclaim now and then."""
        self._now_ms = max(self._now_ms, now_ms)
        for stream, segment in list(self._open.items()):
            if self._now_ms - segment.opened_ms >= self.segment_max_age_ms:
                self._write_segment(stream)
        due = self._reclaimed_ms is None or self._now_ms - self._reclaimed_ms >= RECLAIM_INTERVAL_MS
        if due:
            self._reclaimed_ms = self._now_ms
            self._reclaim()
            # Counted again from the files: segments removed by hand give room back too.
            used_bytes = self._scan_disk_bytes()
            with self._lock:
                self._disk_used_bytes = used_bytes

    def _add(self, stream: str, records: Sequence[SpoolRecord]) -> None:
        if stream in self._writer_stopped:
            # The writer stopped the stream after these were queued.
            self._count_dropped(len(records))
            return
        segment = self._open.get(stream)
        if segment is None:
            segment = self._open[stream] = _OpenSegment(opened_ms=self._now_ms)
        for position, record in enumerate(records):
            seq, digest, producer_id, producer_seq, key, value, kind, duplicate = record
            segment.seqs.append(seq)
            segment.digests.append(digest)
            segment.producer_ids.append(producer_id)
            segment.producer_seqs.append(to_signed64(producer_seq))
            segment.keys.append(key)
            segment.values.append(value)
            segment.kinds.append(kind)
            segment.duplicates.append(duplicate)
            segment.size_bytes += spooling.record_bytes(producer_id, key, value)
            if segment.size_bytes >= self.segment_max_bytes:
                self._write_segment(stream)
                if stream in self._writer_stopped:
                    self._count_dropped(len(records) - position - 1)
                    return
                segment = self._open[stream] = _OpenSegment(opened_ms=self._now_ms)
        if not segment.seqs:
            del self._open[stream]

    def _write_segment(self, stream: str) -> None:
        segment = self._open.pop(stream, None)
        if segment is None or not segment.seqs:
            return
        count = len(segment.seqs)
        table = segment_table(
            stream,
            self.relay_id,
            segment.seqs,
            segment.digests,
            segment.producer_ids,
            segment.producer_seqs,
            segment.keys,
            segment.values,
            segment.kinds,
            segment.duplicates,
        )
        directory = self.root / stream_dir_name(stream)
        name = segment_name(segment.seqs[0], segment.seqs[-1])
        temporary = directory / f".{name}.tmp"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            write_segment_file(table, temporary)
            os.replace(temporary, directory / name)
            size_bytes = (directory / name).stat().st_size
        except OSError as error:
            with contextlib.suppress(OSError):
                temporary.unlink()
            self._writer_stopped.add(stream)
            self._stop(stream, f"cannot write segment {directory / name}: {error}")
            self._count_dropped(count)
            return
        with self._lock:
            self._disk_used_bytes += size_bytes
            over_bytes = self._disk_used_bytes - self.disk_max_bytes
            self._status.segments_written += 1
            self._status.bytes_written += size_bytes
            self._status.records_written += count
        if over_bytes > 0 and not self._over_budget_logged:
            # The relay voted only within the room, so this is the estimates' error (or
            # files put there by hand); nothing is dropped for it.
            self._over_budget_logged = True
            log.warning(
                "spool of relay %d: %d bytes over disk_max_bytes=%d",
                self.relay_id,
                over_bytes,
                self.disk_max_bytes,
            )

    def _reclaim(self) -> None:
        """Remove this relay's segments whose records the store holds (each stream's
        records table reaches their last seq)."""
        if self.store is None:
            return
        try:
            stored = load_store(self.store, digests=False)
        except (StoreError, ImportError, OSError) as error:  # never stop the writer over it
            log.warning("spool of relay %d: cannot read the store: %s", self.relay_id, error)
            return
        removed = freed = 0
        try:
            segments = find_segments(self.root.parent)
        except OSError as error:  # never let the writer die over a listing
            log.warning("spool of relay %d: cannot list segments: %s", self.relay_id, error)
            return
        for segment in segments:
            state = stored.streams.get(segment.stream)
            if segment.relay != self.relay_id or state is None:
                continue
            if segment.last_seq <= state.last_seq:
                with contextlib.suppress(OSError):
                    os.unlink(segment.path)
                    removed += 1
                    freed += segment.size_bytes
        if removed:
            with self._lock:
                self._status.segments_reclaimed += removed
            log.info(
                "spool of relay %d: removed %d ingested segments (%d bytes)",
                self.relay_id,
                removed,
                freed,
            )

    def _scan_disk_bytes(self) -> int:
        total = 0
        for directory, _subdirs, files in os.walk(self.root):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(directory, name)).st_size
        return total


def _record_bytes(record: SpoolRecord) -> int:
    return spooling.record_bytes(record[2], record[4], record[5])


def last_spooled_points(
    directory: str | os.PathLike[str], relay_id: int
) -> dict[str, tuple[int, bytes]]:
    """Per stream, the (seq, digest) of the last record in `relay_id`'s spool under
    `directory`; a segment that cannot be read is skipped (logged)."""
    last: dict[str, tuple[int, str]] = {}  # stream -> (last seq, path)
    for segment in find_segments(directory):
        if segment.relay == relay_id and segment.last_seq > last.get(segment.stream, (-1, ""))[0]:
            last[segment.stream] = (segment.last_seq, segment.path)
    points: dict[str, tuple[int, bytes]] = {}
    for stream, (seq, path) in last.items():
        try:
            table = pq.read_table(path, columns=["seq", "digest"])
        except (OSError, pa.ArrowException) as error:
            log.warning("spool segment %s unreadable, not used: %s", path, error)
            continue
        if table.num_rows and table.column("seq")[-1].as_py() == seq:
            points[stream] = (seq, table.column("digest")[-1].as_py())
    return points
