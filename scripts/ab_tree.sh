#!/usr/bin/env bash
# Exports the source tree of a git revision into ab/<rev> (git-ignored), for
# benchmarks/gpu/ab.sh to time against the working tree on a GPU machine that has no git
# history: scripts/ab_tree.sh REV, then carry ab/ (and carry/) with the tree.
#   scripts/ab_tree.sh HEAD~3      # prints ab/<short hash>
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: scripts/ab_tree.sh REV" >&2; exit 2; }
rev="$(git rev-parse --short=10 "$1^{commit}")" || { echo "ab_tree: $1 is not a revision" >&2; exit 2; }
dir="ab/$rev"
rm -rf "$dir" && mkdir -p "$dir"
git archive "$rev" | tar -x -C "$dir"
echo "$dir"
