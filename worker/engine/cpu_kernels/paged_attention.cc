// Paged attention for XLA's CPU backend, called from JAX through the XLA FFI.
//
// Query tokens are packed back to back; row r holds the q_lens[r] tokens starting at
// q_starts[r], all of one sequence (1: a decode row; more: a prefill chunk), and they attend over
// that sequence's pages, read in place: the page table is followed row by row, so each query
// reads only the keys and values visible to it, with no gathered copy, no work for the masked
// part of a padded page table and none for padding between rows (tokens in no row get zeros).
// Work items are (row, block of queries, KV head) triples spread over XLA's intra-op thread pool;
// each handles the G query heads that share its KV head: a decode row's in one pass over each
// page (decode_attention.h), a prefill block's as small products (prefill_attention.h).
// Same masking as the jnp reference (worker/engine/paged_attention.py): key j is visible to the
// query at position p iff j <= p, j < context_len and p - j < window (window 0: none).
//
// Key pages are transposed within the page ([D, page_size]: dimension i of all the page's keys
// is one contiguous run), value pages are not ([page_size, D]). A query's scores against 16 keys
// are then 16 lanes of one vector accumulated over the D dimensions (q[i] broadcast times a
// contiguous run), with no horizontal sum per key; values are accumulated the same way over D.
//
// Shapes: q f32[T, H, D]; k_pages f32, bf16 or s8 [KV, N, D, page_size]; v_pages the same dtype
// [KV, N, page_size, D]; page_tables s32[R, P]; positions s32[T]; q_starts, q_lens,
// context_lens s32[R]; out f32[T, H, D]. int8 pages (kv_quant.py) come with their scales, f32[KV,
// N, page_size] for keys and for values (the *I8 handlers), applied to each page's scores and
// probabilities (decode_attention.h, prefill_attention.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_rows.h"
#include "decode_attention.h"
#include "page_slot.h"
#include "pool_work.h"
#include "prefill_attention.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using redjax::Ahead, redjax::attend_decode, redjax::Block, redjax::kBlock, redjax::kLanes, redjax::page_at,
    redjax::prime, redjax::Problem, redjax::queue_pages, redjax::scalar, redjax::visible;

// Per-thread buffers, reused across work items.
struct Scratch {
  Ahead ahead;
  std::vector<float> probs;  // decode rows, plain loops: [G, n] scores, then probabilities; [G] inverse sums
  redjax::PrefillScratch prefill;
};

// Attention of query token `token` of row `s`, for its G query heads that share KV head `kvh`:
// scores for every visible key (walking the page table), one softmax per head, then the weighted
// sum of values. `key_page(col)` / `value_page(col)` give page `col` of the row's table as E
// ([D, ps] and [ps, D]). Plain loops, for shapes the vector paths do not cover (a head dimension
// or page size that is not a multiple of 16).
template <typename E, typename KeyPage, typename ValuePage>
void attend_query(const Problem& pb, int64_t s, int64_t token, int64_t kvh, Scratch& scratch, KeyPage key_page,
                  ValuePage value_page) {
  const int64_t d = pb.dim, ps = pb.page_size, g = pb.heads / pb.kv_heads;
  float* o = pb.out + (token * pb.heads + kvh * g) * d;  // [G, D]
  int64_t lo, hi;
  visible(pb, s, token, lo, hi);
  const int64_t n = hi - lo;
  std::fill(o, o + g * d, 0.0f);
  if (n <= 0) return;  // padding
  scratch.probs.resize(g * n + g);
  float* probs = scratch.probs.data();  // [G, n]
  float* inv = probs + g * n;           // [G]: 1 / softmax denominator
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* qs = pb.q + (token * pb.heads + kvh * g) * d;  // [G, D]
  // the visible keys a page at a time: (column, first offset, end offset, index of the first in [0, n))
  auto for_each_page = [&](auto&& visit) {
    for (int64_t col = lo / ps; col * ps < hi; ++col) {
      const int64_t first = std::max(lo, col * ps) - col * ps, end = std::min(hi, col * ps + ps) - col * ps;
      visit(col, first, end, col * ps + first - lo);
    }
  };
  for_each_page([&](int64_t col, int64_t first, int64_t end, int64_t j) {
    const E* kp = key_page(col);  // [D, ps]
    if ((col + 1) * ps < hi) prime(key_page(col + 1));
    const float* ks = pb.k_scales ? redjax::page_scales(pb.k_scales, pb, s, kvh, col) : nullptr;  // int8 pages
    for (int64_t h = 0; h < g; ++h) {
      const float* qh = qs + h * d;
      float* p = probs + h * n + j - first;  // p[t] for t in [first, end)
      for (int64_t t = first; t < end; ++t) {
        float dot = 0.0f;
        for (int64_t i = 0; i < d; ++i) dot += qh[i] * scalar(kp[i * ps + t]);
        p[t] = dot * scale * (ks ? ks[t] : 1.0f);
      }
    }
  });
  prime(value_page(lo / ps));  // read once the softmax is done
  for (int64_t h = 0; h < g; ++h) {
    float* p = probs + h * n;
    // (an `omp simd` max reduction here stayed scalar: 17 % of the demo's decode attention)
    const float mx = redjax::max_of(p, n, -1e30f);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      p[t] = std::exp(p[t] - mx);
      sum += p[t];
    }
    inv[h] = 1.0f / sum;
  }
  for (int64_t h = 0; h < g; ++h) {
    const float* p = probs + h * n;
    float* oh = o + h * d;
    for_each_page([&](int64_t col, int64_t first, int64_t end, int64_t j) {
      const E* rows = value_page(col);
      const float* vs = pb.v_scales ? redjax::page_scales(pb.v_scales, pb, s, kvh, col) : nullptr;
      for (int64_t t = first; t < end; ++t) {
        const float w = p[j + t - first] * (vs ? vs[t] : 1.0f);
        for (int64_t i = 0; i < d; ++i) oh[i] += w * scalar(rows[t * d + i]);
      }
    });
    for (int64_t i = 0; i < d; ++i) oh[i] *= inv[h];
  }
}


// One work item: the queries of block `b` for KV head `kvh`. On the vector path a single query
// (a decode row) goes through `attend_decode`, a block of several (a prefill chunk's) through
// `attend_prefill` (prefill_attention.h); both widen bfloat16 pages as they load them. Other
// shapes take plain loops, query by query.
template <typename T, int DIM>
void attend(const Problem& pb, const Block& b, int64_t kvh, Scratch& scratch) {
  const int64_t page_floats = pb.dim * pb.page_size;
  const T* kbase = static_cast<const T*>(pb.k) + kvh * pb.num_pages * page_floats;  // [N, D, ps]
  const T* vbase = static_cast<const T*>(pb.v) + kvh * pb.num_pages * page_floats;  // [N, ps, D]
  auto key_page = [&](int64_t col) { return kbase + page_at(pb, b.row, col) * page_floats; };
  auto value_page = [&](int64_t col) { return vbase + page_at(pb, b.row, col) * page_floats; };
  if constexpr (DIM > 0) {
    if (b.end - b.begin > 1) return redjax::attend_prefill<DIM, T>(pb, b, kvh, scratch.prefill, key_page, value_page);
    const int64_t g = pb.heads / pb.kv_heads;
    for (int64_t h = 0; h < g; h += 4) {  // a decode row: heads in calls of up to 4
      switch (std::min<int64_t>(4, g - h)) {
        case 1: attend_decode<DIM, 1, T>(pb, b.row, b.begin, kvh, h, scratch, key_page, value_page); break;
        case 2: attend_decode<DIM, 2, T>(pb, b.row, b.begin, kvh, h, scratch, key_page, value_page); break;
        case 3: attend_decode<DIM, 3, T>(pb, b.row, b.begin, kvh, h, scratch, key_page, value_page); break;
        default: attend_decode<DIM, 4, T>(pb, b.row, b.begin, kvh, h, scratch, key_page, value_page); break;
      }
    }
  } else {
    for (int64_t token = b.begin; token < b.end; ++token)
      attend_query<T>(pb, b.row, token, kvh, scratch, key_page, value_page);
  }
}

using AttendFn = void (*)(const Problem&, const Block&, int64_t, Scratch&);

template <typename T>
AttendFn for_shape(int64_t dim, int64_t page_size) {
  if (page_size % kLanes != 0) return attend<T, 0>;
  switch (dim) {
    case 32: return attend<T, 32>;
    case 64: return attend<T, 64>;
    case 80: return attend<T, 80>;
    case 96: return attend<T, 96>;
    case 128: return attend<T, 128>;
    case 256: return attend<T, 256>;
    default: return attend<T, 0>;
  }
}

// A decode step's new keys and values, for PagedAttentionWrite: k and v [T, KV, D] in the pages'
// dtype, slots s32[T]; the pages they go into (the call's outputs, aliasing its page operands).
struct NewTokens {
  const void* k;
  const void* v;
  const int32_t* slots;
  void* k_pages;
  void* v_pages;
  const float* k_scale = nullptr;  // int8 pages: the new tokens' scales f32[T, KV]
  const float* v_scale = nullptr;
  float* k_scales = nullptr;  // and the pages' scales they go into, f32[KV, N, ps]
  float* v_scales = nullptr;
};

// Block `b`'s token (a decode row's one) for KV head `kvh` into its slot, pages of T
template <typename T>
void write_token(const Problem& pb, const NewTokens& nt, const Block& b, int64_t kvh) {
  const int64_t at = (b.begin * pb.kv_heads + kvh) * pb.dim;
  redjax::write_slot(static_cast<T*>(nt.k_pages), static_cast<T*>(nt.v_pages), pb.num_pages, pb.dim, pb.page_size,
                     kvh, int64_t{nt.slots[b.begin]}, static_cast<const T*>(nt.k) + at,
                     static_cast<const T*>(nt.v) + at);
  if constexpr (std::is_same_v<T, int8_t>) {
    const int64_t slot = nt.slots[b.begin], scale_at = b.begin * pb.kv_heads + kvh;
    redjax::write_scale(nt.k_scales, pb.num_pages, pb.page_size, kvh, slot, nt.k_scale[scale_at]);
    redjax::write_scale(nt.v_scales, pb.num_pages, pb.page_size, kvh, slot, nt.v_scale[scale_at]);
  }
}

// The attention of `PagedAttentionImpl`; with `nt`, each (decode row, KV head) item first writes
// its row's token into its slot (page_slot.h). `k_scales`, `v_scales`: int8 pages' scales
// f32[KV, N, ps] (null for float pages).
ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                  ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> q_starts,
                  ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> context_lens, int64_t window,
                  ffi::ResultBuffer<ffi::F32> out, const NewTokens* nt, const float* k_scales = nullptr,
                  const float* v_scales = nullptr) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), vd = v_pages.dimensions(), td = page_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 || positions.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(
        "paged_attention: expected q [T,H,D], keys [KV,N,D,ps], values [KV,N,ps,D], tables [R,P], positions [T]");
  if (k_pages.element_type() != v_pages.element_type())
    return ffi::Error::InvalidArgument("paged_attention: key and value pages differ in dtype");
  // bfloat16 pages come as BF16 or as their bit patterns in U16 (how the engine stores them)
  const bool bf16 = k_pages.element_type() == ffi::DataType::BF16 || k_pages.element_type() == ffi::DataType::U16;
  const bool i8 = k_pages.element_type() == ffi::DataType::S8;
  if (!bf16 && !i8 && k_pages.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("paged_attention: pages must be float32, bfloat16 (or its bits as uint16) or int8");
  if (i8 != (k_scales != nullptr))
    return ffi::Error::InvalidArgument("paged_attention: int8 pages, and only they, come with scales");
  const int64_t tokens = qd[0], rows = td[0];
  if (qd[1] % kd[0] != 0 || qd[2] != kd[2] || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[3] ||
      vd[3] != kd[2] || positions.dimensions()[0] != tokens ||
      q_starts.dimensions()[0] != rows || q_lens.dimensions()[0] != rows || context_lens.dimensions()[0] != rows)
    return ffi::Error::InvalidArgument("paged_attention: inconsistent shapes");
  const Problem pb{q.typed_data(), nt ? nt->k_pages : k_pages.untyped_data(),
                   nt ? nt->v_pages : v_pages.untyped_data(), k_scales, v_scales, page_tables.typed_data(),
                   positions.typed_data(), context_lens.typed_data(), out->typed_data(),
                   qd[1], kd[0], qd[2], kd[1], kd[3], td[1], window};
  const AttendFn fn = i8 ? for_shape<int8_t>(qd[2], kd[3])
                      : bf16 ? for_shape<uint16_t>(qd[2], kd[3]) : for_shape<float>(qd[2], kd[3]);
  const int64_t elem = i8 ? 1 : bf16 ? 2 : 4;
  std::vector<Block> blocks;
  std::vector<char> covered(tokens, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t start = q_starts.typed_data()[r], len = q_lens.typed_data()[r];
    if (len <= 0) continue;  // a padding row
    if (nt != nullptr && len != 1) return ffi::Error::InvalidArgument("paged_attention_write: decode rows only");
    if (start < 0 || start + len > tokens)
      return ffi::Error::InvalidArgument("paged_attention: a row's queries run outside q");
    for (int64_t b = start; b < start + len; b += kBlock) blocks.push_back({r, b, std::min(b + kBlock, start + len)});
    std::fill(covered.begin() + start, covered.begin() + start + len, 1);
  }
  const int64_t token_floats = qd[1] * qd[2];
  for (int64_t t = 0; t < tokens; ++t)  // padding tokens: zeros, like a query with no visible key
    if (!covered[t]) std::fill(out->typed_data() + t * token_floats, out->typed_data() + (t + 1) * token_floats, 0.0f);
  const int64_t items = static_cast<int64_t>(blocks.size()) * kd[0];  // (block, KV head) pairs
  const NewTokens fresh = nt ? *nt : NewTokens{};
  const auto write = elem == 1 ? write_token<int8_t> : elem == 2 ? write_token<uint16_t> : write_token<float>;
  redjax::run_on_pool(pool, items, [pb, fn, elem, write, blocks = std::move(blocks), fresh](int64_t i, int64_t next) {
    thread_local Scratch scratch;  // kept by the pool's threads across calls: no allocation per call
    queue_pages(pb, blocks, next, elem, scratch.ahead);
    const Block& b = blocks[i / pb.kv_heads];
    const int64_t kvh = i % pb.kv_heads;
    if (fresh.slots != nullptr) write(pb, fresh, b, kvh);
    fn(pb, b, kvh, scratch);
  });
  return ffi::Error::Success();
}

// int8 pages' scales f32[KV, N, ps] against the pages' [KV, N, ...] and the page size
bool scales_fit(ffi::Buffer<ffi::F32> scales, ffi::AnyBuffer k_pages) {
  const auto sd = scales.dimensions(), kd = k_pages.dimensions();
  return sd.size() == 3 && kd.size() == 4 && sd[0] == kd[0] && sd[1] == kd[1] && sd[2] == kd[3];
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_tables, ffi::Buffer<ffi::S32> positions,
                              ffi::Buffer<ffi::S32> q_starts, ffi::Buffer<ffi::S32> q_lens,
                              ffi::Buffer<ffi::S32> context_lens, int64_t window, ffi::ResultBuffer<ffi::F32> out) {
  return Attend(pool, q, k_pages, v_pages, page_tables, positions, q_starts, q_lens, context_lens, window, out, nullptr);
}

// int8 pages with their scales (kv_quant.py)
ffi::Error PagedAttentionI8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                                ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_tables,
                                ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> q_starts,
                                ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> context_lens,
                                ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales, int64_t window,
                                ffi::ResultBuffer<ffi::F32> out) {
  if (!scales_fit(k_scales, k_pages) || !scales_fit(v_scales, k_pages))
    return ffi::Error::InvalidArgument("paged_attention: expected scales [KV,N,ps]");
  return Attend(pool, q, k_pages, v_pages, page_tables, positions, q_starts, q_lens, context_lens, window, out, nullptr,
                k_scales.typed_data(), v_scales.typed_data());
}

// The new tokens' operands of the write handlers against the pages: k and v [T,KV,D] in the
// pages' dtype, slots [T]; the outputs aliasing the pages (copied first should XLA ever hand over
// separate buffers)
ffi::Error check_new_tokens(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> k_out,
                            ffi::Result<ffi::AnyBuffer> v_out) {
  const auto kd = k_pages.dimensions(), nd = k.dimensions();
  if (kd.size() != 4 || nd.size() != 3 || k.element_type() != k_pages.element_type() ||
      v.element_type() != k_pages.element_type() || v.dimensions().size() != 3 || nd[0] != q.dimensions()[0] ||
      nd[1] != kd[0] || nd[2] != kd[2] || v.dimensions()[0] != nd[0] || v.dimensions()[1] != nd[1] ||
      v.dimensions()[2] != nd[2] || slots.element_count() != nd[0])
    return ffi::Error::InvalidArgument("paged_attention_write: expected k, v [T,KV,D] in the pages' dtype, slots [T]");
  if (k_out->untyped_data() != k_pages.untyped_data())
    std::memcpy(k_out->untyped_data(), k_pages.untyped_data(), k_pages.size_bytes());
  if (v_out->untyped_data() != v_pages.untyped_data())
    std::memcpy(v_out->untyped_data(), v_pages.untyped_data(), v_pages.size_bytes());
  return ffi::Error::Success();
}

// Decode rows only (one query each): each (row, KV head) item writes its row's new key and value
// (k, v [T, KV, D], slots s32[T]) and then attends, so the page write is no pass of its own. The
// lines it writes are in the last page the item reads next: the demo model's four layers of page
// writes and decode attention (64 rows at 192 keys) took 1.05-1.08x less time than as two calls
// (session 40, alternating in one process). The pages come back as outputs aliasing the operands.
ffi::Error PagedAttentionWriteImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                                   ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_tables,
                                   ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> q_starts,
                                   ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> context_lens, ffi::AnyBuffer k,
                                   ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots, int64_t window,
                                   ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k_out,
                                   ffi::Result<ffi::AnyBuffer> v_out) {
  if (auto error = check_new_tokens(q, k_pages, v_pages, k, v, slots, k_out, v_out); error.failure()) return error;
  const NewTokens nt{k.untyped_data(), v.untyped_data(), slots.typed_data(), k_out->untyped_data(),
                     v_out->untyped_data()};
  return Attend(pool, q, k_pages, v_pages, page_tables, positions, q_starts, q_lens, context_lens, window, out, &nt);
}

// The same for int8 pages: the new tokens come quantized (k, v int8 [T, KV, D] and their scales
// f32[T, KV]), and their scales go into the pages' scales (f32[KV, N, ps], also aliased outputs).
ffi::Error PagedAttentionWriteI8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                                     ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> page_tables,
                                     ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> q_starts,
                                     ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> context_lens,
                                     ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots,
                                     ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                                     ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, int64_t window,
                                     ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k_out,
                                     ffi::Result<ffi::AnyBuffer> v_out, ffi::ResultBuffer<ffi::F32> ks_out,
                                     ffi::ResultBuffer<ffi::F32> vs_out) {
  if (auto error = check_new_tokens(q, k_pages, v_pages, k, v, slots, k_out, v_out); error.failure()) return error;
  const int64_t pairs = k.dimensions()[0] * k.dimensions()[1];
  if (!scales_fit(k_scales, k_pages) || !scales_fit(v_scales, k_pages) || k_scale.element_count() != pairs ||
      v_scale.element_count() != pairs)
    return ffi::Error::InvalidArgument("paged_attention_write: expected scales [KV,N,ps] and new scales [T,KV]");
  if (ks_out->typed_data() != k_scales.typed_data())
    std::memcpy(ks_out->typed_data(), k_scales.typed_data(), k_scales.size_bytes());
  if (vs_out->typed_data() != v_scales.typed_data())
    std::memcpy(vs_out->typed_data(), v_scales.typed_data(), v_scales.size_bytes());
  const NewTokens nt{k.untyped_data(), v.untyped_data(), slots.typed_data(), k_out->untyped_data(),
                     v_out->untyped_data(), k_scale.typed_data(), v_scale.typed_data(), ks_out->typed_data(),
                     vs_out->typed_data()};
  return Attend(pool, q, k_pages, v_pages, page_tables, positions, q_starts, q_lens, context_lens, window, out, &nt,
                ks_out->typed_data(), vs_out->typed_data());
}

// The operands both handlers take first: the pool, q, the key and value pages, the page tables,
// positions, each row's first query and query count, and the context lengths.
auto attention_operands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

// ... then, for the write handlers, the new keys, values and their slots
auto write_operands() {
  return attention_operands().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttention, PagedAttentionImpl,
                              attention_operands().Attr<int64_t>("window").Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionI8, PagedAttentionI8Impl,
                              attention_operands()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // key scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // value scales
                                  .Attr<int64_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionWrite, PagedAttentionWriteImpl,
                              write_operands()
                                  .Attr<int64_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionWriteI8, PagedAttentionWriteI8Impl,
                              write_operands()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // key scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // value scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the new keys' scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the new values' scales
                                  .Attr<int64_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
