// d9d/optim/lr_schedule.hpp — piecewise learning-rate schedules (a multiplier of the base rate).
//
//   auto schedule = d9d::optim::PiecewiseSchedule::build(
//       {{.length = {.steps = 100}, .curve = Curve::linear, .start = 0.0, .end = 1.0},
//        {.length = {.rest = true}, .curve = Curve::cosine, .start = 1.0, .end = 0.1}},
//       /*total_steps=*/1000);
//   double lr = base_lr * schedule.multiplier(step);
//
// A phase lasts a number of steps, a percentage of the run, or the rest of it (at most one phase);
// within a phase the multiplier follows a curve from `start` to `end`: constant, linear, cosine,
// polynomial (with `power`) or exponential (geometric; start and end > 0). After the last phase the
// multiplier stays at its end.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace d9d::optim {

enum class Curve { constant, linear, cosine, polynomial, exponential };

/// Parses "constant", "linear", "cosine", "polynomial", "exponential" (std::invalid_argument else).
Curve parse_curve(const std::string& name);

/// How long a phase lasts: exactly one of the three.
struct PhaseLength {
  int64_t steps = 0;     ///< a number of steps, or
  double percent = 0.0;  ///< a percentage of total_steps (rounded to whole steps), or
  bool rest = false;     ///< whatever the other phases leave
};

struct Phase {
  PhaseLength length;
  Curve curve = Curve::constant;
  double start = 1.0;
  double end = 1.0;
  double power = 1.0;  ///< polynomial only
};

/// A schedule resolved against a run length.
class PiecewiseSchedule {
 public:
  /// Resolves phase lengths; std::invalid_argument (naming the phase) when they do not fit.
  static PiecewiseSchedule build(std::vector<Phase> phases, int64_t total_steps);
  /// The multiplier at `step` (0-based).
  [[nodiscard]] double multiplier(int64_t step) const;
  /// Resolved lengths, one per phase.
  [[nodiscard]] const std::vector<int64_t>& lengths() const { return lengths_; }

 private:
  std::vector<Phase> phases_;
  std::vector<int64_t> lengths_;
};

}  // namespace d9d::optim
