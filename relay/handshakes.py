"""The handshakes a relay refuses on its listening sockets, in words (docs/security.md).

libzmq reports each refused handshake through the socket's monitor (relay/sockets.py
LinkMonitor): ZMQ_EVENT_HANDSHAKE_FAILED_AUTH when the ZAP handler refused the peer's key
(relay/zap.py), _PROTOCOL or _NO_DETAIL when the handshake failed before ZAP was asked (a
client holding another server key for the relay, one without CurveZMQ; a handshake broken
off, mostly by a peer that went away in the middle of it). The relay counts each under
`handshakes_refused_<kind>` and logs it. The monitor's events name the relay's own
endpoint, not the peer's (libzmq 4.3 reports the peer's address only through its draft
monitor API, which pyzmq's wheels leave out): the peer's address is known only for a key
ZAP refused, from the ZAP request.
"""

from __future__ import annotations

import os

import zmq

__all__ = ["COUNTERS", "HANDSHAKE_FAILED", "Refusal", "refusal"]

_AUTH = int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_PROTOCOL = int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
_NO_DETAIL = int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
# The monitor events of a refused handshake (ZMQ_EVENT_* flags).
HANDSHAKE_FAILED = _AUTH | _PROTOCOL | _NO_DETAIL

# The relay's counters of refused handshakes, by kind; their sum is `handshakes_refused`.
AUTH_COUNTER = "handshakes_refused_auth"  # ZAP refused the key
PROTOCOL_COUNTER = "handshakes_refused_protocol"  # failed before ZAP, a protocol error
NO_DETAIL_COUNTER = "handshakes_refused_no_detail"  # broken off before ZAP (an errno)
COUNTERS = (AUTH_COUNTER, PROTOCOL_COUNTER, NO_DETAIL_COUNTER)

# What libzmq's protocol error codes (the event's value) mean for a CurveZMQ server.
_PROTOCOL_WORDS = {
    int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC): (
        "its CurveZMQ handshake does not decrypt: it holds another public key for this relay"
    ),
    int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH): (
        "it speaks another security mechanism (CurveZMQ on one side only)"
    ),
}


class Refusal:
    """One refused handshake: the counter it counts under, why in words, and whether ZAP
    refused it (then the ZAP handler knows the peer's address)."""

    __slots__ = ("by_zap", "counter", "why")

    def __init__(self, counter: str, why: str, by_zap: bool = False) -> None:
        self.counter = counter
        self.why = why
        self.by_zap = by_zap


def refusal(event: int, value: int) -> Refusal | None:
    """The refusal a monitor event reports (`value`: its value), None for another event."""
    if event == _AUTH:
        return Refusal(AUTH_COUNTER, f"its key is not listed (ZAP status {value})", by_zap=True)
    if event == _PROTOCOL:
        why = _PROTOCOL_WORDS.get(value, f"protocol error 0x{value:x} in the handshake")
        return Refusal(PROTOCOL_COUNTER, why)
    if event == _NO_DETAIL:
        # (mostly a peer that went away mid-handshake: errno 32, a broken pipe)
        why = f"the handshake broke off: {os.strerror(value)} (errno {value})"
        return Refusal(NO_DETAIL_COUNTER, why)
    return None
