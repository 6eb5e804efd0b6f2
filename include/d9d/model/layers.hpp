// d9d/model/layers.hpp — white-box transformer layers as LibTorch modules.
//
//   d9d::model::RmsNorm norm(1024, 1e-6);                 // d9d::rms_norm custom op inside
//   d9d::model::Attention attn(AttentionOptions{.hidden_size = 1024, .num_heads = 16, ...});
//   auto y = attn(x, rope.cos_sin(seq_len, x.device()));   // causal GQA through SDPA
//   auto z = attn->forward_placed(x, placement, &layer_cache);  // placed tokens, KV cache
//
// Linear layers are d9d::model::Linear: at::linear normally, split backward (input gradient now,
// weight gradient queued) when a d9d::WeightGradQueue records them
// (d9d/core/weight_grad.hpp), float8 GEMMs when d9d::precision::Float8 set `float8` on them.
//
// Plain `XxxImpl` + TORCH_MODULE holders, so models built from them stay ordinary torch::nn code:
// parameters, named_parameters(), to(), train()/eval() work as usual. Parameter names follow the
// Hugging Face layout (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, gate_proj, up_proj,
// down_proj, weight), so checkpoints map by name.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <d9d/kernels/float8.hpp>
#include <d9d/model/context_parallel.hpp>
#include <d9d/model/tensor_parallel.hpp>

namespace d9d::model {

/// Whether the layers run the d9d custom ops (d9d::rope, d9d::silu_mul, the fused head and loss of
/// d9d/model/linear_cross_entropy.hpp) — the default — or the ATen compositions they replace (for
/// comparisons and benchmarks). Process-wide.
void set_fused_kernels(bool enabled);
[[nodiscard]] bool fused_kernels();

/// RMSNorm over the last dimension (the d9d::rms_norm custom op; CPU and CUDA kernels).
class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t dim, double eps);
  /// A float32 weight is read as it is by bfloat16 or half inputs, other weights are cast to x's
  /// dtype; under autocast a float32 x is normalised into autocast's dtype (what the matmuls after
  /// the norm read).
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RmsNorm);

/// A low-rank addition to a linear layer's output in factored form: scale (x A^T) B^T, with
/// A [rank, in] and B [out, rank] (LoRA's lora_A and lora_B weights).
struct LowRankUpdate {
  at::Tensor a;
  at::Tensor b;
  double scale = 1.0;
};

/// What a parameter-efficient method adds to a linear layer's output (d9d/peft/lora.hpp: LoRA).
/// Its parameters live in child modules of the layer, so they are named after it
/// ("...q_proj.lora_A.weight").
class LinearAdapter {
 public:
  LinearAdapter() = default;
  virtual ~LinearAdapter() = default;
  LinearAdapter(const LinearAdapter&) = delete;
  LinearAdapter& operator=(const LinearAdapter&) = delete;
  LinearAdapter(LinearAdapter&&) = delete;
  LinearAdapter& operator=(LinearAdapter&&) = delete;
  /// The addition to the layer's output for input x, or an undefined tensor for none (e.g. while
  /// the adapter is merged into the weight).
  virtual at::Tensor forward(const at::Tensor& x) = 0;
  /// The addition as a low-rank update when it is exactly one for this forward (LoRA without
  /// active dropout, not merged), so the layer can fold it into its own GEMMs
  /// (low_rank_linear); undefined factors otherwise, and the layer calls forward(x).
  [[nodiscard]] virtual LowRankUpdate low_rank() const { return {}; }
};

/// x W^T + scale (x A^T) B^T as one autograd function: the base GEMM, then the adapter's thin
/// GEMMs accumulating into its output, and in backward the two terms of x's gradient summed the
/// same way. Keeps x and the [rows, rank] product for backward, never the [rows, out] addition.
/// Under autocast computes in the autocast dtype; under a recording d9d::WeightGradQueue
/// the weight gradients (A's, B's and W's when it trains) can be deferred like Linear's.
at::Tensor low_rank_linear(const at::Tensor& x, const at::Tensor& weight,
                           const LowRankUpdate& update);

/// How a linear layer runs its GEMMs in float8 (d9d::precision::Float8 sets it on the attention
/// and MLP projections).
struct Float8Linear {
  /// One scale per row (every operand e4m3fn) or per tensor (gradients e5m2).
  bool rowwise = true;
  /// The weight already quantised per row, when FullyShard gathered it so
  /// (WeightGather::float8): its storage lives while the layer's unit is gathered. Undefined: the
  /// forward quantises the weight itself.
  kernels::Float8Tensor weight;
  /// `weight` transposed for the input gradient's GEMM (float8_transpose), made by the first
  /// backward that needs it and reused by the step's later microbatches while `weight` stays
  /// gathered; FullyShard drops it whenever it gathers or frees the unit. Undefined otherwise.
  mutable kernels::Float8Tensor weight_transposed;
};

/// y = x W^T with every GEMM in float8 (the forward's, and in backward the input gradient's and
/// the weight gradient's), by `how`: x per row (rowwise) or per tensor in e4m3fn, W per row in
/// e4m3fn (or `how.weight`), in the compute dtype (autocast's, else x's). Backward quantises the
/// output gradient (e4m3fn rowwise, e5m2 tensorwise) along each product's contracted dimension and
/// uses the forward's float8 weight as it is, transposed (per row, W's row scales multiply the
/// gradient's columns before its rows are quantised for dx = g W); it keeps the float8 weight and
/// x^T in float8 for backward, not x. Under a recording d9d::WeightGradQueue the weight-gradient
/// GEMM is deferred like Linear's. d9d/kernels/float8.hpp defines the quantisation.
at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& weight, const Float8Linear& how);

/// y = x W^T (+ b), with split backward under a recording d9d::WeightGradQueue. The same
/// parameter names ("weight", "bias") and initialisation as torch::nn::Linear. With an adapter,
/// y = x W^T (+ b) + adapter->forward(x); by low_rank_linear when the adapter is a low-rank
/// update, the layer has no bias and the fused kernels are on (fused_kernels()).
class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias = false);
  /// x [..., in] -> [..., out]; under autocast computes in the autocast dtype like at::linear.
  at::Tensor forward(const at::Tensor& x);
  [[nodiscard]] int64_t in_features() const { return weight.size(1); }
  [[nodiscard]] int64_t out_features() const { return weight.size(0); }
  at::Tensor weight;  ///< [out, in]
  at::Tensor bias;    ///< [out], or undefined
  /// Set by d9d::peft (LoRA); null for a plain linear layer.
  std::shared_ptr<LinearAdapter> adapter;
  /// Set by d9d::precision::Float8: the GEMMs run in float8 (float8_linear; a bias and an
  /// adapter's addition are added in the compute dtype).
  std::optional<Float8Linear> float8;
};
TORCH_MODULE(Linear);

/// The outputs x W_i^T of linear layers that read one input x (attention's q, k and v
/// projections; the feed-forward's gate and up), in the layers' order, each [..., out_i]. When
/// every layer is plain (no bias, adapter or float8) and the fused kernels are on
/// (fused_kernels()), one autograd node computes them: its backward sums x's gradient in one chain
/// of GEMMs (g_1 W_1, then + g_i W_i accumulated by the next GEMM: no separate additions) and
/// computes the weight gradients, or queues them as one job under a deferring
/// d9d::WeightGradQueue, as Linear's. When every layer instead has a low-rank adapter of one scale
/// (LoRA; no bias or float8), one node adds x W_i^T + s (x A_i^T) B_i^T with the A factors stacked
/// (x read once for all the adapters' products) and x's gradient in one chain the same way.
/// Otherwise each layer's forward(x). Under autocast computes in the autocast dtype like Linear.
[[nodiscard]] std::vector<at::Tensor> fan_out_linear(const at::Tensor& x,
                                                     std::initializer_list<LinearImpl*> layers);

/// fan_out_linear of `group.copy_in(x)`: the layers of a column-parallel block under tensor
/// parallelism. Under sequence parallelism (x is this rank's shard of the tokens) with plain
/// layers and the fused kernels on, one autograd node overlaps the collectives with the GEMMs: in
/// forward it multiplies this rank's own tokens while the others' are gathered, then theirs; in
/// backward it starts the input gradient's reduce-scatter as soon as that gradient is summed and
/// computes the weight gradients meanwhile (queued instead under a deferring
/// d9d::WeightGradQueue, as fan_out_linear's). The outputs are [B, T, out_i] as fan_out_linear's
/// of the gathered input; the values are the same products.
[[nodiscard]] std::vector<at::Tensor> fan_out_linear_gathered(
    const at::Tensor& x, std::initializer_list<LinearImpl*> layers,
    const TensorParallelGroup& group);

/// group.reduce_out(layer(h)): a row-parallel projection under tensor parallelism. Under sequence
/// parallelism with a plain layer and the fused kernels on, one autograd node overlaps the
/// collectives with the GEMMs: forward reduce-scatters each half of the ranks' rows while the
/// next half is multiplied; backward multiplies this rank's rows of the output gradient while the
/// others' are gathered. Returns this rank's shard [B, T / size, out] as reduce_out does.
[[nodiscard]] at::Tensor linear_scattered(const at::Tensor& h, LinearImpl& layer,
                                          const TensorParallelGroup& group);

/// Rotary position embedding (the half-split "rotate_half" layout), applied by the d9d::rope op.
class RotaryEmbedding {
 public:
  RotaryEmbedding(int64_t head_dim, double theta);
  /// The half tables: cos and sin of position t times theta^(-2i/head_dim), each
  /// [seq_len, head_dim / 2], in `dtype` (float32, or float64 for float64 models) on `device`.
  [[nodiscard]] std::pair<at::Tensor, at::Tensor> cos_sin(int64_t seq_len, c10::Device device,
                                                          at::ScalarType dtype = at::kFloat) const;
  /// The tables' dtype for activations of `activations` (float64 stays float64, else float32).
  [[nodiscard]] static at::ScalarType table_dtype(at::ScalarType activations);
  /// The half tables at given positions: `positions` [B, T] (int64, >= 0) -> cos and sin, each
  /// [B * T, head_dim / 2], row b * T + t at positions[b][t] (for apply_per_token).
  [[nodiscard]] std::pair<at::Tensor, at::Tensor> cos_sin_at(
      const at::Tensor& positions, at::ScalarType dtype = at::kFloat) const;
  /// Rotates x [B, T, heads, head_dim] by the tables (d9d::kernels::rope, with autograd).
  [[nodiscard]] static at::Tensor apply(const at::Tensor& x, const at::Tensor& cos,
                                        const at::Tensor& sin);
  /// Rotates x [B, T, heads, head_dim] by per-token tables [B * T, head_dim / 2] (cos_sin_at):
  /// the same kernel over x seen as one sequence of B * T positions.
  [[nodiscard]] static at::Tensor apply_per_token(const at::Tensor& x, const at::Tensor& cos,
                                                  const at::Tensor& sin);

 private:
  int64_t head_dim_;
  double theta_;
};

struct AttentionOptions {
  int64_t hidden_size = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  bool qk_norm = true;
};

/// Where the tokens of one forward sit when they are not one causal sequence per row starting at
/// position 0: decoding after cached tokens, left-padded batches, packed documents.
/// d9d::model::place_tokens builds one from positions and a key mask.
struct TokenPlacement {
  /// The rotary tables at every token's position, [B * T, head_dim / 2] each
  /// (RotaryEmbedding::cos_sin_at).
  at::Tensor cos, sin;
  /// [B, 1, T, past + T] bool: whether query t may attend key s (the `past` cached keys first).
  /// Every query must see at least one key. Undefined: causal, which needs past == 0. Under
  /// context parallelism the rows are this rank's tokens and the columns every token of the
  /// sequence: [B, 1, T / cp, T] (d9d/model/context_parallel.hpp).
  at::Tensor visible;
  /// Keys already in the KV cache before these tokens (0 without a cache).
  int64_t past = 0;
};

/// One attention layer's cached keys and values, [B, kv_heads, capacity, head_dim] each; the
/// first `past` positions hold the tokens seen so far (TokenPlacement::past).
struct KvCacheLayer {
  at::Tensor keys, values;
};

/// The keys and values of every layer of a model, for incremental decoding: `length` positions
/// of `capacity` are filled. Built by the model (Qwen3ForCausalLMImpl::make_cache); a forward
/// with it writes its tokens' keys and values at [length, length + T) of each layer, and the
/// caller advances `length` by T after it.
struct KvCache {
  std::vector<KvCacheLayer> layers;
  int64_t length = 0;
  int64_t capacity = 0;
};

/// The placement of tokens [B, T] that follow `past` cached ones: `positions` [B, T] (int64) give
/// the rotary angles, `key_valid` [B, past + T] (bool) which keys exist (false: padding), and a
/// query sees the valid keys at or before its own slot, and always itself (so padding queries see
/// something; their outputs are meaningless and ignored). Tables in `table_dtype`.
[[nodiscard]] TokenPlacement place_tokens(const RotaryEmbedding& rope, const at::Tensor& positions,
                                          const at::Tensor& key_valid, int64_t past,
                                          at::ScalarType table_dtype = at::kFloat);

/// The placement of packed documents: `document_ids` [B, T] (int64) numbers the documents of each
/// row (equal ids are one document, which must be contiguous); positions restart at 0 with each
/// document and a query sees only earlier tokens of its own document, so the row computes what
/// separate forwards of its documents would.
[[nodiscard]] TokenPlacement place_documents(const RotaryEmbedding& rope,
                                             const at::Tensor& document_ids,
                                             at::ScalarType table_dtype = at::kFloat);

/// Causal grouped-query attention with per-head QK RMSNorm and rotary embeddings, computed by
/// at::scaled_dot_product_attention (flash / cuDNN kernels on GPU).
class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const AttentionOptions& options);
  /// x: [B, T, hidden]; cos_sin from RotaryEmbedding::cos_sin(T, ...).
  at::Tensor forward(const at::Tensor& x, const std::pair<at::Tensor, at::Tensor>& cos_sin);
  /// x: [B, T, hidden] placed by `where` (per-token rotary tables, which keys each query sees);
  /// with `cache`, these tokens' keys and values are written at [where.past, where.past + T) of
  /// it and the queries attend over its first where.past + T positions.
  /// (Not an overload of forward: ModuleHolder's call operator needs a single forward.)
  at::Tensor forward_placed(const at::Tensor& x, const TokenPlacement& where, KvCacheLayer* cache);
  /// Tensor parallelism over `group` (d9d::parallel::TensorParallel): the caller has narrowed
  /// q/k/v_proj to this rank's num_heads / size query and num_kv_heads / size KV heads (rows) and
  /// o_proj to the matching columns; the input then passes through group->copy_in (with the q/k/v
  /// projections: fan_out_linear_gathered) and the output through group->reduce_out. The
  /// per-head q/k norms stay whole (replicated).
  void set_tensor_parallel(std::shared_ptr<const TensorParallelGroup> group);
  /// Context parallelism over `group` (d9d::parallel::ContextParallel): from now on the module
  /// runs only placed tokens (forward_placed, without a KV cache) — this rank's chunks of each
  /// sequence — and attends over every rank's keys (d9d::model::context_attention).
  void set_context_parallel(std::shared_ptr<const ContextParallelGroup> group);
  /// The query and KV heads this module computes (all of them without tensor parallelism).
  [[nodiscard]] int64_t local_heads() const { return options_.num_heads; }
  [[nodiscard]] int64_t local_kv_heads() const { return options_.num_kv_heads; }

  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RmsNorm q_norm{nullptr}, k_norm{nullptr};

 private:
  at::Tensor forward_heads(const at::Tensor& x, const std::pair<at::Tensor, at::Tensor>& cos_sin);
  at::Tensor placed_heads(const at::Tensor& x, const TokenPlacement& where, KvCacheLayer* cache);
  /// q and k [B, T, heads, dim] (normed, not rotated) and v [B, kv_heads, T, dim]; under tensor
  /// parallelism x is the input before copy_in (T: the gathered tokens).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> project(const at::Tensor& x);
  /// o_proj of the heads' outputs [B, T, heads * dim]; under tensor parallelism through reduce_out
  /// (linear_scattered).
  at::Tensor output(const at::Tensor& attended);
  AttentionOptions options_;
  std::shared_ptr<const TensorParallelGroup> tp_;
  std::shared_ptr<const ContextParallelGroup> cp_;
};
TORCH_MODULE(Attention);

/// down(silu(gate) * up) = (silu(gate) * up) W^T by d9d::silu_mul and a GEMM, with autograd,
/// without keeping the product silu(gate) * up for backward: backward recomputes it from gate and
/// up (one more elementwise pass) for W's gradient. Under autocast computes in the autocast dtype;
/// under a recording d9d::WeightGradQueue its weight gradient can be deferred like Linear's.
at::Tensor silu_mul_linear(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& weight);

/// group.reduce_out(down(silu(gate) * up)): the feed-forward's row-parallel down projection under
/// tensor parallelism. Under sequence parallelism with a plain layer and the fused kernels on, one
/// autograd node computes silu(gate) * up, overlaps the collectives with the GEMMs as
/// linear_scattered does, and recomputes the product in backward instead of keeping it (as
/// silu_mul_linear). Returns this rank's shard [B, T / size, out] as reduce_out does.
[[nodiscard]] at::Tensor silu_mul_linear_scattered(const at::Tensor& gate, const at::Tensor& up,
                                                   LinearImpl& layer,
                                                   const TensorParallelGroup& group);

/// SwiGLU feed-forward: down(silu(gate(x)) * up(x)), the activation by the d9d::silu_mul op. With
/// the fused kernels on and a down projection without a bias, plain (silu_mul_linear) or with a
/// low-rank adapter (LoRA without active dropout: the same node with low_rank_linear's GEMMs), the
/// activation is not kept for backward: backward recomputes it from gate and up.
class SwiGluImpl : public torch::nn::Module {
 public:
  SwiGluImpl(int64_t hidden_size, int64_t intermediate_size);
  at::Tensor forward(const at::Tensor& x);
  /// Tensor parallelism over `group`: the caller has narrowed gate/up_proj to this rank's rows of
  /// the intermediate dimension and down_proj to the matching columns (column- then row-parallel).
  void set_tensor_parallel(std::shared_ptr<const TensorParallelGroup> group);

  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};

 private:
  std::shared_ptr<const TensorParallelGroup> tp_;
};
TORCH_MODULE(SwiGlu);

}  // namespace d9d::model
