// Host-side dispatch from a tensor's dtype to the C++ storage type the kernels are built for.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

namespace transfuse {

// Calls f(T{}) with T the storage type of dtype t: float, c10::Half or c10::BFloat16.
template <typename F>
void with_float_type(c10::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case c10::ScalarType::Float:
      f(float{});
      return;
    case c10::ScalarType::Half:
      f(c10::Half{});
      return;
    case c10::ScalarType::BFloat16:
      f(c10::BFloat16{});
      return;
    default:
      TORCH_CHECK(false, "transfuse's CUDA kernels take a float32, float16 or bfloat16 ", what, ", not ", t, ".");
  }
}

// Calls f(T{}) when t is T's own dtype and f(float{}) when it is float32: the two storage types
// a weight or an output may have beside an input of type T (fewer kernels to build).
template <typename T, typename F>
void with_same_or_float(c10::ScalarType t, const char* what, F&& f) {
  if (t == c10::CppTypeToScalarType<T>::value) {
    f(T{});
  } else if (t == c10::ScalarType::Float) {
    f(float{});
  } else {
    TORCH_CHECK(false, "transfuse's CUDA kernels take a ", what, " of the input's dtype (",
                c10::CppTypeToScalarType<T>::value, ") or float32, not ", t, ".");
  }
}

}  // namespace transfuse
