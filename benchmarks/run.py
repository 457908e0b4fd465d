"""Benchmarks for jaxdnn: every case timed against its XLA peer, in one process, on the same inputs.

    python benchmarks/run.py --family norm --out benchmarks/results [--repeats 20] [--quick]
    python benchmarks/run.py --family pool batch_norm --out RESULTS_DIR
    python benchmarks/run.py --family all  --out RESULTS_DIR
    python benchmarks/run.py --family conv --case "1x1" --out RESULTS_DIR   (cases matching a regex)

Conventions (see ARCHITECTURE.md, "Benchmarks"):
- Timing (`time_fn`): each case has several sets of distinct inputs (8; 2 with --quick), and one jitted
  program runs the call on every set in turn, each call behind an optimization barrier on the one before
  (no fusion or overlap between them, no L2 reuse, one host dispatch for all). After compiling and 3
  warm-up runs, `repeats` (default 20) repeats of ~20 ms of runs back to back (at least 3, so the
  host's dispatch of a run overlaps the GPU's work on the one before), each ended by
  `jax.block_until_ready`; the reported time is the median per call in ms. Inputs are random normal.
- fwd+bwd cases run `jax.vjp` of the function w.r.t. every array argument under one `jax.jit` and
  apply it to a random cotangent passed in as an argument; they return the primal output too, so the
  forward output is really written, as in a training step.
- Ceilings, measured in the same run: copy bandwidth = a jitted negation of a 1 GiB bf16 array (a real
  read + write kernel; `x * 1` or `x + 0` would be optimized away), counting bytes read + written; compute
  = a bf16 8192^3 matmul, 2*M*N*K FLOPs. `ceiling_fraction` = value / the ceiling of the same metric.
- Memory-bound families report GB/s of compulsory traffic (each family documents its byte count).
- Results: `<out>/<device>-<date>.json` (`-autotune`, `-quick` are appended for `--autotune` and
  `--quick` runs; rewritten after every case, so a run cut short keeps what it measured), a JSON
  list of records {"family", "case", "dtype", "jaxdnn_ms", "peer", "peer_ms", "speedup" (peer_ms /
  jaxdnn_ms), "metric", "value", "ceiling_fraction", "jax", "device", "date", "autotune"}; the
  ceilings are records of family "ceiling" with null peer fields. A table is printed at the end.
  `--autotune` runs with jaxdnn.config.autotune on (candidates timed while a case is compiled,
  outside its timing), its choices kept in `<out>/autotune.json`. `--nondeterministic` runs with
  jaxdnn.config.deterministic off (`-nondeterministic` appended to the file name; the records'
  "deterministic" field says which).

Adding a family: write `def <family>_cases(quick) -> list[Case]` and add it to `FAMILIES` (a family
measured other than by time, such as attention_memory, returns its records and goes in `OTHER_FAMILIES`).
"""

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp

import jaxdnn


# ----------------------------------------------------------------------------------------------------
# Timing


def _chain(fn: Callable, arg_sets: list[tuple]) -> list:
    """`fn` applied to each argument set in turn, in one program. Each call waits for the previous one
    (an optimization barrier), so XLA neither fuses nor overlaps them, and one dispatch covers them all."""
    outs = []
    for args in arg_sets:
        if outs:
            args, _ = jax.lax.optimization_barrier((args, outs[-1]))
        outs.append(fn(*args))
    return outs


def time_fn(
    fn: Callable, arg_sets: list[tuple], repeats: int = 20, warmup: int = 3, target_ms: float = 20.0,
    min_runs: int = 3,
) -> float:
    """Median time in ms of one call `fn(*args)`, over the argument sets in `arg_sets`.

    The calls on all the sets run as one jitted program (`_chain`): on distinct inputs, so no set is
    served from the L2 of the one before, and with the host's dispatch cost spread over all of them
    (a single ~50 us kernel per dispatch would time the host, not the GPU). The program is compiled
    and run `warmup` times; each of the `repeats` repeats then runs it back to back for about
    `target_ms` (`min_runs` to 500 times) and waits for the last result. A repeat of one run would
    time the host's dispatch of the program before its first kernel starts, in full: 1.3 ms of a
    33 ms program of 8 RNN fwd+bwd calls (H200, 2026-12-01), against none in a training loop, where
    each step's dispatch overlaps the GPU's work on the step before.
    """
    program = jax.jit(lambda sets: _chain(fn, sets))
    for _ in range(1 + warmup):  # compile, then warm up
        jax.block_until_ready(program(arg_sets))
    start = time.perf_counter()
    jax.block_until_ready(program(arg_sets))
    single_ms = (time.perf_counter() - start) * 1e3
    runs = max(min_runs, min(500, math.ceil(target_ms / max(single_ms, 1e-3))))
    per_call_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(runs):
            out = program(arg_sets)
        jax.block_until_ready(out)  # one stream: the last result done means every run is done
        per_call_ms.append((time.perf_counter() - start) * 1e3 / (runs * len(arg_sets)))
    return statistics.median(per_call_ms)


# ----------------------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass
class Case:
    family: str
    name: str  # the shape in full, e.g. "layer_norm R32768 D1024 fwd+bwd"
    fn: Callable  # jaxdnn
    peer: str
    peer_fn: Callable  # same signature and inputs as fn
    arg_sets: list[tuple]  # several sets of distinct inputs of one call (see time_fn)
    work: float  # bytes (metric GB/s) or FLOPs (metric TFLOP/s) per call
    metric: str  # "GB/s" or "TFLOP/s"
    peer_arg_sets: list[tuple] | None = None  # the peer's inputs when they differ from `arg_sets`


def _normal(key, shape, dtype, mean=0.0, std=1.0):
    return (mean + std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _fwd_bwd(f, *, separate=True):
    """(*primals, dy) -> (y, grads of every primal): the fwd+bwd of a training step.

    separate=True puts an optimization barrier between the passes, as a real network does (dy comes
    from the layers after this one, so nothing of the backward can start before the forward is done).
    separate=False lets XLA see dy while it compiles the forward, so it may fuse both passes into one
    pass over x and dy: a shortcut no training step offers, measured for reference.
    """

    def run(*args):
        *primals, dy = args
        y, vjp = jax.vjp(f, *primals)
        if separate:
            y, vjp = jax.lax.optimization_barrier((y, vjp))
        return y, vjp(dy)

    return run


def _bwd_case(family, name, fn, peer_fn, primal_sets, dy_sets, work):
    """The backward pass alone: each side's VJP closure (holding its own saved residuals) applied to dy."""
    apply = lambda dy, vjp_fn: vjp_fn(dy)

    def arg_sets(f):
        return [(dy, jax.vjp(f, *primals)[1]) for primals, dy in zip(primal_sets, dy_sets)]

    return Case(
        family,
        name,
        apply,
        "xla",
        apply,
        arg_sets(fn),
        work,
        "GB/s",
        peer_arg_sets=arg_sets(peer_fn),
    )


# --- norm -------------------------------------------------------------------------------------------


def _layer_norm_xla(x, scale, bias, epsilon=1e-6):
    """Layer norm over the last axis the way Flax's LayerNorm computes it (fast variance, fp32 stats)."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(jnp.square(x32), axis=-1, keepdims=True) - jnp.square(mean))
    mul = jax.lax.rsqrt(var + epsilon) * scale.astype(jnp.float32)
    return ((x32 - mean) * mul + bias.astype(jnp.float32)).astype(x.dtype)


def _rms_norm_xla(x, scale, epsilon=1e-6):
    """RMS norm over the last axis the way Flax's RMSNorm computes it (fp32 stats)."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return (x32 * (jax.lax.rsqrt(var + epsilon) * scale.astype(jnp.float32))).astype(x.dtype)


def _row_cases(family: str, ops: dict, shapes: list, quick: bool) -> list[Case]:
    """Cases of row-wise ops (normalized over the last axis), bf16, rows R x features D: fwd,
    fwd+bwd (two ways) and bwd, for each op {name: (jaxdnn function, XLA peer, number of (D,) params)}.

    Bytes (compulsory traffic; the convention of the issues that set the targets, so GB/s compare
    with the XLA numbers quoted there):
      fwd     = read x + write y + read the params
      fwd+bwd = read x (or y) + read dy + write dx + the params and their grads
      bwd     = the same bytes as fwd+bwd, for the backward pass alone (from each side's residuals)
    The fwd+bwd cases also compute and return y (as a training step does), which this count leaves out:
    the time covers both passes, the bytes only three R*D arrays. "fwd+bwd" separates the passes by an
    optimization barrier, as the layers in between do in a network; "fwd+bwd dy-in-fwd" lets XLA fuse
    both passes into one pass over x and dy (dy is an input of the program), which no training step
    allows, so jaxdnn's two kernels cannot match it there. "bwd" is the backward pass alone.
    """
    dtype = jnp.bfloat16
    sets = 2 if quick else 8  # distinct input sets per timed program (see time_fn)
    cases = []
    key = jax.random.key(0)
    for rows, features in shapes:
        xs, dys, param_sets = [], [], []
        for _ in range(sets):
            key, kx, kdy, ks, kb = jax.random.split(key, 5)
            xs.append(_normal(kx, (rows, features), dtype))
            dys.append(_normal(kdy, (rows, features), dtype))
            param_sets.append(
                (
                    _normal(ks, (features,), dtype, mean=1.0, std=0.1),
                    _normal(kb, (features,), dtype, std=0.1),
                )
            )
        array_bytes = rows * features * jnp.dtype(dtype).itemsize
        param_bytes = features * jnp.dtype(dtype).itemsize
        for op, (fn, peer_fn, num_params) in ops.items():
            primal_sets = [(x, *params[:num_params]) for x, params in zip(xs, param_sets)]
            name = f"{op} R{rows} D{features}"
            fwd_bytes = 2 * array_bytes + num_params * param_bytes
            cases.append(
                Case(family, f"{name} fwd", fn, "xla", peer_fn, primal_sets, fwd_bytes, "GB/s")
            )
            bwd_bytes = 3 * array_bytes + 2 * num_params * param_bytes
            fwd_bwd_sets = [(*primals, dy) for primals, dy in zip(primal_sets, dys)]
            for suffix, separate in (("fwd+bwd", True), ("fwd+bwd dy-in-fwd", False)):
                cases.append(
                    Case(
                        family,
                        f"{name} {suffix}",
                        _fwd_bwd(fn, separate=separate),
                        "xla",
                        _fwd_bwd(peer_fn, separate=separate),
                        fwd_bwd_sets,
                        bwd_bytes,
                        "GB/s",
                    )
                )
            cases.append(_bwd_case(family, f"{name} bwd", fn, peer_fn, primal_sets, dys, bwd_bytes))
    return cases


def norm_cases(quick: bool) -> list[Case]:
    """layer_norm and rms_norm against Flax's formulas in XLA; layer_norm with its fused gelu
    (tanh approximation) against XLA's layer norm followed by jax.nn.gelu, on one shape."""
    shapes = (
        [(256, 1024), (64, 4096)]
        if quick
        else [(32768, 1024), (16384, 4096), (8192, 8192), (4096, 16384)]
    )
    ops = {
        "layer_norm": (jaxdnn.layer_norm, _layer_norm_xla, 2),
        "rms_norm": (jaxdnn.rms_norm, _rms_norm_xla, 1),
    }
    fused = {
        "layer_norm+gelu": (
            lambda x, scale, bias: jaxdnn.layer_norm(x, scale, bias, activation="gelu"),
            lambda x, scale, bias: jax.nn.gelu(_layer_norm_xla(x, scale, bias)),
            2,
        )
    }
    return _row_cases("norm", ops, shapes, quick) + _row_cases("norm", fused, shapes[1:2], quick)


def softmax_cases(quick: bool) -> list[Case]:
    """softmax and log_softmax against jax.nn's (XLA); rows up to 64k."""
    shapes = [(256, 1024), (8, 65536)] if quick else [(32768, 1024), (16384, 4096), (4096, 65536)]
    ops = {
        "softmax": (jaxdnn.softmax, jax.nn.softmax, 0),
        "log_softmax": (jaxdnn.log_softmax, jax.nn.log_softmax, 0),
    }
    return _row_cases("softmax", ops, shapes, quick)


def activation_cases(quick: bool) -> list[Case]:
    """Standalone activations against jax.nn's (XLA); both are memory-bound, so parity is expected."""
    shapes = [(256, 1024)] if quick else [(16384, 4096)]
    ops = {
        "relu": (jaxdnn.relu, jax.nn.relu, 0),
        "gelu": (jaxdnn.gelu, jax.nn.gelu, 0),
        "silu": (jaxdnn.silu, jax.nn.silu, 0),
        "sigmoid": (jaxdnn.sigmoid, jax.nn.sigmoid, 0),
    }
    return _row_cases("activation", ops, shapes, quick)


# --- batch norm ------------------------------------------------------------------------------------


def _batch_norm_xla(x, scale, bias, residual=None, relu=False, epsilon=1e-5, silu=False):
    """Training-mode batch norm over every axis but the last, the way Flax's BatchNorm computes it
    (fast variance, fp32 statistics), optionally followed by + residual and relu (the ResNet chain),
    or by jax.nn.silu."""
    x32 = x.astype(jnp.float32)
    axes = tuple(range(x.ndim - 1))
    mean = jnp.mean(x32, axis=axes)
    var = jnp.maximum(0.0, jnp.mean(jnp.square(x32), axis=axes) - jnp.square(mean))
    y = (x32 - mean) * (jax.lax.rsqrt(var + epsilon) * scale.astype(jnp.float32)) + bias.astype(jnp.float32)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    if silu:
        y = jax.nn.silu(y)
    return (jax.nn.relu(y) if relu else y).astype(x.dtype)


def batch_norm_cases(quick: bool) -> list[Case]:
    """Training-mode batch_norm, NHWC bf16, against Flax's formulas in XLA: plain, fused with a
    residual add and relu, and fused with silu (against XLA's batch norm followed by jax.nn.silu).
    Bytes (compulsory traffic): fwd = read x + write y; fwd+bwd = read x + read dy + write dx, plus read
    residual + write dresidual when fused with one (the [C] vectors are negligible)."""
    n, h, w, c = (8, 14, 14, 64) if quick else (128, 56, 56, 256)
    dtype = jnp.bfloat16
    sets = 2 if quick else 8
    key = jax.random.key(1)
    stats = (jnp.zeros((c,), jnp.float32), jnp.ones((c,), jnp.float32))
    primal_sets, residuals, dys = [], [], []
    for _ in range(sets):
        key, kx, kr, kdy, ks, kb = jax.random.split(key, 6)
        x = _normal(kx, (n, h, w, c), dtype, mean=0.5, std=2.0)
        scale = _normal(ks, (c,), jnp.float32, mean=1.0, std=0.1)
        primal_sets.append((x, scale, _normal(kb, (c,), jnp.float32, std=0.1)))
        residuals.append(_normal(kr, (n, h, w, c), dtype))
        dys.append(_normal(kdy, (n, h, w, c), dtype))
    array_bytes = n * h * w * c * jnp.dtype(dtype).itemsize
    name = f"batch_norm N{n} H{h} W{w} C{c} train"
    plain = lambda x, s, b: jaxdnn.batch_norm(x, s, b, *stats, training=True)[0]
    fused = lambda x, s, b, r: jaxdnn.batch_norm(x, s, b, *stats, training=True, residual=r,
                                                 activation="relu")[0]
    fused_xla = lambda x, s, b, r: _batch_norm_xla(x, s, b, r, relu=True)
    fused_sets = [(*p, r) for p, r in zip(primal_sets, residuals)]
    silu = lambda x, s, b: jaxdnn.batch_norm(x, s, b, *stats, training=True, activation="silu")[0]
    silu_xla = lambda x, s, b: _batch_norm_xla(x, s, b, silu=True)
    return [
        Case("batch_norm", f"{name} fwd", plain, "xla", _batch_norm_xla, primal_sets, 2 * array_bytes,
             "GB/s"),
        Case("batch_norm", f"{name} fwd+bwd", _fwd_bwd(plain), "xla", _fwd_bwd(_batch_norm_xla),
             [(*p, dy) for p, dy in zip(primal_sets, dys)], 3 * array_bytes, "GB/s"),
        Case("batch_norm", f"{name} +residual+relu fwd", fused, "xla", fused_xla, fused_sets, 3 * array_bytes,
             "GB/s"),
        Case("batch_norm", f"{name} +residual+relu fwd+bwd", _fwd_bwd(fused), "xla", _fwd_bwd(fused_xla),
             [(*p, dy) for p, dy in zip(fused_sets, dys)], 5 * array_bytes, "GB/s"),
        Case("batch_norm", f"{name} +silu fwd", silu, "xla", silu_xla, primal_sets, 2 * array_bytes, "GB/s"),
        Case("batch_norm", f"{name} +silu fwd+bwd", _fwd_bwd(silu), "xla", _fwd_bwd(silu_xla),
             [(*p, dy) for p, dy in zip(primal_sets, dys)], 3 * array_bytes, "GB/s"),
    ]


def pool_cases(quick: bool) -> list[Case]:
    """max_pool and avg_pool, 3x3 stride 2 SAME on the ResNet stem's [N, 112, 112, 64] bf16 (N = 128;
    16 with --quick), against flax.linen.max_pool/avg_pool (XLA's reduce_window, and select_and_scatter
    for the max-pool gradient): fwd, fwd+bwd (passes separated, as in a network) and bwd alone.

    Bytes (compulsory traffic): fwd = read x + write y; fwd+bwd = that + read dy + write dx; bwd = read
    dy + write dx. jaxdnn's max pool also moves its saved uint8 argmax (written by the forward, read by
    the backward; half of y's bytes in bf16), which this count leaves out, as it does XLA's re-read of x
    in the backward.
    """
    from flax import linen as nn

    dtype = jnp.bfloat16
    sets = 2 if quick else 8
    batch = 16 if quick else 128
    x_shape, y_shape = (batch, 112, 112, 64), (batch, 56, 56, 64)
    key = jax.random.key(0)
    xs, dys = [], []
    for _ in range(sets):
        key, kx, kdy = jax.random.split(key, 3)
        xs.append(_normal(kx, x_shape, dtype))
        dys.append(_normal(kdy, y_shape, dtype))
    itemsize = jnp.dtype(dtype).itemsize
    x_bytes, y_bytes = math.prod(x_shape) * itemsize, math.prod(y_shape) * itemsize
    window = dict(window_shape=(3, 3), strides=(2, 2), padding="SAME")
    ops = {
        "max_pool": (lambda x: jaxdnn.max_pool(x, **window), lambda x: nn.max_pool(x, **window)),
        "avg_pool": (lambda x: jaxdnn.avg_pool(x, **window), lambda x: nn.avg_pool(x, **window)),
    }
    cases = []
    for op, (fn, peer_fn) in ops.items():
        name = f"{op} 3x3/2 SAME N{batch} H112 W112 C64"
        primal_sets = [(x,) for x in xs]
        cases.append(Case("pool", f"{name} fwd", fn, "xla", peer_fn, primal_sets, x_bytes + y_bytes, "GB/s"))
        cases.append(
            Case(
                "pool",
                f"{name} fwd+bwd",
                _fwd_bwd(fn),
                "xla",
                _fwd_bwd(peer_fn),
                [(x, dy) for x, dy in zip(xs, dys)],
                2 * (x_bytes + y_bytes),
                "GB/s",
            )
        )
        cases.append(_bwd_case("pool", f"{name} bwd", fn, peer_fn, primal_sets, dys, x_bytes + y_bytes))
    return cases


def _group_norm_xla(x, scale, bias, num_groups=32, epsilon=1e-5):
    """Group norm over [N, ..., C] the way flax.linen.GroupNorm computes it (fast variance, fp32 stats)."""
    x32 = x.astype(jnp.float32)
    grouped = x32.reshape(x.shape[0], -1, num_groups, x.shape[-1] // num_groups)
    mean = jnp.mean(grouped, axis=(1, 3), keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(jnp.square(grouped), axis=(1, 3), keepdims=True) - jnp.square(mean))
    y = ((grouped - mean) * jax.lax.rsqrt(var + epsilon)).reshape(x.shape)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def group_norm_cases(quick: bool) -> list[Case]:
    """group_norm (channels last, 32 groups) against Flax's GroupNorm formulas in XLA, bf16; and
    group_norm with its fused silu against XLA's group norm followed by jax.nn.silu. The issue's shape
    (16 x 64 x 64 x 512) in every form; Stable Diffusion's UNet levels at batch 8 (320, 640 and 1280
    channels: groups of 10, 20 and 40) and SDXL's first (128 x 128 x 320, batch 2) as their forwards
    and with silu.

    Bytes of compulsory traffic, as for the row-wise families: fwd = read x + write y + the params;
    fwd+bwd and bwd = read x + read dy + write dx + the params and their grads (the kernels read x,
    and dy, twice: the statistics need a whole sample before anything can be written).
    """
    dtype, groups = jnp.bfloat16, 32
    sets = 2 if quick else 8
    if quick:
        shapes = [((2, 16, 16, 512), True), ((2, 8, 8, 320), False)]
    else:
        shapes = [((16, 64, 64, 512), True), ((8, 64, 64, 320), False), ((8, 32, 32, 640), False),
                  ((8, 16, 16, 1280), False), ((2, 128, 128, 320), False)]
    key = jax.random.key(0)
    fn = lambda x, scale, bias: jaxdnn.group_norm(x, groups, scale, bias)
    peer = lambda x, scale, bias: _group_norm_xla(x, scale, bias, groups)
    silu = lambda x, scale, bias: jaxdnn.group_norm(x, groups, scale, bias, activation="silu")
    silu_peer = lambda x, scale, bias: jax.nn.silu(_group_norm_xla(x, scale, bias, groups))
    cases = []
    for shape, every_form in shapes:
        primal_sets, dys = [], []
        for _ in range(sets):
            key, kx, kdy, ks, kb = jax.random.split(key, 5)
            primal_sets.append((_normal(kx, shape, dtype),
                                _normal(ks, shape[-1:], dtype, mean=1.0, std=0.1),
                                _normal(kb, shape[-1:], dtype, std=0.1)))
            dys.append(_normal(kdy, shape, dtype))
        array_bytes = math.prod(shape) * jnp.dtype(dtype).itemsize
        param_bytes = shape[-1] * jnp.dtype(dtype).itemsize
        fwd_bytes = 2 * array_bytes + 2 * param_bytes
        name = f"group_norm N{shape[0]} HW{shape[1]}x{shape[2]} C{shape[3]} G{groups}"
        fwd_bwd_sets = [(*primals, dy) for primals, dy in zip(primal_sets, dys)]
        bwd_bytes = 3 * array_bytes + 4 * param_bytes
        cases.append(Case("group_norm", f"{name} fwd", fn, "xla", peer, primal_sets, fwd_bytes, "GB/s"))
        if every_form:
            cases.append(Case("group_norm", f"{name} fwd+bwd", _fwd_bwd(fn), "xla", _fwd_bwd(peer),
                              fwd_bwd_sets, bwd_bytes, "GB/s"))
            cases.append(_bwd_case("group_norm", f"{name} bwd", fn, peer, primal_sets, dys, bwd_bytes))
        cases.append(Case("group_norm", f"{name} +silu fwd", silu, "xla", silu_peer, primal_sets, fwd_bytes,
                          "GB/s"))
        cases.append(Case("group_norm", f"{name} +silu fwd+bwd", _fwd_bwd(silu), "xla", _fwd_bwd(silu_peer),
                          fwd_bwd_sets, bwd_bytes, "GB/s"))
    return cases


# ResNet-50's convolutions (NHWC): (name, H = W, C, K, window, stride).
_RESNET50_CONVS = [
    ("stem", 224, 3, 64, 7, 2),
    ("3x3", 56, 64, 64, 3, 1),
    ("1x1 reduce", 56, 256, 64, 1, 1),
    ("1x1 expand", 56, 64, 256, 1, 1),
    ("3x3", 28, 128, 128, 3, 1),
    ("3x3/2", 56, 128, 128, 3, 2),
    ("3x3", 14, 256, 256, 3, 1),
    ("3x3", 7, 512, 512, 3, 1),
]


def conv_cases(quick: bool) -> list[Case]:
    """conv_general_dilated on ResNet-50's layers, NHWC / HWIO, bf16, N = 128 (2 with --quick), SAME
    padding, against lax.conv_general_dilated (XLA calls cuDNN on a GPU): fwd, and fwd+bwd (the
    gradients w.r.t. both the input and the filter, passes separated as in a network); the same in
    float32 at JAX's default precision (both sides multiply TF32-rounded operands on tensor cores;
    the case names say "float32"); then the fused conv + bias + relu and the depthwise cases.

    FLOPs: fwd = 2 * N * P * Q * K * C * R * S (groups = 1), fwd+bwd = 3 x fwd.
    """
    return (_resnet_conv_cases(quick, jnp.bfloat16, 8) + _resnet_conv_cases(quick, jnp.float32, 4)
            + _fused_conv_cases(quick) + _depthwise_conv_cases(quick) + _transpose_conv_cases(quick)
            + _grouped_conv_cases(quick) + _vmapped_filter_cases(quick) + _conv3d_cases(quick)
            + _long_row_cases(quick))


def _resnet_conv_cases(quick: bool, dtype, sets: int) -> list[Case]:
    sets = 2 if quick else sets
    batch = 2 if quick else 128
    numbers = ("NHWC", "HWIO", "NHWC")
    key = jax.random.key(0)
    cases = []
    suffix = " float32" if dtype == jnp.float32 else ""
    for label, size, channels, filters, window, stride in _RESNET50_CONVS:
        out = -(-size // stride)
        x_shape, w_shape, y_shape = (batch, size, size, channels), (window, window, channels, filters), (
            batch, out, out, filters)
        primal_sets, dys = [], []
        for _ in range(sets):
            key, kx, kw, kdy = jax.random.split(key, 4)
            primal_sets.append((_normal(kx, x_shape, dtype), _normal(kw, w_shape, dtype, std=0.1)))
            dys.append(_normal(kdy, y_shape, dtype))
        conv = dict(window_strides=(stride, stride), padding="SAME", dimension_numbers=numbers)
        fn = functools.partial(jaxdnn.conv_general_dilated, **conv)
        peer_fn = functools.partial(jax.lax.conv_general_dilated, **conv)
        flops = 2 * batch * out * out * filters * channels * window * window
        name = f"{label} N{batch} H{size} W{size} C{channels} K{filters} {window}x{window}/{stride}{suffix}"
        cases.append(Case("conv", f"{name} fwd", fn, "xla", peer_fn, primal_sets, flops, "TFLOP/s"))
        cases.append(Case("conv", f"{name} fwd+bwd", _fwd_bwd(fn), "xla", _fwd_bwd(peer_fn),
                          [(x, w, dy) for (x, w), dy in zip(primal_sets, dys)], 3 * flops, "TFLOP/s"))
    return cases


def _fused_conv_cases(quick: bool) -> list[Case]:
    """jaxdnn.conv(x, w, bias, activation="relu") (the epilogue in the conv kernel) against XLA's
    conv followed by the bias add and relu (which XLA may fuse into its cuDNN call), on ResNet-50's
    56^2 64->64 3x3 layer: fwd and fwd+bwd (gradients w.r.t. x, w and bias). FLOPs as the plain conv."""
    dtype = jnp.bfloat16
    sets = 2 if quick else 8
    batch = 2 if quick else 128
    size, channels, filters = 56, 64, 64
    key = jax.random.key(1)
    primal_sets, dys = [], []
    for _ in range(sets):
        key, kx, kw, kb, kdy = jax.random.split(key, 5)
        primal_sets.append((_normal(kx, (batch, size, size, channels), dtype),
                            _normal(kw, (3, 3, channels, filters), dtype, std=0.1),
                            _normal(kb, (filters,), dtype)))
        dys.append(_normal(kdy, (batch, size, size, filters), dtype))

    def fn(x, w, bias):
        return jaxdnn.conv(x, w, bias, activation="relu")

    def peer_fn(x, w, bias):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.relu(y + bias)

    flops = 2 * batch * size * size * filters * channels * 9
    name = f"conv+bias+relu N{batch} H{size} W{size} C{channels} K{filters} 3x3/1"
    return [
        Case("conv", f"{name} fwd", fn, "xla", peer_fn, primal_sets, flops, "TFLOP/s"),
        Case("conv", f"{name} fwd+bwd", _fwd_bwd(fn), "xla", _fwd_bwd(peer_fn),
             [(*primals, dy) for primals, dy in zip(primal_sets, dys)], 3 * flops, "TFLOP/s"),
    ]


# Depthwise convolutions (H = W, C, window), stride 1, SAME: the 3x3 layers, ConvNeXt-T's
# 7x7 stages and EfficientNet-B0's 5x5 ones.
_DEPTHWISE_CONVS = [
    (56, 256, 3), (14, 1024, 3),
    (56, 96, 7), (28, 192, 7), (14, 384, 7), (7, 768, 7),
    (28, 240, 5), (14, 672, 5),
]


def _depthwise_conv_cases(quick: bool) -> list[Case]:
    """Depthwise stride-1 SAME convolutions (feature_group_count = C, m = 1), NHWC / HWIO, bf16, on the
    layers of _DEPTHWISE_CONVS, N = 64 (2 with --quick), against lax.conv_general_dilated with
    feature_group_count=C: fwd, and fwd+bwd (the gradients w.r.t. the input and the filter, passes
    separated as in a network).

    Memory-bound, so GB/s of compulsory traffic: fwd = read x + read w + write y; fwd+bwd = the forward
    + read dy, x and w + write dx and dw (x, y, dy and dx have one size here). Re-reads between the
    backward's dgrad and wgrad are not counted.
    """
    dtype = jnp.bfloat16
    sets = 2 if quick else 8
    batch = 2 if quick else 64
    key = jax.random.key(3)
    cases = []
    for size, channels, window in _DEPTHWISE_CONVS:
        x_shape, w_shape = (batch, size, size, channels), (window, window, 1, channels)
        primal_sets, dys = [], []
        for _ in range(sets):
            key, kx, kw, kdy = jax.random.split(key, 4)
            primal_sets.append((_normal(kx, x_shape, dtype), _normal(kw, w_shape, dtype, std=0.3)))
            dys.append(_normal(kdy, x_shape, dtype))
        conv = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                    feature_group_count=channels)
        fn = functools.partial(jaxdnn.conv_general_dilated, **conv)
        peer_fn = functools.partial(jax.lax.conv_general_dilated, **conv)
        x_bytes = math.prod(x_shape) * jnp.dtype(dtype).itemsize
        w_bytes = math.prod(w_shape) * jnp.dtype(dtype).itemsize
        fwd_bytes = 2 * x_bytes + w_bytes
        name = f"depthwise N{batch} H{size} W{size} C{channels} {window}x{window}/1"
        cases.append(Case("conv", f"{name} fwd", fn, "xla", peer_fn, primal_sets, fwd_bytes, "GB/s"))
        cases.append(Case("conv", f"{name} fwd+bwd", _fwd_bwd(fn), "xla", _fwd_bwd(peer_fn),
                          [(x, w, dy) for (x, w), dy in zip(primal_sets, dys)],
                          fwd_bytes + 3 * x_bytes + 2 * w_bytes, "GB/s"))
    return cases


def _transpose_conv_cases(quick: bool) -> list[Case]:
    """conv_transpose (NHWC / HWIO) against lax.conv_transpose (cuDNN's dgrad through XLA), bf16 and
    float32 at JAX's default precision, fwd and fwd+bwd: a U-Net decoder's 2x2/2 upsampling (N 32,
    56^2 -> 112^2, 128 -> 64 channels) and DCGAN's 4x4/2 (N 64, 32^2 -> 64^2, 256 -> 128).

    FLOPs: every input pixel meets every tap: fwd = 2 * N * H * W * C * K * R * S (H, W the input's),
    fwd+bwd = 3 x fwd.
    """
    cases = []
    key = jax.random.key(4)
    for label, batch, size, channels, filters, window in (("U-Net 2x2/2", 32, 56, 128, 64, 2),
                                                          ("DCGAN 4x4/2", 64, 32, 256, 128, 4)):
        batch = 2 if quick else batch
        for dtype in (jnp.bfloat16, jnp.float32):
            primal_sets, dys = [], []
            for _ in range(2 if quick else 4):
                key, kx, kw, kdy = jax.random.split(key, 4)
                primal_sets.append((_normal(kx, (batch, size, size, channels), dtype),
                                    _normal(kw, (window, window, channels, filters), dtype, std=0.1)))
                dys.append(_normal(kdy, (batch, 2 * size, 2 * size, filters), dtype))
            conv = dict(strides=(2, 2), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            fn = functools.partial(jaxdnn.conv_transpose, **conv)
            peer_fn = functools.partial(jax.lax.conv_transpose, **conv)
            flops = 2 * batch * size * size * channels * filters * window * window
            name = (f"conv_transpose {label} N{batch} H{size} W{size} C{channels} K{filters}"
                    + (" float32" if dtype == jnp.float32 else ""))
            cases.append(Case("conv", f"{name} fwd", fn, "xla", peer_fn, primal_sets, flops, "TFLOP/s"))
            cases.append(Case("conv", f"{name} fwd+bwd", _fwd_bwd(fn), "xla", _fwd_bwd(peer_fn),
                              [(x, w, dy) for (x, w), dy in zip(primal_sets, dys)], 3 * flops, "TFLOP/s"))
    return cases


def _general_conv_cases(label, x_shape, w_shape, kwargs, dtype, quick, key, sets=4):
    """fwd and fwd+bwd cases of conv_general_dilated against lax's for one channels-last problem
    (kwargs without dimension_numbers), in TFLOP/s of the products the convolution needs: fwd =
    2 * N * (output pixels) * K * (C / groups) * (window taps), fwd+bwd = 3 x fwd."""
    spatial = len(x_shape) - 2
    letters = "DHW"[3 - spatial:]
    conv = dict(kwargs, dimension_numbers=(f"N{letters}C", f"{letters}IO", f"N{letters}C"))
    fn = functools.partial(jaxdnn.conv_general_dilated, **conv)
    peer_fn = functools.partial(jax.lax.conv_general_dilated, **conv)
    primal_sets, dys = [], []
    for _ in range(2 if quick else sets):
        key, kx, kw, kdy = jax.random.split(key, 4)
        x, w = _normal(kx, x_shape, dtype), _normal(kw, w_shape, dtype, std=0.1)
        primal_sets.append((x, w))
        dys.append(_normal(kdy, jax.eval_shape(fn, x, w).shape, dtype))
    y_shape = dys[0].shape
    flops = 2 * math.prod(y_shape) * math.prod(w_shape[:-1])
    size = "x".join(str(n) for n in x_shape[1:-1])
    window = "x".join(str(n) for n in w_shape[:-2])
    stride = max(kwargs["window_strides"])
    name = (f"{label} N{x_shape[0]} {size} C{x_shape[-1]} K{w_shape[-1]} {window}/{stride}"
            + (f" G{kwargs['feature_group_count']}" if kwargs.get("feature_group_count", 1) > 1 else "")
            + (" float32" if dtype == jnp.float32 else ""))
    return [Case("conv", f"{name} fwd", fn, "xla", peer_fn, primal_sets, flops, "TFLOP/s"),
            Case("conv", f"{name} fwd+bwd", _fwd_bwd(fn), "xla", _fwd_bwd(peer_fn),
                 [(x, w, dy) for (x, w), dy in zip(primal_sets, dys)], 3 * flops, "TFLOP/s")]


# Grouped convolutions (label, batch, H = W, C, K, groups, window, stride): ResNeXt-50 32x4d's 3x3
# layers (stages 1, 2's strided first block, 3 and 4), ResNeXt-101 32x8d's stage-2 layer (16 channels
# a group at 28^2) and a RegNet-like layer of 64-channel groups.
_GROUPED_CONVS = [
    ("ResNeXt-50 grouped", 128, 56, 128, 128, 32, 3, 1),
    ("ResNeXt-50 grouped", 128, 56, 256, 256, 32, 3, 2),
    ("ResNeXt-50 grouped", 128, 14, 512, 512, 32, 3, 1),
    ("ResNeXt-50 grouped", 128, 7, 1024, 1024, 32, 3, 1),
    ("ResNeXt-101 grouped", 128, 28, 512, 512, 32, 3, 1),
    ("RegNet grouped", 128, 28, 256, 256, 4, 3, 1),
]


def _grouped_conv_cases(quick: bool) -> list[Case]:
    """Grouped 3x3 convolutions (feature_group_count > 1, not depthwise; SAME padding, NHWC / HWIO)
    against lax.conv_general_dilated (cuDNN's grouped kernels through XLA): bf16, and the first in
    float32 at JAX's default precision (TF32 on both sides)."""
    key = jax.random.key(5)
    cases = []
    for i, (label, batch, size, channels, filters, groups, window, stride) in enumerate(_GROUPED_CONVS):
        batch = 2 if quick else batch
        kwargs = dict(window_strides=(stride, stride), padding="SAME", feature_group_count=groups)
        for dtype in (jnp.bfloat16,) + ((jnp.float32,) if i == 0 else ()):
            key, sub = jax.random.split(key)
            x_shape, w_shape = (batch, size, size, channels), (window, window, channels // groups, filters)
            cases += _general_conv_cases(label, x_shape, w_shape, kwargs, dtype, quick, sub)
    return cases


def _vmapped_filter_cases(quick: bool) -> list[Case]:
    """An ensemble: 8 copies of a 3x3 layer's filter, `jax.vmap` over them on one shared input (56^2,
    64 -> 64, N 32, bf16), against the same vmap of lax.conv_general_dilated. Both widen the forward
    and wgrad into one convolution of 8 x 64 filters on the shared input; the backward's per-copy dx
    is a grouped convolution for jaxdnn (its VJP is batched, so the sum over copies comes after) and
    one 512 -> 64 dgrad for XLA (it differentiates the widened convolution). FLOPs as for 8 separate
    layers."""
    copies, batch, size, channels = 8, (2 if quick else 32), 56, 64
    numbers = ("NHWC", "HWIO", "NHWC")
    one = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=numbers)
    fn = jax.vmap(functools.partial(jaxdnn.conv_general_dilated, **one), (None, 0))
    peer_fn = jax.vmap(functools.partial(jax.lax.conv_general_dilated, **one), (None, 0))
    key, primal_sets, dys = jax.random.key(7), [], []
    for _ in range(2 if quick else 4):
        key, kx, kw, kdy = jax.random.split(key, 4)
        primal_sets.append((_normal(kx, (batch, size, size, channels), jnp.bfloat16),
                            _normal(kw, (copies, 3, 3, channels, channels), jnp.bfloat16, std=0.1)))
        dys.append(_normal(kdy, (copies, batch, size, size, channels), jnp.bfloat16))
    flops = 2 * copies * batch * size * size * channels * channels * 9
    name = f"vmap over {copies} filters N{batch} {size}x{size} C{channels} K{channels} 3x3/1"
    return [Case("conv", f"{name} fwd", fn, "xla", peer_fn, primal_sets, flops, "TFLOP/s"),
            Case("conv", f"{name} fwd+bwd", _fwd_bwd(fn), "xla", _fwd_bwd(peer_fn),
                 [(x, w, dy) for (x, w), dy in zip(primal_sets, dys)], 3 * flops, "TFLOP/s")]


# 3-D convolutions (label, batch, D, H = W, C, K, window (T, U, V), stride): video (C3D/I3D-like
# 3x3x3 at 16 frames, with stride 2, and R(2+1)D's temporal 3x1x1) and a 3-D U-Net's 64^3 level.
_CONVS_3D = [
    ("video 3-D", 8, 16, 56, 64, 64, (3, 3, 3), 1),
    ("video 3-D", 8, 16, 56, 64, 128, (3, 3, 3), 2),
    ("video (2+1)-D temporal", 8, 16, 56, 64, 64, (3, 1, 1), 1),
    ("3-D U-Net", 2, 64, 64, 32, 32, (3, 3, 3), 1),
]


def _conv3d_cases(quick: bool) -> list[Case]:
    """3-D convolutions (NDHWC / DHWIO, SAME padding) against lax.conv_general_dilated (cuDNN through
    XLA), bf16 and float32 at JAX's default precision (TF32 on both sides)."""
    key = jax.random.key(6)
    cases = []
    for label, batch, depth, size, channels, filters, window, stride in _CONVS_3D:
        batch = 1 if quick else batch
        kwargs = dict(window_strides=(stride,) * 3, padding="SAME")
        for dtype in (jnp.bfloat16, jnp.float32):
            key, sub = jax.random.split(key)
            cases += _general_conv_cases(label, (batch, depth, size, size, channels),
                                         window + (channels, filters), kwargs, dtype, quick, sub)
    return cases


# Convolutions over long rows (label, batch, batch with --quick, spatial shape, C, K, window, stride):
# an audio encoder's (wav2vec-like) strided 1-D layer and a temporal convolution's 3-tap layer over
# 16000 samples, and VGG-16's second and third 3x3 layers (rows of 224 pixels, 64 -> 64 channels; of
# 112, 64 -> 128).
_CONVS_LONG_ROWS = [
    ("1-D audio", 32, 4, (16000,), 64, 128, (9,), 4),
    ("1-D temporal", 32, 4, (16000,), 64, 64, (3,), 1),
    ("1-D temporal 5-tap", 32, 4, (16000,), 64, 64, (5,), 1),
    ("1-D temporal 7-tap", 32, 4, (16000,), 64, 64, (7,), 1),
    ("VGG-16 conv1_2", 32, 1, (224, 224), 64, 64, (3, 3), 1),
    ("VGG-16 conv2_1", 32, 1, (112, 112), 64, 128, (3, 3), 1),
]


def _long_row_cases(quick: bool) -> list[Case]:
    """Convolutions over long rows (NWC / WIO or NHWC / HWIO, SAME padding) against
    lax.conv_general_dilated, bf16."""
    key = jax.random.key(7)
    cases = []
    for label, batch, quick_batch, spatial, channels, filters, window, stride in _CONVS_LONG_ROWS:
        key, sub = jax.random.split(key)
        kwargs = dict(window_strides=(stride,) * len(spatial), padding="SAME")
        cases += _general_conv_cases(label, (quick_batch if quick else batch,) + spatial + (channels,),
                                     window + (channels, filters), kwargs, jnp.bfloat16, quick, sub)
    return cases


# Convolutions timed a stage at a time (label, batch, spatial shape, C, K, window): ResNet-50's 56^2
# 64 -> 64 layer (all three stages on the halo kernels) and its 14^2 256 -> 256 one (its lowest
# fwd+bwd against cuDNN, 0.90-0.91x), VGG-16's conv2_1 (112^2, 64 -> 128: the forward on the im2col
# kernels, the dgrad on CUTLASS's, dx's 64 channels being fewer than an im2col tile's 128, the wgrad
# on the halo one), and 1-D 3-tap layers of 64 and 128 channels (the latter 0.80x cuDNN fwd+bwd in a
# one-off probe).
_STAGE_CONVS = [
    ("3x3", 128, (56, 56), 64, 64, (3, 3)),
    ("3x3", 128, (14, 14), 256, 256, (3, 3)),
    ("VGG-16 conv2_1", 32, (112, 112), 64, 128, (3, 3)),
    ("1-D temporal", 32, (16000,), 64, 64, (3,)),
    ("1-D temporal", 32, (16000,), 128, 128, (3,)),
]


def conv_stage_cases(quick: bool) -> list[Case]:
    """The forward, x's gradient alone (dgrad) and w's (wgrad) of a few convolutions (bf16, SAME,
    unit strides, channels last; N 1 with --quick) against lax's, each a case: where a layer's
    fwd+bwd gap lies. FLOPs: each stage 2 * N * (output pixels) * K * C * (window taps)."""
    key = jax.random.key(8)
    cases = []
    for label, batch, spatial, channels, filters, window in _STAGE_CONVS:
        batch = 1 if quick else batch
        letters = "DHW"[3 - len(spatial):]
        conv = dict(window_strides=(1,) * len(spatial), padding="SAME",
                    dimension_numbers=(f"N{letters}C", f"{letters}IO", f"N{letters}C"))
        sets = []
        for _ in range(2 if quick else 3):
            key, kx, kw, kdy = jax.random.split(key, 4)
            sets.append((_normal(kx, (batch,) + spatial + (channels,), jnp.bfloat16),
                         _normal(kw, window + (channels, filters), jnp.bfloat16, std=0.1),
                         _normal(kdy, (batch,) + spatial + (filters,), jnp.bfloat16)))
        flops = 2 * batch * math.prod(spatial) * filters * channels * math.prod(window)
        size, taps = "x".join(map(str, spatial)), "x".join(map(str, window))
        name = f"{label} N{batch} {size} C{channels} K{filters} {taps}"
        for stage, (fn, peer_fn) in _conv_stages(conv).items():
            cases.append(Case("conv_stages", f"{name} {stage}", fn, "xla", peer_fn, sets, flops, "TFLOP/s"))
    return cases


def _conv_stages(conv):
    """{stage: (jaxdnn's, lax's)}, each a function of (x, w, dy)."""
    def stages(op):
        return {"fwd": lambda x, w, dy: op(x, w, **conv),
                "dgrad": lambda x, w, dy: jax.vjp(lambda x: op(x, w, **conv), x)[1](dy)[0],
                "wgrad": lambda x, w, dy: jax.vjp(lambda w: op(x, w, **conv), w)[1](dy)[0]}
    ours, peers = stages(jaxdnn.conv_general_dilated), stages(jax.lax.conv_general_dilated)
    return {stage: (ours[stage], peers[stage]) for stage in ours}


# --- dense -------------------------------------------------------------------------------------------

def dense_cases(quick: bool) -> list[Case]:
    """jaxdnn.dense on an M = N = K = 8192 product (256 with --quick), x [M, K] @ w [K, N]: the plain
    product against XLA's `x @ w` (cuBLAS on a GPU); with bias and gelu (tanh) fused into the epilogue
    against XLA's `jax.nn.gelu(x @ w + b)` (which XLA fuses into its GEMM's epilogue where it can); and
    the fwd+bwd of the latter (gradients w.r.t. x, w and b, random cotangent, passes separated). In
    bf16, and in float32 at JAX's default precision (both sides multiply TF32-rounded operands on
    tensor cores; the case names say "float32").

    FLOPs: fwd = 2 * M * N * K (the epilogue's elementwise work is not counted), fwd+bwd = 3 x fwd.
    """
    n = 256 if quick else 8192
    key = jax.random.key(2)

    def fused(x, w, b):
        return jaxdnn.dense(x, w, b, activation="gelu")

    def fused_xla(x, w, b):
        return jax.nn.gelu(x @ w + b)

    flops = 2 * n**3
    cases = []
    for dtype, sets in ((jnp.bfloat16, 8), (jnp.float32, 4)):
        primal_sets, dys = [], []
        for _ in range(2 if quick else sets):
            key, kx, kw, kb, kdy = jax.random.split(key, 5)
            # w scaled by 1 / sqrt(K): x @ w ~ N(0, 1), gelu's interesting region
            primal_sets.append((_normal(kx, (n, n), dtype), _normal(kw, (n, n), dtype, std=n**-0.5),
                                _normal(kb, (n,), dtype)))
            dys.append(_normal(kdy, (n, n), dtype))
        name = f"M{n} N{n} K{n}" + (" float32" if dtype == jnp.float32 else "")
        cases += [
            Case("dense", f"dense {name} fwd", jaxdnn.dense, "xla", jnp.matmul,
                 [(x, w) for x, w, _ in primal_sets], flops, "TFLOP/s"),
            Case("dense", f"dense+bias+gelu {name} fwd", fused, "xla", fused_xla, primal_sets, flops,
                 "TFLOP/s"),
            Case("dense", f"dense+bias+gelu {name} fwd+bwd", _fwd_bwd(fused), "xla", _fwd_bwd(fused_xla),
                 [(*primals, dy) for primals, dy in zip(primal_sets, dys)], 3 * flops, "TFLOP/s"),
        ]
    return cases


# --- attention ---------------------------------------------------------------------------------------


def _attention_peers() -> dict[str, Callable]:
    """jax.nn.dot_product_attention's implementations to compare with: cuDNN (GPU only) and XLA."""
    peers = {"xla": functools.partial(jax.nn.dot_product_attention, implementation="xla")}
    if jax.default_backend() == "gpu":
        peers = {"cudnn": functools.partial(jax.nn.dot_product_attention, implementation="cudnn"), **peers}
    return peers


def attention_cases(quick: bool) -> list[Case]:
    """dot_product_attention against jax.nn.dot_product_attention with implementation "cudnn" (on a
    GPU) and "xla", bf16, fwd and fwd+bwd (a random cotangent; the primal output is returned too).

    Shapes (issue 5): B*S = 32768 tokens and N*H = 2048 with S in {1024, 4096, 16384} and H in
    {64, 128, 256}, causal and not (T = S); GQA N=32 K=8 H=128 S=4096; decode T=1 S=32768 B=8.
    FLOPs (ARCHITECTURE.md): fwd = 4 B N T S H, halved when causal; fwd+bwd = fwd + 2.5 fwd.
    """
    dtype = jnp.bfloat16
    sets = 2  # each input is >= 128 MiB at full size: no set can be served from the L2 of the one before
    if quick:
        shapes = [(2, 128, 128, 4, 4, 64, False), (2, 128, 128, 4, 4, 64, True), (1, 64, 64, 8, 2, 32, True),
                  (2, 1, 256, 4, 4, 64, False)]
    else:
        shapes = [(32768 // s, s, s, 2048 // h, 2048 // h, h, causal)
                  for s in (1024, 4096, 16384) for h in (64, 128, 256) for causal in (False, True)]
        shapes += [(8, 4096, 4096, 32, 8, 128, causal) for causal in (False, True)]  # GQA
        shapes += [(8, 1, 32768, 16, 16, 128, False)]  # decode
    cases = []
    key = jax.random.key(2)
    for b, t, s, n, kv_heads, h, causal in shapes:
        arg_sets = []
        for _ in range(sets):
            key, kq, kk, kv, kdy = jax.random.split(key, 5)
            arg_sets.append((_normal(kq, (b, t, n, h), dtype), _normal(kk, (b, s, kv_heads, h), dtype),
                             _normal(kv, (b, s, kv_heads, h), dtype), _normal(kdy, (b, t, n, h), dtype)))
        fwd_flops = 4 * b * n * t * s * h * (0.5 if causal else 1.0)
        heads = f"N{n}" if kv_heads == n else f"N{n} K{kv_heads}"
        name = f"attention B{b} T{t} S{s} {heads} H{h}{' causal' if causal else ''}"
        fn = functools.partial(jaxdnn.dot_product_attention, is_causal=causal)
        # One jaxdnn callable per pass, shared by the cases of both peers: timed once (see main).
        fwd, fwd_bwd = (lambda q, k, v, dy, f=fn: f(q, k, v)), _fwd_bwd(fn)
        for peer, peer_attention in _attention_peers().items():
            peer_fn = functools.partial(peer_attention, is_causal=causal)
            cases.append(Case("attention", f"{name} fwd", fwd, peer,
                              lambda q, k, v, dy, f=peer_fn: f(q, k, v), arg_sets, fwd_flops, "TFLOP/s"))
            cases.append(Case("attention", f"{name} fwd+bwd", fwd_bwd, peer, _fwd_bwd(peer_fn), arg_sets,
                              3.5 * fwd_flops, "TFLOP/s"))
    return cases


def attention_memory(quick: bool) -> list[dict[str, Any]]:
    """Device memory of a jitted attention fwd+bwd (bf16, B=1, N=16, H=128, T = S, causal): first
    jaxdnn's is run at the largest S and the device's peak bytes in use reported (before anything
    else of this family allocates: XLA's compiler itself reserves memory for its largest programs);
    then XLA's compiled memory analysis (arguments + outputs + temporaries, no run needed) of jaxdnn
    and jax.nn's "xla" (and "cudnn" on a GPU) for S from 4096 to 32768."""
    lengths = [256, 512] if quick else [4096, 8192, 16384, 32768]
    impls = {"jaxdnn": jaxdnn.dot_product_attention, **_attention_peers()}
    s = lengths[-1]
    key = jax.random.key(3)
    args = [_normal(k, (1, s, 16, 128), jnp.bfloat16) for k in jax.random.split(key, 4)]
    step = jax.jit(_fwd_bwd(functools.partial(jaxdnn.dot_product_attention, is_causal=True)))
    jax.block_until_ready(step(*args))
    del args
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    records = [dict(family="attention_memory", case=f"B1 T{s} S{s} N16 H128 causal fwd+bwd run",
                    impl="jaxdnn", peak_bytes_in_use=peak)]
    print(f"jaxdnn fwd+bwd at S{s} ran; peak bytes in use {peak}", flush=True)
    for s in lengths:
        shape = jax.ShapeDtypeStruct((1, s, 16, 128), jnp.bfloat16)
        for impl, attention in impls.items():
            step = jax.jit(_fwd_bwd(functools.partial(attention, is_causal=True)))
            try:
                stats = step.lower(shape, shape, shape, shape).compile().memory_analysis()
                total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                         + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
            except Exception as error:  # XLA refuses programs that cannot fit
                print(f"{impl} S{s}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                total = None
            records.append(dict(family="attention_memory", case=f"B1 T{s} S{s} N16 H128 causal fwd+bwd",
                                impl=impl, compiled_bytes=total))
            print(f"memory {impl} S{s}: {'-' if total is None else f'{total / 2**30:.2f} GiB'}", flush=True)
    return records


def rnn_cases(quick: bool) -> list[Case]:
    """jaxdnn.lstm and jaxdnn.gru against a lax.scan LSTM/GRU (`jaxdnn.reference.lstm`/`gru`: the same
    math and seq_lengths handling, XLA) in bf16 and fp32, and the LSTM against cuDNN through
    `jax.experimental.rnn.lstm` (GPU only; it takes fp32 alone): fwd, and fwd+bwd (passes separated,
    w.r.t. x, the initial states and the weights).

    Shapes (T, B, I, H) of issue 6: (512, 16, 512, 512), (256, 64, 1024, 1024), the (100, 1, 256, 256)
    latency case, and a 2-layer bidirectional (256, 32, 512, 512); and a small batch (100, 8, 256, 256)
    (the tensor-core cluster kernels' size); every sequence full length; weights
    uniform in +-1/sqrt(H) as `init_lstm_weight`. FLOPs: fwd = 2 B T G (I_l + H) summed over layers and
    directions (G = 4H for the LSTM, 3H for the GRU; I_l = I, then D H); fwd+bwd = 3x.
    """
    from jax.experimental import rnn as jax_rnn

    shapes = [(16, 2, 8, 8, 1, False)] if quick else [
        (512, 16, 512, 512, 1, False), (256, 64, 1024, 1024, 1, False), (100, 1, 256, 256, 1, False),
        (256, 32, 512, 512, 2, True), (100, 8, 256, 256, 1, False)]
    sets = 2 if quick else 8
    on_gpu = jax.default_backend() == "gpu"
    cases = []
    for mode, gates, state_count in (("lstm", 4, 2), ("gru", 3, 1)):
        for steps, batch, inputs, hidden, layers, bidirectional in shapes:
            directions = 2 if bidirectional else 1
            sizes = (inputs, hidden, layers, 0.0, bidirectional)
            widths = [inputs] * directions + [directions * hidden] * (layers - 1) * directions
            flops = sum(2 * batch * steps * gates * hidden * (width + hidden) for width in widths)
            lengths = jnp.full((batch,), steps, jnp.int32)
            name = (f"{mode} T{steps} B{batch} I{inputs} H{hidden}" + (f" L{layers}" if layers > 1 else "")
                    + (" bidirectional" if bidirectional else ""))

            def call(fn, sizes=sizes, lengths=lengths):
                """(x, *states, weights) -> y of fn (jaxdnn's, the reference or jax's)."""
                return lambda x, *rest: fn(x, *rest, lengths, *sizes)[0]

            ours, scan = call(getattr(jaxdnn, mode)), call(getattr(jaxdnn.reference, mode))
            count = jaxdnn.reference.rnn.weight_count(mode, inputs, hidden, layers, bidirectional)
            for dtype in (jnp.bfloat16, jnp.float32):
                key = jax.random.key(steps * batch + hidden)
                primal_sets, dys = [], []
                for _ in range(sets):
                    key, kx, ks, kw, kdy = jax.random.split(key, 5)
                    states = [_normal(k, (layers * directions, batch, hidden), jnp.float32)
                              for k in jax.random.split(ks, state_count)]
                    bound = 1 / math.sqrt(hidden)
                    weights = jax.random.uniform(kw, (count,), jnp.float32, -bound, bound).astype(dtype)
                    primal_sets.append((_normal(kx, (batch, steps, inputs), dtype), *states, weights))
                    dys.append(_normal(kdy, (batch, steps, directions * hidden), dtype))
                fwd_bwd_sets = [(*p, dy) for p, dy in zip(primal_sets, dys)]
                label = f"{name} {jnp.dtype(dtype).name}"
                peers = [("xla", scan)]
                if mode == "lstm" and on_gpu and dtype == jnp.float32:
                    peers.append(("cudnn", call(jax_rnn.lstm)))
                for peer, peer_fn in peers:
                    cases.append(Case("rnn", f"{label} fwd vs {peer}", ours, peer, peer_fn, primal_sets,
                                      flops, "TFLOP/s"))
                    cases.append(Case("rnn", f"{label} fwd+bwd vs {peer}", _fwd_bwd(ours), peer,
                                      _fwd_bwd(peer_fn), fwd_bwd_sets, 3 * flops, "TFLOP/s"))
    return cases


FAMILIES: dict[str, Callable[[bool], list[Case]]] = {
    "norm": norm_cases,
    "softmax": softmax_cases,
    "activation": activation_cases,
    "batch_norm": batch_norm_cases,
    "pool": pool_cases,
    "group_norm": group_norm_cases,
    "conv": conv_cases,
    "conv_stages": conv_stage_cases,
    "dense": dense_cases,
    "attention": attention_cases,
    "rnn": rnn_cases,
}
# Families measured other than by time, each a function (quick) -> records of its own fields.
OTHER_FAMILIES: dict[str, Callable[[bool], list[dict[str, Any]]]] = {
    "attention_memory": attention_memory,
}


# ----------------------------------------------------------------------------------------------------
# Ceilings


def measure_ceilings(quick: bool, repeats: int) -> dict[str, tuple[str, float, float]]:
    """{metric: (case, ms, value)}: copy bandwidth (GB/s, read + write) and bf16 matmul (TFLOP/s)."""
    kx, ka, kb = jax.random.split(jax.random.key(1), 3)
    copy_mib = 16 if quick else 1024
    x = _normal(kx, (copy_mib * 2**19,), jnp.bfloat16)  # 2 bytes per element
    copy_ms = time_fn(jnp.negative, [(x,)], repeats=repeats)
    copy_name = "copy 1GiB" if copy_mib == 1024 else f"copy {copy_mib}MiB"
    del x
    n = 512 if quick else 8192
    a = _normal(ka, (n, n), jnp.bfloat16)
    b = _normal(kb, (n, n), jnp.bfloat16)
    matmul_ms = time_fn(jnp.matmul, [(a, b)], repeats=repeats)
    return {
        "GB/s": (copy_name, copy_ms, 2 * copy_mib * 2**20 / copy_ms / 1e6),
        "TFLOP/s": (f"matmul {n}^3", matmul_ms, 2 * n**3 / matmul_ms / 1e9),
    }


# ----------------------------------------------------------------------------------------------------
# Driver


def device_name() -> str:
    """'h100', 'h200', 'a100', ... from the device kind; 'cpu' on CPU."""
    kind = jax.devices()[0].device_kind.lower()
    model = re.search(r"\b(gb\d{3}|[a-z]\d{2,3}[a-z]?)\b", kind.replace("nvidia", ""))
    return model.group(1) if model else re.sub(r"[^a-z0-9]+", "-", kind).strip("-")


def uses_jaxdnn(fn: Callable, args: tuple) -> bool:
    """Whether the lowered program calls a jaxdnn kernel (guards against timing a silent fallback)."""
    return "jaxdnn" in jax.jit(fn).lower(*args).as_text()


def print_table(records: list[dict[str, Any]]) -> None:
    def fmt(value, width, digits):
        return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"

    width = max(len(r["case"]) for r in records)
    print(
        f"\n{'case':<{width}}  {'jaxdnn ms':>9}  {'peer ms':>9}  {'speedup':>7}  {'value':>15}  "
        f"{'% ceiling':>9}"
    )
    for r in records:
        print(
            f"{r['case']:<{width}}  {fmt(r['jaxdnn_ms'], 9, 4)}  {fmt(r['peer_ms'], 9, 4)}  "
            f"{fmt(r['speedup'], 7, 2)}  {r['value']:7.1f} {r['metric']:<7}  "
            f"{fmt(100 * r['ceiling_fraction'], 8, 1)}%"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, nargs="+", choices=[*FAMILIES, *OTHER_FAMILIES, "all"],
                        help="one or more families, or all")
    parser.add_argument("--out", required=True, help="results folder")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed repeats (default 20, --quick 3)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small shapes, few repeats: a CPU smoke test"
    )
    parser.add_argument(
        "--case", default=None, help="only the cases whose name matches this regular expression"
    )
    parser.add_argument(
        "--autotune", action="store_true",
        help="time jaxdnn's candidate kernels first (jaxdnn.config.autotune), caching the choices in "
             "<out>/autotune.json; results go to <device>-<date>-autotune.json"
    )
    parser.add_argument(
        "--nondeterministic", action="store_true",
        help="run with jaxdnn.config.deterministic off (attention's backward adds dq unordered, as "
             "cuDNN's default does); results go to <device>-<date>-nondeterministic.json"
    )
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 20)
    jaxdnn.config.deterministic = not args.nondeterministic
    if args.autotune:
        jaxdnn.config.autotune = True
        jaxdnn.config.autotune_cache = os.path.join(args.out, "autotune.json")

    device, date = device_name(), datetime.date.today().isoformat()
    common = {"jax": jax.__version__, "device": device, "date": date, "autotune": args.autotune,
              "deterministic": not args.nondeterministic}
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind!r}; "
        f"jaxdnn CUDA kernels: {jaxdnn.has_cuda_kernels()}",
        flush=True,
    )

    ceilings = measure_ceilings(args.quick, repeats)
    records = [
        dict(
            family="ceiling",
            case=case,
            dtype="bfloat16",
            jaxdnn_ms=None,
            peer=None,
            peer_ms=None,
            speedup=None,
            metric=metric,
            value=value,
            ceiling_fraction=1.0,
            **common,
        )
        for metric, (case, ms, value) in ceilings.items()
    ]
    for r in records:
        print(f"{r['case']}: {r['value']:.1f} {r['metric']}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    suffix = (("-autotune" if args.autotune else "") + ("-nondeterministic" if args.nondeterministic else "")
              + ("-quick" if args.quick else ""))
    path = os.path.join(args.out, f"{device}-{date}{suffix}.json")
    failures = 0
    other_records = []

    def write():
        """The records so far, rewritten whole after every case, so that a run cut short (a device
        call's time limit) leaves the cases it finished; renamed into place, never half written."""
        with open(path + ".tmp", "w") as f:
            json.dump(records + other_records, f, indent=1)
            f.write("\n")
        os.replace(path + ".tmp", path)

    for family in [*FAMILIES, *OTHER_FAMILIES] if "all" in args.family else dict.fromkeys(args.family):
        if family in OTHER_FAMILIES:
            other_records += [dict(record, **common) for record in OTHER_FAMILIES[family](args.quick)]
            write()
            continue
        # (fn, arg_sets) -> ms: cases against several peers time jaxdnn's call once. Per family: the
        # ids are those of the family's cases, alive until its loop ends.
        jaxdnn_ms = {}
        for case in FAMILIES[family](args.quick):
            if args.case and not re.search(args.case, case.name):
                continue
            try:
                timed = (id(case.fn), id(case.arg_sets))
                if timed not in jaxdnn_ms:
                    if not uses_jaxdnn(case.fn, case.arg_sets[0]):
                        print(
                            f"WARNING: {case.name}: no jaxdnn custom call in the lowered program",
                            file=sys.stderr,
                        )
                    jaxdnn_ms[timed] = time_fn(case.fn, case.arg_sets, repeats=repeats)
                ms = jaxdnn_ms[timed]
            except Exception:  # keep going: one broken case must not cost the rest of a GPU run
                traceback.print_exc()
                print(f"FAILED: {case.name}", file=sys.stderr, flush=True)
                failures += 1
                continue
            try:
                peer_ms = time_fn(case.peer_fn, case.peer_arg_sets or case.arg_sets, repeats=repeats)
            except Exception as error:  # a peer that cannot run the case (e.g. out of memory)
                print(f"{case.name}: peer {case.peer} failed: {type(error).__name__}: {str(error)[:200]}",
                      file=sys.stderr, flush=True)
                peer_ms = None
            scale = 1e6 if case.metric == "GB/s" else 1e9  # work per ms -> GB/s or TFLOP/s
            value = case.work / ms / scale
            records.append(
                dict(
                    family=case.family,
                    case=case.name,
                    dtype=str(case.arg_sets[0][0].dtype),
                    jaxdnn_ms=ms,
                    peer=case.peer,
                    peer_ms=peer_ms,
                    speedup=None if peer_ms is None else peer_ms / ms,
                    metric=case.metric,
                    value=value,
                    ceiling_fraction=value / ceilings[case.metric][2],
                    **common,
                )
            )
            peer_text = "-" if peer_ms is None else f"{peer_ms:.4f}"
            print(f"{case.name}: {ms:.4f} ms (peer {peer_text} ms)", flush=True)
            write()

    write()
    print_table(records)
    print(f"\nwrote {path}" + (f"; {failures} case(s) FAILED" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
