"""Attacks on a live mesh (docs/security.md): each one as a hostile client or outsider
would try it, with real relay processes and real sockets, and what it can no longer do.

One 3-relay mesh per module (relays 0-2 serve `orders.*`), security off: these are the
bounds that hold whatever the configuration.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from relay.client import Consumer, Producer
from relay.errors import Rejected
from relay.launcher import Mesh, write_loopback_topology

STREAM = "orders.eu"
START_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    directory = tmp_path_factory.mktemp("attacks")
    path = write_loopback_topology(directory, {r: ["orders.*"] for r in range(3)}, [STREAM])
    running = Mesh(path, log_level="warning", log_dir=directory / "logs")
    try:
        running.start(timeout_s=START_TIMEOUT_S)
        yield running
    finally:
        running.stop()


def relays(mesh: Mesh) -> dict[int, str]:
    return {r: e.client for r, e in sorted(mesh.endpoints.items())}


def test_a_client_cannot_take_over_another_producers_sequence(mesh: Mesh) -> None:
    """The attack: write the victim's next producer sequences with other values. They
    commit (the attacker's own writes), but the victim is no longer told `committed` for
    content that never went in: its sends are rejected `duplicate_mismatch`, and readers
    see the attacker's values only once, the victim's never as committed."""
    with Producer(relays(mesh), producer_id=b"victim") as victim:
        before = victim.send(STREAM, b"genuine 1")
        taken = victim.next_producer_seq
        with Producer(relays(mesh), producer_id=b"victim", first_producer_seq=taken) as thief:
            forged = thief.send(STREAM, b"forged")
        with pytest.raises(Rejected, match="duplicate_mismatch") as refused:
            victim.send(STREAM, b"genuine 2")
        assert refused.value.reason == "duplicate_mismatch"
        after = victim.send(STREAM, b"genuine 3")  # its next sequence is its own again
    values = {}
    with Consumer(relays(mesh), timeout_s=30).subscribe(STREAM, "earliest") as consumer:
        for record in consumer:
            values[record.seq] = record.value
            if record.seq >= after:
                break
    assert values[before] == b"genuine 1"
    assert values[forged] == b"forged"
    assert values[after] == b"genuine 3"
    assert b"genuine 2" not in values.values()
