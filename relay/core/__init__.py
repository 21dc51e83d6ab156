"""The protocol core: pure, deterministic, no I/O (docs/protocol.md is its spec).

This is the surface a shell uses: `RelayCore` and the contract of relay/core/shell.py, the
configuration, and the values that cross it. Everything else in relay/core is the rules'
own business (one module per spec section):

    machine.py     RelayCore: inputs, queries, validation, dispatch
    shell.py       the shell contract: Ready, inputs and outputs, routing, the drain loop
    state.py       section 4: what a relay remembers; the table of outstanding requests
    coordinate.py  5.1 coordinating produces and answering producers
    links.py       5.2 receiving, floors, gaps, watermark, suspicion sync
    commit.py      5.3-5.4 reporting, votes, acks, commits, delivery
    repair.py      5.5 advancing, repair, rebase; serving repair requests
    reset.py       5.7 dead points and reset
    join.py        5.8 joining, restarts, inheritance, seeds
    fencing.py     5.9 fencing and redirects
    heartbeat.py   5.11 heartbeats
    membership.py  5.15 configurations: whose votes a stream counts, whatever the files say
    quorum.py      quorum size and the vote tally (5.4, 5.7)
    timeline.py    one stream's buffer and digest chain; the dedupe window (5.6)
    config.py      topology and every bound (5.10); memory.py: what buffers cost
    seq.py, digest.py: section 2
    messages.py    section 3; codec.py and fields.py: the wire format and its validation

Other layers also use three library modules directly: seq.py (the sequence number
layout), digest.py (the chain the store checks again) and fields.py (the field validators
the client protocol shares).
"""

from relay.core.config import CoreConfig, Limits, Topology
from relay.core.machine import RelayCore, configuration_status
from relay.core.messages import Outcome, ReadStatus, RejectReason, Transaction
from relay.core.quorum import quorum
from relay.core.seq import EPOCH_MS
from relay.core.shell import (
    FED_TICK_MS,
    Delivery,
    Outgoing,
    ProduceReply,
    ProduceRequest,
    ReadResult,
    Ready,
    Sink,
    drain,
    recipients,
)
from relay.core.timeline import CommittedRecord

__all__ = [
    "EPOCH_MS",
    "FED_TICK_MS",
    "CommittedRecord",
    "CoreConfig",
    "Delivery",
    "Limits",
    "Outcome",
    "Outgoing",
    "ProduceReply",
    "ProduceRequest",
    "ReadResult",
    "ReadStatus",
    "Ready",
    "RejectReason",
    "RelayCore",
    "Sink",
    "Topology",
    "Transaction",
    "configuration_status",
    "drain",
    "quorum",
    "recipients",
]
