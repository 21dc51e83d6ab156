"""Options shared by the whole suite.

--sim-seeds N       how many simulator seeds the seeded tests run (default 120;
                    `RELAY_SLOW=1 bash scripts/test.sh` passes 2000)
--sim-first-seed F  the first of those seeds (default 0), to shift the window

Fixture `spark`: the one local Spark session of the test session (`local[2]`), for the
store's jobs; skips where Java is missing.

Hypothesis profiles, chosen by HYPOTHESIS_PROFILE (default `ci`):
  ci   the same examples on every run (derandomized, no example database), so a failure in
       CI fails the same way on a developer's machine; `print_blob` prints the replay line.
  dev  fresh examples on every run, failures kept in the local `.hypothesis` database and
       replayed first next time: for hunting bugs, `HYPOTHESIS_PROFILE=dev pytest ...`.
Neither has a per-example deadline nor fails on slow data generation: the suite must hold on
a loaded machine, where a property test once failed on the default 200 ms deadline.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from s3_server import CREDENTIALS

# The object-store tests' stand-in credentials, before anything starts a Spark session
# (tests/s3_server.py says why).
os.environ.update(CREDENTIALS)

# Checked topologies (relay/topology/cache.py) go to a directory of this test session, for
# the relays and commands the tests start too, not to the user's ~/.cache: the suite writes
# hundreds of throw-away topologies. Removed when the session ends.
_TOPOLOGY_CACHE = tempfile.mkdtemp(prefix="relay-test-topology-cache-")
os.environ["RELAY_CACHE_DIR"] = _TOPOLOGY_CACHE
atexit.register(shutil.rmtree, _TOPOLOGY_CACHE, ignore_errors=True)

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Loaded here, before pytest imports any test module: a test's @settings takes its
# defaults from the profile loaded when the decorator runs.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("relay")
    group.addoption(
        "--sim-seeds",
        type=int,
        default=120,
        metavar="N",
        help="number of simulator seeds for seeded tests (default: 120)",
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


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Java is not installed: the Spark store jobs need a Java 17+ runtime")
    from relay.store.spark import get_session

    session = get_session("local[2]", app_name="relay-store-tests")
    session.conf.set("spark.sql.shuffle.partitions", "2")
    yield session
    session.stop()
