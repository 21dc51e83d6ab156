"""Attacks on a live mesh (docs/security.md): each one as a hostile client or outsider
would try it, with real relay processes and real sockets, and what it can no longer do.

One 3-relay mesh per module (relays 0-2 serve `orders.*`), security off: these are the
bounds that hold whatever the configuration (tests/test_security.py has the attacks that
keys stop). Its per-client bounds are set low, so that the attacks reach them quickly.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from relay import wire
from relay.client import Consumer, Producer
from relay.core.messages import Outcome, ReadStatus
from relay.errors import Rejected
from relay.launcher import Mesh, write_loopback_topology
from relay.node import TOPIC_MAX_BYTES
from waiting import wait_until

pytestmark = pytest.mark.timeout(300)

STREAM = "orders.eu"
START_TIMEOUT_S = 60.0
NEW_STREAMS_PER_CLIENT = 20
UNREAD_REPLY_BYTES = 8 * 1024 * 1024
BIG_VALUE_BYTES = 64 * 1024
# What a relay may grow by while a client leaves answers unread: the bound, an answer in
# flight, and room for the allocator and the test's own traffic; without the bound the
# attack below queues about 300 answers of 4 MiB.
SLOW_READER_RSS_SLACK_BYTES = UNREAD_REPLY_BYTES + 4 * 1024 * 1024 + 96 * 1024 * 1024


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    directory = tmp_path_factory.mktemp("attacks")
    limits = {
        "max_new_streams_per_client": NEW_STREAMS_PER_CLIENT,
        "max_unread_reply_bytes": UNREAD_REPLY_BYTES,
    }
    path = write_loopback_topology(directory, {r: ["orders.*"] for r in range(3)}, [STREAM], limits)
    running = Mesh(path, log_level="warning", log_dir=directory / "logs")
    try:
        running.start(timeout_s=START_TIMEOUT_S)
        yield running
    finally:
        running.stop()


def relays(mesh: Mesh) -> dict[int, str]:
    return {r: e.client for r, e in sorted(mesh.endpoints.items())}


def test_a_client_cannot_take_over_another_producers_sequence(mesh: Mesh) -> None:
    """The attack: write the victim's next producer sequences with other values. They
    commit (the attacker's own writes), but the victim is no longer told `committed` for
    content that never went in: its sends are rejected `duplicate_mismatch`, and readers
    see the attacker's values only once, the victim's never as committed."""
    with Producer(relays(mesh), producer_id=b"victim") as victim:
        before = victim.send(STREAM, b"genuine 1")
        taken = victim.next_producer_seq
        with Producer(relays(mesh), producer_id=b"victim", first_producer_seq=taken) as thief:
            forged = thief.send(STREAM, b"forged")
        with pytest.raises(Rejected, match="duplicate_mismatch") as refused:
            victim.send(STREAM, b"genuine 2")
        assert refused.value.reason == "duplicate_mismatch"
        after = victim.send(STREAM, b"genuine 3")  # its next sequence is its own again
    values = {}
    with Consumer(relays(mesh), timeout_s=30).subscribe(STREAM, "earliest") as consumer:
        for record in consumer:
            values[record.seq] = record.value
            if record.seq >= after:
                break
    assert values[before] == b"genuine 1"
    assert values[forged] == b"forged"
    assert values[after] == b"genuine 3"
    assert b"genuine 2" not in values.values()


def node_counter(mesh: Mesh, relay_id: int, name: str) -> int:
    status = mesh.status(relay_id, timeout_s=10)
    assert status is not None, f"relay {relay_id} did not answer"
    return int(status["node"]["counters"].get(name, 0))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class RawDealer:
    def __init__(self, endpoint: str, **options: int) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            self.sock.setsockopt(getattr(zmq, name), value)
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)

    def answer(self) -> Any:
        assert self.sock.poll(30_000), "no answer within 30 s"
        return wire.decode(self.sock.recv(), 64 * 1024 * 1024)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_a_reader_that_does_not_read_is_cut_off_and_the_relay_stays_small(mesh: Mesh) -> None:
    """The attack: ask for the whole stream again and again and never take the answers.
    Each answer is up to max_batch_bytes; they used to queue in the relay (82 MB -> 875 MB
    for 200 of them). Now the relay stops answering with entries once the connection holds
    max_unread_reply_bytes unread, and says so (SlowConsumer)."""
    with Producer(relays(mesh)) as producer:
        producer.send_many(STREAM, [os.urandom(BIG_VALUE_BYTES) for _ in range(128)])
    pid = mesh.pids[0]
    before = rss_bytes(pid)
    refused = node_counter(mesh, 0, "read_refused_slow_consumer")
    reader = RawDealer(mesh.endpoints[0].client, RCVHWM=1, RCVBUF=4096)
    try:
        asks = 300
        for i in range(asks):
            reader.sock.send(wire.encode(wire.ReadReq(i, STREAM, -1, 65_536, 0)))
        wait_until(
            lambda: node_counter(mesh, 0, "read_refused_slow_consumer") - refused >= asks - 10,
            "relay 0 to refuse the reads beyond the unread bound",
        )
        grown = rss_bytes(pid) - before
        assert grown < SLOW_READER_RSS_SLACK_BYTES, f"relay 0 grew {grown} bytes"
        # The reader catches up: what was queued arrives, then the refusals, named.
        answers = [reader.answer() for _ in range(asks)]
        kinds = {type(a).__name__ + ":" + getattr(a, "error", "") for a in answers}
        assert kinds == {"ReadResp:", "ErrorResp:SlowConsumer"}, kinds
        reader.sock.send(wire.encode(wire.ReadReq(asks, STREAM, -1, 1, 0)))
        again = reader.answer()
        assert isinstance(again, wire.ReadResp) and again.status is ReadStatus.OK, again
    finally:
        reader.close()


def test_new_streams_are_bounded_per_client(mesh: Mesh) -> None:
    """The attack: read (or write) many new names matching `orders.*`; each opened a
    stream on every relay. One client now opens at most max_new_streams_per_client on a
    relay; the rest are refused by name, and other clients and streams carry on."""
    refused = node_counter(mesh, 1, "refused_too_many_streams")
    flood = RawDealer(mesh.endpoints[1].client)
    try:
        names = [f"orders.flood-{i}" for i in range(NEW_STREAMS_PER_CLIENT + 5)]
        for i, name in enumerate(names):
            flood.sock.send(wire.encode(wire.ReadReq(i, name, -1, 1, 0)))
        answers = sorted((a.request_id, a) for a in (flood.answer() for _ in names))
        errors = [a for _, a in answers if isinstance(a, wire.ErrorResp)]
        assert len(errors) == 5 and all(e.error == "TooManyStreams" for e in errors), errors
        assert "max_new_streams_per_client" in errors[0].message
        flood.sock.send(wire.encode(wire.ProduceReq(99, "orders.flood-x", b"p", 0, None, b"v")))
        produced = flood.answer()
        assert isinstance(produced, wire.ProduceResp), produced
        assert produced.outcome is Outcome.REJECTED, produced
        assert produced.reason.startswith("too_many_streams"), produced
    finally:
        flood.close()
    assert node_counter(mesh, 1, "refused_too_many_streams") - refused == 6
    with Producer(relays(mesh), send_timeout_s=60) as producer:  # another client
        assert producer.send("orders.fresh", b"v") > 0
        assert producer.send(STREAM, b"v") > 0


def test_a_subscription_longer_than_any_topic_drops_the_subscriber(mesh: Mesh) -> None:
    """A subscription is bounded by the longest topic (ZMQ_MAXMSGSIZE on the mesh PUB): a
    longer one closes the subscriber's connection, and the relay carries on. (How many
    subscriptions a subscriber makes, only keys bound: tests/test_security.py.)"""
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RECONNECT_IVL, 60_000)  # once is enough
    monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"S|" + b"x" * (TOPIC_MAX_BYTES + 1))
        sub.connect(mesh.endpoints[2].mesh)
        events = []
        while zmq.EVENT_DISCONNECTED not in events:
            assert monitor.poll(30_000), f"the relay kept the connection: {events}"
            events.append(recv_monitor_message(monitor)["event"])
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)
        ctx.term()
    with Producer(relays(mesh), send_timeout_s=60) as producer:
        assert producer.send(STREAM, b"v") > 0
