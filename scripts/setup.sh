#!/usr/bin/env bash
# Installs what dtrain needs, and nothing that is already there: Debian packages (g++, clang,
# CMake, Ninja, ccache, Open MPI, spdlog, CLI11, nlohmann-json, GoogleTest, and `fortunes`,
# the prose the demo and a pretraining test train on) and LibTorch
# (an importable torch, else `pip install torch==$DTRAIN_TORCH_VERSION`, default 2.11.0), and
# Python's safetensors, numpy and transformers (the checkpoint tests read dtrain's files and
# its Hugging Face export with them).
# The CUDA toolkit, NCCL and cuDNN are used from CUDA_HOME or /usr/local/cuda when present.
set -euo pipefail

DTRAIN_TORCH_VERSION="${DTRAIN_TORCH_VERSION:-2.11.0}"
say() { echo "[setup] $*"; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else "$@"; fi; }

# ---- Debian packages --------------------------------------------------------------------
pkgs=(g++ clang cmake ninja-build ccache pkg-config openmpi-bin libopenmpi-dev libspdlog-dev
      libcli11-dev nlohmann-json3-dev libgtest-dev libgmock-dev fortunes)
command -v python3 >/dev/null || pkgs+=(python3)
python3 -m pip --version >/dev/null 2>&1 || pkgs+=(python3-pip)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null; then
    say "installing Debian packages: ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  else
    say "warning: no apt-get; missing packages: ${missing[*]} (the build may still find them)"
  fi
fi

# ---- LibTorch -----------------------------------------------------------------------------
# Found without importing it (importing torch takes seconds).
torch_version() {
  python3 -c "import importlib.util as u, importlib.metadata as m, sys
sys.exit(1) if u.find_spec('torch') is None else print(m.version('torch'))" 2>/dev/null
}
pip_install() {  # pip_install SPEC: into the python3 that CMake asks for torch
  if ! python3 -m pip install -q "$1" 2>/tmp/dtrain-pip.err; then
    if grep -q externally-managed /tmp/dtrain-pip.err; then
      python3 -m pip install -q --break-system-packages "$1"
    else
      cat /tmp/dtrain-pip.err >&2
      exit 1
    fi
  fi
}
if torch_version >/dev/null; then
  :
else
  say "installing torch==${DTRAIN_TORCH_VERSION} (LibTorch headers, libraries and CMake config)"
  pip_install "torch==${DTRAIN_TORCH_VERSION}"
fi
# Python packages the tests use: safetensors (and numpy, which safetensors.torch needs) reads
# dtrain's checkpoint files; transformers loads the Hugging Face export (hf_export test).
DTRAIN_TRANSFORMERS_VERSION="${DTRAIN_TRANSFORMERS_VERSION:-5.24.0}"
for spec in numpy safetensors "transformers==${DTRAIN_TRANSFORMERS_VERSION}"; do
  module="${spec%%=*}"
  if ! python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('$module') is None)" 2>/dev/null; then
    say "installing $spec (Python; used by the checkpoint tests)"
    pip_install "$spec"
  fi
done
say "ready: torch $(torch_version)," \
    "$(mpirun --version 2>/dev/null | head -1 || echo 'no MPI')," \
    "nvcc $(command -v nvcc >/dev/null && nvcc --version | grep -o 'release [0-9.]*' || echo 'absent')"
