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
