"""Each relay's HTTP endpoint (relay/opsserver.py): /metrics in Prometheus' format,
/healthz, /readyz, /status and the page, on real relay processes, and what it does with
requests it cannot serve."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from relay.client import Consumer, Producer
from relay.errors import UnknownStream
from relay.launcher import Mesh, write_loopback_topology
from relay.node import RelayNode
from relay.opsserver import STATUS_WAIT_S
from relay.topology import load
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
    port: int, path: str, method: str = "GET", **headers: str
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers by lower-case name, body) of one request to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT_S)
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


def sample(families: dict[str, list[Any]], name: str, **labels: str) -> float:
    """The value of the sample `name` (a counter's has `_total`) with exactly `labels`."""
    values = [
        s.value
        for samples in families.values()
        for s in samples
        if s.name == name and s.labels == labels
    ]
    assert len(values) == 1, (name, labels, values)
    return float(values[0])


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
    assert sample(metrics(mesh, 2), "relay_stream_served_records_total", stream=STREAM) >= PRODUCED
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
    assert sample(metrics(mesh, 0), "relay_produce_refusals_total", **refused) == 1


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


def test_a_stuck_loop_is_not_live_and_says_why(tmp_path: Path) -> None:
    """A request waits at most STATUS_WAIT_S for the relay's loop: a loop that does not
    come round (here: its event loop held by a blocking call, as a bug would) gets a 503
    that says so, and the relay answers again once its loop turns."""
    config = load(write_loopback_topology(tmp_path, {0: [STREAM]}, [STREAM], http=True))
    port = config.relays[0].http_port
    assert port is not None

    async def healthz() -> int:
        return (await asyncio.to_thread(request, port, "/healthz"))[0]

    async def scenario() -> None:
        node = RelayNode(config, 0, handle_signals=False)
        task = asyncio.create_task(node.run())
        try:
            await wait_until_async(lambda: node.running, "relay 0 to run")
            assert await healthz() == 200
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
            assert await healthz() == 200
        finally:
            node.stop()
            await asyncio.wait_for(task, HTTP_TIMEOUT_S)  # raises what the relay raised

    asyncio.run(scenario())
