"""CurveZMQ identities: key files, and the sockets' side of the handshake (docs/security.md).

Keys are CurveZMQ key pairs in ZeroMQ's certificate files (ZPL text, as pyzmq's `zmq.auth`
writes and reads them): `<name>.key` holds the public key, `<name>.key_secret` the public
and the secret key, readable by its owner only. Names: `relay-<id>` for a relay,
`client-<name>` for a client (its secret file also notes the name, for people: the name
that counts is the one the topology's `access:` section gives its public key).

* `generate(directory, name, ...)` writes a key pair (0600 files in a 0700 directory) and
  returns its paths; `load_identity(path)` reads a secret file (refused if others can read
  it, like ssh refuses such keys); `load_public_key(path)` reads either file's public key.
* `KeyRing` resolves a topology's keys (relay/topology/: `security:`, each relay's
  `public_key`, the `access:` clients): inline z85 keys or files under `keys_dir`.
* The relays' answers to ZeroMQ's ZAP requests (who may connect to which socket) are in
  relay/zap.py: only relays need them, and pyzmq's authenticator imports asyncio.
* `curve_server(sock, identity, domain)` / `curve_client(sock, identity, server_key)` set
  the socket options before a socket binds or connects.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
import zmq.auth
from zmq.utils import z85

from relay.errors import KeyFileError
from relay.topology import Z85_KEY_CHARS

if TYPE_CHECKING:
    from relay.topology import MeshConfig

MESH_DOMAIN = "mesh"
CLIENT_DOMAIN = "clients"
KEY_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SECRET_SUFFIX = ".key_secret"
PUBLIC_SUFFIX = ".key"


def relay_key_name(relay_id: int) -> str:
    return f"relay-{relay_id}"


def client_key_name(client: str) -> str:
    return f"client-{client}"


@dataclass(frozen=True)
class Identity:
    """A key pair (Z85 text, as ZeroMQ's socket options take them) and its file."""

    public_key: bytes
    secret_key: bytes
    path: Path | None = None


# --- key files ----------------------------------------------------------------------------


def generate(directory: Path, name: str, *, client: str = "", overwrite: bool = False) -> Path:
    """Write a new key pair `<directory>/<name>.key` and `.key_secret` (both 0600; the
    directory is made 0700 if it does not exist); the secret file's path. `client`: the
    client name to keep in the secret file. An existing pair is kept unless `overwrite`
    (KeyFileError names it)."""
    if not KEY_NAME_PATTERN.fullmatch(name):
        raise KeyFileError(f"{name!r} is not a key name (letters, digits, '_', '.', '-')")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    secret = directory / (name + SECRET_SUFFIX)
    public = directory / (name + PUBLIC_SUFFIX)
    if not overwrite and (secret.exists() or public.exists()):
        raise KeyFileError(f"{secret}: a key pair named {name!r} exists already")
    metadata = {"name": client} if client else None
    # Created under a umask that lets nobody else read them: no moment where the secret
    # is readable by others, as a chmod after writing would leave.
    previous = os.umask(0o077)
    try:
        zmq.auth.create_certificates(directory, name, metadata=metadata)
    finally:
        os.umask(previous)
    for path in (public, secret):
        path.chmod(0o600)
    return secret


def load_identity(path: str | os.PathLike[str]) -> Identity:
    """The key pair of a secret key file. KeyFileError (naming the file) if it cannot be
    read, holds no secret key, or can be read by others than its owner."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
    except FileNotFoundError:
        raise KeyFileError(f"{file}: no such key file") from None
    except OSError as e:
        raise KeyFileError(f"{file}: cannot read the key file: {e.strerror or e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            f"{file}: a secret key file must be readable by its owner only "
            f"(mode {stat.S_IMODE(mode):04o}); run: chmod 600 {file}"
        )
    public, secret = _read_certificate(file)
    if secret is None:
        raise KeyFileError(f"{file}: holds no secret key (is it the public .key file?)")
    return Identity(public, secret, file)


def load_public_key(path: Path | str) -> bytes:
    """The public key (Z85) of a key file, public or secret. KeyFileError if the file or
    its directory can be written by others than their owner, or belongs to another user
    (as ssh refuses such files: whoever can swap in their own key is let in by it)."""
    file = Path(path)
    for item, what in ((file.parent, "key directory"), (file, "key file")):
        _check_kept(item, what)
    public, _ = _read_certificate(file)
    return public


def _check_kept(path: Path, what: str) -> None:
    """`path` is owned by this user (or root) and writable by its owner only."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return  # (a missing file is named when it is read)
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    if info.st_uid not in (os.geteuid(), 0):
        raise KeyFileError(
            f"{path}: the {what} belongs to user {info.st_uid}, not to this user "
            f"({os.geteuid()}) or root"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KeyFileError(
            f"{path}: the {what} can be written by others than its owner (mode "
            f"{stat.S_IMODE(info.st_mode):04o}); run: chmod go-w {path}"
        )


def _read_certificate(file: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(file)
    except FileNotFoundError:
        raise KeyFileError(f"{file}: no such key file") from None
    except OSError as e:
        raise KeyFileError(f"{file}: cannot read the key file: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise KeyFileError(f"{file}: not a ZeroMQ key file: {e}") from None
    for key in (public, secret):
        if key is not None:
            check_z85_key(key.decode("ascii", "replace"), str(file))
    return public, secret


def check_z85_key(text: str, where: str) -> bytes:
    """`text` as a Z85 key (40 characters decoding to 32 bytes); KeyFileError naming
    `where` otherwise."""
    if len(text) != Z85_KEY_CHARS:
        raise KeyFileError(f"{where}: a key is {Z85_KEY_CHARS} Z85 characters, got {len(text)}")
    try:
        z85.decode(text)
    except (ValueError, KeyError, TypeError):
        raise KeyFileError(f"{where}: {text!r} is not Z85 text") from None
    return text.encode("ascii")


# --- a topology's keys ----------------------------------------------------------------------


class KeyRing:
    """The keys of a topology with `security.curve` on: every relay's public key, every
    client's public key and name, and where this machine's secret keys are."""

    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self.keys_dir = config.security.keys_dir

    def relay_secret_path(self, relay_id: int) -> Path:
        return self.keys_dir / (relay_key_name(relay_id) + SECRET_SUFFIX)

    def relay_identity(self, relay_id: int) -> Identity:
        identity = load_identity(self.relay_secret_path(relay_id))
        expected = self.relay_public_key(relay_id)
        if identity.public_key != expected:
            raise KeyFileError(
                f"{identity.path}: its public key is not the one the topology gives relay "
                f"{relay_id} ({expected.decode()})"
            )
        return identity

    def relay_public_key(self, relay_id: int) -> bytes:
        inline = self.config.relays[relay_id].public_key
        if inline is not None:
            return inline.encode("ascii")
        return load_public_key(self.keys_dir / (relay_key_name(relay_id) + PUBLIC_SUFFIX))

    def relay_public_keys(self) -> dict[int, bytes]:
        return {relay_id: self.relay_public_key(relay_id) for relay_id in self.config.relays}

    def client_public_key(self, client: str) -> bytes:
        inline = self.config.access.clients[client].public_key
        if inline is not None:
            return inline.encode("ascii")
        return load_public_key(self.keys_dir / (client_key_name(client) + PUBLIC_SUFFIX))

    def client_names(self) -> dict[bytes, str]:
        """Client public key (Z85) -> client name. KeyFileError naming both if a key
        belongs to two clients, or to a client and a relay: the name a key is let in
        under would otherwise depend on the order of the file."""
        owners: dict[bytes, str] = {
            key: f"relay {relay_id}" for relay_id, key in self.relay_public_keys().items()
        }
        if len(owners) < len(self.config.relays):
            seen: dict[bytes, int] = {}
            for relay_id, key in self.relay_public_keys().items():
                if key in seen:
                    raise KeyFileError(
                        f"relays {seen[key]} and {relay_id} have the same public key "
                        f"({key.decode()}): each needs its own key pair"
                    )
                seen[key] = relay_id
        names: dict[bytes, str] = {}
        for name in self.config.access.clients:
            key = self.client_public_key(name)
            other = owners.get(key)
            if other is not None:
                raise KeyFileError(
                    f"client {name!r} and {other} have the same public key "
                    f"({key.decode()}): each needs its own key pair"
                )
            owners[key] = f"client {name!r}"
            names[key] = name
        return names

    def missing(self) -> list[tuple[str, str]]:
        """(key name, client name) of the key pairs `ensure` would create: the relays' and
        clients' that the topology does not give inline and whose files are absent."""
        wanted = [
            (relay_key_name(rid), "")
            for rid, spec in self.config.relays.items()
            if spec.public_key is None
        ]
        wanted += [
            (client_key_name(name), name)
            for name, grant in self.config.access.clients.items()
            if grant.public_key is None
        ]
        return [
            (name, client)
            for name, client in wanted
            if not (self.keys_dir / (name + PUBLIC_SUFFIX)).exists()
        ]

    def ensure(self) -> list[Path]:
        """Create the key pairs that are missing (for a mesh run on one machine, as `relay
        up` and scripts/setup.sh do); the secret files written."""
        return [generate(self.keys_dir, name, client=client) for name, client in self.missing()]


# --- clients ---------------------------------------------------------------------------------

KEY_FILE_ENV = "RELAY_KEY_FILE"


@dataclass(frozen=True)
class ClientCurve:
    """What a client needs to talk CurveZMQ to a mesh: its key pair and name, and the
    public key of the relay behind each client endpoint."""

    identity: Identity
    name: str
    server_keys: dict[str, bytes]  # client endpoint -> that relay's public key

    def apply(self, sock: zmq.Socket[Any], endpoint: str) -> None:
        """Make `sock` (before it connects to `endpoint`) a CurveZMQ client of that relay."""
        curve_client(sock, self.identity, self.server_keys[endpoint])


def client_curve(
    config: MeshConfig, key_file: str | os.PathLike[str] | None = None
) -> ClientCurve | None:
    """The CurveZMQ settings of a client of `config`'s mesh (None: security.curve is off).
    The client key is `key_file`, else $RELAY_KEY_FILE, else the topology's
    security.client_key_file; KeyFileError says which are missing or wrong."""
    if not config.security.curve:
        return None
    path = key_file or os.environ.get(KEY_FILE_ENV) or config.security.client_key_file
    if not path:
        raise KeyFileError(
            f"{config.path}: security.curve is on, so a client needs its key: give "
            f"--key-file (key_file=), set {KEY_FILE_ENV}, or set security.client_key_file"
        )
    identity = load_identity(path)
    ring = KeyRing(config)
    known = ring.client_names()
    name = known.get(identity.public_key)
    if name is None:
        raise KeyFileError(
            f"{identity.path}: its public key ({identity.public_key.decode()}) belongs to no "
            f"client of {config.path}'s access section; the relays would refuse it"
        )
    server_keys = {
        spec.client_endpoint: ring.relay_public_key(rid) for rid, spec in config.relays.items()
    }
    return ClientCurve(identity, name, server_keys)


# --- sockets ---------------------------------------------------------------------------------


def curve_server(sock: zmq.Socket[Any], identity: Identity, domain: str) -> None:
    """Make `sock` a CurveZMQ server in ZAP `domain` (before it binds)."""
    sock.setsockopt(zmq.CURVE_SECRETKEY, identity.secret_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, identity.public_key)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())


def curve_client(sock: zmq.Socket[Any], identity: Identity, server_key: bytes) -> None:
    """Make `sock` a CurveZMQ client that talks only to the holder of `server_key` (before
    it connects)."""
    sock.setsockopt(zmq.CURVE_SECRETKEY, identity.secret_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, identity.public_key)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
