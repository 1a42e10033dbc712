// RMSNorm of each row in one pass, as the engine's eager step needs it.
//
// kvledger_cpu::rms_norm(x, weight, eps) -> y, x [M, D] and weight [D] of one dtype:
//   float32:  y = x * rsqrt(mean(x^2) + eps) * weight
//   bfloat16: y = bf16(weight * bf16(x * rsqrt(mean(x^2) + eps))), x^2 summed in float32
// which are the formulas of kvledger.layers.rmsnorm.RMSNorm (Llama's: normalised in float32,
// rounded to the model dtype, then scaled). One call instead of the five to seven operators
// torch runs for it, each of which costs more to dispatch than a 576-wide row costs to compute.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "float_vec.h"
#include "library.h"

namespace {

using kvledger_cpu::load_floats;
using kvledger_cpu::round_as;
using kvledger_cpu::store_floats;
using kvledger_cpu::Vec;

template <typename T>
void norm_rows(const T* x, const T* w, T* y, int64_t M, int64_t D, float eps) {
  constexpr int64_t W = Vec::size();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* xr = x + m * D;
      T* yr = y + m * D;
      Vec sq(0.f);
      int64_t i = 0;
      for (; i + W <= D; i += W) {
        const Vec v = load_floats(xr + i);
        sq = at::vec::fmadd(v, v, sq);
      }
      float total = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sq);
      for (; i < D; ++i) total += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(total / static_cast<float>(D) + eps);
      const Vec iv(inv);
      for (i = 0; i + W <= D; i += W)  // w * x * inv, rounded to T before the weight (as below)
        store_floats(load_floats(w + i) * round_as<T>(load_floats(xr + i) * iv), yr + i);
      for (; i < D; ++i) {
        const float normed = static_cast<float>(xr[i]) * inv;
        // float32: x * inv * w; bfloat16: rounded to bfloat16 before the weight, as the module does
        yr[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(normed)));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be a contiguous [M, D]");
  TORCH_CHECK(weight.dim() == 1 && weight.numel() == x.size(1) && weight.is_contiguous(), "rms_norm: weight must be [D]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  at::Tensor y = at::empty_like(x);
  const int64_t M = x.size(0), D = x.size(1);
  kvledger_cpu::dispatch_float(x.scalar_type(), "rms_norm", [&](auto t) {
    using T = decltype(t);
    norm_rows<T>(x.data_ptr<T>(), weight.data_ptr<T>(), y.data_ptr<T>(), M, D, static_cast<float>(eps));
  });
  return y;
}

}  // namespace

KVLEDGER_IMPL(m) { m.impl("rms_norm", &rms_norm); }
