#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: GPT pretraining with data
# parallelism on 2 MPI ranks (DTRAIN_DEMO_RANKS) over the bundled corpus (the `fortunes`
# package's prose, prepared into data/fortunes once), examples/configs/demo.json: a 4-layer
# byte-level GPT, 800 steps, about 3 minutes on 2 cores. Extra arguments go to pretrain_gpt
# (e.g. --steps 200).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
source scripts/env.sh
build="${DTRAIN_BUILD_DIR:-build}"
data="${DTRAIN_DEMO_DATA:-data/fortunes}"
scripts/prepare_corpus.sh "$build/examples/prepare_data" "$data"
np="${DTRAIN_DEMO_RANKS:-2}"
exec mpirun -np "$np" --oversubscribe "$build/examples/pretrain_gpt" \
  --config examples/configs/demo.json \
  --train-data "$data/fortunes_train_*.bin" --val-data "$data/fortunes_val_*.bin" \
  --metrics "$data/demo_metrics.jsonl" "$@"
