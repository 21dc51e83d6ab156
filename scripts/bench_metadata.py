"""What metadata and durable consumers cost on a local 3-relay mesh (docs/metadata.md).

    .venv/bin/python scripts/bench_metadata.py [--records 20000] [--json FILE]

Prints: the latency of a compare-and-set write and of a durable consumer's commit (p50,
p99); the rate of a consumer reading a backlog while committing every N records (N = 1,
100, 10,000) against a plain consumer reading the same backlog in the same run; the time
a durable consumer's next instance needs to take over after kill -9 of the holder (lease
TTL 1 s and the default 5 s); and a linearizability check of concurrent compare-and-set
from several processes (relay/tools/metacheck.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from relay.client import DEFAULT_LEASE_TTL_S, Consumer, Metadata, Producer
from relay.launcher import Mesh, write_loopback_topology
from relay.meta import ABSENT
from relay.tools.metacheck import cas_worker, check_linearizable

STREAM = "bench.marks"
COMMIT_EVERY = (1, 100, 10_000)
RECORDS_AT_EVERY_COMMIT = 2_000  # a commit per record is a commit round each: fewer records
CAS_WRITES = 300
CHECK_PROCESSES = 4
CHECK_OPS = 150  # per process


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def cas_latency(config: Path) -> dict[str, float]:
    times = []
    with Metadata(topology=config) as meta:
        version = meta.write("bench/cas", b"0", ABSENT)  # a fresh mesh: the key is new
        for i in range(CAS_WRITES):
            began = time.perf_counter()
            version = meta.write("bench/cas", b"%d" % i, version)
            times.append(time.perf_counter() - began)
    return {"p50_ms": percentile(times, 50) * 1e3, "p99_ms": percentile(times, 99) * 1e3}


def read_rate(config: Path, records: int, every: int | None, name: str) -> dict[str, float]:
    """Records per second reading `records` of the backlog (a durable consumer committing
    every `every` records; None: a plain consumer), and the commits' latency."""
    commits: list[float] = []
    durable = None if every is None else name
    with Consumer(topology=config, timeout_s=30, max_batch=1_000, durable=durable) as consumer:
        consumer.subscribe(STREAM, "earliest")
        began = time.perf_counter()
        for i, _ in enumerate(consumer, start=1):
            if every is not None and i % every == 0:
                at = time.perf_counter()
                consumer.commit()
                commits.append(time.perf_counter() - at)
            if i == records:
                break
        elapsed = time.perf_counter() - began
    found: dict[str, float] = {"records_per_s": records / elapsed}
    if commits:
        found["commit_p50_ms"] = percentile(commits, 50) * 1e3
        found["commit_p99_ms"] = percentile(commits, 99) * 1e3
    return found


HOLDER = """
import sys, time
from relay.client import Consumer
with Consumer(topology=sys.argv[1], durable=sys.argv[2], lease_ttl_s=float(sys.argv[3]),
              auto_commit_interval_s=0.2, lease_wait_s=None, timeout_s=60) as c:
    c.subscribe(sys.argv[4], "earliest")
    for i, _ in enumerate(c):
        if i == 10:
            print("reading", flush=True)
        time.sleep(0.002)
"""


def takeover(config: Path, ttl_s: float) -> dict[str, float]:
    """kill -9 a reading holder; how long until the next instance yields a record."""
    name = f"takeover-{os.urandom(3).hex()}"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(config), name, str(ttl_s), STREAM],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "reading"
        killed = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        with Consumer(
            topology=config, durable=name, lease_ttl_s=ttl_s, lease_wait_s=None, timeout_s=30
        ) as successor:
            successor.subscribe(STREAM, "earliest")
            taken = time.monotonic()
            next(successor)
            first = time.monotonic()
    finally:
        holder.kill()
        holder.wait(30)
    return {"lease_taken_s": taken - killed, "first_record_s": first - killed}


def linearizability(config: Path) -> dict[str, Any]:
    rng = random.Random(12)
    ops = ("write", "write", "delete", "read")
    scripts = [
        [(rng.choice(ops), rng.randrange(2)) for _ in range(CHECK_OPS)]
        for _ in range(CHECK_PROCESSES)
    ]
    keys = [f"check/{os.urandom(3).hex()}/{i}" for i in range(2)]
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(CHECK_PROCESSES, mp_context=spawn) as pool:
        runs = [pool.submit(cas_worker, str(config), keys, script) for script in scripts]
        histories = [run.result(timeout=600) for run in runs]
    checked = check_linearizable(histories)  # raises AssertionError naming the violation
    results = [h[6] for history in histories for h in history]
    return {
        "processes": CHECK_PROCESSES,
        "operations": checked,
        "keys": len(keys),
        "applied": results.count("applied"),
        "bad_version": results.count("bad_version"),
        "reads": results.count("ok"),
        "result": "linearizable",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--json", dest="json_file", default=None)
    args = parser.parse_args()
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="relay-bench-meta-") as folder:
        config = write_loopback_topology(Path(folder), {r: [STREAM] for r in range(3)}, [STREAM])
        with Mesh(config, log_dir=Path(folder) / "logs", log_level="warning"):
            with Producer(topology=config, window=1_024) as producer:
                producer.send_many(STREAM, [os.urandom(100) for _ in range(args.records)])
            report["cas_write"] = cas_latency(config)
            print(f"compare-and-set write: {report['cas_write']}", flush=True)
            for every in COMMIT_EVERY:
                records = RECORDS_AT_EVERY_COMMIT if every == 1 else args.records
                plain = read_rate(config, records, None, "")
                durable = read_rate(config, records, every, f"every-{every}")
                durable["ratio_to_plain"] = durable["records_per_s"] / plain["records_per_s"]
                report[f"commit_every_{every}"] = {"plain": plain, "durable": durable}
                print(
                    f"commit every {every} ({records} records): {durable} "
                    f"(plain consumer {plain['records_per_s']:.0f}/s)",
                    flush=True,
                )
            for ttl_s in (1.0, DEFAULT_LEASE_TTL_S):
                report[f"takeover_ttl_{ttl_s:g}s"] = found = takeover(config, ttl_s)
                print(f"takeover after kill -9, TTL {ttl_s:g} s: {found}", flush=True)
            report["linearizability"] = linearizability(config)
            print(f"linearizability: {report['linearizability']}", flush=True)
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
