// ---- one decoder layer -------------------------------------------------------------------
//
// A whole Llama / Qwen3 decoder layer on the step's rows in one call (the kernel layout's
// `Engine.run_layers`), so a step makes one call per layer instead of ~35 small PyTorch ops,
// whose overhead cost more than their arithmetic (docs/kernels.md, "decoder layer"); rows_layers
// below runs all of a step's layers in one call. Every operation is per row and runs one fixed
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
