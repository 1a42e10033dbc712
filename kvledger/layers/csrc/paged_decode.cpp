// Decode attention over the paged KV cache, read in place: one query per sequence.
//
// kvledger_cpu::paged_decode(out, q, k_pool, v_pool, block_tables, context_lens, scale)
//   out, q        [B, H, d]       float32 or bfloat16, last dimension contiguous
//   k_pool/v_pool [num_blocks, block_size, H_kv, d]   same dtype as q, contiguous
//   block_tables  [B, max_blocks] int64 (rows padded past a sequence's last block)
//   context_lens  [B]             int64, tokens each query attends to (its own included)
//
// Work is split into spans (a sequence and a run of its blocks): a span reads each key and value
// once, for every query head of its KV head (GQA), and keeps a partial softmax per query head
// (its max, its sum, its weighted sum of values) in float32; a second pass merges the spans of
// each sequence, as flash-decoding does. Long contexts of few sequences are cut into several
// spans so that every thread works at batch 1. For the common head sizes (64, 128) and group
// sizes the queries and accumulators are held in vector registers (span_fixed), and with AVX-512
// the lanes of sixteen keys' products are summed in one tree of shuffles (sum_lanes16). Scores and
// accumulations are float32 whatever the storage dtype, as SDPA does under a 16-bit model.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "float_vec.h"

namespace {

using kvledger_cpu::load_floats;
using kvledger_cpu::Vec;
constexpr int64_t kMaxGroup = 16;  // query heads per KV head this kernel takes

// One work item: keys and values [first_block, end_block) of one sequence's blocks, all heads.
struct Span {
  int64_t seq, first_block, end_block;
};

// Where one span reads and writes.
template <typename T>
struct SpanArgs {
  const T* q;            // the sequence's query rows, head stride q_head
  int64_t q_head;
  const T* k_pool;
  const T* v_pool;
  const int64_t* table;  // the sequence's block table
  int64_t t0, n;         // first position and number of positions
  int64_t block_size, token_stride, block_stride, kv_heads, group, dim;
  float scale;
  float* max;            // [H] per query head: max score, sum of exp, weighted values [H, dim]
  float* sum;
  float* acc;
  float* scores;         // scratch, [n] per query head of one KV head
};

// f(t, row) for the span's positions t = 0 .. n-1, row pointing at KV head kv_head of position
// t0 + t in pool: one table lookup per block (spans start on a block boundary).
template <typename T, typename F>
inline void for_each_row(const T* pool, const SpanArgs<T>& a, int64_t kv_head, F&& f) {
  for (int64_t t = 0; t < a.n;) {
    const T* r = pool + a.table[(a.t0 + t) / a.block_size] * a.block_stride + kv_head * a.dim;
    const int64_t end = std::min(a.n, t + a.block_size);
    for (; t < end; ++t, r += a.token_stride) f(t, r);
  }
}

// exp(scores - max) in place for one query head; returns (max, sum).
inline std::pair<float, float> softmax_numerators(float* s, int64_t n) {
  constexpr int64_t W = Vec::size();
  Vec mv(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + W <= n; t += W) mv = at::vec::maximum(mv, Vec::loadu(s + t));
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, mv);
  for (; t < n; ++t) m = std::max(m, s[t]);
  Vec total(0.f);
  const Vec mb(m);
  for (t = 0; t + W <= n; t += W) {
    const Vec e = (Vec::loadu(s + t) - mb).exp();
    e.store(s + t);
    total = total + e;
  }
  if (t < n) {
    const Vec e = (Vec::loadu(s + t, n - t) - mb).exp();
    e.store(s + t, n - t);
    total = total + Vec::set(Vec(0.f), e, n - t);
  }
  return {m, at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, total)};
}

#if defined(CPU_CAPABILITY_AVX512)
// The sums of the lanes of sixteen vectors at once: r[t] = sum(v[t]), t = 0 .. 15. A tree of
// shuffles and adds: about 50 instructions where sixteen separate reductions take about 130.
inline Vec sum_lanes16(const Vec* v) {
  __m512 w[8];  // w[i]: v[2i] in 128-bit chunks 0-1, v[2i+1] in 2-3 (each folded to 8 floats)
  for (int i = 0; i < 8; ++i) {
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  __m512 x[4];  // x[i]: chunk c holds v[4i + c] folded to 4 floats
  for (int i = 0; i < 4; ++i) {
    const __m512 a = w[2 * i], b = w[2 * i + 1];
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  const __m512 p = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
  const __m512 q = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
  // lane 4c + j now holds sum(v[4j + c]); put sum(v[t]) in lane t
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(p, q, 0x44), _mm512_shuffle_ps(p, q, 0xEE));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}
#endif

// Scores of one KV head's G query heads against the span's keys: scores[g * n + t].
template <typename T, int D, int G>
inline void span_scores(const SpanArgs<T>& a, int64_t j, const Vec (&qv)[G][D / Vec::size()]) {
  constexpr int64_t W = Vec::size();
  constexpr int C = D / W;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (W == 16) {  // sixteen keys' products, then their sums in one tree
    Vec dots[G][16];
    int64_t pending = 0, base = 0;
    const auto flush = [&]() {
      for (int g = 0; g < G; ++g) {
        for (int64_t p = pending; p < 16; ++p) dots[g][p] = Vec(0.f);
        sum_lanes16(dots[g]).store(a.scores + g * a.n + base, static_cast<int>(pending));
      }
      base += pending;
      pending = 0;
    };
    for_each_row(a.k_pool, a, j, [&](int64_t, const T* k) {
      Vec kx[C];
      for (int c = 0; c < C; ++c) kx[c] = load_floats(k + c * W);
      for (int g = 0; g < G; ++g) {
        Vec d = qv[g][0] * kx[0];
        for (int c = 1; c < C; ++c) d = at::vec::fmadd(qv[g][c], kx[c], d);
        dots[g][pending] = d;
      }
      if (++pending == 16) flush();
    });
    if (pending) flush();
    return;
  }
#endif
  for_each_row(a.k_pool, a, j, [&](int64_t t, const T* k) {
    Vec kx[C];
    for (int c = 0; c < C; ++c) kx[c] = load_floats(k + c * W);
    for (int g = 0; g < G; ++g) {
      Vec d = qv[g][0] * kx[0];
      for (int c = 1; c < C; ++c) d = at::vec::fmadd(qv[g][c], kx[c], d);
      a.scores[g * a.n + t] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, d);
    }
  });
}

// One span with the head size D and the query heads per KV head G known at compile time, so
// that the queries and the accumulators stay in vector registers.
template <typename T, int D, int G>
void span_fixed(const SpanArgs<T>& a) {
  constexpr int64_t W = Vec::size();
  constexpr int C = D / W;
  for (int64_t j = 0; j < a.kv_heads; ++j) {
    Vec qv[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) qv[g][c] = load_floats(a.q + (j * G + g) * a.q_head + c * W) * Vec(a.scale);
    span_scores<T, D, G>(a, j, qv);
    for (int g = 0; g < G; ++g) {
      auto [m, total] = softmax_numerators(a.scores + g * a.n, a.n);
      a.max[j * G + g] = m;
      a.sum[j * G + g] = total;
    }
    Vec acc[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] = Vec(0.f);
    for_each_row(a.v_pool, a, j, [&](int64_t t, const T* v) {
      for (int c = 0; c < C; ++c) {
        const Vec vx = load_floats(v + c * W);
        for (int g = 0; g < G; ++g) acc[g][c] = at::vec::fmadd(Vec(a.scores[g * a.n + t]), vx, acc[g][c]);
      }
    });
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) acc[g][c].store(a.acc + (j * G + g) * D + c * W);
  }
}

// The same for any head size and group (both multiples checked by the caller), from memory.
template <typename T>
void span_any(const SpanArgs<T>& a) {
  constexpr int64_t W = Vec::size();
  const int64_t G = a.group, D = a.dim;
  std::vector<float> qf(G * D);
  for (int64_t j = 0; j < a.kv_heads; ++j) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t x = 0; x < D; x += W) (load_floats(a.q + (j * G + g) * a.q_head + x) * Vec(a.scale)).store(qf.data() + g * D + x);
    for_each_row(a.k_pool, a, j, [&](int64_t t, const T* k) {
      for (int64_t g = 0; g < G; ++g) {
        Vec d(0.f);
        for (int64_t x = 0; x < D; x += W) d = at::vec::fmadd(Vec::loadu(qf.data() + g * D + x), load_floats(k + x), d);
        a.scores[g * a.n + t] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, d);
      }
    });
    for (int64_t g = 0; g < G; ++g) {
      auto [m, total] = softmax_numerators(a.scores + g * a.n, a.n);
      a.max[j * G + g] = m;
      a.sum[j * G + g] = total;
    }
    float* acc = a.acc + j * G * D;
    std::fill(acc, acc + G * D, 0.f);
    for_each_row(a.v_pool, a, j, [&](int64_t t, const T* v) {
      for (int64_t x = 0; x < D; x += W) {
        const Vec vx = load_floats(v + x);
        for (int64_t g = 0; g < G; ++g) {
          float* o = acc + g * D + x;
          at::vec::fmadd(Vec(a.scores[g * a.n + t]), vx, Vec::loadu(o)).store(o);
        }
      }
    });
  }
}

template <typename T>
using SpanFn = void (*)(const SpanArgs<T>&);

template <typename T, int D>
SpanFn<T> pick_group(int64_t group) {
  switch (group) {
    case 1: return span_fixed<T, D, 1>;
    case 2: return span_fixed<T, D, 2>;
    case 3: return span_fixed<T, D, 3>;
    case 4: return span_fixed<T, D, 4>;
    case 6: return span_fixed<T, D, 6>;
    case 8: return span_fixed<T, D, 8>;
    default: return span_any<T>;
  }
}

template <typename T>
SpanFn<T> pick(int64_t dim, int64_t group) {
  if (dim == 64 && 64 % Vec::size() == 0) return pick_group<T, 64>(group);
  if (dim == 128 && 128 % Vec::size() == 0) return pick_group<T, 128>(group);
  return span_any<T>;
}

template <typename T>
void decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale_) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_pool.size(1), kv_heads = k_pool.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const float scale = static_cast<float>(scale_);
  const int64_t q_seq = q.stride(0), q_head = q.stride(1);
  const int64_t o_seq = out.stride(0), o_head = out.stride(1);
  const int64_t token_stride = kv_heads * dim, block_stride = block_size * token_stride;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();

  // Spans: at least two work items per thread where the batch alone gives fewer, none
  // shorter than 256 tokens.
  const int64_t threads = at::get_num_threads();
  const int64_t min_span_blocks = std::max<int64_t>(1, 256 / block_size);
  std::vector<Span> spans;
  std::vector<int64_t> first_span(batch + 1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t blocks = (std::min<int64_t>(lens[b], max_blocks * block_size) + block_size - 1) / block_size;
    int64_t pieces = 1;
    if (batch < 2 * threads) {
      pieces = std::max<int64_t>(1, std::min((2 * threads + batch - 1) / batch, blocks / min_span_blocks));
    }
    const int64_t per = std::max<int64_t>(1, (blocks + pieces - 1) / pieces);
    first_span[b] = static_cast<int64_t>(spans.size());
    int64_t s = 0;
    do {  // one span at least, empty for an empty context
      spans.push_back({b, s, std::min(blocks, s + per)});
      s += per;
    } while (s < blocks);
  }
  first_span[batch] = static_cast<int64_t>(spans.size());
  const int64_t num_spans = static_cast<int64_t>(spans.size());
  const int64_t partial_size = heads * (dim + 2);  // per span: [H] max, [H] sum, [H, dim] acc
  std::vector<float> partial(num_spans * partial_size);

  const SpanFn<T> run_span = pick<T>(dim, group);
  at::parallel_for(0, num_spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const Span sp = spans[i];
      const int64_t t0 = sp.first_block * block_size;
      const int64_t n = std::max<int64_t>(0, std::min(lens[sp.seq], sp.end_block * block_size) - t0);
      float* mx = partial.data() + i * partial_size;
      scores.resize(std::max<int64_t>(1, group * n));
      const SpanArgs<T> args{qp + sp.seq * q_seq, q_head, kp, vp, tables + sp.seq * max_blocks, t0, n,
                             block_size, token_stride, block_stride, kv_heads, group, dim, scale,
                             mx, mx + heads, mx + 2 * heads, scores.data()};
      if (n == 0) {
        std::fill(mx, mx + partial_size, 0.f);  // an empty span: sum 0, merged as nothing
        continue;
      }
      run_span(args);
    }
  });

  // Merge the spans of each sequence into its output rows.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(dim);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t s = first_span[b]; s < first_span[b + 1]; ++s) m = std::max(m, partial[s * partial_size + h]);
        float total = 0.f;
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t s = first_span[b]; s < first_span[b + 1]; ++s) {
          const float* base = partial.data() + s * partial_size;
          if (base[heads + h] == 0.f) continue;  // an empty span
          const float w = std::exp(base[h] - m);
          total += w * base[heads + h];
          const float* a = base + 2 * heads + h * dim;
          for (int64_t x = 0; x < dim; ++x) merged[x] += w * a[x];
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        T* orow = op + b * o_seq + h * o_head;
        for (int64_t x = 0; x < dim; ++x) orow[x] = static_cast<T>(merged[x] * inv);
      }
    }
  });
}

void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_decode: q and out must be [B, H, d] alike");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(), "paged_decode: pools must be [blocks, block_size, H_kv, d]");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "paged_decode: pools must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_decode: the head dimension must be contiguous");
  TORCH_CHECK(q.size(2) == k_pool.size(3) && q.size(1) % k_pool.size(2) == 0, "paged_decode: head shapes disagree");
  TORCH_CHECK(q.size(2) % Vec::size() == 0, "paged_decode: head_dim must be a multiple of ", Vec::size());
  TORCH_CHECK(q.size(1) / k_pool.size(2) <= kMaxGroup, "paged_decode: at most ", kMaxGroup, " query heads per KV head");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == out.scalar_type()
                  && q.scalar_type() == v_pool.scalar_type(), "paged_decode: q, out and pools must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong
                  && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode: block_tables and context_lens must be contiguous int64");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "paged_decode: batch sizes disagree");
  if (q.scalar_type() == at::kFloat) {
    decode<float>(out, q, k_pool, v_pool, block_tables, context_lens, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode<c10::BFloat16>(out, q, k_pool, v_pool, block_tables, context_lens, scale);
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only, got ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(kvledger_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
        "Tensor context_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvledger_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
