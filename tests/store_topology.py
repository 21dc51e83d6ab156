"""The topology the store's command tests run from: one relay serving `s.*`, spooling on,
its data directory (spools, store) in `<tmp_path>/data`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
