// d9d/model/moe.hpp — a mixture-of-experts layer: router, grouped experts, optional shared expert,
// and the load-balancing machinery (auxiliary loss, auxiliary-loss-free expert bias, statistics).
//
//   d9d::model::MoeLayer moe(d9d::model::MoeOptions{.hidden_size = 1024, .num_experts = 64,
//                                                   .top_k = 8, .intermediate_size = 256});
//   auto stats = std::make_shared<d9d::model::MoeForwardStats>(/*aux_loss_coef=*/1e-3);
//   at::Tensor y = moe(x, stats);   // [B, T, H] -> [B, T, H]; then stats->finish() after the pass
//
// Routing (Qwen3-MoE / Mixtral): probabilities = softmax of the router logits in at least float32;
// each token goes to its top-k experts, weighted by their probabilities, renormalised to sum to one
// when norm_topk_prob. Dropless by default; with a capacity factor c > 0 each expert takes at most
// ceil(c * tokens * k / E) of a forward's (token, expert) routings, the first in token order, and
// drops the rest: a dropped routing adds nothing to its token's output (the residual carries the
// token), its weight is not given to the token's other experts, and it still counts in the load,
// the auxiliary loss and the bias update (they balance what the router chose). With the
// auxiliary-loss-free balancing (bias_update_rate > 0, DeepSeek-V3's idea) a per-expert bias is
// added to the router logits for the selection only (the weights stay the probabilities); after
// each optimizer step it moves towards the mean load: bias += rate * sign(mean load - load)
// (DeepSeek-V3's rule), or bias += rate * (mean load - load) / mean load
// (MoeBiasRule::proportional). The bias acts on logits, not on the probabilities (where
// DeepSeek-V3's sigmoid scores would put it): a softmax over many experts squeezes the unchosen
// experts' probabilities to nearly the same tiny value for every token, so a bias there picks the
// same experts for all tokens and the load jumps from one group of experts to the next instead of
// spreading (design 0009, "Balancing"). Tokens are sorted by expert (permute), each projection is
// one grouped GEMM over the experts' segments (at::_grouped_mm on CUDA, a loop over the segments
// elsewhere), and the outputs are weighted and summed back per token (un-permute).
//
// The auxiliary loss (MoeAuxLoss::global_batch, the default) is transformers'
// load_balancing_loss_func over every MoE layer of one forward pass (of a model, or of a pipeline
// stage): aux = E * sum_e f_e * P_e, with f_e the fraction of the pass's (token, layer) routings
// that chose expert e (summed over the top k) and P_e the mean router probability of e. f is
// summed over the data-parallel ranks when the layers have a load group (global-batch statistics;
// the parallelize layer sets it), P stays local and carries the gradient. MoeAuxLoss::sequence is
// DeepSeek-V3's sequence-wise balance loss instead: per layer l and per sequence b (a row of the
// layer's [..., T, hidden] input; under context parallelism the rank's part of the row), with
// f_lbe = E / (k T) * (routings of row b to e) and P_lbe the mean probability of e over row b,
//   aux = (1 / L) sum_l (1 / B) sum_b sum_e f_lbe * P_lbe        (1 where routing is uniform),
// no statistics shared between ranks. The loss is not added to the task's loss: each MoE layer's
// output carries an autograd node that adds d(coef * aux * tokens)/d(router probabilities) in
// backward, so the gradient is that of sum(cross-entropy) + coef * aux * tokens (the trainer
// divides by the tokens), and it works unchanged under recompute, FullyShard, pipelines and
// expert parallelism.
//
// Expert parallelism plugs in through ExpertDispatcher (d9d::parallel::ExpertParallel sets one):
// the layer hands it the sorted rows and the rows per expert, and it runs the local experts on the
// rows every rank sends them.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <d9d/core/process_group.hpp>
#include <d9d/model/layers.hpp>

namespace d9d::model {

class TensorParallelGroup;  // d9d/model/tensor_parallel.hpp

/// The auxiliary-loss-free balancing's update of the selection bias, per expert e with load l_e
/// (routings in the step) and mean load m: `sign` adds rate * sign(m - l_e) (DeepSeek-V3);
/// `proportional` adds rate * (m - l_e) / m, which moves the overloaded experts as far as they are
/// off and settles closer (measured on a collapsed router: design 0009, "Balancing").
enum class MoeBiasRule { sign, proportional };

/// Which auxiliary loss MoeForwardStats gives the routers (see the file comment): transformers'
/// over the pass's routings (f summed over the load group), or DeepSeek-V3's sequence-wise one.
enum class MoeAuxLoss { global_batch, sequence };

/// The shape and the routing rules of one MoE layer.
struct MoeOptions {
  int64_t hidden_size = 0;
  int64_t num_experts = 0;
  int64_t top_k = 0;              ///< experts per token (num_experts_per_tok)
  int64_t intermediate_size = 0;  ///< of each expert (moe_intermediate_size)
  bool norm_topk_prob = false;    ///< renormalise the top-k probabilities to sum to one
  /// The Qwen2-MoE shared expert (a SwiGLU every token goes through, scaled by a sigmoid gate);
  /// 0: none.
  int64_t shared_expert_intermediate_size = 0;
  /// Auxiliary-loss-free balancing: the rate of the per-expert selection bias; 0: no bias.
  double bias_update_rate = 0.0;
  /// How the bias moves after each step (see the file comment).
  MoeBiasRule bias_update_rule = MoeBiasRule::sign;
  /// Token dropping: each expert takes at most ceil(capacity_factor * tokens * top_k /
  /// num_experts) routings of a forward (the first in token order); 0: dropless.
  double capacity_factor = 0.0;
};

/// The routings (token, slot) an expert capacity keeps: `sorted_experts` are the chosen experts
/// sorted (stably) by expert, `counts` [E] the routings per expert; a routing is kept when its
/// place within its expert's run is below `capacity` (< 0: every one). Returns a bool mask over
/// the sorted routings.
at::Tensor within_capacity(const at::Tensor& sorted_experts, const at::Tensor& counts,
                           int64_t capacity);

/// The capacity of each expert for `tokens` tokens of a forward: ceil(factor * tokens * k / E), or
/// -1 (unbounded) for a factor of 0.
int64_t expert_capacity(const MoeOptions& options, int64_t tokens);

/// How GroupedExperts multiplies its segments.
enum class GroupedGemm {
  automatic,   ///< at::_grouped_mm on CUDA for bfloat16, else the loop
  loop,        ///< one at::linear per expert segment (any device and dtype)
  grouped_mm,  ///< at::_grouped_mm (CUDA: bf16; CPU fallback: float32 / bf16, 16-byte rows)
};

/// x [M, K] with its rows in groups of counts[g] rows (sum = M), w [G, N, K]: the rows of group g
/// times w[g]^T, [M, N]. Differentiable in x and w (empty groups get zero weight gradients).
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w,
                          const std::vector<int64_t>& counts,
                          GroupedGemm how = GroupedGemm::automatic);

/// `values` as a tensor of `dtype` (int64 or int32) on `device`. To a CUDA device it is copied
/// from pinned host memory without making the host wait (ordered on the current stream), where a
/// copy from ordinary host memory would synchronise; elsewhere a plain copy.
at::Tensor host_index_tensor(const std::vector<int64_t>& values, const c10::Device& device,
                             at::ScalarType dtype = at::kLong);

/// What expert parallelism does with a layer's sorted rows (d9d::parallel::ExpertParallel).
class ExpertDispatcher {
 public:
  /// Runs `local` (the rank's experts) on rows [M, H] and their rows per local expert.
  using LocalExperts = std::function<at::Tensor(const at::Tensor&, const std::vector<int64_t>&)>;
  ExpertDispatcher() = default;
  virtual ~ExpertDispatcher() = default;
  ExpertDispatcher(const ExpertDispatcher&) = delete;
  ExpertDispatcher& operator=(const ExpertDispatcher&) = delete;
  ExpertDispatcher(ExpertDispatcher&&) = delete;
  ExpertDispatcher& operator=(ExpertDispatcher&&) = delete;
  /// `rows` [M, H] are sorted by global expert, counts[e] of them for expert e (`counts` [E]
  /// int64, on the rows' device or the host: the dispatcher reads it to the host together with
  /// what it exchanges, so the layer need not). Returns each row's expert output, in the order of
  /// `rows` (differentiable).
  virtual at::Tensor dispatch(const at::Tensor& rows, const at::Tensor& counts,
                              const LocalExperts& local) = 0;
};

/// Routing statistics of one forward pass (a model's or a pipeline stage's), shared by its MoE
/// layers: what the auxiliary loss needs, and the pass's loads. Created per pass; finish() after
/// the pass's last MoE layer (collective over the layers' load group when there is one).
class MoeForwardStats {
 public:
  /// `aux_loss_coef` 0: no auxiliary-loss gradient.
  explicit MoeForwardStats(double aux_loss_coef = 0.0, MoeAuxLoss kind = MoeAuxLoss::global_batch);
  /// A layer's routing of this pass: counts (int64) routings per expert, the summed router
  /// probabilities (detached), the tokens routed — [E] each for MoeAuxLoss::global_batch, [B, E]
  /// per sequence for MoeAuxLoss::sequence. False when the layer has been recorded already (the
  /// recomputation of a recomputed block). `group`: where f is summed (may be invalid).
  bool record(int64_t layer, const at::Tensor& counts, const at::Tensor& probability_sum,
              int64_t tokens, const ProcessGroup& group);
  /// Computes f (all-reduced over the group) and the auxiliary loss and fills the gradient that
  /// the layers' backward adds. Idempotent.
  void finish();
  [[nodiscard]] double aux_loss_coef() const { return coef_; }
  [[nodiscard]] MoeAuxLoss aux_loss_kind() const { return kind_; }
  /// The aux loss of this pass (global_batch: f over the group, P of this rank); 0 before
  /// finish().
  [[nodiscard]] double aux_loss() const { return aux_; }
  /// MoE layers recorded in this pass.
  [[nodiscard]] int64_t layers() const { return static_cast<int64_t>(layers_.size()); }
  /// d(coef * aux * tokens)/d(summed probabilities of `layer`), shaped as that layer recorded them
  /// (float32 or float64): coef * E * f / layers (global_batch, the same for every layer) or
  /// coef * f_lbe / layers (sequence). Filled by finish(); the layers' autograd nodes read it in
  /// backward. Undefined for a layer not recorded.
  [[nodiscard]] at::Tensor aux_gradient(int64_t layer) const;
  /// The tensor aux_gradient(layer) will be, created when the layer records (internal).
  at::Tensor gradient_holder(int64_t layer, const at::Tensor& like);

 private:
  struct Layer {
    int64_t index = 0;
    at::Tensor counts;
    at::Tensor probability_sum;
    int64_t tokens = 0;
    at::Tensor gradient;  // the holder its autograd node reads
  };
  void finish_global_batch();
  void finish_sequence();
  Layer* find(int64_t layer);
  double coef_;
  MoeAuxLoss kind_;
  double aux_ = 0.0;
  bool finished_ = false;
  std::vector<Layer> layers_;
  ProcessGroup group_;
};

/// The router ("gate" in Hugging Face's names): weight [num_experts, hidden] and, with the
/// auxiliary-loss-free balancing, the buffer expert_bias [num_experts].
class MoeRouterImpl : public torch::nn::Module {
 public:
  explicit MoeRouterImpl(const MoeOptions& options);
  struct Routing {
    at::Tensor probabilities;  ///< [N, E], at least float32
    at::Tensor experts;        ///< [N, k] int64, the chosen experts
    at::Tensor weights;        ///< [N, k], their weights (probabilities, renormalised if asked)
  };
  /// x [N, hidden].
  Routing forward(const at::Tensor& x);
  /// Moves the bias by the options' rule (MoeBiasRule). `load` [E]: routings per expert.
  void update_bias(const at::Tensor& load);
  [[nodiscard]] const MoeOptions& options() const { return options_; }

  at::Tensor weight;       ///< [E, H]
  at::Tensor expert_bias;  ///< [E] (float32), undefined without bias balancing

 private:
  MoeOptions options_;
};
TORCH_MODULE(MoeRouter);

/// What a parameter-efficient method adds to one stacked projection of GroupedExperts
/// (d9d/peft/lora.hpp: LoRA on experts): to the rows of expert e, scale (x A_e^T) B_e^T, with the
/// factors stacked over the experts, A [E, rank, in] and B [E, out, rank] (this rank's experts
/// under expert parallelism). The factors are parameters of the experts module, so they are
/// named after the projection ("...experts.gate_proj_lora_A") and sharded with the experts.
class GroupedAdapter {
 public:
  GroupedAdapter() = default;
  virtual ~GroupedAdapter() = default;
  GroupedAdapter(const GroupedAdapter&) = delete;
  GroupedAdapter& operator=(const GroupedAdapter&) = delete;
  GroupedAdapter(GroupedAdapter&&) = delete;
  GroupedAdapter& operator=(GroupedAdapter&&) = delete;
  /// The stacked factors, or undefined ones for no addition (e.g. while merged into the weight).
  [[nodiscard]] virtual LowRankUpdate low_rank() const = 0;
};

/// The routed experts, stacked: gate_proj, up_proj [E, I, H], down_proj [E, H, I] (Hugging Face
/// stores them per expert as mlp.experts.<e>.gate_proj.weight, ...). Under expert parallelism
/// each rank holds experts [first_expert(), first_expert() + local_experts()).
class GroupedExpertsImpl : public torch::nn::Module {
 public:
  /// The stacked projections' names, in the order of `adapters`.
  static constexpr std::array<std::string_view, 3> projections = {"gate_proj", "up_proj",
                                                                  "down_proj"};

  explicit GroupedExpertsImpl(const MoeOptions& options);
  /// Rows sorted by local expert, counts[e] for local expert e: SwiGLU of each row by its expert.
  at::Tensor forward(const at::Tensor& rows, const std::vector<int64_t>& counts);
  /// Every row of `rows` (sorted by global expert, `counts` [E] int64 per global expert, on any
  /// device) through its expert: locally (the counts read to the host: one synchronisation), or
  /// through the dispatcher under expert parallelism (which reads them with its own exchange).
  at::Tensor run(const at::Tensor& rows, const at::Tensor& counts);

  [[nodiscard]] int64_t num_experts() const { return options_.num_experts; }
  [[nodiscard]] int64_t local_experts() const { return gate_proj.size(0); }
  [[nodiscard]] int64_t first_expert() const { return first_expert_; }
  /// Expert parallelism: the weights hold experts [first, first + count) (set by the strategy
  /// after it sliced them) and rows go through `dispatcher`.
  void set_expert_parallel(int64_t first, std::shared_ptr<ExpertDispatcher> dispatcher);

  /// The stacked weight of projections[index].
  [[nodiscard]] at::Tensor& projection(std::size_t index);
  /// The index in `projections` of `name`, or projections.size() for another name.
  [[nodiscard]] static std::size_t projection_index(std::string_view name);

  at::Tensor gate_proj, up_proj, down_proj;
  GroupedGemm gemm = GroupedGemm::automatic;
  /// Set by d9d::peft (LoRA on experts): the additions to gate_proj, up_proj and down_proj (the
  /// order of `projections`); null for none.
  std::array<std::shared_ptr<GroupedAdapter>, 3> adapters{};

 private:
  MoeOptions options_;
  int64_t first_expert_ = 0;
  std::shared_ptr<ExpertDispatcher> dispatcher_;
};
TORCH_MODULE(GroupedExperts);

/// Routing statistics a layer keeps for logging and the bias update.
struct RouterLoad {
  at::Tensor routed;  ///< [E] float64: routings per expert since the last take_load()
  int64_t tokens = 0;
  int64_t dropped = 0;  ///< routings an expert capacity dropped (MoeOptions::capacity_factor)
};

/// The sparse MLP block: children "gate" (MoeRouter), "experts" (GroupedExperts) and, with a
/// shared expert, "shared_expert" (SwiGlu) and "shared_expert_gate" (Linear hidden -> 1).
class MoeLayerImpl : public torch::nn::Module {
 public:
  MoeLayerImpl(const MoeOptions& options, int64_t layer_index);
  /// x [..., hidden]. `stats` (may be null) records the routing and, when its coefficient is > 0
  /// and gradients are recorded, attaches the auxiliary loss's gradient to the output.
  at::Tensor forward(const at::Tensor& x, const std::shared_ptr<MoeForwardStats>& stats = nullptr);

  /// Routings per expert accumulated over the training forward passes since the last call (each
  /// pass counted once, also under recompute), then reset.
  RouterLoad take_load();
  /// The data-parallel group over which the auxiliary loss's f is summed (global-batch
  /// statistics); set by the parallelize layer.
  void set_load_group(ProcessGroup group) { load_group_ = std::move(group); }
  /// Under tensor parallelism (d9d::parallel::TensorParallel sets it) the layer splits its work
  /// over the tp ranks by tokens, not by weights: each rank routes and runs its part of the
  /// sequence (TensorParallelGroup::split_sequence before, gather_sequence after; under sequence
  /// parallelism the part it already holds), so the router, the shared expert and the experts
  /// stay whole (or ExpertParallel's) and their gradients are partial sums over tp.
  void set_tensor_parallel(std::shared_ptr<const TensorParallelGroup> group);
  [[nodiscard]] int64_t layer_index() const { return layer_index_; }
  /// The statistics of the last forward pass this layer recorded into (null before any).
  [[nodiscard]] std::shared_ptr<MoeForwardStats> last_stats() const { return last_stats_; }
  [[nodiscard]] const MoeOptions& options() const { return options_; }

  MoeRouter gate{nullptr};
  GroupedExperts experts{nullptr};
  SwiGlu shared_expert{nullptr};
  Linear shared_expert_gate{nullptr};

 private:
  // The layer on the tokens this rank routes (all of them without tensor parallelism).
  at::Tensor forward_tokens(const at::Tensor& x, const std::shared_ptr<MoeForwardStats>& stats);

  MoeOptions options_;
  std::shared_ptr<const TensorParallelGroup> tp_;
  int64_t layer_index_;
  ProcessGroup load_group_;
  std::shared_ptr<MoeForwardStats> last_stats_;
  at::Tensor routed_;  // [E] float64
  int64_t tokens_ = 0;
  int64_t dropped_ = 0;
};
TORCH_MODULE(MoeLayer);

/// transformers' load_balancing_loss_func written out, for tests and reports: `probabilities`
/// [N, E] of every (layer, token) of a pass, `experts` [N, k] the chosen experts.
at::Tensor load_balancing_loss(const at::Tensor& probabilities, const at::Tensor& experts,
                               int64_t num_experts);

/// The MoE layers of a module tree (in named_modules order).
std::vector<std::shared_ptr<MoeLayerImpl>> moe_layers(const torch::nn::Module& module);

}  // namespace d9d::model
