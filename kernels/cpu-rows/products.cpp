// The products x @ w^T of float32 / bfloat16 / float16 weights (`linear_rows`): 8-lane tiles
// of NW weight rows by NX x rows, and on AVX-512 CPUs paired-row tiles for 16-bit weights
// at 32 rows or more; `rows_isa` chooses.
namespace {

// NW weight rows (w, stride K) times NX x rows (x, stride K); y[c * O + o + i].
// NW and NX are compile-time so the NW * NX accumulators live in registers. With NREAL < NX
// only NREAL x rows exist: the tile's spare columns re-read the last one and are not stored
// (3 rows run in the 4-row tile this way, which measured faster than a 3-row tile; each
// stored dot product's arithmetic is the same either way). Never inlined: inlined into its
// caller's loop, the 3 x 4 tile's 16 accumulators and weight vectors spill out of the 16
// registers (docs/kernels.md, "tiles").
template <typename T, int NW, int NX, int NREAL = NX>
__attribute__((noinline)) void tile(const T* __restrict w, const float* __restrict x, int64_t K, int64_t O,
                 int64_t o, float* __restrict y) {
  __m256 acc[NW][NX];
#pragma GCC unroll 8
  for (int i = 0; i < NW; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NX; ++c) acc[i][c] = _mm256_setzero_ps();
  // software prefetch of each weight row ahead, once per 64-byte line: it changes no
  // arithmetic, only keeps memory busy while the x rows are multiplied. The rows are
  // contiguous (one run of memory) and a tile reads NW of them side by side, so a distance of
  // one row (8 KiB: a 2048-column float32 row) fetches what the tile reads next anyway; the
  // distance is at least one whole tile (NW rows: the next tile's same column) and at least
  // 8 KiB (short rows, SmolLM2's 576 columns). Into L2 only (T1): 3-4 weight rows 8 KiB
  // ahead would fill a 32 KiB L1 (AMD EPYC's) and push out the x rows. The distances were
  // chosen by measurement (docs/kernels.md, "prefetch").
  static_assert(NX <= 4, "the tiles hold at most 4 x rows (run_blocks for more)");
  constexpr int64_t MIN_PF_BYTES = 8192;
  const int64_t PF = std::max<int64_t>(MIN_PF_BYTES / static_cast<int64_t>(sizeof(T)), NW * K);
  constexpr int64_t LINE = 64 / static_cast<int64_t>(sizeof(T));
  const int64_t k8 = K - K % 8;
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NW];
#pragma GCC unroll 8
    for (int i = 0; i < NW; ++i) wv[i] = Elem<T>::load8(w + i * K + k);
    if ((k & (LINE - 1)) == 0) {
#pragma GCC unroll 8
      for (int i = 0; i < NW; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + i * K + k + PF), _MM_HINT_T1);
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
      const T* wi = w + i * K;
      const float* xc = x + c * K;
      for (int64_t k = k8; k < K; ++k) s = std::fma(Elem<T>::load1(wi + k), xc[k], s);
      y[c * O + o + i] = s;
    }
  }
}

// outputs [o0, o1) of all R <= 4 rows, NW weight rows per tile; weight row o at w + (o - o0) * K
template <typename T, int NW, int NX, int NREAL = NX>
void range_tiles(const T* w, const float* xp, float* yp, int64_t K, int64_t O, int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + NW <= o1; o += NW) tile<T, NW, NX, NREAL>(w + (o - o0) * K, xp, K, O, o, yp);
  for (; o < o1; ++o) tile<T, 1, NX, NREAL>(w + (o - o0) * K, xp, K, O, o, yp);
}

template <typename T, int NW, int NX, int NREAL = NX>
void run(const T* wp, const float* xp, float* yp, int64_t K, int64_t O) {
  for_outputs(O, [&](int64_t o0, int64_t o1) { range_tiles<T, NW, NX, NREAL>(wp + o0 * K, xp, yp, K, O, o0, o1); });
}

// NW weight rows against x rows [r0, r0 + n), n in 1..4, in the NW x 4 tile
template <typename T, int NW>
inline void tile_block(const T* w, const float* x, int64_t K, int64_t O, int64_t o, float* y, int64_t n) {
  switch (n) {
    case 1: tile<T, NW, 1>(w, x, K, O, o, y); break;
    case 2: tile<T, NW, 2>(w, x, K, O, o, y); break;
    case 3: tile<T, NW, 4, 3>(w, x, K, O, o, y); break;
    default: tile<T, NW, 4>(w, x, K, O, o, y); break;
  }
}

// R >= 5 rows: three weight rows at a time against the rows in blocks of 4 (3 x 4 tiles: 12
// FMAs for 7 loads, where one weight row against 8 x rows takes 9 loads for 8 FMAs); the
// three weight rows are read from memory once and from L1 for the next blocks, so the step
// streams its weights once. Faster, at every row count from 5, than wider tiles of one
// weight row against up to 8 x rows (docs/kernels.md, "blocks of rows").
// outputs [o0, o1) of all R rows in 3 x 4 tiles; weight row o at w + (o - o0) * K
template <typename T>
void range_blocks(const T* w, const float* xp, float* yp, int64_t R, int64_t K, int64_t O, int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + 3 <= o1; o += 3)
    for (int64_t r0 = 0; r0 < R; r0 += 4)
      tile_block<T, 3>(w + (o - o0) * K, xp + r0 * K, K, O, o, yp + r0 * O, std::min<int64_t>(4, R - r0));
  for (; o < o1; ++o)
    for (int64_t r0 = 0; r0 < R; r0 += 4)
      tile_block<T, 1>(w + (o - o0) * K, xp + r0 * K, K, O, o, yp + r0 * O, std::min<int64_t>(4, R - r0));
}

template <typename T>
void run_blocks(const T* wp, const float* xp, float* yp, int64_t R, int64_t K, int64_t O) {
  for_outputs(O, [&](int64_t o0, int64_t o1) { range_blocks<T>(wp + o0 * K, xp, yp, R, K, O, o0, o1); });
}

// ---- AVX-512: two x rows per register ---------------------------------------------------
//
// On CPUs with AVX-512 (F, DQ, BW, VL), products of 16-bit weights with 32 or more rows pair
// the x rows: one 16-lane register holds the 8-lane accumulators of two dot products (rows
// 2p and 2p + 1, same weight row), each weight block is widened once and broadcast into both
// halves, and the two rows' x blocks come pre-packed side by side. Each lane still runs
// fma(w[k + j], x[k + j], acc_j) over k in order, and each half ends in the same `hsum` and
// scalar tail, so every dot product is bit-identical to the 8-lane tiles above
// (tests/test_kernels_cpu.py compares the two paths bit for bit). The pairs save widenings
// and x loads; float32 weights (nothing to widen) and few rows gain nothing from them, and
// the prefetching 3 x 4 tiles (`run_blocks`) stay faster up to 24 rows, so the pairs take 16-bit
// weights from 32 rows (docs/kernels.md, "AVX-512 pairs").
std::atomic<bool> g_wide_on{true};  // rows_isa(): false = the 8-lane tiles everywhere
inline bool wide_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return ok;
}
inline bool use_wide() { return wide_supported() && g_wide_on.load(std::memory_order_relaxed); }

#define WIDE_TARGET __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))

// 8 elements of a weight row, widened exactly, in both 256-bit halves of a 512-bit register
template <typename T>
struct Wide;
template <>
struct Wide<c10::BFloat16> {
  WIDE_TARGET static inline __m512 load8x2(const c10::BFloat16* p) {
    const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};
template <>
struct Wide<c10::Half> {
  WIDE_TARGET static inline __m512 load8x2(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};

// x rows packed in pairs: xpk[(b * P + p) * 16 + h * 8 + j] = x[2p + h][8b + j] for the
// K8 = K - K % 8 leading columns (an odd R repeats its last row in the spare half)
inline void pack_pairs(const float* x, int64_t R, int64_t K, std::vector<float>& xpk) {
  const int64_t P = (R + 1) / 2, B = K / 8;
  xpk.resize(static_cast<size_t>(B * P * 16));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t r = std::min(2 * p + h, R - 1);
        std::memcpy(&xpk[(b * P + p) * 16 + h * 8], x + r * K + 8 * b, 8 * sizeof(float));
      }
}

// NW weight rows against NP row pairs [p0, p0 + NP) of the P packed pairs; rows >= R unstored
template <typename T, int NW, int NP>
WIDE_TARGET __attribute__((noinline)) void wide_tile(const T* __restrict w, const float* __restrict xpk,
                                                     const float* __restrict x, int64_t P, int64_t p0, int64_t R,
                                                     int64_t K, int64_t O, int64_t o, float* __restrict y) {
  __m512 acc[NW][NP];
#pragma GCC unroll 8
  for (int i = 0; i < NW; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) acc[i][c] = _mm512_setzero_ps();
  // each weight row prefetched 4 KiB ahead (the distance measured for these tiles)
  constexpr int64_t PF_BYTES = 4096;
  constexpr int64_t PF = PF_BYTES / static_cast<int64_t>(sizeof(T));
  constexpr int64_t LINE = 64 / static_cast<int64_t>(sizeof(T));
  const int64_t k8 = K - K % 8;
  const float* xb = xpk + p0 * 16;
  for (int64_t k = 0; k < k8; k += 8, xb += P * 16) {
    __m512 wv[NW];
#pragma GCC unroll 8
    for (int i = 0; i < NW; ++i) wv[i] = Wide<T>::load8x2(w + i * K + k);
    if ((k & (LINE - 1)) == 0) {
#pragma GCC unroll 8
      for (int i = 0; i < NW; ++i) _mm_prefetch(reinterpret_cast<const char*>(w + i * K + k + PF), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int c = 0; c < NP; ++c) {
      const __m512 xv = _mm512_loadu_ps(xb + c * 16);
#pragma GCC unroll 8
      for (int i = 0; i < NW; ++i) acc[i][c] = _mm512_fmadd_ps(wv[i], xv, acc[i][c]);
    }
  }
  for (int i = 0; i < NW; ++i) {
    const T* wi = w + i * K;
    for (int c = 0; c < NP; ++c) {
      const __m256 halves[2] = {_mm512_castps512_ps256(acc[i][c]), _mm512_extractf32x8_ps(acc[i][c], 1)};
      for (int h = 0; h < 2; ++h) {
        const int64_t r = 2 * (p0 + c) + h;
        if (r >= R) continue;
        float s = hsum(halves[h]);
        const float* xr = x + r * K;
        for (int64_t k = k8; k < K; ++k) s = std::fma(Elem<T>::load1(wi + k), xr[k], s);
        y[r * O + o + i] = s;
      }
    }
  }
}

// NW weight rows against pairs [p0, p0 + n), n in 1..4
template <typename T, int NW>
inline void wide_block(const T* w, const float* xpk, const float* x, int64_t P, int64_t p0, int64_t R, int64_t K,
                       int64_t O, int64_t o, float* y) {
  switch (std::min<int64_t>(4, P - p0)) {
    case 1: wide_tile<T, NW, 1>(w, xpk, x, P, p0, R, K, O, o, y); break;
    case 2: wide_tile<T, NW, 2>(w, xpk, x, P, p0, R, K, O, o, y); break;
    case 3: wide_tile<T, NW, 3>(w, xpk, x, P, p0, R, K, O, o, y); break;
    default: wide_tile<T, NW, 4>(w, xpk, x, P, p0, R, K, O, o, y); break;
  }
}

// every row against every weight row, NW weight rows at a time against blocks of up to 4
// pairs (8 rows); the next block re-reads the NW weight rows from L1
template <typename T>
void run_wide(const T* wp, const float* xp, float* yp, int64_t R, int64_t K, int64_t O) {
  thread_local std::vector<float> xpk;
  pack_pairs(xp, R, K, xpk);
  const float* pk = xpk.data();
  const int64_t P = (R + 1) / 2;
  for_outputs(O, [&](int64_t o0, int64_t o1) {
    int64_t o = o0;
    for (; o + 4 <= o1; o += 4)
      for (int64_t p0 = 0; p0 < P; p0 += 4) wide_block<T, 4>(wp + o * K, pk, xp, P, p0, R, K, O, o, yp);
    for (; o < o1; ++o)
      for (int64_t p0 = 0; p0 < P; p0 += 4) wide_block<T, 1>(wp + o * K, pk, xp, P, p0, R, K, O, o, yp);
  });
}

template <typename T>
void linear_rows(const T* wp, const float* xp, float* yp, int64_t R, int64_t K, int64_t O) {
  if constexpr (sizeof(T) == 2) {  // paired rows (see run_wide): 16-bit weights, 32+ rows
    if (R >= 32 && use_wide()) {
      run_wide<T>(wp, xp, yp, R, K, O);
      return;
    }
  }
  switch (R) {  // registers: NW * NX accumulators + NW weight vectors + 1 x vector <= 16
    case 1: run<T, 4, 1>(wp, xp, yp, K, O); break;
    case 2: run<T, 4, 2>(wp, xp, yp, K, O); break;
    case 3: run<T, 3, 4, 3>(wp, xp, yp, K, O); break;  // the 4-row tile, 3 rows stored
    case 4: run<T, 3, 4>(wp, xp, yp, K, O); break;
    default: run_blocks<T>(wp, xp, yp, R, K, O);  // each dot product is still computed alike
  }
}

}  // namespace

// mode 1: the AVX-512 paired-row tiles where the CPU has them (the default), 0: the 8-lane
// tiles everywhere, -1: no change; returns 1 if paired tiles are in use (after the change).
// Results are bit-identical either way.
int64_t rows_isa(int64_t mode);
int64_t rows_isa(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "rows_isa: mode must be -1 (query), 0 (8-lane) or 1 (AVX-512), got ", mode);
  if (mode >= 0) g_wide_on.store(mode == 1);
  return use_wide() ? 1 : 0;
}
