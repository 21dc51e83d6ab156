"""What the explorer checks in every state it reaches: the shared invariants
(relay/sim/invariants.py) over the relays' committed prefixes, consumer logs and producer
answers; that commits are real and never conflict; and each core's internal consistency.
See the package docstring for the list."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping
from itertools import pairwise

from relay.core import digest as dg
from relay.core.machine import RelayCore
from relay.core.messages import Entry, Outcome, Transaction
from relay.core.seq import relay_of
from relay.core.state import GENESIS_POINT
from relay.core.timeline import Timeline
from relay.sim import invariants
from relay.sim.explore.model import RELAYS, STREAM, TXS, CoreInfo, Q, World


def digest_at(info: CoreInfo, point: int) -> bytes | None:
    """The relay's committed chain digest at `point` (<= its committed point)."""
    if point < info.base_point or point > info.committed_point:
        return None
    i = bisect_right(info.committed, point, key=lambda c: c[0])
    return info.committed[i - 1][2] if i else info.base_digest


def check_world(w: World, prefix_of: Mapping[bytes, tuple[Entry, ...]] | None = None) -> list[str]:
    """Cross-relay and client checks of one state."""
    p: list[str] = []
    infos = [c.info for c in w.cores]
    # G1 on the committed prefixes (skipped duplicates included) and on consumer logs.
    internal = {r: [(s, t) for s, t, _, _ in infos[r].committed] for r in RELAYS}
    cps = {r: infos[r].committed_point for r in RELAYS}
    bases = {r: infos[r].base_point for r in RELAYS}
    p += invariants.agree_over(internal, cps, bases, label="committed")
    p += invariants.agree_over(dict(enumerate(w.delivered)), cps, bases, label="consumer")
    for r in RELAYS:
        fresh = tuple((s, t) for s, t, _, skipped in infos[r].committed if not skipped)
        since = tuple(e for e in w.delivered[r] if e[0] > infos[r].base_point)
        if fresh != since:
            p.append(f"relay {r}: consumers received {since} but committed {fresh}")
        p += invariants.in_order(f"relay {r}'s consumers", STREAM, w.delivered[r], "received")
    # Nothing invented: every (seq, tx) anywhere is a copy some relay issued.
    issued: dict[int, Transaction] = {}
    for k, prod in enumerate(w.produced):
        if prod is not None and prod[1] >= 0:
            issued.setdefault(prod[1], TXS[k])
    for r in RELAYS:
        for s, t in infos[r].held:
            if issued.get(s) != t:
                p.append(f"invented: relay {r} holds ({s}, {invariants.describe(t)}), never issued")
    _check_commits(infos, prefix_of, p)
    _check_answers(w, infos, issued, p)
    return p


def _check_commits(
    infos: list[CoreInfo],
    prefix_of: Mapping[bytes, tuple[Entry, ...]] | None,
    p: list[str],
) -> None:
    """Commits are real (a quorum reported them) and never conflict."""
    voters: dict[int, dict[bytes, set[int]]] = {}
    for r in RELAYS:
        for point, d in infos[r].reports:  # every report of every relay is in its log
            voters.setdefault(point, {}).setdefault(d, set()).add(r)
    quorate: dict[int, bytes] = {}
    for point, by_digest in voters.items():
        won = [d for d, who in by_digest.items() if len(who) >= Q]
        if len(won) > 1:
            p.append(f"point {point}: {len(won)} different digests each reported by a quorum")
        if won:
            quorate[point] = won[0]
    for r in RELAYS:
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
    for k, answers in enumerate(w.replies):
        if len(answers) > 1:
            p.append(f"tx {k}: answered {len(answers)} times: {answers}")
        tx = TXS[k]
        key = invariants.key_of(tx)
        prod = w.produced[k]
        for outcome, seq in answers:
            if outcome == Outcome.COMMITTED.value:
                committed_seqs.setdefault(key, []).append(seq)
                for r in RELAYS:
                    if infos[r].committed_point >= seq >= infos[r].base_point:
                        got = dict(w.delivered[r]).get(seq)
                        if got is None or invariants.key_of(got) != key:
                            p.append(
                                f"tx {k}: told committed({seq}) but relay {r}, committed "
                                f"through {infos[r].committed_point}, delivered "
                                f"{invariants.describe(got) if got else 'nothing'} there"
                            )
            elif outcome == Outcome.REJECTED.value and prod is not None and prod[1] >= 0:
                for r in RELAYS:
                    if any(s == prod[1] for s, _, _, _ in infos[r].committed):
                        p.append(f"tx {k}: told rejected but relay {r} committed seq {prod[1]}")
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
    """One relay's internal invariants, and the info the other checks need."""
    p: list[str] = []
    st = core.streams[STREAM]
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
        counters=frozenset(k for k, v in core.counters.items() if v > 0),
        view=(st.view.number, st.view.start),
    )
    return info, p


def check_transition(rid: int, old: CoreInfo, new: CoreInfo) -> list[str]:
    p: list[str] = []
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
