// int4 and int8 weights x int8 activations on x86 CPUs with AVX-512 VNNI or AVX2 (the AVX2 path
// below gives the same bits): the matmuls of `--quant w4a8` (eaglespec/model/w4a8.py has the
// formats, the math and the measurements).
// `linear` takes 4-bit weights (the decoder's), `linear8` 8-bit ones (the output head's, GGUF's
// Q8_0 blocks); both quantize the activations the same way (quantize_row).
//
// y[m, n] = sum_g s[n, g] * dx[m, g] * sum_{k in g} q[n, k] * xq[m, k]   (int32, vpdpbusd)
//         + sum_g mn[n, g] * xsum[m, g]
//
// q: 4-bit codes 0..15, s: fp16 scale, mn: fp16 minimum, per group g of 32 input features.
// xq: the activation row quantized per group to int8 (dx = absmax / 127), xsum: the group's sum of
// the unquantized activations.
//
// linear8: y[m, n] = sum_g s[n, g] * dx[m, g] * sum_{k in g} q[n, k] * xq[m, k], q in -127..127
// (GGUF Q8_0: w = d * q per block of 32, d fp16). vpdpbusd multiplies unsigned by signed bytes,
// so the codes are stored as u = q + 128 (1..255) and the group's dot product is
// sum u * xq - 128 * sum xq, exact in int32 (|sum| < 32 * 255 * 127).
//
// Weights, blocked: output rows in blocks of 16, one per int32 lane of a 512-bit register; each
// block one contiguous run of K/32 group records, so a thread reads its share of a matrix as a
// single sequential stream (N is padded to a multiple of 16 with zero rows). A group record:
//   4-bit, 320 bytes: 4 loads L of 64 code bytes, byte b of lane i = q[row i, 8L + b] |
//          q[row i, 8L + 4 + b] << 4 (features of the group), then the 16 rows' fp16 scales,
//          then their fp16 minimums;
//   8-bit, 544 bytes: 8 steps t of 64 code bytes, byte b of lane i = u[row i, 4t + b], then the
//          16 rows' fp16 scales.
// So a step's 4 bytes per lane meet the same 4 activation codes in every lane: vpdpbusd takes
// them as one broadcast dword, and 8 steps make the group's 16 dot products.
//
// Activation rows are tiled: each group's weights are loaded (and for 4 bits unpacked) once and
// serve up to kTile rows, whose accumulators stay in registers across the groups, so more rows
// cost only their vpdpbusd and float scaling while the weights stream once. Every (m, n) goes
// through the same instructions in the same order whatever M, the tile and the thread split:
//     acc = fma(float(dot), s * dx, acc); acc = fma(mn, xsum, acc)     per group, in order
// (8-bit: no minimum), so a row of a batch is bitwise the row alone.
//
// Where the CPU has AMX (Intel Sapphire Rapids on) and the OS grants its tile state, tiles of
// 16 activation rows take the group's dot products from one tile multiply instead (TDPBSUD:
// the 16 rows' 32 signed codes against the group's 8 steps, which are already AMX's B layout:
// 16 columns of 4 bytes a row), and for 8-bit weights so does a forward of fewer rows, from
// kAmxMinRows8 up (a verification's output head), in one tile of its M rows. Integer sums are
// exact, so its int32 dot products are the VNNI path's, and the same float epilogue
// (`accumulate`) gives the same bits; the rows a forward of more than 16 leaves over go through
// VNNI. The tile multiply replaces 8 vpdpbusd
// and 8 broadcasts per row and group, so the epilogue, inherent in a scale per group of 32, is
// what is left (measured in w4a8.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernels.h"      // w4a8_rows: the kernel called from C++ (layer.cpp)
#include "simd16_avx2.h"  // AVX2 paths: 16 lanes as two halves, the AVX-512 reductions' order
#include "team.h"  // parallel_for: through the forward's team where one runs (layer.cpp)

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRows = 16;  // output rows per weight block: one per int32 lane
constexpr int kTile = 8;       // activation rows sharing each loaded group (accumulators in registers)
constexpr int kAmxRows = 16;   // activation rows of an AMX tile multiply
// The fewest rows of a forward that AMX takes in one tile (a forward of 16 or more always tiles
// by 16). Measured on SmolLM2's shapes (benchmarks/roofline.py --amx both --amx-min-rows 1,
// 2026-11-27): the 8-bit head 1.08x at 8 rows, 1.29x at 12, 1.35x at 15 faster through one
// tile than through VNNI, 0.83-0.95x below 8 (Qwen2.5-1.5B's 151,936-row head: 0.98x at 8,
// 1.39x at 12); the 4-bit decoder slower through a tile at every height below 16 (0.58x at one
// row, 0.78x at 8, 0.94x at 12): the block's unpacking into a buffer and the tile store and
// read-back cost more than its vpdpbusd.
constexpr int kAmxMinRows8 = 8;
constexpr int kAmxMinRows4 = 16;
constexpr int64_t kTaskWeights = int64_t{1} << 18;  // a second thread pays from about here (measured)
constexpr int64_t kChunkBytes = int64_t{1} << 18;   // activation codes a pass keeps in L2
constexpr int64_t kPrefetch = 8192;  // bytes of weights prefetched ahead of the group at hand
constexpr int64_t kTaskValues = int64_t{1} << 16;   // activations a quantizing task takes at least

// Weight bytes per group of 32 input features in a block of 16 output rows: the codes, then
// fp16 scales (and fp16 minimums for 4 bits).
constexpr int64_t code_bytes(int bits) { return kRows * kGroup * bits / 8; }
constexpr int64_t group_bytes(int bits) { return code_bytes(bits) + kRows * (bits == 4 ? 4 : 2); }
// Bytes of a packed weight for K inputs and N outputs at `bits`.
constexpr int64_t packed_bytes(int64_t K, int64_t N, int bits) {
  return (N + kRows - 1) / kRows * (K / kGroup) * group_bytes(bits);
}

#define W4A8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#define W4A8_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,amx-tile,amx-int8")))

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// Whether the kernels run their AVX2 path: where AVX-512 VNNI is missing, or where
// `use_avx2(true)` asked for it (tests compare the two paths bit for bit).
std::atomic<bool> avx2_wanted{false};
bool avx2_on() { return !cpu_supported() || avx2_wanted.load(std::memory_order_relaxed); }

// AMX-INT8 in the CPU (CPUID leaf 7: EDX bits 24 and 25) and its tile state granted to this
// process by Linux (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), asked once.
bool amx_granted() {
  static const bool granted = [] {
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const bool has = ((d >> 24) & 1) && ((d >> 25) & 1);
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return cpu_supported() && has && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return granted;
}

// Whether full 16-row tiles go through AMX: where granted, unless `use_amx(false)` turned it off
// (benchmarks and tests compare the two paths; the bits are the same).
std::atomic<bool> amx_wanted{true};
bool amx_on() {
  return amx_wanted.load(std::memory_order_relaxed) && !avx2_on() && amx_granted();
}
// The fewest rows of a forward that go through AMX in one tile, 4-bit and 8-bit weights
// (`amx_min_rows`: benchmarks find the crossover, tests cover every tile height).
std::atomic<int> amx_min_rows4{kAmxMinRows4}, amx_min_rows8{kAmxMinRows8};

// The activation rows of a forward's AMX tiles (0: VNNI only): 16, or all M rows in one tile.
template <int Bits>
int amx_tile_rows(int64_t M) {
  if (!amx_on()) return 0;
  if (M >= kAmxRows) return kAmxRows;
  const std::atomic<int>& least = Bits == 4 ? amx_min_rows4 : amx_min_rows8;
  return M >= least.load(std::memory_order_relaxed) ? static_cast<int>(M) : 0;
}

// 16 fp16 values -> fp32 lanes.
W4A8_TARGET inline __m512 load_f16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 activations from fp32 or bf16 memory -> fp32 lanes.
W4A8_TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
W4A8_TARGET inline __m512 load16(const at::BFloat16* p) {
  __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

// The quantized activation rows: row m's K int8 codes at xq + m * K (row-major, a group's 32
// codes contiguous), its per-group values at + m * ng: dx (absmax / 127), xsum (the sum of the
// unquantized values) and qbias (-128 times the sum of the codes: what linear8's dot products
// start from, taking back the + 128 of its stored codes).
struct Rows {
  int8_t* xq;
  float* dx;
  float* xsum;
  int32_t* qbias;
  int64_t K, ng;
  Rows at(int64_t m) const {
    return {xq + m * K, dx + m * ng, xsum + m * ng, qbias + m * ng, K, ng};
  }
};

// One row of x (K values) -> the first row of r (Rows::at the row's index).
template <typename T>
W4A8_TARGET void quantize_row(const T* x, const Rows& r) {
  for (int64_t g = 0; g < r.ng; ++g) {
    const __m512 a = load16(x + g * kGroup), b = load16(x + g * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 vinv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    // cvtps_epi32 rounds to nearest even; the saturating narrow keeps the codes in int8.
    const __m128i qa = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, vinv)));
    const __m128i qb = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, vinv)));
    int8_t* q = r.xq + g * kGroup;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), qa);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), qb);
    r.dx[g] = amax / 127.0f;
    r.xsum[g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    r.qbias[g] = -128 * (_mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(qa)) +
                         _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(qb)));
  }
}

inline void store(float* y, float v) { *y = v; }
inline void store(at::BFloat16* y, float v) { *y = at::BFloat16(v); }  // round to nearest even

// The product rounded to T as `store` rounds it, then the residual added as ATen adds two T
// tensors (in fp32, rounded once to T): `linear_add`'s y = r + x W^T has the bits of
// `r + linear(x)`.
inline void store_add(float* y, float v, float r) { *y = r + v; }
inline void store_add(at::BFloat16* y, float v, at::BFloat16 r) {
  *y = at::BFloat16(static_cast<float>(r) + static_cast<float>(at::BFloat16(v)));
}

// One group's int32 dot products of 16 weight rows (8 registers: step t's 4 bytes per lane) with
// one activation row's 32 codes (x, as 8 dwords, each broadcast to every lane), starting from
// `init`. Integer sums are exact, so the two chains (for latency) change no bit.
W4A8_TARGET inline __m512i group_dot(const __m512i (&w)[8], const int32_t* x, __m512i init) {
  __m512i a = _mm512_dpbusd_epi32(init, w[0], _mm512_set1_epi32(x[0]));
  __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(x[1]));
  for (int t = 2; t < 8; t += 2) {
    a = _mm512_dpbusd_epi32(a, w[t], _mm512_set1_epi32(x[t]));
    b = _mm512_dpbusd_epi32(b, w[t + 1], _mm512_set1_epi32(x[t + 1]));
  }
  return _mm512_add_epi32(a, b);
}

// One group's int32 dot products of the block's 16 rows with one activation row (o: the row's
// value index of the group) into its 16 fp32 accumulators. Both paths end every group here, so
// every (m, n) sees the same float operations in the same order.
template <int Bits>
W4A8_TARGET inline __m512 accumulate(__m512 acc, __m512i dot, __m512 S, __m512 MN, const Rows& x,
                                     int64_t o) {
  const __m512 scale = _mm512_mul_ps(S, _mm512_set1_ps(x.dx[o]));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
  if constexpr (Bits == 4) acc = _mm512_fmadd_ps(MN, _mm512_set1_ps(x.xsum[o]), acc);
  return acc;
}

// A block's accumulators (one register of 16 outputs per activation row) rounded and stored.
// (The first `count` of them where given: a partial AMX tile.)
template <int MB, typename T>
W4A8_TARGET inline void store_tile(const __m512 (&acc)[MB], T* y, const T* r, int64_t ldy,
                                   int64_t valid, int count = MB) {
  alignas(64) float out[kRows];
  for (int m = 0; m < count; ++m) {
    _mm512_store_ps(out, acc[m]);
    if (r != nullptr)
      for (int64_t i = 0; i < valid; ++i) store_add(y + m * ldy + i, out[i], r[m * ldy + i]);
    else
      for (int64_t i = 0; i < valid; ++i) store(y + m * ldy + i, out[i]);
  }
}

// One group's 8 steps of 64 code bytes (lane i's 4 bytes: row i's features 4t..4t+3), for 4 bits
// unpacked from the record's 4 loads of low and high nibbles.
template <int Bits>
W4A8_TARGET inline void group_steps(const uint8_t* gp, __m512i (&w)[8]) {
  if constexpr (Bits == 4) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int L = 0; L < 4; ++L) {  // load L's low nibbles are step 2L, its high ones 2L + 1
      const __m512i v = _mm512_loadu_si512(gp + L * 64);
      w[2 * L] = _mm512_and_si512(v, low4);
      w[2 * L + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
  } else {
    for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(gp + t * 64);
  }
}

// The weight stream kPrefetch bytes ahead of a group, every line: the hardware prefetchers stop
// at each 4 KB page of a thread's stream, and a decode step's matrices are small (measured: a pass
// over SmolLM2's 120 decoder matrices and head 20-30% faster at 1-8 rows). Into L2, not L1: a
// prefetch to L1 holds one of the core's few L1 fill buffers until its line arrives, one to L2
// only an L2 miss slot, of which there are about three times as many, so more lines are in flight
// (measured against T0: the decoder pass 5-9% and the head 9-13% faster at 1-2 rows, the same
// from 4 rows up; session 26).
template <int Bits>
inline void prefetch_ahead(const uint8_t* gp) {  // SSE's prefetch only: the AVX2 path's too
  for (int64_t o = 0; o < group_bytes(Bits); o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(gp + kPrefetch + o), _MM_HINT_T1);
}

// One weight block (16 output rows) against a tile of MB activation rows (x at the tile's first
// row): y[m * ldy + i] for m < MB and the block's first `valid` rows i, plus r[m * ldy + i] where
// r is given (linear_add's residual, laid out as y).
template <int Bits, int MB, typename T>
W4A8_TARGET void block_tile(const uint8_t* blk, const Rows& x, T* y, const T* r, int64_t ldy,
                            int64_t valid) {
  // The tile's loops are unrolled so that acc[] lives in registers (GCC otherwise keeps it on
  // the stack, measured 2x slower).
  __m512 acc[MB];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.ng; ++g) {
    const uint8_t* gp = blk + g * group_bytes(Bits);
    prefetch_ahead<Bits>(gp);
    __m512i w[8];
    group_steps<Bits>(gp, w);
    const __m512 S = load_f16x16(gp + code_bytes(Bits));
    const __m512 MN = Bits == 4 ? load_f16x16(gp + code_bytes(Bits) + 32) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const int64_t o = m * x.ng + g;  // row m's values of this group
      const auto* xp = reinterpret_cast<const int32_t*>(x.xq + m * x.K + g * kGroup);
      const __m512i init = Bits == 4 ? _mm512_setzero_si512() : _mm512_set1_epi32(x.qbias[o]);
      acc[m] = accumulate<Bits>(acc[m], group_dot(w, xp, init), S, MN, x, o);
    }
  }
  store_tile<MB>(acc, y, r, ldy, valid);
}

// ---- The AVX2 path (x86-64-v3: no AVX-512, no VNNI) ---------------------------------------
// The same packed weights and the same math, in 8-lane registers: a block's 16 output rows as
// two halves of 8 (lanes 0-7 and 8-15 of the AVX-512 path; bytes 0-31 and 32-63 of each 64-byte
// load; block_tile_avx2 says in which order). Without vpdpbusd a group's dot products are
// vpmaddubsw (u8 x s8 -> pairs summed in int16) then vpmaddwd against ones (-> int32 per lane):
// for 4 bits the 8 steps' pair sums are added in int16 first (|sum| <= 8 * 2 * 15 * 127 =
// 30,480, no overflow), for 8 bits each step is widened (a pair can reach 2 * 127 * 127), its
// signed codes taken back from the stored q + 128 and the activations' signs moved onto them
// (vpsignb), as vpmaddubsw wants one unsigned operand. Integer sums are exact, so every group's
// int32 dot products are vpdpbusd's; the float epilogue is `accumulate`'s, operation for
// operation and lane for lane, and the activations are quantized as quantize_row does (the same
// rounding, and xsum reduced in _mm512_reduce_add_ps's order), so the AVX2 path gives the
// AVX-512 path's bits (tests/test_w4a8.py compares them where both run).

constexpr int kTile2 = 4;  // activation rows sharing a loaded half group (16 ymm registers)

EAGLESPEC_AVX2_TARGET inline int32_t reduce_add8_epi32(__m256i v) {
  const __m128i a = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
  const __m128i b = _mm_add_epi32(a, _mm_shuffle_epi32(a, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(b, _mm_shuffle_epi32(b, 1)));
}

// quantize_row on AVX2: the same codes, dx, xsum and qbias.
template <typename T>
EAGLESPEC_AVX2_TARGET void quantize_row_avx2(const T* x, const Rows& r) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < r.ng; ++g) {
    __m256 v[4];  // the group's 32 values, 8 a register
    for (int i = 0; i < 4; ++i) v[i] = avx2::load8(x + g * kGroup + 8 * i);
    const float amax =
        avx2::reduce_max(avx2::max(avx2::abs({v[0], v[1]}), avx2::abs({v[2], v[3]})));
    const __m256 vinv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i c[4];  // rounded to nearest even, as _mm512_cvtps_epi32
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv));
    // saturating narrows (as _mm512_cvtsepi32_epi8), then the dwords back in feature order
    const __m256i q = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.xq + g * kGroup), q);
    r.dx[g] = amax / 127.0f;
    // _mm512_reduce_add_ps(a + b) with a = values 0-15 and b = 16-31
    r.xsum[g] = avx2::reduce_add({_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3])});
    const __m256i q16a = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
    const __m256i q16b = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
    const __m256i s32 = _mm256_madd_epi16(_mm256_add_epi16(q16a, q16b), _mm256_set1_epi16(1));
    r.qbias[g] = -128 * reduce_add8_epi32(s32);
  }
}

// 32 code bytes of a 4-bit record's load at p -> its two steps: the low nibbles (lo) and the high
// nibbles (hi), each byte 0..15.
EAGLESPEC_AVX2_TARGET inline void nibble_steps(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_and_si256(v, low4);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
}

// 32 code bytes of an 8-bit record's step at p -> the signed codes (the stored q + 128 with its
// top bit flipped).
EAGLESPEC_AVX2_TARGET inline __m256i signed_codes(const uint8_t* p) {
  return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                          _mm256_set1_epi8(static_cast<char>(0x80)));
}

// One half group's 8 steps of 32 code bytes (lane i's 4 bytes: the half's row i, features
// 4t..4t+3), for 4 bits unpacked from the record's 4 loads of low and high nibbles; for 8 bits
// the signed codes.
template <int Bits>
EAGLESPEC_AVX2_TARGET inline void half_steps(const uint8_t* gp, int half, __m256i (&w)[8]) {
  if constexpr (Bits == 4) {
    for (int L = 0; L < 4; ++L) nibble_steps(gp + L * 64 + 32 * half, w[2 * L], w[2 * L + 1]);
  } else {
    for (int t = 0; t < 8; ++t) w[t] = signed_codes(gp + t * 64 + 32 * half);
  }
}

// One step of 8 signed weight rows (4 codes each) against 4 signed activation codes broadcast to
// every lane (xt, and ax its absolute values) -> int32 per row, exact: vpmaddubsw wants an
// unsigned operand, so |x| and w with x's signs.
EAGLESPEC_AVX2_TARGET inline __m256i signed_pairs(__m256i w, __m256i xt, __m256i ax) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w, xt)),
                           _mm256_set1_epi16(1));
}

// signed_pairs against 4 codes given as a dword.
EAGLESPEC_AVX2_TARGET inline __m256i signed_step(__m256i w, int32_t x) {
  const __m256i xt = _mm256_set1_epi32(x);
  return signed_pairs(w, xt, _mm256_abs_epi8(xt));
}

// One half group's int32 dot products of 8 weight rows with one activation row's 32 codes (x,
// as 8 dwords): exactly vpdpbusd's sums (for 8 bits: of the signed codes, which is vpdpbusd's
// sum of q + 128 plus the row's qbias).
template <int Bits>
EAGLESPEC_AVX2_TARGET inline __m256i half_dot(const __m256i (&w)[8], const int32_t* x) {
  if constexpr (Bits == 4) {
    __m256i a = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(x[0]));
    __m256i b = _mm256_maddubs_epi16(w[1], _mm256_set1_epi32(x[1]));
    for (int t = 2; t < 8; t += 2) {
      a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w[t], _mm256_set1_epi32(x[t])));
      b = _mm256_add_epi16(b, _mm256_maddubs_epi16(w[t + 1], _mm256_set1_epi32(x[t + 1])));
      asm("" : "+x"(a), "+x"(b));  // two chains, as in the together tiles (8 rows: 0.93x)
    }
    return _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1));
  } else {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (int t = 0; t < 8; t += 2) {
      a = _mm256_add_epi32(a, signed_step(w[t], x[t]));
      b = _mm256_add_epi32(b, signed_step(w[t + 1], x[t + 1]));
    }
    return _mm256_add_epi32(a, b);
  }
}

// One half group of one weight block against a tile of MB activation rows: acc[m] (row m's 8
// outputs of the half) through `accumulate`'s operations in its order, so they are lanes
// 8 half .. 8 half + 7 of the AVX-512 path's, bit for bit.
template <int Bits, int MB>
EAGLESPEC_AVX2_TARGET inline void half_group_avx2(const uint8_t* gp, int half, const Rows& x,
                                                  int64_t g, __m256 (&acc)[MB]) {
  __m256i w[8];
  half_steps<Bits>(gp, half, w);
  const uint8_t* sp = gp + code_bytes(Bits) + 16 * half;
  const __m256 S = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m) {
    const int64_t o = m * x.ng + g;
    const auto* xp = reinterpret_cast<const int32_t*>(x.xq + m * x.K + g * kGroup);
    const __m256 scale = _mm256_mul_ps(S, _mm256_set1_ps(x.dx[o]));
    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half_dot<Bits>(w, xp)), scale, acc[m]);
    if constexpr (Bits == 4) {
      const __m256 MN =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 32)));
      acc[m] = _mm256_fmadd_ps(MN, _mm256_set1_ps(x.xsum[o]), acc[m]);
    }
  }
}

// at::BFloat16(v)'s bits for 8 lanes, in the low 16 bits of each: avx2::round_bf16_8's round to
// nearest even, and NaN as 0x7FC0 (which that finite-only rounding leaves out).
EAGLESPEC_AVX2_TARGET inline __m256i bf16_bits_avx2(__m256 v) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(avx2::round_bf16_8(v)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// A tile's accumulators for one half of a block stored (8 outputs a row, `here` of them kept).
// A bf16 row's full half is rounded and stored 8 lanes at once, `store` and `store_add`'s bits
// (element by element it was 4% of a 1,024-token prefill, session 61).
template <int MB, typename T>
EAGLESPEC_AVX2_TARGET inline void store_half_avx2(const __m256 (&acc)[MB], int half, T* y,
                                                  const T* r, int64_t ldy, int64_t here) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (here == 8) {
      for (int m = 0; m < MB; ++m) {
        __m256i h = bf16_bits_avx2(acc[m]);
        if (r != nullptr) {  // the product rounded to bf16, plus the residual in fp32, rounded
          const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
          h = bf16_bits_avx2(_mm256_add_ps(avx2::load8(r + m * ldy + 8 * half), v));
        }
        const __m128i packed =
            _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + m * ldy + 8 * half), packed);
      }
      return;
    }
  }
  alignas(32) float out[8];
  for (int m = 0; m < MB; ++m) {
    _mm256_store_ps(out, acc[m]);
    T* ym = y + m * ldy + 8 * half;
    if (r != nullptr)
      for (int64_t i = 0; i < here; ++i) store_add(ym + i, out[i], r[m * ldy + 8 * half + i]);
    else
      for (int64_t i = 0; i < here; ++i) store(ym + i, out[i]);
  }
}

// A tile's accumulators kept in L1, acc[m][half] row m's 8 outputs of a half, stored: the block's
// first `valid` outputs of each row.
template <int MB, typename T>
EAGLESPEC_AVX2_TARGET inline void store_tile_avx2(const float (&acc)[MB][2][8], T* y, const T* r,
                                                  int64_t ldy, int64_t valid) {
  for (int half = 0; half < 2 && 8 * half < valid; ++half) {
    __m256 out[MB];
    for (int m = 0; m < MB; ++m) out[m] = _mm256_load_ps(acc[m][half]);
    store_half_avx2<MB>(out, half, y, r, ldy, std::min<int64_t>(8, valid - 8 * half));
  }
}

// The together tiles below are functions of their own (noinline), which return the float
// accumulators and leave the stores to their caller: inlined into block_tile_avx2 with the order
// by halves and the stores, GCC spilled a tile's int16 sums to the stack before the epilogue and
// read them straight back (a store-forwarding wait in every group's chain; at one row too, where
// registers are plenty). Compiled alone they stay in registers (measured, session 58, both
// kernels in one process: the decoder pass 0.98x the time at one row, 0.95x at two, 0.93x at
// three, 0.88-0.90x at 4, 8 and 16; one thread on a 3072 x 576 matrix in L3, 0.85-0.89x at every
// row count).

// 4-bit weights: one block against a tile of MB activation rows with its two halves together and
// each activation dword broadcast once for both: per group and load L, the two halves' 32 code
// bytes unpacked to their low- and high-nibble steps (4 registers), then every row's two int16
// sums; the float accumulators live in L1 (another 2 MB registers would not fit the 16) and end
// in acc_out (row m's outputs 8 half .. 8 half + 7 at acc_out[m][half]). Each lane gets
// `accumulate`'s operations in its order, so the bits of the order by halves.
template <int MB>
EAGLESPEC_AVX2_TARGET __attribute__((noinline)) void tile4_together_avx2(
    const uint8_t* blk, const Rows& x, float (&acc_out)[MB][2][8]) {
  alignas(32) float acc[MB][2][8] = {};
  for (int64_t g = 0; g < x.ng; ++g) {
    const uint8_t* gp = blk + g * group_bytes(4);
    prefetch_ahead<4>(gp);
    __m256i s16[MB][2];
#pragma GCC unroll 4
    for (int L = 0; L < 4; ++L) {
      __m256i wl0, wh0, wl1, wh1;  // the two halves' low- and high-nibble steps
      nibble_steps(gp + L * 64, wl0, wh0);
      nibble_steps(gp + L * 64 + 32, wl1, wh1);
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        const auto* xp = reinterpret_cast<const int32_t*>(x.xq + m * x.K + g * kGroup);
        const __m256i b0 = _mm256_set1_epi32(xp[2 * L]);
        const __m256i p0 = _mm256_maddubs_epi16(wl0, b0), p1 = _mm256_maddubs_epi16(wl1, b0);
        s16[m][0] = L == 0 ? p0 : _mm256_add_epi16(s16[m][0], p0);
        s16[m][1] = L == 0 ? p1 : _mm256_add_epi16(s16[m][1], p1);
        const __m256i b1 = _mm256_set1_epi32(xp[2 * L + 1]);
        s16[m][0] = _mm256_add_epi16(s16[m][0], _mm256_maddubs_epi16(wh0, b1));
        s16[m][1] = _mm256_add_epi16(s16[m][1], _mm256_maddubs_epi16(wh1, b1));
        // The sums kept as two chains a row: GCC otherwise reassociates them into a tree of
        // products held in registers and, from two rows, spilled (an empty asm pins them;
        // measured, session 57, benchmarks/kernel_ab.py: the decoder pass 0.98x the time at one
        // row, 0.93x at two, 0.88x at three; the same in the 8-bit tiles, the head 0.95x at three
        // rows, 0.89x at four and eight). Integer sums, so the same bits in any order.
        asm("" : "+x"(s16[m][0]), "+x"(s16[m][1]));
      }
    }
    const uint8_t* sp = gp + code_bytes(4);
    const __m256 S0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
    const __m256 S1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 16)));
    const __m256 N0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 32)));
    const __m256 N1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 48)));
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const int64_t o = m * x.ng + g;
      const __m256 dx = _mm256_set1_ps(x.dx[o]), xs = _mm256_set1_ps(x.xsum[o]);
      __m256 a0 = _mm256_load_ps(acc[m][0]), a1 = _mm256_load_ps(acc[m][1]);
      a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16[m][0], ones)),
                           _mm256_mul_ps(S0, dx), a0);
      a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16[m][1], ones)),
                           _mm256_mul_ps(S1, dx), a1);
      _mm256_store_ps(acc[m][0], _mm256_fmadd_ps(N0, xs, a0));
      _mm256_store_ps(acc[m][1], _mm256_fmadd_ps(N1, xs, a1));
    }
  }
  std::memcpy(acc_out, acc, sizeof(acc));
}

// 8-bit weights: one block against a tile of MB activation rows with its two halves together and
// each activation dword broadcast (and its absolute value taken) once for both: per group and
// step t, the two halves' 32 signed code bytes, then every row's two int32 sums (signed_step's
// products); the float accumulators live in L1 and end in acc_out, as tile4_together_avx2's.
// Each lane gets `accumulate`'s operations in its order, so the bits of the order by halves.
template <int MB>
EAGLESPEC_AVX2_TARGET __attribute__((noinline)) void tile8_together_avx2(
    const uint8_t* blk, const Rows& x, float (&acc_out)[MB][2][8]) {
  alignas(32) float acc[MB][2][8] = {};
  for (int64_t g = 0; g < x.ng; ++g) {
    const uint8_t* gp = blk + g * group_bytes(8);
    prefetch_ahead<8>(gp);
    __m256i s32[MB][2];
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m256i w0 = signed_codes(gp + t * 64), w1 = signed_codes(gp + t * 64 + 32);
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        const auto* xp = reinterpret_cast<const int32_t*>(x.xq + m * x.K + g * kGroup);
        const __m256i xt = _mm256_set1_epi32(xp[t]), ax = _mm256_abs_epi8(xt);
        const __m256i p0 = signed_pairs(w0, xt, ax), p1 = signed_pairs(w1, xt, ax);
        s32[m][0] = t == 0 ? p0 : _mm256_add_epi32(s32[m][0], p0);
        s32[m][1] = t == 0 ? p1 : _mm256_add_epi32(s32[m][1], p1);
        asm("" : "+x"(s32[m][0]), "+x"(s32[m][1]));  // two chains a row, as in the 4-bit tiles
      }
    }
    const uint8_t* sp = gp + code_bytes(8);
    const __m256 S0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp)));
    const __m256 S1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + 16)));
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m256 dx = _mm256_set1_ps(x.dx[m * x.ng + g]);
      _mm256_store_ps(acc[m][0], _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[m][0]),
                                                 _mm256_mul_ps(S0, dx), _mm256_load_ps(acc[m][0])));
      _mm256_store_ps(acc[m][1], _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[m][1]),
                                                 _mm256_mul_ps(S1, dx), _mm256_load_ps(acc[m][1])));
    }
  }
  std::memcpy(acc_out, acc, sizeof(acc));
}

// Whether tiles take a block's two halves together where that measured faster (`avx2_together`).
std::atomic<bool> avx2_together_wanted{true};

// One weight block against a tile of MB activation rows, as block_tile. A block's two halves
// either go together, group by group (tile4_together_avx2, tile8_together_avx2), so
// each group's record is read once, the two halves' accumulator chains overlap and each
// activation dword is broadcast once for both halves; or apart, the first half over all groups,
// then the second (the second pass reads the block from L1). Together is the default: it
// measured faster for every tile. Measured on a Zen 3 with 2 threads (benchmarks/roofline.py
// --avx2-together both, session 56), together against apart: SmolLM2's decoder matrices
// 0.94-0.98x the time at one row, 0.88-0.94x at two, 0.80-1.00x at three (a 4-bit tile of 4
// together 1.01x then, before its sums were kept as chains; since, benchmarks/kernel_ab.py
// session 57: the decoder pass 0.83-0.91x at 4, 8, 16 and 32 rows, 0.97x at 12); its output head
// 0.95-1.01x at one row, 0.77-0.98x at two, 0.79-0.82x at three, 0.91-0.97x at four, 0.85-1.04x
// at 8-16 (the same code measured 0.91-1.05x across such runs: the VM's drift). Either way every
// lane gets the same operations in the same order, so the same bits (avx2_together(false) takes
// every tile apart: tests compare the two).
template <int Bits, int MB, typename T>
EAGLESPEC_AVX2_TARGET void block_tile_avx2(const uint8_t* blk, const Rows& x, T* y, const T* r,
                                           int64_t ldy, int64_t valid) {
  const bool together = avx2_together_wanted.load(std::memory_order_relaxed);
  if (together) {
    alignas(32) float acc[MB][2][8];
    if constexpr (Bits == 4)
      tile4_together_avx2<MB>(blk, x, acc);
    else
      tile8_together_avx2<MB>(blk, x, acc);
    return store_tile_avx2<MB>(acc, y, r, ldy, valid);
  }
  const int halves = valid > 8 ? 2 : 1;
  for (int half = 0; half < halves; ++half) {
    __m256 acc[MB];
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < x.ng; ++g) {
      const uint8_t* gp = blk + g * group_bytes(Bits);
      if (half == 0) prefetch_ahead<Bits>(gp);  // the second half reads the same lines
      half_group_avx2<Bits, MB>(gp, half, x, g, acc);
    }
    store_half_avx2<MB>(acc, half, y, r, ldy, std::min<int64_t>(8, valid - 8 * half));
  }
}

// One weight block against `rows` activation rows on the AVX2 path: tiles of kTile2, then one
// of the rest.
template <int Bits, typename T>
void block_rows_avx2(const uint8_t* blk, const Rows& x, int64_t rows, T* y, const T* r,
                     int64_t ldy, int64_t valid) {
  auto at = [&](int64_t m) { return r == nullptr ? nullptr : r + m * ldy; };
  int64_t m = 0;
  for (; m + kTile2 <= rows; m += kTile2)
    block_tile_avx2<Bits, kTile2>(blk, x.at(m), y + m * ldy, at(m), ldy, valid);
  const Rows xr = x.at(m);
  switch (rows - m) {
    case 0: break;
    case 1: block_tile_avx2<Bits, 1>(blk, xr, y + m * ldy, at(m), ldy, valid); break;
    case 2: block_tile_avx2<Bits, 2>(blk, xr, y + m * ldy, at(m), ldy, valid); break;
    case 3: block_tile_avx2<Bits, 3>(blk, xr, y + m * ldy, at(m), ldy, valid); break;
  }
}
// ---- end of the AVX2 path -----------------------------------------------------------------

// AMX's tile configuration for tiles of R activation rows, two sets for alternate groups: tiles
// 0 and 3 the int32 dot products (R activation rows x 16 output rows), 1 and 4 the activation
// codes (R rows x 32 bytes), 2 and 5 the group's weight steps (8 rows of 16 x 4 bytes). Loaded
// by each thread before its first tile multiply.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {4 * kRows, kGroup, 64, 4 * kRows, kGroup, 64};
  uint8_t rows[16] = {};
};

constexpr TileConfig tile_config(int R) {
  TileConfig c;
  const uint8_t r = static_cast<uint8_t>(R), b = kGroup / 4;
  c.rows[0] = r, c.rows[1] = r, c.rows[2] = b, c.rows[3] = r, c.rows[4] = r, c.rows[5] = b;
  return c;
}

// `bytes` of a thread's reused scratch `buf`, grown as needed, starting on a 64-byte line.
inline uint8_t* aligned(std::vector<uint8_t>& buf, int64_t bytes) {
  const size_t need = static_cast<size_t>(bytes) + 64;
  if (buf.size() < need) buf.resize(need);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) &
                                    ~uintptr_t{63});
}

// A block's groups as AMX takes them: `steps` points at group 0's 8 steps of 64 code bytes, the
// next group's `stride` bytes on (8 bits: the records themselves; 4 bits: unpack_block's copy).
struct BlockSteps {
  const uint8_t* steps;
  int64_t stride;
};

// A 4-bit block's groups unpacked into `out` (ng x 512 bytes), streamed once for all its tiles.
W4A8_TARGET inline void unpack_block(const uint8_t* blk, int64_t ng, uint8_t* out) {
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* gp = blk + g * group_bytes(4);
    prefetch_ahead<4>(gp);
    __m512i w[8];
    group_steps<4>(gp, w);
    for (int t = 0; t < 8; ++t) _mm512_store_si512(out + g * 512 + t * 64, w[t]);
  }
}

// Group g's tile multiply (tiles A, B into C: compile-time tile numbers) and its dot products
// stored to `dots` (16 rows of 16 int32).
#define W4A8_TILE_DOTS(C, A, B, g, dots)                                    \
  do {                                                                      \
    _tile_loadd(B, bs.steps + (g) * bs.stride, 64);                         \
    _tile_loadd(A, x.xq + (g) * kGroup, x.K);                               \
    _tile_zero(C);                                                          \
    _tile_dpbsud(C, A, B);                                                  \
    _tile_stored(C, dots, 4 * kRows);                                       \
  } while (0)

// One weight block against a tile of R <= 16 activation rows through AMX (the tiles configured
// for R rows): per group, one TDPBSUD (the rows' signed codes against the weights' unsigned
// ones: vpdpbusd's operands) gives the int32 dot products group_dot would, then `accumulate` as
// block_tile. Two sets of tiles alternate, so a group's dot products are stored one group before
// they are read (a load right after its tile store waits for it: measured a third of the
// kernel's time). The row loop is unrolled over 16 with the rows past R skipped, so acc[] stays
// in registers whatever R.
template <int Bits, typename T>
W4A8_AMX_TARGET void block_amx(const uint8_t* blk, const BlockSteps& bs, const Rows& x, int R,
                               T* y, const T* r, int64_t ldy, int64_t valid) {
  __m512 acc[kAmxRows];
#pragma GCC unroll 16
  for (int m = 0; m < kAmxRows; ++m) acc[m] = _mm512_setzero_ps();
  alignas(64) int32_t dots[2][kAmxRows * kRows];  // tile rows of dot products, row-major
  W4A8_TILE_DOTS(0, 1, 2, 0, dots[0]);
  for (int64_t g = 0; g < x.ng; ++g) {
    if (g + 1 < x.ng) {
      if (g % 2 == 0)
        W4A8_TILE_DOTS(3, 4, 5, g + 1, dots[1]);
      else
        W4A8_TILE_DOTS(0, 1, 2, g + 1, dots[0]);
    }
    const int32_t* d = dots[g % 2];
    const uint8_t* gp = blk + g * group_bytes(Bits);
    if constexpr (Bits == 8) prefetch_ahead<8>(gp);  // 4 bits: unpack_block streamed it
    const __m512 S = load_f16x16(gp + code_bytes(Bits));
    const __m512 MN = Bits == 4 ? load_f16x16(gp + code_bytes(Bits) + 32) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int m = 0; m < kAmxRows; ++m) {
      if (m >= R) break;
      const int64_t o = m * x.ng + g;
      __m512i dot = _mm512_load_si512(d + m * kRows);
      if constexpr (Bits == 8) dot = _mm512_add_epi32(dot, _mm512_set1_epi32(x.qbias[o]));
      acc[m] = accumulate<Bits>(acc[m], dot, S, MN, x, o);
    }
  }
  store_tile<kAmxRows>(acc, y, r, ldy, valid, R);
}
#undef W4A8_TILE_DOTS

// One weight block against `rows` activation rows (any number): with `amx` (the tiles' rows,
// as configured; 0: none), tiles of that many rows through AMX; then tiles of kTile rows, then
// one tile of the rest.
template <int Bits, typename T>
void block_rows(const uint8_t* blk, const Rows& x, int64_t rows, T* y, const T* r, int64_t ldy,
                int64_t valid, int amx) {
  auto at = [&](int64_t m) { return r == nullptr ? nullptr : r + m * ldy; };
  int64_t m = 0;
  if (amx > 0 && rows >= amx) {
    BlockSteps bs{blk, group_bytes(Bits)};  // 8 bits: the records are the steps
    if constexpr (Bits == 4) {
      thread_local std::vector<uint8_t> unpacked;
      uint8_t* out = aligned(unpacked, x.ng * 512);
      unpack_block(blk, x.ng, out);
      bs = {out, 512};
    }
    for (; m + amx <= rows; m += amx)
      block_amx<Bits>(blk, bs, x.at(m), amx, y + m * ldy, at(m), ldy, valid);
  }
  for (; m + kTile <= rows; m += kTile)
    block_tile<Bits, kTile>(blk, x.at(m), y + m * ldy, at(m), ldy, valid);
  const Rows xr = x.at(m);
  T* yr = y + m * ldy;
  const T* rr = at(m);
  switch (rows - m) {
    case 0: break;
    case 1: block_tile<Bits, 1>(blk, xr, yr, rr, ldy, valid); break;
    case 2: block_tile<Bits, 2>(blk, xr, yr, rr, ldy, valid); break;
    case 3: block_tile<Bits, 3>(blk, xr, yr, rr, ldy, valid); break;
    case 4: block_tile<Bits, 4>(blk, xr, yr, rr, ldy, valid); break;
    case 5: block_tile<Bits, 5>(blk, xr, yr, rr, ldy, valid); break;
    case 6: block_tile<Bits, 6>(blk, xr, yr, rr, ldy, valid); break;
    case 7: block_tile<Bits, 7>(blk, xr, yr, rr, ldy, valid); break;
  }
}

// Tiles of R activation rows, for this thread.
W4A8_AMX_TARGET void load_tiles(int R) {
  static const auto configs = [] {
    std::array<TileConfig, kAmxRows + 1> c{};
    for (int R = 1; R <= kAmxRows; ++R) c[R] = tile_config(R);
    return c;
  }();
  _tile_loadconfig(&configs[R]);
}
W4A8_AMX_TARGET void release_tiles() { _tile_release(); }

template <int Bits, typename T>
void run(const T* xin, int64_t M, int64_t K, const uint8_t* wp, int64_t N, T* yp, const T* res) {
  const int64_t ng = K / kGroup, blocks = (N + kRows - 1) / kRows;
  // Scratch for the quantized rows, reused by the calling thread: xq (M, K) int8, then dx, xsum
  // and qbias (M, ng) 4-byte values each.
  thread_local std::vector<uint8_t> scratch;
  auto* base = reinterpret_cast<int8_t*>(aligned(scratch, M * (K + 3 * ng * 4)));
  auto* dx = reinterpret_cast<float*>(base + M * K);
  const Rows rows{base, dx, dx + M * ng, reinterpret_cast<int32_t*>(dx + 2 * M * ng), K, ng};
  // On the calling thread up to kTaskValues values (a step or a verification: a parallel region
  // costs more than the work), split among the threads beyond (prefill).
  const bool avx2 = avx2_on();
  team::parallel_for(0, M, std::max<int64_t>(1, kTaskValues / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      if (avx2)
        quantize_row_avx2(xin + m * K, rows.at(m));
      else
        quantize_row(xin + m * K, rows.at(m));
  });
  const int64_t block_bytes = ng * group_bytes(Bits);
  // Rows in chunks whose codes stay in the core's L2 while a thread's blocks pass over them (a
  // long prefill); the weights stream once per chunk. Whole AMX tiles to a chunk.
  const int64_t chunk = std::max<int64_t>(kAmxRows, kChunkBytes / K / kAmxRows * kAmxRows);
  const int64_t grain = std::max<int64_t>(1, kTaskWeights / (kRows * K));  // blocks per task
  const int amx = amx_tile_rows<Bits>(M);
  team::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    if (amx) load_tiles(amx);  // each thread's own tile state
    for (int64_t c = 0; c < M; c += chunk)
      for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* blk = wp + b * block_bytes;
        T* yb = yp + c * N + b * kRows;
        const T* rb = res == nullptr ? nullptr : res + c * N + b * kRows;
        const int64_t rows_here = std::min(chunk, M - c), valid = std::min(kRows, N - b * kRows);
        if (avx2)
          block_rows_avx2<Bits>(blk, rows.at(c), rows_here, yb, rb, N, valid);
        else
          block_rows<Bits>(blk, rows.at(c), rows_here, yb, rb, N, valid, amx);
      }
    if (amx) release_tiles();
  });
}

// Whether either path runs here: AVX-512 VNNI, or AVX2 with FMA and F16C.
bool w4a8_supported() { return cpu_supported() || avx2::supported(); }

void check_args(const at::Tensor& x, const at::Tensor& w, int64_t N, int bits) {
  const char* op = bits == 4 ? "w4a8" : "w8a8";
  TORCH_CHECK(x.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2, op, ": x must be (M, K), got ", x.sizes());
  kernels::w4a8_check(w, x.size(1), N, bits);
}

}  // namespace

int kernels::packed_bits(const at::Tensor& w, int64_t K, int64_t N) {
  if (K % kGroup != 0 || N <= 0 || w.scalar_type() != at::kByte || w.dim() != 1) return 0;
  for (const int bits : {4, 8})
    if (w.numel() == packed_bytes(K, N, bits)) return bits;
  return 0;
}

void kernels::w4a8_check(const at::Tensor& w, int64_t K, int64_t N, int bits) {
  const char* op = bits == 4 ? "w4a8" : "w8a8";
  TORCH_CHECK(w4a8_supported(), op, ": this CPU lacks AVX2 (and AVX-512)");
  TORCH_CHECK(w.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(K % kGroup == 0, op, ": K must be a multiple of 32, got ", K);
  TORCH_CHECK(N > 0, op, ": N must be positive, got ", N);
  const int64_t want = packed_bytes(K, N, bits);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 1 && w.is_contiguous() &&
                  w.numel() == want,
              op, ": packed weight must be contiguous uint8 of ", want, " bytes for N = ", N,
              ", K = ", K, ", got ", w.sizes(), " ", w.scalar_type());
}

template <typename T>
void kernels::w4a8_rows(int bits, const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                        T* y, const T* residual) {
  if (bits == 4)
    run<4, T>(x, M, K, w, N, y, residual);
  else
    run<8, T>(x, M, K, w, N, y, residual);
}
template void kernels::w4a8_rows<float>(int, const float*, int64_t, int64_t, const uint8_t*,
                                        int64_t, float*, const float*);
template void kernels::w4a8_rows<at::BFloat16>(int, const at::BFloat16*, int64_t, int64_t,
                                               const uint8_t*, int64_t, at::BFloat16*,
                                               const at::BFloat16*);

namespace {

// (M, K) fp32 or bf16 rows -> (M, N) in x's dtype; plus `residual` (M, N) in x's dtype where
// given (linear_add).
template <int Bits>
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t N,
                  const std::optional<at::Tensor>& residual = std::nullopt) {
  const at::Tensor x =
      x_in.scalar_type() == at::kBFloat16 ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  check_args(x, w, N, Bits);
  at::Tensor r;
  if (residual.has_value()) {
    TORCH_CHECK(x_in.scalar_type() == x.scalar_type(), "linear_add: fp32 or bf16 rows only");
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->dim() == 2 &&
                    residual->size(0) == x.size(0) && residual->size(1) == N,
                "linear_add: residual must be (", x.size(0), ", ", N, ") ", x.scalar_type(),
                ", got ", residual->sizes(), " ", residual->scalar_type());
    r = residual->contiguous();
  }
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  const int64_t M = x.size(0), K = x.size(1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kBFloat16)
    run<Bits, at::BFloat16>(x.data_ptr<at::BFloat16>(), M, K, wp, N, y.data_ptr<at::BFloat16>(),
                            r.defined() ? r.data_ptr<at::BFloat16>() : nullptr);
  else
    run<Bits, float>(x.data_ptr<float>(), M, K, wp, N, y.data_ptr<float>(),
                     r.defined() ? r.data_ptr<float>() : nullptr);
  return x_in.scalar_type() == x.scalar_type() ? y : y.to(x_in.scalar_type());
}

}  // namespace

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  return linear<4>(x, w, N);
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  return linear<8>(x, w, N);
}

// residual (M, N) + x (M, K) W^T, the bits of `residual + linear(x, w, N)` (store_add): the
// decoder layer's two residual adds without an op or a tensor of their own.
at::Tensor w4a8_linear_add(const at::Tensor& x, const at::Tensor& w, int64_t N,
                           const at::Tensor& residual) {
  return linear<4>(x, w, N, residual);
}

// Whether the kernels take their AVX2 path from now on where AVX-512 VNNI would run (`force`);
// returns whether they do (always where AVX-512 VNNI is missing). The bits are the same either
// way: tests and benchmarks switch it.
bool w4a8_use_avx2(bool force) {
  avx2_wanted.store(force, std::memory_order_relaxed);
  return avx2_on();
}

// Whether the AVX2 path's tiles take a block's two halves together from now on (`enable`, the
// default, measured faster for every tile) or each over all groups in turn; returns the setting.
// The bits are the same either way: benchmarks and tests switch it.
bool w4a8_avx2_together(bool enable) {
  avx2_together_wanted.store(enable, std::memory_order_relaxed);
  return enable;
}

// Whether tiles of 16 rows go through AMX from now on (`enable`, where the CPU and OS allow it);
// returns whether they do. The bits are the same either way: benchmarks and tests switch it.
bool w4a8_use_amx(bool enable) {
  amx_wanted.store(enable, std::memory_order_relaxed);
  return amx_on();
}

// The fewest rows of a forward (1-16) that AMX takes in one tile from now on, for the kernel of
// `bits` (4 or 8) bits; returns the last setting. A forward of 16 rows or more tiles by 16.
int64_t w4a8_amx_min_rows(int64_t bits, int64_t rows) {
  TORCH_CHECK(bits == 4 || bits == 8, "amx_min_rows: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(rows >= 1 && rows <= kAmxRows, "amx_min_rows: 1 to ", kAmxRows, ", got ", rows);
  return (bits == 4 ? amx_min_rows4 : amx_min_rows8).exchange(static_cast<int>(rows));
}

TORCH_LIBRARY(eaglespec_w4a8, m) {
  m.def("linear(Tensor x, Tensor w, int N) -> Tensor");
  m.def("linear8(Tensor x, Tensor w, int N) -> Tensor");
  m.def("linear_add(Tensor x, Tensor w, int N, Tensor residual) -> Tensor");
  m.def("supported() -> bool");
  m.def("use_amx(bool enable) -> bool");
  m.def("avx2_together(bool enable) -> bool");
  m.def("use_avx2(bool force) -> bool");
  m.def("amx_min_rows(int bits, int rows) -> int");
}

TORCH_LIBRARY_IMPL(eaglespec_w4a8, CPU, m) {
  m.impl("linear", &w4a8_linear);
  m.impl("linear8", &w8a8_linear);
  m.impl("linear_add", &w4a8_linear_add);
}

TORCH_LIBRARY_IMPL(eaglespec_w4a8, CompositeExplicitAutograd, m) {
  m.impl("supported", &w4a8_supported);
  m.impl("use_amx", &w4a8_use_amx);
  m.impl("avx2_together", &w4a8_avx2_together);
  m.impl("use_avx2", &w4a8_use_avx2);
  m.impl("amx_min_rows", &w4a8_amx_min_rows);
}
