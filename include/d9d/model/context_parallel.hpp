// d9d/model/context_parallel.hpp — what a model's attention calls when context parallelism splits
// the sequence over ranks, and which tokens each rank holds.
//
//   model->set_context_parallel(group);                 // d9d::parallel::ContextParallel does this
//   auto mine = d9d::model::context_shard(ids, 1, group->rank(), group->size());  // 2 chunks
//   auto out = d9d::model::context_attention(q, k, v, visible, *group);  // every rank's keys
//
// Causal load balancing: a sequence of T tokens is cut into 2·cp chunks of T / (2·cp); rank r holds
// chunks r and 2·cp − 1 − r, so every rank's queries see the same number of keys (the early chunk
// sees few, the late one many). The layers see only the virtual functions of
// ContextParallelGroup; the collectives and their autograd functions live in the parallel layer
// (src/parallel/context_parallel.cpp), so the model library needs no process group.
// docs/design/0018-context-parallel.md.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace d9d::model {

/// The context-parallel group as the attention sees it. Implemented by d9d::parallel; every rank
/// of the group calls the same functions in the same order.
class ContextParallelGroup {
 public:
  ContextParallelGroup() = default;
  virtual ~ContextParallelGroup() = default;
  ContextParallelGroup(const ContextParallelGroup&) = delete;
  ContextParallelGroup& operator=(const ContextParallelGroup&) = delete;
  ContextParallelGroup(ContextParallelGroup&&) = delete;
  ContextParallelGroup& operator=(ContextParallelGroup&&) = delete;

  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  /// A block of keys and values of one rank: its group rank and k, v [B, kv_heads, 2 L, dim]
  /// (that rank's two chunks, in its order).
  using KvVisitor = std::function<void(int source, const at::Tensor& k, const at::Tensor& v)>;
  /// Calls `visit` once per rank of the group with that rank's keys and values, this rank's first,
  /// however the policy moves them (all-gathered at once, or passed around a ring). Differentiable:
  /// the gradients of the blocks visited flow back to each rank's k and v.
  virtual void for_each_kv(const at::Tensor& k, const at::Tensor& v,
                           const KvVisitor& visit) const = 0;

  /// A collective in flight: calling it waits and gives the result (on CUDA the current stream
  /// waits for it; the host does not).
  using Pending = std::function<at::Tensor()>;
  /// Whether the policy brings every rank's keys at once (KvRotation::all_gather). Then the
  /// kernel path of context_attention overlaps: it starts the gather, attends this rank's own
  /// keys while it runs, and the earlier chunks after (start_gather); its backward sums the keys'
  /// gradients the same way (start_reduce_scatter). Otherwise blocks come through for_each_kv.
  [[nodiscard]] virtual bool gathers_at_once() const = 0;
  /// Starts gathering `x` (the same shape on every rank): [size, x's shape], rank by rank. Not
  /// differentiable (the caller's backward uses start_reduce_scatter).
  [[nodiscard]] virtual Pending start_gather(const at::Tensor& x) const = 0;
  /// Starts summing `x` ([size, ...]: a part for each rank, rank by rank) over the group: this
  /// rank's part of the sum (x[0]'s shape).
  [[nodiscard]] virtual Pending start_reduce_scatter(const at::Tensor& x) const = 0;
};

/// A model whose sequence context parallelism may split (Qwen3ForCausalLM does): from
/// set_context_parallel on, its loss() runs on this rank's two chunks of each sequence (tokens,
/// labels, positions and placements alike) and its attention layers attend over every rank's keys.
class ContextParallelModel {
 public:
  ContextParallelModel() = default;
  virtual ~ContextParallelModel() = default;
  ContextParallelModel(const ContextParallelModel&) = default;
  ContextParallelModel& operator=(const ContextParallelModel&) = default;
  ContextParallelModel(ContextParallelModel&&) = default;
  ContextParallelModel& operator=(ContextParallelModel&&) = default;

  virtual void set_context_parallel(std::shared_ptr<const ContextParallelGroup> group) = 0;
};

/// The global chunk indices rank `rank` of `size` holds, in its order: {rank, 2 size − 1 − rank}.
[[nodiscard]] std::pair<int64_t, int64_t> context_chunks(int rank, int size);

/// std::invalid_argument unless `tokens` splits into 2 · size equal chunks (names the sizes and
/// the fix, "batch.sequence_length").
void check_context_length(int64_t tokens, int size);

/// This rank's part of `x` along `dim`: its two chunks (context_chunks) concatenated.
[[nodiscard]] at::Tensor context_shard(const at::Tensor& x, int64_t dim, int rank, int size);

/// Causal attention of this rank's queries over every rank's keys: q [B, heads, 2 L, dim] (this
/// rank's chunks), k and v [B, kv_heads, 2 L, dim] (grouped-query heads as SDPA's enable_gqa),
/// `visible` [B, 1, 2 L, T] (which global keys each local query may see; undefined: causal by
/// position). For each pair of a query chunk and a key chunk at or before it, the block's softmax
/// output and log-sum-exp; the blocks of a query chunk merged by their log-sum-exps (online
/// softmax), so the result equals attention over the whole sequence. Computed in at least float32,
/// returned in q's dtype.
[[nodiscard]] at::Tensor context_attention(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& visible,
                                           const ContextParallelGroup& group);

}  // namespace d9d::model
