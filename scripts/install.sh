#!/usr/bin/env bash
# Create ./.venv (or $NEEDLE_VENV) if missing and install needle-net into it with the test
# extras; the C++ (and, where nvcc exists, CUDA) backends compile here. Sourced by demo.sh
# and test.sh, which then use $VENV.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${NEEDLE_VENV:-.venv}
if [ -z "${CXX:-}" ] && ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1 \
   && ! command -v clang++ >/dev/null 2>&1; then
  echo "error: no C++ compiler found (c++, g++ or clang++; or set CXX): the C++ backends" \
       "need one; on Debian/Ubuntu: sudo apt-get install g++" >&2
  exit 1
fi
# A venv without pip (python3 -m venv failed for want of ensurepip, or was interrupted)
# is created again rather than failing later with "No module named pip".
if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  echo "== creating the virtual environment $VENV"
  python3 -m venv "$VENV"
fi
echo "== installing the build tools (pip, scikit-build-core, pybind11, cmake, ninja)"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "scikit-build-core>=0.10,<2" "pybind11>=2.12,<4" cmake ninja
echo "== building and installing needle-net (C++ backends compile here; a few minutes)"
"$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[test]"
