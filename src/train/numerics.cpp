// d9d/train/numerics.cpp — the trainer's numerics guard (d9d/train/detail/numerics.hpp).
#include <array>
#include <cstdio>
#include <numeric>
#include <string>
#include <utility>

#include <d9d/train/detail/numerics.hpp>
#include <d9d/util/format.hpp>

namespace d9d::detail {

std::string describe_step(int64_t step, int64_t total, const StepResult& r) {
  return "step " + std::to_string(step + 1) + " of " + std::to_string(total) + " (index " +
         std::to_string(step) + "): loss " + format::number(r.loss, "%.6g") + ", gradient norm " +
         format::number(r.grad_norm, "%.6g");
}

NumericsGuard::NumericsGuard(NumericsConfig config, int64_t total_steps,
                             const DistributedContext& context)
    : config_(std::move(config)), total_steps_(total_steps), context_(context) {}

NumericsGuard::Verdict NumericsGuard::check(int64_t step, const StepResult& r,
                                            const std::function<std::string()>& kept) {
  Verdict verdict;
  if (!r.finite) {
    ++skipped_in_a_row_;
    const auto what = describe_step(step, total_steps_, r);
    if (config_.on_nonfinite == "stop" || skipped_in_a_row_ > config_.max_consecutive_skips) {
      stop(what, kept);
    }
    if (context_.is_main_process()) {
      context_.logger().warning("skipped " + what + ": the optimizer did not step (" +
                                std::to_string(skipped_in_a_row_) + " in a row, at most " +
                                std::to_string(config_.max_consecutive_skips) + ")");
    }
    verdict.skipped = true;
    return verdict;
  }
  skipped_in_a_row_ = 0;
  const auto window = static_cast<std::size_t>(config_.loss_spike_window);
  if (recent_.size() == window) {
    const double mean =
        std::accumulate(recent_.begin(), recent_.end(), 0.0) / static_cast<double>(window);
    if (mean > 0 && r.loss > config_.loss_spike_factor * mean &&
        r.loss - mean >= config_.loss_spike_min_rise) {
      verdict.spike = events::LossSpike{.step = step, .loss = r.loss, .mean = mean};
      if (context_.is_main_process()) {
        context_.logger().warning("loss spike at " + describe_step(step, total_steps_, r) + ": " +
                                  format::number(r.loss / mean, "%.1f") +
                                  "x the mean of the previous " +
                                  std::to_string(config_.loss_spike_window) + " steps (" +
                                  format::number(mean, "%.6g") + ")");
      }
    }
    recent_.pop_front();
  }
  recent_.push_back(r.loss);
  return verdict;
}

void NumericsGuard::stop(const std::string& what, const std::function<std::string()>& kept) const {
  const std::string checkpoint = kept ? kept() : std::string();
  const std::string message =
      "d9d::Trainer: a NaN or infinite loss or gradient norm at " + what +
      (skipped_in_a_row_ > 1
           ? " (" + std::to_string(skipped_in_a_row_) +
                 " such steps in a row, more than \"numerics.max_consecutive_skips\" = " +
                 std::to_string(config_.max_consecutive_skips) + ")"
           : std::string()) +
      "; training stopped before the optimizer step, the parameters are those of the last finite "
      "step; " +
      (checkpoint.empty() ? std::string("no checkpoint was written")
                          : "the last checkpoint, " + checkpoint + ", is kept") +
      ". Fix: lower \"optimizer.lr\" or \"gradient_clipping.max_norm\", check this step's "
      "data, or set \"numerics.on_nonfinite\": \"skip\" to skip such steps";
  if (context_.is_main_process()) {
    context_.logger().error(message);
  }
  throw NumericalError(message);
}

}  // namespace d9d::detail
