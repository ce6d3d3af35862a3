// 16-float vectors for the CPU kernels: GCC/Clang vector extensions, plain C++ arithmetic on whole
// vectors lowered to the target's widest registers (-march=native; one AVX-512 register), with no
// intrinsics and no reliance on the auto-vectorizer (which left several `omp simd` reductions of
// these kernels as scalar chains).

#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

namespace redjax {

constexpr int64_t kLanes = 16;  // floats per vector
using f32xN = float __attribute__((vector_size(kLanes * 4)));
using i32xN = int32_t __attribute__((vector_size(kLanes * 4)));
using u32xN = uint32_t __attribute__((vector_size(kLanes * 4)));

inline f32xN load(const float* p) {
  f32xN v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, f32xN v) { std::memcpy(p, &v, sizeof v); }

// An empty asm that takes v as it is: -ffast-math cannot fold the arithmetic that made v into what
// follows (contract it into a fused multiply-add, reorder it). In a register where one holds 16
// floats (AVX-512); else through memory, as no register could
inline void keep_as_is(f32xN& v) {
#ifdef __AVX512F__
  asm("" : "+v"(v));
#else
  asm("" : "+m"(v));
#endif
}

// Non-finite floats and NaN by their bits (-ffast-math lets a compiler assume there are none)
constexpr uint32_t kExponentBits = 0x7f800000u;
inline bool not_finite(float x) { return (std::bit_cast<uint32_t>(x) & kExponentBits) == kExponentBits; }
inline bool is_nan(float x) { return (std::bit_cast<uint32_t>(x) & 0x7fffffffu) > kExponentBits; }

// max(floor, p[0], ..., p[n - 1]), 16 lanes at a time
inline float max_of(const float* p, int64_t n, float floor) {
  f32xN lanes = f32xN{} + floor;
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const f32xN v = load(p + t);
    lanes = lanes > v ? lanes : v;
  }
  float mx = floor;
  for (int l = 0; l < kLanes; ++l) mx = std::max(mx, lanes[l]);
  for (; t < n; ++t) mx = std::max(mx, p[t]);
  return mx;
}

// The n largest of p[0, v) (0 < n <= v), descending, at out: a sorted buffer of n, 16 values at a
// time compared with its smallest and skipped together when none is larger (almost every block
// once the buffer holds typical values), so about one pass for n small beside v
inline void largest_values(const float* p, int64_t v, int64_t n, float* out) {
  int64_t count = 0;
  const auto insert = [&](float x) {  // x beats the buffer's smallest, or the buffer is not full
    int64_t at = count < n ? count++ : n - 1;
    for (; at > 0 && out[at - 1] < x; --at) out[at] = out[at - 1];
    out[at] = x;
  };
  int64_t i = 0;
  for (; i < v && count < n; ++i) insert(p[i]);
  for (; i + kLanes <= v; i += kLanes) {
    const auto larger = load(p + i) > out[n - 1];
    bool any = false;
    for (int l = 0; l < kLanes; ++l) any |= larger[l] != 0;
    for (int l = 0; any && l < kLanes; ++l)  // in order; the buffer's smallest rises as values go in
      if (p[i + l] > out[n - 1]) insert(p[i + l]);
  }
  for (; i < v; ++i)
    if (p[i] > out[n - 1]) insert(p[i]);
}

// e^x lane by lane for x <= 88 (from -87.3 down it gives e^-87.3, about 1e-38): x = n ln 2 + r with
// |r| <= ln 2 / 2 (n rounded half away from zero), e^r by Cephes' degree-6 polynomial for expf
// (about 1 ulp), times 2^n built in the exponent bits. Plain vector arithmetic: any x86 target.
inline f32xN exp_lanes(f32xN x) {
  const f32xN zero = {};
  x = x < zero - 87.3f ? zero - 87.3f : x;
  x = x > zero + 88.0f ? zero + 88.0f : x;
  const f32xN t = x * 1.44269504089f;
  const i32xN n = __builtin_convertvector(t + (t < zero ? zero - 0.5f : zero + 0.5f), i32xN);
  const f32xN nf = __builtin_convertvector(n, f32xN);
  const f32xN r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;  // ln 2 in two parts
  f32xN p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32xN scale = (n + 127) << 23;  // the bits of 2^n, n in [-126, 127]
  return p * (f32xN)scale;  // a cast between vector types of one size keeps the bits
}

// p[t] = e^(p[t] - mx) for t in [from, to) and 0 elsewhere in [from rounded down, to rounded up to
// 16); -> the sum of p[from, to). Whole vectors only: no scalar remainder (the library's scalar
// expf for a row's last few keys took as long as its vector calls for the rest).
inline float exp_and_sum(float* p, int64_t from, int64_t to, float mx) {
  const i32xN lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const f32xN zero = {};
  f32xN sums = {};
  for (int64_t t = from / kLanes * kLanes; t < to; t += kLanes) {
    const i32xN at = lane + static_cast<int32_t>(t);
    const f32xN e = exp_lanes(load(p + t) - mx);
    const f32xN kept = at >= static_cast<int32_t>(from) && at < static_cast<int32_t>(to) ? e : zero;
    store(p + t, kept);
    sums += kept;
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += sums[l];
  return sum;
}

}  // namespace redjax
