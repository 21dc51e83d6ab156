"""How often an idle mesh fences while the machine is overloaded (issue 10, "load").

    .venv/bin/python scripts/fence_under_load.py [--relays 3] [--busy 8] [--seconds 300]
        [--json]

Starts a mesh of `--relays` relays on free loopback ports (every relay serves stream
`idle`), waits until each has joined and unfenced, then starts `--busy` processes that
spin (`while 1: pass`) to oversubscribe the machine's cores, and for `--seconds` polls
every relay's status twice a second. At the end it reports, per relay, how many times it
fenced (`fenced` counter of the core, since the load began), how often a poll found the
stream fenced or stalled, the longest such stretch seen, and the load average. The busy
processes and the mesh are always stopped. Exit code 0; 3 if the mesh could not start.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from relay.launcher import Mesh, MeshError, write_loopback_topology

STREAM = "idle"
POLL_S = 0.5
START_TIMEOUT_S = 60.0
STATUS_TIMEOUT_S = 5.0  # generous: the machine is overloaded on purpose


def _stream_of(status: dict[str, Any] | None) -> dict[str, Any]:
    return ((status or {}).get("streams") or {}).get(STREAM) or {}


def _fenced_count(status: dict[str, Any] | None) -> int:
    return int(((status or {}).get("counters") or {}).get("fenced", 0))


def measure(relays: int, busy: int, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="relay-load-") as tmp:
        topology = write_loopback_topology(Path(tmp), {i: [STREAM] for i in range(relays)})
        with Mesh(topology, log_dir=Path(tmp) / "logs", die_with_parent=True) as mesh:
            mesh.wait_ready(mesh.relay_ids, timeout_s=START_TIMEOUT_S)
            before = {r: _fenced_count(mesh.status(r, STATUS_TIMEOUT_S)) for r in mesh.relay_ids}
            spinners = [
                subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(busy)
            ]
            polls = {r: 0 for r in mesh.relay_ids}
            stalled_polls = {r: 0 for r in mesh.relay_ids}
            unanswered = {r: 0 for r in mesh.relay_ids}
            stalled_since: dict[int, float] = {}
            longest_s = {r: 0.0 for r in mesh.relay_ids}
            load = []
            try:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    for r in mesh.relay_ids:
                        status = mesh.status(r, STATUS_TIMEOUT_S)
                        polls[r] += 1
                        if status is None:
                            unanswered[r] += 1
                            continue
                        info = _stream_of(status)
                        now = time.monotonic()
                        if info.get("fenced") or info.get("stall"):
                            stalled_polls[r] += 1
                            start = stalled_since.setdefault(r, now)
                            longest_s[r] = max(longest_s[r], now - start)
                        else:
                            stalled_since.pop(r, None)
                    load.append(os.getloadavg()[0])
                    time.sleep(POLL_S)
                after = {r: _fenced_count(mesh.status(r, STATUS_TIMEOUT_S)) for r in mesh.relay_ids}
            finally:
                for p in spinners:
                    p.kill()
                for p in spinners:
                    p.wait()
    return {
        "relays": relays,
        "busy_processes": busy,
        "cores": os.cpu_count(),
        "seconds": seconds,
        "load_average_mean": round(sum(load) / max(len(load), 1), 1),
        "per_relay": {
            r: {
                "fenced": after[r] - before[r],
                "polls": polls[r],
                "polls_fenced_or_stalled": stalled_polls[r],
                "polls_unanswered": unanswered[r],
                "longest_stall_seen_s": round(longest_s[r], 2),
            }
            for r in sorted(polls)
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--relays", type=int, default=3)
    parser.add_argument("--busy", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        result = measure(args.relays, args.busy, args.seconds)
    except MeshError as e:
        print(f"error: the mesh did not start: {e}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['relays']} idle relays, {result['busy_processes']} busy processes on "
        f"{result['cores']} cores for {result['seconds']:.0f} s "
        f"(load average {result['load_average_mean']})"
    )
    print("relay  fenced  polls  fenced/stalled  unanswered  longest stall seen")
    for r, row in result["per_relay"].items():
        print(
            f"{r:>5}  {row['fenced']:>6}  {row['polls']:>5}  {row['polls_fenced_or_stalled']:>14}"
            f"  {row['polls_unanswered']:>10}  {row['longest_stall_seen_s']:>9.2f} s"
        )
    total = sum(row["fenced"] for row in result["per_relay"].values())
    print(f"fenced {total} times in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
