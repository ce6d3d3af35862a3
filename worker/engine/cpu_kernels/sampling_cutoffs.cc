// Top-k and top-p cutoffs of sampled rows on XLA's CPU backend, called from JAX through the XLA FFI.
//
// The jnp sampler finds both by sorting every row of the vocabulary, and XLA's CPU sort is a
// generic comparison sort: 470 ms for 64 rows of 32000 logits, ten times a llama-100m decode step.
// A row only needs its largest values in order until the mass the top-p cutoff asks for is
// reached, so this kernel selects before it sorts: std::nth_element takes the top-k set (O(V)),
// values too small to matter are set aside in one pass (a bound from the softmax denominator), and
// ever larger leading blocks of the rest (32, 64, 128, ... values) are selected and sorted until
// the cumulative probability passes top_p. A peaked distribution is done after one block.
//
// The result per row is one value, `cut`: the sampler masks every logit below it. It is the larger
// of the k-th largest logit (top_k > 0) and the smallest logit the top-p rule keeps, where, in
// descending order, a value is kept while the probability mass strictly before it (renormalized
// over the top-k set) is below top_p; the largest is always kept, and top_p >= 1 keeps all. These
// are the jnp path's rules (worker/engine/sampler.py), so ties at the cut are kept as there.
// Rows with neither top_k nor top_p < 1 get -inf (nothing cut) without looking at their logits.
//
// Shapes: logits f32[R, V] (temperature applied); top_k i32[R] (0: off); top_p f32[R]; cut f32[R].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "pool_work.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kFirstBlock = 32;  // values sorted first; each further block doubles the sorted prefix

float row_cut(const float* logits, int64_t v, int32_t top_k, float top_p) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t k = top_k > 0 ? std::min<int64_t>(top_k, v) : v;
  const bool by_p = top_p < 1.0f;
  if (k == v && !by_p) return kNone;
  std::vector<float> a(logits, logits + v);
  auto desc = std::greater<float>();
  if (k < v) std::nth_element(a.begin(), a.begin() + (k - 1), a.end(), desc);  // a[0, k): the top-k set
  float kth = kNone;
  if (k < v) kth = a[k - 1];
  if (!by_p) return kth;
  const float top = *std::max_element(a.begin(), a.begin() + k);
  if (!(top > kNone)) return kth;  // nothing finite to renormalize
  float z = 0.0f;  // the softmax denominator over the top-k set (a vectorized pass)
  const float* set = a.data();
#pragma omp simd reduction(+ : z)
  for (int64_t i = 0; i < k; ++i) z += std::exp(set[i] - top);
  // Values under `floor` cannot be kept: together they hold less than 1 - top_p of the mass
  // (at most k of them, each under (1 - top_p) / k, with 1 % to spare for rounding), so the cut
  // falls before any of them. Set aside in one pass, they are never selected or sorted.
  const float floor = top + std::log(0.99f * (1.0f - top_p) * z / float(k));
  const int64_t n = std::partition(a.begin(), a.begin() + k, [floor](float x) { return x >= floor; }) - a.begin();
  double before = 0.0;  // mass strictly above the value at position i of the descending order
  for (int64_t sorted = 0; sorted < n;) {
    const int64_t end = std::min(n, sorted == 0 ? kFirstBlock : 2 * sorted);
    std::nth_element(a.begin() + sorted, a.begin() + (end - 1), a.begin() + n, desc);
    std::sort(a.begin() + sorted, a.begin() + end, desc);
    for (int64_t i = sorted; i < end; ++i) {
      if (i > 0 && before >= top_p) return std::max(kth, a[i - 1]);  // a[i] is the first value dropped
      before += std::exp(a[i] - top) / z;
    }
    sorted = end;
  }
  return n < k ? std::max(kth, a[n - 1]) : kth;  // the values set aside are dropped; else all are kept
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
  redjax::run_on_pool(pool, rows, [=](int64_t r) { out[r] = row_cut(x + r * v, v, ks[r], ps[r]); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SamplingCutoffs, SamplingCutoffsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
