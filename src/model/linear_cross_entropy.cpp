// d9d/model/linear_cross_entropy.cpp — chunked LM head + cross-entropy with gradients computed in
// the forward pass (see the header).
#include <algorithm>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/kernels/cross_entropy.hpp>
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
    at::Tensor h = hidden;
    at::Tensor w = weight;
    if (const auto dtype = d9d::detail::autocast_dtype(hidden)) {
      h = hidden.to(*dtype);
      w = weight.to(*dtype);
    } else if (w.scalar_type() != h.scalar_type()) {
      w = w.to(h.scalar_type());
    }
    const auto acc = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor loss_sum = at::zeros({}, hidden.options().dtype(acc));
    at::Tensor grad_hidden = grads && needs_hidden ? at::empty_like(h) : at::Tensor();
    // The head's gradient is summed over chunks in the weight's own dtype (float32 under Fp32
    // and Bf16Mixed: cuBLAS writes float32 from the bf16 product; bfloat16 under Bf16Params, one
    // rounding per chunk, as bfloat16 gradients are summed over microbatches anyway).
    at::Tensor grad_weight =
        grads && needs_weight ? at::zeros({vocab, weight.size(1)}, weight.options()) : at::Tensor();
    const at::Tensor targets = labels.to(at::kLong);
    const bool same_dtype = grad_weight.defined() && grad_weight.scalar_type() == h.scalar_type();
    const bool widening = grad_weight.defined() && grad_weight.is_cuda() &&
                          grad_weight.scalar_type() == at::kFloat &&
                          (h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kHalf);
    for (int64_t begin = 0; begin < rows; begin += chunk_rows) {
      const int64_t n = std::min(chunk_rows, rows - begin);
      const auto hc = h.narrow(0, begin, n);
      const auto yc = targets.narrow(0, begin, n);
      // The logits [n, V] in the matmul's dtype; the kernel leaves softmax - one-hot over them
      // (0 on ignored rows), computed in float (double for double) and rounded once.
      at::Tensor g = at::mm(hc, w.t());
      loss_sum.add_(kernels::cross_entropy_rows(g, yc, ignore_index).sum());
      if (!grads) {
        continue;
      }
      if (grad_hidden.defined()) {
        auto rows_of = grad_hidden.narrow(0, begin, n);  // contiguous: whole rows
        at::mm_out(rows_of, g, w);
      }
      if (grad_weight.defined()) {
        if (same_dtype) {
          grad_weight.addmm_(g.t(), hc);
        } else if (widening) {
          // float32 accumulation straight from the bf16/fp16 product (cuBLAS), no temporary.
          at::addmm_out(grad_weight, grad_weight, g.t(), hc, at::kFloat);
        } else {
          grad_weight.add_(at::mm(g.t(), hc).to(grad_weight.scalar_type()));
        }
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
      // In place: the float32 sum is not needed again, and the peak is the backward's start.
      dw = grad_weight.mul_(scale.to(grad_weight.scalar_type())).to(weight_dtype);
    }
    // Release the forward's sums now rather than when the graph goes.
    ctx->saved_data["grad_hidden"] = at::Tensor();
    ctx->saved_data["grad_weight"] = at::Tensor();
    return {dh, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The cross-entropy of whole logits by the fused kernel: the forward leaves softmax - one-hot
// over a copy of the logits (the caller's stay as they were), the backward scales it.
struct LogitsCrossEntropy : torch::autograd::Function<LogitsCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& labels, int64_t ignore_index, bool grads_wanted) {
    const bool grads = grads_wanted && logits.requires_grad();
    const at::NoGradGuard no_grad;
    at::Tensor g = logits.clone(at::MemoryFormat::Contiguous);
    auto loss_sum = kernels::cross_entropy_rows(g, labels.to(at::kLong), ignore_index).sum();
    ctx->saved_data["grad"] = grads ? g : at::Tensor();
    return loss_sum;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto g = ctx->saved_data["grad"].toTensor();
    if (!g.defined()) {
      throw std::logic_error(
          "d9d::model::logits_cross_entropy: backward of a forward run without gradients");
    }
    // The 0-dim float scale against the logits' dtype: computed in float, rounded once.
    auto dl = g * grads[0];
    ctx->saved_data["grad"] = at::Tensor();
    return {dl, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

CausalLmLoss logits_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                  int64_t ignore_index) {
  if (logits.dim() < 1 || labels.numel() * logits.size(-1) != logits.numel()) {
    throw std::invalid_argument(
        "d9d::model::logits_cross_entropy: logits [..., V] with one row per label expected, got " +
        c10::str(logits.sizes()) + " and labels " + c10::str(labels.sizes()));
  }
  const auto flat_labels = labels.reshape({-1});
  auto loss_sum = LogitsCrossEntropy::apply(logits.reshape({-1, logits.size(-1)}), flat_labels,
                                            ignore_index, at::GradMode::is_enabled());
  auto tokens = (flat_labels != ignore_index).sum();
  return {.loss_sum = std::move(loss_sum), .tokens = std::move(tokens)};
}

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
    // About 128 MiB of logits per chunk in the compute dtype (441 rows of a 151,936 vocabulary
    // in bf16): large enough for full-speed matmuls, small next to the activations.
    const int64_t element_bytes = hidden.scalar_type() == at::kDouble  ? 8
                                  : hidden.scalar_type() == at::kFloat ? 4
                                                                       : 2;
    const bool autocast = at::autocast::is_autocast_enabled(hidden.device().type());
    chunk_rows = std::max<int64_t>(1, (int64_t{1} << 27) / (autocast ? 2 : element_bytes) /
                                          std::max<int64_t>(1, weight.size(0)));
  }
  auto loss_sum = LinearCrossEntropy::apply(hidden, weight, labels, ignore_index, chunk_rows,
                                            at::GradMode::is_enabled());
  auto tokens = (labels != ignore_index).sum();
  return {.loss_sum = std::move(loss_sum), .tokens = std::move(tokens)};
}

}  // namespace d9d::model
