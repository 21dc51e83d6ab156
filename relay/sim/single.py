"""Single persistent faults, and the liveness rule they are checked against.

The availability rule (docs/protocol.md section 7): whenever a majority of a stream's
members are running, have their memory and can reach each other (directly or through
another member), the stream commits again within a bound, whatever the other members do.
A single-fault run checks it: the mesh warms up, one fault strikes at `fault_at_ms` and
stays to the end of the run (nothing heals), and the producers keep writing.

    crash                one relay dies and stays down
    pause                one relay stops (SIGSTOP) and never resumes
    isolate              every link from and to one relay is cut
    oneway-out           one relay's outgoing links are cut (it still hears the others)
    oneway-in            one relay's incoming links are cut (the others still hear it)
    cut-link             the link between two relays is cut both ways
    cut-link-oneway      the link from one relay to another is cut
    cut-then-crash       a link a<->b is cut; a keeps coordinating, then dies
    crash-cut-link       as many relays die as a majority can lose while three stay, and
                         a link between two survivors is cut both ways (with 4 or more
                         relays only the third survivor, passing frames on, joins them)
    clock-back           one relay's wall clock steps back by minutes
    clock-forward        one relay's wall clock steps forward by minutes
    restart-clock-back   one relay restarts (empty) with its wall clock minutes behind
    spool-full           one relay's spool fills up and the store never takes it (5.14)
    roll                 every relay in turn restarts (keeping its disk) onto a topology
                         that grows one group of streams, each once the one before
                         joined every stream it serves again (5.15: a rolling
                         reconfiguration; once every relay runs the new file, the
                         mesh changes the grown streams to its relays)
    stale                one relay restarts onto another topology (5.15)
    retire               every relay in turn reads a file in which one relay serves no
                         stream; once none counts it, the others read one without it,
                         forget it and it stops (docs/deploy.md section 9: 5.15 changes
                         take it off every stream, then the mesh lets it go)

The checker: for every stream, the relays that are up, not stepped, hold their memory, have
room in their spools and form a strongly connected group (over the links that still work)
are its majority, if they include a quorum of its members. Every produce attempt sent to
such a relay from RESUME_BOUND_MS after the fault on (until the producers stop) must be
answered `committed` within ANSWER_BOUND_MS, or `fenced` by a member the view leaves out
(a relay that cannot hear another member, 5.12), whose redirect the client follows, or
`rejected: late` (a view change left that copy out; the client tries again at once): then
the same write must be committed through another attempt within ANSWER_BOUND_MS of that
one. The usual safety checkers run as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relay.core.fencing import CONFIG_MISMATCH
from relay.core.messages import RejectReason
from relay.sim.history import COMMITTED, FENCED, REJECTED, History

SINGLE_FAULTS: tuple[str, ...] = (
    "crash",
    "pause",
    "isolate",
    "oneway-out",
    "oneway-in",
    "cut-link",
    "cut-link-oneway",
    "cut-then-crash",
    "crash-cut-link",
    "clock-back",
    "clock-forward",
    "restart-clock-back",
    "spool-full",
    "roll",
    "stale",
    "retire",
)
# Faults made of restarts onto another topology (5.15): each restart is checked as a
# single fault of its own (see `single_fault_liveness`)
RESTART_FAULTS = ("roll", "stale")
# Faults that change the mesh's files (5.15): the others must not notice them (checked
# from the fault on), and each stream ends with the relays every file names
CHANGE_FAULTS = (*RESTART_FAULTS, "retire")
CLOCK_STEP_MS = 120_000  # "minutes": far beyond max_clock_ahead_ms
CRASH_AFTER_CUT_MS = (20, 1_500)  # cut-then-crash: how long the cut relay coordinates on
# Commits resume within suspect_timeout_ms plus a few round trips of the fault (retries
# of joins, repairs and syncs happen every repair_retry_ms).
RESUME_BOUND_MS = 600
ANSWER_BOUND_MS = 400  # a produce to the majority is answered committed within this
# roll: the next relay restarts this long after the one before, at the earliest (so
# that commits are checked between restarts), and once that one rejoined; a restarted
# relay must have joined every stream it serves again within REJOIN_BOUND_MS
ROLL_STEP_MS = RESUME_BOUND_MS + ANSWER_BOUND_MS
REJOIN_BOUND_MS = RESUME_BOUND_MS


def fault_ms(kind: str, relay_count: int, base_ms: int) -> int:
    """How long a single-fault run of `kind` runs after its fault: `base_ms`, and for a
    roll or a retire as long again as it takes to restart, or change, every relay in
    turn."""
    return base_ms + (relay_count * ROLL_STEP_MS if kind in ("roll", "retire") else 0)


def parse_single(text: str) -> tuple[str, ...]:
    """`all` or a comma list of single-fault names; ValueError names an unknown one."""
    spec = text.strip().lower()
    if spec == "all":
        return SINGLE_FAULTS
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    for name in names:
        if name not in SINGLE_FAULTS:
            raise ValueError(
                f"unknown single fault {name!r}; choose from all, " + ", ".join(SINGLE_FAULTS)
            )
    if not names:
        raise ValueError("no single fault named")
    return names


@dataclass
class SingleFaultInfo:
    """What the single-fault checker needs of a run."""

    kind: str
    fault_at_ms: int
    issue_end_ms: int  # producers stop issuing here
    # stream -> the relays of its connected majority (empty: it has none, nothing to check)
    majorities: dict[str, frozenset[int]] = field(default_factory=dict)
    # RESTART_FAULTS: (relay, restarted at ms, rejoined at ms or -1: never), in order, and
    # the relays the run ended before restarting
    restarts: list[tuple[int, int, int]] = field(default_factory=list)
    not_restarted: tuple[int, ...] = ()
    # RESTART_FAULTS: stream -> the relays of its established configuration when the
    # fault struck (none: not established) and when the run ended
    configs_before: dict[str, tuple[int, ...]] = field(default_factory=dict)
    configs_after: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # stream -> the relays it must end with: those every relay's file names at the end (a
    # roll: the mesh changes the stream to them, 5.15 changes), else those it had (one
    # stale file changes nothing)
    configs_wanted: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # retire: the relay retired and stopped by the end (-1: none was, or another kind)
    retired: int = -1


def strongly_connected(nodes: set[int], works: set[tuple[int, int]]) -> list[set[int]]:
    """The strongly connected groups of `nodes` over the directed links in `works`."""
    groups: list[set[int]] = []
    left = set(nodes)
    while left:
        start = min(left)
        forward = _reach(start, nodes, works, reverse=False)
        backward = _reach(start, nodes, works, reverse=True)
        group = forward & backward
        groups.append(group)
        left -= group
    return groups


def _reach(start: int, nodes: set[int], works: set[tuple[int, int]], *, reverse: bool) -> set[int]:
    seen = {start}
    todo = [start]
    while todo:
        a = todo.pop()
        for b in nodes:
            link = (b, a) if reverse else (a, b)
            if b not in seen and link in works:
                seen.add(b)
                todo.append(b)
    return seen


def single_fault_liveness(history: History, info: SingleFaultInfo) -> list[str]:
    """Produces sent to a stream's connected majority commit promptly after the fault
    (RESTART_FAULTS: `restart_faults` as well)."""
    out: list[str] = []
    changing = info.kind in CHANGE_FAULTS
    # (the others must not notice a restart onto another topology: checked at once)
    start = info.fault_at_ms + (0 if changing else RESUME_BOUND_MS)
    late: dict[str, int] = {}
    first: dict[str, str] = {}
    committed_ms: dict[tuple[bytes, int], int] = {}
    for a in history.attempts:
        if a.outcome == COMMITTED:
            key = (a.pid, a.pseq)
            committed_ms[key] = min(committed_ms.get(key, a.answer_ms), a.answer_ms)
    # A produce caught by its relay's restart (sent at most ANSWER_BOUND_MS before it, or
    # before the relay joined every stream it serves again) is as one it redirected.
    rejoining: dict[int, list[tuple[int, int]]] = {}
    for relay, at, rejoined in info.restarts:
        until = rejoined if rejoined >= 0 else info.issue_end_ms
        rejoining.setdefault(relay, []).append((at - ANSWER_BOUND_MS, until))
    for a in history.attempts:
        majority = info.majorities.get(a.stream)
        if not majority or a.relay not in majority or not start <= a.sent_ms < info.issue_end_ms:
            continue
        if a.outcome == COMMITTED and a.answer_ms - a.sent_ms <= ANSWER_BOUND_MS:
            continue
        # `fenced` redirects the client, and `rejected: late` (a view change left that
        # copy out) has it try again at once, as the clients do (relay/engines.py)
        redirected = (
            a.outcome == FENCED
            or (a.outcome == REJECTED and a.reason.split(" ", 1)[0] == RejectReason.LATE.value)
            or any(lo <= a.sent_ms < hi for lo, hi in rejoining.get(a.relay, ()))
        )
        done = committed_ms.get((a.pid, a.pseq), -1)
        if redirected and 0 <= done - a.sent_ms <= ANSWER_BOUND_MS:
            continue
        late[a.stream] = late.get(a.stream, 0) + 1
        if a.stream not in first:
            answer = (
                f"{a.outcome} after {a.answer_ms - a.sent_ms} ms"
                if a.answer_ms >= 0
                else "no answer"
            )
            first[a.stream] = (
                f"{a.pid.decode()}#{a.pseq} sent to relay {a.relay} at {a.sent_ms} ms: {answer}"
            )
    for stream in sorted(late):
        out.append(
            f"stall: {info.kind} at {info.fault_at_ms} ms: {late[stream]} produce(s) to the "
            f"connected majority {sorted(info.majorities[stream])} of {stream} not committed "
            f"within {ANSWER_BOUND_MS} ms (first: {first[stream]})"
        )
    if changing:
        out.extend(change_faults(history, info))
    return out


def change_faults(history: History, info: SingleFaultInfo) -> list[str]:
    """CHANGE_FAULTS (5.15): the mesh was warm (every stream established) when the fault
    struck; every relay of a roll restarted, each joined every stream it serves again
    within REJOIN_BOUND_MS; a retired relay was let go of by every other and stopped;
    every stream ends with the relays it must (`configs_wanted`: after a roll or a
    retire, those of the files every relay runs, to which the mesh changed it; after one
    stale file, those it was established with, whatever that file says), each of them
    serving it (joined, unfenced), and no relay ends with a stream held for another
    configuration (`config_mismatch`)."""
    out: list[str] = []
    if info.kind == "retire" and info.retired < 0:
        out.append(f"not retired: {info.kind}: the relay was still counted at the end")
    for stream in sorted(info.configs_after.keys() | info.configs_before.keys()):
        before = info.configs_before.get(stream, ())
        after = info.configs_after.get(stream, ())
        wanted = info.configs_wanted.get(stream, before)
        if not before:
            out.append(f"cold: {info.kind}: {stream} was not established when the fault struck")
        elif after != wanted:
            out.append(
                f"reconfigured: {info.kind}: {stream} was established with relays "
                f"{list(before)}, ends with {list(after)}, not {list(wanted)}"
            )
        for relay in wanted:
            rf = history.relay_finals.get(relay)
            if rf is None or not rf.up:
                continue
            config = rf.config.get(stream, (0, ()))
            if config[1] != wanted or not rf.joined.get(stream) or rf.fenced.get(stream):
                out.append(
                    f"dropped: {info.kind}: relay {relay} ends with {stream} under "
                    f"{config}, joined={rf.joined.get(stream, False)}, fenced="
                    f"{rf.fenced.get(stream, False)}; it must end with {list(wanted)}"
                )
    for relay in sorted(history.relay_finals):
        for stream, (reason, waiting) in sorted(history.relay_finals[relay].stall.items()):
            if reason == CONFIG_MISMATCH:
                out.append(
                    f"noticed: {info.kind}: relay {relay} ends with {stream} held for "
                    f"{CONFIG_MISMATCH} by {list(waiting)}"
                )
    for relay, at, rejoined in info.restarts:
        if rejoined < 0 or rejoined - at > REJOIN_BOUND_MS:
            took = "never" if rejoined < 0 else f"after {rejoined - at} ms"
            out.append(
                f"not rejoined: {info.kind}: relay {relay} restarted at {at} ms joined every "
                f"stream it serves {took}, not within {REJOIN_BOUND_MS} ms"
            )
    if info.not_restarted:
        out.append(
            f"not rolled: {info.kind}: relays {list(info.not_restarted)} were never restarted"
        )
    return out
