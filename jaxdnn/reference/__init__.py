"""Pure-JAX reference implementations: the tests' oracle, the second-order derivatives of the
kernels, and the documented path for cases a kernel does not serve (each is named in its docs)."""

from jaxdnn.reference.norm import layer_norm, rms_norm, norm_fwd, norm_bwd

__all__ = ["layer_norm", "rms_norm", "norm_fwd", "norm_bwd"]
