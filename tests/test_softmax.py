"""softmax and log_softmax against jax.nn in float64: forward, gradients, any axis, transforms,
sharding, export, errors, and the custom calls in the HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdnn
from jaxdnn import reference
from helpers import DTYPES, assert_close, dtype_id, f64, normal, tolerance

# (jaxdnn op, jax.nn op, log?) for both ops.
OPS = [(jaxdnn.softmax, jax.nn.softmax, False), (jaxdnn.log_softmax, jax.nn.log_softmax, True)]
op_param = pytest.mark.parametrize("op,oracle,log", OPS, ids=["softmax", "log_softmax"])
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)

# Row lengths reach every CUDA path: a warp per row, a block per row, and the streaming kernel
# (unaligned rows, and rows longer than the registers hold, up to 256k).
SHAPES = [(1, 1), (7, 1), (33,), (3, 5, 37), (2, 0, 16), (0, 8), (4, 1000), (64, 1024), (3, 4096),
          (2, 4100), (2, 32768), (1, 65536), (1, 262144), (2, 3, 2, 33)]


def _oracle_vjp(oracle, x, axis, cotangent):
    return jax.vjp(lambda x: oracle(x, axis), f64(x))[1](f64(cotangent))[0]


@op_param
@dtype_param
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_grad(op, oracle, log, dtype, shape, rng):
    x = normal(rng, shape, dtype, loc=1.0, scale=3.0)
    y = jax.jit(op)(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, oracle(f64(x)), tolerance(dtype), f"{op.__name__} forward")
    cotangent = normal(rng, shape, dtype)
    dx = jax.jit(lambda x, ct: jax.vjp(op, x)[1](ct)[0])(x, cotangent)
    assert dx.dtype == x.dtype
    # The exact VJP at the forward's output as stored (the backward's input): in 16 bits, the rounding
    # of a peaked row's y alone moves y * (dy - sum(y dy)) by up to ~30% of its small norm (bfloat16,
    # 33 logits of scale 3), which is the forward's error, checked above, not the backward's.
    assert_close(dx, reference.softmax_bwd(f64(cotangent), f64(y), log), tolerance(dtype, grad=True),
                 f"{op.__name__} grad")
    at_exact_output = reference.softmax_bwd(f64(cotangent), oracle(f64(x)), log)
    assert_close(at_exact_output, _oracle_vjp(oracle, x, -1, cotangent), 1e-12, "VJP at the output")


@op_param
@pytest.mark.parametrize("axis", [0, 1, -2, (1,), (0, 2), (2, 0), (-1, 1), (0, 1, 2), None, ()], ids=str)
def test_any_axis(op, oracle, log, axis, rng):
    """One axis, several (merged into one row: (0, 2) and (2, 0) are the same rows), all (None), or
    none (each entry its own row), as jax.nn's."""
    x = normal(rng, (6, 5, 130), jnp.float32, scale=2.0)
    cotangent = normal(rng, x.shape)
    assert_close(op(x, axis), oracle(f64(x), axis), tolerance(jnp.float32), "forward")
    dx = jax.vjp(lambda x: op(x, axis), x)[1](cotangent)[0]
    assert_close(dx, _oracle_vjp(oracle, x, axis, cotangent), tolerance(jnp.float32, grad=True), "grad")


@op_param
def test_where_over_several_axes(op, oracle, log, rng):
    """`where` with axes (0, 2) merged into rows: the lane at index 0 of axis 1 has no entry inside."""
    x = normal(rng, (5, 3, 40), jnp.float32, scale=3.0)
    mask = rng.random(x.shape) < 0.6
    mask[:, 0, :] = False
    mask = jnp.asarray(mask)
    y = jax.jit(lambda x, m: op(x, (0, 2), where=m))(x, mask)
    want = oracle(f64(x), (0, 2), where=mask)
    np.testing.assert_array_equal(np.asarray(y)[~np.asarray(mask)], -np.inf if log else 0.0)
    assert_close(jnp.where(mask, y, 0), jnp.where(mask, want, 0), tolerance(jnp.float32), "forward")
    cotangent = jnp.where(mask, normal(rng, x.shape), 0)
    dx = jax.vjp(lambda x: op(x, (0, 2), where=mask), x)[1](cotangent)[0]
    want_dx = jax.vjp(lambda x: oracle(x, (0, 2), where=mask), f64(x))[1](f64(cotangent))[0]
    assert_close(dx, want_dx, tolerance(jnp.float32, grad=True), "grad")


@op_param
def test_masked_rows_with_minus_infinity(op, oracle, log, rng):
    """Masked logits (-inf) get probability 0; a row with one unmasked logit gives exactly 1 there."""
    x = np.array(normal(rng, (8, 96), jnp.float32))
    x[:, ::3] = -np.inf
    x[0, 2:] = -np.inf  # row 0: only column 1 is left
    x = jnp.asarray(x)
    y = op(x)
    want = oracle(f64(x))
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(y)), finite)
    assert_close(jnp.where(finite, y, 0), jnp.where(finite, want, 0), tolerance(jnp.float32), "forward")
    if not log:
        np.testing.assert_array_equal(np.asarray(y)[:, ::3], 0.0)
        assert float(y[0, 1]) == 1.0


@op_param
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("axis,mask_shape",
                         [(-1, (5, 3, 70)), (-1, (1, 3, 70)), (1, (5, 3, 1)), (0, (5, 1, 70))],
                         ids=["full", "broadcast-rows", "axis1-broadcast", "axis0"])
def test_where(op, oracle, log, dtype, axis, mask_shape, rng):
    """jax.nn's `where`: the mask (broadcast to x) selects the entries normalized over; the others
    give 0 (softmax) or -inf (log_softmax) and no gradient. Some rows are fully masked out."""
    x = normal(rng, (5, 3, 70), dtype, scale=3.0)
    mask = rng.random(mask_shape) < 0.6
    empty = [0, 0, 0]  # the lane at index 0 of the other axes: no entry inside
    empty[axis] = slice(None)
    mask[tuple(empty)] = False
    mask = jnp.asarray(mask)
    y = jax.jit(lambda x, m: op(x, axis, where=m))(x, mask)
    want = oracle(f64(x), axis, where=mask)
    inside = np.broadcast_to(np.asarray(mask), x.shape)
    assert not inside[tuple(empty)].any() and inside.any(axis=axis).any()
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y, np.float64)[~inside], -np.inf if log else 0.0)
    assert_close(jnp.where(inside, y, 0), jnp.where(inside, want, 0), tolerance(dtype), "forward")
    cotangent = jnp.where(inside, normal(rng, x.shape, dtype), 0)  # finite where y is -inf
    dx = jax.jit(lambda x, m, ct: jax.vjp(lambda x: op(x, axis, where=m), x)[1](ct)[0])(x, mask, cotangent)
    want_dx = jax.vjp(lambda x: oracle(x, axis, where=mask), f64(x))[1](f64(cotangent))[0]
    assert np.all(np.isfinite(np.asarray(dx, np.float64)))
    np.testing.assert_array_equal(np.asarray(dx, np.float64)[~inside], 0.0)
    assert_close(dx, jnp.where(inside, want_dx, 0), tolerance(dtype, grad=True), "grad")


@op_param
def test_large_logits_do_not_overflow(op, oracle, log, rng):
    x = normal(rng, (4, 300), jnp.float32, loc=5e3, scale=50.0)
    assert_close(op(x), oracle(f64(x)), tolerance(jnp.float32), "forward")


@op_param
def test_transforms(op, oracle, log, rng):
    x = normal(rng, (4, 3, 40), jnp.float32)
    ct = normal(rng, x.shape)
    # vmap over a non-leading axis, and per-example gradients
    assert_close(jax.vmap(op, in_axes=1, out_axes=1)(x), oracle(f64(x)), 1e-5, "vmap")
    per_example = jax.vmap(jax.grad(lambda x, c: jnp.sum(op(x) * c)), in_axes=(0, 0))(x, ct)
    want = jax.vmap(jax.grad(lambda x, c: jnp.sum(oracle(x) * c)), in_axes=(0, 0))(f64(x), f64(ct))
    assert_close(per_example, want, 1e-4, "vmap(grad)")
    # grad of grad (a gradient penalty)
    def penalty(f, x):
        return jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)) * ct.astype(x.dtype)))(x) ** 2)
    assert_close(jax.grad(lambda x: penalty(op, x))(x), jax.grad(lambda x: penalty(oracle, x))(f64(x)),
                 1e-4, "grad of grad")
    # checkpoint and scan
    def scanned(f, x):
        h, _ = jax.lax.scan(lambda h, _: (jax.checkpoint(f)(h) * 3.0, None), x, None, length=3)
        return jnp.sum(h * ct.astype(h.dtype))
    assert_close(jax.grad(lambda x: scanned(op, x))(x), jax.grad(lambda x: scanned(oracle, x))(f64(x)),
                 1e-4, "scan(checkpoint)")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(op, (x,), (ct,))


@op_param
def test_hlo_holds_the_custom_calls(op, oracle, log, rng):
    x = normal(rng, (4, 64))
    name = "log_softmax" if log else "softmax"
    grad_hlo = jax.jit(jax.grad(lambda x: jnp.sum(op(x) * x))).lower(x).as_text()
    assert f"jaxdnn_{name}_fwd_v1" in grad_hlo and f"jaxdnn_{name}_bwd_v1" in grad_hlo


@op_param
def test_batch_sharded_runs_per_shard(op, oracle, log, rng, devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    x = jax.device_put(normal(rng, (8, 6, 64)), NamedSharding(mesh, P("b")))
    ct = jax.device_put(normal(rng, (8, 6, 64)), NamedSharding(mesh, P("b")))
    step = jax.jit(lambda x, ct: jax.vjp(op, x)[1](ct)[0])
    hlo = step.lower(x, ct).compile().as_text()
    assert "all-gather" not in hlo
    name = "log_softmax" if log else "softmax"
    calls = [line for line in hlo.splitlines() if f'custom_call_target="jaxdnn_{name}_' in line]
    assert calls and all("f32[2,6,64]" in line for line in calls), calls
    assert_close(step(x, ct), _oracle_vjp(oracle, x, -1, ct), 1e-4, "sharded grad")
    assert jax.jit(op)(x).sharding.spec[0] == "b"


@op_param
def test_export_round_trip(op, oracle, log, rng):
    x = normal(rng, (3, 50))
    f = jax.jit(jax.grad(lambda x: jnp.sum(op(x) ** 2)))
    exported = jax.export.export(f, disabled_checks=jaxdnn.export_safety_checks())(x)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(restored.call(x), f(x), rtol=1e-6)


@op_param
@pytest.mark.parametrize("bad,error,message", [
    (lambda: jnp.ones((3, 4), jnp.int32), TypeError, "x must be float32, bfloat16 or float16, got int32"),
    (lambda: jnp.ones((3, 4), jnp.float64), TypeError, "got float64"),
    (lambda: jnp.float32(1.0), ValueError, r"rank >= 1, got shape \(\)"),
    (lambda: jnp.ones((3, 0), jnp.float32), ValueError, "must be non-empty"),
], ids=["int", "float64", "rank0", "empty-axis"])
def test_bad_input(op, oracle, log, bad, error, message):
    with pytest.raises(error, match=message):
        op(bad())


@op_param
def test_bad_options(op, oracle, log):
    x = jnp.ones((3, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"axis 2 is out of range for x of shape \(3, 4\)"):
        op(x, axis=2)
    with pytest.raises(ValueError, match=r"axis \(1, -1\) repeats an axis of x \(shape \(3, 4\)\)"):
        op(x, axis=(1, -1))
    with pytest.raises(ValueError, match=r"axis -3 is out of range"):
        op(x, axis=(0, -3))
    with pytest.raises(TypeError, match="axis must be an int, a tuple of ints or None"):
        op(x, axis=1.0)
    with pytest.raises(ValueError, match=r"where of shape \(2, 4\) must broadcast to x's shape \(3, 4\)"):
        op(x, where=jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match=r"where of shape \(3, 4, 1\) must broadcast"):
        op(x, where=jnp.ones((3, 4, 1), bool))
