// d9d/model/qwen3_stage.cpp — a pipeline stage of Qwen3.
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <d9d/model/detail/decoder_stage.hpp>
#include <d9d/model/qwen3_stage.hpp>

namespace d9d::model {

namespace {
constexpr std::string_view kWho = "d9d::model::Qwen3Stage";
}  // namespace

Qwen3StageImpl::Qwen3StageImpl(const Qwen3Config& config, int stage, int stages, LayerRange layers)
    : config_(config),
      stage_(stage),
      stages_(stages),
      range_(layers),
      rope_(config_.head_dim, config_.rope_theta) {
  const uint64_t seed = draw_init_seed();
  config_.validate();
  detail::check_stage(kWho, stage, stages, layers, config_.num_hidden_layers);
  auto parts =
      detail::register_stage_modules(*this, config_, {.first = is_first(), .last = is_last()},
                                     layers, [this](int) { return Qwen3DecoderLayer(config_); });
  embed_tokens = parts.embed_tokens;
  this->layers = std::move(parts.layers);
  norm = parts.norm;
  lm_head = parts.lm_head;
  init_qwen3_parameters(*this, config_, seed);  // the values of the whole model's parameters
}

at::Tensor Qwen3StageImpl::forward(const at::Tensor& input) {
  detail::check_stage_input(kWho, stage_, is_first(), input, config_.hidden_size);
  at::Tensor h = input;
  if (is_first()) {
    const auto ids = cp_ ? context_shard(input, 1, cp_->rank(), cp_->size()) : input;
    h = tp_ ? vocab_parallel_embedding(embed_tokens->weight, ids, vocab_start_, *tp_)
            : embed_tokens(ids);
  }
  // Under sequence parallelism h holds this rank's shard of the tokens, [B, T / tp, H] (the
  // embedding's reduce_out scattered them); attention gathers them (copy_in) into [B, T, H], so
  // its positions span tp times as many.
  const int64_t sp = tp_ && tp_->sequence_parallel() ? tp_->size() : 1;
  if (!layers.empty() && cp_) {
    // This rank's chunks at their positions in the whole sequence of T = T_local x cp tokens.
    const auto where =
        detail::context_placement(rope_, h.size(0), h.size(1) * sp * cp_->size(), h.device(),
                                  RotaryEmbedding::table_dtype(h.scalar_type()), *cp_);
    for (auto& layer : layers) {
      h = layer->forward_placed(h, where, nullptr);
    }
  } else if (!layers.empty()) {
    const auto cos_sin =
        rope_.cos_sin(h.size(1) * sp, h.device(), RotaryEmbedding::table_dtype(h.scalar_type()));
    for (auto& layer : layers) {
      h = layer(h, cos_sin);
    }
  }
  if (!is_last()) {
    return h;
  }
  h = norm(h);
  if (tp_) {
    // Column-parallel over the vocabulary (under sequence parallelism copy_in gathers the
    // sequence first), the logits gathered unless the loss reads this rank's slice of them.
    auto logits = detail::tied_head(tp_->copy_in(h), lm_head, embed_tokens);
    return split_logits_ ? logits : tp_->gather_last(logits);
  }
  return detail::tied_head(h, lm_head, embed_tokens);
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

VocabSlice Qwen3StageImpl::keep_logits_split() {
  if (!tp_ || !is_last()) {
    return {};
  }
  split_logits_ = true;
  return {.group = tp_, .start = vocab_start_};
}

void Qwen3StageImpl::set_context_parallel(std::shared_ptr<const ContextParallelGroup> group) {
  if (cp_) {
    throw std::logic_error("d9d::model::Qwen3Stage: context parallelism is already set");
  }
  for (auto& layer : layers) {
    layer->self_attn->set_context_parallel(group);
  }
  cp_ = std::move(group);
}

int64_t Qwen3StageImpl::local_tokens(int64_t seq) const {
  if (!cp_) {
    return seq;
  }
  check_context_length(seq, cp_->size());
  return seq / cp_->size();
}

int64_t Qwen3StageImpl::hidden_tokens(int64_t seq) const {
  const int64_t local = local_tokens(seq);
  if (!tp_ || !tp_->sequence_parallel()) {
    return local;
  }
  if (local % tp_->size() != 0) {
    throw std::invalid_argument(
        "d9d::model::Qwen3Stage: sequence parallelism splits each sequence's " +
        std::to_string(local) + " tokens over tp = " + std::to_string(tp_->size()) +
        " ranks, which does not divide them. Fix: a \"batch.sequence_length\" that is a multiple "
        "of tp (times cp)");
  }
  return local / tp_->size();
}

std::vector<int64_t> Qwen3StageImpl::input_sizes(int64_t batch, int64_t seq) const {
  // The first stage takes whole sequences of ids and cuts them itself.
  return detail::stage_input_sizes(is_first(), batch, is_first() ? seq : hidden_tokens(seq),
                                   config_.hidden_size);
}

std::vector<int64_t> Qwen3StageImpl::output_sizes(int64_t batch, int64_t seq) const {
  // The last stage's logits cover the sequence's local tokens (the head gathered them back under
  // sequence parallelism), the other stages' hidden states their sequence-parallel share.
  return detail::stage_output_sizes(
      is_last(), batch, is_last() ? local_tokens(seq) : hidden_tokens(seq), config_.hidden_size,
      split_logits_ ? config_.vocab_size / tp_->size() : config_.vocab_size);
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
