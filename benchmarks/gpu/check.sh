#!/usr/bin/env bash
# GPU check: benchmarks/gpu/check.sh [OUTDIR]. Run on a machine with one CUDA GPU,
# python3's torch wheel, nvcc, cmake and ninja but no MPI and no package access (carry/
# from scripts/carry.sh travels with the tree). Builds without MPI for the local GPU;
# tests the kernels (gpu_kernels once per attention kernel: mma.sync, and wgmma on Hopper,
# whose failure makes the later phases keep to mma.sync) and runs kernel_bench (attention
# also at head dims 32, 80, 96); runs the unit, GPU and CLI tests (NCCL backend at world
# size 1); trains the tiny model on the GPU (fp32, bf16, fp16, full sharding; one traced
# run merged by merge_traces); runs pp_bench's runtime with one stage on CUDA, a MoE model
# in bf16 and moe_bench (ep 1) on CUDA; trains with dtrain's kernels (flash attention,
# fused norm / cross-entropy / AdamW); and runs train_bench for gpt2-124m in fp32 and bf16
# over every sharding strategy (batch 8 x 1024; bf16 also with the kernels), and bf16 at
# batch 32; last, where ncu is installed, profiles the kernels (ncu_kernels.sh). Full logs
# and JSON lines go to OUTDIR (default build-gpu/out); a phase that fails is recorded and
# the next one still runs; a summary table comes last, with the
# kernel issue's targets (benchmarks/gpu/targets.py). Exit status: 0 when every phase
# passed (a missed target is a result, not a failure), 1 when one failed, 2 when none failed
# but DTRAIN_CHECK_DEADLINE_S cut some. DTRAIN_CHECK_BENCH overrides
# train_bench's model and shape (default "--preset gpt2-124m --batch 8 --seq 1024"), e.g.
# for a CPU dry run; DTRAIN_CHECK_ONLY runs some of the phases (see phase below);
# DTRAIN_CHECK_AB_BASE=ab/<hash> (scripts/ab_tree.sh) adds an A/B of the kernels against
# that revision (benchmarks/gpu/ab.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-build-gpu/out}"
build="${DTRAIN_GPU_BUILD_DIR:-build-gpu}"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
failed=0
start_all=$SECONDS

# DTRAIN_CHECK_ONLY: an extended regular expression; only the phases whose names it matches
# run (configure and build always do), e.g. DTRAIN_CHECK_ONLY=kernel to retest and time the
# kernels after a fix without the training phases. Give the rerun a new OUTDIR: the JSON
# lines are appended. A phase that needs another's output (the train_* runs need data's)
# finds it in the build folder from an earlier run.
only="${DTRAIN_CHECK_ONLY:-}"

# DTRAIN_CHECK_DEADLINE_S: seconds after the start past which no phase runs (each phase's
# limit is cut to the time left; a phase with under 15 s left is skipped and so recorded),
# so that a run under a hard wall-clock limit still ends with its summary. Unset: no deadline.
deadline="${DTRAIN_CHECK_DEADLINE_S:-}"
skipped=0

# phase NAME TIMEOUT_S COMMAND...: runs COMMAND with its output in $out/NAME.log, records
# status and seconds in the summary (a phase DTRAIN_CHECK_ONLY leaves out: nothing, status 0).
phase() {
  local name="$1" limit="$2"
  shift 2
  if [ -n "$only" ] && [ "$name" != configure ] && [ "$name" != build ] && ! grep -qE -- "$only" <<<"$name"; then
    return 0
  fi
  if [ -n "$deadline" ]; then
    local left=$((deadline - (SECONDS - start_all)))
    if [ "$left" -lt 15 ]; then
      printf '%-26s %-22s %5ss\n' "$name" "SKIPPED (deadline)" 0 >>"$summary"
      skipped=1
      return 125
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  local t0=$SECONDS rc
  echo "== $name"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  local status=ok
  if [ "$rc" -ne 0 ]; then
    status="FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', timeout'))"
    failed=1
    tail -25 "$out/$name.log"
  fi
  printf '%-26s %-22s %5ss\n' "$name" "$status" "$((SECONDS - t0))" >>"$summary"
  return "$rc"
}

# As scripts/build.sh: clang++ when present and CXX is unset (about 60% of g++'s build CPU time).
if [ -z "${CXX:-}" ] && command -v clang++ >/dev/null; then export CXX=clang++; fi
{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2
  echo "cores: $(getconf _NPROCESSORS_ONLN)"
  echo "c++: $("${CXX:-c++}" --version | head -1)"
} 2>&1 | tee "$out/machine.txt"
arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)"
[ "$arch" = 90 ] && arch=90a  # Hopper: the wgmma kernels need the sm_90a target

phase configure 300 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DDTRAIN_WITH_MPI=OFF -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" || { cat "$summary"; exit 1; }
# DTRAIN_CHECK_TARGETS: build only these targets (e.g. "gpu_kernels kernel_bench" for a
# kernels-only rerun); default all. The build keeps going past a target that fails, so the
# phases whose programs did build still run.
# shellcheck disable=SC2086
phase build 900 cmake --build "$build" --parallel "$(getconf _NPROCESSORS_ONLN)" \
  ${DTRAIN_CHECK_TARGETS:+--target $DTRAIN_CHECK_TARGETS} -- -k 0

# The kernels first (issue 8), one attention kernel at a time, so that a broken one (wrong
# results, or a trap: the TMA producer traps after 10 s in a stuck pipeline) cannot hide the
# other; if the wgmma kernels fail, every later phase keeps to mma.sync.
phase kernels_mma 240 env DTRAIN_ATTENTION_KERNEL=mma "$build/tests/gpu_kernels"
if [ "$arch" = 90a ]; then
  if ! phase kernels_wgmma 240 env DTRAIN_ATTENTION_KERNEL=wgmma "$build/tests/gpu_kernels" \
    --gtest_filter='*Attention*'; then
    export DTRAIN_ATTENTION_KERNEL=mma
    echo "kernels_wgmma failed: the later phases run with DTRAIN_ATTENTION_KERNEL=mma" >>"$summary"
  fi
fi
# Kernel benchmarks against LibTorch's ops (attention at 1k, 4k, 16k; the memory-bound ops
# against a device copy).
phase kernel_bench 240 "$build/benchmarks/kernel_bench" --json "$out/kernel_bench.jsonl"
# The other head dims at S = 4096: mma.sync's own kernels for 32 and 96, and 80 zero-padded
# into its 96 (on Hopper dtrain_* is wgmma, which runs all three padded to 64 or 128); 256
# (Gemma's; on Hopper dtrain_* is wgmma both ways, mma_* mma.sync's both ways).
phase kernel_bench_hdims 150 "$build/benchmarks/kernel_bench" --only attention --seq 4096 --dims 32,80,96,256 \
  --json "$out/kernel_bench_hdims.jsonl"
# D 256 in the compact mma.sync tiles of GPUs that give a block 99 KB (RTX 30xx/40xx, L40S),
# here by capping what the launchers take the device to give: against kernel_bench_hdims'
# mma_* at D 256 (the default tiles) and the same LibTorch backends.
phase kernel_bench_compact 60 env DTRAIN_ATTENTION_KERNEL=mma "$build/benchmarks/kernel_bench" --only attention \
  --seq 4096 --dims 256 --smem-cap 101376 --json "$out/kernel_bench_compact.jsonl"
# Attention dropout 0.1 at S 4096, D 128 on every side (on Hopper dtrain_* is wgmma and
# mma_* mma.sync), against LibTorch's flash and cuDNN backends with the same dropout.
phase kernel_bench_dropout 60 "$build/benchmarks/kernel_bench" --only attention --seq 4096 --dims 128 --dropout 0.1 \
  --json "$out/kernel_bench_dropout.jsonl"
# Logit soft-capping 50 (Gemma 2) on dtrain's side at S 4096, D 128 (LibTorch has none:
# against kernel_bench's rows without it, what the cap costs).
phase kernel_bench_softcap 60 "$build/benchmarks/kernel_bench" --only attention --seq 4096 --dims 128 --softcap 50 \
  --json "$out/kernel_bench_softcap.jsonl"
# Learned attention sinks on dtrain's side at S 4096, D 128 (LibTorch has none: against
# kernel_bench's rows without them, what a logit per head costs at the forward's start
# and the sinks' gradient).
phase kernel_bench_sinks 60 "$build/benchmarks/kernel_bench" --only attention --seq 4096 --dims 128 --sinks \
  --json "$out/kernel_bench_sinks.jsonl"
# The deterministic backward (LibTorch's deterministic algorithms on every side) at S 4096,
# D 128: against kernel_bench's rows without it, what bitwise reproducibility costs.
phase kernel_bench_deterministic 60 "$build/benchmarks/kernel_bench" --only attention --seq 4096 --dims 128 \
  --deterministic --json "$out/kernel_bench_deterministic.jsonl"
# Sliding windows (causal, 1024 keys) at 4k and 16k, D 128, against LibTorch's
# FlashAttention-2 with the same window and sdpa with a mask.
phase kernel_bench_window 120 "$build/benchmarks/kernel_bench" --only attention --seq 4096,16384 --dims 128 \
  --window 1024 --json "$out/kernel_bench_window.jsonl"
# Packed documents of 2048 tokens at 16k, D 128, against LibTorch's FlashAttention-2
# varlen and sdpa with a mask.
phase kernel_bench_documents 90 "$build/benchmarks/kernel_bench" --only attention --seq 16384 --dims 128 \
  --documents 2048 --json "$out/kernel_bench_documents.jsonl"
# Grouped-query attention on the sdpa backend (sdpa's own GQA) against sdpa over repeated k
# and v and dtrain's kernel, 16/4 heads at 4k, D 128: time, peak memory and sdpa's backend;
# causal, then over packed documents of 1024.
phase kernel_bench_gqa 90 "$build/benchmarks/kernel_bench" --only gqa --seq 4096 --dims 128 \
  --json "$out/kernel_bench_gqa.jsonl"
phase kernel_bench_gqa_documents 90 "$build/benchmarks/kernel_bench" --only gqa --seq 4096 --dims 128 \
  --documents 1024 --json "$out/kernel_bench_gqa.jsonl"
# One rank's share of the tensor-parallel loss (50304 over tp 8, 8192 rows): the fused
# split form against Megatron's and the one-call op, time and peak memory.
phase kernel_bench_ce_split 60 "$build/benchmarks/kernel_bench" --only ce_split --tp 8 \
  --json "$out/kernel_bench_ce_split.jsonl"
# One context-parallel rank's attention in the all-gather form (cp 4 at 16k, D 128): its two
# query chunks on the flash kernel's query offset against sdpa with the chunks' masks.
phase kernel_bench_cp_chunks 60 "$build/benchmarks/kernel_bench" --only cp_chunks --seq 16384 --dims 128 --cp 4 \
  --json "$out/kernel_bench_cp_chunks.jsonl"
# DTRAIN_CHECK_AB_BASE: another revision's tree (scripts/ab_tree.sh REV, carried as ab/):
# its kernel_bench against this tree's, in turn (benchmarks/gpu/ab.sh, default cases).
if [ -n "${DTRAIN_CHECK_AB_BASE:-}" ]; then
  phase ab 420 env DTRAIN_GPU_BUILD_DIR="$build" benchmarks/gpu/ab.sh "$DTRAIN_CHECK_AB_BASE" "$out/ab"
fi

# Tests: the CPU unit tests, the NCCL/CUDA tests and the CLI tests (no MPI here).
phase tests 300 env OMP_NUM_THREADS=2 ctest --test-dir "$build" --output-on-failure -j 8 \
  -L "unit|gpu|cli" -E "install_consumer|gpu_kernels"

# Training on the GPU (NCCL backend, one rank): the tiny model must learn. pretrain_gpt's
# defaults there include the fused norm, cross-entropy and AdamW (--no-fused-* for LibTorch's).
data="$build/gpu-data"
phase data 120 "$build/examples/prepare_data" --input LICENSE README.md docs/*.md \
  examples/*/README.md --output-dir "$data" --name docs
train() {  # train NAME ARGS...: tiny model for 200 steps
  local name="$1"
  shift
  phase "$name" 180 "$build/examples/pretrain_gpt" --config examples/configs/tiny.json \
    --steps 200 --eval-every 0 --train-data "$data/docs_train_*.bin" \
    --val-data "$data/docs_val_*.bin" --progress off --log-every 50 \
    --metrics "$out/$name.jsonl" "$@"
}
train train_tiny_fp32 --precision fp32
train train_tiny_bf16 --precision bf16
train train_tiny_fp16 --precision fp16
train train_tiny_full_fp32 --precision fp32 --fsdp full
train train_tiny_full_bf16 --fsdp full --param-dtype bfloat16
train train_tiny_zero2_fp16 --fsdp zero2 --param-dtype float16
# Traced (spans end with a device synchronize), then merged.
train train_tiny_trace_bf16 --precision bf16 --steps 20 --trace "$out/trace_tiny.json"
phase merge_traces 60 "$build/examples/merge_traces" "$out/trace_all.json" "$out/trace_tiny.rank0.json"
# Mixture of experts on CUDA: the router in float32 under bf16 autocast, capacity drops.
train train_tiny_moe_bf16 --precision bf16 --moe-experts 8 --moe-topk 2 --moe-capacity 1.25 --steps 100
phase moe_bench 120 "$build/benchmarks/moe_bench" --ep 1 --tokens 16384 --d-model 1024 --hidden 2048 \
  --experts 8 --topk 2 --json "$out/moe_bench.jsonl"
# The pipeline runtime on CUDA with one stage (spans, allocator peak per step).
phase pp_bench 120 "$build/benchmarks/pp_bench" --d-model 1024 --seq 256 --schedules gpipe,1f1b \
  --microbatches 4 --json "$out/pp_bench.jsonl"

# The tiny model trained with all of dtrain's kernels (head dim 16, zero-padded in the
# attention kernels; then 64).
train train_tiny_fused_bf16 --precision bf16 --attention flash --fused-norm --fused-ce --fused-adamw
train train_tiny_fused_full_bf16 --n-head 1 --fsdp full --param-dtype bfloat16 --attention flash --fused-norm \
  --fused-ce --fused-adamw
# Llama (SwiGLU MLPs, rotary embeddings, grouped-query attention) with every kernel, and
# with LibTorch's SwiGLU and rotation: the fused run's losses should track the plain one's.
train train_tiny_llama_fused_bf16 --family llama --n-kv-head 2 --precision bf16 --attention flash --fused-norm \
  --fused-ce --fused-adamw --fused-swiglu --fused-rope
train train_tiny_llama_plain_bf16 --family llama --n-kv-head 2 --precision bf16 --attention flash --fused-norm \
  --fused-ce --fused-adamw --no-fused-swiglu --no-fused-rope

# Throughput and memory: dtrain's trainer against a plain LibTorch loop, gpt2-124m.
for precision in fp32 bf16; do
  # shellcheck disable=SC2086
  phase "train_bench_$precision" 300 "$build/benchmarks/train_bench" \
    ${DTRAIN_CHECK_BENCH:---preset gpt2-124m --batch 8 --seq 1024} --steps 5 --rounds 2 --warmup 2 --precision "$precision" \
    --fsdp none,zero1,zero2,full --json "$out/train_bench.jsonl"
done
# The same with dtrain's kernels on the trainer side (the plain loop stays LibTorch's).
# shellcheck disable=SC2086
phase train_bench_bf16_fused 300 "$build/benchmarks/train_bench" \
  ${DTRAIN_CHECK_BENCH:---preset gpt2-124m --batch 8 --seq 1024} --steps 5 --rounds 2 --warmup 2 --precision bf16 \
  --kernels fused --fsdp none,full --json "$out/train_bench.jsonl"
# The same with LibTorch's attention (sdpa) and dtrain's other kernels: which attention the
# defaults should pick.
# shellcheck disable=SC2086
phase train_bench_bf16_fused_sdpa 300 "$build/benchmarks/train_bench" \
  ${DTRAIN_CHECK_BENCH:---preset gpt2-124m --batch 8 --seq 1024} --steps 5 --rounds 2 --warmup 2 --precision bf16 \
  --kernels norm,ce,adamw --fsdp none,full --json "$out/train_bench.jsonl"
# A batch that fills the GPU better, bf16, replicated only.
# shellcheck disable=SC2086
phase train_bench_bf16_b32 300 "$build/benchmarks/train_bench" \
  ${DTRAIN_CHECK_BENCH:---preset gpt2-124m --batch 32 --seq 1024} --steps 5 --rounds 2 \
  --warmup 2 --precision bf16 --fsdp none,full --json "$out/train_bench.jsonl"

# Last, Nsight Compute on the kernels (where the machine has it): reports, stall reasons and
# per-instruction samples under OUTDIR/ncu, for the next round of tuning.
if command -v ncu >/dev/null || ls /opt/nvidia/nsight-compute/*/ncu >/dev/null 2>&1; then
  phase ncu 240 benchmarks/gpu/ncu_kernels.sh "$out/ncu" "$build"
fi

echo
echo "== GPU check summary ($(head -1 "$out/machine.txt"), $((SECONDS - start_all)) s)"
sed -n 2p "$out/machine.txt"
[ -f "$out/tests.log" ] && grep -E "tests passed|tests failed" "$out/tests.log" | tail -1
for k in kernels_mma kernels_wgmma; do
  [ -f "$out/$k.log" ] && printf '%-22s %s\n' "$k" "$(grep -E "^\[  (PASSED|FAILED)  \]" "$out/$k.log" | tr '\n' ' ')"
done
for f in "$out"/train_tiny_*.log; do
  [ -f "$f" ] || continue
  printf '%-22s %s\n' "$(basename "$f" .log)" "$(grep -oE "done: .*" "$f" | tail -1)"
done
[ -f "$out/kernel_bench.log" ] && { echo "-- kernel_bench"; grep -vE '^\{' "$out/kernel_bench.log"; }
[ -f "$out/kernel_bench_hdims.log" ] && { echo "-- kernel_bench, head dims 32, 80, 96, 256"; grep -vE '^\{|^#' "$out/kernel_bench_hdims.log"; }
[ -f "$out/kernel_bench_compact.log" ] && { echo "-- kernel_bench, D 256 in 99 KB tiles (mma.sync)"; grep -vE '^\{|^#' "$out/kernel_bench_compact.log"; }
[ -f "$out/kernel_bench_dropout.log" ] && { echo "-- kernel_bench, dropout 0.1 (dtrain: wgmma on Hopper, mma_*: mma.sync)"; grep -vE '^\{' "$out/kernel_bench_dropout.log"; }
[ -f "$out/kernel_bench_softcap.log" ] && { echo "-- kernel_bench, softcap 50 (dtrain only)"; grep -vE '^\{' "$out/kernel_bench_softcap.log"; }
[ -f "$out/kernel_bench_sinks.log" ] && { echo "-- kernel_bench, learned sinks (dtrain only)"; grep -vE '^\{' "$out/kernel_bench_sinks.log"; }
[ -f "$out/kernel_bench_deterministic.log" ] && { echo "-- kernel_bench, deterministic"; grep -vE '^\{' "$out/kernel_bench_deterministic.log"; }
[ -f "$out/kernel_bench_window.log" ] && { echo "-- kernel_bench, window 1024"; grep -vE '^\{' "$out/kernel_bench_window.log"; }
[ -f "$out/kernel_bench_documents.log" ] && { echo "-- kernel_bench, documents of 2048"; grep -vE '^\{' "$out/kernel_bench_documents.log"; }
for f in "$out"/kernel_bench_gqa*.log "$out"/kernel_bench_ce_split.log "$out"/kernel_bench_cp_chunks.log; do
  [ -f "$f" ] && { echo "-- $(basename "$f" .log)"; grep -vE '^\{|^#' "$f"; }
done
# The issue's targets (a missed one is a result, not a failed phase).
[ -f "$out/kernel_bench.jsonl" ] && { echo "-- targets"; python3 benchmarks/gpu/targets.py "$out/kernel_bench.jsonl" | tee "$out/targets.txt"; }
for run in fp32 bf16 bf16_fused bf16_fused_sdpa bf16_b32; do
  f="$out/train_bench_$run.log"
  [ -f "$f" ] && { echo "-- train_bench $run"; grep -E "^(strategy|plain|ddp|zero1|zero2|full) " "$f"; }
done
cat "$summary"
[ "$failed" -eq 0 ] && [ "$skipped" -eq 1 ] && exit 2
exit "$failed"
