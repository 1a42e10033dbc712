// What kvledger's CPU kernels share: float32 vectors of ATen's (16 lanes with AVX-512, 8 with
// AVX2), loading one vector's worth of float32 or bfloat16 values as float32, storing one as
// either, and rounding one as storing it to a dtype and loading it back would.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <type_traits>

namespace kvledger_cpu {

using Vec = at::vec::Vectorized<float>;

inline Vec load_floats(const float* p) { return Vec::loadu(p); }

inline Vec load_floats(const c10::BFloat16* p) {
  Vec v;
  at::vec::load_to_float(p, v);
  return v;
}

inline void store_floats(const Vec& v, float* p) { v.store(p); }

// Rounds to nearest even, as c10::BFloat16's own conversion does.
inline void store_floats(const Vec& v, c10::BFloat16* p) {
  at::vec::convert_from_float<c10::BFloat16>(v, v).store(p, Vec::size());
}

// v as it would be after a store to T and a load back: itself for float32, rounded for bfloat16.
template <typename T>
inline Vec round_as(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float<c10::BFloat16>(at::vec::convert_from_float<c10::BFloat16>(v, v)));
  }
}

}  // namespace kvledger_cpu
