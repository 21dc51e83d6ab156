"""The spool: segments per stream per relay, rotation by size and age, never blocking the
caller, counting its room (disk budget, what waits) instead of dropping records, and
stopping a stream (with a logged error and a counter) only when a write fails or records
come out of order."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

import relay.spool as spool_module
from relay.segment import find_segments, stream_dir_name, to_unsigned64
from relay.spool import Spool, SpoolRecord
from relay.store.location import as_location
from relay.tools.synthetic import generate
from waiting import wait_until

STREAM = "orders.eu"


def _read_all(root: Path, stream: str = STREAM) -> list[SpoolRecord]:
    rows: list[SpoolRecord] = []
    for segment in find_segments(root):
        if segment.stream != stream:
            continue
        table = pq.read_table(segment.path)
        for row in table.to_pylist():
            rows.append(
                (
                    row["seq"],
                    row["digest"],
                    row["producer_id"],
                    to_unsigned64(row["producer_seq"]),
                    row["key"],
                    row["value"],
                    row["kind"],
                    row["duplicate"],
                )
            )
    return rows


def test_records_come_back_from_contiguous_segments(tmp_path: Path) -> None:
    records = generate(STREAM, 500, seed=3)
    records.producer_seqs[0] = 2**64 - 1  # a u64 beyond int64 survives the round trip
    with Spool(tmp_path, 4, segment_max_bytes=8_000) as spool:
        for start in range(0, 500, 37):
            assert spool.append(STREAM, records.records(start, start + 37))
    status = spool.status()
    segments = [s for s in find_segments(tmp_path) if s.stream == STREAM]
    assert status.segments_written == len(segments) > 3
    assert status.records_written == 500
    assert status.errors == 0 and status.records_dropped == 0
    assert all(s.relay == 4 for s in segments)
    assert _read_all(tmp_path) == records.records()
    # Segments are contiguous: each starts right after the previous one ends.
    for before, after in itertools.pairwise(segments):
        assert records.seqs.index(after.first_seq) == records.seqs.index(before.last_seq) + 1
    # No temporary files are left, and a segment is named by its first and last seq.
    folder = tmp_path / "relay=4" / stream_dir_name(STREAM)
    assert sorted(os.listdir(folder)) == sorted(Path(s.path).name for s in segments)


def test_stream_names_are_escaped_and_found_again(tmp_path: Path) -> None:
    odd = "../we ird/.name%"
    records = generate(odd, 10)
    with Spool(tmp_path, 0) as spool:
        spool.append(odd, records.records())
    [segment] = find_segments(tmp_path)
    assert segment.stream == odd
    assert Path(segment.path).resolve().is_relative_to(tmp_path.resolve() / "relay=0")
    assert _read_all(tmp_path, odd) == records.records()


def test_tick_writes_segments_older_than_the_age_limit(tmp_path: Path) -> None:
    records = generate(STREAM, 20)
    spool = Spool(tmp_path, 1, segment_max_age_ms=1_000)
    try:
        # One writer thread takes these in order, so no waiting is needed in between.
        spool.tick(10_000)
        spool.append(STREAM, records.records(0, 10))
        spool.tick(10_500)  # younger than the limit: nothing is written...
        spool.append(STREAM, records.records(10, 20))  # ...so these join the same segment
        spool.tick(11_000)
        wait_until(lambda: spool.status().records_written == 20, "the aged segment")
        assert spool.status().segments_written == 1
        assert _read_all(tmp_path) == records.records(0, 20)
    finally:
        spool.close()


def test_a_slow_disk_takes_room_but_never_blocks_or_drops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real_write = spool_module.write_segment_file

    def slow_write(table: object, path: str | os.PathLike[str]) -> None:
        release.wait(60)  # the disk is stuck until the test releases it
        real_write(table, path)

    monkeypatch.setattr(spool_module, "write_segment_file", slow_write)
    records = generate(STREAM, 200)
    spool = Spool(tmp_path, 2, segment_max_bytes=1, pending_max_bytes=5_000)
    try:
        room_before = spool.room_bytes()
        assert room_before == 5_000  # the bound on what waits binds, not the disk
        batches = [records.records(i, i + 10) for i in range(0, 200, 10)]
        # Never waits for the disk and never refuses: what waits counts against the room,
        # which the relay respects by withholding its votes (docs/protocol.md 5.14).
        assert all(spool.append(STREAM, batch) for batch in batches)
        assert spool.room_bytes() < 0
        status = spool.status()
        assert status.pending_bytes > 5_000 and status.room_bytes == spool.room_bytes()
        release.set()
        wait_until(lambda: spool.room_bytes() == room_before, "the writer to catch up")
    finally:
        release.set()
        spool.close()
    assert spool.status().records_dropped == 0
    assert _read_all(tmp_path) == records.records()


def test_the_disk_budget_is_room_not_refusal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = generate(STREAM, 300)
    budget = 40_000
    with Spool(tmp_path, 3, segment_max_bytes=4_000, disk_max_bytes=budget) as spool:
        rooms = []
        for start in range(0, 300, 20):
            rooms.append(spool.room_bytes())
            spool.append(STREAM, records.records(start, start + 20))
        # The room shrinks with every batch: a relay would have stopped voting long
        # before it went below zero; the spool itself drops nothing.
        assert rooms == sorted(rooms, reverse=True) and rooms[0] < budget
        wait_until(lambda: spool.status().queue_depth == 0, "the writer to drain its queue")
    status = spool.status()
    assert status.records_dropped == 0 and status.errors == 0
    assert status.records_written == 300
    assert _read_all(tmp_path) == records.records()
    # Past its budget (by how Parquet compresses against the estimate) it says so, once.
    assert ("over disk_max_bytes" in caplog.text) == (status.disk_used_bytes > budget)


def test_room_comes_back_when_segments_are_removed(tmp_path: Path) -> None:
    records = generate(STREAM, 100)
    spool = Spool(
        tmp_path, 1, segment_max_bytes=2_000, segment_max_age_ms=10**9, disk_max_bytes=1_000_000
    )
    try:
        spool.append(STREAM, records.records())
        spool.tick(1)
        wait_until(lambda: spool.status().segments_written > 1, "segments written")
        wait_until(lambda: spool.status().queue_depth == 0, "the writer to drain its queue")
        used = spool.status().disk_used_bytes
        assert used > 0
        for segment in find_segments(tmp_path):
            os.unlink(segment.path)  # an operator (or the store's reclaim) freed the disk
        spool.tick(1 + spool_module.RECLAIM_INTERVAL_MS)
        wait_until(lambda: spool.status().disk_used_bytes == 0, "the disk counted again")
    finally:
        spool.close()


def test_out_of_order_records_stop_the_stream(tmp_path: Path) -> None:
    records = generate(STREAM, 20)
    with Spool(tmp_path, 0) as spool:
        assert spool.append(STREAM, records.records(10, 20))
        assert not spool.append(STREAM, records.records(0, 10))
        assert not spool.append(STREAM, records.records(19, 20))  # stays stopped
    assert "out of order" in spool.status().stopped_streams[STREAM]
    assert spool.refused_streams() == {STREAM}  # the relay stops voting on it
    assert _read_all(tmp_path) == records.records(10, 20)


def test_limits_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="segment_max_bytes"):
        Spool(tmp_path, 0, segment_max_bytes=0)


def test_ingested_segments_are_reclaimed_by_their_own_relay(tmp_path: Path) -> None:
    from relay.tools.store_baseline import ingest_baseline

    spool_dir, store_dir = tmp_path / "spool", tmp_path / "store"
    records = generate(STREAM, 200, seed=5)
    for relay in (0, 1):
        with Spool(spool_dir, relay, segment_max_bytes=4_000) as spool:
            spool.append(STREAM, records.records())
    written = find_segments(spool_dir)
    assert {s.relay for s in written} == {0, 1}
    assert ingest_baseline(str(spool_dir), str(store_dir)).records_added == 200
    later = generate(STREAM, 220, seed=5).records(200, 220)  # not ingested yet
    spool = Spool(spool_dir, 0, store=as_location(store_dir))
    try:
        spool.append(STREAM, later)
        spool.tick(1)  # the first tick reclaims
        wait_until(lambda: spool.status().segments_reclaimed > 0, "the ingested segments reclaimed")
    finally:
        spool.close()
    left = find_segments(spool_dir)
    assert {s.relay for s in left if s.first_seq <= records.seqs[-1]} == {1}  # only its own
    assert [s.first_seq for s in left if s.relay == 0] == [later[0][0]]
    assert spool.status().segments_reclaimed == sum(1 for s in written if s.relay == 0)
