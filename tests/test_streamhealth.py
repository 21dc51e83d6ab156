"""The one rule of what is wrong with a stream (relay/streamhealth.py), as `relay status`
(relay/tools/status.py) and `/readyz` (relay/opsserver.py) state it, from status
documents made by real cores: scripted meshes of RelayCores (relay/sim/script.py, the
scenario scripts' interpreter) brought into each state, here for the configurations of
docs/protocol.md 5.15. How long a write waits is read from a core cut off after taking
one; past the readiness bounds, how long a stream has diverged or waited is a figure of
such a document set past its bound: a core reaches those states only after faults the
script cannot hold without fencing the stream first."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest

from relay.core import fencing
from relay.launcher import StatusReply
from relay.opsserver import degraded, readiness
from relay.sim.script import Interpreter
from relay.streamhealth import (
    DIVERGED_REPORT_MS,
    STALL_WORDS,
    WAITING_REPORT_MS,
    Problem,
    never_written,
    relay_problems,
    stream_problem,
    stream_problems,
)
from relay.tools.status import DEGRADED, HEALTHY, mesh_status, status_lines

STREAM = "s"
CHANGES = "docs/deploy.md section 9"

# Five relays; s is served by 0-2, t by 3 and 4. Relays 2 and 3 restart onto a topology
# that serves s on all five (tests/scenarios/reconfigure_roll.txt goes on from here).
ROLL = (
    "topology 0:s 1:s 2:s 3:t 4:t",
    "stabilize",
    "produce 0 s p0 1 a",
    "tick 20",
    "crash 2",
    "restart 2 topology 0:s 1:s 2:s 3:s,t 4:s,t",
    "tick 30",
    "crash 3",
    "restart 3 topology 0:s 1:s 2:s 3:s,t 4:s,t",
    "tick 40",
)
# Relays 3 and 4, cut off from 0-2, restart onto a topology that serves s on 3 and 4
# alone: they establish a second configuration of s, and its history; then the network
# heals and each side hears the other's.
FORK = (
    "topology 0:s 1:s 2:s 3:t 4:t",
    "stabilize",
    "produce 0 s p0 1 a",
    "tick 20",
    *(f"cut {a}<->{b}" for a in (3, 4) for b in (0, 1, 2)),
    "crash 3",
    "restart 3 topology 0:t 1:t 2:t 3:s,t 4:s,t",
    "crash 4",
    "restart 4 topology 0:t 1:t 2:t 3:s,t 4:s,t",
    "stabilize",
    "produce 3 s p3 1 b",
    "tick 50",
    "heal",
    "stabilize",
)
# Every relay of s restarts at once: none has its history, and no spool or store does.
ALL_RESTART = (
    "topology 0:s 1:s 2:s",
    "stabilize",
    "produce 0 s p0 1 a",
    "tick 20",
    *(f"crash {r}" for r in range(3)),
    *(f"restart {r}" for r in range(3)),
    "stabilize",
)
HEALTHY_MESH = ("topology 0:s 1:s 2:s", "stabilize", "produce 0 s p0 1 a", "tick 20")


def statuses(script: tuple[str, ...]) -> dict[int, dict[str, Any]]:
    """Every running relay's status document once the script ran."""
    interpreter = Interpreter()
    for line in script:
        out = interpreter.execute(line)
        assert not [o for o in out if o.startswith("!!")], out  # no invariant broken
    mesh = interpreter.m
    return {r: mesh.running(r).status() for r in mesh.ids if mesh.nodes[r].core is not None}


@pytest.fixture(scope="module")
def roll() -> dict[int, dict[str, Any]]:
    return statuses(ROLL)


def health(relay: int, status: dict[str, Any]) -> dict[str, Any]:
    """`relay status`'s document of a mesh of this one relay."""
    return mesh_status("topology.yaml", {relay: StatusReply(relay, "tcp://r", status)})


def test_every_reason_the_core_fences_or_stalls_for_has_words() -> None:
    reasons = {
        value
        for name, value in inspect.getmembers(fencing)
        if name.isupper() and isinstance(value, str)
    }
    assert {"quorum", "config_mismatch"} <= reasons, reasons  # (the constants were found)
    assert reasons <= set(STALL_WORDS), reasons - set(STALL_WORDS)


def test_a_topology_that_names_other_relays_leaves_the_relay_ready_but_degraded(
    roll: dict[int, dict[str, Any]],
) -> None:
    status = roll[2]
    config = status["streams"][STREAM]["config"]
    assert config["relays"] == [0, 1, 2] and config["topology"] == [0, 1, 2, 3, 4], config
    # Relays 0 and 1 still read the old file: they hold the change, by name.
    assert config["change_held_by"] == {"0": [0, 1, 2], "1": [0, 1, 2]}, config
    words = (
        "runs on relays 0, 1, 2 (configuration 1); the topology file names relays 0, 1, 2, "
        "3, 4: the change waits until the file of every live relay of the stream names the "
        "same relays: relay 0's file names relays 0, 1, 2; relay 1's file names relays 0, "
        f"1, 2 ({CHANGES})"
    )
    assert Problem(words, unready=False) in stream_problems(status["streams"][STREAM])
    assert readiness(status) == {}
    assert words in degraded(status)[STREAM]
    doc = health(2, status)
    assert doc["health"] == DEGRADED
    assert {"relay": 2, "stream": STREAM, "problem": words} in doc["problems"]
    text = "\n".join(status_lines(doc))
    assert (
        f"stream {STREAM}: joined, committed seq {status['streams'][STREAM]['committed']}" in text
    )
    assert (
        "; runs on relays 0, 1, 2 (configuration 1), the topology file names relays 0, 1, 2, 3, 4"
        in text
    )


def test_a_stream_whose_configuration_leaves_the_relay_out_is_named_not_unready(
    roll: dict[int, dict[str, Any]],
) -> None:
    status = roll[3]
    assert STREAM not in status["streams"] and STREAM in status["not_member"], status
    words = (
        "not served here: it runs on relays 0, 1, 2 (configuration 1), which leaves this "
        "relay out; its reads are redirected and its produces forwarded to those relays; the "
        "topology file names relays 0, 1, 2, 3, 4: the relays of the stream add the others "
        f"once their files name them too ({CHANGES})"
    )
    assert [p for s, p in relay_problems(status) if s == STREAM] == [Problem(words, unready=False)]
    assert STREAM not in readiness(status) and degraded(status)[STREAM] == words
    doc = health(3, status)
    assert doc["health"] == DEGRADED
    assert {"relay": 3, "stream": STREAM, "problem": words} in doc["problems"]
    assert (
        f"  stream {STREAM}: not a member; runs on relays 0, 1, 2 (configuration 1), the "
        "topology file names relays 0, 1, 2, 3, 4"
    ) in status_lines(doc)


def test_a_disagreement_that_does_not_hold_the_stream_is_named_with_who_states_what(
    roll: dict[int, dict[str, Any]],
) -> None:
    """Relay 3 asked the relays its new topology names for s; relays 0-2 note the
    provisional configuration it stated, and serve on under the established one."""
    status = roll[0]
    info = status["streams"][STREAM]
    assert info["config"]["disagree"] == {"3": {"version": 0, "relays": [0, 1, 2, 3, 4]}}, info
    assert not info["fenced"], info
    words = (
        "relays disagree about its configuration: this relay runs it on relays 0, 1, 2 "
        "(configuration 1); relay 3 states relays 0, 1, 2, 3, 4 (configuration 0, "
        "provisional): it serves on under its own (what they say under theirs is not taken)"
    )
    assert stream_problems(info) == [Problem(words, unready=False)]
    assert readiness(status) == {} and degraded(status) == {STREAM: words}
    doc = health(0, status)
    assert doc["health"] == DEGRADED
    assert (
        "disagreement: relay 3 states relays 0, 1, 2, 3, 4 (configuration 0, provisional)"
        in "\n".join(status_lines(doc))
    )


def test_two_established_configurations_fence_the_stream_on_both_sides() -> None:
    found = statuses(FORK)
    for relay, ours, theirs, peers in (
        (0, "0, 1, 2", "3, 4", "3, 4"),
        (3, "3, 4", "0, 1, 2", "0, 1, 2"),
    ):
        status = found[relay]
        info = status["streams"][STREAM]
        assert info["fence_reason"] == "config_mismatch", info
        problems = stream_problems(info)
        fence, disagreement = problems[0], problems[-1]
        assert fence.unready and fence.words.startswith(
            f"fenced: {STALL_WORDS['config_mismatch']} [config_mismatch] (waiting for relays "
            f"{peers}; for "
        ), fence
        assert disagreement == Problem(
            f"relays disagree about its configuration: this relay runs it on relays {ours} "
            f"(configuration 1); relays {peers} state relays {theirs} (configuration 1): this "
            "holds the stream until they agree",
            unready=False,
        ), problems
        assert readiness(status)[STREAM] == fence.words
        assert degraded(status)[STREAM] == disagreement.words


def test_a_lost_history_fails_readiness() -> None:
    status = statuses(ALL_RESTART)[1]
    info = status["streams"][STREAM]
    assert info["history_lost"] and info["joined"] and not info["fenced"], info
    words = (
        "history lost: every relay of the stream came back without its history and no spool "
        "or store held it, so it began again at the genesis; records committed before are "
        "gone, and reads from positions among them are answered out_of_range"
    )
    assert stream_problems(info) == [Problem(words, unready=True)]
    assert readiness(status) == {STREAM: words} and degraded(status) == {}
    doc = health(1, status)
    assert doc["health"] == DEGRADED
    assert f"stream {STREAM}: joined, history lost, committed seq" in "\n".join(status_lines(doc))


def test_the_core_counts_how_long_a_write_waits_to_commit() -> None:
    """Relay 0 stops hearing the others after taking a produce: its status says how long
    the write has waited (the figure the readiness bound is set against), a fence once it
    fences says why instead, and the figure is 0 again once the write committed."""
    interpreter = Interpreter()
    for line in (*HEALTHY_MESH, "cut 1->0", "cut 2->0", "produce 0 s p0 2 b", "tick 50"):
        interpreter.execute(line)
    mesh = interpreter.m

    def stream() -> dict[str, Any]:
        streams: dict[str, dict[str, Any]] = mesh.running(0).status()["streams"]  # type: ignore[assignment]
        return streams[STREAM]

    first = stream()["waiting_ms"]
    assert 0 < first <= 50 and not stream()["fenced"], stream()
    interpreter.execute(f"tick {2 * WAITING_REPORT_MS}")
    cut = stream()
    assert cut["waiting_ms"] >= first + 2 * WAITING_REPORT_MS and cut["fenced"], cut
    assert [p.words.split(":")[0] for p in stream_problems(cut)] == ["fenced"]
    for line in ("heal", "stabilize"):
        interpreter.execute(line)
    info = stream()
    assert info["committed"] > cut["committed"], (cut, info)  # it took the write's commit
    assert info["waiting_ms"] == 0 and stream_problems(info) == [], info


def test_diverging_or_waiting_past_its_bound_fails_readiness() -> None:
    status = statuses(HEALTHY_MESH)[0]
    assert relay_problems(status) == [] and health(0, status)["health"] == HEALTHY
    info = status["streams"][STREAM]

    def problems_with(**figures: int) -> list[Problem]:
        changed = copy.deepcopy(info)
        changed.update(figures)
        return stream_problems(changed)

    # At their bounds, not yet.
    assert problems_with(diverged_ms=DIVERGED_REPORT_MS, waiting_ms=WAITING_REPORT_MS) == []
    assert problems_with(diverged_ms=3_250) == [
        Problem(
            "diverged for 3.2 s: its history disagrees with a commit the stream's relays "
            "announced, and repairing it from them has not made it agree",
            unready=True,
        )
    ]
    assert problems_with(waiting_ms=2_500) == [
        Problem(
            "nothing has committed for 2.5 s while entries or produces wait to commit here",
            unready=True,
        )
    ]
    # A fenced stream says why it does not commit: its wait adds nothing.
    fenced = copy.deepcopy(info)
    fenced.update(fenced=True, fence_reason="quorum", waiting_ms=9_000)
    assert [p.words for p in stream_problems(fenced)] == [
        f"fenced: {STALL_WORDS['quorum']} [quorum]"
    ]
    assert stream_problem(fenced) == f"fenced: {STALL_WORDS['quorum']} [quorum]"


def test_a_stream_a_read_opened_and_nobody_wrote_is_no_problem_until_written() -> None:
    """A read of a new name of a pattern opens the stream on its relays, but only a
    produce establishes its first view: until then it is fenced (not_admitted) on each,
    which is not in use, so it neither fails readiness nor degrades the relay. Written,
    it is an ordinary stream."""
    opened = ("topology 0:t.* 1:t.* 2:t.*", "stabilize", "read 0 t.new -1", "stabilize")
    status = statuses(opened)[0]
    info = status["streams"]["t.new"]
    assert info["joined"] and info["fenced"] and info["fence_reason"] == fencing.NOT_ADMITTED
    assert never_written(info) and stream_problems(info) == [], info
    assert readiness(status) == {} and degraded(status) == {}
    assert health(0, status)["health"] == HEALTHY
    # The first produce is answered fenced and establishes the view; the retry commits.
    write = (*opened, *("produce 1 t.new p1 1 a", "stabilize") * 2)
    written = statuses(write)[0]["streams"]["t.new"]
    assert written["view"] > 0 and written["held"] == 1 and not written["fenced"], written
    assert not never_written(written) and stream_problems(written) == [], written
    # Cut off from its peers once written, the relay fails readiness for it as for any.
    cut = (*write, "cut 1->0", "cut 2->0", "tick 2000")
    assert readiness(statuses(cut)[0]).get("t.new", "").startswith("fenced"), statuses(cut)[0]
