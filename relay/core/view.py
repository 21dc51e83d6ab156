"""Views: which members' transactions and floors count, changed only by agreement
(docs/protocol.md section 5.12).

A stream's view lists, per member, the intervals of its transactions that count: an open
interval (its floor holds the watermark, its new transactions count) or a cut one (its
transactions up to the cut count, later ones never). A relay never leaves a member out of
its watermark on its own: a member that cannot be heard is excluded by a view change, which
a quorum of members agrees on. So all members that adopted a view hold the same
transactions below every point they report, and two of them never report different
digests at a point: no split can form among a majority, whatever the other members do.

A view change is one instance of single-decree Paxos per view number:

1. The proposer sends PREPARE(ballot, the members it means to cut) to every member.
2. An acceptor that has not promised a higher ballot promises: it adds no report from now
   until it adopts that view (it is *frozen*), and answers with its last reported point,
   its committed point, what it accepted earlier in this instance, and the transactions it
   holds of the members to be cut.
3. With promises from a quorum, the proposer takes the value accepted with the highest
   ballot, if any; else it makes the value: the start s = the highest point any promiser
   reported; the cut members' intervals end at s, and the value carries every transaction
   of theirs the promisers hold up to s (the promiser that reported s held all of them,
   since their floors held its watermark); admitted members' intervals begin at s.
4. It sends ACCEPT(ballot, value); with acceptances from a quorum the value is decided, and
   the proposer sends it to every member, which adopts it: it drops the transactions the
   view no longer counts (none of them reported: they lie above s), adds those the value
   carries, and reports again.

Proposers are staggered by rank (the lowest live admitted member first; a member not
admitted only after the others had their turn), a frozen acceptor that sees no decision
takes over, and members that fall behind are sent the current view. The waits for answers
stretch with the members' lag (a loaded mesh answers later). A stream gets a view only once
it is in use: one opened only by reads needs none.
"""

from __future__ import annotations

from collections import deque

import msgspec

from relay.core import coordinate, links, membership
from relay.core.fencing import heard
from relay.core.links import clock_outlier, is_live, lag_ms
from relay.core.messages import (
    Entry,
    Interval,
    Outcome,
    RejectReason,
    Report,
    ViewDecided,
    ViewPhase,
    ViewReply,
    ViewRequest,
    ViewValue,
)
from relay.core.seq import relay_of
from relay.core.state import (
    FIRST_INCARNATION,
    NEVER,
    PROVISIONAL,
    Acceptor,
    Admission,
    Proposal,
    RelayState,
    StreamState,
    admits_seq,
    open_interval,
    retry_due,
)
from relay.core.transit import reaches

VIEW_STAGGER_MS = 20  # per rank: how long a member lets lower-ranked ones propose first
VIEW_ROUND_MS = 400  # a proposal without a decision this long starts again, higher ballot
VIEW_TAKEOVER_MS = 600  # a frozen acceptor without a decision this long proposes itself
# A member not admitted lets the live members ranked before it propose for this long (they
# want what it wants)
VIEW_DEFER_MS = 600
# The three waits above that expect answers (a round, a takeover, a deferral) grow by this
# many times the members' lag (links.lag_ms): a round is two exchanges, and on a loaded
# mesh (thousands of streams opened at once) answers take longer than on an idle one;
# timers that end every round before its answers come make rounds duel for ever.
VIEW_LAG_FACTOR = 2
# A change of the stream's relays that waited (too few of the new relays held the history,
# 5.15 changes) is proposed again no sooner than this: each try freezes the members for
# a round, and what it waits for (a join, a repair) takes about as long.
CHANGE_RETRY_MS = VIEW_ROUND_MS
# How long a change's proposer waits for promises from relays that hold the history, past
# the first quorum of promises: the members that promised stay frozen meanwhile.
CHANGE_PROMISE_WAIT_MS = VIEW_ROUND_MS // 4
BALLOT_ROUND_SHIFT = 10  # ballot = round << shift | proposer id: unique per proposer
# A proposer whose first view had to carry one of other relays that leave it out waits
# this long before proposing again: past the takeover of those relays, which its
# promises froze (VIEW_ROUND_MS from the last promise, `_carries_elsewhere`, or
# VIEW_TAKEOVER_MS for one that accepted nothing), with room for their rank stagger.
# Its own promise of that round holds it for VIEW_TAKEOVER_MS as well, 200 ms past their
# VIEW_ROUND_MS: too little once the stagger between them exceeds it (streams of more
# than 10 relays), and this bound covers streams of up to 40.
FIRST_ELSEWHERE_WAIT_MS = 2 * VIEW_TAKEOVER_MS


# --- what the view says -----------------------------------------------------------------------


def admitted(core: RelayState, st: StreamState) -> bool:
    """This relay may coordinate: the view admits its current incarnation."""
    interval = open_interval(st.view, core.id)
    return interval is not None and interval.incarnation == core.incarnation


def in_use(core: RelayState, st: StreamState) -> bool:
    """Whether the stream needs a view: it was opened at start (named or declared), a
    produce reached us for it, a view admits anyone already, or a member asks to be
    admitted. A stream opened only by reads or by a member's join gets none until then:
    its members join, serve reads (nothing is committed) and go dormant, so thousands of
    streams opened by reads cost no view change (5.12)."""
    return (
        st.written
        or st.view.number > 0
        or any(m in core.peers and st.stream in core.peers[m].want_in for m in st.peers)
    )


def wants_in(core: RelayState, st: StreamState, now_ms: int, outlier: bool | None = None) -> bool:
    """Joined, with a clock that agrees with the majority's, not admitted and the stream in
    use: this relay asks to be admitted (in its heartbeats, and by proposing it).
    `outlier`: whether our clock is an outlier, if the caller knows already."""
    if st.join is not None or admitted(core, st) or not in_use(core, st):
        return False
    return not (clock_outlier(core, now_ms) if outlier is None else outlier)


# --- the acceptor -----------------------------------------------------------------------------


def forgot_acceptor(core: RelayState, stream: str) -> bool:
    """Whether this start may have lost what an earlier incarnation promised or accepted
    in the stream's view changes: not on a first start (section 3: nothing to forget),
    nor when the shell kept the acceptor memory and it could be read."""
    if core.incarnation <= FIRST_INCARNATION:
        return False
    return core.acceptor_memory is None or stream in core.acceptor_forgotten


def on_request(core: RelayState, st: StreamState, msg: ViewRequest, now_ms: int) -> None:
    if st.view.number == 0 and msg.view == 1 and not forgot_acceptor(core, st.stream):
        membership.follow(core, st, msg.config, msg.members, msg.ballot, msg.phase)
    heard = membership.hear(core, st, msg.sender, msg.config, msg.members)
    if heard is membership.Heard.LEFT:
        return
    if heard is not membership.Heard.AGREES and heard is not membership.Heard.LEARNT:
        # Proposed under another configuration (5.15): its quorum is not ours to join.
        core.counters["view_refused_config"] += 1
        return
    if msg.view <= st.view.number:
        push_view(core, st, msg.sender, now_ms, force=True)  # decided already
        return
    core.send(
        answer(
            core,
            st,
            msg.sender,
            msg.phase,
            msg.view,
            msg.ballot,
            msg.excluding,
            msg.value,
            now_ms,
            msg.moving_to,
        )
    )


def answer(
    core: RelayState,
    st: StreamState,
    target: int,
    phase: ViewPhase,
    number: int,
    ballot: int,
    excluding: tuple[int, ...],
    value: ViewValue | None,
    now_ms: int,
    moving_to: tuple[int, ...] = (),
) -> ViewReply:
    """This relay's answer, as an acceptor, to `target`'s PREPARE or ACCEPT for view
    `number` (the proposer's own acceptor answers it directly). `moving_to`: the relays a
    change of the stream's relays moves to (5.15 changes)."""
    acc = st.acceptor
    promise = phase is ViewPhase.PREPARE
    out_phase = ViewPhase.PROMISE if promise else ViewPhase.ACCEPTED
    ok = (
        number == acc.number
        and number > st.abstain_through
        # A proposer that does not hear us would never get our answer: promising it
        # would only freeze us (it is also refused by everyone else, and gives up).
        and reaches(core, target, core.id, now_ms)
        # A promise tells what we reported and committed; still joining after a restart
        # we do not know what our earlier incarnation reported (and a quorum may have
        # committed with it), so the value must not be made from our word. Under a
        # provisional configuration there is no such word (nothing is reported before
        # the first view, 5.15), and a joining relay must be able to promise then: a
        # first view can only be decided with every one of its relays.
        and (st.join is None or not promise or st.config_version == PROVISIONAL)
        # A member the view admits does not promise its own cut: whoever proposes it hears
        # us (else we would not get its PREPARE), so it judged on stale word of whom we
        # hear. The cut never needs our promise: the members staying are a quorum. (A change
        # that removes us is no such judgement, and may need our promise: the relays
        # staying need not be a quorum of the old ones.)
        and not (
            promise
            and core.id in excluding
            and admitted(core, st)
            and not (moving_to and core.id not in moving_to)
        )
        # 5.15: a relay that may have forgotten accepting a first view of other relays
        # (restarted without acceptor memory) takes no part in establishing a stream
        and not (st.config_version == PROVISIONAL and forgot_acceptor(core, st.stream))
        and (ballot > acc.promised if promise else ballot >= acc.promised)
        # 5.15: a value of other relays (or a version behind ours) is not ours to accept
        and (promise or (value is not None and _of_our_configuration(st, value)))
    )
    if not ok:
        core.counters["view_refused"] += 1
        return _reply(core, st, target, out_phase, number, ballot, ok=False)
    if acc.frozen_ms == NEVER:
        acc.frozen_ms = now_ms
    acc.active_ms = now_ms
    acc.promised = ballot
    acc.promised_to = (
        target,
        core.incarnation if target == core.id else core.peers[target].incarnation,
    )
    if not promise:
        acc.accepted_ballot = ballot
        acc.accepted = value
    core.remember(st)  # durably, before the answer leaves (Ready.acceptors)
    if promise:
        tl = st.timeline
        held: list[Entry] = [
            (seq, tx)
            for seq, tx in tl.entries_between(tl.committed_point, tl.last_seq())
            if relay_of(seq) in excluding
        ]
        return _reply(
            core,
            st,
            target,
            out_phase,
            number,
            ballot,
            ok=True,
            reported=tl.reported,
            committed=tl.committed_point,
            entries=tuple(held),
            holds=holds(core, st, now_ms),
        )
    return _reply(core, st, target, out_phase, number, ballot, ok=True)


def _of_our_configuration(st: StreamState, value: ViewValue) -> bool:
    """A value of our relays (an establishment or an ordinary view), or a change from our
    established configuration to the next version (5.15 changes)."""
    if value.members == st.members and value.config >= st.config_version:
        return True
    return moves(st, value) and value.config == st.config_version + 1


def moves(st: StreamState, value: ViewValue) -> bool:
    """Whether `value` changes the stream's established configuration (5.15 changes)."""
    return PROVISIONAL < st.config_version < value.config


def holds(core: RelayState, st: StreamState, now_ms: int) -> int:
    """The point through which we hold every transaction the view counts (a promise says
    it, 5.15 changes): our watermark, once joined and committed at or above the view's
    lo (what is below it is committed); -1 otherwise. The value of a change made from
    this promise cuts only members the view admits now, so we hold what it counts
    through the same point."""
    if st.join is not None or st.timeline.committed_point < st.view.lo:
        return -1
    return links.watermark(core, st, now_ms)


def _reply(
    core: RelayState,
    st: StreamState,
    target: int,
    phase: ViewPhase,
    number: int,
    ballot: int,
    *,
    ok: bool,
    reported: int = -1,
    committed: int = -1,
    entries: tuple[Entry, ...] = (),
    holds: int = -1,
) -> ViewReply:
    acc = st.acceptor
    config, members = st.configuration
    return ViewReply(
        sender=core.id,
        incarnation=core.incarnation,
        floor=core.clock.floor,
        target=target,
        stream=st.stream,
        phase=phase,
        view=number,
        ballot=ballot,
        ok=ok,
        promised=acc.promised if acc.number == number else -1,
        reported=reported,
        committed=committed,
        accepted_ballot=acc.accepted_ballot if acc.number == number else -1,
        accepted=acc.accepted if acc.number == number else None,
        entries=entries,
        config=config,
        members=members,
        holds=holds,
    )


# --- the proposer -----------------------------------------------------------------------------


def wanted(core: RelayState, st: StreamState, now_ms: int) -> tuple[list[int], list[Admission]]:
    """The changes this relay wants: members to cut (silent, or restarted: the view still
    admits an older incarnation) and members to admit (asking at our view, heard; itself,
    joined), each with the floor it asked at."""
    excluding: list[int] = []
    asking: list[Admission] = []
    # Only a member the view admits cuts others for silence: one left out (say, for a
    # cut link) would otherwise cut the member it cannot hear to take its place, and the
    # two would swap places for as long as the link is down.
    judges = admitted(core, st)
    for m in st.members:
        interval = open_interval(st.view, m)
        if m == core.id:
            if interval is not None and interval.incarnation != core.incarnation:
                excluding.append(m)  # our own earlier incarnation
            if wants_in(core, st, now_ms):
                asking.append((m, core.incarnation, core.clock.floor))
            continue
        peer = core.peers[m]
        if interval is not None:
            restarted = peer.incarnation > interval.incarnation
            if restarted or (judges and _cut_off(core, st, m, now_ms)):
                excluding.append(m)
            if not restarted:
                continue
        asked = peer.want_in.get(st.stream)
        # Only an ask made at our view counts: one made before an earlier admission may
        # carry a floor below what the member coordinated since.
        if asked is not None and asked[0] == st.view.number and is_live(core, peer, now_ms):
            asking.append((m, peer.incarnation, asked[1]))
    staying = [i.member for i in st.view.intervals if i.cut < 0 and i.member not in excluding]
    including = [a for a in asking if all(_mutual(core, a[0], o, now_ms) for o in staying)]
    return excluding, including


def _mutual(core: RelayState, a: int, b: int, now_ms: int) -> bool:
    """Whether `a` and `b` hear each other, directly or through another relay (5.13; as
    far as this relay knows). A member is admitted only if it and every member staying in do:
    one that cannot hear another (cut links, one way or both, with no member in between)
    would suspect it and cut it again at once, and every such round rejects what was in
    flight. It waits, fenced, until a path works (clients are redirected to the members
    that serve)."""
    return reaches(core, a, b, now_ms) and reaches(core, b, a, now_ms)


def _cut_off(core: RelayState, st: StreamState, m: int, now_ms: int) -> bool:
    """Member `m` and this relay do not hear each other, by what we heard ourselves and
    what `m` said in a heartbeat sent after we adopted the view. (An older heartbeat may
    predate a heal that the view change admitting us followed: judged on it, a relay just
    admitted would cut the members that admitted it.)"""
    if not reaches(core, core.id, m, now_ms):
        return True
    peer = core.peers[m]
    return peer.heartbeat_ms > st.view_adopted_ms and not reaches(core, m, core.id, now_ms)


def rank(core: RelayState, st: StreamState, now_ms: int) -> int:
    """This relay's place in the order in which members propose (lower first): the live
    members the view admits, by id, then the other live members that have joined, by id.
    Every member has its own place, also when the view admits nobody (a new stream's
    first view, which every member asks for as soon as it has joined). A member that does
    not hear us, or that we do not hear (5.13), is not ahead of us: it cannot gather our
    answer to its proposal, nor we its decision, so waiting for it would only delay the
    change (a first view then waited VIEW_DEFER_MS for a member that could not lead it)."""
    mine = admitted(core, st)
    ahead = 0
    for m in st.peers:
        peer = core.peers[m]
        if not peer.joined.get(st.stream) or not is_live(core, peer, now_ms):
            continue
        if not _mutual(core, core.id, m, now_ms):
            continue
        held = open_interval(st.view, m)
        theirs = held is not None and held.incarnation == peer.incarnation
        if (theirs and not mine) or (theirs == mine and m < core.id):
            ahead += 1
    return ahead


def defer_ms(core: RelayState, st: StreamState, rank_: int, now_ms: int) -> int:
    """How long after wanting a change this relay lets the members ranked before it
    propose. Admitted members wait VIEW_STAGGER_MS per rank: one of them sees a fault
    first, and the next takes over soon if the first does not see it. A member the view
    does not admit waits VIEW_DEFER_MS besides: what it wants (its own admission, or the
    first view) the members before it want too, and proposing at once as well would start
    a duel, on every stream at once when thousands open together (5.12)."""
    wait_ms = rank_ * VIEW_STAGGER_MS
    if rank_ > 0 and not admitted(core, st):
        wait_ms += VIEW_DEFER_MS + VIEW_LAG_FACTOR * lag_ms(core, st.peers, now_ms)
    return wait_ms


def tick(core: RelayState, st: StreamState, now_ms: int) -> None:
    """Start, retry or take over a view change when one is due."""
    prop = st.proposal
    if prop is not None and prop.number != st.view.number + 1:
        st.proposal = prop = None
    if st.join is not None or heard(core, st, now_ms) < st.q:
        # Cut off: a proposal could not complete, and its requests would only freeze the
        # members that hear it. One under way is given up.
        st.proposal = None
        st.view_wanted_ms = NEVER
        return
    lag = VIEW_LAG_FACTOR * lag_ms(core, st.peers, now_ms)
    if prop is not None and now_ms - prop.started_ms >= VIEW_ROUND_MS + lag:
        # Given up: what to change is judged again below, on what we hear now (a new
        # ballot still carries any value accepted in this instance).
        core.counters["view_round_timeout"] += 1
        st.proposal = prop = None
    if prop is not None:
        if retry_due(now_ms, prop.sent_ms, prop.resends, core.limits.repair_retry_ms + lag):
            prop.resends += 1
            _send_requests(core, st, prop, now_ms)
        if prop.moving_to and prop.phase is ViewPhase.PREPARE:
            _advance(core, st, prop, now_ms)  # (its wait for holders may be over)
        return
    excluding, including = wanted(core, st, now_ms)
    moving_to: tuple[int, ...] = ()
    if (
        not excluding
        and not including
        and admitted(core, st)
        and now_ms - st.change_deferred_ms >= CHANGE_RETRY_MS
    ):
        # Once the view is settled, a change of the stream's relays (5.15 changes), by
        # the members the view admits: cutting the relays it removes.
        moving_to = membership.wanted_change(core, st, now_ms) or ()
        excluding = (
            [m for m in st.members if m not in moving_to and open_interval(st.view, m) is not None]
            if moving_to
            else []
        )
    acc = st.acceptor
    # Taken over when the instance stopped moving (not since the first promise: two
    # members frozen that long would otherwise outbid each other on every tick), at once
    # when the proposer we promised is gone; staggered by rank so that one goes first.
    place = rank(core, st, now_ms)
    wait_ms = place * VIEW_STAGGER_MS
    if _carries_elsewhere(st, acc):
        wait_ms += VIEW_ROUND_MS + lag  # (its round is all it may take)
    elif not _proposer_gone(core, acc, now_ms):
        wait_ms += VIEW_TAKEOVER_MS + lag  # (a live proposer may just be slow)
    stalled = acc.promised >= 0 and now_ms - acc.active_ms >= wait_ms
    if not excluding and not including and not moving_to and not stalled:
        st.view_wanted_ms = NEVER
        return
    if st.view_wanted_ms == NEVER:
        st.view_wanted_ms = now_ms
    if acc.promised >= 0 and not stalled:
        return  # another proposal is under way
    if not stalled and now_ms - st.view_wanted_ms < defer_ms(core, st, place, now_ms):
        return
    if now_ms - st.first_elsewhere_ms < FIRST_ELSEWHERE_WAIT_MS + lag:
        # Our last proposal found a first view that may have been decided and leaves us
        # out (5.15 establishment): its relays, frozen by our promise, take over once the
        # instance stops moving; proposing again would keep it moving, and them frozen.
        core.counters["view_left_to_others"] += 1
        return
    if stalled:
        core.counters["view_takeover"] += 1
    elif not _could_decide(core, st, excluding, now_ms, moving_to):
        # Too few members could promise: the proposal would only freeze those that do,
        # and hold every commit until a later one is decided. Wait until more can.
        core.counters["view_not_proposed"] += 1
        return
    propose(core, st, tuple(excluding), tuple(including), now_ms, moving_to)


def _could_decide(
    core: RelayState,
    st: StreamState,
    excluding: list[int],
    now_ms: int,
    moving_to: tuple[int, ...] = (),
) -> bool:
    """Whether enough members (`membership.to_decide`) could answer a proposal cutting
    `excluding`: we and the live members that have joined, less any it would cut that the
    view admits as they are now (they refuse their own cut, 5.12 step 2; a restarted one
    does not)."""
    able = 1
    staying = {core.id} & set(moving_to)  # (a change: the relays it keeps that could)
    for m in st.peers:
        peer = core.peers[m]
        if not is_live(core, peer, now_ms) or not peer.joined.get(st.stream):
            continue
        held = open_interval(st.view, m)
        cut = m in excluding and held is not None and held.incarnation == peer.incarnation
        if cut and not moving_to:  # (a change's removed relays do promise)
            continue
        able += 1
        if m in moving_to:
            staying.add(m)
    if moving_to and not membership.history_suffices(st.members, moving_to, staying):
        return False  # (enough of its new relays must hold the history: 5.15 changes)
    # (the first view, which establishes the configuration, is decided by every member:
    # while one is not able to, a proposal would only stall in its accept phase, 5.15)
    return able >= membership.to_decide(st)


def _carries_elsewhere(st: StreamState, acc: Acceptor) -> bool:
    """We promised, in a stream's first view, a proposer that the first view we accepted
    leaves out (5.15 establishment): should its proposal have to carry ours, it gives the
    instance up to our relays (`_carry_first`), so we take over once its round is over,
    not after the longer wait for a slow proposer."""
    relay = acc.promised_to[0]
    return (
        st.config_version == PROVISIONAL
        and acc.accepted is not None
        and relay >= 0
        and relay not in acc.accepted.members
    )


def _proposer_gone(core: RelayState, acc: Acceptor, now_ms: int) -> bool:
    """The relay whose ballot we promised is silent or restarted: its proposal is over."""
    relay, incarnation = acc.promised_to
    if relay < 0 or relay == core.id:
        return False
    peer = core.peers.get(relay)
    if peer is None:  # let go of: removed from the mesh (RelayCore.forget_relays)
        return True
    return peer.incarnation != incarnation or not is_live(core, peer, now_ms)


def propose(
    core: RelayState,
    st: StreamState,
    excluding: tuple[int, ...],
    including: tuple[Admission, ...],
    now_ms: int,
    moving_to: tuple[int, ...] = (),
) -> None:
    number = st.view.number + 1
    round_ = (max(st.acceptor.promised, st.acceptor.seen, 0) >> BALLOT_ROUND_SHIFT) + 1
    ballot = (round_ << BALLOT_ROUND_SHIFT) | core.id
    prop = st.proposal = Proposal(number, ballot, excluding, including, now_ms, now_ms)
    prop.moving_to = moving_to
    core.counters["config_change_proposed" if moving_to else "view_proposed"] += 1
    mine = answer(
        core, st, core.id, ViewPhase.PREPARE, number, ballot, excluding, None, now_ms, moving_to
    )
    if mine.ok:
        prop.promises[core.id] = mine
    _send_requests(core, st, prop, now_ms)
    _advance(core, st, prop, now_ms)


def _send_requests(core: RelayState, st: StreamState, prop: Proposal, now_ms: int) -> None:
    prop.sent_ms = now_ms
    config, members = st.configuration
    done = prop.promises if prop.phase is ViewPhase.PREPARE else prop.accepted_by
    for m in st.peers:
        if m in done:
            continue
        core.send(
            ViewRequest(
                sender=core.id,
                incarnation=core.incarnation,
                floor=core.clock.floor,
                target=m,
                stream=st.stream,
                phase=prop.phase,
                view=prop.number,
                ballot=prop.ballot,
                excluding=prop.excluding,
                value=prop.value if prop.phase is ViewPhase.ACCEPT else None,
                config=config,
                members=members,
                moving_to=prop.moving_to,
            )
        )


def on_reply(core: RelayState, st: StreamState, msg: ViewReply, now_ms: int) -> None:
    prop = st.proposal
    if prop is None or msg.view != prop.number or msg.ballot != prop.ballot:
        core.counters["view_reply_unmatched"] += 1
        return
    if not membership.compatible(st, msg.config, msg.members):
        # An acceptor under another configuration (5.15): its promise is not one of ours.
        membership.hear(core, st, msg.sender, msg.config, msg.members)
        core.counters["view_reply_other_config"] += 1
        return
    if not msg.ok:
        if msg.promised > prop.ballot:
            st.acceptor.seen = max(st.acceptor.seen, msg.promised)
            st.proposal = None  # a higher ballot is under way: leave it the instance
        return
    if msg.phase is ViewPhase.PROMISE and prop.phase is ViewPhase.PREPARE:
        prop.promises[msg.sender] = msg
    elif msg.phase is ViewPhase.ACCEPTED and prop.phase is ViewPhase.ACCEPT:
        prop.accepted_by.add(msg.sender)
    _advance(core, st, prop, now_ms)


def _holders_or_done(st: StreamState, prop: Proposal, now_ms: int) -> bool:
    """A change (5.15 changes) is made from the promises once enough of its new relays
    among them hold the history through the start (`_holders_suffice`), or
    CHANGE_PROMISE_WAIT_MS after the proposal began (then it waits, `_value`): the first
    quorum of the old relays to promise need not hold enough of the new ones."""
    if not prop.moving_to or now_ms - prop.started_ms >= CHANGE_PROMISE_WAIT_MS:
        return True
    return _holders_suffice(st, prop)


def _holders_suffice(st: StreamState, prop: Proposal) -> bool:
    """Whether enough of the relays a change moves to are among the promisers that hold
    every transaction the view counts through the start the promises make (5.15,
    `membership.history_suffices`)."""
    start = max(p.reported for p in prop.promises.values())
    holding = {m for m, p in prop.promises.items() if p.holds >= start}
    return membership.history_suffices(st.members, prop.moving_to, holding)


def _advance(core: RelayState, st: StreamState, prop: Proposal, now_ms: int) -> None:
    if (
        prop.phase is ViewPhase.PREPARE
        and _prepared(st, prop)
        and _holders_or_done(st, prop, now_ms)
    ):
        made = _value(core, st, prop)
        if st.config_version == PROVISIONAL and made.members != st.members:
            _carry_first(core, st, prop, made, now_ms)
            return
        prop.value = made
        prop.phase = ViewPhase.ACCEPT
        prop.resends = 0
        mine = answer(
            core, st, core.id, ViewPhase.ACCEPT, prop.number, prop.ballot, (), prop.value, now_ms
        )
        if mine.ok:
            prop.accepted_by.add(core.id)
        _send_requests(core, st, prop, now_ms)
    if prop.phase is ViewPhase.ACCEPT and len(prop.accepted_by) >= membership.to_decide(st):
        value = prop.value
        assert value is not None
        core.counters["view_decided"] += 1
        st.proposal = None
        # (a change's new relays learn it too: they join the stream under it)
        for m in sorted({*st.peers, *value.members} - {core.id}):
            _send_decided(core, st.stream, m, value)
        adopt(core, st, value, now_ms)


def _prepared(st: StreamState, prop: Proposal) -> bool:
    """Whether the proposal may make its value: with promises from a quorum, or, while the
    stream's configuration is provisional, from every one of its relays (5.15
    establishment): a first view is decided by every relay of its value, each of which
    must have promised its ballot, so that what any of them accepted before is known."""
    if st.config_version != PROVISIONAL:
        return len(prop.promises) >= st.q
    return all(m in prop.promises for m in st.members)


def _carry_first(
    core: RelayState, st: StreamState, prop: Proposal, value: ViewValue, now_ms: int
) -> None:
    """The first view the proposal must carry (`_earlier_first`) is of other relays than
    our provisional ones (5.15 establishment). If they include us, they are our
    configuration from now on, and those that have not promised our ballot yet are asked
    to: the value is made again once all of them did (their promises may tell of a later
    one). If they leave us out, the instance is theirs to finish."""
    if core.id not in value.members:
        core.counters["view_first_elsewhere"] += 1
        st.proposal = None
        st.first_elsewhere_ms = now_ms
        return
    membership.carry(core, st, value.members)
    _send_requests(core, st, prop, now_ms)
    _advance(core, st, prop, now_ms)


def _value(core: RelayState, st: StreamState, prop: Proposal) -> ViewValue:
    """The value to accept: one accepted before in this instance, else a new one. Either
    carries our configuration (5.15), established (version 1) by the first view; a first
    view accepted before may carry other relays (`_earlier_first`)."""
    config = max(st.config_version, 1)
    earlier = [p for p in prop.promises.values() if p.accepted is not None]
    if earlier and st.config_version == PROVISIONAL:
        first = _earlier_first(st, prop)
        if first is not None:
            return first
    elif earlier:
        best = max(earlier, key=lambda p: p.accepted_ballot)
        assert best.accepted is not None
        if best.accepted.config == PROVISIONAL:
            return _of_an_earlier_release(st, best.accepted)
        return best.accepted
    start = max(p.reported for p in prop.promises.values())
    members = st.members
    cut_now: set[int] = set(prop.excluding)
    if prop.moving_to:
        if _holders_suffice(st, prop):
            config, members = st.config_version + 1, prop.moving_to
        else:
            # Too few of the new relays hold the history through the start (one is
            # joining, or behind): the change waits, and this instance ends at once
            # with the view unchanged, so that no member stays frozen for it.
            core.counters["config_change_deferred"] += 1
            st.change_deferred_ms = prop.started_ms
            cut_now = set()
    # Decided history only grows: through the last view's lo every promiser of that view
    # had committed, so a promiser behind it does not pull lo back (the intervals pruned at
    # that lo would otherwise be missed by a relay applying this view from below it).
    lo = max(st.view.lo, min(p.committed for p in prop.promises.values()))
    intervals: list[Interval] = []
    for i in st.view.intervals:
        if i.cut < 0 and i.member in cut_now:
            intervals.append(Interval(i.member, i.incarnation, i.since, max(start, i.since)))
        elif i.cut < 0 or i.cut > lo:
            intervals.append(i)  # still open, or its transactions not all committed yet
    for member, incarnation, floor in prop.including:
        if member not in members:
            continue  # (asked for under relays a first view it carries left behind, 5.15)
        if open_interval(ViewValue(0, 0, 0, tuple(intervals)), member) is None:
            # Above all it coordinated before: those were cut, or never counted.
            intervals.append(Interval(member, incarnation, max(start, floor)))
    cut = ViewValue(prop.number, start, lo, tuple(intervals))
    union: dict[int, Entry] = {}
    for p in prop.promises.values():
        for seq, tx in p.entries:
            if seq > lo and admits_seq(cut, relay_of(seq), seq):
                union.setdefault(seq, (seq, tx))
    entries = tuple(union[seq] for seq in sorted(union))
    return ViewValue(prop.number, start, lo, tuple(intervals), entries, config, members)


def _of_an_earlier_release(st: StreamState, value: ViewValue) -> ViewValue:
    """A value accepted before views carried their configuration (an earlier release's
    acceptor record): it was accepted among the same relays as ours, the only ones that
    release knew."""
    return msgspec.structs.replace(value, config=max(st.config_version, 1), members=st.members)


def _earlier_first(st: StreamState, prop: Proposal) -> ViewValue | None:
    """The first view, accepted before in this instance, that the proposal must carry:
    the one accepted with the highest ballot among those that may have been decided
    (every one of its relays among our promisers holds it: a relay that accepted a
    decided first view holds it from then on, section 6); None if none may have been,
    and the proposal makes its own."""
    earlier = sorted(
        (p for p in prop.promises.values() if p.accepted is not None),
        key=lambda p: p.accepted_ballot,
        reverse=True,
    )
    for promise in earlier:
        value = promise.accepted
        assert value is not None
        if value.config == PROVISIONAL:
            return _of_an_earlier_release(st, value)
        if all(p.accepted == value for m, p in prop.promises.items() if m in value.members):
            return value
    return None


# --- learning -------------------------------------------------------------------------------


def on_decided(core: RelayState, st: StreamState, msg: ViewDecided, now_ms: int) -> bool:
    """False if the stream is no longer ours to go on with (see `adopt`)."""
    if msg.value.number <= st.view.number:
        return True
    return adopt(core, st, msg.value, now_ms, msg.sender) or msg.stream in core.streams


def tell_left(core: RelayState, msg: ViewRequest) -> None:
    """A request for a view of a stream a decided change took us off (5.15 changes): its
    sender, a relay the change kept, missed the decision, and may have nobody else to
    learn it from (every other old relay left too); the change is what was decided in
    that instance and every one before it, so we tell it. Anything else is counted."""
    left = core.left_views[msg.stream]
    if msg.sender not in left.members or msg.view > left.number:
        core.counters["frame_not_member"] += 1  # as if we knew nothing of the stream
        return
    core.counters["view_left_told"] += 1
    _send_decided(core, msg.stream, msg.sender, left)


def push_view(
    core: RelayState, st: StreamState, peer: int, now_ms: int, *, force: bool = False
) -> None:
    """Send `peer`, seen behind, our view: at once, then after repair_retry_ms, backing
    off while it stays behind (its heartbeats may only lag the view on its way)."""
    if st.view.number == 0:
        return
    last, resends = st.view_pushed.get(peer, (NEVER, -1))
    if not force and not retry_due(now_ms, last, max(resends, 0), core.limits.repair_retry_ms):
        return
    st.view_pushed[peer] = (now_ms, resends + 1)
    _send_decided(core, st.stream, peer, st.view)


def _send_decided(core: RelayState, stream: str, peer: int, value: ViewValue) -> None:
    core.send(
        ViewDecided(
            sender=core.id,
            incarnation=core.incarnation,
            floor=core.clock.floor,
            target=peer,
            stream=stream,
            value=value,
        )
    )


def adopt(
    core: RelayState, st: StreamState, value: ViewValue, now_ms: int, source: int = -1
) -> bool:
    """Take a decided view (from `source`, -1: our own decision): drop what it no longer
    counts, add what it carries. A view of another configuration (5.15) teaches a
    provisional relay the established one, which it then follows; False if it did not
    take the view: one of another established configuration, or one that leaves it out
    of the stream."""
    moved = moves(st, value)
    if not moved and (value.config, value.members) != (st.config_version, st.members):
        heard = membership.hear(core, st, source, value.config, value.members)
        if heard is membership.Heard.LEFT or heard is membership.Heard.DISAGREES:
            return False
    core.counters["view_adopted"] += 1
    before = set(st.view.intervals)
    st.view = value
    if st.acceptor.number != value.number + 1:  # (one remembered for the next stays)
        st.acceptor = Acceptor(number=value.number + 1)
    if st.proposal is not None and st.proposal.number <= value.number:
        st.proposal = None
    st.view_wanted_ms = NEVER
    st.view_adopted_ms = now_ms
    tl = st.timeline
    dropped, changed_at = tl.apply_view(
        value.lo, lambda seq: admits_seq(value, relay_of(seq), seq), value.entries
    )
    if 0 <= changed_at <= tl.reported:
        # We reported past the view's start without having promised (a promiser reported
        # at most there): those reports are void, no quorum can have used them. Forget
        # them so they are neither sent, counted, nor taken for a split.
        core.counters["view_voided_reports"] += 1
        st.out_reports = [r for r in st.out_reports if r[0] < changed_at]
        _drop_from(st.report_log, changed_at)
        tl.charge_report_log(len(st.report_log))
        _drop_from(st.own_unacked, changed_at)
    for seq in dropped:
        pending = st.pending.take(seq)
        if pending is not None:  # ours, cut by the view: no adopter will ever count it
            core.counters["produce_rejected_cut"] += 1
            coordinate.answer_all(
                core, pending.waiters, Outcome.REJECTED, -1, RejectReason.LATE.value
            )
    for member, incarnation in list(st.stale_floors):
        still = open_interval(value, member)
        if still is None or still.incarnation != incarnation:
            del st.stale_floors[(member, incarnation)]  # that incarnation no longer counts
    for interval in value.intervals:
        if interval.cut >= 0 or interval in before:
            continue
        if interval.member == core.id:
            if interval.incarnation == core.incarnation:
                core.clock.raise_floor(interval.since)  # ours come after the admission
        else:
            # Newly admitted: what it coordinated since is fetched from it, in case it
            # arrived before we adopted the view (and was not taken in then).
            links.refill(core, st, interval.member, interval.since, now_ms)
    if moved:
        # A decided change of the stream's relays (5.15 changes): from now on we count
        # under the new ones; a relay it removed no longer serves the stream. A relay
        # that holds the history through the change's start stands as having reported
        # there: a later view's promise quorum of the new relays meets the quorum that
        # decided the change with it, so that view starts at or above every point the old
        # relays committed (their reports no longer count, and the new relays may not
        # have reported that far).
        if core.id in value.members and holds(core, st, now_ms) >= value.start:
            tl.reported = max(tl.reported, value.start)
        elif core.id not in value.members:
            # What we coordinated that the change carried to the new relays commits
            # there, if at all, without us: its producers hear `unknown` now and retry
            # there (dedupe answers with the seq it committed at), not at their deadline.
            coordinate.abandon_pending(core, st)
            core.left_views[st.stream] = value  # (recorded by the move, `tell_left`)
        return membership.move(core, st, value.config, value.members)
    return True


def _drop_from(reports: deque[Report], point: int) -> None:
    while reports and reports[-1][0] >= point:
        reports.pop()
