"""jaxdnn: fast fused deep-learning primitives for JAX (CUDA kernels through the XLA FFI)."""

from jaxdnn._ffi import has_cuda_kernels, target_names
from jaxdnn._export import export_safety_checks
from jaxdnn.norm import layer_norm, rms_norm
from jaxdnn.softmax import log_softmax, softmax

__version__ = "0.1.0"

__all__ = [
    "export_safety_checks",
    "has_cuda_kernels",
    "layer_norm",
    "log_softmax",
    "rms_norm",
    "softmax",
    "target_names",
]
