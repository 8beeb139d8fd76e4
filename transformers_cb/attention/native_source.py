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

// One (token, kv head): the `group` query heads that share this kv head.
void attend_one(const Step& s, int64_t t, int64_t g, std::vector<float>& scores) {
  const int64_t pos = s.token_pos[t];
  const int64_t lo = first_key(s, pos);
  const int64_t n = pos - lo + 1;
  const int64_t D = s.head_dim;
  scores.resize(static_cast<size_t>(s.group * n));
  const int32_t* pages = s.block_table + s.token_row[t] * s.table_stride;
  const float* q0 = s.q + t * s.q_stride_t + g * s.group * s.q_stride_h;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = lo + j;
    const int64_t slot = static_cast<int64_t>(pages[p / s.page_size]) * s.page_size + p % s.page_size;
    const float* key = s.k + slot * s.slot_stride + g * s.kv_head_stride;
    for (int64_t h = 0; h < s.group; ++h) {
      float x = dot(q0 + h * s.q_stride_h, key, D) * s.scale;
      if (s.softcap > 0.f) x = s.softcap * std::tanh(x / s.softcap);
      scores[h * n + j] = x;
    }
  }
  for (int64_t h = 0; h < s.group; ++h) {
    float* row = scores.data() + h * n;
    const float sink = s.sinks ? s.sinks[g * s.group + h] : -std::numeric_limits<float>::infinity();
    float m = sink;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
    float total = s.sinks ? std::exp(sink - m) : 0.f;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = std::exp(row[j] - m);
      total += row[j];
    }
    const float inv = 1.f / total;
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
  }
  float* o0 = s.out + (t * s.heads + g * s.group) * D;
  std::fill(o0, o0 + s.group * D, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = lo + j;
    const int64_t slot = static_cast<int64_t>(pages[p / s.page_size]) * s.page_size + p % s.page_size;
    const float* value = s.v + slot * s.slot_stride + g * s.kv_head_stride;
    for (int64_t h = 0; h < s.group; ++h) axpy(o0 + h * D, scores[h * n + j], value, D);
  }
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
