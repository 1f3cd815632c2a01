// Writes a step's K and V rows into one layer's paged KV cache (kv_cache_layout.write_kv on
// the CPU): for token t and KV head h, key[t, h, :] goes to
// k_cache[slot / block_size, h, slot % block_size, :] with slot = slots[t], and value
// likewise. Any element type (a row is copied as bytes); a negative slot is padding and
// skipped. Strides are in elements; rows must have unit stride.
//
// NOTE: PyTorch's advanced-index assignment took ~60 us for a decode step's 64 tokens (twice
// a layer: K, then V), 2.3% of a decode step on one core. Most of a write is cache misses:
// the slots are scattered over a cache far larger than the CPU's, and a plain store first
// reads its line. Whole 64-byte-aligned rows are written with non-temporal stores, which
// skip that read (the decode kernel streams the rows from memory either way).
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

void copy_row(char* dst, const char* src, size_t bytes) {
#ifdef __AVX512F__
  if (bytes % 64 == 0 && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
    for (size_t b = 0; b < bytes; b += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + b),
                          _mm512_loadu_si512(reinterpret_cast<const void*>(src + b)));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

}  // namespace

extern "C" {

// Returns 0, or -1 (nothing written) if a slot lies past the cache's last block.
int tandem_write_kv(const char* key, int64_t k_token_stride, int64_t k_head_stride,
                    const char* value, int64_t v_token_stride, int64_t v_head_stride,
                    const int64_t* slots, int64_t num_tokens, char* k_cache, char* v_cache,
                    int64_t block_stride, int64_t head_stride, int64_t row_stride,
                    int64_t num_blocks, int num_kv_heads, int head_size, int block_size,
                    int element_size) {
  for (int64_t t = 0; t < num_tokens; ++t)
    if (slots[t] >= num_blocks * block_size) return -1;
  const size_t row_bytes = static_cast<size_t>(head_size) * element_size;
#pragma omp parallel for if (num_tokens >= 512)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t at = slot / block_size * block_stride + slot % block_size * row_stride;
    for (int h = 0; h < num_kv_heads; ++h) {
      const int64_t dst = (at + h * head_stride) * element_size;
      copy_row(k_cache + dst, key + (t * k_token_stride + h * k_head_stride) * element_size,
               row_bytes);
      copy_row(v_cache + dst, value + (t * v_token_stride + h * v_head_stride) * element_size,
               row_bytes);
    }
  }
#ifdef __AVX512F__
  _mm_sfence();  // the streamed rows are visible to whatever reads the cache next
#endif
  return 0;
}

}  // extern "C"
