"""`precision` arguments (as `lax.dot_general`'s) read the way jaxdnn's float32 products use them."""

from __future__ import annotations

import jax

# dot algorithms that are float32-accurate or better: the products stay exact float32 sums.
_EXACT_ALGORITHMS = frozenset({"F32_F32_F32", "F64_F64_F64", "TF32_TF32_F32_X3", "BF16_BF16_F32_X6",
                               "BF16_BF16_F32_X9"})


def allows_tf32(precision) -> bool:
    """Whether `precision` lets a GPU kernel round float32 operands to TF32 on tensor cores, as XLA's
    float32 dots and cuDNN's RNNs under `jax.experimental.rnn` do: None (unless
    `jax_default_matmul_precision` says otherwise), DEFAULT and HIGH do; HIGHEST and float32-accurate
    dot algorithms do not. A pair (lhs, rhs) allows it when both do."""
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
        if precision is None:
            return True
    if isinstance(precision, (tuple, list)):
        return all(allows_tf32(p) for p in precision)
    if isinstance(precision, str):
        if precision.upper() in jax.lax.DotAlgorithmPreset.__members__:
            return precision.upper() not in _EXACT_ALGORITHMS
        precision = jax.lax.Precision(precision)
    if isinstance(precision, jax.lax.DotAlgorithmPreset):
        return precision.name not in _EXACT_ALGORITHMS
    if isinstance(precision, jax.lax.Precision):
        return precision != jax.lax.Precision.HIGHEST
    return False  # another dot algorithm: keep the products exact
