"""Who may do what: the topology's `access:` section (docs/security.md).

Each client name is granted `produce` and `consume` on stream names or fnmatch patterns
(the same rules as a relay's `streams`; a pattern covers the mesh's own `_relay.` streams
only when it starts with `_relay.`), `metadata` on key patterns (the metadata keys it may
read and write, docs/metadata.md), and `admin` (status and the store's commands) or not.
A client's identity is the name the relay's ZAP handler gave its CurveZMQ key
(relay/security.py); without CurveZMQ nobody is identified and this policy is not used.

A producer id belongs to one client: it starts with the client's name and `/`
(`producer_id_prefix`), so no client can produce under another's id (the clients of
relay.client choose such ids by themselves).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from enum import StrEnum

PRODUCER_ID_SEPARATOR = b"/"
# The mesh's own streams (relay.meta.METADATA_STREAM is one): a pattern names them only
# when it starts with this, so "*" means the applications' streams.
INTERNAL_STREAM_PREFIX = "_relay."


class Right(StrEnum):
    PRODUCE = "produce"
    CONSUME = "consume"
    ADMIN = "admin"
    METADATA = "metadata"


@dataclass(frozen=True)
class ClientGrant:
    """One client's rights. `public_key`: its Z85 public key when the topology gives it
    inline (else it is read from the keys directory)."""

    produce: tuple[str, ...] = ()
    consume: tuple[str, ...] = ()
    admin: bool = False
    metadata: tuple[str, ...] = ()  # fnmatch patterns of the metadata keys it may use
    public_key: str | None = None


@dataclass(frozen=True)
class AccessPolicy:
    clients: dict[str, ClientGrant] = field(default_factory=dict)  # by client name

    def allows(self, client: str, right: Right, name: str = "") -> bool:
        """Whether `client` has `right` on `name`: a stream for produce and consume, a
        metadata key for metadata ("": any key, for requests that name none)."""
        grant = self.clients.get(client)
        if grant is None:
            return False
        if right is Right.ADMIN:
            return grant.admin
        if right is Right.METADATA:
            if not name:
                return bool(grant.metadata)
            return any(fnmatch.fnmatchcase(name, pattern) for pattern in grant.metadata)
        patterns = grant.produce if right is Right.PRODUCE else grant.consume
        return any(pattern_matches(pattern, name) for pattern in patterns)


def pattern_matches(pattern: str, stream: str) -> bool:
    """Whether a pattern (or exact name) names `stream`: fnmatch, case-sensitive. The
    mesh's internal streams (`_relay.` ...) only for a pattern that names them
    explicitly, so `*` means the applications' streams."""
    if stream.startswith(INTERNAL_STREAM_PREFIX) and not pattern.startswith(INTERNAL_STREAM_PREFIX):
        return False
    return fnmatch.fnmatchcase(stream, pattern)


def producer_id_prefix(client: str) -> bytes:
    """What every producer id of `client` starts with."""
    return client.encode() + PRODUCER_ID_SEPARATOR


def owns_producer_id(client: str, producer_id: bytes) -> bool:
    prefix = producer_id_prefix(client)
    return producer_id.startswith(prefix) and len(producer_id) > len(prefix)
