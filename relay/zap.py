"""The ZAP handler of one relay: who may connect to which of its sockets (docs/security.md).

On the mesh PUB (domain `mesh`) only the topology's relay keys may subscribe; on the client
ROUTER (domain `clients`) only the keys of the clients the topology names may connect, and
every message they send carries their name as its ZMTP `User-Id` (what the ACLs check).
It is pyzmq's authenticator in its own thread: a relay's loop may sit in zmq_poll for up to
a quiet heartbeat interval, and a handshake must not wait for its next turn.
"""

from __future__ import annotations

import contextlib
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85


class MeshAuthenticator(ThreadAuthenticator):
    """ZAP for one relay's context: `allowed[domain]` maps the public keys (Z85) allowed in
    that domain to the User-Id their messages carry (a client's name). Anything else, and
    every mechanism but CURVE, is refused (ZeroMQ drops the connection after the
    handshake; the peer sees nothing but a closed connection)."""

    def __init__(self, context: zmq.Context[Any], allowed: dict[str, dict[bytes, str]]) -> None:
        super().__init__(context=context)
        self.allowed = allowed
        self.refused = 0  # handshakes refused, read by the node's status (an int: atomic)

    def start(self) -> None:
        super().start()
        for domain in self.allowed:
            self.configure_curve_callback(domain, self)

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: whether `key` (Z85) may connect in `domain`."""
        allowed = key in self.allowed.get(domain, {})
        if not allowed:
            self.refused += 1
        return allowed

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
