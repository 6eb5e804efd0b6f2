// d9d/kernels/cross_entropy.hpp — cross-entropy over rows of logits with the gradient written over
// the logits, as a LibTorch custom op (`d9d::cross_entropy_rows_`): what the chunked LM head
// (model::linear_cross_entropy) runs on each chunk.
//
//   at::Tensor logits = at::mm(hidden_chunk, head_weight.t());          // [n, V], bf16
//   at::Tensor loss = d9d::kernels::cross_entropy_rows_(logits, labels, -100);   // [n], float
//   // logits now holds softmax(logits) - one_hot(labels), 0 on ignored rows (bf16)
//
// Per row, in float (double for double logits): the log-sum-exp by an online max and sum (one
// read of the row), the loss lse - logits[label] (0 where label == ignore_index), then softmax -
// one-hot written in place (a second read and one write), rounded once to the logits' dtype. The
// ATen composition (upcast, logsumexp, gather, sub, exp, scatter, mul, downcast) moves the
// float32 row about ten times. Schema (namespace `d9d`, src/kernels/cross_entropy.cpp):
//   cross_entropy_rows_(Tensor(a!) logits, Tensor labels, int ignore_index) -> Tensor
// Kernels: CPU (the reference) and CUDA (kernels/cross_entropy.cu). No autograd: the caller
// uses the gradient it leaves.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace d9d::kernels {

/// Loss per row (float; double for double logits) of `logits` [n, V] (contiguous, floating) against
/// `labels` [n] (int64; ignore_index rows count 0), and logits := softmax - one-hot in place.
at::Tensor cross_entropy_rows_(const at::Tensor& logits, const at::Tensor& labels,
                               int64_t ignore_index);

namespace detail {

/// Checks cross_entropy_rows_'s arguments (shapes, dtypes, devices, contiguity).
void check_cross_entropy_rows(const at::Tensor& logits, const at::Tensor& labels);

}  // namespace detail
}  // namespace d9d::kernels
