// d9d/parallel/detail/embedding_rows.hpp — Replicate's side of a deferred embedding lookup
// (private to d9d::parallel; design note 0030).
//
//   auto rows = std::make_shared<ReplicatedEmbeddingRows>(group, weight);
//   model.set_embedding_row_sink(rows);   // d9d/model/embedding_rows.hpp
//   rows->begin();      // before the step's last forward: its lookup defers (counts exchanged)
//   ... forward, the armed backward (the weight's bucket reduced first) ...
//   rows->finish();     // after the reducer's finish(): every rank's rows added into weight.grad
//
// The weight's gradient then holds the group's sum of the head's parts and of every lookup, as
// the whole reduction would give it. The number of ids of each rank's deferred lookup is
// exchanged in the forward (on GPUs on a side stream, copied to the host there), so finish()
// reads it without waiting for the backward.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/util/intrusive_ptr.h>

#include <d9d/core/process_group.hpp>
#include <d9d/model/embedding_rows.hpp>

namespace c10d {
class Work;
}  // namespace c10d

namespace d9d::parallel::detail {

class ReplicatedEmbeddingRows final : public model::EmbeddingRowSink {
 public:
  ReplicatedEmbeddingRows(ProcessGroup group, at::Tensor weight);
  ~ReplicatedEmbeddingRows() override;
  ReplicatedEmbeddingRows(const ReplicatedEmbeddingRows&) = delete;
  ReplicatedEmbeddingRows& operator=(const ReplicatedEmbeddingRows&) = delete;
  ReplicatedEmbeddingRows(ReplicatedEmbeddingRows&&) = delete;
  ReplicatedEmbeddingRows& operator=(ReplicatedEmbeddingRows&&) = delete;

  /// The next lookup defers (before the step's last forward).
  void begin();
  [[nodiscard]] bool deferring() const override;
  void looked_up(const at::Tensor& ids) override;
  void rows_backward(const at::Tensor& ids, const at::Tensor& rows_grad) override;
  /// After the weight's own reduction (on the caller's stream): gathers every rank's rows and adds
  /// them into the weight's gradient. Collective over the group; nothing when no lookup deferred.
  void finish();
  /// Lookups deferred since construction (for tests).
  [[nodiscard]] int64_t deferred_lookups() const;

 private:
  // A deferred lookup, from the forward to finish(): its ids, their rows' gradient, and the
  // exchange of every rank's number of ids, issued in the forward (its tensors live until then).
  struct DeferredLookup {
    at::Tensor mine;  // this rank's count, the input
    at::Tensor all;   // every rank's count, on the group's device
    at::Tensor host;  // on a GPU: `all` copied to the host on a side stream
    c10::intrusive_ptr<c10d::Work> work;
    std::optional<c10::Event> arrived;  // on a GPU: recorded after that copy
    at::Tensor ids;                     // this rank's ids, flattened
    at::Tensor rows;                    // their gradient [ids, hidden] once the backward ran

    // Every rank's count on the host, once exchanged.
    [[nodiscard]] at::Tensor counts() const;
  };

  ProcessGroup group_;
  at::Tensor weight_;
  mutable std::mutex mutex_;
  bool deferring_ = false;
  int64_t lookups_ = 0;
  std::optional<DeferredLookup> pending_;  // a deferred lookup's, until finish()
};

}  // namespace d9d::parallel::detail
