"""Options shared by the whole suite.

--sim-seeds N       how many simulator seeds the seeded tests run (default 200;
                    `RELAY_SLOW=1 bash scripts/test.sh` passes 2000)
--sim-first-seed F  the first of those seeds (default 0), to shift the window
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("relay")
    group.addoption(
        "--sim-seeds",
        type=int,
        default=200,
        metavar="N",
        help="number of simulator seeds for seeded tests (default: 200)",
    )
    group.addoption(
        "--sim-first-seed",
        type=int,
        default=0,
        metavar="F",
        help="first simulator seed for seeded tests (default: 0)",
    )


@pytest.fixture(scope="session")
def sim_seeds(pytestconfig: pytest.Config) -> int:
    seeds: int = pytestconfig.getoption("--sim-seeds")
    if seeds < 1:
        raise pytest.UsageError(f"--sim-seeds must be at least 1, got {seeds}")
    return seeds


@pytest.fixture(scope="session")
def sim_first_seed(pytestconfig: pytest.Config) -> int:
    first: int = pytestconfig.getoption("--sim-first-seed")
    if first < 0:
        raise pytest.UsageError(f"--sim-first-seed must be at least 0, got {first}")
    return first
