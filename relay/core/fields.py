"""Field validators shared by the peer codec and the client wire protocol: where remote
bytes become values, a bad field raises a named FrameError that says which field, what
was expected and what came."""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated, Any, NoReturn

from msgspec import Meta

from relay.core.digest import DIGEST_BYTES
from relay.core.messages import Entry, Report, Transaction
from relay.core.seq import MAX_RELAY_ID
from relay.errors import FieldError, MalformedFrame

MAX_STREAM_NAME_BYTES = 255
MAX_PRODUCER_ID_BYTES = 64
# A transaction's kind says how its value is to be read (0: one plain value; the store
# defines the others, e.g. a list of changes). The mesh carries it as an opaque byte.
MAX_TX_KIND = 255
MAX_U63 = (1 << 63) - 1  # sequence-like fields
MAX_U64 = (1 << 64) - 1  # producer sequences

# The same bounds as msgspec types, for the frames msgspec decodes in C (codec.FastDecoder).
# A frame msgspec refuses goes through the validators below, which name the bad field.
# (msgspec takes no bound above 2**63-1; a msgpack int never exceeds 2**64-1 anyway.)
U63 = Annotated[int, Meta(ge=0, le=MAX_U63)]
U63OrNone = Annotated[int, Meta(ge=-1, le=MAX_U63)]
U64 = Annotated[int, Meta(ge=0)]
RelayId = Annotated[int, Meta(ge=0, le=MAX_RELAY_ID)]
ProducerId = Annotated[bytes, Meta(min_length=1, max_length=MAX_PRODUCER_ID_BYTES)]
TxKind = Annotated[int, Meta(ge=0, le=MAX_TX_KIND)]
Digest = Annotated[bytes, Meta(min_length=DIGEST_BYTES, max_length=DIGEST_BYTES)]
# An entry as the peer codec carries it: [seq, producer_id, producer_seq, key, value, kind]
WireEntry = tuple[U63, ProducerId, U64, bytes | None, bytes, TxKind]


def show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def bad(name: str, expected: str, value: object) -> NoReturn:
    raise FieldError(f"{name}: expected {expected}, got {show(value)}")


def stream(v: Any, name: str) -> str:
    if (
        type(v) is not str
        or not 0 < len(v) <= MAX_STREAM_NAME_BYTES
        or len(v.encode()) > MAX_STREAM_NAME_BYTES
        or "\x00" in v
        or "|" in v
    ):
        bad(name, f"stream name of 1..{MAX_STREAM_NAME_BYTES} UTF-8 bytes, no NUL or '|'", v)
    return v


def producer_id(v: Any, name: str) -> bytes:
    if type(v) is not bytes or not 0 < len(v) <= MAX_PRODUCER_ID_BYTES:
        bad(name, f"producer id of 1..{MAX_PRODUCER_ID_BYTES} bytes", v)
    return v


def array(v: Any, name: str, length: int | None = None) -> list[Any]:
    if type(v) is not list:
        raise MalformedFrame(f"{name}: expected an array, got {show(v)}")
    if length is not None and len(v) != length:
        raise MalformedFrame(f"{name}: expected an array of {length}, got {len(v)} items")
    return v


def enum(v: Any, table: dict[str, Any], name: str) -> Any:
    found = table.get(v) if type(v) is str else None
    if found is None:
        bad(name, "one of " + ", ".join(sorted(table)), v)
    return found


# --- numbers, digests, transactions, reports (the peer codec) ---------------------------


def relay_id(v: Any, name: str) -> int:
    if type(v) is not int or not 0 <= v <= MAX_RELAY_ID:
        bad(name, f"relay id 0..{MAX_RELAY_ID}", v)
    return v


def relay_ids(v: Any, name: str) -> tuple[int, ...]:
    return tuple(relay_id(r, f"{name}[{i}]") for i, r in enumerate(array(v, name)))


def members(v: Any, name: str) -> tuple[int, ...]:
    """A configuration's relays (docs/protocol.md 5.15): relay ids in ascending order, each
    once (empty: none stated)."""
    ids = relay_ids(v, name)
    if any(a >= b for a, b in pairwise(ids)):
        bad(name, "relay ids in ascending order, each once", v)
    return ids


def u63(v: Any, name: str) -> int:
    if type(v) is not int or not 0 <= v <= MAX_U63:
        bad(name, "int 0..2**63-1", v)
    return v


def u63_or_none(v: Any, name: str) -> int:
    """A sequence-like field where -1 means "none"."""
    if type(v) is not int or not -1 <= v <= MAX_U63:
        bad(name, "int -1..2**63-1", v)
    return v


def u64(v: Any, name: str) -> int:
    if type(v) is not int or not 0 <= v <= MAX_U64:
        bad(name, "int 0..2**64-1", v)
    return v


def boolean(v: Any, name: str) -> bool:
    if type(v) is not bool:
        bad(name, "bool", v)
    return v


def string(v: Any, name: str) -> str:
    if type(v) is not str:
        bad(name, "str", v)
    return v


def frame(v: Any, name: str, max_bytes: int) -> bytes:
    """A whole peer frame carried inside another (5.13 transit); decoded on its own."""
    if type(v) is not bytes or not 0 < len(v) <= max_bytes:
        bad(name, f"1..{max_bytes} bytes", v)
    return v


def digest(v: Any, name: str) -> bytes:
    if type(v) is not bytes or len(v) != DIGEST_BYTES:
        bad(name, f"{DIGEST_BYTES}-byte digest", v)
    return v


def tx_ok(pid: Any, pseq: Any, key: Any, value: Any, kind: Any) -> bool:
    return (
        type(kind) is int
        and 0 <= kind <= MAX_TX_KIND
        and type(pid) is bytes
        and 0 < len(pid) <= MAX_PRODUCER_ID_BYTES
        and type(pseq) is int
        and 0 <= pseq <= MAX_U64
        and (key is None or type(key) is bytes)
        and type(value) is bytes
    )


def bad_tx(pid: Any, pseq: Any, key: Any, value: Any, kind: Any, name: str) -> NoReturn:
    """Raise the FieldError naming the first bad field of a transaction `_tx_ok` refused."""
    producer_id(pid, name + ".producer_id")
    u64(pseq, name + ".producer_seq")
    if key is not None and type(key) is not bytes:
        bad(name + ".key", "bytes or nil", key)
    if type(value) is not bytes:
        bad(name + ".value", "bytes", value)
    bad(name + ".kind", f"integer 0..{MAX_TX_KIND}", kind)


def transaction(v: Any, name: str) -> Transaction:
    pid, pseq, key, value, kind = array(v, name, 5)
    if not tx_ok(pid, pseq, key, value, kind):
        bad_tx(pid, pseq, key, value, kind, name)
    return Transaction(pid, pseq, key, value, kind)


def entries(v: Any, name: str) -> tuple[Entry, ...]:
    # The hot path of decoding: no per-entry calls or string formatting unless a field is bad.
    out: list[Entry] = []
    append = out.append
    for e in array(v, name):
        if type(e) is not list or len(e) != 6:
            array(e, f"{name}[{len(out)}]", 6)
        seq, pid, pseq, key, value, kind = e
        if (
            type(seq) is not int
            or not 0 <= seq <= MAX_U63
            or type(pid) is not bytes
            or not 0 < len(pid) <= MAX_PRODUCER_ID_BYTES
            or type(pseq) is not int
            or not 0 <= pseq <= MAX_U64
            or (key is not None and type(key) is not bytes)
            or type(value) is not bytes
            or type(kind) is not int
            or not 0 <= kind <= MAX_TX_KIND
        ):
            where = f"{name}[{len(out)}]"
            u63(seq, where + ".seq")
            bad_tx(pid, pseq, key, value, kind, where)
        append((seq, Transaction(pid, pseq, key, value, kind)))
    return tuple(out)


def checked_entries(
    raw: list[tuple[int, bytes, int, bytes | None, bytes, int]],
) -> tuple[Entry, ...]:
    """Entries from `WireEntry` tuples msgspec has already checked."""
    return tuple([(s, Transaction(p, q, k, v, d)) for s, p, q, k, v, d in raw])


def reports(v: Any, name: str) -> tuple[Report, ...]:
    # Names are built only for a bad item: a heartbeat may carry thousands (5.8).
    out = []
    for i, r in enumerate(array(v, name)):
        if type(r) is list and len(r) == 2:
            point, value = r
            if (
                type(point) is int
                and 0 <= point <= MAX_U63
                and type(value) is bytes
                and len(value) == DIGEST_BYTES
            ):
                out.append((point, value))
                continue
        point, value = array(r, f"{name}[{i}]", 2)
        u63(point, f"{name}[{i}].point")
        digest(value, f"{name}[{i}].digest")
    return tuple(out)


def acks(v: Any, name: str) -> tuple[tuple[int, int], ...]:
    out = []
    for i, r in enumerate(array(v, name)):
        if type(r) is list and len(r) == 2:
            relay, point = r
            if (
                type(relay) is int
                and 0 <= relay <= MAX_RELAY_ID
                and type(point) is int
                and 0 <= point <= MAX_U63
            ):
                out.append((relay, point))
                continue
        relay, point = array(r, f"{name}[{i}]", 2)
        relay_id(relay, f"{name}[{i}].relay")
        u63(point, f"{name}[{i}].point")
    return tuple(out)
