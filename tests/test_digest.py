"""The rolling digest: a hash chain over a stream's timeline."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from relay.core.digest import DIGEST_BYTES, chain, chain_over, genesis, tx_hash
from relay.core.messages import Transaction

TX = Transaction(b"producer", 7, b"key", b"value")
# tx_hash(Transaction(b"p", 1, b"k", b"v")) as computed before transactions had a kind
KIND_ZERO_HASH_HEX = "698fe6e4eb9c736e5ed57112763247a0"

# small alphabets, so that generated timelines are often equal and often nearly equal
transactions = st.builds(
    Transaction,
    st.sampled_from([b"a", b"ab", b"b"]),
    st.integers(0, 2),
    st.sampled_from([None, b"", b"k"]),
    st.sampled_from([b"", b"c", b"bc"]),
)
timelines = st.lists(st.tuples(st.integers(0, 3), transactions), max_size=4)


def test_digest_sizes() -> None:
    assert DIGEST_BYTES == 16
    assert len(genesis("orders")) == 16
    assert len(tx_hash(TX)) == 16
    assert len(chain(genesis("orders"), 1, tx_hash(TX))) == 16
    assert len(chain_over(genesis("orders"), [(1, TX), (2, TX)])) == 16


def test_genesis_differs_per_stream_and_is_stable() -> None:
    names = ["orders", "orders.eu", "orders.us", "Orders", "é", "x" * 255]
    assert len({genesis(n) for n in names}) == len(names)
    assert genesis("orders") == genesis("orders")


@given(st.text(min_size=1, max_size=30), st.text(min_size=1, max_size=30))
def test_genesis_differs_for_any_two_streams(a: str, b: str) -> None:
    assert (genesis(a) == genesis(b)) == (a == b)


def test_tx_hash_differs_when_any_field_differs() -> None:
    variants = [
        TX,
        Transaction(b"producer2", 7, b"key", b"value"),
        Transaction(b"producer", 8, b"key", b"value"),
        Transaction(b"producer", 7, b"kez", b"value"),
        Transaction(b"producer", 7, None, b"value"),
        Transaction(b"producer", 7, b"", b"value"),
        Transaction(b"producer", 7, b"key", b"valuf"),
        Transaction(b"producer", 7, b"key", b""),
        Transaction(b"producer", 7, b"key", b"value", 1),
        Transaction(b"producer", 7, b"key", b"value", 255),
    ]
    assert len({tx_hash(t) for t in variants}) == len(variants)
    assert tx_hash(Transaction(b"producer", 7, b"key", b"value")) == tx_hash(TX)


def test_tx_hash_key_none_differs_from_empty_key() -> None:
    assert tx_hash(Transaction(b"p", 1, None, b"v")) != tx_hash(Transaction(b"p", 1, b"", b"v"))


def test_tx_hash_field_boundaries_cannot_shift() -> None:
    a = Transaction(b"ab", 1, None, b"c")
    b = Transaction(b"a", 1, None, b"bc")
    assert tx_hash(a) != tx_hash(b)
    # the same between key and value, and between producer id and key
    assert tx_hash(Transaction(b"p", 1, b"ab", b"c")) != tx_hash(Transaction(b"p", 1, b"a", b"bc"))
    assert tx_hash(Transaction(b"pk", 1, b"", b"v")) != tx_hash(Transaction(b"p", 1, b"k", b"v"))


def test_tx_hash_of_kind_zero_is_the_hash_from_before_kinds() -> None:
    # Chains built before transactions had a kind stay valid.
    assert tx_hash(Transaction(b"p", 1, b"k", b"v")).hex() == KIND_ZERO_HASH_HEX


def test_tx_hash_full_producer_seq_range() -> None:
    assert tx_hash(Transaction(b"p", 0, None, b"")) != tx_hash(
        Transaction(b"p", 2**64 - 1, None, b"")
    )


def test_chain_is_order_sensitive() -> None:
    g = genesis("s")
    t1 = Transaction(b"p", 1, None, b"one")
    t2 = Transaction(b"p", 2, None, b"two")
    assert chain_over(g, [(1, t1), (2, t2)]) != chain_over(g, [(1, t2), (2, t1)])
    assert chain_over(g, [(1, t1), (2, t2)]) != chain_over(g, [(2, t2), (1, t1)])


def test_chain_depends_on_seq_previous_and_content() -> None:
    g = genesis("s")
    h = tx_hash(TX)
    base = chain(g, 5, h)
    assert chain(g, 6, h) != base
    assert chain(genesis("t"), 5, h) != base
    assert chain(g, 5, tx_hash(Transaction(b"p", 1, None, b""))) != base
    assert chain(g, 5, h) == base


def test_chain_over_nothing_is_the_previous_digest() -> None:
    assert chain_over(genesis("s"), []) == genesis("s")


@given(timelines)
def test_chain_over_equals_repeated_chain(entries: list[tuple[int, Transaction]]) -> None:
    digest = genesis("s")
    for seq, tx in entries:
        digest = chain(digest, seq, tx_hash(tx))
    assert chain_over(genesis("s"), entries) == digest


@given(timelines, timelines)
def test_chain_over_is_incremental(
    a: list[tuple[int, Transaction]], b: list[tuple[int, Transaction]]
) -> None:
    g = genesis("s")
    assert chain_over(chain_over(g, a), b) == chain_over(g, a + b)


@given(timelines, timelines)
def test_equal_digest_iff_equal_timeline(
    a: list[tuple[int, Transaction]], b: list[tuple[int, Transaction]]
) -> None:
    # Different timelines colliding would take a 128-bit hash collision: assert it never does.
    g = genesis("s")
    assert (chain_over(g, a) == chain_over(g, b)) == (a == b)
