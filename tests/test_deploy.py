"""docs/deploy.md, run as it says: three relays in three network namespaces, started from
the guide's topology, keys and systemd units (root, `ip`, `iptables`); its units as
`systemd-analyze verify` reads them; and, on this host with no root, a relay bound to the
wildcard that advertises 127.0.0.1.

The guide marks what is run with `<!-- deploy-test: NAME -->` before a fenced block. The
hosts' file systems are folders: each path under /etc/relay, /var/lib/relay or the
operator's home (`~`) is that path under the host's folder, and the relay command of
/opt/relay is this checkout's.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]

from browser import INSTALL_TIMEOUT_S, Browser, find_chromium
from relay.client import Consumer, Producer
from relay.launcher import Mesh, query_status, write_loopback_topology
from relay.security import client_curve
from relay.tools.netns import ChaosNet, NetBusy, leftovers
from relay.topology import MeshConfig, RelaySpec, load
from waiting import wait_until

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "deploy.md"
RELAY = Path(sys.executable).parent / "relay"  # the guide's /opt/relay/.venv/bin/relay
INSTALLED_RELAY = "/opt/relay/.venv/bin/relay"
HOST_PATHS = ("/etc/relay", "/var/lib/relay")  # a host's own files, under its folder
RELAYS = 3
STREAM = "orders.eu"
RECORDS = 5
HTTP_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 60.0  # one command of the guide (`relay keygen`, `relay status`)
TOOLS = ("ip", "iptables", "ss")
READY_WAIT_S = 120.0  # a relay's start and join, generous for a loaded machine
PAGE_WAIT_S = 180.0  # until the page shows what a test waits for, over many browser runs
LOCK_WAIT_S = 120.0  # for another test's namespaces to go (a `relay chaos` run: skip)


# --- reading the guide ----------------------------------------------------------------------


def guide_block(name: str) -> str:
    """The fenced block right after `<!-- deploy-test: name -->` in the guide."""
    text = GUIDE.read_text(encoding="utf-8")
    found = re.search(rf"<!-- deploy-test: {re.escape(name)} -->\n```\w*\n(.*?)\n```", text, re.S)
    assert found is not None, f"{GUIDE} has no block marked deploy-test: {name}"
    return found.group(1)


def unit_settings(text: str) -> dict[str, list[str]]:
    """A unit file's settings, name -> values in order (comments and sections left out)."""
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        name, _, value = line.partition("=")
        settings.setdefault(name.strip(), []).append(value.strip())
    return settings


def timespan_s(text: str) -> float:
    """A systemd time span of the units: `30`, `30s`, `15min`."""
    found = re.fullmatch(r"(\d+)\s*(s|min)?", text)
    assert found is not None, f"not a time span the test reads: {text!r}"
    return int(found.group(1)) * (60 if found.group(2) == "min" else 1)


@dataclass(frozen=True)
class Unit:
    """What the test takes of a unit: the command, its environment, how it is stopped."""

    exec_start: str
    environment: dict[str, str]
    kill_signal: signal.Signals
    stop_timeout_s: float
    max_open_files: int | None

    @classmethod
    def from_guide(cls, name: str) -> Unit:
        settings = unit_settings(guide_block(name))
        (exec_start,) = settings["ExecStart"]
        environment = dict(
            pair.split("=", 1)
            for line in settings.get("Environment", [])
            for pair in shlex.split(line)
        )
        (nofile,) = settings.get("LimitNOFILE", [None])
        return cls(
            exec_start=exec_start,
            environment=environment,
            kill_signal=signal.Signals[settings.get("KillSignal", ["SIGTERM"])[0]],
            stop_timeout_s=timespan_s(settings.get("TimeoutStopSec", ["90"])[0]),
            max_open_files=None if nofile is None else int(nofile),
        )


@dataclass(frozen=True)
class Machine:
    """One host of the guide as a folder: its /etc/relay, /var/lib/relay and home."""

    folder: Path

    def path(self, text: str) -> str:
        """`text` with the host's paths and the guide's relay command made local."""
        text = text.replace(INSTALLED_RELAY, str(RELAY))
        for path in HOST_PATHS:
            text = text.replace(path, f"{self.folder}{path}")
        return re.sub(r"(?<![\w/])~/", f"{self.folder}/home/", text)

    @property
    def topology(self) -> Path:
        return Path(self.path("/etc/relay/topology.yaml"))

    def command(self, line: str, **specifiers: str) -> list[str]:
        """A command line of the guide as this host would run it: from its relay command
        on (a `runuser -u relay --` before it is left out), `%i` and `$ID` filled in."""
        for name, value in specifiers.items():
            line = line.replace(name, value)
        argv = shlex.split(line)
        start = next(i for i, word in enumerate(argv) if word == INSTALLED_RELAY)
        return [self.path(word) for word in argv[start:]]


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False, **kwargs
    )


def make_keys(relay_hosts: list[Machine], ops: Machine) -> dict[str, str]:
    """Run the guide's `relay keygen` lines (those with $ID on every relay host, the others
    on ops); return each key pair's name -> its public key, as printed."""
    public: dict[str, str] = {}
    for line in guide_block("keygen").splitlines():
        if INSTALLED_RELAY + " keygen" not in line:
            continue
        hosts = list(enumerate(relay_hosts)) if "$ID" in line else [(None, ops)]
        for relay_id, host in hosts:
            argv = host.command(line, **({"$ID": str(relay_id)} if relay_id is not None else {}))
            done = run(argv)
            assert done.returncode == 0, f"{shlex.join(argv)}: {done.stderr}"
            name = argv[argv.index("--name") + 1]
            public[name] = done.stdout.strip()
    return public


def write_topology(hosts: list[Machine], public_keys: dict[str, str]) -> None:
    """The guide's topology with the public keys filled in, on every host."""
    text = guide_block("topology")
    for name, key in public_keys.items():
        text = text.replace(f"<public key of {name}>", key)
    assert "<public key of" not in text, "the keys block makes no key for a placeholder"
    for host in hosts:
        host.topology.parent.mkdir(parents=True, exist_ok=True)
        host.topology.write_text(host.path(text), encoding="utf-8")


# --- the units as systemd reads them ------------------------------------------------------------


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_units_are_what_systemd_reads_without_a_word(tmp_path: Path) -> None:
    """`systemd-analyze verify` names every unknown setting and unreadable value (a typo
    would be ignored by systemd, so the unit would run without it)."""
    units = {"relay-unit": "relay@0.service", "store-unit": "relay-store.service"}
    paths = []
    for block, name in units.items():
        path = tmp_path / name
        # The command must exist to pass: this checkout's stands for /opt/relay's.
        path.write_text(guide_block(block).replace(INSTALLED_RELAY, str(RELAY)) + "\n")
        paths.append(str(path))
    done = run(["systemd-analyze", "verify", "--man=no", *paths])
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


# --- the three hosts in namespaces (root) -----------------------------------------------------


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(t) is None for t in TOOLS),
    reason="needs root with ip, iptables and ss (bash scripts/chaos-deps.sh)",
)


@pytest.fixture
def network() -> Iterator[ChaosNet]:
    """Three namespaces on a bridge (relay i at 10.77.0.(10+i), this host at 10.77.0.1),
    once no other run holds the network (a test of tests/test_chaos.py under xdist; skipped
    if a `relay chaos` run holds it longer); removed afterwards, failed or not."""

    def built() -> ChaosNet | None:
        try:
            return ChaosNet(RELAYS).build()
        except NetBusy:  # another run's namespaces: not ours to remove
            return None

    try:
        net = wait_until(
            built, "the other run to free the network", timeout_s=LOCK_WAIT_S, poll_s=1.0
        )
    except AssertionError as e:
        pytest.skip(str(e))
    try:
        yield net
    finally:
        net.teardown()
    assert leftovers(net.prefix) == []


class RelayProcesses:
    """The relays as their units run them, each in its namespace; stopped (or killed)
    when the block ends, failed or not."""

    def __init__(self, unit: Unit, folder: Path) -> None:
        self.unit = unit
        self.folder = folder
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, IO[bytes]] = {}

    def start(self, relay_id: int, argv: list[str]) -> None:
        log = open(self.folder / f"relay-{relay_id}.log", "wb")  # noqa: SIM115 (closed in stop)
        self.logs[relay_id] = log
        limit = self.unit.max_open_files

        def in_child() -> None:  # as systemd does: LimitNOFILE; and die with the test
            if limit is not None:  # as far as this machine lets root raise it
                hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
            import ctypes

            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

        self.procs[relay_id] = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.unit.environment},
            preexec_fn=in_child,
        )

    def log(self, relay_id: int) -> str:
        return (self.folder / f"relay-{relay_id}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> dict[int, int]:
        """Stop as systemd does: the unit's KillSignal, then SIGKILL after TimeoutStopSec.
        Returns each relay's exit code (again if called again)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(self.unit.kill_signal)
        codes = {}
        for relay_id, proc in self.procs.items():
            try:
                codes[relay_id] = proc.wait(self.unit.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[relay_id] = proc.wait()
            self.logs[relay_id].close()
        return codes

    def __enter__(self) -> RelayProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def http_status(host: str, port: int, path: str) -> tuple[int, dict[str, Any]] | None:
    """(status, JSON body) of a GET, or None if nothing answers yet."""
    conn = http.client.HTTPConnection(host, port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def routes(spec: RelaySpec) -> dict[str, int] | None:
    """The relay's routes around cut links (peer -> the relay that forwards), from
    /status; None while it does not answer."""
    assert spec.http_port is not None
    answer = http_status(spec.host, spec.http_port, "/status")
    return None if answer is None else answer[1]["route_via"]


def http_text(spec: RelaySpec, path: str) -> str:
    assert spec.http_port is not None
    conn = http.client.HTTPConnection(spec.host, spec.http_port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        assert resp.status == 200, resp.status
        return resp.read().decode()
    finally:
        conn.close()


def wait_ready(spec: RelaySpec, log: Callable[[], str]) -> None:
    """Until the relay answers 200 on /readyz at its advertised HTTP address."""
    port = spec.http_port
    assert port is not None
    wait_until(
        lambda: (http_status(spec.host, port, "/readyz") or (0,))[0] == 200,
        lambda: f"relay {spec.id} to answer 200 on {spec.http_url}/readyz: {log()}",
        timeout_s=READY_WAIT_S,
    )


def listening(net: ChaosNet, relay_id: int) -> set[str]:
    """The local addresses of the TCP sockets listening in relay_id's namespace."""
    done = run(net.command(relay_id, ["ss", "-ltnH"]))
    assert done.returncode == 0, done.stderr
    return {line.split()[3] for line in done.stdout.splitlines() if line.strip()}


@dataclass
class Deployment:
    """Three relays started as the guide says, each in its namespace (see `deployed`)."""

    net: ChaosNet
    config: MeshConfig  # the topology, as the operator's machine has it
    relays: RelayProcesses
    ops: Machine
    admin_key: str  # the operator's client key file


@contextlib.contextmanager
def deployed(tmp_path: Path, net: ChaosNet) -> Iterator[Deployment]:
    """The guide's keys, topology and relay unit on three hosts; yields once every relay
    answers /readyz; the relays are stopped when the block ends, failed or not."""
    hosts = [Machine(tmp_path / f"host-{i}") for i in range(RELAYS)]
    ops = Machine(tmp_path / "ops")
    write_topology([*hosts, ops], make_keys(hosts, ops))
    config = load(ops.topology)
    unit = Unit.from_guide("relay-unit")
    with RelayProcesses(unit, tmp_path) as relays:
        for i, host in enumerate(hosts):
            Path(host.path("/var/lib/relay")).mkdir(parents=True)  # the unit's StateDirectory
            relays.start(i, net.command(i, host.command(unit.exec_start, **{"%i": str(i)})))
        for i, spec in config.relays.items():
            wait_ready(spec, functools.partial(relays.log, i))
        admin_key = ops.path("~/.config/relay/client-admin.key_secret")
        yield Deployment(net, config, relays, ops, admin_key)


def cut_between_0_and_1(net: ChaosNet, config: MeshConfig) -> None:
    """Relays 0 and 1 no longer reach each other, both still reach 2: until each routes to
    the other via 2 (docs/protocol.md 5.13), as its /status says."""
    net.cut(0, 1)
    for here, there in ((0, 1), (1, 0)):
        spec = config.relays[here]

        def routed(spec: RelaySpec = spec, there: int = there) -> bool:
            return routes(spec) == {str(there): 2}

        def why(spec: RelaySpec = spec) -> str:
            return f"relay {spec.id} to route around the cut: {routes(spec)}"

        wait_until(routed, why, timeout_s=READY_WAIT_S)


@needs_root
def test_the_guide_runs_three_relays_on_three_hosts(tmp_path: Path, network: ChaosNet) -> None:
    net = network
    with deployed(tmp_path, net) as mesh:
        config, admin_key = mesh.config, mesh.admin_key
        for i, spec in config.relays.items():  # the guide's example addresses are the network's
            assert (spec.host, spec.bind_host) == (net.address(i), "0.0.0.0"), spec
            ports = (spec.mesh_port, spec.client_port, spec.http_port)
            wanted = {f"0.0.0.0:{port}" for port in ports}
            assert wanted <= listening(net, i), "the relay binds the wildcard, as the guide says"
        assert net.host_address == "10.77.0.1"  # ops in the guide

        status = run(
            [str(RELAY), "status", "--config", str(mesh.ops.topology), "--json"],
            env={**os.environ, "RELAY_KEY_FILE": admin_key},
        )  # as the guide: export
        assert status.returncode == 0, status.stdout + status.stderr
        document = json.loads(status.stdout)
        assert document["health"] == "healthy", document["problems"]
        for entry in document["relays"]:
            assert entry["reachable"], entry
            i = entry["relay"]
            spec = config.relays[i]
            assert entry["client_endpoint"] == f"tcp://{net.address(i)}:{spec.client_port}"
            assert all(s["joined"] for s in entry["status"]["streams"].values()), entry

        produced = produce_through(config, admin_key, 0)
        assert read_through(config, admin_key, 2) == produced

        # A partial cut: each of relays 0 and 1 routes to the other via 2, says so in
        # /metrics too, and the mesh still commits through either.
        cut_between_0_and_1(net, config)
        routed_line = 'relay_peer_routed_via{peer="1",via="2"} 1.0'
        # Waited for, not read once: on a loaded machine a late heartbeat can suspend the
        # route via 2 for a moment between the /status read above and this scrape.
        wait_until(
            lambda: routed_line in http_text(config.relays[0], "/metrics"),
            lambda: http_text(config.relays[0], "/metrics")[-3000:],
            timeout_s=READY_WAIT_S,
        )
        across = produce_through(config, admin_key, 1)
        assert read_through(config, admin_key, 0, 2 * RECORDS) == produced + across
        net.heal()
        wait_until(
            lambda: routes(config.relays[0]) == {} and routes(config.relays[1]) == {},
            "relays 0 and 1 to hear each other again",
            timeout_s=READY_WAIT_S,
        )

        store = mesh.ops.command(Unit.from_guide("store-unit").exec_start)
        done = run([*store, "--once", "--engine", "baseline"])
        assert done.returncode == 0, done.stderr

        codes = mesh.relays.stop()
    assert codes == dict.fromkeys(range(RELAYS), 0), "a relay exits 0 on the unit's KillSignal"


@needs_root
@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S + 300)
def test_the_page_shows_a_link_routed_around_a_cut(tmp_path: Path, network: ChaosNet) -> None:
    """The live page (a real Chromium on the operator's host) shows that relays 0 and 1
    send to each other through relay 2 (each still hears the other: its frames come
    forwarded by 2)."""
    executable, why = find_chromium()
    if executable is None:
        pytest.skip(why)
    browser = Browser(executable, tmp_path / "chromium-profile")
    with deployed(tmp_path, network) as mesh:
        url = mesh.config.relays[0].http_url
        assert url is not None
        cut_between_0_and_1(network, mesh.config)
        routed = [
            f'<td class="ok" data-link="{a}-{b}">hears<span class="small"> (to it via 2)</span>'
            for a, b in ((0, 1), (1, 0))
        ]

        def routed_shown() -> str | None:
            dom = browser.dom(url + "/")
            return dom if 'data-state="live"' in dom and all(r in dom for r in routed) else None

        dom = wait_until(routed_shown, "the page to show the route via 2", timeout_s=PAGE_WAIT_S)
        for a, b in ((0, 2), (2, 0), (1, 2), (2, 1)):  # the links that work
            assert f'<td class="ok" data-link="{a}-{b}">hears</td>' in dom, (a, b, dom)


def produce_through(config: MeshConfig, key_file: str, relay_id: int) -> list[tuple[int, bytes]]:
    """Produce RECORDS records through relay_id's advertised client address only."""
    curve = client_curve(config, key_file)
    endpoint = {relay_id: config.relays[relay_id].client_endpoint}
    with Producer(relays=endpoint, curve=curve, send_timeout_s=60) as producer:
        values = [b"deployed %d" % n for n in range(RECORDS)]
        return [(producer.send(STREAM, value), value) for value in values]


def read_through(
    config: MeshConfig, key_file: str, relay_id: int, count: int = RECORDS
) -> list[tuple[int, bytes]]:
    """Read `count` records of STREAM from its start through relay_id's advertised client
    address only."""
    curve = client_curve(config, key_file)
    endpoint = {relay_id: config.relays[relay_id].client_endpoint}
    with Consumer(relays=endpoint, curve=curve, store=False, timeout_s=30, count=count) as c:
        return [(record.seq, record.value) for record in c.subscribe(STREAM, "earliest")]


# --- the wildcard on this host (no root) -------------------------------------------------------


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])  # `::` takes IPv4 too
def test_a_relay_bound_to_the_wildcard_serves_its_advertised_address(
    tmp_path: Path, wildcard: str
) -> None:
    path = write_loopback_topology(tmp_path, {0: [STREAM], 1: [STREAM]}, http=True)
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    wild = doc["relays"][0]
    wild["advertise"], wild["bind"] = wild.pop("host"), wildcard
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    config = load(path)
    spec, other = config.relays[0], config.relays[1]
    assert (spec.host, spec.bind_host) == ("127.0.0.1", wildcard)

    with Mesh(path, log_level="warning", log_dir=tmp_path / "logs").start(timeout_s=30):
        # Peers and clients use the advertised address: relay 1 follows relay 0's commits.
        endpoint = {0: spec.client_endpoint}
        with Producer(relays=endpoint, send_timeout_s=60) as producer:
            seq = producer.send(STREAM, b"through the wildcard")
        with Consumer(relays={1: other.client_endpoint}, store=False, timeout_s=30) as c:
            record = next(c.subscribe(STREAM, seq - 1))
        assert (record.seq, record.value) == (seq, b"through the wildcard")

        # Relay 0 listens on every address of the host (127.0.0.2 too); relay 1, bound to
        # 127.0.0.1 alone, does not.
        elsewhere = {0: f"tcp://127.0.0.2:{spec.client_port}"}
        assert query_status(elsewhere, timeout_s=10)[0].reachable
        assert spec.http_port is not None
        answer = http_status("127.0.0.2", spec.http_port, "/healthz")
        assert answer is not None and answer[0] == 200 and answer[1]["live"], answer
        with contextlib.closing(socket.socket()) as probe:
            assert probe.connect_ex(("127.0.0.2", other.client_port)) != 0


# --- IPv6 (no root) ------------------------------------------------------------------------------


@pytest.mark.skipif(not socket.has_ipv6, reason="this Python has no IPv6")
def test_a_mesh_on_ipv6_serves_clients_over_ipv6(tmp_path: Path) -> None:
    """Relays that advertise ::1: peers, clients, `relay status` and the HTTP endpoint all
    reach them at tcp://[::1]:port (ZeroMQ needs IPv6 turned on for such endpoints, on
    every socket that connects or binds)."""
    path = write_loopback_topology(tmp_path, {r: [STREAM] for r in range(RELAYS)}, http=True)
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    for relay in doc["relays"]:
        relay["host"] = "::1"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    config = load(path)
    assert all(s.client_endpoint.startswith("tcp://[::1]:") for s in config.relays.values())

    with Mesh(path, log_level="warning", log_dir=tmp_path / "logs").start(timeout_s=60):
        with Producer(relays={0: config.relays[0].client_endpoint}, send_timeout_s=60) as p:
            seqs = [p.send(STREAM, b"over IPv6 %d" % n) for n in range(RECORDS)]
        with Consumer(
            relays={2: config.relays[2].client_endpoint}, store=False, timeout_s=30, count=RECORDS
        ) as c:
            read = [(record.seq, record.value) for record in c.subscribe(STREAM, "earliest")]
        assert read == [(seq, b"over IPv6 %d" % n) for n, seq in enumerate(seqs)]

        status = run([str(RELAY), "status", "--config", str(path), "--json"])
        assert status.returncode == 0, status.stdout + status.stderr
        assert json.loads(status.stdout)["health"] == "healthy"
        spec = config.relays[1]
        assert spec.http_port is not None
        answer = http_status("::1", spec.http_port, "/readyz")
        assert answer is not None and answer[0] == 200, answer
