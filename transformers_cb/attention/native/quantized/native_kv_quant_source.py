"""C++ source of the int8 KV cache's write (built into the same library as the paged-attention kernel).

`write_int8_rows(rows [T, Hkv, D], slots [T], cache [S, Hkv, D] int8, scales [S, Hkv] float32)`: each
token's row of each head quantized as `memory.kv_quant.quantize` does it, bit for bit (absmax / 127 in float32,
scale 1 for a zero row, `x / scale` rounded half to even, clamped to [-127, 127]), written at its slot with its
scale. One call per layer and stream instead of the ~10 torch ops of `quantize` and its two scatters (a
decode step's write took about as long as its attention). float32, bfloat16 and float16 rows, their last
dimension contiguous; the cache and scales contiguous.
"""

KV_QUANT_SOURCE = r"""
namespace {

template <typename T>
void quantize_rows(const at::Tensor& rows, const at::Tensor& slots, at::Tensor& cache, at::Tensor& scales) {
  const T* x0 = rows.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  int8_t* q0 = cache.data_ptr<int8_t>();
  float* s0 = scales.data_ptr<float>();
  const int64_t tokens = rows.size(0), heads = rows.size(1), dim = rows.size(2);
  const int64_t stride_t = rows.stride(0), stride_h = rows.stride(1);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* x = x0 + t * stride_t + h * stride_h;
      float m = 0.f;
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < dim; ++i) m = std::max(m, std::fabs(widen(x[i])));
      float scale = m / 127.0f;
      if (!(scale > 0.f)) scale = 1.f;  // a zero row: scale 1, read back 0 (kv_quant.quantize)
      int8_t* q = q0 + (slot[t] * heads + h) * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float v = std::nearbyint(widen(x[i]) / scale);  // half to even, as torch.round
        q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
      }
      s0[slot[t] * heads + h] = scale;
    }
  }
}

}  // namespace

void write_int8_rows(const at::Tensor& rows, const at::Tensor& slots, at::Tensor& cache, at::Tensor& scales) {
  TORCH_CHECK(rows.dim() == 3 && rows.stride(2) == 1, "rows [T, Hkv, D], the last dimension contiguous");
  TORCH_CHECK(cache.scalar_type() == at::kChar && cache.is_contiguous() && cache.dim() == 3, "an int8 cache");
  TORCH_CHECK(cache.size(1) == rows.size(1) && cache.size(2) == rows.size(2), "rows and cache of one head shape");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "float32 scales");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == cache.size(0) && scales.size(1) == cache.size(1), "scales [S, Hkv]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == rows.size(0), "int64 slots");
  const auto dtype = rows.scalar_type();
  if (dtype == at::kFloat) {
    quantize_rows<float>(rows, slots, cache, scales);
  } else if (dtype == at::kBFloat16) {
    quantize_rows<c10::BFloat16>(rows, slots, cache, scales);
  } else if (dtype == at::kHalf) {
    quantize_rows<c10::Half>(rows, slots, cache, scales);
  } else {
    TORCH_CHECK(false, "float32, bfloat16 or float16 rows only, got ", dtype);
  }
}

"""

KV_QUANT_BINDINGS = r"""
  m.def("write_int8_rows", &write_int8_rows, "K or V rows quantized to int8 with their scales, at their slots");
"""
