"""Heartbeats (docs/protocol.md section 5.11): liveness, the floor, the clock, and per stream
what a member would otherwise only learn from messages that may have been lost.

Every heartbeat_interval_ms (and promptly when transactions arrived and the floor moved
while nothing else was sent) a relay sends its floor and wall clock (5.2: timeouts,
clocks) and, per stream it serves: the last link_seq it published (5.2: a lost last
message is noticed), its committed point and digest (5.4), whether it has joined (5.9:
redirects), its acks (5.4), its promise with the inherited reports (5.8), and its view's
number and whether it asks to be admitted (5.12: a member behind is sent the view); and
which peers it hears (5.12: only members that all hear each other are admitted).

A heartbeat gives the statuses of the streams with something to commit, of those whose
status changed since, and of a few others in turn (`_statuses`). A stream with nothing in
flight after its tick, that no input concerned since, is *dormant* (`can_sleep`): ticks,
ready() and heartbeats pass it by until an input concerns it or what its timers read of
the peers changes (`peer_picture`). A relay's work then grows with its active streams, not
with the thousands a client may open by reading new names.

Quiet (5.11): a relay is *settled* when nothing but heartbeats came, went or was asked of
it for quiet_after_ms and nothing is in flight on any stream (no produce pending, nothing
uncommitted, no join, repair, reset, view change, fence or stall). A settled relay whose
live peers all say they are settled heartbeats every quiet_heartbeat_interval_ms instead,
and says so in the heartbeat, which excuses the longer silence (links.live_until_ms).
Anything else coming, going or asked of it, or a live peer saying it is not settled, ends
quiet at once; after a calm, a relay that becomes busy expects quiet peers to answer within
their usual timeout from then on.
"""

from __future__ import annotations

from relay.core import join, links, membership, spooling, view
from relay.core.closing import blank_status, closed_statuses
from relay.core.commit import acks, heard_commit, on_acks, unsettled
from relay.core.fencing import NOT_ADMITTED
from relay.core.links import clock_outlier
from relay.core.messages import Heartbeat, StreamStatus
from relay.core.repair import advance
from relay.core.state import NEVER, NOT_DUE, PeerState, RelayState, StreamState
from relay.core.transit import reaches
from relay.core.view import in_use


def interval_ms(core: RelayState) -> int:
    """How long after the last heartbeat the next is due."""
    limits = core.limits
    return limits.quiet_interval_ms if core.quiet else limits.heartbeat_interval_ms


def settled(core: RelayState, now_ms: int) -> bool:
    """Nothing but heartbeats for quiet_after_ms, and nothing in flight."""
    if now_ms - core.busy_ms < core.limits.quiet_after_ms or core.forwards:
        return False
    return all(st.dormant or stream_settled(core, st) for st in core.streams.values())


def stream_settled(core: RelayState, st: StreamState) -> bool:
    return (
        st.join is None
        and not st.fenced
        # (a stream not in use has no view: nobody is admitted, and nothing waits on it)
        and (not st.stall_reason or (st.stall_reason == NOT_ADMITTED and not in_use(core, st)))
        and not st.pending
        and not st.out_entries
        and not st.out_reports
        and not st.own_unacked
        and not st.requests
        and st.repair is None
        and st.reset is None
        and st.proposal is None
        and st.view_wanted_ms == NEVER
        and st.timeline.last_seq() <= st.timeline.committed_point
    )


def can_sleep(core: RelayState, st: StreamState, now_ms: int) -> bool:
    """Whether the stream may go dormant after its tick and ready(): nothing is in flight
    and nothing of it depends on time alone, so ticking it would change nothing until an
    input concerns it (which wakes it) or what its timers read of the peers changes
    (`peer_picture`, which wakes the streams that read it). Its status then goes only in
    the heartbeats that repeat it in turn (`_statuses`)."""
    tl = st.timeline
    if not stream_settled(core, st) or unsettled(st) or tl.late:
        return False
    if st.reports_paused or st.acceptor.promised >= 0 or st.announced_commit < tl.committed_point:
        return False
    if st.acks_by_ms != NOT_DUE:
        return False  # acks held for a commit (5.4)
    if st.inherited and st.inherited[-1][0] > tl.committed_point:
        return False  # inherited reports still to tell (5.8)
    for m in st.peers:
        peer = core.peers[m]
        state = peer.links.get(st.stream)
        if state is not None and state.hole_lo >= 0:
            return False
        # A member that does not hear us is judged cut off only on a heartbeat sent after
        # we adopted the view (view._cut_off): wait for one, unless it hears us.
        if peer.heartbeat_ms <= st.view_adopted_ms and not reaches(core, m, core.id, now_ms):
            return False
    return True


def peer_picture(core: RelayState, now_ms: int) -> tuple[tuple[object, ...], tuple[object, ...]]:
    """Everything a stream's timers read of the relay's peers and its clock, in two parts:
    what every stream reads (fencing: which peers are live, their incarnations, whether
    our clock is an outlier; whose spool is full, 5.14), and what only a stream in use
    reads (views: who hears whom, 5.13, as our peers and we said it last; a stream not in
    use has no view and nobody asks to be admitted)."""
    peers = sorted(core.peers.items())
    every = (
        tuple((links.is_live(core, p, now_ms), p.incarnation) for _, p in peers),
        (core.spool_blocked, tuple(sorted(core.spool_full_peers))),  # 5.14
    )
    reach = tuple((p.hears, p.heartbeat_ms == NEVER) for _, p in peers)
    return (links.clock_outlier(core, now_ms), every), (core.hears_sent, reach)


def update_quiet(core: RelayState, now_ms: int) -> bool:
    """Go quiet when this relay and every live peer are settled (only a tick does: ending
    quiet happens as soon as anything arrives, see RelayState.note_busy). True when it
    went quiet just now: a heartbeat must say so at once, before the longer silence."""
    was = core.quiet
    core.quiet = settled(core, now_ms) and all(
        p.settled for p in core.peers.values() if links.is_live(core, p, now_ms)
    )
    if core.quiet and not was:
        core.counters["went_quiet"] += 1
        return True
    return False


def send_heartbeat(core: RelayState, now_ms: int) -> None:
    core.last_heartbeat_ms = now_ms
    streams = _statuses(core, now_ms)
    core.send(
        Heartbeat(
            sender=core.id,
            incarnation=core.incarnation,
            floor=core.clock.floor,
            streams=streams,
            wall_ms=core.wall_ms,
            hears=core.hears_sent,  # whom we hear directly, as planned this tick (5.13)
            interval_ms=interval_ms(core),
            settled=settled(core, now_ms),
            spool_full=core.spool_blocked,
        )
    )


def _statuses(core: RelayState, now_ms: int) -> tuple[StreamStatus, ...]:
    """The stream statuses this heartbeat gives, by name: those of the streams with
    something to commit (their members' reports wait on our floor, which the status lets
    move on their link), those that changed since we last gave them, and
    `heartbeat_repeated_statuses` others in turn (all of them when there are no more), so
    that a status lost, or one that a peer never heard (it just started), is told again
    within streams / heartbeat_repeated_statuses heartbeats. Giving every status in every
    heartbeat made a heartbeat's cost grow with the streams a relay serves: 2,000 streams
    opened by reads took 40 ms to tell and 95 ms to take in, 50 times a second from each
    peer; a dormant stream's status is not even looked at (5.11)."""
    names = core.stream_names_sorted()
    streams = core.streams
    repeat = core.limits.heartbeat_repeated_statuses
    window: set[str] | None = None
    if len(names) > repeat:
        start = core.status_cursor % len(names)
        core.status_cursor = start + repeat
        window = {names[(start + k) % len(names)] for k in range(repeat)}
    outlier = clock_outlier(core, now_ms)
    told: list[StreamStatus] = []
    for name in names:
        st = streams[name]
        turn = window is None or name in window
        if st.dormant and not turn:
            continue
        status = _stream_status(core, st, outlier, now_ms)
        if turn or status.inherited or status != st.status_told or _commits_pending(st):
            st.status_told = status
            told.append(status)
    if core.closed_told:
        told.extend(closed_statuses(core))
        told.sort(key=_stream_of)
    return tuple(told)


def _stream_of(status: StreamStatus) -> str:
    return status.stream


def _commits_pending(st: StreamState) -> bool:
    """Something of the stream waits to commit (5.3: reports wait on the floors)."""
    tl = st.timeline
    return bool(st.pending) or tl.last_seq() > tl.committed_point or unsettled(st)


def _stream_status(core: RelayState, st: StreamState, outlier: bool, now_ms: int) -> StreamStatus:
    """(`outlier`: whether our clock is an outlier, 5.2.)"""
    inherited = join.promise(st)  # may raise votes_final_through: keep it first
    config, members = st.configuration
    omitted = False
    if inherited:
        if join.inherited_to_send(core, st, now_ms):
            st.inherited_sent_ms = now_ms  # (a status with them is always given)
        else:
            # Every member counted them: the promise alone, marked so that a member that
            # has not counted them (one we never heard) does not take it (5.8).
            inherited, omitted = (), True
    return StreamStatus(
        stream=st.stream,
        last_link_seq=st.link_seq_out,
        committed_point=st.timeline.committed_point,
        committed_digest=st.timeline.committed_digest,
        joined=st.join is None,
        acks=acks(st),
        inherited=inherited,
        votes_final_through=st.votes_final_through,
        view=st.view.number,
        want_in=view.wants_in(core, st, now_ms, outlier=outlier),
        inherited_acks=tuple(sorted(st.inherited_counted.items())),
        inherited_omitted=omitted,
        config=config,
        members=members,
        wanted=st.desired if st.desired != members else (),
    )


def _agrees(
    core: RelayState, st: StreamState, sender: int, status: StreamStatus, now_ms: int
) -> bool:
    """Whether the rest of a status may be taken: the sender's configuration of the stream
    (5.15), a member's or not, is compatible with ours, or taught us the one we now share
    with it. The word of any relay is heard: a non-member's established configuration is
    a history of the stream elsewhere."""
    heard = membership.hear(core, st, sender, status.config, status.members)
    if heard is membership.Heard.BEHIND:
        # It missed a change of the stream's relays (5.15 changes), a member of the new
        # ones or a relay the change removed: our view carries it.
        view.push_view(core, st, sender, now_ms)
    if heard in (membership.Heard.LEFT, membership.Heard.DISAGREES, membership.Heard.AHEAD):
        return False
    return heard is not membership.Heard.BEHIND and status.stream in core.streams


def on_heartbeat(core: RelayState, msg: Heartbeat, peer: PeerState, now_ms: int) -> None:
    links.on_heartbeat(core, peer, msg.wall_ms, msg.interval_ms, now_ms)
    peer.hears = frozenset(msg.hears)
    peer.settled = msg.settled
    spooling.on_heartbeat(core, msg.sender, msg.spool_full)
    if not msg.settled:
        core.quiet = False  # it has something in flight: keep pace with it
    for status in msg.streams:
        st = core.streams.get(status.stream)
        if st is None:
            membership.readmit(core, status.stream, status.config, status.members)
            if not core.serves(status.stream) or not core.can_open(status.stream):
                continue
            if status.stream in core.closed_link_seq and blank_status(status):
                continue  # (5.11 closing: a blank stream there opens nothing that closed)
            st = core.stream(status.stream)
        # (compared once: hearing a configuration never wakes the stream)
        unchanged = st.dormant and peer.statuses.get(status.stream) == status
        if not unchanged and not _agrees(core, st, msg.sender, status, now_ms):
            continue  # (an unchanged status says the configuration heard before)
        if msg.sender not in st.members:
            continue
        if unchanged:
            # Nothing new of a stream with nothing in flight: the rest would change
            # nothing (5.11 dormancy), but the heartbeat's floor still moves the link's
            # floor and an ask to be admitted, and a member behind is sent the view.
            links.on_link_status(
                core, st, msg.sender, peer, status.last_link_seq, msg.floor, now_ms
            )
            if status.want_in:
                peer.want_in[status.stream] = (status.view, msg.floor)
            if status.view < st.view.number:
                view.push_view(core, st, msg.sender, now_ms)
            continue
        core.wake(st)
        peer.joined[status.stream] = status.joined
        peer.inherited_acked[status.stream] = next(
            (through for m, through in status.inherited_acks if m == core.id), -1
        )
        if status.want_in:
            # Asked at this view, with this floor: not admitted there, the sender
            # coordinates nothing until a later view admits it, so everything it ever
            # coordinated is at or below the floor (5.12, admission).
            peer.want_in[status.stream] = (status.view, msg.floor)
        else:
            peer.want_in.pop(status.stream, None)
        if status.view < st.view.number:
            view.push_view(core, st, msg.sender, now_ms)  # it missed a decision
        else:
            st.view_pushed.pop(msg.sender, None)  # current: a later push starts afresh
        links.on_link_status(core, st, msg.sender, peer, status.last_link_seq, msg.floor, now_ms)
        on_acks(core, st, status.acks)
        join.on_inherited(
            core,
            st,
            msg.sender,
            status.inherited,
            status.votes_final_through,
            omitted=status.inherited_omitted,
        )
        if status.committed_point >= 0:
            heard_commit(st, msg.sender, status.committed_point, status.committed_digest)
            advance(core, st, now_ms)
        if peer.links[status.stream].hole_lo < 0:
            peer.statuses[status.stream] = status
        else:
            # Taken only in part (its promise counts once the hole is closed,
            # join.on_inherited): the same status must be taken in full again then.
            peer.statuses.pop(status.stream, None)
