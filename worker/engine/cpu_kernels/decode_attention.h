// Decode rows of the paged-attention kernel (paged_attention.cc): one query token per row, its G
// query heads that share one KV head in one pass over each of the row's pages, which a decode
// step streams from memory. So besides the arithmetic this is about keeping memory busy: the first
// lines of the next page requested before it is read (`prime`), the next work item's pages
// requested while this one computes (`Ahead`, filled by `queue_pages`), and a partly filled last
// page read only as far as its keys (`last_page_keys`).
//
// Shapes as in paged_attention.cc: key pages [D, ps], value pages [ps, D], float32, bfloat16 or
// int8 (widened as loaded; int8 pages' scales applied to each page's scores and probabilities);
// DIM (the head dimension) and the page size multiples of 16.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_rows.h"
#include "vectors.h"

namespace redjax {

// Lines of a page requested before it is read. Pages sit anywhere in the cache, so every page
// starts a new stream that the hardware prefetcher has to pick up again; asking for the first
// kPrimeLines of the next page while this one is read hides that restart (16 lines, 1 KiB:
// 8-9 % less time per layer than none on scattered pages, 32 or 64 lines gain less; no change
// when a row's pages are consecutive).
constexpr int kPrimeLines = 16;

template <typename E>
inline void prime(const E* page) {
  const char* bytes = reinterpret_cast<const char*>(page);
  for (int i = 0; i < kPrimeLines; ++i) __builtin_prefetch(bytes + 64 * i, 0, 3);
}

// The pages of the work item a thread runs next, requested a page's worth for each page the
// current decode item reads: an item streams only a few pages from memory, and on its own keeps
// too few misses in flight to use the memory's bandwidth (demo model, 64 rows: 455 -> 335 us per
// layer on cold caches; 7 % more decode throughput end to end, 0-1 % for llama-100m).
struct Ahead {
  struct Range {
    const char* at;
    int64_t bytes;  // whole 64-byte lines from `at`
  };
  std::vector<Range> ranges;  // the next item's key rows and value rows, in reading order
  int64_t page_bytes = 0;
  size_t range = 0;
  int64_t offset = 0;  // bytes of ranges[range] requested so far

  void reset(int64_t bytes) { ranges.clear(), page_bytes = bytes, range = 0, offset = 0; }
  // decode reads request as many bytes of the queue as they read, step by step, rather than a
  // page's worth before each page: a burst of 256 requests held back the page's own loads
  // (llama-100m shape, 64 rows, 12 layers: 0.86-0.94 of the time, float32 and bfloat16 pages,
  // consecutive and scattered)
  void add(const char* at, int64_t bytes) { ranges.push_back({at, bytes}); }
  // request the next `bytes` of the queue (whole 64-byte lines) into L2
  void pump(int64_t bytes) {
    for (; bytes > 0 && range < ranges.size(); bytes -= 64) {
      __builtin_prefetch(ranges[range].at + offset, 0, 2);
      if ((offset += 64) >= ranges[range].bytes) ++range, offset = 0;
    }
  }
};

// Keys of a decode row's last page to score, `used` of them visible: when they fit in the first
// 64-byte line of each key row, that line alone (in runs of 16 keys), else the whole page. Reading
// part of a row saves nothing once two or more of its lines are read (the hardware prefetcher
// fetches the rest); a single line does: llama-100m's shape, 64 rows, 1-12 keys on the last page,
// 0.85-0.87 of the whole page's time per layer.
inline int64_t last_page_keys(int64_t used, int64_t ps, int64_t elem) {
  return used * elem <= 64 && ps % kLanes == 0 ? (used + kLanes - 1) / kLanes * kLanes : ps;
}

// The largest divisor of `g` that is at most `cap` (at least 1).
constexpr int divisor_up_to(int g, int cap) {
  for (int d = std::min(g, cap); d > 1; --d)
    if (g % d == 0) return d;
  return 1;
}

// Independent accumulator sets (a power of two) that keep at least 8 FMA chains in flight (two FMA
// units of 4 cycles' latency) when one set has `chains`, at most 16 registers in all.
constexpr int sets_for(int chains) {
  int sets = 1;
  while (sets * chains < 8 && 2 * sets * chains <= 16) sets *= 2;
  return sets;
}

// Scores of G query heads (`qt` [D, G], scaled) against 16 keys of a key page (`kp` at the first
// key in dimension 0, dimension i `ps` further on) -> out[h * stride + key]: the tail of a page that
// is not a multiple of 64 keys. Each key vector loaded serves the G heads; the dimensions go round
// KD accumulator sets.
template <int DIM, int G, typename E>
inline void key_step16(const float (&qt)[DIM][G], const E* kp, int64_t ps, float* out, int64_t stride) {
  constexpr int KD = sets_for(G);
  static_assert(DIM % KD == 0);
  f32xN acc[KD][G] = {};
  for (int i = 0; i < DIM; i += KD)
    for (int u = 0; u < KD; ++u) {
      const f32xN kv = load(kp + (i + u) * ps);
      for (int h = 0; h < G; ++h) acc[u][h] += qt[i + u][h] * kv;
    }
  for (int h = 0; h < G; ++h) {
    f32xN sum = acc[0][h];
    for (int u = 1; u < KD; ++u) sum += acc[u][h];
    store(out + h * stride, sum);
  }
}

// 32 consecutive elements as two vectors: float32 as they lie (the first 16, the next 16);
// bfloat16 (64 bytes) as the even-indexed and the odd-indexed elements, each widened by one
// instruction (a shift, a mask) instead of two per 16 elements (a widening shuffle and a shift).
inline void load32(const float* p, f32xN& a, f32xN& b) {
  a = load(p);
  b = load(p + kLanes);
}
inline void load32(const int8_t* p, f32xN& a, f32xN& b) {
  a = load(p);
  b = load(p + kLanes);
}
inline void load32(const uint16_t* p, f32xN& a, f32xN& b) {
  u32xN w;
  std::memcpy(&w, p, sizeof w);
  const u32xN even = w << 16, odd = w & 0xFFFF0000u;
  a = reinterpret_cast<const f32xN&>(even);
  b = reinterpret_cast<const f32xN&>(odd);
}

// Results computed lane by lane on load32's two vectors, stored back in element order at p[0, 32).
template <typename E>
inline void store32(float* p, f32xN a, f32xN b) {
  if constexpr (std::is_same_v<E, uint16_t>) {  // a: elements 0, 2, .., 30; b: 1, 3, .., 31
    store(p, __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
    store(p + kLanes, __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
  } else {
    store(p, a);
    store(p + kLanes, b);
  }
}

// Scores as key_step16 computes them, over PAIRS * 32 keys loaded 32 at a time (load32); each
// dimension's read of PAIRS * 32 keys requests as many bytes of `ahead`'s queue.
template <int DIM, int G, int PAIRS, typename E>
inline void key_step32(const float (&qt)[DIM][G], const E* kp, int64_t ps, float* out, int64_t stride,
                       Ahead& ahead) {
  constexpr int KD = sets_for(G * PAIRS * 2);
  static_assert(DIM % KD == 0);
  f32xN acc[KD][G][PAIRS][2] = {};
  for (int i = 0; i < DIM; i += KD)
    for (int u = 0; u < KD; ++u) {
      ahead.pump(PAIRS * 2 * kLanes * sizeof(E));
      for (int r = 0; r < PAIRS; ++r) {
        f32xN a, b;
        load32(kp + (i + u) * ps + r * 2 * kLanes, a, b);
        for (int h = 0; h < G; ++h) {
          acc[u][h][r][0] += qt[i + u][h] * a;
          acc[u][h][r][1] += qt[i + u][h] * b;
        }
      }
    }
  for (int h = 0; h < G; ++h)
    for (int r = 0; r < PAIRS; ++r) {
      f32xN a = acc[0][h][r][0], b = acc[0][h][r][1];
      for (int u = 1; u < KD; ++u) a += acc[u][h][r][0], b += acc[u][h][r][1];
      store32<E>(out + h * stride + r * 2 * kLanes, a, b);
    }
}

// One decode query (row `s`, token `token`): query heads [head, head + G) of the group that
// shares KV head `kvh`, in one pass over each page: a key or value vector loaded once serves all G
// heads (the per-head loop of `attend_query` went over every page once per head). Keys are taken
// 64 at a time, a whole row of a float32 page, so a page is read front to back. G (1 to 4: a group
// of 8 heads is two calls) and the head dimension are compile-time (DIM a multiple of 16, page
// sizes too), so the accumulators live in registers.
template <int DIM, int G, typename E, typename Scratch, typename KeyPage, typename ValuePage>
void attend_decode(const Problem& pb, int64_t s, int64_t token, int64_t kvh, int64_t head, Scratch& scratch,
                   KeyPage key_page, ValuePage value_page) {
  constexpr int NC = DIM / kLanes;                        // vectors per value row
  constexpr int GV = divisor_up_to(G, std::max(1, 16 / NC));  // heads per value pass
  constexpr int KS = sets_for(GV * NC);                   // value accumulator sets: keys round them
  const int64_t ps = pb.page_size;
  const int64_t head0 = kvh * (pb.heads / pb.kv_heads) + head;  // this call's first query head
  float* o = pb.out + (token * pb.heads + head0) * DIM;  // [G, D]
  int64_t lo, hi;
  visible(pb, s, token, lo, hi);
  const int64_t n = hi - lo;
  std::fill(o, o + G * DIM, 0.0f);
  if (n <= 0) return;  // padding
  const int64_t c0 = lo / ps, c1 = (hi - 1) / ps;  // the pages holding visible keys
  const int64_t span = (c1 - c0 + 1) * ps;          // scores for whole pages: [G, span]
  scratch.probs.resize(G * span + G);
  float* scores = scratch.probs.data();  // [G, span]; key j of the row at j - c0 * ps
  float* inv = scores + G * span;        // [G]
  const float scale = 1.0f / std::sqrt(static_cast<float>(DIM));
  const float* qs = pb.q + (token * pb.heads + head0) * DIM;  // [G, D]
  float qt[DIM][G];  // [D, G]: a dimension's G query values side by side
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < DIM; ++i) qt[i][h] = qs[h * DIM + i] * scale;
  for (int64_t col = c0; col <= c1; ++col) {
    const E* kp = key_page(col);  // [D, ps]
    if (col < c1) prime(key_page(col + 1));
    float* out = scores + (col - c0) * ps;
    // the last page only up to the row's last key (in runs of 16): a partly filled page is read
    // in part
    const int64_t keys = col < c1 ? ps : last_page_keys(hi - col * ps, ps, sizeof(E));
    // a page's worth of the queue in all: what the 64-key steps below do not request, now
    scratch.ahead.pump(scratch.ahead.page_bytes - keys / (4 * kLanes) * (4 * kLanes) * DIM * int64_t{sizeof(E)});
    int64_t t = 0;
    for (; t + 4 * kLanes <= keys; t += 4 * kLanes)
      key_step32<DIM, G, 2>(qt, kp + t, ps, out + t, span, scratch.ahead);
    for (; t < keys; t += kLanes) key_step16<DIM, G>(qt, kp + t, ps, out + t, span);
    if (pb.k_scales != nullptr) scale_columns(out, G, span, page_scales(pb.k_scales, pb, s, kvh, col), keys);
  }
  const int64_t first = lo - c0 * ps;  // scores [first, first + n) of each head are visible
  for (int h = 0; h < G; ++h) {
    float* p = scores + h * span;
    const float mx = redjax::max_of(p + first, n, -1e30f);
    inv[h] = 1.0f / redjax::exp_and_sum(p, first, first + n, mx);
  }
  if (pb.v_scales != nullptr)  // each key's probability times its value's scale
    for (int64_t col = c0; col <= c1; ++col)
      scale_columns(scores + (col - c0) * ps, G, span, page_scales(pb.v_scales, pb, s, kvh, col), ps);
  prime(value_page(c0));
  if constexpr (DIM % (2 * kLanes) == 0) {
    constexpr int NP = DIM / (2 * kLanes);  // 32-element pieces of a value row (load32)
    for (int h0 = 0; h0 < G; h0 += GV) {
      f32xN acc[KS][GV][NP][2] = {};  // keys go round the KS sets
      for (int64_t col = c0; col <= c1; ++col) {
        const E* rows = value_page(col);  // [ps, D]
        if (h0 == 0 && col < c1) prime(value_page(col + 1));
        const int64_t from = std::max(lo, col * ps) - col * ps, to = std::min(hi, col * ps + ps) - col * ps;
        // the first pass over the page requests a value row's bytes of the queue per row it reads
        // (what its rows in steps of KS do not cover, now)
        const int64_t row_bytes = h0 == 0 ? DIM * int64_t{sizeof(E)} : 0;
        if (h0 == 0) scratch.ahead.pump(scratch.ahead.page_bytes - (to - from) / KS * KS * row_bytes);
        const float* p = scores + h0 * span + (col - c0) * ps;  // this page's probabilities of head h0
        int64_t t = from;
        for (; t + KS <= to; t += KS)
          for (int u = 0; u < KS; ++u) {
            scratch.ahead.pump(row_bytes);
            for (int c = 0; c < NP; ++c) {
              f32xN a, b;
              load32(rows + (t + u) * DIM + c * 2 * kLanes, a, b);
              for (int h = 0; h < GV; ++h) {
                acc[u][h][c][0] += p[h * span + t + u] * a;
                acc[u][h][c][1] += p[h * span + t + u] * b;
              }
            }
          }
        for (; t < to; ++t)
          for (int c = 0; c < NP; ++c) {
            f32xN a, b;
            load32(rows + t * DIM + c * 2 * kLanes, a, b);
            for (int h = 0; h < GV; ++h) {
              acc[0][h][c][0] += p[h * span + t] * a;
              acc[0][h][c][1] += p[h * span + t] * b;
            }
          }
      }
      for (int h = 0; h < GV; ++h)
        for (int c = 0; c < NP; ++c) {
          f32xN a = acc[0][h][c][0], b = acc[0][h][c][1];
          for (int u = 1; u < KS; ++u) a += acc[u][h][c][0], b += acc[u][h][c][1];
          store32<E>(o + (h0 + h) * DIM + c * 2 * kLanes, a * inv[h0 + h], b * inv[h0 + h]);
        }
    }
    return;
  }
  for (int h0 = 0; h0 < G; h0 += GV) {
    f32xN acc[KS][GV][NC] = {};  // keys go round the KS sets
    for (int64_t col = c0; col <= c1; ++col) {
      const E* rows = value_page(col);  // [ps, D]
      if (h0 == 0 && col < c1) prime(value_page(col + 1));
      if (h0 == 0) scratch.ahead.pump(scratch.ahead.page_bytes);
      const int64_t from = std::max(lo, col * ps) - col * ps, to = std::min(hi, col * ps + ps) - col * ps;
      const float* p = scores + h0 * span + (col - c0) * ps;  // this page's probabilities of head h0
      int64_t t = from;
      for (; t + KS <= to; t += KS)
        for (int u = 0; u < KS; ++u)
          for (int c = 0; c < NC; ++c) {
            const f32xN vv = load(rows + (t + u) * DIM + c * kLanes);
            for (int h = 0; h < GV; ++h) acc[u][h][c] += p[h * span + t + u] * vv;
          }
      for (; t < to; ++t)
        for (int c = 0; c < NC; ++c) {
          const f32xN vv = load(rows + t * DIM + c * kLanes);
          for (int h = 0; h < GV; ++h) acc[0][h][c] += p[h * span + t] * vv;
        }
    }
    for (int h = 0; h < GV; ++h)
      for (int c = 0; c < NC; ++c) {
        f32xN sum = acc[0][h][c];
        for (int u = 1; u < KS; ++u) sum += acc[u][h][c];
        store(o + (h0 + h) * DIM + c * kLanes, sum * inv[h0 + h]);
      }
  }
}

// Queue into `ahead` the pages that item `item` (a decode row's block for one KV head) will read;
// nothing for a prefill block or no item (-1). `elem`: bytes per page element.
inline void queue_pages(const Problem& pb, const std::vector<Block>& blocks, int64_t item, int64_t elem,
                        Ahead& ahead) {
  const int64_t page_bytes = pb.dim * pb.page_size * elem;
  ahead.reset(page_bytes);
  if (item < 0) return;
  const Block& b = blocks[item / pb.kv_heads];
  int64_t lo, hi;
  if (b.end - b.begin != 1) return;
  visible(pb, b.row, b.begin, lo, hi);
  const int64_t head_bytes = (item % pb.kv_heads) * pb.num_pages * page_bytes, ps = pb.page_size;
  if (hi <= lo) return;
  const int64_t c0 = lo / ps, c1 = (hi - 1) / ps;
  const int64_t keys = last_page_keys(hi - c1 * ps, ps, elem), row_bytes = ps * elem;
  const char* k = static_cast<const char*>(pb.k) + head_bytes;
  const char* v = static_cast<const char*>(pb.v) + head_bytes;
  // int8 pages' scales (ps floats a page), each read once its page's scores or probabilities are
  auto scales = [&](const float* base, int64_t col) {
    if (base != nullptr) ahead.add(reinterpret_cast<const char*>(page_scales(base, pb, b.row, item % pb.kv_heads, col)),
                                   (ps * 4 + 63) / 64 * 64);
  };
  for (int64_t col = c0; col < c1; ++col) {
    ahead.add(k + page_at(pb, b.row, col) * page_bytes, page_bytes);
    scales(pb.k_scales, col);
  }
  const char* last = k + page_at(pb, b.row, c1) * page_bytes;
  if (keys == ps)
    ahead.add(last, page_bytes);
  else  // the first line of each of the D rows of the transposed page
    for (int64_t i = 0; i < pb.dim; ++i) ahead.add(last + i * row_bytes, 64);
  scales(pb.k_scales, c1);
  for (int64_t col = c0; col <= c1; ++col) scales(pb.v_scales, col);
  for (int64_t col = c0; col < c1; ++col) ahead.add(v + page_at(pb, b.row, col) * page_bytes, page_bytes);
  ahead.add(v + page_at(pb, b.row, c1) * page_bytes, (hi - c1 * ps) * pb.dim * elem);  // the rows it reads
}

}  // namespace redjax
