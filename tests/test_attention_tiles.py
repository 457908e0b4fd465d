"""dot_product_attention in bfloat16 and float16 at sizes that span many tiles of the Hopper
tensor-core kernels (128 queries and 64-128 keys a tile): ragged last tiles in T and S, causal and
window block skipping across tiles, head sizes padded to the kernels' 64/128/256, GQA, a decode row,
rows with no key, and the general per-logit path (bias, mask, segments, soft cap, dropout), against
the float64 reference; forward and the VJP w.r.t. q, k and v (and bias). On the CPU the same cases
check the CPU kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdnn
from helpers import assert_close, bit_equal, dtype_id, f64, normal, tolerance, vjp

HALF_TYPES = (jnp.bfloat16, jnp.float16)
dtype_param = pytest.mark.parametrize("dtype", HALF_TYPES, ids=dtype_id)


def _inputs(rng, b, t, s, n, kv, h, dtype):
    return (normal(rng, (b, t, n, h), dtype), normal(rng, (b, s, kv, h), dtype),
            normal(rng, (b, s, kv, h), dtype))


def _check(rng, q, k, v, bias=None, mask=None, **kw):
    """Forward and VJP against the reference in float64 (bias differentiated when given)."""
    dtype = q.dtype
    ref_kw = dict(kw)
    if "dropout_rng" in ref_kw:  # the reference takes the kernels' per-batch seeds drawn from the key
        shared = ref_kw.pop("broadcast_dropout", False)  # one seed for the batch, head 0's mask
        seeds = jax.random.bits(ref_kw.pop("dropout_rng"), (1 if shared else q.shape[0], 2), jnp.uint32)
        ref_kw["dropout_seed"] = jnp.broadcast_to(seeds, (q.shape[0], 2))
        ref_kw["dropout_heads"] = not shared

    def reference(q, k, v, bias, mask):
        return jaxdnn.reference.attention.dot_product_attention(q, k, v, bias, mask, **ref_kw)

    def ours(q, k, v, bias):
        return jaxdnn.dot_product_attention(q, k, v, bias, mask, **kw)

    out = jax.jit(ours)(q, k, v, bias)
    want = jax.jit(lambda q, k, v, bias: reference(q, k, v, bias, mask))(f64(q), f64(k), f64(v), f64(bias))
    assert_close(out, want, tolerance(dtype), "forward")
    cotangent = normal(rng, q.shape, dtype)
    got = vjp(ours, [q, k, v, bias], cotangent)
    expected = vjp(lambda q, k, v, b: reference(q, k, v, b, mask), [f64(q), f64(k), f64(v), f64(bias)],
                   f64(cotangent))
    for name, g, e in zip(("dq", "dk", "dv", "dbias"), got, expected):
        assert_close(g, e, tolerance(dtype, grad=True), name)


# (B, T, S, N, K, H, options)
CASES = {
    "h64-ragged": ((2, 300, 530, 4, 2, 64), {}),
    "h96-ragged": ((2, 300, 530, 4, 2, 96), {}),  # the fused kernel (H 65-128), no mask
    "h128-causal": ((1, 520, 520, 2, 2, 128), dict(is_causal=True)),
    "h256-causal-t<s": ((1, 200, 333, 2, 1, 256), dict(is_causal=True)),
    "h80-window": ((2, 129, 257, 2, 2, 80), dict(local_window_size=(70, 20))),
    "h192-mqa": ((1, 140, 190, 4, 1, 192), {}),
    "h32-lengths-causal": ((2, 256, 256, 4, 1, 32), dict(
        is_causal=True, query_seq_lengths=np.array([256, 100], np.int32),
        key_value_seq_lengths=np.array([200, 256], np.int32))),
    "decode": ((2, 1, 700, 4, 4, 128), {}),  # few query tiles for many key tiles: the separate kernels
    "h64-decode-causal-t>s": ((1, 2, 1100, 2, 2, 64), dict(is_causal=True, local_window_size=(900, 0))),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@dtype_param
def test_tiles_against_reference(case, dtype, rng):
    shape, kw = CASES[case]
    _check(rng, *_inputs(rng, *shape, dtype), **kw)


@dtype_param
def test_general_rules_across_tiles(dtype, rng):
    """Bias (differentiated), mask, segment ids, soft cap and dropout, all at once, over many tiles."""
    b, t, s, n, kv, h = 2, 200, 300, 4, 2, 64
    q, k, v = _inputs(rng, b, t, s, n, kv, h, dtype)
    bias = normal(rng, (1, n, t, s), jnp.float32)
    mask = jnp.asarray(rng.random((b, 1, t, s)) < 0.9)
    q_seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32)
    kv_seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, s)), axis=1), jnp.int32)
    _check(rng, q, k, v, bias, mask, q_segment_ids=q_seg, kv_segment_ids=kv_seg, logits_soft_cap=3.0,
           is_causal=True, dropout_rate=0.25, dropout_rng=jax.random.key(5))


@pytest.mark.parametrize("h", [64, 96], ids=["h64", "h96-fused"])
def test_broadcast_dropout_across_tiles(h, rng):
    """One dropout mask shared by the batch and the heads (broadcast_dropout) over many tiles, on
    the general kernels and (16-bit, H 65-128) the fused backward."""
    q, k, v = _inputs(rng, 2, 200, 300, 4, 2, h, jnp.bfloat16)
    _check(rng, q, k, v, is_causal=True, dropout_rate=0.25, dropout_rng=jax.random.key(6),
           broadcast_dropout=True)


@dtype_param
def test_rows_without_keys(dtype, rng):
    """A batch element with no key and rows past their length: output 0, logsumexp -inf, no
    gradient; the other rows as the reference."""
    b, t, s = 3, 150, 140
    q, k, v = _inputs(rng, b, t, s, 2, 1, 64, dtype)
    kw = dict(query_seq_lengths=jnp.array([150, 150, 70], jnp.int32),
              key_value_seq_lengths=jnp.array([140, 0, 130], jnp.int32))
    out, lse = jaxdnn.dot_product_attention(q, k, v, return_residual=True, **kw)
    empty = np.zeros((b, t), bool)
    empty[1, :] = empty[2, 70:] = True
    np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0)
    assert np.all(np.isneginf(np.asarray(lse, np.float32)[empty]))
    _check(rng, q, k, v, **kw)


@dtype_param
def test_tiled_backward_is_deterministic(dtype, rng):
    q, k, v = _inputs(rng, 1, 300, 300, 4, 2, 128, dtype)
    ct = normal(rng, q.shape, dtype)
    step = jax.jit(lambda q, k, v: jax.vjp(lambda *a: jaxdnn.dot_product_attention(*a, is_causal=True),
                                           q, k, v)[1](ct))
    first, second = step(q, k, v), step(q, k, v)
    assert all(bit_equal(a, b) for a, b in zip(first, second))


@pytest.fixture
def unordered(monkeypatch):
    """jaxdnn.config.deterministic off for one test (the setting is read when a program is traced)."""
    monkeypatch.setattr(jaxdnn.config, "deterministic", False)


@pytest.mark.parametrize("case", ["h96-ragged", "h128-causal", "h80-window"])
@dtype_param
def test_unordered_backward_against_reference(case, dtype, rng, unordered):
    """With jaxdnn.config.deterministic off, the Hopper backward adds its dq partials unordered (no
    semaphore workspace): still the reference's gradients, within the same tolerances."""
    shape, kw = CASES[case]
    _check(rng, *_inputs(rng, *shape, dtype), **kw)
