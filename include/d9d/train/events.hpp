// d9d/train/events.hpp — typed events of the training loop and a bus to subscribe to them.
//
//   trainer.on<d9d::events::StepEnd>([](const d9d::events::StepEnd& e) {
//     std::printf("step %lld loss %.3f\n", static_cast<long long>(e.step), e.loss);
//   });
//
// Handlers run on every rank, synchronously, in subscription order; an exception thrown by a
// handler propagates out of the training loop.
#pragma once

#include <cstdint>
#include <functional>
#include <typeindex>
#include <unordered_map>
#include <vector>

namespace d9d {
namespace events {

/// Before a step's data is loaded.
struct StepStart {
  int64_t step = 0;
};
/// After gradients are reduced, scaled and clipped, before the optimizer updates parameters.
struct BeforeOptimizer {
  int64_t step = 0;
  double grad_norm = 0.0;
};
/// After the optimizer update.
struct AfterOptimizer {
  int64_t step = 0;
  double lr = 0.0;
};
/// A finished step with its global metrics (the same on every rank).
struct StepEnd {
  int64_t step = 0;   ///< 0-based
  double loss = 0.0;  ///< token-mean loss over all microbatches and data-parallel ranks
  double lr = 0.0;
  double grad_norm = 0.0;  ///< before clipping
  int64_t tokens = 0;      ///< tokens processed by all ranks in this step (0: no sequence_length)
  int64_t samples = 0;     ///< samples processed by all ranks in this step
  double seconds = 0.0;    ///< wall time of the step
};
/// A finite loss above numerics.loss_spike_factor x the mean of the previous
/// numerics.loss_spike_window finite losses and at least numerics.loss_spike_min_rise above it
/// (emitted after StepEnd, on every rank).
struct LossSpike {
  int64_t step = 0;  ///< 0-based
  double loss = 0.0;
  double mean = 0.0;  ///< of the previous window
};
/// The loop finished.
struct TrainEnd {
  int64_t steps = 0;
  double seconds = 0.0;
};

}  // namespace events

/// Type-indexed publish/subscribe.
class EventBus {
 public:
  template <class E>
  void on(std::function<void(const E&)> handler) {
    handlers_[std::type_index(typeid(E))].push_back(
        [handler = std::move(handler)](const void* event) {
          handler(*static_cast<const E*>(event));
        });
  }

  template <class E>
  void emit(const E& event) const {
    const auto found = handlers_.find(std::type_index(typeid(E)));
    if (found == handlers_.end()) {
      return;
    }
    for (const auto& handler : found->second) {
      handler(&event);
    }
  }

 private:
  std::unordered_map<std::type_index, std::vector<std::function<void(const void*)>>> handlers_;
};

}  // namespace d9d
