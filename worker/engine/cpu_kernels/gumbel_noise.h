// Gumbel noise for sampled draws: a sampled row at temperature T takes the first largest of
// logit_j + T g_j over its tokens j (Gumbel-max: a draw from softmax(logits / T)), with
//   h = mix(mix(j * 0x9e3779b9 xor k0) xor k1),  u = (floor(h / 2^8) + 1/2) 2^-24 in (0, 1),
//   g_j = -ln(-ln u)
// from the row's key (k0, k1) (derived in JAX from its seed, choice and position: sampler.py).
// A token's noise depends on nothing else, so the sampler's draw over float32 logits (sampling.cc)
// and the screened heads (screened_argmax.cc) both call `gumbel_noise` below, compiled from this
// one source, and add it to the same float32 logits: the same bits, the same token. The jnp draw
// (sampler.gumbel_draw, accelerators) hashes alike and takes the library's logarithm, within an
// ulp or two of `log_lanes`.

#pragma once

#include <cstdint>

#include "vectors.h"

namespace redjax {

// A 32-bit integer hash (xor-shift, multiply: an avalanche of every input bit into every output bit)
inline u32xN mix32(u32xN x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  x ^= x >> 15;
  return x;
}

// ln x lane by lane for positive normal x: x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln(m) by
// Cephes' polynomial for logf (about 1 ulp), plus e ln 2 in two parts.
inline f32xN log_lanes(f32xN x) {
  const u32xN bits = (u32xN)x;  // a cast between vector types of one size keeps the bits
  i32xN e = (i32xN)(bits >> 23) - 126;
  const u32xN half = (bits & 0x007fffffu) | 0x3f000000u;  // the mantissa in [0.5, 1)
  f32xN m = (f32xN)half;
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
  f32xN y = p * m * z + ef * -2.12194440e-4f - 0.5f * z;
  return m + y + ef * 0.693359375f;
}

// out[j] = t g_j for j in [0, v rounded up to 16) of the row keyed (k0, k1). Not inlined (nor
// cloned): every caller runs this one compiled body, so the noise of a token is the same bits in
// every kernel whatever the code around the call.
__attribute__((noinline, noclone)) inline void gumbel_noise(uint32_t k0, uint32_t k1, float t, int64_t v,
                                                            float* out) {
  u32xN j;
  for (int l = 0; l < kLanes; ++l) j[l] = static_cast<uint32_t>(l);
  for (int64_t i = 0; i < v; i += kLanes, j += static_cast<uint32_t>(kLanes)) {
    const u32xN h = mix32(mix32((j * 0x9e3779b9u) ^ k0) ^ k1);
    const i32xN top = (i32xN)(h >> 8);  // 24 bits
    const f32xN u = (__builtin_convertvector(top, f32xN) + 0.5f) * 0x1p-24f;
    const f32xN g = -log_lanes(-log_lanes(u));
    store(out + i, g * t);
  }
}

}  // namespace redjax
