// The products' entry points: their argument checks, `rows_linear` (float32 / bfloat16 /
// float16 weights, or the compact form of float32 ones) and `rows_compact`.
namespace {

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
