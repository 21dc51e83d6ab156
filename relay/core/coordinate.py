"""Coordinating produces, and answering their producers (docs/protocol.md sections 5.1, 5.4
and 5.9's effect on pending produces).

A produce reaching a member is given the next sequence number of the member's hybrid clock,
inserted, and published in the next `TxBatch`; its producer waits until the committed
prefix reaches it. A produce reaching a non-member is forwarded once to a live member that
hears us. Every produce gets exactly one answer (G3): `committed(seq)`, `rejected(reason)`,
`fenced` with relays to try, or `unknown` when the outcome cannot be known in time.
"""

from __future__ import annotations

from relay.core import digest as dg
from relay.core import fencing, memory
from relay.core.fencing import redirect_for
from relay.core.links import is_live
from relay.core.messages import (
    Forward,
    ForwardReply,
    Outcome,
    RejectReason,
    Transaction,
    TxBatch,
)
from relay.core.seq import MAX_MS, end_of_ms, ms_of, wall_ms
from relay.core.shell import ProduceReply
from relay.core.state import PendingForward, RelayState, StreamState, Waiter, chunks
from relay.core.transit import hears_us

# A member that has not coordinated a stream for LEAD_IDLE_MS promises, in its Reports, not
# to coordinate it at or below LEAD_MS past its clock (its *lead*, 5.2). The stream's other
# members then need not wait for its floor before they report a transaction another member
# coordinated within LEAD_MS of that Reports: one one-way delay less (section 7). Should it
# coordinate the stream after all, its first sequence number lies past the lead, at most
# LEAD_MS ahead of its clock. A member that coordinated within LEAD_IDLE_MS leads no more:
# two members coordinating in turns would push each other's numbers ahead for nothing.
LEAD_MS = 100
LEAD_IDLE_MS = 1_000


def lead(core: RelayState, st: StreamState, now_ms: int) -> int:
    """The lead to announce on `st` now (-1: none), remembered: it binds us."""
    if st.out_entries or now_ms - st.coordinated_ms < LEAD_IDLE_MS:
        return -1
    ms = min(max(ms_of(core.clock.floor), wall_ms(core.wall_ms)) + LEAD_MS, MAX_MS)
    st.lead = max(st.lead, end_of_ms(ms))
    return st.lead


class FenceMemo:
    """Why each stream was fenced (5.9) at the last produce of a batch (`produce_many`).
    Taking a produce changes none of what fencing reads but our floor, which the clock
    check compares with the majority's clock: the answer holds while the floor stays in
    the same millisecond. (The check sorts the peers' clock offsets: a few microseconds,
    which per transaction were a tenth of a coordinator's time at full load.)"""

    def __init__(self) -> None:
        self._why: dict[str, tuple[int, str]] = {}

    def reason(self, core: RelayState, st: StreamState, now_ms: int) -> str:
        floor_ms = ms_of(core.clock.floor)
        known = self._why.get(st.stream)
        if known is not None and known[0] == floor_ms:
            return known[1]
        why = fencing.reason(core, st, now_ms)
        self._why[st.stream] = (floor_ms, why)
        return why


def accept(
    core: RelayState,
    stream: str,
    tx: Transaction,
    waiter: Waiter,
    now_ms: int,
    fences: FenceMemo | None = None,
) -> None:
    """A produce from a client (or forwarded by a non-member): coordinate or forward.
    `fences`: what the earlier produces of the same batch found about fencing."""
    limits = core.limits
    members = core.topology.members(stream)
    if not members:
        return answer(core, waiter, Outcome.REJECTED, reason=RejectReason.UNKNOWN_STREAM.value)
    if tx.size_bytes() > limits.max_tx_bytes:
        return answer(core, waiter, Outcome.REJECTED, reason=RejectReason.TOO_LARGE.value)
    if core.id not in members:
        return forward(core, stream, tx, waiter, members, now_ms)
    if not core.can_open(stream):
        core.counters["produce_refused_max_streams"] += 1
        return answer(core, waiter, Outcome.REJECTED, reason=RejectReason.TOO_MANY_STREAMS.value)
    st = core.stream(stream)
    st.written = True  # in use: its members ask to be admitted (5.12)
    why = fencing.reason(core, st, now_ms) if fences is None else fences.reason(core, st, now_ms)
    if why:
        core.counters["produce_fenced"] += 1
        core.counters["produce_fenced_" + why] += 1
        return answer(core, waiter, Outcome.FENCED, redirect=redirect_for(core, st))
    tl = st.timeline
    key = (tx.producer_id, tx.producer_seq)
    first = tl.dedupe.first_copy(*key)
    if first is not None:
        if first[1] != dg.tx_hash(tx):  # another transaction under a committed key
            return reject_mismatch(core, [waiter])
        core.counters["produce_dedupe_committed"] += 1
        return answer(core, waiter, Outcome.COMMITTED, seq=first[0])
    pending = st.pending.find(key)
    if pending is not None:
        if pending.tx != tx:  # another transaction under the same producer sequence
            return reject_mismatch(core, [waiter])
        pending.waiters.append(waiter)  # the same one: one answer for both
        return None
    if not memory.make_room(core, st, tx) or len(st.pending) >= limits.max_pending_produces:
        core.counters["produce_buffer_full"] += 1
        return answer(core, waiter, Outcome.REJECTED, reason=RejectReason.BUFFER_FULL.value)
    if st.lead > core.clock.floor:  # we promised not to coordinate at or below it (5.2)
        core.clock.raise_floor(st.lead)
    st.coordinated_ms = now_ms
    seq = core.clock.next_seq(core.wall_ms)
    tl.insert(seq, tx)
    st.out_entries.append((seq, tx))
    st.pending.add(seq, tx, waiter, now_ms + limits.produce_timeout_ms)
    return None


def forward(
    core: RelayState,
    stream: str,
    tx: Transaction,
    waiter: Waiter,
    members: tuple[int, ...],
    now_ms: int,
) -> None:
    if waiter.origin is not None:  # never forward twice
        return answer(core, waiter, Outcome.FENCED, redirect=members)
    forward_id = core.request_id()
    target = _forward_target(core, members, forward_id, now_ms)
    if target < 0:
        return answer(core, waiter, Outcome.FENCED, redirect=members)
    pending = core.forwards[forward_id] = PendingForward(waiter.request_id, stream, tx, target)
    core.forward_deadlines.append((now_ms + core.limits.produce_timeout_ms, forward_id))
    _send_forward(core, forward_id, pending)
    return None


def _forward_target(
    core: RelayState, members: tuple[int, ...], forward_id: int, now_ms: int, avoid: int = -1
) -> int:
    """A live member to forward to, spread by forward id (-1: none). A member we hear but
    that gets nothing from us (a one-way cut, and no relay in between, 5.13) would never
    get it."""
    live = [
        m
        for m in members
        if m != avoid and is_live(core, core.peers[m], now_ms) and hears_us(core, m, now_ms)
    ]
    return live[forward_id % len(live)] if live else -1


def _send_forward(core: RelayState, forward_id: int, pending: PendingForward) -> None:
    core.send(
        Forward(
            sender=core.id,
            incarnation=core.incarnation,
            floor=core.clock.floor,
            target=pending.target,
            stream=pending.stream,
            request_id=forward_id,
            tx=pending.tx,
        )
    )


def retarget_forwards(core: RelayState, now_ms: int) -> None:
    """Forwards whose target fell silent before it answered (it died, or was cut off from
    us) go again, under the same id, to another live member (5.1): else their clients
    would wait for the deadline, and then hear `unknown`. Called when a peer's liveness
    changed (the tick's peer picture). Should the first target answer after all, the
    later answer is unmatched; should both coordinate it, the dedupe window delivers one
    copy (5.6)."""
    for forward_id, pending in core.forwards.items():
        silent = pending.target
        if silent < 0 or is_live(core, core.peers[silent], now_ms):
            continue  # on its way, or nobody was left to ask: its deadline answers it
        members = core.topology.members(pending.stream)
        pending.target = _forward_target(core, members, forward_id, now_ms, avoid=silent)
        if pending.target >= 0:
            core.counters["forward_retargeted"] += 1
            _send_forward(core, forward_id, pending)


def on_forward_reply(core: RelayState, msg: ForwardReply) -> None:
    pending = core.forwards.pop(msg.request_id, None)
    if pending is None:
        core.counters["forward_reply_unmatched"] += 1
        return
    core.outbox.replies.append(
        ProduceReply(pending.request_id, msg.outcome, msg.seq, msg.reason, msg.redirect)
    )


def expire_forwards(core: RelayState, now_ms: int) -> None:
    """Forwards unanswered past their deadline: their clients are told `unknown`."""
    deadlines = core.forward_deadlines
    while deadlines and deadlines[0][0] <= now_ms:
        _, forward_id = deadlines.popleft()
        pending = core.forwards.pop(forward_id, None)
        if pending is not None:
            core.outbox.replies.append(ProduceReply(pending.request_id, Outcome.UNKNOWN))


def answer(
    core: RelayState,
    waiter: Waiter,
    outcome: Outcome,
    *,
    seq: int = -1,
    reason: str = "",
    redirect: tuple[int, ...] = (),
) -> None:
    if waiter.origin is None:
        core.outbox.replies.append(ProduceReply(waiter.request_id, outcome, seq, reason, redirect))
        return
    core.send(
        ForwardReply(
            sender=core.id,
            incarnation=core.incarnation,
            floor=core.clock.floor,
            target=waiter.origin,
            request_id=waiter.request_id,
            outcome=outcome,
            seq=seq,
            reason=reason,
            redirect=redirect,
        )
    )


def answer_all(
    core: RelayState, waiters: list[Waiter], outcome: Outcome, seq: int = -1, reason: str = ""
) -> None:
    for waiter in waiters:
        answer(core, waiter, outcome, seq=seq, reason=reason)


def answer_copy(core: RelayState, waiters: list[Waiter], first: int, same: bool) -> None:
    """Answer produces whose (producer id, producer seq) is taken by the transaction at
    `first`: committed there if they are that transaction (a retry), else rejected: a
    producer sequence names one transaction (5.6)."""
    if same:
        answer_all(core, waiters, Outcome.COMMITTED, first)
    else:
        reject_mismatch(core, waiters)


def reject_mismatch(core: RelayState, waiters: list[Waiter]) -> None:
    core.counters["produce_rejected_duplicate_mismatch"] += len(waiters)
    answer_all(core, waiters, Outcome.REJECTED, -1, RejectReason.DUPLICATE_MISMATCH.value)


def resolve_excluded(
    core: RelayState, st: StreamState, point: int, prefix_seen: bool = True
) -> None:
    """Own transactions at or below a newly committed point that we did not deliver.
    If we saw the committed prefix, the transaction is definitely out (rejected), unless
    another copy of it committed. After a rebase we did not see the skipped range, so
    all we can honestly say is unknown."""
    while True:
        seq = st.pending.oldest()
        if seq is None or seq > point:
            break
        pending = st.pending.take(seq)
        assert pending is not None
        first = st.timeline.dedupe.first_copy(*pending.key)
        if first is not None:
            answer_copy(core, pending.waiters, first[0], first[1] == dg.tx_hash(pending.tx))
        elif prefix_seen:
            core.counters["produce_rejected_late"] += 1
            answer_all(core, pending.waiters, Outcome.REJECTED, -1, RejectReason.LATE.value)
        else:
            core.counters["produce_unknown"] += 1
            answer_all(core, pending.waiters, Outcome.UNKNOWN)


def expire_pending(core: RelayState, st: StreamState, now_ms: int) -> None:
    """Produces past their deadline are answered `unknown` (5.4)."""
    for seq in st.pending.expired(now_ms):
        pending = st.pending.take(seq)
        if pending is not None:
            core.counters["produce_unknown"] += 1
            answer_all(core, pending.waiters, Outcome.UNKNOWN)


def abandon_pending(core: RelayState, st: StreamState) -> None:
    """Fenced: what we coordinate cannot commit while we stay cut off, so tell its
    producers `unknown` now (they retry elsewhere with the same producer sequence;
    dedupe keeps one copy if ours commits after all) instead of at its deadline."""
    for seq in list(st.pending.by_seq):
        pending = st.pending.take(seq)
        assert pending is not None
        core.counters["produce_unknown_fenced"] += 1
        answer_all(core, pending.waiters, Outcome.UNKNOWN)


def publish_batches(core: RelayState, st: StreamState) -> None:
    """Publish what we coordinated since the last call, in frames within the batch bounds."""
    if not st.out_entries:
        return
    for chunk in chunks(st.out_entries, core.limits):
        st.mark_run_end(chunk[-1][0])
        st.link_seq_out += 1
        core.send(
            TxBatch(
                sender=core.id,
                incarnation=core.incarnation,
                floor=core.clock.floor,
                stream=st.stream,
                link_seq=st.link_seq_out,
                entries=tuple(chunk),
            ),
            stream=st.stream,
        )
    st.out_entries = []
