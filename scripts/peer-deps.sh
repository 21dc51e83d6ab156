#!/usr/bin/env bash
# What `relay bench --peers nats` needs besides the project: nats-server (Debian package,
# installed with apt-get when missing; needs root) and nats-py (PyPI, into .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! command -v nats-server >/dev/null 2>&1; then
    echo "peer-deps: installing nats-server"
    apt-get install -y -q nats-server >/dev/null || {
        apt-get update -q >/dev/null && apt-get install -y -q nats-server >/dev/null
    }
fi
echo "peer-deps: $(nats-server --version)"
.venv/bin/pip install -q nats-py
echo "peer-deps: nats-py $(.venv/bin/pip show nats-py | sed -n 's/^Version: //p')"
