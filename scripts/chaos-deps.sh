#!/usr/bin/env bash
# Idempotent: the system tools `relay chaos` needs, installed with apt-get when missing.
#   ip (iproute2)      network namespaces, veth pairs, the bridge
#   iptables           partitions: DROP rules inside a relay's namespace
#   faketime           libfaketime, to step a running relay's wall clock
# Needs root (the harness itself does too). Prints what it found or installed; exit 1 if
# something is still missing afterwards.
set -euo pipefail

say() { printf 'chaos-deps: %s\n' "$*"; }

if [ "$(id -u)" != 0 ]; then
    printf 'chaos-deps: ERROR: run as root (network namespaces and iptables need it)\n' >&2
    exit 1
fi

libfaketime() {
    # The preload library's path differs between Debian releases and architectures.
    local path
    for path in /usr/lib/*/faketime/libfaketime.so.1 /usr/lib/faketime/libfaketime.so.1; do
        if [ -e "$path" ]; then
            printf '%s\n' "$path"
            return 0
        fi
    done
    return 1
}

missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
libfaketime >/dev/null || missing+=(faketime)

if [ ${#missing[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        printf 'chaos-deps: ERROR: missing %s and apt-get is unavailable\n' "${missing[*]}" >&2
        exit 1
    fi
    say "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
fi

command -v ip >/dev/null 2>&1 || { echo 'chaos-deps: ERROR: ip not found' >&2; exit 1; }
command -v iptables >/dev/null 2>&1 || { echo 'chaos-deps: ERROR: iptables not found' >&2; exit 1; }
lib=$(libfaketime) || { echo 'chaos-deps: ERROR: libfaketime not found' >&2; exit 1; }
say "ip: $(command -v ip); iptables: $(iptables --version); libfaketime: $lib"
