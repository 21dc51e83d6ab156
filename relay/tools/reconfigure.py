"""`relay reconfigure --config NEW.yaml`: a change of which relays serve which streams,
checked against the running mesh and driven through it (docs/deploy.md section 9).

1. The new file is loaded and checked (a ConfigError names the file and the field).
2. Every relay the new file names is asked for its status. The plan, per stream that any
   relay tracks: the relays it runs on (its configuration, as the relays serving it state
   it) and the relays the new file names, with the steps the relays will take
   (`relay.core.membership.next_step`); a change the mesh cannot make is named (a stream
   of one relay moved to others, a stream no relay of the file serves: each keeps its
   relays). Then each limit the file changes, with the relays holding another value and
   whether a reload takes it.
   Nothing changes without `apply`.
3. `apply`: every relay is asked to read its own topology file again (wire.ReloadReq,
   the admin right), which the operator copied to its host beforehand. Each answer says
   whether it took the file, and the digest of the text it read must be the new file's:
   a relay that read another file is named (its host has another file).
4. Then it waits, printing each stream's progress, until every stream of the plan runs on
   the relays the new file names (`follow`), and until no relay counts a relay the file
   removes from the mesh (`follow_leaving`: the operator stops it then), or the time is up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relay import wire
from relay.core.config import fixed_limit_reason
from relay.core.membership import next_step
from relay.launcher import StatusReply, ask_relays, query_status
from relay.streamhealth import configuration_words, relay_list

if TYPE_CHECKING:
    from relay.security import ClientCurve
    from relay.topology import MeshConfig

FOLLOW_POLL_S = 0.5  # how often the relays' statuses are read while a change goes on
RELOAD_TIMEOUT_S = 5.0  # for every relay's answer to a ReloadReq


@dataclass(frozen=True)
class StreamChange:
    """One stream whose relays the new file changes."""

    stream: str
    version: int  # the configuration it runs under now
    relays: tuple[int, ...]  # ... and its relays
    target: tuple[int, ...]  # the relays the new file names
    steps: tuple[tuple[int, ...], ...]  # the configurations on the way (the last: target)
    refusal: str = ""  # why the mesh will not make it ("": it will)

    def words(self) -> str:
        now = configuration_words(self.version, self.relays)
        if self.refusal:
            return f"{self.stream}: {now} -> {relay_list(self.target)}: {self.refusal}"
        added = [r for r in self.target if r not in self.relays]
        removed = [r for r in self.relays if r not in self.target]
        what = [f"adds {relay_list(added)}"] if added else []
        what += [f"takes off {relay_list(removed)}"] if removed else []
        count = len(self.steps)
        return (
            f"{self.stream}: {now} -> {relay_list(self.target)}: {', '.join(what)} "
            f"({count} step{'s' if count != 1 else ''})"
        )


def running_configurations(
    replies: Mapping[int, StatusReply],
) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Per stream any relay tracks: the latest established configuration its serving
    relays state (version, relays); a stream only provisional so far is left out (its
    relays follow the files)."""
    found: dict[str, tuple[int, tuple[int, ...]]] = {}
    for reply in replies.values():
        status = reply.status or {}
        tables: list[Mapping[str, Any]] = [
            (info or {}).get("config") or {} for info in (status.get("streams") or {}).values()
        ]
        names = list((status.get("streams") or {}).keys())
        for name, config in (status.get("not_member") or {}).items():
            names.append(name)
            tables.append(config or {})
        for name, config in zip(names, tables, strict=True):
            if not config:
                continue
            version = int(config.get("version") or 0)
            relays = tuple(int(r) for r in config.get("relays") or ())
            if version > 0 and version > found.get(name, (0, ()))[0]:
                found[name] = (version, relays)
    return dict(sorted(found.items()))


def plan(new: MeshConfig, replies: Mapping[int, StatusReply]) -> list[StreamChange]:
    """The streams whose relays the new file changes, against what the relays state."""
    out = []
    for stream, (version, relays) in running_configurations(replies).items():
        target = new.members(stream)
        if target == relays:
            continue
        steps: list[tuple[int, ...]] = []
        refusal = ""
        if not target:
            refusal = "no relay of the new file serves it: it keeps its relays"
        else:
            at = relays
            while at != target:
                step = next_step(at, target)
                if step is None:
                    refusal = (
                        "a stream of one relay does not move to other relays: give it a "
                        "file naming both first, then one without the old relay; it keeps "
                        "its relays"
                    )
                    steps = []
                    break
                steps.append(step)
                at = step
        out.append(StreamChange(stream, version, relays, target, tuple(steps), refusal))
    return out


def limit_changes(new: MeshConfig, replies: Mapping[int, StatusReply]) -> list[str]:
    """One line per limit the new file gives another value than a running relay holds
    (its status's `node.limits`): the relays and their values, and whether a reload takes
    it or it is refused by name (relay/core/config.py LIMITS_AT_START and MESH_LIMITS)."""
    held: dict[str, dict[int, list[int]]] = {}  # limit -> value -> relays holding it
    for relay, reply in sorted(replies.items()):
        running = ((reply.status or {}).get("node") or {}).get("limits") or {}
        for name, value in running.items():
            if hasattr(new.limits, name) and value != getattr(new.limits, name):
                held.setdefault(name, {}).setdefault(value, []).append(relay)
    lines = []
    for name, values in sorted(held.items()):
        now = ", ".join(f"{v} on {relay_list(tuple(rs))}" for v, rs in sorted(values.items()))
        why = fixed_limit_reason(name)
        how = f"refused by a reload: {why}" if why else "a reload applies it"
        lines.append(f"limits.{name}: {now} -> {getattr(new.limits, name)} ({how})")
    return lines


def leaving_relays(new: MeshConfig, replies: Mapping[int, StatusReply]) -> tuple[int, ...]:
    """The relays the running relays know (their files' peers, and those they still let
    go of) that the new file leaves out of the mesh."""
    known: set[int] = set()
    for relay, reply in replies.items():
        node = (reply.status or {}).get("node") or {}
        known.add(relay)
        known.update(int(r) for r in (*(node.get("peers") or ()), *(node.get("leaving") or ())))
    return tuple(sorted(known - set(new.relays)))


def counted_by(replies: Mapping[int, StatusReply], relays: Iterable[int]) -> dict[int, list[int]]:
    """Per relay of `relays`: the relays that answered and still count it (their
    status's `leaving`: a stream there has it among its relays)."""
    wanted = set(relays)
    found: dict[int, list[int]] = {}
    for relay, reply in sorted(replies.items()):
        node = (reply.status or {}).get("node") or {}
        for gone in node.get("leaving") or ():
            if int(gone) in wanted:
                found.setdefault(int(gone), []).append(relay)
    return found


def follow_leaving(
    new: MeshConfig,
    leaving: Iterable[int],
    curve: ClientCurve | None,
    deadline: float,
    say: Callable[[str], None],
    began: float,
) -> dict[int, list[int]]:
    """Wait until no relay of the new file counts any of `leaving` (each let it go: it
    serves no stream there), saying when each is; returns those still counted at
    `deadline` (monotonic), with the relays that count them."""
    endpoints = {r: spec.client_endpoint for r, spec in new.relays.items()}
    waiting = set(leaving)
    counted: dict[int, list[int]] = {}
    while waiting:
        counted = counted_by(query_status(endpoints, 1.0, curve), waiting)
        for relay in sorted(waiting - set(counted)):
            waiting.discard(relay)
            say(
                f"  relay {relay}: left the mesh after {time.monotonic() - began:.1f} s "
                "(no relay counts it any more): stop it now"
            )
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(FOLLOW_POLL_S)
    return {r: counted.get(r, []) for r in sorted(waiting)}


@dataclass(frozen=True)
class ReloadAnswer:
    relay: int
    taken: bool
    words: str
    same_file: bool  # the relay read the new file's text (its digest)


def ask_reload(
    new: MeshConfig, digest: bytes, curve: ClientCurve | None, timeout_s: float = RELOAD_TIMEOUT_S
) -> list[ReloadAnswer]:
    """Have every relay of the new file read its topology file again (wire.ReloadReq)."""
    endpoints = {r: spec.client_endpoint for r, spec in new.relays.items()}
    answers = ask_relays(endpoints, wire.ReloadReq, timeout_s, curve)
    out = []
    for relay, answer in answers.items():
        if isinstance(answer, wire.ReloadResp):
            same = answer.file_digest == digest
            out.append(ReloadAnswer(relay, answer.taken, answer.words, same))
        elif isinstance(answer, wire.ErrorResp):
            out.append(ReloadAnswer(relay, False, f"{answer.error}: {answer.message}", False))
        elif isinstance(answer, str):
            out.append(ReloadAnswer(relay, False, answer, False))
        else:
            out.append(ReloadAnswer(relay, False, f"unexpected {type(answer).__name__}", False))
    return out


def follow(
    new: MeshConfig,
    changes: Iterable[StreamChange],
    curve: ClientCurve | None,
    deadline: float,
    say: Callable[[str], None],
    began: float,
) -> list[StreamChange]:
    """Wait until each stream of `changes` runs on its target relays, saying each step a
    stream takes; returns those that did not get there before `deadline` (monotonic)."""
    endpoints = {r: spec.client_endpoint for r, spec in new.relays.items()}
    waiting = {c.stream: c for c in changes if not c.refusal}
    seen = {c.stream: (c.version, c.relays) for c in waiting.values()}
    while waiting:
        replies = query_status(endpoints, 1.0, curve)
        running = running_configurations(replies)
        for stream, change in list(waiting.items()):
            now = running.get(stream)
            if now is None or now == seen[stream]:
                continue
            seen[stream] = now
            at = f"{time.monotonic() - began:.1f} s"
            say(f"  {stream}: on {configuration_words(*now)} after {at}")
            if now[1] == change.target:
                del waiting[stream]
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(FOLLOW_POLL_S)
    return list(waiting.values())
