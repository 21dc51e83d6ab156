"""Integration tests: real relay processes on 127.0.0.1 (free ports), real clients.

1. produce through every relay, consume from every relay: one committed order everywhere;
2. a consumer that starts on a relay outside the stream's members is redirected;
3. SIGKILL of a relay under a steady stream of produces: nothing acknowledged is lost,
   consumers go on, and the restarted relay catches up and serves reads;
4. SIGSTOP of a relay does not stop the others; after SIGCONT it unfences and serves;
5. a relay cut off from its quorum answers `fenced` within about suspect_timeout_ms, and
   commits again once the others are back.

Timing bounds are generous (a loaded 2-core CI machine): they check behaviour, not speed.
Every test stops every process and thread it starts, even when it fails.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]
import zmq

from relay import wire
from relay.client import Consumer, Producer, Record
from relay.core.messages import Outcome, ReadStatus
from relay.errors import ClientError, Fenced, Rejected
from relay.launcher import (
    Mesh,
    not_ready_reason,
    resubscribe,
    startup_streams,
    write_loopback_topology,
)
from relay.meta import METADATA_STREAM
from relay.topology import load
from waiting import wait_until

pytestmark = pytest.mark.timeout(120)

STREAM = "orders.eu"
AUDIT = "audit"
START_TIMEOUT_S = 30.0  # for a mesh, or a restarted relay, to come up
CATCH_UP_S = 30.0  # for a consumer to see what was committed
PROGRESS_S = 30.0  # for a few more commits to happen after a fault
UNFENCE_S = 30.0  # for a relay to unfence once its peers are back
PAUSE_S = 3.0  # how long the soak keeps a relay stopped, after the others suspected it


# --- topologies and processes ----------------------------------------------------------------


def write_topology(
    directory: Path, subscriptions: Sequence[Sequence[str]], declared: Sequence[str]
) -> Path:
    """A topology with relay i serving `subscriptions[i]`, on free ports of 127.0.0.1."""
    return write_loopback_topology(directory, dict(enumerate(subscriptions)), declared)


def running(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def force_kill(pids: Sequence[int]) -> None:
    for pid in pids:
        if running(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)


def stop_mesh(mesh: Mesh, pids: set[int]) -> None:
    pids |= set(mesh.pids.values())
    try:
        mesh.stop()
    finally:
        force_kill(sorted(pids))  # e.g. a relay still stopped by SIGSTOP


class Harness:
    """What one test starts: meshes, producer and consumer threads. `close` ends the
    threads first (so that nothing waits on a relay that is gone), then every relay."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.meshes: list[tuple[Mesh, set[int]]] = []
        self.workers: list[Worker] = []

    def mesh(self, subscriptions: Sequence[Sequence[str]]) -> Mesh:
        directory = self.directory / f"mesh{len(self.meshes)}"
        declared = list(dict.fromkeys(s for streams in subscriptions for s in streams))
        return self.start(write_topology(directory, subscriptions, declared), "warning")

    def start(self, path: Path, log_level: str = "info") -> Mesh:
        """Every relay of the topology at `path`, logging next to it; stopped by `close`."""
        mesh = Mesh(path, log_level=log_level, log_dir=path.parent / "logs")
        pids: set[int] = set()
        self.meshes.append((mesh, pids))
        print(f"relay logs: {path.parent / 'logs'}")  # shown by pytest when the test fails
        mesh.start(timeout_s=START_TIMEOUT_S)
        pids |= set(mesh.pids.values())
        return mesh

    def track(self, mesh: Mesh) -> None:
        """Remember the relays' current pids (call after a restart)."""
        for m, pids in self.meshes:
            if m is mesh:
                pids |= set(mesh.pids.values())

    def pump(self, **kwargs: Any) -> Pump:
        worker = Pump(**kwargs)
        self.workers.append(worker)
        worker.start()
        return worker

    def reader(
        self, relays: Mapping[int, str], stream: str = STREAM, start: Any = "earliest"
    ) -> Reader:
        worker = Reader(relays, stream, start)
        self.workers.append(worker)
        worker.start()
        return worker

    def close(self) -> None:
        try:
            for worker in self.workers:
                worker.halt()
            for worker in self.workers:
                worker.join(20)
        finally:
            for mesh, pids in self.meshes:
                stop_mesh(mesh, pids)


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        h.close()


# --- clients in threads ----------------------------------------------------------------------


class Worker(threading.Thread):
    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def halt(self) -> None:
        self.stopping.set()

    def check(self) -> None:
        if self.error is not None:
            raise AssertionError(f"{self.name} failed: {self.error!r}") from self.error


class Pump(Worker):
    """Produces to `stream` one transaction at a time, as fast as they commit."""

    def __init__(
        self,
        *,
        relays: Mapping[int, str] | None = None,
        topology: Path | None = None,
        stream: str = STREAM,
        send_timeout_s: float = 15.0,
        producer_id: bytes | None = None,
    ) -> None:
        super().__init__("pump")
        self.producer_kwargs: dict[str, Any] = {"relays": relays, "topology": topology}
        self.stream = stream
        self.send_timeout_s = send_timeout_s
        self.producer_id = producer_id or os.urandom(16)
        self.committed: list[tuple[int, int]] = []  # (pseq, seq)
        self.failed: list[tuple[int, str]] = []  # (pseq, error)
        self.stats: Counter[str] = Counter()

    def run(self) -> None:
        try:
            with Producer(
                **self.producer_kwargs,
                producer_id=self.producer_id,
                window=1,
                send_timeout_s=self.send_timeout_s,
            ) as producer:
                while not self.stopping.is_set():
                    pseq = producer.next_producer_seq
                    try:
                        seq = producer.send(self.stream, b"v%d" % pseq, key=b"k%d" % pseq)
                    except ClientError as e:
                        self.failed.append((pseq, repr(e)))
                    else:
                        self.committed.append((pseq, seq))
                self.stats = Counter(producer.stats)
        except BaseException as e:
            self.error = e

    def count(self) -> int:
        return len(self.committed)

    def wait_for(self, n: int, timeout_s: float = PROGRESS_S) -> None:
        """Wait until `n` transactions in all have committed."""

        def done() -> bool:
            self.check()
            return self.count() >= n

        wait_until(
            done,
            lambda: f"{n} commits (only {self.count()}; failures: {self.failed[-3:]})",
            timeout_s=timeout_s,
            poll_s=0.02,
        )

    def stop(self) -> None:
        self.halt()
        self.join(self.send_timeout_s + 10)
        assert not self.is_alive(), "the producer did not stop"
        self.check()


class Reader(Worker):
    """Consumes `stream` from `start` through the given relays, keeping every record."""

    def __init__(self, relays: Mapping[int, str], stream: str, start: Any) -> None:
        super().__init__("reader")
        self.relays = dict(relays)
        self.stream = stream
        self.start_at = start
        self.records: list[Record] = []
        self.stats: Counter[str] = Counter()

    def run(self) -> None:
        try:
            with Consumer(self.relays, timeout_s=0.2, wait_ms=500) as consumer:
                consumer.subscribe(self.stream, self.start_at)
                while not self.stopping.is_set():
                    try:
                        record = next(consumer)
                    except StopIteration:  # idle for timeout_s: look at `stopping`
                        continue
                    self.records.append(record)
                    self.stats = consumer.stats
                self.stats = Counter(consumer.stats)
        except BaseException as e:
            self.error = e

    def last_seq(self) -> int:
        return self.records[-1].seq if self.records else -1

    def wait_for(self, seq: int, timeout_s: float = CATCH_UP_S) -> list[Record]:
        """Wait until a record at or beyond `seq` arrived; return the records so far."""

        def reached() -> bool:
            self.check()
            return self.last_seq() >= seq

        wait_until(
            reached,
            lambda: (
                f"the reader on {sorted(self.relays)} to reach seq {seq} (at "
                f"{self.last_seq()}, {len(self.records)} records; stats {dict(self.stats)})"
            ),
            timeout_s=timeout_s,
            poll_s=0.02,
        )
        return list(self.records)


def read_until(
    relays: Mapping[int, str], stream: str, last: int, **kw: Any
) -> tuple[list[Record], Counter[str]]:
    """Read `stream` from earliest until a record at or beyond `last`; (records, stats)."""
    records: list[Record] = []
    with Consumer(relays, timeout_s=CATCH_UP_S, wait_ms=500, **kw) as consumer:
        consumer.subscribe(stream, "earliest")
        for record in consumer:
            records.append(record)
            if record.seq >= last:
                break
        stats = Counter(consumer.stats)
    assert records and records[-1].seq >= last, (
        f"{stream} on {sorted(relays)}: reached {records[-1].seq if records else None}, "
        f"not {last}, within {CATCH_UP_S} s; stats {dict(stats)}"
    )
    return records, stats


def check_timeline(records: Sequence[Record]) -> None:
    """G1 on one consumer: ascending seqs, no duplicate seq, no transaction twice."""
    seqs = [r.seq for r in records]
    assert all(a < b for a, b in itertools.pairwise(seqs)), "seqs not strictly ascending"
    copies = Counter((r.producer_id, r.producer_seq) for r in records)
    twice = [k for k, n in copies.items() if n > 1]
    assert not twice, f"transactions delivered more than once: {twice[:5]}"


def check_acknowledged(records: Sequence[Record], pump: Pump) -> None:
    """G2/G3: every seq the producer was told committed is there, with its payload."""
    by_seq = {r.seq: r for r in records}
    missing = [(pseq, seq) for pseq, seq in pump.committed if seq not in by_seq]
    assert not missing, f"{len(missing)} acknowledged transactions lost: {missing[:5]}"
    for pseq, seq in pump.committed:
        record = by_seq[seq]
        assert (record.producer_id, record.producer_seq) == (pump.producer_id, pseq)
        assert (record.key, record.value) == (b"k%d" % pseq, b"v%d" % pseq)


def same_prefix(a: Sequence[Record], b: Sequence[Record], last: int) -> None:
    """Two consumers agree on everything committed up to `last`."""
    cut_a = [r for r in a if r.seq <= last]
    cut_b = [r for r in b if r.seq <= last]
    assert cut_a == cut_b, f"timelines differ up to {last}: {len(cut_a)} vs {len(cut_b)} records"


# --- the raw client protocol (to see the wire outcome itself) -------------------------------


class RawClient:
    """One DEALER to one relay: send requests, collect answers by request id."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)
        self.answers: dict[int, tuple[float, Any]] = {}

    def send(self, msg_of: Callable[[int], Any]) -> int:
        rid = next(self.ids)
        self.sock.send(wire.encode(msg_of(rid)))
        return rid

    def poll(self, timeout_s: float) -> None:
        if self.sock.poll(int(timeout_s * 1000)):
            while True:
                try:
                    frame = self.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    return
                msg = wire.decode(frame, 64 * 1024 * 1024)
                self.answers[msg.request_id] = (time.monotonic(), msg)

    def ask(self, msg_of: Callable[[int], Any], timeout_s: float = 5.0) -> Any:
        rid = self.send(msg_of)
        deadline = time.monotonic() + timeout_s
        while rid not in self.answers:
            left = deadline - time.monotonic()
            assert left > 0, f"no answer within {timeout_s} s"
            self.poll(left)
        return self.answers[rid][1]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def wait_status(mesh: Mesh, relay_id: int, stream: str, *, fenced: bool, timeout_s: float) -> float:
    """Wait until the relay reports `stream` joined with the given fenced state; return
    the time it took (for the log, never asserted: a loaded machine may take long)."""
    start = time.monotonic()
    seen: Any = None

    def reached() -> bool:
        nonlocal seen
        status = mesh.status(relay_id, timeout_s=0.5)
        seen = status["streams"].get(stream) if status else None
        return bool(seen and seen["joined"] and seen["fenced"] is fenced)

    wait_until(
        reached,
        lambda: (
            f"relay {relay_id} to report {stream} joined and "
            f"{'fenced' if fenced else 'unfenced'} (last status {seen})"
        ),
        timeout_s=timeout_s,
        poll_s=0.05,
    )
    return time.monotonic() - start


def wait_unheard(mesh: Mesh, relay_id: int, by: Sequence[int]) -> None:
    """Wait until none of the relays `by` has heard from `relay_id` for suspect_timeout_ms:
    they now treat it as gone (it is no longer in their status's `peers_heard`)."""

    def unheard() -> bool:
        for other in by:
            status = mesh.status(other, timeout_s=1.0)
            if status is None or relay_id in status["peers_heard"]:
                return False
        return True

    wait_until(unheard, f"relays {list(by)} to stop hearing relay {relay_id}", poll_s=0.05)


def clients(mesh: Mesh, *relay_ids: int) -> dict[int, str]:
    """relay id -> client endpoint, in the given order (a client tries them in order)."""
    return {r: mesh.endpoints[r].client for r in relay_ids}


# --- 1 and 2: a 4-relay mesh; orders.eu lives on relays 0-2, audit on all four ------------


@pytest.fixture(scope="module")
def mesh4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    directory = tmp_path_factory.mktemp("mesh4")
    subscriptions = [[STREAM, AUDIT]] * 3 + [[AUDIT]]
    mesh = Mesh(
        write_topology(directory, subscriptions, [STREAM, AUDIT]),
        log_level="warning",
        log_dir=directory / "logs",
    )
    pids: set[int] = set()
    try:
        mesh.start(timeout_s=START_TIMEOUT_S)
        pids |= set(mesh.pids.values())
        yield mesh
    finally:
        stop_mesh(mesh, pids)


@pytest.mark.parametrize("stream", [AUDIT, STREAM])
def test_produce_to_every_relay_consume_from_every_relay(mesh4: Mesh, stream: str) -> None:
    """Producers on every relay at once (relay 3 forwards orders.eu, which it does not
    serve); every member serves the same committed order."""
    per_relay = 25
    members = mesh4.config.members(stream)

    def produce(relay_id: int) -> tuple[bytes, list[int]]:
        pid = b"relay-%d-" % relay_id + os.urandom(8)
        with Producer(clients(mesh4, relay_id), producer_id=pid, window=4) as producer:
            values = [
                (b"r%d" % relay_id, b"%s/%d/%d" % (stream.encode(), relay_id, i))
                for i in range(per_relay)
            ]
            return pid, producer.send_many(stream, values)

    with ThreadPoolExecutor(len(mesh4.relay_ids)) as pool:
        produced = list(pool.map(produce, mesh4.relay_ids))
    mine = {seq: (pid, i) for pid, seqs in produced for i, seq in enumerate(seqs)}
    assert len(mine) == per_relay * len(mesh4.relay_ids), "two transactions got one seq"
    last = max(mine)

    timelines = {}
    for relay_id in members:
        records, stats = read_until(clients(mesh4, relay_id), stream, last)
        timelines[relay_id] = [r for r in records if r.seq <= last]
        check_timeline(timelines[relay_id])
        assert stats["redirect"] == 0, stats
    first = timelines[members[0]]
    for relay_id in members[1:]:
        assert timelines[relay_id] == first, f"relay {relay_id} serves another timeline"
    by_seq = {r.seq: r for r in first}
    for seq, (pid, pseq) in mine.items():
        record = by_seq.get(seq)
        assert record is not None, f"committed seq {seq} missing"
        assert (record.producer_id, record.producer_seq) == (pid, pseq)
        relay_id = int(pid.split(b"-")[1])
        assert record.key == b"r%d" % relay_id
        assert record.value == b"%s/%d/%d" % (stream.encode(), relay_id, pseq)
    # Each producer's own transactions commit in the order it sent them (window 4 may
    # reorder within a window, so only check that all are present, which is done above).


def test_consumer_on_a_non_member_is_redirected(mesh4: Mesh) -> None:
    """Relay 3 does not serve orders.eu: a read there answers `redirect` to 0, 1, 2, and a
    consumer that starts there follows it and reads the stream."""
    raw = RawClient(mesh4.endpoints[3].client)
    try:
        answer = raw.ask(lambda rid: wire.ReadReq(rid, STREAM, -1, 10, 0))
    finally:
        raw.close()
    assert isinstance(answer, wire.ReadResp), answer
    assert answer.status is ReadStatus.REDIRECT and answer.redirect == (0, 1, 2), answer

    with Producer(topology=mesh4.config_path) as producer:
        seqs = producer.send_many(STREAM, [b"redirected-%d" % i for i in range(10)])
    last = max(seqs)
    # No topology: the consumer tries relay 3 first (it only knows the ids to map).
    records, stats = read_until(clients(mesh4, 3, 0, 1, 2), STREAM, last)
    check_timeline(records)
    assert stats["redirect"] >= 1, stats
    assert set(seqs) <= {r.seq for r in records}
    direct, _ = read_until(clients(mesh4, 1), STREAM, last)
    same_prefix(records, direct, last)


# --- 3: kill -9 under load, then restart ---------------------------------------------------


def test_sigkill_loses_nothing_acknowledged_and_the_relay_rejoins(harness: Harness) -> None:
    """Relay 1 is killed while a producer commits through relays 0 and 2: the stream goes
    on without it, and once restarted it catches up and serves reads."""
    mesh = harness.mesh([[STREAM]] * 3)
    victim = 1
    # The producer goes through the survivors: a transaction the victim coordinated and
    # only one survivor received may split the survivors until the victim is back (the
    # limit of docs/protocol.md section 8; see the next test).
    pump = harness.pump(relays=clients(mesh, 0, 2))
    on_survivor = harness.reader(clients(mesh, 2))
    on_victim = harness.reader(clients(mesh, victim, 0, 2))  # starts on the victim
    pump.wait_for(50)
    on_victim.wait_for(pump.committed[9][1])

    mesh.kill(victim, signal.SIGKILL)
    at_kill = pump.count()
    pump.wait_for(at_kill + 100)  # the survivors go on

    mesh.restart(victim, timeout_s=START_TIMEOUT_S)
    harness.track(mesh)
    rejoined = harness.reader(clients(mesh, victim))  # the restarted relay only
    at_restart = pump.count()
    pump.wait_for(at_restart + 100)
    pump.stop()

    last = pump.committed[-1][1]
    survivor = on_survivor.wait_for(last)
    check_timeline(survivor)
    check_acknowledged(survivor, pump)

    # The consumer that was reading from the victim went on elsewhere: no gap, no repeat.
    moved = on_victim.wait_for(last)
    check_timeline(moved)
    check_acknowledged(moved, pump)
    same_prefix(moved, survivor, last)
    assert on_victim.stats["failovers"] >= 1, on_victim.stats

    # The restarted relay serves a suffix of the same timeline including everything
    # committed after it came back.
    back = rejoined.wait_for(last)
    check_timeline(back)
    after_restart = [seq for _, seq in pump.committed[at_restart:]]
    assert set(after_restart) <= {r.seq for r in back}
    start = [r.seq for r in survivor].index(back[0].seq)
    assert survivor[start : start + len(back)] == back
    status = mesh.status(victim)
    assert status is not None and status["streams"][STREAM]["committed"] >= last, status


def test_sigkill_of_a_coordinating_relay_loses_nothing_acknowledged(harness: Harness) -> None:
    """Every relay coordinates (a producer pinned to each, failing over to the others)
    when relay 1 is killed. The survivors may stall until it is back (a transaction it
    sent to only one of them splits them: docs/protocol.md section 8), but after its
    restart everything commits again, and nothing acknowledged is lost or repeated."""
    mesh = harness.mesh([[STREAM]] * 3)
    victim = 1
    pumps = [
        harness.pump(relays=clients(mesh, r, *(o for o in (0, 1, 2) if o != r)), send_timeout_s=10)
        for r in (0, 1, 2)
    ]
    readers = [harness.reader(clients(mesh, r, *(o for o in (0, 1, 2) if o != r))) for r in (0, 2)]
    for pump in pumps:
        pump.wait_for(30)

    mesh.kill(victim, signal.SIGKILL)
    counts = [p.count() for p in pumps]
    wait_unheard(mesh, victim, by=[r for r in (0, 1, 2) if r != victim])
    went_on = sum(p.count() for p in pumps) - sum(counts)
    mesh.restart(victim, timeout_s=START_TIMEOUT_S)
    harness.track(mesh)
    counts = [p.count() for p in pumps]
    for pump, count in zip(pumps, counts, strict=True):
        pump.wait_for(count + 30)
    for pump in pumps:
        pump.stop()

    last = max(p.committed[-1][1] for p in pumps)
    timelines = [reader.wait_for(last) for reader in readers]
    for timeline in timelines:
        check_timeline(timeline)
        for pump in pumps:
            check_acknowledged(timeline, pump)
    same_prefix(timelines[0], timelines[1], last)
    print(f"{went_on} commits while the victim was down, before the survivors suspected it")


# --- 4: SIGSTOP of one relay ----------------------------------------------------------------


def test_sigstop_of_one_relay_does_not_stop_the_others(harness: Harness) -> None:
    mesh = harness.mesh([[STREAM]] * 3)
    paused = 2
    pump = harness.pump(relays=clients(mesh, 0, 1))
    reader = harness.reader(clients(mesh, 0))
    pump.wait_for(10)
    # A producer that asks the paused relay first: its connection stays open (the kernel
    # still acknowledges), so only the ZMTP heartbeats show that nobody answers; then the
    # attempt goes to relay 0 long before the (very long) request timeout.
    with Producer(clients(mesh, paused, 0), request_timeout_s=600, send_timeout_s=900) as first:
        first.send(STREAM, b"before the pause")
        mesh.kill(paused, signal.SIGSTOP)
        first.send(STREAM, b"during the pause")
    assert first.stats["disconnects"] >= 1 and first.stats["timeouts"] == 0
    try:
        at_stop = pump.count()
        pump.wait_for(at_stop + 40)  # commits go on without relay 2
        for relay_id in (0, 1):
            wait_status(mesh, relay_id, STREAM, fenced=False, timeout_s=UNFENCE_S)
        assert mesh.status(paused, timeout_s=0.3) is None  # it really is stopped
    finally:
        mesh.kill(paused, signal.SIGCONT)
    wait_status(mesh, paused, STREAM, fenced=False, timeout_s=UNFENCE_S)
    pump.wait_for(pump.count() + 10)
    pump.stop()

    # The resumed relay takes produces itself and serves the whole timeline again.
    with Producer(clients(mesh, paused), send_timeout_s=20) as producer:
        own = producer.send(STREAM, b"through the resumed relay")
    last = max(own, pump.committed[-1][1])
    resumed, _ = read_until(clients(mesh, paused), STREAM, last)
    check_timeline(resumed)
    check_acknowledged(resumed, pump)
    assert own in {r.seq for r in resumed}
    same_prefix(resumed, reader.wait_for(last), last)


# --- 5: fencing -----------------------------------------------------------------------------


def test_a_relay_cut_off_from_its_quorum_answers_fenced_then_recovers(
    harness: Harness,
) -> None:
    mesh = harness.mesh([[STREAM]] * 3)
    suspect_s = mesh.config.limits.suspect_timeout_ms / 1000
    alone, others = 0, (1, 2)
    raw = RawClient(mesh.endpoints[alone].client)
    pid = b"fence-test"
    pseqs = itertools.count(1)
    sent: dict[int, int] = {}  # request id -> producer seq

    def produce(rid: int, pseq: int) -> wire.ProduceReq:
        return wire.ProduceReq(rid, STREAM, pid, pseq, None, b"p%d" % pseq)

    def commit(pseq: int) -> wire.ProduceResp:
        """Produce `pseq` until it commits (a retry with the same producer seq is safe; a
        loaded machine may fence a relay for a moment)."""
        answers: list[wire.ProduceResp] = []

        def committed() -> bool:
            answers.append(raw.ask(functools.partial(produce, pseq=pseq), timeout_s=10))
            return answers[-1].outcome is Outcome.COMMITTED

        wait_until(
            committed,
            lambda: f"producer seq {pseq} to commit (last answer {answers[-1]})",
            poll_s=0.1,
        )
        return answers[-1]

    try:
        first = commit(next(pseqs))
        assert first.outcome is Outcome.COMMITTED, first

        for relay_id in others:
            mesh.kill(relay_id, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            # A produce every 20 ms until one is answered fenced.
            def fenced_at() -> float | None:
                pseq = next(pseqs)
                sent[raw.send(functools.partial(produce, pseq=pseq))] = pseq
                raw.poll(0.02)
                return min(
                    (
                        raw.answers[r][0]
                        for r in sent
                        if r in raw.answers and raw.answers[r][1].outcome is Outcome.FENCED
                    ),
                    default=None,
                )

            first_fenced = wait_until(
                fenced_at,
                lambda: (
                    f"relay {alone} to answer fenced (suspect_timeout_ms "
                    f"{suspect_s * 1000:g}); answers so far: {raw.answers}"
                ),
                poll_s=0,
            )
            print(f"first fenced answer {first_fenced - stopped_at:.3f} s after SIGSTOP")

            # Now fenced: a produce is answered fenced (at once, not `unknown` after
            # produce_timeout_ms), naming relays to try.
            answer = raw.ask(lambda rid: produce(rid, next(pseqs)), timeout_s=5)
            assert answer.outcome is Outcome.FENCED, answer
            assert set(answer.redirect) <= set(others) and answer.redirect, answer
            read = raw.ask(lambda rid: wire.ReadReq(rid, STREAM, -1, 10, 0))
            assert read.status is ReadStatus.FENCED, read

            # The client library says Fenced (every answer was fenced).
            with (
                Producer(clients(mesh, alone), max_attempts=2, send_timeout_s=5) as producer,
                pytest.raises(Fenced) as info,
            ):
                producer.send(STREAM, b"cut off")
            assert set(info.value.redirect_to) <= set(others), info.value.redirect_to

            # The produces sent before it fenced end as unknown (produce_timeout_ms),
            # never as committed while it is alone.
            def all_answered() -> bool:
                raw.poll(0.1)
                return all(r in raw.answers for r in sent)

            wait_until(
                all_answered,
                lambda: (
                    f"an answer to every produce; unanswered: "
                    f"{[sent[r] for r in sent if r not in raw.answers]}"
                ),
                poll_s=0,
            )
            outcomes = Counter(raw.answers[r][1].outcome for r in sent)
            assert set(outcomes) <= {Outcome.FENCED, Outcome.UNKNOWN}, outcomes
            unknown = [sent[r] for r in sent if raw.answers[r][1].outcome is Outcome.UNKNOWN]
        finally:
            for relay_id in others:
                mesh.kill(relay_id, signal.SIGCONT)

        took = wait_status(mesh, alone, STREAM, fenced=False, timeout_s=UNFENCE_S)
        print(f"unfenced {took:.3f} s after SIGCONT; outcomes while alone {dict(outcomes)}")
        for relay_id in others:
            wait_status(mesh, relay_id, STREAM, fenced=False, timeout_s=UNFENCE_S)
        again = commit(next(pseqs))
        assert again.outcome is Outcome.COMMITTED, again
    finally:
        raw.close()

    # Retrying the unknown ones with the same producer seq is safe: one copy each.
    retried = []
    for pseq in unknown:
        with Producer(clients(mesh, alone), producer_id=pid, first_producer_seq=pseq) as p:
            retried.append(p.send(STREAM, b"p%d" % pseq))
    last = max([again.seq, *retried])
    records, _ = read_until(clients(mesh, 1), STREAM, last)
    check_timeline(records)
    ours = Counter(r.producer_seq for r in records if r.producer_id == pid)
    for pseq in [*unknown, 1]:
        assert ours[pseq] == 1, (pseq, ours)


# --- slow: a soak of kills and pauses ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_kill_restart_and_pause_every_relay_in_turn(harness: Harness) -> None:
    """A producer pinned to each relay (failing over to the others) and a consumer on each
    relay run while each relay in turn is killed with SIGKILL and restarted, then paused
    for a few seconds (a backlog builds up) and resumed. The stream may stall while a
    coordinator is gone (docs/protocol.md section 8) but goes on once it is back; nothing
    acknowledged is lost; every consumer sees one timeline."""
    mesh = harness.mesh([[STREAM]] * 3)
    others = {r: [o for o in (0, 1, 2) if o != r] for r in (0, 1, 2)}
    pumps = [
        harness.pump(relays=clients(mesh, r, *others[r]), send_timeout_s=10) for r in (0, 1, 2)
    ]
    readers = [harness.reader(clients(mesh, r, *others[r])) for r in (0, 1, 2)]

    def progress(n: int = 50) -> None:
        targets = [p.count() + n for p in pumps]
        for pump, target in zip(pumps, targets, strict=True):
            pump.wait_for(target, timeout_s=60)

    progress()
    for victim in (0, 1, 2, 0, 1, 2):
        mesh.kill(victim, signal.SIGKILL)
        wait_unheard(mesh, victim, by=others[victim])
        mesh.restart(victim, timeout_s=START_TIMEOUT_S)
        harness.track(mesh)
        progress()
        mesh.kill(victim, signal.SIGSTOP)
        try:
            wait_unheard(mesh, victim, by=others[victim])
            # Then the pause itself is the point: a backlog for the victim to catch up on,
            # where the others go on. No condition says it is there: they may as well stall
            # (the victim coordinated too), so waiting for their progress could hang.
            time.sleep(PAUSE_S)
        finally:
            mesh.kill(victim, signal.SIGCONT)
        wait_status(mesh, victim, STREAM, fenced=False, timeout_s=UNFENCE_S)
        progress()
    for pump in pumps:
        pump.stop()

    last = max(p.committed[-1][1] for p in pumps)
    timelines = [reader.wait_for(last, timeout_s=60) for reader in readers]
    for timeline in timelines:
        check_timeline(timeline)
        for pump in pumps:
            check_acknowledged(timeline, pump)
    for timeline in timelines[1:]:
        same_prefix(timeline, timelines[0], last)
    for relay_id in mesh.relay_ids:
        status = mesh.status(relay_id)
        assert status is not None and status["streams"][STREAM]["committed"] >= last, status
    print(
        f"committed {sum(p.count() for p in pumps)}, failed "
        f"{[f for p in pumps for f in p.failed][:5]}, reader stats "
        f"{[dict(r.stats) for r in readers]}"
    )


def test_a_relay_is_ready_once_the_streams_it_opens_at_start_joined(tmp_path: Path) -> None:
    """Readiness (`relay up`, `relay chaos`, the tests' meshes) covers the declared streams a
    relay serves through a pattern, not only its exact names: a relay subscribed to
    `chaos.*` is not ready while `chaos.a` is still joining."""
    path = write_loopback_topology(
        tmp_path, {0: ["chaos.*"], 1: ["chaos.*", "audit"], 2: ["other.*"]}, ["chaos.a"]
    )
    config = load(path)
    meta = METADATA_STREAM  # every relay serves it (docs/metadata.md)
    assert startup_streams(config, 0) == (meta, "chaos.a")
    assert startup_streams(config, 1) == ("audit", meta, "chaos.a")
    assert startup_streams(config, 2) == (meta,)
    joined = {"joined": True, "fenced": False}
    joining = {"joined": False, "fenced": True}
    assert not_ready_reason(config, 0, {"streams": {meta: joined, "chaos.a": joining}}) == (
        "stream 'chaos.a' has not joined"
    )
    assert not_ready_reason(config, 0, {"streams": {meta: joined}}) == (
        "stream 'chaos.a' is not open"
    )
    assert not_ready_reason(config, 0, {"streams": {meta: joined, "chaos.a": joined}}) is None
    assert not_ready_reason(config, 2, {"streams": {}}) == f"stream {meta!r} is not open"
    assert not_ready_reason(config, 2, {"streams": {meta: joined}}) is None


# --- 6: a stream's relays changed on the running mesh (SIGHUP) -------------------------------

CHANGE_S = 60.0  # for the mesh to change a stream's relays once the files agree


def hang_up(mesh: Mesh, relay_id: int) -> None:
    """Tell a relay to read its topology file again (docs/deploy.md section 9)."""
    mesh.kill(relay_id, signal.SIGHUP)


def wait_stream_on(mesh: Mesh, stream: str, relays: tuple[int, ...]) -> None:
    """Wait until every relay of `relays` serves `stream` under a configuration of exactly
    those relays (joined, unfenced), and every other relay says it is not served there."""
    last: dict[int, Any] = {}

    def changed() -> bool:
        for relay_id in mesh.relay_ids:
            status = mesh.status(relay_id) or {}
            info = (status.get("streams") or {}).get(stream)
            last[relay_id] = (info or {}).get("config") or (status.get("not_member") or {}).get(
                stream
            )
            if relay_id in relays:
                if info is None or not info.get("joined") or info.get("fenced"):
                    return False
                if tuple(info["config"]["relays"]) != relays:
                    return False
            elif info is not None:
                return False
        return True

    wait_until(
        changed,
        lambda: f"{stream} on relays {list(relays)} (last configurations: {last})",
        timeout_s=CHANGE_S,
        poll_s=0.1,
    )


def test_a_streams_relays_change_on_sighup_under_writes(harness: Harness) -> None:
    """docs/deploy.md section 9 as written: edit the topology file, then send each relay
    SIGHUP, under writes. orders.eu grows from relays 0-2 to 0-3, with relay 2 killed -9
    half way through (after relays 0 and 1 read the file) and restarted onto the new file;
    then relay 0 is taken off it (0-3 -> 1-3). The mesh changes the stream's relays
    (docs/protocol.md 5.15 changes); nothing acknowledged is lost, the relays that stay
    serve one timeline, relay 3 serves the writes made since it joined, and relay 0 says
    the stream is not served there."""
    mesh = harness.mesh([[STREAM, AUDIT]] * 3 + [[AUDIT]])
    path = mesh.config_path
    pump = harness.pump(topology=path)
    pump.wait_for(20)

    resubscribe(path, {3: [STREAM, AUDIT]})
    hang_up(mesh, 0)
    hang_up(mesh, 1)
    mesh.kill(2)  # kill -9 half way: the change waits for a quorum of 0-3 holding history
    pump.wait_for(pump.count() + 20)  # relays 0 and 1 commit meanwhile
    mesh.restart(2, timeout_s=START_TIMEOUT_S)  # onto the new file
    harness.track(mesh)
    hang_up(mesh, 3)
    wait_stream_on(mesh, STREAM, (0, 1, 2, 3))
    grown = pump.count()
    pump.wait_for(grown + 20)
    first_on_3 = pump.committed[grown][1]

    resubscribe(path, {0: [AUDIT]})
    for relay_id in mesh.relay_ids:
        hang_up(mesh, relay_id)
    wait_stream_on(mesh, STREAM, (1, 2, 3))
    pump.wait_for(pump.count() + 20)
    pump.stop()

    last = max(seq for _, seq in pump.committed)
    first, _ = read_until(clients(mesh, 1), STREAM, last)
    check_timeline(first)
    check_acknowledged(first, pump)
    # Relay 2 restarted empty and relay 3 joined from a base: each holds the history
    # from where it began, the same as relay 1's.
    again, _ = read_until(clients(mesh, 2), STREAM, last)
    assert again == [r for r in first if again[0].seq <= r.seq <= last]
    on_3 = read_from(clients(mesh, 3), STREAM, first_on_3 - 1, last)
    assert on_3 == [r for r in first if first_on_3 <= r.seq <= last]
    status = mesh.status(0) or {}
    assert STREAM in (status.get("not_member") or {}), status.get("not_member")


def test_a_stream_of_one_relay_moves_on_sighup_under_writes(harness: Harness) -> None:
    """docs/deploy.md section 9 for a stream served by one relay: orders.eu on relay 0
    alone grows to relays 0-2 by SIGHUP, under writes, with relay 2 killed -9 once relays
    0 and 1 read the file, and restarted onto it; then relay 0 is taken off (1-2). The
    first step adds one relay (docs/protocol.md 5.15 changes), the next the other
    (relays 0 and 1 commit while relay 2 is down: a fault during the first step would
    stop the stream, which no quorum of two survives); nothing acknowledged is lost and
    relays 1 and 2 serve the history from where they began, as relay 0 held it."""
    mesh = harness.mesh([[STREAM, AUDIT]] + [[AUDIT]] * 2)
    path = mesh.config_path
    pump = harness.pump(topology=path)
    pump.wait_for(20)

    resubscribe(path, {1: [STREAM, AUDIT], 2: [STREAM, AUDIT]})
    hang_up(mesh, 1)
    hang_up(mesh, 0)
    mesh.kill(2)  # kill -9 half way: the steps go on without it
    pump.wait_for(pump.count() + 20)
    mesh.restart(2, timeout_s=START_TIMEOUT_S)  # onto the new file
    harness.track(mesh)
    wait_stream_on(mesh, STREAM, (0, 1, 2))
    grown = pump.count()
    pump.wait_for(grown + 20)
    held_by_0, _ = read_until(clients(mesh, 0), STREAM, pump.committed[grown][1])

    resubscribe(path, {0: [AUDIT]})
    for relay_id in mesh.relay_ids:
        hang_up(mesh, relay_id)
    wait_stream_on(mesh, STREAM, (1, 2))
    pump.wait_for(pump.count() + 20)
    pump.stop()

    last = max(seq for _, seq in pump.committed)
    now, _ = read_until(clients(mesh, 1), STREAM, last)
    check_timeline(now)
    # Relays 1 and 2 hold the history from the bases they joined from; what came before
    # is what relay 0 held (and the store, when there is one): nothing acknowledged is
    # lost between the two, and they agree where both hold it.
    assert now[0].seq <= held_by_0[-1].seq
    assert [r for r in held_by_0 if r.seq >= now[0].seq] == [
        r for r in now if r.seq <= held_by_0[-1].seq
    ]
    check_acknowledged([*(r for r in held_by_0 if r.seq < now[0].seq), *now], pump)
    again, _ = read_until(clients(mesh, 2), STREAM, last)
    assert again == [r for r in now if again[0].seq <= r.seq <= last]


def curve_of(topology: Path) -> dict[str, Any]:
    """A client's `curve=` for the topology's default client key, when CurveZMQ is on."""
    config = load(topology)
    if not config.security.curve:
        return {}
    from relay.security import client_curve

    return {"curve": client_curve(config, None)}


def read_from(
    relays: Mapping[int, str], stream: str, after: int, last: int, **kw: Any
) -> list[Record]:
    """The records of `stream` after seq `after` up to `last`, read through `relays`."""
    records: list[Record] = []
    with Consumer(relays, timeout_s=CATCH_UP_S, wait_ms=500, **kw) as consumer:
        consumer.subscribe(stream, after)
        for record in consumer:
            if record.seq > last:
                break
            records.append(record)
            if record.seq >= last:
                break
    return records


def reconfigure(path: Path, *args: str) -> tuple[int, str]:
    """`relay reconfigure --config PATH ARGS` as an operator runs it: (exit code, output)."""
    done = subprocess.run(
        [sys.executable, "-m", "relay", "reconfigure", "--config", str(path), *args],
        capture_output=True,
        text=True,
        timeout=CHANGE_S + 60,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def test_relay_reconfigure_plans_checks_and_drives_a_change(harness: Harness) -> None:
    """`relay reconfigure --config NEW.yaml` says what NEW.yaml changes and changes nothing;
    with --apply before NEW.yaml was copied to the relays it names every relay that read
    another file (exit 1); once copied it drives the change (exit 0) and the stream runs on
    the new relays; a file that changes a limit every relay must hold alike is refused by
    every relay, by name (exit 1), and nothing changes; one that lowers max_tx_bytes is
    taken by every relay (exit 0), which then rejects a larger transaction."""
    mesh = harness.mesh([[STREAM, AUDIT]] * 3 + [[AUDIT]])
    path = mesh.config_path
    pump = harness.pump(topology=path)
    pump.wait_for(10)
    new = path.with_name("new.yaml")
    new.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    resubscribe(new, {3: [STREAM, AUDIT]})

    code, out = reconfigure(new)
    assert code == 0, out
    assert (
        f"{STREAM}: relays 0, 1, 2 (configuration 1) -> relays 0, 1, 2, 3: adds relays 3 (1 step)"
    ) in out, out
    assert "nothing applied" in out, out
    code, out = reconfigure(new, "--apply", "--wait", "2")
    assert code == 1, out
    for relay_id in mesh.relay_ids:
        assert f"relay {relay_id}: read another file than {new}" in out, out
    assert ((mesh.status(0) or {})["streams"][STREAM]["config"]["relays"]) == [0, 1, 2]

    path.write_text(new.read_text(encoding="utf-8"), encoding="utf-8")  # copied to the hosts
    code, out = reconfigure(path, "--apply")
    assert code == 0, out
    assert f"{STREAM}: on relays 0, 1, 2, 3 (configuration 2) after" in out, out
    assert "done in" in out, out
    wait_stream_on(mesh, STREAM, (0, 1, 2, 3))
    pump.wait_for(pump.count() + 20)

    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    doc["limits"] = {**(doc.get("limits") or {}), "dedupe_window_entries": 1000}
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    code, out = reconfigure(path, "--apply", "--wait", "2")
    assert code == 1, out
    for relay_id in mesh.relay_ids:
        assert (
            f"relay {relay_id}: refused: {path}: limits.dedupe_window_entries changes (every "
            "relay must skip the same duplicates"
        ) in out, out
    pump.wait_for(pump.count() + 20)  # the relays run on

    del doc["limits"]["dedupe_window_entries"]
    doc["limits"]["max_tx_bytes"] = 1000
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    code, out = reconfigure(path, "--apply")
    assert code == 0, out
    assert "-> 1000 (a reload applies it)" in out, out
    for relay_id in mesh.relay_ids:
        assert f"relay {relay_id}: took the file: limits.max_tx_bytes " in out, out
    with (
        Producer(clients(mesh, *mesh.relay_ids)) as producer,
        pytest.raises(Rejected, match="too_large"),
    ):
        producer.send(STREAM, b"k", b"x" * 1500)
    pump.wait_for(pump.count() + 20)  # the pump's small writes go on
    pump.stop()
    last = max(seq for _, seq in pump.committed)
    records, _ = read_until(clients(mesh, 0), STREAM, last)
    check_acknowledged(records, pump)


RUN = [sys.executable, "-m", "relay", "run"]


def _keys_for_added_relays(path: Path) -> list[str]:
    """`relay keygen --config PATH` (the key pairs the file's new relays lack), as the
    operator runs it; the arguments that give `relay reconfigure` the admin key."""
    made = subprocess.run(
        [sys.executable, "-m", "relay", "keygen", "--config", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    return ["--key-file", str(load(path).security.keys_dir / "client-admin.key_secret")]


def _start_relay(command_file: Path, relay_id: int, log: Path) -> subprocess.Popen[bytes]:
    """`relay run` for one relay on its own topology file (its host's), logging to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*RUN, "--config", str(command_file), "--relay", str(relay_id), "--log-level", "info"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(20)


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_a_relay_added_to_the_mesh_joins_it_and_a_stream_without_a_restart(
    harness: Harness, curve: bool
) -> None:
    """docs/deploy.md section 9, adding a relay: relays 0-2 run; the operator adds relay 3
    to the topology (serving orders.eu too; with CurveZMQ, its key pair made by `relay
    keygen`), starts it on the new file and runs `relay reconfigure --apply`: the running
    relays connect to relay 3 and let it in, and the mesh adds it to orders.eu, under
    writes; nothing acknowledged is lost, relay 3 serves the writes since it joined, and
    no relay of the old three restarted."""
    directory = harness.directory / "grow"
    full = write_loopback_topology(
        directory,
        {relay_id: [STREAM, AUDIT] for relay_id in range(4)},
        [STREAM, AUDIT],
        access={"app": {"produce": ["*"], "consume": ["*"]}} if curve else None,
    )
    new_text = full.read_text(encoding="utf-8")
    doc = yaml.safe_load(new_text)
    doc["relays"] = [r for r in doc["relays"] if r["id"] != 3]
    path = directory / "mesh.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    mesh = harness.start(path)
    before = dict(mesh.pids)
    # (with CurveZMQ the topology's client is admin: its producer ids start so)
    pump = harness.pump(topology=path, producer_id=b"admin/" + os.urandom(8))
    pump.wait_for(20)

    path.write_text(new_text, encoding="utf-8")  # the new file, on every host
    new = load(path)
    endpoint_3 = new.relays[3].client_endpoint
    admin = _keys_for_added_relays(path) if curve else []
    relay_3 = _start_relay(path, 3, directory / "logs" / "relay-3.log")
    try:
        code, out = reconfigure(path, "--apply", *admin)
        assert code == 0, out
        assert "relay 0: took the file: relays [3] join the mesh; " in out, out
        assert f"{STREAM}: on relays 0, 1, 2, 3 (configuration 2) after" in out, out
        grown = pump.count()
        pump.wait_for(grown + 20)
        first_on_3 = pump.committed[grown][1]
        pump.stop()
        last = max(seq for _, seq in pump.committed)
        records, _ = read_until(clients(mesh, 0), STREAM, last, **curve_of(path))
        check_acknowledged(records, pump)
        on_3 = read_from({3: endpoint_3}, STREAM, first_on_3 - 1, last, **curve_of(path))
        assert on_3 == [r for r in records if first_on_3 <= r.seq <= last]
        assert dict(mesh.pids) == before  # nothing restarted
    finally:
        _stop(relay_3)


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_a_relay_replaced_by_a_new_one_leaves_the_mesh_without_a_restart(
    harness: Harness, curve: bool
) -> None:
    """docs/deploy.md section 9, replacing a relay by one with a new id and host: relays
    0-2 run; the operator adds relay 3 in relay 0's place (relay 0's entry kept, serving
    no stream), starts relay 3 and runs `relay reconfigure --apply`: every stream moves
    from relay 0 to relay 3. Then relay 0's entry goes from the file and `relay
    reconfigure --apply` again: relays 1-3 let relay 0 go, and it is stopped. Under
    writes: nothing acknowledged is lost, relay 3 holds what relay 1 holds from its base
    on, no relay that stays restarted, and relay 0 started again on its old file is not
    heard by the others (with CurveZMQ its key is refused)."""
    directory = harness.directory / "replace"
    full = write_loopback_topology(
        directory,
        {relay_id: [STREAM, AUDIT] for relay_id in range(4)},
        [STREAM, AUDIT],
        access={"app": {"produce": ["*"], "consume": ["*"]}} if curve else None,
    )
    doc = yaml.safe_load(full.read_text(encoding="utf-8"))
    entries = {r["id"]: r for r in doc["relays"]}
    path = directory / "mesh.yaml"

    def write(relays: Sequence[dict[str, Any]], to: Path = path) -> None:
        to.write_text(yaml.safe_dump({**doc, "relays": list(relays)}, sort_keys=False), "utf-8")

    write([entries[0], entries[1], entries[2]])
    mesh = harness.start(path)
    before = dict(mesh.pids)
    pump = harness.pump(topology=path, producer_id=b"admin/" + os.urandom(8))
    pump.wait_for(20)

    # Step 1: relay 3 in relay 0's place; relay 0 stays in the mesh, serving nothing.
    drained = [{**entries[0], "streams": []}, entries[1], entries[2], entries[3]]
    write(drained)
    write(drained, directory / "host-0.yaml")  # relay 0's own copy, for its restart below
    new = load(path)
    admin = _keys_for_added_relays(path) if curve else []
    relay_3 = _start_relay(path, 3, directory / "logs" / "relay-3.log")
    relay_0: subprocess.Popen[bytes] | None = None
    try:
        code, out = reconfigure(path, "--apply", *admin)
        assert code == 0, out
        assert "relay 0: took the file: relays [3] join the mesh; " in out, out
        for stream in (STREAM, AUDIT, METADATA_STREAM):
            assert f"{stream}: on relays 1, 2, 3 (configuration" in out, out
        moved = pump.count()
        pump.wait_for(moved + 20)
        first_on_3 = pump.committed[moved][1]  # relay 3 took a base before it

        # Step 2: relay 0 leaves the mesh; the others let it go, then it is stopped.
        write([entries[1], entries[2], entries[3]])
        code, out = reconfigure(path, "--apply", *admin)
        assert code == 0, out
        assert "relays [0] leave the mesh" in out, out
        assert "relay 1: took the file: relays [0] leave the mesh" in out, out
        assert "relay 0: left the mesh after" in out, out
        for relay_id in (1, 2):
            node = (mesh.status(relay_id) or {})["node"]
            assert node["leaving"] == [] and 0 not in node["peers"], node
        if curve:
            # The relays that let relay 0 go closed the connections it had made to them
            # (their mesh ports bound again), and refuse its key: it hears nobody.
            wait_until(
                lambda: (mesh.status(0) or {}).get("peers_heard") == [],
                "relay 0, let go, hearing no relay",
                timeout_s=CHANGE_S,
            )
        assert mesh.kill(0, signal.SIGTERM) == 0
        pump.wait_for(pump.count() + 20)

        # Relay 0 started again on its host's old file: the others do not take it back.
        refused_before = (mesh.status(1) or {})["node"]["handshakes_refused"]
        relay_0 = _start_relay(directory / "host-0.yaml", 0, directory / "logs" / "relay-0.log")
        if curve:
            wait_until(
                lambda: (mesh.status(1) or {})["node"]["handshakes_refused"] > refused_before,
                "relay 1 refusing relay 0's key",
                timeout_s=CHANGE_S,
            )
        pump.wait_for(pump.count() + 20)
        for relay_id in (1, 2):
            status = mesh.status(relay_id) or {}
            assert 0 not in status["peers_heard"], status["peers_heard"]
        pump.stop()

        last = max(seq for _, seq in pump.committed)
        records, _ = read_until(clients(mesh, 1), STREAM, last, **curve_of(path))
        check_timeline(records)
        check_acknowledged(records, pump)
        endpoint_3 = {3: new.relays[3].client_endpoint}
        on_3 = read_from(endpoint_3, STREAM, first_on_3 - 1, last, **curve_of(path))
        assert on_3 == [r for r in records if first_on_3 <= r.seq <= last]
        assert {r: p for r, p in mesh.pids.items() if r != 0} == {
            r: p for r, p in before.items() if r != 0
        }
    finally:
        for proc in (relay_3, relay_0):
            if proc is not None:
                _stop(proc)
