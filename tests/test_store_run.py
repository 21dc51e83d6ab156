"""Keeping a store: retention, compaction and vacuum of its Delta tables
(relay.store.maintain), the runner's schedule and status (relay.storerun), and `relay store
run` as a real process. The jobs run on the pyarrow baseline (the Spark jobs write the
same tables: tests/test_store.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

from relay.store import maintain, tables
from relay.store.location import as_location
from relay.store.lock import LOCK_FILE, WriterLock
from relay.store.reader import StoreReader
from relay.store.tables import load_store
from relay.storerun import STATUS_FILE, StoreRunner, read_status
from relay.tools import store_baseline
from relay.tools.store_baseline import BaselineEngine
from relay.tools.synthetic import StreamRecords, generate, write_spools
from relay.topology import StoreSettings
from store_topology import relay_with, spooling_topology
from waiting import wait_until

RUN_CLI_TIMEOUT_S = 120


def _spool_upto(spool: Path, records: list[StreamRecords], stop: int) -> None:
    """The relays' spools holding each stream's first `stop` records (what ingest already
    stored is simply read again and skipped)."""
    write_spools(str(spool), [r.slice(0, stop) for r in records], segment_records=50)


def _stored_seqs(store: Path, stream: str) -> list[int]:
    return [r.seq for r in StoreReader(store).records_after(stream, -1)]


def _kept(records: StreamRecords, after_seq: int) -> list[int]:
    return [
        s
        for s, duplicate in zip(records.seqs, records.duplicates, strict=True)
        if s > after_seq and not duplicate
    ]


def test_retention_keeps_older_history_only_as_snapshots(tmp_path: Path) -> None:
    records = generate("kept", 600, seed=3)
    spool, store = tmp_path / "spool", tmp_path / "store"
    points = []
    for stop in (200, 400, 600):  # three ingests, a snapshot after each
        _spool_upto(spool, [records], stop)
        store_baseline.ingest_baseline(str(spool), str(store))
        store_baseline.snapshot_baseline(str(store))
        points.append(records.seqs[stop - 1])
    assert load_store(store).streams["kept"].snapshot_seqs == points

    # Everything up to just past the second snapshot is old: the records up to it go (they
    # live on in that snapshot), and with two snapshots kept the first goes too.
    with tables.writing(store, "retire"):
        result = maintain.retire(store, cut_seq=records.seqs[450], keep_snapshots=2)
    assert result.retained_after == {"kept": points[1]}
    assert result.records_removed == 400 and result.snapshots_removed == 1
    state = load_store(store).streams["kept"]
    assert state.retained_after == points[1] and state.snapshot_seqs == points[1:]
    assert state.files[0].first_seq == records.seqs[400]
    # The kept chain still checks, from the snapshot it continues.
    verified = store_baseline.verify_baseline(str(store))
    assert verified.points == {"kept": (points[2], records.digests[-1])}
    assert (verified.snapshots_checked, verified.snapshots_unchecked) == (1, 1)
    # Readers: from the beginning means from the first record kept; the latest snapshot is
    # there, and its base with the records after it rebuild the same state.
    assert _stored_seqs(store, "kept") == _kept(records, points[1])
    reader = StoreReader(store)
    assert reader.retained_after("kept") == points[1]
    latest = reader.snapshot("kept")
    assert latest is not None and latest.seq == points[2]
    # The last file always stays: nothing newer than the last snapshot is ever retired, and
    # a retire with nothing older to remove changes nothing.
    with tables.writing(store, "retire"):
        again = maintain.retire(store, cut_seq=records.seqs[-1], keep_snapshots=2)
    assert again.records_removed == 0
    assert load_store(store).streams["kept"].last_seq == records.seqs[-1]


def test_snapshots_spread_over_the_window_stay_for_later_cuts(tmp_path: Path) -> None:
    """With few snapshots kept and a long retention window, pruning to the newest would
    leave no snapshot for the cut to reach as it moves on: one per period above the cut
    stays, and the next retire finds its point."""
    from relay.core.seq import compose

    spool, store = tmp_path / "spool", tmp_path / "store"
    chunks: list[StreamRecords] = []
    for hour in range(3):  # records an hour apart, a snapshot after each hour's
        previous = chunks[-1] if chunks else None
        chunks.append(
            generate(
                "spread",
                100,
                seed=hour,
                first_seq=compose(3_600_000 * (hour + 1), 0, 0),
                previous_digest=previous.digests[-1] if previous else None,
                first_index=100 * hour,
            )
        )
        write_spools(str(spool), chunks, segment_records=50)
        store_baseline.ingest_baseline(str(spool), str(store))
        store_baseline.snapshot_baseline(str(store))
    points = [c.seqs[-1] for c in chunks]
    with tables.writing(store, "retire"):
        spread = maintain.retire(store, cut_seq=-1, keep_snapshots=1, spread_ms=3_600_000)
    assert spread.snapshots_removed == 0
    assert load_store(store).streams["spread"].snapshot_seqs == points
    # The cut moves past the second hour: the records up to its snapshot retire.
    with tables.writing(store, "retire"):
        later = maintain.retire(store, cut_seq=points[1], keep_snapshots=1, spread_ms=3_600_000)
    assert later.retained_after == {"spread": points[1]} and later.records_removed == 200
    # Without the spread only the newest (and the anchor) would have stayed.
    with tables.writing(store, "retire"):
        maintain.retire(store, cut_seq=points[1], keep_snapshots=1)
    assert load_store(store).streams["spread"].snapshot_seqs == points[1:]


def test_a_consumer_cannot_start_in_retired_history(tmp_path: Path) -> None:
    """A position inside retired history is not served from the store (the records right
    after it are gone); from the beginning reads what is kept."""
    from relay.client import _StoreFeed
    from relay.engines import StoreRead

    records = generate("old", 300, seed=4)
    spool, store = tmp_path / "spool", tmp_path / "store"
    for stop in (150, 300):
        _spool_upto(spool, [records], stop)
        store_baseline.ingest_baseline(str(spool), str(store))
        store_baseline.snapshot_baseline(str(store))
    with tables.writing(store, "retire"):
        maintain.retire(store, cut_seq=records.seqs[-1], keep_snapshots=5)
    feed = _StoreFeed(as_location(store))
    inside = feed.read("old", StoreRead(records.seqs[10], refresh=True), 1000)
    assert inside.records == [] and inside.store_last is None
    earliest = feed.read("old", StoreRead(-1, refresh=True), 1000)
    assert [r.seq for r in earliest.records] == _kept(records, records.seqs[149])


def test_compaction_merges_small_files_in_seq_order(tmp_path: Path) -> None:
    records = generate("small", 500, seed=5)
    spool, store = tmp_path / "spool", tmp_path / "store"
    for stop in range(100, 501, 100):  # five ingests: five small files
        _spool_upto(spool, [records], stop)
        store_baseline.ingest_baseline(str(spool), str(store))
    before = load_store(store).streams["small"]
    assert len(before.files) == 5
    expected = _stored_seqs(store, "small")
    with tables.writing(store, "compact"):
        result = maintain.compact(store, below_bytes=1 << 20, target_bytes=64 << 20)
    assert (result.files_before, result.files_after, result.records) == (5, 1, 500)
    after = load_store(store).streams["small"]
    assert len(after.files) == 1 and after.last_digest == before.last_digest
    [only] = after.files
    seqs = pq.read_table(store / only.path, columns=["seq"]).column("seq").to_pylist()
    assert seqs == sorted(seqs) == records.seqs
    assert _stored_seqs(store, "small") == expected
    store_baseline.verify_baseline(str(store))
    # The next ingest appends after the compacted file; the files it replaced stay for
    # readers of older versions until a vacuum past the retention.
    from deltalake import DeltaTable

    assert (
        DeltaTable((store / tables.records_table("small")), version=before.version).version() == 4
    )
    with tables.writing(store, "vacuum"):
        vacuumed = maintain.vacuum(store, retention_hours=0)
    assert vacuumed.files_removed == 5
    on_disk = list((store / tables.records_table("small")).glob("*.parquet"))
    assert [p.name for p in on_disk] == [Path(only.path).name]


def test_compaction_keeps_the_file_ends_snapshots_were_taken_at(tmp_path: Path) -> None:
    """Retention cuts only at a snapshot taken at a file end: compaction never merges
    across one, so old records can still be retired after it."""
    records = generate("cuts", 600, seed=9)
    spool, store = tmp_path / "spool", tmp_path / "store"
    for stop in range(100, 601, 100):  # six small files, a snapshot after the third
        _spool_upto(spool, [records], stop)
        store_baseline.ingest_baseline(str(spool), str(store))
        if stop == 300:
            store_baseline.snapshot_baseline(str(store))
    with tables.writing(store, "compact"):
        result = maintain.compact(store, below_bytes=1 << 20, target_bytes=64 << 20)
    assert (result.files_before, result.files_after) == (6, 2)
    files = load_store(store).streams["cuts"].files
    assert [f.last_seq for f in files] == [records.seqs[299], records.seqs[-1]]
    with tables.writing(store, "retire"):
        retired = maintain.retire(store, cut_seq=records.seqs[-1], keep_snapshots=5)
    assert retired.records_removed == 300


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now_s


def test_the_runner_runs_each_job_on_its_schedule(tmp_path: Path) -> None:
    records = generate("sched", 200, seed=6)
    spool, store = tmp_path / "spool", tmp_path / "store"
    _spool_upto(spool, [records], 100)
    clock = FakeClock()
    settings = StoreSettings(
        ingest_interval_s=10, snapshot_interval_s=30, compact_interval_s=60, vacuum_interval_s=90
    )
    runner = StoreRunner(settings, spool, store, BaselineEngine(), clock=clock)
    assert [f.job for f in runner.step()] == ["ingest", "snapshot", "compact", "vacuum"]
    clock.now_s += 5
    assert runner.step() == [] and runner.seconds_to_next() == 5
    _spool_upto(spool, [records], 200)
    clock.now_s += 5
    [ingested] = runner.step()
    assert ingested.job == "ingest" and ingested.figures["records_added"] == 100
    status = read_status(store)
    assert status is not None
    assert status["runs"] == {"ingest": 2, "snapshot": 1, "compact": 1, "vacuum": 1}
    assert status["streams"]["sched"]["last_seq"] == str(records.seqs[-1])
    assert status["streams"]["sched"]["snapshot_seq"] == str(records.seqs[99])
    # Another writer holds the store: the job is skipped, named and counted, and the
    # runner goes on.
    runner.settings = StoreSettings(lock_wait_s=0)
    clock.now_s += 20
    with WriterLock(store, "a manual snapshot"):
        jobs = {f.job: f for f in runner.step()}
    assert not jobs["snapshot"].ok and "a manual snapshot" in jobs["snapshot"].error
    assert runner.failures["snapshot"] == 1
    clock.now_s += 30
    assert {f.job: f.ok for f in runner.step()}["snapshot"]
    assert load_store(store).streams["sched"].snapshot_seqs == [records.seqs[99], records.seqs[-1]]
    # Only the newest keep_snapshots stay, even with every record kept.
    runner.settings = StoreSettings(keep_snapshots=1)
    _spool_upto(spool, [records], 200)
    clock.now_s += 300
    runner.step()
    assert load_store(store).streams["sched"].snapshot_seqs == [records.seqs[-1]]


def test_relay_store_run_keeps_the_store_up_to_date(tmp_path: Path) -> None:
    """The command as an operator runs it: it ingests what the relays spool as it comes
    and snapshots it, then stops cleanly on SIGTERM."""
    topology = spooling_topology(tmp_path, {"ingest_interval_s": 1, "snapshot_interval_s": 1})
    records = generate("s.live", 300, seed=7)
    spool, store = tmp_path / "data" / "spool", tmp_path / "data" / "store"
    _spool_upto(spool, [records], 100)
    command = [sys.executable, "-m", "relay", "store", "run", "--config", str(topology)]
    process = subprocess.Popen(
        [*command, "--engine", "baseline"], stderr=subprocess.PIPE, text=True
    )
    try:

        def stored_upto(index: int) -> bool:
            status = read_status(store)
            stream = (status or {}).get("streams", {}).get("s.live", {})
            return bool(stream.get("snapshot_seq") == str(records.seqs[index]))

        wait_until(lambda: stored_upto(99), "the first spooled records stored and snapshot")
        _spool_upto(spool, [records], 300)
        wait_until(lambda: stored_upto(299), "the records spooled later stored and snapshot")
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=RUN_CLI_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert "store runner: ingest in" in stderr and "records_added=200" in stderr
    assert _stored_seqs(store, "s.live") == _kept(records, -1)
    assert (store / STATUS_FILE).is_file()


def test_relay_store_run_once_names_a_bad_schedule(tmp_path: Path) -> None:
    topology = spooling_topology(tmp_path, {"ingest_interval_s": 0})
    done = subprocess.run(
        [sys.executable, "-m", "relay", "store", "run", "--config", str(topology), "--once"],
        capture_output=True,
        text=True,
        timeout=RUN_CLI_TIMEOUT_S,
    )
    assert done.returncode == 2
    assert "store.ingest_interval_s" in done.stderr and "positive" in done.stderr


def test_relay_status_shows_the_store_runner(tmp_path: Path) -> None:
    """After a round of `relay store run --once`, `relay status` shows its jobs and where
    each stream stands in the store (the relays are down here: exit 2)."""
    topology = spooling_topology(tmp_path, {})
    records = generate("s.seen", 150, seed=8)
    _spool_upto(tmp_path / "data" / "spool", [records], 150)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return relay_with(topology, *args)

    once = cli("store", "run", "--engine", "baseline", "--once")
    assert once.returncode == 0, once.stderr
    shown = cli("status", "--json", "--timeout", "0.2")
    assert shown.returncode == 2  # down: no relay answers
    store = json.loads(shown.stdout)["store"]
    assert store["runner"]["runs"] == {"ingest": 1, "snapshot": 1, "compact": 1, "vacuum": 1}
    assert store["runner"]["streams"]["s.seen"]["last_seq"] == str(records.seqs[-1])
    text = cli("status", "--timeout", "0.2").stdout
    assert "store runner" in text and "records_added=150" in text
    assert str(records.seqs[-1]) in text


@pytest.fixture(autouse=True)
def _no_leftover_lock(tmp_path: Path) -> Any:
    yield
    # Every lock a test took was released: a new writer gets it at once.
    for lock in tmp_path.rglob(LOCK_FILE):
        with WriterLock(lock.parent, "check"):
            pass
