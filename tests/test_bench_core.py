"""scripts/bench_core.py runs end to end and reports sane figures.

Only shape and sanity are checked (every transaction committed and delivered at every
relay, positive costs): performance is measured by the benchmark, never asserted here.
"""

from __future__ import annotations

import json
from types import ModuleType

import pytest

from script_modules import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_core")


def test_quick_json_reports_sane_numbers(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(["--quick", "--json", "--profile"]) == 0
    report = json.loads(capsys.readouterr().out)
    results = report["results"]
    cases = {(r["mode"], r["value_bytes"], r["batch"]) for r in results}
    assert cases == {(m, 100, b) for m in ("relay0", "spread") for b in (1, 16, 128)}
    for r in results:
        produced = r["batch"] * r["rounds"]
        assert r["committed"] == produced, r
        # every relay delivered the measured rounds plus the warm-up rounds, all alike
        assert len(r["delivered"]) == 3 and len(set(r["delivered"])) == 1, r
        assert r["delivered"][0] >= produced, r
        for key in ("core_us", "harness_us", "baseline_us", "ratio"):
            assert r[key] > 0, (key, r)
        assert r["frames"] > 0 and r["core_calls"] > 0, r
    profile = report["profile"]
    assert profile["batch"] == 128 and len(profile["top"]) == 20
    assert any(row["function"].startswith("relay/core/") for row in profile["top"])


def test_quick_table_and_options(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--batches", "4", "--value-bytes", "1024", "--modes", "spread"]
    assert bench.main([*argv, "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.startswith("spread")]
    assert len(lines) == 1
    mode, value, batch, rounds, committed = lines[0][:5]
    assert (mode, value, batch, rounds, committed) == ("spread", "1024", "4", "2", "8")


def test_rejects_bad_options(bench: ModuleType) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--batches", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--modes", "nowhere"])
