"""The explorer's transitions: which actions a state enables, what each does to a copy of
the world (through the shared drain loop of relay/core/shell.py), and the start state."""

from __future__ import annotations

from collections import deque

import msgspec

from relay.core import codec
from relay.core.machine import RelayCore
from relay.core.messages import Heartbeat, JoinRequest, Reports, TxBatch
from relay.core.shell import Delivery, Outgoing, ProduceReply, ProduceRequest, drain
from relay.core.state import GENESIS_POINT, Configuration, target_of
from relay.sim.explore.checks import chain_at, check_transition, inspect_core, votes_of
from relay.sim.explore.model import (
    ABSENT,
    LINK_INDEX,
    LINKS,
    RELAYS,
    REQUEST_BASE,
    START_UNIX_MS,
    STREAM,
    TXS,
    Acceptance,
    Action,
    Bounds,
    Context,
    CoreInfo,
    Vote,
    World,
)

PREFIX_MAX_STEPS = 100  # clock steps the start state may take to join and settle


def enabled(w: World, n_tx: int, a: Bounds) -> list[Action]:
    acts: list[Action] = []
    k = sum(1 for x in w.produced if x is not None)
    if k < n_tx and min(w.ticks) >= k * a.produce_gap_ticks:
        acts += [("produce", k, r) for r in RELAYS]
    if a.reloads:
        acts += [
            ("reload", r)
            for r in RELAYS
            if not w.reloaded[r] and w.ticks[r] >= a.reload_after_ticks
        ]
    live = [i for i, q in enumerate(w.links) if q]
    acts += [("deliver", i) for i in live]
    low = min(w.ticks)
    acts += [
        ("tick", r)
        for r in RELAYS
        if w.ticks[r] < a.max_ticks and w.ticks[r] - low < a.max_skew_ticks
    ]
    if w.drops < a.max_drops:
        acts += [("drop", i) for i in live]
    if w.dups < a.max_dups:
        acts += [("dup", i) for i in live]
    if w.steps < a.max_clock_steps:
        acts += [("step", r, sign) for r in RELAYS for sign in (-1, 1)]
    return acts


class _Observer:
    """Where the `Ready` of the core an action touched goes: each frame is checked and
    queued on its links, replies go to the producers' bookkeeping, deliveries to the
    relay's consumer log."""

    def __init__(
        self,
        ctx: Context,
        w: World,
        rid: int,
        core: RelayCore,
        links: list[tuple[bytes, ...]],
        replies: list[tuple[tuple[str, int], ...]],
    ) -> None:
        self.ctx = ctx
        self.rid = rid
        self.links = links
        self.replies = replies
        self.delivered = list(w.delivered)
        self.problems: list[str] = []
        self.last_report = w.last_report[rid]
        self.floor_sent = w.floor_sent[rid]
        self.final_sent = w.final_sent[rid]
        self.rebases = 0
        st = core.streams.get(STREAM)
        self.timeline = st.timeline if st is not None else None  # None: not held (5.15)
        self.configuration = st.configuration if st is not None else None
        self.version = st.config_version if st is not None else None
        self.sent: list[Vote] = []  # its reports, as World.sent_votes keeps them
        self.serving = [c.info.serves for c in w.cores]
        self.reloaded = w.reloaded

    def persist(self, records: list[tuple[str, bytes]]) -> None:
        """The explorer's relays keep no acceptor memory, so none comes."""

    def publish(self, o: Outgoing) -> None:
        p, rid, tl = self.problems, self.rid, self.timeline
        try:
            msg = codec.decode(o.frame, self.ctx.max_frame)
        except Exception as e:
            p.append(f"relay {rid} sent an undecodable frame: {e}")
            return
        if msg.sender != rid:
            p.append(f"relay {rid} sent a frame with sender {msg.sender}")
        target = target_of(msg)
        if isinstance(msg, TxBatch | Reports | JoinRequest):
            if o.stream != msg.stream or o.target is not None:
                p.append(f"relay {rid}: {type(msg).__name__} not routed to the stream")
        elif target is not None:
            if o.target != target or target == rid or o.stream is not None:
                p.append(f"relay {rid}: {type(msg).__name__} routed to {o.target}, not {target}")
        elif o.target is not None or o.stream is not None:
            p.append(f"relay {rid}: {type(msg).__name__} should go to every peer")
        if isinstance(msg, TxBatch):
            for seq, _ in msg.entries:
                if seq <= self.floor_sent:
                    p.append(
                        f"relay {rid} issued {seq} at or below its announced floor "
                        f"{self.floor_sent}"
                    )
        if isinstance(msg, Reports) and msg.stream == STREAM and tl is None:
            p.append(f"relay {rid} sent Reports of a stream it does not hold")
        elif isinstance(msg, Reports) and msg.stream == STREAM and tl is not None:
            if msg.config != self.version:
                # (so each report is made under the configuration it holds after the
                # action: _tag_reports tags it so)
                p.append(
                    f"relay {rid} sent Reports under version {msg.config}, "
                    f"holding version {self.version}"
                )
            for point, d in msg.points:
                if point <= self.last_report:
                    p.append(f"relay {rid} reported {point} after {self.last_report}")
                if point <= self.final_sent:
                    p.append(
                        f"relay {rid} reported {point}, promised none through {self.final_sent}"
                    )
                self.last_report = point
                if self.ctx.across and self.configuration is not None:
                    self.sent.append((point, d, self.configuration))
                if d != chain_at(tl, point):
                    p.append(f"relay {rid} reported at {point} a digest not of its own prefix")
                else:
                    self.ctx.remember_prefix(tl, point, d)
            if (msg.committed_point, msg.committed_digest) != (
                tl.committed_point,
                tl.committed_digest,
            ):
                p.append(f"relay {rid}: Reports announce a commit it does not hold")
        if isinstance(msg, Heartbeat):
            for status in msg.streams:
                self.final_sent = max(self.final_sent, status.votes_final_through)
        if msg.floor < self.floor_sent:
            p.append(
                f"relay {rid}: floor went back from {self.floor_sent} to {msg.floor} on the wire"
            )
        self.floor_sent = max(self.floor_sent, msg.floor)
        for dst in self.ctx.receivers(o, rid, self.serving, self.reloaded):
            i = LINK_INDEX[(rid, dst)]
            self.links[i] = (*self.links[i], o.frame)

    def answer(self, replies: list[ProduceReply]) -> None:
        for reply in replies:
            k = reply.request_id - REQUEST_BASE
            if not 0 <= k < len(TXS):
                unknown = reply.request_id
                self.problems.append(f"relay {self.rid} answered unknown request {unknown}")
                continue
            self.replies[k] = (*self.replies[k], (reply.outcome.value, reply.seq))

    def rebase(self, stream: str, point: int) -> None:
        self.rebases += 1

    def closed(self, stream: str) -> None:
        # (only a stream that holds and promised nothing closes: closing.close asserts it)
        if self.ctx.setup.reader is None:
            self.problems.append(f"relay {self.rid} closed stream {stream!r}")

    def deliver(self, dl: Delivery) -> None:
        rid = self.rid
        if dl.stream != STREAM:
            self.problems.append(f"relay {rid} delivered stream {dl.stream!r}")
            return
        log = self.delivered[rid]
        for seq, _ in dl.entries:
            if log and seq <= log[-1][0]:
                self.problems.append(f"relay {rid} delivered {seq} after {log[-1][0]}")
        self.delivered[rid] = log + tuple(dl.entries)


def _settle(
    ctx: Context,
    w: World,
    rid: int,
    core: RelayCore,
    links: list[tuple[bytes, ...]],
    replies: list[tuple[tuple[str, int], ...]],
) -> tuple[World, list[str]]:
    """Drain the core an action touched, check it, and snapshot it into the next world."""
    seen = _Observer(ctx, w, rid, core, links, replies)
    drain(core, seen)
    p = seen.problems
    info, more = inspect_core(core, rid)
    old = w.cores[rid].info
    info = _tag_reports(old, info._replace(counters=info.counters | old.counters))
    p += more
    p += check_transition(rid, old, info)
    left_votes = w.left_votes
    if old.config is not None and info.config is None and old.reports:
        # It left the stream: its reports stay counted under their configurations.
        left = list(left_votes)
        left[rid] = left[rid] + votes_of(old)
        left_votes = tuple(left)
    sent_votes = w.sent_votes
    if seen.sent:
        sent = list(sent_votes)
        sent[rid] = sent[rid] + tuple(seen.sent)
        sent_votes = tuple(sent)
    forwarded = _forwarded_copies(w, core)
    acceptances = _acceptances(ctx, w, rid, core)
    snap = ctx.freeze(core, info)
    cores = list(w.cores)
    cores[rid] = snap
    lr = list(w.last_report)
    lr[rid] = seen.last_report
    fs = list(w.floor_sent)
    fs[rid] = seen.floor_sent
    fin = list(w.final_sent)
    fin[rid] = seen.final_sent
    return (
        w._replace(
            cores=tuple(cores),
            links=tuple(links),
            replies=tuple(replies),
            delivered=tuple(seen.delivered),
            last_report=tuple(lr),
            floor_sent=tuple(fs),
            final_sent=tuple(fin),
            rebases=w.rebases + seen.rebases,
            forwarded=forwarded,
            left_votes=left_votes,
            sent_votes=sent_votes,
            acceptances=acceptances,
        ),
        p,
    )


def _acceptances(ctx: Context, w: World, rid: int, core: RelayCore) -> tuple[Acceptance, ...]:
    """World.acceptances with what relay `rid` accepted in this step, if anything (an
    acceptor holds only its last acceptance, so each is taken as it is made; one ballot
    of one instance has one value, so an acceptance kept is known by those)."""
    st = core.streams.get(STREAM)
    if not ctx.setup.check_agreement or st is None or st.acceptor.accepted is None:
        return w.acceptances
    acc = st.acceptor
    for a in w.acceptances:
        if (a.number, a.ballot, a.relay) == (acc.number, acc.accepted_ballot, rid):
            return w.acceptances
    value = msgspec.msgpack.encode(acc.accepted)
    made = Acceptance(acc.number, acc.accepted_ballot, value, rid, st.configuration)
    return tuple(sorted((*w.acceptances, made)))


def _tag_reports(old: CoreInfo, new: CoreInfo) -> CoreInfo:
    """`new` with the configuration each report of its log was made under: those its log
    shares with `old`'s keep their tags (a log only grows, or loses a tail of void reports,
    5.12); the ones added since were made under the configuration the relay holds now (a
    core reports in `ready()` only, after the input: _Observer.publish checks that the
    Reports say its version)."""
    if new.config is None:
        return new
    kept = 0
    runs: list[tuple[Configuration, int]] = []
    if old.config is not None:
        n = len(old.reports)
        if new.reports[:n] == old.reports:
            kept = n
        else:
            for before, after in zip(old.reports, new.reports, strict=False):
                if before != after:
                    break
                kept += 1
        left = kept
        for config, count in old.report_configs:
            if left <= 0:
                break
            runs.append((config, min(count, left)))
            left -= count
    added = len(new.reports) - kept
    if added:
        if runs and runs[-1][0] == new.config:
            runs[-1] = (new.config, runs[-1][1] + added)
        else:
            runs.append((new.config, added))
    return new._replace(report_configs=tuple(runs))


def _forwarded_copies(w: World, core: RelayCore) -> tuple[tuple[int, int], ...]:
    """`w.forwarded` with the copies `core` issued for forwarded produces: its pending
    produces that a forwarding relay waits for under one of the forward ids noted at the
    produce (a forward sent again to another member keeps its id)."""
    st = core.streams.get(STREAM)
    if not w.forwards or st is None:
        return w.forwarded
    by_id = {(origin, fid): k for k, origin, fid in w.forwards}
    found = set(w.forwarded)
    for seq, pending in st.pending.by_seq.items():
        for waiter in pending.waiters:
            if waiter.origin is not None:
                k = by_id.get((waiter.origin, waiter.request_id))
                if k is not None:
                    found.add((k, seq))
    return tuple(sorted(found))


def apply(ctx: Context, w: World, act: Action, a: Bounds) -> tuple[World, list[str]]:
    """The successor of `w` by `act`, and the problems found on the way."""
    kind = act[0]
    links = list(w.links)
    replies = list(w.replies)
    if kind == "drop":
        links[act[1]] = links[act[1]][1:]
        return w._replace(links=tuple(links), drops=w.drops + 1), []
    if kind == "dup":
        q = links[act[1]]
        links[act[1]] = (q[0], *q)
        return w._replace(links=tuple(links), dups=w.dups + 1), []
    if kind == "step":
        skew = list(w.skew)
        skew[act[1]] += act[2] * a.clock_step_ms
        return w._replace(skew=tuple(skew), steps=w.steps + 1), []
    if kind == "deliver":
        frame = links[act[1]][0]
        links[act[1]] = links[act[1]][1:]
        rid = LINKS[act[1]][1]
        core = ctx.thaw(w.cores[rid], rid)
        core.receive(frame, w.now[rid] + w.skew[rid], w.now[rid])
        return _settle(ctx, w, rid, core, links, replies)
    if kind == "tick":
        rid = act[1]
        now = list(w.now)
        ticks = list(w.ticks)
        now[rid] += a.tick_ms
        ticks[rid] += 1
        core = ctx.thaw(w.cores[rid], rid)
        core.tick(now[rid] + w.skew[rid], now[rid])
        w = w._replace(now=tuple(now), ticks=tuple(ticks))
        return _settle(ctx, w, rid, core, links, replies)
    if kind == "reload":
        rid = act[1]
        reloaded = list(w.reloaded)
        reloaded[rid] = True
        core = ctx.thaw(w.cores[rid], rid)
        core.reload_topology(ctx.reload_configs[rid])
        w = w._replace(reloaded=tuple(reloaded))
        return _settle(ctx, w, rid, core, links, replies)
    if kind == "produce":
        k, rid = act[1], act[2]
        core = ctx.thaw(w.cores[rid], rid)
        request_id = REQUEST_BASE + k
        request = ProduceRequest(request_id, STREAM, TXS[k])
        core.produce(request, w.now[rid] + w.skew[rid], w.now[rid])
        st = core.streams.get(STREAM)  # None: the relay does not serve it (it forwards)
        copy = -1
        for seq, pending in st.pending.by_seq.items() if st is not None else ():
            if any(x.request_id == request_id and x.origin is None for x in pending.waiters):
                copy = seq
        produced = list(w.produced)
        produced[k] = (rid, copy)
        forwards = tuple(
            (k, rid, fid)
            for fid, fwd in core.forwards.items()
            if fwd.request_id == request_id and fwd.stream == STREAM
        )
        w = w._replace(produced=tuple(produced), forwards=w.forwards + forwards)
        return _settle(ctx, w, rid, core, links, replies)
    raise ValueError(f"unknown action {act!r}")


class _Prefix:
    """The start state's sink: every frame delivered at once, nothing else expected."""

    def __init__(
        self, ctx: Context, rid: int, queue: deque[tuple[int, bytes]], cores: list[RelayCore]
    ) -> None:
        self.ctx = ctx
        self.rid = rid
        self.queue = queue
        self.cores = cores
        self.floor_sent = -1
        self.last_report = -1
        self.final_sent = -1

    def persist(self, records: list[tuple[str, bytes]]) -> None:
        """The explorer's relays keep no acceptor memory, so none comes."""

    def publish(self, o: Outgoing) -> None:
        msg = codec.decode(o.frame, self.ctx.max_frame)
        self.floor_sent = max(self.floor_sent, msg.floor)
        if isinstance(msg, Reports) and msg.points:
            self.last_report = msg.points[-1][0]
        if isinstance(msg, Heartbeat):
            for status in msg.streams:
                self.final_sent = max(self.final_sent, status.votes_final_through)
        serving = [c.serves(STREAM) for c in self.cores]
        for d in self.ctx.receivers(o, self.rid, serving):
            self.queue.append((d, o.frame))

    def answer(self, replies: list[ProduceReply]) -> None:
        raise RuntimeError("the start state's prefix produced a reply")

    def rebase(self, stream: str, point: int) -> None:
        pass  # taking the base at genesis while joining

    def deliver(self, delivery: Delivery) -> None:
        raise RuntimeError("the start state's prefix produced a delivery")

    def closed(self, stream: str) -> None:
        if self.ctx.setup.reader is None:
            raise RuntimeError(f"the start state's prefix closed stream {stream!r}")


def _settled(ctx: Context, cores: list[RelayCore]) -> bool:
    """Whether the start state's prefix is done: with one topology at start ("same",
    "change"), all three joined the stream, are unfenced and committed nothing; with
    topologies that disagree ("stale"), every stream any relay opened at start is joined and
    unfenced, and none has opened the stream (a pattern's: its first use, the join and its
    first view are explored)."""
    reader = ctx.setup.reader
    if reader is not None:
        return all(
            c.joined(STREAM) if r == reader else c.counters["streams_closed_idle"] > 0
            for r, c in enumerate(cores)
        ) and all((STREAM in c.streams) == (r == reader) for r, c in enumerate(cores))
    if not ctx.setup.opened_by_use:
        return all(c.joined(STREAM) and not c.fenced(STREAM) for c in cores) and all(
            c.committed_point(STREAM) == GENESIS_POINT for c in cores
        )
    return all(STREAM not in c.streams for c in cores) and all(
        c.joined(name) and not c.fenced(name) for c in cores for name in c.streams
    )


def initial(ctx: Context, n_tx: int, tick_ms: int) -> World:
    """Tick everyone with immediate delivery until settled (`_settled`) and quiet."""
    now = START_UNIX_MS
    cores = [ctx.core_class(ctx.configs[r], 1, now) for r in RELAYS]
    queue: deque[tuple[int, bytes]] = deque()
    sinks = [_Prefix(ctx, r, queue, cores) for r in RELAYS]
    reader = ctx.setup.reader
    for _ in range(PREFIX_MAX_STEPS):
        if reader is not None:
            cores[reader].read(STREAM, -1, 10)  # (keeps it open there, 5.11)
        for r in RELAYS:
            cores[r].tick(now)
            drain(cores[r], sinks[r])
        while queue:
            d, frame = queue.popleft()
            cores[d].receive(frame, now)
            drain(cores[d], sinks[d])
        if _settled(ctx, cores):
            break
        now += tick_ms
    else:
        raise RuntimeError(f"the relays did not settle within {PREFIX_MAX_STEPS} steps")
    snaps = []
    for r in RELAYS:
        info, problems = inspect_core(cores[r], r)
        if problems:
            raise RuntimeError(f"initial state broken: {problems}")
        snaps.append(ctx.freeze(cores[r], _tag_reports(ABSENT, info)))
    # (what the prefix reported, none of it void: World.sent_votes)
    sent = tuple(votes_of(snap.info) if ctx.across else () for snap in snaps)
    return World(
        cores=tuple(snaps),
        links=tuple(() for _ in LINKS),
        now=(now,) * len(RELAYS),
        ticks=(0,) * len(RELAYS),
        drops=0,
        dups=0,
        produced=(None,) * n_tx,
        replies=((),) * n_tx,
        delivered=((),) * len(RELAYS),
        last_report=tuple(s.last_report for s in sinks),
        floor_sent=tuple(s.floor_sent for s in sinks),
        final_sent=tuple(s.final_sent for s in sinks),
        sent_votes=sent,
    )
