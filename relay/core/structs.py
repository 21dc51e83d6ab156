"""The core's msgspec Structs, in a module that is never compiled (relay/native.py).

A Struct is built in C (about 6x faster than a frozen dataclass), so the values made once
per transaction or frame on every relay are Structs: `Transaction` and the peer messages
(relay.core.messages, not compiled either), and what the core hands its shell,
`ProduceRequest`, `ProduceReply`, `Outgoing`, `Delivery` and `Ready` (re-exported by
relay.core.messages and relay.core.shell, where they belong in the spec).

Compiled by mypyc, a Struct would differ from the same Struct interpreted in two ways.
Compiled code compares instances of a class its own module defines with `==` by identity
(msgspec's stubs do not declare the `__eq__` a Struct has): a Struct compared by value must
therefore be defined here, where compiled code sees a foreign class and compares it as
Python does. And a compiled module drops the keywords of its class statements
(python/mypy#21938): a Struct a compiled module defines derives from `IdentityStruct`,
which sets eq=False here, and is then compared by identity either way.
tests/test_native.py checks every Struct of the compiled modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:  # for the annotations only: relay.core.messages imports this module
    from relay.core.messages import Entry, Outcome

# What Transaction.size_bytes counts besides its producer id, key and value. (Those bytes
# all travel in the frame that carries it: no transaction is larger than that frame plus
# this.)
TX_OVERHEAD_BYTES = 16


class Transaction(msgspec.Struct, frozen=True):
    producer_id: bytes
    producer_seq: int
    key: bytes | None
    value: bytes
    kind: int = 0  # 0: a plain value; others: see relay/store/changes.py (0..MAX_TX_KIND)

    def size_bytes(self) -> int:
        key_bytes = len(self.key) if self.key else 0
        return len(self.producer_id) + len(self.value) + key_bytes + TX_OVERHEAD_BYTES


class ProduceRequest(msgspec.Struct, frozen=True):
    """A client's transaction for `stream`. `request_id` is the shell's own (unique among
    the requests it has in flight): the reply carries it back."""

    request_id: int
    stream: str
    tx: Transaction


class ProduceReply(msgspec.Struct, frozen=True):
    """The outcome of a `ProduceRequest` (docs/protocol.md G3): pass it to the client that
    sent the request. `seq` is set when committed, `reason` when rejected, `redirect` (relay
    ids to try) when fenced."""

    request_id: int
    outcome: Outcome
    seq: int = -1
    reason: str = ""
    redirect: tuple[int, ...] = ()


class IdentityStruct(msgspec.Struct, eq=False):
    """The base of the Structs compiled modules define: mutable; compared and hashed by
    identity."""


class Outgoing(msgspec.Struct, frozen=True):
    """A frame to publish. Exactly one of `stream` (to the stream's other members),
    `target` (to that relay) is set, or neither (to every other relay): see
    `relay.core.shell.recipients`.
    Frames must reach each peer in the order the core returned them (one FIFO link per
    ordered pair of relays); a lost frame is repaired by the protocol."""

    frame: bytes
    stream: str | None = None
    target: int | None = None


class Delivery(msgspec.Struct, frozen=True):
    """Committed entries newly released to consumers of `stream`, in seq order, duplicates
    removed. They follow the previous delivery of the stream with no gap, unless a rebase
    of the stream came in between."""

    stream: str
    entries: tuple[Entry, ...]


class Ready(msgspec.Struct):
    """What the shell must do after the inputs so far, in this order:

    0. `acceptors`: for each (stream, record), keep the record durably as the relay's
       acceptor memory of the stream (replacing the one before), before anything below is
       sent: the relay's answers in a view change count on it (docs/protocol.md 5.12).
       The sink gets them all at once, so that one flush to disk can cover them.
       A shell that keeps no acceptor memory never gets any (see
       `RelayCore.remember_acceptors`);
    1. `outgoing`: publish every frame, in order (`relay.core.shell.recipients` says to
       whom);
    2. `replies`: answer each produce's client;
    3. `rebases`: for each (stream, point), the relay's delivered history of the stream now
       starts after `point` (it took a base: it joined, or its gap was older than every
       member's buffer). Entries between the last one delivered before and `point` are not
       held here: readers positioned in that range must read them elsewhere (the store);
    4. `deliveries`: hand the entries to the stream's consumers (wake parked reads);
    5. `closed`: streams closed because they stayed blank and idle (5.11 closing): the
       shell forgets what it keeps of them (reads parked on one stay: a read or a first
       produce opens it again).
    """

    acceptors: list[tuple[str, bytes]] = msgspec.field(default_factory=list)
    outgoing: list[Outgoing] = msgspec.field(default_factory=list)
    replies: list[ProduceReply] = msgspec.field(default_factory=list)
    deliveries: list[Delivery] = msgspec.field(default_factory=list)
    rebases: list[tuple[str, int]] = msgspec.field(default_factory=list)
    closed: list[str] = msgspec.field(default_factory=list)
