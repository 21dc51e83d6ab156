"""Hostile-input bounds of the core (issue 11, part 3), on real cores over the scenario
network (relay.sim.script.Mesh): simulated milliseconds, no wall clock.

- Thousands of streams opened by reads (a client reading new `orders.*` names) cost no
  view change, go dormant, and do not hold up commits of a stream in use
  (docs/protocol.md 5.11, 5.12).
- A frame claiming an incarnation far beyond any relay's clock is refused, so it cannot
  make a real relay's messages look stale (section 3).
- A frame claiming a link counter far ahead of the sender's cannot make the sender's
  later messages look like duplicates (5.2).
"""

from __future__ import annotations

from relay.core import codec, links
from relay.core.config import Limits, Topology
from relay.core.messages import Heartbeat, Outcome, Reports, Transaction
from relay.core.seq import EPOCH_MS
from relay.core.shell import ProduceReply, ProduceRequest
from relay.sim.script import START_UNIX_MS, Mesh

STREAM = "orders.eu"
RELAYS = (0, 1, 2)
MAX_U63 = (1 << 63) - 1
SETTLE_MS = 600  # start, join, first view: far more than they take
COMMIT_BOUND_MS = 100  # a produce to a settled 3-relay mesh commits well within this


def mesh_with(limits: Limits | None = None) -> Mesh:
    """Three relays serving `orders.eu` (named: joined and in use from the start) and any
    other `orders.*` name (opened on first use), settled."""
    mesh = Mesh(Topology({r: (STREAM, "orders.*") for r in RELAYS}), limits or Limits())
    run(mesh, SETTLE_MS)
    return mesh


def run(mesh: Mesh, ms: int) -> None:
    for _ in range(ms):
        mesh.step_ms()


def produce(mesh: Mesh, relay: int, request_id: int, stream: str = STREAM) -> None:
    tx = Transaction(b"p", request_id, None, b"v%d" % request_id)
    mesh.running(relay).produce(ProduceRequest(request_id, stream, tx), mesh.clock(relay), mesh.now)
    mesh.drain(relay)


def answer(mesh: Mesh, request_id: int) -> ProduceReply | None:
    return next((r for _, r in mesh.replies if r.request_id == request_id), None)


def commits_within(mesh: Mesh, relay: int, request_id: int, bound_ms: int) -> int:
    """Produce through `relay`; the simulated ms it took to be answered `committed`."""
    produce(mesh, relay, request_id)
    for waited in range(1, bound_ms + 1):
        mesh.step_ms()
        got = answer(mesh, request_id)
        if got is not None:
            assert got.outcome is Outcome.COMMITTED, got
            return waited
    raise AssertionError(f"request {request_id} through relay {relay} unanswered in {bound_ms}")


def counter(mesh: Mesh, name: str) -> int:
    return sum(mesh.running(r).counters[name] for r in RELAYS)


def forge(mesh: Mesh, target: int, msg: Heartbeat | Reports) -> None:
    """A well-formed frame that claims to be `msg.sender`'s, straight into `target`."""
    mesh.running(target).receive(codec.encode(msg), mesh.clock(target), mesh.now)
    mesh.drain(target)


# --- thousands of streams opened by reads ---------------------------------------------------


def test_streams_opened_by_reads_cost_no_view_change_nor_hold_up_commits() -> None:
    limits = Limits(heartbeat_repeated_statuses=16)  # fewer than the streams: taken in turn
    mesh = mesh_with(limits)
    assert commits_within(mesh, 0, 1, COMMIT_BOUND_MS)
    proposed = counter(mesh, "view_proposed")
    flood = [f"orders.flood{i}" for i in range(300)]
    for name in flood:
        mesh.running(0).read(name, -1, 10)  # opens the stream (not_ready: joining)
    # Joining all of them, the mesh still commits the stream in use within the bound, and
    # through every relay.
    for r in RELAYS:
        assert commits_within(mesh, r, 10 + r, COMMIT_BOUND_MS)
    run(mesh, SETTLE_MS)
    for r in RELAYS:
        core = mesh.running(r)
        assert all(core.joined(name) for name in flood), r
        # Nobody wrote to them: no view, and nothing to do until an input concerns them.
        assert all(core.streams[name].view.number == 0 for name in flood)
        assert all(core.streams[name].dormant for name in flood), r
    assert counter(mesh, "view_proposed") == proposed
    # A heartbeat now gives the statuses of the streams in turn, not all of them.
    core = mesh.running(1)
    core.tick(mesh.clock(1), mesh.now + limits.quiet_interval_ms)
    beats = [
        m
        for m in (codec.decode(o.frame, limits.max_frame_bytes) for o in core.ready().outgoing)
        if isinstance(m, Heartbeat)
    ]
    assert beats and all(len(b.streams) <= limits.heartbeat_repeated_statuses for b in beats)


def test_a_stream_opened_by_reads_gets_its_view_with_the_first_produce() -> None:
    mesh = mesh_with()
    mesh.running(2).read("orders.new", -1, 10)
    run(mesh, SETTLE_MS)
    assert all(mesh.running(r).streams["orders.new"].dormant for r in RELAYS)
    proposed = counter(mesh, "view_proposed")
    # The first produce finds nobody admitted: `fenced` (not_admitted), retry elsewhere or
    # later. It puts the stream in use: its members ask to be admitted, one proposes.
    produce(mesh, 1, 1, "orders.new")
    first = answer(mesh, 1)
    assert first is not None and first.outcome is Outcome.FENCED
    run(mesh, 100)
    assert counter(mesh, "view_proposed") > proposed
    assert all(mesh.running(r).streams["orders.new"].view.number > 0 for r in RELAYS)
    produce(mesh, 1, 2, "orders.new")
    run(mesh, COMMIT_BOUND_MS)
    retry = answer(mesh, 2)
    assert retry is not None and retry.outcome is Outcome.COMMITTED, retry


IDLE_CLOSE_MS = 1_000  # a short idle time, so the scenarios stay short
READ_EVERY_MS = 200  # a reader polling well within it
CLOSING = Limits(idle_stream_close_ms=IDLE_CLOSE_MS, unread_stream_close_ms=IDLE_CLOSE_MS // 4)


def tracking(mesh: Mesh, stream: str) -> list[int]:
    return [r for r in RELAYS if mesh.running(r).has_stream(stream)]


def test_a_blank_stream_closes_when_idle_and_stays_closed() -> None:
    """Opened by one read through relay 2, on every member (its join); closed everywhere
    once no read reached it for idle_stream_close_ms (at the members it did not reach,
    unread_stream_close_ms after their join); the heartbeats that follow do not open it
    again. Reads through relay 0 keep it open there (and only there)."""
    mesh = mesh_with(CLOSING)
    mesh.running(2).read("orders.idle", -1, 10)

    def keep_reading(ms: int) -> None:
        for _ in range(ms // READ_EVERY_MS):
            mesh.running(0).read("orders.kept", -1, 10)
            run(mesh, READ_EVERY_MS)

    keep_reading(READ_EVERY_MS)  # a join round
    assert tracking(mesh, "orders.idle") == list(RELAYS)
    assert tracking(mesh, "orders.kept") == list(RELAYS)
    keep_reading(CLOSING.unread_stream_close_ms + 2 * READ_EVERY_MS)
    assert tracking(mesh, "orders.idle") == [2]
    assert tracking(mesh, "orders.kept") == [0]
    keep_reading(3 * IDLE_CLOSE_MS)
    assert tracking(mesh, "orders.idle") == []
    assert tracking(mesh, "orders.kept") == [0]
    closed = [(0, "orders.idle"), (1, "orders.idle"), (1, "orders.kept")]
    assert sorted(mesh.closed) == [*closed, (2, "orders.idle"), (2, "orders.kept")]
    keep_reading(3 * IDLE_CLOSE_MS)  # relay 0's heartbeats give its status of orders.kept
    assert tracking(mesh, "orders.kept") == [0]
    assert counter(mesh, "streams_closed_idle") == 5
    # The stream in use is untouched: it commits through every relay.
    for r in RELAYS:
        assert commits_within(mesh, r, 20 + r, COMMIT_BOUND_MS)


def test_a_closed_stream_opens_again_and_commits_with_its_first_produce() -> None:
    """Closed on relays 1 and 2 (read only through 0), the stream is first written through
    relay 1: every member opens it again, its first view is decided, and a retry commits
    and is delivered on every member. The link counters went on where they stopped."""
    mesh = mesh_with(CLOSING)
    for _ in range(5):
        mesh.running(0).read("orders.late", -1, 10)
        run(mesh, IDLE_CLOSE_MS // 2)
    assert tracking(mesh, "orders.late") == [0]
    produce(mesh, 1, 1, "orders.late")
    first = answer(mesh, 1)
    assert first is not None and first.outcome is Outcome.FENCED
    run(mesh, SETTLE_MS)
    assert tracking(mesh, "orders.late") == list(RELAYS)
    assert all(mesh.running(r).streams["orders.late"].view.number > 0 for r in RELAYS)
    assert mesh.running(1).streams["orders.late"].link_seq_out > 1  # went on, not from 0
    produce(mesh, 1, 2, "orders.late")
    run(mesh, COMMIT_BOUND_MS)
    retry = answer(mesh, 2)
    assert retry is not None and retry.outcome is Outcome.COMMITTED, retry
    run(mesh, SETTLE_MS)
    for r in RELAYS:
        got = mesh.running(r).read("orders.late", -1, 10)
        assert [tx.producer_seq for _, tx in got.entries] == [2], r
    # Written now: in use, it never closes.
    run(mesh, 3 * IDLE_CLOSE_MS)
    assert tracking(mesh, "orders.late") == list(RELAYS)


def test_new_streams_written_at_once_get_their_views_without_duels() -> None:
    """The first view of a stream admits nobody, so every member asks for it at once: the
    lowest live member proposes, the others wait (view.VIEW_DEFER_MS) instead of duelling:
    every proposal is decided, none is refused or times out."""
    mesh = mesh_with()
    names = [f"orders.w{i}" for i in range(30)]
    before = {c: counter(mesh, c) for c in ("view_proposed", "view_decided", "view_refused")}
    for i, name in enumerate(names):
        produce(mesh, i % 3, 100 + i, name)  # fenced (joining); puts it in use
    run(mesh, SETTLE_MS)
    proposed = counter(mesh, "view_proposed") - before["view_proposed"]
    assert len(names) <= proposed == counter(mesh, "view_decided") - before["view_decided"]
    assert counter(mesh, "view_refused") == before["view_refused"]
    assert counter(mesh, "view_round_timeout") == counter(mesh, "view_takeover") == 0
    for i, name in enumerate(names):
        produce(mesh, (i + 1) % 3, 200 + i, name)
    run(mesh, COMMIT_BOUND_MS)
    for i in range(len(names)):
        got = answer(mesh, 200 + i)
        assert got is not None and got.outcome is Outcome.COMMITTED, (names[i], got)


# --- the incarnation bound ---------------------------------------------------------------------


def heartbeat_of(mesh: Mesh, sender: int, incarnation: int) -> Heartbeat:
    core = mesh.running(sender)
    return Heartbeat(
        sender=sender,
        incarnation=incarnation,
        floor=core.clock.floor,
        streams=(),
        wall_ms=mesh.clock(sender),
        hears=tuple(r for r in RELAYS if r != sender),
    )


def test_a_forged_heartbeat_with_a_huge_incarnation_is_refused() -> None:
    mesh = mesh_with()
    forge(mesh, 0, heartbeat_of(mesh, 1, MAX_U63))
    core = mesh.running(0)
    assert core.counters["incarnation_implausible"] == 1
    assert core.peers[1].incarnation == 1  # relay 1's real incarnation still counts
    run(mesh, SETTLE_MS)
    assert core.counters["stale_incarnation"] == 0
    assert links.is_live(core, core.peers[1], mesh.now)
    for r in RELAYS:
        assert commits_within(mesh, r, 1 + r, COMMIT_BOUND_MS)
    assert [mesh.running(r).streams[STREAM].view.number for r in RELAYS] == [1, 1, 1]


def test_the_incarnation_bound_is_the_clock_plus_max_clock_ahead() -> None:
    """A relay takes max(last + 1, wall ms since EPOCH_MS) at each start: up to the
    receiver's clock plus max_clock_ahead_ms is a restart, above it a lie."""
    mesh = mesh_with()
    core = mesh.running(0)
    cap = links.incarnation_cap(core, mesh.now)
    # (the majority's clock: ours, give or take the millisecond our peers' heartbeats take)
    assert abs(cap - (mesh.clock(0) - EPOCH_MS + core.limits.max_clock_ahead_ms)) <= 1
    forge(mesh, 0, heartbeat_of(mesh, 1, cap + 1))
    assert core.counters["incarnation_implausible"] == 1
    assert core.peers[1].incarnation == 1
    forge(mesh, 0, heartbeat_of(mesh, 1, cap))
    assert core.counters["incarnation_implausible"] == 1
    assert core.peers[1].incarnation == cap  # taken as a restart of relay 1
    assert cap > START_UNIX_MS - EPOCH_MS


# --- the link counter bound ---------------------------------------------------------------------


def reports_of(mesh: Mesh, sender: int, link_seq: int) -> Reports:
    core = mesh.running(sender)
    return Reports(
        sender=sender,
        incarnation=core.incarnation,
        floor=0,
        stream=STREAM,
        link_seq=link_seq,
        points=(),
        committed_point=-1,
        committed_digest=bytes(16),
        config=core.streams[STREAM].config_version,  # (5.15: else not taken at all)
    )


def test_a_forged_huge_link_seq_does_not_drop_the_senders_later_messages() -> None:
    mesh = mesh_with()
    forge(mesh, 0, reports_of(mesh, 1, MAX_U63))
    core = mesh.running(0)
    assert core.peers[1].links[STREAM].expected == MAX_U63 + 1
    # Relay 1's next real message on the stream (its transactions here) is below that
    # count and was never received: the link follows relay 1's count again.
    duplicates = core.counters["link_duplicate"]
    assert commits_within(mesh, 1, 1, COMMIT_BOUND_MS)
    assert core.counters["link_rewound"] == 1
    assert core.peers[1].links[STREAM].expected < 1_000
    run(mesh, 50)
    assert core.counters["link_duplicate"] == duplicates
    assert mesh.delivered(0, STREAM) == mesh.delivered(1, STREAM) != []
    for r in RELAYS:
        assert commits_within(mesh, r, 10 + r, COMMIT_BOUND_MS)
    run(mesh, 50)
    assert mesh.delivered(0, STREAM) == mesh.delivered(1, STREAM) == mesh.delivered(2, STREAM)


def test_a_forged_small_jump_drops_no_real_message_and_duplicates_still_are() -> None:
    mesh = mesh_with()
    core = mesh.running(0)
    expected = core.peers[1].links[STREAM].expected
    forge(mesh, 0, reports_of(mesh, 1, expected + 5))
    for n in range(1, 8):  # relay 1's next real messages take the counts the lie claimed
        assert commits_within(mesh, 1, n, COMMIT_BOUND_MS)
        assert mesh.delivered(0, STREAM) == mesh.delivered(1, STREAM)
    assert core.counters["link_rewound"] == 1
    # A frame that arrived once is a duplicate the second time.
    frame = codec.encode(reports_of(mesh, 1, core.peers[1].links[STREAM].expected))
    duplicates = core.counters["link_duplicate"]
    for _ in range(2):
        core.receive(frame, mesh.clock(0), mesh.now)
    assert core.counters["link_duplicate"] == duplicates + 1
