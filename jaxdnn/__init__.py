"""jaxdnn: fast fused deep-learning primitives for JAX (CUDA kernels through the XLA FFI)."""

from jaxdnn import config
from jaxdnn._ffi import cpu_isa, has_cuda_kernels, target_names
from jaxdnn._export import export_safety_checks
from jaxdnn.activation import (elu, gelu, hard_tanh, leaky_relu, relu, relu6, sigmoid, silu, softplus,
                               tanh)
from jaxdnn.attention import dot_product_attention
from jaxdnn.batch_norm import batch_norm
from jaxdnn.conv import conv, conv_general_dilated, conv_transpose
from jaxdnn.dense import dense
from jaxdnn.group_norm import group_norm
from jaxdnn.norm import layer_norm, rms_norm
from jaxdnn.pool import avg_pool, max_pool
from jaxdnn.recurrent import gru, gru_cell, lstm, lstm_cell, rnn, rnn_cell
from jaxdnn.softmax import log_softmax, softmax

__version__ = "0.1.0"

__all__ = [
    "avg_pool",
    "batch_norm",
    "config",
    "conv",
    "conv_general_dilated",
    "conv_transpose",
    "cpu_isa",
    "dense",
    "dot_product_attention",
    "elu",
    "export_safety_checks",
    "gelu",
    "group_norm",
    "gru",
    "gru_cell",
    "hard_tanh",
    "has_cuda_kernels",
    "layer_norm",
    "leaky_relu",
    "log_softmax",
    "lstm",
    "lstm_cell",
    "max_pool",
    "relu",
    "relu6",
    "rms_norm",
    "rnn",
    "rnn_cell",
    "sigmoid",
    "silu",
    "softmax",
    "softplus",
    "tanh",
    "target_names",
]
