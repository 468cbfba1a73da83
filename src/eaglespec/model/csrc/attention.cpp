// Attention of query tokens onto a KV cache, on x86 CPUs with AVX-512: the decode,
// verification and (with their causal mask) eager prefill attention of eaglespec
// (eaglespec/model/cpu_attention.py has the why and the measurements).
//
// out[b, h, t] = sum_j p[j] v[b, h / G, j] / sum_j p[j],   p[j] = exp(s[j] - max_j s[j]),
// s[j] = (q[b, h, t] . k[b, h / G, j]) * scale where mask[b, t, j] (all j without a mask),
// G = H / Hkv query heads per KV head. Scores, softmax and sums in fp32; q, k, v, out fp32 or bf16.
//
// Every query row (b, h, t) is computed alone (the G heads of a KV head by one thread, each in
// its own order) through the same instructions whatever T, B and the split among threads are, so a row of a T-token verification is bitwise
// the same row computed in a one-token step over the same keys. Masked keys change nothing
// either: a row's sums run over its attended keys in order, so a key's slot does not matter.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kTaskKeys = 512;  // (query row, key) pairs a task takes at least

#define ATTN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// 16 values from fp32 or bf16 memory -> fp32 lanes.
ATTN_TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
ATTN_TARGET inline __m512 load16(const at::BFloat16* p) {
  __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

// exp(x) for x <= 0 (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial in r,
// times 2^n); lanes below -87 (where expf underflows) and -inf give exactly 0.
ATTN_TARGET inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, n));
}

struct Strides {  // element strides of a (B, heads, rows, D) tensor; the last one is 1
  int64_t b, h, r;
};

Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// The scores of 16 consecutive keys (unscaled q . k, fp32), in key order, bit for bit what
// _mm512_reduce_add_ps gives for each key's accumulator: its tree (lanes i + i+8, then
// + i+4, + i+2, + i+1) run on the 16 accumulators at once, four shuffle-and-add levels, so that
// rows scored this way and one key at a time agree.
template <typename T, int C>
ATTN_TARGET inline __m512 dot16(const __m512 (&qv)[C], const T* k, int64_t k_stride) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) {
    const T* kj = k + j * k_stride;
    a[j] = _mm512_mul_ps(qv[0], load16(kj));
    for (int c = 1; c < C; ++c) a[j] = _mm512_fmadd_ps(qv[c], load16(kj + 16 * c), a[j]);
  }
  __m512 b[8], c4[4], d[2];
  for (int p = 0; p < 8; ++p)  // lanes i + i+8: keys 2p, 2p+1 -> 8 sums each
    b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
  for (int r = 0; r < 4; ++r)  // + i+4: keys 4r..4r+3 -> 4 sums each, one per 128-bit lane
    c4[r] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * r], b[2 * r + 1], 0x88),
                          _mm512_shuffle_f32x4(b[2 * r], b[2 * r + 1], 0xDD));
  for (int t = 0; t < 2; ++t)  // + i+2: 128-bit lane L holds keys 8t+L and 8t+4+L, 2 sums each
    d[t] = _mm512_add_ps(_mm512_shuffle_ps(c4[2 * t], c4[2 * t + 1], 0x44),
                         _mm512_shuffle_ps(c4[2 * t], c4[2 * t + 1], 0xEE));
  // + i+1: element 4L + m holds key L + 4m
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88),
                                 _mm512_shuffle_ps(d[0], d[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

// One query row's softmax over K keys: C = D / 16 chunks of 16 lanes. `mask` is the row's mask
// (stride `mstride` per key) or null; `scores` (at least K + 16 floats) receives p[j] =
// exp(s[j] - max s), 0 where masked, and `packed` is scratch of the same size. Returns
// 1 / sum_j p[j], or 0 for a row whose every key is masked (a zero row, never reached by the
// engine's masks: its p are all 0, so its value sum stays 0).
template <typename T, int C>
ATTN_TARGET float softmax_row(const T* q, const T* k, int64_t k_stride, const bool* mask,
                              int64_t mstride, int64_t K, float scale, float* scores,
                              float* packed) {
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = load16(q + 16 * c);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float top = neg_inf;
  int64_t j0 = 0;
  if (mask == nullptr && C <= 8) {  // 16 keys at a time (C = 16 would spill the accumulators)
    __m512 top16 = _mm512_set1_ps(neg_inf);
    for (; j0 + 16 <= K; j0 += 16) {
      const __m512 s16 = _mm512_mul_ps(dot16<T, C>(qv, k + j0 * k_stride, k_stride),
                                       _mm512_set1_ps(scale));
      _mm512_storeu_ps(scores + j0, s16);
      top16 = _mm512_max_ps(top16, s16);
    }
    top = _mm512_reduce_max_ps(top16);
  }
  for (int64_t j = j0; j < K; ++j) {
    if (mask != nullptr && !mask[j * mstride]) {
      scores[j] = neg_inf;
      continue;
    }
    const T* kj = k + j * k_stride;
    __m512 acc = _mm512_mul_ps(qv[0], load16(kj));
    for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[c], load16(kj + 16 * c), acc);
    const float s = _mm512_reduce_add_ps(acc) * scale;
    scores[j] = s;
    top = std::max(top, s);
  }
  if (top == neg_inf) {
    std::fill(scores, scores + K, 0.0f);
    return 0.0f;
  }
  const __m512 top_v = _mm512_set1_ps(top);
  __m512 total_v = _mm512_setzero_ps();
  for (int64_t j = 0; j < K; j += 16) {
    const __mmask16 lanes = K - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - j)) - 1);
    const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), lanes, scores + j);
    const __m512 p = exp_nonpositive(_mm512_sub_ps(s, top_v));
    _mm512_mask_storeu_ps(scores + j, lanes, p);
    if (mask == nullptr) total_v = _mm512_add_ps(total_v, p);
  }
  if (mask != nullptr) {
    // The sum over the attended keys alone, packed in their order: lane i adds the
    // attended keys numbered i mod 16 wherever they sit, so a draft-tree node, whose ancestors
    // sit among masked siblings, sums exactly as a one-token step over the same keys packed at
    // the front of the cache (which is where the accepted path's entries are moved).
    int64_t n = 0;
    for (int64_t j = 0; j < K; ++j)
      if (mask[j * mstride]) packed[n++] = scores[j];
    total_v = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 lanes = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
      total_v = _mm512_add_ps(total_v, _mm512_maskz_loadu_ps(lanes, packed + i));
    }
  }
  return 1.0f / _mm512_reduce_add_ps(total_v);
}

// The value sums of NQ query rows over the same K keys (the query heads of one KV head, same
// token): out[i] = sum_j p_i[j] v[j] * inv_total[i]. Each row's sum runs over its keys in order,
// skipping its zero p, exactly as it would alone: sharing only saves the loads of v and lets
// the rows' independent FMA chains overlap.
template <typename T, int C, int NQ>
ATTN_TARGET void value_rows(const float* const* p, const float* inv_total, const T* v,
                            int64_t v_stride, int64_t K, T* const* out) {
  __m512 acc[NQ][C];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K; ++j) {
    const T* vj = v + j * v_stride;
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(vj + 16 * c);
    for (int i = 0; i < NQ; ++i) {
      if (p[i][j] == 0.0f) continue;  // masked (or underflowed): adds nothing
      const __m512 pj = _mm512_set1_ps(p[i][j]);
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_fmadd_ps(pj, vv[c], acc[i][c]);
    }
  }
  for (int i = 0; i < NQ; ++i) {
    alignas(64) float row[16 * C];
    for (int c = 0; c < C; ++c)
      _mm512_store_ps(row + 16 * c, _mm512_mul_ps(acc[i][c], _mm512_set1_ps(inv_total[i])));
    for (int d = 0; d < 16 * C; ++d) out[i][d] = static_cast<T>(row[d]);  // bf16: nearest
  }
}

// n when a row's mask attends exactly keys 0..n-1 (a causal prefill's rows, a padded batch's
// steps), else -1. Such a row is computed unmasked over its first n keys: the same scores, the
// same exp-sum (attended keys packed in order are then the keys themselves) and the same value
// sum, bit for bit, without visiting the masked tail.
int64_t prefix_keys(const bool* mask, int64_t stride, int64_t K) {
  int64_t n = 0;
  while (n < K && mask[n * stride]) ++n;
  for (int64_t j = n; j < K; ++j)
    if (mask[j * stride]) return -1;
  return n;
}

template <typename T, int C>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const c10::optional<at::Tensor>& mask, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), Hkv = k.size(1), K = k.size(2);
  const int64_t G = H / Hkv;
  const Strides qs = strides_of(q), ks = strides_of(k), vs = strides_of(v);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();  // (B, T, H, D) contiguous
  const bool* mp = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  int64_t mb = 0, mt = 0, mj = 0;
  if (mp != nullptr) mb = mask->stride(0), mt = mask->stride(2), mj = mask->stride(3);
  // Tasks are (row, KV head, token): the G query heads of a KV head see the same keys and mask,
  // so their value sums share the loads of v (value_rows).
  const int64_t groups = B * Hkv * T_;
  const int64_t grain = std::max<int64_t>(1, kTaskKeys / std::max<int64_t>(K * G, 1));
  constexpr int NQ = C <= 8 ? 2 : 1;  // rows per value pass: 2 x C accumulators in registers
  at::parallel_for(0, groups, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> scores(G * (K + 16)), packed(K + 16), inv(G);
    std::vector<T*> outs(G);
    std::vector<const float*> ps(G);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (Hkv * T_), g = (r / T_) % Hkv, t = r % T_;
      const bool* row_mask = mp == nullptr ? nullptr : mp + b * mb + t * mt;
      const int64_t keys = row_mask == nullptr ? K : prefix_keys(row_mask, mj, K);
      if (keys >= 0) row_mask = nullptr;  // a prefix of the keys: the same sums, unmasked
      const int64_t n = keys >= 0 ? keys : K;
      const T* kg = kp + b * ks.b + g * ks.h;
      for (int64_t i = 0; i < G; ++i) {
        const int64_t h = g * G + i;
        float* sc = scores.data() + i * (K + 16);
        inv[i] = softmax_row<T, C>(qp + b * qs.b + h * qs.h + t * qs.r, kg, ks.r, row_mask, mj,
                                   n, static_cast<float>(scale), sc, packed.data());
        ps[i] = sc;
        outs[i] = op + ((b * T_ + t) * H + h) * 16 * C;
      }
      const T* vg = vp + b * vs.b + g * vs.h;
      int64_t i = 0;
      for (; i + NQ <= G; i += NQ)
        value_rows<T, C, NQ>(ps.data() + i, inv.data() + i, vg, vs.r, n, outs.data() + i);
      for (; i < G; ++i)
        value_rows<T, C, 1>(ps.data() + i, inv.data() + i, vg, vs.r, n, outs.data() + i);
    }
  });
}

template <typename T>
void dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const c10::optional<at::Tensor>& mask, double scale, at::Tensor& out) {
  switch (q.size(3) / 16) {
    case 2: return run<T, 2>(q, k, v, mask, scale, out);
    case 4: return run<T, 4>(q, k, v, mask, scale, out);
    case 5: return run<T, 5>(q, k, v, mask, scale, out);
    case 6: return run<T, 6>(q, k, v, mask, scale, out);
    case 8: return run<T, 8>(q, k, v, mask, scale, out);
    case 16: return run<T, 16>(q, k, v, mask, scale, out);
    default: TORCH_CHECK(false, "eaglespec attention: head dim ", q.size(3), " not supported");
  }
}

at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.stride(-1) == 1 ? t : t.contiguous();
}

}  // namespace

// q (B, H, T, D); k, v (B, Hkv, K, D); mask (B, 1, T, K) bool or None -> (B, H, T, D), a view
// of a (B, T, H, D) contiguous tensor (what the caller's transpose and reshape want).
at::Tensor attention_attend(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4, "q, k, v must be 4-D");
  TORCH_CHECK(q_in.scalar_type() == k_in.scalar_type() && k_in.scalar_type() == v_in.scalar_type(),
              "q, k, v must share a dtype");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16,
              "eaglespec attention takes fp32 or bf16");
  const int64_t B = q_in.size(0), H = q_in.size(1), T_ = q_in.size(2), D = q_in.size(3);
  TORCH_CHECK(k_in.size(0) == B && v_in.sizes() == k_in.sizes() && k_in.size(3) == D,
              "k, v must be (B, Hkv, K, D) like q's B and D");
  TORCH_CHECK(H % k_in.size(1) == 0, "query heads must be a multiple of KV heads");
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && mask->size(0) == B &&
                    mask->size(1) == 1 && mask->size(2) == T_ && mask->size(3) == k_in.size(2),
                "mask must be (B, 1, T, K) bool");
  }
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
                   v = last_dim_contiguous(v_in);
  at::Tensor out = at::empty({B, T_, H, D}, q.options());
  if (q.scalar_type() == at::kBFloat16)
    dispatch<at::BFloat16>(q, k, v, mask, scale, out);
  else
    dispatch<float>(q, k, v, mask, scale, out);
  return out.permute({0, 2, 1, 3});
}

bool attention_supported() { return cpu_supported(); }

TORCH_LIBRARY(eaglespec_attention, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("supported() -> bool");
}

TORCH_LIBRARY_IMPL(eaglespec_attention, CPU, m) { m.impl("attend", &attention_attend); }

TORCH_LIBRARY_IMPL(eaglespec_attention, CompositeExplicitAutograd, m) {
  m.impl("supported", &attention_supported);
}
