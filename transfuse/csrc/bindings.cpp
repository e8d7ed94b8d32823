// Python bindings of transfuse's CUDA kernels. Each takes its outputs preallocated by the
// caller (transfuse/ops/cuda/launch.py), and 2-D row views of its inputs.

#include <torch/extension.h>

#include <optional>

namespace transfuse {
void rms_norm(at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps,
              bool cast_before_weight, bool offset, bool weight_fp32);
void fused_add_rms_norm(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x, const at::Tensor& residual,
                        const std::optional<at::Tensor>& weight, double eps, bool cast_before_weight, bool offset,
                        bool weight_fp32);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);
}  // namespace transfuse

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &transfuse::rms_norm, "out = rms_norm(x) over rows, float32 normalisation");
  m.def("fused_add_rms_norm", &transfuse::fused_add_rms_norm,
        "residual_out = residual + x; out = rms_norm(residual_out) over rows");
  m.def("silu_and_mul", &transfuse::silu_and_mul, "out = silu(x[:, :d]) * x[:, d:]");
}
