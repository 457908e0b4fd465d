#!/usr/bin/env bash
# The one command for a GPU run: build + install jaxdnn, run the test suite on the GPU, run every
# benchmark. Logs (build.log, tests.log, bench.log) and the results JSON go to RESULTS_DIR.
#   usage: benchmarks/gpu_check.sh RESULTS_DIR
# To spend less device time: JAXDNN_TESTS="tests/test_pool.py ..." (default: tests) and
# JAXDNN_FAMILIES="pool batch_norm" narrow the tests and the benchmarks (JAXDNN_TESTS=none: no
# tests, JAXDNN_FAMILIES=none: no benchmarks); JAXDNN_CASE="REGEX" narrows the cases;
# JAXDNN_TEST_WORKERS=N runs the tests in N processes (pytest-xdist, each without JAX's up-front
# allocation of the GPU's memory). The default families leave out rnn, attention_memory and the
# slowest cases; name them to run them.
# A jaxdnn wheel in .whl/ (built elsewhere for this machine's Python) is installed instead of
# building from source, which saves the device the CUDA compile.
# A/B on one machine: JAXDNN_AB=DIR names another source tree (e.g. `git archive REV | tar -x -C .ab`,
# carried to the device with this one), built beside this one (into build/ab-other); the benchmarks
# then run on each build in turn, JAXDNN_AB_ROUNDS times (default 2), into RESULTS_DIR/this-R/ and
# RESULTS_DIR/other-R/ (the same harness, this tree's run.py, for both; the tests run on this tree's
# build alone). Machines differ by several percent, so a change measured against the last run's
# numbers may be the machine.
# Two builds and the tests can fill a device call, so the work may take two calls on one (still
# held) machine: the first with JAXDNN_FAMILIES=none, the second with JAXDNN_TESTS=none and
# JAXDNN_REUSE_BUILDS=1, which keeps the builds the first left (the installed jaxdnn, build/ab-other)
# instead of building again.
# Keeps going after a failure so the benchmarks still run; exits non-zero if any step failed.
set -uo pipefail
mkdir -p "${1:?usage: $0 RESULTS_DIR}" && out=$(cd "$1" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
failed=()

# Pure-Python wheels carried to an offline machine (nvidia-cutlass, whose headers the CUDA build
# needs; dm-haiku and jmp), and a prebuilt jaxdnn wheel, if any.
if compgen -G '.whl/*.whl' >/dev/null; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || failed+=(wheels)
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi

reuse=${JAXDNN_REUSE_BUILDS:-0}
other=$PWD/build/ab-other
if [ -n "${JAXDNN_AB:-}" ] && ! { [ "$reuse" = 1 ] && [ -d "$other/jaxdnn" ]; }; then
  # the other tree's build, beside this one's (the two compile at once)
  rm -rf "$other" && mkdir -p "$other"
  (cd "$JAXDNN_AB" && python3 -m pip install --no-build-isolation --no-deps --target "$other" . \
    > "$out/build-other.log" 2>&1) &
  other_build=$!
fi
if [ "$reuse" = 1 ] && python3 -P -c 'import jaxdnn' 2>/dev/null; then
  echo "gpu_check: reusing the installed jaxdnn" | tee "$out/build.log"
elif compgen -G '.whl/jaxdnn-*.whl' >/dev/null; then
  echo "gpu_check: using the carried $(ls .whl/jaxdnn-*.whl)" | tee "$out/build.log"
else
  python3 -m pip install --no-build-isolation --no-deps -v . 2>&1 | tee "$out/build.log" || failed+=(build)
fi
if [ -n "${other_build:-}" ]; then wait "$other_build" || failed+=(build-other); fi
nvidia-smi
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
# -P: do not put the cwd (the source folder jaxdnn/) ahead of the installed package on sys.path.
python3 -P -c 'import jaxdnn; print("jaxdnn from", jaxdnn.__file__); assert jaxdnn.has_cuda_kernels()' \
  || failed+=(cuda-kernels)
workers=()
if [ "${JAXDNN_TEST_WORKERS:-1}" -gt 1 ]; then
  workers=(-n "$JAXDNN_TEST_WORKERS")
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
fi
if [ "${JAXDNN_TESTS:-tests}" != none ]; then
  # shellcheck disable=SC2086  # the lists are meant to split into words
  python3 -P -m pytest ${JAXDNN_TESTS:-tests} -q -p no:cacheprovider "${workers[@]}" 2>&1 | tee "$out/tests.log" \
    || failed+=(tests)
fi
unset XLA_PYTHON_CLIENT_PREALLOCATE
families=${JAXDNN_FAMILIES:-norm softmax activation pool batch_norm group_norm dense conv attention}
bench() {  # bench OUT_DIR: every family (and case) asked for, on the jaxdnn first on the path
  # shellcheck disable=SC2086
  python3 benchmarks/run.py --family $families ${JAXDNN_CASE:+--case "$JAXDNN_CASE"} --out "$1" 2>&1 \
    | tee -a "$out/bench.log" || failed+=(benchmarks)
}
if [ "$families" != none ] && [ -z "${JAXDNN_AB:-}" ]; then
  bench "$out"
elif [ "$families" != none ]; then
  for round in $(seq "${JAXDNN_AB_ROUNDS:-2}"); do
    echo "gpu_check: round $round, this tree" | tee -a "$out/bench.log"
    bench "$out/this-$round"
    echo "gpu_check: round $round, $JAXDNN_AB" | tee -a "$out/bench.log"
    PYTHONPATH=$other${PYTHONPATH:+:$PYTHONPATH} bench "$out/other-$round"
  done
fi

if ((${#failed[@]})); then echo "gpu_check: FAILED: ${failed[*]}" >&2; exit 1; fi
echo "gpu_check: all passed; results in $out"
