"""Metadata and durable consumers on real relay processes (docs/metadata.md): versioned
compare-and-set from several processes checked for linearizability, durable consumers
that resume after a kill -9 with no gap, and leases that never let two instances read."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from relay import wire
from relay.client import Consumer, Metadata, Producer
from relay.core.digest import chain, genesis, tx_hash
from relay.core.messages import Outcome, Transaction
from relay.core.seq import EPOCH_MS, ms_of
from relay.errors import BadVersion, Busy, LeaseLost, Rejected
from relay.launcher import Mesh, write_loopback_topology
from relay.meta import (
    ABSENT,
    ANY_VERSION,
    KIND_META,
    METADATA_STREAM,
    OP_WRITE,
    MetaOp,
    decode_mark,
    encode_op,
    mark_key,
)
from relay.metasync import fold_durable_history
from relay.segment import segment_name, segment_table, stream_dir_name, write_segment_file
from relay.tools.metacheck import cas_worker, check_linearizable
from relay.topology import MeshConfig
from waiting import wait_until

STREAM = "orders"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    folder = tmp_path_factory.mktemp("meta")
    config = write_loopback_topology(folder, {r: [STREAM, "orders.*"] for r in range(3)}, [STREAM])
    with Mesh(config, log_dir=folder / "logs", log_level="warning") as running:
        yield running


def config_of(mesh: Mesh) -> MeshConfig:
    return mesh.config


def test_compare_and_set_through_the_mesh(mesh: Mesh) -> None:
    with Metadata(topology=config_of(mesh)) as meta:
        first = meta.write("jobs/a", b"1", ABSENT)
        assert meta.read("jobs/a") == meta.read("jobs/a", linearizable=True)
        found = meta.read("jobs/a")
        assert found is not None and (found.version, found.value) == (first, b"1")
        with pytest.raises(BadVersion) as stale:
            meta.write("jobs/a", b"2", ABSENT)
        assert stale.value.current_version == first and not stale.value.retriable
        second = meta.write("jobs/a", b"2", first)
        assert second > first
        meta.write("jobs/b", b"3", ANY_VERSION)
        assert [v.key for v in meta.list("jobs/")] == ["jobs/a", "jobs/b"]
        with pytest.raises(BadVersion):
            meta.delete("jobs/a", first)
        meta.delete("jobs/a", second)
        assert meta.read("jobs/a") is None
        with pytest.raises(BadVersion, match="does not exist") as gone:
            meta.delete("jobs/a", second)
        assert gone.value.current_version == ABSENT


def test_the_metadata_stream_takes_only_metadata_operations(mesh: Mesh) -> None:
    with Producer(topology=config_of(mesh)) as producer:
        with pytest.raises(Rejected, match="metadata stream takes kind 2"):
            producer.send(METADATA_STREAM, b"not an operation")
        with pytest.raises(Rejected, match="invalid: not msgpack"):
            producer.send(METADATA_STREAM, b"\xc1", kind=2)


# --- linearizability of compare-and-set from several processes ---------------------------


PROCESSES = 3
script = st.lists(
    st.tuples(st.sampled_from(("write", "write", "delete", "read")), st.integers(0, 1)),
    min_size=8,
    max_size=25,
)


@settings(max_examples=4, deadline=None, database=None)
@given(st.lists(script, min_size=PROCESSES, max_size=PROCESSES))
def test_concurrent_compare_and_set_is_linearizable(mesh: Mesh, scripts: list[Any]) -> None:
    keys = [f"cas/{os.urandom(4).hex()}/{i}" for i in range(2)]  # fresh keys per example
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(scripts), mp_context=spawn) as pool:
        runs = [pool.submit(cas_worker, str(mesh.config_path), keys, s) for s in scripts]
        histories = [run.result(timeout=300) for run in runs]
    assert check_linearizable(histories) == sum(len(s) for s in scripts)


# --- durable consumers ------------------------------------------------------------------------


def _consume_durable(topology: str, name: str, out: str, ttl_s: float) -> None:
    """A durable consumer that commits after every record it appends to `out`."""
    with (
        open(out, "a") as log,
        Consumer(
            topology=topology,
            durable=name,
            auto_commit_interval_s=0,
            lease_ttl_s=ttl_s,
            lease_wait_s=None,
        ) as consumer,
    ):
        Path(f"{out}.started").touch()  # about to subscribe (and wait for the lease)
        consumer.subscribe(STREAM, "earliest")
        for record in consumer:
            log.write(f"{record.seq} {time.monotonic()} {consumer.endpoint}\n")
            log.flush()


def consumer_process(mesh: Mesh, name: str, out: Path, ttl_s: float) -> subprocess.Popen[bytes]:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_metadata as t; "
        "t._consume_durable(*sys.argv[2:5], float(sys.argv[5]))"
    )
    args = [str(ROOT / "tests"), str(mesh.config_path), name, str(out), str(ttl_s)]
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT)


def lines(path: Path) -> list[tuple[int, float, str]]:
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        seq, at, endpoint = line.split()
        found.append((int(seq), float(at), endpoint))
    return found


def test_a_durable_consumer_killed_mid_stream_resumes_elsewhere_with_no_gap(
    mesh: Mesh, tmp_path: Path
) -> None:
    config = config_of(mesh)
    with Producer(topology=config) as producer:
        sent = sorted(producer.send_many(STREAM, [b"%d" % i for i in range(300)]))
    first_out, second_out = tmp_path / "first.txt", tmp_path / "second.txt"
    first = consumer_process(mesh, "killed", first_out, 1.0)
    try:
        wait_until(lambda: len(lines(first_out)) >= 50, "the first instance to read 50")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
        read_first = [seq for seq, _, _ in lines(first_out)]
        endpoint = lines(first_out)[-1][2]
        relay_id = next(r for r, e in mesh.endpoints.items() if e.client == endpoint)
        mesh.kill(relay_id)  # and the relay it read from goes too
        second = consumer_process(mesh, "killed", second_out, 1.0)
        try:
            wait_until(
                lambda: sent[-1] in {seq for seq, _, _ in lines(second_out)},
                "the second instance to read to the end",
                timeout_s=120,
            )
        finally:
            second.kill()
            second.wait(30)
    finally:
        first.kill()
        first.wait(30)
        mesh.restart(relay_id, 60)
    read_second = [seq for seq, _, _ in lines(second_out)]
    # at least once and no gap: the second starts at or before the record after the
    # first's last, and between them they read everything
    assert sent.index(read_second[0]) <= sent.index(read_first[-1]) + 1
    assert sorted(set(read_first) | set(read_second)) == sent
    assert read_second == sorted(read_second)
    assert all(endpoint != e for _, _, e in lines(second_out))


def test_two_instances_never_read_at_once(mesh: Mesh, tmp_path: Path) -> None:
    config = config_of(mesh)
    key = mark_key("solo", STREAM)
    out = tmp_path / "waiting.txt"
    waiting: subprocess.Popen[bytes] | None = None
    with Producer(topology=config) as producer, Metadata(topology=config) as observer:
        producer.send_many(STREAM, [b"x"] * 5)
        try:
            with Consumer(topology=config, durable="solo", lease_ttl_s=1.0, timeout_s=30) as holder:
                holder.subscribe(STREAM, "earliest")
                next(holder)
                found = observer.read(key, linearizable=True)
                assert found is not None
                holding = decode_mark(found.value).holder
                second = Consumer(topology=config, durable="solo")
                with second, pytest.raises(Busy) as busy:
                    second.subscribe(STREAM)
                assert busy.value.holder == holding != ""
                waiting = consumer_process(mesh, "solo", out, 1.0)
                wait_until(lambda: Path(f"{out}.started").exists(), "the second instance to wait")
                versions: list[int] = []

                def renewed_past_two_ttls() -> bool:
                    # The holder reads on, renewing every third of its TTL: seven renewals
                    # span more than twice the TTL the waiting instance must see unrenewed.
                    producer.send(STREAM, b"more")
                    next(holder)
                    now = observer.read(key, linearizable=True)
                    assert now is not None and decode_mark(now.value).holder == holding
                    if not versions or versions[-1] != now.version:
                        versions.append(now.version)
                    return len(versions) > 7

                wait_until(renewed_past_two_ttls, "the holder to renew its lease 7 times")
                assert not lines(out)  # the waiting instance got nothing meanwhile
                holder.commit()
                done_at = time.monotonic()
            # leaving the block released the lease: the waiting instance takes it at once
            wait_until(lambda: lines(out), "the waiting instance to take over")
            assert lines(out)[0][1] > done_at
        finally:
            if waiting is not None:
                waiting.kill()
                waiting.wait(30)
    # an instance that was taken over from cannot commit any more
    with Consumer(topology=config, durable="taken", lease_ttl_s=0.5, timeout_s=30) as old:
        old.subscribe(STREAM, "earliest")
        next(old)
        with Consumer(topology=config, durable="taken", lease_ttl_s=0.5, lease_wait_s=None) as new:
            new.subscribe(STREAM)  # takes over once the old one's lease ran out unrenewed
            with pytest.raises(LeaseLost, match="another instance took over"):
                old.commit()


def test_marks_survive_a_minority_of_relays_killed(mesh: Mesh) -> None:
    config = config_of(mesh)
    with Producer(topology=config) as producer:
        producer.send_many(STREAM, [b"y"] * 10)
    with Consumer(topology=config, durable="sturdy", timeout_s=30) as consumer:
        consumer.subscribe(STREAM, "earliest")
        for _ in range(5):
            next(consumer)
        position = consumer.commit()
    mesh.kill(0)
    try:
        with Metadata(topology=config) as meta:
            found = meta.read(mark_key("sturdy", STREAM), linearizable=True)
            assert found is not None
            mark = decode_mark(found.value)
            assert (mark.seq, mark.holder) == (position, "")  # stored, and released
        mesh.restart(0, 60)
        # The restarted relay joined above the genesis: it copies a peer's fold, and then
        # answers like the others.
        wait_until(
            lambda: ((mesh.status(0) or {}).get("metadata") or {}).get("complete"),
            lambda: f"relay 0's metadata view to be complete: {mesh.status(0)}",
        )
        synced = (mesh.status(0) or {})["metadata"]
        assert synced["sync"]["installed"] == 1 and synced["gap"] == ""
        with Metadata(relays=[mesh.endpoints[0].client], timeout_s=30) as restarted_only:
            found = restarted_only.read(mark_key("sturdy", STREAM))
            assert found is not None and decode_mark(found.value).seq == position
            restarted_only.write("after/restart", b"1", ANY_VERSION)  # its own outcome: known
        with Consumer(topology=config, durable="sturdy", timeout_s=30) as again:
            again.subscribe(STREAM, "earliest")
            assert again.position == position
    finally:
        if not mesh.alive(0):
            mesh.restart(0, 60)


def test_the_cli_keeps_a_durable_position(mesh: Mesh) -> None:
    # A stream of its own: the records of the other tests on this module's mesh would
    # decide where its reads end (a position moves on through a gap with no record).
    stream = "orders.cli"
    config = config_of(mesh)
    with Producer(topology=config) as producer:
        sent = sorted(producer.send_many(stream, [b"z%d" % i for i in range(6)]))

    def relay(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "relay", *args, "--config", str(mesh.config_path)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )

    first = relay("consume", "--stream", stream, "--durable", "cli", "--count", "3")
    assert first.returncode == 0, first.stderr
    printed = [int(json.loads(line)["seq"]) for line in first.stdout.splitlines()]
    second = relay("consume", "--stream", stream, "--durable", "cli", "--count", "2")
    assert second.returncode == 0, second.stderr
    after = [int(json.loads(line)["seq"]) for line in second.stdout.splitlines()]
    assert printed + after == sent[:5]
    shown = relay("consumers", "show", "cli")
    assert shown.returncode == 0, shown.stderr
    mark = json.loads(shown.stdout)
    assert (mark["durable"], mark["stream"], mark["seq"]) == ("cli", stream, str(after[-1]))
    assert mark["holder"] is None and int(mark["committed"]) >= sent[-1]
    reset = relay("consumers", "reset", "cli", "--stream", stream, "--to", str(printed[0]))
    assert reset.returncode == 0, reset.stderr
    again = relay("consume", "--stream", stream, "--durable", "cli", "--count", "1")
    assert [int(json.loads(line)["seq"]) for line in again.stdout.splitlines()] == [printed[1]]
    listed = relay("consumers", "list")
    assert any(json.loads(line)["durable"] == "cli" for line in listed.stdout.splitlines())
    assert relay("consumers", "delete", "cli").returncode == 0
    missing = relay("consumers", "show", "cli")
    assert missing.returncode == 1 and "no durable consumer 'cli'" in missing.stderr
    bad = relay("consume", "--stream", stream, "--durable", "no/slash", "--count", "1")
    assert bad.returncode == 2 and "durable consumer's name" in bad.stderr


def write_marks_then_stop(config_path: Path, log_dir: Path) -> tuple[int | None, int]:
    """On a mesh of `config_path`: 20 records, a durable consumer "keeper" that committed
    after 7 of them, and the key settings/limit; then the mesh stops (SIGTERM: every relay
    writes its open spool segments). The position committed and the key's version."""
    with Mesh(config_path, log_dir=log_dir, log_level="warning") as first:
        config = first.config
        with Producer(topology=config) as producer:
            producer.send_many(STREAM, [b"w%d" % i for i in range(20)])
        with Consumer(topology=config, durable="keeper", timeout_s=30) as consumer:
            consumer.subscribe(STREAM, "earliest")
            for _ in range(7):
                next(consumer)
            position = consumer.commit()
        with Metadata(topology=config) as meta:
            version = meta.write("settings/limit", b"10", ABSENT)
    return position, version


def check_marks_after_restart(
    config_path: Path, log_dir: Path, position: int | None, version: int, read_on: bool
) -> list[dict[str, int]]:
    """Restart the mesh: every relay's metadata view completes, every relay answers the
    key, and "keeper" resumes at its position (and, with `read_on`, reads the record
    after it: the relays restart empty, so that needs a store). Each relay's sync
    counters."""
    with Mesh(config_path, log_dir=log_dir, log_level="warning") as second:
        wait_until(
            lambda: all(
                ((second.status(r) or {}).get("metadata") or {}).get("complete") for r in range(3)
            ),
            lambda: f"every relay's metadata view complete: {second.statuses()}",
        )
        for relay_id in range(3):
            only = Metadata(relays=[second.endpoints[relay_id].client], timeout_s=30)
            with only:
                setting = only.read("settings/limit")
                assert setting is not None and (setting.version, setting.value) == (version, b"10")
        with Consumer(topology=second.config, durable="keeper", timeout_s=30) as again:
            again.subscribe(STREAM, "earliest")
            assert again.position == position
            if read_on:
                assert position is not None and next(again).seq > position
        return [(second.status(r) or {})["metadata"]["sync"] for r in range(3)]


def test_marks_survive_a_restart_of_the_whole_mesh_with_spool(tmp_path: Path) -> None:
    """Every relay restarts empty: each folds the metadata stream's spooled history, the
    one whose spool reaches the point the mesh carries on from installs it, and the
    others copy it from that one."""
    config_path = write_loopback_topology(
        tmp_path, {r: [STREAM] for r in range(3)}, [STREAM], spool={"enabled": True}
    )
    position, version = write_marks_then_stop(config_path, tmp_path / "logs")
    synced = check_marks_after_restart(config_path, tmp_path / "logs2", position, version, False)
    assert sum(s["installed_from_history"] + s["installed"] for s in synced) == 3


def test_marks_survive_a_whole_mesh_restart_through_the_store(tmp_path: Path, spark: Any) -> None:
    """The metadata stream is stored like any other: once its spools were ingested and are
    gone, a mesh restarted from nothing but the store folds the marks back."""
    from relay.store.ingest import ingest

    config_path = write_loopback_topology(
        tmp_path, {r: [STREAM] for r in range(3)}, [STREAM], spool={"enabled": True}
    )
    position, version = write_marks_then_stop(config_path, tmp_path / "logs")
    config = Mesh(config_path).config
    ingested = ingest(spark, str(config.spool_dir), config.store_location)
    assert not ingested.problems and METADATA_STREAM in ingested.streams, ingested
    shutil.rmtree(config.spool_dir)  # as relays reclaim what the store holds
    synced = check_marks_after_restart(config_path, tmp_path / "logs2", position, version, True)
    assert sum(s["installed_from_history"] for s in synced) >= 1, synced


def write_meta_spool(spool: Path, ops: list[MetaOp], skip: int | None = None) -> list[int]:
    """Relay 0's spool of the metadata stream holding `ops` with a correct chain (the
    record at index `skip` is left out, leaving a gap); their seqs."""
    folder = spool / "relay=0" / stream_dir_name(METADATA_STREAM)
    folder.mkdir(parents=True)
    digest, seq = genesis(METADATA_STREAM), 1 << 40
    rows: list[tuple[int, bytes, bytes]] = []
    for index, op in enumerate(ops):
        seq += 3
        value = encode_op(op)
        digest = chain(digest, seq, tx_hash(Transaction(b"p", index, None, value, KIND_META)))
        if index != skip:
            rows.append((seq, digest, value))
    count = len(rows)
    table = segment_table(
        METADATA_STREAM,
        0,
        [r[0] for r in rows],
        [r[1] for r in rows],
        [b"p"] * count,
        [i for i in range(len(ops)) if i != skip],
        [None] * count,
        [r[2] for r in rows],
        [KIND_META] * count,
        [False] * count,
    )
    write_segment_file(table, folder / segment_name(rows[0][0], rows[-1][0]))
    return [r[0] for r in rows]


def test_durable_history_folds_up_to_a_gap(tmp_path: Path) -> None:
    ops = [MetaOp(OP_WRITE, f"k{i % 3}", ANY_VERSION, b"%d" % i) for i in range(10)]
    seqs = write_meta_spool(tmp_path / "whole", ops)
    fold = fold_durable_history(tmp_path / "store", tmp_path / "whole", 0)
    assert fold is not None and fold.as_of == seqs[-1]
    assert {v.key: v.value for v in fold.items} == {"k0": b"9", "k1": b"7", "k2": b"8"}
    seqs = write_meta_spool(tmp_path / "gap", ops, skip=6)
    fold = fold_durable_history(tmp_path / "store", tmp_path / "gap", 0)
    assert fold is not None and fold.as_of == seqs[5]  # the chain breaks after index 5
    assert {v.key: v.value for v in fold.items} == {"k0": b"3", "k1": b"4", "k2": b"5"}
    assert fold_durable_history(tmp_path / "store", tmp_path / "none", 0) is None


def test_a_consumer_starts_at_a_time(mesh: Mesh) -> None:
    config = config_of(mesh)
    stream = "orders.since"
    with Producer(topology=config) as producer:
        before = sorted(producer.send_many(stream, [b"old"] * 5))
        wait_until(lambda: time.time() * 1000 > ms_of(before[-1]) + EPOCH_MS + 2, "a new ms")
        moment = datetime.now(UTC)
        after = sorted(producer.send_many(stream, [b"new"] * 5))
    with Consumer(topology=config, timeout_s=5) as consumer:
        consumer.subscribe(stream, moment)
        assert [record.seq for record in consumer] == after
    with pytest.raises(ValueError, match="no timezone"):
        Consumer(topology=config).subscribe(stream, datetime.now())

    def consume(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                *(sys.executable, "-m", "relay", "consume", "--config", str(mesh.config_path)),
                *("--stream", stream, "--timeout-s", "2", *args),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )

    since = consume("--since", moment.isoformat())
    assert [int(json.loads(line)["seq"]) for line in since.stdout.splitlines()] == after
    everything = consume("--since", "1d")
    assert [
        int(json.loads(line)["seq"]) for line in everything.stdout.splitlines()
    ] == before + after
    both = consume("--since", "1m", "--from", "earliest")
    assert both.returncode == 2 and "--from or --since" in both.stderr
    bad = consume("--since", "yesterday")
    assert bad.returncode == 2 and "neither a duration" in bad.stderr


def test_a_pattern_is_not_a_produce_target(mesh: Mesh) -> None:
    producer = Producer(topology=config_of(mesh))
    with producer, pytest.raises(ValueError, match="is a pattern"):
        producer.send("orders.*", b"x")
    # A client that sends one anyway (not this library) is refused by the relay.
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(mesh.endpoints[0].client)
        sock.send(wire.encode(wire.ProduceReq(1, "orders.*", b"raw", 0, None, b"x")))
        assert sock.poll(30_000), "no answer to a produce to a pattern"
        answer = wire.decode(sock.recv(), 1 << 20)
        assert isinstance(answer, wire.ProduceResp) and answer.outcome is Outcome.REJECTED
        assert answer.reason.startswith("invalid: 'orders.*' is a pattern")
    finally:
        ctx.destroy(linger=0)


def test_earliest_reads_the_oldest_history_any_relay_holds(tmp_path: Path) -> None:
    """A relay restarted empty holds only what committed since: read from the beginning,
    a consumer that asks it first goes on to a relay that holds more; asked alone, it says
    the history before its base is gone instead of starting later in silence."""
    config_path = write_loopback_topology(tmp_path, {r: [STREAM] for r in range(3)}, [STREAM])
    with Mesh(config_path, log_dir=tmp_path / "logs", log_level="warning") as mesh:
        with Producer(topology=mesh.config) as producer:
            early = sorted(producer.send_many(STREAM, [b"e"] * 20))
            mesh.kill(0)
            mesh.restart(0, 60)
            late = sorted(producer.send_many(STREAM, [b"l"] * 10))
        endpoints = [mesh.endpoints[r].client for r in (0, 1, 2)]
        consumer = Consumer(relays=endpoints, timeout_s=5, store=False)
        with consumer.subscribe(STREAM, "earliest"):
            assert [r.seq for r in consumer] == early + late
            assert consumer.history_gone_before is None
        alone = Consumer(relays=endpoints[:1], timeout_s=5, store=False)
        with alone.subscribe(STREAM, "earliest"):
            read = [r.seq for r in alone]
            gone = alone.history_gone_before
        assert gone is not None and gone >= early[-1] and read == [s for s in late if s > gone]
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "relay",
                "consume",
                "--config",
                str(config_path),
                "--stream",
                STREAM,
                "--relay",
                "0",
                "--timeout-s",
                "2",
                "--no-store",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert cli.returncode == 0, cli.stderr
        assert len(cli.stdout.splitlines()) == len(early + late)  # --relay 0 is only first
