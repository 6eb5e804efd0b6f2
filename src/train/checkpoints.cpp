// d9d/train/checkpoints.cpp — the trainer's checkpoint pass (d9d/train/detail/checkpoints.hpp).
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include <d9d/train/detail/checkpoints.hpp>

namespace d9d::detail {
namespace {

// The buffers of the rank's modules, by their names in the whole model: what training changes
// outside the parameters (every registered buffer; today the MoE routers' selection bias), saved
// and restored with the checkpoints.
NamedBuffers model_buffers(const parallel::ParallelModel& model) {
  NamedBuffers out;
  for (const auto& module : model.modules()) {
    for (const auto& item : module->named_buffers()) {
      out.emplace_back(item.key(), item.value());
    }
  }
  return out;
}

}  // namespace

CheckpointPass::CheckpointPass(const DeviceMesh& mesh, const TrainerConfig& config)
    : mesh_(mesh),
      config_(config.checkpoint),
      total_steps_(config.run.total_steps),
      global_batch_size_(config.batch.global_batch_size) {
  if (config_.every > 0 || config_.resume || !config_.resume_from.empty()) {
    checkpointer_ = std::make_unique<Checkpointer>(mesh, config_, config_.dir, config.run.seed);
  }
}

int64_t CheckpointPass::resume(StepCore& step) {
  if (config_.resume_from.empty() && !config_.resume) {
    return 0;
  }
  resumed_from_ = config_.resume_from.empty() ? checkpointer_->latest()
                                              : checkpointer_->check(config_.resume_from);
  if (resumed_from_.empty()) {
    return 0;
  }
  const auto& context = mesh_.context();
  std::vector<std::string> missing;
  const int64_t start =
      checkpointer_->load(resumed_from_, step.parallel().parameters(), step.optimizer(),
                          model_buffers(step.parallel()), &missing);
  if (!missing.empty() && context.is_main_process()) {
    context.logger().warning("the checkpoint " + resumed_from_ + " has no \"" + missing.front() +
                             "\" (and " + std::to_string(missing.size() - 1) +
                             " more buffers: saved before checkpoints stored buffers); they "
                             "keep their initial values");
  }
  if (start > total_steps_) {
    throw ConfigError("d9d config: the checkpoint \"" + resumed_from_ + "\" is at step " +
                      std::to_string(start) +
                      ", past \"run.total_steps\" = " + std::to_string(total_steps_));
  }
  if (context.is_main_process()) {
    context.logger().info("resuming from " + resumed_from_ + " (step " + std::to_string(start) +
                          ")");
  }
  return start;
}

void CheckpointPass::save(int64_t done, StepCore& step) {
  checkpointer_->save(done, done * global_batch_size_, step.parallel().parameters(),
                      step.optimizer(), model_buffers(step.parallel()));
}

void CheckpointPass::after_step(int64_t done, StepCore& step) {
  if (!checkpointer_) {
    return;
  }
  if (config_.every > 0 && (done % config_.every == 0 || done == total_steps_)) {
    save(done, step);
  } else if (checkpointer_->pending()) {
    (void)checkpointer_->complete(/*wait=*/false);
  }
}

std::string CheckpointPass::save_now(int64_t done, StepCore& step) {
  if (!checkpointer_) {
    throw ConfigError(
        "d9d::Trainer::save_checkpoint: the run has no checkpoints. Fix: give the config a "
        "\"checkpoint\" section (e.g. \"every\": 0 with \"dir\")");
  }
  save(done, step);
  if (checkpointer_->pending()) {
    (void)checkpointer_->complete(/*wait=*/true);  // async: wait for every rank's writer
  }
  return checkpointer_->last_completed();
}

std::string CheckpointPass::finish() {
  if (!checkpointer_) {
    return "";
  }
  (void)checkpointer_->complete(/*wait=*/true);
  return checkpointer_->last_completed();
}

std::string CheckpointPass::kept() {
  if (!checkpointer_) {
    return "";
  }
  if (checkpointer_->pending()) {
    (void)checkpointer_->complete(/*wait=*/true);  // a save of an earlier, finite step
  }
  auto out = checkpointer_->last_completed();
  return out.empty() ? checkpointer_->latest() : out;
}

}  // namespace d9d::detail
