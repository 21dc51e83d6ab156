"""The topology the store's command tests run from: one relay serving `s.*`, spooling on,
its data directory (spools, store) in `<tmp_path>/data`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# One `relay` command of these tests (a JVM on a loaded machine, for the Spark ones).
RELAY_CLI_TIMEOUT_S = 600


def spooling_topology(tmp_path: Path, store: dict[str, Any] | None = None) -> Path:
    """Write it to `<tmp_path>/config/topology.yaml`, with `store` as its `store:`
    section if given; its path."""
    topology = tmp_path / "config" / "topology.yaml"
    topology.parent.mkdir()
    topology.write_text(
        "relays:\n"
        "  - {id: 0, host: 127.0.0.1, mesh_port: 7100, client_port: 7200, streams: [s.*]}\n"
        "data_dir: ../data\n"
        "spool: {enabled: true}\n" + (f"store: {json.dumps(store)}\n" if store is not None else "")
    )
    return topology


def relay_with(topology: Path, *words: str) -> subprocess.CompletedProcess[str]:
    """Run `relay WORDS --config TOPOLOGY` as an operator would (wide output, for the
    tables `relay status` prints); its outcome."""
    return subprocess.run(
        [sys.executable, "-m", "relay", *words, "--config", str(topology)],
        capture_output=True,
        text=True,
        timeout=RELAY_CLI_TIMEOUT_S,
        env={**os.environ, "COLUMNS": "200"},
    )
