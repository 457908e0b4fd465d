// The _jaxdnn extension: hands every FFI handler to Python, which registers them with XLA.
#include <nanobind/nanobind.h>

#include "activation/activation.h"
#include "attention/attention.h"
#include "batch_norm/batch_norm.h"
#include "common/cpu_isa.h"
#include "conv/conv.h"
#include "dense/dense.h"
#include "group_norm/group_norm.h"
#include "norm/norm.h"
#include "pool/pool.h"
#include "rnn/rnn.h"
#include "softmax/softmax.h"

namespace nb = nanobind;

namespace {

// One row per FFI target: its versioned name and its handler per platform (nullptr if not built).
struct Target {
  const char* name;
  XLA_FFI_Handler* cpu;
  XLA_FFI_Handler* cuda;
};

#ifdef JAXDNN_WITH_CUDA
#define JAXDNN_CUDA_HANDLER(symbol) symbol
#else
#define JAXDNN_CUDA_HANDLER(symbol) nullptr
#endif

const Target kTargets[] = {
    {"jaxdnn_layer_norm_fwd_v2", LayerNormFwdCpu, JAXDNN_CUDA_HANDLER(LayerNormFwdCuda)},
    {"jaxdnn_layer_norm_bwd_v2", LayerNormBwdCpu, JAXDNN_CUDA_HANDLER(LayerNormBwdCuda)},
    {"jaxdnn_rms_norm_fwd_v1", RmsNormFwdCpu, JAXDNN_CUDA_HANDLER(RmsNormFwdCuda)},
    {"jaxdnn_rms_norm_bwd_v1", RmsNormBwdCpu, JAXDNN_CUDA_HANDLER(RmsNormBwdCuda)},
    {"jaxdnn_group_norm_fwd_v1", GroupNormFwdCpu, JAXDNN_CUDA_HANDLER(GroupNormFwdCuda)},
    {"jaxdnn_group_norm_bwd_v1", GroupNormBwdCpu, JAXDNN_CUDA_HANDLER(GroupNormBwdCuda)},
    {"jaxdnn_softmax_fwd_v1", SoftmaxFwdCpu, JAXDNN_CUDA_HANDLER(SoftmaxFwdCuda)},
    {"jaxdnn_softmax_bwd_v1", SoftmaxBwdCpu, JAXDNN_CUDA_HANDLER(SoftmaxBwdCuda)},
    {"jaxdnn_log_softmax_fwd_v1", LogSoftmaxFwdCpu, JAXDNN_CUDA_HANDLER(LogSoftmaxFwdCuda)},
    {"jaxdnn_log_softmax_bwd_v1", LogSoftmaxBwdCpu, JAXDNN_CUDA_HANDLER(LogSoftmaxBwdCuda)},
    {"jaxdnn_activation_fwd_v1", ActivationFwdCpu, JAXDNN_CUDA_HANDLER(ActivationFwdCuda)},
    {"jaxdnn_activation_bwd_v1", ActivationBwdCpu, JAXDNN_CUDA_HANDLER(ActivationBwdCuda)},
    {"jaxdnn_activation_bwd_bias_v1", ActivationBwdBiasCpu, JAXDNN_CUDA_HANDLER(ActivationBwdBiasCuda)},
    {"jaxdnn_batch_norm_stats_v1", BatchNormStatsCpu, JAXDNN_CUDA_HANDLER(BatchNormStatsCuda)},
    {"jaxdnn_batch_norm_fwd_v1", BatchNormFwdCpu, JAXDNN_CUDA_HANDLER(BatchNormFwdCuda)},
    {"jaxdnn_batch_norm_bwd_sums_v2", BatchNormBwdSumsCpu, JAXDNN_CUDA_HANDLER(BatchNormBwdSumsCuda)},
    {"jaxdnn_batch_norm_bwd_grad_v1", BatchNormBwdGradCpu, JAXDNN_CUDA_HANDLER(BatchNormBwdGradCuda)},
    {"jaxdnn_batch_norm_bwd_dx_v2", BatchNormBwdDxCpu, JAXDNN_CUDA_HANDLER(BatchNormBwdDxCuda)},
    {"jaxdnn_max_pool_infer_v1", MaxPoolInferCpu, JAXDNN_CUDA_HANDLER(MaxPoolInferCuda)},
    {"jaxdnn_max_pool_fwd_v1", MaxPoolFwdCpu, JAXDNN_CUDA_HANDLER(MaxPoolFwdCuda)},
    {"jaxdnn_max_pool_bwd_v1", MaxPoolBwdCpu, JAXDNN_CUDA_HANDLER(MaxPoolBwdCuda)},
    {"jaxdnn_avg_pool_fwd_v1", AvgPoolFwdCpu, JAXDNN_CUDA_HANDLER(AvgPoolFwdCuda)},
    {"jaxdnn_avg_pool_bwd_v1", AvgPoolBwdCpu, JAXDNN_CUDA_HANDLER(AvgPoolBwdCuda)},
    {"jaxdnn_conv_fprop_v4", ConvFpropCpu, JAXDNN_CUDA_HANDLER(ConvFpropCuda)},
    {"jaxdnn_conv_fprop_fused_v4", ConvFpropFusedCpu, JAXDNN_CUDA_HANDLER(ConvFpropFusedCuda)},
    {"jaxdnn_conv_dgrad_v4", ConvDgradCpu, JAXDNN_CUDA_HANDLER(ConvDgradCuda)},
    {"jaxdnn_conv_wgrad_v4", ConvWgradCpu, JAXDNN_CUDA_HANDLER(ConvWgradCuda)},
    {"jaxdnn_gemm_v3", GemmCpu, JAXDNN_CUDA_HANDLER(GemmCuda)},
    {"jaxdnn_attention_fwd_v2", AttentionFwdCpu, JAXDNN_CUDA_HANDLER(AttentionFwdCuda)},
    {"jaxdnn_attention_bwd_v3", AttentionBwdCpu, JAXDNN_CUDA_HANDLER(AttentionBwdCuda)},
    {"jaxdnn_lstm_fwd_v4", LstmFwdCpu, JAXDNN_CUDA_HANDLER(LstmFwdCuda)},
    {"jaxdnn_lstm_bwd_v3", LstmBwdCpu, JAXDNN_CUDA_HANDLER(LstmBwdCuda)},
    {"jaxdnn_gru_fwd_v4", GruFwdCpu, JAXDNN_CUDA_HANDLER(GruFwdCuda)},
    {"jaxdnn_gru_bwd_v3", GruBwdCpu, JAXDNN_CUDA_HANDLER(GruBwdCuda)},
    {"jaxdnn_rnn_fwd_v4", RnnFwdCpu, JAXDNN_CUDA_HANDLER(RnnFwdCuda)},
    {"jaxdnn_rnn_bwd_v3", RnnBwdCpu, JAXDNN_CUDA_HANDLER(RnnBwdCuda)},
};

nb::capsule Capsule(XLA_FFI_Handler* handler) { return nb::capsule(reinterpret_cast<void*>(handler)); }

}  // namespace

NB_MODULE(_jaxdnn, m) {
  m.def("registrations", []() {
    nb::dict targets;
    for (const Target& target : kTargets) {
      nb::dict platforms;
      platforms["cpu"] = Capsule(target.cpu);
      if (target.cuda != nullptr) platforms["CUDA"] = Capsule(target.cuda);
      targets[target.name] = platforms;
    }
    return targets;
  }, "{target name: {platform: FFI handler capsule}} for every kernel built.");
  m.def("has_cuda_kernels", []() {
#ifdef JAXDNN_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "Whether the CUDA kernels were compiled into this build.");
  m.def("cpu_isa", []() { return jaxdnn::CpuIsaName(jaxdnn::ActiveCpuIsa()); },
        "The vector instructions of the CPU kernels' matmuls in this process: avx512, avx2 or baseline.");
}
