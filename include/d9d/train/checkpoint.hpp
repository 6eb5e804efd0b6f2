// d9d/train/checkpoint.hpp — training checkpoints: what Trainer<Plan> saves to resume a run.
//
//   "checkpoint": {"every": 100, "keep": 2, "async": true, "resume": true}   // in the config
//
// A checkpoint is a directory <output_dir>/checkpoints/step-<N> (N = optimizer steps done):
//   rank-<r>.safetensors  one per rank. Each trained parameter's part on this rank (the whole
//                         parameter, or its shard under FullyShard; a pipeline rank's stages: the
//                         names are the whole model's; a parameter tied across stages once, by
//                         its first holder) is stored by one rank among its replicas
//                         (coordinate 0 on every mesh dim it is replicated on) as "model/<name>",
//                         or "model/<name>@<o0>,<o1>,..." (its offsets) when it is a part, with
//                         AdamW's state beside it: "optim/<name>/exp_avg[@...]", ".../exp_avg_sq",
//                         ".../step"; the model's buffers that training changes (the
//                         MoE routers' selection bias), whole, as "buffer/<name>" by one rank per
//                         pipeline stage (coordinate 0 on every other mesh dim: they are the same
//                         on every rank of a stage); every rank stores its random generators
//                         ("rng/cpu", "rng/cuda").
//   trainer.json          written last by rank 0: step, samples seen, world size, mesh.
// <output_dir>/checkpoints/checkpoints.json names the latest complete checkpoint and the kept
// ones. Ranks write into step-<N>.tmp; after every rank has written, rank 0 writes trainer.json,
// renames the directory to step-<N>, then replaces checkpoints.json (write + rename) and removes
// checkpoints beyond `keep`; files and directories are fsynced before and after each rename. A
// crash at any point leaves checkpoints.json naming a complete checkpoint (or none): a
// half-written step-<N>.tmp is never read, and every save removes those of any step. An error on
// any rank (directory, writer, commit) is thrown on every rank, naming it (raise_if_any_failed).
//
// Loading reads every rank file's header and assembles each parameter's part on this rank from the
// stored pieces that overlap it (copied as stored: bit-identical), so a run may resume on another
// mesh (other pipeline split, other data-parallel degree, sharded or not). The sampler and the
// learning rate are functions of the step, so the data position and the schedule follow from it;
// the random generators are restored when the world size is unchanged and reseeded from (seed,
// rank, step) otherwise. With "async", a save copies the state to host memory (the fast snapshot)
// and a background thread writes the files while training continues; the checkpoint is completed at
// the first step boundary where every rank's writer is done (one small all-reduce per step while a
// save is pending) and at the end of training.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/core/device_mesh.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/train/config.hpp>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace d9d::detail {

/// A model's buffers by name (torch::nn::Module::named_buffers of the rank's modules).
using NamedBuffers = std::vector<std::pair<std::string, at::Tensor>>;

/// One rank's view of the training checkpoints of a run (collective operations are marked).
class Checkpointer {
 public:
  Checkpointer(const DeviceMesh& mesh, CheckpointConfig config, std::string dir, uint64_t seed);
  ~Checkpointer();  ///< waits for a background write (without completing the checkpoint)
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;
  Checkpointer(Checkpointer&&) = delete;
  Checkpointer& operator=(Checkpointer&&) = delete;

  /// The directory of the latest complete checkpoint, or "" when there is none.
  [[nodiscard]] std::string latest() const;
  /// `path` when it is a complete checkpoint directory; std::runtime_error naming it otherwise.
  [[nodiscard]] std::string check(const std::string& path) const;

  /// Loads `path` (a step-<N> directory) into the records' local tensors (by name, each its part
  /// on this rank's mesh), the optimizer's state and `buffers`; returns N. std::runtime_error
  /// names a missing parameter, a shape mismatch or a part the stored pieces do not cover. A
  /// buffer the checkpoint lacks (saved before buffers were stored) keeps its value; its name is
  /// added to `missing_buffers` when given.
  int64_t load(const std::string& path, const std::vector<parallel::ParameterRecord>& parameters,
               torch::optim::Optimizer& optimizer, const NamedBuffers& buffers = {},
               std::vector<std::string>* missing_buffers = nullptr);

  /// Collective: snapshots this rank's state (parameters, optimizer state, `buffers`) after `step`
  /// optimizer steps and writes it (in the background when async). A pending save is completed
  /// first.
  void save(int64_t step, int64_t samples_seen,
            const std::vector<parallel::ParameterRecord>& parameters,
            const torch::optim::Optimizer& optimizer, const NamedBuffers& buffers = {});

  /// Collective: completes a pending save once every rank has written (`wait`: waits for that).
  /// Returns the completed checkpoint's directory, or "".
  std::string complete(bool wait);

  [[nodiscard]] bool pending() const;
  /// The directory of the last checkpoint this run completed ("" when none).
  [[nodiscard]] const std::string& last_completed() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace d9d::detail
