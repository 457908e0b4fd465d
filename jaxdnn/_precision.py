"""`precision` and `preferred_element_type` arguments (as `lax.dot_general`'s) read the way jaxdnn's
products use them."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


_FLOAT_RESULTS = [jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16)]


def result_dtype(fn: str, operands, preferred_element_type):
    """The dtype of a product of `operands` (a float dtype) under `preferred_element_type`, by lax's
    rule: None gives the operands' dtype, else a float type at least as wide. A wider one (16-bit
    operands, a float32 or the other 16-bit result) is computed on the float32 kernels with the
    operands widened: TF32 products keep 16-bit values exact (their 8 or 5 exponent bits and 7 or 10
    mantissa bits), so the result is the exact products' float32 sums, rounded once."""
    operands = jnp.dtype(operands)
    if preferred_element_type is None:
        return operands
    preferred = jnp.dtype(preferred_element_type)
    if preferred not in _FLOAT_RESULTS:
        raise TypeError(f"{fn}: preferred_element_type must be None, float32, bfloat16 or float16 for "
                        f"{operands} operands, got {preferred}")
    if preferred.itemsize < operands.itemsize:
        raise TypeError(f"{fn}: preferred_element_type must not be narrower than the operands' dtype "
                        f"{operands}, got {preferred}")
    return preferred
