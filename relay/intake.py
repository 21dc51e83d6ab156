"""Client requests a relay has read from its ROUTER but not served yet, queued per client.

libzmq queues every request a connection sends until the relay reads it: the client
ROUTER has no receive mark (relay/node.py says why). Served in arrival order, a client
that sends faster than the relay serves makes that queue grow without end, holds every
other client's requests behind its own, and keeps the relay busy after it has gone (16
million reads queued in 20 s took 4 min 15 s to answer to a closed connection).

So the node reads what arrived into an `Intake`, ahead of serving it, and serves the
clients in turn: one request of each client per round, the rounds going on from turn
to turn where the last stopped. A client is its name with CurveZMQ (all its connections
together), else one connection. A client that has more than `max_queued` requests read
and not served is flooding: `add` says so, the node cuts its connections and drops what
they queued (`drop`), so neither the queue nor the time spent on it grows with how fast
a client can send. A library client never comes near: its window bounds what it has in
flight, and a window's transactions travel in batch frames.

Nothing here touches a socket or a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Intake"]

Request = TypeVar("Request")


class Intake(Generic[Request]):
    """Requests per client (any hashable key), served round-robin across clients."""

    def __init__(self, max_queued: int) -> None:
        if max_queued <= 0:
            raise ValueError(f"max_queued must be positive, got {max_queued}")
        self.max_queued = max_queued
        # Insertion order is the order of the round: `take` serves the first client and
        # moves it to the end while it has more.
        self._queues: dict[Hashable, deque[Request]] = {}
        self._queued = 0

    def __len__(self) -> int:
        """Requests queued, of every client."""
        return self._queued

    def queued(self, client: Hashable) -> int:
        held = self._queues.get(client)
        return 0 if held is None else len(held)

    def add(self, client: Hashable, request: Request) -> bool:
        """Queue a request; False if `client` now has more than `max_queued` queued
        (it is flooding: the request is queued anyway, for `drop` to hand back)."""
        held = self._queues.get(client)
        if held is None:
            held = self._queues[client] = deque()
        held.append(request)
        self._queued += 1
        return len(held) <= self.max_queued

    def take(self) -> tuple[Hashable, Request] | None:
        """The next request to serve, of the client whose turn it is (None: nothing)."""
        queues = self._queues
        if not queues:
            return None
        client = next(iter(queues))
        held = queues.pop(client)
        request = held.popleft()
        self._queued -= 1
        if held:
            queues[client] = held  # to the end of the round
        return client, request

    def drop(self, client: Hashable) -> list[Request]:
        """Forget every request `client` has queued, and hand them back (oldest first)."""
        held = self._queues.pop(client, None)
        if held is None:
            return []
        self._queued -= len(held)
        assert self._queued >= 0, self._queued
        return list(held)
