"""The one logging set-up of the `relay` command's processes: relays (`relay run`, and the
relays `relay up` starts), `relay up` itself, the store runner and the store's jobs.

    from relay import logs
    logs.setup("info", "json")  # once, before the first line; again replaces it

Every line goes to stderr, one record a line, in one of LOG_FORMATS:

    text  2026-11-29T00:19:46.004Z WARNING relay.node relay=2 stream=audit fenced: quorum ...
    json  {"time": "2026-11-29T00:19:46.004Z", "level": "warning", "logger": "relay.node",
           "message": "relay=2 stream=audit fenced: quorum ...", "relay": 2, "stream": "audit"}

A JSON line also carries the structured fields a call passes (`log.warning(..., extra=
{"relay": 2, "stream": name})`), seqs among them as strings (relay/seqtext.py), and an
exception's traceback as "exception". Times are UTC.

A line that tells a state change (`extra={STATE_CHANGE: True, ...}`: a stream fenced, a
link closed, a relay restarted) is always written: one line per change, so the log's last
line about a thing is its state. Other lines (a failed attempt, a dropped frame) repeat:
a line identical to one written less than REPEAT_WINDOW_S before (same logger, level and
message) is held back and counted. When that window ends, one line says
`<message> (repeated 734 times in the last 60 s)` (JSON adds "repeated": 734 and
"window_s"), and the next identical line opens a new window: a condition that repeats
costs two lines a minute, and its count is kept. A summary due while nothing else is
logged is written by a timer thread, and what is pending when the process exits, then.
"""

from __future__ import annotations

import atexit
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any

from relay.seqtext import seqs_as_text

__all__ = [
    "LOG_FORMATS",
    "REPEAT_WINDOW_S",
    "STATE_CHANGE",
    "JsonFormatter",
    "RepeatFilter",
    "TextFormatter",
    "setup",
]

LOG_FORMATS = ("text", "json")
STATE_CHANGE = "state_change"  # the field that marks a line telling a state change
REPEAT_WINDOW_S = 60.0  # identical lines after the first within this are counted, not written
# Distinct lines counted at once; past it, a new line is written without being counted (a
# flood of different lines is not what the filter is for, and its memory stays bounded).
REPEAT_KEYS_MAX = 1_000

# What every LogRecord has; anything else on a record came from `extra=` (a field).
_RECORD_ATTRIBUTES = frozenset(
    logging.LogRecord("", logging.INFO, "", 0, "", None, None).__dict__
) | {"message", "asctime", "taskName"}


def _utc_time(created_s: float) -> str:
    """2026-11-29T00:19:46.004Z"""
    moment = datetime.fromtimestamp(created_s, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


class TextFormatter(logging.Formatter):
    """`<UTC time> <LEVEL> <logger> <message>`, then the traceback, if any."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _utc_time(record.created)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": _utc_time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRIBUTES and not key.startswith("_") and key not in doc:
                doc[key] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(seqs_as_text(doc), default=str, ensure_ascii=False)


@dataclass
class _Window:
    opened_s: float  # when the line that opened it was written (monotonic)
    repeats: int = 0  # identical lines held back since
    last: logging.LogRecord | None = None  # the latest of them


class RepeatFilter(logging.Filter):
    """Holds back lines identical to one written less than `window_s` before and writes
    one summary per window (see the module doc). `write` takes a summary record (the
    handler's `handle`: the summary passes this filter again, marked)."""

    def __init__(
        self,
        write: Callable[[logging.LogRecord], object],
        window_s: float = REPEAT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._write = write
        self.window_s = window_s
        self._clock = clock
        self._windows: dict[tuple[str, int, str], _Window] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._timer: threading.Thread | None = None
        self._closed = False

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "repeated", None) is not None or getattr(record, STATE_CHANGE, False):
            return True  # a summary this filter made, or a state change: always written
        key = (record.name, record.levelno, record.getMessage())
        now = self._clock()
        with self._lock:
            due = self._take_due(now)
            window = self._windows.get(key)
            if window is None:
                if len(self._windows) < REPEAT_KEYS_MAX:
                    self._windows[key] = _Window(now)
                written = True
            else:
                window.repeats += 1
                window.last = record
                written = False
                self._start_timer()
                self._wake.notify()
        self._write_summaries(due)
        return written

    def flush(self) -> None:
        """Write the summaries of every window with repeats now (at exit)."""
        with self._lock:
            due = self._take_due(None)
        self._write_summaries(due)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()

    def _take_due(self, now: float | None) -> list[logging.LogRecord]:
        """Close the windows that ended by `now` (None: every window); their summaries.
        Windows are kept in the order they opened, so the look stops at the first one
        still open: a record costs no scan of every window."""
        ended = []
        for key, window in self._windows.items():
            if now is not None and now - window.opened_s < self.window_s:
                break
            ended.append((key, window))
        summaries = []
        for key, window in ended:
            del self._windows[key]
            if window.repeats and window.last is not None:
                elapsed_s = (self._clock() if now is None else now) - window.opened_s
                summaries.append(self._summary(window, min(elapsed_s, self.window_s)))
        return summaries

    def _summary(self, window: _Window, elapsed_s: float) -> logging.LogRecord:
        assert window.last is not None
        fields = dict(window.last.__dict__)
        fields.update(
            msg=f"{window.last.getMessage()} (repeated {window.repeats} "
            f"time{'' if window.repeats == 1 else 's'} in the last {elapsed_s:.3g} s)",
            args=None,
            exc_info=None,
            exc_text=None,
            stack_info=None,
            created=time.time(),
            repeated=window.repeats,
            window_s=round(elapsed_s, 3),
        )
        return logging.makeLogRecord(fields)

    def _write_summaries(self, summaries: list[logging.LogRecord]) -> None:
        for summary in summaries:
            self._write(summary)

    def _start_timer(self) -> None:
        if self._timer is None:  # under the lock
            self._timer = threading.Thread(
                target=self._run_timer, name="relay-log-repeats", daemon=True
            )
            self._timer.start()

    def _run_timer(self) -> None:
        """Write each window's summary when it ends, also while nothing else is logged."""
        while True:
            with self._lock:
                if self._closed:
                    return
                pending = [w.opened_s for w in self._windows.values() if w.repeats]
                if not pending:
                    self._wake.wait()
                    continue
                left_s = min(pending) + self.window_s - self._clock()
                if left_s > 0:
                    self._wake.wait(left_s)
                    continue
                due = self._take_due(self._clock())
            self._write_summaries(due)


class _Handler(logging.StreamHandler[IO[str]]):
    """The handler `setup` installs (marked, so that a second `setup` replaces it)."""

    repeats: RepeatFilter

    def close(self) -> None:
        self.repeats.close()
        super().close()


def setup(level: str = "info", log_format: str = "text", stream: IO[str] | None = None) -> None:
    """Log records of `level` and above to `stream` (default stderr) in `log_format`,
    repeats held back (see the module doc). Replaces what an earlier call installed."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
        atexit.unregister(old.repeats.flush)
        old.repeats.flush()
        old.close()
    handler = _Handler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.repeats = RepeatFilter(handler.handle)
    handler.addFilter(handler.repeats)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Before logging's own exit hook (atexit runs the last registered first): the counts
    # pending then are written, not lost.
    atexit.register(handler.repeats.flush)
