"""Heartbeats (docs/protocol.md section 5.11): liveness, the floor, the clock, and per stream
what a member would otherwise only learn from messages that may have been lost.

Every heartbeat_interval_ms (and promptly when transactions arrived and the floor moved
while nothing else was sent) a relay sends its floor and wall clock (5.2: timeouts,
clocks) and, per stream it serves: the last link_seq it published (5.2: a lost last
message is noticed), its committed point and digest (5.4), whether it has joined (5.9:
redirects), its acks (5.4), its promise with the inherited reports (5.8), and its view's
number and whether it asks to be admitted (5.12: a member behind is sent the view); and
which peers it hears (5.12: only members that all hear each other are admitted).
"""

from __future__ import annotations

from relay.core import join, links, view
from relay.core.commit import acks, learn_commit, on_acks
from relay.core.messages import Heartbeat, StreamStatus
from relay.core.repair import advance
from relay.core.state import PeerState, RelayState


def send_heartbeat(core: RelayState, now_ms: int) -> None:
    core.last_heartbeat_ms = now_ms
    streams = tuple(
        StreamStatus(
            stream=st.stream,
            last_link_seq=st.link_seq_out,
            committed_point=st.timeline.committed_point,
            committed_digest=st.timeline.committed_digest,
            joined=st.join is None,
            acks=acks(st),
            inherited=join.promise(st),  # may raise votes_final_through: keep it first
            votes_final_through=st.votes_final_through,
            view=st.view.number,
            want_in=view.wants_in(core, st, now_ms),
        )
        for st in core.served_streams()
    )
    core.send(
        Heartbeat(
            sender=core.id,
            incarnation=core.incarnation,
            floor=core.clock.floor,
            streams=streams,
            wall_ms=core.wall_ms,
            hears=tuple(m for m, p in sorted(core.peers.items()) if links.is_live(core, p, now_ms)),
        )
    )


def on_heartbeat(core: RelayState, msg: Heartbeat, peer: PeerState, now_ms: int) -> None:
    links.on_heartbeat(core, peer, msg.wall_ms, now_ms)
    peer.hears = frozenset(msg.hears)
    for status in msg.streams:
        st = core.streams.get(status.stream)
        if st is None:
            if not core.topology.serves(core.id, status.stream) or not core.can_open(status.stream):
                continue
            st = core.stream(status.stream)
        if msg.sender not in st.members:
            continue
        peer.joined[status.stream] = status.joined
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
        join.on_inherited(core, st, msg.sender, status.inherited, status.votes_final_through)
        if status.committed_point >= 0:
            learn_commit(st, status.committed_point, status.committed_digest, [msg.sender])
            advance(core, st, now_ms)
