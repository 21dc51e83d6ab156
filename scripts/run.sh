#!/usr/bin/env bash
# The main job. Until the ZeroMQ relay processes land, this runs the deterministic
# simulation of a local 3-relay mesh with producers and consumers over 20 seeds.
# Extra arguments go to `relay sim` (e.g. `--seed 7` to replay one seed verbosely).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
exec .venv/bin/relay sim --seeds 20 --relays 3 "$@"
