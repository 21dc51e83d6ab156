"""The hot modules compiled to C with mypyc, used only where they were built from these sources.

The relay's turn and the clients' per-transaction work are many small Python steps (no
function above 4 % of a turn); mypyc compiles the same type-annotated sources to C
extension modules, with attribute access and calls of native classes done in C. The
sources stay the one truth: the simulator, the tests and every shell run them, compiled
or not, and both must behave alike (tests/test_native.py compares the simulator's event
hashes).

`relay.native.main(["build"])` (scripts/setup.sh runs it) compiles `COMPILED_MODULES` into
`<sys.prefix>/relay-native/<digest>/`, where the digest covers every source file of the
package and the Python version. `install()` (run when `relay` is
imported) puts a finder first on `sys.meta_path` that loads those extension modules only
when a build for exactly the current digest exists. Anything else (no build, a source
edited since, a C compiler missing at set-up, `RELAY_NATIVE=0`) leaves the ordinary
imports of the sources, which are only slower.

What compiled code needs of the sources is in CONTRIBUTING.md ("Compiled modules").
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
# Modules of the protocol core that are not compiled: the package's own `__init__` (a
# compiled package needs its search path set up by hand); those defining msgspec Structs,
# the peer messages among them (relay/core/structs.py says why); and the configuration,
# whose frozen dataclasses a core holds and the explorer and the tests copy by pickle:
# compiled, a frozen dataclass cannot be unpickled.
_CORE_KEPT = {"__init__", "config", "messages", "structs"}
# The shell modules on the per-transaction path of a relay or a client.
_SHELL_MODULES = (
    "relay.access",
    "relay.acceptors",
    "relay.engines",
    "relay.hoptrace",
    "relay.node",
    "relay.service",
    "relay.sockets",
    "relay.wire",
)
COMPILED_MODULES: tuple[str, ...] = tuple(
    sorted(
        [
            f"relay.core.{path.stem}"
            for path in (PACKAGE_DIR / "core").glob("*.py")
            if path.stem not in _CORE_KEPT
        ]
        + list(_SHELL_MODULES)
    )
)
GROUP_NAME = "relay_native"  # the shared library of all compiled modules: relay_native__mypyc
DISABLE_ENV = "RELAY_NATIVE"  # "0": never load the compiled modules
DIR_ENV = "RELAY_NATIVE_DIR"  # where builds live; default <sys.prefix>/relay-native


def interpreted_env() -> dict[str, str]:
    """This process's environment, for a child that must run the sources interpreted (a
    profile, or a patched module function: neither sees into compiled code)."""
    return dict(os.environ, **{DISABLE_ENV: "0"})


def builds_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or Path(sys.prefix) / "relay-native")


@functools.cache  # the sources do not change under a running process
def source_digest() -> str:
    """Names the sources a build is valid for: every module of the package (a compiled
    module takes the types and constants of what it imports at build time) and the Python
    that runs it."""
    digest = hashlib.sha256(sys.version.encode())
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE_DIR)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:24]


def _module_file(build: Path, module: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = build / (module.replace(".", "/") + suffix)
        if candidate.exists():
            return candidate
    return None


class _CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled module of a name in `files`; leaves every other name alone."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


_installed: _CompiledFinder | None = None


def install() -> bool:
    """Loads the compiled modules from now on, if a build for these sources exists. Returns
    whether it does. Called before any compiled module is imported (relay/__init__.py)."""
    global _installed
    if _installed is not None:
        return True
    if os.environ.get(DISABLE_ENV) == "0" or not builds_dir().is_dir():
        return False
    build = builds_dir() / source_digest()
    names = [*COMPILED_MODULES, f"{GROUP_NAME}__mypyc"]
    files = {name: _module_file(build, name) for name in names}
    if not all(files.values()):
        return False
    _installed = _CompiledFinder({name: file for name, file in files.items() if file})
    sys.meta_path.insert(0, _installed)
    return True


def active() -> bool:
    """Whether the compiled modules are in use (for status and benchmark reports)."""
    machine = sys.modules.get("relay.core.machine")
    spec = machine.__spec__ if machine is not None else None
    return _installed is not None and (
        spec is None or isinstance(spec.loader, importlib.machinery.ExtensionFileLoader)
    )


def build(jobs: int = 0) -> Path:
    """Compiles `COMPILED_MODULES` for the current sources (no-op if that build exists) and
    removes builds of other sources. Needs mypy, setuptools and a C compiler."""
    target = builds_dir() / source_digest()
    if _module_file(target, f"{GROUP_NAME}__mypyc") is not None:
        return target  # (set-up asks at every run: no compiler imported for that)

    from concurrent.futures import ThreadPoolExecutor  # only here: every command imports this

    from mypyc.build import mypycify  # only here: mypy is a set-up dependency
    from setuptools import Distribution
    from setuptools.command.build_ext import build_ext

    workers = jobs or os.cpu_count() or 1

    class ParallelBuild(build_ext):
        """Compiles an extension's C files side by side: all modules are one extension
        (calls between them stay direct), which setuptools would compile one file at a
        time."""

        def build_extension(self, ext: Any) -> None:
            serial = self.compiler.compile

            def compile_all(sources: list[str], **options: Any) -> list[str]:
                with ThreadPoolExecutor(workers) as pool:
                    done = pool.map(lambda source: serial([source], **options), sources)
                    return [obj for objects in done for obj in objects]

            self.compiler.compile = compile_all
            try:
                super().build_extension(ext)
            finally:
                self.compiler.compile = serial

    root = PACKAGE_DIR.parent
    builds_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="relay-native-") as scratch:
        staging = Path(scratch) / "lib"
        here = Path.cwd()
        os.chdir(root)  # mypyc names modules after paths relative to the working directory
        try:
            paths = [module.replace(".", "/") + ".py" for module in COMPILED_MODULES]
            extensions = mypycify(
                paths, group_name=GROUP_NAME, multi_file=True, target_dir=f"{scratch}/c"
            )
            distribution = Distribution(
                {
                    "name": "relay-native",
                    "ext_modules": extensions,
                    "cmdclass": {"build_ext": ParallelBuild},
                }
            )
            command = distribution.get_command_obj("build_ext")
            command.build_lib = str(staging)
            command.build_temp = f"{scratch}/obj"
            command.ensure_finalized()
            command.run()
        finally:
            os.chdir(here)
        partial = builds_dir() / f".partial-{target.name}"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(staging, partial)
        try:
            partial.rename(target)  # a build appears whole or not at all
        except OSError:  # another set-up finished the same build first
            shutil.rmtree(partial, ignore_errors=True)
    for old in builds_dir().iterdir():
        if old != target and not old.name.startswith(".partial-"):
            shutil.rmtree(old, ignore_errors=True)
    return target


def main(argv: Sequence[str]) -> int:
    if list(argv) == ["build"]:
        print(f"relay.native: compiled modules in {build()}")
        return 0
    if list(argv) == ["status"]:
        print("active" if install() else f"not built for these sources (in {builds_dir()})")
        return 0
    print("usage: relay.native.main(['build']) or main(['status'])", file=sys.stderr)
    return 2
