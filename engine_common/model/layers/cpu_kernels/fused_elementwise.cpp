// The decoder's elementwise work on the CPU, fused: residual add + RMSNorm, SiLU(gate) x up,
// and the rotary rotation of q/k in place. Each is one pass over its rows where PyTorch runs
// three to eight ops (each a pass over memory and a dispatch).
//
// Owns only the arithmetic. The Python side (engine_common/model/layers/cpu_fused.py) builds
// this file (model/native_build.py, with -ffp-contract=off so that no multiply and add are
// fused into one rounding, and -fno-trapping-math so that the selects below vectorize with
// AVX2 too), checks the tensors and passes raw pointers.
//
// Rounding follows the PyTorch ops the model would otherwise run (Hugging Face's order):
// every value a torch op would round to the model dtype is rounded here too, at the same
// point, and everything in between is float32. In bf16:
//   residual' = bf16(x + residual)
//   normed    = bf16(w * bf16(residual' * rsqrt(mean(residual'^2) + eps)))
//              (weight_first: bf16(w * (residual' * rsqrt(...))), GPT-OSS's order)
//   silu_mul  = bf16(bf16(g / (1 + exp(-g))) * up)
//   rotary    = bf16(bf16(a * cos) - bf16(b * sin)), bf16(bf16(b * cos) + bf16(a * sin))
// and each value is computed as torch computes it: RMSNorm's sum of squares in ATen's order
// (sum_of_squares_in_torch_order), SiLU's exp as SLEEF's (exp_f32). So every kernel is
// bit-identical to the torch ops in float32 and bf16 (tests/test_cpu_fused.py).
//
// The loops are plain C++ written to auto-vectorize (-O3 -march=native: AVX-512 or AVX2 or
// whatever the CPU has, scalar otherwise); rows (tokens) are split among OpenMP threads
// (torch's libgomp, so torch.set_num_threads bounds them) when there are enough of them.

#include <omp.h>

#include "bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

enum DType : int { kFloat32 = 0, kBFloat16 = 1 };

// Below this many elements a call runs on the calling thread: a decode step's rows are a
// few microseconds of work, less than waking a thread team.
constexpr int64_t kParallelMinElements = 1 << 16;

using tandem::bf16_to_f32;
using tandem::f32_to_bf16;

template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<uint16_t>(const uint16_t* p, int64_t i) {
  return bf16_to_f32(p[i]);
}

template <typename T> inline void store(T* p, int64_t i, float v);
template <> inline void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store<uint16_t>(uint16_t* p, int64_t i, float v) {
  p[i] = f32_to_bf16(v);
}

// The value a torch op of dtype T would hold after rounding its float32 result.
template <typename T> inline float round_to(float v);
template <> inline float round_to<float>(float v) { return v; }
// bf16_to_f32(f32_to_bf16(v)), kept in 32-bit lanes (no narrowing and widening: a third
// of SiLU x up's time when it went through uint16_t).
template <> inline float round_to<uint16_t>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  uint32_t nan = (bits | 0x400000u) & 0xffff0000u;
  bits = (bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(d) in float32, SLEEF's expf_u10 (sleefsimdsp.c, xexpf) op for op: the function torch's
// Vectorized<float>::exp() calls, and so torch's SiLU, in its vectorized loop (every element
// of a row of a multiple of 32). The multiply-adds are fused (std::fma), as SLEEF's are on a
// CPU with FMA; q is rounded to nearest even (the add-and-subtract of 1.5 * 2^23 below,
// exact for |d * log2 e| < 2^22; larger |d| end in the selects at the end). Written without
// branches so that it vectorizes (AVX2 and AVX-512 alike).
inline float exp_f32(float d) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23, whose bits are 0x4B400000
  float shifted = d * 1.442695040888963407359924681001892137426645954152985934135449406931f +
                  kRound;
  float q = shifted - kRound;
  int32_t qi;
  std::memcpy(&qi, &shifted, sizeof qi);
  qi -= 0x4B400000;
  float s = std::fma(q, -0.693145751953125f, d);
  s = std::fma(q, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.0f + std::fma(s * s, u, s);
  // ldexp by two powers of two (q >> 1 and the rest), so that neither overflows early.
  int32_t half = qi >> 1;
  int32_t e1 = (half + 127) << 23, e2 = (qi - half + 127) << 23;
  float p1, p2;
  std::memcpy(&p1, &e1, sizeof p1);
  std::memcpy(&p2, &e2, sizeof p2);
  u = (u * p1) * p2;
  u = d < -104.0f ? 0.0f : u;
  return 100.0f < d ? INFINITY : u;
}

// ATen's CeilLog2 (aten/src/ATen/native/cpu/utils.h).
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// sum(v * v) over a row, added in exactly the order of ATen's CPU sum of a contiguous float
// row (SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum, 8-float vectors,
// 4 accumulators, a 4-level cascade of 16-vector blocks; the elements past the last whole
// vector first, then the 8 lanes one by one), so that RMSNorm's mean(x^2) -- and with it
// the whole norm -- is bit-identical to torch's in float32 and bf16 alike.
template <typename T>
float sum_of_squares_in_torch_order(const T* row, int64_t n) {
  constexpr int kVec = 8, kIlp = 4, kLevels = 4;
  const int64_t vectors = n / kVec;
  const int64_t size = vectors / kIlp;  // multi_row_sum's rows of kIlp vectors
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  float acc[kLevels][kIlp][kVec] = {};
  auto add_vector = [&](float* into, int64_t vector) {
    const int64_t base = vector * kVec;
    for (int l = 0; l < kVec; ++l) {
      float v = load(row, base + l);
      into[l] += v * v;
    }
  };
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < kVec; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < kIlp; ++k) add_vector(acc[0][k], i * kIlp + k);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < kVec; ++l) acc[0][k][l] += acc[j][k][l];
  // row_sum: the vectors past the last whole group of kIlp, then the accumulators in turn.
  for (int64_t v = size * kIlp; v < vectors; ++v) add_vector(acc[0][0], v);
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < kVec; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0.0f;
  for (int64_t c = vectors * kVec; c < n; ++c) {
    float v = load(row, c);
    total += v * v;
  }
  for (int l = 0; l < kVec; ++l) total += acc[0][0][l];
  return total;
}

template <typename T>
void add_rms_norm_rows(const T* x, int64_t x_stride, const T* residual, int64_t res_stride,
                       T* residual_out, int64_t res_out_stride, const T* weight, T* out,
                       int64_t out_stride, int64_t rows, int64_t cols, float eps,
                       bool weight_first) {
  const bool parallel = rows > 1 && rows * cols >= kParallelMinElements;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t row = 0; row < rows; ++row) {
    const T* xr = x + row * x_stride;
    const T* rr = residual ? residual + row * res_stride : nullptr;
    // Without a residual the row itself is normed (and not written back).
    const T* sr = xr;
    if (rr) {
      T* ro = residual_out + row * res_out_stride;
      for (int64_t c = 0; c < cols; ++c) store(ro, c, load(xr, c) + load(rr, c));
      sr = ro;
    }
    const float sum = sum_of_squares_in_torch_order(sr, cols);
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(cols) + eps);
    T* o = out + row * out_stride;
    if (weight_first) {
      for (int64_t c2 = 0; c2 < cols; ++c2) store(o, c2, load(weight, c2) * (load(sr, c2) * inv));
    } else {
      for (int64_t c2 = 0; c2 < cols; ++c2)
        store(o, c2, load(weight, c2) * round_to<T>(load(sr, c2) * inv));
    }
  }
}

template <typename T>
void silu_mul_rows(const T* gate_up, int64_t in_stride, T* out, int64_t out_stride,
                   int64_t rows, int64_t cols) {
  const bool parallel = rows > 1 && rows * cols >= kParallelMinElements;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t row = 0; row < rows; ++row) {
    const T* g = gate_up + row * in_stride;
    const T* u = g + cols;
    T* o = out + row * out_stride;
    for (int64_t c = 0; c < cols; ++c) {
      float gv = load(g, c);
      float silu = round_to<T>(gv / (1.0f + exp_f32(-gv)));
      store(o, c, silu * load(u, c));
    }
  }
}

template <typename T>
void rotary_rows(T* qk, int64_t token_stride, int64_t head_stride, int64_t tokens,
                 int64_t heads, int64_t half, const T* cos, const T* sin, int64_t cs_stride) {
  const bool parallel = tokens > 1 && tokens * heads * half >= kParallelMinElements;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* ct = cos + t * cs_stride;
    const T* st = sin + t * cs_stride;
    for (int64_t h = 0; h < heads; ++h) {
      T* a = qk + t * token_stride + h * head_stride;
      T* b = a + half;
      for (int64_t i = 0; i < half; ++i) {
        float av = load(a, i), bv = load(b, i), cv = load(ct, i), sv = load(st, i);
        float first = round_to<T>(av * cv) - round_to<T>(bv * sv);
        float second = round_to<T>(bv * cv) + round_to<T>(av * sv);
        store(a, i, first);
        store(b, i, second);
      }
    }
  }
}

}  // namespace

extern "C" {

// residual may be null: then out = RMSNorm(x) and residual_out is not written. Otherwise
// residual_out = x + residual (it may alias residual) and out = RMSNorm(residual_out).
int tandem_add_rms_norm(int dtype, const void* x, int64_t x_stride, const void* residual,
                        int64_t res_stride, void* residual_out, int64_t res_out_stride,
                        const void* weight, void* out, int64_t out_stride, int64_t rows,
                        int64_t cols, float eps, int weight_first) {
  if (rows < 0 || cols <= 0 || (residual && !residual_out)) return 1;
  if (dtype == kFloat32) {
    add_rms_norm_rows(static_cast<const float*>(x), x_stride,
                      static_cast<const float*>(residual), res_stride,
                      static_cast<float*>(residual_out), res_out_stride,
                      static_cast<const float*>(weight), static_cast<float*>(out), out_stride,
                      rows, cols, eps, weight_first != 0);
  } else if (dtype == kBFloat16) {
    add_rms_norm_rows(static_cast<const uint16_t*>(x), x_stride,
                      static_cast<const uint16_t*>(residual), res_stride,
                      static_cast<uint16_t*>(residual_out), res_out_stride,
                      static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out),
                      out_stride, rows, cols, eps, weight_first != 0);
  } else {
    return 2;
  }
  return 0;
}

// gate_up rows hold [gate (cols) | up (cols)]; out = silu(gate) * up.
int tandem_silu_mul(int dtype, const void* gate_up, int64_t in_stride, void* out,
                    int64_t out_stride, int64_t rows, int64_t cols) {
  if (rows < 0 || cols <= 0) return 1;
  if (dtype == kFloat32) {
    silu_mul_rows(static_cast<const float*>(gate_up), in_stride, static_cast<float*>(out),
                  out_stride, rows, cols);
  } else if (dtype == kBFloat16) {
    silu_mul_rows(static_cast<const uint16_t*>(gate_up), in_stride,
                  static_cast<uint16_t*>(out), out_stride, rows, cols);
  } else {
    return 2;
  }
  return 0;
}

// qk: [tokens, heads, 2 * half] through its strides (unit stride within a head); cos, sin:
// [tokens, half] rows cs_stride apart. Neox rotation of each head's halves, in place.
int tandem_rotary(int dtype, void* qk, int64_t token_stride, int64_t head_stride,
                  int64_t tokens, int64_t heads, int64_t half, const void* cos, const void* sin,
                  int64_t cs_stride) {
  if (tokens < 0 || heads <= 0 || half <= 0) return 1;
  if (dtype == kFloat32) {
    rotary_rows(static_cast<float*>(qk), token_stride, head_stride, tokens, heads, half,
                static_cast<const float*>(cos), static_cast<const float*>(sin), cs_stride);
  } else if (dtype == kBFloat16) {
    rotary_rows(static_cast<uint16_t*>(qk), token_stride, head_stride, tokens, heads, half,
                static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin),
                cs_stride);
  } else {
    return 2;
  }
  return 0;
}

}  // extern "C"
