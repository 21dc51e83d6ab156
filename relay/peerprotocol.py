"""Which peer protocol a relay speaks, announced to the other relays (docs/deploy.md
section 9, upgrades).

The peer protocol (docs/protocol.md section 3, the frames of relay/core/codec.py) changes
with some releases (the changelog says **wire change**), and relays of two protocols
cannot read each other's frames. So every relay publishes, every ANNOUNCE_MS and on a
topic of its own (`V|`, which no other frame uses and relays of earlier builds never
subscribe to), one frame whose layout never changes: a msgpack array

    [relay id, protocol it runs, oldest protocol it speaks, newest it speaks, release,
     {name: value} of the limits every relay must hold alike]

(the sixth field is new in this build; earlier ones send five. Later builds may append
fields: readers ignore what follows, and take a missing sixth as "not said"). A relay that
hears a peer with no protocol in common names both in one line of its log, in its status
(`node.peer_protocols`) and so in `relay status`, and drops that peer's other frames
unread: nothing of theirs reaches the core, whose decoding they would only fail. A peer
that holds one of those limits (relay/core/config.py MESH_LIMITS) at another value is
named the same way; its frames are still taken, since both relays speak the protocol, and
the operator gives one of them the right file.

This build speaks one protocol, PROTOCOL_VERSION. A release that changes the wire and
still speaks the previous protocol would widen SPEAKS and run the mesh at the newest
protocol every member speaks; none does yet, so a roll across a wire change is not
possible (docs/deploy.md section 9).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from relay import __version__
from relay.core.config import MESH_LIMITS, Limits

# Protocol 1: stream configurations and their changes (issue 47; heartbeat statuses carry
# `wanted`, views `moving_to` and `holds`). Earlier builds announce nothing.
PROTOCOL_VERSION = 1
SPEAKS = (PROTOCOL_VERSION, PROTOCOL_VERSION)  # oldest and newest this build speaks
TOPIC = b"V|"
ANNOUNCE_MS = 1_000
MAX_ANNOUNCEMENT_BYTES = 256  # a longer frame on the topic is refused unread
MAX_RELEASE_CHARS = 64


@dataclass(frozen=True)
class Announcement:
    relay: int
    protocol: int
    speaks: tuple[int, int]
    release: str
    mesh_limits: tuple[tuple[str, int], ...] = ()  # sorted by name; () from earlier builds

    def compatible(self, speaks: tuple[int, int] = SPEAKS) -> bool:
        """Whether this relay and one speaking `speaks` have a protocol in common."""
        return self.speaks[0] <= speaks[1] and speaks[0] <= self.speaks[1]


def mesh_limits(limits: Limits) -> tuple[tuple[str, int], ...]:
    """What this relay announces of its limits: those every relay must hold alike."""
    return tuple((name, getattr(limits, name)) for name in sorted(MESH_LIMITS))


def announcement(relay_id: int, limits: Limits) -> bytes:
    """This relay's announcement frame (without its topic)."""
    frame: bytes = msgpack.packb(
        [relay_id, PROTOCOL_VERSION, SPEAKS[0], SPEAKS[1], __version__, dict(mesh_limits(limits))]
    )
    return frame


def parse(frame: bytes) -> Announcement:
    """A peer's announcement; ValueError naming what is wrong with it."""
    if len(frame) > MAX_ANNOUNCEMENT_BYTES:
        raise ValueError(f"{len(frame)} bytes, above {MAX_ANNOUNCEMENT_BYTES}")
    try:
        fields = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:
        raise ValueError(f"not msgpack: {e}") from None
    if not isinstance(fields, list) or len(fields) < 5:
        raise ValueError("not an array of at least 5 fields")
    relay, protocol, oldest, newest, release = fields[:5]
    numbers = (relay, protocol, oldest, newest)
    if not all(type(n) is int and 0 <= n < 1 << 31 for n in numbers) or oldest > newest:
        raise ValueError(f"bad numbers {numbers!r}")
    if type(release) is not str or len(release) > MAX_RELEASE_CHARS:
        raise ValueError("bad release")
    held = fields[5] if len(fields) > 5 else {}
    if not isinstance(held, dict) or not all(
        type(k) is str and type(v) is int and 0 < v < 1 << 63 for k, v in held.items()
    ):
        raise ValueError(f"bad limits {held!r}")
    # (a limit a later build announces and this one does not know is not compared)
    known = tuple(sorted((k, v) for k, v in held.items() if k in MESH_LIMITS))
    return Announcement(relay, protocol, (oldest, newest), release, known)


def mismatch_words(peer: Announcement) -> str:
    """One line naming both sides of a peer with no protocol in common."""
    return (
        f"relay {peer.relay} speaks peer protocol {_span(peer.speaks)} (release "
        f"{peer.release}), this relay {_span(SPEAKS)} (release {__version__}): they cannot "
        "read each other's frames; its frames are dropped unread (docs/deploy.md section 9)"
    )


def limits_words(peer: Announcement, limits: Limits) -> str:
    """One line naming the limits a peer holds at other values than this relay, each with
    why they must agree; "" when none differs (or the peer does not say: an earlier build).
    A limit a later build adds, which the peer does not announce, is not compared."""
    differ = [
        f"limits.{name} {value} there, {getattr(limits, name)} here ({MESH_LIMITS[name]})"
        for name, value in peer.mesh_limits
        if value != getattr(limits, name)
    ]
    if not differ:
        return ""
    return (
        f"relay {peer.relay} holds other values of limits every relay must hold alike: "
        + "; ".join(differ)
        + ": give every relay the same file (docs/deploy.md section 4)"
    )


def _span(speaks: tuple[int, int]) -> str:
    return str(speaks[0]) if speaks[0] == speaks[1] else f"{speaks[0]}..{speaks[1]}"
