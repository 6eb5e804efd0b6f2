// d9d/advise/activation_memory.hpp — the bytes one microbatch's forward keeps for its backward,
// known before launch (the Plan advisor, docs/advise.md). A rank holds this for every microbatch in
// flight: one without a pipeline, the schedule program's peak per rank under one.
//
//   const auto kept = d9d::advise::qwen3_activation_bytes(config, /*microbatch_size=*/8,
//                                                         /*sequence_length=*/2048);
//   kept.layers; kept.loss; kept.rope; kept.total();
//
// Predicted so far: the dense Qwen3 (d9d::model::Qwen3ForCausalLM::loss) with d9d's fused kernels
// (the default), in float32 (Fp32), under bfloat16 autocast over float32 parameters (Bf16Mixed)
// or with bfloat16 parameters (Bf16Params, and FullyShard's bfloat16 gathers), with or without
// recompute (Recompute, below), no tensor or context parallelism, the whole model on one rank. What
// each term is comes from the model's code; in float32, per token of a layer (H hidden, Q = heads x
// head_dim, K = KV heads x head_dim, I intermediate), in elements:
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
// (2 x T x head_dim / 2). Under bfloat16 autocast the residual stream stays float32 and the norms
// write their outputs in bfloat16 (what the linear layers read), so per token of a layer, in bytes:
//   the residual after attention and the layer's output (float32)   4 H + 4 H
//   the input norm's output (read by q, k and v) and the MLP         2 H + 2 H
//   norm's (read by gate and up), bfloat16
//   the two norms' rstds (float32)                                   8
//   q, k, v, the rotated q and k, the attention's output (bf16)       3 x 2 Q + 3 x 2 K
//   the q/k norms' rstds and the log-sum-exp (float32)               4 heads + 4 kv_heads + 4 heads
//   gate and up (bfloat16)                                           2 x 2 I
// plus per layer the bfloat16 casts of its seven weight matrices, which the matmuls keep (the
// norms read their float32 weights as they are); per token of the model the embedding's output
// (float32), the head's input gradient (bfloat16) and the final rstd; per microbatch the head's
// weight gradient (float32) and the rotary tables (float32). With bfloat16 parameters everything is
// bfloat16 but the rstds, the log-sum-exp and the rotary tables (float32), with no casts: per token
// of a layer 4 x 2 H + 8 + 6 Q + 6 K + 8 heads + 4 kv_heads + 2 x 2 I bytes, per token of the model
// 2 x 2 H + 4, and the head's weight gradient in bfloat16. tests/advise checks all three against
// the bytes the forward leaves allocated (d9d::advise::CpuMemoryMeter).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <d9d/advise/state_memory.hpp>
#include <d9d/pipeline/program.hpp>

namespace d9d::model {
struct Qwen3Config;
struct Qwen3MoeConfig;
}  // namespace d9d::model

namespace d9d::advise {

/// How the model computes: the dtypes its forward keeps tensors in.
enum class Compute : unsigned char {
  float32,          ///< float32 parameters, no autocast (Fp32)
  bf16_autocast,    ///< float32 parameters under bfloat16 autocast (Bf16Mixed under Replicate)
  bf16_parameters,  ///< bfloat16 parameters (Bf16Params; Bf16Mixed under FullyShard, which
                    ///< gathers bfloat16 copies); autocast on or off alike
};

/// Which decoder layers recompute their activations in backward, and what of them (the
/// d9d::recompute policies): layer i (0-based) recomputes when every_nth > 0 and
/// i % every_nth == every_nth - 1 — all of it (Full, EveryNth<K>: the layer keeps only its
/// output) or only its attention part (Attention<K>: the input norm, projections, rotary
/// embedding and attention; the MLP keeps its activations).
struct Recompute {
  int every_nth = 0;            ///< 0: none (recompute::None); 1: every layer
  bool attention_only = false;  ///< recompute::Attention<K>

  [[nodiscard]] constexpr bool any() const { return every_nth > 0; }
  /// How many of a model's `layers` layers recompute (those i with i % every_nth ==
  /// every_nth - 1).
  [[nodiscard]] constexpr int64_t layers_recomputed(int64_t layers) const {
    return every_nth > 0 ? layers / every_nth : 0;
  }
  /// recompute::Full.
  [[nodiscard]] static constexpr Recompute full() { return {.every_nth = 1}; }
};

/// How tensor parallelism splits the model (d9d::parallel::TensorParallel): each rank computes its
/// `ranks`-th of the heads, the MLP width and the vocabulary (Megatron's layout), and with
/// `sequence_parallel` the residual stream between blocks holds 1/ranks of the tokens.
struct TensorSplit {
  int ranks = 1;
  bool sequence_parallel = false;
};

/// What one microbatch's forward keeps until its backward, in bytes.
struct ActivationBytes {
  int64_t layers = 0;  ///< every decoder layer's saved tensors
  int64_t loss = 0;    ///< embedding output, final norm, the fused head's gradients
  int64_t rope = 0;    ///< the rotary cos and sin tables

  [[nodiscard]] int64_t total() const { return layers + loss + rope; }
};

/// The bytes d9d::model::Qwen3ForCausalLM's loss() keeps for the backward of one microbatch of
/// `microbatch_size` sequences of `sequence_length` tokens, computed as `compute` says (see the
/// file comment). std::invalid_argument for a size below 1.
/// Under `recompute` a recomputed decoder layer runs its forward without saving and again in
/// backward, so it keeps only its output (the next layer's input); one whose attention part is
/// recomputed keeps what its MLP part saves and its output.
/// Under `tensor` (tp > 1) one rank's: the norms' outputs whole (gathered under sequence
/// parallelism) since every rank's matmuls read them, its heads' and MLP slice's tensors, the
/// residual stream over its tokens; the loss side is the vocabulary-parallel embedding's masked
/// ids and mask, the head's input, and the loss-parallel cross-entropy's softmax - one-hot over
/// its vocabulary slice in float32 (instead of the fused head's gradients). std::invalid_argument
/// when the ranks do not divide the heads, KV heads, intermediate size, vocabulary or (with
/// sequence parallelism) the sequence.
[[nodiscard]] ActivationBytes qwen3_activation_bytes(
    const model::Qwen3Config& config, int64_t microbatch_size, int64_t sequence_length,
    Compute compute = Compute::float32, Recompute recompute = {}, TensorSplit tensor = {});

/// What a PEFT policy changes in qwen3_activation_bytes's figure for one microbatch (add it to
/// total()), from the model's `parameters` under the policy (apply_peft): each LoRA adapter keeps
/// s x A^T [tokens, rank] in the matmuls' dtype (d9d::model::low_rank_linear) and, under autocast,
/// the bfloat16 casts of A and B (an adapted down projection recomputes its input silu(gate) * up
/// in backward, as a plain one does); a head whose weight does not train has no weight gradient
/// in the forward (less
/// vocab x H in the parameters' dtype); a frozen embedding before a frozen first input norm
/// leaves that norm nothing to differentiate, so neither the embedding's output nor the norm's
/// rstd is kept. The rest keeps what it keeps under FullTune. std::invalid_argument, naming it,
/// for what is not predicted: an adapter on the LM head (the unfused loss), a frozen linear layer
/// without an adapter (LoRA on some of the linear layers), and (by `dropout`, any method's)
/// adapters with dropout. Not under recompute, tensor parallelism or a pipeline.
[[nodiscard]] int64_t qwen3_peft_activation_delta(const model::Qwen3Config& config,
                                                  const std::vector<ParameterShape>& parameters,
                                                  int64_t microbatch_size, int64_t sequence_length,
                                                  Compute compute = Compute::float32,
                                                  bool dropout = false);

/// How expert parallelism (d9d::parallel::ExpertParallel) splits a Qwen3-MoE's routed experts:
/// each of `ranks` ranks holds num_experts / ranks of them and runs the rows every rank routes to
/// them. `load` is the rows this rank's experts receive over its own tokens' routings (tokens x
/// top-k): 1 under balanced routing, up to `ranks` when every token picks this rank's experts.
struct ExpertSplit {
  int ranks = 1;
  double load = 1.0;
  /// Under Compute::bf16_parameters: the routed experts' weights stay float32 and are cast to
  /// bfloat16 as each layer runs, the casts kept for its backward (FullyShard in bf16 mixed gathers
  /// its units in bfloat16 but leaves the experts outside them when ep_replicate is 1).
  bool float32_experts = false;
};

/// The decoder layers of `config` that run a MoE block (the others keep the dense MLP).
[[nodiscard]] int64_t qwen3_moe_layer_count(const model::Qwen3MoeConfig& config);

/// The bytes d9d::model::Qwen3MoeForCausalLM's loss() keeps for the backward of one microbatch
/// (d9d's fused kernels, dropless routing: no capacity factor), computed as `compute` says, without
/// recompute, tensor or context parallelism: the dense Qwen3's prediction (its attention part,
/// its dense-MLP layers, the head and embedding, the rotary tables) with each MoE layer's block in
/// place of the dense MLP. Per MoE layer, in bytes (a: the matmuls' element, 4 in float32 else 2;
/// H hidden, I moe_intermediate_size, E experts, k top-k; from src/model/moe.cpp, measured by
/// tests/advise with d9d::advise::CpuMemoryMeter):
///   per token        the router's probabilities (float32, 4 E) and the sum that normalises the
///                    top-k weights (4); outside float32 the router's float32 copy of its input
///                    (4 H) while the norm's output (2 H) is no longer kept (unless a shared
///                    expert reads it)
///   per routing      its indices and weight (20 + a) and the expert output it gets back (a H)
///   (tokens x k)
///   per row an       its input, gate, up, silu(gate) and the product (a (H + 4 I)); under expert
///   expert runs      parallelism also the two orders that permute the received rows (16)
///                    (tokens x k x load)
///   per layer        the routing's per-expert counts (16 E + 2; the sequence-wise auxiliary loss
///                    keeps them per sequence); under autocast the bfloat16 casts of this rank's
///                    experts (3 x E / ranks x I x H x 2), with bfloat16 parameters the router
///                    weight's float32 copy (4 E H) and, with float32_experts, the experts' casts
///   shared expert    its gate and up (2 S a), its output (a H) and its gate's sigmoid (a); under
///                    autocast its weights' casts ((3 S H + H) x 2)
/// std::invalid_argument for a size below 1, a capacity factor, or experts that do not split over
/// the ranks.
[[nodiscard]] ActivationBytes qwen3_moe_activation_bytes(const model::Qwen3MoeConfig& config,
                                                         int64_t microbatch_size,
                                                         int64_t sequence_length,
                                                         Compute compute = Compute::float32,
                                                         ExpertSplit experts = {});

/// What one microbatch's forward keeps on pipeline stage `stage` of `stages` (the stages of
/// d9d::model::Qwen3Stage, layers split by d9d::model::distribute_layers weighed by
/// pipeline_virtual_layers at `sequence_length`, as Qwen3Provider builds them), in bytes: its
/// layers (as above) and rotary tables; on the first stage the embedding's output; on the others
/// the received input the executor keeps (`input`); on the last the final norm, the head and the
/// loss the pipelined step runs on its logits (d9d::model::logits_cross_entropy: softmax − one-hot
/// of every token over the vocabulary in the logits' dtype, the head's input and rstd, and under
/// autocast the head weight's bfloat16 cast).
struct StageActivationBytes {
  int64_t layers = 0;
  int64_t rope = 0;
  int64_t input = 0;  ///< the embedding's output (first stage) or the received hidden states
  int64_t head = 0;   ///< last stage: final norm, head and loss
  /// Under autocast, the bfloat16 copies of the stage's weights (the layers' and the head's): a
  /// lone forward makes its own, the pipelined train step one set for all its microbatches.
  int64_t weight_casts = 0;

  [[nodiscard]] int64_t total() const { return layers + rope + input + head + weight_casts; }
};

/// Under `recompute` (every layer's, or every layer's attention part: every_nth 0 or 1; a
/// larger every_nth counts blocks across a rank's stages and is refused with
/// std::invalid_argument) the stage's layers keep what qwen3_activation_bytes says, and
/// weight_casts only the casts a lone forward keeps (the MLP's under Attention<1>, none under
/// Full); the train step's cache still holds every cast (qwen3_rank_weight_cast_bytes).
[[nodiscard]] StageActivationBytes qwen3_stage_activation_bytes(
    const model::Qwen3Config& config, int stage, int stages, int64_t microbatch_size,
    int64_t sequence_length, Compute compute = Compute::float32, Recompute recompute = {});

/// The most activation bytes pipeline rank `pp_rank` holds at once under `program` (with or
/// without communication), each forward adding its stage's bytes (`per_stage[stage]`) and each
/// B or I of the same stage and microbatch taking them away. (Under a split backward the weight
/// gradient's W still reads the layers' inputs after I; that part is not counted.)
[[nodiscard]] int64_t peak_rank_activation_bytes(const pipeline::Program& program, int pp_rank,
                                                 const std::vector<int64_t>& per_stage);

/// What stage `stage`'s deferred weight gradients keep from its I until its W under a split
/// backward (d9d::WeightGradQueue; src/model/split_linear.cpp), in bytes: every linear layer's
/// input and output gradient, which the queued GEMM reads. Per token of a layer, in elements of
/// the compute dtype: the input of q, k and v (one tensor, the norm's output), of o (the
/// attention's output), of gate and up (likewise) and of down
/// (silu(gate) * up, which its backward computes at I for the queued GEMM), and the gradients of
/// the seven outputs
/// (Q + 2 K + 2 H + 2 I); on the last stage also the head's input and its output gradient over the
/// vocabulary. Everything else the backward saved is freed at I.
[[nodiscard]] int64_t qwen3_stage_weight_gradient_bytes(const model::Qwen3Config& config, int stage,
                                                        int stages, int64_t microbatch_size,
                                                        int64_t sequence_length,
                                                        Compute compute = Compute::float32);

/// The weight casts pipeline rank `pp_rank` holds through a step under bfloat16 autocast: each of
/// its stages' StageActivationBytes::weight_casts once (the train step casts each weight once for
/// all its microbatches); 0 under the other ways of computing. std::invalid_argument for a rank
/// outside `program`.
[[nodiscard]] int64_t qwen3_rank_weight_cast_bytes(const model::Qwen3Config& config,
                                                   const pipeline::Program& program, int pp_rank,
                                                   int64_t sequence_length, Compute compute);

/// The most bytes a rank holds at once during a step, from its state and activations: the
/// parameters and AdamW moments throughout, the activations of the microbatches in flight, and
/// the gradients from the first backward on (the Trainer drops them at the start of each step:
/// zero_grad with set_to_none). Without a pipeline the microbatches run F0 B0 F1 B1 ...: one
/// microbatch peaks at the larger of its activations and the gradients, more at both.
[[nodiscard]] int64_t peak_step_bytes(const StateBytes& state, int64_t activations,
                                      int microbatches);

/// The same under `program` on pipeline rank `pp_rank`: each F adds its stage's activations, each
/// B or I takes them away, and the gradients count from the rank's first B or W (an I computes no
/// weight gradient); the largest sum after any action.
/// With `deferred` (per stage, qwen3_stage_weight_gradient_bytes) under a split backward, an I
/// leaves its stage's deferred bytes until the stage's next W.
[[nodiscard]] int64_t peak_rank_step_bytes(const pipeline::Program& program, int pp_rank,
                                           const std::vector<int64_t>& per_stage,
                                           const StateBytes& state,
                                           const std::vector<int64_t>& deferred = {});

/// FullyShard's units gathered at the peak of a whole-model step, fully_shard_gathered_bytes's
/// total in the dtype it gathers in under `compute` (float32, else bfloat16); 0 when `rules` shard
/// no parameter (shard_ranks 1).
[[nodiscard]] int64_t fully_shard_gathered_step_bytes(const std::vector<ParameterShape>& parameters,
                                                      const StateRules& rules, Compute compute,
                                                      bool reshard_after_forward);

/// The memory of one pipeline rank of a Plan during a step.
struct RankMemory {
  StateBytes state{};                    ///< its state (shard rank 0, which keeps the most rows)
  std::optional<int64_t> activations{};  ///< its activations in flight, where predicted
  std::optional<int64_t> peak{};         ///< its peak during a step, where predicted
};

/// Each of the `pp` pipeline ranks `program` places `config`'s stages on (pp 1: the whole model;
/// the program is unused): its state under `rules`, and with `compute` its activations in flight
/// and its peak during a step (peak_step_bytes, or peak_rank_step_bytes with the split backward's
/// deferred bytes). Under FullyShard without a pipeline (rules.shard_ranks > 1, pp 1) the peak adds
/// the units gathered at once (fully_shard_gathered_bytes, `reshard_after_forward` as the run's
/// reshard setting says: fully_shard_gathered_step_bytes); under a pipeline they are not counted
/// yet. Under bfloat16 autocast the train step casts each weight once for all its microbatches
/// (src/core/weight_casts.cpp): a pipeline rank holds its stages' casts (weight_casts) once, for
/// the whole step, not per microbatch in flight; with recomputed layers (`recompute`, predicted
/// without a pipeline) and more than one microbatch the casts stay through the backward too.
/// Under tensor parallelism (rules.tensor_ranks > 1, without a pipeline) the activations are one
/// rank's (TensorSplit, with `sequence_parallel` as the Plan's TensorParallel says), and the peak
/// adds the head's logits over the rank's vocabulary, alive while the loss-parallel
/// cross-entropy makes its float32 copy.
[[nodiscard]] std::vector<RankMemory> rank_memory(
    const model::Qwen3Config& config, const pipeline::Program& program, int pp, int microbatches,
    const StateRules& rules, int64_t microbatch_size, int64_t sequence_length,
    std::optional<Compute> compute, Recompute recompute, bool reshard_after_forward = true,
    bool sequence_parallel = false);

/// Of rank_memory's ranks, the one with the largest peak during a step (without `compute`, the one
/// with the most state).
[[nodiscard]] RankMemory fullest_rank_memory(const model::Qwen3Config& config,
                                             const pipeline::Program& program, int pp,
                                             int microbatches, const StateRules& rules,
                                             int64_t microbatch_size, int64_t sequence_length,
                                             std::optional<Compute> compute, Recompute recompute,
                                             bool reshard_after_forward = true,
                                             bool sequence_parallel = false);

/// How a Plan runs a Qwen3-MoE's routed experts, from its state rules: over rules.expert_ranks
/// (ep_shard; 1 without expert parallelism) at `load` times their balanced rows, and float32 under
/// FullyShard (`fully_shard`) when it gathers bfloat16 units from float32 parameters (`compute`
/// bf16_parameters over rules.parameters float32: bf16 mixed) but leaves the experts outside them
/// (expert parallelism with expert_shard_ranks 1).
[[nodiscard]] ExpertSplit expert_split(const StateRules& rules, bool fully_shard, Compute compute,
                                       double load = 1.0);

/// A Qwen3-MoE rank's memory during a step without a pipeline, tensor or context parallelism:
/// the state of the rank that keeps the most (shard and expert-shard rank 0), with `compute` one
/// microbatch's activations (qwen3_moe_activation_bytes at `experts`) and, unless FullyShard also
/// shards the experts over ep_replicate (rules.expert_shard_ranks > 1: their own units are not
/// counted yet), the peak during a step: peak_step_bytes plus FullyShard's units gathered at once
/// (fully_shard_gathered_step_bytes).
[[nodiscard]] RankMemory moe_rank_memory(const model::Qwen3MoeConfig& config,
                                         const StateRules& rules, int microbatches,
                                         int64_t microbatch_size, int64_t sequence_length,
                                         std::optional<Compute> compute, ExpertSplit experts,
                                         bool reshard_after_forward = true);

}  // namespace d9d::advise
