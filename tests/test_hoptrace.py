"""A relay's hop trace (relay/hoptrace.py) writes what it stamped, decoded, in order."""

from __future__ import annotations

from pathlib import Path

from relay import wire
from relay.core import codec
from relay.core.messages import Outcome, Reports, Transaction, TxBatch
from relay.hoptrace import CLIENT_IN, CLIENT_OUT, PEER_IN, PEER_OUT, HopTrace, read_trace


def test_events_are_written_decoded_and_in_order(tmp_path: Path) -> None:
    tx = Transaction(b"p", 1, None, b"value")
    batch = codec.encode(TxBatch(0, 1, 100, "s", 1, ((100, tx), (101, tx))))
    reports = codec.encode(Reports(1, 1, 101, "s", 1, ((101, b"d" * 16),), 99, b"d" * 16))
    answer = wire.encode(wire.ProduceResp(7, Outcome.COMMITTED, 101))
    trace = HopTrace(tmp_path / "t" / "relay-0.hops", max_events=4)
    trace.record(CLIENT_IN, -1, b"dropped: the oldest of five")
    trace.record(PEER_OUT, -1, batch)
    trace.record(PEER_IN, 2, reports)
    trace.record(CLIENT_OUT, -1, answer)
    trace.record(PEER_IN, 1, b"\xc1 not a frame")
    trace.write()
    events = read_trace(tmp_path / "t" / "relay-0.hops")
    assert [(e["dir"], e["peer"], e["kind"]) for e in events] == [
        (PEER_OUT, -1, "TxBatch"),
        (PEER_IN, 2, "Reports"),
        (CLIENT_OUT, -1, "ProduceResp"),
        (PEER_IN, 1, "bad"),
    ]
    assert events[0]["seqs"] == [100, 101]
    assert events[1]["points"] == [101] and events[1]["committed"] == 99
    assert events[2]["seqs"] == [101]
    assert [e["ns"] for e in events] == sorted(e["ns"] for e in events)
