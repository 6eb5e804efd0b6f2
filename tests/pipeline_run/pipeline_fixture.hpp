// Helpers of the pipeline-run tests: a tiny Qwen3 split into stages, a single-process reference
// (whole batch, no pipeline) and one pipelined step on this rank, compared by parameter name.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <d9d/model/qwen3.hpp>
#include <d9d/model/qwen3_stage.hpp>
#include <d9d/model/stage_layers.hpp>
#include <d9d/pipeline/executor.hpp>
#include <d9d/pipeline/schedules.hpp>

namespace d9d::testing {

/// 8 decoder layers: one per stage for 4 ranks x 2 stages; untied head (stages need it).
inline model::Qwen3Config pipeline_config() {
  return {.vocab_size = 48,
          .hidden_size = 16,
          .intermediate_size = 24,
          .num_hidden_layers = 8,
          .num_attention_heads = 4,
          .num_key_value_heads = 2,
          .head_dim = 4,
          .rope_theta = 10000.0,
          .tie_word_embeddings = false};
}

constexpr int64_t kMicrobatchSize = 2;
/// The tests run in float64: a pipelined step and the reference differ only in the order of their
/// sums (n <= 10^3 terms of magnitude <= 1 here), i.e. by at most n·u·sum|x| ~ 1e-13 with u =
/// 1.1e-16, on any CPU or GPU. The tolerances below hold by that bound, with room to spare.
constexpr auto kDtype = at::kDouble;
constexpr double kRtol = 1e-9;
constexpr double kAtol = 1e-12;
constexpr int64_t kSeq = 6;

/// Frozen in the "frozen" runs: the embedding, all of layer 0 (so a first stage may hold no
/// trainable weight) and every q_proj (a split-capable linear next to trainable ones).
inline bool frozen_name(const std::string& name) {
  return name.find("embed_tokens") != std::string::npos ||
         name.find("layers.0.") != std::string::npos || name.find("q_proj") != std::string::npos;
}

inline void apply_frozen(torch::nn::Module& module, bool frozen) {
  for (auto& item : module.named_parameters()) {
    item.value().requires_grad_(!(frozen && frozen_name(item.key())));
  }
}

/// The step's data: tokens [m * kMicrobatchSize, kSeq + 1], the same on every rank.
inline at::Tensor step_tokens(int microbatches) {
  auto generator = at::detail::createCPUGenerator(1234 + microbatches);
  return at::randint(pipeline_config().vocab_size, {microbatches * kMicrobatchSize, kSeq + 1},
                     generator, at::kLong);
}

/// The whole model, initialised from a fixed seed (the same on every rank).
inline model::Qwen3ForCausalLM reference_model() {
  at::manual_seed(77);
  return model::Qwen3ForCausalLM(pipeline_config());
}

/// Loss = summed token cross-entropy / all tokens of the step; its gradients by name.
struct Reference {
  at::Tensor loss;                          // the step's loss
  std::vector<at::Tensor> losses;           // each microbatch's share
  std::map<std::string, at::Tensor> grads;  // undefined for frozen parameters
  std::vector<at::Tensor> logits;           // per microbatch (no grad)
};

inline Reference reference_step(int microbatches, bool frozen, c10::Device device = at::kCPU) {
  auto model = reference_model();
  model->to(device, kDtype);
  apply_frozen(*model, frozen);
  const auto tokens = step_tokens(microbatches).to(device);
  const auto inputs = tokens.narrow(1, 0, kSeq);
  const auto labels = tokens.narrow(1, 1, kSeq);
  const double total = static_cast<double>(labels.numel());
  Reference out;
  const auto logits = model(inputs);
  out.loss = model::causal_lm_loss(logits, labels).loss_sum / total;
  out.loss.backward();
  for (int mb = 0; mb < microbatches; ++mb) {
    const auto rows = logits.narrow(0, mb * kMicrobatchSize, kMicrobatchSize).detach();
    out.logits.push_back(rows.cpu());
    out.losses.push_back(
        (model::causal_lm_loss(rows, labels.narrow(0, mb * kMicrobatchSize, kMicrobatchSize))
             .loss_sum /
         total)
            .cpu());
  }
  out.loss = out.loss.detach().cpu();
  for (const auto& item : model->named_parameters()) {
    const auto& grad = item.value().grad();
    out.grads[item.key()] = grad.defined() ? grad.cpu() : grad;
  }
  return out;
}

/// This rank's stages of `program`, with the reference model's parameters.
inline std::vector<model::Qwen3Stage> build_stages(const pipeline::Program& program, int rank,
                                                   bool frozen, c10::Device device) {
  const auto config = pipeline_config();
  const auto ranges =
      model::distribute_layers(static_cast<int>(config.num_hidden_layers), program.stages());
  const auto full = reference_model();
  std::vector<model::Qwen3Stage> stages;
  for (const int s :
       pipeline::rank_stages(program.placement, program.pp, program.stages_per_rank, rank)) {
    model::Qwen3Stage stage(config, s, program.stages(), ranges[static_cast<std::size_t>(s)]);
    model::copy_parameters(*full, *stage);
    stage->to(device, kDtype);
    apply_frozen(*stage, frozen);
    stages.push_back(stage);
  }
  return stages;
}

struct PipelineRun {
  pipeline::StepResult result;
  std::map<std::string, at::Tensor> grads;         // of this rank's stages
  std::vector<pipeline::Timeline::Slot> timeline;  // when options.record_timeline
};

/// The data of one pipelined step: token rows (m * kMicrobatchSize of them) and the token count
/// the loss is divided by (more than this step's when data-parallel ranks share the batch).
struct StepData {
  at::Tensor tokens;
  double total_tokens = 0;
};

/// One step of `program` on this rank (group may be invalid when pp == 1); results on the CPU.
/// Without `data`, step_tokens(m) normalised by its own token count. `before_run` is called with
/// the executor right before its step.
inline PipelineRun pipeline_step(const pipeline::Program& program, const ProcessGroup& group,
                                 int rank, bool frozen, c10::Device device = at::kCPU,
                                 const StepData& data = {},
                                 const pipeline::ExecutorOptions& options = {},
                                 const std::function<void(pipeline::Executor&)>& before_run = {}) {
  auto stages = build_stages(program, rank, frozen, device);
  std::vector<pipeline::Stage> handles;
  handles.reserve(stages.size());
  for (auto& stage : stages) {
    handles.push_back({.index = stage->stage(),
                       .forward = [stage](const at::Tensor& x) mutable { return stage(x); }});
  }
  const auto config = pipeline_config();
  pipeline::Executor executor(
      program, group, std::move(handles),
      [&](int) {
        return pipeline::TensorSpec{.sizes = {kMicrobatchSize, kSeq, config.hidden_size},
                                    .dtype = kDtype};
      },
      options);
  const auto tokens =
      (data.tokens.defined() ? data.tokens : step_tokens(program.microbatches)).to(device);
  const double total = data.total_tokens > 0
                           ? data.total_tokens
                           : static_cast<double>(program.microbatches * kMicrobatchSize * kSeq);
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> labels;
  for (int mb = 0; mb < program.microbatches; ++mb) {
    const auto rows = tokens.narrow(0, mb * kMicrobatchSize, kMicrobatchSize);
    inputs.push_back(rows.narrow(1, 0, kSeq).contiguous());
    labels.push_back(rows.narrow(1, 1, kSeq).contiguous());
  }
  PipelineRun out;
  if (before_run) {
    before_run(executor);
  }
  out.result = executor.run(inputs, [&](const at::Tensor& logits, int mb) {
    return model::causal_lm_loss(logits, labels[static_cast<std::size_t>(mb)]).loss_sum / total;
  });
  out.timeline = executor.timeline();
  for (auto& stage : stages) {
    for (const auto& item : stage->named_parameters()) {
      const auto& grad = item.value().grad();
      out.grads[item.key()] = grad.defined() ? grad.cpu() : grad;
    }
  }
  for (auto& t : out.result.losses) {
    t = t.cpu();
  }
  for (auto& t : out.result.outputs) {
    t = t.cpu();
  }
  return out;
}

/// Every training schedule, built through its policy (which rejects sizes it does not allow).
struct NamedSchedule {
  std::string name;
  std::function<pipeline::Program(int pp, int microbatches)> build;
};

inline std::vector<NamedSchedule> training_schedules() {
  using pipeline::build_program;
  using V2 = pipeline::stages_per_rank<2>;
  return {
      {"GPipe", build_program<pipeline::GPipe<>>},
      {"LoopedBfs2", build_program<pipeline::LoopedBfs<V2>>},
      {"1F1B", build_program<pipeline::OneFOneB<>>},
      {"Interleaved1F1B2", build_program<pipeline::Interleaved1F1B<V2>>},
      {"ZeroBubbleH1", build_program<pipeline::ZeroBubbleH1<>>},
      {"ZeroBubbleV", build_program<pipeline::ZeroBubbleV<>>},
      {"DualPipeV", build_program<pipeline::DualPipeV<>>},
  };
}

/// Runs `body(schedule, program)` for every schedule and microbatch count it allows; returns how
/// many programs ran.
inline int for_each_program(
    int pp, const std::vector<int>& microbatch_counts,
    const std::function<void(const std::string&, const pipeline::Program&)>& body) {
  int ran = 0;
  for (const auto& schedule : training_schedules()) {
    for (const int m : microbatch_counts) {
      pipeline::Program program;
      try {
        program = schedule.build(pp, m);
      } catch (const std::invalid_argument&) {
        continue;  // the schedule does not allow this size
      }
      body(schedule.name + " pp=" + std::to_string(pp) + " m=" + std::to_string(m), program);
      ++ran;
    }
  }
  return ran;
}

/// The compute actions of one rank's program, in order.
inline std::vector<pipeline::Action> compute_actions(const pipeline::Program& program, int rank) {
  std::vector<pipeline::Action> out;
  for (const auto& a : program.ranks[static_cast<std::size_t>(rank)]) {
    if (a.is_compute()) {
      out.push_back(a);
    }
  }
  return out;
}

/// A rank's timeline holds one entry per compute action of its program, in program order, each
/// with start <= end, one after the other (none before the step's start, none overlapping).
inline void expect_timeline_of(const std::vector<pipeline::Timeline::Slot>& timeline,
                               const pipeline::Program& program, int rank,
                               const std::string& what) {
  const auto actions = compute_actions(program, rank);
  ASSERT_EQ(timeline.size(), actions.size()) << what << ": rank " << rank;
  double previous_end = 0;
  for (std::size_t i = 0; i < actions.size(); ++i) {
    const auto& slot = timeline[i];
    EXPECT_EQ(slot.action.op, actions[i].op) << what << ": rank " << rank << " entry " << i;
    EXPECT_EQ(slot.action.stage, actions[i].stage) << what << ": rank " << rank << " entry " << i;
    EXPECT_EQ(slot.action.microbatch, actions[i].microbatch)
        << what << ": rank " << rank << " entry " << i;
    EXPECT_LE(previous_end, slot.start) << what << ": rank " << rank << " entry " << i;
    EXPECT_LE(slot.start, slot.end) << what << ": rank " << rank << " entry " << i;
    previous_end = slot.end;
  }
}

/// How many times `needle` occurs in `text`.
inline int occurrences(const std::string& text, const std::string& needle) {
  int n = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

/// Gradients and losses of a pipelined step equal the reference's (float64: see kDtype).
inline void expect_matches(const PipelineRun& run, const Reference& ref, const std::string& what,
                           double rtol = kRtol, double atol = kAtol) {
  for (const auto& [name, grad] : run.grads) {
    const auto& want = ref.grads.at(name);
    ASSERT_EQ(grad.defined(), want.defined()) << what << ": " << name;
    if (want.defined()) {
      EXPECT_TRUE(at::allclose(grad, want, rtol, atol))
          << what << ": " << name << " max diff " << (grad - want).abs().max().item<double>();
    }
  }
  if (!run.result.losses.empty()) {
    ASSERT_EQ(run.result.losses.size(), ref.losses.size()) << what;
    at::Tensor sum = at::zeros({}, kDtype);
    for (std::size_t mb = 0; mb < ref.losses.size(); ++mb) {
      EXPECT_TRUE(at::allclose(run.result.losses[mb], ref.losses[mb], rtol, atol))
          << what << ": microbatch " << mb;
      sum = sum + run.result.losses[mb];
    }
    EXPECT_TRUE(at::allclose(sum, ref.loss, rtol, atol)) << what << ": step loss";
  }
}

}  // namespace d9d::testing
