"""Shared test helpers: random inputs, the float64 oracle, and relative-error checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxdnn

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def on_gpu() -> bool:
    """Whether the tests run on a GPU (JAX's default backend); `gpu`-marked tests need one."""
    return jax.default_backend() == "gpu"


# Relative error ||out - ref|| / ||ref|| allowed against the float64 oracle; gradients get 10x.
TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2,
             jnp.dtype(jnp.float16): 5e-3}
GRAD_FACTOR = 10


def tolerance(dtype, grad: bool = False) -> float:
    return TOLERANCE[jnp.dtype(dtype)] * (GRAD_FACTOR if grad else 1)


def dtype_id(dtype) -> str:
    return jnp.dtype(dtype).name


def rel_err(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64; ||actual - expected|| when expected is all
    zeros (e.g. dscale of an empty batch), so such results must be exactly zero."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    diff = np.linalg.norm(actual - expected)
    norm = np.linalg.norm(expected)
    return float(diff / norm) if norm > 0 else float(diff)


def assert_close(actual, expected, tol: float, what: str = "") -> None:
    """rel_err(actual, expected) <= tol, and every element finite."""
    assert np.shape(actual) == np.shape(expected), (what, np.shape(actual), np.shape(expected))
    if np.size(expected) == 0:
        return
    assert np.all(np.isfinite(np.asarray(actual, np.float64))), f"{what}: non-finite values"
    err = rel_err(actual, expected)
    # A result in the subnormal range of its dtype is quantized in absolute steps (or flushed to
    # zero), so an error below the smallest normal per element is rounding, not a kernel error.
    dtype = np.asarray(actual).dtype
    if jnp.issubdtype(dtype, jnp.floating):
        diff = np.linalg.norm(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
        if diff <= float(jnp.finfo(dtype).smallest_normal) * np.sqrt(np.size(expected)):
            return
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def normal(rng, shape, dtype=jnp.float32, loc=0.0, scale=1.0):
    """Random normal values (loc + scale * N(0, 1)) as a jax array of `dtype`."""
    return jnp.asarray(rng.normal(loc, scale, size=shape), dtype=dtype)


def f64(a):
    return None if a is None else jnp.asarray(a, jnp.float64)


# The kinks of the piecewise-linear activations (the kernels' kind names).
KINKS = {"relu": (0.0,), "leaky_relu": (0.0,), "relu6": (0.0, 6.0), "hard_tanh": (-1.0, 1.0)}


def off_kinks(cotangent, pre_activation, kind: str, margin: float = 1e-5):
    """`cotangent` zeroed where the float64 `pre_activation` lies within `margin` of a kink of the
    activation `kind`: there the kernel's float32 sums may put it on the other side of the kink than
    the float64 oracle, and that element's gradient then rightly differs (dy or 0, not a rounding)."""
    near = jnp.zeros(jnp.shape(pre_activation), bool)
    for kink in KINKS.get(kind, ()):
        near = near | (jnp.abs(pre_activation - kink) < margin)
    return jnp.where(near, jnp.zeros((), cotangent.dtype), cotangent)


def batch_mesh(kind, devices):
    """A 4-device mesh with one axis "b": a plain Mesh ("mesh"), or Auto / Explicit axis types."""
    if kind == "mesh":
        return jax.sharding.Mesh(np.array(devices), ("b",))
    axis_type = getattr(jax.sharding.AxisType, kind.capitalize())
    return jax.make_mesh((4,), ("b",), axis_types=(axis_type,), devices=devices)


# --- module tests: a jaxdnn module against the stock one on the same parameters ---------------------

def f64_tree(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)


def randomize(rng, tree):
    """Every leaf replaced by random normals (so a zero-initialized bias is exercised too)."""
    return jax.tree.map(lambda a: normal(rng, a.shape, a.dtype), tree)


def assert_same_structure(a, b):
    spec = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert spec(a) == spec(b)


def output_and_grads(apply):
    """jit of (params, x, ct) -> (apply(params, x), its VJP of ct): one compile per module."""
    def run(params, x, ct):
        y, vjp = jax.vjp(apply, params, x)
        return y, vjp(ct)
    return jax.jit(run)


def bit_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8),
                                                                        b.view(np.uint8))


class NormOp:
    """One of jaxdnn's norms, called uniformly as op(x, scale, bias, epsilon=...); `bias` must be
    None for rms_norm."""

    def __init__(self, name: str, has_bias: bool):
        self.name = name
        self.has_bias = has_bias
        version = 2 if has_bias else 1  # layer_norm v2 added the fused activation
        self.fwd_target = f"jaxdnn_{name}_fwd_v{version}"
        self.bwd_target = f"jaxdnn_{name}_bwd_v{version}"
        self._fn = getattr(jaxdnn, name)
        self._reference = getattr(jaxdnn.reference, name)

    def __repr__(self):
        return self.name

    @staticmethod
    def _apply(fn, has_bias, x, scale, bias, epsilon):
        if has_bias:
            return fn(x, scale, bias, epsilon=epsilon)
        assert bias is None, "rms_norm has no bias"
        return fn(x, scale, epsilon=epsilon)

    def __call__(self, x, scale=None, bias=None, *, epsilon=1e-6):
        return self._apply(self._fn, self.has_bias, x, scale, bias, epsilon)

    def reference(self, x, scale=None, bias=None, *, epsilon=1e-6):
        return self._apply(self._reference, self.has_bias, x, scale, bias, epsilon)

    def oracle(self, x, scale=None, bias=None, *, epsilon=1e-6):
        """The reference on the inputs upcast to float64."""
        return _jit_reference(self, f64(x), f64(scale), f64(bias), epsilon=epsilon)

    def params(self, rng, features, dtype=jnp.float32):
        """Random (scale, bias) of shape (D,); bias is None for rms_norm."""
        scale = normal(rng, (features,), dtype, loc=1.0, scale=0.5)
        bias = normal(rng, (features,), dtype, loc=0.5, scale=1.0) if self.has_bias else None
        return scale, bias


OPS = (NormOp("layer_norm", has_bias=True), NormOp("rms_norm", has_bias=False))


# One compiled program per case is much faster than the reference's op-by-op dispatch.
_jit_reference = jax.jit(lambda op, *args, epsilon: op.reference(*args, epsilon=epsilon),
                         static_argnums=0, static_argnames="epsilon")


def vjp(fn, args, cotangent):
    """The VJP of fn(*args) for `cotangent`, w.r.t. every argument that is not None (in order),
    computed under jit (one compiled program instead of op-by-op dispatch)."""
    return jax.jit(lambda args, cotangent: _vjp(fn, args, cotangent))(list(args), cotangent)


def _vjp(fn, args, cotangent):
    live = [i for i, a in enumerate(args) if a is not None]

    def of_live(*values):
        full = list(args)
        for i, v in zip(live, values):
            full[i] = v
        return fn(*full)

    _, pullback = jax.vjp(of_live, *[args[i] for i in live])
    return pullback(cotangent)


def oracle_vjp(op: NormOp, args, cotangent, *, epsilon=1e-6):
    """The float64 reference VJP of op at args (x, scale, bias)."""
    return _jit_oracle_vjp(op, [f64(a) for a in args], f64(cotangent), epsilon=epsilon)


_jit_oracle_vjp = jax.jit(
    lambda op, args, cotangent, epsilon: _vjp(lambda *a: op.reference(*a, epsilon=epsilon), args,
                                             cotangent),
    static_argnums=0, static_argnames="epsilon")


def check_fused_conv(x, w, kwargs, activation, with_residual, rng):
    """jaxdnn.conv(x, w, bias, activation=, residual=, **kwargs) and its VJP (x, w, bias, residual;
    random cotangent) against the float64 reference, in x's dtype. Returns the jitted op and its
    arguments (x, w, bias, residual)."""
    dtype = x.dtype
    bias = normal(rng, w.shape[-1:], dtype)
    out_shape = jax.eval_shape(lambda x, w: jaxdnn.reference.conv(x, w, **kwargs), x, w).shape
    residual = normal(rng, out_shape, dtype) if with_residual else None
    args = (x, w, bias, residual)

    def op(fn):
        return lambda x, w, bias, residual: fn(x, w, bias, activation=activation, residual=residual, **kwargs)
    y = jax.jit(op(jaxdnn.conv))(*args)
    want = op(jaxdnn.reference.conv)(*(f64(a) for a in args))
    assert y.shape == want.shape and y.dtype == dtype
    assert_close(y, want, tolerance(dtype), "forward")
    ct = normal(rng, y.shape, dtype)
    got = jax.jit(lambda args, ct: jax.vjp(op(jaxdnn.conv), *args)[1](ct))(args, ct)
    want = jax.vjp(op(jaxdnn.reference.conv), *(f64(a) for a in args))[1](f64(ct))
    for name, g, want_g in zip(("x", "w", "bias", "residual"), got, want):
        if want_g is None:
            assert g is None
            continue
        assert g.dtype == dtype
        assert_close(g, want_g, tolerance(dtype, grad=True), f"grad {name}")
    return jax.jit(op(jaxdnn.conv)), args


# The CPU kernels' builds, narrowest first (jaxdnn.cpu_isa() names; JAXDNN_CPU_ISA caps the choice).
ISA_ORDER = ("baseline", "avx2", "avx512")


def isa_child_report(child: str, cap: str) -> dict:
    """The last stdout line, JSON, of the script `child` run on the CPU in a child process whose
    JAXDNN_CPU_ISA is `cap` (the choice is made once per process). Checks that it ran and took the cap,
    or the widest build this CPU has when that is narrower."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXDNN_CPU_ISA=cap)
    # -P: the installed jaxdnn, not the sources in the working directory
    run = subprocess.run([sys.executable, "-P", "-c", child], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    this_process = os.environ.get("JAXDNN_CPU_ISA") is None and jaxdnn.cpu_isa()
    if this_process:
        assert report["isa"] == min(cap, this_process, key=ISA_ORDER.index)
    return report
