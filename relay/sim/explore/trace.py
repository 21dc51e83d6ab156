"""Describing what the explorer found: a path of actions replayed step by step in words,
and shortened (greedily) while it still shows a violation."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from relay.core import codec
from relay.core.messages import (
    Forward,
    ForwardReply,
    Heartbeat,
    JoinReply,
    JoinRequest,
    Relayed,
    RepairReply,
    RepairRequest,
    Reports,
    Transaction,
    TxBatch,
    ViewDecided,
    ViewReply,
    ViewRequest,
)
from relay.core.seq import MAX_RELAY_ID, counter_of, ms_of, relay_of, wall_ms
from relay.sim.explore.actions import apply, enabled
from relay.sim.explore.checks import check_world
from relay.sim.explore.model import (
    LINKS,
    RELAYS,
    STREAM,
    TXS,
    Action,
    Bounds,
    Context,
    CoreInfo,
    World,
)
from relay.sim.invariants import describe

SHRINK_BUDGET_S = 30.0  # how long shortening a violation's trace may take
SHRINK_RUNS = (16, 8, 4, 2, 1)  # lengths of the runs of actions tried for removal


def show_tx(tx: Transaction) -> str:
    return f"{describe(tx)}:{tx.value!r}"


class Fmt:
    def __init__(self, start_ms: int) -> None:
        self.ms0 = wall_ms(start_ms)

    def seq(self, seq: int) -> str:
        if seq <= 0:
            return str(seq)
        ms = ms_of(seq) - self.ms0
        r = relay_of(seq)
        if r == MAX_RELAY_ID:
            return f"t{ms:+d}.end"
        return f"t{ms:+d}.r{r}.{counter_of(seq)}"

    def frame(self, frame: bytes) -> str:
        try:
            m = codec.decode(frame, 1 << 30)
        except Exception as e:  # pragma: no cover - only for a broken frame
            return f"<undecodable: {e}>"
        name = type(m).__name__
        if isinstance(m, TxBatch):
            body = (
                f"#{m.link_seq} [{', '.join(self.seq(s) + '=' + show_tx(t) for s, t in m.entries)}]"
            )
        elif isinstance(m, Reports):
            pts = ", ".join(f"{self.seq(p)}:{d.hex()[:6]}" for p, d in m.points)
            body = f"#{m.link_seq} [{pts}] committed={self.seq(m.committed_point)}"
        elif isinstance(m, Heartbeat):
            body = " ".join(
                f"last_link={s.last_link_seq} committed={self.seq(s.committed_point)}"
                for s in m.streams
            )
        elif isinstance(m, RepairRequest):
            body = f"req={m.request_id} ({self.seq(m.lo)}, {self.seq(m.hi)}] origin={m.origin}"
        elif isinstance(m, RepairReply):
            ents = ", ".join(self.seq(s) for s, _ in m.entries)
            body = (
                f"req={m.request_id} {m.status.value} ({self.seq(m.lo)}, {self.seq(m.hi)}] "
                f"more={m.more} [{ents}]"
            )
        elif isinstance(m, JoinRequest | JoinReply):
            body = f"{m.stream} under {m.config}/{m.members}"
        elif isinstance(m, ViewRequest | ViewReply):
            value = m.value if isinstance(m, ViewRequest) else m.accepted
            verdict = "" if isinstance(m, ViewRequest) else (" ok" if m.ok else " refused")
            body = (
                f"{m.phase.value}{verdict} view={m.view} ballot={m.ballot} "
                f"under {m.config}/{m.members}"
                + (f" value of {value.config}/{value.members}" if value is not None else "")
            )
        elif isinstance(m, ViewDecided):
            body = f"view={m.value.number} of {m.value.config}/{m.value.members}"
        elif isinstance(m, Forward):
            body = f"req={m.request_id} {show_tx(m.tx)} to {m.target}"
        elif isinstance(m, Relayed):
            body = f"to {m.to}: [{self.frame(m.frame)}]"
        elif isinstance(m, ForwardReply):
            body = f"req={m.request_id} {m.outcome.value}({self.seq(m.seq)}) to {m.target}"
        else:
            body = ""
        return f"{name}{body and ' ' + body} floor={self.seq(m.floor)}"


def _config_note(r: int, old: CoreInfo, new: CoreInfo) -> str:
    """How relay r's hold of the stream changed (5.15)."""
    if new.config is None:
        return f"relay {r} left {STREAM!r}"
    how = "opened" if old.config is None else "now holds"
    return f"relay {r} {how} {STREAM!r} under configuration {new.config}"


def describe_trace(ctx: Context, start: World, actions: Sequence[Action], a: Bounds) -> list[str]:
    """Replay `actions` from `start`, describing each step (the replay is deterministic)."""
    fmt = Fmt(start.now[0])
    out: list[str] = []
    w = start
    for act in actions:
        kind = act[0]
        if kind in ("deliver", "drop", "dup"):
            src, dst = LINKS[act[1]]
            text = f"{kind} {src}->{dst}: {fmt.frame(w.links[act[1]][0])}"
        elif kind == "tick":
            text = f"tick relay {act[1]} -> t+{w.now[act[1]] + a.tick_ms - start.now[0]}ms"
            if w.skew[act[1]]:
                text += f" (wall clock {w.skew[act[1]]:+d} ms off)"
        elif kind == "step":
            text = f"wall clock of relay {act[1]} steps {act[2] * a.clock_step_ms:+d} ms"
        elif kind == "reload":
            subs = ctx.reload_configs[act[1]].topology.subscriptions
            text = f"relay {act[1]} reads its new topology file {subs}"
        else:
            text = f"produce tx {act[1]} ({show_tx(TXS[act[1]])}) at relay {act[2]}"
        before = w
        try:
            w, _ = apply(ctx, w, act, a)
        except Exception as e:
            out.append(f"{text}  => raised {type(e).__name__}: {e}")
            break
        notes = []
        for k, (old, new) in enumerate(zip(before.replies, w.replies, strict=True)):
            for outcome, seq in new[len(old) :]:
                notes.append(f"tx {k} told {outcome}({fmt.seq(seq)})")
        for r in RELAYS:
            o, n = before.cores[r].info, w.cores[r].info
            if n.config != o.config:
                notes.append(_config_note(r, o, n))
            if n.config is None or o.config is None:
                continue
            if n.committed_point != o.committed_point:
                notes.append(f"relay {r} committed through {fmt.seq(n.committed_point)}")
            if n.fenced != o.fenced:
                notes.append(f"relay {r} {'fenced' if n.fenced else 'unfenced'}")
        if kind == "produce":
            prod = w.produced[act[1]]
            if prod is not None and prod[1] >= 0:
                notes.append(f"seq {fmt.seq(prod[1])}")
        out.append(text + (f"  => {'; '.join(notes)}" if notes else ""))
    return out


def replay(
    ctx: Context, start: World, actions: Sequence[Action], a: Bounds, n_tx: int
) -> list[str] | None:
    """The problems of the first failing step of `actions`, [] if none fails, None if some
    action is not enabled when its turn comes."""
    w = start
    for act in actions:
        if act not in enabled(w, n_tx, a):
            return None
        try:
            w, problems = apply(ctx, w, act, a)
        except Exception as e:
            return [f"a core raised {type(e).__name__}: {e}"]
        problems += check_world(w, ctx.prefix_of, ctx.established)
        if problems:
            return problems
    return []


def shrink(
    ctx: Context,
    start: World,
    actions: list[Action],
    a: Bounds,
    n_tx: int,
    message: str,
    budget_s: float = SHRINK_BUDGET_S,
) -> tuple[list[Action], str]:
    """Greedily drop runs of actions (16, 8, ..., 1 long) while some violation remains."""
    deadline = time.monotonic() + budget_s
    for size in SHRINK_RUNS:
        i = 0
        while i < len(actions) and time.monotonic() < deadline:
            candidate = actions[:i] + actions[i + size :]
            problems = replay(ctx, start, candidate, a, n_tx)
            if problems:
                actions, message = candidate, "; ".join(dict.fromkeys(problems))
            else:
                i += size
    return actions, message


def trace_actions(trace: tuple[Any, ...] | None) -> list[Action]:
    acts: list[Action] = []
    while trace is not None:
        acts.append(trace[0])
        trace = trace[1]
    acts.reverse()
    return acts
