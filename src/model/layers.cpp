// d9d/model/layers.cpp — RMSNorm, rotary embeddings, attention and SwiGLU modules.
#include <atomic>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/ATen.h>

#include <d9d/kernels/rms_norm.hpp>
#include <d9d/kernels/rope.hpp>
#include <d9d/kernels/silu_mul.hpp>
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
  return d9d::kernels::rms_norm(x, weight.to(x.scalar_type()), eps_);
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
  const auto exponents = at::arange(0, head_dim_, 2, at::TensorOptions().dtype(at::kDouble)) /
                         static_cast<double>(head_dim_);
  const auto inv_freq = at::pow(theta_, -exponents).to(options);
  const auto angles = at::outer(at::arange(seq_len, options), inv_freq);  // [T, d/2]
  return {angles.cos().to(dtype), angles.sin().to(dtype)};
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
  if (tp_) {
    // The attention of this rank's heads; the input's gradient is summed over the group.
    const auto out = forward_heads(tp_->copy_in(x), cos_sin);
    return tp_->reduce_out(out);
  }
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

at::Tensor AttentionImpl::forward_heads(const at::Tensor& x,
                                        const std::pair<at::Tensor, at::Tensor>& cos_sin) {
  const int64_t batch = x.size(0);
  const int64_t seq = x.size(1);
  const int64_t heads = options_.num_heads;
  const int64_t kv_heads = options_.num_kv_heads;
  const int64_t dim = options_.head_dim;
  auto q = q_proj(x).view({batch, seq, heads, dim});
  auto k = k_proj(x).view({batch, seq, kv_heads, dim});
  auto v = v_proj(x).view({batch, seq, kv_heads, dim}).transpose(1, 2);
  if (options_.qk_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  // The rotation runs on [batch, seq, heads, dim] (the projections' layout); SDPA takes the head
  // transpose as a view.
  q = RotaryEmbedding::apply(q, cos_sin.first, cos_sin.second).transpose(1, 2);
  k = RotaryEmbedding::apply(k, cos_sin.first, cos_sin.second).transpose(1, 2);
  // Grouped-query attention: SDPA maps each group of query heads onto its KV head itself
  // (enable_gqa), so no repeated K/V copies are made.
  const auto attended = at::scaled_dot_product_attention(
      q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true, /*scale=*/std::nullopt,
      /*enable_gqa=*/kv_heads != heads);
  return o_proj(attended.transpose(1, 2).reshape({batch, seq, heads * dim}));
}

SwiGluImpl::SwiGluImpl(int64_t hidden_size, int64_t intermediate_size) {
  const auto linear = [](int64_t in, int64_t out) { return Linear(in, out); };
  gate_proj = register_module("gate_proj", linear(hidden_size, intermediate_size));
  up_proj = register_module("up_proj", linear(hidden_size, intermediate_size));
  down_proj = register_module("down_proj", linear(intermediate_size, hidden_size));
}

at::Tensor SwiGluImpl::forward(const at::Tensor& x) {
  const auto in = tp_ ? tp_->copy_in(x) : x;
  at::Tensor out;
  if (!fused_kernels()) {
    out = down_proj(at::silu(gate_proj(in)) * up_proj(in));
  } else if (!down_proj->bias.defined() && !down_proj->adapter) {
    // The product silu(gate) * up is recomputed in backward, not kept (silu_mul_linear).
    out = silu_mul_linear(gate_proj(in), up_proj(in), down_proj->weight);
  } else {
    out = down_proj(kernels::silu_mul(gate_proj(in), up_proj(in)));
  }
  return tp_ ? tp_->reduce_out(out) : out;
}

void SwiGluImpl::set_tensor_parallel(std::shared_ptr<const TensorParallelGroup> group) {
  if (tp_) {
    throw std::logic_error("d9d::model::SwiGlu: tensor parallelism is already set");
  }
  tp_ = std::move(group);
}

}  // namespace d9d::model
