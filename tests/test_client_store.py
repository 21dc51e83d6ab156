"""Consumers that read the persistent store where the relays cannot serve (relay/client.py,
docs/store.md 5): real stores built without Spark (`relay.tools.synthetic` spools ingested
by `relay.tools.store_baseline`), scripted fake relays for the live part, and once real relays
that restarted from the store's last point.

Synthetic seqs start at 2**40 and grow by at most 4096 a record, so the fake relays' live
entries (after the store's last seq) and real relays' flake ids (about 2**58) follow the
stored history. Every 50th synthetic record is a duplicate, which readers skip: with 100
records the store's last point is a duplicate's seq that no record yielded carries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from relay import wire
from relay.client import AsyncConsumer, Consumer, Producer, Record
from relay.core.messages import ReadStatus
from relay.errors import OutOfRange
from relay.launcher import write_loopback_topology
from relay.node import RelayNode
from relay.store.changes import Op, changes_of
from relay.store.reader import StoreReader
from relay.tools.store_baseline import ingest_baseline, snapshot_baseline
from relay.tools.synthetic import FIRST_SEQ, StreamRecords, generate, write_spools
from relay.topology import MeshConfig, load
from waiting import wait_until

pytestmark = pytest.mark.timeout(60)

STREAM = "orders"
MAX_FRAME = 1 << 20
SPOOL_RELAYS = 3  # relays whose spools hold each synthetic record
SEGMENT_RECORDS = 30  # records per spool segment: several segments and record files
LIVE_SEQ_STEP = 1_000  # between the fake relays' live entries
LIVE_ENTRIES = 5
GENESIS = 0  # a relay's `oldest` when its history starts at the genesis
FAKE_LONG_POLL_MAX_S = 0.05  # how long a fake relay holds an empty answer
RELAY_JOIN_TIMEOUT_S = 15.0
GIVE_UP_S = 5.0  # a consumer's timeout_s where records are due
QUIET_S = 0.3  # a consumer's timeout_s once every record was read
IMPATIENT_WAIT_S = 0.0005  # an async next() cancelled after this long


# --- stores ------------------------------------------------------------------------------


class History:
    """A stream's history ingested into a store at `path`, chunk by chunk."""

    def __init__(self, tmp_path: Path, store_path: Path | None = None) -> None:
        self.spool_root = tmp_path / "spool"
        self.path = store_path if store_path is not None else tmp_path / "store"
        self.chunks: list[StreamRecords] = []

    def ingest(self, count: int, *, snapshot: bool = False) -> History:
        """Add `count` records (continuing the chain), ingest them; then snapshot."""
        previous = self.chunks[-1] if self.chunks else None
        chunk = generate(
            STREAM,
            count,
            first_seq=previous.seqs[-1] if previous else FIRST_SEQ,
            previous_digest=previous.digests[-1] if previous else None,
            first_index=sum(len(c) for c in self.chunks),
        )
        write_spools(
            str(self.spool_root), [chunk], relays=SPOOL_RELAYS, segment_records=SEGMENT_RECORDS
        )
        ingest_baseline(str(self.spool_root), str(self.path))
        if snapshot:
            snapshot_baseline(str(self.path))
        self.chunks.append(chunk)
        return self

    @property
    def last_seq(self) -> int:
        return self.chunks[-1].seqs[-1]

    def records(self, after_seq: int = -1) -> list[Record]:
        """What a consumer gets: the non-duplicate records after `after_seq`."""
        return [
            Record(STREAM, seq, key, value, pid, pseq, kind)
            for chunk in self.chunks
            for seq, key, value, pid, pseq, kind, duplicate in zip(
                chunk.seqs,
                chunk.keys,
                chunk.values,
                chunk.producer_ids,
                chunk.producer_seqs,
                chunk.kinds,
                chunk.duplicates,
                strict=True,
            )
            if not duplicate and seq > after_seq
        ]


def live_entries(after_seq: int, count: int = LIVE_ENTRIES) -> list[wire.WireEntry]:
    return [
        (after_seq + LIVE_SEQ_STEP * i, b"live", b"v%d" % i, b"live-producer", i, 0)
        for i in range(1, count + 1)
    ]


def as_records(entries: list[wire.WireEntry]) -> list[Record]:
    return [Record(STREAM, *entry) for entry in entries]


# --- fake relays -------------------------------------------------------------------------


class FakeRelay:
    """A ROUTER answering ReadReqs like a relay whose buffer holds `entries` after its
    base `oldest` (GENESIS: its history starts at the genesis): out_of_range for a
    position below the base, else the entries after the position. The test may move the
    base while it runs (an eviction)."""

    def __init__(
        self, entries: list[wire.WireEntry], oldest: int, bind: str = "tcp://127.0.0.1:*"
    ) -> None:
        self.entries = entries
        self.oldest = oldest
        self.requests: list[wire.ReadReq] = []
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(10):
                continue
            identity, frame = self.sock.recv_multipart()
            msg = wire.decode(frame, MAX_FRAME)
            assert isinstance(msg, wire.ReadReq)
            self.requests.append(msg)
            self.sock.send_multipart([identity, wire.encode(self._answer(msg))])

    def _answer(self, req: wire.ReadReq) -> wire.ReadResp:
        base = self.oldest
        committed = self.entries[-1][0] if self.entries else base
        if base != GENESIS and 0 <= req.after_seq < base:
            return wire.ReadResp(req.request_id, ReadStatus.OUT_OF_RANGE, (), (), base, committed)
        after = max(req.after_seq, base)
        found = tuple(e for e in self.entries if e[0] > after)[: req.max_entries]
        if not found:
            # Not a synchronisation: the fake relay's long poll (an empty read waits up to
            # wait_ms before it answers), capped.
            time.sleep(min(req.wait_ms / 1000, FAKE_LONG_POLL_MAX_S))
        return wire.ReadResp(req.request_id, ReadStatus.OK, found, (), base, committed)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.ctx.destroy(linger=0)

    def __enter__(self) -> FakeRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def pulls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the store scans a consumer starts and the stored records it pulls."""
    counts = {"scans": 0, "records": 0}
    records_after = StoreReader.records_after

    def counting(self: StoreReader, stream: str, after_seq: int = -1) -> Iterator[Any]:
        counts["scans"] += 1
        for record in records_after(self, stream, after_seq):
            counts["records"] += 1
            yield record

    monkeypatch.setattr(StoreReader, "records_after", counting)
    return counts


# --- earliest: the store, then the relays ------------------------------------------------


def test_earliest_reads_the_store_then_the_relays(tmp_path: Path, pulls: dict[str, int]) -> None:
    history = History(tmp_path).ingest(100)
    stored = history.records()
    assert stored[-1].seq < history.last_seq  # the last stored record is a duplicate
    live = live_entries(history.last_seq)
    max_batch = 7
    with (
        FakeRelay(live, oldest=history.last_seq) as relay,
        Consumer(
            [relay.endpoint], store=history.path, max_batch=max_batch, count=len(stored) + len(live)
        ).subscribe(STREAM, "earliest") as c,
    ):
        got, sources, positions = [], [], []
        for record in c:
            got.append(record)
            sources.append(c.source)
            positions.append(c.position)
            # Bounded: the store is read a batch at a time, once the last was consumed.
            assert pulls["records"] <= len(got) + max_batch
        assert got == stored + as_records(live)  # every record once, in order
        for record, position, following in zip(got, positions, got[1:], strict=False):
            assert position is not None and record.seq <= position < following.seq
        assert set(sources[: len(stored) - max_batch]) == {"store"}
        assert set(sources[len(stored) :]) == {"relays"}
        # The relays were asked from the store's last point, which no record carries.
        assert relay.requests[0].after_seq == history.last_seq
        assert c.stats["stored_records"] == len(stored)
        assert c.stats["store_reads"] >= len(stored) / max_batch
        assert pulls["scans"] == 1  # one iterator across the batches
        assert c.stats["out_of_range"] == 0 and c.snapshot is None


def test_earliest_without_the_stream_in_the_store_reads_a_relay_from_the_genesis(
    tmp_path: Path,
) -> None:
    history = History(tmp_path).ingest(10)
    whole = live_entries(FIRST_SEQ)
    with (
        FakeRelay(whole[2:], oldest=whole[1][0]) as restarted,
        FakeRelay(whole, oldest=GENESIS) as complete,
    ):
        endpoints = [restarted.endpoint, complete.endpoint]
        with Consumer(endpoints, store=history.path, count=len(whole)) as c:
            # "audit" is not stored: the relay whose history starts after a base leaves a
            # gap before it, so the one holding the stream from its genesis serves.
            got = [(r.seq, r.value) for r in c.subscribe("audit", "earliest")]
        assert got == [(e[0], e[2]) for e in whole]
        assert c.stats["out_of_range"] == 1 and c.stats["stored_records"] == 0


# --- a position the relays no longer hold ------------------------------------------------


def test_a_position_older_than_every_relay_is_served_from_the_store(tmp_path: Path) -> None:
    history = History(tmp_path).ingest(100)
    live = live_entries(history.last_seq)
    start = history.records()[40].seq
    expected = history.records(start) + as_records(live)
    with (
        FakeRelay(live, oldest=history.last_seq) as one,
        FakeRelay(live, oldest=history.last_seq) as two,
    ):
        relays = [one.endpoint, two.endpoint]
        with Consumer(relays, store=history.path, max_batch=16, count=len(expected) - 2) as c:
            got = list(c.subscribe(STREAM, start))
            assert c.stats["out_of_range"] == 1  # one relay said so; the store took over
            assert c.stats["stored_records"] == len(expected) - len(live)
            position = c.position
        assert position is not None and expected[-3].seq <= position < expected[-2].seq
        # Resuming from the position carries on where the first consumer stopped ...
        with Consumer(relays, store=history.path, count=2).subscribe(STREAM, position) as c:
            assert got + list(c) == expected
            assert c.stats["stored_records"] == 0
        # ... and from a position in the stored part, through the handover again.
        resume_at = expected[10].seq
        with Consumer(relays, store=history.path, count=len(expected) - 11) as c:
            assert list(c.subscribe(STREAM, resume_at)) == expected[11:]


def test_a_consumer_that_falls_behind_recovers_from_the_store(tmp_path: Path) -> None:
    history = History(tmp_path).ingest(100)
    stored = history.records()
    live = live_entries(history.last_seq)
    everything = [
        (r.seq, r.key, r.value, r.producer_id, r.producer_seq, r.kind) for r in stored
    ] + live
    max_batch = 10
    with FakeRelay(everything, oldest=GENESIS) as relay:
        with Consumer(
            [relay.endpoint], store=history.path, max_batch=max_batch, count=len(everything)
        ) as c:
            got = []
            for record in c.subscribe(STREAM, -1):
                got.append(record)
                assert c.source == "relays" or len(got) > max_batch
                if len(got) == max_batch:
                    # While the consumer worked through its batch, the relay evicted the
                    # rest of the stored history: its buffer now starts at the store's end.
                    relay.oldest = history.last_seq
        assert got == stored + as_records(live)
        assert c.stats["out_of_range"] == 1
        assert c.stats["stored_records"] == len(stored) - max_batch
        assert c.source == "relays"
        assert [r.after_seq for r in relay.requests[:3]] == [
            -1,
            stored[max_batch - 1].seq,  # out_of_range: the store serves from here ...
            history.last_seq,  # ... up to its last point
        ]


# --- snapshot ----------------------------------------------------------------------------


def folded(records: list[Record]) -> dict[tuple[str, bytes], tuple[bytes, int]]:
    """(entity, key) -> (value, seq of the last write), as a snapshot holds them."""
    state: dict[tuple[str, bytes], tuple[bytes, int]] = {}
    for record in records:
        for change in changes_of(record.kind, record.key, record.value):
            if change.op is Op.DELETE:
                state.pop((change.entity, change.key), None)
            else:
                assert change.value is not None
                state[(change.entity, change.key)] = (change.value, record.seq)
    return state


def test_snapshot_start(tmp_path: Path) -> None:
    history = History(tmp_path).ingest(60, snapshot=True).ingest(40)
    snapshot_seq = history.chunks[0].seqs[-1]
    live = live_entries(history.last_seq)
    with FakeRelay(live, oldest=history.last_seq) as relay:
        after = history.records(snapshot_seq) + as_records(live)
        with Consumer([relay.endpoint], store=history.path, count=len(after)) as c:
            c.subscribe(STREAM, "snapshot")
            snapshot = c.snapshot
            assert snapshot is not None and snapshot.seq == snapshot_seq
            rows = snapshot.rows.to_pylist()
            up_to_snapshot = [r for r in history.records() if r.seq <= snapshot_seq]
            assert {(r["entity"], r["key"]): (r["value"], r["seq"]) for r in rows} == folded(
                up_to_snapshot
            )
            assert list(c) == after  # the records after the snapshot, stored then live
            assert c.stats["stored_records"] == len(after) - len(live)

        # A store without a snapshot of the stream: like "earliest", no snapshot.
        plain = History(tmp_path / "plain").ingest(20)
        relay.entries, relay.oldest = live_entries(plain.last_seq), plain.last_seq
        everything = plain.records() + as_records(relay.entries)
        with Consumer([relay.endpoint], store=plain.path, count=len(everything)) as c:
            assert list(c.subscribe(STREAM, "snapshot")) == everything
            assert c.snapshot is None
        # Without a store a snapshot cannot be had.
        with (
            Consumer([relay.endpoint], store=False) as c,
            pytest.raises(ValueError, match="needs a store"),
        ):
            c.subscribe(STREAM, "snapshot")


# --- when nothing covers the position ----------------------------------------------------


def test_out_of_range_when_neither_the_store_nor_a_relay_covers(tmp_path: Path) -> None:
    history = History(tmp_path).ingest(100)
    base = history.last_seq + 5 * LIVE_SEQ_STEP  # the relays lost what followed the store
    stored = history.records()
    with (
        FakeRelay(live_entries(base), oldest=base) as one,
        FakeRelay(live_entries(base), oldest=base) as two,
    ):
        relays = [one.endpoint, two.endpoint]
        with Consumer(relays, store=history.path, timeout_s=GIVE_UP_S).subscribe(STREAM) as c:
            got = []
            with pytest.raises(OutOfRange) as caught:
                for record in c:
                    got.append(record)
            assert got == stored  # the store's part came before
            message = str(caught.value)
            assert f"ends at seq {history.last_seq}" in message
            assert f"after seq {base}" in message
            assert c.oldest_available == base
        # A stream the store does not hold, from relays whose history starts at a base:
        # read from the beginning, what came before the base is gone, and it says so.
        with Consumer(relays, store=history.path, timeout_s=GIVE_UP_S).subscribe("audit") as c:
            first = next(c)
            assert c.history_gone_before == base and first.seq > base


# --- where the store comes from ----------------------------------------------------------


def test_the_topology_store_by_default_and_store_false(tmp_path: Path) -> None:
    path = write_loopback_topology(tmp_path / "mesh", {1: [STREAM]})
    config = load(path)
    history = History(tmp_path, config.store_location.local_root).ingest(100)
    live = live_entries(history.last_seq)
    stored = history.records()
    with FakeRelay(live, oldest=history.last_seq, bind=config.relays[1].client_endpoint):
        # By default a topology's store location is read once a store was ingested there.
        with Consumer(topology=config, count=len(stored) + len(live)) as c:
            assert list(c.subscribe(STREAM)) == stored + as_records(live)
        # store=False: the relays only, exactly as before ("earliest" is the oldest entry
        # held; a position before it is out of range, with no word of a store).
        with Consumer(topology=config, store=False, timeout_s=QUIET_S) as c:
            assert list(c.subscribe(STREAM)) == as_records(live)
            assert c.stats["store_reads"] == 0
            with pytest.raises(OutOfRange) as caught:
                next(c.subscribe(STREAM, stored[0].seq))
            assert "store" not in str(caught.value)
            assert c.oldest_available == history.last_seq
    # A topology whose store location holds no store: the consumer has none.
    bare = load(write_loopback_topology(tmp_path / "bare", {1: [STREAM]}))
    with Consumer(topology=bare) as c, pytest.raises(ValueError, match="needs a store"):
        c.subscribe(STREAM, "snapshot")


def test_a_store_needs_pyarrow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "relay.store.reader", None)
    with pytest.raises(ImportError, match="store extra"):
        Consumer(["tcp://127.0.0.1:1"], store=tmp_path)


# --- the async flavour -------------------------------------------------------------------


def test_async_consumer_reads_the_store_then_the_relays(tmp_path: Path) -> None:
    history = History(tmp_path).ingest(100)
    live = live_entries(history.last_seq)
    expected = history.records() + as_records(live)

    async def consume(endpoint: str) -> list[Record]:
        async with AsyncConsumer(
            [endpoint], store=history.path, max_batch=9, count=len(expected)
        ) as c:
            got = [record async for record in c.subscribe(STREAM, "earliest")]
            assert c.stats["stored_records"] == len(expected) - len(live)
            assert c.source == "relays"
            return got

    async def consume_impatiently(endpoint: str) -> list[Record]:
        """Every `next` is cancelled unless it is quick: a store read under way in its
        thread then finishes for the next one, and nothing is lost or read twice."""
        got: list[Record] = []
        async with AsyncConsumer([endpoint], store=history.path, max_batch=9) as c:
            c.subscribe(STREAM, "earliest")
            while len(got) < len(expected):
                with contextlib.suppress(TimeoutError):
                    got.append(await asyncio.wait_for(anext(c), IMPATIENT_WAIT_S))
        return got

    with FakeRelay(live, oldest=history.last_seq) as relay:
        assert asyncio.run(consume(relay.endpoint)) == expected
        assert asyncio.run(consume_impatiently(relay.endpoint)) == expected


# --- real relays -------------------------------------------------------------------------


class Mesh:
    """RelayNodes of `config` running in a background thread's event loop."""

    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.nodes: dict[int, RelayNode] = {}
        self.runs: dict[int, concurrent.futures.Future[None]] = {}

    def __enter__(self) -> Mesh:
        self.thread.start()
        try:
            for relay_id in self.config.relays:
                self._start(relay_id)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self, relay_id: int) -> None:
        node = RelayNode(self.config, relay_id, handle_signals=False)
        self.nodes[relay_id] = node
        run = self.runs[relay_id] = asyncio.run_coroutine_threadsafe(node.run(), self.loop)
        wait_until(lambda: node.running or run.done(), f"relay {relay_id} to start")
        assert node.running, run.exception()

    def __exit__(self, *exc: object) -> None:
        try:
            for node in self.nodes.values():
                self.loop.call_soon_threadsafe(node.stop)
            for run in self.runs.values():
                run.result(timeout=5)  # re-raises what the node raised
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()


def test_real_relays_restarted_from_the_store(tmp_path: Path) -> None:
    """The whole mesh restarted with empty buffers: the relays carry on from the store's
    last point, and a consumer gets the stored history, then what commits since."""
    config = load(write_loopback_topology(tmp_path / "mesh", {1: [STREAM], 2: [STREAM]}))
    history = History(tmp_path, config.store_location.local_root).ingest(100)
    stored = history.records()
    with Mesh(config):
        with Producer(topology=config, send_timeout_s=RELAY_JOIN_TIMEOUT_S) as producer:
            seqs = [producer.send(STREAM, b"new %d" % i) for i in range(LIVE_ENTRIES)]
        assert seqs[0] > history.last_seq
        with Consumer(topology=config, count=len(stored) + len(seqs)) as c:
            got = list(c.subscribe(STREAM, "earliest"))
        assert got[: len(stored)] == stored
        assert [r.seq for r in got[len(stored) :]] == seqs
        # A position the relays never held: out_of_range, then the store, then the relays.
        with Consumer(topology=config, count=len(seqs) + 1) as c:
            got = list(c.subscribe(STREAM, stored[-2].seq))
        assert [r.seq for r in got] == [stored[-1].seq, *seqs]
        assert c.stats["out_of_range"] >= 1 and c.stats["stored_records"] == 1
