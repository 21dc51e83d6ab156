"""The store's jobs on a standalone Spark cluster: a master and a worker started on
127.0.0.1 from the pyspark package (`bin/spark-class ... deploy.master.Master` /
`Worker`), the topology naming the master, the driver's address and the executors' Python
(docs/store.md 4), and a store on an S3-compatible server (moto's, docs/store.md 8), as on
several machines."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("moto")
from relay.store.location import as_location  # noqa: E402
from relay.store.reader import StoreReader  # noqa: E402
from relay.tools.synthetic import generate, write_spools  # noqa: E402
from s3_server import moto_server, new_bucket  # noqa: E402
from store_topology import spooling_topology  # noqa: E402
from waiting import wait_until  # noqa: E402

SPARK_HOME = Path(pyspark.__file__).parent
SPARK_CLASS = SPARK_HOME / "bin" / "spark-class"
JOB_TIMEOUT_S = 600  # one `relay store` command on the cluster (JVMs on a loaded machine)
START_TIMEOUT_S = 180  # the master electing itself, the worker registering


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[str]:
    """moto's S3 server; its credentials are in the environment the cluster starts with."""
    with moto_server(tmp_path) as url:
        yield url


@pytest.fixture
def cluster(endpoint: str, tmp_path: Path) -> Iterator[str]:
    """A standalone master and one worker (2 cores, 1 GiB) on 127.0.0.1; their URL. The
    executors inherit the worker's environment, with the object store's credentials."""
    logs = tmp_path / "spark-logs"
    logs.mkdir()
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_NO_DAEMONIZE": "1",
    }
    port = _free_port()
    url = f"spark://127.0.0.1:{port}"
    commands = {
        "master": [
            "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(_free_port()),
        ],
        "worker": [
            "org.apache.spark.deploy.worker.Worker", url,
            "--host", "127.0.0.1", "--cores", "2", "--memory", "1g",
            "--webui-port", str(_free_port()), "--work-dir", str(tmp_path / "spark-work"),
        ],
    }  # fmt: skip
    processes: list[subprocess.Popen[bytes]] = []

    def log_of(name: str) -> str:
        return (logs / f"{name}.log").read_text(errors="replace")

    try:
        for name, arguments in commands.items():
            with open(logs / f"{name}.log", "wb") as sink:
                processes.append(
                    subprocess.Popen(
                        [str(SPARK_CLASS), *arguments],
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,  # its JVM and the scripts: one group
                    )
                )
            if name == "master":
                wait_until(
                    lambda: "I have been elected leader" in log_of("master"),
                    "the standalone master up",
                    timeout_s=START_TIMEOUT_S,
                )
        wait_until(
            lambda: "Registering worker" in log_of("master"),
            "the worker registered with the master",
            timeout_s=START_TIMEOUT_S,
        )
        yield url
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_the_jobs_run_on_a_standalone_cluster(cluster: str, endpoint: str, tmp_path: Path) -> None:
    spark = {
        "master": cluster,
        "driver_host": "127.0.0.1",
        "executor_python": sys.executable,
        "conf": {"spark.executor.memory": "512m", "spark.cores.max": 2},
    }
    location = f"s3://{new_bucket(endpoint)}/store"
    s3 = {"endpoint_url": endpoint, "allow_http": True}
    topology = spooling_topology(tmp_path, {"spark": spark, "location": location, "s3": s3})
    records = [generate("s.a", 400, seed=1), generate("s.b", 200, seed=2)]
    write_spools(str(tmp_path / "data" / "spool"), records, relays=3, segment_records=100)

    def store_job(*words: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "relay", "store", *words, "--config", str(topology)],
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
        )

    for words in (("ingest",), ("snapshot",), ("verify",)):
        done = store_job(*words)
        assert done.returncode == 0, done.stderr[-3000:]
    assert f"verified s.a: chain intact to seq {records[0].seqs[-1]}" in done.stdout
    reader = StoreReader(as_location(location, s3))
    assert {s: p.seq for s, p in reader.last_points().items()} == {
        r.stream: r.seqs[-1] for r in records
    }
    # The jobs ran as applications of the cluster, their tasks on the worker's executors.
    master_log = (tmp_path / "spark-logs" / "master.log").read_text(errors="replace")
    for app in ("relay-store-ingest", "relay-store-snapshot", "relay-store-verify"):
        assert f"Registering app {app}" in master_log
    assert list((tmp_path / "spark-work").glob("app-*/*/stderr"))
