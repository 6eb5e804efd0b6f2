// d9d/parallel/detail/copy_engine_reduce.hpp — sums ranges of a buffer over the ranks of a CUDA
// group with the GPUs' copy engines (private to d9d::parallel; GradientReducer's
// ReduceEngine::copy). Design note 0028 says why.
//
//   CopyEngineReduce reduce(group, bytes, max_range_bytes);   // collective: maps every peer
//   at::Tensor flat = reduce.buffer();                           // uint8, on the group's device
//   reduce.on_side([&] {              // on the side stream, after the caller's stream's work
//     ... write this rank's values into flat ...
//     reduce.sum(offset, numel, at::kFloat);      // afterwards the range holds the sum
//   });
//   reduce.on_side([&] { reduce.end_of_step(); }); // before any rank writes its buffer again
//   reduce.join();                    // the caller's stream waits for the side stream
//
// The buffer is LibTorch symmetric memory: every rank maps its peers' buffers. sum() is two-shot:
// a barrier (every rank's range is written), each rank pulls its chunk of the range from every
// peer with cudaMemcpyAsync (copy engines over NVLink: no SMs) and adds it (one short elementwise
// kernel), a barrier, then each rank pulls the other chunks' sums from their owners. sum() and
// end_of_step() are collective, in the same order on every rank, and run on the current CUDA
// stream (on_side's stream, a high-priority one of the reducer's own, inside on_side's work).
// Needs a CUDA build and a CUDA (NCCL) group whose ranks share a node; otherwise the constructor
// throws std::invalid_argument saying which.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>

#include <d9d/core/process_group.hpp>

namespace d9d::parallel::detail {

class CopyEngineReduce {
 public:
  /// A buffer of `bytes` on every member of `group` (collective); sums of ranges of up to
  /// `max_range_bytes`.
  CopyEngineReduce(const ProcessGroup& group, int64_t bytes, int64_t max_range_bytes);
  ~CopyEngineReduce();
  /// Whether this build has the copy engines (a CUDA build); without, the constructor throws.
  [[nodiscard]] static bool built();
  CopyEngineReduce(const CopyEngineReduce&) = delete;
  CopyEngineReduce& operator=(const CopyEngineReduce&) = delete;
  CopyEngineReduce(CopyEngineReduce&&) = delete;
  CopyEngineReduce& operator=(CopyEngineReduce&&) = delete;

  /// This rank's buffer (uint8, `bytes` long, on the group's device).
  [[nodiscard]] at::Tensor buffer() const;
  /// Runs `work` with the side stream current, after what the current stream has queued so far.
  void on_side(const std::function<void()>& work);
  /// The current stream waits for everything queued on the side stream.
  void join();
  /// Sums `numel` elements of `dtype` from byte `offset` (aligned to the dtype) over the group,
  /// on the current stream.
  void sum(int64_t offset, int64_t numel, at::ScalarType dtype);
  /// A barrier on the current stream: every peer has finished reading this rank's buffer.
  void end_of_step();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace d9d::parallel::detail
