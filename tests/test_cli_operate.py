"""The `relay` command as an operator meets it, against one real 3-relay mesh on 127.0.0.1
(free ports) for the module: `relay status` (health, exit codes 0/1/2, readable at any
width), seqs as strings in JSON output and as input, $RELAY_CONFIG, usage errors without
tracebacks, Ctrl-C exit codes, commands that say what they wait for, JSON logs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from relay.cli import main
from relay.client import Consumer, Producer
from relay.launcher import Mesh, write_loopback_topology
from waiting import wait_until

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
STREAM = "orders.eu"
BIG = 1 << 53  # seqs are above it: a double cannot hold them exactly


def write_topology(directory: Path, **limits: int) -> Path:
    return write_loopback_topology(
        directory,
        {i: ["orders.*", "audit"] for i in range(3)},
        [STREAM, "audit"],
        limits=limits or None,
    )


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A running 3-relay mesh whose relays log JSON lines to files."""
    directory = tmp_path_factory.mktemp("mesh")
    running = Mesh(
        write_topology(directory), log_level="info", log_format="json", log_dir=directory / "logs"
    )
    try:
        running.start(timeout_s=30)
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def down(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A topology whose relays do not run (free ports; short produce timeouts)."""
    return write_topology(tmp_path_factory.mktemp("down"), produce_timeout_ms=300)


def cli(
    args: list[str], stdin: str | None = None, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, args, input=stdin, env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        result.output,
        result.exc_info,
    )
    return result.exit_code, result.stdout, result.stderr


def relay(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m relay ARGS` as a user runs it: output piped (not a terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# --- relay status -----------------------------------------------------------------------------


def test_status_of_a_healthy_mesh_exits_0_and_names_no_problem(mesh: Mesh) -> None:
    config = str(mesh.config_path)
    with Producer(topology=mesh.config) as producer:
        producer.send(STREAM, b"one")
    # A consumer that leaves while its read waits: the relay's answer finds nobody.
    args = ["consume", "--config", config, "--stream", STREAM, "--from", "latest"]
    assert cli([*args, "--timeout-s", "0.3"])[0] == 0

    def status_when_dropped() -> dict[str, Any] | None:
        doc = json.loads(cli(["status", "--config", config, "--json"])[1])
        counted = [r["status"]["node"]["counters"] for r in doc["relays"] if r["status"]]
        return doc if any(c.get("client_reply_dropped") for c in counted) else None

    doc = wait_until(status_when_dropped, "a relay to count the reply nobody took")
    # Consumers that left before their answers came are routine: no problem, no note.
    assert doc["health"] == "healthy" and doc["problems"] == [], doc["problems"]
    assert doc["notes"] == [], doc["notes"]
    code, out, _ = cli(["status", "--config", config])
    assert code == 0 and out.startswith(f"mesh {config}: healthy (3 of 3 relays answer)")


def test_status_reads_whole_at_any_width_and_in_a_pipe(mesh: Mesh) -> None:
    with Producer(topology=mesh.config) as producer:
        producer.send(STREAM, b"counted")
    for columns in ("40", "200"):
        done = relay(["status", "--config", str(mesh.config_path)], env={"COLUMNS": columns})
        assert done.returncode == 0, done.stderr
        text = done.stdout
        assert "…" not in text and "\x1b[" not in text  # nothing cut, no colour in a pipe
        assert "produce_committed=" in text and "delivered_entries=" in text
        assert f"stream {STREAM}: joined, committed seq " in text


def test_status_exits_1_with_a_relay_down_naming_it(mesh: Mesh) -> None:
    mesh.kill(2)
    try:
        code, out, _ = cli(
            ["status", "--config", str(mesh.config_path), "--json", "--timeout", "0.3"]
        )
        doc = json.loads(out)
        assert code == 1 and doc["health"] == "degraded" and doc["relays_answering"] == 2
        [problem] = [p for p in doc["problems"] if p["relay"] == 2]
        assert problem["stream"] is None and "does not answer on tcp://" in problem["problem"]
        code, out, _ = cli(["status", "--config", str(mesh.config_path), "--timeout", "0.3"])
        assert code == 1 and ": degraded (2 of 3 relays answer)" in out
        assert "relay 2: does not answer on tcp://" in out
    finally:
        mesh.restart(2, timeout_s=30)
    wait_until(
        lambda: cli(["status", "--config", str(mesh.config_path)])[0] == 0,
        "the mesh to be healthy again after relay 2 restarted",
    )


def test_status_exits_2_when_no_relay_answers_and_3_for_a_usage_error(
    down: Path, tmp_path: Path
) -> None:
    code, out, _ = cli(["status", "--config", str(down), "--json", "--timeout", "0.2"])
    doc = json.loads(out)
    assert code == 2 and doc["health"] == "down" and len(doc["problems"]) == 3
    assert cli(["status", "--config", str(down), "--timeout", "nan"])[0] == 3
    assert cli(["status", "--config", str(tmp_path / "missing.yaml")])[0] == 3
    help_text = cli(["status", "--help"])[1]
    assert "0  healthy" in help_text and "1  degraded" in help_text and "2  down" in help_text


# --- seqs as strings --------------------------------------------------------------------------


def test_seqs_are_strings_in_every_json_output_and_taken_back_exactly(mesh: Mesh) -> None:
    config = str(mesh.config_path)
    stream = "orders.seqs"
    code, out, err = cli(["produce", "--config", config, "--stream", stream], stdin="a\nb\nc\n")
    assert code == 0, err
    produced = [line["seq"] for line in lines(out)]
    assert all(isinstance(seq, str) and int(seq) > BIG for seq in produced), produced
    assert [str(int(seq)) for seq in produced] == produced  # exact decimal digits

    # Given back as a string (also JSON-quoted, as `jq .seq` prints it): exactly what follows.
    for start in (produced[0], json.dumps(produced[0])):
        code, out, err = cli(
            ["consume", "--config", config, "--stream", stream, "--from", start, "--count", "2"]
        )
        assert code == 0, err
        assert [line["seq"] for line in lines(out)] == produced[1:]

    code, out, err = cli(
        ["consumers", "reset", "g", "--config", config, "--stream", stream, "--to", produced[1]]
    )
    assert code == 0, err
    [mark] = lines(out)
    assert mark["seq"] == produced[1] and isinstance(mark["version"], str)
    code, out, err = cli(["consumers", "show", "g", "--config", config])
    [shown] = lines(out)
    assert shown["seq"] == produced[1] and int(shown["committed"]) >= int(produced[2]), shown
    [listed] = [
        m for m in lines(cli(["consumers", "list", "--config", config])[1]) if m["durable"] == "g"
    ]
    assert listed["seq"] == produced[1]
    assert cli(["consumers", "delete", "g", "--config", config])[0] == 0

    doc = json.loads(cli(["status", "--config", config, "--json"])[1])
    committed = []
    for entry in doc["relays"]:
        status = entry["status"]
        assert isinstance(status["floor"], str) and int(status["floor"]) > BIG
        committed.append(status["streams"][stream]["committed"])
    # a committed point moves on past the last record as time passes (a watermark)
    assert all(isinstance(c, str) and int(c) >= int(produced[-1]) for c in committed), committed

    # The Python client takes a seq as its decimal text too.
    with Consumer(topology=mesh.config, count=1, timeout_s=30) as consumer:
        consumer.subscribe(stream, produced[1])
        assert [record.seq for record in consumer] == [int(produced[2])]


def test_relay_config_from_the_environment(mesh: Mesh) -> None:
    env = {"RELAY_CONFIG": str(mesh.config_path)}
    code, _, err = cli(["produce", "--stream", STREAM], stdin="from env\n", env=env)
    assert code == 0, err
    assert cli(["status"], env=env)[0] == 0
    # --config wins over the environment
    assert cli(["status", "--config", str(mesh.config_path) + ".none"], env=env)[0] == 3
    assert "RELAY_CONFIG" in cli(["consume", "--help"])[1]


# --- usage errors -----------------------------------------------------------------------------

BAD_ARGUMENTS = [
    ["consume", "--stream", STREAM, "--from", "999999999999999999999"],
    ["consume", "--stream", STREAM, "--from", "-5"],
    ["consume", "--stream", STREAM, "--from", "1e5"],
    ["consume", "--stream", STREAM, "--from", "yesterday"],
    ["consume", "--stream", STREAM, "--since", "soon"],
    ["consume", "--stream", STREAM, "--since", "1m", "--from", "earliest"],
    ["consume", "--stream", STREAM, "--timeout-s", "nan"],
    ["consume", "--stream", STREAM, "--timeout-s", "1e400"],
    ["consume", "--stream", STREAM, "--count", "-1"],
    ["consume", "--stream", STREAM, "--relay", "99"],
    ["consume", "--stream", STREAM, "--relay", "one"],
    ["consume", "--stream", ""],
    ["consume", "--stream", STREAM, "--durable", "no/slash"],
    ["consume", "--stream", "orders.*", "--from", "snapshot"],
    ["produce", "--stream", STREAM, "--relay", "99999999999999999999999"],
    ["produce"],
    ["consumers", "reset", "g", "--stream", STREAM, "--to", "99999999999999999999"],
    ["consumers", "reset", "g", "--stream", STREAM, "--to", "-7"],
    ["consumers", "reset", "g", "--stream", STREAM, "--to", "whenever"],
    ["consumers", "show", "bad/name"],
    ["store", "snapshot", "--stream", STREAM, "--as-of", "99999999999999999999"],
    ["store", "snapshot", "--as-of", "5"],
    ["store", "ingest", "--wait-s", "inf"],
    ["up", "--timeout", "0"],
    ["up", "--log-format", "xml"],
    ["run", "--relay", "0", "--log-level", "loud"],
    ["run", "--relay", "99999999999999999999999"],
    ["keygen", "--dir", "/proc/no/such", "--name", "relay-0"],
    ["keygen", "--dir", "keys"],
    ["sim", "--relays", "2"],
    ["explore", "--time-budget", "nan"],
    ["bench", "--duration-s", "nan"],
    ["chaos", "--duration-s", "inf"],
]


@pytest.mark.parametrize("args", BAD_ARGUMENTS, ids=[" ".join(a) for a in BAD_ARGUMENTS])
def test_a_bad_argument_is_a_usage_error_not_a_traceback(down: Path, args: list[str]) -> None:
    result = CliRunner().invoke(main, args, env={"RELAY_CONFIG": str(down)})
    assert isinstance(result.exception, SystemExit), result.exc_info
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in result.output and result.stderr.strip(), result.output


# --- waiting, interrupting --------------------------------------------------------------------


def test_produce_with_the_mesh_down_says_no_relay_answered_and_which(down: Path) -> None:
    code, out, _ = cli(["produce", "--config", str(down), "--stream", STREAM], stdin="x\n")
    [line] = lines(out)
    assert code == 1 and line["outcome"] == "unknown" and line["seq"] is None
    assert "no relay answered" in line["reason"] and "it was not sent" in line["reason"]
    from relay.topology import load

    for spec in load(down).relays.values():
        assert spec.client_endpoint in line["reason"]


@contextlib.contextmanager
def relay_process(args: list[str], stdin: int) -> Iterator[subprocess.Popen[str]]:
    """`python -m relay ARGS` running, its output piped; killed at the end if still there.
    Ctrl-C reaches it as it would from a terminal: a SIGINT that this process ignores (a
    shell ignores it in a background job, e.g. the suite started with `&`) would be
    ignored by the child too, whereas one caught here is reset to the default in the child."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay", *args],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=5)


def test_consume_with_the_mesh_down_says_what_it_waits_for_and_ctrl_c_exits_0(
    down: Path,
) -> None:
    args = ["consume", "--config", str(down), "--stream", STREAM]
    with relay_process(args, subprocess.DEVNULL) as proc:
        assert proc.stderr is not None
        said = proc.stderr.readline()  # blocks until the notice (or the end)
        assert said.startswith("waiting: no relay serving orders.eu answers: tried tcp://"), said
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_ctrl_c_ends_a_command_with_130(mesh: Mesh) -> None:
    args = ["produce", "--config", str(mesh.config_path), "--stream", STREAM]
    with relay_process(args, subprocess.PIPE) as proc:  # it waits on stdin for lines
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("first\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["outcome"] == "committed"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130 and "interrupted" in err and "Aborted!" not in err


# --- logs -------------------------------------------------------------------------------------


def logged(mesh: Mesh) -> list[dict[str, Any]]:
    """Every whole line the relays logged so far, each parsed as JSON."""
    assert mesh.log_dir is not None
    docs = []
    for relay_id in mesh.relay_ids:
        text = (mesh.log_dir / f"relay-{relay_id}.log").read_text()
        for line in text[
            : text.rfind("\n") + 1
        ].splitlines():  # whole lines: one may be half written
            try:
                docs.append(json.loads(line))
            except ValueError:
                pytest.fail(f"relay {relay_id} logged a line that is not JSON: {line!r}")
    return docs


def test_relay_logs_are_json_lines_with_their_fields(mesh: Mesh) -> None:
    def joined() -> list[dict[str, Any]] | None:
        found = [d for d in logged(mesh) if f"stream={STREAM} joined (" in str(d["message"])]
        return found if len(found) >= len(mesh.relay_ids) else None

    # A relay logs it at its next look at its streams, maybe after it answered as ready;
    # one that joins later joins at a committed point past 0 (the point moves with time).
    for doc in wait_until(joined, "every relay to log that it joined"):
        assert {"time", "level", "logger", "message", "state_change"} <= set(doc)
        message = str(doc["message"])
        assert doc["stream"] == STREAM and message.startswith(f"relay={doc['relay']} "), doc
        assert isinstance(doc["committed"], str), doc
        assert message.endswith(f"(committed seq {doc['committed']})"), doc
