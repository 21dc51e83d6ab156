"""A produce forwarded again to another member (its first target fell silent) is answered
`committed` as the second member says, and otherwise `unknown`: the first member may
have taken it, so `fenced` or `rejected` would tell the client a copy that may commit
never will (docs/protocol.md 5.1, G3)."""

from __future__ import annotations

import pytest

from relay.core import coordinate
from relay.core.config import Limits, Topology
from relay.core.messages import ForwardReply, Outcome, RejectReason, Transaction
from relay.core.shell import ProduceReply
from relay.core.state import PendingForward
from relay.sim.script import Mesh

TX = Transaction(b"p", 1, None, b"v")


def answer_of(retargeted: bool, outcome: Outcome, reason: str = "") -> ProduceReply:
    mesh = Mesh(Topology({0: ("s",), 1: ("s",), 2: ("s",), 3: ("t",)}), Limits())
    for _ in range(50):
        mesh.step_ms()
    core = mesh.running(3)
    core.forwards[77] = PendingForward(
        5, "s", TX, target=1, deadline_ms=10_000, retargeted=retargeted
    )
    seq = 123 if outcome is Outcome.COMMITTED else -1
    coordinate.on_forward_reply(core, ForwardReply(1, 1, 0, 3, 77, outcome, seq, reason, ()))
    (reply,) = core.ready().replies
    assert reply.request_id == 5
    return reply


@pytest.mark.parametrize(
    ("outcome", "reason"),
    [
        (Outcome.FENCED, ""),
        (Outcome.REJECTED, RejectReason.STORE_BACKLOG_FULL.value),
        (Outcome.REJECTED, RejectReason.BUFFER_FULL.value),
        (Outcome.REJECTED, RejectReason.LATE.value),
    ],
)
def test_after_a_retarget_only_committed_is_definite(outcome: Outcome, reason: str) -> None:
    assert answer_of(False, outcome, reason).outcome is outcome
    assert answer_of(True, outcome, reason).outcome is Outcome.UNKNOWN


def test_after_a_retarget_committed_and_a_mismatch_pass_through() -> None:
    reply = answer_of(True, Outcome.COMMITTED)
    assert (reply.outcome, reply.seq) == (Outcome.COMMITTED, 123)
    mismatch = RejectReason.DUPLICATE_MISMATCH.value
    assert answer_of(True, Outcome.REJECTED, mismatch).outcome is Outcome.REJECTED
