"""A relay that cannot know the metadata state (it joined the metadata stream above its
genesis: a restart, a late start) gets it from a peer (docs/metadata.md section 3).

The two relays talk over the mesh, as direct messages beside the protocol's frames: a frame
that starts with META_SYNC_MARK (0xc1 never starts msgpack, so no protocol frame does) is
taken by the node, not the core.

    request  MARK + b"Q" + msgpack [request_id, offset]
    chunk    MARK + b"A" + msgpack [request_id, status, as_of, total, offset, items]

The peer answers from a copy of its fold frozen at its committed point `as_of` of the
metadata stream (the first request of an id freezes it; later offsets page through the
same copy), `items` [key, version, value] in key order, at most META_SYNC_CHUNK_BYTES
each chunk; status "not_ready" when its own view is not complete. The asker installs the
copy once it has every item, if its own buffer holds every record after `as_of` (its base
is at or below it): then folding its own committed records from there completes the view.
Otherwise it asks again later (or another peer).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from relay.core import RelayCore, Transaction
from relay.core.digest import chain, genesis, tx_hash
from relay.core.state import GENESIS_POINT
from relay.errors import FieldError, MalformedFrame
from relay.meta import METADATA_STREAM, MetaState, MetaView, Versioned
from relay.store.location import StoreArg, as_location

META_SYNC_MARK = b"\xc1M"
_REQUEST = META_SYNC_MARK + b"Q"
_CHUNK = META_SYNC_MARK + b"A"
META_SYNC_CHUNK_BYTES = 1024 * 1024  # items' bytes per chunk, at most (one at least)
META_SYNC_TIMEOUT_MS = 2_000  # a request unanswered this long goes to the next peer
META_SYNC_RETRY_MS = 500  # after a peer could not help, the next request waits this long
META_SYNC_FROZEN_MAX = 8  # frozen copies a relay keeps for askers paging through them
META_SYNC_ITEMS_MAX = 10_000_000  # a copy's size an asker accepts

SendFn = Callable[[int, bytes], None]  # (peer relay id, frame)


def _unpack(frame: bytes, length: int) -> list[Any]:
    try:
        raw = msgpack.unpackb(frame[len(_REQUEST) :], raw=False, strict_map_key=True)
    except Exception as e:
        raise MalformedFrame(f"metadata sync frame: not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) != length:
        raise MalformedFrame(f"metadata sync frame: expected an array of {length}")
    return raw


def _int(v: Any, name: str) -> int:
    if type(v) is not int or v < 0:
        raise FieldError(f"metadata sync frame: {name} is not an int")
    return v


@dataclass
class _Asking:
    peer: int
    request_id: int
    sent_ms: int
    items: list[Versioned] = field(default_factory=list)
    as_of: int = -1


class MetaSync:
    """Both sides of the transfer for one relay: serving peers' requests from its view,
    and, while its own view has a gap, asking peers in turn."""

    def __init__(self, relay_id: int, peers: tuple[int, ...], send: SendFn) -> None:
        self._relay_id = relay_id
        self._peers = peers
        self._send = send
        self._frozen: OrderedDict[tuple[int, int], tuple[int, list[Versioned]]] = OrderedDict()
        self._asking: _Asking | None = None
        self._next_request_id = 1
        self._turn = 0  # which peer is asked next
        self._wait_until_ms = 0
        # The state folded from durable history (fold_durable_history, by the node once
        # every peer was asked in vain: after a restart of the whole mesh no peer has
        # it), tried before asking peers again.
        self.durable: DurableFold | None = None
        self.counters: dict[str, int] = {
            "installed": 0,
            "installed_from_history": 0,
            "refused": 0,
            "bad_frames": 0,
        }

    @property
    def asked_every_peer(self) -> bool:
        """Whether every peer was asked for its copy at least once (none installed yet, or
        the view would be complete): then only durable history may hold the state."""
        return self._turn >= len(self._peers) and self._asking is None

    @staticmethod
    def is_sync_frame(frame: bytes) -> bool:
        return frame[:2] == META_SYNC_MARK

    def on_frame(self, frame: bytes, peer: int, view: MetaView, core: RelayCore, mono: int) -> None:
        """A frame from `peer` that `is_sync_frame`; a bad one is counted and dropped."""
        try:
            if frame.startswith(_REQUEST):
                request_id, offset = _unpack(frame, 2)
                self._serve(
                    peer, _int(request_id, "request_id"), _int(offset, "offset"), view, core
                )
            elif frame.startswith(_CHUNK):
                self._take_chunk(peer, _unpack(frame, 6), view, core, mono)
            else:
                raise MalformedFrame("metadata sync frame: unknown kind")
        except (FieldError, MalformedFrame, ValueError, TypeError):
            self.counters["bad_frames"] += 1

    # --- serving --------------------------------------------------------------------------

    def _serve(
        self, peer: int, request_id: int, offset: int, view: MetaView, core: RelayCore
    ) -> None:
        frozen = self._frozen.get((peer, request_id))
        if frozen is None:
            view.feed(core)
            if not view.complete:
                self._send(peer, _CHUNK + msgpack.packb([request_id, "not_ready", -1, 0, 0, []]))
                return
            # Everything committed was delivered, and so folded, by the end of the turn
            # before this one: the fold is the state at the committed point.
            as_of = max(view.state.applied, core.committed_point(METADATA_STREAM))
            frozen = (as_of, view.state.list("", limit=META_SYNC_ITEMS_MAX))
            self._frozen[(peer, request_id)] = frozen
            while len(self._frozen) > META_SYNC_FROZEN_MAX:
                self._frozen.popitem(last=False)
        as_of, items = frozen
        chunk: list[tuple[str, int, bytes]] = []
        size = 0
        for item in items[offset:]:
            size += len(item.key) + len(item.value) + 16
            if chunk and size > META_SYNC_CHUNK_BYTES:
                break
            chunk.append((item.key, item.version, item.value))
        body = [request_id, "ok", as_of, len(items), offset, chunk]
        self._send(peer, _CHUNK + msgpack.packb(body, use_bin_type=True))
        if offset + len(chunk) >= len(items):
            self._frozen.pop((peer, request_id), None)

    # --- asking ---------------------------------------------------------------------------

    def tend(self, view: MetaView, core: RelayCore, mono: int) -> None:
        """While the view has a gap: install the fold of durable history if it reaches
        the view's base, else ask a peer (the next one after a timeout)."""
        if not view.started:
            view.feed(core)  # a stream joined at its genesis starts complete
        if view.complete:
            self._asking = self.durable = None
            return
        if not core.joined(METADATA_STREAM):
            return
        durable, self.durable = self.durable, None
        if durable is not None and view.install(durable.items, durable.as_of, core):
            self.counters["installed_from_history"] += 1
            return
        if not self._peers:
            return
        asking = self._asking
        if asking is not None and mono - asking.sent_ms < META_SYNC_TIMEOUT_MS:
            return
        if asking is None and mono < self._wait_until_ms:
            return
        peer = self._peers[self._turn % len(self._peers)]
        self._turn += 1
        self._asking = _Asking(peer, self._next_request_id, mono)
        self._next_request_id += 1
        self._send(peer, _REQUEST + msgpack.packb([self._asking.request_id, 0]))

    def _take_chunk(
        self, peer: int, body: list[Any], view: MetaView, core: RelayCore, mono: int
    ) -> None:
        request_id, status, as_of, total, offset, items = body
        asking = self._asking
        if asking is None or peer != asking.peer or request_id != asking.request_id:
            return  # an answer to an earlier request
        if status != "ok" or type(total) is not int or not 0 <= total <= META_SYNC_ITEMS_MAX:
            self._give_up(mono)
            return
        if offset != len(asking.items) or not isinstance(items, list):
            raise MalformedFrame("metadata sync chunk out of order")
        asking.as_of = _int(as_of, "as_of")
        for item in items:
            key, version, value = item
            if not isinstance(key, str) or type(version) is not int or not isinstance(value, bytes):
                raise MalformedFrame("metadata sync chunk: bad item")
            asking.items.append(Versioned(key, version, value))
        if len(asking.items) < total:
            asking.sent_ms = mono
            self._send(peer, _REQUEST + msgpack.packb([request_id, len(asking.items)]))
            return
        if view.install(asking.items, asking.as_of, core):
            self.counters["installed"] += 1
            self._asking = None
        else:  # our buffer does not reach back to its point: a later copy will
            self.counters["refused"] += 1
            self._give_up(mono)

    def _give_up(self, mono: int) -> None:
        self._asking = None
        self._wait_until_ms = mono + META_SYNC_RETRY_MS


# --- durable history: after the whole mesh restarted --------------------------------------


@dataclass(frozen=True)
class DurableFold:
    """The metadata state folded from durable history, as of `as_of` (the last point of
    an unbroken chain from the genesis through the store and this relay's spool)."""

    items: list[Versioned]
    as_of: int


def fold_durable_history(
    store: StoreArg, spool_dir: Path | None, relay_id: int
) -> DurableFold | None:
    """Fold the metadata stream's stored records, then this relay's spooled ones after
    them while each continues the digest chain (a spool with a gap stops there). None
    when neither holds any. Raises StoreError if the store is unreadable, OSError or a
    pyarrow error if a segment is. (pyarrow, the store's: imported only when called.)"""
    from relay.store import STREAMS_DIR
    from relay.store.reader import StoreReader

    state = MetaState()
    state.applied = GENESIS_POINT
    point, digest = GENESIS_POINT, genesis(METADATA_STREAM)
    location = as_location(store)
    if location.is_dir(STREAMS_DIR):
        reader = StoreReader(location)
        stored = reader.last_point(METADATA_STREAM)
        if stored is not None:
            for record in reader.records_after(METADATA_STREAM):
                state.apply(record.seq, record.kind, record.value, False)
            point, digest = stored.seq, stored.digest
            state.applied = max(state.applied, point)
    for seq, record_digest, tx, duplicate in _spooled(spool_dir, relay_id, point):
        if chain(digest, seq, tx_hash(tx)) != record_digest:
            break  # a gap in this relay's spool: what follows is not ours to fold
        state.apply(seq, tx.kind, tx.value, duplicate)
        point, digest = seq, record_digest
    if point == GENESIS_POINT:
        return None
    return DurableFold(state.list("", META_SYNC_ITEMS_MAX), point)


def _spooled(
    spool_dir: Path | None, relay_id: int, after_seq: int
) -> Iterator[tuple[int, bytes, Transaction, bool]]:
    """This relay's spooled metadata records after `after_seq`, in seq order."""
    if spool_dir is None:
        return

    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    from relay.segment import find_segments, to_unsigned64

    for segment in find_segments(spool_dir):
        if segment.relay != relay_id or segment.stream != METADATA_STREAM:
            continue
        if segment.last_seq <= after_seq:
            continue
        for row in pq.read_table(segment.path).to_pylist():
            if row["seq"] > after_seq:
                tx = Transaction(
                    row["producer_id"],
                    to_unsigned64(row["producer_seq"]),
                    row["key"],
                    row["value"],
                    row["kind"],
                )
                yield row["seq"], row["digest"], tx, row["duplicate"]
