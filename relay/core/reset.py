"""Dead points and reset (docs/protocol.md section 5.7).

When members' timelines differ at points where no digest can reach a quorum any more (a
*split*), nothing would ever commit again: no member may change a prefix it reported. A
point is *dead* at a relay when, counting the reports it knows, no digest can reach the
quorum even if every member whose vote there is still unknown voted for it. A relay that
sees a dead, contradicted point among its own reports pauses its reports (and promises not
to report where anyone has); once every point it reported above its committed point is
dead, it rebuilds that zone as the union of what the live members hold, so that the
members converge and commit again at later points.
"""

from __future__ import annotations

from collections import deque

from relay.core.commit import resume_reports
from relay.core.links import is_live
from relay.core.messages import RepairReply, RepairStatus, Report
from relay.core.seq import relay_of
from relay.core.state import Purpose, RelayState, ResetState, StreamState, admits_seq

# A rebuild waits at most this many repair_retry_ms for the members it asked, then goes on
# with the answers it has.
RESET_MAX_ROUNDS = 3


def vote_known(st: StreamState, member: int, point: int) -> bool:
    """Whether every vote `member` ever cast at `point` is known to us (or it promised)."""
    if point > st.votes_unknowable_above.get(member, point):
        return False
    return point <= st.known_through.get(member, -1)


def dead(st: StreamState, point: int) -> bool:
    unknown = sum(1 for m in st.peers if not vote_known(st, m, point))
    return st.votes.dead(point, unknown)


def conflicts(st: StreamState, point: int, digest: bytes) -> bool:
    """Another member reported a different digest where we reported `digest`."""
    return any(d != digest and mask for d, mask in st.votes.points.get(point, {}).items())


def reports_above(log: deque[Report], point: int) -> list[Report]:
    """Our reports above `point`, oldest first. The log only grows upwards (a view change
    trims its top), so they are its tail: no need to walk the whole log (up to
    report_log_entries) every time a stream sits without progress."""
    tail: list[Report] = []
    for report in reversed(log):
        if report[0] <= point:
            break
        tail.append(report)
    tail.reverse()
    return tail


def maybe_reset(core: RelayState, st: StreamState, now_ms: int) -> None:
    """If every point we reported above our committed point is dead (no digest can
    reach a quorum there any more), nobody can ever commit them, so our prefix there
    may change without breaking rule 4 of section 6. Rebuild it as the union of what the
    members hold, so the members converge and commit again at later points."""
    tl = st.timeline
    if st.join is not None or st.repair is not None or st.reset is not None:
        return
    log = st.report_log
    if not log or log[-1][0] <= tl.committed_point:
        # Nothing of ours above the committed point (a commit passed our reports, or a
        # view voided them): no split of ours is left to resolve, report again.
        resume_reports(st)
        return
    if st.known_commit[0] > tl.committed_point:
        return  # a commit above us is known: repair decides, not a rebuild
    if now_ms - max(st.progress_ms, st.dead_check_ms) < core.limits.repair_retry_ms:
        return
    st.dead_check_ms = now_ms
    if len(log) == log.maxlen and log[0][0] > tl.committed_point:
        return  # our own early reports fell out of the log: cannot prove them dead
    own = reports_above(log, tl.committed_point)
    # Conflicts at or below a zone we already rebuilt are settled for us: only a
    # conflict among the points we reported since is a new split.
    since = max(tl.committed_point, st.rebuilt_through)
    if not any(p > since and conflicts(st, p, d) and dead(st, p) for p, d in own):
        # Dead points that nobody contradicts are only points others skipped (they
        # resumed above a promise): the next commit settles them. No split in sight.
        resume_reports(st)
        return
    # A split: stop adding points, so the members' votes at all of ours become known,
    # and rebuild the zone once every point we reported in it is dead.
    st.reports_paused = True
    if not all(dead(st, p) for p, _ in own):
        return
    live = [m for m in st.peers if is_live(core, core.peers[m], now_ms)]
    core.counters["reset_started"] += 1
    st.reset = ResetState(lo=tl.committed_point, hi=tl.reported, started_ms=now_ms)
    for m in live:
        send_reset_request(core, st, m, st.reset.lo)
    if not live:
        finish_reset(core, st, now_ms)


def send_reset_request(core: RelayState, st: StreamState, peer: int, lo: int) -> None:
    reset = st.reset
    assert reset is not None
    core.ask(st, Purpose.RESET, peer, lo, reset.hi)


def on_reset_reply(core: RelayState, st: StreamState, msg: RepairReply, now_ms: int) -> None:
    """A member's entries in the zone (its request is closed); rebuild once all answered."""
    reset = st.reset
    assert reset is not None
    if msg.status is RepairStatus.OK:
        for seq, tx in msg.entries:
            reset.entries.setdefault(seq, tx)
        if msg.more:
            send_reset_request(core, st, msg.sender, msg.hi)
    if not st.requests.asked(Purpose.RESET):
        finish_reset(core, st, now_ms)


def tick_reset(core: RelayState, st: StreamState, now_ms: int) -> None:
    """Rebuild with the members that answered once the others took too long."""
    reset = st.reset
    if reset is not None and now_ms - reset.started_ms >= RESET_MAX_ROUNDS * (
        core.limits.repair_retry_ms
    ):
        finish_reset(core, st, now_ms)


def finish_reset(core: RelayState, st: StreamState, now_ms: int) -> None:
    reset = st.reset
    assert reset is not None
    tl = st.timeline
    st.end_reset()
    if tl.committed_point != reset.lo:
        resume_reports(st)
        return  # a commit arrived meanwhile: it decides, not the union
    union = dict(tl.entries_between(reset.lo, reset.hi))
    for seq, tx in list(reset.entries.items()) + list(tl.late.items()):
        # Only what the view admits: a transaction a view change cut stays out (5.12).
        if reset.lo < seq <= reset.hi and admits_seq(st.view, relay_of(seq), seq):
            union.setdefault(seq, tx)
    entries = sorted(union.items())
    tl.replace_range(reset.lo, reset.hi, entries)
    st.rebuilt_through = max(st.rebuilt_through, reset.hi)
    core.counters["reset_done"] += 1
    st.progress_ms = now_ms
    resume_reports(st)
