"""CurveZMQ identities and access rights (docs/security.md), on a live mesh with real keys.

Key files and the topology's `security:`/`access:` sections first; then one 3-relay mesh
with CurveZMQ on (module fixture), its clients `admin` (every right), `app` (produce and
consume `orders.*`) and `reader` (consume `audit` only). Each attack of issue 11 that keys
stop is tried as an outsider would: subscribing to a relay's mesh PUB, connecting to its
ROUTER, binding a dead relay's mesh endpoint, with no key or with a key of its own. Each
must end in a refused handshake (seen in the outsider's own socket monitor: a condition,
not a silence that might only mean "not yet"), and the mesh must go on committing.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from relay import wire
from relay.access import AccessPolicy, ClientGrant, Right
from relay.client import Consumer, Metadata, Producer
from relay.core import RelayCore
from relay.core.codec import encode
from relay.core.messages import Heartbeat
from relay.errors import ConfigError, KeyFileError, NotAuthorized
from relay.launcher import Mesh, query_status, write_loopback_topology
from relay.meta import (
    ABSENT,
    ANY_VERSION,
    KIND_META,
    METADATA_STREAM,
    OP_READ,
    READ_BARRIER_KEY,
    Mark,
    MetaOp,
    encode_mark,
    encode_op,
)
from relay.node import RelayNode
from relay.security import KeyRing, client_curve, curve_client, generate, load_identity
from relay.topology import loads
from waiting import bind_when_free, wait_until

pytestmark = pytest.mark.timeout(300)

STREAM = "orders.eu"
IDLE = "orders.idle"  # joined at the start, never written
START_TIMEOUT_S = 60.0
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
ACCESS = {
    "app": {"produce": ["orders.*"], "consume": ["orders.*"], "metadata": ["consumers/app-*"]},
    "reader": {"consume": ["audit"]},
}


# --- key files -------------------------------------------------------------------------------


def test_keygen_writes_owner_only_files_and_refuses_to_overwrite(tmp_path: Path) -> None:
    secret = generate(tmp_path / "keys", "client-x", client="x")
    public = secret.with_suffix(".key")
    for path in (secret, public):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    identity = load_identity(secret)
    assert len(identity.public_key) == len(identity.secret_key) == 40
    with pytest.raises(KeyFileError, match="exists already"):
        generate(tmp_path / "keys", "client-x")
    assert generate(tmp_path / "keys", "client-x", overwrite=True) == secret
    assert load_identity(secret) != identity


def test_a_secret_key_readable_by_others_or_broken_is_refused(tmp_path: Path) -> None:
    secret = generate(tmp_path, "relay-0")
    secret.chmod(0o644)
    with pytest.raises(KeyFileError, match=r"readable by its owner only \(mode 0644\)"):
        load_identity(secret)
    secret.chmod(0o600)
    with pytest.raises(KeyFileError, match="holds no secret key"):
        public = secret.with_suffix(".key")
        load_identity(public)
    with pytest.raises(KeyFileError, match="no such key file"):
        load_identity(tmp_path / "nothing.key_secret")
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text('curve\n    public-key = "short"\n    secret-key = "x"\n')
    garbage.chmod(0o600)
    with pytest.raises(KeyFileError, match=r"garbage\.key_secret"):
        load_identity(garbage)


# --- the topology ------------------------------------------------------------------------------

RELAY = "relays: [{id: 0, host: 127.0.0.1, mesh_port: 7, client_port: 8, streams: [a]%s}]\n"


def test_the_topology_names_every_security_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"access: missing; with security.curve on"):
        loads(RELAY % "" + "security: {curve: true}\n", tmp_path / "t.yaml")
    with pytest.raises(ConfigError, match=r"access: client rights need identities"):
        loads(RELAY % "" + "access: {app: {produce: [a]}}\n", tmp_path / "t.yaml")
    with pytest.raises(ConfigError, match=r"relays\[0\].public_key: 'nope' is not a CurveZMQ"):
        loads(RELAY % ", public_key: nope", tmp_path / "t.yaml")
    with pytest.raises(ConfigError, match=r"access.app.produc: unknown field; did you mean"):
        loads(
            RELAY % "" + "security: {curve: true}\naccess: {app: {produc: [a]}}\n",
            tmp_path / "t.yaml",
        )
    config = loads(
        RELAY % "" + "security: {curve: true, keys_dir: k}\n"
        "access: {app: {produce: ['a*'], consume: [b], metadata: ['consumers/app-*']}, "
        "ops: {admin: true, consume: ['*']}}\n",
        tmp_path / "t.yaml",
    )
    assert config.security.curve and config.security.keys_dir == tmp_path / "k"
    assert config.access.allows("app", Right.PRODUCE, "abc")
    assert not config.access.allows("app", Right.CONSUME, "abc")
    assert not config.access.allows("app", Right.ADMIN)
    assert config.access.allows("ops", Right.ADMIN)
    assert not config.access.allows("stranger", Right.CONSUME, "b")
    assert config.access.allows("app", Right.METADATA, "consumers/app-x/b")
    assert config.access.allows("app", Right.METADATA)  # some key: a read barrier
    assert not config.access.allows("app", Right.METADATA, "consumers/ops/b")
    assert not config.access.allows("ops", Right.METADATA)
    # "*" is the applications' streams; the mesh's own need a pattern naming them.
    assert not config.access.allows("ops", Right.CONSUME, "_relay.meta")
    with pytest.raises(
        ConfigError, match=r"access\.app\.metadata\[0\]: not a metadata key pattern"
    ):
        loads(
            RELAY % "" + "security: {curve: true}\naccess: {app: {metadata: ['']}}\n",
            tmp_path / "t.yaml",
        )


def run_relay(path: Path, relay_id: int) -> subprocess.CompletedProcess[str]:
    """`relay run` for a relay that is to refuse to start (exit 2, the line on stderr)."""
    return subprocess.run(
        [sys.executable, "-m", "relay", "run", "--config", str(path), "--relay", str(relay_id)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_relay_without_its_key_does_not_start(tmp_path: Path) -> None:
    path = write_loopback_topology(tmp_path, {0: ["a"], 1: ["a"]}, ["a"], access={})
    config = Mesh(path).config
    KeyRing(config).ensure()
    (config.security.keys_dir / "relay-1.key_secret").unlink()
    with pytest.raises(KeyFileError, match=r"relay-1.key_secret: no such key file"):
        RelayNode(config, 1, handle_signals=False, incarnation=1)
    # The CLI says so in one line, exit 2 (a configuration error).
    run = run_relay(path, 1)
    assert run.returncode == 2, run
    assert "relay-1.key_secret: no such key file" in run.stderr
    # A secret key that is not the one the topology gives the relay is refused too.
    public = config.security.keys_dir / "relay-1.key"
    listed = public.read_bytes()
    generate(config.security.keys_dir, "relay-1", overwrite=True)
    public.write_bytes(listed)
    with pytest.raises(KeyFileError, match="not the one the topology gives relay 1"):
        RelayNode(config, 1, handle_signals=False, incarnation=1)


def test_a_public_key_others_could_swap_is_refused_by_name(tmp_path: Path) -> None:
    """issue 48, 7: like ssh, a public key file or keys directory that others can write,
    or that belongs to another user, is refused: whoever could swap in their own key
    would be let in by it (a relay does not start, exit 2)."""
    path = write_loopback_topology(tmp_path, {0: ["a"], 1: ["a"]}, ["a"], access={"app": {}})
    config = Mesh(path).config
    KeyRing(config).ensure()
    keys = config.security.keys_dir
    public = keys / "client-app.key"
    public.chmod(0o664)
    with pytest.raises(KeyFileError, match=r"client-app.key: the key file can be written by"):
        KeyRing(config).client_names()
    run = run_relay(path, 1)
    assert run.returncode == 2, run
    assert "chmod go-w" in run.stderr, run.stderr
    public.chmod(0o644)
    keys.chmod(0o777)
    with pytest.raises(KeyFileError, match="the key directory can be written by others"):
        KeyRing(config).client_names()
    keys.chmod(0o700)
    if os.geteuid() == 0:  # (only root can give a file away)
        os.chown(public, 12345, -1)
        with pytest.raises(KeyFileError, match="belongs to user 12345"):
            KeyRing(config).client_names()
        os.chown(public, 0, -1)
    assert "app" in KeyRing(config).client_names().values()


def test_one_public_key_under_two_names_is_refused_by_name(tmp_path: Path) -> None:
    """issue 48, 7: one key listed for two clients (or a client and a relay) let in
    under whichever name came last; the file is now refused, naming both."""
    path = write_loopback_topology(
        tmp_path, {0: ["a"], 1: ["a"]}, ["a"], access={"app": {}, "admin": {"admin": True}}
    )
    config = Mesh(path).config
    KeyRing(config).ensure()
    keys = config.security.keys_dir
    (keys / "client-admin.key").write_bytes((keys / "client-app.key").read_bytes())
    both = r"client '(app|admin)' and client '(app|admin)' have the same public key"
    with pytest.raises(KeyFileError, match=both):
        KeyRing(config).client_names()
    (keys / "client-admin.key").write_bytes((keys / "relay-0.key").read_bytes())
    with pytest.raises(KeyFileError, match=r"client 'admin' and relay 0 have the same"):
        KeyRing(config).client_names()


def test_a_frame_claiming_another_sender_than_its_link_is_dropped(tmp_path: Path) -> None:
    path = write_loopback_topology(tmp_path, {0: ["a"], 1: ["a"], 2: ["a"]}, ["a"])
    core = RelayCore(Mesh(path).config.core_config(0), incarnation=1, now_ms=1_000)
    forged = encode(Heartbeat(2, 5, 1, ()))
    core.receive(forged, 1_000, 1_000, from_relay=1)  # read on relay 1's link
    assert core.counters["peer_sender_mismatch"] == 1
    core.receive(forged, 1_000, 1_000, from_relay=2)
    assert core.counters["peer_sender_mismatch"] == 1


def test_the_access_policy_binds_producer_ids_to_names() -> None:
    from relay.access import owns_producer_id

    policy = AccessPolicy({"app": ClientGrant(produce=("orders.*",))})
    assert policy.allows("app", Right.PRODUCE, "orders.eu")
    assert not policy.allows("app", Right.PRODUCE, "audit")
    assert owns_producer_id("app", b"app/1")
    assert not owns_producer_id("app", b"app/")
    assert not owns_producer_id("app", b"apple/1")
    assert not owns_producer_id("app", b"admin/1")


# --- a live mesh with CurveZMQ ------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    directory = tmp_path_factory.mktemp("security")
    path = write_loopback_topology(
        directory,
        {r: ["orders.*", "audit"] for r in range(3)},
        [STREAM, "audit", IDLE],
        access=ACCESS,
    )
    running = Mesh(path, log_level="warning", log_dir=directory / "logs")
    try:
        running.start(timeout_s=START_TIMEOUT_S)
        yield running
    finally:
        running.stop()


def key_file(mesh: Mesh, client: str) -> Path:
    return mesh.config.security.keys_dir / f"client-{client}.key_secret"


def commit_one(mesh: Mesh, value: bytes = b"v") -> int:
    with Producer(topology=mesh.config, send_timeout_s=60) as producer:
        return producer.send(STREAM, value)


def counters(mesh: Mesh, relay_id: int) -> dict[str, Any]:
    status = mesh.status(relay_id, timeout_s=10)
    assert status is not None
    node: dict[str, Any] = status["node"]
    return node


class Outsider:
    """A socket of a process that is not in the topology, and its monitor."""

    def __init__(self, kind: int) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.monitor = self.sock.get_monitor_socket(
            HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )

    def handshake_failed(self) -> bool:
        """Wait for the next handshake event; True if it failed."""
        while True:
            assert self.monitor.poll(30_000), "no handshake event within 30 s"
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return False
            if event & HANDSHAKE_FAILED:
                return True

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def outsider_sub() -> Iterator[Outsider]:
    outsider = Outsider(zmq.SUB)
    yield outsider
    outsider.close()


def test_an_outsider_without_a_key_cannot_read_the_mesh(mesh: Mesh, outsider_sub: Outsider) -> None:
    outsider_sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
    outsider_sub.sock.connect(mesh.endpoints[0].mesh)
    assert outsider_sub.handshake_failed()
    commit_one(mesh)
    assert not outsider_sub.sock.poll(0)


def test_an_outsider_with_a_key_of_its_own_cannot_read_the_mesh(
    mesh: Mesh, outsider_sub: Outsider, tmp_path: Path
) -> None:
    """It knows relay 0's public key (public keys are no secret) and has a key pair; the
    relay's ZAP handler refuses every key but its peers'."""
    refused = counters(mesh, 0)["handshakes_refused"]
    own = load_identity(generate(tmp_path, "relay-9"))
    curve_client(outsider_sub.sock, own, KeyRing(mesh.config).relay_public_key(0))
    outsider_sub.sock.setsockopt(zmq.SUBSCRIBE, b"")
    outsider_sub.sock.connect(mesh.endpoints[0].mesh)
    assert outsider_sub.handshake_failed()
    assert counters(mesh, 0)["handshakes_refused"] > refused
    commit_one(mesh)
    assert not outsider_sub.sock.poll(0)


def test_a_client_without_a_listed_key_cannot_connect(mesh: Mesh, tmp_path: Path) -> None:
    stranger = generate(tmp_path, "client-stranger")
    with pytest.raises(KeyFileError, match="belongs to no client"):
        Producer(topology=mesh.config, key_file=stranger)
    outsider = Outsider(zmq.DEALER)
    try:
        curve_client(
            outsider.sock, load_identity(stranger), KeyRing(mesh.config).relay_public_key(1)
        )
        outsider.sock.connect(mesh.endpoints[1].client)
        outsider.sock.send(wire.encode(wire.StatusReq(1)))
        assert outsider.handshake_failed()
        assert not outsider.sock.poll(0)
    finally:
        outsider.close()
    plain = Outsider(zmq.DEALER)  # and without any key
    try:
        plain.sock.connect(mesh.endpoints[1].client)
        plain.sock.send(wire.encode(wire.StatusReq(1)))
        assert plain.handshake_failed()
    finally:
        plain.close()


def test_an_outsider_at_a_dead_relays_endpoint_is_not_heard(mesh: Mesh) -> None:
    """The attack that forged a committed transaction: bind relay 2's mesh endpoint while
    relay 2 is down and publish as relay 2. The relays' SUBs accept only relay 2's key, so
    the handshake fails on both of their links, and nothing is taken."""
    mesh.kill(2)
    outsider = Outsider(zmq.PUB)
    try:
        own = load_identity(generate(mesh.config.data_dir / "outsider", "relay-2"))
        outsider.sock.setsockopt(zmq.CURVE_SERVER, 1)
        outsider.sock.setsockopt(zmq.CURVE_SECRETKEY, own.secret_key)
        bind_when_free(outsider.sock, mesh.endpoints[2].mesh)
        for _ in range(4):  # relays 0 and 1 try again and again; never in
            assert outsider.handshake_failed()
        # A heartbeat with the highest incarnation (which used to make relays 0 and 1 drop
        # each other's frames for good) has no connection to travel on.
        outsider.sock.send(b"H|" + encode(Heartbeat(2, (1 << 63) - 1, 1, ())))
        assert commit_one(mesh) > 0
    finally:
        outsider.close()
        mesh.restart(2, timeout_s=START_TIMEOUT_S)
    assert commit_one(mesh) > 0


def refusal_logged(
    mesh: Mesh, relay_id: int, connect: Callable[[Outsider], None], words: str
) -> str:
    """Make handshakes that relay `relay_id` refuses (a new outsider each, `connect` sets
    it up and connects it) until its log has a line with `words` (the log is rate
    limited: an earlier test's refusal may have used this second's line); that line."""
    assert mesh.log_dir is not None
    log = mesh.log_dir / f"relay-{relay_id}.log"

    def refused_and_logged() -> str | None:
        outsider = Outsider(zmq.DEALER)
        try:
            connect(outsider)
            assert outsider.handshake_failed()
        finally:
            outsider.close()
        found = [line for line in log.read_text(errors="replace").splitlines() if words in line]
        return found[-1] if found else None

    return wait_until(refused_and_logged, f"relay {relay_id} logging {words!r}", poll_s=0.2)


def test_every_refused_handshake_is_counted_and_logged(mesh: Mesh, tmp_path: Path) -> None:
    """issue 48, 9 (of item 7): only the handshakes the ZAP handler refused were counted
    (61 failed handshakes, counter +0), and none was logged. Now the client socket's
    monitor counts every refused handshake: a key pair the relay does not know (ZAP
    refuses it: logged with the peer's address), a client holding another public key
    for the relay, and one without CurveZMQ (both fail before ZAP)."""
    endpoint = mesh.endpoints[1].client
    relay_key = KeyRing(mesh.config).relay_public_key(1)
    own = load_identity(generate(tmp_path, "client-stranger"))
    app = load_identity(key_file(mesh, "app"))
    wrong_key = load_identity(generate(tmp_path, "relay-9")).public_key
    before = counters(mesh, 1)

    def unknown_key(outsider: Outsider) -> None:
        curve_client(outsider.sock, own, relay_key)
        outsider.sock.connect(endpoint)

    def wrong_server_key(outsider: Outsider) -> None:
        curve_client(outsider.sock, app, wrong_key)
        outsider.sock.connect(endpoint)

    def no_curve(outsider: Outsider) -> None:
        outsider.sock.connect(endpoint)

    line = refusal_logged(mesh, 1, unknown_key, "its key is not listed")
    assert "refused a clients handshake at " in line and "from 127.0.0.1" in line, line
    line = refusal_logged(mesh, 1, wrong_server_key, "does not decrypt")
    assert "another public key for this relay" in line, line
    refusal_logged(mesh, 1, no_curve, "another security mechanism")

    def counted() -> dict[str, Any] | None:
        now = counters(mesh, 1)
        kinds = ("handshakes_refused_auth", "handshakes_refused_protocol")
        grown = all(now["counters"].get(k, 0) > before["counters"].get(k, 0) for k in kinds)
        return (
            now if grown and now["handshakes_refused"] >= before["handshakes_refused"] + 3 else None
        )

    now = wait_until(counted, "relay 1 counting the refused handshakes")
    assert now["handshakes_refused"] == sum(
        now["counters"].get(f"handshakes_refused_{kind}", 0)
        for kind in ("auth", "protocol", "no_detail")
    )
    assert commit_one(mesh) > 0


# --- rights -------------------------------------------------------------------------------------


def test_rights_are_enforced_and_named(mesh: Mesh) -> None:
    app = key_file(mesh, "app")
    with Producer(topology=mesh.config, key_file=app, send_timeout_s=60) as producer:
        assert producer.producer_id.startswith(b"app/")
        committed = producer.send(STREAM, b"by app")
        with pytest.raises(NotAuthorized, match="no produce right on stream 'audit'") as denied:
            producer.send("audit", b"x")
        assert (denied.value.right, denied.value.stream) == ("produce", "audit")
        assert not denied.value.retriable
    # Another client's producer id: refused, whatever the stream.
    with (
        Producer(topology=mesh.config, key_file=app, producer_id=b"admin/1") as producer,
        pytest.raises(NotAuthorized, match="only under producer ids starting with 'app/'"),
    ):
        producer.send(STREAM, b"x")
    reader = key_file(mesh, "reader")
    with (
        Consumer(topology=mesh.config, key_file=reader, store=False, timeout_s=30) as consumer,
        pytest.raises(NotAuthorized, match=r"no consume right on stream 'orders\.eu'"),
    ):
        next(consumer.subscribe(STREAM, "earliest"))
    with Consumer(topology=mesh.config, key_file=app, store=False, timeout_s=30) as consumer:
        consumer.subscribe(STREAM, committed - 1)
        assert next(consumer).value == b"by app"
    # Status is an admin request.
    replies = query_status({0: mesh.endpoints[0].client}, 10.0, client_curve(mesh.config, reader))
    assert "NotAuthorized" in (replies[0].error or ""), replies
    node = counters(mesh, 0)["counters"]
    assert node.get("not_authorized_admin", 0) >= 1, node


def test_a_pattern_reads_only_the_streams_the_client_may_consume(mesh: Mesh) -> None:
    admin = key_file(mesh, "admin")
    with Producer(topology=mesh.config, key_file=admin, send_timeout_s=60) as producer:
        audit = producer.send("audit", b"for the reader")
        orders = producer.send("orders.pattern", b"for the app")
    seen: dict[str, set[str]] = {}
    for client in ("reader", "app"):
        with Consumer(
            topology=mesh.config, key_file=key_file(mesh, client), store=False, timeout_s=30
        ) as consumer:
            consumer.subscribe("*", min(audit, orders) - 1)
            # The relays list only streams this client may consume: no refusal to raise.
            next(consumer)
            seen[client] = set(consumer.streams)
    assert seen["reader"] == {"audit"}
    assert "audit" not in seen["app"] and "orders.pattern" in seen["app"]


def test_metadata_rights_are_per_key(mesh: Mesh) -> None:
    app = key_file(mesh, "app")
    with Metadata(topology=mesh.config, key_file=key_file(mesh, "admin")) as admin:
        admin.write("jobs/nightly", b"admin's", ANY_VERSION)
    with Producer(topology=mesh.config, key_file=app, send_timeout_s=60) as producer:
        first = producer.send(STREAM, b"for a durable reader")
    # The app keeps the marks of its own durable consumers ...
    with Consumer(
        topology=mesh.config, key_file=app, durable="app-billing", store=False, timeout_s=30
    ) as billing:
        assert next(billing.subscribe(STREAM, first - 1)).seq == first
        assert billing.commit() == first
    # ... and can neither use another name nor see or write other keys.
    with (
        Consumer(
            topology=mesh.config, key_file=app, durable="payroll", store=False, timeout_s=30
        ) as other,
        pytest.raises(NotAuthorized, match="no metadata right on key 'consumers/payroll/") as no,
    ):
        other.subscribe(STREAM, "earliest")
    assert (no.value.right, no.value.retriable) == ("metadata", False)
    with Metadata(topology=mesh.config, key_file=app) as meta:
        assert [v.key for v in meta.list("")] == [f"consumers/app-billing/{STREAM}"]
        with pytest.raises(NotAuthorized, match="no metadata right on key 'jobs/nightly'"):
            meta.write("jobs/nightly", b"app's", ANY_VERSION)
        with pytest.raises(NotAuthorized, match="no metadata right on key 'jobs/nightly'"):
            meta.read("jobs/nightly")
    with (
        Metadata(topology=mesh.config, key_file=key_file(mesh, "reader")) as meta,
        pytest.raises(NotAuthorized, match="client 'reader' has no metadata right"),
    ):
        meta.list("")
    # Reading the metadata stream itself is a consume right that "*" does not give.
    with (
        Consumer(topology=mesh.config, key_file=app, store=False, timeout_s=30) as raw,
        pytest.raises(NotAuthorized, match=r"no consume right on stream '_relay\.meta'"),
    ):
        next(raw.subscribe(METADATA_STREAM, "earliest"))
    assert sum(counters(mesh, r)["counters"].get("not_authorized_metadata", 0) for r in range(3))


def barrier(mesh: Mesh, client: str, key: str) -> int:
    """Commit a read barrier naming `key` as `client`; its seq."""
    op = encode_op(MetaOp(OP_READ, key, ANY_VERSION, None))
    with Producer(topology=mesh.config, key_file=key_file(mesh, client), send_timeout_s=60) as p:
        return p.send(METADATA_STREAM, op, kind=KIND_META)


def test_a_barrier_and_an_outcome_tell_nothing_of_keys_the_client_may_not_read(
    mesh: Mesh,
) -> None:
    """issue 48, 8: `app` could commit a barrier naming any key and read its outcome,
    which carried that key's version (a commit time): it could watch another consumer's
    commits. Now a barrier on a key needs the right on it, an outcome is shown only to a
    client that may read its key (and the refusal does not name the key), and the client
    library's own barrier works for every client with a metadata right, its outcome
    carrying no version."""
    secret = "consumers/payroll/orders.eu"
    with Metadata(topology=mesh.config, key_file=key_file(mesh, "admin")) as admin:
        written = admin.write(secret, b"payroll's mark", ANY_VERSION)
        admins = barrier(mesh, "admin", secret)  # admin may read the key: it sees the version
        assert admin._ask("outcome", "", admins).version == written
    with pytest.raises(NotAuthorized, match=f"no metadata right on key '{secret}'"):
        barrier(mesh, "app", secret)
    with pytest.raises(NotAuthorized, match="client 'reader' has no metadata right"):
        barrier(mesh, "reader", READ_BARRIER_KEY)
    with Metadata(topology=mesh.config, key_file=key_file(mesh, "app")) as app:
        assert app.read(f"consumers/app-x/{STREAM}", linearizable=True) is None
        own = app._ask("outcome", "", app.last_seq)
        assert (own.result, own.version) == ("applied", ABSENT)
        for seq in (written, admins):  # another's write, another's barrier
            with pytest.raises(NotAuthorized) as refused:
                app._ask("outcome", "", seq)
            assert f"the key of the metadata operation at seq {seq}" in str(refused.value)
            assert "payroll" not in str(refused.value)


def relay_cli(mesh: Mesh, client: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A `relay` command against the mesh as `client`."""
    return subprocess.run(
        [sys.executable, "-m", "relay", *args, "--config", str(mesh.config.path)],
        capture_output=True,
        text=True,
        env={**os.environ, "RELAY_KEY_FILE": str(key_file(mesh, client))},
        timeout=120,
    )


def test_a_value_that_is_not_a_mark_is_named_not_a_traceback(mesh: Mesh) -> None:
    """issue 48, 9a: `app` may write any value under its consumers' keys; one that is not
    a mark made `relay consumers list` fail with a traceback, for the operator too. Now
    it is listed with the key and the problem, the marks beside it as before, and
    `relay consumers delete` removes it."""
    bad, odd = f"consumers/app-bad/{STREAM}", "consumers/app-nostream"
    with Metadata(topology=mesh.config, key_file=key_file(mesh, "app")) as app:
        app.write(bad, b"not a mark", ANY_VERSION)
        app.write(odd, encode_mark(Mark(5)), ANY_VERSION)
        app.write(f"consumers/app-good/{STREAM}", encode_mark(Mark(7)), ANY_VERSION)
    try:
        for client in ("app", "admin"):
            listed = relay_cli(mesh, client, "consumers", "list")
            assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed
            lines = {line["durable"]: line for line in map(json.loads, listed.stdout.splitlines())}
            assert lines["app-good"]["seq"] == "7" and "problem" not in lines["app-good"]
            assert lines["app-bad"]["key"] == bad and lines["app-bad"]["seq"] is None
            assert "not a consumer mark" in lines["app-bad"]["problem"]
            assert lines[None]["key"] == odd and "not a mark's key" in lines[None]["problem"]
            assert f"warning: {bad!r} is skipped: not a consumer mark" in listed.stderr
        shown = relay_cli(mesh, "app", "consumers", "show", "app-bad")
        assert shown.returncode == 0 and "not a consumer mark" in shown.stdout, shown
        removed = relay_cli(mesh, "app", "consumers", "delete", "app-bad")
        assert removed.returncode == 0, removed
    finally:
        with Metadata(topology=mesh.config, key_file=key_file(mesh, "admin")) as admin:
            for item in admin.list("consumers/app-"):
                if item.key != f"consumers/app-billing/{STREAM}":
                    admin.delete(item.key, item.version)


def test_a_consume_of_an_empty_stream_times_out_cleanly_without_the_admin_right(
    mesh: Mesh,
) -> None:
    """issue 48, 9b: `relay consume --timeout-s` that got no record asks whether any relay
    answers, with a status request; refused it to a client without the admin right and
    took the refusal for silence: exit 1, "no relay ... answers". A refusal says the relay
    runs: `app` now ends as `admin` does."""
    ended = {}
    for client in ("admin", "app"):
        done = relay_cli(mesh, client, "consume", "--stream", IDLE, "--timeout-s", "1")
        ended[client] = (done.returncode, done.stdout, done.stderr)
    assert ended["app"] == ended["admin"] == (0, "", ""), ended


def test_the_cli_takes_key_files_and_names_refusals(mesh: Mesh) -> None:
    config = str(mesh.config.path)
    env = {**os.environ, "RELAY_KEY_FILE": str(key_file(mesh, "reader"))}
    status = subprocess.run(
        [sys.executable, "-m", "relay", "status", "--config", config, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert status.returncode == 1 and "NotAuthorized" in status.stdout, status
    admin = [sys.executable, "-m", "relay", "status", "--config", config, "--json"]
    ok = subprocess.run(
        [*admin, "--key-file", str(key_file(mesh, "admin"))],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ok.returncode == 0, ok
    verify = subprocess.run(
        [sys.executable, "-m", "relay", "store", "verify", "--config", config],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert verify.returncode == 1, verify
    assert "NotAuthorized: client 'reader' has no admin right" in verify.stderr


def test_rights_changed_in_the_file_apply_on_reload_without_a_restart(tmp_path: Path) -> None:
    """docs/deploy.md section 9: rights are edited in the topology file and the relays
    read it again (`relay reconfigure --apply`, as admin): from then on `reader` may
    produce to audit, which it could not; taking the right away again refuses its next
    produce by name. No relay restarts."""
    import yaml  # type: ignore[import-untyped, unused-ignore]

    path = write_loopback_topology(
        tmp_path, {r: ["orders.*", "audit"] for r in range(3)}, [STREAM, "audit"], access=ACCESS
    )
    mesh = Mesh(path, log_level="warning", log_dir=tmp_path / "logs")
    try:
        mesh.start(timeout_s=START_TIMEOUT_S)
        pids = dict(mesh.pids)
        reader, admin = key_file(mesh, "reader"), key_file(mesh, "admin")

        def reader_produces() -> int:
            with Producer(topology=mesh.config, key_file=reader, send_timeout_s=60) as producer:
                return producer.send("audit", b"by reader")

        def grant(produce: list[str]) -> None:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
            doc["access"]["reader"]["produce"] = produce
            path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
            command = [sys.executable, "-m", "relay", "reconfigure", "--config", str(path)]
            done = subprocess.run(
                [*command, "--apply", "--key-file", str(admin)],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            for relay_id in range(3):
                assert f"relay {relay_id}: took the file: rights of clients ['reader']" in (
                    done.stdout
                ), done.stdout

        with pytest.raises(NotAuthorized, match="no produce right on stream 'audit'"):
            reader_produces()
        grant(["audit"])
        assert reader_produces() > 0
        grant([])
        with pytest.raises(NotAuthorized, match="no produce right on stream 'audit'"):
            reader_produces()
        assert mesh.pids == pids  # nothing restarted
    finally:
        mesh.stop()
