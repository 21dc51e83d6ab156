"""What the explorer checks in every state it reaches: the shared invariants
(relay/sim/invariants.py) over the relays' committed prefixes, consumer logs and producer
answers; that commits are real and never conflict; that only the one configuration that
can be established is (5.15); and each core's internal consistency. A relay that does not
hold the stream (not opened yet, or left) contributes no committed prefix and no reports.
See the package docstring for the list."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise

from relay.core import digest as dg
from relay.core.machine import RelayCore
from relay.core.messages import Entry, Outcome, Transaction
from relay.core.quorum import quorum
from relay.core.seq import relay_of
from relay.core.state import GENESIS_POINT, Configuration
from relay.core.timeline import Timeline
from relay.sim import invariants
from relay.sim.explore.model import ABSENT, RELAYS, SETUPS, STREAM, TXS, CoreInfo, World


def digest_at(info: CoreInfo, point: int) -> bytes | None:
    """The relay's committed chain digest at `point` (<= its committed point)."""
    if point < info.base_point or point > info.committed_point:
        return None
    i = bisect_right(info.committed, point, key=lambda c: c[0])
    return info.committed[i - 1][2] if i else info.base_digest


def holders(infos: Sequence[CoreInfo]) -> list[int]:
    """The relays that hold the stream (opened it, and did not leave it)."""
    return [r for r in RELAYS if infos[r].config is not None]


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
    established: Configuration = SETUPS["same"].established,
) -> list[str]:
    """Cross-relay and client checks of one state; `established`: the only configuration
    of the stream that can be established (its relays vote, by its quorum)."""
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
    _check_commits(infos, prefix_of, established, p)
    _check_answers(w, infos, issued, p)
    return p


def _check_configs(infos: list[CoreInfo], established: Configuration, p: list[str]) -> None:
    """5.15: no relay holds an established configuration of the stream other than the one
    the topologies can establish (so once anything committed, every relay under an
    established configuration holds that one), and none that leaves it out holds the
    stream under it (it stops serving the stream); a relay has reported or committed past
    genesis only under it (a provisional relay reports nothing)."""
    for r in holders(infos):
        info = infos[r]
        assert info.config is not None
        version, members = info.config
        if version > 0 and info.config != established:
            p.append(
                f"relay {r}: configuration {info.config} established, but only {established} can be"
            )
        elif version > 0 and r not in members:
            p.append(f"relay {r}: holds configuration {info.config}, which leaves it out")
        elif info.config != established and (info.committed_point > GENESIS_POINT or info.reports):
            what = "committed" if info.committed_point > GENESIS_POINT else "reported"
            p.append(f"relay {r}: {what} under configuration {info.config}, not {established}")


def _check_commits(
    infos: list[CoreInfo],
    prefix_of: Mapping[bytes, tuple[Entry, ...]] | None,
    established: Configuration,
    p: list[str],
) -> None:
    """Commits are real (a quorum of the established configuration's relays reported them)
    and never conflict."""
    voters: dict[int, dict[bytes, set[int]]] = {}
    relays = established[1]
    q = quorum(len(relays))
    for r in relays:
        for point, d in infos[r].reports:  # every report of every relay is in its log
            voters.setdefault(point, {}).setdefault(d, set()).add(r)
    quorate: dict[int, bytes] = {}
    for point, by_digest in voters.items():
        won = [d for d, who in by_digest.items() if len(who) >= q]
        if len(won) > 1:
            p.append(f"point {point}: {len(won)} different digests each reported by a quorum")
        if won:
            quorate[point] = won[0]
    for r in holders(infos):
        info = infos[r]
        for what, (point, d) in (
            ("committed", (info.committed_point, info.committed_digest)),
            ("known commit", info.known_commit),
        ):
            if point > GENESIS_POINT and quorate.get(point) != d:
                p.append(f"relay {r}: {what} {point} has a digest no quorum reported")
        for point, d in quorate.items():
            mine = digest_at(info, point)
            if mine is not None and mine != d:
                p.append(
                    f"relay {r}: committed past {point} with digest {mine.hex()[:8]} "
                    f"but a quorum reported {d.hex()[:8]} there"
                )
    # The prefixes behind the digests a quorum reported (at any points, delivered anywhere
    # or not) extend one another.
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
                    if infos[r].committed_point >= seq >= infos[r].base_point:
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
            floor=core.clock.floor, counters=counters, serves=core.serves(STREAM)
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
    )
    return info, p


def check_transition(rid: int, old: CoreInfo, new: CoreInfo) -> list[str]:
    """What may not go back across one step of the relay (its floor; and, while it holds
    the stream before and after, its committed point and prefix, its report log)."""
    p: list[str] = []
    if old.config is None or new.config is None:
        if new.floor < old.floor:
            p.append(f"relay {rid}: floor went back from {old.floor} to {new.floor}")
        return p
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
