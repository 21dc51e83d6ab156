"""Each checker flags a hand-built bad history, and a good history passes them all."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from relay.core.messages import Transaction
from relay.sim import checkers
from relay.sim.history import (
    COMMITTED,
    CRASHED,
    REJECTED,
    UNKNOWN,
    Attempt,
    ConsumerLog,
    FenceSample,
    Final,
    History,
    PhaseInfo,
    RelayFinal,
    event_hash,
    final_outcome,
)
from relay.sim.single import SingleFaultInfo, single_fault_liveness

STREAM = "s"
MEMBERS = (0, 1, 2)
PHASE = PhaseInfo(safety_end_ms=100, liveness_end_ms=200, heal_bound_ms=50)


def tx(pseq: int, pid: bytes = b"p0") -> Transaction:
    return Transaction(pid, pseq, b"k", pid + b":" + str(pseq).encode())


def good() -> History:
    h = History(members={STREAM: MEMBERS})
    timeline = [(10, tx(1)), (20, tx(2)), (30, tx(3))]
    for pseq in range(1, 6):
        h.produced[(b"p0", pseq)] = (STREAM, tx(pseq))
    for pseq, (seq, t) in enumerate(timeline, start=1):
        h.attempts.append(Attempt(b"p0", pseq, STREAM, t, 0, 1, pseq, 120, COMMITTED, seq))
        h.finals[(b"p0", pseq)] = Final(b"p0", pseq, STREAM, t, 120, COMMITTED, seq, [seq])
    h.finals[(b"p0", 4)] = Final(b"p0", 4, STREAM, tx(4), 50, REJECTED)
    h.finals[(b"p0", 5)] = Final(b"p0", 5, STREAM, tx(5), 50, UNKNOWN)  # safety phase: fine
    for relay in MEMBERS:
        h.delivered[(relay, 1)] = {STREAM: list(timeline)}
        h.relay_finals[relay] = RelayFinal(
            relay, 1, True, 0, {STREAM: True}, {STREAM: False}, {STREAM: 30}
        )
        h.relay_finals[relay].config[STREAM] = (1, MEMBERS)  # established (5.15)
        h.relay_finals[relay].topology[STREAM] = MEMBERS
        h.fence_samples.append(FenceSample(0, relay, 1, STREAM, False, True))
        h.spooled[relay] = {STREAM: {seq for seq, _ in timeline}}
    h.consumers[0] = ConsumerLog(0, STREAM, list(timeline[1:]))
    return h


def violations(h: History) -> list[str]:
    return checkers.check_all(h, PHASE)


def assert_flags(h: History, word: str, checker=None) -> None:
    found = violations(h)
    assert any(word in v for v in found), found
    if checker is not None:
        assert any(word in v for v in checker(h)), checker(h)


def test_good_history_passes() -> None:
    assert violations(good()) == []


def test_gap_in_relay_log() -> None:
    h = good()
    h.delivered[(1, 1)][STREAM].pop(1)
    assert_flags(h, "gap:", checkers.timelines_agree)
    assert_flags(h, "missing:", checkers.acknowledged_delivered)


def test_gap_in_consumer_log() -> None:
    h = good()
    h.consumers[1] = ConsumerLog(1, STREAM, [(10, tx(1)), (30, tx(3))])
    assert_flags(h, "gap:", checkers.timelines_agree)


def test_reorder() -> None:
    h = good()
    h.delivered[(0, 1)][STREAM] = [(10, tx(1)), (30, tx(3)), (20, tx(2))]
    assert_flags(h, "reorder:", checkers.no_reorder_no_duplicate)


def test_consumer_reorder_and_duplicate() -> None:
    h = good()
    h.consumers[1] = ConsumerLog(1, STREAM, [(20, tx(2)), (10, tx(1))])
    h.consumers[2] = ConsumerLog(2, STREAM, [(10, tx(1)), (10, tx(1))])
    found = checkers.timelines_agree(h)
    assert any("reorder: consumer 1" in v for v in found), found
    assert any("duplicate: consumer 2" in v for v in found), found


def test_duplicate_seq() -> None:
    h = good()
    h.delivered[(0, 1)][STREAM] = [(10, tx(1)), (20, tx(2)), (20, tx(2)), (30, tx(3))]
    assert_flags(h, "duplicate:", checkers.no_reorder_no_duplicate)


def test_duplicate_transaction_at_two_seqs() -> None:
    h = good()
    h.delivered[(0, 1)][STREAM] = [(10, tx(1)), (20, tx(2)), (30, tx(3)), (40, tx(3))]
    assert_flags(h, "duplicate:", checkers.no_reorder_no_duplicate)
    assert_flags(h, "divergence:", checkers.timelines_agree)


def test_divergent_seq() -> None:
    h = good()
    h.delivered[(2, 1)][STREAM][1] = (20, tx(5))
    assert_flags(h, "divergence:", checkers.timelines_agree)


def test_invented_transaction() -> None:
    h = good()
    forged = Transaction(b"p0", 2, b"k", b"forged")
    h.delivered[(0, 1)][STREAM][1] = (20, forged)
    assert_flags(h, "invented:", checkers.nothing_invented)
    h = good()
    h.consumers[0].received.append((40, tx(1, pid=b"nobody")))
    assert_flags(h, "never produced", checkers.nothing_invented)


def test_invented_wrong_stream() -> None:
    h = good()
    h.members["other"] = MEMBERS
    h.delivered[(0, 1)]["other"] = [(15, tx(1))]
    assert_flags(h, "invented:", checkers.nothing_invented)


def test_rejected_delivered() -> None:
    h = good()
    for relay in MEMBERS:
        h.delivered[(relay, 1)][STREAM].append((40, tx(4)))
    assert_flags(h, "rejected delivered:", checkers.no_rejected_delivered)


def test_committed_missing_everywhere() -> None:
    h = good()
    h.finals[(b"p0", 5)] = Final(b"p0", 5, STREAM, tx(5), 150, COMMITTED, 40, [40])
    assert_flags(h, "lost:", checkers.acknowledged_delivered)


def test_committed_missing_on_one_member() -> None:
    h = good()
    h.finals[(b"p0", 5)] = Final(b"p0", 5, STREAM, tx(5), 150, COMMITTED, 40, [40])
    for relay in (0, 1):
        h.delivered[(relay, 1)][STREAM].append((40, tx(5)))
    assert_flags(h, "missing:", checkers.acknowledged_delivered)
    assert not any("relay 0" in v for v in checkers.acknowledged_delivered(h))


def test_committed_in_no_spool() -> None:
    h = good()
    h.spooled[0][STREAM].discard(20)
    h.spooled[1][STREAM].discard(20)
    assert violations(h) == []  # one spool holds it: the store can have it
    h.spooled[2][STREAM].discard(20)
    assert_flags(h, "unspooled:", checkers.spooled_acknowledged)


def test_restarted_relay_need_not_hold_older_history() -> None:
    h = good()
    h.delivered[(2, 2)] = {STREAM: [(30, tx(3))]}
    h.relay_finals[2] = RelayFinal(2, 2, True, 1, {STREAM: True}, {STREAM: False}, {STREAM: 30})
    assert violations(h) == []
    h.delivered[(2, 2)] = {STREAM: [(20, tx(2))]}  # starts at 20 but misses 30
    assert_flags(h, "missing:", checkers.acknowledged_delivered)


def test_wrong_committed_seq() -> None:
    h = good()
    h.finals[(b"p0", 3)].seq = 20
    h.finals[(b"p0", 3)].committed_seqs = [20]
    assert_flags(h, "wrong seq:", checkers.committed_seq_matches)


def test_committed_answers_disagree() -> None:
    h = good()
    h.finals[(b"p0", 3)].committed_seqs = [30, 35]
    assert_flags(h, "committed twice:", checkers.committed_seq_matches)


def test_client_conclusions_follow_the_answers() -> None:
    h = good()
    h.finals[(b"p0", 3)].client_outcome = COMMITTED
    h.finals[(b"p0", 3)].client_seq = 30
    assert violations(h) == []
    h.finals[(b"p0", 3)].client_seq = 20  # a seq no relay answered for it
    assert_flags(h, "client:", checkers.client_conclusions)
    h = good()
    h.finals[(b"p0", 3)].client_outcome = REJECTED  # though a relay answered committed
    assert_flags(h, "client:", checkers.client_conclusions)


def test_client_rejected_is_never_delivered() -> None:
    h = good()
    h.finals[(b"p0", 5)].client_outcome = REJECTED
    for relay in MEMBERS:
        h.delivered[(relay, 1)][STREAM].append((40, tx(5)))
    assert_flags(h, "rejected delivered:", checkers.no_rejected_delivered)


def test_relay_still_fenced() -> None:
    h = good()
    h.fence_samples.append(FenceSample(90, 1, 1, STREAM, True, True))  # heals at 150
    assert_flags(h, "stuck:")
    h = good()
    h.fence_samples.append(FenceSample(90, 1, 1, STREAM, True, True))
    h.fence_samples.append(FenceSample(120, 1, 1, STREAM, False, True))  # in time: fine
    assert violations(h) == []
    h.fence_samples.append(FenceSample(250, 1, 1, STREAM, True, True))
    assert_flags(h, "relapse:", lambda x: checkers.liveness(x, PHASE))
    h = good()
    h.relay_finals[2].fenced[STREAM] = True
    assert_flags(h, "stuck:", lambda x: checkers.liveness(x, PHASE))
    h = good()
    h.relay_finals[2].joined[STREAM] = False
    assert_flags(h, "stuck:", lambda x: checkers.liveness(x, PHASE))


def test_liveness_produce_not_committed() -> None:
    h = good()
    h.finals[(b"p0", 5)].issued_ms = 150
    assert_flags(h, "not committed:", lambda x: checkers.liveness(x, PHASE))
    assert checkers.check_all(h, PhaseInfo(100, 200, check_liveness=False)) == []


def test_rejected_late_only_allowed_while_settling() -> None:
    """A definite rejection right after healing is fine; later, everything must commit."""
    phase = PhaseInfo(safety_end_ms=100, liveness_end_ms=1_000, settle_ms=50)
    h = good()
    h.finals[(b"p0", 4)].issued_ms = 120  # within the settling window
    assert checkers.liveness(h, phase) == []
    h.finals[(b"p0", 4)].issued_ms = 400  # after it
    found = checkers.liveness(h, phase)
    assert any("not committed: p0#4" in v and "rejected" in v for v in found), found


def test_committed_points_differ() -> None:
    h = good()
    h.relay_finals[0].committed_point[STREAM] = 20
    assert_flags(h, "unsettled:", lambda x: checkers.liveness(x, PHASE))


def test_relay_down_at_end() -> None:
    h = good()
    h.relay_finals[0].up = False
    assert_flags(h, "down:", lambda x: checkers.liveness(x, PHASE))


def test_checkers_do_not_mutate() -> None:
    h = good()
    h.delivered[(1, 1)][STREAM].pop(1)
    before = copy.deepcopy(h)
    violations(h)
    assert h == before


@pytest.mark.parametrize(
    ("outcomes", "expected"),
    [
        ([COMMITTED], COMMITTED),
        ([UNKNOWN, COMMITTED], COMMITTED),
        (["fenced", REJECTED], REJECTED),
        ([UNKNOWN, REJECTED], UNKNOWN),
        ([CRASHED, REJECTED], UNKNOWN),
        ([None, REJECTED], UNKNOWN),
        (["fenced"], REJECTED),
        ([], UNKNOWN),
    ],
)
def test_final_outcome(outcomes: list[str | None], expected: str) -> None:
    attempts = [
        Attempt(b"p", 1, STREAM, tx(1), 0, 1, i, 0, o, 7 if o == COMMITTED else -1)
        for i, o in enumerate(outcomes)
    ]
    assert final_outcome(attempts)[0] == expected


def test_event_hash_is_order_sensitive() -> None:
    assert event_hash(["a", "b"]) == event_hash(["a", "b"])
    assert event_hash(["a", "b"]) != event_hash(["b", "a"])
    assert event_hash(["ab"]) != event_hash(["a", "b"])


# --- configurations (docs/protocol.md 5.15) -----------------------------------------------


def test_members_are_the_established_configuration() -> None:
    """The liveness checks ask the relays of the configuration the stream established,
    not the seed's topology: a relay the topology names that the configuration leaves
    out need not hold, join or settle anything, one it names must."""
    h = good()
    h.members[STREAM] = (*MEMBERS, 3)  # relay 3's file names it too; it never joined
    h.fence_samples.append(FenceSample(140, 3, 1, STREAM, True, False))
    assert violations(h) == []
    unconfigured = copy.deepcopy(h)
    for rf in unconfigured.relay_finals.values():
        rf.config.clear()
        rf.topology.clear()
    # with one shared topology, relay 3 would be a member that is down and stuck
    found = violations(unconfigured)
    assert any("down: relay 3" in v for v in found), found
    h.relay_finals[3] = RelayFinal(3, 1, True, 0, config={STREAM: (1, MEMBERS)})
    assert violations(h) == []
    h.fence_samples.append(FenceSample(140, 2, 1, STREAM, True, True))  # a member: stuck
    assert_flags(h, "stuck: relay 2", lambda x: checkers.liveness(x, PHASE))
    h = good()
    h.finals[(b"p0", 5)] = Final(b"p0", 5, STREAM, tx(5), 150, COMMITTED, 40, [40])
    for relay in (0, 1):
        h.delivered[(relay, 1)][STREAM].append((40, tx(5)))
    assert_flags(h, "missing:", checkers.acknowledged_delivered)  # relay 2 is a member


def test_one_configuration_per_stream() -> None:
    h = good()
    assert checkers.established(h) == {STREAM: MEMBERS}
    h.relay_finals[2].config[STREAM] = (0, MEMBERS)  # not established there yet: fine
    assert violations(h) == []
    h.relay_finals[2].config[STREAM] = (1, (0, 2))  # two established configurations
    assert_flags(h, "config fork:", checkers.one_configuration)
    assert checkers.check_all(h, PhaseInfo(100, 200, check_liveness=False))  # (safety)


def test_unestablished_stream_is_not_live() -> None:
    """A stream no relay established, whose relays' files agree, is a liveness failure."""
    h = good()
    for rf in h.relay_finals.values():
        rf.config[STREAM] = (0, MEMBERS)
    assert_flags(h, "unestablished:", lambda x: checkers.liveness(x, PHASE))


BLOCKED = "t"  # a stream the files disagree about


def blocked(stale_file: tuple[int, ...] = (1, 2)) -> History:
    """good(), plus a stream BLOCKED of MEMBERS that relay 2's file names as `stale_file`
    for it: never established, nothing committed, and its relays say why."""
    h = good()
    h.members[BLOCKED] = MEMBERS
    for relay, rf in h.relay_finals.items():
        mine = stale_file if relay == 2 else MEMBERS
        rf.topology[BLOCKED] = mine
        rf.config[BLOCKED] = (0, mine)
        if relay not in mine:
            continue  # it does not serve the stream
        rf.joined[BLOCKED], rf.fenced[BLOCKED] = False, True
        if relay == 2:
            rf.stall[BLOCKED] = ("config_mismatch", (1,))
        elif relay in stale_file:
            rf.stall[BLOCKED] = ("config_mismatch", (2,))
        else:
            rf.stall[BLOCKED] = ("config_mismatch" if 2 in stale_file else "joining", (2,))
        h.fence_samples.append(FenceSample(0, relay, 1, BLOCKED, True, False))
    h.produced[(b"p1", 1)] = (BLOCKED, tx(1, b"p1"))
    h.finals[(b"p1", 1)] = Final(b"p1", 1, BLOCKED, tx(1, b"p1"), 150, UNKNOWN)
    h.attempts.append(Attempt(b"p1", 1, BLOCKED, tx(1, b"p1"), 0, 1, 9, 150, "fenced"))
    return h


def test_stream_blocked_by_files_is_exempt_and_checked() -> None:
    """A stream whose relays' files disagree when it is first opened is never
    established: the liveness checks leave it, and check instead that it never committed
    and that its relays say why (5.15)."""
    h = blocked()
    assert checkers.blocked_by_files(h) == {
        BLOCKED: "relay 2's file names [1, 2], the seed's topology [0, 1, 2]"
    }
    assert violations(h) == []
    bad = blocked()
    bad.attempts[-1].outcome = COMMITTED
    assert_flags(bad, "blocked committed:", checkers.blocked_streams)
    bad = blocked()
    bad.delivered[(0, 1)][BLOCKED] = [(50, tx(1, b"p1"))]
    assert_flags(bad, "blocked committed:", checkers.blocked_streams)
    bad = blocked()
    bad.relay_finals[0].stall[BLOCKED] = ("joining", (2,))  # it is told another one
    assert_flags(bad, "blocked unnoticed: relay 0", checkers.blocked_streams)
    bad = blocked()
    bad.relay_finals[2].stall[BLOCKED] = ("", ())  # the stale relay: nothing holds it?
    assert_flags(bad, "blocked unnoticed: relay 2", checkers.blocked_streams)
    # Once a relay established it, it is a stream like any other: it must work.
    bad = blocked()
    bad.relay_finals[1].config[BLOCKED] = (1, MEMBERS)
    assert BLOCKED not in checkers.blocked_by_files(bad)
    assert_flags(bad, "stuck:", lambda x: checkers.liveness(x, PHASE))


def test_stream_blocked_by_a_file_that_leaves_its_relay_out() -> None:
    """A relay whose file leaves it out of a stream the others name it for never hears
    the stream: the others wait for it (a stall naming it), as for a relay that is down."""
    h = blocked(stale_file=(0, 1))
    assert violations(h) == []
    bad = blocked(stale_file=(0, 1))
    bad.relay_finals[1].stall[BLOCKED] = ("joining", (0,))  # waits, but not for relay 2
    assert_flags(bad, "blocked unnoticed: relay 1", checkers.blocked_streams)
    bad = blocked(stale_file=(0, 1))
    bad.relay_finals[0].stall[BLOCKED] = ("", ())
    assert_flags(bad, "blocked unnoticed: relay 0", checkers.blocked_streams)


def test_agreeing_files_do_not_exempt() -> None:
    """A relay that is not a member by the seed's topology may read another file for the
    stream: that blocks nothing, and the stream must work."""
    h = good()
    h.relay_finals[3] = RelayFinal(3, 1, True, 0, config={STREAM: (1, MEMBERS)})
    h.relay_finals[3].topology[STREAM] = (*MEMBERS, 3)  # names itself: it learnt and left
    for rf in h.relay_finals.values():
        rf.config[STREAM] = (0, rf.topology[STREAM])  # nothing established
    assert checkers.blocked_by_files(h) == {}
    assert_flags(h, "unestablished:", lambda x: checkers.liveness(x, PHASE))


# --- single faults that restart relays onto other topologies (relay/sim/single.py) --------


def restarted(kind: str = "roll") -> tuple[History, SingleFaultInfo]:
    """good(), as a single-fault run: relay 2 restarted at 1000 ms and rejoined at 1050,
    the stream kept its configuration, a produce to relay 0 at 1010 committed in 5 ms."""
    h = good()
    h.attempts = [Attempt(b"p0", 9, STREAM, tx(9), 0, 1, 99, 1_010, COMMITTED, 40, "", 1_015)]
    info = SingleFaultInfo(kind, 1_000, 3_000, {STREAM: frozenset(MEMBERS)})
    info.restarts = [(2, 1_000, 1_050)]
    info.configs_before = {STREAM: MEMBERS}
    info.configs_after = {STREAM: MEMBERS}
    return h, info


def test_restart_faults_are_checked_from_the_restart_on() -> None:
    """The others must not notice a restart onto another topology: produces are held to
    the bound at once (other single faults only RESUME_BOUND_MS after the fault)."""
    h, info = restarted()
    assert single_fault_liveness(h, info) == []
    h.attempts[0].answer_ms = 1_500  # 490 ms
    found = single_fault_liveness(h, info)
    assert any(v.startswith("stall: roll") for v in found), found
    info.kind = "crash"  # (sent before the crash's resume bound: not checked)
    info.restarts, info.configs_before, info.configs_after = [], {}, {}
    assert single_fault_liveness(h, info) == []


def test_restart_faults_produce_caught_by_the_restart() -> None:
    """A produce its relay's restart caught (sent to it just before, or before it joined
    again) must commit through another relay within the bound."""
    h, info = restarted()
    info.restarts.append((1, 2_000, 2_030))
    for relay, sent in ((1, 1_990), (2, 1_030)):  # just before its restart; rejoining
        h.attempts = [Attempt(b"p0", 9, STREAM, tx(9), relay, 1, 98, sent, CRASHED)]
        found = single_fault_liveness(h, info)
        assert any(v.startswith("stall:") for v in found), found  # never committed
        elsewhere = Attempt(b"p0", 9, STREAM, tx(9), 0, 1, 99, sent + 2, COMMITTED, 40)
        elsewhere.answer_ms = sent + 20
        h.attempts.append(elsewhere)
        assert single_fault_liveness(h, info) == []
        elsewhere.answer_ms = sent + 430  # too late after the caught one was sent
        found = single_fault_liveness(h, info)
        assert any(v.startswith("stall:") for v in found), found


@pytest.mark.parametrize(
    ("spoil", "word"),
    [
        (lambda h, info: setattr(info, "restarts", [(2, 1_000, -1)]), "not rejoined:"),
        (lambda h, info: setattr(info, "restarts", [(2, 1_000, 1_700)]), "not rejoined:"),
        (lambda h, info: setattr(info, "not_restarted", (0, 1)), "not rolled:"),
        (lambda h, info: info.configs_before.clear(), "cold:"),
        (lambda h, info: info.configs_after.update({STREAM: (0, 1)}), "reconfigured:"),
        (lambda h, info: h.relay_finals[2].config.update({STREAM: (0, (1, 2))}), "dropped:"),
        (lambda h, info: h.relay_finals[2].joined.update({STREAM: False}), "dropped:"),
        (
            lambda h, info: h.relay_finals[1].stall.update({STREAM: ("config_mismatch", (2,))}),
            "noticed:",
        ),
    ],
)
def test_restart_faults_keep_the_configurations(spoil: Any, word: str) -> None:
    """Every relay of a roll restarted and joined again in time, the mesh was warm, and
    every stream kept its relays, each still serving it, none held for another
    configuration (5.15)."""
    h, info = restarted("stale")
    assert single_fault_liveness(h, info) == []
    spoil(h, info)
    found = single_fault_liveness(h, info)
    assert any(v.startswith(word) for v in found), found


def test_a_retire_must_end_with_the_relay_let_go() -> None:
    """The retire single fault: the relay taken off every stream must also have been let
    go of by every other relay and stopped by the end."""
    h, info = restarted("retire")
    info.restarts = []
    info.retired = 3
    assert single_fault_liveness(h, info) == []
    info.retired = -1
    found = single_fault_liveness(h, info)
    assert any(v.startswith("not retired:") for v in found), found


def test_a_write_a_change_rejected_late_must_commit_on_its_retry() -> None:
    """`rejected: late` (a view change left that copy out) sends the client to try again
    at once, as `fenced` does: the write must then commit within the bound."""
    h, info = restarted("retire")
    info.restarts = []
    info.retired = 3
    late = Attempt(b"p0", 9, STREAM, tx(9), 2, 1, 98, 1_030, REJECTED, -1, "late", 1_035)
    h.attempts = [late]
    found = single_fault_liveness(h, info)
    assert any(v.startswith("stall:") for v in found), found
    retry = Attempt(b"p0", 9, STREAM, tx(9), 0, 1, 99, 1_036, COMMITTED, 40, "", 1_050)
    h.attempts.append(retry)
    assert single_fault_liveness(h, info) == []
