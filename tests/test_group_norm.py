"""group_norm against the float64 reference (and flax.linen.GroupNorm's math): forward, gradients,
fused activations, numerics, transforms, sharding, export, errors, and the custom calls in the HLO."""

import contextlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdnn
from helpers import DTYPES, assert_close, bit_equal, dtype_id, f64, normal, tolerance

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
FWD_TARGET, BWD_TARGET = "jaxdnn_group_norm_fwd_v1", "jaxdnn_group_norm_bwd_v1"

# (x shape, num_groups): rank 2 (no spatial axes), empty batch, empty spatial axis, one channel,
# instance norm (G = C), one group, channel counts off the 16-byte vector (130, 12), groups that
# straddle vectors (K = 3, 10), and positions enough for many chunks. On a GPU with TMA the on-chip
# backward (group_norm_sm90.cu) takes most of them; the last ones are for it: more items than
# blocks (300 samples x 2 slabs), items of several chunks cycling through its rings of shared
# memory, an item of 11 chunks (the last of 40 positions), one of 16 (a full ring but one slot),
# and one too long for it (24 chunks: the two-pass kernels in float32, the cluster backward in
# 16 bits).
# On a GPU the two-pass kernels split the channels into tiles where samples x chunks make fewer than
# 512 blocks, as in most of these cases (tiles of 8 lanes and more, the last one's lanes past C idle).
# The 16-bit forward runs on the cluster kernel (group_norm_sm90.cu) where C is a multiple of 64 and
# K divides 64 (33 positions, K = 2; 8 slabs of K = 16; 4096 positions): also 63 positions of two
# slabs of one group each, and the most positions a cluster holds (7168, instance norm).
CASES = [
    ((1, 1), 1), ((3, 16), 4), ((2, 5, 7, 12), 3), ((0, 4, 8), 2), ((2, 0, 8), 2), ((5, 9, 1), 1),
    ((2, 3, 3, 96), 32), ((4, 33, 64), 32), ((2, 9, 130), 13), ((2, 17, 24), 24), ((2, 300, 48), 1),
    ((1, 2, 40, 512), 32), ((3, 2, 2, 2, 40), 8),
    ((300, 9, 32), 2), ((150, 600, 16), 1), ((3, 2600, 16), 1), ((1, 4096, 64), 4), ((2, 6000, 16), 1),
    ((3, 7, 9, 128), 2), ((1, 7168, 64), 64),
]
case_param = pytest.mark.parametrize("shape,groups", CASES, ids=str)


def _params(rng, channels, dtype=jnp.float32):
    return normal(rng, (channels,), dtype, 1.0, 0.5), normal(rng, (channels,), dtype, 0.5, 1.0)


def _oracle(x, groups, scale=None, bias=None, *, epsilon=1e-5, activation=None):
    return jax.jit(lambda x, s, b: jaxdnn.reference.group_norm(
        x, groups, s, b, epsilon=epsilon, activation=activation))(f64(x), f64(scale), f64(bias))


def _vjp(fn, args, cotangent):
    """The VJP of fn(*args) w.r.t. every argument that is not None, under jit."""
    live = [i for i, a in enumerate(args) if a is not None]

    def of_live(*values):
        full = list(args)
        for i, v in zip(live, values):
            full[i] = v
        return fn(*full)

    return jax.jit(lambda a, c: jax.vjp(of_live, *a)[1](c))([args[i] for i in live], cotangent)


def _check(x, groups, scale, bias, cotangent, dtype, *, epsilon=1e-5, activation=None, tol=None):
    op = lambda x, s, b: jaxdnn.group_norm(x, groups, s, b, epsilon=epsilon, activation=activation)
    ref = lambda x, s, b: jaxdnn.reference.group_norm(x, groups, s, b, epsilon=epsilon,
                                                      activation=activation)
    y = jax.jit(op)(x, scale, bias)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, _oracle(x, groups, scale, bias, epsilon=epsilon, activation=activation),
                 tol or tolerance(dtype), "forward")
    args = (x, scale, bias)
    got = _vjp(op, args, cotangent)
    want = _vjp(ref, tuple(f64(a) for a in args), f64(cotangent))
    primals = [a for a in args if a is not None]
    for name, g, w, p in zip(("dx", "dscale", "dbias"), got, want, primals):
        assert g.dtype == p.dtype, (name, g.dtype, p.dtype)
        assert_close(g, w, 10 * (tol or tolerance(dtype)), name)


@dtype_param
@case_param
def test_forward_and_grad(dtype, shape, groups, rng):
    x = normal(rng, shape, dtype, loc=2.0, scale=3.0)
    scale, bias = _params(rng, shape[-1])
    # One value per group (K = S = 1, or S = 1 with G = C) has variance 0: a large epsilon keeps
    # dx well conditioned there.
    per_group = (shape[-1] // groups) * int(np.prod(shape[1:-1]))
    _check(x, groups, scale, bias, normal(rng, shape, dtype), dtype,
           epsilon=1.0 if per_group == 1 else 1e-5)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=dtype_id)
def test_cluster_forward_many_items(dtype, activation, rng):
    """The 16-bit cluster forward (group_norm_sm90.cu) on a GPU with more clusters than are resident
    at once: 800 items of 16 positions, with and without an activation, checked with its gradients
    (which read the forward's mean and rstd)."""
    shape = (200, 16, 256)
    x = normal(rng, shape, dtype, loc=2.0, scale=3.0)
    scale, bias = _params(rng, shape[-1])
    _check(x, 32, scale, bias, normal(rng, shape, dtype), dtype, activation=activation)


def test_cluster_forward_most_positions(rng):
    """The most positions the cluster forward holds, nearly: 7000 of 7168 (875 rows a CTA, 109 KiB
    of shared memory, two CTAs an SM), in 40 items."""
    shape, groups = (40, 7000, 64), 8
    x = normal(rng, shape, jnp.bfloat16, loc=2.0, scale=3.0)
    scale, bias = _params(rng, shape[-1])
    y = jax.jit(lambda x, s, b: jaxdnn.group_norm(x, groups, s, b))(x, scale, bias)
    assert_close(y, _oracle(x, groups, scale, bias), tolerance(jnp.bfloat16), "forward")


def test_channel_tiles(rng):
    """Stable Diffusion's 16x16 level (few positions, 1280 channels in groups of 40): on a GPU the
    two-pass forward in 4 tiles of 40 lanes x 6 rows, with silu and the gradients."""
    shape = (8, 16, 16, 1280)
    x = normal(rng, shape, jnp.bfloat16, loc=2.0, scale=3.0)
    scale, bias = _params(rng, shape[-1])
    _check(x, 32, scale, bias, normal(rng, shape, jnp.bfloat16), jnp.bfloat16, activation="silu")


@pytest.mark.parametrize("shape, groups, dtype, activation", [
    ((2, 4096, 320), 32, jnp.bfloat16, "silu"),  # Stable Diffusion's groups of 10: 40-channel slabs
    ((2, 1800, 640), 32, jnp.bfloat16, None),    # groups of 20: 40-channel slabs
    ((2, 3000, 96), 8, jnp.float16, "silu"),     # groups of 12: 48-channel slabs
    ((1, 3000, 24), 8, jnp.bfloat16, None),      # groups of 3: one 24-channel slab
    ((2, 2000, 128), 2, jnp.bfloat16, "silu"),   # 64-channel slabs
    ((2, 2000, 128), 2, jnp.bfloat16, "gelu"),
    ((1, 3000, 64), 1, jnp.float16, None),       # the most positions of a 64-channel slab, nearly
    ((1, 4900, 40), 4, jnp.float16, None),       # of a 40-channel slab, nearly (with the scratch)
], ids=["sd-40ch-silu", "40ch", "48ch-silu", "24ch", "64ch-silu", "64ch-gelu", "64ch-most", "40ch-most"])
def test_cluster_backward(shape, groups, dtype, activation, rng):
    """Samples whose slab is too long for the on-chip backward's ring (more than 17 chunks of 8 KiB):
    on an sm_90 GPU the cluster backward (x and dy held by a cluster's 8 CTAs, up to 112 KiB each);
    dx, dscale and dbias against the reference."""
    x = normal(rng, shape, dtype, loc=2.0, scale=3.0)
    scale, bias = _params(rng, shape[-1])
    _check(x, groups, scale, bias, normal(rng, shape, dtype), dtype, activation=activation)


def test_matches_flax_group_norm_math(rng):
    """The reference (and so the kernels) compute what flax.linen.GroupNorm computes."""
    nn = pytest.importorskip("flax.linen")
    x = normal(rng, (3, 6, 5, 64), loc=1.0, scale=2.0)
    module = nn.GroupNorm(num_groups=8, epsilon=1e-5, use_fast_variance=False, param_dtype=jnp.float64)
    params = jax.tree.map(lambda p: f64(normal(rng, p.shape, loc=1.0)),
                          module.init(jax.random.key(0), f64(x)))
    want = module.apply(params, f64(x))
    p = params["params"]
    assert_close(jaxdnn.group_norm(x, 8, p["scale"].astype(jnp.float32), p["bias"].astype(jnp.float32)),
                 want, 1e-5, "vs flax")


@pytest.mark.parametrize("activation", sorted(jaxdnn.activation.EPILOGUES))
def test_fused_activation(activation, rng):
    shape = (3, 7, 5, 24)
    x = normal(rng, shape, loc=0.5, scale=2.0)
    scale, bias = _params(rng, shape[-1])
    _check(x, 6, scale, bias, normal(rng, shape), jnp.float32, activation=activation)


@pytest.mark.parametrize("activation", sorted(jaxdnn.activation.EPILOGUES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=dtype_id)
def test_fused_activation_half(activation, dtype, rng):
    """Every activation on 16-bit x, 64 channels: on an sm_90 GPU, the cluster forward's epilogue."""
    shape = (2, 33, 64)
    x = normal(rng, shape, dtype, loc=0.5, scale=2.0)
    scale, bias = _params(rng, shape[-1])
    _check(x, 32, scale, bias, normal(rng, shape, dtype), dtype, activation=activation)


@pytest.mark.parametrize("scale_dtype", [None, "float32", "x"])
@pytest.mark.parametrize("bias_dtype", [None, "float32", "x"])
@dtype_param
def test_affine_dtypes(scale_dtype, bias_dtype, dtype, rng):
    shape = (2, 6, 40)
    x = normal(rng, shape, dtype, loc=2.0, scale=3.0)
    resolve = lambda d: dtype if d == "x" else d
    scale = None if scale_dtype is None else normal(rng, shape[-1:], resolve(scale_dtype), 1.0, 0.5)
    bias = None if bias_dtype is None else normal(rng, shape[-1:], resolve(bias_dtype), 0.5, 1.0)
    _check(x, 4, scale, bias, normal(rng, shape, dtype), dtype)


@pytest.mark.parametrize("epsilon", [0.0, 1e-4, 0.5])
def test_epsilon(epsilon, rng):
    x = normal(rng, (3, 20, 32), scale=0.03)  # variance ~1e-3: epsilon >= 1e-4 changes the result
    scale, bias = _params(rng, 32)
    _check(x, 4, scale, bias, normal(rng, x.shape), jnp.float32, epsilon=epsilon)


@dtype_param
def test_groups_with_large_offsets(dtype, rng):
    """Groups far from 0 relative to their spread: a single-pass E[x^2] - E[x]^2 variance would lose
    about (offset / std)^2 * 2^-24; the kernels' shifted sums lose about offset / std * 2^-24."""
    stats = [(0.0, 1.0), (1e3, 1.0), (-1e3, 2.0), (3.0, 1e-2), (2e4, 20.0), (-4e4, 1e2), (0.0, 1e-3),
             (-5.0, 1e-2)]
    loc = np.repeat([m for m, _ in stats], 4)
    std = np.repeat([s for _, s in stats], 4)
    x = jnp.asarray(loc + std * rng.normal(size=(2, 50, 32)), dtype)
    scale, bias = _params(rng, 32)
    tol = max(tolerance(dtype), 16 * 1e3 * 2.0**-24)
    _check(x, 8, scale, bias, normal(rng, x.shape, dtype), dtype, tol=tol)


@dtype_param
def test_results_are_deterministic(dtype, rng):
    shape = (4, 16, 16, 64)
    x = normal(rng, shape, dtype, loc=1.0, scale=2.0)
    scale, bias = _params(rng, 64)
    ct = normal(rng, shape, dtype)

    def results(x, s, b, ct):
        y, vjp = jax.vjp(lambda *a: jaxdnn.group_norm(a[0], 16, *a[1:]), x, s, b)
        return (y, *vjp(ct))

    results = jax.jit(results)
    first, second = results(x, scale, bias, ct), results(x, scale, bias, ct)
    for name, a, b in zip(("y", "dx", "dscale", "dbias"), first, second):
        assert bit_equal(a, b), f"{name} differs between two identical runs"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_small_workspace(dtype, rng, monkeypatch):
    """A workspace of one chunk a sample: the kernels run one block a sample (of every position)."""
    monkeypatch.setattr(sys.modules["jaxdnn.group_norm"], "_num_chunks", lambda *_: 1)
    x = normal(rng, (3, 2500, 64), dtype, loc=1.0, scale=2.0)
    scale, bias = _params(rng, 64)
    _check(x, 8, scale, bias, normal(rng, x.shape, dtype), dtype)


# --- transforms -------------------------------------------------------------------------------

def _ref(x, scale, bias, groups=4, activation=None):
    return jaxdnn.reference.group_norm(x, groups, scale, bias, activation=activation)


def _ours(x, scale, bias, groups=4, activation=None):
    return jaxdnn.group_norm(x, groups, scale, bias, activation=activation)


def test_vmap(rng):
    x = normal(rng, (3, 5, 6, 16), loc=1.0, scale=2.0)  # vmapped over axis 1: 5 examples of [3, 6, 16]
    scale, bias = _params(rng, 16)
    got = jax.vmap(_ours, in_axes=(1, None, None), out_axes=1)(x, scale, bias)
    want = jax.vmap(_ref, in_axes=(1, None, None), out_axes=1)(f64(x), f64(scale), f64(bias))
    assert_close(got, want, 1e-5, "vmap, shared params")
    scales = normal(rng, (5, 16), loc=1.0)
    got = jax.vmap(_ours, in_axes=(1, 0, None), out_axes=1)(x, scales, bias)
    want = jax.vmap(_ref, in_axes=(1, 0, None), out_axes=1)(f64(x), f64(scales), f64(bias))
    assert_close(got, want, 1e-5, "vmap, batched scale")
    got = jax.vmap(_ours, in_axes=(None, 0, None))(x[:, 0], scales, bias)
    want = jax.vmap(_ref, in_axes=(None, 0, None))(f64(x[:, 0]), f64(scales), f64(bias))
    assert_close(got, want, 1e-5, "vmap, unbatched x")


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_vmap_of_grad(activation, rng):
    x = normal(rng, (3, 4, 6, 16), loc=1.0, scale=2.0)
    scale, bias = _params(rng, 16)
    ct = normal(rng, x.shape)

    def per_example(fn, x, scale, bias, ct, in_axes):
        loss = lambda x, s, b, c: jnp.sum(fn(x, s, b, activation=activation) * c)
        return jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=in_axes)(x, scale, bias, ct)

    for in_axes, scales in (((1, None, None, 1), scale), ((1, 0, None, 1), normal(rng, (4, 16), loc=1.0))):
        got = jax.jit(lambda *a: per_example(_ours, *a, in_axes))(x, scales, bias, ct)
        want = per_example(_ref, f64(x), f64(scales), f64(bias), f64(ct), in_axes)
        for name, g, w in zip(("dx", "dscale", "dbias"), got, want):
            assert_close(g, w, 1e-4, f"vmap(grad) {name} in_axes={in_axes}")


def test_grad_of_grad_checkpoint_scan(rng):
    x = normal(rng, (2, 5, 24), loc=0.5, scale=2.0)
    scale, bias = _params(rng, 24)
    ct = normal(rng, x.shape)

    def penalty(fn, x, scale, bias):
        grads = jax.grad(lambda x, s: jnp.sum(fn(x, s, bias, activation="silu") * ct.astype(x.dtype)),
                         argnums=(0, 1))(x, scale)
        return sum(jnp.sum(g ** 2) for g in grads)

    got = jax.jit(jax.grad(lambda *a: penalty(_ours, *a), argnums=(0, 1, 2)))(x, scale, bias)
    want = jax.grad(lambda *a: penalty(_ref, *a), argnums=(0, 1, 2))(f64(x), f64(scale), f64(bias))
    for name, g, w in zip(("x", "scale", "bias"), got, want):
        assert_close(g, w, 1e-4, f"grad of grad w.r.t. {name}")

    def scanned(fn, x):
        h, _ = jax.lax.scan(lambda h, _: (jax.checkpoint(fn)(h, scale.astype(h.dtype), bias.astype(h.dtype))
                                          + 0.5, None), x, None, length=3)
        return jnp.sum(h * ct.astype(h.dtype))

    assert_close(jax.jit(jax.grad(lambda x: scanned(_ours, x)))(x),
                 jax.grad(lambda x: scanned(_ref, x))(f64(x)), 1e-4, "scan(checkpoint)")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda x: _ours(x, scale, bias), (x,), (ct,))


# --- sharding and export ----------------------------------------------------------------------

def _custom_call_lines(hlo, target):
    return [line for line in hlo.splitlines() if f'custom_call_target="{target}"' in line]


@pytest.mark.parametrize("mesh_kind", ["mesh", "explicit"])
def test_batch_sharded_runs_per_shard(mesh_kind, devices, rng):
    if mesh_kind == "explicit":
        axis_type = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
        if axis_type is None:
            pytest.skip("this jax has no explicit mesh axes")
        mesh = jax.make_mesh((4,), ("b",), axis_types=(axis_type,), devices=devices)
    else:
        mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    shape = (8, 6, 5, 32)
    x, ct = (put(normal(rng, shape, loc=1.0, scale=2.0), P("b")) for _ in range(2))
    scale, bias = (put(p, P()) for p in _params(rng, 32))
    fwd = jax.jit(lambda x, s, b: _ours(x, s, b, activation="relu"))
    grads = jax.jit(lambda x, s, b, ct: jax.vjp(lambda *a: _ours(*a, activation="relu"), x, s, b)[1](ct))
    with jax.set_mesh(mesh) if mesh_kind == "explicit" else contextlib.nullcontext():
        y = fwd(x, scale, bias)
        got = grads(x, scale, bias, ct)
        hlo = grads.lower(x, scale, bias, ct).compile().as_text()
    assert "all-gather" not in hlo
    for target in (FWD_TARGET, BWD_TARGET):
        lines = _custom_call_lines(hlo, target)
        assert lines and all(re.search(r"f32\[2,30,32\]", line) for line in lines), lines
    x, scale, bias, ct = (f64(np.asarray(a)) for a in (x, scale, bias, ct))  # the oracle, unsharded
    assert_close(y, _ref(x, scale, bias, activation="relu"), 1e-5, "sharded forward")
    want = jax.vjp(lambda *a: _ref(*a, activation="relu"), x, scale, bias)[1](ct)
    for name, g, w in zip(("dx", "dscale", "dbias"), got, want):
        assert_close(g, w, 1e-4, f"sharded {name}")


def test_export_round_trip(rng):
    x = normal(rng, (3, 4, 5, 32), loc=1.0, scale=2.0)
    scale, bias = _params(rng, 32)
    f = jax.jit(jax.value_and_grad(lambda x, s, b: jnp.sum(jnp.tanh(_ours(x, s, b, activation="silu"))),
                                   argnums=(0, 1, 2)))
    exported = jax.export.export(f, disabled_checks=jaxdnn.export_safety_checks())(x, scale, bias)
    module = exported.mlir_module()
    assert f"@{FWD_TARGET}(" in module and f"@{BWD_TARGET}(" in module
    assert {FWD_TARGET, BWD_TARGET} <= set(jaxdnn.target_names())
    restored = jax.export.deserialize(exported.serialize())
    for g, d in zip(jax.tree.leaves(restored.call(x, scale, bias)), jax.tree.leaves(f(x, scale, bias))):
        assert_close(g, d, 1e-6, "exported vs direct")


# --- errors and HLO ---------------------------------------------------------------------------

_F32, _I32 = jnp.float32, jnp.int32
ERRORS = [
    ("int_x", ((4, 3, 8), _I32), 2, None, None, {}, TypeError,
     r"x must be float32, bfloat16 or float16, got int32"),
    ("float64_x", ((4, 3, 8), jnp.float64), 2, None, None, {}, TypeError, r"x must be .*got float64"),
    ("rank1_x", ((8,), _F32), 2, None, None, {}, ValueError, r"x must have rank >= 2 .*got shape \(8,\)"),
    ("empty_channels", ((2, 3, 0), _F32), 1, None, None, {}, ValueError,
     r"x's channel axis \(the last\) must be non-empty"),
    ("groups_do_not_divide", ((2, 3, 12), _F32), 5, None, None, {}, ValueError,
     r"num_groups must be >= 1 and divide the channels C = 12, got num_groups=5"),
    ("zero_groups", ((2, 3, 12), _F32), 0, None, None, {}, ValueError,
     r"num_groups must be >= 1 .*got num_groups=0"),
    ("float_groups", ((2, 3, 12), _F32), 2.0, None, None, {}, TypeError, r"num_groups must be an int"),
    ("bool_groups", ((2, 3, 12), _F32), True, None, None, {}, TypeError, r"num_groups must be an int"),
    ("scale_shape", ((2, 3, 12), _F32), 3, ((6,), _F32), None, {}, ValueError,
     r"scale must have shape \(C,\) = \(12,\) to match x.shape \(2, 3, 12\), got scale.shape \(6,\)"),
    ("bias_dtype", ((2, 3, 12), jnp.bfloat16), 3, None, ((12,), jnp.float16), {}, TypeError,
     r"bias must be float32 or x's dtype bfloat16, got float16"),
    ("scale_int", ((2, 3, 12), _F32), 3, ((12,), _I32), None, {}, TypeError, r"scale must be float32"),
    ("negative_epsilon", ((2, 3, 12), _F32), 3, None, None, {"epsilon": -1.0}, ValueError,
     r"epsilon must be a finite number >= 0"),
    ("activation", ((2, 3, 12), _F32), 3, None, None, {"activation": "swish"}, ValueError,
     r"activation must be None or one of"),
]


def _random(rng, shape, dtype):
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-5, 5, shape), dtype)
    return normal(rng, shape, dtype, 1.0, 2.0)


@pytest.mark.parametrize("x,groups,scale,bias,kwargs,error,match", [c[1:] for c in ERRORS],
                         ids=[c[0] for c in ERRORS])
@pytest.mark.parametrize("under_jit", [False, True], ids=["eager", "jit"])
def test_errors(x, groups, scale, bias, kwargs, error, match, under_jit, rng):
    args = [None if spec is None else _random(rng, *spec) for spec in (x, scale, bias)]
    call = lambda x, s, b: jaxdnn.group_norm(x, groups, s, b, **kwargs)
    with pytest.raises(error, match=rf"^group_norm: {match}"):
        if under_jit:
            jax.jit(call).lower(*args)
        else:
            call(*args)


@dtype_param
def test_lowered_hlo_holds_custom_calls(dtype, rng):
    x = normal(rng, (2, 3, 5, 40), dtype)
    scale, bias = _params(rng, 40)
    fwd = jax.jit(lambda x, s, b: jaxdnn.group_norm(x, 8, s, b)).lower(x, scale, bias).as_text()
    assert re.search(rf"custom_call @{FWD_TARGET}\(", fwd) and BWD_TARGET not in fwd
    loss = lambda x, s, b: jnp.sum(jaxdnn.group_norm(x, 8, s, b, activation="silu").astype(jnp.float32))
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, scale, bias).as_text()
    assert re.search(rf"custom_call @{FWD_TARGET}\(", bwd) and re.search(rf"custom_call @{BWD_TARGET}\(", bwd)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=dtype_id)
def test_half_params_reach_the_kernels_unconverted(dtype, rng):
    """scale and bias in x's 16-bit dtype go to the kernels as they are, and dscale and dbias come
    back in it: no conversion ops around the custom calls (each would be a kernel launch)."""
    x = normal(rng, (2, 3, 5, 40), dtype)
    scale, bias = (normal(rng, (40,), dtype) for _ in range(2))
    loss = lambda x, s, b: jnp.sum(jaxdnn.group_norm(x, 8, s, b).astype(jnp.float32))
    hlo = jax.jit(jax.grad(loss, argnums=(1, 2))).lower(x, scale, bias).as_text()
    name = jnp.dtype(dtype).name.replace("bfloat16", "bf16").replace("float16", "f16")
    calls = [line for line in hlo.splitlines() if "custom_call @" in line]
    assert len(calls) == 2 and all(f"tensor<40x{name}>" in line for line in calls), calls
    assert not re.search(rf"convert.*tensor<40x{name}>|tensor<40x{name}>.*convert", hlo)
    grads = jax.jit(jax.grad(loss, argnums=(1, 2)))(x, scale, bias)
    assert all(g.dtype == dtype for g in grads)


@pytest.mark.gpu
@dtype_param
def test_compiled_gpu_hlo_holds_custom_calls(dtype, rng):
    assert jaxdnn.has_cuda_kernels(), "running on a GPU but jaxdnn was built without CUDA"
    x = normal(rng, (4, 8, 8, 64), dtype)
    scale, bias = _params(rng, 64)
    loss = lambda x, s, b: jnp.sum(jaxdnn.group_norm(x, 32, s, b).astype(jnp.float32))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, scale, bias).compile().as_text()
    assert f'custom_call_target="{FWD_TARGET}"' in hlo and f'custom_call_target="{BWD_TARGET}"' in hlo
