// What the paged-attention kernel (paged_attention.cc) and its prefill blocks
// (prefill_attention.h) share: the problem as the FFI call gives it, a work item's queries, and
// reading pages (bfloat16 widened to float32, page-table lookups, which keys a query sees).

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vectors.h"

namespace redjax {

using u16xN = uint16_t __attribute__((vector_size(kLanes * 2)));

// bfloat16 (stored as its bits) is the high half of a float32: widen by a 16-bit shift (on AVX-512
// one zero-extending load and a shift; GCC lowered the vector-extension form through two halves
// and inserts, a third of a prefill block's time)
inline f32xN load(const uint16_t* p) {
#ifdef __AVX512F__
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
  return reinterpret_cast<const f32xN&>(w);
#else
  u16xN h;
  std::memcpy(&h, p, sizeof h);
  const u32xN w = __builtin_convertvector(h, u32xN) << 16;
  return reinterpret_cast<const f32xN&>(w);
#endif
}
// int8 pages (kv_quant.py) hold q; the scales are applied to scores and probabilities, not here
inline f32xN load(const int8_t* p) {
#ifdef __AVX512F__
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return reinterpret_cast<const f32xN&>(v);
#else
  int8_t b[kLanes];
  std::memcpy(b, p, sizeof b);
  f32xN v;
  for (int i = 0; i < kLanes; ++i) v[i] = b[i];
  return v;
#endif
}
inline float scalar(int8_t x) { return x; }
inline float scalar(float x) { return x; }
inline float scalar(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr int64_t kBlock = 16;  // queries per work item: long prefill rows spread over the threads

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const float* k_scales;  // int8 pages: f32[KV, N, ps], each slot's scale; else null
  const float* v_scales;
  const int32_t* tables;
  const int32_t* positions;
  const int32_t* context_lens;
  float* out;
  int64_t heads, kv_heads, dim, num_pages, page_size, table_width, window;
};

// A work item's queries: tokens [begin, end) of row `row`.
struct Block {
  int64_t row, begin, end;
};

inline int64_t page_at(const Problem& pb, int64_t s, int64_t col) {
  const int64_t page = pb.tables[s * pb.table_width + col];
  return page < 0 || page >= pb.num_pages ? int64_t{0} : page;  // never read outside the cache
}

// The scales [ps] of page `col` of row `s`'s table for KV head `kvh`, from `base` (k_scales or
// v_scales, f32[KV, N, ps])
inline const float* page_scales(const float* base, const Problem& pb, int64_t s, int64_t kvh, int64_t col) {
  return base + (kvh * pb.num_pages + page_at(pb, s, col)) * pb.page_size;
}

// int8 pages: x[r * stride + t] *= scales[t] for r < rows, t < n (scores by their keys' scales,
// probabilities by their values')
inline void scale_columns(float* x, int64_t rows, int64_t stride, const float* scales, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * stride;
    int64_t t = 0;
    for (; t + kLanes <= n; t += kLanes) store(row + t, load(row + t) * load(scales + t));
    for (; t < n; ++t) row[t] *= scales[t];
  }
}

// The keys the query at `token` of row `s` sees: [lo, hi).
inline void visible(const Problem& pb, int64_t s, int64_t token, int64_t& lo, int64_t& hi) {
  const int64_t pos = pb.positions[token];
  // exclusive end: also never past the page table (a fused decode row that has stopped keeps
  // stepping with positions beyond its pages; its output is discarded)
  hi = std::min<int64_t>({pos + 1, pb.context_lens[s], pb.table_width * pb.page_size});
  lo = pb.window > 0 ? std::max<int64_t>(0, pos - pb.window + 1) : 0;
}

}  // namespace redjax
