"""The live status page (relay/page.html, served at / by relay/opsserver.py) in a real
browser: Debian's headless Chromium (scripts/browser-deps.sh installs it) loads it from
one relay of a real 3-relay mesh under produce load, and the page must show every relay
answering with live commit rates, computed from the relays' /status documents.

RELAY_STATUS_PAGE_PNG=<file> makes the first test write its screenshot there (that is how
docs/status-page.png is made; docs/operations.md gives the command)."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from browser import INSTALL_TIMEOUT_S, Browser, find_chromium
from relay.client import Producer
from relay.launcher import Mesh, resubscribe, write_loopback_topology
from waiting import wait_until

PAGE_TIMEOUT_S = 180.0  # until the page shows what a test waits for, over many runs
LOAD_STOP_S = 60.0  # how long the load thread may take to see it should stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(INSTALL_TIMEOUT_S + 2 * PAGE_TIMEOUT_S)]

RELAYS = 3
SEGMENT_MAX_AGE_MS = 200  # spooled records reach a segment soon: the spool shows a backlog
# The streams under load (two, so the screenshot shows rates side by side).
STREAMS = ("orders.eu", "orders.us")
# A stream name that is markup: the page must show it as text (textContent, not innerHTML).
MARKUP_STREAM = 'orders.<i>x</i>&"y'
MARKUP_STREAM_AS_TEXT = '<td>orders.&lt;i&gt;x&lt;/i&gt;&amp;"y</td>'
# Where the screenshot for the README is written, when this names a file.
SCREENSHOT_ENV = "RELAY_STATUS_PAGE_PNG"
# A stream cell's relay and its commit rate (records/s) in the dumped DOM.
RATE_CELL = r'<td id="stream-(\d+)-[^"]*"[^>]*>.*?data-kind="rate">([0-9.]+)<'
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIN_SCREENSHOT_BYTES = 10_000  # a blank 1400x900 page compresses to far less


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's Chromium, installed by scripts/browser-deps.sh if missing."""
    found, why = find_chromium()
    if found is None:
        pytest.skip(why)
    return found


class _Load:
    """Produces to STREAMS in turn, in a thread, until stopped: commit rates are not zero."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.sent = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with Producer(topology=self.mesh.config) as producer:
                while not self._stop.is_set():
                    stream = STREAMS[self.sent % len(STREAMS)]
                    producer.send(stream, f"load-{self.sent}".encode())
                    self.sent += 1
        except BaseException as e:  # reported by the test
            self.error = e

    def __enter__(self) -> _Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=LOAD_STOP_S)


@pytest.fixture
def mesh(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Mesh]:
    """3 relays on free ports of 127.0.0.1 with HTTP ports and spools, serving STREAMS (or
    the streams a test gives as its parameter); stopped also when the test fails."""
    streams = list(getattr(request, "param", STREAMS))
    topology = write_loopback_topology(
        tmp_path,
        {i: streams for i in range(RELAYS)},
        streams,
        spool={"enabled": True, "segment_max_age_ms": SEGMENT_MAX_AGE_MS},
        http=True,
    )
    mesh = Mesh(topology, log_level="warning", log_dir=tmp_path / "logs")
    with mesh.start(timeout_s=60):
        yield mesh


@pytest.fixture
def browser(chromium: str, tmp_path: Path) -> Browser:
    return Browser(chromium, tmp_path / "chromium-profile")


def page_url(mesh: Mesh) -> str:
    url = mesh.config.relays[0].http_url
    assert url is not None
    return url + "/"


def _not_live(dom: str, relays: list[int]) -> list[str]:
    """What keeps the page from showing every relay live: each up, committing (a rate above
    0), its committed seqs shown whole, hearing every other, and no stream fenced or
    stalled."""
    out = [] if 'data-state="live"' in dom else ["the mesh not live"]
    committing = {int(relay) for relay, rate in re.findall(RATE_CELL, dom) if float(rate) > 0}
    out += [f"relay {r} not committing" for r in relays if r not in committing]
    for relay in relays:
        up = f'<tr id="relay-{relay}" data-relay="{relay}"><td>{relay}</td><td class="ok">up<'
        if up not in dom:
            out.append(f"relay {relay} not up")
        for stream in STREAMS:
            cell = rf'id="stream-{relay}-{re.escape(stream)}".*?data-kind="committed">'
            committed = re.search(cell + r"committed (\d+)<", dom)
            if not committed or len(committed[1]) < 18:  # not a rounded float
                out.append(f"relay {relay}: {stream}'s committed seq not shown whole")
        for peer in relays:
            if peer != relay and f'<td class="ok" data-link="{relay}-{peer}">hears' not in dom:
                out.append(f"relay {relay} not hearing {peer}")
    out += [word for word in (">fenced:", ">stalled:") if word in dom]
    return out


def test_the_page_shows_every_relay_live_in_a_real_browser(
    mesh: Mesh, browser: Browser, tmp_path: Path
) -> None:
    url = page_url(mesh)
    relays = sorted(mesh.config.relays)
    problems: list[str] = ["not looked at yet"]

    def live_page() -> str | None:
        # Every condition at once, on one page: on a loaded machine a view change may fence
        # a stream for a moment (fenced: not_admitted), which the next page no longer shows.
        dom = browser.dom(url)
        problems[:] = _not_live(dom, relays)
        return dom if not problems else None

    with _Load(mesh) as load:
        wait_until(
            live_page,
            lambda: f"the page to show every relay live and committing, not {problems}",
            timeout_s=PAGE_TIMEOUT_S,
        )
        screenshot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "status-page.png")
        code, _, err = browser.run(url, f"--screenshot={screenshot}", "--window-size=1400,900")
    assert load.error is None, load.error
    assert load.sent > 0
    data = screenshot.read_bytes()
    assert code == 0 and data.startswith(PNG_MAGIC), err
    assert len(data) > MIN_SCREENSHOT_BYTES, len(data)


@pytest.mark.parametrize("mesh", [(MARKUP_STREAM,)], indirect=True, ids=["markup-stream"])
def test_the_page_shows_a_relay_that_went_down(mesh: Mesh, browser: Browser) -> None:
    url = page_url(mesh)
    mesh.kill(2)

    # Relay 2 is down at once (its port refuses); the others stop hearing it once its
    # heartbeats are overdue.
    silent = [f'<td class="bad" data-link="{relay}-2">silent' for relay in (0, 1)]

    def down_shown() -> str | None:
        dom = browser.dom(url)
        shown = 'data-state="partial"' in dom and all(link in dom for link in silent)
        return dom if shown else None

    dom = wait_until(down_shown, "the page to show relay 2 down", timeout_s=PAGE_TIMEOUT_S)
    assert '<tr id="relay-2" data-relay="2"><td>2</td><td class="bad">down since ' in dom, dom
    assert dom.count('<td class="ok">up<') == 2, dom
    assert MARKUP_STREAM_AS_TEXT in dom, dom  # the name as text, not as an <i> element


def test_the_page_shows_configurations_that_hold_a_relay_apart(
    browser: Browser, tmp_path: Path
) -> None:
    """Relay 2 restarts onto an edited topology file (docs/protocol.md 5.15): it names
    relays 1 and 2 for orders.eu, and relays 0, 1 and 2 for orders.us, which relays 0 and 1
    served alone. Relay 2's cells show that orders.eu keeps running on the relays of its
    configuration, and that orders.us's configuration leaves relay 2 out."""
    eu, us = STREAMS
    topology = write_loopback_topology(
        tmp_path, {0: [eu, us], 1: [eu, us], 2: [eu]}, [eu, us], http=True
    )
    mesh = Mesh(topology, log_level="warning", log_dir=tmp_path / "logs")
    with mesh.start(timeout_s=60):
        with Producer(topology=mesh.config) as producer:
            for stream in STREAMS:
                producer.send(stream, b"before the edit")
        resubscribe(topology, {0: [us], 2: [eu, us]})
        mesh.restart(2, timeout_s=60)
        url = page_url(mesh)
        expected = {
            eu: r'data-kind="config-topology"[^>]*>runs on relays 0, 1, 2 \(configuration 1\); '
            r"the topology file names relays 1, 2<",
            us: r'<div class="warn">not a member</div><div class="warn" data-kind="not-member"'
            r"[^>]*>runs on relays 0, 1 \(configuration 1\); the topology file names "
            r"relays 0, 1, 2<",
        }

        def shown() -> str | None:
            dom = browser.dom(url)
            for stream, pattern in expected.items():
                cell = re.search(rf'<td id="stream-2-{re.escape(stream)}".*?</td>', dom)
                if cell is None or not re.search(pattern, cell[0]):
                    return None
            return dom

        dom = wait_until(
            shown,
            "the page to show relay 2 keeping orders.eu's relays and left out of orders.us",
            timeout_s=PAGE_TIMEOUT_S,
        )
    # Relays 0 and 1 serve both as their topology (the one they read) says: nothing to say.
    for relay in (0, 1):
        for stream in STREAMS:
            cell = re.search(rf'<td id="stream-{relay}-{re.escape(stream)}".*?</td>', dom)
            assert cell and 'data-kind="config-topology"' not in cell[0], (relay, dom)
