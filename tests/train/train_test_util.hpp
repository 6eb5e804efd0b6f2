// Helpers of the training tests: a tiny Qwen3, an in-memory random-token dataset, configs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <d9d/train/causal_lm.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/events.hpp>

namespace d9d::testing {

// Tolerances of the equality tests. Every run here is float64 (d9d::precision::Fp64): a parallel
// run and the single-process reference differ only in the order of their sums (all-reduces,
// microbatch accumulation, pipeline stages). With n <= 10^3 terms per sum and u = 1.1e-16, such a
// difference is at most n·u·sum|x| ~ 1e-13 of the values involved:
//  - losses and gradient norms (sums of that kind, then a few smooth steps): 1e-9 relative;
//  - parameters pass through AdamW, update = lr·m/(sqrt(v)+eps), which magnifies an absolute
//    gradient difference d by up to lr/eps (for gradients near eps): after `steps` steps they
//    differ by at most steps·(lr/eps)·1e-13 <= 8·(0.01/1e-8)·1e-13 = 8e-7 < 1e-6 absolute
//    (tiny_run: lr 0.01, AdamW's eps 1e-8, at most 8 steps in these tests).
// In float32 the same bound is ~1e-4 (u = 6e-8), which is why float32 equality tests broke on some
// CPUs (1.2e-6 against 1e-6) and are not used here. Measured: every difference below 1e-12.
inline constexpr double kLossRtol = 1e-9;
inline constexpr double kParameterAtol = 1e-6;
static_assert(8 * (0.01 / 1e-8) * 1e-13 < kParameterAtol);

/// A Qwen3 small enough to train in milliseconds (GQA: 4 heads over 2 KV heads, untied head).
inline std::string tiny_qwen3_json(bool tied = false, int layers = 2) {
  return std::string(R"({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": )") +
         std::to_string(layers) +
         R"(, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": )" +
         (tied ? "true" : "false") + "}";
}

/// Random token windows, the same on every rank (seeded), as CausalLmBatch.
class RandomWindows {
 public:
  RandomWindows(int64_t samples, int64_t sequence_length, int64_t vocab, uint64_t seed) {
    auto generator = at::detail::createCPUGenerator(seed);
    tokens_ = at::randint(vocab, {samples, sequence_length + 1}, generator, at::kLong);
  }
  [[nodiscard]] int64_t size() const { return tokens_.size(0); }
  [[nodiscard]] CausalLmBatch get(const std::vector<int64_t>& indices) const {
    return {.tokens = tokens_.index_select(0, at::tensor(indices, at::kLong))};
  }

 private:
  at::Tensor tokens_;
};

struct RandomWindowsProvider {
  using dataset_provider_concept = dataset_provider_tag;
  int64_t samples = 64;
  RandomWindows build(const DataBuildContext& context) const {
    return {samples, context.sequence_length, 64, context.seed + 99};
  }
};

/// CausalLmTask with a fault injected in steps [first, last] (0-based): the loss (and so every
/// gradient) multiplied by `factor` (NaN, infinity, or a finite factor for a spike), or, with
/// `gradient_only`, the gradients alone (the loss stays as it was). Off on a rank with
/// `active` false. The step comes from follow(): a StepStart handler of the trainer.
struct FaultyTask {
  using train_task_concept = train_task_tag;
  int64_t first = -1;
  int64_t last = -1;
  double factor = 1.0;
  bool gradient_only = false;
  bool no_targets = false;  ///< the loss and its weight become 0 (no target tokens)
  bool active = true;
  std::shared_ptr<int64_t> current = std::make_shared<int64_t>(-1);

  template <class Trainer>
  void follow(Trainer& trainer) const {
    trainer.template on<events::StepStart>(
        [current = current](const events::StepStart& e) { *current = e.step; });
  }

  LossOutput compute_loss(model::Qwen3ForCausalLM& model, const CausalLmBatch& batch) const {
    auto out = CausalLmTask{}.compute_loss(model, batch);
    if (!active || *current < first || *current > last) {
      return out;
    }
    if (no_targets) {
      out.loss_sum = out.loss_sum * 0.0;
      out.weight = out.weight * 0;
    } else if (gradient_only) {
      const double f = factor;
      out.loss_sum.register_hook([f](const at::Tensor& grad) { return grad * f; });
      out.loss_sum = out.loss_sum * 1.0;  // the hook sits below the tensor backward() starts from
    } else {
      out.loss_sum = out.loss_sum * factor;
    }
    return out;
  }
};

/// A run of `steps` steps with logging and export off unless asked for; `layers` decoder layers,
/// when given, a "mesh" section (e.g. {"pp": 2}), and the LM head tied to the embedding or not.
inline TrainerConfig tiny_run(const std::string& output_dir, int64_t steps, int64_t global_batch,
                              int64_t microbatch, bool outputs = false, int layers = 2,
                              const std::string& mesh_json = "", bool tied = false) {
  return TrainerConfig::from_json_text(R"({
    )" + (mesh_json.empty() ? std::string() : "\"mesh\": " + mesh_json + ",") +
                                       R"(
    "run": {"output_dir": ")" + output_dir +
                                       R"(", "total_steps": )" + std::to_string(steps) +
                                       R"(, "seed": 5, "log_every": 2},
    "batch": {"global_batch_size": )" + std::to_string(global_batch) +
                                       R"(, "microbatch_size": )" + std::to_string(microbatch) +
                                       R"(, "sequence_length": 16},
    "optimizer": {"lr": 0.01, "weight_decay": 0.1},
    "lr_schedule": [{"steps": 2, "curve": "linear", "start": 0.1, "end": 1.0},
                    {"rest": true, "curve": "cosine", "start": 1.0, "end": 0.1}],
    "gradient_clipping": {"max_norm": 0.5},
    "data_parallel": {"bucket_size_mb": 0.01},
    "logging": {"progress": )" + (outputs ? "true" : "false") +
                                       R"(, "jsonl": )" + (outputs ? "true" : "false") +
                                       R"(, "tensorboard": )" + (outputs ? "true" : "false") +
                                       R"(, "pictures": )" + (outputs ? "true" : "false") + R"(},
    "export": {"enabled": )" + (outputs ? "true" : "false") +
                                       R"(},
    "model": )" + tiny_qwen3_json(tied, layers) +
                                       "}");
}

}  // namespace d9d::testing
