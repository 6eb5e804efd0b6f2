// d9d/optim/lr_schedule.cpp — phase resolution and curves of the piecewise schedule.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>

#include <d9d/optim/lr_schedule.hpp>

namespace d9d::optim {

Curve parse_curve(const std::string& name) {
  if (name == "constant") {
    return Curve::constant;
  }
  if (name == "linear") {
    return Curve::linear;
  }
  if (name == "cosine") {
    return Curve::cosine;
  }
  if (name == "polynomial") {
    return Curve::polynomial;
  }
  if (name == "exponential") {
    return Curve::exponential;
  }
  throw std::invalid_argument("unknown curve \"" + name +
                              "\"; valid: constant, linear, cosine, polynomial, exponential");
}

PiecewiseSchedule PiecewiseSchedule::build(std::vector<Phase> phases, int64_t total_steps) {
  if (total_steps < 1) {
    throw std::invalid_argument("total_steps must be >= 1, got " + std::to_string(total_steps));
  }
  PiecewiseSchedule schedule;
  int64_t used = 0;
  int rest_index = -1;
  for (std::size_t i = 0; i < phases.size(); ++i) {
    const auto& p = phases[i];
    const std::string name = "phase " + std::to_string(i);
    const int kinds =
        (p.length.steps > 0 ? 1 : 0) + (p.length.percent > 0 ? 1 : 0) + (p.length.rest ? 1 : 0);
    if (kinds != 1) {
      throw std::invalid_argument(name +
                                  ": give exactly one of steps (> 0), percent (> 0) or rest");
    }
    if (p.curve == Curve::exponential && !(p.start > 0 && p.end > 0)) {
      throw std::invalid_argument(name + ": an exponential curve needs start > 0 and end > 0");
    }
    if (p.curve == Curve::polynomial && !(p.power > 0)) {
      throw std::invalid_argument(name + ": a polynomial curve needs power > 0");
    }
    int64_t length = 0;
    if (p.length.rest) {
      if (rest_index >= 0) {
        throw std::invalid_argument(name + ": only one phase may take the rest");
      }
      rest_index = static_cast<int>(i);
    } else if (p.length.percent > 0) {
      if (p.length.percent > 100) {
        throw std::invalid_argument(name + ": percent must be in (0, 100], got " +
                                    std::to_string(p.length.percent));
      }
      length = std::llround(p.length.percent / 100.0 * static_cast<double>(total_steps));
    } else {
      length = p.length.steps;
    }
    schedule.lengths_.push_back(length);
    used += length;
  }
  if (used > total_steps) {
    throw std::invalid_argument("the phases last " + std::to_string(used) +
                                " steps, more than the run's " + std::to_string(total_steps));
  }
  if (rest_index >= 0) {
    schedule.lengths_[static_cast<std::size_t>(rest_index)] = total_steps - used;
  }
  schedule.phases_ = std::move(phases);
  return schedule;
}

double PiecewiseSchedule::multiplier(int64_t step) const {
  if (phases_.empty()) {
    return 1.0;
  }
  int64_t begin = 0;
  for (std::size_t i = 0; i < phases_.size(); ++i) {
    const int64_t length = lengths_[i];
    if (step < begin + length) {
      const auto& p = phases_[i];
      const double t = static_cast<double>(step - begin) / static_cast<double>(length);
      switch (p.curve) {
        case Curve::constant:
          return p.start;
        case Curve::linear:
          return p.start + (p.end - p.start) * t;
        case Curve::cosine:
          return p.end + (p.start - p.end) * 0.5 * (1.0 + std::cos(std::numbers::pi * t));
        case Curve::polynomial:
          return p.end + (p.start - p.end) * std::pow(1.0 - t, p.power);
        case Curve::exponential:
          return p.start * std::pow(p.end / p.start, t);
      }
    }
    begin += length;
  }
  return phases_.back().curve == Curve::constant ? phases_.back().start : phases_.back().end;
}

}  // namespace d9d::optim
