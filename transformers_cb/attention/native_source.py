"""C++ source of the native CPU paged-attention kernel (built by `native.py` with `torch.utils.cpp_extension`).

One call attends every query token of a step that the kernel takes (decodes and short prefill
chunks) over the paged cache in place: no gathered K/V copies, no padding, one op per layer
whatever the number of requests. Token `t` is at logical position `token_pos[t]` of block-table
row `token_row[t]` and sees its row's keys `[lo, token_pos[t]]` (`lo` = 0, or the window start):
causal by construction, windowed when `window > 0`.
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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

struct Step {
  const float* q; int64_t q_stride_t, q_stride_h;
  const float* k; const float* v; int64_t slot_stride, kv_head_stride;
  const int64_t* token_row; const int64_t* token_pos;
  const int32_t* block_table; int64_t table_stride;
  const float* sinks;
  float* out;
  int64_t heads, kv_heads, group, head_dim, page_size, window;
  float scale, softcap;
};

inline int64_t first_key(const Step& s, int64_t pos) {
  return s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
}

// Calls f(j, slot) for the keys lo..pos in order (j counts from 0), one page run at a time: slots
// are consecutive within a page, so the page table is read once per page, not once per key.
template <typename F>
inline void for_each_key(const Step& s, const int32_t* pages, int64_t lo, int64_t pos, F&& f) {
  int64_t j = 0;
  for (int64_t page = lo / s.page_size; page <= pos / s.page_size; ++page) {
    const int64_t start = std::max(lo, page * s.page_size);
    const int64_t end = std::min(pos + 1, (page + 1) * s.page_size);
    int64_t slot = static_cast<int64_t>(pages[page]) * s.page_size + (start - page * s.page_size);
    for (int64_t p = start; p < end; ++p, ++j, ++slot) f(j, slot);
  }
}

// One (token, kv head): the `group` query heads that share this kv head.
void attend_one(const Step& s, int64_t t, int64_t g, std::vector<float>& scores) {
  const int64_t pos = s.token_pos[t];
  const int64_t lo = first_key(s, pos);
  const int64_t n = pos - lo + 1;
  const int64_t D = s.head_dim, G = s.group;
  scores.resize(static_cast<size_t>(G * n));
  float* sc = scores.data();
  const int32_t* pages = s.block_table + s.token_row[t] * s.table_stride;
  const float* q0 = s.q + t * s.q_stride_t + g * G * s.q_stride_h;
  for_each_key(s, pages, lo, pos, [&](int64_t j, int64_t slot) {
    const float* key = s.k + slot * s.slot_stride + g * s.kv_head_stride;
    for (int64_t h = 0; h < G; ++h) sc[h * n + j] = dot(q0 + h * s.q_stride_h, key, D);
  });
  for (int64_t h = 0; h < G; ++h) {
    float* row = sc + h * n;
    const float scale = s.scale;
    if (s.softcap > 0.f) {
      for (int64_t j = 0; j < n; ++j) row[j] = s.softcap * std::tanh(row[j] * scale / s.softcap);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) row[j] *= scale;
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
  float* o0 = s.out + (t * s.heads + g * G) * D;
  std::fill(o0, o0 + G * D, 0.f);
  for_each_key(s, pages, lo, pos, [&](int64_t j, int64_t slot) {
    const float* value = s.v + slot * s.slot_stride + g * s.kv_head_stride;
    for (int64_t h = 0; h < G; ++h) axpy(o0 + h * D, sc[h * n + j], value, D);
  });
}

}  // namespace

// query [T, H, D] (last dim contiguous), key/value cache [S, Hkv, D] contiguous, out [T, H, D] contiguous.
void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& token_row, const at::Tensor& token_pos, const at::Tensor& block_table,
                     int64_t page_size, double scale, int64_t window, double softcap,
                     const c10::optional<at::Tensor>& sinks, at::Tensor& out) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && key_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.is_contiguous() && value_cache.is_contiguous(), "layout");
  TORCH_CHECK(out.is_contiguous() && block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "layout");
  TORCH_CHECK(token_row.scalar_type() == at::kLong && token_pos.scalar_type() == at::kLong, "int64 tokens");
  Step s;
  s.q = query.data_ptr<float>(); s.q_stride_t = query.stride(0); s.q_stride_h = query.stride(1);
  s.k = key_cache.data_ptr<float>(); s.v = value_cache.data_ptr<float>();
  s.slot_stride = key_cache.stride(0); s.kv_head_stride = key_cache.stride(1);
  s.token_row = token_row.data_ptr<int64_t>(); s.token_pos = token_pos.data_ptr<int64_t>();
  s.block_table = block_table.data_ptr<int32_t>(); s.table_stride = block_table.stride(0);
  at::Tensor sink_values;
  if (sinks.has_value()) sink_values = sinks->to(at::kFloat).contiguous();
  s.sinks = sinks.has_value() ? sink_values.data_ptr<float>() : nullptr;
  s.out = out.data_ptr<float>();
  s.heads = query.size(1); s.kv_heads = key_cache.size(1); s.group = s.heads / s.kv_heads;
  s.head_dim = query.size(2); s.page_size = page_size; s.window = window;
  s.scale = static_cast<float>(scale); s.softcap = static_cast<float>(softcap);
  const int64_t tokens = query.size(0);
  const int64_t items = tokens * s.kv_heads;
  int64_t work = 0;  // keys read, summed over tokens: small steps stay on one thread (no barrier to wait on)
  for (int64_t t = 0; t < tokens; ++t) work += s.token_pos[t] - first_key(s, s.token_pos[t]) + 1;
  work *= s.heads * s.head_dim;
  const int64_t lanes = work < (1 << 18) ? 1 : std::min<int64_t>(at::get_num_threads(), items);
  auto run_lanes = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    // Round robin: items are sorted by length (longest decodes first), so lanes get even shares.
    for (int64_t lane = begin; lane < end; ++lane)
      for (int64_t i = lane; i < items; i += lanes) attend_one(s, i / s.kv_heads, i % s.kv_heads, scores);
  };
  if (lanes <= 1) {
    run_lanes(0, 1);
  } else {
    at::parallel_for(0, lanes, 1, run_lanes);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention of query tokens over the paged KV cache");
}
"""
