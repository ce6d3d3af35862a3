// RMSNorm for XLA's CPU backend, alone or together with the residual add before it, called from
// JAX through the XLA FFI.
//
// XLA runs a norm as three passes over the rows (the sum of squares, the reciprocal root, the
// scaling), and the residual add before it as a fourth, each its own task on the intra-op pool:
// about 25-35 us per norm for llama-100m's 64 decode rows of 768 in a profiler trace (which
// overstates small operations). Here one pass per row block does the add, the sum of squares and
// the scaling while the row is in L1 (with the rope kernel: llama-100m decode 2.3 % faster).
//
// Same arithmetic as Hugging Face's LlamaRMSNorm in float32: y = w * (x * (1 / sqrt(mean(x^2) +
// eps))); the sum of squares is taken in a different order (vector lanes), so results can differ
// in the last bit.
//
// Shapes: x f32[M, H] (and the addend y f32[M, H]); w f32[H]; out f32[M, H] (and x + y f32[M, H]).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "pool_work.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using redjax::f32xN, redjax::kLanes, redjax::load, redjax::store;

constexpr int64_t kRowsPerItem = 16;  // rows per work item at least (pool_work.h: units_per_item)

// out = w * (x * rsqrt(mean(x^2) + eps)) for one row of h values
inline void norm_row(const float* x, const float* w, int64_t h, float eps, float* out) {
  f32xN acc[4] = {};
  int64_t i = 0;
  for (; i + 4 * kLanes <= h; i += 4 * kLanes)
    for (int u = 0; u < 4; ++u) {
      const f32xN v = load(x + i + u * kLanes);
      acc[u] += v * v;
    }
  for (; i + kLanes <= h; i += kLanes) {
    const f32xN v = load(x + i);
    acc[0] += v * v;
  }
  const f32xN lanes = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; i < h; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
  int64_t j = 0;
  for (; j + kLanes <= h; j += kLanes) store(out + j, load(w + j) * (load(x + j) * inv));
  for (; j < h; ++j) out[j] = w[j] * (x[j] * inv);
}

// rows [0, m) of x (+ y into `sum` first when y is given) normalised into `out`
void norm_rows(ffi::ThreadPool& pool, const float* x, const float* y, const float* w, float eps, int64_t m,
               int64_t h, float* sum, float* out) {
  const int64_t per_item = redjax::units_per_item(h, kRowsPerItem);
  redjax::run_on_pool(pool, (m + per_item - 1) / per_item, [=](int64_t item) {
    for (int64_t r = item * per_item; r < std::min(m, (item + 1) * per_item); ++r) {
      const float* row = x + r * h;
      if (y != nullptr) {
        float* s = sum + r * h;
        int64_t j = 0;
        for (; j + kLanes <= h; j += kLanes) store(s + j, load(row + j) + load(y + r * h + j));
        for (; j < h; ++j) s[j] = row[j] + y[r * h + j];
        row = s;
      }
      norm_row(row, w, h, eps, out + r * h);
    }
  });
}

ffi::Error check(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& w, int64_t& m, int64_t& h) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 1 || wd[0] != xd[1])
    return ffi::Error::InvalidArgument("rms_norm: expected x [M, H] and w [H]");
  m = xd[0], h = xd[1];
  return ffi::Error::Success();
}

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, float eps,
                       ffi::ResultBuffer<ffi::F32> out) {
  int64_t m, h;
  if (auto error = check(x, w, m, h); error.failure()) return error;
  norm_rows(pool, x.typed_data(), nullptr, w.typed_data(), eps, m, h, nullptr, out->typed_data());
  return ffi::Error::Success();
}

ffi::Error AddRmsNormImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> y,
                          ffi::Buffer<ffi::F32> w, float eps, ffi::ResultBuffer<ffi::F32> sum,
                          ffi::ResultBuffer<ffi::F32> out) {
  int64_t m, h;
  if (auto error = check(x, w, m, h); error.failure()) return error;
  if (y.dimensions().size() != 2 || y.dimensions()[0] != m || y.dimensions()[1] != h)
    return ffi::Error::InvalidArgument("rms_norm: the addend must have x's shape");
  norm_rows(pool, x.typed_data(), y.typed_data(), w.typed_data(), eps, m, h, sum->typed_data(), out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddRmsNorm, AddRmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
