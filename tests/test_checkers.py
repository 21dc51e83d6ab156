"""Each checker flags a hand-built bad history, and a good history passes them all."""

from __future__ import annotations

import copy

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
