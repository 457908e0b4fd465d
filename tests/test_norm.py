"""layer_norm and rms_norm against the float64 reference: forward, gradients, numerics, errors, and
the custom calls in the HLO."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdnn
from helpers import (DTYPES, OPS, assert_close, bit_equal, dtype_id, f64, normal, oracle_vjp,
                     tolerance, vjp)

op_param = pytest.mark.parametrize("op", OPS, ids=repr)
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)

SHAPES = [
    (1, 1), (7, 1), (33,), (3, 5, 37), (2, 0, 16), (0, 8), (4, 1000), (2, 4096), (1, 65536),
    (6, 130), (3, 1023), (2, 4100), (2, 3, 2, 33),
]
# Feature sizes cover every CUDA backward path: warp per row, block per row (up to 512 threads), and
# the streaming kernel (unaligned or long rows).
GRAD_SHAPES = [(1, 1), (7, 1), (33,), (3, 5, 37), (2, 0, 16), (4, 1000), (2, 4100), (37, 1024), (5, 8192),
               (2048, 256), (700, 2048), (1200, 100),  # rows > resident blocks (CPU: 16, 16, 3 slices)
               (3, 16384), (2, 65536)]


def _check_grads(op, dtype, args, cotangent, got, *, epsilon=1e-6, tol=None):
    want = oracle_vjp(op, args, cotangent, epsilon=epsilon)
    names = [n for n, a in zip(("dx", "dscale", "dbias"), args) if a is not None]
    assert len(got) == len(want) == len(names)
    for name, g, w, primal in zip(names, got, want, [a for a in args if a is not None]):
        assert g.dtype == primal.dtype, (name, g.dtype, primal.dtype)
        assert_close(g, w, tol or tolerance(dtype, grad=True), f"{op} {name}")


@op_param
@dtype_param
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward(op, dtype, shape, rng):
    x = normal(rng, shape, dtype, loc=2.0, scale=3.0)
    scale, bias = op.params(rng, shape[-1])
    out = op(x, scale, bias)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, op.oracle(x, scale, bias), tolerance(dtype), f"{op} forward")


@op_param
@dtype_param
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=str)
def test_grad(op, dtype, shape, rng):
    x = normal(rng, shape, dtype, loc=-1.0, scale=2.0)
    scale, bias = op.params(rng, shape[-1])
    cotangent = normal(rng, shape, dtype)
    # With one feature rms_norm's dx is ~epsilon / |x|^3 (cancellation in 1 - xhat^2): a large
    # epsilon keeps it well conditioned.
    epsilon = 1.0 if shape[-1] == 1 else 1e-6
    args = (x, scale, bias)
    got = vjp(lambda *a: op(*a, epsilon=epsilon), args, cotangent)
    _check_grads(op, dtype, args, cotangent, got, epsilon=epsilon)


# scale/bias: absent, float32, or x's dtype (rms_norm has no bias).
AFFINE = [(op, s, b) for op in OPS for s in (None, "float32", "x")
          for b in ((None, "float32", "x") if op.has_bias else (None,))]


@pytest.mark.parametrize("op,scale_dtype,bias_dtype", AFFINE,
                         ids=lambda v: str(v) if v is not None else "none")
@dtype_param
def test_affine_dtypes(op, scale_dtype, bias_dtype, dtype, rng):
    shape = (3, 5, 130)
    x = normal(rng, shape, dtype, loc=2.0, scale=3.0)
    resolve = lambda d: dtype if d == "x" else d  # noqa: E731
    scale = None if scale_dtype is None else normal(rng, shape[-1:], resolve(scale_dtype), 1.0, 0.5)
    bias = None if bias_dtype is None else normal(rng, shape[-1:], resolve(bias_dtype), 0.5, 1.0)
    out = op(x, scale, bias)
    assert out.dtype == x.dtype
    assert_close(out, op.oracle(x, scale, bias), tolerance(dtype), f"{op} forward")
    cotangent = normal(rng, shape, dtype)
    args = (x, scale, bias)
    _check_grads(op, dtype, args, cotangent, vjp(op, args, cotangent))


@op_param
@dtype_param
@pytest.mark.parametrize("epsilon", [0.0, 1e-6, 1e-4, 1e-2, 0.5])
def test_epsilon(op, dtype, epsilon, rng):
    # Rows of variance ~1e-3, so epsilon >= 1e-4 visibly changes the result.
    x = normal(rng, (6, 257), dtype, loc=0.0, scale=0.03)
    scale, bias = op.params(rng, 257)
    out = op(x, scale, bias, epsilon=epsilon)
    assert_close(out, op.oracle(x, scale, bias, epsilon=epsilon), tolerance(dtype), f"{op} forward")
    cotangent = normal(rng, x.shape, dtype)
    args = (x, scale, bias)
    got = vjp(lambda *a: op(*a, epsilon=epsilon), args, cotangent)
    _check_grads(op, dtype, args, cotangent, got, epsilon=epsilon)


# (offset, std) per row: large offsets relative to the spread catch a single-pass
# E[x^2] - E[x]^2 variance (its error grows like (offset/std)^2, a two-pass one like offset/std).
# All within float16 range.
ROW_STATS = [(0.0, 1.0), (1e3, 1.0), (-1e3, 2.0), (3.0, 1e-2), (-5.0, 1e-2), (2e4, 20.0),
             (0.0, 1e-3), (-4e4, 1e2)]
MAX_OFFSET_TO_STD = max(abs(m) / s for m, s in ROW_STATS)


@op_param
@dtype_param
@pytest.mark.parametrize("features", [64, 1023, 4100])
def test_rows_with_large_offsets(op, dtype, features, rng):
    loc = np.array([m for m, _ in ROW_STATS])[:, None]
    std = np.array([s for _, s in ROW_STATS])[:, None]
    x = jnp.asarray(loc + std * rng.normal(size=(len(ROW_STATS), features)), dtype)
    scale, bias = op.params(rng, features)
    # float32 statistics lose about (offset / std) * 2^-24 relative precision in x - mean.
    tol = max(tolerance(dtype), 16 * MAX_OFFSET_TO_STD * 2.0**-24)
    out = op(x, scale, bias)
    assert_close(out, op.oracle(x, scale, bias), tol, f"{op} forward")
    cotangent = normal(rng, x.shape, dtype)
    args = (x, scale, bias)
    _check_grads(op, dtype, args, cotangent, vjp(op, args, cotangent),
                 tol=max(tolerance(dtype, grad=True), 10 * tol))


@op_param
@dtype_param
def test_backward_is_deterministic(op, dtype, rng):
    shape = (512, 768)
    x = normal(rng, shape, dtype, loc=1.0, scale=2.0)
    scale, bias = op.params(rng, shape[-1])
    cotangent = normal(rng, shape, dtype)
    grads = jax.jit(lambda *a: vjp(op, a[:3], a[3]))
    first = grads(x, scale, bias, cotangent)
    second = grads(x, scale, bias, cotangent)
    for name, a, b in zip(("dx", "dscale", "dbias"), first, second):
        assert bit_equal(a, b), f"{op} {name} differs between two identical runs"


# Each case: (name, ops it applies to, x (shape, dtype), scale and bias (shape, dtype) or None,
# epsilon, error, message pattern). Messages start with the function's name and name the argument
# and the shapes involved.
_F32, _F64, _BF16, _F16, _I32 = jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16, jnp.int32
BOTH, LAYER = ("layer_norm", "rms_norm"), ("layer_norm",)
ERRORS = [
    ("int_x", BOTH, ((4, 8), _I32), None, None, 1e-6,
     TypeError, r"x must be float32, bfloat16 or float16, got int32"),
    ("float64_x", BOTH, ((4, 8), _F64), None, None, 1e-6,
     TypeError, r"x must be float32, bfloat16 or float16, got float64"),
    ("rank0_x", BOTH, ((), _F32), None, None, 1e-6,
     ValueError, r"x must have rank >= 1 .*got shape \(\)"),
    ("empty_last_axis", BOTH, ((3, 0), _F32), None, None, 1e-6,
     ValueError, r"x's last axis must be non-empty, got shape \(3, 0\)"),
    ("scale_shape", BOTH, ((4, 8), _F32), ((5,), _F32), None, 1e-6,
     ValueError, r"scale must have shape \(D,\) = \(8,\) to match x.shape \(4, 8\), "
                 r"got scale.shape \(5,\)"),
    ("scale_rank2", BOTH, ((4, 8), _F32), ((1, 8), _F32), None, 1e-6,
     ValueError, r"scale must have shape \(D,\) = \(8,\) .*got scale.shape \(1, 8\)"),
    ("scale_float64", BOTH, ((4, 8), _F32), ((8,), _F64), None, 1e-6,
     TypeError, r"scale must be float32 or x's dtype float32, got float64"),
    ("scale_float16_for_bfloat16_x", BOTH, ((4, 8), _BF16), ((8,), _F16), None, 1e-6,
     TypeError, r"scale must be float32 or x's dtype bfloat16, got float16"),
    ("scale_int", BOTH, ((4, 8), _F32), ((8,), _I32), None, 1e-6,
     TypeError, r"scale must be float32 or x's dtype float32, got int32"),
    ("bias_shape", LAYER, ((2, 3, 8), _F32), ((8,), _F32), ((9,), _F32), 1e-6,
     ValueError, r"bias must have shape \(D,\) = \(8,\) to match x.shape \(2, 3, 8\), "
                 r"got bias.shape \(9,\)"),
    ("bias_float64", LAYER, ((4, 8), _F32), None, ((8,), _F64), 1e-6,
     TypeError, r"bias must be float32 or x's dtype float32, got float64"),
    ("negative_epsilon", BOTH, ((4, 8), _F32), None, None, -1e-5,
     ValueError, r"epsilon must be a finite number >= 0, got -1e-05"),
    ("nan_epsilon", BOTH, ((4, 8), _F32), None, None, float("nan"),
     ValueError, r"epsilon must be a finite number >= 0, got nan"),
]


def _random(rng, shape, dtype):
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-5, 5, shape), dtype)
    return normal(rng, shape, dtype, loc=1.0, scale=2.0)


@pytest.mark.parametrize(
    "op,x,scale,bias,epsilon,error,match",
    [pytest.param(op, *case[2:], id=f"{op}-{case[0]}")
     for case in ERRORS for op in OPS if op.name in case[1]])
@pytest.mark.parametrize("under_jit", [False, True], ids=["eager", "jit"])
def test_errors(op, x, scale, bias, epsilon, error, match, under_jit, rng):
    args = [None if spec is None else _random(rng, *spec) for spec in (x, scale, bias)]
    call = lambda x, scale, bias: op(x, scale, bias, epsilon=epsilon)  # noqa: E731
    with pytest.raises(error, match=rf"^{op.name}: {match}"):
        if under_jit:  # validation happens at trace time, on abstract values
            jax.jit(call).lower(*args)
        else:
            call(*args)


def _grad_fn(op):
    def loss(x, scale, bias, cotangent):
        return jnp.sum(op(x, scale, bias).astype(jnp.float32) * cotangent)
    return jax.grad(loss, argnums=(0, 1, 2) if op.has_bias else (0, 1))


@op_param
@dtype_param
def test_lowered_hlo_holds_custom_calls(op, dtype, rng):
    x = normal(rng, (3, 5, 40), dtype)
    scale, bias = op.params(rng, 40)
    cotangent = normal(rng, x.shape, jnp.float32)
    fwd = jax.jit(op).lower(x, scale, bias).as_text()
    assert re.search(rf"custom_call @{op.fwd_target}\(", fwd), fwd
    assert op.bwd_target not in fwd
    bwd = jax.jit(_grad_fn(op)).lower(x, scale, bias, cotangent).as_text()
    assert re.search(rf"custom_call @{op.fwd_target}\(", bwd), bwd
    assert re.search(rf"custom_call @{op.bwd_target}\(", bwd), bwd


@pytest.mark.gpu
@op_param
@dtype_param
def test_compiled_gpu_hlo_holds_custom_calls(op, dtype, rng):
    assert jaxdnn.has_cuda_kernels(), "running on a GPU but jaxdnn was built without CUDA"
    x = normal(rng, (8, 1024), dtype, 1.0, 2.0)
    scale, bias = op.params(rng, 1024)
    cotangent = normal(rng, x.shape, jnp.float32)
    fwd = jax.jit(op).lower(x, scale, bias).compile().as_text()
    assert f'custom_call_target="{op.fwd_target}"' in fwd
    bwd = jax.jit(_grad_fn(op)).lower(x, scale, bias, cotangent).compile().as_text()
    assert f'custom_call_target="{op.fwd_target}"' in bwd
    assert f'custom_call_target="{op.bwd_target}"' in bwd


# --- layer_norm(..., activation=): the fused epilogue ---------------------------------------------

def _layer_norm_act_oracle(x, scale, bias, activation):
    from jaxdnn.activation import epilogue
    kind, param = epilogue("test", activation)
    return jaxdnn.reference.layer_norm(x, scale, bias, activation=kind, activation_param=param)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_exact", "silu", "tanh", "leaky_relu"])
@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 33), (2, 4100), (0, 16)], ids=str)
@dtype_param
def test_layer_norm_activation(activation, shape, dtype, rng):
    """Forward and gradients (x, scale, bias) of act(layer_norm) in one kernel, on the cached and the
    streaming paths (4100 is not a multiple of a 16-byte vector)."""
    x = normal(rng, shape, dtype, loc=0.5, scale=2.0)
    scale, bias = normal(rng, shape[-1:]), normal(rng, shape[-1:])
    ct = normal(rng, shape, dtype)
    op = lambda x, s, b: jaxdnn.layer_norm(x, s, b, activation=activation)
    y, vjp = jax.vjp(jax.jit(op), x, scale, bias)
    want, want_vjp = jax.vjp(lambda *a: _layer_norm_act_oracle(*a, activation), f64(x), f64(scale), f64(bias))
    assert_close(y, want, tolerance(dtype), "forward")
    for name, got, expected in zip(["dx", "dscale", "dbias"], vjp(ct), want_vjp(f64(ct))):
        assert_close(got, expected, tolerance(dtype, grad=True), name)


@pytest.mark.parametrize("activation", sorted(jaxdnn.activation.EPILOGUES))
@pytest.mark.parametrize("shape", [(3, 37), (4, 64)], ids=str)
def test_layer_norm_every_activation(activation, shape, rng):
    """Each fused activation: the kernels switch on its kind once per pack of values (37 = four packs
    of 8 and a tail on the CPU, the streaming path on a GPU; 64: the GPU's cached path)."""
    x = normal(rng, shape, jnp.float32, loc=0.5, scale=2.0)
    scale, bias = normal(rng, shape[-1:]), normal(rng, shape[-1:])
    op = lambda x, s, b: jaxdnn.layer_norm(x, s, b, activation=activation)
    y, vjp = jax.vjp(jax.jit(op), x, scale, bias)
    want, want_vjp = jax.vjp(lambda *a: _layer_norm_act_oracle(*a, activation), f64(x), f64(scale), f64(bias))
    assert_close(y, want, tolerance(jnp.float32), "forward")
    ct = normal(rng, shape, jnp.float32)
    for name, got, expected in zip(["dx", "dscale", "dbias"], vjp(ct), want_vjp(f64(ct))):
        assert_close(got, expected, tolerance(jnp.float32, grad=True), name)


def test_layer_norm_activation_transforms(rng):
    x, ct = normal(rng, (4, 3, 40)), normal(rng, (4, 3, 40))
    scales, biases = normal(rng, (4, 40)), normal(rng, (4, 40))
    op = lambda x, s, b: jaxdnn.layer_norm(x, s, b, activation="silu")
    oracle = lambda x, s, b: _layer_norm_act_oracle(x, s, b, "silu")
    # vmap with batched scale and bias (the affine and activation run in XLA), and its gradient
    assert_close(jax.vmap(op)(x, scales, biases), jax.vmap(oracle)(f64(x), f64(scales), f64(biases)), 1e-5,
                 "vmap batched params")
    loss = lambda f: lambda x, s, b: jnp.sum(jax.vmap(f)(x, s, b) * ct.astype(x.dtype))
    got = jax.grad(loss(op), argnums=(0, 1, 2))(x, scales, biases)
    want = jax.grad(loss(oracle), argnums=(0, 1, 2))(f64(x), f64(scales), f64(biases))
    for name, g, w in zip(["x", "scale", "bias"], got, want):
        assert_close(g, w, 1e-4, f"vmap grad {name}")
    # grad of grad
    s, b = scales[0], biases[0]
    penalty = lambda f: lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(f(x, s, b)) * ct))(x) ** 2)
    assert_close(jax.grad(penalty(op))(x), jax.grad(penalty(oracle))(f64(x)), 1e-4, "grad of grad")
    with pytest.raises(ValueError, match="activation must be None or one of"):
        jaxdnn.layer_norm(x, activation="swish")
