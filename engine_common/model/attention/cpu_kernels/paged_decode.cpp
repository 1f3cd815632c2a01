// Paged decode attention for the CPU: each query token attends to its sequence's context,
// reading K and V where they lie in the paged cache, block by block through the block
// table. No gathered copy of the context is made.
//
// Owns only the arithmetic of one decode step's attention for one layer. The Python side
// (engine_common/model/attention/cpu_paged_kernel.py) builds this file, checks the tensors
// and passes raw pointers; the cache layout is the engine's (attention/backend.py):
//   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_size], contiguous.
//
// Work items are (sequence, KV head) pairs, shared among OpenMP threads (the library links
// the libgomp torch already loaded, so torch.set_num_threads bounds them too). For one item
// the query heads of the KV head (h = kv_head * group + g, Hugging Face's repeat_kv order)
// are scored against every context token (float32 accumulation), softmax runs in float32
// over the whole context, and the values are summed with those weights in float32.
// In bf16, scores and weights are rounded to bf16 where PyTorch's bf16 matmuls round them
// (each matmul's output), so the result is the torch backend's up to summation order.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif

namespace {

enum DType : int { kFloat32 = 0, kBFloat16 = 1 };

inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as torch rounds float32 to bf16.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

struct Args {
  int dtype;
  const void* query;
  int64_t q_token_stride, q_head_stride;  // in elements
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  int64_t block_table_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;  // the row of sequence i's query token; null: row i
  const int32_t* seqs;             // the sequences to attend; null: 0 .. num_items - 1
  void* out;
  int64_t out_token_stride, out_head_stride;
  int num_items, num_heads, num_kv_heads, head_size, block_size;
  float scale;
};

#ifdef TANDEM_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// exp for x <= 0 (Cephes' polynomial, as avx_mathfun): about 1 ulp.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}
#endif

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_f32(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = f32_to_bf16(v); }

// q . k over head_size elements (a multiple of 8 on the vector path).
template <typename T>
inline float dot(const float* q, const T* k, int head_size) {
#ifdef TANDEM_AVX2
  if (head_size % 16 == 0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int d = 0; d < head_size; d += 16) {
      a0 = _mm256_fmadd_ps(load8(q + d), load8(k + d), a0);
      a1 = _mm256_fmadd_ps(load8(q + d + 8), load8(k + d + 8), a1);
    }
    return hsum(_mm256_add_ps(a0, a1));
  }
#endif
  float sum = 0.0f;
  for (int d = 0; d < head_size; ++d) sum += q[d] * load1(k + d);
  return sum;
}

// Softmax of x[0 .. n) in place, in float32 (the scale is already applied).
inline void softmax(float* x, int n) {
  float max = x[0];
  for (int i = 1; i < n; ++i) max = std::max(max, x[i]);
  float sum = 0.0f;
  int i = 0;
#ifdef TANDEM_AVX2
  __m256 vmax = _mm256_set1_ps(max), vsum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax));
    _mm256_storeu_ps(x + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = hsum(vsum);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  const float inv = 1.0f / sum;
  for (int j = 0; j < n; ++j) x[j] *= inv;
}

// out[0 .. head_size) = sum over the context of p[t] * v[t], v read block by block.
template <typename T>
void weighted_values(const Args& a, const float* p, const int32_t* table, int ctx, int kv_head,
                     float* out) {
  const T* v_cache = static_cast<const T*>(a.v_cache);
  const int64_t token_stride = static_cast<int64_t>(a.num_kv_heads) * a.head_size;
  const int64_t block_stride = token_stride * a.block_size;
  const int hs = a.head_size;
  int d0 = 0;
#ifdef TANDEM_AVX2
  // 32 columns at a time: four accumulators stay in registers across the whole context.
  for (; d0 + 32 <= hs; d0 += 32) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int t0 = 0; t0 < ctx; t0 += a.block_size) {
      const T* block = v_cache + table[t0 / a.block_size] * block_stride +
                       static_cast<int64_t>(kv_head) * hs + d0;
      const int n = std::min(a.block_size, ctx - t0);
      for (int t = 0; t < n; ++t) {
        const T* v = block + t * token_stride;
        const __m256 w = _mm256_set1_ps(p[t0 + t]);
        acc0 = _mm256_fmadd_ps(w, load8(v), acc0);
        acc1 = _mm256_fmadd_ps(w, load8(v + 8), acc1);
        acc2 = _mm256_fmadd_ps(w, load8(v + 16), acc2);
        acc3 = _mm256_fmadd_ps(w, load8(v + 24), acc3);
      }
    }
    _mm256_storeu_ps(out + d0, acc0);
    _mm256_storeu_ps(out + d0 + 8, acc1);
    _mm256_storeu_ps(out + d0 + 16, acc2);
    _mm256_storeu_ps(out + d0 + 24, acc3);
  }
#endif
  for (int d = d0; d < hs; ++d) out[d] = 0.0f;
  if (d0 == hs) return;
  for (int t0 = 0; t0 < ctx; t0 += a.block_size) {
    const T* block = v_cache + table[t0 / a.block_size] * block_stride +
                     static_cast<int64_t>(kv_head) * hs;
    const int n = std::min(a.block_size, ctx - t0);
    for (int t = 0; t < n; ++t) {
      const T* v = block + t * token_stride;
      for (int d = d0; d < hs; ++d) out[d] += p[t0 + t] * load1(v + d);
    }
  }
}

// One (sequence, KV head): its query heads against the sequence's whole context.
template <typename T>
void attend(const Args& a, int seq, int kv_head, std::vector<float>& scratch) {
  const int group = a.num_heads / a.num_kv_heads;
  const int hs = a.head_size;
  const int ctx = a.seq_lens[seq];
  const int64_t row = a.query_start_loc ? a.query_start_loc[seq] : seq;
  const size_t needed = static_cast<size_t>(group) * (2 * hs + ctx);
  if (scratch.size() < needed) scratch.resize(needed);
  float* q = scratch.data();              // [group][hs], float32
  float* acc = q + group * hs;            // [hs] per head, then written out
  float* scores = acc + group * hs;       // [group][ctx]
  const T* query = static_cast<const T*>(a.query);
  for (int g = 0; g < group; ++g) {
    const T* src = query + row * a.q_token_stride + (kv_head * group + g) * a.q_head_stride;
    for (int d = 0; d < hs; ++d) q[g * hs + d] = load1(src + d);
  }
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const int64_t token_stride = static_cast<int64_t>(a.num_kv_heads) * hs;
  const int64_t block_stride = token_stride * a.block_size;
  const int32_t* table = a.block_tables + seq * a.block_table_stride;
  const bool bf16 = a.dtype == kBFloat16;
  for (int t0 = 0; t0 < ctx; t0 += a.block_size) {
    const T* block = k_cache + table[t0 / a.block_size] * block_stride +
                     static_cast<int64_t>(kv_head) * hs;
    const int n = std::min(a.block_size, ctx - t0);
    for (int t = 0; t < n; ++t) {
      for (int g = 0; g < group; ++g) {
        const float s = dot(q + g * hs, block + t * token_stride, hs);
        scores[g * ctx + t0 + t] = (bf16 ? round_bf16(s) : s) * a.scale;
      }
    }
  }
  T* out = static_cast<T*>(a.out);
  for (int g = 0; g < group; ++g) {
    float* p = scores + g * ctx;
    softmax(p, ctx);
    if (bf16) {
      for (int t = 0; t < ctx; ++t) p[t] = round_bf16(p[t]);
    }
    weighted_values<T>(a, p, table, ctx, kv_head, acc);
    T* dst = out + row * a.out_token_stride + (kv_head * group + g) * a.out_head_stride;
    for (int d = 0; d < hs; ++d) store1(dst + d, acc[d]);
  }
}

template <typename T>
void run(const Args& a, int num_items) {
  const int work = num_items * a.num_kv_heads;
#pragma omp parallel if (work > 1 && omp_get_max_threads() > 1)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 2)
    for (int w = 0; w < work; ++w) {
      const int item = w / a.num_kv_heads;
      const int seq = a.seqs ? a.seqs[item] : item;
      attend<T>(a, seq, w % a.num_kv_heads, scratch);
    }
  }
}

}  // namespace

extern "C" {

// Returns 0, or a negative code for arguments the kernel cannot take.
int tandem_paged_decode(int dtype, const void* query, int64_t q_token_stride,
                        int64_t q_head_stride, const void* k_cache, const void* v_cache,
                        const int32_t* block_tables, int64_t block_table_stride,
                        const int32_t* seq_lens, const int32_t* query_start_loc,
                        const int32_t* seqs, int num_items, void* out,
                        int64_t out_token_stride, int64_t out_head_stride, int num_heads,
                        int num_kv_heads, int head_size, int block_size, float scale) {
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_size < 1 || block_size < 1)
    return -1;
  if (dtype != kFloat32 && dtype != kBFloat16) return -2;
  const Args a{dtype,       query,          q_token_stride,  q_head_stride,
               k_cache,     v_cache,        block_tables,    block_table_stride,
               seq_lens,    query_start_loc, seqs,           out,
               out_token_stride, out_head_stride, num_items,  num_heads,
               num_kv_heads, head_size,     block_size,      scale};
  if (dtype == kFloat32) {
    run<float>(a, num_items);
  } else {
    run<uint16_t>(a, num_items);
  }
  return 0;
}

}  // extern "C"
