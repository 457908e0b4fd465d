"""dense against the float64 reference: forward and VJP (x, w, bias; random cotangent) for every dtype
and several epilogues, awkward shapes, every transpose combination of the GEMM target, transforms
(jit, vmap over x / w / bias, vmap(grad), grad of grad, checkpoint, scan), sharding, export, errors,
and the custom call in the HLO."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdnn
from helpers import (DTYPES, ISA_ORDER, assert_close, batch_mesh, dtype_id, f64, isa_child_report, normal,
                     on_gpu, rel_err, tolerance)
from jaxdnn.dense import _GEMM, _gemm, _matmul, _row_slices, _streamed_tiles
from jaxdnn.activation import epilogue, epilogue_attrs
from jaxdnn.reference.activation import activation_fwd

TARGET = "jaxdnn_gemm_v3"


def _op(activation):
    return lambda x, w, bias: jaxdnn.dense(x, w, bias, activation=activation)


def _oracle(activation):
    return lambda x, w, bias: jaxdnn.reference.dense(x, w, bias, activation=activation)


def _inputs(rng, x_shape, n, dtype=jnp.float32, bias=True, bias_dtype=jnp.float32):
    x = normal(rng, x_shape, dtype)
    # w scaled by 1 / sqrt(K) keeps z ~ N(0, 1): the activations' interesting region.
    w = normal(rng, (x_shape[-1], n), dtype, scale=1.0 / np.sqrt(max(x_shape[-1], 1)))
    b = normal(rng, (n,), bias_dtype, scale=0.5) if bias else None
    return x, w, b


def _check(activation, x, w, bias, rng, *, tol=None, grad_tol=None):
    """Forward and the VJP w.r.t. x, w (and bias) against the float64 oracle."""
    dtype = x.dtype
    args = (x, w) if bias is None else (x, w, bias)
    fn = (lambda f: (lambda x, w: f(x, w, None)) if bias is None else f)
    y, vjp = jax.vjp(jax.jit(fn(_op(activation))), *args)
    want = fn(_oracle(activation))(*(f64(a) for a in args))
    assert y.shape == want.shape and y.dtype == dtype
    assert_close(jax.jit(fn(_op(activation)))(*args), want, tol or tolerance(dtype), "forward")
    # Differentiated, the forward keeps z for the backward (dense.py's _dense_fwd): y = act(z rounded
    # to x's dtype) and act' at that z, which where act is steep (gelu's tail) or act' crosses zero
    # differ from their values at z by more than one rounding, so this oracle rounds z too (and
    # passes z's gradient through the rounding unchanged).
    kind, param = epilogue("dense", activation)

    def rounded_act(z):
        return activation_fwd(z + jax.lax.stop_gradient(z.astype(dtype).astype(z.dtype) - z), kind, param)

    z64, product_vjp = jax.vjp(fn(_oracle(None)), *(f64(a) for a in args))
    want_rounded, act_vjp = jax.vjp(rounded_act, z64)
    assert_close(y, want_rounded, tol or tolerance(dtype), "differentiated forward")
    ct = normal(rng, y.shape, dtype)
    (dz,) = act_vjp(f64(ct))
    # dbias sums dz (rounded to x's dtype) over the rows. Those roundings are independent, so the sum
    # is known to about the root sum of squares of its terms: where the terms cancel (a few rows, one
    # column) the relative tolerance grows by that over the sum's size.
    rows = np.asarray(dz).reshape(-1, y.shape[-1])
    spread = np.linalg.norm(np.sqrt(np.sum(rows**2, axis=0))) / max(np.linalg.norm(rows.sum(axis=0)), 1e-300)
    for name, g, want_g, primal in zip(("dx", "dw", "dbias"), vjp(ct), product_vjp(dz), args):
        assert g.dtype == primal.dtype, (name, g.dtype, primal.dtype)
        grad_tolerance = grad_tol or tolerance(dtype, grad=True)
        assert_close(g, want_g, grad_tolerance * (max(1.0, spread) if name == "dbias" else 1.0), name)


ACTIVATIONS = [None, "relu", "gelu", "silu", "leaky_relu"]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_forward_and_grad(dtype, activation, with_bias, rng):
    x, w, bias = _inputs(rng, (3, 37, 29), 19, dtype, with_bias)
    _check(activation, x, w, bias, rng)


# (x shape, N): sizes that are multiples of nothing, K = 1, N = 1, empty leading axes, K = 0 (the
# output is act(bias)), rank 1 x, several leading axes, a depth beyond one packed block (K > 256),
# rows beyond one CPU tile (M > 128) and columns beyond one (N > 256).
SHAPES = [((1, 1), 1), ((7, 1), 5), ((13, 5), 1), ((0, 8), 6), ((2, 0, 8), 6), ((4, 0), 3), ((33,), 10),
          ((2, 3, 4, 9), 7), ((5, 300), 17), ((530, 20), 9), ((3, 70), 260)]


@pytest.mark.parametrize("shape,n", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_shapes(shape, n, dtype, rng):
    x, w, bias = _inputs(rng, shape, n, dtype)
    _check("gelu", x, w, bias, rng)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_weight_gradient_split_over_rows(dtype, rng):
    """Many rows and a small w: dw is summed from slices of the rows (here 3 of 4098; the partial
    products are rounded to x's dtype, hence the wider bf16 tolerance)."""
    assert _row_slices(3 * 4098, 24, 9) == 3 and _row_slices(4097 * 2 + 1, 24, 9) == 1
    # float32 at TF32 on the streamed kernel: its own tiles (one 64 x 256 tile for a 1x1 64 -> 256
    # convolution's wgrad at N 128, 56^2; ten 128 x 128 for 516 x 132), slices of 1024 rows or more.
    assert _streamed_tiles(64, 256) == 1 and _streamed_tiles(256, 64) == 1 and _streamed_tiles(516, 132) == 10
    assert _row_slices(128 * 56 * 56, 64, 256, True) == 128 and _row_slices(4 * 1025, 24, 9, True) == 4
    x, w, bias = _inputs(rng, (2, 3 * 4098 // 2, 24), 9, dtype)
    hlo = jax.jit(jax.grad(lambda x, w: jnp.sum(jaxdnn.dense(x, w) ** 2), argnums=1)).lower(x, w).as_text()
    assert "tensor<3x4098x24x" in hlo
    _check("gelu", x, w, bias, rng, grad_tol=2 * tolerance(dtype, grad=True))


@pytest.mark.parametrize("dtype,preferred", [(jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float32),
                                             (jnp.bfloat16, jnp.float16)], ids=str)
def test_preferred_element_type_wider(dtype, preferred, rng):
    """A preferred float type at least as wide as 16-bit x and w: the result in it (the float32
    kernels on the widened operands: exact products, float32 sums and epilogue, rounded once), the
    gradients in the operands' dtypes."""
    x, w, bias = _inputs(rng, (3, 40, 64), 48, dtype, bias_dtype=dtype)

    def op(x, w, bias):
        return jaxdnn.dense(x, w, bias, activation="gelu", preferred_element_type=preferred)
    y, vjp = jax.vjp(jax.jit(op), x, w, bias)
    want, oracle_vjp = jax.vjp(_oracle("gelu"), f64(x), f64(w), f64(bias))
    assert y.dtype == jnp.dtype(preferred)
    assert_close(y, want, tolerance(preferred), "forward")
    ct = normal(rng, y.shape, preferred)
    for name, g, want_g, primal in zip(("dx", "dw", "dbias"), vjp(ct), oracle_vjp(f64(ct)), (x, w, bias)):
        assert g.dtype == primal.dtype, name
        assert_close(g, want_g, tolerance(dtype, grad=True), name)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_bias_in_x_dtype(dtype, rng):
    x, w, bias = _inputs(rng, (6, 11), 13, dtype, bias_dtype=dtype)
    _check("silu", x, w, bias, rng)


def test_leaky_relu_slope_and_every_epilogue(rng):
    """Every activation name the epilogue accepts (leaky_relu's and elu's parameters included)."""
    from jaxdnn.activation import EPILOGUES
    x, w, bias = _inputs(rng, (9, 12), 7)
    for activation in EPILOGUES:
        _check(activation, x, w, bias, rng)


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("batch", [1, 3])
def test_matmul_stage_transposes(trans_a, trans_b, batch, rng):
    """The kernel's op_a / op_b transposes, forward, VJP and second order, against jnp.matmul."""
    m, k, n = 7, 11, 5
    a = normal(rng, (batch, k, m) if trans_a else (batch, m, k))
    b = normal(rng, (batch, n, k) if trans_b else (batch, k, n))

    def oracle(a, b):
        return jnp.matmul(jnp.swapaxes(a, 1, 2) if trans_a else a, jnp.swapaxes(b, 1, 2) if trans_b else b)
    op = lambda a, b: _matmul(a, b, trans_a, trans_b, 0)  # noqa: E731
    assert_close(op(a, b), oracle(f64(a), f64(b)), 1e-5, "forward")
    if trans_a and trans_b:  # the target's own form of this layout (_matmul binds its transpose)
        assert_close(_gemm(a, b, None, 1, 1, 0), oracle(f64(a), f64(b)), 1e-5, "forward, both transposed")
    ct = normal(rng, (batch, m, n))

    def penalty(f, a, b):
        da, db = jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b)) * ct.astype(a.dtype)), argnums=(0, 1))(a, b)
        return jnp.sum(da ** 2) + jnp.sum(jnp.cos(db))
    got = jax.jit(jax.grad(functools.partial(penalty, op), argnums=(0, 1)))(a, b)
    want = jax.grad(functools.partial(penalty, oracle), argnums=(0, 1))(f64(a), f64(b))
    assert_close(got[0], want[0], 1e-5, "grad of grad a")
    assert_close(got[1], want[1], 1e-5, "grad of grad b")


# The CPU kernel in each build the CPU can run (JAXDNN_CPU_ISA caps the choice, made once per
# process): a child process per cap multiplies, in every transpose layout and in float32 and
# bfloat16, shapes with partial register tiles, several depth blocks, row tiles and column tiles,
# and runs a fused bias + silu; it reports the relative errors against float64.
_ISA_CHILD = """
import importlib, json, jax, jax.numpy as jnp, numpy as np
import jaxdnn
gemm = importlib.import_module("jaxdnn.dense")._gemm
errors = []
for i, (m, k, n) in enumerate([(19, 300, 45), (133, 20, 270), (1, 7, 3)]):
    for dtype in (jnp.float32, jnp.bfloat16):
        for trans_a, trans_b in ((0, 0), (0, 1), (1, 0), (1, 1)):
            ka, kb = jax.random.split(jax.random.key(i), 2)
            a = jax.random.normal(ka, (2, k, m) if trans_a else (2, m, k), dtype)
            b = jax.random.normal(kb, (2, n, k) if trans_b else (2, k, n), dtype)
            a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
            want = (a64.swapaxes(1, 2) if trans_a else a64) @ (b64.swapaxes(1, 2) if trans_b else b64)
            got = np.asarray(gemm(a, b, None, trans_a, trans_b, 0), np.float64)
            errors.append(float(np.linalg.norm(got - want) / np.linalg.norm(want)))
kx, kw, kb = jax.random.split(jax.random.key(9), 3)
x, w, bias = (jax.random.normal(key, shape, jnp.float32)
              for key, shape in ((kx, (37, 300)), (kw, (300, 70)), (kb, (70,))))
got = np.asarray(jaxdnn.dense(x, w, bias, activation="silu"), np.float64)
z = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(bias, np.float64)
want = z / (1 + np.exp(-z))
errors.append(float(np.linalg.norm(got - want) / np.linalg.norm(want)))
print(json.dumps({"isa": jaxdnn.cpu_isa(), "errors": errors}))
"""


@pytest.mark.skipif(on_gpu(), reason="the CPU kernel's builds")
@pytest.mark.parametrize("cap", ISA_ORDER)
def test_cpu_kernel_builds(cap):
    report = isa_child_report(_ISA_CHILD, cap)
    errors = report["errors"]
    assert len(errors) == 25
    for i, err in enumerate(errors[:-1]):  # float32 and bfloat16 alternate in blocks of 4 layouts
        assert err < tolerance(jnp.float32 if i // 4 % 2 == 0 else jnp.bfloat16), report
    assert errors[-1] < tolerance(jnp.float32), report


# --- precision: float32 operands as TF32 --------------------------------------------------------

# Operands rounded to TF32 (10 explicit mantissa bits), float32 sums: a few 2^-11 relative errors.
TF32_TOLERANCE = 2e-3


@pytest.mark.parametrize("precision,dtype,tf32", [
    (None, jnp.float32, 1), ("default", jnp.float32, 1), (jax.lax.Precision.HIGH, jnp.float32, 1),
    ("highest", jnp.float32, 0), ("F32_F32_F32", jnp.float32, 0), (None, jnp.bfloat16, 0)], ids=str)
def test_precision_sets_tf32_on_every_call(precision, dtype, tf32, rng):
    """The forward's and both gradients' GEMM calls carry the tf32 attribute that precision implies
    (JAX's default lets XLA's float32 dots use TF32 on a GPU; 16-bit operands are exact anyway)."""
    x, w, bias = _inputs(rng, (6, 16), 8, dtype)
    loss = lambda x, w, b: jnp.sum(jaxdnn.dense(x, w, b, activation="gelu", precision=precision) ** 2)  # noqa: E731
    with jax.default_matmul_precision(None):  # JAX's own default (this suite sets "highest")
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w, bias).as_text()
    assert hlo.count(f"@{TARGET}(") == 3 and hlo.count(f"tf32 = {tf32} : i64") == 3
    # Under jax_default_matmul_precision = "highest" (this suite's), precision None keeps them exact.
    if precision is None:
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w, bias).as_text()
        assert hlo.count("tf32 = 0 : i64") == 3


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_tf32_products_every_layout(trans_a, trans_b, rng):
    """float32 as TF32 on each operand layout (the tensor cores read TF32 operands K-major only:
    CUTLASS reads an M-major A through registers and transposes an N-major B in shared memory, and
    A K-major with B N-major runs as the transposed product; both transposed as the transpose of
    B . A): within TF32 rounding of the float64 product, and on a GPU not exact (the tensor cores
    ran); exact on CPU. Sizes are multiples of 4."""
    m, k, n, batch = 200, 136, 72, 2
    a = normal(rng, (batch, k, m) if trans_a else (batch, m, k))
    b = normal(rng, (batch, n, k) if trans_b else (batch, k, n))
    want = jnp.matmul(jnp.swapaxes(f64(a), 1, 2) if trans_a else f64(a),
                      jnp.swapaxes(f64(b), 1, 2) if trans_b else f64(b))
    err = rel_err(jax.jit(lambda a, b: _matmul(a, b, trans_a, trans_b, 1))(a, b), want)
    assert err <= (TF32_TOLERANCE if on_gpu() else 1e-6), err
    if on_gpu():
        assert err > 1e-6, f"exact float32 sums ({err}): the TF32 kernel did not run"


@pytest.mark.parametrize("m,n", [(64, 256), (200, 72), (300, 36), (516, 132), (30, 40)], ids=str)
@pytest.mark.parametrize("algorithm", [0, 4], ids=["heuristic", "streamed"])
def test_tf32_streamed_weight_gradient(m, n, algorithm, rng):
    """float32 a^T . b at TF32, the weight gradient's product, on the streamed kernel (gemm_streamed_tf32.cu)
    when the heuristic or the algorithm attribute picks it: its 64 x 256, 128 x 128 and 256 x 64
    tiles (the first four cases, ragged but for the first), K rows past a stage and not a multiple
    of one, 3 batch entries, a bias and an activation in the epilogue. Within TF32 rounding of the
    float64 product, and on a GPU not exact (the tensor cores ran); exact on CPU. (30, 40): M not
    a multiple of 4, which the CUDA-core kernel takes (exact)."""
    k, batch = 1000, 3
    a, b = normal(rng, (batch, k, m)), normal(rng, (batch, k, n))
    bias = normal(rng, (n,))
    attrs = dict(trans_a=np.int64(1), trans_b=np.int64(0), tf32=np.int64(1), algorithm=np.int64(algorithm),
                 **epilogue_attrs("gelu_tanh", 0.0))
    got = jax.jit(lambda a, b, bias: _GEMM["batched"].bind(a, b, bias, **attrs)[0])(a, b, bias)
    want = activation_fwd(jnp.einsum("lkm,lkn->lmn", f64(a), f64(b)) + f64(bias), "gelu_tanh", 0.0)
    err = rel_err(got, want)
    tensor_cores = on_gpu() and m % 4 == 0
    assert err <= (TF32_TOLERANCE if tensor_cores else 1e-6), err
    if tensor_cores:
        assert err > 1e-6, f"exact float32 sums ({err}): the TF32 kernel did not run"


@pytest.mark.parametrize("activation", [None, "gelu"], ids=str)
def test_tf32_forward_and_grad(activation, rng):
    """dense at JAX's default precision, forward and VJP, within TF32 rounding (exact on CPU)."""
    x, w, bias = _inputs(rng, (3, 64, 96), 40)
    with jax.default_matmul_precision(None):
        _check(activation, x, w, bias, rng, tol=TF32_TOLERANCE, grad_tol=10 * TF32_TOLERANCE)


# --- transforms -------------------------------------------------------------------------------

@pytest.mark.parametrize("x_axis,w_axis,bias_axis", [(0, None, None), (1, None, None), (None, 0, None),
                                                     (2, 1, None), (0, None, 0), (None, None, 0), (1, 2, 0)],
                         ids=str)
def test_vmap(x_axis, w_axis, bias_axis, rng):
    shapes = [[4, 6, 10], [10, 7], [7]]
    for shape, axis in zip(shapes, (x_axis, w_axis, bias_axis)):
        if axis is not None:
            shape.insert(axis, 3)
    x, w, bias = (normal(rng, shape) for shape in shapes)
    in_axes = (x_axis, w_axis, bias_axis)
    op, oracle = _op("relu"), _oracle("relu")
    got = jax.jit(jax.vmap(op, in_axes, out_axes=1))(x, w, bias)
    want = jax.vmap(oracle, in_axes, out_axes=1)(f64(x), f64(w), f64(bias))
    assert_close(got, want, 1e-5, "vmap")
    hlo = jax.jit(jax.vmap(op, in_axes)).lower(x, w, bias).as_text()
    assert hlo.count(f"@{TARGET}(") == 1 and "stablehlo.while" not in hlo  # one call, not a loop
    ct = normal(rng, want.shape)

    def grads(fn, x, w, bias, ct):
        loss = lambda x, w, b, c: jnp.sum(fn(x, w, b) * c)  # noqa: E731
        return jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes + (1,))(x, w, bias, ct)
    got = jax.jit(functools.partial(grads, _op("silu")))(x, w, bias, ct)
    want = grads(_oracle("silu"), f64(x), f64(w), f64(bias), f64(ct))
    for name, g, want_g in zip(("x", "w", "bias"), got, want):
        assert_close(g, want_g, 1e-5, f"vmap(grad) {name}")


@pytest.mark.parametrize("activation", [None, "gelu"], ids=str)
def test_grad_of_grad_runs_on_the_kernel(activation, rng):
    x, w, bias = _inputs(rng, (2, 5, 9), 6)
    ct = normal(rng, (2, 5, 6))

    def penalty(fn, x, w, bias):
        loss = lambda x, w, b: jnp.sum(jnp.sin(fn(x, w, b)) * ct.astype(x.dtype))  # noqa: E731
        dx, dw, db = jax.grad(loss, argnums=(0, 1, 2))(x, w, bias)
        return jnp.sum(dx ** 2) + jnp.sum(jnp.cos(dw)) + jnp.sum(db ** 3)
    grad = jax.jit(jax.grad(functools.partial(penalty, _op(activation)), argnums=(0, 1, 2)))
    want = jax.grad(functools.partial(penalty, _oracle(activation)), argnums=(0, 1, 2))(
        f64(x), f64(w), f64(bias))
    for name, g, want_g in zip(("x", "w", "bias"), grad(x, w, bias), want):
        assert_close(g, want_g, 1e-5, f"grad of grad {name}")
    hlo = grad.lower(x, w, bias).as_text()
    assert f"@{TARGET}(" in hlo and "stablehlo.dot_general" not in hlo


def test_checkpoint_scan_and_jvp(rng):
    x, w, bias = _inputs(rng, (3, 4, 8), 8)
    ct = normal(rng, x.shape)

    def scanned(fn, x, w, bias):
        step = lambda h, _: (jax.checkpoint(fn)(h, w, bias) * 1.5 - 0.2, None)  # noqa: E731
        h, _ = jax.lax.scan(step, x, None, length=3)
        return jnp.sum(h * ct.astype(h.dtype))
    got = jax.jit(jax.grad(functools.partial(scanned, _op("tanh")), argnums=(0, 1, 2)))(x, w, bias)
    want = jax.grad(functools.partial(scanned, _oracle("tanh")), argnums=(0, 1, 2))(f64(x), f64(w), f64(bias))
    for name, g, want_g in zip(("x", "w", "bias"), got, want):
        assert_close(g, want_g, 1e-4, f"scan(checkpoint) {name}")  # gradients: 10x (ARCHITECTURE.md)
    small = (x[0, :2], w[:, :3], bias[:3])
    jac = jax.jacrev(_op("silu"), argnums=(0, 1, 2))(*small)
    want_jac = jax.jacrev(_oracle("silu"), argnums=(0, 1, 2))(*(f64(a) for a in small))
    for g, want_g in zip(jac, want_jac):
        assert_close(g, want_g, 1e-5, "jacrev")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(_op(None), (x, w, bias), (x, w, bias))


def test_hlo_holds_the_custom_call(rng):
    x, w, bias = _inputs(rng, (3, 5, 16), 8)
    fwd = jax.jit(_op("gelu")).lower(x, w, bias).as_text()
    assert fwd.count(f"@{TARGET}(") == 1 and "jaxdnn_activation" not in fwd and "dot_general" not in fwd
    grad = jax.grad(lambda x, w, b: jnp.sum(_op("gelu")(x, w, b) ** 2), argnums=(0, 1, 2))
    hlo = jax.jit(grad).lower(x, w, bias).as_text()
    # z, dx and dw on the GEMM kernel, the activation on its kernel, its derivative and dbias on one
    assert hlo.count(f"@{TARGET}(") == 3 and "dot_general" not in hlo
    assert "jaxdnn_activation_fwd_v1" in hlo and hlo.count("@jaxdnn_activation_bwd_bias_v1(") == 1
    assert "jaxdnn_activation_bwd_v1" not in hlo


# --- sharding and export ----------------------------------------------------------------------

@pytest.mark.parametrize("mesh_kind", ["mesh", "auto", "explicit"])
def test_batch_sharded_runs_per_shard(mesh_kind, devices, rng):
    mesh = batch_mesh(mesh_kind, devices)
    rows = NamedSharding(mesh, P("b"))
    x, w, bias = _inputs(rng, (8, 3, 16), 12)
    x, ct = jax.device_put(x, rows), jax.device_put(normal(rng, (8, 3, 12)), rows)
    def train_step(x, w, b, ct):
        y, pullback = jax.vjp(_op("gelu"), x, w, b)
        return y, *pullback(ct)
    step = jax.jit(train_step)
    with jax.set_mesh(mesh) if mesh_kind == "explicit" else contextlib.nullcontext():
        hlo = step.lower(x, w, bias, ct).compile().as_text()
        y, dx, dw, dbias = step(x, w, bias, ct)
    assert "all-gather" not in hlo
    calls = [line for line in hlo.splitlines() if f'custom_call_target="{TARGET}"' in line]
    assert len(calls) == 3, calls
    # Each device: z [1, 6, 12] and dx [1, 6, 16] on its 2 x 3 rows, dw [1, 16, 12] from them (then
    # summed across the devices).
    results = sorted(line.split("=")[1].split("{")[0].strip() for line in calls)
    assert results == ["f32[1,16,12]", "f32[1,6,12]", "f32[1,6,16]"], calls
    want_y, pullback = jax.vjp(_oracle("gelu"), *(f64(np.asarray(a)) for a in (x, w, bias)))
    assert_close(y, want_y, 1e-5, "sharded forward")
    for name, g, want_g in zip(("x", "w", "bias"), (dx, dw, dbias), pullback(f64(np.asarray(ct)))):
        assert_close(g, want_g, 1e-5, f"sharded grad {name}")
    assert y.sharding.spec[0] == "b" and dx.sharding.spec[0] == "b"


def test_shard_map_grad(devices, rng):
    mesh = batch_mesh("mesh", devices)
    x, w, bias = _inputs(rng, (8, 5), 3)
    ct = normal(rng, (8, 3))
    per_shard = jax.shard_map(lambda x, w, b, ct: jax.vjp(_op("relu"), x, w, b)[1](ct), mesh=mesh,
                              in_specs=(P("b"), P(), P(), P("b")), out_specs=(P("b"), P(), P()))
    got = jax.jit(per_shard)(x, w, bias, ct)
    want = jax.vjp(_oracle("relu"), f64(x), f64(w), f64(bias))[1](f64(ct))
    for name, g, want_g in zip(("x", "w (summed over the shards)", "bias"), got, want):
        assert_close(g, want_g, 1e-5, f"shard_map grad {name}")


def test_export_round_trip(rng):
    x, w, bias = _inputs(rng, (3, 4, 9), 5)
    f = jax.jit(jax.grad(lambda x, w, b: jnp.sum(_op("silu")(x, w, b) ** 2), argnums=(0, 1, 2)))
    exported = export.export(f, disabled_checks=jaxdnn.export_safety_checks())(x, w, bias)
    assert f"@{TARGET}(" in exported.mlir_module() and TARGET in jaxdnn.target_names()
    restored = export.deserialize(exported.serialize())
    for got, want in zip(restored.call(x, w, bias), f(x, w, bias)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_batch_polymorphic_export(rng):
    batch, = export.symbolic_shape("batch")
    _, w, bias = _inputs(rng, (1, 6), 4)
    exported = export.export(jax.jit(_op("relu")), disabled_checks=jaxdnn.export_safety_checks())(
        jax.ShapeDtypeStruct((batch, 3, 6), jnp.float32), w, bias)
    restored = export.deserialize(exported.serialize())
    x = normal(rng, (5, 3, 6))
    for rows in (5, 1):
        want = _oracle("relu")(f64(x[:rows]), f64(w), f64(bias))
        assert_close(restored.call(x[:rows], w, bias), want, 1e-5, f"batch={rows}")


# --- errors -----------------------------------------------------------------------------------

X, W = ((4, 6), jnp.float32), ((6, 3), jnp.float32)


@pytest.mark.parametrize("x,w,bias,kwargs,error,message", [
    (((4, 5), jnp.float32), W, None, {}, ValueError,
     r"dense: K mismatch: x's last axis has 5 features, w's first 6 \(x shape \(4, 5\), w shape \(6, 3\)\)"),
    (X, W, ((4,), jnp.float32), {}, ValueError,
     r"dense: bias must have shape \(N,\) = \(3,\) to match w shape \(6, 3\), got bias shape \(4,\)"),
    (X, W, ((1, 3), jnp.float32), {}, ValueError,
     r"dense: bias must have shape \(N,\) .* got bias shape \(1, 3\)"),
    (((4, 6), jnp.int32), ((6, 3), jnp.int32), None, {}, TypeError,
     "dense: x must be float32, bfloat16 or float16, got int32"),
    (X, ((6, 3), jnp.float64), None, {}, TypeError,
     "dense: w must be float32, bfloat16 or float16, got float64"),
    (X, ((6, 3), jnp.bfloat16), None, {}, TypeError,
     "dense: x and w must have the same dtype, got float32 and bfloat16"),
    (((4, 6), jnp.bfloat16), ((6, 3), jnp.bfloat16), ((3,), jnp.float16), {}, TypeError,
     "dense: bias must be float32 or x's dtype bfloat16, got float16"),
    (X, ((6, 3, 1), jnp.float32), None, {}, ValueError,
     r"dense: w must have shape \[K, N\] \(rank 2\), got shape"),
    (((), jnp.float32), W, None, {}, ValueError, r"dense: x must have shape \[\.\.\., K\] \(rank >= 1\)"),
    (X, W, None, dict(activation="swish"), ValueError, "dense: activation must be None or one of"),
    (X, W, None, dict(preferred_element_type=jnp.bfloat16), TypeError,
     "dense: preferred_element_type must not be narrower than the operands' dtype float32, got bfloat16"),
    (X, W, None, dict(preferred_element_type=jnp.int32), TypeError,
     "dense: preferred_element_type must be None, float32, bfloat16 or float16 for float32 operands"),
], ids=["k-mismatch", "bias-shape", "bias-rank", "int", "float64", "mixed-dtypes", "bias-dtype", "w-rank",
        "x-rank0", "activation", "preferred-narrower", "preferred-int"])
@pytest.mark.parametrize("under_jit", [False, True], ids=["eager", "jit"])
def test_bad_input(x, w, bias, kwargs, error, message, under_jit):
    args = [None if spec is None else jnp.ones(*spec) for spec in (x, w, bias)]
    call = lambda x, w, bias: jaxdnn.dense(x, w, bias, **kwargs)  # noqa: E731
    with pytest.raises(error, match=message):
        if under_jit:  # validation happens at trace time, on abstract values
            jax.jit(call).lower(*args)
        else:
            call(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_compiled_gpu_hlo_and_large_shapes(dtype, rng):
    """The CUDA kernel on tile-sized and ragged shapes (several tiles, K beyond one stage)."""
    assert jaxdnn.has_cuda_kernels(), "running on a GPU but jaxdnn was built without CUDA"
    for shape, n in (((4, 256, 512), 384), ((1000, 1000), 1000), ((3, 67, 129), 131)):
        x, w, bias = _inputs(rng, shape, n, dtype)
        _check("gelu", x, w, bias, rng)
    compiled = jax.jit(_op("gelu")).lower(x, w, bias).compile().as_text()
    assert f'custom_call_target="{TARGET}"' in compiled
