"""What a checked topology is: `MeshConfig` and its parts (the file format and the
rules: relay/topology/__init__.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from relay.access import AccessPolicy
from relay.core.config import CoreConfig, Limits, Topology
from relay.errors import ConfigError
from relay.store.location import StoreLocation, as_location

MAX_STREAM_NAME_BYTES = 255
Z85_KEY_CHARS = 40  # a 32-byte CurveZMQ key in Z85
_PATTERN_CHARS = "*?["


def is_pattern(stream: str) -> bool:
    """Whether a name is an fnmatch pattern (it names many streams), not one stream."""
    return "*" in stream or "?" in stream or "[" in stream


def pattern_refusal(stream: str) -> str:
    """Why `stream` may not be produced to ("" if it may): a pattern names many streams."""
    if is_pattern(stream):
        return f"{stream!r} is a pattern (it has one of {_PATTERN_CHARS}), not one stream"
    return ""


# --- the result ------------------------------------------------------------------------


@dataclass(frozen=True)
class RelaySpec:
    id: int  # 0..1023
    # The advertised address, which peers and clients connect to: the topology's
    # `advertise`, or its `host`. The sockets bind at `bind_host`.
    host: str
    mesh_port: int  # the relay's PUB socket: peers subscribe at tcp://host:mesh_port
    client_port: int  # the relay's ROUTER for clients: tcp://host:client_port
    streams: tuple[str, ...]  # exact names and fnmatch patterns
    public_key: str | None = None  # Z85, when the topology gives it inline
    # HTTP for operators (relay/opsserver.py: /metrics, /healthz, /readyz, the page): none
    # without it
    http_port: int | None = None
    bind: str | None = None  # the topology's `bind` (may be a wildcard); None: `host`

    @property
    def http_url(self) -> str | None:
        """Where the relay's HTTP endpoint is reached, if it has one."""
        if self.http_port is None:
            return None
        return _endpoint(self.host, self.http_port, "http")

    @property
    def mesh_endpoint(self) -> str:
        return _endpoint(self.host, self.mesh_port)

    @property
    def client_endpoint(self) -> str:
        return _endpoint(self.host, self.client_port)

    @property
    def bind_host(self) -> str:
        """The address every listening socket of the relay binds (mesh, client, HTTP)."""
        return self.bind or self.host

    @property
    def mesh_bind_endpoint(self) -> str:
        return _endpoint(self.bind_host, self.mesh_port)

    @property
    def client_bind_endpoint(self) -> str:
        return _endpoint(self.bind_host, self.client_port)


def _endpoint(host: str, port: int, scheme: str = "tcp") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def is_ipv6(address: str) -> bool:
    """Whether a host (`::1`) or an endpoint (`tcp://[::1]:7200`) is an IPv6 address:
    ZeroMQ sockets must be told to allow those (zmq.IPV6), and only those, since the
    option also lets a host name resolve to IPv6 where it resolved to IPv4 before."""
    host = address.split("://", 1)[1].rsplit(":", 1)[0] if "://" in address else address
    return ":" in host


@dataclass(frozen=True)
class SpoolSettings:
    """Whether and how relays write their committed history for the store."""

    enabled: bool = False
    segment_max_bytes: int = 16 * 1024 * 1024
    segment_max_age_ms: int = 10_000
    disk_max_bytes: int = 10 * 1024 * 1024 * 1024


@dataclass(frozen=True)
class SparkSettings:
    """Where the store's Spark jobs run (docs/store.md 4): the master (`--master`
    overrides it), the address executors reach the driver at, the Python executors run
    (absolute; default: the one running the command) and any other Spark settings."""

    master: str = "local[*]"
    driver_host: str = "127.0.0.1"
    executor_python: Path | None = None
    conf: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class StoreSettings:
    """How `relay store run` keeps the store (relay.storerun; docs/store.md 7)."""

    ingest_interval_s: int = 10
    snapshot_interval_s: int = 300
    keep_deltas_s: int | None = None  # None: keep every record
    keep_snapshots: int = 10
    compact_interval_s: int = 300
    compact_below_bytes: int = 8 * 1024 * 1024
    compact_target_bytes: int = 128 * 1024 * 1024
    vacuum_interval_s: int = 3600
    vacuum_retention_hours: int = 24
    lock_wait_s: int = 60
    spark: SparkSettings = SparkSettings()
    # Where the store is: an absolute path or an s3:// URI; None: <data_dir>/store.
    location: str | None = None
    s3: tuple[tuple[str, str], ...] = ()  # S3 options (relay.store.location.S3_OPTIONS)


@dataclass(frozen=True)
class SecuritySettings:
    """CurveZMQ on every socket (`curve`), where this machine's keys are (`keys_dir`,
    absolute), and the client key tools use when given none (`client_key_file`)."""

    curve: bool = False
    keys_dir: Path = Path("keys")
    client_key_file: Path | None = None


@dataclass(frozen=True)
class HttpSettings:
    """What each relay's HTTP endpoint (relay/opsserver.py) serves besides /metrics,
    /healthz and /readyz: `expose_status`, its status document (/status) and the live
    page that reads it (/). The file's `http.expose_status`; unset, it is on without
    CurveZMQ (anyone who reaches a client port may ask for the document there too) and
    off with it (the client port gives the document only to clients with `admin`)."""

    expose_status: bool = True


@dataclass(frozen=True)
class MeshConfig:
    path: Path
    relays: dict[int, RelaySpec]  # by id, ascending
    streams: tuple[str, ...]  # the declared streams (exact names), in file order
    limits: Limits  # defaults with the file's overrides
    topology: Topology  # built from the relays' streams
    warnings: tuple[str, ...]  # e.g. a declared stream with fewer than 3 relays
    data_dir: Path  # absolute; for the spool and the store
    spool: SpoolSettings = SpoolSettings()
    store: StoreSettings = StoreSettings()
    security: SecuritySettings = SecuritySettings()
    http: HttpSettings = HttpSettings()
    access: AccessPolicy = dataclasses.field(default_factory=AccessPolicy)

    @property
    def spool_dir(self) -> Path:
        """Where relays write segments (one folder per relay inside)."""
        return self.data_dir / "spool"

    @property
    def store_location(self) -> StoreLocation:
        """The persistent store that `relay store ingest` builds from the spool (checked
        when the file was loaded)."""
        return as_location(self.store.location or self.data_dir / "store", dict(self.store.s3))

    def core_config(self, relay_id: int) -> CoreConfig:
        """The core's configuration for one relay of this mesh."""
        if (
            not isinstance(relay_id, int)
            or isinstance(relay_id, bool)
            or relay_id not in self.relays
        ):
            known = ", ".join(str(r) for r in self.relays)
            raise ConfigError(f"{self.path}: relay {relay_id!r} is not in the topology ({known})")
        return CoreConfig(
            relay_id=relay_id,
            topology=self.topology,
            limits=self.limits,
            declared_streams=self.streams,
        )

    def members(self, stream: str) -> tuple[int, ...]:
        """R(S): the relays serving `stream`, ascending; empty if none does."""
        return self.topology.members(stream)
