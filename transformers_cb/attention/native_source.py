"""C++ source of the native CPU library (built by `native.py` with `torch.utils.cpp_extension`): the paged-attention
kernel here, the decoder-layer ops in native_layer_source.py.

One call attends every query token of a step that the kernel takes (decodes and short prefill
chunks) over the paged cache in place: no gathered K/V copies, no padding, one op per layer
whatever the number of requests. Token `t` is at logical position `token_pos[t]` of block-table
row `token_row[t]` and sees its row's keys `[lo, token_pos[t]]` (`lo` = 0, or the window start):
causal by construction, windowed when `window > 0`, chunked (`lo` = the start of the query's attention
chunk of `-window` tokens) when `window < 0`.

On AVX-512 CPUs (float32, bfloat16) head sizes 64 and 128 with up to 8 query heads per KV head run
`attend_vec`: scores 16 keys at a time with their lane sums done together, a vectorized softmax, values
accumulated in registers, every row widened to float32 as it is read.
Elsewhere `attend_fixed` / `attend_one` (portable C++ the compiler vectorizes).
"""

from .native_layer_source import BINDINGS, LAYER_SOURCE

ATTENTION_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// exp(x) for x <= 0 (scores minus their max), Cephes' single-precision polynomial (about 1 ulp):
// written so that the compiler vectorizes the softmax loop (std::exp is one scalar call per score).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r -= n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// float32, bfloat16 and float16 caches: inputs are widened to float on load, every sum is a float.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }

template <typename T>
struct Step {
  const T* q; int64_t q_stride_t, q_stride_h;
  const T* k; const T* v; int64_t slot_stride, kv_head_stride;
  const int64_t* token_row; const int64_t* token_pos;
  const int32_t* block_table; int64_t table_stride;
  const float* sinks;
  const float* slopes;  // ALiBi: slope_h * (key_pos - query_pos) added to the scaled logits; nullptr: none
  T* out;
  int64_t heads, kv_heads, group, head_dim, page_size, window;
  float scale, softcap;
};

inline int64_t first_key(int64_t window, int64_t pos) {
  // window > 0: a sliding window; window < 0: an attention chunk of -window tokens; 0: full attention.
  if (window < 0) return pos / -window * -window;
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// Calls f(j, slot) for the keys lo..pos in order (j counts from 0), one page run at a time: slots
// are consecutive within a page, so the page table is read once per page, not once per key.
template <typename F>
inline void for_each_key(int64_t page_size, const int32_t* pages, int64_t lo, int64_t pos, F&& f) {
  int64_t j = 0;
  for (int64_t page = lo / page_size; page <= pos / page_size; ++page) {
    const int64_t start = std::max(lo, page * page_size);
    const int64_t end = std::min(pos + 1, (page + 1) * page_size);
    int64_t slot = static_cast<int64_t>(pages[page]) * page_size + (start - page * page_size);
    for (int64_t p = start; p < end; ++p, ++j, ++slot) f(j, slot);
  }
}

// A key or value row as float: itself for float32, widened into `buffer` otherwise.
template <typename T>
inline const float* as_float(const T* row, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buffer[i] = widen(row[i]);
    return buffer;
  }
}

// Scores `sc` [G, n] of kv head g's query heads made probabilities in place: scale (or softcap), then a
// softmax over the keys, with the head's attention sink in the denominator when the layer has sinks.
// The keys are positions lo..lo+n-1 of a query at `pos` (its ALiBi bias).
template <typename T>
inline void softmax_rows(const Step<T>& s, float* sc, int64_t n, int64_t g, int64_t G, int64_t lo, int64_t pos) {
  for (int64_t h = 0; h < G; ++h) {
    float* row = sc + h * n;
    const float scale = s.scale;
    if (s.softcap > 0.f) {
      for (int64_t j = 0; j < n; ++j) row[j] = s.softcap * std::tanh(row[j] * scale / s.softcap);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) row[j] *= scale;
    }
    if (s.slopes != nullptr) {
      const float slope = s.slopes[g * G + h];
      for (int64_t j = 0; j < n; ++j) row[j] += slope * static_cast<float>(lo + j - pos);
    }
    const bool sink = s.sinks != nullptr;
    const float sink_logit = sink ? s.sinks[g * G + h] : 0.f;
    float m = sink ? sink_logit : row[0];
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
    float total = sink ? exp_nonpositive(sink_logit - m) : 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; ++j) {
      row[j] = exp_nonpositive(row[j] - m);
      total += row[j];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
  }
}

// Scratch space of one lane: scores, the widened queries, one widened K/V row, the float output.
struct Scratch {
  std::vector<float> scores, query, row, out;
  std::vector<int64_t> slots;
};

// One (token, kv head): the `group` query heads that share this kv head.
template <typename T>
void attend_one(const Step<T>& s, int64_t t, int64_t g, Scratch& scratch) {
  const int64_t pos = s.token_pos[t];
  const int64_t lo = first_key(s.window, pos);
  const int64_t n = pos - lo + 1;
  const int64_t D = s.head_dim, G = s.group;
  scratch.scores.resize(static_cast<size_t>(G * n));
  scratch.query.resize(static_cast<size_t>(G * D));
  scratch.row.resize(static_cast<size_t>(D));
  scratch.out.assign(static_cast<size_t>(G * D), 0.f);
  float* sc = scratch.scores.data();
  float* q0 = scratch.query.data();
  float* o0 = scratch.out.data();
  const int32_t* pages = s.block_table + s.token_row[t] * s.table_stride;
  const T* q_in = s.q + t * s.q_stride_t + g * G * s.q_stride_h;
  for (int64_t h = 0; h < G; ++h) {
    const T* q_row = q_in + h * s.q_stride_h;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) q0[h * D + i] = widen(q_row[i]);
  }
  for_each_key(s.page_size, pages, lo, pos, [&](int64_t j, int64_t slot) {
    const float* key = as_float(s.k + slot * s.slot_stride + g * s.kv_head_stride, D, scratch.row.data());
    for (int64_t h = 0; h < G; ++h) sc[h * n + j] = dot(q0 + h * D, key, D);
  });
  softmax_rows(s, sc, n, g, G, lo, pos);
  for_each_key(s.page_size, pages, lo, pos, [&](int64_t j, int64_t slot) {
    const float* value = as_float(s.v + slot * s.slot_stride + g * s.kv_head_stride, D, scratch.row.data());
    for (int64_t h = 0; h < G; ++h) axpy(o0 + h * D, sc[h * n + j], value, D);
  });
  T* out = s.out + (t * s.heads + g * G) * D;
  for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<T>(o0[i]);
}

// Rows fetched ahead of the one being read (a prefetch past a page run's end is harmless).
constexpr int64_t kPrefetchRows = 8;

// The same as attend_one with the group size and head size known at compile time (the common shapes):
// the queries and the output accumulators stay in registers, the loops over the head size unroll.
template <typename T, int G, int D>
void attend_fixed(const Step<T>& s, int64_t t, int64_t g, Scratch& scratch) {
  const int64_t pos = s.token_pos[t];
  const int64_t lo = first_key(s.window, pos);
  const int64_t n = pos - lo + 1;
  scratch.scores.resize(static_cast<size_t>(G * n));
  float* sc = scratch.scores.data();
  const int32_t* pages = s.block_table + s.token_row[t] * s.table_stride;
  const T* q_in = s.q + t * s.q_stride_t + g * G * s.q_stride_h;
  alignas(64) float q[G][D];
  for (int h = 0; h < G; ++h) {
    const T* q_row = q_in + h * s.q_stride_h;
#pragma omp simd
    for (int i = 0; i < D; ++i) q[h][i] = widen(q_row[i]);
  }
  const T* k_base = s.k + g * s.kv_head_stride;
  const T* v_base = s.v + g * s.kv_head_stride;
  constexpr int64_t kRowBytes = D * static_cast<int64_t>(sizeof(T));
  for_each_key(s.page_size, pages, lo, pos, [&](int64_t j, int64_t slot) {
    const T* kr = k_base + slot * s.slot_stride;
    // The cache is cold after the step's products streamed the weights: fetch ahead within the page
    // run (slots are consecutive there), and this key's value row for the third pass.
    const char* ahead = reinterpret_cast<const char*>(kr + kPrefetchRows * s.slot_stride);
    for (int64_t b = 0; b < kRowBytes; b += 64) __builtin_prefetch(ahead + b);
    const char* vr_now = reinterpret_cast<const char*>(v_base + slot * s.slot_stride);
    for (int64_t b = 0; b < kRowBytes; b += 64) __builtin_prefetch(vr_now + b);
    alignas(64) float k[D];
#pragma omp simd
    for (int i = 0; i < D; ++i) k[i] = widen(kr[i]);
    for (int h = 0; h < G; ++h) {
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int i = 0; i < D; ++i) acc += q[h][i] * k[i];
      sc[h * n + j] = acc;
    }
  });
  softmax_rows(s, sc, n, g, G, lo, pos);
  alignas(64) float o[G][D];
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < D; ++i) o[h][i] = 0.f;
  for_each_key(s.page_size, pages, lo, pos, [&](int64_t j, int64_t slot) {
    const T* vr = v_base + slot * s.slot_stride;
    alignas(64) float v[D];
#pragma omp simd
    for (int i = 0; i < D; ++i) v[i] = widen(vr[i]);
    for (int h = 0; h < G; ++h) {
      const float p = sc[h * n + j];
#pragma omp simd
      for (int i = 0; i < D; ++i) o[h][i] += p * v[i];
    }
  });
  T* out = s.out + (t * s.heads + g * G) * D;
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < D; ++i) out[h * D + i] = static_cast<T>(o[h][i]);
}

template <typename T>
using Attend = void (*)(const Step<T>&, int64_t, int64_t, Scratch&);

#if defined(__AVX512F__)
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

template <typename T, int G, int D>
void attend_vec(const Step<T>& s, int64_t t, int64_t g, Scratch& scratch) {
  const int64_t pos = s.token_pos[t];
  const int64_t lo = first_key(s.window, pos);
  const int64_t n = pos - lo + 1;
  scratch.scores.resize(static_cast<size_t>(G * n));
  float* sc = scratch.scores.data();
  const int32_t* pages = s.block_table + s.token_row[t] * s.table_stride;
  const T* q_in = s.q + t * s.q_stride_t + g * G * s.q_stride_h;
  QueryRegs<T, D> q[G];
  for (int h = 0; h < G; ++h) q[h].load(q_in + h * s.q_stride_h);
  const T* k_base = s.k + g * s.kv_head_stride;
  const T* v_base = s.v + g * s.kv_head_stride;
  constexpr int64_t kRowBytes = D * static_cast<int64_t>(sizeof(T));
  // the keys' slots first: rows are then fetched ahead across page boundaries too (pages are anywhere)
  scratch.slots.resize(static_cast<size_t>(n));
  int64_t* slots = scratch.slots.data();
  for_each_key(s.page_size, pages, lo, pos, [&](int64_t j, int64_t slot) { slots[j] = slot; });
  const auto fetch = [&](const T* base, int64_t j) {
    if (j < n) {
      const char* row = reinterpret_cast<const char*>(base + slots[j] * s.slot_stride);
      for (int64_t b = 0; b < kRowBytes; b += 64) __builtin_prefetch(row + b);
    }
  };
  alignas(64) float part[G][16][16];
  for (int64_t j = 0; j < n; ++j) {
    fetch(k_base, j + kAheadKeys);
    const T* kr = k_base + slots[j] * s.slot_stride;
    const int lane = static_cast<int>(j & 15);
    for (int h = 0; h < G; ++h) _mm512_store_ps(part[h][lane], q[h].dot(kr));
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
    const T* vr = v_base + slots[j] * s.slot_stride;
    __m512 v[D / 16];
    for (int c = 0; c < D / 16; ++c) v[c] = widen16(vr + 16 * c);
    for (int h = 0; h < G; ++h) {
      const __m512 p = _mm512_set1_ps(sc[h * n + j]);
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

// The vector kernel for this dtype, group and head size, or nullptr where it does not apply.
template <typename T, int D>
Attend<T> vec_for_group(int64_t group) {
  constexpr bool takes = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
  if constexpr (takes) {
    switch (group) {
      case 1: return attend_vec<T, 1, D>;
      case 2: return attend_vec<T, 2, D>;
      case 3: return attend_vec<T, 3, D>;
      case 4: return attend_vec<T, 4, D>;
      case 5: return attend_vec<T, 5, D>;
      case 6: return attend_vec<T, 6, D>;
      case 7: return attend_vec<T, 7, D>;
      case 8: return attend_vec<T, 8, D>;
      default: return nullptr;
    }
  }
  return nullptr;
}
#endif

template <typename T, int D>
Attend<T> fixed_for_group(int64_t group) {
#if defined(__AVX512F__)
  if (const Attend<T> vec = vec_for_group<T, D>(group)) return vec;
#endif
  switch (group) {
    case 1: return attend_fixed<T, 1, D>;
    case 2: return attend_fixed<T, 2, D>;
    case 3: return attend_fixed<T, 3, D>;
    case 4: return attend_fixed<T, 4, D>;
    case 5: return attend_fixed<T, 5, D>;
    case 6: return attend_fixed<T, 6, D>;
    case 7: return attend_fixed<T, 7, D>;
    case 8: return attend_fixed<T, 8, D>;
    default: return attend_one<T>;
  }
}

// The kernel of this step's shape: a fixed one for head sizes 64 / 128 and groups up to 8 (the AVX-512
// vector kernel where the CPU has it).
template <typename T>
Attend<T> attend_for(int64_t group, int64_t head_dim) {
  if (head_dim == 64) return fixed_for_group<T, 64>(group);
  if (head_dim == 128) return fixed_for_group<T, 128>(group);
  return attend_one<T>;
}

template <typename T>
void run_step(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
              const at::Tensor& token_row, const at::Tensor& token_pos, const at::Tensor& block_table,
              int64_t page_size, double scale, int64_t window, double softcap, const float* sinks,
              const float* slopes, at::Tensor& out) {
  Step<T> s;
  s.q = query.data_ptr<T>(); s.q_stride_t = query.stride(0); s.q_stride_h = query.stride(1);
  s.k = key_cache.data_ptr<T>(); s.v = value_cache.data_ptr<T>();
  s.slot_stride = key_cache.stride(0); s.kv_head_stride = key_cache.stride(1);
  s.token_row = token_row.data_ptr<int64_t>(); s.token_pos = token_pos.data_ptr<int64_t>();
  s.block_table = block_table.data_ptr<int32_t>(); s.table_stride = block_table.stride(0);
  s.sinks = sinks;
  s.slopes = slopes;
  s.out = out.data_ptr<T>();
  s.heads = query.size(1); s.kv_heads = key_cache.size(1); s.group = s.heads / s.kv_heads;
  s.head_dim = query.size(2); s.page_size = page_size; s.window = window;
  s.scale = static_cast<float>(scale); s.softcap = static_cast<float>(softcap);
  const int64_t tokens = query.size(0);
  const int64_t items = tokens * s.kv_heads;
  int64_t work = 0;  // keys read, summed over tokens: small steps stay on one thread (no barrier to wait on)
  for (int64_t t = 0; t < tokens; ++t) work += s.token_pos[t] - first_key(s.window, s.token_pos[t]) + 1;
  work *= s.heads * s.head_dim;
  const int64_t lanes = work < (1 << 18) ? 1 : std::min<int64_t>(at::get_num_threads(), items);
  const Attend<T> attend = attend_for<T>(s.group, s.head_dim);
  auto run_lanes = [&](int64_t begin, int64_t end) {
    Scratch scratch;
    // Round robin: items are sorted by length (longest decodes first), so lanes get even shares.
    for (int64_t lane = begin; lane < end; ++lane)
      for (int64_t i = lane; i < items; i += lanes) attend(s, i / s.kv_heads, i % s.kv_heads, scratch);
  };
  if (lanes <= 1) {
    run_lanes(0, 1);
  } else {
    at::parallel_for(0, lanes, 1, run_lanes);
  }
}

}  // namespace

// query [T, H, D] (last dim contiguous), key/value cache [S, Hkv, D] contiguous, out [T, H, D] contiguous,
// all of one dtype: float32, bfloat16 or float16.
void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& token_row, const at::Tensor& token_pos, const at::Tensor& block_table,
                     int64_t page_size, double scale, int64_t window, double softcap,
                     const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& slopes,
                     at::Tensor& out) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "query, caches and out must share one dtype");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.is_contiguous() && value_cache.is_contiguous(), "layout");
  TORCH_CHECK(out.is_contiguous() && block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "layout");
  TORCH_CHECK(token_row.scalar_type() == at::kLong && token_pos.scalar_type() == at::kLong, "int64 tokens");
  at::Tensor sink_values;
  if (sinks.has_value()) sink_values = sinks->to(at::kFloat).contiguous();
  const float* sink_data = sinks.has_value() ? sink_values.data_ptr<float>() : nullptr;
  at::Tensor slope_values;
  if (slopes.has_value()) slope_values = slopes->to(at::kFloat).contiguous();
  const float* slope_data = slopes.has_value() ? slope_values.data_ptr<float>() : nullptr;
  if (dtype == at::kFloat) {
    run_step<float>(query, key_cache, value_cache, token_row, token_pos, block_table, page_size, scale, window,
                    softcap, sink_data, slope_data, out);
  } else if (dtype == at::kBFloat16) {
    run_step<c10::BFloat16>(query, key_cache, value_cache, token_row, token_pos, block_table, page_size, scale,
                            window, softcap, sink_data, slope_data, out);
  } else if (dtype == at::kHalf) {
    run_step<c10::Half>(query, key_cache, value_cache, token_row, token_pos, block_table, page_size, scale,
                        window, softcap, sink_data, slope_data, out);
  } else {
    TORCH_CHECK(false, "float32, bfloat16 or float16 only, got ", dtype);
  }
}

"""

# The library's one source: the attention kernel, the decoder-layer ops (native_layer_source.py), the bindings.
SOURCE = (
    ATTENTION_SOURCE
    + LAYER_SOURCE
    + """
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention of query tokens over the paged KV cache");
"""
    + BINDINGS
    + "}\n"
)
