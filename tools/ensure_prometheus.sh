#!/bin/sh
# Makes sure Debian's Prometheus is installed for the lab and the telemetry tests. Does
# nothing when a `prometheus` binary is on PATH (or at $PROMETHEUS). Otherwise installs the
# package with apt-get, as root or through sudo, without letting it start its system service:
# the lab and the tests run their own Prometheus with their own config and data directory.
# Never fails: where it cannot install, it says so in one line and the lab falls back to
# scraping replicas itself.
set -u

PROMETHEUS=${PROMETHEUS:-prometheus}

if command -v "$PROMETHEUS" >/dev/null 2>&1; then
    exit 0
fi

say() { echo "ensure_prometheus: $*" >&2; }

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    say "prometheus is not installed and installing it needs root (apt-get install prometheus); telemetry will scrape replicas directly"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    say "prometheus is not installed and this system has no apt-get; telemetry will scrape replicas directly"
    exit 0
fi

# policy-rc.d answering 101 tells the package's maintainer scripts not to start the service.
POLICY=/usr/sbin/policy-rc.d
OURS=""
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null && $SUDO chmod 755 "$POLICY" && OURS=1
fi

apt_install() {
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        prometheus >/dev/null 2>&1
}

say "installing Debian's prometheus with apt-get"
if ! apt_install; then
    # Usually a machine whose package lists were never fetched.
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null 2>&1
    apt_install
fi
[ -n "$OURS" ] && $SUDO rm -f "$POLICY"

# Belt and braces: a system service that started anyway holds port 9090 and a data dir.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi

if command -v "$PROMETHEUS" >/dev/null 2>&1; then
    say "installed $("$PROMETHEUS" --version 2>&1 | head -n 1)"
else
    say "could not install prometheus; telemetry will scrape replicas directly"
fi
exit 0
