// Split backward (d9d/core/weight_grad.hpp): for every layer type, I (input gradients, weight
// gradients queued) followed by W (the queue drained) gives the gradients of a full backward.
// And the step's weight casts (d9d/core/detail/weight_casts.hpp): one cast per weight and step,
// made again when the weight's values change.
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <d9d/core/detail/weight_casts.hpp>
#include <d9d/core/weight_grad.hpp>
#include <d9d/model/layers.hpp>
#include <d9d/model/qwen3.hpp>

namespace {

using Grads = std::map<std::string, at::Tensor>;
using Forward = std::function<at::Tensor(const at::Tensor&)>;

Grads grads_of(torch::nn::Module& module) {
  Grads out;
  for (const auto& item : module.named_parameters()) {
    out[item.key()] = item.value().grad().defined() ? item.value().grad().clone() : at::Tensor();
  }
  return out;
}

void zero_grads(torch::nn::Module& module) {
  for (auto& p : module.parameters()) {
    p.mutable_grad() = at::Tensor();
  }
}

// Loss weights that make every output element's gradient different.
at::Tensor loss_of(const at::Tensor& out) {
  const auto weights = at::linspace(-1.0, 2.0, out.numel(), out.options()).view(out.sizes());
  return (out * weights).sum();
}

struct Result {
  Grads params;
  at::Tensor input_grad;
};

Result full_backward(torch::nn::Module& module, const Forward& forward, const at::Tensor& x) {
  zero_grads(module);
  const auto input = x.detach().requires_grad_(x.is_floating_point());
  loss_of(forward(input)).backward();
  return {grads_of(module), input.is_floating_point() ? input.grad().clone() : at::Tensor()};
}

// I then W; also checks that after I the linear weights have no gradient yet and the queue holds
// their work.
Result split_backward(torch::nn::Module& module, const Forward& forward, const at::Tensor& x,
                      int expected_queued) {
  zero_grads(module);
  d9d::WeightGradQueue queue;
  const auto input = x.detach().requires_grad_(x.is_floating_point());
  at::Tensor out;
  {
    const d9d::RecordWeightGrads record(queue);
    out = forward(input);
  }
  {
    const d9d::DeferWeightGrads defer(queue);
    loss_of(out).backward();
  }
  EXPECT_EQ(static_cast<int>(queue.size()), expected_queued);
  for (const auto& item : module.named_parameters()) {
    const auto& name = item.key();
    const bool is_linear = name.find("proj") != std::string::npos ||
                           name.find("lm_head") != std::string::npos || name == "weight" ||
                           name == "bias";
    if (is_linear && item.value().requires_grad()) {
      EXPECT_FALSE(item.value().grad().defined()) << name << " has a gradient before W";
    }
  }
  const auto input_grad = input.is_floating_point() ? input.grad().clone() : at::Tensor();
  queue.drain();
  EXPECT_TRUE(queue.empty());
  return {grads_of(module), input_grad};
}

void expect_same(const Result& a, const Result& b, double rtol = 1e-5, double atol = 1e-6) {
  ASSERT_EQ(a.params.size(), b.params.size());
  for (const auto& [name, grad] : a.params) {
    const auto& other = b.params.at(name);
    ASSERT_EQ(grad.defined(), other.defined()) << name;
    if (grad.defined()) {
      EXPECT_TRUE(at::allclose(grad, other, rtol, atol))
          << name << " differs by " << (grad - other).abs().max().item<double>();
    }
  }
  ASSERT_EQ(a.input_grad.defined(), b.input_grad.defined());
  if (a.input_grad.defined()) {
    EXPECT_TRUE(at::allclose(a.input_grad, b.input_grad, rtol, atol));
  }
}

d9d::model::Qwen3Config tiny_config() {
  return {.vocab_size = 48,
          .hidden_size = 32,
          .intermediate_size = 48,
          .num_hidden_layers = 2,
          .num_attention_heads = 4,
          .num_key_value_heads = 2,
          .head_dim = 8,
          .tie_word_embeddings = false};
}

TEST(SplitBackward, LinearWithAndWithoutBias) {
  at::manual_seed(1);
  for (const bool bias : {false, true}) {
    d9d::model::Linear linear(12, 7, bias);
    const Forward forward = [&](const at::Tensor& x) { return linear(x); };
    for (const auto& x : {at::randn({5, 12}), at::randn({2, 3, 12})}) {
      expect_same(full_backward(*linear, forward, x),
                  split_backward(*linear, forward, x, /*expected_queued=*/1));
    }
  }
}

TEST(SplitBackward, RecordedButNotDeferredIsAFullBackward) {
  at::manual_seed(2);
  d9d::model::Linear linear(6, 4, true);
  const auto x = at::randn({3, 6});
  const Forward forward = [&](const at::Tensor& in) { return linear(in); };
  const auto reference = full_backward(*linear, forward, x);
  zero_grads(*linear);
  d9d::WeightGradQueue queue;
  const auto input = x.detach().requires_grad_(true);
  at::Tensor out;
  {
    const d9d::RecordWeightGrads record(queue);
    out = linear(input);
  }
  loss_of(out).backward();
  EXPECT_TRUE(queue.empty());
  expect_same(reference, {grads_of(*linear), input.grad()});
}

TEST(SplitBackward, FrozenWeightsQueueNothing) {
  at::manual_seed(3);
  d9d::model::Linear linear(6, 4, true);
  linear->weight.requires_grad_(false);
  linear->bias.requires_grad_(false);
  const Forward forward = [&](const at::Tensor& in) { return linear(in); };
  const auto x = at::randn({3, 6});
  expect_same(full_backward(*linear, forward, x), split_backward(*linear, forward, x, 0));
  EXPECT_FALSE(linear->weight.grad().defined());
}

TEST(SplitBackward, SwiGlu) {
  at::manual_seed(4);
  d9d::model::SwiGlu mlp(16, 24);
  const Forward forward = [&](const at::Tensor& x) { return mlp(x); };
  const auto x = at::randn({2, 5, 16});
  // gate and up read one input: one job (d9d::model::fan_out_linear); down another.
  expect_same(full_backward(*mlp, forward, x), split_backward(*mlp, forward, x, 2));
}

TEST(SplitBackward, AttentionWithQkNormAndGqa) {
  at::manual_seed(5);
  d9d::model::Attention attention(d9d::model::AttentionOptions{
      .hidden_size = 32, .num_heads = 4, .num_kv_heads = 2, .head_dim = 8});
  const d9d::model::RotaryEmbedding rope(8, 10000.0);
  const auto cos_sin = rope.cos_sin(6, at::kCPU);
  const Forward forward = [&](const at::Tensor& x) { return attention(x, cos_sin); };
  const auto x = at::randn({2, 6, 32});
  // q, k and v: one job (d9d::model::fan_out_linear); o another.
  expect_same(full_backward(*attention, forward, x), split_backward(*attention, forward, x, 2));
}

TEST(SplitBackward, DecoderLayer) {
  at::manual_seed(6);
  const auto config = tiny_config();
  d9d::model::Qwen3DecoderLayer layer(config);
  const d9d::model::RotaryEmbedding rope(config.head_dim, config.rope_theta);
  const auto cos_sin = rope.cos_sin(6, at::kCPU);
  const Forward forward = [&](const at::Tensor& x) { return layer(x, cos_sin); };
  const auto x = at::randn({2, 6, 32});
  expect_same(full_backward(*layer, forward, x), split_backward(*layer, forward, x, 4));
}

TEST(SplitBackward, WholeModelWithEmbeddingAndHead) {
  at::manual_seed(7);
  d9d::model::Qwen3ForCausalLM model(tiny_config());
  const Forward forward = [&](const at::Tensor& ids) { return model(ids); };
  const auto ids = at::randint(48, {2, 6}, at::kLong);
  // 4 jobs per layer (q/k/v, o, gate/up, down) and the LM head's
  expect_same(full_backward(*model, forward, ids), split_backward(*model, forward, ids, 2 * 4 + 1));
}

TEST(SplitBackward, AutocastComputesInTheAutocastDtypeLikeLinear) {
  at::manual_seed(8);
  d9d::model::Linear linear(16, 8);
  const auto x = at::randn({4, 16});
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  const auto input = x.detach().requires_grad_(true);
  const auto reference_out = at::linear(input, linear->weight);
  d9d::WeightGradQueue queue;
  at::Tensor out;
  {
    const d9d::RecordWeightGrads record(queue);
    out = linear(input);
  }
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(reference_out.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(out, reference_out));
  {
    const d9d::DeferWeightGrads defer(queue);
    out.to(at::kFloat).sum().backward();
  }
  ASSERT_EQ(queue.size(), 1U);
  queue.drain();
  ASSERT_TRUE(linear->weight.grad().defined());
  EXPECT_EQ(linear->weight.grad().scalar_type(), at::kFloat);
  // d/dW sum(x W^T) = column sums of x, computed in bf16
  const auto expected = x.to(at::kBFloat16).sum(0).to(at::kFloat).expand({8, 16});
  EXPECT_TRUE(at::allclose(linear->weight.grad(), expected, 1e-2, 1e-2));
  EXPECT_EQ(input.grad().scalar_type(), at::kFloat);
}

TEST(WeightCasts, OneCastPerScopeWhileTheWeightHoldsTheSameValues) {
  using d9d::detail::cached_weight_casts;
  using d9d::detail::cast_weight;
  at::manual_seed(9);
  const auto weight = at::randn({8, 16}).requires_grad_(true);
  // No scope: a new copy each time, nothing kept.
  EXPECT_NE(cast_weight(weight, at::kBFloat16).const_data_ptr(),
            cast_weight(weight, at::kBFloat16).const_data_ptr());
  EXPECT_EQ(cached_weight_casts(), 0U);
  // The weight's own dtype: the weight itself.
  EXPECT_TRUE(cast_weight(weight, at::kFloat).is_same(weight));
  {
    const d9d::detail::WeightCastScope outer(true);
    const auto first = cast_weight(weight, at::kBFloat16);
    {
      const d9d::detail::WeightCastScope inner(true);
      EXPECT_TRUE(cast_weight(weight, at::kBFloat16).is_same(first));
    }
    // The inner scope's end keeps the outer one's casts.
    EXPECT_EQ(cached_weight_casts(), 1U);
    EXPECT_TRUE(cast_weight(weight, at::kBFloat16).is_same(first));
    EXPECT_TRUE(at::equal(first, weight.detach().to(at::kBFloat16)));
    EXPECT_FALSE(first.requires_grad()) << "a copy of the values, without autograd history";
    // An in-place update moves the version counter: a new cast with the new values.
    {
      const at::NoGradGuard no_grad;
      weight.add_(1.0);
    }
    const auto updated = cast_weight(weight, at::kBFloat16);
    EXPECT_FALSE(updated.is_same(first));
    EXPECT_TRUE(at::equal(updated, weight.detach().to(at::kBFloat16)));
    // New memory under the same tensor (set_data): a new cast too.
    {
      const at::NoGradGuard no_grad;
      weight.set_data(at::randn({8, 16}));
    }
    EXPECT_TRUE(at::equal(cast_weight(weight, at::kBFloat16), weight.detach().to(at::kBFloat16)));
    // A tensor with autograd history (an activation, not a parameter) is cast but not kept.
    const auto activation = weight * 2.0;
    const auto before = cached_weight_casts();
    (void)cast_weight(activation, at::kBFloat16);
    EXPECT_EQ(cached_weight_casts(), before);
    // A disabled scope changes nothing.
    const d9d::detail::WeightCastScope off(false);
    EXPECT_TRUE(cast_weight(weight, at::kBFloat16).is_same(cast_weight(weight, at::kBFloat16)));
  }
  EXPECT_EQ(cached_weight_casts(), 0U);
}

// Under autocast a d9d::model::Linear without a recording queue runs the split-capable function
// (for the step's cached cast): outputs and gradients as at::linear gives them, over two
// microbatches whose weight gradients add up, with the weight cast once.
TEST(WeightCasts, AutocastLinearOverMicrobatchesMatchesAtLinear) {
  at::manual_seed(10);
  d9d::model::Linear linear(16, 8);
  const auto reference_weight = linear->weight.detach().clone().requires_grad_(true);
  const std::vector<at::Tensor> microbatches = {at::randn({4, 16}), at::randn({4, 16})};
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  std::vector<at::Tensor> input_grads;
  std::vector<at::Tensor> reference_input_grads;
  {
    const d9d::detail::WeightCastScope casts(true);
    for (const auto& x : microbatches) {
      const auto input = x.detach().requires_grad_(true);
      const auto reference_input = x.detach().requires_grad_(true);
      at::autocast::set_autocast_enabled(at::kCPU, true);
      const auto out = linear(input);
      const auto reference_out = at::linear(reference_input, reference_weight);
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
      EXPECT_EQ(out.scalar_type(), at::kBFloat16);
      EXPECT_TRUE(at::equal(out, reference_out));
      loss_of(out.to(at::kFloat)).backward();
      loss_of(reference_out.to(at::kFloat)).backward();
      input_grads.push_back(input.grad());
      reference_input_grads.push_back(reference_input.grad());
    }
    EXPECT_EQ(d9d::detail::cached_weight_casts(), 1U);
  }
  EXPECT_EQ(d9d::detail::cached_weight_casts(), 0U);
  ASSERT_TRUE(linear->weight.grad().defined());
  EXPECT_EQ(linear->weight.grad().scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(linear->weight.grad(), reference_weight.grad()));
  for (std::size_t i = 0; i < microbatches.size(); ++i) {
    EXPECT_TRUE(at::equal(input_grads[i], reference_input_grads[i]));
  }
}

}  // namespace
