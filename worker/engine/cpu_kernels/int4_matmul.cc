// int4 projections on AVX512-VNNI (PanelMatmulW4A8, int4_linear.py): weights quantized to 4 bits in
// groups of G along K with a float32 scale per group and column (symmetric, [-8, 7]); activations
// quantized per row to int8 with a scale and a zero point (asymmetric), at run time. The scheme is
// torchao's Int8DynamicActivationIntxWeightConfig with int4 weights (8da4w).
//
// Layout. The weight lives as panels of kPanel = 32 columns, each panel one contiguous run of
// ceil(K / 4) steps of 64 bytes: byte j of a step holds, in its low nibble, column j / 4's k + j % 4
// and, in its high nibble, column 16 + j / 4's, each as q + 8 (0..15). Split into low and high
// nibbles, a step is two VPDPBUSD operands of 16 columns x 4 k, the layout of the int8 kernels'
// panel rows (panel_matmul.cc); the 8 comes off each group's int32 sums as 8 times the sum of the
// row's bytes over the group. The group scales go panel by panel, [P, K / G, kPanel].
//
// A row of x is quantized to bytes u = q + 128 (unsigned; q in [-128, 127]) with scale s and zero
// point z, so x ~ s (q - z). One VPDPBUSD adds 16 columns' four products u * (w + 8) into int32,
// exactly.
// After each group a tile folds its int32 sums into float32 ones, times the group's column scales:
//   y[m, n] = s_m * (sum_g scale[g, n] * sum_{k in g} u_mk w_kn - (128 + z_m) * C[n]),
// where C[n] = sum_g scale[g, n] * sum_{k in g} w_kn is computed once when the weight is packed.
// A tile is kRows rows x one panel: 2 * kRows int32 accumulators, and as many float32 sums, which
// the compiler keeps in L1 between groups.
//
// Shapes: x f32[M, K]; w u8[P, ceil(K / 4), 64]; scales f32[P, K / G, 32]; c f32[P * 32]; y f32[M, N]
// with (P - 1) * 32 < N <= P * 32, G a multiple of 4 dividing K.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "i8_rows.h"
#include "pool_work.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using redjax::f32xN;
using redjax::i32xN;
using redjax::kLanes;

#ifdef __AVX512VNNI__
constexpr int64_t kPanel = 32;       // columns per panel (int4_linear.py: PANEL)
constexpr int64_t kStepBytes = 64;   // one step: 32 columns x 4 k, a nibble each
constexpr int64_t kRows = 12;        // rows per tile: 24 int32 accumulators (the float32 sums wait in L1)
constexpr int64_t kBlockTiles = 8;   // row tiles per work item of a long product (prefill)
constexpr int64_t kAhead = 16;       // a tile requests the panel's line this many steps ahead (1 KB)

// x f32[K] -> to u32[K / 4] as unsigned bytes q + 128, and sums[g] = the bytes of group g (`per`
// inputs each) summed; returns {s, 128 + z}. torchao's per-token asymmetric int8:
// s = max((max(x, 0) - min(x, 0)) / 255, FLT_MIN), z = clamp(-128 - round(min(x, 0) / s), -128,
// 127), q = clamp(round(x * (1 / s)) + z, -128, 127), rounding half to even. A row with a value
// that is not finite gets s = NaN (its products NaN). 16 lanes at a time (as a scalar loop this
// was ~2 us of a 12-50 us batch-1 product at K = 768); K and `per` are multiples of 4.
struct RowScale {
  float scale, offset;
};
RowScale quantize_row_a8(const float* x, int64_t k, int64_t per, uint32_t* to, int32_t* sums) {
  uint8_t* out = reinterpret_cast<uint8_t*>(to);
  float lo = 0.0f, hi = 0.0f;
  bool finite = true;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 low = _mm512_setzero_ps(), high = _mm512_setzero_ps();
  __mmask16 odd = 0;  // lanes that met an infinity or NaN (all exponent bits set)
  const __m512i exponent = _mm512_set1_epi32(static_cast<int32_t>(redjax::kExponentBits));
  for (; i + 16 <= k; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    odd |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exponent), exponent);
    low = _mm512_min_ps(low, v);
    high = _mm512_max_ps(high, v);
  }
  finite = odd == 0;
  lo = _mm512_reduce_min_ps(low);
  hi = _mm512_reduce_max_ps(high);
#endif
  for (; i < k; ++i) {
    finite &= !redjax::not_finite(x[i]);
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  if (!finite) {
    std::fill(out, out + k, uint8_t{128});
    std::fill(sums, sums + k / per, static_cast<int32_t>(128 * per));
    return {std::bit_cast<float>(0x7fc00000u), 128.0f};
  }
  const float s = std::max(redjax::divide_exactly(hi - lo, 255.0f), 0x1p-126f);
  const float z = std::clamp(-128.0f - std::nearbyint(redjax::divide_exactly(lo, s)), -128.0f, 127.0f);
  const float inv = redjax::divide_exactly(1.0f, s);
  for (int64_t g = 0; g < k / per; ++g) {
    int32_t sum = 0;
    i = g * per;
#ifdef __AVX512F__
    // the scalar loop's operations, 16 at a time: the same bytes
    const __m512 scale_by = _mm512_set1_ps(inv), zero = _mm512_set1_ps(z);
    const __m512 floor = _mm512_set1_ps(-128.0f), ceiling = _mm512_set1_ps(127.0f);
    __m512i lanes = _mm512_setzero_si512();
    for (; i + 16 <= (g + 1) * per; i += 16) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale_by),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 q = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(r, zero), floor), ceiling);
      const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(q), _mm512_set1_epi32(128));
      lanes = _mm512_add_epi32(lanes, u);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(u));
    }
    sum = _mm512_reduce_add_epi32(lanes);
#endif
    for (; i < (g + 1) * per; ++i) {
      out[i] = static_cast<uint8_t>(static_cast<int32_t>(std::clamp(std::nearbyint(x[i] * inv) + z, -128.0f, 127.0f)) + 128);
      sum += out[i];
    }
    sums[g] = sum;
  }
  return {s, 128.0f + z};
}

struct Problem {
  // each tile of kRows rows (the last: the rest) k-major, [steps, R]: row r's bytes for k .. k + 3
  // as one word at [k / 4, r]; a step's R words are one read, where R rows K apart would share L1
  // sets (4 KB apart at K = 4096: every row in one set)
  const uint32_t* x;
  const RowScale* rows;  // [M]
  const int32_t* usums;  // [M, groups]: each row's bytes summed over each group (the weights' offset's share)
  const uint8_t* w;      // [P, steps, 64]
  const float* scales;   // [P, groups, 32]
  const float* c;        // [P * 32]
  float* y;              // [M, N]
  int64_t m, n, steps, group_steps, groups;
};

// y[m0 : m0 + R, n0 : n0 + 32] (clipped at n) for panel p. Each step requests the panel's line
// kAhead steps on, and, past the panel's end, the lines of `next` (the panel this thread computes
// after it, or null): a decode step's panels are read once, from memory, and a thread's panels are
// not adjacent (the threads take them in turn), so the hardware's stream prefetch starts late.
template <int R>
inline void tile(const Problem& pb, int64_t p, int64_t m0, const uint8_t* next) {
  const uint8_t* panel = pb.w + p * pb.steps * kStepBytes;
  const float* scales = pb.scales + p * pb.groups * kPanel;
  const uint32_t* xt = pb.x + m0 * pb.steps;  // this tile, [steps, R]
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  f32xN sums[R][2] = {};
  for (int64_t g = 0; g < pb.groups; ++g) {
    i32xN acc[R][2] = {};
    const int64_t k0 = g * pb.group_steps;
    for (int64_t k = k0; k < k0 + pb.group_steps; ++k) {
      const int64_t ahead = k + kAhead;
      if (ahead < pb.steps)
        __builtin_prefetch(panel + ahead * kStepBytes, 0, 3);
      else if (next != nullptr)
        __builtin_prefetch(next + (ahead - pb.steps) * kStepBytes, 0, 3);
      const __m512i v = _mm512_loadu_si512(panel + k * kStepBytes);
      // the nibbles as they are, q + 8 (0..15): the 8 comes off once a group, below
      const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(static_cast<int32_t>(xt[k * R + r]));
        acc[r][0] = reinterpret_cast<i32xN>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc[r][0]), xv, lo));
        acc[r][1] = reinterpret_cast<i32xN>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc[r][1]), xv, hi));
      }
    }
    const f32xN s0 = redjax::load(scales + g * kPanel), s1 = redjax::load(scales + g * kPanel + kLanes);
    for (int r = 0; r < R; ++r) {  // sum u (q + 8) - 8 sum u = sum u q, exactly
      const int32_t offset = 8 * pb.usums[(m0 + r) * pb.groups + g];
      sums[r][0] += __builtin_convertvector(acc[r][0] - offset, f32xN) * s0;
      sums[r][1] += __builtin_convertvector(acc[r][1] - offset, f32xN) * s1;
    }
  }
  const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, pb.n - n0);
  const f32xN c0 = redjax::load(pb.c + n0), c1 = redjax::load(pb.c + n0 + kLanes);
  for (int r = 0; r < R; ++r) {
    const RowScale rs = pb.rows[m0 + r];
    float full[kPanel];
    redjax::store(full, (sums[r][0] - rs.offset * c0) * rs.scale);
    redjax::store(full + kLanes, (sums[r][1] - rs.offset * c1) * rs.scale);
    std::memcpy(pb.y + (m0 + r) * pb.n + n0, full, cols * sizeof(float));
  }
}

// M rows as ceil(M / kRows) tiles of sizes within one of each other (64 rows: 11, 11, 11, 11, 10, 10):
// a tile's fixed work a step (the weights' load and split) spread over as many rows as it can be
struct Tiles {
  int64_t m, count;
  explicit Tiles(int64_t m) : m(m), count((m + kRows - 1) / kRows) {}
  int64_t start(int64_t t) const { return t * m / count; }
  int64_t rows(int64_t t) const { return start(t + 1) - start(t); }
};

// rows [m0, m0 + count) of panel p (count <= kRows)
template <int R = kRows>
inline void any_tile(const Problem& pb, int64_t p, int64_t m0, int64_t count, const uint8_t* next) {
  if constexpr (R > 0) {
    if (count == R) return tile<R>(pb, p, m0, next);
    any_tile<R - 1>(pb, p, m0, count, next);
  }
}

ffi::Error PanelMatmulW4A8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                               ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> c, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("panel_matmul_w4a8: expected x [M,K], w [P,steps,64], scales [P,G,32], y [M,N]");
  const int64_t m = xd[0], k = xd[1], n = yd[1], panels = wd[0], steps = (k + 3) / 4, groups = sd[1];
  if (wd[1] != steps || wd[2] != kStepBytes || yd[0] != m || n > panels * kPanel || n <= (panels - 1) * kPanel ||
      sd[0] != panels || sd[2] != kPanel || c.element_count() != panels * kPanel || groups < 1 || k % groups != 0 ||
      (k / groups) % 4 != 0)
    return ffi::Error::InvalidArgument("panel_matmul_w4a8: inconsistent shapes");
  if (m == 0 || n == 0) return ffi::Error::Success();
  thread_local std::vector<uint32_t> quantized;  // the calling thread's, reused across calls
  thread_local std::vector<RowScale> row_scales;
  thread_local std::vector<int32_t> group_sums;
  quantized.resize(m * steps);
  row_scales.resize(m);
  group_sums.resize(m * groups);
  int32_t* us = group_sums.data();
  uint32_t* xq = quantized.data();
  RowScale* rs = row_scales.data();
  const float* xs = x.typed_data();
  const Tiles tiles(m);
  const int64_t blocks = (tiles.count + kBlockTiles - 1) / kBlockTiles;
  redjax::run_on_pool(pool, tiles.count, [=](int64_t t) {  // a tile: its rows, then k-major
    thread_local std::vector<uint32_t> row;
    row.resize(steps);
    const int64_t m0 = tiles.start(t), count = tiles.rows(t);
    uint32_t* tile = xq + m0 * steps;
    for (int64_t r = 0; r < count; ++r) {
      rs[m0 + r] = quantize_row_a8(xs + (m0 + r) * k, k, k / groups, row.data(), us + (m0 + r) * groups);
      for (int64_t i = 0; i < steps; ++i) tile[i * count + r] = row[i];
    }
  });
  const Problem pb{xq, rs, us, w.typed_data(), scales.typed_data(), c.typed_data(), y->typed_data(),
                   m, n, steps, steps / groups, groups};
  // an item: one panel over a block of row tiles (decode: every row), each panel read once per block
  redjax::run_on_pool(pool, blocks * panels, [pb, panels, tiles](int64_t item, int64_t later) {
    const int64_t b = item / panels, p = item % panels;
    const int64_t t1 = std::min(tiles.count, (b + 1) * kBlockTiles);
    for (int64_t t = b * kBlockTiles; t < t1; ++t) {
      // the last tile of this panel requests the next item's panel (earlier tiles reread this one)
      const uint8_t* next = t + 1 < t1 ? pb.w + p * pb.steps * kStepBytes
                            : later >= 0 ? pb.w + (later % panels) * pb.steps * kStepBytes
                                         : nullptr;
      any_tile(pb, p, tiles.start(t), tiles.rows(t), next);
    }
  });
  return ffi::Error::Success();
}
#endif

}  // namespace

#ifdef __AVX512VNNI__
XLA_FFI_DEFINE_HANDLER_SYMBOL(PanelMatmulW4A8, PanelMatmulW4A8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#endif
