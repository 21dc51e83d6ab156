"""The spool segment file format: what a relay's spool writes and the store reads.

Spool:  <spool_root>/relay=<id>/stream=<escaped>/<first_seq>-<last_seq>.parquet
        (written as a hidden `.<...>.tmp` file and renamed once complete, so a reader that
        lists only names matching SEGMENT_NAME never sees half a segment)

A segment is one Parquet row group of SEGMENT_SCHEMA (`segment_table`, `write_segment_file`).
The store's own files (`relay.store.manifest`) name their stream folders the same way
(`stream_dir_name`).

Stream names (1..255 UTF-8 bytes, no NUL or '|') are escaped with percent-encoding of
everything but [A-Za-z0-9_.-~], and a leading '.' too, so a name is never a hidden file,
'.' or '..'.

This module imports neither `relay.spool` nor `relay.store`: both build on it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

SEGMENT_SUFFIX = ".parquet"
SEGMENT_NAME = re.compile(r"^(\d{1,19})-(\d{1,19})\.parquet$")
RELAY_DIR = re.compile(r"^relay=(\d{1,4})$")
STREAM_DIR_PREFIX = "stream="
# Parquet settings chosen by measurement (docs/store.md, "Segment format").
SEGMENT_COMPRESSION = "zstd"

# The columns of a spool segment, in order. producer_seq is a u64 on the wire; Parquet and
# Spark have no unsigned 64-bit type, so it is stored as the int64 with the same bits
# (`to_signed64` / `to_unsigned64`).
SEGMENT_SCHEMA = pa.schema(
    [
        pa.field("stream", pa.string(), nullable=False),
        pa.field("relay", pa.int32(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("digest", pa.binary(), nullable=False),
        pa.field("producer_id", pa.binary(), nullable=False),
        pa.field("producer_seq", pa.int64(), nullable=False),
        pa.field("key", pa.binary(), nullable=True),
        pa.field("value", pa.binary(), nullable=False),
        pa.field("kind", pa.int8(), nullable=False),
        pa.field("duplicate", pa.bool_(), nullable=False),
    ]
)

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


def to_signed64(value: int) -> int:
    return value - _U64 if value > _I64_MAX else value


def to_unsigned64(value: int) -> int:
    return value + _U64 if value < 0 else value


def segment_table(
    stream: str,
    relay: int,
    seqs: Sequence[int],
    digests: Sequence[bytes],
    producer_ids: Sequence[bytes],
    producer_seqs: Sequence[int],
    keys: Sequence[bytes | None],
    values: Sequence[bytes],
    kinds: Sequence[int],
    duplicates: Sequence[bool],
) -> pa.Table:
    """The rows of one segment of `relay`'s copy of `stream`, column by column in seq
    order (`producer_seqs` as stored: already `to_signed64`)."""
    count = len(seqs)
    return pa.table(
        [
            pa.array([stream] * count, pa.string()),
            pa.array([relay] * count, pa.int32()),
            pa.array(seqs, pa.int64()),
            pa.array(digests, pa.binary()),
            pa.array(producer_ids, pa.binary()),
            pa.array(producer_seqs, pa.int64()),
            pa.array(keys, pa.binary()),
            pa.array(values, pa.binary()),
            pa.array(kinds, pa.int8()),
            pa.array(duplicates, pa.bool_()),
        ],
        schema=SEGMENT_SCHEMA,
    )


def write_segment_file(table: pa.Table, path: str | os.PathLike[str]) -> None:
    """One segment as one Parquet row group, flushed to disk before it is renamed."""
    with open(path, "wb") as sink:
        pq.write_table(
            table,
            sink,
            compression=SEGMENT_COMPRESSION,
            row_group_size=max(1, table.num_rows),
            use_dictionary=["stream", "relay", "kind", "duplicate"],
            write_statistics=["seq"],
        )
        sink.flush()
        os.fsync(sink.fileno())


def escape_stream(stream: str) -> str:
    escaped = quote(stream, safe="")
    if escaped.startswith("."):
        escaped = "%2E" + escaped[1:]
    return escaped


def unescape_stream(escaped: str) -> str:
    return unquote(escaped)


def stream_dir_name(stream: str) -> str:
    return STREAM_DIR_PREFIX + escape_stream(stream)


def segment_name(first_seq: int, last_seq: int) -> str:
    return f"{first_seq}-{last_seq}{SEGMENT_SUFFIX}"


@dataclass(frozen=True, slots=True, order=True)
class SegmentRef:
    """One closed segment found in a spool."""

    stream: str
    first_seq: int
    last_seq: int
    relay: int
    path: str
    size_bytes: int

    @property
    def ident(self) -> str:
        """Names the segment in the store's list of ingested segments."""
        return f"relay={self.relay}/{segment_name(self.first_seq, self.last_seq)}"


def find_segments(spool_root: str | os.PathLike[str]) -> list[SegmentRef]:
    """Every closed segment of every relay under `spool_root`, sorted by stream and seq."""
    root = Path(spool_root)
    found: list[SegmentRef] = []
    if not root.is_dir():
        return found
    for relay_entry in os.scandir(root):
        relay_match = RELAY_DIR.match(relay_entry.name)
        if not (relay_match and relay_entry.is_dir()):
            continue
        relay = int(relay_match.group(1))
        for stream_entry in os.scandir(relay_entry.path):
            if not (stream_entry.name.startswith(STREAM_DIR_PREFIX) and stream_entry.is_dir()):
                continue
            stream = unescape_stream(stream_entry.name[len(STREAM_DIR_PREFIX) :])
            for segment in os.scandir(stream_entry.path):
                match = SEGMENT_NAME.match(segment.name)
                if not match:
                    continue
                try:
                    size_bytes = segment.stat().st_size
                except FileNotFoundError:  # reclaimed by its relay since the listing
                    continue
                found.append(
                    SegmentRef(
                        stream=stream,
                        first_seq=int(match.group(1)),
                        last_seq=int(match.group(2)),
                        relay=relay,
                        path=segment.path,
                        size_bytes=size_bytes,
                    )
                )
    found.sort()
    return found
