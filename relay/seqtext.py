"""Seqs as text: how they leave in JSON and enter from command lines and JSON.

A seq is a 63-bit integer (relay/core/seq.py), about 3.8e17 today: above 2**53, where a
JSON reader that keeps numbers as doubles (JavaScript, `jq`) rounds it, and a rounded seq
given back as a position silently skips records. So every JSON document the `relay`
command prints carries seqs as decimal strings (`"seq": "383315973454696481"`, as APIs
with large ids do), and every place a seq comes in takes that string (or a number).

`seqs_as_text(doc)` turns the seq fields of a document (`SEQ_FIELDS`, at any depth) into
strings; `parse_seq` reads one back, naming the problem when it is no seq.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relay.core.seq import MAX_SEQ

__all__ = ["NO_SEQ", "SEQ_FIELDS", "parse_seq", "seq_text", "seqs_as_text"]

NO_SEQ = -1  # "before the first record": a position, never a record's seq

# The keys whose integer values are seqs in the documents the command line prints: a
# record's and a mark's position, a metadata key's version (the seq of its last write), a
# stream's committed and reported points, a relay's floor, the metadata fold's last seq,
# and the store's points. Applied by key, so only to documents whose keys are these
# fields' names (a relay's status, a mark), never to one keyed by names of other things
# (the store runner's jobs: "snapshot").
SEQ_FIELDS = frozenset(
    {
        "seq",
        "version",
        "committed",
        "reported",
        "newest",
        "floor",
        "applied",
        "last_seq",
        "snapshot_seq",
        "retained_after",
        "oldest_available",
    }
)


def seq_text(seq: int) -> str:
    """A seq (or -1) as JSON carries it: its decimal digits."""
    return str(seq)


def seqs_as_text(doc: Any, fields: frozenset[str] = SEQ_FIELDS) -> Any:
    """A copy of `doc` (dicts and lists, any depth) with the integer values of `fields`
    as decimal strings; anything else as it was."""
    if isinstance(doc, Mapping):
        return {
            key: (
                seq_text(value)
                if key in fields and isinstance(value, int) and not isinstance(value, bool)
                else seqs_as_text(value, fields)
            )
            for key, value in doc.items()
        }
    if isinstance(doc, list | tuple):
        return [seqs_as_text(item, fields) for item in doc]
    return doc


def parse_seq(value: str | int, *, allow_none: bool = True) -> int:
    """A seq given as decimal text (surrounding blanks allowed, and the double quotes of a
    JSON string: what `jq .seq` prints) or an int: 0..MAX_SEQ, or -1 (before the first
    record) when `allow_none`. ValueError naming the problem."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a seq")
    if isinstance(value, int):
        seq = value
    else:
        text = value.strip()
        if len(text) >= 2 and text[0] == text[-1] == '"':
            text = text[1:-1].strip()
        digits = text[1:] if text.startswith("-") else text
        # int() alone would take "1_000", "+5", "١٢" (other scripts' digits) and floats fail
        # late: a seq is ASCII digits only, as JSON and the relays write it
        if not digits or not digits.isascii() or not digits.isdigit():
            raise ValueError(f"{value!r} is not a seq (decimal digits)")
        seq = int(text)
    lowest = NO_SEQ if allow_none else 0
    if not lowest <= seq <= MAX_SEQ:
        raise ValueError(f"{value!r} is not a seq: seqs run {lowest}..{MAX_SEQ}")
    return seq
