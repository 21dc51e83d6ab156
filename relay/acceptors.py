"""A relay's acceptor memory on disk (docs/protocol.md 5.12): per stream, the record the
core asked to keep (`Ready.acceptors`), so that a restarted relay takes part in the next
view change at once instead of abstaining from it.

One file per stream under `<data_dir>/acceptors/relay-<id>/`, named by the stream name in
hex (any stream name gives a safe file name). A record replaces the one before it
atomically: written to a temporary file, fsynced, renamed over the old one, and the
directory fsynced, all before the relay sends the answer that counts on it. View changes
are rare (a member lost or admitted), so this is never on the path of a produce.
"""

from __future__ import annotations

import os
from pathlib import Path

SUFFIX = ".acceptor"


class AcceptorFiles:
    """The acceptor records of one relay, in `directory` (created when missing)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    @classmethod
    def of_relay(cls, data_dir: Path, relay_id: int) -> AcceptorFiles:
        return cls(data_dir / "acceptors" / f"relay-{relay_id}")

    def load(self) -> dict[str, bytes]:
        """Every stream's record; a file whose name is not a stream's is skipped (the core
        validates the contents: an unreadable record counts as forgotten)."""
        records: dict[str, bytes] = {}
        for path in sorted(self.directory.glob("*" + SUFFIX)):
            try:
                stream = bytes.fromhex(path.name[: -len(SUFFIX)]).decode()
            except ValueError:
                continue
            records[stream] = path.read_bytes()
        return records

    def save(self, stream: str, record: bytes) -> None:
        """Replace the stream's record durably (raises OSError if the disk refuses)."""
        replace_durably(self.directory / (stream.encode().hex() + SUFFIX), record)


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
