#!/usr/bin/env bash
# The project's test command (CI runs exactly this): set-up, lint, type check, tests.
#
#   bash scripts/test.sh [PYTEST ARGS...]
#
# Slow suites (soak runs, many simulator seeds) are deselected by default. RELAY_SLOW=1
# selects every test (`-m "slow or not slow"`) and raises the simulator seeds to 2000
# (`--sim-seeds 2000`):
#
#   RELAY_SLOW=1 bash scripts/test.sh
#
# The tests run in one worker per core (pytest-xdist), each test file whole in one worker
# (module fixtures start meshes once). Extra arguments go to pytest, after these, so they
# win (e.g. `--sim-seeds 500`, or `-n 0` for one process).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
# As root, the system tools of the namespace and fault tests (iproute2, iptables,
# libfaketime), so that none of them is skipped on a fresh machine.
if [ "$(id -u)" = 0 ]; then
    bash scripts/chaos-deps.sh
fi

echo "== ruff"
.venv/bin/ruff check relay tests scripts
echo "== mypy"
.venv/bin/mypy relay tests scripts
echo "== pytest"
slow=()
if [ "${RELAY_SLOW:-0}" = 1 ]; then
    slow=(-m "slow or not slow" --sim-seeds 2000)
fi
.venv/bin/pytest -q -n auto --dist loadfile "${slow[@]}" "$@"
