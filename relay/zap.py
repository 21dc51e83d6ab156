"""The ZAP handler of one relay: who may connect to which of its sockets (docs/security.md).

On the mesh PUB (domain `mesh`) only the topology's relay keys may subscribe; on the client
ROUTER (domain `clients`) only the keys of the clients the topology names may connect, and
every message they send carries their name as its ZMTP `User-Id` (what the ACLs check).
It is pyzmq's authenticator in its own thread: a relay's loop may sit in zmq_poll for up to
a quiet heartbeat interval, and a handshake must not wait for its next turn.

The relay counts refused handshakes from its sockets' monitors (relay/handshakes.py); this
handler keeps the peer address of each key it refused (`refused_from`), which libzmq's
monitor events do not carry, for the relay's log line.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

# Addresses of refused keys kept per domain until the relay's loop logs them (it takes
# one per refusal its monitor reports, every turn of its state log); beyond it the
# oldest are dropped and those refusals are logged without an address.
REFUSED_ADDRESSES_MAX = 1_000


class MeshAuthenticator(ThreadAuthenticator):
    """ZAP for one relay's context: `allowed[domain]` maps the public keys (Z85) allowed in
    that domain to the User-Id their messages carry (a client's name). Anything else, and
    every mechanism but CURVE, is refused (ZeroMQ drops the connection after the
    handshake; the peer sees nothing but a closed connection)."""

    def __init__(self, context: zmq.Context[Any], allowed: dict[str, dict[bytes, str]]) -> None:
        super().__init__(context=context)
        self.allowed = allowed
        # Per domain, the peer addresses (IP) of the keys refused, oldest first: appended
        # here, taken by the relay's loop (a deque's append and popleft are atomic).
        self.refused_from: dict[str, deque[str]] = {
            domain: deque(maxlen=REFUSED_ADDRESSES_MAX) for domain in allowed
        }
        self._address = ""  # the peer address of the ZAP request being answered

    def start(self) -> None:
        super().start()
        for domain in self.allowed:
            self.configure_curve_callback(domain, self)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        """pyzmq's handler of one ZAP request; the request's peer address (its fourth
        frame) is noted first, for `callback`, which pyzmq gives only the key."""
        self._address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: whether `key` (Z85) may connect in `domain`."""
        allowed = key in self.allowed.get(domain, {})
        if not allowed:
            self.refused_from.setdefault(domain, deque(maxlen=REFUSED_ADDRESSES_MAX)).append(
                self._address
            )
        return allowed

    def refused_address(self, domain: str) -> str:
        """The peer address of the oldest refusal in `domain` not yet taken ("" if none)."""
        refused = self.refused_from.get(domain)
        if not refused:
            return ""
        try:
            return refused.popleft()
        except IndexError:  # (taken meanwhile: only the loop takes them)
            return ""

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = z85.encode(client_public_key)
        for names in self.allowed.values():
            name = names.get(key)
            if name is not None:
                return name
        return key.decode()

    def stop(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the context may be closing already
            super().stop()
