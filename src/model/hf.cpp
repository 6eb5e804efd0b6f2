// d9d/model/hf.cpp — Hugging Face checkpoint directories (config.json + model.safetensors, or
// model.safetensors.index.json + shards).
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <d9d/model/hf.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/state/safetensors_sharded.hpp>
#include <d9d/util/files.hpp>
#include <d9d/util/quote.hpp>

namespace d9d::model {
namespace {

// Through a temporary file, fsynced, then renamed (and the directory fsynced).
void write_text_file(const std::string& path, const std::string& text) {
  files::AtomicFile file(path, "d9d::model::save_hf_checkpoint");
  file.write(text.data(), text.size());
  file.commit();
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

struct HfCheckpointWriter::Impl {
  std::string dir;
  std::string config_json;
  at::ScalarType dtype = at::kFloat;
  std::unique_ptr<state::SafetensorsWriter> weights;
};

HfCheckpointWriter::HfCheckpointWriter(
    const std::string& dir, std::string config_json,
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes, at::ScalarType dtype)
    : impl_(std::make_unique<Impl>()) {
  files::create_directories(dir, "d9d::model::save_hf_checkpoint");
  std::vector<state::SafetensorsEntry> entries;
  entries.reserve(shapes.size());
  for (const auto& [name, shape] : shapes) {
    entries.push_back({.name = name, .dtype = dtype, .shape = shape});
  }
  impl_->dir = dir;
  impl_->config_json = std::move(config_json);
  impl_->dtype = dtype;
  impl_->weights = std::make_unique<state::SafetensorsWriter>(
      files::join(dir, "model.safetensors"), std::move(entries),
      std::map<std::string, std::string>{{"format", "pt"}});
}

HfCheckpointWriter::~HfCheckpointWriter() = default;

void HfCheckpointWriter::write(const std::string& name, const at::Tensor& tensor) {
  impl_->weights->write(name, tensor.detach().to(at::kCPU, impl_->dtype));
}

void HfCheckpointWriter::commit() {
  impl_->weights->commit();
  if (!impl_->config_json.empty()) {
    write_text_file(files::join(impl_->dir, "config.json"), impl_->config_json);
  }
  // The renames above, and `dir` itself when it was just created, reach the disk.
  files::sync_directory(impl_->dir);
  files::sync_directory(files::parent(impl_->dir));
}

void save_hf_checkpoint(const torch::nn::Module& model, const std::string& dir,
                        const std::string& config_json, at::ScalarType dtype) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (const auto& item : model.named_parameters()) {
    shapes.emplace_back(item.key(), item.value().sizes().vec());
  }
  HfCheckpointWriter out(dir, config_json, shapes, dtype);
  for (const auto& item : model.named_parameters()) {
    out.write(item.key(), item.value());
  }
  out.commit();
}

void load_hf_checkpoint(torch::nn::Module& model, const std::string& dir,
                        const std::vector<std::string>& ignore) {
  const std::string who = "d9d::model::load_hf_checkpoint";
  // The files, and for each tensor the file holding it: model.safetensors when there is one (as
  // transformers prefers it), else the shards model.safetensors.index.json lists. Only headers
  // are read here.
  std::vector<state::SafetensorsFile> checkpoint;
  std::string path = files::join(dir, "model.safetensors");
  if (files::exists(path)) {
    checkpoint.push_back(state::open_safetensors_as(path, who));
  } else if (files::exists(files::join(dir, state::kSafetensorsIndexName))) {
    path = files::join(dir, state::kSafetensorsIndexName);
    checkpoint = state::open_safetensors_shards(state::load_safetensors_index(dir), who);
  } else {
    throw std::runtime_error(who + ": " + dir + " holds neither model.safetensors nor " +
                             std::string(state::kSafetensorsIndexName) +
                             ". Fix: pass a directory written by save_pretrained");
  }
  std::map<std::string, std::pair<std::size_t, const state::SafetensorsEntry*>> by_name;
  for (std::size_t file = 0; file < checkpoint.size(); ++file) {
    for (const auto& entry : checkpoint[file].entries()) {
      by_name.emplace(entry.name, std::make_pair(file, &entry));
    }
  }

  // Every check before the first copy.
  auto params = model.named_parameters();
  std::vector<std::string> missing;
  std::vector<std::string> mismatched;
  std::vector<std::string> not_floating;
  for (const auto& item : params) {
    const auto it = by_name.find(item.key());
    if (it == by_name.end()) {
      missing.push_back(item.key());
      continue;
    }
    const state::SafetensorsEntry& entry = *it->second.second;
    if (c10::IntArrayRef(entry.shape) != item.value().sizes()) {
      mismatched.push_back(item.key() + " (file " + c10::str(c10::IntArrayRef(entry.shape)) +
                           ", model " + c10::str(item.value().sizes()) + ")");
    } else if (!at::isFloatingType(entry.dtype)) {
      not_floating.push_back(item.key() + " (" + std::string(c10::toString(entry.dtype)) + ")");
    }
  }
  std::vector<std::string> unexpected;
  for (const auto& [name, where] : by_name) {
    const bool ignored = std::find(ignore.begin(), ignore.end(), name) != ignore.end();
    if (!ignored && params.find(name) == nullptr) {
      unexpected.push_back(name);
    }
  }
  if (const std::string details = util::misfit({{"missing", missing},
                                                {"unexpected", unexpected},
                                                {"other shapes:", mismatched},
                                                {"not floating point:", not_floating}});
      !details.empty()) {
    throw std::runtime_error(who + ": " + path + " does not fit the model:" + details);
  }

  // Tensor by tensor, file by file, from the mapping: each parameter is copied (and converted to
  // its dtype and device) from a view of the file, whose pages are dropped after the copy, so the
  // whole checkpoint is never in memory at once.
  const at::NoGradGuard no_grad;
  for (std::size_t file = 0; file < checkpoint.size(); ++file) {
    for (auto& item : params) {
      const auto& [holder, entry] = by_name.at(item.key());
      if (holder != file) {
        continue;
      }
      item.value().copy_(checkpoint[file].view(entry->name));
      (void)checkpoint[file].release(entry->name);
    }
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
