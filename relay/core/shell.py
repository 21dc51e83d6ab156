"""The contract between the core and the shell that runs it (the ZeroMQ node, the simulator,
the scenario interpreter, the explorer).

The core never does I/O. The shell feeds it inputs and acts on what it returns:

1. Inputs, each with the wall clock (Unix ms: sequence numbers, the skew check) and the
   monotonic clock (ms: every timer):
   - `RelayCore.receive(frame, ...)`: a frame a peer published (the whole frame, topic
     removed). The core validates it and never raises.
   - `RelayCore.peer_lost(relay_id, ...)`: the connection to a peer closed.
   - `RelayCore.produce(ProduceRequest, ...)`: a client's transaction. Exactly one
     `ProduceReply` with the same `request_id` comes back in some later `Ready`.
   - `RelayCore.tick(...)`: time passed; call it by `RelayCore.next_deadline_ms()` (the
     monotonic ms of the next timer) at the latest, and within FED_TICK_MS of any input
     (what an input sends, answers and delivers comes out of the next `ready()`; a tick
     looks at the timers `next_deadline_ms` does not name, e.g. a view change an input
     made possible). Ticking more often is allowed, only slower.
   - `RelayCore.read(...)`: a consumer's read; answered at once (`ReadResult`).
2. After any inputs, `RelayCore.ready()` returns a `Ready`: what to do now. `drain` below
   does it in the required order for any shell. The core has already forgotten what it
   returned: acting on it is the shell's job alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from relay.core.config import Topology
from relay.core.messages import Entry, ReadStatus

# A produce and its answer (msgspec Structs, defined with the core's other Structs)
from relay.core.structs import ProduceReply as ProduceReply
from relay.core.structs import ProduceRequest as ProduceRequest

# The longest a core that took input may wait for its tick. Ticking after every input cost
# a busy relay most of its turns' time (a tick looks at every timer of every stream in
# use); the timers next_deadline_ms does not name (fencing, suspicion, joins, repairs,
# view changes) then run at most this much later than they used to.
FED_TICK_MS = 5
NO_FED_TICK = 1 << 62  # a shell's mark: no input waits for a tick


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A frame to publish. Exactly one of `stream` (to the stream's other members),
    `target` (to that relay) is set, or neither (to every other relay): see `recipients`.
    Frames must reach each peer in the order the core returned them (one FIFO link per
    ordered pair of relays); a lost frame is repaired by the protocol."""

    frame: bytes
    stream: str | None = None
    target: int | None = None


@dataclass(frozen=True, slots=True)
class Delivery:
    """Committed entries newly released to consumers of `stream`, in seq order, duplicates
    removed. They follow the previous delivery of the stream with no gap, unless a rebase
    of the stream came in between."""

    stream: str
    entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True)
class ReadResult:
    """A read's answer: `entries` after the position asked for (status OK), or why not
    (`redirect`: members to try instead)."""

    status: ReadStatus
    entries: tuple[Entry, ...] = ()
    redirect: tuple[int, ...] = ()
    oldest: int = -1  # lowest position `after_seq` that can still be read
    committed: int = -1  # the relay's committed point for the stream


@dataclass
class Ready:
    """What the shell must do after the inputs so far, in this order:

    0. `acceptors`: for each (stream, record), keep the record durably as the relay's
       acceptor memory of the stream (replacing the one before), before anything below is
       sent: the relay's answers in a view change count on it (docs/protocol.md 5.12).
       The sink gets them all at once, so that one flush to disk can cover them.
       A shell that keeps no acceptor memory never gets any (see
       `RelayCore.remember_acceptors`);
    1. `outgoing`: publish every frame, in order (`recipients` says to whom);
    2. `replies`: answer each produce's client;
    3. `rebases`: for each (stream, point), the relay's delivered history of the stream now
       starts after `point` (it took a base: it joined, or its gap was older than every
       member's buffer). Entries between the last one delivered before and `point` are not
       held here: readers positioned in that range must read them elsewhere (the store);
    4. `deliveries`: hand the entries to the stream's consumers (wake parked reads).
    """

    acceptors: list[tuple[str, bytes]] = field(default_factory=list)
    outgoing: list[Outgoing] = field(default_factory=list)
    replies: list[ProduceReply] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    rebases: list[tuple[str, int]] = field(default_factory=list)


def recipients(out: Outgoing, topology: Topology, sender: int) -> tuple[int, ...]:
    """The relays that must receive `out` from `sender`, ascending: the stream's other
    members, the target, or every other relay. (The ZeroMQ node lets topics do this: each
    relay subscribes to the streams it serves, its own id and heartbeats.)"""
    if out.stream is not None:
        return tuple(r for r in topology.members(out.stream) if r != sender)
    if out.target is not None:
        return (out.target,)
    return tuple(r for r in topology.relay_ids if r != sender)


class Sink(Protocol):
    """Where a shell puts what `Ready` asks for."""

    def persist(self, records: list[tuple[str, bytes]]) -> None: ...

    def publish(self, out: Outgoing) -> None: ...

    def answer(self, replies: list[ProduceReply]) -> None: ...

    def rebase(self, stream: str, point: int) -> None: ...

    def deliver(self, delivery: Delivery) -> None: ...


class HasReady(Protocol):
    def ready(self) -> Ready: ...


def drain(core: HasReady, sink: Sink) -> Ready:
    """Take the core's `ready()` and act on it in the contract's order; returns it."""
    ready = core.ready()
    if ready.acceptors:
        sink.persist(ready.acceptors)
    for out in ready.outgoing:
        sink.publish(out)
    if ready.replies:
        sink.answer(ready.replies)
    for stream, point in ready.rebases:
        sink.rebase(stream, point)
    for delivery in ready.deliveries:
        sink.deliver(delivery)
    return ready
