"""Simulated producers and consumers: the real client engines (relay/engines.py) over
simulated client links.

Each client talks to the relays through a `ClientPort` (the world): `send` hands a request
frame to a relay's client service (relay/service.py) and returns False when the relay is
down (not connected, as a real client's socket would say); response frames and lost
connections come back through `on_frame` and `on_disconnect`. The retry, fail-over and
resume rules are the engines' own: the simulator checks the real ones.

Producers record, from the frames on their link, every attempt (each transaction of each
request frame) and every answer a relay gave it: the checkers judge the relays' answers,
and also what the engine concluded from them. Consumers record every record they yielded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from relay import wire
from relay.core import Outcome, Transaction
from relay.engines import Op, ProduceEngine, ReadEngine, Relays
from relay.errors import FrameError, Rejected, UnknownStream
from relay.sim.history import (
    COMMITTED,
    CRASHED,
    FENCED,
    REJECTED,
    UNKNOWN,
    Attempt,
    ConsumerLog,
    Final,
    History,
    final_outcome,
)

CLIENT_TIMEOUT_MS = 3_000  # one produce attempt without an answer
# A producer keeps trying until the run tells it to stop (stop_retry), never giving up by
# itself within a run: these bounds are far above any run's length.
SEND_TIMEOUT_S = 3_600.0
MAX_ATTEMPTS = 1_000_000
PRODUCE_WINDOW = 1_000  # in flight at once: every issued transaction
READ_BATCH = 64
READ_WAIT_MS = 100  # a consumer's long poll
READ_TIMEOUT_MS = 200  # beyond the long poll: a paused relay is left after this
DISCONNECT_P = 0.0005  # per ms and consumer: its connection drops (it reconnects)
REQUEST_ID_BITS = 40  # a client's first request id is drawn from this many bits
SPIN_RANGE = 1 << 16


def endpoint_of(relay: int) -> str:
    return f"sim://{relay}"


def relay_of(endpoint: str) -> int:
    return int(endpoint.removeprefix("sim://"))


class ClientPort(Protocol):
    now: int

    def send(self, client: bytes, relay: int, frame: bytes) -> bool:
        """Queue a request frame to `relay`; False if the relay is down."""

    def incarnation(self, relay: int) -> int: ...


def client_relays(relays: Relays, rng: random.Random) -> Relays:
    """The relays as a client sees them, starting at its own member of each stream."""
    return Relays(
        relays.endpoints,
        relays.by_id,
        limits=relays.limits,
        members=relays.members,
        spin=rng.randrange(SPIN_RANGE),
    )


@dataclass
class _Issued:
    op: Op
    stream: str
    tx: Transaction
    issued_ms: int


class Producer:
    """Issues a transaction to a random stream every `interval_ms`, through the engine."""

    def __init__(
        self,
        index: int,
        rng: random.Random,
        streams: tuple[str, ...],
        history: History,
        relays: Relays,
        interval_ms: tuple[int, int] = (15, 60),
        late_streams: tuple[str, ...] = (),
        late_from_ms: int = 0,
    ) -> None:
        """`late_streams`: written only from `late_from_ms` on (read from the start)."""
        self.index = index
        self.pid = b"prod-%d" % index
        self.client_id = b"producer-%d" % index
        self.rng = rng
        self.streams = streams
        self.early_streams = tuple(s for s in streams if s not in late_streams)
        self.late_from_ms = late_from_ms
        self.history = history
        self.interval_ms = interval_ms
        self.next_issue = rng.randint(0, interval_ms[1])
        self.issuing = True
        self.engine = ProduceEngine(
            client_relays(relays, rng),
            self.pid,
            1,
            window=PRODUCE_WINDOW,
            send_timeout_s=SEND_TIMEOUT_S,
            request_timeout_s=CLIENT_TIMEOUT_MS / 1000,
            max_attempts=MAX_ATTEMPTS,
            connect_grace_s=0.0,
            now=0.0,
            first_request_id=rng.getrandbits(REQUEST_ID_BITS),
        )
        self.issued: list[_Issued] = []
        self.attempts: dict[int, Attempt] = {}  # by request (item) id
        self.by_pseq: dict[int, list[Attempt]] = {}

    # --- driving -----------------------------------------------------------------------

    def step(self, port: ClientPort) -> None:
        now = port.now
        if self.issuing and now >= self.next_issue:
            self.next_issue = now + self.rng.randint(*self.interval_ms)
            self._issue(port)
        self.engine.step(now / 1000, lambda endpoint, frame: self._send(port, endpoint, frame))

    def stop_retrying(self) -> None:
        """The run ends: the engine gives up what is not settled (answers that still come
        are recorded all the same)."""
        self.engine.abandon("the run ends")

    def _issue(self, port: ClientPort) -> None:
        rng = self.rng
        pseq = self.engine.next_seq
        stream = rng.choice(self.streams if port.now >= self.late_from_ms else self.early_streams)
        key = None if rng.random() < 0.3 else b"k%d" % rng.randint(0, 7)
        value = b"%s:%d:" % (self.pid, pseq) + rng.randbytes(rng.randint(0, 24))
        tx = Transaction(self.pid, pseq, key, value)
        self.history.produced[(self.pid, pseq)] = (stream, tx)
        op = self.engine.submit(stream, key, value)
        self.issued.append(_Issued(op, stream, tx, port.now))

    def _send(self, port: ClientPort, endpoint: str, frame: bytes) -> bool:
        relay = relay_of(endpoint)
        if not port.send(self.client_id, relay, frame):
            return False
        msg = wire.decode(frame, 1 << 30, wire.MAX_BATCH_ITEMS)  # our own frame: valid
        if isinstance(msg, wire.ProduceReq):
            items = [(msg.request_id, msg.stream, msg.producer_seq, msg.key, msg.value, msg.kind)]
        else:
            assert isinstance(msg, wire.ProduceBatchReq)
            items = list(msg.items)
        incarnation = port.incarnation(relay)
        for rid, stream, pseq, key, value, kind in items:
            tx = Transaction(self.pid, pseq, key, value, kind)
            attempt = Attempt(self.pid, pseq, stream, tx, relay, incarnation, rid, port.now)
            self.attempts[rid] = attempt
            self.by_pseq.setdefault(pseq, []).append(attempt)
            self.history.attempts.append(attempt)
            self.history.event(
                f"{port.now} produce {self.pid.decode()}#{pseq} {stream} r{relay} q{rid}"
            )
        return True

    # --- answers -----------------------------------------------------------------------

    def on_frame(self, relay: int, frame: bytes, now: int) -> None:
        try:
            msg = wire.decode(frame, 1 << 30, wire.MAX_BATCH_ITEMS)
        except FrameError as error:
            self.history.anomalies.append(f"{now} ms: relay {relay} sent a bad frame: {error}")
            return
        if isinstance(msg, wire.ProduceResp):
            self._record(msg.request_id, msg.outcome, msg.seq, msg.reason, now)
        elif isinstance(msg, wire.ProduceBatchResp):
            for rid, outcome, seq, reason, _ in msg.results:
                self._record(rid, outcome, seq, reason, now)
        self.engine.on_frame(endpoint_of(relay), frame, now / 1000)

    def on_disconnect(self, relay: int, incarnation: int, now: int) -> None:
        """The relay crashed: attempts it did not answer end without an answer."""
        for attempts in self.by_pseq.values():
            for a in attempts:
                if a.relay == relay and a.incarnation == incarnation and a.answer_ms < 0:
                    a.outcome = CRASHED
                    a.answer_ms = now
        self.engine.on_disconnect(endpoint_of(relay), now / 1000)

    def _record(self, rid: int, answer: Outcome, seq: int, reason: str, now: int) -> None:
        attempt = self.attempts.get(rid)
        if attempt is None:
            self.history.anomalies.append(
                f"{now} ms: reply to unknown request {rid} at {self.pid.decode()}"
            )
            return
        outcome = answer.value
        if attempt.answer_ms >= 0 and attempt.outcome in (COMMITTED, REJECTED, FENCED, UNKNOWN):
            if attempt.outcome in (COMMITTED, REJECTED) and (
                outcome != attempt.outcome or seq != attempt.seq
            ):
                self.history.anomalies.append(
                    f"{now} ms: request {rid} ({self.pid.decode()}#{attempt.pseq}) "
                    f"answered {attempt.outcome} {attempt.seq} then {outcome} {seq}"
                )
            if attempt.outcome == COMMITTED:
                return  # keep the committed answer
        attempt.outcome = outcome
        attempt.seq = seq if outcome == COMMITTED else -1
        attempt.reason = reason
        attempt.answer_ms = now
        self.history.event(
            f"{now} answer {self.pid.decode()}#{attempt.pseq} r{attempt.relay} {outcome} "
            f"{seq} {reason}"
        )

    def finals(self) -> list[Final]:
        out = []
        for issued in self.issued:
            op = issued.op
            outcome, seq, committed = final_outcome(self.by_pseq.get(op.pseq, []))
            final = Final(
                self.pid,
                op.pseq,
                issued.stream,
                issued.tx,
                issued.issued_ms,
                outcome,
                seq,
                committed,
            )
            if not op.done:
                final.client_outcome = ""
            elif op.error is None:
                final.client_outcome, final.client_seq = COMMITTED, op.seq
            elif isinstance(op.error, Rejected | UnknownStream):
                final.client_outcome = REJECTED
            else:
                final.client_outcome = UNKNOWN
            out.append(final)
        return out


class Consumer:
    """Follows one stream from its beginning through the engine, with long polls."""

    def __init__(
        self,
        cid: int,
        stream: str,
        rng: random.Random,
        history: History,
        relays: Relays,
    ) -> None:
        self.cid = cid
        self.stream = stream
        self.rng = rng
        self.history = history
        self.client_id = b"consumer-%d" % cid
        self.relays = client_relays(relays, rng)
        self.failovers = 0
        self.log = ConsumerLog(cid, stream)
        history.consumers[cid] = self.log
        self.engine = self._engine(0)

    def _engine(self, now: int) -> ReadEngine:
        engine = ReadEngine(
            self.relays,
            max_batch=READ_BATCH,
            wait_ms=READ_WAIT_MS,
            request_timeout_s=READ_TIMEOUT_MS / 1000,
            connect_grace_s=0.0,
            now=now / 1000,
            first_request_id=self.rng.getrandbits(REQUEST_ID_BITS),
        )
        engine.subscribe(self.stream, "earliest")
        return engine

    def step(self, port: ClientPort) -> None:
        now = port.now
        engine = self.engine
        if engine.endpoint is not None and self.rng.random() < DISCONNECT_P:
            self.history.event(f"{now} disconnect c{self.cid} {engine.endpoint}")
            engine.on_disconnect(engine.endpoint, now / 1000)
        engine.step(
            now / 1000, lambda endpoint, frame: port.send(self.client_id, relay_of(endpoint), frame)
        )
        self._take(now)
        if engine.error is not None:
            # Nothing can serve its position any more: a new reader from the beginning.
            self.history.event(f"{now} reader c{self.cid} ended: {engine.error}")
            self.failovers += engine.stats["failovers"]
            self.log = ConsumerLog(len(self.history.consumers), self.stream)
            self.history.consumers[self.log.consumer] = self.log
            self.engine = self._engine(now)

    def on_frame(self, relay: int, frame: bytes, now: int) -> None:
        self.engine.on_frame(endpoint_of(relay), frame, now / 1000)
        self._take(now)

    def on_disconnect(self, relay: int, incarnation: int, now: int) -> None:
        self.engine.on_disconnect(endpoint_of(relay), now / 1000)

    def _take(self, now: int) -> None:
        records = self.engine.records
        if not records:
            return
        first = records[0].seq
        entries = [
            (r.seq, Transaction(r.producer_id, r.producer_seq, r.key, r.value, r.kind))
            for r in records
        ]
        records.clear()
        self.log.received.extend(entries)
        self.history.event(
            f"{now} read c{self.log.consumer} {len(entries)} {first}-{entries[-1][0]}"
        )

    @property
    def reconnects(self) -> int:
        return self.failovers + self.engine.stats["failovers"]
