"""The main job: a round trip through a real local relay mesh, and through its store.

    .venv/bin/python scripts/main_job.py [--count N] [--config FILE]

1. Starts every relay of the topology (default config/topology.yaml: 3 relays on
   127.0.0.1) as child processes, produces N transactions (default 1000) to stream
   `orders.eu` through the first relay serving it with a pipelined Producer, reads them
   back from another relay with a Consumer from `earliest`, and checks that every
   committed seq came back exactly once, in ascending order, with its key and value.
2. When the topology spools (`spool: enabled`), stops the mesh (the relays write their
   spools), runs `relay store ingest` and `relay store snapshot` (Spark), starts the mesh
   again (empty buffers: the relays carry on from the store's last point), produces N more,
   and reads the stream from `earliest` with a Consumer: the store's history first, then
   the relays, and checks that both batches came back once and in order across the
   handover, after everything stored before.
3. Meanwhile `relay store run` (Spark) runs in the background from the restart on: the
   job waits until it has ingested the second batch too, stops it (SIGTERM), reads the
   stream's Delta table with Polars (through deltalake) and DuckDB (over the table's file
   list) and checks that every committed seq is in it once, then runs `relay store
   verify` (Spark reads the same file list and checks the chain).
Prints a short summary. The mesh is always stopped before the job ends.

Exit codes: 0 on success, 1 if a transaction did not commit or the read-back does not match,
2 for a usage or configuration error, 3 if the mesh could not start (e.g. a port is in use),
4 if a `relay store` command failed, 130 if interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.cli import relays_first
from relay.client import Consumer, Producer
from relay.errors import ClientError, ConfigError
from relay.launcher import Mesh, MeshError, ports_taken
from relay.security import client_curve
from relay.topology import MeshConfig, load

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "config" / "topology.yaml"
STREAM = "orders.eu"
DEFAULT_COUNT = 1000
START_TIMEOUT_S = 20.0  # for every relay to come up
READ_IDLE_S = 0.5  # the consumer's wait for a record before checking whether it is done
READ_TIMEOUT_S = 30.0  # for the whole read-back
STORE_JOB_TIMEOUT_S = 600.0  # one `relay store` command (Spark starts a JVM)
# `relay store run` in the background: ingests every 10 s (config/topology.yaml); how long
# the job waits for it to store the second batch, and polls its status while it waits
STORE_RUN_CATCH_UP_S = 300.0
STORE_RUN_POLL_S = 0.5
SHOW_PROBLEMS = 5  # problems printed of each kind

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_MESH, EXIT_STORE, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


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
    all_seqs: list[int] = field(default_factory=list)  # everything read, in order
    others: int = 0  # records of other producers (not checked)
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    endpoint: str | None = None
    failovers: int = 0
    from_store: int = 0  # records read from the store before the relays took over


def message(i: int) -> tuple[bytes, bytes]:
    """The key and value of the i-th transaction."""
    return f"customer-{i % 97}".encode(), f"order {i:06d}: 1 x widget".encode()


def produce(
    config: MeshConfig, relay_id: int, count: int, first: int = 0
) -> tuple[Produced, bytes]:
    """Messages first..first+count-1; `committed` maps each seq to its message number."""
    out = Produced()
    items = [message(i) for i in range(first, first + count)]
    started = time.monotonic()
    relays = relays_first(config, relay_id, STREAM)
    with Producer(relays=relays, curve=client_curve(config)) as producer:
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
            out.committed[result] = first + i
    return out, producer_id


def read_back(
    config: MeshConfig,
    relay_id: int,
    producer_ids: tuple[bytes, ...],
    produced: Produced,
    *,
    use_store: bool = False,
) -> ReadBack:
    """Read STREAM from `earliest` (with the store when `use_store`) until every seq of
    `produced` came back or READ_TIMEOUT_S passed; check order, uniqueness and content."""
    out = ReadBack()
    want = produced.committed
    seen: dict[int, int] = {}  # seq -> times read
    started = time.monotonic()
    deadline = started + READ_TIMEOUT_S
    last: int | None = None
    consumer = Consumer(
        relays=relays_first(config, relay_id, STREAM),
        curve=client_curve(config),
        timeout_s=READ_IDLE_S,
        store=config.store_location if use_store else False,
    )
    with consumer.subscribe(STREAM, "earliest"):
        while True:
            record = next(consumer, None)
            if record is None:  # READ_IDLE_S without a record
                if len(seen) >= len(want) or time.monotonic() >= deadline:
                    break
                continue
            out.all_seqs.append(record.seq)
            if last is not None and record.seq <= last:
                out.problems.append(f"seq {record.seq} came after seq {last}")
            if record.producer_id not in producer_ids:
                out.others += 1
                last = record.seq
                continue
            seq = record.seq
            out.seqs.append(seq)
            seen[seq] = seen.get(seq, 0) + 1
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
        out.from_store = consumer.stats["stored_records"]
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


def start_mesh(config_path: Path, log_dir: Path) -> Mesh | None:
    mesh = Mesh(config_path, log_level="warning", log_dir=log_dir, die_with_parent=True)
    started = time.monotonic()
    try:
        mesh.start(START_TIMEOUT_S)
    except MeshError as e:
        fail(f"the mesh did not start: {e}")
        if "in use" in str(e):  # taken between the check and the start
            explain_busy_ports(config_path, [])
        return None
    print_mesh(mesh, time.monotonic() - started)
    return mesh


def stop_mesh(mesh: Mesh) -> None:
    codes = mesh.stop()
    say(f"mesh stopped (exit codes {', '.join(f'{r}: {c}' for r, c in codes.items())})")


def report_produced(produced: Produced, count: int, relay_id: int) -> None:
    rate = len(produced.committed) / produced.elapsed_s if produced.elapsed_s > 0 else 0.0
    say(
        f"produced {count} to {STREAM} via relay {relay_id}: "
        f"{len(produced.committed)} committed, {len(produced.failures)} failed, "
        f"{produced.retries} retries, in {produced.elapsed_s:.2f} s ({rate:,.0f} tx/s)"
    )


def report_read(back: ReadBack, relay_id: int) -> None:
    first = str(back.seqs[0]) if back.seqs else "-"
    last = str(back.seqs[-1]) if back.seqs else "-"
    others = f", {back.others} of earlier runs" if back.others else ""
    moved = f", {back.failovers} fail-overs" if back.failovers else ""
    stored = f", {back.from_store} of them from the store" if back.from_store else ""
    say(
        f"consumed {len(back.seqs) + back.others} from earliest (relay {relay_id} first) in "
        f"{back.elapsed_s:.2f} s{stored}{others}{moved}: ours {len(back.seqs)}, "
        f"first seq {first}, last seq {last}"
    )


def store_command(config_path: Path, *words: str) -> bool:
    """Run `relay store <words> --config FILE` as a user would; show its output."""
    command = [sys.executable, "-m", "relay", "store", *words, "--config", str(config_path)]
    say(f"$ relay store {' '.join(words)} --config {shown(config_path)}")
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=STORE_JOB_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        fail(f"relay store {words[0]} did not finish in {STORE_JOB_TIMEOUT_S:g} s")
        return False
    for line in done.stdout.splitlines():
        say(f"  {line}")
    if done.returncode != 0:
        fail(f"relay store {words[0]} exited {done.returncode}:")
        print(done.stderr[-4000:], file=sys.stderr, flush=True)
        return False
    return True


def start_store_run(config_path: Path, log_dir: Path) -> subprocess.Popen[bytes]:
    """`relay store run` in the background, as an operator runs it beside the mesh."""
    command = [sys.executable, "-m", "relay", "store", "run", "--config", str(config_path)]
    say(f"$ relay store run --config {shown(config_path)} &  (log: {log_dir / 'store-run.log'})")
    with open(log_dir / "store-run.log", "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def stop_store_run(runner: subprocess.Popen[bytes]) -> None:
    if runner.poll() is None:
        runner.send_signal(signal.SIGTERM)
        try:
            runner.wait(timeout=STORE_JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            runner.kill()
            runner.wait()


def catch_up(config: MeshConfig, runner: subprocess.Popen[bytes], produced: Produced) -> list[str]:
    """Wait until the runner's status shows the stream stored up to the last committed seq;
    the problems if it does not get there."""
    from relay.storerun import read_status

    last = max(produced.committed)
    started = time.monotonic()
    deadline = started + STORE_RUN_CATCH_UP_S
    while time.monotonic() < deadline:
        if runner.poll() is not None:
            return [f"relay store run exited {runner.returncode} (see store-run.log)"]
        status = read_status(config.store_location) or {}
        stream = (status.get("streams") or {}).get(STREAM) or {}
        if int(stream.get("last_seq", -1)) >= last:
            say(
                f"relay store run stored through seq {last} {time.monotonic() - started:.1f} s "
                f"after the second batch was read (jobs run: {status.get('runs')})"
            )
            return []
        time.sleep(STORE_RUN_POLL_S)
    return [f"seq {last} not stored within {STORE_RUN_CATCH_UP_S:g} s"]


def read_tables(config: MeshConfig, produced: Produced) -> list[str]:
    """Read the stream's Delta table with Polars (deltalake), and DuckDB and Spark (its
    file list): the problems if a committed seq is missing or stored twice, or if the
    three disagree."""
    import duckdb
    import polars as pl
    from deltalake import DeltaTable

    from relay.store.spark import get_session
    from relay.store.tables import records_table

    location = config.store_location
    path = location.local_root / records_table(STREAM)
    table = DeltaTable(str(path))
    seqs = pl.read_delta(str(path)).get_column("seq").to_list()
    uris = table.file_uris()
    query = f"select count(*), count(distinct seq), max(seq) from read_parquet({uris!r})"
    rows, distinct, last = duckdb.execute(query).fetchall()[0]
    spark = get_session("local[1]", app_name="relay-main-job-read")
    try:
        counted = (
            spark.read.parquet(*uris)
            .selectExpr("count(*) AS n", "count(distinct seq) AS d", "max(seq) AS m")
            .first()
        )
    finally:
        spark.stop()
    say(
        f"Delta table {shown(path)}: version {table.version()}, {len(uris)} files; Polars read "
        f"{len(seqs)} records to seq {max(seqs)}, DuckDB {rows} ({distinct} distinct seqs) "
        f"to seq {last}, Spark {counted['n']} ({counted['d']} distinct) to seq {counted['m']}"
    )
    found: list[str] = []
    if len(seqs) != len(set(seqs)) or rows != distinct or rows != len(seqs):
        found.append("a seq is stored more than once")
    if (counted["n"], counted["d"], counted["m"]) != (rows, distinct, last):
        found.append(f"Spark read {tuple(counted)}, DuckDB {(rows, distinct, last)}")
    missing = set(produced.committed) - set(seqs)
    if missing:
        found.append(f"{len(missing)} committed seqs are not in the table, e.g. {min(missing)}")
    return found


def consume_command(config_path: Path, expected: list[int]) -> list[str]:
    """Run `relay consume --from earliest` as a user would; the problems with what it
    printed, given the seqs the in-process read got (`expected`, in order)."""
    words = ["consume", "--stream", STREAM, "--from", "earliest", "--timeout-s", "1"]
    say(f"$ relay {' '.join(words)} --config {shown(config_path)}")
    command = [sys.executable, "-m", "relay", *words, "--config", str(config_path)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=READ_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return [f"relay consume did not finish in {READ_TIMEOUT_S:g} s"]
    if done.returncode != 0:
        return [f"relay consume exited {done.returncode}: {done.stderr[-2000:]}"]
    seqs = [int(json.loads(line)["seq"]) for line in done.stdout.splitlines()]  # strings
    first = seqs[0] if seqs else "-"
    last = seqs[-1] if seqs else "-"
    say(f"  {len(seqs)} lines, first seq {first}, last seq {last}")
    if seqs != expected:
        return [f"relay consume printed {len(seqs)} seqs, the Consumer read {len(expected)}"]
    return []


def run(config_path: Path, config: MeshConfig, count: int, log_dir: Path) -> int:
    job_started = time.monotonic()
    source, reader = pick_relays(config)
    with_store = config.spool.enabled
    say(f"relay main job: {count} transactions to {STREAM}, config {shown(config_path)}")
    problems: list[tuple[str, list[str]]] = []

    # 1. A round trip through the live mesh.
    mesh = start_mesh(config_path, log_dir)
    if mesh is None:
        return EXIT_MESH
    try:
        produced, producer_id = produce(config, source, count)
        report_produced(produced, count, source)
        batches = [produced]
        back = read_back(config, reader, (producer_id,), produced)
        report_read(back, reader)
    finally:
        stop_mesh(mesh)
    problems.append(
        (f"{len(produced.failures)} of {count} transactions did not commit:", produced.failures)
    )
    problems.append(
        (f"the read-back does not match ({len(back.problems)} problems):", back.problems)
    )

    # 2. Through the store: ingest the spools, restart with empty buffers, read it all.
    if with_store and not produced.failures and not back.problems:
        if not (store_command(config_path, "ingest") and store_command(config_path, "snapshot")):
            return EXIT_STORE
        say("restarting the mesh: empty buffers, every relay carries on from the store")
        mesh = start_mesh(config_path, log_dir)
        if mesh is None:
            return EXIT_MESH
        runner = start_store_run(config_path, log_dir)
        try:
            more, more_id = produce(config, source, count, first=count)
            batches.append(more)
            report_produced(more, count, source)
            both = Produced(committed={**produced.committed, **more.committed})
            whole = read_back(config, reader, (producer_id, more_id), both, use_store=True)
            report_read(whole, reader)
            printed = consume_command(config_path, whole.all_seqs)
            problems.append(
                ("`relay store run` did not store everything:", catch_up(config, runner, both))
            )
        finally:
            stop_store_run(runner)
            stop_mesh(mesh)
        problems.append(("the Delta table does not match:", read_tables(config, both)))
        if not store_command(config_path, "verify"):
            return EXIT_STORE
        problems.append(
            (f"{len(more.failures)} of {count} transactions did not commit:", more.failures)
        )
        problems.append(
            (
                f"the read from earliest does not match ({len(whole.problems)} problems):",
                whole.problems,
            )
        )
        if not whole.from_store:
            problems.append(("the read from earliest took nothing from the store", ["-"]))
        problems.append(("`relay consume --from earliest` does not match:", printed))
    elif not with_store:
        say(f"{shown(config_path)} does not spool (spool: enabled): the store part is skipped")

    elapsed = time.monotonic() - job_started
    failed = [(title, found) for title, found in problems if found]
    for title, found in failed:
        show(title, found)
    if failed:
        say(f"FAILED in {elapsed:.1f} s")
        return EXIT_MISMATCH
    total = sum(len(batch.committed) for batch in batches)
    handover = " across the store-to-relay handover" if with_store else ""
    say(f"OK: all {total} committed seqs came back once and in order{handover} in {elapsed:.1f} s")
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
    busy = [words for _, words in ports_taken(config)]  # mesh, client and HTTP ports
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
