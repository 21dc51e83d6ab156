"""RelayCore: the protocol state machine of one relay, with no I/O of its own.

Theory of operation (docs/protocol.md is the full spec; section numbers refer to it):

* The shell feeds inputs (`receive`, `peer_lost`, `produce`, `tick`) with its clocks and
  acts on `ready()` (relay/core/shell.py states the contract); `read` and the other
  queries answer at once.
* A member of stream S coordinates a produce by giving it the next sequence number of its
  hybrid clock and publishing it on S's topic (coordinate.py, 5.1). Every member inserts it
  in its timeline; links.py (5.2) tracks what each peer sent, so that once a point is
  *stable* (at or below the watermark: the lowest floor of the live members) the member
  reports its digest there, once (commit.py, 5.3). A point commits when a quorum reports
  the same digest (5.4); a member delivers the committed prefix when its own digest
  matches, and otherwise repairs from members that reported it (repair.py, 5.5). Splits
  are resolved by reset.py (5.7), empty relays join by join.py (5.8), fencing.py (5.9)
  and heartbeat.py (5.11) keep liveness visible.
* Safety rests only on the rules of section 6: commit = a quorum of identical counted
  reports at one point; one counted report per relay per point, across restarts; a
  reported prefix changes only by adopting a committed digest, or by rebuilding a zone
  whose every point is dead; quorums intersect. Clocks and timeouts only decide when.

This module is the dispatch: it validates what arrives, hands each message and each timer
to the rule that owns it, and composes the rules where one event concerns several.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import groupby
from operator import attrgetter
from typing import Any, cast

from mypy_extensions import mypyc_attr

from relay.core import (
    closing,
    codec,
    commit,
    coordinate,
    fencing,
    heartbeat,
    join,
    links,
    membership,
    repair,
    reset,
    spooling,
    transit,
    view,
)
from relay.core.config import LIMITS_AT_START, MESH_LIMITS, CoreConfig, Limits, limits_changed
from relay.core.messages import (
    STREAM_MESSAGES,
    TX_OVERHEAD_BYTES,
    Forward,
    ForwardReply,
    Heartbeat,
    JoinReply,
    JoinRequest,
    PeerMessage,
    ReadStatus,
    Relayed,
    RepairReply,
    RepairRequest,
    RepairStatus,
    Reports,
    TxBatch,
    ViewDecided,
    ViewReply,
    ViewRequest,
    ViewValue,
)
from relay.core.seq import COUNTER_BITS, MAX_RELAY_ID
from relay.core.shell import ProduceRequest, ReadResult, Ready
from relay.core.state import (
    GENESIS_POINT,
    NEVER,
    PROVISIONAL,
    Acceptor,
    PeerState,
    Purpose,
    RelayState,
    StreamState,
    Waiter,
    earliest_deadline_ms,
    retry_due,
    target_of,
)
from relay.core.timeline import NO_DIGEST, CommittedRecord
from relay.errors import ConfigError, FieldError, FrameError, NotAMember, OversizedFrame


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class RelayCore(RelayState):
    """One relay's protocol decisions. Pure: time and events come in, `ready()` says what
    to send, answer and deliver."""

    def __init__(self, config: CoreConfig, incarnation: int, now_ms: int) -> None:
        super().__init__(config, incarnation, now_ms)
        self._open_named_streams()

    def _open_named_streams(self) -> None:
        """Named and declared streams this relay serves join at start (or when a reloaded
        topology names them), and are in use (5.12) from then on; others join on first
        use."""
        topology = self.topology
        named = [p for p in topology.subscriptions[self.id] if not any(c in p for c in "*?[")]
        declared = [s for s in self.config.declared_streams if topology.serves(self.id, s)]
        for stream in named + declared:
            if stream not in self.streams and stream not in self.foreign and self.can_open(stream):
                self.stream(stream).written = True
                self.unread_since.pop(stream, None)  # (in use: it never closes)

    def remember_acceptors(self, records: Mapping[str, bytes]) -> list[str]:
        """The shell keeps acceptor memory (Ready.acceptors) and gives back what it kept
        before this start. Call it once, before any input. From then on the relay takes
        part in view changes at once after a restart, and runs each stream under the
        configuration its record keeps (5.15), whatever the topology says now. Returns
        the streams whose record could not be read: those it treats as forgotten (it
        abstains from their next view change, as a relay without acceptor memory does)."""
        memory: dict[str, Acceptor] = {}
        broken: list[str] = []
        for stream, raw in records.items():
            try:
                record = codec.decode_acceptor(raw, self.limits.max_frame_bytes)
            except FrameError:
                broken.append(stream)
                continue
            memory[stream] = Acceptor(
                record.number,
                record.promised,
                accepted_ballot=record.accepted_ballot,
                accepted=record.accepted,
            )
            version, members = record.config, record.members
            if version == PROVISIONAL:
                # 5.15: a provisional configuration is the topology's; a first view we
                # accepted binds us to no relays (it goes with our promises)
                members = ()
            if members and self.id in members:  # (none in a record of an earlier release)
                self.recorded[stream] = (version, members)
            elif members and version > PROVISIONAL:
                # An established configuration without us: we left the stream (`leave`),
                # and know that it runs on without us (a member behind does not readmit
                # us to an earlier version, membership.readmit)
                self.foreign[stream] = (version, members)
                if record.left is not None:
                    self.left_views[stream] = record.left
            if record.committed:
                self.recorded_committed.add(stream)
        self.acceptor_memory = memory
        self.acceptor_forgotten = set(broken)
        for stream, st in list(self.streams.items()):
            if stream in memory:
                st.acceptor = memory[stream]
            if stream in self.foreign:  # (opened because the topology names it)
                membership.set_config(self, st, *self.foreign[stream])
                membership.leave(self, st)
                continue
            recorded = self.recorded.pop(stream, None)
            if recorded is not None:
                st.config_recorded = True
                membership.set_config(self, st, *recorded)
            if stream in self.recorded_committed:
                self.recorded_committed.discard(stream)
                st.committed_before = True
        return broken

    def reload_topology(self, config: CoreConfig) -> None:
        """The operator's topology file changed and the relay read it again, running on
        (5.15 changes): `config` is the core's configuration from the new file, for this
        relay and with the same limits. Each stream's wanted relays follow the new file at
        once; its configuration changes only through the mesh, once a quorum of its relays
        want the same relays (`membership.wanted_change`). Streams the file names or
        declares for this relay and that are not open yet open, as at a start."""
        topology = config.topology
        if config.relay_id != self.id or self.id not in topology.subscriptions:
            raise ConfigError(f"relay {self.id} is not in the new topology")
        fixed = sorted(
            set(limits_changed(self.limits, config.limits)) & {*LIMITS_AT_START, *MESH_LIMITS}
        )
        if fixed:
            raise ConfigError(f"the new topology changes limits {fixed}: they apply at a start")
        self.topology = topology
        self.config = config
        if config.limits != self.limits:
            self._take_limits(config.limits)
        for r in topology.relay_ids:
            if r != self.id and r not in self.peers:
                self.peers[r] = PeerState()
        for st in list(self.streams.values()):
            desired = topology.members(st.stream)
            if desired != st.desired:
                st.desired = desired
                self.wake(st)
                membership.reprovision(self, st)
        self._open_named_streams()

    def _take_limits(self, limits: Limits) -> None:
        """Bounds from a reloaded file (none of LIMITS_AT_START or MESH_LIMITS changes):
        every check reads `self.limits` from now on; what was sized by a limit is resized.
        Lower bounds refuse what would go past them from now on; what a stream holds beyond
        them already goes as it commits and is delivered, as at any eviction (5.10). A
        shorter report log forgets its oldest reports at once."""
        self.limits = limits
        self.memory.max_bytes = limits.relay_buffer_max_bytes
        for st in self.streams.values():
            st.timeline.late_max_entries = limits.late_max_entries
            st.votes.max_points = limits.max_pending_vote_points
            if st.report_log.maxlen != limits.report_log_entries:
                st.report_log = deque(st.report_log, maxlen=limits.report_log_entries)
                st.timeline.charge_report_log(len(st.report_log))
        self.counters["limits_reloaded"] += 1

    def counted_relays(self) -> frozenset[int]:
        """The peers this relay still has a use for: those its topology names, the
        members of every stream it serves or will open under its acceptor record, and
        those its forwarded produces wait on. A
        relay a reloaded file left out of the mesh stays a peer while one of these counts
        it (5.15 changes: it votes until a change takes it off each stream)."""
        used = set(self.topology.relay_ids)
        for st in self.streams.values():
            used.update(st.peers)
        for _, members in self.recorded.values():  # streams to open under their records
            used.update(members)
        # (a forward not sent yet has no target: -1)
        used.update(pending.target for pending in self.forwards.values() if pending.target >= 0)
        used.discard(self.id)
        return frozenset(used)

    def forget_relays(self, relays: Iterable[int]) -> tuple[int, ...]:
        """Forget the peers among `relays` that nothing counts any more
        (`counted_relays`): a relay removed from the mesh. Their frames are not taken
        from then on (the sender is no peer). Returns those forgotten, ascending."""
        counted = self.counted_relays()
        gone = tuple(sorted(r for r in set(relays) if r in self.peers and r not in counted))
        for r in gone:
            del self.peers[r]
            self.route_via.pop(r, None)
            self.spool_full_peers.discard(r)
        if gone:
            self.route_via = {p: via for p, via in self.route_via.items() if via not in gone}
            self.counters["peers_forgotten"] += len(gone)
        assert counted <= set(self.peers), "every peer counted is known"
        return gone

    def change_held_by(self, stream: str) -> dict[int, tuple[int, ...]]:
        """The live relays whose topology files name other relays for the stream than
        ours does, holding a change of its relays (5.15 changes); {} when ours names its
        configuration's relays."""
        st = self.streams.get(stream)
        return {} if st is None else membership.change_held_by(self, st, self.now_ms)

    def recorded_streams(self) -> list[str]:
        """The streams this relay serves by its acceptor records (5.15) and not by its
        topology: the shell subscribes to them too."""
        topology = self.topology
        names = set(self.recorded) | {
            name for name, st in self.streams.items() if st.config_recorded
        }
        return sorted(n for n in names if not topology.serves(self.id, n))

    # === inputs ==========================================================================

    def _set_time(self, wall_ms: int, mono_ms: int | None) -> int:
        """Two clocks come in: the wall clock (Unix ms) only feeds sequence numbers and the
        skew check; every timer runs on the monotonic clock, so a wall clock stepping back
        does not silence heartbeats or hide dead peers. Returns the monotonic time."""
        self.wall_ms = wall_ms
        self.now_ms = wall_ms if mono_ms is None else mono_ms
        return self.now_ms

    def receive(
        self, frame: bytes, now_ms: int, mono_ms: int | None = None, from_relay: int = -1
    ) -> None:
        """A frame from a peer. Never raises; a bad frame is counted and changes nothing.
        `now_ms`: wall clock (Unix ms); `mono_ms`: monotonic clock (defaults to now_ms).
        `from_relay`: the relay the shell knows the frame came from (an authenticated
        link); a frame claiming another sender is dropped and counted (-1: unknown)."""
        now_ms = self._set_time(now_ms, mono_ms)
        msg = self._decode(frame)
        if msg is None:
            return
        if from_relay >= 0 and msg.sender != from_relay:
            self.counters["peer_sender_mismatch"] += 1
            return
        peer = self.peers[msg.sender]
        if not links.admit(self, msg, peer, now_ms):
            return
        if isinstance(msg, Relayed):
            self._on_relayed(msg, now_ms)
            return
        self._dispatch(msg, peer, now_ms)

    def _decode(self, frame: bytes, relayed_by: int = -1) -> PeerMessage | None:
        """The checked message in `frame`, or None (a bad frame is counted). A frame that
        relay `relayed_by` passed on (5.13) must be another relay's, and not itself a
        Relayed; only a Relayed may exceed max_frame_bytes, by its own header."""
        limit = self.limits.max_frame_bytes
        try:
            if relayed_by < 0:
                msg = codec.decode(frame, codec.peer_frame_limit(limit))
                if len(frame) > limit and not isinstance(msg, Relayed):
                    raise OversizedFrame(f"frame of {len(frame)} bytes exceeds {limit}")
            else:
                msg = codec.decode(frame, limit)
                if isinstance(msg, Relayed) or msg.sender == relayed_by:
                    raise FieldError(f"relay {relayed_by} passed on a frame not another's")
            self._check(msg, len(frame))
        except FrameError as error:
            self.counters[error.counter] += 1
            return None
        return msg

    def _on_relayed(self, msg: Relayed, now_ms: int) -> None:
        """A frame passed on by another relay (5.13): pass it on if we are the relay in
        between, else take it as if its sender had sent it straight to us."""
        if msg.to != self.id:
            transit.pass_through(self, msg)
            return
        inner = self._decode(msg.frame, relayed_by=msg.sender)
        if inner is None:
            return
        peer = self.peers[inner.sender]
        if isinstance(inner, Heartbeat) and transit.hears_directly(self, peer, now_ms):
            return  # its heartbeats reach us straight: an older one passed on adds nothing
        self.counters["transit_received"] += 1
        if links.admit(self, inner, peer, now_ms, direct=False):
            self._dispatch(inner, peer, now_ms)

    def produce(self, request: ProduceRequest, now_ms: int, mono_ms: int | None = None) -> None:
        """A client's transaction; its ProduceReply comes out of a later `ready()`."""
        self.produce_many((request,), now_ms, mono_ms)

    def produce_many(
        self, requests: Sequence[ProduceRequest], now_ms: int, mono_ms: int | None = None
    ) -> None:
        """Client transactions that arrived together (a client's batch): each is taken
        exactly as `produce` would take it, in order; consecutive ones of one stream are
        taken as a run (see `coordinate.accept`)."""
        now_ms = self._set_time(now_ms, mono_ms)
        self.note_busy(now_ms)
        fences = coordinate.FenceMemo()
        for stream, run in groupby(requests, key=attrgetter("stream")):
            produces = [(request.tx, Waiter(request.request_id, None)) for request in run]
            coordinate.accept(self, stream, produces, now_ms, fences)

    def peer_lost(self, relay_id: int, now_ms: int, mono_ms: int | None = None) -> None:
        """The shell saw its connection to a peer close (the process died, the host went
        away): suspect it now rather than after suspect_timeout_ms of silence. Hearing from
        it again makes it live again. A hint for liveness only; safety never rests on it."""
        now_ms = self._set_time(now_ms, mono_ms)
        self.quiet = False  # react at the usual pace (5.11)
        links.peer_lost(self, relay_id, now_ms)

    def tick(self, now_ms: int, mono_ms: int | None = None) -> None:
        """Time passed: heartbeats, retries, deadlines, fencing."""
        now_ms = self._set_time(now_ms, mono_ms)
        links.forgive_stall(self, now_ms)
        self.clock.follow_wall(self.wall_ms)
        if transit.plan(self, now_ms):
            # Whom we hear directly changed: say so now (a relay in between must start or
            # stop passing frames on, 5.13), at the usual pace.
            self.note_busy(now_ms)
            self.last_heartbeat_ms = NEVER
        every, reach = heartbeat.peer_picture(self, now_ms)
        liveness_changed = every != self.peer_picture[0]
        if (every, reach) != self.peer_picture:
            # What streams' timers read of the peers changed (one was suspected or heard
            # again, restarted, hears others differently; our clock): the streams that
            # read it look again, dormant or not (5.11).
            woken = liveness_changed
            self.peer_picture = (every, reach)
            self.counters["dormant_woken_all" if woken else "dormant_woken_in_use"] += 1
            for st in self.streams.values():
                if woken or view.in_use(self, st):
                    self.wake(st)
        went_quiet = heartbeat.update_quiet(self, now_ms)
        if went_quiet or now_ms - self.last_heartbeat_ms >= heartbeat.interval_ms(self):
            heartbeat.send_heartbeat(self, now_ms)
        for st in self.streams.values():
            if not st.dormant:
                self._tick_stream(st, now_ms)
        if liveness_changed and self.forwards:  # a forward's target may have fallen silent
            coordinate.retarget_forwards(self, now_ms)
        if self.forwards:
            coordinate.retry_unanswered_forwards(self, now_ms)
        coordinate.expire_forwards(self, now_ms)
        closing.close_idle(self, now_ms)
        self.tick_interval_ms = heartbeat.interval_ms(self)

    def next_deadline_ms(self) -> int:
        """The monotonic time by which `tick` must next be called (the shell may sleep until
        then unless input arrives): the next heartbeat, or an earlier produce deadline,
        announcement of a commit or held acks.
        Every other timer (suspicion, fencing, retries) is looked at on each tick, so it
        fires at most one heartbeat interval late (a quiet one only while nothing is in
        flight, 5.11), and at most FED_TICK_MS late after an input (relay/core/shell.py)."""
        due = self.last_heartbeat_ms + heartbeat.interval_ms(self)
        forward_due = earliest_deadline_ms(self.forwards)
        if forward_due is not None:
            due = min(due, forward_due)
            forward_retry_ms = coordinate.next_forward_retry_ms(self)
            if forward_retry_ms is not None:
                due = min(due, forward_retry_ms)
        for st in self.streams.values():
            if st.dormant:
                continue
            produce_due = earliest_deadline_ms(st.pending.by_seq)
            if produce_due is not None:
                due = min(due, produce_due)
            if st.announced_commit < st.timeline.committed_point:
                due = min(due, st.announce_by_ms)  # a lazy announcement (5.4)
            due = min(due, st.acks_by_ms)  # acks held for a commit (5.4)
        return due

    def ready(self) -> Ready:
        """Drain what the shell must do now: publish, answer, deliver (see `Ready`)."""
        for st in self.streams.values():
            if st.dormant:
                continue
            coordinate.publish_batches(self, st)
            commit.publish_reports(self, st)
            if not st.touched and heartbeat.can_sleep(self, st, self.now_ms):
                st.dormant = True
        if self.announce_floor and self.clock.floor > self.floor_sent:
            heartbeat.send_heartbeat(self, self.now_ms)
        self.announce_floor = False
        out, self.outbox = self.outbox, Ready()
        return out

    # === queries =========================================================================

    def read(self, stream: str, after_seq: int, max_entries: int) -> ReadResult:
        """Committed entries of `stream` after `after_seq` (-1: from the oldest held)."""
        members = self.members(stream)
        if not members:
            return ReadResult(ReadStatus.UNKNOWN_STREAM)
        if self.id not in members:
            return ReadResult(ReadStatus.REDIRECT, redirect=members)
        if not self.can_open(stream):
            return ReadResult(
                ReadStatus.NOT_READY, redirect=tuple(m for m in members if m != self.id)
            )
        # A read changes nothing: it opens a stream but does not wake one, and keeps a
        # blank one from closing (5.11).
        st = self.streams.get(stream) or self.stream(stream)
        closing.note_read(self, stream)
        redirect = fencing.redirect_for(self, st)
        if st.join is not None and st.join.amnesiac:
            return ReadResult(ReadStatus.NOT_READY, redirect=redirect)
        if st.fenced:
            return ReadResult(ReadStatus.FENCED, redirect=redirect)
        tl = st.timeline
        if (after_seq >= 0 and after_seq < tl.base_point and tl.base_point != GENESIS_POINT) or (
            # 5.8: a position in the history every member lost (not one of the records
            # committed since, which it may name): what follows it is not what followed.
            GENESIS_POINT < after_seq < st.history_lost_below and not tl.contains(after_seq)
        ):
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
        return join.seed(self, stream, point, digest)

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

    def set_spool_room(self, room_bytes: int | None, refused: Iterable[str] = ()) -> None:
        """With spooling on, the shell says between turns how many bytes its spool can
        still take and which streams it cannot take at all (5.14): a member votes only
        while what it holds fits. None: this relay keeps no spool."""
        if spooling.set_room(self, room_bytes, frozenset(refused)):
            # Whether our spool is full changed: the peers hear it now, and every stream
            # looks again whether it may report (the next tick is due at once).
            self.note_busy(self.now_ms)
            self.last_heartbeat_ms = NEVER
            for st in self.streams.values():
                self.wake(st)

    def spool_records(
        self, stream: str, after_seq: int, max_entries: int
    ) -> tuple[int, bytes, list[CommittedRecord]]:
        """For the spool: (base point, base digest, the committed records after
        `after_seq` that the spool takes now, 5.14). Records below the base were evicted
        (or never held: the relay joined above them): a spool behind the base has a gap
        that the spools of the members that voted for them cover. With a room set, the
        records the spool cannot take yet are left for a later call."""
        st = self.streams.get(stream)
        if st is None:
            return -1, NO_DIGEST, []
        tl = st.timeline
        return tl.base_point, tl.base_digest, spooling.take(self, st, after_seq, max_entries)

    def spool_waiting_streams(self) -> list[str]:
        """The streams whose committed records the spool could not take yet (5.14): hand
        them over again once the room is back (`spool_blocked` false)."""
        return sorted(self.spool_held_back)

    def stream_names(self) -> list[str]:
        """The streams this relay tracks (served, and opened)."""
        return list(self.streams)

    def has_stream(self, stream: str) -> bool:
        """Whether this relay tracks `stream` (a pattern's streams open on first use, while
        fewer than max_streams are open: `can_open`)."""
        return stream in self.streams

    def fenced(self, stream: str) -> bool:
        """Joined or not, this relay may not coordinate the stream's produces now: too few
        members heard, not admitted by the view, or its clock is an outlier (5.9)."""
        return self.fence_reason(stream) not in ("", fencing.JOINING)

    def fence_reason(self, stream: str) -> str:
        """Why this relay may not coordinate the stream's produces ("" if it may)."""
        st = self.streams.get(stream)
        if st is None:
            return fencing.QUORUM
        return fencing.reason(self, st, self.now_ms)

    def stall(self, stream: str) -> tuple[str, tuple[int, ...]]:
        """Why nothing commits through this relay, and whom it waits for (5.9)."""
        st = self.streams.get(stream)
        if st is None:
            return fencing.QUORUM, ()
        return fencing.stall(self, st, self.now_ms)

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
            # 5.10: memory of every stream's held entries and dedupe keys, and its bound
            "memory_bytes": self.memory.used_bytes,
            "memory_max_bytes": self.memory.max_bytes,
            # 5.14: whether our spool lacks room for what we owe it (we then vote nowhere),
            # and the peers whose heartbeats say theirs does
            "spool_full": self.spool_blocked,
            "spool_full_peers": sorted(self.spool_full_peers),
            "streams": {
                name: {
                    "joined": st.join is None,
                    # Produces are answered `fenced` (joined or not): see fence_reason.
                    "fenced": self.fenced(name),
                    "committed": st.timeline.committed_point,
                    # The newest seq held (a coordinator gave it) and how many held entries
                    # are above the committed point: the commit lag (docs/operations.md).
                    "newest": st.timeline.last_seq(),
                    "uncommitted": st.timeline.uncommitted(),
                    "reported": st.timeline.reported,
                    "held": len(st.timeline),
                    "held_bytes": st.timeline.held_bytes,
                    "dedupe_bytes": st.timeline.dedupe_bytes,
                    "report_log_bytes": st.timeline.report_log_bytes,
                    "late": len(st.timeline.late),
                    "pending": len(st.pending),
                    "repairing": st.repair is not None,
                    # A split seen (5.7): reports held back, then the zone rebuilt.
                    "reports_paused": st.reports_paused,
                    "rebuilding": st.reset is not None,
                    # Why produces are answered `fenced` here ("" when they are not), 5.9.
                    "fence_reason": fencing.reason(self, st, self.now_ms),
                    # Why nothing commits through this relay, whom it waits for, since
                    # when (relay's wall clock): deliverable of issue 10, 5.9.
                    "stall": self._stall_status(st),
                    # The view (5.12): its number, the members it admits, and whether a
                    # view change under way holds our reports.
                    "view": st.view.number,
                    "admitted": sorted(i.member for i in st.view.intervals if i.cut < 0),
                    "view_frozen": st.acceptor.promised >= 0,
                    # Reports that contradict the same member's earlier one at a point: a
                    # member breaking rule 2 of section 6 (counted, never used).
                    "vote_conflicts": st.votes.conflicts,
                    # 5.15: the configuration it counts votes under, the relays our
                    # topology names for it, and the relays that state another one
                    "config": configuration_status(
                        st.configuration,
                        st.desired,
                        st.disagree,
                        membership.change_held_by(self, st, self.now_ms),
                    ),
                    # How long something has waited to commit without the committed point
                    # moving (0: nothing waits), and how long our digest has disagreed
                    # with a commit the members announced (0: it agrees): a stream that
                    # does not commit, or holds another history, is never healthy.
                    "waiting_ms": self._since(max(st.waiting_since_ms, st.progress_ms))
                    if st.waiting_since_ms != NEVER
                    else 0,
                    "diverged_ms": self._since(st.mismatch_since_ms),
                    # 5.8: every member lost the stream's history (no seed kept it)
                    "history_lost": st.history_lost_below >= 0,
                }
                for name, st in sorted(self.streams.items())
            },
            # 5.15: streams our topology serves whose configuration leaves us out
            "not_member": {
                name: configuration_status(config, self.topology.members(name), {})
                for name, config in sorted(self.foreign.items())
            },
            "peers_heard": sorted(
                r for r, p in self.peers.items() if links.is_live(self, p, self.now_ms)
            ),
            # 5.13 transit: the peers heard straight from them (as our heartbeats say), and
            # the relay our frames go through for each peer that does not hear us directly.
            "hears_directly": list(self.hears_sent),
            "route_via": {str(peer): via for peer, via in sorted(self.route_via.items())},
            "counters": dict(self.counters),
        }

    def _since(self, since_ms: int) -> int:
        return 0 if since_ms == NEVER else self.now_ms - since_ms

    def _stall_status(self, st: StreamState) -> dict[str, object] | None:
        why, waiting = fencing.stall(self, st, self.now_ms)
        if not why:
            return None
        since_ms = st.stall_since_ms if st.stall_reason == why else self.now_ms
        return {
            "reason": why,
            "waiting_for": list(waiting),
            "for_ms": self.now_ms - since_ms,
            "since_unix_ms": self.wall_ms - (self.now_ms - since_ms),
        }

    # === validation of what a peer sent ================================================

    def _check(self, msg: PeerMessage, frame_bytes: int) -> None:
        """Semantic checks the codec cannot make (`frame_bytes`: the size of the frame it
        came in); raise FrameError before any state change."""
        if msg.sender == self.id or msg.sender not in self.peers:
            raise FieldError(f"sender {msg.sender} is not a peer of relay {self.id}")
        target = target_of(msg)
        if target is not None and target != self.id:
            raise FieldError(f"message for relay {target} reached relay {self.id}")
        if (
            isinstance(msg, Relayed)
            and msg.to != self.id
            and (msg.to not in self.peers or msg.to == msg.sender)
        ):
            raise FieldError(f"relay {msg.sender} asked to pass its frame on to relay {msg.to}")
        # Looked up by type, as `target_of` says why.
        stream: str | None = cast(Any, msg).stream if type(msg) in STREAM_MESSAGES else None
        if stream is not None and not self.can_open(stream):
            raise FieldError(f"relay {self.id} already tracks max_streams streams")
        # (a view request for a stream we left: view.tell_left answers it, or counts it)
        told_left = type(msg) is ViewRequest and self._left(msg.stream)
        if stream is not None and not isinstance(msg, Forward) and not told_left:
            members = self.members(stream)
            if isinstance(msg, ViewDecided) and self._later_configuration(stream, msg.value):
                # A change of the stream's relays decided without us knowing it yet
                # (5.15 changes): a relay it adds, or one behind, learns it from any of
                # the old or the new relays (its decider may be one it removed).
                members = tuple(sorted({*members, *msg.value.members}))
            elif isinstance(msg, ViewRequest) and self._first_view_of_us(stream, msg):
                # A first view of relays that include us, which our file does not name
                # for the stream (5.15 establishment): its proposer carries one that may
                # have been decided, and only its relays' promises can tell.
                members = tuple(sorted({*members, *msg.members}))
            if self.id not in members:
                raise NotAMember(f"relay {self.id} does not serve stream {stream!r}")
            # Replies are matched to our own requests, and anyone may ask where a stream
            # stands (5.15: a relay whose topology names us learns our configuration);
            # everything else, a view decided included, is taken only from the members.
            if (
                not isinstance(msg, (ForwardReply, RepairReply, JoinReply, JoinRequest))
                and msg.sender not in members
            ):
                raise NotAMember(f"relay {msg.sender} does not serve stream {stream!r}")
        if isinstance(msg, TxBatch):
            # Once per transaction on every member: relay_of inline, and sizes looked at
            # only when the frame is large enough to hold a transaction too large.
            sender, floor = msg.sender, msg.floor
            previous = -1
            for seq, _ in msg.entries:
                if seq >> COUNTER_BITS & MAX_RELAY_ID != sender or seq > floor or seq <= previous:
                    raise FieldError(f"transaction {seq} not issued in order by {sender}")
                previous = seq
            if frame_bytes + TX_OVERHEAD_BYTES > self.limits.max_tx_bytes:
                for seq, tx in msg.entries:
                    if tx.size_bytes() > self.limits.max_tx_bytes:
                        raise FieldError(f"transaction {seq} exceeds max_tx_bytes")
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

    def _left(self, stream: str) -> bool:
        """Whether a decided change took us off `stream` and we do not serve it again."""
        return stream in self.left_views and stream not in self.streams

    def _later_configuration(self, stream: str, value: ViewValue) -> bool:
        """Whether `value` carries an established configuration of `stream` later than
        the one we know (5.15 changes), among whose relays we are."""
        st = self.streams.get(stream)
        known = st.configuration if st is not None else self.foreign.get(stream)
        known = known or self.recorded.get(stream)
        version = known[0] if known is not None else PROVISIONAL
        return self.id in value.members and value.config > max(version, PROVISIONAL)

    def _first_view_of_us(self, stream: str, msg: ViewRequest) -> bool:
        """Whether `msg` proposes a first view of `stream` under a provisional
        configuration that includes us and its sender, for a stream of which we know no
        established configuration."""
        st = self.streams.get(stream)
        return (
            msg.view == 1
            and msg.config == PROVISIONAL
            and self.id in msg.members
            and msg.sender in msg.members
            and (st.config_version == PROVISIONAL if st is not None else stream not in self.foreign)
            and stream not in self.recorded
        )

    # === dispatch ========================================================================

    def _dispatch(self, msg: PeerMessage, peer: PeerState, now_ms: int) -> None:
        if closing.reply_for_closed(self, msg):
            self.counters["reply_for_closed_stream"] += 1
            return  # (5.11 closing: asked before the stream closed; it is not reopened)
        if not isinstance(msg, Heartbeat):
            self.note_busy(now_ms)
        if isinstance(msg, TxBatch):
            st = self.stream(msg.stream)
            if links.on_link_message(self, st, msg.sender, peer, msg.link_seq, msg.floor, now_ms):
                links.on_tx_batch(self, st, msg)
        elif isinstance(msg, Reports):
            st = self.stream(msg.stream)
            # Its lead is a floor on this link alone (5.2): we do not follow it.
            floor = max(msg.floor, msg.lead)
            if msg.config != st.config_version:
                # Votes under another configuration never count here (5.15): taken as
                # lost, so the hole it leaves on the link is filled (with the reports, once
                # we share the configuration: a member that adopted the view establishing
                # it before us) and no report of the sender's looks known meanwhile.
                self.counters["reports_other_config"] += 1
                return
            if links.on_link_message(self, st, msg.sender, peer, msg.link_seq, floor, now_ms):
                commit.on_reports(self, st, msg)
                repair.advance(self, st, now_ms)
        elif isinstance(msg, Heartbeat):
            heartbeat.on_heartbeat(self, msg, peer, now_ms)
        elif isinstance(msg, JoinRequest):
            st = self.stream(msg.stream)
            if links.on_link_message(self, st, msg.sender, peer, msg.link_seq, msg.floor, now_ms):
                join.on_join_request(self, st, msg)
        elif isinstance(msg, JoinReply):
            st = self.stream(msg.stream)
            if join.on_join_reply(self, st, msg, now_ms):
                repair.advance(self, st, now_ms)
        elif isinstance(msg, Forward):
            produces = [(msg.tx, Waiter(msg.request_id, msg.sender))]
            coordinate.accept(self, msg.stream, produces, now_ms, coordinate.FenceMemo())
        elif isinstance(msg, ForwardReply):
            coordinate.on_forward_reply(self, msg)
        elif isinstance(msg, RepairRequest):
            repair.on_repair_request(self, self.stream(msg.stream), msg)
        elif isinstance(msg, RepairReply):
            self._on_repair_reply(self.stream(msg.stream), msg, now_ms)
        elif isinstance(msg, ViewRequest):
            if self._left(msg.stream):
                view.tell_left(self, msg)
            else:
                view.on_request(self, self.stream(msg.stream), msg, now_ms)
        elif isinstance(msg, ViewReply):
            view.on_reply(self, self.stream(msg.stream), msg, now_ms)
        elif isinstance(msg, ViewDecided):
            membership.readmit(self, msg.stream, msg.value.config, msg.value.members)
            st = self.stream(msg.stream)
            if view.on_decided(self, st, msg, now_ms):
                repair.advance(self, st, now_ms)

    def _on_repair_reply(self, st: StreamState, msg: RepairReply, now_ms: int) -> None:
        """Hand a reply to the rule that asked for it (the table of requests says which)."""
        asked = st.requests.take(msg.request_id, msg.sender)
        if asked is None:
            self.counters["repair_reply_unmatched"] += 1
        elif msg.config != st.config_version:
            # What a relay under another configuration holds and reported is not ours to
            # take (5.15); the request is asked again, of it or another member.
            self.counters["repair_reply_other_config"] += 1
        elif asked.purpose is Purpose.GAP_FILL:
            # The entries fill the hole; the reports in the reply are the sender's votes.
            # (A gap fill is outstanding only while its link has a hole: see Requests.)
            state = self.peers[msg.sender].links[st.stream]
            closed = links.on_fill_reply(self, st, state, msg, now_ms)
            if msg.status is RepairStatus.OK:
                commit.count_votes(st, msg.sender, msg.reports)
            if closed:
                commit.update_known_through(self, st, msg.sender)
        elif asked.purpose is Purpose.RESET:
            reset.on_reset_reply(self, st, msg, now_ms)
        else:
            repair.on_repair_reply(self, st, msg, now_ms)

    def _tick_stream(self, st: StreamState, now_ms: int) -> None:
        st.touched = False
        if st.pending or st.timeline.last_seq() > st.timeline.committed_point:
            if st.waiting_since_ms == NEVER:
                st.waiting_since_ms = now_ms
        else:
            st.waiting_since_ms = NEVER
        if fencing.update_fence(self, st, now_ms) and st.join is None:
            coordinate.abandon_pending(self, st)
        was = st.stall_reason
        fencing.track_stall(self, st, now_ms)
        if st.stall_reason == fencing.CLOCK != was and st.join is None:
            # Our clock just stepped far from the majority's: what we issued meanwhile may
            # carry sequence numbers minutes ahead, which commit only when the others'
            # clocks get there. Tell the producers `unknown` now, so they retry elsewhere
            # (dedupe keeps one copy), instead of at produce_timeout_ms.
            coordinate.abandon_pending(self, st)
        joining = st.join
        if joining is not None and not st.peers and joining.amnesiac:
            # A stream of one: nobody to ask.
            if join.on_join_round(self, st, now_ms):
                repair.advance(self, st, now_ms)
            return
        if joining is not None and retry_due(
            now_ms,
            joining.sent_ms,
            joining.resends,
            self.limits.repair_retry_ms + links.lag_ms(self, st.peers, now_ms),
        ):
            if joining.sent_ms != NEVER:
                joining.resends += 1
            join.send_join_request(self, st, now_ms)
        coordinate.expire_pending(self, st, now_ms)
        repair.tick_repair(self, st, now_ms)
        reset.tick_reset(self, st, now_ms)
        reset.maybe_reset(self, st, now_ms)
        view.tick(self, st, now_ms)
        links.retry_fills(self, st, now_ms)
        repair.advance(self, st, now_ms)


def configuration_status(
    config: tuple[int, tuple[int, ...]],
    desired: tuple[int, ...],
    disagree: Mapping[int, tuple[int, tuple[int, ...]]],
    held_by: Mapping[int, tuple[int, ...]] | None = None,
) -> dict[str, object]:
    """A stream's configuration (5.15) as the status gives it: its version and relays, the
    relays this relay's topology names, what each relay that states another one stated,
    and, while our file names other relays, the live relays whose files name others
    still (they hold the change, 5.15 changes) with what theirs name."""
    version, members = config
    return {
        "version": version,
        "relays": list(members),
        "topology": list(desired),
        "disagree": {
            str(peer): {"version": v, "relays": list(m)}
            for peer, (v, m) in sorted(disagree.items())
        },
        "change_held_by": {str(peer): list(m) for peer, m in sorted((held_by or {}).items())},
    }
