"""C++ source of the native paged-attention kernel's AVX2 path (`attend_vec`, `attend_tile` on 8 lanes), spliced by
native_source.py after the AVX-512 path (native_vec_source.py) and built only where that one is not: a CPU with
AVX2 and FMA but no AVX-512 (AMD Zen 3).

The same kernels as the AVX-512 ones, 8 lanes wide: scores 8 keys at a time with their lane sums done together
(no horizontal sum per key), a vectorized softmax, values accumulated key by key, every row widened to float32
as it is read, rows fetched ahead across page boundaries; the query tiles share each block of 8 widened K/V
rows among up to 16 tokens of one prompt, each token keeping the per-token kernel's arithmetic and order (so
the same bits in a tile as alone). The portable `attend_fixed` summed each key's dot product across lanes
and copied each row: 1.9x this kernel's time on the small model's decode (docs/design.md, "AVX2-only CPUs").
An AVX2 build's bits differ from an AVX-512 build's (8 partial sums a dot product, not 16), as the portable
kernel's did.
"""

VEC8_SOURCE = r"""#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define TCB_VECTOR_KERNELS 1
// ---- the AVX2 kernel (float32, bfloat16; int8 caches): no horizontal sum per key --------------------

// lane l of the result: the sum of the 8 lanes of v[l]
inline __m256 sum_lanes_of_8(const float (*v)[8]) {
  const __m256 a0 = _mm256_hadd_ps(_mm256_load_ps(v[0]), _mm256_load_ps(v[1]));
  const __m256 a1 = _mm256_hadd_ps(_mm256_load_ps(v[2]), _mm256_load_ps(v[3]));
  const __m256 a2 = _mm256_hadd_ps(_mm256_load_ps(v[4]), _mm256_load_ps(v[5]));
  const __m256 a3 = _mm256_hadd_ps(_mm256_load_ps(v[6]), _mm256_load_ps(v[7]));
  const __m256 b0 = _mm256_hadd_ps(a0, a1);  // v0..v3's sums of each 128-bit half
  const __m256 b1 = _mm256_hadd_ps(a2, a3);  // v4..v7's
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// the sum of one vector's 8 lanes (a block's tail, key by key), in one fixed order
inline float sum_of_8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

inline float max_of_8(__m256 v) {
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

// 8 values of a row as float32
inline __m256 widen8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 widen8(const c10::BFloat16* x) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
// 8 int8 values of a row as float32 (an int8 cache; the row's scale applied by the caller)
inline __m256 widen8(const int8_t* x) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x))));
}

// A query head held for the dot products, as float32 vectors.
template <typename T, int D>
struct QueryRegs {
  __m256 v[D / 8];
  void load(const T* q) { for (int c = 0; c < D / 8; ++c) v[c] = widen8(q + 8 * c); }
  template <typename K>
  __m256 dot(const K* k) const {
    __m256 acc = _mm256_mul_ps(v[0], widen8(k));
    for (int c = 1; c < D / 8; ++c) acc = _mm256_fmadd_ps(v[c], widen8(k + 8 * c), acc);
    return acc;
  }
};

// exp(x) for x <= 0, 8 lanes: exp_nonpositive's polynomial.
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// softmax_rows, 8 scores at a time (the tail's one by one), for layers without softcap or ALiBi.
template <typename T>
inline void softmax_rows_vec(const Step<T>& s, float* sc, int64_t n, int64_t g, int64_t G) {
  const __m256 scale = _mm256_set1_ps(s.scale);
  const int64_t full = n / 8 * 8;
  for (int64_t h = 0; h < G; ++h) {
    float* row = sc + h * n;
    const bool sink = s.sinks != nullptr;
    const float sink_logit = sink ? s.sinks[g * G + h] : 0.f;
    __m256 m = _mm256_set1_ps(sink ? sink_logit : -std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < full; j += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(row + j), scale);
      _mm256_storeu_ps(row + j, x);
      m = _mm256_max_ps(m, x);
    }
    float mx = max_of_8(m);
    for (int64_t j = full; j < n; ++j) {
      row[j] *= s.scale;
      mx = std::max(mx, row[j]);
    }
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < full; j += 8) {
      const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(row + j), vm));
      _mm256_storeu_ps(row + j, e);
      total = _mm256_add_ps(total, e);
    }
    float sum = sum_of_8(total);
    for (int64_t j = full; j < n; ++j) {
      row[j] = exp_nonpositive(row[j] - mx);
      sum += row[j];
    }
    if (sink) sum += exp_nonpositive(sink_logit - mx);
    const float inv_sum = 1.f / sum;
    const __m256 inv = _mm256_set1_ps(inv_sum);
    for (int64_t j = 0; j < full; j += 8) _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), inv));
    for (int64_t j = full; j < n; ++j) row[j] *= inv_sum;
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
  alignas(32) float part[G][8][8];
  for (int64_t j = 0; j < n; ++j) {
    fetch(k_base, j + kAheadKeys);
    const KV* kr = k_base + slots[j] * s.slot_stride;
    const int lane = static_cast<int>(j & 7);
    if constexpr (q8) {
      const __m256 scale = _mm256_set1_ps(row_scale(s, true, slots[j], g));
      for (int h = 0; h < G; ++h) _mm256_store_ps(part[h][lane], _mm256_mul_ps(q[h].dot(kr), scale));
    } else {
      for (int h = 0; h < G; ++h) _mm256_store_ps(part[h][lane], q[h].dot(kr));
    }
    if (lane == 7) {
      for (int h = 0; h < G; ++h) _mm256_storeu_ps(sc + h * n + (j - 7), sum_lanes_of_8(part[h]));
    }
  }
  const int64_t done = n / 8 * 8;
  for (int h = 0; h < G; ++h)
    for (int64_t j = done; j < n; ++j) sc[h * n + j] = sum_of_8(_mm256_load_ps(part[h][j - done]));
  if (s.softcap > 0.f || s.slopes != nullptr) {
    softmax_rows(s, sc, n, g, G, lo, pos);
  } else {
    softmax_rows_vec(s, sc, n, g, G);
  }
  // 16 registers: a head's accumulators at a time while the rows stay in L1 (8 keys' rows of 64 floats: 2 KB)
  alignas(32) float o[G][D];
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < D; ++i) o[h][i] = 0.f;
  for (int64_t k = 0; k < kAheadKeys; ++k) fetch(v_base, k);
  alignas(32) float rows[8][D];
  for (int64_t b = 0; b < n; b += 8) {
    const int64_t m = std::min<int64_t>(8, n - b);
    for (int64_t j = 0; j < m; ++j) {
      fetch(v_base, b + j + kAheadKeys);
      const KV* vr = v_base + slots[b + j] * s.slot_stride;
      for (int c = 0; c < D / 8; ++c) _mm256_store_ps(rows[j] + 8 * c, widen8(vr + 8 * c));
    }
    for (int h = 0; h < G; ++h) {
      __m256 ov[D / 8];
      for (int c = 0; c < D / 8; ++c) ov[c] = _mm256_load_ps(o[h] + 8 * c);
      for (int64_t j = 0; j < m; ++j) {
        float p = sc[h * n + b + j];
        if constexpr (q8) p *= row_scale(s, false, slots[b + j], g);
        const __m256 pv = _mm256_set1_ps(p);
        for (int c = 0; c < D / 8; ++c) ov[c] = _mm256_fmadd_ps(pv, _mm256_load_ps(rows[j] + 8 * c), ov[c]);
      }
      for (int c = 0; c < D / 8; ++c) _mm256_store_ps(o[h] + 8 * c, ov[c]);
    }
  }
  T* out = s.out + (t * s.heads + g * G) * D;
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < D; ++i) out[h * D + i] = static_cast<T>(o[h][i]);
}

// ---- query tiles: a prefill chunk's tokens attended together (native_vec_source.py's, 8 keys a block) ----
// Each token's arithmetic is attend_vec's, in its order: the 8-lane partial dot products, the lane sums of a
// full block (the tail's one by one), the same softmax, values accumulated key by key from zero: a token gets
// the same bits in a tile as alone.
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
      for (int c = 0; c < D / 8; ++c)
        _mm256_storeu_ps(queries + (q * G + h) * D + 8 * c, widen8(q_in + h * s.q_stride_h + 8 * c));
  }
  const T* k_base = s.k + g * s.kv_head_stride;
  const T* v_base = s.v + g * s.kv_head_stride;
  constexpr int64_t kRowBytes = D * static_cast<int64_t>(sizeof(T));
  alignas(32) float rows[8][D];
  alignas(32) float part[8][8];
  // 8 rows from key (or value) `b` on, widened; the next two blocks' rows fetched ahead.
  const auto widen_block = [&](const T* base, int64_t b, int64_t nb) {
    for (int64_t j = b + 8; j < std::min(n_last, b + 24); ++j) {
      const char* row = reinterpret_cast<const char*>(base + slots[j] * s.slot_stride);
      for (int64_t x = 0; x < kRowBytes; x += 64) __builtin_prefetch(row + x);
    }
    for (int64_t j = 0; j < nb; ++j) {
      const T* r = base + slots[b + j] * s.slot_stride;
      for (int c = 0; c < D / 8; ++c) _mm256_store_ps(rows[j] + 8 * c, widen8(r + 8 * c));
    }
  };
  for (int64_t b = 0; b < n_last; b += 8) {
    widen_block(k_base, b, std::min<int64_t>(8, n_last - b));
    for (int64_t q = 0; q < count; ++q) {
      const int64_t n_q = pos0 + q + 1;
      if (n_q <= b) continue;
      const int64_t m = std::min<int64_t>(8, n_q - b);
      float* sc = scores + offset[q];
      for (int64_t h = 0; h < G; ++h) {
        const float* qh = queries + (q * G + h) * D;
        for (int64_t j = 0; j < m; ++j) {
          __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_load_ps(rows[j]));
          for (int c = 1; c < D / 8; ++c)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), _mm256_load_ps(rows[j] + 8 * c), a);
          _mm256_store_ps(part[j], a);
        }
        if (m == 8) {
          _mm256_storeu_ps(sc + h * n_q + b, sum_lanes_of_8(part));
        } else {
          for (int64_t j = 0; j < m; ++j) sc[h * n_q + b + j] = sum_of_8(_mm256_load_ps(part[j]));
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
  for (int64_t b = 0; b < n_last; b += 8) {
    widen_block(v_base, b, std::min<int64_t>(8, n_last - b));
    for (int64_t q = 0; q < count; ++q) {
      const int64_t n_q = pos0 + q + 1;
      if (n_q <= b) continue;
      const int64_t m = std::min<int64_t>(8, n_q - b);
      const float* sc = scores + offset[q];
      for (int64_t h = 0; h < G; ++h) {
        float* o = acc + (q * G + h) * D;
        __m256 ov[D / 8];
        for (int c = 0; c < D / 8; ++c) ov[c] = _mm256_loadu_ps(o + 8 * c);
        for (int64_t j = 0; j < m; ++j) {
          const __m256 p = _mm256_set1_ps(sc[h * n_q + b + j]);
          for (int c = 0; c < D / 8; ++c) ov[c] = _mm256_fmadd_ps(p, _mm256_load_ps(rows[j] + 8 * c), ov[c]);
        }
        for (int c = 0; c < D / 8; ++c) _mm256_storeu_ps(o + 8 * c, ov[c]);
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
