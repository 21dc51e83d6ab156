"""The attacks of issue 48 again, measured the same way before and after the fixes.

    PYTHONPATH=/work/wt-base .venv/bin/python scripts/attack_figures.py --attack all
    PYTHONPATH=$PWD .venv/bin/python scripts/attack_figures.py --attack read-flood \
        [--seconds 20] [--quiet-s 10] [--recover-s 60] [--json]

Measures whichever relay package is on PYTHONPATH (the baseline checkout for "before", the
fixed tree for "after"): it uses only what the baseline has (relay.launcher.Mesh and
write_loopback_topology, relay.client Producer/Consumer/Metadata, relay.wire frames on raw
pyzmq DEALERs, the relay CLI), so the same script runs against both.

Each attack (`--attack NAME`, or `all`: float-op, unread, read-flood, streams, readyz,
ops-port, keys, barrier, small) gets a fresh 3-relay CurveZMQ mesh on free loopback ports
in a temporary directory (every relay serves `orders.*`; clients `app`, the attacker with
the issue's rights, `legit` and `admin`; an HTTP ops port on each relay). Throughout, a
legitimate client (`legit`, in a process of its own so the attacker's threads do not slow
it) produces unique values to `orders.legit` at `--rate` per second, one `send` at a time,
timing each, and a live consumer reads them. Phases:

- quiet (`--quiet-s`): legit p50/p99, relay CPU (utime+stime from /proc/<pid>/stat, % of
  one core), RSS (VmRSS, /proc/<pid>/status);
- attack: the same, plus the attack's own figures (sub-windows where it has several parts);
- recovery: the seconds from the attack's end to the start of the first 3-s window in which
  every relay's CPU is within `--cpu-margin` points (or half again) of its quiet level and
  the legit p50 within 1.5x (or +1 ms) of the quiet p50 with no failed send; "not
  recovered" after `--recover-s`; then an "after" window of `--after-s`.

/healthz and /readyz of every relay are sampled every 2 s (codes per phase); counters of
/metrics whose names hold refused/slow/too_many/not_authorized/handshake are shown (value
at the end and growth since the quiet phase). At the end the legit history is checked:
every value the producer was told committed must be read exactly once, in order, at its
seq, from the earliest position, from every relay alone (a Consumer pinned to it); lost,
duplicated and misplaced values are counted, and whether every relay is still alive.
`keys` starts no mesh: it starts a relay (the CLI) on broken key set-ups and reports
whether it refused. Progress goes to stderr; the table (or with --json one JSON object) to
stdout. Exit code 0, 1 if an attack could not be run (its error is in the report).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

import relay
from relay import wire
from relay.client import Consumer, Metadata, Producer
from relay.core.messages import ReadStatus
from relay.errors import ClientError, FrameError, Unknown
from relay.launcher import Mesh, write_loopback_topology
from relay.meta import ANY_VERSION, KIND_META, META_FORMAT, METADATA_STREAM, OP_READ, mark_key
from relay.security import ClientCurve, KeyRing, client_curve, curve_client, generate, load_identity
from relay.topology import MeshConfig, load

STREAM = "orders.legit"  # the legitimate client's
BIG = "orders.big"  # pre-filled for the unread-answer attack
EMPTY = "orders.empty"  # declared, never written
DECLARED = (STREAM, BIG, EMPTY)
RELAYS = (0, 1, 2)
TARGET = 0  # the relay an attack aims at when it aims at one
ACCESS: dict[str, dict[str, Any]] = {
    "app": {"produce": ["orders.*"], "consume": ["orders.*"], "metadata": ["consumers/app-*"]},
    "legit": {
        "produce": [STREAM],
        "consume": [STREAM],
        "metadata": ["consumers/legit-*"],
    },
}
DURABLE = "legit-c"  # the legit durable consumer of the barrier attack
WATCHED_WORDS = ("refused", "slow", "too_many", "not_authorized", "handshake")
START_TIMEOUT_S = 90.0
SEND_TIMEOUT_S = 10.0  # one legit send, every attempt included
ANSWER_TIMEOUT_S = 10.0
HTTP_TIMEOUT_S = 3.0
PROC_SAMPLE_S = 0.5
HEALTH_SAMPLE_S = 2.0
RECOVERY_SPAN_S = 3.0
RECOVERY_STEP_S = 0.5
HISTORY_TIMEOUT_S = 60.0  # reading one relay's whole legit history
MAX_ANSWER_BYTES = 64 * 1024 * 1024
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
MB = 1024 * 1024
RELAY_ROOT = Path(relay.__file__).resolve().parent.parent  # the package measured

# --- measuring a process -----------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (all its threads), in seconds."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- the ops port --------------------------------------------------------------------------


@dataclass(frozen=True)
class HttpAnswer:
    code: int | str  # the HTTP status, or why there is none ("timeout", "refused", ...)
    latency_s: float
    body: bytes = b""


def http_get(host: str, port: int, path: str, timeout_s: float = HTTP_TIMEOUT_S) -> HttpAnswer:
    started = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        return HttpAnswer(response.status, time.monotonic() - started, body)
    except TimeoutError:
        return HttpAnswer("timeout", time.monotonic() - started)
    except ConnectionRefusedError:
        return HttpAnswer("refused", time.monotonic() - started)
    except (OSError, http.client.HTTPException) as e:
        return HttpAnswer(type(e).__name__, time.monotonic() - started)
    finally:
        conn.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: sample (name and labels) -> value."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            found[name] = float(value)
    return found


def watched(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if any(w in k for w in WATCHED_WORDS)}


# --- raw clients -------------------------------------------------------------------------


def answer_kind(answer: Any) -> str:
    """A short name of an answer: ReadResp:ok, ErrorResp:SlowConsumer, ProduceResp:rejected."""
    if answer is None:
        return "no answer"
    if isinstance(answer, str):
        return answer
    name = type(answer).__name__
    if isinstance(answer, wire.ErrorResp):
        return f"{name}:{answer.error}"
    if isinstance(answer, wire.ReadResp):
        return f"{name}:{answer.status.value}"
    if isinstance(answer, wire.ProduceResp):
        reason = answer.reason.split(" ")[0].rstrip(":")
        return f"{name}:{answer.outcome.value}" + (f":{reason}" if reason else "")
    if isinstance(answer, wire.MetaResp):
        return f"{name}:{answer.status}" + (f":{answer.result}" if answer.result else "")
    return name


class RawClient:
    """A DEALER to one relay as a client (its CurveZMQ key): sends any frame, reads answers."""

    def __init__(self, ctx: Any, endpoint: str, curve: ClientCurve | None, **options: int) -> None:
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            self.sock.setsockopt(getattr(zmq, name), value)
        if curve is not None:
            curve.apply(self.sock, endpoint)
        self.sock.connect(endpoint)
        self._ids = 0
        self.closed = False

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    def send(self, msg: wire.ClientMessage) -> int:
        frame = wire.encode(msg)
        self.sock.send(frame)
        return len(frame)

    def recv(self, timeout_s: float) -> Any:
        """The next answer (decoded; a string if it does not decode), None if none came."""
        if not self.sock.poll(max(0, int(timeout_s * 1000))):
            return None
        frame = self.sock.recv_multipart()[-1]
        try:
            return wire.decode(frame, MAX_ANSWER_BYTES)
        except FrameError as e:
            return f"undecodable: {e}"

    def ask(self, msg: wire.ClientMessage, timeout_s: float = ANSWER_TIMEOUT_S) -> Any:
        """Send a request and return the answer with its request id (None: none in time)."""
        self.send(msg)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            answer = self.recv(left)
            if getattr(answer, "request_id", None) == msg.request_id:
                return answer
        return None

    def collect(self, count: int, timeout_s: float) -> Counter[str]:
        """Kinds of up to `count` answers, reading at most `timeout_s` (a pause of it ends)."""
        kinds: Counter[str] = Counter()
        deadline = time.monotonic() + timeout_s
        while sum(kinds.values()) < count and (left := deadline - time.monotonic()) > 0:
            answer = self.recv(min(left, 5.0))
            if answer is None:
                break
            kinds[answer_kind(answer)] += 1
        return kinds

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close(linger=0)


def meta_op_value(op: object, key: str) -> bytes:
    """A metadata operation's transaction value packed by hand (relay.meta.encode_op
    checks what it packs; `op` may be anything here, a float for instance)."""
    packed: bytes = msgpack.packb([META_FORMAT, op, key, ANY_VERSION, None], use_bin_type=True)
    return packed


# --- the legitimate client (a process of its own) ----------------------------------------

# (monotonic time at the answer, latency s, seq or -1, value index, error or "")
Send = tuple[float, float, int, int, str]


def legit_value(index: int) -> bytes:
    return b"legit-%d" % index


def legit_index(value: bytes) -> int:
    """The index legit_value wrote into `value`; -1 if it is no legit value."""
    return int(value[6:]) if value.startswith(b"legit-") and value[6:].isdigit() else -1


def _legit_consume(
    config_path: str, key_file: str, done: threading.Event, top: list[int], out: Any
) -> None:
    """Read STREAM live until `done` and the last committed seq (`top[0]`) was read."""
    values: list[tuple[int, int]] = []
    errors: Counter[str] = Counter()
    last = -1
    give_up = None
    while True:
        try:
            with Consumer(
                topology=config_path, key_file=key_file, store=False, timeout_s=0.5
            ) as consumer:
                consumer.subscribe(STREAM, "earliest" if last < 0 else last)
                while True:
                    if done.is_set():
                        give_up = give_up or time.monotonic() + 15.0
                        if last >= top[0] or time.monotonic() > give_up:
                            out.put(("consumer", values, dict(errors)))
                            return
                    try:
                        record = next(consumer)
                    except StopIteration:
                        continue
                    last = record.seq
                    values.append((record.seq, legit_index(record.value)))
        except ClientError as e:
            errors[type(e).__name__] += 1
            time.sleep(0.5)


def _exit_with_parent(parent: int) -> None:
    """... or, should it die without doing so, this thread ends the process."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(3)


def legit_worker(config_path: str, key_file: str, rate: float, stop: Any, out: Any) -> None:
    """The legit producer and live consumer; every send's outcome goes to `out`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops this process ...
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    top = [-1]
    done = threading.Event()
    reader = threading.Thread(
        target=_legit_consume, args=(config_path, key_file, done, top, out), daemon=True
    )
    reader.start()
    period = 1.0 / rate
    with Producer(
        topology=config_path, key_file=key_file, window=1, send_timeout_s=SEND_TIMEOUT_S
    ) as producer:
        index = 0
        next_at = time.monotonic()
        while not stop.is_set():
            started = time.monotonic()
            seq, error = -1, ""
            try:
                seq = producer.send(STREAM, legit_value(index))
                top[0] = max(top[0], seq)
            except Unknown as e:
                error = f"Unknown: {e}"[:200]
            except ClientError as e:
                error = f"{type(e).__name__}: {e}"[:200]
            ended = time.monotonic()
            out.put(("send", ended, ended - started, seq, index, error))
            index += 1
            next_at += period
            if ended - next_at > 1.0:  # far behind (a stall): no burst to catch up
                next_at = ended
            time.sleep(max(0.0, next_at - time.monotonic()))
    done.set()
    reader.join(30.0)
    out.put(("done",))


class LegitLoad:
    """Runs legit_worker in a child process and gathers what it reports."""

    def __init__(self, config_path: Path, key_file: Path, rate: float) -> None:
        mp = multiprocessing.get_context("spawn")
        self._stop = mp.Event()
        self._out: Any = mp.Queue()
        self._proc = mp.Process(
            target=legit_worker,
            args=(str(config_path), str(key_file), rate, self._stop, self._out),
            daemon=True,
        )
        self.sends: list[Send] = []
        self.consumed: list[tuple[int, int]] = []
        self.consumer_errors: dict[str, int] = {}
        self._finished = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)

    def start(self) -> LegitLoad:
        self._proc.start()
        self._reader.start()
        return self

    def _read(self) -> None:
        while True:
            try:
                item = self._out.get(timeout=1.0)
            except Exception:  # queue.Empty
                if not self._proc.is_alive():
                    break
                continue
            if item[0] == "send":
                self.sends.append(tuple(item[1:]))
            elif item[0] == "consumer":
                self.consumed, self.consumer_errors = item[1], item[2]
            elif item[0] == "done":
                break
        self._finished.set()

    def wait_first_commit(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(s[2] >= 0 for s in self.sends[-50:]):
                return True
            time.sleep(0.1)
        return False

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        self._finished.wait(timeout_s)
        self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5.0)


# --- sampling the relays -------------------------------------------------------------------


@dataclass
class Samples:
    # (monotonic time, relay -> (RSS bytes, CPU seconds)); a relay gone has None
    proc: list[tuple[float, dict[int, tuple[int | None, float | None]]]] = field(
        default_factory=list
    )
    # (monotonic time, relay, path, code)
    health: list[tuple[float, int, str, str]] = field(default_factory=list)


class Sampler:
    """Threads that sample every relay's /proc figures and its /healthz and /readyz."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.samples = Samples()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._proc, daemon=True)] + [
            threading.Thread(target=self._health, args=(r,), daemon=True) for r in RELAYS
        ]

    def start(self) -> Sampler:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(2 * HTTP_TIMEOUT_S + 1)

    def _proc(self) -> None:
        while not self._stop.is_set():
            pids = self.mesh.pids
            now = time.monotonic()
            self.samples.proc.append(
                (now, {r: (rss_bytes(pid), cpu_seconds(pid)) for r, pid in pids.items()})
            )
            self._stop.wait(PROC_SAMPLE_S)

    def _health(self, relay_id: int) -> None:
        spec = self.mesh.config.relays[relay_id]
        assert spec.http_port is not None
        while not self._stop.is_set():
            for path in ("/healthz", "/readyz"):
                answer = http_get(spec.host, spec.http_port, path)
                self.samples.health.append((time.monotonic(), relay_id, path, str(answer.code)))
            self._stop.wait(HEALTH_SAMPLE_S)


# --- figures of a time window --------------------------------------------------------------


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def legit_figures(sends: Sequence[Send], t0: float, t1: float) -> dict[str, Any]:
    inside = [s for s in sends if t0 <= s[0] < t1]
    ok = [s[1] for s in inside if s[2] >= 0]
    errors = Counter(_error_kind(s[4]) for s in inside if s[2] < 0)
    return {
        "sends": len(inside),
        "failed": dict(errors),
        "p50_ms": _ms(percentile(ok, 0.5)),
        "p99_ms": _ms(percentile(ok, 0.99)),
        "max_ms": _ms(max((s[1] for s in inside), default=None)),
    }


def _error_kind(error: str) -> str:
    kind = error.split(":")[0]
    for reason in ("buffer_full", "too_many_streams", "not_authorized", "fenced", "late"):
        if reason in error:
            return f"{kind}:{reason}"
    return kind


def cpu_figures(samples: Samples, t0: float, t1: float) -> dict[int, float | None]:
    """Per relay, its CPU over the samples within [t0, t1], in % of one core."""
    inside = [(t, by) for t, by in list(samples.proc) if t0 <= t <= t1]
    found: dict[int, float | None] = {}
    for relay_id in RELAYS:
        points = [(t, by[relay_id][1]) for t, by in inside if relay_id in by]
        known = [(t, c) for t, c in points if c is not None]
        if len(known) < 2 or known[-1][0] - known[0][0] <= 0:
            found[relay_id] = None
            continue
        found[relay_id] = round(
            100 * (known[-1][1] - known[0][1]) / (known[-1][0] - known[0][0]), 1
        )
    return found


def rss_figures(samples: Samples, t0: float, t1: float) -> dict[int, float | None]:
    """Per relay, its peak RSS within [t0, t1], in MB."""
    inside = [by for t, by in list(samples.proc) if t0 <= t <= t1]
    found: dict[int, float | None] = {}
    for relay_id in RELAYS:
        values = [by[relay_id][0] for by in inside if relay_id in by]
        known = [v for v in values if v is not None]
        found[relay_id] = round(max(known) / MB, 1) if known else None
    return found


def health_figures(samples: Samples, t0: float, t1: float) -> dict[str, dict[str, int]]:
    """Per path, how often each code was seen (all relays) within [t0, t1]."""
    found: dict[str, Counter[str]] = {"/healthz": Counter(), "/readyz": Counter()}
    for t, _, path, code in list(samples.health):
        if t0 <= t <= t1:
            found[path][code] += 1
    return {path: dict(codes) for path, codes in found.items()}


@dataclass
class Window:
    name: str
    t0: float
    t1: float


def window_figures(sends: Sequence[Send], samples: Samples, window: Window) -> dict[str, Any]:
    return {
        "seconds": round(window.t1 - window.t0, 1),
        "legit": legit_figures(sends, window.t0, window.t1),
        "cpu_pct": cpu_figures(samples, window.t0, window.t1),
        "rss_peak_mb": rss_figures(samples, window.t0, window.t1),
        "health": health_figures(samples, window.t0, window.t1),
    }


# --- one attack's run ------------------------------------------------------------------------


class Run:
    """A mesh for one attack, its legit load and samplers, and what the attack opened:
    all of it closed by `close`, also on failure."""

    def __init__(self, directory: Path, args: argparse.Namespace) -> None:
        self.directory = directory
        self.args = args
        self.path = write_loopback_topology(
            directory, {r: ["orders.*"] for r in RELAYS}, list(DECLARED), access=ACCESS, http=True
        )
        self.mesh = Mesh(
            self.path, log_level="info", log_dir=directory / "logs", die_with_parent=True
        )
        self.config: MeshConfig = self.mesh.config
        self.ctx: Any = zmq.Context()
        self.raws: list[RawClient] = []
        self.sampler: Sampler | None = None
        self.legit: LegitLoad | None = None
        self.windows: list[Window] = []
        self.figures: dict[str, Any] = {}  # the attack's own

    def key_file(self, client: str) -> Path:
        return self.config.security.keys_dir / f"client-{client}.key_secret"

    def curve(self, client: str) -> ClientCurve | None:
        return client_curve(self.config, self.key_file(client))

    def start(self) -> None:
        self.mesh.start(timeout_s=START_TIMEOUT_S)

    def start_load(self) -> None:
        self.sampler = Sampler(self.mesh).start()
        self.legit = LegitLoad(self.path, self.key_file("legit"), self.args.rate).start()
        if not self.legit.wait_first_commit(60.0):
            raise RuntimeError("the legit producer committed nothing within 60 s")

    @property
    def sends(self) -> list[Send]:
        return self.legit.sends if self.legit is not None else []

    @property
    def samples(self) -> Samples:
        return self.sampler.samples if self.sampler is not None else Samples()

    def raw(self, client: str, relay_id: int = TARGET, **options: int) -> RawClient:
        made = RawClient(
            self.ctx, self.config.relays[relay_id].client_endpoint, self.curve(client), **options
        )
        self.raws.append(made)
        return made

    def http(self, relay_id: int, path: str, timeout_s: float = HTTP_TIMEOUT_S) -> HttpAnswer:
        spec = self.config.relays[relay_id]
        assert spec.http_port is not None
        return http_get(spec.host, spec.http_port, path, timeout_s)

    def metrics(self, relay_id: int) -> dict[str, float] | None:
        answer = self.http(relay_id, "/metrics", 10.0)
        if answer.code != 200:
            return None
        return parse_metrics(answer.body.decode("utf-8", "replace"))

    def readyz_codes(self) -> dict[int, str]:
        return {r: str(self.http(r, "/readyz").code) for r in RELAYS}

    def core_counter(self, relay_id: int, name: str) -> int | None:
        status = self.mesh.status(relay_id, timeout_s=10.0)
        if status is None:
            return None
        return int((status.get("counters") or {}).get(name, 0))

    @contextlib.contextmanager
    def window(self, name: str) -> Iterator[None]:
        """A sub-window of the attack, reported with its own figures."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.windows.append(Window(name, started, time.monotonic()))

    def log_sizes(self) -> dict[int, int]:
        return {r: _size(self.directory / "logs" / f"relay-{r}.log") for r in RELAYS}

    def log_since(self, relay_id: int, offset: int) -> list[str]:
        path = self.directory / "logs" / f"relay-{relay_id}.log"
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return []

    def cli(self, *argv: str, key: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        """`relay ARGV --config TOPOLOGY [--key-file KEY]`: exit code, traceback, output."""
        command = [*argv, "--config", str(self.path)]
        if key is not None:
            command += ["--key-file", str(self.key_file(key))]
        return run_cli(command, timeout_s)

    def close_raws(self) -> None:
        for raw in self.raws:
            raw.close()
        self.raws.clear()

    def close(self) -> None:
        self.close_raws()
        if self.legit is not None:
            self.legit.stop(5.0)
        if self.sampler is not None:
            self.sampler.stop()
        self.mesh.stop()
        self.ctx.term()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def relay_env() -> dict[str, str]:
    """The environment of a relay CLI: the package measured first on its path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(RELAY_ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_cli(argv: Sequence[str], timeout_s: float) -> dict[str, Any]:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "relay", *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=relay_env(),
        )
    except subprocess.TimeoutExpired:
        return {"exit": f"still running after {timeout_s:g} s"}
    lines = done.stderr.strip().splitlines()
    return {
        "exit": done.returncode,
        "traceback": "Traceback" in done.stderr,
        "stderr_last": lines[-1][:300] if lines else "",
        "stdout_lines": len(done.stdout.splitlines()),
    }


def wait_rss_settled(run: Run, relay_id: int, max_s: float) -> float:
    """Wait until the relay's RSS moved less than 2 MB over 2 s (at most max_s); its RSS MB."""
    pid = run.mesh.pids[relay_id]
    history: list[tuple[float, int]] = []
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        now, rss = time.monotonic(), rss_bytes(pid) or 0
        history.append((now, rss))
        old = [r for t, r in history if t <= now - 2.0]
        if old and abs(rss - old[-1]) < 2 * MB:
            break
        time.sleep(0.25)
    return round((rss_bytes(pid) or 0) / MB, 1)


# --- the attacks --------------------------------------------------------------------------


def attack_float_op(run: Run) -> dict[str, Any]:
    """Item 1: produce batches to _relay.meta whose items' op is the float 2.0."""
    args = run.args
    raw = run.raw("app")
    value = meta_op_value(2.0, "")
    producer_id = b"app/float"
    producer_seq = 0
    sent_bytes = 0
    for _ in range(args.float_batches):
        items = []
        for _ in range(args.float_items):
            items.append((raw.next_id(), METADATA_STREAM, producer_seq, None, value, KIND_META))
            producer_seq += 1
        sent_bytes += raw.send(wire.ProduceBatchReq(raw.next_id(), producer_id, tuple(items)))
    results: Counter[str] = Counter()
    deadline = time.monotonic() + 10.0
    while sum(results.values()) < producer_seq and time.monotonic() < deadline:
        answer = raw.recv(max(0.0, deadline - time.monotonic()))
        if answer is None:
            break
        if isinstance(answer, wire.ProduceBatchResp):
            for _, outcome, _, reason, _ in answer.results:
                results[f"{outcome.value}:{reason.split(' ')[0]}" if reason else outcome.value] += 1
        else:
            results[answer_kind(answer)] += 1
    single = raw.ask(
        wire.ProduceReq(
            raw.next_id(), METADATA_STREAM, producer_id, producer_seq, None, value, KIND_META
        ),
        5.0,
    )
    time.sleep(args.seconds)  # the legit producer meanwhile
    probes = {}
    for relay_id in RELAYS:  # one produce through each relay alone, as another client
        answer = run.raw("admin", relay_id).ask(
            wire.ProduceReq(1, BIG, b"admin/probe-%d" % relay_id, 0, None, b"probe"), 10.0
        )
        probes[relay_id] = answer_kind(answer)
    pending = {}
    for relay_id in RELAYS:
        metrics = run.metrics(relay_id) or {}
        pending[relay_id] = metrics.get("relay_pending_produces")
    return {
        "batches": args.float_batches,
        "items_per_batch": args.float_items,
        "bytes_sent": sent_bytes,
        "batch_results": dict(results),
        "unanswered_items": producer_seq - sum(results.values()),
        "single_produce": answer_kind(single),
        "pending_produces_after": pending,
        "admin_produce_per_relay": probes,
    }


def fill_big(run: Run, answer_bytes: int, count: int) -> int:
    """Write `count` values to BIG so that one entry's ReadResp is about answer_bytes."""
    empty = wire.encode(
        wire.ReadResp(1, ReadStatus.OK, ((1 << 62, None, b"", b"admin/" + bytes(16), 0, 0),))
    )
    size = max(1, answer_bytes - len(empty) - 8)
    with Producer(topology=run.config, key_file=run.key_file("admin")) as producer:
        producer.send_many(BIG, [os.urandom(size) for _ in range(count)])
    return size


def drain(raws: Sequence[RawClient], timeout_s: float) -> tuple[Counter[str], float]:
    """Read every answer the connections left unread (at most timeout_s): their kinds."""
    kinds: Counter[str] = Counter()
    started = time.monotonic()
    deadline = started + timeout_s
    for raw in raws:
        kinds.update(raw.collect(1 << 30, max(0.0, deadline - time.monotonic())))
    return kinds, round(time.monotonic() - started, 1)


def named_counters(run: Run, relay_id: int, *words: str) -> dict[str, float] | None:
    """The relay's /metrics samples whose names hold every one of `words`."""
    metrics = run.metrics(relay_id)
    if metrics is None:
        return None
    return {k: v for k, v in metrics.items() if all(w in k for w in words)}


def slow_refusals(run: Run, relay_id: int) -> float | None:
    """The relay's count of reads refused for answers left unread (any counter named so)."""
    found = named_counters(run, relay_id, "slow", "consumer")
    return None if found is None else sum(found.values())


def unread_part(run: Run, relay_id: int, conns: int, reads: int, entries: int) -> dict[str, Any]:
    """`conns` connections of app to the relay each send `reads` reads of BIG and read no
    answer."""
    before = (rss_bytes(run.mesh.pids[relay_id]) or 0) / MB
    refused = slow_refusals(run, relay_id)
    raws = [run.raw("app", relay_id, RCVHWM=1, RCVBUF=4096) for _ in range(conns)]
    for raw in raws:
        for _ in range(reads):
            raw.send(wire.ReadReq(raw.next_id(), BIG, -1, entries, 0))
    settled = wait_rss_settled(run, relay_id, 60.0)
    now_refused = slow_refusals(run, relay_id)
    kinds, took = drain(raws, run.args.drain_s)
    for raw in raws:
        raw.close()
    return {
        "relay": relay_id,
        "connections": conns,
        "reads_each": reads,
        "entries_per_read": entries,
        "rss_before_mb": round(before, 1),
        "rss_settled_mb": settled,
        "rss_growth_mb": round(settled - before, 1),
        "slow_consumer_refusals_counted": (
            None if refused is None or now_refused is None else now_refused - refused
        ),
        "answers_drained": dict(kinds),
        "drain_s": took,
    }


def attack_unread(run: Run) -> dict[str, Any]:
    """Item 2: (a) connections of one client each leaving big answers unread, on relay
    0; (b) one connection leaving answers just under 64 KiB unread, on relay 1 (relay 0's
    heap, freed by (a), would take them without growing)."""
    args = run.args
    with run.window("a: many connections, r0"):
        a = unread_part(run, 0, args.unread_conns, args.unread_a_reads, args.unread_a_entries)
    with run.window("b: under 64 KiB, r1"):
        b = unread_part(run, 1, 1, args.unread_b_reads, 1)
    return {"value_bytes": run.figures.get("value_bytes"), "a": a, "b": b}


def prepare_unread(run: Run) -> None:
    run.figures["value_bytes"] = fill_big(run, run.args.answer_bytes, run.args.big_values)


def attack_read_flood(run: Run) -> dict[str, Any]:
    """Item 3: one connection sends reads as fast as it can, then goes away."""
    raw = run.raw("app")
    frame = wire.encode(wire.ReadReq(1, STREAM, -1, 1, 0))
    sent = blocked = 0
    ends = time.monotonic() + run.args.seconds
    while time.monotonic() < ends:
        for _ in range(1000):
            try:
                raw.sock.send(frame, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                blocked += 1
                raw.sock.poll(1, zmq.POLLOUT)
                break
    raw.close()
    return {
        "reads_sent": sent,
        "per_second": round(sent / run.args.seconds),
        "send_would_block": blocked,
    }


def open_streams(run: Run, count: int) -> tuple[dict[int, dict[str, int]], dict[int, int | None]]:
    """As app, read `count` new names `orders.s<N>`, a third through each relay: the
    answers' kinds per relay, and how many streams each relay tracks then."""
    opened: dict[int, dict[str, int]] = {}
    raws = {r: run.raw("app", r) for r in RELAYS}
    each = -(-count // len(RELAYS))  # names of its own for each relay
    for relay_id, raw in raws.items():
        for n in range(relay_id * each, (relay_id + 1) * each):
            raw.send(wire.ReadReq(raw.next_id(), f"orders.s{n}", -1, 1, 0))
    for relay_id, raw in raws.items():
        opened[relay_id] = dict(raw.collect(each, 120.0))
        raw.close()
    return opened, streams_tracked(run, 20.0)


def streams_tracked(run: Run, max_s: float) -> dict[int, int | None]:
    """How many streams each relay tracks, once every relay tracks as many (or max_s)."""
    deadline = time.monotonic() + max_s
    while True:
        tracked = {}
        for relay_id in RELAYS:
            status = run.mesh.status(relay_id, 10.0)
            tracked[relay_id] = None if status is None else len(status.get("streams") or {})
        if len(set(tracked.values())) == 1 or time.monotonic() > deadline:
            return tracked
        time.sleep(0.5)


def attack_streams(run: Run) -> dict[str, Any]:
    """Item 4: open streams by reading new names on every relay; then StreamsReq '*'."""
    args = run.args
    with run.window("opening streams"):
        opened, tracked = open_streams(run, args.streams)
    with run.window("idle with the streams"):
        time.sleep(args.seconds)
    fenced = {r: run.core_counter(r, "fenced") for r in RELAYS}
    with run.window("StreamsReq flood"):
        raw = run.raw("app")
        started = time.monotonic()
        for _ in range(args.streams_reqs):
            raw.send(wire.StreamsReq(raw.next_id(), "*"))
        listed = raw.collect(args.streams_reqs, 180.0)
        answered_s = time.monotonic() - started
        raw.close()
        time.sleep(3.0)  # a fence that follows the stall
    after = {r: run.core_counter(r, "fenced") for r in RELAYS}
    grew: dict[int, int | None] = {}
    for relay_id in RELAYS:
        old, new = fenced[relay_id], after[relay_id]
        grew[relay_id] = None if old is None or new is None else new - old
    return {
        "read_answers_per_relay": opened,
        "streams_tracked_per_relay": tracked,
        "streams_answers": dict(listed),
        "streams_answered_in_s": round(answered_s, 1),
        "fences_during_streams_flood": grew,
    }


def attack_readyz(run: Run) -> dict[str, Any]:
    """Item 5: a read of a never-written name, then one of a literal pattern name."""
    raw = run.raw("app")
    found: dict[str, Any] = {}
    for what, name in (("never-written", "orders.never"), ("pattern-name", "orders.*")):
        answer = raw.ask(wire.ReadReq(raw.next_id(), name, -1, 1, 0))
        time.sleep(1.0)
        right_after = run.readyz_codes()
        with run.window(f"after {what} read"):
            time.sleep(run.args.readyz_wait_s)
        later = run.readyz_codes()
        found[what] = {
            "stream": name,
            "answer": answer_kind(answer),
            "refused": isinstance(answer, wire.ErrorResp | str) or answer is None,
            "readyz_right_after": right_after,
            f"readyz_after_{run.args.readyz_wait_s:g}s": later,
        }
    body = run.http(TARGET, "/readyz").body.decode("utf-8", "replace")
    found["readyz_body"] = body[:300]
    return found


class SlowLoris:
    """Connections to an HTTP port that send one byte of a request every `every_s`, from
    the local address `source` (another than the probes', as an attacker's host is not
    the orchestrator's)."""

    REQUEST = b"GET /healthz HTTP/1.1\r\nHost: relay\r\nX-Slow: " + b"x" * 200

    def __init__(self, host: str, port: int, count: int, every_s: float, source: str) -> None:
        self.address = (host, port)
        self.source = (source, 0)
        self.every_s = every_s
        self.socks: list[tuple[socket.socket, int]] = []
        self.closed_by_server = 0
        self.refused = 0
        self._stop = threading.Event()
        for _ in range(count):
            self._open()
        self._thread = threading.Thread(target=self._drip, daemon=True)
        self._thread.start()

    def _open(self) -> None:
        try:
            conn = socket.create_connection(self.address, timeout=5.0, source_address=self.source)
            self.socks.append((conn, 0))
        except OSError:
            self.refused += 1

    def _drip(self) -> None:
        while not self._stop.wait(self.every_s):
            kept = []
            for sock, sent in self.socks:
                try:
                    sock.send(self.REQUEST[sent % len(self.REQUEST) : sent % len(self.REQUEST) + 1])
                    kept.append((sock, sent + 1))
                except OSError:
                    self.closed_by_server += 1
                    sock.close()
            lost = len(self.socks) - len(kept)
            self.socks = kept
            for _ in range(lost):  # an attacker connects again
                self._open()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.every_s + 1)
        for sock, _ in self.socks:
            sock.close()


def metrics_flood(run: Run, threads: int, seconds: float) -> dict[str, Any]:
    codes: Counter[str] = Counter()
    latencies: list[float] = []
    ends = time.monotonic() + seconds

    def scrape() -> None:
        while time.monotonic() < ends:
            answer = run.http(TARGET, "/metrics", 10.0)
            codes[str(answer.code)] += 1
            latencies.append(answer.latency_s)

    workers = [threading.Thread(target=scrape, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(seconds + 15)
    return {
        "threads": threads,
        "requests": sum(codes.values()),
        "codes": dict(codes),
        "p50_ms": _ms(percentile(latencies, 0.5)),
    }


def attack_ops_port(run: Run) -> dict[str, Any]:
    """Item 6: slow-loris connections on the HTTP port, a /metrics flood, /status."""
    args = run.args
    spec = run.config.relays[TARGET]
    assert spec.http_port is not None
    probes: list[tuple[str, float]] = []
    with run.window("slow loris"):
        loris = SlowLoris(spec.host, spec.http_port, args.loris_conns, 5.0, args.loris_from)
        try:
            ends = time.monotonic() + args.loris_s
            while time.monotonic() < ends:
                answer = run.http(TARGET, "/healthz", 10.0)
                probes.append((str(answer.code), answer.latency_s))
                time.sleep(2.0)
        finally:
            loris.close()
    _, tracked = open_streams(run, args.ops_streams)
    with run.window("/metrics flood"):
        flood = metrics_flood(run, args.metrics_threads, args.seconds)
    status = run.http(TARGET, "/status", 10.0)
    return {
        "loris_connections": args.loris_conns,
        "loris_refused_at_connect": loris.refused,
        "loris_closed_by_relay": loris.closed_by_server,
        "healthz_during_loris": dict(Counter(code for code, _ in probes)),
        "healthz_p50_ms_during_loris": _ms(percentile([s for _, s in probes], 0.5)),
        "streams_tracked_during_the_flood": tracked,
        "metrics_flood": flood,
        "unauthenticated_status_code": status.code,
        "unauthenticated_status_is_document": b'"streams"' in status.body,
    }


def try_start_relay(path: Path, relay_id: int, wait_s: float) -> dict[str, Any]:
    """`relay run` on a topology meant to be refused: did it exit, with what?"""
    log = path.parent / f"run-{relay_id}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "run", "--config", str(path), "--relay", str(relay_id)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=relay_env(),
        )
        try:
            code: int | str = proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            code = f"started (still running after {wait_s:g} s)"
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5.0)
    lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    return {
        "refused": isinstance(code, int) and code != 0,
        "exit": code,
        "last_line": (lines or [""])[-1][:300],
    }


def attack_keys(args: argparse.Namespace) -> dict[str, Any]:
    """Item 7: a relay started on (a) one public key under two client names, (b) a keys
    directory group-writable, (c) a client public key file group-writable."""

    def same_key(keys: Path) -> None:
        shutil.copyfile(keys / "client-app.key", keys / "client-admin.key")

    def group_dir(keys: Path) -> None:
        keys.chmod(0o770)

    def group_file(keys: Path) -> None:
        (keys / "client-app.key").chmod(0o664)

    found: dict[str, Any] = {}
    for name, tweak in (
        ("a_one_key_two_names", same_key),
        ("b_keys_dir_group_writable", group_dir),
        ("c_key_file_group_writable", group_file),
    ):
        with tempfile.TemporaryDirectory(prefix=f"attack-keys-{name[0]}-") as tmp:
            path = write_loopback_topology(
                Path(tmp), {r: ["orders.*"] for r in RELAYS[:2]}, [STREAM], access=ACCESS
            )
            config = load(path)
            KeyRing(config).ensure()
            tweak(config.security.keys_dir)
            found[name] = try_start_relay(path, 0, args.keys_wait_s)
    return found


def attack_barrier(run: Run) -> dict[str, Any]:
    """Item 8: app sends read barriers naming legit's mark key and reads their outcomes."""
    args = run.args
    key = mark_key(DURABLE, STREAM)
    stop = threading.Event()
    marks: list[int] = []

    def durable() -> None:  # legit's durable consumer, committing every 0.5 s
        with Consumer(
            topology=run.config,
            key_file=run.key_file("legit"),
            durable=DURABLE,
            store=False,
            timeout_s=0.2,
        ) as consumer:
            consumer.subscribe(STREAM, "earliest")
            committed = time.monotonic()
            while not stop.is_set():
                with contextlib.suppress(StopIteration):
                    next(consumer)
                if time.monotonic() - committed > 0.5:
                    consumer.commit()
                    committed = time.monotonic()

    thread = threading.Thread(target=durable, daemon=True)
    thread.start()
    outcomes: Counter[str] = Counter()
    versions: list[int] = []
    try:
        with Metadata(topology=run.config, key_file=run.key_file("admin")) as admin:
            deadline = time.monotonic() + 30.0
            while admin.read(key) is None and time.monotonic() < deadline:
                time.sleep(0.2)
            raw = run.raw("app")
            ends = time.monotonic() + args.seconds
            producer_seq = 0
            while time.monotonic() < ends:
                outcome, version = barrier(raw, key, producer_seq)
                producer_seq += 1
                outcomes[outcome] += 1
                held = admin.read(key)
                if held is not None:
                    marks.append(held.version)
                if version is not None:
                    versions.append(version)
                time.sleep(max(0.0, args.seconds / args.barriers - 0.05))
            missing, missing_version = barrier(
                raw, "consumers/legit-nobody/orders.legit", producer_seq
            )
    finally:
        stop.set()
        thread.join(10.0)
    return {
        "key": key,
        "barriers": sum(outcomes.values()),
        "outcomes": dict(outcomes),
        "outcomes_with_a_version": sum(1 for v in versions if v > 0),
        "distinct_versions_seen": len(set(versions)),
        "versions_that_were_the_marks": len(set(versions) & set(marks)),
        "mark_versions_admin_saw": len(set(marks)),
        "barrier_on_missing_key": f"{missing} version={missing_version}",
    }


def barrier(raw: RawClient, key: str, producer_seq: int) -> tuple[str, int | None]:
    """One read barrier naming `key` and its outcome: (kind, version if it says one)."""
    value = meta_op_value(OP_READ, key)
    produced = raw.ask(
        wire.ProduceReq(
            raw.next_id(), METADATA_STREAM, b"app/barrier", producer_seq, None, value, KIND_META
        )
    )
    if not isinstance(produced, wire.ProduceResp) or produced.seq < 0:
        return answer_kind(produced), None
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while time.monotonic() < deadline:
        answer = raw.ask(wire.MetaReq(raw.next_id(), "outcome", "", produced.seq))
        if isinstance(answer, wire.MetaResp) and answer.status == "pending":
            time.sleep(0.05)
            continue
        if isinstance(answer, wire.MetaResp):
            return answer_kind(answer), answer.version
        return answer_kind(answer), None
    return "outcome pending for good", None


def handshake_failed(sock: Any, monitor: Any, timeout_s: float) -> str:
    failed = (
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not monitor.poll(int(left * 1000)):
            break
        event = recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return "succeeded"
        if event & failed:
            return "failed"
    return "no event"


def wrong_handshakes(run: Run, count: int) -> Counter[str]:
    """`count` handshakes with the client port: half with a key pair the relay does not
    know, half with app's key but another server key than the relay's."""
    keys = run.directory / "stranger-keys"
    stranger = load_identity(generate(keys, "client-stranger"))
    wrong_server = load_identity(generate(keys, "relay-9")).public_key
    app = load_identity(run.key_file("app"))
    server = KeyRing(run.config).relay_public_key(TARGET)
    endpoint = run.config.relays[TARGET].client_endpoint
    seen: Counter[str] = Counter()
    for n in range(count):
        identity, server_key, what = (
            (stranger, server, "unknown client key")
            if n % 2 == 0
            else (app, wrong_server, "wrong server key")
        )
        sock = run.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 60_000)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        try:
            curve_client(sock, identity, server_key)
            sock.connect(endpoint)
            sock.send(wire.encode(wire.StatusReq(1)))
            seen[f"{what}: {handshake_failed(sock, monitor, 5.0)}"] += 1
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
    return seen


def attack_small(run: Run) -> dict[str, Any]:
    """Item 9: a bad mark and `relay consumers list`; `relay consume --timeout-s` as app
    on an empty stream; handshakes that fail and the relay's count and log of them."""
    with Metadata(topology=run.config, key_file=run.key_file("app")) as meta:
        meta.write(mark_key("app-bad", STREAM), b"not a mark", ANY_VERSION)
    listed = run.cli("consumers", "list", key="admin")
    consumed = run.cli("consume", "--stream", EMPTY, "--timeout-s", "3", key="app")
    before = named_counters(run, TARGET, "handshake")
    offset = run.log_sizes()[TARGET]
    with run.window("wrong handshakes"):
        shakes = wrong_handshakes(run, run.args.handshakes)
    time.sleep(1.0)
    after = named_counters(run, TARGET, "handshake")
    lines = run.log_since(TARGET, offset)
    naming = [line for line in lines if "127.0.0.1" in line]
    handshake = [line for line in lines if "handshake" in line.lower()]
    return {
        "consumers_list_with_a_bad_mark": listed,
        "consume_as_app_on_an_empty_stream": consumed,
        "handshakes": dict(shakes),
        "handshake_counters": {"before": before, "after": after},
        "log_lines_naming_127.0.0.1": len(naming),
        "log_lines_saying_handshake": len(handshake),
        "log_example": (naming or handshake or [""])[0][:200],
    }


@dataclass(frozen=True)
class Attack:
    name: str
    item: int  # in issue 48
    run: Callable[[Run], dict[str, Any]]
    prepare: Callable[[Run], None] | None = None


ATTACKS = {
    a.name: a
    for a in (
        Attack("float-op", 1, attack_float_op),
        Attack("unread", 2, attack_unread, prepare_unread),
        Attack("read-flood", 3, attack_read_flood),
        Attack("streams", 4, attack_streams),
        Attack("readyz", 5, attack_readyz),
        Attack("ops-port", 6, attack_ops_port),
        Attack("barrier", 8, attack_barrier),
        Attack("small", 9, attack_small),
    )
}
ORDER = (
    "float-op",
    "unread",
    "read-flood",
    "streams",
    "readyz",
    "ops-port",
    "keys",
    "barrier",
    "small",
)


# --- recovery and histories ----------------------------------------------------------------


def recovered(run: Run, quiet: dict[str, Any], t0: float, t1: float, cpu_only: bool) -> bool:
    """Whether [t0, t1] looks like the quiet phase: each relay's CPU within the margin
    and (unless cpu_only) the legit p50 within 1.5x (or 1 ms) with no failed send."""
    margin = run.args.cpu_margin
    cpu = cpu_figures(run.samples, t0, t1)
    for relay_id in RELAYS:
        base = quiet["cpu_pct"].get(relay_id) or 0.0
        now = cpu.get(relay_id)
        if now is None or now > base + max(margin, 0.5 * base):
            return False
    if cpu_only:
        return True
    legit = legit_figures(run.sends, t0, t1)
    base_p50 = quiet["legit"]["p50_ms"] or 0.0
    return (
        legit["sends"] >= 3
        and not legit["failed"]
        and legit["p50_ms"] is not None
        and legit["p50_ms"] <= max(1.5 * base_p50, base_p50 + 1.0)
    )


def wait_recovery(
    run: Run, quiet: dict[str, Any], ended: float
) -> tuple[float | None, float | None]:
    """Seconds from `ended` to the first RECOVERY_SPAN_S window that is back: of CPU alone,
    and of CPU and legit latency (None: not within --recover-s)."""
    cpu_back: float | None = None
    deadline = ended + run.args.recover_s
    while time.monotonic() < deadline:
        time.sleep(RECOVERY_STEP_S)
        t1 = time.monotonic()
        t0 = t1 - RECOVERY_SPAN_S
        if t0 < ended:
            continue
        if cpu_back is None and recovered(run, quiet, t0, t1, cpu_only=True):
            cpu_back = round(t0 - ended, 1)
        if cpu_back is not None and recovered(run, quiet, t0, t1, cpu_only=False):
            return cpu_back, round(t0 - ended, 1)
    return cpu_back, None


def read_history(run: Run, relay_id: int) -> tuple[list[tuple[int, int]], str]:
    """Every (seq, value index) relay_id alone gives of STREAM from the earliest."""
    last_wanted = max((s[2] for s in run.sends), default=-1)
    endpoint = run.config.relays[relay_id].client_endpoint
    read: list[tuple[int, int]] = []
    deadline = time.monotonic() + HISTORY_TIMEOUT_S
    try:
        with Consumer(
            {relay_id: endpoint}, curve=run.curve("legit"), store=False, timeout_s=10.0
        ) as consumer:
            for record in consumer.subscribe(STREAM, "earliest"):
                read.append((record.seq, legit_index(record.value)))
                if record.seq >= last_wanted or time.monotonic() > deadline:
                    break
    except ClientError as e:
        return read, f"{type(e).__name__}: {e}"[:200]
    return read, ""


def check_history(sends: Sequence[Send], read: list[tuple[int, int]]) -> dict[str, Any]:
    committed = {s[3]: s[2] for s in sends if s[2] >= 0}  # value index -> seq
    counts = Counter(index for _, index in read if index >= 0)
    seqs = [seq for seq, _ in read]
    return {
        "read": len(read),
        "committed": len(committed),
        "lost": sum(1 for index in committed if counts[index] == 0),
        "duplicated": sum(1 for n in counts.values() if n > 1),
        "wrong_seq": sum(
            1 for seq, index in read if index in committed and committed[index] != seq
        ),
        "in_order": all(a < b for a, b in itertools.pairwise(seqs)),
        "not_legit_values": sum(1 for _, index in read if index < 0),
    }


def histories(run: Run) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for relay_id in RELAYS:
        read, error = read_history(run, relay_id)
        found[f"relay {relay_id}"] = {**check_history(run.sends, read), "error": error}
    legit = run.legit
    if legit is not None:
        found["live consumer"] = {
            **check_history(run.sends, legit.consumed),
            "error": "; ".join(f"{k} x{v}" for k, v in legit.consumer_errors.items()),
        }
    return found


def history_ok(found: dict[str, Any]) -> bool:
    return all(
        h["lost"] == 0 and h["duplicated"] == 0 and h["wrong_seq"] == 0 and h["in_order"]
        for h in found.values()
    )


# --- running one attack ----------------------------------------------------------------------


def counters_of(run: Run) -> dict[int, dict[str, float] | None]:
    found: dict[int, dict[str, float] | None] = {}
    for relay_id in RELAYS:
        metrics = run.metrics(relay_id)
        found[relay_id] = None if metrics is None else watched(metrics)
    return found


def counter_changes(
    before: dict[int, dict[str, float] | None], after: dict[int, dict[str, float] | None]
) -> dict[int, dict[str, str]]:
    """Per relay, each watched counter that is not 0 at the end: 'value (+growth)'."""
    found: dict[int, dict[str, str]] = {}
    for relay_id in RELAYS:
        now = after.get(relay_id)
        if now is None:
            found[relay_id] = {"(no /metrics)": ""}
            continue
        old = before.get(relay_id) or {}
        found[relay_id] = {
            name: f"{value:g} (+{value - old.get(name, 0.0):g})"
            for name, value in sorted(now.items())
            if value
        }
    return found


def run_mesh_attack(attack: Attack, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"attack-{attack.name}-") as tmp:
        run = Run(Path(tmp), args)
        try:
            progress(f"{attack.name}: starting the mesh")
            run.start()
            if attack.prepare is not None:
                attack.prepare(run)
            run.start_load()
            before = counters_of(run)
            progress(f"{attack.name}: quiet for {args.quiet_s:g} s")
            quiet_start = time.monotonic()
            time.sleep(args.quiet_s)
            quiet = Window("quiet", quiet_start, time.monotonic())
            progress(f"{attack.name}: attack")
            logs_before = run.log_sizes()
            figures = attack.run(run)
            attacked = Window("attack", quiet.t1, time.monotonic())
            logs_after = run.log_sizes()
            run.close_raws()
            quiet_figures = window_figures(run.sends, run.samples, quiet)
            progress(f"{attack.name}: waiting for recovery (at most {args.recover_s:g} s)")
            cpu_back, back = wait_recovery(run, quiet_figures, attacked.t1)
            after_start = time.monotonic()
            time.sleep(args.after_s)
            after = Window("after", after_start, time.monotonic())
            progress(f"{attack.name}: checking histories")
            if run.legit is not None:
                run.legit.stop()
            checked = histories(run)
            counters = counter_changes(before, counters_of(run))
            alive = {r: run.mesh.alive(r) for r in RELAYS}
            attack_figures = window_figures(run.sends, run.samples, attacked)
            return {
                "attack": attack.name,
                "issue_item": attack.item,
                "quiet": quiet_figures,
                "attack_window": attack_figures,
                "sub_windows": {
                    w.name: window_figures(run.sends, run.samples, w) for w in run.windows
                },
                "after": window_figures(run.sends, run.samples, after),
                "ratio_p50": ratio(
                    attack_figures["legit"]["p50_ms"], quiet_figures["legit"]["p50_ms"]
                ),
                "rss_growth_mb": growth(
                    quiet_figures["rss_peak_mb"], attack_figures["rss_peak_mb"]
                ),
                "cpu_back_s": cpu_back,
                "recovered_s": back,
                "recover_limit_s": args.recover_s,
                "log_lines_during_attack": {
                    r: _lines(run, r, logs_before[r], logs_after[r]) for r in RELAYS
                },
                "counters": counters,
                "history": checked,
                "history_ok": history_ok(checked),
                "relays_alive": alive,
                "figures": figures,
            }
        finally:
            run.close()


def _lines(run: Run, relay_id: int, start: int, end: int) -> int:
    path = run.directory / "logs" / f"relay-{relay_id}.log"
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start)).count(b"\n")
    except OSError:
        return 0


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def growth(
    before: dict[int, float | None], after: dict[int, float | None]
) -> dict[int, float | None]:
    found: dict[int, float | None] = {}
    for relay_id in RELAYS:
        old, new = before.get(relay_id), after.get(relay_id)
        found[relay_id] = None if old is None or new is None else round(new - old, 1)
    return found


def run_attack(name: str, args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    try:
        if name == "keys":
            result = {"attack": "keys", "issue_item": 7, "figures": attack_keys(args)}
        else:
            result = run_mesh_attack(ATTACKS[name], args)
    except Exception as e:
        progress(f"{name}: failed: {type(e).__name__}: {e}")
        result = {
            "attack": name,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc().splitlines()[-12:],
        }
    result["took_s"] = round(time.monotonic() - started, 1)
    return result


# --- output -------------------------------------------------------------------------------


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _per_relay(values: dict[Any, Any]) -> str:
    return "/".join("-" if values.get(r) is None else f"{values[r]:g}" for r in RELAYS)


def _codes(health: dict[str, dict[str, int]], path: str) -> str:
    codes = health.get(path) or {}
    return " ".join(f"{code}x{n}" for code, n in sorted(codes.items())) or "-"


def _recovery(result: dict[str, Any]) -> str:
    if result.get("recovered_s") is not None:
        return f"{result['recovered_s']:g} s"
    return f"not within {result.get('recover_limit_s', 0):g} s"


def format_result(result: dict[str, Any]) -> str:
    name = result["attack"]
    lines = [
        f"== {name} (issue 48 item {result.get('issue_item', '?')}; took {result.get('took_s')} s)"
    ]
    if "error" in result:
        lines.append(f"  ERROR {result['error']}")
        lines += ["    " + t for t in result.get("traceback", [])]
        return "\n".join(lines)
    if "quiet" in result:
        windows = [("quiet", result["quiet"]), ("attack", result["attack_window"])]
        windows += [*result["sub_windows"].items(), ("after", result["after"])]
        lines.append("  " + _row(WINDOW_COLUMNS))
        for label, w in windows:
            legit = w["legit"]
            failed = ",".join(f"{k}x{v}" for k, v in legit["failed"].items()) or "0"
            cells = [label, f"{w['seconds']:g}", str(legit["sends"]), failed]
            cells += [_num(legit[k]) for k in ("p50_ms", "p99_ms", "max_ms")]
            cells += [_per_relay(w["cpu_pct"]), _per_relay(w["rss_peak_mb"])]
            cells.append(f"{_codes(w['health'], '/healthz')} ; {_codes(w['health'], '/readyz')}")
            lines.append("  " + _filled(cells, WINDOW_COLUMNS))
        lines.append(
            f"  p50 attack/quiet: {_num(result['ratio_p50'])}x; RSS growth MB: "
            f"{_per_relay(result['rss_growth_mb'])}; CPU back after: "
            f"{_num(result['cpu_back_s'])} s; recovered (CPU and p50) after: {_recovery(result)}"
        )
        lines.append(
            f"  relay log lines during the attack: {_per_relay(result['log_lines_during_attack'])}"
        )
        for relay_id, counters in result["counters"].items():
            shown = ", ".join(f"{k} {v}" for k, v in counters.items()) or "none"
            lines.append(f"  counters r{relay_id}: {shown}")
        for where, h in result["history"].items():
            lines.append(
                f"  history {where}: read {h['read']} of {h['committed']} committed, "
                f"lost {h['lost']}, dup {h['duplicated']}, wrong seq {h['wrong_seq']}, "
                f"in order {h['in_order']}" + (f", error: {h['error']}" if h["error"] else "")
            )
        alive = result["relays_alive"]
        lines.append(
            f"  histories ok: {result['history_ok']}; relays alive: "
            + ("all" if all(alive.values()) else ", ".join(f"r{r} {a}" for r, a in alive.items()))
        )
    lines.append("  figures: " + json.dumps(result["figures"], default=str, indent=None)[:4000])
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def format_summary(results: Sequence[dict[str, Any]]) -> str:
    lines = [_row(SUMMARY_COLUMNS)]
    for r in results:
        if "quiet" not in r:
            state = r.get("error") or "no mesh (see its figures above)"
            lines.append(f"{r['attack']:<11} {state[:150]}")
            continue
        quiet, attacked, after = r["quiet"], r["attack_window"], r["after"]
        failed = sum(sum(w["legit"]["failed"].values()) for w in (attacked, after))
        cells = [r["attack"], _num(quiet["legit"]["p50_ms"]), _num(attacked["legit"]["p50_ms"])]
        cells += [_num(r["ratio_p50"]), f"{_rate(quiet):g}/{_rate(attacked):g}/{_rate(after):g}"]
        cells += [_per_relay(attacked["rss_peak_mb"])]
        cells += [_per_relay(r["rss_growth_mb"])]
        cells += [_per_relay(w["cpu_pct"]) for w in (quiet, attacked, after)]
        cells += [_recovery(r), str(failed), "ok" if r["history_ok"] else "FAILED"]
        cells.append("all" if all(r["relays_alive"].values()) else "NO")
        lines.append(_filled(cells, SUMMARY_COLUMNS))
    return "\n".join(lines)


WINDOW_COLUMNS = [
    ("window", 24),
    ("s", 5),
    ("sends", 6),
    ("failed sends", 22),
    ("p50 ms", 8),
    ("p99 ms", 8),
    ("max ms", 8),
    ("CPU % r0/1/2", 16),
    ("RSS MB r0/1/2", 18),
    ("/healthz ; /readyz codes", 0),
]
SUMMARY_COLUMNS = [
    ("attack", 11),
    ("p50 quiet", 9),
    ("p50 att.", 9),
    ("ratio", 6),
    ("sends/s q/a/af", 15),
    ("RSS peak MB r0/1/2", 19),
    ("RSS growth", 16),
    ("CPU% quiet", 14),
    ("CPU% attack", 15),
    ("CPU% after", 14),
    ("recovered", 15),
    ("failed", 7),
    ("history", 8),
    ("alive", 0),
]


def _rate(window: dict[str, Any]) -> float:
    """Legit sends per second in a window (one at a time: a stall shows as fewer)."""
    return round(window["legit"]["sends"] / window["seconds"]) if window["seconds"] else 0


def _row(cells: Sequence[tuple[str, int]]) -> str:
    return " ".join(text[: width or None].ljust(width) for text, width in cells).rstrip()


def _filled(texts: Sequence[str], columns: Sequence[tuple[str, int]]) -> str:
    return _row([(text, width) for text, (_, width) in zip(texts, columns, strict=True)])


# --- the command ---------------------------------------------------------------------------


# Per attack: (flag, type, default: the figure where it gives one, help)
ATTACK_OPTIONS: dict[str, list[tuple[str, type, float | str, str | None]]] = {
    "float-op": [
        ("--float-batches", int, 25, None),
        ("--float-items", int, 4000, "items per batch (25 x 4,000: max_pending_produces)"),
    ],
    "unread": [
        ("--answer-bytes", int, 62_300, "the size of a one-entry answer of orders.big"),
        ("--big-values", int, 64, "values written to orders.big first"),
        ("--unread-conns", int, 8, "(a) connections"),
        ("--unread-a-reads", int, 400, "(a) reads per connection"),
        ("--unread-a-entries", int, 4, "(a) entries per read (answers over 64 KiB)"),
        ("--unread-b-reads", int, 10_000, "(b) reads of one entry on one connection"),
        ("--drain-s", float, 5.0, "how long to read the answers left unread"),
    ],
    "streams": [
        ("--streams", int, 3006, "new names read, a third on each relay"),
        ("--streams-reqs", int, 5000, "StreamsReq '*' from one connection"),
    ],
    "readyz": [("--readyz-wait-s", float, 30.0, "the second /readyz look, after the read")],
    "ops-port": [
        ("--loris-conns", int, 32, "connections sending a byte every 5 s"),
        ("--loris-s", float, 20.0, "how long they stay"),
        ("--loris-from", str, "127.0.0.2", "the local address they come from"),
        ("--metrics-threads", int, 8, "threads of the /metrics flood (--seconds long)"),
        ("--ops-streams", int, 3006, "streams opened before the /metrics flood"),
    ],
    "keys, barrier, small": [
        ("--keys-wait-s", float, 10.0, "how long a relay that is to refuse may run"),
        ("--barriers", int, 20, "read barriers, spread over --seconds"),
        ("--handshakes", int, 61, "failed handshakes"),
    ],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--attack", required=True, choices=[*ORDER, "all"])
    parser.add_argument(
        "--seconds",
        type=float,
        default=20.0,
        help="length of an attack's flood or hold (read-flood, /metrics flood, idle with "
        "streams, barriers, float-op hold)",
    )
    parser.add_argument("--quiet-s", type=float, default=10.0)
    parser.add_argument(
        "--recover-s", type=float, default=60.0, help="how long to wait for recovery"
    )
    parser.add_argument("--after-s", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=200.0, help="legit sends per second")
    parser.add_argument(
        "--cpu-margin", type=float, default=10.0, help="CPU points above quiet that count as back"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, not the tables")
    for title, options in ATTACK_OPTIONS.items():
        group = parser.add_argument_group(title)
        for flag, kind, default, words in options:
            group.add_argument(flag, type=kind, default=default, help=words)
    return parser.parse_args(argv)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Ctrl-C and SIGTERM (also where a shell started this with SIGINT ignored) unwind
    # through every `finally`: relays, the legit process and sockets are stopped.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    names = list(ORDER) if args.attack == "all" else [args.attack]
    progress(f"measuring the relay package at {RELAY_ROOT / 'relay'}")
    results: list[dict[str, Any]] = []
    name = names[0]
    try:
        for name in names:
            result = run_attack(name, args)
            results.append(result)
            if not args.json:
                print(format_result(result), flush=True)
    except KeyboardInterrupt as e:
        progress(f"interrupted ({e or 'Ctrl-C'}); everything this run started is stopped")
        results.append({"attack": name, "error": "interrupted"})
    if args.json:
        print(
            json.dumps(
                {"relay_package": str(RELAY_ROOT), "attacks": {r["attack"]: r for r in results}},
                indent=2,
                default=str,
            )
        )
    else:
        print(f"\n== summary (relay package {RELAY_ROOT / 'relay'})")
        print(format_summary(results))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
