"""The wire format of the view-change messages (docs/protocol.md sections 3 and 5.12), for
relay/core/codec.py: one msgpack array per message, its fields in their declared order.

    Interval     -> [member, incarnation, since, cut]
    ViewValue    -> [number, start, lo, [Interval...], [Entry...], config, members]
                    (None -> nil)
    ViewPhase    -> its `.value` string
"""

from __future__ import annotations

from typing import Any

from relay.core import fields
from relay.core.fields import array as _array
from relay.core.fields import enum as _enum
from relay.core.fields import stream as _stream
from relay.core.messages import (
    Interval,
    ViewDecided,
    ViewPhase,
    ViewReply,
    ViewRequest,
    ViewValue,
)

_PHASES = {p.value: p for p in ViewPhase}


def enc_entries(entries: tuple[tuple[int, Any], ...]) -> list[tuple[Any, ...]]:
    return [(s, t.producer_id, t.producer_seq, t.key, t.value, t.kind) for s, t in entries]


def enc_value(v: ViewValue | None) -> tuple[Any, ...] | None:
    if v is None:
        return None
    intervals = [(i.member, i.incarnation, i.since, i.cut) for i in v.intervals]
    return (v.number, v.start, v.lo, intervals, enc_entries(v.entries), v.config, v.members)


def enc_view_request(m: ViewRequest) -> tuple[Any, ...]:
    return (
        11,
        m.sender,
        m.incarnation,
        m.floor,
        m.target,
        m.stream,
        m.phase.value,
        m.view,
        m.ballot,
        m.excluding,
        enc_value(m.value),
        m.config,
        m.members,
        m.moving_to,
    )


def enc_view_reply(m: ViewReply) -> tuple[Any, ...]:
    return (
        12,
        m.sender,
        m.incarnation,
        m.floor,
        m.target,
        m.stream,
        m.phase.value,
        m.view,
        m.ballot,
        m.ok,
        m.promised,
        m.reported,
        m.committed,
        m.accepted_ballot,
        enc_value(m.accepted),
        enc_entries(m.entries),
        m.config,
        m.members,
        m.holds,
    )


def enc_view_decided(m: ViewDecided) -> tuple[Any, ...]:
    return (13, m.sender, m.incarnation, m.floor, m.target, m.stream, enc_value(m.value))


def dec_value(v: Any, name: str, *, legacy: bool = False) -> ViewValue | None:
    """A view, or None. `legacy`: also the shape kept before configurations (5.15) were
    part of a view (an acceptor record written by an earlier release), as of version 0."""
    if v is None:
        return None
    if legacy and type(v) is list and len(v) == 5:
        v = [*v, 0, []]
    number, start, lo, raw_intervals, raw_entries, config, members = _array(v, name, 7)
    intervals = []
    for i, raw in enumerate(_array(raw_intervals, name + ".intervals")):
        member, incarnation, since, cut = _array(raw, f"{name}.intervals[{i}]", 4)
        at = f"{name}.intervals[{i}]"
        intervals.append(
            Interval(
                fields.relay_id(member, at + ".member"),
                fields.u64(incarnation, at + ".incarnation"),
                fields.u63_or_none(since, at + ".since"),
                fields.u63_or_none(cut, at + ".cut"),
            )
        )
    return ViewValue(
        fields.u63(number, name + ".number"),
        fields.u63_or_none(start, name + ".start"),
        fields.u63_or_none(lo, name + ".lo"),
        tuple(intervals),
        fields.entries(raw_entries, name + ".entries"),
        fields.u63(config, name + ".config"),
        fields.members(members, name + ".members"),
    )


def dec_view_request(a: list[Any]) -> ViewRequest:
    return ViewRequest(
        fields.relay_id(a[1], "ViewRequest.sender"),
        fields.u64(a[2], "ViewRequest.incarnation"),
        fields.u63(a[3], "ViewRequest.floor"),
        fields.relay_id(a[4], "ViewRequest.target"),
        _stream(a[5], "ViewRequest.stream"),
        _enum(a[6], _PHASES, "ViewRequest.phase"),
        fields.u63(a[7], "ViewRequest.view"),
        fields.u63(a[8], "ViewRequest.ballot"),
        fields.relay_ids(a[9], "ViewRequest.excluding"),
        dec_value(a[10], "ViewRequest.value"),
        fields.u63(a[11], "ViewRequest.config"),
        fields.members(a[12], "ViewRequest.members"),
        fields.members(a[13], "ViewRequest.moving_to"),
    )


def dec_view_reply(a: list[Any]) -> ViewReply:
    return ViewReply(
        fields.relay_id(a[1], "ViewReply.sender"),
        fields.u64(a[2], "ViewReply.incarnation"),
        fields.u63(a[3], "ViewReply.floor"),
        fields.relay_id(a[4], "ViewReply.target"),
        _stream(a[5], "ViewReply.stream"),
        _enum(a[6], _PHASES, "ViewReply.phase"),
        fields.u63(a[7], "ViewReply.view"),
        fields.u63(a[8], "ViewReply.ballot"),
        fields.boolean(a[9], "ViewReply.ok"),
        fields.u63_or_none(a[10], "ViewReply.promised"),
        fields.u63_or_none(a[11], "ViewReply.reported"),
        fields.u63_or_none(a[12], "ViewReply.committed"),
        fields.u63_or_none(a[13], "ViewReply.accepted_ballot"),
        dec_value(a[14], "ViewReply.accepted"),
        fields.entries(a[15], "ViewReply.entries"),
        fields.u63(a[16], "ViewReply.config"),
        fields.members(a[17], "ViewReply.members"),
        fields.u63_or_none(a[18], "ViewReply.holds"),
    )


def dec_view_decided(a: list[Any]) -> ViewDecided:
    value = dec_value(a[6], "ViewDecided.value")
    if value is None:
        fields.bad("ViewDecided.value", "a view", None)
    return ViewDecided(
        fields.relay_id(a[1], "ViewDecided.sender"),
        fields.u64(a[2], "ViewDecided.incarnation"),
        fields.u63(a[3], "ViewDecided.floor"),
        fields.relay_id(a[4], "ViewDecided.target"),
        _stream(a[5], "ViewDecided.stream"),
        value,
    )
