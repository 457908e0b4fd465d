"""jaxdnn's BatchNorm modules (Flax linen, NNX, Haiku) against the stock ones: the same params and
state trees, the same outputs in training and inference, the same updated statistics and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close, normal

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
hk = pytest.importorskip("haiku")

import jaxdnn.flax.linen as jlinen  # noqa: E402
import jaxdnn.flax.nnx as jnnx  # noqa: E402
import jaxdnn.haiku as jhaiku  # noqa: E402


def _tree_close(got, want, tol, what):
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype, what
        assert_close(g, w, tol, what)


def _randomize(rng, tree):
    """Every leaf random near 1 and positive: the running variances must be (a negative one, a 3-sigma
    draw of normal(1, 0.3), made both implementations' inference NaN: CI seed 1320225958)."""
    return jax.tree.map(lambda a: jnp.abs(normal(rng, a.shape, a.dtype, loc=1.0, scale=0.3)) + 0.05, tree)


@pytest.mark.parametrize("shape,axis", [((4, 5, 5, 12), -1), ((3, 6, 4, 5), 1)], ids=str)
def test_linen_batch_norm_matches_stock(rng, shape, axis):
    x = normal(rng, shape, loc=0.5, scale=2.0)
    kw = dict(momentum=0.9, epsilon=1e-5, axis=axis)
    stock, ours = nn.BatchNorm(**kw), jlinen.BatchNorm(**kw)
    variables = stock.init(jax.random.key(0), x, use_running_average=False)
    assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), x, use_running_average=False)) == \
        jax.tree.map(jnp.shape, variables)
    variables = _randomize(rng, variables)
    ct = normal(rng, shape)

    def train(module, params, x):
        y, updates = module.apply({**variables, "params": params}, x, use_running_average=False,
                                  mutable=["batch_stats"])
        return jnp.sum(y * ct), (y, updates)

    (_, (y, updates)), grads = jax.value_and_grad(train, argnums=(1, 2), has_aux=True)(
        ours, variables["params"], x)
    (_, (want_y, want_updates)), want_grads = jax.value_and_grad(train, argnums=(1, 2), has_aux=True)(
        stock, variables["params"], x)
    assert_close(y, want_y, 1e-5, "train y")
    _tree_close(updates, want_updates, 1e-5, "batch_stats")
    _tree_close(grads, want_grads, 1e-4, "grads")
    infer = ours.apply(variables, x, use_running_average=True)
    assert_close(infer, stock.apply(variables, x, use_running_average=True), 1e-5, "inference y")


def test_nnx_batch_norm_matches_stock(rng):
    x = normal(rng, (6, 4, 4, 10), loc=-0.5, scale=1.5)
    stock = nnx.BatchNorm(10, momentum=0.8, rngs=nnx.Rngs(0))
    ours = jnnx.BatchNorm(10, momentum=0.8, rngs=nnx.Rngs(0))
    nnx.update(stock, _randomize(rng, nnx.state(stock)))
    nnx.update(ours, nnx.state(stock))
    assert_close(ours(x), stock(x), 1e-5, "train y")
    _tree_close(nnx.state(ours, nnx.BatchStat), nnx.state(stock, nnx.BatchStat), 1e-5, "batch stats")
    assert_close(ours(x, use_running_average=True), stock(x, use_running_average=True), 1e-5, "inference y")
    grad = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x, use_running_average=True))))
    _tree_close(grad(ours), grad(stock), 1e-4, "grads")


@pytest.mark.parametrize("data_format,shape", [("channels_last", (4, 5, 5, 8)),
                                               ("channels_first", (4, 8, 3, 5))], ids=["NHWC", "NCHW"])
def test_haiku_batch_norm_matches_stock(rng, data_format, shape):
    x = normal(rng, shape, loc=0.3, scale=2.0)

    def forward(cls):
        return hk.transform_with_state(
            lambda x, training: cls(True, True, 0.9, data_format=data_format)(x, is_training=training))

    stock, ours = forward(hk.BatchNorm), forward(jhaiku.BatchNorm)
    params, state = stock.init(jax.random.key(0), x, True)
    ours_params, ours_state = ours.init(jax.random.key(0), x, True)
    assert jax.tree.map(jnp.shape, (ours_params, ours_state)) == jax.tree.map(jnp.shape, (params, state))
    params = _randomize(rng, params)
    for training in (True, False):
        y, new_state = ours.apply(params, state, None, x, training)
        want_y, want_state = stock.apply(params, state, None, x, training)
        assert_close(y, want_y, 1e-5, f"y, training={training}")
        _tree_close(new_state, want_state, 1e-5, f"state, training={training}")
        state = new_state


@pytest.mark.parametrize("make,message", [
    (lambda: jlinen.BatchNorm(use_running_average=False, axis_name="batch"), "axis_name"),
    (lambda: jlinen.BatchNorm(use_running_average=False, axis=(1, 2)), "single feature axis"),
], ids=["axis_name", "two-axes"])
def test_linen_unsupported_options_raise(rng, make, message):
    with pytest.raises(ValueError, match=message):
        make().init(jax.random.key(0), normal(rng, (2, 3, 4)))


def test_haiku_unsupported_options_raise(rng):
    for kwargs, message in [(dict(axis=[0]), "axis must be None"),
                            (dict(cross_replica_axis="i"), "cross_replica")]:
        module = lambda x: jhaiku.BatchNorm(True, True, 0.9, **kwargs)(x, is_training=True)
        f = hk.transform_with_state(module)
        with pytest.raises(ValueError, match=message):
            f.init(jax.random.key(0), normal(rng, (2, 4)))


def test_modules_lower_to_the_kernels(rng):
    x = normal(rng, (2, 3, 3, 4))
    module = jlinen.BatchNorm(use_running_average=False)
    variables = module.init(jax.random.key(0), x)
    hlo = jax.jit(lambda v, x: module.apply(v, x, mutable=["batch_stats"])).lower(variables, x).as_text()
    assert "jaxdnn_batch_norm_stats_v1" in hlo and "jaxdnn_batch_norm_fwd_v1" in hlo
    np.testing.assert_equal(module.apply(variables, x, mutable=["batch_stats"])[0].shape, x.shape)
