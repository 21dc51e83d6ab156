"""What the core needs to know about the mesh, and every bound it enforces.

The topology (which relays exist, which streams each serves) is this relay's file, read
at start; other relays may have read another one. Stream subscriptions may be exact names
or patterns (`orders.*`, fnmatch syntax). Which relays a stream counts votes under is its
configuration (relay/core/membership.py, docs/protocol.md 5.15): the topology's only until
the stream is established.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, fields

from relay.core.memory import DEDUPE_KEY_BYTES, REPORT_LOG_ENTRY_BYTES
from relay.core.seq import MAX_RELAY_ID
from relay.errors import ConfigError


@dataclass(frozen=True)
class Limits:
    """Every named bound of the protocol core. Times are milliseconds of the shell's clock."""

    heartbeat_interval_ms: int = 20
    suspect_timeout_ms: int = 150  # no message from a peer for this long: suspected
    # 5.11 quiet: a relay with nothing in flight, none of whose peers has either, for
    # quiet_after_ms heartbeats only every quiet_heartbeat_interval_ms (an idle mesh sleeps)
    quiet_heartbeat_interval_ms: int = 2_000
    quiet_after_ms: int = 1_000
    produce_timeout_ms: int = 2_000  # a producer is told `unknown` after this
    repair_retry_ms: int = 100  # resend an unanswered repair or join request
    repair_grace_ms: int = 50  # a commit above our watermark waits this long before repair
    checkpoint_interval_ms: int = 10  # aligned report points while a stream is unsettled
    max_checkpoints_per_report: int = 8
    # no floor is taken further ahead of the majority's clock; a relay whose clock is
    # further from it is an outlier and fences itself (5.2, 5.9)
    max_clock_ahead_ms: int = 5_000
    # Per stream: held entries, and bytes of memory they and the dedupe keys take
    # (relay/core/memory.py counts what Python really allocates for them); per relay: the
    # same bytes across every stream
    buffer_max_entries: int = 1_000_000
    buffer_max_bytes: int = 256 * 1024 * 1024
    relay_buffer_max_bytes: int = 1024 * 1024 * 1024
    late_max_entries: int = 10_000
    dedupe_window_entries: int = 262_144  # duplicates detected among this many committed
    max_tx_bytes: int = 1024 * 1024
    max_frame_bytes: int = 64 * 1024 * 1024
    max_batch_entries: int = 4_096  # entries per TxBatch / RepairReply frame
    max_batch_bytes: int = 4 * 1024 * 1024
    max_pending_vote_points: int = 200_000
    report_log_entries: int = 100_000  # own reports kept to answer gap fills
    max_pending_produces: int = 100_000
    max_streams: int = 10_000
    # 5.11: stream statuses each heartbeat repeats in turn besides the ones it must give
    heartbeat_repeated_statuses: int = 64
    # 5.11 closing: a stream nobody wrote (it holds nothing) is closed once no read reached
    # it here for idle_stream_close_ms (longer than a polling consumer's read waits, so
    # one that keeps reading keeps it open), or unread_stream_close_ms after it opened if
    # none ever did (a member's join opened it: longer than that join takes)
    idle_stream_close_ms: int = 30_000
    unread_stream_close_ms: int = 5_000
    # Shell bounds on what one client may cost a relay (relay/service.py, relay/node.py),
    # per client name with CurveZMQ (all its connections together), else per connection:
    # streams it opens by first use of a pattern's name, bytes of answers it leaves unread
    # before its reads are refused, and requests read and not served yet before its
    # connections are cut (relay/intake.py).
    max_new_streams_per_client: int = 1_000
    max_unread_reply_bytes: int = 64 * 1024 * 1024
    max_queued_requests_per_client: int = 10_000
    max_stream_name_bytes: int = 255

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"limit {name} must be a positive integer, got {value!r}")
        # Dedupe keys and report log entries are never evicted for memory (5.10): a stream
        # whose window and log alone filled its byte bound would refuse every produce.
        fixed_bytes = (
            self.dedupe_window_entries * DEDUPE_KEY_BYTES
            + self.report_log_entries * REPORT_LOG_ENTRY_BYTES
        )
        for bound in ("buffer_max_bytes", "relay_buffer_max_bytes"):
            if getattr(self, bound) <= 2 * fixed_bytes:
                raise ConfigError(
                    f"limit {bound} must exceed twice what a stream's full dedupe window "
                    f"and report log take (dedupe_window_entries x {DEDUPE_KEY_BYTES} + "
                    f"report_log_entries x {REPORT_LOG_ENTRY_BYTES} = {fixed_bytes} "
                    f"bytes), got {getattr(self, bound)}"
                )
        if self.suspect_timeout_ms <= self.heartbeat_interval_ms:
            raise ConfigError(
                "limit suspect_timeout_ms must exceed heartbeat_interval_ms "
                f"({self.suspect_timeout_ms} <= {self.heartbeat_interval_ms})"
            )

    @property
    def quiet_interval_ms(self) -> int:
        """The heartbeat interval of a quiet relay (5.11): never shorter than the usual one
        (a mesh configured to heartbeat rarely has nothing to gain from quiet)."""
        return max(self.quiet_heartbeat_interval_ms, self.heartbeat_interval_ms)


# The limits a running relay cannot take from a reloaded file (relay/topology/change.py),
# each with why; every other limit applies at the reload (`RelayCore.reload_topology` and
# the shell's `RelayNode.reload`).
LIMITS_AT_START: dict[str, str] = {
    # libzmq copies socket options into each connection as it is made
    "heartbeat_interval_ms": "the mesh links' reconnect interval is set when they open",
    "suspect_timeout_ms": "the mesh links' heartbeats are set when they open",
    "max_frame_bytes": "every socket's largest message is set when it opens",
}
# The limits every relay of the mesh must hold alike (docs/protocol.md 5.6, 5.3): a relay
# with another dedupe window would skip other entries than its peers (its delivered history
# would differ from theirs: a safety matter), and one with other checkpoints would report at
# other points than theirs, so that they agree only at run ends (liveness). A reload does
# not change them, and relays announce them (relay/peerprotocol.py), so that one holding
# other values is named.
MESH_LIMITS: dict[str, str] = {
    "dedupe_window_entries": "every relay must skip the same duplicates (protocol 5.6)",
    "checkpoint_interval_ms": "every relay must report at the same points (protocol 5.3)",
    "max_checkpoints_per_report": "every relay must report at the same points (protocol 5.3)",
}


def fixed_limit_reason(name: str) -> str | None:
    """Why a reload does not change limit `name` (LIMITS_AT_START, MESH_LIMITS); None if
    it does."""
    return LIMITS_AT_START.get(name) or MESH_LIMITS.get(name)


def limits_changed(old: Limits, new: Limits) -> dict[str, tuple[int, int]]:
    """The limits `new` gives other values than `old`: name -> (old value, new value)."""
    return {
        f.name: (getattr(old, f.name), getattr(new, f.name))
        for f in fields(Limits)
        if getattr(old, f.name) != getattr(new, f.name)
    }


@dataclass(frozen=True)
class Topology:
    """relay id -> subscription patterns. Relay ids fit the sequence layout (0..1023)."""

    subscriptions: dict[int, tuple[str, ...]]
    _cache: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.subscriptions:
            raise ConfigError("topology has no relays")
        for relay_id, patterns in self.subscriptions.items():
            if not isinstance(relay_id, int) or isinstance(relay_id, bool):
                raise ConfigError(f"relay id {relay_id!r} must be an integer")
            # An empty list is allowed: a relay serving no stream (being taken out of the mesh)
            if not isinstance(patterns, tuple | list) or not all(
                isinstance(p, str) and p for p in patterns
            ):
                raise ConfigError(
                    f"relay {relay_id}: subscriptions must be a list of stream names or "
                    f"patterns, got {patterns!r}"
                )
            if not 0 <= relay_id <= MAX_RELAY_ID:
                raise ConfigError(f"relay id {relay_id} outside 0..{MAX_RELAY_ID}")

    @property
    def relay_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.subscriptions))

    def members(self, stream: str) -> tuple[int, ...]:
        """The relays this topology names for `stream`, ascending; empty if none does (a
        stream's members are its configuration's, RelayCore.members)."""
        found = self._cache.get(stream)
        if found is None:
            found = tuple(
                relay_id
                for relay_id in self.relay_ids
                if any(fnmatch.fnmatchcase(stream, p) for p in self.subscriptions[relay_id])
            )
            if len(self._cache) < 100_000:  # bound the memo, not correctness
                self._cache[stream] = found
        return found

    def serves(self, relay_id: int, stream: str) -> bool:
        return relay_id in self.members(stream)


@dataclass(frozen=True)
class CoreConfig:
    relay_id: int
    topology: Topology
    limits: Limits = field(default_factory=Limits)
    # Streams to open (and join) at start even when only a pattern names them; other
    # pattern-matched streams open on first use.
    declared_streams: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.relay_id not in self.topology.subscriptions:
            raise ConfigError(f"relay {self.relay_id} is not in the topology")
