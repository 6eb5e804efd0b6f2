// examples/05_qwen3_moe_pretraining — pretrain a Qwen3-MoE with expert parallelism and sharded
// data parallelism, printing the routers' balance next to the loss.
//
//   bazel build //examples/05_qwen3_moe_pretraining //tools/tokenize
//   bazel-bin/tools/tokenize/tokenize --out corpus.bin --width u16 README.md docs/*.md
//   tools/d9drun -n 2 bazel-bin/examples/05_qwen3_moe_pretraining/05_qwen3_moe_pretraining
//       examples/05_qwen3_moe_pretraining/moe_cpu.json --data corpus.bin --output runs/moe
//   # 2 x H200 (ep 2, the Qwen3-30B-A3B layer shape with 8 layers, bf16): tools/gpu/moe-bench, or
//   # the same command with qwen3_30b_a3b_8l_gpu.json --bf16-params --peak-tflops 989
//
// The configuration block below is the plan: every rank is a data-parallel rank (dp_shard from the
// world size), the config's "mesh.ep" splits each layer's experts over that many of them
// (ExpertParallel: tokens travel to their experts by all-to-all), and the parameters outside the
// experts are sharded ZeRO-3 style (FullyShard), and so are the experts over the remaining
// ranks (ep_replicate): gathered per layer, reduce-scattered there. The model's
// "router_aux_loss_coef" (with "output_router_logits": true; "router_aux_loss_type": "sequence"
// for DeepSeek-V3's sequence-wise form) and "router_bias_update_rate" choose the balancing: the
// auxiliary loss, the auxiliary-loss-free bias, or both. With an "advise" section in the config
// ({"enabled": true}, optionally "memory_gib" and a machine "profile") the advisor's prediction
// for the Plan is printed before the run (docs/advise.md, "Pre-flight").
#include <cstdio>
#include <map>
#include <string>

#include <CLI/CLI.hpp>

#include <d9d/d9d.hpp>

#include "examples/common/command_line.hpp"
#include "examples/common/preflight.hpp"
#include "examples/common/report.hpp"

// ---- configuration: one `using` per plan slot -------------------------------------------------
using Mesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::ep<d9d::dynamic>>;  // or ep<2>
using DataParallel = d9d::parallel::FullyShard<>;        // or d9d::parallel::Replicate
using ExpertParallel = d9d::parallel::ExpertParallel<>;  // or NoExpertParallel (ep = 1)
using Pipeline = d9d::pipeline::NoPipeline;              // or OneFOneB<> with d9d::pp in the mesh
using Peft = d9d::peft::FullTune;                        // every parameter trains
using Recompute = d9d::recompute::None;                  // or d9d::recompute::Full
template <class Precision>  // Fp32; Bf16Mixed with --bf16, Bf16Params<> with --bf16-params (GPU)
using MoePlan = d9d::Plan<Mesh, DataParallel, ExpertParallel, Pipeline, Peft, Precision, Recompute>;
// -----------------------------------------------------------------------------------------------

namespace {

template <class Plan>
int run(const d9d::DistributedContext& ctx, const d9d::TrainerConfig& cfg, double peak_tflops) {
  d9d::examples::print_preflight<Plan>(ctx, cfg);  // with an "advise" section in the config
  d9d::Trainer<Plan> trainer{ctx, d9d::Qwen3MoeProvider{}, d9d::TokenFilesProvider{},
                             d9d::CausalLmTask{}, cfg};
  // The routers' balance of each step (summed over the data-parallel ranks), next to the loss.
  std::map<std::string, double> last;
  trainer.template on<d9d::events::StepEnd>([&](const d9d::events::StepEnd& e) {
    last.clear();
    for (const auto& [name, value] : trainer.core().parallel().metrics()) {
      last[name] = value;
    }
    const bool print = e.step % cfg.run.log_every == 0 || e.step + 1 == cfg.run.total_steps;
    if (ctx.is_main_process() && print) {
      std::printf(
          "step %4ld  loss %.4f  | router load max/mean %.3f (worst layer %.3f)  ep rank load "
          "%.3f  aux %.4f  dropped %.0f\n",
          static_cast<long>(e.step), e.loss, last["moe/load_max_over_mean"],
          last["moe/load_max_over_mean_worst_layer"], last["moe/ep_rank_load_max"],
          last["moe/aux_loss"], last["moe/dropped"]);
      std::fflush(stdout);
    }
  });
  const auto result = trainer.train();
  if (ctx.is_main_process()) {
    const auto config = d9d::model::Qwen3MoeConfig::from_json_text(cfg.section("model"));
    // FLOPs counted on the parameters a token uses (the top-k experts, not all).
    const double tflops =
        result.tokens_per_second *
        report::training_flops_per_token(config, config.active_non_embedding_parameter_count(),
                                         cfg.batch.sequence_length) /
        1e12;
    std::printf(
        "model: %.1fM parameters, %.1fM active per token; throughput: %.0f tokens/s over %d "
        "rank(s), %.3f TFLOP/s per rank on active parameters",
        static_cast<double>(config.parameter_count()) / 1e6,
        static_cast<double>(config.active_parameter_count()) / 1e6, result.tokens_per_second,
        ctx.world_size(), tflops / ctx.world_size());
    report::print_mfu(tflops, ctx.world_size(), peak_tflops);
    report::print_peak_memory(result.peak_memory_bytes);
    if (!result.losses.empty()) {
      std::printf("\nloss: %.4f -> %.4f; router load max/mean at the end %.3f\n",
                  result.losses.front(), result.losses.back(), last["moe/load_max_over_mean"]);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Pretrain a Qwen3-MoE with expert parallelism (d9d example 05)"};
  std::string config_path;
  std::string data;
  std::string output;
  int64_t steps = 0;
  int ep = 0;
  bool bf16 = false;
  bool bf16_params = false;
  double peak_tflops = 0;
  app.add_option("config", config_path, "trainer configuration (JSON)")->required();
  app.add_option("--data", data, "token file (u16), replacing data.paths");
  app.add_option("--output", output, "output directory, replacing run.output_dir");
  app.add_option("--steps", steps, "optimizer steps, replacing run.total_steps");
  app.add_option("--ep", ep, "expert-parallel degree, replacing mesh.ep");
  app.add_flag("--bf16", bf16, "bf16 mixed precision (d9d::precision::Bf16Mixed)");
  app.add_flag("--bf16-params", bf16_params,
               "bfloat16 parameters, gradients and compute with stochastic rounding, no float32 "
               "master copy (d9d::precision::Bf16Params<>)")
      ->excludes("--bf16");
  app.add_option("--peak-tflops", peak_tflops,
                 "per-device peak for the MFU line (e.g. 989 for H100/H200 bf16)");
  CLI11_PARSE(app, argc, argv);

  // Any error: one line per rank and a non-zero status (2 for the configuration), never an abort
  // (d9d/train/main.hpp).
  return d9d::run_main(argc, argv, [&]() -> int {
    const auto ctx = d9d::DistributedContext::from_env();
    // The command line's replacements, applied before the file is validated.
    auto overrides = command_line::run_overrides(data, output, steps);
    if (ep > 0) {
      overrides.emplace_back("mesh.ep", std::to_string(ep));
    }
    const auto cfg = d9d::TrainerConfig::from_file(config_path, overrides);
    if (bf16_params) {
      return run<MoePlan<d9d::precision::Bf16Params<>>>(ctx, cfg, peak_tflops);
    }
    return bf16 ? run<MoePlan<d9d::precision::Bf16Mixed>>(ctx, cfg, peak_tflops)
                : run<MoePlan<d9d::precision::Fp32>>(ctx, cfg, peak_tflops);
  });
}
