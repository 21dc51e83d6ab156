"""Versioned metadata kept by the mesh itself: a small key/value service with
compare-and-set (docs/metadata.md).

Metadata lives in one ordinary stream, `METADATA_STREAM`, served by every relay, so it is
replicated, committed, spooled and stored like any other stream. Each of its transactions
(kind `KIND_META`) is one operation: write or delete a key, on condition that the key's
version is the one the writer expects. The state is the fold of the committed operations
in seq order (`MetaState.apply`): an operation whose expected version matches is applied,
one that does not changes nothing (`bad_version`). Every relay folds the same committed
sequence, so every relay reaches the same state at the same seq, and a compare-and-set is
linearizable at its commit: the log is the order.

A key's version is the seq of the committed operation that last wrote it (0: the key does
not exist), so versions are unique across keys and grow with time.

`MetaView` keeps one relay's fold up to date from its core's committed records; it can
answer only when it folded the stream from its genesis without a gap (`complete`).
"""

from __future__ import annotations

import enum
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from relay.core import RelayCore
from relay.core.digest import genesis
from relay.core.state import GENESIS_POINT
from relay.errors import FieldError

__all__ = [
    "ABSENT",
    "ANY_VERSION",
    "KIND_META",
    "METADATA_STREAM",
    "MetaOp",
    "MetaResult",
    "MetaState",
    "MetaView",
    "Versioned",
    "decode_op",
    "encode_op",
    "guarded_key",
]

METADATA_STREAM = "_relay.meta"  # served by every relay of a topology
KIND_META = 2  # a transaction's kind: one metadata operation (docs/store.md lists kinds)
ABSENT = 0  # expected version: the key must not exist (also the version of a missing key)
ANY_VERSION = -1  # expected version: whatever the key holds (an unconditional write)
MAX_META_KEY_BYTES = 512
MAX_META_VALUE_BYTES = 64 * 1024
META_OUTCOMES_MAX = 100_000  # outcomes of the latest operations a view remembers
META_LIST_MAX = 10_000  # keys one list answer carries at most
META_FEED_MAX = 4_096  # committed records folded per pull from the core
META_FORMAT = 1  # the first element of every encoded operation
OP_WRITE = 0
OP_DELETE = 1
OP_READ = 2  # changes nothing: a barrier a linearizable read waits for (docs/metadata.md)
# The key the client library's read barrier names (relay.client.Metadata): such a barrier
# needs only some metadata right, so its outcome names no key and carries no version
# (`guarded_key`): it must tell a client nothing about keys it may not read.
READ_BARRIER_KEY = "reads"
MAX_U63 = 2**63 - 1


class InvalidMetaOp(FieldError):
    """A metadata operation that does not decode or breaks a bound; names the problem."""


@dataclass(frozen=True, slots=True)
class Versioned:
    """A key's value and its version (the seq of the operation that last wrote it)."""

    key: str
    version: int
    value: bytes


@dataclass(frozen=True, slots=True)
class MetaOp:
    op: int  # OP_WRITE, OP_DELETE or OP_READ
    key: str
    expected_version: int  # ABSENT, ANY_VERSION or a version
    value: bytes | None  # None for a delete


class Result(enum.Enum):
    APPLIED = "applied"
    BAD_VERSION = "bad_version"  # the key's version was not the one expected
    INVALID = "invalid"  # not a metadata operation: changes nothing


@dataclass(frozen=True, slots=True)
class MetaResult:
    """What the operation committed at `seq` did. `version`: the key's version after it
    (applied) or the version it found (bad_version); `detail` says why for invalid.
    `key` is "" (and `version` ABSENT) for what names no key: the client library's read
    barrier (`guarded_key`) and what is invalid."""

    seq: int
    result: Result
    key: str
    version: int
    detail: str = ""


def check_key(key: object) -> str:
    if (
        not isinstance(key, str)
        or not key
        or len(key.encode()) > MAX_META_KEY_BYTES
        or "\x00" in key
    ):
        raise InvalidMetaOp(
            f"a metadata key is a string of 1..{MAX_META_KEY_BYTES} UTF-8 bytes without NUL, "
            f"not {key!r:.80}"
        )
    return key


def check_version(version: object, name: str = "expected_version") -> int:
    if type(version) is not int or not ANY_VERSION <= version <= MAX_U63:
        raise InvalidMetaOp(
            f"{name} is ABSENT (0), ANY_VERSION (-1) or a version (a seq), not {version!r:.80}"
        )
    return version


def _is_int(value: object, expected: int) -> bool:
    return type(value) is int and value == expected


def guarded_key(op: MetaOp) -> str:
    """The key whose `metadata` right `op` needs, and the key its outcome names; "": any
    metadata right. Only the client library's barrier (OP_READ on READ_BARRIER_KEY) is "":
    every client with a metadata right must be able to read linearizably, and its outcome
    then carries no version. A barrier on another key carries that key's version (a
    commit seq, so a time), so it needs the right on that key, as a write does."""
    return "" if op.op == OP_READ and op.key == READ_BARRIER_KEY else op.key


def encode_op(op: MetaOp) -> bytes:
    """The transaction value of `op`, checked first (InvalidMetaOp)."""
    check_key(op.key)
    check_version(op.expected_version)
    if type(op.op) is not int:
        raise InvalidMetaOp(f"op is an int, not {type(op.op).__name__}")
    if op.op == OP_WRITE:
        if not isinstance(op.value, bytes) or len(op.value) > MAX_META_VALUE_BYTES:
            raise InvalidMetaOp(
                f"a metadata value is bytes of at most {MAX_META_VALUE_BYTES}, "
                f"not {type(op.value).__name__} of {len(op.value or b'')}"
            )
    elif op.op not in (OP_DELETE, OP_READ) or op.value is not None:
        raise InvalidMetaOp(
            f"op is {OP_WRITE} (write, with a value), {OP_DELETE} (delete) or {OP_READ} (read)"
        )
    packed: bytes = msgpack.packb(
        [META_FORMAT, op.op, op.key, op.expected_version, op.value], use_bin_type=True
    )
    return packed


def decode_op(value: bytes) -> MetaOp:
    """The operation in a transaction value; InvalidMetaOp naming the problem otherwise."""
    try:
        raw: Any = msgpack.unpackb(value, raw=False, strict_map_key=True, max_bin_len=len(value))
    except Exception as e:
        raise InvalidMetaOp(f"not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) != 5 or not _is_int(raw[0], META_FORMAT):
        raise InvalidMetaOp(f"expected [{META_FORMAT}, op, key, expected_version, value]")
    _, op, key, expected, data = raw
    if not any(_is_int(op, known) for known in (OP_WRITE, OP_DELETE, OP_READ)):
        # (exactly an int: 2.0 or True compare equal to an op, and are not one)
        raise InvalidMetaOp(
            f"op is {OP_WRITE} (write), {OP_DELETE} (delete) or {OP_READ} (read), not {op!r:.20}"
        )
    meta = MetaOp(op, check_key(key), check_version(expected), data)
    if op == OP_WRITE and isinstance(data, bytes) and len(data) <= MAX_META_VALUE_BYTES:
        return meta
    if op in (OP_DELETE, OP_READ) and data is None:
        return meta
    raise InvalidMetaOp(
        f"op {op!r:.20} with a {type(data).__name__} value: a write carries bytes of at most "
        f"{MAX_META_VALUE_BYTES}, a delete or read none"
    )


class MetaState:
    """The fold of committed metadata operations, in seq order."""

    def __init__(self, outcomes_max: int = META_OUTCOMES_MAX) -> None:
        self.items: dict[str, Versioned] = {}
        self.applied = -1  # the last seq folded
        # Outcomes at or below this point are not known here (the state was installed from
        # a peer's copy as of it, section 3 of docs/metadata.md); -1: all are.
        self.outcomes_from = -1
        self._outcomes: OrderedDict[int, MetaResult] = OrderedDict()
        self._outcomes_max = outcomes_max

    def apply(self, seq: int, kind: int, value: bytes, duplicate: bool) -> MetaResult | None:
        """Fold the committed entry at `seq` (ascending). A duplicate (a producer's retry
        of an operation already committed) changes nothing and has no outcome of its own:
        its producer is answered with the seq of the first copy."""
        if seq <= self.applied:
            raise ValueError(f"seq {seq} folded out of order (after {self.applied})")
        self.applied = seq
        if duplicate:
            return None
        if kind != KIND_META:
            outcome = MetaResult(seq, Result.INVALID, "", 0, f"kind {kind}, not {KIND_META}")
        else:
            try:
                op = decode_op(value)
            except InvalidMetaOp as e:
                outcome = MetaResult(seq, Result.INVALID, "", 0, str(e))
            else:
                outcome = self._cas(seq, op)
        self._outcomes[seq] = outcome
        if len(self._outcomes) > self._outcomes_max:
            self._outcomes.popitem(last=False)
        return outcome

    def _cas(self, seq: int, op: MetaOp) -> MetaResult:
        held = self.items.get(op.key)
        current = ABSENT if held is None else held.version
        if op.op == OP_READ:  # the library's barrier names no key: no version either
            key = guarded_key(op)
            return MetaResult(seq, Result.APPLIED, key, current if key else ABSENT)
        expected = op.expected_version
        if op.op == OP_DELETE and held is None:
            return MetaResult(seq, Result.BAD_VERSION, op.key, ABSENT, "no such key")
        if expected != ANY_VERSION and expected != current:
            return MetaResult(seq, Result.BAD_VERSION, op.key, current)
        if op.op == OP_DELETE:
            del self.items[op.key]
            return MetaResult(seq, Result.APPLIED, op.key, ABSENT)
        assert op.value is not None  # decode_op: a write carries a value
        self.items[op.key] = Versioned(op.key, seq, op.value)
        return MetaResult(seq, Result.APPLIED, op.key, seq)

    def get(self, key: str) -> Versioned | None:
        return self.items.get(key)

    def list(
        self,
        prefix: str,
        limit: int = META_LIST_MAX,
        visible: Callable[[str], bool] | None = None,
    ) -> list[Versioned]:
        """The keys starting with `prefix` (and `visible`, if given), in key order, at most
        `limit`."""
        found = sorted(
            k for k in self.items if k.startswith(prefix) and (visible is None or visible(k))
        )
        return [self.items[k] for k in found[:limit]]

    def outcome(self, seq: int) -> MetaResult | None:
        """What the operation committed at `seq` did, while remembered (None after)."""
        return self._outcomes.get(seq)

    @property
    def oldest_outcome(self) -> int:
        """The oldest seq whose outcome is remembered (-1: none)."""
        return next(iter(self._outcomes), -1)


class MetaView:
    """One relay's fold of METADATA_STREAM, pulled from its core's committed records.
    `complete` while the fold started at the stream's genesis and missed nothing: a relay
    that joined above the genesis (a restart, a late start), or whose buffer evicted
    records before they were folded, cannot know the state and says so (`gap`)."""

    def __init__(self) -> None:
        self.state = MetaState()
        self.started = False  # the first records were folded from the genesis
        self.gap = ""  # why the fold is not complete ("" while it is)

    @property
    def complete(self) -> bool:
        return self.started and not self.gap

    def install(self, items: list[Versioned], as_of: int, core: RelayCore) -> bool:
        """Take a peer's fold as of its committed point `as_of` (relay/metasync.py), if
        this relay holds every committed record after it: then folding those completes
        the view. False (nothing changed) if its buffer starts above `as_of`."""
        base, _, _ = core.committed_records(METADATA_STREAM, as_of, 1)
        if base < 0 or base > as_of:
            return False
        state = MetaState()
        state.items = {item.key: item for item in items}
        state.applied = state.outcomes_from = as_of
        self.state, self.started, self.gap = state, True, ""
        self.feed(core)
        return True

    def feed(self, core: RelayCore) -> None:
        """Fold what the core committed since the last call."""
        if self.gap:
            return
        state = self.state
        while True:
            base, base_digest, records = core.committed_records(
                METADATA_STREAM, state.applied, META_FEED_MAX
            )
            if base < 0:
                return  # not joined yet
            if not self.started:
                if base != GENESIS_POINT or base_digest != genesis(METADATA_STREAM):
                    self.gap = f"this relay's history of it starts at seq {base}, not the genesis"
                    return
                self.started = True
                state.applied = max(state.applied, GENESIS_POINT)
            elif base > state.applied:  # evicted or rebased past what was folded
                self.gap = f"records after seq {state.applied} left the buffer unfolded"
                return
            if not records:
                return
            for seq, _, tx, duplicate in records:
                state.apply(seq, tx.kind, tx.value, duplicate)
            if len(records) < META_FEED_MAX:
                return


# --- durable consumers' marks -------------------------------------------------------------

MARKS_PREFIX = "consumers/"  # a mark's key: consumers/<durable name>/<stream>
DURABLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MARK_FORMAT = 1


def check_durable_name(name: object) -> str:
    if not isinstance(name, str) or DURABLE_NAME.fullmatch(name) is None:
        raise ValueError(
            "a durable consumer's name is 1..64 letters, digits, '_', '.' or '-', starting "
            f"with a letter or digit, not {name!r:.80}"
        )
    return name


def mark_key(name: str, stream: str) -> str:
    """The metadata key of durable consumer `name`'s mark on `stream`."""
    return f"{MARKS_PREFIX}{check_durable_name(name)}/{stream}"


def split_mark_key(key: str) -> tuple[str, str] | None:
    """(durable name, stream) of a mark's key; None for another key."""
    if not key.startswith(MARKS_PREFIX):
        return None
    name, sep, stream = key[len(MARKS_PREFIX) :].partition("/")
    return (name, stream) if sep and stream and DURABLE_NAME.fullmatch(name) else None


@dataclass(frozen=True, slots=True)
class Mark:
    """A durable consumer's mark on a stream: its position (`seq`: the records after it
    are next; None: nothing stored yet) and the lease on it: the instance holding it
    (`holder`, "" when none does) and how long a lease lasts without renewal."""

    seq: int | None
    holder: str = ""
    ttl_ms: int = 0


MAX_HOLDER_CHARS = 200
MAX_LEASE_TTL_MS = 24 * 3_600_000


def encode_mark(mark: Mark) -> bytes:
    packed: bytes = msgpack.packb([MARK_FORMAT, mark.seq, mark.holder, mark.ttl_ms])
    return packed


def decode_mark(value: bytes) -> Mark:
    try:
        raw: Any = msgpack.unpackb(value)
    except Exception:
        raw = None
    if (
        isinstance(raw, list)
        and len(raw) == 4
        and _is_int(raw[0], MARK_FORMAT)
        and (raw[1] is None or (type(raw[1]) is int and -1 <= raw[1] <= MAX_U63))
        and isinstance(raw[2], str)
        and len(raw[2]) <= MAX_HOLDER_CHARS
        and type(raw[3]) is int
        and 0 <= raw[3] <= MAX_LEASE_TTL_MS
    ):
        return Mark(raw[1], raw[2], raw[3])
    raise InvalidMetaOp(f"not a consumer mark: {value[:80]!r}")
