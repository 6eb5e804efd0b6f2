// d9d/model/generate.cpp — token generation for the Qwen3 causal LM: a left-padded batch,
// prefilled once and continued one token per step through the KV cache (or, as the reference,
// recomputed whole every step), greedy or sampled with temperature and top-p.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <d9d/model/qwen3.hpp>

namespace d9d::model {
namespace {

void check(const Qwen3ForCausalLMImpl& model, const std::vector<std::vector<int64_t>>& prompts,
           const GenerationOptions& options) {
  const auto fail = [](const std::string& what) {
    throw std::invalid_argument("d9d::model::generate: " + what);
  };
  if (options.max_new_tokens < 0) {
    fail("max_new_tokens must be >= 0, got " + std::to_string(options.max_new_tokens));
  }
  if (!std::isfinite(options.temperature) || options.temperature < 0) {
    fail("temperature must be finite and >= 0 (0: greedy), got " +
         std::to_string(options.temperature));
  }
  if (!(options.top_p > 0 && options.top_p <= 1)) {
    fail("top_p must be in (0, 1], got " + std::to_string(options.top_p));
  }
  const int64_t vocab = model.config().vocab_size;
  for (std::size_t row = 0; row < prompts.size(); ++row) {
    if (prompts[row].empty()) {
      fail("prompt " + std::to_string(row) + " is empty; each needs at least one token");
    }
    for (std::size_t i = 0; i < prompts[row].size(); ++i) {
      const int64_t id = prompts[row][i];
      if (id < 0 || id >= vocab) {
        fail("prompt " + std::to_string(row) + " has token " + std::to_string(id) +
             " at position " + std::to_string(i) + ", outside the vocabulary [0, " +
             std::to_string(vocab) + ")");
      }
    }
  }
  for (const int64_t id : options.stop_tokens) {
    if (id < 0 || id >= vocab) {
      fail("stop token " + std::to_string(id) + " is outside the vocabulary [0, " +
           std::to_string(vocab) + ")");
    }
  }
}

// The next token of every row from its last logits [B, vocab].
at::Tensor choose(const at::Tensor& logits, const GenerationOptions& options,
                  at::Generator& generator) {
  if (options.temperature == 0) {
    return logits.argmax(-1);
  }
  // Sampled on the CPU in double, so the draws depend only on the seed.
  auto probs = at::softmax(logits.to(at::kCPU, at::kDouble) / options.temperature, -1);
  if (options.top_p < 1) {
    const auto [sorted, order] = probs.sort(-1, /*descending=*/true);
    // A token stays when the tokens more likely than it have not yet reached top_p.
    const auto before = sorted.cumsum(-1) - sorted;
    const auto kept = sorted.masked_fill(before.ge(options.top_p), 0.0);
    probs = at::zeros_like(probs).scatter(-1, order, kept);
  }
  return at::multinomial(probs, 1, /*replacement=*/false, generator)
      .squeeze(-1)
      .to(logits.device());
}

// Restores the model's training flag when generation ends.
class EvalMode {
 public:
  explicit EvalMode(torch::nn::Module& model) : model_(model), was_training_(model.is_training()) {
    model_.eval();
  }
  ~EvalMode() { model_.train(was_training_); }
  EvalMode(const EvalMode&) = delete;
  EvalMode& operator=(const EvalMode&) = delete;
  EvalMode(EvalMode&&) = delete;
  EvalMode& operator=(EvalMode&&) = delete;

 private:
  torch::nn::Module& model_;
  bool was_training_;
};

}  // namespace

std::vector<std::vector<int64_t>> generate(Qwen3ForCausalLMImpl& model,
                                           const std::vector<std::vector<int64_t>>& prompts,
                                           const GenerationOptions& options) {
  check(model, prompts, options);
  std::vector<std::vector<int64_t>> out(prompts.size());
  if (prompts.empty() || options.max_new_tokens == 0) {
    return out;
  }
  const at::NoGradGuard no_grad;
  const EvalMode eval(model);
  const auto& parameter = model.model->embed_tokens->weight;
  const auto device = parameter.device();
  const auto table_dtype = RotaryEmbedding::table_dtype(parameter.scalar_type());
  const auto& rope = model.model->rope();
  const auto batch = static_cast<int64_t>(prompts.size());
  int64_t longest = 0;
  for (const auto& prompt : prompts) {
    longest = std::max(longest, static_cast<int64_t>(prompt.size()));
  }
  const int64_t capacity = longest + options.max_new_tokens;

  // Left-padded prompts; `valid` marks real tokens over the whole capacity (generated ones are
  // valid as they come), `lengths` counts each row's tokens (its next position).
  auto ids = at::zeros({batch, longest}, at::kLong);
  auto valid = at::zeros({batch, capacity}, at::kBool);
  auto lengths = at::empty({batch}, at::kLong);
  for (int64_t row = 0; row < batch; ++row) {
    const auto& prompt = prompts[static_cast<std::size_t>(row)];
    const auto size = static_cast<int64_t>(prompt.size());
    ids[row].narrow(0, longest - size, size).copy_(at::tensor(prompt, at::kLong));
    valid[row].narrow(0, longest - size, size).fill_(true);
    lengths[row] = size;
  }
  ids = ids.to(device);
  valid = valid.to(device);
  lengths = lengths.to(device);
  const auto prompt_positions = (valid.narrow(1, 0, longest).cumsum(1) - 1).clamp_min(0);

  auto generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  KvCache cache;
  if (options.use_cache) {
    cache = model.make_cache(batch, capacity, parameter.options());
  }
  std::vector<bool> finished(prompts.size(), false);
  auto sequence = ids;  // the prompts and the tokens so far (without a cache)
  at::Tensor next;      // [B, 1], the last chosen tokens
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    at::Tensor logits;
    const int64_t seen = longest + step;  // slots filled before this step's forward
    if (!options.use_cache) {
      const auto positions = (valid.narrow(1, 0, seen).cumsum(1) - 1).clamp_min(0);
      logits = model.forward_placed(
          sequence, place_tokens(rope, positions, valid.narrow(1, 0, seen), 0, table_dtype),
          nullptr, 1);
    } else if (step == 0) {
      logits = model.forward_placed(
          ids, place_tokens(rope, prompt_positions, valid.narrow(1, 0, longest), 0, table_dtype),
          &cache, 1);
      cache.length = longest;
    } else {
      const auto positions = (lengths + (step - 1)).unsqueeze(1);
      logits = model.forward_placed(
          next, place_tokens(rope, positions, valid.narrow(1, 0, seen), seen - 1, table_dtype),
          &cache, 1);
      cache.length = seen;
    }
    next = choose(logits.select(1, -1), options, generator).unsqueeze(1);
    valid.select(1, seen).fill_(true);
    if (!options.use_cache) {
      sequence = at::cat({sequence, next}, 1);
    }
    const auto chosen = next.squeeze(1).cpu();
    const auto* values = chosen.data_ptr<int64_t>();
    bool all_finished = true;
    for (std::size_t row = 0; row < out.size(); ++row) {
      if (!finished[row]) {
        out[row].push_back(values[row]);
        for (const int64_t stop : options.stop_tokens) {
          finished[row] = finished[row] || values[row] == stop;
        }
      }
      all_finished = all_finished && finished[row];
    }
    if (all_finished) {
      break;
    }
  }
  return out;
}

}  // namespace d9d::model
