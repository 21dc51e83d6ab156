"""Reporting, counting votes, committing and delivering (docs/protocol.md sections 5.3, 5.4).

A member reports its digest at the end of every TxBatch it published or received (and,
while the stream is unsettled, at aligned checkpoints) between the last point it reported
and the watermark, each point once, in increasing order. A point commits when a quorum of
counted reports agree there; a member counts its own report only once some member
acknowledged having it. A relay delivers up to the highest known committed point whose
digest equals its own there; what to do when it does not is repair (relay/core/repair.py).
"""

from __future__ import annotations

from relay.core import coordinate, memory, spooling
from relay.core.links import is_live, watermark
from relay.core.messages import Ack, Report, Reports
from relay.core.seq import end_of_ms, ms_of
from relay.core.shell import Delivery
from relay.core.state import NEVER, NOT_DUE, PROVISIONAL, RelayState, StreamState
from relay.core.transit import reaches

# Acks that moved above our committed point go out alone only if we did not commit past
# them this long after (5.4). In a mesh where every member reports, the others' reports
# commit the point within a hop and the ack is never needed; where one is missing, a
# member counting its own report waits this much longer for it.
ACK_HOLD_MS = 2

# --- counting ---------------------------------------------------------------------------------


def count_votes(st: StreamState, reporter: int, points: tuple[Report, ...]) -> None:
    votes = st.votes
    committed_here: tuple[int, bytes] | None = None
    for point, digest in points:
        if votes.add(reporter, point, digest):
            committed_here = (point, digest)
    if committed_here is not None:
        learn_commit(st, *committed_here, sources=votes.reporters(*committed_here))


def learn_commit(st: StreamState, point: int, digest: bytes, sources: list[int]) -> None:
    """A committed point, counted here or announced by a member."""
    if point > st.votes.max_seen:
        st.votes.max_seen = point
    known = st.known_commit[0]
    if point > known:
        st.known_commit = (point, digest)
        st.commit_sources = set(sources)
    elif point == known:
        st.commit_sources.update(sources)


def heard_commit(st: StreamState, sender: int, point: int, digest: bytes) -> None:
    """A member announced its committed point (its Reports or heartbeat)."""
    if point > st.others_announced:
        st.others_announced = point
    learn_commit(st, point, digest, [sender])


def update_known_through(core: RelayState, st: StreamState, member: int) -> None:
    """With no hole on its link, every report of `member` up to its last one is known."""
    state = core.peers[member].links.get(st.stream)
    if state is not None and state.hole_lo < 0:
        last = st.votes.last_point.get(member, -1)
        if last > st.known_through.get(member, -1):
            st.known_through[member] = last


def on_reports(core: RelayState, st: StreamState, msg: Reports) -> None:
    """A member's new reports, committed point and acks (the caller then advances)."""
    count_votes(st, msg.sender, msg.points)
    update_known_through(core, st, msg.sender)
    on_acks(core, st, msg.acks)
    if msg.committed_point >= 0:
        heard_commit(st, msg.sender, msg.committed_point, msg.committed_digest)


def on_acks(core: RelayState, st: StreamState, acks: tuple[Ack, ...]) -> None:
    for relay, point in acks:
        if relay == core.id and point > st.own_acked_through:
            st.own_acked_through = point
            count_acked_own(core, st)


def count_acked_own(core: RelayState, st: StreamState) -> None:
    acked: list[Report] = []
    while st.own_unacked and st.own_unacked[0][0] <= st.own_acked_through:
        acked.append(st.own_unacked.popleft())
    if acked:
        count_votes(st, core.id, tuple(acked))


def acks(st: StreamState) -> tuple[Ack, ...]:
    """What we have of each member's reports: all of them up to known_through."""
    return tuple((m, p) for m in st.peers if (p := st.known_through.get(m, -1)) >= 0)


# --- reporting --------------------------------------------------------------------------------


def unsettled(st: StreamState) -> bool:
    tl = st.timeline
    return (
        tl.reported > tl.committed_point
        or tl.delivered < len(tl.seqs)
        or st.known_commit[0] > tl.committed_point
        or st.votes.max_seen > max(tl.reported, st.votes_final_through)  # join in
    )


def checkpoints(core: RelayState, above: int, upto: int) -> list[int]:
    """Aligned report points in (above, upto]: the end of every interval-th millisecond.
    Relays pick the same points, so they can agree while no transaction arrives."""
    interval = core.limits.checkpoint_interval_ms
    lo_ms = max(ms_of(above), 0)
    hi_ms = ms_of(upto)
    first = lo_ms - lo_ms % interval + interval - 1
    last = hi_ms - (hi_ms + 1) % interval
    if last < first:
        return []
    count = (last - first) // interval + 1
    skip = max(count - core.limits.max_checkpoints_per_report, 0)
    points = [end_of_ms(first + (skip + k) * interval) for k in range(count - skip)]
    return [p for p in points if above < p <= upto]


def collect_reports(core: RelayState, st: StreamState, now_ms: int) -> None:
    tl = st.timeline
    if st.join is not None or st.repair is not None or st.reset is not None:
        return
    if st.config_version == PROVISIONAL:
        return  # no vote before a view established the configuration (5.15)
    if st.reports_paused or st.acceptor.promised >= 0:
        return  # a split seen (5.7), or frozen by a view change under way (5.12)
    if not spooling.may_report(core, st):
        return  # our spool has no room for what we hold (5.14)
    w = watermark(core, st, now_ms)
    # We report only above what we reported and above our promise; transactions may
    # still enter between the two (we never reported there).
    above = max(tl.reported, st.votes_final_through)
    if w <= above:
        return
    start = tl.index_after(above)
    end = tl.index_after(w)
    wanted = st.take_run_ends(above, w)
    if unsettled(st) or end > start:
        aligned = checkpoints(core, above, w)
        if aligned:
            wanted = sorted({*wanted, *aligned})
    points: list[Report] = []
    for p in wanted:
        d = tl.digest_at(p)
        if d is not None:
            points.append((p, d))
    if not points:
        return
    tl.reported = tl.voted_through = points[-1][0]
    st.out_reports.extend(points)
    st.report_log.extend(points)
    tl.charge_report_log(len(st.report_log))
    if st.peers:
        st.own_unacked.extend(points)
        count_acked_own(core, st)
    else:
        count_votes(st, core.id, tuple(points))  # a stream of one: nobody to ack


def resume_reports(st: StreamState) -> None:
    st.reports_paused = False  # the promise made while paused still bounds our reports


def publish_reports(core: RelayState, st: StreamState) -> None:
    """Publish new reports, and our committed point and acks when they moved."""
    collect_reports(core, st, core.now_ms)
    committed = st.timeline.committed_point
    our_acks = acks(st)
    # Acks of reports at or below our committed point need no message of their own: our
    # committed point tells their authors more (a stream just joined would otherwise
    # send a Reports per member heard, thousands when thousands of streams open at once).
    # Nor do acks that our next commit will pass: they wait ACK_HOLD_MS for it (5.4).
    acks_moved = any(st.acks_sent.get(m, -1) < p and p > committed for m, p in our_acks)
    if not acks_moved:
        st.acks_by_ms = NOT_DUE
    elif st.acks_by_ms == NOT_DUE:
        st.acks_by_ms = core.now_ms + ACK_HOLD_MS
    acks_due = core.now_ms >= st.acks_by_ms
    news = committed > st.announced_commit and core.now_ms >= st.announce_by_ms
    if st.out_reports or news or acks_due:
        st.link_seq_out += 1
        st.announced_commit = committed
        st.acks_sent = dict(our_acks)
        st.acks_by_ms = NOT_DUE
        core.send(
            Reports(
                sender=core.id,
                incarnation=core.incarnation,
                floor=core.clock.floor,
                stream=st.stream,
                link_seq=st.link_seq_out,
                points=tuple(st.out_reports),
                committed_point=committed,
                committed_digest=st.timeline.committed_digest,
                acks=our_acks,
                lead=coordinate.lead(core, st, core.now_ms),
                config=st.config_version,
            ),
            stream=st.stream,
        )
        st.out_reports = []


def plan_announcement(core: RelayState, st: StreamState, point: int, digest: bytes) -> None:
    """When our committed point must be announced by a Reports of its own (5.4), should no
    Reports carry it before: at once if a member may need it from us to commit, else
    lazily. The lazy announcement goes with the next Reports, or after a heartbeat interval
    (a stream is dormant only once it announced its commit, 5.11). Announcing every commit
    from every member cost each relay a frame per commit and each peer a turn to read it
    (a third of the frames at one transaction in flight)."""
    mask = st.votes.mask(point, digest)
    if not mask >> core.id & 1:  # our report there, if any, is not acknowledged yet
        for mine in st.own_unacked:
            if mine[0] >= point:
                if mine == (point, digest):
                    mask |= 1 << core.id  # the others count it
                break
    lazy = others_announce(core, st, point, mask)
    due = core.now_ms + (core.limits.heartbeat_interval_ms if lazy else 0)
    if st.announced_commit >= st.timeline.committed_point:  # nothing waiting: start over
        st.announce_by_ms = due
    else:
        st.announce_by_ms = min(st.announce_by_ms, due)


def others_announce(core: RelayState, st: StreamState, point: int, mask: int) -> bool:
    """Whether every member that may need a commit at `point` (reported by the members in
    `mask`) gets it without an announcement from us (5.4):

    - another member announced it already: every member hears that announcement;
    - or every member hears q reports there besides its own, counting as reporting there
      every live member that has joined and hears every member (its report is on its
      way: a member reports what it holds, 5.3), so commits by itself;
    - or a live member with a lower id hears q reports there besides its own: it commits
      without its own report and, by this same rule, announces at once.

    A member that needs it and is missed here (the lower member fell silent after all, or
    a member counted on did not report there) gets our lazy announcement, a heartbeat
    interval later."""
    if st.others_announced >= point:
        return True
    q = st.q
    now_ms = core.now_ms
    expected = mask
    for m in st.peers:
        peer = core.peers[m]
        if (
            peer.joined.get(st.stream)
            and is_live(core, peer, now_ms)
            and all(reaches(core, m, other, now_ms) for other in st.members if other != m)
        ):
            expected |= 1 << m

    def counts_alone(member: int, reports: int) -> bool:
        return (reports & ~(1 << member)).bit_count() >= q

    if all(counts_alone(m, expected) for m in st.peers):
        return True
    return any(
        m < core.id and counts_alone(m, mask) and is_live(core, core.peers[m], now_ms)
        for m in st.peers
    )


# --- delivering ---------------------------------------------------------------------------------


def deliver(core: RelayState, st: StreamState, point: int, digest: bytes) -> None:
    """Commit our prefix up to `point` (its digest is `digest`), hand the new entries to
    consumers, answer the produces it settles, and evict down to the buffer bounds."""
    tl = st.timeline
    plan_announcement(core, st, point, digest)
    newly = tl.deliver_through(point, digest)
    st.votes.settle_through(point)
    st.forget_run_ends(point)  # committed: no need to report there any more
    while st.own_unacked and st.own_unacked[0][0] <= point:
        st.own_unacked.popleft()  # settled: no need to count them any more
    st.progress_ms = core.now_ms
    resume_reports(st)
    st.mismatch_since_ms = NEVER
    if st.repair is not None and st.repair.point <= point:
        st.end_repair()
    fresh = tuple((seq, tx) for seq, tx, first, _ in newly if first == seq)
    if fresh:
        core.outbox.deliveries.append(Delivery(st.stream, fresh))
    core.counters["delivered"] += len(fresh)
    core.counters["dedupe_skipped"] += len(newly) - len(fresh)
    coordinate.answer_committed(core, st, newly)
    coordinate.resolve_excluded(core, st, point)
    memory.evict(core, st)
    if newly and not st.committed_before:
        st.committed_before = True
        core.remember(st)  # once: the stream has a history to lose (5.8, 5.15)
