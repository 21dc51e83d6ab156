"""RelayCore: every protocol decision of one relay, with no I/O of its own.

Theory of operation (docs/protocol.md is the full spec; section numbers below refer to it):

* Inputs: `receive(frame, now_ms, mono_ms)` for a peer's frame, `produce(request, ...)` for
  a client's transaction, `tick(...)` as time passes, `read(...)` for consumers. `now_ms`
  is the wall clock (sequence numbers, skew check); `mono_ms` the monotonic clock (timers).
* Output: `ready()` drains what to publish, what to answer producers, what committed
  entries to hand to consumers and where the delivered history restarted. The shell
  publishes every `Outgoing` in order on its one PUB socket, so each peer link stays FIFO.
* A member of stream S coordinates a produce by giving it the next sequence number of its
  hybrid clock and publishing it on S's `in` topic. Every member inserts it in its timeline.
  Once a point is *stable* (at or below the watermark W: the lowest floor of the live
  members, taken from the last message of each that followed all earlier ones), the member
  reports its digest there, once (5.3). A point commits when a quorum reports the same
  digest (5.4); a member delivers the committed prefix when its own digest matches, and
  otherwise repairs from members that reported the committed digest (5.5).
* Safety rests only on (6): commit = a quorum of identical counted reports at one point;
  one counted report per relay per point, across restarts; a reported prefix changes only
  by adopting a committed digest, or by rebuilding a zone whose every point is dead (5.7);
  quorums intersect. Clocks and timeouts only decide when things happen.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from relay.core import codec
from relay.core import digest as dg
from relay.core.config import CoreConfig, quorum
from relay.core.messages import (
    CHANNEL_OF,
    Delivery,
    Entry,
    Forward,
    ForwardReply,
    Heartbeat,
    JoinReply,
    JoinRequest,
    Outcome,
    Outgoing,
    PeerMessage,
    ProduceReply,
    ProduceRequest,
    ReadResult,
    ReadStatus,
    Refusal,
    RejectReason,
    RepairReply,
    RepairRequest,
    RepairStatus,
    Report,
    Reports,
    StreamStatus,
    Transaction,
    TxBatch,
)
from relay.core.seq import MAX_SEQ, HybridClock, end_of_ms, ms_of, relay_of
from relay.core.timeline import NO_DIGEST, CommittedRecord, DedupeWindow, Timeline
from relay.core.votes import VoteTally
from relay.errors import FieldError, FrameError

GENESIS_POINT = 0
NEVER = -(1 << 62)  # a time long before anything happened
REQUEST_ID_BITS = 20  # request ids are (incarnation << bits) + n: unique across restarts
# A suspicion sync (5.2) waits at most this many repair_retry_ms rounds for the members it
# asked, then lets the watermark leave the suspected member out anyway.
SYNC_MAX_ROUNDS = 3


@dataclass
class Ready:
    outgoing: list[Outgoing] = field(default_factory=list)
    replies: list[ProduceReply] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    # (stream, point): this relay's delivered history now starts after `point` (it joined,
    # or its gap was older than every member's buffer). Entries between the last one
    # delivered before and `point` are not held here; consumers must read them elsewhere.
    rebases: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class LinkState:
    """What this relay has received of one peer's messages about one stream."""

    expected: int = 1  # next link_seq we expect; 0: not yet synchronised (first contact)
    contig_floor: int = 0  # peer floor as of its last message with nothing missing before it
    latest_floor: int = 0  # peer floor as of its latest message on this link
    hole_lo: int = -1  # -1: no hole. Else transactions lo < seq <= hole_hi may be missing
    hole_hi: int = -1
    fill_request: int = 0
    fill_sent_ms: int = NEVER
    fill_lo: int = -1


@dataclass
class PeerState:
    incarnation: int = -1
    last_heard_ms: int = NEVER
    refused_us_ms: int = NEVER
    refusal_sent_ms: int = NEVER
    links: dict[str, LinkState] = field(default_factory=dict)
    joined: dict[str, bool] = field(default_factory=dict)
    sync_links: bool = True  # a new link takes the first link_seq it sees as its start


@dataclass
class Waiter:
    request_id: int
    origin: int | None  # None: a local client; else the relay that forwarded it


@dataclass
class RepairState:
    point: int
    digest: bytes
    lo: int
    candidates: list[int]
    attempt: int = 0
    request_id: int = 0
    sent_ms: int = NEVER
    entries: list[Entry] = field(default_factory=list)
    too_old: set[int] = field(default_factory=set)  # candidates whose buffer starts later


@dataclass
class ResetState:
    """Rebuilding our uncommitted zone (lo, hi] as the union of what the members hold,
    after every point we reported there turned out dead."""

    lo: int
    hi: int
    awaiting: dict[int, int]  # request id -> peer
    started_ms: int
    entries: dict[int, Transaction] = field(default_factory=dict)


@dataclass
class SuspectSync:
    """Before the watermark leaves out a suspected member, fetch from the live members the
    transactions it coordinated above the floor we last had from it (5.2): a frame it sent
    to only some members before it died then reaches all of them, and they agree."""

    heard_ms: int  # the member's last_heard_ms at the start: hearing it again ends the sync
    lo: int
    started_ms: int
    sent_ms: int
    awaiting: dict[int, int] = field(default_factory=dict)  # request id -> member asked
    done: bool = False


@dataclass
class JoinState:
    """Joining (no history) or rebasing (history too old to repair)."""

    amnesiac: bool  # joining after a start: must hear every other member first
    need_point: int = -1
    replies: dict[int, JoinReply] = field(default_factory=dict)
    first_round_done: bool = False
    sent_ms: int = NEVER
    asked_after_commit: int = -1  # highest known commit we already asked a base for


class StreamState:
    def __init__(self, stream: str, members: tuple[int, ...], me: int, cfg: CoreConfig) -> None:
        limits = cfg.limits
        self.stream = stream
        self.members = members
        self.peers = tuple(m for m in members if m != me)
        self.q = quorum(len(members))
        self.timeline = Timeline(stream, limits.dedupe_window_entries, limits.late_max_entries)
        self.votes = VoteTally(members, limits.max_pending_vote_points)
        self.link_seq_out = 0
        self.out_entries: list[Entry] = []
        self.out_reports: list[Report] = []
        self.pending: dict[int, list[Waiter]] = {}  # own seq -> who waits for its outcome
        self.pending_keys: dict[tuple[bytes, int], int] = {}  # (pid, pseq) -> own seq
        self.pending_key_of: dict[int, tuple[bytes, int]] = {}  # own seq -> (pid, pseq)
        self.pending_deadlines: deque[tuple[int, int]] = deque()  # (deadline_ms, seq)
        self.known_commit: tuple[int, bytes] = (-1, NO_DIGEST)
        self.commit_sources: set[int] = set()
        self.announced_commit = -1
        self.repair: RepairState | None = None
        self.mismatch_since_ms = NEVER
        self.join: JoinState | None = JoinState(amnesiac=True)
        self.fenced = True
        self.report_log: deque[Report] = deque(maxlen=limits.report_log_entries)
        # Votes of member m are all known at points <= known_through[m] (its report
        # stream arrived with nothing missing); a restart of m leaves its earlier
        # incarnation's later votes unknowable (votes_unknowable_above).
        self.known_through: dict[int, int] = {}
        self.votes_unknowable_above: dict[int, int] = {}
        self.reset: ResetState | None = None
        self.reports_paused = False  # a split was seen: add no points until it is rebuilt
        self.rebuilt_through = -1  # the highest point of a zone we rebuilt (5.7)
        # Our own reports count towards a commit we recognise only once some member has
        # acknowledged receiving them: then every vote that ever helped a commit is known
        # to a member that survives us, which is what lets our next incarnation inherit.
        self.own_unacked: deque[Report] = deque()
        self.own_acked_through = -1
        self.acks_sent: dict[int, int] = {}
        # Our promise (see StreamStatus): at or below votes_final_through, our votes are
        # those members got from us or `inherited` (our earlier incarnations' reports that
        # members saw); we never report there again.
        self.inherited: tuple[Report, ...] = ()
        self.votes_final_through = -1
        self.progress_ms = NEVER  # last time the committed point moved
        self.dead_check_ms = NEVER
        self.syncs: dict[int, SuspectSync] = {}  # suspected member -> its sync (5.2)
        # The last committed (point, digest) known from durable history (the store, a
        # spool) when this relay started without any (see RelayCore.seed).
        self.seed: tuple[int, bytes] | None = None


class RelayCore:
    def __init__(self, config: CoreConfig, incarnation: int, now_ms: int) -> None:
        self.config = config
        self.limits = config.limits
        self.topology = config.topology
        self.id = config.relay_id
        self.incarnation = incarnation
        self.clock = HybridClock(self.id)
        self.clock.follow_wall(now_ms)
        self.wall_ms = now_ms
        self.now_ms = now_ms  # monotonic time; the first input with mono_ms replaces it
        self.counters: Counter[str] = Counter()
        self.peers: dict[int, PeerState] = {
            r: PeerState() for r in self.topology.relay_ids if r != self.id
        }
        self.streams: dict[str, StreamState] = {}
        self._ready = Ready()
        self._next_request = incarnation << REQUEST_ID_BITS
        self._forwards: dict[int, int] = {}  # our forward id -> the client's request id
        self._forward_deadlines: deque[tuple[int, int]] = deque()
        self._last_heartbeat_ms = NEVER
        self._floor_sent = -1
        self._announce_floor = False
        named = [p for p in self.topology.subscriptions[self.id] if not any(c in p for c in "*?[")]
        for stream in named + [
            s for s in config.declared_streams if self.topology.serves(self.id, s)
        ]:
            self._stream(stream)  # named and declared streams join at start; others on first use

    # === inputs ==========================================================================

    def _set_time(self, wall_ms: int, mono_ms: int | None) -> int:
        """Two clocks come in: the wall clock (Unix ms) only feeds sequence numbers and the
        skew check; every timer runs on the monotonic clock, so a wall clock stepping back
        does not silence heartbeats or hide dead peers. Returns the monotonic time."""
        self.wall_ms = wall_ms
        self.now_ms = wall_ms if mono_ms is None else mono_ms
        return self.now_ms

    def receive(self, frame: bytes, now_ms: int, mono_ms: int | None = None) -> None:
        """A frame from a peer. Never raises; a bad frame is counted and changes nothing.
        `now_ms`: wall clock (Unix ms); `mono_ms`: monotonic clock (defaults to now_ms)."""
        now_ms = self._set_time(now_ms, mono_ms)
        try:
            msg = codec.decode(frame, self.limits.max_frame_bytes)
            self._check(msg)
        except FrameError as error:
            self.counters[error.counter] += 1
            return
        peer = self.peers[msg.sender]
        if msg.incarnation < peer.incarnation:
            self.counters["stale_incarnation"] += 1
            return
        ahead_ms = self.clock.ahead_by_ms(msg.floor, self.wall_ms)
        if ahead_ms > self.limits.max_clock_ahead_ms:
            self._refuse(peer, msg.sender, f"clock ahead by {ahead_ms} ms", now_ms)
            return
        if msg.incarnation > peer.incarnation:
            self._new_incarnation(msg.sender, peer, msg.incarnation)
        peer.last_heard_ms = now_ms
        self.clock.raise_floor(msg.floor)
        self._dispatch(msg, peer, now_ms)

    def produce(self, request: ProduceRequest, now_ms: int, mono_ms: int | None = None) -> None:
        now_ms = self._set_time(now_ms, mono_ms)
        self._accept(request.stream, request.tx, Waiter(request.request_id, None), now_ms)

    def peer_lost(self, relay_id: int, now_ms: int, mono_ms: int | None = None) -> None:
        """The shell saw its connection to a peer close (the process died, the host went
        away): suspect it now rather than after suspect_timeout_ms of silence. Hearing from
        it again makes it live again. A hint for liveness only; safety never rests on it."""
        now_ms = self._set_time(now_ms, mono_ms)
        peer = self.peers.get(relay_id)
        if peer is None:
            self.counters["peer_lost_unknown"] += 1
            return
        silent_since = now_ms - self.limits.suspect_timeout_ms
        if peer.last_heard_ms > silent_since:
            peer.last_heard_ms = silent_since
            self.counters["peer_lost"] += 1

    def tick(self, now_ms: int, mono_ms: int | None = None) -> None:
        now_ms = self._set_time(now_ms, mono_ms)
        self.clock.follow_wall(self.wall_ms)
        if now_ms - self._last_heartbeat_ms >= self.limits.heartbeat_interval_ms:
            self._send_heartbeat(now_ms)
        for st in self.streams.values():
            self._tick_stream(st, now_ms)
        while self._forward_deadlines and self._forward_deadlines[0][0] <= now_ms:
            _, fid = self._forward_deadlines.popleft()
            client_request = self._forwards.pop(fid, None)
            if client_request is not None:
                self._ready.replies.append(ProduceReply(client_request, Outcome.UNKNOWN))

    def ready(self) -> Ready:
        """Drain what the shell must do now: publish, answer, deliver."""
        for st in self.streams.values():
            self._flush_stream(st)
        if self._announce_floor and self.clock.floor > self._floor_sent:
            self._send_heartbeat(self.now_ms)
        self._announce_floor = False
        out, self._ready = self._ready, Ready()
        return out

    # === queries =========================================================================

    def read(self, stream: str, after_seq: int, max_entries: int) -> ReadResult:
        members = self.topology.members(stream)
        if not members:
            return ReadResult(ReadStatus.UNKNOWN_STREAM)
        if self.id not in members:
            return ReadResult(ReadStatus.REDIRECT, redirect=members)
        if not self._can_open(stream):
            return ReadResult(
                ReadStatus.NOT_READY, redirect=tuple(m for m in members if m != self.id)
            )
        st = self._stream(stream)
        redirect = self._redirect_for(st)
        if st.join is not None and st.join.amnesiac:
            return ReadResult(ReadStatus.NOT_READY, redirect=redirect)
        if st.fenced:
            return ReadResult(ReadStatus.FENCED, redirect=redirect)
        tl = st.timeline
        if after_seq >= 0 and after_seq < tl.base_point and tl.base_point != GENESIS_POINT:
            return ReadResult(
                ReadStatus.OUT_OF_RANGE, oldest=tl.base_point, committed=tl.committed_point
            )
        entries = tl.committed_after(after_seq, max_entries)
        return ReadResult(
            ReadStatus.OK, tuple(entries), oldest=tl.base_point, committed=tl.committed_point
        )

    def seed(self, stream: str, point: int, digest: bytes) -> bool:
        """Before the stream joins: its last committed point and digest as durable history
        (the store, this relay's spool) knows them. Should no member hold any history of
        the stream when it joins, the highest seed any member offers becomes the base
        instead of the genesis, so the chain and the sequence numbers carry on from the
        stored history. False (and nothing changes) if the stream is not served here or
        has begun joining. ValueError if the point or digest cannot be one."""
        if point <= GENESIS_POINT or len(digest) != dg.DIGEST_BYTES:
            raise ValueError(f"not a committed point: ({point}, {digest!r})")
        if not self.topology.serves(self.id, stream) or not self._can_open(stream):
            return False
        st = self._stream(stream)
        join = st.join
        if join is None or not join.amnesiac or join.first_round_done:
            return False
        if st.seed is None or point > st.seed[0]:
            st.seed = (point, digest)
        self.clock.raise_floor(point)  # our own sequence numbers come after it
        return True

    def committed_records(
        self, stream: str, after_seq: int, max_entries: int
    ) -> tuple[int, bytes, list[CommittedRecord]]:
        """For a spool: (base point, base digest, committed records after `after_seq`).
        Records below the base were evicted (or never held: the relay joined above them);
        a spool behind the base has a gap that other relays' spools must cover."""
        st = self.streams.get(stream)
        if st is None:
            return -1, NO_DIGEST, []
        tl = st.timeline
        return tl.base_point, tl.base_digest, tl.records_after(after_seq, max_entries)

    def fenced(self, stream: str) -> bool:
        st = self.streams.get(stream)
        return st is None or st.fenced

    def joined(self, stream: str) -> bool:
        st = self.streams.get(stream)
        return st is not None and (st.join is None or not st.join.amnesiac)

    def committed_point(self, stream: str) -> int:
        st = self.streams.get(stream)
        return st.timeline.committed_point if st else -1

    def status(self) -> dict[str, object]:
        return {
            "relay": self.id,
            "incarnation": self.incarnation,
            "floor": self.clock.floor,
            "streams": {
                name: {
                    "joined": st.join is None,
                    "fenced": st.fenced,
                    "committed": st.timeline.committed_point,
                    "reported": st.timeline.reported,
                    "held": len(st.timeline),
                    "held_bytes": st.timeline.held_bytes,
                    "late": len(st.timeline.late),
                    "pending": len(st.pending),
                    "repairing": st.repair is not None,
                    # A split seen (5.7): reports held back, then the zone rebuilt.
                    "reports_paused": st.reports_paused,
                    "rebuilding": st.reset is not None,
                    # Suspected members whose transactions are still being fetched (5.2).
                    "syncing": sorted(m for m, sync in st.syncs.items() if not sync.done),
                }
                for name, st in sorted(self.streams.items())
            },
            "peers_heard": sorted(
                r
                for r, p in self.peers.items()
                if self.now_ms - p.last_heard_ms < self.limits.suspect_timeout_ms
            ),
            "counters": dict(self.counters),
        }

    # === validation of what a peer sent ================================================

    def _check(self, msg: PeerMessage) -> None:
        """Semantic checks the codec cannot make; raise FrameError before any state change."""
        if msg.sender == self.id or msg.sender not in self.peers:
            raise FieldError(f"sender {msg.sender} is not a peer of relay {self.id}")
        target = getattr(msg, "target", None)
        if target is not None and target != self.id:
            raise FieldError(f"message for relay {target} reached relay {self.id}")
        stream = getattr(msg, "stream", None)
        if stream is not None and not self._can_open(stream):
            raise FieldError(f"relay {self.id} already tracks max_streams streams")
        if stream is not None and not isinstance(msg, (Forward,)):
            if not self.topology.serves(self.id, stream):
                raise FieldError(f"relay {self.id} does not serve stream {stream!r}")
            if not isinstance(
                msg, (ForwardReply, RepairReply, JoinReply)
            ) and not self.topology.serves(msg.sender, stream):
                raise FieldError(f"relay {msg.sender} does not serve stream {stream!r}")
        if isinstance(msg, TxBatch):
            previous = -1
            for seq, tx in msg.entries:
                if relay_of(seq) != msg.sender or seq > msg.floor or seq <= previous:
                    raise FieldError(f"transaction {seq} not issued in order by {msg.sender}")
                if tx.size_bytes() > self.limits.max_tx_bytes:
                    raise FieldError(f"transaction {seq} exceeds max_tx_bytes")
                previous = seq
        elif isinstance(msg, Reports):
            previous = -1
            for point, _ in msg.points:
                if point <= previous or point > msg.floor:
                    raise FieldError("report points must increase and not pass the floor")
                previous = point
        elif isinstance(msg, RepairReply):
            previous = msg.lo
            for seq, _ in msg.entries:
                if seq <= previous or seq > msg.hi:
                    raise FieldError("repair entries out of order or outside their range")
                previous = seq
        elif isinstance(msg, Forward) and not self.topology.serves(self.id, msg.stream):
            raise FieldError(f"forward of stream {msg.stream!r} to a relay that does not serve it")

    # === dispatch ========================================================================

    def _dispatch(self, msg: PeerMessage, peer: PeerState, now_ms: int) -> None:
        if isinstance(msg, TxBatch):
            st = self._stream(msg.stream)
            if self._on_link_message(st, msg.sender, peer, msg.link_seq, msg.floor, now_ms):
                self._on_tx_batch(st, msg)
        elif isinstance(msg, Reports):
            st = self._stream(msg.stream)
            if self._on_link_message(st, msg.sender, peer, msg.link_seq, msg.floor, now_ms):
                self._on_reports(st, msg, now_ms)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(msg, peer, now_ms)
        elif isinstance(msg, JoinRequest):
            st = self._stream(msg.stream)
            if self._on_link_message(st, msg.sender, peer, msg.link_seq, msg.floor, now_ms):
                self._on_join_request(st, msg)
        elif isinstance(msg, JoinReply):
            self._on_join_reply(self._stream(msg.stream), msg, now_ms)
        elif isinstance(msg, Forward):
            self._accept(msg.stream, msg.tx, Waiter(msg.request_id, msg.sender), now_ms)
        elif isinstance(msg, ForwardReply):
            self._on_forward_reply(msg)
        elif isinstance(msg, RepairRequest):
            self._on_repair_request(self._stream(msg.stream), msg)
        elif isinstance(msg, RepairReply):
            self._on_repair_reply(self._stream(msg.stream), msg, now_ms)
        elif isinstance(msg, Refusal):
            peer.refused_us_ms = now_ms
            self.counters["refused_by_peer"] += 1

    def _new_incarnation(self, sender: int, peer: PeerState, incarnation: int) -> None:
        """First contact with a peer, or the peer restarted with empty memory."""
        restarted = peer.incarnation >= 0
        peer.incarnation = incarnation
        peer.links.clear()
        peer.joined.clear()
        # On first contact we join its message streams wherever they are; after a restart
        # they begin again at 1, and anything missing from there is a real gap.
        peer.sync_links = not restarted
        if not restarted:
            return
        for st in self.streams.values():
            if sender in st.members:
                st.commit_sources.discard(sender)
                frozen = st.known_through.get(sender, -1)
                st.votes_unknowable_above[sender] = min(
                    st.votes_unknowable_above.get(sender, frozen), frozen
                )

    # === links: gap detection ==========================================================

    def _link(self, peer: PeerState, stream: str) -> LinkState:
        link = peer.links.get(stream)
        if link is None:
            link = peer.links[stream] = LinkState(expected=0 if peer.sync_links else 1)
        return link

    def _on_link_message(
        self, st: StreamState, sender: int, peer: PeerState, link_seq: int, floor: int, now_ms: int
    ) -> bool:
        """Track the peer's per-stream message counter; False for a duplicate."""
        link = self._link(peer, st.stream)
        if link.expected == 0:
            link.expected = link_seq
        if link_seq < link.expected:
            self.counters["link_duplicate"] += 1
            return False
        if link_seq > link.expected:
            self.counters["link_gap"] += 1
            self._open_hole(st, sender, link, floor, now_ms)
        link.expected = link_seq + 1
        link.latest_floor = max(link.latest_floor, floor)
        if link.hole_lo < 0:
            link.contig_floor = link.latest_floor
        return True

    def _open_hole(
        self, st: StreamState, sender: int, link: LinkState, floor: int, now_ms: int
    ) -> None:
        if link.hole_lo < 0:
            # Lost transactions lie above the last contiguous floor; lost reports lie above
            # the last report we know of, which trails the floor: ask from the lower one.
            link.hole_lo = min(link.contig_floor, max(st.known_through.get(sender, 0), 0))
            link.hole_hi = floor
            self._request_fill(st, sender, link, link.hole_lo, now_ms)
        else:
            link.hole_hi = max(link.hole_hi, floor)

    def _request_fill(
        self, st: StreamState, sender: int, link: LinkState, lo: int, now_ms: int
    ) -> None:
        link.fill_request = self._request_id()
        link.fill_sent_ms = now_ms
        link.fill_lo = lo
        self._send(
            RepairRequest(
                self.id,
                self.incarnation,
                self.clock.floor,
                sender,
                st.stream,
                link.fill_request,
                lo,
                link.hole_hi,
                sender,
            )
        )

    def _close_hole(self, link: LinkState) -> None:
        link.hole_lo = link.hole_hi = -1
        link.contig_floor = link.latest_floor

    # === transactions ===================================================================

    def _on_tx_batch(self, st: StreamState, msg: TxBatch) -> None:
        tl = st.timeline
        for seq, tx in msg.entries:
            outcome = tl.insert(seq, tx)
            if outcome != "inserted":
                self.counters[f"tx_{outcome}"] += 1
        if msg.entries:
            self._announce_floor = True

    def _accept(self, stream: str, tx: Transaction, waiter: Waiter, now_ms: int) -> None:
        """A produce from a client (or forwarded by a non-member): coordinate or forward."""
        limits = self.limits
        members = self.topology.members(stream)
        if not members:
            return self._answer(waiter, Outcome.REJECTED, reason=RejectReason.UNKNOWN_STREAM.value)
        if tx.size_bytes() > limits.max_tx_bytes:
            return self._answer(waiter, Outcome.REJECTED, reason=RejectReason.TOO_LARGE.value)
        if self.id not in members:
            return self._forward(stream, tx, waiter, members, now_ms)
        if not self._can_open(stream):
            return self._answer(waiter, Outcome.REJECTED, reason=RejectReason.BUFFER_FULL.value)
        st = self._stream(stream)
        if st.join is not None or st.fenced:
            self.counters["produce_fenced"] += 1
            return self._answer(waiter, Outcome.FENCED, redirect=self._redirect_for(st))
        tl = st.timeline
        first = tl.dedupe.first_copy(tx.producer_id, tx.producer_seq)
        if first is not None:
            self.counters["produce_dedupe_committed"] += 1
            return self._answer(waiter, Outcome.COMMITTED, seq=first)
        in_flight = st.pending_keys.get((tx.producer_id, tx.producer_seq))
        if in_flight is not None:
            st.pending[in_flight].append(waiter)
            return None
        if (
            not tl.make_room(limits.buffer_max_entries, limits.buffer_max_bytes, tx.size_bytes())
            or len(st.pending) >= limits.max_pending_produces
        ):
            self.counters["produce_buffer_full"] += 1
            return self._answer(waiter, Outcome.REJECTED, reason=RejectReason.BUFFER_FULL.value)
        seq = self.clock.next_seq(self.wall_ms)
        tl.insert(seq, tx)
        st.out_entries.append((seq, tx))
        st.pending[seq] = [waiter]
        st.pending_keys[(tx.producer_id, tx.producer_seq)] = seq
        st.pending_key_of[seq] = (tx.producer_id, tx.producer_seq)
        st.pending_deadlines.append((now_ms + limits.produce_timeout_ms, seq))
        return None

    def _forward(
        self,
        stream: str,
        tx: Transaction,
        waiter: Waiter,
        members: tuple[int, ...],
        now_ms: int,
    ) -> None:
        if waiter.origin is not None:  # never forward twice
            return self._answer(waiter, Outcome.FENCED, redirect=members)
        live = [m for m in members if self._is_live(self.peers[m], now_ms)]
        if not live:
            return self._answer(waiter, Outcome.FENCED, redirect=members)
        fid = self._request_id()
        target = live[fid % len(live)]
        self._forwards[fid] = waiter.request_id
        self._forward_deadlines.append((now_ms + self.limits.produce_timeout_ms, fid))
        self._send(Forward(self.id, self.incarnation, self.clock.floor, target, stream, fid, tx))
        return None

    def _on_forward_reply(self, msg: ForwardReply) -> None:
        client_request = self._forwards.pop(msg.request_id, None)
        if client_request is None:
            self.counters["forward_reply_unmatched"] += 1
            return
        self._ready.replies.append(
            ProduceReply(client_request, msg.outcome, msg.seq, msg.reason, msg.redirect)
        )

    def _answer(
        self,
        waiter: Waiter,
        outcome: Outcome,
        *,
        seq: int = -1,
        reason: str = "",
        redirect: tuple[int, ...] = (),
    ) -> None:
        if waiter.origin is None:
            self._ready.replies.append(
                ProduceReply(waiter.request_id, outcome, seq, reason, redirect)
            )
        else:
            self._send(
                ForwardReply(
                    self.id,
                    self.incarnation,
                    self.clock.floor,
                    waiter.origin,
                    waiter.request_id,
                    outcome,
                    seq,
                    reason,
                    redirect,
                )
            )

    # === reports, commits, delivery ======================================================

    def _on_reports(self, st: StreamState, msg: Reports, now_ms: int) -> None:
        self._count_votes(st, msg.sender, msg.points)
        self._update_known_through(st, msg.sender)
        self._on_acks(st, msg.acks)
        if msg.committed_point >= 0:
            self._learn_commit(st, msg.committed_point, msg.committed_digest, [msg.sender])
        self._advance(st, now_ms)

    def _count_votes(self, st: StreamState, reporter: int, points: tuple[Report, ...]) -> None:
        votes = st.votes
        committed_here: tuple[int, bytes] | None = None
        for point, digest in points:
            if votes.add(reporter, point, digest):
                committed_here = (point, digest)
        if committed_here is not None:
            self._learn_commit(st, *committed_here, sources=votes.reporters(*committed_here))

    def _update_known_through(self, st: StreamState, member: int) -> None:
        link = self.peers[member].links.get(st.stream)
        if link is not None and link.hole_lo < 0:
            last = st.votes.last_point.get(member, -1)
            if last > st.known_through.get(member, -1):
                st.known_through[member] = last

    def _vote_known(self, st: StreamState, member: int, point: int) -> bool:
        if point > st.votes_unknowable_above.get(member, point):
            return False
        return point <= st.known_through.get(member, -1)

    def _learn_commit(self, st: StreamState, point: int, digest: bytes, sources: list[int]) -> None:
        if point > st.votes.max_seen:
            st.votes.max_seen = point
        known = st.known_commit[0]
        if point > known:
            st.known_commit = (point, digest)
            st.commit_sources = set(sources)
        elif point == known:
            st.commit_sources.update(sources)

    def _watermark(self, st: StreamState, now_ms: int) -> int:
        """W: no live member will coordinate at or below it that we have not received."""
        w = self.clock.floor
        for m in st.peers:
            peer = self.peers[m]
            if now_ms - peer.last_heard_ms >= self.limits.suspect_timeout_ms:
                sync = st.syncs.get(m)
                if sync is not None and sync.done and sync.heard_ms == peer.last_heard_ms:
                    continue  # suspected and synced: left out (liveness; digests keep us safe)
                # Suspected, but what it sent others is not fetched yet: hold at its floor.
            link = peer.links.get(st.stream)
            floor = link.contig_floor if link is not None else 0
            if floor < w:
                w = floor
        return w

    def _unsettled(self, st: StreamState) -> bool:
        tl = st.timeline
        return (
            tl.reported > tl.committed_point
            or tl.delivered < len(tl.seqs)
            or st.known_commit[0] > tl.committed_point
            or st.votes.max_seen > max(tl.reported, st.votes_final_through)  # join in
        )

    def _collect_reports(self, st: StreamState, now_ms: int) -> None:
        tl = st.timeline
        if st.join is not None or st.repair is not None or st.reset is not None:
            return
        if st.reports_paused:
            return
        w = self._watermark(st, now_ms)
        # We report only above what we reported and above our promise; transactions may
        # still enter between the two (we never reported there).
        above = max(tl.reported, st.votes_final_through)
        if w <= above:
            return
        start = tl.index_after(above)
        end = tl.index_after(w)
        points: list[Report] = []
        if end > start:
            tl.digest_through(end - 1)
            points.extend(zip(tl.seqs[start:end], tl.digests[start:end], strict=True))
        if self._unsettled(st) or end > start:
            checkpoints = self._checkpoints(above, w)
            if checkpoints:
                for p in checkpoints:
                    d = tl.digest_at(p)
                    if d is not None:
                        points.append((p, d))
                points.sort()
        if not points:
            return
        tl.reported = points[-1][0]
        st.out_reports.extend(points)
        st.report_log.extend(points)
        if st.peers:
            st.own_unacked.extend(points)
            self._count_acked_own(st)
        else:
            self._count_votes(st, self.id, tuple(points))  # a stream of one: nobody to ack

    def _on_acks(self, st: StreamState, acks: tuple[tuple[int, int], ...]) -> None:
        for relay, point in acks:
            if relay == self.id and point > st.own_acked_through:
                st.own_acked_through = point
                self._count_acked_own(st)

    def _count_acked_own(self, st: StreamState) -> None:
        acked: list[Report] = []
        while st.own_unacked and st.own_unacked[0][0] <= st.own_acked_through:
            acked.append(st.own_unacked.popleft())
        if acked:
            self._count_votes(st, self.id, tuple(acked))

    def _acks(self, st: StreamState) -> tuple[tuple[int, int], ...]:
        return tuple((m, p) for m in st.peers if (p := st.known_through.get(m, -1)) >= 0)

    def _checkpoints(self, above: int, upto: int) -> list[int]:
        """Aligned report points in (above, upto]: the end of every interval-th millisecond.
        Relays pick the same points, so they can agree while no transaction arrives."""
        interval = self.limits.checkpoint_interval_ms
        lo_ms = max(ms_of(above), 0)
        hi_ms = ms_of(upto)
        first = lo_ms - lo_ms % interval + interval - 1
        last = hi_ms - (hi_ms + 1) % interval
        if last < first:
            return []
        count = (last - first) // interval + 1
        skip = max(count - self.limits.max_checkpoints_per_report, 0)
        points = [end_of_ms(first + (skip + k) * interval) for k in range(count - skip)]
        return [p for p in points if above < p <= upto]

    def _advance(self, st: StreamState, now_ms: int) -> None:
        """Deliver up to the highest known commit if our prefix matches; else repair."""
        point, digest = st.known_commit
        tl = st.timeline
        join = st.join
        if join is not None:
            # Joining: ask again as soon as a commit we can take a base from is visible.
            if join.first_round_done and point >= join.need_point > join.asked_after_commit:
                join.asked_after_commit = point
                self._send_join_request(st, now_ms)
            return
        if point <= tl.committed_point:
            return
        own = tl.digest_at(point)
        if own == digest:
            self._deliver(st, point, digest)
            return
        if st.repair is not None:
            return
        if st.mismatch_since_ms == NEVER:
            st.mismatch_since_ms = now_ms
        behind = point <= tl.reported or point <= self._watermark(st, now_ms)
        if behind or now_ms - st.mismatch_since_ms >= self.limits.repair_grace_ms:
            self._start_repair(st, now_ms)

    def _deliver(self, st: StreamState, point: int, digest: bytes) -> None:
        tl = st.timeline
        newly = tl.deliver_through(point, digest)
        st.votes.settle_through(point)
        while st.own_unacked and st.own_unacked[0][0] <= point:
            st.own_unacked.popleft()  # settled: no need to count them any more
        st.progress_ms = self.now_ms
        self._resume_reports(st)
        st.mismatch_since_ms = NEVER
        if st.repair is not None and st.repair.point <= point:
            st.repair = None
        fresh = tuple((seq, tx) for seq, tx, first in newly if first == seq)
        if fresh:
            self._ready.deliveries.append(Delivery(st.stream, fresh))
        self.counters["delivered"] += len(fresh)
        self.counters["dedupe_skipped"] += len(newly) - len(fresh)
        for seq, _, first in newly:
            waiters = st.pending.pop(seq, None)
            if waiters is not None:
                self._finish(st, seq, waiters, Outcome.COMMITTED, first)
        self._resolve_excluded(st, point)
        tl.evict(self.limits.buffer_max_entries, self.limits.buffer_max_bytes)

    def _resolve_excluded(self, st: StreamState, point: int, prefix_seen: bool = True) -> None:
        """Own transactions at or below a newly committed point that we did not deliver.
        If we saw the committed prefix, the transaction is definitely out (rejected), unless
        another copy of it committed. After a rebase we did not see the skipped range, so
        all we can honestly say is unknown."""
        while st.pending:
            seq = next(iter(st.pending))
            if seq > point:
                break
            waiters = st.pending.pop(seq)
            key = st.pending_key_of.get(seq)
            first = st.timeline.dedupe.first_copy(*key) if key is not None else None
            if first is not None:
                self._finish(st, seq, waiters, Outcome.COMMITTED, first)
            elif prefix_seen:
                self.counters["produce_rejected_late"] += 1
                self._finish(st, seq, waiters, Outcome.REJECTED, -1, RejectReason.LATE.value)
            else:
                self.counters["produce_unknown"] += 1
                self._finish(st, seq, waiters, Outcome.UNKNOWN, -1)

    def _finish(
        self,
        st: StreamState,
        seq: int,
        waiters: list[Waiter],
        outcome: Outcome,
        result_seq: int,
        reason: str = "",
    ) -> None:
        key = st.pending_key_of.pop(seq, None)
        if key is not None:
            st.pending_keys.pop(key, None)
        for waiter in waiters:
            self._answer(waiter, outcome, seq=result_seq, reason=reason)

    def _abandon_pending(self, st: StreamState) -> None:
        """Fenced: what we coordinate cannot commit while we stay cut off, so tell its
        producers `unknown` now (they retry elsewhere with the same producer sequence;
        dedupe keeps one copy if ours commits after all) instead of at its deadline."""
        for seq, waiters in list(st.pending.items()):
            self.counters["produce_unknown_fenced"] += 1
            self._finish(st, seq, waiters, Outcome.UNKNOWN, -1)
        st.pending.clear()

    # === repair ==========================================================================

    def _start_repair(self, st: StreamState, now_ms: int) -> None:
        point, digest = st.known_commit
        tl = st.timeline
        lo = tl.committed_point
        # First try what we already hold, with the late arrivals we kept aside.
        if tl.late:
            merged = dict(tl.entries_between(lo, point))
            merged.update((s, t) for s, t in tl.late.items() if lo < s <= point)
            entries = sorted(merged.items())
            if dg.chain_over(tl.committed_digest, entries) == digest:
                self.counters["repair_local"] += 1
                self._adopt_range(st, lo, point, digest, entries)
                return
        st.repair = RepairState(point, digest, lo, self._repair_candidates(st))
        self.counters["repair_started"] += 1
        self._send_repair_request(st, lo, now_ms)

    def _repair_candidates(self, st: StreamState) -> list[int]:
        """Members known to hold the committed digest first, then every other member."""
        sources = sorted(m for m in st.commit_sources if m != self.id)
        return sources + [m for m in st.peers if m not in sources]

    def _retry_repair(self, st: StreamState, now_ms: int) -> None:
        rep = st.repair
        assert rep is not None
        if st.known_commit[0] > rep.point:
            st.repair = None  # a newer commit is known: repair towards it instead
            self._start_repair(st, now_ms)
            return
        rep.attempt += 1
        rep.entries = []
        rep.candidates = self._repair_candidates(st)
        self._send_repair_request(st, rep.lo, now_ms)

    def _send_repair_request(self, st: StreamState, lo: int, now_ms: int) -> None:
        rep = st.repair
        assert rep is not None
        rep.request_id = self._request_id()
        rep.sent_ms = now_ms
        usable = [c for c in rep.candidates if c not in rep.too_old] or rep.candidates
        target = usable[rep.attempt % len(usable)]
        self._send(
            RepairRequest(
                self.id,
                self.incarnation,
                self.clock.floor,
                target,
                st.stream,
                rep.request_id,
                lo,
                rep.point,
                -1,
            )
        )

    def _on_repair_request(self, st: StreamState, msg: RepairRequest) -> None:
        tl = st.timeline
        status = RepairStatus.OK
        chunk: list[Entry] = []
        more = False
        hi = max(msg.hi, msg.lo)
        if not tl.has_base:
            # Without a base we hold nothing: we coordinated nothing (a gap fill gets an
            # empty range) and cannot serve a repair (too old).
            if msg.origin < 0:
                status = RepairStatus.TOO_OLD
        elif msg.lo < tl.base_point:
            status = RepairStatus.TOO_OLD
        else:
            entries = tl.entries_between(msg.lo, msg.hi)
            if msg.origin >= 0:
                entries = [(s, t) for s, t in entries if relay_of(s) == msg.origin]
            chunks = self._chunks(entries)
            chunk = next(chunks, [])
            more = next(chunks, None) is not None
            if more:
                hi = chunk[-1][0]
        reports: tuple[Report, ...] = ()
        if status is RepairStatus.OK:
            reports = tuple(r for r in st.report_log if msg.lo < r[0] <= hi)
        self._send(
            RepairReply(
                self.id,
                self.incarnation,
                self.clock.floor,
                msg.sender,
                st.stream,
                msg.request_id,
                status,
                msg.lo,
                hi,
                more,
                tuple(chunk),
                reports,
            )
        )

    def _chunks(self, entries: list[Entry]) -> Iterator[list[Entry]]:
        """Split entries into frames of at most max_batch_entries and max_batch_bytes."""
        limits = self.limits
        chunk: list[Entry] = []
        size = 0
        for entry in entries:
            entry_bytes = entry[1].size_bytes()
            if chunk and (
                len(chunk) >= limits.max_batch_entries
                or size + entry_bytes > limits.max_batch_bytes
            ):
                yield chunk
                chunk, size = [], 0
            chunk.append(entry)
            size += entry_bytes
        if chunk:
            yield chunk

    def _on_repair_reply(self, st: StreamState, msg: RepairReply, now_ms: int) -> None:
        peer = self.peers[msg.sender]
        link = peer.links.get(st.stream)
        if link is not None and msg.request_id == link.fill_request and link.hole_lo >= 0:
            self._on_fill_reply(st, msg.sender, link, msg, now_ms)
            return
        for suspect, sync in st.syncs.items():
            if sync.awaiting.get(msg.request_id) == msg.sender:
                self._on_sync_reply(st, suspect, sync, msg)
                return
        if st.reset is not None and msg.request_id in st.reset.awaiting:
            self._on_reset_reply(st, msg, now_ms)
            return
        rep = st.repair
        if rep is None or msg.request_id != rep.request_id:
            self.counters["repair_reply_unmatched"] += 1
            return
        tl = st.timeline
        if rep.lo != tl.committed_point:
            st.repair = None  # we moved on meanwhile; start again from where we are
            self._advance(st, now_ms)
            return
        if msg.status is RepairStatus.TOO_OLD:
            self.counters["repair_too_old"] += 1
            rep.too_old.add(msg.sender)
            if rep.too_old.issuperset(st.peers):
                st.repair = None  # nobody holds our gap any more: start from a base
                self._start_rebase(st, rep.point, now_ms)
            else:
                self._retry_repair(st, now_ms)
            return
        rep.entries.extend(msg.entries)
        if msg.more:
            self._send_repair_request(st, msg.hi, now_ms)
            return
        if dg.chain_over(tl.committed_digest, rep.entries) == rep.digest:
            self._adopt_range(st, rep.lo, rep.point, rep.digest, rep.entries)
        else:
            self.counters["repair_mismatch"] += 1
            self._retry_repair(st, now_ms)

    def _adopt_range(
        self, st: StreamState, lo: int, point: int, digest: bytes, entries: list[Entry]
    ) -> None:
        self.counters["repair_adopted"] += 1
        st.timeline.replace_range(lo, point, entries)
        st.repair = None
        self._deliver(st, point, digest)

    def _on_fill_reply(
        self, st: StreamState, sender: int, link: LinkState, msg: RepairReply, now_ms: int
    ) -> None:
        if msg.status is RepairStatus.OK:
            for seq, tx in msg.entries:
                outcome = st.timeline.insert(seq, tx)
                self.counters[f"fill_{outcome}"] += 1
            self._count_votes(st, sender, msg.reports)
            if msg.more:
                self._request_fill(st, sender, link, msg.hi, now_ms)
                return
            if link.hole_hi > msg.hi:
                self._request_fill(st, sender, link, msg.hi, now_ms)
                return
        self.counters["hole_closed"] += 1
        self._close_hole(link)
        self._update_known_through(st, sender)

    def _start_rebase(self, st: StreamState, need_point: int, now_ms: int) -> None:
        """Our history is too old to repair: take a base at or above need_point."""
        st.join = JoinState(amnesiac=False, need_point=need_point, first_round_done=True)
        self._send_join_request(st, now_ms)

    # === suspicion sync (5.2) =============================================================

    def _tick_syncs(self, st: StreamState, now_ms: int) -> None:
        for m in st.peers:
            peer = self.peers[m]
            sync = st.syncs.get(m)
            if self._is_live(peer, now_ms):
                if sync is not None:
                    del st.syncs[m]  # heard again: its own link speaks for it
                continue
            if sync is None or sync.heard_ms != peer.last_heard_ms:
                self._start_sync(st, m, now_ms)
            elif not sync.done:
                self._retry_sync(st, m, sync, now_ms)

    def _start_sync(self, st: StreamState, suspect: int, now_ms: int) -> None:
        peer = self.peers[suspect]
        link = peer.links.get(st.stream)
        floor = link.contig_floor if link is not None else 0
        # Below our committed point the suspect's transactions are settled for us.
        lo = max(floor, st.timeline.committed_point, 0)
        sync = st.syncs[suspect] = SuspectSync(peer.last_heard_ms, lo, now_ms, now_ms)
        self.counters["suspect_sync_started"] += 1
        for m in st.peers:
            if m != suspect and self._is_live(self.peers[m], now_ms):
                self._send_sync_request(st, suspect, sync, m, lo)
        if not sync.awaiting:
            sync.done = True

    def _send_sync_request(
        self, st: StreamState, suspect: int, sync: SuspectSync, member: int, lo: int
    ) -> None:
        request_id = self._request_id()
        sync.awaiting[request_id] = member
        self._send(
            RepairRequest(
                self.id,
                self.incarnation,
                self.clock.floor,
                member,
                st.stream,
                request_id,
                lo,
                MAX_SEQ,
                suspect,
            )
        )

    def _retry_sync(self, st: StreamState, suspect: int, sync: SuspectSync, now_ms: int) -> None:
        retry_ms = self.limits.repair_retry_ms
        # A member that went silent too has its own sync; one that does not answer in time
        # must not hold the watermark (and so every commit) for ever.
        for request_id, member in list(sync.awaiting.items()):
            if not self._is_live(self.peers[member], now_ms):
                del sync.awaiting[request_id]
        if sync.awaiting and now_ms - sync.started_ms >= SYNC_MAX_ROUNDS * retry_ms:
            self.counters["suspect_sync_gave_up"] += 1
            sync.awaiting.clear()
        if not sync.awaiting:
            sync.done = True
            return
        if now_ms - sync.sent_ms >= retry_ms:
            sync.sent_ms = now_ms
            members = list(sync.awaiting.values())
            sync.awaiting.clear()
            for member in members:
                self._send_sync_request(st, suspect, sync, member, sync.lo)

    def _on_sync_reply(
        self, st: StreamState, suspect: int, sync: SuspectSync, msg: RepairReply
    ) -> None:
        del sync.awaiting[msg.request_id]
        if msg.status is RepairStatus.OK:
            for seq, tx in msg.entries:
                if relay_of(seq) == suspect:
                    self.counters[f"sync_{st.timeline.insert(seq, tx)}"] += 1
            if msg.more:
                self._send_sync_request(st, suspect, sync, msg.sender, msg.hi)
                return
        if not sync.awaiting:
            sync.done = True
            self.counters["suspect_sync_done"] += 1

    # === dead points: rebuilding an uncommitted zone ======================================

    def _maybe_reset(self, st: StreamState, now_ms: int) -> None:
        """If every point we reported above our committed point is dead (no digest can
        reach a quorum there any more), nobody can ever commit them, so our prefix there
        may change without breaking rule iii. Rebuild it as the union of what the members
        hold, so the members converge and commit again at later points."""
        tl = st.timeline
        limits = self.limits
        if st.join is not None or st.repair is not None or st.reset is not None:
            return
        if tl.reported <= tl.committed_point or st.known_commit[0] > tl.committed_point:
            return
        if now_ms - max(st.progress_ms, st.dead_check_ms) < limits.repair_retry_ms:
            return
        st.dead_check_ms = now_ms
        log = st.report_log
        if not log or log[-1][0] <= tl.committed_point:
            return  # we reported nothing above our committed point
        if len(log) == log.maxlen and log[0][0] > tl.committed_point:
            return  # our own early reports fell out of the log: cannot prove them dead
        own = [(p, d) for p, d in log if p > tl.committed_point]
        # Conflicts at or below a zone we already rebuilt are settled for us: only a
        # conflict among the points we reported since is a new split.
        since = max(tl.committed_point, st.rebuilt_through)
        if not any(p > since and self._conflicts(st, p, d) and self._dead(st, p) for p, d in own):
            # Dead points that nobody contradicts are only points others skipped (they
            # resumed above a promise): the next commit settles them. No split in sight.
            self._resume_reports(st)
            return
        # A split: stop adding points, so the members' votes at all of ours become known,
        # and rebuild the zone once every point we reported in it is dead.
        st.reports_paused = True
        if not all(self._dead(st, p) for p, _ in own):
            return
        live = [m for m in st.peers if self._is_live(self.peers[m], now_ms)]
        self.counters["reset_started"] += 1
        st.reset = ResetState(tl.committed_point, tl.reported, {}, now_ms)
        for m in live:
            self._send_reset_request(st, m, st.reset.lo)
        if not live:
            self._finish_reset(st, now_ms)

    def _resume_reports(self, st: StreamState) -> None:
        st.reports_paused = False  # the promise made while paused still bounds our reports

    def _conflicts(self, st: StreamState, point: int, digest: bytes) -> bool:
        """Another member reported a different digest where we reported `digest`."""
        return any(d != digest and mask for d, mask in st.votes.points.get(point, {}).items())

    def _dead(self, st: StreamState, point: int) -> bool:
        unknown = sum(1 for m in st.peers if not self._vote_known(st, m, point))
        return st.votes.dead(point, unknown)

    def _send_reset_request(self, st: StreamState, peer: int, lo: int) -> None:
        reset = st.reset
        assert reset is not None
        rid = self._request_id()
        reset.awaiting[rid] = peer
        self._send(
            RepairRequest(
                self.id,
                self.incarnation,
                self.clock.floor,
                peer,
                st.stream,
                rid,
                lo,
                reset.hi,
                -1,
            )
        )

    def _on_reset_reply(self, st: StreamState, msg: RepairReply, now_ms: int) -> None:
        reset = st.reset
        assert reset is not None
        peer = reset.awaiting.pop(msg.request_id)
        if msg.status is RepairStatus.OK:
            for seq, tx in msg.entries:
                reset.entries.setdefault(seq, tx)
            if msg.more:
                self._send_reset_request(st, peer, msg.hi)
        if not reset.awaiting:
            self._finish_reset(st, now_ms)

    def _finish_reset(self, st: StreamState, now_ms: int) -> None:
        reset = st.reset
        assert reset is not None
        tl = st.timeline
        st.reset = None
        if tl.committed_point != reset.lo:
            self._resume_reports(st)
            return  # a commit arrived meanwhile: it decides, not the union
        union = dict(tl.entries_between(reset.lo, reset.hi))
        for seq, tx in list(reset.entries.items()) + list(tl.late.items()):
            if reset.lo < seq <= reset.hi:
                union.setdefault(seq, tx)
        entries = sorted(union.items())
        tl.replace_range(reset.lo, reset.hi, entries)
        st.rebuilt_through = max(st.rebuilt_through, reset.hi)
        self.counters["reset_done"] += 1
        st.progress_ms = now_ms
        self._resume_reports(st)

    # === joining ========================================================================

    def _send_join_request(self, st: StreamState, now_ms: int) -> None:
        assert st.join is not None
        st.join.sent_ms = now_ms
        st.link_seq_out += 1
        self._send(
            JoinRequest(
                self.id,
                self.incarnation,
                self.clock.floor,
                st.stream,
                st.link_seq_out,
                st.join.need_point,
            ),
            stream=st.stream,
        )

    def _on_join_request(self, st: StreamState, msg: JoinRequest) -> None:
        tl = st.timeline
        joined = st.join is None or not st.join.amnesiac
        keys = None
        if joined and tl.has_base and tl.committed_point >= msg.need_point:
            keys = tl.dedupe.keys()
        point, digest = tl.committed_point, tl.committed_digest
        if not joined and st.seed is not None:
            point, digest = st.seed  # a fresh member's committed point is its seed
        self._send(
            JoinReply(
                self.id,
                self.incarnation,
                self.clock.floor,
                msg.sender,
                st.stream,
                not joined,
                point,
                digest,
                max(st.votes.max_seen, tl.reported),
                keys,
                self._votes_of(st, msg.sender),
            )
        )

    def _votes_of(self, st: StreamState, member: int) -> tuple[Report, ...]:
        """The reports of `member` (any incarnation) we hold above our committed point."""
        bit = 1 << member
        return tuple(
            sorted(
                (point, digest)
                for point, by_digest in st.votes.points.items()
                for digest, mask in by_digest.items()
                if mask & bit
            )
        )

    def _on_join_reply(self, st: StreamState, msg: JoinReply, now_ms: int) -> None:
        join = st.join
        if join is None:
            return
        join.replies[msg.sender] = msg
        self._on_join_round(st, now_ms)

    def _on_join_round(self, st: StreamState, now_ms: int) -> None:
        join = st.join
        assert join is not None
        if not join.first_round_done:
            if not all(p in join.replies for p in st.peers):
                return
            join.first_round_done = True
            inherited: dict[int, bytes] = {}
            for reply in join.replies.values():
                for point, digest in reply.your_votes:
                    inherited.setdefault(point, digest)
            st.inherited = tuple(sorted(inherited.items()))
            highest = max(
                [r.max_seen_reported for r in join.replies.values()]
                + [st.votes.max_seen, st.known_commit[0]]
            )
            # We will never report at or below this point: members may count our earlier
            # incarnations' votes as known up to it (see _on_inherited).
            st.votes_final_through = max(highest, 0)
            holders = [r for r in join.replies.values() if not r.fresh]
            if len(holders) < st.q:
                # Fewer than a quorum of members hold any state, so nothing can commit
                # without the joiners: take the best state the holders have (the empty
                # genesis if none), and still never vote where anyone already reported.
                self._join_without_quorum(st, holders, highest, now_ms)
                return
            join.need_point = max(highest, 0)
            if not self._try_join_base(st, join, now_ms):
                self._send_join_request(st, now_ms)  # ask again, now for a base
            return
        self._try_join_base(st, join, now_ms)

    def _join_without_quorum(
        self, st: StreamState, holders: list[JoinReply], highest: int, now_ms: int
    ) -> None:
        self.counters["joined_without_quorum"] += 1
        capacity = self.limits.dedupe_window_entries
        with_window = [r for r in holders if r.dedupe is not None]
        if with_window:
            best = max(with_window, key=lambda r: r.committed_point)
            point, digest = best.committed_point, best.committed_digest
            window = DedupeWindow(capacity, best.dedupe or ())
        else:
            point, digest = GENESIS_POINT, dg.genesis(st.stream)
            window = DedupeWindow(capacity)
        # Seeds: every member's (ours and the fresh repliers'); every joiner heard all
        # members before this, so all of them pick the same one.
        assert st.join is not None
        seeds = [
            (r.committed_point, r.committed_digest)
            for r in st.join.replies.values()
            if r.fresh and r.committed_point > GENESIS_POINT
        ]
        if st.seed is not None:
            seeds.append(st.seed)
        if seeds and max(seeds)[0] > point:
            self.counters["joined_from_seed"] += 1
            point, digest = max(seeds)
            window = DedupeWindow(capacity)  # the store keeps no dedupe window
        self._adopt_base(st, point, digest, window, max(highest, point), now_ms)

    def _try_join_base(self, st: StreamState, join: JoinState, now_ms: int) -> bool:
        for reply in join.replies.values():
            if (
                not reply.fresh
                and reply.dedupe is not None
                and reply.committed_point >= join.need_point
            ):
                window = DedupeWindow(self.limits.dedupe_window_entries, reply.dedupe)
                self._adopt_base(
                    st,
                    reply.committed_point,
                    reply.committed_digest,
                    window,
                    join.need_point,
                    now_ms,
                )
                return True
        return False

    def _adopt_base(
        self,
        st: StreamState,
        point: int,
        digest: bytes,
        window: DedupeWindow,
        never_report_through: int,
        now_ms: int,
    ) -> None:
        self.counters["base_adopted"] += 1
        tl = st.timeline
        tl.adopt_base(point, digest, window)
        self._ready.rebases.append((st.stream, point))
        # Never report where members may have seen our earlier incarnations report
        # (_collect_reports also keeps below the promise made while joining).
        st.votes_final_through = max(st.votes_final_through, never_report_through)
        st.votes.settle_through(point)
        st.join = None
        st.repair = None
        st.mismatch_since_ms = NEVER
        if point > st.known_commit[0]:
            st.known_commit = (point, digest)
        self._resolve_excluded(st, point, prefix_seen=False)
        self._advance(st, now_ms)

    # === heartbeats, fencing, timers ===================================================

    def _on_heartbeat(self, msg: Heartbeat, peer: PeerState, now_ms: int) -> None:
        for status in msg.streams:
            st = self.streams.get(status.stream)
            if st is None:
                if not self.topology.serves(self.id, status.stream) or not self._can_open(
                    status.stream
                ):
                    continue
                st = self._stream(status.stream)
            if msg.sender not in st.members:
                continue
            peer.joined[status.stream] = status.joined
            link = self._link(peer, status.stream)
            if link.expected == 0:
                link.expected = status.last_link_seq + 1
            if status.last_link_seq >= link.expected:
                self.counters["link_gap_heartbeat"] += 1
                self._open_hole(st, msg.sender, link, msg.floor, now_ms)
                link.expected = status.last_link_seq + 1
            if status.last_link_seq == link.expected - 1:
                link.latest_floor = max(link.latest_floor, msg.floor)
                if link.hole_lo < 0:
                    link.contig_floor = link.latest_floor
            self._on_acks(st, status.acks)
            self._on_inherited(st, msg.sender, status.inherited, status.votes_final_through)
            if status.committed_point >= 0:
                self._learn_commit(
                    st, status.committed_point, status.committed_digest, [msg.sender]
                )
                self._advance(st, now_ms)

    def _send_heartbeat(self, now_ms: int) -> None:
        self._last_heartbeat_ms = now_ms
        streams = tuple(
            StreamStatus(
                st.stream,
                st.link_seq_out,
                st.timeline.committed_point,
                st.timeline.committed_digest,
                st.join is None,
                self._acks(st),
                self._inherited(st),
                st.votes_final_through,
            )
            for st in self._served_streams()
        )
        self._send(Heartbeat(self.id, self.incarnation, self.clock.floor, streams))

    def _inherited(self, st: StreamState) -> tuple[Report, ...]:
        """Inherited reports still worth telling: those above our committed point."""
        join = st.join
        if (join is not None and join.amnesiac and join.first_round_done) or st.reports_paused:
            # Joining, or holding our reports back because of a split: promise never to
            # vote where anyone has reported so far, so members can count our votes there
            # as known, and prove the split dead.
            st.votes_final_through = max(st.votes_final_through, st.votes.max_seen)
        committed = st.timeline.committed_point
        if st.inherited and st.inherited[0][0] <= committed:
            st.inherited = tuple(r for r in st.inherited if r[0] > committed)
        return st.inherited

    def _on_inherited(
        self, st: StreamState, member: int, inherited: tuple[Report, ...], through: int
    ) -> None:
        """A restarted member tells which of its earlier reports anyone saw: with them, all
        its votes up to `through` are known again."""
        if through < 0:
            return
        self._count_votes(st, member, inherited)
        link = self.peers[member].links.get(st.stream)
        if link is not None and link.hole_lo >= 0:
            return  # its reports that we missed are not known yet
        if through > st.known_through.get(member, -1):
            st.known_through[member] = through
        st.votes_unknowable_above.pop(member, None)

    def _served_streams(self) -> list[StreamState]:
        return [self.streams[s] for s in sorted(self.streams)]

    def _tick_stream(self, st: StreamState, now_ms: int) -> None:
        limits = self.limits
        heard = 1 + sum(
            1
            for m in st.peers
            if self._is_live(self.peers[m], now_ms)
            and now_ms - self.peers[m].refused_us_ms >= limits.suspect_timeout_ms
        )
        fenced = heard < st.q
        if fenced != st.fenced:
            self.counters["fenced" if fenced else "unfenced"] += 1
            st.fenced = fenced
            if fenced and st.join is None:
                self._abandon_pending(st)
        join = st.join
        if join is not None and not st.peers and join.amnesiac:
            self._on_join_round(st, now_ms)  # a stream of one: nobody to ask
            return
        if join is not None and now_ms - join.sent_ms >= limits.repair_retry_ms:
            self._send_join_request(st, now_ms)
        while st.pending_deadlines and st.pending_deadlines[0][0] <= now_ms:
            _, seq = st.pending_deadlines.popleft()
            waiters = st.pending.pop(seq, None)
            if waiters is not None:
                self.counters["produce_unknown"] += 1
                self._finish(st, seq, waiters, Outcome.UNKNOWN, -1)
        rep = st.repair
        if rep is not None and now_ms - rep.sent_ms >= limits.repair_retry_ms:
            self.counters["repair_retry"] += 1
            self._retry_repair(st, now_ms)
        if st.reset is not None and now_ms - st.reset.started_ms >= 3 * limits.repair_retry_ms:
            self._finish_reset(st, now_ms)  # proceed with the members that answered
        self._maybe_reset(st, now_ms)
        self._tick_syncs(st, now_ms)
        for m in st.peers:
            link = self.peers[m].links.get(st.stream)
            if link is None or link.hole_lo < 0:
                continue
            if not self._is_live(self.peers[m], now_ms):
                continue
            if now_ms - link.fill_sent_ms >= limits.repair_retry_ms:
                self._request_fill(st, m, link, link.fill_lo, now_ms)
        self._advance(st, now_ms)

    def _is_live(self, peer: PeerState, now_ms: int) -> bool:
        return now_ms - peer.last_heard_ms < self.limits.suspect_timeout_ms

    def _redirect_for(self, st: StreamState) -> tuple[int, ...]:
        live = [
            m
            for m in st.peers
            if self._is_live(self.peers[m], self.now_ms) and self.peers[m].joined.get(st.stream)
        ]
        return tuple(live) if live else st.peers

    def _refuse(self, peer: PeerState, sender: int, reason: str, now_ms: int) -> None:
        self.counters["refused_clock_ahead"] += 1
        if now_ms - peer.refusal_sent_ms >= self.limits.heartbeat_interval_ms:
            peer.refusal_sent_ms = now_ms
            self._send(Refusal(self.id, self.incarnation, self.clock.floor, sender, reason))

    # === output =========================================================================

    def _flush_stream(self, st: StreamState) -> None:
        if st.out_entries:
            for chunk in self._chunks(st.out_entries):
                self._send_tx_batch(st, chunk)
            st.out_entries = []
        self._collect_reports(st, self.now_ms)
        committed = st.timeline.committed_point
        acks = self._acks(st)
        acks_moved = any(st.acks_sent.get(m, -1) < p for m, p in acks)
        if st.out_reports or committed > st.announced_commit or acks_moved:
            st.link_seq_out += 1
            st.announced_commit = committed
            st.acks_sent = dict(acks)
            self._send(
                Reports(
                    self.id,
                    self.incarnation,
                    self.clock.floor,
                    st.stream,
                    st.link_seq_out,
                    tuple(st.out_reports),
                    committed,
                    st.timeline.committed_digest,
                    acks,
                ),
                stream=st.stream,
            )
            st.out_reports = []

    def _send_tx_batch(self, st: StreamState, chunk: list[Entry]) -> None:
        st.link_seq_out += 1
        self._send(
            TxBatch(
                self.id,
                self.incarnation,
                self.clock.floor,
                st.stream,
                st.link_seq_out,
                tuple(chunk),
            ),
            stream=st.stream,
        )

    def _send(self, msg: PeerMessage, stream: str | None = None) -> None:
        target = getattr(msg, "target", None)
        self._floor_sent = max(self._floor_sent, msg.floor)
        self._ready.outgoing.append(
            Outgoing(CHANNEL_OF[type(msg)], codec.encode(msg), stream=stream, target=target)
        )

    # === helpers ========================================================================

    def _stream(self, stream: str) -> StreamState:
        st = self.streams.get(stream)
        if st is None:
            members = self.topology.members(stream)
            st = self.streams[stream] = StreamState(stream, members, self.id, self.config)
        return st

    def _can_open(self, stream: str) -> bool:
        """Bound the number of streams a relay tracks (patterns admit any name)."""
        return stream in self.streams or len(self.streams) < self.limits.max_streams

    def _request_id(self) -> int:
        self._next_request += 1
        return self._next_request
