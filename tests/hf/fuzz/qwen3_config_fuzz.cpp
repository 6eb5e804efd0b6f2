// The libFuzzer target of the Hugging Face config reader, d9d::model::Qwen3Config::from_json_text
// (tools/fuzz/json_configs hf builds and runs it with clang, ASan and UBSan;
// //tests/hf:qwen3_config_fuzz_replay_test replays the committed corpus through it with gcc).
//
//   LLVMFuzzerTestOneInput(bytes, size);   // returns 0, or aborts on a bug
//
// The rules it enforces: only std::invalid_argument comes out of the reader, its message starting
// with "d9d Qwen3 config: "; an accepted config validates (sizes from 1 to 2^31 - 1, heads that
// divide, finite positive eps and theta); its export, to_hf_json(), reads back as the same config.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>

#include <d9d/model/qwen3.hpp>

#include "tests/support/fuzz_target.hpp"

namespace {

using d9d::model::Qwen3Config;

[[noreturn]] void bug(const std::string& what) {
  std::fprintf(stderr, "Qwen3 config fuzz: %s\n", what.c_str());
  std::abort();
}

// False when refused (the error checked); else the config is in `out`.
bool read(const std::string& text, Qwen3Config& out) {
  try {
    out = Qwen3Config::from_json_text(text);
    return true;
  } catch (const std::invalid_argument& error) {
    if (std::string_view(error.what()).substr(0, 18) != "d9d Qwen3 config: ") {
      bug(std::string("an error without the \"d9d Qwen3 config: \" prefix: ") + error.what());
    }
    return false;
  } catch (const std::exception& error) {
    bug(std::string("not std::invalid_argument: ") + error.what());
  } catch (...) {
    bug("not a std::exception");
  }
}

bool same(const Qwen3Config& a, const Qwen3Config& b) {
  return a.vocab_size == b.vocab_size && a.hidden_size == b.hidden_size &&
         a.intermediate_size == b.intermediate_size && a.num_hidden_layers == b.num_hidden_layers &&
         a.num_attention_heads == b.num_attention_heads &&
         a.num_key_value_heads == b.num_key_value_heads && a.head_dim == b.head_dim &&
         a.rms_norm_eps == b.rms_norm_eps && a.rope_theta == b.rope_theta &&
         a.tie_word_embeddings == b.tie_word_embeddings &&
         a.max_position_embeddings == b.max_position_embeddings &&
         a.initializer_range == b.initializer_range;
}

}  // namespace

bool d9d::testing::fuzz_input_accepted(std::string_view input) {
  Qwen3Config config;
  return read(std::string(input), config);
}

// NOLINTNEXTLINE(readability-identifier-naming): the name libFuzzer calls
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  Qwen3Config config;
  if (!read(text, config)) {
    return 0;
  }
  try {
    config.validate();
  } catch (const std::exception& error) {
    bug(std::string("an accepted config does not validate: ") + error.what());
  }
  const std::string exported = config.to_hf_json();
  Qwen3Config again;
  if (!read(exported, again)) {
    bug("the export of an accepted config is refused: " + exported);
  }
  if (!same(config, again)) {
    bug("the export of an accepted config reads back as another config: " + exported);
  }
  return 0;
}
