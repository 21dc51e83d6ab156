"""Messages between relays (docs/protocol.md section 3), and the values they carry.

Peer messages are frozen msgspec Structs: one is made for every frame a relay takes or
sends, and a Struct is built in C, where a frozen dataclass runs its generated `__init__`
interpreted (even in a module mypyc compiles). The module is never compiled
(relay/core/structs.py says why). The codec (`relay.core.codec`) turns each message into
one msgpack frame and back, validating every field where remote bytes enter. Every peer
message starts with the same header: the sender's relay id, its incarnation (a number that grows
with every start of the relay) and its floor (the sequence number it promises never to
coordinate at or below).

Messages about one stream (`TxBatch`, `Reports`, `JoinRequest`) are published on that
stream's topic and carry `link_seq`: the sender's count of messages it has published for
that stream in this incarnation (1, 2, 3 ...). A receiver that sees a jump knows a message
was lost before any digest disagrees. Directed messages (to one relay) carry `target`.

What the core and its shell pass each other is in `relay.core.shell`.
"""

from __future__ import annotations

import enum
from typing import get_args

import msgspec

# A transaction (a msgspec Struct, defined with the core's other Structs)
from relay.core.structs import TX_OVERHEAD_BYTES as TX_OVERHEAD_BYTES
from relay.core.structs import Transaction as Transaction

# (seq, transaction): one timeline entry on the wire
Entry = tuple[int, Transaction]
# (point, digest): one digest report
Report = tuple[int, bytes]
# (producer_id, producer_seq, seq, content hash): one key of the deduplication window;
# the hash (digest.tx_hash) tells a retry of the same transaction from another one
# reusing its producer sequence
DedupeKey = tuple[bytes, int, int, bytes]
# (relay, point): "I have received every report of `relay` up to `point`"
Ack = tuple[int, int]


class Outcome(enum.Enum):
    COMMITTED = "committed"  # seq is the committed sequence number
    REJECTED = "rejected"  # definitely never delivered; reason says why
    UNKNOWN = "unknown"  # no definite answer in time; retry with the same producer seq
    FENCED = "fenced"  # not accepted here; redirect lists relays to try


class RejectReason(enum.Enum):
    LATE = "late"  # a committed prefix beyond its seq does not contain it
    UNKNOWN_STREAM = "unknown_stream"
    TOO_LARGE = "too_large"
    BUFFER_FULL = "buffer_full"
    # the (producer id, producer seq) belongs to a transaction of other content (5.6)
    DUPLICATE_MISMATCH = "duplicate_mismatch"
    # the relay tracks max_streams streams already, or the client opened its share (5.10)
    TOO_MANY_STREAMS = "too_many_streams"
    # fewer than a quorum of the stream's members can spool more (5.14): retry later
    STORE_BACKLOG_FULL = "store_backlog_full"


class ReadStatus(enum.Enum):
    """How a read was answered (the client protocol carries it too)."""

    OK = "ok"
    REDIRECT = "redirect"  # this relay does not serve the stream
    FENCED = "fenced"  # this relay cannot reach a quorum for the stream
    NOT_READY = "not_ready"  # still joining the stream
    OUT_OF_RANGE = "out_of_range"  # position older than the buffer
    UNKNOWN_STREAM = "unknown_stream"


# --- peer messages ------------------------------------------------------------------------


class TxBatch(msgspec.Struct, frozen=True):
    """New transactions a coordinator issued for a stream (channel `in`)."""

    sender: int
    incarnation: int
    floor: int
    stream: str
    link_seq: int
    entries: tuple[Entry, ...]


class Reports(msgspec.Struct, frozen=True):
    """Digest reports, in increasing point order, never repeated (channel `wr`); also
    announces the sender's highest committed (delivered) point and its digest."""

    sender: int
    incarnation: int
    floor: int
    stream: str
    link_seq: int
    points: tuple[Report, ...]
    committed_point: int
    committed_digest: bytes
    acks: tuple[Ack, ...] = ()  # the sender's knowledge of the other members' reports
    # The sender's lead on the stream (5.2): it will never coordinate a transaction of the
    # stream at or below it in this incarnation, and it published every one it did before
    # this message (-1: none). Unlike `floor`, receivers do not follow it.
    lead: int = -1
    # The version of the configuration (5.15) the reports were made under: a receiver
    # counts them only under the same one.
    config: int = 0


class JoinRequest(msgspec.Struct, frozen=True):
    """A relay that starts without history asks the stream's members where the stream
    stands (channel `ae`). `need_point` is -1 on the first round; later rounds ask for a
    base at or above it."""

    sender: int
    incarnation: int
    floor: int
    stream: str
    link_seq: int
    need_point: int
    # The requester's configuration of the stream (5.15): version (0: provisional, its
    # topology's) and relays. Members answer only a request under a configuration they
    # can agree with; anyone answers with its own, so the requester can learn it.
    config: int = 0
    members: tuple[int, ...] = ()


class StreamStatus(msgspec.Struct, frozen=True):
    stream: str
    last_link_seq: int  # link_seq of the last message the sender published for the stream
    committed_point: int
    committed_digest: bytes
    joined: bool
    acks: tuple[Ack, ...] = ()
    # Every report the sender ever made (in any incarnation) at or below
    # votes_final_through is one the receiver got from it or is listed in `inherited`, and
    # it will make none there in future: a promise given after a restart (inherited: its
    # earlier incarnations' reports that any member saw, above its committed point), while
    # joining, and while it holds its reports back because of a split. -1: no promise.
    inherited: tuple[Report, ...] = ()
    votes_final_through: int = -1
    view: int = 0  # the number of the sender's view of the stream (5.12)
    want_in: bool = False  # the sender has joined and asks to be admitted to the view
    # (member, its votes_final_through) for each member whose inherited reports the
    # sender counted, in full, for the member's current incarnation (5.8): that member
    # need not send them to the sender again
    inherited_acks: tuple[Ack, ...] = ()
    # The sender left its inherited reports out (every member counted them already): a
    # receiver that has not counted them must ignore votes_final_through (5.8)
    inherited_omitted: bool = False
    # The sender's configuration of the stream (5.15): version and relays. A receiver
    # takes the rest of the status only under a configuration it agrees with.
    config: int = 0
    members: tuple[int, ...] = ()
    # The relays the sender's topology names for the stream, when they are not those of
    # its configuration (5.15 changes: a quorum of members wanting the same ones starts
    # the change); empty otherwise.
    wanted: tuple[int, ...] = ()


class Heartbeat(msgspec.Struct, frozen=True):
    """Liveness and floor, sent on `hb` every heartbeat interval (and promptly when the
    floor moves while nothing else is being sent). `wall_ms` is the sender's wall clock
    when it sent it: members compare clocks (5.2)."""

    sender: int
    incarnation: int
    floor: int
    streams: tuple[StreamStatus, ...]
    wall_ms: int = 0
    hears: tuple[int, ...] = ()  # the peers the sender hears directly (not suspected)
    # 5.11 quiet: the sender's next heartbeat comes within interval_ms (0: the usual
    # heartbeat interval), and whether it has nothing in flight (it could go quiet)
    interval_ms: int = 0
    settled: bool = False
    # 5.14 the sender's spool has no room for what it holds: it votes on no stream
    spool_full: bool = False


class Forward(msgspec.Struct, frozen=True):
    """A produce received by a relay outside the stream's set, passed to a member."""

    sender: int
    incarnation: int
    floor: int
    target: int
    stream: str
    request_id: int
    tx: Transaction


class ForwardReply(msgspec.Struct, frozen=True):
    sender: int
    incarnation: int
    floor: int
    target: int
    request_id: int
    outcome: Outcome
    seq: int
    reason: str
    redirect: tuple[int, ...]


class JoinReply(msgspec.Struct, frozen=True):
    sender: int
    incarnation: int
    floor: int
    target: int
    stream: str
    fresh: bool  # the sender holds no history of the stream either
    committed_point: int
    committed_digest: bytes
    max_seen_reported: int  # highest point the sender has seen reported by anyone, -1 none
    dedupe: tuple[DedupeKey, ...] | None  # the dedupe window as of committed_point, if asked
    your_votes: tuple[Report, ...] = ()  # reports of the requester's earlier incarnations seen
    view: ViewValue | None = None  # the sender's view of the stream (5.12)
    # The sender's configuration of the stream (5.15): the answer counts only under the
    # same one; an established one (version >= 1) teaches a provisional requester.
    config: int = 0
    members: tuple[int, ...] = ()


class RepairRequest(msgspec.Struct, frozen=True):
    """Ask `target` for its entries with lo < seq <= hi. origin >= 0 asks only for
    transactions that relay coordinated (filling a gap on a link)."""

    sender: int
    incarnation: int
    floor: int
    target: int
    stream: str
    request_id: int
    lo: int
    hi: int
    origin: int


class RepairStatus(enum.Enum):
    OK = "ok"
    TOO_OLD = "too_old"  # lo lies before the responder's buffer


class RepairReply(msgspec.Struct, frozen=True):
    sender: int
    incarnation: int
    floor: int
    target: int
    stream: str
    request_id: int
    status: RepairStatus
    lo: int
    hi: int  # entries cover lo < seq <= hi (may stop short of the request: `more`)
    more: bool
    entries: tuple[Entry, ...]
    reports: tuple[Report, ...]  # the responder's own reports in (lo, hi]
    config: int = 0  # the configuration version its reports and entries are of (5.15)


class Interval(msgspec.Struct, frozen=True):
    """One admission of a member to a stream's view: the transactions it coordinated in
    incarnation `incarnation` with since < seq (and seq <= cut, once cut) count; its
    floor holds the watermark while the interval is open (cut = -1)."""

    member: int
    incarnation: int
    since: int
    cut: int = -1


class ViewValue(msgspec.Struct, frozen=True):
    """A stream's view as a view change decided it (5.12): every member's admissions,
    from `start` on; and `entries`, every transaction with lo < seq <= cut of the members
    whose interval this change cut, so that every member holds exactly those. `config`
    and `members`: the configuration it was decided under (5.15), which the first view
    establishes as version 1."""

    number: int
    start: int
    lo: int
    intervals: tuple[Interval, ...]
    entries: tuple[Entry, ...] = ()
    config: int = 0
    members: tuple[int, ...] = ()


class ViewPhase(enum.Enum):
    PREPARE = "prepare"  # proposer -> acceptor: promise ballot, freeze, say what you hold
    PROMISE = "promise"  # acceptor -> proposer
    ACCEPT = "accept"  # proposer -> acceptor: accept this value
    ACCEPTED = "accepted"  # acceptor -> proposer


class ViewRequest(msgspec.Struct, frozen=True):
    """A view change's proposer to one member (PREPARE or ACCEPT) for instance `view`.
    `excluding`: the members whose open intervals the proposer means to cut (the promise
    returns their transactions); `value` only with ACCEPT."""

    sender: int
    incarnation: int
    floor: int
    target: int
    stream: str
    phase: ViewPhase
    view: int
    ballot: int
    excluding: tuple[int, ...] = ()
    value: ViewValue | None = None
    # The proposer's configuration (5.15): an acceptor under another one refuses.
    config: int = 0
    members: tuple[int, ...] = ()
    # A change of the stream's relays: the relays it moves to (5.15 changes; empty: none)
    moving_to: tuple[int, ...] = ()


class ViewReply(msgspec.Struct, frozen=True):
    """A member's answer (PROMISE or ACCEPTED) to a ViewRequest. Not `ok`: it promised a
    higher ballot (`promised`), or its view is not `view` - 1. A promise carries the
    member's last reported point and committed point, what it accepted before in this
    instance, and the transactions it holds of the members to be excluded."""

    sender: int
    incarnation: int
    floor: int
    target: int
    stream: str
    phase: ViewPhase
    view: int
    ballot: int
    ok: bool
    promised: int = -1
    reported: int = -1
    committed: int = -1
    accepted_ballot: int = -1
    accepted: ViewValue | None = None
    entries: tuple[Entry, ...] = ()
    # The acceptor's configuration (5.15): a proposer counts the answer only under its own.
    config: int = 0
    members: tuple[int, ...] = ()
    # A promise: the point through which the acceptor holds every transaction the view
    # counts (its watermark, once joined; -1 while joining). A change of the stream's
    # relays is proposed only if a quorum of the new relays hold it through its start
    # (5.15 changes).
    holds: int = -1


class ViewDecided(msgspec.Struct, frozen=True):
    """A decided view, sent to every member (and again to any member seen behind)."""

    sender: int
    incarnation: int
    floor: int
    target: int
    stream: str
    value: ViewValue


class Relayed(msgspec.Struct, frozen=True):
    """Another relay's frame passed on (5.13 transit): `frame` is that relay's message,
    bytes as it sent them, for relay `to`. The sender is the relay in between when `to` is
    the target; when they differ, the sender asks `target` to pass its own frame on to
    `to`, which does not hear it directly."""

    sender: int
    incarnation: int
    floor: int
    target: int
    to: int
    frame: bytes


PeerMessage = (
    TxBatch
    | Reports
    | JoinRequest
    | Heartbeat
    | Forward
    | ForwardReply
    | JoinReply
    | RepairRequest
    | RepairReply
    | ViewRequest
    | ViewReply
    | ViewDecided
    | Relayed
)

PEER_MESSAGE_TYPES: tuple[type[msgspec.Struct], ...] = get_args(PeerMessage)


def _with_field(name: str) -> frozenset[type[msgspec.Struct]]:
    return frozenset(
        c for c in PEER_MESSAGE_TYPES if any(f.name == name for f in msgspec.structs.fields(c))
    )


# The messages for one relay (they name it in `target`), and those about one stream.
DIRECTED_MESSAGES = _with_field("target")
STREAM_MESSAGES = _with_field("stream")
