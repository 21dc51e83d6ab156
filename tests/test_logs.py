"""The one logging set-up (relay/logs.py): JSON lines that parse, text lines, repeats held
back and counted; and seqs as text (relay/seqtext.py), as JSON output and input use them."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from relay import logs
from relay.seqtext import parse_seq, seqs_as_text
from waiting import wait_until

BIG_SEQ = 383_315_973_454_696_481  # above 2**53: a double would round it


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """The root logger's lines (logs.setup) in a buffer; the set-up removed afterwards."""
    out = io.StringIO()
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    logs.setup("debug", "json", stream=out)
    try:
        yield out
    finally:
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)


def lines_of(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_json_lines_parse_with_time_level_logger_message_and_fields(
    captured: io.StringIO,
) -> None:
    log = logging.getLogger("relay.node")
    log.info("relay=%d stream=%s joined", 2, "audit", extra={"relay": 2, "seq": BIG_SEQ})
    try:
        raise ValueError("bad frame")
    except ValueError:
        log.exception("relay=2 core failed")
    first, second = lines_of(captured)
    assert first["level"] == "info" and first["logger"] == "relay.node"
    assert first["message"] == "relay=2 stream=audit joined" and first["relay"] == 2
    assert first["seq"] == str(BIG_SEQ)  # seqs as strings, as in all JSON output
    assert str(first["time"]).endswith("Z") and "T" in str(first["time"])
    assert second["level"] == "error" and "ValueError: bad frame" in str(second["exception"])


def test_text_lines_carry_utc_time_level_and_logger() -> None:
    out = io.StringIO()
    logs.setup("info", "text", stream=out)
    try:
        logging.getLogger("relay.store").warning("store %s: renewing failed", "s3://b")
        logging.getLogger("relay.store").debug("not shown at info")
    finally:
        logs.setup("warning", "text", stream=io.StringIO())  # replaces it
    [line] = out.getvalue().splitlines()
    stamp, level, logger, message = line.split(" ", 3)
    assert stamp.endswith("Z") and (level, logger) == ("WARNING", "relay.store")
    assert message == "store s3://b: renewing failed"


def test_a_second_setup_replaces_the_first(captured: io.StringIO) -> None:
    other = io.StringIO()
    logs.setup("info", "text", stream=other)
    logging.getLogger("relay.node").warning("once")
    assert captured.getvalue() == "" and other.getvalue().count("once") == 1


class Kept(logging.Handler):
    """Keeps the records it is handed."""

    def __init__(self, kept: list[logging.LogRecord]) -> None:
        super().__init__()
        self.kept = kept

    def emit(self, record: logging.LogRecord) -> None:
        self.kept.append(record)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1_000.0

    def __call__(self) -> float:
        return self.now_s


def test_identical_lines_are_held_back_and_counted_per_window() -> None:
    written: list[logging.LogRecord] = []
    clock = Clock()
    repeats = logs.RepeatFilter(written.append, window_s=60.0, clock=clock)
    log = logging.getLogger("relay.test.repeats")
    log.propagate = False
    handler = Kept(written)
    handler.addFilter(repeats)
    log.addHandler(handler)
    try:
        for _ in range(735):
            log.warning("relay=0 link from relay %d closed; reconnecting", 1)
            clock.now_s += 0.05
        log.warning("relay=0 link from relay %d closed; reconnecting", 2)  # not identical
        assert [r.getMessage() for r in written] == [
            "relay=0 link from relay 1 closed; reconnecting",
            "relay=0 link from relay 2 closed; reconnecting",
        ]
        clock.now_s += 60.0  # the window ends: the next line writes the summary first
        log.warning("relay=0 link from relay %d closed; reconnecting", 1)
        summary = written[2]
        assert summary.getMessage() == (
            "relay=0 link from relay 1 closed; reconnecting (repeated 734 times in the last 60 s)"
        )
        assert getattr(summary, "repeated", None) == 734
        assert written[3].getMessage() == "relay=0 link from relay 1 closed; reconnecting"
        log.warning("relay=0 link from relay %d closed; reconnecting", 1)
        repeats.flush()  # at exit: what is pending is written, not lost
        assert written[-1].getMessage().endswith("(repeated 1 time in the last 0 s)")
        assert len(written) == 5
    finally:
        repeats.close()
        log.removeHandler(handler)


def test_every_state_change_is_written_even_when_it_repeats(captured: io.StringIO) -> None:
    log = logging.getLogger("relay.node")
    for fenced in (True, False, True, False):  # a flapping stream: each change is news
        words = "fenced: quorum, waiting for relays [1]" if fenced else "unfenced"
        log.warning("relay=0 stream=a %s", words, extra={logs.STATE_CHANGE: True})
    assert [d["message"] for d in lines_of(captured)] == [
        "relay=0 stream=a fenced: quorum, waiting for relays [1]",
        "relay=0 stream=a unfenced",
    ] * 2
    assert lines_of(captured)[0]["state_change"] is True


def test_a_summary_is_written_when_its_window_ends_with_nothing_else_logged(
    captured: io.StringIO,
) -> None:
    handler = next(h for h in logging.getLogger().handlers if isinstance(h, logs._Handler))
    handler.repeats.window_s = 0.2  # the timer thread writes it: no other line comes
    log = logging.getLogger("relay.node")
    for _ in range(3):
        log.warning("spool of relay 0: cannot read the store")
    wait_until(lambda: len(lines_of(captured)) == 2, "the timer to write the summary")
    first, summary = lines_of(captured)
    assert first["message"] == "spool of relay 0: cannot read the store"
    assert summary["repeated"] == 2 and "(repeated 2 times" in str(summary["message"])


# --- seqs as text ---------------------------------------------------------------------------


def test_seqs_round_trip_exactly_as_strings() -> None:
    doc = {"seq": BIG_SEQ, "outcome": "committed", "streams": {"a": {"committed": BIG_SEQ + 1}}}
    text = json.dumps(seqs_as_text(doc))
    back = json.loads(text)
    assert back["seq"] == str(BIG_SEQ) and parse_seq(back["seq"]) == BIG_SEQ
    assert parse_seq(back["streams"]["a"]["committed"]) == BIG_SEQ + 1
    assert float(back["seq"]) != BIG_SEQ  # why: a double rounds it
    assert seqs_as_text({"seq": None, "held": 5, "fenced": True}) == {
        "seq": None,
        "held": 5,
        "fenced": True,
    }


@pytest.mark.parametrize(
    ("text", "seq"),
    [("0", 0), (" 42 ", 42), ('"383315973454696481"', BIG_SEQ), ("-1", -1), (BIG_SEQ, BIG_SEQ)],
)
def test_parse_seq_takes_digits_json_strings_and_ints(text: str | int, seq: int) -> None:
    assert parse_seq(text) == seq


@pytest.mark.parametrize(
    "text", ["", "abc", "1e5", "1_000", "+5", "١٢", "-2", str(1 << 63), "999999999999999999999"]
)
def test_parse_seq_refuses_anything_else_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="is not a seq"):
        parse_seq(text)
    with pytest.raises(ValueError, match="is not a seq"):
        parse_seq("-1", allow_none=False)
