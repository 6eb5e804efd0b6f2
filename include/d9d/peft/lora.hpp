// d9d/peft/lora.hpp — LoRA adapters on d9d::model::Linear: applying a peft stack, merge and
// unmerge, adapter files in the format of Hugging Face's `peft` library both ways, and the merged
// model as a Hugging Face checkpoint.
//
//   d9d::peft::apply_stack(*model, d9d::peft::stack_spec<d9d::peft::Lora<8, 16, "*.q_proj">>());
//   d9d::peft::save_adapter(*model, "out/adapter");     // adapter_model.safetensors + config
//   d9d::peft::merge(*model);  ...  d9d::peft::unmerge(*model);        // exact round trip
//   d9d::peft::save_merged_hf_checkpoint(*model, "out/model", model->config().to_hf_json());
//   d9d::peft::load_adapter(*other, "dir/saved/by/peft");  // PeftModel.from_pretrained's work
//
// Inside a Trainer the parallelize layer applies the plan's peft policy (strategy<Policy>, first
// of every strategy); these functions are for one process: examples, export, inference, tests.
//
// An adapted layer computes y = W x (+ b) + scale * B A dropout(x), scale = alpha / rank (alpha /
// sqrt(rank) for rsLoRA adapters loaded from peft), with A = lora_A.weight [rank, in] and B =
// lora_B.weight [out, rank] registered as child modules of the layer ("<layer>.lora_A.weight",
// "<layer>.lora_B.weight"); A and B are d9d::model::Linear, so split backward (zero-bubble
// pipelines) queues their weight gradients like the base layer's. New adapters start as peft's
// do: A uniform in +-1/sqrt(in) (Kaiming, a = sqrt(5)), B zero, so the model's output is
// unchanged; A is drawn from a generator seeded by (seed, parameter name), so every rank and
// every pipeline split draws the same values.
//
// LoRA on experts: a target that names a stacked projection of d9d::model::GroupedExperts
// ("*.experts.gate_proj", or "gate_proj", which also names every expert's gate_proj in Hugging
// Face's per-expert layout) adapts every expert of it, each with its own A [rank, in] and
// B [out, rank], stacked as "<experts>.gate_proj_lora_A" [E, rank, in] and "..._lora_B"
// [E, out, rank] (ExpertLoraAdapter): what peft puts on transformers 4's per-expert linear layers
// ("mlp.experts.<e>.gate_proj"), whose keys the adapter files use. Dropout is refused there, as
// peft refuses it on stacked expert weights.
//
// Adapter files (peft 0.17's save_pretrained): adapter_model.safetensors with keys
// "base_model.model.<layer>.lora_A.weight" / "...lora_B.weight" (and "base_model.model.<name>"
// for trained base parameters, listed as modules_to_save), and adapter_config.json with
// peft_type "LORA", r, lora_alpha, target_modules, rank_pattern / alpha_pattern for layers that
// differ, lora_dropout, use_rslora, modules_to_save, bias "none", fan_in_fan_out false.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <d9d/model/layers.hpp>
#include <d9d/model/moe.hpp>
#include <d9d/peft/stack.hpp>

namespace d9d::peft {

/// One adapter's shape and scale.
struct LoraOptions {
  int64_t rank = 8;
  double alpha = 16.0;
  double dropout = 0.0;  ///< probability, applied to the adapter's input in training mode
  bool rslora = false;   ///< scale alpha / sqrt(rank) instead of alpha / rank (peft's use_rslora)

  [[nodiscard]] double scale() const;
};

/// The adapter d9d::peft puts on a d9d::model::Linear (see the file comment).
class LoraAdapter final : public model::LinearAdapter {
 public:
  /// Registers lora_A [rank, in] and lora_B [out, rank] as child modules of `layer`, in its dtype
  /// and on its device; A from a generator seeded by (`seed`, `name` + ".lora_A.weight"), B zero.
  LoraAdapter(model::LinearImpl& layer, const LoraOptions& options, uint64_t seed,
              const std::string& name);
  /// scale * B A dropout(x), or undefined while merged.
  at::Tensor forward(const at::Tensor& x) override;
  /// {A, B, scale} for the layer to fuse (model::low_rank_linear); none while merged or while
  /// dropout is active (training with dropout > 0).
  [[nodiscard]] model::LowRankUpdate low_rank() const override;

  [[nodiscard]] const LoraOptions& options() const { return options_; }
  [[nodiscard]] bool merged() const { return original_.defined(); }
  /// scale * B A, in the base weight's dtype.
  [[nodiscard]] at::Tensor delta_weight() const;

  model::Linear lora_A{nullptr};  // NOLINT(readability-identifier-naming): peft's names
  model::Linear lora_B{nullptr};  // NOLINT(readability-identifier-naming)

 private:
  friend void merge(torch::nn::Module& model);
  friend void unmerge(torch::nn::Module& model);
  LoraOptions options_;
  at::Tensor original_;  ///< the base weight as it was before merge (defined while merged)
};

/// LoRA on every expert of one stacked projection of d9d::model::GroupedExperts (see the file
/// comment): per expert e, scale (x A_e^T) B_e^T on its rows.
class ExpertLoraAdapter final : public model::GroupedAdapter {
 public:
  /// Registers "<projection>_lora_A" [E, rank, in] and "<projection>_lora_B" [E, out, rank] on
  /// `experts` (the projection of that index in GroupedExpertsImpl::projections), in the weight's
  /// dtype and on its device; each expert's A as LoraAdapter draws one (a generator seeded by
  /// (`seed`, `name` + ".lora_A"), the experts' A one after another), B zero. `name` is the
  /// projection's name in the model. std::invalid_argument for dropout or a rank below 1.
  ExpertLoraAdapter(model::GroupedExpertsImpl& experts, std::size_t projection,
                    const LoraOptions& options, uint64_t seed, const std::string& name);
  /// The stacked factors and the scale; none while merged.
  [[nodiscard]] model::LowRankUpdate low_rank() const override;

  [[nodiscard]] const LoraOptions& options() const { return options_; }
  [[nodiscard]] bool merged() const { return original_.defined(); }

  at::Tensor lora_A;  // NOLINT(readability-identifier-naming): peft's names
  at::Tensor lora_B;  // NOLINT(readability-identifier-naming)

 private:
  friend void merge(torch::nn::Module& model);
  friend void unmerge(torch::nn::Module& model);
  LoraOptions options_;
  at::Tensor original_;  ///< the stacked weight before merge (defined while merged)
};

/// An adapted weight, by its name in the model: a linear layer ("...q_proj") with its LoraAdapter,
/// or a stacked expert projection ("...mlp.experts.gate_proj") with its ExpertLoraAdapter.
struct LoraLayer {
  std::string name;
  model::LinearImpl* layer = nullptr;            ///< null for an expert projection
  LoraAdapter* adapter = nullptr;                ///< null for an expert projection
  model::GroupedExpertsImpl* experts = nullptr;  ///< null for a linear layer
  ExpertLoraAdapter* expert_adapter = nullptr;   ///< null for a linear layer

  /// The adapted weight's name: "<name>.weight", or the expert projection's own name.
  [[nodiscard]] std::string weight_name() const;
  /// A's and B's names: "<name>.lora_A.weight" / "<name>.lora_B.weight", or "<name>_lora_A" /
  /// "<name>_lora_B" for an expert projection.
  [[nodiscard]] std::string a_name() const;
  [[nodiscard]] std::string b_name() const;
  [[nodiscard]] const LoraOptions& options() const;
  [[nodiscard]] bool merged() const;
  /// The experts stacked in the whole model (0 for a linear layer).
  [[nodiscard]] int64_t num_experts() const;
};

/// Every adapted layer of `model`, in module order (a module's expert projections in the order
/// gate_proj, up_proj, down_proj).
[[nodiscard]] std::vector<LoraLayer> lora_layers(const torch::nn::Module& model);
[[nodiscard]] bool has_lora(const torch::nn::Module& model);

/// Applies a peft policy to one model outside the parallelize layer (one process): freezes and
/// trains parameters as the stack says and puts adapters on the layers its Lora methods name.
/// std::invalid_argument when a pattern matches nothing (listing the model's modules), when a
/// Lora target is not a linear layer, or when two methods claim one parameter.
void apply_stack(torch::nn::Module& model, const StackSpec& spec, uint64_t seed = 0);

/// W += scale * B A in every adapted layer, keeping W's previous value: unmerge restores it
/// exactly. While merged the adapters add nothing to the output (the weights carry them).
/// Layers already merged are left alone. std::invalid_argument when an adapter's parameters are
/// not whole here (FullyShard between steps).
void merge(torch::nn::Module& model);
/// Restores every merged layer's weight exactly (bit for bit) and re-enables its adapter.
void unmerge(torch::nn::Module& model);

/// weight + scale * B A in weight's dtype: what merge writes into a layer, for whole tensors held
/// elsewhere (the Trainer's streamed export merges gathered adapters this way, bit for bit as
/// merge does). Stacked experts (weight [E, out, in], A [E, rank, in], B [E, out, rank]) merge
/// expert by expert.
[[nodiscard]] at::Tensor merged_weight(const at::Tensor& weight, const at::Tensor& lora_a,
                                       const at::Tensor& lora_b, const LoraOptions& options);

/// Parameters of a model, and those that train (requires_grad), counted in elements.
struct ParameterCount {
  int64_t trainable = 0;
  int64_t total = 0;
  [[nodiscard]] double trainable_percent() const {
    return total > 0 ? 100.0 * static_cast<double>(trainable) / static_cast<double>(total) : 0.0;
  }
};
[[nodiscard]] ParameterCount count_parameters(const torch::nn::Module& model);

struct AdapterExportOptions {
  /// Written as base_model_name_or_path (JSON null when empty).
  std::string base_model_name_or_path{};
  /// peft's task_type, e.g. "CAUSAL_LM" (JSON null when empty: PeftModel).
  std::string task_type{};
  at::ScalarType dtype = at::kFloat;
  /// A parameter's whole value from its name and its tensor in the model; empty: the tensor itself,
  /// which must be whole (the Trainer passes the values it gathered from FullyShard's shards).
  std::function<at::Tensor(const std::string& name, const at::Tensor& local)> whole_tensor{};
};

/// Writes dir/adapter_model.safetensors and dir/adapter_config.json (see the file comment): every
/// adapter, and every other parameter that trains (as peft's modules_to_save). Creates `dir`.
/// std::invalid_argument when the model has no adapter.
void save_adapter(const torch::nn::Module& model, const std::string& dir,
                  const AdapterExportOptions& options = {});

/// What an adapter file says about a model, without its tensors: the adapted layers in module
/// order, every module's name (peft's target_modules names a kind of layer only when every layer
/// of that kind is adapted) and every parameter with whether it trains (modules_to_save). Pipeline
/// stages each describe their part; merged in stage order they describe the whole model, so the
/// rank that writes need not hold it.
struct AdapterContents {
  struct Layer {
    std::string name;
    LoraOptions options;
    int64_t experts = 0;  ///< stacked experts of an expert projection (0: a linear layer)
  };
  std::vector<Layer> layers;
  std::vector<std::string> modules;                      ///< without the adapters' own
  std::vector<std::pair<std::string, bool>> parameters;  ///< name, trains

  /// The tensors the file is made of by model name, in the file's order: each adapter's lora_A
  /// and lora_B (an expert projection's stacked ones, which the file holds expert by expert),
  /// then every parameter of the modules to save.
  [[nodiscard]] std::vector<std::string> tensor_names() const;
  /// Appends `other`'s layers, modules and parameters not seen yet (a later pipeline stage).
  void merge(const AdapterContents& other);
  [[nodiscard]] std::string to_json() const;
  static AdapterContents from_json(const std::string& text);
};

/// The contents of `model` (a whole model or one pipeline stage).
[[nodiscard]] AdapterContents adapter_contents(const torch::nn::Module& model);

/// save_adapter from contents: `tensor(name)` gives the whole value of each of
/// contents.tensor_names(). std::invalid_argument when the contents have no adapter.
void save_adapter(const AdapterContents& contents, const std::string& dir,
                  const std::function<at::Tensor(const std::string& name)>& tensor,
                  const AdapterExportOptions& options = {});

/// What peft's PeftModel.from_pretrained(model, dir) does, for a model without adapters: reads
/// dir/adapter_config.json (target_modules as a list or a regular expression, "all-linear",
/// exclude_modules, rank_pattern, alpha_pattern, use_rslora, modules_to_save), adds the adapters,
/// copies dir/adapter_model.safetensors into them (and into the modules to save), and freezes
/// every parameter (inference). std::runtime_error naming the key for features d9d does not
/// implement (DoRA, bias, fan_in_fan_out, layer replication, ...), missing or unexpected tensors,
/// and shapes that differ.
void load_adapter(torch::nn::Module& model, const std::string& dir);

/// Copies an adapter file's tensors into a model that already has the same adapters (e.g. one a
/// Trainer<Plan<peft::Lora<...>>> built): names, shapes, rank and alpha are checked first.
void load_adapter_weights(torch::nn::Module& model, const std::string& dir);

/// The merged model as a Hugging Face checkpoint (d9d::model::save_hf_checkpoint): every base
/// parameter under its own name with the adapters merged in, no adapter tensors. The model is
/// merged for the save and left as it was (layers merged here are unmerged exactly).
void save_merged_hf_checkpoint(torch::nn::Module& model, const std::string& dir,
                               const std::string& config_json, at::ScalarType dtype = at::kFloat);

/// Whether `pattern` matches the module or parameter name `name` (d9d/peft/policies.hpp: without
/// '*', equal or a dotted suffix; with '*', a glob over the whole name).
[[nodiscard]] bool pattern_matches(std::string_view pattern, std::string_view name);

/// Whether a Freeze or Train pattern claims the parameter named `parameter` (its full name): the
/// pattern matches that name or the name of a module around it (pattern_matches).
[[nodiscard]] bool parameter_matches(std::string_view pattern, std::string_view parameter);

namespace detail {

/// Sums the counts over the ranks that hold other parts of the model (pipeline stages), so a
/// pattern that matches on another stage is not an error here. Identity in one process.
using SumOverStages = std::function<void(std::vector<int64_t>& counts)>;

/// apply_stack over several root modules (a rank's pipeline stages).
void apply_stack(const std::vector<std::shared_ptr<torch::nn::Module>>& roots,
                 const StackSpec& spec, uint64_t seed, const SumOverStages& sum_over_stages);

}  // namespace detail

}  // namespace d9d::peft
