"""The whole path with real components: relay processes spool what they commit, Spark
ingests the spools and builds a snapshot, and consumers starting from `earliest` and from
the snapshot read the store and then the live mesh, while a producer keeps writing."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from relay.client import Consumer, Producer, Record
from relay.launcher import Mesh, write_loopback_topology
from relay.spool import last_spooled_points
from relay.store.changes import KIND_CHANGES, KIND_PLAIN, Change, Op, changes_of, encode_changes
from relay.store.ingest import ingest
from relay.store.snapshot import snapshot
from relay.topology import MeshConfig, load
from waiting import wait_until

pytestmark = pytest.mark.timeout(300)

STREAM = "orders"
RELAYS = (0, 1, 2)
# Small buffers, so the relays evict the beginning of the stream and a consumer from
# `earliest` has to read it from the store; yet bigger than everything written after the
# store's last point (WHILE_READING), so the consumers can hand over to the relays
# however slow the machine is.
BUFFER_MAX_ENTRIES = 1_000
KEYS = 40  # the producer's keys (so the snapshot overwrites and deletes)
BEFORE_INGEST = 1_500  # committed before the store is built (then the writer waits)
WHILE_READING = 300  # committed while the consumers read
SEND_INTERVAL_S = 0.005  # the writer's pause between those, so reading overlaps writing
CONSUMER_IDLE_S = 0.2  # a consumer's wait before the test looks whether it is done
READ_TIMEOUT_S = 60.0
START_TIMEOUT_S = 20.0


class Writer(threading.Thread):
    """Produces BEFORE_INGEST transactions to STREAM, waits for `resume`, produces
    WHILE_READING more: plain values, and every 7th a change list (a put and, every other
    time, a delete of another key). Keeps what committed."""

    def __init__(self, config: MeshConfig) -> None:
        super().__init__(name="e2e-writer", daemon=True)
        self.config = config
        self.resume = threading.Event()
        self.stop_writing = threading.Event()  # ends the run early (the test failed)
        self.committed: dict[int, tuple[int, bytes | None, bytes]] = {}  # seq -> (kind, key, value)
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def count(self) -> int:
        """Committed so far; raises what stopped the writer, if anything did."""
        if self.error is not None:
            raise self.error
        with self._lock:
            return len(self.committed)

    def run(self) -> None:
        n = 0
        try:
            with Producer(topology=self.config) as producer:
                while n < BEFORE_INGEST + WHILE_READING and not self.stop_writing.is_set():
                    if n == BEFORE_INGEST:
                        while not (self.resume.wait(0.1) or self.stop_writing.is_set()):
                            pass
                    if n >= BEFORE_INGEST:
                        time.sleep(SEND_INTERVAL_S)  # pacing the load, not a synchronisation
                    key = b"k%d" % (n % KEYS)
                    if n % 7 == 6:
                        changes = [Change("", key, Op.PUT, b"c%d" % n)]
                        if n % 2:
                            changes.append(Change("", b"k%d" % ((n + 1) % KEYS), Op.DELETE))
                        seq = producer.send_changes(STREAM, changes)
                        entry: tuple[int, bytes | None, bytes] = (
                            KIND_CHANGES,
                            None,
                            encode_changes(changes),
                        )
                    else:
                        seq = producer.send(STREAM, b"v%d" % n, key)
                        entry = (KIND_PLAIN, key, b"v%d" % n)
                    with self._lock:
                        self.committed[seq] = entry
                    n += 1
        except BaseException as error:  # surfaced by the test
            self.error = error


def read_while_writing(consumer: Consumer, writer: Writer) -> list[Record]:
    """Every record, in the order yielded, until the writer finished and the consumer
    reached its last committed seq."""
    records: list[Record] = []
    deadline = time.monotonic() + READ_TIMEOUT_S
    while True:
        for record in consumer:  # ends after CONSUMER_IDLE_S without a record
            records.append(record)
        writer.count()  # raises what stopped the writer, if anything did
        if not writer.is_alive() and records and records[-1].seq >= max(writer.committed):
            return records
        assert time.monotonic() < deadline, f"read stalled after {len(records)} records"


def expected_state(
    committed: dict[int, tuple[int, bytes | None, bytes]], through: int
) -> dict[bytes, bytes]:
    """key -> value after every committed transaction at or below `through`."""
    state: dict[bytes, bytes] = {}
    for seq in sorted(s for s in committed if s <= through):
        kind, key, value = committed[seq]
        for change in changes_of(kind, key, value):
            if change.op is Op.PUT:
                assert change.value is not None
                state[change.key] = change.value
            else:
                state.pop(change.key, None)
    return state


def test_consumers_read_the_store_then_the_live_mesh(tmp_path: Path, spark: Any) -> None:
    config = load(
        write_loopback_topology(
            tmp_path,
            {r: [STREAM] for r in RELAYS},
            limits={"buffer_max_entries": BUFFER_MAX_ENTRIES},
            spool={"enabled": True, "segment_max_age_ms": 200},
        )
    )
    with Mesh(config.path, log_dir=tmp_path / "logs").start(START_TIMEOUT_S):
        writer = Writer(config)
        writer.start()
        try:
            wait_until(lambda: writer.count() >= BEFORE_INGEST, "the first commits", timeout_s=60)
            # The writer waits; every relay closes its segment when it passes its max age.
            last = max(writer.committed)
            wait_until(
                lambda: all(
                    last_spooled_points(config.spool_dir, r).get(STREAM, (0,))[0] == last
                    for r in RELAYS
                ),
                "every relay to spool the first commits",
                timeout_s=60,
                poll_s=0.05,
            )
            ingested = ingest(spark, str(config.spool_dir), config.store_location)
            assert ingested.records_added == BEFORE_INGEST and not ingested.problems
            stored_through = ingested.streams[STREAM][0]
            made = snapshot(spark, config.store_location)
            snapshot_seq = made[STREAM].seq
            assert snapshot_seq == stored_through

            # While the writer goes on: from the very first transaction, and from the snapshot.
            earliest, from_snapshot = (
                Consumer(topology=config, wait_ms=100, timeout_s=CONSUMER_IDLE_S) for _ in range(2)
            )
            with (
                earliest.subscribe(STREAM, "earliest"),
                from_snapshot.subscribe(STREAM, "snapshot"),
            ):
                assert from_snapshot.snapshot is not None
                assert from_snapshot.snapshot.seq == snapshot_seq
                writer.resume.set()
                everything = read_while_writing(earliest, writer)
                after_snapshot = read_while_writing(from_snapshot, writer)
                assert writer.error is None, writer.error
                # The store served the evicted beginning, the relays everything after it.
                from_store = earliest.stats["stored_records"]
                assert from_store >= BEFORE_INGEST - BUFFER_MAX_ENTRIES
                assert len(everything) - from_store >= WHILE_READING
                rows = from_snapshot.snapshot.rows.to_pydict()
        finally:
            writer.stop_writing.set()
            writer.join(30)

    committed = writer.committed
    # Every committed transaction exactly once, in order, across the handover.
    assert [r.seq for r in everything] == sorted(committed)
    for record in everything:
        key = record.key if record.kind == KIND_PLAIN else None
        assert (record.kind, key, record.value) == committed[record.seq]
    assert [r.seq for r in after_snapshot] == sorted(s for s in committed if s > snapshot_seq)
    # The snapshot is the state after every transaction up to its seq.
    assert dict(zip(rows["key"], rows["value"], strict=True)) == expected_state(
        committed, snapshot_seq
    )
    assert set(rows["entity"]) == {""}
