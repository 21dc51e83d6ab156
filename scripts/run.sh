#!/usr/bin/env bash
# The main job: start the local 3-relay mesh of config/topology.yaml (real relay processes
# over ZeroMQ), produce a batch of transactions to `orders.eu` through relay 0, read them
# back from relay 1 and check every committed seq came back once and in order; the mesh is
# always stopped. Extra arguments go to scripts/main_job.py (`--count N`, `--config FILE`).
# The deterministic simulator is `.venv/bin/relay sim ...` (see the README).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
exec .venv/bin/python scripts/main_job.py "$@"
