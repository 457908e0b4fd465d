#!/usr/bin/env bash
# The one command for a GPU run: build + install jaxdnn, run the test suite on the GPU, run every
# benchmark. Logs (build.log, tests.log, bench.log) and the results JSON go to RESULTS_DIR.
#   usage: benchmarks/gpu_check.sh RESULTS_DIR
# To spend less device time: JAXDNN_TESTS="tests/test_pool.py ..." (default: tests) and
# JAXDNN_FAMILIES="pool batch_norm" narrow the tests and the benchmarks. The default families leave
# out attention and rnn, whose CUDA kernels are still correctness baselines (no tensor cores):
# their full-size cases would take far longer than a session's device time; name them to run them.
# Keeps going after a failure so the benchmarks still run; exits non-zero if any step failed.
set -uo pipefail
mkdir -p "${1:?usage: $0 RESULTS_DIR}" && out=$(cd "$1" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
failed=()

# Pure-Python wheels carried to an offline machine (nvidia-cutlass, whose headers the CUDA build
# needs; dm-haiku), if any.
if compgen -G '.whl/*.whl' >/dev/null; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || failed+=(wheels)
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi

python3 -m pip install --no-build-isolation --no-deps -v . 2>&1 | tee "$out/build.log" || failed+=(build)
nvidia-smi
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
# -P: do not put the cwd (the source folder jaxdnn/) ahead of the installed package on sys.path.
python3 -P -c 'import jaxdnn; print("jaxdnn from", jaxdnn.__file__); assert jaxdnn.has_cuda_kernels()' \
  || failed+=(cuda-kernels)
# shellcheck disable=SC2086  # the lists are meant to split into words
python3 -P -m pytest ${JAXDNN_TESTS:-tests} -q -p no:cacheprovider 2>&1 | tee "$out/tests.log" || failed+=(tests)
python3 benchmarks/run.py --family ${JAXDNN_FAMILIES:-norm softmax activation pool batch_norm group_norm dense conv} --out "$out" 2>&1 | tee "$out/bench.log" \
  || failed+=(benchmarks)

if ((${#failed[@]})); then echo "gpu_check: FAILED: ${failed[*]}" >&2; exit 1; fi
echo "gpu_check: all passed; results in $out"
