#!/usr/bin/env bash
# Run a command beside a shardcache proxy on this node (docs/deployment.md, "Bare metal:
# SLURM"): start the proxy on loopback, wait until it answers, run the command with
# SHARDCACHE_PROXY set, then stop the proxy with SIGTERM (it lets responses finish and
# exits). The script exits with the command's status.
#
#   srun --ntasks-per-node=1 with-shardcache.sh python train.py
#
# The proxy reads its settings from the environment (docs/configuration.md);
# SHARDCACHE_UPSTREAM is required. Defaults here: the cache on node-local disk
# ($SLURM_TMPDIR, else $TMPDIR, else /tmp), a port derived from the job id so that two
# jobs on one node do not collide, and the proxy's log beside the cache directory.
set -uo pipefail

: "${SHARDCACHE_UPSTREAM:?set SHARDCACHE_UPSTREAM to the base URL of the dataset}"
export SHARDCACHE_CACHE_DIR="${SHARDCACHE_CACHE_DIR:-${SLURM_TMPDIR:-${TMPDIR:-/tmp}}/shardcache-$(id -u)}"
export SHARDCACHE_HOST=127.0.0.1
if [ -z "${SHARDCACHE_PORT:-}" ]; then
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    SHARDCACHE_PORT=$((20000 + SLURM_JOB_ID % 20000))
  else
    SHARDCACHE_PORT=8080
  fi
fi
export SHARDCACHE_PORT
export SHARDCACHE_PROXY="http://127.0.0.1:${SHARDCACHE_PORT}"
log="${SHARDCACHE_LOG:-${SHARDCACHE_CACHE_DIR%/}.log}"

shardcache serve >>"$log" 2>&1 &
proxy=$!
stop() {
  kill -TERM "$proxy" 2>/dev/null
  wait "$proxy" 2>/dev/null
}
trap stop EXIT
trap 'exit 143' TERM INT # scancel or Ctrl-C: stop the proxy on the way out

ready=""
for _ in $(seq 300); do
  if shardcache stats --proxy "$SHARDCACHE_PROXY" >/dev/null 2>&1; then
    ready=1
    break
  fi
  if ! kill -0 "$proxy" 2>/dev/null; then
    break
  fi
  sleep 0.2
done
if [ -z "$ready" ]; then
  echo "with-shardcache: the proxy did not start; the end of $log:" >&2
  tail -n 5 "$log" >&2
  exit 1
fi
echo "with-shardcache: proxy at $SHARDCACHE_PROXY, cache $SHARDCACHE_CACHE_DIR, log $log" >&2

"$@"
