"""Start, watch and stop every relay of a topology on this host, as child processes.

    with Mesh("config/topology.yaml").start(timeout_s=10) as mesh:
        mesh.endpoints[0].client      # "tcp://127.0.0.1:7200"
        mesh.kill(1)                  # SIGKILL relay 1 (waits until it is gone)
        mesh.restart(1)               # start it again, wait until it is ready
    # leaving the block stops every relay: SIGTERM, then SIGKILL after a bounded grace

Each relay runs as `sys.executable -m relay run --config FILE --relay ID --log-level L
--log-format F`. A relay is *ready* when it answers a StatusReq on its client endpoint and
reports every named stream of its subscriptions (exact names; patterns open on first use)
joined and unfenced.
`start` first checks that every port the relays will listen on is free on this host (a
port in use, or an address not of this host, raises `MeshError` naming the relay and the
port, and nothing is started), then waits for all relays, bounded; if one does not come up
it stops the others and raises `MeshError` naming that relay (with the tail of its log when
logs go to files).
`tend` restarts a relay whose process ended while the mesh runs (`relay up` calls it), with
back-off: RESTART_FIRST_S, doubling up to RESTART_MAX_S, back to the first once a relay
stayed up RESTART_STABLE_S; it logs each exit and restart (logger `relay.launcher`).

`query_status` asks relays for their status over DEALER sockets (used by `relay status`).

With `security.curve` (docs/security.md) `start` first creates the key pairs the topology
needs and this machine lacks (`KeyRing.ensure`, under keys_dir), and status queries use
the client key (`key_file`, else $RELAY_KEY_FILE, else security.client_key_file).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

import zmq

from relay import wire
from relay.errors import RelayError
from relay.logs import STATE_CHANGE
from relay.topology import MeshConfig, RelaySpec, is_ipv6, is_pattern, load

if TYPE_CHECKING:  # relay.security (and yaml) only where used: `relay status` starts faster
    from relay.security import ClientCurve

__all__ = [
    "Mesh",
    "MeshError",
    "RelayEndpoints",
    "StatusReply",
    "free_ports",
    "named_streams",
    "not_ready_reason",
    "query_status",
    "startup_streams",
    "write_loopback_topology",
]

STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long
RESTART_FIRST_S = 1.0  # a relay that exits is started again after this long ...
RESTART_MAX_S = 30.0  # ... doubled at each exit, up to this ...
RESTART_STABLE_S = 60.0  # ... and back to the first once it stayed up this long
POLL_S = 0.05  # how often start() looks at the children
PROBE_TIMEOUT_S = 0.25  # one StatusReq round while waiting for relays to come up
MAX_STATUS_BYTES = 64 * 1024 * 1024
# a client with every right
ADMIN_GRANT = {"produce": ["*"], "consume": ["*"], "admin": True, "metadata": ["*"]}
_PROJECT_ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("relay.launcher")


class MeshError(RelayError):
    """A relay of the mesh did not come up (or could not be started)."""

    def __init__(self, message: str, *, relay_id: int | None = None) -> None:
        super().__init__(message)
        self.relay_id = relay_id


@dataclass(frozen=True)
class RelayEndpoints:
    relay: int
    mesh: str  # the relay's PUB socket
    client: str  # the relay's ROUTER for clients
    streams: tuple[str, ...]  # its subscriptions (names and patterns)


# --- status queries ------------------------------------------------------------------------


@dataclass(frozen=True)
class StatusReply:
    relay: int
    endpoint: str
    status: dict[str, Any] | None  # the relay's status document; None if unreachable
    error: str | None = None  # why there is no status
    refused: bool = False  # it answered, with an error (e.g. NotAuthorized): it runs

    @property
    def reachable(self) -> bool:
        return self.status is not None

    @property
    def answered(self) -> bool:
        """It runs: it sent its status, or refused to (a client without the admin right
        is refused the status of a relay that is up)."""
        return self.status is not None or self.refused


def ask_relays(
    endpoints: Mapping[int, str],
    request: Callable[[int], wire.ClientMessage],
    timeout_s: float = 1.0,
    curve: ClientCurve | None = None,
) -> dict[int, wire.ClientMessage | str]:
    """Send every relay (relay id -> client endpoint) one request at once (`request`
    makes it from a request id) and wait for their answers, each within `timeout_s` in
    all (`curve`: as this CurveZMQ client): per relay the answer, or why there is none.
    Never raises for a relay that is down or answers garbage."""
    ctx = zmq.Context()
    socks: dict[int, zmq.Socket[Any]] = {}
    answers: dict[int, wire.ClientMessage | str] = {}
    request_ids: dict[int, int] = {}
    try:
        poller = zmq.Poller()
        for n, (relay_id, endpoint) in enumerate(sorted(endpoints.items())):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_STATUS_BYTES)
            socks[relay_id] = sock
            if is_ipv6(endpoint):  # (relay.sockets.allow_ipv6 would import asyncio)
                sock.setsockopt(zmq.IPV6, 1)
            if curve is not None:
                curve.apply(sock, endpoint)
            try:
                sock.connect(endpoint)
                request_ids[relay_id] = n + 1
                sock.send(wire.encode(request(n + 1)), zmq.NOBLOCK)
            except zmq.ZMQError as e:
                answers[relay_id] = f"cannot send: {e}"
                continue
            poller.register(sock, zmq.POLLIN)
        by_sock = {id(s): r for r, s in socks.items()}
        deadline = time.monotonic() + timeout_s
        while len(answers) < len(endpoints):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            for sock, _ in poller.poll(left_ms):
                relay_id = by_sock[id(sock)]
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.ZMQError:
                    continue
                try:
                    msg = wire.decode(frame, MAX_STATUS_BYTES)
                except Exception as e:
                    answers[relay_id] = f"bad answer: {e}"
                else:
                    if msg.request_id != request_ids[relay_id]:
                        continue  # not ours; keep waiting
                    answers[relay_id] = msg
                poller.unregister(sock)
        for relay_id in endpoints:
            if relay_id not in answers:
                answers[relay_id] = f"no answer within {timeout_s:g} s"
    finally:
        for sock in socks.values():
            sock.close(linger=0)
        ctx.term()
    return dict(sorted(answers.items()))


def query_status(
    endpoints: Mapping[int, str], timeout_s: float = 1.0, curve: ClientCurve | None = None
) -> dict[int, StatusReply]:
    """Ask every relay (relay id -> client endpoint) for its status at once; each gets
    `timeout_s` in total (`curve`: as this CurveZMQ client). Never raises for a relay that
    is down or answers garbage."""
    answers = ask_relays(endpoints, wire.StatusReq, timeout_s, curve)
    return {r: _status_reply(r, endpoints[r], answer) for r, answer in answers.items()}


def _status_reply(relay_id: int, endpoint: str, answer: wire.ClientMessage | str) -> StatusReply:
    if isinstance(answer, str):
        return StatusReply(relay_id, endpoint, None, answer)
    if isinstance(answer, wire.ErrorResp):
        return StatusReply(
            relay_id, endpoint, None, f"refused: {answer.error}: {answer.message}", refused=True
        )
    if not isinstance(answer, wire.StatusResp):
        return StatusReply(relay_id, endpoint, None, f"unexpected {type(answer).__name__}")
    try:
        status = json.loads(answer.status_json)
    except ValueError as e:
        return StatusReply(relay_id, endpoint, None, f"status is not JSON: {e}")
    if not isinstance(status, dict):
        return StatusReply(relay_id, endpoint, None, "status is not a JSON object")
    return StatusReply(relay_id, endpoint, status)


def named_streams(spec: RelaySpec) -> tuple[str, ...]:
    """The exact stream names of a relay's subscriptions (they join at start)."""
    return tuple(s for s in spec.streams if not is_pattern(s))


def startup_streams(config: MeshConfig, relay_id: int) -> tuple[str, ...]:
    """The streams a relay opens and joins at start (docs/protocol.md section 2): the exact
    names among its subscriptions and the declared streams it serves."""
    named = named_streams(config.relays[relay_id])
    served = tuple(s for s in config.streams if s not in named and relay_id in config.members(s))
    return named + served


def not_ready_reason(config: MeshConfig, relay_id: int, status: Mapping[str, Any]) -> str | None:
    """Why a relay with this status is not ready yet; None if every stream it opens at
    start (`startup_streams`) is joined and unfenced, but those whose configuration leaves
    it out (`not_member`: it does not serve them, as its /readyz says). (Named
    subscriptions alone said a relay subscribed by pattern was ready as soon as it
    answered, joined or not.)"""
    streams = status.get("streams")
    if not isinstance(streams, dict):
        return "its status has no streams"
    outside = status.get("not_member") or {}
    for name in startup_streams(config, relay_id):
        if name in outside and name not in streams:
            continue
        info = streams.get(name)
        if not isinstance(info, dict):
            return f"stream {name!r} is not open"
        if not info.get("joined"):
            return f"stream {name!r} has not joined"
        if info.get("fenced"):
            return f"stream {name!r} is fenced ({info.get('fence_reason') or 'no reason given'})"
    return None


# --- the mesh ---------------------------------------------------------------------------------


@dataclass
class _Child:
    relay: int
    proc: subprocess.Popen[bytes]
    log_path: Path | None
    started_s: float  # monotonic


@dataclass
class _Restart:
    """A relay's restarts under `Mesh.tend`: the back-off and, once it exited, when it is
    started again."""

    backoff_s: float = RESTART_FIRST_S
    due_s: float | None = None  # monotonic; None while it runs
    count: int = 0


class Mesh:
    """Every relay of a topology as child processes of this one (see the module doc).

    `config_path`: the topology (loaded at once; raises ConfigError). `log_dir`: write each
    relay's output to `log_dir/relay-<id>.log` (default: inherit this process's stdout and
    stderr). `die_with_parent`: on Linux, children get SIGTERM when the thread that started
    them exits (use it only from a thread that lives as long as the mesh, e.g. the main one).
    `wrappers`: relay id -> the command its relay runs under (e.g. `["ip", "netns", "exec",
    NAME]` to put it in a network namespace); it must exec the relay, so signals reach it.
    Its ports are not checked before the start (they are in the wrapper's network).
    `log_level`, `log_format`: the relays' `--log-level` and `--log-format`.
    """

    def __init__(
        self,
        config_path: str | Path,
        *,
        log_level: str = "info",
        log_format: str = "text",
        log_dir: str | Path | None = None,
        die_with_parent: bool = False,
        stop_grace_s: float = STOP_GRACE_S,
        wrappers: Mapping[int, Sequence[str]] | None = None,
        key_file: str | Path | None = None,
    ) -> None:
        self.config_path = Path(config_path)
        self.wrappers = {r: list(w) for r, w in (wrappers or {}).items()}
        self.config: MeshConfig = load(self.config_path)
        self.key_file = key_file
        self.curve: ClientCurve | None = None  # set by start() (the keys may not exist yet)
        self.log_level = log_level
        self.log_format = log_format
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.die_with_parent = die_with_parent
        self.stop_grace_s = stop_grace_s
        self._children: dict[int, _Child] = {}
        self._restarts: dict[int, _Restart] = {}
        self._started = False
        self._atexit_registered = False

    # --- queries ----------------------------------------------------------------------------

    @property
    def endpoints(self) -> dict[int, RelayEndpoints]:
        """relay id -> its mesh and client endpoints and streams, ascending."""
        return {
            r: RelayEndpoints(r, spec.mesh_endpoint, spec.client_endpoint, spec.streams)
            for r, spec in self.config.relays.items()
        }

    @property
    def relay_ids(self) -> tuple[int, ...]:
        return tuple(self.config.relays)

    @property
    def pids(self) -> dict[int, int]:
        """relay id -> pid of its process (also of a process that has exited)."""
        return {r: c.proc.pid for r, c in self._children.items()}

    def alive(self, relay_id: int) -> bool:
        child = self._children.get(relay_id)
        return child is not None and child.proc.poll() is None

    def returncode(self, relay_id: int) -> int | None:
        child = self._children.get(relay_id)
        return None if child is None else child.proc.poll()

    def status(self, relay_id: int, timeout_s: float = 1.0) -> dict[str, Any] | None:
        """The relay's status document, or None if it does not answer in time."""
        endpoint = self.config.relays[relay_id].client_endpoint
        return query_status({relay_id: endpoint}, timeout_s, self.curve)[relay_id].status

    def statuses(self, timeout_s: float = 1.0) -> dict[int, StatusReply]:
        endpoints = {r: e.client for r, e in self.endpoints.items()}
        return query_status(endpoints, timeout_s, self.curve)

    def ensure_keys(self) -> list[Path]:
        """With CurveZMQ: create the key pairs this machine lacks and load the client key
        of status queries; the secret key files created."""
        if not self.config.security.curve:
            return []
        from relay.security import KeyRing, client_curve

        created = KeyRing(self.config).ensure()
        self.curve = client_curve(self.config, self.key_file)
        return created

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0, stop: threading.Event | None = None) -> Mesh:
        """Check the ports, start every relay and wait (at most `timeout_s`) until each is
        ready. On failure stops every relay and raises MeshError naming the one that did
        not come up (or whose port is taken: then nothing was started). `stop` set while
        it waits (e.g. by a signal handler, which need not raise) stops every relay and
        raises MeshError too."""
        if self._started:
            raise RuntimeError("this mesh was already started")
        self.check_ports()
        self._started = True
        self.ensure_keys()
        self._register_atexit()
        try:
            for relay_id in self.config.relays:
                self._spawn(relay_id)
            self.wait_ready(self.config.relays, timeout_s, stop)
        except BaseException:
            self.stop()
            raise
        return self

    def check_ports(self) -> None:
        """MeshError naming every port a relay of this host would listen on that is taken
        (or whose address is not this host's), and its relay; nothing is started. Bound
        as libzmq binds (SO_REUSEADDR), so a port left in TIME_WAIT counts as free."""
        taken = ports_taken(self.config, skip=set(self.wrappers))
        if taken:
            raise MeshError(
                f"cannot start the mesh of {self.config_path}, nothing was started: "
                + "; ".join(text for _, text in taken),
                relay_id=taken[0][0],
            )

    def tend(self, now_s: float | None = None) -> None:
        """Restart the relays whose process ended (call it every few tenths of a second
        while the mesh runs): each exit is logged, and the relay started again after its
        back-off (see the module doc). Never raises for a relay that cannot be started:
        that is logged, and tried again after the next back-off."""
        now_s = time.monotonic() if now_s is None else now_s
        for relay_id, child in self._children.items():
            restart = self._restarts.setdefault(relay_id, _Restart())
            code = child.proc.poll()
            if code is None:
                if now_s - child.started_s >= RESTART_STABLE_S:
                    restart.backoff_s = RESTART_FIRST_S
                continue
            if restart.due_s is None:
                restart.due_s = now_s + restart.backoff_s
                log.warning(
                    "relay %d (pid %d) exited with code %s after %.1f s; starting it again in %g s",
                    relay_id,
                    child.proc.pid,
                    code,
                    now_s - child.started_s,
                    restart.backoff_s,
                    extra={
                        "relay": relay_id,
                        "exit_code": code,
                        "restart_in_s": restart.backoff_s,
                        STATE_CHANGE: True,
                    },
                )
                continue
            if now_s < restart.due_s:
                continue
            restart.due_s = None
            restart.count += 1
            restart.backoff_s = min(2 * restart.backoff_s, RESTART_MAX_S)
            try:
                self._spawn(relay_id)
            except MeshError as e:
                log.error("%s", e, extra={"relay": relay_id})
                continue
            log.warning(  # not info: a restart is news at every log level but error
                "relay %d started again (pid %d, restart %d)",
                relay_id,
                self._children[relay_id].proc.pid,
                restart.count,
                extra={"relay": relay_id, "restarts": restart.count, STATE_CHANGE: True},
            )

    def wait_ready(
        self, relay_ids: Iterable[int], timeout_s: float = 10.0, stop: threading.Event | None = None
    ) -> None:
        """Wait until every relay of `relay_ids` is ready; raise MeshError on the first
        that exits, naming one still not ready when `timeout_s` passes, or when `stop` is
        set."""
        stop = threading.Event() if stop is None else stop
        waiting = {r: "it did not answer a StatusReq yet" for r in relay_ids}
        deadline = time.monotonic() + timeout_s
        while True:
            for relay_id in waiting:
                child = self._children.get(relay_id)
                if child is None:
                    raise MeshError(f"relay {relay_id} was not started", relay_id=relay_id)
                code = child.proc.poll()
                if code is not None:
                    raise MeshError(
                        f"relay {relay_id} exited with code {code} before it was ready"
                        + self._log_tail(child),
                        relay_id=relay_id,
                    )
            endpoints = {r: self.config.relays[r].client_endpoint for r in waiting}
            for relay_id, reply in query_status(endpoints, PROBE_TIMEOUT_S, self.curve).items():
                if reply.status is None:
                    waiting[relay_id] = f"it did not answer a StatusReq on {reply.endpoint}"
                    continue
                reason = not_ready_reason(self.config, relay_id, reply.status)
                if reason is None:
                    del waiting[relay_id]
                else:
                    waiting[relay_id] = reason
            if not waiting:
                return
            if time.monotonic() >= deadline:
                relay_id, reason = min(waiting.items())
                others = sorted(waiting)[1:]
                also = f" (nor did relays {others})" if others else ""
                child = self._children[relay_id]
                raise MeshError(
                    f"relay {relay_id} did not come up within {timeout_s:g} s: {reason}{also}"
                    + self._log_tail(child),
                    relay_id=relay_id,
                )
            if stop.wait(POLL_S):
                raise MeshError("stopped while the relays were starting")

    def kill(
        self, relay_id: int, sig: int = signal.SIGKILL, *, wait_s: float | None = None
    ) -> int | None:
        """Send `sig` to one relay. For SIGKILL, SIGTERM and SIGINT wait (at most `wait_s`,
        default the stop grace; then SIGKILL) until it is gone and return its exit code;
        for other signals (SIGSTOP, SIGCONT, ...) return None at once."""
        child = self._children.get(relay_id)
        if child is None:
            raise KeyError(f"relay {relay_id} was not started")
        _signal(child.proc, sig)
        if sig == signal.SIGTERM:
            _signal(child.proc, signal.SIGCONT)  # a stopped process must run to exit
        if sig not in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            return None
        grace = self.stop_grace_s if wait_s is None else wait_s
        try:
            return child.proc.wait(grace)
        except subprocess.TimeoutExpired:
            _signal(child.proc, signal.SIGKILL)
            return child.proc.wait(grace)

    def restart(self, relay_id: int, timeout_s: float = 10.0) -> None:
        """Stop the relay if it runs (SIGTERM, then SIGKILL), start it again and wait until
        it is ready. Raises MeshError if it does not come up (the others keep running)."""
        if relay_id not in self.config.relays:
            raise KeyError(f"relay {relay_id} is not in {self.config_path}")
        if self.alive(relay_id):
            self.kill(relay_id, signal.SIGTERM)
        self._spawn(relay_id)
        self.wait_ready([relay_id], timeout_s)

    def stop(self) -> dict[int, int | None]:
        """Stop every relay: SIGTERM, then SIGKILL after the grace. Returns the exit codes.
        Safe to call more than once."""
        children = list(self._children.values())
        for child in children:
            if child.proc.poll() is None:
                _signal(child.proc, signal.SIGTERM)
                _signal(child.proc, signal.SIGCONT)
        deadline = time.monotonic() + self.stop_grace_s
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(max(0.0, deadline - time.monotonic()))
        for child in children:
            if child.proc.poll() is None:
                _signal(child.proc, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(self.stop_grace_s)
        if self._atexit_registered:
            atexit.unregister(self._kill_all)
            self._atexit_registered = False
        return {c.relay: c.proc.poll() for c in children}

    def __enter__(self) -> Mesh:
        if not self._started:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- internals ----------------------------------------------------------------------------

    def _command(self, relay_id: int) -> list[str]:
        return [
            *self.wrappers.get(relay_id, []),
            sys.executable,
            "-m",
            "relay",
            "run",
            "--config",
            str(self.config_path.resolve()),
            "--relay",
            str(relay_id),
            "--log-level",
            self.log_level,
            "--log-format",
            self.log_format,
        ]

    def _spawn(self, relay_id: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_PROJECT_ROOT), env.get("PYTHONPATH", "")) if p
        )
        env.setdefault("PYTHONUNBUFFERED", "1")
        log_path: Path | None = None
        out: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"relay-{relay_id}.log"
            out = open(log_path, "ab")  # noqa: SIM115 (the child holds it; closed below)
        try:
            proc = subprocess.Popen(
                self._command(relay_id),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                env=env,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
            )
        except OSError as e:
            raise MeshError(f"relay {relay_id} could not be started: {e}", relay_id=relay_id) from e
        finally:
            if out is not None:
                out.close()
        self._children[relay_id] = _Child(relay_id, proc, log_path, time.monotonic())

    def _log_tail(self, child: _Child, lines: int = 15) -> str:
        if child.log_path is None:
            return ""
        try:
            text = child.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        tail = text.splitlines()[-lines:]
        if not tail:
            return f"\n(its log {child.log_path} is empty)"
        return f"\nlast lines of {child.log_path}:\n" + "\n".join("  " + t for t in tail)

    def _register_atexit(self) -> None:
        if not self._atexit_registered:
            atexit.register(self._kill_all)
            self._atexit_registered = True

    def _kill_all(self) -> None:
        """Last resort when the interpreter exits without stop(): leave no relay behind."""
        for child in self._children.values():
            if child.proc.poll() is None:
                _signal(child.proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(1.0)


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def listen_addresses(spec: RelaySpec) -> list[tuple[str, str, int]]:
    """(what, host, port) of every port the relay listens on (binds: at its bind_host)."""
    host = spec.bind_host
    found = [("mesh", host, spec.mesh_port), ("client", host, spec.client_port)]
    if spec.http_port is not None:
        found.append(("http", host, spec.http_port))
    return found


def ports_taken(config: MeshConfig, skip: Collection[int] = ()) -> list[tuple[int, str]]:
    """(relay id, words) for every port a relay of `config` (but those in `skip`) would
    listen on that is taken here, or whose address is not this host's."""
    taken: list[tuple[int, str]] = []
    for relay_id, spec in config.relays.items():
        if relay_id in skip:
            continue
        for what, host, port in listen_addresses(spec):
            problem = _bind_problem(host, port)
            if problem is not None:
                taken.append(
                    (relay_id, f"relay {relay_id}'s {what} port {port} on {host}: {problem}")
                )
    return taken


def _bind_problem(host: str, port: int) -> str | None:
    """Why a listener cannot bind (host, port) here now (None: it can)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"cannot resolve {host!r}: {e}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"in use ({e.strerror})"
            return f"cannot listen there ({e.strerror or e})"
    return None


# Ports `free_ports` picks from: below the kernel's ephemeral range, which outgoing
# connections take their local ports from. A port picked there can be taken by any
# connection while the relay that listens on it restarts ("Address already in use").
PICKED_PORTS_LOW = 10_000
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
EPHEMERAL_LOW_DEFAULT = 32_768
PICK_ATTEMPTS_PER_PORT = 50


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_LOW_DEFAULT


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free on `host` right now (held open together while chosen),
    at random below the ephemeral range where there is room (else any the kernel gives)."""
    import random

    held: list[socket.socket] = []
    high = _ephemeral_low()
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            for _ in range(PICK_ATTEMPTS_PER_PORT if high > PICKED_PORTS_LOW else 0):
                try:
                    sock.bind((host, random.randrange(PICKED_PORTS_LOW, high)))
                    break
                except OSError:
                    continue
            else:
                sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in held]
    finally:
        for sock in held:
            sock.close()


def write_loopback_topology(
    directory: Path,
    subscriptions: Mapping[int, Sequence[str]],
    declared: Sequence[str] = (),
    limits: Mapping[str, int] | None = None,
    spool: Mapping[str, Any] | None = None,
    access: Mapping[str, Mapping[str, Any]] | None = None,
    http: bool = False,
) -> Path:
    """Write `directory/topology.yaml`: relay id -> its subscriptions, every relay on free
    ports of 127.0.0.1, the declared streams, optional limits and spool settings, data
    under `directory`. `access`: turn CurveZMQ on with these clients and rights (keys under
    `directory/data/keys`, created by `Mesh.start`); the client `admin`, with every right,
    is added unless given, and is the default client key. `http`: give every relay an
    http_port (relay/opsserver.py).
    For tests and benchmarks that must not collide with a running mesh."""
    import yaml  # type: ignore[import-untyped, unused-ignore]

    directory.mkdir(parents=True, exist_ok=True)
    ports = free_ports(3 * len(subscriptions))
    doc: dict[str, Any] = {
        "relays": [
            {
                "id": relay_id,
                "host": "127.0.0.1",
                "mesh_port": ports[2 * i],
                "client_port": ports[2 * i + 1],
                **({"http_port": ports[2 * len(subscriptions) + i]} if http else {}),
                "streams": list(streams),
            }
            for i, (relay_id, streams) in enumerate(sorted(subscriptions.items()))
        ],
        "streams": list(declared),
        "data_dir": str(directory / "data"),
    }
    if limits:
        doc["limits"] = dict(limits)
    if spool is not None:
        doc["spool"] = dict(spool)
    if access is not None:
        keys = directory / "data" / "keys"
        doc["security"] = {
            "curve": True,
            "keys_dir": str(keys),
            "client_key_file": str(keys / "client-admin.key_secret"),
        }
        doc["access"] = {"admin": dict(ADMIN_GRANT), **{k: dict(v) for k, v in access.items()}}
    path = directory / "topology.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def resubscribe(path: Path, subscriptions: Mapping[int, Sequence[str]]) -> None:
    """Give the relays of a topology file (one `write_loopback_topology` wrote) other
    subscriptions (relay id -> its streams; the others keep theirs), as an operator edits
    the file before restarting relays onto it. For tests."""
    import yaml  # type: ignore[import-untyped, unused-ignore]

    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    for relay in doc["relays"]:
        relay["streams"] = list(subscriptions.get(relay["id"], relay["streams"]))
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
