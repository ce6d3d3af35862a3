// Prefill blocks of the paged-attention kernel (paged_attention.cc): the queries of one work item
// (up to kBlock tokens of one row, each with the G query heads that share one KV head) against
// the row's pages as two small matrix products, instead of one query at a time.
//
// A query alone reads every key and value vector for one multiply-add per lane, so it runs at the
// rate the vectors load (a 1024-token prompt: ~75 GFLOP/s on two cores, a third of the machine's
// FMA rate, and more time than the projections of the same tokens in bfloat16). Here the block's
// NQ = tokens x G query vectors are taken kScoreRows at a time: each key vector loaded (16 keys of
// one dimension: a row of the transposed key page) serves kScoreRows queries, and each value row
// loaded serves a tile of queries in the weighted sum, so loads no longer bound the arithmetic.
//
// Per work item: the scaled queries transposed to [DIM, NQ] (a dimension's query values side by
// side, read as broadcasts; their lines requested first, since the projection that wrote them
// may have run on the other core), scores from the first page holding a visible key up to the
// block's last visible key (rows of [NQ, span], span: those pages), then per query a softmax
// over its own visible keys (zeros elsewhere, so the value pass needs no mask), then the values.
// Keys a query must not see within that range are scored with the others and then dropped; the
// value pass reads only keys some query of its tile sees.
//
// Session 40, the demo model's prefill (7 rows of 128 tokens, head dim 32, pages of 64, one
// layer, alternating in one process on the Intel VM): 1.33-1.47x faster than before these three
// things: scoring past the block's last key (a block of the first 16 tokens scored a whole page
// of 64), the softmax's last keys on the library's scalar expf (as long as the vector calls for
// the rest; `exp_and_sum` runs whole vectors), and the queries read cold while transposed (16 % of
// the kernel's samples). 2 rows x 512 ending at 1024: 1.08x.
//
// Shapes as in paged_attention.cc: key pages [D, ps], value pages [ps, D], float32, bfloat16 or
// int8 (widened as loaded; int8 pages' scales applied to the scores and the probabilities); DIM
// (the head dimension) and the page size multiples of 16.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_rows.h"
#include "vectors.h"

namespace redjax {

constexpr int kScoreRows = 12;  // queries per score tile: 12 x 2 key vectors, 24 accumulators

// Per-thread buffers of prefill blocks, reused across work items.
struct PrefillScratch {
  std::vector<float> qt;      // [DIM, nq]: query j's dimension i at i * nq + j, scaled
  std::vector<float> scores;  // [nq, span]: scores, then probabilities (zero outside each query's keys)
  std::vector<int64_t> lo, hi;  // [nq]: each query's visible keys, relative to the span's first key
  std::vector<float> inv;       // [nq]: 1 / softmax denominator (0: no visible key)
};

// Scores of kScoreRows queries (`qt` at the first one's column, rows `nq` apart) against KC
// vectors of 16 keys (`kp[c]`: dimension 0 of vector c; dimension i is `ps` further on) ->
// out[r * span + c * 16 + lane].
template <int DIM, int KC, typename E>
inline void score_tile(const float* qt, int64_t nq, const E* const* kp, int64_t ps, float* out, int64_t span) {
  f32xN acc[kScoreRows][KC] = {};
  for (int i = 0; i < DIM; ++i) {
    f32xN keys[KC];
    for (int c = 0; c < KC; ++c) keys[c] = load(kp[c] + i * ps);
    const float* q = qt + i * nq;
    for (int r = 0; r < kScoreRows; ++r)
      for (int c = 0; c < KC; ++c) acc[r][c] += q[r] * keys[c];
  }
  for (int r = 0; r < kScoreRows; ++r)
    for (int c = 0; c < KC; ++c) store(out + r * span + c * kLanes, acc[r][c]);
}

// Queries per value tile: at most 24 accumulators of DIM / 16 vectors each (a divisor of
// kScoreRows, so value tiles cover the score tiles' padded queries exactly)
constexpr int value_rows(int dim) {
  const int vectors = dim / static_cast<int>(kLanes);
  int rows = vectors >= 24 ? 1 : 24 / vectors;
  while (kScoreRows % rows != 0) --rows;
  return rows;
}

// out rows j0 .. j0 + R of the weighted sums over keys [from, to) (relative to the span's first
// key), probabilities `p` at query j0's row, rows `span` apart; `value_page(col)` [ps, DIM]
template <int DIM, int R, typename E, typename ValuePage>
inline void value_tile(const float* p, int64_t span, int64_t from, int64_t to, int64_t c0, int64_t ps,
                       ValuePage value_page, float (*out)[DIM]) {
  constexpr int NC = DIM / kLanes;
  f32xN acc[R][NC] = {};
  for (int64_t col = c0 + from / ps; col * ps < c0 * ps + to; ++col) {
    const E* rows = value_page(col);
    const int64_t base = (col - c0) * ps, t0 = std::max(from, base), t1 = std::min(to, base + ps);
    for (int64_t t = t0; t < t1; ++t) {
      const E* row = rows + (t - base) * DIM;
      f32xN v[NC];
      for (int c = 0; c < NC; ++c) v[c] = load(row + c * kLanes);
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] += p[r * span + t] * v[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) store(out[r] + c * kLanes, acc[r][c]);
}

// The queries of block `b` for KV head `kvh` (all its G query heads) -> their rows of pb.out.
// `key_page(col)` / `value_page(col)`: page `col` of the row's table as E ([DIM, ps], [ps, DIM]).
template <int DIM, typename E, typename KeyPage, typename ValuePage>
void attend_prefill(const Problem& pb, const Block& b, int64_t kvh, PrefillScratch& scratch, KeyPage key_page,
                    ValuePage value_page) {
  const int64_t g = pb.heads / pb.kv_heads, head0 = kvh * g, ps = pb.page_size;
  const int64_t nq_real = (b.end - b.begin) * g;                          // query j: token j / g, head j % g
  const int64_t nq = (nq_real + kScoreRows - 1) / kScoreRows * kScoreRows;  // padded with zero queries
  auto at = [&](int64_t j) { return ((b.begin + j / g) * pb.heads + head0 + j % g) * DIM; };  // in q and out
  auto out_row = [&](int64_t j) { return pb.out + at(j); };
  for (int64_t j = 0; j < nq_real; ++j)  // the queries' lines, requested before they are transposed
    for (int64_t i = 0; i < DIM; i += 16) __builtin_prefetch(pb.q + at(j) + i, 0, 3);
  int64_t lo = INT64_MAX, hi = 0;  // the union of the block's visible keys
  scratch.lo.assign(nq, 0);
  scratch.hi.assign(nq, 0);
  for (int64_t j = 0; j < nq_real; j += g) {
    int64_t l, h;
    visible(pb, b.row, b.begin + j / g, l, h);
    if (h <= l) continue;  // a padding query: no visible key
    lo = std::min(lo, l), hi = std::max(hi, h);
    for (int64_t k = j; k < j + g; ++k) scratch.lo[k] = l, scratch.hi[k] = h;
  }
  if (hi <= lo) {
    for (int64_t j = 0; j < nq_real; ++j) std::fill(out_row(j), out_row(j) + DIM, 0.0f);
    return;
  }
  const int64_t c0 = lo / ps, c1 = (hi - 1) / ps, span = (c1 - c0 + 1) * ps, first = c0 * ps;
  for (int64_t j = 0; j < nq; ++j)
    if (scratch.hi[j] > scratch.lo[j]) scratch.lo[j] -= first, scratch.hi[j] -= first;

  scratch.qt.assign(DIM * nq, 0.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(DIM));
  for (int64_t j = 0; j < nq_real; ++j) {
    const float* q = pb.q + at(j);
    for (int i = 0; i < DIM; ++i) scratch.qt[i * nq + j] = q[i] * scale;
  }

  // scores, two key vectors at a time (from one page, or the ends of two 16-key pages)
  scratch.scores.resize(nq * span);
  float* scores = scratch.scores.data();
  // key vectors up to the block's last visible key: the rest of its last page is never read
  const int64_t vectors = (hi - first + kLanes - 1) / kLanes, scored = vectors * kLanes;
  auto key_vector = [&](int64_t v) { return key_page(c0 + v * kLanes / ps) + v * kLanes % ps; };
  for (int64_t v = 0; v < vectors; v += 2) {
    const E* kp[2] = {key_vector(v), v + 1 < vectors ? key_vector(v + 1) : nullptr};
    for (int64_t j0 = 0; j0 < nq; j0 += kScoreRows) {
      float* out = scores + j0 * span + v * kLanes;
      if (kp[1] != nullptr)
        score_tile<DIM, 2>(scratch.qt.data() + j0, nq, kp, ps, out, span);
      else
        score_tile<DIM, 1>(scratch.qt.data() + j0, nq, kp, ps, out, span);
    }
  }

  // int8 pages: scores by their keys' scales (below, probabilities by their values')
  auto scale_pages = [&](const float* base) {
    for (int64_t col = c0; col <= c1 && (col - c0) * ps < scored; ++col)
      scale_columns(scores + (col - c0) * ps, nq, span, page_scales(base, pb, b.row, kvh, col),
                    std::min(ps, scored - (col - c0) * ps));
  };
  if (pb.k_scales != nullptr) scale_pages(pb.k_scales);

  // each query's softmax over its own keys; probabilities elsewhere are zero
  scratch.inv.assign(nq, 0.0f);
  for (int64_t j = 0; j < nq; ++j) {
    float* p = scores + j * span;
    const int64_t from = scratch.lo[j], to = scratch.hi[j];
    if (to <= from) {
      std::fill(p, p + scored, 0.0f);
      continue;
    }
    const float mx = max_of(p + from, to - from, -1e30f);
    std::fill(p, p + from / kLanes * kLanes, 0.0f);
    std::fill(p + (to + kLanes - 1) / kLanes * kLanes, p + scored, 0.0f);
    scratch.inv[j] = 1.0f / exp_and_sum(p, from, to, mx);
  }

  if (pb.v_scales != nullptr) scale_pages(pb.v_scales);

  // values, a tile of queries at a time over the keys any of them sees
  constexpr int R = value_rows(DIM);
  alignas(64) float tile[R][DIM];
  for (int64_t j0 = 0; j0 < nq_real; j0 += R) {
    int64_t from = span, to = 0;
    for (int64_t j = j0; j < j0 + R; ++j)
      if (scratch.hi[j] > scratch.lo[j]) from = std::min(from, scratch.lo[j]), to = std::max(to, scratch.hi[j]);
    if (to <= from) {
      for (int64_t j = j0; j < std::min(j0 + R, nq_real); ++j) std::fill(out_row(j), out_row(j) + DIM, 0.0f);
      continue;
    }
    value_tile<DIM, R, E>(scores + j0 * span, span, from, to, c0, ps, value_page, tile);
    for (int64_t j = j0; j < std::min(j0 + R, nq_real); ++j) {
      float* o = out_row(j);
      for (int i = 0; i < DIM; ++i) o[i] = tile[j - j0][i] * scratch.inv[j];
    }
  }
}

}  // namespace redjax
