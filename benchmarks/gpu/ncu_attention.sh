#!/usr/bin/env bash
# Profiles the Hopper attention kernels with Nsight Compute: benchmarks/gpu/ncu_attention.sh
# OUTDIR [BUILD]. One launch each of the wgmma forward and backward at kernel_bench's first
# case (S 4096, D 128, causal, bf16), full section set, the card's clocks left alone; writes
# OUTDIR/{fwd,bwd}.ncu-rep, their details pages (occupancy, throughput, stall reasons) as
# text and their per-instruction source pages (SASS with stall samples) as CSV. Needs ncu and
# a build from benchmarks/gpu/check.sh (BUILD, default build-gpu).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: ncu_attention.sh OUTDIR [BUILD]}"
build="${2:-build-gpu}"
mkdir -p "$out"
ncu="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)"
[ -x "$ncu" ] || { echo "ncu_attention.sh: no ncu on this machine" >&2; exit 1; }
rc=0
for pass in fwd bwd; do
  "$ncu" --clock-control none --set full --kernel-name "regex:flash_${pass}_sm90_kernel" --launch-count 1 \
    --export "$out/$pass" --force-overwrite "$build/benchmarks/kernel_bench" --only attention --seq 4096 \
    --dims 128 --iters 2 --rounds 1 >"$out/${pass}_run.log" 2>&1 || { rc=1; tail -5 "$out/${pass}_run.log"; continue; }
  "$ncu" --import "$out/$pass.ncu-rep" --page details --print-details all >"$out/${pass}_details.txt" 2>&1 || rc=1
  "$ncu" --import "$out/$pass.ncu-rep" --page source --csv --print-source sass >"$out/${pass}_sass.csv" 2>&1 || rc=1
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy" \
    "$out/${pass}_details.txt" | head -8 | sed "s/^/$pass: /"
done
exit "$rc"
