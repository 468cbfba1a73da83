// int4 and int8 weights x int8 activations on x86 CPUs with AVX-512 VNNI: the matmuls of
// `--quant w4a8` (eaglespec/model/w4a8.py has the formats, the math and the measurements).
// `linear` takes 4-bit weights (the decoder's), `linear8` 8-bit ones (the output head's, GGUF's
// Q8_0 blocks); both quantize the activations the same way (quantize_row).
//
// y[m, n] = sum_g s[n, g] * dx[m, g] * sum_{k in g} q[n, k] * xq[m, k]   (int32, vpdpbusd)
//         + sum_g mn[n, g] * xsum[m, g]
//
// q: 4-bit codes 0..15, s: fp16 scale, mn: fp16 minimum, per group g of 32 input features.
// xq: the activation row quantized per group to int8 (dx = absmax / 127), xsum: the group's sum of
// the unquantized activations. Every (m, n) goes through the same instructions whatever M and
// however the output rows are split among threads, so a row of a batch is bitwise the row alone.
//
// Weights, blocked: output rows in blocks of 4, each block one contiguous run of K/32 * 80 bytes,
// so a thread reads its share of a matrix as a single sequential stream. Inside a block, per
// window of h <= 16 groups (512 features; the last window of a row may be partial), 80h bytes:
//     codes of row r (r = 0..3) at 16h * r: 4 loads L of 4h bytes; in load L, byte b of lane i
//         (group i of the window) = q[8L + b] | q[8L + 4 + b] << 4 (features within the group)
//     scales at 64h: 4 rows x h fp16; minimums at 72h: 4 rows x h fp16
// So a load's low nibbles are features 8L..8L+3 and its high nibbles 8L+4..8L+7 of every group,
// one group per int32 lane, and a window's 8 such steps sum to the groups' dot products.
//
// linear8: y[m, n] = sum_g s[n, g] * dx[m, g] * sum_{k in g} q[n, k] * xq[m, k], q in -127..127
// (GGUF Q8_0: w = d * q per block of 32, d fp16). vpdpbusd multiplies unsigned by signed bytes,
// so the codes are stored as u = q + 128 (1..255) and the group's dot product is
// sum u * xq - 128 * sum xq, exact in int32 (|sum| < 32 * 255 * 127). Blocked like the 4-bit
// weights, 4 output rows a block, per window of h <= 16 groups, 136h bytes:
//     codes of row r at 32h * r: 8 steps t of 4h bytes; byte b of lane i = u[group i, 4t + b]
//     scales at 128h: 4 rows x h fp16
// so step t pairs with quantize_row's step t of the activations.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRows = 4;                          // output rows per weight block
constexpr int64_t kBlockBytesPerGroup = kRows * 20;   // per row: 16 B codes + 2 B scale + 2 B min
constexpr int64_t kBlockBytesPerGroup8 = kRows * 34;  // linear8, per row: 32 B codes + 2 B scale
constexpr int64_t kTaskWeights = int64_t{1} << 18;  // a second thread pays from about here (measured)

#define W4A8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// 16 bf16 values (the first `mask` of them) -> fp32 lanes; masked lanes are 0.
W4A8_TARGET inline __m512 load_bf16x16(const uint16_t* p, __mmask16 mask) {
  __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

// 16 fp16 values (the first `mask` of them) -> fp32 lanes; masked lanes are 0.
W4A8_TARGET inline __m512 load_f16x16(const uint16_t* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// 16 activations from fp32 or bf16 memory -> fp32 lanes.
W4A8_TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
W4A8_TARGET inline __m512 load16(const at::BFloat16* p) {
  return load_bf16x16(reinterpret_cast<const uint16_t*>(p), 0xFFFF);
}

// One activation row: K values -> per window of 16 groups (512 features), zero past the last
// group: xq (8 steps x 16 lanes x 4 int8, step t / lane i holding features 4t..4t+3 of the
// window's group i), dx (16 fp32 group scales absmax / 127), xsum (16 fp32 group sums) and
// qsum (16 int32 sums of the group's codes, for linear8).
template <typename T>
W4A8_TARGET void quantize_row(const T* x, int64_t K, int8_t* xq, float* dx, float* xsum,
                              int32_t* qsum) {
  const int64_t ng = K / kGroup;
  const int64_t nw = (ng + 15) / 16;
  const int64_t used = ng % 16;  // groups in a partial last window (0: none)
  if (used) {  // clear the lanes no group fills
    const int64_t w = nw - 1;
    for (int t = 0; t < 8; ++t)
      std::memset(xq + w * 512 + t * 64 + used * 4, 0, (16 - used) * 4);
    std::fill(dx + w * 16 + used, dx + w * 16 + 16, 0.0f);
    std::fill(xsum + w * 16 + used, xsum + w * 16 + 16, 0.0f);
    std::fill(qsum + w * 16 + used, qsum + w * 16 + 16, 0);
  }
  // dword t of a group's 32 codes goes to step t: 64 bytes = 16 dwords apart
  const __m256i steps = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
  for (int64_t g = 0; g < ng; ++g) {
    const __m512 a = load16(x + g * kGroup), b = load16(x + g * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 vinv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    // cvtps_epi32 rounds to nearest even; the saturating narrow keeps the codes in int8.
    const __m128i qa = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, vinv)));
    const __m128i qb = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, vinv)));
    const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1);
    const int64_t w = g / 16, i = g % 16;
    _mm256_i32scatter_epi32(xq + w * 512 + i * 4, steps, q, 4);
    dx[w * 16 + i] = amax / 127.0f;
    xsum[w * 16 + i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    qsum[w * 16 + i] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(qa)) +
                       _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(qb));
  }
}

// A window of up to 16 groups starting at group g0 of ng: its groups h (one per int32 lane),
// the lanes they fill and the bytes of a 4h-byte load.
struct Window {
  int64_t h;
  __mmask16 lanes;
  __mmask64 bytes;
};
inline Window window(int64_t ng, int64_t g0) {
  const int64_t h = std::min<int64_t>(16, ng - g0);
  return {h, static_cast<__mmask16>((1u << h) - 1u),
          h == 16 ? ~__mmask64{0} : ((__mmask64{1} << (4 * h)) - 1)};
}

inline void store(float* y, float v) { *y = v; }
inline void store(at::BFloat16* y, float v) { *y = at::BFloat16(v); }  // round to nearest even

// The 4 output rows of one weight block (blk, the layout above) against MB activation rows in
// quantize_row's layout (xq: nw * 512 bytes per row, dx and xsum: nw * 16 floats per row).
// y[m * ldy + r] for m < MB, r < 4. MB > 2 runs out of the 32 vector registers (measured slower).
//
// A load of 64 code bytes feeds two dot products without a shift: the low nibbles (w & 0x0F)
// and the high nibbles kept in place (w & 0xF0 = 16 * hi, at most 240, still an unsigned byte),
// summed in two int32 accumulators; 16 * lo_sum + hi_sum is then 16 times the group's dot
// product, and the 1/16 goes into the float scale (exact: a power of two).
template <int MB, typename T>
W4A8_TARGET void block_rows(const uint8_t* blk, int64_t K, const int8_t* xq, const float* dx,
                            const float* xsum, T* y, int64_t ldy) {
  const int64_t ng = K / kGroup;
  const int64_t nw = (ng + 15) / 16;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i high4 = _mm512_set1_epi8(static_cast<char>(0xF0));
  const __m512 sixteenth = _mm512_set1_ps(1.0f / 16.0f);
  __m512 acc[MB][kRows];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t win = 0; win < nw; ++win) {
    const int64_t g0 = win * 16;
    const auto [h, mask, bytes] = window(ng, g0);  // groups (lanes) in it, lane and byte masks
    const uint8_t* wp = blk + g0 * kBlockBytesPerGroup;
    const auto* sp = reinterpret_cast<const uint16_t*>(wp + 64 * h);  // scales, then minimums
    const uint16_t* mp = sp + kRows * h;
    // The activation rows of this window: 8 steps each, held across the block's 4 rows (MB = 1)
    // or reloaded from L1 per row (MB = 2, for want of registers).
    __m512i xv[MB == 1 ? 8 : 1];
    __m512 sdx[MB], xs[MB];
    for (int m = 0; m < MB; ++m) {
      sdx[m] = _mm512_mul_ps(_mm512_load_ps(dx + m * nw * 16 + win * 16), sixteenth);
      xs[m] = _mm512_load_ps(xsum + m * nw * 16 + win * 16);
    }
    if constexpr (MB == 1)
      for (int t = 0; t < 8; ++t) xv[t] = _mm512_load_si512(xq + win * 512 + t * 64);
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* cr = wp + r * 16 * h;
      __m512i wv[4];
      for (int L = 0; L < 4; ++L)
        wv[L] = h == 16 ? _mm512_loadu_si512(cr + L * 64)
                        : _mm512_maskz_loadu_epi8(bytes, cr + L * 4 * h);
      const __m512 S = load_f16x16(sp + r * h, mask);
      const __m512 MN = load_f16x16(mp + r * h, mask);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xp = xq + m * nw * 512 + win * 512;
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        for (int L = 0; L < 4; ++L) {
          const __m512i xa = MB == 1 ? xv[2 * L] : _mm512_load_si512(xp + 2 * L * 64);
          const __m512i xb = MB == 1 ? xv[2 * L + 1] : _mm512_load_si512(xp + (2 * L + 1) * 64);
          lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(wv[L], low4), xa);
          hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(wv[L], high4), xb);
        }
        const __m512i d16 = _mm512_add_epi32(_mm512_slli_epi32(lo, 4), hi);  // 16 x dot
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d16), _mm512_mul_ps(S, sdx[m]), acc[m][r]);
        acc[m][r] = _mm512_fmadd_ps(MN, xs[m], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) store(y + m * ldy + r, _mm512_reduce_add_ps(acc[m][r]));
}

// linear8's block_rows: the 4 output rows of one 8-bit weight block against MB activation rows
// (quantize_row's layout; qsum: nw * 16 int32 per row). The block's codes for a window are
// loaded once and serve the MB rows.
template <int MB, typename T>
W4A8_TARGET void block_rows8(const uint8_t* blk, int64_t K, const int8_t* xq, const float* dx,
                             const int32_t* qsum, T* y, int64_t ldy) {
  const int64_t ng = K / kGroup;
  const int64_t nw = (ng + 15) / 16;
  __m512 acc[MB][kRows];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t win = 0; win < nw; ++win) {
    const int64_t g0 = win * 16;
    const auto [h, mask, bytes] = window(ng, g0);  // groups (lanes) in it, lane and byte masks
    const uint8_t* wp = blk + g0 * kBlockBytesPerGroup8;
    const auto* sp = reinterpret_cast<const uint16_t*>(wp + 128 * h);
    __m512 dxv[MB];
    __m512i bias[MB];  // 128 * the group's code sum: what u = q + 128 adds to the dot product
    for (int m = 0; m < MB; ++m) {
      dxv[m] = _mm512_load_ps(dx + m * nw * 16 + win * 16);
      bias[m] = _mm512_slli_epi32(_mm512_load_si512(qsum + m * nw * 16 + win * 16), 7);
    }
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* cr = wp + r * 32 * h;
      __m512i wv[8];
      for (int t = 0; t < 8; ++t)
        wv[t] = h == 16 ? _mm512_loadu_si512(cr + t * 64)
                        : _mm512_maskz_loadu_epi8(bytes, cr + t * 4 * h);
      const __m512 S = load_f16x16(sp + r * h, mask);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xp = xq + m * nw * 512 + win * 512;
        __m512i dot = _mm512_setzero_si512();
        for (int t = 0; t < 8; ++t)
          dot = _mm512_dpbusd_epi32(dot, wv[t], _mm512_load_si512(xp + t * 64));
        const __m512i isum = _mm512_sub_epi32(dot, bias[m]);
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(S, dxv[m]), acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < kRows; ++r) store(y + m * ldy + r, _mm512_reduce_add_ps(acc[m][r]));
}

// One weight block against MB activation rows: block_rows (4-bit) or block_rows8 (8-bit), each
// taking the per-row sums it needs (xsum for the 4-bit minimums, qsum for the 8-bit code offset).
template <int Bits, int MB, typename T>
void block(const uint8_t* blk, int64_t K, const int8_t* xq, const float* dx, const float* xsum,
           const int32_t* qsum, T* y, int64_t ldy) {
  if constexpr (Bits == 4)
    block_rows<MB>(blk, K, xq, dx, xsum, y, ldy);
  else
    block_rows8<MB>(blk, K, xq, dx, qsum, y, ldy);
}

// Weight bytes per group of 32 input features in a block of 4 output rows.
constexpr int64_t block_bytes_per_group(int bits) {
  return bits == 4 ? kBlockBytesPerGroup : kBlockBytesPerGroup8;
}

void check_args(const at::Tensor& x, const at::Tensor& w, int64_t N, int bits) {
  const char* op = bits == 4 ? "w4a8" : "w8a8";
  TORCH_CHECK(cpu_supported(), op, ": this CPU lacks AVX-512 VNNI");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2, op, ": x must be (M, K), got ", x.sizes());
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, op, ": K must be a multiple of 32, got ", K);
  TORCH_CHECK(N % kRows == 0, op, ": N must be a multiple of 4, got ", N);
  const int64_t want = N / kRows * (K / kGroup) * block_bytes_per_group(bits);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 1 && w.is_contiguous() &&
                  w.numel() == want,
              op, ": packed weight must be contiguous uint8 of ", want, " bytes for N = ", N,
              ", K = ", K, ", got ", w.sizes(), " ", w.scalar_type());
}

template <int Bits, typename T>
void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t ng = K / kGroup, nw = (ng + 15) / 16, blocks = N / kRows;
  // Scratch for the quantized rows, reused by the calling thread: xq (M, nw * 512) int8, then
  // dx, xsum and qsum (M, nw * 16) 4-byte values each; 64-byte aligned for the aligned loads.
  const int64_t rq = nw * 512, rf = nw * 16;  // per row: code bytes, 4-byte values
  const size_t bytes = static_cast<size_t>(M * (rq + 3 * rf * 4)) + 64;
  thread_local std::vector<int8_t> scratch;
  if (scratch.size() < bytes) scratch.resize(bytes);
  auto* base = reinterpret_cast<int8_t*>(
      (reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  int8_t* qp = base;
  float* dp = reinterpret_cast<float*>(base + M * rq);
  float* sp = dp + M * rf;
  int32_t* cp = reinterpret_cast<int32_t*>(sp + M * rf);
  const T* xin = x.data_ptr<T>();
  for (int64_t m = 0; m < M; ++m)
    quantize_row(xin + m * K, K, qp + m * rq, dp + m * rf, sp + m * rf, cp + m * rf);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  T* yp = y.data_ptr<T>();
  const int64_t block_bytes = ng * block_bytes_per_group(Bits);
  const int64_t grain = std::max<int64_t>(1, kTaskWeights / (kRows * K));  // blocks per task
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = wp + b * block_bytes;
      int64_t m = 0;
      for (; m + 2 <= M; m += 2)
        block<Bits, 2>(blk, K, qp + m * rq, dp + m * rf, sp + m * rf, cp + m * rf,
                       yp + m * N + b * kRows, N);
      for (; m < M; ++m)
        block<Bits, 1>(blk, K, qp + m * rq, dp + m * rf, sp + m * rf, cp + m * rf,
                       yp + m * N + b * kRows, N);
    }
  });
}

// (M, K) fp32 or bf16 rows -> (M, N) in x's dtype.
template <int Bits>
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t N) {
  const at::Tensor x =
      x_in.scalar_type() == at::kBFloat16 ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  check_args(x, w, N, Bits);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    run<Bits, at::BFloat16>(x, w, y);
  else
    run<Bits, float>(x, w, y);
  return x_in.scalar_type() == x.scalar_type() ? y : y.to(x_in.scalar_type());
}

}  // namespace

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  return linear<4>(x, w, N);
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  return linear<8>(x, w, N);
}

bool w4a8_supported() { return cpu_supported(); }

TORCH_LIBRARY(eaglespec_w4a8, m) {
  m.def("linear(Tensor x, Tensor w, int N) -> Tensor");
  m.def("linear8(Tensor x, Tensor w, int N) -> Tensor");
  m.def("supported() -> bool");
}

TORCH_LIBRARY_IMPL(eaglespec_w4a8, CPU, m) {
  m.impl("linear", &w4a8_linear);
  m.impl("linear8", &w8a8_linear);
}

TORCH_LIBRARY_IMPL(eaglespec_w4a8, CompositeExplicitAutograd, m) {
  m.impl("supported", &w4a8_supported);
}
