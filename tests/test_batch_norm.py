"""batch_norm against Flax's BatchNorm math in float64: training and inference, both layouts, the fused
residual + activation, running statistics, transforms, sharding (global statistics), export, errors,
and the custom calls in the HLO."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdnn
from helpers import DTYPES, assert_close, dtype_id, f64, normal, off_kinks, tolerance
from jaxdnn.activation import epilogue
from jaxdnn.reference import batch_norm as ref

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
# (shape, channel axis): channels last with C a multiple of the 16-byte pack and not, channels first
# with H*W a multiple of the pack and not, a middle axis, one channel, the first axis.
LAYOUTS = [((4, 5, 6, 16), -1), ((3, 7, 13), -1), ((2, 3, 8, 8), 1), ((3, 5, 3, 7), 1), ((4, 6, 5), 1),
           ((6, 1), -1), ((7, 3), 0), ((2, 40, 3, 256), -1)]
layout_param = pytest.mark.parametrize("shape,axis", LAYOUTS, ids=str)


def _inputs(rng, shape, axis, dtype, residual=False, loc=0.5):
    channels = shape[axis]
    x = normal(rng, shape, dtype, loc=loc, scale=2.0)
    params = [normal(rng, (channels,)), normal(rng, (channels,))]
    stats = [normal(rng, (channels,)), jnp.asarray(rng.uniform(0.5, 2.0, channels), jnp.float32)]
    return x, params, stats, (normal(rng, shape, dtype) if residual else None)


def _check(x, params, stats, residual, cotangent, *, training, axis, activation, tol, grad_tol):
    kind, param = epilogue("test", activation)
    kw = dict(training=training, axis=axis)

    def ours(x, scale, bias, residual):
        return jaxdnn.batch_norm(x, scale, bias, *stats, residual=residual, activation=activation, **kw)

    def oracle(x, scale, bias, residual):
        return ref.batch_norm(x, scale, bias, *map(f64, stats), residual=residual, activation=kind,
                              activation_param=param, **kw)

    args = (x, *params, residual)
    out = jax.jit(ours)(*args)
    want = oracle(*map(f64, args))
    assert out[0].shape == x.shape and out[0].dtype == x.dtype
    assert_close(out[0], want[0], tol, "y")
    assert_close(out[1], want[1], 1e-5, "running mean")
    assert_close(out[2], want[2], 1e-5, "running var")
    pre = ref.batch_norm(*map(f64, args[:3]), *map(f64, stats), residual=f64(residual), **kw)[0]
    cotangent = off_kinks(cotangent, pre, kind)
    grads = jax.jit(lambda *a: jax.vjp(lambda *a: ours(*a)[0], *a)[1](cotangent))(*args)
    want_grads = jax.vjp(lambda *a: oracle(*a)[0], *map(f64, args))[1](f64(cotangent))
    for name, g, w in zip(["dx", "dscale", "dbias", "dresidual"], grads, want_grads):
        if w is not None:
            assert_close(g, w, grad_tol, name)


@dtype_param
@layout_param
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
def test_forward_and_grad(dtype, shape, axis, training, rng):
    x, params, stats, _ = _inputs(rng, shape, axis, dtype)
    _check(x, params, stats, None, normal(rng, shape, dtype), training=training, axis=axis, activation=None,
           tol=tolerance(dtype), grad_tol=tolerance(dtype, grad=True))


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu", "leaky_relu"], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape,axis", [((4, 5, 6, 16), -1), ((3, 5, 3, 7), 1)], ids=str)
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
def test_fused_residual_and_activation(activation, residual, shape, axis, training, rng):
    x, params, stats, res = _inputs(rng, shape, axis, jnp.float32, residual)
    _check(x, params, stats, res, normal(rng, shape), training=training, axis=axis, activation=activation,
           tol=1e-5, grad_tol=1e-4)


@pytest.mark.parametrize("activation", sorted(jaxdnn.activation.EPILOGUES))
def test_every_activation(activation, rng):
    """Each fused activation (the kernels switch on its kind once per pack of channels)."""
    x, params, stats, _ = _inputs(rng, (4, 5, 6, 16), -1, jnp.float32)
    _check(x, params, stats, None, normal(rng, x.shape), training=True, axis=-1, activation=activation,
           tol=1e-5, grad_tol=1e-4)


@dtype_param
def test_fused_bf16_and_f16(dtype, rng):
    x, params, stats, res = _inputs(rng, (8, 7, 7, 64), -1, dtype, residual=True)
    _check(x, params, stats, res, normal(rng, x.shape, dtype), training=True, axis=-1, activation="relu",
           tol=tolerance(dtype), grad_tol=tolerance(dtype, grad=True))


@pytest.mark.parametrize("shape,axis,dtype", [
    ((6, 4096), -1, jnp.bfloat16), ((5, 4100), -1, jnp.float32), ((2, 3000, 24), 1, jnp.float32),
    ((300, 8, 2), 1, jnp.bfloat16)], ids=["C4096-bf16", "C4100-f32", "C3000-first", "O300-first-I2"])
def test_wide_channels_and_many_rows(shape, axis, dtype, rng):
    """Channel counts past one block of channel packs (CUDA grid y > 1) and long runs of rows."""
    x, params, stats, res = _inputs(rng, shape, axis, dtype, residual=True)
    _check(x, params, stats, res, normal(rng, shape, dtype), training=True, axis=axis, activation="relu",
           tol=tolerance(dtype), grad_tol=tolerance(dtype, grad=True))


def test_large_mean_keeps_the_variance(rng):
    """Data far from zero: the sums are taken about a sample of the batch (each channel's first
    element), so the variance does not cancel."""
    x, params, stats, _ = _inputs(rng, (64, 32), -1, jnp.float32, loc=1000.0)
    stats = [jnp.full((32,), 1000.0, jnp.float32), stats[1]]
    _check(x, params, stats, None, normal(rng, x.shape), training=True, axis=-1, activation=None, tol=1e-5,
           grad_tol=1e-4)


def test_matches_flax_batch_norm(rng):
    """Training and inference against flax.linen.BatchNorm itself, running statistics included."""
    x = normal(rng, (6, 5, 5, 12), scale=2.0, loc=0.3)
    module = nn.BatchNorm(momentum=0.9, epsilon=1e-5)
    variables = module.init(jax.random.key(0), x, use_running_average=False)
    variables = {"params": {"scale": normal(rng, (12,)), "bias": normal(rng, (12,))},
                 "batch_stats": {"mean": normal(rng, (12,)),
                                 "var": jnp.asarray(rng.uniform(0.5, 2, 12), jnp.float32)}}
    want, updates = module.apply(variables, x, use_running_average=False, mutable=["batch_stats"])
    p, s = variables["params"], variables["batch_stats"]
    y, mean, var = jaxdnn.batch_norm(x, p["scale"], p["bias"], s["mean"], s["var"], training=True,
                                     momentum=0.9)
    assert_close(y, want, 1e-5, "train y")
    assert_close(mean, updates["batch_stats"]["mean"], 1e-5, "mean")
    assert_close(var, updates["batch_stats"]["var"], 1e-5, "var")
    y, mean, var = jaxdnn.batch_norm(x, p["scale"], p["bias"], s["mean"], s["var"], training=False)
    assert_close(y, module.apply(variables, x, use_running_average=True), 1e-5, "inference y")
    assert mean is s["mean"] and var is s["var"]


def test_optional_params_and_stat_dtypes(rng):
    x = normal(rng, (5, 6), jnp.bfloat16)
    mean, var = jnp.zeros((6,), jnp.bfloat16), jnp.ones((6,), jnp.bfloat16)
    y, new_mean, new_var = jaxdnn.batch_norm(x, None, None, mean, var, training=True)
    assert new_mean.dtype == new_var.dtype == jnp.bfloat16
    want = ref.batch_norm(f64(x), None, None, f64(mean), f64(var), training=True)
    assert_close(y, want[0], tolerance(jnp.bfloat16), "y")


def test_empty_batch_inference(rng):
    x = jnp.zeros((0, 4, 4, 8), jnp.float32)
    stats = [normal(rng, (8,)), jnp.ones((8,))]
    y, _, _ = jaxdnn.batch_norm(x, None, None, *stats, training=False)
    assert y.shape == x.shape
    dx = jax.grad(lambda x: jnp.sum(jaxdnn.batch_norm(x, None, None, *stats, training=False)[0]))(x)
    assert dx.shape == x.shape


def _loss(op, x, scale, bias, residual, ct, **kw):
    return jnp.sum(jnp.sin(op(x, scale, bias, residual, **kw)) * ct)


def _ours(x, scale, bias, residual, stats, training=True):
    return jaxdnn.batch_norm(x, scale, bias, *stats, training=training, residual=residual,
                             activation="relu")[0]


def _oracle(x, scale, bias, residual, stats, training=True):
    return ref.batch_norm(x, scale, bias, *map(f64, stats), training=training, residual=residual,
                          activation="relu")[0]


def test_transforms(rng):
    x, (scale, bias), stats, residual = _inputs(rng, (4, 6, 3, 8), -1, jnp.float32, residual=True)
    ct = normal(rng, x.shape)
    # vmap over a non-leading axis: each example has its own statistics; unbatched and batched params
    vm = jax.vmap(lambda x, r: _ours(x, scale, bias, r, stats), in_axes=(1, 1), out_axes=1)(x, residual)
    want = jax.vmap(lambda x, r: _oracle(x, f64(scale), f64(bias), r, stats), in_axes=(1, 1), out_axes=1)(
        f64(x), f64(residual))
    assert_close(vm, want, 1e-5, "vmap")
    scales = normal(rng, (4, 8))
    vm = jax.vmap(lambda x, s: _ours(x, s, bias, None, stats))(x, scales)
    want = jax.vmap(lambda x, s: _oracle(x, s, f64(bias), None, stats))(f64(x), f64(scales))
    assert_close(vm, want, 1e-5, "vmap batched scale")
    # per-example gradients
    grad = jax.vmap(jax.grad(lambda x, c: jnp.sum(_ours(x, scale, bias, None, stats) * c)))(x, ct)
    want = jax.vmap(jax.grad(lambda x, c: jnp.sum(_oracle(x, f64(scale), f64(bias), None, stats) * c)))(
        f64(x), f64(ct))
    assert_close(grad, want, 1e-4, "vmap(grad)")
    # grad of grad, for every differentiable input
    def penalty(f, x, scale, bias, residual):
        g = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a, stats)) * ct.astype(a[0].dtype)), argnums=(0, 1, 2, 3))(
            x, scale, bias, residual)
        return sum(jnp.sum(t ** 2) for t in g)
    args = (x, scale, bias, residual)
    got = jax.grad(lambda *a: penalty(_ours, *a), argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(lambda *a: penalty(_oracle, *a), argnums=(0, 1, 2, 3))(*map(f64, args))
    for name, g, w in zip(["x", "scale", "bias", "residual"], got, want):
        assert_close(g, w, 1e-4, f"grad of grad {name}")
    # checkpoint inside scan, with a smooth activation: after two steps, relu's kink can flip between
    # float32 and float64 for elements near 0, which is not what this checks
    def scanned(batch_norm, x):
        step = jax.checkpoint(
            lambda h: batch_norm(h, scale, bias, *stats, training=True, activation="silu")[0])
        h, _ = jax.lax.scan(lambda h, _: (step(h), None), x, None, length=2)
        return jnp.sum(h * ct.astype(h.dtype))
    assert_close(jax.grad(lambda x: scanned(jaxdnn.batch_norm, x))(x),
                 jax.grad(lambda x: scanned(ref.batch_norm, x))(f64(x)), 1e-4, "scan(checkpoint)")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda x: _ours(x, scale, bias, None, stats), (x,), (ct,))


def test_hlo_holds_the_custom_calls(rng):
    x, (scale, bias), stats, residual = _inputs(rng, (4, 6, 8), -1, jnp.float32, residual=True)
    grad = jax.grad(lambda x, r: jnp.sum(_ours(x, scale, bias, r, stats) * x), argnums=(0, 1))
    hlo = jax.jit(grad).lower(x, residual).as_text()
    # With a residual and an activation, the sums stage also writes g (bwd_grad) and dx reads it.
    for target in ["stats_v1", "fwd_v1", "bwd_grad_v1", "bwd_dx_v2"]:
        assert f"jaxdnn_batch_norm_{target}" in hlo, target
    assert "bwd_sums" not in hlo
    plain = jax.grad(lambda x: jnp.sum(jaxdnn.batch_norm(x, scale, bias, *stats, training=True)[0] * x))
    hlo = jax.jit(plain).lower(x).as_text()
    for target in ["stats_v1", "fwd_v1", "bwd_sums_v2", "bwd_dx_v2"]:
        assert f"jaxdnn_batch_norm_{target}" in hlo, target


def test_deterministic(rng):
    x, (scale, bias), stats, _ = _inputs(rng, (64, 9, 24), -1, jnp.float32)
    ct = normal(rng, x.shape)
    step = jax.jit(lambda x: jax.vjp(lambda x, s, b: _ours(x, s, b, None, stats), x, scale, bias)[1](ct))
    first, second = step(x), step(x)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_batch_sharded_uses_global_statistics(rng, devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    x, (scale, bias), stats, residual = _inputs(rng, (8, 5, 5, 16), -1, jnp.float32, residual=True)
    ct = normal(rng, x.shape)
    shard = NamedSharding(mesh, P("b"))
    xs, rs, cts = (jax.device_put(a, shard) for a in (x, residual, ct))

    def step(x, r, c):
        out, vjp = jax.vjp(lambda x, s, b, r: _ours(x, s, b, r, stats), x, scale, bias, r)
        return out, vjp(c)

    hlo = jax.jit(step).lower(xs, rs, cts).compile().as_text()
    assert "all-gather" not in hlo
    calls = [line for line in hlo.splitlines() if 'custom_call_target="jaxdnn_batch_norm_' in line]
    assert calls and all("f32[50,16,1]" in line for line in calls if "_dx_" in line or "_fwd_" in line), calls
    out, grads = jax.jit(step)(xs, rs, cts)
    want, want_vjp = jax.vjp(lambda *a: _oracle(*a, stats), *map(f64, (x, scale, bias, residual)))
    assert_close(out, want, 1e-5, "sharded y")
    for name, g, w in zip(["x", "scale", "bias", "residual"], grads, want_vjp(f64(ct))):
        assert_close(g, w, 1e-4, f"sharded d{name}")
    assert out.sharding.spec[0] == "b"


def test_explicit_mesh_uses_global_statistics(rng, devices):
    if not hasattr(jax.sharding, "AxisType"):
        pytest.skip("needs Explicit mesh axes")
    mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    x, (scale, bias), stats, residual = _inputs(rng, (8, 3, 4, 16), -1, jnp.float32, residual=True)
    ct = normal(rng, x.shape)
    want, want_vjp = jax.vjp(lambda *a: _oracle(*a, stats), *map(f64, (x, scale, bias, residual)))
    with jax.set_mesh(mesh):
        xs, rs, cts = (jax.device_put(a, NamedSharding(mesh, P("b"))) for a in (x, residual, ct))
        out, vjp = jax.vjp(jax.jit(lambda x, s, b, r: _ours(x, s, b, r, stats)), xs, scale, bias, rs)
        grads = vjp(cts)
        _, new_mean, new_var = jax.jit(lambda x: jaxdnn.batch_norm(x, scale, bias, *stats, training=True))(xs)
    assert out.sharding.spec[0] == "b"
    assert_close(out, want, 1e-5, "explicit y")
    for name, g, w in zip(["x", "scale", "bias", "residual"], grads, want_vjp(f64(ct))):
        assert_close(g, w, 1e-4, f"explicit d{name}")
    want_stats = ref.batch_norm(f64(x), f64(scale), f64(bias), *map(f64, stats), training=True)
    assert_close(new_mean, want_stats[1], 1e-5, "running mean")
    assert_close(new_var, want_stats[2], 1e-5, "running var")


def test_inside_shard_map_statistics_are_per_device(rng, devices):
    """Called by the user inside shard_map, batch_norm sees one device's rows (as stock code would)."""
    mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    x, (scale, bias), stats, _ = _inputs(rng, (8, 5, 16), -1, jnp.float32)
    per_device = jax.shard_map(lambda x: _ours(x, scale, bias, None, stats), mesh=mesh, in_specs=P("b"),
                               out_specs=P("b"))
    want = jnp.concatenate([_oracle(f64(part), f64(scale), f64(bias), None, stats)
                            for part in jnp.split(x, 4)])
    assert_close(jax.jit(per_device)(x), want, 1e-5, "per-device batch norm")


def test_export_round_trip(rng):
    x, (scale, bias), stats, _ = _inputs(rng, (4, 3, 8), -1, jnp.float32)
    f = jax.jit(jax.grad(lambda x: jnp.sum(_ours(x, scale, bias, None, stats) ** 2)))
    exported = jax.export.export(f, disabled_checks=jaxdnn.export_safety_checks())(x)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(restored.call(x), f(x), rtol=1e-6)


def _bad_call(**overrides):
    """batch_norm on a valid [3, 4] input with some arguments replaced."""
    c = jnp.ones((4,), jnp.float32)
    args = dict(x=jnp.ones((3, 4), jnp.float32), scale=c, bias=c, running_mean=c, running_var=c,
                training=True)
    args.update(overrides)
    return jaxdnn.batch_norm(**args)


@pytest.mark.parametrize("overrides,error,message", [
    (dict(x=jnp.ones((3, 4), jnp.int32)), TypeError, "x must be float32, bfloat16 or float16, got int32"),
    (dict(x=jnp.float32(1), scale=None, bias=None), ValueError, "rank >= 1"),
    (dict(training=1), TypeError, "training must be a bool"),
    (dict(axis=2), ValueError, "axis must be an int in"),
    (dict(x=jnp.ones((3, 5), jnp.float32), scale=None, bias=None), ValueError,
     r"running_mean must have shape \(C,\) = \(5,\), got \(4,\)"),
    (dict(scale=jnp.ones((4,), jnp.int32)), TypeError, "scale must be float32 or x's dtype, got int32"),
    (dict(bias=jnp.ones((5,), jnp.float32)), ValueError, "bias must have shape"),
    (dict(running_var=jnp.ones((2, 2), jnp.float32)), ValueError, "running_var must have shape"),
    (dict(residual=jnp.ones((3, 5), jnp.float32)), ValueError, "residual must have x's shape"),
    (dict(activation="swish"), ValueError, "activation must be None or one of"),
    (dict(epsilon=-1.0), ValueError, "epsilon must be"),
    (dict(momentum=1.5), ValueError, "momentum must be in"),
    (dict(x=jnp.ones((0, 4), jnp.float32)), ValueError, "at least one element per channel"),
], ids=["int", "rank0", "training", "axis", "stat-shape", "scale-dtype", "bias-shape", "var-shape",
        "residual", "activation", "epsilon", "momentum", "empty-train"])
def test_bad_input(overrides, error, message):
    with pytest.raises(error, match=message):
        _bad_call(**overrides)
