"""Joining, restarts, inheritance and seeds (docs/protocol.md section 5.8).

A relay starts with no history. For each stream it asks every other member where the
stream stands (`JoinRequest`) until all have answered. From the first complete round it
learns the highest point anyone saw reported (it promises never to report at or below
it), the reports its earlier incarnations made that members saw (it publishes them as its
votes), and which members hold state; then it takes a base: a member's committed point at
or above that promise, with its digest and dedupe window. When fewer than a quorum hold
any state, it takes the best state the holders (or, failing them, the durable seeds) have.
A relay whose history is too old to repair rebases the same way (relay/core/repair.py).

The functions that may take a base return whether they did: the caller then advances the
stream (relay/core/repair.py), as after any new commit.
"""

from __future__ import annotations

from relay.core import digest as dg
from relay.core import links, membership, view
from relay.core.commit import count_votes
from relay.core.coordinate import resolve_excluded
from relay.core.messages import DedupeKey, JoinReply, JoinRequest, Report
from relay.core.state import (
    GENESIS_POINT,
    NEVER,
    Acceptor,
    JoinState,
    RelayState,
    StreamState,
)
from relay.core.timeline import NO_DIGEST, DedupeWindow
from relay.core.view import forgot_acceptor

# A member we do not hear, which has not counted our inherited reports, gets them at least
# this often (it may hear us).
INHERITED_RESEND_MS = 1_000


def seed(core: RelayState, stream: str, point: int, digest: bytes) -> bool:
    """Durable history's last committed point of `stream`, before it joins (see
    RelayCore.seed). False if the stream is not served here or has begun joining."""
    if point <= GENESIS_POINT or len(digest) != dg.DIGEST_BYTES:
        raise ValueError(f"not a committed point: ({point}, {digest!r})")
    if not core.serves(stream) or not core.can_open(stream):
        return False
    st = core.stream(stream)
    join = st.join
    if join is None or not join.amnesiac or join.first_round_done:
        return False
    st.written = True  # it has durable history: it is in use (5.12)
    if st.seed is None or point > st.seed[0]:
        st.seed = (point, digest)
    core.clock.raise_floor(point)  # our own sequence numbers come after it
    return True


def send_join_request(core: RelayState, st: StreamState, now_ms: int) -> None:
    join = st.join
    assert join is not None
    join.sent_ms = now_ms
    st.link_seq_out += 1
    config, members = st.configuration
    core.send(
        JoinRequest(
            sender=core.id,
            incarnation=core.incarnation,
            floor=core.clock.floor,
            stream=st.stream,
            link_seq=st.link_seq_out,
            need_point=join.need_point,
            config=config,
            members=members,
        ),
        stream=st.stream,
    )


def on_join_request(core: RelayState, st: StreamState, msg: JoinRequest) -> None:
    """Tell a joining member where the stream stands here. A relay under another
    configuration (a member or not, 5.15) is told ours and nothing else: it learns an
    established one, or sees the disagreement; its word teaches us an established one in
    place of our provisional one."""
    heard = membership.hear(core, st, msg.sender, msg.config, msg.members)
    if heard is membership.Heard.LEFT or heard is membership.Heard.AHEAD:
        return  # (it asked the others, not us; or we are behind: it is pushed our view)
    if heard is membership.Heard.BEHIND:
        # It missed a change of the stream's relays (5.15 changes): the view carries it,
        # and it asks again under it. (An answer now would reach it under the new one,
        # and be taken for a member's that holds nothing.)
        view.push_view(core, st, msg.sender, core.now_ms, force=True)
        return
    if heard is membership.Heard.DISAGREES or msg.sender not in st.members:
        # An answer that vouches for nothing (it will not count it under its own): fresh,
        # no committed point; our view, so that a relay that learns the configuration
        # follows the stream from it.
        _reply(core, st, msg.sender, fresh=True, point=-1, digest=NO_DIGEST, seen=-1)
        return
    tl = st.timeline
    joined = st.join is None or not st.join.amnesiac
    keys = None
    if joined and tl.has_base and tl.committed_point >= msg.need_point:
        keys = tl.dedupe.keys()
    point, digest = tl.committed_point, tl.committed_digest
    if not joined and st.seed is not None:
        point, digest = st.seed  # a fresh member's committed point is its seed
    seen = max(st.votes.max_seen, tl.reported)
    votes = votes_of(st, msg.sender)
    _reply(core, st, msg.sender, not joined, point, digest, seen, keys, votes)


def _reply(
    core: RelayState,
    st: StreamState,
    target: int,
    fresh: bool,
    point: int,
    digest: bytes,
    seen: int,
    dedupe: tuple[DedupeKey, ...] | None = None,
    votes: tuple[Report, ...] = (),
) -> None:
    """A JoinReply to `target`, with our view and configuration."""
    config, members = st.configuration
    core.send(
        JoinReply(
            sender=core.id,
            incarnation=core.incarnation,
            floor=core.clock.floor,
            target=target,
            stream=st.stream,
            fresh=fresh,
            committed_point=point,
            committed_digest=digest,
            max_seen_reported=seen,
            dedupe=dedupe,
            your_votes=votes,
            view=st.view if st.view.number > 0 else None,
            config=config,
            members=members,
        )
    )


def votes_of(st: StreamState, member: int) -> tuple[Report, ...]:
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


def on_join_reply(core: RelayState, st: StreamState, msg: JoinReply, now_ms: int) -> bool:
    """A member's answer; True if the stream took a base. An answer under another
    configuration (5.15) is not counted; an established one teaches us (we join again
    under it, or leave the stream if it leaves us out)."""
    join = st.join
    if join is None:
        return False
    heard = membership.hear(core, st, msg.sender, msg.config, msg.members)
    if heard is membership.Heard.LEFT or heard is membership.Heard.DISAGREES:
        return False
    members_view = msg.view  # the members' view, to follow from the base
    if (
        members_view is not None
        and members_view.number > st.view.number
        and not view.adopt(core, st, members_view, now_ms, msg.sender)
    ):
        return False  # (a view of another configuration)
    if heard is not membership.Heard.AGREES or msg.sender not in st.members:
        # It answered a request under a configuration it did not share (an answer that
        # vouches for nothing): we ask again under the one we learnt, at once.
        if st.join is not None and heard is not membership.Heard.AGREES:
            st.join.sent_ms = NEVER
        return False
    join = st.join
    assert join is not None
    join.replies[msg.sender] = msg
    return on_join_round(core, st, now_ms)


def on_join_round(core: RelayState, st: StreamState, now_ms: int) -> bool:
    """Decide once every member answered; True if the stream took a base."""
    join = st.join
    assert join is not None
    if join.first_round_done:
        return try_join_base(core, st, join, now_ms)
    if not all(p in join.replies for p in st.peers):
        return False
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
    # incarnations' votes as known up to it (see on_inherited).
    st.votes_final_through = max(highest, 0)
    holders = [r for r in join.replies.values() if not r.fresh]
    if len(holders) < st.q:
        # Fewer than a quorum of members hold any state, so nothing can commit
        # without the joiners: take the best state the holders have (the empty
        # genesis if none), and still never vote where anyone already reported.
        join_without_quorum(core, st, holders, highest, now_ms)
        return True
    join.need_point = max(highest, 0)
    if try_join_base(core, st, join, now_ms):
        return True
    send_join_request(core, st, now_ms)  # ask again, now for a base
    return False


def join_without_quorum(
    core: RelayState, st: StreamState, holders: list[JoinReply], highest: int, now_ms: int
) -> None:
    core.counters["joined_without_quorum"] += 1
    capacity = core.limits.dedupe_window_entries
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
        core.counters["joined_from_seed"] += 1
        point, digest = max(seeds)
        window = DedupeWindow(capacity)  # the store keeps no dedupe window
    elif point == GENESIS_POINT and st.committed_before:
        # Records committed under this configuration (our acceptor record says so), yet
        # no member holds anything and no durable history does: what committed is gone.
        # Say so, and refuse reads that would skip it (RelayCore.read).
        core.counters["history_lost"] += 1
        st.history_lost_below = core.clock.floor
    adopt_base(core, st, point, digest, window, max(highest, point), now_ms)


def try_join_base(core: RelayState, st: StreamState, join: JoinState, now_ms: int) -> bool:
    for reply in join.replies.values():
        if (
            not reply.fresh
            and reply.dedupe is not None
            and reply.committed_point >= join.need_point
        ):
            window = DedupeWindow(core.limits.dedupe_window_entries, reply.dedupe)
            if join.amnesiac and forgot_acceptor(core, st.stream):
                # We may have promised or accepted in the next view change before we lost
                # our memory: take no part in it as an acceptor (5.12).
                st.abstain_through = st.view.number + 1
            adopt_base(
                core,
                st,
                reply.committed_point,
                reply.committed_digest,
                window,
                join.need_point,
                now_ms,
            )
            return True
    return False


def adopt_base(
    core: RelayState,
    st: StreamState,
    point: int,
    digest: bytes,
    window: DedupeWindow,
    never_report_through: int,
    now_ms: int,
) -> None:
    core.counters["base_adopted"] += 1
    tl = st.timeline
    tl.adopt_base(point, digest, window)
    if point > GENESIS_POINT and not st.committed_before:
        st.committed_before = True  # (a history below the base: 5.8)
        core.remember(st)
    core.outbox.rebases.append((st.stream, point))
    # Never report where members may have seen our earlier incarnations report
    # (collect_reports also keeps below the promise made while joining).
    st.votes_final_through = max(st.votes_final_through, never_report_through)
    st.votes.settle_through(point)
    # The members we took it from know it committed (or, joining without a quorum, take
    # the same one): nothing to announce (5.4).
    st.announced_commit = max(st.announced_commit, point)
    st.join = None
    if st.acceptor.number > st.view.number + 1:
        # Remembered from a history the members no longer hold (the whole mesh restarted
        # and began again): it cannot count in theirs, and would refuse their changes.
        st.acceptor = Acceptor(number=st.view.number + 1)
    st.end_repair()
    st.mismatch_since_ms = NEVER
    if point > st.known_commit[0]:
        st.known_commit = (point, digest)
    resolve_excluded(core, st, point, prefix_seen=False)
    # What the admitted members coordinated after the base may have passed before our
    # links began: fetch it, so that we hold all of it below every point we report.
    for interval in st.view.intervals:
        if interval.cut < 0 and interval.member != core.id:
            links.refill(core, st, interval.member, point, now_ms)


def promise(st: StreamState) -> tuple[Report, ...]:
    """Our promise for the heartbeat: raise votes_final_through while joining or holding
    reports back (5.7), and return the inherited reports still worth telling (those above
    our committed point)."""
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


def on_inherited(
    core: RelayState,
    st: StreamState,
    member: int,
    inherited: tuple[Report, ...],
    through: int,
    *,
    omitted: bool = False,
) -> None:
    """A restarted member tells which of its earlier reports anyone saw: with them, all
    its votes up to `through` are known again. `omitted`: it left them out, as we have
    them; if we do not, its promise alone says nothing."""
    if through < 0 or (omitted and member not in st.inherited_counted):
        return
    count_votes(st, member, inherited)
    state = core.peers[member].links.get(st.stream)
    if state is not None and state.hole_lo >= 0:
        return  # its reports that we missed are not known yet
    if through > st.known_through.get(member, -1):
        st.known_through[member] = through
    st.votes_unknowable_above.pop(member, None)
    st.inherited_counted[member] = max(st.inherited_counted.get(member, -1), through)


def inherited_to_send(core: RelayState, st: StreamState, now_ms: int) -> bool:
    """Whether this heartbeat carries our inherited reports: every repair_retry_ms while
    a live member has not counted them, every INHERITED_RESEND_MS while any member has not
    (one we do not hear may hear us); else only our promise goes (`inherited_omitted`). A
    member's count lasts as long as its incarnation. Without this every heartbeat carried
    them all, and a long list (a stall before our restart) swamped every member (5.8)."""
    waiting = [core.peers[m] for m in st.peers]
    waiting = [p for p in waiting if p.inherited_acked.get(st.stream, -1) < 0]
    if not waiting:
        return False
    since = now_ms - st.inherited_sent_ms
    if any(links.is_live(core, p, now_ms) for p in waiting):
        return since >= core.limits.repair_retry_ms
    return since >= INHERITED_RESEND_MS
