"""Errors of the spool and the store. Each subclasses a class of `relay.errors`."""

from __future__ import annotations

from relay.errors import FieldError, RelayError


class InvalidChanges(FieldError):
    """A transaction's value is not a valid encoded change list (or a change list to
    encode breaks a limit). The message names the change and the problem."""

    counter = "changes_invalid"


class StoreError(RelayError):
    """Base of the store's errors: the store was left as its last commit made it."""


class StoreCorrupt(StoreError):
    """A table or file of the store is missing or unreadable."""


class UnknownStoredStream(StoreError):
    """The store holds no stream of this name."""


class ConcurrentCommit(StoreError):
    """Another writer committed to the same table first. Retry the job: it starts again
    from the newer commit."""

    retriable = True


class StoreLocked(StoreError):
    """Another job holds the store's writer lock; `holder` names it (job, process, host,
    since when). Run again once it is done."""

    retriable = True

    def __init__(self, message: str, *, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


class ChainProblem(StoreError):
    """The records of a stream cannot be appended: the relays disagree on a digest, or the
    chain does not continue the store's last point. Nothing at or after `seq` of `stream`
    was written. `relays` are the relays whose records are involved."""

    def __init__(self, message: str, *, stream: str, seq: int, relays: tuple[int, ...]) -> None:
        super().__init__(message)
        self.stream = stream
        self.seq = seq
        self.relays = relays


class IngestFailed(StoreError):
    """An ingest run found chain problems (listed in `problems`). The verified records of
    every stream up to its first problem were committed; nothing after it."""

    def __init__(self, message: str, *, problems: tuple[ChainProblem, ...]) -> None:
        super().__init__(message)
        self.problems = problems


class VerifyFailed(StoreError):
    """The stored chain of one or more streams does not check end to end."""

    def __init__(self, message: str, *, problems: tuple[ChainProblem, ...]) -> None:
        super().__init__(message)
        self.problems = problems
