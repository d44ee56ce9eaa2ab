#!/usr/bin/env bash
# GPU check, run on the lent GPU machine in one call (torch wheel, nvcc, cmake, ninja; no
# MPI, no package access: carry/ from scripts/carry.sh travels with the tree). Builds
# without MPI for the local GPU's architecture, runs the unit, GPU and CLI tests (NCCL
# backend at world size 1), trains the tiny model on the GPU in fp32 and bf16, and runs
# train_bench, printing what a docs/benchmarks.md entry needs.
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
ctest --test-dir "$build" --output-on-failure -L "unit|gpu|cli" -E install_consumer

# Training on the GPU (NCCL backend, one rank): the tiny model must learn in fp32 and bf16,
# then trainer vs plain LibTorch throughput and MFU for gpt2-124m.
data="$build/gpu-data"
"$build/examples/prepare_data" --input LICENSE README.md docs/*.md examples/*/README.md \
  --output-dir "$data" --name docs >/dev/null
for precision in fp32 bf16; do
  echo "== pretrain_gpt tiny, $precision"
  "$build/examples/pretrain_gpt" --config examples/configs/tiny.json --steps 200 --eval-every 0 \
    --train-data "$data/docs_train_*.bin" --val-data "$data/docs_val_*.bin" \
    --precision "$precision" --progress off --log-every 50 2>&1 | grep -E "device|step |done"
done
echo "== train_bench gpt2-124m"
"$build/benchmarks/train_bench" --preset gpt2-124m --batch 8 --seq 1024 --steps 5 --rounds 2 --fsdp none,full \
  --warmup 2 2>&1 | grep -v "^\[" 
echo "== GPU check passed"
