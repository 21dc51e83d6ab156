"""relay/core is the pure protocol: no I/O, no clocks, no randomness, no threads.

Every decision the core makes must be a function of its inputs, so that the simulator can
replay a seed exactly. This test parses every module under relay/core and rejects imports of
modules that reach the outside world, and imports of any part of `relay` other than
`relay.core` and `relay.errors`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE_DIR = Path(__file__).resolve().parent.parent / "relay" / "core"

FORBIDDEN_TOP_LEVEL = frozenset(
    {
        "asyncio",
        "zmq",
        "socket",
        "time",
        "random",
        "threading",
        "subprocess",
        "multiprocessing",
        "os",
        "datetime",
        "secrets",
        "select",
        "selectors",
        "signal",
        "uuid",
        # Not I/O itself, but a way around every rule above.
        "importlib",
    }
)
ALLOWED_RELAY = ("relay.core", "relay.errors")


def _allowed_relay(module: str) -> bool:
    return any(module == ok or module.startswith(ok + ".") for ok in ALLOWED_RELAY)


def _why_forbidden(module: str) -> str | None:
    top = module.split(".", 1)[0]
    if top in FORBIDDEN_TOP_LEVEL:
        return f"imports {module!r} ({top} is forbidden in relay/core)"
    if top == "relay" and not _allowed_relay(module):
        return f"imports {module!r} (relay/core may import only relay.core and relay.errors)"
    return None


def import_violations(
    source: str, package: str = "relay.core", filename: str = "<src>"
) -> list[str]:
    """Return one message per forbidden import in `source`, a module of `package`."""
    tree = ast.parse(source, filename=filename)
    found: list[str] = []

    def check(module: str, line: int) -> None:
        why = _why_forbidden(module)
        if why:
            found.append(f"{filename}:{line}: {why}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    found.append(f"{filename}:{node.lineno}: relative import beyond top level")
                    continue
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if node.module is None or module == "relay":
                # `from . import x` / `from relay import x`: each name may be a submodule.
                for alias in node.names:
                    check(f"{module}.{alias.name}", node.lineno)
            else:
                check(module, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "__import__"
        ):
            found.append(f"{filename}:{node.lineno}: calls __import__")
    return found


def _core_files() -> list[Path]:
    return sorted(CORE_DIR.rglob("*.py"))


def _package_of(path: Path) -> str:
    # relay/core/a/b.py and relay/core/a/__init__.py both belong to package relay.core.a.
    return ".".join(path.relative_to(CORE_DIR.parent.parent).parts[:-1])


def test_core_exists() -> None:
    assert _core_files(), f"no Python files found under {CORE_DIR}"


def test_core_imports_nothing_impure() -> None:
    violations: list[str] = []
    for path in _core_files():
        violations += import_violations(
            path.read_text(encoding="utf-8"),
            package=_package_of(path),
            filename=str(path.relative_to(CORE_DIR.parent.parent)),
        )
    assert not violations, "relay/core must stay pure:\n" + "\n".join(violations)


@pytest.mark.parametrize(
    "source",
    [
        "import time",
        "import os.path",
        "from os import path",
        "import zmq as z",
        "from datetime import datetime",
        "import json, random",
        "def f():\n    import asyncio\n",
        "try:\n    import uuid\nexcept ImportError:\n    pass\n",
        "from relay.sim import network",
        "from relay import sim",
        "import relay.cli",
        "import relay",
        "from .. import sim",
        "from ..sim.network import Net",
        "from ... import anything",
        "import importlib",
        "m = __import__('socket')",
    ],
)
def test_checker_catches_forbidden_import(source: str) -> None:
    assert import_violations(source, package="relay.core"), source


@pytest.mark.parametrize(
    "source",
    [
        "import dataclasses\nimport enum\nfrom collections import deque",
        "import struct, bisect, fnmatch",
        "import xxhash\nimport msgpack",
        "from relay.core.seq import MAX_SEQ",
        "import relay.core.digest",
        "from relay.errors import ConfigError",
        "from relay import core, errors",
        "from . import seq",
        "from .messages import Transaction",
        "from ..errors import FrameError",
        "from .. import errors",
        "import timeit_not_time_really as t",
        "from typing import TYPE_CHECKING",
    ],
)
def test_checker_allows_pure_imports(source: str) -> None:
    assert import_violations(source, package="relay.core") == [], source


def test_checker_reports_file_and_line() -> None:
    (message,) = import_violations("import json\n\nimport socket\n", filename="relay/core/x.py")
    assert message.startswith("relay/core/x.py:3: ")
    assert "socket" in message
