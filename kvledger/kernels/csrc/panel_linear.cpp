// Products of a few dozen rows (the batched decode steps) on a weight laid out in column panels.
//
// kvledger_cpu::pack_panels(weight) -> panels
//   weight [N, K] float32 or bfloat16, N a multiple of the panel width P (two vectors of floats:
//          32 with AVX-512, 16 with AVX2), contiguous
//   panels [N / P, K, P] same dtype: panel p holds output columns p*P .. p*P + P - 1, one row of P
//          weights per k, so that a panel is one forward stream of memory
//
// kvledger_cpu::panel_linear(x, panels, bias?, residual?) -> y
//   x        [M, K]  float32 or bfloat16, contiguous, M >= 1
//   panels   pack_panels' layout, float32 or bfloat16 (either with either)
//   bias     [N]     x's dtype, or None
//   residual [M, N]  x's dtype, or None
//   y        [M, N]  x's dtype: y = x W^T (+ bias), accumulated in float32 and rounded once to x's
//            dtype, then (+ residual) as a torch add of that dtype would.
//
// The threads take contiguous runs of panels. For each panel, the input rows are taken in groups of
// at most kRows; a group keeps its kRows x 2 accumulator vectors in registers and, for every k,
// loads the panel's two weight vectors once and multiplies them by each row's x[r][k] (broadcast
// from x transposed, so the group's values of one k are adjacent). The first group reads the
// panel from memory, the others from the core's cache. With few rows this streams the weight at
// the speed of memory; with a few dozen it keeps the FMA units busy: 24 multiply-adds for every
// 128 bytes of float32 weight at kRows = 12. oneDNN's inner product, which takes these shapes
// otherwise, reached less than a third of the machine's float32 rate at 16-64 rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "float_vec.h"
#include "library.h"

namespace {

using kvledger_cpu::load_floats;
using kvledger_cpu::Vec;
constexpr int64_t kW = Vec::size();
constexpr int64_t kPanel = 2 * kW;                 // output columns per panel
constexpr int kRows = kW == 16 ? 12 : 6;           // input rows per group: 2 * kRows accumulators + 3 in 32 (16) registers

// Two vectors of weights for one k of a panel, as float32 (a bfloat16 weight is widened).
#if defined(CPU_CAPABILITY_AVX512)
using Raw = __m512;
inline Raw raw_load(const float* p) { return _mm512_loadu_ps(p); }
inline Raw raw_load(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline Raw raw_broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Raw raw_fmadd(Raw a, Raw b, Raw c) { return _mm512_fmadd_ps(a, b, c); }
inline Raw raw_zero() { return _mm512_setzero_ps(); }
inline void raw_store(float* p, Raw v) { _mm512_storeu_ps(p, v); }
#elif defined(CPU_CAPABILITY_AVX2)
using Raw = __m256;
inline Raw raw_load(const float* p) { return _mm256_loadu_ps(p); }
inline Raw raw_load(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline Raw raw_broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Raw raw_fmadd(Raw a, Raw b, Raw c) { return _mm256_fmadd_ps(a, b, c); }
inline Raw raw_zero() { return _mm256_setzero_ps(); }
inline void raw_store(float* p, Raw v) { _mm256_storeu_ps(p, v); }
#endif

// out[r][0..P) = sum_k x[k][r] * panel[k][0..P) for the R rows of one group; x is [K][M]
// (transposed). The accumulators are plain arrays of the ISA's vector type, which the compiler
// keeps in registers (ATen's vector class in an array made it store them every iteration).
template <typename TW, int R>
inline void group(const float* xt, int64_t M, const TW* panel, int64_t K, float* out, int64_t out_stride) {
  Raw acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = raw_zero();
  for (int64_t k = 0; k < K; ++k) {
    const Raw w0 = raw_load(panel + k * kPanel), w1 = raw_load(panel + k * kPanel + kW);
    const float* xk = xt + k * M;
    for (int r = 0; r < R; ++r) {
      const Raw xb = raw_broadcast(xk + r);
      acc0[r] = raw_fmadd(w0, xb, acc0[r]);
      acc1[r] = raw_fmadd(w1, xb, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    raw_store(out + r * out_stride, acc0[r]);
    raw_store(out + r * out_stride + kW, acc1[r]);
  }
}

template <typename TW>
using GroupFn = void (*)(const float*, int64_t, const TW*, int64_t, float*, int64_t);

template <typename TW, int... R>
constexpr std::array<GroupFn<TW>, sizeof...(R)> group_table(std::integer_sequence<int, R...>) {
  return {&group<TW, R + 1>...};
}

template <typename TX, typename TW>
void product(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
             const std::optional<at::Tensor>& residual, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), num_panels = panels.size(0), N = num_panels * kPanel;
  // x transposed to [K][M] in float32: a group's values of one k lie side by side
  std::vector<float> xt(K * M);
  const TX* xp = x.data_ptr<TX>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[k * M + m] = static_cast<float>(xp[m * K + k]);
  static constexpr auto groups = group_table<TW>(std::make_integer_sequence<int, kRows>{});
  const int64_t num_groups = (M + kRows - 1) / kRows;
  const TW* wp = panels.data_ptr<TW>();
  const TX* bp = bias ? bias->data_ptr<TX>() : nullptr;
  const TX* rp = residual ? residual->data_ptr<TX>() : nullptr;
  TX* yp = y.data_ptr<TX>();
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> acc(M * kPanel);
    for (int64_t p = p0; p < p1; ++p) {
      const TW* panel = wp + p * K * kPanel;
      for (int64_t g = 0, r0 = 0; g < num_groups; ++g) {  // groups of even size, at most kRows
        const int64_t rows = (M - r0) / (num_groups - g);
        groups[rows - 1](xt.data() + r0, M, panel, K, acc.data() + r0 * kPanel, kPanel);
        r0 += rows;
      }
      const int64_t n0 = p * kPanel;
      for (int64_t m = 0; m < M; ++m) {  // + bias, rounded once to x's dtype, + residual, a vector at a time
        for (int64_t c = 0; c < kPanel; c += kW) {
          Vec v = Vec::loadu(acc.data() + m * kPanel + c);
          if (bp) v = v + load_floats(bp + n0 + c);
          if (rp) v = kvledger_cpu::round_as<TX>(v) + load_floats(rp + m * N + n0 + c);
          kvledger_cpu::store_floats(v, yp + m * N + n0 + c);
        }
      }
    }
  });
}

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_panels: weight must be [N, K]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "pack_panels: float32 or bfloat16 only");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kPanel == 0, "pack_panels: N must be a multiple of ", kPanel, ", got ", N);
  return weight.reshape({N / kPanel, kPanel, K}).transpose(1, 2).contiguous();
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1, "panel_linear: x must be a contiguous [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(1) == x.size(1) && panels.size(2) == kPanel,
              "panel_linear: panels must be pack_panels' [N / ", kPanel, ", K, ", kPanel, "]");
  const auto xt = x.scalar_type(), wt = panels.scalar_type();
  const int64_t N = panels.size(0) * kPanel;
  if (bias) TORCH_CHECK(bias->scalar_type() == xt && bias->is_contiguous() && bias->numel() == N,
                        "panel_linear: bias must be [N] of x's dtype");
  if (residual) TORCH_CHECK(residual->scalar_type() == xt && residual->is_contiguous()
                                && residual->size(0) == x.size(0) && residual->size(1) == N,
                            "panel_linear: residual must be a contiguous [M, N] of x's dtype");
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  kvledger_cpu::dispatch_float(xt, "panel_linear", [&](auto tx) {
    kvledger_cpu::dispatch_float(wt, "panel_linear", [&](auto tw) {
      product<decltype(tx), decltype(tw)>(x, panels, bias, residual, y);
    });
  });
  return y;
}

}  // namespace

int64_t kvledger_cpu::panel_width() { return kPanel; }

KVLEDGER_IMPL(m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}
