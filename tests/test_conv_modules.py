"""jaxdnn's Flax linen Conv/ConvTranspose and Haiku ConvND/Conv2D against the stock modules.

Same params tree (names, shapes, dtypes) as the stock module; outputs and gradients (w.r.t. params and
inputs, random cotangent) within tests/helpers.py's tolerances of the stock module run in float64 on
the same params; jaxdnn's fprop/dgrad/wgrad custom calls in the HLO; unsupported options raise.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from helpers import (assert_close, assert_same_structure, f64_tree, normal, output_and_grads, randomize,
                     tolerance)

nn = pytest.importorskip("flax.linen")
hk = pytest.importorskip("haiku")

import jaxdnn.flax as jflax  # noqa: E402
import jaxdnn.haiku as jhk  # noqa: E402

F32 = jnp.float32
TARGETS = ("jaxdnn_conv_fprop_v4", "jaxdnn_conv_dgrad_v4", "jaxdnn_conv_wgrad_v4")


def _check_against(apply, apply_stock, params, x, rng):
    """apply(params, x) and its VJP (random cotangent) against apply_stock run in float64 on the
    same params, and jaxdnn's kernels in the HLO: fprop, dgrad and wgrad, or the GEMM of the
    few-channel (2 to 7) convolutions' explicit-GEMM form; no XLA convolution."""
    ct = normal(rng, jax.eval_shape(apply, params, x).shape, F32)
    run = output_and_grads(apply)
    y, grads = run(params, x, ct)
    y_ref, grads_ref = output_and_grads(apply_stock)(f64_tree(params), f64_tree(x), f64_tree(ct))
    assert y.dtype == F32
    assert_close(y, y_ref, tolerance(F32), "output")
    for path, g, g_ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads),
                              jax.tree.leaves(grads_ref)):
        assert_close(g, g_ref, tolerance(F32, grad=True), f"grad {jax.tree_util.keystr(path[0])}")
    hlo = run.lower(params, x, ct).as_text()
    assert "convolution" not in hlo
    assert (all(f"@{target}(" in hlo for target in TARGETS)
            or "@jaxdnn_gemm_v3(" in hlo), "jaxdnn's conv kernels missing from the HLO"


# --- Flax linen ---------------------------------------------------------------------------------

CONV_CASES = [
    ((2, 9, 7, 6), dict(features=5, kernel_size=(3, 3))),
    ((3, 11, 6), dict(features=8, kernel_size=(3, 2), strides=(2, 1), padding="VALID",
                      feature_group_count=2)),
    ((2, 10, 8, 4), dict(features=4, kernel_size=(2, 3), padding=((1, 0), (2, 1)), kernel_dilation=(2, 1),
                         input_dilation=(1, 2), use_bias=False, mask=jnp.tril(jnp.ones((2, 3, 4, 4), F32)))),
    ((2, 3, 8, 7, 4), dict(features=4, kernel_size=(3, 3), feature_group_count=4, padding="CIRCULAR")),
    ((1, 10, 3), dict(features=2, kernel_size=(3,), kernel_dilation=2, padding="CAUSAL")),
    ((5, 6, 3), dict(features=3, kernel_size=(3, 3), padding=1, strides=2)),  # unbatched
]


@pytest.mark.parametrize("shape,kw", CONV_CASES, ids=[str(i) for i in range(len(CONV_CASES))])
def test_flax_conv_matches_stock(rng, shape, kw):
    x = normal(rng, shape, F32)
    params = jflax.Conv(**kw).init(jax.random.key(0), x)
    assert_same_structure(params, nn.Conv(**kw).init(jax.random.key(0), x))
    params = randomize(rng, params)
    _check_against(jflax.Conv(**kw).apply, nn.Conv(**kw).apply, params, x, rng)


TRANSPOSE_CASES = [
    ((2, 5, 4, 6), dict(features=5, kernel_size=(3, 3), strides=(2, 2))),
    ((2, 6, 3), dict(features=4, kernel_size=(4,), strides=(3,), padding="VALID", kernel_dilation=(2,))),
    ((1, 4, 5, 3), dict(features=2, kernel_size=(3, 2), strides=(2, 1), padding=((2, 1), (0, 1)),
                        transpose_kernel=True)),
]


@pytest.mark.parametrize("shape,kw", TRANSPOSE_CASES, ids=[str(i) for i in range(len(TRANSPOSE_CASES))])
def test_flax_conv_transpose_matches_stock(rng, shape, kw):
    x = normal(rng, shape, F32)
    params = jflax.ConvTranspose(**kw).init(jax.random.key(0), x)
    assert_same_structure(params, nn.ConvTranspose(**kw).init(jax.random.key(0), x))
    params = randomize(rng, params)
    _check_against(jflax.ConvTranspose(**kw).apply, nn.ConvTranspose(**kw).apply, params, x, rng)


def test_flax_conv_transpose_preferred_element_type(rng):
    """bf16 computation with float32 results (preferred_element_type), as stock ConvTranspose's."""
    kw = dict(features=4, kernel_size=(3, 3), strides=(2, 2), dtype=jnp.bfloat16, preferred_element_type=F32)
    x = normal(rng, (2, 5, 4, 6), jnp.bfloat16)
    params = nn.ConvTranspose(**kw).init(jax.random.key(0), x)
    y, want = jflax.ConvTranspose(**kw).apply(params, x), nn.ConvTranspose(**kw).apply(params, x)
    assert y.dtype == want.dtype == F32
    assert_close(y, want, tolerance(jnp.bfloat16))


def test_flax_conv_dtype_promotion(rng):
    """bfloat16 inputs with float32 params compute in float32, as stock Flax; dtype= sets it."""
    x = normal(rng, (2, 6, 6, 3), jnp.bfloat16)
    params = nn.Conv(4, (3, 3)).init(jax.random.key(0), x)
    assert jflax.Conv(4, (3, 3)).apply(params, x).dtype == nn.Conv(4, (3, 3)).apply(params, x).dtype == F32
    y = jflax.Conv(4, (3, 3), dtype=jnp.bfloat16).apply(params, x)
    y_ref = nn.Conv(4, (3, 3), dtype=jnp.bfloat16).apply(params, x)
    assert y.dtype == y_ref.dtype == jnp.bfloat16
    assert_close(y.astype(F32), y_ref.astype(F32), tolerance(jnp.bfloat16))


def test_flax_conv_in_models_share_params(rng):
    """The modules slot into a model under the stock names (Conv_0, ConvTranspose_0)."""

    def model(conv, conv_transpose):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                return conv_transpose(3, (2, 2), strides=(2, 2))(nn.relu(conv(6, (3, 3), strides=2)(x)))
        return Net()

    x = normal(rng, (2, 8, 8, 3), F32)
    params = randomize(rng, model(nn.Conv, nn.ConvTranspose).init(jax.random.key(0), x))
    assert_same_structure(params, model(jflax.Conv, jflax.ConvTranspose).init(jax.random.key(0), x))
    _check_against(model(jflax.Conv, jflax.ConvTranspose).apply, model(nn.Conv, nn.ConvTranspose).apply,
                   params, x, rng)


@pytest.mark.parametrize("module,kw,match", [
    (jflax.ConvTranspose, dict(features=2, kernel_size=(3, 3), padding="CIRCULAR"), "CIRCULAR"),
    (jflax.Conv, dict(features=2, kernel_size=(3, 3), padding="CAUSAL"), "CAUSAL"),
    (jflax.Conv, dict(features=2, kernel_size=(3, 3), feature_group_count=2), "feature_group_count"),
    (jflax.Conv, dict(features=2, kernel_size=(3, 3), mask=jnp.ones((2, 2, 3, 2))), "mask"),
    (jflax.Conv, dict(features=2, kernel_size=(3, 3), padding="BOGUS"), "padding"),
])
def test_flax_bad_options_raise(rng, module, kw, match):
    with pytest.raises(ValueError, match=match):
        module(**kw).init(jax.random.key(0), normal(rng, (1, 6, 6, 3), F32))


# --- Haiku --------------------------------------------------------------------------------------

HAIKU_CASES = [
    ((2, 9, 7, 6), dict(output_channels=5, kernel_shape=3)),
    ((2, 9, 7, 6), dict(output_channels=6, kernel_shape=(3, 2), stride=(2, 1), padding="VALID",
                        feature_group_count=3)),
    ((2, 6, 10, 8), dict(output_channels=4, kernel_shape=(2, 3), rate=2, padding=((1, 0), (2, 1)),
                         data_format="NCHW")),
    ((7, 5, 4), dict(output_channels=3, kernel_shape=3, stride=2, with_bias=False)),  # unbatched
]


@pytest.mark.parametrize("shape,kw", HAIKU_CASES, ids=[str(i) for i in range(len(HAIKU_CASES))])
def test_haiku_conv2d_matches_stock(rng, shape, kw):
    x = normal(rng, shape, F32)
    ours = hk.without_apply_rng(hk.transform(lambda x: jhk.Conv2D(**kw)(x)))
    stock = hk.without_apply_rng(hk.transform(lambda x: hk.Conv2D(**kw)(x)))
    params = ours.init(jax.random.key(0), x)
    assert_same_structure(params, stock.init(jax.random.key(0), x))
    _check_against(ours.apply, stock.apply, randomize(rng, params), x, rng)


@pytest.mark.parametrize("name,shape,kw", [
    ("ConvND", (2, 5, 6, 4, 3), dict(num_spatial_dims=3, output_channels=4, kernel_shape=(3, 1, 2),
                                     stride=(1, 2, 1))),
    ("Conv1D", (3, 4, 11), dict(output_channels=4, kernel_shape=3, rate=2, data_format="NCW")),
    ("Conv3D", (1, 4, 5, 3, 2), dict(output_channels=3, kernel_shape=(2, 2, 1), padding="VALID")),
])
def test_haiku_conv_nd_matches_stock(rng, name, shape, kw):
    x = normal(rng, shape, F32)
    ours = hk.without_apply_rng(hk.transform(lambda x: getattr(jhk, name)(**kw)(x)))
    stock = hk.without_apply_rng(hk.transform(lambda x: getattr(hk, name)(**kw)(x)))
    params = ours.init(jax.random.key(0), x)
    assert_same_structure(params, stock.init(jax.random.key(0), x))
    _check_against(ours.apply, stock.apply, randomize(rng, params), x, rng)


@pytest.mark.parametrize("shape,kw,match", [
    ((1, 6, 6, 3), dict(output_channels=2, kernel_shape=3, feature_group_count=2), "feature_group_count"),
    ((6, 3), dict(output_channels=2, kernel_shape=3), "rank"),
])
def test_haiku_bad_options_raise(rng, shape, kw, match):
    f = hk.transform(lambda x: jhk.Conv2D(**kw)(x))
    with pytest.raises(ValueError, match=match):
        f.init(jax.random.key(0), normal(rng, shape, F32))


# --- Flax NNX -----------------------------------------------------------------------------------

NNX_CASES = [
    ((2, 9, 7, 6), dict(in_features=6, out_features=5, kernel_size=(3, 3))),
    ((2, 3, 11, 6), dict(in_features=6, out_features=4, kernel_size=(3, 2), strides=(2, 1), padding="REFLECT",
                         feature_group_count=2, kernel_dilation=(1, 2))),
    ((1, 10, 3), dict(in_features=3, out_features=2, kernel_size=(3,), padding="CAUSAL", use_bias=False)),
]


@pytest.mark.parametrize("shape,kw", NNX_CASES, ids=[str(i) for i in range(len(NNX_CASES))])
def test_nnx_conv_matches_stock(rng, shape, kw):
    nnx = pytest.importorskip("flax.nnx")
    from jaxdnn.flax import nnx as jnnx

    x = normal(rng, shape, F32)
    ours, stock = jnnx.Conv(**kw, rngs=nnx.Rngs(0)), nnx.Conv(**kw, rngs=nnx.Rngs(0))
    params = randomize(rng, nnx.state(stock, nnx.Param))
    assert_same_structure(params, nnx.state(ours, nnx.Param))
    graph, _ = nnx.split(ours)
    stock_graph, _ = nnx.split(stock)

    def apply(graph):
        return lambda params, x: nnx.merge(graph, params)(x)

    _check_against(apply(graph), apply(stock_graph), params, x, rng)


def test_nnx_conv_preferred_element_type_matches_stock(rng):
    """bf16 computation with float32 results (preferred_element_type), as the stock module's."""
    nnx = pytest.importorskip("flax.nnx")
    from jaxdnn.flax import nnx as jnnx

    kw = dict(in_features=16, out_features=8, kernel_size=(3, 3), dtype=jnp.bfloat16,
              preferred_element_type=jnp.float32)
    ours, stock = jnnx.Conv(**kw, rngs=nnx.Rngs(0)), nnx.Conv(**kw, rngs=nnx.Rngs(0))
    x = normal(rng, (2, 7, 6, 16), jnp.bfloat16)
    y, want = ours(x), stock(x)
    assert y.dtype == want.dtype == jnp.float32
    assert_close(y, want, tolerance(jnp.bfloat16))


def test_nnx_conv_bad_options_raise(rng):
    nnx = pytest.importorskip("flax.nnx")
    from jaxdnn.flax import nnx as jnnx

    conv = jnnx.Conv(4, 2, (3, 3), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features"):
        conv(normal(rng, (1, 5, 5, 3), F32))
    with pytest.raises(ValueError, match="out_sharding"):
        conv(normal(rng, (1, 5, 5, 4), F32), out_sharding=jax.sharding.PartitionSpec())


def test_precision_reaches_the_kernels(rng):
    """Each module's `precision` is jaxdnn.conv_general_dilated's: at JAX's default (None) a float32
    convolution may run as TF32 (tf32 = 1), HIGHEST keeps exact products (tf32 = 0)."""
    nnx = pytest.importorskip("flax.nnx")
    from jaxdnn.flax import nnx as jnnx

    x = normal(rng, (2, 6, 5, 8), F32)
    with jax.default_matmul_precision(None):  # JAX's own default (this suite sets "highest")
        for precision, tf32 in ((None, 1), ("highest", 0)):
            hlos = []
            for module in (jflax.Conv(4, (3, 3), precision=precision),
                           jflax.ConvTranspose(4, (3, 3), strides=(2, 2), precision=precision)):
                hlos.append(jax.jit(module.apply).lower(module.init(jax.random.key(0), x), x).as_text())
            haiku = hk.without_apply_rng(hk.transform(lambda x: jhk.Conv2D(4, 3)(x, precision=precision)))
            hlos.append(jax.jit(haiku.apply).lower(haiku.init(jax.random.key(0), x), x).as_text())
            conv = jnnx.Conv(8, 4, (3, 3), precision=precision, rngs=nnx.Rngs(0))
            hlos.append(jax.jit(lambda x: conv(x)).lower(x).as_text())
            for hlo in hlos:  # ConvTranspose's forward is a dgrad (of the convolution it transposes)
                assert len(re.findall(r"@jaxdnn_conv_(fprop|dgrad)_v4\(", hlo)) == 1
                assert f"tf32 = {tf32} : i64" in hlo
