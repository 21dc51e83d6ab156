"""`relay bench` runs end to end on a real 3-relay mesh and reports sane figures.

Only shape and sanity are checked (positive rates, ordered percentiles, every latency
sample delivered, ratios present): performance is measured by the benchmark, never
asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from relay.cli import main
from relay.hoptrace import CLIENT_IN, CLIENT_OUT, PEER_IN, PEER_OUT
from relay.tools.bench import parse_sizes
from relay.tools.hops import analyse
from relay.tools.isolated import IsolatedRunFailed, run_isolated

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent


def bench(*args: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "relay", "bench", "--quick", "--json", *args]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def check_summary(summary: dict[str, Any]) -> None:
    assert summary["count"] > 0, summary
    assert 0 < summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"], summary
    assert summary["mean"] > 0, summary


def test_quick_json_reports_sane_numbers() -> None:
    report = bench()
    config = report["config"]
    assert config["quick"] is True and config["sizes"] == [100, 1024]
    windows = config["windows"]
    assert len(windows) == 2 and all(w > 1 for w in windows)
    cases = {(s, w) for s in (100, 1024) for w in windows}

    relay_t = report["relay"]["throughput"]
    assert {(r["value_bytes"], r["window"]) for r in relay_t} == cases
    for r in relay_t:
        assert r["committed"] > 0 and r["committed"] + r["failed"] == r["sent"], r
        assert r["tx_per_s"] > 0 and r["elapsed_s"] > 0, r
        assert r["cpu_s"]["client_s"] >= 0, r

    base_t = report["baseline"]["throughput"]
    assert {(b["value_bytes"], b["window"]) for b in base_t} == cases
    for b in base_t:
        assert b["msgs_per_s"] > 0 and b["deliveries_per_s"] >= b["msgs_per_s"], b
        assert b["lost"] == 0, b

    relay_l = report["relay"]["latency"]
    modes = {(s, m) for s in (100, 1024) for m in ("one_in_flight", "rate")}
    assert {(r["value_bytes"], r["mode"]) for r in relay_l} == modes
    for r in relay_l:
        assert r["committed"] > 0 and r["consumer_error"] is None, r
        assert r["delivered"] == r["committed"], r  # a consumer on relay 1 saw every one
        assert r["achieved_tx_s"] > 0, r
        check_summary(r["commit_ms"])
        check_summary(r["delivery_ms"])
        if r["mode"] == "rate":
            assert r["rate_tx_s"] == config["rate_tx_s"], r

    base_l = report["baseline"]["latency"]
    assert {(b["value_bytes"], b["mode"]) for b in base_l} == modes
    for b in base_l:
        assert b["sent"] > 0 and b["lost_receipts"] == 0, b
        check_summary(b["one_way_ms"])

    ratios = report["ratios"]
    assert len([r for r in ratios if r["metric"] == "throughput"]) == len(cases)
    assert len([r for r in ratios if r["metric"] != "throughput"]) == 8 * len(config["sizes"])
    for r in ratios:
        assert r["ratio"] is not None and r["ratio"] > 0, r
        assert r["ratio"] == pytest.approx(r["relay"] / r["baseline"], rel=1e-3, abs=1e-4), r

    targets = report["targets"]
    assert len(targets) == 3
    for t in targets:
        assert t["measured"] is not None and t["measured"] > 0, t
        assert isinstance(t["met"], bool), t
    assert "profile" not in report


def test_quick_profile_says_where_time_goes() -> None:
    report = bench("--sizes", "100", "--duration-s", "0.15", "--profile")
    profile = report["profile"]
    relay0 = profile["relay0"]
    stages = {row["stage"].strip(): row for row in relay0["stages"]}
    assert stages["loop turns (busy)"]["cumtime_s"] > 0
    assert stages["core.produce"]["calls"] > 0
    assert relay0["top_by_own_time"] and profile["client"]["top_by_own_time"]
    assert any("relay/" in row["function"] for row in relay0["top_by_own_time"])


def test_quick_security_run_compares_a_plain_and_a_curve_mesh() -> None:
    report = bench("--security", "--sizes", "100")
    for side in ("plain", "curve"):
        for run in report[side]["throughput"]:
            assert run["committed"] > 0 and run["tx_per_s"] > 0, run
        for run in report[side]["latency"]:
            assert run["committed"] > 0, run
            check_summary(run["commit_ms"])
    assert len(report["ratios"]) == 4  # two windows, two latency loads
    assert all(r.get("tx_s") or r.get("commit_p50") for r in report["ratios"]), report["ratios"]


def test_quick_metrics_run_compares_a_mesh_without_and_with_http_endpoints() -> None:
    """`relay bench --metrics`: the same runs on a mesh without HTTP endpoints and on one
    whose relays' /metrics are scraped meanwhile; every scrape answered."""
    report = bench("--metrics", "--sizes", "100")
    assert report["sides"] == ["off", "on"]
    for side in ("off", "on"):
        for run in report[side]["throughput"]:
            assert run["committed"] > 0 and run["tx_per_s"] > 0, run
        for run in report[side]["latency"]:
            check_summary(run["commit_ms"])
    assert report["scrapes"]["done"] > 0 and report["scrapes"]["failed"] == 0, report["scrapes"]
    assert len(report["ratios"]) == 4
    throughput = [r for r in report["ratios"] if r["run"].startswith("throughput")]
    assert all(r["relay_cpu_us_per_tx"] > 0 for r in throughput), throughput


def test_rounds_alternate_which_side_goes_first() -> None:
    """`--rounds 2`: every pair of runs twice, the other side first the second time; each
    ratio is the median of the rounds' ratios, each round's pair taken on its own."""
    report = bench("--security", "--sizes", "100", "--rounds", "2", "--duration-s", "0.15")
    assert report["order"] == [["plain", "curve"], ["curve", "plain"]]
    for side in ("plain", "curve"):
        assert [run["round"] for run in report[side]["throughput"]] == [0, 0, 1, 1]
        assert [run["round"] for run in report[side]["latency"]] == [0, 0, 1, 1]
    assert len(report["ratios"]) == 4
    for row in report["ratios"]:
        figures = [key for key in row if key != "run" and not key.endswith("_rounds")]
        for figure in figures:
            rounds = row[f"{figure}_rounds"]
            assert len(rounds) == 2
            if None not in rounds:
                assert row[figure] == round((rounds[0] + rounds[1]) / 2, 3)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_peers_run_compares_the_mesh_with_nats_jetstream() -> None:
    """`relay bench --peers nats`: the same shapes through a 3-server NATS JetStream cluster
    beside the mesh (slow: scripts/peer-deps.sh installs nats-server and nats-py first)."""
    subprocess.run(["bash", "scripts/peer-deps.sh"], cwd=ROOT, check=True, timeout=600)
    report = bench("--peers", "nats", "--sizes", "100", "--rounds", "2")
    assert report["order"] == [["relay", "nats"], ["nats", "relay"]]
    windows = [16, 64, 256, 1024, 4096]
    for side in ("relay", "nats"):
        assert [r["window"] for r in report[side]["throughput"]] == windows * 2
        assert [r["round"] for r in report[side]["throughput"]] == [0] * 5 + [1] * 5
        for run in report[side]["throughput"]:
            assert run["committed"] > 0 and run["tx_per_s"] > 0, run
            assert run["cpu_us_per_tx_all"] > 0, run
        for run in report[side]["latency"]:
            assert run["committed"] > 0, run
            assert run["cpu_us_per_tx_all"] > 0, run
            check_summary(run["commit_ms"])
        modes = ["one_in_flight", "rate", "rate"]
        assert [r["mode"] for r in report[side]["latency"]] == modes * 2
        for run in report[side]["latency"]:
            if run["mode"] == "rate":
                assert run["delivered"] > 0, run  # a consumer of another server got them
                check_summary(run["delivery_ms"])
        idle = report["idle_cpu_percent"][side]
        assert len(idle) == 3 and all(v is not None and v >= 0 for v in idle), idle
    shapes = [row["run"] for row in report["ratios"]]
    assert shapes[:5] == [f"100 B window {w}" for w in windows], shapes
    assert shapes[5:] == [
        "100 B one in flight",
        "100 B at 200 tx/s",
        "100 B at 80% of each side's best",
    ]
    for row in report["ratios"]:
        assert len(row["cpu_us_per_tx_rounds"]) == 2, row


def _peer_run(
    round_: int, tx_s: float | None = None, p50: float | None = None, **more: Any
) -> dict[str, Any]:
    run: dict[str, Any] = {"value_bytes": 100, "round": round_, "cpu_us_per_tx_all": 10.0}
    if tx_s is not None:
        return {**run, "window": 16, "tx_per_s": tx_s, **more}
    return {**run, "commit_ms": {"p50": p50, "p99": 2 * p50 if p50 else None}, **more}


def test_peer_ratios_take_each_rounds_pair_and_their_median() -> None:
    """relay/NATS per shape: the ratio of every round's pair, their median and spread;
    the rate runs are shapes by what was asked of them (a rate both ran at, or each side's
    own share of its best), never paired across rounds."""
    from relay.tools.bench import _peer_ratios, _ratio_cell

    def side(tx: list[float], one: list[float], rates: list[tuple[int, int]]) -> dict[str, Any]:
        throughput = [_peer_run(n, tx_s=v) for n, v in enumerate(tx)]
        latency = []
        for n, (p50, (fixed, share)) in enumerate(zip(one, rates, strict=True)):
            latency.append(_peer_run(n, p50=p50, mode="one_in_flight"))
            for rate in (fixed, share):
                delivery = {"p50": 1.0, "p99": 2.0}
                latency.append(
                    _peer_run(n, p50=p50, mode="rate", rate_tx_s=rate, delivery_ms=delivery)
                )
        return {"throughput": throughput, "latency": latency}

    report = {
        "relay": side([9.0, 12.0, 30.0], [2.0, 3.0, 1.0], [(1000, 800), (1000, 900), (1000, 700)]),
        "nats": side([10.0, 10.0, 10.0], [1.0, 1.0, 1.0], [(1000, 400), (1000, 500), (1000, 600)]),
    }
    rows = {row["run"]: row for row in _peer_ratios(report)}
    assert list(rows) == [
        "100 B window 16",
        "100 B one in flight",
        "100 B at 1,000 tx/s",
        "100 B at 80% of each side's best",
    ]
    window = rows["100 B window 16"]
    assert window["tx_s_rounds"] == [0.9, 1.2, 3.0]
    assert window["tx_s"] == 1.2 and _ratio_cell(window, "tx_s") == "1.20 (0.90-3.00)"
    assert window["cpu_us_per_tx"] == 1.0
    one = rows["100 B one in flight"]
    assert one["commit_p50_rounds"] == [2.0, 3.0, 1.0] and one["commit_p50"] == 2.0
    assert "delivery_p50" not in one and _ratio_cell(one, "delivery_p50") == "-"
    # Each round's pair, whatever rates the two sides' bests gave them.
    share = rows["100 B at 80% of each side's best"]
    assert share["commit_p50_rounds"] == [2.0, 3.0, 1.0]
    assert share["delivery_p50_rounds"] == [1.0, 1.0, 1.0] and share["delivery_p50"] == 1.0


COORDINATOR_FRAMES = ("the TxBatch", "TxBatch from relay 0", "Reports from relay 0")


def _hop_events(
    start: int, seq: int, reporters: tuple[int, ...]
) -> tuple[dict[int, list[dict[str, Any]]], tuple[int, int, None]]:
    """One transaction's stamps at relay 0 (coordinator) and members 1 and 2, from `start`
    ns: the members in `reporters` report at `seq`; the other takes the TxBatch after their
    reports (which commit it) and sends a Reports with no point (its commit, acks)."""

    def ev(ns: int, direction: str, peer: int, kind: str, **more: Any) -> dict[str, Any]:
        return {"ns": start + ns, "dir": direction, "peer": peer, "kind": kind, **more}

    coord = [
        ev(10, CLIENT_IN, -1, "ProduceReq"),
        ev(20, PEER_OUT, -1, "TxBatch", seqs=[seq]),
        *(ev(40 + r, PEER_IN, r, "Reports", points=[seq]) for r in reporters),
        ev(50, CLIENT_OUT, -1, "ProduceResp", seqs=[seq]),
    ]
    members: dict[int, list[dict[str, Any]]] = {}
    for m in (1, 2):
        if m in reporters:
            members[m] = [
                ev(30, PEER_IN, 0, "TxBatch", seqs=[seq]),
                ev(35, PEER_OUT, -1, "Reports", points=[seq]),
            ]
        else:
            members[m] = [
                ev(45, PEER_IN, 0, "TxBatch", seqs=[seq]),
                ev(46, PEER_IN, 3 - m, "Reports", points=[seq]),
                ev(47, PEER_OUT, -1, "Reports", points=[]),
            ]
    return {0: coord, **members}, (start, start + 60, None)


def test_hops_leave_out_a_member_that_did_not_report_at_the_seq() -> None:
    """A member that took the TxBatch after the others' reports committed its seq does not
    report there. Its next Reports, at a later transaction's seq, is not that path's: the
    transaction is traced through the member that did report."""
    traces: dict[int, list[dict[str, Any]]] = {0: [], 1: [], 2: []}
    client = []
    for start, seq, reporters in ((0, 100, (1, 2)), (1000, 200, (1,)), (2000, 300, (1, 2))):
        events, stamps = _hop_events(start, seq, reporters)
        for relay, got in events.items():
            traces[relay].extend(got)
        client.append(stamps)
    report = analyse(traces, client)
    assert report["traced"] == 3
    # Member 2 is in the first and third paths only: what it heard last before reporting
    # (the TxBatch), twice; member 1 in all three.
    assert report["member_triggers"] == {"the TxBatch": 5}
    # The second report came 1 ns after the first in the two paths where both reported.
    assert report["second_report_after_first_p50_us"] == 0.001
    report_out = next(row for row in report["stages"] if row["stage"] == "report_out")
    assert report_out["samples"] == 3 and report_out["p90_us"] == 0.005, report_out


def test_quick_hops_traces_every_stage_of_the_path() -> None:
    """`relay bench --hops`: the relays' stamps line up with the client's for (nearly) every
    transaction, and each stage of the path has a time that is not negative."""
    report = bench("--hops", "--sizes", "100", "--duration-s", "0.5")
    assert report["transactions"] > 0
    assert report["traced"] >= report["transactions"] * 9 // 10, report
    for row in (*report["stages"], *report["delivery_stages"]):
        assert row["samples"] > 0 and 0 <= row["p50_us"] <= row["p90_us"], row
    assert report["commit_p50_us"] >= max(row["p50_us"] for row in report["stages"])
    assert report["one_way_delays"] == 4  # docs/protocol.md section 7
    triggers = report["member_triggers"]
    # One or both members reported at each traced seq (a member slower than the other two
    # finds it committed, and does not report there).
    assert report["traced"] <= sum(triggers.values()) <= 2 * report["traced"]
    # The members lead (5.2): what lets one report is the coordinator's frames, not the
    # other member's floor (all but the first transactions, before any lead was given).
    by_coordinator = sum(n for what, n in triggers.items() if what in COORDINATOR_FRAMES)
    assert 2 * by_coordinator > sum(triggers.values()), triggers


def test_quick_memory_run_samples_rss_beside_what_the_bounds_count() -> None:
    """`relay bench --memory`: every relay's RSS and counted bytes are sampled while the
    load runs, and the counts grow with it (the full ten minutes is a measurement)."""
    report = bench("--memory", "--duration-s", "6", "--rate", "2000")
    samples = report["samples"]
    assert len(samples) >= 2 and samples[-1]["sent"] > 0
    for relay in ("0", "1", "2"):
        first, last = samples[0]["relays"][relay], samples[-1]["relays"][relay]
        assert last["rss_bytes"] > 0 and last["memory_bytes"] > first["memory_bytes"], last
        assert last["memory_bytes"] <= report["relay_buffer_max_bytes"]
    assert set(report["relays"]) == {"0", "1", "2"}


def test_bad_options_are_refused_before_any_mesh_starts() -> None:
    runner = CliRunner()
    bad = (
        ["--sizes", "abc"],
        ["--sizes", "4"],
        ["--sizes", ""],
        ["--duration-s", "0"],
        ["--peers", "redis"],
        ["--peers", "nats", "--security"],
        ["--metrics", "--security"],
        ["--hops", "--profile"],
        ["--memory", "--hops"],
        ["--rate", "100"],
        ["--buffer-mib", "512"],
        ["--rounds", "2"],
        ["--security", "--rounds", "0"],
    )
    for args in bad:
        result = runner.invoke(main, ["bench", *args])
        assert result.exit_code == 2, (args, result.output)
    assert parse_sizes("100, 1k,100") == (100, 1024)


def gated_sum(gate: Callable[[], None], n: int) -> dict[str, Any]:
    """A client for run_isolated: warms up, passes the gate, works."""
    warm = sum(range(n))
    gate()
    return {"warm": warm, "sum": sum(range(2 * n))}


def failing_after_gate(gate: Callable[[], None]) -> dict[str, Any]:
    gate()
    raise ValueError("the client broke here")


def never_gated(gate: Callable[[], None]) -> dict[str, Any]:
    return {}


def test_an_isolated_client_runs_in_its_own_process_behind_its_gate() -> None:
    events: list[str] = []

    def at_gate() -> int:
        events.append("gate")
        return os.getpid()

    result, token = run_isolated(gated_sum, (1_000,), at_gate=at_gate, duration_s=1.0)
    assert events == ["gate"] and token == os.getpid()
    assert result["warm"] == sum(range(1_000)) and result["sum"] == sum(range(2_000))
    assert result["client_s"] >= 0

    with pytest.raises(IsolatedRunFailed, match="the client broke here"):
        run_isolated(failing_after_gate, (), at_gate=lambda: None, duration_s=1.0)
    with pytest.raises(IsolatedRunFailed, match="never reached its gate"):
        run_isolated(never_gated, (), at_gate=lambda: None, duration_s=1.0)
