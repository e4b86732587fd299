#!/usr/bin/env bash
# Regenerate the pinned dependency files the image installs from:
#   docker/requirements.lock  the runtime dependencies of the package (pyproject.toml) with
#                             the s3 extra: the image serves s3:// upstreams
#   docker/trainer.lock       what the example trainer adds (webdataset)
# Run from the repository root with the Python the image uses (see PYTHON_VERSION in
# docker/Dockerfile): bash docker/update-lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$PYTHON" -m venv "$tmp/run"
"$tmp/run/bin/pip" install --quiet --upgrade pip
"$tmp/run/bin/pip" install --quiet ".[s3]"
{
  echo "# Runtime dependencies of shardcache, pinned. Regenerate: bash docker/update-lock.sh"
  "$tmp/run/bin/pip" freeze --exclude shardcache --exclude pip
} > docker/requirements.lock

"$tmp/run/bin/pip" install --quiet "webdataset==1.0.2"
{
  echo "# The example trainer's additions to requirements.lock. Regenerate: bash docker/update-lock.sh"
  "$tmp/run/bin/pip" freeze --exclude shardcache --exclude pip \
    | grep -vxF -f <(grep -v '^#' docker/requirements.lock)
} > docker/trainer.lock
echo "wrote docker/requirements.lock docker/trainer.lock"
