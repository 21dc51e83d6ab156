"""A bounded exhaustive model checker of the real protocol core (safety only).

The entry point (`relay explore` passes its options):

    run_explore(
        max_states: int = 20_000,      # distinct states to discover before stopping
        transactions: int = 3,         # produces the clients make (0..3, see TXS)
        max_drops: int = 2,            # frames the network may lose in one run
        *,
        max_dups: int = 1,             # frames the network may duplicate in one run
        max_ticks: int = 6,            # clock steps per relay (each one calls tick())
        tick_ms: int = 10,             # length of one clock step
        max_skew_ticks: int = 2,       # no relay ticks further ahead of the slowest one
        max_depth: int = 400,          # actions on one path (walks end by ~250)
        max_clock_steps: int = 0,      # wall clock steps (+-clock_step_ms) in one run
        clock_step_ms: int = 25,
        strategy: str = "dfs",         # "dfs" | "bfs" | "random" (dfs, seeded successor
                                       # order) | "walk" (seeded random walks, sampling)
        seed: int = 0,                 # for "random" and "walk"
        time_budget_s: float | None = None,
        limits: Limits | None = None,  # default: EXPLORE_LIMITS (small timeouts)
        stop_on_violation: bool = True,
        progress: Callable[[str], None] | None = None,
        core_class: type[RelayCore] = RelayCore,  # a subclass plants bugs (tests)
        shrink: bool = True,           # shorten a violation's trace (greedy, <= 30 s)
        topologies: str = "same",      # "same" | "stale": the files the relays read
    ) -> ExploreResult   # .summary() prints the statistics; .ok

What is explored. Each relay reads its own topology file (model.SETUPS):

  "same"   all three read {0: ("s",), 1: ("s",), 2: ("s",)}. A deterministic prefix (tick
           everyone every `tick_ms`, deliver every frame at once) runs until all three
           joined stream "s", are unfenced and the network is quiet: the first view is
           decided and the configuration (1, (0, 1, 2)) established before exploring.
  "stale"  relays 0 and 1 read {0: ("s*",), 1: ("s*",), 2: ("t",)}, relay 2 reads
           {0: ("s*",), 1: ("s*",), 2: ("s*", "t")} (5.15: a file not yet rolled out, or
           stale). The prefix runs until relay 2 joined its own stream "t" and the network
           is quiet; "s", a pattern's stream, exists nowhere yet. So the exploration covers
           its opening on first use (a produce, answered `fenced`), the joins under
           configurations that disagree, the first view that establishes (1, (0, 1))
           (decided only with the acceptances of both), relay 2 learning that
           configuration and leaving the stream (`RelayCore.foreign`), and its produces
           then forwarded to relays 0 and 1 (5.1). A produce at relay 2 before
           relays 0 or 1 used "s" leaves the stream unestablished (no view is wanted where
           it is not in use, 5.12; fenced `config_mismatch` at relay 2). Transaction k > 0
           is produced only once every relay ticked k * (max_ticks // transactions) times,
           as a client's retries come after a backoff: at any time, all three were spent
           (fenced) before the first view could be decided. Give it more ticks than the
           default (max_ticks=12: joining and the first view take about three).

Frames are routed as the node's topics route them (relay/sim/script.py,
`Mesh.subscribers`): a stream's frame goes to every other relay whose own topology or
whose configuration (`RelayCore.serves`) serves the stream, targeted and mesh-wide ones
as `recipients` says; each only to relays whose topology lists the sender. From the start
state every interleaving of these actions is explored, within the bounds:

  produce k at r  the next transaction (in TXS order) is produced at relay r; TXS[2] is a
                  retry of TXS[0] (same producer id and sequence), to exercise dedupe; at
                  a relay that does not serve the stream it is forwarded to a member
  deliver a->b    the head frame of link a->b is received by b (links are FIFO)
  drop a->b       the head frame of link a->b is lost          (at most max_drops)
  dup a->b        the head frame of link a->b is duplicated    (at most max_dups)
  tick r          relay r's clock advances tick_ms and tick() runs (max_ticks, max_skew)
  step r +-       relay r's wall clock (sequence numbers) steps by clock_step_ms, forward or
                  back, apart from its monotonic clock (timers)  (at most max_clock_steps)

After every call into a core, `ready()` is drained by the shared loop of relay/core/shell.py
(`drain`, routing as above): frames onto the links, replies to the producers' bookkeeping,
deliveries to the relay's consumer log. A relay that does not hold the stream (not opened
yet, or left) contributes no committed prefix and no reports to the checks below; the
copies members issue for forwarded produces count as issued. Clocks are per relay, so the
safety checks also hold under skew (G4).

States are deduplicated by a fingerprint: each core is pickled (its shared, constant config
and its diagnostics counters detached: the protocol never reads them) and the state hashes
the cores' pickles with the links, clocks and client bookkeeping (blake2b). Equal
fingerprints mean equal states, so deduplication never merges different states; equal
states reached along different paths could in principle pickle differently (dict order,
object sharing), which only costs repeated work (on a 100k-state run a canonical field-by-
field walk merged exactly as many states, at 1.4x the cost). Cores are copied by a pickle
round trip; a successor only re-pickles the one core its action touched.

Checked in every state (checks.py: the shared invariants of relay/sim/invariants.py, and
`inspect_core`, `check_world`, `check_transition`):

  * G1: the committed prefixes of any two relays agree up to the lower committed point
    (same seqs, same transactions, nothing missing); seqs strictly increase; the consumer
    log of each relay is exactly its committed prefix without skipped duplicates; no
    producer key (pid, pseq) is delivered twice on a relay.
  * nothing invented: every held, late or delivered (seq, tx) is a copy some relay issued.
  * commits are real and never conflict: no point has two digests each reported by a
    quorum (counting every report made, delivered or not, by the relays of the one
    configuration that can be established, with its quorum: 2 of relays 0-2, or 2 of
    relays 0-1 in "stale"); the prefixes behind the digests quorums reported at successive
    points extend one another (each reported digest is mapped to the prefix it was
    computed over); each relay's committed and known-committed (point, digest) above
    genesis was reported by a quorum; every relay committed past a quorum-reported point
    has that digest there.
  * configurations (5.15): no relay holds an established configuration (version >= 1)
    other than the one the files can establish ((1, (0, 1, 2)), or (1, (0, 1)) in
    "stale"), so once anything committed every established relay holds that one; none it
    leaves out holds the stream under it; a relay that reported or committed past genesis
    holds it (a provisional relay reports nothing).
  * G3: a producer gets at most one answer per request; `committed(seq)` names a copy of
    its own transaction, every relay committed past seq delivered that transaction at seq,
    and all committed answers for one key name the same seq; `rejected` copies are in no
    relay's committed prefix.
  * per relay: base <= committed <= reported, committed <= known commit; committed digest
    = the chain recomputed from the base; cached digests and content hashes are right;
    delivered index and dedupe skip flags match the committed prefix; pending produces lie
    above the committed point and their key maps agree.
  * per transition: committed point, reported point, clock floor never decrease, the
    committed prefix only grows (never rewritten), the report log is append-only; every
    outgoing frame decodes, is routed as its type requires, carries a non-decreasing floor;
    every transaction it issues lies above every floor it announced before; reports
    strictly increase, lie above every votes_final_through promise it announced before,
    and each equals the reporter's own chain digest at that point.

Not covered: crashes and restarts (incarnations; the relays keep no acceptor memory, so
no record binds a configuration), eviction and rebasing, transactions on more than one
stream (relay 2's "t" is only joined), topology files changed during a run, clock refusals
(steps are far below the bound). Forwarding is covered in "stale" only (in "same" every
relay is a member).

Scale. The interleavings of six FIFO links are genuinely concurrent: even one transaction
without faults or ticks has more than 10^5 distinct states, so realistic bounds are always
hit (about 2,000 distinct states per second). "dfs" goes deep along the first choices
(commits within the first few hundred states); "walk" samples the whole space and reaches
repairs, resets, late rejections and timeouts; "bfs" covers every short prefix. A partial
order reduction (sleep sets: actions on different cores commute) would cut the work per
state, not the number of states.

The modules: model.py (the world as a value, copying cores, fingerprints), actions.py
(enabled actions, applying one, the start state), checks.py (what is checked), trace.py
(describing and shrinking a violation's path), search.py (the strategies).
"""

from relay.sim.explore.model import EXPLORE_LIMITS
from relay.sim.explore.search import STRATEGIES, ExploreResult, Violation, run_explore

__all__ = ["EXPLORE_LIMITS", "STRATEGIES", "ExploreResult", "Violation", "run_explore"]
