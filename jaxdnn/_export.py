"""Support for `jax.export` of programs that call jaxdnn kernels."""

from jax import export

from jaxdnn._ffi import target_names


def export_safety_checks() -> list:
    """The `disabled_checks` that `jax.export.export` needs for programs using jaxdnn.

    jax.export refuses custom calls it does not know to be stable; jaxdnn's targets are versioned
    (`jaxdnn_<op>_v<N>`) and keep their ABI, so they are safe to serialize. The deserializing
    process must `import jaxdnn` (to register the targets) before calling the program.

    Example:
      exported = jax.export.export(jax.jit(f), disabled_checks=jaxdnn.export_safety_checks())(x)
    """
    return [export.DisabledSafetyCheck.custom_call(name) for name in target_names()]
