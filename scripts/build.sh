#!/usr/bin/env bash
# Configures (once) and builds dtrain with Ninja into $DTRAIN_BUILD_DIR (default build/).
# Extra CMake arguments: DTRAIN_CMAKE_ARGS. Later runs only rebuild what changed.
# The C++ compiler is clang++ when present and CXX is unset: it builds LibTorch code
# in about 60% of g++'s CPU time (docs/architecture.md, Build); CXX=g++ chooses GCC.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
build="${DTRAIN_BUILD_DIR:-build}"
if [ ! -f "$build/build.ninja" ]; then
  if [ -z "${CXX:-}" ] && command -v clang++ >/dev/null; then export CXX=clang++; fi
  # shellcheck disable=SC2086
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${DTRAIN_BUILD_TYPE:-Release}" \
    ${DTRAIN_CMAKE_ARGS:-}
fi
cmake --build "$build" --parallel "$DTRAIN_JOBS"
