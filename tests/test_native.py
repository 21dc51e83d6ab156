"""The compiled modules (relay/native.py) behave as their sources do, and are only ever
loaded for exactly those sources."""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from relay import native
from relay.core.structs import IdentityStruct

ROOT = Path(__file__).resolve().parent.parent
# Simulator seeds whose event hashes, compiled against interpreted, are compared: the
# first four told apart each compiled core that decided differently while it was built
# (a Struct compared by identity, a tuple told from itself by identity).
HASHED_SEEDS = 4
# The simulator's limits that make it evict (as `relay sim` runs half its checks with).
EVICTING = (
    "Limits(relay_buffer_max_bytes=280_000, dedupe_window_entries=300, report_log_entries=200)"
)


def struct_classes() -> list[tuple[str, type[msgspec.Struct], ast.ClassDef]]:
    """Every msgspec Struct defined in a compiled module, with its class statement."""
    found = []
    for name in native.COMPILED_MODULES:
        module = importlib.import_module(name)
        source = ROOT / (name.replace(".", "/") + ".py")
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.ClassDef):
                cls = getattr(module, node.name)
                if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
                    found.append((name, cls, node))
    return found


def test_every_compiled_struct_is_compared_by_identity_through_its_base() -> None:
    classes = struct_classes()
    assert {cls.__name__ for _, cls, _ in classes} >= {"Op", "Pending", "Waiter"}
    for module, cls, node in classes:
        where = f"{module}.{cls.__name__}"
        # Compiled, the class statement's keywords are dropped and == is identity: the
        # base must say eq=False (relay/core/structs.py).
        assert issubclass(cls, IdentityStruct), f"{where}: not an IdentityStruct"
        assert not cls.__struct_config__.eq, f"{where}: compared by value"
        for keyword in node.keywords:
            assert keyword.arg is not None
            said = ast.literal_eval(keyword.value)
            assert getattr(cls.__struct_config__, keyword.arg) == said, f"{where}: {keyword.arg}"


def test_frozen_structs_compare_by_value_where_compiled() -> None:
    # Timeline.insert tells a duplicate (same transaction) from a conflict with ==: in the
    # compiled module, not here, which is why the check runs through it.
    from relay.core.memory import MemoryBudget
    from relay.core.messages import Transaction
    from relay.core.timeline import Insert, Timeline

    timeline = Timeline("s", 100, 100, MemoryBudget(1 << 30))
    timeline.base_point = 0
    assert timeline.insert(10, Transaction(b"p", 1, None, b"v")) is Insert.INSERTED
    assert timeline.insert(10, Transaction(b"p", 1, None, b"v")) is Insert.DUPLICATE
    assert timeline.insert(10, Transaction(b"p", 1, None, b"w")) is Insert.CONFLICT


def _event_hashes(compiled: bool) -> str:
    code = (
        "import sys\n"
        "from relay import native\n"
        "from relay.core.config import Limits\n"
        "from relay.sim.runner import run_seed\n"
        f"assert native.active() == {compiled}, 'compiled: ' + str(native.active())\n"
        f"for seed in range({HASHED_SEEDS}):\n"
        "    for limits in (Limits(), " + EVICTING + "):\n"
        "        result = run_seed(seed, 0, 'all', limits=limits)\n"
        "        print(seed, result.ok, result.event_hash)\n"
    )
    env = dict(os.environ, **{native.DISABLE_ENV: "1"}) if compiled else native.interpreted_env()
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(os.environ.get(native.DISABLE_ENV) == "0", reason="RELAY_NATIVE=0")
def test_compiled_and_interpreted_cores_simulate_alike() -> None:
    assert native.install(), (
        f"no compiled modules for these sources in {native.builds_dir()}: "
        "bash scripts/setup.sh builds them (it needs a C compiler; see its log)"
    )
    assert _event_hashes(compiled=True) == _event_hashes(compiled=False)


def test_a_build_is_loaded_only_for_its_own_sources(tmp_path: Path) -> None:
    """A copy of the package loads the build made for its sources; edited, it falls back to
    the interpreted modules, never to a stale build."""
    copy = tmp_path / "relay"
    shutil.copytree(ROOT / "relay", copy, ignore=shutil.ignore_patterns("__pycache__"))
    code = "import relay.native as n, relay.core.machine as m; print(n.active(), m.__file__)"

    def load() -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=dict(os.environ, PYTHONPATH=str(tmp_path)),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    if native.install():
        active, loaded = load()
        assert active == "True" and loaded.startswith(str(native.builds_dir())), loaded
    machine = copy / "core" / "machine.py"
    machine.write_text(machine.read_text() + "\n# edited\n")
    assert load() == ["False", str(machine)]


def test_a_running_core_survives_a_pickle_round_trip() -> None:
    """The explorer and the tests copy cores by pickle: compiled, every class a core holds
    must say it can be (mypyc_attr serializable)."""
    import pickle

    from relay.core.config import Limits, Topology
    from relay.core.messages import Transaction
    from relay.core.shell import ProduceRequest
    from relay.sim.script import START_UNIX_MS, Mesh

    mesh = Mesh(Topology({0: ("s",), 1: ("s",), 2: ("s",)}), Limits())
    for _ in range(300):
        mesh.step_ms()
    core = mesh.running(0)
    for n in range(4):
        request = ProduceRequest(n, "s", Transaction(b"p", n, None, b"v"))
        core.produce(request, START_UNIX_MS + mesh.now, mesh.now)
        mesh.step_ms()
    copy = pickle.loads(pickle.dumps(core, pickle.HIGHEST_PROTOCOL))
    assert copy.status() == core.status()
    assert copy.committed_point("s") == core.committed_point("s") >= 0
    # The copy goes on as the original does.
    later = mesh.now + 1_000
    for each in (core, copy):
        each.tick(START_UNIX_MS + later, later)
    assert [o.frame for o in copy.ready().outgoing] == [o.frame for o in core.ready().outgoing]


def test_cores_after_a_simulated_run_with_faults_survive_a_pickle_round_trip() -> None:
    """Views changed, relays rejoined, peers suspected: whatever such a core holds pickles."""
    import pickle

    from relay.sim.faults import FaultConfig
    from relay.sim.world import World

    world = World(3, 5, FaultConfig.parse("all"))
    world.run()
    cores = [node.core for node in world.nodes.values() if node.core is not None]
    assert cores
    for core in cores:
        copy = pickle.loads(pickle.dumps(core, pickle.HIGHEST_PROTOCOL))
        assert copy.status() == core.status()
