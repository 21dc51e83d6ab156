"""What a relay's client service counts of its produces for the metrics: the produce
latency in fixed buckets, and the produces it refused by stream, outcome and reason.

This is the only part of the metrics that runs per transaction (a bisect per produce
answer, a dictionary addition per refusal), so it holds plain counts and imports nothing
heavy: relay/metrics.py turns them into Prometheus' families when someone scrapes, and
only a relay with an HTTP port loads it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from typing import Any

__all__ = [
    "LATENCY_BOUNDS_S",
    "MAX_REFUSAL_REASONS",
    "OTHER_REASON",
    "LatencyHistogram",
    "RefusalCounts",
    "refusal_reason",
]

# The produce-latency buckets (from a produce frame's arrival to its answer), seconds:
# a local mesh answers in about a millisecond, a loaded one in tens; past the produce
# timeout (2 s by default) a producer has been told `unknown`.
LATENCY_BOUNDS_S = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# Distinct refusal reasons counted per relay: reasons are short words from the protocol
# (fenced, buffer_full, not_authorized, ...); past this any new one counts as "other", so
# a label set stays bounded whatever a client sends.
MAX_REFUSAL_REASONS = 64
OTHER_REASON = "other"


class LatencyHistogram:
    """Counts of observations per bucket of LATENCY_BOUNDS_S (the last: above them all)."""

    __slots__ = ("counts", "sum_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BOUNDS_S) + 1)
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BOUNDS_S, seconds)] += 1
        self.sum_s += seconds

    def document(self) -> dict[str, Any]:
        return {
            "bounds_s": list(LATENCY_BOUNDS_S),
            "counts": list(self.counts),
            "sum_s": self.sum_s,
        }


def refusal_reason(reason: str) -> str:
    """The first word of a refusal's reason (`"not_authorized (client 'x' has ...)"` ->
    `not_authorized`): what the label keeps of it; the details go to the log."""
    for stop in (" ", ":", "("):
        reason = reason.split(stop, 1)[0]
    return reason or "none"


class RefusalCounts:
    """Produces answered other than `committed`, by (stream, outcome, reason's first
    word); at most MAX_REFUSAL_REASONS distinct reasons, the rest under OTHER_REASON."""

    __slots__ = ("_counts", "_reasons")

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str, str]] = Counter()
        self._reasons: set[str] = set()

    def count(self, stream: str, outcome: str, reason: str) -> None:
        word = refusal_reason(reason)
        if word not in self._reasons:
            if len(self._reasons) >= MAX_REFUSAL_REASONS:
                word = OTHER_REASON
            else:
                self._reasons.add(word)
        self._counts[stream, outcome, word] += 1

    def document(self) -> list[dict[str, Any]]:
        return [
            {"stream": stream, "outcome": outcome, "reason": reason, "count": count}
            for (stream, outcome, reason), count in sorted(self._counts.items())
        ]
