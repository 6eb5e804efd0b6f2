// d9d/state/stream.cpp — streaming a checkpoint through a state mapper, and loading into a module.
#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <d9d/state/stream.hpp>
#include <d9d/util/files.hpp>
#include <d9d/util/quote.hpp>

namespace d9d::state {

namespace {

// True when `t` is contiguous and alone in its storage, and shares no memory with `inputs`.
bool owns_its_memory(const at::Tensor& t, const std::vector<at::Tensor>& inputs) {
  if (!t.has_storage() || !t.is_contiguous() || t.storage_offset() != 0 ||
      t.storage().nbytes() != t.nbytes()) {
    return false;
  }
  return std::none_of(inputs.begin(), inputs.end(), [&](const at::Tensor& in) {
    return in.has_storage() && t.storage().is_alias_of(in.storage());
  });
}

}  // namespace

// ---------------------------------------------------------------------------------- StateSource

StateSource StateSource::from_file(SafetensorsFile file) {
  StateSource source;
  source.files_.push_back(file.path());
  std::vector<std::string> keys;
  for (const auto& entry : file.entries()) {
    keys.push_back(entry.name);
  }
  std::sort(keys.begin(), keys.end());
  source.keys_ = std::move(keys);
  source.key_file_.assign(source.keys_.size(), 0);
  source.opened_ = std::move(file);
  return source;
}

StateSource StateSource::from_index(const SafetensorsIndex& index) {
  StateSource source;
  const std::vector<std::string> names = index.files();  // sorted, each once
  for (const auto& name : names) {
    source.files_.push_back(files::join(index.dir, name));
  }
  for (const auto& [key, file] : index.weight_map) {  // sorted by key
    source.keys_.push_back(key);
    source.key_file_.push_back(static_cast<std::size_t>(
        std::lower_bound(names.begin(), names.end(), file) - names.begin()));
  }
  return source;
}

StateSource StateSource::open(const std::string& path) {
  if (files::is_directory(path)) {
    if (files::exists(files::join(path, kSafetensorsIndexName))) {
      return from_index(load_safetensors_index(path));
    }
    const std::string single = files::join(path, "model.safetensors");
    if (files::exists(single)) {
      return from_file(open_safetensors_as(single, "d9d::state::StateSource"));
    }
    throw std::runtime_error("d9d::state::StateSource: " + path + ": a directory with neither " +
                             std::string(kSafetensorsIndexName) +
                             " nor model.safetensors. Fix: pass a checkpoint directory or a "
                             ".safetensors file");
  }
  return from_file(open_safetensors_as(path, "d9d::state::StateSource"));
}

std::size_t StateSource::file_of(std::string_view key) const {
  const auto it = std::lower_bound(keys_.begin(), keys_.end(), key);
  if (it == keys_.end() || *it != key) {
    throw std::out_of_range("d9d::state::StateSource: no tensor " + util::quoted_key(key));
  }
  return key_file_[static_cast<std::size_t>(it - keys_.begin())];
}

SafetensorsFile StateSource::open_file(std::size_t file) const {
  if (file >= files_.size()) {
    throw std::out_of_range("d9d::state::StateSource: file " + std::to_string(file) + " of " +
                            std::to_string(files_.size()));
  }
  if (opened_) {
    return *opened_;
  }
  return open_safetensors_as(files_[file], "d9d::state::stream_state");
}

uint64_t StateSource::offset_hint(std::string_view key) const {
  if (opened_ && opened_->contains(key)) {
    return opened_->entry(key).begin;
  }
  return 0;
}

// -------------------------------------------------------------------------------- infer_shapes

std::map<std::string, TensorSpec> infer_shapes(const StateSource& source, const Mapper& mapper) {
  validate(mapper, source.keys(), {.allow_unused_inputs = true});
  std::map<std::size_t, SafetensorsFile> open;
  std::map<std::string, TensorSpec> specs;
  const auto& groups = mapper.groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].outputs.empty() || !mapper.runs_on_meta(g)) {
      continue;
    }
    TensorMap inputs;
    for (const auto& key : groups[g].inputs) {
      const std::size_t f = source.file_of(key);
      auto it = open.find(f);
      if (it == open.end()) {
        it = open.emplace(f, source.open_file(f)).first;
      }
      if (!it->second.contains(key)) {
        throw std::runtime_error("d9d::state::infer_shapes: " + it->second.path() +
                                 ": the checkpoint index maps tensor " + util::quoted_key(key) +
                                 " to this file, which does not hold it");
      }
      const SafetensorsEntry& entry = it->second.entry(key);
      inputs.emplace(
          key, at::empty(entry.shape, at::TensorOptions().dtype(entry.dtype).device(at::kMeta)));
    }
    for (const auto& [name, tensor] : mapper.apply(g, std::move(inputs))) {
      specs.emplace(name, TensorSpec{.dtype = tensor.scalar_type(), .shape = tensor.sizes().vec()});
    }
  }
  return specs;
}

// -------------------------------------------------------------------------------- stream_state

StreamStats stream_state(const StateSource& source, const Mapper& mapper,
                         const StreamCallback& callback, const StreamOptions& options) {
  const std::string who = "d9d::state::stream_state";
  if (!callback) {
    throw std::invalid_argument(who + ": the callback is empty");
  }
  validate(mapper, source.keys(), {.allow_unused_inputs = options.allow_unused_inputs});
  if (options.check_shapes) {
    (void)infer_shapes(source, mapper);
  }

  // The plan: groups with outputs, ordered by (first file, first data offset, group number).
  const auto& groups = mapper.groups();
  constexpr auto kNoFile = std::numeric_limits<std::size_t>::max();
  std::vector<std::tuple<std::size_t, uint64_t, std::size_t>> order;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].outputs.empty()) {
      continue;  // a drop: nothing to read, nothing to hand on
    }
    std::size_t file = groups[g].inputs.empty() ? 0 : kNoFile;
    uint64_t offset = std::numeric_limits<uint64_t>::max();
    for (const auto& key : groups[g].inputs) {
      const std::size_t f = source.file_of(key);
      const uint64_t o = source.offset_hint(key);
      if (f < file || (f == file && o < offset)) {
        file = f;
        offset = o;
      }
    }
    order.emplace_back(file, groups[g].inputs.empty() ? 0 : offset, g);
  }
  std::sort(order.begin(), order.end());
  // After which step each file is needed no more.
  std::map<std::size_t, std::size_t> last_use;
  for (std::size_t step = 0; step < order.size(); ++step) {
    for (const auto& key : groups[std::get<2>(order[step])].inputs) {
      last_use[source.file_of(key)] = step;
    }
  }

  StreamStats stats;
  std::map<std::size_t, SafetensorsFile> open;
  for (std::size_t step = 0; step < order.size(); ++step) {
    const std::size_t g = std::get<2>(order[step]);
    const MapperGroup& group = groups[g];
    TensorMap inputs;
    std::vector<at::Tensor> input_handles;
    uint64_t held = 0;
    for (const auto& key : group.inputs) {
      const std::size_t f = source.file_of(key);
      auto it = open.find(f);
      if (it == open.end()) {
        it = open.emplace(f, source.open_file(f)).first;
        ++stats.files_opened;
      }
      const SafetensorsFile& file = it->second;
      if (!file.contains(key)) {
        throw std::runtime_error(who + ": " + file.path() + ": the checkpoint index maps tensor " +
                                 util::quoted_key(key) + " to this file, which does not hold it");
      }
      at::Tensor tensor = file.view(key);
      held += tensor.nbytes();
      ++stats.tensors_read;
      stats.bytes_read += tensor.nbytes();
      input_handles.push_back(tensor);
      inputs.emplace(key, std::move(tensor));
    }
    TensorMap outputs = mapper.apply(g, std::move(inputs));
    for (auto& [name, tensor] : outputs) {
      if (!owns_its_memory(tensor, input_handles)) {
        tensor = tensor.clone(at::MemoryFormat::Contiguous);
        stats.copied_bytes += tensor.nbytes();
      }
      held += tensor.nbytes();
    }
    input_handles.clear();  // the inputs go before the outputs are handed on
    for (const auto& key : group.inputs) {
      // Their mapped pages too (when no view of them is left), or a long stream through one
      // large file would keep every page it has read resident.
      if (open.at(source.file_of(key)).release(key)) {
        ++stats.tensors_released;
      }
    }
    for (auto it = open.begin(); it != open.end();) {
      it = last_use.at(it->first) <= step ? open.erase(it) : std::next(it);
    }
    stats.peak_bytes = std::max(stats.peak_bytes, held);
    ++stats.groups;
    for (auto& [name, tensor] : outputs) {
      ++stats.outputs;
      stats.output_bytes += tensor.nbytes();
      callback(name, tensor);
      tensor = at::Tensor();
    }
  }
  return stats;
}

// ----------------------------------------------------------------------------------- load_into

StreamStats load_into(torch::nn::Module& module, const StateSource& source, const Mapper& mapper,
                      const LoadOptions& options) {
  const std::string who = "d9d::state::load_into";
  std::map<std::string, at::Tensor> targets;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    targets.emplace(item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    targets.emplace(item.key(), item.value());
  }
  const std::vector<std::string> outputs = mapper.outputs();
  std::vector<std::string> extra;
  for (const auto& key : outputs) {
    if (!targets.contains(key)) {
      extra.push_back(key);
    }
  }
  if (!extra.empty()) {
    throw std::invalid_argument(
        who + ": extra: the mapper produces " + std::to_string(extra.size()) +
        " key(s) the module has no parameter or buffer for: " + util::quoted_keys(extra) +
        " (the module has " + std::to_string(targets.size()) + ")");
  }
  if (!options.allow_missing) {
    std::vector<std::string> missing;
    for (const auto& [key, tensor] : targets) {
      if (!std::binary_search(outputs.begin(), outputs.end(), key)) {
        missing.push_back(key);
      }
    }
    if (!missing.empty()) {
      throw std::invalid_argument(who + ": missing: " + std::to_string(missing.size()) +
                                  " parameter(s)/buffer(s) of the module are produced by no " +
                                  "group: " + util::quoted_keys(missing) +
                                  ". Fix: map them, or set allow_missing to keep their values");
    }
  }
  validate(mapper, source.keys(), {.allow_unused_inputs = options.allow_unused_inputs});
  const auto shape_error = [&](const std::string& name, at::IntArrayRef got, at::IntArrayRef want) {
    return std::invalid_argument(who + ": " + util::quoted_key(name) +
                                 ": the mapped tensor has shape " + util::shape_string(got) +
                                 ", the module's has " + util::shape_string(want));
  };
  for (const auto& [name, spec] : infer_shapes(source, mapper)) {
    const at::Tensor& target = targets.at(name);
    if (target.sizes() != at::IntArrayRef(spec.shape)) {
      throw shape_error(name, spec.shape, target.sizes());
    }
  }
  const c10::NoGradGuard no_grad;
  return stream_state(source, mapper,
                      [&](const std::string& name, const at::Tensor& tensor) {
                        at::Tensor& target = targets.at(name);
                        if (target.sizes() != tensor.sizes()) {
                          throw shape_error(name, tensor.sizes(), target.sizes());
                        }
                        target.copy_(tensor);
                      },
                      {.allow_unused_inputs = options.allow_unused_inputs, .check_shapes = false});
}

}  // namespace d9d::state
