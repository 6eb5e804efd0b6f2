// d9d/parallel/load.hpp — a checkpoint (Hugging Face's, or any safetensors state) streamed into a
// parallelised model: each rank reads and copies only its part of each parameter.
//
//   auto parallel = d9d::parallel::parallelize<Plan>(mesh, {model.ptr()});   // or a Trainer's
//   auto stats = d9d::parallel::load_state(*parallel, d9d::state::StateSource::open("Qwen3-0.6B/"),
//                                          {.ignore = {"lm_head.weight"}});  // tied checkpoints
//
// After parallelize the records say where each parameter lives (dims + placements: Shard(d) on
// tp, rows on dp_shard, experts on ep_shard, ...). load_state appends to the checkpoint's mapper
// (checkpoint keys -> the whole model's parameter names; identity by default) one stage that
// keeps, for every recorded parameter, this rank's part under its record's layout
// (d9d::state::distribute, no communication), and streams the source through it
// (d9d::state::stream_state): per group the inputs are views of the mapped files, the mapper's
// operations (renames, chunks of fused tensors, ...) act on those views, and only the rank's
// slice is copied out and then into the record's local tensor. Parameters without a record
// (frozen by the peft policy) load whole. Nothing is communicated, so ranks may load at any time.
#pragma once

#include <string>
#include <vector>

#include <d9d/parallel/parallelize.hpp>
#include <d9d/state/mapper.hpp>
#include <d9d/state/stream.hpp>

namespace d9d::parallel {

/// How a checkpoint maps onto the model (load_state).
struct LoadStateOptions {
  /// Checkpoint keys -> the whole model's parameter names (Hugging Face names for Qwen3: none to
  /// change). Empty: identity on this rank's parameter names. With `stages_elsewhere` the outputs
  /// that are not this rank's parameters are dropped, and their inputs never read.
  state::Mapper mapper{};
  /// Source keys that nothing reads and that may stay unread (e.g. "lm_head.weight" of a
  /// checkpoint with a tied head); keys the source lacks are skipped.
  std::vector<std::string> ignore{};
  /// Accept every source key that no group reads (set by itself with `stages_elsewhere` and the
  /// default mapper: the other stages' parameters).
  bool allow_unused_inputs = false;
  /// The model is this rank's pipeline stages and other ranks hold the others: the mapper's
  /// outputs that are not this rank's parameters are dropped (their inputs never read) instead of
  /// being an error (Trainer and Inference set it when their step holds pipeline stages).
  bool stages_elsewhere = false;
  /// Model parameters the source does not hold: not loaded, they keep their values (LoRA's
  /// adapters when a base checkpoint is loaded). Names as in the model; the mapper must not
  /// produce them.
  std::vector<std::string> keep{};
};

/// Streams `source` into `model`'s parameters: every recorded parameter gets its local part
/// (record.local, converted to its dtype and device), parameters without a record their whole
/// value. Before anything is read, std::invalid_argument for a parameter no group produces, an
/// output the model has no parameter for, a source key no group reads (unless ignored or
/// allowed), and an output whose shape after the split differs from its target's (naming both; a
/// parameter without a record that a strategy split says so). Errors of the mapper and the
/// stream as stream_state raises them. Returns what the stream did: outputs and output_bytes are
/// this rank's parts, not the whole tensors. No communication.
state::StreamStats load_state(ParallelModel& model, const state::StateSource& source,
                              const LoadStateOptions& options = {});

}  // namespace d9d::parallel
