// What kvledger's CPU kernels share: float32 vectors of ATen's (16 lanes with AVX-512, 8 with
// AVX2), and loading one vector's worth of float32 or bfloat16 values as float32.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

namespace kvledger_cpu {

using Vec = at::vec::Vectorized<float>;

inline Vec load_floats(const float* p) { return Vec::loadu(p); }

inline Vec load_floats(const c10::BFloat16* p) {
  Vec v;
  at::vec::load_to_float(p, v);
  return v;
}

}  // namespace kvledger_cpu
