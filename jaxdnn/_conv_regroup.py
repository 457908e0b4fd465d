"""Grouped convolutions and 3-D windows, rewritten as convolutions the tensor-core kernels take.

The GPU's tensor-core kernels run one group and 2-D windows (a 3-D one only with a depth window of
1); everything else would run on the CUDA-core baseline, one to two orders of magnitude slower. Two
rewrites, each a set of convolutions of one group on linear maps of the operands:
- `GroupBlocks` (1 < G < C; not the 16-bit groups of 16 or 32 channels that ffi/conv/grouped.cu takes as
  they are, see _conv_kernels._grouped_kernel_takes): the groups in blocks of m, each block one
  convolution of its m * Cg channels with a block-diagonal filter (zeros off its m diagonal blocks): m
  times the products of its groups, but fewer, larger convolutions, each on a slice of x's channels (an
  XLA copy) and their results joined (another). m is the fewest groups that give a block 128 channels and
  filters: on an H200 (2026-11-28) blocks of at least 128 ran ResNeXt-50's grouped layers 1.03-1.95x
  faster than blocks of 64 (14^2 512 channels in 32 groups: 4 blocks of 128, 0.32 ms fwd+bwd, against 8
  of 64, 0.62, and 2 of 256, 0.43). ResNeXt's 32 groups of 4 channels are then one dense convolution.
  Non-finite values differ from lax's: a zero of the filter times another group's inf or NaN in the same
  block is NaN. On a GPU only: the CPU's kernels take the groups.
- `DepthFold` (one group, depth window T > 1): each output depth's T input planes side by side as
  T * C channels (XLA's gather; T times x), the depth folded into the batch, so that the
  convolution is a 2-D one of N * P images with the filter [1, U, V, T * C, K]. On a GPU only: the
  CPU's kernels take 3-D windows.
Each rewrite maps x, w and y-shaped operands (`inputs`, `filters`, `outputs`, `biases`) to its
convolutions' and joins their results back (`join_*`: the transposes of those maps for dx and dw, the
inverse for y), so that each stage of the original convolution is the same stage of the rewritten
ones (jaxdnn/_conv_kernels.py), and so is every derivative.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxdnn import _conv_few_channels as few_channels
from jaxdnn._primitive import transpose_linear

# The channels and filters a block of groups needs (see the module docstring).
_BLOCK_WIDTH = 128
# Whether the GPU's forms of some stages (both rewrites; the strided dgrad's space-to-depth form) run
# on the CPU too (jaxdnn/_conv_kernels.py's `_gpu_only`): off; the tests turn it on to check them there.
BLOCKS_ON_CPU = False


def groups_per_block(groups, group_channels, group_filters):
    """m, the fewest groups (a divisor of `groups`) whose channels and filters both reach _BLOCK_WIDTH;
    all of them if none do."""
    narrow = min(group_channels, group_filters)
    return next((m for m in range(1, groups + 1) if groups % m == 0 and m * narrow >= _BLOCK_WIDTH), groups)


class GroupBlocks:
    """Feature groups in blocks of `groups_per_block`, a convolution of one group per block."""

    def __init__(self, x_shape, w_shape, conv):
        self.group_channels, self.group_filters = w_shape[3], w_shape[4] // conv.groups
        self.per_block = groups_per_block(conv.groups, self.group_channels, self.group_filters)
        self.blocks = conv.groups // self.per_block
        self.convs = [dataclasses.replace(conv, groups=1)] * self.blocks

    def inputs(self, x):
        return jnp.split(x, self.blocks, axis=-1)

    outputs = inputs  # y-shaped operands: their features split the same way

    def biases(self, bias):
        return jnp.split(bias, self.blocks)

    def filters(self, w):
        """w [T, U, V, Cg, G * Kg] -> one [T, U, V, m * Cg, m * Kg] a block, block-diagonal: group i of
        the block maps its channels i * Cg.. to its filters i * Kg.., zeros elsewhere (selected, so a
        non-finite w stays in its group)."""
        m, window = self.per_block, w.shape[:3]
        w = jnp.moveaxis(w.reshape(window + (self.group_channels, self.blocks, m, self.group_filters)), 4, 0)
        diagonal = jnp.eye(m, dtype=bool)[:, None, :, None]  # [i, Cg, j, Kg]: i == j
        dense = jnp.where(diagonal, w[:, :, :, :, None], jnp.zeros((), w.dtype))
        block_shape = (m * self.group_channels, m * self.group_filters)
        return list(dense.reshape((self.blocks,) + window + block_shape))

    def join_outputs(self, ys):
        return jnp.concatenate(ys, axis=-1)

    join_inputs = join_outputs

    def join_filters(self, dws):
        """The transpose of `filters`: each block's diagonal blocks, back in w's layout."""
        m, window = self.per_block, dws[0].shape[:3]
        blocks = (m, self.group_channels, m, self.group_filters)
        dense = jnp.stack(dws).reshape((self.blocks,) + window + blocks)
        diagonal = jnp.diagonal(dense, axis1=4, axis2=6)  # [blocks, T, U, V, Cg, Kg, m]
        return jnp.moveaxis(diagonal, (0, 6), (4, 5)).reshape(window + (self.group_channels, -1))


# The window attributes of an axis that does nothing: the depth's in the 2-D convolution, the
# plane's in the gather of the depth's windows.
_NEUTRAL = {"window": 1, "strides": 1, "pads": 0, "rhs_dilation": 1}


class DepthFold:
    """A depth window folded into the channels and the output depths into the batch."""

    def __init__(self, x_shape, w_shape, conv):
        self.x_shape = x_shape
        plane, out_depth = conv.in_spatial[1:], conv.out_spatial[0]
        depth_only = {name: (getattr(conv, name)[0], n, n) for name, n in _NEUTRAL.items()}
        plane_only = {name: (n, *getattr(conv, name)[1:]) for name, n in _NEUTRAL.items()}
        # The gather of each output depth's window of input planes (patches over the depth alone).
        self.planes = dataclasses.replace(conv, out_spatial=(out_depth, *plane), **depth_only)
        flat = dataclasses.replace(conv, in_spatial=(1, *plane), out_spatial=(1, *conv.out_spatial[1:]),
                                   **plane_only)
        self.convs = [flat]

    def inputs(self, x):
        """x [N, D, H, W, C] -> [N * P, 1, H, W, T * C] (padded to a multiple of 8), tap-major channels."""
        planes = few_channels.patches(x, self.planes)
        return [planes.reshape((-1, 1) + planes.shape[2:])]

    def outputs(self, y):
        return [y.reshape((-1, 1) + y.shape[2:])]

    def biases(self, bias):
        return [bias]

    def filters(self, w):
        """w [T, U, V, C, K] -> [1, U, V, T * C, K] (padded as `inputs`' channels)."""
        window, channels, filters = w.shape[:3], w.shape[3], w.shape[4]
        folded = jnp.moveaxis(w, 0, 2).reshape((1,) + window[1:] + (window[0] * channels, filters))
        return [few_channels.pad_channels(folded, -2)]

    def join_outputs(self, ys):
        return ys[0].reshape((self.x_shape[0], -1) + ys[0].shape[2:])

    def join_inputs(self, dxs):
        """The transpose of `inputs` (XLA's transpose of the gather: the planes' sums back into x)."""
        return transpose_linear(lambda x: self.inputs(x)[0], self.x_shape, dxs[0])

    def join_filters(self, dws):
        """The transpose of `filters`."""
        _, height, width, _, filters = dws[0].shape
        taps, channels = self.planes.window[0], self.x_shape[-1]
        dw = dws[0][0, :, :, :taps * channels].reshape((height, width, taps, channels, filters))
        return jnp.moveaxis(dw, 2, 0)


def rewrite(x_shape, w_shape, conv):
    """The rewrite that takes the convolution `conv` of x [N, D, H, W, C] with w [T, U, V, Cg, K] to the
    tensor-core kernels (its dtype and operands checked by the caller), or None: groups but not
    depthwise, or one group and a depth window; no lhs dilation (a transposed convolution with groups
    stays on the baseline)."""
    empty = min(math.prod(x_shape), math.prod(w_shape), math.prod(conv.out_spatial)) == 0
    if conv.lhs_dilation != (1, 1, 1) or empty:
        return None
    if 1 < conv.groups < x_shape[-1]:
        return GroupBlocks(x_shape, w_shape, conv)
    if conv.groups == 1 and conv.window[0] > 1:
        return DepthFold(x_shape, w_shape, conv)
    return None
