"""Transit: reaching a member through another relay (docs/protocol.md section 5.13).

With one link cut (one way or both), two relays that both hear a third still make a
majority together: the third passes their frames on. Each relay says in its heartbeats
whom it hears *directly*; from those lists every relay knows who hears whom. When P does
not hear S directly (or S does not hear P: around a link cut both ways neither hears the
other say so), S sends each frame meant for P (its heartbeats, its messages on a stream P
serves, and those addressed to P) also wrapped in a `Relayed` to the lowest-numbered live
relay that hears S and P and that P hears, which passes it on. The frame
inside is S's own, so P takes it exactly as if it came from S: incarnation, link counter,
holes and duplicates as on a direct link.

A relay lists a peer as heard directly until half the peer's timeout before it would
suspect it, so that the relay in between starts passing frames on before anyone suspects
the peer. Liveness, admission and everything else count a peer heard by any path.
"""

from __future__ import annotations

from relay.core import links
from relay.core.messages import Relayed
from relay.core.state import NEVER, PeerState, RelayState

# A peer stops counting as heard directly this fraction of its timeout before it would be
# suspected (1/DIRECT_MARGIN_DIVISOR of it): time for our heartbeat to say so and for a
# relay in between to start passing its frames on.
DIRECT_MARGIN_DIVISOR = 2


def hears_directly(core: RelayState, peer: PeerState, now_ms: int) -> bool:
    """Frames from `peer` still come to us straight from it."""
    if peer.direct_ms == NEVER:
        return False
    span = links.live_until_ms(core, peer) - peer.last_heard_ms
    margin = links.timeout_ms(core, peer) // DIRECT_MARGIN_DIVISOR
    return now_ms < peer.direct_ms + span - margin


def direct_set(core: RelayState, now_ms: int) -> tuple[int, ...]:
    """The peers we hear directly, ascending (what our heartbeats say we hear)."""
    return tuple(m for m, p in sorted(core.peers.items()) if hears_directly(core, p, now_ms))


def _direct(core: RelayState, listener: int, speaker: int) -> bool:
    """`listener` hears `speaker` directly, as far as we know (for us: as planned)."""
    if listener == core.id:
        return speaker in core.hears_sent
    peer = core.peers[listener]
    # Before its first heartbeat a peer has not said whom it hears: take that it does.
    return speaker in peer.hears or peer.heartbeat_ms == NEVER


def reaches(core: RelayState, listener: int, speaker: int, now_ms: int) -> bool:
    """`listener` gets `speaker`'s frames, directly or passed on by one other relay. For
    ourselves as the listener: heard by any path (not suspected)."""
    if listener == speaker:
        return True
    if listener == core.id:
        return links.is_live(core, core.peers[speaker], now_ms)
    if _direct(core, listener, speaker):
        return True
    return any(
        x not in (listener, speaker) and _direct(core, listener, x) and _direct(core, x, speaker)
        for x in core.topology.relay_ids
    )


def hears_us(core: RelayState, peer_id: int, now_ms: int) -> bool:
    """`peer_id` gets our frames, directly or through another relay."""
    return reaches(core, peer_id, core.id, now_ms)


def _relay_between(core: RelayState, listener: int, now_ms: int) -> int:
    """The relay our frames for `listener` go through: the lowest-numbered live relay
    that hears us and `listener`, and that `listener` hears, by what we know; -1 if
    none. (That it hears `listener` is the evidence that `listener` is up: we may have
    stopped hearing it before any of its frames came around.)"""
    for x in core.topology.relay_ids:
        if x in (core.id, listener) or not links.is_live(core, core.peers[x], now_ms):
            continue
        if _direct(core, x, core.id) and _direct(core, x, listener) and _direct(core, listener, x):
            return x
    return -1


def plan(core: RelayState, now_ms: int) -> bool:
    """Work out, from the latest heartbeats, which relay our frames go through for each
    peer that does not hear us directly (or that we do not hear directly). True when the
    peers we hear directly changed since our last heartbeat said (it must say so now)."""
    mine = direct_set(core, now_ms)
    changed = mine != core.hears_sent
    core.hears_sent = mine
    route_via: dict[int, int] = {}
    for p, peer in core.peers.items():
        # Around a link cut both ways neither end hears the other say so: a peer we do
        # not hear directly gets our frames through another relay too (with the link cut
        # one way only, the copies it also gets directly are dropped as duplicates).
        # Whether it is live to us does not matter: if we suspect it because its frames
        # stopped before they came around, a route must still start.
        unheard = peer.heartbeat_ms != NEVER and core.id not in peer.hears
        if not unheard and p in mine:
            continue
        via = _relay_between(core, p, now_ms)
        if via >= 0:
            route_via[p] = via
    core.route_via = route_via
    return changed


def pass_through(core: RelayState, msg: Relayed) -> None:
    """A peer asks us to pass its own message on to `msg.to`, which does not hear it
    (the receiver checks that the frame inside is the sender's)."""
    # Passing frames on is not activity of ours (5.11): the two ends say they are busy.
    relayed = Relayed(core.id, core.incarnation, core.clock.floor, msg.to, msg.to, msg.frame)
    core.send(relayed, busy=False)
    core.counters["transit_passed"] += 1
