// tools/generate — continues prompts with a Qwen3 model exported by the trainer (or any Hugging
// Face Qwen3 checkpoint), through d9d::model::generate and its KV cache.
//
//   bazel run //tools/generate -- --model runs/quickstart/model --prompt "The trainer"
//   bazel run //tools/generate -- --model M --prompt "a" --prompt "b" --temperature 0.8 --top-p 0.9
//   bazel run //tools/generate -- --model Qwen3-0.6B --ids "785 3974 13876" --device cuda
//   ... --time     # also a warm-up run, then the generation's seconds and tokens/s on stderr
//
// Text prompts are encoded with d9d::data::ByteTokenizer (the tokenizer of tools/tokenize and the
// demo), so they need a model whose vocabulary is that tokenizer's (258 ids); a continuation
// stops at <|endoftext|> and prints as text. --ids takes token ids of any tokenizer (space
// separated) and prints ids. All prompts of a run form one batch.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <d9d/data/byte_tokenizer.hpp>
#include <d9d/model/hf.hpp>
#include <d9d/model/qwen3.hpp>

namespace {

struct Options {
  std::string model_dir;
  std::vector<std::string> prompts;
  std::vector<std::string> ids;
  std::string dtype = "float32";
  std::string device = "cpu";
  bool time = false;
  d9d::model::GenerationOptions generation;
};

std::vector<int64_t> parse_ids(const std::string& text) {
  std::istringstream in(text);
  std::vector<int64_t> ids;
  std::string word;
  while (in >> word) {
    std::size_t used = 0;
    int64_t id = 0;
    try {
      id = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != word.size()) {
      throw std::invalid_argument("--ids \"" + text + "\": \"" + word + "\" is not a token id");
    }
    ids.push_back(id);
  }
  return ids;
}

int run(Options options) {
  auto model = d9d::model::load_hf_qwen3(options.model_dir);
  const auto dtype = options.dtype == "float64"    ? at::kDouble
                     : options.dtype == "bfloat16" ? at::kBFloat16
                                                   : at::kFloat;
  model->to(c10::Device(options.device), dtype);
  const d9d::data::ByteTokenizer tokenizer;
  const bool text = !options.prompts.empty();
  std::vector<std::vector<int64_t>> prompts;
  if (text) {
    if (model->config().vocab_size != tokenizer.vocab_size()) {
      throw std::invalid_argument(
          "--prompt encodes text with the byte tokenizer (" +
          std::to_string(tokenizer.vocab_size()) + " ids), but the model's vocabulary has " +
          std::to_string(model->config().vocab_size) + "; pass token ids with --ids instead");
    }
    for (const auto& prompt : options.prompts) {
      const auto encoded = tokenizer.encode(prompt);
      prompts.emplace_back(encoded.begin(), encoded.end());
    }
    options.generation.stop_tokens.push_back(d9d::data::ByteTokenizer::end_of_text);
  } else {
    for (const auto& ids : options.ids) {
      prompts.push_back(parse_ids(ids));
    }
  }
  if (options.time) {  // kernels loaded and caches warm before the timed run
    auto warm_up = options.generation;
    warm_up.max_new_tokens = std::min<int64_t>(8, warm_up.max_new_tokens);
    (void)d9d::model::generate(*model, prompts, warm_up);
  }
  const auto start = std::chrono::steady_clock::now();
  const auto continuations = d9d::model::generate(*model, prompts, options.generation);
  if (options.time) {
    // generate() copies every step's tokens to the host, so the device is done when it returns.
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::size_t tokens = 0;
    for (const auto& row : continuations) {
      tokens += row.size();
    }
    std::cerr << "generate: " << prompts.size() << " prompts, " << tokens << " new tokens in "
              << seconds << " s (" << static_cast<double>(tokens) / seconds << " tokens/s)\n";
  }
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    if (text) {
      // Continuations span lines: each gets a header when there are several.
      if (prompts.size() > 1) {
        std::cout << "--- " << (i + 1) << "/" << prompts.size() << "\n";
      }
      const std::vector<uint32_t> ids(continuations[i].begin(), continuations[i].end());
      std::cout << options.prompts[i] << tokenizer.decode(ids) << "\n";
    } else {
      for (const int64_t id : continuations[i]) {
        std::cout << id << " ";
      }
      std::cout << "\n";
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Continue prompts with an exported Qwen3 model (greedy or sampled, KV cache)"};
  Options options;
  auto& generation = options.generation;
  generation.max_new_tokens = 64;
  app.add_option("--model", options.model_dir, "checkpoint directory (config.json + safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  auto* prompt = app.add_option("--prompt", options.prompts,
                                "text prompt, byte-tokenized (repeat for a batch)");
  auto* ids = app.add_option("--ids", options.ids, "prompt as space-separated token ids (repeat)");
  prompt->excludes(ids);
  app.add_option("--max-new-tokens", generation.max_new_tokens, "new tokens per prompt at most")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--temperature", generation.temperature, "0: greedy; > 0: sampling")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--top-p", generation.top_p, "nucleus sampling mass, in (0, 1]")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--seed", generation.seed, "seed of the sampling")->capture_default_str();
  app.add_option("--dtype", options.dtype, "compute dtype")
      ->check(CLI::IsMember({"float32", "float64", "bfloat16"}))
      ->capture_default_str();
  app.add_option("--device", options.device, "cpu, cuda, cuda:1, ...")->capture_default_str();
  app.add_flag("--time", options.time, "warm up, then print the generation's speed to stderr");
  CLI11_PARSE(app, argc, argv);
  if (options.prompts.empty() && options.ids.empty()) {
    std::cerr << "generate: error: give --prompt TEXT or --ids \"ID ID ...\"\n";
    return 2;
  }
  try {
    return run(options);
  } catch (const std::exception& error) {
    std::cerr << "generate: error: " << error.what() << "\n";
    return 1;
  }
}
