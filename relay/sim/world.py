"""A deterministic simulated mesh: relays (RelayCore with its ClientService), a faulty
network between them, and clients on the real client engines (relay/sim/clients.py).

Everything follows from one integer seed through `random.Random` instances. Time is integer
milliseconds from 0. Each millisecond: apply due fault events, deliver due peer frames,
deliver due client frames (requests to each relay's client service, responses and lost
connections to the clients), let the clients act, then tick every running relay that was
fed input FED_TICK_MS ago or whose next deadline came (as the node does), and drain the
`ready()` of every relay fed input or ticked through the shared loop of
relay/core/shell.py (frames into the network, answers and deliveries to its client
service, deliveries into the history), and let the
client service expire and flush. Client links are FIFO, take CLIENT_LINK_MS each way and
lose nothing; a relay that crashes closes them (after what it sent), one that is paused
queues what arrives.

Each relay reads its own topology file (`Node.config`): the seed's (relay/sim/topologies.py),
or another one the retopology and stale faults give it (5.15). A stream's frames reach, as
the node's subscriptions do, every other relay whose own file serves the stream or whose
running core does (by the configuration its acceptor records keep); any frame reaches only
relays whose file lists its sender. The clients read the seed's topology.

Phases: safety (faults on), then heal (partitions and pauses end, crashed relays restart,
clocks stop stepping but keep their skew), liveness (no faults, producers continue), quiet
(producers stop issuing; their in-flight retries end halfway through), then the checkers.
"""

from __future__ import annotations

import heapq
import random
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relay.core import memory
from relay.core.config import CoreConfig, Limits, Topology
from relay.core.machine import RelayCore
from relay.core.quorum import quorum
from relay.core.shell import (
    FED_TICK_MS,
    NO_FED_TICK,
    Delivery,
    Outgoing,
    ProduceReply,
    drain,
    recipients,
)
from relay.core.state import PROVISIONAL, Configuration
from relay.engines import Relays
from relay.service import ClientService
from relay.sim.clients import Consumer, Producer, endpoint_of
from relay.sim.faults import (
    MAX_SKEW_MS,
    MAX_STEP_MS,
    MAX_TOTAL_OFFSET_MS,
    RECONFIGURE_STAGGER_MS,
    RETIRE_CHANCE,
    RETIRE_MIN_RELAYS,
    RETIRE_REMOVE_AFTER_MS,
    RETIRE_START_FRACTION,
    RETOPOLOGY_BACK_CHANCE,
    RETOPOLOGY_DOWN_MS,
    FaultConfig,
)
from relay.sim.history import FenceSample, History, PhaseInfo, RelayFinal
from relay.sim.network import CLOSED, NetParams, Network, subscribers
from relay.sim.single import (
    CLOCK_STEP_MS,
    CRASH_AFTER_CUT_MS,
    ROLL_STEP_MS,
    SingleFaultInfo,
    strongly_connected,
)
from relay.sim.spools import SimSpool
from relay.sim.topologies import (
    alternate_topology,
    build_topology,
    describe,
    grown_topology,
    retired_topology,
)

BASE_UNIX_MS = 1_750_000_000_000  # the simulation's time 0, before the per-seed offset
CLIENT_LINK_MS = 1  # one way on a client link (clients and relays on one host)
REQUEST, RESPONSE, DISCONNECT = 0, 1, 2  # what a client link carries
FENCE_SAMPLE_EVERY_MS = 5
# retire: how often the world, as each node does, has the relays forget the removed one
FORGET_EVERY_MS = 100
# Lulls: every producer stops issuing for a while, so the mesh goes quiet (5.11) and must
# wake up. A random run has one in its safety phase with LULL_CHANCE; a single-fault run
# of an odd seed has one from SINGLE_LULL_BEFORE_MS before its fault to
# SINGLE_LULL_AFTER_MS after it (the fault strikes a quiet mesh).
LULL_CHANCE = 0.5
LULL_MS = (1_200, 2_000)  # longer than quiet_after_ms with the default limits
SINGLE_LULL_BEFORE_MS = 1_800
SINGLE_LULL_AFTER_MS = 200
# `a.late` is read from the start and written only from LATE_FROM_MS on: until then it is
# blank, and its members that no read reaches close it (5.11 closing). Early enough that
# its first view is decided before a single-fault run's lull and fault (its warm-up
# writes for 800 ms, relay/sim/runner.py): a stream first written while a member is down
# waits for it (5.15).
LATE_STREAM = "a.late"
LATE_FROM_MS = 400
STREAMS = ("all", "a.one", "a.two", "b.one", "c.one", LATE_STREAM)
# 5.11 closing: far shorter than the defaults, so that blank streams close within a run
SIM_IDLE_STREAM_CLOSE_MS = 300
SIM_UNREAD_STREAM_CLOSE_MS = 150
# spool_full faults: how long a spool stays full, and the room it is left beyond what its
# relay owes for its votes
SPOOL_FULL_MS = (100, 1_500)
SPOOL_FULL_EXTRA_BYTES = (0, 3_000)


CoreFactory = Callable[[CoreConfig, int, int], RelayCore]  # (config, incarnation, now_ms)


class SimError(Exception):
    """The core raised while the world drove it; the message says when and where."""


@dataclass
class Node:
    rid: int
    config: CoreConfig
    core: RelayCore | None = None
    service: ClientService | None = None  # the client protocol's side of this relay
    incarnation: int = 1
    restarts: int = 0
    epoch: int = 0  # grows at every crash; frames addressed to an older epoch are discarded
    paused_until: int = -1  # >= 0 while paused
    # What arrived while paused: (sender, frame) from a peer (frame CLOSED: the sender's
    # connection closed) or (None, (client, frame)) from a client.
    inbox: list[tuple[int | None, Any]] = field(default_factory=list)
    counters: Counter[str] = field(default_factory=Counter)  # the client service's
    # The relay's disk, which a crash keeps: its acceptor memory per stream (5.12).
    disk: dict[str, bytes] = field(default_factory=dict)
    skew: int = 0
    step: int = 0
    # the simulation's streams this relay serves: by its running core's configurations
    # (5.15: its acceptor records, else its topology), as of its last start or sample
    streams: tuple[str, ...] = ()
    # Input reached the core this millisecond: its ready() is drained now, and it is ticked
    # within FED_TICK_MS (at fed_tick_due), or by its deadline, as the node does.
    fed: bool = False
    fed_tick_due: int = NO_FED_TICK
    spool: SimSpool = field(default_factory=SimSpool)  # kept across crashes, like a disk
    spool_anomaly: bool = False  # a broken spool promise was reported already
    # Relays its file no longer lists whose link it kept (removed from the mesh while a
    # stream still counts them: node `_forget_peers`); a restart knows only its file
    kept_links: set[int] = field(default_factory=set)

    def listens_to(self, src: int) -> bool:
        """Whether it has a link from relay `src`: its file lists it, or it kept it."""
        return src in self.config.topology.subscriptions or src in self.kept_links


def configuration_of(core: RelayCore, stream: str) -> Configuration:
    """The configuration (version, relays) the relay runs the stream under, or would if it
    opened it now (5.15): its own, one learnt that leaves it out, its acceptor record's,
    else provisional: its topology's."""
    st = core.streams.get(stream)
    if st is not None:
        return st.configuration
    known = core.foreign.get(stream) or core.recorded.get(stream)
    return known if known is not None else (PROVISIONAL, core.topology.members(stream))


def _ignore(*_: object) -> None:
    """The simulator keeps no log: what a relay would warn about is in its counters."""


class _WorldSink:
    """Where one relay's `Ready` goes: frames into the network, replies to the producers,
    deliveries and rebases into the history."""

    def __init__(self, world: World, node: Node) -> None:
        self.world = world
        self.node = node

    def persist(self, records: list[tuple[str, bytes]]) -> None:
        self.node.disk.update(records)

    def publish(self, out: Outgoing) -> None:
        world = self.world
        src = self.node.rid
        nodes = world.nodes
        targets = (
            subscribers(nodes, src, out.stream)
            if out.stream is not None
            else recipients(out, world.topology, src)
        )
        for d in targets:
            node = nodes[d]
            if node.listens_to(src):  # it subscribes to the relays it lists (or kept)
                world.network.send(world.now, src, d, out.frame, node.epoch)

    def answer(self, replies: list[ProduceReply]) -> None:
        service = self.node.service
        assert service is not None
        service.on_replies(replies)

    def rebase(self, stream: str, point: int) -> None:
        world, node = self.world, self.node
        world.history.record_rebase(node.rid, node.incarnation, stream)
        world.events.append(f"{world.now} rebase {node.rid}/{node.incarnation} {stream} {point}")
        assert node.service is not None
        node.service.wake(stream)

    def closed(self, stream: str) -> None:
        world, node = self.world, self.node
        world.events.append(f"{world.now} closed {node.rid}/{node.incarnation} {stream}")
        assert node.service is not None
        node.service.closed(stream)

    def deliver(self, delivery: Delivery) -> None:
        world, node = self.world, self.node
        assert node.service is not None
        node.service.wake(delivery.stream)
        if not delivery.entries:
            return
        world.history.record_delivery(node.rid, node.incarnation, delivery.stream, delivery.entries)
        world.events.append(
            f"{world.now} deliver {node.rid}/{node.incarnation} {delivery.stream} "
            f"{delivery.entries[0][0]}..{delivery.entries[-1][0]} n{len(delivery.entries)}"
        )


class World:
    def __init__(
        self,
        seed: int,
        relay_count: int,
        faults: FaultConfig | str = "all",
        *,
        safety_ms: int = 2_500,
        liveness_ms: int = 2_000,
        quiet_ms: int = 1_500,
        heal_bound_ms: int = 2_000,
        producers: int = 3,
        produce_interval_ms: tuple[int, int] = (15, 60),
        consumers_per_stream: int = 1,
        limits: Limits | None = None,
        core_factory: CoreFactory | None = None,
        log_frames: bool = True,
        single: str | None = None,
    ) -> None:
        """`single`: a single-fault run (relay/sim/single.py): no random faults, the named
        fault strikes when the safety phase would end (`safety_ms` is the warm-up) and is
        never healed."""
        if not 1 <= relay_count <= 64:
            raise ValueError(f"relay count {relay_count} outside 1..64")
        self.seed = seed
        self.faults = FaultConfig.parse(faults)
        self.safety_end = safety_ms
        self.liveness_end = safety_ms + liveness_ms
        self.stop_retry = self.liveness_end + quiet_ms // 2
        self.end = self.liveness_end + quiet_ms
        self.heal_bound_ms = heal_bound_ms
        self.single = single
        self.single_victims: tuple[int, ...] = ()
        self.stepped: set[int] = set()  # relays whose clock a single fault stepped
        self.emptied: set[int] = set()  # relays a single fault restarted without memory
        # The roll and stale single faults (5.15): the relays still to restart onto
        # `roll_topology`, one at a time, and the restarts done: [relay, at ms, ms it had
        # joined every stream it serves again (-1: not yet)]
        self.roll: list[int] = []
        self.roll_topology: Topology | None = None
        self.rolled: list[list[int]] = []
        self.configs_before: dict[str, tuple[int, ...]] = {}  # when a roll or stale began
        self.core_factory: CoreFactory = core_factory or RelayCore
        self.now = 0
        self.history = History()
        self.events = self.history.events

        master = random.Random(seed)
        topo_rng = random.Random(master.getrandbits(64))
        net_rng = random.Random(master.getrandbits(64))
        self.fault_rng = random.Random(master.getrandbits(64))
        client_rng = random.Random(master.getrandbits(64))
        self.base_ms = BASE_UNIX_MS + master.randint(0, 86_400_000)
        self.lull_rng = random.Random(master.getrandbits(64))
        self.spool_rng = random.Random(master.getrandbits(64))  # drawn late: others unchanged
        self.config_rng = random.Random(master.getrandbits(64))  # 5.15 faults: drawn last
        self.reconfigure_rng = random.Random(master.getrandbits(64))  # (later still)
        self.retire_rng = random.Random(master.getrandbits(64))  # (and later)
        # The retire fault: the relay taken off every stream, whether the others' files
        # no longer list it, whether it was stopped for good (every other relay forgot it)
        self.retiring: int | None = None
        self.retire_removed = False
        self.retired = False
        self.spool_stuck: set[int] = set()  # relays whose spool a single fault filled

        # The seed's topology: every relay's file, the clients' too, but for the relays the
        # retopology and stale faults (and the roll and stale single faults) give another
        # (Node.config), which may disagree about a stream's relays (5.15)
        self.topology = build_topology(topo_rng, relay_count)
        self.ids = self.topology.relay_ids
        self.limits = limits or Limits(
            idle_stream_close_ms=SIM_IDLE_STREAM_CLOSE_MS,
            unread_stream_close_ms=SIM_UNREAD_STREAM_CLOSE_MS,
        )
        self.members = {s: self.topology.members(s) for s in STREAMS}
        self.history.members = dict(self.members)
        self.network = Network(
            net_rng, NetParams.draw(net_rng, self.faults), self.events if log_frames else None
        )
        self.nodes: dict[int, Node] = {}
        for r in self.ids:
            node = Node(r, CoreConfig(r, self.topology, self.limits))
            node.streams = tuple(s for s in STREAMS if r in self.members[s])
            if self.faults.clock_skew:
                node.skew = self.fault_rng.randint(-MAX_SKEW_MS, MAX_SKEW_MS)
            self.nodes[r] = node
        self.stats: dict[str, int] = {
            "crashes": 0,
            "crash_refused": 0,
            "restarts": 0,
            "pauses": 0,
            "partitions": 0,
            "oneways": 0,
            "clock_steps": 0,
            "retopologies": 0,
            "reloads": 0,
            "retired": 0,
        }
        if self.faults.stale:  # one relay was deployed with another file from the start
            stale = self.config_rng.choice(self.ids)
            self._retopologize(stale, alternate_topology(self.config_rng, self.topology))

        # Client links: (due ms, n, kind, client, relay, epoch, frame); FIFO per link. The
        # epoch is the relay's (REQUEST, RESPONSE), or its crashed incarnation (DISCONNECT).
        self._client_links: list[tuple[int, int, int, bytes, int, int, bytes]] = []
        self._client_n = 0
        relays = Relays(
            [endpoint_of(r) for r in self.ids],
            {r: endpoint_of(r) for r in self.ids},
            limits=self.limits,
            members=self.topology.members,
        )
        self.producers = [
            Producer(
                i,
                random.Random(client_rng.getrandbits(64)),
                STREAMS,
                self.history,
                relays,
                produce_interval_ms,
                late_streams=(LATE_STREAM,),
                late_from_ms=LATE_FROM_MS,
            )
            for i in range(producers)
        ]
        self.consumers: list[Consumer] = []
        for stream in STREAMS:
            for _ in range(consumers_per_stream):
                crng = random.Random(client_rng.getrandbits(64))
                self.consumers.append(
                    Consumer(len(self.consumers), stream, crng, self.history, relays)
                )
        self.clients: dict[bytes, Producer | Consumer] = {p.client_id: p for p in self.producers}
        self.clients.update((c.client_id, c) for c in self.consumers)
        self._faults_heap: list[tuple[int, int, str, tuple[Any, ...]]] = []
        self._nfault = 0
        self._plan_faults()
        self._last_sample: dict[tuple[int, str], tuple[int, bool, bool]] = {}

    # --- clocks ------------------------------------------------------------------------------

    def clock(self, r: int) -> int:
        node = self.nodes[r]
        return self.base_ms + self.now + node.skew + node.step

    # --- the client port ---------------------------------------------------------------------

    def send(self, client: bytes, relay: int, frame: bytes) -> bool:
        """A client's request to `relay`, arriving next millisecond; False if it is down."""
        node = self.nodes[relay]
        if node.core is None:
            return False
        self._client_frame(REQUEST, client, relay, frame)
        return True

    def incarnation(self, relay: int) -> int:
        return self.nodes[relay].incarnation

    def _respond(self, relay: int, envelope: list[bytes], frame: bytes) -> bool:
        """The client service's answer, arriving next millisecond."""
        self._client_frame(RESPONSE, envelope[0], relay, frame)
        return True

    def _client_frame(self, kind: int, client: bytes, relay: int, frame: bytes) -> None:
        self._client_n += 1
        epoch = self.nodes[relay].epoch
        item = (self.now + CLIENT_LINK_MS, self._client_n, kind, client, relay, epoch, frame)
        heapq.heappush(self._client_links, item)

    def _deliver_client_frames(self, now: int) -> None:
        links = self._client_links
        while links and links[0][0] <= now:
            _, _, kind, client, relay, epoch, frame = heapq.heappop(links)
            node = self.nodes[relay]
            if kind == RESPONSE:
                self.clients[client].on_frame(relay, frame, now)
            elif kind == DISCONNECT:
                self.clients[client].on_disconnect(relay, epoch, now)
            elif node.service is None or node.epoch != epoch:
                continue  # the relay crashed: the connection is gone, and the request
            elif node.paused_until >= 0:
                node.inbox.append((None, (client, frame)))
            else:
                node.fed = True
                node.service.on_request([client], frame, self.clock(relay), now)

    # --- fault plan --------------------------------------------------------------------------

    def _at(self, t: int, kind: str, *args: Any) -> None:
        self._nfault += 1
        heapq.heappush(self._faults_heap, (t, self._nfault, kind, args))

    def _plan_faults(self) -> None:
        rng = self.fault_rng
        self._plan_lull()
        if self.single is not None:
            self._at(self.safety_end, "single", self.single)
            return
        f = self.faults
        span = self.safety_end
        if span < 50:
            return
        per_kind = 1 + span // 1_000

        def window(lo: int, hi: int) -> tuple[int, int]:
            start = rng.randint(0, span - 20)
            return start, min(start + rng.randint(lo, hi), span - 1)

        for kind, enabled, lo, hi in (
            ("partition", f.partition, 20, 800),
            ("oneway", f.oneway, 20, 800),
            ("pause", f.pause, 10, 600),
            ("crash", f.crash, 20, 1_200),
        ):
            if not enabled:
                continue
            for _ in range(rng.randint(1, per_kind)):
                start, end = window(lo, hi)
                self._at(start, kind, end)
        if f.clock_step:
            for _ in range(rng.randint(1, per_kind)):
                self._at(rng.randint(0, span - 1), "clock_step")
        if f.spool_full:
            srng = self.spool_rng
            for _ in range(srng.randint(1, per_kind)):
                start = srng.randint(0, span - 20)
                end = min(start + srng.randint(*SPOOL_FULL_MS), span - 1)
                victims = sorted(srng.sample(self.ids, srng.randint(1, len(self.ids))))
                extra = srng.randint(*SPOOL_FULL_EXTRA_BYTES)
                self._at(start, "spool_full", victims, extra)
                self._at(end, "spool_free", victims)
        if f.reconfigure:
            rrng = self.reconfigure_rng
            for _ in range(rrng.randint(1, per_kind)):
                at = rrng.randint(0, span - 20)
                topology = alternate_topology(rrng, self.topology)
                for r in rrng.sample(self.ids, len(self.ids)):
                    self._at(at, "reload", r, topology)
                    at = min(at + rrng.randint(*RECONFIGURE_STAGGER_MS), span - 1)
        if f.retire and len(self.ids) >= RETIRE_MIN_RELAYS:
            trng = self.retire_rng
            if trng.random() < RETIRE_CHANCE:
                at = trng.randint(0, int(span * RETIRE_START_FRACTION))
                victim = trng.choice(self.ids)
                for r in trng.sample(self.ids, len(self.ids)):
                    self._at(at, "drain", r, victim)
                    at = min(at + trng.randint(*RECONFIGURE_STAGGER_MS), span - 1)
                self._at(min(at + trng.randint(*RETIRE_REMOVE_AFTER_MS), span - 1), "remove")
        if f.retopology:
            crng = self.config_rng
            for _ in range(crng.randint(1, per_kind)):
                start = crng.randint(0, span - 20)
                end = min(start + crng.randint(*RETOPOLOGY_DOWN_MS), span - 1)
                self._at(start, "retopology", end)

    def _plan_lull(self) -> None:
        rng = self.lull_rng
        if self.single is not None:
            if self.seed % 2:
                start = max(0, self.safety_end - SINGLE_LULL_BEFORE_MS)
                self._at(start, "lull", self.safety_end + SINGLE_LULL_AFTER_MS)
            return
        if self.safety_end > LULL_MS[1] and rng.random() < LULL_CHANCE:
            start = rng.randint(0, self.safety_end - LULL_MS[0])
            end = min(start + rng.randint(*LULL_MS), self.safety_end)
            self._at(start, "lull", end)

    def _apply_fault(self, kind: str, args: tuple[Any, ...]) -> None:
        rng = self.fault_rng
        now = self.now
        n = len(self.ids)
        if kind == "lull":
            for p in self.producers:
                p.next_issue = max(p.next_issue, args[0])
            self.events.append(f"{now} lull until {args[0]}")
        elif kind == "single":
            self._apply_single(args[0])
        elif kind == "crash-now":
            self._crash(args[0])
        elif kind == "partition":
            if n < 2:
                return
            order = list(self.ids)
            rng.shuffle(order)
            cut_at = rng.randint(1, n - 1)
            left, right = sorted(order[:cut_at]), sorted(order[cut_at:])
            links = [(a, b) for a in left for b in right] + [(b, a) for a in left for b in right]
            self.network.cut(links)
            self.stats["partitions"] += 1
            self.events.append(f"{now} partition {left}|{right} until {args[0]}")
            self._at(args[0], "uncut", links)
        elif kind == "oneway":
            if n < 2:
                return
            mode = rng.randint(0, 2)
            victim = rng.choice(self.ids)
            if mode == 0:
                links = [(victim, o) for o in self.ids if o != victim]
            elif mode == 1:
                links = [(o, victim) for o in self.ids if o != victim]
            else:
                pairs = [(a, b) for a in self.ids for b in self.ids if a != b]
                links = sorted(rng.sample(pairs, rng.randint(1, len(pairs) // 2 or 1)))
            self.network.cut(links)
            self.stats["oneways"] += 1
            self.events.append(f"{now} oneway {links} until {args[0]}")
            self._at(args[0], "uncut", links)
        elif kind == "uncut":
            self.network.uncut(args[0])
            self.events.append(f"{now} uncut {len(args[0])}")
        elif kind == "pause":
            r = rng.choice(self.ids)
            node = self.nodes[r]
            if node.core is None or node.paused_until >= 0:
                return
            node.paused_until = args[0]
            self.stats["pauses"] += 1
            self.events.append(f"{now} pause {r} until {args[0]}")
            self._at(args[0], "resume", r, node.epoch)
        elif kind == "resume":
            r, epoch = args
            if self.nodes[r].epoch == epoch:
                self._resume(r)
        elif kind == "crash":
            crashed = self._crash_victim(rng, kind)
            if crashed is not None:
                self._crash(crashed)
                self._at(args[0], "restart", crashed, self.nodes[crashed].epoch)
        elif kind == "retopology":
            self._apply_retopology(args[0])
        elif kind == "reload":
            self._reload(*args)
        elif kind == "drain":
            r, self.retiring = args
            self._reload(r, self.nodes[r].config.topology)
        elif kind == "remove":
            assert self.retiring is not None
            if self._counted_anywhere(self.retiring):
                # Step 2 only once step 1 is done, as `relay reconfigure` waits for it:
                # no stream any relay tracks runs on the relay (until the heal)
                self._at(now + FORGET_EVERY_MS, "remove")
                return
            self.retire_removed = True
            for r in self.ids:
                if r != self.retiring:
                    if self.nodes[r].core is not None:
                        self.nodes[r].kept_links.add(self.retiring)
                    self._reload(r, self.nodes[r].config.topology)
        elif kind == "restart":
            r, epoch = args
            node = self.nodes[r]
            if node.core is None and node.epoch == epoch:
                self._restart(r)
        elif kind == "spool_full":
            victims, extra = args
            for r in victims:
                self.nodes[r].spool.shrink(self.nodes[r].core, extra)
            self.events.append(f"{now} spool_full {victims} extra {extra}")
        elif kind == "spool_free":
            for r in args[0]:
                self.nodes[r].spool.free()
            self.events.append(f"{now} spool_free {args[0]}")
        elif kind == "clock_step":
            r = rng.choice(self.ids)
            node = self.nodes[r]
            delta = rng.randint(-MAX_STEP_MS, MAX_STEP_MS)
            offset = node.skew + node.step + delta
            total = max(-MAX_TOTAL_OFFSET_MS, min(MAX_TOTAL_OFFSET_MS, offset))
            node.step = total - node.skew
            self.stats["clock_steps"] += 1
            self.events.append(f"{now} clock_step {r} {delta} -> offset {total}")

    def _apply_retopology(self, restart_at: int) -> None:
        """Crash a running relay (as the crash fault does, within the tolerated fault
        model) and restart it at `restart_at` onto another topology: back to the seed's if
        it runs another, else (or by chance) a fresh alternate (5.15)."""
        rng = self.config_rng
        r = self._crash_victim(rng, "retopology")
        if r is None:
            return
        node = self.nodes[r]
        if node.config.topology != self.topology and rng.random() < RETOPOLOGY_BACK_CHANCE:
            topology = self.topology
        else:
            topology = alternate_topology(rng, self.topology)
        self._crash(r)
        self._retopologize(r, topology)
        self.stats["retopologies"] += 1
        self._at(restart_at, "restart", r, node.epoch)

    def _reload(self, r: int, topology: Topology) -> None:
        """Relay `r` reads a new topology file while it runs (5.15 changes), or at its
        next start if it is down."""
        node = self.nodes[r]
        self._retopologize(r, topology)
        self.stats["reloads"] += 1
        if node.core is not None:
            node.core.reload_topology(node.config)

    def _counted_anywhere(self, victim: int) -> bool:
        """Whether a running relay runs a stream, or keeps a record of one, whose
        relays include `victim` (what `relay status` shows the operator)."""
        for r in self.ids:
            core = self.nodes[r].core
            if core is None:
                continue
            if any(victim in st.members for st in core.streams.values()):
                return True
            if any(victim in members for _, members in core.recorded.values()):
                return True
        return False

    def _forget_retired(self) -> None:
        """As each node does (node `_forget_peers`): every running relay forgets the
        removed one once no stream there counts it; once every relay did (all run), it is
        stopped for good, as the operator stops it when `relay reconfigure` says so."""
        victim = self.retiring
        assert victim is not None
        kept = False
        for r in self.ids:
            core = self.nodes[r].core
            if r == victim:
                continue
            if core is None or (victim in core.peers and not core.forget_relays((victim,))):
                kept = True
            else:
                self.nodes[r].kept_links.discard(victim)
        if kept:
            return
        self.retired = True
        self.stats["retired"] += 1
        self.events.append(f"{self.now} retired {victim}")
        if self.nodes[victim].core is not None:
            self._crash(victim)
        else:
            self.nodes[victim].epoch += 1  # a restart planned for it does not happen

    def _crash_victim(self, rng: random.Random, kind: str) -> int | None:
        """A running relay, drawn from `rng`, that `kind` may crash: None if none runs, or
        the tolerated fault model does not let it crash (`may_crash`: refused, counted)."""
        candidates = [r for r in self.ids if self.nodes[r].core is not None]
        if not candidates:
            return None
        r = rng.choice(candidates)
        if not self.may_crash(r):
            self.stats["crash_refused"] += 1
            self.events.append(f"{self.now} {kind} {r} refused")
            return None
        return r

    def _retopologize(self, r: int, topology: Topology) -> None:
        """Relay `r` reads `topology` from its next start on (it is down, or not started).
        Once a relay is retiring, every file leaves it serving nothing, and once it is
        removed, every other relay's file leaves it out (the operator's later files)."""
        node = self.nodes[r]
        if self.retiring is not None:
            removed = self.retire_removed and r != self.retiring
            topology = retired_topology(topology, self.retiring, removed=removed)
        node.config = CoreConfig(r, topology, self.limits)
        self.events.append(f"{self.now} topology {r} {describe(topology)}")

    def _apply_single(self, kind: str) -> None:
        """Strike the single fault of a single-fault run (see relay/sim/single.py)."""
        rng = self.fault_rng
        victim = rng.choice(self.ids)
        other = rng.choice([r for r in self.ids if r != victim])
        node = self.nodes[victim]
        self.single_victims = (victim,)
        links: list[tuple[int, int]] = []
        if kind == "crash":
            self._crash(victim)
        elif kind == "pause":
            node.paused_until = self.end + 1
        elif kind == "isolate":
            links = [(victim, o) for o in self.ids if o != victim]
            links += [(o, victim) for o in self.ids if o != victim]
        elif kind == "oneway-out":
            links = [(victim, o) for o in self.ids if o != victim]
        elif kind == "oneway-in":
            links = [(o, victim) for o in self.ids if o != victim]
        elif kind in ("cut-link", "cut-then-crash"):
            links = [(victim, other), (other, victim)]
            self.single_victims = (victim, other)
            if kind == "cut-then-crash":
                self._at(self.now + rng.randint(*CRASH_AFTER_CUT_MS), "crash-now", victim)
        elif kind == "cut-link-oneway":
            links = [(victim, other)]
            self.single_victims = (victim, other)
        elif kind == "crash-cut-link":
            # As many relays die as a majority of `all` can lose while three stay (a cut
            # link needs a third relay to pass frames on), then a link between two of the
            # survivors is cut both ways: only transit keeps a majority together (5.13).
            n = len(self.ids)
            down = rng.sample(self.ids, max(0, min(n - quorum(n), n - 3)))
            for r in down:
                self._crash(r)
            a, b = rng.sample([r for r in self.ids if r not in down], 2)
            links = [(a, b), (b, a)]
            self.single_victims = (*sorted(down), a, b)
        elif kind in ("clock-back", "clock-forward"):
            node.step += CLOCK_STEP_MS if kind == "clock-forward" else -CLOCK_STEP_MS
            self.stepped.add(victim)
        elif kind == "spool-full":
            node.spool.shrink(node.core, 0)
            self.spool_stuck.add(victim)
        elif kind in ("roll", "stale"):
            crng = self.config_rng
            if kind == "roll":  # every relay in turn, onto a topology that grows a group
                self.roll_topology = grown_topology(crng, self.topology)
                self.roll = crng.sample(self.ids, len(self.ids))
            else:  # one relay, onto another topology
                self.roll_topology = alternate_topology(crng, self.topology)
                self.roll = [victim]
            self.single_victims = tuple(self.roll)
            self.configs_before = {stream: self.established(stream) for stream in STREAMS}
            self._roll_next()
        elif kind == "retire":
            # docs/deploy.md section 9 as the random fault does it: every relay reads a
            # file in which the victim serves no stream, in turn; once no relay counts
            # it, the others read one without it, and it is stopped once they forgot it.
            self.configs_before = {stream: self.established(stream) for stream in STREAMS}
            at = self.now
            for r in rng.sample(self.ids, len(self.ids)):
                self._at(at, "drain", r, victim)
                at += rng.randint(*RECONFIGURE_STAGGER_MS)
            self._at(at + rng.randint(*RETIRE_REMOVE_AFTER_MS), "remove")
        elif kind == "restart-clock-back":
            node.step -= CLOCK_STEP_MS
            self.stepped.add(victim)
            self.emptied.add(victim)
            self._crash(victim)
            self._restart(victim)
        else:
            raise ValueError(f"unknown single fault {kind!r}")
        if links:
            self.network.cut(links)
        self.events.append(f"{self.now} single {kind} {self.single_victims} links {links}")

    def _roll_next(self) -> None:
        assert self.roll_topology is not None
        r = self.roll.pop(0)
        self._crash(r)
        self._retopologize(r, self.roll_topology)
        self._restart(r)
        self.rolled.append([r, self.now, -1])

    def _roll_on(self, now: int) -> None:
        """Restart the next relay of a roll once the last one joined every stream it
        serves again, and ROLL_STEP_MS after that one restarted."""
        last = self.rolled[-1]
        r, at, rejoined = last
        if rejoined < 0:
            node = self.nodes[r]
            core = node.core
            if core is None or not all(core.joined(s) for s in self._serving(node)):
                return
            last[2] = rejoined = now
            self.events.append(f"{now} rejoined {r}/{node.incarnation} after {now - at} ms")
        if self.roll and now >= max(rejoined, at + ROLL_STEP_MS):
            self._roll_next()

    def single_info(self) -> SingleFaultInfo:
        """The connected majority of every stream at the end of a single-fault run."""
        assert self.single is not None
        able = {
            r
            for r, node in self.nodes.items()
            if node.core is not None
            and node.paused_until < 0
            and r not in self.stepped
            and r not in self.emptied
            and r not in self.spool_stuck
        }
        works = {(a, b) for a in able for b in able if a != b and not self.network.is_cut(a, b)}
        groups = strongly_connected(able, works)
        info = SingleFaultInfo(self.single, self.safety_end, self.liveness_end)
        info.restarts = [(r, at, rejoined) for r, at, rejoined in self.rolled]
        info.not_restarted = tuple(self.roll)
        if self.rolled or self.single == "retire":
            info.configs_before = dict(self.configs_before)
            info.configs_after = {stream: self.established(stream) for stream in STREAMS}
            if self.single == "roll" and self.roll_topology is not None and not self.roll:
                info.configs_wanted = {s: self.roll_topology.members(s) for s in STREAMS}
        if self.single == "retire" and self.retiring is not None:
            # what every file names at the end: the others', which leave the victim out
            left = retired_topology(self.topology, self.retiring, removed=True)
            info.configs_wanted = {s: left.members(s) for s in STREAMS}
            info.retired = self.retiring if self.retired else -1
        for stream in STREAMS:
            # the stream's established configuration (5.15): its topology's, unless a
            # relay that began it read another file
            members = self.established(stream) or self.members[stream]
            for group in groups:
                if len(group & set(members)) >= quorum(len(members)):
                    info.majorities[stream] = frozenset(group)
        return info

    def established(self, stream: str) -> tuple[int, ...]:
        """The relays of the stream's established configuration as the running relays know
        it (5.15; the latest version, should a change be under way; empty while none knows
        one)."""
        latest: tuple[int, tuple[int, ...]] = (PROVISIONAL, ())
        for node in self.nodes.values():
            if node.core is not None:
                latest = max(latest, configuration_of(node.core, stream))
        return latest[1]

    def _serving(self, node: Node) -> tuple[str, ...]:
        """The simulation's streams the relay serves now: by its core's configurations,
        or as it last ran when it is down."""
        core = node.core
        if core is None:
            return node.streams
        return tuple(s for s in STREAMS if core.serves(s))

    def may_crash(self, r: int) -> bool:
        """The tolerated fault model: after crashing `r`, every stream it serves keeps a
        quorum of members that are up and joined."""
        core = self.nodes[r].core
        for stream in self.nodes[r].streams:
            # the relays of the configuration it runs the stream under (5.15)
            members = self.members[stream] if core is None else core.members(stream)
            holding = 0
            for m in members:
                core = self.nodes[m].core
                if m != r and core is not None and core.joined(stream):
                    holding += 1
            if holding < quorum(len(members)):
                return False
        return True

    def _crash(self, r: int) -> None:
        node = self.nodes[r]
        node.core = None
        node.kept_links.clear()
        node.epoch += 1
        node.paused_until = -1
        node.inbox.clear()
        self.stats["crashes"] += 1
        self.events.append(f"{self.now} crash {r}/{node.incarnation}")
        for other in self.nodes:
            if other != r and self.nodes[other].core is not None:
                self.network.close(self.now, r, other, self.nodes[other].epoch)
        node.service = None
        for client in self.clients:
            # Their connections to it close, after what it sent before.
            self._client_links_close(client, r, node.incarnation)

    def _client_links_close(self, client: bytes, relay: int, incarnation: int) -> None:
        self._client_n += 1
        due = self.now + CLIENT_LINK_MS
        item = (due, self._client_n, DISCONNECT, client, relay, incarnation, b"")
        heapq.heappush(self._client_links, item)

    def _receive(self, core: RelayCore, r: int, src: int, frame: bytes) -> None:
        self.nodes[r].fed = True
        if frame == CLOSED:
            core.peer_lost(src, self.clock(r), self.now)
        else:
            core.receive(frame, self.clock(r), self.now)

    def _start(self, r: int) -> None:
        node = self.nodes[r]
        core = node.core = self.core_factory(node.config, node.incarnation, self.clock(r))
        core.remember_acceptors(node.disk)
        node.streams = self._serving(node)
        node.spool.restarted()
        node.spool.tell(core)
        node.service = ClientService(
            core,
            self.limits,
            members=node.config.topology.members,  # as the node: its own file's rule
            send=lambda envelope, frame: self._respond(r, envelope, frame),
            counters=node.counters,
            status=core.status,
            warn=_ignore,
            relay_id=r,
        )

    def _restart(self, r: int) -> None:
        node = self.nodes[r]
        node.incarnation += 1
        node.restarts += 1
        self._start(r)
        self.stats["restarts"] += 1
        self.events.append(f"{self.now} restart {r}/{node.incarnation}")

    def _resume(self, r: int) -> None:
        node = self.nodes[r]
        node.paused_until = -1
        core = node.core
        self.events.append(f"{self.now} resume {r} inbox {len(node.inbox)}")
        if core is None:
            return
        inbox, node.inbox = node.inbox, []
        service = node.service
        assert service is not None
        for src, item in inbox:
            if src is None:
                client, frame = item
                node.fed = True
                service.on_request([client], frame, self.clock(r), self.now)
            else:
                self._receive(core, r, src, item)

    def heal(self) -> None:
        """End of the safety phase: every fault ends, crashed relays restart."""
        self.events.append(f"{self.now} heal")
        self._faults_heap.clear()
        self.network.heal()
        for r in self.ids:
            node = self.nodes[r]
            node.spool.free()
            if node.core is None and not (self.retired and r == self.retiring):
                self._restart(r)
            elif node.paused_until >= 0:
                self._resume(r)

    # --- the loop ----------------------------------------------------------------------------

    def _drain(self, node: Node) -> None:
        core = node.core
        assert core is not None
        drain(core, _WorldSink(self, node))
        node.spool.feed(core, node.streams)
        broken = node.spool.broken_promise(core)
        if broken and not node.spool_anomaly:
            node.spool_anomaly = True
            self.history.anomalies.append(f"relay {node.rid} at {self.now} ms: {broken}")

    def _sample(self) -> None:
        for r in self.ids:
            node = self.nodes[r]
            core = node.core
            node.streams = self._serving(node)
            for stream in node.streams:
                if core is None:
                    state = (node.incarnation, True, False)
                else:
                    state = (node.incarnation, core.fenced(stream), core.joined(stream))
                key = (r, stream)
                if self._last_sample.get(key) != state:
                    self._last_sample[key] = state
                    self.history.fence_samples.append(
                        FenceSample(self.now, r, state[0], stream, state[1], state[2])
                    )
                    self.events.append(
                        f"{self.now} state {r}/{state[0]} {stream} "
                        f"fenced={int(state[1])} joined={int(state[2])}"
                    )

    def run(self) -> History:
        for r in self.ids:
            self._start(r)
        bound = self.safety_end + self.heal_bound_ms
        for now in range(self.end):
            self.now = now
            try:
                self._step(now, bound)
            except Exception as exc:  # a bug in the core or the world: report with context
                raise SimError(
                    f"seed {self.seed} at {now} ms: {type(exc).__name__}: {exc}\n"
                    + "".join(traceback.format_exception(exc)[-6:])
                ) from exc
        self.now = self.end
        self._sample()
        return self._finish()

    def _step(self, now: int, bound: int) -> None:
        if now == self.safety_end and self.single is None:
            self.heal()
        if now == self.liveness_end:
            for p in self.producers:
                p.issuing = False
        if now == self.stop_retry:
            for p in self.producers:
                p.stop_retrying()
        heap = self._faults_heap
        while heap and heap[0][0] <= now:
            _, _, kind, args = heapq.heappop(heap)
            self._apply_fault(kind, args)
        nodes = self.nodes
        for node in nodes.values():
            if node.core is not None and node.paused_until < 0:
                node.spool.tell(node.core)  # as the node does before every turn (5.14)
        for src, dst, epoch, frame in self.network.due(now):
            node = nodes[dst]
            if node.core is None or node.epoch != epoch:
                self.network.stats.stale += 1
            elif node.paused_until >= 0:
                node.inbox.append((src, frame))
            else:
                self.network.stats.delivered += 1
                self._receive(node.core, dst, src, frame)
        self._deliver_client_frames(now)
        for p in self.producers:
            p.step(self)
        for c in self.consumers:
            c.step(self)
        for r in self.ids:
            node = nodes[r]
            if node.core is not None and node.paused_until < 0:
                if node.fed and node.fed_tick_due == NO_FED_TICK:
                    node.fed_tick_due = now + FED_TICK_MS
                due = now >= min(node.core.next_deadline_ms(), node.fed_tick_due)
                if node.fed or due:
                    # As the node does (relay/core/shell.py): tick by the core's deadline
                    # and within FED_TICK_MS of an input, act on its output after any input.
                    node.fed = False
                    if due:
                        node.fed_tick_due = NO_FED_TICK
                        node.core.tick(self.clock(r), self.now)
                    self._drain(node)
                assert node.service is not None
                node.service.expire(now)
                node.service.flush()
        if self.rolled:
            self._roll_on(now)
        if self.retire_removed and not self.retired and now % FORGET_EVERY_MS == 0:
            self._forget_retired()
        if now % FENCE_SAMPLE_EVERY_MS == 0 or now == bound:
            self._sample()

    def _finish(self) -> History:
        h = self.history
        for p in self.producers:
            for final in p.finals():
                h.finals[(final.pid, final.pseq)] = final
        for r in self.ids:
            node = self.nodes[r]
            core = node.core
            rf = RelayFinal(
                r, node.incarnation, core is not None and node.paused_until < 0, node.restarts
            )
            if core is not None:
                h.anomalies.extend(f"relay {r}: {e}" for e in memory.accounting_errors(core))
                node.streams = self._serving(node)
                for stream in node.streams:
                    rf.joined[stream] = core.joined(stream)
                    rf.fenced[stream] = core.fenced(stream)
                    rf.committed_point[stream] = core.committed_point(stream)
                    rf.stall[stream] = core.stall(stream)
                for stream in STREAMS:
                    rf.config[stream] = configuration_of(core, stream)
                    rf.topology[stream] = node.config.topology.members(stream)
            h.relay_finals[r] = rf
            h.spooled[r] = node.spool.seqs
        return h

    def phase_info(self) -> PhaseInfo:
        return PhaseInfo(
            safety_end_ms=self.safety_end,
            liveness_end_ms=self.liveness_end,
            heal_bound_ms=self.heal_bound_ms,
            # liveness needs a fault-free phase and time after the heal bound to observe
            # (a single-fault run never heals: relay/sim/single.py checks it instead)
            check_liveness=self.single is None
            and self.liveness_end > self.safety_end
            and self.end > self.safety_end + self.heal_bound_ms,
        )

    def summary(self) -> dict[str, int]:
        h = self.history
        net = self.network.stats
        finals = list(h.finals.values())
        out = {
            "relays": len(self.ids),
            "sim_ms": self.end,
            "txs": len(finals),
            "committed": sum(f.outcome == "committed" for f in finals),
            "rejected": sum(f.outcome == "rejected" for f in finals),
            "unknown": sum(f.outcome == "unknown" for f in finals),
            "attempts": len(h.attempts),
            "frames_sent": net.sent,
            "frames_delivered": net.delivered,
            "frames_dropped": net.dropped,
            "frames_cut": net.cut,
            "frames_duplicated": net.duplicated,
            "frames_delayed": net.delayed,
            "frames_stale": net.stale,
            "delivered_entries": sum(
                len(log) for per in h.delivered.values() for log in per.values()
            ),
            "consumer_entries": sum(len(c.received) for c in h.consumers.values()),
            "consumer_reconnects": sum(c.reconnects for c in self.consumers),
            "produce_requests": sum(n.counters["produce_requests"] for n in self.nodes.values()),
            "read_requests": sum(n.counters["read_requests"] for n in self.nodes.values()),
            # of the relays running at the end (a restart starts its counters again)
            "evicted_for_relay_bound": sum(
                n.core.counters["evicted_for_relay_bound"]
                for n in self.nodes.values()
                if n.core is not None
            ),
        }
        out.update(self.stats)
        return out
