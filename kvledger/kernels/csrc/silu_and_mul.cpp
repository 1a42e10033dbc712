// SwiGLU's gate in one call, as the engine's eager step needs it.
//
// kvledger_cpu::silu_and_mul(gate_up) -> y
//   gate_up [M, 2I]  float32 or bfloat16, contiguous: the fused [gate | up] projection
//   y       [M, I]   silu(gate) * up, silu(g) = g / (1 + exp(-g)) computed in float32 as torch's
//                    F.silu does (with the same vector exp), rounded to the dtype, then the
//                    product rounded again: the result equals F.silu(gate) * up.
// One call instead of three operators (chunk, silu, mul) and an intermediate tensor.

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
void gate_rows(const T* gu, T* y, int64_t M, int64_t I) {
  constexpr int64_t W = Vec::size();
  const Vec one(1.f);
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* g = gu + m * 2 * I;
      const T* u = g + I;
      T* yr = y + m * I;
      int64_t i = 0;
      for (; i + W <= I; i += W) {
        const Vec gv = load_floats(g + i);
        const Vec s = round_as<T>(gv / (one + gv.neg().exp()));  // F.silu's result, in T
        store_floats(s * load_floats(u + i), yr + i);
      }
      for (; i < I; ++i) {
        const float gi = static_cast<float>(g[i]);
        const T s = static_cast<T>(gi / (1.f + std::exp(-gi)));
        yr[i] = static_cast<T>(static_cast<float>(s) * static_cast<float>(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be a contiguous [M, 2I]");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor y = at::empty({M, I}, gate_up.options());
  kvledger_cpu::dispatch_float(gate_up.scalar_type(), "silu_and_mul", [&](auto t) {
    using T = decltype(t);
    gate_rows<T>(gate_up.data_ptr<T>(), y.data_ptr<T>(), M, I);
  });
  return y;
}

}  // namespace

KVLEDGER_IMPL(m) { m.impl("silu_and_mul", &silu_and_mul); }
