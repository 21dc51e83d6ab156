"""Consuming a pattern of streams on real relay processes: every stream the pattern names is
read in its own order, records tagged with their stream, streams that appear later
included; durable marks per stream; resuming from positions; the CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay import wire
from relay.access import pattern_matches
from relay.client import AsyncConsumer, Consumer, Metadata, Producer
from relay.engines import Record
from relay.errors import FieldError
from relay.launcher import Mesh, write_loopback_topology
from relay.meta import METADATA_STREAM, decode_mark

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
REFRESH_S = 0.1  # the tests' consumers look for new streams this often
LONG_S = 60.0  # a wait that only guards against a hang: reads end on counts


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    folder = tmp_path_factory.mktemp("patterns")
    config = write_loopback_topology(folder, {r: ["*"] for r in range(3)}, ["all.eu", "audit"])
    with Mesh(config, log_dir=folder / "logs", log_level="warning") as running:
        yield running


def produce(mesh: Mesh, stream: str, count: int, tag: str = "") -> list[int]:
    with Producer(topology=mesh.config) as producer:
        return sorted(producer.send_many(stream, [f"{tag}{i}".encode() for i in range(count)]))


def by_stream(records: list[Record]) -> dict[str, list[int]]:
    seqs: dict[str, list[int]] = defaultdict(list)
    for record in records:
        seqs[record.stream].append(record.seq)
    return dict(seqs)


def read(consumer: Consumer, count: int) -> list[Record]:
    records = []
    for record in consumer:
        records.append(record)
        if len(records) == count:
            break
    return records


def test_the_pattern_rule() -> None:
    assert pattern_matches("orders.*", "orders.eu")
    assert not pattern_matches("orders.*", "audit")
    assert pattern_matches("audit", "audit")  # an exact name matches itself
    # The mesh's own streams only for a pattern that names them.
    assert not pattern_matches("*", METADATA_STREAM)
    assert pattern_matches("_relay.*", METADATA_STREAM)


def test_streams_frames_survive_their_encoding_and_hostile_bytes() -> None:
    for msg in (wire.StreamsReq(7, "orders.*"), wire.StreamsResp(7, ("a", "orders.eu"))):
        assert wire.decode(wire.encode(msg), 1 << 20) == msg
    with pytest.raises(FieldError, match=r"StreamsResp\.streams"):
        wire.decode(wire.encode(wire.StreamsResp(1, ("a|b",))), 1 << 20)


def test_a_pattern_reads_every_stream_it_names_each_in_order(mesh: Mesh) -> None:
    eu = produce(mesh, "all.eu", 30, "eu")  # declared
    us = produce(mesh, "all.us", 20, "us")  # opened by its first produce (a pattern)
    produce(mesh, "audit", 10)
    with Consumer(
        topology=mesh.config, timeout_s=LONG_S, pattern_refresh_s=REFRESH_S, store=False
    ) as consumer:
        consumer.subscribe("all.*", "earliest")
        got = by_stream(read(consumer, 50))
        assert got == {"all.eu": eu, "all.us": us}
        assert sorted(consumer.streams) == ["all.eu", "all.us"]
        assert consumer.positions == {"all.eu": eu[-1], "all.us": us[-1]}
        # A stream that appears while the consumer reads is found and read from its start.
        asia = produce(mesh, "all.asia", 5, "asia")
        assert by_stream(read(consumer, 5)) == {"all.asia": asia}
        with pytest.raises(RuntimeError, match=r"Consumer\.positions"):
            _ = consumer.position


def test_latest_reads_what_commits_after_the_subscription_in_new_streams_too(mesh: Mesh) -> None:
    produce(mesh, "late.eu", 5, "old")
    with Consumer(
        topology=mesh.config, timeout_s=0.05, pattern_refresh_s=REFRESH_S, store=False
    ) as consumer:
        consumer.subscribe("late.*", "latest")
        # Drive the consumer until it found the stream and learnt its committed point.
        while consumer.positions.get("late.eu") is None:
            assert read(consumer, 1) == []
        eu = produce(mesh, "late.eu", 4, "new")
        fresh = produce(mesh, "late.new", 3, "new")
        records: list[Record] = []
        while len(records) < 7:  # timeout_s bounds each wait, not the whole read
            records += read(consumer, 7 - len(records))
        assert by_stream(records) == {"late.eu": eu, "late.new": fresh}


def test_positions_resume_a_pattern_with_no_gap(mesh: Mesh) -> None:
    whole = {"pos.eu": produce(mesh, "pos.eu", 10, "p"), "pos.us": produce(mesh, "pos.us", 10, "p")}
    with Consumer(topology=mesh.config, timeout_s=LONG_S, store=False) as first:
        first.subscribe("pos.*", "earliest")
        head = read(first, 13)
        positions = first.positions
    whole["pos.eu"] += produce(mesh, "pos.eu", 3, "q")
    whole["pos.new"] = produce(mesh, "pos.new", 2, "q")  # not in positions: from its start
    with Consumer(topology=mesh.config, timeout_s=LONG_S, count=12, store=False) as second:
        rest = list(second.subscribe("pos.*", positions))
    assert by_stream(head + rest) == whole  # each once, in order, none missing


def test_a_durable_pattern_keeps_a_mark_per_stream(mesh: Mesh) -> None:
    sent = {"dur.eu": produce(mesh, "dur.eu", 4, "d"), "dur.us": produce(mesh, "dur.us", 4, "d")}
    with Consumer(
        topology=mesh.config, durable="fanout", timeout_s=LONG_S, count=8, store=False
    ) as first:
        assert by_stream(list(first.subscribe("dur.*", "earliest"))) == sent
        assert first.commit() is None  # a pattern's positions are per stream
        positions = first.positions
    with Metadata(topology=mesh.config) as meta:
        marks = {v.key: decode_mark(v.value) for v in meta.list("consumers/fanout/")}
    assert {key: mark.seq for key, mark in marks.items()} == {
        f"consumers/fanout/{stream}": seq for stream, seq in positions.items()
    }
    assert all(mark.holder == "" for mark in marks.values())  # released at close
    newer = {"dur.eu": produce(mesh, "dur.eu", 2, "e"), "dur.us": produce(mesh, "dur.us", 3, "e")}
    with Consumer(
        topology=mesh.config, durable="fanout", timeout_s=LONG_S, count=5, store=False
    ) as again:
        assert by_stream(list(again.subscribe("dur.*", "earliest"))) == newer


def test_the_asyncio_consumer_reads_a_pattern_durably(mesh: Mesh) -> None:
    sent = {"asy.eu": produce(mesh, "asy.eu", 5, "a"), "asy.us": produce(mesh, "asy.us", 5, "a")}

    async def read_all(count: int) -> list[Record]:
        async with AsyncConsumer(
            topology=mesh.config, durable="async", count=count, timeout_s=LONG_S, store=False
        ) as consumer:
            consumer.subscribe("asy.*", "earliest")
            got = [record async for record in consumer]
            assert await consumer.commit() is None
            return got

    assert by_stream(asyncio.run(read_all(10))) == sent
    later = {"asy.us": produce(mesh, "asy.us", 2, "b")}
    assert by_stream(asyncio.run(read_all(2))) == later  # resumed after the marks


def test_what_a_pattern_cannot_do_is_refused_by_name(mesh: Mesh) -> None:
    with Consumer(topology=mesh.config, store=False) as consumer:
        with pytest.raises(ValueError, match=r"'orders\.\*' is a pattern"):
            consumer.subscribe("orders.*", "snapshot")
        with pytest.raises(TypeError, match="a start per stream"):
            consumer.subscribe("orders.eu", {"orders.eu": 5})
        with pytest.raises(ValueError, match="start must be"):
            consumer.subscribe("orders.*", {"orders.eu": "yesterday"})  # type: ignore[dict-item]
    with Producer(topology=mesh.config) as producer, pytest.raises(ValueError, match="pattern"):
        producer.send("orders.*", b"x")


def test_the_cli_consumes_a_pattern(mesh: Mesh) -> None:
    eu = produce(mesh, "cli.eu", 3, "c")
    us = produce(mesh, "cli.us", 3, "c")
    produce(mesh, "clix", 1)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "relay",
            "consume",
            "--config",
            str(mesh.config_path),
            "--stream",
            "cli.*",
            "--count",
            "6",
            "--timeout-s",
            str(LONG_S),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    got: dict[str, list[int]] = defaultdict(list)
    for line in lines:
        assert isinstance(line["seq"], str)  # seqs exceed 2**53: JSON carries them as text
        got[line["stream"]].append(int(line["seq"]))
    assert got == {"cli.eu": eu, "cli.us": us}
