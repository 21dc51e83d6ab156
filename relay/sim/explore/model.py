"""The explored world: three relays serving one stream, their links, clocks and clients, as
an immutable value; how cores are copied in and out of it; and its fingerprint."""

from __future__ import annotations

import hashlib
import io
import pickle
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from relay.core import digest as dg
from relay.core.config import CoreConfig, Limits, Topology
from relay.core.machine import RelayCore
from relay.core.messages import Entry, Report, Transaction
from relay.core.quorum import quorum
from relay.core.state import GENESIS_POINT
from relay.core.timeline import Timeline

STREAM = "s"
RELAYS = (0, 1, 2)
TOPOLOGY_SUBSCRIPTIONS: dict[int, tuple[str, ...]] = {r: (STREAM,) for r in RELAYS}
LINKS: tuple[tuple[int, int], ...] = tuple((a, b) for a in RELAYS for b in RELAYS if a != b)
LINK_INDEX = {link: i for i, link in enumerate(LINKS)}
START_UNIX_MS = 1_750_000_000_000
REQUEST_BASE = 100  # request id of transaction k is REQUEST_BASE + k
Q = quorum(len(RELAYS))

# TXS[2] retries TXS[0] (same producer id and producer seq, same payload): dedupe.
TXS: tuple[Transaction, ...] = (
    Transaction(b"p0", 1, None, b"a"),
    Transaction(b"p1", 1, None, b"b"),
    Transaction(b"p0", 1, None, b"a"),
)

# Small timeouts so suspicion, fencing, repair retries and `unknown` fit in a few ticks.
EXPLORE_LIMITS = Limits(
    heartbeat_interval_ms=20,
    suspect_timeout_ms=40,
    produce_timeout_ms=50,
    repair_retry_ms=30,
    repair_grace_ms=20,
    checkpoint_interval_ms=10,
)

Action = tuple[Any, ...]  # ("produce", k, r) | ("deliver"|"drop"|"dup", link) | ("tick", r)


@dataclass
class Bounds:
    """How far the search may go on one path (see run_explore)."""

    max_ticks: int
    tick_ms: int
    max_skew_ticks: int
    max_drops: int
    max_dups: int
    max_clock_steps: int = 0
    clock_step_ms: int = 25


class CoreInfo(NamedTuple):
    """What the checks need of one core, extracted once when its snapshot is taken."""

    committed_point: int
    committed_digest: bytes
    reported: int
    floor: int
    base_point: int
    base_digest: bytes
    known_commit: tuple[int, bytes]
    committed: tuple[tuple[int, Transaction, bytes, bool], ...]  # seq, tx, digest, skipped
    held: tuple[Entry, ...]  # every held entry and every late one
    reports: tuple[Report, ...]  # the relay's report log (every report it sent)
    fenced: bool
    counters: frozenset[str]
    view: tuple[int, int] = (0, -1)  # the view's number and start (5.12)


class CoreSnap(NamedTuple):
    blob: bytes  # the pickled core, its configuration by reference (Context.freeze)
    fp: bytes  # blake2b of the blob
    info: CoreInfo


class World(NamedTuple):
    cores: tuple[CoreSnap, ...]
    links: tuple[tuple[bytes, ...], ...]  # LINKS order, head first
    now: tuple[int, ...]
    ticks: tuple[int, ...]
    drops: int
    dups: int
    produced: tuple[tuple[int, int] | None, ...]  # per tx: (relay, copy seq or -1)
    replies: tuple[tuple[tuple[str, int], ...], ...]  # per tx: (outcome, seq) answers
    delivered: tuple[tuple[Entry, ...], ...]  # per relay: what its consumers received
    last_report: tuple[int, ...]  # per relay: highest point it reported
    floor_sent: tuple[int, ...]  # per relay: highest floor it announced
    rebases: int = 0  # delivered histories restarted after a point (Ready.rebases)
    # per relay: highest votes_final_through it announced (it promised never to report at
    # or below it again)
    final_sent: tuple[int, ...] = (-1, -1, -1)
    skew: tuple[int, ...] = (0, 0, 0)  # per relay: wall clock minus monotonic clock (ms)
    steps: int = 0  # wall clock steps taken


def world_fingerprint(w: World) -> bytes:
    rest = (
        w.rebases,
        w.links,
        w.now,
        w.ticks,
        w.drops,
        w.dups,
        w.produced,
        w.replies,
        w.delivered,
        w.last_report,
        w.floor_sent,
        w.final_sent,
        w.skew,
        w.steps,
    )
    hsh = hashlib.blake2b(digest_size=16)
    for c in w.cores:
        hsh.update(c.fp)
    hsh.update(repr(rest).encode())
    return hsh.digest()


class Context:
    """What every state shares: the configuration, the core class, and the prefix behind
    each reported digest."""

    def __init__(self, limits: Limits, core_class: type[RelayCore] = RelayCore) -> None:
        self.core_class = core_class
        self.topology = Topology(dict(TOPOLOGY_SUBSCRIPTIONS))
        self.configs = [CoreConfig(r, self.topology, limits) for r in RELAYS]
        self.limits = limits
        # The configuration every state shares is pickled as a reference into _SHARED
        # (chosen by type, in the pickler's C code: no call per other object pickled).
        for shared in (self.topology, limits, *self.configs):
            _SHARED[id(shared)] = shared
        self._detach: dict[type, Callable[[Any], Any]] = {
            kind: _by_reference for kind in (CoreConfig, Limits, Topology)
        }
        self.max_frame = limits.max_frame_bytes
        # chain digest -> the prefix (entries above genesis) it stands for. A pure function
        # of the digest (xxh3-128 collisions aside), so it lives outside the states.
        self.prefix_of: dict[bytes, tuple[Entry, ...]] = {dg.genesis(STREAM): ()}

    def remember_prefix(self, tl: Timeline, point: int, digest: bytes) -> None:
        if tl.base_point != GENESIS_POINT or digest in self.prefix_of:
            return
        h = tl.head
        entries = tuple((s, t) for s, t in zip(tl.seqs[h:], tl.txs[h:], strict=True) if s <= point)
        self.prefix_of[digest] = entries

    def thaw(self, snap: CoreSnap, rid: int) -> RelayCore:
        core: RelayCore = pickle.loads(snap.blob)
        return core

    def freeze(self, core: RelayCore, info: CoreInfo) -> CoreSnap:
        """Pickle the core with its (shared, constant) configuration by reference and
        without its counters (never read by the protocol; `info.counters` keeps their
        names for coverage). The core object must not be used afterwards."""
        core.counters = Counter()
        out = io.BytesIO()
        pickler = pickle.Pickler(out, pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = self._detach
        pickler.dump(core)
        blob = out.getvalue()
        return CoreSnap(blob, hashlib.blake2b(blob, digest_size=16).digest(), info)


# What the states of every Context share, by id (held here, so no id is reused): a pickled
# core names its configuration by this key instead of holding a copy.
_SHARED: dict[int, object] = {}


def _shared(key: int) -> object:
    return _SHARED[key]


def _by_reference(shared: object) -> tuple[Callable[[int], object], tuple[int]]:
    return _shared, (id(shared),)
