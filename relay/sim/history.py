"""What the clients observed and what the relays delivered, recorded as plain data.

A `History` is all the checkers see. The world fills it; tests build bad ones by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash

from relay.core.messages import Transaction

# Outcomes of one produce attempt as the producer saw it: the relay's answer (an Outcome
# value), CRASHED (its connection closed first), or None (no answer by the end).
COMMITTED = "committed"
REJECTED = "rejected"
UNKNOWN = "unknown"
FENCED = "fenced"
CRASHED = "crashed"  # the relay died with the attempt pending

DelivEntry = tuple[int, Transaction]  # (seq, tx)
OpKey = tuple[bytes, int]  # (producer_id, producer_seq)


@dataclass
class Attempt:
    pid: bytes
    pseq: int
    stream: str
    tx: Transaction
    relay: int
    incarnation: int
    request_id: int
    sent_ms: int
    outcome: str | None = None  # None: never answered
    seq: int = -1
    reason: str = ""
    answer_ms: int = -1


@dataclass
class Final:
    """The final outcome of one (producer_id, producer_seq)."""

    pid: bytes
    pseq: int
    stream: str
    tx: Transaction
    issued_ms: int
    outcome: str  # COMMITTED, REJECTED or UNKNOWN
    seq: int = -1
    committed_seqs: list[int] = field(default_factory=list)  # every committed answer's seq
    # What the client engine concluded from the answers: COMMITTED (at client_seq),
    # REJECTED (final), UNKNOWN (it may still commit), "" (still trying when the run ended)
    client_outcome: str = ""
    client_seq: int = -1


@dataclass
class FenceSample:
    t: int
    relay: int
    incarnation: int
    stream: str
    fenced: bool
    joined: bool


@dataclass
class RelayFinal:
    """A relay's state when the run ended."""

    relay: int
    incarnation: int
    up: bool  # not crashed and not paused
    restarts: int = 0  # how often it crashed and came back (0: holds its whole history)
    joined: dict[str, bool] = field(default_factory=dict)  # member streams only
    fenced: dict[str, bool] = field(default_factory=dict)
    committed_point: dict[str, int] = field(default_factory=dict)
    # why nothing commits through it ("": nothing holds it) and the relays it waits for
    stall: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    # 5.15, every stream of the run: the configuration (version, relays) the relay runs it
    # under (version 0: provisional, not established; relays without this one: it learnt
    # one that leaves it out), and the relays its own topology file names for it
    config: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    topology: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class ConsumerLog:
    consumer: int
    stream: str
    received: list[DelivEntry] = field(default_factory=list)


@dataclass
class PhaseInfo:
    """When the phases ended (simulated ms) and what the liveness checks expect."""

    safety_end_ms: int
    liveness_end_ms: int
    heal_bound_ms: int = 2_000  # relays must be joined and unfenced this long after healing
    # Right after healing, suspicion timers from the fault phase still run out, and a
    # transaction may be definitely rejected as late; after this window, all must commit.
    settle_ms: int = 500
    check_liveness: bool = True


@dataclass
class History:
    # stream -> relays: the seed's topology's (most relays' file; 5.15: the configuration
    # the run establishes, unless a relay with another file blocked it)
    members: dict[str, tuple[int, ...]] = field(default_factory=dict)
    produced: dict[OpKey, tuple[str, Transaction]] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)
    finals: dict[OpKey, Final] = field(default_factory=dict)
    # (relay, incarnation) -> stream -> delivered entries, in the order ready() gave them
    delivered: dict[tuple[int, int], dict[str, list[DelivEntry]]] = field(default_factory=dict)
    consumers: dict[int, ConsumerLog] = field(default_factory=dict)
    fence_samples: list[FenceSample] = field(default_factory=list)
    relay_finals: dict[int, RelayFinal] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    # (relay, incarnation, stream) -> positions in the delivered log where the relay's
    # history restarted from a base (it joined, or its gap was older than every buffer):
    # the entries on either side need not be neighbours in the timeline.
    rebases: dict[tuple[int, int, str], list[int]] = field(default_factory=dict)
    # protocol misbehaviour seen by the harness itself (e.g. two different answers to one
    # request); check_all reports each
    anomalies: list[str] = field(default_factory=list)
    # relay -> stream -> the seqs its spool took, over all its incarnations (5.14)
    spooled: dict[int, dict[str, set[int]]] = field(default_factory=dict)

    # --- recording helpers ---------------------------------------------------------------

    def event(self, text: str) -> None:
        self.events.append(text)

    def record_delivery(
        self, relay: int, incarnation: int, stream: str, entries: tuple[DelivEntry, ...]
    ) -> None:
        per_stream = self.delivered.setdefault((relay, incarnation), {})
        per_stream.setdefault(stream, []).extend(entries)

    def record_rebase(self, relay: int, incarnation: int, stream: str) -> None:
        position = len(self.log_for(relay, incarnation, stream))
        self.rebases.setdefault((relay, incarnation, stream), []).append(position)

    def log_since_rebase(self, relay: int, incarnation: int, stream: str) -> list[DelivEntry]:
        """The part of a relay's log delivered since its history last restarted."""
        log = self.log_for(relay, incarnation, stream)
        positions = self.rebases.get((relay, incarnation, stream))
        return log[positions[-1] :] if positions else log

    def log_for(self, relay: int, incarnation: int, stream: str) -> list[DelivEntry]:
        return self.delivered.get((relay, incarnation), {}).get(stream, [])


def event_hash(events: list[str]) -> str:
    """A digest of an event log: two runs of one seed must give the same value."""
    h = xxhash.xxh3_128()
    for line in events:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


def final_outcome(attempts: list[Attempt]) -> tuple[str, int, list[int]]:
    """(outcome, seq, committed seqs) from every attempt of one (pid, pseq).

    COMMITTED if any attempt was answered committed; REJECTED only if every attempt was
    answered rejected or fenced (both say: not accepted); else UNKNOWN.
    """
    committed = [a.seq for a in attempts if a.outcome == COMMITTED]
    if committed:
        return COMMITTED, committed[0], committed
    if attempts and all(a.outcome in (REJECTED, FENCED) for a in attempts):
        return REJECTED, -1, []
    return UNKNOWN, -1, []
