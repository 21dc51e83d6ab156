"""A run appended in one go (`Timeline.append_run`, a member taking a TxBatch) leaves the
timeline exactly as inserting its entries one by one would; a run it cannot append is
refused untouched. Eviction frees entries without changing what is read above the base."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from relay.core.memory import MemoryBudget
from relay.core.messages import Entry, Transaction
from relay.core.timeline import Timeline

BASE = 1_000


def fresh() -> Timeline:
    tl = Timeline("s", 64, 16, MemoryBudget(1 << 40))
    tl.base_point = BASE
    return tl


def entries_of(seqs: list[int]) -> tuple[Entry, ...]:
    return tuple((s, Transaction(b"p", s, None, b"v%d" % s)) for s in seqs)


def shape(tl: Timeline) -> tuple[object, ...]:
    h = tl.head
    return (
        tl.seqs[h:],
        tl.txs[h:],
        tl.hashes[h:],
        tl.skip[h:],
        sorted(tl.late),
        tl.held_bytes,
        tl.budget.used_bytes,
        tl.digest_at(tl.last_seq()),
    )


seq_lists = st.lists(st.integers(BASE - 5, BASE + 60), max_size=12)


# append_run takes strictly ascending runs only (what a coordinator issues, and what the
# codec lets through in a TxBatch)
ascending_runs = seq_lists.map(lambda seqs: sorted(set(seqs))).filter(bool)


@given(held=seq_lists, run=ascending_runs, reported=st.integers(BASE - 1, BASE + 30))
def test_append_run_is_inserting_one_by_one(held: list[int], run: list[int], reported: int) -> None:
    by_run, one_by_one = fresh(), fresh()
    for tl in (by_run, one_by_one):
        for seq, tx in entries_of(held):
            tl.insert(seq, tx)
        tl.reported = max(tl.reported, reported)
    before = shape(by_run)
    appended = by_run.append_run(entries_of(run))
    if not appended:
        assert shape(by_run) == before  # refused untouched: the caller inserts one by one
        for seq, tx in entries_of(run):
            by_run.insert(seq, tx)
    for seq, tx in entries_of(run):
        one_by_one.insert(seq, tx)
    assert shape(by_run) == shape(one_by_one)
    assert appended == (run[0] > max([reported, BASE, *held]))


@given(count=st.integers(1, 40), keep=st.integers(0, 40))
def test_eviction_frees_entries_and_keeps_the_rest_readable(count: int, keep: int) -> None:
    tl = fresh()
    for seq, tx in entries_of(list(range(BASE + 1, BASE + 1 + count))):
        tl.insert(seq, tx)
    tl.digest_through(len(tl) - 1)
    last = tl.last_seq()
    digest = tl.digest_at(last)
    assert digest is not None
    tl.deliver_through(last, digest)
    evicted = tl.evict(keep, 1 << 40)
    assert evicted == max(0, count - keep) and len(tl) == min(count, keep)
    assert tl.digest_at(last) == digest and tl.base_point == last - len(tl)
    assert [s for s, _ in tl.entries_between(BASE, last)] == list(
        range(last - len(tl) + 1, last + 1)
    )


@given(count=st.integers(1, 40), spooled=st.integers(0, 40), voted=st.integers(0, 40))
def test_with_a_spool_eviction_keeps_what_was_voted_for_until_spooled(
    count: int, spooled: int, voted: int
) -> None:
    """docs/protocol.md 5.14: committed entries in (spooled_through, voted_through] stay."""
    tl = fresh()
    for seq, tx in entries_of(list(range(BASE + 1, BASE + 1 + count))):
        tl.insert(seq, tx)
    last = tl.last_seq()
    digest = tl.digest_at(last)
    assert digest is not None
    tl.deliver_through(last, digest)
    tl.spooled_through = BASE + spooled
    tl.voted_through = BASE + voted
    tl.budget.spool_pin = True
    tl.evict(0, 1 << 40)
    pinned = [s for s in range(BASE + 1, last + 1) if BASE + spooled < s <= BASE + voted]
    oldest_kept = pinned[0] if pinned else last + 1
    assert tl.seqs[tl.head :] == list(range(oldest_kept, last + 1))
    tl.budget.spool_pin = False  # without a spool nothing is pinned
    tl.evict(0, 1 << 40)
    assert len(tl) == 0


def test_changed_entries_lower_the_point_voted_through() -> None:
    tl = fresh()
    run = entries_of([BASE + 1, BASE + 2, BASE + 3, BASE + 4])
    for seq, tx in run:
        tl.insert(seq, tx)
    tl.voted_through = BASE + 4
    # Replaced by the same entries: our reports still stand.
    tl.replace_range(BASE, BASE + 4, list(run))
    assert tl.voted_through == BASE + 4
    # Entry BASE + 3 left out: our reports from there covered other entries.
    tl.replace_range(BASE, BASE + 4, [run[0], run[1], run[3]])
    assert tl.voted_through == BASE + 2
