// d9d/parallel/fully_shard.cpp — FullyShard (ZeRO-3 / HSDP): sharded parameters gathered per unit
// around their use, gradients reduce-scattered as each unit's backward completes.
//
// Layout. Every trained parameter p with n rows (its first dimension; a row is the rest) is split
// by torch.chunk's rule over the W ranks of dp_shard: c = ceil(n / W) rows per rank, rank r holding
// rows [r c, min((r + 1) c, n)). The shard is a leaf in the precision's parameter dtype: what the
// optimizer updates and what the parameter record points to (placement Shard(0) on dp_shard,
// Replicate on dp_replicate). A unit (a d9d::model::Block, or the parameters outside every block)
// packs its parameters' shards, each padded to c rows, into one flat segment of S elements, the
// same size on every rank: the all-gather of the segments is [W, S], and parameter p's rows are
// the p-columns of it, in rank order. The module keeps its parameter tensors (the same TensorImpl,
// so forward code, saved tensors and autograd leaves stay valid); their data lives in one storage
// per unit in the compute dtype, which is freed (its bytes released, size 0) when the unit is
// resharded and allocated again — the same storage object, so tensors saved for backward see the
// values again — when it is gathered. Gathers write through a separate alias of the storage, so
// the parameters' version counters do not move and autograd's saved-tensor checks stay quiet.
//
// Gradients. A post-accumulate-grad hook on each gathered parameter counts a unit's gradients; once
// all are there (every node that used the unit's parameters has run), the whole gradients are
// packed as the gather's layout in the reduce dtype and reduce-scattered (summed), the unit may be
// freed, and the result is added to the shards' .grad (after an all-reduce over dp_replicate for
// HSDP) once two later units' reductions are launched, or when the microbatch's backward ends: at
// most three units' whole gradients wait in the reduce dtype. Units are reduced in one fixed order
// on every rank (reverse forward order, the unit of loose parameters last), so collectives match
// across ranks.
//
// Context parallelism. With cp > 1 the shards are over dp_shard x cp_shard (the dense domain's
// dp_cp_shard), each cp rank holding other rows like another dp_shard rank, and the HSDP
// all-reduce runs over dp_replicate x cp_replicate: the gathered parameters are the same on every
// cp rank, their gradients (of different tokens) summed by the reduce-scatter.
//
// Float8 gather (d9d::precision::WeightGather::float8). The weights of float8 linear layers
// (model::Float8Linear) are quantised on their owner ranks and gathered as float8 bytes with their
// float32 scales, by a second all-gather of the unit (bytes); the gathered rows and scales land in
// a second storage of the unit, which the layer's Float8Linear::weight views and which is freed
// and allocated with the first. Per row, a row's scale depends on that row alone; per tensor, the
// shards' largest magnitudes are all-reduced (max, as float bits: d9d/kernels/float8_sharded.hpp)
// over the shard group first — one small all-reduce per unit and gather, queued on the device
// without a host wait — and every owner quantises its rows with the whole weight's scale. Either
// way the gathered float8 weight is exactly what the layer would compute from the whole bfloat16
// weight. Such a weight has no place in the compute-dtype storage: its parameter tensor keeps its
// shape over a freed storage (nothing reads its values), while its gradient is reduce-scattered
// like every other (the reduction's layout counts every parameter). The layer's backward keeps
// the weight's transpose (its input gradient's operand) on Float8Linear::weight_transposed for the
// step's later microbatches; freeing or gathering the unit drops it, so under reshard "never" a
// weight is transposed once per step instead of once per microbatch, for one more byte per
// parameter while the unit stays gathered.
//
// Experts. Under ExpertParallel the routed experts are records of the expert domain, already split
// over ep_shard; when ep_replicate > 1 a second state shards them (their ep_shard slices) the same
// way over ep_replicate — ZeRO-3 over the expert-data ranks of one HSDP replica — with the same
// units (the blocks), so a block's forward gathers its regular parameters over dp_shard and its
// experts over ep_replicate; under HSDP the experts' shard gradients are all-reduced over
// ep_dp_replicate (the replicas) like the regular ones over dp_replicate. Their records nest:
// Shard(0) on ep_shard, then Shard(0) on ep_replicate (Replicate on ep_dp_replicate).
#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <d9d/core/collectives.hpp>
#include <d9d/kernels/float8.hpp>
#include <d9d/kernels/float8_sharded.hpp>
#include <d9d/model/block.hpp>
#include <d9d/model/layers.hpp>
#include <d9d/parallel/parallelize.hpp>

namespace d9d::parallel::detail {
namespace {

// Releases a storage's bytes (every tensor on it keeps its sizes and must not be read).
void free_storage(const c10::Storage& storage) {
  auto* impl = storage.unsafeGetStorageImpl();
  if (impl->nbytes() == 0) {
    return;
  }
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
}

// Gives a freed storage `nbytes` again (fresh memory from its allocator).
void alloc_storage(const c10::Storage& storage, std::size_t nbytes) {
  auto* impl = storage.unsafeGetStorageImpl();
  if (impl->nbytes() == nbytes) {
    return;
  }
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

// Bytes rounded up to 16, so that every float8 weight and scale starts aligned.
int64_t aligned(int64_t bytes) { return (bytes + 15) / 16 * 16; }

struct Param {
  std::size_t record = 0;  // index into the model's records
  at::Tensor full;         // the module's parameter (its data: a slice of the unit's storage)
  std::vector<int64_t> shape;
  int64_t rows = 0;            // n
  int64_t row_numel = 0;       // elements per row
  int64_t chunk_rows = 0;      // c
  ShardRange held;             // this rank's rows
  int64_t segment_offset = 0;  // in the unit's reduction segment (elements)
  int64_t gather_offset = 0;   // in the unit's compute-dtype gather segment (elements)
  int64_t full_offset = 0;     // in the unit's storage (elements)
  at::Tensor shard;            // the record's local tensor
  // Gathered as float8 (a float8 linear layer's weight under the float8 gather): the layer's
  // settings, and byte offsets of its rows and scales (one per row, or one) in the float8 segment
  // and storage.
  model::Float8Linear* float8 = nullptr;
  int64_t f8_data_offset = 0;
  int64_t f8_scale_offset = 0;
  int64_t f8_full_data_offset = 0;
  int64_t f8_full_scale_offset = 0;
};

struct Unit {
  std::string name;
  std::vector<std::size_t> params;
  int64_t segment_numel = 0;  // the reduction's segment: every parameter
  int64_t gather_numel = 0;   // the compute-dtype gather's: all but the float8 ones
  int64_t full_numel = 0;
  c10::Storage storage;
  bool gathered = false;
  at::Tensor gather_output;  // an all-gather in flight (with gather_work)
  c10::intrusive_ptr<c10d::Work> gather_work;
  int64_t f8_segment_bytes = 0;  // the float8 gather's segment (0: none)
  int64_t f8_full_bytes = 0;
  c10::Storage f8_storage;
  at::Tensor f8_gather_output;
  c10::intrusive_ptr<c10d::Work> f8_gather_work;
  // The whole weights' largest magnitudes (float8_amax_bits' form, the compute dtype's rounding)
  // of the unit's per-tensor float8 weights, in order, taken for the step by begin_step (undefined:
  // gathers take them one unit at a time).
  at::Tensor f8_amax;
  std::size_t pending = 0;  // gradients still to come in this backward
  bool reduced = false;     // reduce-scatter launched in this backward
  bool block = false;       // a d9d::model::Block (else the unit of loose parameters)
  bool reshard_after_forward = false;
};

// Which records a state shards, over which mesh dims, and how their records read afterwards.
struct ShardLayout {
  MeshDomain domain = MeshDomain::regular;
  std::string shard_dim = "dp_shard";
  // The dims whose ranks hold the same shards (HSDP's replicas, context parallelism's cp ranks):
  // the shards' gradients are all-reduced over them. Empty: none.
  std::vector<std::string> replicate_dims = {"dp_replicate"};
  std::vector<std::string> dims = {"dp_replicate", "dp_shard"};
  std::vector<Placement> placements = {::d9d::Replicate{}, ::d9d::Shard{0}};
};

// Reductions launched and not yet added to the shards' gradients, at most (launch_reduction).
constexpr std::size_t kReductionsInFlight = 2;
// Gradients of at least this many elements are packed for the reduce-scatter one rank's slice at
// a time (see launch_reduction).
constexpr int64_t kSlicedCopyNumel = int64_t{1} << 22;

struct Reduction {
  std::size_t unit = 0;
  at::Tensor input;  // kept alive until the collective is done
  at::Tensor output;
  c10::intrusive_ptr<c10d::Work> work;
};

class FullyShardState;

ProcessGroup replicate_group_of(const DeviceMesh& mesh, const ShardLayout& layout) {
  if (layout.replicate_dims.empty()) {
    return {};
  }
  if (layout.replicate_dims.size() == 1) {
    return mesh.group(layout.domain, layout.replicate_dims.front());
  }
  return mesh.group(layout.domain, layout.replicate_dims);
}

// Identity in forward; its backward gathers the unit again before the unit's own backward runs
// (it sits on the unit's output) and starts gathering the units before it.
struct PreBackward : torch::autograd::Function<PreBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            int64_t state, int64_t unit) {
    ctx->saved_data["state"] = state;
    ctx->saved_data["unit"] = unit;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

class FullyShardState : public std::enable_shared_from_this<FullyShardState> {
 public:
  FullyShardState(ParallelModel& model, FullyShardSettings settings, ShardLayout layout)
      : model_(model),
        settings_(std::move(settings)),
        layout_(std::move(layout)),
        shard_group_(model.mesh().group(layout_.domain, layout_.shard_dim)),
        replicate_group_(replicate_group_of(model.mesh(), layout_)),
        world_(std::max(1, shard_group_.size())),
        rank_(shard_group_.size() > 1 ? shard_group_.rank() : 0),
        device_(model.mesh().context().device()) {}

  // Under a pipeline program (GradientTiming::program) blocks are gathered by their hooks within
  // the program's actions, freed as the reshard setting says (and after each action by
  // action_done), and reductions start from module_done() and finish(), never from the hooks.
  [[nodiscard]] bool program_order() const { return settings_.timing == GradientTiming::program; }

  // Sorts the records into units, shards them and points the modules at the units' storages.
  void build() {
    auto& records = model_.mutable_parameters();
    if (settings_.float8_gather) {
      for (const auto& module : model_.modules()) {
        for (const auto& item : module->named_modules()) {
          auto linear = std::dynamic_pointer_cast<model::LinearImpl>(item.value());
          if (linear && linear->float8) {
            float8_layers_[linear->weight.unsafeGetTensorImpl()] = &*linear->float8;
          }
        }
      }
    }
    std::vector<std::pair<model::Block*, std::string>> blocks;
    // Outermost blocks, in registration (= forward) order, with their parameters' name prefixes.
    const auto& modules = model_.modules();
    for (std::size_t m = 0; m < modules.size(); ++m) {
      for (const auto& item : modules[m]->named_modules()) {
        auto* block = dynamic_cast<model::Block*>(item.value().get());
        if (block == nullptr) {
          continue;
        }
        const std::string prefix = item.key().empty() ? std::string() : item.key() + ".";
        const bool inside = std::any_of(blocks.begin(), blocks.end(), [&](const auto& outer) {
          return !outer.second.empty() && prefix.rfind(outer.second, 0) == 0;
        });
        if (!inside) {
          blocks.emplace_back(block, prefix);
          block_module_.push_back(m);
        }
      }
    }
    units_.resize(blocks.size() + 1);
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      units_[b].name = blocks[b].second.empty() ? "block" : blocks[b].second;
      units_[b].block = true;
    }
    units_.back().name = "(parameters outside blocks)";
    for (std::size_t i = 0; i < records.size(); ++i) {
      if (records[i].domain != layout_.domain) {
        continue;  // the other domain's records (experts, or the rest) are another state's
      }
      std::size_t unit = blocks.size();
      for (std::size_t b = 0; b < blocks.size(); ++b) {
        if (!blocks[b].second.empty() && records[i].name.rfind(blocks[b].second, 0) == 0) {
          unit = b;
          break;
        }
      }
      add_param(unit, i, records[i]);
    }
    const std::size_t last_block = blocks.empty() ? 0 : blocks.size() - 1;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      auto& unit = units_[u];
      unit.reshard_after_forward =
          unit.block && (settings_.reshard == "after_forward" ||
                         (settings_.reshard == "all_but_last" && u != last_block));
      place(unit);
    }
    // Reduction order: blocks in reverse forward order, then the loose parameters.
    for (std::size_t b = blocks.size(); b-- > 0;) {
      reduce_order_.push_back(b);
    }
    reduce_order_.push_back(units_.size() - 1);
    blocks_ = std::move(blocks);
  }

  void install_hooks() {
    const std::weak_ptr<FullyShardState> weak = shared_from_this();
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      auto* block = blocks_[b].first;
      block->add_forward_pre_hook([weak, b] {
        if (auto state = weak.lock()) {
          state->before_forward(b);
        }
      });
      block->add_forward_post_hook([weak, b](const at::Tensor& out) {
        if (auto state = weak.lock()) {
          return state->after_forward(b, out);
        }
        return out;
      });
    }
    for (std::size_t u = 0; u < units_.size(); ++u) {
      for (const auto p : units_[u].params) {
        if (params_[p].full.requires_grad()) {
          torch::autograd::impl::set_post_acc_grad_hooks(params_[p].full,
                                                         std::make_unique<ReadyHook>(weak, u));
        }
      }
    }
  }

  void remove_hooks() {
    for (const auto& [block, prefix] : blocks_) {
      block->clear_block_hooks();
    }
    for (const auto& param : params_) {
      if (param.full.requires_grad()) {
        torch::autograd::impl::set_post_acc_grad_hooks(param.full, nullptr);
      }
    }
  }

  // ---- the step
  // ----------------------------------------------------------------------------------

  void begin_step() {
    const std::lock_guard<std::mutex> lock(mutex_);
    take_step_maxima();
    if (program_order()) {
      // Reductions start from module_done() and finish() only, never from the gradient hooks
      // (pending counts are per microbatch, which a program does not announce).
      armed_ = false;
      for (auto& unit : units_) {
        unit.reduced = false;
      }
      started_early_ = 0;
      peak_bytes_ = 0;
      // Blocks are gathered by their forward hooks, within the program's actions; the loose
      // parameters (embedding, head, ...), which no block's hooks cover, for the whole step.
      ensure_gathered(units_.size() - 1);
      return;
    }
    peak_bytes_ = 0;
    // The loose parameters (embedding, head, ...) are used outside any block's hooks.
    ensure_gathered(units_.size() - 1);
    if (!blocks_.empty()) {
      start_gather(0);
    }
  }

  void before_backward(int microbatch, int microbatches) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (microbatch > 0) {
      flush_unreduced();  // the previous microbatch's units that got no gradient
      complete_reductions();
    }
    armed_ = model_.options().reduce_every_microbatch || microbatch + 1 == microbatches;
    next_reduce_ = 0;
    for (auto& unit : units_) {
      unit.pending = 0;
      for (const auto p : unit.params) {
        unit.pending += params_[p].full.requires_grad() ? 1 : 0;
      }
      unit.reduced = false;
    }
  }

  void finish() {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (program_order()) {
      // The units module_done() did not start (reduced is reset in begin_step).
      for (const auto u : reduce_order_) {
        launch_reduction(u);
      }
    } else {
      flush_unreduced();
    }
    complete_reductions();
    for (std::size_t u = 0; u < units_.size(); ++u) {
      reshard(u);
      units_[u].f8_amax = at::Tensor();  // the optimizer changes the weights next
    }
  }

  // Under a pipeline program: the blocks of module `module` have their step's gradients; their
  // reductions start now, in the fixed reduction order (the loose parameters, which may span
  // modules, wait for finish()).
  void module_done(std::size_t module) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!program_order()) {
      return;
    }
    for (const auto u : reduce_order_) {
      if (u < block_module_.size() && block_module_[u] == module && !units_[u].reduced) {
        launch_reduction(u);
        started_early_ += units_[u].params.empty() ? 0 : 1;
      }
    }
  }

  // Under a pipeline program: an action of module `module` has run. Its blocks that reshard after
  // forward are freed (a backward action regathered them; a forward one freed them already),
  // unless this rank's next action is on the same module, which would gather them again at once.
  void action_done(std::size_t module, int64_t next_module) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!program_order() || next_module == static_cast<int64_t>(module)) {
      return;
    }
    for (std::size_t b = 0; b < blocks_.size(); ++b) {
      if (block_module_[b] == module && units_[b].reshard_after_forward) {
        reshard(b);
      }
    }
  }

  [[nodiscard]] std::size_t started_early() const { return started_early_; }

  [[nodiscard]] int64_t extra_bytes() const {
    int64_t bytes = 0;
    for (const auto& unit : units_) {
      bytes += static_cast<int64_t>(unit.storage.nbytes());
      bytes += unit.f8_storage ? static_cast<int64_t>(unit.f8_storage.nbytes()) : 0;
    }
    return bytes;
  }

  [[nodiscard]] int64_t peak_extra_bytes() const { return std::max(peak_bytes_, extra_bytes()); }

  // ---- hooks
  // ---------------------------------------------------------------------------------------

  void before_forward(std::size_t b) {
    const std::lock_guard<std::mutex> lock(mutex_);
    ensure_gathered(b);
    // Under a pipeline program the next blocks in forward order may belong to another stage, whose
    // actions come who knows when: prefetch within the stage only.
    for (int k = 1; k <= model_.options().prefetch && b + k < blocks_.size(); ++k) {
      if (!program_order() || same_stage(b, b + static_cast<std::size_t>(k))) {
        start_gather(b + static_cast<std::size_t>(k));
      }
    }
  }

  at::Tensor after_forward(std::size_t b, const at::Tensor& out) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!units_[b].reshard_after_forward || units_[b].params.empty()) {
      return out;
    }
    reshard(b);
    lock.unlock();
    if (!at::GradMode::is_enabled() || !out.requires_grad()) {
      return out;
    }
    return PreBackward::apply(out, reinterpret_cast<int64_t>(this), static_cast<int64_t>(b));
  }

  void before_backward_of(std::size_t b) {
    const std::lock_guard<std::mutex> lock(mutex_);
    ensure_gathered(b);
    if (program_order()) {  // this block's gradients of this backward, counted down by the hooks
      units_[b].pending = 0;
      for (const auto p : units_[b].params) {
        units_[b].pending += params_[p].full.requires_grad() ? 1 : 0;
      }
    }
    for (int k = 1; k <= model_.options().prefetch && b >= static_cast<std::size_t>(k); ++k) {
      if (units_[b - k].reshard_after_forward &&
          (!program_order() || same_stage(b, b - static_cast<std::size_t>(k)))) {
        start_gather(b - static_cast<std::size_t>(k));
      }
    }
  }

  void gradient_ready(std::size_t u) {
    const std::lock_guard<std::mutex> lock(mutex_);
    auto& unit = units_[u];
    if (program_order()) {
      // Reductions start from module_done. A block whose every gradient of this backward arrived
      // (counted from its PreBackward) is freed; under split backward its weights' gradients come
      // in W actions instead, so it waits for action_done.
      if (unit.pending > 0 && --unit.pending == 0 && unit.reshard_after_forward) {
        reshard(u);
      }
      return;
    }
    if (unit.pending > 0) {
      --unit.pending;
    }
    if (unit.pending > 0) {
      return;
    }
    if (!armed_) {
      // Gradients accumulate in the whole parameters until the reducing microbatch.
      if (unit.reshard_after_forward) {
        reshard(u);
      }
      return;
    }
    launch_ready();
  }

 private:
  class ReadyHook : public torch::autograd::PostAccumulateGradHook {
   public:
    ReadyHook(std::weak_ptr<FullyShardState> state, std::size_t unit)
        : state_(std::move(state)), unit_(unit) {}
    void operator()(const torch::autograd::Variable& /*tensor*/) override {
      if (auto state = state_.lock()) {
        state->gradient_ready(unit_);
      }
    }

   private:
    std::weak_ptr<FullyShardState> state_;
    std::size_t unit_;
  };

  [[nodiscard]] bool same_stage(std::size_t a, std::size_t b) const {
    return block_module_[a] == block_module_[b];
  }

  void add_param(std::size_t u, std::size_t index, ParameterRecord& record) {
    const auto& full = record.local;
    if (full.dim() == 0) {
      throw std::invalid_argument("d9d::parallel::FullyShard: parameter \"" + record.name +
                                  "\" is a scalar; only tensors with a first dimension shard");
    }
    Param param;
    param.record = index;
    param.full = full;
    param.shape = full.sizes().vec();
    param.rows = full.size(0);
    param.row_numel = param.rows == 0 ? 0 : full.numel() / param.rows;
    param.chunk_rows = (param.rows + world_ - 1) / world_;
    param.held = shard_range(param.rows, world_, rank_);
    auto& unit = units_[u];
    param.segment_offset = unit.segment_numel;
    unit.segment_numel += param.chunk_rows * param.row_numel;
    if (const auto found = float8_layers_.find(full.unsafeGetTensorImpl());
        found != float8_layers_.end() && full.dim() == 2) {
      param.float8 = found->second;
      const bool rowwise = param.float8->rowwise;
      param.f8_data_offset = unit.f8_segment_bytes;
      param.f8_scale_offset = param.f8_data_offset + aligned(param.chunk_rows * param.row_numel);
      unit.f8_segment_bytes = param.f8_scale_offset + aligned((rowwise ? param.chunk_rows : 1) * 4);
      param.f8_full_data_offset = unit.f8_full_bytes;
      param.f8_full_scale_offset =
          param.f8_full_data_offset + aligned(param.rows * param.row_numel);
      unit.f8_full_bytes = param.f8_full_scale_offset + aligned((rowwise ? param.rows : 1) * 4);
    } else {
      param.gather_offset = unit.gather_numel;
      unit.gather_numel += param.chunk_rows * param.row_numel;
      param.full_offset = unit.full_numel;
      unit.full_numel += full.numel();
    }
    // The shard: this rank's rows, in the parameter dtype; what the optimizer updates.
    {
      const at::NoGradGuard no_grad;
      param.shard = full.detach().narrow(0, param.held.offset, param.held.length).clone();
    }
    param.shard.requires_grad_(true);
    record.local = param.shard;
    // The dims of strategies applied before (tensor parallelism's tp) stay, before the shard dim:
    // this rank's rows are rows of the tensor that those dims left it.
    std::vector<std::string> dims;
    std::vector<Placement> placements;
    for (std::size_t i = 0; i < layout_.dims.size(); ++i) {
      if (layout_.dims[i] == layout_.shard_dim) {
        for (std::size_t j = 0; j < record.dims.size() && j < record.placements.size(); ++j) {
          if (std::find(layout_.dims.begin(), layout_.dims.end(), record.dims[j]) ==
              layout_.dims.end()) {
            dims.push_back(record.dims[j]);
            placements.push_back(record.placements[j]);
          }
        }
      }
      dims.push_back(layout_.dims[i]);
      placements.push_back(layout_.placements[i]);
    }
    record.dims = std::move(dims);
    record.placements = std::move(placements);
    unit.params.push_back(params_.size());
    params_.push_back(std::move(param));
  }

  // Allocates the unit's storage in the compute dtype, moves the parameters' data onto it and
  // leaves it gathered (the values are the whole parameters, identical on every rank). Float8
  // weights get their views on the float8 storage instead, and a parameter tensor of their shape
  // over a storage that is freed at once (nothing reads it; autograd needs its metadata).
  void place(Unit& unit) {
    const auto options = at::TensorOptions().dtype(settings_.compute_dtype).device(device_);
    const at::NoGradGuard no_grad;
    auto buffer = at::empty({unit.full_numel}, options);
    unit.storage = buffer.storage();
    auto f8_buffer = at::empty({unit.f8_full_bytes}, options.dtype(at::kByte));
    unit.f8_storage = f8_buffer.storage();
    for (const auto p : unit.params) {
      auto& param = params_[p];
      if (param.float8 != nullptr) {
        auto stand_in = at::empty({param.full.numel()}, options);
        auto view =
            at::empty({0}, options)
                .set_(stand_in.storage(), 0, param.shape, c10::contiguous_strides(param.shape));
        free_storage(stand_in.storage());
        param.full.set_data(view);
        auto scale = at::empty({0}, options.dtype(at::kFloat));
        if (param.float8->rowwise) {
          scale.set_(unit.f8_storage, param.f8_full_scale_offset / 4, {param.rows, 1}, {1, 1});
        } else {
          scale.set_(unit.f8_storage, param.f8_full_scale_offset / 4, {}, {});
        }
        param.float8->weight = kernels::Float8Tensor{
            .data = at::empty({0}, options.dtype(at::kFloat8_e4m3fn))
                        .set_(unit.f8_storage, param.f8_full_data_offset,
                              {param.rows, param.row_numel}, {param.row_numel, 1}),
            .scale = scale};
        continue;
      }
      auto view = at::empty({0}, options)
                      .set_(unit.storage, param.full_offset, param.shape,
                            c10::contiguous_strides(param.shape));
      view.copy_(param.full.detach());
      param.full.set_data(view);
    }
    unit.gathered = true;
    reshard(static_cast<std::size_t>(&unit - units_.data()));
  }

  [[nodiscard]] at::Tensor storage_alias(const Unit& unit) const {
    return at::empty({0}, at::TensorOptions().dtype(settings_.compute_dtype).device(device_))
        .set_(unit.storage, 0, {unit.full_numel}, {1});
  }

  void start_gather(std::size_t u) {
    auto& unit = units_[u];
    if (unit.gathered || unit.gather_work || unit.gather_output.defined() ||
        unit.f8_gather_output.defined()) {
      return;
    }
    if (unit.params.empty()) {  // e.g. a dense block in the experts' state: nothing to gather
      unit.gathered = true;
      return;
    }
    const at::NoGradGuard no_grad;
    const auto options = at::TensorOptions().dtype(settings_.compute_dtype).device(device_);
    auto input = at::empty({unit.gather_numel}, options);
    for (const auto p : unit.params) {
      const auto& param = params_[p];
      if (param.float8 == nullptr) {
        input.narrow(0, param.gather_offset, param.held.length * param.row_numel)
            .copy_(param.shard.detach().reshape({-1}));
      }
    }
    if (world_ == 1 || unit.gather_numel == 0) {
      unit.gather_output = input;
    } else {
      unit.gather_output = at::empty({world_ * unit.gather_numel}, options);
      unit.gather_work = shard_group_.backend()->_allgather_base(unit.gather_output, input);
    }
    if (unit.f8_segment_bytes > 0) {
      start_float8_gather(unit);
    }
  }

  // The largest magnitudes of every per-tensor float8 weight of the model, for the whole step
  // (the weights do not change within it): one all-reduce at its start instead of one per unit
  // and gather, each of which made the compute stream wait for the other ranks in the middle of
  // the forward. Taken from the shards as held (e.g. float32): rounding to the compute dtype is
  // monotonic, so the rounded maximum is the maximum of the rounded values that
  // start_float8_gather quantises.
  void take_step_maxima() {
    std::vector<at::Tensor> maxima;
    std::vector<std::pair<std::size_t, int64_t>> spans;  // unit, its maxima
    for (std::size_t u = 0; u < units_.size(); ++u) {
      const auto before = static_cast<int64_t>(maxima.size());
      for (const auto p : units_[u].params) {
        const auto& param = params_[p];
        if (param.float8 != nullptr && !param.float8->rowwise) {
          maxima.push_back(kernels::float8_amax_bits(
              param.shard.detach().reshape({param.held.length, param.row_numel})));
        }
      }
      if (static_cast<int64_t>(maxima.size()) > before) {
        spans.emplace_back(u, static_cast<int64_t>(maxima.size()) - before);
      }
    }
    if (maxima.empty()) {
      return;
    }
    const at::NoGradGuard no_grad;
    const auto amax = maxima_over_shards(maxima)
                          .view(at::kFloat)
                          .to(settings_.compute_dtype)
                          .to(at::kFloat)
                          .view(at::kInt);
    int64_t next = 0;
    for (const auto& [u, count] : spans) {
      units_[u].f8_amax = amax.narrow(0, next, count);
      next += count;
    }
  }

  // Per-tensor largest magnitudes (float bits, one per tensor, from this rank's rows): the maximum
  // over the shard group, i.e. of the whole tensors.
  [[nodiscard]] at::Tensor maxima_over_shards(const std::vector<at::Tensor>& maxima) const {
    const auto amax = at::stack(maxima);
    return world_ > 1 ? all_reduce(shard_group_, amax, ReduceOp::max) : amax;
  }

  // This rank's rows of the unit's float8 weights, quantised from the compute dtype as the layer
  // would quantise the whole weight (per row; or per tensor with the whole weight's largest
  // magnitude, all-reduced first), with their scales, all-gathered as bytes.
  void start_float8_gather(Unit& unit) {
    const auto bytes = at::TensorOptions().dtype(at::kByte).device(device_);
    auto input = at::empty({unit.f8_segment_bytes}, bytes);
    std::vector<at::Tensor> rows(unit.params.size());
    std::vector<at::Tensor> maxima;  // the per-tensor weights' largest magnitudes (bits), in order
    for (std::size_t i = 0; i < unit.params.size(); ++i) {
      const auto& param = params_[unit.params[i]];
      if (param.float8 == nullptr) {
        continue;
      }
      rows[i] = param.shard.detach()
                    .reshape({param.held.length, param.row_numel})
                    .to(settings_.compute_dtype);
      if (!param.float8->rowwise && !unit.f8_amax.defined()) {
        maxima.push_back(kernels::float8_amax_bits(rows[i]));
      }
    }
    const at::Tensor amax = maxima.empty() ? unit.f8_amax : maxima_over_shards(maxima);
    int64_t next_amax = 0;
    for (std::size_t i = 0; i < unit.params.size(); ++i) {
      const auto& param = params_[unit.params[i]];
      if (param.float8 == nullptr) {
        continue;
      }
      const bool rowwise = param.float8->rowwise;
      if (rowwise && param.held.length == 0) {
        continue;
      }
      const auto q = rowwise ? kernels::float8_quantize(rows[i], at::kFloat8_e4m3fn, true)
                             : kernels::float8_quantize_with_amax(rows[i], amax[next_amax++],
                                                                  at::kFloat8_e4m3fn);
      input.narrow(0, param.f8_data_offset, param.held.length * param.row_numel)
          .copy_(q.data.view(at::kByte).reshape({-1}));
      input.narrow(0, param.f8_scale_offset, (rowwise ? param.held.length : 1) * 4)
          .copy_(q.scale.reshape({-1}).view(at::kByte));
    }
    if (world_ == 1) {
      unit.f8_gather_output = input;
      return;
    }
    unit.f8_gather_output = at::empty({world_ * unit.f8_segment_bytes}, bytes);
    unit.f8_gather_work = shard_group_.backend()->_allgather_base(unit.f8_gather_output, input);
  }

  void finish_gather(std::size_t u) {
    auto& unit = units_[u];
    if (unit.gathered) {
      return;
    }
    if (!unit.gather_output.defined()) {
      start_gather(u);
    }
    if (unit.gather_work) {
      unit.gather_work->wait();
      unit.gather_work.reset();
    }
    const at::NoGradGuard no_grad;
    alloc_storage(unit.storage, static_cast<std::size_t>(unit.full_numel) *
                                    c10::elementSize(settings_.compute_dtype));
    const auto alias = storage_alias(unit);
    const auto gathered = unit.gather_output.view({world_, unit.gather_numel});
    for (const auto p : unit.params) {
      const auto& param = params_[p];
      if (param.float8 != nullptr) {
        continue;
      }
      const auto rows = gathered.narrow(1, param.gather_offset, param.chunk_rows * param.row_numel)
                            .reshape({world_ * param.chunk_rows, param.row_numel})
                            .narrow(0, 0, param.rows);
      alias.narrow(0, param.full_offset, param.rows * param.row_numel)
          .view({param.rows, param.row_numel})
          .copy_(rows);
    }
    unit.gather_output = at::Tensor();
    if (unit.f8_segment_bytes > 0) {
      finish_float8_gather(unit);
    }
    unit.gathered = true;
    peak_bytes_ = std::max(peak_bytes_, extra_bytes());
  }

  // The gathered float8 rows and scales into the unit's float8 storage (bytes to bytes).
  void finish_float8_gather(Unit& unit) {
    if (unit.f8_gather_work) {
      unit.f8_gather_work->wait();
      unit.f8_gather_work.reset();
    }
    alloc_storage(unit.f8_storage, static_cast<std::size_t>(unit.f8_full_bytes));
    const auto alias = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device_))
                           .set_(unit.f8_storage, 0, {unit.f8_full_bytes}, {1});
    const auto gathered = unit.f8_gather_output.view({world_, unit.f8_segment_bytes});
    for (const auto p : unit.params) {
      const auto& param = params_[p];
      if (param.float8 == nullptr) {
        continue;
      }
      const int64_t c = param.chunk_rows;
      alias.narrow(0, param.f8_full_data_offset, param.rows * param.row_numel)
          .view({param.rows, param.row_numel})
          .copy_(gathered.narrow(1, param.f8_data_offset, c * param.row_numel)
                     .reshape({world_ * c, param.row_numel})
                     .narrow(0, 0, param.rows));
      if (param.float8->rowwise) {
        alias.narrow(0, param.f8_full_scale_offset, param.rows * 4)
            .copy_(gathered.narrow(1, param.f8_scale_offset, c * 4)
                       .reshape({world_ * c * 4})
                       .narrow(0, 0, param.rows * 4));
      } else {  // every rank sent the same scale
        alias.narrow(0, param.f8_full_scale_offset, 4)
            .copy_(gathered[0].narrow(0, param.f8_scale_offset, 4));
      }
    }
    unit.f8_gather_output = at::Tensor();
  }

  void ensure_gathered(std::size_t u) {
    start_gather(u);
    finish_gather(u);
  }

  void reshard(std::size_t u) {
    auto& unit = units_[u];
    if (unit.gather_work) {
      unit.gather_work->wait();  // a prefetch nobody used: let it land before dropping it
      unit.gather_work.reset();
    }
    unit.gather_output = at::Tensor();
    free_storage(unit.storage);
    if (unit.f8_gather_work) {
      unit.f8_gather_work->wait();
      unit.f8_gather_work.reset();
    }
    unit.f8_gather_output = at::Tensor();
    if (unit.f8_storage) {
      free_storage(unit.f8_storage);
      drop_float8_transposes(unit);
    }
    unit.gathered = false;
  }

  // The layers' float8 weights transposed by their backward (Float8Linear::weight_transposed)
  // belong to the unit's gathered values: dropped when those are freed (a unit is gathered only
  // after it was freed, so no gather finds an older transpose).
  void drop_float8_transposes(const Unit& unit) {
    for (const auto p : unit.params) {
      if (params_[p].float8 != nullptr) {
        params_[p].float8->weight_transposed = kernels::Float8Tensor{};
      }
    }
  }

  // Launches the reductions of ready units in the fixed order.
  void launch_ready() {
    while (next_reduce_ < reduce_order_.size()) {
      const auto u = reduce_order_[next_reduce_];
      if (units_[u].pending > 0) {
        return;
      }
      launch_reduction(u);
      ++next_reduce_;
    }
  }

  // The units of this backward still unreduced (some parameter got no gradient), in order.
  void flush_unreduced() {
    if (!armed_) {
      return;
    }
    for (; next_reduce_ < reduce_order_.size(); ++next_reduce_) {
      launch_reduction(reduce_order_[next_reduce_]);
    }
  }

  void launch_reduction(std::size_t u) {
    auto& unit = units_[u];
    if (unit.reduced) {
      return;
    }
    unit.reduced = true;
    if (unit.params.empty()) {
      return;
    }
    const at::NoGradGuard no_grad;
    const auto options = at::TensorOptions().dtype(settings_.reduce_dtype).device(device_);
    // A large gradient goes rank slice by rank slice, contiguous to contiguous: one vectorised
    // copy-and-cast each (a single strided copy into the [world, segment] layout ran at ~1 TB/s
    // on H200, 50 ms per step of the 8B shape's 8.2B elements); a small one, split evenly, in one
    // strided copy (a launch per rank cost more host time than it saved). Only what no gradient
    // covers is zeroed.
    auto input = at::empty({world_ * unit.segment_numel}, options);
    const auto laid = input.view({world_, unit.segment_numel});
    for (const auto p : unit.params) {
      auto& param = params_[p];
      auto& grad = param.full.mutable_grad();
      const int64_t c = param.chunk_rows;
      const auto flat = grad.defined() ? grad.reshape({-1}) : at::Tensor();
      if (flat.defined() && param.rows == c * world_ && flat.numel() < kSlicedCopyNumel) {
        laid.narrow(1, param.segment_offset, c * param.row_numel)
            .copy_(flat.view({world_, c * param.row_numel}));
      } else {
        for (int64_t r = 0; r < world_; ++r) {
          const auto slot = laid.select(0, r).narrow(0, param.segment_offset, c * param.row_numel);
          const int64_t given = flat.defined() ? std::clamp<int64_t>(param.rows - r * c, 0, c) : 0;
          if (given > 0) {
            slot.narrow(0, 0, given * param.row_numel)
                .copy_(flat.narrow(0, r * c * param.row_numel, given * param.row_numel));
          }
          if (given < c) {
            slot.narrow(0, given * param.row_numel, (c - given) * param.row_numel).zero_();
          }
        }
      }
      grad = at::Tensor();  // the whole gradient is not needed any more
    }
    Reduction reduction{.unit = u, .input = input, .output = at::Tensor(), .work = {}};
    if (world_ == 1) {
      reduction.output = input;
    } else {
      reduction.output = at::empty({unit.segment_numel}, options);
      reduction.work = shard_group_.backend()->_reduce_scatter_base(reduction.output, input);
    }
    reductions_.push_back(std::move(reduction));
    if (unit.reshard_after_forward && !program_order()) {
      reshard(u);
    }
    // Each reduction holds its unit's whole gradient in the reduce dtype until it is completed:
    // kept for a whole backward, that is twice the model in float32 (an 8B model's 33 GB per rank
    // on 2 ranks). The oldest is completed once more than kReductionsInFlight wait; launched two
    // units ago, it has usually finished, and NCCL's wait only orders the compute stream after it.
    while (reductions_.size() > kReductionsInFlight) {
      complete_oldest();
    }
  }

  // Waits for the oldest launched reduction and adds it to the shards' gradients.
  void complete_oldest() {
    const at::NoGradGuard no_grad;
    const Reduction reduction = std::move(reductions_.front());
    reductions_.pop_front();
    if (reduction.work) {
      reduction.work->wait();
    }
    auto out = reduction.output;
    if (replicate_group_.valid() && replicate_group_.size() > 1) {
      out = all_reduce(replicate_group_, out);  // HSDP: the replicas' sums
    }
    const auto& unit = units_[reduction.unit];
    for (const auto p : unit.params) {
      auto& param = params_[p];
      if (!param.full.requires_grad()) {
        continue;
      }
      const int64_t numel = param.held.length * param.row_numel;
      auto& grad = param.shard.mutable_grad();
      if (out.scalar_type() != param.shard.scalar_type()) {
        auto part = out.narrow(0, param.segment_offset, numel)
                        .view(param.shard.sizes())
                        .to(param.shard.scalar_type());
        grad = grad.defined() ? grad.add_(part) : part;
      } else if (grad.defined()) {
        grad.add_(out.narrow(0, param.segment_offset, numel).view(param.shard.sizes()));
      } else {
        // The reduction's output becomes the gradient, with no copy: a tensor of its own over the
        // output's storage (not a view: optimizers detach gradients in place, which views
        // refuse); the unit's shards share that buffer, which nothing else holds.
        grad = at::empty({0}, out.options())
                   .set_(out.storage(), out.storage_offset() + param.segment_offset,
                         param.shard.sizes());
      }
    }
  }

  // Waits for the launched reductions, oldest first, and adds them to the shards' gradients.
  void complete_reductions() {
    while (!reductions_.empty()) {
      complete_oldest();
    }
  }

  ParallelModel& model_;
  FullyShardSettings settings_;
  ShardLayout layout_;
  ProcessGroup shard_group_;
  ProcessGroup replicate_group_;
  int64_t world_;
  int rank_;
  c10::Device device_;
  std::vector<Param> params_;
  std::vector<Unit> units_;  // the blocks in forward order, then the loose parameters
  std::vector<std::pair<model::Block*, std::string>> blocks_;
  std::vector<std::size_t> block_module_;  // block -> index of its module in model_.modules()
  std::vector<std::size_t> reduce_order_;
  std::size_t started_early_ = 0;
  int64_t peak_bytes_ = 0;            // the most gathered at once in this step
  std::deque<Reduction> reductions_;  // launched, oldest first
  // Under the float8 gather: the float8 linear layers, by their weight's TensorImpl.
  std::unordered_map<const c10::TensorImpl*, model::Float8Linear*> float8_layers_;
  std::size_t next_reduce_ = 0;
  bool armed_ = false;
  std::mutex mutex_;
};

torch::autograd::variable_list PreBackward::backward(torch::autograd::AutogradContext* ctx,
                                                     torch::autograd::variable_list grads) {
  // NOLINTNEXTLINE(performance-no-int-to-ptr): the state's address, stored by forward()
  auto* state = reinterpret_cast<FullyShardState*>(ctx->saved_data["state"].toInt());
  state->before_backward_of(static_cast<std::size_t>(ctx->saved_data["unit"].toInt()));
  return {grads[0], torch::autograd::Variable(), torch::autograd::Variable()};
}

class FullyShardSync : public GradientSync {
 public:
  explicit FullyShardSync(std::shared_ptr<FullyShardState> state) : state_(std::move(state)) {}
  ~FullyShardSync() override { state_->remove_hooks(); }
  FullyShardSync(const FullyShardSync&) = delete;
  FullyShardSync& operator=(const FullyShardSync&) = delete;
  FullyShardSync(FullyShardSync&&) = delete;
  FullyShardSync& operator=(FullyShardSync&&) = delete;

  void begin_step() override { state_->begin_step(); }
  void before_backward(int microbatch, int microbatches) override {
    state_->before_backward(microbatch, microbatches);
  }
  void module_done(std::size_t module) override { state_->module_done(module); }
  void action_done(std::size_t module, int64_t next_module) override {
    state_->action_done(module, next_module);
  }
  [[nodiscard]] int64_t peak_extra_bytes() const override { return state_->peak_extra_bytes(); }
  void finish() override { state_->finish(); }
  [[nodiscard]] std::size_t started_early() const override { return state_->started_early(); }
  [[nodiscard]] int64_t extra_bytes() const override { return state_->extra_bytes(); }

 private:
  std::shared_ptr<FullyShardState> state_;
};

}  // namespace

void apply_fully_shard(ParallelModel& model, const FullyShardSettings& settings) {
  check_reshard_name(settings.reshard);
  ShardLayout layout;
  const auto& shape = model.mesh().shape();
  if (shape.cp_shard * shape.cp_replicate > 1) {
    // Context parallelism: the parameters are sharded over dp_shard x cp_shard together (the
    // dense domain's dp_cp_shard, as FSDP's dp_cp mesh) and the shards' gradients all-reduced
    // over dp_replicate x cp_replicate. The records move to the dense domain: their replicated
    // dp_shard and cp_shard become dp_cp_shard, which the layout shards.
    layout = ShardLayout{.domain = MeshDomain::dense,
                         .shard_dim = "dp_cp_shard",
                         .replicate_dims = {"dp_replicate", "cp_replicate"},
                         .dims = {"dp_replicate", "dp_cp_shard"},
                         .placements = {::d9d::Replicate{}, ::d9d::Shard{0}}};
    for (auto& record : model.mutable_parameters()) {
      if (record.domain != MeshDomain::regular) {
        continue;
      }
      std::vector<std::string> dims;
      std::vector<Placement> placements;
      for (std::size_t i = 0; i < record.dims.size(); ++i) {
        if (record.dims[i] != "dp_shard" && record.dims[i] != "cp_shard") {
          dims.push_back(record.dims[i]);
          placements.push_back(record.placements[i]);
        }
      }
      dims.emplace_back("dp_cp_shard");
      placements.emplace_back(::d9d::Replicate{});
      record.domain = MeshDomain::dense;
      record.dims = std::move(dims);
      record.placements = std::move(placements);
    }
  }
  const auto domain = layout.domain;
  auto state = std::make_shared<FullyShardState>(model, settings, layout);
  state->build();
  state->install_hooks();
  model.add_norm_dims({layout.shard_dim}, domain);
  // Shards of tensor-parallel shards: sharded on dp_shard and tp (every rank has the same sets).
  for (const auto& record : model.parameters()) {
    if (record.domain == domain) {
      model.add_norm_dims(record.sharded_dims(), domain);
    }
  }
  model.add_sync(std::make_unique<FullyShardSync>(std::move(state)));
  // ExpertParallel's experts (expert domain, split over ep_shard): sharded over the expert-data
  // ranks as well when there are several; ExpertParallel's all-reduce then finds them sharded.
  const auto& records = model.parameters();
  const bool experts = std::any_of(records.begin(), records.end(), [](const auto& record) {
    return record.domain == MeshDomain::expert;
  });
  if (experts && model.mesh().size(MeshDomain::expert, "ep_replicate") > 1) {
    // Under HSDP (dp_replicate > 1) the experts are sharded within a replica and their shards'
    // gradients all-reduced over the replicas (ep_dp_replicate), as the regular parameters are.
    auto expert_state = std::make_shared<FullyShardState>(
        model, settings,
        ShardLayout{.domain = MeshDomain::expert,
                    .shard_dim = "ep_replicate",
                    .replicate_dims = {"ep_dp_replicate"},
                    .dims = {"ep_dp_replicate", "ep_shard", "ep_replicate"},
                    .placements = {::d9d::Replicate{}, ::d9d::Shard{0}, ::d9d::Shard{0}}});
    expert_state->build();
    expert_state->install_hooks();
    model.add_norm_dims({"ep_replicate", "ep_shard"}, MeshDomain::expert);
    model.add_sync(std::make_unique<FullyShardSync>(std::move(expert_state)));
  }
}

}  // namespace d9d::parallel::detail
