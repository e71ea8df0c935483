#!/usr/bin/env bash
# Install needle-net into ./.venv and run the main demo: a local devnet, a verified remote
# matmul and a short training run with offloaded matmuls (needle-net demo --help for options).
set -euo pipefail
source "$(dirname "$0")/install.sh"
exec "$VENV/bin/needle-net" demo "$@"
