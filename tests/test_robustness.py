"""Hostile input against a LIVE relay mesh: property tests (hypothesis) on real sockets.

One mesh per module: relays 0, 1 and 2 serve `orders.*` and `audit`; relay 3 of the same
topology serves only `hostile`. The mesh is started whole (the launcher starts every relay
of a topology), then relay 3 is killed and this module binds a PUB at relay 3's mesh
endpoint: the SUBs of relays 0-2 connect to it as to any peer, so whatever it publishes
arrives as peer traffic from relay 3. Relays are not malicious in the protocol's fault
model (docs/protocol.md 1): a correctly formed lie is not detected. So the hostile peer
never forges another relay's id: every frame it publishes either fails validation
(garbage, truncated, wrong types, huge lengths, wrong part counts) or is a well-formed
message from relay 3 itself (which serves none of the others' streams).

After every example each relay must still answer a StatusReq and commit a produce, and a
read of `orders.eu` and `audit` from each relay must extend what was read before the example
(nothing removed or altered). Plus: oversized frames are refused (an OversizedFrame
ErrorResp, or the connection dropped by ZMQ_MAXMSGSIZE) and the relay keeps working; an
unknown stream gets a clear error. The example counts keep the module well under a minute;
the `slow` variants run ten times as many.

Every test runs twice: on a plain mesh, and on one with CurveZMQ (`curve`): there the hostile
PUB holds relay 3's key pair and the raw clients the `admin` client's, so the hostile
frames come from an authenticated peer and authenticated clients (docs/security.md: a
relay or client with a key is not trusted with anything beyond its rights either). The
probes' producer ids start with `admin/`, the name the ACLs bind producer ids to.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay import wire
from relay.client import Consumer, Producer
from relay.core import codec
from relay.core.config import Limits
from relay.core.messages import (
    Forward,
    Heartbeat,
    Interval,
    JoinRequest,
    Outcome,
    ReadStatus,
    RepairRequest,
    Reports,
    StreamStatus,
    Transaction,
    TxBatch,
    ViewDecided,
    ViewPhase,
    ViewRequest,
    ViewValue,
)
from relay.errors import FrameError, Rejected, UnknownStream
from relay.launcher import Mesh, query_status, write_loopback_topology
from relay.meta import KIND_META, META_FORMAT, METADATA_STREAM
from relay.metasync import META_SYNC_MARK
from relay.node import TOPIC_MAX_BYTES
from relay.security import ClientCurve, KeyRing, curve_server
from waiting import wait_until

pytestmark = pytest.mark.timeout(300)

RELAYS = (0, 1, 2)
HOSTILE = 3
STREAMS = ("orders.eu", "audit")
MAX_TX_BYTES = 64 * 1024
MAX_FRAME_BYTES = 1024 * 1024
REQUEST_LIMIT = wire.request_frame_limit(
    Limits(max_tx_bytes=MAX_TX_BYTES, max_frame_bytes=MAX_FRAME_BYTES)
)
ANSWER_TIMEOUT_S = 5.0
EXAMPLES = 200
SLOW_EXAMPLES = 2_000
MAX_U63 = (1 << 63) - 1
MAX_U64 = (1 << 64) - 1
MARKER = [b"H|robustness-marker", b"2 parts: counted as peer_bad_parts"]
PRODUCER = b"admin/p"  # a producer id the admin client may use


def write_topology(directory: Path, curve: bool) -> Path:
    subscriptions = {i: ["orders.*", "audit"] for i in RELAYS}
    subscriptions[HOSTILE] = ["hostile"]
    limits = {
        "max_tx_bytes": MAX_TX_BYTES,
        "max_frame_bytes": MAX_FRAME_BYTES,
        "max_batch_bytes": 262144,
    }
    return write_loopback_topology(
        directory, subscriptions, ["orders.eu", "audit"], limits, access={} if curve else None
    )


# --- a raw client -----------------------------------------------------------------------------


class RawClient:
    """A DEALER to one relay: sends any bytes, and waits for the answer to a request id."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, curve: ClientCurve | None) -> None:
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock, endpoint)
        self.sock.connect(endpoint)
        self._ids = itertools.count(1)

    def close(self) -> None:
        self.sock.close(linger=0)

    def send(self, parts: list[bytes]) -> None:
        self.sock.send_multipart(parts)

    def next_id(self) -> int:
        return next(self._ids)

    def ask(self, msg: wire.ClientMessage, timeout_s: float = ANSWER_TIMEOUT_S) -> Any:
        """Send a request; return the decoded answer with its request id (answers to
        earlier hostile requests are skipped). Fails the test if none comes in time."""
        self.sock.send(wire.encode(msg))
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0, f"{self.endpoint} did not answer {type(msg).__name__} in time"
            if not self.sock.poll(left_ms):
                continue
            # a REQ-style message (empty delimiter first) is answered with the delimiter
            frame = self.sock.recv_multipart()[-1]
            try:
                answer = wire.decode(frame, 64 * 1024 * 1024)
            except FrameError as e:
                raise AssertionError(f"{self.endpoint} sent an undecodable frame: {e}") from e
            if answer.request_id == msg.request_id:
                return answer

    def produce_batch(
        self, msg: wire.ProduceBatchReq, timeout_s: float = ANSWER_TIMEOUT_S
    ) -> dict[int, wire.BatchResult]:
        """Send a produce batch; return each item's result by item id (they may come in
        several ProduceBatchResp frames). Fails the test if one does not come in time."""
        self.sock.send(wire.encode(msg))
        wanted = {item[0] for item in msg.items}
        results: dict[int, wire.BatchResult] = {}
        deadline = time.monotonic() + timeout_s
        while not wanted <= results.keys():
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0, f"{self.endpoint} left items {wanted - results.keys()} unanswered"
            if not self.sock.poll(left_ms):
                continue
            answer = wire.decode(self.sock.recv_multipart()[-1], 64 * 1024 * 1024)
            if isinstance(answer, wire.ProduceBatchResp):
                results.update((r[0], r) for r in answer.results if r[0] in wanted)
        return results

    def status(self) -> dict[str, Any]:
        import json

        answer = self.ask(wire.StatusReq(self.next_id()))
        assert isinstance(answer, wire.StatusResp), answer
        doc: dict[str, Any] = json.loads(answer.status_json)
        return doc

    def read_all(self, stream: str) -> list[tuple[Any, ...]]:
        """Every entry the relay holds of `stream`. A relay starved of CPU for longer than
        the suspect timeout fences for a moment (it cannot tell a slow quorum from a lost
        one): such answers are retried."""
        entries: list[tuple[Any, ...]] = []
        after = -1
        while True:
            answer = wait_until(
                functools.partial(self.read_page, stream, after),
                f"{self.endpoint} to serve {stream} unfenced",
                poll_s=0.02,
            )
            if not answer.entries:
                return entries
            entries.extend(tuple(e) for e in answer.entries)
            after = answer.entries[-1][0]

    def read_page(self, stream: str, after: int) -> wire.ReadResp | None:
        """The entries of `stream` after `after`; None while the relay is fenced or not
        ready."""
        answer = self.ask(wire.ReadReq(self.next_id(), stream, after, 65_536, 0))
        assert isinstance(answer, wire.ReadResp), answer
        if answer.status in (ReadStatus.FENCED, ReadStatus.NOT_READY):
            return None
        assert answer.status is ReadStatus.OK, (self.endpoint, stream, answer.status)
        return answer


@dataclass
class Live:
    mesh: Mesh
    ctx: zmq.Context[Any]
    clients: dict[int, RawClient]
    hostile_pub: zmq.Socket[Any]
    curve: ClientCurve | None
    probe_seqs: Iterator[int] = field(default_factory=itertools.count)
    committed_probes: list[tuple[int, int]] = field(default_factory=list)  # (relay, seq)

    def endpoint(self, relay_id: int) -> str:
        return self.mesh.endpoints[relay_id].client

    def views(self) -> dict[tuple[int, str], list[tuple[Any, ...]]]:
        return {(r, s): self.clients[r].read_all(s) for r in RELAYS for s in STREAMS}

    def bad_parts(self) -> dict[int, int]:
        return self.node_counter("peer_bad_parts")

    def links_closed(self) -> dict[int, int]:
        return self.node_counter("peer_link_closed")

    def node_counter(self, name: str) -> dict[int, int]:
        return {r: int(self.clients[r].status()["node"]["counters"].get(name, 0)) for r in RELAYS}

    def commit_probe(self, relay_id: int) -> int:
        """Produce one transaction through `relay_id` itself; it must commit there (a
        fenced or unknown answer is retried on the same relay, same producer seq)."""
        client = self.clients[relay_id]
        pseq = next(self.probe_seqs)
        answers: list[wire.ProduceResp] = []

        def committed() -> bool:
            req = wire.ProduceReq(
                client.next_id(), "orders.eu", b"admin/probe", pseq, b"probe", b"%d" % pseq
            )
            answer = client.ask(req, timeout_s=10.0)
            assert isinstance(answer, wire.ProduceResp), answer
            assert answer.outcome in (Outcome.COMMITTED, Outcome.FENCED, Outcome.UNKNOWN), answer
            answers.append(answer)
            return answer.outcome is Outcome.COMMITTED

        wait_until(
            committed,
            lambda: f"a probe to commit on relay {relay_id} (last answer {answers[-1]})",
            poll_s=0.05,
        )
        self.committed_probes.append((relay_id, answers[-1].seq))
        return answers[-1].seq

    def check_alive_and_extending(
        self, before: dict[tuple[int, str], list[tuple[Any, ...]]]
    ) -> None:
        for r in RELAYS:
            assert self.mesh.alive(r), f"relay {r} exited with {self.mesh.returncode(r)}"
            assert self.clients[r].status()["relay"] == r
        for key, after in self.views().items():
            old = before[key]
            assert after[: len(old)] == old, f"relay {key[0]} stream {key[1]}: history changed"


def subscribed(relay_id: int, topic: bytes) -> bool:
    """Whether relay `relay_id`'s SUB takes a message with this first part."""
    prefixes = (b"S|orders.", b"S|audit|", b"D|%d|" % relay_id, b"H|")
    return any(topic.startswith(p) for p in prefixes)


def wait_bad_parts(live: Live, want: dict[int, int], resend_marker: bool) -> None:
    """Wait until every relay counted `want` bad peer frames; `resend_marker`: send the
    marker again each round (while a SUB has not joined, or rejoined, the PUB drops it)."""
    got: dict[int, int] = {}

    def seen() -> bool:
        got.update(live.bad_parts())
        if all(got[r] >= want[r] for r in RELAYS):
            return True
        if resend_marker:
            live.hostile_pub.send_multipart(MARKER)
        return False

    wait_until(
        seen,
        lambda: f"the relays to count the bad peer frames: {got} < {want}",
        poll_s=0.1 if resend_marker else 0.01,  # a marker every 100 ms is plenty
    )


@pytest.fixture(scope="module", params=["plain", "curve"])
def live(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    curved = request.param == "curve"
    directory = tmp_path_factory.mktemp("robust")
    mesh = Mesh(write_topology(directory, curved), log_level="warning", log_dir=directory / "logs")
    ctx: zmq.Context[Any] = zmq.Context()
    clients: dict[int, RawClient] = {}
    try:
        mesh.start(timeout_s=30)
        mesh.kill(HOSTILE)  # its place in the mesh is taken by the hostile PUB below
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        if curved:  # relay 3's own key: the relays' SUBs accept only that one
            curve_server(pub, KeyRing(mesh.config).relay_identity(HOSTILE), "mesh")
        pub.bind(mesh.endpoints[HOSTILE].mesh)
        clients = {r: RawClient(ctx, mesh.endpoints[r].client, mesh.curve) for r in RELAYS}
        live = Live(mesh, ctx, clients, pub, mesh.curve)
        # Slow joiner: wait until every relay's SUB receives what the hostile PUB sends.
        base = live.bad_parts()
        wait_bad_parts(live, {r: base[r] + 1 for r in RELAYS}, resend_marker=True)
        for r in RELAYS:
            live.commit_probe(r)
        yield live
    finally:
        for client in clients.values():
            client.close()
        ctx.destroy(linger=0)
        mesh.stop()


# --- strategies ---------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=MAX_U64)
    | st.floats(allow_nan=True)
    | st.text(max_size=16)
    | st.binary(max_size=32)
)
msgpack_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)
u63 = st.integers(min_value=0, max_value=MAX_U63)
huge_headers = st.sampled_from(
    [
        b"\xdd\xff\xff\xff\xff",  # array32 of 4 billion items
        b"\xdf\xff\xff\xff\xff",  # map32
        b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
        b"\xdb\x7f\xff\xff\xff",  # str32
        b"\xc9\xff\xff\xff\xff\x01",  # ext32
        b"\x97\x01\x01\xa9orders.eu\xc6\xff\xff\xff\xff",  # a ProduceReq whose id is bin32
        b"\x97\x01\x01\xa9orders.eu\xc4\x08producer\x01\xc0\xc6\x7f\xff\xff\xff",  # value
    ]
)


def mutate(frame: bytes, index: int, value: Any) -> bytes:
    """The message with one field (or the type code) replaced by `value`."""
    items = msgpack.unpackb(frame, raw=False)
    items[index % len(items)] = value
    packed: bytes = msgpack.packb(items, use_bin_type=True)
    return packed


@st.composite
def hostile_variants(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    """A frame built from a valid one, or from nothing: garbage, truncation, a field of the
    wrong type, huge length headers, trailing bytes, any msgpack value."""
    kind = draw(
        st.sampled_from(["raw", "truncated", "mutated", "huge", "trailing", "value", "valid"])
    )
    if kind == "raw":
        return draw(st.binary(max_size=512))
    if kind == "value":
        packed: bytes = msgpack.packb(draw(msgpack_values), use_bin_type=True)
        return packed
    if kind == "huge":
        return draw(huge_headers) + draw(st.binary(max_size=16))
    frame = draw(valid)
    if kind == "truncated":
        return frame[: draw(st.integers(min_value=0, max_value=len(frame) - 1))]
    if kind == "mutated":
        return mutate(frame, draw(st.integers(min_value=0, max_value=16)), draw(msgpack_values))
    if kind == "trailing":
        return frame + draw(st.binary(min_size=1, max_size=8))
    return frame


# client frames
client_streams = st.sampled_from([*STREAMS, "nosuch.stream", "hostile", METADATA_STREAM])
valid_client_frames = st.one_of(
    st.builds(
        wire.ProduceReq,
        u63,
        client_streams,
        st.binary(min_size=1, max_size=64),
        st.integers(min_value=0, max_value=MAX_U64),
        st.none() | st.binary(max_size=16),
        st.binary(max_size=256),
    ),
    st.builds(
        wire.ReadReq,
        u63,
        client_streams,
        st.integers(min_value=-1, max_value=MAX_U63),
        st.integers(min_value=1, max_value=65_536),
        st.integers(min_value=0, max_value=50),
    ),
    st.builds(wire.StatusReq, u63),
    st.builds(
        wire.MetaReq,
        u63,
        st.sampled_from(wire.META_OPS),
        st.text(max_size=16),
        st.integers(min_value=-1, max_value=MAX_U63),
    ),
    st.builds(wire.StreamsReq, u63, st.sampled_from(["*", "orders.*", "_relay.*", "[", "x"])),
    st.builds(wire.MetaResp, u63, st.sampled_from(wire.META_STATUSES)),  # not a request
    st.builds(wire.ProduceResp, u63, st.sampled_from(list(Outcome))),  # not requests
    st.builds(wire.ErrorResp, u63, st.text(max_size=8), st.text(max_size=8)),
).map(wire.encode)
# messages of one to three parts (a DEALER message has one: more is a bad envelope)
client_messages = st.lists(
    st.lists(hostile_variants(valid_client_frames), min_size=1, max_size=3),
    min_size=1,
    max_size=3,
)

# peer frames: well-formed ones come from relay 3 itself (never a forged sender)
digests = st.binary(min_size=16, max_size=16)
tx = st.builds(
    Transaction,
    st.binary(min_size=1, max_size=16),
    st.integers(min_value=0, max_value=MAX_U64),
    st.none() | st.binary(max_size=8),
    st.binary(max_size=64),
)
peer_streams = st.sampled_from([*STREAMS, "orders.us", "hostile", "nosuch"])
targets = st.integers(min_value=0, max_value=4)
floors = st.integers(min_value=0, max_value=MAX_U63)
# A view that would cut every member, from a relay that is not one: never adopted.
hostile_views = st.builds(
    ViewValue,
    st.integers(min_value=1, max_value=1_000),
    u63,
    u63,
    st.lists(
        st.builds(Interval, st.sampled_from([*RELAYS, HOSTILE]), u63, u63, u63), max_size=4
    ).map(tuple),
    st.lists(st.tuples(u63, tx), max_size=2).map(tuple),
)
valid_peer_frames = st.one_of(
    st.builds(
        Heartbeat,
        st.just(HOSTILE),
        u63,
        floors,
        st.lists(
            st.builds(StreamStatus, peer_streams, u63, u63, digests, st.booleans()), max_size=3
        ).map(tuple),
    ),
    st.builds(
        TxBatch,
        st.just(HOSTILE),
        u63,
        floors,
        peer_streams,
        u63,
        st.lists(st.tuples(u63, tx), max_size=3).map(tuple),
    ),
    st.builds(
        Reports,
        st.just(HOSTILE),
        u63,
        floors,
        peer_streams,
        u63,
        st.lists(st.tuples(u63, digests), max_size=3).map(tuple),
        u63,
        digests,
    ),
    st.builds(JoinRequest, st.just(HOSTILE), u63, floors, peer_streams, u63, u63),
    st.builds(Forward, st.just(HOSTILE), u63, floors, targets, peer_streams, u63, tx),
    st.builds(
        RepairRequest,
        st.just(HOSTILE),
        u63,
        floors,
        targets,
        peer_streams,
        u63,
        u63,
        u63,
        st.integers(min_value=-1, max_value=4),
    ),
    st.builds(
        ViewRequest,
        st.just(HOSTILE),
        u63,
        floors,
        targets,
        peer_streams,
        st.sampled_from(ViewPhase),
        u63,
        u63,
        st.lists(st.sampled_from(RELAYS), max_size=3).map(tuple),
        st.none() | hostile_views,
    ),
    st.builds(ViewDecided, st.just(HOSTILE), u63, floors, targets, peer_streams, hostile_views),
).map(codec.encode)
# The node's own frames beside the protocol's: the metadata transfer (relay/metasync.py).
sync_frames = st.one_of(
    st.builds(lambda body: META_SYNC_MARK + b"Q" + msgpack.packb(body), st.lists(u63, max_size=3)),
    st.builds(
        lambda body: META_SYNC_MARK + b"A" + msgpack.packb(body),
        st.lists(msgpack_values, max_size=7),
    ),
    st.binary(max_size=16).map(lambda tail: META_SYNC_MARK + tail),
)


def not_forged(frame: bytes) -> bool:
    try:
        msg = codec.decode(frame, MAX_FRAME_BYTES)
    except FrameError:
        return True
    return msg.sender == HOSTILE


topics = st.one_of(
    st.sampled_from([b"S|orders.eu|", b"S|audit|", b"D|0|", b"D|1|", b"D|2|", b"H|"]),
    st.text(max_size=12).map(lambda s: b"S|orders." + s.encode() + b"|"),
    st.binary(max_size=12),
)
peer_message = st.tuples(
    topics,
    hostile_variants(valid_peer_frames).filter(not_forged) | sync_frames,
    st.sampled_from([1, 1, 1, 1, 2, 3]),  # parts; 2 or 3 are dropped by the node
)
peer_messages = st.lists(peer_message, min_size=1, max_size=6)


# --- client frames ---------------------------------------------------------------------------


def hostile_client_case(live: Live, relay_id: int, messages: list[list[bytes]]) -> None:
    before = live.views()
    client = live.clients[relay_id]
    for parts in messages:
        client.send(parts)
    # The relay handles one connection's frames in order: once it answers this StatusReq
    # it has been through every hostile frame above.
    assert client.status()["relay"] == relay_id
    live.commit_probe(relay_id)
    live.check_alive_and_extending(before)


def client_test(examples: int) -> Callable[..., None]:
    @settings(
        max_examples=examples,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(relay_id=st.sampled_from(RELAYS), messages=client_messages)
    def test(live: Live, relay_id: int, messages: list[list[bytes]]) -> None:
        hostile_client_case(live, relay_id, messages)

    return test


test_hostile_client_frames_never_crash_nor_change_committed_data = client_test(EXAMPLES)
test_hostile_client_frames_long = pytest.mark.slow(client_test(SLOW_EXAMPLES))


# --- peer frames -----------------------------------------------------------------------------


def hostile_peer_case(live: Live, messages: list[tuple[bytes, bytes, int]]) -> None:
    before = live.views()
    base = live.bad_parts()
    want = {r: base[r] + 1 for r in RELAYS}  # the marker
    for topic, frame, parts in messages:
        if parts == 1:  # a mesh message: one part, the topic then the frame
            live.hostile_pub.send(topic + frame)
        else:
            live.hostile_pub.send_multipart([topic + frame, frame, frame][:parts])
            for r in RELAYS:
                want[r] += subscribed(r, topic)
    live.hostile_pub.send_multipart(MARKER)
    # Each link is FIFO: once a relay counted the marker it has been through every frame.
    wait_bad_parts(live, want, resend_marker=False)
    live.commit_probe(RELAYS[len(messages) % len(RELAYS)])
    live.check_alive_and_extending(before)


def peer_test(examples: int) -> Callable[..., None]:
    @settings(
        max_examples=examples,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(messages=peer_messages)
    def test(live: Live, messages: list[tuple[bytes, bytes, int]]) -> None:
        hostile_peer_case(live, messages)

    return test


test_hostile_peer_frames_never_crash_nor_change_committed_data = peer_test(EXAMPLES)
test_hostile_peer_frames_long = pytest.mark.slow(peer_test(SLOW_EXAMPLES))


def test_hostile_frames_are_counted_not_obeyed(live: Live) -> None:
    """Bad frames from a client or a peer are counted by kind (and dropped)."""
    for r in RELAYS:
        live.clients[r].send([b"\xc1"])  # a byte msgpack never uses
    base = live.bad_parts()
    live.hostile_pub.send(b"H|\xc1")
    live.hostile_pub.send_multipart(MARKER)
    wait_bad_parts(live, {r: base[r] + 1 for r in RELAYS}, resend_marker=False)
    for r in RELAYS:
        status = live.clients[r].status()
        core, node = status["counters"], status["node"]["counters"]
        assert core.get("frame_malformed", 0) > 0, core
        assert node.get("peer_bad_parts", 0) > 0, node
        assert node.get("client_frame_invalid", 0) > 0, node


# --- oversized frames ---------------------------------------------------------------------------


def test_oversized_client_frames_are_refused_and_the_relay_keeps_working(live: Live) -> None:
    before = live.views()
    client = live.clients[0]
    # Above the request limit (max_tx_bytes + overhead), below max_frame_bytes: an ErrorResp.
    big = wire.ProduceReq(client.next_id(), "orders.eu", PRODUCER, 0, None, b"x" * REQUEST_LIMIT)
    assert REQUEST_LIMIT < len(wire.encode(big)) < MAX_FRAME_BYTES
    answer = client.ask(big)
    assert isinstance(answer, wire.ErrorResp) and answer.error == "OversizedFrame", answer
    # A transaction just above max_tx_bytes in a frame the relay reads: rejected too_large.
    value = b"y" * (MAX_TX_BYTES - 22)  # size_bytes: 7 (producer id) + value + 16
    answer = client.ask(wire.ProduceReq(client.next_id(), "orders.eu", PRODUCER, 0, None, value))
    assert isinstance(answer, wire.ProduceResp), answer
    assert answer.outcome is Outcome.REJECTED and answer.reason == "too_large", answer
    # Above max_frame_bytes: ZMQ_MAXMSGSIZE drops the connection; nothing is answered.
    doomed = RawClient(live.ctx, live.endpoint(0), live.curve)
    try:
        doomed.send([b"z" * (MAX_FRAME_BYTES + 1)])
        assert not doomed.sock.poll(500), "an oversized frame was answered"
    finally:
        doomed.close()
    # The client library refuses it before sending (the topology gives it the limits).
    with (
        Producer(topology=live.mesh.config, request_timeout_s=2.0) as producer,
        pytest.raises(Rejected, match="too_large"),
    ):
        producer.send("orders.eu", b"w" * (MAX_TX_BYTES + 1))
    live.commit_probe(0)
    live.check_alive_and_extending(before)


def test_oversized_peer_frame_is_dropped_and_the_relays_keep_working(live: Live) -> None:
    # Runs after every other test that publishes from relay 3's endpoint: see below.
    before = live.views()
    base = live.bad_parts()
    closed = live.links_closed()
    # Above what any peer frame may be (max_frame_bytes, plus a Relayed's header).
    too_big = codec.peer_frame_limit(MAX_FRAME_BYTES) + TOPIC_MAX_BYTES + 1
    live.hostile_pub.send(b"H|" + b"\x00" * too_big)
    # The SUBs of relays 0-2 drop the connection (ZMQ_MAXMSGSIZE); each relay counts it.
    wait_until(
        lambda: all(live.links_closed()[r] > closed[r] for r in RELAYS),
        lambda: f"every relay to drop its link from the hostile peer: {live.links_closed()}",
    )
    for r in RELAYS:
        live.commit_probe(r)
    live.check_alive_and_extending(before)
    assert all(live.bad_parts()[r] == base[r] for r in RELAYS)  # the frame was not taken


def test_a_peer_link_recovers_after_an_oversized_frame(live: Live) -> None:
    # libzmq drops a SUB connection for a frame above ZMQ_MAXMSGSIZE and never connects
    # it again by itself; the node watches its SUB's disconnects and reconnects.
    base = live.bad_parts()
    wait_bad_parts(live, {r: base[r] + 1 for r in RELAYS}, resend_marker=True)


# --- unknown streams -----------------------------------------------------------------------------


def test_an_unknown_stream_gets_a_clear_error(live: Live) -> None:
    client = live.clients[1]
    answer = client.ask(wire.ProduceReq(client.next_id(), "nosuch.stream", PRODUCER, 0, None, b"v"))
    assert isinstance(answer, wire.ProduceResp), answer
    assert answer.outcome is Outcome.REJECTED and answer.reason == "unknown_stream", answer
    answer = client.ask(wire.ReadReq(client.next_id(), "nosuch.stream", -1, 10, 0))
    assert isinstance(answer, wire.ReadResp) and answer.status is ReadStatus.UNKNOWN_STREAM
    endpoints = {r: live.endpoint(r) for r in RELAYS}
    with (
        Producer(relays=endpoints, request_timeout_s=2.0, curve=live.curve) as producer,
        pytest.raises(UnknownStream, match=r"nosuch\.stream"),
    ):
        producer.send("nosuch.stream", b"v")
    with Consumer(relays=endpoints, timeout_s=5.0, curve=live.curve) as consumer:
        consumer.subscribe("nosuch.stream", "earliest")
        with pytest.raises(UnknownStream, match=r"nosuch\.stream"):
            next(consumer)
    replies = query_status(endpoints, 2.0, live.curve)
    assert all(reply.reachable for reply in replies.values())


# --- metadata operations of loose types ---------------------------------------------------------


def test_a_metadata_operation_of_a_loose_type_is_refused_and_its_batch_goes_on(
    live: Live,
) -> None:
    """issue 48, 1: an operation whose op was 2.0 (equal to the read barrier's 2) passed
    the checks; in a batch, the items before it were left pending for good (25 such
    batches held a relay at max_pending_produces). Now it is refused by name, and the
    items beside it commit."""
    client = live.clients[1]
    op = msgpack.packb([META_FORMAT, 2.0, "k", -1, None], use_bin_type=True)
    first = client.next_id()
    items: list[wire.BatchItem] = [
        (first + i, "orders.eu", int(time.time_ns()) + i, None, b"beside a loose op", 0)
        for i in range(3)
    ]
    items.append((first + 3, METADATA_STREAM, int(time.time_ns()) + 3, None, op, KIND_META))
    for _ in items[1:]:
        client.next_id()
    results = client.produce_batch(wire.ProduceBatchReq(client.next_id(), PRODUCER, tuple(items)))
    meta = results.pop(first + 3)
    assert meta[1] is Outcome.REJECTED and meta[3].startswith("invalid: op is"), meta
    assert {r[1] for r in results.values()} <= {Outcome.COMMITTED, Outcome.FENCED}, results
    assert client.status()["node"]["pending_produces"] == 0


# --- and at the end ----------------------------------------------------------------------------


def test_the_relays_still_agree_and_hold_every_probe(live: Live) -> None:
    """Every committed probe is in every relay's history, and the histories agree (one
    may lag: each is a prefix of the longest)."""
    probes = {seq for _, seq in live.committed_probes}
    assert probes
    views: dict[int, list[tuple[Any, ...]]] = {}
    missing: dict[int, set[int]] = {}

    def every_probe_held() -> bool:
        views.update({r: live.clients[r].read_all("orders.eu") for r in RELAYS})
        missing.update({r: probes - {e[0] for e in v} for r, v in views.items()})
        return not any(missing.values())

    wait_until(
        every_probe_held, lambda: f"every relay to hold every probe; missing {missing}", poll_s=0.1
    )
    longest = max(views.values(), key=len)
    for r, view in views.items():
        assert longest[: len(view)] == view, f"relay {r} disagrees"
