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
_NO_KEY_MARK = 0xFFFF_FFFF  # in place of a key's length: no key
_SEQ_NO_KEY_LEN = struct.Struct(">QII")  # producer seq, the no-key mark, value length
_SEQ_LEN = struct.Struct(">QI")  # producer seq, key length
# Prefixes the content of a transaction of kind > 0. A kind-0 content starts with the
# producer id's 4-byte length (< 2**24), never with 0xff, so no two contents coincide, and
# kind-0 hashes are what they were before kinds existed.
_KIND_MARK = b"\xff\xff\xff\xfe"


def genesis(stream: str) -> bytes:
    return _hash(b"relay/genesis/" + stream.encode())


def tx_hash(tx: Transaction) -> bytes:
    """Hash of a transaction's content; fields are length-prefixed so no two differ alike.
    (Neighbouring integer fields are packed together: every relay hashes every
    transaction.)"""
    pid, key, value = tx.producer_id, tx.key, tx.value
    if key is None:
        seq_key_len = _SEQ_NO_KEY_LEN.pack(tx.producer_seq, _NO_KEY_MARK, len(value))
        content = b"".join((_LEN.pack(len(pid)), pid, seq_key_len, value))
    else:
        seq_key = _SEQ_LEN.pack(tx.producer_seq, len(key))
        content = b"".join((_LEN.pack(len(pid)), pid, seq_key, key, _LEN.pack(len(value)), value))
    if tx.kind:
        content = _KIND_MARK + bytes((tx.kind,)) + content
    return _hash(content)


def chain(previous: bytes, seq: int, content_hash: bytes) -> bytes:
    return _hash(previous + _SEQ.pack(seq) + content_hash)


def chain_over(previous: bytes, entries: list[tuple[int, Transaction]]) -> bytes:
    """The digest after appending `entries` (in seq order) to a prefix ending in `previous`."""
    digest = previous
    for seq, tx in entries:
        digest = chain(digest, seq, tx_hash(tx))
    return digest
