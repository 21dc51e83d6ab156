"""`relay store ingest|snapshot|verify` from a topology, on a synthetic spool (real Spark,
one session per command, as a user runs them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")
from relay.tools.synthetic import StreamRecords, generate, write_spools
from store_topology import spooling_topology

STORE_CLI_TIMEOUT_S = 240
ROOT = Path(__file__).resolve().parent.parent
# spark-submit of the Python environment that runs the tests (pip's pyspark ships it).
SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"


def relay_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        capture_output=True,
        text=True,
        timeout=STORE_CLI_TIMEOUT_S,
    )


def spooled_topology(tmp_path: Path) -> tuple[Path, list[StreamRecords]]:
    """A one-relay topology whose data directory holds the spools of two streams."""
    topology = spooling_topology(tmp_path)
    records = [generate("s.a", 300, seed=1), generate("s.b", 120, seed=2)]
    write_spools(str(tmp_path / "data" / "spool"), records, relays=3, segment_records=100)
    return topology, records


def test_ingest_snapshot_verify_from_the_topology(tmp_path: Path) -> None:
    topology, records = spooled_topology(tmp_path)

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


def test_a_second_writer_exits_naming_the_holder(tmp_path: Path) -> None:
    """While another job writes the store, `relay store ingest` touches nothing and says
    who holds it (exit 1); once it is free the same command ingests."""
    from relay.store.lock import WriterLock

    topology, records = spooled_topology(tmp_path)
    store = tmp_path / "data" / "store"
    with WriterLock(store, "a snapshot run by hand"):
        refused = relay_cli("store", "ingest", "--config", str(topology), "--wait-s", "0.5")
        assert refused.returncode == 1
        assert "is being written by a snapshot run by hand (pid" in refused.stderr
        assert not (store / "streams").exists()
    done = relay_cli("store", "ingest", "--config", str(topology))
    assert done.returncode == 0, done.stderr
    assert f"s.a: last seq {records[0].seqs[-1]}" in done.stdout


@pytest.mark.skipif(not SPARK_SUBMIT.exists(), reason="no spark-submit next to this Python")
def test_spark_submit_runs_the_same_command(tmp_path: Path) -> None:
    """docs/store.md 4: `spark-submit relay/__main__.py store ingest --config ...` runs the
    same click command under spark-submit, and its exit code is the command's."""
    topology, records = spooled_topology(tmp_path)
    submit = [str(SPARK_SUBMIT), "--master", "local[1]", str(ROOT / "relay" / "__main__.py")]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}

    def submitted(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*submit, *args],
            capture_output=True,
            text=True,
            timeout=STORE_CLI_TIMEOUT_S,
            env=env,
            cwd=tmp_path,
        )

    done = submitted("store", "ingest", "--config", str(topology))
    assert done.returncode == 0, done.stderr
    assert f"s.a: last seq {records[0].seqs[-1]}" in done.stdout

    broken = tmp_path / "bad.yaml"
    broken.write_text("relays: []\n")
    refused = submitted("store", "verify", "--config", str(broken))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    # spark-submit hands the driver's stderr on through its stdout.
    assert "bad.yaml" in refused.stdout + refused.stderr


def test_a_broken_topology_is_named(tmp_path: Path) -> None:
    topology = tmp_path / "bad.yaml"
    topology.write_text("relays: []\n")
    done = relay_cli("store", "verify", "--config", str(topology))
    assert done.returncode == 2
    assert "bad.yaml" in done.stderr
