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


def test_cold_evicts_the_caches_whenever_another_relay_takes_its_turn(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--quick", "--json", "--batches", "1", "--modes", "relay0", "--rounds", "5"]
    assert bench.main([*argv, "--cold"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["cold_evict_mib"] == bench.COLD_EVICT_MIB
    (cold,) = report["results"]
    assert cold["committed"] == 5 and cold["core_us"] > 0, cold
    # every transaction passes through all three relays, so the relay changes several
    # times per round; but consecutive calls of one relay (relay 0's produce, then its
    # ready()) share their caches, so there are fewer evictions than core calls
    assert 3 * 5 <= cold["evictions"] < cold["core_calls"], cold
    assert bench.main(argv) == 0
    (warm,) = json.loads(capsys.readouterr().out)["results"]
    assert warm["evictions"] == 0


def test_cache_evictor_writes_every_line(bench: ModuleType) -> None:
    evictor = bench.CacheEvictor(1)
    evictor.buffer[:] = b"\xff" * len(evictor.buffer)
    evictor.evict()
    assert evictor.count == 1
    assert evictor.buffer[:: bench.CACHE_LINE_BYTES] == bytes(len(evictor.lines))
    assert len(evictor.lines) == (1 << 20) // bench.CACHE_LINE_BYTES


def test_rejects_bad_options(bench: ModuleType) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--batches", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--modes", "nowhere"])
