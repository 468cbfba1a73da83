// The two limits a CPU matmul kernel meets, measured on the machine at hand
// (benchmarks/roofline.py turns them into a roofline for the w4a8 kernels):
//
// stream(buf): read a byte buffer once with 512-bit loads, split among the threads as
//   at::parallel_for splits the kernels' weights; returns a checksum so the reads stay.
//   Bytes / seconds is the streaming bandwidth the decode kernels can reach.
// vnni(iters): per thread, iters rounds of 16 independent vpdpbusd chains (enough to cover
//   the instruction's latency on current x86 cores); returns a checksum. 64 int8 multiply-adds
//   per instruction, so 1024 * iters * threads / seconds is the VNNI peak.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace {

#define ROOFLINE_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

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

int64_t stream(const at::Tensor& buf) {
  TORCH_CHECK(cpu_supported(), "roofline: this CPU lacks AVX-512 VNNI");
  TORCH_CHECK(buf.device().is_cpu() && buf.scalar_type() == at::kByte && buf.is_contiguous(),
              "roofline.stream: a contiguous CPU uint8 buffer");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t chunks = buf.numel() / 256;
  std::vector<int64_t> sums(at::get_num_threads(), 0);
  at::parallel_for(0, chunks, 1024, [&](int64_t c0, int64_t c1) {
    sums[at::get_thread_num()] |= stream_range(p + c0 * 256, (c1 - c0) * 256);
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

int64_t vnni(int64_t iters) {
  TORCH_CHECK(cpu_supported(), "roofline: this CPU lacks AVX-512 VNNI");
  const int threads = at::get_num_threads();
  std::vector<int64_t> sums(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) sums[t] = vnni_thread(iters, static_cast<int>(t));
  });
  int64_t out = 0;
  for (int64_t s : sums) out += s;
  return out;
}

bool supported() { return cpu_supported(); }

}  // namespace

TORCH_LIBRARY(eaglespec_roofline, m) {
  m.def("stream(Tensor buf) -> int");
  m.def("vnni(int iters) -> int");
  m.def("supported() -> bool");
}

TORCH_LIBRARY_IMPL(eaglespec_roofline, CPU, m) { m.impl("stream", &stream); }

TORCH_LIBRARY_IMPL(eaglespec_roofline, CompositeExplicitAutograd, m) {
  m.impl("vnni", &vnni);
  m.impl("supported", &supported);
}
