"""Configurations: the relays a stream counts votes under (docs/protocol.md section 5.15).

Topology files are edited by hand and deployed one host at a time, so relays may disagree
about which relays serve a stream. Quorums of two different sets of relays need not
intersect, so no relay takes its topology's word for whom it counts. A stream's
*configuration* is a version and its relays. Version 0 is provisional: the relays this
relay's topology names, which it uses only to join. The stream's first view (5.12) is
decided under it with every one of those relays accepting, and establishes it as
version 1; every member keeps the established configuration in its acceptor record and
runs the stream under it from then on, whatever its topology says after a restart.

Every message about a stream that carries votes, promises or where the stream stands
says which configuration it was made under; a relay takes it only under a configuration
it agrees with (`compatible`), and notes every other one (`StreamState.disagree`, shown
in the status). A relay whose configuration is provisional and that hears an
established one takes it (`hear`): the stream has a history there; if the established
configuration leaves it out, it does not serve the stream (`RelayState.foreign`). Two
established configurations that differ, or provisional ones that differ while the
stream is being established, hold it: `fencing.CONFIG_MISMATCH`.
"""

from __future__ import annotations

import enum

from relay.core.links import is_live
from relay.core.messages import ViewPhase
from relay.core.quorum import VoteTally, quorum
from relay.core.state import (
    FIRST_INCARNATION,
    PROVISIONAL,
    JoinState,
    RelayState,
    StreamState,
)


class Heard(enum.Enum):
    """What a peer's word about a stream's configuration meant here (`hear`)."""

    AGREES = "agrees"  # compatible with ours: take its message
    DISAGREES = "disagrees"  # another one: its message is not taken (noted)
    LEARNT = "learnt"  # an established one replaced our provisional one (same relays)
    MOVED = "moved"  # an established one with other relays replaced ours: join again
    LEFT = "left"  # an established one that leaves us out: we no longer serve the stream
    # A later version than ours: a change we have not adopted yet (its view comes to us,
    # view.push_view); nothing said under it is taken meanwhile
    AHEAD = "ahead"
    BEHIND = "behind"  # an earlier version than ours: the sender missed a change


def compatible(st: StreamState, version: int, members: tuple[int, ...]) -> bool:
    """Whether a message made under (version, members) may be taken here: the same relays,
    and the same version or one of the two provisional (a member that has not adopted
    the view that established them yet, or we have not: a provisional relay reports
    nothing, commit.collect_reports)."""
    return members == st.members and (
        version == st.config_version or PROVISIONAL in (version, st.config_version)
    )


def hear(
    core: RelayState, st: StreamState, peer: int, version: int, members: tuple[int, ...]
) -> Heard:
    """`peer` (a member or not) stated (version, members) for the stream. An established
    configuration teaches a provisional relay (`learn`); anything else incompatible is
    noted, and its message is not taken."""
    if compatible(st, version, members):
        if st.disagree.pop(peer, None) is not None:
            core.counters["config_agreed"] += 1
        if version > st.config_version:
            set_config(core, st, version, members)
            return Heard.LEARNT
        return Heard.AGREES
    if version > PROVISIONAL and st.config_version == PROVISIONAL:
        return learn(core, st, version, members)
    if version > PROVISIONAL and version != st.config_version:
        # Established versions only grow, each from the one before by a decided view
        # (5.15 changes): another version is not a second history, only one of us is
        # behind.
        st.disagree.pop(peer, None)
        core.counters["config_ahead" if version > st.config_version else "config_behind"] += 1
        return Heard.AHEAD if version > st.config_version else Heard.BEHIND
    if st.disagree.get(peer) != (version, members):
        st.disagree[peer] = (version, members)
        core.counters["config_mismatch"] += 1
    return Heard.DISAGREES


def learn(core: RelayState, st: StreamState, version: int, members: tuple[int, ...]) -> Heard:
    """Take an established configuration in place of our provisional one: the stream has
    a history under it, which a configuration of our own would fork. A relay it leaves
    out stops serving the stream (its reads are redirected to the members, its produces
    forwarded to them)."""
    assert st.config_version == PROVISIONAL < version, "only a provisional one is replaced"
    core.counters["config_learnt"] += 1
    moved = members != st.members
    set_config(core, st, version, members)
    if core.id not in members:
        leave(core, st)
        return Heard.LEFT
    if not moved:
        return Heard.LEARNT
    _ask_again(st)
    return Heard.MOVED


def _ask_again(st: StreamState) -> None:
    """Our relays changed while we join: what the old ones answered counts for nothing,
    the new ones are asked (the next tick does)."""
    if st.join is not None:
        st.join = JoinState(amnesiac=st.join.amnesiac)


def move(core: RelayState, st: StreamState, version: int, members: tuple[int, ...]) -> bool:
    """Run the stream under a later configuration, which a decided view carried (5.15
    changes); False if it leaves this relay out (it no longer serves the stream)."""
    assert PROVISIONAL < st.config_version < version, "a change moves to a later version"
    core.counters["config_moved"] += 1
    set_config(core, st, version, members)
    if core.id not in members:
        leave(core, st)
        return False
    _ask_again(st)
    return True


def set_config(core: RelayState, st: StreamState, version: int, members: tuple[int, ...]) -> None:
    """Run the stream under (version, members) from now on; an established one is kept in
    the acceptor record (before anything said under it leaves, Ready.acceptors)."""
    assert version >= st.config_version, "a configuration's version never goes back"
    assert list(members) == sorted(set(members)), "relays ascending, each once"
    changed = (version, members) != st.configuration
    st.config_version = version
    if members != st.members:
        st.members = members
        st.peers = tuple(m for m in members if m != core.id)
        st.q = st.votes.q = quorum(len(members))
        # Votes counted under the old relays never count under the new ones: a quorum of
        # the new relays must report again (at later points: each reports a point once).
        st.votes = VoteTally(members, core.limits.max_pending_vote_points)
        st.votes.settle_through(st.timeline.committed_point)
        st.own_unacked.clear()
        core.know_peers(st.peers)
        for peer, stated in list(st.disagree.items()):
            if compatible(st, *stated):
                del st.disagree[peer]
    if version > PROVISIONAL and (changed or not st.config_recorded):
        core.remember(st)  # kept from now on, whatever the topology says after a restart


def leave(core: RelayState, st: StreamState) -> None:
    """Stop serving a stream whose configuration leaves this relay out."""
    core.counters["config_not_member"] += 1
    del core.streams[st.stream]
    core.invalidate_names()
    core.memory.used_bytes -= st.timeline.memory_bytes
    core.foreign[st.stream] = st.configuration
    # Our link counter on the stream's topic goes on from here should we serve it again
    # (`readmit`): the members drop a frame whose counter they passed (5.2).
    core.left_link_seq[st.stream] = st.link_seq_out


def reprovision(core: RelayState, st: StreamState) -> None:
    """The topology changed under a stream not established yet: its provisional
    configuration is the topology's, so it follows, unless the new file leaves us out (we
    learn the configuration its relays establish, and leave then). A first view we
    accepted of the old relays binds nothing: it goes with our promises, and a proposal
    carries it while it may have been decided (5.15 establishment). What the old relays
    answered to our join counts for nothing: we ask the new ones."""
    if st.config_version != PROVISIONAL:
        return
    if st.desired == st.members or core.id not in st.desired:
        return
    core.counters["config_reprovisioned"] += 1
    _provision(core, st, st.desired)


def follow(
    core: RelayState,
    st: StreamState,
    version: int,
    members: tuple[int, ...],
    ballot: int,
    phase: ViewPhase,
) -> None:
    """A first view of other relays that include us is proposed to us, with a ballot we
    may answer: its proposer's file names them, ours names others (it changed since,
    `reprovision`, or theirs did). We take its relays as our provisional configuration,
    so that the stream is established rather than held by relays whose files differ;
    the change to what our file names follows through the mesh. Safe, whatever we
    accepted before (section 6): our promise carries it, and a first view needs the
    promise of every relay of its proposer's configuration (5.15 establishment)."""
    acc = st.acceptor
    if (
        version != PROVISIONAL
        or st.config_version != PROVISIONAL
        or core.id not in members
        or members == st.members
        or not (ballot > acc.promised if phase is ViewPhase.PREPARE else ballot >= acc.promised)
    ):
        return
    core.counters["config_followed"] += 1
    _provision(core, st, members)


def carry(core: RelayState, st: StreamState, members: tuple[int, ...]) -> None:
    """Our proposal of a first view carries one accepted before of other relays, which
    include us (5.15 establishment): they are our provisional configuration from now on,
    and the proposal asks every one of them to accept it."""
    assert st.config_version == PROVISIONAL and core.id in members
    core.counters["config_carried"] += 1
    proposal = st.proposal
    _provision(core, st, members)
    st.proposal = proposal


def _provision(core: RelayState, st: StreamState, members: tuple[int, ...]) -> None:
    """Take other relays as the stream's provisional configuration: a proposal of ours
    for the old ones is given up, and the join asks the new ones."""
    st.proposal = None
    set_config(core, st, PROVISIONAL, members)
    _ask_again(st)


def readmit(core: RelayState, stream: str, version: int, members: tuple[int, ...]) -> bool:
    """A relay that does not serve the stream (it left it, `leave`, or its file does not
    name it and it knows no configuration of it) hears an established configuration, a
    later one than it knew, that has it among its relays (5.15 changes: a change added
    it while it was away, or its file is stale): it serves the stream under that
    configuration, and joins it afresh. True if it did."""
    if version == PROVISIONAL or stream in core.streams or core.id not in members:
        return False
    if not core.can_open(stream):
        return False
    left = core.foreign.get(stream)
    if left is None and (stream in core.recorded or core.serves(stream)):
        return False  # (it opens as it is; a provisional one learns the configuration)
    if left is not None and version <= left[0]:
        return False
    core.counters["config_readmitted"] += 1
    core.foreign.pop(stream, None)
    core.left_views.pop(stream, None)
    # It opens under that configuration (as under an acceptor record's), and joins: it
    # holds nothing of the stream. Unless it may have forgotten what it did under that
    # version (restarted without acceptor memory), it never reported under it, so it
    # need not wait for a commit above what anyone reported (an amnesiac join, 5.8): a
    # base at any member's committed point will do, and it catches up from there while a
    # change that needs it waits (the members, frozen by the change, commit nothing).
    core.recorded[stream] = (version, members)
    st = core.stream(stream)
    st.link_seq_out = max(st.link_seq_out, core.left_link_seq.pop(stream, 0))
    remembers = core.acceptor_memory is not None and stream not in core.acceptor_forgotten
    if core.incarnation <= FIRST_INCARNATION or remembers:
        st.join = JoinState(amnesiac=False, first_round_done=True)
    core.remember(st)
    return True


def blocking(st: StreamState) -> tuple[int, ...]:
    """The relays whose configuration holds the stream (`fencing.CONFIG_MISMATCH`): while
    ours is provisional, the members that state another one (the stream cannot be
    established before all agree); once established, any relay that states another
    established one (two histories may have begun: a fork to resolve by hand)."""
    if st.config_version == PROVISIONAL:
        return tuple(sorted(p for p in st.disagree if p in st.members))
    return tuple(sorted(p for p, (v, _) in st.disagree.items() if v > PROVISIONAL))


def to_decide(st: StreamState) -> int:
    """How many acceptances decide the stream's next view: every one of its relays while
    its configuration is provisional (that view establishes it: with every relay of a
    value accepting, and every one promising before it is made, two establishments of
    relay sets that share a relay cannot both be decided, 5.15 and section 6), else a
    quorum."""
    return len(st.members) if st.config_version == PROVISIONAL else st.q


def wanted_change(core: RelayState, st: StreamState, now_ms: int) -> tuple[int, ...] | None:
    """The relays the stream's next configuration should have, if a change is due: the
    configuration is established, this relay's topology names other relays for the
    stream, and so does the topology of every one of its relays that is live (by their
    heartbeats), a quorum of them at least. One relay with a stale file holds the change
    (its status names what it wants: it is refused by name), and files that disagree
    while they roll out never make the stream's relays go back and forth; a relay that
    is down does not hold it (it may be the one the change replaces). The change goes by
    steps (`next_step`)."""
    target = st.desired
    if st.config_version == PROVISIONAL or target == st.members or not target:
        return None
    if change_held_by(core, st, now_ms):
        return None
    live = sum(1 for m in st.peers if is_live(core, core.peers[m], now_ms))
    if 1 + live < st.q:
        return None
    return next_step(st.members, target)


def change_held_by(core: RelayState, st: StreamState, now_ms: int) -> dict[int, tuple[int, ...]]:
    """While this relay's file names other relays for an established stream than its
    configuration has: the live relays of the configuration whose files name others
    still (their statuses' `wanted`; the configuration's own relays when they state
    none, or not heard yet), which hold the change (`wanted_change`; in the status)."""
    held: dict[int, tuple[int, ...]] = {}
    if st.config_version == PROVISIONAL or st.desired == st.members:
        return held
    for m in st.peers:
        peer = core.peers[m]
        if not is_live(core, peer, now_ms):
            continue
        status = peer.statuses.get(st.stream)
        theirs = status.wanted or st.members if status is not None else st.members
        if theirs != st.desired:
            held[m] = theirs
    return held


def next_step(members: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, ...] | None:
    """The next configuration on the way from `members` to `target`. A change is decided
    by a quorum of the relays that stay, and only relays that already hold the stream's
    history count towards it (5.15), so relays are added while the current ones are a
    quorum of the next set, as many as that allows at a time (then the stream commits on
    while they catch up); a stream of one relay, which no addition leaves a quorum, grows
    by one relay (`history_suffices`). Once every target relay is in, the others are
    removed together. The set never shrinks below the smaller of the two, and every step
    keeps relays holding the history in every quorum of the next set. None: a stream of
    one relay moved to others (a target without its relay) is not changed. The files of
    the relays it moves to name only them, and a relay whose file names it alone may
    open the stream and establish it by itself before the change reaches it (a second
    history, docs/protocol.md section 8), which the change would then merge into the
    first. The operator grows the stream first (files naming both), then takes the old
    relay off (docs/deploy.md section 9)."""
    adding = [m for m in target if m not in members]
    if not adding:
        return target
    # quorum(len(members) + k) <= len(members)  <=>  k < len(members)
    room = len(members) - 1
    if room == 0:
        if members[0] not in target:
            return None
        room = 1
    return tuple(sorted({*members, *adding[:room]}))


def history_suffices(old: tuple[int, ...], new: tuple[int, ...], holding: set[int]) -> bool:
    """Whether the relays of a change's new configuration that hold the stream's history
    through the change's start (`holding`) let the change be made (5.15 changes): a quorum
    of the new relays, so that the stream commits on at once; or, growing a stream of one
    relay by one (`next_step`), that relay, which every quorum of the two contains. Either
    way every quorum of the new relays meets a relay that stands as having reported the
    start, which is what keeps later views from starting below it (docs/protocol.md
    section 6); in the second, the stream commits again once the added relay joined."""
    if sum(1 for m in new if m in holding) >= quorum(len(new)):
        return True
    return len(old) == 1 and len(new) == 2 and old[0] in new and old[0] in holding
