// Row-wise ops of a decode step on x86 CPUs with AVX-512 or AVX2 (the AVX2 path gives the same
// bits), where PyTorch's eager ops cost more in dispatch than in work
// (eaglespec/model/cpu_rowops.py has the why and the measurements).
//
// rms_norm: y[m] = x[m] * (1 / sqrt(mean_c x[m, c]^2 + eps)) * w, in fp32, rounded once to x's
// dtype. Each row is computed alone, by one thread, through the same instructions whatever the
// number of rows and the split among threads, so a row of a verification forward is bitwise the
// row of a one-token step.
//
// rope_write: the step between the fused q/k/v projection and attention onto the cache. q and
// k rotated (rotate-half layout: out = x * cos + roll(x, D/2) * signed_sin, each product and the
// sum rounded to x's dtype as PyTorch's eager ops round them, so the bits are `apply_rope`'s),
// k and v written to the cache at each token's slot, q returned. One call in place of a dozen
// ops a layer.
//
// silu_mul: the gated MLP's activation, y[m, i] = silu(g[m, i]) * u[m, i] for the gate and up
// halves of a fused gate/up projection's row (g = x[m, :I], u = x[m, I:]), silu(g) = g *
// sigmoid(g) with sigmoid from exp of -|g| (simd_exp.h), in fp32, rounded once to x's dtype.
// One call in place of PyTorch's silu and mul (about 17 us a SmolLM2 layer from Python).
//
// argmax: each fp32 row's index of its first maximum, as torch.max(x, -1).indices gives it (a NaN
// counts as the maximum: the first NaN's index). Two passes over the row: the maximum (and whether
// any NaN), then the first index holding it. A greedy step's or verification's token choice
// over a 49,152-token vocabulary in one call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"  // the kernels called from C++ (layer.cpp)
#include "team.h"     // parallel_for: through the forward's team where one runs (layer.cpp)

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTaskValues = 1 << 16;  // values a task takes at least (a second thread pays)
// SiLU's exp and division cost more a value than a norm's sums: a second thread pays from 8,192
// values (SmolLM2's gate/up rows of 1,536: 32 rows 18.6 -> 11.1 us, 16 rows 10.4 -> 7.0 us, 1-4
// rows unchanged; batched decoding of 16 and 32 rows 1.005-1.031x as fast, session 45).
constexpr int64_t kSiluTaskValues = 1 << 13;

#define ROWOPS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

bool avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// The first n (<= 16) values from fp32 or bf16 memory -> fp32 lanes, the rest 0.
ROWOPS_TARGET inline __m512 load16(const float* p, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, p);
}
ROWOPS_TARGET inline __m512 load16(const at::BFloat16* p, __mmask16 mask) {
  __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

// fp32 lanes rounded to T's precision and back, as fp32 lanes. bf16: the high half of fp32
// after adding 0x7FFF + the lowest kept bit (round to nearest even, as at::BFloat16's
// constructor for finite values; NaN is not expected in activations). fp32: unchanged.
template <typename T>
ROWOPS_TARGET inline __m512 round_to(__m512 v);
template <>
ROWOPS_TARGET inline __m512 round_to<float>(__m512 v) { return v; }
template <>
ROWOPS_TARGET inline __m512 round_to<at::BFloat16>(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

// fp32 lanes -> the first n of them stored as fp32 or bf16 (round_to's rounding).
ROWOPS_TARGET inline void store16(float* p, __m512 v, __mmask16 mask) {
  _mm512_mask_storeu_ps(p, mask, v);
}
ROWOPS_TARGET inline void store16(at::BFloat16* p, __m512 v, __mmask16 mask) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(round_to<at::BFloat16>(v)), 16);
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(high));
}

#define EAGLESPEC_SIMD_TARGET ROWOPS_TARGET
#include "simd_exp.h"
#include "simd16_avx2.h"

// AVX-512, or AVX2 with FMA and F16C (x86-64-v3): the AVX2 path, the same bits.
bool cpu_supported() { return avx512_supported() || avx2::supported(); }

// Whether the ops take their AVX2 path: where AVX-512 is missing, or where `use_avx2(true)`
// asked for it (tests compare the two paths bit for bit).
std::atomic<bool> avx2_wanted{false};
bool avx2_on() { return !avx512_supported() || avx2_wanted.load(std::memory_order_relaxed); }

inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// ---- The AVX2 path: the functions below, lane for lane on simd16_avx2.h's 16 lanes, so the
// same bits (tests/test_rowops.py compares the two where both run).

template <typename T, typename W>
EAGLESPEC_AVX2_TARGET void rms_norm_row_avx2(const T* x, const W* w, T* y, int64_t C,
                                             float eps) {
  avx2::F16 ss = avx2::zero();
  for (int64_t c = 0; c < C; c += 16) {
    const avx2::F16 v = avx2::load_n(x + c, C - c);
    ss = avx2::fmadd(v, v, ss);
  }
  const float r = 1.0f / std::sqrt(avx2::reduce_add(ss) / static_cast<float>(C) + eps);
  const avx2::F16 vr = avx2::set1(r);
  for (int64_t c = 0; c < C; c += 16) {
    const avx2::F16 v = avx2::mul(avx2::load_n(x + c, C - c), vr);
    avx2::store_n(y + c, avx2::mul(v, avx2::load_n(w + c, C - c)), C - c);
  }
}

template <typename T>
EAGLESPEC_AVX2_TARGET void silu_mul_row_avx2(const T* g, const T* u, T* y, int64_t I) {
  const avx2::F16 one = avx2::set1(1.0f);
  for (int64_t i = 0; i < I; i += 16) {
    const avx2::F16 x = avx2::load_n(g + i, I - i);
    const avx2::F16 e = avx2::exp_nonpositive(avx2::sub(avx2::zero(), avx2::abs(x)));
    const avx2::F16 sig_abs = avx2::div(one, avx2::add(one, e));
    const avx2::Mask negative = avx2::cmp<_CMP_LT_OQ>(x, avx2::zero());
    const avx2::F16 sig = avx2::select(negative, avx2::mul(sig_abs, e), sig_abs);
    avx2::store_n(y + i, avx2::mul(avx2::mul(x, sig), avx2::load_n(u + i, I - i)), I - i);
  }
}

template <typename T>
EAGLESPEC_AVX2_TARGET avx2::F16 round_avx2(avx2::F16 v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return avx2::round_bf16(v);
}

template <typename T>
EAGLESPEC_AVX2_TARGET void rope_write_token_avx2(const T* x, const T* cos, const T* sin,
                                                 int64_t H, int64_t Hkv, int64_t D, T* qo, T* kc,
                                                 T* vc, int64_t hs) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < H + Hkv; ++h) {
    const T* xh = x + h * D;
    T* out = h < H ? qo + h * D : kc + (h - H) * hs;
    for (int64_t d = 0; d < D; d += 16) {
      const int64_t src = d < half ? d + half : d - half, n = D - d;
      const avx2::F16 a =
          round_avx2<T>(avx2::mul(avx2::load_n(xh + d, n), avx2::load_n(cos + d, n)));
      const avx2::F16 b =
          round_avx2<T>(avx2::mul(avx2::load_n(xh + src, n), avx2::load_n(sin + d, n)));
      avx2::store_n(out + d, avx2::add(a, b), n);
    }
  }
  for (int64_t h = 0; h < Hkv; ++h)
    std::copy(x + (H + Hkv + h) * D, x + (H + Hkv + h + 1) * D, vc + h * hs);
}

EAGLESPEC_AVX2_TARGET int64_t argmax_row_avx2(const float* x, int64_t V) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  avx2::F16 best = avx2::set1(neg_inf);
  avx2::Mask nan = 0;
  for (int64_t v = 0; v < V; v += 16) {
    const avx2::F16 a = avx2::load_n(x + v, V - v, neg_inf);
    nan |= avx2::cmp<_CMP_UNORD_Q>(a, a);
    best = avx2::max(best, a);
  }
  if (nan) {
    for (int64_t v = 0; v < V; ++v)
      if (std::isnan(x[v])) return v;
  }
  const avx2::F16 top = avx2::set1(avx2::reduce_max(best));
  for (int64_t v = 0; v < V; v += 16) {
    const int64_t n = V - v;
    avx2::Mask hit = avx2::cmp<_CMP_EQ_OQ>(avx2::load_n(x + v, n), top);
    if (n < 16) hit &= (1u << n) - 1u;
    if (hit) return v + __builtin_ctz(hit);
  }
  return 0;  // not reached: the maximum is one of the values
}
// ---- end of the AVX2 path

template <typename T, typename W>
ROWOPS_TARGET void rms_norm_row(const T* x, const W* w, T* y, int64_t C, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 16) {
    const __m512 v = load16(x + c, tail_mask(C - c));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(C) + eps);
  const __m512 vr = _mm512_set1_ps(r);
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 mask = tail_mask(C - c);
    const __m512 v = _mm512_mul_ps(load16(x + c, mask), vr);
    store16(y + c, _mm512_mul_ps(v, load16(w + c, mask)), mask);
  }
}

template <typename T, typename W>
void rms_norm_rows(const T* xp, const W* wp, T* yp, int64_t M, int64_t C, double eps) {
  const int64_t grain = std::max<int64_t>(1, kTaskValues / C);
  const bool avx2 = avx2_on();
  team::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      if (avx2)
        rms_norm_row_avx2<T, W>(xp + m * C, wp, yp + m * C, C, static_cast<float>(eps));
      else
        rms_norm_row<T, W>(xp + m * C, wp, yp + m * C, C, static_cast<float>(eps));
  });
}

template <typename T>
ROWOPS_TARGET void silu_mul_row(const T* g, const T* u, T* y, int64_t I) {
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 mask = tail_mask(I - i);
    const __m512 x = load16(g + i, mask);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 sig_abs = _mm512_div_ps(one, _mm512_add_ps(one, e));  // sigmoid(|x|)
    // sigmoid(x) = 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) = e * sigmoid(|x|) below
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_mask_mul_ps(sig_abs, negative, sig_abs, e);
    store16(y + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), load16(u + i, mask)), mask);
  }
}

template <typename T>
void silu_mul_rows(const T* xp, int64_t stride, int64_t M, int64_t I, T* yp) {
  const int64_t grain = std::max<int64_t>(1, kSiluTaskValues / I);
  const bool avx2 = avx2_on();
  team::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      if (avx2)
        silu_mul_row_avx2<T>(xp + m * stride, xp + m * stride + I, yp + m * I, I);
      else
        silu_mul_row<T>(xp + m * stride, xp + m * stride + I, yp + m * I, I);
  });
}

// One token's q heads (to qo) and k heads (to the cache at kc, stride hs per head), rotated,
// and its v heads copied to the cache at vc (same stride). x: the token's H + 2 Hkv heads of D
// values; D a multiple of 32 (checked by the op).
template <typename T>
ROWOPS_TARGET void rope_write_token(const T* x, const T* cos, const T* sin, int64_t H,
                                    int64_t Hkv, int64_t D, T* qo, T* kc, T* vc, int64_t hs) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < H + Hkv; ++h) {
    const T* xh = x + h * D;
    T* out = h < H ? qo + h * D : kc + (h - H) * hs;
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 mask = tail_mask(D - d);
      // roll(x, D/2)[d] = x[(d + D/2) mod D]: one of the halves; a 16-lane chunk never straddles
      // them, D/2 being a multiple of 16.
      const int64_t src = d < half ? d + half : d - half;
      const __m512 a = round_to<T>(_mm512_mul_ps(load16(xh + d, mask), load16(cos + d, mask)));
      const __m512 b = round_to<T>(_mm512_mul_ps(load16(xh + src, mask), load16(sin + d, mask)));
      store16(out + d, _mm512_add_ps(a, b), mask);
    }
  }
  for (int64_t h = 0; h < Hkv; ++h)
    std::copy(x + (H + Hkv + h) * D, x + (H + Hkv + h + 1) * D, vc + h * hs);
}

template <typename T>
void rope_write_all(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& kc, at::Tensor& vc, const at::Tensor& slots, at::Tensor& q) {
  const int64_t B = qkv.size(0), T_ = qkv.size(1), D = qkv.size(3);
  const int64_t Hkv = kc.size(1), H = qkv.size(2) - 2 * Hkv;
  const T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* kp = kc.data_ptr<T>();
  T* vp = vc.data_ptr<T>();
  T* qp = q.data_ptr<T>();
  const int64_t kb = kc.stride(0), kh = kc.stride(1), ks = kc.stride(2);
  const int64_t vb = vc.stride(0), vh = vc.stride(1), vs = vc.stride(2);
  TORCH_CHECK(kh == vh, "rope_write: k and v caches must share their head stride");
  const int64_t grain = std::max<int64_t>(1, kTaskValues / ((H + 2 * Hkv) * D));
  const bool avx2 = avx2_on();
  team::parallel_for(0, B * T_, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T_, s = slot[r];
      (avx2 ? rope_write_token_avx2<T> : rope_write_token<T>)(
          xp + r * (H + 2 * Hkv) * D, cp + r * D, sp + r * D, H, Hkv, D, qp + r * H * D,
          kp + b * kb + s * ks, vp + b * vb + s * vs, kh);
    }
  });
}

// Row x (V fp32 values) -> the index of its first maximum (of its first NaN if it has one).
ROWOPS_TARGET int64_t argmax_row(const float* x, int64_t V) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 m = tail_mask(V - v);
    const __m512 a = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, x + v);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, a);
  }
  if (nan) {
    for (int64_t v = 0; v < V; ++v)
      if (std::isnan(x[v])) return v;
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 m = tail_mask(V - v);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, load16(x + v, m), top, _CMP_EQ_OQ);
    if (hit) return v + __builtin_ctz(hit);
  }
  return 0;  // not reached: the maximum is one of the values
}

}  // namespace

template <typename T, typename W>
void kernels::rms_norm_rows(const T* x, const W* w, T* y, int64_t M, int64_t C, float eps) {
  ::rms_norm_rows<T, W>(x, w, y, M, C, eps);
}
template void kernels::rms_norm_rows<float, float>(const float*, const float*, float*, int64_t,
                                                   int64_t, float);
template void kernels::rms_norm_rows<at::BFloat16, float>(const at::BFloat16*, const float*,
                                                          at::BFloat16*, int64_t, int64_t, float);
template void kernels::rms_norm_rows<at::BFloat16, at::BFloat16>(const at::BFloat16*,
                                                                 const at::BFloat16*,
                                                                 at::BFloat16*, int64_t, int64_t,
                                                                 float);

template <typename T>
void kernels::silu_mul_rows(const T* x, int64_t stride, int64_t M, int64_t I, T* y) {
  ::silu_mul_rows<T>(x, stride, M, I, y);
}
template void kernels::silu_mul_rows<float>(const float*, int64_t, int64_t, int64_t, float*);
template void kernels::silu_mul_rows<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, int64_t,
                                                   at::BFloat16*);

template <typename T>
void kernels::rope_write_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                              at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                              at::Tensor& q) {
  rope_write_all<T>(qkv, cos, sin, k_cache, v_cache, slots, q);
}
template void kernels::rope_write_rows<float>(const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, at::Tensor&, at::Tensor&,
                                              const at::Tensor&, at::Tensor&);
template void kernels::rope_write_rows<at::BFloat16>(const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, at::Tensor&, at::Tensor&,
                                                     const at::Tensor&, at::Tensor&);

// x (..., 2I): gate then up -> (..., I) in x's dtype.
at::Tensor rowops_silu_mul(const at::Tensor& x_in) {
  TORCH_CHECK(cpu_supported(), "eaglespec silu_mul: this CPU lacks AVX2 (and AVX-512)");
  TORCH_CHECK(x_in.device().is_cpu(), "silu_mul: CPU tensors only");
  const int64_t W = x_in.size(-1);
  TORCH_CHECK(W % 2 == 0, "silu_mul: the last dim holds gate and up halves, got ", W);
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "silu_mul: fp32 or bf16 only, got ", dt);
  at::Tensor x = x_in.reshape({-1, W});  // rows (a view where x_in's rows are strided)
  if (x.stride(-1) != 1) x = x.contiguous();
  std::vector<int64_t> sizes = x_in.sizes().vec();
  sizes.back() = W / 2;
  at::Tensor y = at::empty({x.size(0), W / 2}, x_in.options());
  const int64_t M = x.size(0), I = W / 2, stride = x.stride(0);
  if (dt == at::kFloat)
    silu_mul_rows<float>(x.data_ptr<float>(), stride, M, I, y.data_ptr<float>());
  else
    silu_mul_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), stride, M, I,
                                y.data_ptr<at::BFloat16>());
  return y.view(sizes);
}

// x (..., C) fp32 or bf16, w (C,) fp32 or x's dtype -> (..., C) in x's dtype.
at::Tensor rowops_rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(cpu_supported(), "eaglespec rms_norm: this CPU lacks AVX2 (and AVX-512)");
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu(), "rms_norm: CPU tensors only");
  const int64_t C = x_in.size(-1);
  TORCH_CHECK(w_in.dim() == 1 && w_in.size(0) == C, "rms_norm: weight must be (", C, "), got ",
              w_in.sizes());
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "rms_norm: fp32 or bf16 only, got ", dt);
  TORCH_CHECK(w_in.scalar_type() == dt || w_in.scalar_type() == at::kFloat,
              "rms_norm: weight dtype ", w_in.scalar_type(), " for ", dt, " input");
  const at::Tensor x = x_in.contiguous().view({-1, C});
  const at::Tensor w = w_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t M = x.size(0);
  if (dt == at::kFloat)
    rms_norm_rows<float, float>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M,
                                C, eps);
  else if (w.scalar_type() == at::kFloat)
    rms_norm_rows<at::BFloat16, float>(x.data_ptr<at::BFloat16>(), w.data_ptr<float>(),
                                       y.data_ptr<at::BFloat16>(), M, C, eps);
  else
    rms_norm_rows<at::BFloat16, at::BFloat16>(x.data_ptr<at::BFloat16>(),
                                              w.data_ptr<at::BFloat16>(),
                                              y.data_ptr<at::BFloat16>(), M, C, eps);
  return y.view(x_in.sizes());
}

// qkv (B, T, H + 2 Hkv, D) contiguous; cos, signed sin (B, T, 1, D); k_cache, v_cache
// (B, Hkv, S, D) with unit stride over D; slots (B, T) int64 -> q (B, T, H, D), rotated; the
// rotated k and the v of token (b, t) land in row b's slot slots[b, t] of the caches.
at::Tensor rowops_rope_write(const at::Tensor& qkv_in, const at::Tensor& cos_in,
                             const at::Tensor& sin_in, at::Tensor k_cache, at::Tensor v_cache,
                             const at::Tensor& slots_in) {
  TORCH_CHECK(cpu_supported(), "eaglespec rope_write: this CPU lacks AVX2 (and AVX-512)");
  TORCH_CHECK(qkv_in.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "rope_write: qkv and the caches must be 4-D");
  const int64_t B = qkv_in.size(0), T_ = qkv_in.size(1), D = qkv_in.size(3);
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2), H = qkv_in.size(2) - 2 * Hkv;
  const auto dt = qkv_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "rope_write: fp32 or bf16 only");
  TORCH_CHECK(cos_in.scalar_type() == dt && sin_in.scalar_type() == dt &&
                  k_cache.scalar_type() == dt && v_cache.scalar_type() == dt,
              "rope_write: qkv, cos, sin and the caches must share a dtype");
  TORCH_CHECK(H > 0 && D % 32 == 0, "rope_write: needs query heads and a head dim divisible by 32");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == B && k_cache.size(3) == D,
              "rope_write: caches must be (B, Hkv, S, D) like qkv's B and D");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "rope_write: cache rows must be contiguous");
  TORCH_CHECK(cos_in.numel() == B * T_ * D && sin_in.numel() == B * T_ * D,
              "rope_write: cos and sin must be (B, T, 1, D)");
  TORCH_CHECK(slots_in.scalar_type() == at::kLong && slots_in.numel() == B * T_,
              "rope_write: slots must be (B, T) int64");
  const at::Tensor qkv = qkv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor slots = slots_in.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T_; ++i)
    TORCH_CHECK(0 <= sp[i] && sp[i] < S, "rope_write: slot ", sp[i], " outside the cache (", S, ")");
  at::Tensor q = at::empty({B, T_, H, D}, qkv.options());
  if (dt == at::kFloat)
    rope_write_all<float>(qkv, cos, sin, k_cache, v_cache, slots, q);
  else
    rope_write_all<at::BFloat16>(qkv, cos, sin, k_cache, v_cache, slots, q);
  return q;
}

// x (..., V) fp32 -> (...) int64: each row's index of its first maximum (a NaN counts as the
// maximum), torch.max(x, -1).indices' values; rows split among threads, each row alone.
at::Tensor rowops_argmax(const at::Tensor& x_in) {
  TORCH_CHECK(cpu_supported(), "eaglespec argmax: this CPU lacks AVX2 (and AVX-512)");
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() >= 1,
              "argmax: CPU fp32 (..., V) only, got ", x_in.scalar_type(), " ", x_in.sizes());
  const int64_t V = x_in.size(-1);
  TORCH_CHECK(V > 0, "argmax: an empty last dimension has no maximum");
  const at::Tensor x = x_in.contiguous().view({-1, V});
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const bool avx2 = avx2_on();
  team::parallel_for(0, M, std::max<int64_t>(1, kTaskValues / V), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      op[m] = avx2 ? argmax_row_avx2(xp + m * V, V) : argmax_row(xp + m * V, V);
  });
  auto sizes = x_in.sizes().vec();
  sizes.pop_back();
  return out.view(sizes);
}

at::Tensor kernels::argmax_rows(const at::Tensor& x) { return rowops_argmax(x); }

bool rowops_supported() { return cpu_supported(); }

// Whether the ops take their AVX2 path from now on where AVX-512 would run (`force`); returns
// whether they do (always where AVX-512 is missing). The bits are the same either way.
bool rowops_use_avx2(bool force) {
  avx2_wanted.store(force, std::memory_order_relaxed);
  return avx2_on();
}

TORCH_LIBRARY(eaglespec_rowops, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("supported() -> bool");
  m.def("use_avx2(bool force) -> bool");
}

TORCH_LIBRARY_IMPL(eaglespec_rowops, CPU, m) {
  m.impl("argmax", &rowops_argmax);
  m.impl("silu_mul", &rowops_silu_mul);
  m.impl("rms_norm", &rowops_rms_norm);
  m.impl("rope_write", &rowops_rope_write);
}

TORCH_LIBRARY_IMPL(eaglespec_rowops, CompositeExplicitAutograd, m) {
  m.impl("supported", &rowops_supported);
  m.impl("use_avx2", &rowops_use_avx2);
}
