#!/usr/bin/env bash
# Install needle-net into ./.venv and run the main demo: a local devnet, a verified remote
# matmul and a short training run with offloaded matmuls (-h/--help lists the options).
set -euo pipefail
usage() {
  cat <<'USAGE'
Usage: bash scripts/demo.sh [OPTIONS]

Installs needle-net into ./.venv (or $NEEDLE_VENV) on its first run (pip installs, a
C++ build; a few minutes), then runs `needle-net demo OPTIONS`: a local devnet, a
verified remote matmul and a short training run with offloaded matmuls.

Options (passed to needle-net demo):
  --workers INTEGER   Worker processes to start (at least 1; default 2).
  --data-dir PATH     State of the demo's devnet (default: a temporary directory).
  -h, --help          Show this message and exit.
USAGE
}
# -h/--help answers at once: from the installed needle-net if there is one, else from
# the text above, never after an install
for arg in "$@"; do
  if [ "$arg" = -h ] || [ "$arg" = --help ]; then
    venv=$(cd "$(dirname "$0")/.." && cd "${NEEDLE_VENV:-.venv}" 2>/dev/null && pwd) || true
    if [ -n "$venv" ] && [ -x "$venv/bin/needle-net" ]; then
      exec "$venv/bin/needle-net" demo --help
    fi
    usage
    exit 0
  fi
done
caller=$PWD  # install.sh works from the repo root; the demo's own paths are the caller's
source "$(dirname "$0")/install.sh"
venv=$(cd "$VENV" && pwd)
cd "$caller"
exec "$venv/bin/needle-net" demo "$@"
