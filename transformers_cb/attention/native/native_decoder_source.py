"""C++ source of the native decoder-layer step (built into the same library as the paged-attention kernel).

`decoder_layer(...)`: one Llama-form decoder layer on a step whose every token the native kernel attends, as
runner/layer_ops/direct_layer.py decided it: the input RMSNorm, the q/k/v products (one fused product split,
or one each), rotary on q and k, the new K/V written at their slots, the paged attention, the output
product, the residual add with the second RMSNorm, the gate/up products, SiLU·mul, the down product and the
last residual add. Each step is the call the Python path makes (the library's own `rms_norm`, `rotary`,
`add_rms_norm`, `silu_mul`, `paged_attention`, `bf16_rows_matmul`; torch's `linear`, `add`; the K/V rows written by `write_slots`;
oneDNN's `mkldnn::_linear_pointwise` through the dispatcher): the same bits, in one call instead of ~40
from Python (a few microseconds each on these machines). With `tile_rows` under the call's tokens it runs
the layer on tiles of that many rows, one after another (layer_plan.py `row_tile`, docs/design.md "Row tiles").

A product is given as (kind, tensor, bias, width, GGUF type): kind 0 `linear(x, weight, bias)`, 1 oneDNN's
product on its packed weight, 2 the small-row product on its row pack (bfloat16 or float32, native_rows_source.py;
only where that is built), 3 `QuantizedLinear`'s forward on rows its native product takes (`quant_matmul` over the blocks,
native_quant_source.py, then the bias added in the output's dtype).
"""

DECODER_SOURCE = r"""
namespace {

at::Tensor onednn_product(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         c10::string_view, c10::List<c10::optional<at::Scalar>>,
                                         c10::optional<c10::string_view>)>();
  return op.call(x.contiguous(), packed, bias, "none", c10::List<c10::optional<at::Scalar>>(),
                 c10::optional<c10::string_view>(""));
}

// QuantizedLinear.forward (runner/products/quantized_linear.py) where its product is `quant_matmul`.
at::Tensor quantized_layer_product(const at::Tensor& x, const at::Tensor& blocks, const c10::optional<at::Tensor>& bias,
                                   int64_t out_features, int64_t qtype) {
  at::Tensor out = quant_matmul(x.reshape({-1, x.size(-1)}), blocks, qtype);
  if (bias.has_value()) out = out + bias->to(out.scalar_type());
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out_features;
  return out.reshape(sizes);
}

at::Tensor layer_product(int64_t kind, const at::Tensor& x, const at::Tensor& tensor,
                         const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t qtype) {
  if (kind == 0) return at::linear(x, tensor, bias);
  if ((kind == 1 || kind == 2) && tensor.scalar_type() == at::kFloat && x.scalar_type() == at::kBFloat16) {
    // a bf16 weight packed in float32 (where oneDNN refuses bf16: packed_linear.pack_dtype): the float32
    // product on the widened rows, rounded once to bf16
    c10::optional<at::Tensor> wide_bias;
    if (bias.has_value()) wide_bias = bias->to(at::kFloat);
    return layer_product(kind, x.to(at::kFloat), tensor, wide_bias, out_features, qtype).to(at::kBFloat16);
  }
  if (kind == 1) return onednn_product(x, tensor, bias);
  if (kind == 3) return quantized_layer_product(x, tensor, bias, out_features, qtype);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (tensor.scalar_type() == at::kFloat) return f32_rows_matmul(x, tensor, bias, out_features);
#endif
#if defined(__AVX512BF16__)
  return bf16_rows_matmul(x, tensor, bias, out_features);
#else
  TORCH_CHECK(false, "the small-row product of this dtype is not built here");
#endif
}

// Products [first, first + count) of the lists on x: one fused product split at `split`, or one each.
std::vector<at::Tensor> layer_products(const at::Tensor& x, const std::vector<int64_t>& kinds,
                                       const std::vector<at::Tensor>& tensors,
                                       const std::vector<c10::optional<at::Tensor>>& biases,
                                       const std::vector<int64_t>& outs, const std::vector<int64_t>& qtypes,
                                       int64_t first, int64_t count, const std::vector<int64_t>& split) {
  if (count == 1 && split.size() > 1) {
    return at::split_with_sizes(
        layer_product(kinds[first], x, tensors[first], biases[first], outs[first], qtypes[first]), split, -1);
  }
  std::vector<at::Tensor> results;
  for (int64_t i = first; i < first + count; ++i)
    results.push_back(layer_product(kinds[i], x, tensors[i], biases[i], outs[i], qtypes[i]));
  return results;
}

}  // namespace

// hidden [1, T, E] contiguous; products in order q/k/v (`qkv_count` of them: 1 fused, split at `qkv_split`,
// or 3), o, gate/up (`gate_up_count`: 1 fused split at `gate_up_split`, or 2), down; cos / sin [1, T, D];
// storage the KV group's tensor [2, layers, pages, page_size, Hkv, D] and `layer` the layer's index in it.
// `cache.index_copy_(0, slots, rows)` for a step's K or V rows [T, Hkv, D] into cache [S, Hkv, D]: a copy of each
// head's D values, without index_copy_'s iterator set-up (~5 us a call, two a layer, at one decode row);
// index_copy_ itself where a row's heads are not D contiguous values of the cache's dtype.
void write_slots(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& rows) {
  if (rows.scalar_type() != cache.scalar_type() || slots.scalar_type() != at::kLong || !slots.is_contiguous() ||
      rows.dim() != 3 || rows.stride(2) != 1 || !cache.is_contiguous() || cache.dim() != 3 ||
      rows.size(1) != cache.size(1) || rows.size(2) != cache.size(2) || slots.numel() != rows.size(0)) {
    cache.index_copy_(0, slots, rows);
    return;
  }
  const int64_t tokens = rows.size(0), heads = rows.size(1), dim = rows.size(2), count = cache.size(0);
  const int64_t bytes = dim * static_cast<int64_t>(cache.element_size());
  const int64_t* slot = slots.data_ptr<int64_t>();
  const auto* from = static_cast<const char*>(rows.data_ptr());
  auto* to = static_cast<char*>(cache.data_ptr());
  const int64_t esize = cache.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < count, "slot ", slot[t], " is out of range for ", count, " cache rows");
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(to + ((slot[t] * heads + h) * dim) * esize, from + (t * rows.stride(0) + h * rows.stride(1)) * esize,
                  bytes);
  }
}

// The layer on `hidden`'s tokens in tiles of `tile_rows` (0: one call), each tile the whole layer in token
// order: a tile's tokens attend to the keys the tiles before it wrote. Every op is per token (the products
// per row, the attention per query token), so the tiles give the untiled call's bits; they keep a step of
// thousands of tokens' intermediates (the gate/up product's output) in cache (layer_plan.py, ROW_TILE_BYTES).
at::Tensor decoder_layer(const at::Tensor& hidden, const at::Tensor& input_weight, double input_eps, bool input_gemma,
                         const at::Tensor& post_weight, double post_eps, bool post_gemma,
                         const std::vector<int64_t>& kinds, const std::vector<at::Tensor>& tensors,
                         const std::vector<c10::optional<at::Tensor>>& biases, const std::vector<int64_t>& outs,
                         const std::vector<int64_t>& qtypes, int64_t qkv_count, const std::vector<int64_t>& qkv_split, int64_t gate_up_count,
                         const std::vector<int64_t>& gate_up_split, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t head_dim, const at::Tensor& storage, int64_t layer, const at::Tensor& slot_mapping,
                         const at::Tensor& token_row, const at::Tensor& token_pos, const at::Tensor& block_table,
                         int64_t page_size, double scale, int64_t window, int64_t tile_rows) {
  const int64_t count = qkv_count + 1 + gate_up_count + 1;
  // The layer on one span of the call's tokens (all of them, or a tile): its per-token inputs, shadowing the
  // call's.
  const auto span = [&](const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& slot_mapping, const at::Tensor& token_row, const at::Tensor& token_pos,
                        const c10::optional<at::Tensor>& into) -> at::Tensor {
    const int64_t tokens = hidden.size(1);
    at::Tensor normed = at::empty(hidden.sizes(), hidden.options());
    rms_norm(hidden, input_weight, input_eps, input_gemma, normed);

    const auto qkv = layer_products(normed, kinds, tensors, biases, outs, qtypes, 0, qkv_count, qkv_split);
    TORCH_CHECK(qkv.size() == 3, "q, k and v");
    const at::Tensor q = qkv[0].view({1, tokens, -1, head_dim});
    const at::Tensor k = qkv[1].view({1, tokens, -1, head_dim});
    const at::Tensor v = qkv[2].view({1, tokens, -1, head_dim});
    at::Tensor q_rot = at::empty(q.sizes(), hidden.options());
    at::Tensor k_rot = at::empty(k.sizes(), hidden.options());
    at::Tensor q_rot_t = q_rot.transpose(1, 2), k_rot_t = k_rot.transpose(1, 2);
    rotary(q.transpose(1, 2), cos, sin, q_rot_t);
    rotary(k.transpose(1, 2), cos, sin, k_rot_t);

    const int64_t kv_heads = storage.size(-2), dim = storage.size(-1);
    at::Tensor key_cache = storage.select(0, 0).select(0, layer).view({-1, kv_heads, dim});
    at::Tensor value_cache = storage.select(0, storage.size(0) - 1).select(0, layer).view({-1, kv_heads, dim});
    write_slots(key_cache, slot_mapping, k_rot[0]);
    write_slots(value_cache, slot_mapping, v[0]);
    const at::Tensor query = q_rot[0];
    at::Tensor attended = at::empty(query.sizes(), hidden.options());
    paged_attention(query, key_cache, value_cache, token_row, token_pos, block_table, page_size, scale, window, 0.0,
                    c10::nullopt, c10::nullopt, attended, c10::nullopt, c10::nullopt);
    const int64_t o = qkv_count;
    const at::Tensor attn_output =
        layer_product(kinds[o], attended.view({1, tokens, -1}), tensors[o], biases[o], outs[o], qtypes[o]);

    at::Tensor summed = at::empty(hidden.sizes(), hidden.options());
    at::Tensor post = at::empty(hidden.sizes(), hidden.options());
    add_rms_norm(hidden, attn_output, post_weight, post_eps, post_gemma, summed, post);

    const auto gate_up = layer_products(post, kinds, tensors, biases, outs, qtypes, o + 1, gate_up_count, gate_up_split);
    TORCH_CHECK(gate_up.size() == 2 && gate_up[0].sizes() == gate_up[1].sizes(), "gate and up of one shape");
    at::Tensor activated = at::empty(gate_up[0].sizes(), hidden.options());
    silu_mul(gate_up[0], gate_up[1], activated);
    const int64_t d = count - 1;
    const at::Tensor down = layer_product(kinds[d], activated, tensors[d], biases[d], outs[d], qtypes[d]);
    if (!into.has_value()) return summed + down;
    at::Tensor out = *into;
    at::add_out(out, summed, down);
    return out;
  };
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == count && static_cast<int64_t>(tensors.size()) == count &&
                  static_cast<int64_t>(biases.size()) == count && static_cast<int64_t>(outs.size()) == count &&
                  static_cast<int64_t>(qtypes.size()) == count,
              "one kind, tensor, bias, width and GGUF type per product");
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1 && hidden.is_contiguous(), "hidden: contiguous [1, T, E]");
  const int64_t tokens = hidden.size(1);
  if (tile_rows <= 0 || tile_rows >= tokens) {
    return span(hidden, cos, sin, slot_mapping, token_row, token_pos, c10::nullopt);
  }
  TORCH_CHECK(slot_mapping.numel() == tokens && token_row.numel() == tokens && token_pos.numel() == tokens &&
                  cos.dim() == 3 && cos.size(1) == tokens && sin.size(1) == tokens,
              "one slot, row, position, cos and sin per token");
  at::Tensor out = at::empty(hidden.sizes(), hidden.options());
  for (int64_t first = 0; first < tokens; first += tile_rows) {
    const int64_t rows = std::min(tile_rows, tokens - first);
    span(hidden.narrow(1, first, rows), cos.narrow(1, first, rows), sin.narrow(1, first, rows),
         slot_mapping.narrow(0, first, rows), token_row.narrow(0, first, rows), token_pos.narrow(0, first, rows),
         out.narrow(1, first, rows));
  }
  return out;
}
"""

DECODER_BINDINGS = r"""
  m.def("decoder_layer", &decoder_layer, "one Llama-form decoder layer step on the native paths, in one call");
"""
