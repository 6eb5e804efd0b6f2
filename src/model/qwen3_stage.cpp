// d9d/model/qwen3_stage.cpp — a pipeline stage of Qwen3.
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <d9d/model/qwen3_stage.hpp>

namespace d9d::model {

Qwen3StageImpl::Qwen3StageImpl(const Qwen3Config& config, int stage, int stages,
                               pipeline::LayerRange layers)
    : config_(config),
      stage_(stage),
      stages_(stages),
      range_(layers),
      rope_(config_.head_dim, config_.rope_theta) {
  const uint64_t seed = draw_init_seed();
  config_.validate();
  if (stages < 1 || stage < 0 || stage >= stages) {
    throw std::invalid_argument("d9d::model::Qwen3Stage: stage " + std::to_string(stage) +
                                " is not one of " + std::to_string(stages) + " stages");
  }
  if (layers.begin < 0 || layers.end < layers.begin || layers.end > config_.num_hidden_layers) {
    throw std::invalid_argument("d9d::model::Qwen3Stage: layers [" + std::to_string(layers.begin) +
                                ", " + std::to_string(layers.end) + ") are not within the " +
                                std::to_string(config_.num_hidden_layers) + " decoder layers");
  }
  // Parameter names as in Qwen3ForCausalLM: a "model" child with embed_tokens, layers and norm.
  auto body = std::make_shared<torch::nn::Module>();
  // A tied LM head on a last stage that is not the first holds its own copy of the embedding,
  // under the embedding's name: it starts with the same values (initialised by name), the
  // parallelize layer sums the two holders' gradients (d9d::parallel::detail::tie_stage_parameters)
  // and checkpoints, export and init_from see one "model.embed_tokens.weight".
  if (is_first() || (is_last() && config_.tie_word_embeddings)) {
    embed_tokens = body->register_module(
        "embed_tokens", torch::nn::Embedding(config_.vocab_size, config_.hidden_size));
  }
  auto layer_list = std::make_shared<torch::nn::Module>();
  for (int i = layers.begin; i < layers.end; ++i) {
    this->layers.emplace_back(
        layer_list->register_module(std::to_string(i), Qwen3DecoderLayer(config_)));
  }
  body->register_module("layers", layer_list);
  if (is_last()) {
    norm = body->register_module("norm", RmsNorm(config_.hidden_size, config_.rms_norm_eps));
  }
  register_module("model", body);
  if (is_last() && !config_.tie_word_embeddings) {
    lm_head = register_module("lm_head", Linear(config_.hidden_size, config_.vocab_size));
  }
  init_qwen3_parameters(*this, config_, seed);  // the values of the whole model's parameters
}

at::Tensor Qwen3StageImpl::forward(const at::Tensor& input) {
  at::Tensor h;
  if (is_first()) {
    if (input.dim() != 2 || input.is_floating_point()) {
      throw std::invalid_argument(
          "d9d::model::Qwen3Stage: the first stage takes token ids [batch, seq] (int64)");
    }
    h = tp_ ? vocab_parallel_embedding(embed_tokens->weight, input, vocab_start_, *tp_)
            : embed_tokens(input);
  } else {
    if (input.dim() != 3 || input.size(2) != config_.hidden_size) {
      throw std::invalid_argument("d9d::model::Qwen3Stage: stage " + std::to_string(stage_) +
                                  " takes hidden states [batch, seq, " +
                                  std::to_string(config_.hidden_size) + "]");
    }
    h = input;
  }
  if (!layers.empty()) {
    const auto cos_sin =
        rope_.cos_sin(h.size(1), h.device(), RotaryEmbedding::table_dtype(h.scalar_type()));
    for (auto& layer : layers) {
      h = layer(h, cos_sin);
    }
  }
  if (!is_last()) {
    return h;
  }
  h = norm(h);
  if (tp_) {
    // Column-parallel over the vocabulary, the logits gathered (the stage's output is whole).
    const auto in = tp_->copy_in(h);
    return tp_->gather_last(lm_head ? lm_head(in)
                                    : at::linear(in, embed_tokens->weight.to(in.scalar_type())));
  }
  if (lm_head) {
    return lm_head(h);
  }
  return at::linear(h, embed_tokens->weight.to(h.scalar_type()));
}

std::vector<std::string> Qwen3StageImpl::vocab_parameters() const {
  std::vector<std::string> names;
  if (embed_tokens) {
    names.emplace_back("model.embed_tokens.weight");
  }
  if (lm_head) {
    names.emplace_back("lm_head.weight");
  }
  return names;
}

void Qwen3StageImpl::set_tensor_parallel(std::shared_ptr<const TensorParallelGroup> group) {
  if (tp_) {
    throw std::logic_error("d9d::model::Qwen3Stage: tensor parallelism is already set");
  }
  // Both vocabulary parameters (when present) hold V / tp rows after the strategy's split.
  const int64_t rows = embed_tokens ? embed_tokens->weight.size(0)
                       : lm_head    ? lm_head->weight.size(0)
                                    : 0;
  vocab_start_ = group->rank() * rows;
  tp_ = std::move(group);
}

std::vector<int64_t> Qwen3StageImpl::input_sizes(int64_t batch, int64_t seq) const {
  if (is_first()) {
    return {batch, seq};
  }
  return {batch, seq, config_.hidden_size};
}

std::vector<int64_t> Qwen3StageImpl::output_sizes(int64_t batch, int64_t seq) const {
  return {batch, seq, is_last() ? config_.vocab_size : config_.hidden_size};
}

void copy_parameters(const torch::nn::Module& from, torch::nn::Module& to) {
  const auto source = from.named_parameters();
  const at::NoGradGuard no_grad;
  for (auto& item : to.named_parameters()) {
    const auto* found = source.find(item.key());
    if (found == nullptr) {
      throw std::invalid_argument("d9d::model::copy_parameters: the source has no parameter \"" +
                                  item.key() + "\"");
    }
    if (found->sizes() != item.value().sizes()) {
      throw std::invalid_argument("d9d::model::copy_parameters: \"" + item.key() +
                                  "\" has another shape in the source");
    }
    item.value().copy_(*found);
  }
}

}  // namespace d9d::model
