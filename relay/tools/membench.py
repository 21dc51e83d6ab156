"""`relay bench --memory`: do the buffer bounds hold what the relays really use?

Starts a 3-relay mesh on loopback with two streams and a relay-wide bound smaller than the
two streams' bounds together (so the per-relay bound is the one that binds), produces at a
fixed rate, half to each stream, for `duration_s`, and every `SAMPLE_S` reads each relay's
resident memory (VmRSS of /proc/PID/status) and what its core counts (`memory_bytes`:
held entries and dedupe keys, relay/core/memory.py). It reports, per relay:

* the ratio of RSS growth (over the RSS of the idle relay before the load) to the bytes the
  core counts, once the buffers are full: how honest the bound is;
* when the buffers filled, and the RSS slope over the second half of the run (MiB per
  minute): flat means the bound holds over time (nothing else grows per transaction).

    relay bench --memory [--duration-s 600] [--rate 5000] [--sizes 100] [--buffer-mib 384]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relay.client import Producer
from relay.launcher import Mesh, write_loopback_topology
from relay.tools.bench import START_TIMEOUT_S, _payload

STREAMS = ("mem.a", "mem.b")
SAMPLE_S = 5.0
SEND_TICK_S = 0.02  # the producer sends what is due every tick (open loop at the rate)
WINDOW = 1_000
FULL_FRACTION = 0.95  # the buffers count as full at this share of the relay bound
DEFAULT_RATE_TX_S = 5_000
DEFAULT_BUFFER_MIB = 384
MIB = 1024 * 1024


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (Linux), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _sample(mesh: Mesh, started: float, sent: int) -> dict[str, Any]:
    relays: dict[str, Any] = {}
    statuses = mesh.statuses(5.0)
    for relay_id, pid in mesh.pids.items():
        status = statuses[relay_id].status or {}
        streams = status.get("streams") or {}
        relays[str(relay_id)] = {
            "rss_bytes": rss_bytes(pid),
            "memory_bytes": status.get("memory_bytes"),
            "held": {s: (streams.get(s) or {}).get("held") for s in STREAMS},
        }
    return {"t_s": round(time.perf_counter() - started, 1), "sent": sent, "relays": relays}


def _slope_mib_per_min(points: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of (seconds, bytes) in MiB per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_b = sum(b for _, b in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (b - mean_b) for t, b in points)
    return cov / var * 60 / MIB


def _summarise(
    samples: list[dict[str, Any]], idle: dict[str, int], max_bytes: int, duration_s: float
) -> Any:
    """Per relay: when the buffers filled; RSS then and at the end; RSS growth over what
    the core counts at the end; the RSS slope over the second half of the run (the
    buffers long full: what still grows is what the bounds miss)."""
    out: dict[str, Any] = {}
    for relay in idle:
        rows = [(s["t_s"], s["relays"][relay]) for s in samples]
        full = [(t, r) for t, r in rows if (r["memory_bytes"] or 0) >= FULL_FRACTION * max_bytes]
        last = rows[-1][1] if rows else {}
        summary: dict[str, Any] = {"idle_rss_bytes": idle[relay], "full_at_s": None}
        if full and last.get("rss_bytes") and last.get("memory_bytes"):
            growth = last["rss_bytes"] - idle[relay]
            late = [(t, r["rss_bytes"]) for t, r in full if r["rss_bytes"] and t >= duration_s / 2]
            summary.update(
                full_at_s=full[0][0],
                rss_at_full_bytes=full[0][1]["rss_bytes"],
                rss_half_bytes=late[0][1] if late else None,
                rss_end_bytes=last["rss_bytes"],
                counted_end_bytes=last["memory_bytes"],
                rss_growth_over_counted=round(growth / last["memory_bytes"], 2),
                rss_slope_second_half_mib_per_min=_slope_mib_per_min(late),
            )
        out[relay] = summary
    return out


def run_memory(
    duration_s: float,
    rate_tx_s: int,
    size: int,
    buffer_mib: int,
    *,
    log: Callable[[str], None],
) -> dict[str, Any]:
    max_bytes = buffer_mib * MIB
    directory = Path(tempfile.mkdtemp(prefix="relay-bench-mem-"))
    try:
        config = write_loopback_topology(
            directory,
            {r: list(STREAMS) for r in range(3)},
            list(STREAMS),
            limits={"relay_buffer_max_bytes": max_bytes},
        )
        mesh = Mesh(config, log_level="warning", log_dir=directory / "logs")
        with mesh.start(START_TIMEOUT_S):
            relays = {r: e.client for r, e in mesh.endpoints.items()}
            pad = os.urandom(size)
            with Producer(relays=relays, window=WINDOW) as producer:
                for stream in STREAMS:  # open both streams before the idle reading
                    producer.send(stream, _payload(0, 0, size, pad))
                time.sleep(SAMPLE_S)
                idle = {str(r): rss_bytes(pid) or 0 for r, pid in mesh.pids.items()}
                log(f"idle RSS: {', '.join(f'{r}: {b / MIB:.1f} MiB' for r, b in idle.items())}")
                samples = _produce(mesh, producer, duration_s, rate_tx_s, size, pad, log)
        return {
            "duration_s": duration_s,
            "rate_tx_s": rate_tx_s,
            "value_bytes": size,
            "relay_buffer_max_bytes": max_bytes,
            "streams": list(STREAMS),
            "samples": samples,
            "relays": _summarise(samples, idle, max_bytes, duration_s),
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _produce(
    mesh: Mesh,
    producer: Producer,
    duration_s: float,
    rate_tx_s: int,
    size: int,
    pad: bytes,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    sent = 0
    started = time.perf_counter()
    next_sample = started
    while (now := time.perf_counter()) - started < duration_s:
        if now >= next_sample:
            samples.append(_sample(mesh, started, sent))
            log(_sample_line(samples[-1]))
            next_sample += SAMPLE_S
        due = int((now - started) * rate_tx_s) - sent
        if due > 0:
            stream = STREAMS[(sent // WINDOW) % len(STREAMS)]
            values = [_payload(1, sent + i, size, pad) for i in range(min(due, WINDOW))]
            producer.send_many(stream, values)
            sent += len(values)
        else:
            time.sleep(SEND_TICK_S)
    samples.append(_sample(mesh, started, sent))
    log(_sample_line(samples[-1]))
    return samples


def _sample_line(sample: dict[str, Any]) -> str:
    parts = []
    for relay, r in sample["relays"].items():
        rss = (r["rss_bytes"] or 0) / MIB
        counted = (r["memory_bytes"] or 0) / MIB
        parts.append(f"{relay}: rss {rss:.0f} counted {counted:.0f} MiB")
    return f"{sample['t_s']:>7.1f} s  sent {sample['sent']:>9}  " + "  ".join(parts)


def print_memory_report(report: dict[str, Any]) -> None:
    print(
        f"memory: {report['duration_s']:.0f} s at {report['rate_tx_s']} tx/s, "
        f"{report['value_bytes']} B values over {len(report['streams'])} streams, "
        f"relay bound {report['relay_buffer_max_bytes'] / MIB:.0f} MiB"
    )
    print(
        "relay  idle_rss  full_at  rss_at_full  rss_half  rss_end  counted_end  "
        "growth/counted  slope_2nd_half"
    )
    for relay, s in report["relays"].items():
        if s["full_at_s"] is None:
            print(f"{relay:>5}  {s['idle_rss_bytes'] / MIB:7.0f}M  never full")
            continue
        slope = s["rss_slope_second_half_mib_per_min"]
        half = s["rss_half_bytes"]
        print(
            f"{relay:>5}  {s['idle_rss_bytes'] / MIB:7.0f}M  {s['full_at_s']:6.0f}s  "
            f"{s['rss_at_full_bytes'] / MIB:10.0f}M  "
            f"{'-' if half is None else f'{half / MIB:.0f}M':>8}  "
            f"{s['rss_end_bytes'] / MIB:6.0f}M  "
            f"{s['counted_end_bytes'] / MIB:10.0f}M  {s['rss_growth_over_counted']:14.2f}  "
            f"{'-' if slope is None else f'{slope:+.2f} MiB/min':>14}"
        )
