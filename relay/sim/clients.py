"""Simulated producers and consumers.

Clients talk to relays through a `ClientPort` (the world). Producers retry a transaction
with the same producer sequence until some relay gives a definite answer; consumers follow
one stream and resume after their last seen sequence number whenever they move.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Protocol

from relay.core.messages import Outcome, ReadStatus, Transaction
from relay.core.shell import ProduceReply, ReadResult
from relay.sim.history import (
    COMMITTED,
    CRASHED,
    FENCED,
    REJECTED,
    TIMEOUT,
    UNKNOWN,
    Attempt,
    ConsumerLog,
    Final,
    History,
    final_outcome,
)

CLIENT_TIMEOUT_MS = 3_000
READ_BATCH = 64
STALL_MS = 200  # a consumer whose relay is paused this long moves elsewhere


class ClientPort(Protocol):
    now: int

    def relay_ids(self) -> tuple[int, ...]: ...

    def alive(self, relay: int) -> bool:
        """Not crashed (a paused relay is alive: clients cannot tell it is paused)."""

    def paused(self, relay: int) -> bool: ...

    def submit(self, relay: int, stream: str, tx: Transaction) -> tuple[int, int]:
        """Hand a produce to `relay`; returns (incarnation, request_id)."""

    def read(self, relay: int, stream: str, after_seq: int, max_entries: int) -> ReadResult: ...


@dataclass
class Op:
    pid: bytes
    pseq: int
    stream: str
    tx: Transaction
    issued_ms: int
    attempts: list[Attempt] = field(default_factory=list)
    current: Attempt | None = None
    retry_at: int = -1  # when to send the next attempt (-1: none scheduled)
    prefer: tuple[int, ...] = ()  # relays suggested by a redirect
    done: bool = False
    token: int = 0  # bumped at every state change; older wake-ups are ignored


def _pick(rng: random.Random, port: ClientPort, prefer: tuple[int, ...], avoid: int) -> int:
    alive = [r for r in port.relay_ids() if port.alive(r)]
    preferred = [r for r in prefer if r in alive and r != avoid]
    if preferred:
        return rng.choice(preferred)
    others = [r for r in alive if r != avoid]
    if others:
        return rng.choice(others)
    return rng.choice(alive) if alive else rng.choice(port.relay_ids())


class Producer:
    def __init__(
        self,
        index: int,
        rng: random.Random,
        streams: tuple[str, ...],
        history: History,
        interval_ms: tuple[int, int] = (15, 60),
        client_timeout_ms: int = CLIENT_TIMEOUT_MS,
    ) -> None:
        self.index = index
        self.pid = b"prod-%d" % index
        self.rng = rng
        self.streams = streams
        self.history = history
        self.interval_ms = interval_ms
        self.client_timeout_ms = client_timeout_ms
        self.next_pseq = 1
        self.next_issue = rng.randint(0, interval_ms[1])
        self.issuing = True
        self.retrying = True
        self.open: dict[int, Op] = {}  # pseq -> op, in issue order
        self.ops: list[Op] = []
        self.by_request: dict[int, Attempt] = {}
        self._wake: list[tuple[int, int, int]] = []  # (when, pseq, token): timeout or retry

    # --- driving -----------------------------------------------------------------------------

    def step(self, port: ClientPort) -> None:
        now = port.now
        if self.issuing and now >= self.next_issue:
            self.next_issue = now + self.rng.randint(*self.interval_ms)
            self._issue(port)
        wake = self._wake
        while self.retrying and wake and wake[0][0] <= now:
            _, pseq, token = heapq.heappop(wake)
            op = self.open.get(pseq)
            if op is None or op.token != token:
                continue  # stale wake-up: the op moved on since
            cur = op.current
            if cur is not None:
                cur.outcome = TIMEOUT
                self.history.event(f"{now} timeout {self.pid.decode()}#{op.pseq} r{cur.relay}")
                self._schedule(op, now + self.rng.randint(1, 20), ())
            else:
                self._attempt(op, port)

    def _issue(self, port: ClientPort) -> None:
        rng = self.rng
        pseq = self.next_pseq
        self.next_pseq += 1
        stream = rng.choice(self.streams)
        key = None if rng.random() < 0.3 else b"k%d" % rng.randint(0, 7)
        value = b"%s:%d:" % (self.pid, pseq) + rng.randbytes(rng.randint(0, 24))
        tx = Transaction(self.pid, pseq, key, value)
        self.history.produced[(self.pid, pseq)] = (stream, tx)
        op = Op(self.pid, pseq, stream, tx, port.now)
        self.open[pseq] = op
        self.ops.append(op)
        self._attempt(op, port)

    def _attempt(self, op: Op, port: ClientPort) -> None:
        last = op.attempts[-1].relay if op.attempts else -1
        relay = _pick(self.rng, port, op.prefer, last)
        incarnation, request_id = port.submit(relay, op.stream, op.tx)
        attempt = Attempt(
            op.pid, op.pseq, op.stream, op.tx, relay, incarnation, request_id, port.now
        )
        op.attempts.append(attempt)
        self.by_request[request_id] = attempt
        self.history.attempts.append(attempt)
        op.current = attempt
        op.retry_at = -1
        op.prefer = ()
        op.token += 1
        heapq.heappush(self._wake, (port.now + self.client_timeout_ms, op.pseq, op.token))
        self.history.event(
            f"{port.now} produce {self.pid.decode()}#{op.pseq} {op.stream} r{relay} q{request_id}"
        )

    def _schedule(self, op: Op, at: int, prefer: tuple[int, ...]) -> None:
        op.current = None
        op.retry_at = at
        op.prefer = prefer
        op.token += 1
        heapq.heappush(self._wake, (at, op.pseq, op.token))

    # --- answers -----------------------------------------------------------------------------

    def on_reply(self, reply: ProduceReply, now: int) -> None:
        attempt = self.by_request.get(reply.request_id)
        if attempt is None:
            self.history.anomalies.append(
                f"{now} ms: reply to unknown request {reply.request_id} at {self.pid.decode()}"
            )
            return
        outcome = {
            Outcome.COMMITTED: COMMITTED,
            Outcome.REJECTED: REJECTED,
            Outcome.UNKNOWN: UNKNOWN,
            Outcome.FENCED: FENCED,
        }[reply.outcome]
        if attempt.answer_ms >= 0 and attempt.outcome in (COMMITTED, REJECTED, FENCED, UNKNOWN):
            if attempt.outcome in (COMMITTED, REJECTED) and (
                outcome != attempt.outcome or reply.seq != attempt.seq
            ):
                self.history.anomalies.append(
                    f"{now} ms: request {reply.request_id} ({self.pid.decode()}#{attempt.pseq}) "
                    f"answered {attempt.outcome} {attempt.seq} then {outcome} {reply.seq}"
                )
            if attempt.outcome == COMMITTED:
                return  # keep the committed answer
        attempt.outcome = outcome
        attempt.seq = reply.seq if outcome == COMMITTED else -1
        attempt.reason = reply.reason
        attempt.answer_ms = now
        self.history.event(
            f"{now} answer {self.pid.decode()}#{attempt.pseq} r{attempt.relay} {outcome} "
            f"{reply.seq} {reply.reason}"
        )
        op = self.open.get(attempt.pseq)
        if op is None or op.current is not attempt:
            return  # a late answer to an attempt already given up on: recorded, no action
        if outcome in (COMMITTED, REJECTED):
            op.current = None
            op.done = True
            op.token += 1
            del self.open[op.pseq]
        elif outcome == FENCED:
            self._schedule(op, now + self.rng.randint(5, 50), tuple(reply.redirect))
        else:
            self._schedule(op, now + self.rng.randint(1, 20), ())

    def on_crash(self, relay: int, incarnation: int, now: int) -> None:
        for op in self.open.values():
            cur = op.current
            if cur is not None and cur.relay == relay and cur.incarnation == incarnation:
                cur.outcome = CRASHED
                cur.answer_ms = now
                self._schedule(op, now + self.rng.randint(1, 20), ())

    def finals(self) -> list[Final]:
        out = []
        for op in self.ops:
            outcome, seq, committed = final_outcome(op.attempts)
            out.append(
                Final(op.pid, op.pseq, op.stream, op.tx, op.issued_ms, outcome, seq, committed)
            )
        return out


class Consumer:
    def __init__(
        self,
        cid: int,
        stream: str,
        rng: random.Random,
        relay: int,
        history: History,
        read_every_ms: tuple[int, int] = (2, 15),
        disconnect_p: float = 0.005,
    ) -> None:
        self.cid = cid
        self.stream = stream
        self.rng = rng
        self.relay = relay
        self.read_every_ms = read_every_ms
        self.disconnect_p = disconnect_p
        self.last_seq = -1
        self.next_read = rng.randint(0, read_every_ms[1])
        self.stalled_since = -1
        self.reconnects = 0
        self.history = history
        self.log = ConsumerLog(cid, stream)
        history.consumers[cid] = self.log

    def step(self, port: ClientPort) -> None:
        now = port.now
        if now < self.next_read:
            return
        self.next_read = now + self.rng.randint(*self.read_every_ms)
        if self.rng.random() < self.disconnect_p:
            self._move(port, (), "disconnect")
            return
        if not port.alive(self.relay):
            self._move(port, (), "crashed")
            return
        if port.paused(self.relay):
            if self.stalled_since < 0:
                self.stalled_since = now
            elif now - self.stalled_since >= STALL_MS:
                self._move(port, (), "stalled")
            return
        self.stalled_since = -1
        result = port.read(self.relay, self.stream, self.last_seq, READ_BATCH)
        if result.status is ReadStatus.OK:
            if result.entries:
                self.log.received.extend(result.entries)
                self.last_seq = max(self.last_seq, result.entries[-1][0])
                self.history.event(
                    f"{now} read c{self.cid} r{self.relay} {len(result.entries)} "
                    f"{result.entries[0][0]}-{result.entries[-1][0]}"
                )
            return
        self._move(port, tuple(result.redirect), result.status.value)

    def _move(self, port: ClientPort, prefer: tuple[int, ...], why: str) -> None:
        old = self.relay
        self.relay = _pick(self.rng, port, prefer, old)
        self.stalled_since = -1
        self.reconnects += 1
        self.history.event(f"{port.now} reconnect c{self.cid} {old}>{self.relay} {why}")
