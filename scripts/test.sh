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
echo "== running the test suite"
exec "$VENV/bin/python" -m pytest "$@"
