"""C++ source of the products over lanes: GGUF Q4_0 / Q4_1 / Q8_0 weights repacked so that 16 output columns sit in
the 16 lanes of a vector (llama.cpp repacks its Q4_0 for x86 and ARM the same way, `Q4_0x8`).

The row-major GGUF blocks (runner/products/quantized_linear.py, native_quant_source.py) put 32 weights of one
column in a block: a bfloat16 x needs each block's own values computed (a 4-bit block's 16 by table, ~11
instructions a block, a third of them shuffles, which this CPU runs on two of its four vector pipes); the decode
products were bound by that work, not by reading the weights. Over lanes, a block of 32 weights of 16 columns is:

- the 16 columns' fp16 scales d (and Q4_1's fp16 minimums m), 32 (64) bytes: one conversion for 16 columns;
- the values as vectors of 32 16-bit words, word 2c + h of column c holding four 4-bit fields. 4-bit types: 4
  vectors, field s of vector i the nibble of weight k = 8i + 2s + h; Q8_0: 8 vectors, byte t of the word holding
  `q ^ 0x80` of weight k = 4v + 2t + h (its low nibble field 2t, its high nibble field 2t + 1). Shifting a
  vector by 4s and keeping the low nibble gives, in each lane c, a pair of weights (k, k + 1) that `vdpbf16ps`
  multiplies by x's pair (x[k], x[k + 1]) broadcast (Q8_0's high nibbles by 16 x, exact in bfloat16).

A field f becomes the bfloat16 128 + f by one bitwise instruction (`0x4300 | f`: 128's exponent, f in the
mantissa's low bits), so a block's sums run over 128 + f; with sx the block's sum of x,
`sum(w x) = d * block sum + shift * sx`, shift = m - 128 d (Q4_1), -136 d (Q4_0: m = -8 d), -2304 d (Q8_0:
q = 16 hi + lo - 128). Two shuffle-free instructions a pair, one `vdpbf16ps` per row and pair, two fused
multiply-adds a block and row: the product reads memory at its rate. Every product of a bfloat16 x by 128 + f
is exact in float32; the weights are exactly `d * q + m` (not rounded to bfloat16 as the row-major product
rounds them), so the sums differ from the bfloat16 reference's only in rounding (tie-aware,
docs/quantization.md). The bytes are the GGUF blocks' own count: a layer's `[N, row bytes]` buffer holds the
same bytes, 16 columns' blocks after each other.

`quant_lanes_pack(blocks, qtype)`, `quant_lanes_unpack(lanes, lane type)`: between the two layouts (bit for
bit); `quant_lanes_rows(lanes, lane type, ids, dtype)`: rows dequantized (a tied embedding's lookup);
`quant_matmul` / `quant_dequantize` take the lane types `100 + qtype` (102, 103, 108).
"""

LANES_SOURCE = r"""
namespace {

constexpr int kLanes = 100;  // a lane layout's type: kLanes + the GGUF type (Q4_0: 102, Q4_1: 103, Q8_0: 108)
constexpr int kLaneColumns = 16;

bool is_lanes(int64_t qtype) {
  return qtype == kLanes + kQ4_0 || qtype == kLanes + kQ4_1 || qtype == kLanes + kQ8_0;
}

// A lane block (16 columns x 32 weights): the scales (d, then Q4_1's m: 16 fp16 each), then the values.
inline int lane_scale_bytes(int q) { return q == kQ4_1 ? 64 : 32; }
inline int lane_value_bytes(int q) { return q == kQ8_0 ? 512 : 256; }
inline int lane_block_bytes(int q) { return lane_scale_bytes(q) + lane_value_bytes(q); }

// Where weight k of lane column c sits among a lane block's values: the byte offset of its 16-bit word (of vector
// v, word 2c + h) and the 4-bit field s in it. 4-bit: v = k / 8, s = (k % 8) / 2 (a nibble); 8-bit: v = k / 4, the
// byte t = (k % 4) / 2 holding q ^ 0x80 in fields 2t (low nibble) and 2t + 1 (high).
inline int lane_word(int q, int c, int k) { return (q == kQ8_0 ? k / 4 : k / 8) * 64 + (2 * c + k % 2) * 2; }

inline int lane_value(const uint8_t* values, int q, int c, int k) {
  const uint8_t* word = values + lane_word(q, c, k);
  if (q == kQ8_0) return static_cast<int>(static_cast<int8_t>(word[(k % 4) / 2] ^ 0x80));
  const int bits = word[0] | (word[1] << 8);
  return (bits >> (4 * ((k % 8) / 2))) & 15;
}

inline void set_lane_value(uint8_t* values, int q, int c, int k, int value) {
  uint8_t* word = values + lane_word(q, c, k);
  if (q == kQ8_0) {
    word[(k % 4) / 2] = static_cast<uint8_t>(value) ^ 0x80;
    return;
  }
  const int shift = 4 * ((k % 8) / 2);
  word[shift / 8] |= static_cast<uint8_t>(value << (shift % 8));
}

// A GGUF block's weight k as stored (Q8_0: the int8; 4-bit: the nibble), and back.
inline int block_value(const uint8_t* block, int q, int k) {
  if (q == kQ8_0) return static_cast<int8_t>(block[2 + k]);
  const uint8_t* qs = block + (q == kQ4_1 ? 4 : 2);
  return k < QK / 2 ? qs[k] & 15 : qs[k - QK / 2] >> 4;
}

void lanes_pack(int q, const uint8_t* W, int64_t N, int64_t K, int64_t row_bytes, uint8_t* out) {
  const int64_t nb = K / QK, bb = block_bytes_of(q), lb = lane_block_bytes(q);
  at::parallel_for(0, N / kLaneColumns, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* o = out + (g * nb + b) * lb;
        uint8_t* values = o + lane_scale_bytes(q);
        std::memset(values, 0, lane_value_bytes(q));
        for (int c = 0; c < kLaneColumns; ++c) {
          const uint8_t* block = W + (g * kLaneColumns + c) * row_bytes + b * bb;
          std::memcpy(o + 2 * c, block, 2);                                   // d
          if (q == kQ4_1) std::memcpy(o + 32 + 2 * c, block + 2, 2);          // m
          for (int k = 0; k < QK; ++k) set_lane_value(values, q, c, k, block_value(block, q, k));
        }
      }
  });
}

void lanes_unpack(int q, const uint8_t* L, int64_t N, int64_t K, int64_t row_bytes, uint8_t* out) {
  const int64_t nb = K / QK, bb = block_bytes_of(q), lb = lane_block_bytes(q);
  at::parallel_for(0, N / kLaneColumns, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* l = L + (g * nb + b) * lb;
        const uint8_t* values = l + lane_scale_bytes(q);
        for (int c = 0; c < kLaneColumns; ++c) {
          uint8_t* block = out + (g * kLaneColumns + c) * row_bytes + b * bb;
          std::memcpy(block, l + 2 * c, 2);
          if (q == kQ4_1) std::memcpy(block + 2, l + 32 + 2 * c, 2);
          if (q == kQ8_0) {
            for (int k = 0; k < QK; ++k) block[2 + k] = static_cast<uint8_t>(lane_value(values, q, c, k));
            continue;
          }
          uint8_t* qs = block + (q == kQ4_1 ? 4 : 2);
          for (int j = 0; j < QK / 2; ++j)
            qs[j] = static_cast<uint8_t>(lane_value(values, q, c, j) | (lane_value(values, q, c, j + QK / 2) << 4));
        }
      }
  });
}

// Rows `ids` of a lane layout, dequantized (an embedding lookup over the blocks an LM head shares).
template <typename T>
void lanes_rows(int q, const uint8_t* L, int64_t K, const int64_t* ids, int64_t count, int64_t N, T* out) {
  const int64_t nb = K / QK, lb = lane_block_bytes(q);
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t id = ids[i];
      TORCH_CHECK(id >= 0 && id < N, "index ", id, " is out of range for ", N, " rows");
      const int64_t g = id / kLaneColumns;
      const int c = static_cast<int>(id % kLaneColumns);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* l = L + (g * nb + b) * lb;
        const float d = half_at(l + 2 * c);
        const float m = q == kQ4_1 ? half_at(l + 32 + 2 * c) : 0.0f;
        for (int k = 0; k < QK; ++k) {
          const int v = lane_value(l + lane_scale_bytes(q), q, c, k);
          // as dequant_block: d * q exact, one rounding of d * q + m
          const float w = q == kQ4_1 ? std::fma(d, static_cast<float>(v), m)
                                     : d * static_cast<float>(q == kQ4_0 ? v - 8 : v);
          out[i * K + b * QK + k] = static_cast<T>(w);
        }
      }
    }
  });
}

#if defined(TCB_QUANT_BF16_DIRECT)
inline uint32_t pair_at(const c10::BFloat16* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Rows r0 .. r0 + RT - 1 against lane groups g .. g + CG - 1. Per block, each group's value vectors give, by a
// shift and one bitwise instruction each, 16-lane operands of bfloat16 128 + (a 4-bit field) multiplied into
// each row's block sum: a 4-bit type's field s of vector i is weight pair 4i + s against x; Q8_0's fields
// 2t / 2t + 1 of vector v are the low / high nibble of q ^ 0x80 for pair 2v + t, against x / 16 x. Then the
// block's scales: sum(w x) = d * block sum + shift * sum(x), shift = m - 128 d (Q4_1), -136 d (Q4_0),
// -2304 d (Q8_0: q = 16 hi + lo - 128, each nibble summed as 128 + it).
template <int Q, int RT, int CG>
inline void lane_groups(const c10::BFloat16* x, const c10::BFloat16* x16, int64_t K, const float* xsum,
                        const uint8_t* L, int64_t group_bytes, int64_t g, c10::BFloat16* y, int64_t N,
                        int64_t r0) {
  constexpr int SB = Q == kQ4_1 ? 64 : 32, VECS = Q == kQ8_0 ? 8 : 4, LB = SB + VECS * 64;
  const int64_t nb = K / QK;
  const __m512i low = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  __m512 acc[CG][RT];
  for (int c = 0; c < CG; ++c)
    for (int r = 0; r < RT; ++r) acc[c][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 blk[CG][RT];
    for (int c = 0; c < CG; ++c)
      for (int r = 0; r < RT; ++r) blk[c][r] = _mm512_setzero_ps();
    for (int i = 0; i < VECS; ++i) {
      __m512i words[CG];
      for (int c = 0; c < CG; ++c) {
        const uint8_t* lane = L + (g + c) * group_bytes + b * LB;
        __builtin_prefetch(lane + 4 * LB + i * 64);
        words[c] = _mm512_loadu_si512(lane + SB + i * 64);
      }
      for (int s = 0; s < 4; ++s) {
        const int k = Q == kQ8_0 ? 4 * i + 2 * (s / 2) : 8 * i + 2 * s;
        const c10::BFloat16* xs = Q == kQ8_0 && s % 2 ? x16 : x;
        __m512bh xv[RT];
        for (int r = 0; r < RT; ++r)
          xv[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(xs + (r0 + r) * K + b * QK + k)));
        for (int c = 0; c < CG; ++c) {
          const __m512i shifted = s == 0 ? words[c] : _mm512_srli_epi16(words[c], 4 * s);
          const __m512bh w = (__m512bh)_mm512_ternarylogic_epi32(shifted, low, bias, 0xEA);  // (a & b) | c
          for (int r = 0; r < RT; ++r) blk[c][r] = _mm512_dpbf16_ps(blk[c][r], w, xv[r]);
        }
      }
    }
    for (int c = 0; c < CG; ++c) {
      const uint8_t* lane = L + (g + c) * group_bytes + b * LB;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane)));
      const __m512 shift =
          Q == kQ4_1 ? _mm512_fmadd_ps(d, _mm512_set1_ps(-128.0f),
                                       _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane + 32))))
                     : _mm512_mul_ps(d, _mm512_set1_ps(Q == kQ8_0 ? -2304.0f : -136.0f));
      for (int r = 0; r < RT; ++r) {
        acc[c][r] = _mm512_fmadd_ps(blk[c][r], d, acc[c][r]);
        acc[c][r] = _mm512_fmadd_ps(shift, _mm512_set1_ps(xsum[(r0 + r) * nb + b]), acc[c][r]);
      }
    }
  }
  for (int c = 0; c < CG; ++c)
    for (int r = 0; r < RT; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r0 + r) * N + (g + c) * kLaneColumns),
                          (__m256i)_mm512_cvtneps_pbh(acc[c][r]));  // rounded to nearest even, as .to(bfloat16)
}

struct LaneCall {
  const c10::BFloat16* x;
  const c10::BFloat16* x16;  // Q8_0's high nibbles: x * 16 (exact)
  int64_t K;
  const float* xsum;  // each block's sum of x, a row at a time
  const uint8_t* L;
  int64_t group_bytes;
  c10::BFloat16* y;
  int64_t N;
};

template <int Q, int RT>
void lane_rows(const LaneCall& a, int64_t g0, int64_t g1, int64_t r0) {
  constexpr int CG = RT >= 6 ? 1 : RT >= 3 ? 2 : 4;  // accumulators: 2 * RT * CG, at most 24
  int64_t g = g0;
  for (; g + CG <= g1; g += CG) lane_groups<Q, RT, CG>(a.x, a.x16, a.K, a.xsum, a.L, a.group_bytes, g, a.y, a.N, r0);
  for (; g < g1; ++g) lane_groups<Q, RT, 1>(a.x, a.x16, a.K, a.xsum, a.L, a.group_bytes, g, a.y, a.N, r0);
}

template <int Q, int RT>
void lane_rest(const LaneCall& a, int64_t rest, int64_t g0, int64_t g1, int64_t r0) {
  if constexpr (RT > 1) {
    if (rest == RT - 1) lane_rows<Q, RT - 1>(a, g0, g1, r0);
    else lane_rest<Q, RT - 1>(a, rest, g0, g1, r0);
  }
}

constexpr int kLaneRowTile = 8;

template <int Q>
void lanes_matmul_typed(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* L, c10::BFloat16* y,
                        int64_t N) {
  const int64_t nb = K / QK, groups = N / kLaneColumns;
  std::vector<float> xsum(R * nb);
  std::vector<c10::BFloat16> x16(Q == kQ8_0 ? R * K : 0);
  at::parallel_for(0, R * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const c10::BFloat16* xb = x + (i / nb) * K + (i % nb) * QK;
      const __m512i pairs = _mm512_loadu_si512(xb);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
      if constexpr (Q == kQ8_0) {  // 16 x is exact in bfloat16: its float32 bits' high halves, pairs as x's
        const __m512 sixteen = _mm512_set1_ps(16.0f);
        const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(_mm512_mul_ps(even, sixteen)), 16);
        const __m512i hi = _mm512_castps_si512(_mm512_mul_ps(odd, sixteen));
        _mm512_storeu_si512(x16.data() + (xb - x), _mm512_ternarylogic_epi32(hi, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)), lo, 0xEA));
      }
    }
  });
  const LaneCall call{x, x16.data(), K, xsum.data(), L, nb * lane_block_bytes(Q), y, N};
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    int64_t r = 0;
    for (; r + kLaneRowTile <= R; r += kLaneRowTile) lane_rows<Q, kLaneRowTile>(call, begin, end, r);
    if (r < R) lane_rest<Q, kLaneRowTile>(call, R - r, begin, end, r);
  });
}
#endif

int lanes_base(int64_t qtype) {
  TORCH_CHECK(is_lanes(qtype), "lane layouts: types ", kLanes + kQ4_0, " (Q4_0), ", kLanes + kQ4_1, " (Q4_1) and ",
              kLanes + kQ8_0, " (Q8_0), got ", qtype);
  return static_cast<int>(qtype - kLanes);
}

}  // namespace

bool quant_lanes_available() {
#if defined(TCB_QUANT_BF16_DIRECT)
  return true;
#else
  return false;
#endif
}

at::Tensor lanes_convert(const at::Tensor& blocks, int64_t qtype, bool pack) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0,
              "lane layouts: Q4_0 (2), Q4_1 (3) and Q8_0 (8) only, got ", qtype);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks: contiguous uint8 [N, row bytes]");
  const int64_t N = blocks.size(0), rb = blocks.size(1), bb = block_bytes_of(qtype);
  TORCH_CHECK(N % kLaneColumns == 0, "lane layouts need a multiple of ", kLaneColumns, " columns, got ", N);
  TORCH_CHECK(rb % bb == 0, "row bytes ", rb, " is not a whole number of blocks of ", bb);
  at::Tensor out = at::empty_like(blocks);
  const int q = static_cast<int>(qtype);
  if (pack) lanes_pack(q, blocks.data_ptr<uint8_t>(), N, rb / bb * QK, rb, out.data_ptr<uint8_t>());
  else lanes_unpack(q, blocks.data_ptr<uint8_t>(), N, rb / bb * QK, rb, out.data_ptr<uint8_t>());
  return out;
}

at::Tensor quant_lanes_pack(const at::Tensor& blocks, int64_t qtype) { return lanes_convert(blocks, qtype, true); }

at::Tensor quant_lanes_unpack(const at::Tensor& lanes, int64_t qtype) {
  return lanes_convert(lanes, lanes_base(qtype), false);
}

// Rows `ids` (int64) of the weight a lane layout holds, in float32 or bfloat16: [ids..., K].
at::Tensor quant_lanes_rows(const at::Tensor& lanes, int64_t qtype, const at::Tensor& ids, at::ScalarType dtype) {
  const int q = lanes_base(qtype);
  TORCH_CHECK(lanes.scalar_type() == at::kByte && lanes.dim() == 2 && lanes.is_contiguous(),
              "lanes: contiguous uint8 [N, row bytes]");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "ids: int64");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rows in float32 or bfloat16");
  const int64_t K = lanes.size(1) / block_bytes_of(q) * QK;
  const at::Tensor flat = ids.reshape({-1}).contiguous();
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  at::Tensor out = at::empty(shape, lanes.options().dtype(dtype));
  if (dtype == at::kFloat)
    lanes_rows(q, lanes.data_ptr<uint8_t>(), K, flat.data_ptr<int64_t>(), flat.numel(), lanes.size(0),
               out.data_ptr<float>());
  else
    lanes_rows(q, lanes.data_ptr<uint8_t>(), K, flat.data_ptr<int64_t>(), flat.numel(), lanes.size(0),
               out.data_ptr<c10::BFloat16>());
  return out;
}

// quant_matmul over a lane layout: the lane product for a bfloat16 x where the CPU has AVX512-BF16, else the
// weight back in GGUF blocks and quant_matmul's own product.
at::Tensor lanes_matmul(const at::Tensor& x, const at::Tensor& lanes, int64_t qtype) {
  const int q = lanes_base(qtype);
  const int64_t K = lanes.size(1) / block_bytes_of(q) * QK, N = lanes.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x [R, ", K, "] expected, got ", x.sizes());
#if defined(TCB_QUANT_BF16_DIRECT)
  if (x.scalar_type() == at::kBFloat16 && lanes.is_contiguous() && N % kLaneColumns == 0) {
    const at::Tensor xc = x.contiguous();
    const int64_t R = x.size(0);
    at::Tensor y = at::empty({R, N}, x.options());
    if (R > 0 && N > 0) {
      const auto* xp = xc.data_ptr<c10::BFloat16>();
      const auto* lp = lanes.data_ptr<uint8_t>();
      auto* yp = y.data_ptr<c10::BFloat16>();
      if (q == kQ4_1) lanes_matmul_typed<kQ4_1>(xp, R, K, lp, yp, N);
      else if (q == kQ4_0) lanes_matmul_typed<kQ4_0>(xp, R, K, lp, yp, N);
      else lanes_matmul_typed<kQ8_0>(xp, R, K, lp, yp, N);
    }
    return y;
  }
#endif
  return quant_matmul(x, quant_lanes_unpack(lanes, qtype), q);
}
"""

LANES_BINDINGS = r"""
  m.def("quant_lanes_available", &quant_lanes_available, "whether this build has the bfloat16 lane product");
  m.def("quant_lanes_pack", &quant_lanes_pack, "GGUF Q4_0 / Q4_1 / Q8_0 blocks [N, row bytes] in the lane layout");
  m.def("quant_lanes_unpack", &quant_lanes_unpack, "a lane layout back in GGUF blocks, bit for bit");
  m.def("quant_lanes_rows", &quant_lanes_rows, "rows of a lane layout's weight, dequantized (an embedding lookup)");
"""
