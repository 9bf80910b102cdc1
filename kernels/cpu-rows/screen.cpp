// The LM head's argmax screen (`rows_screen`, at the end): its int8 products, in 8-lane tiles,
// 16-lane AVX-512 ones or, on AVX-512 VNNI, with x quantised to 16 bits, then each row's
// candidates decided by their float32 logits.

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
    if ((k & 63) == 0) {  // 8 KiB ahead as `tile` (1 KiB ahead measured slower)
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
// weights, would cost less per row, but its error on the hidden states' outlier dimensions
// leaves too many rows with too many candidates: docs/kernels.md, "screen".)
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
