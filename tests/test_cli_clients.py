"""`relay produce`, `relay consume` and the main job (scripts/main_job.py) against a real
3-relay mesh on 127.0.0.1 (free ports). Every mesh is stopped, even when a test fails."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from relay.cli import main
from relay.launcher import Mesh, write_loopback_topology

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
MAIN_JOB = ROOT / "scripts" / "main_job.py"
STREAM = "orders.eu"


def write_topology(directory: Path, relays: int = 3) -> Path:
    return write_loopback_topology(
        directory, {i: ["orders.*", "audit"] for i in range(relays)}, [STREAM, "audit"]
    )


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A running 3-relay mesh; yields its topology file."""
    directory = tmp_path_factory.mktemp("mesh")
    path = write_topology(directory)
    mesh = Mesh(path, log_level="warning", log_dir=directory / "logs")
    try:
        mesh.start(timeout_s=20)
        yield path
    finally:
        mesh.stop()


def run_cli(args: list[str], stdin: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, args, input=stdin)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_produce_then_consume_from_another_relay(topology: Path) -> None:
    values = ["alpha", "beta", "gamma \u00e9", "", "epsilon"]
    code, out, err = run_cli(
        ["produce", "--config", str(topology), "--stream", STREAM, "--relay", "0", "--key", "k"],
        stdin="\n".join(values) + "\n",
    )
    assert code == 0, err
    produced = json_lines(out)
    assert len(produced) == 5
    assert all(p["outcome"] == "committed" and p["stream"] == STREAM for p in produced)
    seqs = [p["seq"] for p in produced]  # strings: seqs are above 2**53
    assert all(isinstance(s, str) and s.isdigit() for s in seqs) and len(set(seqs)) == 5
    value_of = dict(zip(seqs, values, strict=True))

    code, out, err = run_cli(
        [
            *("consume", "--config", str(topology), "--stream", STREAM, "--relay", "1"),
            *("--from", "earliest", "--count", "5", "--timeout-s", "10"),
        ]
    )
    assert code == 0, err
    records = json_lines(out)
    assert [r["seq"] for r in records] == sorted(value_of, key=int)  # the same, in order
    for record in records:
        assert record["stream"] == STREAM and record["key"] == "k"
        assert record["value"] == value_of[record["seq"]]

    # --from SEQ reads what follows it; --base64 encodes; --timeout-s ends an idle read.
    code, out, err = run_cli(
        [
            *("consume", "--config", str(topology), "--stream", STREAM, "--relay", "2"),
            *("--from", str(records[2]["seq"]), "--base64", "--timeout-s", "1"),
        ]
    )
    assert code == 0, err
    tail = json_lines(out)
    assert [r["seq"] for r in tail] == [r["seq"] for r in records[3:]]
    assert tail[-1]["key"] == "aw=="  # base64 of b"k"


def test_consume_an_unknown_stream_exits_1(topology: Path) -> None:
    code, out, err = run_cli(
        ["consume", "--config", str(topology), "--stream", "no.such.stream", "--timeout-s", "5"]
    )
    assert code == 1
    assert out == ""
    assert "unknown stream" in err and "no.such.stream" in err


def test_produce_to_an_unknown_stream_reports_rejected_and_exits_1(topology: Path) -> None:
    code, out, err = run_cli(
        ["produce", "--config", str(topology), "--stream", "no.such.stream"], stdin="x\n"
    )
    assert code == 1
    [line] = json_lines(out)
    assert line["outcome"] == "rejected" and line["seq"] is None
    assert "unknown_stream" in str(line["reason"])
    assert "1 of 1" in err


MAIN_JOB_TIMEOUT_S = 300  # two meshes and two Spark commands


@pytest.mark.timeout(MAIN_JOB_TIMEOUT_S + 30)
def test_main_job_round_trip(topology: Path, tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    # Its own mesh, on other free ports, spooling: the whole path through the store.
    other = write_loopback_topology(
        tmp_path / "job",
        {i: ["orders.*", "audit"] for i in range(3)},
        [STREAM, "audit"],
        spool={"enabled": True},
    )
    proc = subprocess.run(
        [sys.executable, str(MAIN_JOB), "--count", "200", "--config", str(other)],
        capture_output=True,
        text=True,
        timeout=MAIN_JOB_TIMEOUT_S,
        cwd=ROOT,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.count("200 committed") == 2
    assert "consumed 200 from earliest (relay 1 first)" in out
    assert "ingest: 200 records" in out and "snapshot orders.eu" in out
    assert (
        "consumed 400 from earliest (relay 1 first)" in out and "200 of them from the store" in out
    )
    assert "$ relay consume --stream orders.eu --from earliest" in out and "400 lines" in out
    assert "OK: all 400 committed seqs came back once and in order across the store" in out


def test_main_job_says_when_the_ports_are_in_use(topology: Path) -> None:
    # The module's mesh holds every port of `topology`.
    proc = subprocess.run(
        [sys.executable, str(MAIN_JOB), "--count", "10", "--config", str(topology)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "in use" in proc.stderr and "relay status" in proc.stderr
