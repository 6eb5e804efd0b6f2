// d9d/parallel/load.cpp — a checkpoint streamed into a parallelised model, each rank its parts.
#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <d9d/parallel/load.hpp>
#include <d9d/state/mapper_distributed.hpp>
#include <d9d/util/quote.hpp>

namespace d9d::parallel {
namespace {

constexpr const char* kWho = "d9d::parallel::load_state";

// Where an output goes: a record's local part, or a parameter without a record (whole).
struct Target {
  at::Tensor tensor;
  const ParameterRecord* record = nullptr;
  /// Further holders of the same name on this rank (a parameter tied across this rank's pipeline
  /// stages): the same part of the same tensor, copied there too.
  std::vector<at::Tensor> copies;
};

}  // namespace

state::StreamStats load_state(ParallelModel& model, const state::StateSource& source,
                              const LoadStateOptions& options) {
  const std::string who = kWho;
  std::map<std::string, Target> targets;
  for (const auto& root : model.modules()) {
    for (const auto& item : root->named_parameters(/*recurse=*/true)) {
      if (std::find(options.keep.begin(), options.keep.end(), item.key()) != options.keep.end()) {
        continue;
      }
      // A trained parameter's record, or the layout a strategy kept of a frozen one it split
      // (LoRA's base under tensor parallelism); null for a parameter whole on every rank.
      const auto* record = model.layout(item.key());
      const auto found = targets.find(item.key());
      if (found != targets.end()) {
        // A second holder of a tied parameter (ParameterRecord::tied_copy): the records of one
        // name come in module order, like the modules' parameters.
        const ParameterRecord* copy = nullptr;
        const std::size_t occurrence = found->second.copies.size() + 1;  // 0 is the first holder
        std::size_t seen = 0;
        for (const auto& candidate : model.parameters()) {
          if (candidate.name != item.key()) {
            continue;
          }
          if (seen == occurrence) {
            copy = &candidate;
            break;
          }
          ++seen;
        }
        found->second.copies.push_back(copy != nullptr ? copy->local : item.value());
        continue;
      }
      targets.emplace(item.key(), Target{.tensor = record != nullptr ? record->local : item.value(),
                                         .record = record,
                                         .copies = {}});
    }
  }
  const bool elsewhere_ok = options.stages_elsewhere;
  const bool default_mapper = options.mapper.groups().empty();
  std::vector<std::string> names;
  names.reserve(targets.size());
  for (const auto& [name, target] : targets) {
    names.push_back(name);
  }
  const state::Mapper base = default_mapper ? state::identity(names) : options.mapper;

  // The second stage: each output to its target's part on this rank.
  std::vector<state::Mapper> parts;
  std::vector<std::string> extra;
  std::vector<std::string> elsewhere;  // other pipeline stages' parameters
  for (const auto& key : base.outputs()) {
    const auto found = targets.find(key);
    if (found == targets.end()) {
      (elsewhere_ok ? elsewhere : extra).push_back(key);
      continue;
    }
    const auto* record = found->second.record;
    if (record != nullptr && !record->sharded_dims().empty()) {
      parts.push_back(state::distribute({key}, {.mesh = model.mesh(),
                                                .domain = record->domain,
                                                .dims = record->dims,
                                                .placements = record->placements}));
    } else {
      parts.push_back(state::identity({key}));
    }
  }
  if (!extra.empty()) {
    throw std::invalid_argument(
        who + ": extra: the mapper produces " + std::to_string(extra.size()) +
        " key(s) the model has no parameter for: " + util::quoted_keys(extra) + " (the model has " +
        std::to_string(targets.size()) + ")");
  }
  const auto outputs = base.outputs();
  std::vector<std::string> missing;
  for (const auto& [name, target] : targets) {
    if (!std::binary_search(outputs.begin(), outputs.end(), name)) {
      missing.push_back(name);
    }
  }
  if (!missing.empty()) {
    throw std::invalid_argument(
        who + ": missing: " + std::to_string(missing.size()) +
        " parameter(s) of the model are produced by no group: " + util::quoted_keys(missing) +
        ". Fix: map them from the checkpoint's keys");
  }
  if (!elsewhere.empty()) {
    parts.push_back(state::drop(elsewhere));
  }
  std::vector<state::Mapper> whole{state::sequential({base, state::parallel(parts)})};
  // Ignored keys the source holds and nothing reads: read by nobody, allowed to be there.
  const auto inputs = base.inputs();
  std::vector<std::string> ignored;
  for (const auto& key : options.ignore) {
    if (std::binary_search(source.keys().begin(), source.keys().end(), key) &&
        !std::binary_search(inputs.begin(), inputs.end(), key) &&
        std::find(ignored.begin(), ignored.end(), key) == ignored.end()) {
      ignored.push_back(key);
    }
  }
  if (!ignored.empty()) {
    whole.push_back(state::drop(ignored));
  }
  const state::Mapper mapper = state::parallel(whole);
  const bool allow_unused = options.allow_unused_inputs || (elsewhere_ok && default_mapper);
  state::validate(mapper, source.keys(), {.allow_unused_inputs = allow_unused});

  const auto shape_error = [&](const std::string& name, at::IntArrayRef got, const Target& target) {
    std::string message =
        who + ": " + util::quoted_key(name) + ": this rank's part of the mapped tensor has shape " +
        util::shape_string(got) + ", the model's has " + util::shape_string(target.tensor.sizes());
    if (target.record == nullptr) {
      message +=
          " (a parameter without a record or a kept layout loads whole: a strategy that splits it "
          "does not say how)";
    }
    return std::invalid_argument(message);
  };
  for (const auto& [name, spec] : state::infer_shapes(source, mapper)) {
    const Target& target = targets.at(name);
    if (target.tensor.sizes() != at::IntArrayRef(spec.shape)) {
      throw shape_error(name, spec.shape, target);
    }
  }
  const at::NoGradGuard no_grad;
  return state::stream_state(source, mapper,
                             [&](const std::string& name, const at::Tensor& tensor) {
                               Target& target = targets.at(name);
                               if (target.tensor.sizes() != tensor.sizes()) {
                                 throw shape_error(name, tensor.sizes(), target);
                               }
                               target.tensor.copy_(tensor);
                               for (auto& copy : target.copies) {
                                 copy.copy_(tensor);
                               }
                             },
                             {.allow_unused_inputs = allow_unused, .check_shapes = false});
}

}  // namespace d9d::parallel
