"""Activations against jax.nn in float64: forward, gradients, parameters, transforms, sharding,
export, errors, and the custom calls in the HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdnn
from jaxdnn.activation import backward_with_bias_grad
from helpers import (DTYPES, ISA_ORDER, assert_close, dtype_id, f64, isa_child_report, normal, on_gpu,
                     tolerance)


def _gelu_tanh(x):
    """jax.nn.gelu(x) (approximate=True) as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3):
    jax.nn's 0.5 x (1 + tanh(u)) cancels for x < -5 even in float64 (at x = -7.3 its 2.8e-15 is
    44x the true 6.4e-17), so it cannot judge the kernels there."""
    return x * jax.nn.sigmoid(2 * np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))


# name -> (jaxdnn function, jax.nn oracle), the same arguments.
ACTIVATIONS = {
    "relu": (jaxdnn.relu, jax.nn.relu),
    "relu6": (jaxdnn.relu6, jax.nn.relu6),
    "leaky_relu": (jaxdnn.leaky_relu, jax.nn.leaky_relu),
    "elu": (jaxdnn.elu, jax.nn.elu),
    "sigmoid": (jaxdnn.sigmoid, jax.nn.sigmoid),
    "tanh": (jaxdnn.tanh, jnp.tanh),
    "gelu": (jaxdnn.gelu, _gelu_tanh),
    "gelu_exact": (lambda x: jaxdnn.gelu(x, approximate=False), lambda x: jax.nn.gelu(x, approximate=False)),
    "silu": (jaxdnn.silu, jax.nn.silu),
    "softplus": (jaxdnn.softplus, jax.nn.softplus),
    "hard_tanh": (jaxdnn.hard_tanh, jax.nn.hard_tanh),
    "leaky_relu_0.2": (lambda x: jaxdnn.leaky_relu(x, 0.2), lambda x: jax.nn.leaky_relu(x, 0.2)),
    "elu_alpha_0.5": (lambda x: jaxdnn.elu(x, alpha=0.5), lambda x: jax.nn.elu(x, alpha=0.5)),
}
act_param = pytest.mark.parametrize("name", ACTIVATIONS)
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
# Sizes with and without a tail past the last 16-byte vector; rank 0; empty.
SHAPES = [(), (7,), (3, 5, 37), (4, 1024), (2, 0, 8), (1, 100003)]


def _check(name, x, cotangent, dtype):
    op, oracle = ACTIVATIONS[name]
    y = jax.jit(op)(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, oracle(f64(x)), tolerance(dtype), f"{name} forward")
    dx = jax.jit(lambda x, ct: jax.vjp(op, x)[1](ct)[0])(x, cotangent)
    want = jax.vjp(oracle, f64(x))[1](f64(cotangent))[0]
    assert_close(dx, want, tolerance(dtype, grad=True), f"{name} grad")


@act_param
@dtype_param
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_grad(name, dtype, shape, rng):
    _check(name, normal(rng, shape, dtype, scale=3.0), normal(rng, shape, dtype), dtype)


@act_param
def test_kinks_and_saturation(name, rng):
    """The points where jax.nn defines the gradient by convention, and far-out inputs."""
    special = jnp.asarray([0.0, -0.0, 1.0, -1.0, 6.0, 30.0, -30.0, 90.0, -90.0], jnp.float32)
    x = jnp.concatenate([special, normal(rng, (55,), scale=4.0)])
    _check(name, x, normal(rng, x.shape), jnp.float32)


@act_param
def test_nan_propagates(name, rng):
    """NaN inputs give jax.nn's outputs and gradients: NaN where jax.nn's are NaN, the same numbers
    elsewhere (relu, relu6 and hard_tanh keep a NaN, as jnp.maximum, minimum and where do)."""
    op, oracle = ACTIVATIONS[name]
    x = normal(rng, (40,), scale=3.0).at[::3].set(jnp.nan)
    cotangent = normal(rng, x.shape)
    y, vjp = jax.vjp(jax.jit(op), x)
    want, want_vjp = jax.vjp(oracle, f64(x))
    np.testing.assert_allclose(y, want, rtol=tolerance(jnp.float32), atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(vjp(cotangent)[0], want_vjp(f64(cotangent))[0],
                               rtol=tolerance(jnp.float32, grad=True), atol=1e-6, equal_nan=True)


# The activations whose CPU kernels take their transcendentals from ffi/common/math_cpu.h, with the
# elementwise relative error allowed against float64 on a dense grid: a few float32 ulp (a few for
# the functions, one or two for the float32 arithmetic around them). gelu's is larger far out: the
# rounding of its float32 argument (2u = 2 sqrt(2/pi) (x + 0.044715 x^3), or -x / sqrt(2) for
# erfc) is amplified by about |2u| or 2z^2 (1e-5 at x = -9 to -12), so within |x| <= 3 gelu has
# the tight bound and beyond a loose one.
_ELEMENTWISE_RTOL = {"sigmoid": 5e-7, "tanh": 5e-7, "silu": 5e-7, "gelu": 2e-6, "gelu_exact": 2e-6,
                     "softplus": 5e-7, "elu": 5e-7, "elu_alpha_0.5": 5e-7}


@pytest.mark.skipif(on_gpu(), reason="the CPU kernels' own exp, expm1, log1p, erfc and tanh")
@pytest.mark.parametrize("name", _ELEMENTWISE_RTOL)
def test_cpu_transcendentals_elementwise(name):
    """Every value of a dense grid over [-30, 30] (and +-inf), forward and gradient, within a
    few float32 ulp of jax.nn's in float64, elementwise: the norm-wise tests would let a coarse
    polynomial pass. Values below 1e-36 are judged absolutely (gelu's sigmoid(2u) is 0 where
    exp(-2u) overflows, from about 1e-38 down); gradients get an
    absolute term of 1e-6 times their largest value, for the cancellation in f' near its zeros
    (silu's and gelu's)."""
    op, oracle = ACTIVATIONS[name]
    x = jnp.concatenate([jnp.linspace(-30, 30, 600001, dtype=jnp.float32),
                         jnp.asarray([jnp.inf, -jnp.inf], jnp.float32)])
    rtol = _ELEMENTWISE_RTOL[name]
    y = np.asarray(jax.jit(op)(x), np.float64)
    want = np.asarray(oracle(f64(x)))
    tiny = 1e-36
    core = np.abs(np.asarray(x)) <= 3
    np.testing.assert_allclose(y[core], want[core], rtol=rtol, atol=tiny)
    np.testing.assert_allclose(y, want, rtol=3e-5 if name.startswith("gelu") else rtol, atol=tiny)
    grad = np.asarray(jax.jit(jax.grad(lambda x: op(x).sum()))(x[:-2]), np.float64)
    want_grad = np.asarray(jax.grad(lambda x: oracle(x).sum())(f64(x[:-2])))
    np.testing.assert_allclose(grad, want_grad, rtol=2 * rtol, atol=1e-6 * np.abs(want_grad).max())


_ISA_CHILD = """
import json, jax, jax.numpy as jnp, numpy as np
import jaxdnn
jax.config.update("jax_enable_x64", True)

def layer_norm_gelu(x, scale, bias):
    xhat = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-6)
    return jax.nn.gelu(xhat * scale + bias, approximate=False)

def group_norm_silu(x, scale, bias):  # x [N, S, C], 8 groups
    g = x.reshape(x.shape[0], x.shape[1], 8, -1)
    mean, var = g.mean((1, 3), keepdims=True), g.var((1, 3), keepdims=True)
    return jax.nn.silu(((g - mean) / jnp.sqrt(var + 1e-5)).reshape(x.shape) * scale + bias)

kx, kc, ks, kb, kq = jax.random.split(jax.random.key(0), 5)
x = 3 * jax.random.normal(kx, (37, 1029), jnp.float32)
scale, bias = 1 + jax.random.normal(ks, (1029,), jnp.float32), jax.random.normal(kb, (1029,), jnp.float32)
xg = jax.random.normal(kx, (3, 50, 64), jnp.float32)
sg, bg = scale[:64], bias[:64]
qkv = [jax.random.normal(key, (2, 40, 4, 32), jnp.float32) for key in jax.random.split(kq, 3)]
q, kv_bias = qkv[0], [a[:, :, :2] for a in qkv[1:]] + [jax.random.normal(kq, (1, 4, 40, 40), jnp.float32)]
windowed = dict(local_window_size=(9, 3))  # with a bias: the per-logit rules
cases = [  # (jaxdnn function, float64 reference, operands)
    (jaxdnn.sigmoid, jax.nn.sigmoid, (x,)), (jaxdnn.silu, jax.nn.silu, (x,)), (jaxdnn.tanh, jnp.tanh, (x,)),
    (lambda x: jaxdnn.gelu(x, approximate=False), lambda x: jax.nn.gelu(x, approximate=False), (x,)),
    (jaxdnn.softplus, jax.nn.softplus, (x,)), (jaxdnn.elu, jax.nn.elu, (x,)),
    (jaxdnn.relu, jax.nn.relu, (x,)),
    (jaxdnn.softmax, jax.nn.softmax, (x,)), (jaxdnn.log_softmax, jax.nn.log_softmax, (x,)),
    (lambda x, s, b: jaxdnn.layer_norm(x, s, b, activation="gelu_exact"), layer_norm_gelu, (x, scale, bias)),
    (lambda x, s, b: jaxdnn.group_norm(x, 8, s, b, activation="silu"), group_norm_silu, (xg, sg, bg)),
    (lambda q, k, v: jaxdnn.dot_product_attention(q, k, v, is_causal=True),
     lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), qkv),
    (lambda q, k, v, b: jaxdnn.dot_product_attention(q, k, v, b, **windowed),
     lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b, **windowed), [q, *kv_bias]),
]
errors = []
for op, oracle, operands in cases:
    y, pullback = jax.vjp(jax.jit(op), *operands)
    want, want_pullback = jax.vjp(oracle, *(a.astype(jnp.float64) for a in operands))
    ct = jax.random.normal(kc, y.shape, jnp.float32)
    grads = (np.concatenate([np.ravel(g) for g in pullback(ct)]),  # every operand's
             np.concatenate([np.ravel(g) for g in want_pullback(ct.astype(jnp.float64))]))
    for got, ref in ((y, want), grads):
        got, ref = np.asarray(got, np.float64), np.asarray(ref)
        errors.append(float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
print(json.dumps({"isa": jaxdnn.cpu_isa(), "errors": errors}))
"""


@pytest.mark.skipif(on_gpu(), reason="the CPU kernels' builds")
@pytest.mark.parametrize("cap", ISA_ORDER)
def test_cpu_vectorized_builds(cap):
    """The CPU kernels' vectorized loops in each build (common/cpu_isa.h's CallVectorized and
    CallForIsa): forward and every operand's gradient of the activations, softmax, layer and group
    norm with fused activations, and attention (causal; and windowed with a bias, GQA)."""
    report = isa_child_report(_ISA_CHILD, cap)
    assert len(report["errors"]) == 26
    forward, grads = report["errors"][0::2], report["errors"][1::2]
    assert max(forward) < tolerance(jnp.float32), report
    assert max(grads) < tolerance(jnp.float32, grad=True), report


# The backward with the bias gradient (dense's and conv's), as the fused ops name their activations:
# every activation on two shapes, and gelu on rows of C a multiple of the 16-byte pack or not (one
# value a lane), over several 256-pack column tiles, in chunks of one row and of many, with no rows
# and with one.
BIAS_CASES = ([(name, shape) for name in jaxdnn.activation.EPILOGUES for shape in [(3, 5, 37), (700, 16)]]
              + [("gelu", shape) for shape in [(3000, 8), (2, 60, 2056), (2, 0, 8), (1, 9)]])


@pytest.mark.parametrize("name,shape", BIAS_CASES, ids=str)
@dtype_param
def test_backward_with_bias_grad(name, shape, dtype, rng):
    kind, param = jaxdnn.activation.EPILOGUES[name]
    dy, z = normal(rng, shape, dtype), normal(rng, shape, dtype, scale=3.0)
    dz, dbias = jax.jit(lambda dy, z: backward_with_bias_grad(dy, z, kind, param))(dy, z)
    assert dz.dtype == dtype and dbias.dtype == jnp.float32 and dbias.shape == shape[-1:]
    want = jax.vjp(ACTIVATIONS[name][1], f64(z))[1](f64(dy))[0]
    assert_close(dz, want, tolerance(dtype, grad=True), "dz")
    assert_close(dbias, jnp.sum(want.reshape(-1, shape[-1]), axis=0), tolerance(dtype, grad=True), "dbias")
    # dbias is the sum of the rounded dz the products read (float32 sums: within their rounding)
    assert_close(dbias, jnp.sum(f64(dz).reshape(-1, shape[-1]), axis=0), 1e-5, "sum of dz")


def test_backward_with_bias_grad_transforms(rng):
    oracle = ACTIVATIONS["silu"][1]
    dy, z = normal(rng, (3, 40, 24)), normal(rng, (3, 40, 24), scale=2.0)

    def want(dy, z):
        dz = jax.vjp(oracle, z)[1](dy)[0]
        return dz, jnp.sum(dz, axis=tuple(range(dz.ndim - 1)))
    got = jax.vmap(lambda dy, z: backward_with_bias_grad(dy, z, "silu", 0.0), in_axes=(1, 1))(dy, z)
    expected = jax.vmap(want, in_axes=(1, 1))(f64(dy), f64(z))
    for g, w, what in zip(got, expected, ("vmap dz", "vmap dbias")):
        assert_close(g, w, 1e-5, what)
    got = jax.grad(lambda z: jnp.sum(backward_with_bias_grad(dy, z, "silu", 0.0)[1] ** 2))(z)
    expected = jax.grad(lambda z: jnp.sum(want(f64(dy), z)[1] ** 2))(f64(z))
    assert_close(got, expected, 1e-4, "grad through dbias")
    hlo = jax.jit(lambda dy, z: backward_with_bias_grad(dy, z, "silu", 0.0)).lower(dy, z).as_text()
    assert hlo.count("@jaxdnn_activation_bwd_bias_v1(") == 1 and "jaxdnn_activation_bwd_v1" not in hlo


@act_param
def test_transforms(name, rng):
    op, oracle = ACTIVATIONS[name]
    x = normal(rng, (4, 3, 24), scale=2.0)
    ct = normal(rng, x.shape)
    assert_close(jax.vmap(op, in_axes=1, out_axes=1)(x), oracle(f64(x)), 1e-5, "vmap")
    per_example = jax.vmap(jax.grad(lambda x, c: jnp.sum(op(x) * c)))(x, ct)
    want = jax.vmap(jax.grad(lambda x, c: jnp.sum(oracle(x) * c)))(f64(x), f64(ct))
    assert_close(per_example, want, 1e-4, "vmap(grad)")
    def penalty(f, x):
        return jnp.sum(jax.grad(lambda x: jnp.sum(f(x) * ct.astype(x.dtype)))(x) ** 2)
    got = jax.grad(lambda x: penalty(op, x))(x)
    want = jax.grad(lambda x: penalty(oracle, x))(f64(x))
    assert_close(got, want, 1e-4, "grad of grad")
    def scanned(f, x):
        h, _ = jax.lax.scan(lambda h, _: (jax.checkpoint(f)(h) + 0.5, None), x, None, length=3)
        return jnp.sum(h * ct.astype(h.dtype))
    assert_close(jax.grad(lambda x: scanned(op, x))(x), jax.grad(lambda x: scanned(oracle, x))(f64(x)),
                 1e-4, "scan(checkpoint)")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(op, (x,), (ct,))


def test_hlo_holds_the_custom_calls(rng):
    x = normal(rng, (4, 64))
    hlo = jax.jit(jax.grad(lambda x: jnp.sum(jaxdnn.gelu(x) * x))).lower(x).as_text()
    assert "jaxdnn_activation_fwd_v1" in hlo and "jaxdnn_activation_bwd_v1" in hlo


def test_sharded_runs_per_shard(rng, devices):
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("b", "m"))
    spec = NamedSharding(mesh, P("b", "m"))  # elementwise: the last axis may be sharded too
    x, ct = (jax.device_put(normal(rng, (8, 64)), spec) for _ in range(2))
    step = jax.jit(lambda x, ct: jax.vjp(jaxdnn.silu, x)[1](ct)[0])
    hlo = step.lower(x, ct).compile().as_text()
    assert "all-gather" not in hlo
    calls = [line for line in hlo.splitlines() if 'custom_call_target="jaxdnn_activation_' in line]
    assert calls and all("f32[4,32]" in line for line in calls), calls
    want = jax.vjp(jax.nn.silu, f64(x))[1](f64(ct))[0]
    assert_close(step(x, ct), want, 1e-5, "sharded grad")


def test_export_round_trip(rng):
    x = normal(rng, (3, 50))
    f = jax.jit(jax.grad(lambda x: jnp.sum(jaxdnn.elu(x, 0.7) ** 2)))
    exported = jax.export.export(f, disabled_checks=jaxdnn.export_safety_checks())(x)
    np.testing.assert_allclose(jax.export.deserialize(exported.serialize()).call(x), f(x), rtol=1e-6)


@pytest.mark.parametrize("bad,error,message", [
    (lambda: jaxdnn.relu(jnp.ones((3,), jnp.int32)), TypeError,
     "relu: x must be float32, bfloat16 or float16, got int32"),
    (lambda: jaxdnn.silu(jnp.ones((3,), jnp.float64)), TypeError, "silu: .* got float64"),
    (lambda: jaxdnn.leaky_relu(jnp.ones((3,), jnp.float32), float("nan")), ValueError, "must be finite"),
    (lambda: jaxdnn.gelu(jnp.ones((3,), jnp.float32), approximate="yes"), TypeError,
     "approximate must be a bool"),
], ids=["int", "float64", "nan-param", "approximate"])
def test_bad_input(bad, error, message):
    with pytest.raises(error, match=message):
        bad()
