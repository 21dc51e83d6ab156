"""The explored world: three relays and the topologies they read (`SETUPS`), their links,
clocks and clients, as an immutable value; how cores are copied in and out of it; where a
frame goes (`Context.receivers`); and its fingerprint."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import pickle
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from relay.core import digest as dg
from relay.core.config import CoreConfig, Limits, Topology
from relay.core.machine import RelayCore
from relay.core.messages import Entry, Report, Transaction
from relay.core.shell import Outgoing, recipients
from relay.core.state import GENESIS_POINT, Configuration
from relay.core.timeline import Timeline

STREAM = "s"
RELAYS = (0, 1, 2)
TOPOLOGY_SUBSCRIPTIONS: dict[int, tuple[str, ...]] = {r: (STREAM,) for r in RELAYS}
# "stale": relays 0 and 1 read a file in which only they serve "s" (a pattern's stream,
# opened on first use); relay 2 reads one in which all three do (its own stream "t", named,
# is opened at start).
OTHER_STREAM = "t"
STALE_SUBSCRIPTIONS: dict[int, tuple[str, ...]] = {0: ("s*",), 1: ("s*",), 2: (OTHER_STREAM,)}
FULL_SUBSCRIPTIONS: dict[int, tuple[str, ...]] = {0: ("s*",), 1: ("s*",), 2: ("s*", OTHER_STREAM)}
PATTERN_SUBSCRIPTIONS: dict[int, tuple[str, ...]] = {r: ("s*",) for r in RELAYS}
LINKS: tuple[tuple[int, int], ...] = tuple((a, b) for a in RELAYS for b in RELAYS if a != b)
LINK_INDEX = {link: i for i, link in enumerate(LINKS)}
START_UNIX_MS = 1_750_000_000_000
REQUEST_BASE = 100  # request id of transaction k is REQUEST_BASE + k
NO_RELOADS = (False,) * len(RELAYS)


# "change": all three read TOPOLOGY_SUBSCRIPTIONS at start (the stream is established on
# relays 0-2), then each reads, once, a file in which relays 0 and 1 alone serve "s" (relay 2
# keeps only a pattern no stream matches: a file names at least one stream per relay).
CHANGED_SUBSCRIPTIONS: dict[int, tuple[str, ...]] = {0: (STREAM,), 1: (STREAM,), 2: ("t*",)}


class Setup(NamedTuple):
    """What the relays read and what may come of it: each relay's topology file, the
    configurations of STREAM (5.15) that can be established, in version order (each the
    change of the one before), and the file each relay reads while it runs (the explored
    action `reload r`), if any."""

    subscriptions: tuple[dict[int, tuple[str, ...]], ...]  # per relay: its topology's
    established: tuple[Configuration, ...]
    reloads: tuple[dict[int, tuple[str, ...]], ...] | None = None  # per relay
    # the stream opens on its first use (a pattern's), not established at start
    opened_by_use: bool = False
    # transaction k > 0 waits until every relay ticked k * (max_ticks // transactions)
    # times (Bounds.produce_gap_ticks), so that some come after the configuration changed
    spread_produces: bool = False
    # the relay whose reader reads the stream throughout the prefix (None: no reader):
    # it opens the stream everywhere (its join), and the others close it again (5.11)
    reader: int | None = None
    # limits of the setup itself, over the explorer's (Limits field -> value)
    limits: tuple[tuple[str, int], ...] = ()
    # a relay reads its new file only once it ticked this many times: first views are
    # proposed and accepted before (at any time, depth first would read every file first)
    reload_after_ticks: int = 0
    # keep every acceptance made (World.acceptances) and check that no instance decides two
    # values: where files differ or change, an instance may decide a value nobody learns,
    # which the other checks cannot see
    check_agreement: bool = False


SETUPS: dict[str, Setup] = {
    # One shared topology; the start state has established the configuration already.
    "same": Setup((TOPOLOGY_SUBSCRIPTIONS,) * len(RELAYS), ((1, RELAYS),)),
    # Relay 2's file disagrees: the first view, decided by every relay of its proposer's
    # configuration, can only establish relays 0 and 1.
    "stale": Setup(
        (STALE_SUBSCRIPTIONS, STALE_SUBSCRIPTIONS, FULL_SUBSCRIPTIONS),
        ((1, (0, 1)),),
        opened_by_use=True,
        spread_produces=True,
        check_agreement=True,
    ),
    # Established on relays 0-2 at start; every relay then reads a file that takes relay 2
    # off the stream: the mesh changes it to relays 0-1 (version 2) once the files agree.
    "change": Setup(
        (TOPOLOGY_SUBSCRIPTIONS,) * len(RELAYS),
        ((1, RELAYS), (2, (0, 1))),
        reloads=(CHANGED_SUBSCRIPTIONS,) * len(RELAYS),
        spread_produces=True,
        check_agreement=True,
    ),
    # Relays 0 and 1 serve "s" alone at start (relay 2 only "t"); each relay then reads,
    # as an explored action, the file in which all three serve it: first views of relays
    # 0-1 accepted, or decided, before the files moved meet proposals of relays 0-2
    # (5.15 establishment). Either may be established, then changed to relays 0-2.
    "refile": Setup(
        (STALE_SUBSCRIPTIONS,) * len(RELAYS),
        ((1, (0, 1)), (1, RELAYS), (2, RELAYS)),
        reloads=(FULL_SUBSCRIPTIONS,) * len(RELAYS),
        opened_by_use=True,
        spread_produces=True,
        reload_after_ticks=8,
        check_agreement=True,
    ),
    # One shared file serving "s" as a pattern's stream. The prefix reads it through
    # relay 0 until relays 1 and 2, which only relay 0's join opened it at, closed it
    # (5.11 closing): the exploration covers its first produces opening it again at the
    # relays that closed it, their joins and its first view, with relay 0 holding it
    # blank and joined throughout.
    "closed": Setup(
        (PATTERN_SUBSCRIPTIONS,) * len(RELAYS),
        ((1, RELAYS),),
        opened_by_use=True,
        spread_produces=True,
        reader=0,
        limits=(("unread_stream_close_ms", 40), ("idle_stream_close_ms", 600_000)),
    ),
}
TOPOLOGIES = tuple(SETUPS)

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
# | ("step", r, sign) | ("reload", r)


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
    # transaction k > 0 is produced only once every relay ticked k * produce_gap_ticks
    # times (0: at any time)
    produce_gap_ticks: int = 0
    reloads: bool = False  # each relay may read its new file once ("reload r")
    reload_after_ticks: int = 0  # ... once it ticked this many times (Setup's)


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
    # the stream's configuration (5.15); None: the relay does not hold the stream (not
    # opened yet, or it left: its configuration leaves it out), and the fields above are
    # those of `ABSENT`
    config: Configuration | None = None
    serves: bool = True  # RelayCore.serves(STREAM): frames of the stream reach it
    # The configuration each report of `reports` was made under, as runs (configuration,
    # how many reports): the first n1 under c1, the next n2 under c2, ... (the explorer
    # tags them, actions._tag_reports)
    report_configs: tuple[tuple[Configuration, int], ...] = ()
    # the configuration that left it out when it left the stream (RelayCore.foreign)
    left_under: Configuration | None = None
    change_held: bool = False  # a relay's file still names other relays (change_held_by)


# What a relay that does not hold the stream contributes: no committed prefix, no reports.
ABSENT = CoreInfo(
    committed_point=-1,
    committed_digest=b"",
    reported=-1,
    floor=-1,
    base_point=-1,
    base_digest=b"",
    known_commit=(-1, b""),
    committed=(),
    held=(),
    reports=(),
    fenced=False,
    counters=frozenset(),
)


class CoreSnap(NamedTuple):
    blob: bytes  # the pickled core, its configuration by reference (Context.freeze)
    fp: bytes  # blake2b of the blob
    info: CoreInfo


Vote = tuple[int, bytes, Configuration]  # a report (point, digest) and its configuration


class Acceptance(NamedTuple):
    """Relay `relay` accepted `value` (its msgpack encoding: states hash and sort it) for
    view `number` at `ballot`, holding the configuration `under` then (5.12, 5.15): what
    decides an instance."""

    number: int
    ballot: int
    value: bytes
    relay: int
    under: Configuration


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
    # produces a relay forwarded (5.1: it does not serve the stream), as
    # (tx, forwarding relay, forward id), and the copies members issued for them, as
    # (tx, seq)
    forwards: tuple[tuple[int, int, int], ...] = ()
    forwarded: tuple[tuple[int, int], ...] = ()
    reloaded: tuple[bool, ...] = NO_RELOADS  # per relay: read its new file ("reload r")
    # per relay: the reports it made while it held the stream before it left it, each with
    # the configuration it was made under (they may be in a commit of that configuration)
    left_votes: tuple[tuple[Vote, ...], ...] = ((), (), ())
    # per relay: every report it sent, with the configuration its Reports stated, void ones
    # (5.12) included; kept only where more than one configuration can be established
    # (Context.across)
    sent_votes: tuple[tuple[Vote, ...], ...] = ((), (), ())
    # every acceptance any relay made, kept only where Setup.check_agreement says
    acceptances: tuple[Acceptance, ...] = ()


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
        w.forwards,
        w.forwarded,
        w.reloaded,
        w.left_votes,
        w.sent_votes,
        w.acceptances,
        tuple(c.info.report_configs for c in w.cores),
    )
    hsh = hashlib.blake2b(digest_size=16)
    for c in w.cores:
        hsh.update(c.fp)
    hsh.update(repr(rest).encode())
    return hsh.digest()


class Context:
    """What every state shares: each relay's configuration (its own topology, `SETUPS`,
    and the one it reads while it runs, if any), the core class, and the prefix behind
    each reported digest."""

    def __init__(
        self, limits: Limits, core_class: type[RelayCore] = RelayCore, topologies: str = "same"
    ) -> None:
        if topologies not in SETUPS:
            raise ValueError(f"unknown topologies {topologies!r}: one of {TOPOLOGIES}")
        setup = SETUPS[topologies]
        limits = dataclasses.replace(limits, **dict(setup.limits))
        self.core_class = core_class
        self.mode = topologies
        self.setup = setup
        made: dict[int, Topology] = {}  # relays reading one file share one Topology
        for subs in (*setup.subscriptions, *(setup.reloads or ())):
            if id(subs) not in made:
                made[id(subs)] = Topology(dict(subs))
        self.topologies = tuple(made[id(subs)] for subs in setup.subscriptions)
        self.configs = [CoreConfig(r, self.topologies[r], limits) for r in RELAYS]
        # What each relay reads while it runs ("reload r"), as RelayCore.reload_topology
        # takes it; the topologies in force, by which relays read theirs (for routing).
        self.reload_configs = (
            [CoreConfig(r, made[id(setup.reloads[r])], limits) for r in RELAYS]
            if setup.reloads is not None
            else []
        )
        self._in_force: dict[tuple[bool, ...], tuple[Topology, ...]] = {NO_RELOADS: self.topologies}
        self.limits = limits
        # The configurations of STREAM that can be established; the commit checks count
        # the votes made under each by its relays, by its quorum.
        self.established = setup.established
        # Several can: the checks compare them, counting every report sent (World.sent_votes)
        self.across = len(setup.established) > 1
        # The configuration every state shares is pickled as a reference into _SHARED
        # (chosen by type, in the pickler's C code: no call per other object pickled).
        for shared in (*made.values(), limits, *self.configs, *self.reload_configs):
            _SHARED[id(shared)] = shared
        self._detach: dict[type, Callable[[Any], Any]] = {
            kind: _by_reference for kind in (CoreConfig, Limits, Topology)
        }
        self.max_frame = limits.max_frame_bytes
        # chain digest -> the prefix (entries above genesis) it stands for. A pure function
        # of the digest (xxh3-128 collisions aside), so it lives outside the states.
        self.prefix_of: dict[bytes, tuple[Entry, ...]] = {dg.genesis(STREAM): ()}

    def in_force(self, reloaded: tuple[bool, ...]) -> tuple[Topology, ...]:
        """Each relay's topology once the relays `reloaded` says read their new file."""
        found = self._in_force.get(reloaded)
        if found is None:
            found = tuple(
                self.reload_configs[r].topology if reloaded[r] else self.topologies[r]
                for r in RELAYS
            )
            self._in_force[reloaded] = found
        return found

    def remember_prefix(self, tl: Timeline, point: int, digest: bytes) -> None:
        if tl.base_point != GENESIS_POINT or digest in self.prefix_of:
            return
        h = tl.head
        entries = tuple((s, t) for s, t in zip(tl.seqs[h:], tl.txs[h:], strict=True) if s <= point)
        self.prefix_of[digest] = entries

    def receivers(
        self,
        out: Outgoing,
        src: int,
        serving: Sequence[bool],
        reloaded: tuple[bool, ...] = NO_RELOADS,
    ) -> list[int]:
        """Where `src`'s frame goes, as the node's topics take it (relay/sim/script.py,
        `Mesh.subscribers`): a stream's frame to every other relay whose own topology serves
        the stream or whose configuration does (`serving[d]`: RelayCore.serves(STREAM)); a
        targeted or mesh-wide one as `recipients` says by the sender's topology; and only to
        a relay whose topology lists `src`. Each relay's topology is the one in force
        (`reloaded`: the relays that read their new file)."""
        tops = self.in_force(reloaded)
        if out.stream is None:
            targets: Sequence[int] = recipients(out, tops[src], src)
        else:
            stream = out.stream
            targets = [
                d
                for d in RELAYS
                if d != src and (tops[d].serves(d, stream) or (stream == STREAM and serving[d]))
            ]
        return [d for d in targets if src in tops[d].subscriptions]

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
