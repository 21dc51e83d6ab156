"""The `relay` command line.

    relay sim --seeds N [--seed S] [--relays K] [--faults LIST] [--first-seed F]
    relay run --config FILE --relay ID [--log-level LEVEL] [--log-format text|json]
    relay up [FILE | --config FILE] [--log-level LEVEL] [--log-format text|json]
             [--log-dir DIR] [--timeout SECONDS]
    relay keygen (--config FILE | --dir DIR --name NAME [--client NAME]) [--force]
    relay status --config FILE [--json] [--timeout SECONDS]
    relay produce --config FILE --stream S [--relay ID] [--key K]
    relay consume --config FILE --stream S [--relay ID] [--from earliest|latest|snapshot|SEQ]
                  [--count N] [--timeout-s T] [--base64]
    relay chaos [--relays 3|5] [--scenario NAME ...|all] [--duration-s S] [--json] (root)

Every command that takes a topology takes `--config FILE`, or $RELAY_CONFIG. Commands that
talk to relays (and the store's) take `--key-file FILE` (or $RELAY_KEY_FILE): the client's
CurveZMQ secret key, when the topology has `security.curve` on (default: the topology's
`security.client_key_file`). Seqs in JSON output are strings (relay/seqtext.py says why),
and a seq given to a command may be one.

Ctrl-C (SIGINT) ends a command with exit code 130 ("interrupted" on stderr), except the
commands that run until stopped (`run`, `up`, `consume`, `store run`): they stop cleanly
and exit 0, also when stopped while starting.

Heavy modules are imported inside the subcommands, so `relay --help` stays fast and works
even while a subcommand's module is broken.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click
from click.core import ParameterSource

from relay import __version__

RELAYS_MIN = 3
RELAYS_MAX = 7
_FAULT_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # relay/logs.py takes these
LOG_FORMATS = ("text", "json")  # and these
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as shells report a command Ctrl-C ended
CONFIG_ENV = "RELAY_CONFIG"

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path
    from typing import Literal

    from relay.client import Consumer, Metadata, Record, Start
    from relay.launcher import Mesh
    from relay.security import ClientCurve
    from relay.store.location import StoreLocation
    from relay.store.reader import StoredSnapshot
    from relay.topology import MeshConfig


def _until_stopped(function: Callable[..., Any]) -> Callable[..., Any]:
    """For a command that runs until stopped: Ctrl-C (KeyboardInterrupt) at any moment,
    also while it starts, ends it with exit code 0, not the group's 130."""
    import functools

    @functools.wraps(function)
    def stopped_cleanly(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except KeyboardInterrupt:
            sys.exit(0)

    return stopped_cleanly


@contextlib.contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """Inside the block SIGTERM stops the command as Ctrl-C does (KeyboardInterrupt), and
    either ends it with exit code 0: a command that runs until stopped, stopped while it
    starts."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    except KeyboardInterrupt:
        sys.exit(0)
    finally:
        signal.signal(signal.SIGTERM, previous)


SECONDS_MAX = 365 * 86_400.0  # the longest time any option takes (a year; beyond is "never")


class _Seconds(click.FloatRange):
    """A time in seconds from `min` to SECONDS_MAX. Not nan nor inf: they pass a
    FloatRange's bounds, then wait forever or overflow a socket's poll."""

    name = "seconds"

    def __init__(self, lowest: float = 0.0) -> None:
        super().__init__(min=lowest, max=SECONDS_MAX)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        import math

        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a number of seconds.", param, ctx)
        return number


class _SeqType(click.ParamType):
    """A seq (0..2**63-1), as digits or as the string JSON output carries it: a usage
    error naming the value otherwise (never a traceback further on)."""

    name = "seq"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from relay.seqtext import parse_seq

        try:
            return parse_seq(value, allow_none=False)
        except ValueError as e:
            self.fail(str(e), param, ctx)


SEQ = _SeqType()


def _check_relays(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if value != 0 and not RELAYS_MIN <= value <= RELAYS_MAX:
        raise click.BadParameter(
            f"{value} is not 0 (each seed chooses) nor in {RELAYS_MIN}..{RELAYS_MAX}."
        )
    return value


def _parse_faults(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    names: list[str] = []
    for raw in value.split(","):
        name = raw.strip().lower()
        if not name:
            raise click.BadParameter(f"empty fault name in {value!r}.")
        if not _FAULT_NAME.match(name):
            raise click.BadParameter(f"{raw.strip()!r} is not a fault name.")
        if name not in names:
            names.append(name)
    if len(names) > 1 and ("all" in names or "none" in names):
        raise click.BadParameter("'all' and 'none' cannot be combined with other faults.")
    return tuple(names)


class _Commands(click.Group):
    """The `relay` group: Ctrl-C in any command ends it with INTERRUPTED_EXIT_CODE and one
    line on stderr (click's default is `Aborted!` and 1). The commands that run until
    stopped catch it themselves and exit 0."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(INTERRUPTED_EXIT_CODE)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="relay")
def main() -> None:
    """relay: a leaderless relay mesh over ZeroMQ.

    Every command that takes a topology takes --config FILE or $RELAY_CONFIG. Seqs in JSON
    output are strings ("seq": "383315973454696481": JSON readers that keep numbers as
    doubles would round them), and a seq given to a command may be one.

    Ctrl-C ends a command with exit code 130, except the commands that run until stopped
    (run, up, consume, store run), which stop cleanly and exit 0.
    """


@main.command()
@click.option(
    "--seeds",
    "seeds",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    metavar="N",
    help="Number of seeds to run: first-seed, first-seed + 1, ...",
)
@click.option(
    "--seed",
    "seed",
    type=click.IntRange(min=0),
    default=None,
    metavar="S",
    help="Run exactly this one seed, verbosely (replays a failure).",
)
@click.option(
    "--relays",
    "relays",
    type=int,
    default=0,
    show_default=True,
    callback=_check_relays,
    metavar="K",
    help=f"Relays in the mesh, {RELAYS_MIN}..{RELAYS_MAX}; 0: each seed chooses.",
)
@click.option(
    "--faults",
    "faults",
    default="all",
    show_default=True,
    callback=_parse_faults,
    metavar="LIST",
    help="Comma-separated fault kinds to inject ('all' or 'none' alone).",
)
@click.option(
    "--first-seed",
    "first_seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="F",
    help="First seed of the --seeds range.",
)
@click.option(
    "--jobs",
    "jobs",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    metavar="J",
    help="Processes running seeds at once; 0: one per CPU.",
)
@click.option(
    "--single",
    "single",
    default=None,
    metavar="LIST",
    help="Single-fault runs instead: one fault that never heals, from this comma list "
    "('all': every kind, one per seed in turn); checks that the connected majority commits.",
)
def sim(
    seeds: int,
    seed: int | None,
    relays: int,
    faults: tuple[str, ...],
    first_seed: int,
    jobs: int,
    single: str | None,
) -> None:
    """Run the deterministic simulator of a local mesh under seeded faults.

    Prints a line per failing seed (replay it with --seed S) and ends with
    `N passed, M failed`; the exit code is non-zero if any seed failed.
    """
    from relay.sim.faults import FaultConfig
    from relay.sim.runner import run_cli

    try:
        FaultConfig.parse(",".join(faults))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--faults") from None
    kinds: tuple[str, ...] = ()
    if single is not None:
        from relay.sim.single import parse_single

        try:
            kinds = parse_single(single)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--single") from None
    sys.exit(
        run_cli(
            seeds=seeds,
            seed=seed,
            relays=relays,
            faults=faults,
            first_seed=first_seed,
            jobs=jobs,
            single=kinds,
        )
    )


# --- relay processes ------------------------------------------------------------------------

_config_option = click.option(
    "--config",
    "config_path",
    required=True,
    envvar=CONFIG_ENV,
    show_envvar=True,
    metavar="FILE",
    help="The topology.",
)
_key_file_option = click.option(
    "--key-file",
    "key_file",
    envvar="RELAY_KEY_FILE",
    default=None,
    metavar="FILE",
    help="This client's CurveZMQ secret key file, when the topology has security.curve on "
    "[env RELAY_KEY_FILE; default: the topology's security.client_key_file].",
)


def _setup_logging(log_level: str, log_format: str) -> None:
    """The one logging set-up (relay/logs.py): lines on stderr, text or JSON."""
    from relay import logs

    logs.setup(log_level.lower(), log_format)


def _log_options(function: Callable[..., Any]) -> Callable[..., Any]:
    """--log-level and --log-format, for every command that logs (and passes them on to
    the processes it starts)."""
    level = click.option(
        "--log-level",
        "log_level",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        default="info",
        show_default=True,
        help="Log level (also of the relays or jobs the command starts).",
    )
    log_format = click.option(
        "--log-format",
        "log_format",
        type=click.Choice(LOG_FORMATS, case_sensitive=False),
        default="text",
        show_default=True,
        envvar="RELAY_LOG_FORMAT",
        show_envvar=True,
        help="Log lines as text, or as JSON objects (time, level, logger, message and "
        "fields such as relay and stream; seqs as strings).",
    )
    return level(log_format(function))


@main.command()
@click.option(
    "--max-states",
    type=click.IntRange(min=1),
    default=20_000,
    show_default=True,
    help="Distinct states to discover before stopping.",
)
@click.option(
    "--transactions",
    type=click.IntRange(0, 3),
    default=3,
    show_default=True,
    help="Produces the clients make (the third retries the first).",
)
@click.option(
    "--max-drops",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Frames the network may lose on one path.",
)
@click.option(
    "--max-dups",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Frames the network may duplicate on one path.",
)
@click.option(
    "--max-ticks",
    type=click.IntRange(min=0),
    default=6,
    show_default=True,
    help="Clock steps per relay on one path.",
)
@click.option(
    "--tick-ms",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Length of one clock step.",
)
@click.option(
    "--max-skew-ticks",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="No relay ticks further ahead of the slowest one.",
)
@click.option(
    "--max-depth",
    type=click.IntRange(min=1),
    default=400,
    show_default=True,
    help="Actions on one path.",
)
@click.option(
    "--max-clock-steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Wall clock steps (+- --clock-step-ms) on one path.",
)
@click.option(
    "--clock-step-ms",
    type=click.IntRange(min=1),
    default=25,
    show_default=True,
    help="Size of one wall clock step.",
)
@click.option(
    "--strategy",
    type=click.Choice(("dfs", "bfs", "random", "walk")),
    default="dfs",
    show_default=True,
    help="Search order (random: shuffled dfs; walk: random walks).",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the random and walk strategies."
)
@click.option(
    "--time-budget",
    "time_budget_s",
    type=_Seconds(0),
    default=None,
    metavar="SECONDS",
    help="Stop after this long.",
)
@click.option(
    "--topologies",
    type=click.Choice(("same", "stale", "change", "refile", "closed")),
    default="same",
    show_default=True,
    help="stale: relay 2's topology file adds it to stream s, which relays 0 and 1 serve "
    "alone (5.15; give it --max-ticks 12). change: s is established on relays 0-2, then "
    "each relay reads, as an explored action, a file that takes relay 2 off it: the change "
    "to relays 0-1 (5.15 changes). refile: relays 0 and 1 serve s alone, then each relay "
    "reads, as an explored action, a file in which all three do (5.15 establishment; give "
    "it --max-ticks 12). closed: s, a pattern's stream, is read through relay 0 "
    "and closed at relays 1 and 2 (5.11 closing) before its first produces (give it "
    "--max-ticks 12).",
)
def explore(
    max_states: int,
    transactions: int,
    max_drops: int,
    max_dups: int,
    max_ticks: int,
    tick_ms: int,
    max_skew_ticks: int,
    max_depth: int,
    max_clock_steps: int,
    clock_step_ms: int,
    strategy: str,
    seed: int,
    time_budget_s: float | None,
    topologies: str,
) -> None:
    """Bounded exhaustive safety check of 3 relays and up to 3 transactions.

    Every interleaving, loss and duplication of the protocol's messages within the
    bounds, checked in every state; prints the statistics and ends with
    `N passed, M failed` (exit 1 on a violation, with its shortened trace).
    """
    from relay.sim.explore import run_explore

    result = run_explore(
        max_states,
        transactions,
        max_drops,
        max_dups=max_dups,
        max_ticks=max_ticks,
        tick_ms=tick_ms,
        max_skew_ticks=max_skew_ticks,
        max_depth=max_depth,
        max_clock_steps=max_clock_steps,
        clock_step_ms=clock_step_ms,
        strategy=strategy,
        seed=seed,
        time_budget_s=time_budget_s,
        progress=lambda line: click.echo(line, err=True),
        topologies=topologies,
    )
    click.echo(result.summary())
    click.echo(f"{int(result.ok)} passed, {int(not result.ok)} failed")
    sys.exit(0 if result.ok else 1)


@main.command()
@click.argument(
    "files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option("--rewrite", is_flag=True, help="Write the regenerated output back.")
def scenario(files: tuple[Path, ...], rewrite: bool) -> None:
    """Run scenario scripts (tests/scenarios/*.txt) against real relay cores.

    Each command's output is regenerated; a script whose output differs is printed with
    its new output (exit 1). With --rewrite the new output is written back instead (review
    the diff: behaviour changed on purpose?). A malformed script exits 2, naming the line.
    """
    from relay.sim.script import ScriptError, run_script

    status = 0
    for path in files:
        text = path.read_text()
        try:
            result = run_script(text)
        except ScriptError as error:
            click.echo(f"error: {path}: {error}", err=True)
            sys.exit(2)
        if rewrite:
            path.write_text(result)
        elif result != text:
            status = 1
            click.echo(f"--- {path}: output differs\n{result}", nl=False)
    sys.exit(status)


def _config_failed(error: Exception, exit_code: int = 2) -> NoReturn:
    """A ConfigError: its message names the file, field and problem; exit code 2 (a usage
    error, as click's own), or `exit_code`."""
    click.echo(f"error: {error}", err=True)
    sys.exit(exit_code)


def _warn_config(warnings: tuple[str, ...]) -> None:
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)


@main.command()
@_config_option
@click.option("--relay", "relay_id", required=True, type=int, metavar="ID", help="Relay id.")
@_log_options
@click.option(
    "--hop-trace",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    metavar="FILE",
    help="Stamp every frame in and out and write the stamps to FILE when the relay stops "
    "(for `relay bench --hops`; costs a little per frame).",
)
def run(
    config_path: str, relay_id: int, log_level: str, log_format: str, hop_trace: str | None
) -> None:
    """Run one relay of the topology in the foreground until SIGINT or SIGTERM.

    Logs to stderr (--log-format json: one JSON object a line). Exit codes: 0 after a stop
    (also one while it starts), 2 for a configuration error, 1 if the relay cannot start
    (e.g. its port is taken, or another process of this machine runs it).
    """
    with _stopped_by_sigterm():  # before or after the node's own handlers are installed
        _run_relay(config_path, relay_id, log_level, log_format, hop_trace)
    sys.exit(0)


def _run_relay(
    config_path: str, relay_id: int, log_level: str, log_format: str, hop_trace: str | None
) -> None:
    """`relay run` until the relay stops (KeyboardInterrupt: SIGINT or SIGTERM)."""
    import asyncio

    import zmq

    from relay.errors import (
        AcceptorMemoryError,
        ConfigError,
        IncarnationError,
        PortUnavailable,
        RelayAlreadyRunning,
    )
    from relay.node import RelayNode
    from relay.topology import load

    try:
        config = load(config_path)
        config.core_config(relay_id)  # a relay id not in the topology is a ConfigError
        node = RelayNode(
            config, relay_id, hop_trace=Path(hop_trace) if hop_trace is not None else None
        )
    except ConfigError as e:
        _config_failed(e)
    except (RelayAlreadyRunning, IncarnationError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    _warn_config(config.warnings)
    _setup_logging(log_level, log_format)
    try:
        asyncio.run(node.run())
    except zmq.ZMQError as e:
        spec = config.relays[relay_id]
        click.echo(
            f"error: relay {relay_id} cannot start on {spec.mesh_bind_endpoint} / "
            f"{spec.client_bind_endpoint}: {e}",
            err=True,
        )
        sys.exit(1)
    except PortUnavailable as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except AcceptorMemoryError as e:
        click.echo(f"error: {e}; the relay stopped", err=True)
        sys.exit(1)


UP_TEND_INTERVAL_S = 0.2  # how often `relay up` looks for relays to start again


@main.command()
@click.argument("file_path", metavar="[FILE]", required=False)
@click.option(
    "--config",
    "config_path",
    default=None,
    envvar=CONFIG_ENV,
    show_envvar=True,
    metavar="FILE",
    help="The topology (or give it as FILE).",
)
@_log_options
@click.option(
    "--log-dir",
    "log_dir",
    default=None,
    metavar="DIR",
    help="Write each relay's log to DIR/relay-<id>.log (default: this terminal).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=_Seconds(0.1),
    default=15.0,
    show_default=True,
    metavar="SECONDS",
    help="How long to wait for every relay to come up.",
)
@_key_file_option
def up(
    file_path: str | None,
    config_path: str | None,
    log_level: str,
    log_format: str,
    log_dir: str | None,
    timeout_s: float,
    key_file: str | None,
) -> None:
    """Start every relay of the topology (FILE, --config or $RELAY_CONFIG) on this host.

    First checks that every port the relays listen on is free here: a port in use is named
    with its relay, and nothing is started. With security.curve on, the key pairs the
    topology needs and keys_dir lacks are created (their public keys are printed).

    Waits until each relay answers a status request with its streams joined, prints the
    relays and their endpoints, then runs until SIGINT (Ctrl-C) or SIGTERM, which stop every
    relay (SIGTERM, then SIGKILL after a grace). A relay that exits meanwhile is started
    again after 1 s, the wait doubling at each exit up to 30 s and back to 1 s once it stayed
    up a minute; each exit and restart is logged (--log-format; the relays get the same).

    Exit codes: 0 after a stop by SIGINT or SIGTERM (also while starting), 1 if a port is
    taken or a relay did not come up, 2 for a usage or configuration error.
    """
    import signal

    if file_path is not None and config_path is not None and file_path != config_path:
        source = click.get_current_context().get_parameter_source("config_path")
        if source is ParameterSource.COMMANDLINE:
            raise click.UsageError(f"two topologies: {file_path} and --config {config_path}")
    path = file_path or config_path
    if path is None:
        raise click.UsageError(f"no topology: give FILE or --config FILE, or set ${CONFIG_ENV}")
    _setup_logging(log_level, log_format)
    stop = threading.Event()

    def interrupt(signum: int, frame: object) -> None:
        # Only a flag: an exception raised here can land where Python ignores it (an
        # at-fork hook while a relay starts), and the stop would be lost.
        stop.set()

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    meshes: list[Mesh] = []
    try:
        code = _run_mesh(path, log_level, log_format, log_dir, timeout_s, key_file, stop, meshes)
    finally:
        if stop.is_set():
            click.echo("stopping the mesh...", err=True)
        for mesh in meshes:
            mesh.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == 0:
        click.echo("mesh stopped", err=True)
    sys.exit(code)


def _run_mesh(
    path: str,
    log_level: str,
    log_format: str,
    log_dir: str | None,
    timeout_s: float,
    key_file: str | None,
    stop: threading.Event,
    started: list[Mesh],
) -> int:
    """`relay up` until `stop` is set (0), or 1 if the mesh did not come up. The mesh is
    put in `started` as soon as it exists, for the caller to stop."""
    from relay.errors import ConfigError
    from relay.launcher import Mesh, MeshError

    try:
        mesh = Mesh(
            path,
            log_level=log_level,
            log_format=log_format,
            log_dir=log_dir,
            die_with_parent=True,
            key_file=key_file,
        )
        mesh.check_ports()  # before anything is made or started
        created = mesh.ensure_keys()
    except ConfigError as e:
        _config_failed(e)
    except MeshError as e:
        click.echo(f"error: {e}", err=True)
        return 1
    started.append(mesh)
    _warn_config(mesh.config.warnings)
    for created_path in created:
        click.echo(
            f"created key pair {created_path} (public key {_public_key_text(created_path)})",
            err=True,
        )
    click.echo(
        f"starting {len(mesh.relay_ids)} relays of {path}; waiting until each serves its "
        f"streams (at most {timeout_s:g} s)",
        err=True,
    )
    if stop.is_set():
        return 0  # stopped before anything started
    try:
        mesh.start(timeout_s, stop)
    except MeshError as e:
        if stop.is_set():
            return 0  # stopped while starting
        click.echo(f"error: {e}", err=True)
        return 1
    _print_mesh(mesh)
    while not stop.wait(UP_TEND_INTERVAL_S):
        mesh.tend()
    return 0


@main.command()
@click.option(
    "--config",
    "config_path",
    default=None,
    envvar=CONFIG_ENV,
    show_envvar=True,
    metavar="FILE",
    help="Create every key pair this topology needs that its keys_dir lacks.",
)
@click.option("--dir", "directory", default=None, metavar="DIR", help="Where to write one pair.")
@click.option("--name", "name", default=None, metavar="NAME", help="relay-<id> or client-<name>.")
@click.option("--client", "client", default="", metavar="NAME", help="Note this client name.")
@click.option("--force", is_flag=True, help="Replace a pair that exists (with --dir).")
def keygen(
    config_path: str | None, directory: str | None, name: str | None, client: str, force: bool
) -> None:
    """Write CurveZMQ key pairs: NAME.key (public) and NAME.key_secret (secret), both with
    0600 permissions, and print the public key(s) to put in a topology (a relay's
    `public_key`, or a client's under `access`) on other hosts.

    With --config: every relay and client of the topology whose public key is neither given
    inline nor present under security.keys_dir (existing pairs are kept). With --dir and
    --name: one pair. Exit codes: 0 done, 2 a usage, configuration or key file error.
    """
    from relay.errors import ConfigError
    from relay.security import KeyRing, generate

    source = click.get_current_context().get_parameter_source("config_path")
    if directory is not None and source is ParameterSource.ENVIRONMENT:
        config_path = None  # --dir asks for one pair: $RELAY_CONFIG is not meant
    if (config_path is None) == (directory is None) or (directory is not None) != (
        name is not None
    ):
        raise click.UsageError("give either --config FILE, or --dir DIR and --name NAME")
    try:
        if config_path is not None:
            config = _load_config(config_path)
            ring = KeyRing(config)
            for path in ring.ensure():
                click.echo(f"created {path}", err=True)
            for rid in config.relays:
                click.echo(f"relay {rid}: {ring.relay_public_key(rid).decode()}")
            for client_name in config.access.clients:
                click.echo(f"client {client_name}: {ring.client_public_key(client_name).decode()}")
        else:
            assert directory is not None and name is not None
            path = generate(Path(directory), name, client=client, overwrite=force)
            click.echo(f"created {path}", err=True)
            click.echo(_public_key_text(path))
    except ConfigError as e:
        _config_failed(e)
    except OSError as e:  # a folder that cannot be made or written
        click.echo(f"error: cannot write the key pair: {e}", err=True)
        sys.exit(2)


def _public_key_text(path: Path) -> str:
    from relay.security import load_public_key

    return load_public_key(path).decode()


def _client_curve(
    config: MeshConfig, key_file: str | None, exit_code: int = 2
) -> ClientCurve | None:
    """The CurveZMQ settings of this command as a client (None: curve is off); a key
    problem ends the command (`exit_code`) with the file and the problem named."""
    if not config.security.curve:
        return None  # without importing relay.security (`relay status` starts faster)
    from relay.errors import ConfigError
    from relay.security import client_curve

    try:
        return client_curve(config, key_file)
    except ConfigError as e:
        _config_failed(e, exit_code)


def _require_admin(config: MeshConfig, key_file: str | None, what: str) -> None:
    """With CurveZMQ, the store's commands need the admin right, like status requests
    (exit 1, NotAuthorized, otherwise)."""
    from relay.access import Right

    curve = _client_curve(config, key_file)
    if curve is not None and not config.access.allows(curve.name, Right.ADMIN):
        click.echo(
            f"error: NotAuthorized: client {curve.name!r} has no admin right ({what} needs "
            f"it; see the access section of {config.path})",
            err=True,
        )
        sys.exit(1)


def _print_mesh(mesh: Mesh) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"relay mesh: {mesh.config_path}")
    for name in ("relay", "pid", "mesh endpoint", "client endpoint", "streams"):
        table.add_column(name, no_wrap=name != "streams")
    pids = mesh.pids
    for relay_id, ends in mesh.endpoints.items():
        table.add_row(
            str(relay_id),
            str(pids.get(relay_id, "-")),
            ends.mesh,
            ends.client,
            ", ".join(ends.streams),
        )
    console = Console()
    console.print(table)
    console.print(f"mesh up: {len(pids)} relays ready; Ctrl-C or SIGTERM stops them")
    sys.stdout.flush()


# --- status -----------------------------------------------------------------------------------

STATUS_USAGE_EXIT_CODE = 3  # `relay status` only: 0-2 say the mesh's health


class _StatusCommand(click.Command):
    """`relay status`: a usage error exits STATUS_USAGE_EXIT_CODE, not click's 2, which
    says "down" here (as a monitoring check says "unknown")."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as e:
            e.exit_code = STATUS_USAGE_EXIT_CODE  # type: ignore[misc]  # this one error
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            e.exit_code = STATUS_USAGE_EXIT_CODE  # type: ignore[misc]  # this one error
            raise


@main.command(cls=_StatusCommand)
@_config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (seqs as strings).")
@click.option(
    "--timeout",
    "timeout_s",
    type=_Seconds(0.01),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="How long to wait for the relays' answers.",
)
@_key_file_option
def status(config_path: str, as_json: bool, timeout_s: float, key_file: str | None) -> None:
    """Ask every relay of the topology for its status; print the mesh's health, each
    problem in words, and per relay its streams and counters (plain lines: nothing is cut
    at any width or in a pipe), or with --json one document.

    \b
    Exit codes, for scripts:
      0  healthy: every relay answers; every stream joined, not fenced, not stalled
      1  degraded: the mesh answers, but a relay does not (or refuses: this client
         lacks the admin right), or a stream is not joined, is fenced or stalled, or a
         spool is full
      2  down: no relay answers
      3  a usage or configuration error

    Counters of things that went wrong since a relay started (invalid frames, refused
    handshakes, ...) are listed as notes and leave the health alone; routine events (a
    client that left before its answer) are not counted as problems.
    """
    from relay.errors import ConfigError
    from relay.launcher import query_status
    from relay.tools.status import EXIT_CODES, mesh_status, status_lines, store_status
    from relay.topology import load

    try:
        config = load(config_path)
    except ConfigError as e:
        _config_failed(e, STATUS_USAGE_EXIT_CODE)
    endpoints = {r: spec.client_endpoint for r, spec in config.relays.items()}
    curve = _client_curve(config, key_file, exit_code=STATUS_USAGE_EXIT_CODE)
    replies = query_status(endpoints, timeout_s, curve)
    doc = mesh_status(config_path, replies, store_status(config.store_location, replies))
    if as_json:
        import json

        click.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        _warn_config(config.warnings)
        colours = {"good": "green", "warn": "yellow", "bad": "red"}
        text = status_lines(doc, lambda words, level: click.style(words, fg=colours[level]))
        click.echo("\n".join(text))  # one write: `relay status | head -3` ends cleanly
    sys.exit(EXIT_CODES[doc["health"]])


RECONFIGURE_EXIT_CODES = {"done": 0, "not done": 1, "unreachable": 2, "usage": 3}


@main.command()
@_config_option
@click.option(
    "--apply",
    "apply_change",
    is_flag=True,
    help="Have every relay read its topology file again (it must hold FILE's text) and "
    "wait for the streams' relays to change; without it, only the plan is printed.",
)
@click.option(
    "--wait",
    "wait_s",
    type=_Seconds(1.0),
    default=60.0,
    show_default=True,
    metavar="SECONDS",
    help="With --apply: how long to wait for the mesh to make the change.",
)
@_key_file_option
def reconfigure(config_path: str, apply_change: bool, wait_s: float, key_file: str | None) -> None:
    """Check a new topology file against the running mesh, say what it changes (which
    relays each stream runs on now, which the file names, the steps the relays will
    take), and with --apply drive the change (docs/deploy.md section 9): copy FILE to
    every relay's host first, at the path its `relay run --config` names; each relay
    reads it again (as on SIGHUP) and says whether it took it, and the command waits until
    every stream runs on its new relays, printing each step, and until every relay the
    file removes from the mesh is let go by the others (stop it then).

    \b
    Exit codes:
      0  the plan printed (nothing to do, or nothing applied), or the change made
      1  with --apply: a relay refused the file or read another one, or the change was
         not made within --wait
      2  no relay answers
      3  a usage or configuration error
    """
    import time

    from relay.errors import ConfigError
    from relay.launcher import query_status
    from relay.tools.reconfigure import (
        ask_reload,
        follow,
        follow_leaving,
        leaving_relays,
        limit_changes,
        plan,
    )
    from relay.topology import load, read_text, text_digest

    try:
        new = load(config_path)
        digest = text_digest(read_text(Path(config_path)))
    except ConfigError as e:
        _config_failed(e, RECONFIGURE_EXIT_CODES["usage"])
    _warn_config(new.warnings)
    curve = _client_curve(new, key_file, exit_code=RECONFIGURE_EXIT_CODES["usage"])
    endpoints = {r: spec.client_endpoint for r, spec in new.relays.items()}
    replies = query_status(endpoints, 2.0, curve)
    answering = [r for r, reply in replies.items() if reply.reachable]
    click.echo(
        f"relay reconfigure: {config_path} against the running mesh "
        f"({len(answering)} of {len(replies)} relays answer)"
    )
    for relay, reply in replies.items():
        if not reply.reachable:
            click.echo(f"  relay {relay}: {reply.error}")
    if not answering:
        sys.exit(RECONFIGURE_EXIT_CODES["unreachable"])
    changes = plan(new, replies)
    leaving = leaving_relays(new, replies)
    for change in changes:
        click.echo(f"  {change.words()}")
    if not changes:
        click.echo("  no stream's relays change")
    for line in limit_changes(new, replies):
        click.echo(f"  {line}")
    if leaving:
        click.echo(
            f"  relays {list(leaving)} leave the mesh: each relay lets them go once no "
            "stream there counts them (take them off every stream first)"
        )
    if not apply_change:
        click.echo("nothing applied (--apply has every relay read its file again)")
        sys.exit(RECONFIGURE_EXIT_CODES["done"])
    began = time.monotonic()
    failed = False
    for answer in ask_reload(new, digest, curve):
        if not answer.taken:
            failed = True
            click.echo(f"  relay {answer.relay}: refused: {answer.words}")
        elif not answer.same_file:
            failed = True
            click.echo(
                f"  relay {answer.relay}: read another file than {config_path} (copy it to "
                f"that host first): {answer.words}"
            )
        else:
            click.echo(f"  relay {answer.relay}: took the file: {answer.words}")
    if changes:
        click.echo(f"waiting for the relays to make the change (at most {wait_s:g} s):")
    left = follow(new, changes, curve, began + wait_s, click.echo, began)
    for change in left:
        click.echo(f"  NOT done: {change.stream} is not on {list(change.target)} yet")
    counted = follow_leaving(new, leaving, curve, began + wait_s, click.echo, began)
    for relay, by in counted.items():
        click.echo(f"  NOT done: relay {relay} is still counted by relays {by}: do not stop it")
    refused = [c for c in changes if c.refusal]
    if failed or left or refused or counted:
        sys.exit(RECONFIGURE_EXIT_CODES["not done"])
    click.echo(
        f"done in {time.monotonic() - began:.1f} s: every stream runs on the relays the file names"
    )
    sys.exit(RECONFIGURE_EXIT_CODES["done"])


# --- produce and consume ------------------------------------------------------------------

READ_CHUNK_BYTES = 64 * 1024  # stdin is read in chunks of at most this many bytes
READ_QUEUE_CHUNKS = 8  # chunks read ahead of the producer (bounds memory)
UNREACHABLE_PROBE_S = 0.5  # after an idle consume: how long to ask the relays if they are up
DEFAULT_COMMIT_INTERVAL_S = 1.0  # a durable `relay consume` commits its position this often
SNAPSHOT_PRINT_ROWS = 10_000  # snapshot rows turned into Python objects at once


def relays_first(config: MeshConfig, relay_id: int | None, stream: str) -> dict[int, str]:
    """relay id -> client endpoint in the order a client should try them: `relay_id` first
    (if given), then the relays serving `stream`, then the others. Given to a Producer or
    Consumer as `relays=`, it makes that relay the first one asked while redirects (relay
    ids) can still be followed."""
    if relay_id is not None and relay_id not in config.relays:
        known = ", ".join(str(r) for r in config.relays)
        raise click.BadParameter(
            f"relay {relay_id} is not in {config.path} ({known})", param_hint="--relay"
        )
    try:
        members = list(config.members(stream))
    except ValueError:
        members = []
    order = [relay_id] if relay_id is not None else []
    order += [r for r in members if r not in order]
    order += [r for r in config.relays if r not in order]
    return {r: config.relays[r].client_endpoint for r in order}


def _load_config(config_path: str) -> MeshConfig:
    from relay.errors import ConfigError
    from relay.topology import load

    try:
        config = load(config_path)
    except ConfigError as e:
        _config_failed(e)
    _warn_config(config.warnings)
    return config


def _client_endpoints(
    config: MeshConfig, relay_id: int | None, stream: str
) -> dict[int, str] | None:
    """None: let the client use the topology (its limits, stream members first)."""
    return None if relay_id is None else relays_first(config, relay_id, stream)


def _check_stream_name(stream: str) -> str:
    from relay.engines import check_stream  # the client's own rule for stream names

    try:
        return check_stream(stream)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--stream") from None


def _served_streams(config: MeshConfig) -> str:
    names = dict.fromkeys(config.streams)
    for spec in config.relays.values():
        names.update(dict.fromkeys(spec.streams))
    return ", ".join(names) or "none"


def _emit(line: str) -> None:
    """One output line, flushed (a reader of the pipe sees it at once)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _emit_json(doc: dict[str, Any]) -> None:
    """One JSON line, its seqs as strings (relay/seqtext.py)."""
    import json

    from relay.seqtext import seqs_as_text

    _emit(json.dumps(seqs_as_text(doc)))


def _outcome(stream: str, result: int | BaseException) -> dict[str, Any]:
    from relay.errors import ClientError, Fenced, Unknown

    if isinstance(result, int):  # the seq as a string, as in all JSON output
        return {"stream": stream, "seq": str(result), "outcome": "committed"}
    if not isinstance(result, ClientError):
        raise result
    if isinstance(result, Fenced):
        outcome = "fenced"
    elif isinstance(result, Unknown):
        outcome = "unknown"
    else:  # Rejected, UnknownStream
        outcome = "rejected"
    return {"stream": stream, "seq": None, "outcome": outcome, "reason": str(result)}


async def _produce_stdin(
    stdin: Any,
    config: MeshConfig,
    relays: dict[int, str] | None,
    stream: str,
    key: bytes | None,
    curve: ClientCurve | None,
) -> tuple[int, int]:
    """Produce every line of `stdin` (pipelined, up to the producer's window in flight);
    print each outcome in input order. Returns (transactions, not committed)."""
    import asyncio
    import json
    import threading

    from relay.client import AsyncProducer

    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[list[bytes] | None] = asyncio.Queue(READ_QUEUE_CHUNKS)
    read = getattr(stdin, "read1", None) or stdin.read

    def put(item: list[bytes] | None) -> None:
        asyncio.run_coroutine_threadsafe(chunks.put(item), loop).result()

    def reader() -> None:  # a daemon thread: a blocked read never keeps the process alive
        rest = b""
        try:
            while True:
                data = read(READ_CHUNK_BYTES)
                if not data:
                    break
                lines = (rest + data).split(b"\n")
                rest = lines.pop()
                if lines:
                    put(lines)
            if rest:
                put([rest])
        finally:
            put(None)

    outcomes: asyncio.Queue[asyncio.Future[int] | None] = asyncio.Queue()
    counts = [0, 0]

    async def printer() -> None:
        while (future := await outcomes.get()) is not None:
            try:
                result: int | BaseException = await future
            except Exception as e:
                result = e
            doc = _outcome(stream, result)
            counts[0] += 1
            counts[1] += doc["outcome"] != "committed"
            _emit(json.dumps(doc))

    producer = (
        AsyncProducer(topology=config, curve=curve)
        if relays is None
        else AsyncProducer(relays=relays, curve=curve)
    )
    async with producer:
        printing = asyncio.create_task(printer())
        threading.Thread(target=reader, name="relay-produce-stdin", daemon=True).start()
        try:
            while (lines := await chunks.get()) is not None:
                for value in lines:
                    await outcomes.put(await producer.send_async(stream, value, key))
        finally:
            await outcomes.put(None)
            await printing
    return counts[0], counts[1]


@main.command()
@_config_option
@click.option("--stream", "stream", required=True, metavar="S", help="The stream to write.")
@click.option(
    "--relay",
    "relay_id",
    type=int,
    default=None,
    metavar="ID",
    help="Send to this relay first (redirects and retries still go elsewhere).",
)
@click.option("--key", "key", default=None, metavar="K", help="The key of every transaction.")
@_key_file_option
def produce(
    config_path: str, stream: str, relay_id: int | None, key: str | None, key_file: str | None
) -> None:
    """Produce one transaction per line of stdin to stream S.

    The value is the line's bytes without the newline. Up to the producer's window of
    transactions are in flight at once; one JSON line per transaction is printed, in input
    order: {"stream", "seq", "outcome": "committed"}, or outcome rejected / unknown / fenced
    with "reason" (an unknown one may still commit; producing it again with a new producer
    may duplicate it). Exit codes: 0 if every transaction committed, 1 if any did not, 2 for
    a usage or configuration error.
    """
    from relay import loop

    config = _load_config(config_path)
    _check_stream_name(stream)
    relays = _client_endpoints(config, relay_id, stream)
    curve = _client_curve(config, key_file)
    stdin = sys.stdin.buffer
    key_bytes = None if key is None else key.encode("utf-8", "surrogateescape")
    try:
        total, failed = loop.run(_produce_stdin(stdin, config, relays, stream, key_bytes, curve))
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(1)
    if failed:
        click.echo(f"error: {failed} of {total} transactions were not committed", err=True)
        sys.exit(1)
    sys.exit(0)


def _parse_start(ctx: click.Context, param: click.Parameter, value: str) -> Start:
    from relay.seqtext import parse_seq

    text = value.strip().lower()
    named: dict[str, Start] = {"earliest": "earliest", "latest": "latest", "snapshot": "snapshot"}
    if text in named:
        return named[text]
    try:
        return parse_seq(text)
    except ValueError as e:
        raise click.BadParameter(f"{e}; give earliest, latest, snapshot or a seq") from None


_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_DURATION_UNIT_S = {"s": 1, "m": 60, "h": 3_600, "d": 86_400}


def _parse_since(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    """A moment: a duration back from now (90s, 10m, 2h, 1d) or an ISO 8601 timestamp
    (UTC unless it names its zone)."""
    if value is None:
        return None
    text = value.strip()
    found = _DURATION.fullmatch(text)
    if found:
        back_s = float(found.group(1)) * _DURATION_UNIT_S[found.group(2)]
        try:
            return datetime.now(UTC) - timedelta(seconds=back_s)
        except (OverflowError, ValueError):  # before year 1: no seq is that old anyway
            return datetime.min.replace(tzinfo=UTC)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is neither a duration (90s, 10m, 2h, 1d) nor an ISO 8601 timestamp "
            "(2026-11-23T10:00Z)"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _text(data: bytes | None, as_base64: bool) -> str | None:
    import base64

    if data is None:
        return None
    if as_base64:
        return base64.b64encode(data).decode("ascii")
    return data.decode("utf-8", errors="replace")


def _record_doc(record: Record, as_base64: bool) -> dict[str, Any]:
    from relay.store.changes import KIND_PLAIN
    from relay.store.errors import InvalidChanges

    doc: dict[str, Any] = {
        "stream": record.stream,
        "seq": str(record.seq),  # as a string, as in all JSON output
        "key": _text(record.key, as_base64),
        "value": _text(record.value, as_base64),
    }
    if record.kind != KIND_PLAIN:
        doc["kind"] = record.kind
        try:
            doc["changes"] = [
                {
                    "entity": change.entity,
                    "key": _text(change.key, as_base64),
                    "op": change.op.name.lower(),
                    "value": _text(change.value, as_base64),
                }
                for change in record.changes()
            ]
        except InvalidChanges as error:
            doc["error"] = str(error)
    return doc


def _snapshot_lines(stream: str, snapshot: StoredSnapshot, as_base64: bool) -> Iterator[str]:
    """One JSON line per (entity, key) of a stored snapshot, batch by batch."""
    import json

    for batch in snapshot.rows.to_batches(max_chunksize=SNAPSHOT_PRINT_ROWS):
        for entity, key, value, seq in zip(
            *(batch.column(name).to_pylist() for name in ("entity", "key", "value", "seq")),
            strict=True,
        ):
            yield json.dumps(
                {
                    "stream": stream,
                    "snapshot": str(snapshot.seq),  # seqs as strings, as in all JSON output
                    "entity": entity,
                    "key": _text(key, as_base64),
                    "value": _text(value, as_base64),
                    "seq": str(seq),
                }
            )


@main.command()
@_config_option
@click.option(
    "--stream",
    "stream",
    required=True,
    metavar="S",
    help="The stream to read, or a pattern (quoted: 'orders.*') for every stream it names.",
)
@click.option(
    "--relay",
    "relay_id",
    type=int,
    default=None,
    metavar="ID",
    help="Read from this relay first (fail-over still goes elsewhere).",
)
@click.option(
    "--from",
    "start",
    default="earliest",
    show_default=True,
    callback=_parse_start,
    metavar="earliest|latest|snapshot|SEQ",
    help=(
        "The first transaction of the stream (from the store, then the relays), what commits "
        "from now on, the latest snapshot and the transactions after it, or the records "
        "after SEQ."
    ),
)
@click.option(
    "--since",
    "since",
    default=None,
    callback=_parse_since,
    metavar="DURATION|TIME",
    help=(
        "Instead of --from: the records committed since then, a duration back from now "
        "(90s, 10m, 2h, 1d) or an ISO 8601 time (2026-11-23T10:00Z; UTC unless it names "
        "its zone), as the relays' clocks stamped them."
    ),
)
@click.option(
    "--count",
    "count",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="Stop after N records (default: no limit).",
)
@click.option(
    "--timeout-s",
    "timeout_s",
    type=_Seconds(0),
    default=None,
    metavar="T",
    help="Stop after T seconds without a record (default: wait forever).",
)
@click.option(
    "--base64", "as_base64", is_flag=True, help="Print keys and values as base64, not UTF-8."
)
@click.option(
    "--no-store",
    "no_store",
    is_flag=True,
    help="Read the relays only, not the store under the topology's data_dir.",
)
@click.option(
    "--durable",
    "durable",
    default=None,
    metavar="NAME",
    help=(
        "A durable consumer: resume after NAME's committed mark on S (--from only when it "
        "has none) and commit the position as it goes and when it stops."
    ),
)
@click.option(
    "--commit-interval-s",
    "commit_interval_s",
    type=_Seconds(0),
    default=DEFAULT_COMMIT_INTERVAL_S,
    show_default=True,
    metavar="T",
    help="With --durable: commit the position at most every T seconds.",
)
@click.option(
    "--lease-wait-s",
    "lease_wait_s",
    type=_Seconds(0),
    default=0.0,
    show_default=True,
    metavar="T",
    help="With --durable, when another instance of NAME reads S: wait up to T seconds for "
    "it to stop (or for its lease to run out), then fail naming it.",
)
@_key_file_option
@_until_stopped
def consume(
    config_path: str,
    stream: str,
    relay_id: int | None,
    start: Start,
    since: datetime | None,
    count: int | None,
    timeout_s: float | None,
    as_base64: bool,
    no_store: bool,
    durable: str | None,
    commit_interval_s: float,
    lease_wait_s: float,
    key_file: str | None,
) -> None:
    """Read stream S and print one JSON line per transaction: {"stream", "seq", "key",
    "value"} (bytes decoded as UTF-8 with replacement characters, or base64 with --base64;
    a missing key is null; a change list adds "kind" and "changes").

    S may be a pattern ('orders.*'; fnmatch `*`, `?`, `[...]`): every stream it names is
    read, each in its own order, those that appear while it runs included (from their
    first record); "stream" says whose each line is. --from SEQ and --since apply to every
    stream; --from snapshot is for one stream only.

    History older than the relays' buffers comes from the store (the topology's
    data_dir/store, built by `relay store ingest`), then the relays carry on with no gap.
    With --from snapshot, the latest snapshot's rows come first, one JSON line per key:
    {"stream", "snapshot": its seq, "entity", "key", "value", "seq": the last write}.

    With --durable NAME the mesh remembers the position (docs/metadata.md): the next run
    with the same NAME prints what follows the last record this one printed (at least
    once: a record printed just before a crash may come again).

    Stops after --count records or --timeout-s seconds without one (Ctrl-C also stops it).
    Exit codes: 0 when it stops so, 1 if the stream is unknown, the position is no longer
    held (the message names the oldest one), no relay is reachable or a mark could not be
    committed (another instance of NAME committed meanwhile), 2 for a usage or
    configuration error.
    """
    import json

    from relay.client import Consumer, ingested_store
    from relay.errors import ClientError, OutOfRange, UnknownStream
    from relay.topology import is_pattern

    context = click.get_current_context()
    if since is not None and context.get_parameter_source("start") is not ParameterSource.DEFAULT:
        raise click.UsageError("give --from or --since, not both")
    config = _load_config(config_path)
    _check_stream_name(stream)
    if durable is not None:
        _check_durable(durable)
    relays = _client_endpoints(config, relay_id, stream)
    store: StoreLocation | Literal[False] = False if no_store else (ingested_store(config) or False)
    if start == "snapshot" and is_pattern(stream):
        raise click.BadParameter(
            f"{stream!r} is a pattern; --from snapshot reads one stream's snapshot",
            param_hint="--from",
        )
    if start == "snapshot" and not store:
        click.echo(
            f"error: --from snapshot needs a store; {config.store_location} has none", err=True
        )
        sys.exit(2)
    curve = _client_curve(config, key_file)
    notice = _WaitNotice(config, relays_first(config, relay_id, stream), stream, curve)
    options: dict[str, Any] = {"timeout_s": timeout_s, "count": count, "store": store}
    if durable is not None:
        options.update(
            durable=durable, auto_commit_interval_s=commit_interval_s, lease_wait_s=lease_wait_s
        )
    consumer = (
        Consumer(topology=config, curve=curve, **options)
        if relays is None
        else Consumer(relays=relays, curve=curve, **options)
    )
    seen = 0
    code = 0
    printed_all = True  # every record yielded was printed: the position may be committed
    started: set[str] = set()  # the streams a record was printed of
    if timeout_s is None:  # else a consume without records says so when it ends
        notice.start()
    try:
        consumer.subscribe(stream, start if since is None else since)
        if consumer.snapshot is not None:
            for line in _snapshot_lines(stream, consumer.snapshot, as_base64):
                _emit(line)
        for record in consumer:
            notice.received = True
            if record.stream not in started:
                started.add(record.stream)
                _warn_history_gone(record.stream, consumer)
            printed_all = False
            _emit(json.dumps(_record_doc(record, as_base64)))
            printed_all = True
            seen += 1
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # e.g. `relay consume ... | head -3`
        sys.stderr.close()
    except OutOfRange as e:
        click.echo(f"error: {e}", err=True)
        if consumer.oldest_available is not None:
            click.echo(f"hint: read from there with --from {consumer.oldest_available}", err=True)
        code = 1
    except UnknownStream as e:
        click.echo(f"error: unknown stream: {e}", err=True)
        click.echo(f"the streams of {config_path}: {_served_streams(config)}", err=True)
        code = 1
    except ClientError as e:
        click.echo(f"error: {e}", err=True)
        code = 1
    else:
        if seen == 0 and timeout_s is not None and not notice.any_answers():
            click.echo(f"error: {notice.none_answer()}", err=True)
            code = 1
    finally:
        notice.stop()
        code = _close_consumer(consumer, commit=printed_all) or code
    sys.exit(code)


WAIT_NOTICE_S = 3.0  # a consume that got no record for this long asks if any relay answers


class _WaitNotice:
    """Says on stderr, once, what a `relay consume` that got no record waits for when no
    relay answers (it would otherwise wait in silence): WAIT_NOTICE_S after `start`, the
    relays are asked for their status (UNREACHABLE_PROBE_S); a record received first, or a
    relay answering, says nothing."""

    def __init__(
        self, config: MeshConfig, relays: dict[int, str], stream: str, curve: ClientCurve | None
    ) -> None:
        import threading

        self.config = config
        self.relays = relays  # the order the consumer tries them: members of `stream` first
        self.stream = stream
        self.curve = curve
        self.received = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay-consume-notice", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def any_answers(self) -> bool:
        from relay.launcher import query_status

        # A status request is what every relay answers; to a client without the admin
        # right it answers NotAuthorized, which says as well that it runs (issue 48, 9b:
        # such a consume of an empty stream ended claiming no relay answered).
        replies = query_status(self.relays, UNREACHABLE_PROBE_S, self.curve)
        return any(reply.answered for reply in replies.values())

    def none_answer(self) -> str:
        where = ", ".join(f"{endpoint} (relay {r})" for r, endpoint in self.relays.items())
        return (
            f"no relay serving {self.stream} answers: tried {where}; is the mesh up "
            f"(relay up --config {self.config.path})?"
        )

    def _run(self) -> None:
        if self._stopped.wait(WAIT_NOTICE_S) or self.received or self.any_answers():
            return
        if not (self.received or self._stopped.is_set()):
            click.echo(f"waiting: {self.none_answer()}", err=True)


def _warn_history_gone(stream: str, consumer: Consumer) -> None:
    gone = consumer.history_gone_before
    if gone is not None:
        click.echo(
            f"warning: the history of {stream!r} up to seq {gone} is gone (no relay holds "
            "it and no store has it); reading from there",
            err=True,
        )


def _close_consumer(consumer: Consumer, commit: bool) -> int:
    """Close (a durable consumer commits what was printed); 1 if the commit failed."""
    from relay.errors import ClientError

    try:
        consumer.close(commit=commit)
    except ClientError as e:
        consumer.close(commit=False)
        click.echo(f"error: the position of {consumer.durable!r} was not committed: {e}", err=True)
        return 1
    return 0


def _check_durable(name: str) -> str:
    from relay.meta import check_durable_name

    try:
        return check_durable_name(name)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--durable") from None


# --- durable consumers' marks ------------------------------------------------------------


@main.group()
def consumers() -> None:
    """The marks of durable consumers (`relay consume --durable NAME`), kept by the mesh
    (docs/metadata.md). Output: one JSON line per mark, {"durable", "stream", "seq": the
    position (the next run reads the records after it), "version"}."""


def _metadata(config_path: str, key_file: str | None) -> tuple[MeshConfig, Metadata]:
    from relay.client import Metadata

    config = _load_config(config_path)
    return config, Metadata(topology=config, curve=_client_curve(config, key_file))


def _marks(meta: Metadata, durable: str | None) -> list[dict[str, Any]]:
    """The marks under `durable`'s prefix (every durable consumer's for None). A key there
    that is not a mark's (consumers/<name>/<stream>), or a value that is not a mark, is
    listed with "key" and "problem" naming which and why, its seq and holder null: any
    client that may write such keys could put one there, and it must not hide the
    others (issue 48, 9a: it made the whole listing fail)."""
    from relay.meta import MARKS_PREFIX, InvalidMetaOp, decode_mark, split_mark_key

    prefix = MARKS_PREFIX if durable is None else f"{MARKS_PREFIX}{durable}/"
    found = []
    for item in meta.list(prefix):
        named = split_mark_key(item.key)
        name, stream = named if named is not None else (None, None)
        entry: dict[str, Any] = {
            "durable": name,
            "stream": stream,
            "seq": None,
            "holder": None,
            "version": item.version,
        }
        if named is None:
            entry["key"] = item.key
            entry["problem"] = f"not a mark's key: marks are {MARKS_PREFIX}<durable name>/<stream>"
        else:
            try:
                mark = decode_mark(item.value)
            except InvalidMetaOp as e:
                entry["key"], entry["problem"] = item.key, str(e)
            else:
                entry["seq"], entry["holder"] = mark.seq, mark.holder or None
        found.append(entry)
    return found


def _say_problems(marks: list[dict[str, Any]]) -> None:
    """A line on stderr per key `_marks` found that is not a mark (its JSON line says so
    too): for whoever reads the output by eye."""
    for mark in marks:
        if "problem" in mark:
            click.echo(f"warning: {mark['key']!r} is skipped: {mark['problem']}", err=True)


def _committed_points(config: MeshConfig, key_file: str | None) -> dict[str, int]:
    """Per stream, the highest committed point any relay reports (one status round)."""
    from relay.launcher import query_status

    endpoints = {r: spec.client_endpoint for r, spec in config.relays.items()}
    replies = query_status(endpoints, UNREACHABLE_PROBE_S, _client_curve(config, key_file))
    points: dict[str, int] = {}
    for reply in replies.values():
        for stream, state in ((reply.status or {}).get("streams") or {}).items():
            points[stream] = max(points.get(stream, -1), int(state.get("committed", -1)))
    return points


def _run_meta(action: Callable[[], int]) -> NoReturn:
    """Run a metadata command: its exit code, or 1 with the error (BadVersion: another
    writer got there first; MetadataUnavailable: no relay could answer)."""
    from relay.errors import ClientError

    try:
        code = action()
    except ClientError as e:
        click.echo(f"error: {e}", err=True)
        code = 1
    sys.exit(code)


@consumers.command("list")
@_config_option
@_key_file_option
def consumers_list(config_path: str, key_file: str | None) -> None:
    """Every durable consumer's mark on every stream; a key under consumers/ that holds
    no mark is listed with "key" and "problem" (and named on stderr). Exit codes: 0, 1
    no relay could answer, 2 a usage or configuration error."""

    def action() -> int:
        _, meta = _metadata(config_path, key_file)
        with meta:
            marks = _marks(meta, None)
        for mark in marks:
            _emit_json(mark)
        _say_problems(marks)
        return 0

    _run_meta(action)


@consumers.command("show")
@_config_option
@click.argument("durable")
@_key_file_option
def consumers_show(config_path: str, durable: str, key_file: str | None) -> None:
    """DURABLE's marks, one per stream, with how far each stream's relays have committed
    ("committed") and how far behind the mark is ("behind_ms": the milliseconds between the
    two seqs' times). Exit codes: 0, 1 no such durable consumer or no relay could answer,
    2 a usage or configuration error."""

    from relay.core.seq import ms_of

    _check_durable(durable)

    def action() -> int:
        config, meta = _metadata(config_path, key_file)
        with meta:
            marks = _marks(meta, durable)
        if not marks:
            click.echo(f"error: no durable consumer {durable!r} has a mark", err=True)
            return 1
        points = _committed_points(config, key_file)
        for mark in marks:
            committed = points.get(mark["stream"], -1)
            mark["committed"] = committed
            if committed > 0 and mark["seq"] is not None and mark["seq"] > 0:
                mark["behind_ms"] = max(0, ms_of(committed) - ms_of(mark["seq"]))
            _emit_json(mark)
        _say_problems(marks)
        return 0

    _run_meta(action)


_force_option = click.option(
    "--force",
    "force",
    is_flag=True,
    help="Also when an instance holds the lease (it then stops with LeaseLost at its next "
    "renewal); without it, a held mark is refused naming the holder.",
)


def _refuse_held(durable: str, mark: dict[str, Any], force: bool) -> bool:
    """Whether a mark is held by a running (or dead, not yet replaced) instance and may
    not be changed without --force; says so."""
    if mark["holder"] is None or force:
        return False
    click.echo(
        f"error: {durable!r} on {mark['stream']!r} is held by {mark['holder']}: stop it first "
        "(a dead holder's lease is taken over by the next instance), or use --force",
        err=True,
    )
    return True


@consumers.command("delete")
@_config_option
@click.argument("durable")
@click.option("--stream", "stream", default=None, metavar="S", help="Only the mark on S.")
@_force_option
@_key_file_option
def consumers_delete(
    config_path: str, durable: str, stream: str | None, force: bool, key_file: str | None
) -> None:
    """Forget DURABLE's marks (its next run starts at --from again). Each mark is deleted
    at the version just read: if the consumer commits meanwhile, that delete fails.
    Exit codes: 0, 1 nothing to delete, a held mark, or a failure, 2 a usage error."""
    from relay.meta import mark_key

    _check_durable(durable)

    def action() -> int:
        _, meta = _metadata(config_path, key_file)
        with meta:
            marks = [
                m
                for m in _marks(meta, durable)
                if m["stream"] is not None and stream in (None, m["stream"])
            ]
            if not marks:
                click.echo(f"error: {durable!r} has no mark to delete", err=True)
                return 1
            if any(_refuse_held(durable, mark, force) for mark in marks):
                return 1
            for mark in marks:
                meta.delete(mark_key(durable, mark["stream"]), mark["version"])
                click.echo(f"deleted {durable!r}'s mark on {mark['stream']!r}", err=True)
        return 0

    _run_meta(action)


def _parse_reset_to(ctx: click.Context, param: click.Parameter, value: str) -> str | int:
    from relay.engines import position_at
    from relay.seqtext import parse_seq

    text = value.strip().lower()
    if text in ("earliest", "latest"):
        return text
    if text.strip('"').lstrip("-").isdigit():  # a seq, maybe JSON-quoted
        try:
            return parse_seq(text)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    try:
        moment = _parse_since(ctx, param, value)
        assert moment is not None
        return position_at(moment)
    except (click.BadParameter, ValueError):
        raise click.BadParameter(
            f"{value!r} is not earliest, latest, a seq, a duration (10m) or a time "
            "(2026-11-23T10:00Z)"
        ) from None


@consumers.command("reset")
@_config_option
@click.argument("durable")
@click.option("--stream", "stream", required=True, metavar="S", help="The stream.")
@click.option(
    "--to",
    "to",
    required=True,
    callback=_parse_reset_to,
    metavar="SEQ|earliest|latest|TIME",
    help="The new position: the next run reads the records after SEQ, from the oldest "
    "held (earliest), what commits after now (latest), or what committed since TIME (a "
    "duration back from now, 10m, or an ISO 8601 time).",
)
@_force_option
@_key_file_option
def consumers_reset(
    config_path: str, durable: str, stream: str, to: str | int, force: bool, key_file: str | None
) -> None:
    """Move DURABLE's mark on S (at the version just read: fails if the consumer commits
    meanwhile). Exit codes: 0, 1 a held mark or a failure, 2 a usage error."""

    from relay.meta import ABSENT, Mark, encode_mark, mark_key

    _check_durable(durable)
    _check_stream_name(stream)

    def action() -> int:
        config, meta = _metadata(config_path, key_file)
        with meta:
            if to == "latest":
                position = _committed_points(config, key_file).get(stream, -1)
                if position < 0:
                    click.echo(f"error: no relay told stream {stream!r}'s position", err=True)
                    return 1
            else:
                position = -1 if to == "earliest" else int(to)
            held = [m for m in _marks(meta, durable) if m["stream"] == stream]
            if held and _refuse_held(durable, held[0], force):
                return 1
            version = meta.write(
                mark_key(durable, stream),
                encode_mark(Mark(position)),
                held[0]["version"] if held else ABSENT,
            )
        _emit_json({"durable": durable, "stream": stream, "seq": position, "version": version})
        return 0

    _run_meta(action)


# --- bench ------------------------------------------------------------------------------------


def _parse_bench_sizes(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    from relay.tools.bench import parse_sizes

    try:
        return parse_sizes(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@main.command()
@click.option(
    "--duration-s",
    "duration_s",
    type=_Seconds(0.05),
    default=None,
    metavar="S",
    help="Length of every measured run [default: 5, or 0.25 with --quick].",
)
@click.option(
    "--sizes",
    "sizes",
    default="100,1024",
    show_default=True,
    callback=_parse_bench_sizes,
    metavar="LIST",
    help="Comma-separated value sizes in bytes (e.g. 100,1k).",
)
@click.option("--quick", is_flag=True, help="Short runs (a smoke test, not a measurement).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option(
    "--profile",
    is_flag=True,
    help="Run relay 0 under cProfile and profile the producer; print where time goes.",
)
@click.option(
    "--security",
    is_flag=True,
    help="Measure the cost of CurveZMQ: every run on a plain and a CurveZMQ mesh, side by side.",
)
@click.option(
    "--metrics",
    is_flag=True,
    help="Measure the cost of the relays' HTTP endpoints: every run on a mesh without them "
    "and on one with them, its /metrics scraped every second, side by side.",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="With --security, --metrics or --peers: make every pair of runs N times, each side "
    "first in every other round, and report the median ratio [default: 1].",
)
@click.option(
    "--peers",
    type=click.Choice(["nats"]),
    default=None,
    help="Side by side with a 3-server NATS JetStream cluster (R3 memory stream, nats-py): "
    "windows 16..4096, one in flight, delivery to another server's consumer at 1,000 tx/s "
    "and 80% of the best, CPU per tx (every run), idle CPU (bash scripts/peer-deps.sh "
    "installs it).",
)
@click.option(
    "--hops",
    is_flag=True,
    help="Trace one transaction in flight through every relay (first size only) and print "
    "the time of each hop: client -> coordinator -> members -> reports -> commit -> "
    "client, and -> consumer.",
)
@click.option(
    "--memory",
    is_flag=True,
    help="Produce at --rate to two streams for --duration-s [default: 600] with a relay-wide "
    "buffer bound of --buffer-mib, and compare each relay's RSS with what its bounds count.",
)
@click.option(
    "--rate",
    "rate_tx_s",
    type=click.IntRange(min=1),
    default=None,
    metavar="TX_S",
    help="The fixed rate of --memory [default: 5000].",
)
@click.option(
    "--buffer-mib",
    type=click.IntRange(min=1),
    default=None,
    metavar="MIB",
    help="The relay-wide buffer bound of --memory (relay_buffer_max_bytes) [default: 384].",
)
def bench(
    duration_s: float | None,
    sizes: tuple[int, ...],
    quick: bool,
    as_json: bool,
    profile: bool,
    security: bool,
    metrics: bool,
    rounds: int | None,
    peers: str | None,
    hops: bool,
    memory: bool,
    rate_tx_s: int | None,
    buffer_mib: int | None,
) -> None:
    """Benchmark a local 3-relay mesh side by side with raw ZeroMQ PUB/SUB.

    Starts the mesh on free 127.0.0.1 ports (always stopped), measures committed tx/s of
    a pipelined producer (windows 128 and 1000), produce-to-commit and produce-to-delivery
    latency p50/p99 at one in flight and at 1,000 tx/s, and the same figures for a PUB
    with two SUBs; prints a table (or --json with relay/baseline ratios and the targets).
    Exit codes: 0 when every run produced figures, 1 otherwise.
    """
    from relay.tools.bench import run_cli

    if sum((security, metrics, profile, peers is not None, hops, memory)) > 1:
        raise click.UsageError(
            "--profile, --security, --metrics, --peers, --hops and --memory measure different "
            "things; pick one"
        )
    if not memory and (rate_tx_s is not None or buffer_mib is not None):
        raise click.UsageError("--rate and --buffer-mib go with --memory")
    if rounds is not None and not (security or metrics or peers is not None):
        raise click.UsageError("--rounds goes with --security, --metrics or --peers")
    sys.exit(
        run_cli(
            duration_s=duration_s,
            sizes=sizes,
            quick=quick,
            as_json=as_json,
            profile=profile,
            security=security,
            metrics=metrics,
            rounds=rounds or 1,
            peers=peers,
            hops=hops,
            memory=memory,
            memory_rate_tx_s=rate_tx_s,
            buffer_mib=buffer_mib,
        )
    )


@main.command()
@click.option(
    "--relays",
    "relays",
    type=click.Choice(["3", "4", "5"]),
    default="3",
    show_default=True,
    help="Relays of the run (add-relay and replace-relay start the last one during it).",
)
@click.option(
    "--scenario",
    "scenarios",
    multiple=True,
    metavar="NAME",
    help="kill, pause, partition, partial-partition, kill-cut, clock, clock-restart, mix, roll, "
    "stale, replace, limits, add-relay, replace-relay, or all (repeat or comma-separate; "
    "default all).",
)
@click.option(
    "--duration-s",
    "duration_s",
    type=_Seconds(5),
    default=90.0,
    show_default=True,
    metavar="S",
    help="Length of each scenario's fault phase.",
)
@click.option("--producers", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--consumers", type=click.IntRange(min=0), default=2, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option(
    "--json-file",
    "json_file",
    default=None,
    metavar="FILE",
    help="Also write the JSON document to FILE (the table still goes to stdout).",
)
@click.option("--keep-logs", is_flag=True, help="Keep every scenario's relay logs.")
@click.option(
    "--curve",
    is_flag=True,
    help="CurveZMQ on every socket of the run (keys made for it), clients authenticated.",
)
@click.option(
    "--relay-log-level",
    "relay_log_level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="warning",
    show_default=True,
    help="Log level of the relays (their logs are kept for failed scenarios).",
)
@click.option(
    "--from-build",
    "from_build",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="upgrade: a checkout of another build (DIR/relay is its package) the mesh starts on.",
)
def chaos(
    relays: str,
    scenarios: tuple[str, ...],
    duration_s: float,
    producers: int,
    consumers: int,
    seed: int,
    as_json: bool,
    json_file: str | None,
    keep_logs: bool,
    curve: bool,
    relay_log_level: str,
    from_build: Path | None,
) -> None:
    """Run real relays under real faults, then check the history they kept (as root).

    Each relay runs in its own network namespace; faults are kill -9, SIGSTOP, iptables
    partitions and libfaketime clock steps (bash scripts/chaos-deps.sh installs the tools).
    Prints per scenario: attempts, committed, unknown, fenced, lost, dup, phantom,
    divergent, stuck, the longest gap without a commit, the time to recover after a heal
    and to rejoin. Exit codes: 0; 1 if a scenario lost, duplicated, invented, diverged,
    got stuck or committed nothing; 3 if the harness could not run.
    """
    from relay.tools.chaos import parse_scenarios, run_cli

    try:
        chosen = parse_scenarios(scenarios)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--scenario") from None
    sys.exit(
        run_cli(
            relays=int(relays),
            scenarios=chosen,
            duration_s=duration_s,
            producers=producers,
            consumers=consumers,
            seed=seed,
            as_json=as_json,
            json_file=json_file,
            keep_logs=keep_logs,
            relay_log_level=relay_log_level.lower(),
            curve=curve,
            from_build=from_build,
        )
    )


@main.group()
def store() -> None:
    """The persistent store built by Spark from the relays' spools (see docs/store.md)."""


_master_option = click.option(
    "--master",
    default=None,
    metavar="URL",
    help="Spark master [default: the topology's store.spark.master, else local[*]; "
    "ignored under spark-submit].",
)


_wait_option = click.option(
    "--wait-s",
    "wait_s",
    type=_Seconds(0),
    default=0.0,
    show_default=True,
    metavar="SECONDS",
    help="Wait this long for another job writing the store (else exit 1 naming it).",
)


@store.command("ingest")
@_config_option
@_master_option
@_wait_option
@_log_options
@_key_file_option
def store_ingest(
    config_path: str,
    master: str | None,
    wait_s: float,
    log_level: str,
    log_format: str,
    key_file: str | None,
) -> None:
    """Append every relay's closed spool segments to the store.

    Checks that all relays agree on the digest at every seq and that each stream's chain
    continues the store's last point. Exit codes: 0 done (also when nothing was new), 2 a
    divergence or a broken chain (named; nothing from it on is written), 1 another error.
    """
    from relay import storecmd

    config = _load_config(config_path)
    _require_admin(config, key_file, "relay store ingest")
    _setup_logging(log_level, log_format)
    sys.exit(storecmd.ingest(config, master, wait_s))


@store.command("snapshot")
@_config_option
@click.option("--stream", "stream", default=None, metavar="S", help="Only this stream.")
@click.option(
    "--as-of",
    "as_of",
    default=None,
    type=SEQ,
    metavar="SEQ",
    help="Snapshot as of this seq (with --stream).",
)
@_master_option
@_wait_option
@_log_options
@_key_file_option
def store_snapshot(
    config_path: str,
    stream: str | None,
    as_of: int | None,
    master: str | None,
    wait_s: float,
    log_level: str,
    log_format: str,
    key_file: str | None,
) -> None:
    """Build each stream's snapshot (last value per entity and key) from the previous one
    plus newer records. Exit codes: 0 done, 1 an error, 2 a usage error."""
    from relay import storecmd

    if as_of is not None and stream is None:
        raise click.BadParameter("needs --stream", param_hint="--as-of")
    if stream is not None:
        _check_stream_name(stream)
    config = _load_config(config_path)
    _require_admin(config, key_file, "relay store snapshot")
    _setup_logging(log_level, log_format)
    sys.exit(storecmd.snapshot(config, master, stream, as_of, wait_s))


@store.command("run")
@_config_option
@click.option(
    "--engine",
    type=click.Choice(["spark", "baseline"]),
    default="spark",
    show_default=True,
    help="Spark, or the pyarrow baseline in this one process (no JVM).",
)
@_master_option
@click.option("--once", is_flag=True, help="Run every job once, then exit.")
@_log_options
@_key_file_option
def store_run(
    config_path: str,
    engine: str,
    master: str | None,
    once: bool,
    log_level: str,
    log_format: str,
    key_file: str | None,
) -> None:
    """Keep the store up to date: ingest, snapshot (and retire old records), compact and
    vacuum on the schedule of the topology's `store:` section, until Ctrl-C or SIGTERM.

    Each job holds the store's writer lock; one log line per job that changed something
    (--log-format json: JSON lines); figures in <store>/_runner.json and `relay status`.
    Exit codes: 0 stopped (also while starting; or, with --once, every job done), 1 a job
    of --once failed or an error, 2 a usage or configuration error.
    """
    from relay import storecmd

    config = _load_config(config_path)
    _require_admin(config, key_file, "relay store run")
    _setup_logging(log_level, log_format)

    with _stopped_by_sigterm():  # while the engine starts; storecmd.run handles its own
        if engine == "spark":
            from relay.storerun import SparkEngine

            session = storecmd.session_for(config, master, "relay-store-run")
            runner_engine: Any = SparkEngine(session)
        else:
            from relay.tools.store_baseline import BaselineEngine

            runner_engine = BaselineEngine()
    sys.exit(storecmd.run(config, runner_engine, once=once))


@store.command("verify")
@_config_option
@_master_option
@_log_options
@_key_file_option
def store_verify(
    config_path: str, master: str | None, log_level: str, log_format: str, key_file: str | None
) -> None:
    """Re-check every stream's chain in the store end to end. Exit codes: 0 intact, 2 a
    broken chain (named), 1 another error."""
    from relay import storecmd

    config = _load_config(config_path)
    _require_admin(config, key_file, "relay store verify")
    _setup_logging(log_level, log_format)
    sys.exit(storecmd.verify(config, master))
