"""Debian's headless Chromium for the tests that look at the live status page
(relay/page.html): found, or installed by scripts/browser-deps.sh, and run against one URL
at a time."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTALL_TIMEOUT_S = 1_800.0  # apt-get installing Chromium and its libraries
BROWSER_TIMEOUT_S = 120.0  # one Chromium run (it takes a few seconds here)
VIRTUAL_TIME_MS = 5_000  # page time Chromium lets pass before it dumps or shoots the page


def find_chromium() -> tuple[str | None, str]:
    """(Chromium's path, "") or, if it is missing and could not be installed, (None, why)."""
    found = shutil.which("chromium")
    if found is None:
        setup = subprocess.run(
            ["bash", str(ROOT / "scripts" / "browser-deps.sh")],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
        found = shutil.which("chromium")
        if found is None:
            return None, f"Chromium is missing and could not be installed: {setup.stderr[-2000:]}"
    return found, ""


class Browser:
    """Headless Chromium runs against one URL, each in a process group of its own that is
    killed whole afterwards (Chromium starts helper processes), also when a run fails."""

    def __init__(self, executable: str, profile: Path) -> None:
        self.executable = executable
        self.profile = profile  # not the user's: nothing of a run stays in ~/.config

    def run(self, url: str, *args: str) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of one run with `args` (--dump-dom, --screenshot)."""
        command = [
            self.executable,
            "--headless",
            "--no-sandbox",  # it runs as root here
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={self.profile}",
            f"--virtual-time-budget={VIRTUAL_TIME_MS}",
            *args,
            url,
        ]
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=BROWSER_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return proc.returncode, out, err

    def dom(self, url: str) -> str:
        return self.run(url, "--dump-dom")[1]
