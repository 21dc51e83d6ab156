"""The intake of client requests (relay/intake.py): served one client after the other,
from turn to turn where the last stopped, and a client past its bound named."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from relay.intake import Intake


def served(intake: Intake[int], most: int) -> list[tuple[object, int]]:
    out = []
    for _ in range(most):
        taken = intake.take()
        if taken is None:
            break
        out.append(taken)
    return out


def test_clients_are_served_in_turn_and_a_turn_goes_on_where_the_last_stopped() -> None:
    intake: Intake[int] = Intake(max_queued=100)
    for request in range(5):
        assert intake.add("flood", request)
    assert intake.add("quiet", 100)
    # The quiet client's one request waits for one of the flood's, not for all five.
    assert served(intake, 2) == [("flood", 0), ("quiet", 100)]
    assert intake.add("quiet", 101)
    assert served(intake, 2) == [("flood", 1), ("quiet", 101)]
    assert served(intake, 10) == [("flood", 2), ("flood", 3), ("flood", 4)]
    assert len(intake) == 0 and intake.take() is None


def test_a_client_past_its_bound_is_said_flooding_and_its_requests_handed_back() -> None:
    intake: Intake[int] = Intake(max_queued=3)
    assert all(intake.add("a", r) for r in range(3))
    assert intake.add("b", 9)
    assert not intake.add("a", 3)  # the fourth: past the bound
    assert intake.queued("a") == 4 and len(intake) == 5
    assert intake.drop("a") == [0, 1, 2, 3]
    assert intake.queued("a") == 0 and len(intake) == 1
    assert intake.drop("a") == []
    assert served(intake, 5) == [("b", 9)]


@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), max_size=200))
def test_every_request_is_served_once_in_its_clients_order(ops: list[tuple[str, bool]]) -> None:
    """Adds and takes interleaved: each client's requests come out in the order they went
    in, none twice, none lost, and the count is right throughout."""
    intake: Intake[int] = Intake(max_queued=1_000)
    added: dict[str, list[int]] = {c: [] for c in "abc"}
    taken: dict[object, list[int]] = {c: [] for c in "abc"}
    for n, (client, add) in enumerate(ops):
        if add:
            intake.add(client, n)
            added[client].append(n)
        else:
            got = intake.take()
            if got is not None:
                taken[got[0]].append(got[1])
        assert len(intake) == sum(len(v) for v in added.values()) - sum(
            len(v) for v in taken.values()
        )
    for got in served(intake, len(ops) + 1):
        taken[got[0]].append(got[1])
    assert taken == added
