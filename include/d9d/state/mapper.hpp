// d9d/state/mapper.hpp — the state mapper graph: which stored tensors become which model tensors,
// in independent groups, and by which operation.
//
//   namespace st = d9d::state;
//   auto m = st::sequential({st::select_child_modules({"w", "b"}, "model"),
//                            st::parallel({st::transpose({"w"}, 0, 1), st::identity({"b"})})});
//   st::validate(m, {"model.w", "model.b"});  // before any data is read
//   for (const auto& g : m.groups()) { st::TensorMap out = m.apply(g, read(g.inputs)); }
//
// A Mapper is a list of groups. Each group names the input keys it reads and the output keys it
// produces, and applies one function to exactly those inputs. Every input key belongs to exactly
// one group and every output key comes from exactly one group, so a reader can load one group's
// inputs, apply it, hand the outputs on and drop the inputs before the next group (stream.hpp).
//
// Leaves build one group per key (identity, rename, transpose, ...) or per tuple (stack, chunk,
// ...). Composition: `parallel` unions mappers (an output produced twice is an error; groups that
// read the same input merge), `sequential` feeds one stage's outputs into the next (a stage-2 group
// that needs the outputs of several stage-1 groups merges them into one), `scope` puts every key
// under a module prefix, `shard` keeps this rank's share of the groups. Structural errors — an
// output produced twice, a stage needing a key the previous one does not produce, an output nobody
// uses — are std::invalid_argument when the mapper is built; `validate` checks the mapper against
// the keys a checkpoint has (missing input, unused input). All of it happens before any tensor is
// read.
//
// Mapper is a value type: copies share one immutable graph, so passing it around is cheap and it is
// safe to use from several threads. Distributed leaves (distribute, gather_full) are in
// d9d/state/mapper_distributed.hpp; streaming a checkpoint through a mapper is
// d9d/state/stream.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace d9d::state {

/// Tensors by name: what a group reads and what it produces.
using TensorMap = std::map<std::string, at::Tensor>;

/// The function of one group: gets exactly the group's inputs, returns exactly its outputs.
using GroupFunction = std::function<TensorMap(TensorMap)>;

/// One dependency group: these input keys produce these output keys.
struct MapperGroup {
  /// Keys read, sorted, each once (empty for a group that creates tensors from nothing).
  std::vector<std::string> inputs;
  /// Keys produced, sorted, each once (empty for a group that only drops its inputs).
  std::vector<std::string> outputs;
  /// What the group does, for messages: "transpose(0, 1)", "rename -> stack(dim 0)", ...
  std::string op;

  bool operator==(const MapperGroup&) const = default;
};

namespace detail {
struct MapperData;
struct MapperAccess;
}  // namespace detail

/// A state mapper: dependency groups plus the function of each. Cheap to copy (shared, immutable).
class Mapper {
 public:
  /// The empty mapper: no groups (the neutral element of `parallel`).
  Mapper();

  /// The groups, in a fixed order (by first output key, then first input key): the same on every
  /// rank for the same mapper.
  [[nodiscard]] const std::vector<MapperGroup>& groups() const;
  /// Every input key of every group, sorted.
  [[nodiscard]] std::vector<std::string> inputs() const;
  /// Every output key of every group, sorted.
  [[nodiscard]] std::vector<std::string> outputs() const;
  /// Input keys that groups given to other ranks by `shard` read: not used here, not unused either.
  [[nodiscard]] const std::vector<std::string>& elsewhere() const;
  /// True when group `group`'s function also works on meta tensors (shapes and dtypes, no data,
  /// no communication), so its output shapes can be derived before anything is read
  /// (infer_shapes in stream.hpp). True for every built-in leaf except gather_full, and for a
  /// merged group when it holds for each of its parts.
  [[nodiscard]] bool runs_on_meta(std::size_t group) const;

  /// Applies group number `group` (an index into groups()) to `inputs`, which must hold exactly
  /// its input keys; returns exactly its output keys. std::invalid_argument naming the operation
  /// and the keys when an input is missing or extra, or when the operation fails on these tensors
  /// (a dimension out of range, shapes that do not stack, ...). Outputs may be views of inputs.
  [[nodiscard]] TensorMap apply(std::size_t group, TensorMap inputs) const;
  /// The same for a group given by value: it must be one of groups() (same inputs and outputs).
  [[nodiscard]] TensorMap apply(const MapperGroup& group, TensorMap inputs) const;
  /// Every group over one map holding at least every input key (other keys are ignored); the
  /// outputs of all groups. For in-memory state (e.g. before saving).
  [[nodiscard]] TensorMap apply_all(const TensorMap& inputs) const;

 private:
  explicit Mapper(std::shared_ptr<const detail::MapperData> data);
  friend struct detail::MapperAccess;

  std::shared_ptr<const detail::MapperData> data_;
};

/// The name for the same type.
using StateMapper = Mapper;

// ---------------------------------------------------------------------------------------- leaves

/// One group with a custom function: reads `inputs`, must return exactly `outputs`. `op` names it
/// in messages. The building block of every other leaf. Pass `runs_on_meta` = true only when the
/// function also works on meta tensors (no data access such as item(), no communication): streams
/// then check its output shapes before reading. std::invalid_argument for a key given twice; at
/// apply, for a function that returns other keys or an undefined tensor.
[[nodiscard]] Mapper leaf(std::string op, std::vector<std::string> inputs,
                          std::vector<std::string> outputs, GroupFunction function,
                          bool runs_on_meta = false);

/// Each key unchanged (one group per key).
[[nodiscard]] Mapper identity(const std::vector<std::string>& keys);
/// `from` becomes `to`, unchanged.
[[nodiscard]] Mapper rename(const std::string& from, const std::string& to);
/// Each pair (from, to) renamed (one group per pair); two pairs with one `to` is an error.
[[nodiscard]] Mapper rename(const std::vector<std::pair<std::string, std::string>>& from_to);
/// Each key (which must start with `from_prefix`) renamed to `to_prefix` + the rest of it.
[[nodiscard]] Mapper rename_prefix(const std::vector<std::string>& keys,
                                   std::string_view from_prefix, std::string_view to_prefix);
/// The keys of a child module taken out of its parent: input `parent` + "." + key becomes `key`
/// (e.g. {"layers.0.w"} under "model" reads "model.layers.0.w"). rename_prefix for many keys.
[[nodiscard]] Mapper select_child_modules(const std::vector<std::string>& child_keys,
                                          std::string_view parent);
/// Reads nothing and produces nothing for these keys: marks them used (a stream never loads them).
[[nodiscard]] Mapper drop(const std::vector<std::string>& keys);
/// Each key transposed in place of its name: dims `dim0` and `dim1` swapped (negative counts from
/// the end).
[[nodiscard]] Mapper transpose(const std::vector<std::string>& keys, int64_t dim0, int64_t dim1);
/// Each key with dimension `dim` (of size 1) removed; a dimension of another size is an error.
[[nodiscard]] Mapper squeeze(const std::vector<std::string>& keys, int64_t dim);
/// Each key with a new dimension of size 1 at `dim`.
[[nodiscard]] Mapper unsqueeze(const std::vector<std::string>& keys, int64_t dim);
/// `inputs` (same shape) stacked, in the order given, along a new dimension `dim` into `output`.
[[nodiscard]] Mapper stack(const std::vector<std::string>& inputs, const std::string& output,
                           int64_t dim = 0);
/// `input` split along `dim` into its slices, one per output in order; the size of `dim` must
/// equal outputs.size(). The inverse of stack.
[[nodiscard]] Mapper unstack(const std::string& input, const std::vector<std::string>& outputs,
                             int64_t dim = 0);
/// `inputs` concatenated, in the order given, along the existing dimension `dim` into `output`.
[[nodiscard]] Mapper concatenate(const std::vector<std::string>& inputs, const std::string& output,
                                 int64_t dim = 0);
/// `input` cut along `dim` into outputs.size() consecutive parts, one per output in order. A size
/// of n gives each part ceil(n / k) elements, the last ones fewer, possibly none (the rule of
/// d9d::shard_range). The inverse of concatenate when the sizes follow that rule.
[[nodiscard]] Mapper chunk(const std::string& input, const std::vector<std::string>& outputs,
                           int64_t dim = 0);

// ----------------------------------------------------------------------------------- composition

/// The union of `parts`. An output key produced by two parts is std::invalid_argument naming the
/// key and both groups. Groups of different parts that read the same input merge into one group
/// (so every input is read once); each still gets its own copy of the tensor handle.
[[nodiscard]] Mapper parallel(const std::vector<Mapper>& parts);

/// `stages` chained: the outputs of stage i are the inputs of stage i + 1. std::invalid_argument
/// when a stage needs a key the previous stage does not produce, or when a stage produces a key
/// the next one neither uses nor leaves to another rank (add identity or drop for it). A group of
/// stage i + 1 that needs outputs of several groups of stage i merges them (with everything else
/// connected to them) into one group. No stages: the empty mapper.
[[nodiscard]] Mapper sequential(const std::vector<Mapper>& stages);

/// `mapper` with every input and output key put under the module `prefix`: "w" becomes
/// `prefix` + "." + "w" ("" leaves the keys as they are). For mapping one submodule inside a model.
[[nodiscard]] Mapper scope(std::string_view prefix, const Mapper& mapper);

/// The groups of `mapper` that rank `rank` of `world` handles: group i goes to rank i % world, in
/// the order of groups() (identical on every rank). The inputs of the other ranks' groups become
/// elsewhere() (validate does not call them unused). std::invalid_argument unless 0 <= rank <
/// world.
[[nodiscard]] Mapper shard(const Mapper& mapper, int rank, int world);

// ------------------------------------------------------------------------------------ validation

/// Options of validate.
struct ValidateOptions {
  /// Accept available keys that no group reads (default: an error listing them).
  bool allow_unused_inputs = false;
};

/// Checks `mapper` against the keys a source holds, before anything is read: every input key must
/// be available (std::invalid_argument "missing input" naming the keys and the groups needing
/// them) and, unless allowed, every available key must be read by a group or be elsewhere()
/// (std::invalid_argument "unused input" naming the keys).
void validate(const Mapper& mapper, const std::vector<std::string>& available_inputs,
              const ValidateOptions& options = {});

}  // namespace d9d::state
