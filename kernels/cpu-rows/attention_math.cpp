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
// pairs; a pair never depends on the split (timings: docs/kernels.md, "attention").
//
// This section: the per-key arithmetic (dot products, exp8, weighted sums), which the
// decoder layer's SiLU and the draft head's softmax use too; attention.cpp: the calls.
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

}  // namespace
