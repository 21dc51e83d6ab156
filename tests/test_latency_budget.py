"""scripts/latency_budget.py runs end to end, reports figures and leaves no process behind.

Only shape is checked: the figures are measurements, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from script_modules import load_script


@pytest.fixture(scope="module")
def budget() -> ModuleType:
    return load_script("latency_budget")


ROOT = Path(__file__).resolve().parent.parent


def _model_processes() -> list[int]:
    """This process's children that are relays of the model (started with --serve-relay,
    or the C relay), of --relay's mesh or of --peers' NATS cluster, and still there;
    another test worker's do not count."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes()
                status = (entry / "status").read_text()
            except OSError:
                continue
            parent = int(status.split("PPid:", 1)[1].split()[0])
            model = any(
                mark in command
                for mark in (b"--serve-relay", b"latency_budget_relay", b"latency-budget-")
            )
            if parent == os.getpid() and model:
                found.append(int(entry.name))
    return found


def test_quick_json_reports_every_work_level(
    budget: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert budget.main(["--quick", "--json", "--work-us", "0,30"]) == 0
    report = json.loads(capsys.readouterr().out)
    runs = report["runs"]
    assert [run["work_us"] for run in runs] == [0, 30]
    for run in runs:
        assert run["transactions"] > 0, run
        assert 0 < run["p50_us"] <= run["p90_us"], run
        assert set(run["cpu_us_per_tx"]) == {"client", "relay0", "relay1", "relay2"}, run
        assert run["cpu_us_per_tx_all"] > 0, run
    assert _model_processes() == []


def test_the_table_names_its_rows(budget: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--work-us", "5", "--free-peer-reports", "--duration-s", "0.2"]
    assert budget.main(argv) == 0
    out = capsys.readouterr().out
    assert "members take each other's reports for free" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("5 ")]
    assert len(rows) == 1 and rows[0][1] == "python" and int(rows[0][2]) > 0, out
    assert _model_processes() == []


@pytest.mark.parametrize("bad", [["--work-us", "x"], ["--work-us", "-1"], ["--duration-s", "0"]])
def test_bad_options_are_usage_errors(budget: ModuleType, bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        budget.main(bad)
    assert exc.value.code == 2


def test_a_relay_that_cannot_start_is_named(
    budget: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The children run this interpreter: one that exits at once never says "ready".
    monkeypatch.setattr(budget.sys, "executable", "/bin/false")
    assert budget.main(["--quick", "--work-us", "0"]) == 3
    assert "relay 0 of the model did not start" in capsys.readouterr().err
    assert _model_processes() == []


def test_native_relays_run_beside_the_python_ones(
    budget: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert budget.main(["--quick", "--json", "--native", "--work-us", "0,20"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(run["work_us"], run["relays"]) for run in runs] == [
        (0, "python"),
        (0, "c"),
        (20, "python"),
        (20, "c"),
    ]
    for run in runs:
        assert run["transactions"] > 0 and 0 < run["p50_us"] <= run["p90_us"], run
        assert set(run["cpu_us_per_tx"]) == {"client", "relay0", "relay1", "relay2"}, run
    assert _model_processes() == []


def test_native_without_a_compiler_is_named(
    budget: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(budget.shutil, "which", lambda name: None)
    assert budget.main(["--quick", "--native", "--work-us", "0"]) == 3
    assert "no C compiler (gcc or cc) on PATH" in capsys.readouterr().err
    assert _model_processes() == []


def test_native_build_errors_are_reported(
    budget: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("int main(void) { return not_declared; }\n")
    monkeypatch.setattr(budget, "NATIVE_SOURCE", broken)
    assert budget.main(["--quick", "--native", "--work-us", "0"]) == 3
    err = capsys.readouterr().err
    assert "failed" in err and "not_declared" in err, err
    assert _model_processes() == []


def test_work_at_places_a_latency_on_the_sweep(budget: ModuleType) -> None:
    runs = [
        {"work_us": 0, "relays": "python", "p50_us": 300.0},
        {"work_us": 20, "relays": "python", "p50_us": 400.0},
        {"work_us": 40, "relays": "python", "p50_us": 500.0},
        {"work_us": 0, "relays": "c", "p50_us": 250.0},
        {"work_us": 20, "relays": "c", "p50_us": 250.0},
    ]
    assert budget.work_at(runs, "python", 450.0) == 30.0
    assert budget.work_at(runs, "python", 300.0) == 0.0
    assert budget.work_at(runs, "python", 500.0) == 40.0
    assert budget.work_at(runs, "python", 299.0) is None  # faster than the floor
    assert budget.work_at(runs, "python", 501.0) is None  # beyond the sweep
    assert budget.work_at(runs, "c", 250.0) == 0  # a flat stretch: its first row
    assert budget.work_at(runs, "c", 400.0) is None


def test_the_mesh_is_measured_beside_the_model(
    budget: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """--relay: this project's mesh, one in flight, placed on the sweep (a real mesh of
    three relay processes, stopped afterwards)."""
    assert budget.main(["--quick", "--json", "--relay", "--work-us", "0,5000"]) == 0
    report = json.loads(capsys.readouterr().out)
    [mesh] = report["compared"]
    assert mesh["relays"] == "relay" and mesh["transactions"] > 0, mesh
    assert 0 < mesh["p50_us"] <= mesh["p90_us"], mesh
    assert set(mesh["cpu_us_per_tx"]) == {"client", "relay0", "relay1", "relay2"}, mesh
    # Placed on this run's own python rows (the C model was not asked for).
    assert mesh["work_us_like"] == {
        "python": budget.work_at(report["runs"], "python", mesh["p50_us"])
    }, report
    assert _model_processes() == []


def test_the_table_places_the_mesh(budget: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert budget.main(["--quick", "--relay", "--work-us", "0"]) == 0
    out = capsys.readouterr().out
    assert "this project's mesh runs like the model at work/frame us: python " in out, out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("- ")]
    assert len(rows) == 1 and rows[0][1] == "relay" and int(rows[0][2]) > 0, out
    assert _model_processes() == []


def test_nats_missing_is_named(
    budget: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from relay.tools import nats_peer

    monkeypatch.setattr(nats_peer.shutil, "which", lambda name: None)
    assert budget.main(["--quick", "--peers", "nats", "--work-us", "0"]) == 3
    err = capsys.readouterr().err
    assert "NATS: nats-server not found" in err and "peer-deps.sh" in err, err
    assert _model_processes() == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nats_is_measured_beside_the_model(
    budget: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """--peers nats: a 3-server NATS JetStream cluster, one in flight, placed on the
    sweep (slow: scripts/peer-deps.sh installs nats-server and nats-py first)."""
    subprocess.run(["bash", "scripts/peer-deps.sh"], cwd=ROOT, check=True, timeout=600)
    argv = ["--quick", "--json", "--native", "--peers", "nats", "--work-us", "0,5000"]
    assert budget.main(argv) == 0
    [nats] = json.loads(capsys.readouterr().out)["compared"]
    assert nats["relays"] == "nats" and nats["transactions"] > 0, nats
    assert set(nats["cpu_us_per_tx"]) == {"client", "server0", "server1", "server2"}, nats
    assert set(nats["work_us_like"]) == {"python", "c"}
    assert _model_processes() == []
