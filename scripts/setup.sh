#!/usr/bin/env bash
# Sets up jaxdnn on a fresh machine (Python >= 3.11 and pip present): a virtual environment in
# .venv, the build tools, then jaxdnn itself with the extras named in $1 (e.g. "demo" or "test").
# The C++ kernels always build; the CUDA kernels too when nvcc is found (JAXDNN_CUDA=AUTO|ON|OFF).
# Re-running it is cheap: pip skips what is installed and CMake rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Build requirements are installed once into the venv: the build then runs without isolation,
# which lets CMake's build folder (build/) be reused between runs.
python -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" "jax>=0.10.2"
# CUTLASS's C++ headers for the CUDA build (its Python dependencies serve only its code generator).
python -m pip install -q --no-deps "nvidia-cutlass==4.2.0.0"
python -m pip install -q --no-build-isolation ".${extras:+[$extras]}"
