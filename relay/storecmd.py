"""`relay store ingest|snapshot|verify`: the store's Spark jobs, driven from a topology.

The topology names the data directory: relays spool to `<data_dir>/spool`, the store lives
in `<data_dir>/store`. Each command starts a Spark session (`local[*]`, every core, unless
`--master` says otherwise), shows the running stages' task progress on stderr while it runs,
prints one line per stream, and exits 0, or 2 when the store found a problem (relays
disagree, a broken chain), or 1 for any other store error.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from relay.store.errors import IngestFailed, StoreError, VerifyFailed
from relay.topology import MeshConfig

PROGRESS_POLL_S = 0.25  # how often the stage progress is read from Spark
EXIT_PROBLEM = 2  # the store found divergence or a broken chain
EXIT_ERROR = 1


def _watch_stages(spark: Any, done: threading.Event, console: Console) -> None:
    """Show completed/total tasks of Spark's active stages until `done` is set."""
    tracker = spark.sparkContext.statusTracker()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tasks"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        bar = progress.add_task("spark", total=None)
        while not done.wait(PROGRESS_POLL_S):
            infos = [tracker.getStageInfo(i) for i in tracker.getActiveStageIds()]
            infos = [i for i in infos if i is not None]
            if not infos:
                continue
            total = sum(i.numTasks for i in infos)
            completed = sum(i.numCompletedTasks for i in infos)
            names = ", ".join(sorted({str(i.name).split(" at ")[0] for i in infos}))
            progress.update(
                bar, description=f"stage {names}"[:60], total=total, completed=completed
            )


def session_for(config: MeshConfig, master: str | None, app: str) -> Any:
    """A Spark session as the topology's `store.spark` says (`master` overrides its
    master)."""
    from relay.store.spark import get_session

    settings = config.store.spark
    python = settings.executor_python
    return get_session(
        master or settings.master,
        app_name=app,
        extra_config=dict(settings.conf),
        driver_host=settings.driver_host,
        executor_python=None if python is None else str(python),
    )


def _with_session(
    config: MeshConfig, master: str | None, app: str, job: Callable[[Any], int]
) -> int:
    console = Console(stderr=True)
    spark = session_for(config, master, app)
    done = threading.Event()
    watcher = threading.Thread(target=_watch_stages, args=(spark, done, console), daemon=True)
    if console.is_terminal:
        watcher.start()
    try:
        return job(spark)
    except (IngestFailed, VerifyFailed) as error:
        print(f"{app} FAILED: {error}", file=sys.stderr)
        return EXIT_PROBLEM
    except StoreError as error:
        print(f"{app} FAILED: {error}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        done.set()
        if watcher.is_alive():
            watcher.join()
        spark.stop()


def ingest(config: MeshConfig, master: str | None, wait_s: float = 0.0) -> int:
    """`relay store ingest`; `wait_s`: how long to wait for another job's writer lock."""
    from relay.store.ingest import ingest as run_ingest

    def job(spark: Any) -> int:
        result = run_ingest(spark, str(config.spool_dir), config.store_location, lock_wait_s=wait_s)
        print(
            f"ingest: {result.records_added} records from {result.segments_read} segments "
            f"into {config.store_location} ({result.copies_checked} other relays' copies compared "
            "in content)"
        )
        for stream, (seq, digest) in sorted(result.streams.items()):
            version = result.versions.get(stream, -1)
            print(f"  {stream}: last seq {seq} digest {digest.hex()} (table version {version})")
        if result.outvoted:
            relays = sorted({relay for _, relay, _ in result.outvoted})
            print(
                f"  {len(result.outvoted)} relay copies outvoted (relays {relays}); "
                f"segments quarantined: {', '.join(result.quarantined) or 'none'}"
            )
        return 0

    return _with_session(config, master, "relay-store-ingest", job)


def snapshot(
    config: MeshConfig,
    master: str | None,
    stream: str | None,
    as_of: int | None,
    wait_s: float = 0.0,
) -> int:
    from relay.store.snapshot import snapshot as run_snapshot

    def job(spark: Any) -> int:
        if stream is not None:
            from relay.store.reader import StoreReader

            if stream not in StoreReader(config.store_location).streams():
                print(f"snapshot FAILED: the store holds no stream {stream!r}", file=sys.stderr)
                return EXIT_ERROR
        made = run_snapshot(
            spark,
            config.store_location,
            as_of={stream: as_of} if stream is not None and as_of is not None else None,
            lock_wait_s=wait_s,
            streams=None if stream is None else (stream,),
        )
        for name, info in sorted(made.items()):
            print(f"snapshot {name}: seq {info.seq} digest {info.digest} rows {info.rows}")
        if not made:
            print("snapshot: up to date")
        return 0

    return _with_session(config, master, "relay-store-snapshot", job)


def run(config: MeshConfig, engine: Any, *, once: bool = False) -> int:
    """`relay store run`: the store's jobs on the topology's `store:` schedule until SIGINT
    or SIGTERM (the job under way finishes first), or one round with `once`. Exit 0, or 1
    when a round of `once` had a failed job."""
    import signal

    from relay.storerun import StoreRunner

    runner = StoreRunner(config.store, config.spool_dir, config.store_location, engine)
    stop = threading.Event()

    def stopping(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, stopping) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if once:
            return 0 if all(f.ok for f in runner.step()) else EXIT_ERROR
        runner.run(stop)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.close()


def verify(config: MeshConfig, master: str | None) -> int:
    from relay.store.verify import verify as run_verify

    def job(spark: Any) -> int:
        verified = run_verify(spark, config.store_location)
        for stream, (seq, digest) in sorted(verified.points.items()):
            count = verified.records[stream]
            print(
                f"verified {stream}: chain intact to seq {seq} digest {digest.hex()} "
                f"({count} records)"
            )
        if not verified.points:
            print("verify: the store is empty")
        unchecked = verified.snapshots_unchecked
        print(
            f"verified {verified.snapshots_checked} snapshots: each is the fold of the records "
            "up to its seq"
            + (f" ({unchecked} older than the first kept record not checked)" if unchecked else "")
        )
        return 0

    return _with_session(config, master, "relay-store-verify", job)
