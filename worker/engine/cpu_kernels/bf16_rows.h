// Rounding float32 rows to bfloat16 pairs, the x operand of the bfloat16 products
// (panel_matmul.cc's VDPBF16PS tiles, amx_matmul.cc's AMX tiles): a row of K floats becomes
// ceil(K / 2) 32-bit words, k in the low half and k + 1 in the high half.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace redjax {

#ifdef __AVX512BF16__
// x rounded to bfloat16 as XLA rounds it (to nearest, ties to even; NaN stays NaN); the vector
// conversion below rounds the same way and flushes float32 denormals to zero
inline uint16_t bf16_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// rows f32[count, K] -> bfloat16 pairs [count, steps] (k in the low half; a zero past an odd K)
inline void round_rows_bf16(const float* rows, int64_t count, int64_t k, uint32_t* to) {
  const int64_t steps = (k + 1) / 2;
  for (int64_t r = 0; r < count; ++r) {
    const float* row = rows + r * k;
    uint16_t* out = reinterpret_cast<uint16_t*>(to + r * steps);
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + i + 16), _mm512_loadu_ps(row + i));
      _mm512_storeu_si512(out + i, reinterpret_cast<__m512i>(v));
    }
    for (; i < k; ++i) out[i] = bf16_bits(row[i]);
    if (k % 2) out[k] = 0;
  }
}
#endif

}  // namespace redjax
