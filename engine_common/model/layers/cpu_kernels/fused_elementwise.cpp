// The decoder's elementwise work on the CPU, fused: residual add + RMSNorm, SiLU(gate) x up,
// and the rotary rotation of q/k in place. Each is one pass over its rows where PyTorch runs
// three to eight ops (each a pass over memory and a dispatch).
//
// Owns only the arithmetic. The Python side (engine_common/model/layers/cpu_fused.py) builds
// this file (model/native_build.py, with -ffp-contract=off so that no multiply and add are
// fused into one rounding, and -fno-trapping-math so that the clamps below vectorize with
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
// The rotary and the residual add are bit-identical to torch's in both dtypes; the norm's
// float32 sum of squares is summed in another order than torch's, and exp is a polynomial
// (within ~2 float32 ulps of torch's), so those two can differ from torch by one bf16 ulp
// where a float32 value lies within a few float32 ulps of a bf16 rounding boundary.
//
// The loops are plain C++ written to auto-vectorize (-O3 -march=native: AVX-512 or AVX2 or
// whatever the CPU has, scalar otherwise); rows (tokens) are split among OpenMP threads
// (torch's libgomp, so torch.set_num_threads bounds them) when there are enough of them.

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

enum DType : int { kFloat32 = 0, kBFloat16 = 1 };

// Below this many elements a call runs on the calling thread: a decode step's rows are a
// few microseconds of work, less than waking a thread team.
constexpr int64_t kParallelMinElements = 1 << 16;
constexpr int kLanes = 16;

inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as torch rounds float32 to bf16 (NaN stays a quiet NaN); written
// without branches so that loops over it vectorize.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  uint32_t nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

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

// exp(x) in float32 (Cephes' expf: range reduction by ln 2, a degree-6 polynomial, the
// exponent set by integer arithmetic), without branches or selects so that it vectorizes
// with AVX2 as well as AVX-512. x is clamped to [-86, 89]: above ~88.72 the result
// overflows to +inf like expf's (2^(n-1) * 2, so that 2^128 is reached only by a doubling
// that overflows); below -86 it stays at exp(-86) ~ 4e-38 (only exp(-g) of a large
// positive g gets there, where g / (1 + exp(-g)) == g either way).
inline float exp_f32(float x) {
  float c = x < -86.0f ? -86.0f : x;
  c = c > 89.0f ? 89.0f : c;
  // Round to the nearest integer by adding and taking away 1.5 * 2^23 (|c * log2 e| < 2^22).
  // The rounded value's low mantissa bits are n itself (0x4B400000 is 1.5 * 2^23's bits).
  constexpr float kRound = 12582912.0f;
  float shifted = c * 1.44269504088896341f + kRound;
  float n = shifted - kRound;
  float r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float z = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * z + r + 1.0f;
  int32_t n_bits;
  std::memcpy(&n_bits, &shifted, sizeof n_bits);
  int32_t e = (n_bits - 0x4B400000 + 126) << 23;  // 2^(n - 1)
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return (y * scale) * 2.0f;
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
    float partial[kLanes] = {};
    int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes) {
      for (int j = 0; j < kLanes; ++j) {
        float v = load(sr, c + j);
        partial[j] += v * v;
      }
    }
    for (; c < cols; ++c) {
      float v = load(sr, c);
      partial[0] += v * v;
    }
    float sum = 0.0f;
    for (int j = 0; j < kLanes; ++j) sum += partial[j];
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
