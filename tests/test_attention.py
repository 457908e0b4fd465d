"""dot_product_attention against jax.nn.dot_product_attention (implementation="xla") and the reference
in float64: forward and VJP for q, k, v and bias, every mask and their combinations, GQA/MQA, fully
masked rows, dtypes, transforms, sharding, export, errors, and the custom calls in the HLO."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdnn
from helpers import DTYPES, assert_close, bit_equal, dtype_id, f64, normal, rel_err, tolerance, vjp

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)


def _inputs(rng, b, t, s, n, kv, h, dtype=jnp.float32):
    return (normal(rng, (b, t, n, h), dtype), normal(rng, (b, s, kv, h), dtype),
            normal(rng, (b, s, kv, h), dtype))


def _xla(q, k, v, bias=None, mask=None, **kw):
    return jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="xla", **kw)


def _check_against(oracle, rng, q, k, v, bias=None, mask=None, grad_bias=True, **kw):
    """Forward and VJP (q, k, v and bias) of jaxdnn against `oracle` on float64 inputs."""
    dtype = q.dtype
    fn = jax.jit(lambda q, k, v, bias: jaxdnn.dot_product_attention(q, k, v, bias, mask, **kw))
    out = fn(q, k, v, bias)
    assert out.shape == q.shape and out.dtype == dtype
    want = jax.jit(lambda q, k, v, bias: oracle(q, k, v, bias, mask, **kw))(f64(q), f64(k), f64(v), f64(bias))
    assert_close(out, want, tolerance(dtype), "forward")
    cotangent = normal(rng, q.shape, dtype)
    args = [q, k, v, bias if grad_bias else None]
    got = vjp(lambda q, k, v, b=bias: jaxdnn.dot_product_attention(q, k, v, b, mask, **kw), args, cotangent)
    expected = vjp(lambda q, k, v, b=f64(bias): oracle(q, k, v, b, mask, **kw),
                   [f64(a) for a in args], f64(cotangent))
    for name, g, e in zip(("dq", "dk", "dv", "dbias"), got, expected):
        assert g.dtype == dict(dq=q, dk=k, dv=v, dbias=bias)[name].dtype
        assert_close(g, e, tolerance(dtype, grad=True), name)


# (B, T, S, N, K, H, options): T != S, head sizes 8..128, GQA (K < N), MQA (K = 1), every mask.
CASES = {
    "mha": ((2, 17, 23, 2, 2, 16), {}),
    "gqa-h72": ((2, 9, 40, 6, 2, 72), {}),
    "mqa-causal": ((1, 33, 33, 4, 1, 64), dict(is_causal=True)),
    "h128": ((1, 5, 70, 2, 2, 128), {}),
    "h256": ((1, 3, 20, 1, 1, 256), {}),
    "large-logits": ((2, 20, 70, 2, 1, 16), dict(scale=6.0)),  # the online softmax rescales often
    "causal-t>s": ((2, 40, 19, 2, 1, 16), dict(is_causal=True)),
    "window": ((1, 50, 45, 2, 2, 24), dict(local_window_size=(7, 3))),
    "window-int": ((1, 21, 21, 2, 2, 8), dict(local_window_size=4)),
    "seq-lengths": ((3, 20, 37, 2, 1, 16), dict(query_seq_lengths=np.array([20, 7, 13], np.int32),
                                                key_value_seq_lengths=np.array([37, 1, 20], np.int32))),
    "scale": ((2, 8, 8, 2, 2, 16), dict(scale=0.37)),
    "combined": ((2, 35, 50, 4, 2, 32), dict(is_causal=True, local_window_size=(20, 0),
                                             key_value_seq_lengths=np.array([50, 30], np.int32))),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@dtype_param
def test_against_jax_nn(case, dtype, rng):
    shape, kw = CASES[case]
    _check_against(_xla, rng, *_inputs(rng, *shape, dtype), **kw)


@pytest.mark.parametrize("bias_shape", [(1, 4, 19, 33), (2, 1, 1, 33), (19, 33), (2, 4, 1, 33)],
                         ids=str)
def test_bias_broadcasts_and_gradient(bias_shape, rng):
    """(A bias constant along S has gradient 0 by the softmax's shift invariance: not a useful case.)"""
    q, k, v = _inputs(rng, 2, 19, 33, 4, 2, 16)
    bias = normal(rng, bias_shape, scale=2.0)
    _check_against(_xla, rng, q, k, v, bias)


@dtype_param
def test_mask_bias_and_masks_combined(dtype, rng):
    q, k, v = _inputs(rng, 2, 24, 31, 4, 2, 40, dtype)
    mask = jnp.asarray(rng.random((2, 1, 24, 31)) < 0.8)
    bias = normal(rng, (1, 4, 24, 31), dtype)
    _check_against(_xla, rng, q, k, v, bias, mask, local_window_size=(30, 5),
                   query_seq_lengths=jnp.array([24, 11], jnp.int32))


@pytest.mark.parametrize("mask_shape", [(2, 4, 12, 16), (1, 1, 12, 16), (2, 1, 1, 16), (12, 16)], ids=str)
def test_mask_broadcasts(mask_shape, rng):
    q, k, v = _inputs(rng, 2, 12, 16, 4, 4, 16)
    mask = np.asarray(rng.random(mask_shape) < 0.7)
    mask[..., 0] = True  # every row keeps a key (fully masked rows: see below)
    _check_against(_xla, rng, q, k, v, mask=jnp.asarray(mask))


def test_fully_masked_rows_give_zero(rng):
    """Rows with no key: output 0 and no gradient (jax.nn's "xla" path averages every value there,
    except for rows past query_seq_lengths, which it zeroes too); every other row matches jax.nn."""
    b, t, s, n = 3, 12, 10, 2
    q, k, v = _inputs(rng, b, t, s, n, 1, 16)
    mask = np.asarray(rng.random((b, 1, t, s)) < 0.8)
    mask[..., 0] = True
    mask[0, :, 3, :] = False  # one row of the mask
    mask = jnp.asarray(mask)
    kw = dict(key_value_seq_lengths=jnp.array([10, 0, 10], jnp.int32),  # batch 1: no key at all
              query_seq_lengths=jnp.array([12, 12, 5], jnp.int32), local_window_size=(100, 0))
    out = jaxdnn.dot_product_attention(q, k, v, mask=mask, **kw)
    empty = np.zeros((b, t), bool)
    empty[0, 3] = empty[1, :] = True
    empty[2, 5:] = True
    np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
    want = _xla(f64(q), f64(k), f64(v), mask=mask, **kw)
    live = jnp.asarray(~empty)[:, :, None, None]
    assert_close(jnp.where(live, out, 0), jnp.where(live, want, 0), 1e-5, "live rows")
    reference = jaxdnn.reference.attention.dot_product_attention(f64(q), f64(k), f64(v), mask=mask, **kw)
    assert_close(out, reference, 1e-5, "reference")
    ct = normal(rng, q.shape)
    got = vjp(lambda q, k, v: jaxdnn.dot_product_attention(q, k, v, mask=mask, **kw), [q, k, v], ct)
    expected = vjp(lambda q, k, v: jaxdnn.reference.attention.dot_product_attention(q, k, v, mask=mask, **kw),
                   [f64(q), f64(k), f64(v)], f64(ct))
    for g, e in zip(got, expected):
        assert_close(g, e, 1e-4, "grad")
    np.testing.assert_array_equal(np.asarray(got[0])[empty], 0.0)
    _, lse = jaxdnn.dot_product_attention(q, k, v, mask=mask, return_residual=True, **kw)
    assert np.all(np.isneginf(np.asarray(lse)[empty])) and np.all(np.isfinite(np.asarray(lse)[~empty]))


@dtype_param
def test_segment_ids_and_soft_cap(dtype, rng):
    """Beyond jax.nn: packed sequences (segment ids) and the Gemma-2 soft cap, against the reference;
    segment ids also against jax.nn with the equivalent mask."""
    b, t, s = 2, 21, 26
    q, k, v = _inputs(rng, b, t, s, 4, 2, 16, dtype)
    q_seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32)
    kv_seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, s)), axis=1), jnp.int32)
    kv_seg = kv_seg.at[:, :3].set(q_seg[:, :3])  # most rows keep a key
    seg_mask = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
    keeps_key = np.asarray(jnp.any(seg_mask, axis=-1))[:, 0]  # [B, T]
    out = jaxdnn.dot_product_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    want = _xla(f64(q), f64(k), f64(v), mask=seg_mask)
    live = jnp.asarray(keeps_key)[:, :, None, None]
    assert_close(jnp.where(live, out, 0), jnp.where(live, want, 0), tolerance(dtype), "segments vs jax.nn")
    bias = normal(rng, (1, 4, t, s), dtype)

    def oracle(q, k, v, bias, mask, **kw):
        return jaxdnn.reference.attention.dot_product_attention(q, k, v, bias, mask, **kw)

    _check_against(oracle, rng, q, k, v, bias, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                   logits_soft_cap=2.5, is_causal=True)


def test_rank3_inputs_and_empty_batch(rng):
    q, k, v = _inputs(rng, 1, 9, 14, 2, 1, 16)
    out = jaxdnn.dot_product_attention(q[0], k[0], v[0], is_causal=True)
    assert out.shape == (9, 2, 16)
    assert_close(out, _xla(f64(q[0]), f64(k[0]), f64(v[0]), is_causal=True), 1e-5, "rank 3")
    q, k, v = _inputs(rng, 0, 9, 14, 2, 1, 16)
    out, grads = jax.value_and_grad(lambda q, k, v: jnp.sum(jaxdnn.dot_product_attention(q, k, v)),
                                    argnums=(0, 1, 2))(q, k, v)
    assert out == 0 and all(g.shape == a.shape for g, a in zip(grads, (q, k, v)))
    q, k, v = _inputs(rng, 2, 0, 5, 2, 1, 16)  # no queries: dk = dv = 0
    grads = jax.grad(lambda k, v: jnp.sum(jaxdnn.dot_product_attention(q, k, v)), argnums=(0, 1))(k, v)
    assert all(np.all(np.asarray(g) == 0) for g in grads)


def test_return_residual_matches_jax_nn(rng):
    q, k, v = _inputs(rng, 2, 11, 13, 4, 2, 16)
    out, lse = jaxdnn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    want_out, want_lse = _xla(f64(q), f64(k), f64(v), is_causal=True, return_residual=True)
    assert lse.shape == (2, 11, 4) and lse.dtype == q.dtype
    assert_close(out, want_out, 1e-5, "output")
    assert_close(lse, want_lse, 1e-5, "logsumexp")


def test_backward_is_deterministic(rng):
    q, k, v = _inputs(rng, 2, 40, 40, 4, 1, 16)
    ct = normal(rng, q.shape)
    step = jax.jit(lambda q, k, v: jax.vjp(lambda *a: jaxdnn.dot_product_attention(*a, is_causal=True),
                                           q, k, v)[1](ct))
    first, second = step(q, k, v), step(q, k, v)
    assert all(bit_equal(a, b) for a, b in zip(first, second))


def test_transforms(rng):
    q, k, v = _inputs(rng, 3, 10, 12, 4, 2, 16)
    ct = normal(rng, q.shape)
    kw = dict(is_causal=True)

    def ours(q, k, v):
        return jaxdnn.dot_product_attention(q, k, v, **kw)

    def oracle(q, k, v):
        return _xla(q, k, v, **kw)

    # vmap over a non-leading axis of q with k, v unbatched (the batch of 3 on axis 1)
    qs = jnp.stack([q, 2 * q], axis=1)  # [B, 2, T, N, H]
    got = jax.vmap(ours, in_axes=(1, None, None), out_axes=1)(qs, k, v)
    want = jax.vmap(oracle, in_axes=(1, None, None), out_axes=1)(f64(qs), f64(k), f64(v))
    assert_close(got, want, 1e-5, "vmap")
    # a bias and lengths mapped along with q
    bias = normal(rng, (2, 1, 4, 10, 12))
    lens = jnp.array([[12, 5, 1], [3, 12, 7]], jnp.int32)
    got = jax.vmap(lambda q, b, n: jaxdnn.dot_product_attention(q, k, v, b, key_value_seq_lengths=n),
                   in_axes=(1, 0, 0), out_axes=1)(qs, bias, lens)
    want = jax.vmap(lambda q, b, n: _xla(q, f64(k), f64(v), b, key_value_seq_lengths=n),
                    in_axes=(1, 0, 0), out_axes=1)(f64(qs), f64(bias), lens)
    assert_close(got, want, 1e-5, "vmap with bias and lengths")
    # per-example gradients
    def loss(f):
        return lambda q, k, v, c: jnp.sum(f(q[None], k[None], v[None])[0] * c)
    per_example = jax.vmap(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v, ct)
    want = jax.vmap(jax.grad(loss(oracle), argnums=(0, 1, 2)))(f64(q), f64(k), f64(v), f64(ct))
    for g, e in zip(per_example, want):
        assert_close(g, e, 1e-4, "vmap(grad)")
    # grad of grad (a gradient penalty)
    def penalty(f, q, k, v):
        grads = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * ct.astype(q.dtype)), argnums=(0, 1, 2))
        return sum(jnp.sum(g ** 2) for g in grads(q, k, v))
    got = jax.grad(lambda *a: penalty(ours, *a), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: penalty(oracle, *a), argnums=(0, 1, 2))(f64(q), f64(k), f64(v))
    for g, e in zip(got, want):
        assert_close(g, e, 1e-4, "grad of grad")
    # checkpoint and scan
    def scanned(f, q):
        h, _ = jax.lax.scan(lambda h, _: (jax.checkpoint(f)(h, k.astype(h.dtype), v.astype(h.dtype)) * 3.0,
                                          None), q, None, length=3)
        return jnp.sum(h * ct.astype(h.dtype))
    assert_close(jax.grad(lambda q: scanned(ours, q))(q), jax.grad(lambda q: scanned(oracle, q))(f64(q)),
                 1e-4, "scan(checkpoint)")
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(ours, (q, k, v), (ct, k, v))


def test_hlo_holds_the_custom_calls(rng):
    q, k, v = _inputs(rng, 1, 8, 8, 2, 2, 16)
    hlo = jax.jit(jax.grad(lambda q: jnp.sum(jaxdnn.dot_product_attention(q, k, v) * q))).lower(q).as_text()
    assert "jaxdnn_attention_fwd_v2" in hlo and "jaxdnn_attention_bwd_v3" in hlo
    assert "dot_general" not in hlo  # no T x S matmul: nothing falls back to XLA's attention


@pytest.mark.parametrize("mesh_kind", ["mesh", "explicit"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_batch_sharded_runs_per_shard(with_bias, mesh_kind, rng, devices):
    if mesh_kind == "explicit":
        mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    else:
        mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    rows = NamedSharding(mesh, P("b"))
    q, k, v = (jax.device_put(x, rows) for x in _inputs(rng, 8, 12, 16, 4, 2, 16))
    ct = jax.device_put(normal(rng, q.shape), rows)
    lens = jax.device_put(jnp.asarray(rng.integers(1, 17, 8), jnp.int32), rows)
    bias = normal(rng, (1, 4, 12, 16)) if with_bias else None

    def ours(q, k, v, bias):
        return jaxdnn.dot_product_attention(q, k, v, bias, key_value_seq_lengths=lens, is_causal=True)

    step = jax.jit(lambda q, k, v, ct: jax.vjp(lambda *a: ours(*a, bias), q, k, v)[1](ct))
    with jax.set_mesh(mesh) if mesh_kind == "explicit" else contextlib.nullcontext():
        hlo = step.lower(q, k, v, ct).compile().as_text()
        got = step(q, k, v, ct)
        out = jax.jit(ours)(q, k, v, bias)
    assert "all-gather" not in hlo
    calls = [line for line in hlo.splitlines() if 'custom_call_target="jaxdnn_attention_' in line]
    assert len(calls) == 2 and all("f32[2,12,4,16]" in line for line in calls), calls
    want = vjp(lambda q, k, v: _xla(q, k, v, f64(bias), key_value_seq_lengths=lens, is_causal=True),
               [f64(q), f64(k), f64(v)], f64(ct))
    for g, e in zip(got, want):
        assert_close(g, e, 1e-4, "sharded grad")
        assert g.sharding.spec[0] == "b"
    assert out.sharding.spec[0] == "b"


def test_shard_map_and_sharded_bias_gradient(rng, devices):
    """Inside a user's shard_map (per-device kernels), and a bias gradient from batch-sharded inputs."""
    mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    rows = NamedSharding(mesh, P("b"))
    q, k, v = (jax.device_put(x, rows) for x in _inputs(rng, 8, 10, 12, 2, 1, 16))
    bias = normal(rng, (1, 2, 10, 12))
    per_shard = jax.shard_map(lambda q, k, v, b: jaxdnn.dot_product_attention(q, k, v, b, is_causal=True),
                              mesh=mesh, in_specs=(P("b"), P("b"), P("b"), P()), out_specs=P("b"))
    want = _xla(f64(q), f64(k), f64(v), f64(bias), is_causal=True)
    assert_close(jax.jit(per_shard)(q, k, v, bias), want, 1e-5, "shard_map")
    loss = jax.jit(jax.grad(lambda b: jnp.sum(jaxdnn.dot_product_attention(q, k, v, b) ** 2)))
    hlo = loss.lower(bias).compile().as_text()
    assert "all-gather" not in hlo
    want = jax.grad(lambda b: jnp.sum(_xla(f64(q), f64(k), f64(v), b) ** 2))(f64(bias))
    assert_close(loss(bias), want, 1e-4, "sharded dbias")


def test_export_round_trip(rng):
    q, k, v = _inputs(rng, 2, 9, 11, 4, 2, 16)
    f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jaxdnn.dot_product_attention(q, k, v, is_causal=True) ** 2),
                         argnums=(0, 1, 2)))
    exported = jax.export.export(f, disabled_checks=jaxdnn.export_safety_checks())(q, k, v)
    restored = jax.export.deserialize(exported.serialize())
    for got, want in zip(restored.call(q, k, v), f(q, k, v)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_implementation_xla_is_jax_nn(rng):
    q, k, v = _inputs(rng, 1, 6, 6, 2, 2, 16)
    np.testing.assert_array_equal(jaxdnn.dot_product_attention(q, k, v, implementation="xla"),
                                  jax.nn.dot_product_attention(q, k, v, implementation="xla"))


_Q, _KV = jnp.ones((2, 5, 4, 16), jnp.float32), jnp.ones((2, 7, 2, 16), jnp.float32)
BAD = [
    (lambda: (_Q, _KV[..., :8], _KV[..., :8]), {}, ValueError, "in B and H"),
    (lambda: (_Q, _KV[:, :, :1].repeat(3, 2), _KV[:, :, :1].repeat(3, 2)), {}, ValueError,
     "N = 4 must be a multiple of the key/value heads K = 3"),
    (lambda: (_Q, _KV, _KV[:, :6]), {}, ValueError, "value must have key's shape"),
    (lambda: (_Q.astype(jnp.int32), _KV, _KV), {}, TypeError, "query must be float32"),
    (lambda: (_Q, _KV.astype(jnp.bfloat16), _KV), {}, TypeError, "must have query's dtype"),
    (lambda: (_Q[..., :12], _KV[..., :12], _KV[..., :12]), {}, ValueError,
     "H = 12 must be a multiple of 8"),
    (lambda: (_Q[0, 0], _KV[0, 0], _KV[0, 0]), {}, ValueError, "query must be"),
    (lambda: (_Q, _KV, _KV), dict(bias=jnp.ones((2, 4, 5, 6))), ValueError,
     r"bias of shape \(2, 4, 5, 6\) is not broadcastable to \[B, N, T, S\] = \(2, 4, 5, 7\)"),
    (lambda: (_Q, _KV, _KV), dict(bias=jnp.ones((1, 2, 4, 5, 7))), ValueError, "bias must have rank <= 4"),
    (lambda: (_Q, _KV, _KV), dict(bias=jnp.ones((4, 5, 7), jnp.int32)), TypeError, "bias must be floating"),
    (lambda: (_Q, _KV, _KV), dict(mask=jnp.ones((3, 1, 5, 7), bool)), ValueError, "mask of shape"),
    (lambda: (_Q, _KV, _KV), dict(mask=jnp.ones((5, 7))), TypeError, "mask must be bool"),
    (lambda: (_Q, _KV, _KV), dict(query_seq_lengths=jnp.ones((2,), jnp.int64)), TypeError,
     "query_seq_lengths must be int32, got int64"),
    (lambda: (_Q, _KV, _KV), dict(key_value_seq_lengths=jnp.ones((3,), jnp.int32)), ValueError,
     r"key_value_seq_lengths must have shape \(2,\), got \(3,\)"),
    (lambda: (_Q, _KV, _KV), dict(q_segment_ids=jnp.ones((2, 5), jnp.int32)), ValueError, "together"),
    (lambda: (_Q, _KV, _KV), dict(q_segment_ids=jnp.ones((2, 5), jnp.int32),
                                  kv_segment_ids=jnp.ones((2, 5), jnp.int32)), ValueError,
     r"kv_segment_ids must have shape \(2, 7\)"),
    (lambda: (_Q, _KV, _KV), dict(local_window_size=(1, -2)), ValueError, "local_window_size"),
    (lambda: (_Q, _KV, _KV), dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be > 0"),
    (lambda: (_Q, _KV, _KV), dict(dropout_rate=0.1), ValueError, "needs a dropout_rng key"),
    (lambda: (_Q, _KV, _KV), dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError,
     r"dropout_rate must be in \[0, 1\)"),
    (lambda: (_Q, _KV, _KV), dict(implementation="xla", dropout_rate=0.1), ValueError, "has no dropout"),
    (lambda: (_Q, _KV, _KV), dict(dropout_rate=0.1, dropout_rng=jax.random.key(0), broadcast_dropout=1),
     TypeError, "broadcast_dropout must be a bool"),
    (lambda: (_Q, _KV, _KV), dict(implementation="flash"), ValueError, "implementation must be"),
    (lambda: (_Q, _KV, _KV), dict(implementation="xla", logits_soft_cap=1.0), ValueError, "does not take"),
    (lambda: (_Q, _KV, _KV), dict(is_causal=1), TypeError, "is_causal must be a bool"),
]


@pytest.mark.parametrize("operands,kw,error,message", BAD, ids=[b[3][:30] for b in BAD])
def test_bad_input(operands, kw, error, message):
    with pytest.raises(error, match=message):
        jaxdnn.dot_product_attention(*operands(), **kw)


def test_traced_scale_is_refused():
    with pytest.raises(TypeError, match="scale must be a Python number"):
        jax.jit(lambda s: jaxdnn.dot_product_attention(_Q, _KV, _KV, scale=s))(0.5)


def test_bias_gradient_only_when_differentiated(rng):
    """dbias ([B, N, T, S] float32) is computed only for a bias being differentiated: a constant
    bias (ALiBi, say) costs the backward no T x S buffer."""
    q, k, v = _inputs(rng, 2, 24, 40, 2, 2, 16)
    bias = normal(rng, (1, 2, 24, 40))

    def loss(q, bias):
        return jnp.sum(jaxdnn.dot_product_attention(q, k, v, bias) ** 2)

    full = "tensor<2x2x24x40xf32>"
    assert full not in jax.jit(jax.grad(loss)).lower(q, bias).as_text()
    assert full in jax.jit(jax.grad(loss, argnums=1)).lower(q, bias).as_text()
    # per-example bias gradients, and second order through the bias
    got = jax.vmap(jax.grad(loss, argnums=1), in_axes=(None, 0))(q, jnp.stack([bias, -bias]))
    want = jax.vmap(jax.grad(lambda q, b: jnp.sum(_xla(f64(q), f64(k), f64(v), b) ** 2), argnums=1),
                    in_axes=(None, 0))(q, f64(jnp.stack([bias, -bias])))
    assert_close(got, want, 1e-4, "vmap(grad) bias")
    got = jax.grad(lambda b: jnp.sum(jax.grad(loss)(q, b) ** 2))(bias)
    want = jax.grad(lambda b: jnp.sum(jax.grad(lambda q, b: jnp.sum(_xla(q, f64(k), f64(v), b) ** 2))(
        f64(q), b) ** 2))(f64(bias))
    assert_close(got, want, 1e-4, "grad of grad through the bias")


def test_flax_attention_fn_matches_stock(rng):
    """jaxdnn.flax.dot_product_attention as the attention_fn of Flax's attention modules, against
    stock Flax with the same parameters (linen with two batch axes and a causal mask; nnx)."""
    nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")
    import jaxdnn.flax

    x = normal(rng, (2, 3, 10, 32))
    mask = nn.make_causal_mask(jnp.ones((2, 3, 10)))
    stock = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64)
    ours = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64,
                                           attention_fn=jaxdnn.flax.dot_product_attention)
    params = stock.init(jax.random.key(0), x, mask=mask)
    want = stock.apply(params, x, mask=mask)
    assert_close(ours.apply(params, x, mask=mask), want, 1e-5, "linen")
    grads = jax.grad(lambda p: jnp.sum(ours.apply(p, x, mask=mask) ** 2))(params)
    want_grads = jax.grad(lambda p: jnp.sum(stock.apply(p, x, mask=mask) ** 2))(params)
    # (all leaves at once: the key projection's bias has gradient 0, by the softmax's shift invariance)
    flat = [jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)]) for t in (grads, want_grads)]
    assert_close(*flat, 1e-4, "linen grads")
    for broadcast in (True, False):  # Flax's default: one mask for every batch element and head
        dropping = nn.MultiHeadDotProductAttention(
            num_heads=4, qkv_features=64, dropout_rate=0.2, deterministic=False, broadcast_dropout=broadcast,
            attention_fn=jaxdnn.flax.dot_product_attention)
        rngs = {"dropout": jax.random.key(2)}
        dropped = [dropping.apply(params, x, mask=mask, rngs=rngs) for _ in range(2)]
        assert np.all(np.isfinite(dropped[0])) and rel_err(dropped[0], want) > 0.05
        np.testing.assert_array_equal(*dropped)  # the same key, the same mask

    y = normal(rng, (2, 7, 16))
    stock_nnx = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=nnx.Rngs(0))
    ours_nnx = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=nnx.Rngs(0),
                                      attention_fn=jaxdnn.flax.dot_product_attention)
    assert_close(ours_nnx(y), stock_nnx(y), 1e-5, "nnx")


def test_memory_is_linear_in_sequence_length(rng):
    """fwd+bwd at T = S = 8192 needs no T x S buffer (256 MiB in float32): compiled, not run."""
    t = 8192
    q = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 1, 16), jnp.float32)
    step = jax.jit(lambda q, k, v, ct: jax.vjp(
        lambda *a: jaxdnn.dot_product_attention(*a, is_causal=True), q, k, v)[1](ct))
    memory = step.lower(q, kv, kv, q).compile().memory_analysis()
    assert memory.temp_size_in_bytes < 4 * 2**20, memory


def test_haiku_usage_matches_stock(rng):
    """The Haiku usage the README shows: hk.MultiHeadAttention's parameters (query, key, value,
    linear) around jaxdnn.dot_product_attention, against stock Haiku with the same parameters."""
    hk = pytest.importorskip("haiku")

    class MultiHeadAttention(hk.Module):
        def __init__(self, num_heads, key_size, model_size, name="multi_head_attention"):
            super().__init__(name=name)
            self.num_heads, self.key_size, self.model_size = num_heads, key_size, model_size

        def __call__(self, query, key, value, mask=None):
            def heads(x, name):
                y = hk.Linear(self.num_heads * self.key_size, name=name)(x)
                return y.reshape(*x.shape[:-1], self.num_heads, self.key_size)
            q, k, v = heads(query, "query"), heads(key, "key"), heads(value, "value")
            out = jaxdnn.dot_product_attention(q, k, v, mask=mask)
            return hk.Linear(self.model_size, name="linear")(out.reshape(*query.shape[:-1], -1))

    x = normal(rng, (2, 9, 24))
    mask = jnp.tril(jnp.ones((9, 9), bool))[None, None]
    stock = hk.without_apply_rng(hk.transform(
        lambda x: hk.MultiHeadAttention(num_heads=4, key_size=8, model_size=24,
                                        w_init=hk.initializers.VarianceScaling())(x, x, x, mask)))
    ours = hk.without_apply_rng(hk.transform(lambda x: MultiHeadAttention(4, 8, 24)(x, x, x, mask)))
    params = stock.init(jax.random.key(0), x)
    assert jax.tree.structure(params) == jax.tree.structure(ours.init(jax.random.key(0), x))
    assert_close(ours.apply(params, x), stock.apply(params, x), 1e-5, "haiku")


def test_batch_polymorphic_export(rng):
    """Exported once with a symbolic batch, run at two batch sizes."""
    def loss(q, k, v, lens):
        return jnp.sum(jaxdnn.dot_product_attention(q, k, v, key_value_seq_lengths=lens, is_causal=True) ** 2)

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    b = jax.export.symbolic_shape("b")[0]
    kv = jax.ShapeDtypeStruct((b, 9, 2, 16), jnp.float32)
    shapes = [jax.ShapeDtypeStruct((b, 7, 4, 16), jnp.float32), kv, kv, jax.ShapeDtypeStruct((b,), jnp.int32)]
    exported = jax.export.export(f, disabled_checks=jaxdnn.export_safety_checks())(*shapes)
    restored = jax.export.deserialize(exported.serialize())
    for batch in (1, 3):
        q, k, v = _inputs(rng, batch, 7, 9, 4, 2, 16)
        lens = jnp.asarray(rng.integers(1, 10, batch), jnp.int32)
        for got, want in zip(restored.call(q, k, v, lens), f(q, k, v, lens)):
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_jacrev(rng):
    """jacrev = vmap of the VJP over cotangents, the primals unbatched."""
    q, k, v = _inputs(rng, 1, 3, 5, 2, 1, 8)
    bias = normal(rng, (1, 2, 3, 5))
    got = jax.jacrev(lambda q, b: jaxdnn.dot_product_attention(q, k, v, b, is_causal=True),
                     argnums=(0, 1))(q, bias)
    want = jax.jacrev(lambda q, b: _xla(q, f64(k), f64(v), b, is_causal=True),
                      argnums=(0, 1))(f64(q), f64(bias))
    for g, e in zip(got, want):
        assert_close(g, e, 1e-4, "jacrev")


@pytest.mark.parametrize("broadcast", [False, True], ids=["per-head", "broadcast"])
def test_dropout_matches_reference_with_the_same_mask(broadcast, rng):
    """The kernels' dropout mask is a hash of (seed, n, t, s) that the reference recomputes: forward
    and VJP (q, k, v, bias) against the reference in float64 with the same seed. broadcast_dropout:
    one seed for the batch and head 0's hash for every head, so identical rows of q, k and v across
    the batch and the heads give identical outputs, where masks per batch element and head do not."""
    q, k, v = _inputs(rng, 2, 19, 37, 4, 2, 16)
    bias = normal(rng, (1, 4, 19, 37))
    key = jax.random.key(int(rng.integers(1 << 31)))
    seed = jnp.broadcast_to(jax.random.bits(key, (1 if broadcast else 2, 2), jnp.uint32), (2, 2))
    kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([37, 20], jnp.int32))

    def ours(q, k, v, b):
        return jaxdnn.dot_product_attention(q, k, v, b, dropout_rate=0.3, dropout_rng=key,
                                            broadcast_dropout=broadcast, **kw)

    def oracle(q, k, v, b):
        return jaxdnn.reference.attention.dot_product_attention(
            q, k, v, b, dropout_rate=0.3, dropout_seed=seed, dropout_heads=not broadcast, **kw)

    assert_close(ours(q, k, v, bias), oracle(f64(q), f64(k), f64(v), f64(bias)), 1e-5, "forward")
    ct = normal(rng, q.shape)
    got = vjp(ours, [q, k, v, bias], ct)
    want = vjp(oracle, [f64(q), f64(k), f64(v), f64(bias)], f64(ct))
    for name, g, e in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert_close(g, e, 1e-4, name)
    undropped = jaxdnn.dot_product_attention(q, k, v, bias, **kw)
    assert rel_err(ours(q, k, v, bias), undropped) > 0.1  # dropout did something
    np.testing.assert_array_equal(ours(q, k, v, bias), ours(q, k, v, bias))  # same key, same mask
    other = jaxdnn.dot_product_attention(q, k, v, bias, dropout_rate=0.3, dropout_rng=jax.random.key(7),
                                         broadcast_dropout=broadcast, **kw)
    assert rel_err(other, ours(q, k, v, bias)) > 0.1

    q1, k1 = normal(rng, (1, 19, 1, 16)), normal(rng, (1, 37, 1, 16))
    same = [jnp.broadcast_to(x, (2, x.shape[1], 4, 16)) for x in (q1, k1, k1)]  # every b, n alike
    out = jaxdnn.dot_product_attention(*same, dropout_rate=0.3, dropout_rng=key, broadcast_dropout=broadcast)
    if broadcast:
        np.testing.assert_array_equal(out, jnp.broadcast_to(out[:1, :, :1], out.shape))
    else:
        assert rel_err(out[:, :, 1], out[:, :, 0]) > 0.1 and rel_err(out[1], out[0]) > 0.1


def _reference(q, k, v, bias, mask, **kw):
    return jaxdnn.reference.attention.dot_product_attention(q, k, v, bias, mask, **kw)


# Decoding shapes (G T <= 4 query rows a kv head, S >= 1024 keys): the CUDA backward's one-pass
# decoding kernel (ffi/attention/attention.cu), S not a multiple of its 256-key chunks.
DECODE_CASES = {
    "gqa-h72": ((2, 1, 1500, 8, 2, 72), {}),
    "t2-lengths": ((2, 2, 1300, 2, 1, 64), dict(key_value_seq_lengths=np.array([1300, 517], np.int32))),
    "h256-causal-window": ((1, 3, 1030, 1, 1, 256), dict(is_causal=True, local_window_size=(500, 0))),
    "soft-cap-segments": ((2, 1, 1100, 4, 4, 32), dict(logits_soft_cap=3.0)),
}


@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_decoding_backward(case, dtype, rng):
    """Forward and VJP (q, k, v, bias) of decoding-shaped problems against jax.nn, with a bias, a mask,
    soft cap and segment ids against the reference; dropout with the reference's mask."""
    (b, t, s, n, kv, h), kw = DECODE_CASES[case]
    q, k, v = _inputs(rng, b, t, s, n, kv, h, dtype)
    if case == "soft-cap-segments":
        kw = dict(kw, q_segment_ids=jnp.zeros((b, t), jnp.int32),
                  kv_segment_ids=jnp.asarray(rng.random((b, s)) < 0.2, jnp.int32))
        mask = jnp.asarray(rng.random((b, 1, 1, s)) < 0.7)
        _check_against(_reference, rng, q, k, v, normal(rng, (1, n, t, s), dtype), mask, **kw)
    else:
        _check_against(_xla, rng, q, k, v, normal(rng, (b, 1, t, s), dtype), **kw)
    key = jax.random.key(int(rng.integers(1 << 31)))
    seed = jax.random.bits(key, (b, 2), jnp.uint32)
    kw = {name: value for name, value in kw.items() if not name.endswith("segment_ids")}

    def ours(q, k, v):
        return jaxdnn.dot_product_attention(q, k, v, dropout_rate=0.25, dropout_rng=key, **kw)

    def oracle(q, k, v):
        return _reference(q, k, v, None, None, dropout_rate=0.25, dropout_seed=seed, **kw)

    ct = normal(rng, q.shape, dtype)
    want = vjp(oracle, [f64(x) for x in (q, k, v)], f64(ct))
    for name, g, e in zip(("dq", "dk", "dv"), vjp(ours, [q, k, v], ct), want):
        assert_close(g, e, tolerance(dtype, grad=True), f"dropout {name}")


def test_dropout_mask_statistics():
    """About `rate` of the probabilities are dropped, and the kept ones are scaled to keep the mean."""
    seed = jax.random.bits(jax.random.key(3), (2, 2), jnp.uint32)
    keep = jaxdnn.reference.attention.dropout_keep(0.25)
    scale = np.asarray(jaxdnn.reference.attention.dropout_scale(seed, keep, 4, 64, 256, jnp.float32))
    assert abs(np.mean(scale == 0) - 0.25) < 0.01
    assert abs(np.mean(scale) - 1.0) < 0.02


def test_dropout_under_vmap_over_keys(rng):
    """Per-example keys (vmap over dropout_rng) fold into the batch: each example as if alone."""
    q, k, v = _inputs(rng, 1, 9, 11, 2, 1, 16)
    keys = jax.random.split(jax.random.key(5), 3)

    def f(key):
        return jaxdnn.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=key)

    batched = jax.vmap(f)(keys)
    for i in range(3):
        np.testing.assert_allclose(batched[i], f(keys[i]), rtol=1e-6)
    grads = jax.vmap(jax.grad(lambda q, key: jnp.sum(jaxdnn.dot_product_attention(
        q, k, v, dropout_rate=0.5, dropout_rng=key) ** 2)), in_axes=(None, 0))(q, keys)
    for i in range(3):
        want = jax.grad(lambda q: jnp.sum(jaxdnn.dot_product_attention(
            q, k, v, dropout_rate=0.5, dropout_rng=keys[i]) ** 2))(q)
        np.testing.assert_allclose(grads[i], want, rtol=1e-5, atol=1e-6)
