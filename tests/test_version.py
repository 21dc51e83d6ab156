"""The version has one home, `relay.__version__`: the installed metadata (built from
pyproject's dynamic version) and `relay --version` must both report it."""

from __future__ import annotations

import importlib.metadata

from click.testing import CliRunner

import relay
from relay.cli import main


def test_installed_metadata_carries_the_package_version() -> None:
    assert importlib.metadata.version("relay") == relay.__version__


def test_cli_prints_the_package_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"relay, version {relay.__version__}\n"
