// Decode attention over the paged KV cache, read in place: one query per sequence.
//
// kvledger_cpu::paged_decode(out, q, k_pool, v_pool, block_tables, context_lens, scale,
//                            k_scales=None, v_scales=None, k_scale=1.0, v_scale=1.0)
//   out, q        [B, H, d]       float32 or bfloat16, last dimension contiguous
//   k_pool/v_pool [num_blocks, block_size, H_kv, d]   contiguous: q's dtype, or an 8-bit cache's
//                 elements (int8, float8_e4m3fn, float8_e5m2)
//   block_tables  [B, max_blocks] int64 (rows padded past a sequence's last block)
//   context_lens  [B]             int64, tokens each query attends to (its own included)
//   k_scales/v_scales [num_blocks, block_size, H_kv] float16: the int8 cache's scale per token and
//                 KV head (required with int8 pools, refused otherwise)
//   k_scale/v_scale   the fp8 cache's scale per layer (1.0 otherwise)
//
// Work is split into spans (a sequence and a run of its blocks): a span reads each key and value
// once, for every query head (GQA: a KV head's row serves its G query heads), and keeps a partial
// softmax per query head (its max, its sum, its weighted sum of values) in float32; a second pass
// merges the spans of each sequence, as flash-decoding does. Long contexts of few sequences are cut
// into several spans so that every thread works at batch 1. For the common head sizes (64, 128)
// and group sizes (span_fixed) keys and values are read block by block and, in a block, position
// by position with all KV heads of a position together, so that each block is read from its start
// to its end as one run; with AVX-512 the lanes of sixteen keys' products are summed in one tree of
// shuffles (sum_lanes16). Scores and accumulations are float32 whatever the storage dtype, as SDPA
// does under a 16-bit model. While a block is read, the first lines of the next block of the
// table are asked for: the blocks lie anywhere in the pool.
//
// Measured (SmolLM2's 9 query and 3 KV heads of 64, 30 layers' pools of 2 GiB in huge pages,
// tables in random order, a 14 MB read between layers, 2 threads, slower AMD EPYC with AVX-512,
// float32, ms for the 30 layers): the read one KV head at a time (each head's rows short pieces a
// row apart) against position by position, 22 sequences of 340 tokens: blocks of 16 22.0 / 22.5,
// blocks of 128 21.1 / 15.7; 64 x 256 in blocks of 128 39.3 / 32.0. In blocks of 16 both run at
// about 15 GB/s, what torch's own index_select of 16-token blocks reads here (a contiguous copy:
// 28-33 GB/s); in blocks of 128 position by position reads at 22-24 GB/s. The next block's first
// kilobyte asked for or not: no difference measured in blocks of 128 (the first rows are asked for).
//
// 8-bit elements are widened to float32 as they are read and never dequantized into a copy; their
// scales go where they cost least, as in attention over the dequantized K/V:
//   score[t] = (scale * k_scale * q) . k[t] * k_scales[t]
//   out      = v_scale * sum_t softmax(score)[t] * v_scales[t] * v[t]
// a per-layer scale folded into the query and the output, a per-token one into the [n] scores and
// probabilities of each query head.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "float_vec.h"
#include "library.h"

namespace {

using kvledger_cpu::Fp8E4M3;
using kvledger_cpu::Fp8E5M2;
using kvledger_cpu::load_floats;
using kvledger_cpu::Vec;
constexpr int64_t kMaxGroup = 16;  // query heads per KV head this kernel takes
constexpr int64_t kPrefetchRows = 16;  // rows of the next block prefetched (a larger block streams)

// One work item: keys and values [first_block, end_block) of one sequence's blocks, all heads.
struct Span {
  int64_t seq, first_block, end_block;
};

// Where one span reads and writes; KV is the pool's element type.
template <typename KV>
struct SpanArgs {
  const float* q;        // the sequence's query rows [H, dim], float32
  float q_mul;           // scale * the per-layer k_scale (and the fp8 widening's factor)
  float v_mul;           // the per-layer v_scale (and the widening's factor)
  const KV* k_pool;
  const KV* v_pool;
  const c10::Half* k_scales;  // per token and KV head ([num_blocks, block_size, H_kv]), or null
  const c10::Half* v_scales;
  const int64_t* table;  // the sequence's block table
  int64_t t0, n;         // first position and number of positions
  int64_t block_size, token_stride, kv_heads, group, dim;
  float* max;            // [H] per query head: max score, sum of exp, weighted values [H, dim]
  float* sum;
  float* acc;
  float* scores;         // scratch, [n] per query head (span_any: those of one KV head)
  float* token_scales;   // scratch, [2n] (the scales as float32, and as stored)
  Vec* dots;             // scratch, 16 vectors per query head (span_fixed's sums of sixteen keys)
};

// f(p, t, end) for each block of the span in turn: p at offset `at` of the block's first position
// in a block pool of `token_stride` elements per position, [t, end) the span's positions in it (spans
// start on a block boundary: one table lookup per block). The next block's first rows are asked
// for while this block's are read: the blocks lie anywhere in the pool, and the hardware
// prefetcher needs a few rows of a block to find its run.
template <typename P, typename KV, typename F>
inline void for_each_block(const P* pool, const SpanArgs<KV>& a, int64_t at, int64_t token_stride, F&& f) {
  const int64_t block_stride = a.block_size * token_stride;
  for (int64_t t = 0; t < a.n;) {
    const P* p = pool + a.table[(a.t0 + t) / a.block_size] * block_stride + at;
    const int64_t end = std::min(a.n, t + a.block_size);
    if (end < a.n) {
      const char* next = reinterpret_cast<const char*>(pool + a.table[(a.t0 + end) / a.block_size] * block_stride + at);
      const int64_t rows = std::min<int64_t>(a.block_size, kPrefetchRows);
      for (int64_t r = 0; r < rows; ++r) __builtin_prefetch(next + r * token_stride * sizeof(P), 0, 3);
    }
    f(p, t, end);
    t = end;
  }
}

// f(t, p) for the span's positions t = 0 .. n-1, p pointing at offset `at` of position t0 + t.
template <typename P, typename KV, typename F>
inline void for_each_position(const P* pool, const SpanArgs<KV>& a, int64_t at, int64_t token_stride, F&& f) {
  for_each_block(pool, a, at, token_stride, [&](const P* p, int64_t t, int64_t end) {
    for (; t < end; ++t, p += token_stride) f(t, p);
  });
}

// f(t, row) with row the [dim] elements of KV head kv_head at the span's position t in a K or V pool.
template <typename KV, typename F>
inline void for_each_row(const KV* pool, const SpanArgs<KV>& a, int64_t kv_head, F&& f) {
  for_each_position(pool, a, kv_head * a.dim, a.token_stride, std::forward<F>(f));
}

// rows[g * n + t] *= scales[t] for the G rows of one KV head, scales[t] read for KV head kv_head of
// the span's positions from a per-token scale pool (null: nothing to do).
template <typename KV>
inline void scale_rows(const c10::Half* pool, const SpanArgs<KV>& a, int64_t kv_head, float* rows, int64_t rows_count) {
  if (pool == nullptr) return;
  float* s = a.token_scales;
  auto* h = reinterpret_cast<c10::Half*>(s + a.n);  // the scales as stored, then as float32 in s
  for_each_position(pool, a, kv_head, a.kv_heads, [&](int64_t t, const c10::Half* r) { h[t] = *r; });
  kvledger_cpu::halves_to_floats(h, s, a.n);
  constexpr int64_t W = Vec::size();
  for (int64_t g = 0; g < rows_count; ++g) {
    float* row = rows + g * a.n;
    int64_t t = 0;
    for (; t + W <= a.n; t += W) (Vec::loadu(row + t) * Vec::loadu(s + t)).store(row + t);
    for (; t < a.n; ++t) row[t] *= s[t];
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

// The products of KV head j's key in `row` (a position's keys, all KV heads) with its G query heads'
// rows of q ([H, D]), one vector each whose lanes sum to the score.
template <typename KV, int D, int G>
inline void head_products(const KV* row, const float* q, int64_t j, Vec (&d)[G]) {
  constexpr int64_t W = Vec::size();
  constexpr int C = D / W;
  Vec kx[C];
  for (int c = 0; c < C; ++c) kx[c] = load_floats(row + j * D + c * W);
  for (int g = 0; g < G; ++g) {
    const float* qh = q + (j * G + g) * D;
    Vec acc = Vec::loadu(qh) * kx[0];
    for (int c = 1; c < C; ++c) acc = at::vec::fmadd(Vec::loadu(qh + c * W), kx[c], acc);
    d[g] = acc;
  }
}

// Scores of all query heads against the span's keys, scores[h * n + t], read position by position:
// each key row (all KV heads) is one contiguous piece of its block, read once from start to end.
// q holds the scaled queries [H, D].
template <typename KV, int D, int G>
inline void span_scores(const SpanArgs<KV>& a, const float* q) {
  Vec* dots = a.dots;
  [[maybe_unused]] constexpr int64_t W = Vec::size();
  const int64_t heads = a.kv_heads * G;
  for_each_block(a.k_pool, a, 0, a.token_stride, [&](const KV* block, int64_t t0, int64_t end) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (W == 16) {  // sixteen keys' products per query head, then their sums in one tree
      const KV* row = block;
      for (int64_t base = t0; base < end; base += 16) {
        const int64_t count = std::min<int64_t>(16, end - base);
        for (int64_t p = 0; p < count; ++p, row += a.token_stride) {
          for (int64_t j = 0; j < a.kv_heads; ++j) {
            Vec d[G];
            head_products<KV, D, G>(row, q, j, d);
            for (int g = 0; g < G; ++g) dots[(j * G + g) * 16 + p] = d[g];
          }
        }
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t p = count; p < 16; ++p) dots[h * 16 + p] = Vec(0.f);
          sum_lanes16(dots + h * 16).store(a.scores + h * a.n + base, static_cast<int>(count));
        }
      }
      return;
    }
#endif
    const KV* row = block;
    for (int64_t t = t0; t < end; ++t, row += a.token_stride) {
      for (int64_t j = 0; j < a.kv_heads; ++j) {
        Vec d[G];
        head_products<KV, D, G>(row, q, j, d);
        for (int g = 0; g < G; ++g)
          a.scores[(j * G + g) * a.n + t] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, d[g]);
      }
    }
  });
}

// Softmax numerators of the G query heads of KV head j from their scores, rows [G, n] at scores
// (the per-token key scales applied first, the per-token value scales after: the sum is of the
// probabilities alone).
template <typename KV>
inline void span_softmax(const SpanArgs<KV>& a, int64_t j, int64_t G, float* scores) {
  scale_rows(a.k_scales, a, j, scores, G);
  for (int64_t g = 0; g < G; ++g) {
    auto [m, total] = softmax_numerators(scores + g * a.n, a.n);
    a.max[j * G + g] = m;
    a.sum[j * G + g] = total;
  }
  scale_rows(a.v_scales, a, j, scores, G);
}

// One span with the head size D and the query heads per KV head G known at compile time, so
// that the queries and the accumulators stay in vector registers. Keys and then values are read
// block by block, all KV heads of a block together: a block's rows are one contiguous run of the
// pool, where one KV head's rows alone are short pieces a row apart.
template <typename KV, int D, int G>
void span_fixed(const SpanArgs<KV>& a) {
  constexpr int64_t W = Vec::size();
  constexpr int C = D / W;
  const int64_t heads = a.kv_heads * G;
  float* q = a.acc;  // the scaled queries, [H, D], where the accumulators go once the scores are made
  for (int64_t x = 0; x < heads * D; x += W) (Vec::loadu(a.q + x) * Vec(a.q_mul)).store(q + x);
  span_scores<KV, D, G>(a, q);
  for (int64_t j = 0; j < a.kv_heads; ++j) span_softmax(a, j, G, a.scores + j * G * a.n);
  std::fill(a.acc, a.acc + heads * D, 0.f);
  for_each_block(a.v_pool, a, 0, a.token_stride, [&](const KV* block, int64_t t0, int64_t end) {
    const KV* row = block;
    for (int64_t t = t0; t < end; ++t, row += a.token_stride) {
      for (int64_t j = 0; j < a.kv_heads; ++j) {
        Vec vx[C];
        for (int c = 0; c < C; ++c) vx[c] = load_floats(row + j * D + c * W);
        for (int g = 0; g < G; ++g) {
          const Vec p(a.scores[(j * G + g) * a.n + t]);
          float* o = a.acc + (j * G + g) * D;
          for (int c = 0; c < C; ++c) at::vec::fmadd(p, vx[c], Vec::loadu(o + c * W)).store(o + c * W);
        }
      }
    }
  });
  for (int64_t x = 0; x < heads * D; x += W) (Vec::loadu(a.acc + x) * Vec(a.v_mul)).store(a.acc + x);
}

// The same for any head size and group (both multiples checked by the caller), from memory.
template <typename KV>
void span_any(const SpanArgs<KV>& a) {
  constexpr int64_t W = Vec::size();
  const int64_t G = a.group, D = a.dim;
  std::vector<float> qf(G * D);
  for (int64_t j = 0; j < a.kv_heads; ++j) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t x = 0; x < D; x += W) (Vec::loadu(a.q + (j * G + g) * D + x) * Vec(a.q_mul)).store(qf.data() + g * D + x);
    for_each_row(a.k_pool, a, j, [&](int64_t t, const KV* k) {
      for (int64_t g = 0; g < G; ++g) {
        Vec d(0.f);
        for (int64_t x = 0; x < D; x += W) d = at::vec::fmadd(Vec::loadu(qf.data() + g * D + x), load_floats(k + x), d);
        a.scores[g * a.n + t] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, d);
      }
    });
    span_softmax(a, j, G, a.scores);
    float* acc = a.acc + j * G * D;
    std::fill(acc, acc + G * D, 0.f);
    for_each_row(a.v_pool, a, j, [&](int64_t t, const KV* v) {
      for (int64_t x = 0; x < D; x += W) {
        const Vec vx = load_floats(v + x);
        for (int64_t g = 0; g < G; ++g) {
          float* o = acc + g * D + x;
          at::vec::fmadd(Vec(a.scores[g * a.n + t]), vx, Vec::loadu(o)).store(o);
        }
      }
    });
    for (int64_t x = 0; x < G * D; x += W) (Vec::loadu(acc + x) * Vec(a.v_mul)).store(acc + x);
  }
}

template <typename KV>
using SpanFn = void (*)(const SpanArgs<KV>&);

template <typename KV, int D>
SpanFn<KV> pick_group(int64_t group) {
  switch (group) {
    case 1: return span_fixed<KV, D, 1>;
    case 2: return span_fixed<KV, D, 2>;
    case 3: return span_fixed<KV, D, 3>;
    case 4: return span_fixed<KV, D, 4>;
    case 6: return span_fixed<KV, D, 6>;
    case 8: return span_fixed<KV, D, 8>;
    default: return span_any<KV>;
  }
}

template <typename KV>
SpanFn<KV> pick(int64_t dim, int64_t group) {
  if (dim == 64 && 64 % Vec::size() == 0) return pick_group<KV, 64>(group);
  if (dim == 128 && 128 % Vec::size() == 0) return pick_group<KV, 128>(group);
  return span_any<KV>;
}

// The factor a pool's widened elements are off by (kvledger_cpu::Fp8E4M3), 1 for the others.
template <typename KV>
constexpr float widening_factor() {
  if constexpr (std::is_same_v<KV, Fp8E4M3> || std::is_same_v<KV, Fp8E5M2>) {
    return KV::kFactor;
  } else {
    return 1.f;
  }
}

template <typename T, typename KV>
void decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
            const c10::Half* k_scales, const c10::Half* v_scales, double k_scale, double v_scale) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_pool.size(1), kv_heads = k_pool.size(2);
  const int64_t group = heads / kv_heads, max_blocks = block_tables.size(1);
  const float q_mul = static_cast<float>(scale * k_scale) * widening_factor<KV>();
  const float v_mul = static_cast<float>(v_scale) * widening_factor<KV>();
  const int64_t o_seq = out.stride(0), o_head = out.stride(1);
  const int64_t token_stride = kv_heads * dim;
  T* op = out.data_ptr<T>();
  const KV* kp = reinterpret_cast<const KV*>(k_pool.data_ptr());
  const KV* vp = reinterpret_cast<const KV*>(v_pool.data_ptr());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();

  const T* qp = q.data_ptr<T>();
  const int64_t q_seq = q.stride(0), q_head = q.stride(1);

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

  const SpanFn<KV> run_span = pick<KV>(dim, group);
  at::parallel_for(0, num_spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<Vec> dots(heads * 16);
    for (int64_t i = begin; i < end; ++i) {
      const Span sp = spans[i];
      const int64_t t0 = sp.first_block * block_size;
      const int64_t n = std::max<int64_t>(0, std::min(lens[sp.seq], sp.end_block * block_size) - t0);
      float* mx = partial.data() + i * partial_size;
      if (n == 0) {
        std::fill(mx, mx + partial_size, 0.f);  // an empty span: sum 0, merged as nothing
        continue;
      }
      scratch.resize(heads * dim + (heads + 2) * n);  // the query rows, scores, token scales
      float* qf = scratch.data();  // the sequence's queries as float32: spans read one type whatever T
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t x = 0; x < dim; x += Vec::size())
          load_floats(qp + sp.seq * q_seq + h * q_head + x).store(qf + h * dim + x);
      const SpanArgs<KV> args{qf, q_mul, v_mul, kp, vp, k_scales, v_scales, tables + sp.seq * max_blocks, t0, n,
                              block_size, token_stride, kv_heads, group, dim, mx, mx + heads, mx + 2 * heads,
                              qf + heads * dim, qf + heads * dim + heads * n, dots.data()};
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

// The pool's element type as a kernel type, then decode<T, KV>.
template <typename T>
void decode_pools(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                  const c10::Half* k_scales, const c10::Half* v_scales, double k_scale, double v_scale) {
  const auto run = [&](auto kv) {
    decode<T, decltype(kv)>(out, q, k_pool, v_pool, block_tables, context_lens, scale, k_scales, v_scales, k_scale, v_scale);
  };
  switch (k_pool.scalar_type()) {
    case at::kChar: return run(int8_t{});
    case at::kFloat8_e4m3fn: return run(Fp8E4M3{});
    case at::kFloat8_e5m2: return run(Fp8E5M2{});
    default: return run(T{});  // the compute dtype itself (checked by the caller)
  }
}

const c10::Half* token_scales(const std::optional<at::Tensor>& scales, const at::Tensor& pool, const char* name) {
  if (!scales.has_value()) return nullptr;
  TORCH_CHECK(scales->scalar_type() == at::kHalf && scales->is_contiguous() && scales->dim() == 3
                  && scales->size(0) == pool.size(0) && scales->size(1) == pool.size(1) && scales->size(2) == pool.size(2),
              "paged_decode: ", name, " must be contiguous float16 [num_blocks, block_size, H_kv] beside its pool");
  return scales->data_ptr<c10::Half>();
}

void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                  const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales,
                  double k_scale, double v_scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_decode: q and out must be [B, H, d] alike");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(), "paged_decode: pools must be [blocks, block_size, H_kv, d]");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "paged_decode: pools must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_decode: the head dimension must be contiguous");
  TORCH_CHECK(q.size(2) == k_pool.size(3) && q.size(1) % k_pool.size(2) == 0, "paged_decode: head shapes disagree");
  TORCH_CHECK(q.size(2) % Vec::size() == 0, "paged_decode: head_dim must be a multiple of ", Vec::size());
  TORCH_CHECK(q.size(1) / k_pool.size(2) <= kMaxGroup, "paged_decode: at most ", kMaxGroup, " query heads per KV head");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "paged_decode: q and out must share a dtype");
  const auto kv = k_pool.scalar_type();
  const bool eight_bit = kv == at::kChar || kv == at::kFloat8_e4m3fn || kv == at::kFloat8_e5m2;
  TORCH_CHECK(v_pool.scalar_type() == kv && (kv == q.scalar_type() || eight_bit),
              "paged_decode: the pools must share a dtype, q's or an 8-bit one (int8, float8_e4m3fn, float8_e5m2), got ", kv);
  TORCH_CHECK((kv == at::kChar) == k_scales.has_value() && k_scales.has_value() == v_scales.has_value(),
              "paged_decode: per-token k_scales and v_scales go with int8 pools, and only with them");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong
                  && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode: block_tables and context_lens must be contiguous int64");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "paged_decode: batch sizes disagree");
  const c10::Half* ks = token_scales(k_scales, k_pool, "k_scales");
  const c10::Half* vs = token_scales(v_scales, v_pool, "v_scales");
  kvledger_cpu::dispatch_float(q.scalar_type(), "paged_decode", [&](auto t) {
    decode_pools<decltype(t)>(out, q, k_pool, v_pool, block_tables, context_lens, scale, ks, vs, k_scale, v_scale);
  });
}

}  // namespace

KVLEDGER_IMPL(m) { m.impl("paged_decode", &paged_decode); }
