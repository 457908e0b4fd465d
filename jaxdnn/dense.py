"""Dense layers: `dense(x, w, bias, activation=)` = act(x @ w + bias), the epilogue fused into the
GEMM kernel.

Shapes: x [..., K] (any leading axes, M rows in all), w [K, N] (flax's `kernel` layout), bias [N],
y [..., N]. The kernel (ffi/dense/dense.h, target `jaxdnn_gemm_v3`) computes, for every batch
entry l < L, c[l] = act(op_a(a[l]) . op_b(b[l]) + bias) with op_a / op_b optional transposes,
float32 accumulation and the operands' dtype out (float32 operands rounded to TF32 on a GPU's
tensor cores where `precision` allows it, as XLA's float32 dots). `dense` folds x's leading axes into
M (L = 1); the training forward writes z with it and the backward is two more calls, dx = dz . w^T and
dw = x^T . dz with every leading axis folded into the contracted rows (split into slices summed in
float32 when the product has few output tiles).

Differentiable with `jax.grad`/`jax.vjp` to any order (every derivative runs on the kernel; the
activation's derivatives run on jaxdnn's activation kernels); forward-mode `jax.jvp` is not provided
(custom_vjp).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdnn import _autotune, _ffi  # noqa: F401  (_ffi registers the FFI targets)
from jaxdnn._precision import allows_tf32, result_dtype
from jaxdnn._primitive import ffi_primitive, match_varying, move_to_front, per_row_shard
from jaxdnn.activation import KIND_NAMES, _activation, backward_with_bias_grad, epilogue, epilogue_attrs
from jaxdnn.reference.activation import FUNCTIONS

_FLOAT_TYPES = [jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]
_F32 = jnp.float32


# --- the kernel as primitives ---------------------------------------------------------------------

def _gemm_avals(a, b, bias, *, trans_a, trans_b, activation, activation_param, algorithm, tf32):
    m = a.shape[2] if trans_a else a.shape[1]
    n = b.shape[1] if trans_b else b.shape[2]
    return [jax.core.ShapedArray((a.shape[0], m, n), a.dtype)]


def _batch_rule(prim, args, dims, **attrs):
    """A vmapped a with a shared b (and trans_a = 0) joins a's rows M: one call on [L, B * M, K].
    Otherwise the vmapped axis is folded into L, shared operands broadcast to it. A batched bias is
    added in XLA after an epilogue-free call, and the activation applied there too."""
    a, b, bias = args
    a_dim, b_dim, bias_dim = dims
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    if bias_dim is not None:
        no_epilogue = dict(attrs, **epilogue_attrs("identity", 0.0))
        no_bias = jnp.zeros((0,), _F32)
        if a_dim is None and b_dim is None:
            z = _bind(a, b, no_bias, **no_epilogue)[None]
        else:
            outs, out_dims = _batch_rule(prim, (a, b, no_bias), (a_dim, b_dim, None), **no_epilogue)
            z = move_to_front(outs[0], out_dims[0], size)
        # z was rounded to a's dtype by the kernel: the sum and activation round once more.
        z = z.astype(_F32) + move_to_front(bias, bias_dim, size)[:, None, None, :]
        kind = KIND_NAMES[int(attrs["activation"])]
        return [FUNCTIONS[kind](z, attrs["activation_param"]).astype(a.dtype)], [0]
    if b_dim is None and not int(attrs["trans_a"]):
        a = jnp.moveaxis(a, a_dim, 1)  # [L, B, M, K]
        c = _bind(a.reshape((a.shape[0], size * a.shape[2], a.shape[3])), b, bias, **attrs)
        return [c.reshape((c.shape[0], size, a.shape[2], c.shape[2]))], [1]
    a, b = move_to_front(a, a_dim, size), move_to_front(b, b_dim, size)  # [B, L, ...]
    c = _bind(a.reshape((size * a.shape[1],) + a.shape[2:]), b.reshape((size * b.shape[1],) + b.shape[2:]),
              bias, **attrs)
    return [c.reshape((size, a.shape[1]) + c.shape[1:])], [0]


def _gemm_primitive(layout: str, rule: str, **kwargs):
    return ffi_primitive(f"jaxdnn_gemm_{layout}", "jaxdnn_gemm_v3", result_avals=_gemm_avals,
                         batch_rule=_batch_rule, sharding_rule=rule, **kwargs)


# One target, three primitives: they differ only in their sharding rule (`...` = the axes that may
# stay sharded, each device running the kernel on its own part), which depends on where the rows
# of the activations are. The factor names of unshared axes are distinct because the sizes differ.
_GEMM = {
    # L = 1, a [1, M, K]: a's rows M run per shard (x in the forward, dz in dx); b is replicated.
    "rows": _gemm_primitive("rows", "... k, l p q, s -> ... n"),
    # L = 1, trans_a, a [1, R, K] and b [1, R, N] share the contracted rows R (x and dz in dw): each
    # shard multiplies its own rows and the [1, K, N] products are summed over the shards.
    "contract": _gemm_primitive("contract", "... k, ... n, s -> l p q", reduced_results=(0,)),
    # Batches (vmap over the weights): L runs per shard.
    "batched": _gemm_primitive("batched", "... m k, ... p q, s -> ... r n"),
}


# The `algorithm` attribute's tile configurations (ffi/dense/dense.h's GemmAlgorithm) that autotuning
# times: 128 x 256 in clusters of 2, 128 x 128, 128 x 64; and for float32 a^T . b at TF32 the streamed
# mma.sync kernel (ffi/dense/gemm_streamed_tf32.cu).
_TILE_CONFIGS = (1, 2, 3)
_STREAMED = 4


def _candidates(a, b, trans_a, trans_b, tf32):
    """The tile configurations, where the tensor cores take the product (16-bit operands, or float32
    ones as TF32; 16-byte aligned rows; not both operands transposed: dense.cu's GemmOnTensorCores)."""
    n = b.shape[1] if trans_b else b.shape[2]
    itemsize = jnp.dtype(a.dtype).itemsize
    per_16_bytes = 16 // itemsize
    aligned = a.shape[-1] % per_16_bytes == 0 and b.shape[-1] % per_16_bytes == 0 and n % per_16_bytes == 0
    if not ((itemsize == 2 or tf32) and aligned and not (trans_a and trans_b)):
        return ()
    return _TILE_CONFIGS + ((_STREAMED,) if itemsize == 4 and trans_a and not trans_b else ())


def _bind(a, b, bias, **attrs):
    """The kernel on a [L, M, K] (or [L, K, M]), b [L, K, N] (or [L, N, K]), bias [N] or [0]; the
    tile configuration from autotuning (any `algorithm` in attrs is chosen anew for these shapes)."""
    batch, trans_a, trans_b = a.shape[0], int(attrs["trans_a"]), int(attrs["trans_b"])
    if isinstance(batch, int) and batch == 1:
        # trans_a with trans_b (a caller's own bind: _matmul never makes one): the contracted rows
        # are b's last axis, so only L may stay sharded.
        layout = "contract" if trans_a and not trans_b else ("batched" if trans_a else "rows")
    else:
        layout = "batched"
    attrs = {k: v for k, v in attrs.items() if k != "algorithm"}
    algorithm = _autotune.choose(_GEMM[layout], (a, b, bias), attrs,
                                 _candidates(a, b, trans_a, trans_b, int(attrs["tf32"])))
    return _GEMM[layout].bind(a, b, bias, **attrs, algorithm=np.int64(algorithm))[0]


def _gemm(a, b, bias, trans_a, trans_b, tf32, kind="identity", param=0.0):
    return _bind(a, b, jnp.zeros((0,), _F32) if bias is None else bias, trans_a=np.int64(trans_a),
                 trans_b=np.int64(trans_b), tf32=np.int64(tf32), **epilogue_attrs(kind, param))


# --- the plain product, differentiated by two more products ---------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul(a, b, trans_a, trans_b, tf32):
    """op_a(a) . op_b(b) per batch entry: a [L, M, K] ([L, K, M] when trans_a), b [L, K, N]
    ([L, N, K] when trans_b) -> [L, M, N]; float32 operands as TF32 on a GPU when tf32."""
    if trans_a and trans_b:
        # A^T . B^T = (B . A)^T and one XLA transpose: the tensor-core kernels leave this layout out
        # (dense.cu), as jaxdnn's products and their derivatives never need it.
        return jnp.swapaxes(_gemm(b, a, None, 0, 0, tf32), 1, 2)
    return _gemm(a, b, None, trans_a, trans_b, tf32)


def _matmul_bwd(trans_a, trans_b, tf32, residuals, dc):
    # With A = op_a(a), B = op_b(b): dA = dc . B^T and dB = A^T . dc, written as products of the
    # stored a, b and dc so that no operand is transposed in memory.
    a, b = residuals
    da = _matmul(b, dc, trans_b, 1, tf32) if trans_a else _matmul(dc, b, 0, 1 - trans_b, tf32)
    db = _matmul(dc, a, 1, trans_a, tf32) if trans_b else _matmul(a, dc, 1 - trans_a, 0, tf32)
    return da, db


_matmul.defvjp(lambda a, b, trans_a, trans_b, tf32: (_matmul(a, b, trans_a, trans_b, tf32), (a, b)),
               _matmul_bwd)


# The weight gradient x^T . dz contracts the M rows. With few output tiles (a [147, 64] stem filter,
# a classifier's [K, 10]: one or two 128-wide tiles) one or two SMs would do all the work, so the
# rows are split into slices multiplied as a batch (one kernel call) and summed in float32.
_SMS = 132  # an H100/H200's: the slice count is a function of the shapes alone, the same everywhere
_MIN_SLICE_ROWS = 4096
# float32 products at TF32 of at most this many sums run on the streamed kernel (dense.cu, gemm_sm90.h's
# kStreamedMaxOutputs), whose slices may be shorter.
_STREAMED_MAX_OUTPUTS = 1 << 17
_STREAMED_MIN_SLICE_ROWS = 1024


def _streamed_tiles(k, n):
    """The streamed kernel's tiles of a [k, n] product (gemm_streamed_tf32.cu's StreamedTf32TileM: of
    the 64 x 256, 128 x 128 and 256 x 64 tiles, the shape whose tiles read the fewest columns)."""
    counts = [(-(-k // m) * -(-n // (16384 // m)), m) for m in (64, 128, 256)]
    return min(counts, key=lambda c: c[0] * (c[1] + 16384 // c[1]))[0]


def _row_slices(rows, k, n, streamed=False):
    """How many slices of the rows to multiply apart: about one output tile per SM, each slice at
    least _MIN_SLICE_ROWS long (_STREAMED_MIN_SLICE_ROWS on the streamed kernel); a divisor of rows
    (1: no split)."""
    tiles = _streamed_tiles(k, n) if streamed else max(1, -(-k // 128) * -(-n // 128))
    limit = min(-(-_SMS // tiles), rows // (_STREAMED_MIN_SLICE_ROWS if streamed else _MIN_SLICE_ROWS))
    return next((s for s in range(limit, 1, -1) if rows % s == 0), 1)


def weight_gradient(x, dz, tf32):
    """x^T . dz for x [1, M, K] and dz [1, M, N] -> [1, K, N]. Split into slices, each partial
    product is rounded to x's dtype before the float32 sum: for 16-bit operands about one more
    rounding error than one product would make."""
    rows, k, n = x.shape[1], x.shape[2], dz.shape[2]
    streamed = bool(tf32) and x.dtype == _F32 and k % 4 == 0 and n % 4 == 0 and k * n <= _STREAMED_MAX_OUTPUTS
    slices = _row_slices(rows, k, n, streamed)
    if slices == 1:
        return _matmul(x, dz, 1, 0, tf32)
    parts = _matmul(x.reshape(slices, rows // slices, k), dz.reshape(slices, rows // slices, n), 1, 0, tf32)
    return jnp.sum(parts, axis=0, keepdims=True, dtype=_F32).astype(x.dtype)


# --- the fused forward ----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _dense(x, w, bias, kind, param, tf32):
    """act(x . w + bias) in one kernel call: x [1, M, K], w [1, K, N], bias [N] float32 or [0]."""
    return _gemm(x, w, bias, 0, 0, tf32, kind, param)


def _dense_fwd(x, w, bias, kind, param, tf32):
    # z through `_dense` itself (identity epilogue), so that it is differentiable for the higher
    # orders; the activation by its own kernel, keeping z (not y) for act'(z).
    z = _dense(x, w, bias, "identity", 0.0, tf32)
    y = z if kind == "identity" else _activation(z, kind, param)
    return y, (x, w, bias, z)


def _dense_bwd(kind, param, tf32, residuals, dy):
    x, w, bias, z = residuals
    if kind == "identity":
        dz = dy
        dbias = jnp.sum(dz[0], axis=0, dtype=_F32) if bias.shape[0] else jnp.zeros_like(bias)
    elif bias.shape[0]:
        dz, dbias = backward_with_bias_grad(dy, z, kind, param)  # one pass: dbias with dz
    else:
        dz, dbias = jax.vjp(lambda z: _activation(z, kind, param), z)[1](dy)[0], jnp.zeros_like(bias)
    return _matmul(dz, w, 0, 1, tf32), weight_gradient(x, dz, tf32), dbias


_dense.defvjp(_dense_fwd, _dense_bwd)


# --- public API -----------------------------------------------------------------------------------

def _as_array(a):
    return a if hasattr(a, "shape") and hasattr(a, "dtype") else jnp.asarray(a)


def _check(x, w, bias):
    x, w = _as_array(x), _as_array(w)
    for name, a in (("x", x), ("w", w)):
        if a.dtype not in _FLOAT_TYPES:
            raise TypeError(f"dense: {name} must be float32, bfloat16 or float16, got {a.dtype}")
    if x.dtype != w.dtype:
        raise TypeError(f"dense: x and w must have the same dtype, got {x.dtype} and {w.dtype}")
    if x.ndim < 1:
        raise ValueError(f"dense: x must have shape [..., K] (rank >= 1), got shape {x.shape}")
    if w.ndim != 2:
        raise ValueError(f"dense: w must have shape [K, N] (rank 2), got shape {w.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"dense: K mismatch: x's last axis has {x.shape[-1]} features, w's first "
                         f"{w.shape[0]} (x shape {x.shape}, w shape {w.shape})")
    if bias is None:
        return x, w, None
    bias = _as_array(bias)
    if bias.dtype not in (jnp.dtype(_F32), x.dtype):
        raise TypeError(f"dense: bias must be float32 or x's dtype {x.dtype}, got {bias.dtype}")
    if bias.shape != w.shape[1:]:
        raise ValueError(f"dense: bias must have shape (N,) = {w.shape[1:]} to match w shape {w.shape}, got "
                         f"bias shape {bias.shape}")
    return x, w, bias.astype(_F32)


def dense(x, w, bias=None, *, activation=None, precision=None, preferred_element_type=None):
    """act(x @ w + bias) on the GEMM kernel, the bias and activation fused into its epilogue.

    Args:
      x: [..., K] float32, bfloat16 or float16; any number of leading axes (empty ones too), folded
        into the M rows of one matrix product.
      w: [K, N] in x's dtype (flax's `kernel` / haiku's `w` layout).
      bias: None or [N], float32 or x's dtype (added in float32).
      activation: None or a name of `jaxdnn.activation.EPILOGUES` ("relu", "gelu", "silu",
        "leaky_relu", ...).
      precision: as `lax.dot_general`'s, for float32 x and w: None (JAX's default, unless
        `jax_default_matmul_precision` sets another), DEFAULT or HIGH let the GPU kernel round the
        operands to TF32 on tensor cores, as XLA's float32 dots do; HIGHEST (or a float32-accurate
        dot algorithm) keeps exact float32 products. The CPU kernel's are always exact; 16-bit
        operands are exact products in any case.
      preferred_element_type: None (x's dtype) or the result's float dtype, at least as wide as x's
        (`lax.dot_general`'s rule). For 16-bit x and w and a float32 (or the other 16-bit) result,
        the float32 kernels run on the operands widened to float32 (exact products, float32 sums
        and epilogue, rounded once): twice the bytes, and on a GPU the TF32 rate.

    Returns:
      [..., N] in `preferred_element_type` (x's dtype by default), accumulated in float32 and
      rounded once; gradients in x's and w's dtype.

    Differentiable with `jax.grad`/`jax.vjp` to any order; `jax.jvp` is not supported. Under
    differentiation the forward writes z = x @ w + bias and applies the activation with its own
    kernel (z is kept for act'(z)), so y is act of z rounded to x's dtype, where the fused call
    applies act to the float32 sum. dbias is the float32 sum of dz over the rows, taken (with an
    activation) in the same pass as dz.
    """
    kind, param = epilogue("dense", activation)
    x, w, bias = _check(x, w, bias)
    out_dtype = result_dtype("dense", x.dtype, preferred_element_type)
    widened = out_dtype != x.dtype
    if widened:
        x, w = x.astype(_F32), w.astype(_F32)
    tf32 = int(x.dtype == jnp.dtype(_F32) and (widened or allows_tf32(precision)))

    def run(x, w, bias):
        w, bias = match_varying(x, w, bias)
        rows = x.reshape((1, math.prod(x.shape[:-1]), x.shape[-1]))
        y = _dense(rows, w[None], jnp.zeros((0,), _F32) if bias is None else bias, kind, param, tf32)
        return y.reshape(x.shape[:-1] + w.shape[1:])
    if bias is None:
        y = per_row_shard(lambda x, w: run(x, w, None), x, w)
    else:
        y = per_row_shard(run, x, w, bias)
    return y.astype(out_dtype) if widened else y
