"""A throwaway network for real-process fault runs: one namespace per relay on a bridge.

    with ChaosNet(relays=3) as net:        # needs root, `ip` and `iptables`
        net.address(0)                     # "10.77.0.10"; the host side is 10.77.0.1
        net.command(0, ["relay", "run", ...])  # prefix a command to run inside ns 0
        net.cut(0, 1)                      # 0 and 1 no longer hear each other
        net.cut(0, 2, one_way=True, mesh_port=7100)  # 2 no longer hears 0; 0 hears 2
        net.isolate(2)                     # 2 hears no relay and no relay hears it
        net.heal()                         # every rule gone again
    # leaving the block deletes the namespaces, links, bridge and root rules

Everything is named with a per-run prefix, `rc` and four hex digits (`rc1f2e-n0` for the
namespace of relay 0, `rc1f2e-h0` for its link's host end, `rc1f2e-br` for the bridge),
and the one rule in the root namespace (bridged frames pass FORWARD when br_netfilter is
loaded, whatever that chain's policy) carries the prefix as its comment. Runs take an
exclusive lock (`LOCK_PATH`), so whatever carries the `rc` family's names while we hold it
is a crashed run's leftover: `ChaosNet` removes it before building its own, processes in
leftover namespaces included.

Partition rules live in a chain of each relay's namespace (`CHAIN`, jumped to from INPUT
and OUTPUT), so healing flushes the chains and deleting a namespace deletes its rules.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shlex
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

__all__ = [
    "CHAIN",
    "FAMILY",
    "LOCK_PATH",
    "ChaosNet",
    "NetBusy",
    "NetError",
    "remove_leftovers",
]

FAMILY = "rc"  # every name a run creates starts with FAMILY + 4 hex digits + "-"
_NAME = re.compile(rf"^{FAMILY}[0-9a-f]{{4}}-")
CHAIN = "RELAY-CHAOS"
LOCK_PATH = Path("/run/relay-chaos.lock")
SUBNET = "10.77.0"  # /24: the host end is .1, relay i is .(10 + i)
HOST_OCTET = 1
FIRST_RELAY_OCTET = 10
MAX_RELAYS = 200  # addresses .10 .. .209 of the /24
COMMAND_TIMEOUT_S = 10.0  # one `ip` or `iptables` call
KILL_WAIT_S = 5.0  # a leftover process to go after SIGKILL


class NetError(RuntimeError):
    """The network could not be built or changed: not root, a tool missing, a command
    failed (the message has the command and its stderr), or another run holds the lock."""


class NetBusy(NetError):
    """Another run holds the lock: its namespaces are in use (callers may wait or skip)."""


def _run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except FileNotFoundError as e:
        raise NetError(f"{args[0]} not found (bash scripts/chaos-deps.sh installs it)") from e
    except subprocess.TimeoutExpired as e:
        raise NetError(f"{' '.join(args)} took over {COMMAND_TIMEOUT_S:g} s") from e
    if check and done.returncode != 0:
        raise NetError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _netns_names() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _root_rules(prefix_re: re.Pattern[str]) -> list[list[str]]:
    """The root namespace's filter rules whose comment matches, as `-D` argument lists."""
    out = _run(["iptables", "-S"], check=False).stdout
    rules = []
    for line in out.splitlines():
        match = re.search(r'--comment "?([^" ]+)"?', line)
        if line.startswith("-A ") and match and prefix_re.match(match.group(1) + "-"):
            rules.append(["-D", *shlex.split(line[3:])])
    return rules


def _kill_namespace_processes(name: str) -> None:
    out = _run(["ip", "netns", "pids", name], check=False).stdout
    pids = [int(p) for p in out.split() if p.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:  # our own children are reaped by their Popen; others by init
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def remove_leftovers(prefix: str | None = None) -> list[str]:
    """Remove namespaces (and the processes in them), links and root rules named with
    `prefix` (default: every run of the family); return what was removed."""
    pattern = re.compile(rf"^{re.escape(prefix)}-") if prefix else _NAME
    removed: list[str] = []
    for name in _netns_names():
        if pattern.match(name):
            _kill_namespace_processes(name)
            _run(["ip", "netns", "del", name], check=False)
            removed.append(f"netns {name}")
    for name in _link_names():
        if pattern.match(name):
            _run(["ip", "link", "del", name], check=False)
            removed.append(f"link {name}")
    for rule in _root_rules(pattern):
        _run(["iptables", *rule], check=False)
        removed.append(f"iptables {' '.join(rule[1:])}")
    return removed


def leftovers(prefix: str | None = None) -> list[str]:
    """What `remove_leftovers` would remove (the tests check a run left nothing)."""
    pattern = re.compile(rf"^{re.escape(prefix)}-") if prefix else _NAME
    found = [f"netns {n}" for n in _netns_names() if pattern.match(n)]
    found += [f"link {n}" for n in _link_names() if pattern.match(n)]
    found += [f"iptables {' '.join(r[1:])}" for r in _root_rules(pattern)]
    return found


class ChaosNet:
    """Namespaces on a bridge for `relays` relays (see the module doc). Build it with
    `with` or `build()`; `teardown()` is safe to call more than once and after a
    failed build."""

    def __init__(self, relays: int) -> None:
        if not 1 <= relays <= MAX_RELAYS:
            raise ValueError(f"relays must be 1..{MAX_RELAYS}, got {relays}")
        self.relays = relays
        self.prefix = f"{FAMILY}{secrets.token_hex(2)}"
        self.bridge = f"{self.prefix}-br"
        self.host_address = f"{SUBNET}.{HOST_OCTET}"
        self.removed_leftovers: list[str] = []
        self._lock: IO[str] | None = None
        self._built = False

    # --- names ---------------------------------------------------------------------------

    def namespace(self, relay: int) -> str:
        return f"{self.prefix}-n{relay}"

    def address(self, relay: int) -> str:
        return f"{SUBNET}.{FIRST_RELAY_OCTET + relay}"

    def command(self, relay: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside relay's namespace (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespace(relay), *argv]

    # --- lifecycle ------------------------------------------------------------------------

    def build(self) -> ChaosNet:
        if os.geteuid() != 0:
            raise NetError("network namespaces and iptables need root")
        self._take_lock()
        try:
            self.removed_leftovers = remove_leftovers()
            self._build()
        except BaseException:
            self.teardown()
            raise
        self._built = True
        return self

    def _take_lock(self) -> None:
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        lock = open(LOCK_PATH, "a+", encoding="utf-8")  # noqa: SIM115 (held until teardown)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            lock.close()
            raise NetBusy(f"another relay chaos run holds {LOCK_PATH} (pid {holder})") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._lock = lock

    def _build(self) -> None:
        br = self.bridge
        _run(["ip", "link", "add", br, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.host_address}/24", "dev", br])
        _run(["ip", "link", "set", br, "up"])
        _run(
            [
                "iptables", "-I", "FORWARD", "-i", br, "-o", br, "-j", "ACCEPT",
                "-m", "comment", "--comment", self.prefix,
            ]
        )  # fmt: skip
        for relay in range(self.relays):
            ns, host_end, ns_end = self.namespace(relay), f"{self.prefix}-h{relay}", "eth0"
            temp_end = f"{self.prefix}-v{relay}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", temp_end])
            _run(["ip", "link", "set", host_end, "master", br])
            _run(["ip", "link", "set", host_end, "up"])
            _run(["ip", "link", "set", temp_end, "netns", ns])
            inside = ["ip", "netns", "exec", ns]
            _run([*inside, "ip", "link", "set", temp_end, "name", ns_end])
            _run([*inside, "ip", "addr", "add", f"{self.address(relay)}/24", "dev", ns_end])
            _run([*inside, "ip", "link", "set", ns_end, "up"])
            _run([*inside, "ip", "link", "set", "lo", "up"])
            _run([*inside, "iptables", "-N", CHAIN])
            _run([*inside, "iptables", "-A", "INPUT", "-j", CHAIN])
            _run([*inside, "iptables", "-A", "OUTPUT", "-j", CHAIN])

    def teardown(self) -> list[str]:
        """Delete everything of this run (processes still in its namespaces are killed);
        release the lock. Returns what was removed."""
        removed: list[str] = []
        try:
            removed = remove_leftovers(self.prefix)
        finally:
            self._built = False
            if self._lock is not None:
                with contextlib.suppress(OSError):
                    self._lock.truncate(0)
                self._lock.close()  # closing releases the flock
                self._lock = None
        return removed

    def __enter__(self) -> ChaosNet:
        if not self._built:
            self.build()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.teardown()

    # --- faults ---------------------------------------------------------------------------

    def _add(self, relay: int, rule: list[str]) -> None:
        _run([*self.command(relay, ["iptables"]), "-A", CHAIN, *rule])

    def cut(self, a: int, b: int, *, one_way: bool = False, mesh_port: int | None = None) -> None:
        """Cut the link between relays a and b. Both ways: every packet between their
        addresses is dropped (in a's namespace). One way: what a publishes no longer
        reaches b (b's subscription to a's PUB socket on `mesh_port` stalls) while b's
        messages still reach a; only that TCP connection is touched, since dropping all of
        a's packets to b would also drop the acknowledgements of b's connection."""
        peer = self.address(b)
        if not one_way:
            self._add(a, ["-s", peer, "-j", "DROP"])
            self._add(a, ["-d", peer, "-j", "DROP"])
            return
        if mesh_port is None:
            raise ValueError("a one-way cut needs a's mesh_port")
        self._add(a, ["-d", peer, "-p", "tcp", "--sport", str(mesh_port), "-j", "DROP"])
        self._add(a, ["-s", peer, "-p", "tcp", "--dport", str(mesh_port), "-j", "DROP"])

    def isolate(self, relay: int) -> None:
        """Cut `relay` from every other relay, both ways; clients (the host) still reach
        it, so they hear it answer `fenced`."""
        for other in range(self.relays):
            if other != relay:
                self.cut(relay, other)

    def heal(self, relay: int | None = None) -> None:
        """Drop the partition rules of one relay's namespace, or of every one."""
        for r in range(self.relays) if relay is None else [relay]:
            _run([*self.command(r, ["iptables"]), "-F", CHAIN])
