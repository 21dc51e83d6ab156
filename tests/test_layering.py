"""Imports point down: every module of `relay` imports only modules of its own layer's
lower layers (CONTRIBUTING.md, "How the code is laid out"), so there is no import cycle
between the parts, and runtime modules never import the tools or the simulator."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RELAY = Path(__file__).resolve().parent.parent / "relay"

# Top to bottom; a module may import from its own part and from any later layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("cli",),
    ("tools",),
    ("node", "client", "launcher", "storecmd", "sim"),
    ("incarnation", "hoptrace", "loop", "storerun", "opsserver"),
    (
        "service",
        "engines",
        "spool",
        "sockets",
        "acceptors",
        "security",
        "zap",
        "handshakes",
        "metasync",
        "intake",
    ),
    ("peerprotocol",),
    ("wire", "topology", "logs"),
    ("store",),  # the topology names the store's location (relay.store.location)
    ("segment", "access", "meta", "seqtext", "metrics", "produce_metrics", "streamhealth"),
    ("core",),
    ("errors", "__init__"),
    ("native",),
)
LAYER_OF = {part: depth for depth, parts in enumerate(LAYERS) for part in parts}


def part_of(module: str) -> str:
    """`relay.core.machine` -> `core`; `relay.node` -> `node`; `relay` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "relay":  # `from relay import wire`: a module, or the package's
                for alias in node.names:
                    is_module = (RELAY / f"{alias.name}.py").exists() or (
                        RELAY / alias.name
                    ).is_dir()
                    found.add(f"relay.{alias.name}" if is_module else "relay")
            elif node.module.startswith("relay."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("relay."))
    return found


MODULES = sorted(RELAY.rglob("*.py"))


def test_every_part_has_a_layer() -> None:
    parts = {p.relative_to(RELAY).parts[0].removesuffix(".py") for p in MODULES}
    assert parts <= set(LAYER_OF), parts - set(LAYER_OF)


def upward(here: str, modules: set[str]) -> list[str]:
    """The modules a module of part `here` may not import (its layer or above)."""
    return [
        module
        for module in sorted(modules)
        if part_of(module) != here and LAYER_OF[part_of(module)] <= LAYER_OF[here]
    ]


def test_the_rule_flags_imports_up_and_sideways() -> None:
    assert upward("core", {"relay.core.state", "relay.errors"}) == []
    assert upward("core", {"relay.node"}) == ["relay.node"]
    assert upward("engines", {"relay.spool", "relay.wire"}) == ["relay.spool"]


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(RELAY)) for p in MODULES])
def test_imports_point_down(path: Path) -> None:
    here = path.relative_to(RELAY).parts[0].removesuffix(".py")
    wrong = upward(here, imports_of(path))
    assert not wrong, f"relay/{path.relative_to(RELAY)} imports {wrong} (at or above its layer)"


def test_relays_and_clients_do_not_load_the_stores_libraries() -> None:
    """pyarrow and Spark are the store's: a relay or a client that reads no store must not
    pay for them at every start (pyarrow alone doubled a relay's memory at start)."""
    import subprocess
    import sys

    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, relay.node, relay.client, relay.cli; "
            "print(' '.join(m for m in ('pyarrow', 'pyspark', 'deltalake') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert loaded.stdout.strip() == "", loaded.stdout
