"""Batch-sharded inputs on 4 host devices: each device runs the kernel on its own rows (no
all-gather), results match the unsharded float64 reference, and shardings are kept."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import OPS, assert_close, dtype_id, normal, oracle_vjp, tolerance, vjp

op_param = pytest.mark.parametrize("op", OPS, ids=repr)
HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _make_mesh(kind, devices):
    """(mesh, x shape, x spec, per-shard x shape, whether to enter the mesh as a context)."""
    if kind == "mesh_1d":
        return jax.sharding.Mesh(np.array(devices), ("b",)), (8, 6, 64), P("b"), (2, 6, 64), False
    if kind == "mesh_2d":
        mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("b", "m"))
        return mesh, (4, 6, 80), P("b", "m"), (2, 3, 80), False
    axis_type = getattr(getattr(jax.sharding, "AxisType", None), kind.split("_")[0].capitalize(),
                        None)
    if axis_type is None:
        pytest.skip("this jax has no jax.sharding.AxisType")
    try:
        mesh = jax.make_mesh((4,), ("b",), axis_types=(axis_type,), devices=devices)
    except TypeError:
        pytest.skip("this jax.make_mesh takes no axis_types")
    return mesh, (8, 6, 64), P("b"), (2, 6, 64), kind.startswith("explicit")


MESHES = ["mesh_1d", "auto_make_mesh", "explicit_make_mesh", "mesh_2d"]


def _put(mesh, spec, *arrays):
    """The arrays placed on the mesh (every operand of a call must live on the same devices)."""
    return tuple(None if a is None else jax.device_put(a, NamedSharding(mesh, spec))
                 for a in arrays)


def _padded(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(tuple(spec)))


def _custom_call_lines(hlo, target):
    return [line for line in hlo.splitlines() if f'custom_call_target="{target}"' in line]


def _assert_runs_per_shard(hlo, target, operand_shape, dtype):
    assert "all-gather" not in hlo, "sharded operands were gathered"
    lines = _custom_call_lines(hlo, target)
    assert lines, f"no custom call to {target} in the compiled HLO"
    # The first operand of every stage has x's per-shard shape.
    first = f"{HLO_DTYPE[jnp.dtype(dtype).name]}[{','.join(map(str, operand_shape))}]"
    for line in lines:
        constraints = re.search(r"operand_layout_constraints=\{(\S+)", line)
        assert constraints and constraints.group(1).startswith(first + "{"), line


@op_param
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("mesh_kind", MESHES)
def test_batch_sharded(op, dtype, mesh_kind, devices, rng):
    mesh, shape, spec, shard_shape, as_context = _make_mesh(mesh_kind, devices)
    x, cotangent = _put(mesh, spec, normal(rng, shape, dtype, loc=1.0, scale=2.0),
                        normal(rng, shape, dtype))
    scale, bias = _put(mesh, P(), *op.params(rng, shape[-1]))
    args = (x, scale, bias)
    forward = jax.jit(op)
    grads = jax.jit(lambda x, scale, bias, ct: vjp(op, (x, scale, bias), ct))

    with jax.set_mesh(mesh) if as_context else contextlib.nullcontext():
        out = forward(*args)
        got = grads(*args, cotangent)
        fwd_hlo = forward.lower(*args).compile().as_text()
        grad_hlo = grads.lower(*args, cotangent).compile().as_text()

    assert out.shape == shape and out.dtype == dtype
    assert _padded(out.sharding.spec, out.ndim) == _padded(spec, len(shape))
    assert_close(out, op.oracle(*args), tolerance(dtype), f"{op} sharded forward")

    want = oracle_vjp(op, args, cotangent)
    assert _padded(got[0].sharding.spec, len(shape)) == _padded(spec, len(shape))
    for name, g, w in zip(("dx", "dscale", "dbias"), got, want):
        # dscale/dbias are sums over every shard's rows (an all-reduce).
        assert_close(g, w, tolerance(dtype, grad=True), f"{op} sharded {name}")

    _assert_runs_per_shard(fwd_hlo, op.fwd_target, shard_shape, dtype)
    assert op.bwd_target not in fwd_hlo
    _assert_runs_per_shard(grad_hlo, op.fwd_target, shard_shape, dtype)
    _assert_runs_per_shard(grad_hlo, op.bwd_target, shard_shape, dtype)


# Shardings the kernel cannot run under directly (features split, parameters split): the operands
# are resharded, and results must still be right.
@op_param
@pytest.mark.parametrize("x_spec,param_spec", [
    (P(None, None, "b"), P()),
    (P("b"), P("b")),
    (P(None, "b"), P("b")),
], ids=str)
def test_other_shardings_stay_correct(op, x_spec, param_spec, devices, rng):
    mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    x, cotangent = _put(mesh, x_spec, normal(rng, (4, 8, 32), loc=-1.0, scale=3.0),
                        normal(rng, (4, 8, 32)))
    scale, bias = _put(mesh, param_spec, *op.params(rng, 32))
    args = (x, scale, bias)
    assert_close(jax.jit(op)(*args), op.oracle(*args), tolerance(jnp.float32), f"{op} forward")
    got = jax.jit(lambda *a: vjp(op, a[:3], a[3]))(*args, cotangent)
    for name, g, w in zip(("dx", "dscale", "dbias"), got, oracle_vjp(op, args, cotangent)):
        assert_close(g, w, tolerance(jnp.float32, grad=True), f"{op} {name}")


def _shard_map_setup(op, devices, rng):
    mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    x, = _put(mesh, P("b"), normal(rng, (8, 5, 48), loc=2.0, scale=3.0))
    scale, bias = _put(mesh, P(), *op.params(rng, 48))
    return mesh, x, scale, bias


@op_param
def test_shard_map_forward(op, devices, rng):
    mesh, x, scale, bias = _shard_map_setup(op, devices, rng)
    per_shard = jax.shard_map(lambda x, s, b: op(x, s, b), mesh=mesh,
                              in_specs=(P("b"), P(), P()), out_specs=P("b"))
    out = jax.jit(per_shard)(x, scale, bias)
    assert_close(out, op.oracle(x, scale, bias), tolerance(jnp.float32), f"{op} shard_map")


def _varying_axes(aval):
    """The mesh axes a value inside shard_map varies over (`vma`; renamed in newer jax)."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else aval.vma)


@op_param
def test_shard_map_output_varies_over_the_mesh_axis(op, devices, rng):
    mesh, x, scale, bias = _shard_map_setup(op, devices, rng)
    varying = {}

    def body(x, s, b):
        y = op(x, s, b)
        varying.update(x=_varying_axes(jax.typeof(x)), y=_varying_axes(jax.typeof(y)))
        return y

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("b"), P(), P()),
                          out_specs=P("b")))(x, scale, bias)
    assert varying["x"] == {"b"}
    assert varying["y"] == {"b"}, f"{op}'s output inside shard_map varies over {varying['y']}"


@op_param
def test_shard_map_grad(op, devices, rng):
    mesh, x, scale, bias = _shard_map_setup(op, devices, rng)
    cotangent, = _put(mesh, P("b"), normal(rng, x.shape))

    def body(x, scale, bias, ct):
        # scale and bias are replicated (invariant over "b"), so their cotangents come back
        # already summed over the shards.
        return vjp(op, (x, scale, bias), ct)

    n_params = 2 if op.has_bias else 1
    per_shard = jax.shard_map(body, mesh=mesh, in_specs=(P("b"), P(), P(), P("b")),
                              out_specs=(P("b"),) + (P(),) * n_params)
    got = jax.jit(per_shard)(x, scale, bias, cotangent)
    for g, w in zip(got, oracle_vjp(op, (x, scale, bias), cotangent)):
        assert_close(g, w, tolerance(jnp.float32, grad=True), f"{op} shard_map grad")
