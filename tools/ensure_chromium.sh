#!/bin/sh
# Makes sure Debian's Chromium is installed for the browser tests (Playwright drives it at
# /usr/bin/chromium and never downloads a browser of its own). Idempotent: does nothing when
# Chromium is already there; otherwise installs it with apt, as root or through sudo.
set -eu

CHROMIUM=${CHROMIUM:-/usr/bin/chromium}

if [ -x "$CHROMIUM" ]; then
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    echo "ensure_chromium: $CHROMIUM is missing and installing it needs root (apt-get install chromium)" >&2
    exit 1
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: $CHROMIUM is missing and this system has no apt-get; install Chromium and set CHROMIUM=/path/to/chromium" >&2
    exit 1
fi

echo "ensure_chromium: installing Chromium with apt-get" >&2
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
test -x "$CHROMIUM"
