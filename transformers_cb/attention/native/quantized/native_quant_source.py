"""C++ source of the native quantized products (built into the same library as the paged-attention kernel).

`quant_matmul(x [R, K], blocks uint8 [N, K / 32 * block bytes], qtype)`: `y [R, N] = x @ W.T` with W held in
GGUF blocks of 32 weights along K (llama.cpp's layouts, as the `gguf` package reads them):

- Q8_0 (qtype 8, 34 bytes): fp16 scale d, 32 int8 q; w = d * q;
- Q4_0 (qtype 2, 18 bytes): fp16 d, 16 bytes of nibbles (weight j < 16 the low nibble of byte j, weight
  j + 16 its high nibble); w = d * (q - 8);
- Q4_1 (qtype 3, 20 bytes): fp16 d, fp16 min m, the nibbles as Q4_0; w = d * q + m.

Each block is dequantized in registers to exactly the float32 values `gguf.quants.dequantize` gives (d * q is
exact in float32, so one fused multiply-add rounds as numpy's multiply-then-add does), then multiplied in
float32: the product differs from `x @ dequantize(W).T` only by the order of the float32 sums. A bfloat16 x
reads weights rounded to bfloat16 first (what a bfloat16 model loaded from the GGUF holds) and its output
is rounded to bfloat16. Parallel over output columns, 16 at a time; rows in tiles of up to 16 (bfloat16 x
read by `vdpbf16ps`) or 8, so a column's blocks are dequantized once per tile and stay in L1, with up to 4
columns in flight for few rows (independent chains); the 16 columns' partial sums are lane-summed together.
A bfloat16 x's 4-bit blocks come by table: a block's 16 possible values computed once and looked up by its
nibbles (`vpermw`), the same bits as dequantizing each weight. Each block prefetches the next columns' block
(a weight read once per product streams from memory). No integer (VNNI) dot products: they would quantize x
too.

`quant_dequantize(blocks, qtype, dtype)`: the whole [N, K] weight in float32 or bfloat16 (the prefill path
of runner/products/quantized_linear.py multiplies tiles of it with torch's product, faster on many rows).
"""

QUANT_SOURCE = r"""
at::Tensor lanes_matmul(const at::Tensor& x, const at::Tensor& lanes, int64_t qtype);
at::Tensor quant_lanes_unpack(const at::Tensor& lanes, int64_t qtype);

namespace {

constexpr int QK = 32;
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kLaneTypes = 100;  // above it: a lane layout of the GGUF type (native_lanes_source.py)

template <int Q> constexpr int block_bytes() { return Q == kQ8_0 ? 34 : Q == kQ4_1 ? 20 : 18; }

int block_bytes_of(int64_t qtype) {
  if (qtype == kQ8_0) return 34;
  if (qtype == kQ4_1) return 20;
  if (qtype == kQ4_0) return 18;
  TORCH_CHECK(false, "quantized product: GGUF types Q4_0 (2), Q4_1 (3) and Q8_0 (8) only, got ", qtype);
  return 0;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Round-to-nearest-even to bfloat16 and back (weights are finite: no NaN handling needed).
inline float round_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &bits, 4);
  return v;
}

template <int Q>
inline void dequant_block(const uint8_t* b, float* w) {
  const float d = half_at(b);
  if (Q == kQ8_0) {
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < QK; ++j) w[j] = d * static_cast<float>(qs[j]);
  } else if (Q == kQ4_0) {
    const uint8_t* qs = b + 2;
    for (int j = 0; j < QK / 2; ++j) {
      w[j] = d * static_cast<float>((qs[j] & 15) - 8);
      w[j + QK / 2] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  } else {
    const float m = half_at(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < QK / 2; ++j) {
      w[j] = std::fma(d, static_cast<float>(qs[j] & 15), m);
      w[j + QK / 2] = std::fma(d, static_cast<float>(qs[j] >> 4), m);
    }
  }
}

#if defined(__AVX512F__)
template <int Q>
inline void dequant_block_vec(const uint8_t* b, __m512& w0, __m512& w1) {
  const float ds = half_at(b);
  const __m512 d = _mm512_set1_ps(ds);
  if (Q == kQ8_0) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), d);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (Q == kQ4_1 ? 4 : 2)));
    const __m128i nib = _mm_set1_epi8(15);
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, nib)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), nib)));
    // d * q is exact in float32: one rounding, as numpy's d * q + m (or d * (q - 8)) rounds.
    const __m512 m = _mm512_set1_ps(Q == kQ4_1 ? half_at(b + 2) : -8.0f * ds);
    w0 = _mm512_fmadd_ps(q0, d, m);
    w1 = _mm512_fmadd_ps(q1, d, m);
  }
}

inline __m512 round_bf16_vec(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// A tile's partial sums: part[i][c] holds row i's 16-lane sums for column n0 + c, lane-summed 16 columns at a
// time (`sum_lanes_of_16`, the attention kernel's transpose-and-add tree: ~1 instruction a sum instead of ~10).
template <int RT>
inline void store_sums(float (*part)[16][16], float* y, int64_t N, int64_t r0, int64_t n0, int64_t n1) {
  if (n1 - n0 == 16) {
    for (int i = 0; i < RT; ++i) _mm512_storeu_ps(y + (r0 + i) * N + n0, sum_lanes_of_16(part[i]));
    return;
  }
  for (int i = 0; i < RT; ++i)
    for (int64_t c = 0; c < n1 - n0; ++c) y[(r0 + i) * N + n0 + c] = _mm512_reduce_add_ps(_mm512_load_ps(part[i][c]));
}

// Columns n .. n + CT - 1 for the RT rows at x: each block of a column dequantized once, multiplied into every
// row (two accumulators a row and column: independent chains of fused multiply-adds); CT columns at a time
// so that few rows still keep several chains in flight and each x load serves CT columns.
template <int Q, int RT, int CT, bool BF16>
inline void float_columns(const float* x, int64_t K, const uint8_t* W, int64_t row_bytes, int64_t n,
                          float (*part)[16][16], int64_t c0) {
  const int64_t nb = K / QK;
  __m512 acc0[CT][RT], acc1[CT][RT];
  for (int c = 0; c < CT; ++c)
    for (int i = 0; i < RT; ++i) acc0[c][i] = acc1[c][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 w0[CT], w1[CT];
    for (int c = 0; c < CT; ++c) {
      const uint8_t* block = W + (n + c) * row_bytes + b * block_bytes<Q>();
      __builtin_prefetch(block + CT * row_bytes);  // as bf16_columns: the next columns' block
      dequant_block_vec<Q>(block, w0[c], w1[c]);
      if (BF16) {
        w0[c] = round_bf16_vec(w0[c]);
        w1[c] = round_bf16_vec(w1[c]);
      }
    }
    const float* xb = x + b * QK;
    for (int i = 0; i < RT; ++i) {
      const __m512 x0 = _mm512_loadu_ps(xb + i * K), x1 = _mm512_loadu_ps(xb + i * K + 16);
      for (int c = 0; c < CT; ++c) {
        acc0[c][i] = _mm512_fmadd_ps(w0[c], x0, acc0[c][i]);
        acc1[c][i] = _mm512_fmadd_ps(w1[c], x1, acc1[c][i]);
      }
    }
  }
  for (int c = 0; c < CT; ++c)
    for (int i = 0; i < RT; ++i) _mm512_store_ps(part[i][c0 + c], _mm512_add_ps(acc0[c][i], acc1[c][i]));
}

// Columns [n0, n1) (at most 16) for rows [r0, r0 + RT).
template <int Q, int RT, bool BF16>
void column_tile(const float* x, int64_t K, const uint8_t* W, int64_t row_bytes, float* y, int64_t N, int64_t r0,
                 int64_t n0, int64_t n1) {
  constexpr int CT = RT >= 5 ? 1 : RT >= 3 ? 2 : 4;  // at most 16 accumulators
  alignas(64) float part[RT][16][16];
  int64_t n = n0;
  for (; n + CT <= n1; n += CT) float_columns<Q, RT, CT, BF16>(x + r0 * K, K, W, row_bytes, n, part, n - n0);
  for (; n < n1; ++n) float_columns<Q, RT, 1, BF16>(x + r0 * K, K, W, row_bytes, n, part, n - n0);
  store_sums<RT>(part, y, N, r0, n0, n1);
}

#if defined(__AVX512BF16__)
// bfloat16 x: the dequantized weights rounded to bfloat16 (one instruction for 32) and multiplied by x's
// bfloat16 values pairwise into float32 sums (`vdpbf16ps`; each product of two bfloat16 values is exact).
// A 4-bit block's 32 weights in bfloat16 by table: its 16 possible values (d * j + m, or d * (j - 8), rounded
// as dequant_block_vec's then bfloat16's) computed once, twice over in one register, and looked up by the
// nibbles (`vpermw` reads an index's low 5 bits: a low nibble's byte, high nibble included, finds its value
// in either copy). The same bits as dequantizing each weight: ~9 instructions a block instead of ~15.
template <int Q>
inline __m512bh q4_block_bf16(const uint8_t* b) {
  uint32_t scales;
  std::memcpy(&scales, b, 4);
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(scales)));  // [d, m (Q4_1), ...]
  const __m512 d = _mm512_broadcastss_ps(dm);
  const __m512 m = Q == kQ4_1 ? _mm512_broadcastss_ps(_mm_movehdup_ps(dm)) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 values = _mm512_fmadd_ps(iota, d, m);
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
  const __m256i nibbles = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (Q == kQ4_1 ? 4 : 2))));
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i index = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(nibbles), shifts);
  return (__m512bh)_mm512_permutexvar_epi16(index, table);
}

template <int Q, int RT, int CT>
inline void bf16_columns(const c10::BFloat16* x, int64_t K, const uint8_t* W, int64_t row_bytes, int64_t n,
                         float (*part)[16][16], int64_t c0) {
  const int64_t nb = K / QK;
  __m512 acc[CT][RT];
  for (int c = 0; c < CT; ++c)
    for (int i = 0; i < RT; ++i) acc[c][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512bh w[CT];
    for (int c = 0; c < CT; ++c) {
      const uint8_t* block = W + (n + c) * row_bytes + b * block_bytes<Q>();
      // the same block of the column CT on (the next columns' blocks follow these): a weight read once per
      // product (an LM head's 30 MB) streams from memory, where the hardware's prefetch alone ran at ~5 GB/s
      __builtin_prefetch(block + CT * row_bytes);
      if constexpr (Q == kQ8_0) {
        __m512 w0, w1;
        dequant_block_vec<Q>(block, w0, w1);
        w[c] = _mm512_cvtne2ps_pbh(w1, w0);
      } else {
        w[c] = q4_block_bf16<Q>(block);
      }
    }
    const c10::BFloat16* xb = x + b * QK;
    for (int i = 0; i < RT; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + i * K);
      for (int c = 0; c < CT; ++c) acc[c][i] = _mm512_dpbf16_ps(acc[c][i], w[c], xv);
    }
  }
  for (int c = 0; c < CT; ++c)
    for (int i = 0; i < RT; ++i) _mm512_store_ps(part[i][c0 + c], acc[c][i]);
}

template <int Q, int RT>
void column_tile_bf16(const c10::BFloat16* x, int64_t K, const uint8_t* W, int64_t row_bytes, float* y, int64_t N,
                      int64_t r0, int64_t n0, int64_t n1) {
  constexpr int CT = RT >= 8 ? 1 : RT >= 4 ? 2 : 4;  // at most 16 accumulators
  alignas(64) float part[RT][16][16];
  int64_t n = n0;
  for (; n + CT <= n1; n += CT) bf16_columns<Q, RT, CT>(x + r0 * K, K, W, row_bytes, n, part, n - n0);
  for (; n < n1; ++n) bf16_columns<Q, RT, 1>(x + r0 * K, K, W, row_bytes, n, part, n - n0);
  store_sums<RT>(part, y, N, r0, n0, n1);
}
#define TCB_QUANT_BF16_DIRECT 1
#endif

// How x is read: float32 rows; bfloat16 rows widened to float32 first, weights rounded to bfloat16
// (AVX-512 without BF16, portable); bfloat16 rows read directly (`vdpbf16ps`).
constexpr int kFloatX = 0, kWidenedX = 1, kBf16X = 2;

template <int Q, int MODE, int RT>
void tile_of(const void* x, int64_t K, const uint8_t* W, int64_t row_bytes, float* y, int64_t N, int64_t r0,
             int64_t n0, int64_t n1) {
#if defined(TCB_QUANT_BF16_DIRECT)
  if constexpr (MODE == kBf16X) {
    column_tile_bf16<Q, RT>(static_cast<const c10::BFloat16*>(x), K, W, row_bytes, y, N, r0, n0, n1);
    return;
  }
#endif
  column_tile<Q, RT, MODE != kFloatX>(static_cast<const float*>(x), K, W, row_bytes, y, N, r0, n0, n1);
}

// The last R - r (< RT) rows as one tile of their own size.
template <int Q, int MODE, int RT>
void rest_rows(const void* x, int64_t rest, int64_t K, const uint8_t* W, int64_t row_bytes, float* y, int64_t N,
               int64_t r, int64_t n0, int64_t n1) {
  if constexpr (RT > 1) {
    if (rest == RT - 1) tile_of<Q, MODE, RT - 1>(x, K, W, row_bytes, y, N, r, n0, n1);
    else rest_rows<Q, MODE, RT - 1>(x, rest, K, W, row_bytes, y, N, r, n0, n1);
  }
}

// Rows in tiles of 16 (bfloat16 x read directly: one accumulator a row) or 8 (two a row), the rest in one tile.
template <int Q, int MODE>
void column_rows(const void* x, int64_t R, int64_t K, const uint8_t* W, int64_t row_bytes, float* y, int64_t N,
                 int64_t n0, int64_t n1) {
#if defined(TCB_QUANT_BF16_DIRECT)
  constexpr int kTile = MODE == kBf16X ? 16 : 8;
#else
  constexpr int kTile = 8;
#endif
  int64_t r = 0;
  for (; r + kTile <= R; r += kTile) tile_of<Q, MODE, kTile>(x, K, W, row_bytes, y, N, r, n0, n1);
  if (r < R) rest_rows<Q, MODE, kTile>(x, R - r, K, W, row_bytes, y, N, r, n0, n1);
}
#else
// Portable path: a row's blocks dequantized into a buffer, then plain float32 sums (per row, per column).
constexpr int kFloatX = 0, kWidenedX = 1, kBf16X = 2;

template <int Q, int MODE>
void column_rows(const void* xv, int64_t R, int64_t K, const uint8_t* W, int64_t row_bytes, float* y, int64_t N,
                 int64_t n0, int64_t n1) {
  const float* x = static_cast<const float*>(xv);
  const int64_t nb = K / QK;
  std::vector<float> w(K);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < nb; ++b) dequant_block<Q>(W + n * row_bytes + b * block_bytes<Q>(), w.data() + b * QK);
    if (MODE != kFloatX)
      for (auto& v : w) v = round_bf16(v);
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + r * K;
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += w[k] * xr[k];
      y[r * N + n] = acc;
    }
  }
}
#endif

// Columns per task: a few columns' blocks at a time, so one tile of x rows is reused from L1 across them.
constexpr int64_t kColumnGrain = 16;

template <int Q, int MODE>
void quant_matmul_typed(const void* x, int64_t R, int64_t K, const uint8_t* W, int64_t row_bytes, float* y,
                        int64_t N) {
  at::parallel_for(0, N, kColumnGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kColumnGrain)
      column_rows<Q, MODE>(x, R, K, W, row_bytes, y, N, n0, std::min(end, n0 + kColumnGrain));
  });
}

template <int MODE>
void quant_matmul_dispatch(int64_t qtype, const void* x, int64_t R, int64_t K, const uint8_t* W, int64_t row_bytes,
                           float* y, int64_t N) {
  if (qtype == kQ8_0) quant_matmul_typed<kQ8_0, MODE>(x, R, K, W, row_bytes, y, N);
  else if (qtype == kQ4_1) quant_matmul_typed<kQ4_1, MODE>(x, R, K, W, row_bytes, y, N);
  else quant_matmul_typed<kQ4_0, MODE>(x, R, K, W, row_bytes, y, N);
}

template <int Q, typename T>
void dequantize_typed(const uint8_t* W, int64_t N, int64_t K, int64_t row_bytes, T* out) {
  const int64_t nb = K / QK;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    alignas(64) float w[QK];
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* block = W + n * row_bytes + b * block_bytes<Q>();
        T* o = out + n * K + b * QK;
#if defined(__AVX512F__)
        __m512 w0, w1;
        dequant_block_vec<Q>(block, w0, w1);
        if constexpr (std::is_same<T, float>::value) {
          _mm512_storeu_ps(o, w0);
          _mm512_storeu_ps(o + 16, w1);
          continue;
        }
#if defined(__AVX512BF16__)
        // round to nearest even, as c10::BFloat16's conversion (the weights are finite)
        _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
        continue;
#endif
        _mm512_store_ps(w, w0);
        _mm512_store_ps(w + 16, w1);
#else
        dequant_block<Q>(block, w);
#endif
        for (int j = 0; j < QK; ++j) o[j] = static_cast<T>(w[j]);
      }
  });
}

int64_t checked_columns(const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks: contiguous uint8 [N, row bytes]");
  const int64_t bytes = block_bytes_of(qtype);
  TORCH_CHECK(blocks.size(1) % bytes == 0, "row bytes ", blocks.size(1), " is not a whole number of blocks of ", bytes);
  return blocks.size(1) / bytes * QK;
}

}  // namespace

// y [R, N] = x [R, K] @ W.T, W in GGUF blocks [N, K / 32 * block bytes]; y in x's dtype (float32 / bfloat16).
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  if (qtype > kLaneTypes) return lanes_matmul(x, blocks, qtype);
  const int64_t K = checked_columns(blocks, qtype);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x [R, ", K, "] expected, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t R = x.size(0), N = blocks.size(0);
  at::Tensor y = at::empty({R, N}, x.options().dtype(at::kFloat));
  if (R > 0 && N > 0) {
    const uint8_t* W = blocks.data_ptr<uint8_t>();
    const int64_t rb = blocks.size(1);
    float* out = y.data_ptr<float>();
#if defined(TCB_QUANT_BF16_DIRECT)
    if (bf16) {
      const at::Tensor xc = x.contiguous();
      quant_matmul_dispatch<kBf16X>(qtype, xc.data_ptr<c10::BFloat16>(), R, K, W, rb, out, N);
      return y.to(at::kBFloat16);
    }
#endif
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    if (bf16) quant_matmul_dispatch<kWidenedX>(qtype, xf.data_ptr<float>(), R, K, W, rb, out, N);
    else quant_matmul_dispatch<kFloatX>(qtype, xf.data_ptr<float>(), R, K, W, rb, out, N);
  }
  return bf16 ? y.to(at::kBFloat16) : y;
}

// The [N, K] weight of `blocks` in float32 or bfloat16 (as gguf.quants.dequantize, then rounded).
at::Tensor quant_dequantize(const at::Tensor& blocks, int64_t qtype, at::ScalarType dtype) {
  if (qtype > kLaneTypes) return quant_dequantize(quant_lanes_unpack(blocks, qtype), qtype - kLaneTypes, dtype);
  const int64_t K = checked_columns(blocks, qtype), N = blocks.size(0);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize to float32 or bfloat16");
  at::Tensor out = at::empty({N, K}, blocks.options().dtype(dtype));
  const uint8_t* W = blocks.data_ptr<uint8_t>();
  const int64_t rb = blocks.size(1);
  if (dtype == at::kFloat) {
    if (qtype == kQ8_0) dequantize_typed<kQ8_0>(W, N, K, rb, out.data_ptr<float>());
    else if (qtype == kQ4_1) dequantize_typed<kQ4_1>(W, N, K, rb, out.data_ptr<float>());
    else dequantize_typed<kQ4_0>(W, N, K, rb, out.data_ptr<float>());
  } else {
    if (qtype == kQ8_0) dequantize_typed<kQ8_0>(W, N, K, rb, out.data_ptr<c10::BFloat16>());
    else if (qtype == kQ4_1) dequantize_typed<kQ4_1>(W, N, K, rb, out.data_ptr<c10::BFloat16>());
    else dequantize_typed<kQ4_0>(W, N, K, rb, out.data_ptr<c10::BFloat16>());
  }
  return out;
}
"""

QUANT_BINDINGS = r"""
  m.def("quant_matmul", &quant_matmul, "x @ W.T with W in GGUF blocks (Q4_0, Q4_1, Q8_0), float32 sums");
  m.def("quant_dequantize", &quant_dequantize, "the float32 / bfloat16 weight of GGUF blocks");
"""
