"""C++ source of the native paged-attention kernel's AVX-512 path (`attend_vec`), spliced by native_source.py
between the portable kernels (whose `Step`, `Scratch`, `softmax_rows` and key walk it uses) and the dispatch
that picks it for head sizes 64 / 128 and up to 8 query heads per KV head.

Scores are computed 16 keys at a time with their lane sums done together (no horizontal sum per key), the
softmax is vectorized, values are accumulated in registers, every row is widened to float32 as it is read,
and the rows 12 keys ahead are prefetched across page boundaries (docs/design.md, "The vector kernel on
AVX-512"). Its int8 instance (`KV = int8_t`, an int8 KV cache) widens 16 int8 values at a time and multiplies
each key's 16-lane partial dot product by the key row's scale, each value row's probability by its scale.
"""

VEC_SOURCE = r"""#if defined(__AVX512F__)
#define TCB_VECTOR_KERNELS 1
// ---- the AVX-512 kernel (float32, bfloat16): no horizontal sum per key -------------------------------
// Scores are computed 16 keys at a time: each (head, key) dot product is left as a 16-lane vector, and the
// 16 vectors of a block are summed across lanes together (a transpose-and-add tree: ~3 instructions a
// score instead of ~10 for a reduction per key); values are accumulated in registers. bfloat16 rows are
// widened to float32 and multiplied with FMAs: `vdpbf16ps` (pairs as stored) was no faster on Zen 4 and
// its other order of additions moved the real model's bf16 outputs off `generate()`'s
// (conformance/test_real_model.py).

// lane l of the result: the sum of the 16 lanes of v[l]
inline __m512 sum_lanes_of_16(const float (*v)[16]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = _mm512_load_ps(v[2 * i]), y = _mm512_load_ps(v[2 * i + 1]);
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

// A query head held for the dot products, as float32 vectors.
template <typename T, int D>
struct QueryRegs;

template <int D>
struct QueryRegs<float, D> {
  __m512 v[D / 16];
  void load(const float* q) { for (int c = 0; c < D / 16; ++c) v[c] = _mm512_loadu_ps(q + 16 * c); }
  __m512 dot(const float* k) const {
    __m512 acc = _mm512_mul_ps(v[0], _mm512_loadu_ps(k));
    for (int c = 1; c < D / 16; ++c) acc = _mm512_fmadd_ps(v[c], _mm512_loadu_ps(k + 16 * c), acc);
    return acc;
  }
};

// 16 values of a row as float32
inline __m512 widen16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 widen16(const c10::BFloat16* x) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// 16 int8 values of a row as float32 (an int8 cache; the row's scale applied by the caller)
inline __m512 widen16(const int8_t* x) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))));
}

template <int D>
struct QueryRegs<c10::BFloat16, D> {
  __m512 v[D / 16];
  void load(const c10::BFloat16* q) { for (int c = 0; c < D / 16; ++c) v[c] = widen16(q + 16 * c); }
  __m512 dot(const c10::BFloat16* k) const {
    __m512 acc = _mm512_mul_ps(v[0], widen16(k));
    for (int c = 1; c < D / 16; ++c) acc = _mm512_fmadd_ps(v[c], widen16(k + 16 * c), acc);
    return acc;
  }
};


// A query head's 16-lane partial dot product with a key row already widened into registers (an int8 row:
// widened once for all the heads of its group, unscaled).
template <typename T, int D>
inline __m512 dot_widened(const QueryRegs<T, D>& q, const __m512* k) {
  __m512 acc = _mm512_mul_ps(q.v[0], k[0]);
  for (int c = 1; c < D / 16; ++c) acc = _mm512_fmadd_ps(q.v[c], k[c], acc);
  return acc;
}

// exp(x) for x <= 0, 16 lanes: exp_nonpositive's polynomial.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// softmax_rows, 16 scores at a time (a masked last block), for layers without softcap or ALiBi.
template <typename T>
inline void softmax_rows_vec(const Step<T>& s, float* sc, int64_t n, int64_t g, int64_t G) {
  const __m512 scale = _mm512_set1_ps(s.scale);
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1u);
  for (int64_t h = 0; h < G; ++h) {
    float* row = sc + h * n;
    const bool sink = s.sinks != nullptr;
    const float sink_logit = sink ? s.sinks[g * G + h] : 0.f;
    __m512 m = _mm512_set1_ps(sink ? sink_logit : -std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < full; j += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + j), scale);
      _mm512_storeu_ps(row + j, x);
      m = _mm512_max_ps(m, x);
    }
    if (tail) {
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + full), scale);
      _mm512_mask_storeu_ps(row + full, tail, x);
      m = _mm512_mask_max_ps(m, tail, m, x);
    }
    const float mx = _mm512_reduce_max_ps(m);
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < full; j += 16) {
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row + j), vm));
      _mm512_storeu_ps(row + j, e);
      total = _mm512_add_ps(total, e);
    }
    if (tail) {
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + full), vm));
      _mm512_mask_storeu_ps(row + full, tail, e);
      total = _mm512_mask_add_ps(total, tail, total, e);
    }
    float sum = _mm512_reduce_add_ps(total);
    if (sink) sum += exp_nonpositive(sink_logit - mx);
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    for (int64_t j = 0; j < full; j += 16) _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), inv));
    if (tail) _mm512_mask_storeu_ps(row + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + full), inv));
  }
}

// Keys whose rows are fetched ahead of the one being read.
constexpr int64_t kAheadKeys = 12;

template <typename T, int G, int D, typename KV = T>
void attend_vec(const Step<T>& s, int64_t t, int64_t g, Scratch& scratch) {
  constexpr bool q8 = std::is_same_v<KV, int8_t>;
  const int64_t pos = s.token_pos[t];
  const int64_t lo = first_key(s.window, pos);
  const int64_t n = pos - lo + 1;
  scratch.scores.resize(static_cast<size_t>(G * n));
  float* sc = scratch.scores.data();
  const int32_t* pages = s.block_table + s.token_row[t] * s.table_stride;
  const T* q_in = s.q + t * s.q_stride_t + g * G * s.q_stride_h;
  QueryRegs<T, D> q[G];
  for (int h = 0; h < G; ++h) q[h].load(q_in + h * s.q_stride_h);
  const KV* k_base = kv_data<KV>(s, true) + g * s.kv_head_stride;
  const KV* v_base = kv_data<KV>(s, false) + g * s.kv_head_stride;
  constexpr int64_t kRowBytes = D * static_cast<int64_t>(sizeof(KV));
  // the keys' slots first: rows are then fetched ahead across page boundaries too (pages are anywhere)
  scratch.slots.resize(static_cast<size_t>(n));
  int64_t* slots = scratch.slots.data();
  for_each_key(s.page_size, pages, lo, pos, [&](int64_t j, int64_t slot) { slots[j] = slot; });
  const auto fetch = [&](const KV* base, int64_t j) {
    if (j < n) {
      const char* row = reinterpret_cast<const char*>(base + slots[j] * s.slot_stride);
      for (int64_t b = 0; b < kRowBytes; b += 64) __builtin_prefetch(row + b);
    }
  };
  alignas(64) float part[G][16][16];
  for (int64_t j = 0; j < n; ++j) {
    fetch(k_base, j + kAheadKeys);
    const KV* kr = k_base + slots[j] * s.slot_stride;
    const int lane = static_cast<int>(j & 15);
    if constexpr (q8) {
      __m512 k[D / 16];
      for (int c = 0; c < D / 16; ++c) k[c] = widen16(kr + 16 * c);
      const __m512 scale = _mm512_set1_ps(row_scale(s, true, slots[j], g));
      for (int h = 0; h < G; ++h) _mm512_store_ps(part[h][lane], _mm512_mul_ps(dot_widened(q[h], k), scale));
    } else {
      for (int h = 0; h < G; ++h) _mm512_store_ps(part[h][lane], q[h].dot(kr));
    }
    if (lane == 15) {
      for (int h = 0; h < G; ++h) _mm512_storeu_ps(sc + h * n + (j - 15), sum_lanes_of_16(part[h]));
    }
  }
  const int64_t done = n / 16 * 16;
  for (int h = 0; h < G; ++h)
    for (int64_t j = done; j < n; ++j) sc[h * n + j] = _mm512_reduce_add_ps(_mm512_load_ps(part[h][j - done]));
  if (s.softcap > 0.f || s.slopes != nullptr) {
    softmax_rows(s, sc, n, g, G, lo, pos);
  } else {
    softmax_rows_vec(s, sc, n, g, G);
  }
  __m512 o[G][D / 16];
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < D / 16; ++c) o[h][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kAheadKeys; ++k) fetch(v_base, k);
  for (int64_t j = 0; j < n; ++j) {
    fetch(v_base, j + kAheadKeys);
    const KV* vr = v_base + slots[j] * s.slot_stride;
    __m512 v[D / 16];
    for (int c = 0; c < D / 16; ++c) v[c] = widen16(vr + 16 * c);
    float v_scale = 1.f;
    if constexpr (q8) v_scale = row_scale(s, false, slots[j], g);
    for (int h = 0; h < G; ++h) {
      const __m512 p = _mm512_set1_ps(q8 ? sc[h * n + j] * v_scale : sc[h * n + j]);
      for (int c = 0; c < D / 16; ++c) o[h][c] = _mm512_fmadd_ps(p, v[c], o[h][c]);
    }
  }
  T* out = s.out + (t * s.heads + g * G) * D;
  for (int h = 0; h < G; ++h) {
    alignas(64) float row[D];
    for (int c = 0; c < D / 16; ++c) _mm512_store_ps(row + 16 * c, o[h][c]);
    for (int i = 0; i < D; ++i) out[h * D + i] = static_cast<T>(row[i]);
  }
}

// ---- query tiles: a prefill chunk's tokens attended together -----------------------------------------
// Up to kTileTokens tokens of one row at consecutive positions (a prefill chunk, full attention) share each
// block of 16 key rows and 16 value rows, widened once for all of them: the K/V bytes a 512-token chunk
// reads drop by the tile's size (attend_vec reads every key once per token). Each token's arithmetic is
// attend_vec's, in its order: the 16-lane partial dot products, the lane sums of a full block (the tail's
// one by one), the same softmax, values accumulated key by key from zero. So a token gets the same bits in a
// tile as alone, and a prompt the same bits whatever its chunking.
template <typename T, int D>
void attend_tile(const Step<T>& s, int64_t t0, int64_t count, int64_t g, Scratch& scratch) {
  const int64_t G = s.group;
  const int64_t pos0 = s.token_pos[t0];
  const int64_t n_last = pos0 + count;  // the keys of the tile's last token: positions 0 .. pos0 + count - 1
  int64_t offset[kTileTokens + 1];      // token q's scores [G, n_q] start at offset[q]
  offset[0] = 0;
  for (int64_t q = 0; q < count; ++q) offset[q + 1] = offset[q] + G * (pos0 + q + 1);
  scratch.scores.resize(static_cast<size_t>(offset[count]));
  scratch.query.resize(static_cast<size_t>(count * G * D));
  scratch.out.assign(static_cast<size_t>(count * G * D), 0.f);
  scratch.slots.resize(static_cast<size_t>(n_last));
  float* scores = scratch.scores.data();
  float* queries = scratch.query.data();
  float* acc = scratch.out.data();
  int64_t* slots = scratch.slots.data();
  const int32_t* pages = s.block_table + s.token_row[t0] * s.table_stride;
  for_each_key(s.page_size, pages, 0, n_last - 1, [&](int64_t j, int64_t slot) { slots[j] = slot; });
  for (int64_t q = 0; q < count; ++q) {
    const T* q_in = s.q + (t0 + q) * s.q_stride_t + g * G * s.q_stride_h;
    for (int64_t h = 0; h < G; ++h)
      for (int c = 0; c < D / 16; ++c)
        _mm512_storeu_ps(queries + (q * G + h) * D + 16 * c, widen16(q_in + h * s.q_stride_h + 16 * c));
  }
  const T* k_base = s.k + g * s.kv_head_stride;
  const T* v_base = s.v + g * s.kv_head_stride;
  constexpr int64_t kRowBytes = D * static_cast<int64_t>(sizeof(T));
  alignas(64) float rows[16][D];
  alignas(64) float part[16][16];
  // 16 rows from key (or value) `b` on, widened; the next block's rows fetched ahead.
  const auto widen_block = [&](const T* base, int64_t b, int64_t nb) {
    for (int64_t j = b + 16; j < std::min(n_last, b + 32); ++j) {
      const char* row = reinterpret_cast<const char*>(base + slots[j] * s.slot_stride);
      for (int64_t x = 0; x < kRowBytes; x += 64) __builtin_prefetch(row + x);
    }
    for (int64_t j = 0; j < nb; ++j) {
      const T* r = base + slots[b + j] * s.slot_stride;
      for (int c = 0; c < D / 16; ++c) _mm512_store_ps(rows[j] + 16 * c, widen16(r + 16 * c));
    }
  };
  for (int64_t b = 0; b < n_last; b += 16) {
    widen_block(k_base, b, std::min<int64_t>(16, n_last - b));
    for (int64_t q = 0; q < count; ++q) {
      const int64_t n_q = pos0 + q + 1;
      if (n_q <= b) continue;
      const int64_t m = std::min<int64_t>(16, n_q - b);
      float* sc = scores + offset[q];
      for (int64_t h = 0; h < G; ++h) {
        const float* qh = queries + (q * G + h) * D;
        __m512 qv[D / 16];
        for (int c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(qh + 16 * c);
        for (int64_t j = 0; j < m; ++j) {
          __m512 a = _mm512_mul_ps(qv[0], _mm512_load_ps(rows[j]));
          for (int c = 1; c < D / 16; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_load_ps(rows[j] + 16 * c), a);
          _mm512_store_ps(part[j], a);
        }
        if (m == 16) {
          _mm512_storeu_ps(sc + h * n_q + b, sum_lanes_of_16(part));
        } else {
          for (int64_t j = 0; j < m; ++j) sc[h * n_q + b + j] = _mm512_reduce_add_ps(_mm512_load_ps(part[j]));
        }
      }
    }
  }
  for (int64_t q = 0; q < count; ++q) {
    const int64_t n_q = pos0 + q + 1;
    if (s.softcap > 0.f || s.slopes != nullptr) {
      softmax_rows(s, scores + offset[q], n_q, g, G, 0, pos0 + q);
    } else {
      softmax_rows_vec(s, scores + offset[q], n_q, g, G);
    }
  }
  for (int64_t b = 0; b < n_last; b += 16) {
    widen_block(v_base, b, std::min<int64_t>(16, n_last - b));
    for (int64_t q = 0; q < count; ++q) {
      const int64_t n_q = pos0 + q + 1;
      if (n_q <= b) continue;
      const int64_t m = std::min<int64_t>(16, n_q - b);
      const float* sc = scores + offset[q];
      for (int64_t h = 0; h < G; ++h) {
        float* o = acc + (q * G + h) * D;
        __m512 ov[D / 16];
        for (int c = 0; c < D / 16; ++c) ov[c] = _mm512_loadu_ps(o + 16 * c);
        for (int64_t j = 0; j < m; ++j) {
          const __m512 p = _mm512_set1_ps(sc[h * n_q + b + j]);
          for (int c = 0; c < D / 16; ++c) ov[c] = _mm512_fmadd_ps(p, _mm512_load_ps(rows[j] + 16 * c), ov[c]);
        }
        for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(o + 16 * c, ov[c]);
      }
    }
  }
  for (int64_t q = 0; q < count; ++q) {
    T* out = s.out + ((t0 + q) * s.heads + g * G) * D;
    const float* o = acc + q * G * D;
    for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<T>(o[i]);
  }
}
#endif
"""
