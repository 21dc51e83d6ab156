"""Digest reports per point, and the commit rule: a point commits when a quorum of the
stream's members reported the same digest there. Reports of one member arrive in
increasing point order and are never repeated (rule ii of the spec)."""

from __future__ import annotations

from relay.core.config import quorum


class VoteTally:
    def __init__(self, members: tuple[int, ...], max_points: int) -> None:
        self.members = members
        self.q = quorum(len(members))
        self.max_points = max_points
        self.points: dict[int, dict[bytes, int]] = {}  # point -> digest -> reporter bitmask
        self.last_point: dict[int, int] = {}  # reporter -> highest point it reported
        self.max_seen = -1  # highest point seen reported by anyone (or announced committed)
        self.floor = -1  # points at or below are settled (committed here): ignored

    def add(self, reporter: int, point: int, digest: bytes) -> bool:
        """Count one report; True if it completed a quorum at `point`."""
        if point <= self.last_point.get(reporter, -1):
            return False  # a repeat or out of order: a member reports each point once
        self.last_point[reporter] = point
        if point > self.max_seen:
            self.max_seen = point
        if point <= self.floor:
            return False
        by_digest = self.points.get(point)
        if by_digest is None:
            if len(self.points) >= self.max_points:
                del self.points[min(self.points)]  # bounded memory; a later point commits
            by_digest = self.points[point] = {}
        mask = by_digest.get(digest, 0) | (1 << reporter)
        by_digest[digest] = mask
        return mask.bit_count() == self.q

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

    def drop_reporter(self, reporter: int) -> None:
        """A member restarted: its earlier, uncommitted reports no longer count."""
        bit = 1 << reporter
        for by_digest in self.points.values():
            for d in list(by_digest):
                by_digest[d] &= ~bit
                if not by_digest[d]:
                    del by_digest[d]
        self.last_point.pop(reporter, None)
