"""Which faults a simulation injects, and how hard.

`FaultConfig.parse("all" | "none" | "drop,delay,...")` picks the fault kinds; the numbers
(probabilities, durations) are drawn per seed by the world, inside the bounds given here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

FAULT_KINDS: tuple[str, ...] = (
    "drop",  # a frame is lost
    "delay",  # a latency spike on one link (head-of-line: later frames wait too)
    "duplicate",  # a frame is delivered twice, the copy right after the original
    "reorder",  # per-frame jitter: frames on different links interleave freely
    "partition",  # symmetric: the relays split into two groups that cannot talk
    "oneway",  # some directed links are cut while their reverse still works
    "pause",  # a relay stops processing for a while; inbound frames queue
    "crash",  # a relay dies and later restarts empty, with a higher incarnation
    "clock_skew",  # a constant per-relay clock offset
    "clock_step",  # a relay's clock jumps back or forward
    "spool_full",  # some relays' spools fill up until the store takes them (5.14)
    # 5.15 configurations: a relay crashes and restarts onto another topology file
    # (relay/sim/topologies.py), which may later move it back or elsewhere
    "retopology",
    "stale",  # one relay runs from the start with another topology file than the others
    # 5.15 changes: the operator gives every relay a new topology file, one relay after
    # another, and each reads it while it runs: the mesh changes the streams' relays
    "reconfigure",
    # 5.15 changes: the operator takes one relay off every stream (every relay reads a
    # file in which it serves none), then removes it from the mesh (the others read a file
    # without it, and forget it once no stream counts it); then it is stopped for good
    "retire",
)

# Bounds. Offsets stay well below the core's max_clock_ahead_ms (5000): any two relays'
# clocks differ by at most 2 * MAX_TOTAL_OFFSET_MS.
MAX_SKEW_MS = 2_000
MAX_STEP_MS = 1_500
MAX_TOTAL_OFFSET_MS = 2_400
# retopology: how long the relay is down before it restarts onto its new topology
RETOPOLOGY_DOWN_MS = (20, 600)
# retopology: the chance that a restart goes back to the seed's own topology (when the
# relay is not on it), rather than onto another alternate
RETOPOLOGY_BACK_CHANCE = 0.3
# reconfigure: the time between two relays reading the new file
RECONFIGURE_STAGGER_MS = (0, 200)
# retire: the chance a run retires a relay (with at least RETIRE_MIN_RELAYS: fewer would
# leave streams of two), when in the safety phase its drain starts, and how long after
# the last relay read the drained file the others read the one without it
RETIRE_CHANCE = 0.5
RETIRE_MIN_RELAYS = 4
RETIRE_START_FRACTION = 0.5
RETIRE_REMOVE_AFTER_MS = (200, 1_200)


@dataclass(frozen=True)
class FaultConfig:
    drop: bool = False
    delay: bool = False
    duplicate: bool = False
    reorder: bool = False
    partition: bool = False
    oneway: bool = False
    pause: bool = False
    crash: bool = False
    clock_skew: bool = False
    clock_step: bool = False
    spool_full: bool = False
    retopology: bool = False
    stale: bool = False
    reconfigure: bool = False
    retire: bool = False

    @classmethod
    def all(cls) -> FaultConfig:
        return cls(**dict.fromkeys(FAULT_KINDS, True))

    @classmethod
    def none(cls) -> FaultConfig:
        return cls()

    @classmethod
    def parse(cls, text: str | Sequence[str] | FaultConfig) -> FaultConfig:
        """`all`, `none`, or a comma list of fault names (e.g. `drop,crash`); a sequence of
        names (`("drop", "crash")`, `("all",)`) works too. Unknown names: ValueError."""
        if isinstance(text, FaultConfig):
            return text
        if not isinstance(text, str):
            text = ",".join(text)
        spec = text.strip().lower()
        if spec == "all":
            return cls.all()
        if spec in ("none", ""):
            return cls.none()
        chosen: dict[str, bool] = {}
        for raw in spec.split(","):
            name = raw.strip().replace("-", "_")
            if not name:
                continue
            if name in ("all", "none"):
                raise ValueError(f"fault {name!r} cannot be combined with other faults")
            if name not in FAULT_KINDS:
                raise ValueError(
                    f"unknown fault {raw.strip()!r}; choose from all, none, "
                    + ", ".join(FAULT_KINDS)
                )
            chosen[name] = True
        return cls(**chosen)

    def enabled(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if getattr(self, f.name))

    def any(self) -> bool:
        return bool(self.enabled())

    def spec(self) -> str:
        """The text `parse` turns back into this config."""
        names = self.enabled()
        if len(names) == len(FAULT_KINDS):
            return "all"
        if not names:
            return "none"
        return ",".join(names)
