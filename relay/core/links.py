"""Receiving, floors, gaps, clocks and liveness (docs/protocol.md section 5.2).

Each ordered pair of relays is one FIFO link. Per peer and stream, a relay tracks the
peer's message counter (`link_seq`) and the peer's floor as of its last message that
followed all earlier ones. A jump in the counter opens a *hole*: the peer's transactions
above its last contiguous floor may be missing, so its floor stops advancing the watermark
and the relay asks the peer for them (a gap fill). The *watermark* W is the lowest such
floor among the members the view admits (and the relay's own): below W, the relay holds
every transaction they coordinated. A member is never left out of W here: only a view
change excludes it (relay/core/view.py, 5.12).

A member is *suspected* once silent for longer than its timeout: suspect_timeout_ms, or
more when its heartbeats have been arriving late (a stalled scheduler), and a relay that
itself stalled does not count its own sleep as the others' silence. Clocks: every
heartbeat carries the sender's wall clock; the median offset of the relays heard is the
majority's clock. A relay never lets its floor run more than max_clock_ahead_ms ahead of
the majority's clock, and one whose clock is that far from the majority's is an outlier:
it fences itself (5.9) and follows the others' floors.
"""

from __future__ import annotations

from relay.core.messages import PeerMessage, RepairReply, RepairStatus, TxBatch
from relay.core.seq import end_of_ms, ms_of, wall_ms
from relay.core.state import (
    NEVER,
    LinkState,
    PeerState,
    Purpose,
    RelayState,
    StreamState,
    admits,
    admits_run,
    open_interval,
)
from relay.core.timeline import Insert

# A peer's timeout: this many times the longest recent gap between its heartbeats, at
# least suspect_timeout_ms and at most SUSPECT_MAX_FACTOR times it.
HEARTBEAT_GAP_FACTOR = 3
SUSPECT_MAX_FACTOR = 8
GAP_DECAY_SHIFT = 3  # the gap maximum decays by 1/8 per heartbeat
# A tick this many heartbeat intervals late means this relay itself stalled.
SELF_STALL_INTERVALS = 3
# Per link, which of the last LINK_WINDOW link_seqs below the next expected one arrived.
# Only a message seen there is a duplicate (the same frame passed on by another relay as
# well, 5.13, or a network that duplicates frames: they trail the original by what the
# sender published in between, far fewer than this); any other message below the next
# expected one was never received (it was overtaken, or a forged count ran ahead of the
# sender's), and resynchronises the link (5.2). An older duplicate taken for new is
# processed twice, which changes nothing, and costs a gap fill.
LINK_WINDOW = 1024
_WINDOW_MASK = (1 << LINK_WINDOW) - 1


# --- admitting a peer's message --------------------------------------------------------------


def admit(
    core: RelayState, msg: PeerMessage, peer: PeerState, now_ms: int, *, direct: bool = True
) -> bool:
    """Whether to act on a valid message from `peer`: not from an older incarnation than
    one seen. Notes that we heard it (`direct`: straight from it, else passed on by
    another relay, 5.13), and raises our floor to the sender's, unless that runs more than
    max_clock_ahead_ms ahead of the majority's clock (an outlier's)."""
    if msg.incarnation < peer.incarnation:
        core.counters["stale_incarnation"] += 1
        return False
    if msg.incarnation > peer.incarnation:
        if msg.incarnation > incarnation_cap(core, now_ms):
            # Taken, it would make us drop every later message of the relay's real
            # incarnation as stale, for good (a forged or corrupted frame): refused.
            core.counters["incarnation_implausible"] += 1
            return False
        new_incarnation(core, msg.sender, peer, msg.incarnation)
    peer.last_heard_ms = now_ms
    if direct:
        peer.direct_ms = now_ms
    else:
        peer.relayed_ms = now_ms
    if msg.floor > floor_cap_at_least(core) and msg.floor > floor_cap(core, now_ms):
        core.counters["floor_not_followed"] += 1
    else:
        core.clock.raise_floor(msg.floor)
    return True


def incarnation_cap(core: RelayState, now_ms: int) -> int:
    """The highest incarnation we take from a peer (section 3): the majority's clock in
    ms since EPOCH_MS, plus max_clock_ahead_ms. A relay takes max(last + 1, its wall
    clock in those ms) at each start (relay/incarnation.py), so one whose clock is not an
    outlier's never goes above it; one started with its clock far ahead is not heard
    until real time catches up with the incarnation it took."""
    majority_ms = wall_ms(core.wall_ms + majority_offset_ms(core, now_ms))
    return majority_ms + core.limits.max_clock_ahead_ms


def new_incarnation(core: RelayState, sender: int, peer: PeerState, incarnation: int) -> None:
    """First contact with a peer, or the peer restarted with empty memory (section 3)."""
    restarted = peer.incarnation >= 0
    peer.incarnation = incarnation
    peer.joined.clear()
    peer.want_in.clear()
    peer.hears = frozenset()
    peer.heartbeat_ms = NEVER  # whom it hears is not known until its first heartbeat
    peer.quiet_gap_ms = 0
    peer.settled = False
    peer.inherited_acked.clear()
    peer.statuses.clear()
    # On first contact we join its message streams wherever they are; after a restart
    # they begin again at 1, and anything missing from there is a real gap.
    peer.sync_links = not restarted
    for st in core.streams.values():
        st.requests.close(Purpose.GAP_FILL, peer=sender)  # its links are gone
        # What it said of the stream's configuration (5.15) was its last incarnation's.
        st.disagree.pop(sender, None)
        held = open_interval(st.view, sender)
        state = peer.links.get(st.stream)
        if restarted and held is not None and held.incarnation != incarnation:
            # The view still counts the old incarnation: its floor holds W where it
            # stopped, until a view change cuts it (5.12).
            st.stale_floors[(sender, held.incarnation)] = state.contig_floor if state else 0
    peer.links.clear()
    if not restarted:
        return
    for st in core.streams.values():
        if sender in st.members:
            st.inherited_counted.pop(sender, None)
            st.commit_sources.discard(sender)
            frozen = st.known_through.get(sender, -1)
            st.votes_unknowable_above[sender] = min(
                st.votes_unknowable_above.get(sender, frozen), frozen
            )


# --- liveness and clocks -----------------------------------------------------------------------


def timeout_ms(core: RelayState, peer: PeerState) -> int:
    """How long `peer` may be silent before it is suspected."""
    base = core.limits.suspect_timeout_ms
    return min(max(base, HEARTBEAT_GAP_FACTOR * peer.gap_max_ms), SUSPECT_MAX_FACTOR * base)


def lag_ms(core: RelayState, members: tuple[int, ...], now_ms: int) -> int:
    """How much longer than suspect_timeout_ms the slowest live one of `members` may be
    silent, because its heartbeats have been arriving late (a loaded relay or a loaded
    machine): 0 on an idle mesh. Waits for answers stretch by it (5.12)."""
    base = core.limits.suspect_timeout_ms
    lag = 0
    for m in members:
        peer = core.peers[m]
        if is_live(core, peer, now_ms):
            lag = max(lag, timeout_ms(core, peer) - base)
    return lag


def is_live(core: RelayState, peer: PeerState, now_ms: int) -> bool:
    """Heard within its timeout: not suspected."""
    return now_ms < live_until_ms(core, peer)


def live_until_ms(core: RelayState, peer: PeerState) -> int:
    """When the peer becomes suspected if nothing more is heard: its timeout after its
    last message. When that was a quiet heartbeat (5.11), the gap it announced is excused
    and, while this relay is calm too, the longest timeout on top (nothing waits on it,
    and a quiet mesh on a loaded machine must not flap); but once this relay became busy
    after it, the usual timeout runs from then on: a quiet peer hears that at once and
    answers at the usual pace."""
    timeout = timeout_ms(core, peer)
    heard = peer.last_heard_ms
    if not peer.quiet_gap_ms or peer.heartbeat_ms < heard:
        return heard + timeout
    calm = heard + peer.quiet_gap_ms + SUSPECT_MAX_FACTOR * core.limits.suspect_timeout_ms
    if core.woke_ms > heard:
        return min(calm, core.woke_ms + timeout)
    return calm


def on_heartbeat(
    core: RelayState, peer: PeerState, sent_wall_ms: int, interval_ms: int, now_ms: int
) -> None:
    """Note a heartbeat's arrival (its gap since the last one, beyond any quiet gap the
    last one announced), the gap this one announces, and the sender's clock."""
    if peer.heartbeat_ms > 0:
        gap = now_ms - peer.heartbeat_ms - peer.quiet_gap_ms
        if peer.lost_ms > peer.heartbeat_ms or gap > outage_ms(core):
            # An outage (its connection closed meanwhile, or a silence no timeout
            # stretches to: a cut link, a stopped process), not a slow pace: counted, it
            # would keep the peer's timeout at its longest for a while after the heal, and
            # a crash then would go unseen for as long (5.2).
            gap = 0
            core.counters["heartbeat_gap_outage"] += 1
        decayed = peer.gap_max_ms - (peer.gap_max_ms >> GAP_DECAY_SHIFT)
        peer.gap_max_ms = max(gap, decayed)
    peer.heartbeat_ms = now_ms
    # A peer may excuse itself at most our own quiet interval (5.11).
    limits = core.limits
    announced = min(interval_ms, limits.quiet_interval_ms)
    peer.quiet_gap_ms = max(0, announced - limits.heartbeat_interval_ms)
    if sent_wall_ms > 0:
        peer.wall_offset_ms = sent_wall_ms - core.wall_ms


def outage_ms(core: RelayState) -> int:
    """A peer silent longer than this was cut off or stopped, not slow: no timeout waits
    this long (`timeout_ms`)."""
    return SUSPECT_MAX_FACTOR * core.limits.suspect_timeout_ms


def forgive_stall(core: RelayState, now_ms: int) -> None:
    """This relay did not run for a while (its process was stopped or starved): the
    others' silence during that time is not theirs. Shift their last-heard times by it."""
    stall = now_ms - core.last_tick_ms - core.tick_interval_ms
    if stall > SELF_STALL_INTERVALS * core.limits.heartbeat_interval_ms:
        core.counters["self_stall"] += 1
        for peer in core.peers.values():
            if peer.last_heard_ms > 0:
                peer.last_heard_ms = min(now_ms, peer.last_heard_ms + stall)
            if peer.direct_ms > 0:
                peer.direct_ms = min(now_ms, peer.direct_ms + stall)
    core.last_tick_ms = now_ms


def majority_offset_ms(core: RelayState, now_ms: int) -> int:
    """The majority's clock minus ours: the median offset over us and the peers heard."""
    offsets = sorted(
        [0]
        + [
            p.wall_offset_ms
            for p in core.peers.values()
            if p.wall_offset_ms is not None and is_live(core, p, now_ms)
        ]
    )
    return offsets[(len(offsets) - 1) // 2]


def floor_cap(core: RelayState, now_ms: int) -> int:
    """The highest floor we take from peers: max_clock_ahead_ms past the majority's clock."""
    majority_ms = wall_ms(core.wall_ms + majority_offset_ms(core, now_ms))
    return end_of_ms(majority_ms + core.limits.max_clock_ahead_ms)


def floor_cap_at_least(core: RelayState) -> int:
    """A lower bound of `floor_cap` that needs no liveness: the median over the live
    peers' offsets is at least the lowest offset of all (ours is 0). A floor at or below
    it is followed without working out the median, which every frame would otherwise
    do (it read each peer's timeout: a tenth of a relay's work per frame)."""
    offsets = [p.wall_offset_ms for p in core.peers.values() if p.wall_offset_ms is not None]
    lowest = min([0, *offsets])
    return end_of_ms(wall_ms(core.wall_ms + lowest) + core.limits.max_clock_ahead_ms)


def clock_outlier(core: RelayState, now_ms: int) -> bool:
    """Our clock, or our floor, is more than max_clock_ahead_ms from the majority's clock:
    we may not coordinate (5.9) until it is back."""
    bound = core.limits.max_clock_ahead_ms
    offset = majority_offset_ms(core, now_ms)
    if abs(offset) > bound:
        return True
    return ms_of(core.clock.floor) - wall_ms(core.wall_ms + offset) > bound


def peer_lost(core: RelayState, relay_id: int, now_ms: int) -> None:
    """The shell saw the connection to a peer close: suspect it now rather than after
    its timeout, unless its frames reach us through another relay too (5.13): then it is
    only no longer heard directly. Hearing from it again makes it live again."""
    peer = core.peers.get(relay_id)
    if peer is None:
        core.counters["peer_lost_unknown"] += 1
        return
    peer.lost_ms = now_ms
    silent_since = now_ms - timeout_ms(core, peer)
    peer.direct_ms = min(peer.direct_ms, silent_since)
    if peer.relayed_ms > silent_since:
        core.counters["peer_lost_direct"] += 1
    elif peer.last_heard_ms > silent_since:
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
        if _seen(state, link_seq):
            core.counters["link_duplicate"] += 1
            return False
        # Never received, yet below the count we expect: a later message or a heartbeat
        # overtook it (it came round through another relay), or a forged or corrupted
        # message claimed a count the sender never reached. Take it, follow the sender's
        # count from it again, and fetch what may have been lost meanwhile.
        _rewind(core, st, sender, state, link_seq, floor, now_ms)
    elif link_seq > state.expected:
        core.counters["link_gap"] += 1
        open_hole(core, st, sender, state, floor, now_ms)
    _count(state, link_seq, received=True)
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
        _count(state, last_link_seq, received=False)
    elif last_link_seq < state.expected - 1 and not _seen(state, last_link_seq):
        # The sender's last message is one we never received, below our count: as above.
        _rewind(core, st, sender, state, last_link_seq, floor, now_ms)
        _count(state, last_link_seq, received=False)
    if last_link_seq == state.expected - 1:
        state.latest_floor = max(state.latest_floor, floor)
        if state.hole_lo < 0:
            state.contig_floor = state.latest_floor


def _seen(state: LinkState, link_seq: int) -> bool:
    """Whether the message `link_seq`, below the next expected one, arrived (LINK_WINDOW)."""
    back = state.expected - 1 - link_seq
    return 0 <= back < LINK_WINDOW and bool(state.seen >> back & 1)


def _count(state: LinkState, link_seq: int, *, received: bool) -> None:
    """The sender published up to `link_seq` (at or above the next expected one); we
    received that message itself if `received`."""
    shift = link_seq + 1 - state.expected
    state.seen = 0 if shift >= LINK_WINDOW else state.seen << shift & _WINDOW_MASK
    state.seen |= int(received)
    state.expected = link_seq + 1


def _rewind(
    core: RelayState,
    st: StreamState,
    sender: int,
    state: LinkState,
    link_seq: int,
    floor: int,
    now_ms: int,
) -> None:
    """Our count of the sender's messages ran ahead of the sender's: start again from
    `link_seq` (what we saw above it no longer counts as seen), and treat what may have
    come in between as missing: a hole, as after a gap."""
    core.counters["link_rewound"] += 1
    open_hole(core, st, sender, state, floor, now_ms)
    state.expected = link_seq
    state.seen = 0


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


def refill(core: RelayState, st: StreamState, member: int, lo: int, now_ms: int) -> None:
    """Fetch again from `member` its transactions above `lo` on this stream: we may have
    missed them (we joined after they were sent, or the view did not count them yet)."""
    peer = core.peers.get(member)
    if peer is None:
        return
    state = peer.links.get(st.stream)
    if state is None or state.contig_floor <= lo:
        return  # nothing of its can be behind us yet: the link brings what follows
    if state.hole_lo < 0 or lo < state.hole_lo:
        state.hole_lo = lo
        state.hole_hi = max(state.hole_hi, state.latest_floor)
        state.contig_floor = lo
        request_fill(core, st, member, state, lo, now_ms)


def on_fill_reply(
    core: RelayState, st: StreamState, state: LinkState, msg: RepairReply, now_ms: int
) -> bool:
    """Insert what a gap fill brought and ask for the rest; True once the hole is closed.
    (The reports in the reply count as the sender's votes: the caller counts them.)"""
    if msg.status is RepairStatus.OK:
        for seq, tx in msg.entries:
            if not admits(st.view, msg.sender, msg.incarnation, seq):
                core.counters["fill_not_admitted"] += 1
                continue
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
    entries = msg.entries
    if (
        entries
        and admits_run(st.view, msg.sender, msg.incarnation, entries[0][0], entries[-1][0])
        and tl.append_run(entries)
    ):
        st.mark_run_end(entries[-1][0])
        core.announce_floor = True
        return
    held = False
    for seq, tx in msg.entries:
        if not admits(st.view, msg.sender, msg.incarnation, seq):
            core.counters["tx_not_admitted"] += 1
            continue
        outcome = tl.insert(seq, tx)
        if outcome is Insert.INSERTED:
            held = True
        else:
            core.counters["tx_" + outcome.value] += 1
            held = held or outcome is Insert.DUPLICATE
    if held:  # (a run end is one more point to report: only for an entry we hold)
        st.mark_run_end(msg.entries[-1][0])
    if msg.entries:
        core.announce_floor = True


# --- the watermark -------------------------------------------------------------------------


def watermark(core: RelayState, st: StreamState, now_ms: int) -> int:
    """W: no member the view admits will coordinate at or below it that we lack."""
    w = core.clock.floor
    for interval in st.view.intervals:
        m = interval.member
        if interval.cut >= 0 or m == core.id:
            continue
        peer = core.peers[m]
        if peer.incarnation == interval.incarnation:
            state = peer.links.get(st.stream)
            floor = state.contig_floor if state is not None else 0
        else:  # restarted (or not heard yet): where the admitted incarnation stopped
            floor = st.stale_floors.get((m, interval.incarnation), 0)
        if floor < w:
            w = floor
    return w
