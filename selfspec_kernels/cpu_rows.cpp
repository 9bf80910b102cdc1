// Row-invariant tall-skinny product for the CPU engine: y[r, o] = sum_k x[r, k] * w[o, k]
// for the few rows r of one decode / verify step (1..W tokens) and every output o.
//
// Why: BLAS libraries pick kernels by shape, so a token's row rounds differently when it
// is computed alone or among n rows. Here every dot product runs the same instruction
// sequence whatever the number of rows and whatever its neighbours: one 8-wide FMA
// accumulator over k in order (blocks of 8), a fixed horizontal sum, then the scalar tail
// k >= K - K % 8. How many weight rows and x rows share a pass only changes which dot
// products are in flight together, never the arithmetic of one of them, so a row's result
// is bit-identical for any R (tests/test_kernels_cpu.py checks it bit for bit).
//
// Memory: a step streams each weight row once (1-4 rows: 3-4 weight rows per pass, 5-6
// rows: 2, 7-8 rows: 1 weight row against all x rows), so 1..8 rows cost about the memory
// traffic of one. Measured on the 2-core AMD EPYC CI machine, all 211 weights of
// SmolLM2-135M: 1 / 4 / 8 rows 33-35 / 43-47 / 50-57 ms against MKL's 4- / 8-column
// products (the wx4 layout) 42-53 / 71-80 ms; streaming the same bytes (sum) takes 34 ms. Threads split the outputs o (at::parallel_for: torch's own pool and
// thread count); a dot product never depends on the split.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// NW weight rows (w, stride K) times NX x rows (x, stride K); y[c * O + o + i].
// NW and NX are compile-time so the NW * NX accumulators live in registers.
template <int NW, int NX>
inline void tile(const float* __restrict w, const float* __restrict x, int64_t K, int64_t O,
                 int64_t o, float* __restrict y) {
  __m256 acc[NW][NX];
#pragma GCC unroll 8
  for (int i = 0; i < NW; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NX; ++c) acc[i][c] = _mm256_setzero_ps();
  const int64_t k8 = K - K % 8;
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NW];
#pragma GCC unroll 8
    for (int i = 0; i < NW; ++i) wv[i] = _mm256_loadu_ps(w + i * K + k);
#pragma GCC unroll 8
    for (int c = 0; c < NX; ++c) {
      const __m256 xv = _mm256_loadu_ps(x + c * K + k);
#pragma GCC unroll 8
      for (int i = 0; i < NW; ++i) acc[i][c] = _mm256_fmadd_ps(wv[i], xv, acc[i][c]);
    }
  }
  for (int i = 0; i < NW; ++i) {
    for (int c = 0; c < NX; ++c) {
      float s = hsum(acc[i][c]);
      const float* wi = w + i * K;
      const float* xc = x + c * K;
      for (int64_t k = k8; k < K; ++k) s += wi[k] * xc[k];
      y[c * O + o + i] = s;
    }
  }
}

// all R = NX1 + NX2 rows against every weight row, NW weight rows per tile; the second
// group of rows re-reads the tile's weight rows from L1, not from memory
template <int NW, int NX1, int NX2>
void run(const float* wp, const float* xp, float* yp, int64_t K, int64_t O) {
  at::parallel_for(0, O, 64, [&](int64_t o0, int64_t o1) {
    int64_t o = o0;
    for (; o + NW <= o1; o += NW) {
      tile<NW, NX1>(wp + o * K, xp, K, O, o, yp);
      if constexpr (NX2 > 0) tile<NW, NX2>(wp + o * K, xp + NX1 * K, K, O, o, yp + NX1 * O);
    }
    for (; o < o1; ++o) {
      tile<1, NX1>(wp + o * K, xp, K, O, o, yp);
      if constexpr (NX2 > 0) tile<1, NX2>(wp + o * K, xp + NX1 * K, K, O, o, yp + NX1 * O);
    }
  });
}

}  // namespace

// x [R, K] float32 contiguous, w [O, K] float32 contiguous -> y [R, O]
torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w);
torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "rows_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "rows_linear: x [R, K], w [O, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "rows_linear: contiguous inputs");
  const int64_t R = x.size(0), K = x.size(1), O = w.size(0);
  auto y = torch::empty({R, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (R) {  // registers: NW * NX accumulators + NW weight vectors + 1 x vector <= 16
    case 1: run<4, 1, 0>(wp, xp, yp, K, O); break;
    case 2: run<4, 2, 0>(wp, xp, yp, K, O); break;
    case 3: run<3, 3, 0>(wp, xp, yp, K, O); break;
    case 4: run<3, 4, 0>(wp, xp, yp, K, O); break;
    case 5: run<2, 5, 0>(wp, xp, yp, K, O); break;
    case 6: run<2, 6, 0>(wp, xp, yp, K, O); break;
    case 7: run<1, 7, 0>(wp, xp, yp, K, O); break;
    case 8: run<1, 8, 0>(wp, xp, yp, K, O); break;
    default:  // more rows: blocks of 8 (each dot product is still computed alike)
      for (int64_t r0 = 0; r0 < R; r0 += 8) {
        auto part = rows_linear(x.narrow(0, r0, std::min<int64_t>(8, R - r0)).contiguous(), w);
        y.narrow(0, r0, part.size(0)).copy_(part);
      }
  }
  return y;
}
