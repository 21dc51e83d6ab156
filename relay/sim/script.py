"""Scenario scripts: N real RelayCore instances over a fully scripted network.

A scenario is a text file of commands, one per line, each followed by the output it
printed, as lines starting with `> ` (in the style of etcd-io/raft's `testdata/*.txt`).
`run_script(text)` runs the commands and returns the same text with every `> ` block
regenerated, so a test compares the two and a rewrite just writes the result back.

Nothing is random. Time is an integer number of milliseconds since the start of the
script; relay R reads the Unix clock `START_UNIX_MS + now + offset(R)`. Every directed
link holds its frames in a FIFO queue; by default a frame sent during millisecond t is
delivered at t + 1. One millisecond of `tick` does, in order: deliver every due frame
(links in (src, dst) order, FIFO within a link), tick every running relay, then drain each
relay's `ready()` (route frames, collect producer replies and deliveries).

Routing of an `Outgoing` (only to relays whose topology lists the sender): `stream` set ->
every other relay that serves the stream by its own topology or by its configuration (as
the node's subscriptions do: relay/sim/network.py `subscribers`), `target` set -> that
relay, neither -> every other relay.

Commands (`#` starts a comment; relays are ids, links are `A->B` or `A<->B`):

    limits NAME=VALUE ...        override Limits (before `topology`)
    topology 0:s 1:s,t 2:*       relay id : comma-separated subscriptions; starts every
                                 relay (incarnation 1)
    tick N                       advance N ms, one at a time
    stabilize [MAX]              tick until no frame but heartbeats and refusals was sent
                                 for 2 x suspect_timeout_ms (at most MAX ms, default 5000;
                                 prints only if that bound is hit)
    produce R STREAM PID PSEQ VALUE   a client produce at relay R (request ids #1, #2 ...)
    read R STREAM AFTER [MAX]    AFTER: a sequence number (-1, 0) or a delivered value,
                                 meaning the seq of that value
    cut A->B | cut A<->B         the link loses what is queued and everything sent on it
    closed A->B | closed A<->B   B's shell sees its connection from A close now
                                 (`peer_lost`), as after a cut that resets TCP
    hold A->B | release A->B     queue frames without delivering them / deliver again
    deliver A->B [N]             deliver the first N (default all) frames queued on the
                                 link now, even if it is held
    drop A->B N                  lose the next N frames sent on the link
    isolate R                    cut every link from and to R
    heal                         every link back to normal: uncut, released, no drops
    pause R | resume R           no ticks and no deliveries to R while paused
    crash R | restart R [wiped] [topology SPEC ...]
                                 restart = a new RelayCore with incarnation + 1 and the
                                 acceptor records its disk kept (`wiped`: its disk
                                 emptied: nothing remembered), reading the topology
                                 SPEC (as `topology`) from then on if given; frames
                                 queued towards a crashed relay are lost; its peers see
                                 the connection close after what it sent before
                                 (`peer_lost`), unless the link is cut
    reload R topology SPEC ...   R reads the topology SPEC while it runs (5.15 changes:
                                 RelayCore.reload_topology), and from then on
    skew R MS                    set R's clock offset to MS
    step R MS                    add MS to R's clock offset (a clock jump)
    show [R ...]                 per relay: the peers it hears and its watched counters;
                                 per stream: joined, fenced (and why), the view's number
                                 and admitted members, committed point, delivered values
                                 (and late, pending, repairing when there are any)
    watch [+|-]PATTERN ...       the counters `show` prints: PATTERN replaces the list,
                                 +PATTERN adds, -PATTERN removes (default DEFAULT_WATCH)
    replies                      producer replies since the last `replies`
    delivered R STREAM           values delivered by R (this incarnation), in order
    counters R [NAME ...]        R's counters (all non-zero ones, or the named ones)
    queue A->B [N]               the (first N) frames waiting on a link, summarised
    now                          the script time in ms
    clocks                       per relay: its clock offset, and how far its floor (the
                                 seq it promises not to go below) runs ahead of true time

Stable names instead of raw sequence numbers (which depend on the start time): the
committed timeline of a stream is the union of everything any relay delivered, in seq
order. A point (committed point, oldest readable position) prints as the number of
committed transactions at or below it; a committed seq in a reply prints as
`STREAM[k]=VALUE`, the k-th (1-based) committed transaction of the stream.

The shared invariants (relay/sim/invariants.py) are checked after every command; a
violation is printed as a `!! ` line (a scenario's expected output must never contain
one): every relay's delivered log (per incarnation) is in seq order and a gap-free run of
the stream's committed timeline, no transaction is delivered at two seqs, two relays never
deliver different transactions at one seq, and a `committed(seq)` reply names a committed
copy of its transaction.
"""

from __future__ import annotations

import fnmatch
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from relay.core import codec
from relay.core.config import CoreConfig, Limits, Topology
from relay.core.machine import RelayCore
from relay.core.messages import (
    Entry,
    Forward,
    ForwardReply,
    Heartbeat,
    JoinReply,
    JoinRequest,
    Outcome,
    PeerMessage,
    ReadStatus,
    RepairReply,
    RepairRequest,
    Reports,
    Transaction,
    TxBatch,
)
from relay.core.seq import counter_of, ms_of, relay_of, wall_ms
from relay.core.shell import Delivery, Outgoing, ProduceReply, ProduceRequest, drain, recipients
from relay.sim import invariants
from relay.sim.network import CLOSED, subscribers

START_UNIX_MS = 1_800_000_000_000
STABILIZE_MAX_MS = 5_000
OUTPUT_PREFIX = "> "
VIOLATION_PREFIX = "!! "
SEQ_PATTERN = re.compile(r"\b\d{15,}\b")  # a sequence number in a message: named by value

# Counters `show` prints by default (fnmatch patterns): protocol events a scenario is about.
# A curated list rather than every counter, so a new counter in the core does not churn
# every scenario; `watch` changes it per script, `counters R` prints them all.
DEFAULT_WATCH = (
    "fenced",
    "unfenced",
    "base_adopted",
    "tx_*",
    "link_gap*",
    "fill_*",
    "hole_closed",
    "repair_started",
    "repair_adopted",
    "repair_local",
    "repair_mismatch",
    "reset_*",
    "refused_*",
    "produce_*",
    "dedupe_skipped",
    "stale_incarnation",
)
BACKGROUND = (Heartbeat,)  # what `stabilize` does not count as activity


class ScriptError(Exception):
    """A malformed command, or a command that cannot run in the current state."""


@dataclass
class Link:
    queue: deque[tuple[int, bytes]] = field(default_factory=deque)  # (sent at ms, frame)
    cut: bool = False
    held: bool = False
    drop: int = 0
    lost: int = 0


@dataclass
class Node:
    rid: int
    config: CoreConfig
    core: RelayCore | None = None
    incarnation: int = 1
    offset_ms: int = 0
    paused: bool = False
    disk: dict[str, bytes] = field(default_factory=dict)  # its acceptor records

    def listens_to(self, src: int) -> bool:
        """Whether it has a link from relay `src`: its file lists it."""
        return src in self.config.topology.subscriptions


@dataclass
class Request:
    rid: int
    relay: int
    stream: str
    pid: bytes
    pseq: int
    value: str

    @property
    def tx(self) -> Transaction:
        return Transaction(self.pid, self.pseq, None, self.value.encode())


def _link_arg(text: str) -> list[tuple[int, int]]:
    if "<->" in text:
        a, b = text.split("<->")
        pairs = [(int(a), int(b)), (int(b), int(a))]
    elif "->" in text:
        a, b = text.split("->")
        pairs = [(int(a), int(b))]
    else:
        raise ScriptError(f"expected a link A->B or A<->B, got {text!r}")
    for x, y in pairs:
        if x == y:
            raise ScriptError(f"a link joins two different relays: {text!r}")
    return pairs


def _topology(args: list[str]) -> Topology:
    """`RELAY:PATTERN[,PATTERN] ...`, as the `topology` command takes it."""
    subs: dict[int, tuple[str, ...]] = {}
    for arg in args:
        rid, sep, patterns = arg.partition(":")
        if not sep:
            raise ScriptError(f"expected RELAY:PATTERN[,PATTERN], got {arg!r}")
        subs[_int(rid, "relay")] = tuple(p for p in patterns.split(",") if p)
    return Topology(subs)


def _configuration(config: dict[str, object], *, always: bool = False) -> str:
    """A stream's configuration (5.15) for `show`, when there is something to say: not
    established yet, not what the relay's topology says, or other relays disagree."""
    relays, topology, disagree = config["relays"], config["topology"], config["disagree"]
    assert isinstance(disagree, dict)
    if not always and config["version"] != 0 and relays == topology and not disagree:
        return ""

    def ids(value: object) -> str:
        assert isinstance(value, list)
        return " ".join(map(str, value))

    out = f" config={config['version']}[{ids(relays)}]"
    if topology != relays:
        out += f" topology=[{ids(topology)}]"
    held = config.get("change_held_by") or {}
    assert isinstance(held, dict)
    if held:
        out += " change_held_by=" + ",".join(f"{p}:[{ids(m)}]" for p, m in held.items())
    if disagree:
        out += " disagree=" + ",".join(
            f"{peer}:{c['version']}[{ids(c['relays'])}]" for peer, c in disagree.items()
        )
    return out


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ScriptError(f"{what}: expected an integer, got {text!r}") from None


class _MeshSink:
    """Where relay `rid`'s `Ready` goes: frames onto the links, replies to the script's
    log, deliveries into the committed timeline it names values by."""

    def __init__(self, mesh: Mesh, rid: int) -> None:
        self.mesh = mesh
        self.rid = rid

    def persist(self, records: list[tuple[str, bytes]]) -> None:
        self.mesh.nodes[self.rid].disk.update(records)

    def publish(self, out: Outgoing) -> None:
        self.mesh._route(self.rid, out)

    def answer(self, replies: list[ProduceReply]) -> None:
        self.mesh.replies.extend((self.rid, reply) for reply in replies)
        self.mesh.all_replies.extend(replies)

    def rebase(self, stream: str, point: int) -> None:
        pass  # not modelled: `check` would report the gap in the delivered log

    def closed(self, stream: str) -> None:
        self.mesh.closed.append((self.rid, stream))

    def deliver(self, delivery: Delivery) -> None:
        mesh = self.mesh
        node = mesh.nodes[self.rid]
        log = mesh.logs.setdefault((self.rid, node.incarnation), {})
        log.setdefault(delivery.stream, []).extend(delivery.entries)
        timeline = mesh.committed.setdefault(delivery.stream, {})
        for seq, tx in delivery.entries:
            mesh.txs.setdefault(seq, (delivery.stream, tx))
            timeline.setdefault(seq, tx)  # a second copy at a seq is for `check` to report


class Mesh:
    """The relays, the links between them and what the script has observed."""

    def __init__(self, topology: Topology, limits: Limits) -> None:
        self.topology = topology
        self.limits = limits
        self.ids = topology.relay_ids
        self.now = 0
        self.nodes = {r: Node(r, CoreConfig(r, topology, limits)) for r in self.ids}
        self.links = {(a, b): Link() for a in self.ids for b in self.ids if a != b}
        self.txs: dict[int, tuple[str, Transaction]] = {}  # every seq ever issued
        # stream -> seq -> tx: what any relay delivered, first copy (names values)
        self.committed: dict[str, dict[int, Transaction]] = {}
        # (relay, incarnation) -> stream -> every entry it delivered, in order
        self.logs: dict[tuple[int, int], dict[str, list[Entry]]] = {}
        self.requests: dict[int, Request] = {}
        self.replies: list[tuple[int, ProduceReply]] = []  # (answering relay, reply)
        self.closed: list[tuple[int, str]] = []  # (relay, stream) closed blank and idle
        self.all_replies: list[ProduceReply] = []
        self.activity = False  # a non-background frame entered a link this ms
        for r in self.ids:
            self._start(r)

    # --- clocks and lifecycle ---------------------------------------------------------------

    def clock(self, r: int) -> int:
        return START_UNIX_MS + self.now + self.nodes[r].offset_ms

    def _start(self, r: int, *, wiped: bool = False) -> None:
        node = self.nodes[r]
        node.core = RelayCore(node.config, node.incarnation, self.clock(r))
        if wiped:
            node.disk.clear()  # an empty data directory: nothing to remember
        node.core.remember_acceptors(node.disk)

    def crash(self, r: int) -> None:
        node = self.nodes[r]
        if node.core is None:
            raise ScriptError(f"relay {r} is already crashed")
        node.core = None
        node.paused = False
        for (src, dst), link in self.links.items():
            if dst == r:
                link.lost += len(link.queue)
                link.queue.clear()
            elif src == r and not link.cut and self.nodes[dst].core is not None:
                link.queue.append((self.now, CLOSED))  # its peers see the connection close

    def restart(self, r: int, topology: Topology | None = None, *, wiped: bool = False) -> None:
        node = self.nodes[r]
        if node.core is not None:
            raise ScriptError(f"relay {r} is running; crash it first")
        if topology is not None:
            if not set(topology.relay_ids) <= set(self.ids) or r not in topology.relay_ids:
                raise ScriptError(f"a topology of relay {r} among {list(self.ids)} expected")
            node.config = CoreConfig(r, topology, self.limits)
        node.incarnation += 1
        self._start(r, wiped=wiped)

    def reload(self, r: int, topology: Topology) -> None:
        if not set(topology.relay_ids) <= set(self.ids) or r not in topology.relay_ids:
            raise ScriptError(f"a topology of relay {r} among {list(self.ids)} expected")
        self.nodes[r].config = CoreConfig(r, topology, self.limits)
        self.running(r).reload_topology(self.nodes[r].config)

    def running(self, r: int) -> RelayCore:
        core = self.nodes[r].core
        if core is None:
            raise ScriptError(f"relay {r} is crashed")
        return core

    # --- the network -----------------------------------------------------------------------

    def _route(self, src: int, out: Outgoing) -> None:
        msg = codec.decode(out.frame, self.limits.max_frame_bytes)
        self._observe(msg)
        background = isinstance(msg, BACKGROUND)
        targets = (
            subscribers(self.nodes, src, out.stream)
            if out.stream is not None
            else recipients(out, self.topology, src)
        )
        for d in targets:
            if src not in self.nodes[d].config.topology.subscriptions:
                continue  # a relay subscribes only to the relays its topology lists
            link = self.links[(src, d)]
            if link.cut or self.nodes[d].core is None:
                link.lost += 1
                continue
            if link.drop > 0:
                link.drop -= 1
                link.lost += 1
                continue
            link.queue.append((self.now, out.frame))
            if not background:
                self.activity = True

    def _observe(self, msg: PeerMessage) -> None:
        if isinstance(msg, (TxBatch, RepairReply)):
            for seq, tx in msg.entries:
                self.txs.setdefault(seq, (msg.stream, tx))

    def _deliverable(self, dst: int, link: Link) -> bool:
        node = self.nodes[dst]
        return not link.held and not link.cut and node.core is not None and not node.paused

    def _deliver_due(self) -> None:
        for (src, dst), link in sorted(self.links.items()):
            if not link.queue or not self._deliverable(dst, link):
                continue
            core = self.nodes[dst].core
            assert core is not None
            while link.queue and link.queue[0][0] < self.now:
                _, frame = link.queue.popleft()
                if frame == CLOSED:
                    core.peer_lost(src, self.clock(dst), self.now)
                else:
                    core.receive(frame, self.clock(dst), self.now)

    def drain(self, r: int) -> None:
        core = self.nodes[r].core
        assert core is not None
        drain(core, _MeshSink(self, r))

    def step_ms(self) -> None:
        self.now += 1
        self.activity = False
        self._deliver_due()
        running = [r for r in self.ids if self.nodes[r].core is not None]
        for r in running:
            if not self.nodes[r].paused:
                core = self.nodes[r].core
                assert core is not None
                core.tick(self.clock(r), self.now)
        for r in running:
            if not self.nodes[r].paused:
                self.drain(r)

    # --- naming ---------------------------------------------------------------------------

    def timeline(self, stream: str) -> list[int]:
        return sorted(self.committed.get(stream, {}))

    def value(self, seq: int) -> str:
        found = self.txs.get(seq)
        if found is None:
            return self.raw(seq)
        return found[1].value.decode(errors="replace")

    def raw(self, seq: int) -> str:
        """A seq nobody delivered: its ms since the script start, relay and counter."""
        ms = ms_of(seq) - wall_ms(START_UNIX_MS)
        return f"seq(+{ms}ms,r{relay_of(seq)},c{counter_of(seq)})"

    def point(self, stream: str, point: int) -> str:
        """A point as the number of committed transactions at or below it."""
        if point < 0:
            return "none"
        return str(sum(1 for s in self.timeline(stream) if s <= point))

    def committed_seq(self, stream: str, seq: int) -> str:
        tl = self.timeline(stream)
        if seq in self.committed.get(stream, {}):
            return f"{stream}[{tl.index(seq) + 1}]={self.value(seq)}"
        return f"{self.raw(seq)} (not committed)"

    def seq_of_value(self, stream: str, value: str) -> int:
        found = [s for s in self.timeline(stream) if self.value(s) == value]
        if len(found) != 1:
            raise ScriptError(
                f"value {value!r} names {len(found)} committed transactions of {stream!r}"
            )
        return found[0]

    # --- invariants ------------------------------------------------------------------------

    def delivered(self, r: int, stream: str) -> list[int]:
        """The seqs relay `r` delivered in its current incarnation, in order."""
        log = self.logs.get((r, self.nodes[r].incarnation), {}).get(stream, [])
        return [seq for seq, _ in log]

    def check(self) -> list[str]:
        """The shared invariants (relay/sim/invariants.py) over every delivered log and
        the committed replies since the last check; seqs named by their values."""
        logs = [
            (f"relay {r}/{inc}", stream, log)
            for (r, inc), per_stream in sorted(self.logs.items())
            for stream, log in sorted(per_stream.items())
        ]
        timelines, out = invariants.one_timeline(logs)
        for label, stream, log in logs:
            out += invariants.in_order(label, stream, log)
            out += invariants.gap_free(
                label, stream, log, invariants.TimelineIndex(timelines[stream])
            )
        for reply in self.all_replies:
            if reply.outcome is not Outcome.COMMITTED:
                continue
            req = self.requests.get(reply.request_id)
            if req is None:
                out.append(f"a reply to unknown request {reply.request_id}")
                continue
            out += invariants.committed_answers(
                f"#{req.rid} {req.pid.decode()}/{req.pseq}",
                req.tx,
                [reply.seq],
                timelines.get(req.stream, {}),
                must_hold=True,
            )
        self.all_replies = []
        return [SEQ_PATTERN.sub(lambda m: self.value(int(m.group())), line) for line in out]


class Interpreter:
    def __init__(self) -> None:
        self.mesh: Mesh | None = None
        self.limits = Limits()
        self.next_request = 1
        self.watch: list[str] = list(DEFAULT_WATCH)
        self.commands: dict[str, Callable[[list[str]], list[str]]] = {
            "limits": self.cmd_limits,
            "topology": self.cmd_topology,
            "tick": self.cmd_tick,
            "stabilize": self.cmd_stabilize,
            "produce": self.cmd_produce,
            "read": self.cmd_read,
            "cut": self.cmd_cut,
            "closed": self.cmd_closed,
            "hold": self.cmd_hold,
            "release": self.cmd_release,
            "drop": self.cmd_drop,
            "deliver": self.cmd_deliver,
            "isolate": self.cmd_isolate,
            "heal": self.cmd_heal,
            "pause": self.cmd_pause,
            "resume": self.cmd_resume,
            "crash": self.cmd_crash,
            "restart": self.cmd_restart,
            "reload": self.cmd_reload,
            "skew": self.cmd_skew,
            "step": self.cmd_step,
            "show": self.cmd_show,
            "replies": self.cmd_replies,
            "delivered": self.cmd_delivered,
            "counters": self.cmd_counters,
            "queue": self.cmd_queue,
            "now": self.cmd_now,
            "watch": self.cmd_watch,
            "clocks": self.cmd_clocks,
        }

    # --- running --------------------------------------------------------------------------

    def execute(self, line: str) -> list[str]:
        words = line.split()
        handler = self.commands.get(words[0])
        if handler is None:
            raise ScriptError(f"unknown command {words[0]!r}")
        if self.mesh is None and words[0] not in ("limits", "topology", "watch"):
            raise ScriptError("the script must start with `topology`")
        out = handler(words[1:])
        if self.mesh is not None:
            out += [VIOLATION_PREFIX + v for v in self.mesh.check()]
        return out

    @property
    def m(self) -> Mesh:
        assert self.mesh is not None
        return self.mesh

    def relay(self, text: str) -> int:
        r = _int(text, "relay")
        if r not in self.m.nodes:
            raise ScriptError(f"no relay {r} in the topology")
        return r

    def links(self, text: str) -> list[Link]:
        pairs = _link_arg(text)
        for a, b in pairs:
            self.relay(str(a))
            self.relay(str(b))
        return [self.m.links[p] for p in pairs]

    @staticmethod
    def nargs(args: list[str], lo: int, hi: int | None = None) -> None:
        hi = lo if hi is None else hi
        if not lo <= len(args) <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            raise ScriptError(f"expected {want} arguments, got {len(args)}")

    # --- setup ----------------------------------------------------------------------------

    def cmd_limits(self, args: list[str]) -> list[str]:
        if self.mesh is not None:
            raise ScriptError("`limits` must come before `topology`")
        names = {f.name for f in fields(Limits)}
        overrides = {}
        for arg in args:
            name, _, value = arg.partition("=")
            if name not in names:
                raise ScriptError(f"unknown limit {name!r}")
            overrides[name] = _int(value, name)
        self.limits = Limits(**{**vars(self.limits), **overrides})
        return []

    def cmd_topology(self, args: list[str]) -> list[str]:
        if self.mesh is not None:
            raise ScriptError("`topology` may appear only once")
        self.mesh = Mesh(_topology(args), self.limits)
        return []

    # --- time ------------------------------------------------------------------------------

    def cmd_tick(self, args: list[str]) -> list[str]:
        self.nargs(args, 1)
        for _ in range(_int(args[0], "ms")):
            self.m.step_ms()
        return []

    def cmd_stabilize(self, args: list[str]) -> list[str]:
        self.nargs(args, 0, 1)
        bound = _int(args[0], "ms") if args else STABILIZE_MAX_MS
        window = 2 * self.m.limits.suspect_timeout_ms
        quiet = 0
        for _ in range(bound):
            self.m.step_ms()
            quiet = 0 if self.m.activity else quiet + 1
            if quiet >= window:
                return []
        return [f"not stable after {bound} ms"]

    def cmd_now(self, args: list[str]) -> list[str]:
        self.nargs(args, 0)
        return [f"{self.m.now} ms"]

    # --- clients ---------------------------------------------------------------------------

    def cmd_produce(self, args: list[str]) -> list[str]:
        self.nargs(args, 5)
        r = self.relay(args[0])
        core = self.m.running(r)
        if self.m.nodes[r].paused:
            raise ScriptError(f"relay {r} is paused")
        rid = self.next_request
        self.next_request += 1
        req = Request(rid, r, args[1], args[2].encode(), _int(args[3], "pseq"), args[4])
        self.m.requests[rid] = req
        tx = Transaction(req.pid, req.pseq, None, req.value.encode())
        core.produce(ProduceRequest(rid, req.stream, tx), self.m.clock(r), self.m.now)
        self.m.drain(r)
        return []

    def cmd_read(self, args: list[str]) -> list[str]:
        self.nargs(args, 3, 4)
        r = self.relay(args[0])
        stream = args[1]
        try:
            after = int(args[2])
        except ValueError:
            after = self.m.seq_of_value(stream, args[2])
        limit = _int(args[3], "max") if len(args) > 3 else 1_000
        result = self.m.running(r).read(stream, after, limit)
        m = self.m
        if result.status is ReadStatus.OK:
            values = " ".join(m.value(s) for s, _ in result.entries)
            return [
                f"ok [{values}] committed={m.point(stream, result.committed)} "
                f"oldest={m.point(stream, result.oldest)}"
            ]
        if result.status is ReadStatus.OUT_OF_RANGE:
            return [
                f"out_of_range committed={m.point(stream, result.committed)} "
                f"oldest={m.point(stream, result.oldest)}"
            ]
        if not result.redirect:
            return [result.status.value]
        return [f"{result.status.value} -> [{' '.join(map(str, result.redirect))}]"]

    def cmd_replies(self, args: list[str]) -> list[str]:
        self.nargs(args, 0)
        out = []
        for relay, reply in self.m.replies:
            req = self.m.requests.get(reply.request_id)
            if req is None:
                out.append(f"relay {relay} answered unknown request {reply.request_id}")
                continue
            head = (
                f"#{req.rid} {req.stream} {req.pid.decode()}/{req.pseq}={req.value} at {req.relay}:"
            )
            if relay != req.relay:
                head += f" (answered by {relay})"
            if reply.outcome is Outcome.COMMITTED:
                out.append(f"{head} committed {self.m.committed_seq(req.stream, reply.seq)}")
            elif reply.outcome is Outcome.REJECTED:
                out.append(f"{head} rejected {reply.reason}")
            elif reply.outcome is Outcome.FENCED:
                out.append(f"{head} fenced -> [{' '.join(map(str, reply.redirect))}]")
            else:
                out.append(f"{head} {reply.outcome.value}")
        self.m.replies = []
        return out or ["none"]

    # --- the network -----------------------------------------------------------------------

    def cmd_cut(self, args: list[str]) -> list[str]:
        self.nargs(args, 1)
        for link in self.links(args[0]):
            link.cut = True
            link.lost += len(link.queue)
            link.queue.clear()
        return []

    def cmd_closed(self, args: list[str]) -> list[str]:
        self.nargs(args, 1)
        pairs = _link_arg(args[0])
        self.links(args[0])  # both relays exist
        for src, dst in pairs:
            core = self.m.nodes[dst].core
            if core is None:
                raise ScriptError(f"relay {dst} is not running")
            core.peer_lost(src, self.m.clock(dst), self.m.now)
            self.m.drain(dst)
        return []

    def cmd_hold(self, args: list[str]) -> list[str]:
        self.nargs(args, 1)
        for link in self.links(args[0]):
            link.held = True
        return []

    def cmd_release(self, args: list[str]) -> list[str]:
        self.nargs(args, 1)
        for link in self.links(args[0]):
            link.held = False
        return []

    def cmd_drop(self, args: list[str]) -> list[str]:
        self.nargs(args, 2)
        for link in self.links(args[0]):
            link.drop += _int(args[1], "count")
        return []

    def cmd_deliver(self, args: list[str]) -> list[str]:
        self.nargs(args, 1, 2)
        ((_, dst),) = _link_arg(args[0])
        (link,) = self.links(args[0])
        count = _int(args[1], "count") if len(args) > 1 else len(link.queue)
        node = self.m.nodes[dst]
        if node.core is None or node.paused:
            raise ScriptError(f"relay {dst} is not running")
        for _ in range(min(count, len(link.queue))):
            _, frame = link.queue.popleft()
            node.core.receive(frame, self.m.clock(dst), self.m.now)
        self.m.drain(dst)
        return []

    def cmd_isolate(self, args: list[str]) -> list[str]:
        self.nargs(args, 1)
        r = self.relay(args[0])
        for o in self.m.ids:
            if o != r:
                self.cmd_cut([f"{r}<->{o}"])
        return []

    def cmd_heal(self, args: list[str]) -> list[str]:
        self.nargs(args, 0)
        for link in self.m.links.values():
            link.cut = link.held = False
            link.drop = 0
        return []

    def cmd_queue(self, args: list[str]) -> list[str]:
        self.nargs(args, 1, 2)
        (link,) = self.links(args[0])
        if not link.queue:
            return ["empty"]
        limit = _int(args[1], "count") if len(args) > 1 else len(link.queue)
        out: list[str] = []
        repeats = 0
        for _, frame in list(link.queue)[:limit]:
            if frame == CLOSED:
                line = "connection closed"
            else:
                line = self._summary(codec.decode(frame, self.m.limits.max_frame_bytes))
            if out and out[-1] == line:
                repeats += 1
                continue
            if repeats:
                out[-1] += f" (x{repeats + 1})"
            out.append(line)
            repeats = 0
        if repeats:
            out[-1] += f" (x{repeats + 1})"
        if limit < len(link.queue):
            out.append(f"... {len(link.queue) - limit} more")
        return out

    def _summary(self, msg: PeerMessage) -> str:
        name = type(msg).__name__
        if isinstance(msg, TxBatch):
            return f"{name} {msg.stream} [{' '.join(self.m.value(s) for s, _ in msg.entries)}]"
        if isinstance(msg, Reports):
            return f"{name} {msg.stream} {len(msg.points)} points"
        if isinstance(msg, (JoinRequest, JoinReply, RepairRequest, RepairReply, Forward)):
            return f"{name} {msg.stream}"
        if isinstance(msg, ForwardReply):
            return f"{name} {msg.outcome.value}"
        return name

    # --- relays ----------------------------------------------------------------------------

    def cmd_pause(self, args: list[str]) -> list[str]:
        self.nargs(args, 1)
        r = self.relay(args[0])
        self.m.running(r)
        self.m.nodes[r].paused = True
        return []

    def cmd_resume(self, args: list[str]) -> list[str]:
        self.nargs(args, 1)
        self.m.nodes[self.relay(args[0])].paused = False
        return []

    def cmd_crash(self, args: list[str]) -> list[str]:
        self.nargs(args, 1)
        self.m.crash(self.relay(args[0]))
        return []

    def cmd_restart(self, args: list[str]) -> list[str]:
        self.nargs(args, 1, 64)
        rest = args[1:]
        wiped = bool(rest) and rest[0] == "wiped"
        if wiped:
            rest = rest[1:]
        topology = None
        if rest:
            if rest[0] != "topology" or len(rest) < 2:
                raise ScriptError("expected `restart R [wiped] [topology SPEC ...]`")
            topology = _topology(rest[1:])
        self.m.restart(self.relay(args[0]), topology, wiped=wiped)
        return []

    def cmd_reload(self, args: list[str]) -> list[str]:
        self.nargs(args, 3, 64)
        if args[1] != "topology":
            raise ScriptError("expected `reload R topology SPEC ...`")
        self.m.reload(self.relay(args[0]), _topology(args[2:]))
        return []

    def cmd_skew(self, args: list[str]) -> list[str]:
        self.nargs(args, 2)
        self.m.nodes[self.relay(args[0])].offset_ms = _int(args[1], "ms")
        return []

    def cmd_step(self, args: list[str]) -> list[str]:
        self.nargs(args, 2)
        self.m.nodes[self.relay(args[0])].offset_ms += _int(args[1], "ms")
        return []

    # --- observing -------------------------------------------------------------------------

    def cmd_show(self, args: list[str]) -> list[str]:
        relays = [self.relay(a) for a in args] or list(self.m.ids)
        out = []
        for r in relays:
            node = self.m.nodes[r]
            core = node.core
            if core is None:
                out.append(f"{r}: crashed")
                continue
            paused = " (paused)" if node.paused else ""
            status = core.status()
            heard = status["peers_heard"]
            assert isinstance(heard, list)
            shown = " ".join(
                f"{k}={v}"
                for k, v in sorted(core.counters.items())
                if v and any(fnmatch.fnmatchcase(k, p) for p in self.watch)
            )
            heard_ids = " ".join(map(str, heard))
            out.append(f"{r}/{node.incarnation}{paused} hears [{heard_ids}] {shown}".rstrip())
            streams = status["streams"]
            assert isinstance(streams, dict)
            for stream, st in streams.items():
                values = " ".join(self.m.value(s) for s in self.m.delivered(r, stream))
                reason = st["fence_reason"]
                admitted = " ".join(map(str, st["admitted"]))
                line = (
                    f"  {stream}: "
                    f"{'joined' if core.joined(stream) else 'joining'} "
                    f"{f'fenced:{reason}' if reason else 'unfenced'} "
                    f"view={st['view']}[{admitted}] "
                    f"committed={self.m.point(stream, st['committed'])} "
                    f"delivered=[{values}]"
                )
                for extra in ("late", "pending"):
                    if st[extra]:
                        line += f" {extra}={st[extra]}"
                if st["repairing"]:
                    line += " repairing"
                if st["history_lost"]:
                    line += " history_lost"
                out.append(line + _configuration(st["config"]))
            not_member = status["not_member"]
            assert isinstance(not_member, dict)
            for stream, config in not_member.items():
                out.append(f"  {stream}: not a member{_configuration(config, always=True)}")
        return out

    def cmd_clocks(self, args: list[str]) -> list[str]:
        self.nargs(args, 0)
        true_ms = wall_ms(START_UNIX_MS + self.m.now)
        out = []
        for r in self.m.ids:
            node = self.m.nodes[r]
            if node.core is None:
                out.append(f"{r}: crashed")
                continue
            floor = ms_of(node.core.clock.floor) - true_ms
            out.append(f"{r}: clock {node.offset_ms:+d} ms, floor {floor:+d} ms")
        return out

    def cmd_watch(self, args: list[str]) -> list[str]:
        if not args:
            raise ScriptError("expected counter patterns")
        replace = [a for a in args if a[0] not in "+-"]
        if replace:
            self.watch = []
        for arg in args:
            if arg.startswith("-"):
                self.watch = [p for p in self.watch if p != arg[1:]]
            else:
                self.watch.append(arg.removeprefix("+"))
        return []

    def cmd_delivered(self, args: list[str]) -> list[str]:
        self.nargs(args, 2)
        values = " ".join(self.m.value(s) for s in self.m.delivered(self.relay(args[0]), args[1]))
        return [f"[{values}]"]

    def cmd_counters(self, args: list[str]) -> list[str]:
        if not args:
            raise ScriptError("expected a relay")
        core = self.m.running(self.relay(args[0]))
        names = args[1:] or sorted(k for k, v in core.counters.items() if v)
        return [" ".join(f"{k}={core.counters.get(k, 0)}" for k in names) or "none"]


def run_script(text: str) -> str:
    """Run a scenario; return its text with every output block regenerated."""
    interp = Interpreter()
    out: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith(">"):
            continue  # old output: regenerated below its command
        out.append(raw)
        command = stripped.split("#", 1)[0].strip() if not stripped.startswith("#") else ""
        if not command:
            continue
        try:
            printed = interp.execute(command)
        except ScriptError as error:
            raise ScriptError(f"line {number}: {command}: {error}") from None
        out.extend((OUTPUT_PREFIX + line).rstrip() for line in printed)
    return "\n".join(out) + "\n"
