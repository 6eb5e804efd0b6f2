// d9d/core/weight_grad.cpp — the weight-gradient queue of split backward and the thread's
// recording binding (d9d/core/weight_grad.hpp).
#include <utility>

#include <d9d/core/weight_grad.hpp>

namespace d9d {
namespace {

thread_local WeightGradQueue* recording = nullptr;

}  // namespace

void WeightGradQueue::drain() {
  // Take the jobs first: a job that throws leaves the queue empty rather than half-run twice.
  auto jobs = std::move(jobs_);
  jobs_.clear();
  for (auto& job : jobs) {
    job();
  }
}

RecordWeightGrads::RecordWeightGrads(WeightGradQueue& queue) : previous_(recording) {
  recording = &queue;
}

RecordWeightGrads::~RecordWeightGrads() { recording = previous_; }

WeightGradQueue* recording_weight_grads() { return recording; }

}  // namespace d9d
