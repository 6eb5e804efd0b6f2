// d9d::advise::rank_plans and its helpers (d9d/advise/ranking.hpp).
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <d9d/advise/ranking.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/train/config.hpp>

namespace d9d::advise {

StateRules precision_rules(const std::string& name) {
  namespace p = d9d::precision;
  if (name == "fp32") {
    return precision_rules<p::Fp32>();
  }
  if (name == "bf16_mixed") {
    return precision_rules<p::Bf16Mixed>();
  }
  if (name == "fp64") {
    return precision_rules<p::Fp64>();
  }
  if (name == "bf16_params") {
    return precision_rules<p::Bf16Params<>>();
  }
  if (name == "bf16_params_nearest") {
    return precision_rules<p::Bf16Params<p::NearestRounding>>();
  }
  throw std::invalid_argument("d9d::advise: unknown precision \"" + name +
                              "\" (fp32, bf16_mixed, bf16_params, bf16_params_nearest, fp64)");
}

Compute compute_of(const std::string& precision, bool fully_shard) {
  (void)precision_rules(precision);  // names an unknown precision
  if (precision == "fp32" || precision == "fp64") {
    return Compute::float32;
  }
  return precision == "bf16_mixed" && !fully_shard ? Compute::bf16_autocast
                                                   : Compute::bf16_parameters;
}

std::vector<RankedPlan> rank_plans(const TrainerConfig& config, int world_size,
                                   const RankOptions& options) {
  const auto model = model::Qwen3Config::from_json_text(config.sections.at("model"));
  const int64_t mb = config.batch.microbatch_size;
  const int64_t seq = config.batch.sequence_length;
  const bool activations_known = options.precision != "fp64";
  std::vector<RankedPlan> out;
  for (const auto& c : enumerate_candidates(config, world_size, options.candidates)) {
    RankedPlan row{.plan = c};
    auto rules = precision_rules(options.precision);
    rules.tensor_ranks = c.tp;
    rules.shard_ranks = c.fully_shard ? c.dp_shard * c.cp : 1;
    const auto program =
        c.pp > 1 ? build_schedule(c.schedule, c.pp, c.microbatches) : pipeline::Program{};
    const auto compute = compute_of(options.precision, c.fully_shard);
    // Tensor parallelism with sequence parallelism, as the step time models it.
    const bool predicted = activations_known && c.cp == 1 &&
                           !(c.pp > 1 && (options.recompute.every_nth > 1 || c.tp > 1)) &&
                           seq % c.tp == 0;
    const auto memory = fullest_rank_memory(
        model, program, c.pp, c.microbatches, rules, mb, seq,
        predicted ? std::optional<Compute>(compute) : std::nullopt, options.recompute,
        /*reshard_after_forward=*/true, /*sequence_parallel=*/c.tp > 1);
    row.state_bytes = memory.state.total();
    row.activation_bytes = memory.activations;
    row.peak_bytes = memory.peak;
    row.fits = options.memory_bytes <= 0 || row.predicted_bytes() <= options.memory_bytes;
    if (options.machine != nullptr && compute != Compute::float32) {
      row.time = predict_step_time(model, c,
                                   {.microbatch_size = mb,
                                    .sequence_length = seq,
                                    .precision = precision_rules(options.precision),
                                    .compute = compute,
                                    .recompute = options.recompute},
                                   *options.machine);
    }
    out.push_back(std::move(row));
  }
  // Fitting and predicted, then fitting without activations, then not fitting; fastest first.
  const auto group = [](const RankedPlan& r) { return !r.fits ? 2 : (r.activation_bytes ? 0 : 1); };
  std::stable_sort(out.begin(), out.end(), [&](const RankedPlan& a, const RankedPlan& b) {
    if (group(a) != group(b)) {
      return group(a) < group(b);
    }
    const double ta = a.time ? a.time->tokens_per_second() : 0.0;
    const double tb = b.time ? b.time->tokens_per_second() : 0.0;
    return ta > tb;
  });
  return out;
}

std::string ranking_json(const std::vector<RankedPlan>& ranked) {
  auto out = nlohmann::ordered_json::array();
  for (const auto& r : ranked) {
    const auto& c = r.plan;
    nlohmann::ordered_json row = {
        {"plan", c.describe()},
        {"data_parallel", c.fully_shard ? "fully_shard" : "replicate"},
        {"dp_replicate", c.dp_replicate},
        {"dp_shard", c.dp_shard},
        {"cp", c.cp},
        {"tp", c.tp},
        {"pp", c.pp},
        {"schedule", c.schedule},
        {"microbatches", c.microbatches},
        {"state_bytes", r.state_bytes},
        {"activation_bytes", nullptr},
        {"peak_bytes", nullptr},
        {"fits", r.fits},
        {"step_seconds", nullptr},
        {"tokens_per_second", nullptr},
    };
    if (r.activation_bytes) {
      row["activation_bytes"] = *r.activation_bytes;
    }
    if (r.peak_bytes) {
      row["peak_bytes"] = *r.peak_bytes;
    }
    if (r.time) {
      row["step_seconds"] = r.time->total;
      row["tokens_per_second"] = r.time->tokens_per_second();
    }
    out.push_back(std::move(row));
  }
  return out.dump(1);
}

}  // namespace d9d::advise
