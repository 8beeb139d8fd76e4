"""C++ source of the native CPU library (built by `kernel.py` with `torch.utils.cpp_extension`): the paged-attention
kernel here, the decoder-layer ops in native_layer_source.py.

One call attends every query token of a step that the kernel takes (decodes and short prefill
chunks) over the paged cache in place: no gathered K/V copies, no padding, one op per layer
whatever the number of requests. Token `t` is at logical position `token_pos[t]` of block-table
row `token_row[t]` and sees its row's keys `[lo, token_pos[t]]` (`lo` = 0, or the window start):
causal by construction, windowed when `window > 0`, chunked (`lo` = the start of the query's attention
chunk of `-window` tokens) when `window < 0`.

On AVX-512 CPUs (float32, bfloat16) head sizes 64 and 128 with up to 8 query heads per KV head run
`attend_vec`: scores 16 keys at a time with their lane sums done together, a vectorized softmax, values
accumulated in registers, every row widened to float32 as it is read; on CPUs with AVX2 and FMA alone the
same kernel 8 lanes wide (native_vec8_source.py). Elsewhere `attend_fixed` / `attend_one` (portable C++
the compiler vectorizes).

An int8 cache (`kv_cache_dtype="int8"`, memory/kv_quant.py) is read in place by the same kernels
instantiated for int8 rows (`KV = int8_t`): `attend_vec` widens 16 int8 values at a time and applies each
row's float32 scale to its scores (keys) or to its probability (values); `attend_one` dequantizes a row
into float (`kv_row`) elsewhere. The query and the output keep the model's dtype.
"""

from .native_argmax_source import ARGMAX_BINDINGS, ARGMAX_SOURCE
from .native_decoder_source import DECODER_BINDINGS, DECODER_SOURCE
from .native_dispatch_source import DISPATCH_SOURCE
from .native_layer_source import BINDINGS, LAYER_SOURCE
from .native_rows_source import ROWS_BINDINGS, ROWS_SOURCE
from .native_vec8_source import VEC8_SOURCE
from .native_vec_source import VEC_SOURCE
from .quantized.native_int8_source import INT8_BINDINGS, INT8_SOURCE
from .quantized.native_kv_quant_source import KV_QUANT_BINDINGS, KV_QUANT_SOURCE
from .quantized.native_lanes_source import LANES_BINDINGS, LANES_SOURCE
from .quantized.native_quant_source import QUANT_BINDINGS, QUANT_SOURCE

ATTENTION_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <numeric>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {

// Subnormal floats flushed to zero (inputs and results) on this thread while the guard lives. A sharp
// attention row (a real model's sink token) puts most probabilities below 2^-126, where every
// multiply-add on them takes a microcode assist: SmolLM2's decode attention ran 2x slower on such rows
// (4x on sharper ones). A row's largest probability is at least 1/n, so a subnormal one is far below the
// last bit of the sums it joins: flushing it moves an output only where the output itself is subnormal.
struct FlushSubnormals {
#if defined(__SSE__)
  unsigned saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040u); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushSubnormals() { _mm_setcsr(saved); }
#endif
};

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
  // An int8 cache: its rows (k and v unused then) and their float32 scales [slots, kv heads].
  const int8_t* k8; const int8_t* v8; const float* k_scale; const float* v_scale; int64_t scale_slot_stride;
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

// The key (`key`) or value rows of the cache: the model's dtype (KV = T) or int8 (KV = int8_t).
template <typename KV, typename T>
inline const KV* kv_data(const Step<T>& s, bool key) {
  if constexpr (std::is_same_v<KV, int8_t>) {
    return key ? s.k8 : s.v8;
  } else {
    return key ? s.k : s.v;
  }
}

// The scale of an int8 row (key or value) of kv head g at `slot`.
template <typename T>
inline float row_scale(const Step<T>& s, bool key, int64_t slot, int64_t g) {
  return (key ? s.k_scale : s.v_scale)[slot * s.scale_slot_stride + g];
}

// Kv head g's key or value row at `slot` as float: widened, or an int8 row dequantized (q * scale).
template <typename KV, typename T>
inline const float* kv_row(const Step<T>& s, bool key, int64_t slot, int64_t g, int64_t n, float* buffer) {
  const KV* row = kv_data<KV>(s, key) + slot * s.slot_stride + g * s.kv_head_stride;
  if constexpr (std::is_same_v<KV, int8_t>) {
    const float scale = row_scale(s, key, slot, g);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(row[i]) * scale;
    return buffer;
  } else {
    return as_float(row, n, buffer);
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
template <typename T, typename KV = T>
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
    const float* key = kv_row<KV>(s, true, slot, g, D, scratch.row.data());
    for (int64_t h = 0; h < G; ++h) sc[h * n + j] = dot(q0 + h * D, key, D);
  });
  softmax_rows(s, sc, n, g, G, lo, pos);
  for_each_key(s.page_size, pages, lo, pos, [&](int64_t j, int64_t slot) {
    const float* value = kv_row<KV>(s, false, slot, g, D, scratch.row.data());
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

// A tile of `count` tokens from token t0 (one row, consecutive positions) and kv head g (native_vec_source.py).
template <typename T>
using AttendTile = void (*)(const Step<T>&, int64_t, int64_t, int64_t, Scratch&);
constexpr int64_t kTileTokens = 16;

"""

# The library's one source: the attention kernel, its AVX-512 loops (native_vec_source.py) between the
# portable kernels and the dispatch that picks one (native_dispatch_source.py), the decoder-layer ops (native_layer_source.py), the greedy
# argmax (native_argmax_source.py), the quantized products (native_quant_source.py; over lanes: native_lanes_source.py), torchao's int8
# weight-only product (native_int8_source.py), the small-row bfloat16 product (native_rows_source.py), the decoder-layer step (native_decoder_source.py), the
# bindings.
SOURCE = (
    ATTENTION_SOURCE
    + VEC_SOURCE
    + VEC8_SOURCE
    + DISPATCH_SOURCE
    + KV_QUANT_SOURCE
    + LAYER_SOURCE
    + ARGMAX_SOURCE
    + QUANT_SOURCE
    + LANES_SOURCE
    + INT8_SOURCE
    + ROWS_SOURCE
    + DECODER_SOURCE
    + """
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention of query tokens over the paged KV cache");
  m.def("vector_kernels", &vector_kernels, "whether the vector attention kernels (AVX-512 or AVX2; and their query tiles) are built");
  m.def("vector_lanes", &vector_lanes, "the vector attention kernels' width: 16 (AVX-512), 8 (AVX2) or 0");
"""
    + BINDINGS
    + ARGMAX_BINDINGS
    + KV_QUANT_BINDINGS
    + QUANT_BINDINGS
    + LANES_BINDINGS
    + INT8_BINDINGS
    + ROWS_BINDINGS
    + DECODER_BINDINGS
    + "}\n"
)
