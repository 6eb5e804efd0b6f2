// Split backward (d9d/core/weight_grad.hpp): for every layer type, I (input gradients, weight
// gradients queued) followed by W (the queue drained) gives the gradients of a full backward.
#include <functional>
#include <map>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

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
  expect_same(full_backward(*mlp, forward, x), split_backward(*mlp, forward, x, 3));
}

TEST(SplitBackward, AttentionWithQkNormAndGqa) {
  at::manual_seed(5);
  d9d::model::Attention attention(d9d::model::AttentionOptions{
      .hidden_size = 32, .num_heads = 4, .num_kv_heads = 2, .head_dim = 8});
  const d9d::model::RotaryEmbedding rope(8, 10000.0);
  const auto cos_sin = rope.cos_sin(6, at::kCPU);
  const Forward forward = [&](const at::Tensor& x) { return attention(x, cos_sin); };
  const auto x = at::randn({2, 6, 32});
  expect_same(full_backward(*attention, forward, x), split_backward(*attention, forward, x, 4));
}

TEST(SplitBackward, DecoderLayer) {
  at::manual_seed(6);
  const auto config = tiny_config();
  d9d::model::Qwen3DecoderLayer layer(config);
  const d9d::model::RotaryEmbedding rope(config.head_dim, config.rope_theta);
  const auto cos_sin = rope.cos_sin(6, at::kCPU);
  const Forward forward = [&](const at::Tensor& x) { return layer(x, cos_sin); };
  const auto x = at::randn({2, 6, 32});
  expect_same(full_backward(*layer, forward, x), split_backward(*layer, forward, x, 7));
}

TEST(SplitBackward, WholeModelWithEmbeddingAndHead) {
  at::manual_seed(7);
  d9d::model::Qwen3ForCausalLM model(tiny_config());
  const Forward forward = [&](const at::Tensor& ids) { return model(ids); };
  const auto ids = at::randint(48, {2, 6}, at::kLong);
  // 7 linears per layer and the LM head
  expect_same(full_backward(*model, forward, ids), split_backward(*model, forward, ids, 2 * 7 + 1));
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

}  // namespace
