"""Receiving, floors and gaps (docs/protocol.md section 5.2).

Each ordered pair of relays is one FIFO link. Per peer and stream, a relay tracks the
peer's message counter (`link_seq`) and the peer's floor as of its last message that
followed all earlier ones. A jump in the counter opens a *hole*: the peer's transactions
above its last contiguous floor may be missing, so its floor stops advancing the watermark
and the relay asks the peer for them (a gap fill). The *watermark* W is the lowest such
floor among the live members (and the relay's own): below W, the relay holds every
transaction a live member coordinated. A member that goes silent is *suspected*; before W
leaves it out, the relay fetches from the other live members what the suspect sent them
(the suspicion sync).
"""

from __future__ import annotations

from relay.core.messages import (
    PeerMessage,
    Refusal,
    RepairReply,
    RepairStatus,
    TxBatch,
)
from relay.core.seq import MAX_SEQ, relay_of
from relay.core.state import (
    LinkState,
    PeerState,
    Purpose,
    RelayState,
    StreamState,
    SuspectSync,
)
from relay.core.timeline import Insert

# A suspicion sync waits at most this many repair_retry_ms rounds for the members it
# asked, then lets the watermark leave the suspected member out anyway.
SYNC_MAX_ROUNDS = 3


# --- admitting a peer's message --------------------------------------------------------------


def admit(core: RelayState, msg: PeerMessage, peer: PeerState, now_ms: int) -> bool:
    """Whether to act on a valid message from `peer`: not from an older incarnation than
    one seen, and not from a clock too far ahead (refused, 5.2). Raises our floor to the
    sender's and notes that we heard it."""
    if msg.incarnation < peer.incarnation:
        core.counters["stale_incarnation"] += 1
        return False
    ahead_ms = core.clock.ahead_by_ms(msg.floor, core.wall_ms)
    if ahead_ms > core.limits.max_clock_ahead_ms:
        refuse(core, peer, msg.sender, f"clock ahead by {ahead_ms} ms", now_ms)
        return False
    if msg.incarnation > peer.incarnation:
        new_incarnation(core, msg.sender, peer, msg.incarnation)
    peer.last_heard_ms = now_ms
    core.clock.raise_floor(msg.floor)
    return True


def refuse(core: RelayState, peer: PeerState, sender: int, reason: str, now_ms: int) -> None:
    """Drop a peer's message and tell it why, at most once per heartbeat interval."""
    core.counters["refused_clock_ahead"] += 1
    if now_ms - peer.refusal_sent_ms >= core.limits.heartbeat_interval_ms:
        peer.refusal_sent_ms = now_ms
        core.send(
            Refusal(
                sender=core.id,
                incarnation=core.incarnation,
                floor=core.clock.floor,
                target=sender,
                reason=reason,
            )
        )


def new_incarnation(core: RelayState, sender: int, peer: PeerState, incarnation: int) -> None:
    """First contact with a peer, or the peer restarted with empty memory (section 3)."""
    restarted = peer.incarnation >= 0
    peer.incarnation = incarnation
    peer.links.clear()
    peer.joined.clear()
    # On first contact we join its message streams wherever they are; after a restart
    # they begin again at 1, and anything missing from there is a real gap.
    peer.sync_links = not restarted
    for st in core.streams.values():
        st.requests.close(Purpose.GAP_FILL, peer=sender)  # its links are gone
    if not restarted:
        return
    for st in core.streams.values():
        if sender in st.members:
            st.commit_sources.discard(sender)
            frozen = st.known_through.get(sender, -1)
            st.votes_unknowable_above[sender] = min(
                st.votes_unknowable_above.get(sender, frozen), frozen
            )


# --- liveness ----------------------------------------------------------------------------------


def is_live(core: RelayState, peer: PeerState, now_ms: int) -> bool:
    """Heard within suspect_timeout_ms: not suspected."""
    return now_ms - peer.last_heard_ms < core.limits.suspect_timeout_ms


def peer_lost(core: RelayState, relay_id: int, now_ms: int) -> None:
    """The shell saw the connection to a peer close: suspect it now rather than after
    suspect_timeout_ms of silence. Hearing from it again makes it live again."""
    peer = core.peers.get(relay_id)
    if peer is None:
        core.counters["peer_lost_unknown"] += 1
        return
    silent_since = now_ms - core.limits.suspect_timeout_ms
    if peer.last_heard_ms > silent_since:
        peer.last_heard_ms = silent_since
        core.counters["peer_lost"] += 1


# --- link counters and holes -------------------------------------------------------------------


def link(peer: PeerState, stream: str) -> LinkState:
    found = peer.links.get(stream)
    if found is None:
        found = peer.links[stream] = LinkState(expected=0 if peer.sync_links else 1)
    return found


def on_link_message(
    core: RelayState,
    st: StreamState,
    sender: int,
    peer: PeerState,
    link_seq: int,
    floor: int,
    now_ms: int,
) -> bool:
    """Track the peer's per-stream message counter; False for a duplicate."""
    state = link(peer, st.stream)
    if state.expected == 0:
        state.expected = link_seq
    if link_seq < state.expected:
        core.counters["link_duplicate"] += 1
        return False
    if link_seq > state.expected:
        core.counters["link_gap"] += 1
        open_hole(core, st, sender, state, floor, now_ms)
    state.expected = link_seq + 1
    state.latest_floor = max(state.latest_floor, floor)
    if state.hole_lo < 0:
        state.contig_floor = state.latest_floor
    return True


def on_link_status(
    core: RelayState,
    st: StreamState,
    sender: int,
    peer: PeerState,
    last_link_seq: int,
    floor: int,
    now_ms: int,
) -> None:
    """A heartbeat names the peer's last link_seq on the stream: a lost last message is
    noticed too, and with nothing missing the heartbeat's floor moves the link's floor."""
    state = link(peer, st.stream)
    if state.expected == 0:
        state.expected = last_link_seq + 1
    if last_link_seq >= state.expected:
        core.counters["link_gap_heartbeat"] += 1
        open_hole(core, st, sender, state, floor, now_ms)
        state.expected = last_link_seq + 1
    if last_link_seq == state.expected - 1:
        state.latest_floor = max(state.latest_floor, floor)
        if state.hole_lo < 0:
            state.contig_floor = state.latest_floor


def open_hole(
    core: RelayState, st: StreamState, sender: int, state: LinkState, floor: int, now_ms: int
) -> None:
    if state.hole_lo < 0:
        # Lost transactions lie above the last contiguous floor; lost reports lie above
        # the last report we know of, which trails the floor: ask from the lower one.
        state.hole_lo = min(state.contig_floor, max(st.known_through.get(sender, 0), 0))
        state.hole_hi = floor
        request_fill(core, st, sender, state, state.hole_lo, now_ms)
    else:
        state.hole_hi = max(state.hole_hi, floor)


def request_fill(
    core: RelayState, st: StreamState, sender: int, state: LinkState, lo: int, now_ms: int
) -> None:
    """Ask `sender` for its own transactions (and reports) in (lo, hole_hi]."""
    st.requests.close(Purpose.GAP_FILL, peer=sender)  # only the latest answer counts
    core.ask(st, Purpose.GAP_FILL, sender, lo, state.hole_hi, origin=sender)
    state.fill_sent_ms = now_ms
    state.fill_lo = lo


def close_hole(st: StreamState, sender: int, state: LinkState) -> None:
    state.hole_lo = state.hole_hi = -1
    state.contig_floor = state.latest_floor
    st.requests.close(Purpose.GAP_FILL, peer=sender)


def on_fill_reply(
    core: RelayState, st: StreamState, state: LinkState, msg: RepairReply, now_ms: int
) -> bool:
    """Insert what a gap fill brought and ask for the rest; True once the hole is closed.
    (The reports in the reply count as the sender's votes: the caller counts them.)"""
    if msg.status is RepairStatus.OK:
        for seq, tx in msg.entries:
            outcome = st.timeline.insert(seq, tx)
            core.counters["fill_" + outcome.value] += 1
        if msg.more or state.hole_hi > msg.hi:
            request_fill(core, st, msg.sender, state, msg.hi, now_ms)
            return False
    core.counters["hole_closed"] += 1
    close_hole(st, msg.sender, state)
    return True


def retry_fills(core: RelayState, st: StreamState, now_ms: int) -> None:
    """Ask live members again for gap fills unanswered for repair_retry_ms."""
    for m in st.peers:
        peer = core.peers[m]
        state = peer.links.get(st.stream)
        if state is None or state.hole_lo < 0:
            continue
        if not is_live(core, peer, now_ms):
            continue
        if now_ms - state.fill_sent_ms >= core.limits.repair_retry_ms:
            request_fill(core, st, m, state, state.fill_lo, now_ms)


def on_tx_batch(core: RelayState, st: StreamState, msg: TxBatch) -> None:
    """A coordinator's transactions: inserted above what we reported, else kept late."""
    tl = st.timeline
    for seq, tx in msg.entries:
        outcome = tl.insert(seq, tx)
        if outcome is not Insert.INSERTED:
            core.counters["tx_" + outcome.value] += 1
    if msg.entries:
        core.announce_floor = True


# --- the watermark -------------------------------------------------------------------------


def watermark(core: RelayState, st: StreamState, now_ms: int) -> int:
    """W: no live member will coordinate at or below it that we have not received."""
    w = core.clock.floor
    for m in st.peers:
        peer = core.peers[m]
        if now_ms - peer.last_heard_ms >= core.limits.suspect_timeout_ms:
            sync = st.syncs.get(m)
            if sync is not None and sync.done and sync.heard_ms == peer.last_heard_ms:
                continue  # suspected and synced: left out (liveness; digests keep us safe)
            # Suspected, but what it sent others is not fetched yet: hold at its floor.
        state = peer.links.get(st.stream)
        floor = state.contig_floor if state is not None else 0
        if floor < w:
            w = floor
    return w


# --- the suspicion sync ----------------------------------------------------------------------


def tick_syncs(core: RelayState, st: StreamState, now_ms: int) -> None:
    for m in st.peers:
        peer = core.peers[m]
        sync = st.syncs.get(m)
        if is_live(core, peer, now_ms):
            if sync is not None:
                st.end_sync(m)  # heard again: its own link speaks for it
            continue
        if sync is None or sync.heard_ms != peer.last_heard_ms:
            start_sync(core, st, m, now_ms)
        elif not sync.done:
            retry_sync(core, st, m, sync, now_ms)


def start_sync(core: RelayState, st: StreamState, suspect: int, now_ms: int) -> None:
    peer = core.peers[suspect]
    state = peer.links.get(st.stream)
    floor = state.contig_floor if state is not None else 0
    # Below our committed point the suspect's transactions are settled for us.
    lo = max(floor, st.timeline.committed_point, 0)
    # Heard and silent again since an earlier sync: start over (its requests are void).
    st.requests.close(Purpose.SUSPECT_SYNC, about=suspect)
    sync = st.syncs[suspect] = SuspectSync(
        heard_ms=peer.last_heard_ms, lo=lo, started_ms=now_ms, sent_ms=now_ms
    )
    core.counters["suspect_sync_started"] += 1
    for m in st.peers:
        if m != suspect and is_live(core, core.peers[m], now_ms):
            send_sync_request(core, st, suspect, m, lo)
    if not st.requests.asked(Purpose.SUSPECT_SYNC, suspect):
        sync.done = True


def send_sync_request(
    core: RelayState, st: StreamState, suspect: int, member: int, lo: int
) -> None:
    core.ask(st, Purpose.SUSPECT_SYNC, member, lo, MAX_SEQ, origin=suspect, about=suspect)


def retry_sync(
    core: RelayState, st: StreamState, suspect: int, sync: SuspectSync, now_ms: int
) -> None:
    retry_ms = core.limits.repair_retry_ms
    # A member that went silent too has its own sync; one that does not answer in time
    # must not hold the watermark (and so every commit) for ever.
    for member in st.requests.asked(Purpose.SUSPECT_SYNC, suspect):
        if not is_live(core, core.peers[member], now_ms):
            st.requests.close(Purpose.SUSPECT_SYNC, peer=member, about=suspect)
    asked = st.requests.asked(Purpose.SUSPECT_SYNC, suspect)
    if asked and now_ms - sync.started_ms >= SYNC_MAX_ROUNDS * retry_ms:
        core.counters["suspect_sync_gave_up"] += 1
        st.requests.close(Purpose.SUSPECT_SYNC, about=suspect)
        asked = []
    if not asked:
        sync.done = True
        return
    if now_ms - sync.sent_ms >= retry_ms:
        sync.sent_ms = now_ms
        st.requests.close(Purpose.SUSPECT_SYNC, about=suspect)
        for member in asked:
            send_sync_request(core, st, suspect, member, sync.lo)


def on_sync_reply(core: RelayState, st: StreamState, suspect: int, msg: RepairReply) -> None:
    """What a member holds of the suspect's transactions (its request is closed)."""
    sync = st.syncs[suspect]
    if msg.status is RepairStatus.OK:
        for seq, tx in msg.entries:
            if relay_of(seq) == suspect:
                core.counters["sync_" + st.timeline.insert(seq, tx).value] += 1
        if msg.more:
            send_sync_request(core, st, suspect, msg.sender, msg.hi)
            return
    if not st.requests.asked(Purpose.SUSPECT_SYNC, suspect):
        sync.done = True
        core.counters["suspect_sync_done"] += 1
