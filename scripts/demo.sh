#!/usr/bin/env bash
# Install needle-net into ./.venv and run the main demo: a local devnet, a verified remote
# matmul and a short training run with offloaded matmuls (needle-net demo --help for options).
set -euo pipefail
caller=$PWD  # install.sh works from the repo root; the demo's own paths are the caller's
source "$(dirname "$0")/install.sh"
venv=$(cd "$VENV" && pwd)
cd "$caller"
exec "$venv/bin/needle-net" demo "$@"
