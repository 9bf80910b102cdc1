// ---- compact weights: float32 rows held as the exact quantized blocks they are -----------
//
// A float32 matrix dequantized from one of GGUF's block formats (a GGUF file loaded through
// transformers, as the embedded default model, a Q4_1 file, is) holds in every block of 32
// weights of a row only the values its format can give:
//  - Q4_1: fma(d, q, m), q in 0..15 (the lowest weight m, the highest m + 15 d, d a float16);
//  - Q4_0: d * (q - 8), q in 0..15 (the weight of largest magnitude at q = 0);
//  - Q8_0: d * q, q in -128..127 (the weight of largest magnitude at q = +-127).
// `rows_compact` finds such a d (and m) per block, trying the forms in that order, and keeps
// a matrix in the first form that reproduces **every weight bit for bit** (a Q4_1 d also has
// d * q exact for every q, so fma(d, q, m) and d * q + m round alike, whatever the compiler
// contracts; the two products are single roundings, as the kernels compute them); otherwise
// it returns an empty tensor and the float32 matrix is used. A block is 24 / 20 / 36 bytes
// for 128 float32 bytes (float32 d, Q4_1's float32 m, the codes), so a form's row width says
// which form it is. A product decodes each block in registers and runs the float32 tiles'
// arithmetic on it (`compact_tile`): every output is the float32 path's bit for bit
// (tests/test_compact.py compares them).
namespace {

constexpr int64_t COMPACT_BLOCK = 32;  // weights per block
enum CompactForm : int { Q4_1_FORM = 0, Q4_0_FORM = 1, Q8_0_FORM = 2, COMPACT_FORMS = 3 };
constexpr int64_t FORM_BLOCK_BYTES[COMPACT_FORMS] = {24, 20, 36};

inline int64_t compact_row_bytes(int64_t K, int form) { return K / COMPACT_BLOCK * FORM_BLOCK_BYTES[form]; }

// the form of a compact matrix of K columns whose rows are row_bytes wide; -1 for none
inline int compact_form(int64_t K, int64_t row_bytes) {
  if (K <= 0 || K % COMPACT_BLOCK != 0) return -1;
  for (int f = 0; f < COMPACT_FORMS; ++f)
    if (row_bytes == compact_row_bytes(K, f)) return f;
  return -1;
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Q4_1: d * q exact in float32 for every q in 0..15: d zero, or a normal d whose significand
// has at most 20 bits and whose product with 15 stays normal and finite
inline bool exact_multiples(float d) {
  if (d == 0.0f) return float_bits(d) == 0;
  return std::isnormal(d) && (float_bits(d) & 0xF) == 0 && std::isfinite(d * 15.0f);
}

// the block's codes (q[j] for weight j) if every weight is `value(d, m, q)` bit for bit for
// the nearest q in [lo, hi] to `guess(w)`
template <typename V, typename G>
inline bool block_codes(const float* w, int lo, int hi, const V& value, const G& guess, int* q) {
  for (int64_t j = 0; j < COMPACT_BLOCK; ++j) {
    const float est = std::nearbyint(guess(w[j]));
    if (!(est >= static_cast<float>(lo) && est <= static_cast<float>(hi))) return false;
    q[j] = static_cast<int>(est);
    if (float_bits(value(q[j])) != float_bits(w[j])) return false;
  }
  return true;
}

// 4-bit codes: byte j holds weight j in its low nibble, weight j + 16 in its high one
inline void store_nibbles(const int* q, uint8_t* codes) {
  for (int64_t j = 0; j < 16; ++j) codes[j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
}

inline float half_rounded(float f) { return static_cast<float>(c10::Half(f)); }

// one block of 32 finite weights (lowest lo, highest hi, largest magnitude at index big) in
// form F; false when none of the form's candidate d reproduces it
inline bool encode_block(const float* w, float lo, float hi, int64_t big, int form, uint8_t* out) {
  int q[COMPACT_BLOCK];
  if (form == Q4_1_FORM) {
    auto take = [&](float d) {
      if (!exact_multiples(d)) return false;
      const float inv = d != 0.0f ? 1.0f / d : 0.0f;
      if (!block_codes(w, 0, 15, [&](int c) { return std::fma(d, static_cast<float>(c), lo); },
                       [&](float x) { return (x - lo) * inv; }, q))
        return false;
      std::memcpy(out, &d, 4);
      std::memcpy(out + 4, &lo, 4);
      store_nibbles(q, out + 8);
      return true;
    };
    if (hi == lo) return take(0.0f);
    // d a float16: (hi - lo) / 15 lies within a few ulps of it
    const float d0 = (hi - lo) / 15.0f;
    if (!std::isfinite(d0)) return false;
    const float down = std::nextafter(d0, 0.0f), up = std::nextafter(d0, INFINITY);
    for (float d : {half_rounded(d0), d0, down, up, std::nextafter(down, 0.0f), std::nextafter(up, INFINITY)})
      if (take(d)) return true;
    return false;
  }
  auto symmetric = [&](float d, int lo_q, int hi_q, int offset) {
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    if (!block_codes(w, lo_q, hi_q, [&](int c) { return d * static_cast<float>(c - offset); },
                     [&](float x) { return x * inv + static_cast<float>(offset); }, q))
      return false;
    std::memcpy(out, &d, 4);
    if (offset == 0)
      for (int64_t j = 0; j < COMPACT_BLOCK; ++j) out[4 + j] = static_cast<uint8_t>(static_cast<int8_t>(q[j]));
    else
      store_nibbles(q, out + 4);
    return true;
  };
  if (form == Q4_0_FORM)  // d = w[big] / -8 exactly (q = 0 there); an all-zero block: d = -0.0 gives -0.0
    return symmetric(w[big] / -8.0f, 0, 15, 8) || (w[big] == 0.0f && symmetric(-0.0f, 0, 15, 8));
  // Q8_0: d = |w[big]| / 127 (q = +-127 there), a float16
  const float d0 = std::fabs(w[big]) / 127.0f;
  for (float d : {d0, half_rounded(d0), std::nextafter(d0, 0.0f), std::nextafter(d0, INFINITY)})
    if (symmetric(d, -128, 127, 0)) return true;
  return false;
}

// weights 8s..8s+7 of a block in form F, widened exactly: d (and m) already broadcast
template <int F>
inline __m256 decode_part(const uint8_t* blk, int s, __m256 d, __m256 m) {
  if constexpr (F == Q8_0_FORM) {
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 4 + 8 * s)));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
  } else {
    // the low nibbles of code bytes 0-7 / 8-15, then the high nibbles
    constexpr int64_t CODES = F == Q4_1_FORM ? 8 : 4;
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + CODES + (s & 1) * 8)));
    q = s < 2 ? _mm256_and_si256(q, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(q, 4);
    if constexpr (F == Q4_1_FORM) return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m);
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))));
  }
}

// NW compact weight rows in form F (w: row o's blocks, rb bytes per row) against NX x rows
// [R, K]: y[c * O + o + i]. Each block's weights are decoded in registers (exact, see above),
// and each accumulator then takes fma(w, x, acc) over k in order in 8 lanes and ends in
// `hsum`: the arithmetic of `tile` on the float32 weights, so every output is the same bit for
// bit. The blocks ahead of the tile (COMPACT_PF_BYTES) are prefetched: the decoding is fast
// enough that the hardware alone does not keep the stream ahead of it.
constexpr int64_t COMPACT_PF_BYTES = 4096;
template <int F, int NW, int NX>
__attribute__((always_inline)) inline void compact_tile_body(const uint8_t* __restrict w, int64_t rb,
                                                             const float* __restrict x, int64_t K, int64_t O,
                                                             int64_t o, float* __restrict y) {
  constexpr int64_t BYTES = FORM_BLOCK_BYTES[F];
  __m256 acc[NW][NX];
#pragma GCC unroll 8
  for (int i = 0; i < NW; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NX; ++c) acc[i][c] = _mm256_setzero_ps();
  constexpr int64_t PF_PER_BLOCK = (NW * BYTES + 63) / 64;
  for (int64_t b = 0; b < K / COMPACT_BLOCK; ++b) {
    const int64_t k = b * COMPACT_BLOCK;
#pragma GCC unroll 4
    for (int p = 0; p < PF_PER_BLOCK; ++p)
      _mm_prefetch(reinterpret_cast<const char*>(w + b * NW * BYTES + COMPACT_PF_BYTES + 64 * p), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int i = 0; i < NW; ++i) {
      const uint8_t* blk = w + i * rb + b * BYTES;
      const __m256 d = _mm256_broadcast_ss(reinterpret_cast<const float*>(blk));
      const __m256 m = F == Q4_1_FORM ? _mm256_broadcast_ss(reinterpret_cast<const float*>(blk + 4)) : d;
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m256 wv = decode_part<F>(blk, s, d, m);
#pragma GCC unroll 8
        for (int c = 0; c < NX; ++c)
          acc[i][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + c * K + k + 8 * s), acc[i][c]);
      }
    }
  }
  for (int i = 0; i < NW; ++i)
    for (int c = 0; c < NX; ++c) y[c * O + o + i] = hsum(acc[i][c]);
}

template <int F, int NW, int NX>
__attribute__((noinline)) void compact_tile(const uint8_t* __restrict w, int64_t rb, const float* __restrict x,
                                            int64_t K, int64_t O, int64_t o, float* __restrict y) {
  compact_tile_body<F, NW, NX>(w, rb, x, K, O, o, y);
}

// The same 8-lane tile compiled for AVX-512VL: the same instructions in their EVEX forms,
// which reach 32 vector registers instead of 16, room for 2 x 8 accumulators. Each output's
// arithmetic is unchanged (the same fma chain per lane, the same hsum): bit for bit the
// tile above. Used for blocks of 7-8 x rows where rows_isa() allows AVX-512.
template <int F, int NW, int NX>
WIDE_TARGET __attribute__((noinline)) void compact_tile_wide(const uint8_t* __restrict w, int64_t rb,
                                                             const float* __restrict x, int64_t K, int64_t O,
                                                             int64_t o, float* __restrict y) {
  compact_tile_body<F, NW, NX>(w, rb, x, K, O, o, y);
}

// outputs [o0, o1) against NX x rows, NW weight rows per tile (then one at a time)
template <int F, int NW, int NX, bool WIDE = false>
void compact_range(const uint8_t* cw, int64_t rb, const float* x, float* y, int64_t K, int64_t O, int64_t o0,
                   int64_t o1) {
  int64_t o = o0;
  if constexpr (WIDE) {
    for (; o + NW <= o1; o += NW) compact_tile_wide<F, NW, NX>(cw + o * rb, rb, x, K, O, o, y);
  } else {
    for (; o + NW <= o1; o += NW) compact_tile<F, NW, NX>(cw + o * rb, rb, x, K, O, o, y);
  }
  for (; o < o1; ++o) compact_tile<F, 1, NX>(cw + o * rb, rb, x, K, O, o, y);
}

// y [R, O] = x [R, K] @ w^T for a compact w [O, compact_row_bytes(K, F)]: the x rows in blocks
// of up to 8 (each block re-reads the chunk's codes, from cache for the later blocks)
template <int F>
void linear_rows_form(const uint8_t* cw, const float* xp, float* yp, int64_t R, int64_t K, int64_t O) {
  const int64_t rb = compact_row_bytes(K, F);
  const bool wide = use_wide();
  for_outputs(O, [&](int64_t o0, int64_t o1) {
    for (int64_t r0 = 0; r0 < R; r0 += 8) {
      const float* x = xp + r0 * K;
      float* y = yp + r0 * O;
      const int64_t n = std::min<int64_t>(8, R - r0);
      if (n >= 7 && wide) {  // 32 registers: 2 x NX accumulators
        if (n == 8) compact_range<F, 2, 8, true>(cw, rb, x, y, K, O, o0, o1);
        else compact_range<F, 2, 7, true>(cw, rb, x, y, K, O, o0, o1);
        continue;
      }
      switch (n) {  // registers: NW * NX accumulators + 4 <= 16
        case 1: compact_range<F, 4, 1>(cw, rb, x, y, K, O, o0, o1); break;
        case 2: compact_range<F, 4, 2>(cw, rb, x, y, K, O, o0, o1); break;
        case 3: compact_range<F, 3, 3>(cw, rb, x, y, K, O, o0, o1); break;
        case 4: compact_range<F, 2, 4>(cw, rb, x, y, K, O, o0, o1); break;
        case 5: compact_range<F, 2, 5>(cw, rb, x, y, K, O, o0, o1); break;
        case 6: compact_range<F, 1, 6>(cw, rb, x, y, K, O, o0, o1); break;  // (2 x 6 measured slower)
        case 7: compact_range<F, 1, 7>(cw, rb, x, y, K, O, o0, o1); break;
        default: compact_range<F, 1, 8>(cw, rb, x, y, K, O, o0, o1); break;
      }
    }
  });
}

void linear_rows_compact(const uint8_t* cw, int form, const float* xp, float* yp, int64_t R, int64_t K, int64_t O) {
  switch (form) {
    case Q4_1_FORM: linear_rows_form<Q4_1_FORM>(cw, xp, yp, R, K, O); break;
    case Q4_0_FORM: linear_rows_form<Q4_0_FORM>(cw, xp, yp, R, K, O); break;
    default: linear_rows_form<Q8_0_FORM>(cw, xp, yp, R, K, O); break;
  }
}

}  // namespace
