"""jaxdnn's run-time options, read when a program is traced (set them before the first call of a
jitted function: a cached trace keeps the choices it was made with).

`autotune` (env `JAXDNN_AUTOTUNE=1`; off by default): the convolution stages and `dense` on a GPU
time each of their candidate kernels (tile configurations, the halo and im2col kernels where they
apply; the GEMM for 1x1 convolutions) once per (device, problem) while the program is traced, and
run the fastest, as `torch.backends.cudnn.benchmark` does. The choice is kept in memory and in the
JSON file
`autotune_cache` (env `JAXDNN_AUTOTUNE_CACHE`; default `$XDG_CACHE_HOME/jaxdnn/autotune.json`, or
`~/.cache/...`), so later processes reuse it without timing. Off, a heuristic on the problem's shape
chooses. Every candidate is deterministic, and they agree up to float32 summation order, so turning
autotuning on does not change results beyond that.

    import jaxdnn
    jaxdnn.config.autotune = True

`deterministic` (env `JAXDNN_DETERMINISTIC=0` turns it off; on by default): every kernel gives the
same bits on every run. Off, `dot_product_attention`'s backward on a Hopper GPU (16-bit inputs, head
size 65 to 128) adds each key tile's share of dq in whatever order the tiles finish, instead of
waiting its turn: 1.02-1.06x faster fwd+bwd at S 4096 on an H100 (see the README), with dq's
rounding varying between runs, as cuDNN's and FlashAttention's defaults do. Other kernels are
deterministic either way.
"""

from __future__ import annotations

import os


def _default_cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxdnn", "autotune.json")


def _env_flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).lower() not in ("", "0", "false", "no", "off")


autotune: bool = _env_flag("JAXDNN_AUTOTUNE", "0")
autotune_cache: str = os.environ.get("JAXDNN_AUTOTUNE_CACHE") or _default_cache_path()
deterministic: bool = _env_flag("JAXDNN_DETERMINISTIC", "1")
