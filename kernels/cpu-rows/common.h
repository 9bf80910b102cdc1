// The CPU row kernels, in sections (this folder), built by kernels/cpu_rows.py as ONE
// translation unit: the sections are concatenated in the order of cpu_rows.py's SECTIONS
// (this one first; each uses what the sections before it declare), as the single file they
// once were. One unit leaves the compiler the same code to inline and optimise whatever the
// file layout, so the split cannot move a rounding.
//
// Row-invariant tall-skinny product for the CPU engine: y[r, o] = sum_k x[r, k] * w[o, k]
// for the few rows r of one decode / verify step (1..W tokens) and every output o.
//
// Why: BLAS libraries pick kernels by shape, so a token's row rounds differently when it
// is computed alone or among n rows. Here every dot product runs the same instruction
// sequence whatever the number of rows and whatever its neighbours: one 8-wide FMA
// accumulator over k in order (blocks of 8), a fixed horizontal sum, then the scalar tail
// k >= K - K % 8 by std::fma (one rounding each: the same operation whatever the weight
// dtype, never left to the compiler to contract or not). How many weight rows and x rows
// share a pass only changes which dot products are in flight together, never the arithmetic
// of one of them, so a row's result is bit-identical for any R (tests/test_kernels_cpu.py
// checks it bit for bit).
//
// Memory: a step streams each weight row once (1-4 rows: 3-4 weight rows per pass against
// all x rows; more rows: 3 weight rows against blocks of 4 x rows), so 1..8 rows cost about
// the memory traffic of one (measured against MKL: docs/kernels.md). Threads split the
// outputs o (torch's OpenMP team by default, or the work-sharing `Pool` where other
// processes share the cores: pool.h); a dot product never depends on the split.
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
//
// This section: the includes, and the element loads and dtype dispatch every section uses.

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

}  // namespace
