#!/usr/bin/env bash
# Idempotent: what the status page's browser test (tests/test_status_page.py) needs,
# Debian's headless Chromium, installed with apt-get when missing (needs root then).
# Prints the browser's version and path; exit 1 if it is still missing afterwards.
set -euo pipefail

say() { printf 'browser-deps: %s\n' "$*" >&2; }
fail() { printf 'browser-deps: ERROR: %s\n' "$*" >&2; exit 1; }

if ! command -v chromium >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || fail "chromium is missing; run this as root to install it"
    command -v apt-get >/dev/null 2>&1 || fail "chromium is missing and apt-get is unavailable"
    say "installing chromium"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq chromium >/dev/null || {
        apt-get update -qq >/dev/null && apt-get install -y -qq chromium >/dev/null
    }
fi

command -v chromium >/dev/null 2>&1 || fail "chromium not found after installing it"
say "$(chromium --version)"
command -v chromium
