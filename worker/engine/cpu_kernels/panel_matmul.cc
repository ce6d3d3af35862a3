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
// Prefill's products have hundreds of rows. There a work item is a block of kBlockTiles row tiles
// (48 rows) over every panel instead: the block's rows of x stay in L2 while the panels stream
// past once per block, where a panel item read all of x from L2 (or, for K = 768, from L3) once
// per panel, both cores at once. On the 2-core Intel VM, alternating with panel items in one
// process (session 39), row blocks ran the demo's prefill products at 931 rows 1.01-1.22x faster
// by shape (a layer's products together 1.09-1.10x; 1.05x at 512 rows), llama-100m's 1.08x.
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
// where there are many (kPackPanels), or where x's rows would evict each other from L1: a row
// length of a multiple of 4 KB, as float32 K = 1024, 2048, 4096 and bfloat16 K = 2048, 4096 give
// (copies_x).
//
// bfloat16 weights (PanelMatmulBf16, built where the CPU has AVX512-BF16) are stored as pairs of
// consecutive k: a panel row is [kPanel columns, 2] for k and k + 1, and one VDPBF16PS multiplies
// 16 columns by both and adds them into the float32 accumulators, twice the k of a float32 FMA
// per instruction at the same 128 bytes of panel per step. x is first rounded to bfloat16 pairs
// [M, ceil(K / 2)] (to nearest even, as XLA's astype) and read in place, or, where float32 x would
// be copied, rounded a row tile at a time just before that tile's copy; products are exact in
// float32, so the result is XLA's bfloat16 x bfloat16 -> float32 product up to the order of the sums.
//
// Shapes: x f32[M, K]; w f32[P, K, kPanel], or bf16 [P, ceil(K / 2), 2 * kPanel] (columns past N
// and a k past K are zero padding); y f32[M, N] with (P - 1) * kPanel < N <= P * kPanel.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_rows.h"
#include "i8_rows.h"
#include "pool_work.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using redjax::f32xN, redjax::i32xN, redjax::kLanes, redjax::load, redjax::store;
#ifdef __AVX512BF16__
using redjax::round_rows_bf16;
#endif

constexpr int64_t kPanel = 32;  // columns per panel (worker/engine/cpu_matmul.py: PANEL)
constexpr int kVecs = kPanel / kLanes;
constexpr int64_t kRows = 12;           // rows of x per register tile
constexpr int64_t kShortRest = 5;       // a remainder of up to this many rows is merged with a full tile
constexpr int64_t kPrefetch = 128;  // panel rows (16 KB) ahead to request while a panel is first read
// products over at least this many panels copy x into k-major tiles first (measured at 62 rows,
// any K: 8-10 % faster at 96-256 panels, about even at 48, 10-20 % slower at 8-16)
constexpr int64_t kPackPanels = 64;
// and so do products whose tiles have this many rows or more, where x's rows share L1 sets (copies_x)
constexpr int64_t kAliasRows = 11;
// products of at least kBlockAt row tiles (192 rows: prefill) go by row blocks of kBlockTiles tiles
constexpr int64_t kBlockAt = 16;
constexpr int64_t kBlockTiles = 4;

// How a step reads its x value and panel row, and multiplies them into the accumulators. A step
// covers one k of float32 weights, two of bfloat16 (a panel row is 128 bytes either way).
struct F32 {
  using X = float;
  using Acc = f32xN;  // the accumulators' vector type, stored by put
  struct Scales {};   // what put needs beyond the sums (I8: the scales)
  static void put(float* p, Acc v, const Scales&, int64_t, int64_t) { store(p, v); }
  static constexpr bool kInPlace = true;  // x's rows are read as they are
  using W = f32xN;
  static W weights(const void* p) { return load(static_cast<const float*>(p)); }
  static f32xN madd(f32xN acc, X x, W w) { return acc + x * w; }
};

#ifdef __AVX512BF16__
struct BF16 {
  using X = uint32_t;  // x[k] (low half) and x[k + 1] as bfloat16
  using Acc = f32xN;
  struct Scales {};
  static void put(float* p, Acc v, const Scales&, int64_t, int64_t) { store(p, v); }
  static constexpr bool kInPlace = false;  // x's rows are rounded first
  using W = __m512bh;  // 16 columns x (k, k + 1)
  static W weights(const void* p) { return reinterpret_cast<W>(_mm512_loadu_si512(p)); }
  static f32xN madd(f32xN acc, X x, W w) {
    return reinterpret_cast<f32xN>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc),
                                                     reinterpret_cast<W>(_mm512_set1_epi32(x)), w));
  }
};
#endif

#ifdef __AVX512VNNI__
// int8 weights (PanelMatmulI8: the screened greedy head's approximation, screened_head.py): a panel
// row is [kPanel columns, 4] for k .. k + 3 as signed bytes, and one VPDPBUSD adds 16 columns' four
// products with x's four (quantized, offset by 128, unsigned) into int32 accumulators, exactly:
// four times the k of a float32 FMA per instruction. The tile's stores scale the sums to floats.
struct I8 {
  using X = uint32_t;  // x's quantized k .. k + 3, each + 128, as unsigned bytes (low byte first)
  // int32 sums, in GCC's own 16 x int32 vector type: through __m512i (8 x int64), which the
  // intrinsic converts to and from on every call, GCC spilled accumulators to the stack
  using Acc = i32xN;
  struct Scales {
    const float* rows;     // [M, 3]: each row's scale first (i8_rows.h); W8A8: [M]
    const float* columns;  // [P * kPanel]: each column's scale (zero past N)
    const int32_t* sums;   // [P * kPanel]: each column's quantized weights summed
  };
  // row m's sums for columns n .. n + 15 -> the product of the quantized vectors, in float32: the
  // 128 added to x's values taken off exactly in int32, then scaled
  static void put(float* p, Acc v, const Scales& sc, int64_t m, int64_t n) {
    i32xN sums;
    std::memcpy(&sums, sc.sums + n, sizeof sums);
    store(p, __builtin_convertvector(v - (sums << 7), f32xN) * (sc.rows[3 * m] * load(sc.columns + n)));
  }
  static constexpr bool kInPlace = false;  // x's rows are quantized first
  using W = i32xN;  // 16 columns x (k .. k + 3)
  static W weights(const void* p) {
    W w;
    std::memcpy(&w, p, sizeof w);
    return w;
  }
  static Acc madd(Acc acc, X x, W w) { return __builtin_ia32_vpdpbusd_v16si(acc, i32xN{} + static_cast<int32_t>(x), w); }
};

// The int8 projections (PanelMatmulW8A8, int8_linear.py): the same product, x quantized by torchao's
// scheme (quantize_row_w8a8), one scale a row.
struct W8A8 : I8 {
  // as I8's, with the scales' product rounded first, as XLA rounds it: -ffast-math may otherwise
  // reassociate the two multiplications
  static void put(float* p, Acc v, const Scales& sc, int64_t m, int64_t n) {
    i32xN sums;
    std::memcpy(&sums, sc.sums + n, sizeof sums);
    f32xN scale = sc.rows[m] * load(sc.columns + n);
    asm volatile("" : "+v"(scale));
    store(p, __builtin_convertvector(v - (sums << 7), f32xN) * scale);
  }
};
#endif

template <typename F>
struct Problem {
  const typename F::X* x;  // [M, steps], or if packed each row tile [steps, R] in turn (tile_plan)
  const char* w;           // panels of steps x 128 bytes
  float* y;
  int64_t m, n;
  int64_t steps;  // panel rows: K for float32 weights, ceil(K / 2) for bfloat16, ceil(K / 4) for int8
  typename F::Scales scales = {};
  int64_t panel_bytes() const { return steps * kPanel * int64_t{sizeof(float)}; }
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
template <typename F, int R, bool kFirst, bool kPacked>
inline void tile(const Problem<F>& pb, const char* panel, int64_t m0, int64_t n0, const char* ahead = nullptr,
                 int64_t step = 0) {
  constexpr int64_t kRowBytes = kPanel * sizeof(float);  // one step's panel row
  typename F::Acc acc[R][kVecs] = {};
  const typename F::X* rows[R];  // unpacked: x's rows
  for (int r = 0; r < R; ++r) rows[r] = pb.x + (m0 + r) * pb.steps;
  const typename F::X* xt = pb.x + m0 * pb.steps;  // packed: this tile [steps, R]
  if (ahead == nullptr) ahead = panel;  // requests for lines already here
  // the tile's output lines, requested for writing now so that the stores at the end find them in
  // cache instead of each waiting on a fresh line of y (1-4 % less time per product, in-process
  // A/B at llama-100m's decode shapes and a 1024-row prefill product)
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) __builtin_prefetch(pb.y + (m0 + r) * pb.n + n0 + c * kLanes, 1, 3);
  for (int64_t k = 0; k < pb.steps; ++k, ahead += step) {
    const char* wk = panel + k * kRowBytes;
    // the first tile reads the panel from memory unless the last panel requested it: ask for
    // lines ahead (later tiles hit L2)
    if (kFirst)
      for (int c = 0; c < kVecs; ++c) __builtin_prefetch(wk + kPrefetch * kRowBytes + c * 64, 0, 3);
    __builtin_prefetch(ahead, 0, 2);  // into L2; a step of 32 asks for each line twice
    __builtin_prefetch(ahead + step / 2, 0, 2);
    typename F::W wv[kVecs];
    for (int c = 0; c < kVecs; ++c) wv[c] = F::weights(wk + c * 64);
    for (int r = 0; r < R; ++r) {
      const typename F::X xv = kPacked ? xt[k * R + r] : rows[r][k];
      for (int c = 0; c < kVecs; ++c) acc[r][c] = F::madd(acc[r][c], xv, wv[c]);
    }
  }
  const int64_t cols = std::min<int64_t>(kPanel, pb.n - n0);
  for (int r = 0; r < R; ++r) {
    float* out = pb.y + (m0 + r) * pb.n + n0;
    if (cols == kPanel) {
      for (int c = 0; c < kVecs; ++c) F::put(out + c * kLanes, acc[r][c], pb.scales, m0 + r, n0 + c * kLanes);
    } else {  // the last panel of an N that is not a multiple of kPanel
      float full[kPanel];
      for (int c = 0; c < kVecs; ++c) F::put(full + c * kLanes, acc[r][c], pb.scales, m0 + r, n0 + c * kLanes);
      std::memcpy(out, full, cols * sizeof(float));
    }
  }
}

// a tile of `rows` rows (1..kRows)
template <typename F, bool kFirst, bool kPacked, int R = kRows>
inline void any_tile(int64_t rows, const Problem<F>& pb, const char* panel, int64_t m0, int64_t n0,
                     const char* ahead = nullptr, int64_t step = 0) {
  if constexpr (R > 0) {
    if (rows == R) return tile<F, R, kFirst, kPacked>(pb, panel, m0, n0, ahead, step);
    any_tile<F, kFirst, kPacked, R - 1>(rows, pb, panel, m0, n0, ahead, step);
  }
}

// panel p over the row tiles [t0, t1); `next`: the panel this thread computes after it (-1: none)
template <typename F, bool kPacked>
void panel_product(const Problem<F>& pb, const TilePlan& plan, int64_t p, int64_t next, int64_t t0, int64_t t1) {
  const int64_t bytes = pb.panel_bytes(), n0 = p * kPanel, step = ahead_step(t1 - t0 - 1);
  const char* panel = pb.w + p * bytes;
  const char* next_panel = next < 0 ? nullptr : pb.w + next * bytes;
  int64_t covered = 0;  // bytes of the next panel requested so far
  any_tile<F, true, kPacked>(plan.rows(t0), pb, panel, plan.start(t0), n0);
  for (int64_t t = t0 + 1; t < t1; ++t) {  // each later tile requests the next stretch of the next panel
    const char* at = next_panel != nullptr && covered < bytes ? next_panel + covered : nullptr;
    covered += pb.steps * step;
    any_tile<F, false, kPacked>(plan.rows(t), pb, panel, plan.start(t), n0, at, at ? step : 0);
  }
}

// The work items of a product: each panel over all rows, or from kBlockAt row tiles on, each row
// block over all panels.
template <typename F, bool kPacked>
void run_items(ffi::ThreadPool& pool, const Problem<F>& pb, const TilePlan& plan, int64_t panels) {
  const int64_t tiles = plan.count();
  if (tiles < kBlockAt) {
    redjax::run_on_pool(pool, panels, [pb, plan, tiles](int64_t p, int64_t next) {
      panel_product<F, kPacked>(pb, plan, p, next, 0, tiles);
    });
    return;
  }
  redjax::run_on_pool(pool, (tiles + kBlockTiles - 1) / kBlockTiles, [pb, plan, tiles, panels](int64_t b) {
    const int64_t t0 = b * kBlockTiles, t1 = std::min(tiles, t0 + kBlockTiles);
    for (int64_t p = 0; p < panels; ++p) panel_product<F, kPacked>(pb, plan, p, p + 1 < panels ? p + 1 : -1, t0, t1);
  });
}

// `count` rows [count, steps] of x -> to [steps, count]
template <typename T>
void pack_tile(const T* rows, int64_t count, int64_t steps, T* to) {
  for (int64_t i = 0; i < steps; ++i)
    for (int64_t r = 0; r < count; ++r) to[i * count + r] = rows[r * steps + i];
}

// Whether a product copies x into k-major row tiles first: over many panels, where the copy costs
// about one or two panels' time, and where a tile's rows of x lie a multiple of 4 KB apart. Such
// rows all map to one L1 set, and a tile of 11 or 12 of them, read every step, evicts its own lines.
// In-process A/B on Zen 4 (32 KB 8-way L1), 24 panels, session 52: copied tiles 1.17-1.33x faster
// at K = 1024-4096 float32 (2048-4096 bfloat16) for 11-62 rows and 1.11-1.20x at 512 rows; 0.94x
// for tiles of 10 or 8 rows, and 0.97-0.99x at K of other strides, which therefore read in place.
template <typename F>
bool copies_x(const Problem<F>& pb, const TilePlan& plan, int64_t panels) {
  const int64_t stride = pb.steps * int64_t{sizeof(typename F::X)};
  return panels >= kPackPanels || (plan.rows(0) >= kAliasRows && stride % 4096 == 0);
}

// A product over `panels` panels. `rows(m0, count, to)` gives x's rows [m0, m0 + count) in the step
// format [count, steps]: x itself, or (bfloat16) rounded into `to`, which has room for them.
// Unless `copies_x`, the tiles read those rows in place; else each row tile is copied k-major
// ([steps, R]) first, in parallel.
template <typename F, typename Rows>
void run_product(ffi::ThreadPool& pool, const TilePlan& plan, Problem<F> pb, int64_t panels, Rows rows) {
  using X = typename F::X;
  thread_local std::vector<X> staged, packed;  // the calling thread's, reused across calls
  const int64_t steps = pb.steps;
  if (!copies_x(pb, plan, panels)) {
    if constexpr (F::kInPlace) {
      pb.x = rows(0, pb.m, nullptr);
    } else {
      staged.resize(pb.m * steps);
      X* to = staged.data();
      redjax::run_on_pool(pool, plan.count(), [=](int64_t t) {
        const int64_t m0 = plan.start(t);
        rows(m0, plan.rows(t), to + m0 * steps);
      });
      pb.x = staged.data();
    }
    run_items<F, false>(pool, pb, plan, panels);
    return;
  }
  packed.resize(pb.m * steps);  // each row tile [steps, R] in turn
  X* to = packed.data();
  redjax::run_on_pool(pool, plan.count(), [=](int64_t t) {
    thread_local std::vector<X> tile_rows;  // a tile's rows rounded, before the copy
    const int64_t m0 = plan.start(t), count = plan.rows(t);
    if constexpr (!F::kInPlace) tile_rows.resize(count * steps);
    pack_tile(rows(m0, count, tile_rows.data()), count, steps, to + m0 * steps);
  });
  pb.x = packed.data();
  run_items<F, true>(pool, pb, plan, panels);
}

// checks shapes: x [M, K], w [P, ceil(K / per_step), per_step * kPanel], y [M, N]
ffi::Error check(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, ffi::Span<const int64_t> yd,
                 int64_t per_step) {
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("panel_matmul: expected x [M,K], w [P,steps,width], y [M,N]");
  const int64_t panels = wd[0], n = yd[1], steps = (xd[1] + per_step - 1) / per_step;
  if (wd[1] != steps || wd[2] != per_step * kPanel || yd[0] != xd[0] || n > panels * kPanel ||
      n <= (panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("panel_matmul: inconsistent shapes");
  return ffi::Error::Success();
}

ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = check(x.dimensions(), w.dimensions(), y->dimensions(), 1); e.failure()) return e;
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], n = y->dimensions()[1];
  if (m == 0 || n == 0) return ffi::Error::Success();
  const Problem<F32> pb{nullptr, reinterpret_cast<const char*>(w.typed_data()), y->typed_data(), m, n, k};
  const float* xs = x.typed_data();
  run_product(pool, tile_plan(m), pb, w.dimensions()[0],
              [=](int64_t m0, int64_t, float*) { return xs + m0 * k; });
  return ffi::Error::Success();
}

#ifdef __AVX512BF16__
// x f32[M, K], rounded to bfloat16 pairs first (in parallel, by row tiles)
ffi::Error PanelMatmulBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                               ffi::ResultBuffer<ffi::F32> y) {
  if (w.element_type() != ffi::DataType::BF16 && w.element_type() != ffi::DataType::U16)
    return ffi::Error::InvalidArgument("panel_matmul_bf16: w must be bfloat16");
  if (auto e = check(x.dimensions(), w.dimensions(), y->dimensions(), 2); e.failure()) return e;
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], n = y->dimensions()[1], steps = (k + 1) / 2;
  if (m == 0 || n == 0) return ffi::Error::Success();
  const TilePlan plan = tile_plan(m);
  const Problem<BF16> pb{nullptr, static_cast<const char*>(w.untyped_data()), y->typed_data(), m, n, steps};
  const float* xs = x.typed_data();
  run_product(pool, plan, pb, w.dimensions()[0], [=](int64_t m0, int64_t count, uint32_t* to) {
    round_rows_bf16(xs + m0 * k, count, k, to);
    return static_cast<const uint32_t*>(to);
  });
  return ffi::Error::Success();
}
#endif

#ifdef __AVX512VNNI__
// x f32[M, K] quantized a row at a time (redjax::quantize_row_i8), times int8 weights w whose
// columns' scales and quantized sums are `scales` f32[P * kPanel] and `sums` s32[P * kPanel] ->
// y f32[M, N], the product of the quantized vectors (three roundings from it), and each row's scale
// and error norms stats f32[M, 3]
ffi::Error PanelMatmulI8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                             ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> sums, ffi::ResultBuffer<ffi::F32> y,
                             ffi::ResultBuffer<ffi::F32> stats) {
  if (auto e = check(x.dimensions(), w.dimensions(), y->dimensions(), 4); e.failure()) return e;
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], n = y->dimensions()[1], steps = (k + 3) / 4;
  const int64_t columns = w.dimensions()[0] * kPanel;
  if (stats->element_count() != 3 * m || scales.element_count() != columns || sums.element_count() != columns)
    return ffi::Error::InvalidArgument("panel_matmul_i8: expected stats [M, 3], scales and sums [P * 32]");
  if (m == 0 || n == 0) return ffi::Error::Success();
  const TilePlan plan = tile_plan(m);
  float* st = stats->typed_data();
  const Problem<I8> pb{nullptr, reinterpret_cast<const char*>(w.typed_data()), y->typed_data(), m, n, steps,
                       {st, scales.typed_data(), sums.typed_data()}};
  const float* xs = x.typed_data();
  run_product(pool, plan, pb, w.dimensions()[0], [=](int64_t m0, int64_t count, uint32_t* to) {
    for (int64_t r = 0; r < count; ++r) redjax::quantize_row_i8(xs + (m0 + r) * k, k, to + r * steps, st + 3 * (m0 + r));
    return static_cast<const uint32_t*>(to);
  });
  return ffi::Error::Success();
}

// x f32[M, K] quantized a row at a time (redjax::quantize_row_w8a8, int8_linear.py's scheme to the
// bit), times int8 weights w with their columns' scales and quantized sums (as PanelMatmulI8's) ->
// y f32[M, N] = the int32 product of the quantized vectors, in float32, times (row scale * column
// scale): what int8_linear.py computes with XLA's int8 dot, bit for bit
ffi::Error PanelMatmulW8A8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                               ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> sums, ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = check(x.dimensions(), w.dimensions(), y->dimensions(), 4); e.failure()) return e;
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], n = y->dimensions()[1], steps = (k + 3) / 4;
  const int64_t columns = w.dimensions()[0] * kPanel;
  if (scales.element_count() != columns || sums.element_count() != columns)
    return ffi::Error::InvalidArgument("panel_matmul_w8a8: expected scales and sums [P * 32]");
  if (m == 0 || n == 0) return ffi::Error::Success();
  thread_local std::vector<float> row_scales;  // the calling thread's, reused across calls
  row_scales.resize(m);
  float* rs = row_scales.data();
  const Problem<W8A8> pb{nullptr, reinterpret_cast<const char*>(w.typed_data()), y->typed_data(), m, n, steps,
                         {rs, scales.typed_data(), sums.typed_data()}};
  const float* xs = x.typed_data();
  run_product(pool, tile_plan(m), pb, w.dimensions()[0], [=](int64_t m0, int64_t count, uint32_t* to) {
    for (int64_t r = 0; r < count; ++r) rs[m0 + r] = redjax::quantize_row_w8a8(xs + (m0 + r) * k, k, to + r * steps);
    return static_cast<const uint32_t*>(to);
  });
  return ffi::Error::Success();
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#ifdef __AVX512BF16__
XLA_FFI_DEFINE_HANDLER_SYMBOL(PanelMatmulBf16, PanelMatmulBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#endif

#ifdef __AVX512VNNI__
XLA_FFI_DEFINE_HANDLER_SYMBOL(PanelMatmulI8, PanelMatmulI8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#endif

#ifdef __AVX512VNNI__
XLA_FFI_DEFINE_HANDLER_SYMBOL(PanelMatmulW8A8, PanelMatmulW8A8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#endif
