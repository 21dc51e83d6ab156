"""Synthetic committed records with correct chains, and the spools of several relays
holding them in overlapping segments: for the tests and `scripts/bench_store.py`."""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass, field, fields

import pyarrow as pa  # type: ignore[import-untyped]

from relay.core.digest import chain, genesis, tx_hash
from relay.core.messages import Transaction
from relay.segment import (
    segment_name,
    segment_table,
    stream_dir_name,
    to_signed64,
    write_segment_file,
)
from relay.spool import SpoolRecord
from relay.store.changes import KIND_CHANGES, KIND_PLAIN, Change, Op, encode_changes

# Sequence numbers start here and grow by a random step, like k-sorted relay seqs.
FIRST_SEQ = 1 << 40
SEQ_STEP_MAX = 1 << 12


@dataclass(slots=True)
class StreamRecords:
    """One stream's committed records, column by column, in seq order."""

    stream: str
    seqs: list[int]
    digests: list[bytes]
    producer_ids: list[bytes]
    producer_seqs: list[int]
    keys: list[bytes | None]
    values: list[bytes]
    kinds: list[int]
    duplicates: list[bool]

    def __len__(self) -> int:
        return len(self.seqs)

    def slice(self, start: int, stop: int) -> StreamRecords:
        """Records [start, stop): what a relay spooled of the stream, for example."""
        columns = [f.name for f in fields(self) if f.name != "stream"]
        return StreamRecords(self.stream, *(getattr(self, c)[start:stop] for c in columns))

    def table(self, relay: int, start: int = 0, stop: int | None = None) -> pa.Table:
        """Rows [start, stop) as a spool segment of `relay`."""
        stop = len(self.seqs) if stop is None else stop
        return segment_table(
            self.stream,
            relay,
            self.seqs[start:stop],
            self.digests[start:stop],
            self.producer_ids[start:stop],
            [to_signed64(s) for s in self.producer_seqs[start:stop]],
            self.keys[start:stop],
            self.values[start:stop],
            self.kinds[start:stop],
            self.duplicates[start:stop],
        )

    def records(self, start: int = 0, stop: int | None = None) -> list[SpoolRecord]:
        """Spool records (seq, digest, producer_id, producer_seq, key, value, kind, dup)."""
        return list(
            zip(
                self.seqs[start:stop],
                self.digests[start:stop],
                self.producer_ids[start:stop],
                self.producer_seqs[start:stop],
                self.keys[start:stop],
                self.values[start:stop],
                self.kinds[start:stop],
                self.duplicates[start:stop],
                strict=True,
            )
        )


def generate(
    stream: str,
    count: int,
    *,
    seed: int = 0,
    keys: int = 1000,
    value_bytes: int = 100,
    changes_every: int = 5,
    duplicate_every: int = 50,
    first_seq: int = FIRST_SEQ,
    previous_digest: bytes | None = None,
    first_index: int = 0,
) -> StreamRecords:
    """`count` committed records: mostly plain puts over `keys` keys, every
    `changes_every`-th a change list (puts and deletes over two entity types), every
    `duplicate_every`-th a duplicate of the transaction before it. A long stream is made
    in chunks: each continues the last (`first_seq`, `previous_digest`) and record index
    (`first_index`) of the one before."""
    rng = random.Random(
        f"{stream}/{seed}" if first_index == 0 else f"{stream}/{seed}/{first_index}"
    )
    out = StreamRecords(stream, [], [], [], [], [], [], [], [])
    digest = genesis(stream) if previous_digest is None else previous_digest
    seq = first_seq
    producer_seq = first_index  # producer seqs grow by at most 1 per record: no overlap
    filler = b"v" * max(0, value_bytes - 16)
    for index in range(first_index, first_index + count):
        seq += rng.randint(1, SEQ_STEP_MAX)
        duplicate = duplicate_every > 0 and index % duplicate_every == duplicate_every - 1
        if duplicate and out.seqs:
            producer_id, tx_seq = out.producer_ids[-1], out.producer_seqs[-1]
            key, value, kind = out.keys[-1], out.values[-1], out.kinds[-1]
        else:
            duplicate = False
            producer_seq += 1
            producer_id, tx_seq = f"p{rng.randint(0, 3)}".encode(), producer_seq
            if changes_every > 0 and index % changes_every == changes_every - 1:
                kind, key = KIND_CHANGES, None
                value = encode_changes(
                    [_random_change(rng, keys, index) for _ in range(rng.randint(1, 3))]
                )
            else:
                kind = KIND_PLAIN
                key = b"k%d" % rng.randrange(keys)
                value = b"%016d" % index + filler
        digest = chain(digest, seq, tx_hash(Transaction(producer_id, tx_seq, key, value, kind)))
        out.seqs.append(seq)
        out.digests.append(digest)
        out.producer_ids.append(producer_id)
        out.producer_seqs.append(tx_seq)
        out.keys.append(key)
        out.values.append(value)
        out.kinds.append(kind)
        out.duplicates.append(duplicate)
    return out


def _random_change(rng: random.Random, keys: int, index: int) -> Change:
    entity = rng.choice(("order", "customer"))
    key = b"k%d" % rng.randrange(keys)
    if rng.random() < 0.3:
        return Change(entity, key, Op.DELETE, None)
    return Change(entity, key, Op.PUT, b"c%d" % index)


def write_spools(
    spool_root: str,
    streams: list[StreamRecords],
    *,
    relays: int = 3,
    segment_records: int = 10_000,
) -> int:
    """Each relay spools every record, its segment boundaries shifted from the others'
    (relay r starts with a segment of r * segment_records / relays records), so segments
    of different relays overlap. Returns the number of segment files written."""
    written = 0
    for relay in range(relays):
        for records in streams:
            folder = os.path.join(spool_root, f"relay={relay}", stream_dir_name(records.stream))
            os.makedirs(folder, exist_ok=True)
            bounds = [0]
            shift = relay * segment_records // relays
            if shift:
                bounds.append(min(shift, len(records)))
            while bounds[-1] < len(records):
                bounds.append(min(bounds[-1] + segment_records, len(records)))
            for start, stop in itertools.pairwise(bounds):
                if start == stop:
                    continue
                name = segment_name(records.seqs[start], records.seqs[stop - 1])
                write_segment_file(records.table(relay, start, stop), os.path.join(folder, name))
                written += 1
    return written


def write_spools_in_chunks(
    spool_root: str,
    streams: dict[str, int],
    *,
    relays: int = 3,
    segment_records: int = 10_000,
    chunk_records: int = 50_000,
) -> tuple[int, dict[str, tuple[int, bytes]]]:
    """What `write_spools` writes for `generate(stream, count, seed=i)` streams (`streams`:
    name -> count, seed = position), made and written `chunk_records` at a time so memory
    stays bounded whatever the count. Returns the number of segment files written and each
    stream's last (seq, digest)."""
    written = 0
    last_points = {}
    for seed, (stream, count) in enumerate(streams.items()):
        segmenters = [
            _RelaySegmenter(
                os.path.join(spool_root, f"relay={relay}", stream_dir_name(stream)),
                relay,
                relay * segment_records // relays,
                segment_records,
            )
            for relay in range(relays)
        ]
        last_seq, last_digest = FIRST_SEQ, genesis(stream)
        for first_index in range(0, count, chunk_records):
            chunk = generate(
                stream,
                min(chunk_records, count - first_index),
                seed=seed,
                first_seq=last_seq,
                previous_digest=last_digest,
                first_index=first_index,
            )
            last_seq, last_digest = chunk.seqs[-1], chunk.digests[-1]
            for segmenter in segmenters:
                written += segmenter.add(chunk.table(segmenter.relay))
        written += sum(segmenter.close() for segmenter in segmenters)
        last_points[stream] = (last_seq, last_digest)
    return written, last_points


@dataclass(slots=True)
class _RelaySegmenter:
    """Cuts one relay's copy of a stream into segments as `write_spools` does (a first
    segment of `shift` records, then `segment_records` each), from chunks of rows."""

    folder: str
    relay: int
    shift: int
    segment_records: int
    pending: list[pa.Table] = field(default_factory=list)
    pending_rows: int = 0
    pending_first_index: int = 0  # the stream index of the first pending row

    def add(self, rows: pa.Table) -> int:
        self.pending.append(rows)
        self.pending_rows += rows.num_rows
        written = 0
        while self.pending_first_index + self.pending_rows >= self._segment_end():
            written += self._write(self._segment_end() - self.pending_first_index)
        return written

    def close(self) -> int:
        return self._write(self.pending_rows) if self.pending_rows else 0

    def _segment_end(self) -> int:
        """The stream index just after the segment holding the first pending row."""
        first = self.pending_first_index
        if first < self.shift:
            return self.shift
        return (
            self.shift + ((first - self.shift) // self.segment_records + 1) * self.segment_records
        )

    def _write(self, rows: int) -> int:
        table = pa.concat_tables(self.pending)
        segment, rest = table.slice(0, rows), table.slice(rows)
        os.makedirs(self.folder, exist_ok=True)
        seqs = segment.column("seq")
        name = segment_name(seqs[0].as_py(), seqs[-1].as_py())
        write_segment_file(segment, os.path.join(self.folder, name))
        self.pending = [rest] if rest.num_rows else []
        self.pending_rows = rest.num_rows
        self.pending_first_index += rows
        return 1
