// d9d/model/hf.cpp — Hugging Face checkpoint directories (model.safetensors + config.json).
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <d9d/model/hf.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>

namespace d9d::model {
namespace {

void write_text_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::FILE* out = std::fopen(tmp.c_str(), "w");
  if (out == nullptr) {
    throw std::runtime_error("d9d: cannot write " + tmp + ": " + std::strerror(errno));
  }
  const bool ok = std::fputs(text.c_str(), out) >= 0;
  if (std::fclose(out) != 0 || !ok) {
    throw std::runtime_error("d9d: cannot write " + tmp);
  }
  files::rename(tmp, path);
}

std::string list(const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < 8; ++i) {
    out += (i > 0 ? ", " : "") + names[i];
  }
  if (names.size() > 8) {
    out += ", ... (" + std::to_string(names.size()) + " in all)";
  }
  return out;
}

}  // namespace

std::string read_text_file(const std::string& path) {
  std::FILE* in = std::fopen(path.c_str(), "rb");
  if (in == nullptr) {
    throw std::runtime_error("d9d: cannot read " + path + ": " + std::strerror(errno));
  }
  std::string text;
  char buffer[4096];
  std::size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), in)) > 0) {
    text.append(buffer, n);
  }
  const bool failed = std::ferror(in) != 0;
  std::fclose(in);
  if (failed) {
    throw std::runtime_error("d9d: error while reading " + path);
  }
  return text;
}

void save_hf_checkpoint(const torch::nn::Module& model, const std::string& dir,
                        const std::string& config_json, at::ScalarType dtype) {
  files::create_directories(dir, "d9d::model::save_hf_checkpoint");
  state::NamedTensors tensors;
  for (const auto& item : model.named_parameters()) {
    tensors.emplace_back(item.key(), item.value().detach().to(at::kCPU, dtype));
  }
  state::save_safetensors(files::join(dir, "model.safetensors"), tensors, {{"format", "pt"}});
  if (!config_json.empty()) {
    write_text_file(files::join(dir, "config.json"), config_json);
  }
}

void load_hf_checkpoint(torch::nn::Module& model, const std::string& dir,
                        const std::vector<std::string>& ignore) {
  const std::string path = files::join(dir, "model.safetensors");
  auto loaded = state::load_safetensors(path);
  std::map<std::string, at::Tensor> by_name;
  for (auto& [name, tensor] : loaded) {
    by_name.emplace(name, std::move(tensor));
  }
  auto params = model.named_parameters();
  std::vector<std::string> missing;
  std::vector<std::string> mismatched;
  std::set<std::string> used;
  for (const auto& item : params) {
    const auto it = by_name.find(item.key());
    if (it == by_name.end()) {
      missing.push_back(item.key());
    } else if (it->second.sizes() != item.value().sizes()) {
      mismatched.push_back(item.key() + " (file " + c10::str(it->second.sizes()) + ", model " +
                           c10::str(item.value().sizes()) + ")");
    } else {
      used.insert(item.key());
    }
  }
  std::vector<std::string> unexpected;
  for (const auto& [name, tensor] : by_name) {
    const bool ignored = std::find(ignore.begin(), ignore.end(), name) != ignore.end();
    if (used.count(name) == 0 && !ignored &&
        std::find(mismatched.begin(), mismatched.end(), name) == mismatched.end() &&
        params.find(name) == nullptr) {
      unexpected.push_back(name);
    }
  }
  if (!missing.empty() || !mismatched.empty() || !unexpected.empty()) {
    std::string message = "d9d::model::load_hf_checkpoint: " + path + " does not fit the model:";
    if (!missing.empty()) {
      message += " missing " + list(missing) + ";";
    }
    if (!unexpected.empty()) {
      message += " unexpected " + list(unexpected) + ";";
    }
    if (!mismatched.empty()) {
      message += " other shapes: " + list(mismatched) + ";";
    }
    throw std::runtime_error(message);
  }
  const at::NoGradGuard no_grad;
  for (auto& item : params) {
    item.value().copy_(by_name.at(item.key()));
  }
}

Qwen3ForCausalLM load_hf_qwen3(const std::string& dir) {
  const auto config = Qwen3Config::from_json_text(read_text_file(files::join(dir, "config.json")));
  Qwen3ForCausalLM model(config);
  std::vector<std::string> ignore;
  if (config.tie_word_embeddings) {
    ignore.emplace_back("lm_head.weight");  // some tied checkpoints carry the shared weight twice
  }
  load_hf_checkpoint(*model, dir, ignore);
  return model;
}

}  // namespace d9d::model
