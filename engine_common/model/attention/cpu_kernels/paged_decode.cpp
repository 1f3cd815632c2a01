// Paged decode attention for the CPU: each query token attends to its sequence's context,
// reading K and V where they lie in the paged cache, block by block through the block
// table. No gathered copy of the context is made.
//
// Owns only the arithmetic of one decode step's attention for one layer. The Python side
// (engine_common/model/attention/cpu_paged_kernel.py) builds this file, checks the tensors
// and passes raw pointers; the cache layout is the engine's (attention/kv_cache_layout.py):
//   k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_size] of one layer, read
//   through their strides (a block's stride spans every layer; rows have unit stride).
//
// Work items are (sequence, KV head) pairs, shared among OpenMP threads (the library links
// the libgomp torch already loaded, so torch.set_num_threads bounds them too). For one item
// the query heads of the KV head (h = kv_head * group + g, Hugging Face's repeat_kv order)
// are scored against every context token (float32 accumulation), softmax runs in float32
// over the whole context, and the values are summed with those weights in float32.
// A KV head's rows of a block are contiguous (the head-major cache) and stream through once
// for all of its query heads (up to four at a time): each K or V chunk is loaded and widened
// from bf16 once, then feeds one FMA chain per query head and token (or column chunk).
// Each score and output element sums in the previous kernel's order, except that tokens
// past a block's last multiple of 4 (not 8) take the vector path: equal up to rounding.
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
  int64_t block_stride, head_stride, token_stride;  // of k_cache and v_cache, in elements
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

#ifdef TANDEM_AVX2
// Lane i of the result: the sum of the lanes of a_i.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                    __m256 a6, __m256 a7) {
  const __m256 s01 = _mm256_hadd_ps(a0, a1), s23 = _mm256_hadd_ps(a2, a3);
  const __m256 s45 = _mm256_hadd_ps(a4, a5), s67 = _mm256_hadd_ps(a6, a7);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif

// q . k over head_size elements.
template <typename T>
inline float dot(const float* q, const T* k, int head_size) {
  float sum = 0.0f;
  for (int d = 0; d < head_size; ++d) sum += q[d] * load1(k + d);
  return sum;
}

// One sequence's blocks in the cache: block j of its context starts at
// cache + table[j] * block_stride; the row of token t of KV head h starts
// h * head_stride + t * token_stride elements into it.
struct Blocks {
  const int32_t* table;
  int64_t token_stride, block_stride, head_stride;
  template <typename T>
  const T* start(const T* cache, int t0, int block_size) const {
    return cache + table[t0 / block_size] * block_stride;
  }
};

// Fetch the next block's rows of heads [h0, h1) while this block computes: a sequence's
// blocks lie anywhere in the cache, where the hardware prefetchers do not look.
template <typename T>
inline void prefetch_block(const T* block, int n, const Blocks& blocks, int h0, int h1,
                           int head_size) {
  const int64_t span = static_cast<int64_t>(head_size) * sizeof(T);
  for (int h = h0; h < h1; ++h) {
    const char* first = reinterpret_cast<const char*>(block + h * blocks.head_stride);
    for (int t = 0; t < n; ++t) {
      const char* row = first + t * blocks.token_stride * static_cast<int64_t>(sizeof(T));
      for (int64_t b = 0; b < span; b += 64) __builtin_prefetch(row + b);
    }
  }
}

#ifdef TANDEM_AVX2
// Lanes 0-3 of the result: the sums of the lanes of a0 .. a3 (in hsum8's order).
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Scores of TOKENS consecutive K rows (``rows``, ``ts`` apart: one KV head's rows of a
// block, contiguous in the head-major cache) against G query heads (``q``, hs apart).
// Each K chunk is loaded (and widened from bf16) once for all G heads: G * TOKENS
// independent FMA chains. out[g * ctx + j] = q_g . k_j, before scaling.
template <typename T, int G, int TOKENS>
inline void score_tile(const T* rows, int64_t ts, int hs, const float* q, float* sums) {
  __m256 acc[G][TOKENS];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < TOKENS; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int d = 0; d < hs; d += 8) {
    __m256 k[TOKENS];
    for (int j = 0; j < TOKENS; ++j) k[j] = load8(rows + j * ts + d);
    for (int g = 0; g < G; ++g) {
      const __m256 qv = _mm256_loadu_ps(q + g * hs + d);
      for (int j = 0; j < TOKENS; ++j) acc[g][j] = _mm256_fmadd_ps(qv, k[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    if constexpr (TOKENS == 8) {
      _mm256_storeu_ps(sums + g * 8, hsum8(acc[g][0], acc[g][1], acc[g][2], acc[g][3],
                                           acc[g][4], acc[g][5], acc[g][6], acc[g][7]));
    } else {
      _mm_storeu_ps(sums + g * 4, hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
    }
  }
}

// One KV head's n rows of a block against G of its query heads: scores[g * ctx + t].
template <typename T, int G>
inline int score_rows(const Args& a, const T* rows, int64_t ts, int n, const float* q,
                      float* scores, int64_t ctx) {
  // Few heads: eight tokens at a time, else four (G * TOKENS accumulators in 16 registers).
  constexpr int TOKENS = G <= 1 ? 8 : 4;
  const int hs = a.head_size;
  const bool bf16 = a.dtype == kBFloat16;
  int t = 0;
  if (hs % 8 != 0) return 0;
  alignas(32) float sums[G * TOKENS];
  for (; t + TOKENS <= n; t += TOKENS) {
    score_tile<T, G, TOKENS>(rows + t * ts, ts, hs, q, sums);
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < TOKENS; ++j) {
        const float s = sums[g * TOKENS + j];
        scores[g * ctx + t + j] = (bf16 ? round_bf16(s) : s) * a.scale;
      }
  }
  return t;
}
#endif

// The heads [h0, h1) of one sequence, block after block (each block read once, while it is
// in L1): scores[i][t] = (q_i . k_t) * scale for each query head i of those KV heads.
// A KV head's rows of a block are contiguous (head-major cache): they stream through
// once for all of its query heads, up to four at a time.
template <typename T>
void scores_for_heads(const Args& a, const Blocks& blocks, int ctx, int h0, int h1,
                      const float* q, float* scores) {
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const int group = a.num_heads / a.num_kv_heads, hs = a.head_size, bs = a.block_size;
  const int64_t ts = blocks.token_stride;
  const bool bf16 = a.dtype == kBFloat16;
  for (int t0 = 0; t0 < ctx; t0 += bs) {
    const T* block = blocks.start(k_cache, t0, bs);
    const int n = std::min(bs, ctx - t0);
    if (t0 + bs < ctx)
      prefetch_block(blocks.start(k_cache, t0 + bs, bs), std::min(bs, ctx - t0 - bs), blocks,
                     h0, h1, hs);
    for (int h = h0; h < h1; ++h) {
      const T* rows = block + h * blocks.head_stride;
      for (int g0 = 0; g0 < group; g0 += 4) {
        const int i0 = (h - h0) * group + g0;
        const float* qi = q + static_cast<int64_t>(i0) * hs;
        float* out = scores + static_cast<int64_t>(i0) * ctx + t0;
        int t = 0;
#ifdef TANDEM_AVX2
        switch (std::min(4, group - g0)) {
          case 1: t = score_rows<T, 1>(a, rows, ts, n, qi, out, ctx); break;
          case 2: t = score_rows<T, 2>(a, rows, ts, n, qi, out, ctx); break;
          case 3: t = score_rows<T, 3>(a, rows, ts, n, qi, out, ctx); break;
          default: t = score_rows<T, 4>(a, rows, ts, n, qi, out, ctx); break;
        }
#endif
        for (int g = g0; g < std::min(group, g0 + 4); ++g) {
          const int i = (h - h0) * group + g;
          for (int tt = t; tt < n; ++tt) {
            const float s = dot(q + i * hs, rows + tt * ts, hs);
            scores[static_cast<int64_t>(i) * ctx + t0 + tt] =
                (bf16 ? round_bf16(s) : s) * a.scale;
          }
        }
      }
    }
  }
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

#ifdef TANDEM_AVX2
// acc[g][d0 .. d0 + 8 * CHUNKS) += sum over t of w[g][t] * v_t, for G query heads of one KV
// head: each V row chunk is loaded (and widened) once for all G heads.
template <typename T, int G, int CHUNKS>
inline void accumulate_tile(const T* rows, int n, int64_t ts, int d0, const float* w,
                            int64_t w_stride, float* acc, int hs) {
  __m256 c[G][CHUNKS];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < CHUNKS; ++k) c[g][k] = _mm256_loadu_ps(acc + g * hs + d0 + 8 * k);
  const T* v = rows + d0;
  for (int t = 0; t < n; ++t, v += ts) {
    __m256 x[CHUNKS];
    for (int k = 0; k < CHUNKS; ++k) x[k] = load8(v + 8 * k);
    for (int g = 0; g < G; ++g) {
      const __m256 wt = _mm256_set1_ps(w[g * w_stride + t]);
      for (int k = 0; k < CHUNKS; ++k) c[g][k] = _mm256_fmadd_ps(wt, x[k], c[g][k]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < CHUNKS; ++k) _mm256_storeu_ps(acc + g * hs + d0 + 8 * k, c[g][k]);
}

// Columns [0, done) of G heads' outputs from one KV head's n rows; returns done.
template <typename T, int G>
inline int accumulate_rows(const T* rows, int n, int64_t ts, const float* w, int64_t w_stride,
                           float* acc, int hs) {
  // About eight accumulators: 64 columns for one head, 16 for three or four.
  constexpr int CHUNKS = G == 1 ? 8 : (G == 2 ? 4 : 2);
  int d0 = 0;
  for (; d0 + 8 * CHUNKS <= hs; d0 += 8 * CHUNKS)
    accumulate_tile<T, G, CHUNKS>(rows, n, ts, d0, w, w_stride, acc, hs);
  for (; d0 + 8 <= hs; d0 += 8) accumulate_tile<T, G, 1>(rows, n, ts, d0, w, w_stride, acc, hs);
  return d0;
}
#endif

// acc[i][0 .. head_size) += sum over the block's n tokens of p[i][t] * v_t, for the query
// heads i of KV heads [h0, h1); weights p[i] start at the block's first token.
template <typename T>
void accumulate_block(const Args& a, const T* block, int n, int64_t ts, int64_t head_stride,
                      int h0, int h1, const float* p, int64_t p_stride, float* acc) {
  const int group = a.num_heads / a.num_kv_heads, hs = a.head_size;
  for (int h = h0; h < h1; ++h) {
    const T* rows = block + h * head_stride;
    for (int g0 = 0; g0 < group; g0 += 4) {
      const int i0 = (h - h0) * group + g0;
      const float* w = p + i0 * p_stride;
      float* out = acc + static_cast<int64_t>(i0) * hs;
      int d0 = 0;
#ifdef TANDEM_AVX2
      switch (std::min(4, group - g0)) {
        case 1: d0 = accumulate_rows<T, 1>(rows, n, ts, w, p_stride, out, hs); break;
        case 2: d0 = accumulate_rows<T, 2>(rows, n, ts, w, p_stride, out, hs); break;
        case 3: d0 = accumulate_rows<T, 3>(rows, n, ts, w, p_stride, out, hs); break;
        default: d0 = accumulate_rows<T, 4>(rows, n, ts, w, p_stride, out, hs); break;
      }
#endif
      for (int g = 0; g < std::min(4, group - g0); ++g)
        for (int t = 0; t < n; ++t)
          for (int d = d0; d < hs; ++d)
            out[g * hs + d] += w[g * p_stride + t] * load1(rows + t * ts + d);
    }
  }
}

// The KV heads [h0, h1) of one sequence: their query heads against its whole context.
template <typename T>
void attend(const Args& a, int seq, int h0, int h1, std::vector<float>& scratch) {
  const int group = a.num_heads / a.num_kv_heads, hs = a.head_size, bs = a.block_size;
  const int heads = (h1 - h0) * group;
  const int ctx = a.seq_lens[seq];
  const int64_t row = a.query_start_loc ? a.query_start_loc[seq] : seq;
  const size_t needed = static_cast<size_t>(heads) * (2 * hs + ctx);
  if (scratch.size() < needed) scratch.resize(needed);
  float* q = scratch.data();      // [heads][hs], float32
  float* acc = q + heads * hs;    // [heads][hs]: the outputs before they are stored
  float* scores = acc + heads * hs;  // [heads][ctx]
  const T* query = static_cast<const T*>(a.query);
  for (int i = 0; i < heads; ++i) {
    const T* src = query + row * a.q_token_stride + (h0 * group + i) * a.q_head_stride;
    for (int d = 0; d < hs; ++d) q[i * hs + d] = load1(src + d);
  }
  const int64_t ts = a.token_stride;
  const Blocks blocks{a.block_tables + seq * a.block_table_stride, ts, a.block_stride,
                      a.head_stride};
  scores_for_heads<T>(a, blocks, ctx, h0, h1, q, scores);
  for (int i = 0; i < heads; ++i) {
    float* p = scores + static_cast<int64_t>(i) * ctx;
    softmax(p, ctx);
    if (a.dtype == kBFloat16) {
      for (int t = 0; t < ctx; ++t) p[t] = round_bf16(p[t]);
    }
  }
  std::fill(acc, acc + heads * hs, 0.0f);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  for (int t0 = 0; t0 < ctx; t0 += bs) {
    if (t0 + bs < ctx)
      prefetch_block(blocks.start(v_cache, t0 + bs, bs), std::min(bs, ctx - t0 - bs), blocks,
                     h0, h1, hs);
    accumulate_block(a, blocks.start(v_cache, t0, bs), std::min(bs, ctx - t0), ts,
                     blocks.head_stride, h0, h1, scores + t0, ctx, acc);
  }
  T* out = static_cast<T*>(a.out);
  for (int i = 0; i < heads; ++i) {
    T* dst = out + row * a.out_token_stride + (h0 * group + i) * a.out_head_stride;
    for (int d = 0; d < hs; ++d) store1(dst + d, acc[i * hs + d]);
  }
}

// Work items: whole sequences when there are enough to share among the threads (each
// block then streams through once), else (sequence, KV head) pairs.
template <typename T>
void run(const Args& a, int num_items) {
  const int threads = omp_get_max_threads();
  const int split = num_items >= 4 * threads ? 1 : a.num_kv_heads;
  const int work = num_items * split;
#pragma omp parallel if (work > 1 && threads > 1)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int w = 0; w < work; ++w) {
      const int item = w / split;
      const int seq = a.seqs ? a.seqs[item] : item;
      const int h0 = split == 1 ? 0 : w % split;
      attend<T>(a, seq, h0, split == 1 ? a.num_kv_heads : h0 + 1, scratch);
    }
  }
}

}  // namespace

extern "C" {

// Returns 0, or a negative code for arguments the kernel cannot take.
int tandem_paged_decode(int dtype, const void* query, int64_t q_token_stride,
                        int64_t q_head_stride, const void* k_cache, const void* v_cache,
                        int64_t block_stride, int64_t head_stride, int64_t token_stride,
                        const int32_t* block_tables, int64_t block_table_stride,
                        const int32_t* seq_lens, const int32_t* query_start_loc,
                        const int32_t* seqs, int num_items, void* out,
                        int64_t out_token_stride, int64_t out_head_stride, int num_heads,
                        int num_kv_heads, int head_size, int block_size, float scale) {
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_size < 1 || block_size < 1)
    return -1;
  if (dtype != kFloat32 && dtype != kBFloat16) return -2;
  const Args a{dtype,       query,          q_token_stride,  q_head_stride,
               k_cache,     v_cache,        block_stride,    head_stride,
               token_stride, block_tables,  block_table_stride,
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
