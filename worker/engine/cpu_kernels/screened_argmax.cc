// Greedy and sampled tokens of a float32 LM head from its bfloat16 product, for XLA's CPU backend through the
// XLA FFI: the same tokens the float32 product and its argmax give, bit for bit, at about half
// the head's cost.
//
// A greedy step needs only each row's first largest logit. The bfloat16 product (x and W rounded
// to bfloat16, products exact, sums in float32: panel_matmul.cc's PanelMatmulBf16) runs at about
// twice the float32 one's speed, and differs from it by a bounded amount: for logit j,
//   |approx_j - exact_j| <= c(K) * sum_k |x_k| |W_kj| <= c(K) * |x|_2 * |W_j|_2  (Cauchy-Schwarz)
// with c(K) = 2u + u^2 (each operand rounded to bfloat16, unit roundoff u = 2^-8) plus twice
// gamma_K (K float32 additions in either product, in any order), widened for the float32 rounding
// of the bound itself (and an absolute term for subnormals, screen_row). So the exact argmax j* is
// among the candidates
//   { j : approx_j + e_j >= max_i (approx_i - e_i) },  e_j = c(K) |x|_2 |W_j|_2,
// since max_i (approx_i - e_i) <= max_i exact_i = exact_j* <= approx_j* + e_j*. Each candidate's
// logit is then computed exactly as the float32 panel kernel computes it (one fused multiply-add
// chain over k from zero, in order), and the first largest wins, as the argmax would pick. With
// random weights at the demo's and llama-100m's shapes, 2.5 and 5.8 candidates a row on average (at
// most 14 and 37 over 1280 rows); a row whose approximate logits or norm are not finite is
// searched over every token (and gives V - 1 if one of its logits is NaN, as the argmax kernel does).
//
// ScreenedArgmaxI8 screens the int8 product (PanelMatmulI8) the same way with its own bound
// (ScreenedArgmaxI8Impl), about twice as wide: ~60 candidates a row at llama-100m's shape. Where
// more than two are left, `refine` first narrows them with float32 dot products vectorized along
// k (within 2 gamma_K |x|_2 |W_j|_2 of the chain), so that about one gets the chain.
//
// ScreenedArgmaxI8Bf16 serves a bfloat16 model, whose head is the bfloat16 panel product itself
// (panel_matmul.cc's PanelMatmulBf16): the int8 product of x rounded to bfloat16 is screened with the
// same bound (the bfloat16 product is K float32 additions of exact products, within gamma_K of the
// real dot product as the float32 chain is), and each candidate's logit is the panel kernel's
// VDPBF16PS chain over the model's own panels, run again for that token's column (`bf16_chains`), so
// the tokens are the bfloat16 head's bit for bit, with no float32 copy of its weight.
//
// Sampled rows (temperature T > 0, nothing cut) take the token the sampler's draw gives over the
// float32 logits: the first largest of l_j + n_j, n_j = T g_j the token's Gumbel noise
// (gumbel_noise.h, the same bits here as there). Rounding is monotone, so where l_j lies in [lo_j,
// up_j], fl(l_j + n_j) lies in [fl(lo_j + n_j), fl(up_j + n_j)]: the screen keeps the tokens whose
// upper end reaches the largest lower end, and the first largest of their exact logits plus noise
// wins. The noise spreads the row's values (a Gumbel's scale is T), so a sampled row keeps about
// as few candidates as a greedy one.
//
// Sampled rows with a top-k cut take the sampler's token too: the tokens whose upper bound reaches
// the k-th largest lower bound get their exact logits, which give the k-th largest logit, and the
// draw runs over those that reach it (screen_top_k).
//
// Shapes: approx f32[R, V] (the bfloat16 or int8 product), x f32[R, K] (the head's input), rows
// f32[V, K] (the head's weight, a row per token: W transposed), norms f32[V] (|W_j|_2, rounded up),
// temperature f32[R] (0: greedy), keys u32[R, 2] (the noise's, for sampled rows), top_k s32[R]
// (sampled rows' cut, 0: none) -> tokens s32[R],
// their exact logits f32[R] (without noise), candidates s32[R] (exact logits computed per row).

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "bf16_rows.h"
#include "gumbel_noise.h"
#include "pool_work.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using redjax::f32xN, redjax::is_nan, redjax::kExponentBits, redjax::kLanes, redjax::load, redjax::moved,
    redjax::not_finite, redjax::u32xN;

// The float32 panel kernel's logits of tokens t[0..N): for each, acc = fma(x[k], w[k], acc) for k = 0
// .. K - 1 from zero. N chains at once (independent, so their latencies overlap); the empty asm keeps
// each step's result as it is, so -ffast-math cannot reorder or split a chain.
template <int N>
void exact_logits(const float* x, const float* rows, int64_t k, const int32_t* t, float* out) {
  const float* w[N];
  float acc[N];
  for (int c = 0; c < N; ++c) w[c] = rows + t[c] * k, acc[c] = 0.0f;
  for (int64_t i = 0; i < k; ++i)
    for (int c = 0; c < N; ++c) {
      acc[c] = __builtin_fmaf(x[i], w[c][i], acc[c]);
      asm("" : "+x"(acc[c]));
    }
  for (int c = 0; c < N; ++c) out[c] = acc[c];
}

constexpr double kWiden = 1.0 + 0x1p-6;  // every bound widened by 2^-6 for the float32 arithmetic that applies it

// exact_logits of tokens t[0..n), four chains at a time and the last 1-3 together
void exact_chains(const float* x, const float* rows, int64_t k, const int32_t* t, int64_t n, float* out) {
  int64_t c = 0;
  for (; c + 4 <= n; c += 4) exact_logits<4>(x, rows, k, t + c, out + c);
  switch (n - c) {
    case 3: exact_logits<3>(x, rows, k, t + c, out + c); break;
    case 2: exact_logits<2>(x, rows, k, t + c, out + c); break;
    case 1: exact_logits<1>(x, rows, k, t + c, out + c); break;
  }
}

// gamma_K: K float32 additions (a K + 2 margin), in any order, are within gamma_K sum |terms|
double gamma(int64_t k) { return (k + 2) * 0x1p-24 / (1.0 - (k + 2) * 0x1p-24); }

// The absolute parts of the screens' bounds (double, each caller rounds it once): subnormal operands
// and partial sums flushed to zero, at most 2^-126 (|W_j|_1 + |x|_1 + 2K) in all; the relative
// factor's share is 2^-120 sqrt(K) times |W_j|, the rest (`absolute_term`) stands alone.
double subnormal_factor(int64_t k) { return 0x1p-120 * std::sqrt(static_cast<double>(k)); }
double absolute_term(double xn, int64_t k) { return 0x1p-120 * (std::sqrt(static_cast<double>(k)) * xn + 2.0 * k); }

// c(K) of the bound above, widened.
double bound_factor(int64_t k) {
  const double u = 0x1p-8;
  return (2 * u + u * u + 2 * gamma(k) * (1 + 2 * u)) * kWiden;
}

// refine's s2: twice gamma_K |x|_2 (the dot's and the chain's rounding), widened, and the subnormal
// factor of the screens
float refine_factor(double xn, int64_t k) { return static_cast<float>(2 * gamma(k) * xn * kWiden + subnormal_factor(k)); }

struct Problem {
  const float* x;       // [R, K]
  const float* rows;    // [V, K]
  const float* norms;   // [V]
  int64_t v, k;
  int32_t* tokens;
  float* values;
  int32_t* candidates;
  const float* temperature;  // [R]: 0 for a greedy row
  const uint32_t* keys;      // [R, 2]: a sampled row's noise key
  const int32_t* top_k;      // [R]: a sampled row's top-k cut (0: none)
  const float* lost = nullptr;  // [V], the int8 screen's: |W_j - q(W_j)|_2, rounded up
  // a bfloat16 head (rows null): x rounded to bfloat16 pairs [R, steps], and the head's panels as
  // pairs [P, steps, kPanel] (panel_matmul.cc's layout)
  const uint32_t* pairs = nullptr;
  const uint32_t* panels = nullptr;
  int64_t steps = 0;
};

#ifdef __AVX512BF16__
constexpr int64_t kPanel = 32;  // columns per panel: panel_matmul.cc's kPanel
constexpr int64_t kAhead = 8;   // steps ahead the chains request their gathers' lines

// The bfloat16 panel kernel's logits of tokens t[0..n) for x's pairs xp [steps]: each token's column
// in a lane of its own, the kernel's VDPBF16PS chain over k from zero, in order (a lane's sums never
// depend on the others'), 16 tokens at a time, their panel pairs gathered.
void bf16_chains(const uint32_t* xp, const uint32_t* panels, int64_t steps, const int32_t* t, int64_t n, float* out) {
  for (int64_t c = 0; c < n; c += kLanes) {
    const int64_t lanes = std::min<int64_t>(kLanes, n - c);
    alignas(64) int32_t at[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) {
      const int32_t token = t[c + std::min(l, lanes - 1)];
      at[l] = static_cast<int32_t>(token / kPanel * steps * kPanel + token % kPanel);
    }
    __m512i index = _mm512_load_si512(at);
    const __m512i stride = _mm512_set1_epi32(static_cast<int32_t>(kPanel));
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < steps; ++i, index = _mm512_add_epi32(index, stride)) {
      if (i + kAhead < steps)  // each lane's pair kAhead steps on: a line of its own (a panel row apart)
        for (int64_t l = 0; l < lanes; ++l) __builtin_prefetch(panels + at[l] + (i + kAhead) * kPanel, 0, 3);
      const __m512i w = _mm512_i32gather_epi32(index, panels, 4);
      acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(xp[i]))),
                             reinterpret_cast<__m512bh>(w));
    }
    alignas(64) float sums[kLanes];
    _mm512_store_ps(sums, acc);
    for (int64_t l = 0; l < lanes; ++l) out[c + l] = sums[l];
  }
}
#endif

// Row r's exact logits of tokens t[0..n): the float32 chains over the rows, or the bfloat16 head's
void exact_of(const Problem& pb, int64_t r, const float* x, const int32_t* t, int64_t n, float* out) {
#ifdef __AVX512BF16__
  if (pb.panels != nullptr) return bf16_chains(pb.pairs + r * pb.steps, pb.panels, pb.steps, t, n, out);
#endif
  exact_chains(x, pb.rows, pb.k, t, n, out);
}

// |x|_2 in double
double row_norm(const float* x, int64_t k) {
  double sq = 0.0;
  for (int64_t i = 0; i < k; ++i) sq += double{x[i]} * x[i];
  return std::sqrt(sq);
}

// x . w in float32, 16 lanes along k, then across them: any order is within gamma_K sum_k |x_k w_k|
// of the real product, as the float32 kernel's chain is
float dot(const float* x, const float* w, int64_t k) {
  f32xN lanes = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) lanes += load(x + i) * load(w + i);
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; i < k; ++i) sum += x[i] * w[i];
  return sum;
}

// A sampled row's noise: its key and temperature, and the noise computed so far (by token)
struct RowNoise {
  uint32_t k0, k1;
  float temperature;
  float* by_token;  // [V]: filled for the tokens the screen computes it for
};

// Narrow the candidates (in token order) with their float32 dot products, vectorized along k, each
// within s2 * norms[j] + t of the kernel's logit (s2 = 2 gamma_K |x|, widened, as for both it and
// the dot): a tenth of a chain's time per candidate, where the int8 screen leaves tens of them.
// With `noise` (a sampled row), each bound moved by its token's noise.
void refine(const Problem& pb, const float* x, float s2, float t, const float* noise, std::vector<int32_t>& picked) {
  thread_local std::vector<float> los, ups;
  los.resize(picked.size()), ups.resize(picked.size());
  float lower = -std::numeric_limits<float>::max();
  for (size_t c = 0; c < picked.size(); ++c) {
    if (c + 1 < picked.size())  // the next candidate's row, while this one's is summed
      for (int64_t i = 0; i < pb.k; i += 16) __builtin_prefetch(pb.rows + picked[c + 1] * pb.k + i, 0, 3);
    const float d = dot(x, pb.rows + picked[c] * pb.k, pb.k), e = s2 * pb.norms[picked[c]];
    los[c] = d - e - t, ups[c] = d + e + t;
    if (noise) los[c] = moved(los[c], noise[picked[c]]), ups[c] = moved(ups[c], noise[picked[c]]);
    lower = std::max(lower, los[c]);
  }
  size_t kept = 0;
  for (size_t c = 0; c < picked.size(); ++c)
    if (ups[c] >= lower) picked[kept++] = picked[c];
  picked.resize(kept);
}

// Row r's result where one of its logits is NaN: V - 1, as the argmax and the draw of sampling.cc give
void no_number(const Problem& pb, int64_t r, const float* x, int64_t candidates) {
  const int32_t last = static_cast<int32_t>(pb.v - 1);
  pb.tokens[r] = last;
  exact_of(pb, r, x, &last, 1, &pb.values[r]);
  pb.candidates[r] = static_cast<int32_t>(candidates);
}

// Row r's token and exact logit, from approximate logits a f32[V] within e_j = s * norms[j] + t of
// the float32 kernel's, plus b * lost[j] with kLost (and s2 * norms[j] + t for refine). With kNoise
// (a sampled row) the token is the first largest of logit_j + n_j (gumbel_noise.h), the bounds
// moved by the noise (`moved`): the loud tokens' (and the largest lower bound moved by the least
// noise) give the lower bound; a quiet token is a candidate where its upper bound moved by the
// most a quiet token's noise can be reaches it, and then where moved by its own; else the first
// largest logit.
template <bool kLost, bool kNoise>
void screen_row(const Problem& pb, int64_t r, const float* a, float s, float b, float s2, float t,
                const RowNoise* rn) {
  const auto margin = [&](int64_t j) { return kLost ? s * pb.norms[j] + b * pb.lost[j] : s * pb.norms[j]; };
  const float* x = pb.x + r * pb.k;
  // One pass: lower = max_j (a_j - e_j), and each chunk's largest upper bound a_j + e_j (few
  // chunks hold a candidate; only those are read again). An approximate logit that is not finite
  // makes the screen void.
  constexpr int64_t kChunk = 16 * kLanes;
  const int64_t chunks = pb.v / kChunk;
  thread_local std::vector<float> tops;
  tops.resize(chunks);
  const f32xN zero = {}, sv = zero + s, bv = zero + b, tv = zero + t, least = zero - std::numeric_limits<float>::max();
  f32xN lanes = least;
  u32xN exponents = {};  // lanes whose exponent bits are all ones: an infinity or a NaN
  for (int64_t c = 0; c < chunks; ++c) {
    f32xN top = least;
    for (int64_t j = c * kChunk; j < (c + 1) * kChunk; j += kLanes) {
      const f32xN av = load(a + j), e = kLost ? sv * load(pb.norms + j) + bv * load(pb.lost + j) : sv * load(pb.norms + j);
      f32xN lo = av - e, up = av + e;
      if constexpr (kNoise) lo -= tv, up += tv;  // t inside each bound, before the noise
      lanes = lanes > lo ? lanes : lo;
      top = top > up ? top : up;
      exponents |= (reinterpret_cast<const u32xN&>(av) & kExponentBits) == kExponentBits;
    }
    float most = top[0];
    for (int l = 1; l < kLanes; ++l) most = std::max(most, top[l]);
    tops[c] = most;
  }
  bool ok = !not_finite(s) && !not_finite(b);
  float lower = -std::numeric_limits<float>::max();
  for (int l = 0; l < kLanes; ++l) lower = std::max(lower, lanes[l]), ok &= exponents[l] == 0;
  // a token's bounds as floats: [a_j - e_j, a_j + e_j], for a sampled row with t inside
  const auto bounds = [&](int64_t j) {
    float lo = a[j] - margin(j), up = a[j] + margin(j);
    if constexpr (kNoise) lo -= t, up += t;
    return std::pair{lo, up};
  };
  for (int64_t j = chunks * kChunk; j < pb.v; ++j) {
    lower = std::max(lower, bounds(j).first);
    ok &= !not_finite(a[j]);
  }
  if constexpr (!kNoise) lower -= 2 * t;  // a candidate's a_j + s n_j + t reaches the best a_i - s n_i - t
  thread_local std::vector<int32_t> ids;  // a sampled row's loud tokens, quiet candidates and their union
  float reach = 0.0f;  // a quiet token's noise is at most this (0 for a greedy row)
  int64_t nl = 0;
  float* noise = kNoise ? rn->by_token : nullptr;
  if constexpr (kNoise) {
    if (static_cast<int64_t>(ids.size()) < 3 * (pb.v + kLanes)) ids.resize(3 * (pb.v + kLanes));
    thread_local std::vector<float> loud_noise;
    loud_noise.resize(pb.v + kLanes);
    nl = redjax::loud_tokens(rn->k0, rn->k1, pb.v, ids.data());
    redjax::noise_of(rn->k0, rn->k1, rn->temperature, ids.data(), nl, loud_noise.data());
    lower = moved(lower, rn->temperature * redjax::kLeastG);  // the largest lower bound, the least noise
    for (int64_t i = 0; i < nl; ++i) lower = std::max(lower, moved(bounds(ids[i]).first, loud_noise[i]));
    reach = rn->temperature * redjax::kQuietG;
  }
  // the candidates, in token order; every token if the screen is void
  thread_local std::vector<int32_t> picked;
  thread_local std::vector<float> exact;
  picked.clear();
  if (!ok) {
    for (int64_t i = 0; i < pb.v; ++i) picked.push_back(static_cast<int32_t>(i));
  } else {
    const auto reaches = [&](float up) { return kNoise ? moved(up, reach) >= lower : up >= lower; };
    for (int64_t c = 0; c < chunks; ++c)
      if (reaches(tops[c]))
        for (int64_t i = c * kChunk; i < (c + 1) * kChunk; ++i)
          if (reaches(bounds(i).second)) picked.push_back(static_cast<int32_t>(i));
    for (int64_t j = chunks * kChunk; j < pb.v; ++j)
      if (reaches(bounds(j).second)) picked.push_back(static_cast<int32_t>(j));
  }
  if constexpr (kNoise) {  // with the loud tokens, each with its own noise, kept where its bound reaches
    int32_t* merged = ids.data() + 2 * (pb.v + kLanes);
    const int64_t n = ok ? redjax::merge_tokens(ids.data(), nl, picked.data(), static_cast<int64_t>(picked.size()), merged)
                         : static_cast<int64_t>(picked.size());
    if (ok) picked.assign(merged, merged + n);
    thread_local std::vector<float> values;
    values.resize(n + kLanes);
    redjax::noise_of(rn->k0, rn->k1, rn->temperature, picked.data(), n, values.data());
    size_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      noise[picked[i]] = values[i];
      if (!ok || moved(bounds(picked[i]).second, values[i]) >= lower) picked[kept++] = picked[i];
    }
    picked.resize(kept);
  }
  if (ok && picked.size() > 2 && pb.rows != nullptr) refine(pb, x, s2, t, noise, picked);  // (a bfloat16 head: no rows)
  const int64_t n = static_cast<int64_t>(picked.size());
  exact.resize(n + 4);
  exact_of(pb, r, x, picked.data(), n, exact.data());
  int64_t best = 0, c;  // the first largest (n >= 1: the largest lower bound's token is always kept)
  bool nan = false;
  for (c = 0; c < n; ++c) nan |= is_nan(exact[c]);
  if constexpr (kNoise) {  // as the sampler's draw: the exact logit plus the token's noise
    thread_local std::vector<float> noisy;
    noisy.resize(n);
    for (c = 0; c < n; ++c) noisy[c] = moved(exact[c], noise[picked[c]]);
    for (c = 0; c < n; ++c)
      if (noisy[c] > noisy[best]) best = c;
  } else {
    for (c = 0; c < n; ++c)
      if (exact[c] > exact[best]) best = c;
  }
  if (nan) return no_number(pb, r, x, n);
  pb.tokens[r] = n ? picked[best] : 0;
  pb.values[r] = n ? exact[best] : 0.0f;
  pb.candidates[r] = static_cast<int32_t>(n);
}

// A sampled row with a top-k cut (0 < top_k < V): the sampler masks every logit whose scaled value
// fl(l_j / T) is under the k-th largest's, then draws the first largest of l_j + n_j from the rest.
// The k-th largest logit is at least L, the k-th largest lower bound a_j - e_j; a token whose upper
// bound stays under L, less 2^-20 of it (so its scaled value stays under the k-th's even after
// rounding), can be neither in the top-k set nor tied with it there. The rest (about 12k a row
// through the int8 bound, with random weights) are narrowed alike by float32 dot products (as
// `refine` narrows), and the few more than k left get their exact logits; their k-th largest is
// the row's, and the draw runs over those whose
// scaled value reaches its scaled value, scaled as the sampler scales (times the float32 reciprocal
// of T: sampler.filter_logits).
template <bool kLost>
void screen_top_k(const Problem& pb, int64_t r, const float* a, float s, float b, float s2, float t, const RowNoise& rn,
                  int64_t top_k) {
  const auto margin = [&](int64_t j) { return kLost ? s * pb.norms[j] + b * pb.lost[j] : s * pb.norms[j]; };
  const float* x = pb.x + r * pb.k;
  // a bound under v by 2^-20 of it: a logit under it stays under v's scaled value after rounding
  const auto below = [](float v) { return v - (std::fabs(v) * 0x1p-20f + 0x1p-100f); };
  thread_local std::vector<float> lows, ups, exact, noise, largest;
  thread_local std::vector<int32_t> picked;
  lows.resize(pb.v), ups.resize(pb.v + kLanes);
  bool ok = !not_finite(s) && !not_finite(b);
  for (int64_t j = 0; j < pb.v; ++j) {
    lows[j] = a[j] - margin(j) - t, ups[j] = a[j] + margin(j) + t;
    ok &= !not_finite(a[j]);  // else every token is a candidate, as in screen_row
  }
  largest.resize(top_k);
  picked.clear();
  if (ok) {
    redjax::largest_values(lows.data(), pb.v, top_k, largest.data());
    const float reach = below(largest[top_k - 1]);
    picked.resize(pb.v + kLanes);
    int64_t wide = 0, j = 0;
    for (; j + kLanes <= pb.v; j += kLanes)
      wide += redjax::put_lanes(load(ups.data() + j) >= reach, j, picked.data() + wide);
    for (; j < pb.v; ++j)
      if (ups[j] >= reach) picked[wide++] = static_cast<int32_t>(j);
    picked.resize(wide);
    // narrowed as `refine` narrows: float32 dot products within s2 |W_j| + t of the chains (a
    // bfloat16 head has no float32 rows: its top-k rows take the chains of every candidate, which
    // costs about the whole head, so the engine sends them to the head itself, head_choice.py)
    for (int64_t c = 0; c < (pb.rows != nullptr ? wide : 0); ++c) {
      if (c + 1 < wide)  // the next candidate's row, while this one's is summed
        for (int64_t i = 0; i < pb.k; i += 16) __builtin_prefetch(pb.rows + picked[c + 1] * pb.k + i, 0, 3);
      const float d = dot(x, pb.rows + picked[c] * pb.k, pb.k), e = s2 * pb.norms[picked[c]] + t;
      lows[c] = d - e, ups[c] = d + e;
    }
    if (pb.rows != nullptr) {
      redjax::largest_values(lows.data(), wide, top_k, largest.data());
      const float narrow = below(largest[top_k - 1]);
      int64_t kept = 0;
      for (int64_t c = 0; c < wide; ++c)
        if (ups[c] >= narrow) picked[kept++] = picked[c];
      picked.resize(kept);
    }
  } else {
    for (int64_t j = 0; j < pb.v; ++j) picked.push_back(static_cast<int32_t>(j));
  }
  const int64_t n = static_cast<int64_t>(picked.size());
  exact.resize(n + 4);
  exact_of(pb, r, x, picked.data(), n, exact.data());
  bool nan = false;
  for (int64_t c = 0; c < n; ++c) nan |= is_nan(exact[c]);
  if (nan) return no_number(pb, r, x, n);
  redjax::largest_values(exact.data(), n, top_k, largest.data());
  float inverse = 1.0f / std::max(rn.temperature, 1e-5f);  // the sampler's scaling: times 1 / max(T, 1e-5)
  asm("" : "+x"(inverse));
  const auto scaled = [=](float logit) { return logit * inverse; };
  const float cut = scaled(largest[top_k - 1]);
  int64_t kept = 0;
  for (int64_t c = 0; c < n; ++c)
    if (scaled(exact[c]) >= cut) picked[kept] = picked[c], exact[kept++] = exact[c];
  noise.resize(kept + kLanes);
  redjax::noise_of(rn.k0, rn.k1, rn.temperature, picked.data(), kept, noise.data());
  int64_t best = 0;  // the first largest noisy logit, in token order
  for (int64_t c = 1; c < kept; ++c)
    if (moved(exact[c], noise[c]) > moved(exact[best], noise[best])) best = c;
  pb.tokens[r] = picked[best], pb.values[r] = exact[best], pb.candidates[r] = static_cast<int32_t>(n);
}

// checks: x [R, K], rows [V, K], norms [V] and the three results [R] (R and V as the logits give them)
ffi::Error check(int64_t r, int64_t v, ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd,
                 ffi::Span<const int64_t> nd, int64_t results, int64_t temperatures, int64_t keys, int64_t top_k) {
  if (xd.size() != 2 || wd.size() != 2 || nd.size() != 1 || xd[0] != r || wd[0] != v || wd[1] != xd[1] ||
      nd[0] != v || results != 3 * r || temperatures != r || keys != 2 * r || top_k != r)
    return ffi::Error::InvalidArgument("screened_argmax: expected logits [R,V], x [R,K], rows [V,K], norms [V], "
                                       "temperature [R], keys [R,2], top_k [R]");
  if (v == 0 || v > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("screened_argmax: the vocabulary must hold 1 to 2^31 - 1 tokens");
  return ffi::Error::Success();
}

// Screens row r by `screen_row`, with its noise where its temperature is above zero, and by
// `screen_top_k` where it also has a top-k cut
template <bool kLost>
void screen_noisy(const Problem& pb, int64_t r, const float* a, float s, float b, float s2, float t) {
  const float temperature = pb.temperature[r];
  if (!(temperature > 0.0f)) return screen_row<kLost, false>(pb, r, a, s, b, s2, t, nullptr);
  thread_local std::vector<float> by_token;
  by_token.resize(pb.v);
  const RowNoise rn{pb.keys[2 * r], pb.keys[2 * r + 1], temperature, by_token.data()};
  if (pb.top_k[r] > 0 && pb.top_k[r] < pb.v) return screen_top_k<kLost>(pb, r, a, s, b, s2, t, rn, pb.top_k[r]);
  screen_row<kLost, true>(pb, r, a, s, b, s2, t, &rn);
}

// `row(r)` screens row r: rows in items of a few (a row's screen reads V logits: 4096-32000 here)
template <typename Row>
void screen_rows(ffi::ThreadPool& pool, int64_t count, int64_t v, Row row) {
  const int64_t per_item = redjax::units_per_item(v, 1);
  redjax::run_on_pool(pool, (count + per_item - 1) / per_item, [=](int64_t item) {
    for (int64_t r = item * per_item; r < std::min(count, (item + 1) * per_item); ++r) row(r);
  });
}

ffi::Error ScreenedArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> approx, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> norms,
                              ffi::Buffer<ffi::F32> temperature, ffi::Buffer<ffi::U32> keys,
                              ffi::Buffer<ffi::S32> top_k, ffi::ResultBuffer<ffi::S32> tokens,
                              ffi::ResultBuffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> candidates) {
  const auto ad = approx.dimensions();
  if (ad.size() != 2) return ffi::Error::InvalidArgument("screened_argmax: approx must be [R, V]");
  const int64_t results = tokens->element_count() + values->element_count() + candidates->element_count();
  if (auto e = check(ad[0], ad[1], x.dimensions(), rows.dimensions(), norms.dimensions(), results,
                     temperature.element_count(), keys.element_count(), top_k.element_count());
      e.failure())
    return e;
  const int64_t k = x.dimensions()[1];
  const Problem pb{x.typed_data(),         rows.typed_data(),     norms.typed_data(),      ad[1],
                   k,                      tokens->typed_data(),  values->typed_data(),    candidates->typed_data(),
                   temperature.typed_data(), keys.typed_data(),   top_k.typed_data()};
  const double factor = bound_factor(k);
  const float* a = approx.typed_data();
  screen_rows(pool, ad[0], pb.v, [=](int64_t r) {
    // e_j = s * norms[j] + t: the relative bound, and an absolute one for subnormal operands and
    // partial sums (flushed to zero by VDPBF16PS: at most 2^-126 (|W_j|_1 + |x|_1 + 2K) in all)
    const double xn = row_norm(pb.x + r * k, k);
    const float s = static_cast<float>(xn * factor + subnormal_factor(k));
    const float t = static_cast<float>(absolute_term(xn, k));
    screen_noisy<false>(pb, r, a + r * pb.v, s, 0.0f, refine_factor(xn, k), t);
  });
  return ffi::Error::Success();
}

// Row r through the int8 screen's bound (ScreenedArgmaxI8Impl says what it is): approx f32[R, V],
// stats f32[R, 3] (x's scale, |x - q(x)|, |q(x)|: not finite where x is not), xn = |x| (the x the
// int8 product quantized)
void screen_i8_row(const Problem& pb, int64_t r, const float* approx, const float* stats, double xn) {
  const double gk = gamma(pb.k), u3 = 3.01 * 0x1p-24, kept = stats[3 * r + 2];
  const float s = static_cast<float>((stats[3 * r + 1] + gk * xn + u3 * kept) * kWiden + subnormal_factor(pb.k));
  const float b = static_cast<float>(kept * (1.0 + u3) * kWiden);
  const float t = static_cast<float>(absolute_term(xn, pb.k) + 0x1p-100 * pb.k);
  const float scale = stats[3 * r];
  screen_noisy<true>(pb, r, approx + r * pb.v, not_finite(scale) ? scale : s, b, refine_factor(xn, pb.k), t);
}

// The int8 product's approximate logits f32[R, V] (PanelMatmulI8) and x's quantization stats
// f32[R, 3] (i8_rows.h), x, the float32 rows and norms, and `lost` f32[V], |W_j - q(W_j)|_2 rounded up.
//
// With q(x) and q(W_j) the quantized vectors as reals, |x.W_j - q(x).q(W_j)| <= |x - q(x)| |W_j| +
// |q(x)| |W_j - q(W_j)|; the float32 kernel's logit is within gamma_K |x| |W_j| of x.W_j; the
// approximate logit within 3 roundings (3.01 2^-24) of q(x).q(W_j), at most |q(x)| (|W_j| + |W_j -
// q(W_j)|). So e_j = s n_j + b lost_j with s = |x - q(x)| + gamma_K |x| + 3.01 2^-24 |q(x)| and
// b = |q(x)| (1 + 3.01 2^-24), each widened 2^-6 for the arithmetic that applies them, plus the
// subnormal terms of the bfloat16 screen, and K 2^-100 for an approximate logit whose scale underflows.
ffi::Error ScreenedArgmaxI8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> approx, ffi::Buffer<ffi::F32> stats,
                                ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> norms,
                                ffi::Buffer<ffi::F32> lost, ffi::Buffer<ffi::F32> temperature,
                                ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::S32> top_k,
                                ffi::ResultBuffer<ffi::S32> tokens,
                                ffi::ResultBuffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> candidates) {
  const auto ad = approx.dimensions();
  if (ad.size() != 2) return ffi::Error::InvalidArgument("screened_argmax_i8: approx must be [R, V]");
  const int64_t results = tokens->element_count() + values->element_count() + candidates->element_count();
  if (auto e = check(ad[0], ad[1], x.dimensions(), rows.dimensions(), norms.dimensions(), results,
                     temperature.element_count(), keys.element_count(), top_k.element_count());
      e.failure())
    return e;
  if (stats.element_count() != 3 * ad[0] || lost.element_count() != ad[1])
    return ffi::Error::InvalidArgument("screened_argmax_i8: expected stats [R, 3] and lost [V]");
  const int64_t k = x.dimensions()[1];
  const Problem pb{x.typed_data(),         rows.typed_data(),     norms.typed_data(),      ad[1],
                   k,                      tokens->typed_data(),  values->typed_data(),    candidates->typed_data(),
                   temperature.typed_data(), keys.typed_data(),   top_k.typed_data(), lost.typed_data()};
  const float *a = approx.typed_data(), *st = stats.typed_data();
  screen_rows(pool, ad[0], pb.v, [=](int64_t r) { screen_i8_row(pb, r, a, st, row_norm(pb.x + r * k, k)); });
  return ffi::Error::Success();
}

#ifdef __AVX512BF16__
// A bfloat16 model's head: the int8 product of x rounded to bfloat16 (x') and its stats, x (float32,
// rounded here as the panel kernel rounds it), the head's bfloat16 panels (as 32-bit pairs), the
// norms and `lost` of its rows (as float32). The bound is ScreenedArgmaxI8's for x': the bfloat16
// product of x' and W_j, K float32 additions of exact products (flushed where subnormal, as that
// bound's absolute terms allow), is within gamma_K |x'| |W_j| of x'.W_j as the float32 chain is.
ffi::Error ScreenedArgmaxI8Bf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> approx, ffi::Buffer<ffi::F32> stats,
                                    ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> panels, ffi::Buffer<ffi::F32> norms,
                                    ffi::Buffer<ffi::F32> lost, ffi::Buffer<ffi::F32> temperature,
                                    ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::S32> top_k,
                                    ffi::ResultBuffer<ffi::S32> tokens,
                                    ffi::ResultBuffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> candidates) {
  const auto ad = approx.dimensions(), xd = x.dimensions(), pd = panels.dimensions();
  if (ad.size() != 2 || xd.size() != 2 || pd.size() != 3 || xd[0] != ad[0] || pd[1] != (xd[1] + 1) / 2 ||
      pd[2] != 2 * kPanel || pd[0] * kPanel < ad[1] || pd[0] * pd[1] * kPanel > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("screened_argmax_i8_bf16: expected approx [R, V], x [R, K] and panels "
                                       "[ceil(V / 32), ceil(K / 2), 64] of under 2^31 pairs");
  const int64_t r_count = ad[0], v = ad[1], k = xd[1], steps = pd[1];
  if (stats.element_count() != 3 * r_count || lost.element_count() != v || norms.element_count() != v ||
      tokens->element_count() != r_count || values->element_count() != r_count ||
      candidates->element_count() != r_count || temperature.element_count() != r_count ||
      keys.element_count() != 2 * r_count || top_k.element_count() != r_count)
    return ffi::Error::InvalidArgument("screened_argmax_i8_bf16: expected stats [R, 3], norms and lost [V], "
                                       "temperature [R], keys [R, 2], top_k [R]");
  if (v == 0 || v > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("screened_argmax_i8_bf16: the vocabulary must hold 1 to 2^31 - 1 tokens");
  std::vector<uint32_t> pairs(r_count * steps);  // x as the panel kernel rounds it
  uint32_t* rounded = pairs.data();
  Problem pb{x.typed_data(),         nullptr,               norms.typed_data(),      v,
             k,                      tokens->typed_data(),  values->typed_data(),    candidates->typed_data(),
             temperature.typed_data(), keys.typed_data(),   top_k.typed_data(), lost.typed_data()};
  pb.pairs = pairs.data(), pb.panels = reinterpret_cast<const uint32_t*>(panels.untyped_data()), pb.steps = steps;
  const float *a = approx.typed_data(), *st = stats.typed_data();
  screen_rows(pool, r_count, v, [=](int64_t r) {
    uint32_t* xp = rounded + r * steps;
    redjax::round_rows_bf16(pb.x + r * k, 1, k, xp);
    double sq = 0.0;  // |x'|, from the pairs
    for (int64_t i = 0; i < steps; ++i) {
      const float lo = std::bit_cast<float>(xp[i] << 16), hi = std::bit_cast<float>(xp[i] & 0xffff0000u);
      sq += double{lo} * lo + double{hi} * hi;
    }
    screen_i8_row(pb, r, a, st, std::sqrt(sq));
  });
  return ffi::Error::Success();
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScreenedArgmax, ScreenedArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScreenedArgmaxI8, ScreenedArgmaxI8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

#ifdef __AVX512BF16__
XLA_FFI_DEFINE_HANDLER_SYMBOL(ScreenedArgmaxI8Bf16, ScreenedArgmaxI8Bf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
#endif
