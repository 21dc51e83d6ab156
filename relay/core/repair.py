"""Advancing to known commits, repair and rebase (docs/protocol.md section 5.5), and serving
every RepairRequest (gap fills, repairs and resets all ask for entries).

`advance` is what follows any event that may make a newer commit known: deliver up to it
if our prefix matches there, else repair. A repair first tries our own entries plus the
late pile; failing that, it asks members (those that reported the committed digest
first) for their entries in (our committed point, p], checks that the chain over them gives
the committed digest, replaces the range and delivers. If every member answers `too_old`,
the relay rebases: it takes a committed point at or above p from a member, like a join.
"""

from __future__ import annotations

from relay.core import digest as dg
from relay.core.commit import deliver
from relay.core.join import send_join_request
from relay.core.links import watermark
from relay.core.messages import Entry, RepairReply, RepairRequest, RepairStatus, Report
from relay.core.seq import relay_of
from relay.core.state import NEVER, JoinState, Purpose, RelayState, RepairState, StreamState, chunks


def advance(core: RelayState, st: StreamState, now_ms: int) -> None:
    """Deliver up to the highest known commit if our prefix matches; else repair."""
    point, digest = st.known_commit
    tl = st.timeline
    join = st.join
    if join is not None:
        # Joining: ask again as soon as a commit we can take a base from is visible.
        if join.first_round_done and point >= join.need_point > join.asked_after_commit:
            join.asked_after_commit = point
            send_join_request(core, st, now_ms)
        return
    if point <= tl.committed_point:
        return
    own = tl.digest_at(point)
    if own == digest:
        deliver(core, st, point, digest)
        return
    if st.repair is not None:
        return
    if st.mismatch_since_ms == NEVER:
        st.mismatch_since_ms = now_ms
    behind = point <= tl.reported or point <= watermark(core, st, now_ms)
    if behind or now_ms - st.mismatch_since_ms >= core.limits.repair_grace_ms:
        start_repair(core, st, now_ms)


def start_repair(core: RelayState, st: StreamState, now_ms: int) -> None:
    point, digest = st.known_commit
    tl = st.timeline
    lo = tl.committed_point
    # First try what we already hold, with the late arrivals we kept aside.
    if tl.late:
        merged = dict(tl.entries_between(lo, point))
        merged.update((s, t) for s, t in tl.late.items() if lo < s <= point)
        entries = sorted(merged.items())
        if dg.chain_over(tl.committed_digest, entries) == digest:
            core.counters["repair_local"] += 1
            adopt_range(core, st, lo, point, digest, entries)
            return
    st.repair = RepairState(point=point, digest=digest, lo=lo, candidates=candidates(core, st))
    core.counters["repair_started"] += 1
    send_repair_request(core, st, lo, now_ms)


def candidates(core: RelayState, st: StreamState) -> list[int]:
    """Members known to hold the committed digest first, then every other member."""
    sources = sorted(m for m in st.commit_sources if m != core.id)
    return sources + [m for m in st.peers if m not in sources]


def retry_repair(core: RelayState, st: StreamState, now_ms: int) -> None:
    rep = st.repair
    assert rep is not None
    if st.known_commit[0] > rep.point:
        st.end_repair()  # a newer commit is known: repair towards it instead
        start_repair(core, st, now_ms)
        return
    rep.attempt += 1
    rep.entries = []
    rep.candidates = candidates(core, st)
    send_repair_request(core, st, rep.lo, now_ms)


def tick_repair(core: RelayState, st: StreamState, now_ms: int) -> None:
    """Ask the next candidate when the current one took repair_retry_ms."""
    rep = st.repair
    if rep is not None and now_ms - rep.sent_ms >= core.limits.repair_retry_ms:
        core.counters["repair_retry"] += 1
        retry_repair(core, st, now_ms)


def send_repair_request(core: RelayState, st: StreamState, lo: int, now_ms: int) -> None:
    rep = st.repair
    assert rep is not None
    rep.sent_ms = now_ms
    usable = [c for c in rep.candidates if c not in rep.too_old] or rep.candidates
    target = usable[rep.attempt % len(usable)]
    st.requests.close(Purpose.REPAIR)  # only the latest answer counts
    core.ask(st, Purpose.REPAIR, target, lo, rep.point)


def on_repair_reply(core: RelayState, st: StreamState, msg: RepairReply, now_ms: int) -> None:
    """A candidate's entries in our gap (its request is closed)."""
    rep = st.repair
    assert rep is not None
    tl = st.timeline
    if rep.lo != tl.committed_point:
        st.end_repair()  # we moved on meanwhile; start again from where we are
        advance(core, st, now_ms)
        return
    if msg.status is RepairStatus.TOO_OLD:
        core.counters["repair_too_old"] += 1
        rep.too_old.add(msg.sender)
        if rep.too_old.issuperset(st.peers):
            st.end_repair()  # nobody holds our gap any more: start from a base
            start_rebase(core, st, rep.point, now_ms)
        else:
            retry_repair(core, st, now_ms)
        return
    rep.entries.extend(msg.entries)
    if msg.more:
        send_repair_request(core, st, msg.hi, now_ms)
        return
    if dg.chain_over(tl.committed_digest, rep.entries) == rep.digest:
        adopt_range(core, st, rep.lo, rep.point, rep.digest, rep.entries)
    else:
        core.counters["repair_mismatch"] += 1
        retry_repair(core, st, now_ms)


def adopt_range(
    core: RelayState, st: StreamState, lo: int, point: int, digest: bytes, entries: list[Entry]
) -> None:
    core.counters["repair_adopted"] += 1
    st.timeline.replace_range(lo, point, entries)
    st.end_repair()
    deliver(core, st, point, digest)


def start_rebase(core: RelayState, st: StreamState, need_point: int, now_ms: int) -> None:
    """Our history is too old to repair: take a base at or above need_point."""
    st.join = JoinState(amnesiac=False, need_point=need_point, first_round_done=True)
    send_join_request(core, st, now_ms)


def on_repair_request(core: RelayState, st: StreamState, msg: RepairRequest) -> None:
    """Send the entries we hold in (lo, hi] (only `origin`'s, if given), in chunks, with
    our own reports there; `too_old` if our buffer starts after lo."""
    tl = st.timeline
    status = RepairStatus.OK
    chunk: list[Entry] = []
    more = False
    hi = max(msg.hi, msg.lo)
    if not tl.has_base:
        # Without a base we hold nothing: we coordinated nothing (a gap fill gets an
        # empty range) and cannot serve a repair (too old).
        if msg.origin < 0:
            status = RepairStatus.TOO_OLD
    elif msg.lo < tl.base_point:
        status = RepairStatus.TOO_OLD
    else:
        entries = tl.entries_between(msg.lo, msg.hi)
        if msg.origin >= 0:
            entries = [(s, t) for s, t in entries if relay_of(s) == msg.origin]
        parts = chunks(entries, core.limits)
        chunk = next(parts, [])
        more = next(parts, None) is not None
        if more:
            hi = chunk[-1][0]
    reports: tuple[Report, ...] = ()
    if status is RepairStatus.OK:
        reports = tuple(r for r in st.report_log if msg.lo < r[0] <= hi)
    core.send(
        RepairReply(
            sender=core.id,
            incarnation=core.incarnation,
            floor=core.clock.floor,
            target=msg.sender,
            stream=st.stream,
            request_id=msg.request_id,
            status=status,
            lo=msg.lo,
            hi=hi,
            more=more,
            entries=tuple(chunk),
            reports=reports,
            config=st.config_version,
        )
    )
