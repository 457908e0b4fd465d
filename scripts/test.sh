#!/usr/bin/env bash
# Sets up jaxdnn with its test dependencies and runs the test suite (on the GPU if there is one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# The tests are mostly compilation: they run in JAXDNN_TEST_WORKERS processes (pytest-xdist; default:
# the cores, at most 4), which on CI's 2 cores takes the suite from about 19 to 12 minutes. With more
# than one, JAX does not claim a GPU's memory up front, so the processes can share it.
workers=${JAXDNN_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers")
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
fi
# On the CPU the suite is mostly XLA compiling small programs (references, transforms, eager ops):
# compiling them unoptimized, without the new fusion emitters, took the suite on 2 cores from 15.6
# to 8.3 minutes (2026-11-28). jaxdnn's kernels are built by CMake, so what they compute is the same.
# A jaxlib that does not know a flag aborts on it, so the flags are tried first.
if ! command -v nvidia-smi >/dev/null && [ -z "${XLA_FLAGS:-}" ]; then
  fast_compile="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
  if XLA_FLAGS=$fast_compile .venv/bin/python -c 'import jax; jax.jit(lambda x: x + 1)(1.0)' 2>/dev/null; then
    export XLA_FLAGS=$fast_compile
  else
    echo "test.sh: this jaxlib rejects $fast_compile; compiling as usual" >&2
  fi
fi
# -P: import the installed jaxdnn, not the source folder of the same name.
status=0
.venv/bin/python -P -m pytest tests -q -p no:cacheprovider "${parallel[@]}" "$@" || status=$?
# pytest exits 5 when it collected no test: a suite that ran nothing has not passed.
if [ "$status" -eq 5 ]; then echo "test.sh: pytest collected no tests" >&2; exit 1; fi
exit "$status"
