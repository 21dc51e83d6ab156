"""Acceptor memory (docs/protocol.md 5.12): what a relay promised or accepted in a view
change survives its restart, on disk (relay/acceptors.py) and in the core
(RelayCore.remember_acceptors); a relay that lost it abstains from the next change."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.acceptors import COMPACT_MIN_BYTES, LEGACY_SUFFIX, LOG_NAME, AcceptorFiles
from relay.core import CoreConfig, Limits, RelayCore, Topology, codec, membership
from relay.core.messages import Interval, ViewValue
from relay.core.state import FIRST_INCARNATION
from relay.core.view import forgot_acceptor
from relay.errors import FrameError

T0 = 1_800_000_000_000
TOPOLOGY = Topology({0: ("s", "t"), 1: ("s", "t"), 2: ("s", "t")})


def core_of(incarnation: int) -> RelayCore:
    return RelayCore(CoreConfig(0, TOPOLOGY, Limits()), incarnation, T0)


def record(
    number: int,
    promised: int,
    ballot: int = -1,
    value: ViewValue | None = None,
    config: tuple[int, tuple[int, ...]] = (1, (0, 1, 2)),
) -> bytes:
    return codec.encode_acceptor(codec.AcceptorRecord(number, promised, ballot, value, *config))


# --- the files ---------------------------------------------------------------------------------


def loaded(tmp_path: Path, relay_id: int) -> dict[str, bytes]:
    """What a restarted relay finds."""
    files = AcceptorFiles.of_relay(tmp_path, relay_id)
    try:
        return files.load()
    finally:
        files.close()


def test_records_round_trip_and_replace(tmp_path: Path) -> None:
    files = AcceptorFiles.of_relay(tmp_path, 4)
    assert files.load() == {}
    files.save_all([("orders.eu", b"one"), ("a/b c", b"two")])
    files.save_all([("orders.eu", b"three")])  # replaces the earlier record
    files.save_all([])
    # A second AcceptorFiles on the same directory (the restarted relay) reads the same.
    again = AcceptorFiles.of_relay(tmp_path, 4)
    assert again.load() == {"orders.eu": b"three", "a/b c": b"two"}
    assert [p.name for p in again.directory.iterdir()] == [LOG_NAME]  # no temporary file
    assert loaded(tmp_path, 5) == {}
    files.close()
    again.close()


def test_saving_before_loading_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="load"):
        AcceptorFiles.of_relay(tmp_path, 0).save_all([("s", b"x")])


def test_a_torn_last_entry_is_dropped_and_the_rest_kept(tmp_path: Path) -> None:
    files = AcceptorFiles.of_relay(tmp_path, 0)
    files.load()
    files.save_all([("s", b"kept"), ("t", b"kept too")])
    files.save_all([("s", b"torn by a crash")])
    files.close()
    data = files.path.read_bytes()
    files.path.write_bytes(data[:-3])  # the last append never reached the disk whole
    assert loaded(tmp_path, 0) == {"s": b"kept", "t": b"kept too"}
    corrupt = bytearray(data)
    corrupt[-1] ^= 0xFF  # nor may a damaged one count
    files.path.write_bytes(bytes(corrupt))
    assert loaded(tmp_path, 0) == {"s": b"kept", "t": b"kept too"}


def test_the_log_is_rewritten_once_it_grew_past_what_it_holds(tmp_path: Path) -> None:
    files = AcceptorFiles.of_relay(tmp_path, 0)
    files.load()
    record = b"r" * 1_000
    for n in range(3 * COMPACT_MIN_BYTES // len(record)):
        files.save_all([(f"s{n % 10}", record + b"%d" % n)])
    assert files.path.stat().st_size < COMPACT_MIN_BYTES + 20 * len(record)
    last = {f"s{n % 10}": record + b"%d" % n for n in range(3 * COMPACT_MIN_BYTES // len(record))}
    files.close()
    assert loaded(tmp_path, 0) == last


def test_files_of_the_earlier_layout_are_taken_over(tmp_path: Path) -> None:
    directory = tmp_path / "acceptors" / "relay-0"
    directory.mkdir(parents=True)
    (directory / (b"s".hex() + LEGACY_SUFFIX)).write_bytes(b"old")
    (directory / ("zz-not-hex" + LEGACY_SUFFIX)).write_bytes(b"x")
    files = AcceptorFiles.of_relay(tmp_path, 0)
    assert files.load() == {"s": b"old"}
    files.save_all([("t", b"new")])
    files.close()
    assert loaded(tmp_path, 0) == {"s": b"old", "t": b"new"}
    assert not (directory / (b"s".hex() + LEGACY_SUFFIX)).exists()


# --- the codec ---------------------------------------------------------------------------------


def test_acceptor_record_round_trips_with_an_accepted_value() -> None:
    value = ViewValue(3, 1_000, 900, (Interval(0, 1, 0), Interval(1, 2, 50, 1_000)))
    decoded = codec.decode_acceptor(record(4, 2049, 2049, value), 1 << 20)
    assert decoded == (4, 2049, 2049, value, 1, (0, 1, 2), False, None)
    empty = codec.decode_acceptor(record(1, -1), 1 << 20)
    assert empty == (1, -1, -1, None, 1, (0, 1, 2), False, None)


@pytest.mark.parametrize("junk", [b"", b"\x00", b"\x92\x01\x02", b"not msgpack at all"])
def test_a_broken_record_is_a_frame_error(junk: bytes) -> None:
    with pytest.raises(FrameError):
        codec.decode_acceptor(junk, 1 << 20)


# --- the core ----------------------------------------------------------------------------------


def test_a_remembered_acceptor_is_taken_back_and_nothing_is_forgotten() -> None:
    core = core_of(FIRST_INCARNATION + 1)
    broken = core.remember_acceptors({"s": record(2, (3 << 10) | 1)})
    assert broken == []
    acc = core.streams["s"].acceptor
    assert (acc.number, acc.promised) == (2, (3 << 10) | 1)
    assert not forgot_acceptor(core, "s")
    assert not forgot_acceptor(core, "t")  # no record: it never promised anything there


def test_an_unreadable_record_counts_as_forgotten() -> None:
    core = core_of(FIRST_INCARNATION + 1)
    assert core.remember_acceptors({"s": b"\xc1garbage", "t": record(1, -1)}) == ["s"]
    assert forgot_acceptor(core, "s")
    assert not forgot_acceptor(core, "t")


def test_without_acceptor_memory_only_a_restart_forgets() -> None:
    # A first start has nothing to forget; a later start without memory may have promised.
    assert not forgot_acceptor(core_of(FIRST_INCARNATION), "s")
    assert forgot_acceptor(core_of(FIRST_INCARNATION + 1), "s")


def test_a_changed_acceptor_is_handed_to_the_shell_only_when_it_keeps_memory() -> None:
    without = core_of(FIRST_INCARNATION)
    without.remember(without.streams["s"])
    assert without.outbox.acceptors == []
    keeping = core_of(FIRST_INCARNATION)
    keeping.remember_acceptors({})
    keeping.remember(keeping.streams["s"])
    [(stream, kept)] = keeping.outbox.acceptors
    assert stream == "s"
    assert codec.decode_acceptor(kept, 1 << 20)[0] == keeping.streams["s"].acceptor.number
    # with the stream's configuration as it stands (5.15): provisional, not yet kept
    assert codec.decode_acceptor(kept, 1 << 20)[4:] == (0, (0, 1, 2), False, None)


def test_a_recorded_configuration_outlives_the_topology() -> None:
    """5.15: after a restart onto a topology that names other relays for a stream, the
    relay runs it under the configuration its record keeps; a stream it does not open at
    start opens under its record too, and the shell subscribes to it."""
    grown = Topology({0: ("s", "u"), 1: ("s", "u"), 2: ("s", "u"), 3: ("s",)})
    core = RelayCore(CoreConfig(0, grown, Limits()), FIRST_INCARNATION + 1, T0)
    core.remember_acceptors({"s": record(3, -1), "t": record(2, -1, config=(1, (0, 2)))})
    st = core.streams["s"]
    assert (st.configuration, st.desired, st.q) == ((1, (0, 1, 2)), (0, 1, 2, 3), 2)
    assert core.members("t") == (0, 2) and core.serves("t")  # not opened yet: by its record
    assert core.recorded_streams() == ["t"]
    assert "t" not in core.streams
    assert core.stream("t").configuration == (1, (0, 2))  # opened on first use, as recorded
    assert core.recorded_streams() == ["t"]
    assert core.members("u") == (0, 1, 2)  # no record: the topology's
    assert "u" in core.streams and core.streams["u"].config_version == 0


def test_an_accepted_establishing_value_is_kept_but_binds_no_relays_across_a_restart() -> None:
    """5.15 establishment: a relay that accepted the value of a stream's first view keeps
    it across a restart (its promises carry it to every later proposal, which carries it
    on while it may have been decided), and its provisional configuration is the
    topology's again: the accepted value binds it to no relays."""
    grown = Topology({0: ("s",), 1: ("s",), 2: ("s",), 3: ("s",)})
    value = ViewValue(1, 5, 0, (Interval(0, 1, 5),), (), 1, (0, 1, 2))
    core = RelayCore(CoreConfig(0, grown, Limits()), FIRST_INCARNATION + 1, T0)
    core.remember_acceptors({"s": record(1, 1025, 1025, value, config=(0, (0, 1, 2)))})
    st = core.streams["s"]
    assert st.configuration == (0, (0, 1, 2, 3))
    assert (st.acceptor.promised, st.acceptor.accepted_ballot, st.acceptor.accepted) == (
        1025,
        1025,
        value,
    )


def test_a_stream_left_by_a_change_stays_left_across_a_restart() -> None:
    """5.15 changes: a record whose configuration leaves the relay out is a stream it
    left. After a restart it serves the stream no more, even where its topology still
    names it (`not a member`); a relay behind the change does not readmit it to an
    earlier version; and the decided view that took it off is kept, to tell a relay the
    change kept that missed it (view.tell_left)."""
    left = ViewValue(4, 9, 5, (Interval(1, 1, 5),), (), 2, (1,))
    kept = codec.encode_acceptor(codec.AcceptorRecord(5, -1, -1, None, 2, (1,), True, left))
    for topology in (TOPOLOGY, Topology({0: ("t",), 1: ("s", "t"), 2: ("t",)})):
        core = RelayCore(CoreConfig(0, topology, Limits()), FIRST_INCARNATION + 1, T0)
        core.remember_acceptors({"s": kept})
        assert "s" not in core.streams and not core.serves("s")
        assert core.foreign == {"s": (2, (1,))}
        assert core.left_views == {"s": left}
        assert not membership.readmit(core, "s", 1, (0, 1))  # (1, [0, 1]): behind us
        assert membership.readmit(core, "s", 3, (0, 1))  # a later change adds us again
        assert core.streams["s"].configuration == (3, (0, 1))
        assert "s" not in core.left_views and "s" not in core.foreign
