// Writing one token's key and value for one KV head into its page slot: what the page-write
// kernel (kv_write.cc) does for every (token, KV head) pair, and the decode attention
// (paged_attention.cc, PagedAttentionWrite) for its row's token just before it reads the pages.
//
// Key pages are transposed within the page ([D, page_size]), so the key goes down one column, D
// values page_size apart; value pages are not ([page_size, D]), so the value is one contiguous
// row. Slot 0 (in the reserved page 0: padding, or a fused decode row past its own steps) and
// slots outside the cache write nothing. int8 pages (kv_quant.py) also take the token's scale for the
// head into the slot of their scales (`write_scale`).

#pragma once

#include <cstdint>
#include <cstring>

namespace redjax {

// k_pages [KV, N, D, ps], v_pages [KV, N, ps, D]; key and value: the token's D values for KV head kvh
template <typename E>
inline void write_slot(E* k_pages, E* v_pages, int64_t num_pages, int64_t dim, int64_t ps, int64_t kvh,
                       int64_t slot, const E* key, const E* value) {
  const int64_t page = slot / ps, offset = slot % ps, page_elems = dim * ps;
  if (slot <= 0 || page >= num_pages) return;
  E* column = k_pages + (kvh * num_pages + page) * page_elems + offset;  // dimension i at column[i * ps]
  for (int64_t i = 0; i < dim; ++i) column[i * ps] = key[i];
  std::memcpy(v_pages + (kvh * num_pages + page) * page_elems + offset * dim, value, dim * sizeof(E));
}

// int8 pages: the token's scale for KV head `kvh` into its slot of `scales` f32[KV, N, ps]
inline void write_scale(float* scales, int64_t num_pages, int64_t ps, int64_t kvh, int64_t slot, float scale) {
  if (slot <= 0 || slot / ps >= num_pages) return;
  scales[kvh * num_pages * ps + slot] = scale;
}

}  // namespace redjax
