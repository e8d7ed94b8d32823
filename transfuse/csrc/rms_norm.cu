// rms_norm and fused_add_rms_norm: one block per row, the row held in registers between the
// sum of squares and the normalisation (as float32, which the compiler keeps in registers without
// spilling for every width handled here), so each input is read once and each output written once.
// Rounding follows transfuse.ops.rms_norm_native for the float32 (upcast) variants whose weight and
// output have the input dtype; the other variants are left to the Triton and native providers.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "common.cuh"
#include "dtypes.h"

namespace transfuse {
namespace {

// A block has at most kMaxThreads threads and each keeps up to kMaxVectorsPerThread vectors of
// its row in registers; wider rows are left to the other providers. (At 1024 threads the
// register cap of 64 a thread made the 8-vector bfloat16 kernels spill.)
constexpr int kMaxThreads = 512;
constexpr int kMaxVectorsPerThread = 8;
constexpr int kMaxVectors = kMaxThreads * kMaxVectorsPerThread;
// Threads per block the launcher aims for: several blocks per multiprocessor keep loads in flight.
constexpr int kTargetThreads = 256;

struct NormFlags {
  bool cast_before_weight;  // round the normalised value to the input dtype before the weight
  bool offset;              // multiply by 1 + weight
  bool round_offset;        // 1 + weight rounds to the weight's dtype (it is not cast to float32 first)
};

// VPT vectors of VEC elements per thread; the weight and the output have the input's dtype T.
template <typename T, int VEC, int VPT, bool ADD_RESIDUAL>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_kernel(
    T* __restrict__ out, T* __restrict__ residual_out, const T* __restrict__ x, const T* __restrict__ residual,
    const T* __restrict__ weight, int64_t x_stride, int64_t residual_stride, int hidden, float eps, NormFlags flags) {
  const int64_t row = blockIdx.x;
  const int n_vec = hidden / VEC;
  float cache[VPT][VEC];
  float sum_sq = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < n_vec) {
      Vec<T, VEC> h = load_vec<T, VEC>(x + row * x_stride + v * VEC);
      if constexpr (ADD_RESIDUAL) {
        const Vec<T, VEC> r = load_vec<T, VEC>(residual + row * residual_stride + v * VEC);
#pragma unroll
        for (int j = 0; j < VEC; ++j) h.v[j] = static_cast<T>(static_cast<float>(r.v[j]) + static_cast<float>(h.v[j]));
        store_vec<T, VEC>(residual_out + row * hidden + v * VEC, h);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float f = static_cast<float>(h.v[j]);
        cache[i][j] = f;
        sum_sq += f * f;
      }
    }
  }
  const float rstd = rsqrtf(block_sum(sum_sq) / hidden + eps);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    if (v < n_vec) {
      Vec<T, VEC> w;
      if (weight != nullptr) w = load_vec<T, VEC>(weight + v * VEC);
      Vec<T, VEC> o;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float h = cache[i][j] * rstd;
        if (flags.cast_before_weight) h = round_to<T>(h);
        if (weight != nullptr) {
          float wj = static_cast<float>(w.v[j]);
          if (flags.offset) {
            wj = 1.f + wj;
            if (flags.round_offset) wj = round_to<T>(wj);
          }
          h *= wj;  // the product's one rounding is the store's
        }
        o.v[j] = static_cast<T>(h);
      }
      store_vec<T, VEC>(out + row * hidden + v * VEC, o);
    }
  }
}

struct Rows {
  const at::Tensor& x;
  const at::Tensor* residual;  // null for rms_norm
  const std::optional<at::Tensor>& weight;
  at::Tensor& out;
  at::Tensor* residual_out;  // null for rms_norm
};

template <typename T, int VEC, int VPT, bool ADD_RESIDUAL>
void launch_rows(const Rows& r, int threads, float eps, NormFlags flags) {
  const auto data = [](const at::Tensor* t) { return t ? static_cast<T*>(t->data_ptr()) : nullptr; };
  const T* weight = r.weight ? static_cast<const T*>(r.weight->data_ptr()) : nullptr;
  rms_norm_kernel<T, VEC, VPT, ADD_RESIDUAL>
      <<<static_cast<unsigned>(r.x.size(0)), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          data(&r.out), data(r.residual_out), data(&r.x), data(r.residual), weight, r.x.stride(0),
          r.residual ? r.residual->stride(0) : 0, static_cast<int>(r.x.size(1)), eps, flags);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Vectors per thread: the fewest that keep the block at kTargetThreads, up to kMaxVectorsPerThread.
template <typename T, int VEC, bool ADD_RESIDUAL>
void launch_vec(const Rows& r, float eps, NormFlags flags) {
  const int64_t n_vec = r.x.size(1) / VEC;
  TORCH_CHECK(n_vec <= kMaxVectors, "transfuse's CUDA rms_norm holds at most ", kMaxVectors * VEC,
              " elements of a row here; this row has ", r.x.size(1), ".");
  const int64_t per_thread = (n_vec + kTargetThreads - 1) / kTargetThreads;
  const int vpt = per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : per_thread <= 4 ? 4 : 8;
  const int threads = std::max(32, round_up_to_warp((n_vec + vpt - 1) / vpt));
  switch (vpt) {
    case 1: return launch_rows<T, VEC, 1, ADD_RESIDUAL>(r, threads, eps, flags);
    case 2: return launch_rows<T, VEC, 2, ADD_RESIDUAL>(r, threads, eps, flags);
    case 4: return launch_rows<T, VEC, 4, ADD_RESIDUAL>(r, threads, eps, flags);
    default: return launch_rows<T, VEC, 8, ADD_RESIDUAL>(r, threads, eps, flags);
  }
}

// 16-byte accesses when the width and every row start allow them, else one element at a time.
template <typename T, bool ADD_RESIDUAL>
void launch(const Rows& r, float eps, NormFlags flags) {
  constexpr int VEC = 16 / sizeof(T);
  bool vectorized = r.x.size(1) % VEC == 0 && r.x.stride(0) % VEC == 0 && aligned(r.x.data_ptr(), 16) &&
                    aligned(r.out.data_ptr(), 16);
  if (r.residual) {
    vectorized = vectorized && r.residual->stride(0) % VEC == 0 && aligned(r.residual->data_ptr(), 16) &&
                 aligned(r.residual_out->data_ptr(), 16);
  }
  if (r.weight) vectorized = vectorized && aligned(r.weight->data_ptr(), 16);
  if (vectorized) {
    launch_vec<T, VEC, ADD_RESIDUAL>(r, eps, flags);
  } else {
    launch_vec<T, 1, ADD_RESIDUAL>(r, eps, flags);
  }
}

void check_rows(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.stride(1) == 1 && t.sizes() == x.sizes() &&
                  t.scalar_type() == x.scalar_type() && t.device() == x.device(),
              "transfuse's CUDA rms_norm takes ", name, " as rows of x's shape, dtype and device, contiguous "
              "along the last dimension; got shape ", t.sizes(), ", strides ", t.strides(), ", ", t.scalar_type(),
              " on ", t.device(), " for x of shape ", x.sizes(), ", ", x.scalar_type(), " on ", x.device(), ".");
}

template <bool ADD_RESIDUAL>
void dispatch(const Rows& r, double eps, bool cast_before_weight, bool offset, bool weight_fp32) {
  check_rows(r.x, r.x, "x");
  check_rows(r.out, r.x, "out");
  TORCH_CHECK(r.x.size(0) < (int64_t{1} << 31), "transfuse's CUDA rms_norm takes fewer than 2**31 rows, not ",
              r.x.size(0), ".");
  if (r.weight) {
    TORCH_CHECK(r.weight->dim() == 1 && r.weight->is_contiguous() && r.weight->numel() == r.x.size(1) &&
                    r.weight->scalar_type() == r.x.scalar_type() && r.weight->device() == r.x.device(),
                "transfuse's CUDA rms_norm takes a contiguous 1-D weight of x's width, dtype and device; got shape ",
                r.weight->sizes(), ", ", r.weight->scalar_type(), " on ", r.weight->device(), ".");
  }
  const c10::cuda::OptionalCUDAGuard guard(r.x.device());
  with_float_type(r.x.scalar_type(), "input", [&](auto x_type) {
    using T = decltype(x_type);
    // weight_fp32 casts a half weight to float32 before 1 + weight, which then does not round.
    const NormFlags flags{cast_before_weight, offset, !weight_fp32 && !std::is_same_v<T, float>};
    launch<T, ADD_RESIDUAL>(r, static_cast<float>(eps), flags);
  });
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps,
              bool cast_before_weight, bool offset, bool weight_fp32) {
  dispatch<false>(Rows{x, nullptr, weight, out, nullptr}, eps, cast_before_weight, offset, weight_fp32);
}

void fused_add_rms_norm(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x, const at::Tensor& residual,
                        const std::optional<at::Tensor>& weight, double eps, bool cast_before_weight, bool offset,
                        bool weight_fp32) {
  check_rows(residual, x, "residual");
  check_rows(residual_out, x, "residual_out");
  dispatch<true>(Rows{x, &residual, weight, out, &residual_out}, eps, cast_before_weight, offset, weight_fp32);
}

}  // namespace transfuse
