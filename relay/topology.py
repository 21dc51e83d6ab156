"""The YAML topology: which relays exist, where they listen, which streams each serves.

The file format (`config/topology.yaml` is the commented example)::

    relays:                       # required, at least one
      - id: 0                     # 0..1023, unique (it is part of every sequence number)
        host: 127.0.0.1           # address to bind and to connect to (not a wildcard);
                                  # or, on several hosts (docs/deploy.md), instead:
        # advertise: 10.0.0.1     # the address peers and clients connect to (no wildcard)
        # bind: 0.0.0.0           # optional: where the relay's sockets bind; default the
                                  # advertise address; may be a wildcard (0.0.0.0, ::)
        mesh_port: 7100           # PUB socket of the mesh: tcp://advertise:mesh_port
        client_port: 7200         # ROUTER socket for clients: tcp://advertise:client_port
        http_port: 7300           # optional: metrics, health, status page (docs/operations.md)
        streams: ["orders.*", "audit"]   # exact names and fnmatch patterns, at least one
    streams:                      # optional: the streams the mesh is expected to serve
      - orders.eu                 # exact names; each must match at least one relay
      - {name: audit, min_relays: 3}   # object form: fewer serving relays is an error
    limits:                       # optional: any field of relay.core.config.Limits
      suspect_timeout_ms: 150
    data_dir: ../data             # optional, relative to the file; default <file dir>/../data
    spool:                        # optional: write committed history for the store
      enabled: true               # default false
      segment_max_bytes: 16777216 # a segment closes at this size ...
      segment_max_age_ms: 10000   # ... or this age
      disk_max_bytes: 10737418240 # per relay; once full the relay stops voting (5.14)
    store:                        # optional: where the store is and how `relay store run` keeps it
      location: s3://bucket/relay # a path (relative to the file) or s3:// URI; default
                                  # <data_dir>/store (docs/store.md 8)
      s3: {endpoint_url: "http://10.0.0.6:9000", region: eu-west-1, allow_http: true}
                                  # optional; credentials come from the AWS environment
      ingest_interval_s: 10       # ingest the spools this often
      snapshot_interval_s: 300    # snapshot the streams with new records this often
      keep_deltas_s: 604800       # records older than this (by seq time) are kept only as
                                  # snapshots; default: every record is kept
      keep_snapshots: 10          # snapshots per stream (the newest)
      compact_interval_s: 300     # merge runs of record files smaller than
      compact_below_bytes: 8388608    # this into files of about
      compact_target_bytes: 134217728 # this
      vacuum_interval_s: 3600     # delete files no version of the last
      vacuum_retention_hours: 24  # this many hours needs
      lock_wait_s: 60             # wait this long for another job's writer lock
      spark:                      # where the store's Spark jobs run
        master: spark://10.0.0.5:7077   # default local[*]; `--master` overrides it
        driver_host: 10.0.0.4     # executors reach the driver here; default 127.0.0.1
        executor_python: /opt/relay/.venv/bin/python  # default: the command's Python
        conf: {spark.executor.memory: 4g}   # any other Spark setting
    security:                     # optional (docs/security.md)
      curve: true                 # CurveZMQ on every socket; default false
      keys_dir: ../data/keys      # relative to the file; default <data_dir>/keys
      client_key_file: ../data/keys/client-admin.key_secret  # tools' default client key
    access:                       # with curve: the clients and their rights
      admin:                      # a client name (letters, digits, _ . -; at most 40)
        public_key: "..."         # optional, Z85; default <keys_dir>/client-admin.key
        produce: ["*"]            # stream names and patterns it may produce to
        consume: ["*"]            # ... and read
        admin: true               # status and store commands; default false
        metadata: ["*"]           # metadata keys (fnmatch) it may read and write

A relay takes `public_key:` (Z85, 40 characters) too; without it its public key is read
from `<keys_dir>/relay-<id>.key`. Its secret key is `<keys_dir>/relay-<id>.key_secret`.

Rules: unknown keys are errors; a relay gives either `host` (advertise and bind in one)
or `advertise` with an optional `bind`; ports are 1..65535 and every (advertise, port)
pair is used once across all mesh, client and HTTP ports; two relays known to share a
machine (one's advertise or specific bind address is the other's) do not bind one port on
overlapping addresses; stream names are non-empty, at most 255 UTF-8 bytes (or
`limits.max_stream_name_bytes` if lower), without `|` or NUL; declared streams are exact
names (no `*`, `?`, `[`). A declared stream served by fewer than 3 relays is a warning:
its majority quorum tolerates no relay failure.

Every problem becomes one `ConfigError` whose message names the file, the field path and
the problem, one line per problem, e.g.
`config/topology.yaml: relays[1].mesh_port: 7100 is already used by relay 0 (...)`.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml  # type: ignore[import-untyped, unused-ignore]
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationError,
    field_validator,
)

from relay.access import AccessPolicy, ClientGrant
from relay.core.config import CoreConfig, Limits, Topology
from relay.core.seq import MAX_RELAY_ID
from relay.errors import ConfigError
from relay.meta import METADATA_STREAM, InvalidMetaOp, check_key
from relay.store.location import BadStoreLocation, StoreLocation, as_location

__all__ = ["MeshConfig", "RelaySpec", "load", "loads"]

MAX_STREAM_NAME_BYTES = 255
MIN_SAFE_RELAYS = 3  # fewer: a majority quorum tolerates no relay failure
Z85_KEY_CHARS = 40  # a 32-byte CurveZMQ key in Z85
_Z85_CHARS = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)
# A client's name starts each of its producer ids (relay/access.py): at most 40 bytes, so
# the name, a `/` and 16 random bytes fit the 64 bytes of a producer id.
CLIENT_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")
_PORT_FIELDS = ("mesh_port", "client_port", "http_port")  # what a relay listens on
_ZMQ_WILDCARDS = frozenset({"*", "[::]"})  # ZeroMQ's spellings of 0.0.0.0 and ::
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


# --- parsing models (field checks that need no other field) ------------------------------


def _check_name(name: str) -> str:
    if not name:
        raise ValueError("a stream name must not be empty")
    if "|" in name:
        raise ValueError(f"{name!r}: '|' is not allowed in a stream name")
    if "\0" in name:
        raise ValueError(f"{name!r}: NUL is not allowed in a stream name")
    size = _utf8_size(name)
    if size is None:
        raise ValueError(f"{name!r} is not valid Unicode text")
    if size > MAX_STREAM_NAME_BYTES:
        raise ValueError(
            f"{_short(name)} is {size} UTF-8 bytes long; at most {MAX_STREAM_NAME_BYTES} allowed"
        )
    return name


def _check_declared_name(name: str) -> str:
    _check_name(name)
    if is_pattern(name):
        raise ValueError(
            f"{name!r} is a pattern; declared streams are exact names "
            "(patterns belong in a relay's streams)"
        )
    return name


def _check_meta_key_pattern(value: str) -> str:
    try:
        check_key(value)
    except InvalidMetaOp as e:
        raise ValueError(f"not a metadata key pattern: {e}") from None
    return value


def _check_relay_id(value: int) -> int:
    if not 0 <= value <= MAX_RELAY_ID:
        raise ValueError(f"{value} is outside 0..{MAX_RELAY_ID}")
    return value


def _check_port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise ValueError(f"{value} is outside 1..65535")
    return value


def _check_address(value: str) -> str:
    """A host name or an IP address, without port, scheme or path (wildcards pass)."""
    if not value or value != value.strip() or any(c.isspace() for c in value):
        raise ValueError(f"{value!r} is not a host name or address")
    if "://" in value or "/" in value:
        raise ValueError(f"{value!r}: give only the host, without scheme or path")
    if ":" in value:
        try:
            ipaddress.IPv6Address(value)
        except ValueError:
            raise ValueError(
                f"{value!r} is neither a host name nor an IPv6 address "
                "(ports go in mesh_port and client_port)"
            ) from None
    return value


def _is_wildcard(host: str) -> bool:
    """Whether `host` stands for every address of the machine (0.0.0.0, ::, ZeroMQ's *)."""
    if host in _ZMQ_WILDCARDS:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _check_host(value: str) -> str:
    if _is_wildcard(value):
        raise ValueError(
            f"{value!r} is a wildcard; host is both the address peers and clients connect "
            f"to and the one bound: to bind every address give advertise: <this host's "
            f"address> and bind: {value} instead"
        )
    return _check_address(value)


def _check_advertise(value: str) -> str:
    if _is_wildcard(value):
        raise ValueError(
            f"{value!r} is a wildcard; advertise is the address peers and clients connect "
            "to (a wildcard belongs in bind)"
        )
    return _check_address(value)


def _check_bind(value: str) -> str:
    if value in _ZMQ_WILDCARDS:
        # Spelled for ZeroMQ only; the HTTP server and port checks bind with the OS's names.
        raise ValueError(
            f"{value!r}: write the wildcard as 0.0.0.0 (every IPv4 address) or :: (every "
            "address, IPv4 and IPv6)"
        )
    return _check_address(value)


def _check_min_relays(value: int) -> int:
    if value < 1:
        raise ValueError(f"{value} must be at least 1")
    return value


def _check_data_dir(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


def _stream_entry(value: Any) -> Any:
    if isinstance(value, str):
        return {"name": value}
    if isinstance(value, dict):
        return value
    raise ValueError(
        "expected a stream name or a mapping like {name: orders.eu, min_relays: 3}, "
        f"got {_describe(value)}"
    )


def _check_z85_key(value: str) -> str:
    if len(value) != Z85_KEY_CHARS or not set(value) <= _Z85_CHARS:
        raise ValueError(
            f"{_short(value)} is not a CurveZMQ public key ({Z85_KEY_CHARS} Z85 characters, "
            "as `relay keygen` prints)"
        )
    return value


def _check_client_name(value: str) -> str:
    if not CLIENT_NAME_PATTERN.fullmatch(value):
        raise ValueError(
            f"{_short(value)} is not a client name (1..40 letters, digits, '_', '.', '-', "
            "starting with a letter or digit)"
        )
    return value


def _check_path(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty")
    return value


_STRICT = ConfigDict(extra="forbid", strict=True)
_StreamName = Annotated[str, AfterValidator(_check_name)]
_PublicKey = Annotated[str, AfterValidator(_check_z85_key)]
_MetaKeyPattern = Annotated[str, AfterValidator(_check_meta_key_pattern)]


class _RelayModel(BaseModel):
    model_config = _STRICT

    id: Annotated[int, AfterValidator(_check_relay_id)]
    # `host`, or `advertise` with an optional `bind` (checked together in _build)
    host: Annotated[str, AfterValidator(_check_host)] | None = None
    advertise: Annotated[str, AfterValidator(_check_advertise)] | None = None
    bind: Annotated[str, AfterValidator(_check_bind)] | None = None
    mesh_port: Annotated[int, AfterValidator(_check_port)]
    client_port: Annotated[int, AfterValidator(_check_port)]
    http_port: Annotated[int, AfterValidator(_check_port)] | None = None
    streams: list[_StreamName]
    public_key: _PublicKey | None = None

    @field_validator("streams")
    @classmethod
    def _some_stream(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("the relay subscribes to no stream; list at least one")
        return value

    @property
    def advertised(self) -> str | None:
        """The address peers and clients connect to (None: neither field given)."""
        return self.advertise or self.host


class _StreamModel(BaseModel):
    model_config = _STRICT

    name: Annotated[str, AfterValidator(_check_declared_name)]
    min_relays: Annotated[int, AfterValidator(_check_min_relays)] | None = None


def _check_positive(value: int) -> int:
    if value <= 0:
        raise ValueError(f"must be a positive integer, got {value}")
    return value


_Positive = Annotated[int, AfterValidator(_check_positive)]


def _check_non_negative(value: int) -> int:
    if value < 0:
        raise ValueError(f"must be zero or more, got {value}")
    return value


_NonNegative = Annotated[int, AfterValidator(_check_non_negative)]


class _SpoolModel(BaseModel):
    model_config = _STRICT

    enabled: bool = False
    segment_max_bytes: _Positive = SpoolSettings.segment_max_bytes
    segment_max_age_ms: _Positive = SpoolSettings.segment_max_age_ms
    disk_max_bytes: _Positive = SpoolSettings.disk_max_bytes


class _SparkModel(BaseModel):
    model_config = _STRICT

    master: str = SparkSettings.master
    driver_host: str = SparkSettings.driver_host
    executor_python: Annotated[str, AfterValidator(_check_path)] | None = None
    conf: dict[str, str | int | float | bool] = {}


class _S3Model(BaseModel):
    model_config = _STRICT

    endpoint_url: str | None = None
    region: str | None = None
    allow_http: bool = False


class _StoreModel(BaseModel):
    model_config = _STRICT

    ingest_interval_s: _Positive = StoreSettings.ingest_interval_s
    snapshot_interval_s: _Positive = StoreSettings.snapshot_interval_s
    keep_deltas_s: _Positive | None = StoreSettings.keep_deltas_s
    keep_snapshots: _Positive = StoreSettings.keep_snapshots
    compact_interval_s: _Positive = StoreSettings.compact_interval_s
    compact_below_bytes: _Positive = StoreSettings.compact_below_bytes
    compact_target_bytes: _Positive = StoreSettings.compact_target_bytes
    vacuum_interval_s: _Positive = StoreSettings.vacuum_interval_s
    vacuum_retention_hours: _NonNegative = StoreSettings.vacuum_retention_hours
    lock_wait_s: _NonNegative = StoreSettings.lock_wait_s
    spark: _SparkModel | None = None
    location: Annotated[str, AfterValidator(_check_path)] | None = None
    s3: _S3Model | None = None


class _SecurityModel(BaseModel):
    model_config = _STRICT

    curve: bool = False
    keys_dir: Annotated[str, AfterValidator(_check_path)] | None = None
    client_key_file: Annotated[str, AfterValidator(_check_path)] | None = None


class _ClientModel(BaseModel):
    model_config = _STRICT

    public_key: _PublicKey | None = None
    produce: list[_StreamName] = []
    consume: list[_StreamName] = []
    admin: bool = False
    metadata: list[_MetaKeyPattern] = []


class _FileModel(BaseModel):
    model_config = _STRICT

    relays: list[_RelayModel]
    streams: list[Annotated[_StreamModel, BeforeValidator(_stream_entry)]] | None = None
    limits: dict[str, Any] | None = None
    data_dir: Annotated[str, AfterValidator(_check_data_dir)] | None = None
    spool: _SpoolModel | None = None
    store: _StoreModel | None = None
    security: _SecurityModel | None = None
    access: dict[Annotated[str, AfterValidator(_check_client_name)], _ClientModel] | None = None

    @field_validator("relays")
    @classmethod
    def _some_relay(cls, value: list[_RelayModel]) -> list[_RelayModel]:
        if not value:
            raise ValueError("at least one relay is required")
        return value


_LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(Limits))
_ALLOWED_KEYS: dict[str, tuple[str, ...]] = {
    "": tuple(_FileModel.model_fields),
    "relays": tuple(_RelayModel.model_fields),
    "streams": tuple(_StreamModel.model_fields),
    "limits": _LIMIT_FIELDS,
    "spool": tuple(_SpoolModel.model_fields),
    "store": tuple(_StoreModel.model_fields),
    "store.spark": tuple(_SparkModel.model_fields),
    "store.s3": tuple(_S3Model.model_fields),
    "security": tuple(_SecurityModel.model_fields),
    "access": tuple(_ClientModel.model_fields),
}


# --- loading ---------------------------------------------------------------------------


def _store_settings(model: _StoreModel | None, base: Path) -> StoreSettings:
    if model is None:
        return StoreSettings()
    fields = model.model_dump(exclude={"spark", "location", "s3"})
    spark = model.spark or _SparkModel()
    python = spark.executor_python
    location = model.location
    if location is not None and "://" not in location:
        location = os.path.abspath(base / location)
    s3 = model.s3.model_dump(exclude_none=True, exclude_defaults=True) if model.s3 else {}
    s3_options = tuple(sorted((k, _conf_text(v)) for k, v in s3.items()))
    return StoreSettings(
        **fields,
        location=location,
        s3=s3_options,
        spark=SparkSettings(
            master=spark.master,
            driver_host=spark.driver_host,
            executor_python=None if python is None else Path(os.path.abspath(base / python)),
            conf=tuple(sorted((k, _conf_text(v)) for k, v in spark.conf.items())),
        ),
    )


def _conf_text(value: str | int | float | bool) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def load(path: str | Path) -> MeshConfig:
    """Read and check a topology file. Raises ConfigError naming the file and field."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{file}: cannot read the topology: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{file}: cannot read the topology: it is a directory") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{file}: cannot read the topology: not UTF-8 text (byte {exc.start})"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read the topology: {exc.strerror or exc}") from None
    return loads(text, file)


def loads(text: str, path: str | Path = "<string>") -> MeshConfig:
    """Check a topology given as text; `path` names it in messages and anchors data_dir."""
    file = Path(path)
    data = _parse_yaml(text, file)
    try:
        model = _FileModel.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_join(file, _pydantic_problems(exc))) from None
    return _build(file, model)


def _parse_yaml(text: str, file: Path) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        where = ""
        if exc.problem_mark is not None:
            mark = exc.problem_mark
            where = f"line {mark.line + 1}, column {mark.column + 1}: "
        problem = exc.problem or "invalid YAML"
        context = f" ({exc.context})" if exc.context else ""
        raise ConfigError(f"{file}: {where}invalid YAML: {problem}{context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: invalid YAML: {exc}") from None
    if data is None:
        raise ConfigError(f"{file}: the topology is empty; expected a mapping with 'relays'")
    if not isinstance(data, dict):
        raise ConfigError(
            f"{file}: expected a mapping with 'relays' at the top level, got {_describe(data)}"
        )
    return data


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first given on line {first.start_mark.line + 1})",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def _build(file: Path, model: _FileModel) -> MeshConfig:
    problems: list[tuple[str, str]] = []  # (field path, problem)
    warnings: list[tuple[str, str]] = []

    limits = _build_limits(model.limits or {}, problems)
    max_name = min(MAX_STREAM_NAME_BYTES, limits.max_stream_name_bytes)

    # relays: ids, addresses, the ports they listen on, subscriptions
    by_id: dict[int, int] = {}  # relay id -> index in the file
    listeners = _Listeners()
    for i, relay in enumerate(model.relays):
        at = f"relays[{i}]"
        if relay.id in by_id:
            problems.append(
                (f"{at}.id", f"{relay.id} is already used by relays[{by_id[relay.id]}]")
            )
        else:
            by_id[relay.id] = i
        if (problem := _address_problem(relay)) is not None:
            field, text = problem
            problems.append((f"{at}.{field}" if field else at, text))
        problems.extend(listeners.add(relay, at))
        problems.extend(_duplicates(f"{at}.streams", relay.streams))
        problems.extend(_long_names(f"{at}.streams", relay.streams, max_name))

    declared = model.streams or []
    names = [s.name for s in declared]
    problems.extend(_duplicates("streams", names))
    problems.extend(_long_names("streams", names, max_name))

    relays = {
        r.id: RelaySpec(
            id=r.id,
            host=r.advertised or "",  # "" only with a problem reported above
            bind=r.bind,
            mesh_port=r.mesh_port,
            client_port=r.client_port,
            # Every relay also serves the metadata stream (docs/metadata.md): durable
            # consumers' marks and other metadata are committed by, and readable from, all.
            streams=tuple(dict.fromkeys((*r.streams, METADATA_STREAM))),
            public_key=r.public_key,
            http_port=r.http_port,
        )
        for r in sorted(model.relays, key=lambda r: r.id)
    }
    try:
        topology = Topology(subscriptions={r.id: r.streams for r in relays.values()})
    except ConfigError as exc:  # already checked above; kept as a safety net
        raise ConfigError(_join(file, [*problems, ("relays", str(exc))])) from None

    # declared streams: served, enough relays
    for i, stream in enumerate(declared):
        at = f"streams[{i}]"
        members = topology.members(stream.name)
        if not members:
            problems.append(
                (at, f"{stream.name!r} is a stream no relay serves (no relay's streams match it)")
            )
        elif stream.min_relays is not None and len(members) < stream.min_relays:
            problems.append(
                (
                    f"{at}.min_relays",
                    f"{stream.name!r} needs {stream.min_relays} relays but only "
                    f"{len(members)} serve it ({_relay_list(members)}), so its quorum "
                    "cannot be met",
                )
            )
        elif len(members) < MIN_SAFE_RELAYS:
            warnings.append(
                (
                    at,
                    f"{stream.name!r} is served by only {len(members)} "
                    f"relay{'s' if len(members) > 1 else ''} ({_relay_list(members)}); "
                    f"its quorum of {len(members) // 2 + 1} tolerates no relay failure "
                    f"(serve it on at least {MIN_SAFE_RELAYS})",
                )
            )

    security = model.security or _SecurityModel()
    if model.access and not security.curve:
        problems.append(
            (
                "access",
                "client rights need identities: set security.curve: true (without "
                "CurveZMQ no client is identified, and every client may do anything)",
            )
        )
    if security.curve and not model.access:
        problems.append(
            (
                "access",
                "missing; with security.curve on, only the clients listed here may "
                "connect (e.g. access: {admin: {produce: ['*'], consume: ['*'], admin: true, "
                "metadata: ['*']}})",
            )
        )

    store = model.store
    if store is not None and store.s3 is not None and "://" not in (store.location or ""):
        problems.append(("store.s3", "S3 options need an s3:// store.location"))
    elif store is not None and store.location is not None:
        try:
            s3 = store.s3.model_dump(exclude_none=True) if store.s3 else None
            as_location(store.location, s3)
        except BadStoreLocation as error:
            problems.append(("store.location", str(error)))

    if problems:
        raise ConfigError(_join(file, problems))

    base = file.parent
    data_dir = base / model.data_dir if model.data_dir is not None else base / ".." / "data"
    data_dir = Path(os.path.abspath(data_dir))
    keys_dir = (
        Path(os.path.abspath(base / security.keys_dir))
        if security.keys_dir is not None
        else data_dir / "keys"
    )
    client_key = security.client_key_file
    return MeshConfig(
        path=file,
        relays=relays,
        streams=tuple(names),
        limits=limits,
        topology=topology,
        warnings=tuple(f"{file}: {at}: {text}" for at, text in warnings),
        data_dir=data_dir,
        spool=SpoolSettings(**model.spool.model_dump()) if model.spool else SpoolSettings(),
        store=_store_settings(model.store, base),
        security=SecuritySettings(
            curve=security.curve,
            keys_dir=keys_dir,
            client_key_file=None
            if client_key is None
            else Path(os.path.abspath(base / client_key)),
        ),
        access=AccessPolicy(
            {
                name: ClientGrant(
                    produce=tuple(grant.produce),
                    consume=tuple(grant.consume),
                    admin=grant.admin,
                    metadata=tuple(grant.metadata),
                    public_key=grant.public_key,
                )
                for name, grant in (model.access or {}).items()
            }
        ),
    )


def _address_problem(relay: _RelayModel) -> tuple[str, str] | None:
    """`host`, or `advertise` with an optional `bind`: one meaning per field. Returns
    (the field, the problem) or None."""
    if relay.host is not None and relay.advertise is not None:
        return "advertise", "give host (the address to bind and advertise) or advertise, not both"
    if relay.host is not None and relay.bind is not None:
        return "bind", (
            f"host sets the bind address too; give advertise: {relay.host} with "
            f"bind: {relay.bind} instead of host"
        )
    if relay.advertised is None:
        return "", (
            "missing host or advertise: give advertise (the address peers and clients "
            "connect to; with bind if the relay binds another) or host (both in one)"
        )
    return None


@dataclass(frozen=True)
class _Listener:
    relay: int
    port_field: str
    bind: str  # the address it binds (a wildcard, or a specific one)
    machine: frozenset[str]  # addresses that name the machine it runs on


class _Listeners:
    """The ports the relays checked so far listen on, to find collisions: the same
    (advertise, port) twice, or one port bound on overlapping addresses of one machine.
    Relays share a machine when one's advertise or specific bind address is the other's
    (a loopback bind names no machine: every host has one)."""

    def __init__(self) -> None:
        self._advertised: dict[tuple[str, int], tuple[int, str]] = {}  # -> (relay, field)
        self._bound: dict[int, list[_Listener]] = {}  # port -> listeners on it

    def add(self, relay: _RelayModel, at: str) -> list[tuple[str, str]]:
        advertise = relay.advertised
        if advertise is None:
            return []  # reported by _address_problem
        machine = {advertise.lower()}
        if relay.bind is not None and not _is_wildcard(relay.bind) and not _is_loopback(relay.bind):
            machine.add(relay.bind.lower())
        problems = []
        for port_field in _PORT_FIELDS:
            port: int | None = getattr(relay, port_field)
            if port is None:
                continue
            key = (advertise.lower(), port)
            if key in self._advertised:
                other, other_field = self._advertised[key]
                taken = (
                    f"{port} is already used by relay {other} (its {other_field} on {advertise})"
                )
                problems.append((f"{at}.{port_field}", taken))
                continue
            self._advertised[key] = (relay.id, port_field)
            mine = _Listener(relay.id, port_field, relay.bind or advertise, frozenset(machine))
            clash = next((o for o in self._bound.get(port, ()) if _collide(o, mine)), None)
            if clash is not None:
                clashes = (
                    f"{port} cannot be bound at {mine.bind}: relay {clash.relay} binds it at "
                    f"{clash.bind} on the same machine (its {clash.port_field})"
                )
                problems.append((f"{at}.{port_field}", clashes))
                continue
            self._bound.setdefault(port, []).append(mine)
        return problems


def _collide(a: _Listener, b: _Listener) -> bool:
    """Whether two listeners on one port fail to bind both: same machine, and the same
    address or a wildcard covering the other's (`::` covers IPv4 too: the relay's sockets
    leave IPV6_V6ONLY off)."""
    if not a.machine & b.machine:
        return False
    if a.bind.lower() == b.bind.lower():
        return True
    return any(
        _is_wildcard(wild) and (":" in wild or ":" not in other)
        for wild, other in ((a.bind, b.bind), (b.bind, a.bind))
    )


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _build_limits(overrides: dict[str, Any], problems: list[tuple[str, str]]) -> Limits:
    unknown = [key for key in overrides if key not in _LIMIT_FIELDS]
    for key in unknown:
        problems.append((f"limits.{key}", "unknown limit" + _suggest(key, _LIMIT_FIELDS)))
    if unknown:
        return Limits()
    try:
        return Limits(**overrides)
    except ConfigError as exc:
        problems.append(_limit_problem(str(exc), overrides))
        return Limits()


def _limit_problem(message: str, overrides: dict[str, Any]) -> tuple[str, str]:
    """Limits says `limit <field> <problem>`; point at a field the file actually set."""
    match = re.match(r"limit (\w+) (.*)", message, re.DOTALL)
    if match is None:
        return "limits", message
    named, problem = match.groups()
    if named not in overrides:
        mentioned = [f for f in re.findall(r"\w+", problem) if f in overrides]
        if mentioned:
            return f"limits.{mentioned[0]}", f"{named} {problem}"
    return f"limits.{named}", problem


def _duplicates(at: str, names: list[str]) -> list[tuple[str, str]]:
    first: dict[str, int] = {}
    found = []
    for i, name in enumerate(names):
        if name in first:
            found.append((f"{at}[{i}]", f"{name!r} is listed twice (first as {at}[{first[name]}])"))
        else:
            first[name] = i
    return found


def _long_names(at: str, names: list[str], max_bytes: int) -> list[tuple[str, str]]:
    if max_bytes >= MAX_STREAM_NAME_BYTES:
        return []  # the parser checked the hard bound
    found = []
    for i, name in enumerate(names):
        size = _utf8_size(name) or 0
        if size > max_bytes:
            found.append(
                (
                    f"{at}[{i}]",
                    f"{_short(name)} is {size} UTF-8 bytes long; at most {max_bytes} allowed "
                    "by limits.max_stream_name_bytes",
                )
            )
    return found


# --- messages --------------------------------------------------------------------------


def _join(file: Path, problems: Iterable[tuple[str, str]]) -> str:
    lines = []
    for at, text in problems:
        line = f"{file}: {at}: {text}" if at else f"{file}: {text}"
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)


def _pydantic_problems(exc: ValidationError) -> list[tuple[str, str]]:
    return [(_loc(err["loc"]), _plain(err)) for err in exc.errors()]


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _plain(err: Any) -> str:
    kind: str = err["type"]
    value = err.get("input")
    if kind == "missing":
        return "missing; this field is required"
    if kind == "extra_forbidden":
        loc = err["loc"]
        # The section: `store.spark`, or the first part (`relays`, `access` under a name).
        context = ".".join(str(part) for part in loc[:-1] if not isinstance(part, int))
        if context not in _ALLOWED_KEYS:
            context = str(loc[0]) if len(loc) > 1 else ""
        allowed = _ALLOWED_KEYS.get(context, ())
        return "unknown field" + _suggest(str(loc[-1]), allowed)
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"expected an integer, got {_describe(value)}"
    if kind in ("bool_type", "bool_parsing"):
        return f"expected true or false, got {_describe(value)}"
    if kind in ("string_type", "string_unicode"):
        return f"expected a string, got {_describe(value)}"
    if kind in ("list_type", "tuple_type"):
        return f"expected a list, got {_describe(value)}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping, got {_describe(value)}"
    if kind == "value_error":
        return str(err.get("ctx", {}).get("error", err["msg"]))
    return str(err["msg"])


def _suggest(key: str, allowed: Iterable[str]) -> str:
    allowed = tuple(allowed)
    close = difflib.get_close_matches(key, allowed, n=1)
    if close:
        return f"; did you mean {close[0]!r}?"
    if allowed:
        return f" (expected one of: {', '.join(allowed)})"
    return ""


def _describe(value: Any) -> str:
    if value is None:
        return "an empty value"
    if isinstance(value, bool):
        return f"the boolean {value}"
    if isinstance(value, str):
        return f"the string {_short(value)}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"{_short(repr(value), quote=False)} ({type(value).__name__})"


def _short(text: str, *, quote: bool = True, limit: int = 40) -> str:
    shown = text if len(text) <= limit else text[: limit - 3] + "..."
    return repr(shown) if quote else shown


def _utf8_size(text: str) -> int | None:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def _relay_list(ids: Iterable[int]) -> str:
    ids = tuple(ids)
    return ("relay " if len(ids) == 1 else "relays ") + ", ".join(str(i) for i in ids)
