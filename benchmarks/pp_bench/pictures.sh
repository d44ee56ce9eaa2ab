#!/usr/bin/env bash
# Draws each pipeline schedule from a real run: pretrain_gpt on the bundled corpus with
# --pp 4 and 8 micro-batches (8 blocks of the demo model, 3 steps, --trace), then
# merge_traces draws the last step as docs/images/pp_<schedule>.svg.
# Usage: benchmarks/pp_bench/pictures.sh [build dir] [output dir]   (after scripts/demo.sh
# or scripts/build.sh; needs 4 MPI ranks, oversubscribed on smaller machines).
set -euo pipefail
cd "$(dirname "$0")/../.."
build="${1:-build}"
out="${2:-docs/images}"
source scripts/env.sh
data="${DTRAIN_DEMO_DATA:-data/fortunes}"
scripts/prepare_corpus.sh "$build/examples/prepare_data" "$data"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for schedule in gpipe 1f1b interleaved zb; do
  v=1
  [ "$schedule" = interleaved ] && v=2
  mpirun -np 4 --oversubscribe "$build/examples/pretrain_gpt" --config examples/configs/demo.json \
    --train-data "$data/fortunes_train_*.bin" --steps 3 --warmup-steps 0 --n-layer 8 \
    --pp 4 --pp-schedule "$schedule" --virtual-stages "$v" --microbatches 8 --progress off \
    --trace "$work/$schedule.json" > "$work/$schedule.log" 2>&1
  "$build/examples/merge_traces" "$work/$schedule-all.json" "$work/$schedule".rank{0,1,2,3}.json \
    --svg "$out/pp_$schedule.svg" --title "$schedule: pp 4, 8 micro-batches (v $v), step 3 of pretrain_gpt"
done
