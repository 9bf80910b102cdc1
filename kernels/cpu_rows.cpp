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
// NW and NX are compile-time so the NW * NX accumulators live in registers. With NREAL < NX
// only NREAL x rows exist: the tile's spare columns re-read the last one and are not stored
// (3 rows run in the 4-row tile this way, faster than a 3-row tile on a 2-core Xeon, layer
// weights 19.5 vs 21.2 ms; each stored dot product's arithmetic is the same either way).
template <int NW, int NX, int NREAL = NX>
inline void tile(const float* __restrict w, const float* __restrict x, int64_t K, int64_t O,
                 int64_t o, float* __restrict y) {
  __m256 acc[NW][NX];
#pragma GCC unroll 8
  for (int i = 0; i < NW; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NX; ++c) acc[i][c] = _mm256_setzero_ps();
  // software prefetch of each weight row PF floats ahead, once per 64-byte line: it changes
  // no arithmetic, only keeps memory busy while several x rows are multiplied (measured on a
  // 2-core Xeon, all SmolLM2 layer weights: 4 rows 24.7 -> 19.5 ms, 8 rows 33 -> 23-26 ms,
  // 1 row unchanged at the memory bound); further ahead for the 5-8 row tiles, whose one or
  // two weight rows per pass are consumed more slowly
  constexpr int64_t PF = NX <= 4 ? 256 : 1024;
  const int64_t k8 = K - K % 8;
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NW];
#pragma GCC unroll 8
    for (int i = 0; i < NW; ++i) wv[i] = _mm256_loadu_ps(w + i * K + k);
    if ((k & 15) == 0) {
#pragma GCC unroll 8
      for (int i = 0; i < NW; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + i * K + k + PF), _MM_HINT_T0);
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
      const float* wi = w + i * K;
      const float* xc = x + c * K;
      for (int64_t k = k8; k < K; ++k) s += wi[k] * xc[k];
      y[c * O + o + i] = s;
    }
  }
}

// all R = NX1 + NX2 rows against every weight row, NW weight rows per tile; the second
// group of rows re-reads the tile's weight rows from L1, not from memory
template <int NW, int NX1, int NX2, int NREAL1 = NX1>
void run(const float* wp, const float* xp, float* yp, int64_t K, int64_t O) {
  at::parallel_for(0, O, 64, [&](int64_t o0, int64_t o1) {
    int64_t o = o0;
    for (; o + NW <= o1; o += NW) {
      tile<NW, NX1, NREAL1>(wp + o * K, xp, K, O, o, yp);
      if constexpr (NX2 > 0) tile<NW, NX2>(wp + o * K, xp + NX1 * K, K, O, o, yp + NX1 * O);
    }
    for (; o < o1; ++o) {
      tile<1, NX1, NREAL1>(wp + o * K, xp, K, O, o, yp);
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
    case 3: run<3, 4, 0, 3>(wp, xp, yp, K, O); break;  // the 4-row tile, 3 rows stored
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

// ---- attention ---------------------------------------------------------------------------
//
// Row-invariant attention for the CPU engine: query row r, head h sees the cached keys and
// values of slots [0, limit[r]] of its KV head h / G, and nothing else enters its result.
// The arithmetic of one (row, head) is one fixed sequence whatever the other rows, how many
// there are and how far they see:
//   s_j = q.k_j     q scaled by `scale` first; the 8-wide FMA dot product of `tile`, four
//                   keys in flight with one accumulator each (`dot4`, the last L % 4 keys
//                   through `dot`, the same sequence)
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

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  const int64_t d8 = d - d % 8;
  for (int64_t i = 0; i < d8; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (int64_t i = d8; i < d; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// four dot products of one query with keys k, k + d, k + 2d, k + 3d, each exactly as `dot`
inline void dot4(const float* __restrict a, const float* __restrict k, int64_t d, float* __restrict s) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  const int64_t d8 = d - d % 8;
  for (int64_t i = 0; i < d8; i += 8) {
    const __m256 av = _mm256_loadu_ps(a + i);
    acc0 = _mm256_fmadd_ps(av, _mm256_loadu_ps(k + i), acc0);
    acc1 = _mm256_fmadd_ps(av, _mm256_loadu_ps(k + d + i), acc1);
    acc2 = _mm256_fmadd_ps(av, _mm256_loadu_ps(k + 2 * d + i), acc2);
    acc3 = _mm256_fmadd_ps(av, _mm256_loadu_ps(k + 3 * d + i), acc3);
  }
  float t[4] = {hsum(acc0), hsum(acc1), hsum(acc2), hsum(acc3)};
  for (int j = 0; j < 4; ++j) {
    const float* kj = k + j * d;
    for (int64_t i = d8; i < d; ++i) t[j] = std::fma(a[i], kj[i], t[j]);
    s[j] = t[j];
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
template <int D>
inline void weighted_sum(const float* __restrict p, const float* __restrict v, int64_t j0, int64_t j1,
                         float* __restrict acc) {
  __m256 a[D / 8];
#pragma GCC unroll 16
  for (int c = 0; c < D / 8; ++c) a[c] = _mm256_load_ps(acc + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 16
    for (int c = 0; c < D / 8; ++c) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * D + 8 * c), a[c]);
  }
#pragma GCC unroll 16
  for (int c = 0; c < D / 8; ++c) _mm256_store_ps(acc + 8 * c, a[c]);
}

inline void weighted_sum_any(const float* __restrict p, const float* __restrict v, int64_t d, int64_t j0,
                             int64_t j1, float* __restrict acc) {
  const int64_t d8 = d - d % 8;
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int64_t c = 0; c < d8; c += 8)
      _mm256_store_ps(acc + c, _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * d + c), _mm256_load_ps(acc + c)));
    for (int64_t i = d8; i < d; ++i) acc[i] = std::fma(p[j], v[j * d + i], acc[i]);
  }
}

constexpr int64_t kMaxHeadDim = 256;

}  // namespace

// q [R, Hq, d] (after RoPE, unscaled), k/v [Hkv, S, d] one layer's cache, limit int64 [R]
// (the last slot row r sees) -> o [R, Hq * d]; all float32 contiguous.
//
// Trees: `path` int64 [R, P] (P may be 0: every row a chain) lists, per row, the slots of its
// own path in the draft tree (ancestors then itself, in depth order; -1 pads after them). With
// c_r such slots, row r sees logical keys j = 0 .. limit[r]: key j < limit[r] + 1 - c_r at slot j
// (the committed prefix), the last c_r keys at path[r][...] in order. A row's keys are then the
// exact keys a chain row at the same position would see, visited in the same order with the
// same arithmetic, so a tree row is bit-identical to that chain row.
torch::Tensor rows_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                             double scale, torch::Tensor path);
torch::Tensor rows_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                             double scale, torch::Tensor path) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32,
              "rows_attention: float32 q, k, v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(2) == k.size(2),
              "rows_attention: q [R, Hq, d], k and v [Hkv, S, d]");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "rows_attention: contiguous q, k, v");
  TORCH_CHECK(limit.dtype() == torch::kInt64 && limit.dim() == 1 && limit.size(0) == q.size(0),
              "rows_attention: limit int64 [R]");
  const int64_t R = q.size(0), Hq = q.size(1), d = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(Hq % Hkv == 0, "rows_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(d <= kMaxHeadDim, "rows_attention: head_dim <= 256");
  auto lim = limit.contiguous();
  const int64_t* lp = lim.data_ptr<int64_t>();
  int64_t keys = 0;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(lp[r] >= 0 && lp[r] < S, "rows_attention: a key limit is outside the cache");
    keys = std::max(keys, lp[r] + 1);
  }
  TORCH_CHECK(path.dtype() == torch::kInt64 && path.dim() == 2 && (path.size(1) == 0 || path.size(0) == R),
              "rows_attention: path int64 [R, P] (P = 0: no tree)");
  auto pth = path.contiguous();
  const int64_t P = pth.size(1);
  const int64_t* pp = pth.data_ptr<int64_t>();
  std::vector<int64_t> tree_keys(R, 0);  // c_r: the row's path slots (its last c_r keys)
  for (int64_t r = 0; r < R && P > 0; ++r) {
    while (tree_keys[r] < P && pp[r * P + tree_keys[r]] >= 0) {
      TORCH_CHECK(pp[r * P + tree_keys[r]] < S, "rows_attention: a path slot is outside the cache");
      ++tree_keys[r];
    }
    TORCH_CHECK(tree_keys[r] <= lp[r] + 1, "rows_attention: a row's path is longer than its keys");
  }
  const int64_t G = Hq / Hkv, stride = (keys + 7) / 8 * 8;  // scores rows padded to 8 lanes
  auto out = torch::empty({R, Hq * d}, q.options());
  auto scores = torch::empty({R * Hq, stride}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = scores.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t d8 = d - d % 8;
  at::parallel_for(0, R * Hq, 1, [&](int64_t i0, int64_t i1) {
    alignas(32) float qs[kMaxHeadDim];
    alignas(32) float acc[kMaxHeadDim];
    for (int64_t item = i0; item < i1; ++item) {  // item = r * Hq + h
      const int64_t r = item / Hq, h = item % Hq, L = lp[r] + 1, L8 = (L + 7) / 8 * 8;
      const int64_t Lp = L - tree_keys[r];  // keys [0, Lp) contiguous, [Lp, L) on the path
      const int64_t* row_path = pp + r * P;
      const float* kh = kp + (h / G) * S * d;
      const float* vh = vp + (h / G) * S * d;
      float* s = sp + item * stride;
      for (int64_t i = 0; i < d; ++i) qs[i] = qp[item * d + i] * sc;
      int64_t j = 0;
      for (; j + 4 <= Lp; j += 4) dot4(qs, kh + j * d, d, s + j);
      for (; j < Lp; ++j) s[j] = dot(qs, kh + j * d, d);
      for (; j < L; ++j) s[j] = dot(qs, kh + row_path[j - Lp] * d, d);
      float m = s[0];
      for (j = 1; j < L; ++j) m = std::max(m, s[j]);
      for (j = L; j < L8; ++j) s[j] = -INFINITY;  // exp8 -> exp(-87): zeroed below
      const __m256 mv = _mm256_set1_ps(m);
      __m256 lv = _mm256_setzero_ps();
      for (j = 0; j < L8; j += 8) {
        __m256 pj = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        if (j + 8 > L) {  // lanes past the last key contribute exactly 0
          alignas(32) float keep[8];
          for (int i = 0; i < 8; ++i) keep[i] = j + i < L ? 1.0f : 0.0f;
          pj = _mm256_mul_ps(pj, _mm256_load_ps(keep));
        }
        _mm256_storeu_ps(s + j, pj);
        lv = _mm256_add_ps(lv, pj);
      }
      const float l = hsum(lv);
      for (int64_t i = 0; i < d; ++i) acc[i] = 0.f;
      // keys in order of j: the contiguous prefix, then each path key (the same FMA per lane)
      if (d == 64) weighted_sum<64>(s, vh, 0, Lp, acc);
      else if (d == 128) weighted_sum<128>(s, vh, 0, Lp, acc);
      else weighted_sum_any(s, vh, d, 0, Lp, acc);
      for (j = Lp; j < L; ++j) {
        const float* vj = vh + row_path[j - Lp] * d;
        if (d == 64) weighted_sum<64>(s + j, vj, 0, 1, acc);
        else if (d == 128) weighted_sum<128>(s + j, vj, 0, 1, acc);
        else weighted_sum_any(s + j, vj, d, 0, 1, acc);
      }
      float* o = op + item * d;  // out[r, h*d : (h+1)*d]
      const __m256 lvec = _mm256_set1_ps(l);
      for (int64_t c = 0; c < d8; c += 8) _mm256_storeu_ps(o + c, _mm256_div_ps(_mm256_load_ps(acc + c), lvec));
      for (int64_t i = d8; i < d; ++i) o[i] = acc[i] / l;
    }
  });
  return out;
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
                   int64_t n, float eps) {
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
    for (int64_t i = 0; i < n8; i += 8)
      _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), iv)));
    for (int64_t i = n8; i < n; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

// x [R, heads, d] in place: x * cos + rotate_half(x) * sin, cos/sin [R, d]
void rope_rows(float* __restrict x, const float* __restrict cos, const float* __restrict sin, int64_t rows,
               int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  alignas(32) float t[kMaxHeadDim];
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * d;
    const float* s = sin + r * d;
    for (int64_t h = 0; h < heads; ++h) {
      float* xh = x + (r * heads + h) * d;
      for (int64_t i = 0; i < half; ++i) t[i] = xh[i] * c[i] + (-xh[i + half]) * s[i];
      for (int64_t i = half; i < d; ++i) t[i] = xh[i] * c[i] + xh[i - half] * s[i];
      for (int64_t i = 0; i < d; ++i) xh[i] = t[i];
    }
  }
}

// a = silu(g) * u, elementwise over n values
void silu_mul(const float* __restrict g, const float* __restrict u, float* __restrict a, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  const int64_t n8 = n - n % 8;
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_or_ps(gv, sign));  // exp(-|g|)
    const __m256 pos = _mm256_div_ps(one, _mm256_add_ps(one, e));  // sigmoid(|g|)
    const __m256 neg = _mm256_div_ps(e, _mm256_add_ps(one, e));    // sigmoid(-|g|)
    const __m256 sig = _mm256_blendv_ps(pos, neg, gv);  // sign bit of g picks
    _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
  }
  if (n8 < n) {  // the tail through the same vector code on a padded copy
    alignas(32) float gt[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, ut[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, at[8];
    for (int64_t i = n8; i < n; ++i) gt[i - n8] = g[i], ut[i - n8] = u[i];
    silu_mul(gt, ut, at, 8);
    for (int64_t i = n8; i < n; ++i) a[i] = at[i - n8];
  }
}

}  // namespace

// h [R, H] (the residual stream before the layer) -> after the layer; writes the layer's
// K and V of row r at slot slots[r] of k_cache / v_cache [Hkv, S, d]. weights: input norm
// [H], q [Hq*d, H], k [Hkv*d, H], v [Hkv*d, H], o [H, Hq*d], post norm [H], gate [I, H],
// up [I, H], down [H, I], then q norm [d] and k norm [d] (Qwen3) or nothing. cos / sin
// [R, d] at the rows' positions; limit [R] the last (logical) key each row sees, path [R, P]
// its tree slots (see rows_attention; P = 0 for chains). All float32
// contiguous, no biases (the caller uses the PyTorch path for biased layers).
torch::Tensor rows_layer(torch::Tensor h, std::vector<torch::Tensor> weights, torch::Tensor k_cache,
                         torch::Tensor v_cache, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                         torch::Tensor limit, double eps, double scale, torch::Tensor path);
torch::Tensor rows_layer(torch::Tensor h, std::vector<torch::Tensor> weights, torch::Tensor k_cache,
                         torch::Tensor v_cache, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                         torch::Tensor limit, double eps, double scale, torch::Tensor path) {
  TORCH_CHECK(weights.size() == 9 || weights.size() == 11, "rows_layer: 9 weights, or 11 with q/k norms");
  for (const auto& t : weights)
    TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous(), "rows_layer: float32 contiguous weights");
  TORCH_CHECK(h.dtype() == torch::kFloat32 && h.dim() == 2 && h.is_contiguous(), "rows_layer: h [R, H] float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes(), "rows_layer: k/v cache [Hkv, S, d] contiguous");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.numel() == h.size(0), "rows_layer: slots int64 [R]");
  const int64_t R = h.size(0), H = h.size(1), Hkv = k_cache.size(0), S = k_cache.size(1), d = k_cache.size(2);
  const int64_t Hq = weights[1].size(0) / d;
  TORCH_CHECK(weights[0].numel() == H && weights[1].size(1) == H && weights[2].size(0) == Hkv * d,
              "rows_layer: weight shapes do not match h and the cache");
  TORCH_CHECK(cos.dtype() == torch::kFloat32 && cos.is_contiguous() && sin.is_contiguous() &&
              cos.size(0) == R && cos.size(1) == d, "rows_layer: cos/sin [R, d] float32 contiguous");
  TORCH_CHECK(d % 2 == 0 && d <= kMaxHeadDim, "rows_layer: even head_dim <= 256");
  const float e = static_cast<float>(eps);
  auto x = torch::empty_like(h);
  rms_norm_rows(h.data_ptr<float>(), weights[0].data_ptr<float>(), x.data_ptr<float>(), R, H, e);
  auto q = rows_linear(x, weights[1]);  // [R, Hq*d]
  auto k = rows_linear(x, weights[2]);  // [R, Hkv*d]
  auto v = rows_linear(x, weights[3]);
  if (weights.size() == 11) {  // per-head norms before RoPE
    rms_norm_rows(q.data_ptr<float>(), weights[9].data_ptr<float>(), q.data_ptr<float>(), R * Hq, d, e);
    rms_norm_rows(k.data_ptr<float>(), weights[10].data_ptr<float>(), k.data_ptr<float>(), R * Hkv, d, e);
  }
  rope_rows(q.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), R, Hq, d);
  rope_rows(k.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), R, Hkv, d);
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < S, "rows_layer: a slot is outside the cache");
    for (int64_t g = 0; g < Hkv; ++g) {
      std::memcpy(kc + (g * S + sp[r]) * d, kp + (r * Hkv + g) * d, d * sizeof(float));
      std::memcpy(vc + (g * S + sp[r]) * d, vp + (r * Hkv + g) * d, d * sizeof(float));
    }
  }
  auto o = rows_attention(q.view({R, Hq, d}), k_cache, v_cache, limit, scale, path);
  auto h1 = h + rows_linear(o, weights[4]);
  rms_norm_rows(h1.data_ptr<float>(), weights[5].data_ptr<float>(), x.data_ptr<float>(), R, H, e);
  auto gate = rows_linear(x, weights[6]);
  auto up = rows_linear(x, weights[7]);
  silu_mul(gate.data_ptr<float>(), up.data_ptr<float>(), gate.data_ptr<float>(), gate.numel());
  return h1 + rows_linear(gate, weights[8]);
}
