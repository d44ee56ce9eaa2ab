#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (unit, multi-rank, install).
# Arguments are passed to ctest (e.g. -L comm, -R mesh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
source scripts/env.sh
ctest --test-dir "${DTRAIN_BUILD_DIR:-build}" --output-on-failure -j "$DTRAIN_JOBS" "$@"
