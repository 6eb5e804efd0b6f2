// d9d::advise::preflight (d9d/advise/preflight.hpp): the runtime part, which reads the config's
// "advise" section and the Plan's facts and writes the lines to log.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <d9d/advise/preflight.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/model/qwen3_moe.hpp>
#include <d9d/train/config.hpp>

namespace d9d::advise {

namespace {

[[noreturn]] void bad_setting(const std::string& what) {
  throw ConfigError("d9d config: advise." + what);
}

std::string gib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f GiB",
                static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return text;
}

// Why the activations are not predicted for this Plan, or empty when they are.
std::string activations_unknown(const PreflightPlan& plan) {
  if (!plan.compute) {
    return "fp64";
  }
  if (plan.fine_tunes() && plan.candidate.pp > 1) {
    return "a PEFT policy under a pipeline";
  }
  if (plan.fine_tunes() && plan.recompute.any()) {
    return "a PEFT policy with recompute";
  }
  if (plan.float8) {
    return "Float8";
  }
  if (plan.candidate.tp > 1 && plan.candidate.pp > 1) {
    return "tensor parallelism under a pipeline";
  }
  if (plan.candidate.cp > 1) {
    return "context parallelism";
  }
  if (plan.recompute.every_nth > 1 && plan.candidate.pp > 1) {
    return "recompute of every K-th layer under a pipeline";
  }
  return {};
}

// Why a Qwen3-MoE's activations (and step time) are not predicted for this Plan, or empty.
std::string moe_unknown(const PreflightPlan& plan) {
  if (!plan.compute) {
    return "fp64";
  }
  if (plan.float8) {
    return "Float8";
  }
  const auto& c = plan.candidate;
  if (c.pp > 1 || c.tp > 1 || c.cp > 1 || plan.recompute.any()) {
    return std::string("a MoE model under ") + (c.pp > 1   ? "a pipeline"
                                                : c.tp > 1 ? "tensor parallelism"
                                                : c.cp > 1 ? "context parallelism"
                                                           : "recompute");
  }
  return {};
}

// The step-time line on `machine` for `time`.
std::string step_line(const MachineProfile& machine, const StepTime& time) {
  char text[256];
  std::snprintf(text, sizeof(text),
                "advise: predicted step on %s: %.1f ms, %.0f tokens/s (bubble %.1f ms, data "
                "parallel %.1f ms)",
                machine.device.c_str(), time.total * 1e3, time.tokens_per_second(),
                time.bubble * 1e3, time.data_parallel_exposed * 1e3);
  return text;
}

// The state line's start: the Plan and the fullest rank's state.
std::string state_line(const std::string& plan, const StateBytes& state) {
  return "advise: " + plan + "; predicted for the fullest rank: state " + gib(state.total()) +
         " (parameters " + gib(state.parameters) + ", gradients " + gib(state.gradients) +
         ", AdamW moments " + gib(state.optimizer) + ")";
}

StepOptions step_options(const TrainerConfig& config, const PreflightPlan& plan) {
  return {.microbatch_size = config.batch.microbatch_size,
          .sequence_length = config.batch.sequence_length,
          .precision = *plan.rules,
          .compute = *plan.compute,
          .recompute = plan.recompute,
          .reduce_bf16 = plan.reduce_bf16,
          .reshard_after_forward = config.data_parallel.reshard != "never",
          .reduce_every_microbatch = config.data_parallel.reduce_every_microbatch,
          .peft = plan.fine_tunes() ? std::optional<peft::StackSpec>(plan.peft) : std::nullopt};
}

// With `machine`: the step predicted by `predict` (into out.time) and its line, or why not (the
// activations' `unknown`, float32, or the prediction's refusal).
template <class Predict>
void add_step_time(const MachineProfile* machine, const PreflightPlan& plan,
                   const std::string& unknown, Preflight& out, std::vector<std::string>& lines,
                   Predict predict) {
  if (machine == nullptr) {
    return;
  }
  if (!unknown.empty() || *plan.compute == Compute::float32) {
    lines.emplace_back("advise: step time not predicted (" +
                       (unknown.empty() ? std::string("float32") : unknown) + ")");
    return;
  }
  try {
    out.time = predict();
    lines.push_back(step_line(*machine, *out.time));
  } catch (const std::invalid_argument& e) {
    lines.push_back(std::string("advise: step time not predicted: ") + e.what());
  }
}

// Whether Replicate reduces with the copy engines: data_parallel.reduce_engine "copy", or "auto"
// where the data-parallel group (dp_replicate x cp) is the whole job without a pipeline (one
// node assumed: the advisor does not know the nodes; parallel::automatic_reduce_engine); never
// under FullyShard or on one data-parallel rank.
bool copy_engine_reduces(const TrainerConfig& config, const PreflightPlan& plan) {
  const auto& c = plan.candidate;
  const auto& engine = config.data_parallel.reduce_engine;
  return !c.fully_shard && c.dp_replicate * c.cp >= 2 &&
         (engine == "copy" || (engine == "auto" && c.tp == 1 && c.pp == 1));
}

// What Replicate's buffer under data_parallel.reduce_engine "copy" (d9d/parallel/detail/
// copy_engine_reduce.hpp) adds to the peak: its buckets are laid out in memory every rank of its
// group (dp x cp) maps, in the reduction's dtype, for the gradients of `state` (a MoE model's
// regular domain, not its experts). In the gradients' own dtype the gradients live there (the
// linear layers write their first product of a step into it, design note 0031; every gradient
// becomes its place after the reduction): nothing on top of the gradients already counted. Under
// a bfloat16 reduction of wider gradients the buffer holds bfloat16 sums beside them: half their
// bytes on top (each bucket rounded up to 256 bytes: at most 255 bytes a bucket, not counted). 0
// without the copy engines (copy_engine_reduces).
int64_t copy_engine_buffer_bytes(const TrainerConfig& config, const PreflightPlan& plan,
                                 const StateBytes& state) {
  if (!copy_engine_reduces(config, plan)) {
    return 0;
  }
  const auto element = static_cast<int64_t>(c10::elementSize(plan.rules->gradients));
  return plan.reduce_bf16 && element > 2 ? state.gradients / element * 2 : 0;
}

// The memory line's words for the copy engine's buffer ("" without one).
std::string copy_engine_words(const TrainerConfig& config, const PreflightPlan& plan,
                              int64_t extra) {
  if (!copy_engine_reduces(config, plan)) {
    return "";
  }
  return extra > 0 ? ", the copy engine's bfloat16 sums " + gib(extra)
                   : ", the gradients in the copy engine's buffer";
}

// A Qwen3-MoE's figures and lines (predict_plan's, before the fit check): the rank with the most
// state, its experts at their balanced load over the Plan's ep ranks.
void predict_moe(const TrainerConfig& config, const model::Qwen3MoeConfig& model,
                 const PreflightPlan& plan, const MachineProfile* machine, Preflight& out,
                 std::vector<std::string>& lines) {
  const auto& c = plan.candidate;
  const auto& rules = *plan.rules;
  const auto unknown = moe_unknown(plan);
  const auto compute = unknown.empty() ? plan.compute : std::nullopt;
  const auto split = compute ? expert_split(rules, c.fully_shard, *compute) : ExpertSplit{};
  const auto rank = moe_rank_memory(model, rules, c.microbatches, config.batch.microbatch_size,
                                    config.batch.sequence_length, compute, split,
                                    config.data_parallel.reshard != "never");
  out.plan += ", ep " + std::to_string(split.ranks);
  out.state_bytes = rank.state.total();
  out.activation_bytes = rank.activations;
  out.peak_bytes = rank.peak;
  // The copy engines reduce the regular domain's gradients; the experts have their own reduction.
  std::vector<ParameterShape> regular;
  for (auto& param : qwen3_parameters(model)) {
    if (!param.expert) {
      regular.push_back(std::move(param));
    }
  }
  const int64_t copy_buffer =
      copy_engine_buffer_bytes(config, plan, state_bytes(regular, rules, 0, 0));
  if (out.peak_bytes) {
    *out.peak_bytes += copy_buffer;
  }
  std::string memory = state_line(out.plan, rank.state);
  memory += copy_engine_words(config, plan, copy_buffer);
  if (rank.activations) {
    memory += ", activations " + gib(*rank.activations) + " (experts at their balanced load)";
    memory += rank.peak ? ", peak during a step " + gib(*rank.peak)
                        : "; peak not predicted (the experts' own FullyShard units over "
                          "ep_replicate)";
  } else {
    memory += "; activations not predicted (" + unknown + ")";
  }
  lines.push_back(memory + "; not counted: the step's transient buffers, communication buffers");
  add_step_time(machine, plan, unknown, out, lines, [&] {
    return predict_step_time(model, c, split, step_options(config, plan), *machine);
  });
}

// Under a PEFT policy (plan.fine_tunes()) the fullest rank's state, with the adapters and the
// frozen parameters (apply_peft), and without a pipeline (`unknown` empty) its activations:
// FullTune's with qwen3_peft_activation_delta's change; where that refuses, `unknown` says why.
// An empty RankMemory otherwise.
RankMemory fine_tunes_memory(const model::Qwen3Config& model, const PreflightPlan& plan, int64_t mb,
                             int64_t seq, std::string& unknown) {
  RankMemory rank;
  if (!plan.fine_tunes()) {
    return rank;
  }
  const auto& c = plan.candidate;
  std::vector<ParameterShape> fullest;
  for (int r = 0; r < c.pp; ++r) {
    auto mine = apply_peft(
        c.pp > 1 ? qwen3_rank_parameters(model, plan.program, r, seq) : qwen3_parameters(model),
        plan.peft);
    const auto state = state_bytes(mine, *plan.rules, 0);
    if (fullest.empty() || state.total() > rank.state.total()) {
      rank.state = state;
      fullest = std::move(mine);
    }
  }
  if (!unknown.empty()) {
    return rank;
  }
  const bool dropout = std::any_of(plan.peft.methods.begin(), plan.peft.methods.end(),
                                   [](const peft::MethodSpec& m) { return m.dropout > 0; });
  try {
    const int64_t kept =
        qwen3_activation_bytes(model, mb, seq, *plan.compute).total() +
        qwen3_peft_activation_delta(model, fullest, mb, seq, *plan.compute, dropout);
    rank.activations = kept;
    rank.peak = peak_step_bytes(rank.state, kept, c.microbatches);
  } catch (const std::invalid_argument& e) {
    unknown = e.what();
  }
  return rank;
}

// A dense Qwen3's figures and lines (predict_plan's, before the fit check): the fullest rank.
void predict_dense(const TrainerConfig& config, const model::Qwen3Config& model,
                   const PreflightPlan& plan, const MachineProfile* machine, Preflight& out,
                   std::vector<std::string>& lines) {
  const auto& c = plan.candidate;
  const int64_t mb = config.batch.microbatch_size;
  const int64_t seq = config.batch.sequence_length;
  auto unknown = activations_unknown(plan);
  auto rank = fine_tunes_memory(model, plan, mb, seq, unknown);
  if (!plan.fine_tunes()) {
    rank = fullest_rank_memory(model, plan.program, c.pp, c.microbatches, *plan.rules, mb, seq,
                               unknown.empty() ? plan.compute : std::nullopt, plan.recompute,
                               config.data_parallel.reshard != "never", plan.sequence_parallel);
  }
  out.state_bytes = rank.state.total();
  out.activation_bytes = rank.activations;
  out.peak_bytes = rank.peak;
  const int64_t copy_buffer = copy_engine_buffer_bytes(config, plan, rank.state);
  if (out.peak_bytes) {
    *out.peak_bytes += copy_buffer;
  }
  std::string memory = state_line(out.plan, rank.state);
  memory += copy_engine_words(config, plan, copy_buffer);
  if (out.activation_bytes) {
    memory += ", activations " + gib(*out.activation_bytes) + ", peak during a step " +
              gib(*out.peak_bytes);
  } else {
    memory += "; activations not predicted (" + unknown + ")";
  }
  lines.push_back(memory + "; not counted: the step's transient buffers, communication buffers" +
                  (c.pp > 1 && c.fully_shard ? ", FullyShard's gathered units" : ""));
  add_step_time(machine, plan, unknown, out, lines, [&] {
    return predict_step_time(model, c, plan.program, step_options(config, plan), *machine);
  });
}

}  // namespace

PreflightSettings preflight_settings(const TrainerConfig& config) {
  PreflightSettings out;
  const auto found = config.sections.find("advise");
  if (found == config.sections.end()) {
    return out;
  }
  const auto json = nlohmann::json::parse(found->second);
  out.enabled = true;
  for (const auto& [key, value] : json.items()) {
    if (key == "enabled") {
      if (!value.is_boolean()) {
        bad_setting("enabled: expected true or false, got " + value.dump());
      }
      out.enabled = value.get<bool>();
    } else if (key == "memory_gib") {
      if (!value.is_number() || value.get<double>() < 0) {
        bad_setting("memory_gib: expected a number of GiB >= 0, got " + value.dump());
      }
      out.memory_gib = value.get<double>();
    } else if (key == "profile") {
      if (!value.is_string()) {
        bad_setting(
            "profile: expected the path of a machine profile (tools/gpu/profile-machine), "
            "got " +
            value.dump());
      }
      out.profile = value.get<std::string>();
    } else {
      bad_setting(key + ": unknown key (advise takes enabled, memory_gib, profile)");
    }
  }
  return out;
}

std::optional<Preflight> preflight(const TrainerConfig& config, const PreflightPlan& plan) {
  const auto settings = preflight_settings(config);
  if (!settings.enabled) {
    return std::nullopt;
  }
  std::optional<MachineProfile> machine;
  std::string unread;
  if (!settings.profile.empty()) {
    try {
      machine = MachineProfile::from_file(settings.profile);
    } catch (const std::invalid_argument& e) {
      unread = e.what();
    }
  }
  auto out = predict_plan(config, plan, machine ? &*machine : nullptr, settings.memory_gib);
  if (!unread.empty()) {
    out.lines.push_back("advise: step time not predicted: " + unread);
  }
  return out;
}

bool PreflightPlan::fine_tunes() const {
  return std::any_of(peft.methods.begin(), peft.methods.end(), [](const peft::MethodSpec& m) {
    return m.kind != peft::MethodKind::full_tune;
  });
}

Preflight predict_plan(const TrainerConfig& config, const PreflightPlan& plan,
                       const MachineProfile* machine, double memory_gib) {
  Preflight out;
  const auto& c = plan.candidate;
  out.plan = c.describe();
  std::vector<std::string> lines;
  std::optional<model::Qwen3Config> model;
  std::optional<model::Qwen3MoeConfig> moe;
  try {
    model = model::Qwen3Config::from_json_text(config.section("model"));
  } catch (const std::exception& dense) {
    try {
      moe = model::Qwen3MoeConfig::from_json_text(config.section("model"));
    } catch (const std::exception&) {
      out.lines.push_back("advise: " + out.plan +
                          ": not predicted: the model section is not a "
                          "dense Qwen3 or a Qwen3-MoE config (" +
                          dense.what() + ")");
      return out;
    }
  }
  if (!plan.rules) {
    out.lines.push_back("advise: " + out.plan + ": not predicted: " + plan.not_predicted);
    return out;
  }
  if (moe && plan.fine_tunes()) {
    out.lines.push_back("advise: " + out.plan +
                        ": not predicted: a PEFT policy on a Qwen3-MoE is not predicted yet");
    return out;
  }
  if (moe) {
    predict_moe(config, *moe, plan, machine, out, lines);
  } else {
    predict_dense(config, *model, plan, machine, out, lines);
  }
  if (memory_gib > 0) {
    const auto limit = static_cast<int64_t>(memory_gib * 1024 * 1024 * 1024);
    out.fits = out.peak_bytes.value_or(out.state_bytes) <= limit;
    if (!out.fits) {
      const long long world = 1LL * c.dp_replicate * c.dp_shard * c.cp * c.tp * c.pp;
      char text[320];
      std::snprintf(text, sizeof(text),
                    "advise: warning: the prediction exceeds memory_gib (%.1f GiB): this Plan will "
                    "likely run out of memory; `tools/advise --config <this config> --candidates "
                    "%lld --memory-gib %.1f` lists the Plan shapes predicted to fit",
                    memory_gib, world, memory_gib);
      out.lines.emplace_back(text);
    }
  }
  out.lines.insert(out.lines.end(), lines.begin(), lines.end());
  return out;
}

}  // namespace d9d::advise
