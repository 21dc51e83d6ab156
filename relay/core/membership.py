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

from relay.core.quorum import quorum
from relay.core.state import (
    PROVISIONAL,
    JoinState,
    PeerState,
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
    if st.join is not None:
        # What the relays of our provisional configuration answered counts for nothing:
        # ask those of the established one (the next tick does).
        st.join = JoinState(amnesiac=st.join.amnesiac)
    return Heard.MOVED


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
        st.votes.members = members
        for m in st.peers:
            # A relay the topology no longer lists is still a member: it is never heard
            # (the shell has no address for it), and counts as down.
            if m not in core.peers:
                core.peers[m] = PeerState()
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
    its configuration is provisional (that view establishes it: an acceptor that accepted
    it accepts no value of other relays, so two establishments of relay sets that share a
    relay cannot both be decided), else a quorum."""
    return len(st.members) if st.config_version == PROVISIONAL else st.q
