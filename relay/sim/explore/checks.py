"""What the explorer checks in every state it reaches: the shared invariants
(relay/sim/invariants.py) over the relays' committed prefixes, consumer logs and producer
answers; that commits are real and never conflict, under each configuration and across
them; that only the configurations the files can establish are, and no two relays hold
different ones of one version (5.15); and each core's internal consistency. A relay that
does not hold the stream (not opened yet, or left) contributes no committed prefix; the
reports it made before it left stay counted under their configurations. See the package
docstring for the list."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise

import msgspec

from relay.core import digest as dg
from relay.core.machine import RelayCore
from relay.core.messages import Entry, Outcome, Transaction, ViewValue
from relay.core.quorum import quorum
from relay.core.seq import relay_of
from relay.core.state import GENESIS_POINT, Configuration
from relay.core.timeline import Timeline
from relay.sim import invariants
from relay.sim.explore.model import (
    ABSENT,
    RELAYS,
    SETUPS,
    STREAM,
    TXS,
    Acceptance,
    CoreInfo,
    Vote,
    World,
)


def digest_at(info: CoreInfo, point: int) -> bytes | None:
    """The relay's committed chain digest at `point` (<= its committed point)."""
    if point < info.base_point or point > info.committed_point:
        return None
    i = bisect_right(info.committed, point, key=lambda c: c[0])
    return info.committed[i - 1][2] if i else info.base_digest


def holders(infos: Sequence[CoreInfo]) -> list[int]:
    """The relays that hold the stream (opened it, and did not leave it)."""
    return [r for r in RELAYS if infos[r].config is not None]


def votes_of(info: CoreInfo) -> tuple[Vote, ...]:
    """The relay's reports, each with the configuration it was made under."""
    out: list[Vote] = []
    i = 0
    for config, count in info.report_configs:
        out += [(point, d, config) for point, d in info.reports[i : i + count]]
        i += count
    return tuple(out)


def can_be(allowed: Sequence[Configuration]) -> str:
    return " or ".join(str(c) for c in allowed)


def copies(w: World) -> dict[int, list[int]]:
    """tx -> the seqs of the copies issued for it: by the relay it was produced at, and by
    the members a relay that does not serve the stream forwarded it to."""
    out: dict[int, list[int]] = {}
    for k, prod in enumerate(w.produced):
        if prod is not None and prod[1] >= 0:
            out.setdefault(k, []).append(prod[1])
    for k, seq in w.forwarded:
        out.setdefault(k, []).append(seq)
    return out


def check_world(
    w: World,
    prefix_of: Mapping[bytes, tuple[Entry, ...]] | None = None,
    established: tuple[Configuration, ...] = SETUPS["same"].established,
) -> list[str]:
    """Cross-relay and client checks of one state; `established`: the configurations of
    the stream that can be established (the relays of each vote under it, by its
    quorum)."""
    p: list[str] = []
    infos = [c.info for c in w.cores]
    have = holders(infos)
    # G1 on the committed prefixes (skipped duplicates included) and on consumer logs; a
    # relay without the stream has no committed prefix, and its consumers' log is held to
    # the others' up to its last entry.
    internal = {r: [(s, t) for s, t, _, _ in infos[r].committed] for r in have}
    cps = {r: infos[r].committed_point for r in have}
    bases = {r: infos[r].base_point for r in have}
    p += invariants.agree_over(internal, cps, bases, label="committed")
    p += invariants.agree_over(dict(enumerate(w.delivered)), cps, bases, label="consumer")
    for r in have:
        fresh = tuple((s, t) for s, t, _, skipped in infos[r].committed if not skipped)
        since = tuple(e for e in w.delivered[r] if e[0] > infos[r].base_point)
        if fresh != since:
            p.append(f"relay {r}: consumers received {since} but committed {fresh}")
    for r in RELAYS:
        p += invariants.in_order(f"relay {r}'s consumers", STREAM, w.delivered[r], "received")
    # Nothing invented: every (seq, tx) anywhere is a copy some relay issued.
    issued: dict[int, Transaction] = {}
    for k, seqs in sorted(copies(w).items()):
        for seq in seqs:
            issued.setdefault(seq, TXS[k])
    for r in have:
        for s, t in infos[r].held:
            if issued.get(s) != t:
                p.append(f"invented: relay {r} holds ({s}, {invariants.describe(t)}), never issued")
    _check_configs(infos, established, p)
    votes = [w.left_votes[r] + votes_of(infos[r]) for r in RELAYS]
    _check_commits(infos, votes, prefix_of, established, p)
    if len(established) > 1:
        _check_across(w.sent_votes, prefix_of, established, p)
    _check_answers(w, infos, issued, p)
    _check_agreement(w.acceptances, p)
    return p


def decided(acceptances: Iterable[Acceptance]) -> dict[int, dict[bytes, tuple[int, list[int]]]]:
    """The values each instance decided, per the acceptances made (5.12, 5.15): a first
    view once every one of its relays accepted it at one ballot, any other view once a
    quorum of the relays it was accepted under did. View number -> value -> (the lowest
    ballot it was decided at, the relays that accepted it then)."""
    by_ballot: dict[tuple[int, int, bytes], list[Acceptance]] = {}
    for a in acceptances:
        by_ballot.setdefault((a.number, a.ballot, a.value), []).append(a)
    out: dict[int, dict[bytes, tuple[int, list[int]]]] = {}
    for (number, ballot, value), made in sorted(by_ballot.items()):
        relays = sorted(a.relay for a in made)  # (each once: actions._acceptances)
        view = msgspec.msgpack.decode(value, type=ViewValue)
        if view.config == 1 and number == 1:
            done = set(view.members) <= set(relays)
        else:
            done = any(
                len([a for a in made if a.under == under]) >= quorum(len(under[1]))
                for under in {a.under for a in made}
            )
        if done:
            out.setdefault(number, {}).setdefault(value, (ballot, relays))
    return out


def _check_agreement(acceptances: tuple[Acceptance, ...], p: list[str]) -> None:
    """One value per instance (5.12; for first views section 6, 5.15 establishment): also
    one that nobody learnt was decided."""
    for number, values in sorted(decided(acceptances).items()):
        if len(values) > 1:
            each = "; ".join(f"at ballot {b} by relays {rs}" for b, rs in sorted(values.values()))
            p.append(f"view {number} decided {len(values)} values: {each}")


def _check_configs(infos: list[CoreInfo], allowed: tuple[Configuration, ...], p: list[str]) -> None:
    """5.15: no relay holds an established configuration of the stream other than those
    the topologies can establish (with one, once anything committed every relay under an
    established configuration holds that one), and no two relays hold different ones of
    one version (counting the one a relay left the stream under); none that leaves a relay
    out is held by it (it stops serving the stream), and a relay leaves only under one that
    leaves it out; a relay has reported or committed past genesis only under one of them (a
    provisional relay reports nothing)."""
    can = can_be(allowed)
    held: dict[int, dict[Configuration, list[int]]] = {}  # version -> configuration -> relays
    for r in RELAYS:
        info = infos[r]
        if info.config is None:
            left = info.left_under
            if left is None:
                continue
            if left not in allowed:
                p.append(f"relay {r}: left {STREAM!r} under {left}, but only {can} can be")
            elif r in left[1]:
                p.append(f"relay {r}: left {STREAM!r} under {left}, which has it")
            held.setdefault(left[0], {}).setdefault(left, []).append(r)
            continue
        version, members = info.config
        if version > 0:
            held.setdefault(version, {}).setdefault(info.config, []).append(r)
        if version > 0 and info.config not in allowed:
            p.append(f"relay {r}: configuration {info.config} established, but only {can} can be")
        elif version > 0 and r not in members:
            p.append(f"relay {r}: holds configuration {info.config}, which leaves it out")
        elif info.config not in allowed and (info.committed_point > GENESIS_POINT or info.reports):
            what = "committed" if info.committed_point > GENESIS_POINT else "reported"
            p.append(f"relay {r}: {what} under configuration {info.config}, not {can}")
    for version, configs in sorted(held.items()):
        if len(configs) > 1:
            who = "; ".join(f"{c} by relays {rs}" for c, rs in sorted(configs.items()))
            p.append(f"two configurations of version {version} held: {who}")


def _check_commits(
    infos: list[CoreInfo],
    votes: list[tuple[Vote, ...]],
    prefix_of: Mapping[bytes, tuple[Entry, ...]] | None,
    allowed: tuple[Configuration, ...],
    p: list[str],
) -> None:
    """Commits are real (a quorum of the relays of a configuration that can be established
    reported them, under it) and never conflict: not within one configuration, nor across
    them (`votes`: per relay, the reports in its log, and those it made before it left the
    stream, each with the configuration it was made under)."""
    backed = quorums(allowed, votes)
    quorate: dict[int, bytes] = {}
    for point, under in backed.items():
        for config in allowed:
            won = sum(1 for cs in under.values() if config in cs)
            if won > 1:
                p.append(f"point {point}: {won} different digests each reported by a quorum")
        configs = {c for cs in under.values() for c in cs}
        if len(under) > 1 and len(configs) > 1:
            p.append(
                f"point {point}: {len(under)} different digests each reported by a quorum "
                f"of one of the configurations {can_be(sorted(configs))}"
            )
        quorate[point] = next(iter(under))
    for r in holders(infos):
        info = infos[r]
        for what, (point, d) in (
            ("committed", (info.committed_point, info.committed_digest)),
            ("known commit", info.known_commit),
        ):
            if point > GENESIS_POINT and d not in backed.get(point, ()):
                p.append(f"relay {r}: {what} {point} has a digest no quorum reported")
        for point, under in backed.items():
            mine = digest_at(info, point)
            if mine is not None and mine not in under:
                d = next(iter(under))
                p.append(
                    f"relay {r}: committed past {point} with digest {mine.hex()[:8]} "
                    f"but a quorum reported {d.hex()[:8]} there"
                )
    # The prefixes behind the digests a quorum reported (at any points, delivered anywhere
    # or not, under any configuration) extend one another.
    if prefix_of is not None:
        chain = sorted(quorate.items())
        for (p1, d1), (p2, d2) in pairwise(chain):
            e1, e2 = prefix_of.get(d1), prefix_of.get(d2)
            if e1 is None or e2 is None:
                p.append(f"no prefix known for a digest reported at {p1} or {p2}")
            elif tuple(e for e in e2 if e[0] <= p1) != e1:
                p.append(
                    f"conflicting commits: the prefix a quorum reported at {p2} differs "
                    f"at or below {p1} from the one a quorum reported there"
                )


def quorate_under(
    config: Configuration, votes: Sequence[tuple[Vote, ...]]
) -> dict[int, list[bytes]]:
    """point -> the digests a quorum of `config`'s relays reported there, under it."""
    voters: dict[int, dict[bytes, set[int]]] = {}
    for r in config[1]:
        for point, d, made_under in votes[r]:
            if made_under == config:
                voters.setdefault(point, {}).setdefault(d, set()).add(r)
    q = quorum(len(config[1]))
    out: dict[int, list[bytes]] = {}
    for point, reporters in voters.items():
        won = [d for d, who in reporters.items() if len(who) >= q]
        if won:
            out[point] = won
    return out


def quorums(
    allowed: tuple[Configuration, ...], votes: Sequence[tuple[Vote, ...]]
) -> dict[int, dict[bytes, list[Configuration]]]:
    """point -> digest -> the configurations a quorum of whose relays reported it there,
    under it."""
    backed: dict[int, dict[bytes, list[Configuration]]] = {}
    for config in allowed:
        for point, digests in quorate_under(config, votes).items():
            for d in digests:
                backed.setdefault(point, {}).setdefault(d, []).append(config)
    return backed


def _check_across(
    sent: Sequence[tuple[Vote, ...]],
    prefix_of: Mapping[bytes, tuple[Entry, ...]] | None,
    allowed: tuple[Configuration, ...],
    p: list[str],
) -> None:
    """Commits never conflict across configurations (5.15 changes, section 6), counting
    every report each relay sent (`sent`), under the configuration its Reports stated,
    void ones included (section 6: no digest a view changes reaches a quorum, so none of
    them can back a conflict): no point has different digests each reported by a quorum
    of a configuration, and the prefixes behind the digests quorums reported, under any
    of them, extend one another (checked between successive points: extending is
    transitive)."""
    backed = quorums(allowed, sent)
    for point, under in backed.items():
        if len(under) > 1:
            who = "; ".join(f"{d.hex()[:8]} by {can_be(cs)}" for d, cs in under.items())
            p.append(f"point {point}: different digests each reported by a quorum: {who}")
    if prefix_of is None:
        return
    chain = sorted((point, d, under[d]) for point, under in backed.items() for d in under)
    for (p1, d1, c1), (p2, d2, c2) in pairwise(chain):
        e1, e2 = prefix_of.get(d1), prefix_of.get(d2)
        if e1 is None or e2 is None:
            p.append(f"no prefix known for a digest reported at {p1} or {p2}")
        elif p1 < p2 and tuple(e for e in e2 if e[0] <= p1) != e1:
            p.append(
                f"conflicting commits across configurations: the prefix a quorum of "
                f"{can_be(c2)} reported at {p2} differs at or below {p1} from the one a "
                f"quorum of {can_be(c1)} reported there"
            )


def _check_answers(
    w: World, infos: list[CoreInfo], issued: dict[int, Transaction], p: list[str]
) -> None:
    """G3: one answer per request; committed answers name the copy every relay committed
    past them delivered there; a rejected copy is in no committed prefix."""
    committed_seqs: dict[invariants.Key, list[int]] = {}
    have = holders(infos)
    issued_for = copies(w)
    for k, answers in enumerate(w.replies):
        if len(answers) > 1:
            p.append(f"tx {k}: answered {len(answers)} times: {answers}")
        tx = TXS[k]
        key = invariants.key_of(tx)
        for outcome, seq in answers:
            if outcome == Outcome.COMMITTED.value:
                committed_seqs.setdefault(key, []).append(seq)
                for r in have:
                    if infos[r].committed_point >= seq > infos[r].base_point:
                        got = dict(w.delivered[r]).get(seq)
                        if got is None or invariants.key_of(got) != key:
                            p.append(
                                f"tx {k}: told committed({seq}) but relay {r}, committed "
                                f"through {infos[r].committed_point}, delivered "
                                f"{invariants.describe(got) if got else 'nothing'} there"
                            )
            elif outcome == Outcome.REJECTED.value:
                for r in have:
                    for copy in issued_for.get(k, ()):
                        if any(s == copy for s, _, _, _ in infos[r].committed):
                            p.append(f"tx {k}: told rejected but relay {r} committed seq {copy}")
    for key, seqs in committed_seqs.items():
        tx = next(t for t in TXS if invariants.key_of(t) == key)
        name = invariants.describe(tx)
        p += invariants.committed_answers(name, tx, seqs, issued, must_hold=True)


def chain(base: bytes, entries: Iterable[tuple[int, bytes]]) -> list[bytes]:
    out = []
    prev = base
    for seq, h in entries:
        prev = dg.chain(prev, seq, h)
        out.append(prev)
    return out


def chain_at(tl: Timeline, point: int) -> bytes | None:
    """The digest at `point` recomputed from the base, ignoring every cache."""
    if not tl.has_base or point < tl.base_point:
        return None
    h = tl.head
    entries = [
        (s, dg.tx_hash(t)) for s, t in zip(tl.seqs[h:], tl.txs[h:], strict=True) if s <= point
    ]
    digests = chain(tl.base_digest, entries)
    return digests[-1] if digests else tl.base_digest


def inspect_core(core: RelayCore, rid: int) -> tuple[CoreInfo, list[str]]:
    """One relay's internal invariants, and the info the other checks need (`ABSENT`'s,
    with its floor, if it does not hold the stream)."""
    p: list[str] = []
    st = core.streams.get(STREAM)
    counters = frozenset(k for k, v in core.counters.items() if v > 0)
    if st is None:
        return ABSENT._replace(
            floor=core.clock.floor,
            counters=counters,
            serves=core.serves(STREAM),
            left_under=core.foreign.get(STREAM),
        ), p
    tl = st.timeline
    h = tl.head
    if not (len(tl.seqs) == len(tl.txs) == len(tl.hashes) == len(tl.skip)):
        p.append(f"relay {rid}: timeline lists of different lengths")
    seqs, txs = tl.seqs[h:], tl.txs[h:]
    for a, b in pairwise(seqs):
        if b <= a:
            p.append(f"relay {rid}: timeline seq {b} after {a}")
            break
    hashes = [dg.tx_hash(t) for t in txs]
    if hashes != tl.hashes[h:]:
        p.append(f"relay {rid}: cached content hash wrong")
    digests = chain(tl.base_digest, zip(seqs, hashes, strict=True))
    upto = min(tl.digested, len(tl.digests))
    if tl.digested > len(tl.digests):
        p.append(f"relay {rid}: digested={tl.digested} but {len(tl.digests)} digests")
    if tl.digests[h:upto] != digests[: max(upto - h, 0)]:
        p.append(f"relay {rid}: cached digests disagree with the recomputed chain")
    cp = tl.committed_point
    end = bisect_right(seqs, cp)
    committed = tuple((seqs[i], txs[i], digests[i], tl.skip[h + i]) for i in range(end))
    if tl.has_base:
        if not tl.base_point <= cp <= tl.reported:
            p.append(
                f"relay {rid}: base {tl.base_point} <= committed {cp} <= reported "
                f"{tl.reported} fails"
            )
        if st.known_commit[0] < cp:
            p.append(f"relay {rid}: known commit {st.known_commit[0]} below committed {cp}")
        if tl.delivered != h + end:
            p.append(
                f"relay {rid}: delivered index {tl.delivered}, committed prefix ends {h + end}"
            )
        want = digests[end - 1] if end else tl.base_digest
        if tl.committed_digest != want:
            p.append(f"relay {rid}: committed digest is not the chain digest at {cp}")
        if tl.base_point == GENESIS_POINT:
            seen: dict[tuple[bytes, int], tuple[int, bytes]] = {}
            for seq, tx, _, skipped in committed:
                key = (tx.producer_id, tx.producer_seq)
                if skipped != (key in seen):
                    p.append(f"relay {rid}: skip flag of {seq} is {skipped}")
                seen.setdefault(key, (seq, dg.tx_hash(tx)))
            if tl.dedupe.keys() != tuple((*k, *first) for k, first in seen.items()):
                p.append(f"relay {rid}: dedupe window differs from the committed prefix")
    if any(tl.skip[h + end :]):
        p.append(f"relay {rid}: an uncommitted entry is marked skipped")
    for seq in st.pending.by_seq:
        if seq <= cp or relay_of(seq) != rid:
            p.append(f"relay {rid}: pending produce at {seq}, committed {cp}")
    if {v: k for k, v in st.pending.by_key.items()} != {
        seq: pending.key for seq, pending in st.pending.by_seq.items()
    }:
        p.append(f"relay {rid}: pending maps disagree")
    held = tuple(zip(seqs, txs, strict=True)) + tuple(tl.late.items())
    info = CoreInfo(
        committed_point=cp,
        committed_digest=tl.committed_digest,
        reported=tl.reported,
        floor=core.clock.floor,
        base_point=tl.base_point,
        base_digest=tl.base_digest,
        known_commit=st.known_commit,
        committed=committed,
        held=held,
        reports=tuple(st.report_log),
        fenced=st.fenced,
        counters=counters,
        view=(st.view.number, st.view.start),
        config=st.configuration,
        serves=core.serves(STREAM),
        change_held=bool(core.change_held_by(STREAM)),
    )
    return info, p


def check_transition(rid: int, old: CoreInfo, new: CoreInfo) -> list[str]:
    """What may not go back across one step of the relay (its floor; and, while it holds
    the stream before and after, its configuration's version (an established one changes
    only to a later version), its committed point and prefix, its report log)."""
    p: list[str] = []
    if old.config is None or new.config is None:
        if new.floor < old.floor:
            p.append(f"relay {rid}: floor went back from {old.floor} to {new.floor}")
        return p
    if new.config != old.config and (
        new.config[0] < old.config[0] or new.config[0] == old.config[0] > 0
    ):
        p.append(f"relay {rid}: configuration went from {old.config} to {new.config}")
    for name in ("committed_point", "reported", "floor"):
        if getattr(new, name) < getattr(old, name):
            p.append(
                f"relay {rid}: {name} went back from {getattr(old, name)} to {getattr(new, name)}"
            )
    if new.committed[: len(old.committed)] != old.committed and new.base_point == old.base_point:
        p.append(f"relay {rid}: committed prefix rewritten")
    if new.reports[: len(old.reports)] != old.reports and not _voided_by_view(old, new):
        p.append(f"relay {rid}: report log rewritten")
    return p


def _voided_by_view(old: CoreInfo, new: CoreInfo) -> bool:
    """The report log lost its tail because the relay adopted a view that changed its
    prefix there (5.12 step 5, rule 4(c) of section 6): allowed only for reports above
    the view's start, which no commit can contain."""
    if new.view[0] <= old.view[0]:
        return False
    kept = 0
    for before, after in zip(old.reports, new.reports, strict=False):
        if before != after:
            break
        kept += 1
    return all(point > new.view[1] for point, _ in old.reports[kept:])
