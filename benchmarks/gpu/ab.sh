#!/usr/bin/env bash
# A/B of the kernels on one GPU: benchmarks/gpu/ab.sh BASE OUTDIR [kernel_bench args...].
# BASE is another revision's source tree (scripts/ab_tree.sh REV, carried with the working
# tree). Builds kernel_bench for the local GPU in both trees (no MPI, as check.sh), runs
# the two binaries in turn DTRAIN_AB_ROUNDS times (default 3; the order flips each round,
# so that a drift of the clocks favours neither), each with the given kernel_bench
# arguments (default: --seq 4096 --dims 128, every op at the issue's target case), and
# prints, per case, the base's and this tree's medians and their ratio
# (benchmarks/gpu/ab_compare.py). Logs and JSON lines go to OUTDIR. Build folders:
# DTRAIN_GPU_BUILD_DIR (default build-gpu, as check.sh's) here, its base name in BASE.
# DTRAIN_AB_NO_BUILD=1 uses the binaries already built there.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 2 ] || { echo "usage: benchmarks/gpu/ab.sh BASE OUTDIR [kernel_bench args...]" >&2; exit 2; }
root="$PWD"
base="$(cd "$1" && pwd)"
out="$2"
shift 2
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--seq 4096 --dims 128)
rounds="${DTRAIN_AB_ROUNDS:-3}"
build="${DTRAIN_GPU_BUILD_DIR:-build-gpu}"
case "$build" in /*) new_build="$build" ;; *) new_build="$root/$build" ;; esac
base_build="$base/$(basename "$build")"
mkdir -p "$out"
: >"$out/base.jsonl"
: >"$out/new.jsonl"

if [ -z "${CXX:-}" ] && command -v clang++ >/dev/null; then export CXX=clang++; fi
arch=""
if command -v nvidia-smi >/dev/null; then
  arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)"
  [ "$arch" = 90 ] && arch=90a  # Hopper: the wgmma kernels need the sm_90a target
fi
# build_tree SRC BUILD SIDE: configure and build kernel_bench (both trees use this tree's carry/).
build_tree() {
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WITH_MPI=OFF \
    -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" -DDTRAIN_DEPS_DIR="$root/carry" >"$out/configure_$3.log" 2>&1
  cmake --build "$2" --parallel "$(getconf _NPROCESSORS_ONLN)" --target kernel_bench >"$out/build_$3.log" 2>&1
}
if [ "${DTRAIN_AB_NO_BUILD:-0}" != 1 ]; then
  t0=$SECONDS
  build_tree "$root" "$new_build" new || { tail -30 "$out/build_new.log" "$out/configure_new.log"; exit 1; }
  build_tree "$base" "$base_build" base || { tail -30 "$out/build_base.log" "$out/configure_base.log"; exit 1; }
  echo "built both trees in $((SECONDS - t0)) s"
fi
run() {  # run SIDE: one kernel_bench run; a failure ends the A/B with its log's tail
  local bin="$new_build/benchmarks/kernel_bench"
  [ "$1" = base ] && bin="$base_build/benchmarks/kernel_bench"
  "$bin" "${args[@]}" --json "$out/$1.jsonl" >>"$out/$1.log" 2>&1 || {
    echo "ab: the $1 side's kernel_bench failed" >&2
    tail -20 "$out/$1.log" >&2
    exit 1
  }
}
for ((r = 1; r <= rounds; r++)); do
  if ((r % 2)); then
    run base
    run new
  else
    run new
    run base
  fi
  echo "round $r of $rounds done"
done
python3 benchmarks/gpu/ab_compare.py "$out/base.jsonl" "$out/new.jsonl" | tee "$out/ab.txt"
