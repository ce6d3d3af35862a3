// Paged attention for XLA's CPU backend, called from JAX through the XLA FFI.
//
// Query tokens are packed back to back; row r holds the q_lens[r] tokens starting at
// q_starts[r], all of one sequence (1: a decode row; more: a prefill chunk), and they attend over
// that sequence's pages, read in place: the page table is followed row by row, so each query
// reads only the keys and values visible to it, with no gathered copy, no work for the masked
// part of a padded page table and none for padding between rows (tokens in no row get zeros).
// Work items are (row, block of queries, KV head) triples spread over XLA's intra-op thread pool;
// each handles the G query heads that share its KV head, query by query.
// Same masking as the jnp reference (worker/engine/paged_attention.py): key j is visible to the
// query at position p iff j <= p, j < context_len and p - j < window (window 0: none).
//
// Shapes: q f32[T, H, D]; k_pages, v_pages f32 or bf16 [KV, N, page_size, D];
// page_tables s32[R, P]; positions s32[T]; q_starts, q_lens, context_lens s32[R]; out f32[T, H, D].

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxDim = 512;  // head_dim limit (the row buffers below live on the stack)

// A key or value row as float32: float32 pages are read in place; bfloat16 rows (the high half of
// a float32) are widened into `buf` first, in one vectorizable pass, so the dot products below
// run on plain floats either way.
inline const float* as_floats(const float* row, float*, int64_t) { return row; }
inline const float* as_floats(const uint16_t* row, float* buf, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const uint32_t bits = static_cast<uint32_t>(row[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    buf[i] = f;
  }
  return buf;
}

constexpr int64_t kBlock = 16;  // queries per work item: long prefill rows spread over the threads

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* tables;
  const int32_t* positions;
  const int32_t* context_lens;
  float* out;
  int64_t heads, kv_heads, dim, num_pages, page_size, table_width, window;
};

// A work item's queries: tokens [begin, end) of row `row`.
struct Block {
  int64_t row, begin, end;
};

// Attention of query token `token` of row `s`, for its G query heads that share KV head `kvh`:
// scores for every visible key (walking the page table), one softmax per head, then the weighted
// sum of values. DIM > 0 fixes the head dimension at compile time (fully unrolled,
// register-resident rows); 0: any.
template <typename T, int DIM>
void attend_query(const Problem& pb, int64_t s, int64_t token, int64_t kvh, std::vector<float>& scratch) {
  const int64_t d = DIM > 0 ? DIM : pb.dim, ps = pb.page_size, g = pb.heads / pb.kv_heads;
  float* o = pb.out + (token * pb.heads + kvh * g) * d;  // [G, D]
  const int64_t pos = pb.positions[token];
  // exclusive end: also never past the page table (a fused decode row that has stopped keeps
  // stepping with positions beyond its pages; its output is discarded)
  const int64_t hi = std::min<int64_t>({pos + 1, pb.context_lens[s], pb.table_width * ps});
  const int64_t lo = pb.window > 0 ? std::max<int64_t>(0, pos - pb.window + 1) : 0;
  const int64_t n = hi - lo;  // visible keys
  std::fill(o, o + g * d, 0.0f);
  if (n <= 0) return;  // padding
  scratch.resize(g * n + g);
  float* probs = scratch.data();  // [G, n]: scores, then probabilities
  float* inv = probs + g * n;     // [G]: 1 / softmax denominator
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* qs = pb.q + (token * pb.heads + kvh * g) * d;  // [G, D]
  const T* kbase = static_cast<const T*>(pb.k) + kvh * pb.num_pages * ps * d;
  const T* vbase = static_cast<const T*>(pb.v) + kvh * pb.num_pages * ps * d;
  const int32_t* table = pb.tables + s * pb.table_width;
  // visit every visible key row in order, a page at a time (no division per token)
  auto for_each_row = [&](const T* base, auto&& visit) {
    for (int64_t col = lo / ps; col * ps < hi; ++col) {
      int64_t page = table[col];
      if (page < 0 || page >= pb.num_pages) page = 0;  // never read outside the cache
      const T* rows = base + page * ps * d;  // [page_size, D]
      for (int64_t t = std::max(lo, col * ps) - col * ps, end = std::min(hi, col * ps + ps) - col * ps; t < end; ++t)
        visit(col * ps + t - lo, rows + t * d);
    }
  };
  alignas(64) float row_buf[kMaxDim];
  for_each_row(kbase, [&](int64_t j, const T* k_row) {
    const float* k = as_floats(k_row, row_buf, d);
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = qs + h * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += qh[i] * k[i];
      probs[h * n + j] = dot * scale;
    }
  });
  for (int64_t h = 0; h < g; ++h) {
    float* p = probs + h * n;
    float mx = -1e30f, sum = 0.0f;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, p[t]);
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      p[t] = std::exp(p[t] - mx);
      sum += p[t];
    }
    inv[h] = 1.0f / sum;
  }
  for_each_row(vbase, [&](int64_t j, const T* v_row) {
    const float* v = as_floats(v_row, row_buf, d);
    for (int64_t h = 0; h < g; ++h) {
      const float p = probs[h * n + j];
      float* oh = o + h * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) oh[i] += p * v[i];
    }
  });
  for (int64_t h = 0; h < g; ++h) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) o[h * d + i] *= inv[h];
  }
}

template <typename T, int DIM>
void attend(const Problem& pb, const Block& b, int64_t kvh, std::vector<float>& scratch) {
  for (int64_t token = b.begin; token < b.end; ++token) attend_query<T, DIM>(pb, b.row, token, kvh, scratch);
}

// Items are claimed from a shared counter by the calling thread and by pool tasks; the state is
// shared-owned, so a pool task that starts after all items are done only reads the counter.
using AttendFn = void (*)(const Problem&, const Block&, int64_t, std::vector<float>&);

template <typename T>
AttendFn for_dim(int64_t dim) {
  switch (dim) {
    case 32: return attend<T, 32>;
    case 64: return attend<T, 64>;
    case 128: return attend<T, 128>;
    case 256: return attend<T, 256>;
    default: return attend<T, 0>;
  }
}

struct Work {
  Problem pb;
  AttendFn fn;
  std::vector<Block> blocks;
  int64_t items;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    std::vector<float> scratch;
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      fn(pb, blocks[i / pb.kv_heads], i % pb.kv_heads, scratch);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> positions,
                              ffi::Buffer<ffi::S32> q_starts, ffi::Buffer<ffi::S32> q_lens,
                              ffi::Buffer<ffi::S32> context_lens, int64_t window, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), td = page_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || positions.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(
        "paged_attention: expected q [T,H,D], pages [KV,N,ps,D], tables [R,P], positions [T]");
  if (k_pages.element_type() != v_pages.element_type())
    return ffi::Error::InvalidArgument("paged_attention: key and value pages differ in dtype");
  // bfloat16 pages come as BF16 or as their bit patterns in U16 (how the engine stores them)
  const bool bf16 = k_pages.element_type() == ffi::DataType::BF16 || k_pages.element_type() == ffi::DataType::U16;
  if (!bf16 && k_pages.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("paged_attention: pages must be float32 or bfloat16 (or its bits as uint16)");
  const int64_t tokens = qd[0], rows = td[0];
  if (qd[1] % kd[0] != 0 || qd[2] != kd[3] || positions.dimensions()[0] != tokens ||
      q_starts.dimensions()[0] != rows || q_lens.dimensions()[0] != rows || context_lens.dimensions()[0] != rows)
    return ffi::Error::InvalidArgument("paged_attention: inconsistent shapes");
  if (qd[2] > kMaxDim) return ffi::Error::InvalidArgument("paged_attention: head_dim above 512");
  auto work = std::make_shared<Work>();
  work->pb = Problem{q.typed_data(), k_pages.untyped_data(), v_pages.untyped_data(), page_tables.typed_data(),
                     positions.typed_data(), context_lens.typed_data(), out->typed_data(),
                     qd[1], kd[0], qd[2], kd[1], kd[2], td[1], window};
  work->fn = bf16 ? for_dim<uint16_t>(qd[2]) : for_dim<float>(qd[2]);
  std::vector<char> covered(tokens, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t start = q_starts.typed_data()[r], len = q_lens.typed_data()[r];
    if (len <= 0) continue;  // a padding row
    if (start < 0 || start + len > tokens)
      return ffi::Error::InvalidArgument("paged_attention: a row's queries run outside q");
    for (int64_t b = start; b < start + len; b += kBlock) work->blocks.push_back({r, b, std::min(b + kBlock, start + len)});
    std::fill(covered.begin() + start, covered.begin() + start + len, 1);
  }
  const int64_t token_floats = qd[1] * qd[2];
  for (int64_t t = 0; t < tokens; ++t)  // padding tokens: zeros, like a query with no visible key
    if (!covered[t]) std::fill(out->typed_data() + t * token_floats, out->typed_data() + (t + 1) * token_floats, 0.0f);
  work->items = static_cast<int64_t>(work->blocks.size()) * kd[0];
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < work->items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>());
