// y = x @ W on XLA's CPU backend, with W packed once (at model load) into column panels, called
// from JAX through the XLA FFI.
//
// XLA's CPU matmuls pack the weight operand into a cache-friendly layout on every call. For the
// few-row products of decode (64 rows against a 768 x 2048 weight) that pass over the whole weight
// costs about a third of the product, and it reads the weight with a stride of a full row. Here
// the weight is stored as panels of kPanel columns, each panel one contiguous [K, kPanel] run, so
// a product streams every weight byte once, sequentially, and the packing is paid once per
// process instead of once per step.
//
// Each work item is one panel: a tile of up to kRows rows of x times the panel is accumulated in
// registers over all of K (kRows x kPanel floats: 24 AVX-512 registers), tile after tile, while
// the panel stays in L2. Panels are spread over XLA's intra-op thread pool.
//
// Shapes: x f32[M, K]; w f32[P, K, kPanel] (columns past N are zero padding); y f32[M, N] with
// (P - 1) * kPanel < N <= P * kPanel.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "pool_work.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;  // floats per vector (one AVX-512 register)
constexpr int64_t kPanel = 32;  // columns per panel (worker/engine/cpu_matmul.py: PANEL)
constexpr int kVecs = kPanel / kLanes;
constexpr int kRows = 12;           // rows of x per register tile
constexpr int64_t kPrefetch = 128;  // panel rows (16 KB) ahead to request while a panel is first read

// GCC/Clang vector extensions, lowered to the target's widest registers (-march=native).
using f32xN = float __attribute__((vector_size(kLanes * 4)));

inline f32xN load(const float* p) {
  f32xN v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, f32xN v) { std::memcpy(p, &v, sizeof v); }

struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n;
};

// y[m0 : m0 + R, n0 : n0 + kPanel] (clipped at n) = x[m0 : m0 + R, :] @ panel
template <int R, bool kFirst>
inline void tile(const Problem& pb, const float* panel, int64_t m0, int64_t n0) {
  f32xN acc[R][kVecs] = {};
  const float* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = pb.x + (m0 + r) * pb.k;
  for (int64_t k = 0; k < pb.k; ++k) {
    const float* wk = panel + k * kPanel;
    // the first tile reads the panel from memory: ask for lines ahead (later tiles hit L2)
    if (kFirst)
      for (int c = 0; c < kVecs; ++c) __builtin_prefetch(wk + kPrefetch * kPanel + c * kLanes, 0, 3);
    f32xN wv[kVecs];
    for (int c = 0; c < kVecs; ++c) wv[c] = load(wk + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xv = rows[r][k];
      for (int c = 0; c < kVecs; ++c) acc[r][c] += xv * wv[c];
    }
  }
  const int64_t cols = std::min<int64_t>(kPanel, pb.n - n0);
  for (int r = 0; r < R; ++r) {
    float* out = pb.y + (m0 + r) * pb.n + n0;
    if (cols == kPanel) {
      for (int c = 0; c < kVecs; ++c) store(out + c * kLanes, acc[r][c]);
    } else {  // the last panel of an N that is not a multiple of kPanel
      float full[kPanel];
      for (int c = 0; c < kVecs; ++c) store(full + c * kLanes, acc[r][c]);
      std::memcpy(out, full, cols * sizeof(float));
    }
  }
}

// the rows left after the full tiles, fewer than kRows: one smaller tile
template <int R>
inline void tail(const Problem& pb, const float* panel, int64_t m0, int64_t rows, int64_t n0) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R, false>(pb, panel, m0, n0);
    tail<R - 1>(pb, panel, m0, rows, n0);
  }
}

void panel_product(const Problem& pb, int64_t p) {
  const float* panel = pb.w + p * pb.k * kPanel;
  const int64_t n0 = p * kPanel;
  int64_t m0 = 0;
  if (pb.m >= kRows) {
    tile<kRows, true>(pb, panel, 0, n0);
    for (m0 = kRows; m0 + kRows <= pb.m; m0 += kRows) tile<kRows, false>(pb, panel, m0, n0);
  }
  tail<kRows - 1>(pb, panel, m0, pb.m - m0, n0);
}

ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("panel_matmul: expected x [M,K], w [P,K,32], y [M,N]");
  const int64_t m = xd[0], k = xd[1], panels = wd[0], n = yd[1];
  if (wd[1] != k || wd[2] != kPanel || yd[0] != m || n > panels * kPanel || n <= (panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("panel_matmul: inconsistent shapes");
  if (m == 0 || n == 0) return ffi::Error::Success();
  const Problem pb{x.typed_data(), w.typed_data(), y->typed_data(), m, k, n};
  redjax::run_on_pool(pool, panels, [pb](int64_t p) { panel_product(pb, p); });  // one panel per item
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
