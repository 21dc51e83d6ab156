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
        topologies: str = "same",      # "same" | "stale" | "change" | "closed": the files
                                       # the relays read, and what the prefix does
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
  "change" all three read the file of "same", and the prefix is that of "same": the
           configuration (1, (0, 1, 2)) is established. Then each relay reads, once, a file
           in which relays 0 and 1 alone serve "s" (relay 2 keeps a pattern no stream
           matches): the explored action `reload r` (RelayCore.reload_topology with the new
           CoreConfig, as relay/sim/world.py `_reload` does), interleaved with everything
           else, so the change (1, (0, 1, 2)) -> (2, (0, 1)) (5.15 changes) is wanted and
           held back while a relay still reads the old file (`change_held_by`), proposed,
           decided by a quorum of the old relays, adopted, and relay 2 leaves the stream.
           Transaction k > 0 waits for k * (max_ticks // transactions) ticks of every
           relay, as in "stale", so that some come after the change and commit under
           version 2 (without the wait depth first produced all three before it, and
           nothing new committed under version 2). `reload r` comes right after `produce`
           in the order of actions, so depth first reads the files early and explores
           around the change; walks read them at random times. The change takes two or
           three ticks once every relay read its file: the default max_ticks will do.
  "closed" all three read {0: ("s*",), 1: ("s*",), 2: ("s*",)}: "s" is a pattern's stream.
           The prefix reads it through relay 0 at every step, which opens it there and,
           through relay 0's join, at relays 1 and 2; with `unread_stream_close_ms` at 40
           ms these close it again (5.11 closing: blank, joined, no read ever reached
           them), and the prefix ends once they did. The exploration then covers its first
           produces opening it again at relays 1 and 2, their joins next to relay 0's
           blank stream, the first view and the commits. Transactions are spread as in
           "stale"; commits need more ticks (about 24) than there.

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
  reload r        relay r reads its new topology file ("change" only; once per relay)
  step r +-       relay r's wall clock (sequence numbers) steps by clock_step_ms, forward or
                  back, apart from its monotonic clock (timers)  (at most max_clock_steps)

After every call into a core, `ready()` is drained by the shared loop of relay/core/shell.py
(`drain`, routing as above, each relay by the file it reads now): frames onto the links,
replies to the producers' bookkeeping, deliveries to the relay's consumer log. A relay that
does not hold the stream (not opened yet, or left) contributes no committed prefix to the
checks below; the reports it made before it left stay counted (as its log held them before
the step in which it left). Each report is tagged with the configuration it was made under
(a core reports only in `ready()`, under the configuration it then holds, which its Reports
state). The copies members issue for forwarded produces count as issued. Clocks are per
relay, so the safety checks also hold under skew (G4).

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
  * commits are real and never conflict, per configuration: for each configuration that
    can be established, no point has two digests each reported by a quorum of its relays
    under it (counting every report in the relays' report logs, delivered or not, with the
    configuration's quorum: 2 of relays 0-2, 2 of relays 0-1 in "stale"; in "change" both);
    the prefixes behind the digests quorums reported at successive points, under any of
    them, extend one another (each reported digest is mapped to the prefix it was computed
    over); each relay's committed and known-committed (point, digest) above genesis was
    reported by a quorum of one configuration under it; every relay committed past a
    quorum-reported point has that digest there.
  * and across configurations ("change"): counting every report each relay sent, under
    the configuration its Reports stated, void ones (5.12 step 5) included (section 6: no
    digest a view changes reaches a quorum, so none can back a conflict), no point has
    different digests each reported by a quorum of a configuration (of one or of two), and
    the prefixes behind the digests quorums of either reported extend one another.
  * configurations (5.15): no relay holds an established configuration (version >= 1)
    other than the ones the files can establish ((1, (0, 1, 2)); (1, (0, 1)) in "stale";
    (1, (0, 1, 2)) and (2, (0, 1)) in "change"), and no two relays hold different ones of
    one version (the one a relay left the stream under counted), so once anything
    committed every relay under an established configuration of that version holds that
    one; none that leaves a relay out is held by it, and a relay leaves the stream only
    under one that leaves it out; a relay that reported or committed past genesis holds
    one of them (a provisional relay reports nothing); a relay's established
    configuration changes only to a later version.
  * agreement ("stale", "change", "refile"): no view is decided twice with different
    values, also when nobody learnt one of them (section 6). Every acceptance any relay
    makes is kept (World.acceptances); a first view is decided once every one of its
    relays accepted it at one ballot, any other view once a quorum of the relays it was
    accepted under did.
    Where files differ or change, a proposer that ignored what its promisers accepted
    decides a second value that the other checks see only if a relay adopted the first.
    ("same" keeps no acceptances: its first view is decided in the prefix, and the
    acceptances would multiply its states.)
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
    each equals the reporter's own chain digest at that point, and its Reports state the
    version of the configuration it holds.

Not covered: crashes and restarts (incarnations; the relays keep no acceptor memory, so
no record binds a configuration), eviction and rebasing, transactions on more than one
stream (relay 2's "t" is only joined), clock refusals (steps are far below the bound).
Topology files changed during a run only as "change" does: one change that removes a
relay, in one step (held back, decided, adopted; with max_ticks=12 random walks also reach
a change deferred because too few of the new relays held the history after
`CHANGE_PROMISE_WAIT_MS`); not one that adds relays (steps, readmission, a relay joining
under the new configuration), a change made while a relay is down (no crashes here), nor
a file read again while a stream is provisional (`reprovision`). Forwarding is covered in
"stale" and "change" (relay 2's produces once it left; a member coordinating a forwarded
produce is reached in "stale" only), not in "same" (every relay is a member). Liveness
(that the change is made at all) is the simulator's to check (section 7): the explorer
checks safety only.

Scale. The interleavings of six FIFO links are genuinely concurrent: even one transaction
without faults or ticks has more than 10^5 distinct states, so realistic bounds are always
hit (about 2,000 distinct states per second). "dfs" goes deep along the first choices
(commits within the first few hundred states); "walk" samples the whole space and reaches
repairs, resets, late rejections and timeouts; "bfs" covers every short prefix. A partial
order reduction (sleep sets: actions on different cores commute) would cut the work per
state, not the number of states.

The modules: model.py (the world as a value, the setups, copying cores, fingerprints),
actions.py (enabled actions, applying one, the start state), checks.py (what is checked),
trace.py (describing and shrinking a violation's path), search.py (the strategies).
"""

from relay.sim.explore.model import EXPLORE_LIMITS
from relay.sim.explore.search import STRATEGIES, ExploreResult, Violation, run_explore

__all__ = ["EXPLORE_LIMITS", "STRATEGIES", "ExploreResult", "Violation", "run_explore"]
