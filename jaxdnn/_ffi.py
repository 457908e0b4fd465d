"""Loads the compiled extension and registers every FFI target with XLA.

Each target is registered for the "cpu" platform and, when the CUDA kernels were built, for "CUDA",
under one name: the same program lowers to the kernel of whichever platform runs it.
"""

import jax

from jaxdnn import _jaxdnn

_TARGETS = _jaxdnn.registrations()

for _name, _platforms in _TARGETS.items():
    for _platform, _capsule in _platforms.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)


def has_cuda_kernels() -> bool:
    """Whether this build of jaxdnn contains the CUDA kernels (it always contains the CPU ones)."""
    return _jaxdnn.has_cuda_kernels()


def cpu_isa() -> str:
    """The vector instructions of the CPU convolution's matmuls in this process: "avx512", "avx2" or
    "baseline" (SSE2 on x86-64), the widest the CPU has, capped by the environment variable
    JAXDNN_CPU_ISA (one of those names), read once."""
    return _jaxdnn.cpu_isa()


def target_names() -> tuple[str, ...]:
    """The versioned names of every FFI target jaxdnn registers (the ABI of exported programs)."""
    return tuple(sorted(_TARGETS))
