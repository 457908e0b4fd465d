"""jax.export of programs that call jaxdnn: serialization round trip, the safety checks jaxdnn's
helper disables, and the versioned custom-call targets in the exported module."""

import jax
import jax.numpy as jnp
import pytest
from jax import export

import jaxdnn
from helpers import OPS, assert_close, f64, normal, tolerance

op_param = pytest.mark.parametrize("op", OPS, ids=repr)


def _program(op, weights, reference=False):
    """Forward value and gradients (x, scale[, bias]) of a loss through op (or its reference)."""
    norm = op.reference if reference else op

    def loss(x, scale, bias):
        return jnp.sum(jnp.tanh(norm(x, scale, bias)) * weights.astype(x.dtype))

    def program(x, scale, bias):
        argnums = (0, 1, 2) if op.has_bias else (0, 1)
        return jax.value_and_grad(loss, argnums=argnums)(x, scale, bias)
    return program


def _inputs(op, rng, shape=(4, 6, 72)):
    x = normal(rng, shape, loc=1.0, scale=2.0)
    scale, bias = op.params(rng, shape[-1])
    return x, scale, bias, normal(rng, shape)


def _export(fn, *args, **kwargs):
    return export.export(jax.jit(fn), disabled_checks=jaxdnn.export_safety_checks(), **kwargs)(
        *args)


@op_param
def test_round_trip(op, rng):
    x, scale, bias, weights = _inputs(op, rng)
    program = _program(op, weights)
    exported = _export(program, x, scale, bias)
    restored = export.deserialize(exported.serialize())
    got = restored.call(x, scale, bias)
    direct = jax.jit(program)(x, scale, bias)
    for g, d in zip(jax.tree.leaves(got), jax.tree.leaves(direct)):
        assert g.shape == d.shape and g.dtype == d.dtype
        assert_close(g, d, 1e-6, f"{op} exported vs direct")
    # And both are right.
    want = _program(op, f64(weights), reference=True)(f64(x), f64(scale), f64(bias))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, tolerance(jnp.float32, grad=True), f"{op} exported vs reference")
    # The restored program composes like any function: under jit, fed fresh inputs.
    x2 = normal(rng, x.shape, loc=-3.0, scale=0.5)
    again = jax.jit(restored.call)(x2, scale, bias)
    for g, d in zip(jax.tree.leaves(again), jax.tree.leaves(jax.jit(program)(x2, scale, bias))):
        assert_close(g, d, 1e-6, f"{op} exported (second call) vs direct")


@op_param
def test_module_holds_versioned_targets(op, rng):
    x, scale, bias, weights = _inputs(op, rng)
    module = _export(_program(op, weights), x, scale, bias).mlir_module()
    assert f"@{op.fwd_target}(" in module
    assert f"@{op.bwd_target}(" in module
    assert {op.fwd_target, op.bwd_target} <= set(jaxdnn.target_names())


@op_param
def test_export_needs_the_safety_checks(op, rng):
    x, scale, bias, weights = _inputs(op, rng)
    with pytest.raises(ValueError, match=rf"custom calls whose targets have no compatibility"
                                         rf"[\s\S]*{op.fwd_target}"):
        export.export(jax.jit(_program(op, weights)))(x, scale, bias)
    # Every jaxdnn target is covered by the helper, and only jaxdnn's.
    checks = jaxdnn.export_safety_checks()
    assert checks == [export.DisabledSafetyCheck.custom_call(t) for t in jaxdnn.target_names()]


@op_param
def test_multi_platform_export(op, rng):
    """One artifact for CPU and CUDA (the targets share their names across platforms)."""
    x, scale, bias, weights = _inputs(op, rng, (3, 40))
    program = _program(op, weights)
    exported = _export(program, x, scale, bias, platforms=("cpu", "cuda"))
    assert exported.platforms == ("cpu", "cuda")
    got = export.deserialize(exported.serialize()).call(x, scale, bias)
    for g, d in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(program)(x, scale, bias))):
        assert_close(g, d, 1e-6, f"{op} multi-platform export vs direct")


@op_param
def test_batch_polymorphic_forward_export(op, rng):
    x, scale, bias, _ = _inputs(op, rng, (5, 3, 24))
    batch, = export.symbolic_shape("batch")
    exported = _export(op, jax.ShapeDtypeStruct((batch, 3, 24), x.dtype), scale, bias)
    restored = export.deserialize(exported.serialize())
    for rows in (5, 1):
        got = restored.call(x[:rows], scale, bias)
        assert_close(got, op.oracle(x[:rows], scale, bias), tolerance(x.dtype), f"{op} rows={rows}")
