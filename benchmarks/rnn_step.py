"""Times one recurrent layer's jitted fwd+bwd (benchmarks/run.py's rnn case: vjp, an optimization
barrier, the vjp applied to dy; full-length sequences), for profilers and quick A/B probes.

    python benchmarks/rnn_step.py lstm 512 16 512 512 [--layers 2] [--bidirectional] [--dtype float32]
        [--calls 30] [--trace] [--switch NAME=A,B [--rounds 2]]

Prints the wall-clock median of `calls` calls after a warm-up call; with --trace, also the GPU
time of each kernel a call (over `calls` more calls under `jax.profiler.trace`, whose GPU events
come from CUPTI): where a call's time goes outside the recurrences. --switch times the layer under
each value of an environment variable that the kernels' launches read (a probe build's run-time
switch), in turn for `rounds` rounds in one process, and prints each value's largest difference of
the results from the first value's. Under Nsight Compute, pass
--calls 1 and, with XLA_PYTHON_CLIENT_PREALLOCATE=false, select the kernels by name, e.g.
`ncu --kernel-name regex:Persistent --launch-count 2 python benchmarks/rnn_step.py ... --calls 1`.
"""
import argparse
import collections
import glob
import gzip
import json
import math
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxdnn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (also under python -P)
import run  # noqa: E402  benchmarks/run.py: its rnn case's program


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("lstm", "gru"))
    parser.add_argument("sizes", type=int, nargs=4, metavar=("T", "B", "I", "H"))
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--bidirectional", action="store_true")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--trace", action="store_true", help="print each kernel's GPU time a call")
    parser.add_argument("--switch", default=None, metavar="NAME=A,B", help="A/B an environment variable")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    (steps, batch, inputs, hidden), layers, bidirectional = args.sizes, args.layers, args.bidirectional
    dtype, directions = jnp.dtype(args.dtype), 2 if args.bidirectional else 1
    count = jaxdnn.reference.rnn.weight_count(args.mode, inputs, hidden, layers, bidirectional)
    keys = jax.random.split(jax.random.key(0), 4)
    state_count = 2 if args.mode == "lstm" else 1
    x = jax.random.normal(keys[0], (batch, steps, inputs), dtype)
    states = [jax.random.normal(k, (layers * directions, batch, hidden), jnp.float32)
              for k in jax.random.split(keys[1], state_count)]
    bound = 1 / math.sqrt(hidden)
    weights = jax.random.uniform(keys[2], (count,), jnp.float32, -bound, bound).astype(dtype)
    dy = jax.random.normal(keys[3], (batch, steps, directions * hidden), dtype)
    lengths = jnp.full((batch,), steps, jnp.int32)
    layer = getattr(jaxdnn, args.mode)

    step = lambda x, *rest: layer(x, *rest, lengths, inputs, hidden, layers, 0.0, bidirectional)[0]
    fwd_bwd = jax.jit(run._fwd_bwd(step))  # the rnn case's program: (x, *states, weights, dy) -> (y, grads)

    def median_ms():
        jax.block_until_ready(fwd_bwd(x, *states, weights, dy))
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            jax.block_until_ready(fwd_bwd(x, *states, weights, dy))
            times.append(time.perf_counter() - start)
        return 1e3 * sorted(times)[len(times) // 2]

    name = f"{args.mode} T{steps} B{batch} I{inputs} H{hidden} L{layers}"
    name += " bidirectional" if bidirectional else ""
    if args.switch is None:
        print(f"{name} {dtype.name} fwd+bwd: median {median_ms():.3f} ms of {args.calls} calls")
    else:
        variable, values = args.switch.split("=", 1)
        first = None
        for _ in range(args.rounds):
            for value in values.split(","):
                os.environ[variable] = value
                outputs = jax.tree.leaves(fwd_bwd(x, *states, weights, dy))
                results = [np.asarray(r, np.float32) for r in outputs]
                first = first or results
                diff = max(float(np.max(np.abs(r - f))) / (float(np.max(np.abs(f))) or 1.0)
                           for r, f in zip(results, first))
                print(f"{name} {dtype.name} fwd+bwd, {variable}={value}: median {median_ms():.3f} ms of "
                      f"{args.calls} calls; results within {diff:.2e} of the first value's (relative to "
                      f"the largest)", flush=True)
    if args.trace:
        with tempfile.TemporaryDirectory() as folder:
            with jax.profiler.trace(folder):
                for _ in range(args.calls):
                    jax.block_until_ready(fwd_bwd(x, *states, weights, dy))
            print_kernel_times(folder, args.calls)


def print_kernel_times(folder, calls):
    """Each GPU kernel's time a call (µs), longest first, from the trace `jax.profiler.trace` wrote
    under `folder`: the complete events on the streams ("Stream #...") of the processes named
    /device:GPU:* (the trace's other GPU lines, XLA's modules and ops, span the same kernels)."""
    (path,) = glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.trace.json.gz"))
    events = json.load(gzip.open(path))["traceEvents"]
    named = [e for e in events if e.get("ph") == "M"]
    gpus = {e["pid"] for e in named if e["name"] == "process_name" and "/device:GPU" in e["args"]["name"]}
    streams = {(e["pid"], e["tid"]) for e in named
               if e["name"] == "thread_name" and e["pid"] in gpus and e["args"]["name"].startswith("Stream")}
    kernels = sorted((e for e in events if e.get("ph") == "X" and (e["pid"], e.get("tid")) in streams),
                     key=lambda e: e["ts"])
    total, count = collections.Counter(), collections.Counter()
    for e in kernels:
        total[e["name"]] += e["dur"] / calls
        count[e["name"]] += 1
    if not total:
        lines = sorted({e["args"]["name"] for e in named if e["name"] == "thread_name" and e["pid"] in gpus})
        print(f"no GPU stream events in the trace; its GPU lines: {lines}")
        return
    for kernel, us in total.most_common():
        print(f"{us:10.1f} µs  {count[kernel] / calls:5.1f}x  {kernel[:100]}")
    print(f"{sum(total.values()):10.1f} µs  the kernels' GPU time a call (summed over streams)")
    # Each call launches the same kernels: its span on the GPU, first start to last end, and the
    # idle gaps inside it (the GPU waiting on the host), the longest with the kernels around them.
    if len(kernels) % calls:
        return
    per_call = len(kernels) // calls
    spans, gaps = [], collections.Counter()
    for c in range(calls):
        chunk = kernels[c * per_call:(c + 1) * per_call]
        end = chunk[0]["ts"]
        for before, e in zip([None] + chunk[:-1], chunk):
            if before is not None and e["ts"] > end:
                gaps[(before["name"][:40], e["name"][:40])] += (e["ts"] - end) / calls
            end = max(end, e["ts"] + e["dur"])
        spans.append(end - chunk[0]["ts"])
    print(f"{sorted(spans)[calls // 2]:10.1f} µs  a call's span on the GPU (median), "
          f"{sum(gaps.values()):.1f} µs of it idle; the longest gaps a call:")
    for (before, after), us in gaps.most_common(5):
        print(f"{us:10.1f} µs  between {before} and {after}")
    # The host's side of each call: jit's dispatch (PjitFunction) against the call's GPU span.
    dispatches = sorted((e for e in events if e.get("ph") == "X" and e["name"].startswith("PjitFunction(")),
                        key=lambda e: e["ts"])
    if len(dispatches) == calls:
        first = [kernels[c * per_call]["ts"] - dispatches[c]["ts"] for c in range(calls)]
        hosts = [e["dur"] for e in dispatches]
        print(f"{sorted(first)[calls // 2]:10.1f} µs  from a call's dispatch to its first kernel (median); "
              f"the dispatch took {sorted(hosts)[calls // 2]:.1f} µs")


if __name__ == "__main__":
    main()
