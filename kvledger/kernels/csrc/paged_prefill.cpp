// Causal attention of a prefill chunk over the paged KV cache, read in place.
//
// kvledger_cpu::paged_prefill(out, q, k_pool, v_pool, block_table, num_computed, scale)
//   out, q        [n, H, d]   float32 or bfloat16, last dimension contiguous: the chunk's queries,
//                             at positions num_computed .. num_computed + n - 1
//   k_pool/v_pool [num_blocks, block_size, H_kv, d]   same dtype as q, contiguous; the chunk's
//                             own keys and values are already written
//   block_table   [blocks]    int64, the sequence's blocks from position 0
// Query i sees the keys at positions 0 .. num_computed + i (itself included).
//
// Flash attention on the CPU's vectors. For each KV head the context's keys are first copied
// into tiles of kTile (32) positions, transposed ([d][32] floats), and its values into rows of
// floats: one pass over the cache, in float32 whatever the storage. Work items are then (KV
// head, block of 16 query positions): the item's rows (16 positions x the query heads of that
// KV head, GQA) walk the key tiles up to their causal end, keeping a running max, sum and
// weighted sum of values per row (an online softmax), all in float32, as SDPA does under a
// 16-bit model. Scores are computed a few rows at a time in eight register accumulators, each
// key vector loaded once for those rows; the weighted sum keeps a few rows' accumulators in
// registers. Items are ordered so that the threads' shares of
// causal work are even (a late block of queries pairs with an early one).
//
// That is the path of bfloat16 on a CPU that does not multiply it (AVX2 alone). float32, and
// bfloat16 on a CPU with AMX or AVX512-BF16, take prefill_gemm (below): the same algorithm with
// its two products through oneDNN.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "float_vec.h"
#include "library.h"

namespace {

using kvledger_cpu::load_floats;
using kvledger_cpu::Vec;

constexpr int64_t kTile = 32;        // key positions per tile
constexpr int64_t kQueryBlock = 16;  // query positions per work item
constexpr size_t kKeptFloats = size_t{16} << 20;  // 64 MiB of packed context kept between calls
constexpr int64_t kW = Vec::size();
constexpr int64_t kTileVecs = kTile / kW;  // vectors per tile row (1 with AVX-512, 2 with AVX2)
static_assert(kTile % kW == 0 && 8 % kTileVecs == 0, "a key tile must be a whole number of vectors");

// Loops over register-held accumulators are unrolled whole, so that each accumulator is a register.
#define UNROLL _Pragma("GCC unroll 32")

// The context of one KV head, in float32: keys as tiles [tile][d][kTile], values as rows [t][d].
struct PackedKV {
  const float* kt;
  const float* v;
};

// Scores of kScoreRows query rows against one key tile, as eight named accumulators (a row's
// kTileVecs vectors each), so that the compiler keeps every one in a register: s[r][0..kTile).
constexpr int kScoreRows = 8 / kTileVecs;
template <int D>
inline void scores_block(const float* qs, const float* kt, float* s) {
  Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f), a4(0.f), a5(0.f), a6(0.f), a7(0.f);
  for (int x = 0; x < D; ++x) {
    const float* kx = kt + x * kTile;
#define KVLEDGER_ACC(n) a##n = at::vec::fmadd(Vec(qs[((n) / kTileVecs) * D + x]), Vec::loadu(kx + ((n) % kTileVecs) * kW), a##n)
    KVLEDGER_ACC(0); KVLEDGER_ACC(1); KVLEDGER_ACC(2); KVLEDGER_ACC(3);
    KVLEDGER_ACC(4); KVLEDGER_ACC(5); KVLEDGER_ACC(6); KVLEDGER_ACC(7);
#undef KVLEDGER_ACC
  }
#define KVLEDGER_STORE(n) a##n.store(s + ((n) / kTileVecs) * kTile + ((n) % kTileVecs) * kW)
  KVLEDGER_STORE(0); KVLEDGER_STORE(1); KVLEDGER_STORE(2); KVLEDGER_STORE(3);
  KVLEDGER_STORE(4); KVLEDGER_STORE(5); KVLEDGER_STORE(6); KVLEDGER_STORE(7);
#undef KVLEDGER_STORE
}

// Scores of one query row against one key tile ([D][kTile]): s[0..kTile).
template <int D>
inline void scores1(const float* qs, const float* kt, float* s) {
  for (int c = 0; c < kTileVecs; ++c) {
    Vec a(0.f);
    for (int x = 0; x < D; ++x) a = at::vec::fmadd(Vec(qs[x]), Vec::loadu(kt + x * kTile + c * kW), a);
    a.store(s + c * kW);
  }
}

// Scores of `rows` query rows ([rows][D]) against key tile `kt` ([D][kTile]): s[r][0..kTile).
template <int D>
inline void tile_scores(const float* qs, int64_t rows, const float* kt, float* s) {
  int64_t r = 0;
  for (; r + kScoreRows <= rows; r += kScoreRows) scores_block<D>(qs + r * D, kt, s + r * kTile);
  for (; r < rows; ++r) scores1<D>(qs + r * D, kt, s + r * kTile);
}

// o[r] += sum_k p[r][k] * v[k] for `rows` rows, over the `keys` value rows v ([keys][D]).
template <int D>
inline void tile_values(const float* p, int64_t rows, const float* v, int64_t keys, float* o) {
  constexpr int C = D / kW;
  constexpr int RB = C >= 24 ? 1 : 24 / C;  // rows whose accumulators fit in registers
  int64_t r = 0;
  for (; r < rows; r += RB) {
    const int n = static_cast<int>(std::min<int64_t>(RB, rows - r));
    if (n == RB) {
      Vec acc[RB][C];
      UNROLL for (int i = 0; i < RB; ++i)
        UNROLL for (int c = 0; c < C; ++c) acc[i][c] = Vec::loadu(o + (r + i) * D + c * kW);
      for (int64_t k = 0; k < keys; ++k) {
        const float* vr = v + k * D;
        UNROLL for (int c = 0; c < C; ++c) {
          const Vec vx = Vec::loadu(vr + c * kW);
          UNROLL for (int i = 0; i < RB; ++i) acc[i][c] = at::vec::fmadd(Vec(p[(r + i) * kTile + k]), vx, acc[i][c]);
        }
      }
      UNROLL for (int i = 0; i < RB; ++i)
        UNROLL for (int c = 0; c < C; ++c) acc[i][c].store(o + (r + i) * D + c * kW);
      continue;
    }
    for (int i = 0; i < n; ++i) {  // the rows left over, one at a time
      Vec acc[C];
      UNROLL for (int c = 0; c < C; ++c) acc[c] = Vec::loadu(o + (r + i) * D + c * kW);
      for (int64_t k = 0; k < keys; ++k) {
        const Vec pk(p[(r + i) * kTile + k]);
        UNROLL for (int c = 0; c < C; ++c) acc[c] = at::vec::fmadd(pk, Vec::loadu(v + k * D + c * kW), acc[c]);
      }
      UNROLL for (int c = 0; c < C; ++c) acc[c].store(o + (r + i) * D + c * kW);
    }
  }
}

// One work item: query positions [i0, i1) of the chunk, all query heads of KV head j.
template <typename T, int D>
void query_block(const T* q, int64_t q_pos_stride, int64_t q_head_stride, T* out, int64_t o_pos_stride,
                 int64_t o_head_stride, const PackedKV& kv, int64_t j, int64_t group, int64_t i0, int64_t i1,
                 int64_t num_computed, float scale, std::vector<float>& scratch) {
  const int64_t positions = i1 - i0, rows = positions * group;  // row = (position, head in group)
  scratch.resize(rows * (2 * D + 2 * kTile + 2));
  float* qs = scratch.data();         // [rows][D] scaled queries
  float* o = qs + rows * D;           // [rows][D] weighted sums of values
  float* s = o + rows * D;            // [rows][kTile] scores, then probabilities
  float* m = s + rows * kTile;        // [rows] running max
  float* l = m + rows;                // [rows] running sum
  const Vec sv(scale);
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = q + (i0 + i) * q_pos_stride + (j * group + g) * q_head_stride;
      float* dst = qs + (i * group + g) * D;
      for (int x = 0; x < D; x += kW) (load_floats(src + x) * sv).store(dst + x);
    }
  std::fill(o, o + rows * D, 0.f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.f);

  const int64_t first_pos = num_computed + i0, last_pos = num_computed + i1 - 1;
  const int64_t tiles = last_pos / kTile + 1;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t k0 = t * kTile;
    tile_scores<D>(qs, rows, kv.kt + t * D * kTile, s);
    if (k0 + kTile - 1 > first_pos) {  // the tile reaches past some row's own position: mask
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = first_pos + r / group;
        for (int64_t k = std::max<int64_t>(0, pos + 1 - k0); k < kTile; ++k)
          s[r * kTile + k] = -std::numeric_limits<float>::infinity();
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * kTile;
      Vec mv = Vec::loadu(sr);
      for (int c = 1; c < kTileVecs; ++c) mv = at::vec::maximum(mv, Vec::loadu(sr + c * kW));
      const float tile_max = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, mv);
      const float m_new = std::max(m[r], tile_max);  // finite: tile 0 holds key 0, seen by every row
      const Vec mb(m_new);
      Vec sum(0.f);
      for (int c = 0; c < kTileVecs; ++c) {
        const Vec e = (Vec::loadu(sr + c * kW) - mb).exp_u20();
        e.store(sr + c * kW);
        sum = sum + e;
      }
      const float tile_sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
      if (m_new != m[r]) {
        const float alpha = std::exp(m[r] - m_new);  // 0 on the first tile (m = -inf)
        const Vec av(alpha);
        float* orow = o + r * D;
        for (int x = 0; x < D; x += kW) (Vec::loadu(orow + x) * av).store(orow + x);
        l[r] *= alpha;
        m[r] = m_new;
      }
      l[r] += tile_sum;
    }
    const int64_t keys = std::min<int64_t>(kTile, last_pos + 1 - k0);  // masked keys past it add 0
    tile_values<D>(s, rows, kv.v + k0 * D, keys, o);
  }
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      const Vec inv(1.f / l[r]);
      T* dst = out + (i0 + i) * o_pos_stride + (j * group + g) * o_head_stride;
      for (int x = 0; x < D; x += kW) {
        const Vec y = Vec::loadu(o + r * D + x) * inv;
        if constexpr (std::is_same_v<T, float>) {
          y.store(dst + x);
        } else {
          float tmp[kW];
          y.store(tmp);
          for (int64_t e = 0; e < kW; ++e) dst[x + e] = static_cast<T>(tmp[e]);
        }
      }
    }
}

template <typename T, int D>
void prefill(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
             const at::Tensor& block_table, int64_t num_computed, double scale_) {
  const int64_t n = q.size(0), heads = q.size(1);
  const int64_t block_size = k_pool.size(1), kv_heads = k_pool.size(2), group = heads / kv_heads;
  const int64_t ctx = num_computed + n, tiles = (ctx + kTile - 1) / kTile;
  const int64_t token_stride = kv_heads * D, block_stride = block_size * token_stride;
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const float scale = static_cast<float>(scale_);

  // The context of every KV head in float32: keys transposed in tiles, values as rows. Positions
  // past the end of the last tile are zeros (their scores are masked).
  const int64_t head_k = tiles * D * kTile, head_v = tiles * kTile * D;
  // Reused from call to call (no fresh pages to fault in for every layer), up to kKeptFloats:
  // the copy of a longer context is freed after its call.
  thread_local std::vector<float> packed;
  packed.resize(kv_heads * (head_k + head_v));
  struct FreeIfLong {
    std::vector<float>& v;
    ~FreeIfLong() { if (v.capacity() > kKeptFloats) std::vector<float>().swap(v); }
  } free_if_long{packed};
  float* kt_all = packed.data();
  float* v_all = kt_all + kv_heads * head_k;
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t j = item / tiles, t = item % tiles;
      float* kt = kt_all + j * head_k + t * D * kTile;
      float* vrows = v_all + j * head_v + t * kTile * D;
      for (int64_t k = 0; k < kTile; ++k) {
        const int64_t p = t * kTile + k;
        if (p >= ctx) {
          for (int x = 0; x < D; ++x) kt[x * kTile + k] = 0.f;
          std::fill(vrows + k * D, vrows + (k + 1) * D, 0.f);
          continue;
        }
        const int64_t slot = table[p / block_size] * block_stride + (p % block_size) * token_stride + j * D;
        float row[D];
        for (int x = 0; x < D; x += kW) load_floats(kp + slot + x).store(row + x);
        for (int x = 0; x < D; ++x) kt[x * kTile + k] = row[x];
        for (int x = 0; x < D; x += kW) load_floats(vp + slot + x).store(vrows + k * D + x);
      }
    }
  });

  // Work items (KV head, query block), late blocks paired with early ones for even shares.
  const int64_t qblocks = (n + kQueryBlock - 1) / kQueryBlock;
  std::vector<int64_t> order(qblocks);
  for (int64_t b = 0, lo = 0, hi = qblocks - 1; b < qblocks; ++b) order[b] = (b % 2 == 0) ? hi-- : lo++;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, qblocks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = order[item / kv_heads], j = item % kv_heads;
      const int64_t i0 = b * kQueryBlock, i1 = std::min(n, i0 + kQueryBlock);
      const PackedKV kv{kt_all + j * head_k, v_all + j * head_v};
      query_block<T, D>(qp, q.stride(0), q.stride(1), op, out.stride(0), out.stride(1), kv, j, group, i0, i1,
                        num_computed, scale, scratch);
    }
  });
}


// ---- float32, and bfloat16 on a CPU that multiplies it (AMX, AVX512-BF16): the products through oneDNN ----
//
// The same flash attention, with the two products of each step through ATen's batch-reduce GEMM
// (at::native::cpublas::brgemm, oneDNN's micro-kernels; torch's flash SDPA uses it too):
// scores = Q K^T (float32 out), then O += P V, in float32, or with bfloat16 operands (on the
// matrix unit, or the AVX512-BF16 dot products) and the probabilities rounded to bfloat16 (as
// SDPA does under a bfloat16 model).
// The online softmax stays in float32 on the vectors. The context of each KV head is copied once
// into chunks of kGemmChunk positions (keys transposed; for bfloat16 in the VNNI layout both
// take, pairs of rows interleaved); the queries of a work item (kGemmQueryBlock positions x the query
// heads of one KV head) are copied into one [rows][d] block, so that every key chunk is
// multiplied once for the whole group. Where a chunk reaches the item's own positions (the causal
// edge), its rows are multiplied kGemmSplit positions at a time, each group only as far as its
// last position sees (at 512 tokens: 6% more than the causal product's FLOPs instead of 12%).

constexpr int64_t kGemmQueryBlock = 64;  // query positions per work item
constexpr int64_t kGemmChunk = 256;      // key positions per packed chunk (fewer for a shorter context)
constexpr int64_t kGemmCols = 32;        // a chunk's scores are computed in multiples of this many keys
constexpr int64_t kGemmSplit = 32;       // query positions per product where the causal edge crosses a chunk

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <typename BF, int D>
void prefill_gemm(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& block_table, int64_t num_computed, double scale_) {
  constexpr bool kVnni = std::is_same_v<BF, c10::BFloat16>;
  namespace blas = at::native::cpublas;
  const int64_t n = q.size(0), heads = q.size(1);
  const int64_t block_size = k_pool.size(1), kv_heads = k_pool.size(2), group = heads / kv_heads;
  const int64_t ctx = num_computed + n, KC = std::min(kGemmChunk, round_up(ctx, kGemmCols));
  const int64_t chunks = (ctx + KC - 1) / KC;
  const int64_t token_stride = kv_heads * D, block_stride = block_size * token_stride;
  const BF* kp = k_pool.data_ptr<BF>();
  const BF* vp = v_pool.data_ptr<BF>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const float scale = static_cast<float>(scale_);

  // Per KV head and chunk: K^T [D][KC] and V [KC][D], each packed; positions past ctx are zeros.
  const int64_t chunk_elems = 2 * D * KC, head_elems = chunks * chunk_elems;
  thread_local std::vector<BF> packed;
  packed.resize(kv_heads * head_elems);
  struct FreeIfLong {
    std::vector<BF>& v;
    ~FreeIfLong() { if (v.capacity() > 2 * kKeptFloats) std::vector<BF>().swap(v); }
  } free_if_long{packed};
  BF* packed_all = packed.data();
  // bfloat16 in the VNNI layout (the matrix unit's, and the dot products'): element (k, n) of a [K][N] operand at
  // ((k / 2) * N + n) * 2 + k % 2, so that each 32-bit word holds two consecutive k of one n.
  // K^T of a chunk: word (x / 2, k) is the pair of dims (x, x + 1) of key k, one word of its row;
  // V of a chunk: word (k / 2, x) is dim x of keys k and k + 1. float32 as plain rows.
  at::parallel_for(0, kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t j = item / chunks, c = item % chunks;
      BF* kt = packed_all + j * head_elems + c * chunk_elems;
      BF* vv = kt + D * KC;
      if constexpr (kVnni) {
        for (int64_t k = 0; k < KC; ++k) {
          const int64_t p = c * KC + k;
          const bool past = p >= ctx;  // zeros past the context
          const int64_t slot = past ? 0 : table[p / block_size] * block_stride + (p % block_size) * token_stride + j * D;
          auto* kt_words = reinterpret_cast<uint32_t*>(kt);
          const auto* key_words = reinterpret_cast<const uint32_t*>(kp + slot);
          for (int x = 0; x < D / 2; ++x) kt_words[x * KC + k] = past ? 0 : key_words[x];
          BF* dst = vv + (k / 2) * 2 * D + k % 2;
          for (int x = 0; x < D; ++x) dst[2 * x] = past ? BF(0.f) : vp[slot + x];
        }
      } else {
        // The chunk's positions come in runs that lie in one block (rows token_stride apart): each
        // run's keys are transposed as one [run][D] -> [D][run] tile, its values copied row by row.
        for (int64_t k = 0; k < KC;) {
          const int64_t p = c * KC + k;
          if (p >= ctx) {  // zeros past the context
            for (int x = 0; x < D; ++x) std::fill(kt + x * KC + k, kt + (x + 1) * KC, 0.f);
            std::fill(vv + k * D, vv + KC * D, 0.f);
            break;
          }
          const int64_t run = std::min({block_size - p % block_size, ctx - p, KC - k});
          const int64_t slot = table[p / block_size] * block_stride + (p % block_size) * token_stride + j * D;
          at::vec::transpose_mxn<float>(kp + slot, token_stride, kt + k, KC, static_cast<int>(run), D);
          for (int64_t r = 0; r < run; ++r)
            std::memcpy(vv + (k + r) * D, vp + slot + r * token_stride, D * sizeof(float));
          k += run;
        }
      }
    }
  });

  const int64_t qblocks = (n + kGemmQueryBlock - 1) / kGemmQueryBlock;
  std::vector<int64_t> order(qblocks);
  for (int64_t b = 0, lo = 0, hi = qblocks - 1; b < qblocks; ++b) order[b] = (b % 2 == 0) ? hi-- : lo++;
  const BF* qp = q.data_ptr<BF>();
  BF* op = out.data_ptr<BF>();
  const int64_t q_pos_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t o_pos_stride = out.stride(0), o_head_stride = out.stride(1);
  at::parallel_for(0, qblocks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = kGemmQueryBlock * group;
    std::vector<BF> qs(max_rows * D), probs(max_rows * KC);
    std::vector<float> s(max_rows * KC), o(max_rows * D), m(max_rows), l(max_rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = order[item / kv_heads], j = item % kv_heads;
      const int64_t i0 = b * kGemmQueryBlock, i1 = std::min(n, i0 + kGemmQueryBlock);
      const int64_t rows = (i1 - i0) * group;  // row = (position, head in group)
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const BF* src = qp + i * q_pos_stride + (j * group + g) * q_head_stride;
          std::copy(src, src + D, qs.begin() + ((i - i0) * group + g) * D);
        }
      std::fill(o.begin(), o.begin() + rows * D, 0.f);
      std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows, 0.f);
      const int64_t first_pos = num_computed + i0, last_pos = num_computed + i1 - 1;
      const BF* head = packed_all + j * head_elems;
      for (int64_t c = 0; c * KC <= last_pos; ++c) {
        const int64_t k0 = c * KC;
        const BF* chunk = head + c * chunk_elems;
        // A chunk that reaches the item's own positions is multiplied by groups of kGemmSplit
        // positions, each only as far as its last position sees; an earlier chunk by all rows at once.
        const int64_t split = k0 + KC > first_pos ? kGemmSplit : i1 - i0;
        for (int64_t g0 = 0; g0 < i1 - i0; g0 += split) {
          const int64_t g1 = std::min(i1 - i0, g0 + split), keys = std::min<int64_t>(KC, first_pos + g1 - k0);
          if (keys <= 0) continue;  // the chunk lies past these positions
          const int64_t cols = std::min<int64_t>(KC, round_up(keys, kGemmCols)), r0 = g0 * group, r1 = g1 * group;
          blas::brgemm(r1 - r0, cols, D, D, KC, KC, false, qs.data() + r0 * D, chunk, s.data() + r0 * KC, kVnni);
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t pos = first_pos + r / group;
            const int64_t valid = std::min<int64_t>(cols, std::max<int64_t>(0, pos + 1 - k0));  // keys this row sees
            float* sr = s.data() + r * KC;
            BF* pr = probs.data() + r * KC;
            if (valid == 0) {  // the whole chunk lies past this row's position
              std::fill(pr, pr + cols, BF(0.f));
              continue;
            }
            // Whole vectors, then the last part-vector with the lanes past `valid` at -inf (exp: 0).
            const int64_t whole = valid / kW * kW, rest = valid - whole;
            const Vec neg_inf(-std::numeric_limits<float>::infinity());
            Vec mv = neg_inf;
            for (int64_t k = 0; k < whole; k += kW) mv = at::vec::maximum(mv, Vec::loadu(sr + k));
            const Vec last = rest ? Vec::set(neg_inf, Vec::loadu(sr + whole, rest), rest) : neg_inf;
            mv = at::vec::maximum(mv, last);
            const float tile_max = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, mv);
            const float m_new = std::max(m[r], tile_max * scale);
            const Vec sv(scale), mb(m_new);
            Vec sum(0.f);
            for (int64_t k = 0; k < whole; k += kW) {
              const Vec e = (Vec::loadu(sr + k) * sv - mb).exp_u20();
              sum = sum + e;
              kvledger_cpu::store_floats(e, pr + k);
            }
            if (rest) {
              const Vec e = (last * sv - mb).exp_u20();  // -inf lanes give 0
              sum = sum + e;
              kvledger_cpu::store_floats(e, pr + whole);
            }
            std::fill(pr + whole + (rest ? kW : 0), pr + cols, BF(0.f));
            const float tile_sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
            if (m_new != m[r]) {
              const float alpha = std::exp(m[r] - m_new);  // 0 on the first chunk (m = -inf)
              const Vec av(alpha);
              float* orow = o.data() + r * D;
              for (int x = 0; x < D; x += kW) (Vec::loadu(orow + x) * av).store(orow + x);
              l[r] *= alpha;
              m[r] = m_new;
            }
            l[r] += tile_sum;
          }
          blas::brgemm(r1 - r0, D, cols, KC, D, D, true, probs.data() + r0 * KC, chunk + D * KC, o.data() + r0 * D,
                       kVnni);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r / group, g = r % group;
        const Vec inv(1.f / l[r]);
        BF* dst = op + i * o_pos_stride + (j * group + g) * o_head_stride;
        for (int x = 0; x < D; x += kW) kvledger_cpu::store_floats(Vec::loadu(o.data() + r * D + x) * inv, dst + x);
      }
    }
    blas::brgemm_release(kVnni);
  });
}

// True when oneDNN's batch-reduce GEMM multiplies bfloat16 on this CPU: on its matrix unit (AMX,
// where ATen packs for it) or with the AVX512-BF16 dot products (AMD Zen 4, Intel Cooper Lake).
bool bfloat16_products() {
  static const bool yes = [] {
    if (at::native::cpublas::could_pack(at::kBFloat16)) return true;
    const auto caps = at::cpu::get_cpu_capabilities();
    const auto bf16 = caps.find("avx512_bf16");
    return bf16 != caps.end() && bf16->second.isBool() && bf16->second.toBool();
  }();
  return yes;
}

template <typename T>
void prefill_dim(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                 const at::Tensor& block_table, int64_t num_computed, double scale) {
  // float32 always through the GEMM; bfloat16 where the CPU multiplies it (AMX, AVX512-BF16)
  if (std::is_same_v<T, float> || bfloat16_products()) {
    switch (q.size(2)) {
      case 64: return prefill_gemm<T, 64>(out, q, k_pool, v_pool, block_table, num_computed, scale);
      case 128: return prefill_gemm<T, 128>(out, q, k_pool, v_pool, block_table, num_computed, scale);
      case 256: return prefill_gemm<T, 256>(out, q, k_pool, v_pool, block_table, num_computed, scale);
      default: break;
    }
  }
  if constexpr (!std::is_same_v<T, float>) {  // bfloat16 on the vectors
    switch (q.size(2)) {
      case 64: return prefill<T, 64>(out, q, k_pool, v_pool, block_table, num_computed, scale);
      case 128: return prefill<T, 128>(out, q, k_pool, v_pool, block_table, num_computed, scale);
      case 256: return prefill<T, 256>(out, q, k_pool, v_pool, block_table, num_computed, scale);
      default: break;
    }
  }
  TORCH_CHECK(false, "paged_prefill: head_dim 64, 128 or 256 only, got ", q.size(2));
}

void paged_prefill(at::Tensor out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                   const at::Tensor& block_table, int64_t num_computed, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_prefill: q and out must be [n, H, d] alike");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(), "paged_prefill: pools must be [blocks, block_size, H_kv, d]");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "paged_prefill: pools must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_prefill: the head dimension must be contiguous");
  TORCH_CHECK(q.size(2) == k_pool.size(3) && q.size(1) % k_pool.size(2) == 0, "paged_prefill: head shapes disagree");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == out.scalar_type()
                  && q.scalar_type() == v_pool.scalar_type(), "paged_prefill: q, out and pools must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous(),
              "paged_prefill: block_table must be contiguous int64");
  TORCH_CHECK(num_computed >= 0, "paged_prefill: num_computed must be >= 0");
  TORCH_CHECK(block_table.numel() * k_pool.size(1) >= num_computed + q.size(0),
              "paged_prefill: block_table covers fewer positions than the context");
  if (q.size(0) == 0) return;
  kvledger_cpu::dispatch_float(q.scalar_type(), "paged_prefill", [&](auto t) {
    prefill_dim<decltype(t)>(out, q, k_pool, v_pool, block_table, num_computed, scale);
  });
}

}  // namespace

KVLEDGER_IMPL(m) { m.impl("paged_prefill", &paged_prefill); }
