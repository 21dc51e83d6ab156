"""A relay's incarnation and lock on disk (relay/incarnation.py), alone and as the node
and `relay run` use them: the counter grows across starts whatever the wall clock does,
the first start ever is FIRST_INCARNATION, and a second process of a relay is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relay.core import EPOCH_MS
from relay.core.state import FIRST_INCARNATION
from relay.errors import IncarnationError, RelayAlreadyRunning
from relay.incarnation import (
    INCARNATION_FILE,
    LOCK_FILE,
    RelayLock,
    next_incarnation,
    relay_directory,
)
from relay.launcher import write_loopback_topology
from relay.node import RelayNode
from relay.topology import load

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
NOW_MS = EPOCH_MS + 3_000_000_000  # a wall clock some weeks after the epoch


def test_the_first_start_ever_is_the_first_incarnation(tmp_path: Path) -> None:
    assert next_incarnation(tmp_path, 1, NOW_MS, ran_before=False) == FIRST_INCARNATION
    assert (tmp_path / INCARNATION_FILE).read_text() == f"{FIRST_INCARNATION}\n"


def test_the_counter_grows_across_starts(tmp_path: Path) -> None:
    taken = [next_incarnation(tmp_path, 1, NOW_MS + i, ran_before=False) for i in range(4)]
    assert taken[0] == FIRST_INCARNATION
    assert taken[1] == NOW_MS + 1 - EPOCH_MS  # the wall clock's value, above the last
    assert taken == sorted(set(taken)), taken
    assert (tmp_path / INCARNATION_FILE).read_text() == f"{taken[-1]}\n"


def test_a_wall_clock_stepped_back_still_gives_a_higher_incarnation(tmp_path: Path) -> None:
    before = next_incarnation(tmp_path, 1, NOW_MS, ran_before=True)
    assert before == NOW_MS - EPOCH_MS
    # The clock stepped back an hour across the restart (and again): still higher.
    after = next_incarnation(tmp_path, 1, NOW_MS - 3_600_000, ran_before=True)
    assert after == before + 1
    assert next_incarnation(tmp_path, 1, EPOCH_MS - 1, ran_before=True) == before + 2


def test_a_relay_that_ran_before_is_not_on_its_first_start(tmp_path: Path) -> None:
    """No file, but acceptor records or a spool say the relay ran: its earlier
    incarnations may have promised or voted, so it must not claim to have nothing to
    forget (relay/core/view.py forgot_acceptor), even with a clock before the epoch."""
    assert next_incarnation(tmp_path, 1, EPOCH_MS - 5, ran_before=True) == FIRST_INCARNATION + 1
    assert next_incarnation(tmp_path / "b", 1, NOW_MS, ran_before=True) == NOW_MS - EPOCH_MS


@pytest.mark.parametrize("content", [b"", b"garbage\n", b"-5\n", b"0\n", b"7" * 100])
def test_a_file_without_an_incarnation_stops_the_start(tmp_path: Path, content: bytes) -> None:
    """Guessing could take an incarnation below what the peers remember (ignored for
    good): the relay refuses, naming the file and the way out."""
    (tmp_path / INCARNATION_FILE).write_bytes(content)
    with pytest.raises(IncarnationError, match="Remove the file") as info:
        next_incarnation(tmp_path, 1, NOW_MS, ran_before=True)
    assert str(tmp_path / INCARNATION_FILE) in str(info.value)
    assert (tmp_path / INCARNATION_FILE).read_bytes() == content  # left as it was


def test_an_unreadable_file_stops_the_start(tmp_path: Path) -> None:
    (tmp_path / INCARNATION_FILE).mkdir()  # a directory: reading it fails (even as root)
    with pytest.raises(IncarnationError, match="cannot read"):
        next_incarnation(tmp_path, 1, NOW_MS, ran_before=True)


def test_the_lock_refuses_a_second_holder_and_names_the_first(tmp_path: Path) -> None:
    first = RelayLock.acquire(tmp_path, 3)
    try:
        with pytest.raises(RelayAlreadyRunning) as info:
            RelayLock.acquire(tmp_path, 3)
        assert info.value.pid == os.getpid()
        assert info.value.lock_path == tmp_path / LOCK_FILE
        assert f"pid {os.getpid()}" in str(info.value) and str(tmp_path / LOCK_FILE) in str(
            info.value
        )
    finally:
        first.release()
    again = RelayLock.acquire(tmp_path, 3)  # released: free again
    assert again.held
    again.release()
    again.release()  # idempotent
    assert not again.held


def test_a_node_takes_the_next_incarnation_and_holds_its_lock(tmp_path: Path) -> None:
    config = load(write_loopback_topology(tmp_path, {1: ["solo"], 2: ["solo"]}))
    directory = relay_directory(config.data_dir, 1)
    first = RelayNode(config, 1, handle_signals=False)
    try:
        assert first.incarnation == FIRST_INCARNATION  # nothing of relay 1 existed
        with pytest.raises(RelayAlreadyRunning):
            RelayNode(config, 1, handle_signals=False)
        other = RelayNode(config, 2, handle_signals=False)  # another relay: its own lock
        other.close()
    finally:
        first.close()
    second = RelayNode(config, 1, handle_signals=False)
    second.close()
    assert second.incarnation > first.incarnation
    # The file lost, but the relay's acceptor records are there: not a first start.
    (directory / INCARNATION_FILE).unlink()
    third = RelayNode(config, 1, handle_signals=False)
    third.close()
    assert third.incarnation > FIRST_INCARNATION


def test_relay_run_refuses_a_relay_already_running(tmp_path: Path) -> None:
    path = write_loopback_topology(tmp_path, {1: ["solo"]})
    config = load(path)
    holder = RelayLock.acquire(relay_directory(config.data_dir, 1), 1)  # "the other process"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "relay", "run", "--config", str(path), "--relay", "1"],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        holder.release()
    assert done.returncode == 1, done
    assert "already running" in done.stderr and f"pid {os.getpid()}" in done.stderr, done.stderr
    assert str(holder.path) in done.stderr, done.stderr
