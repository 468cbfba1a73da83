// The two limits a CPU matmul kernel meets, measured on the machine at hand
// (benchmarks/roofline.py turns them into a roofline for the w4a8 kernels):
//
// stream(buf): read a byte buffer once with 512-bit loads, split among the threads as
//   at::parallel_for splits the kernels' weights; returns a checksum so the reads stay.
//   Bytes / seconds is the streaming bandwidth the decode kernels can reach.
// vnni(iters): per thread, iters rounds of 16 independent vpdpbusd chains (enough to cover
//   the instruction's latency on current x86 cores); returns a checksum. 64 int8 multiply-adds
//   per instruction, so 1024 * iters * threads / seconds is the VNNI peak.
// maddubs(iters): per thread, iters rounds of 12 independent vpmaddubsw on 256 bits (the AVX2
//   kernels' multiply, 32 int8 multiply-adds an instruction), for CPUs without AVX-512 VNNI;
//   12 * iters * threads / seconds is its peak. stream() reads with 256-bit loads there.
// matrices(xs, ws, ns, bits): each w4a8 matrix ws[i] (ns[i] outputs) over its rows xs[i], in
//   turn, through eaglespec_w4a8's linear (bits 4) or linear8 (bits 8) by the dispatcher, as
//   the fused layer calls them (csrc/layer.cpp): a pass over a model's matrices without Python
//   between them (about 10 us a call on a 2-core VM, as much as a small matrix's whole time).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
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

// 12 vpmaddubsw a round, each writing its own register from the same two operands: no result is
// read again, so the rounds measure how many the core issues a cycle, not their latency. In
// assembly, as a compiler would hoist the loop-invariant products out of the loop (and with
// arrays of chains in C++ GCC spilled to the stack: a third of this rate on a Zen 3, session 56).
EAGLESPEC_AVX2_TARGET int64_t maddubs_thread(int64_t iters, int seed) {
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(static_cast<char>(seed | 1));
  for (int64_t it = 0; it < iters; ++it)
    asm volatile(
        "vpmaddubsw %1, %0, %%ymm0\n\t"
        "vpmaddubsw %1, %0, %%ymm1\n\t"
        "vpmaddubsw %1, %0, %%ymm2\n\t"
        "vpmaddubsw %1, %0, %%ymm3\n\t"
        "vpmaddubsw %1, %0, %%ymm4\n\t"
        "vpmaddubsw %1, %0, %%ymm5\n\t"
        "vpmaddubsw %1, %0, %%ymm6\n\t"
        "vpmaddubsw %1, %0, %%ymm7\n\t"
        "vpmaddubsw %1, %0, %%ymm8\n\t"
        "vpmaddubsw %1, %0, %%ymm9\n\t"
        "vpmaddubsw %1, %0, %%ymm10\n\t"
        "vpmaddubsw %1, %0, %%ymm11\n\t"
        : "+x"(a)
        : "x"(b)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11");
  return _mm256_extract_epi64(_mm256_maddubs_epi16(a, b), 0);
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

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);

int64_t matrices(at::TensorList xs, at::TensorList ws, at::IntArrayRef ns, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "roofline.matrices: 4 or 8 bits, got ", bits);
  TORCH_CHECK(xs.size() == ws.size() && ws.size() == ns.size(),
              "roofline.matrices: one input, weight and output size a matrix");
  static const auto linear = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("eaglespec_w4a8::linear", "")
                                 .typed<Linear>();
  static const auto linear8 = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("eaglespec_w4a8::linear8", "")
                                  .typed<Linear>();
  const auto& op = bits == 4 ? linear : linear8;
  for (size_t i = 0; i < ws.size(); ++i) op.call(xs[i], ws[i], ns[i]);
  return static_cast<int64_t>(ws.size());
}

bool supported() { return cpu_supported(); }
bool has_vnni() { return vnni_supported(); }

}  // namespace

TORCH_LIBRARY(eaglespec_roofline, m) {
  m.def("stream(Tensor buf) -> int");
  m.def("vnni(int iters) -> int");
  m.def("maddubs(int iters) -> int");
  m.def("matrices(Tensor[] xs, Tensor[] ws, int[] ns, int bits) -> int");
  m.def("supported() -> bool");
  m.def("has_vnni() -> bool");
}

TORCH_LIBRARY_IMPL(eaglespec_roofline, CPU, m) {
  m.impl("stream", &stream);
  m.impl("matrices", &matrices);
}

TORCH_LIBRARY_IMPL(eaglespec_roofline, CompositeExplicitAutograd, m) {
  m.impl("vnni", &vnni);
  m.impl("maddubs", &maddubs);
  m.impl("supported", &supported);
  m.impl("has_vnni", &has_vnni);
}
