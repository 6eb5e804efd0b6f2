// tools/advise — what each rank keeps between steps under a Plan, before launch: its parameters,
// gradients and AdamW moments (d9d/advise/state_memory.hpp), for a trainer config's Qwen3 model.
//
//   bazel run //tools/advise -- --config examples/03_qwen3_quickstart/qwen3_8b_gpu.json
//       --data-parallel fully_shard --dp-shard 2 --precision bf16_mixed      (one line)
//   bazel run //tools/advise -- --config ... --pp 2 --schedule zbv --tp 2 --precision bf16_params
//
// One line per distinct rank (pipeline rank x shard rank): bytes and GiB of each part, then the
// largest; without fp64, tp or cp also the activations one microbatch keeps, or under a pipeline
// each rank's microbatches in flight
// (d9d/advise/activation_memory.hpp). Gathered units and communication buffers are not predicted
// yet. A Qwen3-MoE config ("model_type": "qwen3_moe", example 05's) gets its state, with --ep N
// for expert parallelism (each line then also names the rank's ep_replicate coordinate when
// FullyShard shards the experts) and, without a pipeline or recompute, the activations of a
// microbatch and the step's peak (--expert-load: the rows a rank's experts get over balanced)
// and, with --profile, its step time. --lora R prints the pre-flight's prediction for LoRA of rank
// R on every linear layer but the head (d9d::advise::predict_plan: the adapters and the frozen
// base, the activations, the peak, and with --profile the step), under Replicate without tp.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <d9d/advise/activation_memory.hpp>
#include <d9d/advise/candidates.hpp>
#include <d9d/advise/preflight.hpp>
#include <d9d/advise/ranking.hpp>
#include <d9d/advise/state_memory.hpp>
#include <d9d/advise/step_time.hpp>
#include <d9d/d9d.hpp>

namespace {

using d9d::advise::compute_of;
using d9d::advise::precision_rules;

double gib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

// --candidates N: every Plan shape for N ranks (d9d/advise/ranking.hpp) with the memory its
// fullest rank is predicted to need and, with --profile, its predicted step, ranked.
void print_candidates(const d9d::TrainerConfig& config, const d9d::advise::RankOptions& options,
                      int world, const std::string& json_path) {
  const auto ranked = d9d::advise::rank_plans(config, world, options);
  std::printf(
      "%zu candidate Plans for %d ranks, %s; per rank: the most state any rank keeps, its "
      "activations (- where not predicted yet)%s\n",
      ranked.size(), world, options.precision.c_str(),
      options.machine != nullptr ? ("; the predicted step on " + options.machine->device).c_str()
                                 : "");
  int over = 0;
  for (const auto& r : ranked) {
    std::string activations = "-";
    if (r.activation_bytes) {
      char text[32];
      std::snprintf(text, sizeof(text), "%.2f", gib(*r.activation_bytes));
      activations = text;
    }
    std::string time;
    if (r.time) {
      char text[64];
      std::snprintf(text, sizeof(text), "  step %8.1f ms %9.0f tokens/s", r.time->total * 1e3,
                    r.time->tokens_per_second());
      time = text;
    }
    over += r.fits ? 0 : 1;
    std::printf("  %-58s state %8.2f GiB  activations %8s GiB%s%s\n", r.plan.describe().c_str(),
                gib(r.state_bytes), activations.c_str(), time.c_str(),
                r.fits ? "" : "  (does not fit)");
  }
  if (options.memory_bytes > 0) {
    std::printf("%d of %zu do not fit in %.1f GiB by the bytes predicted so far\n", over,
                ranked.size(), gib(options.memory_bytes));
  }
  if (!json_path.empty()) {
    std::FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) {
      throw std::runtime_error("cannot write " + json_path);
    }
    const auto text = d9d::advise::ranking_json(ranked);
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
    std::printf("ranking written to %s\n", json_path.c_str());
  }
}

// "step time on DEVICE: ..." and its breakdown (d9d/advise/step_time.hpp).
void print_step_time(const d9d::advise::StepTime& t, const std::string& device) {
  const auto ms = [](double s) { return s * 1e3; };
  std::printf("step time on %s: %.3f ms, %.0f tokens/s (%lld tokens per step)\n", device.c_str(),
              ms(t.total), t.tokens_per_second(), static_cast<long long>(t.tokens));
  std::printf(
      "  matmuls %.1f, attention %.1f, elementwise %.1f, optimizer %.1f, tensor parallel %.1f, "
      "context parallel %.1f, pipeline p2p %.1f, bubble %.1f, data parallel %.1f (%.1f exposed) "
      "ms\n",
      ms(t.gemm), ms(t.attention), ms(t.memory), ms(t.optimizer), ms(t.tensor_parallel),
      ms(t.context_parallel), ms(t.pipeline_p2p), ms(t.bubble), ms(t.data_parallel),
      ms(t.data_parallel_exposed));
  if (t.host > 0) {
    std::printf("  host issuing the step: %.1f ms%s\n", ms(t.host),
                t.host >= t.total ? " (host-bound: the step's time)" : "");
  }
}

// The config's microbatches per step when --microbatches is not given: its global batch over
// `data_parallel` ranks' microbatches (at least one).
int default_microbatches(const d9d::TrainerConfig& config, int data_parallel) {
  const int64_t per_step = config.batch.microbatch_size * data_parallel;
  return static_cast<int>(
      std::max<int64_t>(1, per_step > 0 ? config.batch.global_batch_size / per_step : 1));
}

// The Plan's pipeline program (empty without a pipeline).
d9d::pipeline::Program program_of(int pp, const std::string& schedule, int microbatches) {
  return pp > 1 ? d9d::advise::build_schedule(schedule, pp, microbatches)
                : d9d::pipeline::Program{};
}

int64_t parameter_count(const std::vector<d9d::advise::ParameterShape>& parameters) {
  int64_t count = 0;
  for (const auto& p : parameters) {
    count += p.numel();
  }
  return count;
}

// The options print_moe_state reads.
struct MoePlan {
  std::string data_parallel;
  std::string precision;
  std::string schedule;
  int dp_shard = 1;
  int pp = 1;
  int ep = 1;
  int microbatches = 0;
  bool recompute = false;
  bool reshard_after_forward = true;
  bool reduce_once = false;
  bool reduce_bf16 = false;
  double expert_load = 1.0;
  const d9d::advise::MachineProfile* machine = nullptr;  ///< --profile: predict the step time
};

// How the Plan runs the experts, given its state rules (d9d::advise::expert_split).
d9d::advise::ExpertSplit expert_split(const MoePlan& plan, const d9d::advise::StateRules& rules) {
  const bool shards = plan.data_parallel == "fully_shard";
  return d9d::advise::expert_split(rules, shards, compute_of(plan.precision, shards),
                                   plan.expert_load);
}

// With --profile: the MoE step's predicted time (d9d/advise/step_time.hpp), the rank's experts
// getting `expert_load` times their balanced rows.
void print_moe_step_time(const d9d::TrainerConfig& config, const d9d::model::Qwen3MoeConfig& model,
                         const MoePlan& plan, const d9d::advise::ExpertSplit& split,
                         int microbatches) {
  if (plan.machine == nullptr) {
    return;
  }
  const bool shards = plan.data_parallel == "fully_shard";
  const auto compute = compute_of(plan.precision, shards);
  if (compute == d9d::advise::Compute::float32) {
    std::printf("step time: not predicted for %s (the profile measures bfloat16 matmuls)\n",
                plan.precision.c_str());
    return;
  }
  const d9d::advise::Candidate candidate{.fully_shard = shards,
                                         .dp_replicate = shards ? 1 : plan.dp_shard,
                                         .dp_shard = shards ? plan.dp_shard : 1,
                                         .microbatches = microbatches};
  const d9d::advise::StepOptions options{.microbatch_size = config.batch.microbatch_size,
                                         .sequence_length = config.batch.sequence_length,
                                         .precision = precision_rules(plan.precision),
                                         .compute = compute,
                                         .reduce_bf16 = plan.reduce_bf16,
                                         .reshard_after_forward = plan.reshard_after_forward,
                                         .reduce_every_microbatch = !plan.reduce_once};
  const auto t = d9d::advise::predict_step_time(model, candidate, split, options, *plan.machine);
  print_step_time(t, plan.machine->device);
  std::printf("  of which the routed experts %.1f ms, expert parallelism's all-to-alls %.1f ms\n",
              t.experts * 1e3, t.expert_parallel * 1e3);
}

// A Qwen3-MoE's state per rank (d9d/advise/state_memory.hpp): one line per pipeline rank, shard
// rank and, when FullyShard shards the experts over ep_replicate, expert shard rank.
void print_moe_state(const d9d::TrainerConfig& config, const d9d::model::Qwen3MoeConfig& model,
                     const MoePlan& plan) {
  auto rules = precision_rules(plan.precision);
  const bool shards = plan.data_parallel == "fully_shard";
  d9d::MeshShape shape{.pp = plan.pp, .ep = plan.ep};
  (shards ? shape.dp_shard : shape.dp_replicate) = plan.dp_shard;
  if (shards) {
    rules.shard_ranks = plan.dp_shard;
  }
  if (plan.ep > 1) {
    rules.expert_parallel = true;
    rules.expert_ranks = plan.ep;
    rules.expert_shard_ranks = shards ? d9d::advise::expert_replicate_ranks(shape) : 1;
  }
  const int microbatches =
      plan.microbatches > 0 ? plan.microbatches : default_microbatches(config, plan.dp_shard);
  const auto program = program_of(plan.pp, plan.schedule, microbatches);
  const auto all = d9d::advise::qwen3_parameters(model);
  std::printf("model: %.3fB parameters (Qwen3-MoE, %lld layers, %lld experts, top %lld)\n",
              static_cast<double>(parameter_count(all)) / 1e9,
              static_cast<long long>(model.num_hidden_layers),
              static_cast<long long>(model.num_experts),
              static_cast<long long>(model.num_experts_per_tok));
  std::printf("plan: %s over %d shard rank(s), %s, ep %d (experts sharded over %d), pp %d\n",
              plan.data_parallel.c_str(), rules.shard_ranks, plan.precision.c_str(), plan.ep,
              rules.expert_shard_ranks, plan.pp);
  std::printf("state per rank: parameters, gradients, AdamW moments, total (bytes, GiB)\n");
  d9d::advise::StateBytes largest{};  // the rank that keeps the most
  for (int p = 0; p < plan.pp; ++p) {
    const auto mine = plan.pp > 1 ? d9d::advise::qwen3_rank_parameters(model, program, p,
                                                                       config.batch.sequence_length)
                                  : all;
    // Each rank of the stage: its dp_shard coordinate (FullyShard) and, in the expert domain
    // (ep_replicate, then ep_shard innermost), its ep_replicate coordinate.
    for (int r = 0; r < plan.dp_shard; ++r) {
      const int s = shards ? r : 0;
      const int e = (r / plan.ep) % rules.expert_shard_ranks;
      const auto bytes = d9d::advise::state_bytes(mine, rules, s, e);
      std::printf(
          "  pp %d, shard %d, expert shard %d: %lld %lld %lld %lld  (%.2f %.2f %.2f %.2f GiB)\n", p,
          s, e, static_cast<long long>(bytes.parameters), static_cast<long long>(bytes.gradients),
          static_cast<long long>(bytes.optimizer), static_cast<long long>(bytes.total()),
          gib(bytes.parameters), gib(bytes.gradients), gib(bytes.optimizer), gib(bytes.total()));
      if (bytes.total() > largest.total()) {
        largest = bytes;
      }
      if (!shards && rules.expert_shard_ranks == 1) {
        break;  // every rank of the stage holds the same bytes
      }
    }
  }
  std::printf("largest: %.2f GiB\n", gib(largest.total()));
  if (plan.pp > 1 || plan.recompute || plan.precision == "fp64") {
    std::printf(
        "not predicted yet for a MoE model%s: activations, step time, gathered units, "
        "communication buffers\n",
        plan.pp > 1      ? " under a pipeline"
        : plan.recompute ? " under recompute"
                         : " in fp64");
    return;
  }
  // Without a pipeline: one microbatch's activations (the rank's experts getting `expert_load`
  // times its own routings), then the step's peak on the rank with the most state.
  const auto split = expert_split(plan, rules);
  print_moe_step_time(config, model, plan, split, microbatches);
  const auto compute = compute_of(plan.precision, shards);
  const auto kept = d9d::advise::qwen3_moe_activation_bytes(
      model, config.batch.microbatch_size, config.batch.sequence_length, compute, split);
  std::printf(
      "activations of a microbatch (experts at %.2fx their balanced rows): %lld (%.2f GiB: layers "
      "%.2f, head and embedding %.2f, rotary tables %.4f)\n",
      plan.expert_load, static_cast<long long>(kept.total()), gib(kept.total()), gib(kept.layers),
      gib(kept.loss), gib(kept.rope));
  if (rules.expert_shard_ranks > 1) {
    // fully_shard_gathered_bytes does not know the experts' own units over ep_replicate yet.
    std::printf(
        "not predicted yet for a MoE model: the peak during a step (the experts' own "
        "FullyShard units over ep_replicate), communication buffers\n");
    return;
  }
  const int64_t gathered =
      d9d::advise::fully_shard_gathered_step_bytes(all, rules, compute, plan.reshard_after_forward);
  const auto rank = d9d::advise::moe_rank_memory(
      model, rules, microbatches, config.batch.microbatch_size, config.batch.sequence_length,
      compute, split, plan.reshard_after_forward);
  std::printf(
      "peak during a step: %.2f GiB (parameters and moments, the activations, the gradients from "
      "the first backward, FullyShard's gathered units %.2f GiB; %d microbatch(es))\n",
      gib(rank.peak.value_or(0)), gib(gathered), microbatches);
  std::printf(
      "not predicted yet for a MoE model: communication buffers, the step's transient buffers\n");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"What each rank keeps between steps under a Plan (d9d::advise)"};
  std::string config_path;
  std::string data_parallel = "replicate";
  std::string precision = "bf16_mixed";
  std::string schedule = "1f1b";
  int dp_shard = 1;
  int cp_shard = 1;
  int tp = 1;
  int pp = 1;
  int ep = 1;
  int microbatches = 0;
  app.add_option("--config", config_path, "trainer configuration (JSON) with a Qwen3 model")
      ->required();
  app.add_option("--data-parallel", data_parallel, "replicate or fully_shard")
      ->check(CLI::IsMember({"replicate", "fully_shard"}));
  app.add_option("--precision", precision,
                 "fp32, bf16_mixed, bf16_params, bf16_params_nearest, fp64");
  app.add_option("--dp-shard", dp_shard,
                 "data-parallel ranks (FullyShard shards over them; Replicate replicates)");
  app.add_option("--cp-shard", cp_shard, "context-parallel ranks (shard with FullyShard)");
  app.add_option("--tp", tp, "tensor-parallel degree");
  bool sequence_parallel = false;
  app.add_flag("--sequence-parallel", sequence_parallel,
               "with --tp: the residual stream split by tokens too (TensorParallel<on>)");
  app.add_option("--pp", pp, "pipeline degree");
  app.add_option("--ep", ep,
                 "expert-parallel degree (a Qwen3-MoE config: its experts split over ep ranks)");
  app.add_option("--schedule", schedule, "gpipe, 1f1b, interleaved, zbh1, zbv, dualpipev");
  std::string recompute = "none";
  app.add_option("--recompute", recompute,
                 "none; full: decoder layers recomputed in backward (recompute::Full, "
                 "EveryNth<K>); attention: only their attention part (recompute::Attention<K>)")
      ->check(CLI::IsMember({"none", "full", "attention"}));
  int recompute_every = 1;
  app.add_option("--recompute-every", recompute_every,
                 "with --recompute: every K-th layer (layers K-1, 2K-1, ...; default 1: all)")
      ->check(CLI::PositiveNumber);
  int candidates = 0;
  double memory_gib = 0;
  app.add_option("--candidates", candidates,
                 "list every Plan shape for this many ranks with its predicted memory instead");
  app.add_option("--memory-gib", memory_gib, "with --candidates: mark those that do not fit");
  app.add_option("--microbatches", microbatches,
                 "microbatches per step (default: the config's global / (dp x microbatch))");
  std::string profile_path;
  app.add_option("--profile", profile_path,
                 "machine profile (tools/gpu/profile-machine's JSON): predict the step time");
  std::string reshard = "after_forward";
  app.add_option("--reshard", reshard,
                 "FullyShard: after_forward (gathered again for backward) or never (once a step)")
      ->check(CLI::IsMember({"after_forward", "never"}));
  bool reduce_once = false;
  bool reduce_bf16 = false;
  app.add_flag("--reduce-once", reduce_once, "FullyShard: one reduce-scatter per step");
  app.add_flag("--reduce-bf16", reduce_bf16, "data-parallel gradients reduced in bfloat16");
  double expert_load = 1.0;
  app.add_option("--expert-load", expert_load,
                 "with --ep: the rows a rank's experts get over its own tokens' routings (1: "
                 "balanced; the most loaded rank of a collapsed router more, up to ep)")
      ->check(CLI::NonNegativeNumber);
  std::string json_path;
  app.add_option("--json", json_path, "with --candidates and --profile: write the ranking here");
  int lora_rank = 0;
  int lora_alpha = 0;
  app.add_option("--lora", lora_rank,
                 "LoRA adapters of this rank on every linear layer but the head, the rest frozen "
                 "(d9d::peft::Lora<rank, 2 rank>, the quickstart's --lora): the pre-flight's "
                 "prediction (state, activations, peak, step time with --profile)")
      ->check(CLI::PositiveNumber);
  app.add_option("--lora-alpha", lora_alpha, "with --lora: the adapters' alpha (default 2 rank)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    const auto config = d9d::TrainerConfig::from_file(config_path);
    const auto& model_json = config.sections.at("model");
    const bool moe = std::regex_search(model_json, std::regex(R"("model_type"\s*:\s*"qwen3_moe")"));
    std::optional<d9d::advise::MachineProfile> machine;
    if (!profile_path.empty()) {
      machine = d9d::advise::MachineProfile::from_file(profile_path);
    }
    if (moe) {
      print_moe_state(config, d9d::model::Qwen3MoeConfig::from_json_text(model_json),
                      {.data_parallel = data_parallel,
                       .precision = precision,
                       .schedule = schedule,
                       .dp_shard = dp_shard,
                       .pp = pp,
                       .ep = ep,
                       .microbatches = microbatches,
                       .recompute = recompute != "none",
                       .reshard_after_forward = reshard == "after_forward",
                       .reduce_once = reduce_once,
                       .reduce_bf16 = reduce_bf16,
                       .expert_load = expert_load,
                       .machine = machine ? &*machine : nullptr});
      return 0;
    }
    if (ep > 1) {
      throw std::invalid_argument("--ep " + std::to_string(ep) +
                                  ": the config's model is a dense Qwen3 (no experts)");
    }
    const auto model = d9d::model::Qwen3Config::from_json_text(model_json);
    const d9d::advise::Recompute recomputing{.every_nth = recompute == "none" ? 0 : recompute_every,
                                             .attention_only = recompute == "attention"};
    if (lora_rank > 0) {
      if (data_parallel == "fully_shard" || tp > 1 || candidates > 0) {
        throw std::invalid_argument(
            "--lora: predicted under replicate without tp and without --candidates so far (a "
            "PEFT policy's frozen shards under FullyShard or tp are not predicted yet)");
      }
      d9d::advise::PreflightPlan plan;
      plan.candidate = {
          .dp_replicate = dp_shard,
          .cp = cp_shard,
          .pp = pp,
          .schedule = pp > 1 ? schedule : std::string{},
          .microbatches = microbatches > 0 ? microbatches : default_microbatches(config, dp_shard)};
      if (pp > 1) {
        plan.program = program_of(pp, schedule, plan.candidate.microbatches);
      }
      plan.rules = precision_rules(precision);
      if (precision != "fp64") {
        plan.compute = compute_of(precision, false);
      }
      plan.recompute = recomputing;
      plan.reduce_bf16 = reduce_bf16;
      plan.peft = {.methods = {{.kind = d9d::peft::MethodKind::lora,
                                .rank = lora_rank,
                                .alpha = lora_alpha > 0 ? lora_alpha : 2 * lora_rank}},
                   .rest_trains = false};
      const auto predicted =
          d9d::advise::predict_plan(config, plan, machine ? &*machine : nullptr, memory_gib);
      for (const auto& line : predicted.lines) {
        std::printf("%s\n", line.c_str());
      }
      return 0;
    }
    if (candidates > 0) {
      print_candidates(config,
                       {.precision = precision,
                        .recompute = recomputing,
                        .memory_bytes = static_cast<int64_t>(memory_gib * 1024 * 1024 * 1024),
                        .machine = machine ? &*machine : nullptr},
                       candidates, json_path);
      return 0;
    }
    auto rules = precision_rules(precision);
    if (data_parallel == "fully_shard") {
      rules.shard_ranks = dp_shard * cp_shard;
    }
    rules.tensor_ranks = tp;
    if (microbatches < 1) {
      microbatches = default_microbatches(config, dp_shard);
    }
    const auto program = program_of(pp, schedule, microbatches);
    const auto all = d9d::advise::qwen3_parameters(model);
    std::printf("model: %.3fB parameters (Qwen3, %lld layers, vocab %lld)\n",
                static_cast<double>(parameter_count(all)) / 1e9,
                static_cast<long long>(model.num_hidden_layers),
                static_cast<long long>(model.vocab_size));
    std::printf(
        "plan: %s over %d shard rank(s), %s, tp %d, pp %d%s\n", data_parallel.c_str(),
        rules.shard_ranks, precision.c_str(), tp, pp,
        pp > 1 ? (" (" + schedule + ", " + std::to_string(microbatches) + " microbatches)").c_str()
               : "");
    std::printf("state per rank: parameters, gradients, AdamW moments, total (bytes, GiB)\n");
    int64_t largest = 0;
    std::string where;
    for (int p = 0; p < pp; ++p) {
      const auto mine = pp > 1 ? d9d::advise::qwen3_rank_parameters(model, program, p,
                                                                    config.batch.sequence_length)
                               : all;
      for (int s = 0; s < rules.shard_ranks; ++s) {
        const auto bytes = d9d::advise::state_bytes(mine, rules, s);
        std::printf(
            "  pp %d, shard %d: %lld %lld %lld %lld  (%.2f %.2f %.2f %.2f GiB)\n", p, s,
            static_cast<long long>(bytes.parameters), static_cast<long long>(bytes.gradients),
            static_cast<long long>(bytes.optimizer), static_cast<long long>(bytes.total()),
            gib(bytes.parameters), gib(bytes.gradients), gib(bytes.optimizer), gib(bytes.total()));
        if (bytes.total() > largest) {
          largest = bytes.total();
          where = "pp " + std::to_string(p) + ", shard " + std::to_string(s);
        }
      }
    }
    std::printf("largest: %.2f GiB (%s)\n", gib(largest), where.c_str());
    if (machine &&
        compute_of(precision, data_parallel == "fully_shard") == d9d::advise::Compute::float32) {
      std::printf("step time: not predicted for %s (the profile measures bfloat16 matmuls)\n",
                  precision.c_str());
    } else if (machine) {
      d9d::advise::Candidate plan{.fully_shard = data_parallel == "fully_shard",
                                  .dp_replicate = data_parallel == "fully_shard" ? 1 : dp_shard,
                                  .dp_shard = data_parallel == "fully_shard" ? dp_shard : 1,
                                  .cp = cp_shard,
                                  .tp = tp,
                                  .pp = pp,
                                  .schedule = pp > 1 ? schedule : std::string{},
                                  .microbatches = microbatches};
      const d9d::advise::StepOptions options{.microbatch_size = config.batch.microbatch_size,
                                             .sequence_length = config.batch.sequence_length,
                                             .precision = precision_rules(precision),
                                             .compute = compute_of(precision, plan.fully_shard),
                                             .recompute = recomputing,
                                             .reduce_bf16 = reduce_bf16,
                                             .reshard_after_forward = reshard == "after_forward",
                                             .reduce_every_microbatch = !reduce_once};
      print_step_time(d9d::advise::predict_step_time(model, plan, options, *machine),
                      machine->device);
    }
    if (precision != "fp64" && (tp == 1 || pp == 1) && cp_shard == 1 &&
        !(recomputing.every_nth > 1 && pp > 1)) {
      const auto compute = compute_of(precision, data_parallel == "fully_shard");
      const int64_t mb = config.batch.microbatch_size;
      const int64_t seq = config.batch.sequence_length;
      if (pp == 1) {
        // One microbatch is in flight without a pipeline (accumulation runs them in turn).
        const auto kept = d9d::advise::qwen3_activation_bytes(
            model, mb, seq, compute, recomputing,
            {.ranks = tp, .sequence_parallel = sequence_parallel});
        std::printf(
            "activations of a microbatch: %lld (%.2f GiB: layers %.2f, head and embedding %.2f, "
            "rotary tables %.4f); state + activations: %.2f GiB\n",
            static_cast<long long>(kept.total()), gib(kept.total()), gib(kept.layers),
            gib(kept.loss), gib(kept.rope), gib(largest + kept.total()));
        const int64_t gathered =
            d9d::advise::fully_shard_gathered_step_bytes(all, rules, compute, reshard != "never");
        std::array<char, 96> units{};
        if (gathered > 0) {
          std::snprintf(units.data(), units.size(), ", FullyShard's gathered units %.2f GiB",
                        gib(gathered));
        }
        std::printf(
            "peak during a step: %.2f GiB (parameters and moments, the activations, the gradients "
            "from the first backward%s; %d microbatch(es))\n",
            gib(*d9d::advise::fullest_rank_memory(model, program, 1, microbatches, rules, mb, seq,
                                                  compute, recomputing, reshard != "never",
                                                  sequence_parallel)
                     .peak),
            units.data(), microbatches);
      } else {
        // Each pipeline rank: its stages' microbatches in flight as the program runs them.
        std::printf(
            "activations in flight per pipeline rank (bytes, GiB), and its peak during a step:\n");
        const auto ranks =
            d9d::advise::rank_memory(model, program, pp, microbatches, rules, mb, seq, compute,
                                     recomputing, reshard != "never", sequence_parallel);
        for (int p = 0; p < pp; ++p) {
          const auto& rank = ranks[static_cast<std::size_t>(p)];
          std::printf("  pp %d: %lld  (%.2f GiB), peak %.2f GiB\n", p,
                      static_cast<long long>(*rank.activations), gib(*rank.activations),
                      gib(*rank.peak));
        }
      }
      std::printf("not predicted yet: %scommunication buffers, the step's transient buffers\n",
                  pp > 1 && rules.shard_ranks > 1 ? "gathered units under a pipeline, " : "");
    } else {
      std::printf(
          "not predicted yet: activations (predicted without fp64 or cp, tp and recompute of "
          "every K-th layer without a pipeline, so far), gathered units, communication "
          "buffers\n");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "advise: %s\n", e.what());
    return 1;
  }
  return 0;
}
