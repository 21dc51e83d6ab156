"""Coordinating produces, and answering their producers (docs/protocol.md sections 5.1, 5.4
and 5.9's effect on pending produces).

A produce reaching a member is given the next sequence number of the member's hybrid clock,
inserted, and published in the next `TxBatch`; its producer waits until the committed
prefix reaches it. A produce reaching a non-member is forwarded once to a live member that
hears us. Every produce gets exactly one answer (G3): `committed(seq)`, `rejected(reason)`,
`fenced` with relays to try, or `unknown` when the outcome cannot be known in time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from relay.core import digest as dg
from relay.core import fencing, memory, spooling
from relay.core.fencing import redirect_for
from relay.core.links import is_live
from relay.core.messages import (
    Entry,
    Forward,
    ForwardReply,
    Outcome,
    RejectReason,
    Transaction,
    TxBatch,
)
from relay.core.seq import MAX_MS, end_of_ms, ms_of, wall_ms
from relay.core.shell import ProduceReply
from relay.core.state import (
    PendingForward,
    RelayState,
    StreamState,
    Waiter,
    chunks,
    past_deadline,
)
from relay.core.timeline import Delivered
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
    produces: Sequence[tuple[Transaction, Waiter]],
    now_ms: int,
    fences: FenceMemo,
) -> None:
    """Produces of one stream that arrived together (a client's batch, or one forwarded
    by a non-member), in order: coordinate or forward each. Each is answered exactly as if
    it had come alone; what cannot change between them (the stream's members, whether it
    can open here) is looked at once, and their entries join the timeline, the outgoing
    batch and the pending produces as one run."""
    limits = core.limits
    members = core.members(stream)
    if not members:
        for _, waiter in produces:
            answer(core, waiter, Outcome.REJECTED, reason=RejectReason.UNKNOWN_STREAM.value)
        return
    member = core.id in members
    refused = member and not core.can_open(stream)
    run = _Run(core, stream, now_ms) if member and not refused else None
    for i, (tx, waiter) in enumerate(produces):
        # The first opens the stream and settles the floor and the lead; the others are
        # then usually all plain (see `take_plain`): taken together, exactly as one by one.
        if i == 1 and run is not None and run.take_plain(produces[1:], fences):
            break
        size_bytes = tx.size_bytes()
        if size_bytes > limits.max_tx_bytes:
            answer(core, waiter, Outcome.REJECTED, reason=RejectReason.TOO_LARGE.value)
        elif run is not None:
            run.take(tx, waiter, size_bytes, fences)
        elif not member:
            forward(core, stream, tx, waiter, members, now_ms)
        else:
            core.counters["produce_refused_max_streams"] += 1
            answer(core, waiter, Outcome.REJECTED, reason=RejectReason.TOO_MANY_STREAMS.value)
    if run is not None:
        run.flush()


class _Run:
    """Produces of one stream this relay coordinates, taken in one call (`accept`). Those
    given a sequence number collect here and join the timeline, the outgoing TxBatch and
    the pending produces in one go (`flush`): a list extend each instead of a bisect and
    insert each. The memory bound is checked against room counted at the start, which is
    exactly what `memory.make_room` would find while nothing needs evicting; when an entry
    does not fit it, the run flushes (so the timeline counts all it holds) and
    `make_room` decides, evicting as it would for a produce alone."""

    def __init__(self, core: RelayState, stream: str, now_ms: int) -> None:
        self.core = core
        self.stream = stream
        self.now_ms = now_ms
        self.deadline_ms = now_ms + core.limits.produce_timeout_ms
        self.st: StreamState | None = None  # opened by the first produce not too large
        self.entries: list[Entry] = []
        self.entries_bytes = 0  # their transactions' sizes
        self.room_entries = 0
        self.room_bytes = 0

    def _open(self) -> StreamState:
        core = self.core
        st = self.st = core.stream(self.stream)
        st.written = True  # in use: its members ask to be admitted (5.12)
        self._count_room(st)
        return st

    def _count_room(self, st: StreamState) -> None:
        """The entries and bytes the timeline takes before anything must be evicted."""
        limits = self.core.limits
        tl = st.timeline
        budget = tl.budget
        self.room_entries = limits.buffer_max_entries - len(tl)
        self.room_bytes = min(
            limits.buffer_max_bytes - tl.memory_bytes, budget.max_bytes - budget.used_bytes
        )

    def take(self, tx: Transaction, waiter: Waiter, size_bytes: int, fences: FenceMemo) -> None:
        core = self.core
        st = self.st or self._open()
        why = fences.reason(core, st, self.now_ms)
        if why:
            core.counters["produce_fenced"] += 1
            core.counters["produce_fenced_" + why] += 1
            return answer(core, waiter, Outcome.FENCED, redirect=redirect_for(core, st))
        key = (tx.producer_id, tx.producer_seq)
        first = st.timeline.dedupe.first_copy(key)
        if first is not None:
            if first[1] != dg.tx_hash(tx):  # another transaction under a committed key
                return reject_mismatch(core, [waiter])
            core.counters["produce_dedupe_committed"] += 1
            return answer(core, waiter, Outcome.COMMITTED, seq=first[0])
        pending = st.pending
        known = pending.find(key)
        if known is not None:
            if known.tx != tx:  # another transaction under the same producer sequence
                return reject_mismatch(core, [waiter])
            known.waiters.append(waiter)  # the same one: one answer for both
            return None
        if spooling.short_of_room(core, st):
            # A new transaction (a retry of a known one was answered above): it could not
            # commit while fewer than a quorum can spool it (5.14).
            core.counters["produce_store_backlog_full"] += 1
            reason = RejectReason.STORE_BACKLOG_FULL.value
            return answer(core, waiter, Outcome.REJECTED, reason=reason)
        cost = size_bytes + memory.HELD_ENTRY_OVERHEAD_BYTES
        if self.room_entries > 0 and cost <= self.room_bytes:
            fits = True  # make_room would evict nothing and say yes
        else:
            self.flush()
            fits = memory.make_room(core, st, tx)
            self._count_room(st)
        if not fits or len(pending) >= core.limits.max_pending_produces:
            core.counters["produce_buffer_full"] += 1
            return answer(core, waiter, Outcome.REJECTED, reason=RejectReason.BUFFER_FULL.value)
        self.room_entries -= 1
        self.room_bytes -= cost
        clock = core.clock
        if st.lead > clock.floor:  # we promised not to coordinate at or below it (5.2)
            clock.raise_floor(st.lead)
        st.coordinated_ms = self.now_ms
        seq = clock.next_seq(core.wall_ms)
        self.entries.append((seq, tx))
        self.entries_bytes += size_bytes
        pending.add(seq, key, tx, waiter, self.deadline_ms)
        return None

    def take_plain(self, produces: Sequence[tuple[Transaction, Waiter]], fences: FenceMemo) -> bool:
        """Take all of `produces` at once if each would be taken plainly by `take`: the
        stream is open and not fenced; none is too large, a copy of another, committed or
        pending; they fit the room counted and the pending bound; and their sequence
        numbers are the next counters of the millisecond of our floor, past our lead (so
        the floor stays in that millisecond and the fence memo's answer holds for all).
        Otherwise False, and nothing is taken. A coordinator's per-transaction work, in
        comprehensions instead of a call of `take` each."""
        core, st = self.core, self.st
        if st is None or not produces:
            return False
        limits = core.limits
        count = len(produces)
        pending = st.pending
        if (
            st.lead > core.clock.floor
            or len(pending) + count > limits.max_pending_produces
            or not core.clock.has_next_seqs(core.wall_ms, count)
            or fences.reason(core, st, self.now_ms)
            or spooling.short_of_room(core, st)
        ):
            return False
        txs = [tx for tx, _ in produces]
        sizes = [tx.size_bytes() for tx in txs]
        total_bytes = sum(sizes)
        cost = total_bytes + count * memory.HELD_ENTRY_OVERHEAD_BYTES
        if max(sizes) > limits.max_tx_bytes:
            return False
        keys = [(tx.producer_id, tx.producer_seq) for tx in txs]
        if (
            len(set(keys)) < count
            or not pending.by_key.keys().isdisjoint(keys)
            or not st.timeline.dedupe.first_of.keys().isdisjoint(keys)
        ):
            return False
        if (self.room_entries < count or cost > self.room_bytes) and not self._evict_for(
            st, count, cost
        ):
            return False
        self.room_entries -= count
        self.room_bytes -= cost
        st.coordinated_ms = self.now_ms
        seqs = core.clock.next_seqs(count)
        self.entries.extend(zip(seqs, txs, strict=True))
        self.entries_bytes += total_bytes
        pending.add_many(seqs, keys, txs, [waiter for _, waiter in produces], self.deadline_ms)
        return True

    def _evict_for(self, st: StreamState, count: int, cost: int) -> bool:
        """Make room for `count` entries costing `cost` bytes in all by evicting what
        taking them one by one would: each `take` evicts the oldest committed entries until
        its own fits, so together they evict the shortest oldest prefix after which all
        fit, or everything evictable. (A full buffer is the steady state of a busy stream:
        after each commit eviction brings it back to its bounds, and the next batch would
        otherwise go one by one.) Only while the stream's own bounds are what binds: if this
        stream at its full bound beside the others as they are would not fit the relay's
        bound, `_free` chooses among streams as entries come, and this returns False with
        nothing evicted. Also False when the room cannot be made; then `take` goes on one
        by one from what was evicted here, which it would have evicted too."""
        limits = self.core.limits
        tl = st.timeline
        budget = tl.budget
        if budget.used_bytes - tl.memory_bytes + limits.buffer_max_bytes > budget.max_bytes:
            return False
        self.flush()  # the run's entries so far count, as `take` flushes before make_room
        tl.evict(limits.buffer_max_entries - count, limits.buffer_max_bytes - cost)
        self._count_room(st)
        return self.room_entries >= count and cost <= self.room_bytes

    def flush(self) -> None:
        """Put the collected entries into the timeline and the outgoing batch."""
        entries, st = self.entries, self.st
        if not entries or st is None:
            return
        entries_bytes, self.entries, self.entries_bytes = self.entries_bytes, [], 0
        tl = st.timeline
        if not tl.append_run(entries, entries_bytes):  # not all after everything held:
            for seq, tx in entries:  # one by one
                tl.insert(seq, tx)
        st.out_entries.extend(entries)
        st.out_bytes += entries_bytes


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
    if not core.topology.subscriptions.get(core.id):
        # A relay whose file lists no stream for it is being taken out of the mesh
        # (5.15): the others may have let it go already, so its forwards could go
        # unanswered; the client goes to the stream's relays at once instead.
        return answer(core, waiter, Outcome.FENCED, redirect=members)
    forward_id = core.request_id()
    target = _forward_target(core, members, forward_id, now_ms)
    if target < 0:
        return answer(core, waiter, Outcome.FENCED, redirect=members)
    deadline_ms = now_ms + core.limits.produce_timeout_ms
    pending = PendingForward(waiter.request_id, stream, tx, target, deadline_ms)
    core.forwards[forward_id] = pending
    _send_forward(core, forward_id, pending, now_ms)
    return None


def _forward_target(
    core: RelayState, members: tuple[int, ...], forward_id: int, now_ms: int, avoid: int = -1
) -> int:
    """A live member to forward to, spread by forward id (-1: none). A member we hear but
    that gets nothing from us (a one-way cut, and no relay in between, 5.13) would never
    get it. (Not ourselves: a change of the stream's relays may have added us since the
    forward was first sent, 5.15.)"""
    peers = core.peers
    live = [
        m
        for m in members
        if m not in (avoid, core.id)
        and m in peers  # (a relay let go of is none: RelayCore.forget_relays)
        and is_live(core, peers[m], now_ms)
        and hears_us(core, m, now_ms)
    ]
    return live[forward_id % len(live)] if live else -1


def _send_forward(core: RelayState, forward_id: int, pending: PendingForward, now_ms: int) -> None:
    pending.target_incarnation = core.peers[pending.target].incarnation
    pending.sent_ms = now_ms
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
    us) or restarted (it forgot them) go again, under the same id, to another live member
    (5.1): else their clients would wait for the deadline, and then hear `unknown`.
    Called when a peer's liveness changed (the tick's peer picture). Should the first
    target answer after all, its answer counts as the second's would; should both
    coordinate it, the dedupe window delivers one copy (5.6)."""
    for forward_id, pending in core.forwards.items():
        gone = pending.target
        if gone < 0:
            continue  # nobody was left to ask: its deadline answers it
        peer = core.peers[gone]
        if is_live(core, peer, now_ms) and peer.incarnation == pending.target_incarnation:
            continue  # on its way
        _retarget(core, forward_id, pending, now_ms)


def retry_unanswered_forwards(core: RelayState, now_ms: int) -> None:
    """A forward its target has not answered within the target's suspect timeout goes
    once to another member: a member may be live and say it hears us when our frames do
    not reach it (its incoming links cut while the mesh was quiet, 5.11: it excuses a long
    silence), and would never answer. Forwards are in the order they were first sent."""
    wait_ms = core.limits.suspect_timeout_ms
    for forward_id, pending in core.forwards.items():
        if pending.retargeted or pending.target < 0:
            continue
        if now_ms - pending.sent_ms < wait_ms:
            break  # (and every later one was sent later still)
        core.counters["forward_unanswered"] += 1
        _retarget(core, forward_id, pending, now_ms)


def next_forward_retry_ms(core: RelayState) -> int | None:
    """When `retry_unanswered_forwards` next has something to do (None: nothing)."""
    for pending in core.forwards.values():
        if not pending.retargeted and pending.target >= 0:
            return pending.sent_ms + core.limits.suspect_timeout_ms
    return None


def _retarget(core: RelayState, forward_id: int, pending: PendingForward, now_ms: int) -> None:
    members = core.members(pending.stream)
    pending.target = _forward_target(core, members, forward_id, now_ms, avoid=pending.target)
    if pending.target >= 0:
        pending.retargeted = True
        core.counters["forward_retargeted"] += 1
        _send_forward(core, forward_id, pending, now_ms)


def on_forward_reply(core: RelayState, msg: ForwardReply) -> None:
    pending = core.forwards.pop(msg.request_id, None)
    if pending is None:
        core.counters["forward_reply_unmatched"] += 1
        return
    if (
        pending.retargeted
        and msg.outcome is not Outcome.COMMITTED
        and msg.reason != RejectReason.DUPLICATE_MISMATCH.value
    ):
        # The member that fell silent may have taken the produce, and its copy may still
        # commit: `fenced` or `rejected` from the second member would tell the client a
        # copy that exists never will (G3). Unknown: a retry with the same producer seq
        # is safe, and finds the copy if it committed.
        core.counters["forward_unknown_after_retarget"] += 1
        core.outbox.replies.append(ProduceReply(pending.request_id, Outcome.UNKNOWN))
        return
    core.outbox.replies.append(
        ProduceReply(pending.request_id, msg.outcome, msg.seq, msg.reason, msg.redirect)
    )


def expire_forwards(core: RelayState, now_ms: int) -> None:
    """Forwards unanswered past their deadline: their clients are told `unknown`."""
    for forward_id in past_deadline(core.forwards, now_ms):
        pending = core.forwards.pop(forward_id)
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


def answer_committed(core: RelayState, st: StreamState, newly: list[Delivered]) -> None:
    """The produces we coordinated among newly committed entries: committed at their own
    seq, or at the first copy's (a retry), or rejected (another transaction under their
    producer sequence, 5.6)."""
    pending = st.pending
    if not pending:
        return  # nothing of ours waits (a member that coordinates none of them)
    # Once per transaction a coordinator commits: the answer of a first copy to a local
    # client (nearly all of them) is made here at once.
    replies = core.outbox.replies
    for seq, _, first, same in newly:
        produce = pending.take(seq)
        if produce is None:
            continue
        waiters = produce.waiters
        if first == seq and len(waiters) == 1 and waiters[0].origin is None:
            replies.append(ProduceReply(waiters[0].request_id, Outcome.COMMITTED, seq))
        else:
            answer_copy(core, waiters, first, same)


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
        first = st.timeline.dedupe.first_copy(pending.key)
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
    for seq in past_deadline(st.pending.by_seq, now_ms):
        pending = st.pending.take(seq)
        assert pending is not None  # past_deadline names pending ones only
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
    limits = core.limits
    if len(st.out_entries) <= limits.max_batch_entries and st.out_bytes <= limits.max_batch_bytes:
        frames: Iterable[list[Entry]] = (st.out_entries,)  # one frame: no need to split
    else:
        frames = chunks(st.out_entries, limits)
    for chunk in frames:
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
    st.out_bytes = 0
