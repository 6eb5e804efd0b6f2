// d9d/model/linear_cross_entropy.hpp — the LM head and the cross-entropy fused and chunked, so the
// whole [tokens × vocab] logits never exist at once.
//
//   auto loss = d9d::model::linear_cross_entropy(hidden, head_weight, labels);  // {loss_sum,
//   tokens} loss.loss_sum.backward();   // gradients of hidden and head_weight, computed in the
//   forward
//
// hidden [N, H], weight [V, H] (the LM head, or a tied embedding), labels [N] (ignore_index rows
// count nothing). For each chunk of rows: logits = h W^T (in the autocast dtype when autocast is
// on, as the head's matmul would be), then d9d::cross_entropy_rows_ (d9d/kernels/cross_entropy.hpp)
// computes in float (double for double inputs) the token losses and — over the logits, in place —
// softmax − one-hot, from which the chunk's gradients of h (stored) and of W (summed over chunks
// in W's dtype: float32 under Fp32 and Bf16Mixed) are computed right away. The backward only
// scales them by the loss's incoming gradient. Peak memory: one chunk's logits (~128 MiB) and the
// head's gradient instead of all the logits in the compute dtype and float (for a 0.6B Qwen3 at
// 8 × 2048 tokens, ~15 GiB), and the same three matmuls as the unfused head.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include <d9d/model/qwen3.hpp>

namespace d9d::model {

/// The causal-LM loss of `hidden` through the head `weight`: CausalLmLoss{loss_sum, tokens} as
/// causal_lm_loss(at::linear(hidden, weight), labels) gives, to rounding. `chunk_rows` = 0 picks
/// chunks of about 128 MiB of logits.
[[nodiscard]] CausalLmLoss linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                                const at::Tensor& labels,
                                                int64_t ignore_index = -100,
                                                int64_t chunk_rows = 0);

/// The causal-LM loss of whole `logits` [..., V] against `labels` (one per row) by the same
/// kernel: CausalLmLoss{loss_sum, tokens} as causal_lm_loss(logits, labels) gives, to rounding.
/// It keeps softmax − one-hot in the logits' dtype for the backward (2 bytes per logit in bf16)
/// where causal_lm_loss keeps float32 log-probabilities (4 bytes) and passes through two more
/// float32 copies of the logits. What a pipeline's last stage runs (its output is the logits).
[[nodiscard]] CausalLmLoss logits_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                                int64_t ignore_index = -100);

}  // namespace d9d::model
