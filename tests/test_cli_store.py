"""`relay store ingest|snapshot|verify` from a topology, on a synthetic spool (real Spark,
one session per command, as a user runs them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")
from relay.tools.synthetic import generate, write_spools

STORE_CLI_TIMEOUT_S = 240


def relay_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        capture_output=True,
        text=True,
        timeout=STORE_CLI_TIMEOUT_S,
    )


def test_ingest_snapshot_verify_from_the_topology(tmp_path: Path) -> None:
    topology = tmp_path / "config" / "topology.yaml"
    topology.parent.mkdir()
    topology.write_text(
        "relays:\n"
        "  - {id: 0, host: 127.0.0.1, mesh_port: 7100, client_port: 7200, streams: [s.*]}\n"
        "data_dir: ../data\n"
        "spool: {enabled: true}\n"
    )
    records = [generate("s.a", 300, seed=1), generate("s.b", 120, seed=2)]
    write_spools(str(tmp_path / "data" / "spool"), records, relays=3, segment_records=100)

    done = relay_cli("store", "ingest", "--config", str(topology))
    assert done.returncode == 0, done.stderr
    assert "records from" in done.stdout
    assert f"s.a: last seq {records[0].seqs[-1]}" in done.stdout
    assert f"s.b: last seq {records[1].seqs[-1]}" in done.stdout

    snap = relay_cli("store", "snapshot", "--config", str(topology), "--stream", "s.a")
    assert snap.returncode == 0, snap.stderr
    assert f"snapshot s.a: seq {records[0].seqs[-1]}" in snap.stdout
    assert "s.b" not in snap.stdout  # only the stream asked for is built

    checked = relay_cli("store", "verify", "--config", str(topology))
    assert checked.returncode == 0, checked.stderr
    assert f"verified s.b: chain intact to seq {records[1].seqs[-1]}" in checked.stdout


def test_a_broken_topology_is_named(tmp_path: Path) -> None:
    topology = tmp_path / "bad.yaml"
    topology.write_text("relays: []\n")
    done = relay_cli("store", "verify", "--config", str(topology))
    assert done.returncode == 2
    assert "bad.yaml" in done.stderr
