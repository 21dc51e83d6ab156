"""scripts/latency_budget.py runs end to end, reports figures and leaves no process behind.

Only shape is checked: the figures are measurements, never asserted here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType

import pytest

from script_modules import load_script


@pytest.fixture(scope="module")
def budget() -> ModuleType:
    return load_script("latency_budget")


def _model_processes() -> list[int]:
    """This process's children that are relays of the model (started with
    --serve-relay, or the C relay) and still there; another test worker's do not count."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes()
                status = (entry / "status").read_text()
            except OSError:
                continue
            parent = int(status.split("PPid:", 1)[1].split()[0])
            model = b"--serve-relay" in command or b"latency_budget_relay" in command
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
