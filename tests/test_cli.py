"""The `relay` command: run, up, status (real relay processes on 127.0.0.1) and sim.

Every test stops every process it starts, even when it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from relay.cli import main
from relay.launcher import Mesh, MeshError, write_loopback_topology
from waiting import wait_until

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
RELAYS = 3
STREAMS = ["orders", "audit", "logs.*"]


def write_topology(tmp_path: Path, relays: int = RELAYS) -> Path:
    return write_loopback_topology(
        tmp_path, {i: STREAMS for i in range(relays)}, ["orders", "audit"]
    )


def children_of(pid: int) -> list[int]:
    """Pids whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("PPid:"):
                    if int(line.split()[1]) == pid:
                        found.append(int(entry.name))
                    break
    return found


def running(pid: int) -> bool:
    """True if the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def force_kill(pids: list[int]) -> None:
    for pid in pids:
        if running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def read_until(proc: subprocess.Popen[bytes], marker: bytes, timeout: float) -> bytes:
    """Read proc's stdout until `marker` appears; fail on timeout or early exit."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    out = b""
    deadline = time.monotonic() + timeout
    while marker not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} within {timeout} s; stdout so far:\n{out.decode()}"
        ready, _, _ = select.select([fd], [], [], min(left, 0.2))
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"exited ({proc.poll()}) before {marker!r}:\n{out.decode()}"
            out += chunk
    return out


def status_json(topology: Path, timeout: float = 1.0) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(
        main, ["status", "--config", str(topology), "--json", "--timeout", str(timeout)]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture
def mesh_cleanup() -> Iterator[list[Mesh]]:
    meshes: list[Mesh] = []
    try:
        yield meshes
    finally:
        for mesh in meshes:
            mesh.stop()


# --- relay run ---------------------------------------------------------------------------


def test_run_with_a_broken_topology_exits_2_naming_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text(
        "relays:\n  - {id: 0, host: 127.0.0.1, mesh_port: seven, client_port: 7200, "
        "streams: [a]}\n",
        encoding="utf-8",
    )
    result = CliRunner().invoke(main, ["run", "--config", str(bad), "--relay", "0"])
    assert result.exit_code == 2, result.output
    assert str(bad) in result.stderr
    assert "relays[0].mesh_port" in result.stderr

    unparsable = tmp_path / "unparsable.yaml"
    unparsable.write_text("relays: [\n", encoding="utf-8")
    result = CliRunner().invoke(main, ["run", "--config", str(unparsable), "--relay", "0"])
    assert result.exit_code == 2, result.output
    assert str(unparsable) in result.stderr and "invalid YAML" in result.stderr


def test_run_with_an_unknown_relay_exits_2(tmp_path: Path) -> None:
    topology = write_topology(tmp_path)
    result = CliRunner().invoke(main, ["run", "--config", str(topology), "--relay", "9"])
    assert result.exit_code == 2, result.output
    assert str(topology) in result.stderr and "relay 9" in result.stderr


def test_status_with_a_missing_topology_exits_3(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    result = CliRunner().invoke(main, ["status", "--config", str(missing)])
    assert result.exit_code == 3  # 0-2 say the mesh's health
    assert str(missing) in result.stderr


# --- relay up + relay status ----------------------------------------------------------------


def test_up_status_and_sigint_stops_every_relay(tmp_path: Path) -> None:
    topology = write_topology(tmp_path)
    command = [sys.executable, "-m", "relay", "up", str(topology), "--log-level", "warning"]
    command += ["--log-dir", str(tmp_path / "logs"), "--timeout", "20"]
    with open(tmp_path / "up.err", "wb") as err:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"},
        )
    children: list[int] = []
    try:
        table = read_until(proc, b"mesh up", timeout=25).decode()
        children = children_of(proc.pid)
        assert len(children) == RELAYS, children
        for pid in children:
            assert str(pid) in table

        code, doc = status_json(topology)
        assert code == 0, doc
        assert doc["all_reachable"] is True
        assert [r["relay"] for r in doc["relays"]] == [0, 1, 2]
        for relay in doc["relays"]:
            assert relay["reachable"] and relay["fenced_streams"] == [], relay
            streams = relay["status"]["streams"]
            for name in ("orders", "audit"):
                assert streams[name]["joined"] is True, (relay["relay"], streams)
                assert streams[name]["fenced"] is False, (relay["relay"], streams)

        human = CliRunner().invoke(main, ["status", "--config", str(topology)])
        assert human.exit_code == 0, human.output
        assert "orders" in human.stdout and ": healthy (3 of 3 relays answer)" in human.stdout

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0, (tmp_path / "up.err").read_text()
        wait_until(
            lambda: not any(running(pid) for pid in children),
            lambda: (
                "every relay to exit with `relay up`; still running: "
                f"{[pid for pid in children if running(pid)]}"
            ),
        )

        code, doc = status_json(topology, timeout=0.3)
        assert code == 2 and doc["health"] == "down"
        assert [r["reachable"] for r in doc["relays"]] == [False] * RELAYS
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        force_kill(children)
        if proc.stdout is not None:
            proc.stdout.close()


# --- the Mesh class ------------------------------------------------------------------------


def test_mesh_kill_restart_and_stop(tmp_path: Path, mesh_cleanup: list[Mesh]) -> None:
    topology = write_topology(tmp_path)
    mesh = Mesh(topology, log_level="warning", log_dir=tmp_path / "logs")
    mesh_cleanup.append(mesh)
    with mesh.start(timeout_s=20):
        assert set(mesh.endpoints) == {0, 1, 2}
        assert mesh.endpoints[1].client.startswith("tcp://127.0.0.1:")
        pids = mesh.pids

        assert mesh.kill(1) == -signal.SIGKILL
        assert not mesh.alive(1)
        replies = mesh.statuses(timeout_s=0.3)
        assert [r.reachable for r in replies.values()] == [True, False, True]

        mesh.restart(1, timeout_s=20)
        assert mesh.alive(1) and mesh.pids[1] != pids[1]
        status = mesh.status(1)
        assert status is not None and status["streams"]["orders"]["joined"]
        pids = mesh.pids
    codes = mesh.stop()
    assert codes == {0: 0, 1: 0, 2: 0}, codes  # `relay run` exits 0 on SIGTERM
    assert not [pid for pid in pids.values() if running(pid)]


def test_mesh_start_names_the_relay_that_does_not_come_up(
    tmp_path: Path, mesh_cleanup: list[Mesh]
) -> None:
    topology = write_topology(tmp_path)
    mesh = Mesh(topology, log_level="warning", log_dir=tmp_path / "logs")
    mesh_cleanup.append(mesh)
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        taken.bind(("127.0.0.1", mesh.config.relays[2].mesh_port))
        taken.listen()
        with pytest.raises(MeshError) as info:
            mesh.start(timeout_s=20)
    finally:
        taken.close()
    assert info.value.relay_id == 2
    assert "relay 2" in str(info.value) and "Address already in use" in str(info.value)
    assert not [pid for pid in mesh.pids.values() if running(pid)]


# --- relay sim ------------------------------------------------------------------------------


def test_sim_still_works() -> None:
    result = CliRunner().invoke(main, ["sim", "--seeds", "2", "--relays", "3"])
    assert result.exit_code == 0, result.output
    assert "2 passed, 0 failed" in result.output


# --- relay up: ports, restarts, Ctrl-C --------------------------------------------------------


def relay_processes_of(topology: Path, relay_id: int | None = None) -> list[int]:
    """Pids of the running `relay run` processes of this topology (of one relay, if
    given), from Linux /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            command = (entry / "cmdline").read_bytes().split(b"\0")
            ours = b"run" in command and str(topology.resolve()).encode() in command
            if relay_id is not None:
                ours = ours and command[command.index(b"--relay") + 1] == str(relay_id).encode()
            if ours and running(int(entry.name)):
                found.append(int(entry.name))
    return found


def start_up(topology: Path, tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    """`relay up` with the topology from $RELAY_CONFIG, its stderr in tmp_path/up.err."""
    command = [sys.executable, "-m", "relay", "up", "--log-level", "warning", *args]
    with open(tmp_path / "up.err", "wb") as err:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "RELAY_CONFIG": str(topology)},
        )


def stop(proc: subprocess.Popen[bytes], topology: Path) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)
    force_kill(relay_processes_of(topology))
    if proc.stdout is not None:
        proc.stdout.close()


def test_up_refuses_a_port_in_use_naming_it_and_starts_nothing(tmp_path: Path) -> None:
    topology = write_topology(tmp_path)
    port = Mesh(topology).config.relays[1].client_port
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    proc = None
    try:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = start_up(topology, tmp_path, "--log-dir", str(tmp_path / "logs"))
        assert proc.wait(timeout=30) == 1
        err = (tmp_path / "up.err").read_text()
        assert f"relay 1's client port {port} on 127.0.0.1: in use" in err, err
        assert "nothing was started" in err and "mesh up" not in err
        assert not (tmp_path / "logs").exists()  # no relay ever ran
    finally:
        taken.close()
        if proc is not None:
            stop(proc, topology)


def test_up_restarts_a_relay_that_dies_and_logs_it(tmp_path: Path) -> None:
    topology = write_topology(tmp_path)
    proc = start_up(topology, tmp_path, "--log-format", "json", "--timeout", "30")
    try:
        read_until(proc, b"mesh up", timeout=40)
        [old] = relay_processes_of(topology, 1)
        os.kill(old, signal.SIGKILL)

        def relay_1_back() -> bool:
            code, _ = status_json(topology, timeout=0.5)
            return code == 0 and old not in relay_processes_of(topology, 1)

        wait_until(relay_1_back, "relay 1 to be started again and the mesh healthy")
        logged = [
            json.loads(line)
            for line in (tmp_path / "up.err").read_text().splitlines()
            if line.startswith("{")
        ]
        exited = [
            d for d in logged if d.get("relay") == 1 and "exited with code -9" in d["message"]
        ]
        again = [d for d in logged if d.get("relay") == 1 and "started again" in d["message"]]
        assert exited and exited[0]["level"] == "warning" and exited[0]["restart_in_s"] == 1.0
        assert again and again[0]["restarts"] == 1, logged
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        wait_until(lambda: not relay_processes_of(topology), "every relay to stop with relay up")
    finally:
        stop(proc, topology)


def test_up_stopped_while_it_starts_exits_0_and_leaves_no_relay(tmp_path: Path) -> None:
    topology = write_topology(tmp_path)
    proc = start_up(topology, tmp_path, "--config", str(topology), "--timeout", "60")
    try:
        wait_until(
            lambda: "waiting until each serves" in (tmp_path / "up.err").read_text(),
            "relay up to start the relays",
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, (tmp_path / "up.err").read_text()
        err = (tmp_path / "up.err").read_text()
        assert "Aborted!" not in err and "mesh stopped" in err
        wait_until(lambda: not relay_processes_of(topology), "every relay to stop with relay up")
    finally:
        stop(proc, topology)


def test_up_takes_the_topology_once(tmp_path: Path) -> None:
    topology = write_topology(tmp_path)
    result = CliRunner().invoke(main, ["up", str(topology), "--config", str(tmp_path / "b.yaml")])
    assert result.exit_code == 2 and "two topologies" in result.stderr
    result = CliRunner().invoke(main, ["up"], env={"RELAY_CONFIG": None})
    assert result.exit_code == 2 and "no topology" in result.stderr


def test_the_port_check_covers_the_http_port(tmp_path: Path) -> None:
    import yaml  # type: ignore[import-untyped]

    topology = write_topology(tmp_path)
    doc = yaml.safe_load(topology.read_text())
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        doc["relays"][2]["http_port"] = port
        topology.write_text(yaml.safe_dump(doc))
        mesh = Mesh(topology)
        with pytest.raises(MeshError) as info:
            mesh.start(timeout_s=20)
    finally:
        taken.close()
    assert info.value.relay_id == 2 and f"relay 2's http port {port}" in str(info.value)
    assert mesh.pids == {}  # nothing was started
