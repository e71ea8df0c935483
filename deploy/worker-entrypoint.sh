#!/bin/sh
# Entrypoint of the compose worker services. Usage: worker-entrypoint.sh needle-net worker up ...
#
# Replicas of a scaled service share one volume; each takes its own data directory (key
# and job state) under $NEEDLE_NET_WORKER_ROOT: the first slot whose lock no running
# replica holds, so a restarted or recreated container gets its old key back. With
# NEEDLE_NET_DEV_FAUCET=1 (dev chains only) the key is funded from the public faucet
# account first. Then the given command runs with --data-dir SLOT, holding the lock.
set -eu
root=${NEEDLE_NET_WORKER_ROOT:-/var/lib/needle-net/workers}
i=0
while :; do
  slot=$root/worker$i
  mkdir -p "$slot"
  exec 9>"$slot/slot.lock"
  if flock -n 9; then
    break
  fi
  exec 9>&-
  i=$((i + 1))
done
echo "worker slot $slot"
if [ "${NEEDLE_NET_DEV_FAUCET:-0}" = 1 ]; then
  python "$(dirname "$0")/dev_faucet.py" --rpc-url "${NEEDLE_NET_RPC:?}" --data-dir "$slot"
fi
exec "$@" --data-dir "$slot"
