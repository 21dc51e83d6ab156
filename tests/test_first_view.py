"""The value a proposal of a stream's first view carries (docs/protocol.md 5.15
establishment): a first view is decided only by every one of its relays, and relays whose
files differ may have accepted first views of different relays. A proposal needs the
promise of every relay of its configuration; it carries the first view accepted with the
highest ballot among those that may have been decided (every one of its relays among the
promisers holds it), taking its relays and asking those that have not promised yet, and
makes its own when none may have been."""

from __future__ import annotations

from relay.core import CoreConfig, Limits, RelayCore, Topology, codec, view
from relay.core.messages import Interval, ViewPhase, ViewReply, ViewRequest, ViewValue
from relay.core.state import FIRST_INCARNATION, PROVISIONAL, Proposal
from relay.sim.script import Mesh

T0 = 1_800_000_000_000
STREAM = "s"
MINE = (0, 1, 2)


def first_view(members: tuple[int, ...], since: int) -> ViewValue:
    return ViewValue(1, 0, 0, tuple(Interval(m, 1, since) for m in members), (), 1, members)


def promise(sender: int, ballot: int, accepted: tuple[int, ViewValue] | None) -> ViewReply:
    accepted_ballot, value = accepted if accepted is not None else (-1, None)
    return ViewReply(
        sender=sender,
        incarnation=1,
        floor=0,
        target=0,
        stream=STREAM,
        phase=ViewPhase.PROMISE,
        view=1,
        ballot=ballot,
        ok=True,
        promised=ballot,
        reported=-1,
        committed=-1,
        accepted_ballot=accepted_ballot,
        accepted=value,
        config=PROVISIONAL,
        members=MINE,
    )


def proposing(promises: dict[int, tuple[int, ViewValue] | None]) -> tuple[RelayCore, Proposal]:
    """Relay 0, whose file names relays 0-2 for the stream, proposing its first view at
    ballot 5 << 10 with the given promises (relay -> what it accepted before)."""
    topology = Topology({r: (STREAM,) for r in MINE})
    core = RelayCore(CoreConfig(0, topology, Limits()), FIRST_INCARNATION, T0)
    st = core.streams[STREAM]
    assert st.configuration == (PROVISIONAL, MINE)
    ballot = 5 << view.BALLOT_ROUND_SHIFT
    prop = Proposal(1, ballot, (), tuple((m, 1, 7) for m in MINE), T0, T0)
    prop.promises = {m: promise(m, ballot, acc) for m, acc in promises.items()}
    st.proposal = prop
    return core, prop


def phase(prop: Proposal) -> ViewPhase:
    return prop.phase  # (read afresh: each step of a test moves it)


def test_a_first_view_waits_for_the_promise_of_every_relay_of_its_configuration() -> None:
    core, prop = proposing({0: None, 1: None})
    st = core.streams[STREAM]
    view._advance(core, st, prop, T0)
    assert phase(prop) is ViewPhase.PREPARE and prop.value is None  # a quorum is not enough
    prop.promises[2] = promise(2, prop.ballot, None)
    view._advance(core, st, prop, T0)
    assert phase(prop) is ViewPhase.ACCEPT and prop.value is not None
    assert prop.value.members == MINE and prop.value.config == 1


def test_a_first_view_of_other_relays_that_may_be_decided_is_carried_with_its_relays() -> None:
    # Relays 0 and 1 accepted a first view of relays 0-1 (their files named them then):
    # both of its relays among the promisers hold it, so it may have been decided.
    earlier = first_view((0, 1), since=3)
    core, prop = proposing({0: (2 << 10, earlier), 1: (2 << 10, earlier), 2: None})
    st = core.streams[STREAM]
    view._advance(core, st, prop, T0)
    assert prop.value == earlier
    assert st.configuration == (PROVISIONAL, (0, 1)) and st.proposal is prop
    assert core.counters["config_carried"] == 1
    assert phase(prop) is ViewPhase.ACCEPT


def test_a_first_view_one_of_whose_relays_holds_another_was_never_decided() -> None:
    # Relay 1 accepted a first view of relays 0-1 at ballot 3, relay 0 one of relays 0-2 at
    # ballot 2: relay 0 does not hold the highest, so no first view was decided, and the
    # proposal makes its own of its configuration's relays.
    low = first_view((0, 1), since=3)
    other = first_view(MINE, since=4)
    core, prop = proposing({0: (2 << 10, other), 1: (3 << 10, low), 2: None})
    st = core.streams[STREAM]
    view._advance(core, st, prop, T0)
    assert prop.value is not None and prop.value not in (low, other)
    assert prop.value.members == MINE and st.configuration == (PROVISIONAL, MINE)


def test_a_first_view_that_may_be_decided_without_the_proposer_is_left_to_its_relays() -> None:
    # Relays 1 and 2 accepted a first view of relays 1-2: it may have been decided, and the
    # proposer is not among its relays, so it gives the instance up to them.
    theirs = first_view((1, 2), since=3)
    core, prop = proposing({0: None, 1: (2 << 10, theirs), 2: (2 << 10, theirs)})
    st = core.streams[STREAM]
    view._advance(core, st, prop, T0)
    assert st.proposal is None and core.counters["view_first_elsewhere"] == 1
    assert st.configuration == (PROVISIONAL, MINE)


def test_a_carried_first_view_waits_for_the_promises_of_its_own_relays() -> None:
    # Relays 0 and 1 accepted a first view of relays 0, 1 and 3: relay 3 has not promised
    # our ballot, and may know of a later value, so the value is made again once it did.
    wider = first_view((0, 1, 3), since=3)
    core, prop = proposing({0: (2 << 10, wider), 1: (2 << 10, wider), 2: None})
    st = core.streams[STREAM]
    core.ready()  # (what the start sent)
    view._advance(core, st, prop, T0)
    assert st.configuration == (PROVISIONAL, (0, 1, 3)) and st.proposal is prop
    assert phase(prop) is ViewPhase.PREPARE and prop.value is None
    sent = [codec.decode(o.frame, Limits().max_frame_bytes) for o in core.ready().outgoing]
    asked = [m for m in sent if isinstance(m, ViewRequest)]
    assert [(m.target, m.phase, m.ballot, m.members) for m in asked] == [
        (3, ViewPhase.PREPARE, prop.ballot, (0, 1, 3))
    ]
    # Relay 3 accepted nothing: the first view of relays 0, 1 and 3 was never decided, and
    # the proposal makes its own, of the relays it now has.
    prop.promises[3] = promise(3, prop.ballot, None)
    view._advance(core, st, prop, T0)
    assert phase(prop) is ViewPhase.ACCEPT and prop.value is not None
    assert prop.value != wider and prop.value.members == (0, 1, 3)


def test_a_relay_whose_file_leaves_it_out_answers_a_first_view_that_includes_it() -> None:
    # Relay 3's file does not name it for "s" (served by relays 0-2). A first view of
    # relays 0, 1 and 3 proposed to it (its proposer carries one that may have been
    # decided with relay 3) is answered: relay 3 opens the stream, follows those relays
    # and promises. Then it learns the configuration relays 0-2 established, and leaves.
    mesh = Mesh(Topology({0: (STREAM,), 1: (STREAM,), 2: (STREAM,), 3: ("t",)}), Limits())
    for _ in range(600):
        mesh.step_ms()
    outsider = mesh.running(3)
    assert STREAM not in outsider.streams and STREAM not in outsider.foreign
    proposer = mesh.running(0)
    ballot = (50 << view.BALLOT_ROUND_SHIFT) | 0
    request = ViewRequest(
        sender=0,
        incarnation=proposer.incarnation,
        floor=proposer.clock.floor,
        target=3,
        stream=STREAM,
        phase=ViewPhase.PREPARE,
        view=1,
        ballot=ballot,
        config=PROVISIONAL,
        members=(0, 1, 3),
    )
    outsider.receive(codec.encode(request), mesh.clock(3), mesh.now)
    st = outsider.streams[STREAM]
    assert st.configuration == (PROVISIONAL, (0, 1, 3))
    assert st.acceptor.promised == ballot  # (it promised: its answer is on its way)
    assert outsider.counters["frame_not_member"] == 0
    mesh.drain(3)
    for _ in range(600):
        mesh.step_ms()
    assert STREAM not in outsider.streams
    version, members = outsider.foreign[STREAM]
    assert version >= 1 and members == MINE
