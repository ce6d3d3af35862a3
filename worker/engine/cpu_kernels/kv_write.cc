// Writing a step's new keys and values into their page slots on XLA's CPU backend, in place, called
// from JAX through the XLA FFI (the results alias the page operands).
//
// Key pages are transposed within the page ([D, page_size], see paged_attention.cc), so one token's
// D key values land in D different cache lines, page_size floats apart (page_slot.h). XLA's scatter does those
// writes one element at a time on one thread, with the index arithmetic of a general scatter: 300 us
// per layer for 62 decode tokens of llama-100m (4 KV heads x 64 dimensions), 5 % of its decode step.
// Here (token, KV head) pairs are spread over the intra-op pool, KV head by KV head, 128 to a work
// item, and each pair writes its D key values down one column and its D values as one contiguous
// row. A prefill chunk's tokens fill consecutive slots, so an item then writes along its pages.
//
// Padding tokens have slot 0 (in the reserved page 0) and write nothing, as in the jnp scatters
// (paged_attention.write_pages).
//
// Shapes: k_pages [KV, N, D, page_size] and v_pages [KV, N, page_size, D], float32, bfloat16 bits
// (uint16) or int8 (KvWriteI8, with the pages' scales f32[KV, N, page_size] and the new tokens'
// f32[T, KV]); k, v [T, KV, D] in the pages' dtype; slots s32[T] (page * page_size + offset).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "page_slot.h"
#include "pool_work.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// (token, KV head) pairs per work item, the pairs taken KV head by KV head (pair = head * T + token).
// Claiming an item costs a trip of the shared counter's cache line between the cores, about what
// one pair's writes cost (4 layers x 64 decode tokens x 4 KV heads of the demo model: 291-305 us
// one pair an item, 198-216 at 16). Prefill writes, 1032 tokens x 4 KV heads, pairs token by token
// 16 to an item before (each item touched four heads' pages, and the next item, often on the
// other core, the same lines): 396-1079 -> 96-339 us a layer here; one thread: 122-286 us. Decode
// writes are unchanged (17-38 us a layer either way).
constexpr int64_t kPairsPerItem = 128;

// int8 pages' scales: the new tokens' (f32[T, KV]) and the pages' (f32[KV, N, ps]) they go into
struct Scales {
  const float* k = nullptr;
  const float* v = nullptr;
  float* k_pages = nullptr;
  float* v_pages = nullptr;
};

template <typename E>
void write(ffi::ThreadPool& pool, const E* k, const E* v, const int32_t* slots, E* kp, E* vp, int64_t tokens,
           int64_t kv_heads, int64_t num_pages, int64_t dim, int64_t ps, Scales sc = {}) {
  const int64_t pairs = tokens * kv_heads;
  redjax::run_on_pool(pool, (pairs + kPairsPerItem - 1) / kPairsPerItem, [=](int64_t item) {
    for (int64_t pair = item * kPairsPerItem; pair < std::min(pairs, (item + 1) * kPairsPerItem); ++pair) {
      const int64_t t = pair % tokens, h = pair / tokens, at = (t * kv_heads + h) * dim;
      redjax::write_slot(kp, vp, num_pages, dim, ps, h, int64_t{slots[t]}, k + at, v + at);
      if (sc.k != nullptr) {
        redjax::write_scale(sc.k_pages, num_pages, ps, h, int64_t{slots[t]}, sc.k[t * kv_heads + h]);
        redjax::write_scale(sc.v_pages, num_pages, ps, h, int64_t{slots[t]}, sc.v[t * kv_heads + h]);
      }
    }
  });
}

// The operands' shapes: pages [KV,N,D,ps] and [KV,N,ps,D], k and v [T,KV,D], slots [T]
bool shapes_fit(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k, ffi::AnyBuffer v,
                ffi::Buffer<ffi::S32> slots) {
  auto kd = k_pages.dimensions(), vd = v_pages.dimensions(), nd = k.dimensions(), ud = v.dimensions();
  return kd.size() == 4 && vd.size() == 4 && nd.size() == 3 && ud.size() == 3 && vd[0] == kd[0] && vd[1] == kd[1] &&
         vd[2] == kd[3] && vd[3] == kd[2] && nd[1] == kd[0] && nd[2] == kd[2] && ud[0] == nd[0] && ud[1] == nd[1] &&
         ud[2] == nd[2] && slots.element_count() == nd[0];
}

// The results alias their operands; should XLA ever hand over separate buffers, start from a copy
void start_from(void* out, const void* in, size_t bytes) {
  if (out != in) std::memcpy(out, in, bytes);
}

ffi::Error KvWriteImpl(ffi::ThreadPool pool, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> k_out,
                       ffi::Result<ffi::AnyBuffer> v_out) {
  if (!shapes_fit(k_pages, v_pages, k, v, slots))
    return ffi::Error::InvalidArgument("kv_write: expected pages [KV,N,D,ps] and [KV,N,ps,D], k and v [T,KV,D], slots [T]");
  const auto type = k_pages.element_type();
  if (v_pages.element_type() != type || k.element_type() != type || v.element_type() != type ||
      (type != ffi::DataType::F32 && type != ffi::DataType::U16))
    return ffi::Error::InvalidArgument("kv_write: pages, k and v must share one dtype, float32 or uint16");
  auto kd = k_pages.dimensions();
  const int64_t kv_heads = kd[0], num_pages = kd[1], dim = kd[2], ps = kd[3], tokens = k.dimensions()[0];
  start_from(k_out->untyped_data(), k_pages.untyped_data(), k_pages.size_bytes());
  start_from(v_out->untyped_data(), v_pages.untyped_data(), v_pages.size_bytes());
  if (type == ffi::DataType::F32)
    write(pool, static_cast<const float*>(k.untyped_data()), static_cast<const float*>(v.untyped_data()),
          slots.typed_data(), static_cast<float*>(k_out->untyped_data()), static_cast<float*>(v_out->untyped_data()),
          tokens, kv_heads, num_pages, dim, ps);
  else
    write(pool, static_cast<const uint16_t*>(k.untyped_data()), static_cast<const uint16_t*>(v.untyped_data()),
          slots.typed_data(), static_cast<uint16_t*>(k_out->untyped_data()),
          static_cast<uint16_t*>(v_out->untyped_data()), tokens, kv_heads, num_pages, dim, ps);
  return ffi::Error::Success();
}

// int8 pages (kv_quant.py): k and v quantized, with their scales k_scale, v_scale f32[T, KV],
// which go into the pages' scales k_scales, v_scales f32[KV, N, ps] (outputs aliasing them too).
ffi::Error KvWriteI8Impl(ffi::ThreadPool pool, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> k_scales,
                         ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                         ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out,
                         ffi::ResultBuffer<ffi::F32> ks_out, ffi::ResultBuffer<ffi::F32> vs_out) {
  if (!shapes_fit(k_pages, v_pages, k, v, slots))
    return ffi::Error::InvalidArgument("kv_write: expected pages [KV,N,D,ps] and [KV,N,ps,D], k and v [T,KV,D], slots [T]");
  for (auto type : {k_pages.element_type(), v_pages.element_type(), k.element_type(), v.element_type()})
    if (type != ffi::DataType::S8) return ffi::Error::InvalidArgument("kv_write: int8 pages, k and v expected");
  auto kd = k_pages.dimensions(), sd = k_scales.dimensions();
  const int64_t kv_heads = kd[0], num_pages = kd[1], dim = kd[2], ps = kd[3], tokens = k.dimensions()[0];
  if (sd.size() != 3 || sd[0] != kv_heads || sd[1] != num_pages || sd[2] != ps ||
      v_scales.element_count() != k_scales.element_count() || k_scale.element_count() != tokens * kv_heads ||
      v_scale.element_count() != tokens * kv_heads)
    return ffi::Error::InvalidArgument("kv_write: expected scales [KV,N,ps] and new scales [T,KV]");
  start_from(k_out->untyped_data(), k_pages.untyped_data(), k_pages.size_bytes());
  start_from(v_out->untyped_data(), v_pages.untyped_data(), v_pages.size_bytes());
  start_from(ks_out->typed_data(), k_scales.typed_data(), k_scales.size_bytes());
  start_from(vs_out->typed_data(), v_scales.typed_data(), v_scales.size_bytes());
  write(pool, static_cast<const int8_t*>(k.untyped_data()), static_cast<const int8_t*>(v.untyped_data()),
        slots.typed_data(), static_cast<int8_t*>(k_out->untyped_data()), static_cast<int8_t*>(v_out->untyped_data()),
        tokens, kv_heads, num_pages, dim, ps,
        Scales{k_scale.typed_data(), v_scale.typed_data(), ks_out->typed_data(), vs_out->typed_data()});
  return ffi::Error::Success();
}

// The operands both handlers take first: the pool, the key and value pages, the new keys and
// values, their slots
auto write_operands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvWrite, KvWriteImpl, write_operands().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvWriteI8, KvWriteI8Impl,
                              write_operands()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the pages' key scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // and value scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the new keys' scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the new values' scales
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
