"""NATS JetStream beside the mesh, for `relay bench --peers nats` (issue 12).

Three `nats-server` processes on 127.0.0.1 form a cluster with JetStream on, and hold one
stream replicated on all three in memory (R3, the closest to a 3-relay mesh: a publish is
acknowledged once a quorum of the replicas stored it). The same shapes as the relay's runs
go through nats-py, the Python client, so both sides pay for a Python producer: a number of
publishes kept in flight (the window), or one at a time for latency.

`bash scripts/peer-deps.sh` installs nats-server (Debian) and nats-py (PyPI).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relay import loop
from relay.launcher import free_ports

SERVERS = 3
SUBJECT = "bench"
STREAM_NAME = "BENCH"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
READY_POLL_S = 0.2
MAX_MEMORY_STORE = "2GB"  # per server: the stream lives in memory
STREAM_MAX_BYTES = 1 << 30  # the stream drops its oldest messages beyond this
ACK_TIMEOUT_S = 10.0  # a publish not acknowledged this long counts as failed


class NatsUnavailable(RuntimeError):
    """nats-server or nats-py is missing, or the cluster did not form."""


class NatsCluster:
    """Three nats-server processes with JetStream and the R3 memory stream `BENCH`."""

    def __init__(self, binary: str = "nats-server") -> None:
        """NatsUnavailable at once if nats-server or nats-py is missing."""
        found = shutil.which(binary)
        if found is None:
            raise NatsUnavailable(f"{binary} not found (bash scripts/peer-deps.sh installs it)")
        _nats()
        self.binary = found
        self.directory = Path()
        self.procs: list[subprocess.Popen[bytes]] = []
        ports = free_ports(2 * SERVERS)
        self.client_ports, self.cluster_ports = ports[:SERVERS], ports[SERVERS:]

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{p}" for p in self.client_ports]

    @property
    def pids(self) -> dict[int, int]:
        return {i: p.pid for i, p in enumerate(self.procs)}

    def _config(self, i: int) -> str:
        routes = ", ".join(
            f"nats-route://127.0.0.1:{p}" for k, p in enumerate(self.cluster_ports) if k != i
        )
        store = self.directory / f"n{i}"
        return (
            f"server_name: n{i}\n"
            f"listen: 127.0.0.1:{self.client_ports[i]}\n"
            f"jetstream {{ store_dir: '{store}', max_memory_store: {MAX_MEMORY_STORE} }}\n"
            f"cluster {{ name: bench, listen: 127.0.0.1:{self.cluster_ports[i]},"
            f" routes: [{routes}] }}\n"
        )

    def start(self, directory: Path) -> None:
        """Start the servers (configs, stores and logs in `directory`) and make the stream."""
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        for i in range(SERVERS):
            path = self.directory / f"n{i}.conf"
            path.write_text(self._config(i), encoding="utf-8")
            log = open(self.directory / f"n{i}.log", "ab")  # noqa: SIM115 (the process keeps it)
            self.procs.append(
                subprocess.Popen([self.binary, "-c", str(path)], stdout=log, stderr=log)
            )
        loop.run(self._create_stream())

    async def _create_stream(self) -> None:
        """Create the stream once the cluster has a JetStream leader (retrying until then)."""
        nats, js_api = _nats()
        deadline = time.monotonic() + READY_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise NatsUnavailable(f"nats-server exited ({proc.returncode}); see its log")
            try:
                nc = await _connect(nats, self.urls, connect_timeout=2)
                try:
                    js = nc.jetstream(timeout=5)
                    config = js_api.StreamConfig(
                        name=STREAM_NAME,
                        subjects=[SUBJECT],
                        num_replicas=SERVERS,
                        storage=js_api.StorageType.MEMORY,
                        max_bytes=STREAM_MAX_BYTES,
                    )
                    await js.add_stream(config)
                    await js.publish(SUBJECT, b"ready", timeout=5)
                    return
                finally:
                    await nc.close()
            except Exception as e:  # not formed yet: no leader, not connected
                last = e
                await asyncio.sleep(READY_POLL_S)
        raise NatsUnavailable(f"the NATS cluster did not form in {READY_TIMEOUT_S:g} s: {last}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def _nats() -> tuple[Any, Any]:
    try:
        import nats
        from nats.js import api
    except ImportError as e:
        raise NatsUnavailable("nats-py is not installed (bash scripts/peer-deps.sh)") from e
    return nats, api


def throughput(urls: Sequence[str], value: bytes, window: int, duration_s: float) -> dict[str, Any]:
    """Publish `value` for `duration_s` with `window` publishes awaiting their ack."""
    return loop.run(_throughput(list(urls), value, window, duration_s))


async def _throughput(
    urls: list[str], value: bytes, window: int, duration_s: float
) -> dict[str, Any]:
    """Publishes with one reply subject, their acks counted as they come, at most `window`
    unacknowledged: the fastest way nats-py has found here (19k acks/s at window 16, 34k at
    256, 100 B). Its own helpers are slower: publish_async with publish_async_max_pending
    acked 3-4k/s, `window` coroutines each awaiting js.publish 5-14k/s."""
    nats, _ = _nats()
    nc = await _connect(nats, urls)
    counts = {"acked": 0, "failed": 0}
    room = asyncio.Semaphore(window)

    async def on_ack(msg: Any) -> None:
        counts["failed" if b'"error"' in msg.data else "acked"] += 1
        room.release()

    try:
        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=on_ack)
        started = time.perf_counter()
        deadline = started + duration_s
        while time.perf_counter() < deadline:
            await room.acquire()
            await nc.publish(SUBJECT, value, reply=inbox)
        for _ in range(window):  # the last acks
            await asyncio.wait_for(room.acquire(), ACK_TIMEOUT_S)
        elapsed = time.perf_counter() - started
    finally:
        await nc.close()
    return {**counts, "elapsed_s": elapsed}


async def _connect(nats: Any, urls: list[str], **options: Any) -> Any:
    """A connection that neither reconnects nor prints errors (a server still starting,
    or the cluster stopping): a failed connect raises, the caller says what it means."""

    async def quiet(error: Exception) -> None:
        pass

    return await nats.connect(servers=urls, allow_reconnect=False, error_cb=quiet, **options)


def at_rate(urls: Sequence[str], value: bytes, rate_tx_s: int, duration_s: float) -> dict[str, Any]:
    """Open loop: the i-th publish at start + i / rate, through the first server, whatever
    came back; a JetStream consumer (ordered, new messages only) on the second server.
    Per publish (its index in the value's first 8 bytes): the time to its ack and to its
    delivery, in seconds."""
    return loop.run(_at_rate(list(urls), value, rate_tx_s, duration_s))


async def _at_rate(
    urls: list[str], value: bytes, rate_tx_s: int, duration_s: float
) -> dict[str, Any]:
    nats, api = _nats()
    producer = await _connect(nats, urls[:1])
    consumer = await _connect(nats, urls[1:2])
    count = max(1, int(rate_tx_s * duration_s))
    sent: dict[int, float] = {}
    acked: dict[int, float] = {}
    delivered: dict[int, float] = {}
    failed = 0
    all_acked = asyncio.Event()

    async def on_ack(msg: Any) -> None:
        nonlocal failed
        index = int(msg.subject.rpartition(".")[2])  # each publish has its own reply subject
        if b'"error"' in msg.data:
            failed += 1
        else:
            acked.setdefault(index, time.perf_counter())
        if len(acked) + failed >= count:
            all_acked.set()

    async def on_message(msg: Any) -> None:
        index = int.from_bytes(msg.data[:8], "big")
        delivered.setdefault(index, time.perf_counter())

    try:
        js = consumer.jetstream(timeout=ACK_TIMEOUT_S)
        config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW)
        await js.subscribe(SUBJECT, cb=on_message, ordered_consumer=True, config=config)
        inbox = producer.new_inbox()
        await producer.subscribe(inbox + ".*", cb=on_ack)
        await producer.flush()
        await consumer.flush()
        body = value[8:]
        started = time.perf_counter()
        for i in range(count):
            delay = started + i / rate_tx_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent[i] = time.perf_counter()
            await producer.publish(SUBJECT, i.to_bytes(8, "big") + body, reply=f"{inbox}.{i}")
        await asyncio.wait_for(all_acked.wait(), ACK_TIMEOUT_S)
        deadline = time.perf_counter() + ACK_TIMEOUT_S
        while len(delivered) < len(acked) and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - started
    finally:
        await producer.close()
        await consumer.close()
    return {
        "ack_s": [acked[i] - sent[i] for i in acked if i in sent],
        "delivery_s": [delivered[i] - sent[i] for i in delivered if i in sent],
        "sent": len(sent),
        "failed": failed,
        "elapsed_s": elapsed,
    }


def one_in_flight(
    urls: Sequence[str], value: bytes, duration_s: float, limit: int
) -> dict[str, Any]:
    """Publish one at a time; every publish's time to its ack, in seconds."""
    return loop.run(_one_in_flight(list(urls), value, duration_s, limit))


async def _one_in_flight(
    urls: list[str], value: bytes, duration_s: float, limit: int
) -> dict[str, Any]:
    nats, _ = _nats()
    nc = await _connect(nats, urls)
    samples: list[float] = []
    failed = 0
    try:
        js = nc.jetstream(timeout=ACK_TIMEOUT_S)
        started = time.perf_counter()
        deadline = started + duration_s
        while len(samples) < limit and time.perf_counter() < deadline:
            t = time.perf_counter()
            try:
                await js.publish(SUBJECT, value)
            except Exception:
                failed += 1
            else:
                samples.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - started
    finally:
        await nc.close()
    return {"samples_s": samples, "failed": failed, "elapsed_s": elapsed}
