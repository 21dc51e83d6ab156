"""A bounded exhaustive model checker of the real protocol core (safety only).

Entry points (`relay explore ARGS` calls `main(ARGS)`):

    run_explore(
        max_states: int = 20_000,      # distinct states to discover before stopping
        transactions: int = 3,         # produces the clients make (0..3, see TXS)
        max_drops: int = 2,            # frames the network may lose in one run
        *,
        max_dups: int = 1,             # frames the network may duplicate in one run
        max_ticks: int = 6,            # clock steps per relay (each one calls tick())
        tick_ms: int = 10,             # length of one clock step
        max_skew_ticks: int = 2,       # no relay ticks further ahead of the slowest one
        max_depth: int = 400,          # actions on one path (walks end by ~250)
        max_clock_steps: int = 0,      # wall clock steps (+-clock_step_ms) in one run
        clock_step_ms: int = 25,
        strategy: str = "dfs",         # "dfs" | "bfs" | "random" (dfs, seeded successor
                                       # order) | "walk" (seeded random walks, sampling)
        seed: int = 0,                 # for "random" and "walk"
        time_budget_s: float | None = None,
        limits: Limits | None = None,  # default: EXPLORE_LIMITS (small timeouts)
        stop_on_violation: bool = True,
        progress: Callable[[str], None] | None = None,
        core_class: type[RelayCore] = RelayCore,  # a subclass plants bugs (tests)
        shrink: bool = True,           # shorten a violation's trace (greedy, <= 30 s)
    ) -> ExploreResult
    main(argv: Sequence[str] | None = None) -> int
        # prints the statistics and ends with `N passed, M failed` (1/0 or 0/1); 0 = ok

What is explored. Three relays serve stream "s" (Topology {0: ("s",), 1: ("s",), 2:
("s",)}). A deterministic prefix (tick everyone every `tick_ms`, deliver every frame at
once) runs until all three joined the stream, are unfenced and the network is quiet. From
that state every interleaving of these actions is explored, within the bounds:

  produce k at r  the next transaction (in TXS order) is produced at relay r; TXS[2] is a
                  retry of TXS[0] (same producer id and sequence), to exercise dedupe
  deliver a->b    the head frame of link a->b is received by b (links are FIFO)
  drop a->b       the head frame of link a->b is lost          (at most max_drops)
  dup a->b        the head frame of link a->b is duplicated    (at most max_dups)
  tick r          relay r's clock advances tick_ms and tick() runs (max_ticks, max_skew)
  step r +-       relay r's wall clock (sequence numbers) steps by clock_step_ms, forward or
                  back, apart from its monotonic clock (timers)  (at most max_clock_steps)

After every call into a core, `ready()` is drained: frames are routed (stream -> the other
members, target -> that relay, neither -> every other relay), replies go to the producers'
bookkeeping, deliveries to the relay's consumer log. Clocks are per relay, so the safety
checks also hold under skew (G4).

States are deduplicated by a fingerprint: each core is pickled (its shared, constant config
and its diagnostics counters detached: the protocol never reads them) and the state hashes
the cores' pickles with the links, clocks and client bookkeeping (blake2b). Equal
fingerprints mean equal states, so deduplication never merges different states; equal
states reached along different paths could in principle pickle differently (dict order,
object sharing), which only costs repeated work (on a 100k-state run a canonical field-by-
field walk merged exactly as many states, at 1.4x the cost). Cores are copied by a pickle
round trip; a successor only re-pickles the one core its action touched.

Checked in every state (see `check_timelines`, `_inspect_core`, `_check_world`):

  * G1: the committed prefixes of any two relays agree up to the lower committed point
    (same seqs, same transactions, nothing missing); seqs strictly increase; the consumer
    log of each relay is exactly its committed prefix without skipped duplicates; no
    producer key (pid, pseq) is delivered twice on a relay.
  * nothing invented: every held, late or delivered (seq, tx) is a copy some relay issued.
  * commits are real and never conflict: no point has two digests each reported by a
    quorum (counting every report made, delivered or not); the prefixes behind the digests
    quorums reported at successive points extend one another (each reported digest is
    mapped to the prefix it was computed over); each relay's committed and known-committed
    (point, digest) above genesis was reported by a quorum; every relay committed past a
    quorum-reported point has that digest there.
  * G3: a producer gets at most one answer per request; `committed(seq)` names a copy of
    its own transaction, every relay committed past seq delivered that transaction at seq,
    and all committed answers for one key name the same seq; `rejected` copies are in no
    relay's committed prefix.
  * per relay: base <= committed <= reported, committed <= known commit; committed digest
    = the chain recomputed from the base; cached digests and content hashes are right;
    delivered index and dedupe skip flags match the committed prefix; pending produces lie
    above the committed point and their key maps agree.
  * per transition: committed point, reported point, clock floor never decrease, the
    committed prefix only grows (never rewritten), the report log is append-only; every
    outgoing frame decodes, is routed as its type requires, carries a non-decreasing floor;
    every transaction it issues lies above every floor it announced before; reports
    strictly increase, lie above every votes_final_through promise it announced before,
    and each equals the reporter's own chain digest at that point.

Not covered: crashes and restarts (incarnations), eviction and rebasing, forwarding by
non-members, more than one stream, clock refusals (steps are far below the bound).

Scale. The interleavings of six FIFO links are genuinely concurrent: even one transaction
without faults or ticks has more than 10^5 distinct states, so realistic bounds are always
hit (about 2,000 distinct states per second). "dfs" goes deep along the first choices
(commits within the first few hundred states); "walk" samples the whole space and reaches
repairs, resets, late rejections and timeouts; "bfs" covers every short prefix. A partial
order reduction (sleep sets: actions on different cores commute) would cut the work per
state, not the number of states.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import random
import re
import sys
import time
import traceback
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, NamedTuple

from relay.core import codec
from relay.core import digest as dg
from relay.core.config import CoreConfig, Limits, Topology, quorum
from relay.core.messages import (
    Entry,
    Heartbeat,
    JoinReply,
    JoinRequest,
    Outcome,
    ProduceRequest,
    RepairReply,
    RepairRequest,
    Report,
    Reports,
    Transaction,
    TxBatch,
)
from relay.core.relay import GENESIS_POINT, RelayCore
from relay.core.seq import MAX_RELAY_ID, counter_of, ms_of, relay_of, wall_ms

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

STRATEGIES = ("dfs", "bfs", "random", "walk")

Action = tuple[Any, ...]  # ("produce", k, r) | ("deliver"|"drop"|"dup", link) | ("tick", r)


# === state ===============================================================================


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


class CoreSnap(NamedTuple):
    blob: bytes  # the pickled core, config detached
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


@dataclass
class Violation:
    message: str
    trace: list[str]  # the steps from the start state, described (shrunk if `shrink`)
    found_at_depth: int = 0  # length of the path on which the search found it

    def __str__(self) -> str:
        shrunk = (
            f" (shrunk from {self.found_at_depth} steps)"
            if self.found_at_depth > len(self.trace)
            else ""
        )
        lines = [f"VIOLATION: {self.message}", f"trace{shrunk}:"]
        lines += [f"  {i + 1:3d}. {step}" for i, step in enumerate(self.trace)]
        return "\n".join(lines)


@dataclass
class ExploreResult:
    states_explored: int = 0  # distinct states whose successors were generated
    distinct_states: int = 0  # distinct fingerprints discovered
    transitions: int = 0  # actions applied
    max_depth: int = 0
    bound_hit: bool = False  # some state was left unexplored (see bound_reasons)
    bound_reasons: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    coverage: dict[str, int] = field(default_factory=dict)  # event -> distinct states
    counters: dict[str, int] = field(default_factory=dict)  # core counter -> distinct states
    walks: int = 0  # strategy "walk": random walks run
    seconds: float = 0.0
    params: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        bound = (
            f"yes ({', '.join(self.bound_reasons)})"
            if self.bound_hit
            else "no (exhaustive within the bounds)"
        )
        lines = [
            "explore: 3 relays, stream 's', "
            + ", ".join(f"{k}={v}" for k, v in self.params.items()),
            f"states explored:   {self.states_explored}",
            f"distinct states:   {self.distinct_states}",
            f"transitions:       {self.transitions}",
            f"max depth:         {self.max_depth}",
            *([f"random walks:      {self.walks}"] if self.walks else []),
            f"bound hit:         {bound}",
            f"time:              {self.seconds:.1f} s",
            "coverage (distinct states where it holds):",
        ]
        lines += [f"  {k}: {v}" for k, v in sorted(self.coverage.items())]
        lines.append("core counters seen (distinct states):")
        lines += [f"  {k}: {v}" for k, v in sorted(self.counters.items())]
        for v in self.violations:
            lines.append(str(v))
        return "\n".join(lines)


# === pure checks =========================================================================


def _fmt_tx(tx: Transaction) -> str:
    return f"{tx.producer_id.decode(errors='replace')}#{tx.producer_seq}:{tx.value!r}"


def check_timelines(
    logs: Mapping[int, Sequence[Entry]],
    committed: Mapping[int, int] | None = None,
    bases: Mapping[int, int] | None = None,
    label: str = "delivered",
) -> list[str]:
    """G1 over delivered logs, one per relay (entries (seq, tx) in delivery order).

    Each log's seqs must strictly increase (no seq twice). Any two logs must hold the same
    entries over their common range: seqs above both bases and at or below the lower of
    the two committed points (default: each log's last seq), so a log missing an entry the
    other has in that range, or holding a different transaction at a seq, is a violation.
    """
    problems: list[str] = []
    top: dict[int, int] = {}
    for r, log in logs.items():
        for (a, _), (b, _) in pairwise(log):
            if b <= a:
                problems.append(f"{label} log of relay {r}: seq {b} after {a} (not increasing)")
                break
        if committed is not None and r in committed:
            top[r] = committed[r]
        else:
            top[r] = log[-1][0] if log else -1
    rids = sorted(logs)
    for i, a in enumerate(rids):
        for b in rids[i + 1 :]:
            hi = min(top[a], top[b])
            lo = max(bases.get(a, -1), bases.get(b, -1)) if bases else -1
            la = [e for e in logs[a] if lo < e[0] <= hi]
            lb = [e for e in logs[b] if lo < e[0] <= hi]
            if la == lb:
                continue
            k = next(
                (j for j, (x, y) in enumerate(zip(la, lb, strict=False)) if x != y),
                min(len(la), len(lb)),
            )
            ea = f"({la[k][0]}, {_fmt_tx(la[k][1])})" if k < len(la) else "nothing"
            eb = f"({lb[k][0]}, {_fmt_tx(lb[k][1])})" if k < len(lb) else "nothing"
            problems.append(
                f"{label} logs of relays {a} and {b} disagree in ({lo}, {hi}]: "
                f"entry {k} is {ea} at relay {a} but {eb} at relay {b}"
            )
    return problems


def _digest_at(info: CoreInfo, point: int) -> bytes | None:
    """The relay's committed chain digest at `point` (<= its committed point)."""
    if point < info.base_point or point > info.committed_point:
        return None
    i = bisect_right(info.committed, point, key=lambda c: c[0])
    return info.committed[i - 1][2] if i else info.base_digest


def _check_world(w: World, prefix_of: Mapping[bytes, tuple[Entry, ...]] | None = None) -> list[str]:
    """Cross-relay and client checks of one state."""
    p: list[str] = []
    infos = [c.info for c in w.cores]
    # G1 on the committed prefixes (skipped duplicates included) and on consumer logs.
    internal = {r: [(s, t) for s, t, _, _ in infos[r].committed] for r in RELAYS}
    cps = {r: infos[r].committed_point for r in RELAYS}
    bases = {r: infos[r].base_point for r in RELAYS}
    p += check_timelines(internal, cps, bases, label="committed")
    p += check_timelines(dict(enumerate(w.delivered)), cps, bases, label="consumer")
    for r in RELAYS:
        fresh = tuple((s, t) for s, t, _, skipped in infos[r].committed if not skipped)
        since = tuple(e for e in w.delivered[r] if e[0] > infos[r].base_point)
        if fresh != since:
            p.append(f"relay {r}: consumers received {since} but committed {fresh}")
        keys = Counter((t.producer_id, t.producer_seq) for _, t in w.delivered[r])
        for key, n in keys.items():
            if n > 1:
                p.append(f"relay {r}: key {key} delivered {n} times (dedupe)")
    # Nothing invented: every (seq, tx) anywhere is a copy some relay issued.
    issued: dict[int, Transaction] = {}
    for k, prod in enumerate(w.produced):
        if prod is not None and prod[1] >= 0:
            issued.setdefault(prod[1], TXS[k])
    for r in RELAYS:
        for s, t in infos[r].held:
            if issued.get(s) != t:
                p.append(f"relay {r} holds ({s}, {_fmt_tx(t)}), never issued")
    # Commits are real: quorums of reports (every report of every relay is in its log).
    voters: dict[int, dict[bytes, set[int]]] = {}
    for r in RELAYS:
        for point, d in infos[r].reports:
            voters.setdefault(point, {}).setdefault(d, set()).add(r)
    quorate: dict[int, bytes] = {}
    for point, by_digest in voters.items():
        won = [d for d, who in by_digest.items() if len(who) >= Q]
        if len(won) > 1:
            p.append(f"point {point}: {len(won)} different digests each reported by a quorum")
        if won:
            quorate[point] = won[0]
    for r in RELAYS:
        info = infos[r]
        for what, (point, d) in (
            ("committed", (info.committed_point, info.committed_digest)),
            ("known commit", info.known_commit),
        ):
            if point > GENESIS_POINT and quorate.get(point) != d:
                p.append(f"relay {r}: {what} {point} has a digest no quorum reported")
        for point, d in quorate.items():
            mine = _digest_at(info, point)
            if mine is not None and mine != d:
                p.append(
                    f"relay {r}: committed past {point} with digest {mine.hex()[:8]} "
                    f"but a quorum reported {d.hex()[:8]} there"
                )
    # No conflicting commits: the prefixes behind the digests a quorum reported (at any
    # points, delivered anywhere or not) extend one another.
    if prefix_of is not None:
        chain = sorted(quorate.items())
        for (p1, d1), (p2, d2) in pairwise(chain):
            e1, e2 = prefix_of.get(d1), prefix_of.get(d2)
            if e1 is None or e2 is None:
                p.append(f"no prefix known for a digest reported at {p1} or {p2}")
            elif tuple(e for e in e2 if e[0] <= p1) != e1:
                p.append(
                    f"conflicting commits: the prefix a quorum reported at {p2} differs "
                    f"at or below {p1} from the one a quorum reported there"
                )
    # Producers (G3).
    committed_seq_of_key: dict[tuple[bytes, int], int] = {}
    for k, answers in enumerate(w.replies):
        if len(answers) > 1:
            p.append(f"tx {k}: answered {len(answers)} times: {answers}")
        tx = TXS[k]
        key = (tx.producer_id, tx.producer_seq)
        prod = w.produced[k]
        for outcome, seq in answers:
            if outcome == Outcome.COMMITTED.value:
                copy = issued.get(seq)
                if copy is None or (copy.producer_id, copy.producer_seq) != key:
                    p.append(f"tx {k}: told committed({seq}), not a copy of its transaction")
                prior = committed_seq_of_key.setdefault(key, seq)
                if prior != seq:
                    p.append(f"key {key}: told committed({prior}) and committed({seq})")
                for r in RELAYS:
                    if infos[r].committed_point >= seq >= infos[r].base_point:
                        got = dict(w.delivered[r]).get(seq)
                        if got is None or (got.producer_id, got.producer_seq) != key:
                            p.append(
                                f"tx {k}: told committed({seq}) but relay {r}, committed "
                                f"through {infos[r].committed_point}, delivered "
                                f"{_fmt_tx(got) if got else 'nothing'} there"
                            )
            elif outcome == Outcome.REJECTED.value and prod is not None and prod[1] >= 0:
                for r in RELAYS:
                    if any(s == prod[1] for s, _, _, _ in infos[r].committed):
                        p.append(f"tx {k}: told rejected but relay {r} committed seq {prod[1]}")
    return p


def _chain(base: bytes, entries: Iterable[tuple[int, bytes]]) -> list[bytes]:
    out = []
    prev = base
    for seq, h in entries:
        prev = dg.chain(prev, seq, h)
        out.append(prev)
    return out


def _inspect_core(core: RelayCore, rid: int) -> tuple[CoreInfo, list[str]]:
    """One relay's internal invariants, and the info the other checks need."""
    p: list[str] = []
    st = core.streams[STREAM]
    tl = st.timeline
    h = tl.head
    if not (len(tl.seqs) == len(tl.txs) == len(tl.hashes) == len(tl.skip)):
        p.append(f"relay {rid}: timeline lists of different lengths")
    seqs, txs = tl.seqs[h:], tl.txs[h:]
    for a, b in pairwise(seqs):
        if b <= a:
            p.append(f"relay {rid}: timeline seq {b} after {a}")
            break
    hashes = [dg.tx_hash(t) for t in txs]
    if hashes != tl.hashes[h:]:
        p.append(f"relay {rid}: cached content hash wrong")
    digests = _chain(tl.base_digest, zip(seqs, hashes, strict=True))
    upto = min(tl.digested, len(tl.digests))
    if tl.digested > len(tl.digests):
        p.append(f"relay {rid}: digested={tl.digested} but {len(tl.digests)} digests")
    if tl.digests[h:upto] != digests[: max(upto - h, 0)]:
        p.append(f"relay {rid}: cached digests disagree with the recomputed chain")
    cp = tl.committed_point
    end = bisect_right(seqs, cp)
    committed = tuple((seqs[i], txs[i], digests[i], tl.skip[h + i]) for i in range(end))
    if tl.has_base:
        if not tl.base_point <= cp <= tl.reported:
            p.append(
                f"relay {rid}: base {tl.base_point} <= committed {cp} <= reported "
                f"{tl.reported} fails"
            )
        if st.known_commit[0] < cp:
            p.append(f"relay {rid}: known commit {st.known_commit[0]} below committed {cp}")
        if tl.delivered != h + end:
            p.append(
                f"relay {rid}: delivered index {tl.delivered}, committed prefix ends {h + end}"
            )
        want = digests[end - 1] if end else tl.base_digest
        if tl.committed_digest != want:
            p.append(f"relay {rid}: committed digest is not the chain digest at {cp}")
        if tl.base_point == GENESIS_POINT:
            seen: dict[tuple[bytes, int], int] = {}
            for seq, tx, _, skipped in committed:
                key = (tx.producer_id, tx.producer_seq)
                if skipped != (key in seen):
                    p.append(f"relay {rid}: skip flag of {seq} is {skipped}")
                seen.setdefault(key, seq)
            if tl.dedupe.keys() != tuple((k[0], k[1], s) for k, s in seen.items()):
                p.append(f"relay {rid}: dedupe window differs from the committed prefix")
    if any(tl.skip[h + end :]):
        p.append(f"relay {rid}: an uncommitted entry is marked skipped")
    for seq in st.pending:
        if seq <= cp or relay_of(seq) != rid:
            p.append(f"relay {rid}: pending produce at {seq}, committed {cp}")
    if (
        set(st.pending_key_of) != set(st.pending)
        or {v: k for k, v in st.pending_keys.items()} != st.pending_key_of
    ):
        p.append(f"relay {rid}: pending maps disagree")
    held = tuple(zip(seqs, txs, strict=True)) + tuple(tl.late.items())
    info = CoreInfo(
        committed_point=cp,
        committed_digest=tl.committed_digest,
        reported=tl.reported,
        floor=core.clock.floor,
        base_point=tl.base_point,
        base_digest=tl.base_digest,
        known_commit=st.known_commit,
        committed=committed,
        held=held,
        reports=tuple(st.report_log),
        fenced=st.fenced,
        counters=frozenset(k for k, v in core.counters.items() if v > 0),
    )
    return info, p


def _check_transition(rid: int, old: CoreInfo, new: CoreInfo) -> list[str]:
    p: list[str] = []
    for name in ("committed_point", "reported", "floor"):
        if getattr(new, name) < getattr(old, name):
            p.append(
                f"relay {rid}: {name} went back from {getattr(old, name)} to {getattr(new, name)}"
            )
    if new.committed[: len(old.committed)] != old.committed and new.base_point == old.base_point:
        p.append(f"relay {rid}: committed prefix rewritten")
    if new.reports[: len(old.reports)] != old.reports:
        p.append(f"relay {rid}: report log rewritten")
    return p


# === fingerprints and copies ===========================================================


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


class _Ctx:
    def __init__(self, limits: Limits, core_class: type[RelayCore] = RelayCore) -> None:
        self.core_class = core_class
        self.topology = Topology(dict(TOPOLOGY_SUBSCRIPTIONS))
        self.configs = [CoreConfig(r, self.topology, limits) for r in RELAYS]
        self.limits = limits
        self.max_frame = limits.max_frame_bytes
        # chain digest -> the prefix (entries above genesis) it stands for. A pure function
        # of the digest (xxh3-128 collisions aside), so it lives outside the states.
        self.prefix_of: dict[bytes, tuple[Entry, ...]] = {dg.genesis(STREAM): ()}

    def remember_prefix(self, tl: Any, point: int, digest: bytes) -> None:
        if tl.base_point != GENESIS_POINT or digest in self.prefix_of:
            return
        h = tl.head
        entries = tuple((s, t) for s, t in zip(tl.seqs[h:], tl.txs[h:], strict=True) if s <= point)
        self.prefix_of[digest] = entries

    def thaw(self, snap: CoreSnap, rid: int) -> RelayCore:
        core: RelayCore = pickle.loads(snap.blob)
        core.config = self.configs[rid]
        core.limits = self.limits
        core.topology = self.topology
        return core

    def freeze(self, core: RelayCore, info: CoreInfo) -> CoreSnap:
        """Pickle the core without its (shared, constant) config and its counters (never
        read by the protocol; `info.counters` keeps their names for coverage). The core
        object must not be used afterwards."""
        core.config = core.limits = core.topology = None  # type: ignore[assignment]
        core.counters = Counter()
        blob = pickle.dumps(core, pickle.HIGHEST_PROTOCOL)
        return CoreSnap(blob, hashlib.blake2b(blob, digest_size=16).digest(), info)


# === transitions =========================================================================


def _enabled(w: World, n_tx: int, a: _Args) -> list[Action]:
    acts: list[Action] = []
    k = sum(1 for x in w.produced if x is not None)
    if k < n_tx:
        acts += [("produce", k, r) for r in RELAYS]
    live = [i for i, q in enumerate(w.links) if q]
    acts += [("deliver", i) for i in live]
    low = min(w.ticks)
    acts += [
        ("tick", r)
        for r in RELAYS
        if w.ticks[r] < a.max_ticks and w.ticks[r] - low < a.max_skew_ticks
    ]
    if w.drops < a.max_drops:
        acts += [("drop", i) for i in live]
    if w.dups < a.max_dups:
        acts += [("dup", i) for i in live]
    if w.steps < a.max_clock_steps:
        acts += [("step", r, sign) for r in RELAYS for sign in (-1, 1)]
    return acts


@dataclass
class _Args:
    max_ticks: int
    tick_ms: int
    max_skew_ticks: int
    max_drops: int
    max_dups: int
    max_clock_steps: int = 0
    clock_step_ms: int = 25


def _drain(
    ctx: _Ctx,
    w: World,
    rid: int,
    core: RelayCore,
    links: list[tuple[bytes, ...]],
    replies: list[tuple[tuple[str, int], ...]],
) -> tuple[World, list[str]]:
    """ready() of the core an action touched: route, answer, deliver; then snapshot it."""
    p: list[str] = []
    out = core.ready()
    last_report = w.last_report[rid]
    floor_sent = w.floor_sent[rid]
    final_sent = w.final_sent[rid]
    tl = core.streams[STREAM].timeline
    for o in out.outgoing:
        try:
            msg = codec.decode(o.frame, ctx.max_frame)
        except Exception as e:
            p.append(f"relay {rid} sent an undecodable frame: {e}")
            continue
        if msg.sender != rid:
            p.append(f"relay {rid} sent a frame with sender {msg.sender}")
        target = getattr(msg, "target", None)
        if isinstance(msg, TxBatch | Reports | JoinRequest):
            if o.stream != STREAM or o.target is not None:
                p.append(f"relay {rid}: {type(msg).__name__} not routed to the stream")
        elif target is not None:
            if o.target != target or target == rid or o.stream is not None:
                p.append(f"relay {rid}: {type(msg).__name__} routed to {o.target}, not {target}")
        elif o.target is not None or o.stream is not None:
            p.append(f"relay {rid}: {type(msg).__name__} should go to every peer")
        if isinstance(msg, TxBatch):
            for seq, _ in msg.entries:
                if seq <= floor_sent:
                    p.append(
                        f"relay {rid} issued {seq} at or below its announced floor {floor_sent}"
                    )
        if isinstance(msg, Reports):
            for point, d in msg.points:
                if point <= last_report:
                    p.append(f"relay {rid} reported {point} after {last_report}")
                if point <= final_sent:
                    p.append(f"relay {rid} reported {point}, promised none through {final_sent}")
                last_report = point
                if d != _chain_at(tl, point):
                    p.append(f"relay {rid} reported at {point} a digest not of its own prefix")
                else:
                    ctx.remember_prefix(tl, point, d)
            if (msg.committed_point, msg.committed_digest) != (
                tl.committed_point,
                tl.committed_digest,
            ):
                p.append(f"relay {rid}: Reports announce a commit it does not hold")
        if isinstance(msg, Heartbeat):
            for status in msg.streams:
                final_sent = max(final_sent, getattr(status, "votes_final_through", -1))
        if msg.floor < floor_sent:
            p.append(f"relay {rid}: floor went back from {floor_sent} to {msg.floor} on the wire")
        floor_sent = max(floor_sent, msg.floor)
        if o.target is not None:
            dsts: Iterable[int] = (o.target,)
        else:
            dsts = (x for x in RELAYS if x != rid)
        for dst in dsts:
            i = LINK_INDEX[(rid, dst)]
            links[i] = (*links[i], o.frame)
    for reply in out.replies:
        k = reply.request_id - REQUEST_BASE
        if not 0 <= k < len(TXS):
            p.append(f"relay {rid} answered unknown request {reply.request_id}")
            continue
        replies[k] = (*replies[k], (reply.outcome.value, reply.seq))
    delivered = list(w.delivered)
    for dl in out.deliveries:
        if dl.stream != STREAM:
            p.append(f"relay {rid} delivered stream {dl.stream!r}")
            continue
        log = delivered[rid]
        for seq, _ in dl.entries:
            if log and seq <= log[-1][0]:
                p.append(f"relay {rid} delivered {seq} after {log[-1][0]}")
        delivered[rid] = log + tuple(dl.entries)
    rebases = w.rebases + len(getattr(out, "rebases", ()))
    info, more = _inspect_core(core, rid)
    info = info._replace(counters=info.counters | w.cores[rid].info.counters)
    p += more
    p += _check_transition(rid, w.cores[rid].info, info)
    snap = ctx.freeze(core, info)
    cores = list(w.cores)
    cores[rid] = snap
    lr = list(w.last_report)
    lr[rid] = last_report
    fs = list(w.floor_sent)
    fs[rid] = floor_sent
    fin = list(w.final_sent)
    fin[rid] = final_sent
    return (
        w._replace(
            cores=tuple(cores),
            links=tuple(links),
            replies=tuple(replies),
            delivered=tuple(delivered),
            last_report=tuple(lr),
            floor_sent=tuple(fs),
            final_sent=tuple(fin),
            rebases=rebases,
        ),
        p,
    )


def _chain_at(tl: Any, point: int) -> bytes | None:
    """The digest at `point` recomputed from the base, ignoring every cache."""
    if not tl.has_base or point < tl.base_point:
        return None
    h = tl.head
    entries = [
        (s, dg.tx_hash(t)) for s, t in zip(tl.seqs[h:], tl.txs[h:], strict=True) if s <= point
    ]
    chain = _chain(tl.base_digest, entries)
    return chain[-1] if chain else tl.base_digest


def _apply(ctx: _Ctx, w: World, act: Action, a: _Args) -> tuple[World, list[str]]:
    kind = act[0]
    links = list(w.links)
    replies = list(w.replies)
    if kind == "drop":
        links[act[1]] = links[act[1]][1:]
        return w._replace(links=tuple(links), drops=w.drops + 1), []
    if kind == "dup":
        q = links[act[1]]
        links[act[1]] = (q[0], *q)
        return w._replace(links=tuple(links), dups=w.dups + 1), []
    if kind == "step":
        skew = list(w.skew)
        skew[act[1]] += act[2] * a.clock_step_ms
        return w._replace(skew=tuple(skew), steps=w.steps + 1), []
    if kind == "deliver":
        frame = links[act[1]][0]
        links[act[1]] = links[act[1]][1:]
        rid = LINKS[act[1]][1]
        core = ctx.thaw(w.cores[rid], rid)
        core.receive(frame, w.now[rid] + w.skew[rid], w.now[rid])
        return _drain(ctx, w, rid, core, links, replies)
    if kind == "tick":
        rid = act[1]
        now = list(w.now)
        ticks = list(w.ticks)
        now[rid] += a.tick_ms
        ticks[rid] += 1
        core = ctx.thaw(w.cores[rid], rid)
        core.tick(now[rid] + w.skew[rid], now[rid])
        w = w._replace(now=tuple(now), ticks=tuple(ticks))
        return _drain(ctx, w, rid, core, links, replies)
    if kind == "produce":
        k, rid = act[1], act[2]
        core = ctx.thaw(w.cores[rid], rid)
        request_id = REQUEST_BASE + k
        request = ProduceRequest(request_id, STREAM, TXS[k])
        core.produce(request, w.now[rid] + w.skew[rid], w.now[rid])
        st = core.streams[STREAM]
        copy = -1
        for seq, waiters in st.pending.items():
            if any(x.request_id == request_id and x.origin is None for x in waiters):
                copy = seq
        produced = list(w.produced)
        produced[k] = (rid, copy)
        w = w._replace(produced=tuple(produced))
        return _drain(ctx, w, rid, core, links, replies)
    raise ValueError(f"unknown action {act!r}")


# === the initial state ================================================================


def _initial(ctx: _Ctx, n_tx: int, tick_ms: int) -> World:
    """Tick everyone with immediate delivery until all joined, unfenced and quiet."""
    now = START_UNIX_MS
    cores = [ctx.core_class(ctx.configs[r], 1, now) for r in RELAYS]
    floor_sent = [-1] * len(RELAYS)
    last_report = [-1] * len(RELAYS)
    final_sent = [-1] * len(RELAYS)

    def drain(r: int, queue: deque[tuple[int, bytes]]) -> None:
        out = cores[r].ready()
        if out.replies or out.deliveries:
            raise RuntimeError("prefix produced replies or deliveries")
        for o in out.outgoing:
            msg = codec.decode(o.frame, ctx.max_frame)
            floor_sent[r] = max(floor_sent[r], msg.floor)
            if isinstance(msg, Reports) and msg.points:
                last_report[r] = msg.points[-1][0]
            if isinstance(msg, Heartbeat):
                for status in msg.streams:
                    final = getattr(status, "votes_final_through", -1)
                    final_sent[r] = max(final_sent[r], final)
            dsts = (o.target,) if o.target is not None else tuple(d for d in RELAYS if d != r)
            for d in dsts:
                queue.append((d, o.frame))

    for _ in range(100):
        queue: deque[tuple[int, bytes]] = deque()
        for r in RELAYS:
            cores[r].tick(now)
            drain(r, queue)
        while queue:
            d, frame = queue.popleft()
            cores[d].receive(frame, now)
            drain(d, queue)
        if all(c.joined(STREAM) and not c.fenced(STREAM) for c in cores) and all(
            c.committed_point(STREAM) == GENESIS_POINT for c in cores
        ):
            break
        now += tick_ms
    else:
        raise RuntimeError("the relays did not join the stream within 100 steps")
    snaps = []
    for r in RELAYS:
        info, problems = _inspect_core(cores[r], r)
        if problems:
            raise RuntimeError(f"initial state broken: {problems}")
        snaps.append(ctx.freeze(cores[r], info))
    return World(
        cores=tuple(snaps),
        links=tuple(() for _ in LINKS),
        now=(now,) * len(RELAYS),
        ticks=(0,) * len(RELAYS),
        drops=0,
        dups=0,
        produced=(None,) * n_tx,
        replies=((),) * n_tx,
        delivered=((),) * len(RELAYS),
        last_report=tuple(last_report),
        floor_sent=tuple(floor_sent),
        final_sent=tuple(final_sent),
    )


# === describing a trace ================================================================


class _Fmt:
    def __init__(self, start_ms: int) -> None:
        self.ms0 = wall_ms(start_ms)

    def seq(self, seq: int) -> str:
        if seq <= 0:
            return str(seq)
        ms = ms_of(seq) - self.ms0
        r = relay_of(seq)
        if r == MAX_RELAY_ID:
            return f"t{ms:+d}.end"
        return f"t{ms:+d}.r{r}.{counter_of(seq)}"

    def frame(self, frame: bytes) -> str:
        try:
            m = codec.decode(frame, 1 << 30)
        except Exception as e:  # pragma: no cover - only for a broken frame
            return f"<undecodable: {e}>"
        name = type(m).__name__
        if isinstance(m, TxBatch):
            body = (
                f"#{m.link_seq} [{', '.join(self.seq(s) + '=' + _fmt_tx(t) for s, t in m.entries)}]"
            )
        elif isinstance(m, Reports):
            pts = ", ".join(f"{self.seq(p)}:{d.hex()[:6]}" for p, d in m.points)
            body = f"#{m.link_seq} [{pts}] committed={self.seq(m.committed_point)}"
        elif isinstance(m, Heartbeat):
            body = " ".join(
                f"last_link={s.last_link_seq} committed={self.seq(s.committed_point)}"
                for s in m.streams
            )
        elif isinstance(m, RepairRequest):
            body = f"req={m.request_id} ({self.seq(m.lo)}, {self.seq(m.hi)}] origin={m.origin}"
        elif isinstance(m, RepairReply):
            ents = ", ".join(self.seq(s) for s, _ in m.entries)
            body = (
                f"req={m.request_id} {m.status.value} ({self.seq(m.lo)}, {self.seq(m.hi)}] "
                f"more={m.more} [{ents}]"
            )
        elif isinstance(m, JoinRequest | JoinReply):
            body = ""
        else:
            body = ""
        return f"{name}{body and ' ' + body} floor={self.seq(m.floor)}"


def _describe(ctx: _Ctx, start: World, actions: Sequence[Action], a: _Args) -> list[str]:
    """Replay `actions` from `start`, describing each step (the replay is deterministic)."""
    fmt = _Fmt(start.now[0])
    out: list[str] = []
    w = start
    for act in actions:
        kind = act[0]
        if kind in ("deliver", "drop", "dup"):
            src, dst = LINKS[act[1]]
            text = f"{kind} {src}->{dst}: {fmt.frame(w.links[act[1]][0])}"
        elif kind == "tick":
            text = f"tick relay {act[1]} -> t+{w.now[act[1]] + a.tick_ms - start.now[0]}ms"
            if w.skew[act[1]]:
                text += f" (wall clock {w.skew[act[1]]:+d} ms off)"
        elif kind == "step":
            text = f"wall clock of relay {act[1]} steps {act[2] * a.clock_step_ms:+d} ms"
        else:
            text = f"produce tx {act[1]} ({_fmt_tx(TXS[act[1]])}) at relay {act[2]}"
        before = w
        try:
            w, _ = _apply(ctx, w, act, a)
        except Exception as e:
            out.append(f"{text}  => raised {type(e).__name__}: {e}")
            break
        notes = []
        for k, (old, new) in enumerate(zip(before.replies, w.replies, strict=True)):
            for outcome, seq in new[len(old) :]:
                notes.append(f"tx {k} told {outcome}({fmt.seq(seq)})")
        for r in RELAYS:
            o, n = before.cores[r].info, w.cores[r].info
            if n.committed_point != o.committed_point:
                notes.append(f"relay {r} committed through {fmt.seq(n.committed_point)}")
            if n.fenced != o.fenced:
                notes.append(f"relay {r} {'fenced' if n.fenced else 'unfenced'}")
        if kind == "produce":
            prod = w.produced[act[1]]
            if prod is not None and prod[1] >= 0:
                notes.append(f"seq {fmt.seq(prod[1])}")
        out.append(text + (f"  => {'; '.join(notes)}" if notes else ""))
    return out


def _replay(
    ctx: _Ctx, start: World, actions: Sequence[Action], a: _Args, n_tx: int
) -> list[str] | None:
    """The problems of the first failing step of `actions`, [] if none fails, None if some
    action is not enabled when its turn comes."""
    w = start
    for act in actions:
        if act not in _enabled(w, n_tx, a):
            return None
        try:
            w, problems = _apply(ctx, w, act, a)
        except Exception as e:
            return [f"a core raised {type(e).__name__}: {e}"]
        problems += _check_world(w, ctx.prefix_of)
        if problems:
            return problems
    return []


def _shrink(
    ctx: _Ctx,
    start: World,
    actions: list[Action],
    a: _Args,
    n_tx: int,
    message: str,
    budget_s: float = 30.0,
) -> tuple[list[Action], str]:
    """Greedily drop runs of actions (16, 8, ..., 1 long) while some violation remains."""
    deadline = time.monotonic() + budget_s
    for size in (16, 8, 4, 2, 1):
        i = 0
        while i < len(actions) and time.monotonic() < deadline:
            candidate = actions[:i] + actions[i + size :]
            problems = _replay(ctx, start, candidate, a, n_tx)
            if problems:
                actions, message = candidate, "; ".join(dict.fromkeys(problems))
            else:
                i += size
    return actions, message


# === the search ==========================================================================


class _Node(NamedTuple):
    world: World
    depth: int
    trace: tuple[Any, ...] | None  # (action, parent trace): a persistent list


def _trace_actions(trace: tuple[Any, ...] | None) -> list[Action]:
    acts: list[Action] = []
    while trace is not None:
        acts.append(trace[0])
        trace = trace[1]
    acts.reverse()
    return acts


def _coverage(w: World, cov: Counter[str], counters: Counter[str]) -> None:
    infos = [c.info for c in w.cores]
    ev: set[str] = set()
    n_delivered = max(len(d) for d in w.delivered)
    if n_delivered:
        ev.add("some tx committed and delivered")
    if n_delivered >= 2:
        ev.add("two txs delivered at one relay")
    if any(any(skipped for *_, skipped in i.committed) for i in infos):
        ev.add("duplicate skipped in a committed prefix")
    if any(i.fenced for i in infos):
        ev.add("a relay fenced")
    if any(i.known_commit[0] > i.committed_point for i in infos):
        ev.add("a relay knows a commit it has not delivered")
    if len({i.committed_point for i in infos}) > 1:
        ev.add("relays at different committed points")
    for answers in w.replies:
        for outcome, _ in answers:
            ev.add(f"producer told {outcome}")
    if w.drops:
        ev.add("a frame dropped")
    if w.dups:
        ev.add("a frame duplicated")
    if w.steps:
        ev.add("a wall clock stepped")
    if w.rebases:
        ev.add("a relay rebased (its delivered history restarted)")
    cov.update(ev)
    counters.update(frozenset().union(*(i.counters for i in infos)))


def run_explore(
    max_states: int = 20_000,
    transactions: int = 3,
    max_drops: int = 2,
    *,
    max_dups: int = 1,
    max_ticks: int = 6,
    tick_ms: int = 10,
    max_skew_ticks: int = 2,
    max_depth: int = 400,
    max_clock_steps: int = 0,
    clock_step_ms: int = 25,
    strategy: str = "dfs",
    seed: int = 0,
    time_budget_s: float | None = None,
    limits: Limits | None = None,
    stop_on_violation: bool = True,
    progress: Callable[[str], None] | None = None,
    core_class: type[RelayCore] = RelayCore,
    shrink: bool = True,
) -> ExploreResult:
    """Explore every interleaving within the bounds (or until `max_states` distinct states
    or `time_budget_s`), checking safety in every state. See the module docstring."""
    if not 0 <= transactions <= len(TXS):
        raise ValueError(f"transactions must be in 0..{len(TXS)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}")
    started = time.monotonic()
    args = _Args(
        max_ticks, tick_ms, max_skew_ticks, max_drops, max_dups, max_clock_steps, clock_step_ms
    )
    ctx = _Ctx(limits or EXPLORE_LIMITS, core_class)
    result = ExploreResult(
        params={
            "max_states": max_states,
            "transactions": transactions,
            "max_drops": max_drops,
            "max_dups": max_dups,
            "max_ticks": max_ticks,
            "tick_ms": tick_ms,
            "max_skew_ticks": max_skew_ticks,
            "max_depth": max_depth,
            **(
                {"max_clock_steps": max_clock_steps, "clock_step_ms": clock_step_ms}
                if max_clock_steps
                else {}
            ),
            "strategy": strategy,
            **({"seed": seed} if strategy in ("random", "walk") else {}),
        }
    )
    rng = random.Random(seed)
    start = _initial(ctx, transactions, tick_ms)
    cov: Counter[str] = Counter()
    counters: Counter[str] = Counter()
    seen = {world_fingerprint(start)}
    _coverage(start, cov, counters)
    reasons: set[str] = set()
    next_progress = started + 10
    walks = 0

    def fail(message: str, trace: tuple[Any, ...] | None) -> None:
        actions = _trace_actions(trace)
        found = len(actions)
        if shrink:
            actions, message = _shrink(ctx, start, actions, args, transactions, message)
        steps = _describe(ctx, start, actions, args)
        fmt = _Fmt(start.now[0])
        message = re.sub(r"\b\d{15,}\b", lambda m: fmt.seq(int(m.group())), message)
        result.violations.append(Violation(message, steps, found))

    def step(node: _Node, act: Action) -> tuple[_Node | None, bool]:
        """Apply one action: (the successor, whether it is new); (None, _) on a violation."""
        result.transitions += 1
        trace = (act, node.trace)
        try:
            child, problems = _apply(ctx, node.world, act, args)
        except Exception as e:
            tb = "".join(traceback.format_exception(e)[-3:])
            fail(f"a core raised {type(e).__name__}: {e}\n{tb}", trace)
            return None, False
        fp = world_fingerprint(child)
        new = fp not in seen
        if new:
            seen.add(fp)
            problems += _check_world(child, ctx.prefix_of)
            _coverage(child, cov, counters)
        if problems:
            fail("; ".join(dict.fromkeys(problems)), trace)
            if stop_on_violation:
                return None, new
        result.max_depth = max(result.max_depth, node.depth + 1)
        return _Node(child, node.depth + 1, trace), new

    def should_stop() -> bool:
        nonlocal next_progress
        if result.violations and stop_on_violation:
            return True
        if len(seen) >= max_states:
            reasons.add("max_states")
            return True
        now = time.monotonic()
        if time_budget_s is not None and now - started >= time_budget_s:
            reasons.add("time_budget")
            return True
        if progress is not None and now >= next_progress:
            next_progress = now + 10
            progress(
                f"{len(seen)} distinct, {result.states_explored} explored, "
                f"{walks or len(frontier)} {'walks' if walks else 'in frontier'}, "
                f"{now - started:.0f} s"
            )
        return False

    frontier: deque[_Node] = deque()
    if strategy == "walk":
        # Random walks from the start to a terminal state (or max_depth), until a bound;
        # each step applies one random enabled action. Stops early once 1,000 walks in a
        # row found nothing new (the space is then likely covered).
        stale = 0
        while stale < 1_000 and not should_stop():
            walks += 1
            node: _Node | None = _Node(start, 0, None)
            fresh = False
            while node is not None:
                acts = _enabled(node.world, transactions, args)
                if not acts:
                    break
                if node.depth >= max_depth:
                    reasons.add("max_depth")
                    break
                result.states_explored += 1
                node, new = step(node, rng.choice(acts))
                fresh |= new
            stale = 0 if fresh else stale + 1
            if len(seen) >= max_states:
                break
        result.walks = walks
        if stale < 1_000:
            reasons.add("sampled")  # walks never prove a space exhausted
    else:
        frontier.append(_Node(start, 0, None))
    while frontier and not should_stop():
        node = frontier.popleft() if strategy == "bfs" else frontier.pop()
        acts = _enabled(node.world, transactions, args)
        if not acts:
            continue
        if node.depth >= max_depth:
            reasons.add("max_depth")
            continue
        result.states_explored += 1
        children: list[_Node] = []
        for act in acts:
            child, new = step(node, act)
            if child is None and stop_on_violation:
                break
            if child is not None and new:
                children.append(child)
        if strategy == "random":
            rng.shuffle(children)
        elif strategy == "dfs":
            children.reverse()  # the first enabled action is explored first
        frontier.extend(children)
    result.distinct_states = len(seen)
    result.bound_hit = bool(reasons)
    result.bound_reasons = sorted(reasons)
    result.coverage = dict(cov)
    result.counters = dict(counters)
    result.seconds = time.monotonic() - started
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """`relay explore`: print the statistics, end with `N passed, M failed`."""
    ap = argparse.ArgumentParser(prog="relay explore", description=__doc__.split("\n")[0])
    ap.add_argument("--max-states", type=int, default=20_000)
    ap.add_argument("--transactions", type=int, default=3)
    ap.add_argument("--max-drops", type=int, default=2)
    ap.add_argument("--max-dups", type=int, default=1)
    ap.add_argument("--max-ticks", type=int, default=6)
    ap.add_argument("--tick-ms", type=int, default=10)
    ap.add_argument("--max-skew-ticks", type=int, default=2)
    ap.add_argument("--max-depth", type=int, default=400)
    ap.add_argument("--max-clock-steps", type=int, default=0)
    ap.add_argument("--clock-step-ms", type=int, default=25)
    ap.add_argument("--strategy", choices=STRATEGIES, default="dfs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=None, metavar="SECONDS")
    ns = ap.parse_args(argv)
    result = run_explore(
        ns.max_states,
        ns.transactions,
        ns.max_drops,
        max_dups=ns.max_dups,
        max_ticks=ns.max_ticks,
        tick_ms=ns.tick_ms,
        max_skew_ticks=ns.max_skew_ticks,
        max_depth=ns.max_depth,
        max_clock_steps=ns.max_clock_steps,
        clock_step_ms=ns.clock_step_ms,
        strategy=ns.strategy,
        seed=ns.seed,
        time_budget_s=ns.time_budget,
        progress=lambda s: print(s, file=sys.stderr, flush=True),
    )
    print(result.summary())
    print(f"{int(result.ok)} passed, {int(not result.ok)} failed")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
