"""Flax modules over jaxdnn's functional API (Flax is an optional dependency).

``import jaxdnn`` never imports Flax; ``import jaxdnn.flax`` does. The linen
modules are re-exported here; the NNX ones live in ``jaxdnn.flax.nnx`` (imported
on first use, since ``flax.nnx`` is a sizeable import of its own)::

    from jaxdnn.flax import BatchNorm, GroupNorm, LayerNorm, RMSNorm   # flax.linen modules
    from jaxdnn.flax import Conv, ConvTranspose    # flax.linen modules on jaxdnn's convolution
    from jaxdnn.flax import Dense                  # flax.linen Dense on jaxdnn's GEMM
    from jaxdnn.flax import nnx as jnnx    # jnnx.BatchNorm, .Conv, .GroupNorm, .Linear, .LayerNorm, .RMSNorm
    from jaxdnn.flax import dot_product_attention  # attention_fn of Flax's attention modules
    from jaxdnn.flax import LSTM, GRU, SimpleRNN   # linen layers over whole sequences
    from jaxdnn.flax import lstm_weights_from_flax, gru_weights_from_flax  # from LSTMCell/GRUCell params
    from jaxdnn.flax import simple_rnn_weights_from_flax                  # from SimpleCell params

Both mirror the stock Flax modules' attributes and parameter names (``scale``,
``bias``; BatchNorm's ``batch_stats`` ``mean``/``var``), so params made with stock Flax load
unchanged and vice versa.
"""

import importlib as _importlib

from jaxdnn.flax import linen
from jaxdnn.flax.attention import dot_product_attention
from jaxdnn.flax.linen import BatchNorm, Conv, ConvTranspose, Dense, GroupNorm, LayerNorm, RMSNorm
from jaxdnn.flax.rnn import (GRU, LSTM, SimpleRNN, gru_weights_from_flax, lstm_weights_from_flax,
                             simple_rnn_weights_from_flax)

__all__ = ["BatchNorm", "Conv", "ConvTranspose", "Dense", "GRU", "GroupNorm", "LSTM", "LayerNorm", "RMSNorm",
           "SimpleRNN", "dot_product_attention", "gru_weights_from_flax", "linen", "lstm_weights_from_flax",
           "nnx", "simple_rnn_weights_from_flax"]


def __getattr__(name):
    if name == "nnx":
        return _importlib.import_module(f"{__name__}.nnx")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
