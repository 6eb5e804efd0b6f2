// d9d/model/embedding_rows.cpp — a token lookup whose weight gradient goes to a sink as rows.
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <d9d/model/embedding_rows.hpp>

namespace d9d::model {
namespace {

// The lookup's backward node: no next edges (the weight was detached), so autograd asks nothing
// of the weight; the rows' gradient goes to the sink.
class RowsToSink : public torch::autograd::Node {
 public:
  RowsToSink(std::shared_ptr<EmbeddingRowSink> sink, at::Tensor ids)
      : sink_(std::move(sink)), ids_(std::move(ids)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads.empty() && grads[0].defined()) {
      const auto& grad = grads[0];
      sink_->rows_backward(ids_, grad.reshape({-1, grad.size(-1)}));
    }
    return {};
  }
  [[nodiscard]] std::string name() const override { return "d9d::model::EmbeddingRowsBackward"; }
  void release_variables() override { ids_ = at::Tensor(); }

 private:
  std::shared_ptr<EmbeddingRowSink> sink_;
  at::Tensor ids_;
};

}  // namespace

at::Tensor embedding_rows(const at::Tensor& weight, const at::Tensor& ids,
                          const std::shared_ptr<EmbeddingRowSink>& sink) {
  if (!sink) {
    throw std::invalid_argument("d9d::model::embedding_rows: no sink");
  }
  if (weight.dim() != 2) {
    throw std::invalid_argument("d9d::model::embedding_rows: the weight must be [vocab, hidden]");
  }
  sink->looked_up(ids);
  auto rows = at::embedding(weight.detach(), ids);
  torch::autograd::create_gradient_edge(rows,
                                        std::make_shared<RowsToSink>(sink, ids.reshape({-1})));
  return rows;
}

}  // namespace d9d::model
