// d9d/train/detail/checkpoints.hpp — the trainer's checkpoint pass (src/train/checkpoints.cpp):
// resume at start-up, saves during and after the loop ("checkpoint" in the config), over the
// step's parameter records, optimizer and model buffers. Not a public API.
//
//   CheckpointPass checkpoints(mesh, config);
//   int64_t start = checkpoints.resume(step);           // 0 when nothing was resumed
//   checkpoints.after_step(done_steps, step);           // saves when due
//   result.checkpoint_dir = checkpoints.finish();
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <d9d/core/device_mesh.hpp>
#include <d9d/train/checkpoint.hpp>
#include <d9d/train/config.hpp>
#include <d9d/train/step.hpp>

namespace d9d::detail {

class CheckpointPass {
 public:
  /// Checkpoints are on when the config saves ("every") or resumes.
  CheckpointPass(const DeviceMesh& mesh, const TrainerConfig& config);

  /// Collective: loads "checkpoint.resume_from" or (with "resume") the latest checkpoint into the
  /// step's records, optimizer and buffers; returns its step (0 when none was loaded). ConfigError
  /// when it is past "run.total_steps".
  int64_t resume(StepCore& step);
  /// The checkpoint resumed from ("" when none).
  [[nodiscard]] const std::string& resumed_from() const { return resumed_from_; }

  /// After `done` optimizer steps: saves when due (every N steps and after the last), else moves a
  /// pending background save towards completion (collective).
  void after_step(int64_t done, StepCore& step);
  /// Collective: saves the state after `done` steps now and waits; returns its directory.
  /// ConfigError when the run has no checkpoints.
  std::string save_now(int64_t done, StepCore& step);
  /// Collective: completes a pending save; the last completed checkpoint ("" when none).
  std::string finish();
  /// For a stop on non-finite numbers: the checkpoint kept after completing a pending save ("":
  /// none).
  std::string kept();

 private:
  void save(int64_t done, StepCore& step);

  const DeviceMesh& mesh_;
  CheckpointConfig config_;
  int64_t total_steps_;
  int64_t global_batch_size_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::string resumed_from_;
};

}  // namespace d9d::detail
