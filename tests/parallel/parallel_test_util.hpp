// Helpers of the parallelize-layer tests: train a plan with the tiny Qwen3 and compare it with a
// single-process run of the same global batch (float64: tolerances in tests/train/train_test_util).
#pragma once

#include <cmath>
#include <cstddef>
#include <map>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <d9d/d9d.hpp>

#include "tests/train/train_test_util.hpp"

namespace d9d::testing {

/// A tiny Qwen3-MoE: 4 experts, top 2 (renormalised), 4 layers with layer 2 dense, the auxiliary
/// loss on (with global statistics) and the auxiliary-loss-free bias on: every path of the router
/// trains.
inline std::string tiny_qwen3_moe_json(bool aux = true, double bias_rate = 0.001) {
  return std::string(R"({"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": false, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 16, "norm_topk_prob": true, "mlp_only_layers": [2],
    "router_aux_loss_coef": 0.05, "output_router_logits": )") +
         (aux ? "true" : "false") + R"(, "router_bias_update_rate": )" + std::to_string(bias_rate) +
         "}";
}

/// Every trained parameter as the whole tensor, by name (collective: gathers the shards).
inline std::map<std::string, at::Tensor> full_parameters(detail::TrainerCore& core) {
  std::map<std::string, at::Tensor> out;
  for (const auto& record : core.parallel().parameters()) {
    out[record.name] = record.sharded(core.mesh()).full_tensor().cpu();
  }
  return out;
}

/// An exported model holds exactly the trained parameters: every one of its parameters equals the
/// tensor of that name in `parameters`, and there are as many.
inline void expect_exported_equals(const torch::nn::Module& exported,
                                   const std::map<std::string, at::Tensor>& parameters) {
  std::size_t compared = 0;
  for (const auto& item : exported.named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), parameters.at(item.key()))) << item.key();
    ++compared;
  }
  EXPECT_EQ(compared, parameters.size());
}

/// A run's losses and final parameters.
struct RunOutcome {
  TrainResult result;
  std::map<std::string, at::Tensor> parameters;
  /// Reductions the last step started before the end of its pipeline program.
  std::size_t reductions_started_early = 0;
  /// The most the strategies held beyond the parameters during the last step (gathered units).
  int64_t peak_extra_bytes = 0;
};

/// Trains `trainer` and collects the run's outcome (collective).
template <class Plan>
RunOutcome outcome_of(Trainer<Plan>& trainer) {
  RunOutcome out;
  out.result = trainer.train();
  out.parameters = full_parameters(trainer.core());
  out.reductions_started_early = trainer.core().parallel().reductions_started_early();
  out.peak_extra_bytes = trainer.core().parallel().peak_extra_bytes();
  return out;
}

template <class Plan, class Task = CausalLmTask>
RunOutcome train_plan(const DistributedContext& ctx, const TrainerConfig& config) {
  Trainer<Plan> trainer(ctx, Qwen3Provider{}, RandomWindowsProvider{}, Task{}, config);
  return outcome_of(trainer);
}

/// A run resumed from the checkpoint of step `from` continues `want` (the uninterrupted run) bit
/// for bit: the losses of the later steps and the final parameters are equal.
inline void expect_resumed_run(const TrainResult& got,
                               const std::map<std::string, at::Tensor>& got_parameters,
                               const TrainResult& want,
                               const std::map<std::string, at::Tensor>& want_parameters,
                               std::size_t from) {
  EXPECT_EQ(got.start_step, static_cast<int64_t>(from));
  ASSERT_EQ(got.losses.size(), want.losses.size() - from);
  for (std::size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_EQ(got.losses[i], want.losses[i + from]) << "step " << i + from;
  }
  ASSERT_EQ(got_parameters.size(), want_parameters.size());
  for (const auto& [name, value] : got_parameters) {
    EXPECT_TRUE(at::equal(value, want_parameters.at(name))) << name;
  }
}

/// Losses, gradient norms and (the parameters `got` has) parameters agree.
inline void expect_same_run(const RunOutcome& got, const RunOutcome& want,
                            const std::string& what) {
  ASSERT_EQ(got.result.losses.size(), want.result.losses.size()) << what;
  for (std::size_t i = 0; i < want.result.losses.size(); ++i) {
    EXPECT_NEAR(got.result.losses[i], want.result.losses[i],
                kLossRtol * std::abs(want.result.losses[i]))
        << what << ": step " << i;
    EXPECT_NEAR(got.result.grad_norms[i], want.result.grad_norms[i],
                kLossRtol * std::abs(want.result.grad_norms[i]))
        << what << ": step " << i;
  }
  ASSERT_FALSE(got.parameters.empty()) << what;
  for (const auto& [name, value] : got.parameters) {
    const auto found = want.parameters.find(name);
    ASSERT_NE(found, want.parameters.end()) << what << ": " << name;
    ASSERT_EQ(value.sizes(), found->second.sizes()) << what << ": " << name;
    EXPECT_TRUE(at::allclose(value, found->second, 0.0, kParameterAtol))
        << what << ": " << name << " max diff "
        << (value - found->second).abs().max().item<double>();
  }
}

/// Bytes of AdamW's state for the optimizer's parameters on this rank.
inline int64_t optimizer_state_bytes(torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& [key, state] : optimizer.state()) {
    const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state.get());
    if (adamw != nullptr) {
      bytes += static_cast<int64_t>(adamw->exp_avg().nbytes() + adamw->exp_avg_sq().nbytes());
      if (adamw->max_exp_avg_sq().defined()) {
        bytes += static_cast<int64_t>(adamw->max_exp_avg_sq().nbytes());
      }
    }
  }
  return bytes;
}

}  // namespace d9d::testing
