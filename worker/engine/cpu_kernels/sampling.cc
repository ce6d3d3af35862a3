// The costly parts of sampling on XLA's CPU backend, called from JAX through the XLA FFI: top-k and
// top-p cutoffs, the draw itself, the greedy argmax and the N largest logprobs.
//
// Cutoffs. Sorting every row of the vocabulary, the jnp sampler's way until session 51, took XLA's
// CPU sort 470 ms for 64 rows of 32000 logits, ten times a llama-100m decode step. A row needs no
// order beyond its cut:
// - top_k up to 256: the k largest kept in a sorted buffer in one pass (vectors.h largest_values);
//   a larger top_k: std::nth_element (O(V));
// - top_p: values too small to matter set aside (a bound from the softmax denominator), the rest
//   bucketed by value in one vector pass, and only the bucket where the running mass passes top_p
//   sorted (bucket_cut). Until session 58 ever larger leading blocks were sorted until the mass
//   passed top_p: fast for a peaked row, but a flat one (random weights, a high temperature) keeps
//   most of the vocabulary, and 64 such rows of 32000 took 79 ms (2.8 ms now).
//
// The result per row is one value, `cut`: the sampler masks every logit below it. It is the larger
// of the k-th largest logit (top_k > 0) and the smallest logit the top-p rule keeps, where, in
// descending order, a value is kept while the probability mass strictly before it (renormalized
// over the top-k set) is below top_p; the largest is always kept, and top_p >= 1 keeps all. These
// are the jnp path's rules (worker/engine/sampler.py), so ties at the cut are kept as there.
// Rows with neither top_k nor top_p < 1 get -inf (nothing cut) without looking at their logits.
//
// Draw. A sampled row at temperature T takes the first largest of logit_j + T g_j, where g_j is
// Gumbel noise hashed from the row's key and j (gumbel_noise.h): by the Gumbel-max property an
// exact draw from softmax(logits / T), masked (-inf) tokens never drawn. The noise is a function of
// the row's key and the token alone, so the screened heads (screened_argmax.cc), which add the same
// noise to the same float32 logits, draw the same token without computing most of them. (Threefry
// noise per token, the jnp sampler's until session 51, took 13 ms for 64 rows of 32000; the hash and
// two logarithms take about a tenth of that.) A row at T = 0 takes the argmax.
//
// Argmax. Greedy rows take the first index of the row's largest logit. XLA's CPU backend runs that
// as a max, a compare-select over the whole row and a min (3.4 ms for 62 rows of 32000 on the
// 2-core Intel VM, 5 % of a llama-100m decode step); here it is one pass per row, rows in parallel.
// A row holding a NaN gives V - 1, as the jnp path (sampler.first_argmax) does.
//
// Top N. Logprobs report each row's N most likely tokens. XLA's CPU top-k took 2.5 ms for 64 rows
// of 32000 (N = 20), 6 % of a llama-100m decode step. Here one pass per row keeps the N largest in
// a small sorted buffer: 16 values at a time are compared with the buffer's smallest and skipped
// together when none is larger (almost every block once the buffer holds typical values). Order as
// jax.lax.top_k: descending, equal values by lower index first. Rows holding NaN: unspecified.
//
// Shapes: cutoffs: logits f32[R, V] (temperature applied); top_k i32[R] (0: off); top_p f32[R];
// cut f32[R]. draw: logits f32[R, V] (masked entries -inf); temperature f32[R]; keys u32[R, 2]; token i32[R].
// argmax: logits f32[R, V]; token i32[R]. top_n: x f32[R, V]; values f32[R, N]; ids i32[R, N] (N <= V).

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "gumbel_noise.h"
#include "pool_work.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBufferedTopK = 256;  // top_k up to this: the k largest kept in a sorted buffer, one pass
constexpr int32_t kBuckets = 4096;  // top-p: value buckets between the largest value and the floor

using redjax::f32xN, redjax::i32xN, redjax::is_nan, redjax::kLanes, redjax::load, redjax::u32xN;
constexpr float kNone = -std::numeric_limits<float>::infinity();

// -inf by its bits: the kernels build with -ffast-math, under which a compiler may assume no
// operand is infinite and fold a comparison with -inf away
inline bool masked(float x) { return std::bit_cast<uint32_t>(x) == 0xff800000u; }

// A row's working memory, kept by each pool thread across calls
struct CutScratch {
  std::vector<float> a;  // the row's values, reordered (top_k past kBufferedTopK)
  std::vector<float> top;  // the top-k buffer's values, descending
  std::vector<int32_t> bucket;  // bucket_cut: the values at or above the floor: each one's bucket,
  std::vector<float> value, weight;  // value and probability
  std::vector<double> mass;  // each bucket's
  std::vector<std::pair<float, float>> inside;  // the crossing bucket's (value, probability), sorted
};

// 16 values from p[0, n) (n < 16 padded with -inf)
inline f32xN load_part(const float* p, int64_t n) {
  if (n >= kLanes) return load(p);
  f32xN v = f32xN{} + kNone;
  for (int64_t l = 0; l < n; ++l) v[l] = p[l];
  return v;
}

// The lanes of b, x and w where `mask` is true, in order, at bo, xo and wo (each with room for 16);
// -> how many. Without branches where the CPU compresses a register.
inline int64_t keep_lanes(i32xN mask, i32xN b, f32xN x, f32xN w, int32_t* bo, float* xo, float* wo) {
#ifdef __AVX512F__
  const __mmask16 bits = _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask);
  _mm512_storeu_si512(bo, _mm512_maskz_compress_epi32(bits, (__m512i)b));
  _mm512_storeu_ps(xo, _mm512_maskz_compress_ps(bits, (__m512)x));
  _mm512_storeu_ps(wo, _mm512_maskz_compress_ps(bits, (__m512)w));
  return __builtin_popcount(bits);
#else
  int64_t n = 0;
  for (int l = 0; l < kLanes; ++l)
    if (mask[l]) bo[n] = b[l], xo[n] = x[l], wo[n++] = w[l];
  return n;
#endif
}

// The top-p cut over n values a[0, n) (the top-k set, or the whole row), `top` the largest, finite,
// and `kth` the top-k cut (-inf: none). In descending order the first value whose running mass
// reaches top_p is the cut; the values at or below it are kept while the mass strictly before them
// is under top_p.
//
// Sorting costs n log n, and a flat row keeps most of a large vocabulary (64 rows of 32000 values:
// 80 ms by sorting ever larger blocks). Instead:
// - the softmax denominator z in one vector pass;
// - values under `floor` cannot be kept: together they hold less than 1 - top_p of the mass (at most
//   n of them, each under (1 - top_p) / n, with 1 % to spare for rounding);
// - every value at or above it gets a bucket by its distance below `top`, kBuckets of them down to
//   the floor, and its probability, in one vector pass (the empty asm stops -ffast-math contracting
//   or reordering the arithmetic, so one instruction sequence serves every value: equal values
//   share a bucket and a larger value never lands in a later one); those values leave it compressed;
// - the buckets' masses in order find the one where the running mass passes top_p, and only that
//   bucket's values are sorted.
float bucket_cut(const float* a, int64_t n, float top, float kth, float top_p, CutScratch& s) {
  f32xN sums = {};
  const f32xN top_v = f32xN{} + top;
  for (int64_t t = 0; t < n; t += kLanes) sums += redjax::exp_lanes(load_part(a + t, n - t) - top_v);
  float z = 0.0f;
  for (int l = 0; l < kLanes; ++l) z += sums[l];
  const float floor = top + std::log(0.99f * (1.0f - top_p) * z / float(n));
  if (!(top - floor > 0.0f) || redjax::not_finite(floor)) {  // magnitudes past float's resolution: sort
    s.a.assign(a, a + n);
    std::sort(s.a.begin(), s.a.end(), std::greater<float>());
    double before = 0.0;
    for (float value : s.a)
      if ((before += std::exp(value - top) / z) >= top_p) return value;
    return kth;
  }
  const f32xN scale = f32xN{} + float(kBuckets) / (top - floor), floor_v = f32xN{} + floor;
  const i32xN lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, last = i32xN{} + (kBuckets - 1);
  s.bucket.resize(n + kLanes), s.value.resize(n + kLanes), s.weight.resize(n + kLanes);
  int64_t kept = 0;  // values at or above the floor
  for (int64_t t = 0; t < n; t += kLanes) {
    const f32xN x = load_part(a + t, n - t);
    f32xN below = top_v - x;
    redjax::keep_as_is(below);
    f32xN q = below * scale;
    redjax::keep_as_is(q);
    i32xN b = __builtin_convertvector(q, i32xN);  // truncated: q >= 0, at most kBuckets and a rounding
    b = b > last || b < 0 ? last : b;
    const i32xN in = (lane + int32_t(t) < int32_t(n)) && x >= floor_v;
    kept += keep_lanes(in, b, x, redjax::exp_lanes(x - top_v) / z, s.bucket.data() + kept, s.value.data() + kept,
                       s.weight.data() + kept);
  }
  const int32_t* bucket = s.bucket.data();
  const float* value = s.value.data();
  s.mass.assign(kBuckets, 0.0);
  for (int64_t i = 0; i < kept; ++i) s.mass[bucket[i]] += s.weight[i];
  double before = 0.0;  // the mass of the buckets before b
  int32_t b = 0;
  for (; b < kBuckets && before + s.mass[b] < top_p; ++b) before += s.mass[b];
  // the cut where the running mass never reaches top_p: the least value kept, or kth if none is dropped
  const auto all = [&] { return kept < n ? *std::min_element(value, value + kept) : kth; };
  if (b == kBuckets) return all();
  s.inside.clear();
  f32xN next_v = f32xN{} + kNone;  // the largest value after bucket b (above the floor)
  const i32xN b_v = i32xN{} + b;
  int64_t i = 0;
  for (; i + kLanes <= kept; i += kLanes) {
    i32xN bi;
    std::memcpy(&bi, bucket + i, sizeof bi);
    const f32xN x = load(value + i);
    next_v = bi > b_v && x > next_v ? x : next_v;
    const i32xN here = bi == b_v;
    bool any = false;
    for (int l = 0; l < kLanes; ++l) any |= here[l] != 0;
    for (int l = 0; any && l < kLanes; ++l)
      if (here[l]) s.inside.emplace_back(value[i + l], s.weight[i + l]);
  }
  float next = kNone;
  bool has_next = false;
  for (int l = 0; l < kLanes && i > 0; ++l) {  // (a lane holds -inf if it never saw a later value)
    const bool seen = !masked(next_v[l]);
    next = seen && (!has_next || next_v[l] > next) ? next_v[l] : next, has_next |= seen;
  }
  for (; i < kept; ++i) {
    if (bucket[i] == b) s.inside.emplace_back(value[i], s.weight[i]);
    else if (bucket[i] > b) next = has_next ? std::max(next, value[i]) : value[i], has_next = true;
  }
  std::sort(s.inside.begin(), s.inside.end(), [](const auto& l, const auto& r) { return l.first > r.first; });
  for (const auto& [x, weight] : s.inside)
    if ((before += weight) >= top_p) return x;
  // the bucket's mass, summed in another order, reached top_p and its running sum did not: the
  // next value does
  return has_next ? next : all();
}

// A row's cut: the larger of the k-th largest value (top_k > 0) and the top-p cut within the top-k
// set (bucket_cut); -inf with neither.
float row_cut(const float* logits, int64_t v, int32_t top_k, float top_p, CutScratch& s) {
  const int64_t k = top_k > 0 ? std::min<int64_t>(top_k, v) : v;
  const bool by_p = top_p < 1.0f;
  if (k == v && !by_p) return kNone;
  if (k < v && k <= kBufferedTopK) {  // the k largest, descending, in one pass
    s.top.resize(k);
    redjax::largest_values(logits, v, k, s.top.data());
    const float kth = s.top[k - 1], top = s.top[0];
    if (!by_p || masked(top)) return kth;
    if (redjax::not_finite(top)) return top;  // +inf: all the mass where the row is +inf
    float z = 0.0f;
    for (float value : s.top) z += std::exp(value - top);
    double before = 0.0;
    for (float value : s.top)
      if ((before += std::exp(value - top) / z) >= top_p) return value;
    return kth;
  }
  const float* set = logits;  // the top-k set
  float kth = kNone;
  if (k < v) {
    s.a.assign(logits, logits + v);
    std::nth_element(s.a.begin(), s.a.begin() + (k - 1), s.a.end(), std::greater<float>());
    kth = s.a[k - 1], set = s.a.data();
    if (!by_p) return kth;
  }
  const float top = redjax::max_of(set, k, kNone);
  if (masked(top)) return kth;  // nothing finite to renormalize
  if (redjax::not_finite(top)) return top;  // +inf: all the mass where the row is +inf (NaN: nothing kept)
  return bucket_cut(set, k, top, kth, top_p, s);
}

ffi::Error SamplingCutoffsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> top_k,
                               ffi::Buffer<ffi::F32> top_p, ffi::ResultBuffer<ffi::F32> cut) {
  auto ld = logits.dimensions();
  if (ld.size() != 2 || top_k.element_count() != ld[0] || top_p.element_count() != ld[0] ||
      cut->element_count() != ld[0])
    return ffi::Error::InvalidArgument("sampling_cutoffs: expected logits [R,V], top_k [R], top_p [R], cut [R]");
  const int64_t rows = ld[0], v = ld[1];
  const float* x = logits.typed_data();
  const int32_t* ks = top_k.typed_data();
  const float* ps = top_p.typed_data();
  float* out = cut->typed_data();
  if (v == 0) {
    std::fill(out, out + rows, -std::numeric_limits<float>::infinity());
    return ffi::Error::Success();
  }
  redjax::run_on_pool(pool, rows, [=](int64_t r) {
    thread_local CutScratch scratch;
    out[r] = row_cut(x + r * v, v, ks[r], ps[r], scratch);
  });
  return ffi::Error::Success();
}

int32_t row_argmax(const float* x, int64_t v) {
  // One pass over 16 values at a time (the `omp simd` form stayed scalar): each lane keeps its
  // largest value, the first index where it saw it, and whether it saw a NaN. The answer is the
  // smallest index among the lanes holding the overall maximum.
  f32xN top_lanes = f32xN{} - std::numeric_limits<float>::infinity();
  i32xN at_lanes = i32xN{}, index;
  for (int l = 0; l < kLanes; ++l) index[l] = l;
  u32xN nan_lanes = u32xN{};
  int64_t i = 0;
  for (; i + kLanes <= v; i += kLanes, index += int32_t(kLanes)) {
    const f32xN x16 = load(x + i);
    nan_lanes |= (reinterpret_cast<const u32xN&>(x16) & 0x7fffffffu) > 0x7f800000u;
    const auto larger = x16 > top_lanes;  // strictly: a lane keeps the first index of its maximum
    top_lanes = larger ? x16 : top_lanes;
    at_lanes = larger ? index : at_lanes;
  }
  float top = -std::numeric_limits<float>::infinity();
  int64_t at = -1;
  bool nan = false;
  for (int l = 0; l < kLanes && i > 0; ++l) {  // (no lane saw a value when v < 16)
    nan |= nan_lanes[l] != 0;
    if (at < 0 || top_lanes[l] > top || (top_lanes[l] == top && at_lanes[l] < at))
      top = top_lanes[l], at = at_lanes[l];
  }
  for (; i < v; ++i) {  // the tail: later indices, so only a larger value wins
    nan |= is_nan(x[i]);
    if (at < 0 || x[i] > top) top = x[i], at = i;
  }
  return nan ? int32_t(v - 1) : int32_t(at);
}

ffi::Error SamplingArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> token) {
  auto ld = logits.dimensions();
  if (ld.size() != 2 || token->element_count() != ld[0])
    return ffi::Error::InvalidArgument("sampling_argmax: expected logits [R,V], token [R]");
  const int64_t rows = ld[0], v = ld[1];
  const float* x = logits.typed_data();
  int32_t* out = token->typed_data();
  if (v == 0) {
    std::fill(out, out + rows, 0);
    return ffi::Error::Success();
  }
  redjax::run_on_pool(pool, rows, [=](int64_t r) { out[r] = row_argmax(x + r * v, v); });
  return ffi::Error::Success();
}

// A row at temperature t > 0: the first largest of x_j + t g_j (gumbel_noise.h); t = 0: the first
// largest of x_j. Masked logits (-inf) stay -inf; a NaN gives V - 1. The noise of the loud tokens
// bounds the row's maximum from below, and only the quiet tokens whose logit plus t kQuietG reaches
// that bound get theirs computed: the largest noisy logit is among those and the loud ones.
int32_t row_draw(const float* x, int64_t v, float t, uint32_t k0, uint32_t k1) {
  if (!(t > 0.0f)) return row_argmax(x, v);
  thread_local std::vector<int32_t> ids;  // the loud tokens, the quiet candidates, their union
  thread_local std::vector<float> noise;
  if (static_cast<int64_t>(ids.size()) < 3 * (v + kLanes)) ids.resize(3 * (v + kLanes)), noise.resize(2 * (v + kLanes));
  int32_t *loud = ids.data(), *quiet = loud + v + kLanes, *picked = quiet + v + kLanes;
  const auto noisy = [&](int32_t j, float n) { return redjax::moved(x[j], n); };  // fl(x_j + n)
  const int64_t nl = redjax::loud_tokens(k0, k1, v, loud);
  redjax::noise_of(k0, k1, t, loud, nl, noise.data());
  // the bound: the loud tokens' noisy logits, and the largest logit with the least noise any token has
  const float top = redjax::max_of(x, v, -std::numeric_limits<float>::infinity());
  float lower = top + t * redjax::kLeastG;
  for (int64_t i = 0; i < nl; ++i) lower = std::max(lower, noisy(loud[i], noise[i]));
  const float quiet_most = t * redjax::kQuietG;
  const f32xN most_v = f32xN{} + quiet_most;
  u32xN nan_lanes = {};
  int64_t nq = 0, j = 0;
  for (; j + kLanes <= v; j += kLanes) {
    const f32xN xv = load(x + j);
    nan_lanes |= ((u32xN)xv & 0x7fffffffu) > 0x7f800000u;
    f32xN sum = xv + most_v;
    redjax::keep_as_is(sum);
    nq += redjax::put_lanes(sum >= lower, j, quiet + nq);
  }
  bool nan = false;
  for (int l = 0; l < kLanes; ++l) nan |= nan_lanes[l] != 0;
  for (; j < v; ++j) {
    nan |= is_nan(x[j]);
    if (noisy(static_cast<int32_t>(j), quiet_most) >= lower) quiet[nq++] = static_cast<int32_t>(j);
  }
  if (nan) return int32_t(v - 1);
  const int64_t n = redjax::merge_tokens(loud, nl, quiet, nq, picked);
  redjax::noise_of(k0, k1, t, picked, n, noise.data());
  int32_t best = -1;  // the first largest noisy logit, in token order
  float most = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float value = noisy(picked[i], noise[i]);
    if (best < 0 || value > most) best = picked[i], most = value;
  }
  return best < 0 ? 0 : best;
}

ffi::Error SamplingDrawImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                            ffi::Buffer<ffi::U32> keys, ffi::ResultBuffer<ffi::S32> token) {
  auto ld = logits.dimensions();
  if (ld.size() != 2 || temperature.element_count() != ld[0] || keys.element_count() != 2 * ld[0] ||
      token->element_count() != ld[0])
    return ffi::Error::InvalidArgument("sampling_draw: expected logits [R,V], temperature [R], keys [R,2], token [R]");
  const int64_t rows = ld[0], v = ld[1];
  const float* x = logits.typed_data();
  const float* t = temperature.typed_data();
  const uint32_t* k = keys.typed_data();
  int32_t* out = token->typed_data();
  if (v == 0) {
    std::fill(out, out + rows, 0);
    return ffi::Error::Success();
  }
  redjax::run_on_pool(pool, rows, [=](int64_t r) { out[r] = row_draw(x + r * v, v, t[r], k[2 * r], k[2 * r + 1]); });
  return ffi::Error::Success();
}

// The n largest of x[0..v) into vals/ids (descending; equal values by lower index), n <= v.
void row_top_n(const float* x, int64_t v, int64_t n, float* vals, int32_t* ids) {
  int64_t count = 0;
  auto insert = [&](float xi, int64_t i) {  // xi beats the buffer's smallest, or the buffer is not full
    int64_t pos = count < n ? count++ : n - 1;
    for (; pos > 0 && vals[pos - 1] < xi; --pos) vals[pos] = vals[pos - 1], ids[pos] = ids[pos - 1];
    vals[pos] = xi, ids[pos] = int32_t(i);
  };
  int64_t i = 0;
  for (; i < v && count < n; ++i) insert(x[i], i);
  for (; i + kLanes <= v; i += kLanes) {
    const f32xN x16 = load(x + i);
    const auto larger = x16 > vals[n - 1];  // strictly: a later equal value never displaces an earlier one
    bool any = false;
    for (int l = 0; l < kLanes; ++l) any |= larger[l] != 0;
    if (!any) continue;
    for (int l = 0; l < kLanes; ++l)  // in index order; the bound rises as values go in
      if (x[i + l] > vals[n - 1]) insert(x[i + l], i + l);
  }
  for (; i < v; ++i)
    if (x[i] > vals[n - 1]) insert(x[i], i);
}

ffi::Error SamplingTopNImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> values,
                            ffi::ResultBuffer<ffi::S32> ids) {
  auto xd = x.dimensions(), vd = values->dimensions();
  if (xd.size() != 2 || vd.size() != 2 || vd[0] != xd[0] || vd[1] > xd[1] || ids->element_count() != vd[0] * vd[1])
    return ffi::Error::InvalidArgument("sampling_top_n: expected x [R,V], values [R,N], ids [R,N], N <= V");
  const int64_t rows = xd[0], v = xd[1], n = vd[1];
  if (n == 0) return ffi::Error::Success();
  const float* in = x.typed_data();
  float* vals = values->typed_data();
  int32_t* out = ids->typed_data();
  redjax::run_on_pool(pool, rows, [=](int64_t r) { row_top_n(in + r * v, v, n, vals + r * n, out + r * n); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SamplingTopN, SamplingTopNImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SamplingArgmax, SamplingArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SamplingCutoffs, SamplingCutoffsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SamplingDraw, SamplingDrawImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
