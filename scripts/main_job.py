"""The main job: a round trip through a real local relay mesh.

    .venv/bin/python scripts/main_job.py [--count N] [--config FILE]

Starts every relay of the topology (default config/topology.yaml: 3 relays on 127.0.0.1)
as child processes, produces N transactions (default 1000) to stream `orders.eu` through
the first relay serving it with a pipelined Producer, reads them back from another relay
with a Consumer from `earliest`, and checks that every committed seq came back exactly once,
in ascending order, with its key and value. Prints a short summary. The mesh is always
stopped before the job ends.

Exit codes: 0 on success, 1 if a transaction did not commit or the read-back does not match,
2 for a usage or configuration error, 3 if the mesh could not start (e.g. a port is in use),
130 if interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.cli import relays_first
from relay.client import Consumer, Producer
from relay.errors import ClientError, ConfigError
from relay.launcher import Mesh, MeshError
from relay.topology import MeshConfig, load

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "config" / "topology.yaml"
STREAM = "orders.eu"
DEFAULT_COUNT = 1000
START_TIMEOUT_S = 20.0  # for every relay to come up
READ_IDLE_S = 0.5  # the consumer's wait for a record before checking whether it is done
READ_TIMEOUT_S = 30.0  # for the whole read-back
SHOW_PROBLEMS = 5  # problems printed of each kind

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_MESH, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="main_job.py",
        description="Start the local relay mesh, produce a batch to orders.eu, read it back "
        "from another relay and check it.",
    )
    parser.add_argument(
        "--count",
        type=int,
        default=DEFAULT_COUNT,
        metavar="N",
        help=f"transactions to produce (default {DEFAULT_COUNT})",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        metavar="FILE",
        help="the topology (default config/topology.yaml)",
    )
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(f"--count must be at least 1, got {args.count}")
    return args


def shown(path: Path) -> str:
    """`path` relative to the working directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def say(text: str = "") -> None:
    print(text, flush=True)


def fail(text: str) -> None:
    print(f"error: {text}", file=sys.stderr, flush=True)


# --- before starting: are the ports free? --------------------------------------------------


def ports_in_use(config: MeshConfig) -> list[str]:
    """Every mesh or client port of the topology that something on this host already
    holds, described for a person."""
    busy = []
    for relay_id, spec in config.relays.items():
        for what, port in (("mesh_port", spec.mesh_port), ("client_port", spec.client_port)):
            family = socket.AF_INET6 if ":" in spec.host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                # ZeroMQ binds with SO_REUSEADDR too: a port in TIME_WAIT is free for it.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((spec.host, port))
                except OSError as e:
                    busy.append(f"{spec.host}:{port} (relay {relay_id} {what}): {e.strerror}")
    return busy


def explain_busy_ports(config_path: Path, busy: list[str]) -> None:
    if busy:
        fail("the mesh cannot start: ports of the topology are in use:")
        for line in busy:
            print(f"  {line}", file=sys.stderr)
    print(
        "Is a mesh already running (`relay status --config "
        f"{shown(config_path)}`, stop `relay up` with Ctrl-C)? Otherwise free those ports or pass "
        "--config with a topology on other ports.",
        file=sys.stderr,
        flush=True,
    )


# --- the job ---------------------------------------------------------------------------------


@dataclass
class Produced:
    committed: dict[int, int] = field(default_factory=dict)  # seq -> index of the message
    failures: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    retries: int = 0


@dataclass
class ReadBack:
    seqs: list[int] = field(default_factory=list)  # ours, in the order read
    others: int = 0  # records of other producers (not checked)
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    endpoint: str | None = None
    failovers: int = 0


def message(i: int) -> tuple[bytes, bytes]:
    """The key and value of the i-th transaction."""
    return f"customer-{i % 97}".encode(), f"order {i:06d}: 1 x widget".encode()


def produce(config: MeshConfig, relay_id: int, count: int) -> tuple[Produced, bytes]:
    out = Produced()
    items = [message(i) for i in range(count)]
    started = time.monotonic()
    with Producer(relays=relays_first(config, relay_id, STREAM)) as producer:
        results = producer.send_many(STREAM, items, return_exceptions=True)
        out.elapsed_s = time.monotonic() - started
        out.retries = producer.stats["retries"]
        producer_id = producer.producer_id
    for i, result in enumerate(results):
        if isinstance(result, ClientError):
            out.failures.append(f"message {i}: {type(result).__name__}: {result}")
        elif result in out.committed:
            out.failures.append(
                f"messages {out.committed[result]} and {i} both committed as seq {result}"
            )
        else:
            out.committed[result] = i
    return out, producer_id


def read_back(
    config: MeshConfig, relay_id: int, producer_id: bytes, produced: Produced
) -> ReadBack:
    out = ReadBack()
    want = produced.committed
    seen: dict[int, int] = {}  # seq -> times read
    started = time.monotonic()
    deadline = started + READ_TIMEOUT_S
    last: int | None = None
    consumer = Consumer(relays=relays_first(config, relay_id, STREAM), timeout_s=READ_IDLE_S)
    with consumer.subscribe(STREAM, "earliest"):
        while True:
            record = next(consumer, None)
            if record is None:  # READ_IDLE_S without a record
                if len(seen) >= len(want) or time.monotonic() >= deadline:
                    break
                continue
            if record.producer_id != producer_id:
                out.others += 1
                continue
            seq = record.seq
            out.seqs.append(seq)
            seen[seq] = seen.get(seq, 0) + 1
            if last is not None and seq <= last:
                out.problems.append(f"seq {seq} came after seq {last}")
            last = seq
            if seq not in want:
                out.problems.append(f"seq {seq} was read but never reported committed")
            elif seen[seq] > 1:
                out.problems.append(f"seq {seq} was read {seen[seq]} times")
            elif (record.key, record.value) != message(want[seq]):
                out.problems.append(f"seq {seq} does not hold message {want[seq]}")
            if time.monotonic() >= deadline:
                break
        out.endpoint = consumer.endpoint
        out.failovers = consumer.stats["failovers"]
    out.elapsed_s = time.monotonic() - started
    missing = sorted(set(want) - set(seen))
    if missing:
        shown = ", ".join(str(s) for s in missing[:SHOW_PROBLEMS])
        more = f" and {len(missing) - SHOW_PROBLEMS} more" if len(missing) > SHOW_PROBLEMS else ""
        out.problems.append(
            f"{len(missing)} committed seqs never came back within {READ_TIMEOUT_S:g} s: "
            f"{shown}{more}"
        )
    return out


def pick_relays(config: MeshConfig) -> tuple[int, int]:
    """The relay to produce through and the one to read from: the first two serving the
    stream (relays 0 and 1 of config/topology.yaml); the same one if only one serves it."""
    members = list(config.members(STREAM))
    if not members:
        raise ConfigError(f"{config.path}: no relay serves stream {STREAM!r}")
    return members[0], members[1] if len(members) > 1 else members[0]


def print_mesh(mesh: Mesh, up_s: float) -> None:
    say(f"mesh up in {up_s:.1f} s: {len(mesh.relay_ids)} relays")
    pids = mesh.pids
    for relay_id, ends in mesh.endpoints.items():
        say(
            f"  relay {relay_id}  pid {pids.get(relay_id, '-'):<7}  mesh {ends.mesh}  "
            f"client {ends.client}  streams {', '.join(ends.streams)}"
        )


def show(title: str, problems: list[str]) -> None:
    fail(title)
    for problem in problems[:SHOW_PROBLEMS]:
        print(f"  {problem}", file=sys.stderr)
    if len(problems) > SHOW_PROBLEMS:
        print(f"  ... and {len(problems) - SHOW_PROBLEMS} more", file=sys.stderr)
    sys.stderr.flush()


def run(config_path: Path, config: MeshConfig, count: int, log_dir: Path) -> int:
    job_started = time.monotonic()
    source, reader = pick_relays(config)
    say(f"relay main job: {count} transactions to {STREAM}, config {shown(config_path)}")
    mesh = Mesh(config_path, log_level="warning", log_dir=log_dir, die_with_parent=True)
    try:
        try:
            mesh.start(START_TIMEOUT_S)
        except MeshError as e:
            fail(f"the mesh did not start: {e}")
            if "in use" in str(e):  # taken between the check and the start
                explain_busy_ports(config_path, [])
            return EXIT_MESH
        print_mesh(mesh, time.monotonic() - job_started)

        produced, producer_id = produce(config, source, count)
        rate = len(produced.committed) / produced.elapsed_s if produced.elapsed_s > 0 else 0.0
        say(
            f"produced {count} to {STREAM} via relay {source}: "
            f"{len(produced.committed)} committed, {len(produced.failures)} failed, "
            f"{produced.retries} retries, in {produced.elapsed_s:.2f} s ({rate:,.0f} tx/s)"
        )
        back = read_back(config, reader, producer_id, produced)
        first = str(back.seqs[0]) if back.seqs else "-"
        last = str(back.seqs[-1]) if back.seqs else "-"
        others = f", {back.others} of other producers skipped" if back.others else ""
        moved = f", {back.failovers} fail-overs" if back.failovers else ""
        say(
            f"consumed {len(back.seqs)} from relay {reader} (from earliest) in "
            f"{back.elapsed_s:.2f} s{others}{moved}: first seq {first}, last seq {last}"
        )
    finally:
        codes = mesh.stop()
    say(f"mesh stopped (exit codes {', '.join(f'{r}: {c}' for r, c in codes.items())})")
    elapsed = time.monotonic() - job_started
    if produced.failures:
        show(f"{len(produced.failures)} of {count} transactions did not commit:", produced.failures)
    if back.problems:
        show(f"the read-back does not match ({len(back.problems)} problems):", back.problems)
    if produced.failures or back.problems:
        say(f"FAILED in {elapsed:.1f} s")
        return EXIT_MISMATCH
    say(
        f"OK: all {len(produced.committed)} committed seqs came back once and in order "
        f"in {elapsed:.1f} s"
    )
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config_path: Path = args.config
    try:
        config = load(config_path)
        pick_relays(config)
    except ConfigError as e:
        fail(str(e))
        return EXIT_USAGE
    for warning in config.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    busy = ports_in_use(config)
    if busy:
        explain_busy_ports(config_path, busy)
        return EXIT_MESH

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM too: unwind, so the mesh is stopped

    signal.signal(signal.SIGTERM, interrupt)
    log_dir = Path(tempfile.mkdtemp(prefix="relay-main-job-"))
    code = EXIT_INTERRUPTED
    try:
        code = run(config_path, config, args.count, log_dir)
    except KeyboardInterrupt:
        fail("interrupted; the mesh was stopped")
    finally:
        if code == EXIT_OK:
            with contextlib.suppress(OSError):
                shutil.rmtree(log_dir)
        else:
            print(f"relay logs kept in {log_dir}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
