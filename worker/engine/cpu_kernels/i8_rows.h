// Quantizing float32 rows to int8, the x operand of the int8 products (panel_matmul.cc's VPDPBUSD
// tiles, for the screened greedy head): a row of K floats becomes ceil(K / 4) 32-bit words of
// unsigned bytes, q_k + 128 for k .. k + 3 (low byte first; 128, a zero, past K), with
// q_k = round(x_k / s) in [-127, 127] and s = max_k |x_k| / 127.
//
// Beside each row go the numbers the screen's bound needs (screened_argmax.cc): s, and upper bounds
// on |x - s q|_2 (what quantizing x lost) and |s q|_2, over the real products s * q_k. A row with a
// value that is not finite gets s = +infinity, which voids the screen for that row.

#pragma once

#include <cmath>
#include <cstdint>

#include "vectors.h"

namespace redjax {

// x f32[K] -> to u32[ceil(K / 4)], stats f32[3] = {s, |x - s q|_2, |s q|_2} (the norms rounded up)
inline void quantize_row_i8(const float* x, int64_t k, uint32_t* to, float* stats) {
  float most = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < k; ++i) {
    finite &= !not_finite(x[i]);
    most = std::max(most, std::fabs(x[i]));
  }
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

}  // namespace redjax
