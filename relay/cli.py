"""The `relay` command line.

    relay sim --seeds N [--seed S] [--relays K] [--faults LIST] [--first-seed F]

Heavy modules are imported inside the subcommands, so `relay --help` stays fast and works
even while a subcommand's module is broken.
"""

from __future__ import annotations

import re
import sys

import click

from relay import __version__

RELAYS_MIN = 3
RELAYS_MAX = 7
_FAULT_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="relay")
def main() -> None:
    """relay: a leaderless relay mesh over ZeroMQ."""


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
def sim(
    seeds: int, seed: int | None, relays: int, faults: tuple[str, ...], first_seed: int
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
    sys.exit(run_cli(seeds=seeds, seed=seed, relays=relays, faults=faults, first_seed=first_seed))
