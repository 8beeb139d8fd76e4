"""C++ source of the native paged-attention kernel's dispatch and entry point, spliced by native_source.py after
the portable kernels and the vector ones (native_vec_source.py, native_vec8_source.py): which kernel a step's
shape and cache take (`vec_for_group` / `tile_for`: the vector kernels of either width; `attend_for`: head sizes
64 / 128 and groups up to 8 on the fixed or vector kernels, `attend_q8_for`: an int8 cache's instances), the
step's lanes over the threads (`run_step`), and `paged_attention`, the function the library binds (its dtype and
layout checks, an int8 cache's scales).
"""

DISPATCH_SOURCE = r"""
#if defined(TCB_VECTOR_KERNELS)
// (the vector kernels of either width: native_vec_source.py, native_vec8_source.py)
// The tile kernel for this dtype and head size where the per-token kernel is attend_vec (whose bits it
// keeps), or nullptr.
template <typename T, typename KV>
AttendTile<T> tile_for(int64_t group, int64_t head_dim) {
  constexpr bool takes = (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) && std::is_same_v<KV, T>;
  if constexpr (takes) {
    if (group < 1 || group > 8) return nullptr;
    if (head_dim == 64) return attend_tile<T, 64>;
    if (head_dim == 128) return attend_tile<T, 128>;
  }
  return nullptr;
}

// The vector kernel for this dtype, group and head size (and cache rows: the model's dtype or int8), or
// nullptr where it does not apply.
template <typename T, int D, typename KV = T>
Attend<T> vec_for_group(int64_t group) {
  constexpr bool takes = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
  if constexpr (takes) {
    switch (group) {
      case 1: return attend_vec<T, 1, D, KV>;
      case 2: return attend_vec<T, 2, D, KV>;
      case 3: return attend_vec<T, 3, D, KV>;
      case 4: return attend_vec<T, 4, D, KV>;
      case 5: return attend_vec<T, 5, D, KV>;
      case 6: return attend_vec<T, 6, D, KV>;
      case 7: return attend_vec<T, 7, D, KV>;
      case 8: return attend_vec<T, 8, D, KV>;
      default: return nullptr;
    }
  }
  return nullptr;
}
#endif

template <typename T, int D>
Attend<T> fixed_for_group(int64_t group) {
#if defined(TCB_VECTOR_KERNELS)
  if (const Attend<T> vec = vec_for_group<T, D>(group)) return vec;
#endif
  switch (group) {
    case 1: return attend_fixed<T, 1, D>;
    case 2: return attend_fixed<T, 2, D>;
    case 3: return attend_fixed<T, 3, D>;
    case 4: return attend_fixed<T, 4, D>;
    case 5: return attend_fixed<T, 5, D>;
    case 6: return attend_fixed<T, 6, D>;
    case 7: return attend_fixed<T, 7, D>;
    case 8: return attend_fixed<T, 8, D>;
    default: return attend_one<T>;
  }
}

// The kernel of this step's shape: a fixed one for head sizes 64 / 128 and groups up to 8 (the vector
// kernel where the library has one: AVX-512, or AVX2 + FMA).
template <typename T>
Attend<T> attend_for(int64_t group, int64_t head_dim) {
  if (head_dim == 64) return fixed_for_group<T, 64>(group);
  if (head_dim == 128) return fixed_for_group<T, 128>(group);
  return attend_one<T>;
}

// The kernel of an int8 cache's step: the vector kernel's int8 instance where it applies, else attend_one's.
template <typename T>
Attend<T> attend_q8_for(int64_t group, int64_t head_dim) {
#if defined(TCB_VECTOR_KERNELS)
  if (head_dim == 64) {
    if (const Attend<T> vec = vec_for_group<T, 64, int8_t>(group)) return vec;
  }
  if (head_dim == 128) {
    if (const Attend<T> vec = vec_for_group<T, 128, int8_t>(group)) return vec;
  }
#endif
  return attend_one<T, int8_t>;
}

// A step holding prefill chunks on the tile kernel: its tokens cut into tiles (runs of one row's consecutive
// positions, kTileTokens at most; a decode is a tile of one, on `attend`), the (tile, kv head) items handed out
// longest first to whichever lane is free. False, having done nothing, when no tile holds two tokens.
template <typename T>
bool run_tiles(const Step<T>& s, int64_t tokens, int64_t lanes, Attend<T> attend, AttendTile<T> tile) {
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (first token, tokens)
  bool several = false;
  for (int64_t t = 0; t < tokens;) {
    int64_t c = 1;
    while (t + c < tokens && c < kTileTokens && s.token_row[t + c] == s.token_row[t] &&
           s.token_pos[t + c] == s.token_pos[t] + c)
      ++c;
    tiles.emplace_back(t, c);
    several = several || c > 1;
    t += c;
  }
  if (!several) return false;
  std::vector<int64_t> order(tiles.size());
  std::iota(order.begin(), order.end(), 0);
  const auto cost = [&](int64_t i) { return tiles[i].second * (s.token_pos[tiles[i].first + tiles[i].second - 1] + 1); };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  const int64_t items = static_cast<int64_t>(tiles.size()) * s.kv_heads;
  std::atomic<int64_t> next{0};
  auto run_lanes = [&](int64_t, int64_t) {
    const FlushSubnormals flush;
    Scratch scratch;
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const auto [t0, count] = tiles[order[i / s.kv_heads]];
      const int64_t g = i % s.kv_heads;
      if (count == 1) {
        attend(s, t0, g, scratch);
      } else {
        tile(s, t0, count, g, scratch);
      }
    }
  };
  if (lanes <= 1) {
    run_lanes(0, 1);
  } else {
    at::parallel_for(0, lanes, 1, run_lanes);
  }
  return true;
}

// `key_scales` / `value_scales` [S, Hkv] float32: an int8 cache's (undefined tensors: a float cache).
template <typename T>
void run_step(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
              const at::Tensor& token_row, const at::Tensor& token_pos, const at::Tensor& block_table,
              int64_t page_size, double scale, int64_t window, double softcap, const float* sinks,
              const float* slopes, at::Tensor& out, const at::Tensor& key_scales, const at::Tensor& value_scales) {
  Step<T> s;
  s.q = query.data_ptr<T>(); s.q_stride_t = query.stride(0); s.q_stride_h = query.stride(1);
  const bool q8 = key_cache.scalar_type() == at::kChar;
  s.k = q8 ? nullptr : key_cache.data_ptr<T>(); s.v = q8 ? nullptr : value_cache.data_ptr<T>();
  s.k8 = q8 ? key_cache.data_ptr<int8_t>() : nullptr; s.v8 = q8 ? value_cache.data_ptr<int8_t>() : nullptr;
  s.k_scale = q8 ? key_scales.data_ptr<float>() : nullptr;
  s.v_scale = q8 ? value_scales.data_ptr<float>() : nullptr;
  s.scale_slot_stride = q8 ? key_scales.stride(0) : 0;
  s.slot_stride = key_cache.stride(0); s.kv_head_stride = key_cache.stride(1);
  s.token_row = token_row.data_ptr<int64_t>(); s.token_pos = token_pos.data_ptr<int64_t>();
  s.block_table = block_table.data_ptr<int32_t>(); s.table_stride = block_table.stride(0);
  s.sinks = sinks;
  s.slopes = slopes;
  s.out = out.data_ptr<T>();
  s.heads = query.size(1); s.kv_heads = key_cache.size(1); s.group = s.heads / s.kv_heads;
  s.head_dim = query.size(2); s.page_size = page_size; s.window = window;
  s.scale = static_cast<float>(scale); s.softcap = static_cast<float>(softcap);
  const int64_t tokens = query.size(0);
  const int64_t items = tokens * s.kv_heads;
  int64_t work = 0;  // keys read, summed over tokens: small steps stay on one thread (no barrier to wait on)
  for (int64_t t = 0; t < tokens; ++t) work += s.token_pos[t] - first_key(s.window, s.token_pos[t]) + 1;
  work *= s.heads * s.head_dim;
  // 2^16: one decode row of SmolLM2 (9 heads of 64) from ~114 keys on takes both cores; at ~300 keys one core
  // spent ~28 us a layer reading the K/V (2^18 kept it on one core up to ~450 keys; a step 8 % faster)
  const int64_t lanes = work < (1 << 16) ? 1 : std::min<int64_t>(at::get_num_threads(), items);
  const Attend<T> attend = q8 ? attend_q8_for<T>(s.group, s.head_dim) : attend_for<T>(s.group, s.head_dim);
  AttendTile<T> tile = nullptr;
#if defined(TCB_VECTOR_KERNELS)
  if (!q8 && s.window == 0) tile = tile_for<T, T>(s.group, s.head_dim);
#endif
  if (tile != nullptr && run_tiles(s, tokens, lanes, attend, tile)) return;
  const bool by_token = tokens >= 2 * lanes;
  auto run_lanes = [&](int64_t begin, int64_t end) {
    const FlushSubnormals flush;
    Scratch scratch;
    // Round robin: items are sorted by length (longest decodes first), so lanes get even shares. With enough
    // tokens a lane takes whole tokens, every KV head of each: a slot holds the token's heads side by side, so
    // one core reads (and its prefetcher streams) each slot's rows once, instead of two cores fetching the
    // same lines for a head each (SmolLM2's decode attention: 0.90x the time in the engine).
    for (int64_t lane = begin; lane < end; ++lane) {
      if (by_token) {
        for (int64_t t = lane; t < tokens; t += lanes)
          for (int64_t g = 0; g < s.kv_heads; ++g) attend(s, t, g, scratch);
      } else {
        for (int64_t i = lane; i < items; i += lanes) attend(s, i / s.kv_heads, i % s.kv_heads, scratch);
      }
    }
  };
  if (lanes <= 1) {
    run_lanes(0, 1);
  } else {
    at::parallel_for(0, lanes, 1, run_lanes);
  }
}

}  // namespace

bool vector_kernels() {
#if defined(TCB_VECTOR_KERNELS)
  return true;
#else
  return false;
#endif
}

// The vector kernels' width: 16 (AVX-512), 8 (AVX2 + FMA) or 0 (none built).
int64_t vector_lanes() {
#if defined(__AVX512F__)
  return 16;
#elif defined(TCB_VECTOR_KERNELS)
  return 8;
#else
  return 0;
#endif
}

// query [T, H, D] (last dim contiguous), key/value cache [S, Hkv, D] contiguous, out [T, H, D] contiguous,
// all of one dtype: float32, bfloat16 or float16; or int8 caches with their float32 scales [S, Hkv]
// (contiguous), the query and out of one of those dtypes.
void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& token_row, const at::Tensor& token_pos, const at::Tensor& block_table,
                     int64_t page_size, double scale, int64_t window, double softcap,
                     const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& slopes,
                     at::Tensor& out, const c10::optional<at::Tensor>& key_scales,
                     const c10::optional<at::Tensor>& value_scales) {
  const auto dtype = query.scalar_type();
  const bool q8 = key_cache.scalar_type() == at::kChar;
  at::Tensor k_scales, v_scales;
  if (q8) {
    TORCH_CHECK(value_cache.scalar_type() == at::kChar && out.scalar_type() == dtype, "int8 caches, query and out");
    TORCH_CHECK(key_scales.has_value() && value_scales.has_value(), "an int8 cache needs its scales");
    k_scales = *key_scales;
    v_scales = *value_scales;
    TORCH_CHECK(k_scales.scalar_type() == at::kFloat && v_scales.scalar_type() == at::kFloat, "float32 scales");
    TORCH_CHECK(k_scales.is_contiguous() && v_scales.is_contiguous() && k_scales.dim() == 2 &&
                    k_scales.size(0) == key_cache.size(0) && k_scales.size(1) == key_cache.size(1) &&
                    v_scales.sizes() == k_scales.sizes(),
                "scales [S, Hkv] contiguous, one per cache row and head");
  } else {
    TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype && out.scalar_type() == dtype,
                "query, caches and out must share one dtype");
  }
  TORCH_CHECK(query.stride(2) == 1 && key_cache.is_contiguous() && value_cache.is_contiguous(), "layout");
  TORCH_CHECK(out.is_contiguous() && block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "layout");
  TORCH_CHECK(token_row.scalar_type() == at::kLong && token_pos.scalar_type() == at::kLong, "int64 tokens");
  at::Tensor sink_values;
  if (sinks.has_value()) sink_values = sinks->to(at::kFloat).contiguous();
  const float* sink_data = sinks.has_value() ? sink_values.data_ptr<float>() : nullptr;
  at::Tensor slope_values;
  if (slopes.has_value()) slope_values = slopes->to(at::kFloat).contiguous();
  const float* slope_data = slopes.has_value() ? slope_values.data_ptr<float>() : nullptr;
  if (dtype == at::kFloat) {
    run_step<float>(query, key_cache, value_cache, token_row, token_pos, block_table, page_size, scale, window,
                    softcap, sink_data, slope_data, out, k_scales, v_scales);
  } else if (dtype == at::kBFloat16) {
    run_step<c10::BFloat16>(query, key_cache, value_cache, token_row, token_pos, block_table, page_size, scale,
                            window, softcap, sink_data, slope_data, out, k_scales, v_scales);
  } else if (dtype == at::kHalf) {
    run_step<c10::Half>(query, key_cache, value_cache, token_row, token_pos, block_table, page_size, scale,
                        window, softcap, sink_data, slope_data, out, k_scales, v_scales);
  } else {
    TORCH_CHECK(false, "float32, bfloat16 or float16 only, got ", dtype);
  }
}

"""
