"""The store on an object store (docs/store.md 8): every job, reader and the relays against
a local S3-compatible server (moto's server mode, tests/s3_server.py), with nothing of the
store on local disk."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

pytest.importorskip("moto")
pytest.importorskip("deltalake")
from relay.client import Consumer, Producer
from relay.launcher import Mesh, write_loopback_topology
from relay.segment import find_segments
from relay.store import maintain, tables
from relay.store.errors import ConcurrentCommit, StoreLocked
from relay.store.location import BadStoreLocation, StoreLocation, as_location
from relay.store.lock import LOCK_FILE, WriterLock, check
from relay.store.reader import StoreReader
from relay.storerun import StoreRunner, read_status
from relay.tools import store_baseline
from relay.tools.synthetic import StreamRecords, generate, write_spools
from relay.topology import StoreSettings, load
from s3_server import bucket_keys, moto_server, new_bucket
from store_topology import relay_with, spooling_topology
from waiting import wait_until

STREAMS = ("orders.eu", "a/b c")
RELAY_JOIN_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with moto_server(tmp_path_factory.mktemp("moto")) as url:
        yield url


@pytest.fixture
def store(endpoint: str) -> StoreLocation:
    """A store under a prefix of a fresh bucket."""
    options = {"endpoint_url": endpoint, "allow_http": True}
    return as_location(f"s3://{new_bucket(endpoint)}/relay/store", options)


def _streams(count: int = 400) -> list[StreamRecords]:
    return [generate(name, count, seed=i) for i, name in enumerate(STREAMS)]


def _kept(records: StreamRecords) -> list[int]:
    return [s for s, dup in zip(records.seqs, records.duplicates, strict=True) if not dup]


def _s3_section(store: StoreLocation) -> dict[str, Any]:
    """The topology's `store:` keys naming `store`."""
    return {"location": store.uri(), "s3": dict(store.options) | {"allow_http": True}}


# --- locations ------------------------------------------------------------------------------


def test_locations_parse_and_bad_ones_are_named(tmp_path: Path) -> None:
    local = as_location(tmp_path / "store")
    assert local.is_local and local.local_root == tmp_path / "store"
    assert as_location(f"file://{tmp_path}/store") == local
    s3 = as_location("s3://bucket/a/b/?endpoint_url=http://127.0.0.1:9&allow_http=true")
    assert (s3.root, s3.uri("streams/x")) == ("bucket/a/b", "s3://bucket/a/b/streams/x")
    assert s3.storage_options == {
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_ALLOW_HTTP": "true",
    }
    for text, problem in (
        ("gs://bucket/x", "unknown scheme 'gs'"),
        ("s3:///x", "names no bucket"),
        ("s3://bucket/x?secret=1", "unknown S3 option(s) secret"),
    ):
        with pytest.raises(BadStoreLocation, match=problem.replace("(", r"\(").replace(")", r"\)")):
            as_location(text)
    with pytest.raises(BadStoreLocation, match="takes no S3 options"):
        as_location(tmp_path, {"region": "eu-west-1"})


# --- jobs, readers, other tools -----------------------------------------------------------


def test_baseline_jobs_build_a_store_other_tools_read(store: StoreLocation, tmp_path: Path) -> None:
    import polars as pl
    import pyarrow.dataset as ds  # type: ignore[import-untyped]

    streams = _streams()
    spool = tmp_path / "spool"
    write_spools(str(spool), streams, segment_records=100)
    result = store_baseline.ingest_baseline(str(spool), store)
    assert result.records_added == sum(len(r) for r in streams)
    made = store_baseline.snapshot_baseline(store)
    assert {s: m.seq for s, m in made.items()} == {r.stream: r.seqs[-1] for r in streams}
    verified = store_baseline.verify_baseline(store)
    assert verified.points == {r.stream: (r.seqs[-1], r.digests[-1]) for r in streams}
    assert verified.snapshots_checked == len(streams)

    reader = StoreReader(store)
    for records in streams:
        assert [r.seq for r in reader.records_after(records.stream)] == _kept(records)
        # Polars through deltalake, and pyarrow over the file list the table gives.
        uri = store.uri(tables.records_table(records.stream))
        frame = pl.read_delta(uri, storage_options=store.storage_options)
        assert frame.height == len(records) and frame["seq"].max() == records.seqs[-1]
        files = tables.open_table(store, tables.records_table(records.stream)).file_uris()
        table = ds.dataset(
            [u.removeprefix("s3://") for u in files], filesystem=store.fs, format="parquet"
        ).to_table(columns=["seq"])
        assert sorted(table.column("seq").to_pylist()) == records.seqs
    keys = bucket_keys(*_endpoint_and_bucket(store))
    assert any(k.endswith("/_delta_log/00000000000000000000.json") for k in keys)
    # (pyarrow keeps an emptied folder as an empty "folder/" marker object)
    assert not [k for k in keys if "/_staging/" in k and not k.endswith("/")]


def _endpoint_and_bucket(store: StoreLocation) -> tuple[str, str]:
    return dict(store.options)["endpoint_url"], store.bucket_and_key[0]


def test_spark_jobs_on_the_object_store(spark: Any, store: StoreLocation, tmp_path: Path) -> None:
    """Spark's tasks read the spools and write through pyarrow's S3 filesystem; the driver
    commits through delta-rs; verify reads it all back through the same filesystem."""
    from relay.store.ingest import ingest
    from relay.store.snapshot import snapshot
    from relay.store.verify import verify

    streams = _streams(300)
    spool = tmp_path / "spool"
    write_spools(str(spool), [r.slice(0, 200) for r in streams], segment_records=60)
    assert ingest(spark, str(spool), store).records_added == 2 * 200
    snapshot(spark, store)
    write_spools(str(spool), streams, segment_records=60)
    assert ingest(spark, str(spool), store).records_added == 2 * 100
    made = snapshot(spark, store)  # incremental: on the first snapshot
    assert {s: m.seq for s, m in made.items()} == {r.stream: r.seqs[-1] for r in streams}
    verified = verify(spark, store)
    assert verified.points == {r.stream: (r.seqs[-1], r.digests[-1]) for r in streams}
    assert verified.snapshots_checked == 2 * len(streams)
    # The same store as the baseline builds on local disk.
    local = tmp_path / "local"
    store_baseline.ingest_baseline(str(spool), local)
    store_baseline.snapshot_baseline(local)
    for records in streams:
        ours, theirs = StoreReader(store), StoreReader(local)
        assert list(ours.records_after(records.stream)) == list(
            theirs.records_after(records.stream)
        )
        mine, other = ours.snapshot(records.stream), theirs.snapshot(records.stream)
        assert mine is not None and other is not None
        order = [("entity", "ascending"), ("key", "ascending")]
        assert mine.rows.sort_by(order).to_pylist() == other.rows.sort_by(order).to_pylist()


def test_two_commits_of_one_version_never_both_succeed(
    store: StoreLocation, tmp_path: Path
) -> None:
    """What keeps the tables right on S3 whatever the lock: delta-rs writes each version's
    log entry with put-if-absent, so a second writer from the same version is refused."""
    records = generate("race", 200, seed=4)
    spool = tmp_path / "spool"
    write_spools(str(spool), [records.slice(0, 100)], segment_records=50)
    store_baseline.ingest_baseline(str(spool), store)
    state = tables.load_stream(store, "race")
    write_spools(str(spool), [records], segment_records=50)
    store_baseline.ingest_baseline(str(spool), store)  # another writer moves the table on
    run, staging = tables.new_run(store)
    staged = f"{staging}/late.parquet"
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    from relay.store.chaincheck import RECORD_SCHEMA

    pq.write_table(RECORD_SCHEMA.empty_table(), store.path(staged), filesystem=store.fs)
    late = [tables.StagedFile(staged, 0, records.seqs[150], records.seqs[160])]
    metadata = tables.position_metadata("ingest", run, late, records.digests[160], 0, 0)
    with pytest.raises(ConcurrentCommit, match="another writer committed since version"):
        tables.commit_records(store, "race", state, late, staging, metadata)
    assert [r.seq for r in StoreReader(store).records_after("race")] == _kept(records)


# --- the writer lock ----------------------------------------------------------------------


def test_the_lease_lock_names_its_holder_and_ends_with_it(store: StoreLocation) -> None:
    with WriterLock(store, "an ingest"):
        with (
            pytest.raises(StoreLocked, match="an ingest") as refused,
            WriterLock(store, "a snapshot"),
        ):
            pass
        assert "pid" in refused.value.holder
    with WriterLock(store, "a snapshot"):  # released: free again
        pass
    # A holder that died leaves a lease that ends: the next job takes it over.
    client = store.boto3_client()
    bucket, prefix = store.bucket_and_key
    dead = {"holder": "a job that died", "until": time.time() - 1}
    client.put_object(Bucket=bucket, Key=f"{prefix}/{LOCK_FILE}", Body=json.dumps(dead).encode())
    with WriterLock(store, "the next ingest", lease_s=30, renew_s=0.2):
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{LOCK_FILE}")["Body"].read()
        assert "the next ingest" in json.loads(body)["holder"]
        check(store)  # held: commits go on
        # Another job took the lease over (say its clock ran far ahead): the holder finds
        # out at its next renewal and commits nothing more.
        other = {"holder": "a job with a fast clock", "until": time.time() + 600}
        client.put_object(Bucket=bucket, Key=f"{prefix}/{LOCK_FILE}", Body=json.dumps(other))

        def lost() -> bool:
            try:
                check(store)
            except StoreLocked as error:
                return "a job with a fast clock" in str(error)
            return False

        wait_until(lost, "the holder noticing it lost the lease")
    body = client.get_object(Bucket=bucket, Key=f"{prefix}/{LOCK_FILE}")["Body"].read()
    assert json.loads(body)["holder"] == "a job with a fast clock"  # not ours: left alone


# --- keeping the store, the runner, the commands ----------------------------------------


def test_the_runner_keeps_an_object_store(store: StoreLocation, tmp_path: Path) -> None:
    """Ingest, snapshot, retention, compaction and vacuum on S3, with the runner's status
    in the store."""
    records = generate("kept", 600, seed=3)
    spool = tmp_path / "spool"
    settings = StoreSettings(compact_below_bytes=1 << 20, keep_snapshots=2)
    now_s = [0.0]
    engine = store_baseline.BaselineEngine()
    runner = StoreRunner(settings, spool, store, engine, clock=lambda: now_s[0])
    for stop in (200, 400, 600):
        write_spools(str(spool), [records.slice(0, stop)], segment_records=50)
        done = {f.job: f for f in runner.step()}
        assert all(f.ok for f in done.values()) and len(done) == 4, done
        now_s[0] += 86_400  # every job due again
    state = tables.load_stream(store, "kept")
    # Compacted, but never across a kept snapshot's seq (the first was retired).
    assert state.snapshot_seqs == [records.seqs[399], records.seqs[-1]]
    assert [f.last_seq for f in state.files] == [records.seqs[399], records.seqs[-1]]
    retired = maintain.retire(store, records.seqs[399], keep_snapshots=2)
    assert retired.retained_after == {"kept": records.seqs[399]}
    assert maintain.vacuum(store, retention_hours=0).files_removed > 0
    assert [r.seq for r in StoreReader(store).records_after("kept", records.seqs[399])] == [
        s for s in _kept(records) if s > records.seqs[399]
    ]
    store_baseline.verify_baseline(store)
    status = read_status(store)
    assert status is not None and status["streams"]["kept"]["last_seq"] == str(records.seqs[-1])


def test_relay_store_commands_on_an_object_store(store: StoreLocation, tmp_path: Path) -> None:
    """`relay store run --once`, `relay store verify` and `relay status` with a topology
    whose store is an s3:// location (credentials from the environment)."""
    topology = spooling_topology(tmp_path, _s3_section(store))
    records = generate("s.obj", 300, seed=9)
    write_spools(str(tmp_path / "data" / "spool"), [records], segment_records=100)

    done = relay_with(topology, "store", "run", "--once", "--engine", "baseline")
    assert done.returncode == 0, done.stderr[-3000:]
    done = relay_with(topology, "store", "verify")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"verified s.obj: chain intact to seq {records.seqs[-1]}" in done.stdout
    # No relay runs: the mesh is down (exit 2), and the store is shown all the same.
    status = relay_with(topology, "status", "--json", "--timeout", "0.2")
    assert status.returncode == 2, status.stderr[-3000:]
    shown = json.loads(status.stdout)["store"]
    assert shown["location"] == store.uri()
    assert shown["runner"]["streams"]["s.obj"]["last_seq"] == str(records.seqs[-1])
    assert not (tmp_path / "data" / "store").exists()


# --- the relays ----------------------------------------------------------------------------


def test_relays_restart_from_an_object_store(store: StoreLocation, tmp_path: Path) -> None:
    """A mesh whose topology names an S3 store: restarted with empty buffers it carries on
    from the store's last point, its consumers read the stored history from S3, and its
    relays reclaim the spooled segments the store holds."""
    stream = "s3.orders"
    spool = {"enabled": True, "segment_max_age_ms": 300}
    path = write_loopback_topology(
        tmp_path / "mesh", {1: [stream], 2: [stream], 3: [stream]}, spool=spool
    )
    document = yaml.safe_load(path.read_text())
    document["store"] = _s3_section(store)
    path.write_text(yaml.safe_dump(document))
    config = load(path)
    assert config.store_location == store
    history = generate(stream, 150, seed=11)
    write_spools(str(tmp_path / "history-spool"), [history], segment_records=50)
    store_baseline.ingest_baseline(str(tmp_path / "history-spool"), store)
    with Mesh(path):
        with Producer(topology=config, send_timeout_s=RELAY_JOIN_TIMEOUT_S) as producer:
            seqs = [producer.send(stream, b"new %d" % i) for i in range(20)]
        assert seqs[0] > history.seqs[-1]
        with Consumer(topology=config, count=len(_kept(history)) + len(seqs)) as consumer:
            got = [r.seq for r in consumer.subscribe(stream, "earliest")]
        assert got == _kept(history) + seqs
        assert consumer.stats["stored_records"] == len(_kept(history))
        # What the relays spooled goes to the store; then each relay removes its copies.

        def spooled_to_the_end() -> bool:
            ends: dict[int, int] = {}
            for segment in find_segments(config.spool_dir):
                ends[segment.relay] = max(ends.get(segment.relay, -1), segment.last_seq)
            return len(ends) == 3 and min(ends.values()) >= seqs[-1]

        wait_until(spooled_to_the_end, "every relay's spool closed past the new records")
        assert store_baseline.ingest_baseline(str(config.spool_dir), store).records_added == 20
        wait_until(
            lambda: not find_segments(config.spool_dir),
            "the relays reclaiming the segments the S3 store holds",
        )
