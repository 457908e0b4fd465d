"""Autotuning (`jaxdnn.config.autotune`): which of a stage's candidate kernels it runs on.

A family with a choice of kernels (the convolution stages, `dense`) binds its primitive with an
`algorithm` attribute from `choose`. With autotuning off, or on a backend whose kernels have no
choice (the CPU), that is 0: the kernel's own heuristic. On, each candidate is timed on random
operands of the problem's shapes while the program is traced (outside the trace, on the default
device), the fastest is kept under a key of the device kind, the primitive, the operands' shapes and
dtypes and the attributes, in memory and in a JSON file (`config.autotune_cache`) that later
processes read instead of timing again. Every candidate computes the same function (a kernel that
cannot take a problem falls back to the heuristic's), so a stale or shared cache costs speed only.
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxdnn import config

# Platforms (jax.default_backend()) whose kernels have candidates to time.
TUNABLE_PLATFORMS = ("gpu",)
# Bumped when the candidates' meaning or their timing changes, so that older cache entries are not read.
_KEY_VERSION = 2
_TRIALS = 5   # timed trials of each candidate; the fastest counts
_CALLS = 8    # calls per run, on as many copies of the first operand
_TRIAL_SECONDS = 4e-3  # a trial's runs are dispatched back to back for at least this long

_lock = threading.Lock()
_entries: dict | None = None  # the cache: key -> {"algorithm": int, "ms": {candidate: ms}}
_entries_path: str | None = None  # the file `_entries` was read from


def choose(prim, operands, attrs: dict, candidates) -> int:
    """The `algorithm` attribute to bind `prim` with on `operands` (arrays or tracers: only shapes and
    dtypes are read) and `attrs` (without `algorithm`): 0 unless autotuning applies and there are at
    least two candidates; then the fastest candidate, from the cache or timed now."""
    candidates = tuple(int(c) for c in candidates)
    if not config.autotune or len(candidates) < 2 or jax.default_backend() not in TUNABLE_PLATFORMS:
        return 0
    device = jax.devices()[0]
    key = problem_key(device.device_kind, prim.name, operands, attrs)
    with _lock:
        entries = _load()
        entry = entries.get(key)
        if entry is not None and entry.get("algorithm") in candidates:
            return int(entry["algorithm"])
        times = time_candidates(prim, operands, attrs, candidates, device)
        if not times:
            return 0
        best = min(times, key=times.get)
        entries[key] = {"algorithm": best, "ms": {str(c): round(t * 1e3, 6) for c, t in times.items()}}
        _save(key, entries[key])
    return best


def problem_key(device_kind: str, name: str, operands, attrs: dict) -> str:
    """The cache key: what the choice depends on, as one readable string."""
    shapes = ",".join(f"{jnp.dtype(o.dtype).name}{list(o.shape)}" for o in operands)
    settings = ",".join(f"{k}={_plain(v)}" for k, v in sorted(attrs.items()) if k != "algorithm")
    return f"v{_KEY_VERSION}|{device_kind}|{name}|{shapes}|{settings}"


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def time_candidates(prim, operands, attrs: dict, candidates, device) -> dict[int, float]:
    """Seconds per call of each candidate that runs, on random operands on `device`. One compiled
    program makes `_CALLS` calls in a chain (see `_chain`); a trial dispatches it back to back for
    about `_TRIAL_SECONDS`, so that the GPU never waits for the host between runs (one run timed
    alone counts its dispatch and the GPU's idle start: an H200 timed a 0.12 ms call as 0.19 ms).
    The candidates take turns, trial by trial, so that a drift of the clocks reaches them all; the
    fastest of each one's `_TRIALS` trials counts."""
    rng = np.random.default_rng(0)
    with jax.ensure_compile_time_eval():  # real arrays, even while a program is being traced
        first, *rest = (jax.device_put(_random(rng, o), device) for o in operands)
        # Distinct first operands, so that XLA can merge no two calls (and none reads the last one's
        # inputs from L2).
        firsts = [first * (1 + i / _CALLS) if jnp.issubdtype(first.dtype, jnp.floating) else first
                  for i in range(_CALLS)]
    programs = {}  # candidate -> (compiled program, runs per trial)
    for candidate in candidates:
        try:
            # Compiled ahead of time and called as an executable: no tracing or dispatch on the path
            # (a jitted call made under ensure_compile_time_eval takes a slow path on every call).
            chain = functools.partial(_chain, prim, attrs, np.int64(candidate))
            run = jax.jit(chain).lower(firsts, rest).compile()
            jax.block_until_ready(run(firsts, rest))  # warms up
            start = time.perf_counter()
            jax.block_until_ready(run(firsts, rest))  # sizes the trials
            runs = max(1, min(100, math.ceil(_TRIAL_SECONDS / (time.perf_counter() - start))))
        except Exception as error:  # noqa: BLE001  (a candidate that fails is not chosen)
            warnings.warn(f"jaxdnn autotuning: {prim.name} candidate {candidate} failed: {error}")
            continue
        programs[candidate] = run, runs
    times = {candidate: math.inf for candidate in programs}
    for _ in range(_TRIALS):
        for candidate, (run, runs) in programs.items():
            start = time.perf_counter()
            for _ in range(runs):
                result = run(firsts, rest)
            jax.block_until_ready(result)
            times[candidate] = min(times[candidate], (time.perf_counter() - start) / (runs * _CALLS))
    return times


def _chain(prim, attrs, algorithm, firsts, rest):
    """The candidate called on each first operand in turn (with the other operands `rest`). Each
    call's operands pass an optimization barrier with the previous result, so that the calls run
    one after the other; one element of each result is returned, so that none is dead code."""
    outs, result = [], None
    for first in firsts:
        operands = (first, *rest)
        if result is not None:
            operands, _ = jax.lax.optimization_barrier((operands, result))
        result = prim.bind(*operands, **attrs, algorithm=algorithm)
        outs.append(jax.tree.leaves(result)[0].ravel()[0])
    return outs


def _random(rng, operand) -> np.ndarray:
    dtype = jnp.dtype(operand.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return rng.standard_normal(operand.shape, dtype=np.float32).astype(dtype)
    return np.zeros(operand.shape, dtype)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            entries = json.load(f)
        if not isinstance(entries, dict):
            raise ValueError("not a JSON object")
        return entries
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        warnings.warn(f"jaxdnn autotuning: ignoring the unreadable cache {path}: {error}")
        return {}


def _load() -> dict:
    """The cache's entries, read from config.autotune_cache when it is first needed (or changed)."""
    global _entries, _entries_path
    if _entries is None or _entries_path != config.autotune_cache:
        _entries, _entries_path = _read(config.autotune_cache), config.autotune_cache
    return _entries


def _save(key: str, entry: dict) -> None:
    """Adds one entry to the cache file: re-read (another process may have added entries), then
    replaced atomically. An unwritable location only warns: the choice still holds in memory."""
    path = config.autotune_cache
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        entries = _read(path)
        entries[key] = entry
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        with os.fdopen(handle, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError as error:
        warnings.warn(f"jaxdnn autotuning: could not write the cache {path}: {error}")


def clear_memory() -> None:
    """Forgets the entries held in memory (the next choice re-reads the file); for tests."""
    global _entries, _entries_path
    with _lock:
        _entries, _entries_path = None, None
