// Paged prefill attention for the CPU, bf16: every query row of a step's prefill sequences
// (query_len > 1, with or without a cached prefix) attends causally to its sequence's keys,
// read from the paged cache through the block table (the step's own K/V are already
// written there). Flash style: float32 scores, an online softmax, no [query, key] matrix.
//
// Owns only the arithmetic of one step's prefill attention for one layer. The Python side
// (engine_common/model/attention/cpu_prefill_kernel.py) builds this file, checks the
// tensors, sizes the workspace and passes raw pointers; the cache layout is the engine's
// (attention/kv_cache_layout.py): k_cache, v_cache [num_blocks, num_kv_heads, block_size,
// head_size] of one layer, read through their strides.
//
// Two phases in one OpenMP region (the library links torch's libgomp):
// 1. Pack: each (sequence, KV head)'s keys, 32 at a time, into the workspace in the layouts
//    the bf16 dot product wants (avx512_bf16's vdpbf16ps multiplies pairs of bf16):
//    K as [head_size / 2][32 keys] pairs of dimensions (lanes run over keys), V as
//    [16 key pairs][head_size] pairs of keys (lanes run over dimensions). Packing costs
//    one pass over the context; every query block then reads the packed tiles contiguously.
// 2. Attend: work items are (sequence, KV head, block of query tokens), the largest first,
//    shared dynamically. An item's rows are its query tokens times the KV head's query
//    heads (h = kv_head * group + g, Hugging Face's repeat_kv order), about 96 rows, so
//    each packed K/V tile (8 KiB at head 64) is reused by all of them while in L1/L2.
//    Per tile and chunk of 8 rows: scores (float32 sums of bf16 products) in registers,
//    scaled and causally masked, the online softmax update (running max and sum per row),
//    weights rounded to bf16 (as flash attention does for its second product), then
//    out += weights x V, the float32 accumulator rescaled by exp(old max - new max).
//    Tiles past a chunk's last visible key are skipped (the causal half is not computed).
//
// Without avx512_bf16 (compile time, -march=native) the same phases run a scalar loop with
// the same roundings: correct but slower than SDPA, so the loader reports which was built
// (tandem_paged_prefill_vectorized) and the backend keeps SDPA for a scalar build.
//
// bf16_to_f32, f32_to_bf16 (bf16.h) and exp16 (simd_exp.h) come from the shared headers of
// model/cpu_kernels/.

#include <omp.h>

#include "bf16.h"
#include "simd_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TANDEM_AVX512BF16 1
#endif

namespace {

constexpr int kTile = 32;         // keys per packed tile
constexpr int kChunk = 8;         // query rows scored together (8 x 2 accumulators)
constexpr int kTargetRows = 96;   // query rows (tokens x heads of a group) per work item

using tandem::bf16_to_f32;
using tandem::f32_to_bf16;

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

struct Args {
  const uint16_t* query;
  int64_t q_token_stride, q_head_stride;  // in elements
  const uint16_t* k_cache;
  const uint16_t* v_cache;
  int64_t block_stride, head_stride, token_stride;  // of k_cache and v_cache, in elements
  const int32_t* block_tables;
  int64_t block_table_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const int32_t* seqs;  // the prefill sequences to attend
  int num_seqs;
  uint16_t* out;
  int64_t out_token_stride, out_head_stride;
  int num_heads, num_kv_heads, head_size, block_size;
  float scale;
  uint32_t* workspace;
};

// One prefill sequence of the call.
struct Seq {
  int seq;        // index into block_tables / seq_lens / query_start_loc
  int first_row;  // its first query row in the step's flat batch
  int query_len;
  int cached;     // tokens before this step's: query j sits at position cached + j
  int tiles;      // packed key tiles: ceil((cached + query_len) / kTile)
  int64_t packed;  // its first packed tile in the workspace, in uint32
};

// Packed tiles of a (sequence, KV head): tile i at packed + (head * tiles + i) * tile_words.
inline int64_t tile_words(int head_size) { return static_cast<int64_t>(kTile) * head_size; }

inline uint32_t* tile_at(const Args& a, const Seq& s, int head, int tile) {
  return a.workspace + s.packed + (static_cast<int64_t>(head) * s.tiles + tile) *
                                      tile_words(a.head_size);
}

// Keys [tile * 32, +32) of one KV head: K as kp[d / 2][key] (a uint32 is dims d, d + 1 of
// one key), V as vp[key / 2][d] (a uint32 is dim d of keys 2i, 2i + 1). Past the context: 0.
void pack_tile(const Args& a, const Seq& s, int head, int tile) {
  const int hs = a.head_size, ctx = s.cached + s.query_len;
  uint32_t* kp = tile_at(a, s, head, tile);
  uint16_t* vp = reinterpret_cast<uint16_t*>(kp + kTile * hs / 2);
  const int32_t* table = a.block_tables + static_cast<int64_t>(s.seq) * a.block_table_stride;
  for (int t = 0; t < kTile; ++t) {
    const int pos = tile * kTile + t;
    if (pos >= ctx) {
      for (int d = 0; d < hs / 2; ++d) kp[d * kTile + t] = 0;
      for (int d = 0; d < hs; ++d) vp[(t / 2 * hs + d) * 2 + (t & 1)] = 0;
      continue;
    }
    const int64_t offset = table[pos / a.block_size] * a.block_stride +
                           head * a.head_stride + (pos % a.block_size) * a.token_stride;
    const uint16_t* k = a.k_cache + offset;
    const uint16_t* v = a.v_cache + offset;
    for (int d = 0; d < hs / 2; ++d) kp[d * kTile + t] = load_pair(k + 2 * d);
    for (int d = 0; d < hs; ++d) vp[(t / 2 * hs + d) * 2 + (t & 1)] = v[d];
  }
}

// One work item's state: its rows' query pointers, last visible key, running max and sum,
// and float32 output accumulators.
struct Rows {
  int count;  // a multiple of kChunk; rows past the item's real ones are padding
  std::vector<const uint16_t*> q;
  std::vector<int> limit;  // the last key position row r may see
  std::vector<float> max, sum, alpha, acc;  // acc: [count][head_size]
  std::vector<uint16_t> weights;            // [kChunk][kTile] bf16 of the current chunk
  std::vector<uint16_t> zeros;              // the query of a padding row
};

#ifdef TANDEM_AVX512BF16
inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }  // the same 512 bits

using tandem::exp16;

// Scores of rows [r0, r0 + 8) against one K tile, then their softmax update: weights (bf16)
// into rows.weights, rescale factors into rows.alpha.
void score_chunk(const Args& a, Rows& rows, int r0, int kt0, const uint32_t* kp) {
  const int hs = a.head_size;
  __m512 s[kChunk][2];
  for (int r = 0; r < kChunk; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  const uint16_t* const* q = rows.q.data() + r0;
  for (int d = 0; d < hs / 2; ++d) {
    const __m512bh k0 = as_bh(_mm512_loadu_si512(kp + d * kTile));
    const __m512bh k1 = as_bh(_mm512_loadu_si512(kp + d * kTile + 16));
    for (int r = 0; r < kChunk; ++r) {
      const __m512bh qd = as_bh(_mm512_set1_epi32(static_cast<int>(load_pair(q[r] + 2 * d))));
      s[r][0] = _mm512_dpbf16_ps(s[r][0], qd, k0);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], qd, k1);
    }
  }
  const __m512 scale = _mm512_set1_ps(a.scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 masks[kChunk][2];
  alignas(64) float new_max[16];
  for (int r = 0; r < kChunk; ++r) {
    const int visible = rows.limit[r0 + r] - kt0 + 1;  // keys 0 .. visible - 1 of the tile
    const uint32_t bits = visible >= kTile ? 0xffffffffu
                          : visible <= 0   ? 0u
                                           : (1u << visible) - 1u;
    masks[r][0] = static_cast<__mmask16>(bits);
    masks[r][1] = static_cast<__mmask16>(bits >> 16);
    s[r][0] = _mm512_mask_mul_ps(minus_inf, masks[r][0], s[r][0], scale);
    s[r][1] = _mm512_mask_mul_ps(minus_inf, masks[r][1], s[r][1], scale);
    new_max[r] = _mm512_reduce_max_ps(_mm512_max_ps(s[r][0], s[r][1]));
  }
  // The 8 rows' new maxima and rescale factors at once (exp(-inf) of a first tile: ~0).
  const __m512 old_max = _mm512_maskz_loadu_ps(0xff, rows.max.data() + r0);
  const __m512 vmax = _mm512_max_ps(old_max, _mm512_maskz_loadu_ps(0xff, new_max));
  _mm512_mask_storeu_ps(rows.max.data() + r0, 0xff, vmax);
  _mm512_mask_storeu_ps(rows.alpha.data() + r0, 0xff, exp16(_mm512_sub_ps(old_max, vmax)));
  _mm512_store_ps(new_max, vmax);
  for (int r = 0; r < kChunk; ++r) {
    const __m512 m = _mm512_set1_ps(new_max[r]);
    const __m512 p0 = _mm512_maskz_mov_ps(masks[r][0], exp16(_mm512_sub_ps(s[r][0], m)));
    const __m512 p1 = _mm512_maskz_mov_ps(masks[r][1], exp16(_mm512_sub_ps(s[r][1], m)));
    const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
    _mm512_storeu_si512(rows.weights.data() + r * kTile, w);
    // The sum of the rounded weights, so that they are normalised exactly as used.
    const __m512 w0 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
    const __m512 w1 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
    rows.sum[r0 + r] = rows.sum[r0 + r] * rows.alpha[r0 + r] +
                       _mm512_reduce_add_ps(_mm512_add_ps(w0, w1));
  }
}

// acc[r0 + r][d0 .. d0 + 16 * CH) = alpha_r * acc + weights_r x V, for 4 rows, over the
// first `pairs` key pairs of the tile (the rest carry zero weight).
template <int CH>
inline void accumulate4(Rows& rows, int r0, int d0, int hs, int pairs, const uint32_t* vp,
                        int wr0) {
  __m512 c[4][CH];
  for (int r = 0; r < 4; ++r) {
    const __m512 alpha = _mm512_set1_ps(rows.alpha[r0 + r]);
    for (int k = 0; k < CH; ++k)
      c[r][k] = _mm512_mul_ps(alpha, _mm512_loadu_ps(&rows.acc[(r0 + r) * hs + d0 + 16 * k]));
  }
  const uint16_t* w = rows.weights.data() + wr0 * kTile;
  for (int t = 0; t < pairs; ++t) {
    __m512bh v[CH];
    for (int k = 0; k < CH; ++k) v[k] = as_bh(_mm512_loadu_si512(vp + t * hs + d0 + 16 * k));
    for (int r = 0; r < 4; ++r) {
      const __m512bh p = as_bh(_mm512_set1_epi32(
          static_cast<int>(load_pair(w + r * kTile + 2 * t))));
      for (int k = 0; k < CH; ++k) c[r][k] = _mm512_dpbf16_ps(c[r][k], p, v[k]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int k = 0; k < CH; ++k)
      _mm512_storeu_ps(&rows.acc[(r0 + r) * hs + d0 + 16 * k], c[r][k]);
}

void accumulate_chunk(const Args& a, Rows& rows, int r0, int pairs, const uint32_t* vp) {
  const int hs = a.head_size;
  for (int h = 0; h < kChunk; h += 4) {
    int d0 = 0;
    for (; d0 + 64 <= hs; d0 += 64) accumulate4<4>(rows, r0 + h, d0, hs, pairs, vp, h);
    for (; d0 < hs; d0 += 16) accumulate4<1>(rows, r0 + h, d0, hs, pairs, vp, h);
  }
}
#else
// The same two steps, one element at a time, with the same roundings (bf16 products summed
// in float32, weights rounded to bf16, their rounded sum).
void score_chunk(const Args& a, Rows& rows, int r0, int kt0, const uint32_t* kp) {
  const int hs = a.head_size;
  for (int r = 0; r < kChunk; ++r) {
    float s[kTile];
    const uint16_t* q = rows.q[r0 + r];
    const int visible = rows.limit[r0 + r] - kt0 + 1;
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < kTile; ++t) {
      float dot = 0.0f;
      for (int d = 0; d < hs / 2; ++d) {
        const uint32_t k = kp[d * kTile + t];
        dot += bf16_to_f32(q[2 * d]) * bf16_to_f32(static_cast<uint16_t>(k)) +
               bf16_to_f32(q[2 * d + 1]) * bf16_to_f32(static_cast<uint16_t>(k >> 16));
      }
      s[t] = dot * a.scale;
      if (t < visible) tile_max = std::max(tile_max, s[t]);
    }
    const float old_max = rows.max[r0 + r], new_max = std::max(old_max, tile_max);
    float sum = 0.0f;
    for (int t = 0; t < kTile; ++t) {
      const uint16_t w = t < visible ? f32_to_bf16(std::exp(s[t] - new_max)) : 0;
      rows.weights[r * kTile + t] = w;
      sum += bf16_to_f32(w);
    }
    const float alpha = old_max == -std::numeric_limits<float>::infinity()
                            ? 0.0f : std::exp(old_max - new_max);
    rows.sum[r0 + r] = rows.sum[r0 + r] * alpha + sum;
    rows.max[r0 + r] = new_max;
    rows.alpha[r0 + r] = alpha;
  }
}

void accumulate_chunk(const Args& a, Rows& rows, int r0, int pairs, const uint32_t* vp) {
  const int hs = a.head_size;
  const uint16_t* v = reinterpret_cast<const uint16_t*>(vp);
  for (int r = 0; r < kChunk; ++r) {
    float* acc = &rows.acc[(r0 + r) * hs];
    const uint16_t* w = rows.weights.data() + r * kTile;
    for (int d = 0; d < hs; ++d) acc[d] *= rows.alpha[r0 + r];
    for (int t = 0; t < 2 * pairs; ++t)
      for (int d = 0; d < hs; ++d)
        acc[d] += bf16_to_f32(w[t]) * bf16_to_f32(v[(t / 2 * hs + d) * 2 + (t & 1)]);
  }
}
#endif

// Query tokens [j0, j1) of one sequence, the query heads of one KV head.
void attend(const Args& a, const Seq& s, int head, int j0, int j1, Rows& rows) {
  const int group = a.num_heads / a.num_kv_heads, hs = a.head_size;
  const int real = (j1 - j0) * group;
  rows.count = (real + kChunk - 1) / kChunk * kChunk;
  for (int r = 0; r < rows.count; ++r) {
    const int j = r < real ? j0 + r / group : j1 - 1;  // padding: a copy of the last row's mask
    rows.q[r] = r < real ? a.query + (s.first_row + j) * a.q_token_stride +
                               (head * group + r % group) * a.q_head_stride
                         : rows.zeros.data();
    rows.limit[r] = s.cached + j;
    rows.max[r] = -std::numeric_limits<float>::infinity();
    rows.sum[r] = 0.0f;
  }
  std::fill(rows.acc.begin(), rows.acc.begin() + static_cast<int64_t>(rows.count) * hs, 0.0f);
  const int tiles = (s.cached + j1 - 1) / kTile + 1;
  for (int tile = 0; tile < tiles; ++tile) {
    const int kt0 = tile * kTile;
    const uint32_t* kp = tile_at(a, s, head, tile);
    const uint32_t* vp = kp + kTile * hs / 2;
    for (int r0 = 0; r0 < rows.count; r0 += kChunk) {
      const int last = rows.limit[r0 + kChunk - 1];  // rows are in position order
      if (last < kt0) continue;  // the whole tile is in these rows' future
      score_chunk(a, rows, r0, kt0, kp);
      accumulate_chunk(a, rows, r0, std::min(kTile / 2, (last - kt0) / 2 + 1), vp);
    }
  }
  for (int r = 0; r < real; ++r) {
    const int j = j0 + r / group;
    uint16_t* dst = a.out + (s.first_row + j) * a.out_token_stride +
                    (head * group + r % group) * a.out_head_stride;
    const float inv = 1.0f / rows.sum[r];
    for (int d = 0; d < hs; ++d) dst[d] = f32_to_bf16(rows.acc[r * hs + d] * inv);
  }
}

// Packing: one tile of one (sequence, KV head).
struct Pack {
  int seq, head, tile;
};

// Attending: query tokens [j0, j1) of one (sequence, KV head); cost ~ their keys.
struct Item {
  int seq, head, j0, j1;
  int64_t cost;
};

// Query tokens per work item: about kTargetRows rows of (token, query head).
inline int tokens_per_item(int group) { return std::max(1, kTargetRows / group); }

int run(const Args& a, int64_t workspace_words) {
  std::vector<Seq> seqs;
  int64_t packed = 0;
  for (int i = 0; i < a.num_seqs; ++i) {
    const int seq = a.seqs[i];
    const int first = a.query_start_loc[seq], len = a.query_start_loc[seq + 1] - first;
    const int ctx = a.seq_lens[seq];
    if (len < 1 || ctx < len) return -3;
    const int tiles = (ctx + kTile - 1) / kTile;
    seqs.push_back({seq, first, len, ctx - len, tiles, packed});
    packed += static_cast<int64_t>(a.num_kv_heads) * tiles * tile_words(a.head_size);
  }
  if (packed > workspace_words) return -4;
  std::vector<Pack> packs;
  std::vector<Item> items;
  const int group = a.num_heads / a.num_kv_heads, per_item = tokens_per_item(group);
  for (int i = 0; i < static_cast<int>(seqs.size()); ++i) {
    const Seq& s = seqs[i];
    for (int h = 0; h < a.num_kv_heads; ++h) {
      for (int t = 0; t < s.tiles; ++t) packs.push_back({i, h, t});
      for (int j0 = 0; j0 < s.query_len; j0 += per_item) {
        const int j1 = std::min(s.query_len, j0 + per_item);
        items.push_back({i, h, j0, j1, static_cast<int64_t>(s.cached + j1) * (j1 - j0)});
      }
    }
  }
  // Largest first: the dynamic schedule then ends with small items on every thread.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int num_packs = static_cast<int>(packs.size()), num_items = static_cast<int>(items.size());
  const int max_rows = (per_item * group + kChunk - 1) / kChunk * kChunk;
#pragma omp parallel if (num_items > 1 && omp_get_max_threads() > 1)
  {
#pragma omp for schedule(dynamic, 4)
    for (int w = 0; w < num_packs; ++w)
      pack_tile(a, seqs[packs[w].seq], packs[w].head, packs[w].tile);
    Rows rows;
    rows.q.resize(max_rows);
    rows.limit.resize(max_rows);
    rows.max.resize(max_rows);
    rows.sum.resize(max_rows);
    rows.alpha.resize(max_rows);
    rows.acc.resize(static_cast<size_t>(max_rows) * a.head_size);
    rows.weights.resize(kChunk * kTile);
    rows.zeros.assign(a.head_size, 0);
#pragma omp for schedule(dynamic, 1)
    for (int w = 0; w < num_items; ++w) {
      const Item& it = items[w];
      attend(a, seqs[it.seq], it.head, it.j0, it.j1, rows);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// 1 where the avx512_bf16 path was compiled, 0 for the scalar one.
int tandem_paged_prefill_vectorized() {
#ifdef TANDEM_AVX512BF16
  return 1;
#else
  return 0;
#endif
}

// Returns 0, or a negative code for arguments the kernel cannot take.
int tandem_paged_prefill(const void* query, int64_t q_token_stride, int64_t q_head_stride,
                         const void* k_cache, const void* v_cache, int64_t block_stride,
                         int64_t head_stride, int64_t token_stride,
                         const int32_t* block_tables, int64_t block_table_stride,
                         const int32_t* seq_lens, const int32_t* query_start_loc,
                         const int32_t* seqs, int num_seqs, void* out,
                         int64_t out_token_stride, int64_t out_head_stride, int num_heads,
                         int num_kv_heads, int head_size, int block_size, float scale,
                         void* workspace, int64_t workspace_bytes) {
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_size < 16 ||
      head_size % 16 != 0 || block_size < 1)
    return -1;
  const Args a{static_cast<const uint16_t*>(query), q_token_stride, q_head_stride,
               static_cast<const uint16_t*>(k_cache), static_cast<const uint16_t*>(v_cache),
               block_stride, head_stride, token_stride, block_tables, block_table_stride,
               seq_lens, query_start_loc, seqs, num_seqs, static_cast<uint16_t*>(out),
               out_token_stride, out_head_stride, num_heads, num_kv_heads, head_size,
               block_size, scale, static_cast<uint32_t*>(workspace)};
  return run(a, workspace_bytes / 4);
}

}  // extern "C"
