#!/usr/bin/env bash
# Install needle-net into ./.venv and run the main demo.
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
exec "$VENV/bin/needle-net" demo "$@"
