"""The client library (relay/client.py) against real RelayNodes and scripted fake relays.

Real relays run in one background thread's event loop (so the synchronous clients may
block the test's thread); fake relays are ROUTER sockets answering from a script, for the
rules that real relays rarely show on demand (unknown then rejected, out_of_range on every
relay, a bounded window). Every test stops every relay it starts, also on failure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import json
import select
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop
import zmq

from relay import wire
from relay.client import (
    AsyncConsumer,
    AsyncProducer,
    Consumer,
    Producer,
    Record,
)
from relay.core import Limits
from relay.core.messages import Outcome, ReadStatus
from relay.engines import ProduceEngine, Relays
from relay.errors import (
    BufferFull,
    Fenced,
    OutOfRange,
    Rejected,
    StoreBacklogFull,
    Unknown,
    UnknownStream,
)
from relay.launcher import free_ports, write_loopback_topology
from relay.node import RelayNode
from relay.topology import MeshConfig, loads
from waiting import wait_until, wait_until_async

pytestmark = pytest.mark.timeout(60)

MAX_FRAME = 1 << 20


# --- helpers -----------------------------------------------------------------------------


def write_topology(tmp_path: Path, streams: dict[int, list[str]]) -> Path:
    limits = {"max_tx_bytes": 4096, "max_frame_bytes": MAX_FRAME}
    return write_loopback_topology(tmp_path, streams, (), limits)


def dead_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there


class Mesh:
    """RelayNodes running in a background thread's event loop."""

    def __init__(self, tmp_path: Path, streams: dict[int, list[str]]) -> None:
        self.path = write_topology(tmp_path, streams)
        self.config: MeshConfig = loads(self.path.read_text(), self.path)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.nodes: dict[int, RelayNode] = {}
        self.runs: dict[int, concurrent.futures.Future[None]] = {}

    def endpoint(self, relay_id: int) -> str:
        return self.config.relays[relay_id].client_endpoint

    def start(self, relay_id: int) -> None:
        node = RelayNode(self.config, relay_id, handle_signals=False)
        self.nodes[relay_id] = node
        run = self.runs[relay_id] = asyncio.run_coroutine_threadsafe(node.run(), self.loop)
        wait_until(lambda: node.running or run.done(), f"relay {relay_id} to start")
        assert node.running, run.exception()

    def stop(self, relay_id: int) -> None:
        node = self.nodes.pop(relay_id)
        run = self.runs.pop(relay_id)
        self.loop.call_soon_threadsafe(node.stop)
        run.result(timeout=5)  # re-raises what the node raised

    def close(self) -> None:
        try:
            for relay_id in list(self.nodes):
                self.stop(relay_id)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()

    def status(self, relay_id: int) -> dict[str, Any]:
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint(relay_id))
            sock.send(wire.encode(wire.StatusReq(1)))
            assert sock.poll(5_000), f"relay {relay_id} did not answer a StatusReq"
            resp = wire.decode(sock.recv(), MAX_FRAME)
            assert isinstance(resp, wire.StatusResp)
            status: dict[str, Any] = json.loads(resp.status_json)
            return status
        finally:
            ctx.destroy(linger=0)

    def wait_joined(self, stream: str, relays: Any = None) -> None:
        for relay_id in relays or self.nodes:
            self.wait_serving(relay_id, stream)

    def wait_serving(self, relay_id: int, stream: str) -> None:
        """Wait until the relay has joined `stream` and is not fenced."""

        def info() -> dict[str, Any]:
            found: dict[str, Any] = self.status(relay_id)["streams"].get(stream, {})
            return found

        def serving() -> bool:
            now = info()
            return bool(now.get("joined") and not now.get("fenced"))

        wait_until(
            serving,
            lambda: f"{stream} joined and unfenced on relay {relay_id} (now: {info()})",
            poll_s=0.02,
        )


@contextlib.contextmanager
def running_mesh(tmp_path: Path, streams: dict[int, list[str]], stream: str) -> Iterator[Mesh]:
    mesh = Mesh(tmp_path, streams)
    try:
        for relay_id in streams:
            mesh.start(relay_id)
        mesh.wait_joined(stream, [r for r, subs in streams.items() if stream in subs])
        yield mesh
    finally:
        mesh.close()


@pytest.fixture
def mesh3(tmp_path: Path) -> Iterator[Mesh]:
    with running_mesh(tmp_path, {1: ["orders"], 2: ["orders"], 3: ["orders"]}, "orders") as mesh:
        yield mesh


Handler = Callable[[wire.ClientMessage], wire.ClientMessage | None]


class FakeRelay:
    """A ROUTER answering client requests from a script (None: no answer). The items of
    a ProduceBatchReq reach the script as ProduceReqs (request id: the item id); their
    answers go back together in one ProduceBatchResp."""

    def __init__(
        self,
        handler: Handler,
        idle: Callable[[], list[wire.ClientMessage]] | None = None,
        refuse_batches: bool = False,
    ) -> None:
        self.handler = handler
        self.idle = idle
        self.refuse_batches = refuse_batches  # answer every batch with an ErrorResp
        self.client = b""
        self.requests: list[wire.ClientMessage] = []
        self.batches: list[wire.ProduceBatchReq] = []
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(10):
                for answer in self.idle() if self.idle is not None else []:
                    self.sock.send_multipart([self.client, wire.encode(answer)])
                continue
            identity, frame = self.sock.recv_multipart()
            self.client = identity
            msg = wire.decode(frame, MAX_FRAME)
            if isinstance(msg, wire.ProduceBatchReq):
                self.batches.append(msg)
                if self.refuse_batches:
                    refusal = wire.ErrorResp(msg.request_id, "FieldError", "items: too many")
                    self.sock.send_multipart([identity, wire.encode(refusal)])
                else:
                    self._answer_batch(identity, msg)
                continue
            self.requests.append(msg)
            resp = self.handler(msg)
            if resp is not None:
                self.sock.send_multipart([identity, wire.encode(resp)])

    def _answer_batch(self, identity: bytes, batch: wire.ProduceBatchReq) -> None:
        results: list[wire.BatchResult] = []
        for item_id, stream, producer_seq, key, value, kind in batch.items:
            item = wire.ProduceReq(
                item_id, stream, batch.producer_id, producer_seq, key, value, kind
            )
            self.requests.append(item)
            resp = self.handler(item)
            if isinstance(resp, wire.ProduceResp):
                results.append((item_id, resp.outcome, resp.seq, resp.reason, resp.redirect))
        if results:
            answer = wire.ProduceBatchResp(-1, tuple(results))
            self.sock.send_multipart([identity, wire.encode(answer)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.ctx.destroy(linger=0)

    def __enter__(self) -> FakeRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def produce_answer(
    outcome: Outcome, seq: int = -1, reason: str = "", redirect: Any = ()
) -> Handler:
    def handle(msg: wire.ClientMessage) -> wire.ClientMessage | None:
        assert isinstance(msg, wire.ProduceReq)
        return wire.ProduceResp(msg.request_id, outcome, seq, reason, tuple(redirect))

    return handle


def read_answer(status: ReadStatus, *, oldest: int = -1, entries: Any = ()) -> Handler:
    def handle(msg: wire.ClientMessage) -> wire.ClientMessage | None:
        assert isinstance(msg, wire.ReadReq)
        found = tuple(e for e in entries if e[0] > msg.after_seq)[: msg.max_entries]
        if status is ReadStatus.OK and not found:
            # Not a synchronisation: the fake relay's long poll (an empty read waits up
            # to wait_ms before it answers), cut to 50 ms.
            time.sleep(min(msg.wait_ms, 50) / 1000)
        return wire.ReadResp(msg.request_id, status, found, (), oldest, 1_000)

    return handle


def silent(msg: wire.ClientMessage) -> None:
    return None


# --- producer rules (fake relays) --------------------------------------------------------


def test_rejected_is_final_unless_an_earlier_attempt_was_unknown() -> None:
    with (
        FakeRelay(produce_answer(Outcome.UNKNOWN)) as unknown,
        FakeRelay(produce_answer(Outcome.REJECTED, reason="late")) as late,
        FakeRelay(produce_answer(Outcome.REJECTED, reason="unknown_stream")) as nobody,
        FakeRelay(silent) as mute,
        FakeRelay(produce_answer(Outcome.COMMITTED, seq=9)) as fine,
        FakeRelay(produce_answer(Outcome.REJECTED, reason="too_large")) as big,
    ):
        # `late` is retried (that copy will never be delivered); only when every attempt
        # until the deadline was left out is it final.
        with (
            Producer([late.endpoint], request_timeout_s=0.3) as p,
            pytest.raises(Rejected, match="every copy was left out"),
        ):
            p.send("s", b"v")
        assert len(late.requests) >= 2
        with Producer([late.endpoint, fine.endpoint]) as p:
            assert p.send("s", b"v") == 9
            assert p.stats["rejected_late"] == 1
        with Producer([nobody.endpoint]) as p, pytest.raises(UnknownStream):
            p.send("s", b"v")
        # unknown, then rejected by the next relay: the first copy may still commit.
        with Producer([unknown.endpoint, big.endpoint]) as p:
            with pytest.raises(Unknown, match="may still commit"):
                p.send("s", b"v")
            assert p.next_producer_seq == 1
        # A timeout counts as unknown too.
        with (
            Producer([mute.endpoint, big.endpoint], request_timeout_s=0.2) as p,
            pytest.raises(Unknown, match="may still commit"),
        ):
            p.send("s", b"v")
        retried = unknown.requests + big.requests + mute.requests
        assert all(isinstance(m, wire.ProduceReq) for m in retried)
        # Within one send, every attempt carries the same producer id and seq.
        last = big.requests[-1]
        assert isinstance(last, wire.ProduceReq)
        same = [
            m
            for m in retried
            if isinstance(m, wire.ProduceReq) and m.producer_id == last.producer_id
        ]
        assert {m.producer_seq for m in same} == {0} and len(same) == 2


def test_fenced_follows_redirect_and_gives_up_with_fenced() -> None:
    with (
        FakeRelay(produce_answer(Outcome.FENCED, redirect=(3,))) as first,
        FakeRelay(produce_answer(Outcome.FENCED, redirect=(1, 3))) as second,
        FakeRelay(produce_answer(Outcome.COMMITTED, seq=77)) as third,
    ):
        relays = {1: first.endpoint, 2: second.endpoint, 3: third.endpoint}
        with Producer(relays) as p:
            assert p.send("s", b"v", key=b"k") == 77
            # The redirect to 3 was followed before trying 2.
            assert len(first.requests) == 1 and not second.requests
            assert p.stats["fenced"] == 1
            # The relay that committed is preferred next time.
            assert p.send("s", b"w") == 77 and len(first.requests) == 1
        with Producer({1: first.endpoint, 2: second.endpoint}, max_attempts=5) as p:
            with pytest.raises(Fenced) as info:
                p.send("s", b"v")
            assert info.value.redirect_to in ((3,), (1, 3))
            assert info.value.retriable


@pytest.mark.parametrize(
    ("reason", "counter", "error"),
    [
        ("store_backlog_full", "rejected_backlog", StoreBacklogFull),
        ("buffer_full", "rejected_buffer_full", BufferFull),
    ],
)
def test_backpressure_is_retried_until_the_deadline(
    reason: str, counter: str, error: type[Rejected]
) -> None:
    """`rejected (store_backlog_full)` (docs/protocol.md 5.14) and `rejected (buffer_full)`
    (5.10) are back-pressure, not final answers: the producer tries the next relay, pauses
    once every relay said so and tries again, until the deadline; only then does the
    reason's error (retriable) reach the caller."""
    full_answer = produce_answer(Outcome.REJECTED, reason=reason)
    with (
        FakeRelay(full_answer) as full,
        FakeRelay(produce_answer(Outcome.COMMITTED, seq=11)) as fine,
    ):
        with Producer([full.endpoint, fine.endpoint]) as p:
            assert p.send("s", b"v") == 11
            assert p.stats[counter] == 1 and p.stats["failed"] == 0
        with (
            Producer([full.endpoint], send_timeout_s=0.5) as p,
            pytest.raises(error, match="still refused") as info,
        ):
            p.send("s", b"v")
        assert info.value.retriable and info.value.reason == reason
        assert len(full.requests) >= 3  # 1 + 1 (the first send) + the retries of the second


def _answer(frame: bytes, outcome: Outcome, seq: int = -1, reason: str = "") -> bytes:
    req = wire.decode(frame, MAX_FRAME)
    assert isinstance(req, wire.ProduceReq)
    return wire.encode(wire.ProduceResp(req.request_id, outcome, seq, reason, ()))


def test_unknown_then_store_backlog_full_is_retried_and_commits() -> None:
    """Simulator seed 479: right after a heal, the first attempt is answered `unknown`, the
    retry on the other relay `rejected (store_backlog_full)` (its picture of a peer's
    spool was stale). The producer keeps the transaction and retries it (same producer
    seq) after a pause, and it commits; it used to end `Unknown` there."""
    a, b = "sim://0", "sim://1"
    relays = Relays([a, b], {0: a, 1: b}, limits=Limits())
    engine = ProduceEngine(
        relays,
        b"prod",
        1,
        window=1,
        send_timeout_s=30.0,
        request_timeout_s=5.0,
        max_attempts=30,
        connect_grace_s=0.0,
        now=0.0,
        first_request_id=1,
    )
    sent: list[tuple[str, bytes]] = []

    def send(endpoint: str, frame: bytes) -> bool:
        sent.append((endpoint, frame))
        return True

    op = engine.submit("a.one", None, b"v")
    engine.step(0.0, send)
    assert [e for e, _ in sent] == [a]
    engine.on_frame(a, _answer(sent[-1][1], Outcome.UNKNOWN), 0.15)
    engine.step(0.15, send)
    assert [e for e, _ in sent] == [a, b]
    engine.on_frame(b, _answer(sent[-1][1], Outcome.REJECTED, reason="store_backlog_full"), 0.16)
    assert not op.done and engine.stats["rejected_backlog"] == 1
    engine.step(0.16, send)
    assert len(sent) == 2  # every relay was tried: a pause first
    wakeup = engine.next_wakeup()
    assert wakeup is not None and 0.16 < wakeup <= 0.16 + 1.0
    engine.step(wakeup, send)
    assert len(sent) == 3
    engine.on_frame(sent[-1][0], _answer(sent[-1][1], Outcome.COMMITTED, seq=42), wakeup + 0.01)
    assert op.done and op.error is None and op.result() == 42
    reqs = [wire.decode(frame, MAX_FRAME) for _, frame in sent]
    # every attempt carries the same producer seq
    assert {r.producer_seq for r in reqs if isinstance(r, wire.ProduceReq)} == {1}
    assert len(reqs) == 3


class Holding:
    """A FakeRelay script that holds every produce and commits all it holds (seq 1000 +
    producer seq) whenever no request came for 10 ms; `peak`: the most held at once."""

    def __init__(self) -> None:
        self.held: list[wire.ProduceReq] = []
        self.peak = 0

    def hold(self, msg: wire.ClientMessage) -> None:
        assert isinstance(msg, wire.ProduceReq)
        self.held.append(msg)
        self.peak = max(self.peak, len(self.held))

    def release(self) -> list[wire.ClientMessage]:
        answers: list[wire.ClientMessage] = [
            wire.ProduceResp(m.request_id, Outcome.COMMITTED, 1000 + m.producer_seq)
            for m in self.held
        ]
        self.held.clear()
        return answers


def test_window_bounds_requests_in_flight() -> None:
    relay = Holding()
    fake_relay = FakeRelay(relay.hold, idle=relay.release)
    with fake_relay as fake, Producer([fake.endpoint], window=8) as p:
        seqs = p.send_many("s", (b"v%d" % i for i in range(40)))
        assert seqs == [1000 + i for i in range(40)]
        assert relay.peak == 8, relay.peak
        # A bad item stops the feed; what was sent before it settles first.
        with pytest.raises(TypeError):
            p.send_many("s", [b"ok", "not bytes"])  # type: ignore[list-item]
        assert p.next_producer_seq == 41 and not relay.held


def test_async_window_survives_senders_cancelled_while_waiting() -> None:
    relay = Holding()

    async def scenario(endpoint: str) -> None:
        async with AsyncProducer([endpoint], window=4) as p:
            first = [await p.send_async("s", b"v%d" % i) for i in range(4)]  # the window is full
            waiting = [asyncio.create_task(p.send_async("s", b"w")) for _ in range(4)]
            await asyncio.sleep(0)  # they wait for room
            for task in waiting:
                task.cancel()
            assert [await f for f in first] == [1000 + i for i in range(4)]
            # Had a cancelled waiter kept a place, the window would be smaller (or gone).
            more = await asyncio.wait_for(p.send_many("s", [b"m%d" % i for i in range(20)]), 30)
            assert len(more) == 20
            assert relay.peak == 4, relay.peak

    with FakeRelay(relay.hold, idle=relay.release) as fake:
        asyncio.run(scenario(fake.endpoint))


def test_a_refused_batch_is_sent_again_item_by_item() -> None:
    """A relay allowing fewer items per batch than the producer assumed refuses the whole
    batch (changing nothing): each transaction then goes alone, and commits."""
    with (
        FakeRelay(produce_answer(Outcome.COMMITTED, seq=5), refuse_batches=True) as fake,
        Producer([fake.endpoint], window=10) as p,
    ):
        assert p.send_many("s", [b"v%d" % i for i in range(10)]) == [5] * 10
        assert len(fake.batches) == 1 and len(fake.batches[0].items) == 10
        singles = [m for m in fake.requests if isinstance(m, wire.ProduceReq)]
        assert sorted(m.producer_seq for m in singles) == list(range(10))
        assert p.stats["batches_refused"] == 1 and p.stats["failed"] == 0
        assert p.stats["attempts"] - p.stats["retries"] == 20  # the batch, then one each


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Producer()
    with pytest.raises(ValueError, match="producer_id"):
        Producer(["tcp://127.0.0.1:1"], producer_id=b"")
    with Producer(["tcp://127.0.0.1:1"]) as p:
        with pytest.raises(ValueError, match="stream name"):
            p.send("a|b", b"v")
        with pytest.raises(TypeError):
            p.send("s", "text")  # type: ignore[arg-type]
        assert len(p.producer_id) == 16
    # No relay reachable: the transaction was never sent; Unknown says so.
    with (
        Producer([dead_endpoint()], max_attempts=3, connect_grace_s=0) as p,
        pytest.raises(Unknown, match="not sent"),
    ):
        p.send("s", b"v")
    with Consumer(["tcp://127.0.0.1:1"]) as c:
        with pytest.raises(ValueError, match="start"):
            c.subscribe("s", "middle")  # text must be a seq's digits
        with pytest.raises(RuntimeError, match="subscribe"):
            next(c)


# --- consumer rules (fake relays) --------------------------------------------------------


def test_out_of_range_only_when_every_relay_lacks_the_position() -> None:
    entries = [(s, None, b"v%d" % s, b"p", s, 0) for s in (60, 70, 80)]
    with (
        FakeRelay(read_answer(ReadStatus.OUT_OF_RANGE, oldest=100)) as young,
        FakeRelay(read_answer(ReadStatus.OUT_OF_RANGE, oldest=50)) as younger,
        FakeRelay(read_answer(ReadStatus.OK, oldest=50, entries=entries)) as old,
    ):
        with Consumer([young.endpoint, younger.endpoint], timeout_s=5).subscribe("s", 10) as c:
            with pytest.raises(OutOfRange, match="after seq 50"):
                next(c)
            assert c.oldest_available == 50
        # One relay restarted from a base lacks the history another still has.
        with Consumer([young.endpoint, old.endpoint], timeout_s=1).subscribe("s", 10) as c:
            assert [r.seq for r in c] == [60, 70, 80]
            assert c.endpoint == old.endpoint and c.stats["out_of_range"] == 1
        # Resuming at the oldest position works.
        with Consumer([old.endpoint], timeout_s=0.3).subscribe("s", 65) as c:
            assert [r.seq for r in c] == [70, 80]


def test_consumer_moves_on_from_fenced_and_silent_relays() -> None:
    entries = [(s, b"k", b"v", b"p", s, 0) for s in (5, 6, 7)]
    with (
        FakeRelay(read_answer(ReadStatus.FENCED)) as fenced,
        FakeRelay(silent) as mute,
        FakeRelay(read_answer(ReadStatus.OK, entries=entries)) as good,
    ):
        relays = [fenced.endpoint, mute.endpoint, good.endpoint]
        with Consumer(relays, request_timeout_s=0.2, wait_ms=50, count=3) as c:
            got = list(c.subscribe("s", "earliest"))
        assert got == [Record("s", s, b"k", b"v", b"p", s) for s in (5, 6, 7)]
        assert c.stats["fenced"] == 1 and c.stats["timeouts"] == 1
        # A relay sending entries the consumer already has: never yielded twice.
        sloppy = FakeRelay(
            lambda m: wire.ReadResp(m.request_id, ReadStatus.OK, tuple(entries), (), -1, 7)
        )
        with sloppy, Consumer([sloppy.endpoint], timeout_s=0.3, wait_ms=0) as c:
            assert [r.seq for r in c.subscribe("s", 5)] == [6, 7]
            assert c.stats["dropped_old_entries"] > 3
        # "latest" starts at the relay's committed point (1000 here): nothing older.
        with Consumer([good.endpoint], timeout_s=0.3).subscribe("s", "latest") as c:
            assert list(c) == [] and c.position == 1_000


# --- real relays -------------------------------------------------------------------------


def test_produce_anywhere_consume_elsewhere(mesh3: Mesh) -> None:
    produced: dict[int, tuple[bytes | None, bytes, bytes, int]] = {}
    for relay_id in (1, 2, 3):
        with Producer([mesh3.endpoint(relay_id)]) as p:
            for i in range(3):
                value = b"r%d-%d" % (relay_id, i)
                seq = p.send("orders", value, key=b"k%d" % i)
                produced[seq] = (b"k%d" % i, value, p.producer_id, i)
            seqs = p.send_many("orders", [b"many-%d" % i for i in range(5)] + [(b"K", b"last")])
            assert len(set(seqs)) == 6
            for i, seq in enumerate(seqs):
                key, value = (b"K", b"last") if i == 5 else (None, b"many-%d" % i)
                produced[seq] = (key, value, p.producer_id, 3 + i)
            with pytest.raises(UnknownStream):
                p.send("nobody.serves.this", b"x")
            assert p.stats["timeouts"] == 0
    for relay_id in (1, 2, 3):
        other = relay_id % 3 + 1
        with Consumer([mesh3.endpoint(other)], count=len(produced), timeout_s=10, max_batch=7) as c:
            records = list(c.subscribe("orders"))
        assert [r.seq for r in records] == sorted(produced)
        for r in records:
            assert r.stream == "orders"
            assert (r.key, r.value, r.producer_id, r.producer_seq) == produced[r.seq]
    with Consumer([mesh3.endpoint(2)], timeout_s=5) as c, pytest.raises(UnknownStream):
        next(c.subscribe("nobody.serves.this"))


def test_batch_frames_hold_at_most_the_pipeline_unit() -> None:
    """A window larger than wire.PIPELINE_BATCH_ITEMS goes out in frames of at most that
    many produces (a relay takes about that many per turn and publishes them before it
    takes more), every transaction in exactly one of them."""
    relays = Relays(["tcp://127.0.0.1:1"], {0: "tcp://127.0.0.1:1"}, limits=Limits())
    engine = ProduceEngine(
        relays,
        b"packer",
        1,
        window=3 * wire.PIPELINE_BATCH_ITEMS,
        send_timeout_s=5.0,
        request_timeout_s=5.0,
        max_attempts=1,
        connect_grace_s=0.0,
        now=0.0,
        first_request_id=1,
    )
    frames: list[bytes] = []
    count = 2 * wire.PIPELINE_BATCH_ITEMS + 7
    for i in range(count):
        engine.submit("orders", None, b"v%d" % i)

    def send(_endpoint: str, frame: bytes) -> bool:
        frames.append(frame)
        return True

    engine.step(0.0, send)
    sizes = [len(wire.decode(f, 1 << 30, 1 << 20).items) for f in frames]  # type: ignore[union-attr]
    assert sizes == [wire.PIPELINE_BATCH_ITEMS, wire.PIPELINE_BATCH_ITEMS, 7], sizes


def test_send_many_packs_batch_frames(mesh3: Mesh) -> None:
    """A pipelined producer packs what waits to go to one relay into ProduceBatchReq frames
    (fewer frames than transactions), each transaction still answered on its own."""
    values = [b"batched-%d" % i for i in range(1_000)]
    with Producer(topology=mesh3.path, window=1_000) as p:
        seqs = p.send_many("orders", values)
        stats = dict(p.stats)
    assert len(set(seqs)) == len(values) and stats["committed"] == len(values)
    assert stats["batches"] >= 1 and stats["frames"] < len(values) // 10, stats
    counters = [mesh3.status(r)["node"]["counters"] for r in (1, 2, 3)]
    assert sum(c.get("produce_batches", 0) for c in counters) >= stats["batches"]
    assert sum(c.get("produce_batch_answers", 0) for c in counters) >= 1
    assert sum(c.get("client_frames", 0) for c in counters) < len(values) // 10
    with Consumer([mesh3.endpoint(2)], count=len(values), timeout_s=10) as c:
        records = list(c.subscribe("orders"))
    assert [r.seq for r in records] == sorted(seqs)
    assert {r.seq: r.value for r in records} == dict(zip(seqs, values, strict=True))


@pytest.mark.parametrize("runner", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_async_flavours(mesh3: Mesh, runner: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    # On uvloop too: compiled, the clients' sockets once expected asyncio's return types
    # from the loop (remove_reader), and closing failed there.
    async def scenario() -> None:
        async with AsyncProducer(topology=mesh3.path, window=4) as p:
            first = await p.send("orders", b"first", key=b"a")
            futures = [await p.send_async("orders", b"f%d" % i) for i in range(10)]
            more = await p.send_many("orders", [b"m%d" % i for i in range(10)])
            seqs = [first, *[await f for f in futures], *more]
            assert len(set(seqs)) == 21
            async with AsyncConsumer(topology=mesh3.config, count=21, timeout_s=10) as c:
                got = [r async for r in c.subscribe("orders", "earliest")]
            assert [r.seq for r in got] == sorted(seqs)
            assert [r.producer_seq for r in got if r.seq in (first,)] == [0]

            # "latest": only what commits after the subscription.
            async with AsyncConsumer([mesh3.endpoint(3)], count=3, timeout_s=10, wait_ms=200) as c:
                c.subscribe("orders", "latest")

                async def consume() -> list[Record]:
                    return [r async for r in c]

                task = asyncio.create_task(consume())
                # The first read learns the committed point; only then is "latest" fixed.
                await wait_until_async(
                    lambda: c.position is not None or task.done(),
                    "the consumer's first read",
                )
                assert not task.done(), task
                new = await p.send_many("orders", [b"n0", b"n1", b"n2"])
                tail = await task
            assert [r.seq for r in tail] == new
            assert [r.value for r in tail] == [b"n0", b"n1", b"n2"]

    runner(scenario())


def test_idempotent_retry_commits_once(mesh3: Mesh) -> None:
    dead = dead_endpoint()
    # The first relay is unreachable: the producer moves on and commits once.
    with Producer([dead, mesh3.endpoint(1)], connect_grace_s=0.1) as p:
        seq = p.send("orders", b"once")
        assert p.stats["unreachable"] >= 1
        pid = p.producer_id
    # Resending the same producer seq (as after a crash) through another relay returns
    # the copy that was delivered.
    with Producer([mesh3.endpoint(3)], producer_id=pid, first_producer_seq=0) as again:
        assert again.send("orders", b"once") == seq
        assert again.next_producer_seq == 1
        later = again.send("orders", b"twice")
    with Consumer([mesh3.endpoint(2)], timeout_s=1, wait_ms=200) as c:
        mine = [r for r in c.subscribe("orders") if r.producer_id == pid]
    assert [(r.seq, r.value, r.producer_seq) for r in mine] == [
        (seq, b"once", 0),
        (later, b"twice", 1),
    ]


def test_consumer_resumes_on_another_relay(mesh3: Mesh) -> None:
    relays = [mesh3.endpoint(r) for r in (1, 2, 3)]
    with Producer([mesh3.endpoint(2), mesh3.endpoint(3)]) as p:
        seqs = p.send_many("orders", [b"a%d" % i for i in range(10)])
        with Consumer(relays, max_batch=3, wait_ms=200, timeout_s=10) as c:
            c.subscribe("orders")
            got = [next(c) for _ in range(5)]
            assert c.endpoint == relays[0]
            mesh3.stop(1)
            seqs += p.send_many("orders", [b"b%d" % i for i in range(10)])
            got += [next(c) for _ in range(15)]
            assert c.endpoint in relays[1:]
            assert c.stats["failovers"] >= 1
            assert [r.seq for r in got] == seqs == sorted(seqs)
            # Nothing more (no duplicate) arrives.
            c._timeout_s = 0.5
            assert list(c) == []


def test_redirect_from_a_relay_outside_the_stream(tmp_path: Path) -> None:
    streams = {0: ["x"], 1: ["x"], 2: ["x"], 3: ["y"]}
    with running_mesh(tmp_path, streams, "x") as mesh:
        # Produce through the relay outside x's set: it forwards to a member.
        with Producer([mesh.endpoint(3)]) as p:
            forwarded = p.send("x", b"via-3")
        with Producer(topology=mesh.path) as p:
            direct = p.send("x", b"direct")
        # Relay 3 answers redirect (0, 1, 2); relay 2 is not in this client's map, and
        # the redirect is followed to 0 although 1 comes next in the given order.
        relays = {3: mesh.endpoint(3), 1: mesh.endpoint(1), 0: mesh.endpoint(0)}
        with Consumer(relays, count=2, timeout_s=10) as c:
            got = [r.value for r in c.subscribe("x")]
            assert c.stats["redirect"] == 1
            assert c.endpoint == mesh.endpoint(0)
        assert sorted(got) == [b"direct", b"via-3"]
        assert forwarded != direct


def test_async_links_find_an_answer_whose_signal_a_send_took_in() -> None:
    """The asyncio links read a socket's ZMQ_EVENTS only when its descriptor signalled,
    it was drained, or it was sent on (relay.sockets.ReadableWaiter). The last case: a
    send takes in the socket's pending commands (libzmq does so at most about once a
    millisecond), among them the one behind an answer's signal, and the descriptor stays
    quiet for that answer. Here a ZMQ_EVENTS read in the test takes the signal in, every
    time; a wait that did not look at the socket sent on would wait forever (`wait_for`
    fails the test)."""
    from relay.client import _AsyncLinks

    class Recorder:
        def __init__(self) -> None:
            self.frames: list[bytes] = []

        def on_frame(self, endpoint: str, frame: bytes, now: float) -> None:
            self.frames.append(frame)

        def on_disconnect(self, endpoint: str, now: float) -> None:
            raise AssertionError(f"{endpoint} disconnected")

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            if router.poll(10):
                router.send_multipart(router.recv_multipart())

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()

    async def scenario() -> None:
        links = _AsyncLinks([endpoint], None)
        engine = Recorder()
        sock = links._by_endpoint[endpoint]
        fd = int(sock.getsockopt(zmq.FD))
        try:
            await wait_until_async(functools.partial(links.send, endpoint, b"-"), "a link")
            while not engine.frames:  # connected, and the first answer taken
                await asyncio.wait_for(links.wait(engine, None), 30)
            engine.frames.clear()
            for round_ in range(20):
                await asyncio.wait_for(links.wait(engine, 0), 30)  # a look: none left to do
                assert links.send(endpoint, b"%d" % round_)
                # The answer makes the descriptor signal; the test takes the signal in.
                assert select.select([fd], [], [], 30)[0], "no signal for the answer"
                sock.get(zmq.EVENTS)
                while len(engine.frames) <= round_:
                    await asyncio.wait_for(links.wait(engine, None), 30)
            assert engine.frames == [b"%d" % r for r in range(20)]
        finally:
            links.close()

    try:
        asyncio.run(scenario())
    finally:
        stop.set()
        thread.join(5)
        router.close(0)
        ctx.term()


def test_out_of_range_waits_for_a_fenced_relay_that_may_hold_the_position() -> None:
    """One relay's history starts after the position; the other answers `fenced` for many
    rounds (a relay of the stream waiting for its quorum, as while a change of the
    stream's relays goes on), then serves it: the consumer waits for it rather than
    raising OutOfRange, and reads every record (engines.OUT_OF_RANGE_WAIT_S)."""
    entries = [(s, None, b"v%d" % s, b"p", s, 0) for s in (60, 70, 80)]
    fenced_for = 8  # rounds: more than a few failovers
    holder_answers = read_answer(ReadStatus.OK, oldest=50, entries=entries)

    def holder(msg: wire.ClientMessage) -> wire.ClientMessage | None:
        assert isinstance(msg, wire.ReadReq)
        if len(held.requests) <= fenced_for:
            return wire.ReadResp(msg.request_id, ReadStatus.FENCED, (), (), -1, -1)
        return holder_answers(msg)

    with (
        FakeRelay(read_answer(ReadStatus.OUT_OF_RANGE, oldest=100)) as young,
        FakeRelay(holder) as held,
        Consumer([young.endpoint, held.endpoint], timeout_s=30).subscribe("s", 10) as c,
    ):
        assert [r.seq for r in itertools.islice(c, 3)] == [60, 70, 80]
        assert c.stats["out_of_range"] > 1 and c.stats["fenced"] >= fenced_for, c.stats
