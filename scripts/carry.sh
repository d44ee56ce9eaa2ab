#!/usr/bin/env bash
# Fills carry/ (git-ignored) with the header-only dependencies and GoogleTest sources from
# this machine's Debian packages, for a machine that has torch, nvcc, cmake and ninja but
# no package access (the GPU check machine): carry/spdlog/include (spdlog + fmt 9, used
# header-only), carry/include (CLI11, nlohmann-json), carry/googletest (sources).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
rm -rf carry && mkdir -p carry/spdlog/include carry/include
cp -r /usr/include/spdlog /usr/include/fmt carry/spdlog/include/
cp -r /usr/include/CLI /usr/include/nlohmann carry/include/
cp -r /usr/src/googletest carry/googletest
echo "carry/: $(du -sh carry | cut -f1)"
