// d9d/peft/lora.cpp — LoRA adapters, applying a peft stack to a module tree, merge and unmerge.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <stdexcept>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <d9d/peft/lora.hpp>
#include <d9d/util/did_you_mean.hpp>

namespace d9d::peft {
namespace {

// FNV-1a of the name mixed with the seed (as d9d::model::init_qwen3_parameters does).
uint64_t name_seed(uint64_t seed, const std::string& name) {
  uint64_t hash = 14695981039346656037ULL ^ seed;
  for (const char c : name) {
    hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  }
  return hash;
}

bool glob_matches(std::string_view pattern, std::string_view name) {
  // Iterative wildcard matching with backtracking to the last '*'.
  std::size_t p = 0;
  std::size_t n = 0;
  std::size_t star = std::string_view::npos;
  std::size_t resume = 0;
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = n;
    } else if (p < pattern.size() && pattern[p] == name[n]) {
      ++p;
      ++n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') {
    ++p;
  }
  return p == pattern.size();
}

bool is_adapter_child(const std::string& name) {
  const auto ends = [&](const std::string& suffix) {
    return name.size() > suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends(".lora_A") || ends(".lora_B") || name == "lora_A" || name == "lora_B";
}

std::string last_component(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(dot + 1);
}

// "model.layers.3.mlp" -> "model.layers.*.mlp": one line for every repeated layer.
std::string collapse_indices(const std::string& name) {
  std::string out;
  std::size_t start = 0;
  while (start <= name.size()) {
    auto dot = name.find('.', start);
    if (dot == std::string::npos) {
      dot = name.size();
    }
    const auto part = name.substr(start, dot - start);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(),
                                                     [](char c) { return c >= '0' && c <= '9'; });
    out += (start > 0 ? "." : "") + (digits ? std::string("*") : part);
    start = dot + 1;
  }
  return out;
}

// "d9d::model::LinearImpl" -> "Linear".
std::string kind_of(const torch::nn::Module& module) {
  std::string name = module.name();
  const auto colon = name.rfind("::");
  if (colon != std::string::npos) {
    name = name.substr(colon + 2);
  }
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) {
    name.resize(name.size() - 4);
  }
  return name;
}

using NamedModule = std::pair<std::string, std::shared_ptr<torch::nn::Module>>;

// Every named submodule of the roots (not the roots themselves, nor adapters' own layers).
std::vector<NamedModule> modules_of(const std::vector<std::shared_ptr<torch::nn::Module>>& roots) {
  std::vector<NamedModule> out;
  for (const auto& root : roots) {
    for (const auto& item : root->named_modules("", /*include_self=*/false)) {
      if (!is_adapter_child(item.key())) {
        out.emplace_back(item.key(), item.value());
      }
    }
  }
  return out;
}

// The modules, one line per repeated name: "model.layers.*.self_attn.q_proj (Linear)".
std::string module_listing(const std::vector<NamedModule>& modules) {
  std::vector<std::string> lines;
  std::set<std::string> seen;
  for (const auto& [name, module] : modules) {
    auto line = collapse_indices(name) + " (" + kind_of(*module) + ")";
    if (seen.insert(line).second) {
      lines.push_back(std::move(line));
    }
  }
  std::string out;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    out += (i > 0 ? ", " : "") + lines[i];
  }
  return out;
}

// A did-you-mean for a pattern, among the modules' last components and collapsed names.
std::string suggestion(const std::string& pattern, const std::vector<NamedModule>& modules) {
  std::vector<std::string> candidates;
  std::set<std::string> seen;
  for (const auto& [name, module] : modules) {
    for (const auto& candidate :
         {last_component(name), collapse_indices(name), "*." + last_component(name)}) {
      if (seen.insert(candidate).second) {
        candidates.push_back(candidate);
      }
    }
  }
  const auto best = util::closest_match(pattern, candidates);
  return best.empty() ? std::string() : " (did you mean \"" + best + "\"?)";
}

bool all_linear_target(const std::string& name, const torch::nn::Module& module) {
  return dynamic_cast<const model::LinearImpl*>(&module) != nullptr &&
         last_component(name) != "lm_head";
}

}  // namespace

double LoraOptions::scale() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

bool pattern_matches(std::string_view pattern, std::string_view name) {
  if (pattern.find('*') != std::string_view::npos) {
    return glob_matches(pattern, name);
  }
  if (name == pattern) {
    return true;
  }
  return name.size() > pattern.size() && name[name.size() - pattern.size() - 1] == '.' &&
         name.substr(name.size() - pattern.size()) == pattern;
}

bool parameter_matches(std::string_view pattern, std::string_view parameter) {
  if (pattern_matches(pattern, parameter)) {
    return true;
  }
  for (auto dot = parameter.find('.'); dot != std::string_view::npos;
       dot = parameter.find('.', dot + 1)) {
    if (pattern_matches(pattern, parameter.substr(0, dot))) {
      return true;
    }
  }
  return false;
}

LoraAdapter::LoraAdapter(model::LinearImpl& layer, const LoraOptions& options, uint64_t seed,
                         const std::string& name)
    : options_(options) {
  if (options.rank < 1) {
    throw std::invalid_argument("d9d::peft::LoraAdapter: rank must be >= 1 (got " +
                                std::to_string(options.rank) + ") for " + name);
  }
  const int64_t in = layer.in_features();
  const int64_t out = layer.out_features();
  lora_A = layer.register_module("lora_A", model::Linear(in, options.rank));
  lora_B = layer.register_module("lora_B", model::Linear(options.rank, out));
  lora_A->to(layer.weight.device(), layer.weight.scalar_type());
  lora_B->to(layer.weight.device(), layer.weight.scalar_type());
  lora_A->train(layer.is_training());
  lora_B->train(layer.is_training());
  const at::NoGradGuard no_grad;
  auto generator =
      at::make_generator<at::CPUGeneratorImpl>(name_seed(seed, name + ".lora_A.weight"));
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  lora_A->weight.copy_(at::empty({options.rank, in}, at::TensorOptions().dtype(at::kFloat))
                           .uniform_(-bound, bound, generator));
  lora_B->weight.zero_();
}

at::Tensor LoraAdapter::forward(const at::Tensor& x) {
  if (merged()) {
    return {};
  }
  auto input = x;
  if (options_.dropout > 0.0 && lora_A->is_training()) {
    input = at::dropout(x, options_.dropout, /*train=*/true);
  }
  // The scale multiplies the [tokens, rank] product, not the [tokens, out] delta: the same value,
  // a pass over rank columns instead of out columns, forward and backward.
  return lora_B(lora_A(input) * options_.scale());
}

model::LowRankUpdate LoraAdapter::low_rank() const {
  if (merged() || (options_.dropout > 0.0 && lora_A->is_training())) {
    return {};
  }
  return {.a = lora_A->weight, .b = lora_B->weight, .scale = options_.scale()};
}

ExpertLoraAdapter::ExpertLoraAdapter(model::GroupedExpertsImpl& experts, std::size_t projection,
                                     const LoraOptions& options, uint64_t seed,
                                     const std::string& name)
    : options_(options) {
  if (options.rank < 1) {
    throw std::invalid_argument("d9d::peft::ExpertLoraAdapter: rank must be >= 1 (got " +
                                std::to_string(options.rank) + ") for " + name);
  }
  if (options.dropout > 0.0) {
    throw std::invalid_argument(
        "d9d::peft::Lora: " + name +
        " is a stacked expert projection, where LoRA takes no dropout (the rows of every expert "
        "share one product; peft refuses lora_dropout on expert parameters too). Fix: a Lora "
        "without with_dropout for the experts, e.g. a second Lora method naming them");
  }
  const auto& weight = experts.projection(projection);
  const int64_t count = weight.size(0);
  const int64_t out = weight.size(1);
  const int64_t in = weight.size(2);
  const std::string base(model::GroupedExpertsImpl::projections.at(projection));
  const auto like = at::TensorOptions().dtype(weight.scalar_type()).device(weight.device());
  auto generator = at::make_generator<at::CPUGeneratorImpl>(name_seed(seed, name + ".lora_A"));
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  lora_A = experts.register_parameter(
      base + "_lora_A", at::empty({count, options.rank, in}, at::TensorOptions().dtype(at::kFloat))
                            .uniform_(-bound, bound, generator)
                            .to(like));
  lora_B =
      experts.register_parameter(base + "_lora_B", at::zeros({count, out, options.rank}, like));
}

model::LowRankUpdate ExpertLoraAdapter::low_rank() const {
  if (merged()) {
    return {};
  }
  return {.a = lora_A, .b = lora_B, .scale = options_.scale()};
}

std::string LoraLayer::weight_name() const { return experts != nullptr ? name : name + ".weight"; }

std::string LoraLayer::a_name() const {
  return experts != nullptr ? name + "_lora_A" : name + ".lora_A.weight";
}

std::string LoraLayer::b_name() const {
  return experts != nullptr ? name + "_lora_B" : name + ".lora_B.weight";
}

const LoraOptions& LoraLayer::options() const {
  return expert_adapter != nullptr ? expert_adapter->options() : adapter->options();
}

bool LoraLayer::merged() const {
  return expert_adapter != nullptr ? expert_adapter->merged() : adapter->merged();
}

int64_t LoraLayer::num_experts() const { return experts != nullptr ? experts->num_experts() : 0; }

at::Tensor LoraAdapter::delta_weight() const {
  const at::NoGradGuard no_grad;
  const auto& a = lora_A->weight;
  const auto& b = lora_B->weight;
  return (b.mm(a) * options_.scale());
}

std::vector<LoraLayer> lora_layers(const torch::nn::Module& model) {
  std::vector<LoraLayer> out;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    if (auto* experts = dynamic_cast<model::GroupedExpertsImpl*>(item.value().get())) {
      for (std::size_t p = 0; p < experts->adapters.size(); ++p) {
        if (auto* adapter = dynamic_cast<ExpertLoraAdapter*>(experts->adapters.at(p).get())) {
          const std::string projection(model::GroupedExpertsImpl::projections.at(p));
          out.push_back({.name = item.key().empty() ? projection : item.key() + "." + projection,
                         .experts = experts,
                         .expert_adapter = adapter});
        }
      }
      continue;
    }
    auto* layer = dynamic_cast<model::LinearImpl*>(item.value().get());
    if (layer == nullptr || !layer->adapter) {
      continue;
    }
    auto* adapter = dynamic_cast<LoraAdapter*>(layer->adapter.get());
    if (adapter != nullptr) {
      out.push_back({.name = item.key(), .layer = layer, .adapter = adapter});
    }
  }
  return out;
}

bool has_lora(const torch::nn::Module& model) { return !lora_layers(model).empty(); }

namespace {

// The adapted weight and the factors of a layer (the experts' stacked ones).
struct MergeParts {
  at::Tensor weight;
  at::Tensor a;
  at::Tensor b;
};

MergeParts merge_parts(const LoraLayer& layer) {
  if (layer.expert_adapter != nullptr) {
    const auto index = model::GroupedExpertsImpl::projection_index(last_component(layer.name));
    return {.weight = layer.experts->projection(index),
            .a = layer.expert_adapter->lora_A,
            .b = layer.expert_adapter->lora_B};
  }
  return {.weight = layer.layer->weight,
          .a = layer.adapter->lora_A->weight,
          .b = layer.adapter->lora_B->weight};
}

}  // namespace

void merge(torch::nn::Module& model) {
  const at::NoGradGuard no_grad;
  for (const auto& layer : lora_layers(model)) {
    if (layer.merged()) {
      continue;
    }
    auto parts = merge_parts(layer);
    auto& original = layer.expert_adapter != nullptr ? layer.expert_adapter->original_
                                                     : layer.adapter->original_;
    for (const auto* weight : {&parts.a, &parts.b, &parts.weight}) {
      if (weight->storage().nbytes() < static_cast<std::size_t>(weight->nbytes())) {
        throw std::invalid_argument(
            "d9d::peft::merge: the parameters of " + layer.name +
            " are not whole on this rank (FullyShard frees them between steps). Fix: save the "
            "adapter (d9d::peft::save_adapter from the records) and merge in one process after "
            "d9d::peft::load_adapter");
      }
    }
    original = parts.weight.detach().clone();
    parts.weight.copy_(merged_weight(original, parts.a, parts.b, layer.options()));
  }
}

at::Tensor merged_weight(const at::Tensor& weight, const at::Tensor& lora_a,
                         const at::Tensor& lora_b, const LoraOptions& options) {
  const at::NoGradGuard no_grad;
  // matmul: mm for a layer's [out, rank] x [rank, in], bmm expert by expert for stacked factors.
  return weight + (at::matmul(lora_b, lora_a) * options.scale()).to(weight.scalar_type());
}

void unmerge(torch::nn::Module& model) {
  const at::NoGradGuard no_grad;
  for (const auto& layer : lora_layers(model)) {
    if (!layer.merged()) {
      continue;
    }
    auto& original = layer.expert_adapter != nullptr ? layer.expert_adapter->original_
                                                     : layer.adapter->original_;
    merge_parts(layer).weight.copy_(original);
    original = at::Tensor();
  }
}

ParameterCount count_parameters(const torch::nn::Module& model) {
  ParameterCount count;
  for (const auto& parameter : model.parameters()) {
    count.total += parameter.numel();
    if (parameter.requires_grad()) {
      count.trainable += parameter.numel();
    }
  }
  return count;
}

void apply_stack(torch::nn::Module& model, const StackSpec& spec, uint64_t seed) {
  // A non-owning pointer to a caller-owned module: named_modules() needs a shared_ptr root.
  const std::shared_ptr<torch::nn::Module> root(std::shared_ptr<torch::nn::Module>(), &model);
  detail::apply_stack({root}, spec, seed, [](std::vector<int64_t>& /*counts*/) {});
}

namespace {

// A peft stack applied to the modules of some roots, in three phases: match every method's
// patterns (claiming parameters, collecting the layers and expert projections to adapt, counting
// matches per pattern, keeping the first error), check the counts over every pipeline stage, then
// freeze, train and adapt.
class StackApplication {
 public:
  StackApplication(const std::vector<std::shared_ptr<torch::nn::Module>>& roots,
                   const StackSpec& spec)
      : spec_(spec), modules_(modules_of(roots)) {
    for (const auto& root : roots) {
      for (const auto& item : root->named_parameters()) {
        parameters_.emplace_back(item.key(), item.value());
      }
    }
    // The grouped experts' stacked projections ("...mlp.experts.gate_proj"): targets like linear
    // layers, each adapted for every expert.
    for (const auto& [name, module] : modules_) {
      if (auto* experts = dynamic_cast<model::GroupedExpertsImpl*>(module.get())) {
        for (std::size_t p = 0; p < model::GroupedExpertsImpl::projections.size(); ++p) {
          expert_projections_.push_back(
              {name + "." + std::string(model::GroupedExpertsImpl::projections.at(p)), experts, p});
        }
      }
    }
  }

  void match() {
    for (std::size_t m = 0; m < spec_.methods.size(); ++m) {
      const auto& method = spec_.methods[m];
      if (method.kind == MethodKind::full_tune) {
        continue;
      }
      if (method.kind == MethodKind::lora) {
        const bool every_linear = method.patterns.empty();
        const std::vector<std::string> patterns =
            every_linear ? std::vector<std::string>{"(every linear layer but lm_head)"}
                         : method.patterns;
        for (const auto& pattern : patterns) {
          count(m, pattern,
                match_linear(m, pattern, every_linear) + match_experts(m, pattern, every_linear));
        }
        continue;
      }
      for (const auto& pattern : method.patterns) {
        int64_t matched = 0;
        for (const auto& [name, parameter] : parameters_) {
          if (parameter_matches(pattern, name)) {
            ++matched;
            claim(name, m, pattern);
          }
        }
        count(m, pattern, matched);
      }
    }
  }

  // A pattern may match on another pipeline stage only; errors on one rank stop every rank.
  void check(const detail::SumOverStages& sum_over_stages) {
    counts_.push_back(error_.empty() ? 0 : 1);
    sum_over_stages(counts_);
    if (!error_.empty()) {
      throw std::invalid_argument(error_);
    }
    if (counts_.back() > 0) {
      throw std::invalid_argument(
          "d9d::peft: another pipeline rank rejected the peft stack (its message says why)");
    }
    for (std::size_t i = 0; i + 1 < counts_.size(); ++i) {
      if (counts_[i] > 0) {
        continue;
      }
      const auto& [m, pattern] = counted_[i];
      const auto& method = spec_.methods[m];
      const bool lora = method.kind == MethodKind::lora;
      throw std::invalid_argument(
          "d9d::peft: the pattern \"" + pattern + "\" of " + method.describe() + " matches no " +
          (lora ? "module" : "parameter or module") + " of the model" +
          suggestion(pattern, modules_) + ". Modules here: " + module_listing(modules_) +
          ". Fix: use one of these names, a dotted suffix of one (\"q_proj\"), or a glob over "
          "whole names (\"*.q_proj\")");
    }
  }

  // Freeze, train, then adapt.
  void apply(uint64_t seed) {
    for (auto& [name, parameter] : parameters_) {
      const auto it = claims_.find(name);
      if (it == claims_.end()) {
        if (!spec_.rest_trains) {
          parameter.requires_grad_(false);
        }
        continue;
      }
      parameter.requires_grad_(spec_.methods[it->second.method].kind == MethodKind::train);
    }
    for (const auto& [t, m] : adapt_experts_) {
      const auto& method = spec_.methods[m];
      const auto& target = expert_projections_[t];
      target.experts->adapters.at(target.index) = std::make_shared<ExpertLoraAdapter>(
          *target.experts, target.index,
          LoraOptions{.rank = method.rank, .alpha = static_cast<double>(method.alpha)}, seed,
          target.name);
    }
    std::map<std::string, std::shared_ptr<torch::nn::Module>> by_name(modules_.begin(),
                                                                      modules_.end());
    for (const auto& [name, m] : adapt_) {
      const auto& method = spec_.methods[m];
      auto& layer = dynamic_cast<model::LinearImpl&>(*by_name.at(name));
      layer.adapter =
          std::make_shared<LoraAdapter>(layer,
                                        LoraOptions{.rank = method.rank,
                                                    .alpha = static_cast<double>(method.alpha),
                                                    .dropout = method.dropout},
                                        seed, name);
    }
  }

 private:
  // Which method claims a parameter, and by which of its patterns.
  struct Claim {
    std::size_t method;
    std::string pattern;
  };
  struct ExpertProjection {
    std::string name;
    model::GroupedExpertsImpl* experts;
    std::size_t index;
  };

  void fail(std::string message) {
    if (error_.empty()) {
      error_ = std::move(message);
    }
  }

  void count(std::size_t method, const std::string& pattern, int64_t matched) {
    counts_.push_back(matched);
    counted_.emplace_back(method, pattern);
  }

  void claim(const std::string& parameter, std::size_t method, const std::string& pattern) {
    const auto [it, fresh] = claims_.emplace(parameter, Claim{method, pattern});
    if (!fresh && it->second.method != method) {
      fail("d9d::peft::Stack: " + parameter + " is claimed by " +
           spec_.methods[it->second.method].describe() + " (pattern \"" + it->second.pattern +
           "\") and by " + spec_.methods[method].describe() + " (pattern \"" + pattern +
           "\"); a parameter is frozen, trained or adapted by one method. Fix: make the "
           "patterns disjoint (e.g. name the layers of each method)");
    }
  }

  [[nodiscard]] bool has_parameter(const std::string& name) const {
    return std::any_of(parameters_.begin(), parameters_.end(),
                       [&](const auto& item) { return item.first == name; });
  }

  // The linear layers Lora method `m`'s pattern adapts; how many modules it matched.
  int64_t match_linear(std::size_t m, const std::string& pattern, bool every_linear) {
    const auto& method = spec_.methods[m];
    int64_t matched = 0;
    for (const auto& [name, module] : modules_) {
      const bool hit =
          every_linear ? all_linear_target(name, *module) : pattern_matches(pattern, name);
      if (!hit) {
        continue;
      }
      ++matched;
      auto* layer = dynamic_cast<model::LinearImpl*>(module.get());
      if (layer == nullptr) {
        if (error_.empty()) {  // the listing is built for the first error only
          fail("d9d::peft::Lora: the target \"" + pattern + "\" of " + method.describe() +
               " matches " + name + ", a " + kind_of(*module) +
               "; LoRA wraps linear layers (d9d::model::Linear) and the grouped experts' "
               "projections (\"*.experts.gate_proj\", up_proj, down_proj) only. Fix: target "
               "those, e.g. \"*.q_proj\"; linear layers here: " +
               module_listing(linear_modules()));
        }
        continue;
      }
      if (layer->adapter) {
        fail("d9d::peft::Lora: " + name +
             " already has an adapter (a peft stack is applied once). Fix: apply one "
             "d9d::peft::Stack with every method");
      }
      if (std::find(adapt_.begin(), adapt_.end(), std::make_pair(name, m)) == adapt_.end()) {
        adapt_.emplace_back(name, m);
      }
      for (const char* suffix : {".weight", ".bias"}) {
        if (has_parameter(name + suffix)) {
          claim(name + suffix, m, pattern);
        }
      }
    }
    return matched;
  }

  // The stacked expert projections Lora method `m`'s pattern adapts; how many it matched.
  int64_t match_experts(std::size_t m, const std::string& pattern, bool every_linear) {
    const auto& method = spec_.methods[m];
    int64_t matched = 0;
    for (std::size_t t = 0; t < expert_projections_.size(); ++t) {
      const auto& target = expert_projections_[t];
      if (!every_linear && !pattern_matches(pattern, target.name)) {
        continue;
      }
      ++matched;
      if (method.dropout > 0.0) {
        fail("d9d::peft::Lora: the target \"" + pattern + "\" of " + method.describe() +
             " matches " + target.name +
             ", a stacked expert projection, where LoRA takes no dropout (peft refuses "
             "lora_dropout on expert parameters too). Fix: adapt the experts with a Lora "
             "without with_dropout, and the other layers with a second Lora method");
      }
      if (target.experts->adapters.at(target.index)) {
        fail("d9d::peft::Lora: " + target.name +
             " already has an adapter (a peft stack is applied once). Fix: apply one "
             "d9d::peft::Stack with every method");
      }
      if (std::find(adapt_experts_.begin(), adapt_experts_.end(), std::make_pair(t, m)) ==
          adapt_experts_.end()) {
        adapt_experts_.emplace_back(t, m);
      }
      claim(target.name, m, pattern);
    }
    return matched;
  }

  [[nodiscard]] std::vector<NamedModule> linear_modules() const {
    std::vector<NamedModule> linear;
    for (const auto& item : modules_) {
      if (dynamic_cast<model::LinearImpl*>(item.second.get()) != nullptr) {
        linear.push_back(item);
      }
    }
    return linear;
  }

  const StackSpec& spec_;
  std::vector<NamedModule> modules_;
  std::vector<std::pair<std::string, at::Tensor>> parameters_;
  std::vector<ExpertProjection> expert_projections_;
  std::map<std::string, Claim> claims_;
  std::vector<std::pair<std::string, std::size_t>> adapt_;          // layer name, Lora method
  std::vector<std::pair<std::size_t, std::size_t>> adapt_experts_;  // projection, Lora method
  std::vector<int64_t> counts_;  // matches per (method, pattern); check() appends the error flag
  std::vector<std::pair<std::size_t, std::string>> counted_;  // what each count is about
  std::string error_;                                         // the first error met while matching
};

}  // namespace

namespace detail {

void apply_stack(const std::vector<std::shared_ptr<torch::nn::Module>>& roots,
                 const StackSpec& spec, uint64_t seed, const SumOverStages& sum_over_stages) {
  StackApplication stack(roots, spec);
  stack.match();
  stack.check(sum_over_stages);
  stack.apply(seed);
}

}  // namespace detail
}  // namespace d9d::peft
