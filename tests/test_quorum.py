"""Quorum arithmetic (relay/core/quorum.py): quorum sizes, the commit rule, the dead-point
rule, settling and the memory bound, each as a table of cases."""

from __future__ import annotations

import itertools

import pytest

from relay.core.membership import history_suffices, next_step
from relay.core.quorum import VoteTally, quorum

D1, D2, D3 = b"1" * 16, b"2" * 16, b"3" * 16


@pytest.mark.parametrize(
    ("n", "q"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (6, 4), (7, 4), (8, 5), (9, 5)]
)
def test_quorum_sizes(n: int, q: int) -> None:
    assert quorum(n) == q


@pytest.mark.parametrize("n", range(1, 8))
def test_any_two_quorums_intersect(n: int) -> None:
    q = quorum(n)
    subsets = [set(c) for c in itertools.combinations(range(n), q)]
    assert all(a & b for a, b in itertools.combinations_with_replacement(subsets, 2))
    # and the quorum is the smallest size with that property
    if q > 1:
        smaller = [set(c) for c in itertools.combinations(range(n), q - 1)]
        assert any(not (a & b) for a, b in itertools.combinations(smaller, 2))


@pytest.mark.parametrize("n", [0, -1])
def test_quorum_of_no_members_raises(n: int) -> None:
    with pytest.raises(ValueError):
        quorum(n)


# Each case: members, the votes (reporter, point, digest) in order, and which of them
# completes a quorum (the index of the vote whose `add` returns True), or None.
COMMIT_CASES = [
    ("one member commits alone", (0,), [(0, 5, D1)], 0),
    ("two of three agree", (0, 1, 2), [(0, 5, D1), (1, 5, D1)], 1),
    ("two of three disagree", (0, 1, 2), [(0, 5, D1), (1, 5, D2)], None),
    ("the third vote decides", (0, 1, 2), [(0, 5, D1), (1, 5, D2), (2, 5, D2)], 2),
    ("a repeated vote counts once", (0, 1, 2), [(0, 5, D1), (0, 5, D1)], None),
    (
        "a second digest by one member is ignored",
        (0, 1, 2),
        [(0, 5, D1), (0, 5, D2), (1, 5, D2)],
        None,
    ),
    ("votes at other points do not add up", (0, 1, 2), [(0, 5, D1), (1, 6, D1)], None),
    ("the quorum completes once only", (0, 1, 2), [(0, 5, D1), (1, 5, D1), (2, 5, D1)], 1),
    ("five members need three", (0, 1, 2, 3, 4), [(0, 5, D1), (3, 5, D1), (4, 5, D1)], 2),
    ("sparse relay ids", (2, 9, 40), [(40, 5, D1), (2, 5, D1)], 1),
]


@pytest.mark.parametrize(
    ("members", "votes", "commits_at"),
    [case[1:] for case in COMMIT_CASES],
    ids=[case[0] for case in COMMIT_CASES],
)
def test_commit_rule(
    members: tuple[int, ...], votes: list[tuple[int, int, bytes]], commits_at: int | None
) -> None:
    tally = VoteTally(members, max_points=100)
    completed = [i for i, (r, p, d) in enumerate(votes) if tally.add(r, p, d)]
    assert completed == ([] if commits_at is None else [commits_at])
    if commits_at is not None:
        reporter, point, digest = votes[commits_at]
        assert reporter in tally.reporters(point, digest)
        assert len(tally.reporters(point, digest)) >= tally.q


# Each case: votes at point 5 among members (0, 1, 2) (q = 2), members whose vote there is
# still unknown, and whether the point is dead (no digest can reach the quorum).
DEAD_CASES = [
    ("no votes, all unknown", [], 3, False),
    ("no votes, all known", [], 0, True),
    ("one vote and one unknown can still agree", [(0, D1)], 1, False),
    ("one vote, nobody else can vote", [(0, D1)], 0, True),
    ("split, one unknown may join either", [(0, D1), (1, D2)], 1, False),
    ("split, all known: dead", [(0, D1), (1, D2)], 0, True),
    ("three ways split", [(0, D1), (1, D2), (2, D3)], 0, True),
    ("committed is never dead", [(0, D1), (1, D1)], 0, False),
]


@pytest.mark.parametrize(
    ("votes", "unknown", "dead"),
    [case[1:] for case in DEAD_CASES],
    ids=[case[0] for case in DEAD_CASES],
)
def test_dead_rule(votes: list[tuple[int, bytes]], unknown: int, dead: bool) -> None:
    tally = VoteTally((0, 1, 2), max_points=100)
    for reporter, digest in votes:
        tally.add(reporter, 5, digest)
    assert tally.dead(5, unknown) is dead


def test_settled_points_are_forgotten_and_ignored() -> None:
    tally = VoteTally((0, 1, 2), max_points=100)
    tally.add(0, 5, D1)
    tally.add(0, 9, D1)
    tally.settle_through(5)
    assert 5 not in tally.points and 9 in tally.points
    assert tally.add(1, 5, D1) is False  # at or below the settled point: no commit again
    assert tally.last_point[1] == 5 and tally.max_seen == 9


def test_bounded_memory_drops_the_lowest_point_and_never_calls_it_dead() -> None:
    tally = VoteTally((0, 1, 2), max_points=2)
    for point in (5, 6, 7):
        tally.add(0, point, D1)
    assert sorted(tally.points) == [6, 7]
    assert tally.evicted_through == 5
    assert tally.dead(5, 0) is False  # its votes are no longer known
    assert tally.dead(6, 0) is True


def test_conflicting_votes_are_counted() -> None:
    tally = VoteTally((0, 1, 2), max_points=100)
    tally.add(0, 5, D1)
    tally.add(0, 5, D2)
    assert tally.conflicts == 1
    assert tally.reporters(5, D2) == []


# --- changes of a stream's relays (relay/core/membership.py, docs/protocol.md 5.15) -------------


@pytest.mark.parametrize(
    ("members", "target", "steps"),
    [
        ((0,), (0, 1, 2), [(0, 1), (0, 1, 2)]),  # a stream of one grows by one first
        ((0, 1), (0, 1, 2, 3), [(0, 1, 2), (0, 1, 2, 3)]),
        ((0, 1, 2), (0, 1, 2, 3, 4), [(0, 1, 2, 3, 4)]),
        ((0, 1, 2), (3, 4, 5), [(0, 1, 2, 3, 4), (0, 1, 2, 3, 4, 5), (3, 4, 5)]),
        ((0, 1, 2), (0, 1), [(0, 1)]),
        ((0, 1), (1,), [(1,)]),
    ],
)
def test_a_change_goes_by_steps_whose_quorums_meet_the_relays_holding_it(
    members: tuple[int, ...], target: tuple[int, ...], steps: list[tuple[int, ...]]
) -> None:
    """Every step keeps relays of the set before it in every quorum of the set after it,
    and (but growing a stream of one) a quorum of them: the relays that hold the history
    decide the step and commit on while the added ones catch up."""
    at, taken = members, []
    while at != target:
        after = next_step(at, target)
        assert after is not None
        kept = set(at) & set(after)
        for q_set in itertools.combinations(after, quorum(len(after))):
            assert kept & set(q_set), (at, after)
        assert history_suffices(at, after, kept)
        taken.append(after)
        at = after
    assert taken == steps


@pytest.mark.parametrize("target", [(1,), (1, 2)])
def test_a_stream_of_one_relay_is_not_moved_to_others(target: tuple[int, ...]) -> None:
    """The relays it would move to may have begun a history of their own (their files
    name only them): the operator grows it first, then takes the old relay off."""
    assert next_step((0,), target) is None
    assert next_step((0,), (0, *target)) == (0, target[0])


@pytest.mark.parametrize(
    ("old", "new", "holding", "enough"),
    [
        ((0,), (0, 1), {0}, True),  # every quorum of two holds relay 0
        ((0,), (0, 1), set(), False),
        ((0, 1), (0, 1, 2), {0, 1}, True),
        ((0, 1), (0, 1, 2), {0}, False),  # relay 0 alone is no quorum of three
        ((0, 1, 2), (0, 1), {0}, False),  # removing: a quorum of the rest must hold it
        ((0, 1, 2), (0, 1), {0, 1}, True),
        ((0, 1), (1,), {1}, True),
    ],
)
def test_which_holders_let_a_change_be_made(
    old: tuple[int, ...], new: tuple[int, ...], holding: set[int], enough: bool
) -> None:
    assert history_suffices(old, new, holding) is enough
