"""A relay's HTTP endpoint for operators: metrics, health, its status and the live page.

    GET /metrics   Prometheus' text exposition (relay/metrics.py)
    GET /healthz   200 while the relay's loop answers; 503 and why, else (liveness)
    GET /readyz    200 when the relay can serve every stream in use that it tracks
                   (joined, unfenced, its history not lost, not diverged, nothing waiting
                   too long to commit; one never written is not in use); 503 with each
                   stream it cannot serve and why (readiness).
                   Either way `degraded` lists the problems that leave it ready (a
                   configuration disagreement, a topology that names other relays, a
                   stream its configuration leaves it out of: relay/streamhealth.py)
    GET /status    the relay's status document as JSON, seqs as strings (relay/seqtext.py)
    GET /          the live status page of the whole mesh (relay/page.html)

/status and / only with the topology's `http.expose_status` (relay/topology/mesh.py
HttpSettings; else 403 naming it): the client port gives that document to `admin`
clients only, and this port knows no identities. /metrics, /healthz and /readyz are
always served (orchestrators and Prometheus need them).

The server runs in threads of its own (the standard library's ThreadingHTTPServer): the
relay's loop never waits on a client of it. The loop owns every counter, so a request
does not read them: it asks the loop for its status document (`StatusSource`), which the
loop builds between two turns, and waits at most STATUS_WAIT_S; the requests of the
next STATUS_MIN_INTERVAL_S share that document, and the answers made of it. /healthz
asks the loop only to come round (`LivenessSource`), no document. A relay whose loop is
stuck is not live, and says so. Read-only: nothing here changes what the relay does.

Whoever reaches the port can cost the relay only this much (`Bounds`): a connection for
at most REQUEST_DEADLINE_S per request (all of its line and headers, however slowly they
come) and ANSWER_DEADLINE_S per answer; MAX_CONNECTIONS at once, MAX_CONNECTIONS_PER_ADDRESS
of them from one address (one client cannot hold every slot: the others are served);
one status document a second, however many ask. Bind it where only operators and their
tools reach (docs/operations.md section 1, docs/security.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from relay.metrics import exposition
from relay.seqtext import seqs_as_text
from relay.streamhealth import relay_problems
from relay.topology import is_ipv6

__all__ = [
    "ANSWER_DEADLINE_S",
    "MAX_CONNECTIONS",
    "MAX_CONNECTIONS_PER_ADDRESS",
    "REQUEST_DEADLINE_S",
    "STATUS_MIN_INTERVAL_S",
    "STATUS_WAIT_S",
    "Bounds",
    "OpsServer",
    "degraded",
    "readiness",
]

log = logging.getLogger("relay.http")

STATUS_WAIT_S = 5.0  # how long a request waits for the loop (its document, or a turn)
# A document this young answers every request: a flood of /metrics, /status, /readyz
# costs the loop one document a second (each was a full build on the loop: a flood fenced
# a relay for 30 s and grew it by 312 MB).
STATUS_MIN_INTERVAL_S = 1.0
# The request line and headers must all arrive within this of the connection being ready
# for the request (accepted, or its last answer written): a client that sends a byte now
# and then (slow loris) is cut off then, however steadily it trickles.
REQUEST_DEADLINE_S = 10.0
ANSWER_DEADLINE_S = 10.0  # an answer its client does not take within this is dropped
# Served at once (a thread each); more are answered 503 at once.
MAX_CONNECTIONS = 64
# Served at once from one address: a client alone cannot hold every slot, and /healthz
# of an orchestrator elsewhere is still answered. 8: Prometheus, a probe and a few browser
# tabs of the page on one operator's machine.
MAX_CONNECTIONS_PER_ADDRESS = 8
JSON_TYPE = "application/json"
HTML_TYPE = "text/html; charset=utf-8"
PATHS = ("/", "/metrics", "/healthz", "/readyz", "/status")
EXPOSED_PATHS = frozenset({"/", "/status"})  # only with http.expose_status

# The loop's status document, or None if the loop did not answer within the wait (s).
StatusSource = Callable[[float], Mapping[str, Any] | None]
# Whether the loop came round within the wait (s), after the call.
LivenessSource = Callable[[float], bool]
# (HTTP status, content type, body)
Answer = tuple[int, str, bytes]
# A status document and the answers made of it so far, by path
_Kept = tuple[Mapping[str, Any], dict[str, Answer]]


@dataclass(frozen=True)
class Bounds:
    """What a client of the endpoint may hold of it (the module's constants; tests give
    shorter deadlines to see them pass)."""

    request_deadline_s: float = REQUEST_DEADLINE_S
    answer_deadline_s: float = ANSWER_DEADLINE_S
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS


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

    def __init__(
        self,
        host: str,
        port: int,
        status: StatusSource,
        relay_id: int,
        *,
        liveness: LivenessSource,
        incarnation: int,
        expose_status: bool,
        bounds: Bounds = Bounds(),
    ) -> None:
        """Binds at once: OSError (the port is taken, the address not this host's) says why.
        `expose_status`: serve /status and the page (the topology's http.expose_status)."""
        self.relay_id = relay_id
        self.incarnation = incarnation
        self.expose_status = expose_status
        self.bounds = bounds
        self._status = _SharedStatus(status)
        self._liveness = liveness
        self._slots = _Slots(bounds.max_connections, bounds.max_connections_per_address)
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

    # --- answers -----------------------------------------------------------------------

    def answer(self, path: str) -> Answer:
        if path not in PATHS:
            known = ", ".join(PATHS)
            return _json(HTTPStatus.NOT_FOUND, {"error": f"no page {path!r}; there are {known}"})
        if path == "/healthz":
            if not self._liveness(STATUS_WAIT_S):
                return self._not_answering()
            doc = {"relay": self.relay_id, "incarnation": self.incarnation, "live": True}
            return _json(HTTPStatus.OK, doc)
        if path in EXPOSED_PATHS and not self.expose_status:
            return _json(HTTPStatus.FORBIDDEN, {"error": self._not_exposed(path)})
        if path == "/":
            return HTTPStatus.OK, HTML_TYPE, self._page
        made = self._status.answer(path, self._made_of)
        return self._not_answering() if made is None else made

    def _made_of(self, path: str, status: Mapping[str, Any]) -> Answer:
        """The answer to `path` (/metrics, /readyz, /status) made of a status document."""
        if path == "/metrics":
            return HTTPStatus.OK, CONTENT_TYPE_LATEST, exposition(status)
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

    def _not_answering(self) -> Answer:
        why = f"relay {self.relay_id}'s loop did not answer within {STATUS_WAIT_S:g} s"
        body: dict[str, Any] = {"relay": self.relay_id, "live": False, "ready": False}
        return _json(HTTPStatus.SERVICE_UNAVAILABLE, {**body, "why": why})

    def _not_exposed(self, path: str) -> str:
        what = "the live page" if path == "/" else "its status document"
        return (
            f"relay {self.relay_id} does not serve {what} ({path}) over HTTP: the topology's "
            "http.expose_status is false (its default with security.curve: true, where the "
            "client port gives the document to admin clients only). `relay status` reads it "
            "there; http.expose_status: true serves it here to whoever reaches this port "
            "(docs/operations.md section 1)"
        )


def _json(code: int, doc: Mapping[str, Any]) -> Answer:
    return code, JSON_TYPE, json.dumps(doc, sort_keys=True).encode() + b"\n"


class _SharedStatus:
    """The loop's status document, kept for STATUS_MIN_INTERVAL_S after it came, and the
    answers made of it, each made once: however many requests come, the loop builds at
    most one document a second and each path's answer is made once per document. One
    request at a time asks the loop; those that come meanwhile wait for its document.
    A loop that did not answer is asked again by the next request."""

    def __init__(self, source: StatusSource) -> None:
        self._source = source
        self._lock = threading.Lock()
        self._making = threading.Lock()  # one answer made at a time (each once)
        self._kept: _Kept | None = None
        self._kept_at = -math.inf  # time.monotonic() when it came
        self._asking: Future[_Kept | None] | None = None

    def answer(self, path: str, make: Callable[[str, Mapping[str, Any]], Answer]) -> Answer | None:
        """The answer to `path` made of a document young enough (`make` makes it); None:
        the loop did not answer within STATUS_WAIT_S."""
        kept = self._document()
        if kept is None:
            return None
        status, answers = kept
        with self._making:
            made = answers.get(path)
            if made is None:
                made = answers[path] = make(path, status)
        return made

    def _document(self) -> _Kept | None:
        with self._lock:
            if self._kept is not None and time.monotonic() - self._kept_at < STATUS_MIN_INTERVAL_S:
                return self._kept
            asking = self._asking
            if asking is None:
                asking = self._asking = Future()
                ask = True
            else:
                ask = False
        if not ask:
            try:
                return asking.result(STATUS_WAIT_S)
            except TimeoutError:
                return None
        kept: _Kept | None = None
        try:
            status = self._source(STATUS_WAIT_S)
            kept = None if status is None else (status, {})
        finally:  # those waiting are answered whatever happened
            with self._lock:
                if kept is not None:
                    self._kept, self._kept_at = kept, time.monotonic()
                self._asking = None
            asking.set_result(kept)
        return kept


class _Slots:
    """The connections served: at most `total` at once, `per_address` from one address."""

    def __init__(self, total: int, per_address: int) -> None:
        self.total = total
        self.per_address = per_address
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()  # by address
        self._taken = 0

    def take(self, address: str) -> str | None:
        """A slot for a connection from `address`; if none is left, why not."""
        with self._lock:
            if self._taken >= self.total:
                return f"at most {self.total} connections at once (MAX_CONNECTIONS)"
            if self._held[address] >= self.per_address:
                return (
                    f"at most {self.per_address} connections at once to one address, and "
                    f"{address} has them (MAX_CONNECTIONS_PER_ADDRESS)"
                )
            self._held[address] += 1
            self._taken += 1
            return None

    def give_back(self, address: str) -> None:
        with self._lock:
            self._taken -= 1
            self._held[address] -= 1
            if not self._held[address]:
                del self._held[address]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    ops: OpsServer

    def process_request(self, request: Any, client_address: Any) -> None:
        """At most MAX_CONNECTIONS served at once, MAX_CONNECTIONS_PER_ADDRESS from one
        address: a flood of connections gets a 503 each, not a thread each."""
        refused = self.ops._slots.take(client_address[0])
        if refused is not None:
            body = f"relay {self.ops.relay_id} serves {refused}: try again later\n".encode()
            with contextlib.suppress(OSError):  # the client went already, or reads nothing
                request.setblocking(False)  # never wait on it here, in the accepting thread
                request.send(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
                    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
                )
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.ops._slots.give_back(client_address[0])

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed (reset by its client, mostly) costs a debug line, not
        a traceback on stderr: anyone can make them."""
        log.debug(
            "relay=%d http connection from %s failed",
            self.ops.relay_id,
            client_address,
            exc_info=True,
        )


class _Server6(_Server):
    address_family = socket.AF_INET6


class _DeadlineReader(io.RawIOBase):
    """A connection's bytes, each read waiting only for what is left of the request's
    deadline (`due`, time.monotonic()): past it, TimeoutError, and the connection is
    closed (BaseHTTPRequestHandler's handling of a timeout)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock
        self.due = math.inf

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.due - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within its deadline")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "relay"

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own file; reads go through the deadline instead
        self._reader = _DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        """One request (of a connection kept alive, the next): its line and headers within
        REQUEST_DEADLINE_S of now, whatever the pace of its bytes."""
        self._reader.due = time.monotonic() + self.server.ops.bounds.request_deadline_s
        super().handle_one_request()

    def do_GET(self) -> None:
        self._serve(with_body=True)

    def do_HEAD(self) -> None:
        self._serve(with_body=False)

    def _serve(self, with_body: bool) -> None:
        ops = self.server.ops
        path = self.path.split("?", 1)[0]
        try:
            code, content_type, body = ops.answer(path)
        except Exception:  # a bug here must cost one answer, never the relay
            log.exception("relay=%d http %s failed", ops.relay_id, path)
            code, content_type, body = _json(
                HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error (see the relay's log)"}
            )
        # The answer is written within ANSWER_DEADLINE_S (sendall's timeout bounds the
        # whole of each write), else TimeoutError closes the connection.
        self.connection.settimeout(ops.bounds.answer_deadline_s)
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
