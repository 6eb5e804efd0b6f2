// d9d/model/tensor_parallel.hpp — what a model's layers call when tensor parallelism splits them,
// and how a model tells the strategy where its vocabulary lives.
//
//   attention->set_tensor_parallel(group);          // d9d::parallel::TensorParallel does this
//   auto x_in = group->copy_in(x);                 // before a column-parallel layer ("f")
//   auto y = group->reduce_out(o_proj(attended));  // after a row-parallel layer ("g")
//
// The layers only call these virtual functions; the collectives and their autograd functions live
// in the parallel layer (src/parallel/tensor_parallel.cpp), so the model library needs no process
// group. A model whose embedding and LM head may be split over the vocabulary implements
// VocabParallelModel (Qwen3ForCausalLM and Qwen3Stage do); attention and SwiGLU blocks are found by
// their types (d9d::model::Attention, d9d::model::SwiGlu). docs/design/0011-tensor-parallel.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace d9d::model {

/// A collective that TensorParallelGroup started and nobody has waited for yet. Work that does not
/// read its result may be issued meanwhile and overlaps it (on a GPU the collective runs on the
/// backend's stream).
class PendingTokens {
 public:
  PendingTokens() = default;
  virtual ~PendingTokens() = default;
  PendingTokens(const PendingTokens&) = delete;
  PendingTokens& operator=(const PendingTokens&) = delete;
  PendingTokens(PendingTokens&&) = delete;
  PendingTokens& operator=(PendingTokens&&) = delete;
  /// The result. On a GPU the caller's stream then waits for the collective; the host does not.
  [[nodiscard]] virtual at::Tensor wait() = 0;
};

/// The tensor-parallel group as the layers see it (Megatron's f/g pair and the loss-parallel
/// cross-entropy). Implemented by d9d::parallel; every rank of the group calls the same functions
/// in the same order.
class TensorParallelGroup {
 public:
  TensorParallelGroup() = default;
  virtual ~TensorParallelGroup() = default;
  TensorParallelGroup(const TensorParallelGroup&) = delete;
  TensorParallelGroup& operator=(const TensorParallelGroup&) = delete;
  TensorParallelGroup(TensorParallelGroup&&) = delete;
  TensorParallelGroup& operator=(TensorParallelGroup&&) = delete;

  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  /// "f": identity in forward; backward sums the input's gradient over the group (the input of a
  /// column-parallel layer gets a partial gradient on each rank). Under sequence parallelism the
  /// input [B, T / size, ...] is this rank's shard of the microbatch's tokens (rows
  /// [rank B T / size, (rank + 1) B T / size) of the B·T tokens taken in order, sequence after
  /// sequence, shaped [B, T / size, ...]): gathered into [B, T, ...] in forward, the gradient
  /// reduce-scattered back. Only per-token work may run on a shard (it is not a slice of each
  /// sequence when B > 1).
  [[nodiscard]] virtual at::Tensor copy_in(const at::Tensor& x) const = 0;
  /// "g": sums the partial outputs of a row-parallel layer over the group in forward; identity in
  /// backward (every rank already holds the whole output's gradient). Under sequence parallelism
  /// the sum is reduce-scattered (this rank keeps its shard of the tokens, as copy_in takes it:
  /// [B, T / size, ...]) and the gradient all-gathered.
  [[nodiscard]] virtual at::Tensor reduce_out(const at::Tensor& x) const = 0;
  /// Whether the residual stream between blocks is split by sequence (copy_in / reduce_out
  /// gather and scatter along dim 1).
  [[nodiscard]] virtual bool sequence_parallel() const = 0;
  /// This rank's part of the tokens, for a layer that splits its work over the group by tokens
  /// rather than by weights (a MoE layer: each rank routes and dispatches its own tokens): x
  /// [B, T, ...] narrowed along dim 1 to [rank T / size, (rank + 1) T / size) in forward; backward
  /// gathers the parts' gradients along dim 1, so every rank holds the whole input's gradient.
  /// T must be a multiple of size() (a clear error otherwise).
  [[nodiscard]] virtual at::Tensor split_sequence(const at::Tensor& x) const = 0;
  /// The inverse of split_sequence: every rank's part concatenated along dim 1 (all-gather) in
  /// forward; backward keeps this rank's part of the gradient (whole and equal on every rank).
  [[nodiscard]] virtual at::Tensor gather_sequence(const at::Tensor& x) const = 0;
  /// Sequence parallelism's gather, started and not autograd-tracked: every rank's rows [N, ...]
  /// (its shard of the tokens as copy_in takes it, flattened to rows) concatenated in rank order
  /// into [size N, ...], the tokens of the whole microbatch as rows. For layers that overlap
  /// the gather with their own work (d9d::model::fan_out_linear_gathered).
  [[nodiscard]] virtual std::unique_ptr<PendingTokens> start_gather_tokens(
      const at::Tensor& rows) const = 0;
  /// Sequence parallelism's scatter, started and not autograd-tracked: rows [size N, ...] summed
  /// over the group, this rank keeping rows [rank N, (rank + 1) N), written into `into` when it
  /// is defined ([N, ...] in the rows' dtype, e.g. rows of a larger result: in place when it is
  /// contiguous on the group's device, else copied there by wait()).
  [[nodiscard]] virtual std::unique_ptr<PendingTokens> start_scatter_tokens(
      const at::Tensor& rows, const at::Tensor& into) const = 0;
  /// Every rank's x concatenated along the last dimension; backward keeps this rank's slice.
  [[nodiscard]] virtual at::Tensor gather_last(const at::Tensor& x) const = 0;
  /// The summed cross-entropy of rows whose logits are split over the group by vocabulary: this
  /// rank holds `local_logits` [N, V / size] for ids [vocab_start, vocab_start + V / size); labels
  /// [N] hold global ids (ignore_index rows count nothing). The full logits are never gathered:
  /// the row maxima and sums of exponentials are all-reduced, the target logit comes from the
  /// rank that holds it. A scalar (float32, float64 for float64 logits), the same on every rank;
  /// its gradient reaches only this rank's logits.
  [[nodiscard]] virtual at::Tensor cross_entropy_sum(const at::Tensor& local_logits,
                                                     const at::Tensor& labels, int64_t vocab_start,
                                                     int64_t ignore_index) const = 0;
};

/// The vocab-parallel embedding: `weight` holds rows [vocab_start, vocab_start + rows) of the
/// embedding; ids outside embed as zeros and the parts are summed over `group` (reduce_out).
[[nodiscard]] at::Tensor vocab_parallel_embedding(const at::Tensor& weight,
                                                  const at::Tensor& input_ids, int64_t vocab_start,
                                                  const TensorParallelGroup& group);

/// This rank's slice of the vocabulary in a model's output logits kept split over the tensor-
/// parallel group (VocabParallelModel::keep_logits_split): ids [start, start + V / tp).
struct VocabSlice {
  std::shared_ptr<const TensorParallelGroup> group;  ///< null: the logits are whole
  int64_t start = 0;
  [[nodiscard]] bool whole() const { return group == nullptr; }
};

/// A model whose token embedding and LM head tensor parallelism may split over the vocabulary
/// (rows [rank V / tp, (rank + 1) V / tp) of each). The strategy narrows the parameters named by
/// vocab_parameters() along dim 0 and then calls set_tensor_parallel; from then on the model
/// embeds out-of-slice ids as zeros (summed over the group) and computes its loss with
/// TensorParallelGroup::cross_entropy_sum. A tied head is the embedding itself: one name.
class VocabParallelModel {
 public:
  VocabParallelModel() = default;
  virtual ~VocabParallelModel() = default;
  VocabParallelModel(const VocabParallelModel&) = default;
  VocabParallelModel& operator=(const VocabParallelModel&) = default;
  VocabParallelModel(VocabParallelModel&&) = default;
  VocabParallelModel& operator=(VocabParallelModel&&) = default;

  /// The vocabulary size (the rows of the embedding and of the head).
  [[nodiscard]] virtual int64_t vocab_size() const = 0;
  /// Names (as in the module's named_parameters()) of the [vocab, hidden] parameters: the
  /// embedding and, when untied, the head.
  [[nodiscard]] virtual std::vector<std::string> vocab_parameters() const = 0;
  /// Called after the strategy narrowed those parameters and the model's attention and MLP blocks.
  virtual void set_tensor_parallel(std::shared_ptr<const TensorParallelGroup> group) = 0;
  /// Under tensor parallelism: from now on forward() returns this rank's slice of the logits
  /// ([..., V / tp]: the loss-parallel cross-entropy, TensorParallelGroup::cross_entropy_sum, reads
  /// them) instead of gathering them, and the slice is returned. A model that cannot, or that
  /// outputs no logits (a pipeline stage before the last), returns a whole slice and changes
  /// nothing (the default).
  virtual VocabSlice keep_logits_split() { return {}; }
};

}  // namespace d9d::model
