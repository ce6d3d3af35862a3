// Quantizing float32 rows to int8, the x operand of the int8 products (panel_matmul.cc's VPDPBUSD
// tiles, for the screened greedy head): a row of K floats becomes ceil(K / 4) 32-bit words of
// unsigned bytes, q_k + 128 for k .. k + 3 (low byte first; 128, a zero, past K), with
// q_k = round(x_k / s) in [-127, 127] and s = max_k |x_k| / 127.
//
// Beside each row go the numbers the screen's bound needs (screened_argmax.cc): s, and upper bounds
// on |x - s q|_2 (what quantizing x lost) and |s q|_2, over the real products s * q_k. A row with a
// value that is not finite gets s = +infinity, which voids the screen for that row.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vectors.h"

namespace redjax {

// max_k |x_k| over x f32[K], and whether every x_k is finite (16 lanes at a time where AVX-512 is:
// GCC leaves the scalar loop, with its `finite &=`, unvectorized)
inline float largest_magnitude(const float* x, int64_t k, bool& finite) {
  float most = 0.0f;
  finite = true;
  int64_t j = 0;
#ifdef __AVX512F__
  __m512 widest = _mm512_setzero_ps();
  __mmask16 odd = 0;  // lanes that met an infinity or NaN (all exponent bits set)
  const __m512i exponent = _mm512_set1_epi32(static_cast<int32_t>(kExponentBits));
  for (; j + 16 <= k; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    odd |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exponent), exponent);
    widest = _mm512_max_ps(widest, _mm512_abs_ps(v));
  }
  finite = odd == 0;
  most = _mm512_reduce_max_ps(widest);
#endif
  for (; j < k; ++j) {
    finite &= !not_finite(x[j]);
    most = std::max(most, std::fabs(x[j]));
  }
  return most;
}

// x f32[K] -> to u32[ceil(K / 4)], stats f32[3] = {s, |x - s q|_2, |s q|_2} (the norms rounded up)
inline void quantize_row_i8(const float* x, int64_t k, uint32_t* to, float* stats) {
  bool finite;
  const float most = largest_magnitude(x, k, finite);
  uint8_t* out = reinterpret_cast<uint8_t*>(to);
  const int64_t padded = (k + 3) / 4 * 4;
  if (!finite) {
    const float inf = std::bit_cast<float>(kExponentBits);
    stats[0] = stats[1] = stats[2] = inf;
    for (int64_t i = 0; i < padded; ++i) out[i] = 128;
    return;
  }
  const float s = most / 127.0f, inv = most > 0.0f ? 127.0f / most : 0.0f;
  double lost = 0.0, kept = 0.0;  // sums of squares, exact enough in double: rounded up below
  for (int64_t i = 0; i < k; ++i) {
    const float q = std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(x[i] * inv)));
    out[i] = static_cast<uint8_t>(static_cast<int32_t>(q) + 128);
    const double real = static_cast<double>(s) * q;  // exact: 24 bits times 8
    lost += (x[i] - real) * (x[i] - real);
    kept += real * real;
  }
  for (int64_t i = k; i < padded; ++i) out[i] = 128;
  // each sum of k squares in double is within (k + 1) 2^-53 of itself: 2^-30 of margin covers
  // k up to 2^22, and the float conversion is rounded up
  const auto up = [](double v) { return std::nextafter(static_cast<float>(std::sqrt(v) * (1.0 + 0x1p-30)), 3e38f); };
  stats[0] = s;
  stats[1] = up(lost);
  stats[2] = up(kept);
}

// a / b rounded once, as IEEE division: -ffast-math lets the compiler multiply by a reciprocal instead
inline float divide_exactly(float a, float b) {
  float r;
  asm("vdivss %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
  return r;
}

// The int8 projections' quantization (int8_linear.py's `quantize`, torchao's symmetric int8 to the
// bit): x f32[K] -> to u32[ceil(K / 4)] as above, q_k + 128 with q_k = round-half-even(x_k * (1 /
// s)) in [-128, 127] and s = max(max_k |x_k| / 127.5, FLT_EPSILON); returns s, or NaN for a row
// holding a value that is not finite (its products NaN)
inline float quantize_row_w8a8(const float* x, int64_t k, uint32_t* to) {
  bool finite;
  const float most = largest_magnitude(x, k, finite);
  uint8_t* out = reinterpret_cast<uint8_t*>(to);
  const int64_t padded = (k + 3) / 4 * 4;
  if (!finite) {
    for (int64_t i = 0; i < padded; ++i) out[i] = 128;
    return std::bit_cast<float>(0x7fc00000u);
  }
  const float s = std::max(divide_exactly(most, 127.5f), 0x1p-23f), inv = divide_exactly(1.0f, s);
  int64_t i = 0;
#ifdef __AVX512F__
  // 16 at a time (GCC left the scalar loop below unvectorized: a third of a prefill product's time
  // at N = 256); the same operations, so the same bytes
  const __m512 scale_by = _mm512_set1_ps(inv), low = _mm512_set1_ps(-128.0f), high = _mm512_set1_ps(127.0f);
  for (; i + 16 <= k; i += 16) {
    const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale_by),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, low), high)),
                                       _mm512_set1_epi32(128));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(q));
  }
#endif
  for (; i < k; ++i)
    out[i] = static_cast<uint8_t>(static_cast<int32_t>(std::fmin(127.0f, std::fmax(-128.0f, std::nearbyint(x[i] * inv)))) + 128);
  for (i = k; i < padded; ++i) out[i] = 128;
  return s;
}

}  // namespace redjax
