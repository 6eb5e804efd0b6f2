// d9d/state/mapper.cpp — the state mapper graph: groups, leaves, composition, validation.
#include <algorithm>
#include <functional>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <c10/util/Exception.h>

#include <d9d/state/mapper.hpp>
#include <d9d/util/quote.hpp>

namespace d9d::state {

namespace detail {

struct MapperData {
  std::vector<MapperGroup> groups;
  std::vector<GroupFunction> functions;
  std::vector<bool> runs_on_meta;      // per group: its function works on meta tensors
  std::vector<std::string> elsewhere;  // sorted, each once
};

namespace {

// One group with its function, while a mapper is being built. `source` says where it came from
// (the part or stage), for messages.
struct Part {
  MapperGroup group;
  GroupFunction function;
  std::size_t source = 0;
  bool runs_on_meta = false;
};

}  // namespace

struct MapperAccess {
  static Mapper make(std::vector<Part> parts, std::vector<std::string> elsewhere) {
    std::sort(parts.begin(), parts.end(), [](const Part& a, const Part& b) {
      static const std::string none;
      const auto& ao = a.group.outputs.empty() ? none : a.group.outputs.front();
      const auto& bo = b.group.outputs.empty() ? none : b.group.outputs.front();
      if (ao != bo) {
        return ao < bo;
      }
      const auto& ai = a.group.inputs.empty() ? none : a.group.inputs.front();
      const auto& bi = b.group.inputs.empty() ? none : b.group.inputs.front();
      return ai < bi;
    });
    auto data = std::make_shared<MapperData>();
    data->groups.reserve(parts.size());
    data->functions.reserve(parts.size());
    std::set<std::string> used;
    for (auto& part : parts) {
      used.insert(part.group.inputs.begin(), part.group.inputs.end());
      data->groups.push_back(std::move(part.group));
      data->functions.push_back(std::move(part.function));
      data->runs_on_meta.push_back(part.runs_on_meta);
    }
    std::sort(elsewhere.begin(), elsewhere.end());
    elsewhere.erase(std::unique(elsewhere.begin(), elsewhere.end()), elsewhere.end());
    std::erase_if(elsewhere, [&](const std::string& key) { return used.contains(key); });
    data->elsewhere = std::move(elsewhere);
    return Mapper(std::move(data));
  }

  static std::vector<Part> parts(const Mapper& mapper, std::size_t source) {
    std::vector<Part> parts;
    parts.reserve(mapper.data_->groups.size());
    for (std::size_t i = 0; i < mapper.data_->groups.size(); ++i) {
      parts.push_back({.group = mapper.data_->groups[i],
                       .function = mapper.data_->functions[i],
                       .source = source,
                       .runs_on_meta = mapper.data_->runs_on_meta[i]});
    }
    return parts;
  }

  static const MapperData& data(const Mapper& mapper) { return *mapper.data_; }
};

}  // namespace detail

namespace {

using detail::MapperAccess;
using detail::Part;

constexpr std::size_t kMaxOpChars = 160;

// Ops of merged groups, joined and cut so that a message stays readable.
std::string join_ops(const std::vector<const Part*>& parts, std::string_view separator) {
  std::vector<std::string> ops;
  for (const Part* part : parts) {
    if (std::find(ops.begin(), ops.end(), part->group.op) == ops.end()) {
      ops.push_back(part->group.op);
    }
  }
  std::string out;
  for (const auto& op : ops) {
    out += (out.empty() ? "" : std::string(separator)) + op;
  }
  if (out.size() > kMaxOpChars) {
    out = out.substr(0, kMaxOpChars) + "...";
  }
  return ops.size() > 1 ? "(" + out + ")" : out;
}

std::vector<std::string> sorted_unique(std::vector<std::string> keys) {
  std::sort(keys.begin(), keys.end());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  return keys;
}

// Union-find over group numbers.
class DisjointSets {
 public:
  explicit DisjointSets(std::size_t n) : parent_(n) {
    std::iota(parent_.begin(), parent_.end(), std::size_t{0});
  }
  std::size_t find(std::size_t x) {
    while (parent_[x] != x) {
      parent_[x] = parent_[parent_[x]];
      x = parent_[x];
    }
    return x;
  }
  void unite(std::size_t a, std::size_t b) {
    a = find(a);
    b = find(b);
    if (a != b) {
      parent_[std::max(a, b)] = std::min(a, b);
    }
  }

 private:
  std::vector<std::size_t> parent_;
};

// Runs each part on its inputs taken from `available`; the union of their outputs.
TensorMap run_parts(const std::vector<Part>& parts, const TensorMap& available) {
  TensorMap out;
  for (const auto& part : parts) {
    TensorMap inputs;
    for (const auto& key : part.group.inputs) {
      inputs.emplace(key, available.at(key));
    }
    TensorMap produced = part.function(std::move(inputs));
    out.merge(produced);
  }
  return out;
}

// The union of `parts` (parallel semantics): an output produced twice is an error; groups sharing
// an input merge into one group. `who` and `source_name` word the messages.
Mapper combine(std::vector<Part> parts, std::vector<std::string> elsewhere, const std::string& who,
               const std::function<std::string(const Part&)>& source_name) {
  std::map<std::string, std::size_t> producer;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    for (const auto& key : parts[i].group.outputs) {
      const auto [it, fresh] = producer.emplace(key, i);
      if (!fresh) {
        const Part& first = parts[it->second];
        throw std::invalid_argument(who + ": output " + util::quoted_key(key) +
                                    " is produced twice: by " + source_name(first) + " and by " +
                                    source_name(parts[i]) +
                                    ". Fix: each output key must come from one group");
      }
    }
  }
  DisjointSets sets(parts.size());
  std::map<std::string, std::size_t> reader;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    for (const auto& key : parts[i].group.inputs) {
      const auto [it, fresh] = reader.emplace(key, i);
      if (!fresh) {
        sets.unite(it->second, i);
      }
    }
  }
  std::map<std::size_t, std::vector<std::size_t>> components;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    components[sets.find(i)].push_back(i);
  }
  std::vector<Part> merged;
  merged.reserve(components.size());
  for (auto& [root, members] : components) {
    if (members.size() == 1) {
      merged.push_back(std::move(parts[root]));
      continue;
    }
    std::vector<const Part*> views;
    std::vector<std::string> inputs;
    std::vector<std::string> outputs;
    auto sub = std::make_shared<std::vector<Part>>();
    for (const auto i : members) {
      views.push_back(&parts[i]);
      inputs.insert(inputs.end(), parts[i].group.inputs.begin(), parts[i].group.inputs.end());
      outputs.insert(outputs.end(), parts[i].group.outputs.begin(), parts[i].group.outputs.end());
    }
    std::string op = join_ops(views, " + ");
    const bool meta = std::all_of(views.begin(), views.end(),
                                  [](const Part* part) { return part->runs_on_meta; });
    for (const auto i : members) {
      sub->push_back(std::move(parts[i]));
    }
    merged.push_back({.group = {.inputs = sorted_unique(std::move(inputs)),
                                .outputs = sorted_unique(std::move(outputs)),
                                .op = std::move(op)},
                      .function = [sub](const TensorMap& in) { return run_parts(*sub, in); },
                      .source = 0,
                      .runs_on_meta = meta});
  }
  return MapperAccess::make(std::move(merged), std::move(elsewhere));
}

// Checks a leaf's key list: no key twice.
void check_unique(const std::vector<std::string>& keys, const std::string& who,
                  std::string_view what) {
  std::set<std::string_view> seen;
  for (const auto& key : keys) {
    if (!seen.insert(key).second) {
      throw std::invalid_argument(who + ": " + std::string(what) + " " + util::quoted_key(key) +
                                  " is given twice");
    }
  }
}

// A one-group part whose function checks what comes back and turns LibTorch errors into
// std::invalid_argument naming the operation and the inputs.
Part leaf_part(std::string op, std::vector<std::string> inputs, std::vector<std::string> outputs,
               GroupFunction function, bool runs_on_meta = true) {
  const std::string who = "d9d::state::" + op;
  if (!function) {
    throw std::invalid_argument(who + ": the group function is empty");
  }
  if (inputs.empty() && outputs.empty()) {
    throw std::invalid_argument(who + ": a group needs at least one input or output key");
  }
  check_unique(inputs, who, "input");
  check_unique(outputs, who, "output");
  std::sort(inputs.begin(), inputs.end());
  std::sort(outputs.begin(), outputs.end());
  GroupFunction checked = [who, outputs, function = std::move(function)](TensorMap in) {
    std::string given;
    for (const auto& [key, tensor] : in) {
      given += (given.empty() ? "" : ", ") + util::quoted_key(key) + " " +
               (tensor.defined() ? util::shape_string(tensor.sizes()) : "(undefined)");
    }
    TensorMap out;
    try {
      out = function(std::move(in));
    } catch (const c10::Error& e) {
      std::string message = e.what_without_backtrace();
      message = message.substr(0, message.find('\n'));
      throw std::invalid_argument(who + ": fails on " + given + ": " + message);
    }
    std::vector<std::string> got;
    for (const auto& [key, tensor] : out) {
      if (!tensor.defined()) {
        throw std::invalid_argument(who + ": returned an undefined tensor for " +
                                    util::quoted_key(key));
      }
      got.push_back(key);
    }
    if (got != outputs) {
      throw std::invalid_argument(who + ": returned " + util::quoted_keys(got) + " but declares " +
                                  util::quoted_keys(outputs) +
                                  ". Fix: return exactly the output keys");
    }
    return out;
  };
  return {
      .group = {.inputs = std::move(inputs), .outputs = std::move(outputs), .op = std::move(op)},
      .function = std::move(checked),
      .source = 0,
      .runs_on_meta = runs_on_meta};
}

// Leaves over many keys: the union of one-key leaves (outputs produced twice are an error).
Mapper many(const std::string& name, std::vector<Part> parts) {
  return combine(std::move(parts), {}, "d9d::state::" + name,
                 [](const Part& part) { return part.group.op; });
}

// One group per key: `key` -> `key` through `fn`.
Mapper per_key(const std::string& name, const std::string& op, const std::vector<std::string>& keys,
               const std::function<at::Tensor(const at::Tensor&)>& fn) {
  std::vector<Part> parts;
  parts.reserve(keys.size());
  for (const auto& key : keys) {
    parts.push_back(leaf_part(op, {key}, {key}, [key, fn](TensorMap in) {
      TensorMap out;
      out.emplace(key, fn(in.at(key)));
      return out;
    }));
  }
  return many(name, std::move(parts));
}

// Stage `a` (number `a_number`, 1-based) followed by stage `b`.
Mapper chain(const Mapper& a, const Mapper& b, std::size_t a_number) {
  const std::string who = "d9d::state::sequential";
  const std::string a_name = "stage " + std::to_string(a_number);
  const std::string b_name = "stage " + std::to_string(a_number + 1);
  std::vector<Part> a_parts = MapperAccess::parts(a, 0);
  std::vector<Part> b_parts = MapperAccess::parts(b, 1);
  const auto& b_elsewhere = MapperAccess::data(b).elsewhere;

  std::map<std::string, std::size_t> producer;
  for (std::size_t i = 0; i < a_parts.size(); ++i) {
    for (const auto& key : a_parts[i].group.outputs) {
      producer.emplace(key, i);
    }
  }
  const std::size_t na = a_parts.size();
  DisjointSets sets(na + b_parts.size());
  std::vector<std::string> missing;
  std::string first_missing_op;
  std::set<std::string> consumed;
  for (std::size_t j = 0; j < b_parts.size(); ++j) {
    for (const auto& key : b_parts[j].group.inputs) {
      const auto it = producer.find(key);
      if (it == producer.end()) {
        if (missing.empty()) {
          first_missing_op = b_parts[j].group.op;
        }
        missing.push_back(key);
        continue;
      }
      consumed.insert(key);
      sets.unite(it->second, na + j);
    }
  }
  if (!missing.empty()) {
    throw std::invalid_argument(
        who + ": " + b_name + " needs " + util::quoted_keys(missing) + " (first needed by " +
        first_missing_op + "), which " + a_name + " does not produce (it produces " +
        std::to_string(producer.size()) + " keys: " + util::quoted_keys(a.outputs()) + ")");
  }
  std::vector<std::string> unused;
  std::string first_unused_op;
  for (const auto& [key, i] : producer) {
    if (!consumed.contains(key) &&
        !std::binary_search(b_elsewhere.begin(), b_elsewhere.end(), key)) {
      if (unused.empty()) {
        first_unused_op = a_parts[i].group.op;
      }
      unused.push_back(key);
    }
  }
  if (!unused.empty()) {
    throw std::invalid_argument(who + ": " + a_name + " produces " + util::quoted_keys(unused) +
                                " (first from " + first_unused_op + "), which " + b_name +
                                " does not use. Fix: add identity or drop for them to " + b_name);
  }

  std::map<std::size_t, std::pair<std::vector<std::size_t>, std::vector<std::size_t>>> components;
  for (std::size_t i = 0; i < na + b_parts.size(); ++i) {
    auto& [as, bs] = components[sets.find(i)];
    (i < na ? as : bs).push_back(i < na ? i : i - na);
  }
  std::vector<Part> merged;
  std::vector<std::string> elsewhere = MapperAccess::data(a).elsewhere;
  for (auto& [root, members] : components) {
    auto& [as, bs] = members;
    if (bs.empty()) {
      if (as.size() == 1 && a_parts[as[0]].group.outputs.empty()) {
        merged.push_back(std::move(a_parts[as[0]]));  // a drop: nothing to feed on
      } else {
        // Every output goes to other ranks' groups of stage b: this rank reads none of it.
        for (const auto i : as) {
          const auto& inputs = a_parts[i].group.inputs;
          elsewhere.insert(elsewhere.end(), inputs.begin(), inputs.end());
        }
      }
      continue;
    }
    std::vector<const Part*> a_views;
    std::vector<const Part*> b_views;
    std::vector<std::string> inputs;
    std::vector<std::string> outputs;
    auto first = std::make_shared<std::vector<Part>>();
    auto second = std::make_shared<std::vector<Part>>();
    for (const auto i : as) {
      a_views.push_back(&a_parts[i]);
      inputs.insert(inputs.end(), a_parts[i].group.inputs.begin(), a_parts[i].group.inputs.end());
    }
    for (const auto j : bs) {
      b_views.push_back(&b_parts[j]);
      outputs.insert(outputs.end(), b_parts[j].group.outputs.begin(),
                     b_parts[j].group.outputs.end());
    }
    std::string op = as.empty() ? join_ops(b_views, " + ")
                                : join_ops(a_views, " + ") + " -> " + join_ops(b_views, " + ");
    const auto on_meta = [](const Part* part) { return part->runs_on_meta; };
    const bool meta = std::all_of(a_views.begin(), a_views.end(), on_meta) &&
                      std::all_of(b_views.begin(), b_views.end(), on_meta);
    for (const auto i : as) {
      first->push_back(std::move(a_parts[i]));
    }
    for (const auto j : bs) {
      second->push_back(std::move(b_parts[j]));
    }
    merged.push_back({.group = {.inputs = sorted_unique(std::move(inputs)),
                                .outputs = sorted_unique(std::move(outputs)),
                                .op = std::move(op)},
                      .function =
                          [first, second](TensorMap in) {
                            TensorMap middle = run_parts(*first, in);
                            in.clear();  // the stage-1 inputs are no longer needed
                            return run_parts(*second, middle);
                          },
                      .source = 0,
                      .runs_on_meta = meta});
  }
  return MapperAccess::make(std::move(merged), std::move(elsewhere));
}

std::string prefixed(std::string_view prefix, const std::string& key) {
  return std::string(prefix) + key;
}

}  // namespace

// ------------------------------------------------------------------------------------- Mapper

Mapper::Mapper() : data_(std::make_shared<detail::MapperData>()) {}

Mapper::Mapper(std::shared_ptr<const detail::MapperData> data) : data_(std::move(data)) {}

const std::vector<MapperGroup>& Mapper::groups() const { return data_->groups; }

std::vector<std::string> Mapper::inputs() const {
  std::vector<std::string> keys;
  for (const auto& group : data_->groups) {
    keys.insert(keys.end(), group.inputs.begin(), group.inputs.end());
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

std::vector<std::string> Mapper::outputs() const {
  std::vector<std::string> keys;
  for (const auto& group : data_->groups) {
    keys.insert(keys.end(), group.outputs.begin(), group.outputs.end());
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

const std::vector<std::string>& Mapper::elsewhere() const { return data_->elsewhere; }

bool Mapper::runs_on_meta(std::size_t group) const {
  if (group >= data_->groups.size()) {
    throw std::invalid_argument("d9d::state::Mapper::runs_on_meta: group " + std::to_string(group) +
                                " of a mapper with " + std::to_string(data_->groups.size()) +
                                " groups");
  }
  return data_->runs_on_meta[group];
}

TensorMap Mapper::apply(std::size_t group, TensorMap inputs) const {
  const std::string who = "d9d::state::Mapper::apply";
  if (group >= data_->groups.size()) {
    throw std::invalid_argument(who + ": group " + std::to_string(group) + " of a mapper with " +
                                std::to_string(data_->groups.size()) + " groups");
  }
  const MapperGroup& g = data_->groups[group];
  std::vector<std::string> missing;
  for (const auto& key : g.inputs) {
    if (!inputs.contains(key)) {
      missing.push_back(key);
    }
  }
  if (!missing.empty()) {
    throw std::invalid_argument(who + ": group " + g.op + " needs " + util::quoted_keys(missing) +
                                ", which the inputs given lack");
  }
  if (inputs.size() != g.inputs.size()) {
    std::vector<std::string> extra;
    for (const auto& [key, tensor] : inputs) {
      if (!std::binary_search(g.inputs.begin(), g.inputs.end(), key)) {
        extra.push_back(key);
      }
    }
    throw std::invalid_argument(who + ": group " + g.op + " does not read " +
                                util::quoted_keys(extra) +
                                ". Fix: pass exactly the group's inputs");
  }
  for (const auto& [key, tensor] : inputs) {
    if (!tensor.defined()) {
      throw std::invalid_argument(who + ": group " + g.op + ": input " + util::quoted_key(key) +
                                  " is an undefined tensor");
    }
  }
  return data_->functions[group](std::move(inputs));
}

TensorMap Mapper::apply(const MapperGroup& group, TensorMap inputs) const {
  const auto& all = data_->groups;
  const std::less<const MapperGroup*> before;  // a total order, also for unrelated pointers
  if (!all.empty() && !before(&group, all.data()) && before(&group, all.data() + all.size())) {
    return apply(static_cast<std::size_t>(&group - all.data()), std::move(inputs));
  }
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (all[i].inputs == group.inputs && all[i].outputs == group.outputs) {
      return apply(i, std::move(inputs));
    }
  }
  throw std::invalid_argument("d9d::state::Mapper::apply: the group " + group.op + " (inputs " +
                              util::quoted_keys(group.inputs) + ") is not a group of this mapper");
}

TensorMap Mapper::apply_all(const TensorMap& inputs) const {
  TensorMap out;
  for (std::size_t i = 0; i < data_->groups.size(); ++i) {
    const MapperGroup& g = data_->groups[i];
    TensorMap sub;
    for (const auto& key : g.inputs) {
      const auto it = inputs.find(key);
      if (it == inputs.end()) {
        throw std::invalid_argument("d9d::state::Mapper::apply_all: no input " +
                                    util::quoted_key(key) + " (needed by " + g.op + ")");
      }
      sub.emplace(key, it->second);
    }
    TensorMap produced = apply(i, std::move(sub));
    out.merge(produced);
  }
  return out;
}

// ------------------------------------------------------------------------------------- leaves

Mapper leaf(std::string op, std::vector<std::string> inputs, std::vector<std::string> outputs,
            GroupFunction function, bool runs_on_meta) {
  std::vector<Part> parts;
  parts.push_back(leaf_part(std::move(op), std::move(inputs), std::move(outputs),
                            std::move(function), runs_on_meta));
  return MapperAccess::make(std::move(parts), {});
}

Mapper identity(const std::vector<std::string>& keys) {
  return per_key("identity", "identity", keys, [](const at::Tensor& t) { return t; });
}

Mapper rename(const std::string& from, const std::string& to) { return rename({{from, to}}); }

Mapper rename(const std::vector<std::pair<std::string, std::string>>& from_to) {
  std::vector<Part> parts;
  parts.reserve(from_to.size());
  for (const auto& [from, to] : from_to) {
    parts.push_back(
        leaf_part("rename(" + util::quoted_key(from) + " -> " + util::quoted_key(to) + ")", {from},
                  {to}, [from = from, to = to](TensorMap in) {
                    TensorMap out;
                    out.emplace(to, in.at(from));
                    return out;
                  }));
  }
  return many("rename", std::move(parts));
}

Mapper rename_prefix(const std::vector<std::string>& keys, std::string_view from_prefix,
                     std::string_view to_prefix) {
  std::vector<std::pair<std::string, std::string>> from_to;
  from_to.reserve(keys.size());
  for (const auto& key : keys) {
    if (!std::string_view(key).starts_with(from_prefix)) {
      throw std::invalid_argument("d9d::state::rename_prefix: key " + util::quoted_key(key) +
                                  " does not start with " + util::quoted_key(from_prefix));
    }
    from_to.emplace_back(key, std::string(to_prefix) + key.substr(from_prefix.size()));
  }
  return rename(from_to);
}

Mapper select_child_modules(const std::vector<std::string>& child_keys, std::string_view parent) {
  if (parent.empty()) {
    return identity(child_keys);
  }
  std::vector<std::pair<std::string, std::string>> from_to;
  from_to.reserve(child_keys.size());
  for (const auto& key : child_keys) {
    from_to.emplace_back(std::string(parent) + "." + key, key);
  }
  return rename(from_to);
}

Mapper drop(const std::vector<std::string>& keys) {
  std::vector<Part> parts;
  parts.reserve(keys.size());
  for (const auto& key : keys) {
    parts.push_back(leaf_part("drop", {key}, {}, [](const TensorMap&) { return TensorMap{}; }));
  }
  return many("drop", std::move(parts));
}

Mapper transpose(const std::vector<std::string>& keys, int64_t dim0, int64_t dim1) {
  return per_key("transpose",
                 "transpose(" + std::to_string(dim0) + ", " + std::to_string(dim1) + ")", keys,
                 [dim0, dim1](const at::Tensor& t) { return t.transpose(dim0, dim1); });
}

Mapper squeeze(const std::vector<std::string>& keys, int64_t dim) {
  const std::string op = "squeeze(dim " + std::to_string(dim) + ")";
  return per_key("squeeze", op, keys, [op, dim](const at::Tensor& t) {
    if (t.size(dim) != 1) {
      throw std::invalid_argument(
          "d9d::state::" + op + ": a tensor of shape " + util::shape_string(t.sizes()) +
          " has size " + std::to_string(t.size(dim)) + ", not 1, at dim " + std::to_string(dim));
    }
    return t.squeeze(dim);
  });
}

Mapper unsqueeze(const std::vector<std::string>& keys, int64_t dim) {
  return per_key("unsqueeze", "unsqueeze(dim " + std::to_string(dim) + ")", keys,
                 [dim](const at::Tensor& t) { return t.unsqueeze(dim); });
}

namespace {

// stack / concatenate: `inputs` in order joined by `join` along `dim` into `output`.
Mapper join_inputs(const char* name, at::Tensor (*join)(at::TensorList, int64_t),
                   const std::vector<std::string>& inputs, const std::string& output, int64_t dim) {
  if (inputs.empty()) {
    throw std::invalid_argument("d9d::state::" + std::string(name) + ": no inputs for " +
                                util::quoted_key(output));
  }
  return leaf(
      std::string(name) + "(dim " + std::to_string(dim) + ")", inputs, {output},
      [inputs, output, dim, join](TensorMap in) {
        std::vector<at::Tensor> tensors;
        tensors.reserve(inputs.size());
        for (const auto& key : inputs) {
          tensors.push_back(in.at(key));
        }
        in.clear();
        TensorMap out;
        out.emplace(output, join(tensors, dim));
        return out;
      },
      /*runs_on_meta=*/true);
}

}  // namespace

Mapper stack(const std::vector<std::string>& inputs, const std::string& output, int64_t dim) {
  return join_inputs(
      "stack", [](at::TensorList t, int64_t d) { return at::stack(t, d); }, inputs, output, dim);
}

Mapper unstack(const std::string& input, const std::vector<std::string>& outputs, int64_t dim) {
  const std::string op = "unstack(dim " + std::to_string(dim) + ")";
  if (outputs.empty()) {
    throw std::invalid_argument("d9d::state::unstack: no outputs for " + util::quoted_key(input));
  }
  return leaf(
      op, {input}, outputs,
      [op, input, outputs, dim](TensorMap in) {
        const at::Tensor t = in.at(input);
        if (t.size(dim) != static_cast<int64_t>(outputs.size())) {
          throw std::invalid_argument("d9d::state::" + op + ": " + util::quoted_key(input) + " " +
                                      util::shape_string(t.sizes()) + " has " +
                                      std::to_string(t.size(dim)) + " slices at dim " +
                                      std::to_string(dim) + ", but " +
                                      std::to_string(outputs.size()) + " outputs are declared");
        }
        TensorMap out;
        for (std::size_t i = 0; i < outputs.size(); ++i) {
          out.emplace(outputs[i], t.select(dim, static_cast<int64_t>(i)));
        }
        return out;
      },
      /*runs_on_meta=*/true);
}

Mapper concatenate(const std::vector<std::string>& inputs, const std::string& output, int64_t dim) {
  return join_inputs(
      "concatenate", [](at::TensorList t, int64_t d) { return at::cat(t, d); }, inputs, output,
      dim);
}

Mapper chunk(const std::string& input, const std::vector<std::string>& outputs, int64_t dim) {
  if (outputs.empty()) {
    throw std::invalid_argument("d9d::state::chunk: no outputs for " + util::quoted_key(input));
  }
  return leaf(
      "chunk(dim " + std::to_string(dim) + ")", {input}, outputs,
      [input, outputs, dim](TensorMap in) {
        const at::Tensor t = in.at(input);
        const int64_t size = t.size(dim);
        const auto k = static_cast<int64_t>(outputs.size());
        const int64_t part = (size + k - 1) / k;
        TensorMap out;
        for (int64_t i = 0; i < k; ++i) {
          const int64_t offset = std::min(size, part * i);
          out.emplace(outputs[static_cast<std::size_t>(i)],
                      t.narrow(dim, offset, std::min(part, size - offset)));
        }
        return out;
      },
      /*runs_on_meta=*/true);
}

// -------------------------------------------------------------------------------- composition

Mapper parallel(const std::vector<Mapper>& parts) {
  std::vector<Part> all;
  std::vector<std::string> elsewhere;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    auto some = MapperAccess::parts(parts[i], i);
    std::move(some.begin(), some.end(), std::back_inserter(all));
    const auto& other = parts[i].elsewhere();
    elsewhere.insert(elsewhere.end(), other.begin(), other.end());
  }
  return combine(std::move(all), std::move(elsewhere), "d9d::state::parallel",
                 [](const Part& part) {
                   return "parts[" + std::to_string(part.source) + "] (" + part.group.op + ")";
                 });
}

Mapper sequential(const std::vector<Mapper>& stages) {
  if (stages.empty()) {
    return {};
  }
  Mapper result = stages.front();
  for (std::size_t i = 1; i < stages.size(); ++i) {
    result = chain(result, stages[i], i);
  }
  return result;
}

Mapper scope(std::string_view prefix, const Mapper& mapper) {
  if (prefix.empty()) {
    return mapper;
  }
  const std::string dotted = std::string(prefix) + ".";
  std::vector<Part> parts = MapperAccess::parts(mapper, 0);
  for (auto& part : parts) {
    for (auto& key : part.group.inputs) {
      key = prefixed(dotted, key);
    }
    for (auto& key : part.group.outputs) {
      key = prefixed(dotted, key);
    }
    part.function = [dotted, inner = std::move(part.function)](TensorMap in) {
      TensorMap local;
      for (auto& [key, tensor] : in) {
        local.emplace(key.substr(dotted.size()), std::move(tensor));
      }
      in.clear();
      TensorMap out;
      for (auto& [key, tensor] : inner(std::move(local))) {
        out.emplace(prefixed(dotted, key), std::move(tensor));
      }
      return out;
    };
  }
  std::vector<std::string> elsewhere;
  for (const auto& key : mapper.elsewhere()) {
    elsewhere.push_back(prefixed(dotted, key));
  }
  return MapperAccess::make(std::move(parts), std::move(elsewhere));
}

Mapper shard(const Mapper& mapper, int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world) {
    throw std::invalid_argument("d9d::state::shard: rank " + std::to_string(rank) + " of world " +
                                std::to_string(world) + ". Fix: need 0 <= rank < world");
  }
  std::vector<Part> parts = MapperAccess::parts(mapper, 0);
  std::vector<Part> mine;
  std::vector<std::string> elsewhere = mapper.elsewhere();
  for (std::size_t i = 0; i < parts.size(); ++i) {
    if (static_cast<int>(i % static_cast<std::size_t>(world)) == rank) {
      mine.push_back(std::move(parts[i]));
    } else {
      const auto& inputs = parts[i].group.inputs;
      elsewhere.insert(elsewhere.end(), inputs.begin(), inputs.end());
    }
  }
  return MapperAccess::make(std::move(mine), std::move(elsewhere));
}

// --------------------------------------------------------------------------------- validation

void validate(const Mapper& mapper, const std::vector<std::string>& available_inputs,
              const ValidateOptions& options) {
  const std::string who = "d9d::state::validate";
  const std::set<std::string_view> available(available_inputs.begin(), available_inputs.end());
  std::vector<std::string> missing;
  std::vector<std::string> needed_by;
  std::set<std::string_view> read;
  for (const auto& group : mapper.groups()) {
    for (const auto& key : group.inputs) {
      read.insert(key);
      if (!available.contains(key)) {
        missing.push_back(key);
        needed_by.push_back(group.op);
      }
    }
  }
  if (!missing.empty()) {
    throw std::invalid_argument(
        who + ": missing input: " + std::to_string(missing.size()) + " key(s) the mapper reads " +
        "are not in the source: " + util::quoted_keys(missing) + " (the first needed by " +
        needed_by.front() + "). Fix: check the checkpoint's names or map them from keys it has");
  }
  if (options.allow_unused_inputs) {
    return;
  }
  const auto& elsewhere = mapper.elsewhere();
  std::vector<std::string> unused;
  for (const auto& key : available) {
    if (!read.contains(key) && !std::binary_search(elsewhere.begin(), elsewhere.end(), key)) {
      unused.emplace_back(key);
    }
  }
  if (!unused.empty()) {
    throw std::invalid_argument(
        who + ": unused input: " + std::to_string(unused.size()) + " key(s) of the source are " +
        "read by no group: " + util::quoted_keys(unused) +
        ". Fix: map them (identity, rename, ...), drop them, or set allow_unused_inputs");
  }
}

}  // namespace d9d::state
