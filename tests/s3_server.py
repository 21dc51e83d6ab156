"""A local S3-compatible server for the store's object-store tests: moto's server mode (from
PyPI, `moto[server]`) as a process of its own on 127.0.0.1, and a fresh bucket per test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from waiting import wait_until

START_TIMEOUT_S = 60
# moto accepts any credentials; these stand in for a real store's (pyarrow, delta-rs and
# boto3 all read them from the environment, and the relays and Spark's workers inherit
# them). tests/conftest.py sets them for the whole session: the session's Spark workers
# start with the environment of the moment the session starts, which may be before any
# object-store test runs. (Without credentials the AWS SDK sends unsigned, chunk-framed
# uploads, which moto stores framing and all.)
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "relay-tests",
    "AWS_SECRET_ACCESS_KEY": "relay-tests-secret",
    "AWS_REGION": "us-east-1",
    # No instance-metadata lookups for credentials or region (they time out off AWS).
    "AWS_EC2_METADATA_DISABLED": "true",
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=5):
            return True
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def moto_server(log_dir: Path) -> Iterator[str]:
    """moto's S3 server on a free port; its endpoint URL."""
    assert all(os.environ.get(k) == v for k, v in CREDENTIALS.items()), "see CREDENTIALS"
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = log_dir / "moto.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(
            lambda: process.poll() is not None or _answers(endpoint),
            "the moto S3 server answering",
            timeout_s=START_TIMEOUT_S,
        )
        assert process.poll() is None, log.read_text(errors="replace")
        yield endpoint
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def new_bucket(endpoint: str) -> str:
    """A fresh, empty bucket on the server; its name."""
    import boto3  # type: ignore[import-untyped]

    name = f"relay-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def bucket_keys(endpoint: str, bucket: str) -> list[str]:
    """Every key in the bucket, sorted."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys.extend(item["Key"] for item in page.get("Contents", []))
    return sorted(keys)
