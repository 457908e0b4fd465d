"""layer_norm and rms_norm under jax transformations (jit, grad, vmap, vmap of grad, grad of grad,
remat, scan, jacrev), each compared with the float64 reference put through the same transform."""

import jax
import jax.numpy as jnp
import pytest

from helpers import OPS, assert_close, f64, normal, tolerance, vjp

F32 = jnp.float32
FWD_TOL = tolerance(F32)
GRAD_TOL = tolerance(F32, grad=True)

op_param = pytest.mark.parametrize("op", OPS, ids=repr)


def _inputs(op, rng, shape, dtype=F32):
    x = normal(rng, shape, dtype, loc=1.5, scale=2.5)
    scale, bias = op.params(rng, shape[-1])
    return x, scale, bias


def _affine_args(op, scale, bias):
    """The parameters op takes positionally: (scale, bias) or (scale,)."""
    return (scale, bias) if op.has_bias else (scale,)


def _assert_all_close(got, want, tol, what):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, tol, f"{what}[{i}]")


@op_param
def test_jit(op, rng):
    x, scale, bias = _inputs(op, rng, (3, 7, 129))
    out = jax.jit(op)(x, scale, bias)
    assert_close(out, op.oracle(x, scale, bias), FWD_TOL, f"{op} jit")
    fixed = jax.jit(lambda x: op(x, scale, bias, epsilon=1e-3))(x)  # closed-over parameters
    assert_close(fixed, op.oracle(x, scale, bias, epsilon=1e-3), FWD_TOL, f"{op} jit closure")


@op_param
@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_grad(op, wrap, rng):
    x, scale, bias = _inputs(op, rng, (4, 3, 65))
    weights = normal(rng, x.shape)
    params = _affine_args(op, scale, bias)

    def loss(fn, x, *params):
        return jnp.sum(jnp.sin(fn(x, *params)) * weights.astype(x.dtype))

    argnums = tuple(range(1 + len(params)))
    got = wrap(jax.grad(lambda *a: loss(op, *a), argnums=argnums))(x, *params)
    want = jax.jit(jax.grad(lambda *a: loss(op.reference, *a), argnums=argnums))(
        f64(x), *map(f64, params))
    _assert_all_close(got, want, GRAD_TOL, f"{op} grad")


# (x in_axes, scale in_axes, bias in_axes), the per-example x shape, and the batch size.
VMAP_CASES = [
    ((0, None, None), (5, 33), 3),
    ((1, None, None), (5, 33), 3),
    ((2, None, None), (2, 5, 33), 3),
    ((-1, None, None), (5, 33), 4),    # batch axis after the features
    ((0, 0, 0), (5, 33), 3),           # per-example scale and bias
    ((1, 0, None), (2, 5, 33), 3),
    ((None, 0, 0), (5, 33), 3),        # shared x, per-example parameters
    ((0, None, 0), (33,), 6),
]


def _with_batch_axis(shape, axis, size):
    """`shape` with a batch axis of `size` at `axis` (an in_axes value; None: unbatched)."""
    if axis is None:
        return tuple(shape)
    full = list(shape)
    full.insert(axis if axis >= 0 else len(shape) + 1 + axis, size)
    return tuple(full)


def _vmap_inputs(op, rng, axes, example_shape, size):
    def batched(shape, axis, **kw):
        return normal(rng, _with_batch_axis(shape, axis, size), **kw)

    features = example_shape[-1]
    x = batched(example_shape, axes[0], loc=1.5, scale=2.5)
    scale = batched((features,), axes[1], loc=1.0, scale=0.5)
    bias = batched((features,), axes[2], loc=0.5) if op.has_bias else None
    return x, scale, bias


def _vmap_params():
    params = {}
    for op in OPS:
        for axes, shape, size in VMAP_CASES:
            axes = axes if op.has_bias else axes[:2]  # rms_norm has no bias
            params.setdefault((op, axes, shape), pytest.param(op, axes, shape, size,
                                                              id=f"{op}-{axes}-{shape}"))
    return list(params.values())


@pytest.mark.parametrize("op,axes,example_shape,size", _vmap_params())
def test_vmap(op, axes, example_shape, size, rng):
    x, scale, bias = _vmap_inputs(op, rng, axes, example_shape, size)
    args = (x, *_affine_args(op, scale, bias))
    vmapped = jax.jit(jax.vmap(op, in_axes=axes))
    got = vmapped(*args)
    want = jax.jit(jax.vmap(op.reference, in_axes=axes))(*map(f64, args))
    assert got.shape == want.shape and got.dtype == x.dtype
    assert_close(got, want, FWD_TOL, f"{op} vmap")
    # The batch is folded into the kernel's rows: one call, not a loop over the examples.
    hlo = vmapped.lower(*args).as_text()
    assert hlo.count(f"@{op.fwd_target}(") == 1 and "stablehlo.while" not in hlo, hlo
    # A random cotangent through the vmapped function: reductions over the batch for unbatched
    # parameters, per-example ones for batched parameters.
    cotangent = normal(rng, got.shape)
    grads = vjp(jax.vmap(op, in_axes=axes), args, cotangent)
    want = vjp(jax.vmap(op.reference, in_axes=axes), [f64(a) for a in args], f64(cotangent))
    _assert_all_close(grads, want, GRAD_TOL, f"{op} vjp of vmap")


@pytest.mark.parametrize("op,axes,example_shape,size", _vmap_params())
def test_vmap_of_grad(op, axes, example_shape, size, rng):
    """Per-example gradients of x and of the parameters."""
    x, scale, bias = _vmap_inputs(op, rng, axes, example_shape, size)
    args = (x, *_affine_args(op, scale, bias))
    # A per-example cotangent, batched along the axis of x (axis 0 if x is shared).
    ct_axis = 0 if axes[0] is None else axes[0]
    weights = normal(rng, _with_batch_axis(example_shape, ct_axis, size))

    def per_example(fn):
        def loss(w, *a):
            return jnp.sum(fn(*a) * w.astype(a[0].dtype))
        grad = jax.grad(loss, argnums=tuple(range(1, 1 + len(args))))
        return jax.vmap(grad, in_axes=(ct_axis, *axes))

    got = jax.jit(per_example(op))(weights, *args)
    want = jax.jit(per_example(op.reference))(f64(weights), *map(f64, args))
    for g, w in zip(got, want):
        assert g.shape == w.shape
    _assert_all_close(got, want, GRAD_TOL, f"{op} vmap(grad)")


@op_param
def test_vmap_of_grad_bfloat16(op, rng):
    x = normal(rng, (6, 4, 130), jnp.bfloat16, loc=1.0, scale=2.0)
    params = _affine_args(op, *op.params(rng, 130, jnp.bfloat16))
    cotangent = normal(rng, x.shape, jnp.bfloat16)

    def per_example(fn, x, params, cotangent):
        return jax.vmap(lambda x, ct: vjp(fn, (x, *params), ct))(x, cotangent)

    got = per_example(op, x, params, cotangent)
    want = per_example(op.reference, f64(x), [f64(p) for p in params], f64(cotangent))
    _assert_all_close(got, want, tolerance(jnp.bfloat16, grad=True), f"{op} bf16 vmap(grad)")


@op_param
def test_grad_of_grad(op, rng):
    """A gradient penalty: d/d(x, scale) of ||d loss / dx||^2 + ||d loss / dscale||^2."""
    x, scale, bias = _inputs(op, rng, (3, 4, 37))
    weights = normal(rng, x.shape)

    def penalty(fn, x, scale):
        def loss(x, scale):
            return jnp.sum(fn(x, scale, bias) * weights.astype(x.dtype))
        dx, dscale = jax.grad(loss, argnums=(0, 1))(x, scale)
        return jnp.sum(dx**2) + jnp.sum(dscale**2)

    def penalty_grad(fn):
        return jax.jit(jax.grad(lambda *a: penalty(fn, *a), argnums=(0, 1)))

    got = penalty_grad(op)(x, scale)
    want = penalty_grad(op.reference)(f64(x), f64(scale))
    _assert_all_close(got, want, GRAD_TOL, f"{op} grad of grad")
    # And the Hessian-vector product of the loss in a random direction.
    direction = normal(rng, x.shape)

    def hvp(fn):
        loss = lambda x: jnp.sum(fn(x, scale, bias) ** 2)  # noqa: E731
        return jax.jit(lambda x, v: jax.grad(lambda x: jnp.vdot(jax.grad(loss)(x), v))(x))

    assert_close(hvp(op)(x, direction), hvp(op.reference)(f64(x), f64(direction)), GRAD_TOL,
                 f"{op} hvp")


@op_param
@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable,
                                    jax.checkpoint_policies.everything_saveable],
                         ids=["default", "nothing_saveable", "everything_saveable"])
def test_remat(op, policy, rng):
    x, scale, bias = _inputs(op, rng, (5, 96))
    cotangent = normal(rng, x.shape)

    def block(fn):
        def f(x, scale, bias):
            h = fn(x, scale, bias)
            return fn(jnp.tanh(h) + x, scale, bias)
        return jax.checkpoint(f, policy=policy)

    args = (x, scale, bias)
    got = vjp(block(op), args, cotangent)
    want = vjp(block(op.reference), [f64(a) for a in args], f64(cotangent))
    _assert_all_close(got, want, GRAD_TOL, f"{op} remat")


@op_param
def test_scan_over_layers(op, rng):
    layers, features = 4, 48
    x = normal(rng, (6, features), loc=0.5, scale=2.0)
    weights = normal(rng, (layers, features, features), scale=features**-0.5)
    scales = normal(rng, (layers, features), loc=1.0, scale=0.3)
    biases = normal(rng, (layers, features), scale=0.3) if op.has_bias else None
    target = normal(rng, (6, features))

    def loss(fn, x, weights, scales, biases):
        def layer(h, p):
            w, s, b = p
            # HIGHEST: on a GPU the default float32 matmul rounds through TF32 (~1e-4 error).
            return h + jnp.tanh(jnp.matmul(fn(h, s, b), w, precision=jax.lax.Precision.HIGHEST)), None
        h, _ = jax.lax.scan(layer, x, (weights, scales, biases))
        return jnp.sum((h - target.astype(h.dtype)) ** 2)

    args = (x, weights, scales, biases)
    argnums = (0, 1, 2, 3) if op.has_bias else (0, 1, 2)
    def value_and_grad(fn):
        return jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums))

    got_loss, got = value_and_grad(op)(*args)
    want_loss, want = value_and_grad(op.reference)(*map(f64, args))
    assert_close(got_loss, want_loss, FWD_TOL, f"{op} scan loss")
    _assert_all_close(got, want, GRAD_TOL, f"{op} scan grad")


@op_param
def test_jacrev(op, rng):
    x, scale, bias = _inputs(op, rng, (3, 5))
    argnums = (0, 1, 2) if op.has_bias else (0, 1)
    args = (x, scale, bias) if op.has_bias else (x, scale)
    got = jax.jit(jax.jacrev(op, argnums=argnums))(*args)
    want = jax.jit(jax.jacrev(op.reference, argnums=argnums))(*map(f64, args))
    assert got[0].shape == (3, 5, 3, 5) and got[1].shape == (3, 5, 5)
    _assert_all_close(got, want, GRAD_TOL, f"{op} jacrev")


@op_param
@pytest.mark.parametrize("transform", [
    lambda f, x: jax.jvp(f, (x,), (x,)),
    lambda f, x: jax.jacfwd(f)(x),
    lambda f, x: jax.linearize(f, x)[1](x),
], ids=["jvp", "jacfwd", "linearize"])
def test_forward_mode_raises(op, transform, rng):
    x, scale, bias = _inputs(op, rng, (2, 9))
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        transform(lambda x: op(x, scale, bias), x)
