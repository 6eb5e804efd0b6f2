// d9d/advise/state_memory.cpp — the state bytes of a rank under a Plan
// (d9d/advise/state_memory.hpp).
#include <algorithm>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <c10/core/ScalarType.h>

#include <d9d/advise/state_memory.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/model/qwen3_moe.hpp>
#include <d9d/model/stage_layers.hpp>
#include <d9d/peft/lora.hpp>

namespace d9d::advise {

namespace {

int64_t product(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (const int64_t size : sizes) {
    n *= size;
  }
  return n;
}

// A MoE layer's block as MoeLayer registers it: the router, the routed experts, then the shared
// expert (a SwiGlu) and its one-output gate when the config has them.
void moe_parameters(const model::Qwen3MoeConfig& config, const std::string& prefix,
                    std::vector<ParameterShape>& out) {
  const int64_t h = config.hidden_size;
  const int64_t e = config.num_experts;
  const int64_t i = config.moe_intermediate_size;
  out.push_back({.name = prefix + "mlp.gate.weight", .sizes = {e, h}});
  out.push_back({.name = prefix + "mlp.experts.gate_proj", .sizes = {e, i, h}, .expert = true});
  out.push_back({.name = prefix + "mlp.experts.up_proj", .sizes = {e, i, h}, .expert = true});
  out.push_back({.name = prefix + "mlp.experts.down_proj", .sizes = {e, h, i}, .expert = true});
  if (const int64_t shared = config.shared_expert_intermediate_size; shared > 0) {
    out.push_back({.name = prefix + "mlp.shared_expert.gate_proj.weight", .sizes = {shared, h}});
    out.push_back({.name = prefix + "mlp.shared_expert.up_proj.weight", .sizes = {shared, h}});
    out.push_back({.name = prefix + "mlp.shared_expert.down_proj.weight", .sizes = {h, shared}});
    out.push_back({.name = prefix + "mlp.shared_expert_gate.weight", .sizes = {1, h}});
  }
}

// A stage's parameters as detail::register_stage_modules registers them: "model.embed_tokens"
// (first stage, or a last stage holding a tied head's copy), "model.layers.<i>..." for the
// stage's layers, "model.norm" (last), "lm_head" (last, untied). `moe`: the config again as a
// Qwen3-MoE's (its MoE layers get the MoE block), or nullptr for the dense model.
std::vector<ParameterShape> stage_parameters(const model::Qwen3Config& config,
                                             const model::Qwen3MoeConfig* moe, bool first,
                                             bool last, model::LayerRange layers) {
  const int64_t h = config.hidden_size;
  const int64_t d = config.head_dim;
  const int64_t q = config.num_attention_heads * d;
  const int64_t kv = config.num_key_value_heads * d;
  const int64_t i = config.intermediate_size;
  std::vector<ParameterShape> out;
  if (first || (last && config.tie_word_embeddings)) {
    out.push_back({.name = "model.embed_tokens.weight",
                   .sizes = {config.vocab_size, h},
                   .tensor_split_dim = 0});
  }
  for (int layer = layers.begin; layer < layers.end; ++layer) {
    const std::string prefix = "model.layers." + std::to_string(layer) + ".";
    // The order of registration: the input norm, attention (q, k, v, o, then the q/k norms), the
    // post-attention norm, then the MLP.
    out.push_back({.name = prefix + "input_layernorm.weight", .sizes = {h}});
    out.push_back(
        {.name = prefix + "self_attn.q_proj.weight", .sizes = {q, h}, .tensor_split_dim = 0});
    out.push_back(
        {.name = prefix + "self_attn.k_proj.weight", .sizes = {kv, h}, .tensor_split_dim = 0});
    out.push_back(
        {.name = prefix + "self_attn.v_proj.weight", .sizes = {kv, h}, .tensor_split_dim = 0});
    out.push_back(
        {.name = prefix + "self_attn.o_proj.weight", .sizes = {h, q}, .tensor_split_dim = 1});
    out.push_back({.name = prefix + "self_attn.q_norm.weight", .sizes = {d}});
    out.push_back({.name = prefix + "self_attn.k_norm.weight", .sizes = {d}});
    out.push_back({.name = prefix + "post_attention_layernorm.weight", .sizes = {h}});
    if (moe != nullptr && moe->is_moe_layer(layer)) {
      moe_parameters(*moe, prefix, out);
      continue;
    }
    out.push_back(
        {.name = prefix + "mlp.gate_proj.weight", .sizes = {i, h}, .tensor_split_dim = 0});
    out.push_back({.name = prefix + "mlp.up_proj.weight", .sizes = {i, h}, .tensor_split_dim = 0});
    out.push_back(
        {.name = prefix + "mlp.down_proj.weight", .sizes = {h, i}, .tensor_split_dim = 1});
  }
  if (last) {
    out.push_back({.name = "model.norm.weight", .sizes = {h}});
  }
  if (last && !config.tie_word_embeddings) {
    out.push_back(
        {.name = "lm_head.weight", .sizes = {config.vocab_size, h}, .tensor_split_dim = 0});
  }
  return out;
}

// The dense model's (moe == nullptr) or a Qwen3-MoE's stage `stage` of `stages`, split as the
// providers split them (pipeline_virtual_layers of the config's own type).
template <class Config>
std::vector<ParameterShape> stage_of(const Config& config, int stage, int stages,
                                     int64_t sequence_length) {
  if (stages < 1 || stage < 0 || stage >= stages) {
    throw std::invalid_argument("d9d::advise::qwen3_stage_parameters: stage " +
                                std::to_string(stage) + " is not one of " + std::to_string(stages) +
                                " stages");
  }
  const auto ranges =
      model::distribute_layers(static_cast<int>(config.num_hidden_layers), stages,
                               model::pipeline_virtual_layers(config, sequence_length));
  const model::Qwen3MoeConfig* moe = nullptr;
  if constexpr (std::is_same_v<Config, model::Qwen3MoeConfig>) {
    moe = &config;
  }
  return stage_parameters(config, moe, stage == 0, stage == stages - 1,
                          ranges[static_cast<std::size_t>(stage)]);
}

template <class Config>
std::vector<ParameterShape> rank_of(const Config& config, const pipeline::Program& program,
                                    int pp_rank, int64_t sequence_length) {
  if (pp_rank < 0 || pp_rank >= program.pp) {
    throw std::invalid_argument("d9d::advise::qwen3_rank_parameters: pipeline rank " +
                                std::to_string(pp_rank) + " of a program for " +
                                std::to_string(program.pp) + " ranks");
  }
  std::vector<ParameterShape> out;
  for (const int stage :
       pipeline::rank_stages(program.placement, program.pp, program.stages_per_rank, pp_rank)) {
    auto part = stage_of(config, stage, program.stages(), sequence_length);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

// The module of a parameter ("model.norm.weight" -> "model.norm").
std::string_view module_of(std::string_view parameter) {
  const auto dot = parameter.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : parameter.substr(0, dot);
}

// Whether `module` is one of the dense Qwen3's linear layers (d9d::model::Linear), the LM head
// included.
bool linear_module(std::string_view module) {
  const auto dot = module.rfind('.');
  const auto last = dot == std::string_view::npos ? module : module.substr(dot + 1);
  return last == "q_proj" || last == "k_proj" || last == "v_proj" || last == "o_proj" ||
         last == "gate_proj" || last == "up_proj" || last == "down_proj" || last == "lm_head";
}

// Whether Lora method `method` adapts the linear layer `module` (no patterns: every linear layer
// but the LM head).
bool lora_targets(const peft::MethodSpec& method, std::string_view module) {
  if (!linear_module(module)) {
    return false;
  }
  if (method.patterns.empty()) {
    return !module.ends_with("lm_head");
  }
  return std::any_of(
      method.patterns.begin(), method.patterns.end(),
      [&](const std::string& pattern) { return peft::pattern_matches(pattern, module); });
}

}  // namespace

int64_t ParameterShape::numel() const { return product(sizes); }

std::vector<ParameterShape> apply_peft(const std::vector<ParameterShape>& parameters,
                                       const peft::StackSpec& spec) {
  std::vector<ParameterShape> out;
  out.reserve(parameters.size());
  for (const auto& p : parameters) {
    const auto module = std::string(module_of(p.name));
    std::optional<std::size_t> claimed;  // the method that claims p
    const peft::MethodSpec* lora = nullptr;
    for (std::size_t m = 0; m < spec.methods.size(); ++m) {
      const auto& method = spec.methods[m];
      bool hit = false;
      switch (method.kind) {
        case peft::MethodKind::full_tune:
          break;
        case peft::MethodKind::lora:
          hit = lora_targets(method, module);
          lora = hit ? &method : lora;
          break;
        case peft::MethodKind::freeze:
        case peft::MethodKind::train:
          hit = std::any_of(
              method.patterns.begin(), method.patterns.end(),
              [&](const std::string& pattern) { return peft::parameter_matches(pattern, p.name); });
          break;
      }
      if (hit && claimed && *claimed != m) {
        throw std::invalid_argument("d9d::advise::apply_peft: " + p.name + " is claimed by " +
                                    spec.methods[*claimed].describe() + " and by " +
                                    method.describe() +
                                    " (the trainer refuses this stack at start-up)");
      }
      claimed = hit ? std::optional<std::size_t>(m) : claimed;
    }
    auto kept = p;
    kept.trained =
        claimed ? spec.methods[*claimed].kind == peft::MethodKind::train : spec.rest_trains;
    out.push_back(kept);
    if (claimed && spec.methods[*claimed].kind == peft::MethodKind::lora &&
        p.name.ends_with(".weight") && p.sizes.size() == 2) {
      // LoraAdapter registers lora_A [rank, in] and lora_B [out, rank] as the layer's children.
      out.push_back(
          {.name = module + ".lora_A.weight",
           .sizes = {lora->rank, p.sizes[1]},
           .lora_scale = static_cast<double>(lora->alpha) / static_cast<double>(lora->rank)});
      out.push_back({.name = module + ".lora_B.weight", .sizes = {p.sizes[0], lora->rank}});
    }
  }
  return out;
}

std::vector<ParameterShape> qwen3_parameters(const model::Qwen3Config& config) {
  return stage_parameters(config, nullptr, true, true,
                          {.begin = 0, .end = static_cast<int>(config.num_hidden_layers)});
}

std::vector<ParameterShape> qwen3_parameters(const model::Qwen3MoeConfig& config) {
  return stage_parameters(config, &config, true, true,
                          {.begin = 0, .end = static_cast<int>(config.num_hidden_layers)});
}

std::vector<ParameterShape> qwen3_stage_parameters(const model::Qwen3Config& config, int stage,
                                                   int stages, int64_t sequence_length) {
  return stage_of(config, stage, stages, sequence_length);
}

std::vector<ParameterShape> qwen3_stage_parameters(const model::Qwen3MoeConfig& config, int stage,
                                                   int stages, int64_t sequence_length) {
  return stage_of(config, stage, stages, sequence_length);
}

std::vector<ParameterShape> qwen3_rank_parameters(const model::Qwen3Config& config,
                                                  const pipeline::Program& program, int pp_rank,
                                                  int64_t sequence_length) {
  return rank_of(config, program, pp_rank, sequence_length);
}

std::vector<ParameterShape> qwen3_rank_parameters(const model::Qwen3MoeConfig& config,
                                                  const pipeline::Program& program, int pp_rank,
                                                  int64_t sequence_length) {
  return rank_of(config, program, pp_rank, sequence_length);
}

int expert_replicate_ranks(const MeshShape& shape) {
  const auto stage = static_cast<int>(shape.stage_size());
  if (shape.ep < 1 || shape.dp_replicate < 1 || stage % shape.ep != 0) {
    throw std::invalid_argument(
        "d9d::advise::expert_replicate_ranks: ep = " + std::to_string(shape.ep) +
        " does not divide a stage's " + std::to_string(stage) + " ranks");
  }
  const int replicas = (stage / shape.dp_replicate) % shape.ep == 0 ? shape.dp_replicate : 1;
  return stage / (replicas * shape.ep);
}

int64_t shard_rows(int64_t rows, int ranks, int rank) {
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    throw std::invalid_argument("d9d::advise::shard_rows: rank " + std::to_string(rank) + " of " +
                                std::to_string(ranks) + " ranks");
  }
  const int64_t per_rank = (rows + ranks - 1) / ranks;  // torch.chunk's ceil(n / ranks)
  const int64_t begin = per_rank * rank;
  return std::max<int64_t>(0, std::min(rows, begin + per_rank) - begin);
}

StateBytes state_bytes(const std::vector<ParameterShape>& parameters, const StateRules& rules,
                       int shard_rank, int expert_shard_rank) {
  if (rules.shard_ranks < 1 || shard_rank < 0 || shard_rank >= rules.shard_ranks) {
    throw std::invalid_argument("d9d::advise::state_bytes: shard rank " +
                                std::to_string(shard_rank) + " outside a group of " +
                                std::to_string(rules.shard_ranks));
  }
  if (rules.expert_ranks < 1 || rules.expert_shard_ranks < 1 || expert_shard_rank < 0 ||
      expert_shard_rank >= rules.expert_shard_ranks) {
    throw std::invalid_argument("d9d::advise::state_bytes: expert shard rank " +
                                std::to_string(expert_shard_rank) + " outside a group of " +
                                std::to_string(rules.expert_shard_ranks) + " (expert ranks " +
                                std::to_string(rules.expert_ranks) + ")");
  }
  const auto size = [](at::ScalarType dtype) {
    return static_cast<int64_t>(c10::elementSize(dtype));
  };
  if (rules.tensor_ranks < 1) {
    throw std::invalid_argument("d9d::advise::state_bytes: tensor_ranks " +
                                std::to_string(rules.tensor_ranks) + " < 1");
  }
  StateBytes out;
  for (const auto& p : parameters) {
    auto sizes = p.sizes;
    if (rules.tensor_ranks > 1 && p.tensor_split_dim >= 0) {
      auto& split = sizes.at(static_cast<std::size_t>(p.tensor_split_dim));
      if (split % rules.tensor_ranks != 0) {
        throw std::invalid_argument("d9d::advise::state_bytes: " + p.name + "'s dimension " +
                                    std::to_string(p.tensor_split_dim) + " (" +
                                    std::to_string(split) + ") does not split over " +
                                    std::to_string(rules.tensor_ranks) + " tensor ranks");
      }
      split /= rules.tensor_ranks;
    }
    const bool expert = rules.expert_parallel && p.expert;
    if (expert) {
      if (sizes.empty() || sizes.front() % rules.expert_ranks != 0) {
        throw std::invalid_argument("d9d::advise::state_bytes: " + p.name +
                                    "'s experts do not split over " +
                                    std::to_string(rules.expert_ranks) + " expert ranks");
      }
      sizes.front() /= rules.expert_ranks;
    }
    int64_t numel = product(sizes);
    if (!p.trained) {
      out.parameters += numel * size(rules.parameters);
      continue;
    }
    const int ranks = expert ? rules.expert_shard_ranks : rules.shard_ranks;
    const int rank = expert ? expert_shard_rank : shard_rank;
    if (ranks > 1 && !sizes.empty() && sizes.front() > 0) {
      numel = numel / sizes.front() * shard_rows(sizes.front(), ranks, rank);
    }
    out.parameters += numel * size(rules.parameters);
    out.gradients += numel * size(rules.gradients);
    out.optimizer += 2 * numel * size(rules.optimizer);
  }
  return out;
}

GatheredBytes fully_shard_gathered_bytes(const std::vector<ParameterShape>& parameters,
                                         const StateRules& rules, at::ScalarType gathered,
                                         bool reshard_after_forward, int prefetch) {
  if (rules.tensor_ranks < 1) {
    throw std::invalid_argument("d9d::advise::fully_shard_gathered_bytes: tensor_ranks " +
                                std::to_string(rules.tensor_ranks) + " < 1");
  }
  const std::string layers = "model.layers.";
  std::map<int64_t, int64_t> layer_bytes;  // layer index -> its unit's bytes
  int64_t rest = 0;
  const auto element = static_cast<int64_t>(c10::elementSize(gathered));
  for (const auto& p : parameters) {
    if (rules.expert_parallel && p.expert) {
      if (rules.expert_shard_ranks > 1) {
        throw std::invalid_argument(
            "d9d::advise::fully_shard_gathered_bytes: the experts' own FullyShard units "
            "(ep_replicate = " +
            std::to_string(rules.expert_shard_ranks) + ") are not predicted yet");
      }
      continue;  // the expert domain's: FullyShard leaves them whole
    }
    auto numel = product(p.sizes);
    if (rules.tensor_ranks > 1 && p.tensor_split_dim >= 0) {
      numel /= rules.tensor_ranks;
    }
    if (p.name.rfind(layers, 0) == 0) {
      layer_bytes[std::stoll(p.name.substr(layers.size()))] += numel * element;
    } else {
      rest += numel * element;
    }
  }
  GatheredBytes out{.units = rest};
  int64_t largest = 0;
  for (const auto& [layer, bytes] : layer_bytes) {
    largest = std::max(largest, bytes);
    if (!reshard_after_forward) {
      out.units += bytes;
    }
  }
  if (reshard_after_forward) {
    // A layer's gather lands in its storage when the layer runs, after the previous one was
    // freed; the next one's, started then, is the all-gather's output until it runs.
    out.units += largest;
    out.in_flight = prefetch > 0 && layer_bytes.size() > 1 ? largest : 0;
  }
  return out;
}

}  // namespace d9d::advise
