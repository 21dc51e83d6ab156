"""A relay's hop trace: when each frame came in and went out, for `relay bench --hops`.

A node started with a trace file (`relay run --hop-trace FILE`) stamps every frame it
takes from a peer or a client and every frame it publishes or answers with the system's
monotonic clock in nanoseconds (`time.monotonic_ns`, one clock for every process of the
machine, so a benchmark can line up the relays' stamps with its own), keeps the last
HOP_TRACE_MAX_EVENTS of them in memory, and writes them when it stops. The hot path only
appends a stamp and the frame it already holds: frames are decoded when the file is
written, so tracing moves the times it measures as little as possible.

The file holds one JSON object per line: `ns` (monotonic ns), `dir` (`peer_in`,
`peer_out`, `client_in`, `client_out`), `peer` (the sending relay for `peer_in`, else -1),
`kind` (the message's class name, or `bad` when it does not decode) and, where the message
names sequence numbers, `seqs` (a TxBatch's entries, a ProduceBatchResp's committed results,
a ReadResp's entries) or `points` (a Reports' points).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relay import wire
from relay.core import codec
from relay.core.messages import Reports, TxBatch

HOP_TRACE_MAX_EVENTS = 1_000_000  # events kept (the oldest are dropped): ~100 MB at most
# Decoding limits when the file is written: frames the relay already took, so any size.
_DECODE_MAX_BYTES = 1 << 30

PEER_IN, PEER_OUT, CLIENT_IN, CLIENT_OUT = "peer_in", "peer_out", "client_in", "client_out"


class HopTrace:
    """The stamps of one relay (see the module docstring)."""

    def __init__(self, path: Path, max_events: int = HOP_TRACE_MAX_EVENTS) -> None:
        self.path = path
        self.events: deque[tuple[int, str, int, bytes]] = deque(maxlen=max_events)

    def record(self, direction: str, peer: int, frame: bytes) -> None:
        self.events.append((time.monotonic_ns(), direction, peer, frame))

    def write(self) -> None:
        """Decode every event and write the file (replacing it)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w") as out:
            for line in self._lines():
                out.write(line)
        tmp.replace(self.path)

    def _lines(self) -> Iterator[str]:
        for ns, direction, peer, frame in self.events:
            event: dict[str, Any] = {"ns": ns, "dir": direction, "peer": peer}
            if direction in (PEER_IN, PEER_OUT):
                event.update(_peer_summary(frame))
            else:
                event.update(_client_summary(frame))
            yield json.dumps(event, separators=(",", ":")) + "\n"


def _peer_summary(frame: bytes) -> dict[str, Any]:
    try:
        msg = codec.decode(frame, _DECODE_MAX_BYTES)
    except Exception:
        return {"kind": "bad"}
    summary: dict[str, Any] = {"kind": type(msg).__name__}
    if isinstance(msg, TxBatch):
        summary["seqs"] = [seq for seq, _ in msg.entries]
    elif isinstance(msg, Reports):
        summary["points"] = [point for point, _ in msg.points]
        summary["committed"] = msg.committed_point
    return summary


def _client_summary(frame: bytes) -> dict[str, Any]:
    try:
        msg = wire.decode(frame, _DECODE_MAX_BYTES)
    except Exception:
        return {"kind": "bad"}
    summary: dict[str, Any] = {"kind": type(msg).__name__}
    if isinstance(msg, wire.ProduceBatchResp):
        summary["seqs"] = [seq for _, _, seq, _, _ in msg.results if seq >= 0]
    elif isinstance(msg, wire.ProduceResp) and msg.seq >= 0:
        summary["seqs"] = [msg.seq]
    elif isinstance(msg, wire.ReadResp):
        summary["seqs"] = [entry[0] for entry in msg.entries]
    return summary


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a trace file, in the order they happened."""
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]
