// d9d/parallel/tensor_parallel.cpp — TensorParallel: attention by heads, SwiGLU by its
// intermediate dimension, embedding and LM head by vocabulary over the regular domain's tp ranks
// (Megatron's layout), with the loss-parallel cross-entropy.
//
// Layout (tp ranks R, this rank r; every split even, checked first):
//   q/k/v_proj.weight [heads·d, H]   Shard(0): rows of query heads [r h/R, (r+1) h/R) and KV heads
//                                    [r kv/R, (r+1) kv/R) (GQA groups stay on one rank)
//   o_proj.weight [H, heads·d]       Shard(1): the matching columns
//   gate/up_proj.weight [I, H]       Shard(0);  down_proj.weight [H, I]  Shard(1)
//   embed_tokens / lm_head [V, H]    Shard(0): ids [r V/R, (r+1) V/R) (tied: one tensor)
//   norms (incl. per-head q/k norms) Replicate
//   LoRA on a column-parallel layer  lora_B [out, r] Shard(0) like the weight, lora_A Replicate
//   LoRA on a row-parallel layer     lora_A [r, in] Shard(1) like the weight, lora_B Replicate
// Communication (autograd functions below): "f" (identity, all-reduce of the gradient) before each
// column-parallel block, "g" (all-reduce, identity backward) after each row-parallel one and after
// the vocab-parallel embedding. So the residual stream and its gradient are whole and identical on
// every tp rank, and with them the gradients of the layer norms. The q/k norms act on this rank's
// heads only: their gradients are partial sums and are summed over tp after the backward, as are
// the gradients of the adapters' whole factors (derived where the adapters are split).
// Sequence parallelism (TensorParallel<SequenceParallel::on>) swaps the pair for an all-gather
// of the tokens (backward: reduce-scatter) and a reduce-scatter (backward: all-gather): between
// the blocks each rank holds B T / R of the microbatch's tokens (GatherSequence below says which),
// so every norm's gradient is partial and summed over tp. FullyShard, applied later, shards these
// shards over dp_shard (src/parallel/fully_shard.cpp).
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <d9d/core/collectives.hpp>
#include <d9d/model/layers.hpp>
#include <d9d/model/moe.hpp>
#include <d9d/model/tensor_parallel.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/peft/lora.hpp>
#include <d9d/train/config.hpp>

namespace d9d::parallel::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// NOLINTBEGIN(performance-no-int-to-ptr): the group outlives the model's graphs (the model holds
// it)
const ProcessGroup& group_at(int64_t address) {
  return *reinterpret_cast<const ProcessGroup*>(address);
}
int64_t address_of(const ProcessGroup& group) { return reinterpret_cast<int64_t>(&group); }
// NOLINTEND(performance-no-int-to-ptr)

// f: identity forward, gradient summed over the group.
struct CopyIn : torch::autograd::Function<CopyIn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& group = group_at(ctx->saved_data["group"].toInt());
    return {all_reduce(group, grads[0].contiguous()), at::Tensor()};
  }
};

// g: sum over the group forward, identity backward.
struct ReduceOut : torch::autograd::Function<ReduceOut> {
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& x, int64_t group) {
    return all_reduce(group_at(group), x.contiguous());
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// Sequence parallelism's shards are rows of the microbatch's tokens taken as one sequence of
// B·T rows (row b T + t is token t of sequence b): rank r holds rows [r B T / tp, (r + 1) B T /
// tp), shaped [B, T / tp, ...] so that the code between the blocks keeps its shapes (only per-token
// work runs there: norms, residual additions, a MoE layer's routing). The gather and the scatter
// are then along the contiguous rows, views of the collective's buffer, where shards of each
// sequence (dim 1) would need a copy of the whole [B, T, ...] around every collective when B > 1.
at::Tensor token_rows(const at::Tensor& x) { return x.contiguous().flatten(0, 1); }

// Rows [B·T', ...] back as [B, T', ...].
at::Tensor batch_of(const at::Tensor& rows, int64_t batch) {
  auto sizes = rows.sizes().vec();
  sizes[0] /= batch;
  sizes.insert(sizes.begin(), batch);
  return rows.view(sizes);
}

// Sequence parallelism's f: the shards [B, T / tp, ...] gathered into [B, T, ...] in forward; the
// gradient summed over the group and scattered back to the shards in backward.
struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return batch_of(all_gather_cat(group_at(group), token_rows(x), 0), x.size(0));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& group = group_at(ctx->saved_data["group"].toInt());
    return {batch_of(reduce_scatter(group, token_rows(grads[0]), 0), grads[0].size(0)),
            at::Tensor()};
  }
};

// Sequence parallelism's g: the partial outputs [B, T, ...] summed over the group and scattered
// to the shards [B, T / tp, ...] in forward; the gradient's shards gathered in backward.
struct ScatterSequence : torch::autograd::Function<ScatterSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    const auto& g = group_at(group);
    if (x.dim() < 2 || x.size(1) % g.size() != 0) {
      throw std::invalid_argument(
          "d9d::parallel::TensorParallel<SequenceParallel::on>: sequence parallelism splits the "
          "sequence over "
          "tp = " +
          std::to_string(g.size()) + " ranks, but it has " +
          std::to_string(x.dim() < 2 ? 0 : x.size(1)) +
          " tokens. Fix: set \"batch.sequence_length\" to a multiple of " +
          std::to_string(g.size()));
    }
    ctx->saved_data["group"] = group;
    return batch_of(reduce_scatter(g, token_rows(x), 0), x.size(0));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& group = group_at(ctx->saved_data["group"].toInt());
    return {batch_of(all_gather_cat(group, token_rows(grads[0]), 0), grads[0].size(0)),
            at::Tensor()};
  }
};

// The tokens split over the group for a layer that divides its work by tokens (a MoE layer):
// this rank's part of dim 1 in forward, the parts' gradients gathered along dim 1 in backward.
struct SplitSequence : torch::autograd::Function<SplitSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    const auto& g = group_at(group);
    if (x.dim() < 2 || x.size(1) % g.size() != 0) {
      throw std::invalid_argument(
          "d9d::parallel::TensorParallel: a mixture-of-experts layer splits its tokens over tp = " +
          std::to_string(g.size()) + " ranks, but the sequence has " +
          std::to_string(x.dim() < 2 ? 0 : x.size(1)) +
          " tokens. Fix: set \"batch.sequence_length\" to a multiple of " +
          std::to_string(g.size()));
    }
    ctx->saved_data["group"] = group;
    const int64_t part = x.size(1) / g.size();
    return x.narrow(1, part * g.rank(), part);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& group = group_at(ctx->saved_data["group"].toInt());
    return {all_gather_cat(group, grads[0].contiguous(), 1), at::Tensor()};
  }
};

// split_sequence's inverse: the parts gathered along dim 1; backward keeps this rank's part.
struct GatherSplitSequence : torch::autograd::Function<GatherSplitSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    const auto& g = group_at(group);
    ctx->saved_data["start"] = x.size(1) * g.rank();
    ctx->saved_data["length"] = x.size(1);
    return all_gather_cat(g, x.contiguous(), 1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t start = ctx->saved_data["start"].toInt();
    const int64_t length = ctx->saved_data["length"].toInt();
    return {grads[0].narrow(1, start, length).contiguous(), at::Tensor()};
  }
};

// Concatenation over the group along the last dimension; backward keeps this rank's slice.
struct GatherLast : torch::autograd::Function<GatherLast> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    const auto& g = group_at(group);
    ctx->saved_data["start"] = x.size(-1) * g.rank();
    ctx->saved_data["length"] = x.size(-1);
    return all_gather_cat(g, x.contiguous(), x.dim() - 1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t start = ctx->saved_data["start"].toInt();
    const int64_t length = ctx->saved_data["length"].toInt();
    return {grads[0].narrow(-1, start, length).contiguous(), at::Tensor()};
  }
};

// The loss-parallel cross-entropy (Megatron's vocab-parallel cross-entropy): per row, the maximum
// logit and the sum of exponentials are all-reduced over the group, the target's logit comes from
// the rank whose slice holds it. The gradient (softmax − one-hot over this rank's columns, zero on
// ignored rows) is computed in the forward and scaled by the incoming gradient in backward.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& labels, int64_t vocab_start, int64_t ignore_index,
                            int64_t group) {
    const auto& g = group_at(group);
    // At least float32 (bf16 logits are upcast; float64 stays float64), as causal_lm_loss: one
    // working copy of the logits that becomes the gradient in place (no second [N, V / tp]
    // temporary; the row maxima are exact in the logits' own dtype).
    const auto dtype = at::promote_types(logits.scalar_type(), at::kFloat);
    const int64_t columns = logits.size(1);
    const auto targets = labels.to(at::kLong);
    const auto row_max = all_reduce(g, std::get<0>(logits.max(1)).to(dtype), ReduceOp::max);
    auto shifted = logits.to(dtype, /*non_blocking=*/false, /*copy=*/true);
    shifted.sub_(row_max.unsqueeze(1));
    const auto valid = targets != ignore_index;
    const auto local = targets - vocab_start;
    const auto mine = valid.logical_and(local >= 0).logical_and(local < columns);
    const auto column = local.masked_fill(mine.logical_not(), 0).unsqueeze(1);
    const auto target_logit =
        shifted.gather(1, column).squeeze(1).masked_fill(mine.logical_not(), 0.0);
    auto exps = shifted.exp_();
    // One collective for both row statistics: [2, N] summed.
    const auto summed = all_reduce(g, at::stack({exps.sum(1), target_logit}));
    const auto sum_exp = summed[0];
    const auto rows = (sum_exp.log() - summed[1]).masked_fill(valid.logical_not(), 0.0);
    // softmax − one-hot on this rank's columns, zero on ignored rows.
    auto grad = exps.div_(sum_exp.unsqueeze(1));
    grad.scatter_add_(1, column, mine.to(grad.scalar_type()).neg().unsqueeze(1));
    grad.masked_fill_(valid.logical_not().unsqueeze(1), 0.0);
    ctx->saved_data["grad"] = grad;
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return rows.sum();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The saved softmax − one-hot is scaled in place and handed over (this node's only use of it),
    // then rounded once into the logits' dtype: no second working-size temporary beside it, which
    // under bf16 was the tensor-parallel step's peak (a float32 [N, V / tp] product).
    const auto saved = ctx->saved_data.find("grad");
    if (saved == ctx->saved_data.end()) {
      throw std::logic_error(
          "d9d::parallel: the loss-parallel cross-entropy's backward ran twice; its gradient is "
          "used up by the first (backward with retain_graph through this loss is not supported)");
    }
    auto grad = saved->second.toTensor();
    ctx->saved_data.erase(saved);
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.mul_(grads[0]).to(dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A collective of the group in flight (start_gather_tokens / start_scatter_tokens).
class Pending final : public model::PendingTokens {
 public:
  // The result goes to `device`, or is copied into `into` when that is defined.
  Pending(c10::intrusive_ptr<c10d::Work> work, at::Tensor result, at::Tensor input,
          c10::Device device, at::Tensor into = {})
      : work_(std::move(work)),
        result_(std::move(result)),
        input_(std::move(input)),
        into_(std::move(into)),
        device_(device) {}
  [[nodiscard]] at::Tensor wait() override {
    if (work_) {
      work_->wait();
      work_.reset();
      input_.reset();  // the backend has read it
    }
    if (into_.defined()) {
      if (!into_.is_same(result_)) {
        into_.copy_(result_);
      }
      return into_;
    }
    return result_.to(device_);
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor result_;
  at::Tensor input_;  // kept alive until the collective has read it
  at::Tensor into_;
  c10::Device device_;
};

// `rows` as the group's backend reads it: on its device, contiguous.
at::Tensor backend_rows(const ProcessGroup& group, const at::Tensor& rows, const char* who) {
  if (rows.dim() == 0) {
    throw std::invalid_argument(std::string("d9d::parallel::TensorParallel: ") + who +
                                " takes rows, not a scalar");
  }
  return rows.to(group.device()).contiguous();
}

class Group : public model::TensorParallelGroup {
 public:
  Group(ProcessGroup group, bool sequence_parallel)
      : group_(std::move(group)), sequence_parallel_(sequence_parallel) {}
  [[nodiscard]] int rank() const override { return group_.rank(); }
  [[nodiscard]] int size() const override { return group_.size(); }
  [[nodiscard]] at::Tensor copy_in(const at::Tensor& x) const override {
    return sequence_parallel_ ? GatherSequence::apply(x, address_of(group_))
                              : CopyIn::apply(x, address_of(group_));
  }
  [[nodiscard]] at::Tensor reduce_out(const at::Tensor& x) const override {
    return sequence_parallel_ ? ScatterSequence::apply(x, address_of(group_))
                              : ReduceOut::apply(x, address_of(group_));
  }
  [[nodiscard]] bool sequence_parallel() const override { return sequence_parallel_; }
  [[nodiscard]] at::Tensor split_sequence(const at::Tensor& x) const override {
    return SplitSequence::apply(x, address_of(group_));
  }
  [[nodiscard]] at::Tensor gather_sequence(const at::Tensor& x) const override {
    return GatherSplitSequence::apply(x, address_of(group_));
  }
  [[nodiscard]] std::unique_ptr<model::PendingTokens> start_gather_tokens(
      const at::Tensor& rows) const override {
    auto input = backend_rows(group_, rows, "start_gather_tokens");
    auto sizes = input.sizes().vec();
    sizes[0] *= group_.size();
    if (group_.size() <= 1) {
      return std::make_unique<Pending>(c10::intrusive_ptr<c10d::Work>(), input.clone(),
                                       at::Tensor(), rows.device());
    }
    auto output = at::empty(sizes, input.options());
    auto work = group_.backend()->_allgather_base(output, input);
    return std::make_unique<Pending>(std::move(work), std::move(output), std::move(input),
                                     rows.device());
  }
  [[nodiscard]] std::unique_ptr<model::PendingTokens> start_scatter_tokens(
      const at::Tensor& rows, const at::Tensor& into) const override {
    auto input = backend_rows(group_, rows, "start_scatter_tokens");
    const int64_t ranks = group_.size();
    if (input.size(0) % ranks != 0) {
      throw std::invalid_argument("d9d::parallel::TensorParallel: start_scatter_tokens got " +
                                  std::to_string(input.size(0)) + " rows for " +
                                  std::to_string(ranks) + " ranks");
    }
    auto sizes = input.sizes().vec();
    sizes[0] /= ranks;
    if (into.defined() &&
        (into.sizes() != at::IntArrayRef(sizes) || into.scalar_type() != input.scalar_type())) {
      throw std::invalid_argument(
          "d9d::parallel::TensorParallel: start_scatter_tokens writes into a tensor of the rows' "
          "dtype shaped as this rank's rows");
    }
    // The backend writes `into` itself when it can (contiguous, on the group's device); otherwise
    // the result is copied into it when waited for.
    const bool direct = into.defined() && into.device() == group_.device() && into.is_contiguous();
    if (ranks <= 1) {
      return std::make_unique<Pending>(c10::intrusive_ptr<c10d::Work>(), input.clone(),
                                       at::Tensor(), rows.device(), into);
    }
    auto output = direct ? into : at::empty(sizes, input.options());
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    auto work = group_.backend()->_reduce_scatter_base(output, input, options);
    return std::make_unique<Pending>(std::move(work), std::move(output), std::move(input),
                                     rows.device(), into);
  }
  [[nodiscard]] at::Tensor gather_last(const at::Tensor& x) const override {
    return GatherLast::apply(x, address_of(group_));
  }
  [[nodiscard]] at::Tensor cross_entropy_sum(const at::Tensor& local_logits,
                                             const at::Tensor& labels, int64_t vocab_start,
                                             int64_t ignore_index) const override {
    return VocabParallelCrossEntropy::apply(local_logits, labels, vocab_start, ignore_index,
                                            address_of(group_));
  }

 private:
  ProcessGroup group_;
  bool sequence_parallel_;
};

// The per-head q/k norms' gradients summed over tp after the step's backward (each rank's holds
// the contribution of its heads only). Runs after the data-parallel strategy's finish (added
// before it), on the records' locals as they are then: the whole parameters, or FullyShard's
// shards of them (equal rows on every tp rank).
class PartialNormSync : public GradientSync {
 public:
  PartialNormSync(ParallelModel& model, ProcessGroup group, std::vector<std::string> names)
      : model_(model), group_(std::move(group)), names_(std::move(names)) {}

  // Tensor parallelism adds no host code to a microbatch's forward and backward: its collectives
  // are the autograd functions above, each a NCCL call ordered on the device (the work's wait is
  // a stream wait), which a CUDA graph captures and replays like a kernel; this sum runs in
  // finish(), after the microbatches. (On the CPU the step refuses graphs for the device.)
  [[nodiscard]] std::string graph_blocker() const override { return ""; }

  void finish() override {
    if (group_.size() <= 1) {
      return;
    }
    std::vector<at::Tensor> grads;
    for (const auto& name : names_) {
      const auto* record = model_.find(name);
      // A parameter another strategy moved to another domain (ExpertParallel's experts) is
      // reduced there.
      if (record != nullptr && record->domain == MeshDomain::regular &&
          record->local.grad().defined()) {
        grads.push_back(at::Tensor(record->local).mutable_grad());
      }
    }
    if (grads.empty()) {
      return;
    }
    std::vector<at::Tensor> flat;
    flat.reserve(grads.size());
    for (const auto& grad : grads) {
      flat.push_back(grad.reshape({-1}));
    }
    const auto summed = all_reduce(group_, at::cat(flat));
    int64_t offset = 0;
    const at::NoGradGuard no_grad;
    for (auto& grad : grads) {
      grad.copy_(summed.narrow(0, offset, grad.numel()).view_as(grad));
      offset += grad.numel();
    }
  }

 private:
  ParallelModel& model_;
  ProcessGroup group_;
  std::vector<std::string> names_;
};

// A ConfigError (run_main's configuration-error status): the config's mesh and model do not fit.
void require_divides(int64_t ranks, int64_t size, const std::string& key) {
  if (size % ranks != 0) {
    throw ConfigError("d9d::parallel::TensorParallel: \"mesh.tp\" = " + std::to_string(ranks) +
                      " does not divide the model's \"" + key + "\" = " + std::to_string(size) +
                      ". Fix: set \"mesh.tp\" to a common divisor of "
                      "num_attention_heads, num_key_value_heads, intermediate_size and "
                      "vocab_size");
  }
}

// Which parameter tensor (by TensorImpl) a pass split along which dimension, and the splitting.
class Splits {
 public:
  Splits(int64_t ranks, int64_t rank) : ranks_(ranks), rank_(rank) {}

  [[nodiscard]] int64_t ranks() const { return ranks_; }

  // This rank's part of `param` along `dim` (once: a tied parameter is met twice).
  void narrow(at::Tensor& param, int64_t dim) {
    if (dims_.count(param.unsafeGetTensorImpl()) != 0) {
      return;
    }
    const int64_t part = param.size(dim) / ranks_;
    param.set_data(param.detach().narrow(dim, rank_ * part, part).clone());
    dims_[param.unsafeGetTensorImpl()] = dim;
  }

  // A column-parallel (dim 0: its output features) or row-parallel (dim 1) projection.
  void narrow_linear(model::LinearImpl& linear, int64_t dim) {
    narrow(linear.weight, dim);
    if (linear.bias.defined()) {
      if (dim != 0) {
        throw std::invalid_argument(
            "d9d::parallel::TensorParallel: a row-parallel projection with a bias is not "
            "supported (the bias would be added on every tp rank)");
      }
      narrow(linear.bias, 0);
    }
  }

  // The dimension `tensor` was split along, or none.
  [[nodiscard]] std::optional<int64_t> dim_of(const at::Tensor& tensor) const {
    const auto found = dims_.find(tensor.unsafeGetTensorImpl());
    return found == dims_.end() ? std::nullopt : std::optional<int64_t>(found->second);
  }

  // Forgets `tensor` (recorded elsewhere); true when it was split.
  bool forget(const at::Tensor& tensor) { return dims_.erase(tensor.unsafeGetTensorImpl()) > 0; }

 private:
  int64_t ranks_;
  int64_t rank_;
  std::map<const void*, int64_t> dims_;
};

// Mixture-of-experts layers split their tokens over tp, not their weights: each rank routes and
// runs its part of the sequence (MoeLayerImpl::set_tensor_parallel), so their parameters (the
// router, the shared expert, the experts) stay whole and their gradients are partial sums over
// tp (appended to `partial`). ExpertParallel, applied later, moves the experts to the expert
// domain, whose reduction over the experts' replicas (ep_dp_replicate x ep_replicate) then sums
// them (PartialNormSync leaves parameters of other domains alone). Returns every module inside a
// MoE layer (the weight pass leaves them whole).
std::set<const torch::nn::Module*> split_moe_layers(
    ParallelModel& model, const std::shared_ptr<const model::TensorParallelGroup>& group,
    std::vector<at::Tensor>& partial) {
  std::set<const torch::nn::Module*> inside_moe;
  for (const auto& root : model.modules()) {
    for (const auto& module : root->modules()) {
      if (auto moe = std::dynamic_pointer_cast<model::MoeLayerImpl>(module)) {
        moe->set_tensor_parallel(group);
        for (const auto& inner : moe->modules()) {
          inside_moe.insert(inner.get());
        }
        for (const auto& param : moe->parameters()) {
          partial.push_back(param);
        }
      }
    }
  }
  return inside_moe;
}

// Attention (heads) and SwiGLU (intermediate features) split by weights, the q/k norms' gradients
// partial (appended to `partial`), and the embedding and head of a VocabParallelModel split over
// the vocabulary. Returns how many roots split their vocabulary.
int split_layers(ParallelModel& model,
                 const std::shared_ptr<const model::TensorParallelGroup>& group,
                 const std::set<const torch::nn::Module*>& inside_moe, Splits& splits,
                 std::vector<at::Tensor>& partial) {
  const int64_t ranks = splits.ranks();
  int vocab_models = 0;
  for (const auto& root : model.modules()) {
    for (const auto& module : root->modules()) {
      if (inside_moe.count(module.get()) != 0) {
        continue;  // a MoE layer's shared expert stays whole with its layer
      }
      if (auto attention = std::dynamic_pointer_cast<model::AttentionImpl>(module)) {
        require_divides(ranks, attention->local_heads(), "num_attention_heads");
        require_divides(ranks, attention->local_kv_heads(), "num_key_value_heads");
        splits.narrow_linear(*attention->q_proj, 0);
        splits.narrow_linear(*attention->k_proj, 0);
        splits.narrow_linear(*attention->v_proj, 0);
        splits.narrow_linear(*attention->o_proj, 1);
        for (const auto& norm : {attention->q_norm, attention->k_norm}) {
          if (norm) {
            partial.push_back(norm->weight);
          }
        }
        attention->set_tensor_parallel(group);
      } else if (auto mlp = std::dynamic_pointer_cast<model::SwiGluImpl>(module)) {
        require_divides(ranks, mlp->gate_proj->out_features(), "intermediate_size");
        splits.narrow_linear(*mlp->gate_proj, 0);
        splits.narrow_linear(*mlp->up_proj, 0);
        splits.narrow_linear(*mlp->down_proj, 1);
        mlp->set_tensor_parallel(group);
      }
    }
    if (auto* vocab = dynamic_cast<model::VocabParallelModel*>(root.get())) {
      require_divides(ranks, vocab->vocab_size(), "vocab_size");
      const auto params = root->named_parameters();
      for (const auto& name : vocab->vocab_parameters()) {
        const auto* found = params.find(name);
        if (found == nullptr) {
          throw std::logic_error("d9d::parallel::TensorParallel: the model names \"" + name +
                                 "\" as a vocabulary parameter but has none");
        }
        auto param = *found;
        splits.narrow(param, 0);
      }
      vocab->set_tensor_parallel(group);
      ++vocab_models;
    }
  }
  return vocab_models;
}

// LoRA adapters split with their layer (the adapter's output is added to the base layer's, so it
// takes the same slice of it): under a column-parallel layer (weight [out / R, in]) lora_B is
// split on dim 0 like the weight and lora_A [rank, in] stays whole; under a row-parallel one
// (weight [out, in / R]) lora_A is split on dim 1 and lora_B [out, rank] stays whole, so the
// partial outputs B A_r x_r join the base layer's before its reduce_out (no collective of their
// own). The whole factor's gradient is a partial sum on each rank in both cases: A's is
// sum_r (B_r^T dy_r) x^T, this rank's output columns only (copy_in sums the input's gradient,
// not A's); B's is dy (A_r x_r)^T, this rank's part of A x only. Both go to `partial`.
void split_adapters(ParallelModel& model, Splits& splits, std::vector<at::Tensor>& partial) {
  for (const auto& root : model.modules()) {
    for (const auto& item : root->named_modules()) {
      const auto linear = std::dynamic_pointer_cast<model::LinearImpl>(item.value());
      if (!linear || !linear->adapter) {
        continue;
      }
      const auto dim = splits.dim_of(linear->weight);
      if (!dim) {
        continue;  // a whole layer keeps its whole adapter
      }
      auto* lora = dynamic_cast<peft::LoraAdapter*>(linear->adapter.get());
      if (lora == nullptr || lora->merged()) {
        throw std::invalid_argument(
            "d9d::parallel::TensorParallel: the split layer " + item.key() +
            " carries an adapter that is not an unmerged d9d::peft::LoraAdapter; tensor "
            "parallelism splits LoRA adapters only. Fix: apply the adapters through the plan's "
            "peft slot (d9d::peft::Lora), or unmerge them first");
      }
      if (*dim == 0) {
        splits.narrow(lora->lora_B->weight, 0);
        partial.push_back(lora->lora_A->weight);
      } else {
        splits.narrow(lora->lora_A->weight, 1);
        partial.push_back(lora->lora_B->weight);
      }
    }
  }
}

// The records: split parameters are Shard(dim) on tp, the rest Replicate on tp. Returns the names
// of the trained parameters whose gradients are partial sums over tp: those in `partial`, and
// under sequence parallelism every replicated one (the norms see this rank's tokens only). The
// split parameters that do not train (LoRA's frozen base weights) get their layout recorded, so
// that export gathers them.
std::vector<std::string> record_layouts(ParallelModel& model, bool sequence_parallel,
                                        Splits& splits, const std::vector<at::Tensor>& partial) {
  std::vector<std::string> partial_trained;
  for (auto& record : model.mutable_parameters()) {
    const auto dim = splits.dim_of(record.local);
    record.dims.emplace_back("tp");
    if (dim) {
      record.placements.emplace_back(::d9d::Shard{*dim});
    } else {
      record.placements.emplace_back(::d9d::Replicate{});
    }
    const bool listed = std::any_of(partial.begin(), partial.end(), [&](const at::Tensor& tensor) {
      return tensor.unsafeGetTensorImpl() == record.local.unsafeGetTensorImpl();
    });
    if ((sequence_parallel && !dim) || listed) {
      partial_trained.push_back(record.name);
    }
  }
  for (const auto& record : model.parameters()) {
    splits.forget(record.local);
  }
  for (const auto& root : model.modules()) {
    for (const auto& item : root->named_parameters()) {
      const auto dim = splits.dim_of(item.value());
      if (!dim) {
        continue;
      }
      auto whole = item.value().sizes().vec();
      whole[*dim] *= splits.ranks();
      model.mutable_frozen_split_parameters().push_back(ParameterRecord{
          .name = item.key(),
          .local = item.value(),
          .global_shape = std::move(whole),
          .domain = MeshDomain::regular,
          .dims = {"dp_replicate", "dp_shard", "tp"},
          .placements = {::d9d::Replicate{}, ::d9d::Replicate{}, ::d9d::Shard{*dim}}});
      splits.forget(item.value());  // a tied parameter, recorded once
    }
  }
  return partial_trained;
}

}  // namespace

std::shared_ptr<const model::TensorParallelGroup> make_tensor_parallel_group(
    const ProcessGroup& group, bool sequence_parallel) {
  return std::make_shared<const Group>(group, sequence_parallel);
}

void apply_tensor_parallel(ParallelModel& model, const TensorParallelSettings& settings) {
  const auto& mesh = model.mesh();
  const auto process_group = mesh.group(MeshDomain::regular, "tp");
  const auto group = make_tensor_parallel_group(process_group, settings.sequence_parallel);
  Splits splits(mesh.size(MeshDomain::regular, "tp"), mesh.coordinate(MeshDomain::regular, "tp"));
  const at::NoGradGuard no_grad;
  // Parameters whose gradients are partial sums over tp: summed there by PartialNormSync.
  std::vector<at::Tensor> partial;
  const auto inside_moe = split_moe_layers(model, group, partial);
  const int vocab_models = split_layers(model, group, inside_moe, splits, partial);
  split_adapters(model, splits, partial);
  // A model that cannot split its embedding and head keeps them whole on every tp rank (their
  // gradients are then whole and equal there), unless the residual stream is split by sequence,
  // which the embedding's reduce-scatter starts.
  if (vocab_models == 0 && settings.sequence_parallel) {
    throw std::invalid_argument(
        "d9d::parallel::TensorParallel<SequenceParallel::on>: the model does not split its "
        "embedding and LM head over the vocabulary (it implements no "
        "d9d::model::VocabParallelModel), which sequence parallelism needs to split the residual "
        "stream. Fix: implement it (as d9d::model::Qwen3ForCausalLM and Qwen3Stage do), or use "
        "d9d::parallel::TensorParallel<> (the embedding and the head then stay whole on every "
        "tp rank)");
  }
  auto partial_trained = record_layouts(model, settings.sequence_parallel, splits, partial);
  model.add_norm_dims({"tp"});
  model.add_sync(
      std::make_unique<PartialNormSync>(model, process_group, std::move(partial_trained)));
}

}  // namespace d9d::parallel::detail
