#!/bin/sh
# Makes sure Debian's iproute2 (`ip`, `tc`) is installed for the tests that put local regions
# in network namespaces (tests/netns.py). Does nothing when `ip` is on PATH. Otherwise, as
# root only (namespaces need root anyway), installs the package with apt-get. Never fails:
# where it cannot install, it says so in one line and those tests skip with the reason.
set -u

if command -v ip >/dev/null 2>&1; then
    exit 0
fi

say() { echo "ensure_iproute2: $*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
    say "ip is not installed and network namespaces need root; the partition tests will skip"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    say "ip is not installed and this system has no apt-get; the partition tests will skip"
    exit 0
fi

apt_install() {
    env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        iproute2 >/dev/null 2>&1
}

say "installing Debian's iproute2 with apt-get"
if ! apt_install; then
    # Usually a machine whose package lists were never fetched.
    env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null 2>&1
    apt_install
fi

if command -v ip >/dev/null 2>&1; then
    say "installed $(ip -V 2>&1 | head -n 1)"
else
    say "could not install iproute2; the partition tests will skip"
fi
exit 0
