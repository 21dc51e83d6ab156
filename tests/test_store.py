"""The store: the change model, Spark ingest / snapshot / verify against expected data and
against the pyarrow baseline, idempotence, divergence and broken chains, crash atomicity,
and the pyarrow-only reader. One local SparkSession serves the whole test session."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

from relay.core.digest import chain
from relay.segment import find_segments, stream_dir_name, write_segment_file
from relay.spool import Spool
from relay.store import tables
from relay.store.changes import (
    KIND_CHANGES,
    KIND_PLAIN,
    MAX_CHANGES_PER_TX,
    Change,
    Op,
    changes_of,
    decode_changes,
    encode_changes,
)
from relay.store.errors import (
    IngestFailed,
    InvalidChanges,
    StoreCorrupt,
    StoreLocked,
    VerifyFailed,
)
from relay.store.lock import WriterLock
from relay.store.reader import StoreReader
from relay.store.tables import load_store
from relay.tools import store_baseline
from relay.tools.synthetic import StreamRecords, generate, write_spools

STREAMS = ("orders.eu", "a/b c")

# --- the change model (no Spark) -----------------------------------------------------------


def test_changes_round_trip_and_plain_values() -> None:
    changes = [
        Change("order", b"k1", Op.PUT, b"v1"),
        Change("", b"", Op.DELETE, None),
        Change("customer", b"\x00\xff", Op.PUT, b""),
    ]
    assert decode_changes(encode_changes(changes)) == changes
    assert changes_of(KIND_CHANGES, None, encode_changes(changes)) == changes
    assert changes_of(KIND_PLAIN, b"k", b"v") == [Change("", b"k", Op.PUT, b"v")]
    assert changes_of(KIND_PLAIN, None, b"v") == [Change("", b"", Op.PUT, b"v")]


@pytest.mark.parametrize(
    ("encoded", "problem"),
    [
        (b"\xc1garbage", "not valid msgpack"),
        (b"\x92\x02\x91\x94\xa0\xc4\x00\x00\xc4\x00", "format version 2"),
        (b"\x92\x01\x90", "1..10000 changes"),
        (b"\x92\x01\x91\x93\xa0\xc4\x00\x00", "change 0: must be an array"),
        (b"\x92\x01\x91\x94\xa0\xc4\x00\x07\xc4\x00", "change 0: op must be 0"),
        (b"\x92\x01\x91\x94\xa0\xc4\x00\x01\xc4\x00", "change 0: a delete carries no value"),
        (b"\x92\x01\x91\x94\xa0\xc4\x00\x00\xc0", "change 0: a put needs a bytes value"),
        (b"\x92\x01\x91\x94\x01\xc4\x00\x00\xc4\x00", "change 0: entity must be a str"),
    ],
)
def test_bad_change_lists_are_named(encoded: bytes, problem: str) -> None:
    with pytest.raises(InvalidChanges, match=problem):
        decode_changes(encoded)


def test_encode_checks_the_limits() -> None:
    with pytest.raises(InvalidChanges, match=r"1\.\.10000 changes"):
        encode_changes([])
    with pytest.raises(InvalidChanges, match=r"1\.\.10000 changes"):
        encode_changes([Change("", b"k", Op.DELETE)] * (MAX_CHANGES_PER_TX + 1))
    with pytest.raises(InvalidChanges, match="change 1: key of 5000 bytes"):
        encode_changes([Change("", b"k", Op.DELETE), Change("", b"k" * 5000, Op.DELETE)])
    with pytest.raises(InvalidChanges, match="kind 7 unknown"):
        changes_of(7, None, b"")


# --- fixtures -------------------------------------------------------------------------------


def _streams(count: int = 600, **kwargs: Any) -> list[StreamRecords]:
    return [generate(name, count, seed=i, **kwargs) for i, name in enumerate(STREAMS)]


def _stored_rows(store: Path) -> list[dict[str, Any]]:
    """Every stored record, sorted by (stream, seq), read with pyarrow."""
    state = load_store(store)
    files = [pq.read_table(store / f.path) for s in state.streams.values() for f in s.files]
    rows = pa.concat_tables(files).to_pylist() if files else []
    return sorted(rows, key=lambda r: (r["stream"], r["seq"]))


def _expected_rows(streams: list[StreamRecords], upto: dict[str, int] | None = None) -> list[Any]:
    rows = []
    for records in streams:
        table = records.table(relay=0).drop_columns(["relay"])
        for row in table.to_pylist():
            if upto is None or row["seq"] < upto.get(records.stream, 1 << 63):
                rows.append(row)
    return sorted(rows, key=lambda r: (r["stream"], r["seq"]))


def _expected_snapshot(records: StreamRecords, upto: int | None = None) -> dict[Any, Any]:
    state: dict[tuple[str, bytes], tuple[bytes, int]] = {}
    for i, seq in enumerate(records.seqs):
        if upto is not None and seq > upto:
            break
        if records.duplicates[i]:
            continue
        for change in changes_of(records.kinds[i], records.keys[i], records.values[i]):
            if change.op == Op.PUT:
                assert change.value is not None
                state[(change.entity, change.key)] = (change.value, seq)
            else:
                state.pop((change.entity, change.key), None)
    return state


def _rows_of_snapshot_table(store: Path, stream: str, seq: int) -> dict[Any, Any]:
    """A snapshot table's rows as Polars reads them through deltalake."""
    import polars as pl

    frame = pl.read_delta(str(store / tables.snapshot_table(stream, seq)))
    return {(r["entity"], r["key"]): (r["value"], r["seq"]) for r in frame.iter_rows(named=True)}


def _snapshot_of(store: Path, stream: str) -> dict[Any, Any]:
    snap = StoreReader(store).snapshot(stream)
    assert snap is not None
    return {(r["entity"], r["key"]): (r["value"], r["seq"]) for r in snap.rows.to_pylist()}


# --- Spark ingest, snapshot, verify ----------------------------------------------------------


def test_ingest_and_snapshot_match_expected_data_and_the_baseline(
    spark: Any, tmp_path: Path
) -> None:
    from pyspark.testing import assertDataFrameEqual

    from relay.store.ingest import ingest
    from relay.store.snapshot import snapshot
    from relay.store.verify import verify

    streams = _streams()
    write_spools(str(tmp_path / "spool"), streams, segment_records=150)
    store = tmp_path / "store"
    result = ingest(spark, str(tmp_path / "spool"), str(store))
    assert result.records_added == sum(len(s) for s in streams)
    for records in streams:
        assert result.streams[records.stream] == (records.seqs[-1], records.digests[-1])

    # Frame for frame: the stored records are exactly the committed records, once each,
    # read by Spark from the file list of the streams' Delta tables.
    from deltalake import DeltaTable

    state = load_store(store)
    files = [u for s in STREAMS for u in DeltaTable(store / tables.records_table(s)).file_uris()]
    stored = spark.read.parquet(*files)
    expected = spark.createDataFrame(_expected_rows(streams), schema=stored.schema)
    assertDataFrameEqual(stored, expected)
    # One table per stream, each commit carrying the chain position; every segment is
    # covered by what is stored (its relay may remove it).
    for name, stream_state in state.streams.items():
        assert all(
            f.path.startswith(f"streams/{tables.table_dir_name(name)}/records/")
            for f in stream_state.files
        )
        assert all(
            s.last_seq <= stream_state.last_seq
            for s in find_segments(tmp_path / "spool")
            if s.stream == name
        )
        [commit] = DeltaTable(store / tables.records_table(name)).history(1)
        assert commit["relay.last_seq"] == str(stream_state.last_seq)
        assert commit["relay.last_digest"] == stream_state.last_digest

    made = snapshot(spark, str(store))
    for records in streams:
        assert made[records.stream].seq == records.seqs[-1]
        assert made[records.stream].digest == records.digests[-1].hex()
        assert _snapshot_of(store, records.stream) == _expected_snapshot(records)
    verified = verify(spark, str(store))
    assert verified.points == {r.stream: (r.seqs[-1], r.digests[-1]) for r in streams}
    assert verified.snapshots_checked == len(streams)

    # The pyarrow baseline builds the same store.
    other = tmp_path / "baseline"
    store_baseline.ingest_baseline(str(tmp_path / "spool"), str(other))
    store_baseline.snapshot_baseline(str(other))
    assert _stored_rows(other) == _stored_rows(store)
    for records in streams:
        assert _snapshot_of(other, records.stream) == _snapshot_of(store, records.stream)
    assert store_baseline.verify_baseline(str(other)) == verify(spark, str(store))


def test_ingest_twice_adds_nothing_and_new_segments_append(spark: Any, tmp_path: Path) -> None:
    from relay.store.ingest import ingest
    from relay.store.snapshot import snapshot

    full = _streams(800)
    first = [r.slice(0, 500) for r in full]
    spool, store = str(tmp_path / "spool"), tmp_path / "store"
    write_spools(spool, first, segment_records=120)
    ingest(spark, spool, str(store))
    snapshot(spark, str(store))
    versions = load_store(store).versions()
    again = ingest(spark, spool, str(store))
    assert again.records_added == 0 and again.versions == versions
    assert snapshot(spark, str(store)) == {}

    # The relays spool more (new segments continue the chains): only they are added, and
    # the snapshot builds on the previous one.
    shutil.rmtree(spool)
    write_spools(spool, full, segment_records=120)  # overlaps what is stored
    result = ingest(spark, spool, str(store))
    assert result.records_added == 300 * len(full)
    assert _stored_rows(store) == _expected_rows(full)
    made = snapshot(spark, str(store))
    for records in full:
        assert made[records.stream].seq == records.seqs[-1]
        assert _snapshot_of(store, records.stream) == _expected_snapshot(records)
    # As of an older seq: a new point in time, rebuilt from the start, with the digest
    # stored at that seq; the latest snapshot stays the latest.
    older = full[0].seqs[100]
    made = snapshot(spark, str(store), as_of={full[0].stream: older})
    assert made[full[0].stream].seq == older
    assert made[full[0].stream].digest == full[0].digests[100].hex()
    assert _snapshot_of(store, full[0].stream) == _expected_snapshot(full[0])
    older_rows = _rows_of_snapshot_table(store, full[0].stream, older)
    assert older_rows == _expected_snapshot(full[0], older)
    assert snapshot(spark, str(store), as_of={full[0].stream: older}) == {}
    # Time travel: the records table as of each ingest's version.
    from deltalake import DeltaTable

    table = DeltaTable((store / tables.records_table(full[1].stream)), version=0)
    assert table.to_pyarrow_table().num_rows == 500
    assert DeltaTable(store / tables.records_table(full[1].stream)).version() == 1


def test_a_divergent_copy_is_outvoted_and_quarantined(spark: Any, tmp_path: Path) -> None:
    from relay.store.ingest import ingest
    from relay.store.verify import verify

    streams = _streams(400)
    spool, store = tmp_path / "spool", tmp_path / "store"
    write_spools(str(spool), streams, segment_records=100)
    bad_seq = streams[0].seqs[250]
    _rewrite_relay_copy(spool, relay=2, stream=streams[0].stream, seq=bad_seq)
    result = ingest(spark, str(spool), str(store))
    # Relays 0 and 1 agree: relay 2's copy is outvoted, named, and its segment moved out.
    assert result.outvoted == [(streams[0].stream, 2, bad_seq)]
    [moved] = result.quarantined
    assert "/quarantine/relay=2/" in moved and Path(moved).is_file()
    assert not any(
        s.relay == 2 and s.first_seq <= bad_seq <= s.last_seq
        for s in find_segments(spool)
        if s.stream == streams[0].stream
    )
    assert _stored_rows(store) == _expected_rows(streams)
    verify(spark, str(store))


def test_copies_without_a_majority_stop_the_stream(tmp_path: Path) -> None:
    records = generate("tied", 200, seed=8)
    spool, store = tmp_path / "spool", tmp_path / "store"
    write_spools(str(spool), [records], relays=2, segment_records=50)
    bad_seq = records.seqs[120]
    _rewrite_relay_copy(spool, relay=1, stream="tied", seq=bad_seq)
    with pytest.raises(IngestFailed) as failure:
        store_baseline.ingest_baseline(str(spool), str(store))
    [problem] = failure.value.problems
    assert (problem.seq, problem.relays) == (bad_seq, (0, 1))
    assert "no majority of the copies" in str(problem)
    assert StoreReader(store).last_points()["tied"].seq == records.seqs[119]


@pytest.mark.parametrize(
    ("relay", "index", "segment_records"),
    [
        # Relay 0's copy, the one stored first: it fails the chain, relay 1's is stored.
        (0, 77, 200),
        # Relay 2's copy, not the one stored (relay 0's is): compared in content.
        (2, 150, 100),
    ],
)
def test_a_copy_with_the_right_digest_and_other_content_is_outvoted(
    tmp_path: Path, relay: int, index: int, segment_records: int
) -> None:
    """A relay's copy keeps the right digest but not the right content: whether it is the
    copy ingest would store or another, it is outvoted, named and its segment quarantined,
    and the right content is stored."""
    records = generate("flaky", 200, seed=9)
    spool, store = tmp_path / "spool", tmp_path / "store"
    write_spools(str(spool), [records], relays=3, segment_records=segment_records)
    bad_seq = records.seqs[index]
    _rewrite_relay_copy(spool, relay=relay, stream="flaky", seq=bad_seq, keep_digest=True)
    result = store_baseline.ingest_baseline(str(spool), str(store))
    assert result.outvoted == [("flaky", relay, bad_seq)] and len(result.quarantined) == 1
    assert result.copies_checked == 2 * len(records)
    stored = {r.seq: r.value for r in StoreReader(store).records_after("flaky", -1)}
    assert len(stored) == records.duplicates.count(False)
    assert stored[bad_seq] == records.values[index]


def test_a_broken_chain_is_reported(spark: Any, tmp_path: Path) -> None:
    from relay.store.ingest import ingest

    records = generate("gappy", 300)
    spool = tmp_path / "spool"
    # No relay holds records 100..149: record 150 does not chain from record 99.
    write_spools(str(spool), [records.slice(0, 100), records.slice(150, 300)], segment_records=60)
    with pytest.raises(IngestFailed, match="does not chain from seq") as failure:
        ingest(spark, str(spool), str(tmp_path / "store"))
    [problem] = failure.value.problems
    assert (problem.stream, problem.seq) == ("gappy", records.seqs[150])
    assert StoreReader(tmp_path / "store").last_points()["gappy"].seq == records.seqs[99]


def test_a_crash_before_commit_leaves_the_store_as_it_was(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.store.ingest import ingest
    from relay.store.snapshot import snapshot

    full = _streams(400)
    spool, store = str(tmp_path / "spool"), tmp_path / "store"
    write_spools(spool, [r.slice(0, 200) for r in full], segment_records=100)
    ingest(spark, spool, str(store))
    before = _stored_rows(store)
    versions = load_store(store).versions()

    def crash() -> None:
        raise RuntimeError("injected crash between write and commit")

    shutil.rmtree(spool)
    write_spools(spool, full, segment_records=100)
    with pytest.raises(RuntimeError, match="injected crash"):
        ingest(spark, spool, str(store), before_commit=crash)
    assert load_store(store).versions() == versions
    assert _stored_rows(store) == before
    with pytest.raises(RuntimeError, match="injected crash"):
        snapshot(spark, str(store), before_commit=crash)
    assert StoreReader(store).snapshot(full[0].stream) is None
    # A crash after the files were moved into a table and before its commit: no version
    # names them.
    monkeypatch.setattr(tables, "_commit", lambda *args: crash())
    with pytest.raises(RuntimeError, match="injected crash"):
        ingest(spark, spool, str(store))
    monkeypatch.undo()
    assert load_store(store).versions() == versions
    assert _stored_rows(store) == before
    # The next run completes the work, and the crashed runs' files are cleaned up.
    ingest(spark, spool, str(store))
    assert _stored_rows(store) == _expected_rows(full)
    listed = {f.path for s in load_store(store).streams.values() for f in s.files}
    on_disk = {str(p.relative_to(store)) for p in (store / "streams").rglob("*.parquet")} - {
        str(p.relative_to(store)) for p in (store / "streams").rglob("_delta_log/*")
    }
    assert on_disk == listed
    assert not (store / "_staging").exists() or not any((store / "_staging").iterdir())


@pytest.mark.parametrize("damage", ["not parquet", "fewer rows"])
def test_a_staged_file_that_is_not_what_its_task_wrote_is_never_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A write that went wrong on its way to the store (a truncated upload, a store that
    kept something else) stops the job before a commit names the file."""
    records = generate("damaged", 300, seed=6)
    spool, store = str(tmp_path / "spool"), tmp_path / "store"
    write_spools(spool, [records.slice(0, 100)], segment_records=50)
    store_baseline.ingest_baseline(spool, store)
    before = load_store(store).versions()
    real_commit = tables.commit_records

    def damaging(location: Any, stream: str, state: Any, files: Any, *rest: Any) -> int:
        path = Path(location.path(files[0].path))
        if damage == "not parquet":
            path.write_bytes(path.read_bytes()[:-100])
        else:
            pq.write_table(pq.read_table(path).slice(1), path)
        return real_commit(location, stream, state, files, *rest)

    monkeypatch.setattr("relay.store.plan.commit_records", damaging)
    write_spools(spool, [records], segment_records=50)
    expected = "is not a readable Parquet file" if damage == "not parquet" else "rows, its task"
    with pytest.raises(StoreCorrupt, match=expected):
        store_baseline.ingest_baseline(spool, store)
    assert load_store(store).versions() == before
    monkeypatch.undo()
    assert store_baseline.ingest_baseline(spool, store).records_added == 200
    assert [r.seq for r in StoreReader(store).records_after("damaged")] == [
        s for s, dup in zip(records.seqs, records.duplicates, strict=True) if not dup
    ]


def test_verify_finds_a_corrupt_record(spark: Any, tmp_path: Path) -> None:
    from relay.store.verify import verify

    streams = _streams(300)
    write_spools(str(tmp_path / "spool"), streams, segment_records=100)
    store = tmp_path / "store"
    store_baseline.ingest_baseline(str(tmp_path / "spool"), str(store))
    state = load_store(store).streams[streams[1].stream]
    path = store / state.files[0].path
    table = pq.read_table(path).to_pylist()
    table[10]["value"] = b"tampered"
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(path)), path)
    with pytest.raises(VerifyFailed) as failure:
        verify(spark, str(store))
    [problem] = failure.value.problems
    assert (problem.stream, problem.seq) == (streams[1].stream, streams[1].seqs[10])
    with pytest.raises(VerifyFailed):
        store_baseline.verify_baseline(str(store))


def test_verify_finds_a_seq_stored_twice(spark: Any, tmp_path: Path) -> None:
    """A records file added a second time under another name (by hand, with deltalake):
    verify names the overlap; the reader still yields each seq once."""
    import json as json_module

    from deltalake import DeltaTable, Schema
    from deltalake.transaction import AddAction

    from relay.store.chaincheck import RECORD_SCHEMA
    from relay.store.verify import verify

    records = generate("twice", 300, seed=12)
    write_spools(str(tmp_path / "spool"), [records], segment_records=100)
    store = tmp_path / "store"
    store_baseline.ingest_baseline(str(tmp_path / "spool"), str(store))
    [original] = load_store(store).streams["twice"].files
    table = store / tables.records_table("twice")
    shutil.copy(store / original.path, table / "copy.parquet")
    stats = {
        "numRecords": original.records,
        "minValues": {"seq": original.first_seq},
        "maxValues": {"seq": original.last_seq},
        "nullCount": {"seq": 0},
    }
    size = (table / "copy.parquet").stat().st_size
    DeltaTable(table).create_write_transaction(
        [AddAction("copy.parquet", size, {}, 0, True, json_module.dumps(stats))],
        mode="append",
        schema=Schema.from_arrow(RECORD_SCHEMA),
    )
    for check in (
        lambda: verify(spark, str(store)),
        lambda: store_baseline.verify_baseline(str(store)),
    ):
        with pytest.raises(VerifyFailed, match="stored more than once"):
            check()
    seqs = [r.seq for r in StoreReader(store).records_after("twice", -1)]
    assert seqs == sorted(set(seqs)) and len(seqs) == records.duplicates.count(False)


def test_verify_compares_every_snapshot_with_the_fold(spark: Any, tmp_path: Path) -> None:
    """Two snapshots per stream, each checked against the fold of the records (the second
    on top of the first); a snapshot row changed on disk is found and named."""
    from relay.store.verify import verify

    full = _streams(300)
    spool, store = str(tmp_path / "spool"), tmp_path / "store"
    for stop in (150, 300):
        write_spools(spool, [r.slice(0, stop) for r in full], segment_records=50)
        store_baseline.ingest_baseline(spool, str(store))
        store_baseline.snapshot_baseline(str(store))
    verified = verify(spark, str(store))
    assert (verified.snapshots_checked, verified.snapshots_unchecked) == (4, 0)
    assert store_baseline.verify_baseline(str(store)).snapshots_checked == 4
    # Change one value of the first stream's older snapshot.
    seq = full[0].seqs[149]
    [path] = tables.load_snapshot(store, full[0].stream, seq).files
    rows = pq.read_table(store / path).to_pylist()
    rows[3]["value"] = b"tampered"
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(store / path)), store / path)
    for check in (
        lambda: verify(spark, str(store)),
        lambda: store_baseline.verify_baseline(str(store)),
    ):
        with pytest.raises(VerifyFailed) as failure:
            check()
        # (The newer snapshot is folded on top of the changed one: it differs as well.)
        problem, *after = failure.value.problems
        assert (problem.stream, problem.seq) == (full[0].stream, seq)
        assert "not the fold" in str(problem) and "1 rows of the fold are not in it" in str(problem)
        assert all(p.stream == full[0].stream and p.seq > seq for p in after)


def test_spooled_segments_ingest(spark: Any, tmp_path: Path) -> None:
    """The relay's own Spool output is what ingest reads."""
    from relay.store.ingest import ingest

    streams = _streams(300)
    for relay in range(3):
        with Spool(tmp_path / "spool", relay, segment_max_bytes=5_000 + relay * 1_000) as spool:
            for records in streams:
                for start in range(0, 300, 25):
                    # records() builds spool records; synthetic annotates them loosely.
                    batch = records.records(start, start + 25)
                    spool.append(records.stream, batch)
    ingest(spark, str(tmp_path / "spool"), str(tmp_path / "store"))
    assert _stored_rows(tmp_path / "store") == _expected_rows(streams)


def test_small_ranges_stitch_copies_from_relays_with_holes(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many range tasks per stream (cut at segment ends, segments straddling the cuts), and
    relays that each miss a part: every seq is stored once, from the lowest relay holding
    it; a divergent copy that the others outvote is left out, and a divergence without a
    majority in a middle range keeps exactly the records before it."""
    from relay.store import plan
    from relay.store.ingest import ingest

    # A range ends at every segment end, whatever the cores.
    monkeypatch.setattr(plan, "RANGE_INPUT_MIN_BYTES", 1)
    monkeypatch.setattr(plan, "RANGE_INPUT_MAX_BYTES", 1)
    records = generate("holes", 600)
    spool = tmp_path / "spool"
    # Relay 0 misses records 300..359, relay 1 misses 100..219, relay 2 holds 280..399 only.
    holdings = {0: [(0, 300), (360, 600)], 1: [(0, 100), (220, 600)], 2: [(280, 400)]}
    for relay, spans in holdings.items():
        folder = spool / f"relay={relay}" / stream_dir_name(records.stream)
        folder.mkdir(parents=True)
        for start, stop in spans:
            for first in range(start, stop, 45):
                last = min(first + 45, stop) - 1
                name = f"{records.seqs[first]}-{records.seqs[last]}.parquet"
                write_segment_file(records.table(relay, first, last + 1), folder / name)
    empty = load_store(tmp_path / "none")
    ranges = plan.plan_ranges(plan.plan_ingest(spool, empty), plan.range_bytes_for(1, 1))
    assert len(ranges) > 10

    store, other = tmp_path / "store", tmp_path / "baseline"
    ingest(spark, str(spool), str(store))
    store_baseline.ingest_baseline(str(spool), str(other))
    assert _stored_rows(store) == _stored_rows(other) == _expected_rows([records])
    assert len(load_store(store).streams["holes"].files) == len(ranges)

    # Three copies of seq 390, relay 2's divergent: outvoted, the stream stored whole.
    outvoted_seq = records.seqs[390]
    _rewrite_relay_copy(spool, relay=2, stream="holes", seq=outvoted_seq)
    result = ingest(spark, str(spool), str(tmp_path / "outvoted"))
    assert result.outvoted == [("holes", 2, outvoted_seq)]
    assert _stored_rows(tmp_path / "outvoted") == _expected_rows([records])
    # Two copies of seq 330 (relay 0 misses it), relay 2's divergent: no majority, the
    # stream keeps exactly the records before it.
    bad_seq = records.seqs[330]
    _rewrite_relay_copy(spool, relay=2, stream="holes", seq=bad_seq)
    diverged = tmp_path / "diverged"
    with pytest.raises(IngestFailed) as failure:
        ingest(spark, str(spool), str(diverged))
    [problem] = failure.value.problems
    assert (problem.seq, problem.relays) == (bad_seq, (1, 2))
    assert _stored_rows(diverged) == _expected_rows([records], upto={"holes": bad_seq})


@pytest.mark.parametrize("index", [0, 50, 77])
def test_a_corrupt_copy_heading_a_range_is_outvoted_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, index: int
) -> None:
    """Ranges cut at every segment end (50 records each): a corrupt first copy of a range
    (seq 0: checked against the genesis; seq 50: against the previous record's copies) is
    replaced as one in the middle of a range is."""
    from relay.store import plan

    monkeypatch.setattr(plan, "RANGE_INPUT_MIN_BYTES", 1)
    monkeypatch.setattr(plan, "RANGE_INPUT_MAX_BYTES", 1)
    records = generate("heads", 200, seed=10)
    spool, store = tmp_path / "spool", tmp_path / "store"
    write_spools(str(spool), [records], relays=3, segment_records=50)
    bad_seq = records.seqs[index]
    _rewrite_relay_copy(spool, relay=0, stream="heads", seq=bad_seq, keep_digest=True)
    result = store_baseline.ingest_baseline(str(spool), str(store))
    assert result.outvoted == [("heads", 0, bad_seq)]
    stored = {r.seq: r.value for r in StoreReader(store).records_after("heads", -1)}
    assert len(stored) == records.duplicates.count(False)
    assert stored.get(bad_seq, records.values[index]) == records.values[index]


def test_change_lists_chain_with_their_kind() -> None:
    """The store checks digests as the relay core makes them: a change list's kind is part
    of its transaction hash."""
    from relay.core.digest import chain_over, genesis
    from relay.core.messages import Transaction
    from relay.segment import to_signed64
    from relay.store.chaincheck import tx_hash_of

    records = generate("kinds", 20, changes_every=2)
    assert KIND_CHANGES in records.kinds
    entries = [
        (seq, Transaction(pid, pseq, key, value, kind))
        for seq, pid, pseq, key, value, kind in zip(
            records.seqs,
            records.producer_ids,
            records.producer_seqs,
            records.keys,
            records.values,
            records.kinds,
            strict=True,
        )
    ]
    assert chain_over(genesis("kinds"), entries) == records.digests[-1]
    seq, tx = entries[1]
    assert tx.kind == KIND_CHANGES
    content = tx_hash_of(tx.producer_id, to_signed64(tx.producer_seq), tx.key, tx.value, tx.kind)
    assert chain(records.digests[0], seq, content) == records.digests[1]


# --- the reader (pyarrow only) ----------------------------------------------------------------


def test_reader_bootstraps_a_consumer(tmp_path: Path) -> None:
    streams = _streams(400)
    write_spools(str(tmp_path / "spool"), streams, segment_records=90)
    store = tmp_path / "store"
    store_baseline.ingest_baseline(str(tmp_path / "spool"), str(store))
    reader = StoreReader(store)
    assert reader.snapshot(streams[0].stream) is None
    store_baseline.snapshot_baseline(str(store))
    reader.refresh()
    records = streams[0]
    after = records.seqs[123]
    got = list(reader.records_after(records.stream, after))
    want = [
        (
            records.seqs[i],
            records.keys[i],
            records.values[i],
            records.producer_ids[i],
            records.producer_seqs[i],
            records.kinds[i],
        )
        for i in range(124, len(records))
        if not records.duplicates[i]
    ]
    assert [(r.seq, r.key, r.value, r.producer_id, r.producer_seq, r.kind) for r in got] == want
    assert len(list(reader.records_after(records.stream))) == records.duplicates.count(False)
    assert reader.last_points()[records.stream].digest == records.digests[-1]
    snap = reader.snapshot(records.stream)
    assert snap is not None
    assert (snap.seq, snap.digest) == (records.seqs[-1], records.digests[-1])
    assert _snapshot_of(store, records.stream) == _expected_snapshot(records)
    from relay.store.errors import UnknownStoredStream

    with pytest.raises(UnknownStoredStream, match="no stream 'nope'"):
        list(reader.records_after("nope"))


def test_the_tables_read_as_delta_tables_elsewhere(tmp_path: Path) -> None:
    """Polars and pandas through deltalake, and DuckDB over the file list deltalake gives,
    read each stream's records and its snapshot."""
    import duckdb
    import polars as pl
    from deltalake import DeltaTable

    streams = _streams(300)
    write_spools(str(tmp_path / "spool"), streams, segment_records=70)
    store = tmp_path / "store"
    store_baseline.ingest_baseline(str(tmp_path / "spool"), str(store))
    store_baseline.snapshot_baseline(str(store))
    for records in streams:
        path = store / tables.records_table(records.stream)
        frame = pl.read_delta(str(path)).sort("seq")
        assert frame["seq"].to_list() == records.seqs
        assert frame["digest"].to_list() == records.digests
        assert len(DeltaTable(path).to_pandas()) == len(records)
        uris = DeltaTable(path).file_uris()
        query = f"select count(*), max(seq) from read_parquet({uris!r})"
        assert duckdb.execute(query).fetchall() == [(len(records), records.seqs[-1])]
        snapshot = _rows_of_snapshot_table(store, records.stream, records.seqs[-1])
        assert snapshot == _expected_snapshot(records)


def test_the_baseline_in_a_process_pool_builds_the_same_store(tmp_path: Path) -> None:
    """`workers=2` (the benchmark's fair baseline: as many cores as Spark's local[2]) runs
    the same tasks in two processes and builds the same store."""
    streams = _streams(400)
    spool = str(tmp_path / "spool")
    write_spools(spool, streams, segment_records=40)
    one, two = tmp_path / "one", tmp_path / "two"
    store_baseline.ingest_baseline(spool, str(one))
    store_baseline.snapshot_baseline(str(one))
    store_baseline.ingest_baseline(spool, str(two), workers=2)
    store_baseline.snapshot_baseline(str(two), workers=2)
    assert _stored_rows(two) == _stored_rows(one) == _expected_rows(streams)
    for records in streams:
        assert _snapshot_of(two, records.stream) == _snapshot_of(one, records.stream)


def test_a_snapshot_with_no_live_key(tmp_path: Path) -> None:
    """Every key put and then deleted: the snapshot is a table with no files, it is the
    latest, readers get no rows from it, and verify checks it against the fold."""
    from relay.core.digest import genesis, tx_hash
    from relay.core.messages import Transaction

    stream = "emptied"
    records = StreamRecords(stream, [], [], [], [], [], [], [], [])
    digest = genesis(stream)
    lists = [[Change("e", b"k", Op.PUT, b"v")], [Change("e", b"k", Op.DELETE)]]
    for index, changes in enumerate(lists):
        seq, value = 1_000_000 + index, encode_changes(changes)
        digest = chain(
            digest, seq, tx_hash(Transaction(b"p", index + 1, None, value, KIND_CHANGES))
        )
        records.seqs.append(seq)
        records.digests.append(digest)
        records.producer_ids.append(b"p")
        records.producer_seqs.append(index + 1)
        records.keys.append(None)
        records.values.append(value)
        records.kinds.append(KIND_CHANGES)
        records.duplicates.append(False)
    spool, store = str(tmp_path / "spool"), tmp_path / "store"
    write_spools(spool, [records.slice(0, 1)], segment_records=10)
    store_baseline.ingest_baseline(spool, str(store))
    store_baseline.snapshot_baseline(str(store))
    write_spools(spool, [records], segment_records=10)
    store_baseline.ingest_baseline(spool, str(store))
    [made] = store_baseline.snapshot_baseline(str(store)).values()
    assert (made.seq, made.rows, made.files) == (records.seqs[-1], 0, ())
    snapshot = StoreReader(store).snapshot(stream)
    assert snapshot is not None and snapshot.seq == records.seqs[-1]
    assert snapshot.rows.num_rows == 0
    assert store_baseline.verify_baseline(str(store)).snapshots_checked == 2


@pytest.mark.parametrize("name", ["a/b c", ".hidden", "x~y%z", "ünï", "~~%7E"])
def test_table_folders_name_any_stream(name: str) -> None:
    folder = tables.table_dir_name(name)
    assert "%" not in folder and "/" not in folder and not folder.startswith(".")
    assert tables.stream_of_dir(folder) == name


def test_one_writer_at_a_time(tmp_path: Path) -> None:
    """A second job does not touch a store another job is writing: it names the holder."""
    streams = _streams(100)
    spool, store = str(tmp_path / "spool"), tmp_path / "store"
    write_spools(spool, streams, segment_records=50)
    with WriterLock(store, "someone else's ingest"):
        with pytest.raises(StoreLocked, match="someone else's ingest") as failure:
            store_baseline.ingest_baseline(spool, str(store))
        assert "pid" in failure.value.holder and failure.value.retriable
        assert not (store / "streams").exists()
    store_baseline.ingest_baseline(spool, str(store))
    assert _stored_rows(store) == _expected_rows(streams)


def test_a_store_of_the_manifest_layout_is_converted(tmp_path: Path) -> None:
    """A store written before the Delta tables (a JSON manifest beside Parquet files) is
    converted by the next job that writes it, which then appends to it as usual."""
    import json

    full = _streams(300)
    spool, store = str(tmp_path / "spool"), tmp_path / "store"
    write_spools(spool, [r.slice(0, 200) for r in full], segment_records=60)
    store_baseline.ingest_baseline(spool, str(store))
    store_baseline.snapshot_baseline(str(store))
    _to_manifest_layout(store)
    assert not (store / "streams").exists()
    shutil.rmtree(spool)
    write_spools(spool, full, segment_records=60)
    result = store_baseline.ingest_baseline(spool, str(store))
    assert result.records_added == 100 * len(full)
    assert _stored_rows(store) == _expected_rows(full)
    for records in full:
        assert _snapshot_of(store, records.stream) == _expected_snapshot(records, records.seqs[199])
    assert not (store / "data").exists() and not (store / "_manifest").exists()
    assert json.loads(next((store / "_manifest.migrated").iterdir()).read_text())["format"] == 1
    store_baseline.verify_baseline(str(store))


def _to_manifest_layout(store: Path) -> None:
    """Rewrite a store as the earlier layout: files under data/ and snapshots/, named by
    the manifest `_manifest/00000000000000000002.json`."""
    import json

    streams = {}
    for stream, state in load_store(store).streams.items():
        folder = f"stream={stream.replace('/', '%2F').replace(' ', '%20')}"
        files = []
        for f in state.files:
            target = store / "data" / folder / Path(f.path).name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(store / f.path, target)
            path = str(target.relative_to(store))
            files.append(
                {
                    "path": path,
                    "first_seq": f.first_seq,
                    "last_seq": f.last_seq,
                    "records": f.records,
                }
            )
        [seq] = state.snapshot_seqs
        info = tables.load_snapshot(store, stream, seq)
        snapshot_files = []
        for path in info.files:
            target = store / "snapshots" / folder / Path(path).name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(store / path, target)
            snapshot_files.append(str(target.relative_to(store)))
        streams[stream] = {
            "last_seq": state.last_seq,
            "last_digest": state.last_digest,
            "records": state.records,
            "files": files,
            "segments": [],
            "snapshot": {
                "seq": info.seq,
                "digest": info.digest,
                "rows": info.rows,
                "files": snapshot_files,
            },
        }
    shutil.rmtree(store / "streams")
    (store / "_manifest").mkdir()
    document = {"format": 1, "version": 2, "committed_ms": 0, "streams": streams}
    (store / "_manifest" / f"{2:020d}.json").write_text(json.dumps(document))


# --- helpers ------------------------------------------------------------------------------------


def _rewrite_relay_copy(
    spool: Path, *, relay: int, stream: str, seq: int, keep_digest: bool = False
) -> None:
    """Give one relay's copy of (stream, seq) another value and another digest, as if that
    relay had committed a different timeline from there on (`keep_digest`: the digest
    stays, as if the value were corrupted on that relay's disk)."""
    for segment in find_segments(spool):
        if (
            segment.relay == relay
            and segment.stream == stream
            and (segment.first_seq <= seq <= segment.last_seq)
        ):
            rows = pq.read_table(segment.path).to_pylist()
            for row in rows:
                if row["seq"] == seq:
                    row["value"] = b"another value"
                    if not keep_digest:
                        row["digest"] = bytes(16)
            pq.write_table(
                pa.Table.from_pylist(rows, schema=pq.read_schema(segment.path)), segment.path
            )
            return
    raise AssertionError("no segment holds the seq")


def test_a_snapshot_of_chosen_streams_leaves_the_others(tmp_path: Path) -> None:
    records = [generate("s.a", 150, seed=3), generate("s.b", 90, seed=4)]
    write_spools(str(tmp_path / "spool"), records, relays=2, segment_records=50)
    store = str(tmp_path / "store")
    store_baseline.ingest_baseline(str(tmp_path / "spool"), store)
    made = store_baseline.snapshot_baseline(store, streams=("s.b",))
    assert set(made) == {"s.b"}
    reader = StoreReader(store)
    assert reader.snapshot("s.a") is None
    snap = reader.snapshot("s.b")
    assert snap is not None and snap.seq == records[1].seqs[-1]
