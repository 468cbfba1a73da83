// 16 fp32 lanes on AVX2 (x86-64-v3: AVX2, FMA, F16C): what the AVX-512 kernels of eaglespec do
// with one __m512, done with two __m256 lane for lane, so the AVX2 paths of rowops.cpp and
// attention.cpp give their AVX-512 paths' bits. Each operation is the AVX-512 one's on every
// lane (IEEE fp32, the same rounding), and the reductions run in _mm512_reduce_add_ps's and
// _mm512_reduce_max_ps's order (GCC's: the 256-bit halves, then the 128-bit halves, then lanes
// 0 + 2 and 1 + 3, then those two). Masks are the low 16 bits of a uint32_t, lane i bit i.
// Include after <immintrin.h> and <ATen/ATen.h>. extension.py digests this header with every
// source, so a change here rebuilds them.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace avx2 {

// The target of every AVX2 function, here and in the kernels' AVX2 paths.
#define EAGLESPEC_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define EAGLESPEC_AVX2 EAGLESPEC_AVX2_TARGET inline

// Whether this CPU runs the AVX2 paths: AVX2 with FMA and F16C (x86-64-v3).
inline bool supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

struct F16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
using Mask = uint32_t;

EAGLESPEC_AVX2 F16 set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
EAGLESPEC_AVX2 F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }

// 16 values from fp32 or bf16 memory (bf16 widened exactly).
EAGLESPEC_AVX2 __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
EAGLESPEC_AVX2 __m256 load8(const at::BFloat16* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
template <typename T>
EAGLESPEC_AVX2 F16 load(const T* p) {
  return {load8(p), load8(p + 8)};
}
// The first n (<= 16) values, `fill` in the other lanes (_mm512_mask_loadu_ps's form).
template <typename T>
EAGLESPEC_AVX2 F16 load_n(const T* p, int64_t n, float fill = 0.0f) {
  if (n >= 16) return avx2::load(p);
  alignas(32) float buf[16];
  for (int i = 0; i < 16; ++i) buf[i] = i < n ? static_cast<float>(p[i]) : fill;
  return {_mm256_load_ps(buf), _mm256_load_ps(buf + 8)};
}

EAGLESPEC_AVX2 void store(float* p, F16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
EAGLESPEC_AVX2 void store_n(float* p, F16 v, int64_t n) {
  alignas(32) float buf[16];
  _mm256_store_ps(buf, v.lo);
  _mm256_store_ps(buf + 8, v.hi);
  std::memcpy(p, buf, sizeof(float) * (n >= 16 ? 16 : n));
}

// fp32 lanes rounded to bf16 precision and back (round to nearest even, as at::BFloat16's
// constructor for finite values): the high half of fp32 after adding 0x7FFF + its lowest kept bit.
EAGLESPEC_AVX2 __m256 round_bf16_8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
EAGLESPEC_AVX2 F16 round_bf16(F16 v) { return {round_bf16_8(v.lo), round_bf16_8(v.hi)}; }

// The first n (<= 16) lanes stored as bf16 (round_bf16's rounding).
EAGLESPEC_AVX2 void store_n(at::BFloat16* p, F16 v, int64_t n) {
  const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(v.lo)), 16);
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(v.hi)), 16);
  // packus interleaves the 128-bit lanes: 64-bit quarters 0, 2, 1, 3 put them back in order
  const __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
  if (n >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  } else {
    alignas(32) uint16_t buf[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(buf), h);
    std::memcpy(p, buf, 2 * n);
  }
}
EAGLESPEC_AVX2 void store(at::BFloat16* p, F16 v) { store_n(p, v, 16); }

EAGLESPEC_AVX2 F16 add(F16 a, F16 b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
EAGLESPEC_AVX2 F16 sub(F16 a, F16 b) {
  return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
}
EAGLESPEC_AVX2 F16 mul(F16 a, F16 b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
EAGLESPEC_AVX2 F16 div(F16 a, F16 b) {
  return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
}
EAGLESPEC_AVX2 F16 max(F16 a, F16 b) {
  return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
}
// a * b + c, and c - a * b, each rounded once
EAGLESPEC_AVX2 F16 fmadd(F16 a, F16 b, F16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
EAGLESPEC_AVX2 F16 fnmadd(F16 a, F16 b, F16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
EAGLESPEC_AVX2 F16 abs(F16 a) {
  const __m256 s = _mm256_set1_ps(-0.0f);
  return {_mm256_andnot_ps(s, a.lo), _mm256_andnot_ps(s, a.hi)};
}

// Lane comparisons (predicate as _mm512_cmp_ps_mask's) -> 16-bit masks.
template <int Pred>
EAGLESPEC_AVX2 Mask cmp(F16 a, F16 b) {
  return static_cast<Mask>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, Pred))) |
         static_cast<Mask>(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, Pred))) << 8;
}

// Lanes of a mask as all-ones / all-zeros lanes of two registers.
EAGLESPEC_AVX2 __m256 lanes8(Mask m) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i v = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m & 0xFF)), bit);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, bit));
}
// a where m, else b
EAGLESPEC_AVX2 F16 select(Mask m, F16 a, F16 b) {
  return {_mm256_blendv_ps(b.lo, a.lo, lanes8(m)), _mm256_blendv_ps(b.hi, a.hi, lanes8(m >> 8))};
}

// _mm512_reduce_add_ps and _mm512_reduce_max_ps, in their order.
EAGLESPEC_AVX2 float reduce_add(F16 v) {
  const __m256 t3 = _mm256_add_ps(v.hi, v.lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
EAGLESPEC_AVX2 float reduce_max(F16 v) {
  const __m256 t3 = _mm256_max_ps(v.hi, v.lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  const float a = _mm_cvtss_f32(t8), b = _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
  return a > b ? a : b;
}

// simd_exp.h's exp_nonpositive, operation for operation: lanes below -87 (and -inf) give 0.
// Its 2^n scaling (_mm512_scalef_ps) is a product with 2^n built from n's exponent bits, exact
// on the live lanes (n >= -126, a normal float), so the product rounds as scalef does.
EAGLESPEC_AVX2 __m256 exp_nonpositive8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
EAGLESPEC_AVX2 F16 exp_nonpositive(F16 x) {
  return {exp_nonpositive8(x.lo), exp_nonpositive8(x.hi)};
}

#undef EAGLESPEC_AVX2

}  // namespace avx2
