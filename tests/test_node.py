"""The relay process (relay/node.py) and its client protocol (relay/wire.py).

Three RelayNodes run in one asyncio loop on 127.0.0.1 with free ports; clients are DEALER
sockets speaking relay.wire. Every test stops every node it starts, even when it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from relay import wire
from relay.core import Limits, codec
from relay.core.messages import Outcome, ReadStatus
from relay.core.shell import Outgoing
from relay.errors import FrameError
from relay.launcher import resubscribe, write_loopback_topology
from relay.node import (
    GC_FULL_COLLECT_MS,
    TOPIC_MAX_BYTES,
    RelayNode,
    mono_ms,
    subscription_prefix,
)
from relay.topology import MeshConfig, load
from waiting import wait_until_async

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
MAX_TX = 4_096
MAX_FRAME = 1 << 20
ANSWER_TIMEOUT_S = 30.0  # for an answer that is due now; a failure bound, not a speed check
PARKED_WAIT_MS = 120_000  # a parked read's wait: far beyond ANSWER_TIMEOUT_S


def write_topology(
    tmp_path: Path, streams: dict[int, list[str]], limits: dict[str, int] | None = None
) -> Path:
    defaults = {"max_tx_bytes": MAX_TX, "max_frame_bytes": MAX_FRAME, "max_batch_bytes": 262144}
    return write_loopback_topology(tmp_path, streams, (), {**defaults, **(limits or {})})


class Client:
    """A DEALER speaking relay.wire to one relay; one request at a time."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.ctx, self.endpoint = ctx, endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._ids = random.randrange(1 << 40)

    def another(self) -> Client:
        """A second connection to the same relay (close it with `close`)."""
        return Client(self.ctx, self.endpoint)

    def close(self) -> None:
        self.sock.close(linger=0)

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    async def send_raw(self, *frames: bytes) -> None:
        await self.sock.send_multipart(list(frames))

    async def recv(self, timeout: float = 5.0) -> wire.ClientMessage:
        frame = await asyncio.wait_for(self.sock.recv(), timeout)
        return wire.decode(frame, MAX_FRAME)

    async def call(self, msg: Any, timeout: float = 5.0) -> Any:
        await self.send_raw(wire.encode(msg))
        resp = await self.recv(timeout)
        assert resp.request_id == msg.request_id, (msg, resp)
        return resp

    async def status(self) -> dict[str, Any]:
        resp = await self.call(wire.StatusReq(self.next_id()))
        assert isinstance(resp, wire.StatusResp)
        status: dict[str, Any] = json.loads(resp.status_json)
        return status

    async def produce(self, stream: str, pid: bytes, pseq: int, value: bytes) -> Any:
        req = wire.ProduceReq(self.next_id(), stream, pid, pseq, b"k%d" % pseq, value)
        return await self.call(req)

    async def read(self, stream: str, after: int = -1, n: int = 1_000, wait_ms: int = 0) -> Any:
        timeout = 5.0 + wait_ms / 1_000
        return await self.call(wire.ReadReq(self.next_id(), stream, after, n, wait_ms), timeout)


@contextlib.asynccontextmanager
async def mesh(
    tmp_path: Path,
    streams: dict[int, list[str]],
    start: tuple[int, ...] | None = None,
    limits: dict[str, int] | None = None,
) -> AsyncIterator[tuple[MeshConfig, dict[int, RelayNode], dict[int, Client]]]:
    """Start the relays `start` (default: all) of a mesh serving `streams`."""
    config = load(write_topology(tmp_path, streams, limits))
    started = config.relays if start is None else start
    nodes = {r: RelayNode(config, r, handle_signals=False) for r in started}
    ctx = zmq.asyncio.Context()
    tasks: list[asyncio.Task[None]] = []
    try:
        tasks = [asyncio.create_task(node.run()) for node in nodes.values()]
        clients = {r: Client(ctx, config.relays[r].client_endpoint) for r in nodes}
        yield config, nodes, clients
        for task in tasks:
            assert not task.done(), f"a node stopped early: {task}"
    finally:
        for node in nodes.values():
            node.stop()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=5)
            assert not pending, "a node did not stop within 5 s"
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        ctx.destroy(linger=0)


async def wait_joined(clients: dict[int, Client], stream: str) -> None:
    for client in clients.values():
        await wait_serving(client, stream)


async def wait_serving(client: Client, stream: str) -> None:
    """Wait until the client's relay has joined `stream` and is not fenced."""
    info: dict[str, Any] = {}

    async def serving() -> bool:
        nonlocal info
        info = (await client.status())["streams"].get(stream, {})
        return bool(info.get("joined") and not info.get("fenced"))

    await wait_until_async(
        serving,
        lambda: f"{stream} joined and unfenced on {client.endpoint} (last: {info})",
        poll_s=0.02,
    )


async def produce_until_definite(
    client: Client, stream: str, pid: bytes, pseq: int, value: bytes
) -> Any:
    """Retry fenced/unknown with the same producer seq (always safe) until definite."""
    last: Any = None

    async def definite() -> Any:
        nonlocal last
        last = await client.produce(stream, pid, pseq, value)
        return last if last.outcome in (Outcome.COMMITTED, Outcome.REJECTED) else None

    return await wait_until_async(
        definite, lambda: f"a definite answer to {stream}/{pseq} (last: {last})", poll_s=0.05
    )


async def read_all(client: Client, stream: str, count: int) -> list[Any]:
    entries: list[Any] = []
    resp: Any = None

    async def got_all() -> bool:
        nonlocal resp
        after = entries[-1][0] if entries else -1
        resp = await client.read(stream, after, 1_000, wait_ms=200)
        if resp.status is ReadStatus.OK:
            entries.extend(resp.entries)
        return len(entries) >= count

    await wait_until_async(
        got_all,
        lambda: f"{count} entries of {stream} (got {len(entries)}; last answer {resp})",
        poll_s=0,
    )
    return entries


MESH = {1: ["orders", "logs.*"], 2: ["orders", "logs.*"], 3: ["orders"]}


# --- wire --------------------------------------------------------------------------------


def test_subscription_prefixes() -> None:
    assert subscription_prefix("orders") == b"S|orders|"
    assert subscription_prefix("orders.*") == b"S|orders."
    assert subscription_prefix("a?b[xy]") == b"S|a"
    assert subscription_prefix("*") == b"S|"


def test_wire_round_trip_and_garbage() -> None:
    messages: list[wire.ClientMessage] = [
        wire.ProduceReq(1, "orders", b"p", 2**64 - 1, None, b""),
        wire.ProduceReq(2, "o.é", b"p" * 64, 0, b"key", b"v" * 100, 255),
        wire.ProduceResp(3, Outcome.COMMITTED, 12345, "", ()),
        wire.ProduceResp(4, Outcome.FENCED, -1, "", (1, 2)),
        wire.ReadReq(5, "orders", -1, 10, 0),
        wire.ReadResp(
            6, ReadStatus.OK, ((7, None, b"v", b"p", 1, 0), (8, b"k", b"", b"q", 2, 1)), (), 0, 8
        ),
        wire.ReadResp(7, ReadStatus.REDIRECT, (), (2, 3), -1, -1),
        wire.StatusReq(8),
        wire.StatusResp(9, b"{}"),
        wire.ErrorResp(-1, "MalformedFrame", "bad"),
        wire.ReloadReq(10),
        wire.ReloadResp(11, True, "orders: relays [0, 1] -> [0, 1, 2]", b"d" * 32),
        wire.ReloadResp(12, False, "cannot read the topology", b""),
    ]
    for msg in messages:
        frame = wire.encode(msg)
        assert wire.decode(frame, 1 << 20) == msg
        assert wire.peek_request_id(frame) == max(msg.request_id, -1)
    bad = [
        b"",
        b"\xc1",
        msgpack.packb([1, 1, "a|b", b"p", 0, None, b"", 0]),  # '|' in a stream name
        msgpack.packb([1, 1, "s", b"", 0, None, b"", 0]),  # empty producer id
        msgpack.packb([1, 1, "s", b"p", -1, None, b"", 0]),  # negative producer seq
        msgpack.packb([1, 1, "s", b"p", 0, "str", b"", 0]),  # key not bin
        msgpack.packb([1, 1, "s", b"p", 0, None, b"", 256]),  # kind above 255
        msgpack.packb([1, 1, "s", b"p", 0, None, b""]),  # no kind
        msgpack.packb([4, 1, "ok", [[7, None, b"v", b"p", 1, -1]], [], 0, 8]),  # kind < 0
        msgpack.packb([3, 1, "s", -2, 1, 0]),  # after_seq < -1
        msgpack.packb([3, 1, "s", -1, 0, 0]),  # max_entries 0
        msgpack.packb([3, 1, "s", -1, 1, 10**9]),  # wait_ms too long
        msgpack.packb([5, 1, 2]),  # wrong length
        msgpack.packb([99, 1]),  # unknown type
        msgpack.packb([15, 1, 1, "w", b""]),  # taken not a bool
        msgpack.packb([15, 1, True, "w", b"short"]),  # a digest of neither 0 nor 32 bytes
        msgpack.packb({"a": 1}),
        msgpack.packb([5, 1]) + b"\x00",  # trailing data
    ]
    for frame in bad:
        with pytest.raises(FrameError):
            wire.decode(frame, 1 << 20)
    with pytest.raises(FrameError):
        wire.decode(b"\x00" * 11, 10)
    rng = random.Random(7)
    valid = [wire.encode(m) for m in messages]
    for _ in range(3_000):
        mutated = bytearray(rng.choice(valid))
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        if rng.random() < 0.3:
            mutated = mutated[: rng.randrange(len(mutated) + 1)]
        with contextlib.suppress(FrameError):
            wire.decode(bytes(mutated), 1 << 20)
        wire.peek_request_id(bytes(mutated))


def test_wire_produce_batches() -> None:
    req = wire.ProduceBatchReq(
        1, b"p", ((10, "orders", 0, None, b"a", 0), (11, "o.é", 2**64 - 1, b"k", b"", 1))
    )
    resp = wire.ProduceBatchResp(
        -1,
        (
            (10, Outcome.COMMITTED, 5, "", ()),
            (11, Outcome.FENCED, -1, "", (1, 2)),
            (12, Outcome.REJECTED, -1, "late", ()),
        ),
    )
    for msg in (req, resp):
        assert wire.decode(wire.encode(msg), 1 << 20) == msg
    assert wire.peek_request_id(wire.encode(req)) == 1

    item = [10, "orders", 0, None, b"a", 0]

    def batch(*items: Any) -> bytes:
        frame: bytes = msgpack.packb([8, 1, b"p", list(items)])
        return frame

    problems = {
        batch(): "ProduceBatchReq.items: expected 1..65536 items",
        batch(item, [11, "a|b", 0, None, b"", 0]): "ProduceBatchReq.items[1].stream: expected",
        batch(item, [11, "orders", -1, None, b"", 0]): "ProduceBatchReq.items[1].producer_seq",
        batch(item, [11, "orders", 0, "key", b"", 0]): "ProduceBatchReq.items[1].key",
        batch(item, [11, "orders", 0, None, None, 0]): "ProduceBatchReq.items[1].value",
        batch(item, [11, "orders", 0, None, b"", 300]): "ProduceBatchReq.items[1].kind",
        batch(item, [2**63, "orders", 0, None, b"", 0]): "ProduceBatchReq.items[1].item_id",
        batch([11, "orders", 0, None, b""]): "ProduceBatchReq.items[0]: expected an array of 6",
        msgpack.packb([8, 1, b"", [item]]): "ProduceBatchReq.producer_id",
        msgpack.packb([8, 1, b"p", item]): "ProduceBatchReq.items[0]: expected an array",
        msgpack.packb([9, 3, [[1, "committed", 5, "", []]]]): "ProduceBatchResp.request_id",
        msgpack.packb([9, -1, [[1, "maybe", 5, "", []]]]): "ProduceBatchResp.results[0].outcome",
        msgpack.packb([9, -1, [[1, "fenced", -1, "", [5000]]]]): "results[0].redirect[0]",
        msgpack.packb([9, -1, [[1, "committed", -2, "", []]]]): "results[0].seq",
    }
    for frame, problem in problems.items():
        with pytest.raises(FrameError, match=re.escape(problem)):
            wire.decode(frame, 1 << 20)
    # A relay bounds the items of a batch by its limits.max_batch_entries.
    three = batch(item, item, item)
    assert len(wire.decode(three, 1 << 20, max_batch_items=3).items) == 3  # type: ignore[union-attr]
    with pytest.raises(FrameError, match=re.escape("ProduceBatchReq.items: expected 1..2 items")):
        wire.decode(three, 1 << 20, max_batch_items=2)

    # batch_item_bytes bounds what each item adds, whatever the ints and lengths are.
    rng = random.Random(3)
    for _ in range(200):
        items = tuple(
            (
                rng.choice((0, 2**63 - 1)),
                rng.choice(("s", "é" * 100, "x" * 255)),
                rng.choice((0, 2**64 - 1)),
                rng.choice((None, b"", b"k" * 300)),
                b"v" * rng.choice((0, 31, 32, 255, 256, 70_000)),
                rng.choice((0, 255)),
            )
            for _ in range(rng.randint(1, 20))
        )
        frame = wire.encode(wire.ProduceBatchReq(2**63 - 1, b"p" * 64, items))
        bound = wire.BATCH_FRAME_OVERHEAD_BYTES + sum(
            wire.batch_item_bytes(stream, key, value) for _, stream, _, key, value, _ in items
        )
        assert len(frame) <= bound


def test_wire_fast_path_agrees_with_the_validators() -> None:
    """Produces, their answers, reads and read answers are decoded in C (msgspec) first:
    whatever the bytes, the answer (message, or error type and text) is the validators'
    alone."""

    def outcome(frame: bytes, decode: Any) -> object:
        try:
            return decode(frame)
        except FrameError as e:
            return (type(e), str(e))

    def reference(frame: bytes) -> Any:
        return codec.decode_with(frame, 1 << 20, wire._DECODERS, "client message")

    valid: list[wire.ClientMessage] = [
        wire.ProduceReq(1, "orders", b"p", 0, None, b"v"),
        wire.ProduceReq(2**63 - 1, "o.é", b"q" * 64, 2**64 - 1, b"k", b"", 255),
        wire.ProduceResp(3, Outcome.COMMITTED, 2**63 - 1),
        wire.ProduceResp(4, Outcome.FENCED, -1, "x" * 4096, (0, 1023)),
        wire.ReadReq(5, "orders"),
        wire.ReadReq(6, "o.é", 2**63 - 1, 65_536, 600_000),
        wire.ReadResp(
            6, ReadStatus.OK, ((7, None, b"v", b"p", 1, 0), (8, b"k", b"", b"q" * 64, 2, 255))
        ),
        wire.ReadResp(7, ReadStatus.REDIRECT, (), (2, 1023), -1, -1),
        wire.ProduceBatchReq(
            1, b"p", ((10, "orders", 0, None, b"a", 0), (11, "o.é", 2**64 - 1, b"k", b"", 1))
        ),
        wire.ProduceBatchResp(
            -1, ((10, Outcome.COMMITTED, 5, "", ()), (11, Outcome.FENCED, -1, "x" * 4096, (1,)))
        ),
    ]
    leaves: list[Any] = [None, True, -1, -2, 0, 256, 1024, 2**63, 2**64 - 1, 1.5, "", "a|b"]
    leaves += [b"", b"p" * 65, "x" * 4097, "committed", "ok", [], [1], {"a": 1}]
    rng = random.Random(11)
    for _ in range(4_000):
        msg = rng.choice(valid)
        frame = wire.encode(msg)
        quick = wire._FAST_DECODERS[wire.TYPE_CODES[type(msg)]]
        assert quick.build(quick.decoder.decode(frame)) == msg  # valid frames take it
        if rng.random() < 0.5:
            mutated = bytearray(frame)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            frame = bytes(mutated)
        else:  # one value anywhere in the tree replaced
            tree = msgpack.unpackb(frame, raw=False)
            node = tree
            while True:
                i = rng.randrange(1, len(node)) if node is tree else rng.randrange(len(node))
                if type(node[i]) is list and node[i] and rng.random() < 0.6:
                    node = node[i]
                    continue
                node[i] = rng.choice(leaves)
                break
            frame = msgpack.packb(tree)
        fast = outcome(frame, lambda f: wire.decode(f, 1 << 20))
        assert fast == outcome(frame, reference), frame


# --- three relays --------------------------------------------------------------------------


def test_produce_everywhere_read_anywhere(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with mesh(tmp_path, MESH) as (_, nodes, clients):
            await wait_joined(clients, "orders")
            # Produce through every relay, all in flight at once.
            sent: dict[int, tuple[int, int]] = {}  # request id -> (relay, pseq)
            for pseq in range(12):
                relay = pseq % 3 + 1
                client = clients[relay]
                req = wire.ProduceReq(
                    client.next_id(), "orders", b"prod", pseq, b"k%d" % pseq, b"value-%d" % pseq
                )
                sent[req.request_id] = (relay, pseq)
                await client.send_raw(wire.encode(req))
            committed: dict[int, int] = {}  # pseq -> seq
            for relay, client in clients.items():
                for _ in range(4):
                    resp = await client.recv(10)
                    assert isinstance(resp, wire.ProduceResp)
                    assert resp.outcome is Outcome.COMMITTED, resp
                    assert sent[resp.request_id][0] == relay
                    committed[sent[resp.request_id][1]] = resp.seq
            assert len(set(committed.values())) == 12

            # Every relay (including ones that coordinated none of them) delivers the
            # same committed timeline, in the same order.
            timelines = {r: await read_all(c, "orders", 12) for r, c in clients.items()}
            expected = sorted(
                (seq, b"k%d" % p, b"value-%d" % p, b"prod", p, 0) for p, seq in committed.items()
            )
            for relay, entries in timelines.items():
                assert entries == expected, relay

            # A retry with the same producer seq, on another relay, is not a new copy.
            again = await clients[3].produce("orders", b"prod", 0, b"value-0")
            assert (again.outcome, again.seq) == (Outcome.COMMITTED, committed[0])

            # Long poll: a read past the end waits until the next commit arrives.
            last = expected[-1][0]
            waiter = clients[2].another()
            try:
                read_id = waiter.next_id()
                # Waits far longer than the answer may take, so only the commit answers it.
                parked = wire.ReadReq(read_id, "orders", last, 10, PARKED_WAIT_MS)
                await waiter.send_raw(wire.encode(parked))

                async def parked_on_relay_2() -> bool:
                    return bool((await clients[2].status())["node"]["parked_reads"] >= 1)

                await wait_until_async(parked_on_relay_2, "relay 2 to park the read")
                assert not await waiter.sock.poll(0), "the read should be parked"
                new = await clients[1].produce("orders", b"prod", 100, b"late-comer")
                assert new.outcome is Outcome.COMMITTED
                resp = await waiter.recv(ANSWER_TIMEOUT_S)
                assert isinstance(resp, wire.ReadResp) and resp.request_id == read_id
                assert resp.status is ReadStatus.OK
                assert [e[0] for e in resp.entries] == [new.seq]
                assert resp.committed >= new.seq
                # A parked read with nothing new answers empty when its wait is over.
                empty = await waiter.read("orders", new.seq, 10, wait_ms=100)
                assert empty.status is ReadStatus.OK and empty.entries == ()
            finally:
                waiter.close()

            # A produce through a relay outside the stream's set is forwarded to a member.
            fwd = await produce_until_definite(clients[3], "logs.app", b"logger", 1, b"hello")
            assert fwd.outcome is Outcome.COMMITTED, fwd
            entries = await read_all(clients[2], "logs.app", 1)
            assert entries == [(fwd.seq, b"k1", b"hello", b"logger", 1, 0)]

            for node in nodes.values():
                assert node.counters["client_frame_invalid"] == 0
                assert node.counters["peer_frame_core_error"] == 0

    asyncio.run(scenario())


def test_bad_client_frames_redirect_and_limits(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with mesh(tmp_path, MESH) as (_, nodes, clients):
            await wait_joined(clients, "orders")
            c = clients[1]

            async def expect_error(error: str, request_id: int, *frames: bytes) -> None:
                await c.send_raw(*frames)
                resp = await c.recv()
                assert isinstance(resp, wire.ErrorResp), resp
                assert (resp.error, resp.request_id) == (error, request_id), resp

            await expect_error("MalformedFrame", -1, b"\xc1 not msgpack")
            await expect_error(
                "FieldError", 42, msgpack.packb([1, 42, "orders", b"", 0, None, b"x", 0])
            )
            await expect_error("UnknownMessageType", 5, msgpack.packb([99, 5]))
            await expect_error("MalformedFrame", -1, b"a", b"b")  # two frames
            await expect_error("MalformedFrame", 9, wire.encode(wire.StatusResp(9, b"{}")))
            # Above the request limit (max_tx_bytes + overhead): refused with its id.
            big = wire.ProduceReq(77, "orders", b"p", 1, None, b"x" * (2 * MAX_TX))
            await expect_error("OversizedFrame", 77, wire.encode(big))

            # Within the frame limit but a transaction above max_tx_bytes: rejected.
            resp = await c.produce("orders", b"p", 2, b"x" * (MAX_TX + 100))
            assert (resp.outcome, resp.reason) == (Outcome.REJECTED, "too_large")

            # Above max_frame_bytes the transport drops the connection; the relay lives on.
            rogue = c.another()
            monitor = rogue.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            try:
                await rogue.send_raw(b"\x00" * (MAX_FRAME + 10))
                event = await asyncio.wait_for(monitor.recv_multipart(), ANSWER_TIMEOUT_S)
                assert parse_monitor_message(event)["event"] == zmq.EVENT_DISCONNECTED, event
            finally:
                rogue.sock.disable_monitor()
                monitor.close(linger=0)
                rogue.close()

            # The relay still works after all that.
            ok = await c.produce("orders", b"p", 3, b"fine")
            assert ok.outcome is Outcome.COMMITTED, ok

            # A read on a stream the relay does not serve answers redirect.
            redirect = await clients[3].read("logs.app")
            assert redirect.status is ReadStatus.REDIRECT
            assert redirect.redirect == (1, 2)
            unknown = await c.read("nobody.serves.this")
            assert unknown.status is ReadStatus.UNKNOWN_STREAM
            nope = await c.produce("nobody.serves.this", b"p", 1, b"x")
            assert (nope.outcome, nope.reason) == (Outcome.REJECTED, "unknown_stream")

            counters = (await c.status())["node"]["counters"]
            assert counters["client_frame_invalid"] == 6
            assert counters["client_frame_oversized"] == 1
            assert counters["client_unknown_stream"] == 2
            assert nodes[3].counters["read_redirect"] == 1

    asyncio.run(scenario())


def test_a_batch_of_produces_is_answered_per_item(tmp_path: Path) -> None:
    """Each item of a ProduceBatchReq is produced on its own and gets its own result; a
    batch the relay refuses changes nothing."""
    max_items = 8

    async def results_of(c: Client, batch: wire.ProduceBatchReq) -> dict[int, Any]:
        await c.send_raw(wire.encode(batch))
        results: dict[int, Any] = {}
        while len(results) < len(batch.items):
            resp = await c.recv()
            assert isinstance(resp, wire.ProduceBatchResp) and resp.request_id == -1, resp
            for item_id, outcome, seq, reason, redirect in resp.results:
                assert item_id not in results
                results[item_id] = (outcome, seq, reason, redirect)
        return results

    async def scenario() -> None:
        limits = {"max_batch_entries": max_items}
        async with mesh(tmp_path, MESH, limits=limits) as (_, nodes, clients):
            await wait_joined(clients, "orders")
            c = clients[1]
            items = (
                (101, "orders", 0, b"k0", b"first", 0),
                (102, "nobody.serves.this", 0, None, b"x", 0),
                (103, "orders", 1, None, b"second", 1),
                (104, "orders", 2, None, b"x" * (MAX_TX + 10), 0),
            )
            batch = wire.ProduceBatchReq(7, b"batcher", items)
            results = await results_of(c, batch)
            assert results[102] == (Outcome.REJECTED, -1, "unknown_stream", ())
            assert results[104] == (Outcome.REJECTED, -1, "too_large", ())
            assert results[101][0] is results[103][0] is Outcome.COMMITTED, results
            committed = {results[101][1]: b"first", results[103][1]: b"second"}
            entries = await read_all(clients[2], "orders", 2)
            assert {seq: value for seq, _, value, _, _, _ in entries} == committed
            kinds = {seq: kind for seq, *_, kind in entries}
            assert kinds == {results[101][1]: 0, results[103][1]: 1}
            # The same producer seqs again: no duplicate, the same seqs.
            again = await results_of(c, wire.ProduceBatchReq(8, b"batcher", items[:1]))
            assert again[101] == results[101]

            # Refused whole, naming the problem, with nothing produced.
            before = (await c.status())["node"]["counters"]
            too_many = tuple(
                (200 + i, "orders", 10 + i, None, b"x", 0) for i in range(max_items + 1)
            )
            bad_item = [[300, "orders", 30, None, b"x", 0], [301, "a|b", 31, None, b"y", 0]]
            for frame, problem in (
                (wire.encode(wire.ProduceBatchReq(9, b"batcher", too_many)), "1..8 items"),
                (msgpack.packb([8, 10, b"batcher", bad_item]), "items[1].stream"),
            ):
                await c.send_raw(frame)
                resp = await c.recv()
                assert isinstance(resp, wire.ErrorResp) and resp.error == "FieldError", resp
                assert resp.request_id == wire.peek_request_id(frame) and problem in resp.message
            after = (await c.status())["node"]["counters"]
            assert after["produce_requests"] == before["produce_requests"]
            assert after["client_frame_bad_field"] == before.get("client_frame_bad_field", 0) + 2
            assert after["produce_batches"] == 2 and after["produce_batch_answers"] >= 2
            assert nodes[1].counters["produce_requests"] == 5

    asyncio.run(scenario())


def test_a_relay_owning_its_process_tends_the_garbage_collector(tmp_path: Path) -> None:
    config = load(write_topology(tmp_path, MESH))
    one_of_several = RelayNode(config, 1, handle_signals=False)
    assert not one_of_several.manage_gc
    one_of_several.close()  # its lock: one node of relay 1 at a time
    node = RelayNode(config, 1)  # as `relay run` makes it
    assert node.manage_gc
    try:
        node._tend_gc(mono_ms())  # what survived so far is frozen
        assert gc.get_freeze_count() > 0
        node._gc_full_at -= GC_FULL_COLLECT_MS
        node._tend_gc(mono_ms())  # due: thaw, collect everything once, freeze again
        assert gc.get_freeze_count() > 0
        assert mono_ms() - node._gc_full_at < GC_FULL_COLLECT_MS
    finally:
        node.close()
        gc.unfreeze()


def test_garbage_from_a_peer_is_counted_and_dropped(tmp_path: Path) -> None:
    """Relay 3's mesh endpoint is held by an impostor publishing garbage on every topic
    relays 1 and 2 subscribe to; they count it, drop it, and keep serving `duo`."""

    async def scenario() -> None:
        streams = {1: ["orders", "duo"], 2: ["orders", "duo"], 3: ["orders"]}
        async with mesh(tmp_path, streams, start=(1, 2)) as (config, nodes, clients):
            ctx = zmq.asyncio.Context()
            try:
                rogue = ctx.socket(zmq.PUB)
                rogue.setsockopt(zmq.LINGER, 0)
                rogue.bind(config.relays[3].mesh_endpoint)
                await wait_joined(clients, "duo")
                junk = [  # a mesh message is one part: its topic, then the frame
                    [b"H|\xc1"],
                    [b"H|" + msgpack.packb([4, 3, 1, 1, []]) + b"x"],
                    [b"D|1|" + msgpack.packb([10, 3, 1, 2**63, 1, "hi"])],
                    [
                        b"S|duo|"
                        + msgpack.packb([1, 3, 1, 1, "duo", 1, [[5, b"", 0, None, b"", 0]]])
                    ],
                    [b"S|orders|" + b"\x00" * 100],
                    [b"S|duo|" + b"\x92\x00\xc1"],  # a bundle that is not msgpack
                    [b"S|duo|" + msgpack.packb([0, []])],  # a bundle of nothing
                    # A bundle in a bundle: split once, the inner one is an unknown type.
                    [b"S|duo|" + msgpack.packb([0, [msgpack.packb([0, [b"x"]])]])],
                    [b"H|", b"a"],  # two parts
                    [b"H|", b"a", b"b"],  # three parts
                ]

                async def junk_counted() -> bool:
                    # Sent again each round: the relays' SUBs may not have joined yet.
                    for parts in junk:
                        await rogue.send_multipart(parts)
                    return min(n.counters["peer_bad_parts"] for n in nodes.values()) >= 10

                await wait_until_async(
                    junk_counted,
                    lambda: (
                        "every relay to count 10 bad peer frames: "
                        f"{[n.counters['peer_bad_parts'] for n in nodes.values()]}"
                    ),
                    poll_s=0.02,
                )
                # Above MAXMSGSIZE: the transport drops that link (and reconnects).
                await rogue.send(b"H|" + b"\xc1" * (MAX_FRAME + TOPIC_MAX_BYTES + 1))
                resp = await produce_until_definite(clients[1], "duo", b"p", 1, b"still here")
                assert resp.outcome is Outcome.COMMITTED, resp
                assert await read_all(clients[2], "duo", 1) == [
                    (resp.seq, b"k1", b"still here", b"p", 1, 0)
                ]
                for node in nodes.values():
                    bad = node.core.counters
                    assert bad["frame_malformed"] > 0 and bad["frame_bad_field"] > 0, bad
                    assert bad["frame_unknown_type"] > 0, bad
                    assert node.counters["peer_bad_parts"] > 0, node.counters
                    assert node.counters["peer_bad_bundle"] > 0, node.counters
                    assert node.counters["peer_frame_core_error"] == 0
            finally:
                ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_frames_of_a_turn_for_one_topic_go_as_one_bundle(tmp_path: Path) -> None:
    """What a relay publishes in one turn for one topic leaves as one ZeroMQ message, a
    bundle of the frames in order; a frame for another topic ends the bundle."""

    async def scenario() -> None:
        frame_limit = {"max_frame_bytes": 4 * codec.BUNDLE_MAX_BYTES}
        async with mesh(tmp_path, {1: ["duo"], 2: ["duo"]}, (1,), frame_limit) as (
            config,
            nodes,
            _,
        ):
            node = nodes[1]
            ctx = zmq.asyncio.Context()
            try:
                listener = ctx.socket(zmq.SUB)
                listener.setsockopt(zmq.LINGER, 0)
                listener.subscribe(b"S|duo|")
                listener.subscribe(b"D|2|")
                listener.connect(config.relays[1].mesh_endpoint)
                socks = await wait_until_async(lambda: node._sockets, "relay 1 to open its sockets")
                frames = [b"\x92\x01first", b"\x92\x01second", b"\x92\x01third"]
                alone = b"D|2|" + frames[2]
                got: list[bytes] = []

                async def one_turn_heard() -> bytes | None:
                    # As a turn does: the core's frames in order, then the held ones out.
                    node._publish(socks, Outgoing(frames[0], stream="duo"))
                    node._publish(socks, Outgoing(frames[1], stream="duo"))
                    node._publish(socks, Outgoing(frames[2], target=2))
                    node._send_held(socks)
                    # Until the relay has the listener's subscriptions, it drops them.
                    with contextlib.suppress(TimeoutError):
                        while True:
                            got.append(await asyncio.wait_for(listener.recv(), 0.2))
                    pairs = itertools.pairwise(got)
                    return next((a for a, b in pairs if b == alone and a[:6] == b"S|duo|"), None)

                bundle = await wait_until_async(
                    one_turn_heard, lambda: f"the listener to hear a turn, got {got}"
                )
                inner = bundle[len(b"S|duo|") :]
                assert codec.is_bundle(inner)
                assert codec.decode_bundle(inner, config.limits.max_frame_bytes) == frames[:2]
                assert node.counters["peer_bundles_sent"] >= 1
                # Frames that would make a bundle larger than BUNDLE_MAX_BYTES go apart,
                # whatever max_frame_bytes allows (a peer may hold a lower one).
                large = [b"\x92\x01" + bytes([i]) * (codec.BUNDLE_MAX_BYTES // 2) for i in (1, 2)]
                for frame in large:
                    node._publish(socks, Outgoing(frame, stream="duo"))
                node._send_held(socks)
                heard: list[bytes] = []
                while len(heard) < 2:
                    message = await asyncio.wait_for(listener.recv(), 30)
                    if len(message) > codec.BUNDLE_MAX_BYTES // 2:
                        heard.append(message[len(b"S|duo|") :])
                assert heard == large
            finally:
                ctx.destroy(linger=0)

    asyncio.run(scenario())


@contextlib.contextmanager
def relay_process(path: Path, relay_id: int) -> Iterator[subprocess.Popen[bytes]]:
    """`relay run` of one relay of the topology at `path` (output piped), killed at the end
    if it still runs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "run", "--config", str(path), "--relay", str(relay_id)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def serving_then(endpoint: str, stream: str, then: Any = None) -> None:
    """Wait until the relay at `endpoint` serves `stream`, then await `then(client)`."""

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        try:
            client = Client(ctx, endpoint)
            await wait_joined({1: client}, stream)
            if then is not None:
                await then(client)
        finally:
            ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_sigterm_stops_a_relay_process(tmp_path: Path) -> None:
    path = write_topology(tmp_path, {1: ["solo"]})
    config = load(path)

    async def commit_one(client: Client) -> None:
        resp = await client.produce("solo", b"p", 1, b"alone")
        assert resp.outcome is Outcome.COMMITTED, resp

    with relay_process(path, 1) as proc:
        serving_then(config.relays[1].client_endpoint, "solo", commit_one)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=5)
        assert proc.returncode == 0, out
        assert b"stopped" in out, out


# --- sleeping while idle ---------------------------------------------------------------

SLEEPY = {"heartbeat_interval_ms": 60_000, "suspect_timeout_ms": 120_000}  # far beyond a test


def test_an_idle_relay_sleeps_until_its_next_deadline(tmp_path: Path) -> None:
    """With a heartbeat a minute away and nobody else in the mesh, an idle relay turns only
    for what happens: the parked read's own deadline wakes it (the service's
    next_deadline_ms), and a stop ends its wait at once."""

    async def scenario() -> None:
        async with mesh(tmp_path, {1: ["solo"]}, limits=SLEEPY) as (_, nodes, clients):
            await wait_joined(clients, "solo")
            before = nodes[1].counters["loop_turns"]
            resp = await clients[1].read("solo", -1, 10, wait_ms=300)
            assert resp.status is ReadStatus.OK and resp.entries == ()
            # The request, the read's deadline, maybe a status poll in flight; a relay
            # polling every millisecond would have turned about 300 times.
            assert nodes[1].counters["loop_turns"] - before <= 10, nodes[1].counters

    asyncio.run(scenario())


def test_sigterm_ends_a_long_sleep_of_a_relay_process(tmp_path: Path) -> None:
    """`relay run` waits in zmq_poll up to the next heartbeat (a minute here): SIGTERM still
    ends the wait and the process, far sooner than the heartbeat would."""
    path = write_topology(tmp_path, {1: ["solo"]}, SLEEPY)
    with relay_process(path, 1) as proc:
        serving_then(load(path).relays[1].client_endpoint, "solo")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)  # bounded well below the 60 s heartbeat
        assert proc.returncode == 0, out
        assert b"received SIGTERM" in out and b"stopped" in out, out


def test_a_stream_served_by_its_acceptor_record_alone_is_subscribed_to(tmp_path: Path) -> None:
    """Relay 2 served `duo` with relay 1: its acceptor record keeps the stream's
    configuration (docs/protocol.md 5.15). Restarted onto a topology file that names
    relays 1 and 3 for duo, it still serves duo under that configuration, so its mesh
    sockets take duo's frames from every peer: a PUB bound at relay 3's endpoint (relay 3
    does not run) that publishes on duo's topic reaches it."""
    streams = {1: ["duo"], 2: ["duo"], 3: ["solo"]}

    async def established() -> None:
        async with mesh(tmp_path, streams, start=(1, 2)) as (_, _, clients):
            await wait_joined(clients, "duo")
            resp = await produce_until_definite(clients[1], "duo", b"p", 1, b"one")
            assert resp.outcome is Outcome.COMMITTED, resp

    asyncio.run(established())
    path = tmp_path / "topology.yaml"
    resubscribe(path, {2: ["solo"], 3: ["duo", "solo"]})
    config = load(path)
    assert 2 not in config.members("duo")

    async def restarted() -> None:
        node = RelayNode(config, 2, handle_signals=False)
        assert node.core.recorded_streams() == ["duo"]
        task = asyncio.create_task(node.run())
        ctx = zmq.asyncio.Context()
        try:
            rogue = ctx.socket(zmq.PUB)
            rogue.setsockopt(zmq.LINGER, 0)
            rogue.bind(config.relays[3].mesh_endpoint)

            async def taken() -> bool:
                # Sent again each round: relay 2's SUB may not have connected yet.
                await rogue.send(b"S|duo|" + b"\x00" * 100)
                return node.counters["peer_frames"] > 0

            await wait_until_async(taken, "relay 2 to take a frame on duo's topic", poll_s=0.02)
            assert node.core.counters["frame_malformed"] > 0, node.core.counters
        finally:
            node.stop()
            await asyncio.wait_for(task, ANSWER_TIMEOUT_S)
            ctx.destroy(linger=0)

    asyncio.run(restarted())


# --- reading the topology file again (SIGHUP) ---------------------------------------------


def test_a_reload_is_refused_by_name_unless_a_running_relay_can_take_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`RelayNode.reload` (SIGHUP): a file that does not parse, or that changes what only a
    restart applies (the heartbeat interval here), is refused with a line naming why, and
    the relay runs on as before; a file that names a new stream for the relay is taken,
    and the relay opens and serves it."""
    import yaml  # type: ignore[import-untyped, unused-ignore]

    async def scenario() -> None:
        async with mesh(tmp_path, {1: ["solo"], 2: ["solo"]}) as (config, nodes, clients):
            await wait_joined(clients, "solo")
            path = config.path
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))

            path.write_text("relays: [\n", encoding="utf-8")
            assert nodes[1].reload() is None
            limits = {**doc, "limits": {**doc.get("limits", {}), "heartbeat_interval_ms": 30}}
            path.write_text(yaml.safe_dump(limits, sort_keys=False), encoding="utf-8")
            assert nodes[1].reload() is None
            assert nodes[1].counters["topology_reload_refused"] == 2, nodes[1].counters
            refused = [r.getMessage() for r in caplog.records if "reload refused" in r.getMessage()]
            assert len(refused) == 2, refused
            assert "limits.heartbeat_interval_ms changes (the mesh links'" in refused[1], refused
            assert nodes[1].config is config  # nothing changed
            resp = await produce_until_definite(clients[1], "solo", b"p", 1, b"still")
            assert resp.outcome is Outcome.COMMITTED, resp

            for relay in doc["relays"]:
                relay["streams"] = [*relay["streams"], "duo"]
            path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
            for node in nodes.values():
                change = node.reload()
                assert change is not None and "duo" in change.streams, change
                assert change.streams["duo"] == ((), (1, 2)), change
            await wait_joined(clients, "duo")
            resp = await produce_until_definite(clients[2], "duo", b"p", 1, b"new")
            assert resp.outcome is Outcome.COMMITTED, resp
            entries = await read_all(clients[1], "duo", 1)
            assert len(entries) == 1 and b"new" in entries[0], entries

    with caplog.at_level("WARNING", logger="relay.node"):
        asyncio.run(scenario())


def test_limits_changed_in_the_file_apply_on_reload_both_ways(tmp_path: Path) -> None:
    """A reload that lowers max_tx_bytes and max_pending_produces is taken by every relay
    (its status shows the new values): a transaction between the two bounds is rejected
    `too_large` through either relay, what was committed before stays; raised again above
    the first file's bound, a transaction larger than that commits and reads back. A file
    that changes a limit every relay must hold alike is refused, by name."""
    import yaml  # type: ignore[import-untyped, unused-ignore]

    async def scenario() -> None:
        async with mesh(tmp_path, {1: ["duo"], 2: ["duo"]}) as (config, nodes, clients):
            await wait_joined(clients, "duo")
            ok = await produce_until_definite(clients[1], "duo", b"p", 1, b"x" * 3_000)
            assert ok.outcome is Outcome.COMMITTED, ok
            path = config.path
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))

            def write(**limits: int) -> None:
                new = {**doc, "limits": {**doc.get("limits", {}), **limits}}
                path.write_text(yaml.safe_dump(new, sort_keys=False), encoding="utf-8")

            write(max_tx_bytes=2_048, max_pending_produces=500)
            for node in nodes.values():
                change = node.reload()
                assert change is not None and not change.refused, change
                assert change.limits == (
                    ("max_pending_produces", 100_000, 500),
                    ("max_tx_bytes", MAX_TX, 2_048),
                ), change
            for r, client in clients.items():
                status = await client.status()
                assert status["node"]["limits"]["max_tx_bytes"] == 2_048, status["node"]
                assert nodes[r].core.limits.max_pending_produces == 500
                resp = await client.produce("duo", b"p", 10 + r, b"x" * 2_500)
                assert (resp.outcome, resp.reason) == (Outcome.REJECTED, "too_large"), resp

            write(max_tx_bytes=2 * MAX_TX)
            for node in nodes.values():
                assert node.reload() is not None
            resp = await produce_until_definite(clients[2], "duo", b"p", 2, b"y" * (MAX_TX + 500))
            assert resp.outcome is Outcome.COMMITTED, resp
            entries = await read_all(clients[1], "duo", 2)
            sizes = [max(len(f) for f in e if isinstance(f, bytes)) for e in entries]
            assert sizes == [3_000, MAX_TX + 500], sizes

            write(max_tx_bytes=2 * MAX_TX, dedupe_window_entries=1_000)
            assert nodes[1].reload() is None
            assert nodes[1].core.limits.dedupe_window_entries == 262_144

    asyncio.run(scenario())


# --- peer protocol versions (relay/peerprotocol.py) ----------------------------------------


def test_a_peer_of_another_protocol_is_named_and_its_frames_are_dropped_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Relay 2 hears relay 1 announce the protocol it speaks, and (from a PUB at relay 3's
    endpoint: relay 3 does not run) a relay 3 that speaks only protocol 99: it names both
    versions once in its log and in its status, `relay status` names it as a problem, and
    relay 3's other frames are dropped before the core sees them. Once relay 3 announces
    this relay's protocol, its frames are taken again. A relay 3 announcing another dedupe
    window (a limit every relay must hold alike) is named too, once, in the log, the
    status and `relay status`, and no longer once it announces this relay's."""
    from relay import peerprotocol
    from relay.launcher import StatusReply
    from relay.tools.status import mesh_status

    streams = {1: ["duo"], 2: ["duo"], 3: ["solo"]}
    other = msgpack.packb([3, 99, 99, 99, "9.0.0"])
    ours = peerprotocol.announcement(3, Limits())

    async def scenario() -> None:
        async with mesh(tmp_path, streams, start=(1, 2)) as (config, nodes, clients):
            await wait_joined(clients, "duo")
            ctx = zmq.asyncio.Context()
            try:
                rogue = ctx.socket(zmq.PUB)
                rogue.setsockopt(zmq.LINGER, 0)
                rogue.bind(config.relays[3].mesh_endpoint)
                node = nodes[2]

                async def named() -> bool:
                    await rogue.send(peerprotocol.TOPIC + other)
                    return 3 in node._incompatible  # sent again: the SUB may not be connected yet

                await wait_until_async(named, "relay 2 to hear relay 3's protocol", poll_s=0.02)
                before = dict(node.core.counters)

                async def dropped() -> bool:
                    await rogue.send(b"H|" + b"\x00" * 50)
                    return node.counters["peer_frames_other_protocol"] > 0

                await wait_until_async(dropped, "relay 3's frames dropped unread", poll_s=0.02)
                assert node.core.counters["frame_malformed"] == before.get("frame_malformed", 0)
                await wait_until_async(
                    lambda: 1 in node._peer_protocols, "relay 1's announcement", poll_s=0.05
                )
                status = await clients[2].status()
                peers = status["node"]["peer_protocols"]
                assert peers["1"]["problem"] == "" and peers["1"]["protocol"] == (
                    peerprotocol.PROTOCOL_VERSION
                ), peers
                words = peers["3"]["problem"]
                assert words.startswith(
                    "relay 3 speaks peer protocol 99 (release 9.0.0), this "
                    f"relay {peerprotocol.PROTOCOL_VERSION} ("
                ), words
                doc = mesh_status("t.yaml", {2: StatusReply(2, "e", status)})
                assert {"relay": 2, "stream": None, "problem": words} in doc["problems"], doc
                lines = [
                    r.getMessage()
                    for r in caplog.records
                    if r.getMessage().startswith("relay=2 relay 3 speaks peer protocol 99")
                ]
                assert len(lines) == 1, lines

                async def taken_again() -> bool:
                    await rogue.send(peerprotocol.TOPIC + ours)
                    return 3 not in node._incompatible

                await wait_until_async(taken_again, "relay 3 taken again", poll_s=0.02)

                # Relay 3 holds another dedupe window: named, once, in the log and status.
                narrow = peerprotocol.announcement(3, Limits(dedupe_window_entries=1_000))

                async def differs() -> bool:
                    await rogue.send(peerprotocol.TOPIC + narrow)
                    return 3 in node._limits_differ

                await wait_until_async(differs, "relay 3's limits named", poll_s=0.02)
                status = await clients[2].status()
                words = status["node"]["peer_protocols"]["3"]["limits_problem"]
                assert words == (
                    "relay 3 holds other values of limits every relay must hold alike: "
                    "limits.dedupe_window_entries 1000 there, 262144 here (every relay must "
                    "skip the same duplicates (protocol 5.6)): give every relay the same file "
                    "(docs/deploy.md section 4)"
                ), words
                doc = mesh_status("t.yaml", {2: StatusReply(2, "e", status)})
                assert {"relay": 2, "stream": None, "problem": words} in doc["problems"], doc
                assert doc["health"] == "degraded", doc
                assert node.counters["peer_limits_mismatch"] == 1, node.counters

                async def alike() -> bool:
                    await rogue.send(peerprotocol.TOPIC + ours)
                    return 3 not in node._limits_differ

                await wait_until_async(alike, "relay 3's limits alike again", poll_s=0.02)
                limits_lines = [
                    r.getMessage()
                    for r in caplog.records
                    if r.getMessage().startswith("relay=2 relay 3 holds other values")
                ]
                assert len(limits_lines) == 1, limits_lines
            finally:
                ctx.destroy(linger=0)

    with caplog.at_level("WARNING", logger="relay.node"):
        asyncio.run(scenario())


def test_a_relay_removed_from_the_mesh_is_kept_while_a_stream_counts_it_then_let_go(
    tmp_path: Path,
) -> None:
    """A reload that removes relay 3 from the mesh while `trio` (and the metadata stream)
    still run on it: relay 1 keeps it (its link, its frames: `leaving` in the status),
    and relay 3 refuses a file that leaves itself out. Named again, serving nothing
    (docs/deploy.md section 9, step 1), no second link is opened, and the mesh takes relay
    3 off every stream; the file without it (step 2) then has relays 1 and 2 let it go at
    once: no peer, no link, and the stream commits on."""
    import yaml  # type: ignore[import-untyped, unused-ignore]

    from relay.meta import METADATA_STREAM

    async def scenario() -> None:
        async with mesh(tmp_path, {1: ["trio"], 2: ["trio"], 3: ["trio"]}) as (
            config,
            nodes,
            clients,
        ):
            await wait_joined(clients, "trio")
            path = config.path
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
            entries = {entry["id"]: entry for entry in doc["relays"]}

            def write(*relays: dict[str, Any]) -> None:
                text = yaml.safe_dump({**doc, "relays": list(relays)}, sort_keys=False)
                path.write_text(text, encoding="utf-8")

            write(entries[1], entries[2])
            change = nodes[1].reload()
            assert change is not None and change.removed_relays == (3,), change
            assert nodes[1]._leaving == {3} and 3 in nodes[1].core.peers
            assert (await clients[1].status())["node"]["leaving"] == [3]
            assert nodes[3].reload() is None  # a file without itself
            assert nodes[3].counters["topology_reload_refused"] == 1

            write(entries[1], entries[2], {**entries[3], "streams": []})
            for node in nodes.values():
                assert node.reload() is not None
            sockets = nodes[1]._sockets
            assert sockets is not None and sorted(sockets.subs.values()) == [2, 3]
            assert not nodes[1]._leaving

            async def moved() -> bool:
                for r in (1, 2):
                    streams = (await clients[r].status())["streams"]
                    for stream in ("trio", METADATA_STREAM):
                        if streams[stream]["config"]["relays"] != [1, 2]:
                            return False
                return True

            await wait_until_async(moved, "every stream off relay 3", timeout_s=60)
            write(entries[1], entries[2])
            for r in (1, 2):
                assert nodes[r].reload() is not None
                sockets = nodes[r]._sockets
                assert sockets is not None and list(sockets.subs.values()) == [3 - r]
                assert 3 not in nodes[r].core.peers and not nodes[r]._leaving
                assert nodes[r].core.counters["peers_forgotten"] == 1
            resp = await produce_until_definite(clients[2], "trio", b"p", 1, b"after")
            assert resp.outcome is Outcome.COMMITTED, resp

    asyncio.run(scenario())
