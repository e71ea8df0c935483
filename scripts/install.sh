#!/usr/bin/env bash
# Create ./.venv (or $NEEDLE_VENV) if missing and install needle-net into it with the test
# extras; the C++ (and, where nvcc exists, CUDA) backends compile here. Sourced by demo.sh
# and test.sh, which then use $VENV.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${NEEDLE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "scikit-build-core>=0.10,<2" "pybind11>=2.12,<4" cmake ninja
echo "== building and installing needle-net (C++ backends compile here)"
"$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[test]"
