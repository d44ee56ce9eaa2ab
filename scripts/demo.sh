#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job. Until the data-parallel
# pretraining example lands, that is the collective benchmark on 4 MPI ranks: raw MPI and
# dtrain's Communicator side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
source scripts/env.sh
np="${DTRAIN_DEMO_RANKS:-4}"
exec mpirun -np "$np" --oversubscribe "${DTRAIN_BUILD_DIR:-build}/benchmarks/comm_bench" \
  -b 64K -e 16M -f 4 -n 10 -w 3 --op all --impl both "$@"
