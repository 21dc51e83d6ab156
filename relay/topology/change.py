"""What a new topology file changes against the one a relay runs on, and whether the relay
can take it while it runs (SIGHUP, docs/deploy.md section 9).

A running relay takes a new file whose only changes are the streams each relay serves
(relays' `streams`, declared `streams`), for which the mesh then changes the affected
streams' relays (docs/protocol.md 5.15 changes), clients' rights and keys (`access`),
which apply to each request from then on, relays added to the mesh (with their keys: the
relay connects to them and lets them in), and relays removed from it (the relay lets them
go once no stream it serves counts them: node `_forget_peers`), and limits, which bound
what comes from then on, except those the mesh's links are made with and those every
relay must hold alike (relay/core/config.py LIMITS_AT_START, MESH_LIMITS). Anything else
(a relay's address, ports or key, those limits, security settings, what the HTTP port
serves, the spool, the store, the data directory) is refused by name, and the relay runs
on, unchanged, on its old file: those apply at a restart onto the new file. A relay may
not take a file that leaves itself out: it serves no stream first (its `streams` empty),
then it is stopped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from relay.core.config import fixed_limit_reason, limits_changed
from relay.topology.mesh import MeshConfig, is_pattern


@dataclass(frozen=True)
class TopologyChange:
    """The difference between two checked files, as one relay takes it."""

    streams: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # stream -> (old, new) relays
    served: tuple[tuple[str, ...], tuple[str, ...]]  # this relay's `streams`: (old, new)
    declared: tuple[tuple[str, ...], tuple[str, ...]]  # the declared streams: (old, new)
    clients: tuple[str, ...]  # the clients whose rights or keys change (added, removed too)
    added_relays: tuple[int, ...]  # relays the new file adds to the mesh
    removed_relays: tuple[int, ...]  # ... and those it leaves out
    limits: tuple[tuple[str, int, int], ...]  # the limits that change: (name, old, new)
    refused: tuple[str, ...]  # what a running relay cannot take, one phrase each

    @property
    def empty(self) -> bool:
        old_served, new_served = self.served
        old_declared, new_declared = self.declared
        return (
            not self.streams
            and not self.clients
            and not self.added_relays
            and not self.removed_relays
            and not self.limits
            and not self.refused
            and old_served == new_served
            and old_declared == new_declared
        )

    def words(self) -> str:
        """What the change does, on one line (the relay's log)."""
        if self.empty:
            return "nothing changes"
        parts = [f"relays {_ids(self.added_relays)} join the mesh"] if self.added_relays else []
        if self.removed_relays:
            parts.append(f"relays {_ids(self.removed_relays)} leave the mesh")
        parts += [
            f"{stream}: relays {_ids(old)} -> {_ids(new)}"
            for stream, (old, new) in sorted(self.streams.items())
        ]
        if self.served[0] != self.served[1]:
            parts.append(f"this relay's streams {list(self.served[0])} -> {list(self.served[1])}")
        if self.declared[0] != self.declared[1]:
            parts.append(f"declared streams {list(self.declared[0])} -> {list(self.declared[1])}")
        if self.clients:
            parts.append(f"rights of clients {list(self.clients)}")
        parts += [f"limits.{name} {old} -> {new}" for name, old, new in self.limits]
        return "; ".join(parts) if parts else "only what needs a restart"


def _ids(relays: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(r) for r in relays) + "]" if relays else "none"


def compare(
    old: MeshConfig, new: MeshConfig, relay_id: int, tracked: Iterable[str] = ()
) -> TopologyChange:
    """What `new` changes against `old` for relay `relay_id`. The streams compared are
    those either file names exactly or declares, and `tracked` (the streams the relay
    has open: names that patterns admit)."""
    refused: list[str] = []
    added = tuple(sorted(set(new.relays) - set(old.relays)))
    removed = tuple(sorted(set(old.relays) - set(new.relays)))
    if relay_id in removed:
        refused.append(
            f"this relay ({relay_id}) is not in it: give it a file in which it serves no "
            "stream first, and stop it once none runs on it (docs/deploy.md section 9)"
        )
    for rid in sorted(set(old.relays) & set(new.relays)):
        before = dataclasses.replace(old.relays[rid], streams=())
        after = dataclasses.replace(new.relays[rid], streams=())
        for field in dataclasses.fields(before):
            if getattr(before, field.name) != getattr(after, field.name):
                refused.append(f"relays[{rid}].{field.name} changes")
    for name in ("spool", "store", "security", "http", "data_dir"):
        if getattr(old, name) != getattr(new, name):
            refused.append(f"{name} changes")
    limits = limits_changed(old.limits, new.limits)
    for name in sorted(limits):
        why = fixed_limit_reason(name)
        if why is not None:
            refused.append(f"limits.{name} changes ({why})")
    names = set(old.streams) | set(new.streams) | set(tracked)
    for spec in (*old.relays.values(), *new.relays.values()):
        names.update(s for s in spec.streams if not is_pattern(s))
    streams = {
        name: (old.members(name), new.members(name))
        for name in sorted(names)
        if old.members(name) != new.members(name)
    }
    served_old = old.relays[relay_id].streams if relay_id in old.relays else ()
    served_new = new.relays[relay_id].streams if relay_id in new.relays else ()
    return TopologyChange(
        streams=streams,
        served=(served_old, served_new),
        declared=(old.streams, new.streams),
        added_relays=added,
        removed_relays=removed,
        limits=tuple(
            (name, *values)
            for name, values in sorted(limits.items())
            if fixed_limit_reason(name) is None
        ),
        clients=tuple(
            sorted(
                name
                for name in set(old.access.clients) | set(new.access.clients)
                if old.access.clients.get(name) != new.access.clients.get(name)
            )
        ),
        refused=tuple(refused),
    )
