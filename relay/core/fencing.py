"""Fencing and redirects (docs/protocol.md section 5.9).

A relay that has heard fewer than a quorum of a stream's members (itself included, peers
that refuse its messages excluded) within suspect_timeout_ms fences the stream: produces
and reads are answered `fenced` with members to try, at once, instead of hanging. It
unfences as soon as enough are heard again. What a fence means for the produces being
coordinated is the coordinator's rule (coordinate.abandon_pending).
"""

from __future__ import annotations

from relay.core.links import is_live
from relay.core.state import RelayState, StreamState


def update_fence(core: RelayState, st: StreamState, now_ms: int) -> bool:
    """Fence or unfence the stream by who was heard; True if it fenced just now."""
    timeout_ms = core.limits.suspect_timeout_ms
    heard = 1 + sum(
        1
        for m in st.peers
        if is_live(core, core.peers[m], now_ms)
        and now_ms - core.peers[m].refused_us_ms >= timeout_ms
    )
    fenced = heard < st.q
    if fenced == st.fenced:
        return False
    core.counters["fenced" if fenced else "unfenced"] += 1
    st.fenced = fenced
    return fenced


def redirect_for(core: RelayState, st: StreamState) -> tuple[int, ...]:
    """Members to try instead of this relay: the live ones that joined, else all."""
    live = [
        m
        for m in st.peers
        if is_live(core, core.peers[m], core.now_ms) and core.peers[m].joined.get(st.stream)
    ]
    return tuple(live) if live else st.peers
