"""Times one recurrent layer's jitted fwd+bwd (benchmarks/run.py's rnn case: vjp, an optimization
barrier, the vjp applied to dy; full-length sequences), for profilers and quick A/B probes.

    python benchmarks/rnn_step.py lstm 512 16 512 512 [--layers 2] [--bidirectional] [--dtype float32]
        [--calls 30]

Prints the wall-clock median of `calls` calls after a warm-up call. Under Nsight Compute, pass
--calls 1 and, with XLA_PYTHON_CLIENT_PREALLOCATE=false, select the kernels by name, e.g.
`ncu --kernel-name regex:Persistent --launch-count 2 python benchmarks/rnn_step.py ... --calls 1`.
"""
import argparse
import math
import time

import jax
import jax.numpy as jnp

import jaxdnn


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("lstm", "gru"))
    parser.add_argument("sizes", type=int, nargs=4, metavar=("T", "B", "I", "H"))
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--bidirectional", action="store_true")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--calls", type=int, default=30)
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

    @jax.jit
    def fwd_bwd(x, states, weights, dy):
        f = lambda x, *rest: layer(x, *rest, lengths, inputs, hidden, layers, 0.0, bidirectional)[0]
        y, vjp = jax.vjp(f, x, *states, weights)
        y, vjp = jax.lax.optimization_barrier((y, vjp))
        return y, vjp(dy)

    jax.block_until_ready(fwd_bwd(x, states, weights, dy))
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        jax.block_until_ready(fwd_bwd(x, states, weights, dy))
        times.append(time.perf_counter() - start)
    times.sort()
    name = f"{args.mode} T{steps} B{batch} I{inputs} H{hidden} L{layers}"
    name += " bidirectional" if bidirectional else ""
    print(f"{name} {dtype.name} fwd+bwd: median {1e3 * times[len(times) // 2]:.3f} ms of {args.calls} calls")


if __name__ == "__main__":
    main()
