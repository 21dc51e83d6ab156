#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian machine with python3 (3.11+):
#   - creates .venv if missing, on the interpreter `pick_python` below chooses ($PYTHON if
#     set), upgrades pip, installs the project with `pip install -e '.[dev,store]'`
#     (skipped when pyproject.toml and the version in relay/__init__.py are unchanged since
#     the last successful install, so the installed metadata keeps the version;
#     RELAY_SETUP_FORCE=1 forces it);
#   - creates the CurveZMQ key pairs config/topology.yaml needs that data/keys lacks
#     (`relay keygen --config config/topology.yaml`; never committed: data/ is ignored);
#   - compiles the hot modules with mypyc (relay/native.py; installs gcc and python3-dev with
#     apt-get when missing and running as root; RELAY_NATIVE=0 skips it);
#   - checks for Java 17+ (the store's Spark jobs and their tests need it) and, if missing, installs
#     openjdk-17-jre-headless with apt-get when running as root. Java problems only warn.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
STAMP="$VENV/.relay-setup-stamp"
LOG="$VENV/setup.log"
# The distribution's interpreter, preferred for a new .venv (pick_python says why).
SYSTEM_PYTHON=/usr/bin/python3

say() { printf 'setup: %s\n' "$*"; }
warn() { printf 'setup: WARNING: %s\n' "$*" >&2; }

is_311() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; }
can_venv() { "$1" -c 'import ensurepip, venv' >/dev/null 2>&1; }

# The interpreter of a new .venv: $PYTHON if set; else the distribution's python3 when it is
# 3.11+ (distributions build it with profile-guided and link-time optimisation, Debian's
# into a statically linked executable: relays on Debian's used 6 % less CPU per transaction
# at one in flight and 9-18 % less at windows 16-256 than the same sources on an interpreter
# built without them, pyenv's default; two meshes side by side, 6 alternating rounds); its
# venv module comes from apt's python3-venv when missing. Else python3 on the PATH.
pick_python() {
    if [ -n "${PYTHON:-}" ]; then
        printf '%s\n' "$PYTHON"
        return
    fi
    if [ -x "$SYSTEM_PYTHON" ] && is_311 "$SYSTEM_PYTHON"; then
        if ! can_venv "$SYSTEM_PYTHON" && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            say "installing python3-venv (for a .venv on $SYSTEM_PYTHON)" >&2
            DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null || true
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null || true
        fi
        if can_venv "$SYSTEM_PYTHON"; then
            printf '%s\n' "$SYSTEM_PYTHON"
            return
        fi
    fi
    printf 'python3\n'
}

if [ ! -x "$VENV/bin/python" ]; then
    PYTHON=$(pick_python)
    if ! command -v "$PYTHON" >/dev/null 2>&1; then
        printf 'setup: ERROR: %s not found; install Python 3.11+ first\n' "$PYTHON" >&2
        exit 1
    fi
    if ! is_311 "$PYTHON"; then
        printf 'setup: ERROR: Python 3.11+ required, found %s\n' "$("$PYTHON" --version 2>&1)" >&2
        exit 1
    fi
    say "creating $VENV on $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    "$PYTHON" -m venv "$VENV"
fi

want=$( (cat pyproject.toml; grep '^__version__' relay/__init__.py; echo 'extras=dev,store') \
    | sha256sum | cut -d' ' -f1)
have=$(cat "$STAMP" 2>/dev/null || true)
if [ "${RELAY_SETUP_FORCE:-0}" = 1 ] || [ "$want" != "$have" ] || [ ! -x "$VENV/bin/relay" ]; then
    say "installing relay[dev,store] into $VENV (log: $LOG)"
    if ! { "$VENV/bin/python" -m pip install --disable-pip-version-check --upgrade pip \
        && "$VENV/bin/python" -m pip install --disable-pip-version-check -e '.[dev,store]'; } \
        >"$LOG" 2>&1; then
        tail -n 30 "$LOG" >&2
        printf 'setup: ERROR: pip install failed; full log in %s\n' "$LOG" >&2
        exit 1
    fi
    echo "$want" >"$STAMP"
else
    say "$VENV up to date"
fi

# The hot modules compiled to C (relay/native.py): a C compiler and this Python's headers,
# installed with apt-get when running as root; then the build, which is a no-op when the
# sources have not changed since the last one. Without it everything runs interpreted, only
# slower; RELAY_NATIVE=0 skips it.
has_headers() {
    "$VENV/bin/python" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
}
if [ "${RELAY_NATIVE:-1}" != 0 ]; then
    if ! command -v cc >/dev/null 2>&1 || ! has_headers; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            say "installing gcc and python3-dev (to compile the hot modules)"
            DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null || true
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc python3-dev >/dev/null \
                || warn "could not install gcc and python3-dev"
        fi
    fi
    if "$VENV/bin/python" -c 'import sys, relay.native as n; sys.exit(n.main(["build"]))' \
        >"$VENV/native.log" 2>&1; then
        say "$(tail -n 1 "$VENV/native.log")"
    else
        tail -n 15 "$VENV/native.log" >&2
        warn "could not compile the hot modules (log: $VENV/native.log); they run interpreted"
    fi
fi

# Java 17+ (for the store's Spark jobs, `relay store ...`, and their tests, which skip
# without it): never fails the set-up.
java_major() {
    local v
    v=$(java -version 2>&1 | sed -n 's/.*version "\([^"]*\)".*/\1/p' | head -n 1)
    case "$v" in
        1.*) v=${v#1.} ;;
    esac
    printf '%s\n' "${v%%[.+-]*}"
}
major=""
if command -v java >/dev/null 2>&1; then
    major=$(java_major)
fi
if [ -n "$major" ] && [ "$major" -ge 17 ] 2>/dev/null; then
    say "java $major ok"
elif [ "$(id -u)" != 0 ]; then
    warn "Java 17+ not found (needed by the store's Spark jobs); as root run: apt-get install openjdk-17-jre-headless"
elif ! command -v apt-get >/dev/null 2>&1; then
    warn "Java 17+ not found and apt-get is unavailable; install a Java 17+ runtime by hand"
else
    say "installing openjdk-17-jre-headless"
    if DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null; then
        say "java $(java_major) installed"
    else
        warn "could not install openjdk-17-jre-headless; Spark steps will not work"
    fi
fi

# The default topology runs with CurveZMQ: its relays' and clients' keys (kept if present).
if ! "$VENV/bin/relay" keygen --config config/topology.yaml >/dev/null; then
    printf 'setup: ERROR: could not create the keys of config/topology.yaml\n' >&2
    exit 1
fi
