// d9d::advise::qwen3_activation_bytes (d9d/advise/activation_memory.hpp).
#include <cstdint>
#include <stdexcept>
#include <string>

#include <d9d/advise/activation_memory.hpp>
#include <d9d/model/qwen3.hpp>

namespace d9d::advise {

ActivationBytes qwen3_activation_bytes(const model::Qwen3Config& config, int64_t microbatch_size,
                                       int64_t sequence_length) {
  if (microbatch_size < 1 || sequence_length < 1) {
    throw std::invalid_argument(
        "d9d::advise::qwen3_activation_bytes: microbatch_size and sequence_length must be at "
        "least 1, got " +
        std::to_string(microbatch_size) + " and " + std::to_string(sequence_length));
  }
  constexpr int64_t kFloat = 4;
  const int64_t tokens = microbatch_size * sequence_length;
  const int64_t h = config.hidden_size;
  const int64_t heads = config.num_attention_heads;
  const int64_t kv_heads = config.num_key_value_heads;
  const int64_t q = heads * config.head_dim;
  const int64_t k = kv_heads * config.head_dim;
  const int64_t i = config.intermediate_size;
  // Per token of one layer, in elements (the file comment's table).
  const int64_t layer =
      (h + 1) + (q + k + heads + kv_heads) + (k + q + k + q + heads) + (h + h + 1) + 2 * i + h;
  ActivationBytes out;
  out.layers = config.num_hidden_layers * layer * tokens * kFloat;
  out.loss = ((2 * h + 1) * tokens + config.vocab_size * h) * kFloat;
  out.rope = 2 * sequence_length * (config.head_dim / 2) * kFloat;
  return out;
}

}  // namespace d9d::advise
