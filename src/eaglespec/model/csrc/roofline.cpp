// The two limits a CPU matmul kernel meets, measured on the machine at hand
// (benchmarks/roofline.py turns them into a roofline for the w4a8 kernels):
//
// stream(buf): read a byte buffer once with 512-bit loads, split among the threads as
//   at::parallel_for splits the kernels' weights; returns a checksum so the reads stay.
//   Bytes / seconds is the streaming bandwidth the decode kernels can reach.
// vnni(iters): per thread, iters rounds of 16 independent vpdpbusd chains (enough to cover
//   the instruction's latency on current x86 cores); returns a checksum. 64 int8 multiply-adds
//   per instruction, so 1024 * iters * threads / seconds is the VNNI peak.
// maddubs(iters): the same with vpmaddubsw on 256 bits (the AVX2 kernels' multiply, 32 int8
//   multiply-adds an instruction), for CPUs without AVX-512 VNNI. stream() reads with 256-bit
//   loads there.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "simd16_avx2.h"  // avx2::supported(): where the w4a8 kernels take their AVX2 path

namespace {

#define ROOFLINE_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))

bool vnni_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

bool cpu_supported() { return vnni_supported() || avx2::supported(); }

ROOFLINE_TARGET int64_t stream_range(const uint8_t* p, int64_t n) {
  // four independent OR chains so the loads, not the ORs, bind
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  int64_t i = 0;
  for (; i + 256 <= n; i += 256) {
    a = _mm512_or_si512(a, _mm512_loadu_si512(p + i));
    b = _mm512_or_si512(b, _mm512_loadu_si512(p + i + 64));
    c = _mm512_or_si512(c, _mm512_loadu_si512(p + i + 128));
    d = _mm512_or_si512(d, _mm512_loadu_si512(p + i + 192));
  }
  const __m512i v = _mm512_or_si512(_mm512_or_si512(a, b), _mm512_or_si512(c, d));
  return _mm512_reduce_or_epi64(v);
}

EAGLESPEC_AVX2_TARGET int64_t stream_range_avx2(const uint8_t* p, int64_t n) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    a = _mm256_or_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_or_si256(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    c = _mm256_or_si256(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    d = _mm256_or_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i v = _mm256_or_si256(_mm256_or_si256(a, b), _mm256_or_si256(c, d));
  return _mm256_extract_epi64(v, 0) | _mm256_extract_epi64(v, 1) | _mm256_extract_epi64(v, 2) |
         _mm256_extract_epi64(v, 3);
}

int64_t stream(const at::Tensor& buf) {
  TORCH_CHECK(cpu_supported(), "roofline: this CPU lacks AVX2 (and AVX-512 VNNI)");
  TORCH_CHECK(buf.device().is_cpu() && buf.scalar_type() == at::kByte && buf.is_contiguous(),
              "roofline.stream: a contiguous CPU uint8 buffer");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t chunks = buf.numel() / 256;
  std::vector<int64_t> sums(at::get_num_threads(), 0);
  at::parallel_for(0, chunks, 1024, [&](int64_t c0, int64_t c1) {
    sums[at::get_thread_num()] |= vnni_supported()
                                      ? stream_range(p + c0 * 256, (c1 - c0) * 256)
                                      : stream_range_avx2(p + c0 * 256, (c1 - c0) * 256);
  });
  int64_t out = 0;
  for (int64_t s : sums) out |= s;
  return out;
}

ROOFLINE_TARGET int64_t vnni_thread(int64_t iters, int seed) {
  __m512i acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_epi32(seed + i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(static_cast<char>(seed | 1));
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  __m512i s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_epi32(s, acc[i]);
  return _mm512_reduce_add_epi32(s);
}

EAGLESPEC_AVX2_TARGET int64_t maddubs_thread(int64_t iters, int seed) {
  __m256i acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm256_set1_epi16(static_cast<int16_t>(seed + i));
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(static_cast<char>(seed | 1));
  // each chain feeds its own result back as the unsigned operand, so no round can be hoisted
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 16; ++i) acc[i] = _mm256_maddubs_epi16(_mm256_and_si256(acc[i], a), b);
  __m256i s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm256_add_epi16(s, acc[i]);
  return _mm256_extract_epi64(s, 0);
}

template <typename Fn>
int64_t per_thread(Fn fn) {
  const int threads = at::get_num_threads();
  std::vector<int64_t> sums(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) sums[t] = fn(static_cast<int>(t));
  });
  int64_t out = 0;
  for (int64_t s : sums) out += s;
  return out;
}

int64_t vnni(int64_t iters) {
  TORCH_CHECK(vnni_supported(), "roofline: this CPU lacks AVX-512 VNNI");
  return per_thread([&](int t) { return vnni_thread(iters, t); });
}

int64_t maddubs(int64_t iters) {
  TORCH_CHECK(avx2::supported(), "roofline: this CPU lacks AVX2 (with FMA and F16C)");
  return per_thread([&](int t) { return maddubs_thread(iters, t); });
}

bool supported() { return cpu_supported(); }
bool has_vnni() { return vnni_supported(); }

}  // namespace

TORCH_LIBRARY(eaglespec_roofline, m) {
  m.def("stream(Tensor buf) -> int");
  m.def("vnni(int iters) -> int");
  m.def("maddubs(int iters) -> int");
  m.def("supported() -> bool");
  m.def("has_vnni() -> bool");
}

TORCH_LIBRARY_IMPL(eaglespec_roofline, CPU, m) { m.impl("stream", &stream); }

TORCH_LIBRARY_IMPL(eaglespec_roofline, CompositeExplicitAutograd, m) {
  m.impl("vnni", &vnni);
  m.impl("maddubs", &maddubs);
  m.impl("supported", &supported);
  m.impl("has_vnni", &has_vnni);
}
