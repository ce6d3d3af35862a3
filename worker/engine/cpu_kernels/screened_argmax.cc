// Greedy tokens of a float32 LM head from its bfloat16 product, for XLA's CPU backend through the
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
// Shapes: approx f32[R, V] (the bfloat16 product), x f32[R, K] (the head's input), rows f32[V, K]
// (the head's weight, a row per token: W transposed), norms f32[V] (|W_j|_2, rounded up) ->
// tokens s32[R], their exact logits f32[R], candidates s32[R] (exact logits computed per row).

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "pool_work.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using redjax::f32xN, redjax::is_nan, redjax::kExponentBits, redjax::kLanes, redjax::load, redjax::not_finite,
    redjax::u32xN;

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

// c(K) of the bound above, widened by 2^-6 of itself for the float32 arithmetic that applies it.
double bound_factor(int64_t k) {
  const double u = 0x1p-8, gamma = (k + 2) * 0x1p-24 / (1.0 - (k + 2) * 0x1p-24);
  return (2 * u + u * u + 2 * gamma * (1 + 2 * u)) * (1.0 + 0x1p-6);
}

struct Problem {
  const float* approx;  // [R, V]
  const float* x;       // [R, K]
  const float* rows;    // [V, K]
  const float* norms;   // [V]
  int64_t v, k;
  double factor;
  int32_t* tokens;
  float* values;
  int32_t* candidates;
};

void screen_row(const Problem& pb, int64_t r) {
  const float* a = pb.approx + r * pb.v;
  const float* x = pb.x + r * pb.k;
  double sq = 0.0;
  for (int64_t i = 0; i < pb.k; ++i) sq += double{x[i]} * x[i];
  // e_j = s * norms[j] + t: the relative bound, and an absolute one for subnormal operands and
  // partial sums (flushed to zero by VDPBF16PS: at most 2^-126 (|W_j|_1 + |x|_1 + 2K) in all)
  const double root_k = std::sqrt(static_cast<double>(pb.k)), xn = std::sqrt(sq);
  const float s = static_cast<float>(xn * pb.factor + 0x1p-120 * root_k);
  const float t = static_cast<float>(0x1p-120 * (root_k * xn + 2.0 * pb.k));
  // lower = max_j (a_j - e_j); an approximate logit that is not finite makes the screen void
  const f32xN zero = {}, sv = zero + s;
  f32xN lanes = zero - std::numeric_limits<float>::max();
  u32xN exponents = {};  // lanes whose exponent bits are all ones: an infinity or a NaN
  int64_t j = 0;
  for (; j + kLanes <= pb.v; j += kLanes) {
    const f32xN av = load(a + j), lo = av - sv * load(pb.norms + j);
    lanes = lanes > lo ? lanes : lo;
    exponents |= (reinterpret_cast<const u32xN&>(av) & kExponentBits) == kExponentBits;
  }
  bool ok = !not_finite(s);
  float lower = -std::numeric_limits<float>::max();
  for (int l = 0; l < kLanes; ++l) lower = std::max(lower, lanes[l]), ok &= exponents[l] == 0;
  for (; j < pb.v; ++j) {
    lower = std::max(lower, a[j] - s * pb.norms[j]);
    ok &= !not_finite(a[j]);
  }
  lower -= 2 * t;  // a candidate's a_j + s n_j + t reaches the best a_i - s n_i - t
  // the candidates, in token order; every token if the screen is void
  thread_local std::vector<int32_t> picked;
  thread_local std::vector<float> exact;
  picked.clear();
  if (!ok) {
    for (int64_t t = 0; t < pb.v; ++t) picked.push_back(static_cast<int32_t>(t));
  } else {
    // a chunk's largest upper bound first (whole vectors): few chunks hold a candidate
    constexpr int64_t kChunk = 16 * kLanes;
    for (j = 0; j + kChunk <= pb.v; j += kChunk) {
      f32xN top = zero - std::numeric_limits<float>::max();
      for (int64_t i = j; i < j + kChunk; i += kLanes) {
        const f32xN up = load(a + i) + sv * load(pb.norms + i);
        top = top > up ? top : up;
      }
      float most = top[0];
      for (int l = 1; l < kLanes; ++l) most = std::max(most, top[l]);
      if (most >= lower)
        for (int64_t i = j; i < j + kChunk; ++i)
          if (a[i] + s * pb.norms[i] >= lower) picked.push_back(static_cast<int32_t>(i));
    }
    for (; j < pb.v; ++j)
      if (a[j] + s * pb.norms[j] >= lower) picked.push_back(static_cast<int32_t>(j));
  }
  const int64_t n = static_cast<int64_t>(picked.size());
  exact.resize(n + 4);
  int64_t c = 0;
  for (; c + 4 <= n; c += 4) exact_logits<4>(x, pb.rows, pb.k, picked.data() + c, exact.data() + c);
  switch (n - c) {  // the last 1-3 together too
    case 3: exact_logits<3>(x, pb.rows, pb.k, picked.data() + c, exact.data() + c); break;
    case 2: exact_logits<2>(x, pb.rows, pb.k, picked.data() + c, exact.data() + c); break;
    case 1: exact_logits<1>(x, pb.rows, pb.k, picked.data() + c, exact.data() + c); break;
  }
  int64_t best = 0;  // the first largest (n >= 1: the largest lower bound's token is always kept)
  bool nan = false;
  for (c = 0; c < n; ++c) {
    nan |= is_nan(exact[c]);
    if (exact[c] > exact[best]) best = c;
  }
  if (nan) {  // a logit that is NaN: V - 1, as the argmax of sampling.cc gives
    const int32_t last = static_cast<int32_t>(pb.v - 1);
    pb.tokens[r] = last;
    exact_logits<1>(x, pb.rows, pb.k, &last, &pb.values[r]);
  } else {
    pb.tokens[r] = n ? picked[best] : 0;
    pb.values[r] = n ? exact[best] : 0.0f;
  }
  pb.candidates[r] = static_cast<int32_t>(n);
}

ffi::Error ScreenedArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> approx, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::F32> norms,
                              ffi::ResultBuffer<ffi::S32> tokens, ffi::ResultBuffer<ffi::F32> values,
                              ffi::ResultBuffer<ffi::S32> candidates) {
  const auto ad = approx.dimensions(), xd = x.dimensions(), wd = rows.dimensions();
  if (ad.size() != 2 || xd.size() != 2 || wd.size() != 2 || norms.dimensions().size() != 1 || xd[0] != ad[0] ||
      wd[0] != ad[1] || wd[1] != xd[1] || norms.dimensions()[0] != ad[1] || tokens->element_count() != ad[0] ||
      values->element_count() != ad[0] || candidates->element_count() != ad[0])
    return ffi::Error::InvalidArgument("screened_argmax: expected approx [R,V], x [R,K], rows [V,K], norms [V]");
  if (ad[1] == 0 || ad[1] > std::numeric_limits<int32_t>::max())
    return ffi::Error::InvalidArgument("screened_argmax: the vocabulary must hold 1 to 2^31 - 1 tokens");
  const Problem pb{approx.typed_data(), x.typed_data(), rows.typed_data(), norms.typed_data(), ad[1], xd[1],
                   bound_factor(xd[1]), tokens->typed_data(), values->typed_data(), candidates->typed_data()};
  // rows in items of a few (a row's screen reads V logits: 4096-32000 for these models)
  const int64_t per_item = redjax::units_per_item(pb.v, 1);
  redjax::run_on_pool(pool, (ad[0] + per_item - 1) / per_item, [pb, per_item, total = ad[0]](int64_t item) {
    for (int64_t r = item * per_item; r < std::min(total, (item + 1) * per_item); ++r) screen_row(pb, r);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScreenedArgmax, ScreenedArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
