// d9d/parallel/replicate.hpp — data-parallel replication: bucketed gradient all-reduce that
// starts during backward (the behaviour of d9d::parallel::Replicate).
//
//   d9d::parallel::GradientReducer reducer(mesh.group(MeshDomain::batch, "dp"), params,
//                                          {.bucket_bytes = 25 << 20});
//   reducer.arm();              // before the last microbatch's backward
//   loss.backward();            // buckets are all-reduced as their gradients become ready
//   reducer.finish();           // waits; every parameter's .grad is now the sum over the group
//
// Parameters are packed into buckets in reverse registration order (about the order backward
// produces their gradients), after the ones GradientReducerOptions::first names. A
// post-accumulate-grad hook on each parameter counts ready gradients; a full bucket's all-reduce is
// launched asynchronously, in bucket order on every rank, overlapping the rest of the backward pass
// (NCCL runs it on its own stream). The gradients are reduced where they are (one coalesced
// all-reduce per bucket: nothing flattened, nothing copied back), or cast one by one when the
// reduction's dtype differs and copied back in finish(). A bucket with a parameter that got no
// gradient (or a gradient not dense and contiguous on the group's device) is flattened into one
// buffer instead, zeros for the missing gradient; its sums become the gradients' memory. finish()
// launches what is left, waits, and writes back what was not reduced in place. With
// ReduceEngine::copy (CUDA groups within one node) the bytes move on the GPUs' copy engines instead
// of NCCL's kernels, which otherwise hold SMs beside the backward (design note 0028): each bucket's
// gradients are copied into a buffer every rank maps (symmetric memory) and summed there on a side
// stream; in finish() each gradient becomes its place in that buffer (no copy back, unless the
// reduction's dtype differs). The linear layers write their weights' gradients into that buffer
// (design note 0031), so it is the gradients' memory rather than a copy of it. With a group of one
// rank nothing is registered and every call is a no-op.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <d9d/core/process_group.hpp>

namespace d9d::parallel {

/// What moves a bucket's bytes.
enum class ReduceEngine {
  backend,  ///< the group's all-reduce (NCCL on GPUs, Gloo on CPUs)
  copy,     ///< the copy engines through symmetric memory (a CUDA group within one node)
};

struct GradientReducerOptions {
  int64_t bucket_bytes = int64_t{25} << 20;
  /// The dtype buckets are all-reduced in (e.g. bfloat16 for float32 gradients: half the bytes,
  /// one rounding of each rank's gradient and of the sum); unset: the gradients' own.
  std::optional<at::ScalarType> reduce_dtype = std::nullopt;
  /// ReduceEngine::copy needs a CUDA build and a CUDA group whose GPUs share a node: otherwise the
  /// constructor throws std::invalid_argument.
  ReduceEngine engine = ReduceEngine::backend;
  /// Parameters (of `parameters`) whose gradients are complete first in the armed backward, each
  /// in a bucket of its own ahead of the others (e.g. a tied embedding whose lookup gradient is
  /// deferred, d9d/model/embedding_rows.hpp). A listed parameter that is complete last instead
  /// holds every bucket back until then: the sums are the same, only later.
  std::vector<at::Tensor> first = {};
};

/// The engine `data_parallel.reduce_engine: "auto"` picks for Replicate's `group`:
/// ReduceEngine::copy where the copy engines run and were measured — a CUDA build, a CUDA group of
/// two or more ranks that is the whole job (`group.size() == world_size`) on one node
/// (`local_world_size == world_size`), no pipeline program (`pipelined` false) — else
/// ReduceEngine::backend. The same on every rank (it reads only what the launch gave them all).
[[nodiscard]] ReduceEngine automatic_reduce_engine(const ProcessGroup& group, int world_size,
                                                   int local_world_size, bool pipelined);

class GradientReducer {
 public:
  GradientReducer(ProcessGroup group, std::vector<at::Tensor> parameters,
                  const GradientReducerOptions& options = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;
  GradientReducer(GradientReducer&&) = delete;
  GradientReducer& operator=(GradientReducer&&) = delete;

  /// The next backward pass reduces gradients as they become ready.
  void arm();
  /// Starts every bucket not started yet (after arm(); a parameter without a gradient adds
  /// zeros), e.g. when the caller knows that the step's gradients are complete; finish() waits.
  void launch_all();
  /// Completes the reduction armed by arm(): afterwards each .grad holds the group's sum.
  void finish();
  /// Number of buckets, and how many were launched from hooks (during backward) last time.
  [[nodiscard]] std::size_t bucket_count() const;
  [[nodiscard]] std::size_t launched_during_backward() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace d9d::parallel
