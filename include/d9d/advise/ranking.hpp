// d9d/advise/ranking.hpp — the candidate Plans for a world of ranks, each with the memory its
// fullest rank is predicted to need and, given a machine profile, its predicted step, ranked
// (docs/advise.md, "Ranking").
//
//   const auto machine = d9d::advise::MachineProfile::from_file("docs/profiles/h200-1gpu.json");
//   const auto ranked = d9d::advise::rank_plans(config, /*world_size=*/8,
//                                               {.precision = "bf16_mixed",
//                                                .memory_bytes = 141LL << 30,
//                                                .machine = &machine});
//   ranked.front().plan.describe();  // the fastest Plan predicted to fit
//   std::puts(d9d::advise::ranking_json(ranked).c_str());
//
// The memory is the fullest rank's peak during a step: its parameters and AdamW moments, the
// activations in flight (one microbatch without a pipeline, as the program runs them under one)
// and the gradients from the first backward on, where the activations are predicted (not under
// fp64 or context parallelism, or tensor parallelism or every-K-th-layer recompute with a
// pipeline; tensor parallelism with sequence parallelism, as the step time models it); the step
// time is
// d9d::advise::predict_step_time's. Plans predicted to fit come first, by predicted tokens/s
// (fastest first, in enumeration order without a machine profile), then those whose activations are
// not predicted, then those predicted not to fit.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <d9d/advise/activation_memory.hpp>
#include <d9d/advise/candidates.hpp>
#include <d9d/advise/state_memory.hpp>
#include <d9d/advise/step_time.hpp>

namespace d9d {
struct TrainerConfig;
}  // namespace d9d

namespace d9d::advise {

/// The precision by its name in tools/advise: fp32, bf16_mixed, bf16_params (stochastic
/// rounding), bf16_params_nearest, fp64. std::invalid_argument for another.
[[nodiscard]] StateRules precision_rules(const std::string& name);

/// How the model computes under the named precision: float32 for fp32 (and fp64, which the
/// activation model does not predict), Bf16Mixed autocast under Replicate and the bfloat16
/// copies FullyShard gathers under FullyShard, bfloat16 parameters for the bf16_params kinds.
[[nodiscard]] Compute compute_of(const std::string& precision, bool fully_shard);

/// What to rank.
struct RankOptions {
  std::string precision = "bf16_mixed";     ///< as precision_rules names it
  Recompute recompute{};                    ///< the Plans' recompute policy
  int64_t memory_bytes = 0;                 ///< a rank's memory; 0: everything fits
  const MachineProfile* machine = nullptr;  ///< predict the step time on it; null: none
  CandidateOptions candidates{};
};

/// One candidate with its predictions.
struct RankedPlan {
  Candidate plan{};
  int64_t state_bytes = 0;                    ///< the fullest rank's state
  std::optional<int64_t> activation_bytes{};  ///< the fullest rank's activations, if predicted
  /// The fullest rank's peak during a step (peak_step_bytes / peak_rank_step_bytes), if the
  /// activations are predicted.
  std::optional<int64_t> peak_bytes{};
  std::optional<StepTime> time{};  ///< with a machine profile
  bool fits = true;  ///< the peak (the state where the activations are not predicted) fits

  [[nodiscard]] int64_t predicted_bytes() const { return peak_bytes.value_or(state_bytes); }
};

/// Every candidate of enumerate_candidates(config, world_size, options.candidates) with its
/// predictions, ranked (see the file comment).
[[nodiscard]] std::vector<RankedPlan> rank_plans(const TrainerConfig& config, int world_size,
                                                 const RankOptions& options);

/// The ranking as JSON: an array of {"plan": describe(), the Plan's degrees, "state_bytes",
/// "activation_bytes" and "peak_bytes" (null if not predicted), "fits", "step_seconds" and
/// "tokens_per_second"
/// (null without a machine profile)}.
[[nodiscard]] std::string ranking_json(const std::vector<RankedPlan>& ranked);

}  // namespace d9d::advise
