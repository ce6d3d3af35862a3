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
// the panel stays in L2. Panels are spread over XLA's intra-op thread pool. While the later tiles
// of a panel compute, the thread requests the panel it computes next, so that panel's first tile
// reads L2 instead of waiting on memory.
//
// Rows go in tiles of kRows, except that a short remainder is merged with the last full tile and
// the two split evenly (64 rows: 12, 12, 12, 12, 8, 8): a tile of 4 rows runs 8 FMAs a step
// between the same loads and requests as a full tile's 24, and cost 1.5x a full tile's time per
// row (perf, llama-100m decode at 64 rows).
//
// A product over many panels first copies x into its row tiles stored k-major ([K, R] for a tile
// of R rows), in parallel: a tile step then reads its R values of x from one place instead of R
// rows (which takes more pointer registers than x86 has, so the compiler moved them through vector
// registers every step). The copy costs about as much as one or two panels, so it is made only
// where there are many (kPackPanels).
//
// Shapes: x f32[M, K]; w f32[P, K, kPanel] (columns past N are zero padding); y f32[M, N] with
// (P - 1) * kPanel < N <= P * kPanel.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool_work.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using redjax::f32xN, redjax::kLanes, redjax::load, redjax::store;

constexpr int64_t kPanel = 32;  // columns per panel (worker/engine/cpu_matmul.py: PANEL)
constexpr int kVecs = kPanel / kLanes;
constexpr int64_t kRows = 12;           // rows of x per register tile
constexpr int64_t kShortRest = 5;       // a remainder of up to this many rows is merged with a full tile
constexpr int64_t kPrefetch = 128;  // panel rows (16 KB) ahead to request while a panel is first read
// products over at least this many panels copy x into k-major tiles first (measured at 62 rows,
// any K: 8-10 % faster at 96-256 panels, about even at 48, 10-20 % slower at 8-16)
constexpr int64_t kPackPanels = 64;

struct Problem {
  const float* x;  // [M, K], or if packed each row tile [K, R] in turn (tile_plan)
  const float* w;
  float* y;
  int64_t m, k, n;
};

// Bytes of the next panel a later tile requests per step of k: the later tiles of a panel share
// the next panel's K * 128 bytes between them (4 or more tiles: 32 bytes a step, a line every
// second step), so the thread's next first tile finds its panel in L2 instead of waiting on memory
// while the FMA units idle (the first tile of a panel took 2.4x a later one on llama-100m decode).
inline int64_t ahead_step(int64_t later_tiles) {
  return later_tiles >= 4 ? 32 : later_tiles >= 2 ? 64 : 128;
}

// The row tiles of an m-row product: `full` tiles of kRows rows, then tiles of `a` and `b` rows
// (0: none); rows in order.
struct TilePlan {
  int64_t full, a, b;

  int64_t count() const { return full + (a > 0) + (b > 0); }
  int64_t start(int64_t t) const { return t <= full ? t * kRows : full * kRows + a; }
  int64_t rows(int64_t t) const { return t < full ? kRows : t == full ? a : b; }
};

TilePlan tile_plan(int64_t m) {
  const int64_t full = m / kRows, rest = m % kRows;
  if (full > 0 && rest > 0 && rest <= kShortRest) return {full - 1, (kRows + rest + 1) / 2, (kRows + rest) / 2};
  return {full, rest, 0};
}

// y[m0 : m0 + R, n0 : n0 + kPanel] (clipped at n) = x[m0 : m0 + R, :] @ panel
// `ahead`: where in the next panel this tile's requests start, `step` bytes further each k (0: none)
template <int R, bool kFirst, bool kPacked>
inline void tile(const Problem& pb, const float* panel, int64_t m0, int64_t n0, const char* ahead = nullptr,
                 int64_t step = 0) {
  f32xN acc[R][kVecs] = {};
  const float* rows[R];  // unpacked: x's rows
  for (int r = 0; r < R; ++r) rows[r] = pb.x + (m0 + r) * pb.k;
  const float* xt = pb.x + m0 * pb.k;  // packed: this tile [K, R]
  if (ahead == nullptr) ahead = reinterpret_cast<const char*>(panel);  // requests for lines already here
  // the tile's output lines, requested for writing now so that the stores at the end find them in
  // cache instead of each waiting on a fresh line of y (1-4 % less time per product, in-process
  // A/B at llama-100m's decode shapes and a 1024-row prefill product)
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) __builtin_prefetch(pb.y + (m0 + r) * pb.n + n0 + c * kLanes, 1, 3);
  for (int64_t k = 0; k < pb.k; ++k, ahead += step) {
    const float* wk = panel + k * kPanel;
    // the first tile reads the panel from memory unless the last panel requested it: ask for
    // lines ahead (later tiles hit L2)
    if (kFirst)
      for (int c = 0; c < kVecs; ++c) __builtin_prefetch(wk + kPrefetch * kPanel + c * kLanes, 0, 3);
    __builtin_prefetch(ahead, 0, 2);  // into L2; a step of 32 asks for each line twice
    __builtin_prefetch(ahead + step / 2, 0, 2);
    f32xN wv[kVecs];
    for (int c = 0; c < kVecs; ++c) wv[c] = load(wk + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xv = kPacked ? xt[k * R + r] : rows[r][k];
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

// a tile of `rows` rows (1..kRows)
template <bool kFirst, bool kPacked, int R = kRows>
inline void any_tile(int64_t rows, const Problem& pb, const float* panel, int64_t m0, int64_t n0,
                     const char* ahead = nullptr, int64_t step = 0) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R, kFirst, kPacked>(pb, panel, m0, n0, ahead, step);
    any_tile<kFirst, kPacked, R - 1>(rows, pb, panel, m0, n0, ahead, step);
  }
}

// panel p; `next`: the panel this thread computes after it (-1: none)
template <bool kPacked>
void panel_product(const Problem& pb, const TilePlan& plan, int64_t p, int64_t next) {
  const float* panel = pb.w + p * pb.k * kPanel;
  const int64_t n0 = p * kPanel, tiles = plan.count();
  const int64_t bytes = pb.k * kPanel * int64_t{sizeof(float)}, step = ahead_step(tiles - 1);
  const char* next_panel = next < 0 ? nullptr : reinterpret_cast<const char*>(pb.w + next * pb.k * kPanel);
  int64_t covered = 0;  // bytes of the next panel requested so far
  any_tile<true, kPacked>(plan.rows(0), pb, panel, 0, n0);
  for (int64_t t = 1; t < tiles; ++t) {  // each later tile requests the next stretch of the next panel
    const char* at = next_panel != nullptr && covered < bytes ? next_panel + covered : nullptr;
    covered += pb.k * step;
    any_tile<false, kPacked>(plan.rows(t), pb, panel, plan.start(t), n0, at, at ? step : 0);
  }
}

// `count` rows [count, K] of x -> to [K, count]
void pack_tile(const float* rows, int64_t count, int64_t k, float* to) {
  for (int64_t i = 0; i < k; ++i)
    for (int64_t r = 0; r < count; ++r) to[i * count + r] = rows[r * k + i];
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
  const TilePlan plan = tile_plan(m);
  if (panels < kPackPanels) {
    const Problem pb{x.typed_data(), w.typed_data(), y->typed_data(), m, k, n};
    redjax::run_on_pool(pool, panels, [pb, plan](int64_t p, int64_t next) { panel_product<false>(pb, plan, p, next); });
    return ffi::Error::Success();
  }
  thread_local std::vector<float> packed;  // the calling thread's, reused across calls
  packed.resize(m * k);                    // each row tile [K, R] in turn
  const float* xs = x.typed_data();
  float* to = packed.data();
  redjax::run_on_pool(pool, plan.count(), [=](int64_t t) {
    const int64_t m0 = plan.start(t);
    pack_tile(xs + m0 * k, plan.rows(t), k, to + m0 * k);
  });
  const Problem pb{packed.data(), w.typed_data(), y->typed_data(), m, k, n};
  redjax::run_on_pool(pool, panels, [pb, plan](int64_t p, int64_t next) { panel_product<true>(pb, plan, p, next); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
