// Products of a few rows (decode steps of a few sequences) read at the speed of memory.
//
// kvledger_cpu::skinny_linear(x, weight, bias?, residual?) -> y
//   x        [M, K]  float32 or bfloat16, M at most 4, contiguous
//   weight   [N, K]  float32 or bfloat16 (either with either), contiguous
//   bias     [N]     x's dtype, or None
//   residual [M, N]  x's dtype, or None
//   y        [M, N]  x's dtype: y = x W^T (+ bias), accumulated in float32 and rounded once to
//            x's dtype, then (+ residual) as a torch add of that dtype would.
//
// With a few rows the product is bound by reading the weight: every weight row is read once,
// as a stream, and multiplied by the M input rows held in float32 in L1; the threads take
// contiguous ranges of output rows. A bfloat16 weight is widened to float32 on the fly, so a
// CPU without bfloat16 arithmetic reads half the bytes and computes in float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "float_vec.h"

namespace {

using kvledger_cpu::load_floats;
using kvledger_cpu::Vec;
constexpr int64_t kMaxRows = 4;

inline float reduce(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Output rows [n0, n1) for all M input rows, one weight row after the next, so that each thread
// reads its share of the weight as one forward stream: the hardware prefetcher follows one long
// stream well, while a few rows read side by side (short streams of K values each) halved the
// read rate at K = 576. U accumulators per input row (vectors k = u, u + U, ... of the row) hide
// the latency of the fused multiply-adds.
template <typename TW, int M>
void rows(const float* xf, const TW* w, int64_t K, int64_t n0, int64_t n1, float* acc_out) {
  constexpr int64_t W = Vec::size();
  constexpr int U = M <= 2 ? 4 : 2;
  const int64_t unrolled = K / (W * U) * (W * U);
  for (int64_t n = n0; n < n1; ++n) {
    const TW* row = w + n * K;
    Vec acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = Vec(0.f);
    int64_t k = 0;
    for (; k < unrolled; k += W * U) {
      for (int u = 0; u < U; ++u) {
        const Vec wv = load_floats(row + k + u * W);
        for (int m = 0; m < M; ++m) acc[m][u] = at::vec::fmadd(wv, Vec::loadu(xf + m * K + k + u * W), acc[m][u]);
      }
    }
    for (; k < K; k += W) {
      const Vec wv = load_floats(row + k);
      for (int m = 0; m < M; ++m) acc[m][0] = at::vec::fmadd(wv, Vec::loadu(xf + m * K + k), acc[m][0]);
    }
    for (int m = 0; m < M; ++m) {
      Vec total = acc[m][0];
      for (int u = 1; u < U; ++u) total = total + acc[m][u];
      acc_out[m * (n1 - n0) + (n - n0)] = reduce(total);
    }
  }
}

template <typename TX, typename TW>
void product(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
             const std::optional<at::Tensor>& residual, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  std::vector<float> xf(M * K);
  const TX* xp = x.data_ptr<TX>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xp[i]);
  const TW* wp = weight.data_ptr<TW>();
  const TX* bp = bias ? bias->data_ptr<TX>() : nullptr;
  const TX* rp = residual ? residual->data_ptr<TX>() : nullptr;
  TX* yp = y.data_ptr<TX>();
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(16, (N + threads - 1) / threads);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(M * (n1 - n0));
    switch (M) {
      case 1: rows<TW, 1>(xf.data(), wp, K, n0, n1, acc.data()); break;
      case 2: rows<TW, 2>(xf.data(), wp, K, n0, n1, acc.data()); break;
      case 3: rows<TW, 3>(xf.data(), wp, K, n0, n1, acc.data()); break;
      default: rows<TW, 4>(xf.data(), wp, K, n0, n1, acc.data()); break;
    }
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = n0; n < n1; ++n) {
        float v = acc[m * (n1 - n0) + (n - n0)];
        if (bp) v += static_cast<float>(bp[n]);
        TX out = static_cast<TX>(v);
        if (rp) out = static_cast<TX>(static_cast<float>(out) + static_cast<float>(rp[m * N + n]));
        yp[m * N + n] = out;
      }
    }
  });
}

template <typename TX>
void dispatch_weight(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& residual, at::Tensor& y) {
  if (weight.scalar_type() == at::kFloat) product<TX, float>(x, weight, bias, residual, y);
  else product<TX, c10::BFloat16>(x, weight, bias, residual, y);
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "skinny_linear: x must be a contiguous [M, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "skinny_linear: 1 to ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "skinny_linear: weight must be a contiguous [N, K]");
  TORCH_CHECK(x.size(1) % Vec::size() == 0, "skinny_linear: K must be a multiple of ", Vec::size());
  const auto xt = x.scalar_type(), wt = weight.scalar_type();
  TORCH_CHECK((xt == at::kFloat || xt == at::kBFloat16) && (wt == at::kFloat || wt == at::kBFloat16),
              "skinny_linear: float32 or bfloat16 only");
  if (bias) TORCH_CHECK(bias->scalar_type() == xt && bias->is_contiguous() && bias->numel() == weight.size(0),
                        "skinny_linear: bias must be [N] of x's dtype");
  if (residual) TORCH_CHECK(residual->scalar_type() == xt && residual->is_contiguous()
                                && residual->size(0) == x.size(0) && residual->size(1) == weight.size(0),
                            "skinny_linear: residual must be a contiguous [M, N] of x's dtype");
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  if (xt == at::kFloat) dispatch_weight<float>(x, weight, bias, residual, y);
  else dispatch_weight<c10::BFloat16>(x, weight, bias, residual, y);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvledger_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvledger_cpu, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
