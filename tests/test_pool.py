"""max_pool and avg_pool against flax.linen's in float64: forward, gradients (ties and NaNs sent
where JAX sends them), 1-D/2-D/3-D windows and every padding, transforms, sharding, export, errors,
and the custom calls in the HLO."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax import export
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdnn
from helpers import DTYPES, assert_close, batch_mesh, dtype_id, f64, normal, tolerance

# name -> (jaxdnn function, flax oracle), the same arguments (inputs, window_shape, strides, padding).
OPS = {
    "max_pool": (jaxdnn.max_pool, nn.max_pool),
    "avg_pool": (jaxdnn.avg_pool, nn.avg_pool),
    "avg_pool_exclude_pad": (lambda *a: jaxdnn.avg_pool(*a, count_include_pad=False),
                             lambda *a: nn.avg_pool(*a, count_include_pad=False)),
}
op_param = pytest.mark.parametrize("name", OPS)
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)

# (inputs shape, window_shape, strides, padding). Channel counts with and without a 16-byte vector
# path (and a scalar tail on CPU; 72 for the CPU backward's groups of 64, then 8), strides above and
# below the window, one window of more than 256 elements (int32 argmax), an empty batch, no batch
# axis and two batch axes. 3x3 and 2x2 windows of stride 2 have their own unrolled kernels
# (pool_window.h's SquareWindow): odd sizes and uneven padding check their clamped loads. The
# largest case spreads its rows over more than one chunk of the CPU's threads.
CASES = [
    ((2, 11, 10, 64), (3, 3), (2, 2), "SAME"),
    ((3, 9, 8, 3), (3, 3), (2, 2), "SAME"),
    ((2, 7, 9, 17), (2, 3), None, "VALID"),
    ((2, 8, 8, 8), (3, 2), (1, 3), ((1, 2), (0, 1))),
    ((2, 13, 5), (4,), (3,), "SAME"),
    ((3, 10, 16), (2,), (2,), "VALID"),
    ((2, 5, 6, 7, 9), (2, 3, 2), (1, 2, 2), ((1, 0), (1, 1), (0, 2))),
    ((1, 4, 5, 6, 16), (3, 3, 3), (2, 2, 2), "SAME"),
    ((1, 19, 18, 4), (17, 16), (2, 1), "VALID"),
    ((0, 6, 6, 8), (2, 2), (2, 2), "VALID"),
    ((9, 10, 5), (3, 3), (2, 2), "SAME"),
    ((2, 3, 7, 6, 4), (3, 2), (2, 2), "SAME"),
    ((2, 6, 6, 5), (1, 1), (3, 2), "VALID"),
    ((2, 7, 9, 16), (2, 2), (2, 2), "SAME"),
    ((1, 10, 11, 8), (3, 3), (2, 2), ((0, 2), (1, 0))),
    ((2, 7, 6, 72), (2, 3), (1, 2), "SAME"),
    ((4, 34, 34, 72), (3, 3), (2, 2), "SAME"),
]
case_param = pytest.mark.parametrize("shape,window,strides,padding", CASES, ids=str)


def _call(fn, window, strides, padding):
    return lambda x: fn(x, window, strides, padding)


def _oracle(name, x, window, strides, padding, cotangent=None):
    """flax's output on x in float64, and its VJP for `cotangent`."""
    y, pullback = jax.vjp(_call(OPS[name][1], window, strides, padding), f64(x))
    return y, None if cotangent is None else pullback(f64(cotangent))[0]


@op_param
@dtype_param
@case_param
def test_forward_and_grad(name, dtype, shape, window, strides, padding, rng):
    op = _call(OPS[name][0], window, strides, padding)
    x = normal(rng, shape, dtype, loc=0.5, scale=2.0)
    y = jax.jit(op)(x)
    want_y, _ = _oracle(name, x, window, strides, padding)
    assert y.shape == want_y.shape and y.dtype == x.dtype
    assert_close(y, want_y, tolerance(dtype), f"{name} forward")
    cotangent = normal(rng, y.shape, dtype)
    dx = jax.jit(lambda x, ct: jax.vjp(op, x)[1](ct)[0])(x, cotangent)
    _, want_dx = _oracle(name, x, window, strides, padding, cotangent)
    assert dx.dtype == x.dtype
    assert_close(dx, want_dx, tolerance(dtype, grad=True), f"{name} grad")


@dtype_param
@pytest.mark.parametrize("window,strides,padding", [((3, 3), (2, 2), "SAME"), ((2, 3), (1, 1), "VALID"),
                                                    ((3, 3), (1, 1), ((1, 1), (2, 0)))], ids=str)
def test_max_pool_ties_go_where_jax_sends_them(dtype, window, strides, padding, rng):
    """Small integers tie often inside a window: the gradient must pick the same element as JAX's
    (the first maximal one in the window's row-major order), exactly."""
    x = jnp.asarray(rng.integers(0, 3, size=(2, 9, 10, 16)), dtype)
    op = _call(jaxdnn.max_pool, window, strides, padding)
    flax_op = _call(nn.max_pool, window, strides, padding)
    y = op(x)
    cotangent = jnp.asarray(rng.integers(1, 8, size=y.shape), jnp.float32)
    got = jax.vjp(op, x.astype(jnp.float32))[1](cotangent)[0]
    want = jax.vjp(flax_op, x.astype(jnp.float32))[1](cotangent)[0]
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(flax_op(x), np.float32))
    np.testing.assert_array_equal(got, want)  # integer sums: exact whatever the order
    got16 = jax.vjp(op, x)[1](cotangent.astype(dtype))[0]
    assert_close(got16, want, tolerance(dtype, grad=True), "16-bit grad with ties")


def test_max_pool_nan_and_all_padding_windows_match_jax(rng):
    x = np.array(normal(rng, (2, 7, 6, 8)))
    x[0, 2, 3, ::2] = np.nan
    x[1, 4, :, 1] = np.nan
    x = jnp.asarray(x)
    # pads of 3 with a 3-wide window: the first and last windows lie entirely in the padding (-inf).
    for window, strides, padding in [((3, 3), (1, 1), "SAME"), ((3, 3), (2, 2), ((3, 3), (0, 1)))]:
        op = _call(jaxdnn.max_pool, window, strides, padding)
        flax_op = _call(nn.max_pool, window, strides, padding)
        y, pullback = jax.vjp(op, x)
        want_y, want_pullback = jax.vjp(flax_op, x)
        np.testing.assert_array_equal(y, want_y)
        cotangent = jnp.asarray(rng.integers(1, 8, size=y.shape), jnp.float32)
        np.testing.assert_array_equal(pullback(cotangent)[0], want_pullback(cotangent)[0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=dtype_id)
def test_max_pool_16_bit_is_the_float32_result_on_ties_and_nans(dtype, rng):
    """The CUDA kernels compare 16-bit inputs two lanes at a time for 3x3 and 2x2 stride-2 windows;
    on the same values, outputs and gradients must be the float32 path's (checked against JAX above),
    exactly: ties, NaNs, windows entirely in the padding."""
    x = rng.integers(-3, 4, size=(2, 9, 8, 16)).astype(np.float32)  # small integers: many ties
    x[0, 2, 3, ::3] = np.nan
    x[1, 5, :, 1] = np.nan
    for window, strides, padding in [((3, 3), (2, 2), "SAME"), ((3, 3), (2, 2), ((3, 3), (0, 1))),
                                     ((2, 2), (2, 2), "VALID")]:
        op = _call(jaxdnn.max_pool, window, strides, padding)
        y, pullback = jax.vjp(op, jnp.asarray(x, dtype))
        want_y, want_pullback = jax.vjp(op, jnp.asarray(x))
        np.testing.assert_array_equal(np.asarray(y, np.float32), want_y)
        cotangent = rng.integers(1, 8, size=y.shape).astype(np.float32)  # sums stay exact in 16 bits
        np.testing.assert_array_equal(np.asarray(pullback(jnp.asarray(cotangent, dtype))[0], np.float32),
                                      want_pullback(jnp.asarray(cotangent))[0])


def test_avg_pool_all_padding_window_is_nan_as_flax(rng):
    x = normal(rng, (2, 5, 4))
    padding = ((3, 3),)
    got = jaxdnn.avg_pool(x, (3,), (1,), padding, count_include_pad=False)
    want = nn.avg_pool(x, (3,), (1,), padding, count_include_pad=False)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got).any()
    assert_close(jnp.nan_to_num(got), jnp.nan_to_num(want), 1e-6, "finite part")


@op_param
def test_transforms(name, rng):
    fn, oracle = OPS[name]
    window, strides, padding = (3, 3), (1, 1), "SAME"  # shape-preserving, so it can run in a scan
    op, oracle_op = _call(fn, window, strides, padding), _call(oracle, window, strides, padding)
    x = normal(rng, (4, 3, 7, 6, 5), scale=2.0)  # vmapped axis 1 of 4, then a (3, 7, 6, 5) batch
    ct = normal(rng, x.shape)
    assert_close(jax.vmap(op, in_axes=1, out_axes=1)(x), jax.vmap(oracle_op, in_axes=1, out_axes=1)(f64(x)),
                 1e-5, "vmap")
    per_example = jax.vmap(jax.grad(lambda x, c: jnp.sum(op(x) * c)), in_axes=(1, None))(x, ct[:, 0])
    want = jax.vmap(jax.grad(lambda x, c: jnp.sum(oracle_op(x) * c)), in_axes=(1, None))(f64(x),
                                                                                      f64(ct[:, 0]))
    assert_close(per_example, want, 1e-5, "vmap(grad), unbatched cotangent")

    def penalty(f, x):
        return jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)) * ct.astype(x.dtype)))(x) ** 2)
    assert_close(jax.grad(lambda x: penalty(op, x))(x), jax.grad(lambda x: penalty(oracle_op, x))(f64(x)),
                 1e-5, "grad of grad")

    def scanned(f, x):
        h, _ = jax.lax.scan(lambda h, _: (jax.checkpoint(f)(h) * 1.5 - 0.2, None), x, None, length=3)
        return jnp.sum(h * ct.astype(h.dtype))
    assert_close(jax.grad(lambda x: scanned(op, x))(x), jax.grad(lambda x: scanned(oracle_op, x))(f64(x)),
                 1e-5, "scan(checkpoint)")
    small = x[0, :1, :4, :3, :2]
    assert_close(jax.jacrev(op)(small), jax.jacrev(oracle_op)(f64(small)), 1e-6, "jacrev")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(op, (x,), (ct,))


def test_avg_pool_third_order_runs_on_the_kernels(rng):
    """Average pooling is linear: its stages are each other's VJP, with no reference in between."""
    x = normal(rng, (2, 6, 5, 3))
    op = _call(jaxdnn.avg_pool, (2, 3), (2, 1), "SAME")
    oracle = _call(nn.avg_pool, (2, 3), (2, 1), "SAME")
    def third(f):
        return jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jax.grad(
            lambda x: jnp.sum(f(x) ** 3))(x) ** 2))(x) * x))
    assert_close(third(op)(x), third(oracle)(f64(x)), 1e-5, "third order")
    hlo = jax.jit(third(op)).lower(x).as_text()
    assert "jaxdnn_avg_pool_fwd_v1" in hlo and "jaxdnn_avg_pool_bwd_v1" in hlo
    assert "reduce_window" not in hlo


def test_hlo_holds_the_custom_calls(rng):
    x = normal(rng, (2, 8, 8, 16))
    infer_hlo = jax.jit(lambda x: jaxdnn.max_pool(x, (3, 3), (2, 2), "SAME")).lower(x).as_text()
    assert "jaxdnn_max_pool_infer_v1" in infer_hlo and "jaxdnn_max_pool_fwd_v1" not in infer_hlo
    grad_hlo = jax.jit(jax.grad(lambda x: jnp.sum(jaxdnn.max_pool(x, (3, 3), (2, 2), "SAME") ** 2))).lower(
        x).as_text()
    assert "jaxdnn_max_pool_fwd_v1" in grad_hlo and "jaxdnn_max_pool_bwd_v1" in grad_hlo
    assert "select_and_scatter" not in grad_hlo and "reduce_window" not in grad_hlo
    grad_hlo = jax.jit(jax.grad(lambda x: jnp.sum(jaxdnn.avg_pool(x, (3, 3)) ** 2))).lower(x).as_text()
    assert "jaxdnn_avg_pool_fwd_v1" in grad_hlo and "jaxdnn_avg_pool_bwd_v1" in grad_hlo


def test_argmax_is_uint8_up_to_256_window_elements(rng):
    for window, dtype in [((16, 16), "ui8"), ((17, 16), "i32")]:
        x = normal(rng, (1, 20, 20, 4))
        hlo = jax.jit(jax.grad(lambda x: jnp.sum(jaxdnn.max_pool(x, window)))).lower(x).as_text()
        fwd = [line for line in hlo.splitlines() if "jaxdnn_max_pool_fwd_v1" in line]
        assert fwd and all(f"x{21 - window[0]}x{21 - window[1]}x4x{dtype}>" in line for line in fwd)


@pytest.mark.parametrize("x_shape,window,operand", [
    ((2, 3, 9, 10, 4), (3, 3), "6x9x10x4"),  # two batch axes: 6 images in the D axis
    ((2, 40, 4), (3,), "1x2x40x4"),  # 1-D: the images in the H axis
    ((2, 5, 9, 10, 4), (3, 3, 3), "2x5x9x10x4"),  # 3-D: the kernels' form
], ids=str)
def test_cpu_view_puts_the_images_in_a_unit_axis(x_shape, window, operand, rng):
    """Lowered for the CPU, the stages take a 1-D or 2-D window's arrays with the images in an axis
    the window does not span (no unit axis after the rows, which made XLA:CPU copy x on every call);
    a 3-D window's as they are."""
    x = normal(rng, x_shape)
    f = jax.jit(jax.grad(lambda x: jnp.sum(jaxdnn.max_pool(x, window, padding="SAME") ** 2)))
    hlo = f.trace(x).lower(lowering_platforms=("cpu",)).as_text()
    calls = [line for line in hlo.splitlines() if "stablehlo.custom_call @jaxdnn_max_pool" in line]
    assert len(calls) == 2 and all(f"tensor<{operand}xf32>" in line for line in calls), calls


@op_param
@pytest.mark.parametrize("mesh_kind", ["mesh", "auto", "explicit"])
def test_batch_sharded_runs_per_shard(name, mesh_kind, devices, rng):
    fn = OPS[name][0]
    mesh = batch_mesh(mesh_kind, devices)
    op = _call(fn, (3, 3), (2, 2), "SAME")
    x = jax.device_put(normal(rng, (8, 9, 10, 16)), NamedSharding(mesh, P("b")))
    ct = jax.device_put(normal(rng, (8, 5, 5, 16)), NamedSharding(mesh, P("b")))
    step = jax.jit(lambda x, ct: (lambda y, pullback: (y, pullback(ct)[0]))(*jax.vjp(op, x)))
    with jax.set_mesh(mesh) if mesh_kind == "explicit" else contextlib.nullcontext():
        hlo = step.lower(x, ct).compile().as_text()
        y, got = step(x, ct)
    assert "all-gather" not in hlo
    calls = [line for line in hlo.splitlines() if 'custom_call_target="jaxdnn_' in line]
    assert len(calls) == 2, calls
    # Every stage reads or writes x's per-shard [2, 1, 9, 10, 16] (the kernels' 3-D form), which the
    # CPU devices of these tests take as [2, 9, 10, 16] (the images in the D axis: _rows_as_spatial)
    shard = "f32[2,9,10,16]"
    assert all(shard in line for line in calls), calls
    want_y, want = _oracle(name, np.asarray(x), (3, 3), (2, 2), "SAME", np.asarray(ct))  # unsharded
    assert_close(y, want_y, 1e-6, "sharded forward")
    assert_close(got, want, 1e-5, "sharded grad")
    assert got.sharding.spec[0] == "b" and y.sharding.spec[0] == "b"


@op_param
def test_shard_map_grad(name, devices, rng):
    mesh = batch_mesh("mesh", devices)
    fn = OPS[name][0]
    op = _call(fn, (2, 2), (2, 2), "VALID")
    x = jax.device_put(normal(rng, (8, 6, 4, 8)), NamedSharding(mesh, P("b")))
    ct = jax.device_put(normal(rng, (8, 3, 2, 8)), NamedSharding(mesh, P("b")))
    per_shard = jax.shard_map(lambda x, ct: jax.vjp(op, x)[1](ct)[0], mesh=mesh, in_specs=(P("b"), P("b")),
                              out_specs=P("b"))
    _, want = _oracle(name, x, (2, 2), (2, 2), "VALID", ct)
    assert_close(jax.jit(per_shard)(x, ct), want, 1e-5, "shard_map grad")


@op_param
def test_export_round_trip(name, rng):
    fn = OPS[name][0]
    x = normal(rng, (3, 9, 8, 5))
    f = jax.jit(jax.grad(lambda x: jnp.sum(fn(x, (3, 3), (2, 2), "SAME") ** 2)))
    exported = export.export(f, disabled_checks=jaxdnn.export_safety_checks())(x)
    restored = export.deserialize(exported.serialize())
    np.testing.assert_allclose(restored.call(x), f(x), rtol=1e-6)


@op_param
def test_batch_polymorphic_export(name, rng):
    fn = OPS[name][0]
    batch, = export.symbolic_shape("batch")
    op = _call(fn, (3, 2), (2, 2), "SAME")
    exported = export.export(jax.jit(op), disabled_checks=jaxdnn.export_safety_checks())(
        jax.ShapeDtypeStruct((batch, 7, 6, 4), jnp.float32))
    restored = export.deserialize(exported.serialize())
    x = normal(rng, (5, 7, 6, 4))
    for rows in (5, 1):
        assert_close(restored.call(x[:rows]), _oracle(name, x[:rows], (3, 2), (2, 2), "SAME")[0], 1e-6,
                     f"batch={rows}")


X = (2, 5, 5, 3)


@pytest.mark.parametrize("fn", [jaxdnn.max_pool, jaxdnn.avg_pool], ids=["max_pool", "avg_pool"])
@pytest.mark.parametrize("args,error,message", [
    ((X, jnp.int32, (2, 2)), TypeError, "inputs must be float32, bfloat16 or float16, got int32"),
    ((X, jnp.float64, (2, 2)), TypeError, "got float64"),
    ((X, jnp.float32, (6, 2)), ValueError, r"window_shape\[0\] = 6 is larger than the padded input"),
    ((X, jnp.float32, (2, 2), None, ((0, 0), (0, 0), (0, 0))), ValueError, "2 \\(low, high\\) pairs"),
    ((X, jnp.float32, (2, 2), None, ((0, -1), (0, 0))), ValueError, "padding must be >= 0"),
    ((X, jnp.float32, (2, 2), None, "FULL"), ValueError, "padding must be 'SAME', 'VALID'"),
    ((X, jnp.float32, (2, 2), None, 3), TypeError, "padding must be"),
    ((X, jnp.float32, (2, 2), (1,)), ValueError, "strides must have 2 entries"),
    ((X, jnp.float32, (2, 2), (0, 1)), ValueError, "strides entries must be >= 1"),
    ((X, jnp.float32, (0, 2)), ValueError, "window_shape entries must be >= 1"),
    ((X, jnp.float32, (2, 2, 2, 2)), ValueError, "window_shape must be a sequence of 1 to 3"),
    ((X, jnp.float32, 2), ValueError, "window_shape must be a sequence"),
    (((5, 3), jnp.float32, (2, 2)), ValueError, r"inputs must have shape \(batch..., 2 spatial axes"),
    ((X, jnp.float32, (2.5, 2)), TypeError, "window_shape must be a sequence of ints"),
], ids=["int", "float64", "window-too-large", "padding-pairs", "negative-pad", "padding-name",
        "padding-type", "strides-length", "zero-stride", "zero-window", "rank-4-window", "int-window", "rank",
        "float-window"])
def test_bad_input(fn, args, error, message):
    shape, dtype, window, *rest = args
    with pytest.raises(error, match=message):
        fn(jnp.ones(shape, dtype), window, *rest)


def test_bad_count_include_pad():
    with pytest.raises(TypeError, match="count_include_pad must be a bool"):
        jaxdnn.avg_pool(jnp.ones((1, 4, 4, 2)), (2, 2), count_include_pad="yes")
