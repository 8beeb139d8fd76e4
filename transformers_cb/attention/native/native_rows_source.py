"""C++ source of the native small-row bfloat16 product (built into the same library as the paged-attention kernel).

`bf16_rows_matmul(x [..., K], packed [NB, KP, 16, 2], bias [N] or None, N)`: a new `x @ W.T + bias`
for a bfloat16 weight `W [N, K]` held as `pack_rows(W)` (runner/products/small_rows.py): 16 output columns
a block, K in pairs, each pair of a column's two weights side by side, which is the operand `vdpbf16ps`
multiplies with a broadcast pair of `x`. Each column's sum runs in float32 (the products of two bfloat16
values are exact in float32), the bias (widened) is added in float32 and the sum rounded to bfloat16 once,
the rounding points of oneDNN's packed product; only the order of the float32 sums differs (AMX tiles
block them their own way), as the packed products differ from MKL's.

Why: oneDNN's call costs 20-40 us whatever the product's size on these CPUs, and its AMX kernels gain
nothing from one row (a tile is 16 rows): one decode row through SmolLM2's 3072 x 576 gate/up product
takes 121 us there against 54 us here (docs/design.md, "Small-row products"). From a few rows on, AMX wins
(this loop is bound by `vdpbf16ps`, 32 products a cycle), so the caller routes by row count.

Columns in pairs of blocks (32 columns) run in parallel; rows in tiles of up to 8, so a block's weights
are read from memory once per call and from L1/L2 for the next tiles. Built only where the compiler
targets AVX512-BF16 (`__AVX512BF16__`); elsewhere the function is absent and the caller keeps oneDNN's.
"""

ROWS_SOURCE = r"""
namespace {
// f(std::integral_constant<int, R>) for a tile of `rows` rows (1-8; more: 8): the row count a kernel's tile
// template takes at compile time.
template <typename F>
inline void with_row_count(int rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// A new [..., N] tensor like x: a product's output.
inline at::Tensor output_like(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return at::empty(shape, x.options());
}

// The bias [N] of `dtype` made contiguous, or an undefined tensor for none.
inline at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, int64_t N, at::ScalarType dtype) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == N, "bias: ", dtype, " [N]");
  return bias->contiguous();
}
}  // namespace

#if defined(__AVX512BF16__)
namespace {

// Rows [0, RT) of x (as bfloat16 pairs, `x_pairs` pairs a row) times CB column blocks: float32 sums in `sums`
// [RT][CB][16].
template <int RT, int CB>
inline void rows_tile(const uint32_t* x, int64_t x_pairs, const __m512i* w, int64_t pairs, int64_t block_stride,
                      float* sums) {
  __m512 acc[RT][CB];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i wv[CB];
    for (int c = 0; c < CB; ++c) {
      // the next column blocks' same line (they follow these): see kernel's note on cold weights
      _mm_prefetch(reinterpret_cast<const char*>(w + (CB + c) * block_stride + p), _MM_HINT_T1);
      wv[c] = _mm512_loadu_si512(w + c * block_stride + p);
    }
    for (int r = 0; r < RT; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(x[r * x_pairs + p]));
      for (int c = 0; c < CB; ++c)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(wv[c]));
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CB; ++c) _mm512_storeu_ps(sums + (r * CB + c) * 16, acc[r][c]);
}

template <int CB>
void rows_tile_of(int rows, const uint32_t* x, int64_t x_pairs, const __m512i* w, int64_t pairs, int64_t stride,
                  float* sums) {
  with_row_count(rows, [&](auto rt) { rows_tile<decltype(rt)::value, CB>(x, x_pairs, w, pairs, stride, sums); });
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
// The process asks Linux for the AMX tile state once (oneDNN asks too; asking twice is harmless).
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Rows [0, R) (R <= 16) of x (K = 32 * chunks bfloat16 a row) times 2 (or 1) column blocks of the row pack:
// float32 sums in `sums` [R][blocks][16]. Tiles: 0/1 the blocks' sums, 2 the rows' 32 columns, 3/4 the
// blocks' 16 pairs.
inline void amx_rows_tile(const uint16_t* x, int64_t K, const char* w0, const char* w1, int64_t chunks, int R,
                          int blocks, float* sums) {
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = static_cast<uint8_t>(R);
  cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[2] = 64;
  cfg.rows[3] = cfg.rows[4] = 16;
  cfg.colsb[3] = cfg.colsb[4] = 64;
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(2, x + c * 32, K * 2);
    _tile_loadd(3, w0 + c * 1024, 64);
    _tile_dpbf16ps(0, 2, 3);
    if (blocks == 2) {
      _tile_loadd(4, w1 + c * 1024, 64);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  _tile_stored(0, sums, blocks * 64);
  if (blocks == 2) _tile_stored(1, sums + 16, blocks * 64);
  _tile_release();
}
#endif

constexpr int kRowTile = 8;
// Rows from which the AMX tiles run (where the CPU and the kernel allow): the vector loop is bound by
// `vdpbf16ps` beyond a few rows.
constexpr int64_t kAmxFromRows = 3;
// Column-block pairs a thread takes at least: ~64k products (a smaller product stays on one thread).
constexpr int64_t kRowsGrainProducts = 1 << 16;

}  // namespace

// x [..., K] @ W.T (+ bias [N]) as a new [..., N] tensor, W held as packed [NB, KP, 16, 2] (2 * KP = K, or K + 1
// with a zero column: x is then padded here), all bfloat16, the pack contiguous (x and bias made so here).
at::Tensor bf16_rows_matmul(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t N) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.dim() >= 1, "x: bfloat16 [..., K]");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == 16 &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "packed: contiguous bfloat16 [NB, KP, 16, 2]");
  const int64_t K_in = x_in.size(-1), NB = packed.size(0), KP = packed.size(1);
  TORCH_CHECK(K_in == 2 * KP || K_in + 1 == 2 * KP, "x has ", K_in, " columns, the pack ", 2 * KP);
  TORCH_CHECK(N <= NB * 16 && N > (NB - 1) * 16, N, " outputs asked of a pack of ", NB * 16);
  const int64_t R = K_in == 0 ? 0 : x_in.numel() / K_in;
  at::Tensor x = x_in.reshape({R, K_in}).contiguous();
  if (K_in != 2 * KP) x = at::constant_pad_nd(x, {0, 1});
  at::Tensor out = output_like(x_in, N);
  const at::Tensor b = checked_bias(bias, N, at::kBFloat16);
  const bool has_bias = b.defined();
  if (R == 0 || N == 0) return out;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const __m512i* wp = reinterpret_cast<const __m512i*>(packed.data_ptr<at::BFloat16>());
  const uint16_t* bp = has_bias ? reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t block_pairs = (NB + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, kRowsGrainProducts / std::max<int64_t>(KP * 64 * R, 1));
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const bool amx = R >= kAmxFromRows && KP % 16 == 0 && amx_permitted();
#else
  const bool amx = false;
#endif
  at::parallel_for(0, block_pairs, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float sums[16 * 2 * 16];
    for (int64_t bpair = b0; bpair < b1; ++bpair) {
      const int64_t nb = bpair * 2;
      const int blocks = nb + 1 < NB ? 2 : 1;
      const int64_t tile_rows = amx ? 16 : kRowTile;
      for (int64_t r0 = 0; r0 < R; r0 += tile_rows) {
        const int rows = static_cast<int>(std::min<int64_t>(tile_rows, R - r0));
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (amx) {
          const char* w = reinterpret_cast<const char*>(wp + nb * KP);
          amx_rows_tile(reinterpret_cast<const uint16_t*>(xp + r0 * KP), 2 * KP, w, w + KP * 64, KP / 16, rows, blocks,
                        sums);
        } else
#endif
        if (blocks == 2) {
          rows_tile_of<2>(rows, xp + r0 * KP, KP, wp + nb * KP, KP, KP, sums);
        } else {
          rows_tile_of<1>(rows, xp + r0 * KP, KP, wp + nb * KP, KP, KP, sums);
        }
        for (int r = 0; r < rows; ++r) {
          for (int c = 0; c < blocks; ++c) {
            const int64_t n0 = (nb + c) * 16;
            const int64_t cols = std::min<int64_t>(16, N - n0);
            if (cols <= 0) continue;
            const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
            __m512 v = _mm512_load_ps(sums + (r * blocks + c) * 16);
            if (bp != nullptr) {
              const __m512i b16 = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bp + n0));
              v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(b16, 16)));
            }
            const __m256i rounded = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
            _mm256_mask_storeu_epi16(yp + (r0 + r) * N + n0, mask, rounded);
          }
        }
      }
    }
  });
  return out;
}

bool bf16_rows_amx() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted();
#else
  return false;
#endif
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
namespace {

#if defined(__AVX512F__)
// Rows [0, RT) of x (float32, `x_stride` a row) times CB column blocks of the float32 row pack ([K, 16] a block):
// each column's sum is one chain of fused multiply-adds over k in order, into `sums` [RT][CB][16].
template <int RT, int CB, bool LEAD>
inline void f32_rows_tile(const float* x, int64_t x_stride, const float* w, int64_t K, int64_t block_stride,
                          float* sums, bool first) {
  __m512 acc[RT][CB];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CB; ++c) acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + (r * CB + c) * 16);
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[CB];
    for (int c = 0; c < CB; ++c) {
      // the next column blocks' same line (they follow these in the pack): weights stream from memory
      _mm_prefetch(reinterpret_cast<const char*>(w + (CB + c) * block_stride + k * 16), _MM_HINT_T1);
      wv[c] = _mm512_loadu_ps(w + c * block_stride + k * 16);
    }
    for (int r = 0; r < RT; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * x_stride + k]);
      for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_fmadd_ps(a, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CB; ++c) _mm512_storeu_ps(sums + (r * CB + c) * 16, acc[r][c]);
}

// Row `r`'s `cols` (<= 16) sums of a block plus the bias, stored.
inline void f32_store_block(const float* sums, const float* bias, float* y, int64_t cols) {
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  __m512 v = _mm512_loadu_ps(sums);
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  _mm512_mask_storeu_ps(y, mask, v);
}

constexpr int64_t kF32Lanes = 16;
constexpr int kF32RowTile = 8;
constexpr int kF32Blocks = 2;  // column blocks a tile: 8 rows x 2 blocks = 16 of the 32 zmm registers
// K in one pass: as measured on Zen 4 (the chunked pass below was measured on AVX2 only).
constexpr int64_t kF32KChunk = int64_t{1} << 40;
#else
// AVX2 + FMA (e.g. AMD Zen 3): the same tile with a block's 16 columns as two 8-lane halves, each column's sum
// the same chain of fused multiply-adds over k in order (so the same bits as the AVX-512 tile). `first`: the
// sums start at zero (else they go on from `sums`); `LEAD`: the first row tile over this stretch of K, which
// asks for the block's lines ahead (the later tiles find them in L1).
template <int RT, int CB, bool LEAD>
inline void f32_rows_tile(const float* x, int64_t x_stride, const float* w, int64_t K, int64_t block_stride,
                          float* sums, bool first) {
  __m256 acc[RT][CB][2];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CB; ++c)
      for (int h = 0; h < 2; ++h)
        acc[r][c][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + (r * CB + c) * 16 + h * 8);
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[CB][2];
    for (int c = 0; c < CB; ++c) {
      if constexpr (LEAD) _mm_prefetch(reinterpret_cast<const char*>(w + c * block_stride + (k + 32) * 16), _MM_HINT_T0);
      wv[c][0] = _mm256_loadu_ps(w + c * block_stride + k * 16);
      wv[c][1] = _mm256_loadu_ps(w + c * block_stride + k * 16 + 8);
    }
    for (int r = 0; r < RT; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * x_stride + k);
      for (int c = 0; c < CB; ++c) {
        acc[r][c][0] = _mm256_fmadd_ps(a, wv[c][0], acc[r][c][0]);
        acc[r][c][1] = _mm256_fmadd_ps(a, wv[c][1], acc[r][c][1]);
      }
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CB; ++c) {
      _mm256_storeu_ps(sums + (r * CB + c) * 16, acc[r][c][0]);
      _mm256_storeu_ps(sums + (r * CB + c) * 16 + 8, acc[r][c][1]);
    }
}

inline void f32_store_block(const float* sums, const float* bias, float* y, int64_t cols) {
  for (int64_t i = 0; i < cols; ++i) y[i] = bias != nullptr ? sums[i] + bias[i] : sums[i];
}

constexpr int64_t kF32Lanes = 8;
constexpr int kF32RowTile = 6;
constexpr int kF32Blocks = 1;  // 6 rows x 2 halves = 12 accumulators, 2 weights and a broadcast: 15 of 16 ymm
// K in stretches of 128 (8 KB of a block's weights, 8 KB of 16 rows' x): every row tile reads a stretch from L1
// while the first one streams it from memory, where one pass over K per tile read it from L2 or memory again
// (1.3-2x faster from 9 rows on the small model's shapes; docs/design.md, "AVX2-only CPUs").
constexpr int64_t kF32KChunk = 128;
#endif

template <int CB>
void f32_rows_tile_of(int rows, const float* x, int64_t x_stride, const float* w, int64_t K, int64_t stride,
                      float* sums, bool first, bool lead) {
  with_row_count(rows, [&](auto rt) {
    if constexpr (decltype(rt)::value <= kF32RowTile) {
      if (lead) {
        f32_rows_tile<decltype(rt)::value, CB, true>(x, x_stride, w, K, stride, sums, first);
      } else {
        f32_rows_tile<decltype(rt)::value, CB, false>(x, x_stride, w, K, stride, sums, first);
      }
    }
  });
}

// R rows [0, R) times the column blocks [nb, nb + CB): sums [R][CB][16], over K in stretches of `kF32KChunk`,
// the rows in tiles of near-equal size (at most `kF32RowTile`: 16 rows on AVX2 are 6 + 5 + 5, not 6 + 6 + 4).
template <int CB>
void f32_rows_group(int64_t R, const float* x, const float* w, int64_t K, float* sums) {
  const int64_t tiles = (R + kF32RowTile - 1) / kF32RowTile;
  for (int64_t k0 = 0; k0 < K; k0 += kF32KChunk) {
    const int64_t kc = std::min<int64_t>(kF32KChunk, K - k0);
    int64_t r0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = (R - r0 + (tiles - t) - 1) / (tiles - t);
      f32_rows_tile_of<CB>(static_cast<int>(rows), x + r0 * K + k0, K, w + k0 * 16, kc, K * 16, sums + r0 * CB * 16,
                           k0 == 0, t == 0);
      r0 += rows;
    }
  }
}

constexpr int64_t kF32RowsGrainProducts = 1 << 16;

}  // namespace

// x [..., K] @ W.T (+ bias [N]) as a new [..., N] float32 tensor, W held as packed [NB, K, 16] float32 (16 output
// columns a block, zero padded), the pack contiguous (x and bias made so here).
at::Tensor f32_rows_matmul(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t N) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1, "x: float32 [..., K]");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == 16 && packed.is_contiguous(),
              "packed: contiguous float32 [NB, K, 16]");
  const int64_t K = x_in.size(-1), NB = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " columns, the pack ", packed.size(1));
  TORCH_CHECK(N <= NB * 16 && N > (NB - 1) * 16, N, " outputs asked of a pack of ", NB * 16);
  const int64_t R = K == 0 ? 0 : x_in.numel() / K;
  const at::Tensor x = x_in.reshape({R, K}).contiguous();
  at::Tensor out = output_like(x_in, N);
  const at::Tensor b = checked_bias(bias, N, at::kFloat);
  const bool has_bias = b.defined();
  if (R == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  const int64_t groups = (NB + kF32Blocks - 1) / kF32Blocks;
  const int64_t grain = std::max<int64_t>(1, kF32RowsGrainProducts / std::max<int64_t>(K * 16 * kF32Blocks * R, 1));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    std::vector<float> sums(R * kF32Blocks * 16);
    for (int64_t group = g0; group < g1; ++group) {
      const int64_t nb = group * kF32Blocks;
      const int blocks = static_cast<int>(std::min<int64_t>(kF32Blocks, NB - nb));
      if (blocks == kF32Blocks) {
        f32_rows_group<kF32Blocks>(R, xp, wp + nb * K * 16, K, sums.data());
      } else {
        f32_rows_group<1>(R, xp, wp + nb * K * 16, K, sums.data());
      }
      for (int64_t r = 0; r < R; ++r) {
        for (int c = 0; c < blocks; ++c) {
          const int64_t n0 = (nb + c) * 16;
          const int64_t cols = std::min<int64_t>(16, N - n0);
          if (cols <= 0) continue;
          f32_store_block(sums.data() + (r * blocks + c) * 16, bp != nullptr ? bp + n0 : nullptr, yp + r * N + n0,
                          cols);
        }
      }
    }
  });
  return out;
}

// The float32 product's vector width: its row limit was measured per width (runner/products/small_rows.py).
int64_t f32_rows_lanes() { return kF32Lanes; }
#endif
"""

ROWS_BINDINGS = r"""
#if defined(__AVX512BF16__)
  m.def("bf16_rows_matmul", &bf16_rows_matmul, "out = x @ W.T + bias for a few bfloat16 rows, W in its row pack");
  m.def("bf16_rows_amx", &bf16_rows_amx, "whether the small-row product runs AMX tiles (K a multiple of 32)");
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  m.def("f32_rows_matmul", &f32_rows_matmul, "out = x @ W.T + bias for a few float32 rows, W in its float32 row pack");
  m.def("f32_rows_lanes", &f32_rows_lanes, "the float32 small-row product's vector width: 16 (AVX-512) or 8 (AVX2)");
#endif
"""
