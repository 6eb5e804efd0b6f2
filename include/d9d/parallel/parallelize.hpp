// d9d/parallel/parallelize.hpp — the parallelize layer: a Plan's horizontal strategies applied to
// a model in one fixed order, and the record of every trained parameter that the step reads.
//
//   auto parallel = d9d::parallel::parallelize<MyPlan>(mesh, {model.ptr()}, {.bucket_bytes = ...});
//   for (auto& r : parallel->parameters()) { r.local; r.placements; }  // the optimizer's tensors
//   parallel->begin_step(); ... loss.backward(); ... parallel->finish();  // gradients reduced
//   double norm = parallel->normalize_and_clip(total_weight, max_norm);  // on any mesh
//
// Order (DESIGN.md; d9d::parallel::strategy_order): peft -> tensor/sequence -> expert -> context
// -> data sharding -> recompute. Before the strategies, floating-point parameters are cast to the
// precision policy's dtype and every data-parallel replica takes dp rank 0's values. Each strategy
// is the component d9d::parallel::strategy<Policy>, specialised on the policy type of its slot,
// modelling d9d::parallel::parallel_strategy (d9d/parallel/strategy.hpp):
//   - check<Plan>():           compile-time rules (static degrees, other slots), static_asserts;
//   - check_mesh(shape):       the same rules at start-up for d9d::dynamic degrees;
//   - apply<Plan>(model):      what it does to the modules and to the parameter records, and the
//                              GradientSync it adds to the step's gradient path;
//   - contribute<Plan>(c):     optional: what it does to the data and the loss.
// Facts of the rest of the Plan (its pipeline slot: GradientTiming; its precision) come from the
// Plan each part is given.
// A parameter record says what this rank's optimizer updates (`local`: the whole parameter, or its
// shard), where it sits on the mesh (dims + placements, as in d9d::ShardedTensor) and so how its
// gradient norm is summed and how checkpoints store it. The train steps, the optimizer, grad-norm
// clipping, checkpoints and export read the records; nothing outside this layer branches on a
// strategy. A new strategy adds a policy, a strategy<> specialisation and (in src/parallel/) its
// apply function (docs/design/0007-parallelize-layer.md).
#pragma once

#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <d9d/core/device_mesh.hpp>
#include <d9d/core/sharded_tensor.hpp>
#include <d9d/model/context_parallel.hpp>
#include <d9d/model/tensor_parallel.hpp>
#include <d9d/parallel/policies.hpp>
#include <d9d/parallel/replicate.hpp>
#include <d9d/parallel/strategy.hpp>
#include <d9d/peft/policies.hpp>
#include <d9d/peft/stack.hpp>
#include <d9d/plan/defaults.hpp>
#include <d9d/plan/plan.hpp>
#include <d9d/plan/slots.hpp>
#include <d9d/precision/policies.hpp>
#include <d9d/precision/scalar_type.hpp>
#include <d9d/recompute/policies.hpp>

namespace d9d::parallel {

/// One trained parameter after parallelize (or, in ParallelModel::frozen_split_parameters, the
/// layout of a frozen one that a strategy split).
struct ParameterRecord {
  std::string name;  ///< its name in the whole model ("model.layers.0.mlp.up_proj.weight")
  /// What this rank's optimizer updates: a leaf tensor, the whole parameter or this rank's part of
  /// it. After the step's backward and GradientSync::finish its .grad is the gradient summed over
  /// the data-parallel ranks (this rank's part of it).
  at::Tensor local;
  std::vector<int64_t> global_shape;  ///< the whole parameter's shape
  MeshDomain domain = MeshDomain::regular;
  std::vector<std::string> dims;      ///< mesh dimensions of `domain` it is laid out on
  std::vector<Placement> placements;  ///< one per dim: Replicate{} or Shard{d}
  /// A second holder of a parameter tied across pipeline stages (the tied LM head's copy of
  /// "model.embed_tokens.weight" on the last stage): the same name, values and gradient as the
  /// first holder (the stage with the lowest index), trained alongside it, but left out of the
  /// gradient norm, checkpoints and export, which count the first holder only.
  bool tied_copy = false;

  /// The dims whose ranks hold different parts (Shard placements).
  [[nodiscard]] std::vector<std::string> sharded_dims() const;
  /// AdamW weight decay applies to matrices (the whole parameter has >= 2 dimensions).
  [[nodiscard]] bool decays() const { return global_shape.size() >= 2; }
  /// `local` as a ShardedTensor on `mesh` (for checkpoints and export).
  [[nodiscard]] ShardedTensor sharded(const DeviceMesh& mesh) const;
};

/// When a step's gradients are complete, as the Plan's pipeline slot says: what a strategy's
/// gradient path adapts to (each strategy reads it from the Plan in apply<Plan>).
enum class GradientTiming {
  /// Each rank runs the whole model, microbatch by microbatch: a microbatch's gradients are
  /// complete at the end of its backward (reductions may start from autograd's hooks).
  backward,
  /// A pipeline program over this rank's stages: forwards and backwards of microbatches
  /// interleave in program order and weight gradients may come in W actions outside autograd, so
  /// reductions start from ParallelModel::module_done and finish().
  program,
};

/// The GradientTiming of `Plan`'s step.
template <class Plan>
inline constexpr GradientTiming gradient_timing_of =
    plan_has_pipeline<Plan> ? GradientTiming::program : GradientTiming::backward;

/// What a strategy adds to the step's gradient path. The steps call, per optimizer step:
/// begin_step(); for each microbatch i of n: before_forward(i, n), forward, before_backward(i, n),
/// backward; then finish(). Under a pipeline program (GradientTiming::program) begin_step(),
/// module_done(m) for each module as the program finishes its gradients, and finish().
class GradientSync {
 public:
  GradientSync() = default;
  virtual ~GradientSync() = default;
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;
  GradientSync(GradientSync&&) = delete;
  GradientSync& operator=(GradientSync&&) = delete;

  virtual void begin_step() {}
  /// Before microbatch i of n runs forward (steps without a pipeline program).
  virtual void before_forward(int /*microbatch*/, int /*microbatches*/) {}
  virtual void before_backward(int /*microbatch*/, int /*microbatches*/) {}
  /// Under a pipeline program: module `module` (its index in ParallelModel::modules()) has every
  /// gradient of this step, so the strategy may start reducing them while the rest of the program
  /// runs. Every rank of the strategy's groups runs the same program, so they call it for the same
  /// modules in the same order; finish() completes what was started and reduces the rest.
  virtual void module_done(std::size_t /*module*/) {}
  /// Under a pipeline program: an action (forward, backward or weight-gradient) of module
  /// `module` has run; what the strategy gathered for it may be freed now, unless `next_module`
  /// (the module of this rank's next compute action, or -1 at the program's end) uses it too.
  virtual void action_done(std::size_t /*module*/, int64_t /*next_module*/) {}
  /// Completes every reduction of the step (collective over the strategy's groups).
  virtual void finish() {}
  /// Reductions (buckets, units) module_done() started in the current or last step.
  [[nodiscard]] virtual std::size_t started_early() const { return 0; }
  /// Bytes this rank holds for the strategy beyond the records' tensors (e.g. gathered units).
  [[nodiscard]] virtual int64_t extra_bytes() const { return 0; }
  /// The most extra_bytes() reached during the current or last step.
  [[nodiscard]] virtual int64_t peak_extra_bytes() const { return extra_bytes(); }
  /// Scalars for the step's log (name, value), e.g. the MoE routers' balance after finish().
  [[nodiscard]] virtual std::vector<std::pair<std::string, double>> metrics() const { return {}; }
  /// Why a CUDA graph cannot capture a microbatch's forward and backward under this path ("" when
  /// it can): a graph replays the kernels only, so a path that runs host code inside forward or
  /// backward (hooks that launch collectives, gather or free units) would not run on replays.
  [[nodiscard]] virtual std::string graph_blocker() const {
    return "a strategy's gradient path runs host code during forward and backward";
  }
};

/// The knobs of the strategies that are not part of the plan type (from the trainer config).
struct ParallelizeOptions {
  /// Replicate: bytes per all-reduce bucket.
  int64_t bucket_bytes = int64_t{25} << 20;
  /// Replicate: what moves the gradients' bytes (GradientReducerOptions::engine); unset: the
  /// copy engines where they run, else the group's all-reduce (automatic_reduce_engine).
  std::optional<ReduceEngine> reduce_engine = std::nullopt;
  /// Replicate: a tied embedding's lookup gradient in the last microbatch goes around autograd as
  /// rows, added after the weight's early all-reduce (d9d/model/embedding_rows.hpp). Applies when
  /// the mesh has only data-parallel (and context-parallel) ranks and the step runs no pipeline.
  bool tied_embedding_rows = true;
  /// FullyShard<Reshard::from_config>: "after_forward", "never" or "all_but_last".
  std::string reshard = "after_forward";
  /// FullyShard: units gathered ahead of their use (0: gather each unit when it starts).
  int prefetch = 1;
  /// FullyShard: reduce-scatter after every microbatch's backward (false: accumulate the whole
  /// gradients over the step's microbatches and reduce once, after the last).
  bool reduce_every_microbatch = true;
  /// peft: new adapters draw their initial values from generators seeded by this and their
  /// parameter names (the same on every rank and for every pipeline split).
  uint64_t seed = 0;
};

/// The model after parallelize: its modules (changed in place by the strategies), the parameter
/// records and the gradient path. Owned by the step; not copyable.
class ParallelModel {
 public:
  ParallelModel(const DeviceMesh& mesh, std::vector<std::shared_ptr<torch::nn::Module>> modules,
                ParallelizeOptions options);
  ~ParallelModel();
  ParallelModel(const ParallelModel&) = delete;
  ParallelModel& operator=(const ParallelModel&) = delete;
  ParallelModel(ParallelModel&&) = delete;
  ParallelModel& operator=(ParallelModel&&) = delete;

  [[nodiscard]] const DeviceMesh& mesh() const;
  [[nodiscard]] const ParallelizeOptions& options() const;
  [[nodiscard]] const std::vector<std::shared_ptr<torch::nn::Module>>& modules() const;
  [[nodiscard]] const std::vector<ParameterRecord>& parameters() const;
  [[nodiscard]] std::vector<ParameterRecord>& mutable_parameters();
  /// The records' local tensors, in record order (what the optimizer updates).
  [[nodiscard]] std::vector<at::Tensor> locals() const;
  [[nodiscard]] const ParameterRecord* find(const std::string& name) const;

  /// Parameters that do not train but that a strategy split over the mesh (TensorParallel narrows
  /// the frozen base weights of LoRA layers, and whatever Freeze froze): records with the same
  /// fields, but no optimizer state, gradient, norm, sync or checkpoint part. Export gathers them.
  [[nodiscard]] const std::vector<ParameterRecord>& frozen_split_parameters() const;
  [[nodiscard]] std::vector<ParameterRecord>& mutable_frozen_split_parameters();
  /// Where the parameter `name` sits on the mesh: its record when it trains, else its entry in
  /// frozen_split_parameters(), else null (a frozen parameter that is whole on every rank).
  [[nodiscard]] const ParameterRecord* layout(const std::string& name) const;

  /// Adds a strategy's gradient path (run in the order added; finish in reverse).
  void add_sync(std::unique_ptr<GradientSync> sync);
  /// Adds a gradient path whose finish() runs after every other one's (on the reduced gradients:
  /// the sum of tied parameters over their holders).
  void add_final_sync(std::unique_ptr<GradientSync> sync);
  /// Registers mesh dims of `domain` that shard parameters: normalize_and_clip sums the squares
  /// of parameters sharded on exactly these dims (of that domain) over their group. Every rank
  /// registers the same sets in the same order (strategies do it in apply).
  void add_norm_dims(std::vector<std::string> dims, MeshDomain domain = MeshDomain::regular);

  void begin_step();
  void before_forward(int microbatch, int microbatches);
  void before_backward(int microbatch, int microbatches);
  /// Under a pipeline program: module `module` of modules() got its last gradient of the step
  /// (this rank ran its stage's last backward or weight-gradient action); the strategies start
  /// reducing its gradients (GradientSync::module_done). Optional: finish() reduces whatever was
  /// not started.
  void module_done(std::size_t module);
  /// Under a pipeline program: an action of module `module` has run, and this rank's next compute
  /// action is on `next_module` (-1: none); the strategies may free what only this action needed
  /// (GradientSync::action_done).
  void action_done(std::size_t module, int64_t next_module);
  void finish();
  /// Reductions started by module_done() in the current or last step, over every strategy.
  [[nodiscard]] std::size_t reductions_started_early() const;
  /// The first strategy's GradientSync::graph_blocker() that is not empty ("": a CUDA graph may
  /// capture the step's forward and backward).
  [[nodiscard]] std::string graph_blocker() const;

  /// Divides every local gradient by `total_weight`, computes the global 2-norm of the gradient
  /// (each element counted once: squares summed over the dims a parameter is sharded on and over
  /// pp, never over replicas), scales the gradients to `max_norm` when it is exceeded, and returns
  /// the norm before clipping. Collective over the mesh (the same collectives on every rank).
  /// Waits for the device to read the norm.
  double normalize_and_clip(double total_weight, std::optional<double> max_norm);
  /// The same without waiting for the device: `total_weight` a scalar tensor on the mesh's device,
  /// the norm returned as one (float64); the scaling happens on the device.
  at::Tensor normalize_and_clip(const at::Tensor& total_weight, std::optional<double> max_norm);

  /// Bytes of this rank's parameters (records' locals), their gradients, and what the strategies
  /// hold besides (gathered units); the optimizer's state is the caller's.
  [[nodiscard]] int64_t parameter_bytes() const;
  [[nodiscard]] int64_t gradient_bytes() const;
  [[nodiscard]] int64_t extra_bytes() const;
  /// The sum over the strategies of the most each held beyond the records during the current or
  /// last step (GradientSync::peak_extra_bytes): FullyShard's gathered units at their peak.
  [[nodiscard]] int64_t peak_extra_bytes() const;
  /// Every strategy's metrics() (after finish()), in the order the strategies were added.
  [[nodiscard]] std::vector<std::pair<std::string, double>> metrics() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The behaviour of a policy; specialised for every policy the layer implements. The primary
/// template is a plan that names a policy nothing implements yet: its check says so.
template <class Policy>
struct strategy {
  using strategy_concept = strategy_tag;
  template <class Plan>
  static constexpr void check() {
    static_assert(
        ::d9d::detail::plan_dependent_false<Policy>,
        "d9d::parallel::parallelize: no strategy implements this policy (shown with this error). "
        "Implemented: data_parallel Replicate, FullyShard<...>; tensor_parallel "
        "NoTensorParallel, TensorParallel<>; expert_parallel NoExpertParallel, "
        "ExpertParallel<E>; context_parallel NoContextParallel, ContextParallel<R>; peft FullTune, "
        "Freeze<...>, "
        "Train<...>, Lora<...>, Stack<...>; recompute None, Full, EveryNth<K>. Fix: use one of "
        "those, or specialise d9d::parallel::strategy<YourPolicy>");
  }
  static void check_mesh(const MeshShape& /*shape*/) {}
  template <class Plan>
  static void apply(ParallelModel& /*model*/) {}
};

namespace detail {

template <class...>
inline constexpr bool parallel_dependent_false = false;

/// The records before any strategy: every parameter that requires a gradient, whole, Replicate
/// on dp_replicate and dp_shard; floating-point parameters cast to `dtype`; dp rank 0's values
/// copied to the other replicas.
std::unique_ptr<ParallelModel> make_parallel_model(
    const DeviceMesh& mesh, std::vector<std::shared_ptr<torch::nn::Module>> modules,
    at::ScalarType dtype, ParallelizeOptions options);

/// Rebuilds the records after a strategy changed which parameters train (peft, applied first):
/// every parameter that requires a gradient, in module order; those not recorded before take dp
/// rank 0's values.
void rerecord_parameters(ParallelModel& model);

/// The peft policies' component (src/peft/): applies the stack to the modules (freezes, trains,
/// adds adapters; a pattern that matches nothing on any pipeline stage is an error), then
/// rerecords the parameters.
void apply_peft(ParallelModel& model, const peft::StackSpec& spec);

/// Data parallelism's contribution (Replicate and FullyShard): the global batch's samples are
/// split over the batch domain's dp, and the loss totals are summed over it.
void contribute_data_parallel(StepContributions& contributions);

/// Replicate: every regular-domain record's gradient all-reduced over the batch domain's dp
/// (under GradientTiming::program one reducer per module, started by module_done), in
/// `reduce_dtype` (the precision policy's `reduce`; gradients of another dtype are cast for the
/// all-reduce and back).
void apply_replicate(ParallelModel& model, GradientTiming timing, at::ScalarType reduce_dtype);

/// Replicate's gradient path for `parameters` over `group` (bucketed all-reduce armed in the last
/// microbatch's backward, or in finish() under GradientTiming::program).
std::unique_ptr<GradientSync> make_replicate_sync(const ProcessGroup& group,
                                                  std::vector<at::Tensor> parameters,
                                                  int64_t bucket_bytes, GradientTiming timing);

/// d9d::precision::Float8: float8 GEMMs (model::Float8Linear, per row or per tensor) on the
/// projections of every d9d::model::Attention and d9d::model::SwiGlu of the modules; returns how
/// many layers. On a CUDA device it runs a small float8 product first (std::runtime_error naming
/// the fix when the device or the build has none); std::invalid_argument when the modules have no
/// such layer (src/parallel/float8.cpp).
int apply_float8(ParallelModel& model, bool rowwise);

/// FullyShard's run-time choices (resolved from the policy and the options).
struct FullyShardSettings {
  std::string reshard;           ///< "after_forward", "never", "all_but_last"
  at::ScalarType compute_dtype;  ///< the gathered parameters' dtype
  at::ScalarType reduce_dtype;   ///< the reduce-scatter's dtype
  /// The weights of float8 linear layers (apply_float8, per-row scales) are quantised on their
  /// owner ranks and gathered as float8 with their scales (d9d::precision::WeightGather::float8).
  bool float8_gather = false;
  /// Under GradientTiming::program the units are gathered around the actions of their stage and
  /// freed after them as `reshard` says ("never": gathered for the whole step), prefetching only
  /// within a stage, and reductions start from module_done and finish().
  GradientTiming timing = GradientTiming::backward;
};
void apply_fully_shard(ParallelModel& model, const FullyShardSettings& settings);

/// ExpertParallel's run-time choices.
struct ExpertParallelSettings {
  int num_experts = -1;  ///< the policy's static expert count, or -1 (d9d::dynamic)
  GradientTiming timing = GradientTiming::backward;  ///< of the experts' replicas' reduction
};
/// Shards every d9d::model::GroupedExperts over the expert domain's ep_shard, dispatches tokens by
/// all-to-all, records the experts on MeshDomain::expert and sums their gradients over their
/// replicas, ep_dp_replicate x ep_replicate (src/parallel/expert_parallel.cpp).
void apply_expert_parallel(ParallelModel& model, const ExpertParallelSettings& settings);

/// For models with d9d::model::MoeLayer blocks (whatever the plan): sets their load group (the
/// batch domain's dp, for global-batch auxiliary-loss statistics) and adds the step's router
/// bookkeeping: loads summed over dp, the auxiliary-loss-free bias update, router metrics.
void apply_moe_balance(ParallelModel& model);

/// TensorParallel's run-time choices.
struct TensorParallelSettings {
  bool sequence_parallel = false;
};
/// Splits every d9d::model::Attention by heads, every d9d::model::SwiGlu by its intermediate
/// dimension and the embedding and head of a d9d::model::VocabParallelModel by vocabulary over the
/// regular domain's tp ranks, and the LoRA adapters of split layers with them (lora_B on dim 0
/// under a column-parallel layer, lora_A on dim 1 under a row-parallel one); records the split
/// parameters as Shard(d) on tp (the rest Replicate; split frozen ones in
/// frozen_split_parameters) and sums over tp the gradients that are partial there: the per-head
/// q/k norms', the adapters' whole factors', and under sequence parallelism every replicated
/// parameter's (src/parallel/tensor_parallel.cpp).
void apply_tensor_parallel(ParallelModel& model, const TensorParallelSettings& settings);
/// The d9d::model::TensorParallelGroup apply_tensor_parallel gives the layers, over `group` (its
/// f/g autograd functions and the loss-parallel cross-entropy; exposed for tests).
std::shared_ptr<const model::TensorParallelGroup> make_tensor_parallel_group(
    const ProcessGroup& group, bool sequence_parallel = false);

/// Splits the sequence of a d9d::model::ContextParallelModel over the batch domain's cp ranks
/// (d9d::parallel::ContextParallel; `ring`: K/V passed around the ring, else all-gathered), makes
/// the parameters equal over cp (broadcast from cp rank 0) and records them as replicated on the
/// regular domain's cp_shard and cp_replicate (src/parallel/context_parallel.cpp). The gradients
/// are summed over cp by the data-parallel strategy (Replicate over data_parallel_group;
/// FullyShard shards over dp_shard x cp_shard).
void apply_context_parallel(ParallelModel& model, bool ring);
/// The d9d::model::ContextParallelGroup apply_context_parallel gives the model, over `group`
/// (exposed for tests).
std::shared_ptr<const model::ContextParallelGroup> make_context_parallel_group(
    const ProcessGroup& group, bool ring);
/// The group over which data-parallel strategies sum gradients: the batch domain's dp, and cp
/// when the mesh has cp > 1 (the ranks that hold other samples or other parts of them).
ProcessGroup data_parallel_group(const DeviceMesh& mesh);

/// Parameters tied across pipeline stages: a name that more than one of the modules holds (this
/// rank's stages, or the stages of other ranks of its pp group; found by one all-gather of names
/// over pp). The first holder (lowest pp rank, then first module) keeps its record; the others are
/// marked ParameterRecord::tied_copy. A final GradientSync sums the holders' gradients after the
/// other reductions (data parallel, FullyShard's reduce-scatter: on this rank's part): locally
/// when one rank holds them all, else by an all-reduce over the group of the holding pp ranks
/// (for each pp group, i.e. each coordinate of the other mesh dims). Every holder then has the
/// same gradient and, with the same optimizer, the same values. Nothing to do without pp > 1 and
/// without repeated names (a model that shares one Parameter between two modules has one record).
void tie_stage_parameters(ParallelModel& model);

/// Recomputes block i when every_nth > 0 and i % every_nth == every_nth - 1: its whole body
/// (Scope::block) or its attention part (Scope::attention; std::invalid_argument naming the block
/// when one does not declare d9d::model::Block::Part::attention).
void apply_recompute(ParallelModel& model, int every_nth, recompute::Scope scope);

/// std::invalid_argument naming `degree`, its value and `policy` unless the degree is 1: "Fix:
/// <fix>, or <alternative>".
void require_degree_one(const char* degree, int value, const char* policy, const char* fix,
                        const char* alternative = "choose a policy that uses it");

/// std::invalid_argument unless `name` is "after_forward", "never" or "all_but_last".
void check_reshard_name(const std::string& name);

template <class Degree>
constexpr bool static_degree_is(int value) {
  return !Degree::is_dynamic && Degree::value == value;
}
template <class Degree>
constexpr bool static_degree_exceeds_one() {
  return !Degree::is_dynamic && Degree::value > 1;
}

template <int Experts, int Ep>
constexpr bool experts_divide_over() {
  return Experts % Ep == 0;
}

}  // namespace detail

// ---- data_parallel --------------------------------------------------------------------------

template <>
struct strategy<Replicate> {
  using strategy_concept = strategy_tag;
  template <class Plan>
  static constexpr void check() {}
  static void check_mesh(const MeshShape& /*shape*/) {}
  template <class Plan>
  static void apply(ParallelModel& model) {
    detail::apply_replicate(model, gradient_timing_of<Plan>,
                            precision::scalar_type(Plan::precision::reduce));
  }
  template <class Plan>
  static void contribute(StepContributions& contributions) {
    detail::contribute_data_parallel(contributions);
  }
};

template <Reshard R, ReduceDtype D>
struct strategy<FullyShard<R, D>> {
  using strategy_concept = strategy_tag;
  template <class Plan>
  static constexpr void check() {
    using Mesh = typename Plan::mesh;
    using P = typename Plan::precision;
    static_assert(!detail::static_degree_is<typename Mesh::dp_shard>(1),
                  "d9d::parallel::FullyShard: the plan's mesh fixes dp_shard = 1, so there is "
                  "nothing to shard over. Fix: give the mesh d9d::dp_shard<N> with N > 1 (or "
                  "d9d::dynamic), or use d9d::parallel::Replicate");
    static_assert(D != ReduceDtype::bfloat16 || P::compute == precision::Dtype::bfloat16,
                  "d9d::parallel::FullyShard: ReduceDtype::bfloat16 needs bfloat16 compute (the "
                  "gradients are float32 otherwise, and rounding them for the reduction only "
                  "loses precision). Fix: use d9d::precision::Bf16Mixed, or "
                  "ReduceDtype::as_precision");
    static_assert(D != ReduceDtype::float32 || P::parameters != precision::Dtype::float64,
                  "d9d::parallel::FullyShard: ReduceDtype::float32 under float64 parameters would "
                  "round every gradient. Fix: use ReduceDtype::as_precision with "
                  "d9d::precision::Fp64");
  }
  static void check_mesh(const MeshShape& /*shape*/) {}
  template <class Plan>
  static void apply(ParallelModel& model) {
    using P = typename Plan::precision;
    detail::FullyShardSettings settings{.reshard = model.options().reshard,
                                        .compute_dtype = precision::scalar_type(P::compute),
                                        .reduce_dtype = precision::scalar_type(P::reduce),
                                        .float8_gather = false,
                                        .timing = gradient_timing_of<Plan>};
    if constexpr (precision::has_float8<P>) {
      settings.float8_gather = P::float8_weight_gather == precision::WeightGather::float8;
    }
    if constexpr (R == Reshard::after_forward) {
      settings.reshard = "after_forward";
    } else if constexpr (R == Reshard::never) {
      settings.reshard = "never";
    } else if constexpr (R == Reshard::all_but_last) {
      settings.reshard = "all_but_last";
    }
    if constexpr (D == ReduceDtype::float32) {
      settings.reduce_dtype = at::kFloat;
    } else if constexpr (D == ReduceDtype::bfloat16) {
      settings.reduce_dtype = at::kBFloat16;
    }
    detail::apply_fully_shard(model, settings);
  }
  template <class Plan>
  static void contribute(StepContributions& contributions) {
    detail::contribute_data_parallel(contributions);
  }
};

// ---- tensor / expert / context parallel ---------------------------------------------------------

template <>
struct strategy<NoTensorParallel> {
  using strategy_concept = strategy_tag;
  template <class Plan>
  static constexpr void check() {
    static_assert(!detail::static_degree_exceeds_one<typename Plan::mesh::tp>(),
                  "d9d::parallel::NoTensorParallel: the plan's mesh has tp > 1 but no tensor "
                  "parallel policy splits the layers. Fix: drop d9d::tp from the mesh, or put "
                  "d9d::parallel::TensorParallel<> in the plan");
  }
  static void check_mesh(const MeshShape& shape) {
    detail::require_degree_one("tp", shape.tp, "d9d::parallel::NoTensorParallel",
                               "set \"mesh.tp\" to 1",
                               "put d9d::parallel::TensorParallel<> in the plan");
  }
  template <class Plan>
  static void apply(ParallelModel& /*model*/) {}
};

/// TensorParallel: static rules — a mesh that fixes tp = 1 has nothing to split; at start-up,
/// sequence parallelism needs
/// tp > 1. The model's sizes are checked when applied (std::invalid_argument naming the config
/// key).
template <SequenceParallel SP>
struct strategy<TensorParallel<SP>> {
  using strategy_concept = strategy_tag;
  static constexpr bool sequence_parallel = SP == SequenceParallel::on;
  template <class Plan>
  static constexpr void check() {
    static_assert(!detail::static_degree_is<typename Plan::mesh::tp>(1),
                  "d9d::parallel::TensorParallel: the plan's mesh fixes tp = 1, so there is "
                  "nothing to split the layers over. Fix: give the mesh d9d::tp<N> with N > 1 (or "
                  "d9d::dynamic), or use d9d::parallel::NoTensorParallel");
  }
  static void check_mesh(const MeshShape& shape) {
    if (sequence_parallel && shape.tp == 1) {
      throw std::invalid_argument(
          "d9d::parallel::TensorParallel<SequenceParallel::on>: sequence parallelism needs "
          "\"mesh.tp\" > 1 (got 1). Fix: set \"mesh.tp\" to 2 or more, or use "
          "d9d::parallel::TensorParallel<>");
    }
  }
  template <class Plan>
  static void apply(ParallelModel& model) {
    detail::apply_tensor_parallel(model, {.sequence_parallel = sequence_parallel});
  }
};

template <>
struct strategy<NoExpertParallel> {
  using strategy_concept = strategy_tag;
  template <class Plan>
  static constexpr void check() {
    static_assert(!detail::static_degree_exceeds_one<typename Plan::mesh::ep>(),
                  "d9d::parallel::NoExpertParallel: the plan's mesh has ep > 1 but no expert "
                  "parallel policy shards the experts. Fix: drop d9d::ep from the mesh");
  }
  static void check_mesh(const MeshShape& shape) {
    detail::require_degree_one("ep", shape.ep, "d9d::parallel::NoExpertParallel",
                               "set \"mesh.ep\" to 1",
                               "put d9d::parallel::ExpertParallel<> in the plan");
  }
  template <class Plan>
  static void apply(ParallelModel& /*model*/) {}
};

/// ExpertParallel: static rules — a mesh that fixes ep = 1 has nothing to shard; a static expert
/// count must be a multiple of a static ep (the model's count is checked at start-up).
template <int E>
struct strategy<ExpertParallel<E>> {
  using strategy_concept = strategy_tag;
  template <class Plan>
  static constexpr void check() {
    using Ep = typename Plan::mesh::ep;
    static_assert(!detail::static_degree_is<Ep>(1),
                  "d9d::parallel::ExpertParallel: the plan's mesh fixes ep = 1, so there is "
                  "nothing to split the experts over. Fix: give the mesh d9d::ep<N> with N > 1 (or "
                  "d9d::dynamic), or use d9d::parallel::NoExpertParallel");
    if constexpr (E != dynamic && !Ep::is_dynamic) {
      static_assert(detail::experts_divide_over<E, Ep::value>(),
                    "d9d::parallel::ExpertParallel<NumExperts>: ep does not divide the number of "
                    "experts (shown with this error as experts_divide_over<NumExperts, ep>). Fix: "
                    "choose ep among the divisors of NumExperts");
    }
  }
  static void check_mesh(const MeshShape& shape) {
    if (E != dynamic && E % shape.ep != 0) {
      throw std::invalid_argument("d9d::parallel::ExpertParallel<" + std::to_string(E) +
                                  ">: \"mesh.ep\" = " + std::to_string(shape.ep) +
                                  " does not divide the " + std::to_string(E) +
                                  " experts. Fix: set \"mesh.ep\" to a divisor of " +
                                  std::to_string(E));
    }
  }
  template <class Plan>
  static void apply(ParallelModel& model) {
    detail::apply_expert_parallel(model, {.num_experts = E, .timing = gradient_timing_of<Plan>});
  }
};

template <>
struct strategy<NoContextParallel> {
  using strategy_concept = strategy_tag;
  template <class Plan>
  static constexpr void check() {
    using Mesh = typename Plan::mesh;
    static_assert(!detail::static_degree_exceeds_one<typename Mesh::cp_shard>() &&
                      !detail::static_degree_exceeds_one<typename Mesh::cp_replicate>(),
                  "d9d::parallel::NoContextParallel: the plan's mesh has cp_shard or "
                  "cp_replicate > 1 but no context parallel policy splits the sequence. Fix: drop "
                  "those degrees from the mesh");
  }
  static void check_mesh(const MeshShape& shape) {
    detail::require_degree_one("cp_shard", shape.cp_shard, "d9d::parallel::NoContextParallel",
                               "set \"mesh.cp_shard\" to 1");
    detail::require_degree_one("cp_replicate", shape.cp_replicate,
                               "d9d::parallel::NoContextParallel",
                               "set \"mesh.cp_replicate\" to 1");
  }
  template <class Plan>
  static void apply(ParallelModel& /*model*/) {}
};

/// ContextParallel: static rule — a mesh that fixes cp_shard and cp_replicate to 1 has nothing to
/// split. At start-up cp > 1; the model and the sequence length are checked when applied and at
/// the first step (std::invalid_argument naming the config key). Under a pipeline schedule every
/// stage cuts and attends as the whole model does, and the task's loss of the last stage gets the
/// rank's part (sequence_dims).
template <KvRotation R>
struct strategy<ContextParallel<R>> {
  using strategy_concept = strategy_tag;
  template <class Plan>
  static constexpr void check() {
    using Mesh = typename Plan::mesh;
    static_assert(!detail::static_degree_is<typename Mesh::cp_shard>(1) ||
                      !detail::static_degree_is<typename Mesh::cp_replicate>(1),
                  "d9d::parallel::ContextParallel: the plan's mesh fixes cp_shard = cp_replicate = "
                  "1, so there is nothing to split the sequence over. Fix: give the mesh "
                  "d9d::cp_shard<N> with N > 1 (or d9d::dynamic), or use "
                  "d9d::parallel::NoContextParallel");
  }
  static void check_mesh(const MeshShape& shape) {
    if (shape.cp_shard * shape.cp_replicate == 1) {
      throw std::invalid_argument(
          "d9d::parallel::ContextParallel: \"mesh.cp_shard\" x \"mesh.cp_replicate\" = 1, so "
          "there is nothing to split the sequence over. Fix: set \"mesh.cp_shard\" to 2 or "
          "more, or use d9d::parallel::NoContextParallel");
    }
  }
  template <class Plan>
  static void apply(ParallelModel& model) {
    detail::apply_context_parallel(model, R == KvRotation::ring);
  }
  template <class Plan>
  static void contribute(StepContributions& contributions) {
    // Every cp rank reads the same samples (sample_dims unchanged) and keeps a part of each.
    contributions.loss_dims.emplace_back("cp");
    contributions.sequence_dims.emplace_back("cp");
  }
};

// ---- peft ---------------------------------------------------------------------------------------

template <>
struct strategy<peft::FullTune> {
  using strategy_concept = strategy_tag;
  template <class Plan>
  static constexpr void check() {}
  static void check_mesh(const MeshShape& /*shape*/) {}
  template <class Plan>
  static void apply(ParallelModel& /*model*/) {}  // every parameter that requires a gradient trains
};

/// Freeze, Train, Lora and Stacks of them (d9d/peft/policies.hpp; their static rules are checked
/// when the policy type is instantiated, in its class body). Applied first, so the strategies
/// after it see only the parameters that train: frozen ones get no record, hence no optimizer
/// state, no gradient synchronisation and no place in the gradient norm (and, under FullyShard,
/// stay whole on every rank).
template <class Policy>
requires(!std::same_as<Policy, peft::FullTune> &&
         (peft::detail::stackable<Policy> ||
          peft::detail::is_stack<Policy>)) struct strategy<Policy> {
  using strategy_concept = strategy_tag;
  template <class Plan>
  static constexpr void check() {
    static_assert(sizeof(Policy) > 0);  // instantiates the policy: its rules run
  }
  static void check_mesh(const MeshShape& /*shape*/) {}
  template <class Plan>
  static void apply(ParallelModel& model) {
    detail::apply_peft(model, peft::stack_spec<Policy>());
  }
};

// ---- activation_checkpointing -----------------------------------------------------------------

template <class Policy>
requires std::same_as<typename Policy::d9d_slot, slot::activation_checkpointing>
struct strategy<Policy> {
  using strategy_concept = strategy_tag;
  template <class Plan>
  static constexpr void check() {
    static_assert(Policy::every_nth >= 0,
                  "d9d::recompute: every_nth must be >= 0 (0 = keep every activation)");
  }
  static void check_mesh(const MeshShape& /*shape*/) {}
  template <class Plan>
  static void apply(ParallelModel& model) {
    if constexpr (Policy::every_nth > 0) {
      detail::apply_recompute(model, Policy::every_nth, scope());
    }
  }

 private:
  /// The policy's scope; whole blocks when it states none.
  static constexpr recompute::Scope scope() {
    if constexpr (requires { Policy::scope; }) {
      return Policy::scope;
    } else {
      return recompute::Scope::block;
    }
  }
};

// ---- the layer ----------------------------------------------------------------------------------

namespace detail {

/// The strategies of `Plan` applied to a model whose plan and mesh rules were checked (see
/// parallelize).
template <class Plan>
std::unique_ptr<ParallelModel> apply_strategies(
    const DeviceMesh& mesh, std::vector<std::shared_ptr<torch::nn::Module>> modules,
    ParallelizeOptions options) {
  check_reshard_name(options.reshard);
  auto model =
      make_parallel_model(mesh, std::move(modules),
                          precision::scalar_type(Plan::precision::parameters), std::move(options));
  if constexpr (precision::has_float8<typename Plan::precision>) {
    apply_float8(*model, Plan::precision::float8_scaling == precision::Scaling::rowwise);
  }
  for_each_strategy<Plan>([&]<class Policy>() {
    if constexpr (parallel_strategy<strategy<Policy>, Plan>) {
      strategy<Policy>::template apply<Plan>(*model);
    }
    if constexpr (std::is_same_v<Policy, typename Plan::expert_parallel>) {
      apply_moe_balance(*model);  // after the experts are placed, whatever the policy
    }
  });
  tie_stage_parameters(*model);
  return model;
}

}  // namespace detail

/// Applies the strategies of `Plan` to `modules` (the whole model, or this rank's pipeline stages
/// in stage order) in strategy_order, after checking the plan's rules (compile time) and the
/// mesh's (start-up). Collective over the mesh: every rank calls it with the same structure of
/// modules (per pipeline rank). d9d::compose<Plan> (d9d/train/compose.hpp) does the same for the
/// trainer, with the mesh checked once when it is resolved.
template <class Plan>
std::unique_ptr<ParallelModel> parallelize(const DeviceMesh& mesh,
                                           std::vector<std::shared_ptr<torch::nn::Module>> modules,
                                           ParallelizeOptions options = {}) {
  check_plan<Plan>();
  check_mesh<Plan>(mesh.shape());
  return detail::apply_strategies<Plan>(mesh, std::move(modules), std::move(options));
}

}  // namespace d9d::parallel
