"""The rolling digest: a hash chain over a stream's timeline.

    D(genesis) = H("relay/genesis/" + stream)
    D(s)       = H(D(previous entry) || seq as 8 bytes big-endian || H(transaction))

H is xxh3 with 128-bit output: a consistency check against lost or reordered messages,
not a MAC. The digest at a point p (which need not be a transaction's seq) is the digest of
the last entry at or below p, so two relays with the same prefix up to p agree at p.
"""

from __future__ import annotations

import struct

import xxhash

from relay.core.messages import Transaction

DIGEST_BYTES = 16

_hash = xxhash.xxh3_128_digest
_SEQ = struct.Struct(">Q")
_LEN = struct.Struct(">I")
_NO_KEY_MARK = 0xFFFF_FFFF
_NO_KEY = _LEN.pack(_NO_KEY_MARK)
# producer seq, the no-key mark, value length: three fields of a keyless content in one
_SEQ_NO_KEY_LEN = struct.Struct(">QII")
# Prefixes the content of a transaction of kind > 0. A kind-0 content starts with the
# producer id's 4-byte length (< 2**24), never with 0xff, so no two contents coincide, and
# kind-0 hashes are what they were before kinds existed.
_KIND_MARK = b"\xff\xff\xff\xfe"


def genesis(stream: str) -> bytes:
    return _hash(b"relay/genesis/" + stream.encode())


def tx_hash(tx: Transaction) -> bytes:
    """Hash of a transaction's content; fields are length-prefixed so no two differ alike."""
    if tx.key is None and not tx.kind:
        # The common shape in one pack less and one join of four (every relay hashes
        # every transaction): the same bytes as below.
        value = tx.value
        return _hash(
            b"".join(
                (
                    _LEN.pack(len(tx.producer_id)),
                    tx.producer_id,
                    _SEQ_NO_KEY_LEN.pack(tx.producer_seq, _NO_KEY_MARK, len(value)),
                    value,
                )
            )
        )
    key = _NO_KEY if tx.key is None else _LEN.pack(len(tx.key)) + tx.key
    return _hash(
        b"".join(
            (
                _KIND_MARK + bytes((tx.kind,)) if tx.kind else b"",
                _LEN.pack(len(tx.producer_id)),
                tx.producer_id,
                _SEQ.pack(tx.producer_seq),
                key,
                _LEN.pack(len(tx.value)),
                tx.value,
            )
        )
    )


def chain(previous: bytes, seq: int, content_hash: bytes) -> bytes:
    return _hash(previous + _SEQ.pack(seq) + content_hash)


def chain_over(previous: bytes, entries: list[tuple[int, Transaction]]) -> bytes:
    """The digest after appending `entries` (in seq order) to a prefix ending in `previous`."""
    digest = previous
    for seq, tx in entries:
        digest = chain(digest, seq, tx_hash(tx))
    return digest
