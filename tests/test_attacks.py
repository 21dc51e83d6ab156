"""Attacks on a live mesh (docs/security.md): each one as a hostile client or outsider
would try it, with real relay processes and real sockets, and what it can no longer do.

One 3-relay mesh per module (relays 0-2 serve `orders.*`), security off: these are the
bounds that hold whatever the configuration (tests/test_security.py has the attacks that
keys stop). Its per-client bounds are set low, so that the attacks reach them quickly. The
forged peer frames come from a PUB bound at a killed relay's mesh endpoint (what an
outsider can do without CurveZMQ): the other relays' SUBs for that relay take whatever it
publishes in that relay's name (in another name it is dropped, `peer_sender_mismatch`).
"""

from __future__ import annotations

import functools
import http.client
import itertools
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from relay import wire
from relay.client import Consumer, Producer
from relay.core import codec
from relay.core.messages import Heartbeat, Outcome, ReadStatus, Reports
from relay.errors import Rejected
from relay.launcher import Mesh, write_loopback_topology
from relay.node import HEARTBEAT_TOPIC, TOPIC_MAX_BYTES, stream_topic
from waiting import bind_when_free, wait_until

pytestmark = pytest.mark.timeout(300)

STREAM = "orders.eu"
START_TIMEOUT_S = 60.0
NEW_STREAMS_PER_CLIENT = 20
IDLE_STREAM_CLOSE_MS = 3_000  # streams nobody writes close after this (5.11)
UNREAD_REPLY_BYTES = 8 * 1024 * 1024
BIG_VALUE_BYTES = 64 * 1024
# What a relay may grow by while a client leaves answers unread: the bound, an answer in
# flight, and room for the allocator and the test's own traffic; without the bound the
# attack below queues about 300 answers of 4 MiB.
SLOW_READER_RSS_SLACK_BYTES = UNREAD_REPLY_BYTES + 4 * 1024 * 1024 + 96 * 1024 * 1024
HONEST = (0, 1, 2)
VICTIM = 1  # the relay whose name the forged frames take, from its own endpoint
MAX_U63 = (1 << 63) - 1
# Two parts: a mesh message has one, so each relay counts it (`peer_bad_parts`) and drops
# it. Once every relay counted one, its SUB is connected to the forging PUB.
MARKER = [b"H|attacks-marker", b"two parts"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    directory = tmp_path_factory.mktemp("attacks")
    limits = {
        "max_new_streams_per_client": NEW_STREAMS_PER_CLIENT,
        "max_unread_reply_bytes": UNREAD_REPLY_BYTES,
        "idle_stream_close_ms": IDLE_STREAM_CLOSE_MS,
    }
    path = write_loopback_topology(
        directory, {r: ["orders.*"] for r in range(3)}, [STREAM], limits, http=True
    )
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


def status(mesh: Mesh, relay: int) -> dict[str, Any]:
    found = mesh.status(relay, timeout_s=10)
    assert found is not None, f"relay {relay} did not answer a StatusReq"
    return found


def node_counter(mesh: Mesh, relay_id: int, name: str) -> int:
    return int(status(mesh, relay_id)["node"]["counters"].get(name, 0))


def core_counter(mesh: Mesh, relay: int, name: str) -> int:
    return int(status(mesh, relay)["counters"].get(name, 0))


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
        # Nobody writes them: once no read reached them for idle_stream_close_ms, they
        # close on every relay, and the same client may open as many again.
        wait_until(
            lambda: all(
                not any(n.startswith("orders.flood-") for n in status(mesh, r)["streams"])
                for r in HONEST
            ),
            timeout_s=120,
            what="the flood's streams closed on every relay",
        )
        assert all(core_counter(mesh, r, "streams_closed_idle") >= 20 for r in HONEST)
        again = [f"orders.flood-again-{i}" for i in range(NEW_STREAMS_PER_CLIENT)]
        for i, name in enumerate(again):
            flood.sock.send(wire.encode(wire.ReadReq(1000 + i, name, -1, 1, 0)))
        reopened = [flood.answer() for _ in again]
        assert not [a for a in reopened if isinstance(a, wire.ErrorResp)], reopened
    finally:
        flood.close()
    assert node_counter(mesh, 1, "refused_too_many_streams") - refused == 6
    with Producer(relays(mesh), send_timeout_s=60) as producer:  # another client
        assert producer.send("orders.fresh", b"v") > 0
        assert producer.send(STREAM, b"v") > 0


PARKED_WAIT_MS = 40_000  # far past the closing and the refill below, on a loaded machine
REREAD_EVERY_MS = 1_000  # well within IDLE_STREAM_CLOSE_MS: the streams read stay open


def test_a_parked_read_reopens_its_stream_on_its_own_clients_share(mesh: Mesh) -> None:
    """The attack: park a long read on a new name, let the stream close (nobody writes
    it), open a full share of other names, and let the read's wait run out: reading then
    would open the stream again. It is counted against the same client, so it is refused
    by name (TooManyStreams), not opened beyond the share."""
    client = RawDealer(mesh.endpoints[1].client)
    try:
        parked = "orders.parked"
        asks = itertools.count(1000)

        def joined() -> bool:  # (a read parked before would be answered as it joins)
            client.sock.send(wire.encode(wire.ReadReq(next(asks), parked, -1, 1, 0)))
            answer = client.answer()
            return isinstance(answer, wire.ReadResp) and answer.status is ReadStatus.OK

        wait_until(joined, f"relay 1 to open and join {parked}")
        client.sock.send(wire.encode(wire.ReadReq(1, parked, -1, 1, PARKED_WAIT_MS)))
        first = [f"orders.share-{i}" for i in range(NEW_STREAMS_PER_CLIENT - 1)]
        for i, name in enumerate(first):
            client.sock.send(wire.encode(wire.ReadReq(10 + i, name, -1, 1, 0)))
        opened = [client.answer() for _ in first]
        assert all(isinstance(a, wire.ReadResp) and a.request_id != 1 for a in opened), opened
        wait_until(
            lambda: (
                not any(
                    n == parked or n.startswith("orders.share-") for n in status(mesh, 1)["streams"]
                )
            ),
            timeout_s=120,
            what="relay 1 to close the client's streams, the parked read's among them",
        )
        # A full share again, kept open by reading it (a stream read within
        # idle_stream_close_ms stays), until the parked read's wait is over.
        refill = [f"orders.refill-{i}" for i in range(NEW_STREAMS_PER_CLIENT)]
        late = None
        deadline = time.monotonic() + (PARKED_WAIT_MS + 60_000) / 1000
        while late is None:
            assert time.monotonic() < deadline, "the parked read never answered"
            for name in refill:
                client.sock.send(wire.encode(wire.ReadReq(next(asks), name, -1, 1, 0)))
            for _ in refill:
                answer = client.answer()
                if answer.request_id == 1:
                    late = answer
                    answer = client.answer()  # (the refill's answer still comes)
                assert isinstance(answer, wire.ReadResp), answer
            if late is None and client.sock.poll(REREAD_EVERY_MS):
                late = wire.decode(client.sock.recv(), 64 * 1024 * 1024)
        assert isinstance(late, wire.ErrorResp), late
        assert late.error == "TooManyStreams", late
        assert parked not in status(mesh, 1)["streams"]
    finally:
        client.close()


def ready_body(mesh: Mesh, relay: int) -> dict[str, Any] | None:
    """The relay's /readyz document while it answers 200 (None: not ready)."""
    port = mesh.config.relays[relay].http_port
    assert port is not None
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/readyz")
        resp = conn.getresponse()
        body: dict[str, Any] = json.loads(resp.read())
        return body if resp.status == 200 else None
    finally:
        conn.close()


def test_a_read_of_a_new_name_leaves_the_mesh_ready_and_a_pattern_is_no_read_target(
    mesh: Mesh,
) -> None:
    """The attack: read a name nobody wrote, and the literal pattern `orders.*`. The first
    opened a stream that stayed fenced (not_admitted) until someone wrote to it, the second
    one that nobody could ever write: every relay answered 503 on /readyz, and a load
    balancer would have taken the mesh out. Now a stream never written is no problem, and a
    pattern is refused as a read target by name."""
    never = "orders.never-written"
    reader = RawDealer(mesh.endpoints[1].client)
    try:
        reader.sock.send(wire.encode(wire.ReadReq(1, never, -1, 1, 0)))
        answer = reader.answer()
        assert isinstance(answer, wire.ReadResp), answer
        reader.sock.send(wire.encode(wire.ReadReq(2, "orders.*", -1, 1, 0)))
        refused = reader.answer()
        assert isinstance(refused, wire.ErrorResp) and refused.error == "FieldError", refused
        assert "'orders.*' is a pattern" in refused.message, refused
    finally:
        reader.close()

    def opened_everywhere() -> bool:
        statuses = [mesh.status(r) or {} for r in HONEST]
        return all((s.get("streams") or {}).get(never, {}).get("joined") for s in statuses)

    wait_until(opened_everywhere, f"every relay to open {never!r} for the read")
    for r in HONEST:
        assert "orders.*" not in (mesh.status(r) or {}).get("streams", {})
        body = wait_until(
            functools.partial(ready_body, mesh, r), f"relay {r} to answer 200 on /readyz"
        )
        assert never not in body.get("degraded", {}), body
    with Producer(relays(mesh), send_timeout_s=60) as producer:  # it commits on first use
        assert producer.send(never, b"first") > 0


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
        events: list[int] = []
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


# --- forged frames on the mesh links ---------------------------------------------------------


def hears(mesh: Mesh, relay: int, peer: int) -> bool:
    return peer in status(mesh, relay)["peers_heard"]


def reported(mesh: Mesh, relay: int, point: int) -> bool:
    return int(status(mesh, relay)["streams"][STREAM]["reported"]) >= point


def commit_through(mesh: Mesh, relay: int, value: bytes) -> int:
    """Produce through `relay` alone: it must coordinate and commit it itself."""
    with Producer({relay: mesh.endpoints[relay].client}, send_timeout_s=60) as producer:
        return producer.send(STREAM, value)


def forge_as_victim(mesh: Mesh, frames: list[bytes]) -> None:
    """Kill the victim, bind a PUB at its mesh endpoint, publish `frames` in its name until
    the others took them (each round ends with MARKER: a link is FIFO, so once a relay
    counted the marker it read the frames before it), then let the victim start again."""
    others = [r for r in HONEST if r != VICTIM]
    base = {r: node_counter(mesh, r, "peer_bad_parts") for r in others}
    mesh.kill(VICTIM)
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        endpoint = mesh.endpoints[VICTIM].mesh
        bind_when_free(pub, endpoint)

        def taken() -> bool:
            for frame in frames:  # (a SUB not yet connected misses them: send again)
                pub.send(frame)
            pub.send_multipart(MARKER)
            return all(node_counter(mesh, r, "peer_bad_parts") > base[r] for r in others)

        wait_until(taken, f"relays {others} to read the forged frames", poll_s=0.1)
    finally:
        pub.close(linger=0)
        ctx.term()
        mesh.restart(VICTIM, timeout_s=START_TIMEOUT_S)


def test_a_forged_heartbeat_with_a_huge_incarnation_cannot_silence_a_relay(mesh: Mesh) -> None:
    """The attack: while relay 1 is down, bind its mesh endpoint and send a heartbeat in its
    name with incarnation 2**63-1. Before, relays 0 and 2 took it, and dropped every frame
    of relay 1's real incarnation as stale for good, restarts included. Now an incarnation
    beyond any relay's clock is refused."""
    others = [r for r in HONEST if r != VICTIM]
    refused = {r: core_counter(mesh, r, "incarnation_implausible") for r in others}
    lie = Heartbeat(sender=VICTIM, incarnation=MAX_U63, floor=0, streams=(), hears=(0, 2))
    forge_as_victim(mesh, [HEARTBEAT_TOPIC + codec.encode(lie)])
    assert all(core_counter(mesh, r, "incarnation_implausible") > refused[r] for r in others)
    stale = {r: core_counter(mesh, r, "stale_incarnation") for r in others}
    seq = commit_through(mesh, VICTIM, b"after a forged heartbeat")
    for r in others:
        wait_until(functools.partial(hears, mesh, r, VICTIM), f"relay {r} to hear relay 1")
        wait_until(functools.partial(reported, mesh, r, seq), f"relay {r} to report {seq}")
        assert core_counter(mesh, r, "stale_incarnation") == stale[r]


def test_a_forged_huge_link_counter_cannot_make_a_relay_drop_anothers_messages(
    mesh: Mesh,
) -> None:
    """The attack: a report in relay 1's name with link counter 2**63-1 (its incarnation
    read from its status). Before, the others took every later message of relay 1 on the
    stream for a duplicate and stopped reporting. Frames bound to their sender's link leave
    a forger only the endpoint of a relay that is down, whose restart starts its count
    afresh; and a message below the count that never arrived makes a relay follow the
    sender's count again anyway (docs/protocol.md 5.2; tests/test_core_bounds.py forges
    it while the sender is up)."""
    incarnation = int(status(mesh, VICTIM)["incarnation"])
    lie = Reports(
        sender=VICTIM,
        incarnation=incarnation,
        floor=0,
        stream=STREAM,
        link_seq=MAX_U63,
        points=(),
        committed_point=-1,
        committed_digest=bytes(16),
    )
    forge_as_victim(mesh, [stream_topic(STREAM) + codec.encode(lie)])
    seq = 0
    for n in range(3):
        seq = commit_through(mesh, VICTIM, b"after a forged link counter %d" % n)
    for r in (0, 2):  # each reports it itself: it took relay 1's messages since
        wait_until(functools.partial(reported, mesh, r, seq), f"relay {r} to report {seq}")
