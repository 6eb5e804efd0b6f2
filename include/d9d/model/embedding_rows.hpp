// d9d/model/embedding_rows.hpp — the token embedding's weight gradient taken out of autograd as
// rows, when a strategy asks for it (d9d::parallel::Replicate does, for a tied embedding).
//
//   model->set_embedding_row_sink(sink);   // d9d::parallel::Replicate does this
//   // while sink->deferring(): embed() looks the rows up through embedding_rows(), whose backward
//   // hands (ids, the rows' gradient) to the sink and gives the weight no gradient
//
// A lookup's backward normally scatters the rows' gradient into a dense [vocab, hidden] tensor
// that autograd adds to the weight's gradient; for an LM head tied to the embedding, autograd adds
// the head's and the lookup's parts once both exist, at the very end of the backward (the lookup
// is the model's first operation). A deferred lookup leaves the weight with the head's part only,
// complete right after the head's backward, so its reduction can start at the beginning of the
// backward; the sink adds the rows afterwards. The layer only calls the sink's virtual functions;
// the collectives live in the parallel layer.
// docs/design/0030-embedding-rows-after-the-reduction.md.
#pragma once

#include <memory>

#include <ATen/core/Tensor.h>

namespace d9d::model {

/// Where a deferred lookup's weight gradient goes. Implemented by d9d::parallel; called by the
/// model on the thread that runs forward (deferring, looked_up) and by autograd on its backward
/// thread (rows_backward).
class EmbeddingRowSink {
 public:
  EmbeddingRowSink() = default;
  virtual ~EmbeddingRowSink() = default;
  EmbeddingRowSink(const EmbeddingRowSink&) = delete;
  EmbeddingRowSink& operator=(const EmbeddingRowSink&) = delete;
  EmbeddingRowSink(EmbeddingRowSink&&) = delete;
  EmbeddingRowSink& operator=(EmbeddingRowSink&&) = delete;

  /// Whether the next lookup (with gradients enabled) defers its weight gradient.
  [[nodiscard]] virtual bool deferring() const = 0;
  /// A deferred lookup of `ids` (any shape) runs forward.
  virtual void looked_up(const at::Tensor& ids) = 0;
  /// Its backward: `rows_grad` [ids.numel(), hidden] is the gradient of the rows of `ids`
  /// (flattened), in the rows' dtype; the weight's gradient is their sum into those rows.
  virtual void rows_backward(const at::Tensor& ids, const at::Tensor& rows_grad) = 0;
};

/// A model whose token embedding can defer its weight gradient to a sink (Qwen3ForCausalLM).
class EmbeddingRowsModel {
 public:
  EmbeddingRowsModel() = default;
  virtual ~EmbeddingRowsModel() = default;
  EmbeddingRowsModel(const EmbeddingRowsModel&) = delete;
  EmbeddingRowsModel& operator=(const EmbeddingRowsModel&) = delete;
  EmbeddingRowsModel(EmbeddingRowsModel&&) = delete;
  EmbeddingRowsModel& operator=(EmbeddingRowsModel&&) = delete;

  /// The token embedding's weight [vocab, hidden].
  [[nodiscard]] virtual at::Tensor embedding_weight() const = 0;
  /// Whether the LM head uses that weight too (tie_word_embeddings).
  [[nodiscard]] virtual bool embedding_tied() const = 0;
  /// Lookups consult `sink` (null: never deferred). Lookups under tensor parallelism (a vocabulary
  /// slice per rank) are never deferred.
  virtual void set_embedding_row_sink(std::shared_ptr<EmbeddingRowSink> sink) = 0;
};

/// The rows of `weight` [vocab, hidden] at `ids`: [..., hidden], as at::embedding gives them, but
/// the backward calls sink->rows_backward instead of giving `weight` a gradient. Calls
/// sink->looked_up(ids) first.
[[nodiscard]] at::Tensor embedding_rows(const at::Tensor& weight, const at::Tensor& ids,
                                        const std::shared_ptr<EmbeddingRowSink>& sink);

}  // namespace d9d::model
