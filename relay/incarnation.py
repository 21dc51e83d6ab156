"""A relay's incarnation and the lock on its identity, kept on disk.

Both live in the relay's own directory, `<data_dir>/relay=<id>/` (named like the relay's
spool directory, `<data_dir>/spool/relay=<id>/`):

* `lock`: held (flock, exclusive) by the process running the relay, and holding its pid.
  A second process of the same relay id on this machine is refused
  (`RelayAlreadyRunning`, naming the pid and the file): two processes of one identity
  would vote twice under it. The kernel drops the lock when the process ends, however it
  ends.
* `incarnation`: the last incarnation taken, in decimal. Each start takes a higher one
  (docs/protocol.md section 3: messages of an older incarnation than one already seen are
  dropped, so a relay restarting lower than its peers remember would be ignored for good):

      new = max(last + 1, wall clock ms since EPOCH_MS)

  The counter makes it rise whatever the wall clock does (a clock that stepped back
  across a restart used to give a lower incarnation); the wall clock makes a relay whose
  file was lost still tend to rise above what its peers remember (and keeps the values of
  relays started before the file existed). The new value is on disk (temporary file,
  fsync, rename, directory fsync) before the relay talks to anyone.

  FIRST_INCARNATION (1) means "the first start of this identity ever": the core then
  knows there is nothing it could have forgotten (relay/core/view.py forgot_acceptor:
  no abstaining from view changes, relay/acceptors.py). So a start without the file
  takes 1 only if nothing else shows an earlier start: a relay with acceptor records or
  a spool directory has run before, and takes at least 2.

  A file that exists but cannot be read or does not hold a positive integer stops the
  start (`IncarnationError`): guessing could give a lower incarnation than the peers
  remember, the very failure this file is for. Removing the file is the operator's
  explicit choice to fall back on the wall clock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import IO

from relay.acceptors import replace_durably
from relay.core import EPOCH_MS
from relay.core.state import FIRST_INCARNATION
from relay.errors import IncarnationError, RelayAlreadyRunning

INCARNATION_FILE = "incarnation"
LOCK_FILE = "lock"
INCARNATION_MAX_BYTES = 64  # a decimal integer and a newline, with room to spare


def relay_directory(data_dir: Path, relay_id: int) -> Path:
    """`<data_dir>/relay=<id>`: where a relay keeps its lock and incarnation."""
    return data_dir / f"relay={relay_id}"


class RelayLock:
    """The exclusive lock on one relay identity on this machine, held until `release`
    (or until the process ends). `acquire` raises RelayAlreadyRunning if another process
    holds it, and IncarnationError if the directory cannot be used."""

    def __init__(self, path: Path, file: IO[str]) -> None:
        self.path = path
        self._file: IO[str] | None = file

    @classmethod
    def acquire(cls, directory: Path, relay_id: int) -> RelayLock:
        path = directory / LOCK_FILE
        try:
            directory.mkdir(parents=True, exist_ok=True)
            file = open(path, "a+", encoding="ascii")  # noqa: SIM115 (held until release)
        except OSError as e:
            raise IncarnationError(f"relay {relay_id}: cannot open its lock {path}: {e}") from e
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read(INCARNATION_MAX_BYTES).strip() or "unknown"
            file.close()
            raise RelayAlreadyRunning(
                f"relay {relay_id} is already running on this machine (pid {holder}): "
                f"{path} is locked",
                lock_path=path,
                pid=int(holder) if holder.isdigit() else None,
            ) from None
        except OSError as e:
            file.close()
            raise IncarnationError(f"relay {relay_id}: cannot lock {path}: {e}") from e
        file.seek(0)
        file.truncate()
        file.write(f"{os.getpid()}\n")
        file.flush()
        return cls(path, file)

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        """Give the lock up (idempotent). The pid stays in the file: harmless, as only
        the flock counts."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(file.fileno(), fcntl.LOCK_UN)
            file.close()


def next_incarnation(directory: Path, relay_id: int, wall_ms: int, *, ran_before: bool) -> int:
    """Take this start's incarnation: the next one after the last on disk, raised to the
    wall clock's value, and keep it durably before returning it. `ran_before`: whether
    anything besides this file shows that the relay ran before (its acceptor records,
    its spool). Raises IncarnationError if the file cannot be read or written."""
    path = directory / INCARNATION_FILE
    last = _read_last(path, relay_id)
    clock_based = wall_ms - EPOCH_MS
    if last is None and not ran_before:
        new = FIRST_INCARNATION
    else:
        after = last if last is not None else FIRST_INCARNATION
        new = max(after + 1, clock_based)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        replace_durably(path, f"{new}\n".encode("ascii"))
    except OSError as e:
        raise IncarnationError(
            f"relay {relay_id}: cannot keep its incarnation in {path}: {e}"
        ) from e
    return new


def _read_last(path: Path, relay_id: int) -> int | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(INCARNATION_MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise IncarnationError(f"relay {relay_id}: cannot read {path}: {e}") from e
    text = raw.decode("ascii", errors="replace").strip()
    if len(raw) > INCARNATION_MAX_BYTES or not text.isdigit() or int(text) < FIRST_INCARNATION:
        raise IncarnationError(
            f"relay {relay_id}: {path} does not hold an incarnation ({raw[:20]!r}); the "
            "relay must start above what its peers remember, so it does not guess. "
            "Remove the file to fall back on the wall clock"
        )
    return int(text)
