"""C++ source of the native decoder-layer ops (built into the same library as the paged-attention kernel).

The ops between a decoder layer's products, each one pass over memory instead of transformers' chain of
eager ops, rounding where transformers' modules round, so that greedy outputs stay those of `generate()`:

- `rms_norm`: Llama's RMSNorm (`weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`) or Gemma's
  (`(x * rsqrt(...)) * (1 + weight)` in float32, then the dtype). The sum of squares is added in the order
  torch 2.x's CPU sum kernel adds a contiguous row (`SumKernel.cpp`: 8-lane vectors, four interleaved
  partial sums in a cascade, their lanes last), so the norm is bitwise equal to the module (x86 CPUs);
- `add_rms_norm`: the residual add (rounded to the dtype, as `residual + x` is) and the next norm in one pass;
- `silu_mul`: `silu(gate) * up` with SiLU rounded to the dtype before the product, SiLU computed as torch's
  kernel computes it (`x / (1 + exp(-x))`, torch's own vectorized exp, `Sleef_expf16_u10` on AVX-512 and
  `Sleef_expf8_u10` on AVX2, looked up in the loaded libtorch_cpu: bitwise equal where it is found, within an ulp otherwise);
- `rotary`: `q * cos + rotate_half(q) * sin` for q and k, each product and the sum rounded to the dtype
  (no fused multiply-add: these ops are compiled with `fp-contract=off`), bitwise equal.

Inputs may be strided views (a column slice of a fused product, heads transposed) as long as the last
dimension is contiguous; float32 and bfloat16 only (the Python side falls back to the module otherwise).
"""

LAYER_SOURCE = r"""
#include <dlfcn.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// Every product here is rounded before it is added, as torch's separate ops round it: no fused multiply-add
// (GCC contracts `a * b + c` by default), for the ops below only.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

// The rows of a tensor whose last dimension is contiguous: row r's offset from the other dimensions.
struct Rows {
  int64_t count = 1, width = 0;
  std::vector<int64_t> sizes, strides;
  explicit Rows(const at::Tensor& t) {
    TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, "the last dimension must be contiguous");
    width = t.size(-1);
    for (int64_t d = 0; d + 1 < t.dim(); ++d) {
      sizes.push_back(t.size(d));
      strides.push_back(t.stride(d));
      count *= t.size(d);
    }
  }
  int64_t offset(int64_t r) const {
    int64_t off = 0;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
      off += (r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return off;
  }
};

inline float widen_any(float x) { return x; }
inline float widen_any(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline T narrow_to(float x) { return static_cast<T>(x); }

// torch's `row_sum` / `multi_row_sum` (SumKernel.cpp) over `size` elements of L lanes each: four
// interleaved partial sums, a cascade of four levels of 2^4 steps, the leftovers added to the first.
template <int L>
struct Lanes {
  float v[L];
  void zero() { for (int i = 0; i < L; ++i) v[i] = 0.f; }
  void add(const Lanes& o) { for (int i = 0; i < L; ++i) v[i] = v[i] + o.v[i]; }
};

template <int L, typename Load>
Lanes<L> torch_row_sum(int64_t size, Load&& load) {
  constexpr int64_t ilp = 4, levels = 4, power = 4;
  const int64_t size_ilp = size / ilp;
  // level_power = max(4, CeilLog2(size_ilp) / 4): 4 for every row under 2^20 elements
  int64_t ceil_log2 = 1;
  if (size_ilp > 2) { ceil_log2 = 64 - __builtin_clzll(static_cast<uint64_t>(size_ilp - 1)); }
  const int64_t level_power = std::max<int64_t>(power, ceil_log2 / levels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  Lanes<L> acc[levels][ilp];
  for (auto& level : acc) for (auto& a : level) a.zero();
  int64_t i = 0;
  for (; i + level_step <= size_ilp;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < ilp; ++k) acc[0][k].add(load(i * ilp + k));
    for (int64_t j = 1; j < levels; ++j) {
      for (int64_t k = 0; k < ilp; ++k) { acc[j][k].add(acc[j - 1][k]); acc[j - 1][k].zero(); }
      const int64_t mask = level_mask << (j * level_power);
      if ((i & mask) != 0) break;
    }
  }
  for (; i < size_ilp; ++i)
    for (int64_t k = 0; k < ilp; ++k) acc[0][k].add(load(i * ilp + k));
  for (int64_t j = 1; j < levels; ++j)
    for (int64_t k = 0; k < ilp; ++k) acc[0][k].add(acc[j][k]);
  for (int64_t e = size_ilp * ilp; e < size; ++e) acc[0][0].add(load(e));
  for (int64_t k = 1; k < ilp; ++k) acc[0][0].add(acc[0][k]);
  return acc[0][0];
}

// The sum of x^2 over a float row in the order torch's sum of `x.pow(2)` adds it (contiguous inner
// reduction: vectors of 8 lanes, torch's reduction kernels being its AVX2 build on AVX-512 CPUs too; then
// the scalar tail, then the lanes; rows under 8: scalars).
inline float sum_of_squares(const float* x, int64_t n) {
  constexpr int L = 8;
  if (n < L) {
    Lanes<1> s = torch_row_sum<1>(n, [&](int64_t e) { Lanes<1> r; r.v[0] = x[e] * x[e]; return r; });
    return s.v[0];
  }
  const int64_t vectors = n / L;
  Lanes<L> s = torch_row_sum<L>(vectors, [&](int64_t e) {
    Lanes<L> r;
    const float* p = x + e * L;
    for (int i = 0; i < L; ++i) r.v[i] = p[i] * p[i];
    return r;
  });
  float total = 0.f;
  for (int64_t e = vectors * L; e < n; ++e) total += x[e] * x[e];
  for (int i = 0; i < L; ++i) total += s.v[i];
  return total;
}

// One row of RMSNorm into `out`: `x` widened into `buffer` (float32), the row's scale, then the weight.
template <typename T>
void norm_row(const float* xf, const T* weight, int64_t n, float eps, bool gemma, T* out) {
  const float variance = sum_of_squares(xf, n) / static_cast<float>(n);
  const float scale = 1.f / std::sqrt(variance + eps);
  if (gemma) {
    for (int64_t i = 0; i < n; ++i) {
      const float w = 1.f + widen_any(weight[i]);
      out[i] = narrow_to<T>((xf[i] * scale) * w);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float h = widen_any(narrow_to<T>(xf[i] * scale));
      out[i] = narrow_to<T>(widen_any(weight[i]) * h);
    }
  }
}

template <typename T>
void rms_norm_typed(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma, at::Tensor& out) {
  const Rows rows(x);
  const int64_t n = rows.width;
  const T* xd = x.data_ptr<T>();
  const T* wd = weight.data_ptr<T>();
  T* od = out.data_ptr<T>();
  at::parallel_for(0, rows.count, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
    std::vector<float> buffer(static_cast<size_t>(n));
    for (int64_t r = b; r < e; ++r) {
      const T* xr = xd + rows.offset(r);
      for (int64_t i = 0; i < n; ++i) buffer[i] = widen_any(xr[i]);
      norm_row<T>(buffer.data(), wd, n, static_cast<float>(eps), gemma, od + r * n);
    }
  });
}

template <typename T>
void add_rms_norm_typed(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps,
                        bool gemma, at::Tensor& sum, at::Tensor& out) {
  const Rows res_rows(residual), x_rows(x);
  const int64_t n = x_rows.width;
  const T* rd = residual.data_ptr<T>();
  const T* xd = x.data_ptr<T>();
  const T* wd = weight.data_ptr<T>();
  T* sd = sum.data_ptr<T>();
  T* od = out.data_ptr<T>();
  at::parallel_for(0, x_rows.count, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
    std::vector<float> buffer(static_cast<size_t>(n));
    for (int64_t r = b; r < e; ++r) {
      const T* rr = rd + res_rows.offset(r);
      const T* xr = xd + x_rows.offset(r);
      T* sr = sd + r * n;
      for (int64_t i = 0; i < n; ++i) {
        sr[i] = narrow_to<T>(widen_any(rr[i]) + widen_any(xr[i]));
        buffer[i] = widen_any(sr[i]);
      }
      norm_row<T>(buffer.data(), wd, n, static_cast<float>(eps), gemma, od + r * n);
    }
  });
}

// torch's vectorized exp as its SiLU kernel calls it on this CPU (AVX-512: `Sleef_expf16_u10`, AVX2:
// `Sleef_expf8_u10`, both in libtorch_cpu), found at run time: a torch build without it leaves the scalar
// `std::exp` (within an ulp of it).
#if defined(__AVX512F__)
using VecF = __m512;
constexpr int64_t kVecLanes = 16;
constexpr const char* kSleefExpName = "Sleef_expf16_u10";
inline VecF vec_load(const float* p) { return _mm512_loadu_ps(p); }
inline void vec_store(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline VecF vec_silu(VecF v, VecF e) { return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e)); }
inline VecF vec_neg(VecF v) { return _mm512_xor_ps(_mm512_set1_ps(-0.f), v); }
#elif defined(__AVX2__)
using VecF = __m256;
constexpr int64_t kVecLanes = 8;
constexpr const char* kSleefExpName = "Sleef_expf8_u10";
inline VecF vec_load(const float* p) { return _mm256_loadu_ps(p); }
inline void vec_store(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline VecF vec_silu(VecF v, VecF e) { return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), e)); }
inline VecF vec_neg(VecF v) { return _mm256_xor_ps(_mm256_set1_ps(-0.f), v); }
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
using SleefExp = VecF (*)(VecF);
SleefExp sleef_exp() {
  static const SleefExp fn = []() -> SleefExp {
    void* handle = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    void* symbol = dlsym(handle != nullptr ? handle : RTLD_DEFAULT, kSleefExpName);
    return reinterpret_cast<SleefExp>(symbol);
  }();
  return fn;
}
#endif

// silu(x) into `out` for n floats the way torch's kernel does: `x / (1 + exp(-x))`, two vectors at a time
// with the vector exp (torch's vectorized loop), the rest with std::exp (torch's scalar lambda).
inline void silu_floats(const float* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  const SleefExp vexp = sleef_exp();
  if (vexp != nullptr) {
    for (; i + 2 * kVecLanes <= n; i += 2 * kVecLanes) {
      for (int64_t half = 0; half < 2; ++half) {
        const VecF v = vec_load(x + i + half * kVecLanes);
        vec_store(out + i + half * kVecLanes, vec_silu(v, vexp(vec_neg(v))));
      }
    }
  }
#endif
  for (; i < n; ++i) out[i] = x[i] / (1.f + std::exp(-x[i]));
}

// silu(gate[i]) rounded to T, times up[i], rounded: n elements from the three row starts.
template <typename T>
void silu_mul_span(const T* g, const T* u, T* o, int64_t n, std::vector<float>& gf, std::vector<float>& sf) {
  gf.resize(static_cast<size_t>(n));
  sf.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) gf[i] = widen_any(g[i]);
  silu_floats(gf.data(), sf.data(), n);
  for (int64_t i = 0; i < n; ++i) o[i] = narrow_to<T>(widen_any(narrow_to<T>(sf[i])) * widen_any(u[i]));
}

template <typename T>
void silu_mul_typed(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const T* gd = gate.data_ptr<T>();
  const T* ud = up.data_ptr<T>();
  T* od = out.data_ptr<T>();
  if (gate.is_contiguous() && up.is_contiguous()) {
    // torch runs SiLU over a contiguous tensor as one flat range split between threads at its grain: the
    // same spans here, so the same elements take the vector exp and the scalar tail.
    at::parallel_for(0, gate.numel(), at::internal::GRAIN_SIZE, [&](int64_t b, int64_t e) {
      std::vector<float> gf, sf;
      silu_mul_span<T>(gd + b, ud + b, od + b, e - b, gf, sf);
    });
    return;
  }
  const Rows g_rows(gate), u_rows(up);
  const int64_t n = g_rows.width;
  at::parallel_for(0, g_rows.count, std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)), [&](int64_t b, int64_t e) {
    std::vector<float> gf, sf;
    for (int64_t r = b; r < e; ++r) silu_mul_span<T>(gd + g_rows.offset(r), ud + u_rows.offset(r), od + r * n, n, gf, sf);
  });
}

// q * cos + rotate_half(q) * sin, every product and the sum rounded to T: no fused multiply-add.
template <typename T>
void rotate_row(const T* x, const T* cos, const T* sin, int64_t d, T* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float xc = widen_any(narrow_to<T>(widen_any(x[i]) * widen_any(cos[i])));
    const float rot = i < half ? -widen_any(x[i + half]) : widen_any(x[i - half]);
    const float rs = widen_any(narrow_to<T>(rot * widen_any(sin[i])));
    out[i] = narrow_to<T>(xc + rs);
  }
}

// x [B, H, S, D] (last dim contiguous), cos/sin [B, S, D]: out [B, H, S, D] with any strides (last 1).
template <typename T>
void rotary_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3);
  const T* xd = x.data_ptr<T>();
  const T* cd = cos.data_ptr<T>();
  const T* sd = sin.data_ptr<T>();
  T* od = out.data_ptr<T>();
  at::parallel_for(0, B * S, std::max<int64_t>(1, 8192 / std::max<int64_t>(H * D, 1)), [&](int64_t b0, int64_t e0) {
    for (int64_t bs = b0; bs < e0; ++bs) {
      const int64_t b = bs / S, s = bs % S;
      const T* c = cd + b * cos.stride(0) + s * cos.stride(1);
      const T* si = sd + b * sin.stride(0) + s * sin.stride(1);
      for (int64_t h = 0; h < H; ++h) {
        rotate_row<T>(xd + b * x.stride(0) + h * x.stride(1) + s * x.stride(2), c, si, D,
                      od + b * out.stride(0) + h * out.stride(1) + s * out.stride(2));
      }
    }
  });
}

void check_float_or_bf16(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
}

}  // namespace

// x [..., N] (last dim contiguous), weight [N] contiguous, out [..., N] contiguous; one dtype.
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma, at::Tensor& out) {
  check_float_or_bf16(x);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(), "one dtype");
  TORCH_CHECK(weight.is_contiguous() && out.is_contiguous() && weight.numel() == x.size(-1), "layout");
  if (x.scalar_type() == at::kFloat) rms_norm_typed<float>(x, weight, eps, gemma, out);
  else rms_norm_typed<c10::BFloat16>(x, weight, eps, gemma, out);
}

// sum = residual + x (rounded), out = rms_norm(sum); sum and out contiguous.
void add_rms_norm(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma,
                  at::Tensor& sum, at::Tensor& out) {
  check_float_or_bf16(x);
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "one dtype");
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.numel() == x.size(-1), "shapes");
  TORCH_CHECK(weight.is_contiguous() && sum.is_contiguous() && out.is_contiguous(), "layout");
  if (x.scalar_type() == at::kFloat) add_rms_norm_typed<float>(residual, x, weight, eps, gemma, sum, out);
  else add_rms_norm_typed<c10::BFloat16>(residual, x, weight, eps, gemma, sum, out);
}

// out = silu(gate) * up; gate / up [..., N] (last dim contiguous), out contiguous.
void silu_mul(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  check_float_or_bf16(gate);
  TORCH_CHECK(up.scalar_type() == gate.scalar_type() && out.scalar_type() == gate.scalar_type(), "one dtype");
  TORCH_CHECK(up.sizes() == gate.sizes() && out.is_contiguous(), "shapes");
  if (gate.scalar_type() == at::kFloat) silu_mul_typed<float>(gate, up, out);
  else silu_mul_typed<c10::BFloat16>(gate, up, out);
}

// out = x * cos + rotate_half(x) * sin for x [B, H, S, D], cos / sin [B, S, D].
void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  check_float_or_bf16(x);
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "one dtype");
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 3 && sin.dim() == 3 && out.dim() == 4, "shapes");
  TORCH_CHECK(x.stride(3) == 1 && cos.stride(2) == 1 && sin.stride(2) == 1 && out.stride(3) == 1, "layout");
  TORCH_CHECK(x.size(3) % 2 == 0 && cos.size(2) == x.size(3) && sin.size(2) == x.size(3), "head size");
  if (x.scalar_type() == at::kFloat) rotary_one<float>(x, cos, sin, out);
  else rotary_one<c10::BFloat16>(x, cos, sin, out);
}

#pragma GCC pop_options
"""

BINDINGS = r"""
  m.def("rms_norm", &rms_norm, "RMSNorm (Llama's or Gemma's form) of the last dimension");
  m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm of the sum");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rotary", &rotary, "rotary embedding: x * cos + rotate_half(x) * sin");
"""
