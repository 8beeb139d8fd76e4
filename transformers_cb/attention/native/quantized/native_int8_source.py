"""C++ source of the native int8 weight-only product (built into the same library as the paged-attention kernel).

`int8_matmul(x [R, K], q int8 [N, K], scale float32 [N])`: `y [R, N] = (x @ q.T) * scale`, rounded where
torchao's `Int8Tensor` weight-only product (per-row or per-tensor scales) rounds on the CPU:

    m = torch.mm(x, q.T.to(x.dtype))      # sums in float32; a bfloat16 x: the sum rounded to bfloat16
    y = m * scale.to(m.dtype)             # one more rounding (in x's dtype)

Here each column's sum runs in float32 (every x * q product is exact in float32: a bfloat16 or float32 x
times an integer of 8 bits), then the sums are rounded to x's dtype and multiplied by the scale rounded to
x's dtype, by the same torch ops torchao calls (so those two roundings are torchao's own). The only difference from
torchao's result is the order of the float32 sums (torch's `mm` blocks them its own way), as the packed
oneDNN products differ from MKL's. The bias is added by the caller (torchao adds it after the scale, a
separate rounding). Parallel over output columns; rows in tiles of up to 8, so a column's int8 row is
widened once per tile and stays in L1.
"""

INT8_SOURCE = r"""
namespace {

#if defined(__AVX512F__)
// Columns [n0, n1) for rows [r0, r0 + RT): each 16 int8 weights widened to float32 once, every row of the
// tile multiplied by them; K's tail past the last 16 in scalar sums added to the lanes' total.
template <int RT>
void int8_column_tile(const float* x, int64_t K, const int8_t* q, float* y, int64_t N, int64_t r0, int64_t n0,
                      int64_t n1) {
  const int64_t k16 = K / 16 * 16;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qrow = q + n * K;
    __m512 acc[RT];
    for (int i = 0; i < RT; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k16; k += 16) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + k));
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
      for (int i = 0; i < RT; ++i) acc[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + (r0 + i) * K + k), acc[i]);
    }
    for (int i = 0; i < RT; ++i) {
      float total = _mm512_reduce_add_ps(acc[i]);
      const float* xr = x + (r0 + i) * K;
      for (int64_t k = k16; k < K; ++k) total += xr[k] * static_cast<float>(qrow[k]);
      y[(r0 + i) * N + n] = total;
    }
  }
}

void int8_column_rows(const float* x, int64_t R, int64_t K, const int8_t* q, float* y, int64_t N, int64_t n0,
                      int64_t n1) {
  int64_t r = 0;
  for (; r + 8 <= R; r += 8) int8_column_tile<8>(x, K, q, y, N, r, n0, n1);
  switch (R - r) {
    case 7: int8_column_tile<7>(x, K, q, y, N, r, n0, n1); break;
    case 6: int8_column_tile<6>(x, K, q, y, N, r, n0, n1); break;
    case 5: int8_column_tile<5>(x, K, q, y, N, r, n0, n1); break;
    case 4: int8_column_tile<4>(x, K, q, y, N, r, n0, n1); break;
    case 3: int8_column_tile<3>(x, K, q, y, N, r, n0, n1); break;
    case 2: int8_column_tile<2>(x, K, q, y, N, r, n0, n1); break;
    case 1: int8_column_tile<1>(x, K, q, y, N, r, n0, n1); break;
    default: break;
  }
}
#else
// Portable path: plain float32 sums per row and column.
void int8_column_rows(const float* x, int64_t R, int64_t K, const int8_t* q, float* y, int64_t N, int64_t n0,
                      int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qrow = q + n * K;
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + r * K;
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * static_cast<float>(qrow[k]);
      y[r * N + n] = acc;
    }
  }
}
#endif

constexpr int64_t kInt8ColumnGrain = 16;

}  // namespace

// y [R, N] = (x [R, K] @ q.T) * scale, q int8 [N, K], scale float32 [N]; y in x's dtype.
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "q: contiguous int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x [R, ", K, "] expected, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == N && scale.is_contiguous(),
              "scale: contiguous float32 [N]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t R = x.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // a bfloat16 x widened: exact
  at::Tensor sums = at::empty({R, N}, xf.options());
  if (R > 0 && N > 0) {
    const float* xp = xf.data_ptr<float>();
    const int8_t* qp = q.data_ptr<int8_t>();
    float* yp = sums.data_ptr<float>();
    at::parallel_for(0, N, kInt8ColumnGrain, [&](int64_t begin, int64_t end) {
      for (int64_t n0 = begin; n0 < end; n0 += kInt8ColumnGrain)
        int8_column_rows(xp, R, K, qp, yp, N, n0, std::min(end, n0 + kInt8ColumnGrain));
    });
  }
  // torchao's rounding points: the sum in x's dtype, then the product with the scale in x's dtype.
  const at::Tensor rounded = bf16 ? sums.to(at::kBFloat16) : sums;
  return rounded * scale.to(rounded.scalar_type());
}
"""

INT8_BINDINGS = r"""
  m.def("int8_matmul", &int8_matmul, "(x @ q.T) * scale with q int8 [N, K]: torchao's weight-only rounding");
"""
