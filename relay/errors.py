"""The project's error tree. A leaf module: it imports nothing of ours.

Every error says whether retrying can help (`retriable`) and, where a relay sent the client
elsewhere, which relays to try (`redirect_to`).
"""

from __future__ import annotations


class RelayError(Exception):
    """Base of every error this project raises on purpose."""

    retriable: bool = False

    def __init__(self, message: str, *, redirect_to: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.redirect_to = redirect_to


# --- configuration ---------------------------------------------------------------------


class ConfigError(RelayError):
    """A topology or limit is invalid. The message names the file, field and problem."""


class KeyFileError(ConfigError):
    """A CurveZMQ key file cannot be used (relay/security.py): missing, unreadable, not a
    key file, readable by others (a secret key), or not the key the topology names. The
    message names the file and the problem."""


class AcceptorMemoryError(RelayError):
    """The relay could not keep its acceptor memory on disk (docs/protocol.md 5.12). It
    stops rather than send an answer it might forget: the message names the file and the
    OS error. Final: the disk (or data_dir's permissions) must be fixed first."""


class RelayAlreadyRunning(RelayError):
    """Another process on this machine runs the same relay id: it holds the lock
    `<data_dir>/relay=<id>/lock` (`lock_path`; `pid` when the file names it). Two processes
    of one relay would vote twice under one identity, so the second refuses to start.
    Stop the other process (or give this one its own relay id)."""

    def __init__(self, message: str, *, lock_path: object = None, pid: int | None = None) -> None:
        super().__init__(message)
        self.lock_path = lock_path
        self.pid = pid


class PortUnavailable(RelayError):
    """A relay cannot listen where its topology says (the port is taken, or the address
    is not this host's): the message names the relay, the address and why."""


class IncarnationError(RelayError):
    """The relay cannot take its incarnation: `<data_dir>/relay=<id>/incarnation` cannot be
    read, does not hold one, or cannot be written (relay/incarnation.py). It does not start:
    an incarnation not above the last one could get it ignored by its peers for good. The
    message names the file and what to do."""


# --- frames from the network --------------------------------------------------------------


class FrameError(RelayError):
    """A frame from a peer or client could not be accepted. Counted, never raised out of
    the core; the frame changes no state."""

    counter = "frame_invalid"


class MalformedFrame(FrameError):
    """Not a msgpack array of the expected shape (truncated, garbage, wrong nesting)."""

    counter = "frame_malformed"


class UnknownMessageType(FrameError):
    """The message type code is not one this version knows."""

    counter = "frame_unknown_type"


class FieldError(FrameError):
    """A field has the wrong type or lies outside its allowed range."""

    counter = "frame_bad_field"


class NotAMember(FieldError):
    """A message about a stream from a relay outside the stream's configuration, or for a
    relay that does not serve it (docs/protocol.md 5.15: a relay whose topology differs)."""

    counter = "frame_not_member"


class OversizedFrame(FrameError):
    """The frame exceeds the configured maximum frame size."""

    counter = "frame_oversized"


# --- what producers and consumers are told ---------------------------------------------


class ClientError(RelayError):
    """Base of the errors a producer or consumer sees."""


class Rejected(ClientError):
    """The transaction was definitely not and will never be delivered. `reason`: the
    relay's word for why (relay.wire ProduceResp), "" when the client decided."""

    def __init__(
        self, message: str, *, redirect_to: tuple[int, ...] = (), reason: str = ""
    ) -> None:
        super().__init__(message, redirect_to=redirect_to)
        self.reason = reason


class Unknown(ClientError):
    """No definite answer in time. Retrying with the same producer id and producer
    sequence is safe: it never creates a duplicate."""

    retriable = True


class Fenced(ClientError):
    """The relay cannot reach a quorum for the stream (or has not joined it yet); try
    one of `redirect_to`."""

    retriable = True


class StoreBacklogFull(Rejected):
    """Fewer than a quorum of the stream's relays can spool more (docs/protocol.md 5.14):
    the store has not taken their spools in time. The producer retried the answer
    `rejected (store_backlog_full)` until its `send_timeout_s` (or `max_attempts`) ran out,
    and no copy was taken; retry later (the room comes back as the store ingests), with
    the same producer seq or a new one."""

    retriable = True


class BufferFull(Rejected):
    """The relays tried had no room for the transaction: their buffers or pending produces
    were full (docs/protocol.md 5.10), and stayed so. The producer retried the answer
    `rejected (buffer_full)` until its `send_timeout_s` (or `max_attempts`) ran out, and no
    copy was taken; retry later (room comes back as consumers and commits drain the
    relays), with the same producer seq or a new one."""

    retriable = True


class UnknownStream(ClientError):
    """No relay of the topology serves this stream."""


class NotAuthorized(ClientError):
    """The client's identity lacks the right for what it asked (docs/security.md): `right`
    is "produce", "consume", "metadata" (a metadata key, named in the message) or
    "admin", `stream` the stream it concerned ("" for admin requests). Final: the
    topology's `access:` section must grant it first."""

    def __init__(self, message: str, *, right: str = "", stream: str = "") -> None:
        super().__init__(message)
        self.right = right
        self.stream = stream


class SlowConsumer(ClientError):
    """The relay refused a read because this connection left more than
    `limits.max_unread_reply_bytes` of earlier answers unread (docs/security.md). Reading
    what is queued makes room again."""

    retriable = True


class TooManyStreams(ClientError):
    """The relay would have to open a new stream (a new name of a pattern it serves) but
    this client already opened `limits.max_new_streams_per_client` there, or the relay
    tracks `limits.max_streams` streams (docs/security.md)."""


class OutOfRange(ClientError):
    """The requested position is older than what the relay still holds."""


class BadVersion(ClientError):
    """A metadata write or delete named a version the key no longer (or never) had:
    another writer got there first (docs/metadata.md). `current_version` is the version
    the operation found (0: the key does not exist). Final for this operation: read the
    key again and decide."""

    def __init__(self, message: str, *, key: str, expected_version: int, current_version: int):
        super().__init__(message)
        self.key = key
        self.expected_version = expected_version
        self.current_version = current_version


class MetadataUnavailable(ClientError):
    """No relay could answer a metadata request in time (each relay's last answer is in the
    message: unreachable, still joining, or its history of the metadata stream does not
    reach back far enough to know the state)."""

    retriable = True


class Busy(ClientError):
    """Another instance of this durable consumer holds the stream's lease
    (docs/metadata.md): `holder` names it; the lease is free within `free_in_s` seconds if
    the holder stops renewing. Retry later, or wait for it (`lease_wait_s`)."""

    retriable = True

    def __init__(self, message: str, *, holder: str, free_in_s: float) -> None:
        super().__init__(message)
        self.holder = holder
        self.free_in_s = free_in_s


class LeaseLost(ClientError):
    """This durable consumer instance no longer holds its stream's lease: it could not
    renew it in time, or another instance took it over. Records yielded after its last
    commit may be delivered again to the new holder. Subscribe again to compete for it."""

    retriable = True
