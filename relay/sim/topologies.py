"""The simulation's topologies: the one a seed builds, and the other files a relay may be
deployed with (docs/protocol.md 5.15: relays may disagree about which relays serve a
stream).

Stream `all` is on every relay; the groups `a.*`, `b.*`, `c.*` are on seeded subsets. An
*alternate* topology moves some groups by one relay (one more, one fewer, or one in place
of another); a *grown* one adds relays to one group, as a rolling reconfiguration does.
Every topology lists every relay id (a relay subscribes only to the relays its file lists:
here, all of them), but for a relay retired from the mesh (`retired_topology`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from relay.core.config import Topology

GROUPS = ("a.*", "b.*", "c.*")
EVERYWHERE = "all"
GROW_BY = 2  # a rolling reconfiguration's group gains this many relays (or all of them)
RETIRE_MIN_GROUP = 3  # a group a retired relay leaves keeps at least this many relays


def build_topology(rng: random.Random, relay_count: int) -> Topology:
    """Stream `all` on every relay; `a.*`, `b.*`, `c.*` on seeded subsets (3, 5, 3-4)."""
    ids = list(range(relay_count))

    def subset(k: int) -> set[int]:
        return set(rng.sample(ids, min(k, relay_count)))

    a = subset(3)
    b = subset(5 if relay_count >= 5 else 3)
    c = subset(rng.choice((3, 4)))
    return topology_of(ids, {"a.*": a, "b.*": b, "c.*": c})


def topology_of(ids: list[int], groups: Mapping[str, set[int]]) -> Topology:
    """Every relay serves `all` and the groups that hold it (in GROUPS order)."""
    subs: dict[int, tuple[str, ...]] = {}
    for r in ids:
        subs[r] = (EVERYWHERE, *(g for g in GROUPS if r in groups.get(g, set())))
    return Topology(subs)


def groups_of(topology: Topology) -> dict[str, set[int]]:
    """The relays of each group in `topology`."""
    return {
        g: {r for r, patterns in topology.subscriptions.items() if g in patterns} for g in GROUPS
    }


def alternate_topology(rng: random.Random, topology: Topology) -> Topology:
    """`topology` with one to three of its groups moved by one relay each, seeded: a group
    grows by a relay it lacks, shrinks by one (never below two), or trades one of its
    relays for one it lacks. The result always differs from `topology`."""
    ids = list(topology.relay_ids)
    groups = groups_of(topology)
    changed = rng.sample(GROUPS, rng.randint(1, len(GROUPS)))
    for g in sorted(changed):
        members = sorted(groups[g])
        others = [r for r in ids if r not in groups[g]]
        moves = [m for m, ok in (("grow", others), ("shrink", len(members) > 2)) if ok]
        if others and members:
            moves.append("move")
        move = rng.choice(moves)  # a group of at least three can always shrink
        if move in ("grow", "move"):
            groups[g].add(rng.choice(others))
        if move in ("shrink", "move"):
            groups[g].discard(rng.choice(members))
    return topology_of(ids, groups)


def grown_topology(rng: random.Random, topology: Topology) -> Topology:
    """`topology` with one group (seeded, among those that do not hold every relay yet)
    grown by GROW_BY relays, or to every relay if fewer lack it; unchanged if every group
    holds every relay already (three relays)."""
    ids = list(topology.relay_ids)
    groups = groups_of(topology)
    can_grow = [g for g in GROUPS if len(groups[g]) < len(ids)]
    if not can_grow:
        return topology
    g = rng.choice(can_grow)
    others = [r for r in ids if r not in groups[g]]
    groups[g].update(rng.sample(others, min(GROW_BY, len(others))))
    return topology_of(ids, groups)


def retired_topology(topology: Topology, relay: int, *, removed: bool) -> Topology:
    """`topology` with `relay` serving no stream (docs/deploy.md section 9, step 1), or,
    `removed`, without it (step 2)."""
    subs = dict(topology.subscriptions)
    patterns = subs.get(relay, ())
    if removed:
        subs.pop(relay, None)
    else:
        subs[relay] = ()
    for pattern in patterns:
        # A group it leaves with fewer than RETIRE_MIN_GROUP relays gets another in its
        # place (a replaced relay): a stream of one relay, or of two that a spool or a
        # pause stops, is not what this fault is about.
        holding = [r for r, p in subs.items() if pattern in p]
        spare = [r for r in sorted(subs) if r != relay and r not in holding]
        if len(holding) < RETIRE_MIN_GROUP and spare:
            subs[spare[0]] = (*subs[spare[0]], pattern)
    return Topology(subs)


def describe(topology: Topology) -> str:
    """The groups of `topology`, for the event log: `a.*=[0, 1, 2] b.*=[...] c.*=[...]`."""
    return " ".join(f"{g}={sorted(m)}" for g, m in groups_of(topology).items())
