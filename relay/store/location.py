"""Where a store lives: a folder on this machine or a prefix in an S3-compatible object store.

    file:///srv/relay/store    or a plain path      a local folder
    s3://bucket/some/prefix                         an object store (AWS S3, MinIO, moto, ...)

Every file the store's jobs and readers touch goes through a `StoreLocation`: names inside
the store are relative (`streams/orders/records/part-1.parquet`), `path()` gives the name a
pyarrow filesystem (`fs`) uses, `uri()` the one delta-rs uses, `storage_options` what
delta-rs needs beside it. A location pickles to its URI and options (Spark ships it to its
tasks), and each process opens its own filesystem on first use.

S3 options (the topology's `store.s3`, or `?endpoint_url=...` style query parameters):
`endpoint_url` (an S3-compatible server; default AWS), `region` (default us-east-1) and
`allow_http` (true for a plain-http endpoint). Credentials never live in the topology: they
come from the standard AWS environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_SESSION_TOKEN`, or a profile), which pyarrow, delta-rs and boto3 all read.

An object store has no folders and no rename: a folder exists while a file is under it, and
a move is a copy and a delete (used only for a job's own staged files, before its commit
names them). Delta commits on S3 use conditional writes (put-if-absent), which AWS S3,
MinIO and moto support, so two commits of one version never both succeed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from relay.store.errors import StoreError

S3_OPTIONS = ("endpoint_url", "region", "allow_http")
DEFAULT_REGION = "us-east-1"
# Bounds on one request to an object store, so that an unreachable store fails a job (or
# a relay's look at the store) in seconds rather than hanging it.
S3_CONNECT_TIMEOUT_S = 5.0
S3_REQUEST_TIMEOUT_S = 60.0

# Filesystems opened by this process, by (scheme, options): one per store, not per call.
_filesystems: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
_filesystems_lock = threading.Lock()


class BadStoreLocation(StoreError):
    """A store location that cannot be used (an unknown scheme, a missing bucket name, an
    unknown option)."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str  # the last part of its path
    is_dir: bool
    size_bytes: int
    mtime_ms: int


@dataclass(frozen=True)
class StoreLocation:
    scheme: str  # "file" or "s3"
    root: str  # the store's root as the filesystem names it: "/abs/folder" or "bucket/prefix"
    options: tuple[tuple[str, str], ...] = ()  # S3 options, sorted

    # --- names --------------------------------------------------------------------------

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    @property
    def local_root(self) -> Path:
        """The folder of a local store (a job that needs a real folder asks for this)."""
        if not self.is_local:
            raise BadStoreLocation(f"store {self} is not a local folder")
        return Path(self.root)

    def path(self, relative: str = "") -> str:
        """`relative` (a name inside the store) as the filesystem names it."""
        return f"{self.root}/{relative}" if relative else self.root

    def uri(self, relative: str = "") -> str:
        """`relative` as delta-rs and other tools name it (a local path stays a path)."""
        path = self.path(relative)
        return path if self.is_local else f"s3://{path}"

    def __str__(self) -> str:
        return self.uri()

    @property
    def storage_options(self) -> dict[str, str] | None:
        """delta-rs's options for this store (None: a local folder needs none)."""
        if self.is_local:
            return None
        options = dict(self.options)
        result = {"AWS_REGION": options.get("region", DEFAULT_REGION)}
        if "endpoint_url" in options:
            result["AWS_ENDPOINT_URL"] = options["endpoint_url"]
        if options.get("allow_http") == "true":
            result["AWS_ALLOW_HTTP"] = "true"
        return result

    # --- the filesystem -------------------------------------------------------------------

    @property
    def fs(self) -> Any:
        """This process's pyarrow filesystem for the store."""
        key = (self.scheme, self.options)
        with _filesystems_lock:
            filesystem = _filesystems.get(key)
            if filesystem is None:
                filesystem = _filesystems[key] = self._open_filesystem()
            return filesystem

    def _open_filesystem(self) -> Any:
        import pyarrow.fs as pafs  # type: ignore[import-untyped]

        if self.is_local:
            return pafs.LocalFileSystem()
        options = dict(self.options)
        arguments: dict[str, Any] = {
            "region": options.get("region", DEFAULT_REGION),
            "connect_timeout": S3_CONNECT_TIMEOUT_S,
            "request_timeout": S3_REQUEST_TIMEOUT_S,
        }
        endpoint = options.get("endpoint_url")
        if endpoint:
            parts = urlsplit(endpoint)
            arguments["endpoint_override"] = parts.netloc or parts.path
            arguments["scheme"] = parts.scheme or "https"
        return pafs.S3FileSystem(**arguments)

    def boto3_client(self) -> Any:
        """A boto3 S3 client for what pyarrow cannot do (conditional writes: the lock)."""
        import boto3  # type: ignore[import-untyped]
        from botocore.config import Config  # type: ignore[import-untyped]

        options = dict(self.options)
        return boto3.client(
            "s3",
            endpoint_url=options.get("endpoint_url"),
            region_name=options.get("region", DEFAULT_REGION),
            config=Config(connect_timeout=S3_CONNECT_TIMEOUT_S, read_timeout=S3_REQUEST_TIMEOUT_S),
        )

    @property
    def bucket_and_key(self) -> tuple[str, str]:
        """An S3 store's bucket and the key prefix of its root."""
        bucket, _, prefix = self.root.partition("/")
        return bucket, prefix

    # --- files --------------------------------------------------------------------------

    def info(self, relative: str) -> FileEntry | None:
        """What is at `relative` (None: nothing)."""
        import pyarrow.fs as pafs

        found = self.fs.get_file_info(self.path(relative))
        if found.type == pafs.FileType.NotFound:
            return None
        return _entry(found)

    def is_file(self, relative: str) -> bool:
        entry = self.info(relative)
        return entry is not None and not entry.is_dir

    def is_dir(self, relative: str) -> bool:
        entry = self.info(relative)
        return entry is not None and entry.is_dir

    def list_dir(self, relative: str) -> list[FileEntry]:
        """The entries right under `relative`, by name ([] if it does not exist)."""
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.path(relative), allow_not_found=True)
        return sorted((_entry(i) for i in self.fs.get_file_info(selector)), key=lambda e: e.name)

    def make_dir(self, relative: str) -> None:
        """A local folder must exist before a file is written in it; an object store needs
        nothing (and gets no marker objects)."""
        if self.is_local:
            os.makedirs(self.path(relative), exist_ok=True)

    def read_bytes(self, relative: str) -> bytes:
        if self.is_local:  # without pyarrow: `relay status` reads _runner.json this way
            return Path(self.path(relative)).read_bytes()
        with self.fs.open_input_stream(self.path(relative)) as source:
            data: bytes = source.read()
            return data

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Write a small file whole: a reader sees the old content or the new, never a part
        (a local file is renamed into place; an S3 put is atomic)."""
        if self.is_local:
            target = Path(self.path(relative))
            target.parent.mkdir(parents=True, exist_ok=True)
            temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            temporary.write_bytes(data)
            os.replace(temporary, target)
            return
        with self.fs.open_output_stream(self.path(relative)) as sink:
            sink.write(data)

    def delete_file(self, relative: str) -> None:
        self.fs.delete_file(self.path(relative))

    def delete_dir(self, relative: str) -> None:
        """Remove `relative` and all under it (nothing if it does not exist)."""
        if self.info(relative) is not None:
            self.fs.delete_dir(self.path(relative))

    def move_in(self, source: str, relative: str) -> FileEntry:
        """Move the file at filesystem path `source` (a staged file) to `relative`; what is
        there then. (On S3 a copy and a delete.)"""
        self.make_dir(relative.rpartition("/")[0])
        self.fs.move(source, self.path(relative))
        entry = self.info(relative)
        if entry is None:
            raise StoreError(f"{self.uri(relative)} is missing right after it was written")
        return entry


@dataclass(frozen=True)
class Folder:
    """A folder inside a store (a job's staging folder), as its tasks write to it."""

    location: StoreLocation
    relative: str

    def parquet_writer(self, name: str, schema: Any, **arguments: Any) -> Any:
        """A ParquetWriter of the file `name` (may hold a `/`) in this folder; the file's
        name inside the store is `self.relative + "/" + name`."""
        import pyarrow.parquet as pq  # type: ignore[import-untyped]

        relative = f"{self.relative}/{name}"
        self.location.make_dir(relative.rpartition("/")[0])
        return pq.ParquetWriter(
            self.location.path(relative), schema, filesystem=self.location.fs, **arguments
        )


def _entry(found: Any) -> FileEntry:
    import pyarrow.fs as pafs

    mtime = found.mtime
    return FileEntry(
        name=found.base_name,
        is_dir=found.type == pafs.FileType.Directory,
        size_bytes=int(found.size or 0),
        mtime_ms=int(mtime.timestamp() * 1000) if mtime is not None else 0,
    )


# What the store's functions take: a location, or a path or URI to make one of.
StoreArg = str | os.PathLike[str] | StoreLocation


def as_location(store: StoreArg, options: Mapping[str, Any] | None = None) -> StoreLocation:
    """A store location from a path, a `file://` or `s3://` URI (query parameters are S3
    options), or a location (returned as it is). Raises BadStoreLocation."""
    if isinstance(store, StoreLocation):
        return store
    text = os.fspath(store)
    parts = urlsplit(text)
    if parts.scheme in ("", "file"):
        local = parts.path if parts.scheme == "file" else text
        if options:
            raise BadStoreLocation(f"store {text} is a local folder; it takes no S3 options")
        return StoreLocation("file", os.path.abspath(local).rstrip("/") or "/")
    if parts.scheme != "s3":
        raise BadStoreLocation(
            f"store location {text!r}: unknown scheme {parts.scheme!r} (use a path, file:// "
            "or s3://)"
        )
    if not parts.netloc:
        raise BadStoreLocation(f"store location {text!r} names no bucket")
    merged = {**dict(parse_qsl(parts.query)), **dict(options or {})}
    unknown = sorted(set(merged) - set(S3_OPTIONS))
    if unknown:
        raise BadStoreLocation(
            f"store location {text!r}: unknown S3 option(s) {', '.join(unknown)} "
            f"(known: {', '.join(S3_OPTIONS)})"
        )
    normalized = tuple(sorted((k, _option_text(v)) for k, v in merged.items()))
    root = f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/")
    return StoreLocation("s3", root, normalized)


def _option_text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
