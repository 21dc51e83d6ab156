"""Relays spool their committed history, and a mesh restarted without history carries on
from it: real relay nodes (in this process) and the store built without Spark."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

from relay.client import AsyncProducer
from relay.core import digest as dg
from relay.core.messages import Transaction
from relay.errors import StoreBacklogFull, Unknown
from relay.launcher import write_loopback_topology
from relay.node import RelayNode
from relay.segment import find_segments, to_unsigned64
from relay.spool import last_spooled_points
from relay.store.reader import StoreReader
from relay.tools.store_baseline import ingest_baseline, verify_baseline
from relay.topology import MeshConfig, load
from waiting import wait_until_async

pytestmark = pytest.mark.timeout(120)

STREAM = "orders"
RELAYS = (0, 1, 2)
JOIN_TIMEOUT_S = 10.0
MAX_FILL_WRITES = 2_000  # far more than the spools' budget holds


def spooling_config(tmp_path: Path) -> MeshConfig:
    path = write_loopback_topology(
        tmp_path,
        {r: [STREAM] for r in RELAYS},
        limits={"max_tx_bytes": 4096},
        spool={"enabled": True, "segment_max_age_ms": 200},
    )
    return load(path)


async def run_mesh(config: MeshConfig, values: list[bytes]) -> tuple[list[int], list[RelayNode]]:
    """Start every relay, produce `values` to STREAM, stop every relay (which closes the
    spools); returns the committed seqs and the stopped nodes."""
    nodes = [RelayNode(config, r, handle_signals=False) for r in RELAYS]
    tasks = [asyncio.create_task(node.run()) for node in nodes]
    try:
        async with AsyncProducer(topology=config, send_timeout_s=JOIN_TIMEOUT_S) as producer:
            seqs = await producer.send_many(STREAM, values)
        # Rotation by age, while the relays run: every relay writes what it committed once
        # its segment is older than segment_max_age_ms (closing would write it anyway).
        await wait_until_async(
            lambda: all(spooled_records(node) >= len(values) for node in nodes),
            lambda: (
                f"every relay to spool {len(values)} records by age: "
                f"{[spooled_records(node) for node in nodes]}"
            ),
            poll_s=0.02,
        )
    finally:
        for node in nodes:
            node.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return seqs, nodes


def spooled_records(node: RelayNode) -> int:
    """How many records the relay's spool has written to segments."""
    spool = node.status()["spool"]
    assert isinstance(spool, dict), spool
    return int(spool["records_written"])


def spooled(config: MeshConfig, relay: int) -> list[tuple[int, bytes, Transaction]]:
    """(seq, digest, transaction) of every record in `relay`'s spool, in seq order."""
    columns = ["seq", "digest", "producer_id", "producer_seq", "key", "value", "kind"]
    rows = []
    for segment in find_segments(config.spool_dir):
        if segment.relay == relay:
            table = pq.read_table(segment.path, columns=columns)
            for seq, digest, pid, pseq, key, value, kind in zip(
                *(table.column(c).to_pylist() for c in columns), strict=True
            ):
                rows.append((seq, digest, Transaction(pid, to_unsigned64(pseq), key, value, kind)))
    return sorted(rows, key=lambda row: row[0])


def test_relays_spool_and_carry_on_from_their_history(tmp_path: Path) -> None:
    config = spooling_config(tmp_path)
    first, _ = asyncio.run(run_mesh(config, [b"a%d" % i for i in range(40)]))

    # Every relay spooled the committed prefix, each record with the chain digest after it.
    for relay in RELAYS:
        rows = spooled(config, relay)
        assert [seq for seq, _, _ in rows] == sorted(first)
        digest = dg.genesis(STREAM)
        for seq, after, tx in rows:
            digest = dg.chain(digest, seq, dg.tx_hash(tx))
            assert after == digest
        assert last_spooled_points(config.spool_dir, relay) == {STREAM: (rows[-1][0], digest)}

    # Restarted with empty buffers: the relays carry on from their spools' last point.
    second, nodes = asyncio.run(run_mesh(config, [b"b%d" % i for i in range(25)]))
    assert min(second) > max(first)
    assert all(node.counters["seeded_streams"] == 1 for node in nodes)
    result = ingest_baseline(str(config.spool_dir), config.store_location)
    assert result.records_added == 65 and not result.problems  # one chain from the genesis
    assert verify_baseline(config.store_location).points[STREAM][0] == max(second)

    # Once ingested, the spools are reclaimed; the next start seeds from the store alone.
    third, nodes = asyncio.run(run_mesh(config, [b"c%d" % i for i in range(5)]))
    assert min(third) > max(second)
    assert all(node.counters["seeded_streams"] == 1 for node in nodes)
    left = find_segments(config.spool_dir)
    assert left and all(segment.first_seq == min(third) for segment in left), left
    assert ingest_baseline(str(config.spool_dir), config.store_location).records_added == 5
    stored = list(StoreReader(config.store_location.local_root).records_after(STREAM, -1))
    assert [r.seq for r in stored] == sorted(first + second + third)
    values = [b"a%d" % i for i in range(40)] + [b"b%d" % i for i in range(25)]
    assert sorted(r.value for r in stored) == sorted(values + [b"c%d" % i for i in range(5)])


def test_full_spools_refuse_writes_and_lose_nothing_acknowledged(tmp_path: Path) -> None:
    """The spool budget is reached on every relay: the relays stop voting, producers get
    StoreBacklogFull, every acknowledged write is in a spool; the store ingests them all
    (no gap), the spools are reclaimed and the mesh takes writes again."""
    path = write_loopback_topology(
        tmp_path,
        {r: [STREAM] for r in RELAYS},
        limits={"max_tx_bytes": 4096},
        spool={
            "enabled": True,
            "segment_max_bytes": 8_000,
            "segment_max_age_ms": 200,
            "disk_max_bytes": 150_000,
        },
    )
    config = load(path)
    value = bytes(range(256)) * 4  # 1 KiB that Parquet cannot squeeze much

    async def fill() -> tuple[list[int], int]:
        nodes = [RelayNode(config, r, handle_signals=False) for r in RELAYS]
        tasks = [asyncio.create_task(node.run()) for node in nodes]
        committed: list[int] = []
        unknown = 0
        try:
            async with AsyncProducer(topology=config, send_timeout_s=JOIN_TIMEOUT_S) as joiner:
                committed.append(await joiner.send(STREAM, value + b"0"))  # the mesh joined
            # store_backlog_full is retried until the attempts run out: one per relay, so
            # that a full mesh answers StoreBacklogFull after one round, not a deadline.
            async with AsyncProducer(topology=config, max_attempts=len(RELAYS)) as producer:
                for n in range(1, MAX_FILL_WRITES):
                    try:
                        committed.append(await producer.send(STREAM, value + b"%d" % n))
                    except StoreBacklogFull:
                        break
                    except Unknown:
                        unknown += 1  # taken just as the spools filled: it may commit
                else:
                    pytest.fail(f"{MAX_FILL_WRITES} writes and no StoreBacklogFull")
            statuses = [node.status() for node in nodes]
            assert sum(1 for s in statuses if s["spool_full"]) >= 2, statuses
            for status in statuses:
                spool = status["spool"]
                assert isinstance(spool, dict)
                assert spool["records_dropped"] == 0 and spool["errors"] == 0, spool
        finally:
            for node in nodes:
                node.stop()
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return committed, unknown

    committed, unknown = asyncio.run(fill())
    assert len(committed) > 50 and unknown <= 2
    everywhere = {seq for relay in RELAYS for seq, _, _ in spooled(config, relay)}
    assert set(committed) <= everywhere
    result = ingest_baseline(str(config.spool_dir), config.store_location)
    assert not result.problems and result.records_added >= len(committed)

    # The store took the spools: the relays reclaim them and take writes again.
    more, _ = asyncio.run(run_mesh(config, [b"after%d" % i for i in range(10)]))
    assert min(more) > max(committed)
    assert ingest_baseline(str(config.spool_dir), config.store_location).records_added == 10
    stored = [
        r.seq for r in StoreReader(config.store_location.local_root).records_after(STREAM, -1)
    ]
    assert set(committed) | set(more) <= set(stored)
    assert stored == sorted(set(stored))
