"""A relay's acceptor memory on disk (docs/protocol.md 5.12): per stream, the last record
the core asked to keep (`Ready.acceptors`), so that a restarted relay takes part in the
next view change at once instead of abstaining from it.

One append-only log, `<data_dir>/acceptors/relay-<id>/acceptors.log`. `save_all` appends
every record of a turn and fsyncs once, before the relay sends the answers that count on
them: a turn that opens thousands of streams (each starting with a view change) costs one
fsync, not thousands (one file per stream, fsynced one by one, stalled a relay for a
minute after a client read 2,000 new names matching a pattern). The last record of a
stream in the log is its record.

Each entry is `[body length: u32][xxh3_64 of the body: u64][body]`, the body
`[stream name length: u16][stream name, UTF-8][record]`. A crash can leave a torn last
entry; it was never fsynced, so nothing was sent that counted on it, and `load` stops at
the first entry that is short or fails its checksum. `load` then writes the log afresh
(one entry per stream: temporary file, fsync, rename, directory fsync), as `save_all`
does whenever the log has grown COMPACT_FACTOR times past what it holds. Files of the
earlier layout (`<stream name in hex>.acceptor`, one per stream) are read, taken into
that fresh log and removed.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import xxhash

LOG_NAME = "acceptors.log"
LEGACY_SUFFIX = ".acceptor"  # the earlier layout: one file per stream
_HEADER = struct.Struct(">IQ")  # body length, xxh3_64 of the body
_NAME_LENGTH = struct.Struct(">H")
COMPACT_MIN_BYTES = 1 << 20  # a log below this is never rewritten by `save_all`
COMPACT_FACTOR = 4  # rewritten once this many times larger than one entry per stream


def _entry_bytes(stream: str, record: bytes) -> int:
    return _HEADER.size + _NAME_LENGTH.size + len(stream.encode()) + len(record)


def _entry(stream: str, record: bytes) -> bytes:
    name = stream.encode()
    body = _NAME_LENGTH.pack(len(name)) + name + record
    return _HEADER.pack(len(body), xxhash.xxh3_64_intdigest(body)) + body


def _entries(data: bytes) -> Iterator[tuple[str, bytes]]:
    """The (stream, record) entries of a log, up to the first torn or corrupt one."""
    at = 0
    while at + _HEADER.size <= len(data):
        length, check = _HEADER.unpack_from(data, at)
        body = data[at + _HEADER.size : at + _HEADER.size + length]
        if len(body) < length or xxhash.xxh3_64_intdigest(body) != check:
            return
        if length < _NAME_LENGTH.size:
            return
        (name_length,) = _NAME_LENGTH.unpack_from(body)
        try:
            stream = body[_NAME_LENGTH.size : _NAME_LENGTH.size + name_length].decode()
        except UnicodeDecodeError:
            return
        yield stream, body[_NAME_LENGTH.size + name_length :]
        at += _HEADER.size + length


class AcceptorFiles:
    """The acceptor records of one relay, in `directory` (created when missing). `load`
    before `save_all`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / LOG_NAME
        self._records: dict[str, bytes] = {}  # the last record of each stream
        self._held_bytes = 0  # one entry per stream: what a fresh log takes
        self._log: BinaryIO | None = None
        self._log_bytes = 0

    @classmethod
    def of_relay(cls, data_dir: Path, relay_id: int) -> AcceptorFiles:
        return cls(data_dir / "acceptors" / f"relay-{relay_id}")

    def load(self) -> dict[str, bytes]:
        """Every stream's record (the core validates the contents: an unreadable record
        counts as forgotten); leaves a fresh log holding exactly these."""
        records: dict[str, bytes] = {}
        legacy = sorted(self.directory.glob("*" + LEGACY_SUFFIX))
        for path in legacy:
            try:
                stream = bytes.fromhex(path.name[: -len(LEGACY_SUFFIX)]).decode()
            except ValueError:
                continue  # not a record's name
            records[stream] = path.read_bytes()
        if self.path.exists():
            records.update(_entries(self.path.read_bytes()))
        self._records = dict(records)
        self._rewrite()
        for path in legacy:
            path.unlink(missing_ok=True)
        return records

    def save_all(self, records: Iterable[tuple[str, bytes]]) -> None:
        """Keep every (stream, record) durably, each replacing the stream's record before
        it, with one fsync (raises OSError if the disk refuses)."""
        if self._log is None:
            raise RuntimeError("AcceptorFiles.load must come first")
        data = bytearray()
        for stream, record in records:
            data += _entry(stream, record)
            old = self._records.get(stream)
            if old is not None:
                self._held_bytes -= _entry_bytes(stream, old)
            self._held_bytes += _entry_bytes(stream, record)
            self._records[stream] = record
        if not data:
            return
        self._log.write(data)
        self._log.flush()
        os.fsync(self._log.fileno())
        self._log_bytes += len(data)
        if self._log_bytes > max(COMPACT_MIN_BYTES, COMPACT_FACTOR * self._held_bytes):
            self._rewrite()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _rewrite(self) -> None:
        """Replace the log by one entry per stream, durably, and append from there."""
        data = b"".join(_entry(s, r) for s, r in self._records.items())
        self.close()
        replace_durably(self.path, data)
        self._log = open(self.path, "ab")  # noqa: SIM115 (kept open: appended to)
        self._log_bytes = self._held_bytes = len(data)


def replace_durably(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old or the new contents:
    a temporary file, fsynced, renamed over it, and the directory fsynced."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)
