"""Pure-JAX reference implementations: the tests' oracle, the second-order derivatives of the
kernels, and the documented path for cases a kernel does not serve (each is named in its docs)."""

from jaxdnn.reference import activation, attention, batch_norm, rnn
from jaxdnn.reference.conv import conv, conv_general_dilated
from jaxdnn.reference.dense import dense
from jaxdnn.reference.group_norm import group_norm, group_norm_bwd, group_norm_fwd
from jaxdnn.reference.norm import layer_norm, norm_bwd, norm_fwd, rms_norm
from jaxdnn.reference.pool import avg_pool, max_pool
from jaxdnn.reference.rnn import gru, lstm
from jaxdnn.reference.softmax import log_softmax, softmax, softmax_bwd, softmax_fwd

__all__ = ["activation", "attention", "avg_pool", "batch_norm", "conv", "conv_general_dilated", "dense",
           "group_norm", "group_norm_bwd", "group_norm_fwd", "gru", "layer_norm", "log_softmax", "lstm",
           "max_pool", "norm_bwd", "norm_fwd", "rms_norm", "rnn", "softmax", "softmax_bwd", "softmax_fwd"]
