"""Field validators shared by the peer codec and the client wire protocol: where remote
bytes become values, a bad field raises a named FrameError that says which field, what
was expected and what came."""

from __future__ import annotations

from typing import Any, NoReturn

from relay.errors import FieldError, MalformedFrame

MAX_STREAM_NAME_BYTES = 255
MAX_PRODUCER_ID_BYTES = 64
# A transaction's kind says how its value is to be read (0: one plain value; the store
# defines the others, e.g. a list of changes). The mesh carries it as an opaque byte.
MAX_TX_KIND = 255


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
