"""Waiting in tests: on a condition, never on the clock alone.

`wait_until` (and `wait_until_async` inside an event loop) polls a condition until it holds
and returns its first truthy value. Only after a generous bound does it fail, naming what
never happened; the bound keeps a broken test from hanging, it is no check of speed: a
loaded machine may take long, and a test must still pass there.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

# Far above what any condition of the suite needs on an idle machine (well under a second
# to a few seconds), so that only a condition that will never hold reaches it; below the
# tests' own pytest timeouts (60 s and more), so the failure names the condition.
TIMEOUT_S = 30.0
POLL_S = 0.01

# What the wait is for, e.g. "relay 1 to start"; or a function giving it, called only on
# failure, so the message can show the latest state.
Description = str | Callable[[], str]


def wait_until(
    condition: Callable[[], T | None],
    what: Description,
    *,
    timeout_s: float = TIMEOUT_S,
    poll_s: float = POLL_S,
) -> T:
    """The first truthy value of `condition()`, asked every `poll_s` (None and other false
    values mean not yet); an AssertionError naming `what` if none came within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(what, timeout_s))
        time.sleep(poll_s)


@overload
async def wait_until_async(
    condition: Callable[[], Awaitable[T | None]],
    what: Description,
    *,
    timeout_s: float = ...,
    poll_s: float = ...,
) -> T: ...


@overload
async def wait_until_async(
    condition: Callable[[], T | None],
    what: Description,
    *,
    timeout_s: float = ...,
    poll_s: float = ...,
) -> T: ...


async def wait_until_async(
    condition: Callable[[], Any],
    what: Description,
    *,
    timeout_s: float = TIMEOUT_S,
    poll_s: float = POLL_S,
) -> Any:
    """`wait_until` for a test running in an event loop: sleeps with asyncio, so the relays
    and clients of the same loop run meanwhile; `condition` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(what, timeout_s))
        await asyncio.sleep(poll_s)


def _timed_out(what: Description, timeout_s: float) -> str:
    described = what if isinstance(what, str) else what()
    return f"timed out after {timeout_s:g} s waiting for {described}"


def bind_when_free(sock: Any, endpoint: str) -> None:
    """Bind `sock` at `endpoint` once no other socket holds it (a process just killed may
    hold it for a moment)."""

    def bound() -> bool:
        try:
            sock.bind(endpoint)
        except Exception as e:  # zmq.ZMQError: address in use
            if "in use" not in str(e):
                raise
            return False
        return True

    wait_until(bound, f"{endpoint} to be free to bind")
