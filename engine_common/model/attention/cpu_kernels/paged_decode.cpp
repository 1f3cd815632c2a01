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
// Work: a sequence's context is cut into chunks of kChunkTokens (whole blocks; fixed by the
// context length alone, so the result never depends on the thread count). Tasks are
// (sequence, chunk) pairs, or (sequence, chunk, KV head) when there are too few to keep the
// OpenMP threads busy (a split by head changes no arithmetic), dealt round-robin to the
// threads so that each knows its next task and fetches its first blocks early. The library
// links the libgomp torch already loaded, so torch.set_num_threads bounds the threads too.
// A task scores the query heads of its KV heads (h = kv_head * group + g, Hugging Face's
// repeat_kv order) against its chunk with float32 accumulation, and sums the values with
// the softmax weights in float32. A sequence of one chunk (up to 256 tokens) is then done;
// the chunks of a longer one are merged as flash-decoding does (each chunk's output
// weighted by exp(its max - the overall max) * its sum of exponentials, over their total).
// Accumulation is float32 throughout. In bf16 the scores stay float32 and only the softmax
// weights (before they multiply V, as torch's CPU flash-attention kernel rounds its
// exponentials) and the outputs are rounded to bf16.
//
// Three instruction sets, chosen at build time (-march=native):
// - AVX512 (F/BW/VL/DQ): one pass over each block, K rows then V rows of a KV head, with an
//   online softmax (running max and sum per query head; the float32 accumulators rescaled
//   when the max grows), so that K and V stream from memory once, in address order, while
//   the rows two blocks ahead (the next task's first, near the end) are prefetched into L2,
//   one row per row read: decode attention is memory-bound once the arithmetic is vector
//   wide, and evenly spread prefetches kept more lines in flight than a burst per block.
//   Scores: 16 keys at a time; each key's q . k accumulates in vector lanes (an FMA per 16
//   float32 elements, or with AVX512_BF16 one vdpbf16ps per 32 bf16 pairs) for up to three
//   query heads per K chunk load, and the 16 keys' lane sums are reduced together by a
//   transposing tree of unpack/shuffle adds (45 operations per head and 16 keys, no
//   horizontal sum per key). Values: with AVX512_BF16, two V rows interleaved (vpunpck
//   {l,h}wd) meet the pair of their bf16 weights in one vdpbf16ps per 16 columns and head;
//   without it, a bf16 row splits into its even and odd elements (a shift and a mask); the
//   accumulators keep that column order until the task's end.
// - AVX2/FMA: a scoring pass (eight or four tokens at a time, one FMA chain per head and
//   token, hadd trees), the chunk's softmax, then a value pass (FMAs over rows).
// - Scalar loops for any other CPU, and for head sizes the AVX2 path does not tile.
// The bf16 weights' rounding differs between the two: of exp(s - running max) in the
// online pass, of the normalized weight in the two-pass one: the same relative error, at
// most 2^-8 of each weight.

#include <omp.h>

#include "bf16.h"
#include "simd_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#include <immintrin.h>
#define TANDEM_AVX512 1
#if defined(__AVX512BF16__)
#define TANDEM_AVX512_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif

namespace {

enum DType : int { kFloat32 = 0, kBFloat16 = 1 };

// Tokens per task, at most (rounded up to whole blocks): a sequence this long or shorter
// is one task; a longer one is split so that batch 1 keeps every thread busy.
constexpr int kChunkTokens = 256;

// How many blocks ahead of the one being read the AVX512 pass prefetches.
constexpr int kPrefetchBlocks = 2;
using tandem::bf16_to_f32;
using tandem::f32_to_bf16;

inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_f32(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = f32_to_bf16(v); }

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

// One task: KV heads [h0, h1) of one sequence against its tokens [t_begin, t_end) (whole
// blocks but the last). Its query heads are i = 0 .. (h1 - h0) * group, head h0 * group + i.
struct Task {
  int seq, t_begin, t_end, h0, h1;
  int64_t row;  // the query's (and output's) row
};

// Fetch n rows of heads [h0, h1) of a block ahead of their use: a sequence's blocks lie
// anywhere in the cache, where the hardware prefetchers do not look. LOCALITY 3 fetches
// into L1 (the next block), 2 into L2 (what the next pass reads).
template <int LOCALITY, typename T>
inline void prefetch_block(const T* block, int n, const Blocks& blocks, int h0, int h1,
                           int head_size) {
  const int64_t span = static_cast<int64_t>(head_size) * sizeof(T);
  const int64_t row_bytes = blocks.token_stride * static_cast<int64_t>(sizeof(T));
  for (int h = h0; h < h1; ++h) {
    const char* first = reinterpret_cast<const char*>(block + h * blocks.head_stride);
    if (row_bytes == span) {  // the head's rows are one stretch (the engine's layout)
      for (int64_t b = 0; b < n * span; b += 64) __builtin_prefetch(first + b, 0, LOCALITY);
      continue;
    }
    for (int t = 0; t < n; ++t) {
      const char* row = first + t * row_bytes;
      for (int64_t b = 0; b < span; b += 64) __builtin_prefetch(row + b, 0, LOCALITY);
    }
  }
}

// ------------------------------------------------------------------------------------------
// AVX512
// ------------------------------------------------------------------------------------------
#ifdef TANDEM_AVX512

inline __mmask16 mask16(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}
inline __mmask32 mask32(int n) {
  return n >= 32 ? static_cast<__mmask32>(0xffffffffu) : static_cast<__mmask32>((1u << n) - 1);
}

// Each lane rounded to bf16 (nearest even, as f32_to_bf16 for finite values), as float32.
inline __m512 round_bf16_16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(0xffff0000u)));
}

using tandem::exp16;

// The lane sums of four vectors: lane 4 * L + j of the result holds a partial sum of a_j
// (over lanes 4 * L .. 4 * L + 3 of it), for each 128-bit lane L.
inline __m512 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d x = _mm512_castps_pd(s01), y = _mm512_castps_pd(s23);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// Four reduce4 results (keys 0-3, 4-7, 8-11, 12-15) -> lane j: the whole sum of key j.
inline __m512 reduce16(__m512 q0, __m512 q1, __m512 q2, __m512 q3) {
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  // [keys 0-3, keys 0-3, keys 4-7, keys 4-7], each half of the partial sums.
  const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(q0, q1, kEven),
                                 _mm512_shuffle_f32x4(q0, q1, kOdd));
  const __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(q2, q3, kEven),
                                 _mm512_shuffle_f32x4(q2, q3, kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u, v, kEven), _mm512_shuffle_f32x4(u, v, kOdd));
}

// Columns 2 * i (even) and 2 * i + 1 (odd) of 32 -> natural order, 16 a vector.
inline void store_even_odd(float* dst, __m512 even, __m512 odd) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i hi =
      _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  _mm512_storeu_ps(dst, _mm512_permutex2var_ps(even, lo, odd));
  _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(even, hi, odd));
}

// How one kind of row meets the query and the weights. Rows are cut into chunks of kChunk
// elements (the last one masked: zeros past the row); a prepared query head is kQFloats
// floats a chunk (zero-padded), and dot() adds the chunk's products into the lanes of acc.
// value_block() adds n rows times their weights into a head's accumulators, which hold
// 64-column tiles in the kind's own column order until natural() restores it.
struct F32Rows {
  using T = float;
  using Vec = __m512;
  static constexpr int kChunk = 16, kQFloats = 16;
  static constexpr bool kBf16Weights = false;
  static Vec load(const float* p, int valid) { return _mm512_maskz_loadu_ps(mask16(valid), p); }
  static __m512 dot(__m512 acc, const float* q, Vec k) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(q), k, acc);
  }
  static void prepare(const float* src, int hs, float* dst, int chunks) {
    std::fill(dst, dst + chunks * kQFloats, 0.0f);
    std::copy(src, src + hs, dst);
  }
  // NC chunks of 16 columns from chunk c0, the last valid up to ``tail``.
  template <int G, int NC>
  static void value_block(const float* rows, int64_t ts, int n, int c0, int tail,
                          const float* w, int64_t w_stride, float* acc, int64_t acc_stride) {
    __m512 c[G][NC];
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < NC; ++k) c[g][k] = _mm512_loadu_ps(acc + g * acc_stride + (c0 + k) * 16);
    const float* v = rows + c0 * 16;
    for (int j = 0; j < n; ++j, v += ts) {
      __m512 x[NC];
      for (int k = 0; k < NC; ++k) x[k] = load(v + 16 * k, k + 1 < NC ? 16 : tail);
      for (int g = 0; g < G; ++g) {
        const __m512 wg = _mm512_set1_ps(w[g * w_stride + j]);
        for (int k = 0; k < NC; ++k) c[g][k] = _mm512_fmadd_ps(wg, x[k], c[g][k]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < NC; ++k) _mm512_storeu_ps(acc + g * acc_stride + (c0 + k) * 16, c[g][k]);
  }
  static void natural(const float* acc, int hs, float* out) { std::copy(acc, acc + hs, out); }
};

// bf16 rows without AVX512_BF16: the even elements of a 32-element chunk are its dwords
// shifted left by 16, the odd ones its dwords with the low half masked off (no widening
// shuffle); the prepared query holds each chunk's 16 even elements, then its 16 odd ones,
// and the accumulators each chunk's 16 even columns, then its 16 odd ones.
struct Bf16SplitRows {
  using T = uint16_t;
  using Vec = __m512i;
  static constexpr int kChunk = 32, kQFloats = 32;
  static constexpr bool kBf16Weights = false;
  static Vec load(const uint16_t* p, int valid) {
    return _mm512_maskz_loadu_epi16(mask32(valid), p);
  }
  static __m512 even(Vec k) { return _mm512_castsi512_ps(_mm512_slli_epi32(k, 16)); }
  static __m512 odd(Vec k) {
    return _mm512_castsi512_ps(_mm512_and_si512(k, _mm512_set1_epi32(0xffff0000u)));
  }
  static __m512 dot(__m512 acc, const float* q, Vec k) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q), even(k), acc);
    return _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), odd(k), acc);
  }
  static void prepare(const uint16_t* src, int hs, float* dst, int chunks) {
    std::fill(dst, dst + chunks * kQFloats, 0.0f);
    for (int d = 0; d < hs; ++d) dst[d / 32 * 32 + d % 2 * 16 + d % 32 / 2] = load1(src + d);
  }
  template <int G, int NC>
  static void value_block(const uint16_t* rows, int64_t ts, int n, int c0, int tail,
                          const float* w, int64_t w_stride, float* acc, int64_t acc_stride) {
    __m512 ce[G][NC], co[G][NC];
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < NC; ++k) {
        ce[g][k] = _mm512_loadu_ps(acc + g * acc_stride + (c0 + k) * 32);
        co[g][k] = _mm512_loadu_ps(acc + g * acc_stride + (c0 + k) * 32 + 16);
      }
    const uint16_t* v = rows + c0 * 32;
    for (int j = 0; j < n; ++j, v += ts) {
      __m512 xe[NC], xo[NC];
      for (int k = 0; k < NC; ++k) {
        const __m512i x = load(v + 32 * k, k + 1 < NC ? 32 : tail);
        xe[k] = even(x);
        xo[k] = odd(x);
      }
      for (int g = 0; g < G; ++g) {
        const __m512 wg = _mm512_set1_ps(w[g * w_stride + j]);
        for (int k = 0; k < NC; ++k) {
          ce[g][k] = _mm512_fmadd_ps(wg, xe[k], ce[g][k]);
          co[g][k] = _mm512_fmadd_ps(wg, xo[k], co[g][k]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < NC; ++k) {
        _mm512_storeu_ps(acc + g * acc_stride + (c0 + k) * 32, ce[g][k]);
        _mm512_storeu_ps(acc + g * acc_stride + (c0 + k) * 32 + 16, co[g][k]);
      }
  }
  static void natural(const float* acc, int hs, float* out) {
    alignas(64) float tmp[32];
    for (int c = 0; c < hs; c += 32) {
      store_even_odd(tmp, _mm512_loadu_ps(acc + c), _mm512_loadu_ps(acc + c + 16));
      std::copy(tmp, tmp + std::min(32, hs - c), out + c);
    }
  }
};

#ifdef TANDEM_AVX512_BF16
// bf16 rows with AVX512_BF16: vdpbf16ps multiplies 32 bf16 pairs (exact products) and adds
// each pair's two into a float32 lane. Scores: the prepared query is the bf16 row,
// zero-padded. Values: rows j and j + 1 interleaved (unpacklo/hi of 16-bit elements:
// columns 8 * L + 0..3 of each 128-bit lane L, then 8 * L + 4..7) meet the pair (w_j,
// w_j+1) of bf16 weights; an odd last row pairs with zeros. The accumulators keep each
// 32-column chunk as its unpacklo columns, then its unpackhi ones.
struct Bf16DpRows {
  using T = uint16_t;
  using Vec = __m512i;
  static constexpr int kChunk = 32, kQFloats = 16;  // 32 bf16 in 16 floats' bytes
  static constexpr bool kBf16Weights = true;
  static Vec load(const uint16_t* p, int valid) {
    return _mm512_maskz_loadu_epi16(mask32(valid), p);
  }
  static __m512 dot(__m512 acc, const float* q, Vec k) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q), (__m512bh)k);
  }
  static void prepare(const uint16_t* src, int hs, float* dst, int chunks) {
    std::fill(dst, dst + chunks * kQFloats, 0.0f);
    std::memcpy(dst, src, hs * sizeof(uint16_t));
  }
  // ``w`` holds the bf16 weights, a zero after the last.
  template <int G, int NC>
  static void value_block(const uint16_t* rows, int64_t ts, int n, int c0, int tail,
                          const uint16_t* w, int64_t w_stride, float* acc, int64_t acc_stride) {
    __m512 cl[G][NC], ch[G][NC];
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < NC; ++k) {
        cl[g][k] = _mm512_loadu_ps(acc + g * acc_stride + (c0 + k) * 32);
        ch[g][k] = _mm512_loadu_ps(acc + g * acc_stride + (c0 + k) * 32 + 16);
      }
    const uint16_t* v = rows + c0 * 32;
    for (int j = 0; j < n; j += 2, v += 2 * ts) {
      __m512i lo[NC], hi[NC];
      for (int k = 0; k < NC; ++k) {
        const int valid = k + 1 < NC ? 32 : tail;
        const __m512i a = load(v + 32 * k, valid);
        const __m512i b = j + 1 < n ? load(v + ts + 32 * k, valid) : _mm512_setzero_si512();
        lo[k] = _mm512_unpacklo_epi16(a, b);
        hi[k] = _mm512_unpackhi_epi16(a, b);
      }
      for (int g = 0; g < G; ++g) {
        uint32_t pair;
        std::memcpy(&pair, w + g * w_stride + j, sizeof pair);
        const __m512bh wp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int k = 0; k < NC; ++k) {
          cl[g][k] = _mm512_dpbf16_ps(cl[g][k], (__m512bh)lo[k], wp);
          ch[g][k] = _mm512_dpbf16_ps(ch[g][k], (__m512bh)hi[k], wp);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < NC; ++k) {
        _mm512_storeu_ps(acc + g * acc_stride + (c0 + k) * 32, cl[g][k]);
        _mm512_storeu_ps(acc + g * acc_stride + (c0 + k) * 32 + 16, ch[g][k]);
      }
  }
  static void natural(const float* acc, int hs, float* out) {
    const __m512i first =
        _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second =
        _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    alignas(64) float tmp[32];
    for (int c = 0; c < hs; c += 32) {
      const __m512 lo = _mm512_loadu_ps(acc + c), hi = _mm512_loadu_ps(acc + c + 16);
      _mm512_storeu_ps(tmp, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(tmp + 16, _mm512_permutex2var_ps(lo, second, hi));
      std::copy(tmp, tmp + std::min(32, hs - c), out + c);
    }
  }
};
using Bf16Rows = Bf16DpRows;
#else
using Bf16Rows = Bf16SplitRows;
#endif

// The rows' kind of each dtype on this CPU.
template <typename T>
using RowsFor = std::conditional_t<std::is_same_v<T, float>, F32Rows, Bf16Rows>;

// The rows to prefetch while a KV head's rows of a block are scored: the same head's K
// and V rows of the block kPrefetchBlocks ahead (null: none), into L2, one of each per key.
template <typename T>
struct RowPrefetch {
  const T* k;
  const T* v;
  int n;  // rows there
  int64_t row_bytes;
  void row(int64_t ts, int j) const {
    if (k == nullptr || j >= n) return;
    const char* pk = reinterpret_cast<const char*>(k + j * ts);
    const char* pv = reinterpret_cast<const char*>(v + j * ts);
    for (int64_t b = 0; b < row_bytes; b += 64) {
      __builtin_prefetch(pk + b, 0, 2);
      __builtin_prefetch(pv + b, 0, 2);
    }
  }
};

// Scores of n <= 16 consecutive K rows (``ts`` apart) against G query heads (prepared,
// ``q_stride`` floats apart): lane j of out[g] is q_g . k_j (lanes past n: garbage). Each
// K chunk is loaded once for all G heads; each quad of keys is reduced as it completes
// (rows past n repeat the last one, so that no branch is taken per key).
template <class R, int G>
inline void score_tile(const typename R::T* rows, int64_t ts, int n, const float* q,
                       int q_stride, int chunks, int tail, const RowPrefetch<typename R::T>& pf,
                       int t, __m512* out) {
  __m512 quad[G][4];
  for (int qd = 0; qd < 4; ++qd) {
    if (4 * qd >= n) {
      for (int g = 0; g < G; ++g) quad[g][qd] = _mm512_setzero_ps();
      continue;
    }
    const typename R::T* row[4];
    for (int j = 0; j < 4; ++j) {
      row[j] = rows + std::min(4 * qd + j, n - 1) * ts;
      pf.row(ts, t + 4 * qd + j);
    }
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; ++c) {
      const int valid = c + 1 < chunks ? R::kChunk : tail;
      for (int j = 0; j < 4; ++j) {
        const typename R::Vec k = R::load(row[j] + c * R::kChunk, valid);
        for (int g = 0; g < G; ++g)
          acc[g][j] = R::dot(acc[g][j], q + g * q_stride + c * R::kQFloats, k);
      }
    }
    for (int g = 0; g < G; ++g) quad[g][qd] = reduce4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
  }
  for (int g = 0; g < G; ++g) out[g] = reduce16(quad[g][0], quad[g][1], quad[g][2], quad[g][3]);
}

// One KV head's n rows of a block against G of its query heads:
// scores[g * s_stride + t] = q_g . k_t * scale, for t up to n rounded up to 16 (garbage
// past n).
template <class R, int G>
inline void score_rows(const typename R::T* rows, int64_t ts, int n, const float* q,
                       int q_stride, int hs, float scale, float* scores,
                       int64_t s_stride, const RowPrefetch<typename R::T>& pf) {
  const int chunks = (hs + R::kChunk - 1) / R::kChunk;
  const int tail = hs - (chunks - 1) * R::kChunk;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int t = 0; t < n; t += 16) {
    __m512 s[G];
    score_tile<R, G>(rows + t * ts, ts, std::min(16, n - t), q, q_stride, chunks, tail, pf, t,
                     s);
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * s_stride + t, _mm512_mul_ps(s[g], vscale));
  }
}

// One query head's online softmax over the n scores of a block (``s``, scaled): the
// running max and sum (max, sum) and the accumulators (``acc``, ``acc_len`` floats)
// rescaled if the max grows; the block's weights exp(s - max) replace the scores (bf16:
// rounded, and written as bf16 to ``w16`` when not null), zero up to n rounded up to 16.
inline void online_softmax(float* s, int n, bool bf16, uint16_t* w16, float* max, float* sum,
                           float* acc, int acc_len) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int i = 0; i < n; i += 16) vmax = _mm512_mask_loadu_ps(vmax, mask16(n - i), s + i);
  const float block_max = _mm512_reduce_max_ps(vmax);
  if (block_max > *max) {
    const float shrink = std::exp(*max - block_max);  // 0 for the first block
    *sum *= shrink;
    const __m512 f = _mm512_set1_ps(shrink);
    for (int d = 0; d < acc_len; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_mul_ps(f, _mm512_loadu_ps(acc + d)));
    *max = block_max;
  }
  const __m512 m = _mm512_set1_ps(*max);
  __m512 total = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) {
    const __mmask16 valid = mask16(n - i);
    __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), m)));
    total = _mm512_add_ps(total, e);
    if (bf16) e = round_bf16_16(e);
    _mm512_storeu_ps(s + i, e);
    if (w16 != nullptr)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w16 + i),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(e), 16)));
  }
  *sum += _mm512_reduce_add_ps(total);
}

// G query heads' accumulators += their weights times one KV head's n rows of a block, in
// tiles of 64 columns (up to 4 heads x 4 accumulators, x 2 for bf16's halves).
template <class R, int G>
inline void value_rows(const typename R::T* rows, int64_t ts, int n, int hs, const float* w,
                       const uint16_t* w16, int64_t w_stride, float* acc, int64_t acc_stride) {
  constexpr int kTile = 64 / R::kChunk;
  const int chunks = (hs + R::kChunk - 1) / R::kChunk, tail = hs - (chunks - 1) * R::kChunk;
  for (int c0 = 0; c0 < chunks; c0 += kTile) {
    const int nc = std::min(kTile, chunks - c0), last = c0 + nc == chunks ? tail : R::kChunk;
    auto run = [&](auto nc_const) {
      constexpr int NC = decltype(nc_const)::value;
      if constexpr (R::kBf16Weights) {
        R::template value_block<G, NC>(rows, ts, n, c0, last, w16, w_stride, acc, acc_stride);
      } else {
        R::template value_block<G, NC>(rows, ts, n, c0, last, w, w_stride, acc, acc_stride);
      }
    };
    switch (nc) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: if constexpr (kTile >= 3) run(std::integral_constant<int, 3>{}); break;
      default: if constexpr (kTile >= 4) run(std::integral_constant<int, 4>{}); break;
    }
  }
}

#endif  // TANDEM_AVX512

// ------------------------------------------------------------------------------------------
// AVX2
// ------------------------------------------------------------------------------------------
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

using tandem::exp8;

// Lane i of the result: the sum of the lanes of a_i.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                    __m256 a6, __m256 a7) {
  const __m256 s01 = _mm256_hadd_ps(a0, a1), s23 = _mm256_hadd_ps(a2, a3);
  const __m256 s45 = _mm256_hadd_ps(a4, a5), s67 = _mm256_hadd_ps(a6, a7);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Lanes 0-3 of the result: the sums of the lanes of a0 .. a3 (in hsum8's order).
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Scores of TOKENS consecutive K rows (``ts`` apart) against G query heads (``q``, hs
// apart). Each K chunk is loaded (and widened from bf16) once for all G heads: G * TOKENS
// independent FMA chains. sums[g * TOKENS + j] = q_g . k_j, before scaling.
template <typename T, int G, int TOKENS>
inline void score_tile8(const T* rows, int64_t ts, int hs, const float* q, float* sums) {
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

// One KV head's n rows of a block against G of its query heads, as many tokens as tile:
// scores[g * s_stride + t]; returns the tokens done.
template <typename T, int G>
inline int score_rows8(const T* rows, int64_t ts, int n, const float* q, int hs, float scale,
                       float* scores, int64_t s_stride) {
  // Few heads: eight tokens at a time, else four (G * TOKENS accumulators in 16 registers).
  constexpr int TOKENS = G <= 1 ? 8 : 4;
  int t = 0;
  if (hs % 8 != 0) return 0;
  alignas(32) float sums[G * TOKENS];
  for (; t + TOKENS <= n; t += TOKENS) {
    score_tile8<T, G, TOKENS>(rows + t * ts, ts, hs, q, sums);
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < TOKENS; ++j) scores[g * s_stride + t + j] = sums[g * TOKENS + j] * scale;
  }
  return t;
}

// acc[g][d0 .. d0 + 8 * CHUNKS) += sum over t of w[g][t] * v_t, for G query heads of one KV
// head: each V row chunk is loaded (and widened) once for all G heads.
template <typename T, int G, int CHUNKS>
inline void accumulate_tile8(const T* rows, int n, int64_t ts, int d0, const float* w,
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
inline int accumulate_rows8(const T* rows, int n, int64_t ts, const float* w, int64_t w_stride,
                            float* acc, int hs) {
  // About eight accumulators: 64 columns for one head, 16 for three or four.
  constexpr int CHUNKS = G == 1 ? 8 : (G == 2 ? 4 : 2);
  int d0 = 0;
  for (; d0 + 8 * CHUNKS <= hs; d0 += 8 * CHUNKS)
    accumulate_tile8<T, G, CHUNKS>(rows, n, ts, d0, w, w_stride, acc, hs);
  for (; d0 + 8 <= hs; d0 += 8) accumulate_tile8<T, G, 1>(rows, n, ts, d0, w, w_stride, acc, hs);
  return d0;
}
#endif  // TANDEM_AVX2

// ------------------------------------------------------------------------------------------
// One task
// ------------------------------------------------------------------------------------------

// A thread's working memory, reused from task to task.
struct Scratch {
  std::vector<float> floats;
  std::vector<uint16_t> weights16;
};

// Where a task's query heads, scores and outputs lie in its thread's scratch.
struct Buffers {
  float* q;  // [heads][q_stride]: the query heads, prepared for the ISA's rows
  int q_stride;
  // [heads][s_stride]: the scores, then the softmax weights (bf16-rounded in bf16), of a
  // block (AVX512) or of the task's tokens (the two-pass path).
  float* scores;
  int64_t s_stride;
  uint16_t* w16;  // [heads][s_stride]: the weights as bf16 (with AVX512_BF16 only)
  float* acc;     // [heads][acc_stride]: the outputs in float32 (AVX512: in its rows' order)
  int64_t acc_stride;
  float* max;  // [heads]: the softmax's max of the task's scores
  float* sum;  // [heads]: its sum of exp(score - max)
};

template <typename T>
Buffers task_buffers(const Args& a, const Task& task, Scratch& s) {
  const int group = a.num_heads / a.num_kv_heads, hs = a.head_size;
  const int heads = (task.h1 - task.h0) * group;
  Buffers b{};
#if defined(TANDEM_AVX512)
  using Rows = RowsFor<T>;
  b.q_stride = (hs + Rows::kChunk - 1) / Rows::kChunk * Rows::kQFloats;
  b.acc_stride = (hs + 63) / 64 * 64;  // whole 64-column tiles
  b.s_stride = (a.block_size + 15) / 16 * 16;
#else
  b.q_stride = hs;
  b.acc_stride = hs;
  b.s_stride = (task.t_end - task.t_begin + 16) / 16 * 16;
#endif
  const size_t needed =
      static_cast<size_t>(heads) * (b.q_stride + b.s_stride + b.acc_stride + 2);
  if (s.floats.size() < needed) s.floats.resize(needed);
  b.q = s.floats.data();
  b.scores = b.q + static_cast<int64_t>(heads) * b.q_stride;
  b.acc = b.scores + heads * b.s_stride;
  b.max = b.acc + heads * b.acc_stride;
  b.sum = b.max + heads;
  if (a.dtype == kBFloat16) {
    const size_t n16 = static_cast<size_t>(heads) * b.s_stride;
    if (s.weights16.size() < n16) s.weights16.resize(n16);
    b.w16 = s.weights16.data();
  }
  return b;
}

// The task's query heads: float32 (bf16 widened), or on AVX512 in its rows' layout.
template <typename T>
void prepare_query(const Args& a, const Task& task, const Buffers& b) {
  const int group = a.num_heads / a.num_kv_heads, hs = a.head_size;
  const int heads = (task.h1 - task.h0) * group;
  const T* query = static_cast<const T*>(a.query);
  for (int i = 0; i < heads; ++i) {
    const T* src = query + task.row * a.q_token_stride + (task.h0 * group + i) * a.q_head_stride;
    float* dst = b.q + static_cast<int64_t>(i) * b.q_stride;
#if defined(TANDEM_AVX512)
    RowsFor<T>::prepare(src, hs, dst, b.q_stride / RowsFor<T>::kQFloats);
#else
    for (int d = 0; d < hs; ++d) dst[d] = load1(src + d);
#endif
  }
}

#if defined(TANDEM_AVX512)
// The next piece of a KV head's query heads [g0, group) that a score tile takes: at most
// three (G * 8 accumulators and G * 4 quad sums stay in 32 registers), four as 2 + 2.
inline int score_piece(int remaining) { return remaining == 4 ? 2 : std::min(3, remaining); }

// The rows of head h (of the task's) kPrefetchBlocks blocks after block ``index`` of the
// task: its own, then those of its thread's next task (null: none).
template <typename T>
RowPrefetch<T> prefetch_target(const Args& a, const Task& task, const Blocks& blocks,
                               const Task* next, const Blocks& next_blocks, int index, int h) {
  const int bs = a.block_size;
  const Task* t = &task;
  const Blocks* where = &blocks;
  int target = index + kPrefetchBlocks;
  const int own = (task.t_end - task.t_begin + bs - 1) / bs;
  if (target >= own) {
    h = next == nullptr ? -1 : next->h0 + (h - task.h0);
    if (h < 0 || h >= next->h1) return {nullptr, nullptr, 0, 0};
    target -= own;
    t = next;
    where = &next_blocks;
  }
  const int t0 = t->t_begin + target * bs;
  if (t0 >= t->t_end) return {nullptr, nullptr, 0, 0};
  const T* k = where->start(static_cast<const T*>(a.k_cache), t0, bs) + h * where->head_stride;
  const T* v = where->start(static_cast<const T*>(a.v_cache), t0, bs) + h * where->head_stride;
  return {k, v, std::min(bs, t->t_end - t0),
          static_cast<int64_t>(a.head_size) * static_cast<int64_t>(sizeof(T))};
}

// The task in one pass over its blocks (K rows, then V rows, of each KV head) with an
// online softmax: acc, max and sum of each query head. ``fetch_first``: the task's first
// blocks were not prefetched by a previous task.
template <typename T>
void attend_blocks(const Args& a, const Task& task, const Task* next, bool fetch_first,
                   const Buffers& b) {
  using R = RowsFor<T>;
  const int group = a.num_heads / a.num_kv_heads, hs = a.head_size, bs = a.block_size;
  const int heads = (task.h1 - task.h0) * group;
  const bool bf16 = a.dtype == kBFloat16;
  const Blocks blocks{a.block_tables + task.seq * a.block_table_stride, a.token_stride,
                      a.block_stride, a.head_stride};
  const Blocks next_blocks{next ? a.block_tables + next->seq * a.block_table_stride : nullptr,
                           a.token_stride, a.block_stride, a.head_stride};
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  const int64_t ts = blocks.token_stride;
  std::fill(b.max, b.max + heads, -std::numeric_limits<float>::infinity());
  std::fill(b.sum, b.sum + heads, 0.0f);
  std::fill(b.acc, b.acc + heads * b.acc_stride, 0.0f);
  for (int t0 = task.t_begin; fetch_first && t0 < std::min(task.t_end, task.t_begin + kPrefetchBlocks * bs); t0 += bs) {
    const int n = std::min(bs, task.t_end - t0);
    prefetch_block<2>(blocks.start(k_cache, t0, bs), n, blocks, task.h0, task.h1, hs);
    prefetch_block<2>(blocks.start(v_cache, t0, bs), n, blocks, task.h0, task.h1, hs);
  }
  for (int t0 = task.t_begin, index = 0; t0 < task.t_end; t0 += bs, ++index) {
    const int n = std::min(bs, task.t_end - t0);
    const T* k_block = blocks.start(k_cache, t0, bs);
    const T* v_block = blocks.start(v_cache, t0, bs);
    for (int h = task.h0; h < task.h1; ++h) {
      const RowPrefetch<T> pf = prefetch_target<T>(a, task, blocks, next, next_blocks, index, h);
      const RowPrefetch<T> none{nullptr, nullptr, 0, 0};
      const T* k_rows = k_block + h * blocks.head_stride;
      const T* v_rows = v_block + h * blocks.head_stride;
      for (int g0 = 0; g0 < group;) {
        const int piece = score_piece(group - g0), i0 = (h - task.h0) * group + g0;
        float* s = b.scores + i0 * b.s_stride;
        uint16_t* w16 = R::kBf16Weights ? b.w16 + i0 * b.s_stride : nullptr;
        float* acc = b.acc + i0 * b.acc_stride;
        const float* q = b.q + static_cast<int64_t>(i0) * b.q_stride;
        auto run = [&](auto piece_const) {
          constexpr int G = decltype(piece_const)::value;
          score_rows<R, G>(k_rows, ts, n, q, b.q_stride, hs, a.scale, s, b.s_stride,
                           g0 == 0 ? pf : none);
          for (int g = 0; g < G; ++g)
            online_softmax(s + g * b.s_stride, n, bf16, w16 ? w16 + g * b.s_stride : nullptr,
                           b.max + i0 + g, b.sum + i0 + g, acc + g * b.acc_stride,
                           static_cast<int>(b.acc_stride));
          value_rows<R, G>(v_rows, ts, n, hs, s, w16, b.s_stride, acc, b.acc_stride);
        };
        switch (piece) {
          case 1: run(std::integral_constant<int, 1>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          default: run(std::integral_constant<int, 3>{}); break;
        }
        g0 += piece;
      }
    }
  }
  // Outputs in natural column order, normalized.
  alignas(64) float natural[1024];
  for (int i = 0; i < heads; ++i) {
    float* acc = b.acc + i * b.acc_stride;
    for (int d0 = 0; d0 < hs; d0 += 1024) {
      const int width = std::min(1024, hs - d0);
      R::natural(acc + d0, width, natural);
      const float inv = 1.0f / b.sum[i];
      for (int d = 0; d < width; ++d) acc[d0 + d] = natural[d] * inv;
    }
  }
}
#endif  // TANDEM_AVX512

#if !defined(TANDEM_AVX512)
// q . k * scale for the task's query heads against its tokens: scores[i][t - t_begin].
template <typename T>
void task_scores(const Args& a, const Blocks& blocks, const Task& task, const Buffers& b) {
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  const int group = a.num_heads / a.num_kv_heads, hs = a.head_size, bs = a.block_size;
  const int64_t ts = blocks.token_stride;
  for (int t0 = task.t_begin; t0 < task.t_end; t0 += bs) {
    const T* block = blocks.start(k_cache, t0, bs);
    const int n = std::min(bs, task.t_end - t0);
    // The next block's K into L1, this block's V into L2 (the value pass reads it next).
    if (t0 + bs < task.t_end)
      prefetch_block<3>(blocks.start(k_cache, t0 + bs, bs), std::min(bs, task.t_end - t0 - bs),
                        blocks, task.h0, task.h1, hs);
    prefetch_block<2>(blocks.start(v_cache, t0, bs), n, blocks, task.h0, task.h1, hs);
    for (int h = task.h0; h < task.h1; ++h) {
      const T* rows = block + h * blocks.head_stride;
      for (int g0 = 0; g0 < group; g0 += 4) {
        const int heads = std::min(4, group - g0), i0 = (h - task.h0) * group + g0;
        const float* q = b.q + static_cast<int64_t>(i0) * b.q_stride;
        float* out = b.scores + i0 * b.s_stride + (t0 - task.t_begin);
        int t = 0;
#if defined(TANDEM_AVX2)
        switch (heads) {
          case 1: t = score_rows8<T, 1>(rows, ts, n, q, hs, a.scale, out, b.s_stride); break;
          case 2: t = score_rows8<T, 2>(rows, ts, n, q, hs, a.scale, out, b.s_stride); break;
          case 3: t = score_rows8<T, 3>(rows, ts, n, q, hs, a.scale, out, b.s_stride); break;
          default: t = score_rows8<T, 4>(rows, ts, n, q, hs, a.scale, out, b.s_stride); break;
        }
#endif
        for (int g = 0; g < heads; ++g)
          for (int tt = t; tt < n; ++tt) {
            float s = 0.0f;
            const T* k = rows + tt * ts;
            for (int d = 0; d < hs; ++d) s += q[g * b.q_stride + d] * load1(k + d);
            out[g * b.s_stride + tt] = s * a.scale;
          }
      }
    }
  }
}

// Softmax of x[0 .. n) in place, in float32 (the scale is already applied), the weights
// rounded to bf16 in bf16 (torch's rounding of its softmax output); the max and the sum of
// exp(x - max) go to max_out and sum_out, for merging chunks.
inline void softmax(float* x, int n, bool bf16, float* max_out, float* sum_out) {
  float max = x[0];
  for (int j = 1; j < n; ++j) max = std::max(max, x[j]);
  float sum = 0.0f;
  int i = 0;
#if defined(TANDEM_AVX2)
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
  for (int j = 0; j < n; ++j) x[j] = bf16 ? round_bf16(x[j] * inv) : x[j] * inv;
  *max_out = max;
  *sum_out = sum;
}

// acc[i] = sum over the task's tokens of w[i][t] * v_t for its query heads i.
template <typename T>
void task_values(const Args& a, const Blocks& blocks, const Task& task, const Buffers& b) {
  const T* v_cache = static_cast<const T*>(a.v_cache);
  const int group = a.num_heads / a.num_kv_heads, hs = a.head_size, bs = a.block_size;
  const int heads = (task.h1 - task.h0) * group;
  const int64_t ts = blocks.token_stride;
  std::fill(b.acc, b.acc + heads * b.acc_stride, 0.0f);
  for (int t0 = task.t_begin; t0 < task.t_end; t0 += bs) {
    const int n = std::min(bs, task.t_end - t0);
    if (t0 + bs < task.t_end)
      prefetch_block<3>(blocks.start(v_cache, t0 + bs, bs), std::min(bs, task.t_end - t0 - bs),
                        blocks, task.h0, task.h1, hs);
    const T* block = blocks.start(v_cache, t0, bs);
    for (int h = task.h0; h < task.h1; ++h) {
      const T* rows = block + h * blocks.head_stride;
      for (int g0 = 0; g0 < group; g0 += 4) {
        const int heads4 = std::min(4, group - g0), i0 = (h - task.h0) * group + g0;
        const float* w = b.scores + i0 * b.s_stride + (t0 - task.t_begin);
        float* out = b.acc + i0 * b.acc_stride;
        int d0 = 0;
#if defined(TANDEM_AVX2)
        switch (heads4) {  // acc_stride is hs here
          case 1: d0 = accumulate_rows8<T, 1>(rows, n, ts, w, b.s_stride, out, hs); break;
          case 2: d0 = accumulate_rows8<T, 2>(rows, n, ts, w, b.s_stride, out, hs); break;
          case 3: d0 = accumulate_rows8<T, 3>(rows, n, ts, w, b.s_stride, out, hs); break;
          default: d0 = accumulate_rows8<T, 4>(rows, n, ts, w, b.s_stride, out, hs); break;
        }
#endif
        for (int g = 0; g < heads4; ++g)
          for (int t = 0; t < n; ++t)
            for (int d = d0; d < hs; ++d)
              out[g * b.acc_stride + d] += w[g * b.s_stride + t] * load1(rows + t * ts + d);
      }
    }
  }
}

// The task in two passes over its tokens: scores, softmax, values.
template <typename T>
void attend_two_pass(const Args& a, const Task& task, const Buffers& b) {
  const int group = a.num_heads / a.num_kv_heads;
  const int heads = (task.h1 - task.h0) * group;
  const Blocks blocks{a.block_tables + task.seq * a.block_table_stride, a.token_stride,
                      a.block_stride, a.head_stride};
  task_scores<T>(a, blocks, task, b);
  for (int i = 0; i < heads; ++i)
    softmax(b.scores + i * b.s_stride, task.t_end - task.t_begin, a.dtype == kBFloat16,
            b.max + i, b.sum + i);
  task_values<T>(a, blocks, task, b);
}
#endif  // !TANDEM_AVX512

// One task: its outputs (float32, normalized by its own softmax sum) with each query
// head's max and sum into ``partial`` ([heads][head_size + 2]) when the sequence has other
// chunks, else straight into the output rows. ``next``: the thread's next task, if any.
template <typename T>
void attend(const Args& a, const Task& task, const Task* next, bool fetch_first,
            Scratch& scratch, float* partial) {
  const int group = a.num_heads / a.num_kv_heads, hs = a.head_size;
  const int heads = (task.h1 - task.h0) * group;
  T* out = static_cast<T*>(a.out) + task.row * a.out_token_stride;
  if (task.t_end <= task.t_begin) {  // an empty context attends to nothing
    for (int i = 0; i < heads; ++i)
      for (int d = 0; d < hs; ++d) store1(out + (task.h0 * group + i) * a.out_head_stride + d, 0.0f);
    return;
  }
  const Buffers b = task_buffers<T>(a, task, scratch);
  prepare_query<T>(a, task, b);
#if defined(TANDEM_AVX512)
  attend_blocks<T>(a, task, next, fetch_first, b);
#else
  (void)next;
  (void)fetch_first;
  attend_two_pass<T>(a, task, b);
#endif
  for (int i = 0; i < heads; ++i) {
    const float* acc = b.acc + i * b.acc_stride;
    if (partial != nullptr) {
      float* p = partial + i * (hs + 2);
      std::copy(acc, acc + hs, p);
      p[hs] = b.max[i];
      p[hs + 1] = b.sum[i];
    } else {
      T* dst = out + (task.h0 * group + i) * a.out_head_stride;
      for (int d = 0; d < hs; ++d) store1(dst + d, acc[d]);
    }
  }
}

// A split sequence's output: its chunks' outputs, each weighted by its share of the
// softmax's sum (exp(chunk max - overall max) * chunk sum, over their total).
template <typename T>
void merge_chunks(const Args& a, int64_t row, const float* partial, int chunks) {
  const int hs = a.head_size, stride = a.num_heads * (hs + 2);
  T* out = static_cast<T*>(a.out);
  std::vector<float> weight(chunks), sum(hs);
  for (int h = 0; h < a.num_heads; ++h) {
    const float* p = partial + h * (hs + 2);
    float max = p[hs];
    for (int c = 1; c < chunks; ++c) max = std::max(max, p[c * stride + hs]);
    float total = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      weight[c] = std::exp(p[c * stride + hs] - max) * p[c * stride + hs + 1];
      total += weight[c];
    }
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int c = 0; c < chunks; ++c) {
      const float w = weight[c] / total;
      for (int d = 0; d < hs; ++d) sum[d] += w * p[c * stride + d];
    }
    T* dst = out + row * a.out_token_stride + h * a.out_head_stride;
    for (int d = 0; d < hs; ++d) store1(dst + d, sum[d]);
  }
}

// The step's work: each item's chunks, by KV head too when there are few.
struct Plan {
  int chunk, split;
  std::vector<int> first_chunk;    // [items + 1]: each item's first in the step's chunks
  std::vector<int> first_partial;  // [items]: its first partial output, or -1 (one chunk)
  int num_partial = 0;

  Plan(const Args& a, int threads) : first_chunk(a.num_items + 1), first_partial(a.num_items, -1) {
    chunk = std::max(1, (kChunkTokens + a.block_size - 1) / a.block_size) * a.block_size;
    for (int item = 0; item < a.num_items; ++item) {
      const int chunks = std::max(1, (a.seq_lens[seq(a, item)] + chunk - 1) / chunk);
      first_chunk[item + 1] = first_chunk[item] + chunks;
      if (chunks > 1) {
        first_partial[item] = num_partial;
        num_partial += chunks;
      }
    }
    split = first_chunk[a.num_items] >= 4 * threads ? 1 : a.num_kv_heads;
  }
  static int seq(const Args& a, int item) { return a.seqs ? a.seqs[item] : item; }
  int work(const Args& a) const { return first_chunk[a.num_items] * split; }
  int item_of(int w) const {
    return static_cast<int>(std::upper_bound(first_chunk.begin(), first_chunk.end(), w / split) -
                            first_chunk.begin() - 1);
  }
  Task task(const Args& a, int w) const {
    const int item = item_of(w), s = seq(a, item), index = w / split - first_chunk[item];
    const int h0 = split == 1 ? 0 : w % split;
    return Task{s, index * chunk, std::min(a.seq_lens[s], (index + 1) * chunk), h0,
                split == 1 ? a.num_kv_heads : h0 + 1,
                a.query_start_loc ? a.query_start_loc[s] : s};
  }
};

template <typename T>
void run(const Args& a) {
  const int threads = omp_get_max_threads();
  const Plan plan(a, threads);
  const int work = plan.work(a), group = a.num_heads / a.num_kv_heads;
  const int64_t partial_stride = static_cast<int64_t>(a.num_heads) * (a.head_size + 2);
  std::vector<float> partials(static_cast<size_t>(plan.num_partial) * partial_stride);
#pragma omp parallel if (work > 1 && threads > 1)
  {
    Scratch scratch;
    const int team = omp_get_num_threads();
    bool first = true;
    // Round-robin (static, 1): a thread's next task is w + team, whose first blocks it
    // prefetches while finishing this one.
#pragma omp for schedule(static, 1)
    for (int w = 0; w < work; ++w) {
      const Task task = plan.task(a, w);
      const bool has_next = w + team < work;
      const Task next = has_next ? plan.task(a, w + team) : task;
      const int item = plan.item_of(w);
      float* partial = plan.first_partial[item] < 0
                           ? nullptr
                           : partials.data() +
                                 (plan.first_partial[item] + w / plan.split -
                                  plan.first_chunk[item]) * partial_stride +
                                 static_cast<int64_t>(task.h0) * group * (a.head_size + 2);
      attend<T>(a, task, has_next ? &next : nullptr, first, scratch, partial);
      first = false;
    }
    if (plan.num_partial > 0) {
#pragma omp for schedule(dynamic, 1)
      for (int item = 0; item < a.num_items; ++item) {
        if (plan.first_partial[item] < 0) continue;
        const int s = Plan::seq(a, item);
        merge_chunks<T>(a, a.query_start_loc ? a.query_start_loc[s] : s,
                        partials.data() + plan.first_partial[item] * partial_stride,
                        plan.first_chunk[item + 1] - plan.first_chunk[item]);
      }
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
    run<float>(a);
  } else {
    run<uint16_t>(a);
  }
  return 0;
}

}  // extern "C"
