// exp of float32 lanes for the attention kernels' softmax (x <= 0 there): Cephes'
// polynomial (as avx_mathfun's exp256_ps), about 1 ulp. exp16 (AVX512F) applies 2^n by
// vscalefps, so results below 2^-126 stay denormal; exp8 (AVX2/FMA) builds 2^n from its
// exponent bits, flushing them. Shared by every kernel source (native_build puts this
// directory on the include path and hashes its headers).

#pragma once

namespace tandem::exp_poly {

// Both widths: exp(x) = 2^n * p(r), n = floor(x log2 e + 1/2), r = x - n ln 2 (ln 2 in two
// parts), p(r) = 1 + r + r^2 q(r), q Cephes' degree-5 polynomial kP (Horner).
constexpr float kMinInput = -88.3762626647949f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kP[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                        4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

}  // namespace tandem::exp_poly

#if defined(__AVX512F__)
#include <immintrin.h>

namespace tandem {

inline __m512 exp16(__m512 x) {
  using namespace exp_poly;
  x = _mm512_max_ps(x, _mm512_set1_ps(kMinInput));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), x);
  __m512 y = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kP[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, fx);
}

}  // namespace tandem

#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace tandem {

inline __m256 exp8(__m256 x) {
  using namespace exp_poly;
  x = _mm256_max_ps(x, _mm256_set1_ps(kMinInput));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), x);
  __m256 y = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kP[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}

}  // namespace tandem

#endif  // __AVX2__ && __FMA__
