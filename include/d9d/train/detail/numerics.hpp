// d9d/train/detail/numerics.hpp — the trainer's numerics guard (src/train/numerics.cpp): what a
// step with a NaN or infinite loss or gradient norm does ("numerics.on_nonfinite"), and loss
// spikes against the mean of the previous finite steps. Not a public API.
//
//   NumericsGuard guard(config.numerics, config.run.total_steps, context);
//   auto spike = guard.check(step, result_of_step, kept_checkpoint);  // may throw NumericalError
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>

#include <d9d/core/distributed_context.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/events.hpp>
#include <d9d/train/step.hpp>

namespace d9d::detail {

/// "step 8 of 300 (index 7): loss nan, gradient norm 1.234"
std::string describe_step(int64_t step, int64_t total, const StepResult& r);

class NumericsGuard {
 public:
  NumericsGuard(NumericsConfig config, int64_t total_steps, const DistributedContext& context);

  /// After step `step` (every rank at the same step: finiteness is agreed over the world). A
  /// non-finite step is skipped with a warning and returns `skipped` = true, or, under "stop" or
  /// past "numerics.max_consecutive_skips", throws NumericalError naming the step and the
  /// checkpoint `kept()` gives ("" when none). A finite step above loss_spike_factor times the
  /// mean of the previous loss_spike_window finite losses is a spike (warned on the main rank).
  struct Verdict {
    bool skipped = false;
    std::optional<events::LossSpike> spike;
  };
  Verdict check(int64_t step, const StepResult& r, const std::function<std::string()>& kept);

 private:
  [[noreturn]] void stop(const std::string& what, const std::function<std::string()>& kept) const;

  NumericsConfig config_;
  int64_t total_steps_;
  const DistributedContext& context_;
  std::deque<double> recent_;  ///< the last loss_spike_window finite losses
  int64_t skipped_in_a_row_ = 0;
};

}  // namespace d9d::detail
