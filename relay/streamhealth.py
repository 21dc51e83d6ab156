"""Why a stream of one relay does not serve, in words: the one rule `relay status`
(relay/tools/status.py) and each relay's `/readyz` (relay/opsserver.py) both state, from
a stream's entry in the relay's status document (relay/core/machine.py `status`).
Nothing here imports anything heavy: `relay status` must start fast."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["STALL_WORDS", "stall_words", "stream_problem"]

STALL_WORDS = {
    "quorum": "fewer than a quorum of its relays are heard",
    "joining": "it is still joining (it has no history of the stream yet)",
    "not_admitted": "the stream's view does not admit this relay (yet)",
    "clock": "this relay's clock is too far from the others'",
    "view_change": "a view change is under way",
    "split": "a split is being rebuilt",
    "spool_full": "this relay's spool is full: it votes on no stream until the store ingests",
    "store_backlog_full": "fewer than a quorum of its relays have room in their spools "
    "(relay store ingest frees it)",
}


def stream_problem(info: Mapping[str, Any]) -> str:
    """What keeps a stream of one relay from committing, in words ("" if nothing)."""
    stall = info.get("stall")
    if info.get("fenced") or stall:
        reason = (stall or {}).get("reason") or info.get("fence_reason") or "no reason given"
        words = ("fenced" if info.get("fenced") else "stalled") + f": {stall_words(reason)}"
        if stall:
            waiting = ", ".join(str(r) for r in stall.get("waiting_for") or []) or "none"
            words += f" (waiting for relays {waiting}; for {stall.get('for_ms', 0) / 1000:.1f} s)"
        if not info.get("joined"):
            words += "; not joined yet"
        return words
    if not info.get("joined"):
        return "not joined yet"
    return ""


def stall_words(reason: str) -> str:
    words = STALL_WORDS.get(reason)
    return f"{words} [{reason}]" if words else reason
