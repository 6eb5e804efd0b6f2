// d9d::advise::qwen3_activation_bytes (d9d/advise/activation_memory.hpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <d9d/advise/activation_memory.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/model/qwen3_moe.hpp>
#include <d9d/model/stage_layers.hpp>

namespace d9d::advise {

namespace {

// The bytes of one element of the residual stream (the layers' inputs and outputs): bfloat16 with
// bfloat16 parameters, else float32 (under autocast the norms write the matmuls' inputs in
// bfloat16; the stream stays float32).
int64_t residual_bytes(Compute compute) { return compute == Compute::bf16_parameters ? 2 : 4; }

// Under autocast, the bfloat16 copies of one layer's weights that its forward casts (this rank's
// slices of the matrices under tensor parallelism over `tp` ranks): all of them (the seven
// matrices; the q/k norms read their float32 weights as they are) and the MLP's three; none
// otherwise.
struct LayerCasts {
  int64_t all = 0;
  int64_t mlp = 0;

  // What a recomputed layer's lone forward keeps of them: the MLP's when only its attention part
  // is recomputed, else none.
  [[nodiscard]] int64_t kept_when_recomputed(const Recompute& recompute) const {
    return recompute.attention_only ? mlp : 0;
  }
};

LayerCasts layer_casts(const model::Qwen3Config& config, Compute compute, int64_t tp = 1) {
  if (compute != Compute::bf16_autocast) {
    return {};
  }
  const int64_t h = config.hidden_size;
  const int64_t q = config.num_attention_heads * config.head_dim;
  const int64_t k = config.num_key_value_heads * config.head_dim;
  const int64_t i = config.intermediate_size;
  return {.all = (h * q + 2 * h * k + q * h + 3 * h * i) / tp * 2, .mlp = 3 * h * i / tp * 2};
}

constexpr int64_t kFloat = 4;
constexpr int64_t kHalf = 2;

// One rank's slice of a microbatch's layer: `tokens` of the microbatch, `stream` of them in this
// rank's residual stream (1/tp of them under sequence parallelism, whose gathers give the blocks'
// matmuls every token), and this rank's heads, projections and MLP width (Megatron's slices; all
// of them without tp).
struct LayerShape {
  int64_t tokens = 0;
  int64_t stream = 0;
  int64_t h = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t q = 0;
  int64_t k = 0;
  int64_t i = 0;
};

// The sizes checked (std::invalid_argument naming them) and the rank's slice of a layer.
LayerShape layer_shape(const model::Qwen3Config& config, int64_t microbatch_size,
                       int64_t sequence_length, TensorSplit tensor) {
  if (microbatch_size < 1 || sequence_length < 1) {
    throw std::invalid_argument(
        "d9d::advise::qwen3_activation_bytes: microbatch_size and sequence_length must be at "
        "least 1, got " +
        std::to_string(microbatch_size) + " and " + std::to_string(sequence_length));
  }
  const int64_t n = tensor.ranks;
  const int64_t sp = tensor.sequence_parallel && n > 1 ? n : 1;
  if (n < 1 || config.num_attention_heads % n != 0 || config.num_key_value_heads % n != 0 ||
      config.intermediate_size % n != 0 || config.vocab_size % n != 0 ||
      sequence_length % sp != 0) {
    throw std::invalid_argument(
        "d9d::advise::qwen3_activation_bytes: tensor parallelism over " + std::to_string(n) +
        " ranks must divide the heads, KV heads, intermediate size and vocabulary (and, with "
        "sequence parallelism, the sequence length)");
  }
  const int64_t tokens = microbatch_size * sequence_length;
  const int64_t heads = config.num_attention_heads / n;
  const int64_t kv_heads = config.num_key_value_heads / n;
  return {.tokens = tokens,
          .stream = tokens / sp,
          .h = config.hidden_size,
          .heads = heads,
          .kv_heads = kv_heads,
          .q = heads * config.head_dim,
          .k = kv_heads * config.head_dim,
          .i = config.intermediate_size / n};
}

// One layer's bytes kept whole, and with its attention part recomputed (the MLP part kept: the
// residual after attention, the MLP norm's output or its casts and rstd, gate and up, the layer's
// output).
struct LayerBytes {
  int64_t whole = 0;
  int64_t attention_recomputed = 0;
};

LayerBytes layer_bytes(const model::Qwen3Config& config, const LayerShape& s, Compute compute,
                       int64_t tp) {
  const int64_t tokens = s.tokens;
  const int64_t stream = s.stream;
  const int64_t h = s.h;
  switch (compute) {
    case Compute::float32:
      // Per token of one layer, in float32 elements (the file comment's first table): the norms'
      // outputs (gathered under sequence parallelism) and this rank's heads over every token,
      // the residual stream's tensors and the norms' rstds over the stream's tokens.
      return {.whole = (tokens * (h + (s.q + s.k + s.heads + s.kv_heads) +
                                  (s.k + s.q + s.k + s.q + s.heads) + h + 2 * s.i) +
                        stream * (1 + h + 1 + h)) *
                       kFloat,
              .attention_recomputed = (tokens * (h + 2 * s.i) + stream * (2 * h + 1)) * kFloat};
    case Compute::bf16_autocast: {
      // Per token of one layer, in bytes (the second table): the residual stream in float32, the
      // matmuls' inputs and outputs in bfloat16 (the norms write theirs in bfloat16), the rstds
      // and the log-sum-exp in float32; per layer, the bfloat16 casts of its weights, which the
      // matmuls and q/k norms keep (the MLP's three when only the attention part is recomputed).
      const auto casts = layer_casts(config, Compute::bf16_autocast, tp);
      return {.whole = tokens * (h * (kHalf + kHalf) + s.q * 3 * kHalf + s.k * 3 * kHalf +
                                 s.heads * 2 * kFloat + s.kv_heads * kFloat + s.i * 2 * kHalf) +
                       stream * (h * (kFloat + kFloat) + 2 * kFloat) + casts.all,
              .attention_recomputed = tokens * (h * kHalf + s.i * 2 * kHalf) +
                                      stream * (h * (kFloat + kFloat) + kFloat) + casts.mlp};
    }
    case Compute::bf16_parameters:
      // Everything in bfloat16 but the rstds and the log-sum-exp; no casts.
      return {.whole = tokens * (2 * h * kHalf + s.q * 3 * kHalf + s.k * 3 * kHalf +
                                 s.heads * 2 * kFloat + s.kv_heads * kFloat + s.i * 2 * kHalf) +
                       stream * (2 * h * kHalf + 2 * kFloat),
              .attention_recomputed =
                  tokens * (h * kHalf + s.i * 2 * kHalf) + stream * (2 * h * kHalf + kFloat)};
  }
  return {};
}

// The embedding's output, the final norm and the head with its loss.
int64_t loss_bytes(const model::Qwen3Config& config, const LayerShape& s, Compute compute,
                   int64_t tp) {
  const int64_t r = residual_bytes(compute);
  const int64_t a = compute == Compute::float32 ? kFloat : kHalf;  // the matmuls' inputs
  const int64_t h = s.h;
  if (tp == 1) {
    // The embedding's output, the final rstd, and the fused head (linear_cross_entropy): the
    // gradient of its input (in the matmuls' dtype) and of its weight (the parameters'), computed
    // in the forward.
    const int64_t weight = compute == Compute::bf16_parameters ? kHalf : kFloat;
    return (h * (r + a) + kFloat) * s.tokens + config.vocab_size * h * weight;
  }
  // Under tp: the vocabulary-parallel embedding's masked ids (int64) and mask (bool), its output
  // in the stream, the final rstd, the head's input as its matmul keeps it (gathered under
  // sequence parallelism; its bfloat16 cast under autocast, and the head weight's), and the
  // loss-parallel cross-entropy's softmax - one-hot over this rank's vocabulary (float32).
  const int64_t vocab = config.vocab_size / tp;
  int64_t bytes = s.tokens * (8 + 1) + s.stream * (h * r + kFloat) + s.tokens * h * a +
                  s.tokens * vocab * kFloat;
  if (compute == Compute::bf16_autocast) {
    bytes += vocab * h * kHalf;
  }
  return bytes;
}

}  // namespace

ActivationBytes qwen3_activation_bytes(const model::Qwen3Config& config, int64_t microbatch_size,
                                       int64_t sequence_length, Compute compute,
                                       Recompute recompute, TensorSplit tensor) {
  const auto shape = layer_shape(config, microbatch_size, sequence_length, tensor);
  const auto layer = layer_bytes(config, shape, compute, tensor.ranks);
  ActivationBytes out;
  out.loss = loss_bytes(config, shape, compute, tensor.ranks);
  // A recomputed layer keeps only its output, in the residual stream's dtype (its input is the
  // previous layer's output, counted there, or the embedding's).
  const int64_t recomputed = recompute.layers_recomputed(config.num_hidden_layers);
  out.layers =
      (config.num_hidden_layers - recomputed) * layer.whole +
      recomputed * (recompute.attention_only ? layer.attention_recomputed
                                             : shape.stream * shape.h * residual_bytes(compute));
  out.rope = 2 * sequence_length * (config.head_dim / 2) * kFloat;
  return out;
}

int64_t qwen3_peft_activation_delta(const model::Qwen3Config& config,
                                    const std::vector<ParameterShape>& parameters,
                                    int64_t microbatch_size, int64_t sequence_length,
                                    Compute compute, bool dropout) {
  const auto not_yet = [](const std::string& what) {
    return std::invalid_argument("d9d::advise::qwen3_peft_activation_delta: " + what +
                                 " is not predicted yet");
  };
  if (dropout) {
    throw not_yet("LoRA with dropout");
  }
  const int64_t tokens = microbatch_size * sequence_length;
  const int64_t a = compute == Compute::float32 ? kFloat : kHalf;  // the matmuls' dtype
  const std::string lora_a = ".lora_A.weight";
  const auto adapted = [&](const std::string& module) {
    return std::any_of(parameters.begin(), parameters.end(),
                       [&](const ParameterShape& p) { return p.name == module + lora_a; });
  };
  const auto ends_with = [](const std::string& name, const std::string& tail) {
    return name.size() >= tail.size() &&
           name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  int64_t delta = 0;
  for (const auto& p : parameters) {
    if (ends_with(p.name, lora_a)) {
      const auto module = p.name.substr(0, p.name.size() - lora_a.size());
      if (ends_with(module, "lm_head")) {
        throw not_yet("an adapter on the LM head (its loss then runs unfused)");
      }
      const int64_t rank = p.sizes.at(0);
      const int64_t in = p.sizes.at(1);
      const auto b = std::find_if(
          parameters.begin(), parameters.end(),
          [&](const ParameterShape& q) { return q.name == module + ".lora_B.weight"; });
      const int64_t out = b == parameters.end() ? 0 : b->sizes.at(0);
      delta += tokens * rank * a;  // s x A^T, which low_rank_linear keeps for B's and A's gradients
      if (compute == Compute::bf16_autocast) {
        delta += rank * (in + out) * kHalf;  // A's and B's bfloat16 casts
      }
      continue;
    }
    const bool linear_weight = ends_with(p.name, "_proj.weight");
    if (linear_weight && !p.trained && !ends_with(p.name, ".lora_B.weight") &&
        !adapted(p.name.substr(0, p.name.size() - std::string(".weight").size()))) {
      throw not_yet("a frozen linear layer without an adapter (" + p.name + ")");
    }
    if (p.name == "model.embed_tokens.weight" && !p.trained &&
        std::any_of(parameters.begin(), parameters.end(), [](const ParameterShape& q) {
          return q.name == "model.layers.0.input_layernorm.weight" && !q.trained;
        })) {
      // The frozen embedding's output needs no gradient, nor then the first input norm (frozen
      // too): that norm keeps neither its input, the embedding's output, nor its rstd.
      delta -= tokens * (config.hidden_size * residual_bytes(compute) + kFloat);
    }
    const bool head = config.tie_word_embeddings ? p.name == "model.embed_tokens.weight"
                                                 : p.name == "lm_head.weight";
    if (head && !p.trained) {
      // linear_cross_entropy computes no weight gradient for a head that does not train.
      delta -= config.vocab_size * config.hidden_size *
               (compute == Compute::bf16_parameters ? kHalf : kFloat);
    }
  }
  return delta;
}

int64_t qwen3_moe_layer_count(const model::Qwen3MoeConfig& config) {
  int64_t count = 0;
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    count += config.is_moe_layer(layer) ? 1 : 0;
  }
  return count;
}

ActivationBytes qwen3_moe_activation_bytes(const model::Qwen3MoeConfig& config,
                                           int64_t microbatch_size, int64_t sequence_length,
                                           Compute compute, ExpertSplit experts) {
  if (config.moe_capacity_factor > 0) {
    throw std::invalid_argument(
        "d9d::advise::qwen3_moe_activation_bytes: token dropping (moe_capacity_factor " +
        std::to_string(config.moe_capacity_factor) + ") is not predicted; dropless routing is");
  }
  if (experts.ranks < 1 || config.num_experts % experts.ranks != 0 || experts.load < 0) {
    throw std::invalid_argument(
        "d9d::advise::qwen3_moe_activation_bytes: " + std::to_string(config.num_experts) +
        " experts over " + std::to_string(experts.ranks) + " expert rank(s), load " +
        std::to_string(experts.load) + " (the ranks must divide the experts, the load be >= 0)");
  }
  // The dense model's prediction (which checks the sizes), then each MoE layer's dense-MLP part
  // (gate and up over every token, under autocast the MLP's weight casts) replaced by its block.
  auto out = qwen3_activation_bytes(config, microbatch_size, sequence_length, compute);
  const int64_t a = compute == Compute::float32 ? kFloat : kHalf;
  const int64_t tokens = microbatch_size * sequence_length;
  const int64_t h = config.hidden_size;
  const int64_t e = config.num_experts;
  const int64_t k = config.num_experts_per_tok;
  const int64_t i = config.moe_intermediate_size;
  const int64_t s = config.shared_expert_intermediate_size;
  const int64_t dense_mlp =
      tokens * 2 * config.intermediate_size * a + layer_casts(config, compute).mlp;
  const int64_t routings = tokens * k;
  const auto rows =
      static_cast<int64_t>(std::llround(static_cast<double>(routings) * experts.load));
  // Per token: the probabilities and the weights' normalising sum; outside float32 the router's
  // float32 input, and the norm's bfloat16 output no longer kept unless the shared expert reads
  // it.
  int64_t block = tokens * (e * kFloat + kFloat);
  if (compute != Compute::float32) {
    block += tokens * h * (kFloat - (s > 0 ? 0 : kHalf));
  }
  // Per routing: its indices and weight, and its expert output sent back; per row this rank's
  // experts run: their input, gate, up, silu(gate) and product, and under expert parallelism the
  // two permutations of the received rows.
  block += routings * (20 + a + a * h) + rows * (a * (h + 4 * i) + (experts.ranks > 1 ? 16 : 0));
  // Per layer: the counts (per sequence under the sequence-wise auxiliary loss), and the casts.
  const int64_t count_rows =
      config.router_aux_loss_type == model::MoeAuxLoss::sequence ? microbatch_size : 1;
  block += 16 * e * count_rows + 2;
  const int64_t expert_casts = 3 * (e / experts.ranks) * i * h * kHalf;
  if (compute == Compute::bf16_autocast) {
    block += expert_casts;
  } else if (compute == Compute::bf16_parameters) {
    block += e * h * kFloat + (experts.float32_experts ? expert_casts : 0);
  }
  if (s > 0) {
    block += tokens * (2 * s * a + a * h + a);
    if (compute == Compute::bf16_autocast) {
      block += (3 * s * h + h) * kHalf;
    }
  }
  out.layers += qwen3_moe_layer_count(config) * (block - dense_mlp);
  return out;
}

StageActivationBytes qwen3_stage_activation_bytes(const model::Qwen3Config& config, int stage,
                                                  int stages, int64_t microbatch_size,
                                                  int64_t sequence_length, Compute compute,
                                                  Recompute recompute) {
  if (stages < 1 || stage < 0 || stage >= stages) {
    throw std::invalid_argument("d9d::advise::qwen3_stage_activation_bytes: stage " +
                                std::to_string(stage) + " is not one of " + std::to_string(stages) +
                                " stages");
  }
  if (recompute.every_nth > 1) {
    throw std::invalid_argument(
        "d9d::advise::qwen3_stage_activation_bytes: recompute of every " +
        std::to_string(recompute.every_nth) +
        "-th layer under a pipeline is not predicted (the policy counts a rank's blocks across "
        "its stages); every layer (every_nth 1) or none is");
  }
  const auto ranges =
      model::distribute_layers(static_cast<int>(config.num_hidden_layers), stages,
                               model::pipeline_virtual_layers(config, sequence_length));
  const int layers = ranges[static_cast<std::size_t>(stage)].size();
  // One layer's bytes and the model's rotary tables, from the whole model's prediction.
  auto one = config;
  one.num_hidden_layers = 1;
  const auto whole =
      qwen3_activation_bytes(one, microbatch_size, sequence_length, compute, recompute);
  const int64_t tokens = microbatch_size * sequence_length;
  const int64_t h = config.hidden_size;
  StageActivationBytes out;
  // The layers' weight casts apart: the train step makes them once for all microbatches. A lone
  // forward keeps those of the parts it does not recompute (an attention-recomputed layer's
  // MLP's three).
  const auto casts = layer_casts(config, compute);
  const int64_t kept_casts = recompute.any() ? casts.kept_when_recomputed(recompute) : casts.all;
  out.weight_casts = layers * kept_casts;
  out.layers = layers * (whole.layers - kept_casts);
  out.rope = layers > 0 ? whole.rope : 0;
  out.input = tokens * h * residual_bytes(compute);
  if (stage == stages - 1) {
    // The loss's softmax - one-hot over the vocabulary in the logits' dtype (the fused
    // model::logits_cross_entropy the pipelined step runs: float32, else bfloat16), the final
    // rstd, and the head's input as the head's matmul keeps it: float32, or its bfloat16 cast
    // (autocast) or bfloat16 parameters.
    const int64_t element = compute == Compute::float32 ? kFloat : kHalf;
    out.head = tokens * (config.vocab_size * element + kFloat) + tokens * h * element;
    if (compute == Compute::bf16_autocast) {
      out.weight_casts += config.vocab_size * h * kHalf;  // the head weight's bfloat16 cast
    }
  }
  return out;
}

namespace {

void check_rank(const char* who, const pipeline::Program& program, int pp_rank,
                const std::vector<int64_t>& per_stage) {
  if (pp_rank < 0 || pp_rank >= static_cast<int>(program.ranks.size())) {
    throw std::invalid_argument(std::string("d9d::advise::") + who + ": rank " +
                                std::to_string(pp_rank) + " of " +
                                std::to_string(program.ranks.size()));
  }
  if (per_stage.size() != static_cast<std::size_t>(program.stages())) {
    throw std::invalid_argument(std::string("d9d::advise::") + who + ": " +
                                std::to_string(per_stage.size()) + " stage sizes for " +
                                std::to_string(program.stages()) + " stages");
  }
}

// The stages whose actions pipeline rank `pp_rank` runs, each once.
std::vector<int> rank_stages(const pipeline::Program& program, int pp_rank) {
  std::vector<int> out;
  for (const auto& a : program.ranks[static_cast<std::size_t>(pp_rank)]) {
    if (std::find(out.begin(), out.end(), a.stage) == out.end()) {
      out.push_back(a.stage);
    }
  }
  return out;
}

// The largest of held + activations in flight (+ what deferred weight gradients keep, +
// gradients once a weight gradient ran) after any action of the rank.
int64_t walk(const pipeline::Program& program, int pp_rank, const std::vector<int64_t>& per_stage,
             int64_t held, int64_t gradients, const std::vector<int64_t>& deferred) {
  int64_t live = 0;
  int64_t peak = held;
  bool with_gradients = false;
  const auto kept_for_w = [&](int stage) {
    return deferred.empty() ? int64_t{0} : deferred[static_cast<std::size_t>(stage)];
  };
  for (const auto& a : program.ranks[static_cast<std::size_t>(pp_rank)]) {
    const int64_t bytes = per_stage[static_cast<std::size_t>(a.stage)];
    if (a.op == pipeline::Op::forward) {
      live += bytes;
    } else if (a.op == pipeline::Op::backward) {
      live -= bytes;
      with_gradients = true;
    } else if (a.op == pipeline::Op::backward_input) {
      live += kept_for_w(a.stage) - bytes;
    } else if (a.op == pipeline::Op::backward_weight) {
      live -= kept_for_w(a.stage);
      with_gradients = true;
    } else {
      continue;
    }
    peak = std::max(peak, held + live + (with_gradients ? gradients : 0));
  }
  return peak;
}

}  // namespace

int64_t peak_rank_activation_bytes(const pipeline::Program& program, int pp_rank,
                                   const std::vector<int64_t>& per_stage) {
  check_rank("peak_rank_activation_bytes", program, pp_rank, per_stage);
  return walk(program, pp_rank, per_stage, 0, 0, {});
}

int64_t peak_rank_step_bytes(const pipeline::Program& program, int pp_rank,
                             const std::vector<int64_t>& per_stage, const StateBytes& state,
                             const std::vector<int64_t>& deferred) {
  check_rank("peak_rank_step_bytes", program, pp_rank, per_stage);
  if (!deferred.empty() && deferred.size() != per_stage.size()) {
    throw std::invalid_argument(
        "d9d::advise::peak_rank_step_bytes: " + std::to_string(deferred.size()) +
        " deferred sizes for " + std::to_string(per_stage.size()) + " stages");
  }
  return walk(program, pp_rank, per_stage, state.parameters + state.optimizer, state.gradients,
              deferred);
}

int64_t qwen3_stage_weight_gradient_bytes(const model::Qwen3Config& config, int stage, int stages,
                                          int64_t microbatch_size, int64_t sequence_length,
                                          Compute compute) {
  if (stages < 1 || stage < 0 || stage >= stages) {
    throw std::invalid_argument("d9d::advise::qwen3_stage_weight_gradient_bytes: stage " +
                                std::to_string(stage) + " is not one of " + std::to_string(stages) +
                                " stages");
  }
  const auto ranges =
      model::distribute_layers(static_cast<int>(config.num_hidden_layers), stages,
                               model::pipeline_virtual_layers(config, sequence_length));
  const int64_t layers = ranges[static_cast<std::size_t>(stage)].size();
  const int64_t tokens = microbatch_size * sequence_length;
  const int64_t h = config.hidden_size;
  const int64_t q = config.num_attention_heads * config.head_dim;
  const int64_t k = config.num_key_value_heads * config.head_dim;
  const int64_t i = config.intermediate_size;
  const int64_t element = compute == Compute::float32 ? 4 : 2;
  // Inputs: q/k/v's (one tensor: the norm's output), o's, gate/up's (one), down's silu(gate) * up
  // (which its backward computes at I for the queued GEMM); then the seven output gradients.
  const int64_t inputs = h + q + h + i;
  const int64_t gradients = q + 2 * k + 2 * h + 2 * i;
  int64_t out = layers * tokens * (inputs + gradients) * element;
  if (stage == stages - 1) {
    out += tokens * (h + config.vocab_size) * element;  // the head's input and output gradient
  }
  return out;
}

int64_t qwen3_rank_weight_cast_bytes(const model::Qwen3Config& config,
                                     const pipeline::Program& program, int pp_rank,
                                     int64_t sequence_length, Compute compute) {
  if (pp_rank < 0 || pp_rank >= static_cast<int>(program.ranks.size())) {
    throw std::invalid_argument("d9d::advise::qwen3_rank_weight_cast_bytes: pipeline rank " +
                                std::to_string(pp_rank) + " is not one of the program's " +
                                std::to_string(program.ranks.size()));
  }
  int64_t out = 0;
  for (const int s : rank_stages(program, pp_rank)) {
    // The casts do not depend on the microbatch's size.
    out += qwen3_stage_activation_bytes(config, s, program.stages(), 1, sequence_length, compute)
               .weight_casts;
  }
  return out;
}

int64_t peak_step_bytes(const StateBytes& state, int64_t activations, int microbatches) {
  if (microbatches < 1) {
    throw std::invalid_argument("d9d::advise::peak_step_bytes: microbatches must be at least 1");
  }
  const int64_t held = state.parameters + state.optimizer;
  return held + (microbatches > 1 ? activations + state.gradients
                                  : std::max(activations, state.gradients));
}

int64_t fully_shard_gathered_step_bytes(const std::vector<ParameterShape>& parameters,
                                        const StateRules& rules, Compute compute,
                                        bool reshard_after_forward) {
  if (rules.shard_ranks <= 1) {
    return 0;
  }
  return fully_shard_gathered_bytes(parameters, rules,
                                    compute == Compute::float32 ? at::kFloat : at::kBFloat16,
                                    reshard_after_forward)
      .total();
}

std::vector<RankMemory> rank_memory(const model::Qwen3Config& config,
                                    const pipeline::Program& program, int pp, int microbatches,
                                    const StateRules& rules, int64_t microbatch_size,
                                    int64_t sequence_length, std::optional<Compute> compute,
                                    Recompute recompute, bool reshard_after_forward,
                                    bool sequence_parallel) {
  const bool piped = pp > 1;
  std::vector<int64_t> per_stage;
  std::vector<int64_t> deferred;  // what a split backward keeps for W
  if (compute && piped) {
    for (int s = 0; s < program.stages(); ++s) {
      // A stage's weight casts count once per rank and step (below), not per microbatch.
      const auto stage = qwen3_stage_activation_bytes(config, s, program.stages(), microbatch_size,
                                                      sequence_length, *compute, recompute);
      per_stage.push_back(stage.total() - stage.weight_casts);
      if (program.split_backward) {
        deferred.push_back(qwen3_stage_weight_gradient_bytes(
            config, s, program.stages(), microbatch_size, sequence_length, *compute));
      }
    }
  }
  std::vector<RankMemory> out;
  out.reserve(static_cast<std::size_t>(pp));
  for (int p = 0; p < pp; ++p) {
    const auto mine = piped ? qwen3_rank_parameters(config, program, p, sequence_length)
                            : qwen3_parameters(config);
    RankMemory rank{.state = state_bytes(mine, rules, 0)};  // shard rank 0 keeps the most rows
    if (compute) {
      if (piped) {
        // The rank's stages' weight casts, counted for the whole step.
        const int64_t cast =
            qwen3_rank_weight_cast_bytes(config, program, p, sequence_length, *compute);
        rank.activations = peak_rank_activation_bytes(program, p, per_stage) + cast;
        rank.peak = peak_rank_step_bytes(program, p, per_stage, rank.state, deferred) + cast;
      } else {
        const int64_t tp = rules.tensor_ranks;
        int64_t kept = qwen3_activation_bytes(
                           config, microbatch_size, sequence_length, *compute, recompute,
                           {.ranks = static_cast<int>(tp), .sequence_parallel = sequence_parallel})
                           .total();
        if (microbatches > 1) {
          // Several microbatches keep the layers' weight casts for the step; recomputing a layer
          // does not free them (what its lone forward keeps of them is counted already).
          const auto casts = layer_casts(config, *compute, tp);
          kept += recompute.layers_recomputed(config.num_hidden_layers) *
                  (casts.all - casts.kept_when_recomputed(recompute));
        }
        // Under tp the loss-parallel cross-entropy runs while the head's logits over this rank's
        // vocabulary (in the matmuls' dtype) are still alive next to its float32 working copy,
        // which the activations count as the kept gradient.
        const int64_t logits = tp > 1
                                   ? microbatch_size * sequence_length * (config.vocab_size / tp) *
                                         (*compute == Compute::float32 ? 4 : 2)
                                   : 0;
        rank.activations = kept;
        rank.peak = peak_step_bytes(rank.state, kept + logits, microbatches) +
                    fully_shard_gathered_step_bytes(mine, rules, *compute, reshard_after_forward);
      }
    }
    out.push_back(rank);
  }
  return out;
}

RankMemory fullest_rank_memory(const model::Qwen3Config& config, const pipeline::Program& program,
                               int pp, int microbatches, const StateRules& rules,
                               int64_t microbatch_size, int64_t sequence_length,
                               std::optional<Compute> compute, Recompute recompute,
                               bool reshard_after_forward, bool sequence_parallel) {
  const auto ranks =
      rank_memory(config, program, pp, microbatches, rules, microbatch_size, sequence_length,
                  compute, recompute, reshard_after_forward, sequence_parallel);
  // The largest peak (the first of equals), or without `compute` the most state.
  const auto size = [](const RankMemory& r) { return r.peak.value_or(r.state.total()); };
  return *std::max_element(
      ranks.begin(), ranks.end(),
      [&](const RankMemory& a, const RankMemory& b) { return size(a) < size(b); });
}

ExpertSplit expert_split(const StateRules& rules, bool fully_shard, Compute compute, double load) {
  return {.ranks = rules.expert_parallel ? rules.expert_ranks : 1,
          .load = load,
          .float32_experts = fully_shard && compute == Compute::bf16_parameters &&
                             rules.parameters == at::kFloat && rules.expert_parallel &&
                             rules.expert_shard_ranks == 1};
}

RankMemory moe_rank_memory(const model::Qwen3MoeConfig& config, const StateRules& rules,
                           int microbatches, int64_t microbatch_size, int64_t sequence_length,
                           std::optional<Compute> compute, ExpertSplit experts,
                           bool reshard_after_forward) {
  const auto parameters = qwen3_parameters(config);
  RankMemory out{.state = state_bytes(parameters, rules, 0, 0)};
  if (!compute) {
    return out;
  }
  out.activations =
      qwen3_moe_activation_bytes(config, microbatch_size, sequence_length, *compute, experts)
          .total();
  if (rules.expert_shard_ranks == 1) {
    out.peak = peak_step_bytes(out.state, *out.activations, microbatches) +
               fully_shard_gathered_step_bytes(parameters, rules, *compute, reshard_after_forward);
  }
  return out;
}

}  // namespace d9d::advise
