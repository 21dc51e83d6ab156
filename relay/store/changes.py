"""The transaction model of the store: a transaction carries one or more changes.

A change is (entity type, key, op, value): `put` sets the value of (entity, key), `delete`
removes it. A transaction's `kind` says how its value is read:

    KIND_PLAIN (0)    the value itself: one put of (entity "", the tx key or b"", value)
    KIND_CHANGES (1)  the value is an encoded change list (`encode_changes`)

Encoding: one msgpack array `[FORMAT_VERSION, [[entity, key, op, value], ...]]` with op
0 = put, 1 = delete and value nil for a delete. `decode_changes` is where producers' bytes
enter the store: it checks every field and raises `InvalidChanges` naming the change and
the problem, never an exception from inside msgpack.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack

from relay.store.errors import InvalidChanges

KIND_PLAIN = 0
KIND_CHANGES = 1
KINDS = (KIND_PLAIN, KIND_CHANGES)

FORMAT_VERSION = 1
# Bounds of one change list; a relay's frame limit bounds the whole value anyway.
MAX_CHANGES_PER_TX = 10_000
MAX_ENTITY_BYTES = 255
MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 16 * 1024 * 1024
MAX_ENCODED_BYTES = 64 * 1024 * 1024

PLAIN_ENTITY = ""


class Op(enum.IntEnum):
    PUT = 0
    DELETE = 1


@dataclass(frozen=True, slots=True)
class Change:
    entity: str
    key: bytes
    op: Op
    value: bytes | None = None


def _check(change: Change, index: int) -> None:
    where = f"change {index}"
    if not isinstance(change.entity, str):
        raise InvalidChanges(f"{where}: entity must be a str, got {type(change.entity).__name__}")
    if len(change.entity.encode()) > MAX_ENTITY_BYTES:
        raise InvalidChanges(f"{where}: entity longer than {MAX_ENTITY_BYTES} bytes")
    if not isinstance(change.key, bytes):
        raise InvalidChanges(f"{where}: key must be bytes, got {type(change.key).__name__}")
    if len(change.key) > MAX_KEY_BYTES:
        raise InvalidChanges(f"{where}: key of {len(change.key)} bytes > {MAX_KEY_BYTES}")
    if change.op not in (Op.PUT, Op.DELETE):
        raise InvalidChanges(f"{where}: op must be put (0) or delete (1), got {change.op!r}")
    if change.op == Op.PUT:
        if not isinstance(change.value, bytes):
            raise InvalidChanges(f"{where}: a put needs a bytes value, got {change.value!r:.40}")
        if len(change.value) > MAX_VALUE_BYTES:
            raise InvalidChanges(f"{where}: value of {len(change.value)} bytes > {MAX_VALUE_BYTES}")
    elif change.value is not None:
        raise InvalidChanges(f"{where}: a delete carries no value")


def encode_changes(changes: list[Change]) -> bytes:
    """The value of a KIND_CHANGES transaction. Raises InvalidChanges on a bad change."""
    if not 1 <= len(changes) <= MAX_CHANGES_PER_TX:
        raise InvalidChanges(
            f"a transaction carries 1..{MAX_CHANGES_PER_TX} changes, got {len(changes)}"
        )
    for index, change in enumerate(changes):
        _check(change, index)
    encoded: bytes = msgpack.packb(
        [FORMAT_VERSION, [[c.entity, c.key, int(c.op), c.value] for c in changes]],
        use_bin_type=True,
    )
    if len(encoded) > MAX_ENCODED_BYTES:
        raise InvalidChanges(f"encoded change list of {len(encoded)} bytes > {MAX_ENCODED_BYTES}")
    return encoded


def decode_changes(encoded: bytes) -> list[Change]:
    """The changes of a KIND_CHANGES value; InvalidChanges names what is wrong."""
    if len(encoded) > MAX_ENCODED_BYTES:
        raise InvalidChanges(f"encoded change list of {len(encoded)} bytes > {MAX_ENCODED_BYTES}")
    try:
        document: Any = msgpack.unpackb(
            encoded, raw=False, strict_map_key=True, max_array_len=MAX_CHANGES_PER_TX
        )
    except Exception as error:  # msgpack raises many types for bad input
        raise InvalidChanges(f"change list is not valid msgpack: {error}") from None
    if not (isinstance(document, list) and len(document) == 2):
        raise InvalidChanges("change list must be an array [version, changes]")
    version, items = document
    if version != FORMAT_VERSION:
        raise InvalidChanges(f"change list format version {version!r} unknown (want 1)")
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_CHANGES_PER_TX:
        raise InvalidChanges(f"change list must hold 1..{MAX_CHANGES_PER_TX} changes")
    changes = []
    for index, item in enumerate(items):
        if not (isinstance(item, list) and len(item) == 4):
            raise InvalidChanges(f"change {index}: must be an array [entity, key, op, value]")
        entity, key, op, value = item
        if not isinstance(op, int) or isinstance(op, bool) or op not in (Op.PUT, Op.DELETE):
            raise InvalidChanges(f"change {index}: op must be 0 (put) or 1 (delete), got {op!r}")
        change = Change(entity, key, Op(op), value)
        _check(change, index)
        changes.append(change)
    return changes


def changes_of(kind: int, key: bytes | None, value: bytes) -> list[Change]:
    """The changes a committed transaction makes, by its kind."""
    if kind == KIND_PLAIN:
        return [Change(PLAIN_ENTITY, b"" if key is None else key, Op.PUT, value)]
    if kind == KIND_CHANGES:
        return decode_changes(value)
    raise InvalidChanges(f"transaction kind {kind!r} unknown (known: {KINDS})")
