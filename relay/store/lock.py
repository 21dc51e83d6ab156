"""One writer at a time: the store's writer lock, `<store>/_writer.lock`.

A job that commits (ingest, snapshot, retention, compaction, vacuum) holds it; a second job
waits up to `wait_s` for it, then raises StoreLocked naming the holder (its job, process,
host and since when).

- A local store: an advisory file lock (flock) the kernel drops when its holder dies.
- An S3 store: a lease object created with a conditional write (put-if-absent) holding the
  holder and when the lease ends; the holder renews it every `LEASE_RENEW_S` (a write that
  succeeds only if the object is still the one it wrote last), and a waiter takes over a
  lease that has ended (its holder died) the same way. A holder that cannot renew marks the
  lock lost, and its next commit refuses (`check()`). Lease ends are wall-clock times of
  the machines involved: their clocks must agree to well within `LEASE_S`.

The lock keeps jobs out of each other's way (one sweep, one compaction at a time); what
keeps the tables right is Delta's own commit protocol, which refuses a second commit of a
version (and `relay.ingest`'s application transaction).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from typing import Any

from relay.store.errors import StoreLocked
from relay.store.location import StoreArg, StoreLocation, as_location

log = logging.getLogger("relay.store")

LOCK_FILE = "_writer.lock"
# How often a writer waiting for the lock looks again.
LOCK_POLL_S = 0.5
# An S3 lease lasts this long unless renewed, and is renewed this often: a holder may miss
# several renewals (a slow network, a long garbage collection) before it loses the lock.
LEASE_S = 60.0
LEASE_RENEW_S = 10.0


def _holder_text(job: str) -> str:
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"{job} (pid {os.getpid()} on {socket.gethostname()} since {since})"


def _locked(location: StoreLocation, holder: str) -> StoreLocked:
    return StoreLocked(
        f"store {location} is being written by {holder}; wait for it to finish (or pass a "
        "longer wait)",
        holder=holder,
    )


class WriterLock:
    """The writer lock of a store (local or S3), as a context manager."""

    def __init__(
        self,
        store: StoreArg,
        job: str,
        *,
        wait_s: float = 0.0,
        lease_s: float = LEASE_S,
        renew_s: float = LEASE_RENEW_S,
    ) -> None:
        self.location = as_location(store)
        self.job = job
        self.wait_s = wait_s
        self.lease_s = lease_s  # an S3 lease's length and renewal period
        self.renew_s = renew_s
        self._held: _FileLock | _LeaseLock | None = None

    def __enter__(self) -> WriterLock:
        held = (
            _FileLock(self.location)
            if self.location.is_local
            else _LeaseLock(self.location, self.lease_s, self.renew_s)
        )
        held.acquire(_holder_text(self.job), self.wait_s)
        self._held = held
        _held_locks[self.location] = held
        return self

    def __exit__(self, *exc: object) -> None:
        held, self._held = self._held, None
        _held_locks.pop(self.location, None)
        if held is not None:
            held.release()


# The locks this process holds, by store: a commit checks its store's (`check`).
_held_locks: dict[StoreLocation, _FileLock | _LeaseLock] = {}


def check(store: StoreArg) -> None:
    """Before a commit: raise StoreLocked if this process held the store's lock and lost it
    (an S3 lease it could not renew). A job run without the lock (tests of one function)
    is not checked."""
    held = _held_locks.get(as_location(store))
    if held is not None and held.lost is not None:
        raise StoreLocked(
            f"store {held.location}: this job lost the writer lock ({held.lost}); nothing more "
            "is committed",
            holder=held.lost,
        )


class _FileLock:
    def __init__(self, location: StoreLocation) -> None:
        self.location = location
        self.lost: str | None = None  # a file lock is never lost while its holder lives
        self._file: Any = None

    def acquire(self, holder: str, wait_s: float) -> None:
        self.location.make_dir("")
        handle = open(self.location.path(LOCK_FILE), "a+")  # noqa: SIM115 (open while held)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.seek(0)
                    other = handle.read().strip() or "an unknown job"
                    handle.close()
                    raise _locked(self.location, other) from None
                time.sleep(LOCK_POLL_S)
        handle.seek(0)
        handle.truncate()
        handle.write(holder)
        handle.flush()
        self._file = handle

    def release(self) -> None:
        handle, self._file = self._file, None
        if handle is not None:
            handle.seek(0)
            handle.truncate()
            handle.close()  # closing drops the lock


class _LeaseLock:
    def __init__(self, location: StoreLocation, lease_s: float, renew_s: float) -> None:
        self.location = location
        self.lease_s = lease_s
        self.renew_s = renew_s
        self.lost: str | None = None
        self._client = location.boto3_client()
        bucket, prefix = location.bucket_and_key
        self._bucket = bucket
        self._key = f"{prefix}/{LOCK_FILE}" if prefix else LOCK_FILE
        self._holder = ""
        self._etag = ""
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"holder": self._holder, "until": time.time() + self.lease_s}).encode()

    def _put(self, **condition: str) -> bool:
        """Write the lease under `condition`; False if the store refused the condition."""
        from botocore.exceptions import ClientError  # type: ignore[import-untyped]

        try:
            reply = self._client.put_object(
                Bucket=self._bucket, Key=self._key, Body=self._body(), **condition
            )
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                return False
            raise
        self._etag = str(reply["ETag"])
        return True

    def _current(self) -> tuple[str, str, float] | None:
        """The lease there now: (etag, holder, until), or None if there is none."""
        from botocore.exceptions import ClientError

        try:
            reply = self._client.get_object(Bucket=self._bucket, Key=self._key)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code", "") in ("NoSuchKey", "404"):
                return None
            raise
        try:
            lease = json.loads(reply["Body"].read())
            return str(reply["ETag"]), str(lease["holder"]), float(lease["until"])
        except (ValueError, KeyError, TypeError):
            return str(reply["ETag"]), "an unreadable lease", 0.0

    def acquire(self, holder: str, wait_s: float) -> None:
        self._holder = holder
        deadline = time.monotonic() + wait_s
        while True:
            if self._put(IfNoneMatch="*"):
                break
            current = self._current()
            if current is not None:
                etag, other, until = current
                if until < time.time():
                    log.warning("store %s: taking over the ended lease of %s", self.location, other)
                    if self._put(IfMatch=etag):
                        break
                elif time.monotonic() >= deadline:
                    raise _locked(self.location, other)
            time.sleep(LOCK_POLL_S)
        self._renewer = threading.Thread(target=self._renew, name="store-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                if not self._put(IfMatch=self._etag):
                    current = self._current()
                    self.lost = current[1] if current else "nobody (the lease was removed)"
                    log.error("store %s: writer lock lost to %s", self.location, self.lost)
                    return
            except Exception as error:  # a network error: try again, the lease lasts
                log.warning("store %s: renewing the writer lock failed: %s", self.location, error)

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self.lost is None:
            # Only our own lease: if another took it over meanwhile, its etag differs.
            current = self._current()
            if current is not None and current[0] == self._etag:
                with contextlib.suppress(Exception):
                    self._client.delete_object(Bucket=self._bucket, Key=self._key)
