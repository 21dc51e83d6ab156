"""Heartbeats (docs/protocol.md section 5.11): liveness, the floor, the clock, and per stream
what a member would otherwise only learn from messages that may have been lost.

Every heartbeat_interval_ms (and promptly when transactions arrived and the floor moved
while nothing else was sent) a relay sends its floor and wall clock (5.2: timeouts,
clocks) and, per stream it serves: the last link_seq it published (5.2: a lost last
message is noticed), its committed point and digest (5.4), whether it has joined (5.9:
redirects), its acks (5.4), its promise with the inherited reports (5.8), and its view's
number and whether it asks to be admitted (5.12: a member behind is sent the view); and
which peers it hears (5.12: only members that all hear each other are admitted).

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

from relay.core import join, links, view
from relay.core.commit import acks, learn_commit, on_acks
from relay.core.messages import Heartbeat, StreamStatus
from relay.core.repair import advance
from relay.core.state import NEVER, PeerState, RelayState, StreamState


def interval_ms(core: RelayState) -> int:
    """How long after the last heartbeat the next is due."""
    limits = core.limits
    return limits.quiet_interval_ms if core.quiet else limits.heartbeat_interval_ms


def settled(core: RelayState, now_ms: int) -> bool:
    """Nothing but heartbeats for quiet_after_ms, and nothing in flight."""
    if now_ms - core.busy_ms < core.limits.quiet_after_ms or core.forwards:
        return False
    return all(stream_settled(st) for st in core.streams.values())


def stream_settled(st: StreamState) -> bool:
    return (
        st.join is None
        and not st.fenced
        and not st.stall_reason
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
    streams = tuple(_stream_status(core, st, now_ms) for st in core.served_streams())
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
        )
    )


def _stream_status(core: RelayState, st: StreamState, now_ms: int) -> StreamStatus:
    inherited = join.promise(st)  # may raise votes_final_through: keep it first
    omitted = False
    if inherited:
        if join.inherited_to_send(core, st, now_ms):
            st.inherited_sent_ms = now_ms
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
        want_in=view.wants_in(core, st, now_ms),
        inherited_acks=tuple(sorted(st.inherited_counted.items())),
        inherited_omitted=omitted,
    )


def on_heartbeat(core: RelayState, msg: Heartbeat, peer: PeerState, now_ms: int) -> None:
    links.on_heartbeat(core, peer, msg.wall_ms, msg.interval_ms, now_ms)
    peer.hears = frozenset(msg.hears)
    peer.settled = msg.settled
    if not msg.settled:
        core.quiet = False  # it has something in flight: keep pace with it
    for status in msg.streams:
        st = core.streams.get(status.stream)
        if st is None:
            if not core.topology.serves(core.id, status.stream) or not core.can_open(status.stream):
                continue
            st = core.stream(status.stream)
        if msg.sender not in st.members:
            continue
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
            learn_commit(st, status.committed_point, status.committed_digest, [msg.sender])
            advance(core, st, now_ms)
