"""Reads and checks a topology file's text (the format and its rules: relay/topology/__init__.py).

Two stages: pydantic models check each field on its own (types, ranges, unknown keys),
then `_build` checks what needs several fields (ids and ports used twice, declared streams
nobody serves, access without CurveZMQ, ...) and builds the MeshConfig. Every problem of
either stage is reported, one line each, in one ConfigError. Only `relay.topology.load`
imports this module, and only for a file not in the cache of checked topologies: pydantic
and its models take longer to load than a short command takes to run.
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
from relay.core.config import Limits, Topology
from relay.core.seq import MAX_RELAY_ID
from relay.errors import ConfigError
from relay.meta import METADATA_STREAM, InvalidMetaOp, check_key
from relay.store.location import BadStoreLocation, as_location
from relay.topology.mesh import (
    MAX_STREAM_NAME_BYTES,
    Z85_KEY_CHARS,
    HttpSettings,
    MeshConfig,
    RelaySpec,
    SecuritySettings,
    SparkSettings,
    SpoolSettings,
    StoreSettings,
    is_pattern,
)

MIN_SAFE_RELAYS = 3  # fewer: a majority quorum tolerates no relay failure
_Z85_CHARS = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)
# A client's name starts each of its producer ids (relay/access.py): at most 40 bytes, so
# the name, a `/` and 16 random bytes fit the 64 bytes of a producer id.
CLIENT_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")
_PORT_FIELDS = ("mesh_port", "client_port", "http_port")  # what a relay listens on
_ZMQ_WILDCARDS = frozenset({"*", "[::]"})  # ZeroMQ's spellings of 0.0.0.0 and ::


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
    # May be empty: a relay that serves no stream only forwards produces and redirects
    # reads (one being taken out of the mesh, docs/deploy.md section 9).
    streams: list[_StreamName]
    public_key: _PublicKey | None = None

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


class _HttpModel(BaseModel):
    model_config = _STRICT

    # None: the default, which follows security.curve (HttpSettings)
    expose_status: bool | None = None


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
    http: _HttpModel | None = None
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
    "http": tuple(_HttpModel.model_fields),
    "access": tuple(_ClientModel.model_fields),
}


# --- building ---------------------------------------------------------------------------


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


def check(text: str, file: Path) -> MeshConfig:
    """Parse and check a topology's text; `file` names it in messages and anchors the
    relative paths. Raises ConfigError with one line per problem."""
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
        if not relay.streams:
            warnings.append(
                (
                    f"{at}.streams",
                    f"relay {relay.id} serves no stream (not even {METADATA_STREAM}): it "
                    "only forwards produces and redirects reads, as a relay being taken "
                    "out of the mesh does",
                )
            )
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
            # Every relay that serves a stream also serves the metadata stream
            # (docs/metadata.md): durable consumers' marks and other metadata are
            # committed by, and readable from, all. One that serves none (it is being
            # taken out of the mesh) serves not that one either.
            streams=tuple(dict.fromkeys((*r.streams, METADATA_STREAM))) if r.streams else (),
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
    expose_status = (model.http or _HttpModel()).expose_status
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
        http=HttpSettings(
            # Unset: no more over HTTP than the client port gives the same outsider.
            expose_status=not security.curve if expose_status is None else expose_status
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
