// RoPE (rotate_half layout) of queries and keys in one call, as the engine's eager step needs it.
//
// kvledger_cpu::rotary(x, cos, sin) -> y
//   x        [N, H, d]  float32 or bfloat16, last dimension contiguous (a view of the fused q/k/v rows)
//   cos, sin [N, d]     x's dtype, contiguous: the rows of the tables for each token's position
//   y        [N, H, d]  contiguous: y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
// with the roundings of those torch operators in x's dtype (a product is rounded before the sum,
// never fused), so the result equals kvledger.layers.rotary.apply_rotary's. One call instead of
// the six operators (two products, a negation, a concatenation, a sum, the slices) per layer.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>

#include "float_vec.h"
#include "library.h"

#pragma GCC optimize("fp-contract=off")  // products rounded before the sum, as torch's operators

namespace {

using kvledger_cpu::load_floats;
using kvledger_cpu::round_as;
using kvledger_cpu::store_floats;
using kvledger_cpu::Vec;

// One head of one token: y[i] = x[i] * c[i] + r[i] * s[i], r = [-x[h..d), x[0..h)].
template <typename T>
inline void rotate_row(const T* x, const T* c, const T* s, T* y, int64_t d) {
  constexpr int64_t W = Vec::size();
  const int64_t h = d / 2;
  if (h % W == 0) {  // a vector from each half at a time: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
    for (int64_t i = 0; i < h; i += W) {
      const Vec x1 = load_floats(x + i), x2 = load_floats(x + h + i);
      store_floats(round_as<T>(x1 * load_floats(c + i)) + round_as<T>(x2.neg() * load_floats(s + i)), y + i);
      store_floats(round_as<T>(x2 * load_floats(c + h + i)) + round_as<T>(x1 * load_floats(s + h + i)), y + h + i);
    }
    return;
  }
  for (int64_t i = 0; i < d; ++i) {
    const float xi = static_cast<float>(x[i]);
    const float ri = i < h ? -static_cast<float>(x[i + h]) : static_cast<float>(x[i - h]);
    const T a = static_cast<T>(xi * static_cast<float>(c[i]));  // rounded to T, as x * cos is
    const T b = static_cast<T>(ri * static_cast<float>(s[i]));
    y[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
  }
}

template <typename T>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& y) {
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2);
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t j = 0; j < heads; ++j)
        rotate_row<T>(xp + t * xs0 + j * xs1, cp + t * d, sp + t * d, yp + (t * heads + j) * d, d);
  });
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary: x must be [N, H, d] with d even and its last dimension contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2)
                  && cos.is_contiguous() && sin.is_contiguous(), "rotary: cos and sin must be contiguous [N, d]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: x, cos and sin must share a dtype");
  at::Tensor y = at::empty(x.sizes(), x.options());
  kvledger_cpu::dispatch_float(x.scalar_type(), "rotary", [&](auto t) { rotate<decltype(t)>(x, cos, sin, y); });
  return y;
}

}  // namespace

KVLEDGER_IMPL(m) { m.impl("rotary", &rotary); }
