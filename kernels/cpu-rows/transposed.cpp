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
// No software prefetch: these contiguous rows are streamed by the hardware, and prefetching
// them ahead measured slower (docs/kernels.md, "transposed weights", has this and the
// timings against torch's x @ wt).
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
