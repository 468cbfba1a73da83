// Attention of query tokens onto a KV cache, on x86 CPUs with AVX-512 or AVX2 (the AVX2 path below
// gives the same bits): the decode, verification and (with their causal mask) eager prefill
// attention of eaglespec (eaglespec/model/cpu_attention.py has the why and the measurements).
//
// out[b, h, t] = sum_j p[j] v[b, h / G, j] / sum_j p[j],   p[j] = exp(s[j] - max_j s[j]),
// s[j] = (q[b, h, t] . k[b, h / G, j]) * scale where mask[b, t, j] (all j without a mask),
// G = H / Hkv query heads per KV head. Scores, softmax and sums in fp32; q, k, v, out fp32 or bf16.
//
// Every query row (b, h, t) is computed alone, in its own order, through the same instructions
// whatever T, B, the rows it shares reads with and the split among threads are, so a row of a
// T-token verification is bitwise the same row computed in a one-token step over the same keys.
// Masked keys change nothing either: a row's sums run over its attended keys in order, so a
// key's slot does not matter.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"  // the kernels called from C++ (layer.cpp)
#include "team.h"     // parallel_for: through the forward's team where one runs (layer.cpp)

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTaskKeys = 512;  // (query row, key) pairs a task takes at least

#define ATTN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

bool avx512_supported() {
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

#define EAGLESPEC_SIMD_TARGET ATTN_TARGET
#include "simd_exp.h"
#include "simd16_avx2.h"

// AVX-512, or AVX2 with FMA and F16C (x86-64-v3): the AVX2 path, the same bits.
bool cpu_supported() { return avx512_supported() || avx2::supported(); }

// Whether the kernel takes its AVX2 path: where AVX-512 is missing, or where `use_avx2(true)`
// asked for it (tests compare the two paths bit for bit).
std::atomic<bool> avx2_wanted{false};
bool avx2_on() { return !avx512_supported() || avx2_wanted.load(std::memory_order_relaxed); }

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

// One key's score, unscaled q . k times `scale`: the per-key form of dot16's scores (the same
// bits: _mm512_reduce_add_ps is the tree dot16 runs on 16 keys at once).
template <typename T, int C>
ATTN_TARGET inline float score_key(const __m512 (&qv)[C], const T* kj, float scale) {
  __m512 acc = _mm512_mul_ps(qv[0], load16(kj));
  for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[c], load16(kj + 16 * c), acc);
  return _mm512_reduce_add_ps(acc) * scale;
}

// The softmax's second half over a row's K scores, whose largest is `top` (-inf: every key
// masked): scores[j] <- p[j] = exp(s[j] - top), 0 where masked; returns 1 / sum_j p[j], or 0 for
// a row whose every key is masked (a zero row, never reached by the engine's masks: its p are
// all 0, so its value sum stays 0). `mask` as softmax_row's; `packed` is scratch of K + 16.
ATTN_TARGET float exp_normalize(float* scores, int64_t K, float top, const bool* mask,
                                int64_t mstride, float* packed) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
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

// One query row's softmax over K keys: C = D / 16 chunks of 16 lanes. `mask` is the row's mask
// (stride `mstride` per key) or null; `scores` (at least K + 16 floats) receives p[j] =
// exp(s[j] - max s), 0 where masked, and `packed` is scratch of the same size. Returns
// exp_normalize's 1 / sum_j p[j]. Unmasked rows with C <= 8 go through score_rows instead
// (the same bits, the keys' conversion shared with the other rows of their KV head).
template <typename T, int C>
ATTN_TARGET float softmax_row(const T* q, const T* k, int64_t k_stride, const bool* mask,
                              int64_t mstride, int64_t K, float scale, float* scores,
                              float* packed) {
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = load16(q + 16 * c);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float top = neg_inf;
  for (int64_t j = 0; j < K; ++j) {
    if (mask != nullptr && !mask[j * mstride]) {
      scores[j] = neg_inf;
      continue;
    }
    const float s = score_key<T, C>(qv, k + j * k_stride, scale);
    scores[j] = s;
    top = std::max(top, s);
  }
  return exp_normalize(scores, K, top, mask, mstride, packed);
}

constexpr int kShareRows = 8;  // query rows of one KV head that share a pass over its keys

// The softmaxes of R <= kShareRows unmasked query rows of one KV head, row i over its first
// n[i] keys: each row's full blocks of 16 keys scored 16 at a time (dot16), its last n[i] mod 16
// keys one at a time, then exp_normalize; scores[i] (at least max n + 16 floats) as
// softmax_row's. A block's keys are widened to fp32 once (into `kb`, 16 x 16C floats, which
// stays in L1) for every row that reads it: bf16 -> fp32 is exact, so each row's products and
// sums are the ones it would compute alone. Returns each row's 1 / sum in inv[i].
template <typename T, int C>
ATTN_TARGET void score_rows(const T* const* q, const T* k, int64_t k_stride, const int64_t* n,
                            int R, float scale, float* const* scores, float* inv, float* kb,
                            float* packed) {
  static_assert(C <= 8, "dot16 keeps 16 accumulators and C query vectors in registers");
  const float neg_inf = -std::numeric_limits<float>::infinity();
  alignas(64) float top16[kShareRows][16];
  int64_t nmax = 0;
  for (int i = 0; i < R; ++i) {
    nmax = std::max(nmax, n[i]);
    _mm512_store_ps(top16[i], _mm512_set1_ps(neg_inf));
  }
  for (int64_t j0 = 0; j0 + 16 <= nmax; j0 += 16) {
    const float* kf;
    int64_t kf_stride;
    if constexpr (std::is_same_v<T, float>) {
      kf = k + j0 * k_stride, kf_stride = k_stride;
    } else {
      for (int j = 0; j < 16; ++j)
        for (int c = 0; c < C; ++c)
          _mm512_store_ps(kb + (j * C + c) * 16, load16(k + (j0 + j) * k_stride + 16 * c));
      kf = kb, kf_stride = 16 * C;
    }
    for (int i = 0; i < R; ++i) {
      if (j0 + 16 > n[i]) continue;
      __m512 qv[C];
      for (int c = 0; c < C; ++c) qv[c] = load16(q[i] + 16 * c);
      const __m512 s16 =
          _mm512_mul_ps(dot16<float, C>(qv, kf, kf_stride), _mm512_set1_ps(scale));
      _mm512_storeu_ps(scores[i] + j0, s16);
      _mm512_store_ps(top16[i], _mm512_max_ps(_mm512_load_ps(top16[i]), s16));
    }
  }
  for (int i = 0; i < R; ++i) {
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = load16(q[i] + 16 * c);
    float top = _mm512_reduce_max_ps(_mm512_load_ps(top16[i]));
    for (int64_t j = n[i] / 16 * 16; j < n[i]; ++j) {
      const float s = score_key<T, C>(qv, k + j * k_stride, scale);
      scores[i][j] = s;
      top = std::max(top, s);
    }
    inv[i] = exp_normalize(scores[i], n[i], top, nullptr, 0, packed);
  }
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
  if (stride == 1) {  // a causal prefill's rows: memchr's and a vectorised OR's speed
    const void* end = std::memchr(mask, 0, K);  // a bool tensor holds bytes 0 and 1
    const int64_t n = end == nullptr ? K : static_cast<const bool*>(end) - mask;
    const auto* bytes = reinterpret_cast<const uint8_t*>(mask);
    uint8_t any = 0;
    for (int64_t j = n; j < K; ++j) any |= bytes[j];
    return any ? -1 : n;
  }
  int64_t n = 0;
  while (n < K && mask[n * stride]) ++n;
  for (int64_t j = n; j < K; ++j)
    if (mask[j * stride]) return -1;
  return n;
}

// The value sums of R rows sharing v (up to the widest pass C's registers hold), in passes of
// NQ rows: p[i] must be 0 past row i's keys up to K, which skips them as the row alone would.
template <typename T, int C>
void value_passes(const float* const* p, const float* inv_total, const T* v, int64_t v_stride,
                  int64_t K, T* const* out, int R) {
  constexpr int kWidest = C <= 4 ? 4 : C <= 6 ? 3 : C <= 8 ? 2 : 1;  // NQ x C + C registers
  int i = 0;
  for (; i + kWidest <= R; i += kWidest)
    value_rows<T, C, kWidest>(p + i, inv_total + i, v, v_stride, K, out + i);
  if constexpr (kWidest > 3)
    if (R - i == 3) return value_rows<T, C, 3>(p + i, inv_total + i, v, v_stride, K, out + i);
  if constexpr (kWidest > 2)
    if (R - i == 2) return value_rows<T, C, 2>(p + i, inv_total + i, v, v_stride, K, out + i);
  for (; i < R; ++i) value_rows<T, C, 1>(p + i, inv_total + i, v, v_stride, K, out + i);
}

// ---- The AVX2 path (x86-64-v3), on simd16_avx2.h's 16 lanes. A key's score is score_key's
// (dot16's bits: the same products, summed in _mm512_reduce_add_ps's order), the softmax
// exp_normalize's and the value sum value_rows', lane for lane, so every row gets the AVX-512
// path's bits (tests/test_cpu_attention.py compares the two where both run). Rows of a KV head
// share the widening of its keys and values from kShareFrom rows up (rows_avx2); fewer rows, and
// a tree's masked rows, go alone (row_avx2).

template <typename T, int C>
EAGLESPEC_AVX2_TARGET float score_key_avx2(const avx2::F16 (&qv)[C], const T* kj,
                                           float scale) {
  avx2::F16 acc = avx2::mul(qv[0], avx2::load(kj));
  for (int c = 1; c < C; ++c) acc = avx2::fmadd(qv[c], avx2::load(kj + 16 * c), acc);
  return avx2::reduce_add(acc) * scale;
}

// The scores of 8 consecutive keys (`k` at `k_stride`), score_key_avx2's bits for each: every
// key's products and FMA chains as there, then avx2::reduce_add's tree (lanes i + i+8, + i+4,
// + i+2, + i+1) run on the 8 keys at once, three shuffle-and-add levels of 256-bit vectors (a
// key's tree alone ends in 128-bit and scalar adds, the same additions), then the scale. Pairs
// (j, j+4) share a vector from the second level on, so the sums land in key order. Measured
// (benchmarks/attention_ab.py, session 61): attention over 2-8 rows and 512-2,048 keys
// 0.85-0.96x the time of scoring key by key, a prefill's 0.74-0.91x.
template <typename T, int C>
EAGLESPEC_AVX2_TARGET inline __attribute__((always_inline)) __m256 score8_avx2(
    const avx2::F16 (&qv)[C], const T* k, int64_t k_stride, float scale) {
  __m256 t[8];  // key j's lanes i + i+8
  for (int j = 0; j < 8; ++j) {
    const T* kj = k + j * k_stride;
    avx2::F16 acc = avx2::mul(qv[0], avx2::load(kj));
    for (int c = 1; c < C; ++c) acc = avx2::fmadd(qv[c], avx2::load(kj + 16 * c), acc);
    t[j] = _mm256_add_ps(acc.hi, acc.lo);
  }
  __m256 p[4];  // + i+4: key j's 4 sums in the low 128 bits, key j+4's in the high
  for (int j = 0; j < 4; ++j)
    p[j] = _mm256_add_ps(_mm256_permute2f128_ps(t[j], t[j + 4], 0x31),
                         _mm256_permute2f128_ps(t[j], t[j + 4], 0x20));
  __m256 q[2];  // + i+2: per 128 bits, keys 2r's and 2r+1's two sums (r = 0, 1; +4 above)
  for (int r = 0; r < 2; ++r)
    q[r] = _mm256_add_ps(_mm256_shuffle_ps(p[2 * r], p[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(p[2 * r], p[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + i+1: keys 0-3 in the low 128 bits, 4-7 in the high
  const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_mul_ps(e, _mm256_set1_ps(scale));
}

// The larger of `top` and the 8 lanes of `top8` (a running max kept in a vector: a max in any
// order is the same max).
EAGLESPEC_AVX2_TARGET inline float max_with_lanes(float top, __m256 top8) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  for (float x : lanes) top = std::max(top, x);
  return top;
}

// exp_normalize on AVX2.
EAGLESPEC_AVX2_TARGET float exp_normalize_avx2(float* scores, int64_t K, float top,
                                               const bool* mask, int64_t mstride, float* packed) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (top == neg_inf) {
    std::fill(scores, scores + K, 0.0f);
    return 0.0f;
  }
  const avx2::F16 top_v = avx2::set1(top);
  avx2::F16 total_v = avx2::zero();
  for (int64_t j = 0; j < K; j += 16) {
    const avx2::F16 s = avx2::load_n(scores + j, K - j, neg_inf);
    const avx2::F16 p = avx2::exp_nonpositive(avx2::sub(s, top_v));
    avx2::store_n(scores + j, p, K - j);
    if (mask == nullptr) total_v = avx2::add(total_v, p);
  }
  if (mask != nullptr) {  // the attended keys packed in order, as exp_normalize
    int64_t n = 0;
    for (int64_t j = 0; j < K; ++j)
      if (mask[j * mstride]) packed[n++] = scores[j];
    total_v = avx2::zero();
    for (int64_t i = 0; i < n; i += 16)
      total_v = avx2::add(total_v, avx2::load_n(packed + i, n - i));
  }
  return 1.0f / avx2::reduce_add(total_v);
}

// A row's value sums times 1 / its exp-sum, rounded once to T (bf16: nearest), as value_rows.
template <typename T, int C>
EAGLESPEC_AVX2_TARGET void store_out_avx2(const avx2::F16 (&acc)[C], float inv, T* out) {
  alignas(32) float row[16 * C];
  for (int c = 0; c < C; ++c) avx2::store(row + 16 * c, avx2::mul(acc[c], avx2::set1(inv)));
  for (int d = 0; d < 16 * C; ++d) out[d] = static_cast<T>(row[d]);
}

// A bf16 row's value sums, out = sum_j p[j] v[j] * inv rounded to bf16: value_rows' bits with
// half its widening. Each 16 values of v are widened with one shift and one AND (the even
// dimensions, then the odd) instead of two loads, two zero-extensions and two shifts, summed
// lane by lane over the keys in order as before, and put back in order once at the end: every
// dimension's sum is the same chain of FMAs. Measured (benchmarks/attention_ab.py, session 61,
// against the kernel before score8_avx2): a one-token step's attention over 512-2,048 keys
// 0.83-0.84x the time with this and score8_avx2, 0.87-0.95x with score8_avx2 alone.
template <int C>
EAGLESPEC_AVX2_TARGET void value_bf16_avx2(const float* p, const at::BFloat16* v,
                                           int64_t v_stride, int64_t K, float inv,
                                           at::BFloat16* out) {
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 ev[C], od[C];  // chunk c's dimensions 16c + 2i and 16c + 2i + 1 in lane i
  for (int c = 0; c < C; ++c) ev[c] = od[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < K; ++j) {
    if (p[j] == 0.0f) continue;  // masked (or underflowed): adds nothing, as value_rows
    const __m256 pj = _mm256_set1_ps(p[j]);
    const auto* vj = reinterpret_cast<const __m256i*>(v + j * v_stride);
    for (int c = 0; c < C; ++c) {
      const __m256i x = _mm256_loadu_si256(vj + c);
      ev[c] = _mm256_fmadd_ps(pj, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), ev[c]);
      od[c] = _mm256_fmadd_ps(pj, _mm256_castsi256_ps(_mm256_and_si256(x, odd)), od[c]);
    }
  }
  avx2::F16 acc[C];
  for (int c = 0; c < C; ++c) {  // lanes back in order: dimensions 0-7, then 8-15
    const __m256 lo = _mm256_unpacklo_ps(ev[c], od[c]), hi = _mm256_unpackhi_ps(ev[c], od[c]);
    acc[c] = {_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)};
  }
  store_out_avx2<at::BFloat16, C>(acc, inv, out);
}

// One query row over its first K keys (`mask`: the row's, or null), out = its attention.
template <typename T, int C>
EAGLESPEC_AVX2_TARGET void row_avx2(const T* q, const T* k, int64_t k_stride, const T* v,
                                    int64_t v_stride, const bool* mask, int64_t mstride, int64_t K,
                                    float scale, float* scores, float* packed, T* out) {
  avx2::F16 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = avx2::load(q + 16 * c);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float top = neg_inf;
  int64_t j = 0;
  __m256 top8 = _mm256_set1_ps(neg_inf);
  for (; j + 8 <= K; j += 8) {
    const __m256 s = score8_avx2<T, C>(qv, k + j * k_stride, k_stride, scale);
    _mm256_storeu_ps(scores + j, s);
    if (mask == nullptr) {
      top8 = _mm256_max_ps(top8, s);
      continue;
    }
    for (int64_t i = j; i < j + 8; ++i) {  // masked keys were scored too: dropped
      if (!mask[i * mstride])
        scores[i] = neg_inf;
      else
        top = std::max(top, scores[i]);
    }
  }
  top = max_with_lanes(top, top8);
  for (; j < K; ++j) {
    if (mask != nullptr && !mask[j * mstride]) {
      scores[j] = neg_inf;
      continue;
    }
    const float s = score_key_avx2<T, C>(qv, k + j * k_stride, scale);
    scores[j] = s;
    top = std::max(top, s);
  }
  const float inv = exp_normalize_avx2(scores, K, top, mask, mstride, packed);
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    value_bf16_avx2<C>(scores, v, v_stride, K, inv, out);
    return;
  }
  avx2::F16 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = avx2::zero();
  for (int64_t j = 0; j < K; ++j) {
    if (scores[j] == 0.0f) continue;  // masked (or underflowed): adds nothing, as value_rows
    const avx2::F16 pj = avx2::set1(scores[j]);
    const T* vj = v + j * v_stride;
    for (int c = 0; c < C; ++c) acc[c] = avx2::fmadd(pj, avx2::load(vj + 16 * c), acc[c]);
  }
  store_out_avx2<T, C>(acc, inv, out);
}

// The fewest rows that share a widening on AVX2 (`python benchmarks/attention_ab.py`, 2026-11-28,
// AMD EPYC Zen 3, SmolLM2's 9/3 heads: 3 rows of a KV head 1.10-1.17x slower through it than
// alone, 6-8 rows 0.83-0.90x, a prefill 0.86-0.92x).
constexpr int kShareFrom = 4;

// Keys or values j0 .. j0 + nb - 1 (nb <= 16) of a KV head widened from T to fp32 into kb (16C
// floats a key, in L1; exact).
template <typename T, int C>
EAGLESPEC_AVX2_TARGET void widen_block(const T* src, int64_t stride, int64_t j0, int64_t nb,
                                       float* kb) {
  for (int64_t j = 0; j < nb; ++j)
    for (int c = 0; c < C; ++c)
      avx2::store(kb + (j * C + c) * 16, avx2::load(src + (j0 + j) * stride + 16 * c));
}

// Up to kShareRows unmasked query rows of one KV head, row i over its first n[i] keys (a causal
// prefill's rows, a verification's, a step's query heads): each block of 16 keys, then of their
// values, widened once for all of them (widen_block into kb), then every row scored, normalised
// and summed exactly as row_avx2 would: the same products in the same order. Rows' value sums
// live in `acc` (R x 16C floats) between blocks. `scores` as score_rows' (row i at scores[i],
// max n + 16 floats each).
template <typename T, int C>
EAGLESPEC_AVX2_TARGET void rows_avx2(const T* const* q, const T* k, int64_t k_stride, const T* v,
                                     int64_t v_stride, const int64_t* n, int R, float scale,
                                     float* const* scores, float* packed, float* kb, float* acc,
                                     T* const* out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t nmax = 0;
  float top[kShareRows], inv[kShareRows];
  for (int i = 0; i < R; ++i) nmax = std::max(nmax, n[i]), top[i] = neg_inf;
  for (int64_t j0 = 0; j0 < nmax; j0 += 16) {
    const int64_t nb = std::min<int64_t>(16, nmax - j0);
    widen_block<T, C>(k, k_stride, j0, nb, kb);
    for (int i = 0; i < R; ++i) {
      avx2::F16 qv[C];
      for (int c = 0; c < C; ++c) qv[c] = avx2::load(q[i] + 16 * c);
      const int64_t here = std::min(nb, n[i] - j0);
      int64_t j = 0;
      __m256 top8 = _mm256_set1_ps(top[i]);
      for (; j + 8 <= here; j += 8) {
        const __m256 s = score8_avx2<float, C>(qv, kb + j * C * 16, C * 16, scale);
        _mm256_storeu_ps(scores[i] + j0 + j, s);
        top8 = _mm256_max_ps(top8, s);
      }
      top[i] = max_with_lanes(top[i], top8);
      for (; j < here; ++j) {
        const float s = score_key_avx2<float, C>(qv, kb + j * C * 16, scale);
        scores[i][j0 + j] = s;
        top[i] = std::max(top[i], s);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    inv[i] = exp_normalize_avx2(scores[i], n[i], top[i], nullptr, 0, packed);
    for (int c = 0; c < C; ++c) avx2::store(acc + (i * C + c) * 16, avx2::zero());
  }
  for (int64_t j0 = 0; j0 < nmax; j0 += 16) {
    const int64_t nb = std::min<int64_t>(16, nmax - j0);
    widen_block<T, C>(v, v_stride, j0, nb, kb);
    for (int i = 0; i < R; ++i) {
      const int64_t here = std::min(nb, n[i] - j0);
      if (here <= 0) continue;
      avx2::F16 a[C];
      for (int c = 0; c < C; ++c) a[c] = avx2::load(acc + (i * C + c) * 16);
      for (int64_t j = 0; j < here; ++j) {
        const float p = scores[i][j0 + j];
        if (p == 0.0f) continue;  // underflowed: adds nothing, as value_rows
        const avx2::F16 pj = avx2::set1(p);
        for (int c = 0; c < C; ++c) a[c] = avx2::fmadd(pj, avx2::load(kb + (j * C + c) * 16), a[c]);
      }
      for (int c = 0; c < C; ++c) avx2::store(acc + (i * C + c) * 16, a[c]);
    }
  }
  for (int i = 0; i < R; ++i) {
    avx2::F16 a[C];
    for (int c = 0; c < C; ++c) a[c] = avx2::load(acc + (i * C + c) * 16);
    store_out_avx2<T, C>(a, inv[i], out[i]);
  }
}
// ---- end of the AVX2 path

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
  // The query rows are split among the threads as one range of (row, KV head, token, query
  // head): a thread's rows of one KV head, up to kShareRows at a time, share the reads of its
  // keys (score_rows) and values (value_passes), and the split is even to a row (SmolLM2's
  // one-token step: 5 rows against 4, where whole KV heads were 6 against 3). A row's
  // arithmetic is the same in any group and on any thread.
  const int64_t per_head = T_ * G, rows = B * Hkv * per_head;
  const int64_t grain = std::max<int64_t>(1, kTaskKeys / std::max<int64_t>(K, 1));
  const float sc = static_cast<float>(scale);
  // Row r (of KV head g of batch row b): its query, its output, its mask row (null without a
  // mask) and how many leading keys it attends (-1: not a prefix, a tree's mask).
  struct RowAt {
    const T* q;
    T* out;
    const bool* mask;
    int64_t keys;
  };
  // The keys each mask row (b, t) attends as a prefix (prefix_keys), found once for the query
  // heads that share it: a 1,024-token prefill scanned each row's mask once per query head,
  // byte by byte, 5% of its time (session 61).
  std::vector<int64_t> prefix;
  if (mp != nullptr) {
    prefix.resize(B * T_);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T_; ++t)
        prefix[b * T_ + t] = prefix_keys(mp + b * mb + t * mt, mj, K);
  }
  auto row_at = [&](int64_t r, int64_t b, int64_t g) -> RowAt {
    const int64_t t = (r % per_head) / G, h = g * G + (r % per_head) % G;
    const bool* row_mask = mp == nullptr ? nullptr : mp + b * mb + t * mt;
    return {qp + b * qs.b + h * qs.h + t * qs.r, op + ((b * T_ + t) * H + h) * 16 * C, row_mask,
            row_mask == nullptr ? K : prefix[b * T_ + t]};
  };
  if (avx2_on()) {  // unmasked rows of a KV head up to kShareRows at a time share the keys'
                    // widening (rows_avx2), a tree's rows alone (row_avx2)
    // The threads take whole groups of a KV head's rows: its rows in the fewest groups of at
    // most kShareRows, of near-equal size (at least kShareFrom each where the head has that
    // many), so a group shares its widening whichever thread takes it. A split by rows had the
    // forward's team (team.h) take them in pieces of an eighth of a thread's share, which cut a
    // 6-token verification's groups of SmolLM2 to 3 rows, each then run alone (measured, session
    // 58, 768 keys: row_avx2 24% of the forward's time, rows_avx2 3%). A head of fewer rows
    // than kShareFrom (a one-token step's 3 query heads), whose rows run alone, is split by rows.
    const int64_t groups =
        per_head < kShareFrom ? per_head : (per_head + kShareRows - 1) / kShareRows;
    const int64_t units = B * Hkv * groups;
    const int64_t unit_grain =
        std::max<int64_t>(1, kTaskKeys / std::max<int64_t>(K * (per_head / groups), 1));
    team::parallel_for(0, units, unit_grain, [&](int64_t u0, int64_t u1) {
      std::vector<float> scores(kShareRows * (K + 16)), packed(K + 16);
      std::vector<float> kb(16 * 16 * C), acc(kShareRows * 16 * C);
      const T* qrow[kShareRows];
      T* orow[kShareRows];
      float* prow[kShareRows];
      int64_t n[kShareRows];
      for (int64_t u = u0; u < u1; ++u) {
        // A head's groups taken first, last, second, second to last ...: a causal prefill's
        // later rows attend more keys, and a static split of the groups in order gave one of two
        // threads 1.4x the other's keys (the other then waited, 11% of a 1,024-token prefill's
        // attention, session 61). Which rows make a group is the same either way.
        const int64_t head = u / groups, z = u % groups, b = head / Hkv, g = head % Hkv;
        const int64_t i = z % 2 == 0 ? z / 2 : groups - 1 - z / 2;
        const int64_t s0 = head * per_head + i * per_head / groups;
        const int64_t s1 = head * per_head + (i + 1) * per_head / groups;
        const T* kg = kp + b * ks.b + g * ks.h;
        const T* vg = vp + b * vs.b + g * vs.h;
        int R = 0;
        for (int64_t r = s0; r < s1; ++r) {
          const RowAt row = row_at(r, b, g);
          if (row.keys < 0) {  // a tree's mask: alone
            row_avx2<T, C>(row.q, kg, ks.r, vg, vs.r, row.mask, mj, K, sc, scores.data(),
                           packed.data(), row.out);
            continue;
          }
          qrow[R] = row.q, orow[R] = row.out, n[R] = row.keys;
          prow[R] = scores.data() + R * (K + 16);
          ++R;
        }
        if (R >= kShareFrom)
          rows_avx2<T, C>(qrow, kg, ks.r, vg, vs.r, n, R, sc, prow, packed.data(), kb.data(),
                          acc.data(), orow);
        else  // too few to pay for the widening's stores (a one-token step's 3 query heads)
          for (int j = 0; j < R; ++j)
            row_avx2<T, C>(qrow[j], kg, ks.r, vg, vs.r, nullptr, 0, n[j], sc, scores.data(),
                           packed.data(), orow[j]);
      }
    });
    return;
  }
  team::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> scores((kShareRows + 1) * (K + 16)), packed(K + 16);  // + a lone row's
    alignas(64) float kb[16 * 16 * (C <= 8 ? C : 1)];  // a widened block of keys (score_rows)
    const T* qrow[kShareRows];
    T* orow[kShareRows];
    float* prow[kShareRows];
    float inv[kShareRows];
    int64_t n[kShareRows];
    for (int64_t s0 = r0; s0 < r1;) {
      const int64_t head = s0 / per_head;  // (b, g)
      const int64_t s1 = std::min({r1, (head + 1) * per_head, s0 + kShareRows});
      const int64_t b = head / Hkv, g = head % Hkv;
      const T* kg = kp + b * ks.b + g * ks.h;
      const T* vg = vp + b * vs.b + g * vs.h;
      int R = 0;
      int64_t nmax = 0;
      for (int64_t r = s0; r < s1; ++r) {
        const RowAt row = row_at(r, b, g);
        if (row.keys < 0 || C > 8) {  // a tree's mask, or a head too wide to share: alone
          const int64_t nk = row.keys < 0 ? K : row.keys;
          float* p = scores.data() + kShareRows * (K + 16);
          float one = softmax_row<T, C>(row.q, kg, ks.r, row.keys < 0 ? row.mask : nullptr, mj,
                                        nk, sc, p, packed.data());
          const float* pc = p;
          value_rows<T, C, 1>(&pc, &one, vg, vs.r, nk, &row.out);
          continue;
        }
        qrow[R] = row.q, orow[R] = row.out, n[R] = row.keys;
        prow[R] = scores.data() + R * (K + 16);
        nmax = std::max(nmax, row.keys);
        ++R;
      }
      if (R > 0) {
        if constexpr (C <= 8)
          score_rows<T, C>(qrow, kg, ks.r, n, R, sc, prow, inv, kb, packed.data());
        for (int i = 0; i < R; ++i) std::fill(prow[i] + n[i], prow[i] + nmax, 0.0f);
        value_passes<T, C>(prow, inv, vg, vs.r, nmax, orow, R);
      }
      s0 = s1;
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

void kernels::attend_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double scale, at::Tensor& out) {
  if (q.scalar_type() == at::kBFloat16)
    dispatch<at::BFloat16>(q, k, v, mask, scale, out);
  else
    dispatch<float>(q, k, v, mask, scale, out);
}

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

// Whether the kernel takes its AVX2 path from now on where AVX-512 would run (`force`); returns
// whether it does (always where AVX-512 is missing). The bits are the same either way.
bool attention_use_avx2(bool force) {
  avx2_wanted.store(force, std::memory_order_relaxed);
  return avx2_on();
}

TORCH_LIBRARY(eaglespec_attention, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("supported() -> bool");
  m.def("use_avx2(bool force) -> bool");
}

TORCH_LIBRARY_IMPL(eaglespec_attention, CPU, m) { m.impl("attend", &attention_attend); }

TORCH_LIBRARY_IMPL(eaglespec_attention, CompositeExplicitAutograd, m) {
  m.impl("supported", &attention_supported);
  m.impl("use_avx2", &attention_use_avx2);
}
