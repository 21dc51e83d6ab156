"""The Spark side shared by the jobs: a local session set up as this machine needs, and
the Spark schemas of the store's files.

Under `spark-submit` (`spark-submit relay/__main__.py store ingest --config ...`) the
session is the one spark-submit configured (`getOrCreate`); run directly (`relay store
ingest --config ...`) it is a quiet local session bound to 127.0.0.1 whose workers run
this very Python (so they import pyarrow and relay).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from relay.store.chaincheck import RECORD_SCHEMA
from relay.store.location import StoreLocation

DEFAULT_MASTER = "local[*]"  # embedded: every core of this machine
# Rows per Arrow batch handed to Python tasks (Spark's default is 10 000).
ARROW_BATCH_ROWS = 20_000

# Spark's DDL name of each Arrow type the store's files use.
_SPARK_TYPES = {
    "string": "STRING",
    "int8": "TINYINT",
    "int32": "INT",
    "int64": "BIGINT",
    "binary": "BINARY",
    "bool": "BOOLEAN",
}


def spark_ddl(schema: Any) -> str:
    """A pyarrow schema as a Spark DDL string, so the two are never written twice."""
    return ", ".join(f"{f.name} {_SPARK_TYPES[str(f.type)]}" for f in schema)


RECORD_DDL = spark_ddl(RECORD_SCHEMA)
SUMMARY_DDL = (
    "stream STRING, head_seq BIGINT, head_tx_hash BINARY, head_digest BINARY, "
    "head_relays STRING, last_seq BIGINT, last_digest BINARY, records BIGINT, path STRING, "
    "file_first_seq BIGINT, problem_seq BIGINT, problem STRING, problem_relays STRING, "
    "outvoted STRING, copies_checked BIGINT"
)
CHANGE_DDL = (
    "stream STRING, entity STRING, key BINARY, op TINYINT, value BINARY, seq BIGINT, "
    "change_index INT"
)
SNAPSHOT_DDL = "stream STRING, entity STRING, key BINARY, value BINARY, seq BIGINT"
SNAPSHOT_WRITE_DDL = "stream STRING, path STRING, rows BIGINT"

_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


def under_spark_submit() -> bool:
    # spark-submit starts the Python driver with a gateway to its JVM already running.
    return "PYSPARK_GATEWAY_PORT" in os.environ


def get_session(
    master: str = DEFAULT_MASTER,
    *,
    app_name: str = "relay-store",
    extra_config: dict[str, str] | None = None,
    driver_host: str = "127.0.0.1",
    executor_python: str | None = None,
) -> Any:
    """The SparkSession to run the store's jobs in: `master` (local, or a cluster's
    `spark://...`), the address the executors reach this driver at (`driver_host`), the
    Python the executors run (`executor_python`, as it is on their machines; default this
    one), and more settings (`extra_config`, e.g. an event log for stage timings, or the
    topology's `store.spark.conf`)."""
    from pyspark.sql import SparkSession

    if under_spark_submit():
        session = SparkSession.builder.appName(app_name).getOrCreate()
    else:
        os.environ.setdefault("PYSPARK_PYTHON", executor_python or sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", driver_host)
        log_config = os.path.join(tempfile.gettempdir(), "relay-store-log4j2.properties")
        with open(log_config, "w") as sink:
            sink.write(_LOG4J2)
        java_options = f"-Dlog4j2.configurationFile=file:{log_config}"
        builder = SparkSession.builder
        for name, value in (extra_config or {}).items():
            builder = builder.config(name, value)
        session = (
            builder.master(master)
            .appName(app_name)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.host", driver_host)
            .config("spark.driver.bindAddress", driver_host)
            .config("spark.pyspark.python", executor_python or sys.executable)
            .config("spark.driver.extraJavaOptions", java_options)
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.sql.adaptive.enabled", "true")
            .getOrCreate()
        )
    session.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", str(ARROW_BATCH_ROWS))
    session.sparkContext.setLogLevel("ERROR")
    return session


def parallelism(spark: Any) -> int:
    return max(1, int(spark.sparkContext.defaultParallelism))


# The rows per batch a store file is read in by `read_store_files`.
READ_BATCH_ROWS = 64 * 1024


def read_store_files(spark: Any, location: StoreLocation, paths: list[str], ddl: str) -> Any:
    """The rows of store files (`paths` relative to the store) with the columns of `ddl`, as
    a DataFrame read by Python tasks through the store's pyarrow filesystem, one task per
    file. (Spark's own Parquet reader reaches an object store only through Hadoop's S3
    connector, whose jars pyspark does not ship.)"""
    from relay.store.tables import parquet_file

    names = [part.split()[0] for part in ddl.split(",")]

    def read(batches: Any) -> Any:
        for batch in batches:
            for path in batch.column("path").to_pylist():
                source = parquet_file(location, path)
                yield from source.iter_batches(batch_size=READ_BATCH_ROWS, columns=names)

    tasks = spark.createDataFrame(
        spark.sparkContext.parallelize([(p,) for p in paths], max(1, len(paths))), "path STRING"
    )
    return tasks.mapInArrow(read, ddl)
