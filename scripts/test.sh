#!/usr/bin/env bash
# Install needle-net with its test extras into ./.venv and run the whole test suite.
set -euo pipefail
source "$(dirname "$0")/install.sh"
# The dashboard test drives Debian's headless Chromium; install it where we may (root with apt).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "== installing chromium for the dashboard test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) \
    >/dev/null 2>&1 || echo "   (chromium could not be installed: the dashboard test will skip)"
fi
# Two pytest processes (CI has two cores, and most tests wait on nodes and sockets rather than
# the CPU: 8.4 minutes against 14.8 in one), each test file whole in one of them (a module's
# fixtures start its chain node once). NEEDLE_TEST_WORKERS=0 runs everything in this process.
WORKERS="${NEEDLE_TEST_WORKERS:-2}"
echo "== running the test suite (pytest -n $WORKERS; NEEDLE_TEST_WORKERS=0: in one process)"
exec "$VENV/bin/python" -m pytest -n "$WORKERS" --dist loadfile "$@"
