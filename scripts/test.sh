#!/usr/bin/env bash
# Install needle-net with its test extras into ./.venv and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NEEDLE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "scikit-build-core>=0.10,<2" "pybind11>=2.12,<4" cmake ninja
echo "== building and installing needle-net (C++ backends compile here)"
"$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[test]"
# The dashboard test drives Debian's headless Chromium; install it where we may (root with apt).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "== installing chromium for the dashboard test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) \
    >/dev/null 2>&1 || echo "   (chromium could not be installed: the dashboard test will skip)"
fi
echo "== running the test suite"
exec "$VENV/bin/python" -m pytest "$@"
