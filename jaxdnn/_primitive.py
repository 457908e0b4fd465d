"""The one helper that turns an FFI target into a JAX primitive.

`ffi_primitive` declares, for one kernel stage (e.g. `layer_norm_fwd`):
- abstract evaluation from a shape function shared with the lowering;
- lowering to the FFI target through `jax.ffi.ffi_call`, identical for CPU and CUDA (the target is
  registered for both under one name, see `_ffi.py`), so the HLO holds one custom call per stage;
- a batching rule supplied by the family (it folds the vmapped axis into an axis the kernel already
  loops over);
- sharding: the call is wrapped in `custom_partitioning` with a Shardy rule in which `...` stands for
  the row (batch) axes. Row-sharded operands stay sharded and each device runs the kernel on its own
  rows (no all-gather); per-feature operands are replicated; results listed in `reduced_results`
  (sums over rows, like dscale) are summed across the devices that hold the rows.

With Explicit mesh axes the sharding is part of the types, and the public functions run the kernels
per row shard through `jax.shard_map` instead (`per_row_shard`). Inside `shard_map` the results vary
over the same mesh axes as the operands (`match_varying` makes per-feature params agree first).

Workspace buffers are extra FFI results sized at trace time from the (per-shard) shapes, so no
handler allocates memory; they are dropped before the primitive returns.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

# jax keeps these in a private module: eager dispatch of a primitive, and the set of primitives
# whose lowering needs the device assignment (custom_partitioning's does; it is inside ours).
from jax._src import dispatch as _dispatch

# A kernel's attributes as a sorted tuple of (name, value) pairs: hashable, as custom_partitioning's
# static arguments must be. Values are numpy scalars so their FFI type is explicit (np.float32 ->
# f32, np.int64 -> i64): a Python float would become f64 and fail to bind.
Attrs = tuple


@dataclasses.dataclass(frozen=True)
class _RowLayout:
    """Which operands/results carry the row axes (`...` in the sharding rule) and how many trailing
    per-row axes they have; the others are per-feature and replicated."""
    operand_trailing: tuple[int | None, ...]  # None: no row axes (replicated)
    result_trailing: tuple[int | None, ...]

    @classmethod
    def parse(cls, rule: str) -> "_RowLayout":
        def roles(side: str):
            out = []
            for spec in side.split(","):
                dims = spec.split()
                out.append(len(dims) - 1 if dims and dims[0] == "..." else None)
            return tuple(out)
        operands, results = rule.split("->")
        return cls(roles(operands), roles(results))


def _row_spec(layout: _RowLayout, arg_shapes) -> tuple:
    """The partition spec of the row axes, read off the first operand (it always has row axes)."""
    x = arg_shapes[0]
    row_ndim = x.ndim - layout.operand_trailing[0]
    spec = tuple(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else ()
    spec = (spec + (None,) * x.ndim)[:row_ndim]
    return spec


def _shardings(mesh, row_spec, trailing_roles):
    return tuple(
        NamedSharding(mesh, PartitionSpec()) if trailing is None
        else NamedSharding(mesh, PartitionSpec(*row_spec, *([None] * trailing)))
        for trailing in trailing_roles)


def _mesh_axes(row_spec) -> tuple[str, ...]:
    axes = []
    for entry in row_spec:
        if entry is None:
            continue
        axes.extend(entry if isinstance(entry, tuple) else (entry,))
    return tuple(axes)


def _varying_axes(aval) -> frozenset:
    """The manual mesh axes (inside `shard_map`) over which a value varies; empty outside."""
    mat = getattr(aval, "mat", None)  # jax >= 0.10: the manual axis type
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def _like_operand(result, operand):
    """`result` typed to vary over the same manual mesh axes as `operand`."""
    mat = getattr(operand, "mat", None)
    if mat is not None:  # jax >= 0.10: the type carries a sharding on the (manual) mesh
        if not mat.varying:
            return result
        return jax.core.ShapedArray(
            result.shape, result.dtype,
            sharding=NamedSharding(operand.sharding.mesh, PartitionSpec()), manual_axis_type=mat)
    if getattr(operand, "vma", None):
        return result.update(vma=operand.vma)
    return result


def match_varying(x, *params):
    """Inside `shard_map`, marks per-feature `params` as varying over the mesh axes `x` varies
    over, as JAX's own ops do when they broadcast: every kernel operand then has one type, and the
    transpose of that cast sums the params' gradients over those axes. Outside, returns `params`."""
    axes = _varying_axes(jax.typeof(x))
    out = []
    for p in params:
        missing = tuple(sorted(axes - _varying_axes(jax.typeof(p)))) if p is not None else ()
        if missing:
            p = (jax.lax.pcast(p, missing, to="varying") if hasattr(jax.lax, "pcast")
                 else jax.lax.pvary(p, missing))
        out.append(p)
    return out


def transpose_linear(fn, shape, ct):
    """The transpose of the linear `fn` (of one array of `shape`, in ct's dtype) applied to ct. Its
    primal varies over the mesh axes ct varies over (inside `shard_map`, e.g. under an Explicit batch
    sharding), which `jax.linear_transpose`'s shape-and-dtype primal would not."""
    primal = match_varying(ct, jax.numpy.zeros(shape, ct.dtype))[0]
    return jax.vjp(fn, primal)[1](ct)[0]


def explicit_row_sharding(x, whole_axes: int = 1):
    """(mesh, x's partition spec, the mesh axes) when x's row axes (all but its last `whole_axes`)
    are sharded over Explicit mesh axes; None otherwise. The spec leaves the last axes whole."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    explicit = set(getattr(mesh, "explicit_axes", ()))
    row_spec = tuple(sharding.spec)[:x.ndim - whole_axes] if sharding is not None else ()
    row_spec = tuple(a if a is not None and set(a if isinstance(a, tuple) else (a,)) <= explicit
                     else None for a in row_spec)
    if not any(a is not None for a in row_spec):
        return None
    row_spec = row_spec + (None,) * (x.ndim - whole_axes - len(row_spec))
    return mesh, PartitionSpec(*row_spec, *([None] * whole_axes)), _mesh_axes(row_spec)


def per_row_shard(fn, x, *params, whole_axes: int = 1):
    """`fn(x, *params)`, run per shard of x's row axes when they are sharded over Explicit mesh axes.

    The row axes are all but x's last `whole_axes` axes (the features a kernel needs whole; 0 for
    elementwise ops). With Explicit axes the sharding is part of x's type; `jax.shard_map` over those
    axes runs the kernels on each device's rows (per-feature params replicated, their gradients
    summed across shards by JAX). Sharded feature axes are gathered first. Other cases (no mesh,
    Auto axes) are partitioned by the primitives' own rule and call fn directly.
    """
    sharded = explicit_row_sharding(x, whole_axes)
    if sharded is None:
        return fn(x, *params)
    mesh, x_spec, axes = sharded
    return jax.shard_map(
        fn, mesh=mesh, in_specs=(x_spec,) + (PartitionSpec(),) * len(params), out_specs=x_spec,
        axis_names=set(axes))(x, *params)


def _spans_devices(ctx) -> bool:
    """Whether the computation being lowered runs on several devices (then it is partitioned)."""
    axis_context = ctx.module_context.axis_context
    if getattr(axis_context, "mesh", None) is not None:  # inside shard_map
        return axis_context.mesh.size > 1
    return getattr(axis_context, "num_devices", 1) > 1


def ffi_primitive(
    name: str,
    target: str,
    *,
    result_avals: Callable[..., Sequence[jax.core.ShapedArray]],
    sharding_rule: str,
    batch_rule: Callable,
    scratch_results: int = 0,
    reduced_results: Sequence[int] = (),
    host_attrs: Sequence[str] = (),
    cpu_view: Callable | None = None,
) -> Primitive:
    """Declares the primitive `name`, computed by the FFI target `target`.

    Args:
      name: the primitive's name as it shows in jaxprs, e.g. "jaxdnn_layer_norm_fwd".
      target: the versioned FFI target, e.g. "jaxdnn_layer_norm_fwd_v1".
      result_avals: `(*operand_avals, **attrs) -> [ShapedArray, ...]`, every FFI result including
        trailing workspace results.
      sharding_rule: Shardy rule over the operands and the public results, `...` for the row axes,
        e.g. "... d, d, d -> ... d, ..., ...".
      batch_rule: `(primitive, args, dims, **attrs) -> (outs, out_dims)`.
      scratch_results: how many trailing FFI results are workspace (not returned).
      reduced_results: indices of public results that are sums over rows.
      host_attrs: names of attributes read by `result_avals` alone (they size workspaces) and not
        passed to the kernel.
      cpu_view: `(attrs, operand shapes) -> (attrs, shape -> shape)` or None: on the CPU, the kernel
        runs with those attributes on every operand and result reshaped by that function (the same
        bytes in another shape, e.g. with unit axes dropped: XLA:CPU may otherwise copy an operand
        into the layout the call asks for), each result reshaped back.

    The primitive is bound as `prim.bind(*operands, **attrs)` and returns a list of public results.
    """
    layout = _RowLayout.parse(sharding_rule)
    prim = Primitive(name)
    prim.multiple_results = True

    def public_avals(*operands, **attrs):
        avals = result_avals(*operands, **attrs)
        return [_like_operand(a, operands[0]) for a in avals[:len(avals) - scratch_results]]

    def make_call(view):
        """The kernel's call on operands (`view` as cpu_view, or None), and its partitioned form."""
        def call_kernel(attrs: Attrs, *operands):
            attrs = dict(attrs)
            avals = result_avals(*(jax.core.ShapedArray(o.shape, o.dtype) for o in operands), **attrs)
            viewed = view(attrs, [o.shape for o in operands]) if view else None
            if viewed:
                attrs, reshape = viewed
                operands = [o.reshape(reshape(o.shape)) for o in operands]
            kernel_attrs = {name: value for name, value in attrs.items() if name not in host_attrs}
            shapes = [reshape(a.shape) if viewed else a.shape for a in avals]
            results = jax.ffi.ffi_call(
                target, [jax.ShapeDtypeStruct(shape, a.dtype) for shape, a in zip(shapes, avals)])(
                    *operands, **kernel_attrs)
            if viewed:
                results = [r.reshape(a.shape) for r, a in zip(results, avals)]
            return tuple(results[:len(results) - scratch_results])

        partitioned = custom_partitioning(call_kernel, static_argnums=(0,))

        def infer_sharding(attrs, mesh, arg_shapes, result_shape):
            return _shardings(mesh, _row_spec(layout, arg_shapes), layout.result_trailing)

        def partition(attrs, mesh, arg_shapes, result_shape):
            row_spec = _row_spec(layout, arg_shapes)
            axes = _mesh_axes(row_spec)

            def per_shard(*operands):
                results = list(call_kernel(attrs, *operands))
                for i in reduced_results:
                    if axes:
                        results[i] = jax.lax.psum(results[i], axes)
                return tuple(results)

            return (mesh, per_shard, _shardings(mesh, row_spec, layout.result_trailing),
                    _shardings(mesh, row_spec, layout.operand_trailing))

        partitioned.def_partition(
            partition=partition, infer_sharding_from_operands=infer_sharding,
            sharding_rule=sharding_rule)
        return call_kernel, partitioned

    calls = make_call(None)
    cpu_calls = make_call(cpu_view) if cpu_view else calls

    def lowering(ctx, *operands, **attrs):
        # The CPU view only where the module is lowered for the CPU alone (not in a multi-platform export).
        call_kernel, partitioned = cpu_calls if tuple(ctx.module_context.platforms) == ("cpu",) else calls
        call = partitioned if _spans_devices(ctx) else call_kernel
        key = tuple(sorted(attrs.items()))
        return mlir.lower_fun(lambda *ops: call(key, *ops), multiple_results=True)(ctx, *operands)

    prim.def_abstract_eval(public_avals)
    prim.def_impl(functools.partial(_dispatch.apply_primitive, prim))
    _dispatch.prim_requires_devices_during_lowering.add(prim)
    mlir.register_lowering(prim, lowering)
    batching.primitive_batchers[prim] = functools.partial(batch_rule, prim)
    return prim


def images_in_unit_axis(attrs, shapes, trivial, rank):
    """A cpu_view (see ffi_primitive) for stages over pixel arrays [images..., D, H, W, C] in the
    kernels' 3-D form, whose window does not span D (trivial[0]: one element, unit stride, no
    padding, D = P = 1) and maybe not H (trivial[1]): the arrays as rank-`rank` ones (4 or 5, leading
    ones first) with the B = prod(images...) images in D, or in H where that is trivial too (the
    same bytes; in_d and out_d, or in_h and out_h, become B). XLA:CPU had copied x into the 3-D
    form's layout, whose unit axis follows the images, on every call. Other arrays (a filter [1, U,
    V, Cg, K], a bias, a workspace) keep their shapes. None where D is not trivial (a 3-D window) or
    the image count is symbolic (shape-polymorphic export)."""
    rows = shapes[0][:-4]
    if not trivial[0] or not all(isinstance(n, (int, np.integer)) for n in rows):
        return None
    images = int(np.prod(rows))
    if images >= 2**31:
        return None
    axis = 1 if trivial[1] else 0  # the unit axis the images take
    attrs = dict(attrs, **{f"{name}_{'dh'[axis]}": np.int64(images) for name in ("in", "out")})

    def reshape(shape):
        if len(shape) < 5 or shape[-4] != 1 or (axis == 1 and shape[-3] != 1):
            return shape  # not a pixel array (a filter [1, U, V, Cg, K] would map onto itself anyway)
        return (1,) * (rank - 4 + axis) + (int(np.prod(shape[:-4])),) + tuple(shape[-3 + axis:])
    return attrs, reshape


def with_reference_vjp(kernel, reference, *args):
    """`kernel(*args)` (a kernel stage), differentiated through `reference(*args)`, the pure-JAX
    function of the same operands and results: second-order derivatives of an op whose own VJP is
    made of kernel stages (grad of grad) then run through the reference."""
    fn = jax.custom_vjp(kernel)
    fn.defvjp(lambda *a: (kernel(*a), a), lambda a, ct: jax.vjp(reference, *a)[1](ct))
    return fn(*args)


def move_to_front(x, dim, size):
    """Returns `x` with its vmapped axis `dim` first, broadcasting an unbatched `x` to `size`."""
    if dim is None:
        return jax.numpy.broadcast_to(x, (size,) + x.shape)
    return jax.numpy.moveaxis(x, dim, 0)


def rows_batch_rule(prim, args, dims, **attrs):
    """Batching rule of an op whose operands all share the row axes (no per-feature operands): the
    vmapped axis becomes one more leading row axis (unbatched operands are broadcast to it)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    outs = prim.bind(*(move_to_front(a, d, size) for a, d in zip(args, dims)), **attrs)
    return outs, [0] * len(outs)
