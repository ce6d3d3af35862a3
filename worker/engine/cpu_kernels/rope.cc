// Rotary position embeddings for XLA's CPU backend (Hugging Face's rotate_half layout), called from
// JAX through the XLA FFI with the cos / signed-sin table that worker/models/rope.py computes once
// per forward.
//
// XLA's fusion of the rotation (a reverse of the two halves, two products and a sum, the table
// broadcast over the heads) ran at about 1 ns per element on this project's CPUs: 25 us for the q
// of llama-100m's 64 decode rows (12 heads of 64), 6 ms of a 1024-token prefill step. Here a token
// block's heads are rotated 16 lanes at a time with the token's table row held in L1.
//
// out[t, n, i] = x[t, n, i] * cos[t, i] + x[t, n, (i + D / 2) % D] * sin[t, i], where sin holds
// -sin for the first half (the table of rope.py), so the arithmetic is apply_rope's, element by
// element.
//
// Shapes: x f32[T, N, D] (N heads); cos, sin f32[T, D]; out f32[T, N, D].

#include <algorithm>
#include <cstdint>

#include "pool_work.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using redjax::f32xN, redjax::kLanes, redjax::load, redjax::store;

constexpr int64_t kTokensPerItem = 16;  // tokens per work item at least (pool_work.h: units_per_item)

inline void rotate(const float* x, const float* c, const float* s, int64_t d, float* out) {
  const int64_t half = d / 2;
  if (half % kLanes == 0) {
    for (int64_t i = 0; i < d; i += kLanes) {
      const int64_t other = i < half ? i + half : i - half;
      store(out + i, load(x + i) * load(c + i) + load(x + other) * load(s + i));
    }
    return;
  }
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * c[i] + x[i < half ? i + half : i - half] * s[i];
}

ffi::Error RopeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos,
                    ffi::Buffer<ffi::F32> sin, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), cd = cos.dimensions(), sd = sin.dimensions();
  if (xd.size() != 3 || cd.size() != 2 || sd.size() != 2 || cd[0] != xd[0] || cd[1] != xd[2] || sd[0] != cd[0] ||
      sd[1] != cd[1] || xd[2] % 2 != 0)
    return ffi::Error::InvalidArgument("rope: expected x [T, N, D] with an even D, cos and sin [T, D]");
  const int64_t tokens = xd[0], heads = xd[1], d = xd[2];
  const float *xs = x.typed_data(), *cs = cos.typed_data(), *ss = sin.typed_data();
  float* o = out->typed_data();
  const int64_t per_item = redjax::units_per_item(heads * d, kTokensPerItem);
  redjax::run_on_pool(pool, (tokens + per_item - 1) / per_item, [=](int64_t item) {
    for (int64_t t = item * per_item; t < std::min(tokens, (item + 1) * per_item); ++t)
      for (int64_t n = 0; n < heads; ++n)
        rotate(xs + (t * heads + n) * d, cs + t * d, ss + t * d, d, o + (t * heads + n) * d);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Rope, RopeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
