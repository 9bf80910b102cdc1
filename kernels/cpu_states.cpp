// Recurrent state updates of the hybrids' token mixers (hf_selfspec/engine/mixers.py), one
// call per layer for all of a step's rows: Mamba2's (Granite 4.0-H, Bamba, Nemotron-H,
// Falcon-H1) and the gated DeltaNet's (Qwen 3.5, OLMo Hybrid).
//
// Each row's new state is its parent's (a ring row of `states`, or zeros before position 0)
// updated by the row's own inputs, and is written to the row's own ring row; rows are taken
// in the order given, which puts every draft-tree row after its parent. A row's arithmetic
// never reads another row's inputs, and every sum runs in one fixed order (8 lanes, then
// the lanes in a fixed tree; a tail in order), so a row's result is bit-identical whatever
// the other rows of its step: speculation stays bitwise the engine's AR. The heads are
// independent, so they are shared among the threads; a head's rows stay in order on one.
// One pass over each state (the PyTorch form makes several, each a temporary of the
// state's size) is what this saves.

#include <torch/extension.h>
#include <immintrin.h>

namespace mixer_states {

// the 8 lanes summed in a fixed order
inline float lanes_sum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                 // (0+4, 1+5, 2+6, 3+7)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));        // (0+4+2+6, 1+5+3+7, ...)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55)); // + lane 1
  return _mm_cvtss_f32(s);
}

void check_f32(const torch::Tensor& t, const char* fn, const char* name, int64_t dim) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
              t.dim() == dim, fn, ": ", name, " must be a contiguous float32 CPU tensor of ", dim, " dimensions, got ",
              t.defined() ? t.toString() : "undefined", " of shape ", t.defined() ? t.sizes() : at::IntArrayRef{});
}

// rows [R, 2] int64 (ring row, parent ring row or -1), checked against the ring's `slots`
const int64_t* check_rows(const torch::Tensor& rows, int64_t R, int64_t slots, const char* fn) {
  TORCH_CHECK(rows.defined() && rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
              rows.dim() == 2 && rows.size(0) == R && rows.size(1) == 2,
              fn, ": rows must be a contiguous int64 CPU tensor [", R, ", 2] (ring row, parent ring row)");
  const int64_t* p = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(0 <= p[2 * r] && p[2 * r] < slots && -1 <= p[2 * r + 1] && p[2 * r + 1] < slots, fn, ": row ", r,
                " names ring rows (", p[2 * r], ", ", p[2 * r + 1], ") outside the ", slots, " the states hold");
  }
  return p;
}

}  // namespace mixer_states

using namespace mixer_states;

// Mamba2, HF's mamba2_selective_state_update per row: state = parent * decay[r, h] +
// dtb[r, h, n] * x[r, h, p] (dtb: dt * B, each row's B already read by its head's group),
// written at the row's ring row; out[r, h, p] = sum_n state[h, p, n] * c[r, h, n].
// states [L, S, H, P, N] float32; decay [R, H]; dtb, c [R, H, N]; x [R, H, P]. Returns out
// [R, H, P] float32.
torch::Tensor rows_mamba2_states(torch::Tensor states, int64_t layer, torch::Tensor rows, torch::Tensor decay,
                                 torch::Tensor dtb, torch::Tensor x, torch::Tensor c);
torch::Tensor rows_mamba2_states(torch::Tensor states, int64_t layer, torch::Tensor rows, torch::Tensor decay,
                                 torch::Tensor dtb, torch::Tensor x, torch::Tensor c) {
  const char* fn = "rows_mamba2_states";
  check_f32(states, fn, "states", 5);
  check_f32(decay, fn, "decay", 2);
  check_f32(dtb, fn, "dtb", 3);
  check_f32(x, fn, "x", 3);
  check_f32(c, fn, "c", 3);
  const int64_t L = states.size(0), S = states.size(1), H = states.size(2), P = states.size(3), N = states.size(4);
  const int64_t R = decay.size(0);
  TORCH_CHECK(0 <= layer && layer < L, fn, ": layer ", layer, " outside the ", L, " the states hold");
  TORCH_CHECK(decay.size(1) == H && dtb.sizes() == c.sizes() && dtb.size(0) == R && dtb.size(1) == H &&
              dtb.size(2) == N && x.size(0) == R && x.size(1) == H && x.size(2) == P,
              fn, ": decay [R, H], dtb and c [R, H, N], x [R, H, P] must match states [L, S, H, P, N] = ",
              states.sizes(), "; got ", decay.sizes(), ", ", dtb.sizes(), ", ", c.sizes(), ", ", x.sizes());
  const int64_t* rp = check_rows(rows, R, S, fn);
  auto out = torch::empty({R, H, P}, x.options());
  float* base = states.data_ptr<float>() + layer * S * H * P * N;
  const float *dp = decay.data_ptr<float>(), *bp = dtb.data_ptr<float>(), *xp = x.data_ptr<float>(),
              *cp = c.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t whole = N - N % 8;
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t r = 0; r < R; ++r) {  // in order: a row's parent is written before it
      const int64_t row = rp[2 * r], parent = rp[2 * r + 1];
      const float* src = parent < 0 ? nullptr : base + (parent * H + h) * P * N;
      float* dst = base + (row * H + h) * P * N;
      const float a = dp[r * H + h];
      const float* b = bp + (r * H + h) * N;
      const float* cc = cp + (r * H + h) * N;
      const __m256 av = _mm256_set1_ps(a);
      for (int64_t p = 0; p < P; ++p) {
        const float xv = xp[(r * H + h) * P + p];
        const __m256 xb = _mm256_set1_ps(xv);
        __m256 acc = _mm256_setzero_ps();
        for (int64_t n = 0; n < whole; n += 8) {
          __m256 inc = _mm256_mul_ps(_mm256_loadu_ps(b + n), xb);
          __m256 s = src ? _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(src + p * N + n), av), inc) : inc;
          _mm256_storeu_ps(dst + p * N + n, s);
          acc = _mm256_fmadd_ps(s, _mm256_loadu_ps(cc + n), acc);
        }
        float sum = lanes_sum(acc);
        for (int64_t n = whole; n < N; ++n) {
          const float inc = b[n] * xv;
          const float s = src ? src[p * N + n] * a + inc : inc;
          dst[p * N + n] = s;
          sum += s * cc[n];
        }
        op[(r * H + h) * P + p] = sum;
      }
    }
  }
  return out;
}

// The gated delta rule, HF's torch_recurrent_gated_delta_rule per row: state = parent *
// decay[r, h]; kv[j] = sum_i state[i, j] k[i]; delta = (v - kv) * beta[r, h]; state +=
// k[i] delta[j], written at the row's ring row; out[r, h, j] = sum_i state[i, j] q[i].
// states [L, S, H, Dk, Dv] float32; decay, beta [R, H]; q, k [R, H, Dk]; v [R, H, Dv] (q, k
// normed and scaled as HF's). Returns out [R, H, Dv] float32.
torch::Tensor rows_delta_states(torch::Tensor states, int64_t layer, torch::Tensor rows, torch::Tensor decay,
                                torch::Tensor beta, torch::Tensor q, torch::Tensor k, torch::Tensor v);
torch::Tensor rows_delta_states(torch::Tensor states, int64_t layer, torch::Tensor rows, torch::Tensor decay,
                                torch::Tensor beta, torch::Tensor q, torch::Tensor k, torch::Tensor v) {
  const char* fn = "rows_delta_states";
  check_f32(states, fn, "states", 5);
  check_f32(decay, fn, "decay", 2);
  check_f32(beta, fn, "beta", 2);
  check_f32(q, fn, "q", 3);
  check_f32(k, fn, "k", 3);
  check_f32(v, fn, "v", 3);
  const int64_t L = states.size(0), S = states.size(1), H = states.size(2), Dk = states.size(3), Dv = states.size(4);
  const int64_t R = decay.size(0);
  TORCH_CHECK(0 <= layer && layer < L, fn, ": layer ", layer, " outside the ", L, " the states hold");
  TORCH_CHECK(decay.size(1) == H && beta.sizes() == decay.sizes() && q.sizes() == k.sizes() && q.size(0) == R &&
              q.size(1) == H && q.size(2) == Dk && v.size(0) == R && v.size(1) == H && v.size(2) == Dv,
              fn, ": decay and beta [R, H], q and k [R, H, Dk], v [R, H, Dv] must match states [L, S, H, Dk, Dv] = ",
              states.sizes(), "; got ", decay.sizes(), ", ", beta.sizes(), ", ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  const int64_t* rp = check_rows(rows, R, S, fn);
  auto out = torch::empty({R, H, Dv}, v.options());
  float* base = states.data_ptr<float>() + layer * S * H * Dk * Dv;
  const float *gp = decay.data_ptr<float>(), *betap = beta.data_ptr<float>(), *qp = q.data_ptr<float>(),
              *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t whole = Dv - Dv % 8;
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < H; ++h) {
    std::vector<float> delta(Dv);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t row = rp[2 * r], parent = rp[2 * r + 1];
      const float* src = parent < 0 ? nullptr : base + (parent * H + h) * Dk * Dv;
      float* dst = base + (row * H + h) * Dk * Dv;
      const float g = gp[r * H + h], bt = betap[r * H + h];
      const float *qh = qp + (r * H + h) * Dk, *kh = kp + (r * H + h) * Dk, *vh = vp + (r * H + h) * Dv;
      float* oh = op + (r * H + h) * Dv;
      const __m256 gv = _mm256_set1_ps(g);
      // kv = (parent * g)^T k, over i in order; then delta
      for (int64_t j = 0; j < whole; j += 8) {
        __m256 kv = _mm256_setzero_ps();
        if (src) {
          for (int64_t i = 0; i < Dk; ++i) {
            kv = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(src + i * Dv + j), gv), _mm256_set1_ps(kh[i]), kv);
          }
        }
        _mm256_storeu_ps(delta.data() + j,
                         _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(vh + j), kv), _mm256_set1_ps(bt)));
      }
      for (int64_t j = whole; j < Dv; ++j) {
        float kv = 0.0f;
        if (src) {
          for (int64_t i = 0; i < Dk; ++i) kv += src[i * Dv + j] * g * kh[i];
        }
        delta[j] = (vh[j] - kv) * bt;
      }
      // the new state row by row, and out = state^T q over i in order
      for (int64_t j = 0; j < whole; j += 8) _mm256_storeu_ps(oh + j, _mm256_setzero_ps());
      for (int64_t j = whole; j < Dv; ++j) oh[j] = 0.0f;
      for (int64_t i = 0; i < Dk; ++i) {
        const __m256 ki = _mm256_set1_ps(kh[i]), qi = _mm256_set1_ps(qh[i]);
        for (int64_t j = 0; j < whole; j += 8) {
          __m256 upd = _mm256_mul_ps(ki, _mm256_loadu_ps(delta.data() + j));
          __m256 s = src ? _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(src + i * Dv + j), gv), upd) : upd;
          _mm256_storeu_ps(dst + i * Dv + j, s);
          _mm256_storeu_ps(oh + j, _mm256_fmadd_ps(s, qi, _mm256_loadu_ps(oh + j)));
        }
        for (int64_t j = whole; j < Dv; ++j) {
          const float upd = kh[i] * delta[j];
          const float s = src ? src[i * Dv + j] * g + upd : upd;
          dst[i * Dv + j] = s;
          oh[j] += s * qh[i];
        }
      }
    }
  }
  return out;
}
