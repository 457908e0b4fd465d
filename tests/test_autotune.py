"""Autotuning (jaxdnn.config.autotune): every algorithm a convolution stage or dense may be bound with
computes the right result (on a GPU these are distinct kernels: tiles, the GEMM); the choice is 0
when autotuning is off, the fastest candidate when on, timed once and kept in the on-disk cache that
a later process reads instead of timing; a broken cache or a failing candidate only warns. The CPU
kernels have no choice, so the timing tests let the CPU count as a tunable platform."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdnn
from helpers import check_fused_conv, dtype_id, normal
from jaxdnn import _autotune
from test_conv import NHWC, test_forward_and_grad as check_conv
from test_dense import TF32_TOLERANCE, _check as check_dense, _inputs as dense_inputs

# (lhs shape, rhs shape, kwargs): a 64-channel 3x3 (the tall and small tiles' case, and the halo
# kernels'), a strided one (dgrad on zero-inserted dy), a pointwise one (the GEMM is a candidate), a
# 128 -> 256 3x3 (the im2col kernels' tiles; forced, the tile of 64 features takes the 64 -> 64 one too).
CONV_CASES = [
    ((2, 10, 9, 64), (3, 3, 64, 64), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
    ((2, 11, 12, 16), (3, 3, 16, 136), dict(window_strides=(2, 2), padding="SAME", dimension_numbers=NHWC)),
    ((2, 7, 6, 32), (1, 1, 32, 72), dict(window_strides=(1, 1), padding="VALID", dimension_numbers=NHWC)),
    ((2, 9, 11, 128), (3, 3, 128, 256), dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)),
]
CONV_ALGORITHMS = (0, 1, 2, 3, 4, 5, 6, 7, 8)  # ffi/conv/conv.h's ConvAlgorithm
GEMM_ALGORITHMS = (0, 1, 2, 3)  # ffi/dense/dense.h's GemmAlgorithm


@pytest.fixture
def forced(monkeypatch):
    """Binds every tunable stage with the algorithm given to the returned setter."""
    def force(algorithm):
        monkeypatch.setattr(_autotune, "choose", lambda *args: algorithm)
    return force


@pytest.mark.parametrize("algorithm", CONV_ALGORITHMS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=dtype_id)
@pytest.mark.parametrize("lhs_shape,rhs_shape,kwargs", CONV_CASES, ids=str)
def test_every_conv_algorithm_is_correct(algorithm, dtype, lhs_shape, rhs_shape, kwargs, forced, rng):
    forced(algorithm)
    check_conv(dtype, lhs_shape, rhs_shape, kwargs, rng)


@pytest.mark.parametrize("algorithm", CONV_ALGORITHMS)
def test_every_fused_conv_algorithm_is_correct(algorithm, forced, rng):
    forced(algorithm)
    x, w = normal(rng, (2, 9, 10, 64), jnp.bfloat16), normal(rng, (3, 3, 64, 64), jnp.bfloat16, scale=0.1)
    check_fused_conv(x, w, dict(padding="SAME"), "relu", True, rng)


@pytest.mark.parametrize("algorithm", GEMM_ALGORITHMS)
@pytest.mark.parametrize("n", [48, 264])
def test_every_dense_algorithm_is_correct(algorithm, n, forced, rng):
    forced(algorithm)
    check_dense("gelu", *dense_inputs(rng, (3, 70, 136), n, jnp.bfloat16), rng)


@pytest.mark.parametrize("algorithm", GEMM_ALGORITHMS)
def test_every_tf32_dense_algorithm_is_correct(algorithm, forced, rng):
    """float32 at JAX's default precision: each tile configuration's TF32 kernel (exact on CPU)."""
    forced(algorithm)
    with jax.default_matmul_precision(None):
        check_dense("gelu", *dense_inputs(rng, (3, 70, 136), 264), rng, tol=TF32_TOLERANCE,
                    grad_tol=10 * TF32_TOLERANCE)


def _conv_fn():
    return jax.jit(lambda x, w: jaxdnn.conv(x, w, padding="SAME"))


def _conv_args(rng):
    return normal(rng, (2, 8, 8, 64), jnp.bfloat16), normal(rng, (3, 3, 64, 64), jnp.bfloat16, scale=0.1)


def _algorithm_in(hlo: str) -> int:
    """The algorithm attribute of the one convolution custom call in `hlo`."""
    values = {int(v) for v in re.findall(r"algorithm = (\d+) : i64", hlo)}
    assert len(values) == 1, values
    return values.pop()


def test_off_binds_the_heuristic(rng):
    assert not jaxdnn.config.autotune  # the default (CI sets no JAXDNN_AUTOTUNE)
    assert _algorithm_in(_conv_fn().lower(*_conv_args(rng)).as_text()) == 0


@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """Autotuning on, the CPU tunable, a fresh cache file; yields its path."""
    path = tmp_path / "cache" / "autotune.json"
    monkeypatch.setattr(jaxdnn.config, "autotune", True)
    monkeypatch.setattr(jaxdnn.config, "autotune_cache", str(path))
    monkeypatch.setattr(_autotune, "TUNABLE_PLATFORMS", (jax.default_backend(),))
    _autotune.clear_memory()
    yield path
    _autotune.clear_memory()


def test_times_once_caches_on_disk_and_reuses(tuning, monkeypatch, rng):
    calls = []
    real = _autotune.time_candidates

    def timed(prim, operands, attrs, candidates, device):
        calls.append(candidates)
        times = real(prim, operands, attrs, candidates, device)  # really runs every candidate
        assert set(times) == set(candidates) and all(t > 0 for t in times.values())
        return {c: (1.0 if c == 3 else 2.0) for c in candidates}  # make the tall tile the fastest
    monkeypatch.setattr(_autotune, "time_candidates", timed)
    x, w = _conv_args(rng)
    assert _algorithm_in(_conv_fn().lower(x, w).as_text()) == 3
    # the forward's tiles, the halo kernel and the im2col kernels' tile of 64 features; no GEMM (3x3)
    assert calls == [(2, 3, 4, 5, 8)]
    _conv_fn().lower(x, w)  # the same problem again: no timing
    assert len(calls) == 1
    entries = json.loads(tuning.read_text())
    (key, entry), = entries.items()
    assert jax.devices()[0].device_kind in key and "|jaxdnn_conv_fprop|" in key and "[2, 1, 8, 8, 64]" in key
    assert entry["algorithm"] == 3 and set(entry["ms"]) == {"2", "3", "4", "5", "8"}
    # A new process (memory cleared) reads the file and does not time.
    _autotune.clear_memory()
    monkeypatch.setattr(_autotune, "time_candidates", lambda *args: pytest.fail("timed again"))
    assert _algorithm_in(_conv_fn().lower(x, w).as_text()) == 3
    # The tuned program computes the same as the untuned one.
    np.testing.assert_array_equal(np.asarray(_conv_fn()(x, w), np.float32),
                                  np.asarray(jaxdnn.conv(x, w, padding="SAME"), np.float32))


def test_gradients_tune_each_stage_and_dense_too(tuning, rng):
    x, w = _conv_args(rng)
    jax.jit(jax.grad(lambda x, w: jnp.sum(jaxdnn.conv(x, w, padding="SAME").astype(jnp.float32)),
                     argnums=(0, 1)))(x, w)
    a, b, _ = dense_inputs(rng, (4, 16), 24, jnp.bfloat16, bias=False)
    jax.jit(lambda a, b: jaxdnn.dense(a, b))(a, b)
    names = {key.split("|")[2] for key in json.loads(tuning.read_text())}
    assert names == {"jaxdnn_conv_fprop", "jaxdnn_conv_dgrad", "jaxdnn_conv_wgrad", "jaxdnn_gemm_rows"}


def test_untunable_stages_are_not_timed(tuning, monkeypatch, rng):
    monkeypatch.setattr(_autotune, "time_candidates", lambda *args: pytest.fail("timed"))
    x, w = normal(rng, (2, 8, 8, 8), jnp.float32), normal(rng, (3, 3, 8, 8), jnp.float32)
    jax.jit(lambda x, w: jaxdnn.conv(x, w))(x, w)  # float32: no tensor-core candidates
    xd, wd = normal(rng, (2, 8, 8, 16), jnp.bfloat16), normal(rng, (3, 3, 1, 16), jnp.bfloat16)
    jax.jit(lambda x, w: jaxdnn.conv(x, w, groups=16))(xd, wd)  # depthwise: one kernel
    assert not tuning.exists()


def test_a_broken_cache_warns_and_is_rewritten(tuning, rng):
    tuning.parent.mkdir(parents=True)
    tuning.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable cache"):
        _conv_fn().lower(*_conv_args(rng))
    assert len(json.loads(tuning.read_text())) == 1


def test_a_failing_candidate_is_skipped():
    class Flaky:
        name = "flaky"

        @staticmethod
        def bind(x, algorithm):
            if int(algorithm) == 2:
                raise RuntimeError("no kernel")
            return x * 2
    with pytest.warns(UserWarning, match="candidate 2 failed"):
        times = _autotune.time_candidates(Flaky, (jnp.ones((4,)),), {}, (1, 2, 3), jax.devices()[0])
    assert set(times) == {1, 3}


def test_the_key_names_device_shapes_and_attributes():
    ops = (jax.ShapeDtypeStruct((2, 3), jnp.bfloat16),)
    key = _autotune.problem_key("NVIDIA H200", "p", ops, {"b": np.int64(2), "a": 1, "algorithm": 4})
    assert key == "v2|NVIDIA H200|p|bfloat16[2, 3]|a=1,b=2"
    assert key != _autotune.problem_key("NVIDIA H100", "p", ops, {"a": 1, "b": 2})
