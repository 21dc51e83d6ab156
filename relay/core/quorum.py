"""Quorum arithmetic (docs/protocol.md sections 2, 5.4 and 5.7): the quorum size, and the
tally of digest reports per point that decides commits and dead points.

A point commits when a quorum of the stream's members reported the same digest there.

A member reports each point at most once (rule ii of the spec), so a vote is a fact: the
first digest counted for (member, point) stays; a second, different one is a protocol
violation by that member and is counted, not used. Votes of a member's earlier incarnation
stay too: a quorum that counted them was a real quorum.

A point is *dead* when no digest can reach a quorum any more: the votes already known,
plus every member whose vote there is still unknown, fall short for every digest. A member
may rewrite its prefix at points it reported only if all of them are dead (relay/core/reset.py).
"""

from __future__ import annotations

from mypy_extensions import mypyc_attr


def quorum(member_count: int) -> int:
    """q(S) = floor(|R(S)| / 2) + 1: any two quorums of the same set intersect."""
    if member_count <= 0:
        raise ValueError("a stream needs at least one member")
    return member_count // 2 + 1


@mypyc_attr(serializable=True, allow_interpreted_subclasses=True)
class VoteTally:
    """Per point above the committed point, per digest, the members that reported it."""

    def __init__(self, members: tuple[int, ...], max_points: int) -> None:
        self.members = members
        self.q = quorum(len(members))
        self.max_points = max_points
        self.points: dict[int, dict[bytes, int]] = {}  # point -> digest -> reporter bitmask
        self.last_point: dict[int, int] = {}  # reporter -> highest point it reported
        self.max_seen = -1  # highest point seen reported by anyone (or announced committed)
        self.floor = -1  # points at or below are settled (committed here): ignored
        self.evicted_through = -1  # votes at or below were dropped to bound memory
        self.conflicts = 0

    def add(self, reporter: int, point: int, digest: bytes) -> bool:
        """Count one report; True if it completed a quorum at `point`."""
        if point > self.last_point.get(reporter, -1):
            self.last_point[reporter] = point
        if point > self.max_seen:
            self.max_seen = point
        if point <= self.floor:
            return False
        by_digest = self.points.get(point)
        if by_digest is None:
            if len(self.points) >= self.max_points:
                lowest = min(self.points)
                del self.points[lowest]  # bounded memory; a later point commits
                self.evicted_through = max(self.evicted_through, lowest)
            by_digest = self.points[point] = {}
        bit = 1 << reporter
        for other, mask in by_digest.items():
            if mask & bit:
                if other != digest:
                    self.conflicts += 1
                return False
        mask = by_digest.get(digest, 0) | bit
        by_digest[digest] = mask
        return mask.bit_count() == self.q

    def mask(self, point: int, digest: bytes) -> int:
        """The members that reported `digest` at `point` (as counted here), as bits."""
        return self.points.get(point, {}).get(digest, 0)

    def reporters(self, point: int, digest: bytes) -> list[int]:
        mask = self.points.get(point, {}).get(digest, 0)
        return [m for m in self.members if mask >> m & 1]

    def settle_through(self, point: int) -> None:
        """Forget every point at or below a committed point."""
        if point <= self.floor:
            return
        self.floor = point
        for p in [p for p in self.points if p <= point]:
            del self.points[p]

    def dead(self, point: int, unknown: int) -> bool:
        """No digest can reach a quorum at `point`, with `unknown` members whose vote
        there may still come (or may have been counted somewhere we cannot see)."""
        if point <= self.evicted_through:
            return False  # we no longer know the votes there
        best = max((mask.bit_count() for mask in self.points.get(point, {}).values()), default=0)
        return best + unknown < self.q
