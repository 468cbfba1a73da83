// One team of threads for a whole forward of a few rows (csrc/layer.cpp's decoder, stack and
// head ops), instead of one OpenMP parallel region for every matrix, attention and row op.
//
// A decode step of SmolLM2 runs about 150 parallel regions (four matrices and attention in each
// of 30 layers), each forked and joined (0.8 us for an empty one on a 2-core Zen 3 VM, against
// 0.1 us to hand out work here, measured in session 57), the worker waiting while the calling
// thread runs the serial ops between. `run(body)` starts the team once: the calling thread
// (thread 0) runs `body`, the forward, and the other threads spin until it hands them work. A
// kernel splits its work with `parallel_for` below, which inside a team hands each thread its
// chunk (a store and a spin, not a fork and a join) and outside one is at::parallel_for. The
// chunks start as at::parallel_for's, taken in pieces (Job), and every row and output is
// computed the same whichever thread takes it, so the bits are the same either way
// (tests/test_cpu_layer.py compares the two). Alone the team measured 0.98-1.02x the forward's
// time; with the layer's kernels called directly (layer.cpp's native_layer), which leaves less
// serial work between the kernels, 0.87-0.97x (BENCHMARKS.md, session 57).
//
// Within a team, ATen's own ops called by thread 0 see an OpenMP region and run on that thread
// alone: the fused layer keeps to kernels that split through here, and the layer ops start a
// team only for a few rows (kTeamRows), where ATen's ops between the kernels are tiny.
//
// The engine's kernels are built into one library (model/extension.py) so that they share the
// thread-local team of the thread that runs the forward; a kernel built alone (a benchmark's
// variant) never sees one and runs as before.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <utility>

#include <immintrin.h>

namespace team {

// Rows (batch x tokens) of a forward up to which the layer ops run it in one team: decode
// steps, verifications and draft steps; a prefill's chunk forks per kernel as before (its
// kernels' work dwarfs a fork, and its ATen ops want the threads).
constexpr int64_t kTeamRows = 64;

// Pieces a chunk is taken in: enough that the last ones even the threads out, few enough that
// taking one (a compare-and-swap, and a call of the kernel's loop) costs nothing beside it.
constexpr int64_t kPieces = 8;

// Most threads a team takes (more are run without one).
constexpr int kMaxThreads = 64;

// A chunk of a job's range still to run: items [front, back) after the job's begin, packed in
// one word (front in the low half) so that its owner takes pieces from the front and a thread
// that has finished its own chunk takes them from the back, each with one compare-and-swap.
struct alignas(64) Chunk {
  std::atomic<uint64_t> span{0};
};

inline uint64_t pack(int64_t front, int64_t back) {
  return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
}

// The next piece of `c` from its front (its owner) or its back (another thread): true and
// [b, e) (after the job's begin) if one was left.
inline bool take(Chunk& c, int64_t piece, bool from_back, int64_t& b, int64_t& e) {
  uint64_t v = c.span.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t front = static_cast<int64_t>(v & 0xFFFFFFFFu), back = static_cast<int64_t>(v >> 32);
    if (front >= back) return false;
    b = from_back ? std::max(front, back - piece) : front;
    e = from_back ? back : std::min(back, front + piece);
    const uint64_t next = from_back ? pack(front, b) : pack(e, back);
    if (c.span.compare_exchange_weak(v, next, std::memory_order_relaxed)) return true;
  }
}

// The work thread 0 hands out: f(begin, end) over [begin, end), first split into `tasks` chunks
// as at::parallel_for splits it, each chunk's thread taking pieces of `piece` items from its
// front; a thread done with its own takes the other chunks' last pieces, so that a thread slowed
// down (another thread on its core, a late start) does not hold the rest up (measured, session
// 57: SmolLM2's one-row step had thread 0 waiting 6% of its time for the other, 11% at 4 rows).
struct Job {
  void (*call)(const void* f, int64_t begin, int64_t end);
  const void* f;
  int64_t begin, piece;
  int tasks;
  Chunk chunks[kMaxThreads];
};

struct State {
  std::atomic<uint64_t> generation{0};  // bumped by thread 0 for each job (and to stop)
  std::atomic<int> done{0};             // workers finished with the current job
  std::atomic<bool> stop{false};
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // a worker's exception, rethrown by thread 0
  Job job;
  int threads = 1;
};

// The team the calling thread leads, if any (null on workers and outside a team).
inline thread_local State* led = nullptr;

// Whether teams are used (the layer ops' `use_team`; tests and benchmarks switch it).
inline std::atomic<bool> wanted{true};

// One round of a wait: a pause, and after 16,384 of them (0.4 ms on a Zen 3, whose pause takes
// 24 ns, measured; longer than any gap between a forward's kernels) a yield of the core as well,
// so that a thread waiting on a descheduled one (more threads than free cores) does not hold the
// core the other needs.
inline void relax(uint32_t& rounds) {
  _mm_pause();
  if (++rounds > (1u << 14)) sched_yield();
}

// Thread `tid`'s part of the job: its own chunk's pieces from the front, then the others'
// from the back. Threads beyond the job's chunks take none (a job split fewer ways than there
// are threads is too small to share wider).
inline void run_chunk(State& s, int tid) {
  Job& j = s.job;
  if (tid >= j.tasks) return;
  int64_t b, e;
  while (take(j.chunks[tid], j.piece, false, b, e)) j.call(j.f, j.begin + b, j.begin + e);
  for (int k = 1; k < j.tasks; ++k) {
    Chunk& other = j.chunks[(tid + k) % j.tasks];
    while (take(other, j.piece, true, b, e)) j.call(j.f, j.begin + b, j.begin + e);
  }
}

// A worker: each job's chunk as it comes, until thread 0 stops the team.
inline void work(State& s, int tid) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t g;
    uint32_t rounds = 0;
    while ((g = s.generation.load(std::memory_order_acquire)) == seen) relax(rounds);
    seen = g;
    if (s.stop.load(std::memory_order_relaxed)) return;
    try {
      run_chunk(s, tid);
    } catch (...) {
      if (!s.failed.exchange(true)) s.error = std::current_exception();
    }
    s.done.fetch_add(1, std::memory_order_release);
  }
}

// f over [begin, end), split as at::parallel_for splits it: inline below `grain` items (or on
// one thread, or from inside a chunk), else in min(threads, ceil(n / grain)) chunks of equal
// size. Through the team thread 0 leads where there is one, else at::parallel_for.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  State* s = led;
  if (s == nullptr) return at::parallel_for(begin, end, grain, f);
  if (begin >= end) return;
  const int64_t n = end - begin;
  if (n <= grain || s->threads == 1 || n >= (int64_t{1} << 31)) return f(begin, end);
  int64_t tasks = s->threads;
  if (grain > 0) tasks = std::min(tasks, (n + grain - 1) / grain);
  if (tasks <= 1) return f(begin, end);
  const int64_t chunk = (n + tasks - 1) / tasks;
  Job& j = s->job;
  j.call = [](const void* fp, int64_t b, int64_t e) { (*static_cast<const F*>(fp))(b, e); };
  j.f = &f;
  j.begin = begin;
  j.piece = std::max<int64_t>(1, chunk / kPieces);
  j.tasks = static_cast<int>(tasks);
  for (int t = 0; t < j.tasks; ++t)
    j.chunks[t].span.store(pack(std::min(n, t * chunk), std::min(n, (t + 1) * chunk)),
                           std::memory_order_relaxed);
  s->done.store(0, std::memory_order_relaxed);
  led = nullptr;  // a parallel_for inside thread 0's chunk runs inline, as at::parallel_for's
  s->generation.fetch_add(1, std::memory_order_release);
  std::exception_ptr mine;
  try {
    run_chunk(*s, 0);
  } catch (...) {
    mine = std::current_exception();
  }
  uint32_t rounds = 0;
  while (s->done.load(std::memory_order_acquire) != s->threads - 1) relax(rounds);
  led = s;
  if (mine) std::rethrow_exception(mine);
  if (s->failed.exchange(false)) std::rethrow_exception(std::exchange(s->error, nullptr));
}

// body() with a team of at::get_num_threads() threads led by the calling thread (see the top);
// body() alone where teams are off, on one thread, inside a team or inside a parallel region.
template <typename F>
void run(const F& body) {
  const int threads = at::get_num_threads();
  if (!wanted.load(std::memory_order_relaxed) || threads <= 1 || threads > kMaxThreads ||
      led != nullptr ||
      at::in_parallel_region())
    return body();
  State s;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    if (tid == 0) {
      s.threads = omp_get_num_threads();  // read by workers only after a job's release
      led = &s;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      led = nullptr;
      s.stop.store(true, std::memory_order_relaxed);
      s.generation.fetch_add(1, std::memory_order_release);
    } else {
      work(s, tid);
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace team
