"""A benchmark's measured client in a fresh process of its own.

A client's cost depends on the process it runs in: the cyclic garbage collector walks
every object the process holds, so a producer sharing the benchmark's process (its
report, earlier runs' results, the other side's client library) pays for all of them.
Measured here with 100-byte values at window 4,096: the same producer committed 77.8k
tx/s alone and 62.8k with a million small objects beside it. A benchmark therefore runs
each side's client in a process started for that run, as an application would run it,
and both sides alike.

The child warms up, then waits at a gate while the parent starts its meters (the servers'
CPU, counters), and runs the measured part once let through; the client CPU it reports
is its own, from the gate to the end.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

# A fresh interpreter imports the package and connects before its warm-up ends.
READY_TIMEOUT_S = 120.0
# After the measured part is let through: its own length plus this.
FINISH_MARGIN_S = 120.0
STOP_TIMEOUT_S = 10.0
GO = "go"

T = TypeVar("T")


class IsolatedRunFailed(RuntimeError):
    """The child process failed, or did not answer in time; the message says which."""


def _child_main(conn: Connection, target: Callable[..., dict[str, Any]], args: tuple) -> None:
    started: list[float] = []

    def gate() -> None:
        conn.send(("ready", None))
        if conn.recv() != GO:
            raise IsolatedRunFailed("the parent did not let the run through")
        started.append(time.process_time())

    try:
        result = target(gate, *args)
        if not started:
            raise IsolatedRunFailed(f"{target.__name__} never reached its gate")
        result["client_s"] = round(time.process_time() - started[0], 3)
        conn.send(("done", result))
    except BaseException:  # everything goes to the parent, which raises it
        conn.send(("failed", traceback.format_exc()))
    finally:
        conn.close()


def _receive(conn: Connection, process: Any, timeout_s: float, waiting_for: str) -> Any:
    if not conn.poll(timeout_s):
        raise IsolatedRunFailed(f"no {waiting_for} from the client process in {timeout_s:g} s")
    try:
        kind, body = conn.recv()
    except EOFError:
        raise IsolatedRunFailed(
            f"the client process exited (code {process.exitcode}) before its {waiting_for}"
        ) from None
    if kind == "failed":
        raise IsolatedRunFailed(f"the client process failed:\n{body}")
    return body


def run_isolated(
    target: Callable[..., dict[str, Any]],
    args: tuple,
    *,
    at_gate: Callable[[], T],
    duration_s: float,
) -> tuple[dict[str, Any], T]:
    """Run `target(gate, *args)` (a module-level function) in a fresh process; when it
    calls `gate()`, call `at_gate()` here, then let it through. Returns what the target
    returned, with `client_s` (its CPU seconds after the gate), and what `at_gate` did.
    The process is always stopped."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_child_main, args=(theirs, target, args), daemon=True)
    process.start()
    theirs.close()
    try:
        _receive(ours, process, READY_TIMEOUT_S, "warm-up")
        token = at_gate()
        ours.send(GO)
        result = _receive(ours, process, duration_s + FINISH_MARGIN_S, "result")
        return result, token
    finally:
        ours.close()
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
