"""The search: from the start state, apply every enabled action (depth first, breadth first,
in a seeded random order, or along random walks), check each new state, and stop at the
bounds. See the package docstring for what is explored and checked."""

from __future__ import annotations

import random
import re
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from relay.core.config import Limits
from relay.core.machine import RelayCore
from relay.sim.explore.actions import apply, enabled, initial
from relay.sim.explore.checks import check_world
from relay.sim.explore.model import (
    EXPLORE_LIMITS,
    SETUPS,
    STREAM,
    TOPOLOGIES,
    TXS,
    Action,
    Bounds,
    Context,
    CoreInfo,
    World,
    world_fingerprint,
)
from relay.sim.explore.trace import Fmt, describe_trace, trace_actions
from relay.sim.explore.trace import shrink as shrink_trace

STRATEGIES = ("dfs", "bfs", "random", "walk")
STALE_WALKS_MAX = 1_000  # "walk" stops once this many walks in a row found nothing new
PROGRESS_EVERY_S = 10


@dataclass
class Violation:
    message: str
    trace: list[str]  # the steps from the start state, described (shrunk if `shrink`)
    found_at_depth: int = 0  # length of the path on which the search found it

    def __str__(self) -> str:
        shrunk = (
            f" (shrunk from {self.found_at_depth} steps)"
            if self.found_at_depth > len(self.trace)
            else ""
        )
        lines = [f"VIOLATION: {self.message}", f"trace{shrunk}:"]
        lines += [f"  {i + 1:3d}. {step}" for i, step in enumerate(self.trace)]
        return "\n".join(lines)


@dataclass
class ExploreResult:
    states_explored: int = 0  # distinct states whose successors were generated
    distinct_states: int = 0  # distinct fingerprints discovered
    transitions: int = 0  # actions applied
    max_depth: int = 0
    bound_hit: bool = False  # some state was left unexplored (see bound_reasons)
    bound_reasons: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    coverage: dict[str, int] = field(default_factory=dict)  # event -> distinct states
    counters: dict[str, int] = field(default_factory=dict)  # core counter -> distinct states
    walks: int = 0  # strategy "walk": random walks run
    seconds: float = 0.0
    params: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        bound = (
            f"yes ({', '.join(self.bound_reasons)})"
            if self.bound_hit
            else "no (exhaustive within the bounds)"
        )
        lines = [
            "explore: 3 relays, stream 's', "
            + ", ".join(f"{k}={v}" for k, v in self.params.items()),
            f"states explored:   {self.states_explored}",
            f"distinct states:   {self.distinct_states}",
            f"transitions:       {self.transitions}",
            f"max depth:         {self.max_depth}",
            *([f"random walks:      {self.walks}"] if self.walks else []),
            f"bound hit:         {bound}",
            f"time:              {self.seconds:.1f} s",
            "coverage (distinct states where it holds):",
        ]
        lines += [f"  {k}: {v}" for k, v in sorted(self.coverage.items())]
        lines.append("core counters seen (distinct states):")
        lines += [f"  {k}: {v}" for k, v in sorted(self.counters.items())]
        for v in self.violations:
            lines.append(str(v))
        return "\n".join(lines)


def _configuration_coverage(w: World, infos: list[CoreInfo], ev: set[str]) -> None:
    """Events of establishing the stream's configuration (5.15), of changing it, and of
    serving it from a relay it leaves out."""
    for r, info in enumerate(infos):
        if info.config is None:
            ev.add(f"relay {r} does not hold {STREAM!r}")
            if not info.serves:
                ev.add(f"relay {r} left {STREAM!r} (its configuration leaves it out)")
        elif info.config[0] == 0:
            ev.add(f"relay {r} holds {STREAM!r} provisionally")
        else:
            ev.add(f"relay {r} holds {STREAM!r} established")
            if info.config[0] > 1:
                ev.add(f"relay {r} holds {STREAM!r} under version {info.config[0]} (changed)")
                if info.committed_point > info.view[1]:
                    # (above its view's start only commits of that version count)
                    ev.add(f"relay {r} committed under version {info.config[0]}")
        if info.change_held:
            ev.add(f"relay {r} holds a change back (a file names other relays)")
    if any(w.reloaded):
        ev.add("every relay read its new file" if all(w.reloaded) else "a relay read its new file")
    if w.forwards:
        ev.add("a produce forwarded")
    if w.forwarded:
        ev.add("a member coordinated a forwarded produce")


class _Node(NamedTuple):
    world: World
    depth: int
    trace: tuple[Any, ...] | None  # (action, parent trace): a persistent list


def _coverage(w: World, cov: Counter[str], counters: Counter[str], shared: bool = True) -> None:
    """Count the events that hold in `w`; `shared`: one topology (the events of
    configurations, 5.15, are counted only when the relays' topologies disagree)."""
    infos = [c.info for c in w.cores]
    have = [i for i in infos if i.config is not None]
    ev: set[str] = set()
    n_delivered = max(len(d) for d in w.delivered)
    if n_delivered:
        ev.add("some tx committed and delivered")
    if n_delivered >= 2:
        ev.add("two txs delivered at one relay")
    if any(any(skipped for *_, skipped in i.committed) for i in infos):
        ev.add("duplicate skipped in a committed prefix")
    if any(i.fenced for i in have):
        ev.add("a relay fenced")
    if any(i.known_commit[0] > i.committed_point for i in have):
        ev.add("a relay knows a commit it has not delivered")
    if len({i.committed_point for i in have}) > 1:
        ev.add("relays at different committed points")
    if not shared:
        _configuration_coverage(w, infos, ev)
    for answers in w.replies:
        for outcome, _ in answers:
            ev.add(f"producer told {outcome}")
    if w.drops:
        ev.add("a frame dropped")
    if w.dups:
        ev.add("a frame duplicated")
    if w.steps:
        ev.add("a wall clock stepped")
    if w.rebases:
        ev.add("a relay rebased (its delivered history restarted)")
    cov.update(ev)
    counters.update(frozenset().union(*(i.counters for i in infos)))


def run_explore(
    max_states: int = 20_000,
    transactions: int = 3,
    max_drops: int = 2,
    *,
    max_dups: int = 1,
    max_ticks: int = 6,
    tick_ms: int = 10,
    max_skew_ticks: int = 2,
    max_depth: int = 400,
    max_clock_steps: int = 0,
    clock_step_ms: int = 25,
    strategy: str = "dfs",
    seed: int = 0,
    time_budget_s: float | None = None,
    limits: Limits | None = None,
    stop_on_violation: bool = True,
    progress: Callable[[str], None] | None = None,
    core_class: type[RelayCore] = RelayCore,
    shrink: bool = True,
    topologies: str = "same",
) -> ExploreResult:
    """Explore every interleaving within the bounds (or until `max_states` distinct states
    or `time_budget_s`), checking safety in every state. See the module docstring."""
    if not 0 <= transactions <= len(TXS):
        raise ValueError(f"transactions must be in 0..{len(TXS)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}")
    if topologies not in TOPOLOGIES:
        raise ValueError(f"unknown topologies {topologies!r}")
    started = time.monotonic()
    shared = topologies == "same"
    setup = SETUPS[topologies]
    # With topologies that disagree the stream opens on its first produce, which is
    # answered `fenced` (its first view is not decided yet): the later produces come
    # spread over the ticks, as a client's retries come after a backoff, so that some
    # reach the stream once established (at any time, all were spent before). While the
    # stream's relays change, so that some come after the change (at any time, depth first
    # went through all before it: nothing committed under the new configuration).
    produce_gap_ticks = max_ticks // max(transactions, 1) if setup.spread_produces else 0
    args = Bounds(
        max_ticks,
        tick_ms,
        max_skew_ticks,
        max_drops,
        max_dups,
        max_clock_steps,
        clock_step_ms,
        produce_gap_ticks,
        reloads=setup.reloads is not None,
        reload_after_ticks=setup.reload_after_ticks,
    )
    ctx = Context(limits or EXPLORE_LIMITS, core_class, topologies)
    result = ExploreResult(
        params={
            "max_states": max_states,
            "transactions": transactions,
            "max_drops": max_drops,
            "max_dups": max_dups,
            "max_ticks": max_ticks,
            "tick_ms": tick_ms,
            "max_skew_ticks": max_skew_ticks,
            "max_depth": max_depth,
            **(
                {"max_clock_steps": max_clock_steps, "clock_step_ms": clock_step_ms}
                if max_clock_steps
                else {}
            ),
            "strategy": strategy,
            **({"seed": seed} if strategy in ("random", "walk") else {}),
            **({} if shared else {"topologies": topologies}),
            **({"produce_gap_ticks": produce_gap_ticks} if setup.spread_produces else {}),
        }
    )
    rng = random.Random(seed)
    start = initial(ctx, transactions, tick_ms)
    cov: Counter[str] = Counter()
    counters: Counter[str] = Counter()
    seen = {world_fingerprint(start)}
    _coverage(start, cov, counters, shared)
    reasons: set[str] = set()
    next_progress = started + PROGRESS_EVERY_S
    walks = 0

    def fail(message: str, trace: tuple[Any, ...] | None) -> None:
        actions = trace_actions(trace)
        found = len(actions)
        if shrink:
            actions, message = shrink_trace(ctx, start, actions, args, transactions, message)
        steps = describe_trace(ctx, start, actions, args)
        fmt = Fmt(start.now[0])
        message = re.sub(r"\b\d{15,}\b", lambda m: fmt.seq(int(m.group())), message)
        result.violations.append(Violation(message, steps, found))

    def step(node: _Node, act: Action) -> tuple[_Node | None, bool]:
        """Apply one action: (the successor, whether it is new); (None, _) on a violation."""
        result.transitions += 1
        trace = (act, node.trace)
        try:
            child, problems = apply(ctx, node.world, act, args)
        except Exception as e:
            tb = "".join(traceback.format_exception(e)[-3:])
            fail(f"a core raised {type(e).__name__}: {e}\n{tb}", trace)
            return None, False
        fp = world_fingerprint(child)
        new = fp not in seen
        if new:
            seen.add(fp)
            problems += check_world(child, ctx.prefix_of, ctx.established)
            _coverage(child, cov, counters, shared)
        if problems:
            fail("; ".join(dict.fromkeys(problems)), trace)
            if stop_on_violation:
                return None, new
        result.max_depth = max(result.max_depth, node.depth + 1)
        return _Node(child, node.depth + 1, trace), new

    def should_stop() -> bool:
        nonlocal next_progress
        if result.violations and stop_on_violation:
            return True
        if len(seen) >= max_states:
            reasons.add("max_states")
            return True
        now = time.monotonic()
        if time_budget_s is not None and now - started >= time_budget_s:
            reasons.add("time_budget")
            return True
        if progress is not None and now >= next_progress:
            next_progress = now + PROGRESS_EVERY_S
            progress(
                f"{len(seen)} distinct, {result.states_explored} explored, "
                f"{walks or len(frontier)} {'walks' if walks else 'in frontier'}, "
                f"{now - started:.0f} s"
            )
        return False

    frontier: deque[_Node] = deque()
    if strategy == "walk":
        # Random walks from the start to a terminal state (or max_depth), until a bound;
        # each step applies one random enabled action. Stops early once 1,000 walks in a
        # row found nothing new (the space is then likely covered).
        stale = 0
        while stale < STALE_WALKS_MAX and not should_stop():
            walks += 1
            node: _Node | None = _Node(start, 0, None)
            fresh = False
            while node is not None:
                acts = enabled(node.world, transactions, args)
                if not acts:
                    break
                if node.depth >= max_depth:
                    reasons.add("max_depth")
                    break
                result.states_explored += 1
                node, new = step(node, rng.choice(acts))
                fresh |= new
            stale = 0 if fresh else stale + 1
            if len(seen) >= max_states:
                break
        result.walks = walks
        if stale < STALE_WALKS_MAX:
            reasons.add("sampled")  # walks never prove a space exhausted
    else:
        frontier.append(_Node(start, 0, None))
    while frontier and not should_stop():
        node = frontier.popleft() if strategy == "bfs" else frontier.pop()
        acts = enabled(node.world, transactions, args)
        if not acts:
            continue
        if node.depth >= max_depth:
            reasons.add("max_depth")
            continue
        result.states_explored += 1
        children: list[_Node] = []
        for act in acts:
            child, new = step(node, act)
            if child is None and stop_on_violation:
                break
            if child is not None and new:
                children.append(child)
        if strategy == "random":
            rng.shuffle(children)
        elif strategy == "dfs":
            children.reverse()  # the first enabled action is explored first
        frontier.extend(children)
    result.distinct_states = len(seen)
    result.bound_hit = bool(reasons)
    result.bound_reasons = sorted(reasons)
    result.coverage = dict(cov)
    result.counters = dict(counters)
    result.seconds = time.monotonic() - started
    return result
