// d9d/advise/activation_memory.hpp — the bytes one microbatch's forward keeps for its backward,
// known before launch (the Plan advisor, docs/advise.md). A rank holds this for every microbatch in
// flight: one without a pipeline, the schedule program's peak per rank under one.
//
//   const auto kept = d9d::advise::qwen3_activation_bytes(config, /*microbatch_size=*/8,
//                                                         /*sequence_length=*/2048);
//   kept.layers; kept.loss; kept.rope; kept.total();
//
// Predicted so far: the dense Qwen3 (d9d::model::Qwen3ForCausalLM::loss) with d9d's fused kernels
// (the default), activations in float32 (the Fp32 precision policy),
// no recompute, no tensor or context parallelism, the whole model on one rank. What each term is
// comes from the model's code, per token of a layer (H hidden, Q = heads x head_dim, K = KV heads x
// head_dim, I intermediate):
//   the input norm's output and its rstd                      H + 1
//   q, k (kept by the q/k norms) and their per-head rstds     Q + K + heads + kv_heads
//   v, the rotated q and k, the attention's output and its    K + Q + K + Q + heads (lse, float)
//   log-sum-exp (SDPA's saved tensors; o_proj reads the output as a view)
//   the residual after attention, the MLP's norm and rstd     H + H + 1
//   gate and up (silu(gate) * up is recomputed in backward)   2 I
//   the layer's output (the next norm's input)                H
// and per token of the model: the embedding's output (H) and the fused head's gradient of its
// input (H) and the final norm's rstd (1), plus per microbatch the head's weight gradient
// (vocab x H, computed in the forward by d9d::model::linear_cross_entropy) and the rotary tables
// (2 x T x head_dim / 2). tests/advise checks it against the bytes the forward leaves allocated
// (d9d::advise::CpuMemoryMeter).
#pragma once

#include <cstdint>

namespace d9d::model {
struct Qwen3Config;
}  // namespace d9d::model

namespace d9d::advise {

/// What one microbatch's forward keeps until its backward, in bytes.
struct ActivationBytes {
  int64_t layers = 0;  ///< every decoder layer's saved tensors
  int64_t loss = 0;    ///< embedding output, final norm, the fused head's gradients
  int64_t rope = 0;    ///< the rotary cos and sin tables

  [[nodiscard]] int64_t total() const { return layers + loss + rope; }
};

/// The bytes d9d::model::Qwen3ForCausalLM's loss() keeps for the backward of one microbatch of
/// `microbatch_size` sequences of `sequence_length` tokens in float32 (see the file comment).
/// std::invalid_argument for a size below 1.
[[nodiscard]] ActivationBytes qwen3_activation_bytes(const model::Qwen3Config& config,
                                                     int64_t microbatch_size,
                                                     int64_t sequence_length);

}  // namespace d9d::advise
