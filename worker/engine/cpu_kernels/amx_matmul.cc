// bfloat16 products on Intel AMX tiles (TDPBF16PS), over the bfloat16 panels of panel_matmul.cc,
// called from JAX through the XLA FFI where the CPU has AMX-BF16 (Sapphire Rapids and later).
//
// One TDPBF16PS multiplies a 16 x 32 tile of x by a 32 x 16 tile of the weight into 16 x 16
// float32 sums: 8192 multiply-adds, where an AVX-512 VDPBF16PS does 32. The panel layout is
// already the one the instruction reads for its weight tile: a panel row holds 32 columns of k and
// k + 1 (128 bytes), so the rows of 16 consecutive pairs, 64 bytes each at a 128-byte stride, are
// the left or right 16 columns of the panel for 32 values of k.
//
// Each work item is one panel (32 columns) for up to 256 rows. x, rounded to bfloat16 pairs and
// padded with zero rows to a multiple of 32, goes through it 32 rows at a time: two x tiles (rows
// 0-15, 16-31) and two weight tiles (columns 0-15, 16-31) per 32 k, four products into four
// accumulator tiles, which are all eight tiles the machine has. The first pass reads the panel
// from memory, later ones from L2; while it computes a thread requests the panel it runs next, as
// panel_matmul.cc does.
//
// Tiles are per-thread state: every item loads the configuration and releases the tiles at the
// end (other code on XLA's threads may use AMX with its own). The process asks Linux for the AMX
// state once (`RedjaxAmxPermit`, before the handler is registered); without it the first tile
// instruction would fault.
//
// Shapes: x f32[M, K]; w bf16[P, K / 2, 64] (panels, K a multiple of 32); y f32[M, N] with
// (P - 1) * 32 < N <= P * 32.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_rows.h"
#include "pool_work.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

namespace {

constexpr int64_t kPanel = 32;       // columns per panel (worker/engine/cpu_matmul.py: PANEL)
constexpr int64_t kRowBytes = 128;   // a panel row: 32 columns x (k, k + 1) in bfloat16
constexpr int64_t kTileRows = 16;    // rows of an x tile, k pairs of a weight tile
constexpr int64_t kBlock = 32;       // rows of x per pass over a panel: two x tiles
constexpr int64_t kChunk = 16;       // k pairs per tile step (32 values of k)
constexpr int64_t kChunkBytes = kChunk * kRowBytes;  // a tile step's weights: 2 KB of the panel
constexpr int64_t kLead = 8;  // the first pass over a panel requests its weights this many steps ahead

// ldtilecfg's 64-byte operand: palette 1, every tile 16 rows of 64 bytes (tiles 0-3 accumulate
// 16 x 16 floats, 4-5 hold x, 6-7 the weight)
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

TileConfig make_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.bytes_per_row[t] = 64;
    c.rows[t] = kTileRows;
  }
  return c;
}

struct Problem {
  const uint32_t* x;  // bfloat16 pairs [ceil(M / 32) * 32, steps], zero rows past M
  const char* w;      // panels of steps x 128 bytes
  float* y;           // [M, N]
  int64_t m, n, steps;
  int64_t panel_bytes() const { return steps * kRowBytes; }
};

// y[m0 : m0 + 32, n0 : n0 + 32] (clipped at M and N) = x[m0 : m0 + 32] @ panel; while it runs,
// `ahead` (if any) gets `bytes` of the next panel requested into L2, and with `lead` the panel's
// own weights are requested kLead steps before they are read (the first pass reads memory)
void block(const Problem& pb, const char* panel, int64_t m0, int64_t n0, const char* ahead, int64_t bytes,
           bool lead) {
  const int64_t x_stride = pb.steps * 4;
  const char* x0 = reinterpret_cast<const char*>(pb.x + m0 * pb.steps);
  const char* x1 = x0 + kTileRows * x_stride;
  const int64_t chunks = pb.steps / kChunk, per_chunk = ahead ? bytes / chunks : 0;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    const char* wk = panel + c * kChunkBytes;
    if (lead && c + kLead < chunks)
      for (int64_t b = 0; b < kChunkBytes; b += 64) __builtin_prefetch(wk + kLead * kChunkBytes + b, 0, 3);
    for (int64_t b = 0; b < per_chunk; b += 64) __builtin_prefetch(ahead + c * per_chunk + b, 0, 2);
    _tile_loadd(4, x0 + c * kChunk * 4, x_stride);
    _tile_loadd(5, x1 + c * kChunk * 4, x_stride);
    _tile_loadd(6, wk, kRowBytes);
    _tile_loadd(7, wk + 64, kRowBytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t rows = std::min(kBlock, pb.m - m0), cols = std::min(kPanel, pb.n - n0);
  float* out = pb.y + m0 * pb.n + n0;
  if (rows == kBlock && cols == kPanel) {  // straight into y
    const int64_t stride = pb.n * 4;
    _tile_stored(0, out, stride);
    _tile_stored(1, out + 16, stride);
    _tile_stored(2, out + kTileRows * pb.n, stride);
    _tile_stored(3, out + kTileRows * pb.n + 16, stride);
    return;
  }
  alignas(64) float full[kBlock][kPanel];  // the block, then its rows and columns inside M x N
  _tile_stored(0, &full[0][0], kPanel * 4);
  _tile_stored(1, &full[0][16], kPanel * 4);
  _tile_stored(2, &full[16][0], kPanel * 4);
  _tile_stored(3, &full[16][16], kPanel * 4);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * pb.n, full[r], cols * sizeof(float));
}

// Rows go through a panel in groups of up to kGroup blocks (256 rows): a work item is one panel
// for one group, and items run group by group, so a thread's x stays in L2 across the panels of a
// group (a 512- or 1024-row prefill product over whole columns read x from L3 for every panel:
// 0.79-0.92 of the time with groups, in-process A/B at llama-100m's prefill shapes, the results
// bit for bit the same; up to 256 rows nothing changes).
constexpr int64_t kGroup = 8;

// item i: panel i % panels for the row blocks of group i / panels; `next`: the item this thread
// runs after it (-1: none), whose panel it requests
void panel_product(const Problem& pb, const TileConfig& config, int64_t panels, int64_t i, int64_t next) {
  _tile_loadconfig(&config);
  const int64_t bytes = pb.panel_bytes(), p = i % panels, all = (pb.m + kBlock - 1) / kBlock;
  const int64_t b0 = i / panels * kGroup, blocks = std::min(kGroup, all - b0);
  const char* panel = pb.w + p * bytes;
  const char* ahead = next < 0 ? nullptr : pb.w + next % panels * bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    // the first pass waits on memory; the later ones share the requests for the next panel (with
    // a single pass, that one makes them)
    const bool asks = ahead != nullptr && (b > 0 || blocks == 1);
    const int64_t share = blocks == 1 ? bytes : (bytes + blocks - 2) / (blocks - 1);
    const int64_t from = blocks == 1 ? 0 : (b - 1) * share;
    block(pb, panel, (b0 + b) * kBlock, p * kPanel, asks && from < bytes ? ahead + from : nullptr,
          std::min(share, bytes - from), b == 0);
  }
  _tile_release();
}

ffi::Error AmxMatmulBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                             ffi::ResultBuffer<ffi::F32> y) {
  if (w.element_type() != ffi::DataType::BF16 && w.element_type() != ffi::DataType::U16)
    return ffi::Error::InvalidArgument("amx_matmul_bf16: w must be bfloat16");
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("amx_matmul_bf16: expected x [M,K], w [P,K/2,64], y [M,N]");
  const int64_t m = xd[0], k = xd[1], n = yd[1], panels = wd[0], steps = k / 2;
  if (k % (2 * kChunk) != 0 || wd[1] != steps || wd[2] != 2 * kPanel || yd[0] != m || n > panels * kPanel ||
      n <= (panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("amx_matmul_bf16: inconsistent shapes (K must be a multiple of 32)");
  if (m == 0 || n == 0) return ffi::Error::Success();
  const int64_t padded = (m + kBlock - 1) / kBlock * kBlock;
  thread_local std::vector<uint32_t> staged;  // the calling thread's, reused across calls
  staged.resize(padded * steps);
  uint32_t* to = staged.data();
  const float* xs = x.typed_data();
  const int64_t blocks = padded / kBlock;
  redjax::run_on_pool(pool, blocks, [=](int64_t b) {
    const int64_t m0 = b * kBlock, rows = std::min(kBlock, m - m0);
    redjax::round_rows_bf16(xs + m0 * k, rows, k, to + m0 * steps);
    std::memset(to + (m0 + rows) * steps, 0, (kBlock - rows) * steps * sizeof(uint32_t));
  });
  const Problem pb{to, static_cast<const char*>(w.untyped_data()), y->typed_data(), m, n, steps};
  const TileConfig config = make_config();
  const int64_t items = panels * ((blocks + kGroup - 1) / kGroup);
  redjax::run_on_pool(pool, items, [&pb, &config, panels](int64_t i, int64_t next) {
    panel_product(pb, config, panels, i, next);
  });
  return ffi::Error::Success();
}

}  // namespace

// Asks Linux for the AMX tile state for this process (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); 0 on success. Idempotent.
extern "C" int RedjaxAmxPermit() {
  constexpr int kReqXcompPerm = 0x1023, kXtiledata = 18;
  return static_cast<int>(syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AmxMatmulBf16, AmxMatmulBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#endif
