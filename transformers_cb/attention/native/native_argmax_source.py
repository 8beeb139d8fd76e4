"""C++ source of the native greedy argmax (built into the same library as the paged-attention kernel).

`best_rows(scores [R, V], out int64 [R])`: each row's index of its largest value, as `scores.max(dim=-1)
.indices` gives it on CPU: the first of equal values (-0.0 equals 0.0), and a row holding a NaN gives its
first NaN. torch reduces a bf16 row with its index at ~1 ns an element on these CPUs (16 x 32000 bf16 rows:
~480 us, 2 threads, every greedy step); here one vector pass finds the row's largest value and a second
finds its first index (~20x faster), 16 lanes wide with AVX-512 and 8 with AVX2 + FMA (the AVX2 kernels' build; a scalar loop before: ~2 ms
a step for 64 float32 rows of 32000 on AMD Zen 3). float32 and bfloat16 rows, the last dimension contiguous.
"""

ARGMAX_SOURCE = r"""
namespace {

template <typename T>
inline float widen_score(T x) { return static_cast<float>(x); }

// The first NaN from `from` on, or -1.
template <typename T>
int64_t first_nan(const T* x, int64_t from, int64_t n) {
  for (int64_t i = from; i < n; ++i) {
    const float v = widen_score(x[i]);
    if (v != v) return i;
  }
  return -1;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#endif

template <typename T>
int64_t best_index(const T* x, int64_t n) {
  if (n <= 0) return 0;
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 top0 = _mm512_set1_ps(best), top1 = top0;
  __mmask16 nan = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = load16(x + i), b = load16(x + i + 16);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    top0 = _mm512_max_ps(top0, a);
    top1 = _mm512_max_ps(top1, b);
  }
  if (nan) return first_nan(x, 0, i);
  best = _mm512_reduce_max_ps(_mm512_max_ps(top0, top1));
#elif defined(TCB_VECTOR_KERNELS)  // the AVX2 kernels' build: their widen8 and max_of_8 (native_vec8_source.py)
  __m256 top0 = _mm256_set1_ps(best), top1 = top0;
  __m256 nan = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m256 a = widen8(x + i), b = widen8(x + i + 8);
    nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
    top0 = _mm256_max_ps(top0, a);
    top1 = _mm256_max_ps(top1, b);
  }
  if (_mm256_movemask_ps(nan)) return first_nan(x, 0, i);
  best = max_of_8(_mm256_max_ps(top0, top1));
#endif
  for (int64_t j = i; j < n; ++j) {
    const float v = widen_score(x[j]);
    if (v != v) return j;
    if (v > best) best = v;
  }
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512 wanted = _mm512_set1_ps(best);
  for (; k + 16 <= n; k += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load16(x + k), wanted, _CMP_EQ_OQ);
    if (hit) return k + __builtin_ctz(static_cast<unsigned>(hit));
  }
#elif defined(TCB_VECTOR_KERNELS)
  const __m256 wanted = _mm256_set1_ps(best);
  for (; k + 8 <= n; k += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(widen8(x + k), wanted, _CMP_EQ_OQ));
    if (hit) return k + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; k < n; ++k)
    if (widen_score(x[k]) == best) return k;
  return 0;  // not reached: `best` is one of the row's values
}

template <typename T>
void best_rows_typed(const at::Tensor& scores, at::Tensor& out) {
  const int64_t rows = scores.size(0), width = scores.size(1), stride = scores.stride(0);
  const T* base = scores.data_ptr<T>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) result[r] = best_index(base + r * stride, width);
  });
}

}  // namespace

// out[r] = scores[r].max(-1).indices for scores [R, V] (float32 or bfloat16, rows contiguous), out int64 [R].
void best_rows(const at::Tensor& scores, at::Tensor& out) {
  TORCH_CHECK(scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(scores.dim() == 2 && scores.stride(1) == 1, "scores [R, V] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == scores.size(0) && out.is_contiguous(),
              "out int64 [R]");
  if (scores.scalar_type() == at::kFloat) best_rows_typed<float>(scores, out);
  else best_rows_typed<c10::BFloat16>(scores, out);
}
"""

ARGMAX_BINDINGS = r"""
  m.def("best_rows", &best_rows, "each row's first index of its largest value (NaN first), as max(-1).indices");
"""
