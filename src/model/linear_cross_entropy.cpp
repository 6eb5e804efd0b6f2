// d9d/model/linear_cross_entropy.cpp — chunked LM head + cross-entropy with gradients computed in
// the forward pass (see the header).
#include <algorithm>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <d9d/model/linear_cross_entropy.hpp>

namespace d9d::model {
namespace {

struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  // `grads`: whether the caller records gradients (autograd functions run their forward with
  // gradients off, so the caller decides).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& labels,
                            int64_t ignore_index, int64_t chunk_rows, bool grads_wanted) {
    const int64_t rows = hidden.size(0);
    const int64_t vocab = weight.size(0);
    const bool needs_hidden = hidden.requires_grad();
    const bool needs_weight = weight.requires_grad();
    const bool grads = grads_wanted && (needs_hidden || needs_weight);
    const at::NoGradGuard no_grad;
    // The matmuls run in the dtype autocast would give the head's at::linear.
    const auto device = hidden.device().type();
    at::Tensor h = hidden;
    at::Tensor w = weight;
    if (at::autocast::is_autocast_enabled(device) && hidden.is_floating_point()) {
      const auto dtype = at::autocast::get_autocast_dtype(device);
      h = hidden.to(dtype);
      w = weight.to(dtype);
    } else if (w.scalar_type() != h.scalar_type()) {
      w = w.to(h.scalar_type());
    }
    const auto acc = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor loss_sum = at::zeros({}, hidden.options().dtype(acc));
    at::Tensor grad_hidden = grads && needs_hidden ? at::empty_like(h) : at::Tensor();
    at::Tensor grad_weight = grads && needs_weight
                                 ? at::zeros({vocab, weight.size(1)}, weight.options().dtype(acc))
                                 : at::Tensor();
    for (int64_t begin = 0; begin < rows; begin += chunk_rows) {
      const int64_t n = std::min(chunk_rows, rows - begin);
      const auto hc = h.narrow(0, begin, n);
      const auto yc = labels.narrow(0, begin, n);
      at::Tensor probs = at::mm(hc, w.t()).to(acc);  // the logits [n, V], then their gradient
      const auto valid = yc != ignore_index;
      const auto target = at::where(valid, yc, at::zeros_like(yc));
      const auto lse = at::logsumexp(probs, 1);
      const auto picked = probs.gather(1, target.unsqueeze(1)).squeeze(1);
      loss_sum.add_(((lse - picked) * valid.to(acc)).sum());
      if (!grads) {
        continue;
      }
      // d(loss)/d(logits) = softmax - one-hot, zero on ignored rows, in the logits' memory.
      probs.sub_(lse.unsqueeze(1)).exp_();
      probs.scatter_add_(1, target.unsqueeze(1), at::full({n, 1}, -1.0, probs.options()));
      probs.mul_(valid.to(acc).unsqueeze(1));
      const auto g = probs.to(h.scalar_type());
      if (grad_hidden.defined()) {
        grad_hidden.narrow(0, begin, n).copy_(at::mm(g, w));
      }
      if (grad_weight.defined()) {
        grad_weight.add_(at::mm(g.t(), hc));
      }
    }
    ctx->saved_data["grad_hidden"] = grad_hidden;
    ctx->saved_data["grad_weight"] = grad_weight;
    ctx->saved_data["hidden_dtype"] = static_cast<int64_t>(hidden.scalar_type());
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return loss_sum;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto scale = grads[0];
    const auto grad_hidden = ctx->saved_data["grad_hidden"].toTensor();
    const auto grad_weight = ctx->saved_data["grad_weight"].toTensor();
    if (!grad_hidden.defined() && !grad_weight.defined() && ctx->needs_input_grad(0)) {
      throw std::logic_error(
          "d9d::model::linear_cross_entropy: backward of a forward run without gradients");
    }
    const auto hidden_dtype = static_cast<at::ScalarType>(ctx->saved_data["hidden_dtype"].toInt());
    const auto weight_dtype = static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    at::Tensor dh;
    at::Tensor dw;
    if (grad_hidden.defined() && ctx->needs_input_grad(0)) {
      dh = (grad_hidden * scale.to(grad_hidden.scalar_type())).to(hidden_dtype);
    }
    if (grad_weight.defined() && ctx->needs_input_grad(1)) {
      dw = (grad_weight * scale.to(grad_weight.scalar_type())).to(weight_dtype);
    }
    return {dh, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

CausalLmLoss linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                  const at::Tensor& labels, int64_t ignore_index,
                                  int64_t chunk_rows) {
  if (hidden.dim() != 2 || weight.dim() != 2 || hidden.size(1) != weight.size(1)) {
    throw std::invalid_argument(
        "d9d::model::linear_cross_entropy: hidden [N, H] and weight [V, "
        "H] expected, got " +
        c10::str(hidden.sizes()) + " and " + c10::str(weight.sizes()));
  }
  if (labels.dim() != 1 || labels.size(0) != hidden.size(0)) {
    throw std::invalid_argument("d9d::model::linear_cross_entropy: labels [" +
                                std::to_string(hidden.size(0)) + "] expected, got " +
                                c10::str(labels.sizes()));
  }
  if (chunk_rows <= 0) {
    chunk_rows = std::max<int64_t>(1, (int64_t{1} << 28) / std::max<int64_t>(1, weight.size(0)));
  }
  auto loss_sum = LinearCrossEntropy::apply(hidden, weight, labels, ignore_index, chunk_rows,
                                            at::GradMode::is_enabled());
  auto tokens = (labels != ignore_index).sum();
  return {.loss_sum = std::move(loss_sum), .tokens = std::move(tokens)};
}

}  // namespace d9d::model
