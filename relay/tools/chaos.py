"""`relay chaos`: real relay processes under real faults, and a check of what they kept.

    sudo .venv/bin/relay chaos [--relays 3|5] [--scenario NAME ...|all] [--duration-s 90]
        [--producers N] [--consumers N] [--seed S] [--json] [--keep-logs] [--curve]

For each scenario, on a fresh mesh (relay/tools/netns.py: every relay in its own network
namespace on a bridge, at 10.77.0.10+i; the clients on the host end, 10.77.0.1):

1. start the relays (`ip netns exec NS python -m relay run ...`) and wait until each has
   joined every stream; start `--producers` producers (one transaction in flight each,
   every relay in their list, a different one first, streams in turn) and `--consumers`
   live consumers (from earliest, failing over between relays as the client does);
2. after a warm-up, inject the scenario's fault, hold it, heal it, let the mesh settle,
   again until `--duration-s` has passed; the fault start and heal times are kept;
3. heal everything, stop the producers, wait (bounded) until every relay has committed
   every acknowledged write, read each relay's history of each stream from that relay
   alone, and check it (relay/tools/chaos_history.py).

Scenarios (one relay or one link at a time, so a majority can always commit, directly or
through another relay):
  kill               kill -9 a relay, restart it after the hold (empty memory)
  pause              SIGSTOP a relay, SIGCONT after the hold
  partition          cut a relay from every other relay, both ways (clients reach it)
  partial-partition  cut one link between two relays, both ways or (every other time) one way
  kill-cut           kill -9 as many relays as a majority can lose while three stay (none of
                     3, one of 4, two of 5), and cut the link between two of the others both
                     ways: the third holds the majority together (transit, protocol 5.13);
                     restart them and mend the link at the heal
  clock              step a running relay's wall clock by -180..+180 s, back to 0 at the heal
  clock-restart      kill -9 a relay and restart it with its clock 30..180 s back; the heal
                     steps it to the right time
  mix                each cycle one of the above but kill-cut, at random
  roll               docs/deploy.md section 9 as written, onto another topology each cycle:
                     every relay in turn (a random order) is given a file that names other
                     relays for stream chaos.b (3 relays: relay 2 drops it; 5 relays: it
                     grows from relays 0-2 to all five, and back), and made to read it, by
                     SIGTERM and a start (even cycles) or by SIGHUP (odd ones), the next
                     only once it is ready; half way through each roll a fault: kill -9
                     of a relay not moved yet (3 relays: after its move, so one is down at
                     a time), or (5 relays) a partition of relays {0, 1} from {2, 3, 4}
                     (the split brain of issue 47); then the roll goes on, and the mesh
                     changes chaos.b's relays to what the files name (waited for)
  replace            as roll, onto a file that moves chaos.b by one relay (3 relays: from
                     relays 0-1 to 1-2; 5 relays: from 0-2 to 1-3), and back
  limits             as roll, onto a file that changes only limits (CHANGED_LIMITS, which a
                     reload takes), and back; after each roll every relay must run with
                     its file's limits (its status says which)
  start-limits       as limits, onto a file that changes the limits a relay takes only at
                     a start (CHANGED_START_LIMITS: the mesh links' timings and largest
                     frame), by restarts only, and back
  upgrade            docs/deploy.md section 9's upgrade, not in `all`: the mesh starts on
                     another build of the package (`--from-build DIR`, a checkout of a
                     release that speaks this peer protocol), and every relay in turn is
                     restarted onto this build, the next only once it is ready, with the
                     fault of roll half way; then back onto the other build, and so on
  add-relay          docs/deploy.md section 9's "Adding a relay to the mesh", once: the
                     mesh starts without its last relay; that relay is started on a file
                     that adds it (chaos.a and chaos.b grow onto it), then every other
                     relay is given the file and sent SIGHUP, with a kill -9 half way of
                     a relay not given it yet
  replace-relay      docs/deploy.md section 9's "Replacing a relay", once: the mesh starts
                     without its last relay, which is started on a file in which it serves
                     relay 0's streams and relay 0 serves none; every other relay is given
                     it and sent SIGHUP (a kill -9 half way of a relay not given it yet);
                     once every stream (the metadata stream too) runs on its new relays,
                     the file without relay 0 is given to the others and read, and relay 0
                     is stopped once none of them counts it (and, with --curve, once it
                     hears none of them) (4 relays: relays 0-2 become 1-3; 5: 0-3 become
                     1-4, chaos.b 0-2 becomes 1, 2, 4)
  stale              one relay given that other file, held, then the right one again (by
                     restart or SIGHUP as in roll); half way, the fault of roll (kill -9
                     of another relay, or the partition); the relay must name the stale
                     file in its status, and chaos.b must keep its relays

With `--curve`, every file of the run turns CurveZMQ on (`secure`): the relays authenticate
each other and the clients (one client key with every right), so the reloads that add and
let go relays also rebind the mesh port (docs/deploy.md section 9).

Relays of the clock scenarios (and of mix) run under libfaketime (LD_PRELOAD, a per-relay
FAKETIME_TIMESTAMP_FILE re-read on every call, the monotonic clock left alone) from the
start, so the offset of a running relay can be rewritten.

Each relay runs with a topology file of its own, in the scenario's directory, and keeps its
data directory (acceptor records, incarnation) across restarts. In roll, once every relay
read the new file, the mesh changes chaos.b's relays (docs/protocol.md 5.15 changes); in
stale, the relay with the other file holds the change, so chaos.b keeps its relays.

Printed per scenario: attempts, committed, unknown, fenced, lost, dup, phantom, divergent
(relays and consumers), stuck (relays not joined, unfenced and caught up within
CONVERGE_TIMEOUT_S after the run, or whose history could not be read from them alone),
max_gap_s (the longest time without a commit acknowledgement over all producers, from
their start to their stop), recover_s (heal to the next commit: max and median) and
rejoin_s (heal to every relay joined and unfenced, the longest; "(N late)": heals after
which that did not happen within the settle time; the next fault then waits for it, at
most REJOIN_MAX_S after the heal), change_s (roll, stale, replace, limits: the longest
time one change of topology took, from the first relay moved to chaos.b running on the relays the
files name, every relay ready) and, for them, the longest gap per stream (each producer
writes one stream: a stream whose relays lost their majority, chaos.b on two relays with
one killed, stalls; the other must not). `--json` adds
the fault times, each relay's history span, `unverified` (acknowledged writes older than
anything any relay or live consumer still shows: without a store, a history every relay
has restarted past is gone) and the problems found. Exit codes: 0; 1 if any scenario
lost, duplicated, invented, diverged, got stuck or committed nothing; 2 usage; 3 if the
harness could not run (not root, tools missing).
Namespaces, links, rules and relay processes are always removed, also on failure and
Ctrl-C; a crashed run's leftovers are removed at the next start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml  # type: ignore[import-untyped, unused-ignore]

from relay.client import Consumer, Producer
from relay.core.quorum import quorum
from relay.errors import ClientError, Fenced, Rejected, UnknownStream
from relay.launcher import ADMIN_GRANT, not_ready_reason, query_status, startup_streams
from relay.meta import METADATA_STREAM
from relay.security import ClientCurve, KeyRing, client_curve
from relay.streamhealth import relay_problems
from relay.tools import chaos_history as history
from relay.tools.netns import ChaosNet, NetError
from relay.topology import MeshConfig, load

__all__ = [
    "SCENARIOS",
    "ChaosError",
    "Options",
    "ScenarioResult",
    "parse_scenarios",
    "run_cli",
    "run_scenarios",
]

SCENARIOS = (
    "kill",
    "pause",
    "partition",
    "partial-partition",
    "kill-cut",
    "clock",
    "clock-restart",
    "mix",
    "roll",
    "stale",
    "replace",
    "limits",
    "start-limits",
    "add-relay",
    "replace-relay",
)
# Scenarios that need another build (`Options.from_build`): not in `all`.
BUILD_SCENARIOS = ("upgrade",)
# Changes of topology, with a fault half way (`_inject_change`, `_inject_add`,
# `_inject_replace`).
CHANGE_SCENARIOS = frozenset(
    {"roll", "stale", "replace", "limits", "start-limits", "add-relay", "replace-relay"}
)
# The scenarios whose other file changes limits only, and what they change.
LIMITS_SCENARIOS = frozenset({"limits", "start-limits"})
# What limits moves between (the run's file has the defaults): bounds a running relay takes
# on a reload, each well above what the run's producers and consumers need.
CHANGED_LIMITS = {
    "max_tx_bytes": 64 * 1024,
    "produce_timeout_ms": 1_500,
    "max_pending_produces": 5_000,
    "buffer_max_entries": 200_000,
    "relay_buffer_max_bytes": 512 * 1024 * 1024,
    "report_log_entries": 20_000,
    "late_max_entries": 2_000,
    "max_unread_reply_bytes": 16 * 1024 * 1024,
    "max_queued_requests_per_client": 2_000,
}
# What start-limits moves between: docs/deploy.md section 4's `[start]` limits, the
# timings raised together (suspect_timeout_ms still several times heartbeat_interval_ms
# in every pair of old and new files) and the largest frame lowered, far above what the
# run sends.
CHANGED_START_LIMITS = {
    "heartbeat_interval_ms": 30,
    "suspect_timeout_ms": 250,
    "max_frame_bytes": 48 * 1024 * 1024,
}
# What mix picks from: the single faults (kill-cut is two at once).
FAULT_KINDS = tuple(k for k in SCENARIOS if k not in ("kill-cut", "mix", *CHANGE_SCENARIOS))
CLOCK_SCENARIOS = frozenset({"clock", "clock-restart", "mix"})
STREAMS = ("chaos.a", "chaos.b")
CHANGED_STREAM = "chaos.b"  # the stream whose relays roll, stale and replace change
STOP_WAIT_S = 10.0  # a relay stopped with SIGTERM exits within this (its unit's TimeoutStopSec)
MESH_PORT = 7100  # every relay has its own address, so all use the same ports
CLIENT_PORT = 7200

START_TIMEOUT_S = 30.0  # every relay joined
CONVERGE_TIMEOUT_S = 30.0  # after the run: every relay committed every acknowledged write
READ_IDLE_S = 2.0  # reading a relay's history ends after this long without a record
READ_TIMEOUT_S = 60.0  # reading one relay's history in total
SEND_TIMEOUT_S = 10.0  # one produce, every attempt included: then it counts as unknown
REQUEST_TIMEOUT_S = 3.0  # one attempt (a relay answers unknown after produce_timeout_ms)
CONSUMER_IDLE_S = 0.5  # a live consumer looks at its stop flag this often
THREAD_JOIN_S = SEND_TIMEOUT_S + 10.0
STATUS_TIMEOUT_S = 1.0
POLL_S = 0.1
KILL_WAIT_S = 5.0
CPU_SAMPLE_S = 0.5  # how long a silent relay's CPU use is watched

WARMUP_FRACTION = 0.1  # of the duration, before the first fault
HOLD_S = (3.0, 8.0)  # how long a fault lasts (at most a quarter of the duration)
SNAPSHOT_AFTER_S = 2.0  # into a fault: every running relay's status is kept (FaultEvent)
SETTLE_S = (3.0, 6.0)  # after a heal, before the next fault
# ... and at most this long after a heal while a relay is not ready yet: a fault that finds
# relays still joining tests what the protocol does not promise (a joiner needs every
# member's answer, docs/protocol.md 5.8), so the next one waits for them.
REJOIN_MAX_S = 30.0
CLOCK_STEPS_S = (-180, -120, -60, -30, 30, 60, 120, 180)
CLOCK_BACK_S = (30, 60, 120, 180)

EXIT_OK, EXIT_BAD, EXIT_HARNESS = 0, 1, 3  # 2, usage, is click's


class ChaosError(RuntimeError):
    """The harness could not run a scenario (a relay did not start, a tool failed)."""


@dataclass(frozen=True)
class Options:
    relays: int = 3
    scenarios: tuple[str, ...] = SCENARIOS
    duration_s: float = 90.0
    producers: int = 3
    consumers: int = 2
    seed: int = 0
    keep_logs: bool = False
    relay_log_level: str = "warning"
    log: Callable[[str], None] = field(default=lambda text: None, compare=False)
    curve: bool = False  # CurveZMQ on every socket, the clients with keys (`secure`)
    # upgrade: the root of another checkout of the package, which the mesh starts on
    from_build: Path | None = None


def parse_scenarios(names: Sequence[str]) -> tuple[str, ...]:
    """Scenario names (each may be a comma list; `all` alone means every one), in the
    given order without repeats; ValueError naming an unknown one."""
    chosen: list[str] = []
    for raw in names:
        for name in (n.strip().lower() for n in raw.split(",")):
            if not name:
                continue
            if name == "all":
                chosen.extend(s for s in SCENARIOS if s not in chosen)
            elif name not in (*SCENARIOS, *BUILD_SCENARIOS):
                known = ", ".join((*SCENARIOS, *BUILD_SCENARIOS))
                raise ValueError(f"unknown scenario {name!r}; known: {known}")
            elif name not in chosen:
                chosen.append(name)
    return tuple(chosen) or SCENARIOS


# --- the relay processes ----------------------------------------------------------------------


def libfaketime() -> Path:
    """The preload library of libfaketime (Debian package `faketime`)."""
    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1"):
        for path in sorted(Path("/").glob(pattern.lstrip("/"))):
            return path
    raise ChaosError("libfaketime not found (bash scripts/chaos-deps.sh installs it)")


def changed_relays(relays: int, other: bool, scenario: str = "roll") -> tuple[int, ...]:
    """The relays a topology names for CHANGED_STREAM: the run's (`other` False) or the one
    roll and stale change to. With 3 relays, all three and then relays 0-1 (relay 2 drops
    it); with more, relays 0-2 and then all of them (it grows, as in issue 47). replace
    moves it by one relay: relays 0-1 to 1-2 (3 relays), 0-2 to 1-3 (5 relays). add-relay
    grows it onto the relay added to the mesh: 0-1 to 0-2 (3), 0-2 to 0-2 and 4 (5)."""
    every = tuple(range(relays))
    if scenario in LIMITS_SCENARIOS or scenario in BUILD_SCENARIOS:  # (limits only, or none)
        other = False
    if scenario == "replace-relay":  # the run's only: write_replace_topologies moves it
        return every[: 2 if relays <= 3 else 3]
    if scenario == "add-relay":  # the last relay is the one added
        width = 2 if relays <= 3 else 3
        return (*every[:width], every[-1]) if other else every[:width]
    if scenario == "replace":
        width = 2 if relays <= 3 else 3
        return every[1 : width + 1] if other else every[:width]
    if relays <= 3:
        return every[:2] if other else every
    return every if other else every[:3]


def write_topology(
    directory: Path, net: ChaosNet, *, other: bool = False, scenario: str = "roll"
) -> Path:
    """A topology of the run: relay i at its namespace's address, chaos.a on every relay
    and CHANGED_STREAM on `changed_relays` (the run's, or with `other` the changed one).
    add-relay and replace-relay: the run's file leaves the last relay out of the mesh."""
    serving = changed_relays(net.relays, other, scenario)
    later = scenario in ("add-relay", "replace-relay") and not other
    streams = {
        relay: ["chaos.a", CHANGED_STREAM] if relay in serving else ["chaos.a"]
        for relay in range(net.relays - 1 if later else net.relays)
    }
    name = "topology-other.yaml" if other else "topology.yaml"
    limits = None
    if other and scenario in LIMITS_SCENARIOS:
        limits = CHANGED_START_LIMITS if scenario == "start-limits" else CHANGED_LIMITS
    return _write_doc(directory / name, directory, net, streams, limits)


def write_replace_topologies(directory: Path, net: ChaosNet) -> tuple[Path, Path]:
    """replace-relay's two files after the run's: the last relay in relay 0's place, with
    relay 0 still in the mesh serving no stream; then the same without relay 0."""
    base = {0: ["chaos.a", CHANGED_STREAM], **{r: ["chaos.a"] for r in range(1, net.relays)}}
    for relay in changed_relays(net.relays, False, "replace-relay"):
        base[relay] = ["chaos.a", CHANGED_STREAM]
    drained = {**base, 0: [], net.relays - 1: base[0]}
    final = {r: names for r, names in drained.items() if r != 0}
    return (
        _write_doc(directory / "topology-drained.yaml", directory, net, drained),
        _write_doc(directory / "topology-final.yaml", directory, net, final),
    )


def secure(directory: Path, paths: Sequence[Path]) -> None:
    """`--curve`: CurveZMQ on in each of the run's files (keys in `directory/keys`, one
    client, `admin`, with every right), and every relay's key pair and the client's made
    (relay/security.py KeyRing.ensure): the relays run, and clients connect, as a mesh
    deployed with security.curve does (docs/security.md)."""
    keys = directory / "keys"
    for path in paths:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        doc["security"] = {
            "curve": True,
            "keys_dir": str(keys),
            "client_key_file": str(keys / "client-admin.key_secret"),
        }
        doc["access"] = {"admin": dict(ADMIN_GRANT)}
        path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    for path in paths:
        KeyRing(load(path)).ensure()


def _write_doc(
    path: Path,
    directory: Path,
    net: ChaosNet,
    streams: dict[int, list[str]],
    limits: dict[str, int] | None = None,
) -> Path:
    doc: dict[str, Any] = {
        "relays": [
            {
                "id": relay,
                "host": net.address(relay),
                "mesh_port": MESH_PORT,
                "client_port": CLIENT_PORT,
                "streams": names,
            }
            for relay, names in sorted(streams.items())
        ],
        "streams": list(STREAMS),
        "data_dir": str(directory / "data"),
    }
    if limits:
        doc["limits"] = dict(limits)
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def _die_with_parent() -> None:  # runs in the child between fork and exec
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


class RelayProcesses:
    """The relays of one scenario, each in its namespace; logs (appended across
    restarts) and faketime offset files in `directory`. Spawn from the main thread only
    (a relay dies with the thread that started it)."""

    def __init__(
        self,
        net: ChaosNet,
        topology: Path,
        directory: Path,
        *,
        faketime: Path | None,
        log_level: str = "warning",
    ) -> None:
        self.net = net
        self.log_level = log_level
        self.topology = topology
        self.config: MeshConfig = load(topology)
        self.directory = directory
        self.faketime = faketime
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.paused: set[int] = set()
        # the topology file whose text each relay's own file holds (default `topology`):
        # what it reads at its next start or SIGHUP
        self.topology_of: dict[int, Path] = {}
        # with CurveZMQ, the run's client key (every right): statuses, producers, readers
        self.curve = client_curve(self.config) if self.config.security.curve else None
        # the checkout each relay runs from at its next start (upgrade); none: this one
        self.build_of: dict[int, Path] = {}

    def endpoint(self, relay: int) -> str:
        return self.config.relays[relay].client_endpoint

    def own_file(self, relay: int) -> Path:
        """The topology file relay `relay` runs with (`relay run --config`)."""
        return self.directory / f"topology-relay-{relay}.yaml"

    def give_file(self, relay: int, topology: Path) -> None:
        """Put `topology`'s text in the relay's own file, as an operator copies a new file
        to its host: it reads it at its next start, or at once on SIGHUP (`hang_up`)."""
        own = self.own_file(relay)
        temp = own.with_suffix(".tmp")
        temp.write_text(topology.read_text(encoding="utf-8"), encoding="utf-8")
        temp.replace(own)  # atomically: the relay never reads half a file
        self.topology_of[relay] = topology

    def config_of(self, relay: int) -> MeshConfig:
        """The topology the relay's own file holds now."""
        return load(self.topology_of.get(relay, self.topology))

    def hang_up(self, relay: int) -> None:
        """SIGHUP (`systemctl reload`): the relay reads its file again."""
        self.procs[relay].send_signal(signal.SIGHUP)

    def clock_file(self, relay: int) -> Path:
        return self.directory / f"clock-{relay}.txt"

    def set_clock(self, relay: int, offset_s: int) -> None:
        """Step the relay's wall clock to real time + offset_s (at once if it runs)."""
        if self.faketime is None:
            raise ChaosError("clock steps need the relays to run under libfaketime")
        path = self.clock_file(relay)
        temp = path.with_suffix(".tmp")
        temp.write_text(f"{offset_s:+d}s\n", encoding="utf-8")
        temp.replace(path)  # atomically: the relay never reads half a line

    def start(self, relay: int) -> None:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        if self.faketime is not None:
            if not self.clock_file(relay).exists():
                self.set_clock(relay, 0)
            env.update(
                LD_PRELOAD=str(self.faketime),
                FAKETIME_TIMESTAMP_FILE=str(self.clock_file(relay)),
                FAKETIME_NO_CACHE="1",
                # A wall clock step only: the kernel never steps the monotonic clock, and
                # the event loop's timers must not jump.
                FAKETIME_DONT_FAKE_MONOTONIC="1",
                # Timed waits on the monotonic clock (the interpreter's lock between
                # threads) left alone too: libfaketime 0.9.10 converts them through the
                # fake clock anyway, and a relay with a second Python thread (pyzmq's
                # garbage collector, after a zero-copy answer) then took 100-800 ms
                # turns, so its peers suspected it (wolfcw/libfaketime#503).
                FAKETIME_FORCE_MONOTONIC_FIX="0",
            )
        if not self.own_file(relay).exists():
            self.give_file(relay, self.topology_of.get(relay, self.topology))
        # Another build's package first on the path: `python -m` puts the working
        # directory before PYTHONPATH, so the relay also runs from the build's root.
        build = self.build_of.get(relay)
        if build is not None:
            env["PYTHONPATH"] = str(build)
        argv = [sys.executable, "-m", "relay", "run", "--config", str(self.own_file(relay))]
        argv += ["--relay", str(relay), "--log-level", self.log_level]
        with open(self.directory / f"relay-{relay}.log", "ab") as out:
            self.procs[relay] = subprocess.Popen(
                self.net.command(relay, argv),
                cwd=build,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,
            )
        self.paused.discard(relay)

    def kill(self, relay: int) -> None:
        proc = self.procs[relay]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(KILL_WAIT_S)
        self.paused.discard(relay)

    def terminate(self, relay: int) -> None:
        """Stop the relay as its unit does (SIGTERM), then SIGKILL if it lingers."""
        proc = self.procs[relay]
        if proc.poll() is None:
            self.resume(relay)
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill(relay)
            raise ChaosError(
                f"relay {relay} did not stop within {STOP_WAIT_S:g} s of SIGTERM"
            ) from None

    def retire(self, relay: int) -> None:
        """Stop a relay that left the mesh for good: from then on it is none of the run's
        relays (statuses, readiness, the histories read at the end)."""
        self.terminate(relay)
        del self.procs[relay]
        self.paused.discard(relay)

    def pause(self, relay: int) -> None:
        self.procs[relay].send_signal(signal.SIGSTOP)
        self.paused.add(relay)

    def resume(self, relay: int) -> None:
        if self.procs[relay].poll() is None:
            self.procs[relay].send_signal(signal.SIGCONT)
        self.paused.discard(relay)

    def process_state(self, relay: int) -> str:
        """The relay process's state and CPU use, to tell a busy relay from a stuck one."""
        proc = self.procs[relay]
        if proc.poll() is not None:
            return f"exited with code {proc.returncode}"
        first = _cpu_ticks(proc.pid)
        time.sleep(CPU_SAMPLE_S)
        second = _cpu_ticks(proc.pid)
        if first is None or second is None:
            return "gone"
        ticks_s = os.sysconf("SC_CLK_TCK")
        busy = (second[1] - first[1]) / ticks_s / CPU_SAMPLE_S
        return f"state {second[0]}, {100 * busy:.0f}% of a core"

    def alive(self, relay: int) -> bool:
        return self.procs[relay].poll() is None

    def statuses(self) -> dict[int, dict[str, Any] | None]:
        """The status of every relay started (add-relay: the added one once it is)."""
        endpoints = {r: self.endpoint(r) for r in self.procs}
        replies = query_status(endpoints, STATUS_TIMEOUT_S, self.curve)
        return {r: reply.status for r, reply in replies.items()}

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            reasons: dict[int, str] = {}
            for relay, status in self.statuses().items():
                if not self.alive(relay):
                    raise ChaosError(f"relay {relay} exited: {self.log_tail(relay)}")
                if status is None:
                    reasons[relay] = "no status answer"
                else:
                    reason = not_ready_reason(self.config_of(relay), relay, status)
                    if reason is not None:
                        reasons[relay] = reason
            if not reasons:
                return
            if time.monotonic() >= deadline:
                relay, reason = min(reasons.items())
                raise ChaosError(
                    f"relay {relay} not ready after {timeout_s:g} s: {reason}; "
                    f"{self.log_tail(relay)}"
                )
            time.sleep(POLL_S)

    def not_ready_until(self, deadline: float, besides: Sequence[int] = ()) -> dict[int, str]:
        """Wait until every relay (but `besides`) is ready (joined, unfenced) or `deadline`
        passed: {} if they were, else why each relay that was not ready at the last look
        was not."""
        waiting: dict[int, str] = {}
        while time.monotonic() < deadline:
            waiting = {}
            for relay, status in self.statuses().items():
                if relay in besides:
                    continue
                reason = (
                    "no status answer"
                    if status is None
                    else not_ready_reason(self.config_of(relay), relay, status)
                )
                if reason is not None:
                    waiting[relay] = reason
            if not waiting:
                return {}
            time.sleep(POLL_S)
        return waiting or {relay: "not looked at in time" for relay in self.procs}

    def log_tail(self, relay: int, lines: int = 5) -> str:
        try:
            text = (self.directory / f"relay-{relay}.log").read_text(errors="replace")
        except OSError:
            return "no log"
        return " | ".join(text.splitlines()[-lines:]) or "empty log"

    def stop_all(self) -> None:
        for relay, proc in self.procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(KILL_WAIT_S)
            self.paused.discard(relay)


def _cpu_ticks(pid: int) -> tuple[str, int] | None:
    """(state letter, user + system clock ticks) of a process, from /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return fields[0], int(fields[11]) + int(fields[12])


# --- the clients ------------------------------------------------------------------------------


class ClientThread(threading.Thread):
    """A client running until `stopping` is set; `failure` if it died of an exception."""

    def __init__(self, name: str, relays: dict[int, str], curve: ClientCurve | None) -> None:
        super().__init__(name=name, daemon=True)
        self.relays = relays
        self.curve = curve
        self.stopping = threading.Event()
        self.failure: BaseException | None = None


class ProducerThread(ClientThread):
    """One transaction in flight at a time until stopped; records every attempt."""

    def __init__(
        self,
        name: str,
        relays: dict[int, str],
        streams: Sequence[str],
        curve: ClientCurve | None = None,
    ) -> None:
        super().__init__(name, relays, curve)
        self.streams = streams
        # (with CurveZMQ a client writes under producer ids that begin with its name)
        self.producer_id = (f"{curve.name}/" if curve is not None else "").encode() + name.encode()
        self.attempts: list[history.Attempt] = []
        self.final_errors: Counter[str] = Counter()  # errors no retry can help, by kind

    def run(self) -> None:
        try:
            with Producer(
                self.relays,
                producer_id=self.producer_id,
                window=1,
                send_timeout_s=SEND_TIMEOUT_S,
                request_timeout_s=REQUEST_TIMEOUT_S,
                curve=self.curve,
            ) as producer:
                n = 0
                while not self.stopping.is_set():
                    stream = self.streams[n % len(self.streams)]
                    value = b"%s:%d" % (self.producer_id, n)
                    pseq = producer.next_producer_seq
                    started = time.monotonic()
                    seq: int | None = None
                    try:
                        seq = producer.send(stream, value)
                        outcome = history.COMMITTED
                    except (Rejected, UnknownStream):
                        outcome = history.REJECTED
                    except Fenced:
                        outcome = history.FENCED
                    except ClientError as e:
                        outcome = history.UNKNOWN
                        if not e.retriable:
                            self.final_errors[f"{type(e).__name__}: {e}"] += 1
                    self.attempts.append(
                        history.Attempt(
                            stream,
                            self.producer_id,
                            pseq,
                            value,
                            started,
                            time.monotonic(),
                            outcome,
                            seq,
                        )
                    )
                    n += 1
        except BaseException as e:
            self.failure = e


class ConsumerThread(ClientThread):
    """A live consumer of one stream from earliest, failing over like any client."""

    def __init__(
        self, name: str, relays: dict[int, str], stream: str, curve: ClientCurve | None = None
    ) -> None:
        super().__init__(name, relays, curve)
        self.stream = stream
        self.records: list[history.HistoryRecord] = []
        self.errors: list[str] = []

    def run(self) -> None:
        try:
            with Consumer(
                self.relays, timeout_s=CONSUMER_IDLE_S, store=False, curve=self.curve
            ) as consumer:
                consumer.subscribe(self.stream, "earliest")
                while not self.stopping.is_set():
                    try:
                        for record in consumer:
                            self.records.append(_record(record))
                            if self.stopping.is_set():
                                break
                    except ClientError as e:  # e.g. out of range: resume where it was
                        self.errors.append(f"{type(e).__name__}: {e}")
                        position = consumer.position
                        consumer.subscribe(self.stream, -1 if position is None else position)
        except BaseException as e:
            self.failure = e


def _record(record: Any) -> history.HistoryRecord:
    return history.HistoryRecord(
        record.seq, record.producer_id, record.producer_seq, bytes(record.value)
    )


def read_history(
    endpoint: str, relay: int, stream: str, curve: ClientCurve | None = None
) -> history.RelayHistory:
    """Everything the relay holds of the stream, read from it alone."""
    records: list[history.HistoryRecord] = []
    deadline = time.monotonic() + READ_TIMEOUT_S
    with Consumer({relay: endpoint}, timeout_s=READ_IDLE_S, store=False, curve=curve) as consumer:
        consumer.subscribe(stream, "earliest")
        for record in consumer:
            records.append(_record(record))
            if time.monotonic() > deadline:
                break
        left = {k: consumer.stats[k] for k in _READ_LEFT if consumer.stats[k]}
    if left:  # it was told to go elsewhere or did not answer: only part of its history
        why = ", ".join(f"{k} {n}" for k, n in sorted(left.items()))
        raise Unreadable(f"relay {relay} {stream}: {why} after {len(records)} records")
    return history.RelayHistory(relay, stream, tuple(records))


# Why a consumer leaves a relay: reading a history ran into one, so it may be incomplete.
_READ_LEFT = ("redirect", "fenced", "not_ready", "timeouts", "unreachable", "disconnects")


class Unreadable(ChaosError):
    """A relay's history could not be read in full from it alone."""


# --- faults -----------------------------------------------------------------------------------


@dataclass
class FaultEvent:
    kind: str
    detail: str
    start_s: float  # since the producers started
    heal_s: float | None = None
    rejoin_s: float | None = None  # heal -> every relay joined and unfenced (None: not in time)
    # What each running relay said SNAPSHOT_AFTER_S into the fault, per stream: fenced or
    # stalled and why, whom it hears (and directly), the view's admitted members; so a
    # fault the mesh did not ride through can be read afterwards.
    during: dict[int, Any] = field(default_factory=dict)


class Faults:
    """Applies one fault at a time and heals it; `heal_everything` undoes whatever is on."""

    def __init__(self, relays: RelayProcesses, net: ChaosNet, rng: random.Random) -> None:
        self.relays = relays
        self.net = net
        self.rng = rng
        self.cycle = 0
        self._heal: Callable[[], None] | None = None

    def apply(self, kind: str) -> str:
        """Inject a fault of `kind`; return what was done."""
        assert self._heal is None, "one fault at a time"
        ids = sorted(self.relays.procs)
        victim = self.rng.choice(ids)
        self.cycle += 1
        if kind == "kill":
            self.relays.kill(victim)
            self._heal = lambda: self.relays.start(victim)
            return f"kill -9 relay {victim}"
        if kind == "pause":
            self.relays.pause(victim)
            self._heal = lambda: self.relays.resume(victim)
            return f"SIGSTOP relay {victim}"
        if kind == "partition":
            self.net.isolate(victim)
            self._heal = self.net.heal
            return f"isolate relay {victim}"
        if kind == "partial-partition":
            other = self.rng.choice([r for r in ids if r != victim])
            one_way = self.cycle % 2 == 0
            self.net.cut(victim, other, one_way=one_way, mesh_port=MESH_PORT)
            self._heal = self.net.heal
            return f"cut {victim}->{other}" if one_way else f"cut {victim}<->{other}"
        if kind == "kill-cut":
            n = len(ids)
            down = sorted(self.rng.sample(ids, max(0, min(n - quorum(n), n - 3))))
            for r in down:
                self.relays.kill(r)
            a, b = sorted(self.rng.sample([r for r in ids if r not in down], 2))
            self.net.cut(a, b)

            def mend() -> None:
                self.net.heal()
                for r in down:
                    self.relays.start(r)

            self._heal = mend
            return f"kill -9 relays {down}, cut {a}<->{b}"
        if kind == "clock":
            step = self.rng.choice(CLOCK_STEPS_S)
            self.relays.set_clock(victim, step)
            self._heal = lambda: self.relays.set_clock(victim, 0)
            return f"step relay {victim}'s clock {step:+d} s"
        if kind == "clock-restart":
            back = self.rng.choice(CLOCK_BACK_S)
            self.relays.kill(victim)
            self.relays.set_clock(victim, -back)
            self.relays.start(victim)
            self._heal = lambda: self.relays.set_clock(victim, 0)
            return f"restart relay {victim} with its clock -{back} s"
        raise ValueError(f"unknown fault kind {kind!r}")

    def heal(self) -> None:
        if self._heal is not None:
            heal, self._heal = self._heal, None
            heal()

    def heal_everything(self) -> None:
        """After the run (or on failure): every relay running, resumed, on time, linked."""
        self.heal()
        self.net.heal()
        for relay in sorted(self.relays.procs):
            if self.relays.faketime is not None:
                self.relays.set_clock(relay, 0)
            if not self.relays.alive(relay):
                self.relays.start(relay)
            self.relays.resume(relay)


# --- one scenario -----------------------------------------------------------------------------


@dataclass
class ScenarioResult:
    scenario: str
    relays: int
    duration_s: float
    attempts: int = 0
    committed: int = 0
    unknown: int = 0
    fenced: int = 0
    rejected: int = 0
    unknown_appeared: int = 0
    lost: int = 0
    unverified: int = 0  # acknowledged, older than any relay's memory and any consumer's log
    dup: int = 0
    phantom: int = 0
    divergent: list[str] = field(default_factory=list)
    max_gap_s: float | None = None
    # Per producer: its longest gap between acknowledgements and when it began (seconds
    # since the producers started): all gaps at once is the mesh stalling, one alone is
    # a producer waiting out its request or send timeout.
    producer_gaps: dict[str, list[float]] = field(default_factory=dict)
    # Per stream: its longest gap between acknowledgements and when it began (roll and
    # stale: a stream whose relays lost their majority stalls, the other must not).
    stream_gaps: dict[str, list[float]] = field(default_factory=dict)
    recover_s: float | None = None  # the longest heal-to-commit time
    recover_median_s: float | None = None
    rejoin_s: float | None = None  # the longest heal-to-every-relay-ready time
    rejoin_missed: int = 0  # heals after which not every relay was ready within the settle time
    # roll, stale, replace: the longest change of topology, first restart to last relay ready
    change_s: float | None = None
    converged: bool = False
    stuck: list[str] = field(default_factory=list)  # relays not converged or not readable
    # "stream@relay": count, first seq, last seq (seqs as strings: relay/seqtext.py)
    held: dict[str, list[int | str]] = field(default_factory=dict)
    faults: list[FaultEvent] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    log_dir: str | None = None

    @property
    def ok(self) -> bool:
        """Nothing lost, duplicated, invented, divergent or stuck, and something committed
        (a run that commits nothing checks nothing)."""
        bad = self.lost or self.dup or self.phantom or self.divergent or self.stuck
        return not bad and self.converged and self.committed > 0


def run_scenario(name: str, options: Options, net: ChaosNet, seed: int) -> ScenarioResult:
    """Run one scenario on a fresh mesh in `net` (see the module doc)."""
    result = ScenarioResult(name, options.relays, options.duration_s)
    directory = Path(tempfile.mkdtemp(prefix=f"relay-chaos-{name}-"))
    log = options.log
    faketime = libfaketime() if name in CLOCK_SCENARIOS else None
    base = write_topology(directory, net, scenario=name)
    added = options.relays - 1 if name in ("add-relay", "replace-relay") else None
    # add-relay and replace-relay: the processes know every relay's address (the file the
    # mesh grows to), and the relays of the mesh read the file without the added one until
    # it is added.
    full = base
    if name == "add-relay":
        full = write_topology(directory, net, other=True, scenario=name)
    elif name == "replace-relay":
        full, final = write_replace_topologies(directory, net)
    other = write_topology(directory, net, other=True, scenario=name)
    if options.curve:
        secure(directory, (base, full, other, *((final,) if name == "replace-relay" else ())))
    relays = RelayProcesses(
        net, full, directory, faketime=faketime, log_level=options.relay_log_level
    )
    if name in BUILD_SCENARIOS:
        if options.from_build is None:
            raise ChaosError(f"{name} needs another build: --from-build DIR")
        relays.build_of.update(dict.fromkeys(range(options.relays), options.from_build))
    if added is not None:
        relays.topology_of.update(dict.fromkeys(range(added), base))
    rng = random.Random(f"{seed}:{name}:{options.relays}")
    faults = Faults(relays, net, rng)
    producers: list[ProducerThread] = []
    consumers: list[ConsumerThread] = []
    try:
        for relay in range(options.relays):
            if relay != added:
                relays.start(relay)
        relays.wait_ready(START_TIMEOUT_S)
        endpoints = {r: relays.endpoint(r) for r in range(options.relays)}
        for i in range(options.producers):
            order = [(i + k) % options.relays for k in range(options.relays)]
            # One stream per producer (window 1): a stream that stalls holds up its own
            # producers only, so each stream's gaps are its own.
            streams = [STREAMS[i % len(STREAMS)]]
            producers.append(
                ProducerThread(
                    f"{net.prefix}-{name}-p{i}",
                    {r: endpoints[r] for r in order},
                    streams,
                    relays.curve,
                )
            )
        for i in range(options.consumers):
            order = [(i + 1 + k) % options.relays for k in range(options.relays)]
            consumers.append(
                ConsumerThread(
                    f"c{i}", {r: endpoints[r] for r in order}, STREAMS[i % 2], relays.curve
                )
            )
        for thread in (*producers, *consumers):
            thread.start()
        t0 = time.monotonic()
        end = t0 + options.duration_s
        if name == "replace-relay":
            _inject_replace(options, faults, rng, result, t0, end, (full, final), added or 0)
        elif added is not None:
            _inject_add(options, faults, rng, result, t0, end, full, added)
        elif name in CHANGE_SCENARIOS or name in BUILD_SCENARIOS:
            _inject_change(name, options, faults, rng, result, t0, end, other)
        else:
            _inject(name, options, faults, rng, result, t0, end)
        faults.heal_everything()
        for thread in producers:
            thread.stopping.set()
        for thread in producers:
            thread.join(THREAD_JOIN_S)
        t_end = time.monotonic()
        attempts = [a for p in producers for a in p.attempts]
        result.converged = _converge(relays, attempts, result)
        for thread in consumers:
            thread.stopping.set()
        for thread in consumers:
            thread.join(THREAD_JOIN_S)
        histories = _read_histories(relays, result)
        _problems_of_threads(producers, consumers, result)
        verdict = history.check(
            attempts,
            histories,
            [history.ConsumerLog(c.name, c.stream, tuple(c.records)) for c in consumers],
        )
        _fill(result, verdict, attempts, histories, t0, t_end)
        log(f"{name}: {_summary_line(result)}")
    finally:
        for client in [*producers, *consumers]:
            client.stopping.set()
        relays.stop_all()
        net.heal()
        if options.keep_logs or not result.ok:
            result.log_dir = str(directory)
        else:
            shutil.rmtree(directory, ignore_errors=True)
    return result


def _inject(
    name: str,
    options: Options,
    faults: Faults,
    rng: random.Random,
    result: ScenarioResult,
    t0: float,
    end: float,
) -> None:
    """Fault, hold, heal, settle, until `end`."""
    hold_max = min(HOLD_S[1], options.duration_s / 4)
    settle_max = min(SETTLE_S[1], options.duration_s / 4)
    _sleep_until(t0 + max(1.0, options.duration_s * WARMUP_FRACTION))
    while time.monotonic() < end:
        kind = rng.choice(FAULT_KINDS) if name == "mix" else name
        hold = rng.uniform(min(HOLD_S[0], hold_max), hold_max)
        if time.monotonic() + hold + min(SETTLE_S[0], settle_max) > end:
            break  # no room to settle after the heal
        event = FaultEvent(kind, "", round(time.monotonic() - t0, 3))
        event.detail = faults.apply(kind)
        result.faults.append(event)
        options.log(f"  {event.start_s:6.1f} s  {event.detail}")
        fault_end = time.monotonic() + hold
        _sleep_until(min(fault_end, time.monotonic() + SNAPSHOT_AFTER_S))
        event.during = _snapshot(faults.relays)
        _sleep_until(fault_end)
        faults.heal()
        healed = time.monotonic()
        event.heal_s = round(healed - t0, 3)
        settle_until = min(end, healed + rng.uniform(min(SETTLE_S[0], settle_max), settle_max))
        waiting = faults.relays.not_ready_until(settle_until)
        if not waiting:
            event.rejoin_s = round(time.monotonic() - healed, 3)
            ready = "every relay ready"
        else:  # which relays were not, and why, to tell a slow start from a slow join
            ready = f"NOT every relay ready ({_why_not_ready(waiting)})"
        options.log(
            f"  {event.heal_s:6.1f} s  healed; {ready} {time.monotonic() - healed:.2f} s on"
        )
        _sleep_until(settle_until)
        if event.rejoin_s is None and not faults.relays.not_ready_until(
            min(end, healed + REJOIN_MAX_S)
        ):
            options.log(f"           every relay ready {time.monotonic() - healed:.2f} s on")
    _sleep_until(end)


def _inject_change(
    name: str,
    options: Options,
    faults: Faults,
    rng: random.Random,
    result: ScenarioResult,
    t0: float,
    end: float,
    other: Path,
) -> None:
    """roll, replace, stale, limits, start-limits and upgrade (module doc): changes of
    topology or of build, one relay at a time, by restarts and by reloads in turn
    (start-limits and upgrade: by restarts), each waited for as docs/deploy.md section 9
    says, with a fault half way; then the wait for the mesh to change the stream's
    relays (or, for stale, the limits and upgrade, to keep them; the limits: for every
    relay to run with its file's limits); until `end`."""
    relays = faults.relays
    ids = sorted(relays.procs)
    files = (relays.topology, other)
    # upgrade: the build each side runs (the run starts on the other one; None: this one)
    builds = (options.from_build, None)
    onto = 1  # the file (and build) the next change moves to
    _sleep_until(t0 + max(1.0, options.duration_s * WARMUP_FRACTION))
    for cycle in itertools.count():
        if time.monotonic() >= end:
            break
        # (start-limits: a reload would refuse them, by name; upgrade: a new process)
        by_restart = name == "start-limits" or name in BUILD_SCENARIOS
        how = "SIGHUP" if cycle % 2 and not by_restart else "restart"
        began = time.monotonic()
        order = rng.sample(ids, len(ids)) if name != "stale" else [rng.choice(ids)]
        steps = [(relay, files[onto]) for relay in order]
        if name == "stale":
            steps.append((order[0], files[0]))  # held on the stale file, then put right
        build = builds[onto]
        moved_onto = files[onto].name
        if name in BUILD_SCENARIOS:
            moved_onto = "this build" if build is None else f"the build in {build}"
        event = FaultEvent(
            name,
            f"relays {order} onto {moved_onto}"
            + (f", then back onto {files[0].name}" if name == "stale" else "")
            + f", by {how}",
            round(began - t0, 3),
        )
        result.faults.append(event)
        options.log(f"  {event.start_s:6.1f} s  {event.detail}")
        for i, (relay, topology) in enumerate(steps):
            if i == len(steps) // 2:
                others = order[i:] if name != "stale" else [r for r in ids if r != order[0]]
                _fault_half_way(options, faults, rng, result, t0, others)
            relays.give_file(relay, topology)
            if name in BUILD_SCENARIOS and build is not None:
                relays.build_of[relay] = build
            elif name in BUILD_SCENARIOS:
                relays.build_of.pop(relay, None)
            if how == "SIGHUP" and relays.alive(relay):
                _reload(relays, relay, event, result)
            else:
                if relays.alive(relay):
                    relays.terminate(relay)
                relays.start(relay)
            _ready_after(relays, relay, event, result, options)
            if name == "stale" and i == 0:
                _sleep_until(min(end, time.monotonic() + rng.uniform(*HOLD_S)))
                _check_stale_said(relays, relay, event, result)
        # The files agree now: the mesh changes the stream's relays to what they name.
        target = relays.config_of(order[0]).members(CHANGED_STREAM)
        _changed(relays, CHANGED_STREAM, target, event, result, options)
        if name in LIMITS_SCENARIOS:
            _check_limits(relays, event, result, options)
        healed = time.monotonic()
        event.heal_s = round(healed - t0, 3)
        event.rejoin_s = round(healed - began, 3)
        result.change_s = max(result.change_s or 0.0, event.rejoin_s)
        options.log(
            f"  {event.heal_s:6.1f} s  {CHANGED_STREAM} on relays {list(target)}, "
            f"{event.rejoin_s:.2f} s after the first move"
        )
        onto = 1 - onto if name != "stale" else 1
        _sleep_until(min(end, healed + rng.uniform(*SETTLE_S)))
    _sleep_until(end)


def _inject_add(
    options: Options,
    faults: Faults,
    rng: random.Random,
    result: ScenarioResult,
    t0: float,
    end: float,
    full: Path,
    added: int,
) -> None:
    """add-relay (module doc): docs/deploy.md section 9's "Adding a relay to the mesh",
    once: the added relay started on the new file, then every other relay given it and
    made to read it by SIGHUP in a random order, with a kill -9 half way; then the wait
    for every stream to run on the relays the file names."""
    relays = faults.relays
    _sleep_until(t0 + max(1.0, options.duration_s * WARMUP_FRACTION))
    began = time.monotonic()
    order = rng.sample(sorted(relays.procs), len(relays.procs))
    event = FaultEvent(
        "add-relay", f"relay {added} started, then relays {order} by SIGHUP", round(began - t0, 3)
    )
    _start_and_reload(options, faults, rng, result, t0, event, order, added, full)
    config = load(full)
    for stream in STREAMS:
        target = config.members(stream)
        _changed(relays, stream, target, event, result, options)
    healed = time.monotonic()
    event.heal_s = round(healed - t0, 3)
    event.rejoin_s = round(healed - began, 3)
    result.change_s = event.rejoin_s
    options.log(f"  {event.heal_s:6.1f} s  every stream on its relays, {event.rejoin_s:.2f} s on")
    _sleep_until(end)


def _inject_replace(
    options: Options,
    faults: Faults,
    rng: random.Random,
    result: ScenarioResult,
    t0: float,
    end: float,
    files: tuple[Path, Path],
    added: int,
    removed: int = 0,
) -> None:
    """replace-relay (module doc): docs/deploy.md section 9's "Replacing a relay", once:
    relay `added` started on the first of `files`, in which it serves relay `removed`'s
    streams and `removed` serves none; every other relay given it and made to read it by
    SIGHUP in a random order, with a kill -9 half way; once every stream runs on the
    relays it names, the second file (without `removed`) given to the others and read,
    and relay `removed` stopped once none of them counts it."""
    relays = faults.relays
    drained, final = files
    _sleep_until(t0 + max(1.0, options.duration_s * WARMUP_FRACTION))
    began = time.monotonic()
    order = rng.sample(sorted(relays.procs), len(relays.procs))
    event = FaultEvent(
        "replace-relay",
        f"relay {added} started in relay {removed}'s place, relays {order} by SIGHUP, "
        f"then relay {removed} removed",
        round(began - t0, 3),
    )
    _start_and_reload(options, faults, rng, result, t0, event, order, added, drained)
    config = load(drained)
    for stream in (*STREAMS, METADATA_STREAM):
        _changed(relays, stream, config.members(stream), event, result, options)
    staying = sorted(r for r in relays.procs if r != removed)
    for relay in staying:
        relays.give_file(relay, final)
        _reload(relays, relay, event, result)
    deadline = time.monotonic() + REJOIN_MAX_S
    while (counting := _counting(relays, staying, removed)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if counting:
        result.problems.append(f"{event.detail}: relays {counting} still count relay {removed}")
        options.log(f"           NOT let go: relay {removed} still counted by {counting}")
    elif relays.curve is not None:
        # With CurveZMQ the relays that let it go bound their mesh ports again and refuse
        # its key: it hears nobody (docs/deploy.md section 9).
        heard = _heard_until(relays, removed, time.monotonic() + REJOIN_MAX_S)
        if heard:
            result.problems.append(f"{event.detail}: relay {removed}, let go, hears {heard}")
            options.log(f"           NOT shut out: relay {removed} still hears {heard}")
    relays.retire(removed)
    _ready_after(relays, removed, event, result, options)
    healed = time.monotonic()
    event.heal_s = round(healed - t0, 3)
    event.rejoin_s = round(healed - began, 3)
    result.change_s = event.rejoin_s
    options.log(
        f"  {event.heal_s:6.1f} s  relay {removed} stopped, every stream on its relays, "
        f"{event.rejoin_s:.2f} s on"
    )
    _sleep_until(end)


def _start_and_reload(
    options: Options,
    faults: Faults,
    rng: random.Random,
    result: ScenarioResult,
    t0: float,
    event: FaultEvent,
    order: Sequence[int],
    added: int,
    topology: Path,
) -> None:
    """`event` begins: relay `added` started on `topology`, then each relay of `order`
    given it and made to read it by SIGHUP, each waited for, with a kill -9 half way of a
    relay not given it yet."""
    relays = faults.relays
    result.faults.append(event)
    options.log(f"  {event.start_s:6.1f} s  {event.detail}")
    relays.give_file(added, topology)
    relays.start(added)
    for i, relay in enumerate(order):
        if i == len(order) // 2:
            _fault_half_way(
                options, faults, rng, result, t0, order[i:], kill=True, besides=(added,)
            )
        relays.give_file(relay, topology)
        _reload(relays, relay, event, result)
        # The relay added may be ready only once the relays of its streams read the file:
        # with CurveZMQ, one that has not refuses its key, so it cannot join there yet.
        last = i == len(order) - 1
        _ready_after(relays, relay, event, result, options, () if last else (added,))


def _counting(relays: RelayProcesses, staying: Sequence[int], removed: int) -> list[int]:
    """The relays of `staying` that still count relay `removed` (or do not answer)."""
    statuses = relays.statuses()
    return [
        r
        for r in staying
        if removed in (((statuses.get(r) or {}).get("node") or {}).get("leaving", [removed]))
    ]


def _heard_until(relays: RelayProcesses, relay: int, deadline: float) -> list[int]:
    """Wait until `relay` hears no other relay, or `deadline`: those it still hears."""
    heard: list[int] = []
    while time.monotonic() < deadline:
        status = relays.statuses().get(relay) or {}
        heard = list(status.get("peers_heard") or [])
        if "peers_heard" in status and not heard:
            return []
        time.sleep(POLL_S)
    return heard or [-1]  # (-1: its status never came)


def _reload(relays: RelayProcesses, relay: int, event: FaultEvent, result: ScenarioResult) -> None:
    """SIGHUP, then wait until the relay says it read its file (its `topology_reloaded`
    counter went up): a refusal is a problem."""

    def counted(status: dict[str, Any] | None) -> tuple[int, int]:
        counters = ((status or {}).get("node") or {}).get("counters") or {}
        return counters.get("topology_reloaded", 0), counters.get("topology_reload_refused", 0)

    before = counted(relays.statuses().get(relay))
    relays.hang_up(relay)
    deadline = time.monotonic() + REJOIN_MAX_S
    while time.monotonic() < deadline:
        now = counted(relays.statuses().get(relay))
        if now[1] > before[1]:
            result.problems.append(f"{event.detail}: relay {relay} refused its new file")
            return
        if now[0] > before[0]:
            return
        time.sleep(POLL_S)
    result.problems.append(f"{event.detail}: relay {relay} did not say it read its file")


def _ready_after(
    relays: RelayProcesses,
    relay: int,
    event: FaultEvent,
    result: ScenarioResult,
    options: Options,
    besides: Sequence[int] = (),
) -> None:
    """After relay `relay` moved: wait until every relay (but `besides`) is ready, or name
    why not."""
    waiting = relays.not_ready_until(time.monotonic() + REJOIN_MAX_S, besides)
    if waiting:
        why = _why_not_ready(waiting)
        result.problems.append(f"{event.detail}: not every relay ready ({why})")
        options.log(f"           NOT every relay ready after relay {relay}: {why}")


def _changed(
    relays: RelayProcesses,
    stream: str,
    target: Sequence[int],
    event: FaultEvent,
    result: ScenarioResult,
    options: Options,
) -> None:
    """Once the files agree: wait until `stream` runs on `target`, or name what stands."""
    stands = _serving_until(relays, stream, target, time.monotonic() + REJOIN_MAX_S)
    if stands:
        result.problems.append(f"{event.detail}: {stream} not on {list(target)}")
        options.log(f"           NOT changed: {stream}: {stands}")


def _serving_until(
    relays: RelayProcesses, stream: str, target: Sequence[int], deadline: float
) -> str:
    """Wait until `stream` runs on exactly `target` (each of them serves it, joined and
    unfenced, under a configuration of those relays; no other relay serves it) or
    `deadline` passed: "" if it did, else what the last look found."""
    found = ""
    while time.monotonic() < deadline:
        seen = []
        for relay, status in sorted(relays.statuses().items()):
            info = ((status or {}).get("streams") or {}).get(stream)
            if relay not in target:
                if info is not None:
                    seen.append(f"relay {relay} still serves it")
                continue
            if info is None:
                seen.append(f"relay {relay} does not serve it")
            elif list((info.get("config") or {}).get("relays") or []) != list(target):
                seen.append(f"relay {relay} runs it on {info['config']['relays']}")
            elif not info.get("joined") or info.get("fenced"):
                seen.append(f"relay {relay} not joined or fenced ({info.get('fence_reason')})")
        found = "; ".join(seen)
        if not found:
            return ""
        time.sleep(POLL_S)
    return found or "not looked at in time"


def _check_limits(
    relays: RelayProcesses, event: FaultEvent, result: ScenarioResult, options: Options
) -> None:
    """Every relay runs with the limits of the file it was given (its status's
    `node.limits`), whether it read it by SIGHUP or at a start after a kill."""
    for relay, status in sorted(relays.statuses().items()):
        want = asdict(relays.config_of(relay).limits)
        running = ((status or {}).get("node") or {}).get("limits")
        if running != want:
            differ = sorted(k for k in want if (running or {}).get(k) != want[k])
            result.problems.append(f"{event.detail}: relay {relay} runs other limits {differ}")
            options.log(f"           NOT taken: relay {relay} runs other limits {differ}")


def _check_stale_said(
    relays: RelayProcesses, relay: int, event: FaultEvent, result: ScenarioResult
) -> None:
    """The relay on the stale file must say, as `relay status` and /readyz show it, that
    its topology names other relays for CHANGED_STREAM than the stream runs on (or that
    the stream's configuration leaves it out): a stale file is never silent."""
    status = relays.statuses().get(relay)
    said = [
        problem.words
        for stream, problem in relay_problems(status or {})
        if stream == CHANGED_STREAM and not problem.unready
    ]
    if not said:
        result.problems.append(
            f"{event.detail}: relay {relay} on the stale file did not report it "
            f"({CHANGED_STREAM}: {(status or {}).get('streams', {}).get(CHANGED_STREAM)})"
        )


def _fault_half_way(
    options: Options,
    faults: Faults,
    rng: random.Random,
    result: ScenarioResult,
    t0: float,
    candidates: Sequence[int],
    *,
    kill: bool = False,
    besides: Sequence[int] = (),
) -> None:
    """The fault in the middle of a change: with 5 relays or more, the partition {0, 1} |
    the rest (two relays on either file may find themselves on the minority side); with
    fewer, or `kill`, kill -9 of one of `candidates` (roll: a relay the change has not
    reached yet; stale: another relay than the stale one; add-relay, whose mesh of four
    a partition would leave without a majority: a relay not given the file yet), so one
    relay is down at a time: a restarting relay joins only once every member answers it
    (docs/protocol.md 5.8). Then the wait for every relay but `besides` to be ready."""
    relays, net = faults.relays, faults.net
    ids = sorted(relays.procs)
    mend: Callable[[], None]
    if len(ids) >= 5 and not kill:
        for a in (0, 1):
            for b in ids[2:]:
                net.cut(a, b)
        detail, mend = "partition {0, 1} | the rest", net.heal
    else:
        victim = rng.choice(list(candidates))
        relays.kill(victim)
        detail = f"kill -9 relay {victim}"

        def mend() -> None:
            relays.start(victim)

    event = FaultEvent("fault", detail, round(time.monotonic() - t0, 3))
    result.faults.append(event)
    options.log(f"  {event.start_s:6.1f} s  {detail}")
    hold = rng.uniform(*HOLD_S)
    _sleep_until(time.monotonic() + min(hold, SNAPSHOT_AFTER_S))
    event.during = _snapshot(relays)
    _sleep_until(time.monotonic() + max(0.0, hold - SNAPSHOT_AFTER_S))
    mend()
    healed = time.monotonic()
    event.heal_s = round(healed - t0, 3)
    waiting = relays.not_ready_until(healed + REJOIN_MAX_S, besides)
    if not waiting:
        event.rejoin_s = round(time.monotonic() - healed, 3)
    options.log(f"  {event.heal_s:6.1f} s  healed; ready {time.monotonic() - healed:.2f} s on")


def _why_not_ready(waiting: dict[int, str]) -> str:
    return "; ".join(f"relay {r}: {reason}" for r, reason in sorted(waiting.items()))


def _snapshot(relays: RelayProcesses) -> dict[int, Any]:
    """Per running relay: whom it hears and, per stream that is fenced or stalled, why."""
    out: dict[int, Any] = {}
    for relay, status in relays.statuses().items():
        if status is None:
            continue
        streams = status.get("streams") or {}
        out[relay] = {
            "peers_heard": status.get("peers_heard"),
            "hears_directly": status.get("hears_directly"),
            "route_via": status.get("route_via"),
            "streams": {
                name: {
                    key: st.get(key)
                    for key in ("joined", "fence_reason", "stall", "view", "admitted", "committed")
                }
                for name, st in streams.items()
                if st.get("fence_reason") or st.get("stall")
            },
        }
    return out


def _sleep_until(when: float) -> None:
    while (left := when - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))


def _converge(
    relays: RelayProcesses, attempts: list[history.Attempt], result: ScenarioResult
) -> bool:
    """Wait until every relay is joined, unfenced and has committed the highest
    acknowledged seq of every stream; False (with a problem) if it did not in time."""
    target = {s: -1 for s in STREAMS}
    for a in attempts:
        if a.outcome == history.COMMITTED and a.seq is not None:
            target[a.stream] = max(target[a.stream], a.seq)
    deadline = time.monotonic() + CONVERGE_TIMEOUT_S
    behind: dict[int, str] = {}
    while True:
        behind = {}
        for relay, status in relays.statuses().items():
            if status is None:
                behind[relay] = f"no status answer ({relays.process_state(relay)})"
                continue
            reason = not_ready_reason(relays.config_of(relay), relay, status)
            if reason is not None and not _clock_outlier(relays.config, relay, status):
                behind[relay] = reason
                continue
            for stream, seq in target.items():
                info = (status.get("streams") or {}).get(stream)
                if info is None:
                    continue  # not served here (roll: a change took the relay off it)
                committed = info.get("committed") or -1
                if committed < seq:
                    behind[relay] = f"{stream} committed {committed} < {seq}"
        if not behind:
            return True
        if time.monotonic() >= deadline:
            result.stuck = [f"relay {r}" for r in sorted(behind)]
            for relay, why in sorted(behind.items()):
                result.problems.append(
                    f"relay {relay} did not converge in {CONVERGE_TIMEOUT_S:g} s: {why}"
                )
            return False
        time.sleep(POLL_S)


def _clock_outlier(config: MeshConfig, relay: int, status: dict[str, Any]) -> bool:
    """Joined, and fenced only because its clock (or the floor it took from it) is still far
    from the majority's: a relay whose clock was stepped ahead returns by itself once real
    time catches up with its floor (docs/protocol.md 5.2), a minute or two after the heal."""
    streams = status.get("streams") or {}
    infos = [streams.get(name) or {} for name in startup_streams(config, relay)]
    return all(
        info.get("joined") and (not info.get("fenced") or info.get("fence_reason") == "clock")
        for info in infos
    )


def _read_histories(relays: RelayProcesses, result: ScenarioResult) -> list[history.RelayHistory]:
    out: list[history.RelayHistory] = []
    errors: list[str] = []
    unreadable: set[int] = set()
    lock = threading.Lock()

    def read(relay: int, stream: str) -> None:
        try:
            got = read_history(relays.endpoint(relay), relay, stream, relays.curve)
        except Unreadable as e:
            with lock:
                errors.append(f"cannot read the history: {e}")
                unreadable.add(relay)
            return
        except ClientError as e:
            with lock:
                errors.append(f"reading {stream} from relay {relay}: {e}")
            return
        with lock:
            out.append(got)

    statuses = relays.statuses()

    def serves(relay: int, stream: str) -> bool:
        """By the relay's own word (roll and stale: a stream's relays may have changed
        since the start); one that does not answer is read if its file names it."""
        status = statuses.get(relay)
        if status is None:
            return relay in relays.config_of(relay).members(stream)
        return stream in (status.get("streams") or {})

    threads = [
        threading.Thread(target=read, args=(relay, stream), daemon=True)
        for relay in sorted(relays.procs)
        for stream in STREAMS
        if serves(relay, stream)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(READ_TIMEOUT_S + 10)
    result.problems.extend(errors)
    result.stuck = sorted(set(result.stuck) | {f"relay {r}" for r in unreadable})
    return sorted(out, key=lambda h: (h.stream, h.relay))


def _problems_of_threads(
    producers: list[ProducerThread], consumers: list[ConsumerThread], result: ScenarioResult
) -> None:
    threads: list[ClientThread] = [*producers, *consumers]
    for thread in threads:
        if thread.is_alive():
            result.problems.append(f"{thread.name} did not stop")
        if thread.failure is not None:
            result.problems.append(f"{thread.name} failed: {thread.failure!r}")
    for producer in producers:
        for error, count in producer.final_errors.most_common(3):
            result.problems.append(f"{producer.name}: {count} x {error}")
    for consumer in consumers:
        for error in consumer.errors[:3]:
            result.problems.append(f"consumer {consumer.name}: {error}")


def _fill(
    result: ScenarioResult,
    verdict: history.Verdict,
    attempts: list[history.Attempt],
    histories: list[history.RelayHistory],
    t0: float,
    t_end: float,
) -> None:
    result.attempts = verdict.attempts
    result.committed = verdict.committed
    result.unknown = verdict.unknown
    result.fenced = verdict.fenced
    result.rejected = verdict.rejected
    result.unknown_appeared = verdict.unknown_appeared
    result.lost = verdict.lost
    result.unverified = verdict.unverified
    result.dup = verdict.duplicates
    result.phantom = verdict.phantom
    result.divergent = verdict.divergent
    result.problems.extend(verdict.problems)
    if verdict.problem_count > len(verdict.problems):
        result.problems.append(f"... {verdict.problem_count - len(verdict.problems)} more")
    acks = [a.ended_s for a in attempts if a.outcome == history.COMMITTED]
    result.max_gap_s = round(history.commit_gaps(acks, t0, t_end), 3)
    by_producer: dict[str, list[float]] = {}
    by_stream: dict[str, list[float]] = {}
    for a in attempts:
        if a.outcome == history.COMMITTED:
            by_producer.setdefault(a.producer_id.decode(), []).append(a.ended_s)
            by_stream.setdefault(a.stream, []).append(a.ended_s)
    for gaps, acked in ((result.producer_gaps, by_producer), (result.stream_gaps, by_stream)):
        for name, times in sorted(acked.items()):
            points = [t0, *sorted(times), t_end]
            begin, end = max(itertools.pairwise(points), key=lambda p: p[1] - p[0])
            gaps[name] = [round(end - begin, 3), round(begin - t0, 3)]
    heals = [t0 + f.heal_s for f in result.faults if f.heal_s is not None]
    worst, median = history.summary(history.recovery_times(heals, acks, t_end))
    result.recover_s = None if worst is None else round(worst, 3)
    result.recover_median_s = None if median is None else round(median, 3)
    # (a change's own time is change_s; only its fault's heal has a rejoin)
    rejoins = [
        f.rejoin_s for f in result.faults if f.heal_s is not None and f.kind not in CHANGE_SCENARIOS
    ]
    done = [r for r in rejoins if r is not None]
    result.rejoin_s = max(done) if done else None
    result.rejoin_missed = len(rejoins) - len(done)
    for h in histories:
        seqs = [r.seq for r in h.records]
        result.held[f"{h.stream}@{h.relay}"] = [  # seqs as strings, as in all JSON output
            len(seqs),
            str(min(seqs, default=-1)),
            str(max(seqs, default=-1)),
        ]


# --- many scenarios and the output ------------------------------------------------------------


def run_scenarios(options: Options) -> list[ScenarioResult]:
    """Every scenario of `options`, each on a fresh mesh in one network; the network is
    always removed. Raises ChaosError or NetError when the harness cannot run."""
    results: list[ScenarioResult] = []
    with ChaosNet(options.relays) as net:
        if net.removed_leftovers:
            options.log(f"removed leftovers of an earlier run: {', '.join(net.removed_leftovers)}")
        for name in options.scenarios:
            options.log(
                f"{name}: {options.relays} relays, {options.duration_s:g} s, "
                f"{options.producers} producers, {options.consumers} consumers"
            )
            try:
                results.append(run_scenario(name, options, net, options.seed))
            except ChaosError as e:  # this scenario could not run; the others still may
                failed = ScenarioResult(name, options.relays, options.duration_s)
                failed.problems.append(f"the scenario could not run: {e}")
                options.log(f"{name}: could not run: {e}")
                results.append(failed)
    return results


COLUMNS = (
    ("scenario", "scenario"),
    ("attempts", "attempts"),
    ("committed", "committed"),
    ("unknown", "unknown"),
    ("fenced", "fenced"),
    ("lost", "lost"),
    ("dup", "dup"),
    ("phantom", "phantom"),
    ("divergent", "divergent"),
    ("stuck", "stuck"),
    ("max_gap_s", "max_gap_s"),
    ("recover_s", "recover_s (max/med)"),
    ("rejoin_s", "rejoin_s"),
    ("change_s", "change_s"),
)


def _cell(result: ScenarioResult, key: str) -> str:
    if key in ("divergent", "stuck"):
        return str(len(getattr(result, key)))
    if key == "rejoin_s" and result.rejoin_missed:
        return f"{_cell(result, 'rejoin_s_only')} ({result.rejoin_missed} late)"
    if key == "rejoin_s_only":
        key = "rejoin_s"
    if key == "recover_s":
        if result.recover_s is None:
            return "-"
        return f"{result.recover_s:.2f}/{result.recover_median_s:.2f}"
    value = getattr(result, key)
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def table(results: Sequence[ScenarioResult]) -> str:
    rows = [[title for _, title in COLUMNS]]
    rows += [[_cell(r, key) for key, _ in COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    return "\n".join(lines)


def _summary_line(r: ScenarioResult) -> str:
    return (
        f"{r.attempts} attempts, {r.committed} committed, {r.unknown} unknown, "
        f"{r.fenced} fenced, {r.lost} lost ({r.unverified} unverified), {r.dup} dup, "
        f"{r.phantom} phantom, "
        f"divergent {r.divergent or 'none'}, stuck {r.stuck or 'none'}, "
        f"max gap {_cell(r, 'max_gap_s')} s, "
        f"recover {_cell(r, 'recover_s')} s, rejoin {_cell(r, 'rejoin_s')} s"
        + (f", change {_cell(r, 'change_s')} s" if r.change_s is not None else "")
        + (
            "; longest gap per stream: "
            + ", ".join(
                f"{name} {gap:.2f} s at {at:.1f} s"
                for name, (gap, at) in sorted(r.stream_gaps.items())
            )
            if r.change_s is not None
            else ""
        )
    )


def document(options: Options, results: Sequence[ScenarioResult]) -> dict[str, Any]:
    return {
        "relays": options.relays,
        "duration_s": options.duration_s,
        "producers": options.producers,
        "consumers": options.consumers,
        "seed": options.seed,
        "curve": options.curve,
        "scenarios": [dataclasses.asdict(r) | {"ok": r.ok} for r in results],
        "ok": all(r.ok for r in results),
    }


def run_cli(
    *,
    relays: int,
    scenarios: tuple[str, ...],
    duration_s: float,
    producers: int,
    consumers: int,
    seed: int,
    as_json: bool,
    keep_logs: bool,
    json_file: str | None = None,
    relay_log_level: str = "warning",
    curve: bool = False,
    from_build: Path | None = None,
    out: IO[str] | None = None,
) -> int:
    out = sys.stdout if out is None else out

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    options = Options(
        relays,
        scenarios,
        duration_s,
        producers,
        consumers,
        seed,
        keep_logs,
        relay_log_level,
        log,
        curve,
        from_build.resolve() if from_build is not None else None,
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        results = run_scenarios(options)
    except (NetError, ChaosError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_HARNESS
    except KeyboardInterrupt:
        print("interrupted; the network and relays were removed", file=sys.stderr)
        return EXIT_HARNESS
    finally:
        signal.signal(signal.SIGTERM, previous)
    doc = json.dumps(document(options, results), indent=2)
    if json_file is not None:
        Path(json_file).write_text(doc + "\n", encoding="utf-8")
    if as_json:
        print(doc, file=out)
    else:
        print(
            f"relay chaos: {options.relays} relays, {options.duration_s:g} s per scenario, "
            f"{options.producers} producers, {options.consumers} consumers, seed {options.seed}"
            + (", CurveZMQ" if options.curve else ""),
            file=out,
        )
        print(table(results), file=out)
        for r in results:
            for problem in r.problems:
                print(f"{r.scenario}: {problem}", file=out)
            if r.log_dir is not None:
                print(f"{r.scenario}: logs in {r.log_dir}", file=out)
    return EXIT_OK if all(r.ok for r in results) else EXIT_BAD


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
