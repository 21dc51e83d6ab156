"""A linearizability check of the mesh's compare-and-set (docs/metadata.md): processes run
scripts of metadata operations, recording when each began and ended, at which seq it
committed and what it returned; `check_linearizable` checks the histories against the
sequential contract. Used by tests/test_metadata.py and scripts/bench_metadata.py."""

from __future__ import annotations

import os
import time
from typing import Any

from relay.client import Metadata
from relay.errors import BadVersion
from relay.meta import ABSENT, ANY_VERSION

# One operation's record: (op, key, began, ended, seq, expected version or, for a read,
# the applied point of its answer, result, version).
History = list[tuple[Any, ...]]


def cas_worker(topology: str, keys: list[str], script: list[tuple[str, int]]) -> History:
    """Run `script` ((op, key index)) with the versions this process last saw; record
    each operation's times (one machine: one monotonic clock), seq and outcome."""
    seen: dict[str, int] = {}
    history = []
    with Metadata(topology=topology) as meta:
        for op, which in script:
            key = keys[which]
            expected = seen.get(key, ABSENT)
            began = time.monotonic()
            if op == "read":
                found = meta.read(key, linearizable=True)
                seen[key] = ABSENT if found is None else found.version
                history.append(
                    (
                        "read",
                        key,
                        began,
                        time.monotonic(),
                        meta.last_seq,
                        meta.applied,
                        "ok",
                        seen[key],
                    )
                )
                continue
            try:
                if op == "write":
                    version = meta.write(key, os.urandom(4), expected)
                else:
                    meta.delete(key, expected)
                    version = ABSENT
                result = "applied"
            except BadVersion as e:
                version, result = e.current_version, "bad_version"
            seen[key] = version
            history.append(
                (op, key, began, time.monotonic(), meta.last_seq, expected, result, version)
            )
    return history


def check_linearizable(histories: list[History]) -> int:
    """Every write and delete took effect at its commit seq, in seq order, exactly as the
    sequential contract says; that order respects real time (an operation that ended
    before another began has the lower seq); every linearizable read saw the state at
    some point between its barrier and its answer. Returns the operations checked."""
    ops = sorted((h for history in histories for h in history), key=lambda h: h[4])
    updates = [h for h in ops if h[0] != "read"]
    state: dict[str, int] = {}
    versions_at: list[tuple[int, dict[str, int]]] = [(-1, {})]
    for op, key, _, _, seq, expected, result, version in updates:
        current = state.get(key, ABSENT)
        holds = current != ABSENT if op == "delete" else True
        holds = holds and expected in (ANY_VERSION, current)
        want = ("applied", seq if op == "write" else ABSENT) if holds else ("bad_version", current)
        assert (result, version) == want, (op, key, seq, expected, result, version, current)
        if holds:
            if op == "write":
                state[key] = seq
            else:
                del state[key]
        versions_at.append((seq, dict(state)))
    by_end = sorted(ops, key=lambda h: h[3])
    for i, earlier in enumerate(by_end):
        for later in by_end[i + 1 :]:
            if later[2] > earlier[3]:  # began after `earlier` ended
                assert later[4] > earlier[4], (earlier, later)
    for _, key, _, _, barrier, applied, _, version in (h for h in ops if h[0] == "read"):
        possible = {
            snapshot.get(key, ABSENT)
            for i, (seq, snapshot) in enumerate(versions_at)
            if seq <= applied and (i + 1 == len(versions_at) or versions_at[i + 1][0] > barrier)
        }
        assert version in possible, (key, barrier, applied, version, possible)
    return len(ops)
