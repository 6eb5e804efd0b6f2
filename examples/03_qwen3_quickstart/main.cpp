// examples/03_qwen3_quickstart — train a Qwen3 dense model with data parallelism (tools/demo).
//
//   tools/demo                      # tokenizes the repository's docs, trains on CPU, one process
//   tools/demo --ranks 2            # the same with two data-parallel Gloo ranks (tools/d9drun)
//   03_qwen3_quickstart quickstart.json --data corpus.bin --output runs/quickstart [--bf16]
//   tools/d9drun -n 4 03_qwen3_quickstart cfg.json --pipeline zbh1 --pp 2   # dp 2 x pp 2
//   tools/d9drun -n 2 03_qwen3_quickstart cfg.json --fsdp [--recompute]      # ZeRO-3
//   tools/d9drun -n 2 03_qwen3_quickstart cfg.json --bf16 --reduce-bf16   # bf16 all-reduce
//   tools/d9drun -n 2 03_qwen3_quickstart cfg.json --tp          # tensor + sequence parallel
//   tools/d9drun -n 2 03_qwen3_quickstart cfg.json --fsdp --bf16 --cp 2 --sequence-length 65536
//   03_qwen3_quickstart cfg.json --bf16-params sr --lora   # LoRA fine-tuning, base frozen
//   tools/d9drun -n 2 03_qwen3_quickstart cfg.json --fp8 rowwise --fsdp --fp8-gather  # FP8 GEMMs
//
// The configuration block below is the plan: the mesh's data-parallel degree comes from the world
// size (d9d::dynamic), gradients are all-reduced in buckets during backward (Replicate), and the
// precision is chosen by --bf16 between compiled plans. --pipeline picks a plan with a pipeline
// schedule; its pp degree comes from --pp or the config's "mesh" section (the model needs
// "tie_word_embeddings": false then). Everything else is in the JSON file.
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>

#include <d9d/d9d.hpp>
#include <d9d/peft/lora.hpp>

#include "examples/common/command_line.hpp"
#include "examples/common/preflight.hpp"
#include "examples/common/report.hpp"

// ---- configuration: one `using` per plan slot -------------------------------------------------
using Mesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>>;  // or d9d::mesh<d9d::dp_replicate<2>>
using DataParallel = d9d::parallel::Replicate;            // --fsdp: d9d::parallel::FullyShard<>
using Fp32Plan = d9d::Plan<Mesh, DataParallel, d9d::precision::Fp32>;
using Bf16Plan = d9d::Plan<Mesh, DataParallel, d9d::precision::Bf16Mixed>;  // --bf16 (GPU)
// --bf16 --reduce-bf16 (also with --fsdp): the gradients' all-reduce (reduce-scatter) in bfloat16.
using Bf16ReducePlan = d9d::Plan<Mesh, DataParallel, d9d::precision::Bf16MixedBf16Reduce>;
// --bf16-params sr|nearest: bfloat16 parameters, no float32 master copy; AdamW's updates rounded
// stochastically (float32 moments) or to nearest (torch's fused AdamW, bfloat16 moments).
using SrPlan = d9d::Plan<Mesh, DataParallel, d9d::precision::Bf16Params<>>;
using SrBf16MomentsPlan = d9d::Plan<Mesh, DataParallel,
                                    d9d::precision::Bf16Params<d9d::precision::StochasticRounding,
                                                               d9d::precision::Dtype::bfloat16>>;
using NearestPlan =
    d9d::Plan<Mesh, DataParallel, d9d::precision::Bf16Params<d9d::precision::NearestRounding>>;
// --lora (with --bf16-params sr): rank-16 LoRA adapters (alpha 32) on every linear layer but the
// LM head, the base frozen in bfloat16; the fine-tuning comparison of tools/gpu/speed-bench.
using LoraPlan =
    d9d::Plan<Mesh, DataParallel, d9d::peft::Lora<16, 32>, d9d::precision::Bf16Params<>>;
// --fsdp: parameters, gradients and AdamW state sharded over the ranks (ZeRO-3); --recompute:
// every decoder layer recomputes its activations in backward; --recompute-attention: only their
// attention parts (selective recompute).
using ShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>>;
template <class Precision, class Recompute = d9d::recompute::None>
using FsdpPlan = d9d::Plan<ShardMesh, d9d::parallel::FullyShard<>, Precision, Recompute>;
// --tp: every rank one tensor-parallel shard (Megatron's layout) with sequence parallelism
// between the blocks; the world is the tp degree, the batch is not split over ranks.
template <class Precision>
using TpPlan =
    d9d::Plan<d9d::mesh<d9d::tp<d9d::dynamic>>,
              d9d::parallel::TensorParallel<d9d::parallel::SequenceParallel::on>, Precision>;
// --cp N (with --fsdp --bf16): each sequence split over N ranks in load-balanced chunks
// (d9d::parallel::ContextParallel), the parameters sharded over dp_shard x cp; --ring passes the
// keys and values around a ring instead of all-gathering them.
using CpMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::cp_shard<d9d::dynamic>>;
template <d9d::parallel::KvRotation R, class Recompute>
using CpPlan = d9d::Plan<CpMesh, d9d::parallel::FullyShard<>, d9d::parallel::ContextParallel<R>,
                         d9d::precision::Bf16Mixed, Recompute>;
// --pipeline: pp from the config, data parallel over the rest of the world.
using PipelineMesh = d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_replicate<d9d::dynamic>>;
template <class Schedule, class Precision>
using PipelinePlan = d9d::Plan<PipelineMesh, DataParallel, Schedule, Precision>;
// --fp8 rowwise|tensorwise: the attention and MLP projections' GEMMs in float8 over Bf16Mixed
// (H100/H200; the CPU emulates them); with --fsdp --fp8-gather their weights are all-gathered in
// float8.
namespace fp8 = d9d::precision;
using Fp8Rowwise = fp8::Float8<fp8::Scaling::rowwise>;
using Fp8Tensorwise = fp8::Float8<fp8::Scaling::tensorwise>;
using Fp8Gathered = fp8::Float8<fp8::Scaling::rowwise, fp8::WeightGather::float8>;
using Fp8TensorwiseGathered = fp8::Float8<fp8::Scaling::tensorwise, fp8::WeightGather::float8>;
// -----------------------------------------------------------------------------------------------

namespace {

struct Options {
  std::string config_path;
  std::string data;
  std::string output;
  int64_t steps = 0;
  bool bf16 = false;
  double peak_tflops = 0;
  std::string pipeline = "none";
  int pp = 0;
  bool fsdp = false;
  bool tp = false;
  bool recompute = false;
  bool recompute_attention = false;
  bool reduce_bf16 = false;
  bool plain_kernels = false;
  std::string bf16_params;
  bool lora = false;
  std::string fp8;
  bool fp8_gather = false;
  bool cuda_graphs = false;
  int cp = 0;
  bool ring = false;
  int64_t sequence_length = 0;
  std::vector<std::string> settings;
};

template <class Plan>
int run(const d9d::DistributedContext& ctx, const d9d::TrainerConfig& cfg, double peak_tflops) {
  d9d::examples::print_preflight<Plan>(ctx, cfg);
  d9d::Qwen3Provider models;
  d9d::Trainer<Plan> trainer{ctx, models, d9d::TokenFilesProvider{}, d9d::CausalLmTask{}, cfg};
  constexpr bool kFrozenBase = !std::is_same_v<typename Plan::peft, d9d::peft::FullTune>;
  if constexpr (kFrozenBase) {
    const auto count = d9d::peft::count_parameters(*trainer.core().model());
    if (ctx.is_main_process()) {
      report::print_trainable(count);
    }
  }
  const auto result = trainer.train();
  if (ctx.is_main_process()) {
    const auto config = d9d::model::Qwen3Config::from_json_text(cfg.section("model"));
    const double tflops =
        result.tokens_per_second *
        report::training_flops_per_token(config, config.non_embedding_parameter_count(),
                                         cfg.batch.sequence_length, kFrozenBase) /
        1e12;
    std::printf(
        "model: %.1fM parameters; throughput: %.0f tokens/s over %d rank(s), %.2f TFLOP/s per rank",
        static_cast<double>(config.parameter_count()) / 1e6, result.tokens_per_second,
        ctx.world_size(), tflops / ctx.world_size());
    report::print_mfu(tflops, ctx.world_size(), peak_tflops);
    std::printf("\nhost time issuing forward + backward: %.2f ms per step",
                result.issue_seconds_per_step * 1e3);
    if (result.graph_replays > 0) {
      std::printf(" (CUDA graphs: %ld microbatches replayed)",
                  static_cast<long>(result.graph_replays));
    }
    report::print_peak_memory(result.peak_memory_bytes);
    if (!result.losses.empty()) {
      std::printf("\nloss: %.4f -> %.4f\n", result.losses.front(), result.losses.back());
    } else {
      std::printf("\nnothing to run: resumed at step %ld of %ld\n",
                  static_cast<long>(result.start_step), static_cast<long>(cfg.run.total_steps));
    }
  }
  return 0;
}

template <class Precision>
int run_pipelined(const std::string& schedule, const d9d::DistributedContext& ctx,
                  const d9d::TrainerConfig& cfg, double peak_tflops) {
  namespace pipe = d9d::pipeline;
  if (schedule == "gpipe") {
    return run<PipelinePlan<pipe::GPipe<>, Precision>>(ctx, cfg, peak_tflops);
  }
  if (schedule == "1f1b") {
    return run<PipelinePlan<pipe::OneFOneB<>, Precision>>(ctx, cfg, peak_tflops);
  }
  if (schedule == "zbh1") {
    return run<PipelinePlan<pipe::ZeroBubbleH1<>, Precision>>(ctx, cfg, peak_tflops);
  }
  return run<PipelinePlan<pipe::ZeroBubbleV<>, Precision>>(ctx, cfg, peak_tflops);
}

// --fp8: Replicate (one GPU) or FullyShard, optionally with the float8 weight gather (rowwise: and
// the attention recomputed).
int run_fp8(const Options& o, const d9d::DistributedContext& ctx, const d9d::TrainerConfig& cfg) {
  const double peak = o.peak_tflops;
  const bool rowwise = o.fp8 == "rowwise";
  if (o.bf16 || !o.bf16_params.empty() || o.tp || o.lora || o.cp > 0 || o.recompute ||
      o.reduce_bf16 || o.pipeline != "none" || (o.recompute_attention && !o.fp8_gather)) {
    throw d9d::ConfigError(
        "--fp8 is compiled alone, or with --fsdp (and --fp8-gather, then optionally "
        "--recompute-attention) in this example; it runs over bf16 mixed precision itself. Fix: "
        "drop --bf16, --bf16-params, --tp, --lora, --cp, --recompute, --reduce-bf16 and "
        "--pipeline");
  }
  if (o.fp8_gather && !o.fsdp) {
    throw d9d::ConfigError(
        "--fp8-gather gathers float8 weights under FullyShard. Fix: add --fsdp, or drop "
        "--fp8-gather");
  }
  if (o.fp8_gather && !rowwise && o.recompute_attention) {
    throw d9d::ConfigError(
        "--recompute-attention with --fp8-gather is compiled for --fp8 rowwise in this example. "
        "Fix: use --fp8 rowwise, or drop --recompute-attention");
  }
  if (o.fsdp) {
    if (o.fp8_gather && !rowwise) {
      return run<FsdpPlan<Fp8TensorwiseGathered>>(ctx, cfg, peak);
    }
    if (o.fp8_gather) {
      return o.recompute_attention
                 ? run<FsdpPlan<Fp8Gathered, d9d::recompute::Attention<>>>(ctx, cfg, peak)
                 : run<FsdpPlan<Fp8Gathered>>(ctx, cfg, peak);
    }
    return rowwise ? run<FsdpPlan<Fp8Rowwise>>(ctx, cfg, peak)
                   : run<FsdpPlan<Fp8Tensorwise>>(ctx, cfg, peak);
  }
  return rowwise ? run<d9d::Plan<Mesh, DataParallel, Fp8Rowwise>>(ctx, cfg, peak)
                 : run<d9d::Plan<Mesh, DataParallel, Fp8Tensorwise>>(ctx, cfg, peak);
}

// Everything after the command line: every library error leaves as an exception, reported by
// d9d::run_main in main (the context, destroyed by it, tells the other ranks first).
int train(const Options& o) {
  d9d::model::set_fused_kernels(!o.plain_kernels);
  const auto ctx = d9d::DistributedContext::from_env();
  // The command line's replacements, applied to the file's JSON before it is validated (so a key
  // given twice in the file is still an error).
  auto overrides = command_line::run_overrides(o.data, o.output, o.steps);
  if (o.cuda_graphs) {
    overrides.emplace_back("cuda_graphs.enabled", "true");
  }
  if (o.pp > 0) {
    overrides.emplace_back("mesh.pp", std::to_string(o.pp));
  }
  if (o.sequence_length > 0) {
    overrides.emplace_back("batch.sequence_length", std::to_string(o.sequence_length));
  }
  if (o.cp > 0) {
    if (ctx.world_size() % o.cp != 0) {
      throw d9d::ConfigError("--cp " + std::to_string(o.cp) + " does not divide the " +
                             std::to_string(ctx.world_size()) + " ranks");
    }
    overrides.emplace_back("mesh.cp_shard", std::to_string(o.cp));
    overrides.emplace_back("mesh.dp_shard", std::to_string(ctx.world_size() / o.cp));
  }
  for (const auto& setting : o.settings) {
    const auto equals = setting.find('=');
    if (equals == std::string::npos || equals == 0) {
      throw d9d::ConfigError("--set " + setting +
                             ": expected key=json (e.g. batch.microbatch_size=1)");
    }
    overrides.emplace_back(setting.substr(0, equals), setting.substr(equals + 1));
  }
  const auto cfg = d9d::TrainerConfig::from_file(o.config_path, overrides);
  if (o.recompute && !o.fsdp) {
    throw d9d::ConfigError("--recompute is compiled with --fsdp only. Fix: add --fsdp");
  }
  if (o.recompute_attention && (!o.fsdp || !o.bf16 || o.recompute || o.cp > 0)) {
    throw d9d::ConfigError(
        "--recompute-attention is compiled with --fsdp --bf16 only. Fix: add --fsdp --bf16, drop "
        "--recompute and --cp");
  }
  if (o.reduce_bf16 && (!o.bf16 || o.recompute || o.recompute_attention || o.cp > 0 || o.tp ||
                        o.pipeline != "none")) {
    throw d9d::ConfigError(
        "--reduce-bf16 is compiled with --bf16 (and optionally --fsdp) only. Fix: add --bf16, "
        "drop --recompute, --recompute-attention, --cp, --tp and --pipeline");
  }
  if ((o.fsdp || o.recompute) && o.pipeline != "none") {
    throw d9d::ConfigError("--fsdp runs without --pipeline in this example. Fix: drop one");
  }
  if (o.pp > 0 && o.pipeline == "none") {
    throw d9d::ConfigError("--pp " + std::to_string(o.pp) +
                           " needs a pipeline schedule. Fix: add --pipeline gpipe|1f1b|zbh1|zbv");
  }
  const double peak = o.peak_tflops;
  if (!o.fp8.empty()) {
    return run_fp8(o, ctx, cfg);
  }
  if (o.fp8_gather) {
    throw d9d::ConfigError(
        "--fp8-gather needs --fp8 rowwise|tensorwise --fsdp. Fix: add them, or drop it");
  }
  if (o.cp > 0) {
    if (!o.fsdp || !o.bf16 || o.tp || o.lora || !o.bf16_params.empty() || o.pipeline != "none") {
      throw d9d::ConfigError(
          "--cp is compiled with --fsdp --bf16 (and optionally --recompute, --ring) in this "
          "example. Fix: add --fsdp --bf16, drop --tp, --lora, --bf16-params and --pipeline");
    }
    using Full = d9d::recompute::Full;
    using None = d9d::recompute::None;
    constexpr auto kRing = d9d::parallel::KvRotation::ring;
    constexpr auto kGather = d9d::parallel::KvRotation::all_gather;
    if (o.ring) {
      return o.recompute ? run<CpPlan<kRing, Full>>(ctx, cfg, peak)
                         : run<CpPlan<kRing, None>>(ctx, cfg, peak);
    }
    return o.recompute ? run<CpPlan<kGather, Full>>(ctx, cfg, peak)
                       : run<CpPlan<kGather, None>>(ctx, cfg, peak);
  }
  if (o.tp) {
    if (o.fsdp || o.recompute || o.lora || !o.bf16_params.empty() || o.pipeline != "none") {
      throw d9d::ConfigError(
          "--tp is compiled alone or with --bf16 in this example. Fix: drop --fsdp, --recompute, "
          "--lora, --bf16-params and --pipeline");
    }
    return o.bf16 ? run<TpPlan<d9d::precision::Bf16Mixed>>(ctx, cfg, peak)
                  : run<TpPlan<d9d::precision::Fp32>>(ctx, cfg, peak);
  }
  if (o.lora) {
    if (o.bf16_params != "sr" || o.fsdp || o.bf16 || o.recompute || o.pipeline != "none") {
      throw d9d::ConfigError(
          "--lora is compiled with --bf16-params sr alone. Fix: use --lora --bf16-params sr");
    }
    return run<LoraPlan>(ctx, cfg, peak);
  }
  if (!o.bf16_params.empty()) {
    if (o.bf16 || o.recompute || o.pipeline != "none" || (o.fsdp && o.bf16_params != "sr")) {
      throw d9d::ConfigError(
          "--bf16-params is compiled alone, or as sr with --fsdp. Fix: drop --bf16, "
          "--recompute and --pipeline");
    }
    if (o.fsdp) {
      return run<FsdpPlan<d9d::precision::Bf16Params<>>>(ctx, cfg, peak);
    }
    if (o.bf16_params == "sr") {
      return run<SrPlan>(ctx, cfg, peak);
    }
    return o.bf16_params == "nearest" ? run<NearestPlan>(ctx, cfg, peak)
                                      : run<SrBf16MomentsPlan>(ctx, cfg, peak);
  }
  if (o.fsdp) {
    using Bf16 = d9d::precision::Bf16Mixed;
    using Fp32 = d9d::precision::Fp32;
    using Full = d9d::recompute::Full;
    if (o.recompute_attention) {
      return run<FsdpPlan<Bf16, d9d::recompute::Attention<>>>(ctx, cfg, peak);
    }
    if (o.reduce_bf16) {
      return run<FsdpPlan<d9d::precision::Bf16MixedBf16Reduce>>(ctx, cfg, peak);
    }
    if (o.recompute) {
      return o.bf16 ? run<FsdpPlan<Bf16, Full>>(ctx, cfg, peak)
                    : run<FsdpPlan<Fp32, Full>>(ctx, cfg, peak);
    }
    return o.bf16 ? run<FsdpPlan<Bf16>>(ctx, cfg, peak) : run<FsdpPlan<Fp32>>(ctx, cfg, peak);
  }
  if (o.reduce_bf16) {
    return run<Bf16ReducePlan>(ctx, cfg, peak);
  }
  if (o.pipeline == "none") {
    return o.bf16 ? run<Bf16Plan>(ctx, cfg, peak) : run<Fp32Plan>(ctx, cfg, peak);
  }
  return o.bf16 ? run_pipelined<d9d::precision::Bf16Mixed>(o.pipeline, ctx, cfg, peak)
                : run_pipelined<d9d::precision::Fp32>(o.pipeline, ctx, cfg, peak);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a Qwen3 dense model (d9d quickstart)"};
  Options o;
  app.add_option("config", o.config_path, "trainer configuration (JSON)")->required();
  app.add_option("--data", o.data, "token file (u16), replacing data.paths");
  app.add_option("--output", o.output, "output directory, replacing run.output_dir");
  app.add_option("--steps", o.steps, "optimizer steps, replacing run.total_steps")
      ->check(CLI::PositiveNumber);
  app.add_flag("--bf16", o.bf16, "bf16 mixed precision (d9d::precision::Bf16Mixed)");
  app.add_option("--peak-tflops", o.peak_tflops,
                 "per-device peak for the MFU line (e.g. 989 for H100/H200 bf16)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--pipeline", o.pipeline, "pipeline schedule: none, gpipe, 1f1b, zbh1 or zbv")
      ->check(CLI::IsMember({"none", "gpipe", "1f1b", "zbh1", "zbv"}));
  app.add_option("--pp", o.pp, "pipeline degree, replacing mesh.pp (with --pipeline)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--no-fused-kernels", o.plain_kernels,
               "the ATen compositions instead of d9d's fused ops (for comparisons)");
  app.add_option("--bf16-params", o.bf16_params,
                 "bfloat16 parameters, AdamW rounding stochastically (sr, also with --fsdp; "
                 "sr-bf16-moments) or to nearest (d9d::precision::Bf16Params)")
      ->check(CLI::IsMember({"sr", "sr-bf16-moments", "nearest"}));
  app.add_flag("--lora", o.lora,
               "LoRA fine-tuning: rank-16 adapters on every linear layer but the head, the rest "
               "frozen (d9d::peft::Lora<16, 32>; with --bf16-params sr)");
  app.add_option("--fp8", o.fp8,
                 "float8 GEMMs in the attention and MLP projections over bf16 mixed precision, "
                 "scaled per row or per tensor (d9d::precision::Float8; H100/H200, emulated on "
                 "the CPU)")
      ->check(CLI::IsMember({"rowwise", "tensorwise"}));
  app.add_flag("--fp8-gather", o.fp8_gather,
               "with --fp8 and --fsdp: weights all-gathered in float8 with their scales "
               "(d9d::precision::WeightGather::float8)");
  app.add_flag("--fsdp", o.fsdp, "fully sharded data parallelism (d9d::parallel::FullyShard<>)");
  app.add_flag("--tp", o.tp,
               "tensor parallelism with sequence parallelism over all ranks "
               "(d9d::parallel::TensorParallel<SequenceParallel::on>; \"mesh.tp\" = the number "
               "of ranks, which must divide the model's heads, KV heads, intermediate size and "
               "vocabulary)");
  app.add_flag("--recompute", o.recompute,
               "recompute every decoder layer's activations in backward (with --fsdp)");
  app.add_flag("--recompute-attention", o.recompute_attention,
               "selective recompute: only the attention part of every decoder layer "
               "(d9d::recompute::Attention<>; with --fsdp --bf16)");
  app.add_flag("--reduce-bf16", o.reduce_bf16,
               "gradients all-reduced (reduce-scattered with --fsdp) in bfloat16, half the bytes "
               "(d9d::precision::Bf16MixedBf16Reduce; with --bf16)");
  app.add_flag("--cuda-graphs", o.cuda_graphs,
               "capture each microbatch's forward and backward once and replay it (one GPU or "
               "--tp alone, no pipeline; config \"cuda_graphs\")");
  app.add_option("--cp", o.cp,
                 "context parallelism over N ranks: each sequence split in load-balanced chunks "
                 "(d9d::parallel::ContextParallel; with --fsdp --bf16, sharded over dp_shard x cp)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--ring", o.ring, "with --cp: keys and values passed around a ring, not gathered");
  app.add_option("--sequence-length", o.sequence_length, "replacing batch.sequence_length")
      ->check(CLI::PositiveNumber);
  app.add_option("--set", o.settings,
                 "a config key and its JSON value, key=value (e.g. batch.global_batch_size=2); "
                 "repeatable");
  CLI11_PARSE(app, argc, argv);

  // One clear message and a non-zero status for every error, never std::terminate: 2 for a
  // configuration error, 1 for any other (d9d/train/main.hpp).
  return d9d::run_main(argc, argv, [&o] { return train(o); });
}
