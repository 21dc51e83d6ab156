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

from dataclasses import dataclass
from typing import Protocol

from relay.core.config import Topology
from relay.core.messages import Entry, ReadStatus

# What passes between the core and its shell once per transaction or frame: msgspec Structs,
# defined with the core's other Structs (relay/core/structs.py says why); `Ready` says what
# a shell must do with the core's output, in which order.
from relay.core.structs import Delivery as Delivery
from relay.core.structs import Outgoing as Outgoing
from relay.core.structs import ProduceReply as ProduceReply
from relay.core.structs import ProduceRequest as ProduceRequest
from relay.core.structs import Ready as Ready

# The longest a core that took input may wait for its tick. Ticking after every input cost
# a busy relay most of its turns' time (a tick looks at every timer of every stream in
# use); the timers next_deadline_ms does not name (fencing, suspicion, joins, repairs,
# view changes) then run at most this much later than they used to.
FED_TICK_MS = 5
NO_FED_TICK = 1 << 62  # a shell's mark: no input waits for a tick


@dataclass(frozen=True, slots=True)
class ReadResult:
    """A read's answer: `entries` after the position asked for (status OK), or why not
    (`redirect`: members to try instead)."""

    status: ReadStatus
    entries: tuple[Entry, ...] = ()
    redirect: tuple[int, ...] = ()
    oldest: int = -1  # lowest position `after_seq` that can still be read
    committed: int = -1  # the relay's committed point for the stream


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

    def closed(self, stream: str) -> None: ...


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
    for stream in ready.closed:
        sink.closed(stream)
    return ready
