// LayerNorm and RMSNorm FFI handlers. Targets (the ABI of exported programs, hence versioned):
//   jaxdnn_layer_norm_fwd_v1  (x[R,D], scale[D] f32, bias[D] f32) -> (y[R,D], mean[R] f32, rstd[R] f32)
//   jaxdnn_layer_norm_bwd_v1  (dy, x, scale, mean, rstd) -> (dx, dscale[D] f32, dbias[D] f32, workspace[P,2,D] f32)
//   jaxdnn_rms_norm_fwd_v1    (x, scale) -> (y, rstd)
//   jaxdnn_rms_norm_bwd_v1    (dy, x, scale, rstd) -> (dx, dscale, workspace[P,1,D] f32)
// R is every leading axis of x folded together. The workspace holds per-block partial sums of
// dscale/dbias so the CUDA backward reduces them in a fixed order (same bits every run); P is chosen
// at trace time (jaxdnn/norm.py) and the CPU kernels ignore it.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(LayerNormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayerNormBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormBwdCpu);

#ifdef JAXDNN_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayerNormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayerNormBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormBwdCuda);
#endif
