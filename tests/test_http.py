"""Each relay's HTTP endpoint (relay/opsserver.py): /metrics in Prometheus' format,
/healthz, /readyz, /status and the page, on real relay processes, and what it does with
requests it cannot serve."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import itertools
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from relay.cli import main
from relay.client import Consumer, Producer
from relay.core.seq import relay_of
from relay.errors import UnknownStream
from relay.launcher import Mesh, query_status, resubscribe, write_loopback_topology
from relay.node import RelayNode
from relay.opsserver import (
    MAX_CONNECTIONS_PER_ADDRESS,
    STATUS_MIN_INTERVAL_S,
    STATUS_WAIT_S,
    Bounds,
    OpsServer,
    StatusSource,
)
from relay.topology import MeshConfig, load
from waiting import wait_until, wait_until_async

ROOT = Path(__file__).resolve().parent.parent
RELAYS = 3
STREAM = "orders.eu"
PRODUCED = 40
HTTP_TIMEOUT_S = 30.0  # one request (the relay answers within its STATUS_WAIT_S)
SEGMENT_MAX_AGE_MS = 200  # spooled records reach a segment soon (the default: 10 s)


def write_topology(directory: Path) -> Path:
    """A 3-relay mesh on free ports of 127.0.0.1, every relay with an http_port and a
    spool, as the default topology has."""
    subscriptions = {i: ["orders.*"] for i in range(RELAYS)}
    spool = {"enabled": True, "segment_max_age_ms": SEGMENT_MAX_AGE_MS}
    return write_loopback_topology(directory, subscriptions, [STREAM], spool=spool, http=True)


def request(
    port: int, path: str, method: str = "GET", source: str | None = None, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers by lower-case name, body) of one request to 127.0.0.1:port (from
    the address `source`, if given)."""
    conn = http.client.HTTPConnection(
        "127.0.0.1",
        port,
        timeout=HTTP_TIMEOUT_S,
        source_address=None if source is None else (source, 0),
    )
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def get(
    mesh: Mesh, relay: int, path: str, method: str = "GET", **headers: str
) -> tuple[int, dict[str, str], bytes]:
    port = mesh.config.relays[relay].http_port
    assert port is not None
    return request(port, path, method, **headers)


def metrics(mesh: Mesh, relay: int) -> dict[str, list[Any]]:
    """Metric family name -> its samples."""
    code, headers, body = get(mesh, relay, "/metrics")
    assert code == 200 and headers["content-type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(body.decode())}


def values(families: dict[str, list[Any]], name: str, **labels: str) -> list[float]:
    """The values of the samples `name` (a counter's has `_total`) with exactly `labels`."""
    return [
        float(s.value)
        for samples in families.values()
        for s in samples
        if s.name == name and s.labels == labels
    ]


def sample(families: dict[str, list[Any]], name: str, **labels: str) -> float:
    """The value of the one sample `name` with exactly `labels`."""
    found = values(families, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp_path = tmp_path_factory.mktemp("http")
    mesh = Mesh(write_topology(tmp_path), log_level="warning", log_dir=tmp_path / "logs")
    with mesh.start(timeout_s=60):
        with Producer(topology=mesh.config) as producer:
            for i in range(PRODUCED):
                producer.send(STREAM, f"value-{i}".encode())
        yield mesh


def test_metrics_name_what_the_issue_asks_for_and_move_with_commits(mesh: Mesh) -> None:
    def committed(relay: int) -> float:
        families = metrics(mesh, relay)
        return sample(families, "relay_stream_committed_records_total", stream=STREAM)

    for relay in range(RELAYS):
        wait_until(
            lambda r=relay: committed(r) == PRODUCED,  # type: ignore[misc]
            f"relay {relay} to count {PRODUCED} committed records of {STREAM}",
        )
    families = metrics(mesh, 0)
    expected = {
        "relay_info",
        "relay_stream_committed_records",
        "relay_stream_served_records",
        "relay_stream_committed_timestamp_seconds",
        "relay_stream_committed_age_seconds",
        "relay_stream_commit_lag_seconds",
        "relay_stream_uncommitted_entries",
        "relay_stream_held_entries",
        "relay_stream_held_bytes",
        "relay_stream_joined",
        "relay_stream_fenced",
        "relay_stream_repairing",
        "relay_stream_stalled_seconds",
        "relay_produce_refusals",
        "relay_produce_latency_seconds",
        "relay_client_connections",
        "relay_pending_produces",
        "relay_parked_reads",
        "relay_memory_bytes",
        "relay_peer_heard",
        "relay_peer_routed_via",
        "relay_events",
        "relay_repairs",
        "relay_spool_backlog_bytes",
        "relay_spool_records_written",
        "relay_spool_full",
    }
    assert expected <= set(families), expected - set(families)
    assert sample(families, "relay_stream_held_entries", stream=STREAM) == PRODUCED
    assert sample(families, "relay_stream_fenced", stream=STREAM, reason="") == 0
    assert sample(families, "relay_stream_stalled_seconds", stream=STREAM, reason="") == 0
    assert sample(families, "relay_peer_heard", peer="1") == 1
    # The committed seq's time is now-ish (seconds since 1970, not since the seq epoch).
    assert sample(families, "relay_stream_committed_timestamp_seconds", stream=STREAM) > 1.7e9
    # Every produce was answered by the relay that took it: the histograms count them all.
    answered = sum(
        sample(metrics(mesh, r), "relay_produce_latency_seconds_count") for r in range(RELAYS)
    )
    assert answered == PRODUCED
    # The spool writes what the relay committed (the metadata stream's records besides).
    wait_until(
        lambda: sample(metrics(mesh, 0), "relay_spool_records_written_total") >= PRODUCED,
        f"relay 0's spool to write the {PRODUCED} records",
    )


def test_records_read_by_a_consumer_are_counted_where_it_read_them(mesh: Mesh) -> None:
    endpoint = mesh.config.relays[2].client_endpoint
    with Consumer([endpoint], timeout_s=HTTP_TIMEOUT_S) as consumer:
        consumer.subscribe(STREAM, "earliest")
        for count, _ in enumerate(consumer, start=1):
            if count == PRODUCED:
                break
    # (a document is shared for STATUS_MIN_INTERVAL_S: one from before the reads may answer)
    wait_until(
        lambda: (
            sample(metrics(mesh, 2), "relay_stream_served_records_total", stream=STREAM) >= PRODUCED
        ),
        f"relay 2 to count {PRODUCED} records served",
    )
    assert sample(metrics(mesh, 1), "relay_stream_served_records_total", stream=STREAM) == 0


def documented(guide: str, name: str) -> bool:
    """Whether the guide names `name` in backquotes (a metric: with its labels or _total)."""
    return re.search("`" + re.escape(name) + r"(_total)?[`{]", guide) is not None


def test_the_operations_guide_explains_every_metric_and_status_field(mesh: Mesh) -> None:
    guide = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    missing = [name for name in metrics(mesh, 0) if not documented(guide, name)]
    assert not missing, f"docs/operations.md does not explain the metrics {missing}"
    doc = json.loads(get(mesh, 0, "/status")[2])
    fields = {
        *doc,
        *doc["node"],
        *doc["metadata"],
        *doc["metadata"]["sync"],
        *doc["spool"],
        *(field for st in doc["streams"].values() for field in st),
    }
    missing = sorted(field for field in fields if not documented(guide, field))
    assert not missing, f"docs/operations.md does not explain the status fields {missing}"


def test_refusals_are_counted_by_stream_outcome_and_reason(mesh: Mesh) -> None:
    endpoint = {0: mesh.config.relays[0].client_endpoint}
    with Producer(endpoint, max_attempts=1) as producer, pytest.raises(UnknownStream):
        producer.send("nobody.serves.this", b"to a stream no relay serves")
    # Counted under "" (a stream the relay does not have): made-up names add no labels.
    refused = {"stream": "", "outcome": "rejected", "reason": "unknown_stream"}
    wait_until(
        lambda: values(metrics(mesh, 0), "relay_produce_refusals_total", **refused) == [1],
        "relay 0 to count the refused produce",
    )


def test_health_readiness_status_and_page(mesh: Mesh) -> None:
    code, headers, body = get(mesh, 1, "/healthz")
    assert code == 200 and json.loads(body) == {"incarnation": 1, "live": True, "relay": 1}
    code, _, body = get(mesh, 1, "/readyz")
    assert code == 200 and json.loads(body)["ready"] is True
    code, headers, body = get(mesh, 2, "/status")
    doc = json.loads(body)
    assert code == 200 and headers["access-control-allow-origin"] == "*"
    committed = doc["streams"][STREAM]["committed"]
    assert isinstance(committed, str) and int(committed) > 2**53  # a seq, exact, as text
    assert doc["node"]["http"]["0"] == f"http://127.0.0.1:{mesh.config.relays[0].http_port}"
    code, headers, body = get(mesh, 0, "/")
    assert code == 200 and headers["content-type"].startswith("text/html")
    assert b"<html" in body.lower() or b"<!doctype html" in body.lower()


def test_requests_it_cannot_serve_get_clean_answers(mesh: Mesh) -> None:
    code, _, body = get(mesh, 0, "/nothing-here")
    assert code == 404 and "/metrics" in json.loads(body)["error"]
    code, _, _ = get(mesh, 0, "/metrics", method="POST")
    assert code == 405
    code, _, _ = get(mesh, 0, "/metrics", **{"X-Big": "x" * 70_000})
    assert code in (400, 431)
    # Garbage that is not HTTP, and a connection that sends half a request and goes.
    port = mesh.config.relays[0].http_port
    assert port is not None
    for junk in (b"\x00\xff" * 1000 + b"\r\n\r\n", b"GET /metr"):
        with socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT_S) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            s.recv(65536)
    assert get(mesh, 0, "/healthz")[0] == 200  # the relay serves on


def test_a_relay_that_lost_its_quorum_is_not_ready_and_says_why(tmp_path: Path) -> None:
    mesh = Mesh(write_topology(tmp_path), log_level="warning", log_dir=tmp_path / "logs")
    with mesh.start(timeout_s=60):
        mesh.kill(1)
        mesh.kill(2)

        def not_ready() -> dict[str, Any] | None:
            code, _, body = get(mesh, 0, "/readyz")
            return json.loads(body) if code == 503 else None

        doc = wait_until(not_ready, "relay 0's /readyz to answer 503 once 1 and 2 are gone")
        why = doc["not_ready"][STREAM]  # in the words of `relay status` (relay/streamhealth.py)
        assert doc["ready"] is False and why.startswith("fenced: "), why
        assert "[quorum]" in why and "waiting for relays 1, 2" in why, why
        assert get(mesh, 0, "/healthz")[0] == 200  # alive, only not ready
        families = metrics(mesh, 0)
        assert sample(families, "relay_stream_fenced", stream=STREAM, reason="quorum") == 1
        # The stall's age, under its reason, grows while the quorum stays lost.
        wait_until(
            lambda: (
                sample(
                    metrics(mesh, 0), "relay_stream_stalled_seconds", stream=STREAM, reason="quorum"
                )
                > 0
            ),
            "relay 0's stall to be counted in seconds",
        )
        assert sample(families, "relay_peer_heard", peer="2") == 0


def test_a_taken_http_port_stops_the_relay_naming_it(tmp_path: Path) -> None:
    topology = write_topology(tmp_path)
    port = Mesh(topology).config.relays[0].http_port
    assert port is not None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        run = subprocess.run(
            [sys.executable, "-m", "relay", "run", "--config", str(topology), "--relay", "0"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 1, run.stderr
    assert f"relay 0 cannot serve HTTP on http://127.0.0.1:{port}" in run.stderr
    assert "Traceback" not in run.stderr


def serve_relay_0(config: MeshConfig, body: Callable[[int], Awaitable[None]]) -> None:
    """Run relay 0 of `config` in this process's event loop while `body(its http_port)`
    runs (its requests go through threads: the relay's loop shares the event loop); the
    relay is stopped also when `body` fails."""
    port = config.relays[0].http_port
    assert port is not None

    async def scenario() -> None:
        node = RelayNode(config, 0, handle_signals=False)
        task = asyncio.create_task(node.run())
        try:
            await wait_until_async(lambda: node.running, "relay 0 to run")
            await body(port)
        finally:
            node.stop()
            await asyncio.wait_for(task, HTTP_TIMEOUT_S)  # raises what the relay raised

    asyncio.run(scenario())


async def code_of(port: int, path: str) -> int:
    return (await asyncio.to_thread(request, port, path))[0]


def test_a_stuck_loop_is_not_live_and_says_why(tmp_path: Path) -> None:
    """A request waits at most STATUS_WAIT_S for the relay's loop: a loop that does not
    come round (here: its event loop held by a blocking call, as a bug would) gets a 503
    that says so, and the relay answers again once its loop turns."""
    config = load(write_loopback_topology(tmp_path, {0: [STREAM]}, [STREAM], http=True))

    async def body(port: int) -> None:
        assert await code_of(port, "/healthz") == 200
        answers: list[tuple[int, dict[str, str], bytes]] = []
        answered = threading.Event()

        def probe() -> None:
            answers.append(request(port, "/healthz"))
            answered.set()

        threading.Thread(target=probe, daemon=True).start()
        # Blocks the event loop, and with it the relay's loop, until the probe's answer.
        assert answered.wait(HTTP_TIMEOUT_S + STATUS_WAIT_S)
        code, _, body = answers[0]
        doc = json.loads(body)
        assert code == 503 and doc["live"] is False, doc
        assert doc["why"] == f"relay 0's loop did not answer within {STATUS_WAIT_S:g} s"
        assert await code_of(port, "/healthz") == 200

    serve_relay_0(config, body)


# --- what a client of the port can hold of it (relay/opsserver.py Bounds) -----------------

DEADLINE_S = 2.0  # the request deadline of these tests' servers (the default: 10 s)
DEADLINE_MARGIN_S = 20.0  # a held connection is closed by its deadline plus this, at most
TRICKLE_S = 0.2  # a slow loris sends a byte this often: far within any per-read timeout
HOLDER = "127.0.0.2"  # the slow loris's address (all of 127/8 is this host's, on Linux)
FLOOD_PATHS = ("/metrics", "/status", "/readyz")
FLOOD_CONNECTIONS = 6  # kept-alive connections flooding at once (under the address's cap)
FLOOD_BUILDS = 3  # documents built before the flood stops: it spans 2 intervals at least


@contextlib.contextmanager
def ops_server(
    status: StatusSource,
    liveness: Callable[[float], bool] = lambda wait_s: True,
    **settings: Any,
) -> Iterator[OpsServer]:
    """A relay's HTTP endpoint on a free port of 127.0.0.1 whose loop is `status` and
    `liveness`; closed also when the test fails."""
    settings = {"expose_status": True, **settings}
    server = OpsServer("127.0.0.1", 0, status, 0, liveness=liveness, incarnation=1, **settings)
    server.start()
    try:
        yield server
    finally:
        server.close()


def status_of_relay_0(mesh: Mesh) -> dict[str, Any]:
    """A real status document (what relay 0's loop builds), read over its client port."""
    doc = query_status({0: mesh.config.relays[0].client_endpoint}, HTTP_TIMEOUT_S)[0].status
    assert doc is not None
    return doc


def read_to_end(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (a reset ends it too)."""
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            got += chunk
    return got


def test_a_slow_loris_holds_only_its_addresss_share_and_only_until_the_deadline(
    mesh: Mesh,
) -> None:
    """MAX_CONNECTIONS_PER_ADDRESS connections from one address that trickle a request
    byte by byte (each byte long before any per-read timeout) hold that address's slots:
    one more from it is answered 503 at once, naming the bound; another address's
    /healthz is answered meanwhile; and the request deadline closes each held connection,
    after which the holder's address is served again."""
    doc = status_of_relay_0(mesh)
    stop = threading.Event()
    with (
        ops_server(lambda wait_s: doc, bounds=Bounds(request_deadline_s=DEADLINE_S)) as server,
        contextlib.ExitStack() as sockets,
    ):

        def connect() -> socket.socket:
            sock = sockets.enter_context(socket.socket())
            sock.settimeout(HTTP_TIMEOUT_S)
            try:
                sock.bind((HOLDER, 0))
            except OSError as e:
                pytest.skip(f"cannot use {HOLDER} as a second loopback address: {e}")
            sock.connect(("127.0.0.1", server.port))
            return sock

        held = [connect() for _ in range(MAX_CONNECTIONS_PER_ADDRESS)]
        for sock in held:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nX-Slow: ")

        def trickle() -> None:
            while not stop.wait(TRICKLE_S):
                for sock in held:
                    with contextlib.suppress(OSError):  # closed by the server: done
                        sock.send(b"x")

        trickler = threading.Thread(target=trickle, daemon=True)
        trickler.start()
        try:
            answer = read_to_end(connect())
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert b"MAX_CONNECTIONS_PER_ADDRESS" in answer and HOLDER.encode() in answer, answer
            code, _, body = request(server.port, "/healthz")
            assert code == 200 and json.loads(body)["live"] is True
            for sock in held:
                # A generous bound that proves there is a deadline: the trickle alone
                # would keep the connection forever.
                sock.settimeout(DEADLINE_S + DEADLINE_MARGIN_S)
                try:
                    assert read_to_end(sock) == b"", "a slow loris got an answer"
                except TimeoutError:
                    raise AssertionError(
                        f"a slow loris was not closed within {DEADLINE_S + DEADLINE_MARGIN_S:g} s"
                    ) from None
        finally:
            stop.set()
            trickler.join(HTTP_TIMEOUT_S)
        wait_until(
            lambda: request(server.port, "/healthz", source=HOLDER)[0] == 200,
            f"{HOLDER} to be served again once its held connections were closed",
        )


def test_a_flood_of_requests_costs_the_loop_one_status_document_a_second(mesh: Mesh) -> None:
    """Kept-alive connections asking /metrics, /status and /readyz as fast as they can
    share the loop's document: the loop is asked for one at most every
    STATUS_MIN_INTERVAL_S, however many requests come; /healthz asks for none."""
    doc = status_of_relay_0(mesh)
    lock = threading.Lock()
    built: list[float] = []  # time.monotonic() of each ask for a document
    turns = itertools.count()

    def status(wait_s: float) -> Mapping[str, Any]:
        with lock:
            built.append(time.monotonic())
        return doc

    def liveness(wait_s: float) -> bool:
        next(turns)
        return True

    answers: Counter[tuple[str, int]] = Counter()
    failed: list[BaseException] = []
    stop = threading.Event()
    with ops_server(status, liveness) as server:

        def flood(path: str) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT_S)
            try:
                while not stop.is_set():
                    conn.request("GET", path)
                    resp = conn.getresponse()
                    resp.read()
                    with lock:
                        answers[path, resp.status] += 1
            except BaseException as e:  # reported by the test
                failed.append(e)
            finally:
                conn.close()

        paths = itertools.islice(itertools.cycle(FLOOD_PATHS), FLOOD_CONNECTIONS)
        threads = [threading.Thread(target=flood, args=(p,), daemon=True) for p in paths]
        for thread in threads:
            thread.start()
        try:
            wait_until(
                lambda: len(built) >= FLOOD_BUILDS or failed,
                f"{FLOOD_BUILDS} documents to be asked for under the flood",
            )
        finally:
            stop.set()
            for thread in threads:
                thread.join(HTTP_TIMEOUT_S)
        assert not failed, failed
        asked = len(built)
        for _ in range(20):
            assert request(server.port, "/healthz")[0] == 200
        assert len(built) == asked and next(turns) == 20  # liveness, never a document
    assert set(answers) == {(path, 200) for path in FLOOD_PATHS}, answers
    gaps = [later - earlier for earlier, later in itertools.pairwise(built)]
    assert all(gap >= STATUS_MIN_INTERVAL_S for gap in gaps), gaps
    assert sum(answers.values()) >= 10 * asked, (answers, asked)


def with_http(topology: Path, **settings: Any) -> Path:
    """The topology file with an `http:` section of these settings."""
    doc = yaml.safe_load(topology.read_text(encoding="utf-8"))
    doc["http"] = settings
    topology.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return topology


def test_status_and_the_page_are_refused_unless_the_topology_exposes_them(
    tmp_path: Path,
) -> None:
    """With http.expose_status: false a relay answers /status and / 403, naming the
    setting; /metrics, /healthz and /readyz stay open for orchestrators."""
    topology = write_loopback_topology(tmp_path, {0: [STREAM]}, [STREAM], http=True)
    config = load(with_http(topology, expose_status=False))
    assert config.http.expose_status is False

    async def body(port: int) -> None:
        for path in ("/status", "/"):
            code, headers, text = await asyncio.to_thread(request, port, path)
            error = json.loads(text)["error"]
            assert code == 403 and headers["content-type"] == "application/json", (path, code)
            assert "http.expose_status is false" in error and path in error, error
        assert await code_of(port, "/metrics") == 200
        assert await code_of(port, "/healthz") == 200

        async def ready() -> bool:
            return await code_of(port, "/readyz") == 200

        await wait_until_async(ready, "relay 0 to answer 200 on /readyz", poll_s=0.2)

    serve_relay_0(config, body)


# --- configurations (docs/protocol.md 5.15) ------------------------------------------------

AUDIT, LEDGER = "audit", "ledger"
CHANGES = "docs/deploy.md section 9"
CONFIG_GAUGES = (
    "relay_stream_config_version",
    "relay_stream_config_relays",
    "relay_stream_config_disagree",
    "relay_stream_topology_differs",
    "relay_stream_history_lost",
    "relay_stream_waiting_seconds",
    "relay_stream_diverged_seconds",
)


def test_a_relay_restarted_onto_a_topology_naming_other_relays_keeps_serving(
    tmp_path: Path,
) -> None:
    """The topology file is edited and relay 2 restarted onto it (relays 0 and 1 keep the
    file they read): it names relays 1 and 2 for orders.eu, relays 0 and 1 for audit,
    and relays 0, 1 and 2 for ledger, which relays 0 and 1 served alone. Relay 2 keeps
    orders.eu and audit on the relays of their established configurations (0, 1, 2, in
    its acceptor record), audit by its record alone, and learns that ledger's leaves it
    out. `relay status` says all of it (degraded, exit 1), and that relays 0 and 1 heard
    relay 2 state another configuration of ledger; every relay stays ready, and the
    streams commit through relay 2."""
    streams = [STREAM, AUDIT, LEDGER]
    before = {0: streams, 1: streams, 2: [STREAM, AUDIT]}
    topology = write_loopback_topology(tmp_path, before, streams, http=True)
    mesh = Mesh(topology, log_level="info", log_dir=tmp_path / "logs")
    with mesh.start(timeout_s=60):
        with Producer(topology=mesh.config) as producer:
            for stream in streams:
                producer.send(stream, b"before the edit")
        resubscribe(topology, {0: [AUDIT, LEDGER], 2: [STREAM, LEDGER]})
        mesh.restart(2, timeout_s=60)  # ready: orders.eu and audit joined and unfenced

        # Relays 0 and 1 still read the old file: they hold the changes, by name.
        held = (
            "the change waits until the file of every live relay of the stream names the "
            "same relays: relay 0's file names relays 0, 1, 2; relay 1's file names relays "
            f"0, 1, 2 ({CHANGES})"
        )
        differs = {
            STREAM: f"runs on relays 0, 1, 2 (configuration 1); the topology file names "
            f"relays 1, 2: {held}",
            AUDIT: f"runs on relays 0, 1, 2 (configuration 1); the topology file names "
            f"relays 0, 1: {held}",
        }
        left = (
            "not served here: it runs on relays 0, 1 (configuration 1), which leaves this "
            "relay out; its reads are redirected and its produces forwarded to those relays; "
            "the topology file names relays 0, 1, 2: the relays of the stream add the others "
            f"once their files name them too ({CHANGES})"
        )

        # Relays 0 and 1 hear relay 2 state its provisional configuration of ledger if it
        # asked them before it heard theirs (it learns it from their answer, or from their
        # frames about ledger, whichever comes first): a disagreement, which stays.
        heard = (
            "relays disagree about its configuration: this relay runs it on relays 0, 1 "
            "(configuration 1); relay 2 states relays 0, 1, 2 (configuration 0, provisional): "
            "it serves on under its own (what they say under theirs is not taken)"
        )
        of_relay_2 = [
            {"relay": 2, "stream": AUDIT, "problem": differs[AUDIT]},
            {"relay": 2, "stream": STREAM, "problem": differs[STREAM]},
            {"relay": 2, "stream": LEDGER, "problem": left},  # (after the streams it serves)
        ]
        last: list[Any] = []

        def status_when_settled() -> tuple[int, dict[str, Any]] | None:
            result = CliRunner().invoke(main, ["status", "--config", str(topology), "--json"])
            status = json.loads(result.stdout)
            last[:] = status["problems"]
            found = [p for p in status["problems"] if p["relay"] == 2]
            return (result.exit_code, status) if found == of_relay_2 else None

        code, status = wait_until(
            status_when_settled,
            lambda: f"`relay status` to name the problems {of_relay_2} (last: {last})",
        )
        assert code == 1 and status["health"] == "degraded", status
        result = CliRunner().invoke(main, ["status", "--config", str(topology)])
        assert result.exit_code == 1
        for line in (
            f"stream {STREAM}: joined, committed seq ",
            "; runs on relays 0, 1, 2 (configuration 1), the topology file names relays 1, 2",
            f"stream {LEDGER}: not a member; runs on relays 0, 1 (configuration 1), the "
            "topology file names relays 0, 1, 2",
        ):
            assert line in result.stdout, (line, result.stdout)

        # Committed through relay 2 alone (its client knows no other relay to be sent to):
        # coordinated there (the seq names its coordinator), or for ledger forwarded.
        with Producer({2: mesh.config.relays[2].client_endpoint}) as producer:
            for stream in (STREAM, AUDIT):
                assert relay_of(producer.send(stream, b"after the edit")) == 2
            assert relay_of(producer.send(LEDGER, b"after the edit")) in (0, 1)

        readyz = {r: get(mesh, r, "/readyz") for r in range(RELAYS)}
        for relay, (code, _, body) in readyz.items():
            assert code == 200 and json.loads(body)["ready"] is True, (relay, body)
        assert json.loads(readyz[2][2])["degraded"] == {**differs, LEDGER: left}
        heard_by = [r for r in (0, 1) if "degraded" in json.loads(readyz[r][2])]
        for relay in heard_by:
            assert json.loads(readyz[relay][2])["degraded"] == {LEDGER: heard}
        result = CliRunner().invoke(main, ["status", "--config", str(topology), "--json"])
        assert json.loads(result.stdout)["problems"] == [
            *({"relay": r, "stream": LEDGER, "problem": heard} for r in heard_by),
            *of_relay_2,
        ]

        def gauges(relay: int, stream: str) -> dict[str, float] | None:
            families = metrics(mesh, relay)
            found = {name: sample(families, name, stream=stream) for name in CONFIG_GAUGES}
            # (nothing waits or diverges once the commits settled: looked at until then)
            settled = found["relay_stream_waiting_seconds"] == 0
            return found if settled and found["relay_stream_diverged_seconds"] == 0 else None

        for relay in range(RELAYS):
            for stream in streams:
                if (relay, stream) == (2, LEDGER):
                    continue
                found = wait_until(
                    lambda r=relay, s=stream: gauges(r, s),  # type: ignore[misc]
                    f"relay {relay}'s {stream} to wait for nothing and agree",
                )
                relays = 2 if stream == LEDGER else 3
                assert found == {
                    "relay_stream_config_version": 1,
                    "relay_stream_config_relays": relays,
                    "relay_stream_config_disagree": 1
                    if stream == LEDGER and relay in heard_by
                    else 0,
                    "relay_stream_topology_differs": 1 if relay == 2 else 0,
                    "relay_stream_history_lost": 0,
                    "relay_stream_waiting_seconds": 0,
                    "relay_stream_diverged_seconds": 0,
                }, (relay, stream, found)
        assert sample(metrics(mesh, 2), "relay_stream_not_member", stream=LEDGER) == 1
        assert not [s for s in metrics(mesh, 0)["relay_stream_not_member"]]
        # Relay 2's log names the relays holding each change once it heard them (a line
        # at most a second per stream: waited for while the relay runs).
        log_2 = tmp_path / "logs" / "relay-2.log"
        for name in (STREAM, AUDIT):
            line = f"WARNING relay.node relay=2 stream={name} {differs[name]}"
            wait_until(
                lambda line=line: line in log_2.read_text(encoding="utf-8"),  # type: ignore[misc]
                f"relay 2 to log: {line}",
            )

    # Relay 2 said each once, relays 0 and 1 what they heard.
    for relay, name, words, times in (
        (2, STREAM, differs[STREAM], 1),
        (2, AUDIT, differs[AUDIT], 1),
        (2, LEDGER, left, 1),
        (0, LEDGER, heard, 1 if 0 in heard_by else 0),
        (1, LEDGER, heard, 1 if 1 in heard_by else 0),
    ):
        log_text = (tmp_path / "logs" / f"relay-{relay}.log").read_text(encoding="utf-8")
        line = f"WARNING relay.node relay={relay} stream={name} {words}"
        assert log_text.count(line) == times, (line, log_text)
