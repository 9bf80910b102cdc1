// The attention calls (`rows_attention`, with ALiBi or sinks): their checks, how a call's
// (row, head) pairs are shared out in work items over key chunks, and the softmax of each
// pair from the arithmetic of attention_math.cpp.
namespace {

// (the stack buffers' size: DeepSeek's latent attention attends over 576-wide latent heads)
constexpr int64_t kMaxHeadDim = 1024;

// A 1-D int64 CPU tensor of n values (limit, slots), made contiguous.
torch::Tensor index_vector(const torch::Tensor& t, int64_t n, const char* fn, const char* name) {
  TORCH_CHECK(t.defined(), fn, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong, fn, ": ", name, " must be int64 [R], got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, fn, ": ", name, " must be int64 [R] with R = ", n,
              " rows, got shape ", t.sizes());
  return t.contiguous();
}

// The checked row metadata of one attention call: key limits, tree paths and, per row, the
// number c_r of its path slots (its last c_r keys).
struct AttentionMeta {
  torch::Tensor limit, path, base;
  std::vector<int64_t> tree_keys;
  int64_t keys = 0;  // max over rows of limit + 1
  // per row, the slot of its logical key 0 (a sequence's KV region in a batched step);
  // empty: 0 for every row
  const int64_t* base_of = nullptr;
  int64_t first_slot(int64_t r) const { return base_of == nullptr ? 0 : base_of[r]; }
};

AttentionMeta check_attention_meta(const torch::Tensor& limit, const torch::Tensor& path, const torch::Tensor& base,
                                   int64_t R, int64_t S, const char* fn) {
  AttentionMeta m;
  m.limit = index_vector(limit, R, fn, "limit");
  const int64_t* lp = m.limit.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(lp[r] >= 0 && lp[r] < S, fn, ": a key limit is outside the cache: limit[", r, "] = ", lp[r],
                ", the cache has ", S, " slots");
    m.keys = std::max(m.keys, lp[r] + 1);
  }
  TORCH_CHECK(path.defined() && path.device().is_cpu(), fn, ": path int64 [R, P] must be a CPU tensor");
  TORCH_CHECK(path.scalar_type() == at::kLong && path.dim() == 2 && (path.size(1) == 0 || path.size(0) == R),
              fn, ": path int64 [R, P] (P = 0: no tree) with R = ", R, ", got ", path.scalar_type(), " ",
              path.sizes());
  m.path = path.contiguous();
  const int64_t P = m.path.size(1);
  const int64_t* pp = m.path.data_ptr<int64_t>();
  m.tree_keys.assign(R, 0);
  for (int64_t r = 0; r < R && P > 0; ++r) {
    int64_t& c = m.tree_keys[r];
    while (c < P && pp[r * P + c] >= 0) {
      TORCH_CHECK(pp[r * P + c] < S, fn, ": a path slot is outside the cache: path[", r, ", ", c, "] = ",
                  pp[r * P + c], ", the cache has ", S, " slots");
      ++c;
    }
    TORCH_CHECK(c <= lp[r] + 1, fn, ": a row's path is longer than its keys: row ", r, " has ", c,
                " path slots but limit ", lp[r]);
  }
  TORCH_CHECK(base.defined() && base.device().is_cpu() && base.scalar_type() == at::kLong && base.dim() == 1 &&
              (base.size(0) == 0 || base.size(0) == R),
              fn, ": base int64 [R] (or [0]: every row's keys start at slot 0) with R = ", R, ", got ",
              base.scalar_type(), " ", base.sizes());
  if (base.size(0) == R) {
    m.base = base.contiguous();
    m.base_of = m.base.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r) {
      const int64_t prefix = lp[r] + 1 - m.tree_keys[r];  // keys at base[r] .. base[r] + prefix - 1
      TORCH_CHECK(m.base_of[r] >= 0 && m.base_of[r] + prefix <= S, fn,
                  ": a row's keys are outside the cache: base[", r, "] = ", m.base_of[r], " with ", prefix,
                  " prefix keys, the cache has ", S, " slots");
    }
  }
  return m;
}

// k and v [Hkv, S, d] caches of one layer: CPU, one float kind, contiguous, non-empty
void check_cache(const torch::Tensor& k, const torch::Tensor& v, const char* fn) {
  TORCH_CHECK(k.defined() && v.defined(), fn, ": k and v caches must be tensors");
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), fn, ": k and v caches must be CPU tensors, got ",
              k.device(), " and ", v.device());
  TORCH_CHECK(float_kind(k) && v.scalar_type() == k.scalar_type(), fn,
              ": k and v caches must both be float32, bfloat16 or float16, got ", k.scalar_type(), " and ",
              v.scalar_type());
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), fn, ": k and v caches must both be [Hkv, S, d], got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), fn, ": k and v caches must be contiguous");
  TORCH_CHECK(k.size(0) > 0 && k.size(1) > 0 && k.size(2) > 0, fn,
              ": empty cache (KV heads, slots and head_dim must be >= 1), got ", k.sizes());
  TORCH_CHECK(k.size(2) <= kMaxHeadDim, fn, ": head_dim <= ", kMaxHeadDim, ", got ", k.size(2));
}

// Work items of `attention_rows`: the (row, head) pairs of one KV head g, rows [r0, r1) and
// query heads [h0, h1) of that KV head's group, over one chunk of KEY_CHUNK logical keys.
// The pairs of an item visit the chunk's keys together, one block of KEY_TILE keys at a
// time, so a block of K (and then of V) is read from memory once per item rather than once
// per pair: with 8 rows of 3 heads per KV head, 24 times fewer reads of a long context's
// cache. Chunks let a long context's keys spread over every thread while each KV head's
// cache is still read once (a single row has only as many (KV head, head block) items as
// there are KV heads otherwise: three for SmolLM2, on two threads, or each KV head read
// twice when its heads are split).
//
// A pair's arithmetic depends on its own keys only, never on the items or the other rows:
// chunk c of a pair with L keys holds its logical keys [c KEY_CHUNK, min(L, (c + 1)
// KEY_CHUNK)). Per chunk: the scores s_j, their maximum m_c, p_j = exp(s_j - m_c), l_c =
// sum_j p_j (8 lanes by j mod 8, then `hsum`) and acc_c = sum_j p_j v_j in order of j. A
// pair of one chunk (L <= KEY_CHUNK) returns acc_0 / l_0; a longer one merges its chunks in
// order: M = max_c m_c, w_c = exp(m_c - M), o = (sum_c w_c acc_c) / (sum_c w_c l_c).
constexpr int64_t KEY_TILE = 64;
constexpr int64_t KEY_CHUNK = 512;  // a multiple of KEY_TILE and of 8
static_assert(KEY_CHUNK % KEY_TILE == 0 && KEY_CHUNK % 8 == 0, "chunks hold whole key tiles and 8-key groups");

// n elements of a 16-bit cache as float32 (the exact widening `Elem` does in registers), so
// that the pairs of an item widen a tile of keys or values once, not once per pair
template <typename TC>
inline void widen(const TC* __restrict src, int64_t n, float* __restrict dst) {
  const int64_t n8 = n - n % 8;
  for (int64_t i = 0; i < n8; i += 8) _mm256_storeu_ps(dst + i, Elem<TC>::load8(src + i));
  for (int64_t i = n8; i < n; ++i) dst[i] = Elem<TC>::load1(src + i);
}

struct AttentionItems {
  int64_t rows_per_item, heads_per_item, row_blocks, head_blocks, chunks, count;
};

// As many rows and heads per item as leave at least two items per thread
inline AttentionItems attention_items(int64_t R, int64_t Hkv, int64_t G, int64_t chunks) {
  const int64_t want = 2 * std::max<int64_t>(1, at::get_num_threads());
  AttentionItems it{std::min<int64_t>(4, R), G, 0, 0, chunks, 0};
  auto count = [&]() {
    it.row_blocks = (R + it.rows_per_item - 1) / it.rows_per_item;
    it.head_blocks = (G + it.heads_per_item - 1) / it.heads_per_item;
    return it.count = Hkv * it.row_blocks * it.head_blocks * chunks;
  };
  while (count() < want && it.rows_per_item > 1) it.rows_per_item = (it.rows_per_item + 1) / 2;
  while (count() < want && it.heads_per_item > 1) it.heads_per_item = (it.heads_per_item + 1) / 2;
  return it;
}

// A pair's output o = acc / l (acc and l its weighted sum and softmax sum relative to its
// maximum score m; acc 32-byte aligned). With an attention sink (GPT-OSS, Granite-SWA: one
// more logit per head in the softmax's denominator, of value 0) the sum gains exp(sink - m),
// taken relative to max(m, sink) so that neither exponential overflows.
inline void write_output(const float* acc, float m, float l, const float* sink, int64_t d, float* o) {
  float scale = 1.f;  // acc's factor before the division
  if (sink != nullptr) {
    if (*sink > m) {
      scale = std::exp(m - *sink);
      l = std::fma(l, scale, 1.f);
    } else {
      l += std::exp(*sink - m);
    }
  }
  const int64_t d8 = d - d % 8;
  const __m256 lvec = _mm256_set1_ps(l), svec = _mm256_set1_ps(scale);
  for (int64_t c8 = 0; c8 < d8; c8 += 8) {
    __m256 a = _mm256_load_ps(acc + c8);
    if (sink != nullptr) a = _mm256_mul_ps(a, svec);
    _mm256_storeu_ps(o + c8, _mm256_div_ps(a, lvec));
  }
  for (int64_t i = d8; i < d; ++i) o[i] = (sink != nullptr ? acc[i] * scale : acc[i]) / l;
}

template <typename TC>
void attention_rows(const float* qp, const TC* kp, const TC* vp, const AttentionMeta& meta, int64_t R, int64_t Hq,
                    int64_t Hkv, int64_t S, int64_t d, float sc, float softcap, int64_t window, float* op,
                    const float* slopes = nullptr, const float* sinks = nullptr) {
  const int64_t G = Hq / Hkv, stride = (meta.keys + 7) / 8 * 8;  // scores rows padded to 8 lanes
  auto scores = torch::empty({R * Hq, stride}, torch::dtype(torch::kFloat32));
  float* sp = scores.data_ptr<float>();
  const int64_t* lp = meta.limit.data_ptr<int64_t>();
  const int64_t P = meta.path.size(1);
  const int64_t* pp = meta.path.data_ptr<int64_t>();
  const int64_t d8 = d - d % 8;
  const int64_t dd = (d + 7) / 8 * 8;  // keeps every pair's accumulators 32-byte aligned
  const int64_t chunks = (meta.keys + KEY_CHUNK - 1) / KEY_CHUNK;
  const AttentionItems items = attention_items(R, Hkv, G, chunks);
  // a sliding window: row r sees logical keys j > limit[r] - window (as HF's sliding mask);
  // the keys before are left out of its scores' maximum and sums, chunks without any skipped
  auto first_key = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, lp[r] + 1 - window) : int64_t{0}; };
  // the chunks of pairs with more than one: per (pair, chunk) acc_c (dd floats), then m_c, l_c
  const int64_t part_floats = dd + 8;
  torch::Tensor parts;
  float* part = nullptr;
  if (chunks > 1) {
    parts = torch::empty({R * Hq * chunks * part_floats}, torch::dtype(torch::kFloat32));
    part = parts.data_ptr<float>();
  }
  auto body = [&](int64_t i0, int64_t i1) {
    struct Pair {
      int64_t item, L, Lp, end, contiguous_end;  // item = r * Hq + h; keys [0, Lp) contiguous,
      const int64_t* path;                        // [Lp, L) on the path; this chunk's keys end
      const TC *kh, *vh, *kb, *vb;                // at `end`, its contiguous ones at
      float* s;                                   // `contiguous_end` (<= its start: none)
      int64_t from;                               // the first key it sees in this chunk
    };
    const int64_t most = items.rows_per_item * items.heads_per_item;
    std::vector<Pair> pairs;
    pairs.reserve(most);
    // per pair: its scaled query, then its weighted-sum accumulators (32-byte aligned)
    // 16-bit caches: a tile of keys (then values) widened once for all pairs of the item
    constexpr bool wide_cache = !std::is_same_v<TC, float>;
    const int64_t tile_floats = wide_cache ? KEY_TILE * d : 0;
    std::vector<float> buffer(2 * most * dd + tile_floats + 8);
    float* qs_all = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 31) & ~uintptr_t(31));
    float* acc_all = qs_all + most * dd;
    float* tile = acc_all + most * dd;
    std::vector<float> sums(most), maxima(most);  // per pair: l_c and m_c of the item's chunk
    for (int64_t it = i0; it < i1; ++it) {
      // (KV head, chunk, head block, row block), the row block fastest: consecutive items of
      // a thread read the same keys and values (from cache after the first)
      const int64_t rb = it % items.row_blocks, hb = it / items.row_blocks % items.head_blocks;
      const int64_t chunk = it / (items.row_blocks * items.head_blocks) % items.chunks;
      const int64_t g = it / (items.row_blocks * items.head_blocks * items.chunks);
      const int64_t r0 = rb * items.rows_per_item, r1 = std::min(R, r0 + items.rows_per_item);
      const int64_t h0 = g * G + hb * items.heads_per_item, h1 = std::min(g * G + G, h0 + items.heads_per_item);
      const int64_t c0 = chunk * KEY_CHUNK;  // the chunk's first logical key
      pairs.clear();
      int64_t longest = c0;
      for (int64_t r = r0; r < r1; ++r) {
        // the row's keys end before this chunk, or its window starts after it
        if (lp[r] + 1 <= c0 || first_key(r) >= c0 + KEY_CHUNK) continue;
        for (int64_t h = h0; h < h1; ++h) {
          Pair pr;
          pr.item = r * Hq + h;
          pr.L = lp[r] + 1;
          pr.Lp = pr.L - meta.tree_keys[r];
          pr.end = std::min(pr.L, c0 + KEY_CHUNK);
          pr.from = std::max(c0, first_key(r));
          pr.contiguous_end = std::min(pr.Lp, pr.end);
          pr.path = pp + r * P;
          pr.kh = kp + g * S * d;  // path slots are absolute
          pr.vh = vp + g * S * d;
          pr.kb = pr.kh + meta.first_slot(r) * d;  // the prefix from the row's first slot
          pr.vb = pr.vh + meta.first_slot(r) * d;
          pr.s = sp + pr.item * stride;
          float* qs = qs_all + pairs.size() * dd;
          for (int64_t i = 0; i < d; ++i) qs[i] = qp[pr.item * d + i] * sc;
          longest = std::max(longest, pr.contiguous_end);
          pairs.push_back(pr);
        }
      }
      const int64_t n = static_cast<int64_t>(pairs.size());
      // every pair's contiguous keys of the chunk (Pair::kb) or values (Pair::vb), a tile of
      // KEY_TILE at a time for all pairs: fn(c, t0, keys, rows), rows the tile's cache rows
      // as stored, or for a 16-bit cache widened into `tile` once for the pairs that share them
      auto by_tiles = [&](const TC* Pair::*first, auto&& fn) {
        const TC* widened = nullptr;
        int64_t widened_keys = 0;
        for (int64_t t0 = c0; t0 < longest; t0 += KEY_TILE)
          for (int64_t c = 0; c < n; ++c) {
            const int64_t keys = std::min(pairs[c].contiguous_end, t0 + KEY_TILE) - t0;
            if (keys <= 0) continue;
            const TC* rows = pairs[c].*first + t0 * d;
            if constexpr (wide_cache) {
              if (rows != widened || keys > widened_keys) {
                widen<TC>(rows, keys * d, tile);
                widened = rows, widened_keys = keys;
              }
              fn(c, t0, keys, static_cast<const float*>(tile));
            } else {
              fn(c, t0, keys, rows);
            }
          }
      };
      // scores of the contiguous keys
      by_tiles(&Pair::kb, [&](int64_t c, int64_t t0, int64_t keys, const auto* k) {
        using TK = std::remove_cv_t<std::remove_pointer_t<decltype(k)>>;
        const float* qs = qs_all + c * dd;
        float* s = pairs[c].s + t0;
        int64_t j = 0;
        for (; j + 8 <= keys; j += 8) dot8<TK>(qs, k + j * d, d, s + j);
        for (; j + 4 <= keys; j += 4) dot4<TK>(qs, k + j * d, d, s + j);
        for (; j < keys; ++j) s[j] = dot<TK>(qs, k + j * d, d);
      });
      // each pair's path keys in the chunk, the chunk's maximum, exponentials and their sum
      for (int64_t c = 0; c < n; ++c) {
        Pair& pr = pairs[c];
        float* s = pr.s;
        const int64_t end = pr.end, end8 = c0 + (end - c0 + 7) / 8 * 8;
        for (int64_t j = std::max(pr.Lp, c0); j < end; ++j)
          s[j] = dot<TC>(qs_all + c * dd, pr.kh + pr.path[j - pr.Lp] * d, d);
        if (softcap > 0.f)  // Gemma 2: cap * tanh(score / cap), per score
          for (int64_t j = c0; j < end; ++j) s[j] = std::tanh(s[j] / softcap) * softcap;
        if (slopes != nullptr) {  // ALiBi: + the head's slope times the logical key index
          const float slope = slopes[pr.item % Hq];
          for (int64_t j = c0; j < end; ++j) s[j] += slope * static_cast<float>(j);
        }
        const int64_t from = pr.from;  // keys [c0, from) lie before the row's window
        for (int64_t j = c0; j < from; ++j) s[j] = -INFINITY;
        float m = s[from];
        for (int64_t j = from + 1; j < end; ++j) m = std::max(m, s[j]);
        // lanes past the last key (only a pair's last chunk ends off a multiple of 8: no
        // other chunk's scores there): exp8 -> exp(-87), zeroed below
        for (int64_t j = end; j < end8; ++j) s[j] = -INFINITY;
        const __m256 mv = _mm256_set1_ps(m);
        __m256 lv = _mm256_setzero_ps();
        for (int64_t j = c0; j < end8; j += 8) {
          __m256 pj = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
          if (j + 8 > end || j < from) {  // lanes past the last key or before the window: exactly 0
            alignas(32) float keep[8];
            for (int i = 0; i < 8; ++i) keep[i] = j + i < end && j + i >= from ? 1.0f : 0.0f;
            pj = _mm256_mul_ps(pj, _mm256_load_ps(keep));
          }
          _mm256_storeu_ps(s + j, pj);
          lv = _mm256_add_ps(lv, pj);
        }
        sums[c] = hsum(lv);
        maxima[c] = m;
        float* acc = acc_all + c * dd;
        for (int64_t i = 0; i < d; ++i) acc[i] = 0.f;
      }
      // the weighted sums over the chunk's contiguous keys in order of j, a tile at a time
      // for every pair, then each pair's path keys (the same FMA per lane)
      by_tiles(&Pair::vb, [&](int64_t c, int64_t t0, int64_t keys, const auto* v) {
        using TV = std::remove_cv_t<std::remove_pointer_t<decltype(v)>>;
        weighted_sum_d<TV>(pairs[c].s + t0, v, d, 0, keys, acc_all + c * dd);
      });
      for (int64_t c = 0; c < n; ++c) {
        const Pair& pr = pairs[c];
        float* acc = acc_all + c * dd;
        for (int64_t j = std::max(pr.Lp, c0); j < pr.end; ++j)
          weighted_sum_d<TC>(pr.s + j, pr.vh + pr.path[j - pr.Lp] * d, d, 0, 1, acc);
        if (first_key(pr.item / Hq) / KEY_CHUNK == (pr.L - 1) / KEY_CHUNK) {  // its only chunk: its output
          write_output(acc, maxima[c], sums[c], sinks == nullptr ? nullptr : sinks + pr.item % Hq, d,
                       op + pr.item * d);  // out[r, h*d : (h+1)*d]
        } else {
          float* dst = part + (pr.item * chunks + chunk) * part_floats;
          for (int64_t i = 0; i < d; ++i) dst[i] = acc[i];
          dst[dd] = maxima[c];
          dst[dd + 1] = sums[c];
        }
      }
    }
  };
  if (use_pool()) Pool::get().run(items.count, [&](int64_t i) { body(i, i + 1); });
  else at::parallel_for(0, items.count, 1, body);
  if (chunks == 1) return;
  // the pairs of several chunks: their chunks merged in order (see KEY_CHUNK)
  alignas(32) float acc[kMaxHeadDim];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t L = lp[r] + 1;
    const int64_t first = first_key(r) / KEY_CHUNK, last = (L - 1) / KEY_CHUNK;  // the chunks it sees
    if (first == last) continue;
    for (int64_t h = 0; h < Hq; ++h) {
      const float* pc = part + (r * Hq + h) * chunks * part_floats;
      float top = pc[first * part_floats + dd];
      for (int64_t c = first + 1; c <= last; ++c) top = std::max(top, pc[c * part_floats + dd]);
      for (int64_t i = 0; i < d; ++i) acc[i] = 0.f;
      float l = 0.f;
      for (int64_t c = first; c <= last; ++c) {
        const float* chunk_part = pc + c * part_floats;
        const float w = std::exp(chunk_part[dd] - top);
        l = std::fma(w, chunk_part[dd + 1], l);
        const __m256 wv = _mm256_set1_ps(w);
        for (int64_t c8 = 0; c8 < d8; c8 += 8)
          _mm256_store_ps(acc + c8, _mm256_fmadd_ps(wv, _mm256_loadu_ps(chunk_part + c8), _mm256_load_ps(acc + c8)));
        for (int64_t i = d8; i < d; ++i) acc[i] = std::fma(w, chunk_part[i], acc[i]);
      }
      write_output(acc, top, l, sinks == nullptr ? nullptr : sinks + h, d, op + (r * Hq + h) * d);
    }
  }
}

}  // namespace

// q [R, Hq, d] (after RoPE, unscaled; float32, bf16 / fp16 widened exactly first), k/v
// [Hkv, S, d] one layer's cache (float32, bfloat16 or float16, both the same), limit int64
// [R] (the last slot row r sees) -> o [R, Hq * d] float32; all CPU and contiguous.
//
// Trees: `path` int64 [R, P] (P may be 0: every row a chain) lists, per row, the slots of its
// own path in the draft tree (ancestors then itself, in depth order; -1 pads after them). With
// c_r such slots, row r sees logical keys j = 0 .. limit[r]: key j < limit[r] + 1 - c_r at slot j
// (the committed prefix), the last c_r keys at path[r][...] in order. A row's keys are then the
// exact keys a chain row at the same position would see, visited in the same order with the
// same arithmetic, so a tree row is bit-identical to that chain row.
//
// Batches: `base` int64 [R] (or [0]: all zeros) puts row r's contiguous prefix at slots
// base[r] .. (its sequence's KV region); path slots stay absolute. The arithmetic runs over
// logical keys j whatever the base, so a sequence's rows are bit-identical wherever its
// region lies in the cache and whatever the other sequences of the step.
//
// softcap > 0: each score s (the scaled product) becomes softcap * tanh(s / softcap) before the
// softmax (Gemma 2's attn_logit_softcapping); 0: as it is. window > 0: a sliding window, row r
// sees only its logical keys j > limit[r] - window (the keys a query at position limit[r]
// sees in HF's sliding layers); 0: every key up to limit[r].
namespace {
torch::Tensor attention_call(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit, double scale,
                             torch::Tensor path, torch::Tensor base, double softcap, int64_t window,
                             const torch::Tensor* slopes, const char* fn, const torch::Tensor* sinks = nullptr) {
  TORCH_CHECK(q.defined() && q.device().is_cpu(), fn, ": q must be a CPU tensor");
  TORCH_CHECK(float_kind(q), fn, ": q must be float32 (or bfloat16 / float16), got ", q.scalar_type());
  check_cache(k, v, fn);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == k.size(2),
              fn, ": q [R, Hq, d], k and v [Hkv, S, d] (the same d), got q ", q.sizes(), " and k ",
              k.sizes());
  TORCH_CHECK(q.is_contiguous(), fn, ": q must be contiguous");
  const int64_t R = q.size(0), Hq = q.size(1), d = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(R > 0 && Hq > 0, fn, ": empty q (rows and query heads must be >= 1), got ", q.sizes());
  TORCH_CHECK(Hq % Hkv == 0, fn, ": query heads must be a multiple of KV heads, got ", Hq, " and ", Hkv);
  TORCH_CHECK(std::isfinite(scale), fn, ": scale must be finite, got ", scale);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, fn, ": softcap must be finite and >= 0 (0: none), got ",
              softcap);
  TORCH_CHECK(window >= 0, fn, ": window must be >= 0 (0: none), got ", window);
  if (slopes != nullptr) {
    TORCH_CHECK(slopes->defined() && slopes->device().is_cpu() && slopes->scalar_type() == at::kFloat &&
                    slopes->dim() == 1 && slopes->size(0) == Hq && slopes->is_contiguous(),
                fn, ": slopes must be a contiguous float32 CPU tensor [Hq] = [", Hq, "], got ",
                slopes->defined() ? slopes->sizes() : at::IntArrayRef{});
  }
  if (sinks != nullptr) {
    TORCH_CHECK(sinks->defined() && sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat &&
                    sinks->dim() == 1 && sinks->size(0) == Hq && sinks->is_contiguous(),
                fn, ": sinks must be a contiguous float32 CPU tensor [Hq] = [", Hq, "], got ",
                sinks->defined() ? sinks->sizes() : at::IntArrayRef{});
    const float* sp = sinks->data_ptr<float>();
    for (int64_t h = 0; h < Hq; ++h) TORCH_CHECK(std::isfinite(sp[h]), fn, ": sinks must be finite, got ", sp[h]);
  }
  const AttentionMeta meta = check_attention_meta(limit, path, base, R, S, fn);
  if (q.scalar_type() != at::kFloat) q = q.to(at::kFloat);
  auto out = torch::empty({R, Hq * d}, q.options());
  by_dtype(k.scalar_type(), [&](auto tag) {
    using TC = decltype(tag);
    attention_rows<TC>(q.data_ptr<float>(), static_cast<const TC*>(k.data_ptr()),
                       static_cast<const TC*>(v.data_ptr()), meta, R, Hq, Hkv, S, d, static_cast<float>(scale),
                       static_cast<float>(softcap), window, out.data_ptr<float>(),
                       slopes == nullptr ? nullptr : slopes->data_ptr<float>(),
                       sinks == nullptr ? nullptr : sinks->data_ptr<float>());
  });
  return out;
}
}  // namespace

torch::Tensor rows_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                             double scale, torch::Tensor path, torch::Tensor base, double softcap, int64_t window);
torch::Tensor rows_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                             double scale, torch::Tensor path, torch::Tensor base, double softcap, int64_t window) {
  return attention_call(q, k, v, limit, scale, path, base, softcap, window, nullptr, "rows_attention");
}

// rows_attention with ALiBi (Bloom): slopes float32 [Hq]; each score s_j (the scaled
// product, capped where softcap > 0) becomes s_j + slopes[h] * j, j the logical key index
// (a row's key positions: the prefix, then its tree path), before the softmax.
torch::Tensor rows_attention_alibi(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                                   double scale, torch::Tensor path, torch::Tensor base, double softcap,
                                   int64_t window, torch::Tensor slopes);
torch::Tensor rows_attention_alibi(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                                   double scale, torch::Tensor path, torch::Tensor base, double softcap,
                                   int64_t window, torch::Tensor slopes) {
  return attention_call(q, k, v, limit, scale, path, base, softcap, window, &slopes, "rows_attention_alibi");
}

// rows_attention with an attention sink per head (GPT-OSS, Granite-SWA): sinks float32 [Hq]
// (finite); head h's softmax over its keys gains one more logit, sinks[h], whose value is 0:
// o = sum_j exp(s_j) v_j / (exp(sinks[h]) + sum_j exp(s_j)), computed relative to the
// largest of them.
torch::Tensor rows_attention_sinks(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                                   double scale, torch::Tensor path, torch::Tensor base, double softcap,
                                   int64_t window, torch::Tensor sinks);
torch::Tensor rows_attention_sinks(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor limit,
                                   double scale, torch::Tensor path, torch::Tensor base, double softcap,
                                   int64_t window, torch::Tensor sinks) {
  return attention_call(q, k, v, limit, scale, path, base, softcap, window, nullptr, "rows_attention_sinks",
                        &sinks);
}
