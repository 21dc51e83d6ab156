"""Checkers: pure functions over a `History`, each returning violations (empty = ok).

They map the history onto the shared invariants (relay/sim/invariants.py); the last ones
are the simulator's own: they need the whole run (its phases and final states).

Configurations (docs/protocol.md 5.15): relays may run different topology files, so a
stream's members are those of the configuration its relays established (`established`),
which every relay that knows one must share (`one_configuration`). A stream never
established because a relay its seed's topology names runs another file that names other
relays for it (`blocked_by_files`) may never commit: it is checked for that instead of
for liveness (`blocked_streams`).

Safety checkers hold at every moment; `acknowledged_delivered` and `liveness` assume the run
ended with a fault-free liveness phase and a quiet period (see `PhaseInfo`).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

from relay.core.fencing import CONFIG_MISMATCH
from relay.core.messages import Transaction
from relay.sim import invariants
from relay.sim.history import COMMITTED, REJECTED, History, PhaseInfo
from relay.sim.invariants import LabelledLog

Canonical = dict[str, dict[int, Transaction]]  # stream -> seq -> tx


def _relay_logs(history: History) -> Iterator[LabelledLog]:
    """(label, stream, log) for every piece of a relay's delivered history, in a fixed
    order: one per incarnation, split again where the relay restarted from a base."""
    for relay, inc in sorted(history.delivered):
        per_stream = history.delivered[(relay, inc)]
        for stream in sorted(per_stream):
            log = per_stream[stream]
            cuts = [0, *history.rebases.get((relay, inc, stream), []), len(log)]
            for part, (a, b) in enumerate(pairwise(sorted(set(cuts)))):
                suffix = f" part {part}" if len(cuts) > 3 else ""
                yield f"relay {relay}/{inc}{suffix}", stream, log[a:b]


def _consumer_logs(history: History) -> Iterator[LabelledLog]:
    for cid in sorted(history.consumers):
        log = history.consumers[cid]
        yield f"consumer {cid}", log.stream, log.received


def _all_logs(history: History) -> Iterator[LabelledLog]:
    yield from _relay_logs(history)
    yield from _consumer_logs(history)


def canonical(history: History) -> tuple[Canonical, list[str]]:
    """The timeline every log must be a gap-free piece of, and the conflicts found building
    it: a seq mapped to two different transactions, or one transaction at two seqs."""
    return invariants.one_timeline(_all_logs(history))


def no_reorder_no_duplicate(history: History) -> list[str]:
    out: list[str] = []
    for label, stream, log in _relay_logs(history):
        out.extend(invariants.in_order(label, stream, log))
    return out


def timelines_agree(history: History) -> list[str]:
    canon, out = canonical(history)
    index = {stream: invariants.TimelineIndex(tl) for stream, tl in canon.items()}
    for label, stream, log in _relay_logs(history):
        if log:
            out.extend(invariants.gap_free(label, stream, log, index[stream]))
    for label, stream, log in _consumer_logs(history):
        out.extend(invariants.in_order(label, stream, log, verb="received"))
        if log:
            out.extend(invariants.gap_free(label, stream, log, index[stream]))
    return out


def nothing_invented(history: History) -> list[str]:
    return invariants.nothing_invented(_all_logs(history), history.produced)


def no_rejected_delivered(history: History) -> list[str]:
    """Neither a relay's final answer nor the client's conclusion `rejected` is ever
    followed by a delivery of that transaction."""
    rejected = {
        key
        for key, f in history.finals.items()
        if f.outcome == REJECTED or f.client_outcome == REJECTED
    }
    return invariants.rejected_not_delivered(_all_logs(history), rejected)


def client_conclusions(history: History) -> list[str]:
    """The client engine concluded `committed(seq)` only from a relay's committed answer at
    that seq, and `rejected` only when no relay answered committed."""
    out: list[str] = []
    for key in sorted(history.finals):
        final = history.finals[key]
        name = invariants.describe(final.tx)
        if final.client_outcome == COMMITTED and final.client_seq not in final.committed_seqs:
            out.append(
                f"client: {name} concluded committed({final.client_seq}), which no relay "
                f"answered (answers: {final.outcome} {final.committed_seqs})"
            )
        elif final.client_outcome == REJECTED and final.outcome == COMMITTED:
            out.append(f"client: {name} concluded rejected, but a relay answered committed")
    return out


def committed_seq_matches(history: History) -> list[str]:
    canon, _ = canonical(history)
    placed = invariants.placed_at(canon)
    out: list[str] = []
    for key in sorted(history.finals):
        final = history.finals[key]
        if final.outcome != COMMITTED:
            continue
        name = invariants.describe(final.tx)
        answers = final.committed_seqs or [final.seq]
        timeline = canon.get(final.stream, {})
        out.extend(invariants.committed_answers(name, final.tx, answers, timeline, must_hold=False))
        where = placed.get(key)
        if where is not None and where != final.seq:
            out.append(f"wrong seq: {name} committed at seq {final.seq} but delivered at {where}")
    return out


def _configurations(history: History) -> dict[str, dict[tuple[int, tuple[int, ...]], list[int]]]:
    """stream -> established configuration (version, relays) -> the relays that ended with
    it (5.15; a relay it leaves out included)."""
    found: dict[str, dict[tuple[int, tuple[int, ...]], list[int]]] = {}
    for relay in sorted(history.relay_finals):
        for stream, config in sorted(history.relay_finals[relay].config.items()):
            if config[0] > 0:  # (version 0: provisional, not established)
                found.setdefault(stream, {}).setdefault(config, []).append(relay)
    return found


def established(history: History) -> dict[str, tuple[int, ...]]:
    """The relays of each stream's established configuration, as the relays ended with it
    (the latest version: a change moves a stream to the next one)."""
    return {stream: max(configs)[1] for stream, configs in _configurations(history).items()}


def members_of(history: History, stream: str, known: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The stream's members: its established configuration's (`known`: `established`),
    else the relays the seed's topology names (nothing established it: liveness says so)."""
    return known.get(stream) or history.members.get(stream, ())


def one_configuration(history: History) -> list[str]:
    """No two relays ended with established configurations of a stream of the same version
    and different relays (5.15: two histories). Different versions are a change that some
    relay has not adopted (`configurations_caught_up` checks the relays that are up)."""
    out: list[str] = []
    for stream, configs in sorted(_configurations(history).items()):
        versions = [v for v, _ in configs]
        if len(set(versions)) < len(versions):
            out.append(
                f"config fork: {stream} ended established as "
                + "; ".join(
                    f"version {v} {list(relays)} at relays {holders}"
                    for (v, relays), holders in sorted(configs.items())
                )
            )
    return out


def blocked_by_files(history: History) -> dict[str, str]:
    """Streams no relay established, with why: a relay the seed's topology names for the
    stream ended with a topology file that names other relays for it (5.15: the stream
    cannot be established while its relays disagree about its relays)."""
    known = established(history)
    out: dict[str, str] = {}
    for stream, named in sorted(history.members.items()):
        if stream in known:
            continue
        for relay in named:
            rf = history.relay_finals.get(relay)
            if rf is None or stream not in rf.topology:
                continue
            if rf.topology[stream] != named:
                out[stream] = (
                    f"relay {relay}'s file names {list(rf.topology[stream])}, the seed's "
                    f"topology {list(named)}"
                )
                break
    return out


def blocked_streams(history: History) -> list[str]:
    """A stream `blocked_by_files` never told a producer `committed` nor delivered
    anything, and every relay up at the end that serves it by its own configuration
    says why (5.15): its stall is `config_mismatch` naming the relays of its
    configuration that state another one, or, when none does, some other reason naming
    the relays of its configuration whose file leaves them out (they never hear the
    stream: it waits for them as for relays that are down)."""
    out: list[str] = []
    finals = history.relay_finals

    def serves(relay: int, stream: str) -> tuple[int, ...]:
        """The relays the relay runs the stream under, if it serves it; else ()."""
        rf = finals.get(relay)
        relays = rf.config.get(stream, (0, ()))[1] if rf is not None else ()
        return relays if relay in relays else ()

    for stream, why in blocked_by_files(history).items():
        told = sorted(
            invariants.describe(a.tx)
            for a in history.attempts
            if a.stream == stream and a.outcome == COMMITTED
        )
        if told:
            out.append(
                f"blocked committed: {stream} ({why}) answered committed for {told[0]} "
                f"and {len(told) - 1} more"
            )
        for label, logged, log in _relay_logs(history):
            if logged == stream and log:
                out.append(f"blocked committed: {stream} ({why}) delivered at {label}")
                break
        for relay in sorted(finals):
            relays = serves(relay, stream)
            if not finals[relay].up or not relays:
                continue
            stating = {m for m in relays if m != relay and serves(m, stream) not in ((), relays)}
            silent = {m for m in relays if m != relay and not serves(m, stream)}
            reason, waiting = finals[relay].stall.get(stream, ("", ()))
            if stating:
                ok = reason == CONFIG_MISMATCH and stating <= set(waiting)
                expected = f"{CONFIG_MISMATCH} for {sorted(stating)}"
            else:
                ok = reason != "" and bool(silent) and silent <= set(waiting)
                expected = f"waiting for {sorted(silent)}, which do not serve it"
            if not ok:
                out.append(
                    f"blocked unnoticed: relay {relay} ends with {stream} stalled "
                    f"{reason or 'for nothing'} for {list(waiting)}, not {expected} ({why})"
                )
    return out


def acknowledged_delivered(history: History) -> list[str]:
    """Every COMMITTED answer is in the canonical timeline and in the final log of every up,
    joined member whose current incarnation's log starts at or below it (a relay starting
    with empty memory joins at its peers' committed point and need not hold older ones)."""
    canon, _ = canonical(history)
    out: list[str] = []
    seqsets: dict[tuple[int, int, str], set[int]] = {}
    known = established(history)
    for key in sorted(history.finals):
        final = history.finals[key]
        if final.outcome != COMMITTED:
            continue
        name = invariants.describe(final.tx)
        if canon.get(final.stream, {}).get(final.seq) is None:
            out.append(
                f"lost: {name} committed at {final.stream} seq {final.seq} "
                "is in no relay's timeline"
            )
        for relay in members_of(history, final.stream, known):
            rf = history.relay_finals.get(relay)
            if rf is None or not rf.up or not rf.joined.get(final.stream, False):
                continue
            log = history.log_since_rebase(relay, rf.incarnation, final.stream)
            if not log or log[0][0] > final.seq:
                continue  # this incarnation joined after it: it need not hold it
            ks = (relay, rf.incarnation, final.stream)
            if ks not in seqsets:
                seqsets[ks] = {s for s, _ in log}
            if final.seq not in seqsets[ks]:
                out.append(
                    f"missing: {name} committed at {final.stream} seq {final.seq} "
                    f"is not in relay {relay}/{rf.incarnation}'s delivered log"
                )
    return out


def liveness(history: History, phase: PhaseInfo) -> list[str]:
    """After the heal, every produce commits, every member of every stream is joined and
    unfenced within the heal bound and stays so, and the members end at one committed
    point. The members are those of the stream's established configuration (5.15); a
    stream `blocked_by_files` is left to `blocked_streams`."""
    out: list[str] = []
    known = established(history)
    blocked = blocked_by_files(history)
    for stream in sorted(history.members):
        if stream not in known and stream not in blocked:
            out.append(f"unestablished: no relay ended with a configuration of {stream}")
    for key in sorted(history.finals):
        final = history.finals[key]
        if final.stream in blocked:
            continue
        settling = final.issued_ms < phase.safety_end_ms + phase.settle_ms
        if settling and final.outcome == REJECTED:
            continue  # a definite answer; see PhaseInfo.settle_ms
        if phase.safety_end_ms <= final.issued_ms < phase.liveness_end_ms and (
            final.outcome != COMMITTED
        ):
            out.append(
                f"not committed: {invariants.describe(final.tx)} to {final.stream} issued at "
                f"{final.issued_ms} ms (liveness phase) ended {final.outcome}"
            )
    bound = phase.safety_end_ms + phase.heal_bound_ms
    state: dict[tuple[int, str], tuple[int, bool, bool]] = {}  # last sample at or before bound
    late_bad: dict[tuple[int, str], int] = {}
    for s in history.fence_samples:
        ks = (s.relay, s.stream)
        if s.stream in blocked or s.relay not in members_of(history, s.stream, known):
            continue  # (a relay that ran it under a configuration that left it out)
        if s.t <= bound:
            state[ks] = (s.t, s.fenced, s.joined)
        elif (s.fenced or not s.joined) and ks not in late_bad:
            late_bad[ks] = s.t
    for ks in sorted(state):
        _, fenced, joined = state[ks]
        if fenced or not joined:
            what = "fenced" if fenced else "not joined"
            out.append(
                f"stuck: relay {ks[0]} still {what} on {ks[1]} at {bound} ms "
                f"({phase.heal_bound_ms} ms after healing)"
            )
    for ks in sorted(late_bad):
        if ks in state and (state[ks][1] or not state[ks][2]):
            continue  # already reported
        out.append(
            f"relapse: relay {ks[0]} fenced or unjoined on {ks[1]} at {late_bad[ks]} ms, "
            "after healing"
        )
    for stream in sorted(history.members):
        if stream in blocked:
            continue
        points: dict[int, int] = {}
        for relay in members_of(history, stream, known):
            rf = history.relay_finals.get(relay)
            if rf is None or not rf.up:
                out.append(f"down: relay {relay} is not up at the end")
                continue
            if rf.fenced.get(stream, False) or not rf.joined.get(stream, False):
                out.append(f"stuck: relay {relay} ends fenced or unjoined on {stream}")
            points[relay] = rf.committed_point.get(stream, -1)
        if len(set(points.values())) > 1:
            out.append(
                f"unsettled: members of {stream} end at different committed points "
                + ", ".join(f"{r}:{p}" for r, p in sorted(points.items()))
            )
    return sorted(set(out), key=out.index)


def spooled_acknowledged(history: History) -> list[str]:
    """Every COMMITTED answer is in some relay's spool (5.14), so the store can have it."""
    out: list[str] = []
    for key in sorted(history.finals):
        final = history.finals[key]
        if final.outcome != COMMITTED:
            continue
        if not any(final.seq in per.get(final.stream, ()) for per in history.spooled.values()):
            out.append(
                f"unspooled: {invariants.describe(final.tx)} committed at {final.stream} "
                f"seq {final.seq} is in no relay's spool"
            )
    return out


SAFETY_CHECKERS = (
    no_reorder_no_duplicate,
    timelines_agree,
    nothing_invented,
    no_rejected_delivered,
    committed_seq_matches,
    client_conclusions,
    spooled_acknowledged,
    one_configuration,
)


def check_all(history: History, phase: PhaseInfo) -> list[str]:
    out: list[str] = [f"anomaly: {a}" for a in history.anomalies]
    for checker in SAFETY_CHECKERS:
        out.extend(checker(history))
    if phase.check_liveness:
        out.extend(acknowledged_delivered(history))
        out.extend(liveness(history, phase))
        out.extend(blocked_streams(history))
    return out
