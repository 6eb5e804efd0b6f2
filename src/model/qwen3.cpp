// d9d/model/qwen3.cpp — the Qwen3 dense model and the causal-LM loss (the config:
// qwen3_config.cpp).
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <d9d/model/detail/decoder_stage.hpp>
#include <d9d/model/linear_cross_entropy.hpp>
#include <d9d/model/qwen3.hpp>

namespace d9d::model {

Qwen3DecoderLayerImpl::Qwen3DecoderLayerImpl(const Qwen3Config& config) {
  declare_part(Part::attention);
  detail::register_attention(*this, config, input_layernorm, self_attn, post_attention_layernorm);
  mlp = register_module("mlp", SwiGlu(config.hidden_size, config.intermediate_size));
}

at::Tensor Qwen3DecoderLayerImpl::forward(const at::Tensor& x,
                                          const std::pair<at::Tensor, at::Tensor>& cos_sin) {
  return run_block(x, [this, cos_sin](const at::Tensor& in) {
    const auto h = in + run_part(Part::attention, in, [this, cos_sin](const at::Tensor& t) {
                     return self_attn(input_layernorm(t), cos_sin);
                   });
    return h + mlp(post_attention_layernorm(h));
  });
}

at::Tensor Qwen3DecoderLayerImpl::forward_placed(const at::Tensor& x, const TokenPlacement& where,
                                                 KvCacheLayer* cache) {
  return run_block(x, [this, where, cache](const at::Tensor& in) {
    const auto h = in + run_part(Part::attention, in, [this, where, cache](const at::Tensor& t) {
                     return self_attn->forward_placed(input_layernorm(t), where, cache);
                   });
    return h + mlp(post_attention_layernorm(h));
  });
}

Qwen3ModelImpl::Qwen3ModelImpl(const Qwen3Config& config)
    : rope_(config.head_dim, config.rope_theta) {
  embed_tokens =
      register_module("embed_tokens", torch::nn::Embedding(config.vocab_size, config.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers->push_back(Qwen3DecoderLayer(config));
  }
  norm = register_module("norm", RmsNorm(config.hidden_size, config.rms_norm_eps));
}

at::Tensor Qwen3ModelImpl::embed(const at::Tensor& input_ids) {
  if (!tp_) {
    const auto& weight = embed_tokens->weight;
    if (row_sink_ && row_sink_->deferring() && at::GradMode::is_enabled() &&
        weight.requires_grad()) {
      return embedding_rows(weight, input_ids, row_sink_);
    }
    return embed_tokens(input_ids);
  }
  return vocab_parallel_embedding(embed_tokens->weight, input_ids, vocab_start_, *tp_);
}

at::Tensor vocab_parallel_embedding(const at::Tensor& weight, const at::Tensor& input_ids,
                                    int64_t vocab_start, const TensorParallelGroup& group) {
  const auto local = input_ids - vocab_start;
  const auto outside = (local < 0).logical_or(local >= weight.size(0));
  const auto rows = at::embedding(weight, local.masked_fill(outside, 0));
  return group.reduce_out(rows.masked_fill(outside.unsqueeze(-1), 0.0));
}

void Qwen3ModelImpl::set_embedding_row_sink(std::shared_ptr<EmbeddingRowSink> sink) {
  row_sink_ = std::move(sink);
}

void Qwen3ModelImpl::set_vocab_parallel(std::shared_ptr<const TensorParallelGroup> group,
                                        int64_t vocab_start) {
  tp_ = std::move(group);
  vocab_start_ = vocab_start;
}

at::Tensor Qwen3ModelImpl::forward(const at::Tensor& input_ids) {
  auto h = embed(input_ids);
  const auto cos_sin = detail::rope_tables(rope_, input_ids, h);
  for (const auto& layer : *layers) {
    h = layer->as<Qwen3DecoderLayer>()->forward(h, cos_sin);
  }
  return norm(h);
}

at::Tensor Qwen3ModelImpl::forward_placed(const at::Tensor& input_ids, const TokenPlacement& where,
                                          KvCache* cache) {
  if (cache != nullptr && cache->layers.size() != layers->size()) {
    throw std::invalid_argument("d9d::model::Qwen3Model: the KV cache has " +
                                std::to_string(cache->layers.size()) + " layers, the model " +
                                std::to_string(layers->size()));
  }
  auto h = embed(input_ids);
  for (std::size_t i = 0; i < layers->size(); ++i) {
    h = (*layers)[i]->as<Qwen3DecoderLayer>()->forward_placed(
        h, where, cache != nullptr ? &cache->layers[i] : nullptr);
  }
  return norm(h);
}

uint64_t draw_init_seed() {
  auto generator = at::detail::getDefaultCPUGenerator();
  const std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get<at::CPUGeneratorImpl>()->random64();
}

void init_qwen3_parameters(torch::nn::Module& module, const Qwen3Config& config, uint64_t seed) {
  const at::NoGradGuard no_grad;
  for (auto& item : module.named_parameters()) {
    const auto& name = item.key();
    auto& param = item.value();
    if (name.size() >= 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0) {
      param.fill_(1.0);
      continue;
    }
    // FNV-1a of the name, mixed with the base draw: a stable seed per parameter.
    uint64_t hash = 14695981039346656037ULL ^ seed;
    for (const char c : name) {
      hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
    }
    auto generator = at::make_generator<at::CPUGeneratorImpl>(hash);
    const auto values = at::empty(param.sizes(), at::TensorOptions().dtype(at::kFloat))
                            .normal_(0.0, config.initializer_range, generator);
    param.copy_(values);
  }
}

Qwen3ForCausalLMImpl::Qwen3ForCausalLMImpl(Qwen3Config config) : config_(config) {
  const uint64_t seed = draw_init_seed();
  config_.validate();
  model = register_module("model", Qwen3Model(config_));
  if (!config_.tie_word_embeddings) {
    lm_head = register_module("lm_head", Linear(config_.hidden_size, config_.vocab_size));
  }
  init_qwen3_parameters(*this, config_, seed);
}

at::Tensor Qwen3ForCausalLMImpl::head_logits(const at::Tensor& hidden) {
  // Under tensor parallelism the head is column-parallel: its input's gradient is summed.
  return detail::tied_head(tp_ ? tp_->copy_in(hidden) : hidden, lm_head, model->embed_tokens);
}

at::Tensor Qwen3ForCausalLMImpl::forward(const at::Tensor& input_ids) {
  refuse_context_parallel("forward");
  const auto logits = head_logits(model(input_ids));
  return tp_ ? tp_->gather_last(logits) : logits;
}

at::Tensor Qwen3ForCausalLMImpl::forward_placed(const at::Tensor& input_ids,
                                                const TokenPlacement& where, KvCache* cache,
                                                int64_t last) {
  refuse_context_parallel("forward_placed");
  auto hidden = model->forward_placed(input_ids, where, cache);
  if (last > 0 && last < hidden.size(1)) {
    hidden = hidden.narrow(1, hidden.size(1) - last, last);
  }
  const auto logits = head_logits(hidden);
  return tp_ ? tp_->gather_last(logits) : logits;
}

KvCache Qwen3ForCausalLMImpl::make_cache(int64_t batch, int64_t capacity,
                                         const at::TensorOptions& options) const {
  KvCache cache;
  cache.capacity = capacity;
  for (const auto& layer : *model->layers) {
    const auto& attention = layer->as<Qwen3DecoderLayer>()->self_attn;
    const std::vector<int64_t> shape{batch, attention->local_kv_heads(), capacity,
                                     config_.head_dim};
    cache.layers.push_back({at::empty(shape, options), at::empty(shape, options)});
  }
  return cache;
}

std::vector<std::string> Qwen3ForCausalLMImpl::vocab_parameters() const {
  std::vector<std::string> names{"model.embed_tokens.weight"};
  if (lm_head) {
    names.emplace_back("lm_head.weight");
  }
  return names;
}

void Qwen3ForCausalLMImpl::set_tensor_parallel(std::shared_ptr<const TensorParallelGroup> group) {
  if (tp_) {
    throw std::logic_error("d9d::model::Qwen3ForCausalLM: tensor parallelism is already set");
  }
  const int64_t rows = model->embed_tokens->weight.size(0);
  model->set_vocab_parallel(group, group->rank() * rows);
  tp_ = std::move(group);
}

at::Tensor Qwen3ForCausalLMImpl::embedding_weight() const { return model->embed_tokens->weight; }

void Qwen3ForCausalLMImpl::set_embedding_row_sink(std::shared_ptr<EmbeddingRowSink> sink) {
  model->set_embedding_row_sink(std::move(sink));
}

void Qwen3ForCausalLMImpl::set_context_parallel(std::shared_ptr<const ContextParallelGroup> group) {
  if (cp_) {
    throw std::logic_error("d9d::model::Qwen3ForCausalLM: context parallelism is already set");
  }
  for (const auto& layer : *model->layers) {
    layer->as<Qwen3DecoderLayer>()->self_attn->set_context_parallel(group);
  }
  cp_ = std::move(group);
}

void Qwen3ForCausalLMImpl::refuse_context_parallel(const char* what) const {
  if (cp_) {
    throw std::logic_error(std::string("d9d::model::Qwen3ForCausalLM::") + what +
                           ": under context parallelism each rank holds two chunks of the "
                           "sequence, so it computes loss() only");
  }
}

CausalLmLoss Qwen3ForCausalLMImpl::context_loss(const at::Tensor& input_ids,
                                                const at::Tensor& labels, int64_t ignore_index,
                                                const TokenPlacement* where) {
  const int rank = cp_->rank();
  const int size = cp_->size();
  const int64_t batch = input_ids.size(0);
  const int64_t tokens = input_ids.size(1);
  check_context_length(tokens, size);
  // The positions and the placement follow the tokens: the tables' rows and the visibility's
  // query rows of this rank's chunks (its key columns stay global: context_attention slices them).
  TokenPlacement local;
  const auto rows = [&](const at::Tensor& table) {
    const auto per_row = table.view({batch, tokens, table.size(-1)});
    return context_shard(per_row, 1, rank, size).reshape({-1, table.size(-1)});
  };
  if (where != nullptr) {
    if (where->past != 0) {
      throw std::invalid_argument(
          "d9d::model::Qwen3ForCausalLM::loss: no cached tokens under context parallelism");
    }
    local.cos = rows(where->cos);
    local.sin = rows(where->sin);
    if (where->visible.defined()) {
      local.visible = context_shard(where->visible, 2, rank, size);
    }
  } else {
    local = detail::context_placement(
        model->rope(), batch, tokens, input_ids.device(),
        RotaryEmbedding::table_dtype(model->embed_tokens->weight.scalar_type()), *cp_);
  }
  const auto hidden =
      model->forward_placed(context_shard(input_ids, 1, rank, size), local, nullptr);
  return loss_of(hidden, context_shard(labels, 1, rank, size), ignore_index);
}

CausalLmLoss Qwen3ForCausalLMImpl::loss(const at::Tensor& input_ids, const at::Tensor& labels,
                                        int64_t ignore_index, const TokenPlacement* where) {
  if (cp_) {
    return context_loss(input_ids, labels, ignore_index, where);
  }
  const auto hidden =
      where != nullptr ? model->forward_placed(input_ids, *where, nullptr) : model(input_ids);
  return loss_of(hidden, labels, ignore_index);
}

CausalLmLoss Qwen3ForCausalLMImpl::loss_of(const at::Tensor& hidden, const at::Tensor& labels,
                                           int64_t ignore_index) {
  // The fused head reads lm_head's weight alone: a head with an adapter (LoRA on "lm_head") takes
  // the unfused path, which runs the layer and its adapter.
  if (tp_) {
    // Loss-parallel: this rank's logits only; the cross-entropy all-reduces row statistics.
    // The head on [B, T, H]: under sequence parallelism its input gathers along the sequence.
    auto logits = head_logits(hidden);
    logits = logits.reshape({-1, logits.size(-1)});
    const auto flat_labels = labels.reshape({-1});
    return {.loss_sum = tp_->cross_entropy_sum(logits, flat_labels, tp_->rank() * logits.size(-1),
                                               ignore_index),
            .tokens = (flat_labels != ignore_index).sum()};
  }
  if (!fused_kernels() || (lm_head && lm_head->adapter)) {
    return causal_lm_loss(head_logits(hidden), labels, ignore_index);
  }
  const auto& head = lm_head ? lm_head->weight : model->embed_tokens->weight;
  return linear_cross_entropy(hidden.reshape({-1, hidden.size(-1)}), head, labels.reshape({-1}),
                              ignore_index);
}

CausalLmLoss causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels,
                            int64_t ignore_index) {
  const int64_t vocab = logits.size(-1);
  // At least float32 (bf16 logits are upcast; float64 stays float64).
  const auto flat_logits =
      logits.reshape({-1, vocab}).to(at::promote_types(logits.scalar_type(), at::kFloat));
  const auto flat_labels = labels.reshape({-1});
  auto loss_sum = at::cross_entropy_loss(flat_logits, flat_labels, /*weight=*/{},
                                         at::Reduction::Sum, ignore_index);
  auto tokens = (flat_labels != ignore_index).sum();
  return {.loss_sum = std::move(loss_sum), .tokens = std::move(tokens)};
}

}  // namespace d9d::model
