"""Bounds per client name (issue 48, items 2 and 3), on a live 3-relay CurveZMQ mesh:
what one authenticated client costs a relay does not grow with the connections it opens
or with how fast it sends, and the bound that bites names it. The module's mesh has
low bounds, so that the attacks reach them quickly; `legit` is another client, whose
writes must go on committing throughout.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from relay import wire
from relay.client import Producer
from relay.core.messages import ReadStatus
from relay.launcher import Mesh, write_loopback_topology
from relay.node import FLOOD_HOLD_MS
from relay.security import KeyRing, curve_client, load_identity
from waiting import wait_until

pytestmark = pytest.mark.timeout(300)

STREAM = "orders.eu"
BIG = "orders.big"
START_TIMEOUT_S = 60.0
UNREAD_REPLY_BYTES = 32 * 1024 * 1024
# What a connection's socket buffers take off the relay's hands (its send buffer grows to
# net.ipv4.tcp_wmem's 4 MiB at most; the reader's receive buffer is 4 KiB), and slack.
KERNEL_TAKES_BYTES = 5 * 1024 * 1024
QUEUED_REQUESTS = 2_000
# Answers below the 64 KiB the relay once counted from: a reader of them was never bound.
SMALL_ANSWER_VALUE_BYTES = 60_000
ACCESS = {
    "app": {"produce": ["orders.*"], "consume": ["orders.*"]},
    "legit": {"produce": ["orders.*"], "consume": ["orders.*"]},
}
RELAY = 0  # the relay attacked


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    directory = tmp_path_factory.mktemp("client-bounds")
    limits = {
        "max_unread_reply_bytes": UNREAD_REPLY_BYTES,
        "max_queued_requests_per_client": QUEUED_REQUESTS,
    }
    path = write_loopback_topology(
        directory, {r: ["orders.*"] for r in range(3)}, [STREAM, BIG], limits, access=ACCESS
    )
    with Mesh(path, log_level="warning", log_dir=directory / "logs").start(
        timeout_s=START_TIMEOUT_S
    ) as running:
        yield running


def key_file(mesh: Mesh, client: str) -> Path:
    return mesh.config.security.keys_dir / f"client-{client}.key_secret"


def node(mesh: Mesh) -> dict[str, Any]:
    status = mesh.status(RELAY, timeout_s=10)
    assert status is not None
    found: dict[str, Any] = status["node"]
    return found


def counter(mesh: Mesh, name: str) -> int:
    return int(node(mesh)["counters"].get(name, 0))


def log_lines(mesh: Mesh, words: str) -> list[str]:
    assert mesh.log_dir is not None
    text = (mesh.log_dir / f"relay-{RELAY}.log").read_text(errors="replace")
    return [line for line in text.splitlines() if words in line]


class Connection:
    """One DEALER of a client, with the client's key, to relay RELAY; it reads only when
    told to (`answer`), and its monitor says when the relay closed it."""

    def __init__(self, mesh: Mesh, client: str, **options: int) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        for name, value in options.items():
            self.sock.setsockopt(getattr(zmq, name), value)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        relay_key = KeyRing(mesh.config).relay_public_key(RELAY)
        curve_client(self.sock, load_identity(key_file(mesh, client)), relay_key)
        self.sock.connect(mesh.endpoints[RELAY].client)
        self.ids = itertools.count(1)

    def read(self, stream: str, max_entries: int = 65_536) -> None:
        self.sock.send(wire.encode(wire.ReadReq(next(self.ids), stream, -1, max_entries, 0)))

    def answer(self) -> Any:
        assert self.sock.poll(30_000), "no answer within 30 s"
        return wire.decode(self.sock.recv(), 64 * 1024 * 1024)

    def cut(self) -> bool:
        """Whether the relay closed the connection (its monitor saw it end)."""
        if not self.monitor.poll(0):
            return False
        return bool(recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()


def commits(mesh: Mesh) -> int:
    with Producer(topology=mesh.config, key_file=key_file(mesh, "legit"), send_timeout_s=60) as p:
        return p.send(STREAM, b"legit")


def test_unread_answers_are_bounded_per_client_name_and_every_answer_counts(mesh: Mesh) -> None:
    """The attack: several connections of one client, each asking for answers and never
    reading them, of a size under 64 KiB (such answers were not counted at all, and the
    bound was per connection: 8 connections grew a relay by 563 MB, one reading no
    62,300-byte answers by 607 MB). Now the answers of every connection of the name count
    together: what the relay sends `app` with entries stops at about
    max_unread_reply_bytes in all (plus what the kernel's socket buffers take off its
    hands, per connection), the rest is refused SlowConsumer, and another client reads
    on."""
    with Producer(topology=mesh.config, key_file=key_file(mesh, "legit")) as producer:
        producer.send(BIG, os.urandom(SMALL_ANSWER_VALUE_BYTES))
    refused = counter(mesh, "read_refused_slow_consumer")
    read, entries = counter(mesh, "read_requests"), counter(mesh, "read_entries")
    connections = 8
    # Per connection, 13.5 MB of answers asked for, under the bound: together well beyond
    # it, and fewer requests than would be cut off for flooding.
    asks = (QUEUED_REQUESTS - 200) // connections
    readers = [Connection(mesh, "app", RCVHWM=1, RCVBUF=4096) for _ in range(connections)]
    try:
        for reader in readers:
            for _ in range(asks):
                reader.read(BIG, 1)
        wait_until(
            lambda: counter(mesh, "read_requests") - read >= asks * connections,
            "the relay to take every read of app's connections",
        )
        sent_bytes = (counter(mesh, "read_entries") - entries) * SMALL_ANSWER_VALUE_BYTES
        # Per connection, the bound would have let through connections x the bound.
        assert sent_bytes <= UNREAD_REPLY_BYTES + connections * KERNEL_TAKES_BYTES, sent_bytes
        assert counter(mesh, "read_refused_slow_consumer") - refused > asks, "too few refused"
        other = Connection(mesh, "legit")
        try:
            other.read(BIG, 1)
            answer = other.answer()
            assert isinstance(answer, wire.ReadResp) and answer.status is ReadStatus.OK, answer
            assert len(answer.entries) == 1
        finally:
            other.close()
    finally:
        for reader in readers:
            reader.close()
    assert commits(mesh) > 0


def test_a_request_flood_cuts_the_client_off_and_names_it(mesh: Mesh) -> None:
    """The attack: one connection sends reads as fast as it can and reads no answer (16
    million queued in 20 s grew a relay to 2.73 GB, and it spent 4 min 15 s answering
    them after the client left). Now the relay reads requests ahead of serving them; a
    client with more than max_queued_requests_per_client read and not served is cut off,
    what it queued dropped, its name and address logged; a new connection of the name is
    cut at its first request for FLOOD_HOLD_MS; other clients commit throughout."""
    cut_before = counter(mesh, "client_cut_flooding")
    frame = wire.encode(wire.ReadReq(1, STREAM, -1, 1, 0))
    flood = Connection(mesh, "app", RCVHWM=1, RCVBUF=4096)
    try:

        def flooded_and_cut() -> bool:  # bursts far faster than a relay answers reads
            for _ in range(10 * QUEUED_REQUESTS):
                flood.sock.send(frame)
            return counter(mesh, "client_cut_flooding") > cut_before

        wait_until(flooded_and_cut, "the relay to cut the flooding client", poll_s=0)
        lines = log_lines(mesh, "cut client 'app' from 127.0.0.1:")
        assert lines and "limits.max_queued_requests_per_client" in lines[-1], lines
        assert counter(mesh, "client_requests_dropped_flooding") > QUEUED_REQUESTS
        # What the flood still had on its way is dropped unserved, not answered.
        served = counter(mesh, "read_requests")
        wait_until(
            lambda: counter(mesh, "client_requests_of_closed_connections") > 0,
            "the relay to drop what the cut connection had queued",
        )
        assert counter(mesh, "read_requests") - served < QUEUED_REQUESTS
    finally:
        flood.close()
    # Held: a new connection of app is cut at its first request; legit is served.
    held_before = counter(mesh, "client_cut_held")
    again = Connection(mesh, "app")
    try:
        again.read(STREAM, 1)
        wait_until(
            lambda: counter(mesh, "client_cut_held") > held_before,
            "the relay to cut app's next connection while it is held",
        )
    finally:
        again.close()
    assert commits(mesh) > 0

    def served_again() -> bool:  # after the hold; a cut while held does not prolong it
        conn = Connection(mesh, "app")
        try:
            conn.read(STREAM, 1)
            if not conn.sock.poll(FLOOD_HOLD_MS // 5):
                return False
            return isinstance(wire.decode(conn.sock.recv(), 64 * 1024 * 1024), wire.ReadResp)
        finally:
            conn.close()

    wait_until(served_again, "app to be served again after the hold", timeout_s=120)
