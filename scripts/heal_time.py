"""How fast a relay cut off from the mesh serves again once the network heals.

    sudo .venv/bin/python scripts/heal_time.py [--runs N] [--cut-s T]
        [--heartbeat-interval-ms MS] [--suspect-timeout-ms MS] [--json]

Needs root (it creates a network namespace). Builds a veth pair into a new namespace
(10.251.0.1 on this side, 10.251.0.2 inside) and starts a 3-relay mesh (streams
`orders.*` and `audit`, declared `orders.eu` and `audit`): relays 0 and 1 here on
10.251.0.1, relay 2 inside the namespace (`ip netns exec`). Each run:

1. cuts relay 2 off: inside the namespace, iptables drops every TCP packet to or from a
   mesh port (the client ports stay open, so its status can still be asked), and measures
   `fence_ms`, from the cut to relay 2 reporting every named stream fenced;
2. keeps the cut for `--cut-s` (default 2 s: longer than the transport's heartbeat
   timeout, so libzmq gives the dead connections up and keeps trying new ones);
3. heals (deletes the rules) and measures, from the heal (status polled every 5 ms),
   `heard_ms`: until relay 2 hears both others again (`peers_heard`: the links carry
   traffic), and `heal_ms`: until it reports every named stream joined, unfenced and
   without a stall (which may take a view change that admits it again).

Prints one line per run and the median and maximum, or with `--json` one document. The
mesh is always stopped and the namespace, the veth pair and the rules removed. Exit
codes: 0; 1 if a run did not fence or heal within its bound; 2 usage (e.g. not root);
3 if the mesh could not start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped, unused-ignore]
from idle_cpu import add_limit_options, limit_overrides  # scripts/idle_cpu.py

from relay.launcher import Mesh, MeshError, free_ports, named_streams, query_status

HOST_IP, CUT_IP = "10.251.0.1", "10.251.0.2"
CUT_RELAY = 2
STREAMS = ["orders.*", "audit"]
DECLARED = ["orders.eu", "audit"]
START_TIMEOUT_S = 60.0
PHASE_TIMEOUT_S = 30.0  # bound of the wait to fence, and of the wait to heal
POLL_S = 0.005
STATUS_TIMEOUT_S = 0.5

EXIT_OK, EXIT_BAD, EXIT_USAGE, EXIT_MESH = 0, 1, 2, 3


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


class Namespace:
    """A network namespace joined to this one by a veth pair; removed by `close`."""

    def __init__(self) -> None:
        self.name = f"relay-heal-{os.getpid()}"
        self.host_link = f"rh{os.getpid() % 100000}h"
        self.cut_link = f"rh{os.getpid() % 100000}n"

    def open(self) -> Namespace:
        run("ip", "netns", "add", self.name)
        run("ip", "link", "add", self.host_link, "type", "veth", "peer", "name", self.cut_link)
        run("ip", "link", "set", self.cut_link, "netns", self.name)
        run("ip", "addr", "add", f"{HOST_IP}/24", "dev", self.host_link)
        run("ip", "link", "set", self.host_link, "up")
        self.exec("ip", "addr", "add", f"{CUT_IP}/24", "dev", self.cut_link)
        self.exec("ip", "link", "set", self.cut_link, "up")
        self.exec("ip", "link", "set", "lo", "up")
        return self

    def exec(self, *argv: str) -> None:
        run("ip", "netns", "exec", self.name, *argv)

    def rules(self, action: str, ports: list[int]) -> None:
        """Insert (-I) or delete (-D) the rules dropping every packet of the mesh ports."""
        listed = ",".join(str(p) for p in ports)
        for chain in ("INPUT", "OUTPUT"):
            self.exec(
                "iptables", action, chain, "-p", "tcp", "-m", "multiport", "--ports", listed,
                "-j", "DROP",
            )  # fmt: skip

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.host_link], capture_output=True)


def write_topology(directory: Path, limits: dict[str, int]) -> tuple[Path, list[int]]:
    """The topology (relays 0, 1 on HOST_IP, relay 2 on CUT_IP) and its mesh ports."""
    ports = free_ports(6, HOST_IP)
    relays = [
        {
            "id": r,
            "host": CUT_IP if r == CUT_RELAY else HOST_IP,
            "mesh_port": ports[2 * r],
            "client_port": ports[2 * r + 1],
            "streams": STREAMS,
        }
        for r in range(3)
    ]
    doc: dict[str, Any] = {"relays": relays, "streams": DECLARED, "data_dir": str(directory)}
    if limits:
        doc["limits"] = limits
    path = directory / "topology.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path, [ports[2 * r] for r in range(3)]


def cut_status(mesh: Mesh) -> dict[str, Any] | None:
    endpoint = mesh.config.relays[CUT_RELAY].client_endpoint
    return query_status({CUT_RELAY: endpoint}, STATUS_TIMEOUT_S)[CUT_RELAY].status


def stream_states(status: dict[str, Any], mesh: Mesh) -> list[dict[str, Any]]:
    streams = status.get("streams", {})
    return [streams.get(name, {}) for name in named_streams(mesh.config.relays[CUT_RELAY])]


def all_fenced(status: dict[str, Any], mesh: Mesh) -> bool:
    return all(s.get("fenced") for s in stream_states(status, mesh))


def all_heard(status: dict[str, Any], mesh: Mesh) -> bool:
    """Relay 2 hears every other relay again: the links carry traffic."""
    others = {r for r in mesh.config.relays if r != CUT_RELAY}
    return others <= set(status.get("peers_heard", ()))


def all_serving(status: dict[str, Any], mesh: Mesh) -> bool:
    return all(
        s.get("joined") and not s.get("fenced") and s.get("stall") is None
        for s in stream_states(status, mesh)
    )


def wait_ms(conditions: list[Any], mesh: Mesh, since: float) -> list[float | None]:
    """Milliseconds from `since` until each of `conditions(status, mesh)` first held (the
    last one ends the wait); None for one that did not within the bound."""
    times: list[float | None] = [None] * len(conditions)
    while time.monotonic() - since < PHASE_TIMEOUT_S and times[-1] is None:
        status = cut_status(mesh)
        elapsed = (time.monotonic() - since) * 1000
        for i, condition in enumerate(conditions):
            if times[i] is None and status is not None and condition(status, mesh):
                times[i] = elapsed
        time.sleep(POLL_S)
    return times


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="heal_time.py",
        description="Cut one relay off with iptables in a network namespace, heal, and "
        "measure how long until it serves again.",
    )
    parser.add_argument("--runs", type=int, default=5, metavar="N", help="runs (default 5)")
    parser.add_argument("--cut-s", type=float, default=2.0, help="cut length (default 2)")
    add_limit_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.cut_s <= 0:
        parser.error("--runs must be at least 1 and --cut-s positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("iptables") is None:
        print("error: needs root, ip and iptables (it creates a namespace)", file=sys.stderr)
        return EXIT_USAGE
    limits = limit_overrides(args)
    runs: list[dict[str, float | None]] = []
    namespace = Namespace()
    with tempfile.TemporaryDirectory(prefix="relay-heal-") as tmp:
        directory = Path(tmp)
        try:
            namespace.open()
            path, mesh_ports = write_topology(directory, limits)
            wrapper = ["ip", "netns", "exec", namespace.name]
            mesh = Mesh(
                path,
                log_level="warning",
                log_dir=directory / "logs",
                wrappers={CUT_RELAY: wrapper},
            )
            try:
                mesh.start(timeout_s=START_TIMEOUT_S)
            except MeshError as e:
                print(f"error: the mesh did not start: {e}", file=sys.stderr)
                return EXIT_MESH
            try:
                limits_now = mesh.config.limits
                if not args.json:
                    print(
                        f"mesh up; relay {CUT_RELAY} in namespace {namespace.name}; "
                        f"heartbeat_interval_ms {limits_now.heartbeat_interval_ms}, "
                        f"suspect_timeout_ms {limits_now.suspect_timeout_ms}",
                        flush=True,
                    )
                for i in range(args.runs):
                    cut_at = time.monotonic()
                    namespace.rules("-I", mesh_ports)
                    try:
                        [fence_ms] = wait_ms([all_fenced], mesh, cut_at)
                        time.sleep(max(0.0, cut_at + args.cut_s - time.monotonic()))
                    finally:
                        namespace.rules("-D", mesh_ports)
                    heard_ms, heal_ms = wait_ms([all_heard, all_serving], mesh, time.monotonic())
                    runs.append({"fence_ms": fence_ms, "heard_ms": heard_ms, "heal_ms": heal_ms})
                    if not args.json:
                        print(
                            f"run {i + 1}: fenced after {fmt(fence_ms)} ms; after the heal, "
                            f"hears the others after {fmt(heard_ms)} ms, serving after "
                            f"{fmt(heal_ms)} ms",
                            flush=True,
                        )
                    if heal_ms is not None:
                        time.sleep(0.5)  # let the others settle before the next cut
            finally:
                mesh.stop()
        finally:
            namespace.close()
    summary: dict[str, float | None] = {}
    for key in ("heard_ms", "heal_ms"):
        values = [v for r in runs if (v := r[key]) is not None]
        summary[key + "_median"] = statistics.median(values) if values else None
        summary[key + "_max"] = max(values) if values else None
    if args.json:
        print(json.dumps({"limits": limits, "runs": runs, **summary}, indent=2))
    else:
        healed = sum(r["heal_ms"] is not None for r in runs)
        print(
            f"heal -> hears the others: median {fmt(summary['heard_ms_median'])} ms, max "
            f"{fmt(summary['heard_ms_max'])} ms; heal -> serving: median "
            f"{fmt(summary['heal_ms_median'])} ms, max {fmt(summary['heal_ms_max'])} ms "
            f"({healed} of {len(runs)} runs healed)"
        )
    bad = any(r["fence_ms"] is None or r["heal_ms"] is None for r in runs)
    return EXIT_BAD if bad else EXIT_OK


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


if __name__ == "__main__":
    sys.exit(main())
