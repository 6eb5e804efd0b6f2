// examples/04_lora_finetune — fine-tune a Qwen3 from a Hugging Face checkpoint with LoRA, on CPU.
//
//   04_lora_finetune --base tests/hf/fixtures/qwen3_tiny_untied --output runs/lora [--steps 60]
//   04_lora_finetune --base runs/quickstart/model --output runs/lora   # the quickstart's export
//   tools/d9drun -n 2 04_lora_finetune --base ... --output ...         # two data-parallel ranks
//
// The configuration block below is the plan: rank-8 LoRA adapters (alpha 16) on the attention
// projections, everything else frozen, data parallelism over the world. The base weights come from
// a transformers-written checkpoint (config.json + model.safetensors); the task is a small
// next-token one the adapters can learn (count up modulo the vocabulary). It prints the trainable
// parameters as Hugging Face peft does, trains, and exports under --output:
//   adapter/  adapter_model.safetensors + adapter_config.json (peft.PeftModel.from_pretrained)
//   model/    the merged model, a plain Hugging Face checkpoint
// and checks them: the base checkpoint with the adapter loaded (d9d::peft::load_adapter) gives the
// merged export's logits, and the loss fell. Exit status 1 otherwise.
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include <d9d/d9d.hpp>
#include <d9d/peft/lora.hpp>

#include "examples/common/report.hpp"

// ---- configuration: one `using` per plan slot -------------------------------------------------
using Mesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>>;  // or mesh<dp_shard<dynamic>> (FullyShard)
using DataParallel = d9d::parallel::Replicate;  // or d9d::parallel::FullyShard<> (export: not yet)
using Pipeline = d9d::pipeline::NoPipeline;     // or d9d::pipeline::OneFOneB<> with d9d::pp<N>
using Peft = d9d::peft::Lora<8, 16, "*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj">;
// or d9d::peft::Lora<8, 16> (every linear layer but lm_head),
//    d9d::peft::Stack<d9d::peft::Lora<8, 16, "*.q_proj", "*.v_proj">, d9d::peft::Train<"*norm">>
using Precision = d9d::precision::Fp32;  // or d9d::precision::Bf16Mixed (GPU)
using Recompute = d9d::recompute::None;  // or d9d::recompute::Full
using Plan = d9d::Plan<Mesh, DataParallel, Pipeline, Peft, Precision, Recompute>;
// -----------------------------------------------------------------------------------------------

namespace {

/// The model: a Qwen3 read from a Hugging Face checkpoint directory.
class HfQwen3Provider {
 public:
  using model_provider_concept = d9d::model_provider_tag;
  explicit HfQwen3Provider(std::string dir) : dir_(std::move(dir)) {}
  d9d::model::Qwen3ForCausalLM build(const d9d::ModelBuildContext& /*context*/) {
    auto model = d9d::model::load_hf_qwen3(dir_);
    config_ = model->config();
    return model;
  }
  [[nodiscard]] std::string hf_config_json() const { return config_.to_hf_json(); }

 private:
  std::string dir_;
  d9d::model::Qwen3Config config_;
};

/// Windows of the sequence start, start + 1, ... (modulo the vocabulary): one per start token.
class CountingWindows {
 public:
  CountingWindows(int64_t vocab, int64_t sequence_length)
      : vocab_(vocab), length_(sequence_length) {}
  [[nodiscard]] int64_t size() const { return vocab_; }
  [[nodiscard]] d9d::CausalLmBatch get(const std::vector<int64_t>& indices) const {
    const auto starts = at::tensor(indices, at::kLong).unsqueeze(1);
    return {.tokens = (starts + at::arange(length_ + 1, at::kLong).unsqueeze(0)).remainder(vocab_)};
  }

 private:
  int64_t vocab_;
  int64_t length_;
};

struct CountingProvider {
  using dataset_provider_concept = d9d::dataset_provider_tag;
  int64_t vocab = 0;
  [[nodiscard]] CountingWindows build(const d9d::DataBuildContext& context) const {
    return {vocab, context.sequence_length};
  }
};

std::string config_json(const std::string& output, int steps) {
  return R"({
    "run": {"output_dir": ")" +
         output + R"(", "total_steps": )" + std::to_string(steps) +
         R"(, "seed": 0, "log_every": 10},
    "batch": {"global_batch_size": 16, "microbatch_size": 8, "sequence_length": 32},
    "optimizer": {"lr": 0.02, "weight_decay": 0.0},
    "lr_schedule": [{"steps": 5, "curve": "linear", "start": 0.1, "end": 1.0},
                    {"rest": true, "curve": "cosine", "start": 1.0, "end": 0.1}],
    "logging": {"progress": true, "jsonl": true, "tensorboard": false},
    "export": {"enabled": true, "dtype": "float32"}
  })";
}

int finetune(const std::string& base, const std::string& output, int steps) {
  const auto ctx = d9d::DistributedContext::from_env();
  const auto cfg = d9d::TrainerConfig::from_json_text(config_json(output, steps));
  const auto base_config =
      d9d::model::Qwen3Config::from_json_text(d9d::model::read_text_file(base + "/config.json"));
  d9d::Trainer<Plan> trainer{ctx, HfQwen3Provider{base},
                             CountingProvider{.vocab = base_config.vocab_size}, d9d::CausalLmTask{},
                             cfg};
  // The plan's peft slot has put the adapters on and frozen the rest (Hugging Face peft's line).
  const auto count = d9d::peft::count_parameters(*trainer.core().model());
  if (ctx.is_main_process()) {
    report::print_trainable(count);
  }
  const auto result = trainer.train();
  if (!ctx.is_main_process()) {
    return 0;
  }
  std::printf("loss: %.4f -> %.4f\nadapter: %s\nmerged model: %s\n", result.losses.front(),
              result.losses.back(), result.adapter_dir.c_str(), result.export_dir.c_str());

  // Check the exports: base + adapter against the merged checkpoint.
  auto adapted = d9d::model::load_hf_qwen3(base);
  d9d::peft::load_adapter(*adapted, result.adapter_dir);
  auto merged = d9d::model::load_hf_qwen3(result.export_dir);
  adapted->eval();
  merged->eval();
  const auto ids = CountingWindows(base_config.vocab_size, 16).get({0, 5, 9}).tokens;
  const at::NoGradGuard no_grad;
  const double diff = (adapted(ids) - merged(ids)).abs().max().item<double>();
  std::printf("check: base + adapter vs merged model: max |logits difference| = %.3g\n", diff);
  const bool ok = diff < 1e-4 && result.losses.back() < result.losses.front();
  std::printf("%s\n", ok ? "ok" : "FAILED: the exports disagree or the loss did not fall");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fine-tune a Qwen3 Hugging Face checkpoint with LoRA"};
  std::string base;
  std::string output = "runs/lora_finetune";
  int steps = 60;
  app.add_option("--base", base, "Hugging Face checkpoint directory (config.json, weights)")
      ->required();
  app.add_option("--output", output, "output directory (metrics, adapter/, model/)");
  app.add_option("--steps", steps, "optimizer steps");
  CLI11_PARSE(app, argc, argv);
  // Any error: one line per rank and a non-zero status, never an abort (d9d/train/main.hpp).
  return d9d::run_main(argc, argv, [&] { return finetune(base, output, steps); });
}
