"""Scenario scripts (tests/scenarios/*.txt), in the style of etcd-io/raft's testdata.

Each script drives real RelayCore instances over a scripted network (relay.sim.script)
and holds, after every command, the output it printed (`> ` lines). A test runs its script
and compares the regenerated text with the file; a mismatch shows a unified diff.

When behaviour changes on purpose, regenerate the expected output and review the diff:

    RELAY_REWRITE_SCENARIOS=1 pytest tests/test_scenarios.py
    # or: relay scenario --rewrite tests/scenarios/*.txt

(The option is an environment variable because pytest options can only be declared in a
conftest or plugin, and this module keeps to itself.)
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from relay.cli import main
from relay.sim.script import OUTPUT_PREFIX, VIOLATION_PREFIX, Interpreter, ScriptError, run_script

SCENARIOS = Path(__file__).parent / "scenarios"
SCRIPTS = sorted(SCENARIOS.glob("*.txt"))
REWRITE = os.environ.get("RELAY_REWRITE_SCENARIOS", "") not in ("", "0")


def test_scenarios_exist() -> None:
    names = {p.stem for p in SCRIPTS}
    assert {
        "commit",
        "late_arrival",
        "repair",
        "fencing",
        "dedupe",
        "join",
        "forward",
        "clock_ahead",
    } <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_scenario(path: Path) -> None:
    expected = path.read_text()
    actual = run_script(expected)
    violations = [
        line for line in actual.splitlines() if line.startswith(OUTPUT_PREFIX + VIOLATION_PREFIX)
    ]
    if REWRITE:
        if actual != expected:
            path.write_text(actual)
    elif actual != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                actual.splitlines(keepends=True),
                fromfile=f"{path.name} (expected)",
                tofile=f"{path.name} (actual)",
            )
        )
        pytest.fail(
            f"scenario {path.name} printed something else "
            f"(RELAY_REWRITE_SCENARIOS=1 rewrites it):\n{diff}",
            pytrace=False,
        )
    assert not violations, "invariant violations:\n" + "\n".join(violations)


# --- the interpreter itself -----------------------------------------------------------------


def test_invariant_check_flags_a_bad_delivery() -> None:
    interp = Interpreter()
    for line in ("topology 0:s 1:s 2:s", "stabilize", "produce 0 s p 1 a", "produce 1 s q 1 b"):
        interp.execute(line)
    assert interp.execute("stabilize") == []
    mesh = interp.m
    a, b = mesh.logs[(0, 1)]["s"]
    mesh.logs[(2, 1)]["s"] = [a, (b[0], a[1])]  # relay 2 delivered `a` at b's seq too
    mesh.logs[(1, 1)]["s"] = [b, a]  # and relay 1 delivered out of order
    problems = mesh.check()
    assert any(p.startswith("reorder: relay 1/1 delivered s seq a after b") for p in problems)
    assert any(p.startswith("divergence: s seq b is q#1 elsewhere but p#1") for p in problems)


def test_scenario_command(tmp_path: Path) -> None:
    script = tmp_path / "s.txt"
    script.write_text("topology 0:s 1:s 2:s\nnow\n> 5 ms\n")
    result = CliRunner().invoke(main, ["scenario", str(script)])
    assert result.exit_code == 1 and "> 0 ms" in result.output
    assert CliRunner().invoke(main, ["scenario", "--rewrite", str(script)]).exit_code == 0
    assert script.read_text() == "topology 0:s 1:s 2:s\nnow\n> 0 ms\n"
    assert CliRunner().invoke(main, ["scenario", str(script)]).exit_code == 0
    script.write_text("tick 1\n")
    result = CliRunner().invoke(main, ["scenario", str(script)])
    assert result.exit_code == 2 and "must start with `topology`" in result.output


def test_script_errors_name_the_line() -> None:
    with pytest.raises(ScriptError, match=r"line 2: tick x: ms: expected an integer"):
        run_script("topology 0:s 1:s 2:s\ntick x\n")
    with pytest.raises(ScriptError, match=r"line 1: .*must start with `topology`"):
        run_script("tick 1\n")
    with pytest.raises(ScriptError, match=r"no relay 7"):
        run_script("topology 0:s 1:s 2:s\ncut 0->7\n")


def test_rewrite_keeps_commands_and_comments() -> None:
    script = "# hello\ntopology 0:s 1:s 2:s  # three\n> stale output\n\nnow\n> 0 ms\n"
    assert run_script(script) == "# hello\ntopology 0:s 1:s 2:s  # three\n\nnow\n> 0 ms\n"
