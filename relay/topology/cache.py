"""The cache of checked topologies: a topology file checked once is not checked again
while its text, its place and the code stay the same.

Checking a topology (check.py) imports pydantic and builds its models:
about 0.15 s, more than the rest of `relay status` together. Each file checked without a
problem is written here as a plain document (msgpack) and read back the next time:
- The key names everything the checked result depends on: the text, the path as given
  and the working directory (relative paths in the file are resolved against them), the
  relay package's sources and the Python (relay.native.source_digest). A file that
  changed, or an upgrade, misses the cache and is checked again; so is anything unreadable
  or malformed here (the cache never turns a good file into an error or a bad one into a
  config: a problem is never cached).
- One entry per topology file (named by a hash of its absolute path), at most
  MAX_CACHED_TOPOLOGIES entries (the oldest go): benchmarks and tests write many
  throw-away topologies.
- Where: $RELAY_CACHE_DIR, else $XDG_CACHE_HOME/relay, else ~/.cache/relay;
  RELAY_CACHE_DIR set to an empty value turns the cache off. A directory that another user
  owns or others may write to is not used: an entry there could point this user's tools
  at other relays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from relay.access import AccessPolicy, ClientGrant
from relay.core.config import Limits, Topology
from relay.topology.mesh import (
    HttpSettings,
    MeshConfig,
    RelaySpec,
    SecuritySettings,
    SparkSettings,
    SpoolSettings,
    StoreSettings,
)

CACHE_DIR_ENV = "RELAY_CACHE_DIR"
MAX_CACHED_TOPOLOGIES = 64
_SUFFIX = ".topology.msgpack"


def cache_dir() -> Path | None:
    """Where checked topologies are kept; None: nowhere (turned off)."""
    chosen = os.environ.get(CACHE_DIR_ENV)
    if chosen is not None:
        return Path(chosen) if chosen.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "relay"


def key(file: Path, text: str) -> bytes:
    """What a checked topology depends on, hashed (128 bits)."""
    from relay.native import source_digest

    digest = xxhash.xxh3_128()
    # The digest covers this module too: a new layout of the document is a new key.
    for part in (source_digest(), str(file), os.getcwd(), text):
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return digest.digest()


def recall(file: Path, wanted: bytes) -> MeshConfig | None:
    """The checked topology kept for `file` under key `wanted`, or None."""
    entry = _entry(file)
    if entry is None:
        return None
    try:
        raw = entry.read_bytes()
        kept = msgpack.unpackb(raw, use_list=False, raw=False)
        if kept["key"] != wanted:
            return None
        return from_document(kept["config"])
    except Exception:  # any damage to an entry is a miss, never an error
        return None


def remember(file: Path, key_: bytes, config: MeshConfig) -> None:
    """Keep `config` for `file` under `key_`; a cache that cannot be written is skipped."""
    entry = _entry(file, create=True)
    if entry is None:
        return
    import tempfile  # only here: a hit writes nothing

    data = msgpack.packb({"key": key_, "config": as_document(config)}, use_bin_type=True)
    try:
        fd, temporary = tempfile.mkstemp(dir=entry.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(temporary, entry)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        _evict(entry.parent)
    except OSError:
        pass


def as_document(config: MeshConfig) -> dict[str, Any]:
    """`config` as plain values (the topology is rebuilt from the relays' streams)."""
    store = dataclasses.asdict(config.store)
    store["spark"]["executor_python"] = _text(config.store.spark.executor_python)
    return {
        "path": str(config.path),
        "relays": [dataclasses.asdict(spec) for spec in config.relays.values()],
        "streams": config.streams,
        "limits": dataclasses.asdict(config.limits),
        "warnings": config.warnings,
        "data_dir": str(config.data_dir),
        "spool": dataclasses.asdict(config.spool),
        "store": store,
        "security": {
            "curve": config.security.curve,
            "keys_dir": str(config.security.keys_dir),
            "client_key_file": _text(config.security.client_key_file),
        },
        "http": dataclasses.asdict(config.http),
        "access": {
            name: dataclasses.asdict(grant) for name, grant in config.access.clients.items()
        },
    }


def from_document(doc: dict[str, Any]) -> MeshConfig:
    """The MeshConfig `as_document` made `doc` from (msgpack arrays read as tuples)."""
    relays = {spec.id: spec for spec in (RelaySpec(**fields) for fields in doc["relays"])}
    store = dict(doc["store"])
    spark = dict(store.pop("spark"))
    spark["executor_python"] = _path(spark["executor_python"])
    security = doc["security"]
    return MeshConfig(
        path=Path(doc["path"]),
        relays=relays,
        streams=doc["streams"],
        limits=Limits(**doc["limits"]),
        topology=Topology(subscriptions={r.id: r.streams for r in relays.values()}),
        warnings=doc["warnings"],
        data_dir=Path(doc["data_dir"]),
        spool=SpoolSettings(**doc["spool"]),
        store=StoreSettings(**store, spark=SparkSettings(**spark)),
        security=SecuritySettings(
            curve=security["curve"],
            keys_dir=Path(security["keys_dir"]),
            client_key_file=_path(security["client_key_file"]),
        ),
        http=HttpSettings(**doc["http"]),
        access=AccessPolicy({name: ClientGrant(**grant) for name, grant in doc["access"].items()}),
    )


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _path(text: str | None) -> Path | None:
    return None if text is None else Path(text)


def _entry(file: Path, create: bool = False) -> Path | None:
    """The cache file for `file`, in a directory only this user may write; None: none."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        if create:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
    except OSError:
        return None
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    name = xxhash.xxh3_64_hexdigest(os.path.abspath(file).encode("utf-8", "surrogatepass"))
    return directory / (name + _SUFFIX)


def _evict(directory: Path) -> None:
    """Keep the newest MAX_CACHED_TOPOLOGIES entries."""
    entries = []
    for entry in directory.glob("*" + _SUFFIX):
        with contextlib.suppress(OSError):
            entries.append((entry.stat().st_mtime_ns, entry))
    entries.sort(reverse=True)
    for _, old in entries[MAX_CACHED_TOPOLOGIES:]:
        with contextlib.suppress(OSError):
            old.unlink()
