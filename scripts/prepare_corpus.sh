#!/usr/bin/env bash
# Prepares the demo corpus: the English prose of Debian's `fortunes` package (fortune-mod's
# quotation files under /usr/share/games/fortunes, BSD licence, ~2.6 MB of text; installed
# by scripts/setup.sh) as byte-level token shards: DIR/fortunes_{train,val}_*.bin.
# Usage: scripts/prepare_corpus.sh <prepare_data binary> <output dir>. Does nothing when
# the shards exist.
set -euo pipefail
prepare="$1"
out="$2"
src=/usr/share/games/fortunes
if ls "$out"/fortunes_train_*.bin >/dev/null 2>&1 && ls "$out"/fortunes_val_*.bin >/dev/null 2>&1; then
  exit 0
fi
if [ ! -d "$src" ]; then
  echo "prepare_corpus: $src is missing: install the Debian package 'fortunes' (scripts/setup.sh does)" >&2
  exit 1
fi
# The text files only: not the .dat indexes nor the .u8 links to the same files.
mapfile -t files < <(find "$src" -maxdepth 1 -type f ! -name '*.dat' | sort)
"$prepare" --input "${files[@]}" --output-dir "$out" --name fortunes
