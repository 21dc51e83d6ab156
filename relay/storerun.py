"""`relay store run`: keeps a store up to date and in shape without anyone running jobs by
hand (docs/store.md 7). On the schedule of the topology's `store:` section it

- ingests the relays' spools every `ingest_interval_s`,
- snapshots every stream with new records every `snapshot_interval_s`, then keeps the
  newest `keep_snapshots` of each and, with `keep_deltas_s` set, retires the records older
  than that which a snapshot covers (relay.store.maintain.retire),
- compacts small record files every `compact_interval_s`,
- vacuums files no recent version needs every `vacuum_interval_s`.

Each job holds the store's writer lock (waiting up to `lock_wait_s` for another job's),
logs one line with its figures, and leaves them in `<store>/_runner.json` with where every
stream stands, which `relay status` shows. A job that fails is logged and counted, and the
runner goes on (an ingest stopped by a chain problem keeps failing, named, until the
relays' copies are repaired). The Spark session (or the pyarrow baseline, `--engine
baseline`) is made once and serves every job.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from relay.core.seq import compose, wall_ms
from relay.store.errors import IngestFailed, StoreError, StoreLocked
from relay.store.location import StoreArg, StoreLocation, as_location
from relay.topology import StoreSettings

log = logging.getLogger("relay.store")

STATUS_FILE = "_runner.json"
JOBS = ("ingest", "snapshot", "compact", "vacuum")


class Engine(Protocol):
    """What runs the store's Spark jobs: a Spark session, or the pyarrow baseline
    (`relay.tools.store_baseline.BaselineEngine`)."""

    name: str

    def ingest(self, spool_root: str, store: StoreLocation, lock_wait_s: float) -> Any: ...

    def snapshot(self, store: StoreLocation, lock_wait_s: float) -> Any: ...

    def close(self) -> None: ...


class SparkEngine:
    name = "spark"

    def __init__(self, spark: Any) -> None:
        self.spark = spark

    def ingest(self, spool_root: str, store: StoreLocation, lock_wait_s: float) -> Any:
        from relay.store.ingest import ingest

        return ingest(self.spark, spool_root, store, lock_wait_s=lock_wait_s)

    def snapshot(self, store: StoreLocation, lock_wait_s: float) -> Any:
        from relay.store.snapshot import snapshot

        return snapshot(self.spark, store, lock_wait_s=lock_wait_s)

    def close(self) -> None:
        self.spark.stop()


@dataclass(slots=True)
class JobFigures:
    """One run of one job, as logged and left in the status file."""

    job: str
    started_ms: int  # Unix
    duration_ms: int = 0
    ok: bool = True
    error: str = ""
    figures: dict[str, Any] = field(default_factory=dict)


class StoreRunner:
    """Runs the store's jobs on `settings`' schedule; `step` runs what is due once (time
    comes in, for tests), `run` loops until `stop` is set."""

    def __init__(
        self,
        settings: StoreSettings,
        spool_root: Path,
        store: StoreArg,
        engine: Engine,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.spool_root = spool_root
        self.store = as_location(store)
        self.engine = engine
        self.clock = clock
        self.started_ms = int(clock() * 1000)
        self.intervals_s = {
            "ingest": settings.ingest_interval_s,
            "snapshot": settings.snapshot_interval_s,
            "compact": settings.compact_interval_s,
            "vacuum": settings.vacuum_interval_s,
        }
        self.next_due_s = dict.fromkeys(JOBS, 0.0)  # all due at start
        self.last: dict[str, JobFigures] = {}
        self.runs: dict[str, int] = dict.fromkeys(JOBS, 0)
        self.failures: dict[str, int] = dict.fromkeys(JOBS, 0)

    def step(self) -> list[JobFigures]:
        """Run every job that is due, in order (ingest first, so that a snapshot sees what
        it stored); what each did."""
        now_s = self.clock()
        done = []
        for job in JOBS:
            if now_s >= self.next_due_s[job]:
                self.next_due_s[job] = now_s + self.intervals_s[job]
                done.append(self._run(job))
        if done:
            self._write_status()
        return done

    def seconds_to_next(self) -> float:
        return max(0.0, min(self.next_due_s.values()) - self.clock())

    def run(self, stop: threading.Event) -> None:
        log.info(
            "store runner: %s engine, store %s, spools %s, schedule %s",
            self.engine.name,
            self.store,
            self.spool_root,
            asdict(self.settings),
        )
        while not stop.is_set():
            self.step()
            stop.wait(self.seconds_to_next())

    def _run(self, job: str) -> JobFigures:
        started = self.clock()
        figures = JobFigures(job, int(started * 1000))
        try:
            figures.figures = getattr(self, f"_{job}")()
        except StoreLocked as error:
            figures.ok, figures.error = False, str(error)
            log.warning("store runner: %s skipped this time: %s", job, error)
        except IngestFailed as error:
            figures.ok, figures.error = False, str(error)
            log.error("store runner: %s stopped at a chain problem: %s", job, error)
        except (StoreError, OSError) as error:
            figures.ok, figures.error = False, f"{type(error).__name__}: {error}"
            log.error("store runner: %s failed: %s", job, figures.error)
        except Exception as error:  # a daemon: log, count and go on
            figures.ok, figures.error = False, f"{type(error).__name__}: {error}"
            log.exception("store runner: %s failed", job)
        figures.duration_ms = int((self.clock() - started) * 1000)
        self.runs[job] += 1
        if not figures.ok:
            self.failures[job] += 1
        elif figures.figures.get("changed", True):
            log.info(
                "store runner: %s in %d ms: %s",
                job,
                figures.duration_ms,
                ", ".join(f"{k}={v}" for k, v in figures.figures.items() if k != "changed"),
            )
        self.last[job] = figures
        return figures

    # --- the jobs -------------------------------------------------------------------------

    def _ingest(self) -> dict[str, Any]:
        result = self.engine.ingest(str(self.spool_root), self.store, self.settings.lock_wait_s)
        return {
            "changed": result.records_added > 0,
            "records_added": result.records_added,
            "segments_read": result.segments_read,
            "copies_checked": result.copies_checked,
            "outvoted": len(result.outvoted),
            "quarantined": len(result.quarantined),
        }

    def _snapshot(self) -> dict[str, Any]:
        made = self.engine.snapshot(self.store, self.settings.lock_wait_s)
        figures: dict[str, Any] = {
            "changed": bool(made),
            "snapshots": len(made),
            "rows": sum(info.rows for info in made.values()),
        }
        figures.update(self._retire())
        figures["changed"] = (
            figures["changed"] or figures["records_retired"] > 0 or figures["snapshots_removed"] > 0
        )
        return figures

    def _retire(self) -> dict[str, Any]:
        """Retention: records older than keep_deltas_s (if set) kept only as snapshots, and
        the snapshots beyond keep_snapshots removed."""
        from relay.store.maintain import retire
        from relay.store.tables import writing

        cut_seq = -1  # no record is old enough
        spread_ms = None
        keep_deltas_s = self.settings.keep_deltas_s
        if keep_deltas_s is not None:
            cut_ms = wall_ms(int(self.clock() * 1000) - keep_deltas_s * 1000)
            cut_seq = compose(cut_ms, 0, 0) - 1  # every seq of an earlier millisecond
            # Snapshots spread over the window, so that the cut finds one as it moves on.
            spread_ms = max(1, keep_deltas_s * 1000 // self.settings.keep_snapshots)
        with writing(self.store, "retire", self.settings.lock_wait_s):
            result = retire(self.store, cut_seq, self.settings.keep_snapshots, spread_ms)
        return {
            "records_retired": result.records_removed,
            "files_retired": result.files_removed,
            "snapshots_removed": result.snapshots_removed,
        }

    def _compact(self) -> dict[str, Any]:
        from relay.store.maintain import compact
        from relay.store.tables import writing

        with writing(self.store, "compact", self.settings.lock_wait_s):
            result = compact(
                self.store, self.settings.compact_below_bytes, self.settings.compact_target_bytes
            )
        return {
            "changed": result.files_before > 0,
            "files_before": result.files_before,
            "files_after": result.files_after,
            "records": result.records,
        }

    def _vacuum(self) -> dict[str, Any]:
        from relay.store.maintain import vacuum
        from relay.store.tables import writing

        with writing(self.store, "vacuum", self.settings.lock_wait_s):
            result = vacuum(self.store, self.settings.vacuum_retention_hours)
        return {"changed": result.files_removed > 0, "files_removed": result.files_removed}

    # --- status ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        from relay.store.tables import load_store

        streams: dict[str, Any] = {}
        try:
            for stream, state in load_store(self.store, digests=False).streams.items():
                streams[stream] = {
                    "last_seq": str(state.last_seq),
                    "records": state.records,
                    "files": len(state.files),
                    "snapshot_seq": str(state.snapshot_seqs[-1]) if state.snapshot_seqs else None,
                    "snapshots": len(state.snapshot_seqs),
                    "retained_after": str(state.retained_after),
                }
        except StoreError as error:
            streams = {"error": str(error)}
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "engine": self.engine.name,
            "started_ms": self.started_ms,
            "updated_ms": int(self.clock() * 1000),
            "schedule": asdict(self.settings),
            "runs": self.runs,
            "failures": self.failures,
            "last": {job: asdict(figures) for job, figures in self.last.items()},
            "streams": streams,
        }

    def _write_status(self) -> None:
        try:
            document = json.dumps(self.status(), indent=1, sort_keys=True).encode()
            self.store.write_bytes(STATUS_FILE, document)
        except (OSError, StoreError) as error:
            log.warning("store runner: cannot write %s: %s", self.store.uri(STATUS_FILE), error)


def read_status(store: StoreArg) -> dict[str, Any] | None:
    """The last status a runner left in `store` (None: none ran there)."""
    try:
        status = json.loads(as_location(store).read_bytes(STATUS_FILE))
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None
