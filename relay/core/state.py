"""What one relay remembers (docs/protocol.md section 4), and the few primitives every rule
uses to act on it: publish a message, allocate a request id, open a stream.

The rules themselves live in one module per spec section (coordinate, links, commit,
repair, reset, join, fencing, heartbeat); they read and change this state and nothing else.
Keeping the state in one place lets a reader see at once what a relay knows, and lets the
explorer copy a relay by pickling it.
"""

from __future__ import annotations

import enum
from bisect import bisect_left, bisect_right
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Protocol, TypeVar, cast

from mypy_extensions import mypyc_attr

from relay.core import codec
from relay.core.config import CoreConfig, Limits
from relay.core.memory import MemoryBudget
from relay.core.messages import (
    DIRECTED_MESSAGES,
    Entry,
    Heartbeat,
    Interval,
    JoinReply,
    PeerMessage,
    Relayed,
    RepairRequest,
    Report,
    StreamStatus,
    Transaction,
    ViewPhase,
    ViewReply,
    ViewValue,
)
from relay.core.quorum import VoteTally, quorum
from relay.core.seq import HybridClock
from relay.core.shell import Outgoing, Ready
from relay.core.structs import IdentityStruct
from relay.core.timeline import NO_DIGEST, Timeline

GENESIS_POINT = 0
NEVER = -(1 << 62)  # a time long before anything happened
NOT_DUE = 1 << 62  # a time that never comes: a timer not armed
# A relay's incarnation on the first start of its identity (section 3): it never ran
# before, so it has nothing to forget. Each restart takes a higher one.
FIRST_INCARNATION = 1
REQUEST_ID_BITS = 20  # request ids are (incarnation << bits) + n: unique across restarts

ProducerKey = tuple[bytes, int]  # (producer id, producer seq)
# 5.15 a stream's configuration: (version, relays ascending). Version 0 is provisional:
# the relays this relay's topology names, before any view established them.
Configuration = tuple[int, tuple[int, ...]]
PROVISIONAL = 0

# A request resent for want of an answer waits twice as long as before each time, up to
# this many doublings of its first interval: when thousands of streams open at once,
# answers take longer than that interval, and resending at a fixed pace would only
# lengthen the queues that delay them (5.8, 5.12).
RETRY_BACKOFF_MAX_SHIFT = 3


def retry_due(now_ms: int, sent_ms: int, resends: int, interval_ms: int) -> bool:
    """Whether a request sent at `sent_ms`, after `resends` resends, is due again."""
    return now_ms - sent_ms >= interval_ms << min(resends, RETRY_BACKOFF_MAX_SHIFT)


# --- what we know of each peer (5.2) ------------------------------------------------------


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass
class LinkState:
    """What this relay has received of one peer's messages about one stream."""

    expected: int = 1  # next link_seq we expect; 0: not yet synchronised (first contact)
    # bit i: we received link_seq expected - 1 - i (links.LINK_WINDOW of them): duplicates
    seen: int = 0
    contig_floor: int = 0  # peer floor as of its last message with nothing missing before it
    latest_floor: int = 0  # peer floor as of its latest message on this link
    hole_lo: int = -1  # -1: no hole. Else transactions lo < seq <= hole_hi may be missing
    hole_hi: int = -1
    fill_sent_ms: int = NEVER  # when the gap fill in flight was asked for
    fill_lo: int = -1  # where it started (a retry asks again from there)


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass
class PeerState:
    incarnation: int = -1
    last_heard_ms: int = NEVER
    links: dict[str, LinkState] = field(default_factory=dict)
    joined: dict[str, bool] = field(default_factory=dict)
    # stream -> (view number, floor) of its last heartbeat that asked to be admitted (5.12)
    want_in: dict[str, tuple[int, int]] = field(default_factory=dict)
    sync_links: bool = True  # a new link takes the first link_seq it sees as its start
    # 5.2 failure detection: its last heartbeat, and a decaying maximum of the gaps
    # between its heartbeats (a scheduling stall there widens its timeout); when the
    # shell last saw its connection close (`peer_lost`)
    heartbeat_ms: int = NEVER
    gap_max_ms: int = 0
    lost_ms: int = NEVER
    # 5.11 quiet: how much longer than heartbeat_interval_ms its last heartbeat said the
    # next may take, and whether it said it has nothing in flight
    quiet_gap_ms: int = 0
    settled: bool = False
    # 5.11 stream -> the status its last heartbeat gave of the stream
    statuses: dict[str, StreamStatus] = field(default_factory=dict)
    # 5.2 clocks: its wall clock minus ours, as of its last heartbeat (None: not known)
    wall_offset_ms: int | None = None
    hears: frozenset[int] = frozenset()  # the peers it heard directly, as of its heartbeat
    # 5.13 transit: when a message from it last came straight from it, and last came
    # passed on by another relay (last_heard_ms is the later of the two)
    direct_ms: int = NEVER
    relayed_ms: int = NEVER
    # 5.8 stream -> the promise up to which it counted our inherited reports
    inherited_acked: dict[str, int] = field(default_factory=dict)


# --- requests we sent and still want an answer to -----------------------------------------


class Purpose(enum.Enum):
    """Why a RepairRequest was sent: decides what its reply is used for."""

    GAP_FILL = "gap_fill"  # 5.2: a peer's own transactions lost on its link to us
    REPAIR = "repair"  # 5.5: the committed prefix we failed to match
    RESET = "reset"  # 5.7: what a member holds in a zone being rebuilt


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass(slots=True)  # not frozen: a compiled frozen dataclass cannot be unpickled
class Outstanding:
    purpose: Purpose
    peer: int  # the relay asked; only its reply counts


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class Requests:
    """One stream's RepairRequests still awaiting their reply, by request id. A request
    leaves the table when its reply comes, or when whatever it served ended or asked again
    (a reply to it is then ignored and counted as unmatched)."""

    def __init__(self) -> None:
        self._open: dict[int, Outstanding] = {}  # in request order (ids only grow)

    def open(self, request_id: int, purpose: Purpose, peer: int) -> None:
        self._open[request_id] = Outstanding(purpose, peer)

    def take(self, request_id: int, sender: int) -> Outstanding | None:
        """The request `sender` answered, now closed; None if it is not one we await."""
        found = self._open.get(request_id)
        if found is None or found.peer != sender:
            return None
        del self._open[request_id]
        return found

    def __len__(self) -> int:
        return len(self._open)

    def asked(self, purpose: Purpose) -> list[int]:
        """The peers with a request of `purpose` open, in request order."""
        return [o.peer for o in self._open.values() if o.purpose is purpose]

    def close(self, purpose: Purpose, *, peer: int = -1) -> None:
        """Close every request of `purpose` (to `peer`, when given)."""
        for request_id, o in list(self._open.items()):
            if o.purpose is purpose and (peer < 0 or o.peer == peer):
                del self._open[request_id]


# --- per-stream state of the rules ---------------------------------------------------------


class Waiter(IdentityStruct, eq=False):
    """Who waits for a produce's outcome. (A Struct: one per transaction, built in C.)"""

    request_id: int
    origin: int | None  # None: a local client; else the relay that forwarded it


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass(slots=True)
class PendingForward:
    """A produce we forwarded (5.1): to whom, and what to send again should it fall silent."""

    request_id: int  # the client's
    stream: str
    tx: Transaction
    target: int
    deadline_ms: int  # when its client is told `unknown` if no answer came
    # the target's incarnation and when it was sent there: a target that restarted forgot
    # it, and one that does not answer within its suspect timeout may not hear us (5.1)
    target_incarnation: int = -1
    sent_ms: int = 0
    # sent again to another member: the one that fell silent may hold a copy (5.1)
    retargeted: bool = False


class Pending(IdentityStruct, eq=False):
    """A produce we coordinate and its waiters. (A Struct: one per transaction, built in
    C.)"""

    tx: Transaction
    waiters: list[Waiter]
    deadline_ms: int  # when its waiters are told `unknown` if it did not commit

    @property
    def key(self) -> ProducerKey:
        return (self.tx.producer_id, self.tx.producer_seq)


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class PendingProduces:
    """The produces this relay coordinates and has not answered yet (5.1, 5.4)."""

    def __init__(self) -> None:
        # own seq -> pending, in seq order, which is also deadline order: both follow the
        # order in which we coordinated them (a deadline is the monotonic time then plus
        # produce_timeout_ms)
        self.by_seq: dict[int, Pending] = {}
        self.by_key: dict[ProducerKey, int] = {}  # -> own seq

    def __len__(self) -> int:
        return len(self.by_seq)

    def add(
        self, seq: int, key: ProducerKey, tx: Transaction, waiter: Waiter, deadline_ms: int
    ) -> None:
        """A produce we coordinated at `seq` (`key`: its producer key), answered `unknown`
        at `deadline_ms` unless it commits before."""
        self.by_seq[seq] = Pending(tx, [waiter], deadline_ms)
        self.by_key[key] = seq

    def add_many(
        self,
        seqs: Sequence[int],
        keys: list[ProducerKey],
        txs: list[Transaction],
        waiters: list[Waiter],
        deadline_ms: int,
    ) -> None:
        """`add` for each of them, in order."""
        pendings = map(Pending, txs, ([w] for w in waiters), repeat(deadline_ms))
        self.by_seq.update(zip(seqs, pendings, strict=True))
        self.by_key.update(zip(keys, seqs, strict=True))

    def find(self, key: ProducerKey) -> Pending | None:
        """The pending produce of `key`, if there is one."""
        seq = self.by_key.get(key)
        return None if seq is None else self.by_seq[seq]

    def take(self, seq: int) -> Pending | None:
        """Remove the pending produce at `seq` (to answer it)."""
        pending = self.by_seq.pop(seq, None)
        if pending is not None:
            self.by_key.pop(pending.key, None)
        return pending

    def oldest(self) -> int | None:
        return next(iter(self.by_seq), None)


def target_of(msg: PeerMessage) -> int | None:
    """The relay a directed message is for; None for any other. Looked up by the message's
    type: a getattr with a default raises and catches an AttributeError inside for every
    message without the field, on every message sent and received."""
    return cast(Any, msg).target if type(msg) in DIRECTED_MESSAGES else None


class _WithDeadline(Protocol):
    deadline_ms: int


_Key = TypeVar("_Key")


def earliest_deadline_ms(in_deadline_order: Mapping[_Key, _WithDeadline]) -> int | None:
    """The deadline of the first entry (None: none), for a dict kept in deadline order:
    `PendingProduces.by_seq`, `RelayState.forwards`. An answered entry is removed, so it
    leaves no deadline behind to wake the relay (each once did: most of a coordinator's
    ticks at one transaction in flight)."""
    first = next(iter(in_deadline_order.values()), None)
    return None if first is None else first.deadline_ms


def past_deadline(in_deadline_order: Mapping[_Key, _WithDeadline], now_ms: int) -> list[_Key]:
    """The keys of the entries whose deadline passed at `now_ms`, first first."""
    due = []
    for key, entry in in_deadline_order.items():
        if entry.deadline_ms > now_ms:
            break
        due.append(key)
    return due


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass
class RepairState:
    """Fetching the committed prefix (lo, point] from members (5.5)."""

    point: int
    digest: bytes
    lo: int
    candidates: list[int]
    attempt: int = 0
    sent_ms: int = NEVER
    entries: list[Entry] = field(default_factory=list)
    too_old: set[int] = field(default_factory=set)  # candidates whose buffer starts later


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass
class ResetState:
    """Rebuilding our uncommitted zone (lo, hi] as the union of what the members hold,
    after every point we reported there turned out dead (5.7)."""

    lo: int
    hi: int
    started_ms: int
    entries: dict[int, Transaction] = field(default_factory=dict)


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass
class Acceptor:
    """This relay as an acceptor of the instance that decides view `number` (5.12). Having
    promised any ballot, it adds no report until it adopts a view of that number."""

    number: int
    promised: int = -1  # the highest ballot promised; -1: none (not frozen)
    seen: int = -1  # the highest ballot seen refused to us (a proposal must top it)
    accepted_ballot: int = -1
    accepted: ViewValue | None = None
    frozen_ms: int = NEVER  # when it first promised
    active_ms: int = NEVER  # when it last promised or accepted: the instance still moved
    promised_to: tuple[int, int] = (-1, -1)  # (relay, incarnation) whose ballot it promised


# A member to admit: (member, incarnation, the floor it asked at; its interval starts
# above it).
Admission = tuple[int, int, int]


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass
class Proposal:
    """This relay proposing view `number` with `ballot` (5.12)."""

    number: int
    ballot: int
    excluding: tuple[int, ...]
    including: tuple[Admission, ...]
    started_ms: int
    sent_ms: int
    phase: ViewPhase = ViewPhase.PREPARE
    resends: int = 0  # of this phase's requests (RETRY_BACKOFF_MAX_SHIFT)
    promises: dict[int, ViewReply] = field(default_factory=dict)
    accepted_by: set[int] = field(default_factory=set)
    value: ViewValue | None = None
    # 5.15 changes: the relays this proposal moves the stream to (empty: no change)
    moving_to: tuple[int, ...] = ()


EMPTY_VIEW = ViewValue(number=0, start=-1, lo=-1, intervals=())


def open_interval(view: ViewValue, member: int) -> Interval | None:
    """The member's admission still open in `view` (its floor holds the watermark)."""
    for interval in view.intervals:
        if interval.member == member and interval.cut < 0:
            return interval
    return None


def admits(view: ViewValue, member: int, incarnation: int, seq: int) -> bool:
    """Whether `view` counts the transaction `seq` that `member` coordinated in
    `incarnation` (5.12): it lies in one of the member's intervals of that incarnation."""
    for i in view.intervals:
        if (
            i.member == member
            and i.incarnation == incarnation
            and seq > i.since
            and (i.cut < 0 or seq <= i.cut)
        ):
            return True
    return False


def admits_run(view: ViewValue, member: int, incarnation: int, lo: int, hi: int) -> bool:
    """Whether `view` counts every seq from `lo` to `hi` that `member` coordinated in
    `incarnation`: one of its intervals holds them all."""
    return any(
        i.member == member
        and i.incarnation == incarnation
        and lo > i.since
        and (i.cut < 0 or hi <= i.cut)
        for i in view.intervals
    )


def admits_seq(view: ViewValue, member: int, seq: int) -> bool:
    """Like `admits`, for a transaction whose incarnation is not known (any interval)."""
    return any(
        i.member == member and seq > i.since and (i.cut < 0 or seq <= i.cut) for i in view.intervals
    )


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
@dataclass
class JoinState:
    """Joining (no history) or rebasing (history too old to repair) (5.5, 5.8)."""

    amnesiac: bool  # joining after a start: must hear every other member first
    need_point: int = -1
    replies: dict[int, JoinReply] = field(default_factory=dict)
    first_round_done: bool = False
    sent_ms: int = NEVER
    resends: int = 0  # of the request last sent (RETRY_BACKOFF_MAX_SHIFT)
    asked_after_commit: int = -1  # highest known commit we already asked a base for


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class StreamState:
    """Everything one relay knows about one stream it serves (section 4)."""

    def __init__(
        self,
        stream: str,
        config: Configuration,
        me: int,
        cfg: CoreConfig,
        budget: MemoryBudget,
    ) -> None:
        limits = cfg.limits
        self.stream = stream
        # 5.15 the configuration the stream counts votes under: its version (0:
        # provisional, this relay's topology's, until a view establishes it) and relays;
        # members, peers and q follow it (membership.set_config changes them together)
        self.config_version, self.members = config
        self.peers = tuple(m for m in self.members if m != me)
        self.q = quorum(len(self.members))
        # the relays this relay's topology names for the stream (what the operator wants)
        self.desired = cfg.topology.members(stream)
        # peer -> the other configuration it last stated for the stream (5.15: its
        # messages under it are not taken), cleared when it states ours again
        self.disagree: dict[int, Configuration] = {}
        self.config_recorded = False  # the configuration is in our acceptor record
        # Something committed above the genesis under it, here or in an earlier
        # incarnation (our record says so): a join that finds no history anywhere knows
        # history was lost (5.8), rather than a stream that never had any.
        self.committed_before = False
        self.timeline = Timeline(
            stream, limits.dedupe_window_entries, limits.late_max_entries, budget
        )
        self.requests = Requests()
        self.fenced = True  # 5.9: fewer than a quorum heard
        # 5.1 coordinating: what we issued and not yet published, and who waits for it
        self.link_seq_out = 0  # our messages on this stream's topic (5.2)
        self.out_entries: list[Entry] = []
        self.out_bytes = 0  # the sizes of their transactions (Transaction.size_bytes)
        self.coordinated_ms = NEVER  # when we last issued a transaction of the stream
        self.lead = -1  # the highest lead we announced on the stream (5.2; -1: none)
        self.pending = PendingProduces()
        # 5.3-5.4 reporting and counting votes
        self.votes = VoteTally(self.members, limits.max_pending_vote_points)
        self.out_reports: list[Report] = []
        self.report_log: deque[Report] = deque(maxlen=limits.report_log_entries)
        # The last seq of every TxBatch published or received, not yet reported past: the
        # points every member reports (5.3), ascending, at most one per entry held.
        self.run_ends: list[int] = []
        self.known_commit: tuple[int, bytes] = (-1, NO_DIGEST)
        self.commit_sources: set[int] = set()
        self.announced_commit = -1
        # The highest committed point another member announced (its Reports or heartbeat):
        # every member hears that announcement, so ours can wait (5.4).
        self.others_announced = -1
        # When the committed point must be announced by a Reports of its own if none went
        # out since it moved (5.4): at once, or later when every member commits it anyway.
        self.announce_by_ms = NEVER
        self.progress_ms = NEVER  # last time the committed point moved
        # since when something waits to commit (an entry held above the committed point, or
        # a pending produce), as of the last tick: the status says how long it waited
        self.waiting_since_ms = NEVER
        # Votes of member m are all known at points <= known_through[m] (its report
        # stream arrived with nothing missing); a restart of m leaves its earlier
        # incarnation's later votes unknowable (votes_unknowable_above).
        self.known_through: dict[int, int] = {}
        self.votes_unknowable_above: dict[int, int] = {}
        # Our own reports count towards a commit we recognise only once some member has
        # acknowledged receiving them: then every vote that ever helped a commit is known
        # to a member that survives us, which is what lets our next incarnation inherit.
        self.own_unacked: deque[Report] = deque()
        self.own_acked_through = -1
        self.acks_sent: dict[int, int] = {}
        self.acks_by_ms = NOT_DUE  # when acks that moved go out alone if nothing took them
        # 5.12 views: the view adopted, this relay as acceptor and proposer of the next
        self.view = EMPTY_VIEW
        self.acceptor = Acceptor(number=1)
        self.proposal: Proposal | None = None
        self.view_wanted_ms = NEVER  # since when this relay wants a view change
        self.view_adopted_ms = NEVER  # when this relay adopted its current view
        self.stall_reason = ""  # fencing.stall's reason, as of the last tick
        self.stall_since_ms = NEVER  # since when it holds
        # peer -> when we last sent it our view, and how often since it was seen current
        self.view_pushed: dict[int, tuple[int, int]] = {}
        # 5.11 dormancy: the stream had nothing in flight after its last tick and nothing
        # concerned it since (see RelayCore.ready): ticks, ready() and heartbeats pass it
        # by until an input concerns it or what the relay knows of its peers changes
        self.dormant = False
        self.touched = True  # an input concerned it since its last tick: not dormant yet
        self.status_told: StreamStatus | None = None  # in our last heartbeat that gave one
        # 5.12: a produce reached us for it, or it was opened at start (named or declared):
        # once a stream is in use its members ask to be admitted; until then, opened only
        # by reads or a member's join, it gets no view (see view.in_use)
        self.written = False
        # (member, incarnation) -> that incarnation's last contiguous floor here, once a
        # newer incarnation was heard while the view still admits the older one
        self.stale_floors: dict[tuple[int, int], int] = {}
        # Instances this relay takes no part in as an acceptor: a restarted relay may have
        # promised or accepted in them before it lost its memory.
        self.abstain_through = 0
        # 5.5 repair
        self.repair: RepairState | None = None
        self.mismatch_since_ms = NEVER
        # 5.7 reset
        self.reset: ResetState | None = None
        self.reports_paused = False  # a split was seen: add no points until it is rebuilt
        self.rebuilt_through = -1  # the highest point of a zone we rebuilt
        self.dead_check_ms = NEVER
        # 5.8 joining. Our promise (see StreamStatus): at or below votes_final_through, our
        # votes are those members got from us or `inherited` (our earlier incarnations'
        # reports that members saw); we never report there again.
        self.join: JoinState | None = JoinState(amnesiac=True)
        self.inherited: tuple[Report, ...] = ()
        self.inherited_sent_ms = NEVER  # when our heartbeat last carried them
        # member -> its promise, for members whose inherited reports we counted in full
        # (for their current incarnation)
        self.inherited_counted: dict[int, int] = {}
        self.votes_final_through = -1
        # The last committed (point, digest) known from durable history (the store, a
        # spool) when this relay started without any (see RelayCore.seed).
        self.seed: tuple[int, bytes] | None = None
        # 5.8: every member of the established configuration came back without the
        # stream's history and no seed held it: it began again at the genesis, and
        # positions below this floor (ours then) name records that are gone. -1: no loss.
        self.history_lost_below = -1
        # 5.15 changes: when a change of the relays last waited for them to hold the history
        self.change_deferred_ms = NEVER
        # 5.15 establishment: when a first view we proposed had to carry one that leaves
        # us out (its relays finish the instance; we propose none for a while)
        self.first_elsewhere_ms = NEVER

    @property
    def configuration(self) -> Configuration:
        """(version, relays): the configuration the stream counts votes under (5.15)."""
        return (self.config_version, self.members)

    def mark_run_end(self, seq: int) -> None:
        """`seq` ended a TxBatch: a point the stream's members will all report (5.3)."""
        ends = self.run_ends
        if not ends or seq > ends[-1]:
            ends.append(seq)
            return
        i = bisect_left(ends, seq)
        if ends[i] != seq:
            ends.insert(i, seq)

    def take_run_ends(self, above: int, upto: int) -> list[int]:
        """The run ends in (above, upto], forgetting every one at or below `upto`."""
        ends = self.run_ends
        cut = bisect_right(ends, upto)
        taken = ends[bisect_right(ends, above, 0, cut) : cut]
        del ends[:cut]
        return taken

    def forget_run_ends(self, upto: int) -> None:
        """Drop the run ends at or below `upto` (committed: nobody needs them reported)."""
        del self.run_ends[: bisect_right(self.run_ends, upto)]

    def end_repair(self) -> None:
        self.repair = None
        self.requests.close(Purpose.REPAIR)

    def end_reset(self) -> None:
        self.reset = None
        self.requests.close(Purpose.RESET)


# --- the relay ------------------------------------------------------------------------------


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class RelayState:
    """One relay: its clocks, peers and streams, and what it has to say to the shell."""

    def __init__(self, config: CoreConfig, incarnation: int, now_ms: int) -> None:
        self.config = config
        self.limits: Limits = config.limits
        self.topology = config.topology
        self.id = config.relay_id
        self.incarnation = incarnation
        self.clock = HybridClock(self.id)
        self.clock.follow_wall(now_ms)
        self.wall_ms = now_ms
        self.now_ms = now_ms  # monotonic time; the first input with mono_ms replaces it
        self.counters: Counter[str] = Counter()
        self.last_tick_ms = self.now_ms  # a late tick means this relay itself stalled
        self.peers: dict[int, PeerState] = {
            r: PeerState() for r in self.topology.relay_ids if r != self.id
        }
        self.streams: dict[str, StreamState] = {}
        self.memory = MemoryBudget(self.limits.relay_buffer_max_bytes)  # 5.10
        self.outbox = Ready()  # drained by ready()
        self.last_request_id = incarnation << REQUEST_ID_BITS
        # 5.1 forwarding: our forward id -> the forward, in id order, which is also their
        # deadlines' order (as PendingProduces.by_seq's)
        self.forwards: dict[int, PendingForward] = {}
        # 5.9 heartbeats
        self.last_heartbeat_ms = NEVER
        self.floor_sent = -1  # the highest floor any message carried
        self.announce_floor = False  # transactions arrived: tell the floor promptly
        # 5.11 quiet: the last time anything but a heartbeat came, went or was asked of us;
        # when this relay last became busy after a calm (quiet peers must answer from
        # then on); whether it heartbeats at the quiet interval; the interval in force
        # at its last tick (a later tick is only a stall past that)
        self.busy_ms = self.now_ms
        self.woke_ms = self.now_ms
        self.quiet = False
        self.tick_interval_ms = self.limits.heartbeat_interval_ms
        # 5.12 acceptor memory: None while the shell keeps none (a restart then abstains
        # from the next view change); else stream -> what was remembered at the start.
        self.acceptor_memory: dict[str, Acceptor] | None = None
        self.acceptor_forgotten: set[str] = set()  # streams whose record was unreadable
        # 5.13 transit, planned every tick: peer -> the relay our frames for it also go
        # through (it does not hear us directly); the peers our last heartbeat said we
        # hear directly
        self.route_via: dict[int, int] = {}
        self.hears_sent: tuple[int, ...] = ()
        # 5.11 dormancy: what every stream's timers read of the peers, as of the last tick
        # (a change wakes every stream); the next dormant stream whose status a heartbeat
        # repeats; the stream names in order
        self.peer_picture: tuple[tuple[object, ...], tuple[object, ...]] = ((), ())
        self.status_cursor = 0
        self._names: list[str] = []
        # 5.14 spooling: the bytes the shell's spool can still take (None: no spool), the
        # streams it cannot take; whether our spool is full, as our heartbeats say; the
        # peers whose last heartbeat said theirs is
        self.spool_room_bytes: int | None = None
        self.spool_refused: frozenset[str] = frozenset()
        self.spool_blocked = False
        self.spool_full_peers: set[int] = set()
        # what we owed our spool when the room was last set (at least the records of
        # every held entry above its timeline's spooled_through), and the memory budget's
        # added_bytes then: entries added since owe at most what they cost
        self.spool_owed_bytes = 0
        self.spool_added_mark = 0
        self.spool_counted_ms = NEVER  # when what we owe was last counted exactly
        self.spool_held_back: set[str] = set()  # streams with records left for more room
        # 5.15 configurations: those of the acceptor records of streams not opened yet (a
        # stream opens under its record's), and of the streams this relay's topology
        # serves but whose established configuration leaves it out (it does not serve them)
        self.recorded: dict[str, Configuration] = {}
        self.recorded_committed: set[str] = set()  # of those, the ones that committed
        self.foreign: dict[str, Configuration] = {}
        self.left_link_seq: dict[str, int] = {}  # of those: our last link counter there
        # 5.11 closing (relay/core/closing.py), of the streams not known to be in use,
        # oldest first: stream -> when a read last reached it here, and stream -> when it
        # opened for those no read reached here; the link counters of the streams
        # closed, by name for the last max_streams, else the highest of those forgotten
        # (a stream opening starts above it)
        self.read_since: OrderedDict[str, int] = OrderedDict()
        self.unread_since: OrderedDict[str, int] = OrderedDict()
        self.closed_link_seq: OrderedDict[str, int] = OrderedDict()
        self.closed_link_floor = 0
        # streams closed lately -> their status as closed (not joined), and how many more
        # heartbeats tell it (closing.closed_statuses)
        self.closed_told: OrderedDict[str, tuple[StreamStatus, int]] = OrderedDict()
        # 5.15 changes: stream -> the decided view that took this relay off it (kept in its
        # acceptor record too), told to a relay the view kept that asks for a view of the
        # old relays (`view.tell_left`): when every other old relay left as well (a
        # stream of two shrunk to one), nobody else can tell it the change was decided.
        self.left_views: dict[str, ViewValue] = {}

    def send(self, msg: PeerMessage, stream: str | None = None, *, busy: bool = True) -> None:
        """Publish `msg`: to the stream's members when `stream` is set, else to its target,
        else to every peer (see Outgoing). A message for a relay that does not hear us
        goes through one that it hears (5.13). `busy`: sending it ends quiet (5.11), as
        everything but a heartbeat does."""
        target = target_of(msg)
        self.floor_sent = max(self.floor_sent, msg.floor)
        if busy and not isinstance(msg, Heartbeat):
            self.note_busy(self.now_ms)
        frame = codec.encode(msg)
        if target is None or target not in self.route_via:
            self.outbox.outgoing.append(Outgoing(frame, stream=stream, target=target))
        if self.route_via and not isinstance(msg, Relayed):
            self._send_around(frame, msg.floor, stream, target)

    def _send_around(
        self, frame: bytes, floor: int, stream: str | None, target: int | None
    ) -> None:
        """Send `frame`, wrapped, through the relay planned for each recipient that does
        not hear us directly (5.13): a message addressed to it goes only that way, a
        published one to everyone directly as well, first (no frame may carry our floor
        past a transaction ahead of the frame that carries the transaction)."""
        if target is not None:
            recipients: Iterable[int] = (target,) if target in self.route_via else ()
        elif stream is not None:
            members = self.topology.members(stream)
            recipients = [p for p in self.route_via if p in members]
        else:
            recipients = list(self.route_via)
        for p in recipients:
            via = self.route_via[p]
            hop = Relayed(self.id, self.incarnation, floor, via, p, frame)
            self.outbox.outgoing.append(Outgoing(codec.encode(hop), target=via))
            self.counters["transit_sent"] += 1

    def note_busy(self, now_ms: int) -> None:
        """Something other than a heartbeat came, went or was asked of us (5.11 quiet):
        heartbeat at the usual interval again. After a calm, from now on quiet peers must
        answer within their timeout (they hear we are busy and leave quiet at once)."""
        if now_ms - self.busy_ms >= self.limits.quiet_after_ms:
            self.woke_ms = now_ms
        self.busy_ms = now_ms
        self.quiet = False

    def remember(self, st: StreamState) -> None:
        """The stream's acceptor changed: the shell must keep it durably before it sends
        anything this relay said after (Ready.acceptors), if it keeps acceptor memory."""
        if self.acceptor_memory is None:
            return
        acc = st.acceptor
        record = codec.AcceptorRecord(
            acc.number,
            acc.promised,
            acc.accepted_ballot,
            acc.accepted,
            *st.configuration,
            committed=st.committed_before,
            left=self.left_views.get(st.stream),
        )
        st.config_recorded = True
        self.outbox.acceptors.append((st.stream, codec.encode_acceptor(record)))

    def request_id(self) -> int:
        self.last_request_id += 1
        return self.last_request_id

    def ask(
        self,
        st: StreamState,
        purpose: Purpose,
        peer: int,
        lo: int,
        hi: int,
        *,
        origin: int = -1,
    ) -> None:
        """Ask `peer` for its entries of the stream in (lo, hi] (only those `origin`
        coordinated, if set), noting the request and its purpose in the stream's table."""
        request_id = self.request_id()
        st.requests.open(request_id, purpose, peer)
        self.send(
            RepairRequest(
                sender=self.id,
                incarnation=self.incarnation,
                floor=self.clock.floor,
                target=peer,
                stream=st.stream,
                request_id=request_id,
                lo=lo,
                hi=hi,
                origin=origin,
            )
        )

    def stream(self, stream: str) -> StreamState:
        """The stream's state, opened on first use (the caller checked `can_open`), and
        awake: an input concerns it (5.11 dormancy)."""
        st = self.streams.get(stream)
        if st is not None:
            self.wake(st)
        else:
            recorded = self.recorded.pop(stream, None)
            config = recorded or (PROVISIONAL, self.topology.members(stream))
            st = self.streams[stream] = StreamState(
                stream, config, self.id, self.config, self.memory
            )
            self.know_peers(st.peers)  # a recorded member the topology no longer lists
            self.note_busy(self.now_ms)  # it has to join
            if self.acceptor_memory is not None and stream in self.acceptor_memory:
                st.acceptor = self.acceptor_memory[stream]
            st.config_recorded = recorded is not None
            # (5.11 closing: its idle time runs from now; a stream closed before goes
            # on counting its messages where it stopped)
            self.unread_since[stream] = self.now_ms
            st.link_seq_out = self.closed_link_seq.pop(stream, self.closed_link_floor)
            if stream in self.recorded_committed:
                self.recorded_committed.discard(stream)
                st.committed_before = True
        return st

    def know_peers(self, relays: tuple[int, ...]) -> None:
        """Every one of `relays` is a peer: a member the topology no longer lists (or
        a relay let go of since, RelayCore.forget_relays) is still one; it is never
        heard unless the shell kept its link, and counts as down."""
        for m in relays:
            if m not in self.peers:
                self.peers[m] = PeerState()

    def members(self, stream: str) -> tuple[int, ...]:
        """R(S): the relays of the stream's configuration (5.15), from its state once it
        is open (which spares the per-message path a call into the topology's interpreted
        module); for a stream not open, the configuration learnt or recorded, else the
        topology's."""
        st = self.streams.get(stream)
        if st is not None:
            return st.members
        known = self.foreign.get(stream) or self.recorded.get(stream)
        return known[1] if known is not None else self.topology.members(stream)

    def serves(self, stream: str) -> bool:
        """Whether this relay is one of the stream's members (5.15)."""
        return self.id in self.members(stream)

    def can_open(self, stream: str) -> bool:
        """Bound the number of streams a relay tracks (patterns admit any name)."""
        return stream in self.streams or len(self.streams) < self.limits.max_streams

    def wake(self, st: StreamState) -> None:
        st.dormant = False
        st.touched = True

    def invalidate_names(self) -> None:
        """A stream was closed (membership.leave, closing.close): the sorted names are
        made again."""
        self._names = []

    def stream_names_sorted(self) -> list[str]:
        """The streams this relay tracks, by name (opened, and closed when their
        configuration leaves this relay out or they stayed blank and idle:
        `invalidate_names`)."""
        if len(self._names) != len(self.streams):
            self._names = sorted(self.streams)
        return self._names

    def served_streams(self) -> list[StreamState]:
        return [self.streams[s] for s in self.stream_names_sorted()]


def chunks(entries: list[Entry], limits: Limits) -> Iterator[list[Entry]]:
    """Split entries into frames of at most max_batch_entries and max_batch_bytes (5.10)."""
    chunk: list[Entry] = []
    size = 0
    for entry in entries:
        entry_bytes = entry[1].size_bytes()
        if chunk and (
            len(chunk) >= limits.max_batch_entries or size + entry_bytes > limits.max_batch_bytes
        ):
            yield chunk
            chunk, size = [], 0
        chunk.append(entry)
        size += entry_bytes
    if chunk:
        yield chunk
