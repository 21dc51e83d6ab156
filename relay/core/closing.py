"""Closing idle streams (docs/protocol.md section 5.11, closing).

A pattern's stream opens here on first use: a read, a produce, a member's message about
it. One that nobody writes (a reader waiting for the first record, a client reading
names at random) holds nothing, yet costs its relays a join, a place in the heartbeats'
turns and in every wake of all streams. A stream is *blank* here while it holds nothing
and promised nothing: not in use (5.12: no produce reached us, no view, no member asks
to be admitted), no entry, no commit above the genesis and none in an earlier
incarnation, no seed, no established configuration, no vote, promise, acceptance or
inherited report, no repair, reset or view change under way. A blank stream that has
joined, whose members' statuses say it is blank there too, is closed once no read reached
it here for `idle_stream_close_ms`, or `unread_stream_close_ms` after it opened if none
ever did (a member's join opened it here): its state is dropped, as if it had never been
opened, but for its link counter, which goes on from where it stopped should it open
again (the members drop a frame whose counter they passed, 5.2).

So that closed streams stay closed while nobody uses them, a *blank status* (a member's
heartbeat status of a blank stream of its own: view 0, nothing committed, no promise, no
ask to be admitted, the provisional configuration) opens nothing here when this relay
closed the stream (its name is among the last max_streams closed, whose link counters
are kept by name: `closed_link_seq`; older ones count only through `closed_link_floor`,
the highest counter of those forgotten, above which every stream opened since starts),
and an answer to a request made for a stream since closed (a join, repair or view reply)
is dropped. Every
other message about a stream opens it as before: the first produce anywhere reaches
every member as a view request and as the coordinator's ask to be admitted. A stream
closed is told, in the next few heartbeats, as not joined (a blank status): a member that
still tracks it waits for us to join again before a first view, as it must, rather than
on a word we no longer keep.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from relay.core import view
from relay.core.messages import JoinReply, RepairReply, StreamStatus, ViewReply
from relay.core.state import GENESIS_POINT, NEVER, PROVISIONAL, RelayState, StreamState
from relay.core.timeline import NO_DIGEST

# The answers that belong to a request of ours (dropped once the stream closed).
REPLIES = (JoinReply, RepairReply, ViewReply)
# A stream closed is told to its members in this many of the next heartbeats, as not
# joined: they do not wait on our word of it (5.15: a first view needs every member
# joined), and a member whose file no longer names us learns that we are silent.
CLOSED_TOLD_HEARTBEATS = 3


def blank(core: RelayState, st: StreamState) -> bool:
    """Whether the stream holds nothing here and promised nothing (see above)."""
    tl = st.timeline
    acceptor = st.acceptor
    return (
        not view.in_use(core, st)
        and st.config_version == PROVISIONAL
        and not st.config_recorded
        and not st.committed_before
        and st.seed is None
        and st.history_lost_below < 0
        and tl.committed_point <= GENESIS_POINT
        and len(tl) == 0
        and tl.reported <= GENESIS_POINT
        and st.votes.max_seen <= GENESIS_POINT
        and not st.pending
        and not st.out_entries
        and not st.run_ends
        and not st.inherited
        and st.votes_final_through <= GENESIS_POINT
        and acceptor.promised < 0
        and acceptor.accepted is None
        and st.abstain_through == 0
        and st.proposal is None
        and st.repair is None
        and st.reset is None
        and st.view_wanted_ms == NEVER
    )


def blank_status(status: StreamStatus) -> bool:
    """Whether a member's status says its stream is blank there: it opens nothing."""
    return (
        status.view == 0
        and status.committed_point <= GENESIS_POINT
        and not status.want_in
        and not status.inherited
        and status.votes_final_through <= GENESIS_POINT
        and status.config == PROVISIONAL
    )


def note_read(core: RelayState, stream: str) -> None:
    """A read reached the stream here: a blank one stays open idle_stream_close_ms more."""
    if core.unread_since.pop(stream, None) is not None or stream in core.read_since:
        core.read_since[stream] = core.now_ms
        core.read_since.move_to_end(stream)


def reply_for_closed(core: RelayState, msg: object) -> bool:
    """Whether `msg` answers a request made for a stream closed since (it is dropped)."""
    stream: str = getattr(msg, "stream", "")
    return type(msg) in REPLIES and stream not in core.streams and stream in core.closed_link_seq


def close_idle(core: RelayState, now_ms: int) -> None:
    """Close the blank streams no read reached here for idle_stream_close_ms, and those
    none ever reached here after unread_stream_close_ms."""
    limits = core.limits
    _close_idle(core, core.read_since, limits.idle_stream_close_ms, now_ms)
    _close_idle(core, core.unread_since, limits.unread_stream_close_ms, now_ms)


def _close_idle(core: RelayState, idle: OrderedDict[str, int], after_ms: int, now_ms: int) -> None:
    """`idle`: stream -> since when, oldest first. A stream found in use leaves it for
    good (being in use never ends); one that holds something for now, or whose members
    say it does, is looked at again `after_ms` later."""
    while idle:
        stream, since_ms = next(iter(idle.items()))
        if 0 <= now_ms - since_ms < after_ms:
            return  # (one opened before the shell's first monotonic time is looked at now)
        del idle[stream]
        st = core.streams.get(stream)
        if st is None or st.written or st.view.number > 0:
            continue
        if closable(core, st):
            close(core, st)
        else:
            idle[stream] = now_ms


def closable(core: RelayState, st: StreamState) -> bool:
    """Blank and joined here, and blank at every member that gave its status (a joining
    relay or a member's word may be about to put it in use)."""
    if st.join is not None or not blank(core, st):
        return False
    stream = st.stream
    for peer in core.peers.values():
        status = peer.statuses.get(stream)
        if status is not None and not blank_status(status):
            return False
    return True


def close(core: RelayState, st: StreamState) -> None:
    """Drop a blank stream's state; tell the shell (Ready.closed)."""
    assert blank(core, st), "only a stream that holds and promised nothing is closed"
    stream = st.stream
    del core.streams[stream]
    core.read_since.pop(stream, None)
    core.unread_since.pop(stream, None)
    core.invalidate_names()
    core.memory.used_bytes -= st.timeline.memory_bytes
    core.spool_held_back.discard(stream)
    for peer in core.peers.values():
        peer.links.pop(stream, None)
        peer.joined.pop(stream, None)
        peer.want_in.pop(stream, None)
        peer.statuses.pop(stream, None)
        peer.inherited_acked.pop(stream, None)
    kept = core.closed_link_seq
    kept[stream] = st.link_seq_out
    kept.move_to_end(stream)
    if len(kept) > core.limits.max_streams:
        _, link_seq = kept.popitem(last=False)
        core.closed_link_floor = max(core.closed_link_floor, link_seq)
    core.closed_told[stream] = (
        StreamStatus(
            stream=stream,
            last_link_seq=st.link_seq_out,
            committed_point=-1,
            committed_digest=NO_DIGEST,
            joined=False,
            config=st.config_version,
            members=st.members,
        ),
        CLOSED_TOLD_HEARTBEATS,
    )
    core.closed_told.move_to_end(stream)
    core.counters["streams_closed_idle"] += 1
    core.outbox.closed.append(stream)


def closed_statuses(core: RelayState) -> list[StreamStatus]:
    """The statuses of streams closed lately that the next heartbeat gives (at most
    heartbeat_repeated_statuses of them, the oldest first), each CLOSED_TOLD_HEARTBEATS
    times; a stream opened again since is told as it stands instead."""
    told = core.closed_told
    out: list[StreamStatus] = []
    for stream in list(itertools.islice(told, core.limits.heartbeat_repeated_statuses)):
        status, left = told.pop(stream)
        if stream in core.streams:
            continue
        out.append(status)
        if left > 1:
            told[stream] = (status, left - 1)
    return out
