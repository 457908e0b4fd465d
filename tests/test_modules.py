"""jaxdnn's Flax (linen, NNX) and Haiku modules against the stock ones.

Each jaxdnn module, given the same params and inputs as its stock Flax/Haiku
counterpart, must give the same params tree (names, shapes, dtypes), the same
output dtype, the same outputs and the same gradients w.r.t. params and inputs,
compared by relative error in float64 (fp32 < 1e-5, bf16 < 2e-2; gradients 10x).
Random data comes from the `rng` fixture of tests/conftest.py (fresh seed per test,
replayable with JAXDNN_TEST_SEED).
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest


nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

import jaxdnn.flax as jflax  # noqa: E402
from jaxdnn.flax import nnx as jnnx  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
SHAPES = [(3, 5, 37), (4, 256)]
X_DTYPES = [F32, BF16]
TOL = {jnp.dtype(F32): 1e-5, jnp.dtype(BF16): 2e-2}
GRAD_FACTOR = 10


def _f64(a):
    a = jnp.asarray(a)
    if a.dtype == BF16:
        a = a.astype(F32)  # exact; numpy cannot convert bfloat16 itself
    return np.asarray(a, np.float64)


def rel_err(a, b):
    """‖a − b‖ / ‖b‖ in float64 (‖a − b‖ when b is all zeros; 0 for empty arrays)."""
    a, b = _f64(a), _f64(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = np.linalg.norm((a - b).ravel())
    ref = np.linalg.norm(b.ravel())
    return diff / ref if ref > 0 else diff


def tol(*dtypes):
    """The tolerance of the least precise dtype involved."""
    return max(TOL[jnp.dtype(d)] for d in dtypes)


def normal(rng, shape, dtype, loc=0.0, scale=1.0):
    return jnp.asarray(rng.normal(loc, scale, shape).astype(np.float32)).astype(dtype)


def randomize(rng, tree):
    """Replaces every leaf by random values of its shape and dtype (scales near 1)."""
    return jax.tree.map(lambda p: normal(rng, p.shape, p.dtype, 1.0, 0.5), tree)


def assert_same_structure(a, b):
    """Same paths, shapes and dtypes."""
    sig = lambda t: [(jax.tree_util.keystr(k), jnp.shape(v), jnp.asarray(v).dtype)
                     for k, v in jax.tree_util.tree_flatten_with_path(t)[0]]
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert sig(a) == sig(b)


def assert_close_trees(got, want, tolerance, what):
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        assert g.dtype == w.dtype, f"{what}{jax.tree_util.keystr(path)}: {g.dtype} vs {w.dtype}"
        err = rel_err(g, w)
        assert err < tolerance, f"{what}{jax.tree_util.keystr(path)}: rel. error {err:.3g}"


def check_fn_pair(rng, ours, stock, params, x):
    """ours(params, x) vs stock(params, x): output dtype/value, and grads w.r.t. both."""
    y_ref = stock(params, x)
    y = jax.jit(ours)(params, x)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    t = tol(x.dtype, y.dtype, *(p.dtype for p in jax.tree.leaves(params)))
    assert rel_err(y, y_ref) < t, rel_err(y, y_ref)

    cotangent = normal(rng, y.shape, F32)
    loss = lambda f: (lambda p, x: jnp.sum(f(p, x).astype(F32) * cotangent))
    g_ref = jax.grad(loss(stock), argnums=(0, 1))(params, x)
    g = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(params, x)
    assert_close_trees(g, g_ref, GRAD_FACTOR * t, "grad")


# --- flax.linen -----------------------------------------------------------------------------

LINEN_PAIRS = [(jflax.LayerNorm, nn.LayerNorm), (jflax.RMSNorm, nn.RMSNorm)]
LINEN_CONFIGS = [
    {},
    {"dtype": BF16},                 # output in bf16, params f32
    {"dtype": F32},                  # output in f32 even for bf16 inputs
    {"param_dtype": BF16},
    {"epsilon": 1e-3, "use_scale": False},
]


@pytest.mark.parametrize("config", LINEN_CONFIGS, ids=str)
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("ours_cls,stock_cls", LINEN_PAIRS, ids=lambda c: c.__name__)
def test_linen_matches_stock(rng, ours_cls, stock_cls, shape, x_dtype, config):
    ours, stock = ours_cls(**config), stock_cls(**config)
    x = normal(rng, shape, x_dtype, 0.5, 2.0)
    v_stock = stock.init(jax.random.key(0), x)
    v_ours = ours.init(jax.random.key(0), x)
    assert_same_structure(v_ours, v_stock)
    assert set(v_stock.get("params", {})) <= {"scale", "bias"}
    params = randomize(rng, v_stock)
    check_fn_pair(rng, ours.apply, stock.apply, params, x)


def test_linen_layer_norm_without_bias(rng):
    x = normal(rng, (6, 33), F32, -1.0, 3.0)
    v = nn.LayerNorm(use_bias=False).init(jax.random.key(0), x)
    assert set(v["params"]) == {"scale"}
    params = randomize(rng, v)
    check_fn_pair(rng, jflax.LayerNorm(use_bias=False).apply,
                  nn.LayerNorm(use_bias=False).apply, params, x)


@pytest.mark.parametrize("use_fast_variance", [True, False])
def test_linen_use_fast_variance_either_value(rng, use_fast_variance):
    x = normal(rng, (5, 64), F32, 3.0, 0.5)
    stock = nn.LayerNorm(use_fast_variance=use_fast_variance)
    params = randomize(rng, stock.init(jax.random.key(0), x))
    check_fn_pair(rng, jflax.LayerNorm(use_fast_variance=use_fast_variance).apply,
                  stock.apply, params, x)


def test_linen_positive_last_axis_accepted(rng):
    x = normal(rng, (2, 3, 17), F32)
    stock = nn.RMSNorm(reduction_axes=2, feature_axes=(2,))
    params = randomize(rng, stock.init(jax.random.key(0), x))
    check_fn_pair(rng, jflax.RMSNorm(reduction_axes=2, feature_axes=(2,)).apply,
                  stock.apply, params, x)


def test_linen_empty_batch(rng):
    x = normal(rng, (0, 16), F32)
    params = randomize(rng, nn.LayerNorm().init(jax.random.key(0), x))
    y = jflax.LayerNorm().apply(params, x)
    assert y.shape == (0, 16) and y.dtype == F32


def test_params_load_either_way(rng):
    """Params initialized by jaxdnn's modules drive stock Flax and vice versa."""
    x = normal(rng, (4, 40), F32)
    v_ours = randomize(rng, jflax.LayerNorm().init(jax.random.key(1), x))
    assert rel_err(nn.LayerNorm().apply(v_ours, x), jflax.LayerNorm().apply(v_ours, x)) < 1e-5


# (reduction_axes, feature_axes) of a rank-4 input [N, H, W, C] that Flax allows and the kernels
# serve: trailing axes (a free reshape), axes that are not trailing (a transpose each way), every
# axis, and params over some of the reduced axes only (broadcast over the others).
OTHER_AXES = [((-2, -1), -1), ((1, 2, 3), (1, 2, 3)), ((1,), (1,)), ((0, 1, 2, 3), -1), ((1, 3), (3,)),
              ((2, 1), 2)]


@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("axes", OTHER_AXES, ids=str)
@pytest.mark.parametrize("ours_cls,stock_cls", LINEN_PAIRS, ids=lambda c: c.__name__)
def test_linen_other_axes(rng, ours_cls, stock_cls, axes, x_dtype):
    reduction, features = axes
    ours, stock = (cls(reduction_axes=reduction, feature_axes=features) for cls in (ours_cls, stock_cls))
    x = normal(rng, (3, 4, 5, 6), x_dtype, 0.5, 2.0)
    v_stock = stock.init(jax.random.key(0), x)
    assert_same_structure(ours.init(jax.random.key(0), x), v_stock)
    check_fn_pair(rng, ours.apply, stock.apply, randomize(rng, v_stock), x)


@pytest.mark.parametrize("kwargs,call_kwargs", [
    ({"reduction_axes": 1}, {}),        # feature_axes -1 is not reduced: params would vary by row
    ({"reduction_axes": -2}, {}),
    ({"feature_axes": 0}, {}),
    ({"feature_axes": (1, 2)}, {}),
    ({"reduction_axes": 3}, {}),        # past the input's rank
    ({"reduction_axes": ()}, {}),
    ({"feature_axes": "c"}, {}),
    ({"axis_name": "batch"}, {}),
    ({"axis_index_groups": [[0, 1]]}, {}),
    ({"force_float32_reductions": False}, {}),
    ({}, {"mask": np.ones((3, 5, 37), bool)}),
], ids=str)
@pytest.mark.parametrize("cls", [jflax.LayerNorm, jflax.RMSNorm], ids=lambda c: c.__name__)
def test_linen_unsupported_options_raise(rng, cls, kwargs, call_kwargs):
    x = normal(rng, (3, 5, 37), F32)
    with pytest.raises(ValueError, match="jaxdnn"):
        cls(**kwargs).init(jax.random.key(0), x, **call_kwargs)


def test_linen_integer_dtype_raises(rng):
    x = normal(rng, (3, 8), F32)
    with pytest.raises(ValueError):
        jflax.LayerNorm(dtype=jnp.int32).init(jax.random.key(0), x)


class _MLP(nn.Module):
    """Dense -> LayerNorm -> relu -> Dense -> RMSNorm, with the norm classes plugged in."""
    layer_norm: type
    rms_norm: type

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(48)(x)
        x = self.layer_norm()(x)
        x = nn.relu(x)
        x = nn.Dense(10)(x)
        return self.rms_norm()(x)


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_linen_model_one_optax_step(rng):
    x = normal(rng, (32, 20), F32)
    labels = jnp.asarray(rng.integers(0, 10, 32))
    stock = _MLP(nn.LayerNorm, nn.RMSNorm)
    ours = _MLP(jflax.LayerNorm, jflax.RMSNorm)
    params = stock.init(jax.random.key(0), x)["params"]
    assert_same_structure(ours.init(jax.random.key(0), x)["params"], params)
    params = jax.tree.map(lambda p: p + normal(rng, p.shape, p.dtype, 0.0, 0.1), params)

    # Adam's first step is lr * g / (|g| + eps): with optax's eps = 1e-8 a gradient element near zero
    # turns its float32 rounding into a sign flip (CI seed 122069287: one element, rel. error 3e-4).
    # A larger eps keeps the step a smooth function of the gradient, which is what is compared.
    tx = optax.adam(1e-2, eps=1e-3)

    def step(model):
        @jax.jit
        def train_step(params, opt_state):
            loss_fn = lambda p: _xent(model.apply({"params": p}, x), labels)
            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            return loss, grads, new_params, loss_fn(new_params)
        return train_step(params, tx.init(params))

    loss_ref, grads_ref, new_ref, after_ref = step(stock)
    loss, grads, new, after = step(ours)
    assert rel_err(loss, loss_ref) < 1e-5
    assert_close_trees(grads, grads_ref, GRAD_FACTOR * 1e-5, "grads")
    assert_close_trees(new, new_ref, 1e-5, "params after one step")
    assert rel_err(after, after_ref) < 1e-5


# --- flax.nnx -------------------------------------------------------------------------------

NNX_PAIRS = [(jnnx.LayerNorm, nnx.LayerNorm), (jnnx.RMSNorm, nnx.RMSNorm)]
NNX_CONFIGS = [{}, {"dtype": BF16}, {"dtype": F32}, {"param_dtype": BF16}]


def _nnx_fn(module):
    """module as a pure function of (its Param state, x)."""
    graphdef, state = nnx.split(module, nnx.Param)
    return (lambda p, x: nnx.merge(graphdef, p)(x)), state


@pytest.mark.parametrize("config", NNX_CONFIGS, ids=str)
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("ours_cls,stock_cls", NNX_PAIRS, ids=lambda c: c.__name__)
def test_nnx_matches_stock(rng, ours_cls, stock_cls, shape, x_dtype, config):
    d = shape[-1]
    stock = stock_cls(d, rngs=nnx.Rngs(0), **config)
    ours = ours_cls(d, rngs=nnx.Rngs(0), **config)
    assert_same_structure(nnx.to_pure_dict(nnx.state(ours, nnx.Param)),
                          nnx.to_pure_dict(nnx.state(stock, nnx.Param)))
    # Stock weights load into jaxdnn's module unchanged.
    nnx.update(stock, randomize(rng, nnx.state(stock, nnx.Param)))
    nnx.update(ours, nnx.state(stock, nnx.Param))
    stock_fn, params = _nnx_fn(stock)
    ours_fn, _ = _nnx_fn(ours)
    x = normal(rng, shape, x_dtype, 0.5, 2.0)
    assert ours(x).dtype == stock(x).dtype
    check_fn_pair(rng, ours_fn, stock_fn, params, x)


def test_nnx_layer_norm_without_bias_or_scale(rng):
    x = normal(rng, (7, 24), F32)
    for kw in ({"use_bias": False}, {"use_scale": False}, {"use_bias": False, "use_scale": False}):
        stock = nnx.LayerNorm(24, rngs=nnx.Rngs(0), **kw)
        ours = jnnx.LayerNorm(24, rngs=nnx.Rngs(0), **kw)
        nnx.update(stock, randomize(rng, nnx.state(stock, nnx.Param)))
        nnx.update(ours, nnx.state(stock, nnx.Param))
        stock_fn, params = _nnx_fn(stock)
        ours_fn, _ = _nnx_fn(ours)
        check_fn_pair(rng, ours_fn, stock_fn, params, x)


@pytest.mark.parametrize("kwargs", [
    {"reduction_axes": ()},
    {"reduction_axes": 1.5},
    {"feature_axes": None},
    {"axis_name": "batch"},
], ids=str)
@pytest.mark.parametrize("cls", [jnnx.LayerNorm, jnnx.RMSNorm], ids=lambda c: c.__name__)
def test_nnx_unsupported_options_raise(cls, kwargs):
    with pytest.raises(ValueError, match="jaxdnn"):
        cls(8, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("axes", [((-2, -1), -1), ((1, 2), 2), ((0, 1, 2), -1)], ids=str)
@pytest.mark.parametrize("ours_cls,stock_cls", NNX_PAIRS, ids=lambda c: c.__name__)
def test_nnx_other_axes(rng, ours_cls, stock_cls, axes):
    reduction, features = axes
    x = normal(rng, (3, 5, 8), F32, 0.5, 2.0)
    stock, ours = (cls(8, rngs=nnx.Rngs(0), reduction_axes=reduction, feature_axes=features)
                   for cls in (stock_cls, ours_cls))
    nnx.update(stock, randomize(rng, nnx.state(stock, nnx.Param)))
    nnx.update(ours, nnx.state(stock, nnx.Param))
    (stock_fn, params), (ours_fn, _) = _nnx_fn(stock), _nnx_fn(ours)
    check_fn_pair(rng, ours_fn, stock_fn, params, x)


@pytest.mark.parametrize("cls", [jnnx.LayerNorm, jnnx.RMSNorm], ids=lambda c: c.__name__)
def test_nnx_unsupported_call_options_raise(rng, cls):
    x = normal(rng, (2, 3, 8), F32)
    with pytest.raises(ValueError, match="jaxdnn"):
        cls(8, rngs=nnx.Rngs(0), reduction_axes=1)(x)   # axis 1 of a rank-3 input
    with pytest.raises(ValueError, match="jaxdnn"):
        cls(8, rngs=nnx.Rngs(0))(x, mask=jnp.ones(x.shape, bool))


class _NnxMLP(nnx.Module):
    def __init__(self, norms, rngs):
        layer_norm, rms_norm = norms
        self.dense1 = nnx.Linear(20, 48, rngs=rngs)
        self.norm1 = layer_norm(48, rngs=rngs)
        self.dense2 = nnx.Linear(48, 10, rngs=rngs)
        self.norm2 = rms_norm(10, rngs=rngs)

    def __call__(self, x):
        return self.norm2(self.dense2(nnx.relu(self.norm1(self.dense1(x)))))


def test_nnx_model_one_optax_step(rng):
    x = normal(rng, (32, 20), F32)
    labels = jnp.asarray(rng.integers(0, 10, 32))
    stock = _NnxMLP((nnx.LayerNorm, nnx.RMSNorm), nnx.Rngs(0))
    ours = _NnxMLP((jnnx.LayerNorm, jnnx.RMSNorm), nnx.Rngs(0))
    nnx.update(stock, jax.tree.map(lambda p: p + normal(rng, p.shape, p.dtype, 0.0, 0.1),
                                   nnx.state(stock, nnx.Param)))
    nnx.update(ours, nnx.state(stock, nnx.Param))
    # Adam's first step is lr * g / (|g| + eps): with optax's eps = 1e-8 a gradient element near zero
    # turns its float32 rounding into a sign flip (CI seed 122069287: one element, rel. error 3e-4).
    # A larger eps keeps the step a smooth function of the gradient, which is what is compared.
    tx = optax.adam(1e-2, eps=1e-3)

    def step(model):
        graphdef, params = nnx.split(model, nnx.Param)
        loss_fn = lambda p: _xent(nnx.merge(graphdef, p)(x), labels)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, _ = tx.update(grads, tx.init(params), params)
        new_params = optax.apply_updates(params, updates)
        return loss, grads, new_params, loss_fn(new_params)

    loss_ref, grads_ref, new_ref, after_ref = step(stock)
    loss, grads, new, after = step(ours)
    assert rel_err(loss, loss_ref) < 1e-5
    assert_close_trees(grads, grads_ref, GRAD_FACTOR * 1e-5, "grads")
    assert_close_trees(new, new_ref, 1e-5, "params after one step")
    assert rel_err(after, after_ref) < 1e-5


# --- haiku ----------------------------------------------------------------------------------

@pytest.fixture
def hk():
    return pytest.importorskip("haiku")


@pytest.fixture
def jhk(hk):
    import jaxdnn.haiku
    return jaxdnn.haiku


def _hk_pair(hk, make_ours, make_stock):
    ours = hk.without_apply_rng(hk.transform(lambda x: make_ours()(x)))
    stock = hk.without_apply_rng(hk.transform(lambda x: make_stock()(x)))
    return ours, stock


HAIKU_CASES = [
    ("LayerNorm", {"create_scale": True, "create_offset": True}),
    ("LayerNorm", {"create_scale": True, "create_offset": False}),
    ("LayerNorm", {"create_scale": False, "create_offset": False, "eps": 1e-3}),
    ("RMSNorm", {}),
    ("RMSNorm", {"create_scale": False}),
]


@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name,kwargs", HAIKU_CASES, ids=str)
def test_haiku_matches_stock(rng, hk, jhk, name, kwargs, shape, x_dtype):
    ours, stock = _hk_pair(hk, lambda: getattr(jhk, name)(axis=-1, **kwargs),
                           lambda: getattr(hk, name)(axis=-1, **kwargs))
    x = normal(rng, shape, x_dtype, 0.5, 2.0)
    p_stock = stock.init(jax.random.key(0), x)
    assert_same_structure(ours.init(jax.random.key(0), x), p_stock)
    params = randomize(rng, p_stock)
    check_fn_pair(rng, ours.apply, stock.apply, params, x)


def test_haiku_float32_params_with_bfloat16_inputs(rng, hk, jhk):
    """Params loaded in float32 with bf16 inputs: Haiku's arithmetic gives float32 out."""
    x32 = normal(rng, (4, 256), F32)
    for name, kw in (("LayerNorm", {"create_scale": True, "create_offset": True}),
                     ("RMSNorm", {})):
        ours, stock = _hk_pair(hk, lambda: getattr(jhk, name)(-1, **kw),
                               lambda: getattr(hk, name)(-1, **kw))
        params = randomize(rng, stock.init(jax.random.key(0), x32))
        check_fn_pair(rng, ours.apply, stock.apply, params, x32.astype(BF16))


@pytest.mark.parametrize("use_fast_variance", [True, False])
def test_haiku_use_fast_variance_either_value(rng, hk, jhk, use_fast_variance):
    kw = {"create_scale": True, "create_offset": True, "use_fast_variance": use_fast_variance}
    ours, stock = _hk_pair(hk, lambda: jhk.LayerNorm(-1, **kw), lambda: hk.LayerNorm(-1, **kw))
    x = normal(rng, (5, 64), F32, 3.0, 0.5)
    params = randomize(rng, stock.init(jax.random.key(0), x))
    check_fn_pair(rng, ours.apply, stock.apply, params, x)


def test_haiku_call_time_scale_and_offset(rng, hk, jhk):
    x = normal(rng, (3, 5, 37), F32)
    scale, offset = normal(rng, (37,), F32, 1.0, 0.5), normal(rng, (1, 1, 37), F32)
    make = lambda mod: hk.without_apply_rng(hk.transform(
        lambda x, s, o: mod.LayerNorm(-1, False, False)(x, s, o)))
    ours, stock = make(jhk), make(hk)
    assert ours.init(jax.random.key(0), x, scale, offset) == {}
    check_fn_pair(rng, lambda p, x: ours.apply(p, x, scale, offset),
                  lambda p, x: stock.apply(p, x, scale, offset), {}, x)


def test_haiku_positional_and_default_axis(rng, hk, jhk):
    """hk.LayerNorm's positional form works; axis defaults to -1 (Haiku requires it)."""
    x = normal(rng, (4, 30), F32)
    ours, stock = _hk_pair(hk, lambda: jhk.LayerNorm(-1, True, True, 1e-4),
                           lambda: hk.LayerNorm(-1, True, True, 1e-4))
    params = randomize(rng, stock.init(jax.random.key(0), x))
    check_fn_pair(rng, ours.apply, stock.apply, params, x)
    default = hk.without_apply_rng(hk.transform(lambda x: jhk.RMSNorm()(x)))
    assert_same_structure(default.init(jax.random.key(0), x),
                          hk.transform(lambda x: hk.RMSNorm(-1)(x)).init(jax.random.key(0), x))


# (module, kwargs) over other axes of a rank-4 input [N, H, W, C]: trailing axes (a free reshape),
# params over all of them or some, axes that are not trailing (a transpose each way), every axis.
HAIKU_OTHER_AXES = [
    ("LayerNorm", {"axis": (1, 2, 3)}),
    ("LayerNorm", {"axis": slice(1, None), "param_axis": (1, 2, 3)}),
    ("LayerNorm", {"axis": (-2, -1), "param_axis": (2, 3)}),
    ("LayerNorm", {"axis": 1, "param_axis": 1}),
    ("RMSNorm", {"axis": (-2, -1)}),
    ("RMSNorm", {"axis": (0, 1, 2, 3)}),
    ("RMSNorm", {"axis": 2, "param_axis": 2}),
]


@pytest.mark.parametrize("name,kwargs", HAIKU_OTHER_AXES, ids=str)
def test_haiku_other_axes(rng, hk, jhk, name, kwargs):
    if name == "LayerNorm":
        kwargs = {"create_scale": True, "create_offset": True, **kwargs}
    ours, stock = _hk_pair(hk, lambda: getattr(jhk, name)(**kwargs), lambda: getattr(hk, name)(**kwargs))
    x = normal(rng, (3, 4, 5, 6), F32, 0.5, 2.0)
    p_stock = stock.init(jax.random.key(0), x)
    assert_same_structure(ours.init(jax.random.key(0), x), p_stock)
    check_fn_pair(rng, ours.apply, stock.apply, randomize(rng, p_stock), x)


def test_haiku_call_time_params_over_other_axes(rng, hk, jhk):
    """Call-time scale and offset that vary along some normalized axes (not along the others)."""
    x = normal(rng, (3, 4, 5, 6), F32)
    scale, offset = normal(rng, (5, 6), F32, 1.0, 0.5), normal(rng, (4, 1, 1), F32)
    make = lambda mod: hk.without_apply_rng(hk.transform(
        lambda x, s, o: mod.LayerNorm((1, 2, 3), False, False)(x, s, o)))
    ours, stock = make(jhk), make(hk)
    check_fn_pair(rng, lambda p, x: ours.apply(p, x, scale, offset),
                  lambda p, x: stock.apply(p, x, scale, offset), {}, x)


@pytest.mark.parametrize("make", [
    lambda jhk: jhk.LayerNorm(axis=0, create_scale=True, create_offset=True),  # params vary by row
    lambda jhk: jhk.LayerNorm(axis=-2, create_scale=True, create_offset=True),
    lambda jhk: jhk.LayerNorm(axis=3, create_scale=True, create_offset=True),  # past the rank
    lambda jhk: jhk.LayerNorm(axis=(), create_scale=True, create_offset=True),
    lambda jhk: jhk.LayerNorm(-1, True, True, param_axis=0),
    lambda jhk: jhk.LayerNorm(-1, False, True, scale_init=jnp.ones),
    lambda jhk: jhk.RMSNorm(axis=1),
    lambda jhk: jhk.RMSNorm(axis="c"),
    lambda jhk: jhk.RMSNorm(-1, param_axis=(0,)),
    lambda jhk: jhk.RMSNorm(-1, create_scale=False, scale_init=jnp.ones),
], ids=range(10))
def test_haiku_unsupported_options_raise(rng, hk, jhk, make):
    x = normal(rng, (3, 5, 37), F32)
    with pytest.raises(ValueError):
        hk.transform(lambda x: make(jhk)(x)).init(jax.random.key(0), x)


def test_haiku_call_time_scale_per_row_raises(rng, hk, jhk):
    x = normal(rng, (3, 37), F32)
    with pytest.raises(ValueError, match="jaxdnn"):
        hk.transform(lambda x: jhk.LayerNorm(-1, False, False)(x, jnp.ones((3, 37)))).init(
            jax.random.key(0), x)


# --- optional dependencies ------------------------------------------------------------------

def test_import_jaxdnn_does_not_import_flax_or_haiku(tmp_path):
    code = ("import sys, jaxdnn\n"
            "optional = ('flax', 'haiku', 'jaxdnn.flax', 'jaxdnn.haiku')\n"
            "bad = [m for m in optional if m in sys.modules]\n"
            "assert not bad, bad\n"
            "import jaxdnn.flax\n"
            "assert 'flax.linen' in sys.modules and 'haiku' not in sys.modules\n")
    subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, check=True)


# --- no silent fallback ---------------------------------------------------------------------

def _lowered_text(fn, *args):
    return jax.jit(fn).lower(*args).as_text()


def test_modules_lower_to_jaxdnn_kernels(rng, hk, jhk):
    """Every module's forward and backward reach jaxdnn's custom calls."""
    x = normal(rng, (4, 24), F32)
    ct = normal(rng, (4, 24), F32)
    fns = {}
    for name in ("LayerNorm", "RMSNorm"):
        linen_mod = getattr(jflax, name)()
        fns[f"linen.{name}"] = (linen_mod.apply, linen_mod.init(jax.random.key(0), x))
        nnx_fn, nnx_params = _nnx_fn(getattr(jnnx, name)(24, rngs=nnx.Rngs(0)))
        fns[f"nnx.{name}"] = (nnx_fn, nnx_params)
        hk_mod = hk.without_apply_rng(hk.transform(lambda x, name=name: getattr(jhk, name)(-1)(x)))
        fns[f"haiku.{name}"] = (hk_mod.apply, hk_mod.init(jax.random.key(0), x))
    for what, (fn, params) in fns.items():
        target = "jaxdnn_layer_norm" if what.endswith("LayerNorm") else "jaxdnn_rms_norm"
        fwd = _lowered_text(fn, params, x)
        assert f"{target}_fwd" in fwd, what
        grad_fn = jax.grad(lambda p, x: jnp.sum(fn(p, x) * ct), argnums=(0, 1))
        bwd = _lowered_text(grad_fn, params, x)
        assert f"{target}_bwd" in bwd, what


# --- GroupNorm (channels last) --------------------------------------------------------------

GN_SHAPES = [(2, 5, 6, 64), (3, 7, 96)]
GN_CONFIGS = [
    {},                                                # 32 groups
    {"num_groups": 8, "dtype": BF16},
    {"num_groups": 4, "param_dtype": BF16},
    {"num_groups": None, "group_size": 1},             # instance norm
    {"num_groups": 2, "use_bias": False, "epsilon": 1e-3},
    {"num_groups": 16, "use_scale": False, "use_fast_variance": False},
]


@pytest.mark.parametrize("config", GN_CONFIGS, ids=str)
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", GN_SHAPES, ids=str)
def test_linen_group_norm_matches_stock(rng, shape, x_dtype, config):
    ours, stock = jflax.GroupNorm(**config), nn.GroupNorm(**config)
    x = normal(rng, shape, x_dtype, 0.5, 2.0)
    v_stock = stock.init(jax.random.key(0), x)
    assert_same_structure(ours.init(jax.random.key(0), x), v_stock)
    check_fn_pair(rng, ours.apply, stock.apply, randomize(rng, v_stock), x)


def test_linen_group_norm_explicit_reduction_axes(rng):
    x = normal(rng, (2, 3, 4, 32), F32)
    stock = nn.GroupNorm(num_groups=4, reduction_axes=(1, 2, -1))
    params = randomize(rng, stock.init(jax.random.key(0), x))
    check_fn_pair(rng, jflax.GroupNorm(num_groups=4, reduction_axes=(1, 2, -1)).apply, stock.apply,
                  params, x)


@pytest.mark.parametrize("kwargs,call_kwargs", [
    ({"num_groups": 5}, {}),
    ({"num_groups": None}, {}),
    ({"num_groups": 4, "group_size": 8}, {}),
    ({"reduction_axes": (2, 3)}, {}),
    ({"reduction_axes": -1}, {}),
    ({"axis_name": "batch"}, {}),
    ({"force_float32_reductions": False}, {}),
    ({}, {"mask": np.ones((2, 3, 4, 32), bool)}),
], ids=str)
def test_linen_group_norm_unsupported_options_raise(rng, kwargs, call_kwargs):
    x = normal(rng, (2, 3, 4, 32), F32)
    with pytest.raises(ValueError, match="jaxdnn"):
        jflax.GroupNorm(**kwargs).init(jax.random.key(0), x, **call_kwargs)


@pytest.mark.parametrize("config", [{}, {"num_groups": 8, "dtype": BF16},
                                    {"num_groups": 4, "param_dtype": BF16},
                                    {"num_groups": None, "group_size": 2, "use_bias": False}], ids=str)
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_nnx_group_norm_matches_stock(rng, x_dtype, config):
    shape = (2, 5, 6, 64)
    stock = nnx.GroupNorm(64, rngs=nnx.Rngs(0), **config)
    ours = jnnx.GroupNorm(64, rngs=nnx.Rngs(0), **config)
    assert_same_structure(nnx.to_pure_dict(nnx.state(ours, nnx.Param)),
                          nnx.to_pure_dict(nnx.state(stock, nnx.Param)))
    nnx.update(stock, randomize(rng, nnx.state(stock, nnx.Param)))
    nnx.update(ours, nnx.state(stock, nnx.Param))
    stock_fn, params = _nnx_fn(stock)
    ours_fn, _ = _nnx_fn(ours)
    x = normal(rng, shape, x_dtype, 0.5, 2.0)
    assert ours(x).dtype == stock(x).dtype
    check_fn_pair(rng, ours_fn, stock_fn, params, x)


def test_nnx_group_norm_unsupported_options_raise(rng):
    with pytest.raises(ValueError, match="jaxdnn"):
        jnnx.GroupNorm(30, num_groups=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="jaxdnn"):
        jnnx.GroupNorm(32, axis_name="batch", rngs=nnx.Rngs(0))
    x = normal(rng, (2, 3, 4, 32), F32)
    with pytest.raises(ValueError, match="jaxdnn"):
        jnnx.GroupNorm(32, num_groups=4, reduction_axes=(2, 3), rngs=nnx.Rngs(0))(x)


@pytest.mark.parametrize("kwargs", [{}, {"create_scale": False, "create_offset": False, "eps": 1e-3},
                                    {"create_offset": False}], ids=str)
@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", GN_SHAPES, ids=str)
def test_haiku_group_norm_matches_stock(rng, hk, jhk, shape, x_dtype, kwargs):
    ours, stock = _hk_pair(hk, lambda: jhk.GroupNorm(8, **kwargs), lambda: hk.GroupNorm(8, **kwargs))
    x = normal(rng, shape, x_dtype, 0.5, 2.0)
    p_stock = stock.init(jax.random.key(0), x)
    assert_same_structure(ours.init(jax.random.key(0), x), p_stock)
    check_fn_pair(rng, ours.apply, stock.apply, randomize(rng, p_stock), x)


def test_haiku_group_norm_call_time_scale_and_offset(rng, hk, jhk):
    x = normal(rng, (2, 5, 32), F32)
    scale, offset = normal(rng, (32,), F32, 1.0, 0.5), normal(rng, (1, 1, 32), F32)
    make = lambda mod: hk.without_apply_rng(hk.transform(
        lambda x, s, o: mod.GroupNorm(4, create_scale=False, create_offset=False)(x, s, o)))
    ours, stock = make(jhk), make(hk)
    check_fn_pair(rng, lambda p, x: ours.apply(p, x, scale, offset),
                  lambda p, x: stock.apply(p, x, scale, offset), {}, x)


@pytest.mark.parametrize("kwargs", [{"groups": 5}, {"groups": 4, "axis": slice(2, None)},
                                    {"groups": 4, "axis": -1},
                                    {"groups": 4, "data_format": "channels_first"}], ids=str)
def test_haiku_group_norm_unsupported_options_raise(rng, hk, jhk, kwargs):
    x = normal(rng, (2, 3, 4, 32), F32)
    with pytest.raises(ValueError):
        hk.transform(lambda x: jhk.GroupNorm(**kwargs)(x)).init(jax.random.key(0), x)


def test_group_norm_modules_lower_to_jaxdnn_kernels(rng, hk, jhk):
    x = normal(rng, (2, 3, 4, 32), F32)
    linen_mod = jflax.GroupNorm(num_groups=8)
    nnx_fn, nnx_params = _nnx_fn(jnnx.GroupNorm(32, num_groups=8, rngs=nnx.Rngs(0)))
    hk_mod = hk.without_apply_rng(hk.transform(lambda x: jhk.GroupNorm(8)(x)))
    for what, fn, params in (("linen", linen_mod.apply, linen_mod.init(jax.random.key(0), x)),
                             ("nnx", nnx_fn, nnx_params),
                             ("haiku", hk_mod.apply, hk_mod.init(jax.random.key(0), x))):
        grad_fn = jax.grad(lambda p, x: jnp.sum(fn(p, x) * x), argnums=(0, 1))
        hlo = _lowered_text(grad_fn, params, x)
        assert "jaxdnn_group_norm_fwd" in hlo and "jaxdnn_group_norm_bwd" in hlo, what
