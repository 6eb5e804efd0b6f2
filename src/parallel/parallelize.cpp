// d9d/parallel/parallelize.cpp — parameter records, the gradient path and mesh-aware clipping.
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <d9d/core/collectives.hpp>
#include <d9d/kernels/scale.hpp>
#include <d9d/model/embedding_rows.hpp>
#include <d9d/parallel/detail/embedding_rows.hpp>
#include <d9d/parallel/parallelize.hpp>
#include <d9d/parallel/replicate.hpp>

namespace d9d::parallel {

std::vector<std::string> ParameterRecord::sharded_dims() const {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < dims.size() && i < placements.size(); ++i) {
    if (std::holds_alternative<::d9d::Shard>(placements[i])) {
      out.push_back(dims[i]);
    }
  }
  return out;
}

ShardedTensor ParameterRecord::sharded(const DeviceMesh& mesh) const {
  return {local.detach(), mesh, domain, dims, placements, global_shape};
}

struct ParallelModel::Impl {
  Impl(const DeviceMesh& mesh_in, std::vector<std::shared_ptr<torch::nn::Module>> modules_in,
       ParallelizeOptions options_in)
      : mesh(mesh_in), modules(std::move(modules_in)), options(std::move(options_in)) {}
  DeviceMesh mesh;
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  ParallelizeOptions options;
  std::vector<ParameterRecord> records;
  std::vector<ParameterRecord> frozen_split;
  std::vector<std::unique_ptr<GradientSync>> syncs;
  // (domain, sorted dim set), in registration order
  std::vector<std::pair<MeshDomain, std::vector<std::string>>> norm_dims;
};

ParallelModel::ParallelModel(const DeviceMesh& mesh,
                             std::vector<std::shared_ptr<torch::nn::Module>> modules,
                             ParallelizeOptions options)
    : impl_(std::make_unique<Impl>(mesh, std::move(modules), std::move(options))) {}

// The syncs go first: their hooks on the modules point into them.
ParallelModel::~ParallelModel() {
  if (impl_) {
    while (!impl_->syncs.empty()) {
      impl_->syncs.pop_back();
    }
  }
}

const DeviceMesh& ParallelModel::mesh() const { return impl_->mesh; }
const ParallelizeOptions& ParallelModel::options() const { return impl_->options; }
const std::vector<std::shared_ptr<torch::nn::Module>>& ParallelModel::modules() const {
  return impl_->modules;
}
const std::vector<ParameterRecord>& ParallelModel::parameters() const { return impl_->records; }
std::vector<ParameterRecord>& ParallelModel::mutable_parameters() { return impl_->records; }

std::vector<at::Tensor> ParallelModel::locals() const {
  std::vector<at::Tensor> out;
  out.reserve(impl_->records.size());
  for (const auto& record : impl_->records) {
    out.push_back(record.local);
  }
  return out;
}

const ParameterRecord* ParallelModel::find(const std::string& name) const {
  for (const auto& record : impl_->records) {
    if (record.name == name) {
      return &record;
    }
  }
  return nullptr;
}

const std::vector<ParameterRecord>& ParallelModel::frozen_split_parameters() const {
  return impl_->frozen_split;
}
std::vector<ParameterRecord>& ParallelModel::mutable_frozen_split_parameters() {
  return impl_->frozen_split;
}

const ParameterRecord* ParallelModel::layout(const std::string& name) const {
  if (const auto* record = find(name); record != nullptr) {
    return record;
  }
  for (const auto& record : impl_->frozen_split) {
    if (record.name == name) {
      return &record;
    }
  }
  return nullptr;
}

void ParallelModel::add_sync(std::unique_ptr<GradientSync> sync) {
  impl_->syncs.push_back(std::move(sync));
}

void ParallelModel::add_final_sync(std::unique_ptr<GradientSync> sync) {
  impl_->syncs.insert(impl_->syncs.begin(), std::move(sync));  // finish runs them in reverse
}

void ParallelModel::add_norm_dims(std::vector<std::string> dims, MeshDomain domain) {
  std::sort(dims.begin(), dims.end());
  auto key = std::make_pair(domain, std::move(dims));
  if (!key.second.empty() &&
      std::find(impl_->norm_dims.begin(), impl_->norm_dims.end(), key) == impl_->norm_dims.end()) {
    impl_->norm_dims.push_back(std::move(key));
  }
}

void ParallelModel::begin_step() {
  for (const auto& sync : impl_->syncs) {
    sync->begin_step();
  }
}

void ParallelModel::before_forward(int microbatch, int microbatches) {
  for (const auto& sync : impl_->syncs) {
    sync->before_forward(microbatch, microbatches);
  }
}

void ParallelModel::before_backward(int microbatch, int microbatches) {
  for (const auto& sync : impl_->syncs) {
    sync->before_backward(microbatch, microbatches);
  }
}

void ParallelModel::module_done(std::size_t module) {
  if (module >= impl_->modules.size()) {
    throw std::out_of_range("d9d::parallel::ParallelModel::module_done: module " +
                            std::to_string(module) + " of " +
                            std::to_string(impl_->modules.size()));
  }
  for (auto it = impl_->syncs.rbegin(); it != impl_->syncs.rend(); ++it) {
    (*it)->module_done(module);
  }
}

void ParallelModel::action_done(std::size_t module, int64_t next_module) {
  for (const auto& sync : impl_->syncs) {
    sync->action_done(module, next_module);
  }
}

std::size_t ParallelModel::reductions_started_early() const {
  std::size_t started = 0;
  for (const auto& sync : impl_->syncs) {
    started += sync->started_early();
  }
  return started;
}

std::string ParallelModel::graph_blocker() const {
  for (const auto& sync : impl_->syncs) {
    if (auto reason = sync->graph_blocker(); !reason.empty()) {
      return reason;
    }
  }
  return "";
}

void ParallelModel::finish() {
  for (auto it = impl_->syncs.rbegin(); it != impl_->syncs.rend(); ++it) {
    (*it)->finish();
  }
}

namespace {

// The sum of the squares of `tensors` (a float64 scalar under `options`): each gradient's norm in
// at least float32 (float64 gradients in float64: precision::Fp64 keeps its exactness), one
// foreach call per such dtype: on CUDA a few launches for all the parameters instead of one norm
// each.
at::Tensor squares_of(const std::vector<at::Tensor>& tensors, const at::TensorOptions& options) {
  if (tensors.empty()) {
    return at::zeros({}, options);
  }
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& grad : tensors) {
    by_dtype[at::promote_types(grad.scalar_type(), at::kFloat)].push_back(grad);
  }
  std::vector<at::Tensor> parts;
  parts.reserve(by_dtype.size());
  for (const auto& [dtype, group] : by_dtype) {
    parts.push_back(at::stack(at::_foreach_norm(group, 2, dtype)).to(options));
  }
  return at::cat(parts).pow(2).sum();
}

// `grads` divided by `total_weight` and clipped to `max_norm`, given the global sum of their
// squares `squares` (float64); returns the norm before clipping. The norm of the summed gradients
// over the weight is the normalized gradients' norm: one pass over the gradients scales them by
// both (dividing first, then clipping, read and wrote every gradient twice). All of it on the
// device, in float64: the host does not wait here.
at::Tensor scale_gradients(const std::vector<at::Tensor>& grads, const at::Tensor& squares,
                           const at::Tensor& total_weight, std::optional<double> max_norm) {
  const auto weight = total_weight.to(squares.options());
  const auto grad_norm = squares.sqrt() / weight;
  auto scale = weight.reciprocal();
  if (max_norm) {
    scale = scale * at::where(grad_norm > *max_norm, *max_norm / (grad_norm + 1e-6),
                              at::ones({}, squares.options()));
  }
  // One d9d::scale_ per gradient dtype (src/kernels/scale.cpp): bfloat16 gradients times the
  // float32 scale in one launch (at::_foreach_mul_ took its per-tensor route for them), the others
  // with the scale in their dtype.
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& grad : grads) {
    by_dtype[grad.scalar_type()].push_back(grad);
  }
  for (const auto& entry : by_dtype) {
    kernels::scale(entry.second, scale);
  }
  return grad_norm;
}

}  // namespace

double ParallelModel::normalize_and_clip(double total_weight, std::optional<double> max_norm) {
  const auto weight = at::scalar_tensor(
      total_weight, at::TensorOptions().dtype(at::kDouble).device(impl_->mesh.context().device()));
  return normalize_and_clip(weight, max_norm).item<double>();
}

at::Tensor ParallelModel::normalize_and_clip(const at::Tensor& total_weight,
                                             std::optional<double> max_norm) {
  auto& s = *impl_;
  const at::NoGradGuard no_grad;
  // Squares per set of sharded dims: replicated parameters count once, shards are summed over the
  // dims that shard them. The sets are those the mesh allows, in one fixed order on every rank.
  using NormKey = std::pair<MeshDomain, std::vector<std::string>>;
  std::map<NormKey, std::vector<at::Tensor>> norms;
  std::vector<at::Tensor> grads;
  for (const auto& record : s.records) {
    if (!record.local.grad().defined()) {
      continue;
    }
    auto grad = at::Tensor(record.local).mutable_grad();
    grads.push_back(grad);
    if (record.tied_copy) {
      continue;  // divided and clipped like its first holder, counted once (there)
    }
    auto dims = record.sharded_dims();
    std::sort(dims.begin(), dims.end());
    // Replicated parameters count once, whatever their domain.
    const NormKey key{dims.empty() ? MeshDomain::regular : record.domain, dims};
    norms[key];  // registers the set even if this rank's part is empty
    if (grad.numel() > 0) {
      norms[key].push_back(grad);
    }
  }
  const auto device = s.mesh.context().device();
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  // Every rank reduces over the same groups in the same order: the sets the strategies registered
  // (the same on every rank), not the ones this rank's parameters happen to use.
  at::Tensor total = squares_of(norms[NormKey{MeshDomain::regular, {}}], options);
  for (const auto& key : s.norm_dims) {
    const auto found = norms.find(key);
    const auto part =
        found != norms.end() ? squares_of(found->second, options) : at::zeros({}, options);
    total = total + all_reduce(s.mesh.group(key.first, key.second), part);
  }
  for (const auto& [key, tensors] : norms) {
    if (!key.second.empty() &&
        std::find(s.norm_dims.begin(), s.norm_dims.end(), key) == s.norm_dims.end()) {
      throw std::logic_error(
          "d9d::parallel: parameters are sharded on mesh dims no strategy "
          "registered for the gradient norm (add_norm_dims)");
    }
  }
  // Pipeline stages hold different parameters.
  if (s.mesh.size(MeshDomain::regular, "pp") > 1) {
    total = all_reduce(s.mesh.group(MeshDomain::regular, "pp"), total);
  }
  return scale_gradients(grads, total, total_weight, max_norm);
}

int64_t ParallelModel::parameter_bytes() const {
  int64_t bytes = 0;
  for (const auto& record : impl_->records) {
    bytes += static_cast<int64_t>(record.local.nbytes());
  }
  return bytes;
}

int64_t ParallelModel::gradient_bytes() const {
  int64_t bytes = 0;
  for (const auto& record : impl_->records) {
    if (record.local.grad().defined()) {
      bytes += static_cast<int64_t>(record.local.grad().nbytes());
    }
  }
  return bytes;
}

std::vector<std::pair<std::string, double>> ParallelModel::metrics() const {
  std::vector<std::pair<std::string, double>> out;
  for (const auto& sync : impl_->syncs) {
    auto part = sync->metrics();
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

int64_t ParallelModel::extra_bytes() const {
  int64_t bytes = 0;
  for (const auto& sync : impl_->syncs) {
    bytes += sync->extra_bytes();
  }
  return bytes;
}

int64_t ParallelModel::peak_extra_bytes() const {
  int64_t bytes = 0;
  for (const auto& sync : impl_->syncs) {
    bytes += sync->peak_extra_bytes();
  }
  return bytes;
}

namespace detail {

std::unique_ptr<ParallelModel> make_parallel_model(
    const DeviceMesh& mesh, std::vector<std::shared_ptr<torch::nn::Module>> modules,
    at::ScalarType dtype, ParallelizeOptions options) {
  auto model = std::make_unique<ParallelModel>(mesh, std::move(modules), std::move(options));
  const at::NoGradGuard no_grad;
  const auto dp = mesh.group(MeshDomain::batch, "dp");
  for (const auto& module : model->modules()) {
    module->train();
    for (auto& item : module->named_parameters()) {
      auto& param = item.value();
      if (at::isFloatingType(param.scalar_type()) && param.scalar_type() != dtype) {
        param.set_data(param.data().to(dtype));
      }
      if (!param.requires_grad()) {
        continue;
      }
      // Replicas start from dp rank 0's values, whatever each rank's initialisation did.
      if (dp.size() > 1) {
        param.copy_(broadcast(dp, param.detach(), 0));
      }
      model->mutable_parameters().push_back(
          ParameterRecord{.name = item.key(),
                          .local = param,
                          .global_shape = param.sizes().vec(),
                          .domain = MeshDomain::regular,
                          .dims = {"dp_replicate", "dp_shard"},
                          .placements = {::d9d::Replicate{}, ::d9d::Replicate{}}});
    }
  }
  return model;
}

void rerecord_parameters(ParallelModel& model) {
  const at::NoGradGuard no_grad;
  auto& records = model.mutable_parameters();
  std::set<const void*> recorded;
  for (const auto& record : records) {
    recorded.insert(record.local.unsafeGetTensorImpl());
  }
  records.clear();
  const auto dp = model.mesh().group(MeshDomain::batch, "dp");
  for (const auto& module : model.modules()) {
    for (auto& item : module->named_parameters()) {
      auto& param = item.value();
      if (!param.requires_grad()) {
        continue;
      }
      if (dp.size() > 1 && recorded.count(param.unsafeGetTensorImpl()) == 0) {
        param.copy_(broadcast(dp, param.detach(), 0));
      }
      records.push_back(ParameterRecord{.name = item.key(),
                                        .local = param,
                                        .global_shape = param.sizes().vec(),
                                        .domain = MeshDomain::regular,
                                        .dims = {"dp_replicate", "dp_shard"},
                                        .placements = {::d9d::Replicate{}, ::d9d::Replicate{}}});
    }
  }
}

namespace {

// A tied embedding whose last lookup Replicate defers (design note 0030): the model, and the sink
// its lookups consult while the sync says so.
struct DeferredEmbedding {
  std::shared_ptr<torch::nn::Module> module;  // keeps the model while the sink is set on it
  model::EmbeddingRowsModel* model = nullptr;
  std::shared_ptr<detail::ReplicatedEmbeddingRows> rows;
};

// Replicate's gradient path: the bucketed all-reduce of the last microbatch's backward. Under a
// pipeline program with the parameters split by module (`by_module`), one reducer per module
// starts when the program has finished that module's gradients (module_done), so its all-reduce
// overlaps the rest of the program; finish() starts the others and waits for all. With a
// DeferredEmbedding the last forward's lookup defers: the tied weight, complete after the head's
// backward, is the first bucket, and its lookup rows are added after the reduction.
class ReplicateSync : public GradientSync {
 public:
  ReplicateSync(const ProcessGroup& group, std::vector<std::vector<at::Tensor>> parts,
                int64_t bucket_bytes, GradientTiming timing, bool by_module,
                std::optional<at::ScalarType> reduce_dtype = std::nullopt,
                ReduceEngine engine = ReduceEngine::backend, DeferredEmbedding embedding = {})
      : program_(timing == GradientTiming::program),
        by_module_(by_module),
        ranks_(group.size()),
        embedding_(std::move(embedding)) {
    std::vector<at::Tensor> first;
    if (embedding_.model != nullptr) {
      first.push_back(embedding_.model->embedding_weight());
      embedding_.model->set_embedding_row_sink(embedding_.rows);
    }
    for (auto& part : parts) {
      reducers_.push_back(std::make_unique<GradientReducer>(
          group, std::move(part),
          parallel::GradientReducerOptions{.bucket_bytes = bucket_bytes,
                                           .reduce_dtype = reduce_dtype,
                                           .engine = engine,
                                           .first = first}));
    }
    done_.assign(reducers_.size(), false);
  }
  ~ReplicateSync() override {
    if (embedding_.model != nullptr) {
      embedding_.model->set_embedding_row_sink(nullptr);
    }
  }
  ReplicateSync(const ReplicateSync&) = delete;
  ReplicateSync& operator=(const ReplicateSync&) = delete;
  ReplicateSync(ReplicateSync&&) = delete;
  ReplicateSync& operator=(ReplicateSync&&) = delete;

  void begin_step() override {
    std::fill(done_.begin(), done_.end(), false);
    started_ = 0;
  }
  void before_forward(int microbatch, int microbatches) override {
    if (embedding_.rows && microbatch + 1 == microbatches) {
      embedding_.rows->begin();
    }
  }
  void before_backward(int microbatch, int microbatches) override {
    if (microbatch + 1 == microbatches) {
      for (auto& reducer : reducers_) {
        reducer->arm();
      }
    }
  }
  void module_done(std::size_t module) override {
    if (!program_ || !by_module_ || module >= reducers_.size() || done_[module]) {
      return;
    }
    done_[module] = true;
    reducers_[module]->arm();
    reducers_[module]->launch_all();
    started_ += reducers_[module]->bucket_count();
  }
  void finish() override {
    for (std::size_t m = 0; m < reducers_.size(); ++m) {
      if (program_ && !done_[m]) {
        // Weight gradients may come from W actions, outside autograd's hooks: reduce them now.
        reducers_[m]->arm();
      }
      reducers_[m]->finish();
    }
    if (embedding_.rows) {
      embedding_.rows->finish();
    }
  }
  [[nodiscard]] std::size_t started_early() const override { return started_; }
  // One rank reduces nothing and registers no hooks (GradientReducer).
  [[nodiscard]] std::string graph_blocker() const override {
    return ranks_ <= 1 ? std::string()
                       : "Replicate over " + std::to_string(ranks_) +
                             " ranks launches its all-reduces from gradient hooks";
  }

 private:
  std::vector<std::unique_ptr<GradientReducer>> reducers_;
  std::vector<bool> done_;
  std::size_t started_ = 0;
  bool program_;  // GradientTiming::program
  bool by_module_;
  int ranks_;
  DeferredEmbedding embedding_;
};

// The tied embedding Replicate defers, when the options ask for it, the step runs no pipeline,
// the group spans the whole mesh (no tensor-parallel or sharded copies of the weight) and one
// module is a model whose trained, replicated, tied embedding weight is in `part`.
DeferredEmbedding deferred_embedding(const ParallelModel& model, GradientTiming timing,
                                     const ProcessGroup& group,
                                     const std::vector<at::Tensor>& part) {
  if (!model.options().tied_embedding_rows || timing != GradientTiming::backward ||
      group.size() <= 1 || group.size() != model.mesh().context().world().size()) {
    return {};
  }
  for (const auto& module : model.modules()) {
    auto* target = dynamic_cast<model::EmbeddingRowsModel*>(module.get());
    if (target == nullptr || !target->embedding_tied()) {
      continue;
    }
    const auto weight = target->embedding_weight();
    const bool replicated =
        weight.requires_grad() &&
        std::any_of(part.begin(), part.end(), [&](const auto& p) { return p.is_same(weight); });
    if (!replicated) {
      continue;
    }
    return {.module = module,
            .model = target,
            .rows = std::make_shared<detail::ReplicatedEmbeddingRows>(group, weight)};
  }
  return {};
}

}  // namespace

void apply_replicate(ParallelModel& model, GradientTiming timing, at::ScalarType reduce_dtype) {
  // The parameters on the regular domain; others (experts) are reduced by their own strategy.
  // Under a pipeline program they are split by the module (stage) holding them.
  const bool by_module = timing == GradientTiming::program;
  const auto& modules = model.modules();
  std::map<const c10::TensorImpl*, std::size_t> module_of;
  if (by_module) {
    for (std::size_t m = 0; m < modules.size(); ++m) {
      for (const auto& param : modules[m]->parameters()) {
        module_of.emplace(param.unsafeGetTensorImpl(), m);
      }
    }
  }
  std::vector<std::vector<at::Tensor>> parts(by_module ? std::max<std::size_t>(modules.size(), 1)
                                                       : 1);
  for (const auto& record : model.parameters()) {
    if (record.domain != MeshDomain::regular) {
      continue;
    }
    const auto it = module_of.find(record.local.unsafeGetTensorImpl());
    parts[it == module_of.end() ? parts.size() - 1 : it->second].push_back(record.local);
  }
  const auto group = data_parallel_group(model.mesh());
  auto embedding =
      by_module ? DeferredEmbedding{} : deferred_embedding(model, timing, group, parts.front());
  const auto& context = model.mesh().context();
  const auto engine = model.options().reduce_engine.value_or(
      automatic_reduce_engine(group, context.world().size(), context.local_world_size(),
                              timing == GradientTiming::program));
  model.add_sync(std::make_unique<ReplicateSync>(group, std::move(parts),
                                                 model.options().bucket_bytes, timing, by_module,
                                                 reduce_dtype, engine, std::move(embedding)));
}

std::unique_ptr<GradientSync> make_replicate_sync(const ProcessGroup& group,
                                                  std::vector<at::Tensor> parameters,
                                                  int64_t bucket_bytes, GradientTiming timing) {
  std::vector<std::vector<at::Tensor>> parts;
  parts.push_back(std::move(parameters));
  return std::make_unique<ReplicateSync>(group, std::move(parts), bucket_bytes, timing,
                                         /*by_module=*/false);
}

namespace {

// The gradients of parameters tied across pipeline stages, summed over their holders after every
// other reduction (ParallelModel::add_final_sync), so that each holder gets the whole gradient.
class TiedSync : public GradientSync {
 public:
  struct Tie {
    std::string name;
    ProcessGroup group;  ///< the holding pp ranks; invalid when this rank holds every copy
  };
  TiedSync(const ParallelModel& model, std::vector<Tie> ties)
      : model_(model), ties_(std::move(ties)) {}

  void finish() override {
    const at::NoGradGuard no_grad;
    for (const auto& tie : ties_) {
      // The records' local tensors are looked up now: strategies may have replaced them (shards).
      std::vector<at::Tensor> holders;
      for (const auto& record : model_.parameters()) {
        if (record.name == tie.name) {
          holders.push_back(record.local);
        }
      }
      at::Tensor sum;
      for (const auto& local : holders) {
        const auto& grad = local.grad();
        const auto part = grad.defined() ? grad : at::zeros_like(local);
        sum = sum.defined() ? sum + part : part.clone();
      }
      if (!sum.defined()) {
        continue;
      }
      if (tie.group.valid() && tie.group.size() > 1) {
        sum = all_reduce(tie.group, sum);
      }
      for (auto& local : holders) {
        auto& grad = local.mutable_grad();
        if (grad.defined()) {
          grad.copy_(sum);
        } else {
          grad = sum.clone();
        }
      }
    }
  }

 private:
  const ParallelModel& model_;
  std::vector<Tie> ties_;
};

}  // namespace

void tie_stage_parameters(ParallelModel& model) {
  auto& records = model.mutable_parameters();
  const auto& mesh = model.mesh();
  std::map<std::string, int> local_count;  // this rank's records per name
  for (const auto& record : records) {
    ++local_count[record.name];
  }
  // The pp ranks holding each name (this rank alone without a pipeline across ranks).
  std::map<std::string, std::vector<int>> holders;
  ProcessGroup pp;
  int pp_rank = 0;
  if (mesh.size(MeshDomain::regular, "pp") > 1) {
    pp = mesh.group(MeshDomain::regular, "pp");
    pp_rank = pp.rank();
    std::string names;
    for (const auto& item : local_count) {
      names += item.first;
      names += '\n';
    }
    const auto all = all_gather_bytes(pp, names);
    for (std::size_t r = 0; r < all.size(); ++r) {
      std::size_t begin = 0;
      for (std::size_t end = all[r].find('\n'); end != std::string::npos;
           begin = end + 1, end = all[r].find('\n', begin)) {
        holders[all[r].substr(begin, end - begin)].push_back(static_cast<int>(r));
      }
    }
  } else {
    for (const auto& item : local_count) {
      holders[item.first] = {0};
    }
  }
  // In name order on every rank: the holders of a name create its group in the same order.
  std::vector<TiedSync::Tie> ties;
  for (const auto& [name, ranks] : holders) {
    const auto found = local_count.find(name);
    if (found == local_count.end() || (ranks.size() < 2 && found->second < 2)) {
      continue;  // not held here, or held once
    }
    bool first = ranks.front() == pp_rank;
    for (auto& record : records) {
      if (record.name == name) {
        record.tied_copy = !first;
        first = false;
      }
    }
    TiedSync::Tie tie{.name = name, .group = {}};
    if (ranks.size() > 1) {
      if (static_cast<int>(ranks.size()) == pp.size()) {
        tie.group = pp;
      } else {
        std::vector<int> global;
        global.reserve(ranks.size());
        for (const int r : ranks) {
          global.push_back(pp.ranks()[static_cast<std::size_t>(r)]);
        }
        std::sort(global.begin(), global.end());
        tie.group = mesh.context().group(global, "tied[" + name + "]");
      }
    }
    ties.push_back(std::move(tie));
  }
  if (!ties.empty()) {
    model.add_final_sync(std::make_unique<TiedSync>(model, std::move(ties)));
  }
}

void require_degree_one(const char* degree, int value, const char* policy, const char* fix,
                        const char* alternative) {
  if (value != 1) {
    throw std::invalid_argument(std::string("d9d::parallel: the mesh has ") + degree + " = " +
                                std::to_string(value) + ", but the plan's " + policy +
                                " does not split anything over it. Fix: " + fix + ", or " +
                                alternative);
  }
}

void check_reshard_name(const std::string& name) {
  if (name != "after_forward" && name != "never" && name != "all_but_last") {
    throw std::invalid_argument("d9d::parallel::FullyShard: reshard \"" + name +
                                "\" is not one of \"after_forward\", \"never\", \"all_but_last\"");
  }
}

}  // namespace detail
}  // namespace d9d::parallel
