// silu_and_mul: out = silu(x[:, :d]) * x[:, d:], computed in float32; like F.silu(gate) * up in
// PyTorch, the activation is rounded to the input dtype before the multiply.

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "common.cuh"
#include "dtypes.h"

namespace transfuse {
namespace {

constexpr int kThreads = 256;

// Grid: (rows, blocks along the row); each thread handles one vector of the gate and of the up half.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride, int d) {
  const int64_t row = blockIdx.x;
  const int v = blockIdx.y * blockDim.x + threadIdx.x;
  if (v >= d / VEC) return;
  const T* gate_ptr = x + row * x_stride + static_cast<int64_t>(v) * VEC;
  const Vec<T, VEC> gate = load_vec<T, VEC>(gate_ptr);
  const Vec<T, VEC> up = load_vec<T, VEC>(gate_ptr + d);
  Vec<T, VEC> o;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float g = static_cast<float>(gate.v[j]);
    const float act = round_to<T>(g / (1.f + expf(-g)));
    o.v[j] = static_cast<T>(act * static_cast<float>(up.v[j]));
  }
  store_vec<T, VEC>(out + row * d + static_cast<int64_t>(v) * VEC, o);
}

template <typename T, int VEC>
void launch_rows(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0);
  const int d = static_cast<int>(x.size(1) / 2);
  const int n_vec = d / VEC;
  const int threads = std::min(kThreads, std::max(32, round_up_to_warp(n_vec)));
  const int blocks_per_row = (n_vec + threads - 1) / threads;
  TORCH_CHECK(blocks_per_row <= 65535, "transfuse's CUDA silu_and_mul takes rows of at most ", 65535 * threads * VEC,
              " elements here; this one has ", d, ".");
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(blocks_per_row));
  silu_and_mul_kernel<T, VEC><<<grid, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<T*>(out.data_ptr()), static_cast<const T*>(x.data_ptr()), x.stride(0), d);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "transfuse's CUDA silu_and_mul takes CUDA rows [gate | up] (2-D, contiguous along an even last "
              "dimension); got shape ", x.sizes(), ", strides ", x.strides(), " on ", x.device(), ".");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1) &&
                  out.scalar_type() == x.scalar_type(),
              "out must be a contiguous tensor of x's rows, half its width, and its dtype.");
  TORCH_CHECK(x.size(0) < (int64_t{1} << 31) && x.size(1) < (int64_t{1} << 31),
              "transfuse's CUDA silu_and_mul takes fewer than 2**31 rows and columns; got ", x.sizes(), ".");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  with_float_type(x.scalar_type(), "input", [&](auto x_type) {
    using T = decltype(x_type);
    constexpr int VEC = 16 / sizeof(T);
    const int64_t d = x.size(1) / 2;
    // The up half starts d elements into each row: it is 16-byte aligned only if d is a multiple of VEC.
    const bool vectorized = d % VEC == 0 && x.stride(0) % VEC == 0 && aligned(x.data_ptr(), 16);
    if (vectorized) {
      launch_rows<T, VEC>(out, x);
    } else {
      launch_rows<T, 1>(out, x);
    }
  });
}

}  // namespace transfuse
