// 16-float vectors for the CPU kernels: GCC/Clang vector extensions, plain C++ arithmetic on whole
// vectors lowered to the target's widest registers (-march=native; one AVX-512 register), with no
// intrinsics and no reliance on the auto-vectorizer (which left several `omp simd` reductions of
// these kernels as scalar chains).

#pragma once

#include <algorithm>
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

}  // namespace redjax
