#!/usr/bin/env bash
# GPU check, run on the lent GPU machine in one call (torch wheel, nvcc, cmake, ninja; no
# MPI, no package access: carry/ from scripts/carry.sh travels with the tree). Builds
# without MPI for the local GPU's architecture, then runs the unit tests and every GPU
# test (NCCL backend at world size 1), printing what a docs/benchmarks.md entry needs.
set -euo pipefail
cd "$(dirname "$0")/../.."
echo "== $(date -u +%Y-%m-%dT%H:%MZ) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
build="${DTRAIN_GPU_BUILD_DIR:-build-gpu}"
arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WITH_MPI=OFF \
  -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" >"$build.configure.log" 2>&1 ||
  { tail -40 "$build.configure.log"; exit 1; }
cmake --build "$build" --parallel "$(nproc)" 2>&1 | tail -5
ctest --test-dir "$build" --output-on-failure -L "unit|gpu" -E install_consumer
echo "== GPU check passed"
