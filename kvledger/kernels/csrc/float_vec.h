// What kvledger's CPU kernels share: float32 vectors of ATen's (16 lanes with AVX-512, 8 with
// AVX2), loading one vector's worth of float32 or bfloat16 values as float32, storing one as
// either, and rounding one as storing it to a dtype and loading it back would. The decode kernel
// also loads the 8-bit caches' elements: int8, and fp8 bytes (E4M3, E5M2) widened exactly. Built
// for AVX2 or AVX-512 only (library.h): a CPU without AVX2 runs torch's own operators.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include <type_traits>

namespace kvledger_cpu {

using Vec = at::vec::Vectorized<float>;

inline Vec load_floats(const float* p) { return Vec::loadu(p); }

inline Vec load_floats(const c10::BFloat16* p) {
  Vec v;
  at::vec::load_to_float(p, v);
  return v;
}

// One vector's worth of int8 values as float32.
inline Vec load_floats(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#endif
}

// fp8 bytes as stored in the cache's pool. Each byte becomes a float16 bit pattern with integer
// shifts (the same mapping as kvledger.layers.kv_quant.widen_fp8), then float32: E5M2 is the top
// byte of a float16 (same exponent bias); E4M3's exponent and mantissa go to the bottom of
// float16's fields, so the result is 2**-8 times the code's value (kFactor undoes it, folded into
// the scale). Both are exact for every finite code.
struct Fp8E4M3 {
  uint8_t bits;
  static constexpr float kFactor = 256.f;
  static uint16_t half_bits(uint16_t b) { return static_cast<uint16_t>(((b & 0x7F) << 7) | ((b & 0x80) << 8)); }
};
struct Fp8E5M2 {
  uint8_t bits;
  static constexpr float kFactor = 1.f;
  static uint16_t half_bits(uint16_t b) { return static_cast<uint16_t>(b << 8); }
};

template <typename F>
inline Vec load_fp8(const F* p) {
  static_assert(sizeof(F) == 1, "one byte per element");
  const auto* bytes = reinterpret_cast<const uint8_t*>(p);
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  __m256i h;
  if constexpr (std::is_same_v<F, Fp8E5M2>) {
    h = _mm256_slli_epi16(b, 8);
  } else {
    h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  }
  return Vec(_mm512_cvtph_ps(h));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  __m128i h;
  if constexpr (std::is_same_v<F, Fp8E5M2>) {
    h = _mm_slli_epi16(b, 8);
  } else {
    h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7),
                     _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  }
  return Vec(_mm256_cvtph_ps(h));
#endif
}

inline Vec load_floats(const Fp8E4M3* p) { return load_fp8(p); }
inline Vec load_floats(const Fp8E5M2* p) { return load_fp8(p); }

// n float16 values as float32 (the int8 cache's scales).
inline void halves_to_floats(const c10::Half* h, float* f, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec v;
    at::vec::load_to_float(h + i, v);
    v.store(f + i);
  }
  for (; i < n; ++i) f[i] = static_cast<float>(h[i]);
}

inline void store_floats(const Vec& v, float* p) { v.store(p); }

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// The bfloat16 bit patterns of v's lanes, rounded to nearest even as c10::BFloat16's own
// conversion does. The CPU's conversion instruction rounds the same way for every normal value
// and zero; it flushes subnormal inputs to zero and keeps NaN payloads, so a vector with such a
// lane (rare: the kernels' values are neither) takes ATen's conversion instead.
inline __m256i bf16_bits(const Vec& v) {
  const __m512 x = v;
  const __m512 magnitude = _mm512_abs_ps(x);
  const __mmask16 odd = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(1.17549435e-38f), _CMP_NGE_UQ)
                        & _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_UQ);
  if (odd == 0) return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  __m256i bits;
  at::vec::convert_from_float<c10::BFloat16>(v, v).store(&bits, Vec::size());
  return bits;
}
#endif

// Rounds to nearest even, as c10::BFloat16's own conversion does.
inline void store_floats(const Vec& v, c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(v));
#else
  at::vec::convert_from_float<c10::BFloat16>(v, v).store(p, Vec::size());
#endif
}

// v as it would be after a store to T and a load back: itself for float32, rounded for bfloat16.
template <typename T>
inline Vec round_as(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16)));
#else
    return std::get<0>(at::vec::convert_to_float<c10::BFloat16>(at::vec::convert_from_float<c10::BFloat16>(v, v)));
#endif
  }
}

}  // namespace kvledger_cpu
