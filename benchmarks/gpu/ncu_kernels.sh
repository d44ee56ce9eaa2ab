#!/usr/bin/env bash
# Profiles dtrain's kernels with Nsight Compute: benchmarks/gpu/ncu_kernels.sh OUTDIR [BUILD].
# One launch each, full section set, the card's clocks left alone: the Hopper attention
# forward and backward at kernel_bench's first case (S 4096, D 128, causal, bf16), the norm
# backward (RMSNorm, and LayerNorm as norm_bwd_ln; 16384 x 4096 bf16), the cross-entropy
# forward (8192 x 50304 bf16) and AdamW. Kernels are picked by a regular expression over
# their demangled names (the template arguments tell the norm instances apart; ncu may
# print a bool argument as true or as (bool)1). Per kernel: OUTDIR/NAME.ncu-rep, its details page (occupancy, throughput, stall
# reasons) as NAME_details.txt and its source page (SASS with stall samples) as
# NAME_sass.csv; a few headline lines printed. Needs ncu and a build from
# benchmarks/gpu/check.sh (BUILD, default build-gpu). DTRAIN_NCU_ONLY (an extended regular
# expression) profiles only the kernels whose NAME matches, e.g. attention_bwd.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: ncu_kernels.sh OUTDIR [BUILD]}"
build="${2:-build-gpu}"
mkdir -p "$out"
ncu="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)"
[ -x "$ncu" ] || { echo "ncu_kernels.sh: no ncu on this machine" >&2; exit 1; }
bench="$build/benchmarks/kernel_bench"
rc=0
# profile NAME KERNEL_REGEX KERNEL_BENCH_ARGS...
profile() {
  local name="$1" regex="$2"
  shift 2
  [ -n "${DTRAIN_NCU_ONLY:-}" ] && ! grep -qE -- "$DTRAIN_NCU_ONLY" <<<"$name" && return
  "$ncu" --clock-control none --set full --kernel-name-base demangled --kernel-name "regex:$regex" --launch-count 1 \
    --export "$out/$name" \
    --force-overwrite "$bench" "$@" --iters 2 --rounds 1 >"$out/${name}_run.log" 2>&1 ||
    { rc=1; tail -5 "$out/${name}_run.log"; return; }
  "$ncu" --import "$out/$name.ncu-rep" --page details --print-details all >"$out/${name}_details.txt" 2>&1 || rc=1
  "$ncu" --import "$out/$name.ncu-rep" --page source --csv --print-source sass >"$out/${name}_sass.csv" 2>&1 || rc=1
  grep -E "^\s+(Duration|Compute \(SM\) Throughput|DRAM Throughput|Registers Per Thread|Achieved Occupancy)\s" \
    "$out/${name}_details.txt" | sort -u | sed "s/^ */$name: /"
}
profile attention_fwd flash_fwd_sm90_kernel --only attention --seq 4096 --dims 128
profile attention_bwd flash_bwd_sm90_kernel --only attention --seq 4096 --dims 128
profile norm_bwd 'norm_bwd_kernel<__nv_bfloat16, (false|\(bool\)0)' --only norm
profile norm_bwd_ln 'norm_bwd_kernel<__nv_bfloat16, (true|\(bool\)1)' --only norm
profile ce_fwd ce_fwd_kernel --only ce
profile adamw adamw_kernel --only adamw
exit "$rc"
