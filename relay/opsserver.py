"""A relay's HTTP endpoint for operators: metrics, health, its status and the live page.

    GET /metrics   Prometheus' text exposition (relay/metrics.py)
    GET /healthz   200 while the relay's loop answers; 503 and why, else (liveness)
    GET /readyz    200 when the relay can serve every stream it tracks (joined, unfenced,
                   its history not lost, not diverged, nothing waiting too long to
                   commit); 503 with each stream it cannot serve and why (readiness).
                   Either way `degraded` lists the problems that leave it ready (a
                   configuration disagreement, a topology that names other relays, a
                   stream its configuration leaves it out of: relay/streamhealth.py)
    GET /status    the relay's status document as JSON, seqs as strings (relay/seqtext.py)
    GET /          the live status page of the whole mesh (relay/page.html)

The server runs in threads of its own (the standard library's ThreadingHTTPServer): the
relay's loop never waits on a client of it. The loop owns every counter, so a request
does not read them: it asks the loop for its status document (`StatusSource`), which the
loop builds between two turns, and waits at most STATUS_WAIT_S. A relay whose loop is
stuck is not live, and says so. Read-only: nothing here changes what the relay does. It
serves whoever reaches its port, like other metrics endpoints: bind it where only
operators and their tools reach (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from relay.metrics import exposition
from relay.seqtext import seqs_as_text
from relay.streamhealth import relay_problems
from relay.topology import is_ipv6

__all__ = ["STATUS_WAIT_S", "OpsServer", "degraded", "readiness"]

log = logging.getLogger("relay.http")

STATUS_WAIT_S = 5.0  # how long a request waits for the loop's status document
REQUEST_TIMEOUT_S = 10.0  # a connection silent this long is closed (slow clients)
MAX_CONNECTIONS = 32  # served at once; more are answered 503 at once
JSON_TYPE = "application/json"
HTML_TYPE = "text/html; charset=utf-8"

# The loop's status document, or None if the loop did not answer within the wait (s).
StatusSource = Callable[[float], Mapping[str, Any] | None]


def readiness(status: Mapping[str, Any]) -> dict[str, str]:
    """Each stream the relay cannot serve (not joined, fenced, its history lost, diverged,
    waiting too long to commit), and why, in the words of `relay status` ({}: ready)."""
    return _problems(status, unready=True)


def degraded(status: Mapping[str, Any]) -> dict[str, str]:
    """Each stream with a problem that leaves the relay ready, and what it is, in the words
    of `relay status` (which says degraded for them): a stall without a fence, a
    configuration disagreement that does not hold the stream, a topology that names other
    relays than its configuration, a stream whose configuration leaves this relay out."""
    return _problems(status, unready=False)


def _problems(status: Mapping[str, Any], *, unready: bool) -> dict[str, str]:
    found: dict[str, list[str]] = {}
    for name, problem in relay_problems(status):
        if problem.unready == unready:
            found.setdefault(name, []).append(problem.words)
    return {name: "; ".join(words) for name, words in found.items()}


class OpsServer:
    """The HTTP endpoint of one relay, on (host, port) until `close()`."""

    def __init__(self, host: str, port: int, status: StatusSource, relay_id: int) -> None:
        """Binds at once: OSError (the port is taken, the address not this host's) says why."""
        self.relay_id = relay_id
        self._status = status
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._page = resources.files("relay").joinpath("page.html").read_bytes()
        server = _Server6 if is_ipv6(host) else _Server  # an IPv6 address, or IPv4 / a name
        self._server = server((host, port), _Handler)
        self._server.ops = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"relay-{relay_id}-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    # --- answers: (HTTP status, content type, body) ----------------------------------

    def answer(self, path: str) -> tuple[int, str, bytes]:
        if path == "/":
            return HTTPStatus.OK, HTML_TYPE, self._page
        if path not in ("/metrics", "/healthz", "/readyz", "/status"):
            known = "/, /metrics, /healthz, /readyz, /status"
            return _json(HTTPStatus.NOT_FOUND, {"error": f"no page {path!r}; there are {known}"})
        status = self._status(STATUS_WAIT_S)
        if status is None:
            why = f"relay {self.relay_id}'s loop did not answer within {STATUS_WAIT_S:g} s"
            body: dict[str, Any] = {"relay": self.relay_id, "live": False, "ready": False}
            return _json(HTTPStatus.SERVICE_UNAVAILABLE, {**body, "why": why})
        if path == "/metrics":
            return HTTPStatus.OK, CONTENT_TYPE_LATEST, exposition(status)
        if path == "/healthz":
            doc = {"relay": self.relay_id, "incarnation": status["incarnation"], "live": True}
            return _json(HTTPStatus.OK, doc)
        if path == "/readyz":
            not_ready = readiness(status)
            ready: dict[str, Any] = {
                "relay": self.relay_id,
                "ready": not not_ready,
                "streams": len(status["streams"]),
            }
            others = degraded(status)
            if others:
                ready["degraded"] = others
            if not_ready:
                return _json(HTTPStatus.SERVICE_UNAVAILABLE, {**ready, "not_ready": not_ready})
            return _json(HTTPStatus.OK, ready)
        return _json(HTTPStatus.OK, seqs_as_text(status))


def _json(code: int, doc: Mapping[str, Any]) -> tuple[int, str, bytes]:
    return code, JSON_TYPE, json.dumps(doc, sort_keys=True).encode() + b"\n"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    ops: OpsServer

    def process_request(self, request: Any, client_address: Any) -> None:
        """At most MAX_CONNECTIONS served at once: a flood of connections gets a 503 each,
        not a thread each."""
        if not self.ops._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):  # the client went already
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                    b"Connection: close\r\n\r\n"
                )
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.ops._slots.release()


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT_S
    protocol_version = "HTTP/1.1"
    server_version = "relay"

    def do_GET(self) -> None:
        self._serve(with_body=True)

    def do_HEAD(self) -> None:
        self._serve(with_body=False)

    def _serve(self, with_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        try:
            code, content_type, body = self.server.ops.answer(path)
        except Exception:  # a bug here must cost one answer, never the relay
            log.exception("relay=%d http %s failed", self.server.ops.relay_id, path)
            code, content_type, body = _json(
                HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error (see the relay's log)"}
            )
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        # The page of one relay reads the status of the others (read-only documents).
        self.send_header("Access-Control-Allow-Origin", "*")
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def _refuse_method(self) -> None:
        self.send_error(HTTPStatus.METHOD_NOT_ALLOWED, "only GET and HEAD")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged (a scrape every few seconds would flood the log)."""
