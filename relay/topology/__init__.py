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
    http:                         # optional: what the relays' http_port serves
      expose_status: true         # /status and the live page to whoever reaches it;
                                  # default: false with security.curve, true without
                                  # (/metrics, /healthz, /readyz: always; docs/operations.md)

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

The package: `mesh.py` holds what a checked topology is (MeshConfig), `check.py` checks a
file's text against these rules, `cache.py` keeps checked files between commands; this
module loads a topology through them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from relay.errors import ConfigError
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
    is_ipv6,
    is_pattern,
    pattern_refusal,
)

__all__ = [
    "MAX_STREAM_NAME_BYTES",
    "Z85_KEY_CHARS",
    "HttpSettings",
    "MeshConfig",
    "RelaySpec",
    "SecuritySettings",
    "SparkSettings",
    "SpoolSettings",
    "StoreSettings",
    "is_ipv6",
    "is_pattern",
    "load",
    "load_text",
    "loads",
    "pattern_refusal",
    "read_text",
    "text_digest",
]


# --- loading -----------------------------------------------------------------------------


def load(path: str | Path) -> MeshConfig:
    """Read and check a topology file. Raises ConfigError naming the file and field.

    A file checked before, with the same text, at the same place and by the same code, is
    taken from the cache of checked topologies (relay/topology/cache.py): checking imports
    pydantic and builds its models, most of what a short command like `relay status`
    would spend."""
    file = Path(path)
    return load_text(read_text(file), file)


def load_text(text: str, path: str | Path) -> MeshConfig:
    """Check the text of the topology file at `path` (as `read_text` gave it), through the
    cache of checked topologies as `load` does."""
    from relay.topology import cache

    file = Path(path)
    key = cache.key(file, text)
    config = cache.recall(file, key)
    if config is None:
        config = loads(text, file)
        cache.remember(file, key, config)
    return config


def loads(text: str, path: str | Path = "<string>") -> MeshConfig:
    """Check a topology given as text; `path` names it in messages and anchors data_dir."""
    from relay.topology.check import check

    return check(text, Path(path))


def text_digest(text: str) -> bytes:
    """The SHA-256 of a topology file's text (UTF-8): which file a relay read
    (wire.ReloadResp), compared with the operator's by `relay reconfigure`."""
    return hashlib.sha256(text.encode("utf-8")).digest()


def read_text(file: Path) -> str:
    """A topology file's text; ConfigError naming the file if it cannot be read."""
    try:
        return file.read_text(encoding="utf-8")
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
