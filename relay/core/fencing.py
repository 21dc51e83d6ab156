"""Fencing and redirects (docs/protocol.md section 5.9).

A relay that has heard fewer than a quorum of a stream's members (itself included) within
their timeouts fences the stream: produces and reads are answered `fenced` with members to
try, at once, instead of hanging; it unfences as soon as enough are heard again. It may
coordinate a produce only when, besides, the view admits it (5.12) and its clock agrees
with the majority's (5.2); otherwise produces are answered `fenced`, naming why. What a
fence means for the produces being coordinated is the coordinator's rule
(coordinate.abandon_pending).
"""

from __future__ import annotations

from relay.core import membership, spooling
from relay.core.links import clock_outlier, is_live
from relay.core.messages import ViewPhase
from relay.core.state import PROVISIONAL, RelayState, StreamState, open_interval

# Why a relay does not coordinate a stream's produces (`reason`).
QUORUM = "quorum"  # fewer than a quorum of members heard
JOINING = "joining"  # no history of the stream yet
NOT_ADMITTED = "not_admitted"  # the view does not admit this relay (yet, or any more)
CLOCK = "clock"  # this relay's clock is too far from the majority's
# relays state another configuration of the stream that holds it (5.15): provisional
# ones that differ while it is established, or another established one
CONFIG_MISMATCH = "config_mismatch"
# Why a stream that is not fenced still cannot commit through this relay (`stall`).
VIEW_CHANGE = "view_change"  # a view change we promised holds our reports (5.12)
SPLIT = "split"  # reports held back while a split is rebuilt (5.7)
SPOOL_FULL = "spool_full"  # our spool has no room for what we hold: we do not vote (5.14)
STORE_BACKLOG_FULL = "store_backlog_full"  # fewer than a quorum of members can spool (5.14)


def heard(core: RelayState, st: StreamState, now_ms: int) -> int:
    """The members heard within their timeouts, this relay included."""
    return 1 + sum(1 for m in st.peers if is_live(core, core.peers[m], now_ms))


def reason(core: RelayState, st: StreamState, now_ms: int) -> str:
    """Why this relay may not coordinate the stream's produces now; "" when it may."""
    if membership.blocking(st):
        return CONFIG_MISMATCH
    if st.fenced:
        return QUORUM
    if st.join is not None:
        return JOINING
    mine = open_interval(st.view, core.id)
    if mine is None or mine.incarnation != core.incarnation:
        return NOT_ADMITTED
    if clock_outlier(core, now_ms):
        return CLOCK
    return ""


def update_fence(core: RelayState, st: StreamState, now_ms: int) -> bool:
    """Fence or unfence the stream by who was heard; True if it fenced just now."""
    fenced = heard(core, st, now_ms) < st.q
    if fenced == st.fenced:
        return False
    core.counters["fenced" if fenced else "unfenced"] += 1
    st.fenced = fenced
    return fenced


def redirect_for(core: RelayState, st: StreamState) -> tuple[int, ...]:
    """Members to try instead of this relay: the live ones that joined, else all."""
    live = [
        m
        for m in st.peers
        if is_live(core, core.peers[m], core.now_ms) and core.peers[m].joined.get(st.stream)
    ]
    return tuple(live) if live else st.peers


def stall(core: RelayState, st: StreamState, now_ms: int) -> tuple[str, tuple[int, ...]]:
    """Why the stream cannot commit through this relay now ("" if nothing holds it), and
    the relays it waits for (5.9): for `config_mismatch` the relays that state another
    configuration (5.15); for `quorum` the members not heard; for `joining` the members
    whose answer is missing or cannot serve as a base; for `not_admitted` the admitted
    members, which must agree to a view change (before the stream's first view, the
    members not heard or not joined: that view needs every one, 5.15); for `clock` this
    relay; for `view_change` the members whose answer our proposal lacks (a member still
    joining after a restart does not promise), or the proposer we promised; for
    `store_backlog_full` the members whose spools are full, when a quorum lacks room; for
    `spool_full` this relay (it does not vote, but the others may commit without it)."""
    why = reason(core, st, now_ms)
    if why == CONFIG_MISMATCH:
        return why, membership.blocking(st)
    if why == QUORUM:
        return why, tuple(m for m in st.peers if not is_live(core, core.peers[m], now_ms))
    if why == JOINING:
        join = st.join
        assert join is not None
        missing = [m for m in st.peers if m not in join.replies]
        if join.first_round_done:
            missing += [
                m for m, r in join.replies.items() if r.fresh or r.committed_point < join.need_point
            ]
        return why, tuple(sorted(missing))
    if why == NOT_ADMITTED:
        if st.config_version == PROVISIONAL:
            # The first view establishes the configuration: every member decides it (5.15)
            return why, tuple(
                m
                for m in st.peers
                if not is_live(core, core.peers[m], now_ms)
                or not core.peers[m].joined.get(st.stream)
            )
        return why, tuple(i.member for i in st.view.intervals if i.cut < 0)
    if why == CLOCK:
        return why, (core.id,)
    prop = st.proposal
    if prop is not None:  # ours: the members whose answer it still needs
        done = prop.promises if prop.phase is ViewPhase.PREPARE else prop.accepted_by
        return VIEW_CHANGE, tuple(m for m in st.peers if m not in done)
    acc = st.acceptor
    if acc.promised >= 0:
        return VIEW_CHANGE, (acc.promised_to[0],) if acc.promised_to[0] >= 0 else ()
    if st.reports_paused or st.reset is not None:
        return SPLIT, ()
    short = spooling.short_of_room(core, st)
    if short:
        return STORE_BACKLOG_FULL, short
    if not spooling.may_report(core, st):
        return SPOOL_FULL, (core.id,)
    return "", ()


def track_stall(core: RelayState, st: StreamState, now_ms: int) -> None:
    """Note when the stream's stall reason last changed (for status and logs)."""
    why = stall(core, st, now_ms)[0]
    if why != st.stall_reason:
        st.stall_reason = why
        st.stall_since_ms = now_ms
