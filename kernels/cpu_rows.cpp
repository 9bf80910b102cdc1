// Row-invariant tall-skinny product for the CPU engine: y[r, o] = sum_k x[r, k] * w[o, k]
// for the few rows r of one decode / verify step (1..W tokens) and every output o.
//
// Why: BLAS libraries pick kernels by shape, so a token's row rounds differently when it
// is computed alone or among n rows. Here every dot product runs the same instruction
// sequence whatever the number of rows and whatever its neighbours: one 8-wide FMA
// accumulator over k in order (blocks of 8), a fixed horizontal sum, then the scalar tail
// k >= K - K % 8 by std::fma (one rounding each: the same operation whatever the weight
// dtype; before bf16 the compiler chose per tile whether to contract it). How many weight rows and x rows share a pass only changes which dot
// products are in flight together, never the arithmetic of one of them, so a row's result
// is bit-identical for any R (tests/test_kernels_cpu.py checks it bit for bit).
//
// Memory: a step streams each weight row once (1-4 rows: 3-4 weight rows per pass against
// all x rows; more rows: 3 weight rows against blocks of 4 x rows), so 1..8 rows cost about the memory
// traffic of one. Measured on the 2-core AMD EPYC CI machine, all 211 weights of
// SmolLM2-135M: 1 / 4 / 8 rows 33-35 / 43-47 / 50-57 ms against MKL's 4- / 8-column
// products (the wx4 layout) 42-53 / 71-80 ms; streaming the same bytes (sum) takes 34 ms.
// Threads split the outputs o (torch's OpenMP team by default, or the work-sharing `Pool`
// where other processes share the cores: see "threads" below); a dot product never depends
// on the split.
//
// Dtypes: weights (and the KV cache) may be float32, bfloat16 or float16; each element is
// widened to float32 in registers (bf16: the 16 bits shifted left by 16; fp16: F16C
// `_mm256_cvtph_ps`), both exact, and every product and sum runs in float32 in the order
// above, so a bf16 / fp16 model reads half the bytes per step and a row stays bit-identical
// whatever the other rows. Activations are float32 in and out (x given in bf16 / fp16 is
// widened exactly first); callers round outputs as they need.
//
// Every entry point checks its arguments (dtypes, CPU device, contiguity, shapes, non-zero
// sizes, slot and limit ranges) before any work and raises (RuntimeError) with a message that
// says what was wrong: it never divides by zero or reads past a buffer.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cfloat>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// 8 elements of a weight row / cache row as float32 (exact widening) and one element
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static inline float load1(const float* p) { return *p; }
};
template <>
struct Elem<c10::BFloat16> {
  static inline __m256 load8(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline float load1(const c10::BFloat16* p) { return static_cast<float>(*p); }
};
template <>
struct Elem<c10::Half> {
  static inline __m256 load8(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline float load1(const c10::Half* p) { return static_cast<float>(*p); }
};

template <>
struct Elem<int8_t> {  // the LM-head screen's int8 rows (exact small integers as float32)
  static inline __m256 load8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static inline float load1(const int8_t* p) { return static_cast<float>(*p); }
};

// f(T{}) with T the element type of a float32 / bfloat16 / float16 tensor
template <typename F>
inline void by_dtype(at::ScalarType s, const F& f) {
  switch (s) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", s);
  }
}

inline bool float_kind(const torch::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf;
}

// ---- threads ------------------------------------------------------------------------------
//
// Two ways to split a call's outputs over torch.get_num_threads() threads, chosen at run time
// by `rows_pool(mode)` (both compute every output with the same arithmetic, so results are
// bit for bit the same either way):
//  - default: torch's OpenMP team (at::parallel_for, static shares). Best where the cores
//    are the process's own: measured on a 2-core Xeon (the process alone on the cores), an
//    engine-like step (211 products, a 49152-row LM head, torch argmax / softmax between)
//    takes 23.4 / 29-30 / 36 ms with 1 / 4 / 8 rows.
//  - the work-sharing pool below: the same step 23-25 / 31-32 / 35-36 ms there (1.0 / 1.04-1.12
//    / 0.96-0.98x), but 2.5-10x faster than OpenMP where other processes busy the cores
//    (same machine with ~10 runnable threads: 99-118 / 154-178 / 179-218 ms against
//    250-343 / 517-1777 / 429-1818 ms), because nothing waits for an unscheduled thread.
//
// Chunks of a call run on torch.get_num_threads() threads: the calling thread and resident
// workers each claim the chunks of their own contiguous share first, then what is left of
// the others' (atomic counters), and the call returns once every claimed chunk is done. Which thread computes a chunk never changes its arithmetic. Unlike an OpenMP
// team (at::parallel_for) nothing waits for a thread that has not started: on a machine
// whose cores other processes also use, a worker the OS has not scheduled claims nothing
// and the caller computes its chunks, where an OpenMP barrier waits (with default spinning)
// for every thread of the team: measured on a 2-core Xeon shared with three busy
// processes, one step's products took 2.6 s with 2 OpenMP threads against 0.09 s with 1.
// Workers spin ~1 ms for the next call (a step's products follow one another within
// microseconds), then sleep on a condition variable. A call made while another thread's call
// holds the pool, or inside a parallel region, or in a forked child (no workers there: it
// claims every chunk itself), runs on the calling thread alone.
std::atomic<bool> g_use_pool{false};  // rows_pool(): false = OpenMP (at::parallel_for)
inline bool use_pool() { return g_use_pool.load(std::memory_order_relaxed); }

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: its detached workers may outlive exit
    return *pool;
  }

  // f(c) for every chunk c in [0, n), each on one thread
  template <typename F>
  void run(int64_t n, const F& f) {
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
    std::unique_lock<std::mutex> owner(submit_, std::try_to_lock);
    if (threads <= 1 || !owner.owns_lock() || at::in_parallel_region()) {
      for (int64_t c = 0; c < n; ++c) f(c);
      return;
    }
    start_workers(static_cast<int>(threads) - 1);
    auto job = std::make_shared<Job>();
    job->n = n;
    job->helpers = static_cast<int>(threads) - 1;
    job->fn = [&f](int64_t c) { f(c); };
    job->mxcsr = _mm_getcsr();  // the caller's denormal modes on every thread
    job->shares.reset(new Share[threads]);
    for (int64_t t = 0; t < threads; ++t) {
      job->shares[t].next.store(t * n / threads, std::memory_order_relaxed);
      job->shares[t].end = (t + 1) * n / threads;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      current_ = job;
      seq_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    work(*job, 0);
    // chunks claimed by workers: a worker holding one is running it (or preempted in it)
    for (int spins = 0; job->done.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096) _mm_pause();
      else sched_yield();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    current_.reset();  // a late worker finds no job; one holding `job` claims only c >= n
  }

 private:
  struct alignas(64) Share {  // the chunks [next, end) a thread takes first; others take the rest
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  struct Job {
    int64_t n = 0;
    int helpers = 0;
    unsigned mxcsr = 0;
    std::function<void(int64_t)> fn;
    std::unique_ptr<Share[]> shares;
    std::atomic<int64_t> done{0};
  };

  // thread t (0: the caller) takes its own contiguous share of the chunks first (each
  // thread streams its own part of the weights, as a static split would), then what is left
  // of the others' shares: a thread that has not started leaves its share to the others
  static void work(Job& job, int t) {
    const int T = job.helpers + 1;
    for (int i = 0; i < T; ++i) {
      Share& share = job.shares[(t + i) % T];
      for (int64_t c; (c = share.next.fetch_add(1, std::memory_order_relaxed)) < share.end;) {
        job.fn(c);
        job.done.fetch_add(1, std::memory_order_release);
      }
    }
  }

  void start_workers(int count) {  // with submit_ held
    while (static_cast<int>(workers_) < count) {
      const int id = static_cast<int>(workers_++);
      std::thread([this, id] { worker(id); }).detach();
    }
  }

  void worker(int id) {
    uint64_t seen = seq_.load(std::memory_order_acquire);
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(1000);
      for (int i = 0; seq_.load(std::memory_order_acquire) == seen; ++i) {
        _mm_pause();
        if ((i & 255) == 255) {
          if (std::chrono::steady_clock::now() > until) break;
          if (i >= 2048) sched_yield();  // a thread waiting for this core (torch's own) runs first
        }
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return seq_.load(std::memory_order_acquire) != seen; });
        seen = seq_.load(std::memory_order_acquire);
        job = current_;
      }
      if (job && id < job->helpers) {
        _mm_setcsr(job->mxcsr);
        work(*job, id + 1);
      }
    }
  }

  std::mutex submit_;  // one call at a time uses the workers
  std::mutex mutex_;   // current_ and the wake-ups
  std::condition_variable wake_;
  std::shared_ptr<Job> current_;
  std::atomic<uint64_t> seq_{0};
  size_t workers_ = 0;
};

// f(o0, o1) over [0, O) in chunks of whole 12-row groups (every tile height divides 12),
// about 8 chunks per thread so that a slow thread's share is taken by the others
template <typename F>
void for_outputs(int64_t O, const F& f) {
  if (!use_pool()) {  // the default: torch's OpenMP team, outputs split in static shares
    at::parallel_for(0, O, 64, f);
    return;
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = std::max<int64_t>(12, (O + 8 * threads * 12 - 1) / (8 * threads * 12) * 12);
  const int64_t n = (O + chunk - 1) / chunk;
  Pool::get().run(n, [&](int64_t c) { f(c * chunk, std::min(O, (c + 1) * chunk)); });
}

// NW weight rows (w, stride K) times NX x rows (x, stride K); y[c * O + o + i].
// NW and NX are compile-time so the NW * NX accumulators live in registers. With NREAL < NX
// only NREAL x rows exist: the tile's spare columns re-read the last one and are not stored
// (3 rows run in the 4-row tile this way, faster than a 3-row tile on a 2-core Xeon, layer
// weights 19.5 vs 21.2 ms; each stored dot product's arithmetic is the same either way).
// (never inlined: inlined into its caller's loop, the 3 x 4 tile's 16 registers spilled: 4 rows
// 10-17% slower)
template <typename T, int NW, int NX, int NREAL = NX>
__attribute__((noinline)) void tile(const T* __restrict w, const float* __restrict x, int64_t K, int64_t O,
                 int64_t o, float* __restrict y) {
  __m256 acc[NW][NX];
#pragma GCC unroll 8
  for (int i = 0; i < NW; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NX; ++c) acc[i][c] = _mm256_setzero_ps();
  // software prefetch of each weight row ahead, once per 64-byte line: it changes no
  // arithmetic, only keeps memory busy while the x rows are multiplied. The rows are
  // contiguous (one run of memory) and a tile reads NW of them side by side, so a distance of
  // one row (8 KiB: a 2048-column float32 row) fetches what the tile reads next anyway; the
  // distance is at least one whole tile (NW rows: the next tile's same column) and at least
  // 8 KiB (short rows, SmolLM2's 576 columns). Into L2 only (T1): 3-4 weight rows 8 KiB
  // ahead would fill a 32 KiB L1 (AMD EPYC's) and push out the x rows. Measured
  // (docs/changelog.md, sessions 7 and 21): 8 KiB against 1-4 KiB on SmolLM2's
  // shapes; one tile against 8 KiB on a 0.82B model's (2048 and 5632 columns), 1-30% faster
  // products in float32 and bf16 from 1 to 8 rows, SmolLM2's unchanged.
  static_assert(NX <= 4, "the tiles hold at most 4 x rows (run_blocks for more)");
  constexpr int64_t MIN_PF_BYTES = 8192;
  const int64_t PF = std::max<int64_t>(MIN_PF_BYTES / static_cast<int64_t>(sizeof(T)), NW * K);
  constexpr int64_t LINE = 64 / static_cast<int64_t>(sizeof(T));
  const int64_t k8 = K - K % 8;
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NW];
#pragma GCC unroll 8
    for (int i = 0; i < NW; ++i) wv[i] = Elem<T>::load8(w + i * K + k);
    if ((k & (LINE - 1)) == 0) {
#pragma GCC unroll 8
      for (int i = 0; i < NW; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + i * K + k + PF), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int c = 0; c < NX; ++c) {
      const __m256 xv = _mm256_loadu_ps(x + (c < NREAL ? c : NREAL - 1) * K + k);
#pragma GCC unroll 8
      for (int i = 0; i < NW; ++i) acc[i][c] = _mm256_fmadd_ps(wv[i], xv, acc[i][c]);
    }
  }
  for (int i = 0; i < NW; ++i) {
    for (int c = 0; c < NREAL; ++c) {
      float s = hsum(acc[i][c]);
      const T* wi = w + i * K;
      const float* xc = x + c * K;
      for (int64_t k = k8; k < K; ++k) s = std::fma(Elem<T>::load1(wi + k), xc[k], s);
      y[c * O + o + i] = s;
    }
  }
}

// all R <= 8 rows against every weight row, NW weight rows per tile
// outputs [o0, o1) of all R <= 4 rows, NW weight rows per tile; weight row o at w + (o - o0) * K
template <typename T, int NW, int NX, int NREAL = NX>
void range_tiles(const T* w, const float* xp, float* yp, int64_t K, int64_t O, int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + NW <= o1; o += NW) tile<T, NW, NX, NREAL>(w + (o - o0) * K, xp, K, O, o, yp);
  for (; o < o1; ++o) tile<T, 1, NX, NREAL>(w + (o - o0) * K, xp, K, O, o, yp);
}

template <typename T, int NW, int NX, int NREAL = NX>
void run(const T* wp, const float* xp, float* yp, int64_t K, int64_t O) {
  for_outputs(O, [&](int64_t o0, int64_t o1) { range_tiles<T, NW, NX, NREAL>(wp + o0 * K, xp, yp, K, O, o0, o1); });
}

// NW weight rows against x rows [r0, r0 + n), n in 1..4, in the NW x 4 tile
template <typename T, int NW>
inline void tile_block(const T* w, const float* x, int64_t K, int64_t O, int64_t o, float* y, int64_t n) {
  switch (n) {
    case 1: tile<T, NW, 1>(w, x, K, O, o, y); break;
    case 2: tile<T, NW, 2>(w, x, K, O, o, y); break;
    case 3: tile<T, NW, 4, 3>(w, x, K, O, o, y); break;
    default: tile<T, NW, 4>(w, x, K, O, o, y); break;
  }
}

// R >= 5 rows: three weight rows at a time against the rows in blocks of 4 (3 x 4 tiles: 12
// FMAs for 7 loads, where one weight row against 8 x rows takes 9 loads for 8 FMAs); the
// three weight rows are read from memory once and from L1 for the next blocks, so the step
// streams its weights once. Measured on a 2-core Xeon, all SmolLM2 products, A/B in one
// process: 24 / 32 / 64 rows 70 / 90 / 177 ms in 8-row blocks of one weight row (run_many,
// since removed) against 59 / 71 / 123 ms here; once the 4-row tiles prefetched 8 KiB ahead,
// also at 5 / 8 / 9 / 12 / 16 rows (20.97 / 22.22 / 26.76 / 29.57 / 34.21 ms with the 5-8 row
// tiles and run_many against 18.90 / 20.84 / 22.45 / 25.50 / 31.16 ms here; whole verify
// steps at 5 / 6 / 7 / 8 rows 29.0 / 30.9 / 31.4 / 33.0 -> 26.6 / 28.1 / 29.0 / 29.5 ms)
// outputs [o0, o1) of all R rows in 3 x 4 tiles; weight row o at w + (o - o0) * K
template <typename T>
void range_blocks(const T* w, const float* xp, float* yp, int64_t R, int64_t K, int64_t O, int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + 3 <= o1; o += 3)
    for (int64_t r0 = 0; r0 < R; r0 += 4)
      tile_block<T, 3>(w + (o - o0) * K, xp + r0 * K, K, O, o, yp + r0 * O, std::min<int64_t>(4, R - r0));
  for (; o < o1; ++o)
    for (int64_t r0 = 0; r0 < R; r0 += 4)
      tile_block<T, 1>(w + (o - o0) * K, xp + r0 * K, K, O, o, yp + r0 * O, std::min<int64_t>(4, R - r0));
}

template <typename T>
void run_blocks(const T* wp, const float* xp, float* yp, int64_t R, int64_t K, int64_t O) {
  for_outputs(O, [&](int64_t o0, int64_t o1) { range_blocks<T>(wp + o0 * K, xp, yp, R, K, O, o0, o1); });
}

// ---- AVX-512: two x rows per register ---------------------------------------------------
//
// On CPUs with AVX-512 (F, DQ, BW, VL), products of 16-bit weights with 32 or more rows pair
// the x rows: one 16-lane register holds the 8-lane accumulators of two dot products (rows
// 2p and 2p + 1, same weight row), each weight block is widened once and broadcast into both
// halves, and the two rows' x blocks come pre-packed side by side. Each lane still runs
// fma(w[k + j], x[k + j], acc_j) over k in order, and each half ends in the same `hsum` and
// scalar tail, so every dot product is bit-identical to the 8-lane tiles above
// (tests/test_kernels_cpu.py compares the two paths bit for bit). Measured on a 2-core Xeon,
// A/B in one process: bf16 SmolLM2 step products at 8 / 12 / 16 / 64 rows 1.10 / 1.25 / 1.17 / 1.10x
// faster (fewer widenings and x loads), a 0.82B model's at 8 rows 1.37x; slower at 3-4 rows
// and for float32 weights at every row count (0.65-0.98x), which keep the 8-lane tiles. Since
// the 4-row tiles prefetch 8 KiB ahead, run_blocks is faster up to 24 rows (bf16 SmolLM2 step
// products, 6 / 8 / 12 / 16 / 24 rows 12.7 / 14.7 / 19.8 / 25.3 / 36.2 ms against paired
// 14.0 / 16.3 / 21.8 / 26.2 / 37.9 ms), the pairs from 32 rows (46.3 / 88.2 ms at 32 / 64
// rows against 47.6 / 91.1 ms).
std::atomic<bool> g_wide_on{true};  // rows_isa(): false = the 8-lane tiles everywhere
inline bool wide_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return ok;
}
inline bool use_wide() { return wide_supported() && g_wide_on.load(std::memory_order_relaxed); }

#define WIDE_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))

// 8 elements of a weight row, widened exactly, in both 256-bit halves of a 512-bit register
template <typename T>
struct Wide;
template <>
struct Wide<c10::BFloat16> {
  WIDE_TARGET static inline __m512 load8x2(const c10::BFloat16* p) {
    const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};
template <>
struct Wide<c10::Half> {
  WIDE_TARGET static inline __m512 load8x2(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};

// x rows packed in pairs: xpk[(b * P + p) * 16 + h * 8 + j] = x[2p + h][8b + j] for the
// K8 = K - K % 8 leading columns (an odd R repeats its last row in the spare half)
inline void pack_pairs(const float* x, int64_t R, int64_t K, std::vector<float>& xpk) {
  const int64_t P = (R + 1) / 2, B = K / 8;
  xpk.resize(static_cast<size_t>(B * P * 16));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t r = std::min(2 * p + h, R - 1);
        std::memcpy(&xpk[(b * P + p) * 16 + h * 8], x + r * K + 8 * b, 8 * sizeof(float));
      }
}

// NW weight rows against NP row pairs [p0, p0 + NP) of the P packed pairs; rows >= R unstored
template <typename T, int NW, int NP>
WIDE_TARGET __attribute__((noinline)) void wide_tile(const T* __restrict w, const float* __restrict xpk,
                                                     const float* __restrict x, int64_t P, int64_t p0, int64_t R,
                                                     int64_t K, int64_t O, int64_t o, float* __restrict y) {
  __m512 acc[NW][NP];
#pragma GCC unroll 8
  for (int i = 0; i < NW; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) acc[i][c] = _mm512_setzero_ps();
  // each weight row prefetched 4 KiB ahead (the distance measured for these tiles)
  constexpr int64_t PF_BYTES = 4096;
  constexpr int64_t PF = PF_BYTES / static_cast<int64_t>(sizeof(T));
  constexpr int64_t LINE = 64 / static_cast<int64_t>(sizeof(T));
  const int64_t k8 = K - K % 8;
  const float* xb = xpk + p0 * 16;
  for (int64_t k = 0; k < k8; k += 8, xb += P * 16) {
    __m512 wv[NW];
#pragma GCC unroll 8
    for (int i = 0; i < NW; ++i) wv[i] = Wide<T>::load8x2(w + i * K + k);
    if ((k & (LINE - 1)) == 0) {
#pragma GCC unroll 8
      for (int i = 0; i < NW; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + i * K + k + PF), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) {
      const __m512 xv = _mm512_loadu_ps(xb + c * 16);
#pragma GCC unroll 8
      for (int i = 0; i < NW; ++i) acc[i][c] = _mm512_fmadd_ps(wv[i], xv, acc[i][c]);
    }
  }
  for (int i = 0; i < NW; ++i) {
    const T* wi = w + i * K;
    for (int c = 0; c < NP; ++c) {
      const __m256 halves[2] = {_mm512_castps512_ps256(acc[i][c]), _mm512_extractf32x8_ps(acc[i][c], 1)};
      for (int h = 0; h < 2; ++h) {
        const int64_t r = 2 * (p0 + c) + h;
        if (r >= R) continue;
        float s = hsum(halves[h]);
        const float* xr = x + r * K;
        for (int64_t k = k8; k < K; ++k) s = std::fma(Elem<T>::load1(wi + k), xr[k], s);
        y[r * O + o + i] = s;
      }
    }
  }
}

// NW weight rows against pairs [p0, p0 + n), n in 1..4
template <typename T, int NW>
inline void wide_block(const T* w, const float* xpk, const float* x, int64_t P, int64_t p0, int64_t R, int64_t K,
                       int64_t O, int64_t o, float* y) {
  switch (std::min<int64_t>(4, P - p0)) {
    case 1: wide_tile<T, NW, 1>(w, xpk, x, P, p0, R, K, O, o, y); break;
    case 2: wide_tile<T, NW, 2>(w, xpk, x, P, p0, R, K, O, o, y); break;
    case 3: wide_tile<T, NW, 3>(w, xpk, x, P, p0, R, K, O, o, y); break;
    default: wide_tile<T, NW, 4>(w, xpk, x, P, p0, R, K, O, o, y); break;
  }
}

// every row against every weight row, NW weight rows at a time against blocks of up to 4
// pairs (8 rows); the next block re-reads the NW weight rows from L1
template <typename T>
void run_wide(const T* wp, const float* xp, float* yp, int64_t R, int64_t K, int64_t O) {
  thread_local std::vector<float> xpk;
  pack_pairs(xp, R, K, xpk);
  const float* pk = xpk.data();
  const int64_t P = (R + 1) / 2;
  for_outputs(O, [&](int64_t o0, int64_t o1) {
    int64_t o = o0;
    for (; o + 4 <= o1; o += 4)
      for (int64_t p0 = 0; p0 < P; p0 += 4) wide_block<T, 4>(wp + o * K, pk, xp, P, p0, R, K, O, o, yp);
    for (; o < o1; ++o)
      for (int64_t p0 = 0; p0 < P; p0 += 4) wide_block<T, 1>(wp + o * K, pk, xp, P, p0, R, K, O, o, yp);
  });
}

template <typename T>
void linear_rows(const T* wp, const float* xp, float* yp, int64_t R, int64_t K, int64_t O) {
  if constexpr (sizeof(T) == 2) {  // paired rows (see run_wide): 16-bit weights, 32+ rows
    if (R >= 32 && use_wide()) {
      run_wide<T>(wp, xp, yp, R, K, O);
      return;
    }
  }
  switch (R) {  // registers: NW * NX accumulators + NW weight vectors + 1 x vector <= 16
    case 1: run<T, 4, 1>(wp, xp, yp, K, O); break;
    case 2: run<T, 4, 2>(wp, xp, yp, K, O); break;
    case 3: run<T, 3, 4, 3>(wp, xp, yp, K, O); break;  // the 4-row tile, 3 rows stored
    case 4: run<T, 3, 4>(wp, xp, yp, K, O); break;
    default: run_blocks<T>(wp, xp, yp, R, K, O);  // each dot product is still computed alike
  }
}

// ---- compact weights: float32 rows held as the exact quantized blocks they are -----------
//
// A float32 matrix dequantized from one of GGUF's block formats (a GGUF file loaded through
// transformers, as the embedded default model, a Q4_1 file, is) holds in every block of 32
// weights of a row only the values its format can give:
//  - Q4_1: fma(d, q, m), q in 0..15 (the lowest weight m, the highest m + 15 d, d a float16);
//  - Q4_0: d * (q - 8), q in 0..15 (the weight of largest magnitude at q = 0);
//  - Q8_0: d * q, q in -128..127 (the weight of largest magnitude at q = +-127).
// `rows_compact` finds such a d (and m) per block, trying the forms in that order, and keeps
// a matrix in the first form that reproduces **every weight bit for bit** (a Q4_1 d also has
// d * q exact for every q, so fma(d, q, m) and d * q + m round alike, whatever the compiler
// contracts; the two products are single roundings, as the kernels compute them); otherwise
// it returns an empty tensor and the float32 matrix is used. A block is 24 / 20 / 36 bytes
// for 128 float32 bytes (float32 d, Q4_1's float32 m, the codes), so a form's row width says
// which form it is. A product decodes each block in registers and runs the float32 tiles'
// arithmetic on it (`compact_tile`): every output is the float32 path's bit for bit
// (tests/test_compact.py compares them).
constexpr int64_t COMPACT_BLOCK = 32;  // weights per block
enum CompactForm : int { Q4_1_FORM = 0, Q4_0_FORM = 1, Q8_0_FORM = 2, COMPACT_FORMS = 3 };
constexpr int64_t FORM_BLOCK_BYTES[COMPACT_FORMS] = {24, 20, 36};

inline int64_t compact_row_bytes(int64_t K, int form) { return K / COMPACT_BLOCK * FORM_BLOCK_BYTES[form]; }

// the form of a compact matrix of K columns whose rows are row_bytes wide; -1 for none
inline int compact_form(int64_t K, int64_t row_bytes) {
  if (K <= 0 || K % COMPACT_BLOCK != 0) return -1;
  for (int f = 0; f < COMPACT_FORMS; ++f)
    if (row_bytes == compact_row_bytes(K, f)) return f;
  return -1;
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Q4_1: d * q exact in float32 for every q in 0..15: d zero, or a normal d whose significand
// has at most 20 bits and whose product with 15 stays normal and finite
inline bool exact_multiples(float d) {
  if (d == 0.0f) return float_bits(d) == 0;
  return std::isnormal(d) && (float_bits(d) & 0xF) == 0 && std::isfinite(d * 15.0f);
}

// the block's codes (q[j] for weight j) if every weight is `value(d, m, q)` bit for bit for
// the nearest q in [lo, hi] to `guess(w)`
template <typename V, typename G>
inline bool block_codes(const float* w, int lo, int hi, const V& value, const G& guess, int* q) {
  for (int64_t j = 0; j < COMPACT_BLOCK; ++j) {
    const float est = std::nearbyint(guess(w[j]));
    if (!(est >= static_cast<float>(lo) && est <= static_cast<float>(hi))) return false;
    q[j] = static_cast<int>(est);
    if (float_bits(value(q[j])) != float_bits(w[j])) return false;
  }
  return true;
}

// 4-bit codes: byte j holds weight j in its low nibble, weight j + 16 in its high one
inline void store_nibbles(const int* q, uint8_t* codes) {
  for (int64_t j = 0; j < 16; ++j) codes[j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
}

inline float half_rounded(float f) { return static_cast<float>(c10::Half(f)); }

// one block of 32 finite weights (lowest lo, highest hi, largest magnitude at index big) in
// form F; false when none of the form's candidate d reproduces it
inline bool encode_block(const float* w, float lo, float hi, int64_t big, int form, uint8_t* out) {
  int q[COMPACT_BLOCK];
  if (form == Q4_1_FORM) {
    auto take = [&](float d) {
      if (!exact_multiples(d)) return false;
      const float inv = d != 0.0f ? 1.0f / d : 0.0f;
      if (!block_codes(w, 0, 15, [&](int c) { return std::fma(d, static_cast<float>(c), lo); },
                       [&](float x) { return (x - lo) * inv; }, q))
        return false;
      std::memcpy(out, &d, 4);
      std::memcpy(out + 4, &lo, 4);
      store_nibbles(q, out + 8);
      return true;
    };
    if (hi == lo) return take(0.0f);
    // d a float16: (hi - lo) / 15 lies within a few ulps of it
    const float d0 = (hi - lo) / 15.0f;
    if (!std::isfinite(d0)) return false;
    const float down = std::nextafter(d0, 0.0f), up = std::nextafter(d0, INFINITY);
    for (float d : {half_rounded(d0), d0, down, up, std::nextafter(down, 0.0f), std::nextafter(up, INFINITY)})
      if (take(d)) return true;
    return false;
  }
  auto symmetric = [&](float d, int lo_q, int hi_q, int offset) {
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    if (!block_codes(w, lo_q, hi_q, [&](int c) { return d * static_cast<float>(c - offset); },
                     [&](float x) { return x * inv + static_cast<float>(offset); }, q))
      return false;
    std::memcpy(out, &d, 4);
    if (offset == 0)
      for (int64_t j = 0; j < COMPACT_BLOCK; ++j) out[4 + j] = static_cast<uint8_t>(static_cast<int8_t>(q[j]));
    else
      store_nibbles(q, out + 4);
    return true;
  };
  if (form == Q4_0_FORM)  // d = w[big] / -8 exactly (q = 0 there); an all-zero block: d = -0.0 gives -0.0
    return symmetric(w[big] / -8.0f, 0, 15, 8) || (w[big] == 0.0f && symmetric(-0.0f, 0, 15, 8));
  // Q8_0: d = |w[big]| / 127 (q = +-127 there), a float16
  const float d0 = std::fabs(w[big]) / 127.0f;
  for (float d : {d0, half_rounded(d0), std::nextafter(d0, 0.0f), std::nextafter(d0, INFINITY)})
    if (symmetric(d, -128, 127, 0)) return true;
  return false;
}

// weights 8s..8s+7 of a block in form F, widened exactly: d (and m) already broadcast
template <int F>
inline __m256 decode_part(const uint8_t* blk, int s, __m256 d, __m256 m) {
  if constexpr (F == Q8_0_FORM) {
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 4 + 8 * s)));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
  } else {
    // the low nibbles of code bytes 0-7 / 8-15, then the high nibbles
    constexpr int64_t CODES = F == Q4_1_FORM ? 8 : 4;
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + CODES + (s & 1) * 8)));
    q = s < 2 ? _mm256_and_si256(q, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(q, 4);
    if constexpr (F == Q4_1_FORM) return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m);
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))));
  }
}

// NW compact weight rows in form F (w: row o's blocks, rb bytes per row) against NX x rows
// [R, K]: y[c * O + o + i]. Each block's weights are decoded in registers (exact, see above),
// and each accumulator then takes fma(w, x, acc) over k in order in 8 lanes and ends in
// `hsum`: the arithmetic of `tile` on the float32 weights, so every output is the same bit for
// bit. The blocks ahead of the tile (COMPACT_PF_BYTES) are prefetched: the decoding is fast
// enough that the hardware alone does not keep the stream ahead of it.
constexpr int64_t COMPACT_PF_BYTES = 4096;
template <int F, int NW, int NX>
__attribute__((always_inline)) inline void compact_tile_body(const uint8_t* __restrict w, int64_t rb,
                                                             const float* __restrict x, int64_t K, int64_t O,
                                                             int64_t o, float* __restrict y) {
  constexpr int64_t BYTES = FORM_BLOCK_BYTES[F];
  __m256 acc[NW][NX];
#pragma GCC unroll 8
  for (int i = 0; i < NW; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NX; ++c) acc[i][c] = _mm256_setzero_ps();
  constexpr int64_t PF_PER_BLOCK = (NW * BYTES + 63) / 64;
  for (int64_t b = 0; b < K / COMPACT_BLOCK; ++b) {
    const int64_t k = b * COMPACT_BLOCK;
#pragma GCC unroll 4
    for (int p = 0; p < PF_PER_BLOCK; ++p)
      _mm_prefetch(reinterpret_cast<const char*>(w + b * NW * BYTES + COMPACT_PF_BYTES + 64 * p), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int i = 0; i < NW; ++i) {
      const uint8_t* blk = w + i * rb + b * BYTES;
      const __m256 d = _mm256_broadcast_ss(reinterpret_cast<const float*>(blk));
      const __m256 m = F == Q4_1_FORM ? _mm256_broadcast_ss(reinterpret_cast<const float*>(blk + 4)) : d;
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m256 wv = decode_part<F>(blk, s, d, m);
#pragma GCC unroll 8
        for (int c = 0; c < NX; ++c)
          acc[i][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + c * K + k + 8 * s), acc[i][c]);
      }
    }
  }
  for (int i = 0; i < NW; ++i)
    for (int c = 0; c < NX; ++c) y[c * O + o + i] = hsum(acc[i][c]);
}

template <int F, int NW, int NX>
__attribute__((noinline)) void compact_tile(const uint8_t* __restrict w, int64_t rb, const float* __restrict x,
                                            int64_t K, int64_t O, int64_t o, float* __restrict y) {
  compact_tile_body<F, NW, NX>(w, rb, x, K, O, o, y);
}

// The same 8-lane tile compiled for AVX-512VL: the same instructions in their EVEX forms,
// which reach 32 vector registers instead of 16, room for 2 x 8 accumulators. Each output's
// arithmetic is unchanged (the same fma chain per lane, the same hsum): bit for bit the
// tile above. Used for blocks of 7-8 x rows where rows_isa() allows AVX-512.
template <int F, int NW, int NX>
WIDE_TARGET __attribute__((noinline)) void compact_tile_wide(const uint8_t* __restrict w, int64_t rb,
                                                             const float* __restrict x, int64_t K, int64_t O,
                                                             int64_t o, float* __restrict y) {
  compact_tile_body<F, NW, NX>(w, rb, x, K, O, o, y);
}

// outputs [o0, o1) against NX x rows, NW weight rows per tile (then one at a time)
template <int F, int NW, int NX, bool WIDE = false>
void compact_range(const uint8_t* cw, int64_t rb, const float* x, float* y, int64_t K, int64_t O, int64_t o0,
                   int64_t o1) {
  int64_t o = o0;
  if constexpr (WIDE) {
    for (; o + NW <= o1; o += NW) compact_tile_wide<F, NW, NX>(cw + o * rb, rb, x, K, O, o, y);
  } else {
    for (; o + NW <= o1; o += NW) compact_tile<F, NW, NX>(cw + o * rb, rb, x, K, O, o, y);
  }
  for (; o < o1; ++o) compact_tile<F, 1, NX>(cw + o * rb, rb, x, K, O, o, y);
}

// y [R, O] = x [R, K] @ w^T for a compact w [O, compact_row_bytes(K, F)]: the x rows in blocks
// of up to 8 (each block re-reads the chunk's codes, from cache for the later blocks)
template <int F>
void linear_rows_form(const uint8_t* cw, const float* xp, float* yp, int64_t R, int64_t K, int64_t O) {
  const int64_t rb = compact_row_bytes(K, F);
  const bool wide = use_wide();
  for_outputs(O, [&](int64_t o0, int64_t o1) {
    for (int64_t r0 = 0; r0 < R; r0 += 8) {
      const float* x = xp + r0 * K;
      float* y = yp + r0 * O;
      const int64_t n = std::min<int64_t>(8, R - r0);
      if (n >= 7 && wide) {  // 32 registers: 2 x NX accumulators
        if (n == 8) compact_range<F, 2, 8, true>(cw, rb, x, y, K, O, o0, o1);
        else compact_range<F, 2, 7, true>(cw, rb, x, y, K, O, o0, o1);
        continue;
      }
      switch (n) {  // registers: NW * NX accumulators + 4 <= 16
        case 1: compact_range<F, 4, 1>(cw, rb, x, y, K, O, o0, o1); break;
        case 2: compact_range<F, 4, 2>(cw, rb, x, y, K, O, o0, o1); break;
        case 3: compact_range<F, 3, 3>(cw, rb, x, y, K, O, o0, o1); break;
        case 4: compact_range<F, 2, 4>(cw, rb, x, y, K, O, o0, o1); break;
        case 5: compact_range<F, 2, 5>(cw, rb, x, y, K, O, o0, o1); break;
        case 6: compact_range<F, 1, 6>(cw, rb, x, y, K, O, o0, o1); break;  // (2 x 6: 8% slower)
        case 7: compact_range<F, 1, 7>(cw, rb, x, y, K, O, o0, o1); break;
        default: compact_range<F, 1, 8>(cw, rb, x, y, K, O, o0, o1); break;
      }
    }
  });
}

void linear_rows_compact(const uint8_t* cw, int form, const float* xp, float* yp, int64_t R, int64_t K, int64_t O) {
  switch (form) {
    case Q4_1_FORM: linear_rows_form<Q4_1_FORM>(cw, xp, yp, R, K, O); break;
    case Q4_0_FORM: linear_rows_form<Q4_0_FORM>(cw, xp, yp, R, K, O); break;
    default: linear_rows_form<Q8_0_FORM>(cw, xp, yp, R, K, O); break;
  }
}

inline bool is_compact(const torch::Tensor& t) { return t.defined() && t.scalar_type() == at::kByte; }

// a compact matrix of K columns: uint8 [O, compact_row_bytes(K, form)], contiguous, on the CPU;
// returns its form
int check_compact(const torch::Tensor& t, int64_t K, const char* fn, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous() && t.size(0) > 0,
              fn, ": ", name, " (compact) must be a 2-D contiguous uint8 CPU tensor from rows_compact, got ",
              t.sizes());
  const int form = compact_form(K, t.size(1));
  TORCH_CHECK(form >= 0, fn, ": ", name, " (compact) must hold ", K, " columns (K a multiple of ", COMPACT_BLOCK,
              "; ", K / COMPACT_BLOCK, " blocks of 24, 20 or 36 bytes per row), got ", t.sizes());
  return form;
}

// the checks every product input passes: a CPU tensor of a float kind, dim 2, contiguous
void check_matrix(const torch::Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK(t.defined(), fn, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(float_kind(t), fn, ": ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2, fn, ": ", name, " must be 2-D, got ", t.dim(), "-D ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), fn, ": ", name, " must be contiguous (row-major), got strides ", t.strides());
}

// y [R, O] float32 = product(w as its element type T, x widened exactly to float32, y, R, K)
template <typename F>
torch::Tensor product_out(torch::Tensor x, const torch::Tensor& w, int64_t O, const F& product) {
  if (x.scalar_type() != at::kFloat) x = x.to(at::kFloat);
  auto y = torch::empty({x.size(0), O}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  by_dtype(w.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    product(static_cast<const T*>(w.data_ptr()), xp, yp, x.size(0), x.size(1));
  });
  return y;
}

}  // namespace

// x [R, K] (float32; bf16 / fp16 widened exactly first), w [O, K] float32, bfloat16 or
// float16, both contiguous CPU -> y [R, O] float32
torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w);
torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w) {
  check_matrix(x, "rows_linear", "x");
  if (is_compact(w)) {  // rows_compact's form of a float32 matrix: the same outputs bit for bit
    TORCH_CHECK(x.size(0) > 0 && x.size(1) > 0, "rows_linear: empty input (R and K must be >= 1), got x ", x.sizes());
    const int form = check_compact(w, x.size(1), "rows_linear", "w");
    if (x.scalar_type() != at::kFloat) x = x.to(at::kFloat);
    auto y = torch::empty({x.size(0), w.size(0)}, x.options());
    linear_rows_compact(w.data_ptr<uint8_t>(), form, x.data_ptr<float>(), y.data_ptr<float>(), x.size(0),
                        x.size(1), w.size(0));
    return y;
  }
  check_matrix(w, "rows_linear", "w");
  TORCH_CHECK(x.size(1) == w.size(1), "rows_linear: x [R, K], w [O, K] must share K, got x ", x.sizes(),
              " and w ", w.sizes());
  TORCH_CHECK(x.size(0) > 0 && x.size(1) > 0 && w.size(0) > 0,
              "rows_linear: empty input (R, K and O must be >= 1), got x ", x.sizes(), " and w ", w.sizes());
  const int64_t O = w.size(0);
  return product_out(x, w, O, [&](const auto* wp, const float* xp, float* yp, int64_t R, int64_t K) {
    linear_rows(wp, xp, yp, R, K, O);
  });
}

// w [O, K] float32 contiguous CPU -> its compact form uint8 [O, K / 32 * (24, 20 or 36)]: the
// first of Q4_1, Q4_0, Q8_0 whose blocks reproduce every weight bit for bit (see "compact
// weights"); an empty uint8 tensor when none does (or K is not a multiple of 32)
torch::Tensor rows_compact(torch::Tensor w);
torch::Tensor rows_compact(torch::Tensor w) {
  check_matrix(w, "rows_compact", "w");
  TORCH_CHECK(w.scalar_type() == at::kFloat, "rows_compact: w must be float32, got ", w.scalar_type());
  const int64_t O = w.size(0), K = w.size(1);
  auto none = torch::empty({0}, w.options().dtype(at::kByte));
  if (K % COMPACT_BLOCK != 0 || O == 0 || K == 0) return none;
  const float* wp = w.data_ptr<float>();
  for (int form = 0; form < COMPACT_FORMS; ++form) {
    const int64_t rb = compact_row_bytes(K, form), bb = FORM_BLOCK_BYTES[form];
    auto out = torch::empty({O, rb}, w.options().dtype(at::kByte));
    uint8_t* op = out.data_ptr<uint8_t>();
    std::atomic<bool> ok{true};
    at::parallel_for(0, O, 16, [&](int64_t o0, int64_t o1) {
      for (int64_t o = o0; o < o1 && ok.load(std::memory_order_relaxed); ++o)
        for (int64_t b = 0; b < K / COMPACT_BLOCK; ++b) {
          const float* blk = wp + o * K + b * COMPACT_BLOCK;
          float lo = blk[0], hi = blk[0];
          int64_t big = 0;
          bool finite = true;
          for (int64_t j = 0; j < COMPACT_BLOCK; ++j) {
            finite = finite && std::isfinite(blk[j]);
            lo = std::min(lo, blk[j]);
            hi = std::max(hi, blk[j]);
            if (std::fabs(blk[j]) > std::fabs(blk[big])) big = j;  // the first largest, as numpy's argmax
          }
          if (!finite || !encode_block(blk, lo, hi, big, form, op + o * rb + b * bb)) {
            ok.store(false, std::memory_order_relaxed);
            break;
          }
        }
    });
    if (ok.load()) return out;
  }
  return none;
}

// ---- weights stored transposed (GPT-2's Conv1D) ------------------------------------------
//
// y[r, o] = sum_k x[r, k] * wt[k, o] for wt [K, O] stored row-major (its rows may be a slice
// of a wider matrix: row stride ldw >= O). Each output is one FMA chain from 0 over k in
// order, acc = fma(x[r, k], wt[k, o], acc), run in 8-lane registers over 8 adjacent outputs
// (a tail of outputs by std::fma: the same operation), so an output's bits depend on its own
// x row and weight column only: never on R, the other rows, the column chunk or the thread.
// A pass holds the accumulators of a chunk of TCOLS outputs for all rows in a buffer
// (L1/L2) and walks k in blocks of 4 (each accumulator loaded once per 4 FMAs, each weight
// vector used for two rows at a time; one row alone: blocks of 8); each weight row's
// TCOLS-wide segment is one contiguous read, so a step streams the weight once for any R.
// Measured on a 2-core Xeon, all products of GPT-2's 12 layers (fp32, 340 MB, from memory),
// A/B in one process: at 1 / 4 / 8 rows 13.1-13.4 / 21.5-21.9 / 26.2-26.5 ms against torch's
// x @ wt 12.1 / 22.5-22.9 / 24.3-24.5 ms (one row in blocks of 4: 15.0 ms; chunks of 512 to
// 4096 outputs within 6%; software prefetch of the rows ahead made it 1.2-1.4x slower: the
// hardware streams them).
namespace {

constexpr int64_t TCOLS = 1536;  // outputs per pass: 6 KiB of an fp32 weight row per k

template <typename T>
void cols_pass(const T* __restrict w, int64_t ldw, const float* __restrict x, float* __restrict y,
               int64_t R, int64_t K, int64_t O, int64_t c0, int64_t cw, float* __restrict acc) {
  const int64_t v8 = cw - cw % 8;
  std::fill(acc, acc + R * cw, 0.0f);
  const int64_t k4 = K - K % 4;
  int64_t k0 = 0;
  if (R == 1) {  // one row: 8 k per accumulator load (the same chain of FMAs, in order)
    k0 = K - K % 8;
    for (int64_t k = 0; k < k0; k += 8) {
      const T* wk = w + k * ldw + c0;
      const float* xr = x + k;
      __m256 xv[8];
      for (int i = 0; i < 8; ++i) xv[i] = _mm256_set1_ps(xr[i]);
      for (int64_t j = 0; j < v8; j += 8) {
        __m256 a = _mm256_loadu_ps(acc + j);
        for (int i = 0; i < 8; ++i) a = _mm256_fmadd_ps(xv[i], Elem<T>::load8(wk + i * ldw + j), a);
        _mm256_storeu_ps(acc + j, a);
      }
      for (int64_t j = v8; j < cw; ++j) {
        float a = acc[j];
        for (int i = 0; i < 8; ++i) a = std::fma(xr[i], Elem<T>::load1(wk + i * ldw + j), a);
        acc[j] = a;
      }
    }
  }
  for (int64_t k = k0; k < K; k += (k < k4 ? 4 : 1)) {
    const int64_t nk = k < k4 ? 4 : 1;
    const T* wk = w + k * ldw + c0;
    int64_t r = 0;
    if (nk == 4) {
      // rows in pairs: each weight vector loaded once for two rows' accumulators
      for (; r + 2 <= R; r += 2) {
        const float* xa = x + r * K + k;
        const float* xb = xa + K;
        const __m256 a0 = _mm256_set1_ps(xa[0]), a1 = _mm256_set1_ps(xa[1]);
        const __m256 a2 = _mm256_set1_ps(xa[2]), a3 = _mm256_set1_ps(xa[3]);
        const __m256 b0 = _mm256_set1_ps(xb[0]), b1 = _mm256_set1_ps(xb[1]);
        const __m256 b2 = _mm256_set1_ps(xb[2]), b3 = _mm256_set1_ps(xb[3]);
        float* pa = acc + r * cw;
        float* pb = pa + cw;
        for (int64_t j = 0; j < v8; j += 8) {
          __m256 sa = _mm256_loadu_ps(pa + j), sb = _mm256_loadu_ps(pb + j);
          __m256 wv = Elem<T>::load8(wk + j);
          sa = _mm256_fmadd_ps(a0, wv, sa);
          sb = _mm256_fmadd_ps(b0, wv, sb);
          wv = Elem<T>::load8(wk + ldw + j);
          sa = _mm256_fmadd_ps(a1, wv, sa);
          sb = _mm256_fmadd_ps(b1, wv, sb);
          wv = Elem<T>::load8(wk + 2 * ldw + j);
          sa = _mm256_fmadd_ps(a2, wv, sa);
          sb = _mm256_fmadd_ps(b2, wv, sb);
          wv = Elem<T>::load8(wk + 3 * ldw + j);
          sa = _mm256_fmadd_ps(a3, wv, sa);
          sb = _mm256_fmadd_ps(b3, wv, sb);
          _mm256_storeu_ps(pa + j, sa);
          _mm256_storeu_ps(pb + j, sb);
        }
        for (int64_t j = v8; j < cw; ++j) {
          float sa = pa[j], sb = pb[j];
          for (int64_t i = 0; i < 4; ++i) {
            const float wf = Elem<T>::load1(wk + i * ldw + j);
            sa = std::fma(xa[i], wf, sa);
            sb = std::fma(xb[i], wf, sb);
          }
          pa[j] = sa;
          pb[j] = sb;
        }
      }
    }
    for (; r < R; ++r) {
      const float* xr = x + r * K + k;
      float* a = acc + r * cw;
      if (nk == 4) {
        const __m256 x0 = _mm256_set1_ps(xr[0]), x1 = _mm256_set1_ps(xr[1]);
        const __m256 x2 = _mm256_set1_ps(xr[2]), x3 = _mm256_set1_ps(xr[3]);
        for (int64_t j = 0; j < v8; j += 8) {
          __m256 s = _mm256_loadu_ps(a + j);
          s = _mm256_fmadd_ps(x0, Elem<T>::load8(wk + j), s);
          s = _mm256_fmadd_ps(x1, Elem<T>::load8(wk + ldw + j), s);
          s = _mm256_fmadd_ps(x2, Elem<T>::load8(wk + 2 * ldw + j), s);
          s = _mm256_fmadd_ps(x3, Elem<T>::load8(wk + 3 * ldw + j), s);
          _mm256_storeu_ps(a + j, s);
        }
        for (int64_t j = v8; j < cw; ++j) {
          float s = a[j];
          for (int64_t i = 0; i < 4; ++i) s = std::fma(xr[i], Elem<T>::load1(wk + i * ldw + j), s);
          a[j] = s;
        }
      } else {
        const __m256 x0 = _mm256_set1_ps(xr[0]);
        for (int64_t j = 0; j < v8; j += 8)
          _mm256_storeu_ps(a + j, _mm256_fmadd_ps(x0, Elem<T>::load8(wk + j), _mm256_loadu_ps(a + j)));
        for (int64_t j = v8; j < cw; ++j) a[j] = std::fma(xr[0], Elem<T>::load1(wk + j), a[j]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) std::memcpy(y + r * O + c0, acc + r * cw, cw * sizeof(float));
}

template <typename T>
void linear_cols(const T* w, int64_t ldw, const float* x, float* y, int64_t R, int64_t K, int64_t O) {
  for_outputs(O, [&](int64_t o0, int64_t o1) {
    std::vector<float> acc(static_cast<size_t>(R * std::min<int64_t>(TCOLS, o1 - o0)));
    for (int64_t c0 = o0; c0 < o1; c0 += TCOLS)
      cols_pass<T>(w, ldw, x, y, R, K, O, c0, std::min<int64_t>(TCOLS, o1 - c0), acc.data());
  });
}

}  // namespace

// x [R, K] (float32; bf16 / fp16 widened exactly first, contiguous), wt [K, O] float32,
// bfloat16 or float16 with unit column stride (a row stride >= O: a column slice of a wider
// weight is read in place) -> y [R, O] float32
torch::Tensor rows_linear_t(torch::Tensor x, torch::Tensor wt);
torch::Tensor rows_linear_t(torch::Tensor x, torch::Tensor wt) {
  check_matrix(x, "rows_linear_t", "x");
  TORCH_CHECK(wt.defined() && wt.device().is_cpu() && float_kind(wt) && wt.dim() == 2,
              "rows_linear_t: wt must be a 2-D float32/bfloat16/float16 CPU tensor, got ",
              wt.defined() ? wt.sizes() : at::IntArrayRef{});
  TORCH_CHECK(wt.stride(1) == 1 && wt.stride(0) >= wt.size(1),
              "rows_linear_t: wt [K, O] must have unit column stride and a row stride >= O, got strides ",
              wt.strides(), " for ", wt.sizes());
  TORCH_CHECK(x.size(1) == wt.size(0), "rows_linear_t: x [R, K], wt [K, O] must share K, got x ", x.sizes(),
              " and wt ", wt.sizes());
  TORCH_CHECK(x.size(0) > 0 && x.size(1) > 0 && wt.size(1) > 0,
              "rows_linear_t: empty input (R, K and O must be >= 1), got x ", x.sizes(), " and wt ", wt.sizes());
  const int64_t O = wt.size(1), ldw = wt.stride(0);
  return product_out(x, wt, O, [&](const auto* wp, const float* xp, float* yp, int64_t R, int64_t K) {
    linear_cols(wp, ldw, xp, yp, R, K, O);
  });
}

// Per-head products in one call (latent attention's k_up / v_up: views of one weight):
// x [H, R, K] (float32; bf16 / fp16 widened exactly first, contiguous), ws H weights of one
// dtype, each [O, K] contiguous (transposed false: rows_linear's) or each wt [K, O] with unit
// column stride and a row stride >= O (transposed true: rows_linear_t's) -> y [H, R, O]
// float32, y[h] = rows_linear(x[h], ws[h]) (or rows_linear_t) bit for bit: the heads are
// shared among the threads, each head's product run whole by one thread (an output's
// arithmetic never depends on how the outputs are split).
torch::Tensor rows_linear_heads(torch::Tensor x, std::vector<torch::Tensor> ws, bool transposed);
torch::Tensor rows_linear_heads(torch::Tensor x, std::vector<torch::Tensor> ws, bool transposed) {
  TORCH_CHECK(x.defined() && x.device().is_cpu() && float_kind(x) && x.dim() == 3 && x.is_contiguous(),
              "rows_linear_heads: x must be a contiguous float32/bfloat16/float16 CPU tensor [H, R, K], got ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  const int64_t H = x.size(0), R = x.size(1), K = x.size(2);
  TORCH_CHECK(H > 0 && R > 0 && K > 0, "rows_linear_heads: empty x (H, R and K must be >= 1), got ", x.sizes());
  TORCH_CHECK(static_cast<int64_t>(ws.size()) == H, "rows_linear_heads: one weight per head: ", H,
              " heads, got ", ws.size(), " weights");
  const int64_t O = transposed ? ws[0].size(1) : ws[0].size(0);
  for (const auto& w : ws) {
    TORCH_CHECK(w.defined() && w.device().is_cpu() && float_kind(w) && w.dim() == 2 &&
                    w.scalar_type() == ws[0].scalar_type(),
                "rows_linear_heads: the weights must be 2-D CPU tensors of one float dtype, got ",
                w.defined() ? w.sizes() : at::IntArrayRef{});
    TORCH_CHECK(transposed ? (w.size(0) == K && w.size(1) == O && w.stride(1) == 1 && w.stride(0) >= O)
                           : (w.size(0) == O && w.size(1) == K && w.is_contiguous()),
                "rows_linear_heads: each weight must be ", transposed ? "wt [K, O] with unit column stride" :
                "w [O, K] contiguous", " with K = ", K, " and the first's O = ", O, ", got ", w.sizes(),
                " with strides ", w.strides());
  }
  if (x.scalar_type() != at::kFloat) x = x.to(at::kFloat);
  auto y = torch::empty({H, R, O}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto heads = [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      by_dtype(ws[h].scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        const T* wp = static_cast<const T*>(ws[h].data_ptr());
        if (transposed) linear_cols(wp, ws[h].stride(0), xp + h * R * K, yp + h * R * O, R, K, O);
        else linear_rows(wp, xp + h * R * K, yp + h * R * O, R, K, O);
      });
    }
  };
  // torch's team: the inner products' own parallel_for runs inline in each worker; the pool
  // takes one call at a time, so there the heads go in turn, each product split as usual
  if (use_pool()) heads(0, H);
  else at::parallel_for(0, H, 1, heads);
  return y;
}

// mode 1: the AVX-512 paired-row tiles where the CPU has them (the default), 0: the 8-lane
// tiles everywhere, -1: no change; returns 1 if paired tiles are in use (after the change).
// Results are bit-identical either way.
int64_t rows_isa(int64_t mode);
int64_t rows_isa(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "rows_isa: mode must be -1 (query), 0 (8-lane) or 1 (AVX-512), got ", mode);
  if (mode >= 0) g_wide_on.store(mode == 1);
  return use_wide() ? 1 : 0;
}

// mode 1: the work-sharing pool, 0: OpenMP (the default), -1: no change; returns the previous
// mode (1 or 0). Results are bit-identical in both modes.
int64_t rows_pool(int64_t mode);
int64_t rows_pool(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "rows_pool: mode must be -1 (query), 0 (OpenMP) or 1 (pool), got ", mode);
  const bool before = g_use_pool.load();
  if (mode >= 0) g_use_pool.store(mode == 1);
  return before ? 1 : 0;
}

// ---- attention ---------------------------------------------------------------------------
//
// Row-invariant attention for the CPU engine: query row r, head h sees the cached keys and
// values of slots [0, limit[r]] of its KV head h / G, and nothing else enters its result.
// The arithmetic of one (row, head) is one fixed sequence whatever the other rows, how many
// there are and how far they see:
//   s_j = q.k_j     q scaled by `scale` first; the 8-wide FMA dot product of `tile`, eight
//                   keys in flight with one accumulator each (`dot8`, then `dot4`, the last
//                   keys through `dot`: the same sequence for every key)
//   m   = max_j s_j (exact in any order)
//   p_j = exp(s_j - m) by `exp8` (8 lanes, each lane's result depends on its input only),
//   l   = sum_j p_j in 8 lanes by j mod 8 (zeros past the last key), then `hsum`
//   o   = (sum_j p_j v_j) / l, the sum in order of j, 8 lanes of the head dimension per FMA
//         (a head dimension tail < 8 with std::fma, the same operation).
// No key blocks, masks or padding: the PyTorch path (engine/attention.py) visits fixed key
// blocks with an online softmax to be row-invariant, ~12 small ops per key block, layer
// and chunk of rows, which cost more than the arithmetic. Threads split the (row, head)
// pairs; a pair never depends on the split. Measured (SmolLM2-135M's 9 heads of 64 over 3 KV
// heads, all 30 layers, 2-core AMD EPYC): 1 / 4 / 8 rows 0.8 / 2.3 / 4.1 ms at a 300-token
// context, 4.8 / 11 / 20 ms at 1500 tokens; grouping the heads of a KV head to share key
// reads measured no better.
namespace {

// q . k for one key row of d elements (cache type TC, widened in registers)
template <typename TC>
inline float dot(const float* __restrict a, const TC* __restrict b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  const int64_t d8 = d - d % 8;
  for (int64_t i = 0; i < d8; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), Elem<TC>::load8(b + i), acc);
  float s = hsum(acc);
  for (int64_t i = d8; i < d; ++i) s = std::fma(a[i], Elem<TC>::load1(b + i), s);
  return s;
}

// four dot products of one query with keys k, k + d, k + 2d, k + 3d, each exactly as `dot`
template <typename TC>
inline void dot4(const float* __restrict a, const TC* __restrict k, int64_t d, float* __restrict s) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  const int64_t d8 = d - d % 8;
  for (int64_t i = 0; i < d8; i += 8) {
    const __m256 av = _mm256_loadu_ps(a + i);
    acc0 = _mm256_fmadd_ps(av, Elem<TC>::load8(k + i), acc0);
    acc1 = _mm256_fmadd_ps(av, Elem<TC>::load8(k + d + i), acc1);
    acc2 = _mm256_fmadd_ps(av, Elem<TC>::load8(k + 2 * d + i), acc2);
    acc3 = _mm256_fmadd_ps(av, Elem<TC>::load8(k + 3 * d + i), acc3);
  }
  float t[4] = {hsum(acc0), hsum(acc1), hsum(acc2), hsum(acc3)};
  for (int j = 0; j < 4; ++j) {
    const TC* kj = k + j * d;
    for (int64_t i = d8; i < d; ++i) t[j] = std::fma(a[i], Elem<TC>::load1(kj + i), t[j]);
    s[j] = t[j];
  }
}

// The `hsum` of eight accumulators at once, as one vector [hsum(a0), ..., hsum(a7)]: the
// same additions in the same pairing (lanes k + 4 onto k, then 2 onto 0 and 3 onto 1, then
// 1 onto 0), done for eight sums per instruction, so each result is bit-identical to `hsum`
// (float addition is commutative bit for bit; only the association matters, and it is kept).
inline __m256 hsum8(const __m256 a[8]) {
  // lo + hi halves, two accumulators per register: [s_i | s_{i+4}]
  __m256 s[4];
  for (int i = 0; i < 4; ++i)
    s[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20), _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
  // (s0 + s2, s1 + s3) per sum: 64-bit interleaves pair element 0 with 2 and 1 with 3
  __m256 t[2];
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(s[2 * i]), y = _mm256_castps_pd(s[2 * i + 1]);
    t[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  // element 0 + element 1 per sum: [a0 a1 a2 a3 | a4 a5 a6 a7]
  return _mm256_hadd_ps(t[0], t[1]);
}

// eight dot products of one query with keys k, k + d, ..., k + 7d, each exactly as `dot`:
// eight independent accumulators keep both FMA pipes busy (`dot4`'s four chains wait on
// the FMA latency), and the eight horizontal sums share instructions (`hsum8`)
template <typename TC>
inline void dot8(const float* __restrict a, const TC* __restrict k, int64_t d, float* __restrict s) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  const int64_t d8 = d - d % 8;
  for (int64_t i = 0; i < d8; i += 8) {
    const __m256 av = _mm256_loadu_ps(a + i);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(av, Elem<TC>::load8(k + j * d + i), acc[j]);
  }
  _mm256_storeu_ps(s, hsum8(acc));
  if (d8 < d)
    for (int j = 0; j < 8; ++j) {
      const TC* kj = k + j * d;
      float t = s[j];
      for (int64_t i = d8; i < d; ++i) t = std::fma(a[i], Elem<TC>::load1(kj + i), t);
      s[j] = t;
    }
}

// exp(x) for x <= 0 on 8 lanes (softmax terms): x = n ln2 + r, |r| <= ln2 / 2, a degree-7
// polynomial for exp(r) (the Cephes single-precision coefficients, ~1 ulp), times 2^n;
// x below -87 gives exp(-87) ~ 1.6e-38 (the smallest normal float is 1.2e-38)
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
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
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// acc[0:D] += p[j] v[j * D : (j+1) * D] for j in [j0, j1), in order of j (D a multiple of
// 8, the accumulators in registers)
template <typename TC, int D>
inline void weighted_sum(const float* __restrict p, const TC* __restrict v, int64_t j0, int64_t j1,
                         float* __restrict acc) {
  __m256 a[D / 8];
#pragma GCC unroll 16
  for (int c = 0; c < D / 8; ++c) a[c] = _mm256_load_ps(acc + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 16
    for (int c = 0; c < D / 8; ++c) a[c] = _mm256_fmadd_ps(pj, Elem<TC>::load8(v + j * D + 8 * c), a[c]);
  }
#pragma GCC unroll 16
  for (int c = 0; c < D / 8; ++c) _mm256_store_ps(acc + 8 * c, a[c]);
}

template <typename TC>
inline void weighted_sum_any(const float* __restrict p, const TC* __restrict v, int64_t d, int64_t j0,
                             int64_t j1, float* __restrict acc) {
  const int64_t d8 = d - d % 8;
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int64_t c = 0; c < d8; c += 8)
      _mm256_store_ps(acc + c, _mm256_fmadd_ps(pj, Elem<TC>::load8(v + j * d + c), _mm256_load_ps(acc + c)));
    for (int64_t i = d8; i < d; ++i) acc[i] = std::fma(p[j], Elem<TC>::load1(v + j * d + i), acc[i]);
  }
}

template <typename TC>
inline void weighted_sum_d(const float* p, const TC* v, int64_t d, int64_t j0, int64_t j1, float* acc) {
  if (d == 64) weighted_sum<TC, 64>(p, v, j0, j1, acc);
  else if (d == 128) weighted_sum<TC, 128>(p, v, j0, j1, acc);
  else weighted_sum_any<TC>(p, v, d, j0, j1, acc);
}

// (the stack buffers' size: DeepSeek's latent attention attends over 576-wide latent heads)
constexpr int64_t kMaxHeadDim = 1024;

// A 1-D int64 CPU tensor of n values (limit, slots), made contiguous.
torch::Tensor index_vector(const torch::Tensor& t, int64_t n, const char* fn, const char* name) {
  TORCH_CHECK(t.defined(), fn, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong, fn, ": ", name, " must be int64 [R], got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, fn, ": ", name, " must be int64 [R] with R = ", n,
              " rows, got shape ", t.sizes());
  return t.contiguous();
}

// The checked row metadata of one attention call: key limits, tree paths and, per row, the
// number c_r of its path slots (its last c_r keys).
struct AttentionMeta {
  torch::Tensor limit, path, base;
  std::vector<int64_t> tree_keys;
  int64_t keys = 0;  // max over rows of limit + 1
  // per row, the slot of its logical key 0 (a sequence's KV region in a batched step);
  // empty: 0 for every row
  const int64_t* base_of = nullptr;
  int64_t first_slot(int64_t r) const { return base_of == nullptr ? 0 : base_of[r]; }
};

AttentionMeta check_attention_meta(const torch::Tensor& limit, const torch::Tensor& path, const torch::Tensor& base,
                                   int64_t R, int64_t S, const char* fn) {
  AttentionMeta m;
  m.limit = index_vector(limit, R, fn, "limit");
  const int64_t* lp = m.limit.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(lp[r] >= 0 && lp[r] < S, fn, ": a key limit is outside the cache: limit[", r, "] = ", lp[r],
                ", the cache has ", S, " slots");
    m.keys = std::max(m.keys, lp[r] + 1);
  }
  TORCH_CHECK(path.defined() && path.device().is_cpu(), fn, ": path int64 [R, P] must be a CPU tensor");
  TORCH_CHECK(path.scalar_type() == at::kLong && path.dim() == 2 && (path.size(1) == 0 || path.size(0) == R),
              fn, ": path int64 [R, P] (P = 0: no tree) with R = ", R, ", got ", path.scalar_type(), " ",
              path.sizes());
  m.path = path.contiguous();
  const int64_t P = m.path.size(1);
  const int64_t* pp = m.path.data_ptr<int64_t>();
  m.tree_keys.assign(R, 0);
  for (int64_t r = 0; r < R && P > 0; ++r) {
    int64_t& c = m.tree_keys[r];
    while (c < P && pp[r * P + c] >= 0) {
      TORCH_CHECK(pp[r * P + c] < S, fn, ": a path slot is outside the cache: path[", r, ", ", c, "] = ",
                  pp[r * P + c], ", the cache has ", S, " slots");
      ++c;
    }
    TORCH_CHECK(c <= lp[r] + 1, fn, ": a row's path is longer than its keys: row ", r, " has ", c,
                " path slots but limit ", lp[r]);
  }
  TORCH_CHECK(base.defined() && base.device().is_cpu() && base.scalar_type() == at::kLong && base.dim() == 1 &&
              (base.size(0) == 0 || base.size(0) == R),
              fn, ": base int64 [R] (or [0]: every row's keys start at slot 0) with R = ", R, ", got ",
              base.scalar_type(), " ", base.sizes());
  if (base.size(0) == R) {
    m.base = base.contiguous();
    m.base_of = m.base.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r) {
      const int64_t prefix = lp[r] + 1 - m.tree_keys[r];  // keys at base[r] .. base[r] + prefix - 1
      TORCH_CHECK(m.base_of[r] >= 0 && m.base_of[r] + prefix <= S, fn,
                  ": a row's keys are outside the cache: base[", r, "] = ", m.base_of[r], " with ", prefix,
                  " prefix keys, the cache has ", S, " slots");
    }
  }
  return m;
}

// k and v [Hkv, S, d] caches of one layer: CPU, one float kind, contiguous, non-empty
void check_cache(const torch::Tensor& k, const torch::Tensor& v, const char* fn) {
  TORCH_CHECK(k.defined() && v.defined(), fn, ": k and v caches must be tensors");
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), fn, ": k and v caches must be CPU tensors, got ",
              k.device(), " and ", v.device());
  TORCH_CHECK(float_kind(k) && v.scalar_type() == k.scalar_type(), fn,
              ": k and v caches must both be float32, bfloat16 or float16, got ", k.scalar_type(), " and ",
              v.scalar_type());
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), fn, ": k and v caches must both be [Hkv, S, d], got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), fn, ": k and v caches must be contiguous");
  TORCH_CHECK(k.size(0) > 0 && k.size(1) > 0 && k.size(2) > 0, fn,
              ": empty cache (KV heads, slots and head_dim must be >= 1), got ", k.sizes());
  TORCH_CHECK(k.size(2) <= kMaxHeadDim, fn, ": head_dim <= ", kMaxHeadDim, ", got ", k.size(2));
}

// Work items of `attention_rows`: the (row, head) pairs of one KV head g, rows [r0, r1) and
// query heads [h0, h1) of that KV head's group, over one chunk of KEY_CHUNK logical keys.
// The pairs of an item visit the chunk's keys together, one block of KEY_TILE keys at a
// time, so a block of K (and then of V) is read from memory once per item rather than once
// per pair: with 8 rows of 3 heads per KV head, 24 times fewer reads of a long context's
// cache. Chunks let a long context's keys spread over every thread while each KV head's
// cache is still read once (a single row has only as many (KV head, head block) items as
// there are KV heads otherwise: three for SmolLM2, on two threads, or each KV head read
// twice when its heads are split).
//
// A pair's arithmetic depends on its own keys only, never on the items or the other rows:
// chunk c of a pair with L keys holds its logical keys [c KEY_CHUNK, min(L, (c + 1)
// KEY_CHUNK)). Per chunk: the scores s_j, their maximum m_c, p_j = exp(s_j - m_c), l_c =
// sum_j p_j (8 lanes by j mod 8, then `hsum`) and acc_c = sum_j p_j v_j in order of j. A
// pair of one chunk (L <= KEY_CHUNK) returns acc_0 / l_0; a longer one merges its chunks in
// order: M = max_c m_c, w_c = exp(m_c - M), o = (sum_c w_c acc_c) / (sum_c w_c l_c).
constexpr int64_t KEY_TILE = 64;
constexpr int64_t KEY_CHUNK = 512;  // a multiple of KEY_TILE and of 8
static_assert(KEY_CHUNK % KEY_TILE == 0 && KEY_CHUNK % 8 == 0, "chunks hold whole key tiles and 8-key groups");

// n elements of a 16-bit cache as float32 (the exact widening `Elem` does in registers), so
// that the pairs of an item widen a tile of keys or values once, not once per pair
template <typename TC>
inline void widen(const TC* __restrict src, int64_t n, float* __restrict dst) {
  const int64_t n8 = n - n % 8;
  for (int64_t i = 0; i < n8; i += 8) _mm256_storeu_ps(dst + i, Elem<TC>::load8(src + i));
  for (int64_t i = n8; i < n; ++i) dst[i] = Elem<TC>::load1(src + i);
}

struct AttentionItems {
  int64_t rows_per_item, heads_per_item, row_blocks, head_blocks, chunks, count;
};

// As many rows and heads per item as leave at least two items per thread
inline AttentionItems attention_items(int64_t R, int64_t Hkv, int64_t G, int64_t chunks) {
  const int64_t want = 2 * std::max<int64_t>(1, at::get_num_threads());
  AttentionItems it{std::min<int64_t>(4, R), G, 0, 0, chunks, 0};
  auto count = [&]() {
    it.row_blocks = (R + it.rows_per_item - 1) / it.rows_per_item;
    it.head_blocks = (G + it.heads_per_item - 1) / it.heads_per_item;
    return it.count = Hkv * it.row_blocks * it.head_blocks * chunks;
  };
  while (count() < want && it.rows_per_item > 1) it.rows_per_item = (it.rows_per_item + 1) / 2;
  while (count() < want && it.heads_per_item > 1) it.heads_per_item = (it.heads_per_item + 1) / 2;
  return it;
}

// A pair's output o = acc / l (acc and l its weighted sum and softmax sum relative to its
// maximum score m; acc 32-byte aligned). With an attention sink (GPT-OSS, Granite-SWA: one
// more logit per head in the softmax's denominator, of value 0) the sum gains exp(sink - m),
// taken relative to max(m, sink) so that neither exponential overflows.
inline void write_output(const float* acc, float m, float l, const float* sink, int64_t d, float* o) {
  float scale = 1.f;  // acc's factor before the division
  if (sink != nullptr) {
    if (*sink > m) {
      scale = std::exp(m - *sink);
      l = std::fma(l, scale, 1.f);
    } else {
      l += std::exp(*sink - m);
    }
  }
  const int64_t d8 = d - d % 8;
  const __m256 lvec = _mm256_set1_ps(l), svec = _mm256_set1_ps(scale);
  for (int64_t c8 = 0; c8 < d8; c8 += 8) {
    __m256 a = _mm256_load_ps(acc + c8);
    if (sink != nullptr) a = _mm256_mul_ps(a, svec);
    _mm256_storeu_ps(o + c8, _mm256_div_ps(a, lvec));
  }
  for (int64_t i = d8; i < d; ++i) o[i] = (sink != nullptr ? acc[i] * scale : acc[i]) / l;
}

template <typename TC>
void attention_rows(const float* qp, const TC* kp, const TC* vp, const AttentionMeta& meta, int64_t R, int64_t Hq,
                    int64_t Hkv, int64_t S, int64_t d, float sc, float softcap, int64_t window, float* op,
                    const float* slopes = nullptr, const float* sinks = nullptr) {
  const int64_t G = Hq / Hkv, stride = (meta.keys + 7) / 8 * 8;  // scores rows padded to 8 lanes
  auto scores = torch::empty({R * Hq, stride}, torch::dtype(torch::kFloat32));
  float* sp = scores.data_ptr<float>();
  const int64_t* lp = meta.limit.data_ptr<int64_t>();
  const int64_t P = meta.path.size(1);
  const int64_t* pp = meta.path.data_ptr<int64_t>();
  const int64_t d8 = d - d % 8;
  const int64_t dd = (d + 7) / 8 * 8;  // keeps every pair's accumulators 32-byte aligned
  const int64_t chunks = (meta.keys + KEY_CHUNK - 1) / KEY_CHUNK;
  const AttentionItems items = attention_items(R, Hkv, G, chunks);
  // a sliding window: row r sees logical keys j > limit[r] - window (as HF's sliding mask);
  // the keys before are left out of its scores' maximum and sums, chunks without any skipped
  auto first_key = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, lp[r] + 1 - window) : int64_t{0}; };
  // the chunks of pairs with more than one: per (pair, chunk) acc_c (dd floats), then m_c, l_c
  const int64_t part_floats = dd + 8;
  torch::Tensor parts;
  float* part = nullptr;
  if (chunks > 1) {
    parts = torch::empty({R * Hq * chunks * part_floats}, torch::dtype(torch::kFloat32));
    part = parts.data_ptr<float>();
  }
  auto body = [&](int64_t i0, int64_t i1) {
    struct Pair {
      int64_t item, L, Lp, end, contiguous_end;  // item = r * Hq + h; keys [0, Lp) contiguous,
      const int64_t* path;                        // [Lp, L) on the path; this chunk's keys end
      const TC *kh, *vh, *kb, *vb;                // at `end`, its contiguous ones at
      float* s;                                   // `contiguous_end` (<= its start: none)
      int64_t from;                               // the first key it sees in this chunk
    };
    const int64_t most = items.rows_per_item * items.heads_per_item;
    std::vector<Pair> pairs;
    pairs.reserve(most);
    // per pair: its scaled query, then its weighted-sum accumulators (32-byte aligned)
    // 16-bit caches: a tile of keys (then values) widened once for all pairs of the item
    constexpr bool wide_cache = !std::is_same_v<TC, float>;
    const int64_t tile_floats = wide_cache ? KEY_TILE * d : 0;
    std::vector<float> buffer(2 * most * dd + tile_floats + 8);
    float* qs_all = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 31) & ~uintptr_t(31));
    float* acc_all = qs_all + most * dd;
    float* tile = acc_all + most * dd;
    std::vector<float> sums(most), maxima(most);  // per pair: l_c and m_c of the item's chunk
    for (int64_t it = i0; it < i1; ++it) {
      // (KV head, chunk, head block, row block), the row block fastest: consecutive items of
      // a thread read the same keys and values (from cache after the first)
      const int64_t rb = it % items.row_blocks, hb = it / items.row_blocks % items.head_blocks;
      const int64_t chunk = it / (items.row_blocks * items.head_blocks) % items.chunks;
      const int64_t g = it / (items.row_blocks * items.head_blocks * items.chunks);
      const int64_t r0 = rb * items.rows_per_item, r1 = std::min(R, r0 + items.rows_per_item);
      const int64_t h0 = g * G + hb * items.heads_per_item, h1 = std::min(g * G + G, h0 + items.heads_per_item);
      const int64_t c0 = chunk * KEY_CHUNK;  // the chunk's first logical key
      pairs.clear();
      int64_t longest = c0;
      for (int64_t r = r0; r < r1; ++r) {
        // the row's keys end before this chunk, or its window starts after it
        if (lp[r] + 1 <= c0 || first_key(r) >= c0 + KEY_CHUNK) continue;
        for (int64_t h = h0; h < h1; ++h) {
          Pair pr;
          pr.item = r * Hq + h;
          pr.L = lp[r] + 1;
          pr.Lp = pr.L - meta.tree_keys[r];
          pr.end = std::min(pr.L, c0 + KEY_CHUNK);
          pr.from = std::max(c0, first_key(r));
          pr.contiguous_end = std::min(pr.Lp, pr.end);
          pr.path = pp + r * P;
          pr.kh = kp + g * S * d;  // path slots are absolute
          pr.vh = vp + g * S * d;
          pr.kb = pr.kh + meta.first_slot(r) * d;  // the prefix from the row's first slot
          pr.vb = pr.vh + meta.first_slot(r) * d;
          pr.s = sp + pr.item * stride;
          float* qs = qs_all + pairs.size() * dd;
          for (int64_t i = 0; i < d; ++i) qs[i] = qp[pr.item * d + i] * sc;
          longest = std::max(longest, pr.contiguous_end);
          pairs.push_back(pr);
        }
      }
      const int64_t n = static_cast<int64_t>(pairs.size());
      // every pair's contiguous keys of the chunk (Pair::kb) or values (Pair::vb), a tile of
      // KEY_TILE at a time for all pairs: fn(c, t0, keys, rows), rows the tile's cache rows
      // as stored, or for a 16-bit cache widened into `tile` once for the pairs that share them
      auto by_tiles = [&](const TC* Pair::*first, auto&& fn) {
        const TC* widened = nullptr;
        int64_t widened_keys = 0;
        for (int64_t t0 = c0; t0 < longest; t0 += KEY_TILE)
          for (int64_t c = 0; c < n; ++c) {
            const int64_t keys = std::min(pairs[c].contiguous_end, t0 + KEY_TILE) - t0;
            if (keys <= 0) continue;
            const TC* rows = pairs[c].*first + t0 * d;
            if constexpr (wide_cache) {
              if (rows != widened || keys > widened_keys) {
                widen<TC>(rows, keys * d, tile);
                widened = rows, widened_keys = keys;
              }
              fn(c, t0, keys, static_cast<const float*>(tile));
            } else {
              fn(c, t0, keys, rows);
            }
          }
      };
      // scores of the contiguous keys
      by_tiles(&Pair::kb, [&](int64_t c, int64_t t0, int64_t keys, const auto* k) {
        using TK = std::remove_cv_t<std::remove_pointer_t<decltype(k)>>;
        const float* qs = qs_all + c * dd;
        float* s = pairs[c].s + t0;
        int64_t j = 0;
        for (; j + 8 <= keys; j += 8) dot8<TK>(qs, k + j * d, d, s + j);
        for (; j + 4 <= keys; j += 4) dot4<TK>(qs, k + j * d, d, s + j);
        for (; j < keys; ++j) s[j] = dot<TK>(qs, k + j * d, d);
      });
      // each pair's path keys in the chunk, the chunk's maximum, exponentials and their sum
      for (int64_t c = 0; c < n; ++c) {
        Pair& pr = pairs[c];
        float* s = pr.s;
        const int64_t end = pr.end, end8 = c0 + (end - c0 + 7) / 8 * 8;
        for (int64_t j = std::max(pr.Lp, c0); j < end; ++j)
          s[j] = dot<TC>(qs_all + c * dd, pr.kh + pr.path[j - pr.Lp] * d, d);
        if (softcap > 0.f)  // Gemma 2: cap * tanh(score / cap), per score
          for (int64_t j = c0; j < end; ++j) s[j] = std::tanh(s[j] / softcap) * softcap;
        if (slopes != nullptr) {  // ALiBi: + the head's slope times the logical key index
          const float slope = slopes[pr.item % Hq];
          for (int64_t j = c0; j < end; ++j) s[j] += slope * static_cast<float>(j);
        }
        const int64_t from = pr.from;  // keys [c0, from) lie before the row's window
        for (int64_t j = c0; j < from; ++j) s[j] = -INFINITY;
        float m = s[from];
        for (int64_t j = from + 1; j < end; ++j) m = std::max(m, s[j]);
        // lanes past the last key (only a pair's last chunk ends off a multiple of 8: no
        // other chunk's scores there): exp8 -> exp(-87), zeroed below
        for (int64_t j = end; j < end8; ++j) s[j] = -INFINITY;
        const __m256 mv = _mm256_set1_ps(m);
        __m256 lv = _mm256_setzero_ps();
        for (int64_t j = c0; j < end8; j += 8) {
          __m256 pj = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
          if (j + 8 > end || j < from) {  // lanes past the last key or before the window: exactly 0
            alignas(32) float keep[8];
            for (int i = 0; i < 8; ++i) keep[i] = j + i < end && j + i >= from ? 1.0f : 0.0f;
            pj = _mm256_mul_ps(pj, _mm256_load_ps(keep));
          }
          _mm256_storeu_ps(s + j, pj);
          lv = _mm256_add_ps(lv, pj);
        }
        sums[c] = hsum(lv);
        maxima[c] = m;
        float* acc = acc_all + c * dd;
        for (int64_t i = 0; i < d; ++i) acc[i] = 0.f;
      }
      // the weighted sums over the chunk's contiguous keys in order of j, a tile at a time
      // for every pair, then each pair's path keys (the same FMA per lane)
      by_tiles(&Pair::vb, [&](int64_t c, int64_t t0, int64_t keys, const auto* v) {
        using TV = std::remove_cv_t<std::remove_pointer_t<decltype(v)>>;
        weighted_sum_d<TV>(pairs[c].s + t0, v, d, 0, keys, acc_all + c * dd);
      });
      for (int64_t c = 0; c < n; ++c) {
        const Pair& pr = pairs[c];
        float* acc = acc_all + c * dd;
        for (int64_t j = std::max(pr.Lp, c0); j < pr.end; ++j)
          weighted_sum_d<TC>(pr.s + j, pr.vh + pr.path[j - pr.Lp] * d, d, 0, 1, acc);
        if (first_key(pr.item / Hq) / KEY_CHUNK == (pr.L - 1) / KEY_CHUNK) {  // its only chunk: its output
          write_output(acc, maxima[c], sums[c], sinks == nullptr ? nullptr : sinks + pr.item % Hq, d,
                       op + pr.item * d);  // out[r, h*d : (h+1)*d]
        } else {
          float* dst = part + (pr.item * chunks + chunk) * part_floats;
          for (int64_t i = 0; i < d; ++i) dst[i] = acc[i];
          dst[dd] = maxima[c];
          dst[dd + 1] = sums[c];
        }
      }
    }
  };
  if (use_pool()) Pool::get().run(items.count, [&](int64_t i) { body(i, i + 1); });
  else at::parallel_for(0, items.count, 1, body);
  if (chunks == 1) return;
  // the pairs of several chunks: their chunks merged in order (see KEY_CHUNK)
  alignas(32) float acc[kMaxHeadDim];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t L = lp[r] + 1;
    const int64_t first = first_key(r) / KEY_CHUNK, last = (L - 1) / KEY_CHUNK;  // the chunks it sees
    if (first == last) continue;
    for (int64_t h = 0; h < Hq; ++h) {
      const float* pc = part + (r * Hq + h) * chunks * part_floats;
      float top = pc[first * part_floats + dd];
      for (int64_t c = first + 1; c <= last; ++c) top = std::max(top, pc[c * part_floats + dd]);
      for (int64_t i = 0; i < d; ++i) acc[i] = 0.f;
      float l = 0.f;
      for (int64_t c = first; c <= last; ++c) {
        const float* chunk_part = pc + c * part_floats;
        const float w = std::exp(chunk_part[dd] - top);
        l = std::fma(w, chunk_part[dd + 1], l);
        const __m256 wv = _mm256_set1_ps(w);
        for (int64_t c8 = 0; c8 < d8; c8 += 8)
          _mm256_store_ps(acc + c8, _mm256_fmadd_ps(wv, _mm256_loadu_ps(chunk_part + c8), _mm256_load_ps(acc + c8)));
        for (int64_t i = d8; i < d; ++i) acc[i] = std::fma(w, chunk_part[i], acc[i]);
      }
      write_output(acc, top, l, sinks == nullptr ? nullptr : sinks + h, d, op + (r * Hq + h) * d);
    }
  }
}

}  // namespace

// q [R, Hq, d] (after RoPE, unscaled; float32, bf16 / fp16 widened exactly first), k/v
// [Hkv, S, d] one layer's cache (float32, bfloat16 or float16, both the same), limit int64
// [R] (the last slot row r sees) -> o [R, Hq * d] float32; all CPU and contiguous.
//
// Trees: `path` int64 [R, P] (P may be 0: every row a chain) lists, per row, the slots of its
// own path in the draft tree (ancestors then itself, in depth order; -1 pads after them). With
// c_r such slots, row r sees logical keys j = 0 .. limit[r]: key j < limit[r] + 1 - c_r at slot j
// (the committed prefix), the last c_r keys at path[r][...] in order. A row's keys are then the
// exact keys a chain row at the same position would see, visited in the same order with the
// same arithmetic, so a tree row is bit-identical to that chain row.
//
// Batches: `base` int64 [R] (or [0]: all zeros) puts row r's contiguous prefix at slots
// base[r] .. (its sequence's KV region); path slots stay absolute. The arithmetic runs over
// logical keys j whatever the base, so a sequence's rows are bit-identical wherever its
// region lies in the cache and whatever the other sequences of the step.
//
// softcap > 0: each score s (the scaled product) becomes softcap * tanh(s / softcap) before the
// softmax (Gemma 2's attn_logit_softcapping); 0: as it is. window > 0: a sliding window, row r
// sees only its logical keys j > limit[r] - window (the keys a query at position limit[r]
// sees in HF's sliding layers); 0: every key up to limit[r].
namespace {
torch::Tensor attention_call(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit, double scale,
                             torch::Tensor path, torch::Tensor base, double softcap, int64_t window,
                             const torch::Tensor* slopes, const char* fn, const torch::Tensor* sinks = nullptr) {
  TORCH_CHECK(q.defined() && q.device().is_cpu(), fn, ": q must be a CPU tensor");
  TORCH_CHECK(float_kind(q), fn, ": q must be float32 (or bfloat16 / float16), got ", q.scalar_type());
  check_cache(k, v, fn);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == k.size(2),
              fn, ": q [R, Hq, d], k and v [Hkv, S, d] (the same d), got q ", q.sizes(), " and k ",
              k.sizes());
  TORCH_CHECK(q.is_contiguous(), fn, ": q must be contiguous");
  const int64_t R = q.size(0), Hq = q.size(1), d = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(R > 0 && Hq > 0, fn, ": empty q (rows and query heads must be >= 1), got ", q.sizes());
  TORCH_CHECK(Hq % Hkv == 0, fn, ": query heads must be a multiple of KV heads, got ", Hq, " and ", Hkv);
  TORCH_CHECK(std::isfinite(scale), fn, ": scale must be finite, got ", scale);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, fn, ": softcap must be finite and >= 0 (0: none), got ",
              softcap);
  TORCH_CHECK(window >= 0, fn, ": window must be >= 0 (0: none), got ", window);
  if (slopes != nullptr) {
    TORCH_CHECK(slopes->defined() && slopes->device().is_cpu() && slopes->scalar_type() == at::kFloat &&
                    slopes->dim() == 1 && slopes->size(0) == Hq && slopes->is_contiguous(),
                fn, ": slopes must be a contiguous float32 CPU tensor [Hq] = [", Hq, "], got ",
                slopes->defined() ? slopes->sizes() : at::IntArrayRef{});
  }
  if (sinks != nullptr) {
    TORCH_CHECK(sinks->defined() && sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat &&
                    sinks->dim() == 1 && sinks->size(0) == Hq && sinks->is_contiguous(),
                fn, ": sinks must be a contiguous float32 CPU tensor [Hq] = [", Hq, "], got ",
                sinks->defined() ? sinks->sizes() : at::IntArrayRef{});
    const float* sp = sinks->data_ptr<float>();
    for (int64_t h = 0; h < Hq; ++h) TORCH_CHECK(std::isfinite(sp[h]), fn, ": sinks must be finite, got ", sp[h]);
  }
  const AttentionMeta meta = check_attention_meta(limit, path, base, R, S, fn);
  if (q.scalar_type() != at::kFloat) q = q.to(at::kFloat);
  auto out = torch::empty({R, Hq * d}, q.options());
  by_dtype(k.scalar_type(), [&](auto tag) {
    using TC = decltype(tag);
    attention_rows<TC>(q.data_ptr<float>(), static_cast<const TC*>(k.data_ptr()),
                       static_cast<const TC*>(v.data_ptr()), meta, R, Hq, Hkv, S, d, static_cast<float>(scale),
                       static_cast<float>(softcap), window, out.data_ptr<float>(),
                       slopes == nullptr ? nullptr : slopes->data_ptr<float>(),
                       sinks == nullptr ? nullptr : sinks->data_ptr<float>());
  });
  return out;
}
}  // namespace

torch::Tensor rows_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                             double scale, torch::Tensor path, torch::Tensor base, double softcap, int64_t window);
torch::Tensor rows_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                             double scale, torch::Tensor path, torch::Tensor base, double softcap, int64_t window) {
  return attention_call(q, k, v, limit, scale, path, base, softcap, window, nullptr, "rows_attention");
}

// rows_attention with ALiBi (Bloom): slopes float32 [Hq]; each score s_j (the scaled
// product, capped where softcap > 0) becomes s_j + slopes[h] * j, j the logical key index
// (a row's key positions: the prefix, then its tree path), before the softmax.
torch::Tensor rows_attention_alibi(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                                   double scale, torch::Tensor path, torch::Tensor base, double softcap,
                                   int64_t window, torch::Tensor slopes);
torch::Tensor rows_attention_alibi(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                                   double scale, torch::Tensor path, torch::Tensor base, double softcap,
                                   int64_t window, torch::Tensor slopes) {
  return attention_call(q, k, v, limit, scale, path, base, softcap, window, &slopes, "rows_attention_alibi");
}

// rows_attention with an attention sink per head (GPT-OSS, Granite-SWA): sinks float32 [Hq]
// (finite); head h's softmax over its keys gains one more logit, sinks[h], whose value is 0:
// o = sum_j exp(s_j) v_j / (exp(sinks[h]) + sum_j exp(s_j)), computed relative to the
// largest of them.
torch::Tensor rows_attention_sinks(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                                   double scale, torch::Tensor path, torch::Tensor base, double softcap,
                                   int64_t window, torch::Tensor sinks);
torch::Tensor rows_attention_sinks(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                                   double scale, torch::Tensor path, torch::Tensor base, double softcap,
                                   int64_t window, torch::Tensor sinks) {
  return attention_call(q, k, v, limit, scale, path, base, softcap, window, nullptr, "rows_attention_sinks",
                        &sinks);
}

// ---- one decoder layer -------------------------------------------------------------------
//
// A whole Llama / Qwen3 decoder layer on the step's rows in one call (the kernel layout's
// `Engine.run_layers`), so a step makes 30 calls instead of ~35 small PyTorch ops per layer
// (~6 ms of a 35 ms step on SmolLM2-135M). Every operation is per row and runs one fixed
// sequence whatever the other rows: RMSNorm (sum of squares in 8 lanes then `hsum`,
// w * (x * (1 / sqrt(mean + eps)))), the products and attention above, RoPE
// (x * cos + rotate_half(x) * sin), SiLU (g * sigmoid(g) with `exp8` of -|g|).
namespace {

void rms_norm_rows(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t rows,
                   int64_t n, float eps, float offset = 0.f) {
  const int64_t n8 = n - n % 8;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
      const __m256 v = _mm256_loadu_ps(xr + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (int64_t i = n8; i < n; ++i) ss = std::fma(xr[i], xr[i], ss);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    if (offset == 0.f) {
      for (int64_t i = 0; i < n8; i += 8)
        _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), iv)));
      for (int64_t i = n8; i < n; ++i) yr[i] = w[i] * (xr[i] * inv);
    } else {  // Gemma: (offset + w) * (x * inv), the sum rounded to float32 first as HF's 1 + w
      const __m256 ov = _mm256_set1_ps(offset);
      for (int64_t i = 0; i < n8; i += 8)
        _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_add_ps(ov, _mm256_loadu_ps(w + i)),
                                               _mm256_mul_ps(_mm256_loadu_ps(xr + i), iv)));
      for (int64_t i = n8; i < n; ++i) yr[i] = (offset + w[i]) * (xr[i] * inv);
    }
  }
}

// x [R, heads, d] in place: x * cos + rotate_half(x) * sin on each head's first `rot`
// dimensions, cos/sin [R, rot]; the other d - rot pass unchanged (partial rotary, as HF
// rotates x[..., :rot] and concatenates the rest: Phi-4-mini's partial_rotary_factor).
// pairs: the rotation turns adjacent pairs (x[2j], x[2j + 1]) instead of the halves (GLM,
// ERNIE 4.5: their rotate_half is (-x[2j + 1], x[2j]) interleaved)
void rope_rows(float* __restrict x, const float* __restrict cos, const float* __restrict sin, int64_t rows,
               int64_t heads, int64_t d, int64_t rot, bool pairs) {
  const int64_t half = rot / 2;
  alignas(32) float t[kMaxHeadDim];
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * rot;
    const float* s = sin + r * rot;
    for (int64_t h = 0; h < heads; ++h) {
      float* xh = x + (r * heads + h) * d;
      if (pairs) {
        for (int64_t i = 0; i < rot; i += 2) {
          t[i] = xh[i] * c[i] + (-xh[i + 1]) * s[i];
          t[i + 1] = xh[i + 1] * c[i + 1] + xh[i] * s[i + 1];
        }
      } else {
        for (int64_t i = 0; i < half; ++i) t[i] = xh[i] * c[i] + (-xh[i + half]) * s[i];
        for (int64_t i = half; i < rot; ++i) t[i] = xh[i] * c[i] + xh[i - half] * s[i];
      }
      for (int64_t i = 0; i < rot; ++i) xh[i] = t[i];
    }
  }
}

// a = silu(g) * u, elementwise over n values (u null: a = silu(g))
void silu_mul(const float* __restrict g, const float* __restrict u, float* __restrict a, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  const int64_t n8 = n - n % 8;
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_or_ps(gv, sign));  // exp(-|g|)
    const __m256 pos = _mm256_div_ps(one, _mm256_add_ps(one, e));  // sigmoid(|g|)
    const __m256 neg = _mm256_div_ps(e, _mm256_add_ps(one, e));    // sigmoid(-|g|)
    const __m256 sig = _mm256_blendv_ps(pos, neg, gv);  // sign bit of g picks
    const __m256 silu = _mm256_mul_ps(gv, sig);
    _mm256_storeu_ps(a + i, u ? _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)) : silu);
  }
  if (n8 < n) {  // the tail through the same vector code on a padded copy
    alignas(32) float gt[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, ut[8] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f}, at[8];
    for (int64_t i = n8; i < n; ++i) gt[i - n8] = g[i], ut[i - n8] = u ? u[i] : 1.f;
    silu_mul(gt, ut, at, 8);
    for (int64_t i = n8; i < n; ++i) a[i] = at[i - n8];
  }
}

// a = gelu(g) * u with GELU's tanh approximation, 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715
// g^3))) as torch's gelu(approximate="tanh") (Gemma's gelu_pytorch_tanh), elementwise
void gelu_tanh_mul(const float* __restrict g, const float* __restrict u, float* __restrict a, int64_t n) {
  constexpr float beta = 0.7978845608028654f, kappa = 0.044715f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    const float inner = beta * (x + kappa * x * x * x);
    a[i] = 0.5f * x * (1.0f + std::tanh(inner)) * u[i];
  }
}

// one row's K or V (float32) into a cache slot of type TC (round to nearest even, as
// torch's .to(dtype))
template <typename TC>
inline void store_row(TC* __restrict dst, const float* __restrict src, int64_t d) {
  if constexpr (std::is_same_v<TC, float>) std::memcpy(dst, src, d * sizeof(float));
  else for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<TC>(src[i]);
}

}  // namespace

// h [R, H] float32 (the residual stream before the layer) -> after the layer, float32;
// writes the layer's K and V of row r at slot slots[r] of k_cache / v_cache [Hkv, S, d]
// (float32, bfloat16 or float16: rounded to nearest even on the write). weights: input norm
// [H], q [Hq*d, H], k [Hkv*d, H], v [Hkv*d, H], o [H, Hq*d], post norm [H], gate [I, H],
// up [I, H], down [H, I]; then (11 or 13) q norm and k norm, each [d] on every head (Qwen3)
// or [Hq*d] / [Hkv*d] on the whole projection (OLMo 2); then (13) the attention output's
// norm [H] and the MLP output's norm [H] (OLMo 2 norms the blocks' outputs). A norm given as
// an empty tensor is not applied (OLMo 2 has no input or post norm). The seven projections
// share one dtype (float32, bfloat16 or float16, read as such), the norms any of the three
// (widened to float32). cos / sin [R, d] float32 at the rows' positions; slots
// int64 [R]; limit int64 [R] the last (logical) key each row sees, path [R, P] its tree slots
// (see rows_attention; P = 0 for chains), base int64 [R] or [0] the slot of each row's
// logical key 0 (see rows_attention). norm_offset 1: every norm scales by (1 + w) (Gemma;
// 0: by w); gelu: the MLP's activation is GELU's tanh approximation (Gemma; else SiLU);
// softcap, window: as rows_attention's; rope_pairs: RoPE turns adjacent pairs (rope_rows).
// With linear biases (Qwen2's q/k/v, `attention_bias`, `mlp_bias`): 20 weights, the 13 (norms
// the layer lacks empty) then the biases of q [Hq*d], k, v [Hkv*d], o [H], gate, up [I] and
// down [H], each empty where that projection has none, any float dtype (widened to float32),
// added to its product's float32 rows. All CPU and contiguous. Everything is checked before
// the cache is written.
torch::Tensor rows_layer(torch::Tensor h, std::vector<torch::Tensor> weights, torch::Tensor k_cache,
                         torch::Tensor v_cache, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                         torch::Tensor limit, double eps, double scale, double residual_scale, torch::Tensor path,
                         torch::Tensor base, double norm_offset, bool gelu, double softcap, int64_t window,
                         bool rope_pairs);
torch::Tensor rows_layer(torch::Tensor h, std::vector<torch::Tensor> weights, torch::Tensor k_cache,
                         torch::Tensor v_cache, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                         torch::Tensor limit, double eps, double scale, double residual_scale, torch::Tensor path,
                         torch::Tensor base, double norm_offset, bool gelu, double softcap, int64_t window,
                         bool rope_pairs) {
  const char* fn = "rows_layer";
  TORCH_CHECK(weights.size() == 9 || weights.size() == 11 || weights.size() == 13 || weights.size() == 20,
              "rows_layer: 9 weights, 11 with q/k norms, 13 with output norms or 20 with biases, got ",
              weights.size());
  TORCH_CHECK(h.defined() && h.device().is_cpu() && h.scalar_type() == at::kFloat && h.dim() == 2 &&
              h.is_contiguous(), "rows_layer: h must be [R, H] float32 contiguous on the CPU");
  const int64_t R = h.size(0), H = h.size(1);
  TORCH_CHECK(R > 0 && H > 0, "rows_layer: empty h (rows and hidden size must be >= 1), got ", h.sizes());
  check_cache(k_cache, v_cache, fn);
  const int64_t Hkv = k_cache.size(0), S = k_cache.size(1), d = k_cache.size(2);
  TORCH_CHECK(d % 2 == 0, "rows_layer: even head_dim (RoPE halves), got ", d);
  static const char* names[] = {"input norm", "q", "k", "v", "o", "post norm", "gate", "up", "down", "q norm",
                                "k norm", "attention output norm", "MLP output norm", "q bias", "k bias",
                                "v bias", "o bias", "gate bias", "up bias", "down bias"};
  // the projections (1-4, 6-8) of a float32 layer may come in rows_compact's form (uint8)
  auto projection = [](size_t i) { return (i >= 1 && i <= 4) || (i >= 6 && i <= 8); };
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto& t = weights[i];
    TORCH_CHECK(t.defined() && t.device().is_cpu(), "rows_layer: the ", names[i], " weight must be a CPU tensor");
    TORCH_CHECK(float_kind(t) || (projection(i) && is_compact(t)), "rows_layer: the ", names[i],
                " weight must be float32, bfloat16 or float16", (projection(i) ? " (or rows_compact's uint8)" : ""),
                ", got ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), "rows_layer: the ", names[i], " weight must be contiguous");
  }
  // a compact projection stands for float32 weights
  auto dtype_of = [&](int i) { return is_compact(weights[i]) ? at::kFloat : weights[i].scalar_type(); };
  const auto wtype = dtype_of(1);
  for (int i : {2, 3, 4, 6, 7, 8})
    TORCH_CHECK(dtype_of(i) == wtype, "rows_layer: the projections must share one dtype (compact ones count as "
                "float32), got q ", wtype, " and ", names[i], " ", dtype_of(i));
  TORCH_CHECK(weights[1].dim() == 2 &&
              (is_compact(weights[1]) ? compact_form(H, weights[1].size(1)) >= 0 : weights[1].size(1) == H) &&
              weights[1].size(0) > 0 &&
              weights[1].size(0) % d == 0, "rows_layer: the q weight must be [Hq * d, H] with H = ", H,
              ", d = ", d, ", got ", weights[1].sizes());
  const int64_t Hq = weights[1].size(0) / d;
  TORCH_CHECK(Hq % Hkv == 0, "rows_layer: query heads must be a multiple of KV heads, got ", Hq, " and ", Hkv);
  TORCH_CHECK(weights[6].dim() == 2 && weights[6].size(0) > 0, "rows_layer: the gate weight must be [I, H], got ",
              weights[6].sizes());
  const int64_t I = weights[6].size(0);
  // q/k norms on each head ([d]) or on the whole projection ([Hq*d], [Hkv*d])
  const bool whole_qk = weights.size() > 9 && weights[9].dim() == 1 && weights[9].size(0) == Hq * d && Hq > 1;
  const std::vector<std::vector<int64_t>> shapes = {
      {H}, {Hq * d, H}, {Hkv * d, H}, {Hkv * d, H}, {H, Hq * d}, {H}, {I, H}, {I, H}, {H, I},
      {whole_qk ? Hq * d : d}, {whole_qk ? Hkv * d : d}, {H}, {H},
      {Hq * d}, {Hkv * d}, {Hkv * d}, {H}, {I}, {I}, {H}};
  // the norms and biases that may be left out (an empty tensor): q and k norm only together
  auto absent = [&](size_t i) { return (i == 0 || i == 5 || i >= 9) && weights[i].numel() == 0; };
  for (size_t i = 0; i < weights.size(); ++i) {
    if (is_compact(weights[i])) {  // [O, compact_row_bytes(K, form)] for the projection's [O, K]
      check_compact(weights[i], shapes[i][1], "rows_layer", names[i]);
      TORCH_CHECK(weights[i].size(0) == shapes[i][0], "rows_layer: the ", names[i], " weight (compact) must have ",
                  shapes[i][0], " rows, got ", weights[i].size(0));
      continue;
    }
    TORCH_CHECK(absent(i) || weights[i].sizes() == c10::IntArrayRef(shapes[i]), "rows_layer: the ", names[i],
                " weight must be ", c10::IntArrayRef(shapes[i]), (i == 0 || i == 5 || i >= 9 ? " or empty" : ""),
                " (H = ", H, ", Hq = ", Hq, ", Hkv = ", Hkv, ", d = ", d, ", I = ", I, "), got ", weights[i].sizes());
  }
  if (weights.size() > 9)
    TORCH_CHECK(absent(9) == absent(10), "rows_layer: q norm and k norm must both be given or both be empty");
  // cos/sin [R, rot]: RoPE on each head's first rot dimensions (rot = d: all of them)
  const int64_t rot = cos.defined() && cos.dim() == 2 ? cos.size(1) : -1;
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->defined() && t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                t->dim() == 2 && t->size(0) == R && t->size(1) == rot && rot >= 2 && rot <= d && rot % 2 == 0,
                "rows_layer: cos/sin must be [R, rot] = [", R, ", rot] float32 contiguous on the CPU with rot even "
                "and <= d = ", d, " (the rotated dimensions), got ", t->scalar_type(), " ", t->sizes());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "rows_layer: eps must be finite and >= 0, got ", eps);
  TORCH_CHECK(std::isfinite(scale), "rows_layer: scale must be finite, got ", scale);
  TORCH_CHECK(std::isfinite(residual_scale), "rows_layer: residual_scale must be finite, got ", residual_scale);
  TORCH_CHECK(norm_offset == 0.0 || norm_offset == 1.0, "rows_layer: norm_offset must be 0 or 1 (Gemma), got ",
              norm_offset);
  auto sl = index_vector(slots, R, fn, "slots");
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(sp[r] >= 0 && sp[r] < S, "rows_layer: a slot is outside the cache: slots[", r, "] = ", sp[r],
                ", the cache has ", S, " slots");
  check_attention_meta(limit, path, base, R, S, fn);  // before the cache is written
  // norm weights and biases as float32 (a no-op for float32 models)
  std::vector<torch::Tensor> norm(20);  // by weight index; undefined: not applied (or not given)
  for (int i : {0, 5, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19})
    if (i < static_cast<int>(weights.size()) && !absent(i)) norm[i] = weights[i].to(at::kFloat).contiguous();
  // the product of rows x [R, in] with projection i (1-4, 6-8), plus its bias (weight i + 12 or
  // 13, where given) on every row
  auto product = [&](const torch::Tensor& x, int i) {
    auto y = rows_linear(x, weights[i]);
    const auto& b = norm[i < 5 ? i + 12 : i + 11];
    if (b.defined()) y.add_(b);
    return y;
  };

  const float e = static_cast<float>(eps), off = static_cast<float>(norm_offset);
  // norm i of the rows of t [R, H] into out (out may be t), where the layer has that norm;
  // t itself where it has not
  auto normed = [&](const torch::Tensor& t, int i, const torch::Tensor& out) {
    if (!norm[i].defined()) return t;
    rms_norm_rows(t.data_ptr<float>(), norm[i].data_ptr<float>(), out.data_ptr<float>(), R, H, e, off);
    return out;
  };
  auto buffer = torch::empty_like(h);  // the blocks' normed inputs
  const auto x = normed(h, 0, buffer);
  auto q = product(x, 1);  // [R, Hq*d]
  auto k = product(x, 2);  // [R, Hkv*d]
  auto v = product(x, 3);
  if (norm[9].defined()) {  // q/k norms before RoPE, on each head or on the whole projection
    rms_norm_rows(q.data_ptr<float>(), norm[9].data_ptr<float>(), q.data_ptr<float>(), whole_qk ? R : R * Hq,
                  whole_qk ? Hq * d : d, e, off);
    rms_norm_rows(k.data_ptr<float>(), norm[10].data_ptr<float>(), k.data_ptr<float>(), whole_qk ? R : R * Hkv,
                  whole_qk ? Hkv * d : d, e, off);
  }
  rope_rows(q.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), R, Hq, d, rot, rope_pairs);
  rope_rows(k.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), R, Hkv, d, rot, rope_pairs);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  by_dtype(k_cache.scalar_type(), [&](auto tag) {
    using TC = decltype(tag);
    TC* kc = static_cast<TC*>(k_cache.data_ptr());
    TC* vc = static_cast<TC*>(v_cache.data_ptr());
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < Hkv; ++g) {
        store_row<TC>(kc + (g * S + sp[r]) * d, kp + (r * Hkv + g) * d, d);
        store_row<TC>(vc + (g * S + sp[r]) * d, vp + (r * Hkv + g) * d, d);
      }
  });
  auto o = rows_attention(q.view({R, Hq, d}), k_cache, v_cache, limit, scale, path, base, softcap, window);
  // a block's output joins the residual stream times residual_scale (Granite's
  // residual_multiplier: HF multiplies, then adds); 1: added as it is
  auto scaled = [&](torch::Tensor t) { return residual_scale == 1.0 ? t : t.mul_(residual_scale); };
  auto attn_out = product(o, 4);
  auto h1 = h + scaled(normed(attn_out, 11, attn_out));
  const auto x1 = normed(h1, 5, buffer);
  auto gate = product(x1, 6);
  auto up = product(x1, 7);
  if (gelu) gelu_tanh_mul(gate.data_ptr<float>(), up.data_ptr<float>(), gate.data_ptr<float>(), gate.numel());
  else silu_mul(gate.data_ptr<float>(), up.data_ptr<float>(), gate.data_ptr<float>(), gate.numel());
  auto mlp_out = product(gate, 8);
  return h1 + scaled(normed(mlp_out, 12, mlp_out));
}

// ---- a top-layer draft head's step (hf_selfspec/heads/top.py) ---------------------------
//
// One chained step of TopDraftHeads for n rows in one call, where the PyTorch version takes
// ~20 small operations: x = [norm(h) * h_norm; norm(e) * e_norm], h' = h + up(silu(down(x))),
// logits = lm(norm(h') * out_norm), then each row's k likeliest tokens and their softmax
// probabilities. A draft is only a proposal (the model verifies every token), so this
// arithmetic need not match the PyTorch step bit for bit; it is deterministic, and each row's
// result does not depend on the other rows.
namespace {

// (probabilities, indices) of the k largest of z[0, V) under softmax; ties: lower index first
void softmax_top(const float* z, int64_t V, int64_t k, float* probs, int64_t* ids) {
  float m = -INFINITY;
  for (int64_t j = 0; j < V; ++j) m = std::max(m, z[j]);
  const int64_t V8 = V - V % 8;
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < V8; j += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(z + j), mv)));
  float total = hsum(acc);
  for (int64_t j = V8; j < V; ++j) total += std::exp(z[j] - m);
  int64_t found = 0;  // ids[0, found) by value, descending
  for (int64_t j = 0; j < V; ++j) {
    if (found == k && !(z[j] > z[ids[k - 1]])) continue;
    int64_t at = found < k ? found++ : k - 1;
    while (at > 0 && z[j] > z[ids[at - 1]]) {
      ids[at] = ids[at - 1];
      --at;
    }
    ids[at] = j;
  }
  for (int64_t i = 0; i < k; ++i) probs[i] = std::exp(z[ids[i]] - m) / total;
}

}  // namespace

// h [n, H], e [n, H] float32 (the state, the previous tokens' input embeddings); h_norm,
// e_norm, out_norm [H]; down [A, 2H], up [H, A], lm [V, H] (the reduced vocabulary's LM rows);
// weights float32 / bfloat16 / float16, contiguous CPU -> [h' [n, H] float32, probs [n, k]
// float32, ids [n, k] int64 (indices into lm's rows, likeliest first)]
std::vector<torch::Tensor> rows_draft_step(torch::Tensor h, torch::Tensor e, torch::Tensor h_norm, torch::Tensor e_norm,
                                           torch::Tensor down, torch::Tensor up, torch::Tensor out_norm,
                                           torch::Tensor lm, double eps, double out_eps, int64_t k);
std::vector<torch::Tensor> rows_draft_step(torch::Tensor h, torch::Tensor e, torch::Tensor h_norm, torch::Tensor e_norm,
                                           torch::Tensor down, torch::Tensor up, torch::Tensor out_norm,
                                           torch::Tensor lm, double eps, double out_eps, int64_t k) {
  const char* fn = "rows_draft_step";
  for (const auto* t : {&h, &e})
    TORCH_CHECK(t->defined() && t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 &&
                t->is_contiguous(), fn, ": h and e must be [n, H] float32 contiguous on the CPU");
  const int64_t n = h.size(0), H = h.size(1);
  TORCH_CHECK(n > 0 && H > 0 && e.sizes() == h.sizes(), fn, ": h and e must both be [n, H], n, H >= 1, got ",
              h.sizes(), " and ", e.sizes());
  for (const auto* t : {&h_norm, &e_norm, &out_norm})
    TORCH_CHECK(t->defined() && t->device().is_cpu() && float_kind(*t) && t->dim() == 1 && t->size(0) == H, fn,
                ": the norm weights must be [", H, "] float CPU tensors");
  check_matrix(down, fn, "down");
  check_matrix(up, fn, "up");
  check_matrix(lm, fn, "lm");
  const int64_t A = down.size(0), V = lm.size(0);
  TORCH_CHECK(down.size(1) == 2 * H && up.size(0) == H && up.size(1) == A && lm.size(1) == H, fn,
              ": shapes must be down [A, 2H], up [H, A], lm [V, H] with H = ", H, ", got ", down.sizes(), ", ",
              up.sizes(), ", ", lm.sizes());
  TORCH_CHECK(k >= 1 && k <= V, fn, ": k must be in [1, ", V, "], got ", k);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0 && std::isfinite(out_eps) && out_eps >= 0, fn, ": eps must be >= 0");
  const auto hn = h_norm.to(at::kFloat).contiguous(), en = e_norm.to(at::kFloat).contiguous(),
             on = out_norm.to(at::kFloat).contiguous();
  auto x = torch::empty({n, 2 * H}, h.options());
  float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    rms_norm_rows(h.data_ptr<float>() + r * H, hn.data_ptr<float>(), xp + r * 2 * H, 1, H, static_cast<float>(eps));
    rms_norm_rows(e.data_ptr<float>() + r * H, en.data_ptr<float>(), xp + r * 2 * H + H, 1, H,
                  static_cast<float>(eps));
  }
  auto a = rows_linear(x, down);  // [n, A]
  silu_mul(a.data_ptr<float>(), nullptr, a.data_ptr<float>(), a.numel());
  auto next = h + rows_linear(a, up);  // [n, H]
  auto y = torch::empty_like(next);
  rms_norm_rows(next.data_ptr<float>(), on.data_ptr<float>(), y.data_ptr<float>(), n, H, static_cast<float>(out_eps));
  auto z = rows_linear(y, lm);  // [n, V]
  auto probs = torch::empty({n, k}, h.options());
  auto ids = torch::empty({n, k}, h.options().dtype(at::kLong));
  for (int64_t r = 0; r < n; ++r)
    softmax_top(z.data_ptr<float>() + r * V, V, k, probs.data_ptr<float>() + r * k, ids.data_ptr<int64_t>() + r * k);
  return {next, probs, ids};
}

// ---- the screen's int8 product on AVX-512 ---------------------------------------------------
//
// The screen's int8 logits need no fixed arithmetic (its bound holds for any summation
// order, and the float32 rows decide), so where the CPU has AVX-512 they are summed in 16
// lanes: int8 widens to four times the elements per byte of float32, and at several rows the
// 8-lane tiles are bound by their FMAs, not by memory.
template <int NX>
WIDE_TARGET __attribute__((noinline)) void screen_tile16(const int8_t* __restrict q, const float* __restrict x,
                                                         int64_t K, int64_t V, int64_t v, int64_t nw,
                                                         float* __restrict y) {
  __m512 acc[2][NX];
  for (int i = 0; i < 2; ++i)
    for (int c = 0; c < NX; ++c) acc[i][c] = _mm512_setzero_ps();
  const int64_t k16 = K - K % 16;
  const int8_t* q1 = q + (nw > 1 ? K : 0);  // a lone last row reads its own row twice
  for (int64_t k = 0; k < k16; k += 16) {
    if ((k & 63) == 0) {  // 8 KiB ahead as `tile` (1 KiB ahead: ~0.5 ms slower per step)
      _mm_prefetch(reinterpret_cast<const char*>(q + k + 8192), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(q1 + k + 8192), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q1 + k))));
    for (int c = 0; c < NX; ++c) {
      const __m512 xv = _mm512_loadu_ps(x + c * K + k);
      acc[0][c] = _mm512_fmadd_ps(w0, xv, acc[0][c]);
      acc[1][c] = _mm512_fmadd_ps(w1, xv, acc[1][c]);
    }
  }
  for (int i = 0; i < static_cast<int>(nw); ++i) {
    const int8_t* qi = i ? q1 : q;
    for (int c = 0; c < NX; ++c) {
      float sum = _mm512_reduce_add_ps(acc[i][c]);
      for (int64_t k = k16; k < K; ++k) sum = std::fma(static_cast<float>(qi[k]), x[c * K + k], sum);
      y[c * V + v + i] = sum;
    }
  }
}

template <int NX>
void screen_rows16(const int8_t* q, const float* x, float* y, int64_t K, int64_t V) {
  for_outputs(V, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; v += 2) screen_tile16<NX>(q + v * K, x, K, V, v, std::min<int64_t>(2, v1 - v), y);
  });
}

// The screen's products take the rows 8 at a time: f(std::integral_constant<int, n>, r0) for
// each block [r0, r0 + n), n in 1..8 a compile-time tile width
template <typename F>
void screen_row_blocks(int64_t R, F&& f) {
  for (int64_t r0 = 0; r0 < R; r0 += 8) {
    switch (std::min<int64_t>(8, R - r0)) {
      case 1: f(std::integral_constant<int, 1>{}, r0); break;
      case 2: f(std::integral_constant<int, 2>{}, r0); break;
      case 3: f(std::integral_constant<int, 3>{}, r0); break;
      case 4: f(std::integral_constant<int, 4>{}, r0); break;
      case 5: f(std::integral_constant<int, 5>{}, r0); break;
      case 6: f(std::integral_constant<int, 6>{}, r0); break;
      case 7: f(std::integral_constant<int, 7>{}, r0); break;
      default: f(std::integral_constant<int, 8>{}, r0); break;
    }
  }
}

// y [R, V] = x [R, K] . q [V, K] (int8 widened), in any order: AVX-512 where the CPU has it
// (and rows_isa has not turned it off)
void screen_product(const int8_t* q, const float* x, float* y, int64_t R, int64_t K, int64_t V) {
  if (!use_wide()) {
    linear_rows<int8_t>(q, x, y, R, K, V);
    return;
  }
  screen_row_blocks(R, [&](auto nx, int64_t r0) {
    screen_rows16<decltype(nx)::value>(q, x + r0 * K, y + r0 * V, K, V);
  });
}

// ---- the screen's product with x quantised too (AVX-512 VNNI) -------------------------------
//
// Where the CPU has AVX-512 VNNI, each row x is quantised as well, to 16-bit integers: x_q =
// round(x / s_x) in [-L, L] with s_x = max|x| / L, and x_q . q_v is summed exactly in int32 by
// vpdpwssd (32 products per instruction, one widening of q per 32 weights shared by all rows:
// at several rows the float32 tiles above are bound by their widenings and FMAs). L keeps
// every sum below 2^31: K L 127 < 2^31. The error this adds, |s_v q_v . (x - s_x x_q)| <= s_v
// ||q_v|| ||x - s_x x_q||, enters every token's bound (screen.py: `qnorm` >= s_v ||q_v||;
// rows_screen: e_x >= ||x - s_x x_q||); it is about 1/L of ||x|| ||w_v||, against the ~1/127
// of the rows' own quantisation, so the candidates stay as few. (8-bit x, one vpdpbusd per 64
// weights, cost less per row but its error, up to ~4% of ||x|| on the hidden states' outlier
// dimensions, left a quarter of SmolLM2's rows with over 128 candidates.)
inline bool vnni_supported() {
  static const bool ok = wide_supported() && __builtin_cpu_supports("avx512vnni");
  return ok;
}
inline bool use_vnni() { return vnni_supported() && g_wide_on.load(std::memory_order_relaxed); }

// whether rows_screen quantises x to 16 bits (AVX-512 VNNI, and rows_isa has not turned AVX-512
// off): its answers are the same either way (the float32 argmax, or no answer)
bool rows_screen_vnni();
bool rows_screen_vnni() { return use_vnni(); }

#define VNNI_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni")))

// 2 weight rows (q, q + K) times NX quantised x rows (xq, stride Kp: zero-padded to a multiple
// of 32); y[c * V + v + i] = s_x[c] (x_q[c] . q_{v+i}) in float32 (the int32 sum exact)
template <int NX>
VNNI_TARGET __attribute__((noinline)) void screen_tile_vnni(const int8_t* __restrict q, const int16_t* __restrict xq,
                                                            const float* __restrict sx, int64_t K, int64_t Kp,
                                                            int64_t V, int64_t v, int64_t nw, float* __restrict y) {
  __m512i acc[2][NX];
  for (int i = 0; i < 2; ++i)
    for (int c = 0; c < NX; ++c) acc[i][c] = _mm512_setzero_si512();
  const int8_t* q1 = q + (nw > 1 ? K : 0);  // a lone last row reads its own row twice
  const int64_t k32 = K - K % 32;
  for (int64_t k = 0; k < k32; k += 32) {
    if ((k & 63) == 0) {  // one cache line of each row per 64 weights, 8 KiB ahead as `tile`
      _mm_prefetch(reinterpret_cast<const char*>(q + k + 8192), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(q1 + k + 8192), _MM_HINT_T1);
    }
    const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k)));
    const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q1 + k)));
    for (int c = 0; c < NX; ++c) {
      const __m512i xv = _mm512_loadu_si512(xq + c * Kp + k);
      acc[0][c] = _mm512_dpwssd_epi32(acc[0][c], xv, w0);
      acc[1][c] = _mm512_dpwssd_epi32(acc[1][c], xv, w1);
    }
  }
  if (k32 < K) {  // the last K % 32 weights, masked (no read past the row)
    const __mmask32 m = (~0U) >> (32 - (K - k32));
    const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, q + k32));
    const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, q1 + k32));
    for (int c = 0; c < NX; ++c) {
      const __m512i xv = _mm512_loadu_si512(xq + c * Kp + k32);
      acc[0][c] = _mm512_dpwssd_epi32(acc[0][c], xv, w0);
      acc[1][c] = _mm512_dpwssd_epi32(acc[1][c], xv, w1);
    }
  }
  for (int i = 0; i < static_cast<int>(nw); ++i)
    for (int c = 0; c < NX; ++c)
      y[c * V + v + i] = static_cast<float>(_mm512_reduce_add_epi32(acc[i][c])) * sx[c];
}

template <int NX>
void screen_rows_vnni(const int8_t* q, const int16_t* xq, const float* sx, float* y, int64_t K, int64_t Kp, int64_t V) {
  for_outputs(V, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; v += 2)
      screen_tile_vnni<NX>(q + v * K, xq, sx, K, Kp, V, v, std::min<int64_t>(2, v1 - v), y);
  });
}

void screen_product_vnni(const int8_t* q, const int16_t* xq, const float* sx, float* y, int64_t R, int64_t K,
                         int64_t Kp, int64_t V) {
  screen_row_blocks(R, [&](auto nx, int64_t r0) {
    screen_rows_vnni<decltype(nx)::value>(q, xq + r0 * Kp, sx + r0, y + r0 * V, K, Kp, V);
  });
}

// ---- the LM head's argmax screen (hf_selfspec/engine/screen.py) -------------------------
//
// Each row's exact argmax of x . w (float32 LM head w [V, K]) from int8 rows q [V, K] with
// per-row scales s [V]: z_v = s_v (x . q_v) is within b_v ||x|| of the float32 logit (b [V],
// the per-row bounds screen.py proves), so only tokens with z_v + b_v ||x|| >= max_u (z_u -
// b_u ||x||) can be the argmax; their float32 logits, computed by the same tile arithmetic as
// the full product's (a dot product does not depend on the other rows or outputs), decide,
// ties to the lowest id as torch.argmax. The comparisons run in float32 with a slack that
// covers their rounding. out[r] = the argmax, or -1 where the row cannot be screened (a
// non-finite value, or more than max_candidates candidates): the caller then computes the
// float32 logits.
torch::Tensor rows_screen(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor bound,
                          torch::Tensor qnorm, torch::Tensor w, int64_t max_candidates);
torch::Tensor rows_screen(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor bound,
                          torch::Tensor qnorm, torch::Tensor w, int64_t max_candidates) {
  const char* fn = "rows_screen";
  check_matrix(x, fn, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat, fn, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(q.defined() && q.device().is_cpu() && q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(),
              fn, ": q must be [V, K] int8 contiguous on the CPU");
  check_matrix(w, fn, "w");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.sizes() == q.sizes(), fn, ": w must be float32 of q's shape ",
              q.sizes(), ", got ", w.scalar_type(), " ", w.sizes());
  const int64_t n = x.size(0), K = x.size(1), V = q.size(0);
  TORCH_CHECK(n > 0 && K > 0 && V > 0 && q.size(1) == K, fn, ": x [n, K], q [V, K] must share K >= 1, got ",
              x.sizes(), " and ", q.sizes());
  for (const auto* t : {&scale, &bound, &qnorm})
    TORCH_CHECK(t->defined() && t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 1 &&
                t->size(0) == V && t->is_contiguous(), fn, ": scale, bound and qnorm must be [", V, "] float32");
  TORCH_CHECK(max_candidates >= 1, fn, ": max_candidates must be >= 1, got ", max_candidates);
  auto d = torch::empty({n, V}, x.options());
  const float* xp = x.data_ptr<float>();
  // e_x [n] >= ||x - s_x x_q|| where x is quantised (0 where it is not); a row with a
  // non-finite value is not quantised (no answer below)
  std::vector<float> ex(n, 0.f);
  // the int32 sums stay exact while K L 127 < 2^31 (L >= 1: K below 2^31 / 127)
  const int64_t levels = std::min<int64_t>(32767, (int64_t{1} << 31) / (127 * K) - 1);
  if (use_vnni() && levels >= 1024) {
    const int64_t Kp = (K + 31) / 32 * 32;
    std::vector<int16_t> xq(static_cast<size_t>(n * Kp), 0);
    std::vector<float> sx(n, 0.f);
    const float L = static_cast<float>(levels);
    const float gamma = static_cast<float>(K + 2) * 0x1p-24f / (1.f - static_cast<float>(K + 2) * 0x1p-24f);
    for (int64_t r = 0; r < n; ++r) {
      const float* xr = xp + r * K;
      float most = 0.f;
      bool finite = true;
      for (int64_t i = 0; i < K; ++i) {
        const float a = std::fabs(xr[i]);
        finite = finite && a <= FLT_MAX;  // false for inf and NaN
        most = std::max(most, a);
      }
      if (!finite) {
        ex[r] = INFINITY;  // no answer for this row
        continue;
      }
      const float s = most / L;
      sx[r] = s;
      float ee = 0.f;
      for (int64_t i = 0; i < K; ++i) {
        const float t = s > 0.f ? std::min(L, std::max(-L, std::nearbyint(xr[i] / s))) : 0.f;
        xq[r * Kp + i] = static_cast<int16_t>(t);
        const float e = std::fma(-s, t, xr[i]);  // x_i - s_x t_i, one rounding
        ee = std::fma(e, e, ee);
      }
      // a float32 sum of K squares is within gamma of the exact one, each e_i within u of its
      // exact value; 1.001 for this arithmetic
      ex[r] = std::sqrt(ee) * (1.f + 2.f * gamma) * 1.001f;
    }
    screen_product_vnni(q.data_ptr<int8_t>(), xq.data(), sx.data(), d.data_ptr<float>(), n, K, Kp, V);
  } else {
    screen_product(q.data_ptr<int8_t>(), xp, d.data_ptr<float>(), n, K, V);
  }
  const float* sp = scale.data_ptr<float>();
  const float* bp = bound.data_ptr<float>();
  const float* gp = qnorm.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  auto out = torch::empty({n}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t V8 = V - V % 8;
  // each row alone (its passes over the vocabulary), rows shared between the threads
  auto screen_row = [&](int64_t r) {
    std::vector<int64_t> found;
    float* z = d.data_ptr<float>() + r * V;
    const float* xr = xp + r * K;
    float ss = 0.f;
    for (int64_t i = 0; i < K; ++i) ss = std::fma(xr[i], xr[i], ss);
    const float nx = std::sqrt(ss);
    const float xe = ex[r];
    if (!std::isfinite(ss) || !std::isfinite(xe)) {
      op[r] = -1;
      return;
    }
    const __m256 nv = _mm256_set1_ps(nx), ev = _mm256_set1_ps(xe), zero = _mm256_setzero_ps(),
                 sign = _mm256_set1_ps(-0.0f);
    // z_v = s_v d_v in place; each token's width b_v ||x|| + g_v e_x; lo = max (z - width);
    // the largest |z| + width; 0 * z summed: NaN iff some z is NaN or infinite
    __m256 lo = _mm256_set1_ps(-INFINITY), big = zero, poison = zero;
    for (int64_t v = 0; v < V8; v += 8) {
      const __m256 zv = _mm256_mul_ps(_mm256_loadu_ps(z + v), _mm256_loadu_ps(sp + v));
      const __m256 bv = _mm256_fmadd_ps(_mm256_loadu_ps(gp + v), ev, _mm256_mul_ps(_mm256_loadu_ps(bp + v), nv));
      _mm256_storeu_ps(z + v, zv);
      lo = _mm256_max_ps(lo, _mm256_sub_ps(zv, bv));
      big = _mm256_max_ps(big, _mm256_add_ps(_mm256_andnot_ps(sign, zv), bv));
      poison = _mm256_add_ps(poison, _mm256_mul_ps(zv, zero));
    }
    alignas(32) float a[8], c[8];
    _mm256_store_ps(a, lo);
    _mm256_store_ps(c, big);
    float low = -INFINITY, most = 0.f, bad = hsum(poison);
    for (int i = 0; i < 8; ++i) low = std::max(low, a[i]), most = std::max(most, c[i]);
    for (int64_t v = V8; v < V; ++v) {
      z[v] *= sp[v];
      const float width = std::fma(gp[v], xe, bp[v] * nx);
      low = std::max(low, z[v] - width);
      most = std::max(most, std::fabs(z[v]) + width);
      bad += z[v] * 0.f;
    }
    if (bad != 0.f || !std::isfinite(low) || !std::isfinite(most)) {
      op[r] = -1;
      return;
    }
    // every float32 operation above is within 2^-24 of its exact value: 2e-6 of the largest
    // magnitude covers the few of them on either side of the comparison (z itself: up to
    // three roundings where x is quantised)
    const float threshold = low - 2e-6f * most;
    const __m256 tv = _mm256_set1_ps(threshold);

    const int64_t cap = max_candidates;
    for (int64_t v = 0; v < V8 && static_cast<int64_t>(found.size()) <= cap; v += 8) {
      const __m256 width = _mm256_fmadd_ps(_mm256_loadu_ps(gp + v), ev, _mm256_mul_ps(_mm256_loadu_ps(bp + v), nv));
      const __m256 up = _mm256_add_ps(_mm256_loadu_ps(z + v), width);
      for (int mask = _mm256_movemask_ps(_mm256_cmp_ps(up, tv, _CMP_GE_OQ)); mask; mask &= mask - 1)
        found.push_back(v + __builtin_ctz(mask));
    }
    for (int64_t v = V8; v < V && static_cast<int64_t>(found.size()) <= cap; ++v)
      if (z[v] + std::fma(gp[v], xe, bp[v] * nx) >= threshold) found.push_back(v);
    if (found.empty() || static_cast<int64_t>(found.size()) > cap) {
      op[r] = -1;
      return;
    }
    // the candidates' float32 logits, each as the full product computes it (ascending ids:
    // the first of equal maxima is the lowest id)
    int64_t best = -1;
    float best_value = 0.f;
    for (int64_t v : found) {
      float value;
      tile<float, 1, 1>(wp + v * K, xr, K, 1, 0, &value);
      if (best < 0 || value > best_value) best = v, best_value = value;
    }
    op[r] = best;
  };
  if (use_pool()) Pool::get().run(n, screen_row);
  else at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) { for (int64_t r = r0; r < r1; ++r) screen_row(r); });
  return out;
}

// ---- all layers of a step in one call -----------------------------------------------------
//
// rows_layer for layers [start, end) in turn: weights holds each layer's `per_layer` tensors
// (rows_layer's 9, 11 or 13) one layer after another, k_cache / v_cache [L, Hkv, S, d] every
// layer's cache. With 16-bit projections the residual stream is rounded to their dtype
// after every layer (as the PyTorch layers in that dtype do), so a row's bits do not depend
// on how a step's layers are split between calls. One call per step instead of one per
// layer keeps the Python loop and 30 argument conversions out of the step.
torch::Tensor rows_layers(torch::Tensor h, std::vector<torch::Tensor> weights, int64_t per_layer,
                          torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor cos, torch::Tensor sin,
                          torch::Tensor slots, torch::Tensor limit, double eps, double scale, double residual_scale,
                          torch::Tensor path, torch::Tensor base, int64_t start, int64_t end, double norm_offset,
                          bool gelu, double softcap, int64_t window, bool rope_pairs);
torch::Tensor rows_layers(torch::Tensor h, std::vector<torch::Tensor> weights, int64_t per_layer,
                          torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor cos, torch::Tensor sin,
                          torch::Tensor slots, torch::Tensor limit, double eps, double scale, double residual_scale,
                          torch::Tensor path, torch::Tensor base, int64_t start, int64_t end, double norm_offset,
                          bool gelu, double softcap, int64_t window, bool rope_pairs) {
  TORCH_CHECK(per_layer == 9 || per_layer == 11 || per_layer == 13 || per_layer == 20,
              "rows_layers: 9, 11, 13 or 20 weights per layer, got ", per_layer);
  const int64_t layers = static_cast<int64_t>(weights.size()) / per_layer;
  TORCH_CHECK(layers * per_layer == static_cast<int64_t>(weights.size()),
              "rows_layers: the weights must be whole layers of ", per_layer, ", got ", weights.size());
  TORCH_CHECK(0 <= start && start <= end && end <= layers, "rows_layers: layers [", start, ", ", end,
              ") outside the ", layers, " given");
  TORCH_CHECK(k_cache.defined() && v_cache.defined() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
              k_cache.size(0) == layers, "rows_layers: k_cache / v_cache must be [L, Hkv, S, d] with L = ", layers);
  const auto wtype = is_compact(weights[1]) ? at::kFloat : weights[1].scalar_type();  // compact: float32
  for (int64_t li = start; li < end; ++li) {
    std::vector<torch::Tensor> w(weights.begin() + li * per_layer, weights.begin() + (li + 1) * per_layer);
    h = rows_layer(h, w, k_cache[li], v_cache[li], cos, sin, slots, limit, eps, scale, residual_scale, path, base,
                   norm_offset, gelu, softcap, window, rope_pairs);
    if (wtype != at::kFloat) h = h.to(wtype).to(at::kFloat);
  }
  return h;
}
