// Gumbel noise for sampled draws: a sampled row at temperature T takes the first largest of
// logit_j + T g_j over its tokens j (Gumbel-max: a draw from softmax(logits / T)), with
//   b = mix(mix(j * 0x9e3779b9 xor k0) xor k1) / 2^8,  u = (b + 1/2) 2^-24 in (0, 1),  g_j = -ln(-ln u)
// from the row's key (k0, k1) (derived in JAX from its seed, choice and position: sampler.py).
// A token's noise depends on nothing else. The sampler's draw over float32 logits (sampling.cc)
// and the screened heads (screened_argmax.cc) both take it from `noise_of` below, compiled from
// this one source, and add it to the same float32 logits: the same bits, the same token. The jnp
// draw (sampler.gumbel_draw, accelerators) hashes alike and takes the library's logarithm, within
// an ulp or two of `log_lanes`.
//
// Only the largest noisy logit matters, and g grows with b: 98.2 % of tokens have b below
// kLoudBits, so g < 4. The kernels compute the noise of the other 1.8 % (`loud_tokens`), take
// the largest of their noisy logits as a lower bound of the row's maximum, and compute the noise
// of a quiet token only where its logit plus T x kQuietG reaches that bound: a few tokens a row,
// where the noise of every token took 3.5 core-ms a step for 64 rows of 32000.

#pragma once

#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vectors.h"

namespace redjax {

constexpr uint32_t kLoudBits = 0xfb5a98;  // b >= kLoudBits: u above exp(-e^-4), g >= 4
constexpr float kQuietG = 4.001f;         // a quiet token's g: below 4 (computed within 1e-6)
constexpr float kLeastG = -2.86f;         // every token's g: at least -ln(-ln 2^-25) = -2.8524

// A 32-bit integer hash (xor-shift, multiply: an avalanche of every input bit into every output bit)
inline u32xN mix32(u32xN x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  x ^= x >> 15;
  return x;
}

// b of the 16 tokens j: integer arithmetic, so exact wherever it is inlined
inline u32xN noise_bits(u32xN j, uint32_t k0, uint32_t k1) { return mix32(mix32((j * 0x9e3779b9u) ^ k0) ^ k1) >> 8; }

// ln x lane by lane for positive normal x: x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln(m) by
// Cephes' polynomial for logf (about 1 ulp), plus e ln 2 in two parts.
inline f32xN log_lanes(f32xN x) {
  const u32xN bits = (u32xN)x;  // a cast between vector types of one size keeps the bits
  i32xN e = (i32xN)(bits >> 23) - 126;
  f32xN m = (f32xN)((bits & 0x007fffffu) | 0x3f000000u);  // the mantissa in [0.5, 1)
  const auto small = m < 0.707106781186547524f;
  e += small;  // a true lane compares as -1
  m = small ? m + m - 1.0f : m - 1.0f;
  const f32xN z = m * m;
  f32xN p = f32xN{} + 7.0376836292e-2f;
  p = p * m - 1.1514610310e-1f;
  p = p * m + 1.1676998740e-1f;
  p = p * m - 1.2420140846e-1f;
  p = p * m + 1.4249322787e-1f;
  p = p * m - 1.6668057665e-1f;
  p = p * m + 2.0000714765e-1f;
  p = p * m - 2.4999993993e-1f;
  p = p * m + 3.3333331174e-1f;
  const f32xN ef = __builtin_convertvector(e, f32xN);
  const f32xN y = p * m * z + ef * -2.12194440e-4f - 0.5f * z;
  return m + y + ef * 0.693359375f;
}

// t g for 16 tokens of bits b. Not inlined (nor cloned): every caller runs this one compiled body,
// so a token's noise is the same bits in every kernel whatever the code around the call.
__attribute__((noinline, noclone)) inline f32xN noise_lanes(u32xN b, float t) {
  const f32xN u = (__builtin_convertvector((i32xN)b, f32xN) + 0.5f) * 0x1p-24f;  // b < 2^24: exact
  return -log_lanes(-log_lanes(u)) * t;
}

// fl(x + n): a logit, or a bound of one, moved by noise n, as rounded whatever the compiler would
// fold (the empty asm keeps x as it is, so n cannot join the arithmetic that made it). Rounding is
// monotone: a logit in [lo, up] moves into [moved(lo, n), moved(up, n)], and below moved(up, m)
// for any noise n <= m. The draw kernel and the screens compare these values, so both use this.
inline float moved(float x, float n) {
  asm("" : "+x"(x));
  return x + n;
}

// out[i] = t g of token ids[i] for i < n (out holds n rounded up to 16)
inline void noise_of(uint32_t k0, uint32_t k1, float t, const int32_t* ids, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += kLanes) {
    u32xN j = {};
    for (int l = 0; l < kLanes && i + l < n; ++l) j[l] = static_cast<uint32_t>(ids[i + l]);
    store(out + i, noise_lanes(noise_bits(j, k0, k1), t));
  }
}

// Writes from + l for each true lane l of `mask` (a vector comparison's result), in order, at out;
// -> how many (out holds 16 more than any caller's total)
inline int64_t put_lanes(i32xN mask, int64_t from, int32_t* out) {
#ifdef __AVX512F__
  // without branches: the lanes' indices compressed in a register (its memory form is slow on Zen 4)
  const __mmask16 bits = _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask);
  const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(from)),
                                      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  _mm512_storeu_si512(out, _mm512_maskz_compress_epi32(bits, at));
  return __builtin_popcount(bits);
#else
  int64_t n = 0;
  for (int l = 0; l < kLanes; ++l)
    if (mask[l]) out[n++] = static_cast<int32_t>(from + l);
  return n;
#endif
}

// The tokens in [0, v) whose b reaches kLoudBits, in order, at out (room for v + 16); -> how many
inline int64_t loud_tokens(uint32_t k0, uint32_t k1, int64_t v, int32_t* out) {
  int64_t n = 0;
  u32xN j;
  for (int l = 0; l < kLanes; ++l) j[l] = static_cast<uint32_t>(l);
  for (int64_t i = 0; i < v; i += kLanes, j += static_cast<uint32_t>(kLanes))
    n += put_lanes(noise_bits(j, k0, k1) >= kLoudBits, i, out + n);
  while (n > 0 && out[n - 1] >= v) --n;  // lanes past v in the last vector
  return n;
}

// The union of two token lists a[0, na) and b[0, nb), each in order, in order and without repeats,
// at out (room for na + nb); -> how many
inline int64_t merge_tokens(const int32_t* a, int64_t na, const int32_t* b, int64_t nb, int32_t* out) {
  int64_t i = 0, k = 0, n = 0;
  while (i < na || k < nb) {
    const int32_t next = k == nb || (i < na && a[i] <= b[k]) ? a[i] : b[k];
    out[n++] = next;
    i += i < na && a[i] == next;
    k += k < nb && b[k] == next;
  }
  return n;
}

}  // namespace redjax
