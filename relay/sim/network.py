"""A simulated network of FIFO links, one per ordered pair of relays.

Each frame is due at send time + base latency (+ seeded jitter when reordering is on, + a
latency spike when delays are on). A link never lets a frame overtake an earlier one, so a
spike holds back everything behind it; different links interleave freely. Drops,
duplicates (the copy right behind the original) and cut links are applied while the
network is faulty. Time is integer milliseconds.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from relay.core.config import CoreConfig
from relay.core.machine import RelayCore
from relay.sim.faults import FaultConfig


class Subscriber(Protocol):
    """A simulated relay as routing sees it: its configuration and its core (if up)."""

    @property
    def config(self) -> CoreConfig: ...

    @property
    def core(self) -> RelayCore | None: ...

    def listens_to(self, src: int) -> bool:
        """Whether it has a link from relay `src` (its file lists it, or it kept it)."""
        ...


def subscribers(nodes: Mapping[int, Subscriber], src: int, stream: str) -> list[int]:
    """The relays a stream's frames from `src` reach, as the node's subscriptions do
    (relay/node.py): those whose own topology serves the stream, or whose running core
    does (by its configuration: an acceptor record, docs/protocol.md 5.15), and that
    subscribe to `src` at all (`listens_to`)."""
    out = []
    for d, node in nodes.items():
        if d == src or not node.listens_to(src):
            continue
        core = node.core
        if node.config.topology.serves(d, stream) or (core is not None and core.serves(stream)):
            out.append(d)
    return out


# Queued on a link when its sender crashes: the receiver's shell sees the connection close
# after everything sent before it (TCP delivers the FIN after the data). A real frame is
# never empty.
CLOSED = b""


@dataclass
class NetParams:
    base_latency_ms: int = 1
    jitter_ms: int = 0  # uniform extra 0..jitter_ms per frame
    drop_p: float = 0.0
    delay_p: float = 0.0
    delay_ms: tuple[int, int] = (10, 200)
    duplicate_p: float = 0.0

    @classmethod
    def draw(cls, rng: random.Random, faults: FaultConfig) -> NetParams:
        """The seed's network fault intensities for the enabled kinds."""
        params = cls()
        if faults.reorder:
            params.jitter_ms = rng.randint(2, 8)
        if faults.drop:
            params.drop_p = rng.uniform(0.005, 0.08)
        if faults.delay:
            params.delay_p = rng.uniform(0.002, 0.02)
            params.delay_ms = (5, rng.randint(50, 400))
        if faults.duplicate:
            params.duplicate_p = rng.uniform(0.005, 0.05)
        return params


@dataclass
class NetStats:
    sent: int = 0
    delivered: int = 0
    dropped: int = 0
    cut: int = 0
    duplicated: int = 0
    delayed: int = 0
    stale: int = 0  # addressed to a relay that crashed since


class Network:
    def __init__(self, rng: random.Random, params: NetParams, log: list[str] | None = None):
        self.rng = rng
        self.params = params
        self.faulty = True  # drop / delay / duplicate / jitter apply only while True
        self.stats = NetStats()
        self._log = log
        self._heap: list[tuple[int, int, int, int, int, bytes]] = []  # at, n, src, dst, epoch
        self._n = 0
        self._link_last: dict[tuple[int, int], int] = {}
        self._cut: dict[tuple[int, int], int] = {}  # directed link -> number of active cuts

    # --- partitions --------------------------------------------------------------------------

    def cut(self, links: list[tuple[int, int]]) -> None:
        for link in links:
            self._cut[link] = self._cut.get(link, 0) + 1

    def uncut(self, links: list[tuple[int, int]]) -> None:
        for link in links:
            left = self._cut.get(link, 0) - 1
            if left > 0:
                self._cut[link] = left
            else:
                self._cut.pop(link, None)

    def is_cut(self, src: int, dst: int) -> bool:
        return (src, dst) in self._cut

    def heal(self) -> None:
        """End every partition and stop injecting faults (frames in flight still arrive)."""
        self._cut.clear()
        self.faulty = False

    # --- frames ------------------------------------------------------------------------------

    def send(self, now: int, src: int, dst: int, frame: bytes, dst_epoch: int) -> None:
        """Queue `frame` on link src->dst. `dst_epoch` lets the world discard frames that
        were addressed to an incarnation of `dst` that has since crashed."""
        stats = self.stats
        stats.sent += 1
        params = self.params
        if (src, dst) in self._cut:
            stats.cut += 1
            return
        latency = params.base_latency_ms
        if self.faulty:
            rng = self.rng
            if params.drop_p and rng.random() < params.drop_p:
                stats.dropped += 1
                if self._log is not None:
                    self._log.append(f"{now} drop {src}>{dst} {len(frame)}")
                return
            if params.jitter_ms:
                latency += rng.randint(0, params.jitter_ms)
            if params.delay_p and rng.random() < params.delay_p:
                latency += rng.randint(*params.delay_ms)
                stats.delayed += 1
        link = (src, dst)
        at = max(now + latency, self._link_last.get(link, 0))
        self._link_last[link] = at
        self._n += 1
        heapq.heappush(self._heap, (at, self._n, src, dst, dst_epoch, frame))
        if self._log is not None:
            self._log.append(f"{now} send {src}>{dst} @{at} {len(frame)}")
        if self.faulty and params.duplicate_p and self.rng.random() < params.duplicate_p:
            stats.duplicated += 1
            self._n += 1
            heapq.heappush(self._heap, (at, self._n, src, dst, dst_epoch, frame))

    def close(self, now: int, src: int, dst: int, dst_epoch: int) -> None:
        """`src` crashed: queue CLOSED behind its frames on src->dst. Never dropped, but a
        cut link hides it (the receiver only notices the silence)."""
        if (src, dst) in self._cut:
            return
        link = (src, dst)
        at = max(now + self.params.base_latency_ms, self._link_last.get(link, 0))
        self._link_last[link] = at
        self._n += 1
        heapq.heappush(self._heap, (at, self._n, src, dst, dst_epoch, CLOSED))

    def due(self, now: int) -> list[tuple[int, int, int, bytes]]:
        """(src, dst, dst_epoch, frame) of every frame due by `now`, in delivery order;
        frames on links cut meanwhile are dropped."""
        out: list[tuple[int, int, int, bytes]] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, src, dst, epoch, frame = heapq.heappop(heap)
            if (src, dst) in self._cut:
                self.stats.cut += 1
                continue
            out.append((src, dst, epoch, frame))
        return out
