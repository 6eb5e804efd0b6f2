// d9d/model/layers.cpp — RMSNorm, rotary embeddings, attention and SwiGLU modules.
#include <atomic>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include <ATen/ATen.h>

#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/kernels/rms_norm.hpp>
#include <d9d/kernels/rope.hpp>
#include <d9d/model/layers.hpp>

namespace d9d::model {
namespace {
std::atomic<bool> fused{true};
}  // namespace

void set_fused_kernels(bool enabled) { fused = enabled; }
bool fused_kernels() { return fused; }

RmsNormImpl::RmsNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RmsNormImpl::forward(const at::Tensor& x) {
  const auto in = x.scalar_type();
  const bool reduced = in == at::kBFloat16 || in == at::kHalf;
  // A float32 weight is read as it is by a bfloat16 or half input (no cast, and its gradient comes
  // back in float32); other dtypes are cast to the input's.
  const bool takes_weight =
      weight.scalar_type() == in || (reduced && weight.scalar_type() == at::kFloat);
  // Under autocast a float32 input (mixed precision's residual stream) is normalised into
  // autocast's dtype: the matmuls that read the output would each cast it to that dtype anyway.
  std::optional<at::ScalarType> out;
  if (in == at::kFloat && weight.scalar_type() == at::kFloat) {
    const auto dtype = d9d::detail::autocast_dtype(x);
    if (dtype == at::kBFloat16 || dtype == at::kHalf) {
      out = dtype;
    }
  }
  return d9d::kernels::rms_norm(x, takes_weight ? weight : weight.to(in), eps_, out);
}

RotaryEmbedding::RotaryEmbedding(int64_t head_dim, double theta)
    : head_dim_(head_dim), theta_(theta) {
  if (head_dim % 2 != 0) {
    throw std::invalid_argument("d9d::model::RotaryEmbedding: head_dim must be even, got " +
                                std::to_string(head_dim));
  }
}

std::pair<at::Tensor, at::Tensor> RotaryEmbedding::cos_sin(int64_t seq_len, c10::Device device,
                                                           at::ScalarType dtype) const {
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  // inv_freq[i] = theta^(-2i/d) and the angles, computed in double for an exact table.
  // On `device` from the start: no host-to-device copy, so a CUDA graph can capture the forward.
  const auto exponents = at::arange(0, head_dim_, 2, options) / static_cast<double>(head_dim_);
  const auto inv_freq = at::pow(theta_, -exponents);
  const auto angles = at::outer(at::arange(seq_len, options), inv_freq);  // [T, d/2]
  return {angles.cos().to(dtype), angles.sin().to(dtype)};
}

std::pair<at::Tensor, at::Tensor> RotaryEmbedding::cos_sin_at(const at::Tensor& positions,
                                                              at::ScalarType dtype) const {
  if (positions.dim() != 2 || positions.scalar_type() != at::kLong) {
    throw std::invalid_argument(
        "d9d::model::RotaryEmbedding::cos_sin_at: positions must be [B, T] int64, got " +
        std::to_string(positions.dim()) + " dimensions of " +
        std::string(c10::toString(positions.scalar_type())));
  }
  const auto flat = positions.reshape({-1});
  if (flat.numel() == 0) {
    return cos_sin(0, positions.device(), dtype);
  }
  const int64_t first = flat.min().item<int64_t>();
  if (first < 0) {
    throw std::invalid_argument("d9d::model::RotaryEmbedding::cos_sin_at: position " +
                                std::to_string(first) + " is negative");
  }
  const auto [cos, sin] = cos_sin(flat.max().item<int64_t>() + 1, positions.device(), dtype);
  return {cos.index_select(0, flat), sin.index_select(0, flat)};
}

at::ScalarType RotaryEmbedding::table_dtype(at::ScalarType activations) {
  return activations == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor RotaryEmbedding::apply(const at::Tensor& x, const at::Tensor& cos,
                                  const at::Tensor& sin) {
  if (fused_kernels()) {
    return kernels::rope(x, cos, sin);
  }
  // The composition: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), tables over [T, 1, D].
  const int64_t half = x.size(-1) / 2;
  const auto c = at::cat({cos, cos}, -1).unsqueeze(1).to(x.scalar_type());
  const auto s = at::cat({sin, sin}, -1).unsqueeze(1).to(x.scalar_type());
  const auto rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rotated * s;
}

at::Tensor RotaryEmbedding::apply_per_token(const at::Tensor& x, const at::Tensor& cos,
                                            const at::Tensor& sin) {
  // The kernels take the position of a row from its index along dim -3: as one sequence of
  // B * T tokens, token b * T + t reads table row b * T + t.
  const auto sizes = x.sizes().vec();
  const auto flat = x.reshape({1, sizes[0] * sizes[1], sizes[2], sizes[3]});
  return apply(flat, cos, sin).view(sizes);
}

TokenPlacement place_tokens(const RotaryEmbedding& rope, const at::Tensor& positions,
                            const at::Tensor& key_valid, int64_t past, at::ScalarType table_dtype) {
  const int64_t batch = positions.size(0);
  const int64_t tokens = positions.size(1);
  if (key_valid.dim() != 2 || key_valid.size(0) != batch || key_valid.size(1) != past + tokens) {
    throw std::invalid_argument("d9d::model::place_tokens: key_valid must be [B, past + T] = [" +
                                std::to_string(batch) + ", " + std::to_string(past + tokens) + "]");
  }
  TokenPlacement where;
  std::tie(where.cos, where.sin) = rope.cos_sin_at(positions, table_dtype);
  const auto options = at::TensorOptions().dtype(at::kLong).device(positions.device());
  const auto slot = at::arange(past, past + tokens, options).unsqueeze(1);  // [T, 1]
  const auto key = at::arange(past + tokens, options).unsqueeze(0);         // [1, S]
  const auto causal = key.le(slot);                                         // [T, S]
  const auto visible = causal.unsqueeze(0).logical_and(key_valid.to(at::kBool).unsqueeze(1));
  where.visible = visible.logical_or(key.eq(slot).unsqueeze(0)).unsqueeze(1);
  where.past = past;
  return where;
}

TokenPlacement place_documents(const RotaryEmbedding& rope, const at::Tensor& document_ids,
                               at::ScalarType table_dtype) {
  if (document_ids.dim() != 2 || document_ids.scalar_type() != at::kLong) {
    throw std::invalid_argument("d9d::model::place_documents: document_ids must be [B, T] int64");
  }
  const int64_t tokens = document_ids.size(1);
  const auto options = at::TensorOptions().dtype(at::kLong).device(document_ids.device());
  const auto index = at::arange(tokens, options).expand_as(document_ids);
  // A document starts where its id differs from the previous token's; positions count from there.
  auto starts = at::ones_like(document_ids, at::kBool);
  if (tokens > 1) {
    starts.narrow(1, 1, tokens - 1)
        .copy_(document_ids.narrow(1, 1, tokens - 1).ne(document_ids.narrow(1, 0, tokens - 1)));
  }
  const auto start_index = std::get<0>(at::where(starts, index, 0).cummax(1));
  const auto positions = index - start_index;
  // Contiguous documents: a token's start must be its id's first occurrence in the row.
  const auto same = document_ids.unsqueeze(2).eq(document_ids.unsqueeze(1));  // [B, T, T]
  const auto same_start = start_index.unsqueeze(2).eq(start_index.unsqueeze(1));
  if (!same.eq(same_start).all().item<bool>()) {
    throw std::invalid_argument(
        "d9d::model::place_documents: a document id appears in two separate runs of a row; each "
        "document's tokens must be contiguous");
  }
  TokenPlacement where;
  std::tie(where.cos, where.sin) = rope.cos_sin_at(positions, table_dtype);
  const auto causal = at::ones({tokens, tokens}, options.dtype(at::kBool)).tril();
  where.visible = same.logical_and(causal.unsqueeze(0)).unsqueeze(1);
  return where;
}

AttentionImpl::AttentionImpl(const AttentionOptions& options) : options_(options) {
  if (options.num_heads % options.num_kv_heads != 0) {
    throw std::invalid_argument(
        "d9d::model::Attention: num_heads (" + std::to_string(options.num_heads) +
        ") must be a multiple of num_kv_heads (" + std::to_string(options.num_kv_heads) + ")");
  }
  const auto linear = [](int64_t in, int64_t out) { return Linear(in, out); };
  q_proj =
      register_module("q_proj", linear(options.hidden_size, options.num_heads * options.head_dim));
  k_proj = register_module("k_proj",
                           linear(options.hidden_size, options.num_kv_heads * options.head_dim));
  v_proj = register_module("v_proj",
                           linear(options.hidden_size, options.num_kv_heads * options.head_dim));
  o_proj =
      register_module("o_proj", linear(options.num_heads * options.head_dim, options.hidden_size));
  if (options.qk_norm) {
    q_norm = register_module("q_norm", RmsNorm(options.head_dim, options.rms_norm_eps));
    k_norm = register_module("k_norm", RmsNorm(options.head_dim, options.rms_norm_eps));
  }
}

at::Tensor AttentionImpl::forward(const at::Tensor& x,
                                  const std::pair<at::Tensor, at::Tensor>& cos_sin) {
  // Under tensor parallelism the attention of this rank's heads: project gathers the input (its
  // gradient summed over the group), output sums the heads' parts over the group.
  return forward_heads(x, cos_sin);
}

void AttentionImpl::set_tensor_parallel(std::shared_ptr<const TensorParallelGroup> group) {
  if (tp_) {
    throw std::logic_error("d9d::model::Attention: tensor parallelism is already set");
  }
  const int64_t ranks = group->size();
  if (options_.num_heads % ranks != 0 || options_.num_kv_heads % ranks != 0) {
    throw std::invalid_argument("d9d::model::Attention: tensor parallelism over " +
                                std::to_string(ranks) + " ranks needs it to divide num_heads (" +
                                std::to_string(options_.num_heads) + ") and num_kv_heads (" +
                                std::to_string(options_.num_kv_heads) + ")");
  }
  options_.num_heads /= ranks;
  options_.num_kv_heads /= ranks;
  tp_ = std::move(group);
}

void AttentionImpl::set_context_parallel(std::shared_ptr<const ContextParallelGroup> group) {
  if (cp_) {
    throw std::logic_error("d9d::model::Attention: context parallelism is already set");
  }
  cp_ = std::move(group);
}

at::Tensor AttentionImpl::forward_placed(const at::Tensor& x, const TokenPlacement& where,
                                         KvCacheLayer* cache) {
  return placed_heads(x, where, cache);
}

at::Tensor AttentionImpl::output(const at::Tensor& attended) {
  // Under tensor parallelism o_proj is row-parallel: its partial outputs summed over the group
  // (reduce_out), overlapped under sequence parallelism.
  return tp_ ? linear_scattered(attended, *o_proj, *tp_) : o_proj(attended);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> AttentionImpl::project(const at::Tensor& x) {
  const int64_t dim = options_.head_dim;
  // Under tensor parallelism x is gathered first (copy_in), with the gather overlapped under
  // sequence parallelism.
  const auto qkv =
      tp_ ? fan_out_linear_gathered(x, {q_proj.get(), k_proj.get(), v_proj.get()}, *tp_)
          : fan_out_linear(x, {q_proj.get(), k_proj.get(), v_proj.get()});
  const int64_t batch = qkv[0].size(0);
  const int64_t seq = qkv[0].size(1);
  auto q = qkv[0].view({batch, seq, options_.num_heads, dim});
  auto k = qkv[1].view({batch, seq, options_.num_kv_heads, dim});
  auto v = qkv[2].view({batch, seq, options_.num_kv_heads, dim}).transpose(1, 2);
  if (options_.qk_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  return {std::move(q), std::move(k), std::move(v)};
}

at::Tensor AttentionImpl::placed_heads(const at::Tensor& x, const TokenPlacement& where,
                                       KvCacheLayer* cache) {
  const int64_t heads = options_.num_heads;
  const int64_t kv_heads = options_.num_kv_heads;
  const int64_t dim = options_.head_dim;
  if (!where.visible.defined() && where.past != 0) {
    throw std::invalid_argument(
        "d9d::model::Attention: tokens after cached ones need TokenPlacement::visible");
  }
  if (cp_ && (cache != nullptr || where.past != 0)) {
    throw std::invalid_argument(
        "d9d::model::Attention: under context parallelism there is no KV cache (training only)");
  }
  auto [q, k, v] = project(x);
  // [B, T, heads, d]; under tensor parallelism T counts the gathered tokens.
  const int64_t batch = q.size(0);
  const int64_t seq = q.size(1);
  q = RotaryEmbedding::apply_per_token(q, where.cos, where.sin).transpose(1, 2);
  k = RotaryEmbedding::apply_per_token(k, where.cos, where.sin).transpose(1, 2);
  if (cp_) {
    const auto attended = context_attention(q, k, v, where.visible, *cp_);
    return output(attended.transpose(1, 2).reshape({batch, seq, heads * dim}));
  }
  if (cache != nullptr) {
    const int64_t end = where.past + seq;
    if (end > cache->keys.size(2)) {
      throw std::invalid_argument("d9d::model::Attention: the KV cache holds " +
                                  std::to_string(cache->keys.size(2)) + " positions, " +
                                  std::to_string(end) + " are needed");
    }
    cache->keys.narrow(2, where.past, seq).copy_(k);
    cache->values.narrow(2, where.past, seq).copy_(v);
    k = cache->keys.narrow(2, 0, end);
    v = cache->values.narrow(2, 0, end);
  }
  const auto attended = at::scaled_dot_product_attention(
      q, k, v, where.visible, /*dropout_p=*/0.0, /*is_causal=*/!where.visible.defined(),
      /*scale=*/std::nullopt, /*enable_gqa=*/kv_heads != heads);
  return output(attended.transpose(1, 2).reshape({batch, seq, heads * dim}));
}

at::Tensor AttentionImpl::forward_heads(const at::Tensor& x,
                                        const std::pair<at::Tensor, at::Tensor>& cos_sin) {
  const int64_t heads = options_.num_heads;
  const int64_t kv_heads = options_.num_kv_heads;
  const int64_t dim = options_.head_dim;
  if (cp_) {
    throw std::logic_error(
        "d9d::model::Attention: under context parallelism the tokens are this rank's chunks and "
        "must be placed (forward_placed with their positions; Qwen3ForCausalLM::loss does it)");
  }
  auto [q, k, v] = project(x);
  const int64_t batch = q.size(0);
  const int64_t seq = q.size(1);
  // The rotation runs on [batch, seq, heads, dim] (the projections' layout); SDPA takes the head
  // transpose as a view.
  q = RotaryEmbedding::apply(q, cos_sin.first, cos_sin.second).transpose(1, 2);
  k = RotaryEmbedding::apply(k, cos_sin.first, cos_sin.second).transpose(1, 2);
  // Grouped-query attention: SDPA maps each group of query heads onto its KV head itself
  // (enable_gqa), so no repeated K/V copies are made.
  const auto attended = at::scaled_dot_product_attention(
      q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true, /*scale=*/std::nullopt,
      /*enable_gqa=*/kv_heads != heads);
  return output(attended.transpose(1, 2).reshape({batch, seq, heads * dim}));
}

SwiGluImpl::SwiGluImpl(int64_t hidden_size, int64_t intermediate_size) {
  const auto linear = [](int64_t in, int64_t out) { return Linear(in, out); };
  gate_proj = register_module("gate_proj", linear(hidden_size, intermediate_size));
  up_proj = register_module("up_proj", linear(hidden_size, intermediate_size));
  down_proj = register_module("down_proj", linear(intermediate_size, hidden_size));
}

// SwiGluImpl::forward is in split_linear.cpp, beside the fused nodes it chooses between.

void SwiGluImpl::set_tensor_parallel(std::shared_ptr<const TensorParallelGroup> group) {
  if (tp_) {
    throw std::logic_error("d9d::model::SwiGlu: tensor parallelism is already set");
  }
  tp_ = std::move(group);
}

}  // namespace d9d::model
