"""jaxdnn's Flax linen Dense, NNX Linear and Haiku Linear against the stock modules.

Same params tree (names, shapes, dtypes) as the stock module; outputs and gradients (w.r.t. params and
inputs, random cotangent) within tests/helpers.py's tolerances of the stock module run in float64 on
the same params; the GEMM custom call in the HLO; the fused `activation` against the stock module
followed by jax.nn's function; unsupported options raise.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import (assert_close, assert_same_structure, f64_tree, normal, output_and_grads, randomize,
                     tolerance)

nn = pytest.importorskip("flax.linen")
hk = pytest.importorskip("haiku")
nnx = pytest.importorskip("flax.nnx")

import jaxdnn.flax as jflax  # noqa: E402
import jaxdnn.haiku as jhk  # noqa: E402
from jaxdnn.flax import nnx as jnnx  # noqa: E402

F32 = jnp.float32
TARGET = "jaxdnn_gemm_v3"


def _check_against(apply, apply_stock, params, x, rng):
    """apply(params, x) and its VJP against apply_stock in float64 on the same params, and the GEMM
    kernel in the HLO."""
    ct = normal(rng, jax.eval_shape(apply, params, x).shape, F32)
    run = output_and_grads(apply)
    y, grads = run(params, x, ct)
    y_ref, grads_ref = output_and_grads(apply_stock)(f64_tree(params), f64_tree(x), f64_tree(ct))
    assert y.dtype == F32
    assert_close(y, y_ref, tolerance(F32), "output")
    for path, g, g_ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads),
                              jax.tree.leaves(grads_ref)):
        assert_close(g, g_ref, tolerance(F32, grad=True), f"grad {jax.tree_util.keystr(path[0])}")
    assert run.lower(params, x, ct).as_text().count(f"@{TARGET}(") == 3  # y, dx, dkernel


CASES = [((4, 10), 7, True, None), ((2, 3, 9), 5, False, None), ((6, 33), 12, True, "gelu")]
CASE_IDS = ["bias", "no-bias-3d", "gelu"]


def _then(activation, fn):
    """fn followed by the activation (jax.nn's), as the stock modules would be used."""
    return fn if activation is None else (lambda *a: jax.nn.gelu(fn(*a)))


@pytest.mark.parametrize("shape,features,use_bias,activation", CASES, ids=CASE_IDS)
def test_flax_dense_matches_stock(rng, shape, features, use_bias, activation):
    x = normal(rng, shape, F32)
    ours = jflax.Dense(features, use_bias=use_bias, activation=activation)
    stock = nn.Dense(features, use_bias=use_bias)
    params = ours.init(jax.random.key(0), x)
    assert_same_structure(params, stock.init(jax.random.key(0), x))
    _check_against(ours.apply, _then(activation, stock.apply), randomize(rng, params), x, rng)


def test_flax_dense_dtypes_and_options(rng):
    x = normal(rng, (3, 8), jnp.bfloat16)
    for kw in (dict(), dict(dtype=jnp.bfloat16), dict(param_dtype=jnp.bfloat16)):
        ours, stock = jflax.Dense(4, **kw), nn.Dense(4, **kw)
        params = stock.init(jax.random.key(1), x)
        y, y_stock = ours.apply(params, x), stock.apply(params, x)
        assert y.dtype == y_stock.dtype, kw
        assert_close(y, y_stock, tolerance(jnp.bfloat16), f"dtypes {kw}")
    with pytest.raises(ValueError, match="dot_general"):
        jflax.Dense(4, dot_general=jax.lax.dot_general).init(jax.random.key(0), x)


@pytest.mark.parametrize("shape,features,use_bias,activation", CASES, ids=CASE_IDS)
def test_nnx_linear_matches_stock(rng, shape, features, use_bias, activation):
    x = normal(rng, shape, F32)
    kw = dict(in_features=shape[-1], out_features=features, use_bias=use_bias)
    ours = jnnx.Linear(**kw, activation=activation, rngs=nnx.Rngs(0))
    stock = nnx.Linear(**kw, rngs=nnx.Rngs(0))
    params = randomize(rng, nnx.state(stock, nnx.Param))
    assert_same_structure(params, nnx.state(ours, nnx.Param))
    graph, _ = nnx.split(ours)
    stock_graph, _ = nnx.split(stock)

    def apply(graph):
        return lambda params, x: nnx.merge(graph, params)(x)

    _check_against(apply(graph), _then(activation, apply(stock_graph)), params, x, rng)


def test_nnx_linear_preferred_element_type_matches_stock(rng):
    """bf16 computation with float32 results (preferred_element_type), as the stock module's."""
    kw = dict(in_features=24, out_features=16, dtype=jnp.bfloat16, preferred_element_type=jnp.float32)
    ours, stock = jnnx.Linear(**kw, rngs=nnx.Rngs(0)), nnx.Linear(**kw, rngs=nnx.Rngs(0))
    x = normal(rng, (5, 24), jnp.bfloat16)
    y, want = ours(x), stock(x)
    assert y.dtype == want.dtype == jnp.float32
    assert_close(y, want, tolerance(jnp.bfloat16))


def test_nnx_linear_bad_options_raise(rng):
    linear = jnnx.Linear(4, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features"):
        linear(normal(rng, (3, 5), F32))
    with pytest.raises(ValueError, match="out_sharding"):
        linear(normal(rng, (3, 4), F32), out_sharding=jax.sharding.PartitionSpec())
    custom = jnnx.Linear(4, 2, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dot_general"):
        custom(normal(rng, (3, 4), F32))


@pytest.mark.parametrize("shape,features,use_bias,activation", CASES, ids=CASE_IDS)
def test_haiku_linear_matches_stock(rng, shape, features, use_bias, activation):
    x = normal(rng, shape, F32)
    ours = hk.without_apply_rng(hk.transform(
        lambda x: jhk.Linear(features, with_bias=use_bias, activation=activation)(x)))
    stock = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(features, with_bias=use_bias)(x)))
    params = ours.init(jax.random.key(0), x)
    assert_same_structure(params, stock.init(jax.random.key(0), x))
    _check_against(ours.apply, _then(activation, stock.apply), randomize(rng, params), x, rng)


def test_haiku_linear_in_an_mlp_shares_params(rng):
    """Stock and jaxdnn modules in one model: the same module names, so one params dict serves both."""
    x = normal(rng, (5, 6), F32)

    def mlp(linear):
        return lambda x: linear(3)(jax.nn.relu(linear(8)(x)))
    ours, stock = (hk.without_apply_rng(hk.transform(mlp(m))) for m in (jhk.Linear, hk.Linear))
    params = randomize(rng, stock.init(jax.random.key(0), x))
    assert set(params) == {"linear", "linear_1"}
    assert_close(ours.apply(params, x), stock.apply(f64_tree(params), f64_tree(x)), tolerance(F32), "mlp")
    with pytest.raises(ValueError, match="scalar"):
        hk.transform(lambda x: jhk.Linear(3)(x)).init(jax.random.key(0), jnp.float32(1.0))


def test_precision_reaches_the_kernel(rng):
    """Each module's `precision` is jaxdnn.dense's: at JAX's default (None) float32 may run as TF32
    (tf32 = 1), HIGHEST keeps exact products (tf32 = 0)."""
    x = normal(rng, (4, 8), F32)
    linen = lambda p: jflax.Dense(5, precision=p)  # noqa: E731
    haiku = lambda p: hk.without_apply_rng(hk.transform(lambda x: jhk.Linear(5)(x, precision=p)))  # noqa: E731
    with jax.default_matmul_precision(None):  # JAX's own default (this suite sets "highest")
        for precision, tf32 in ((None, 1), ("highest", 0)):
            module = linen(precision)
            hlos = [jax.jit(module.apply).lower(module.init(jax.random.key(0), x), x).as_text()]
            transformed = haiku(precision)
            hlos.append(jax.jit(transformed.apply).lower(transformed.init(jax.random.key(0), x), x).as_text())
            linear = jnnx.Linear(8, 5, precision=precision, rngs=nnx.Rngs(0))
            hlos.append(jax.jit(lambda x: linear(x)).lower(x).as_text())
            for hlo in hlos:
                assert hlo.count(f"@{TARGET}(") == 1 and f"tf32 = {tf32} : i64" in hlo
