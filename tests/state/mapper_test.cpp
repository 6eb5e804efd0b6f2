// Tests of d9d/state/mapper.hpp and d9d/state/stream.hpp: every leaf's groups and values (and the
// round trips of inverse leaves), composition (parallel, sequential with merging, scope, shard),
// each validation error's message, and streaming reads: the outputs equal a whole-file load
// transformed by hand, byte for byte, while the stream holds about one group, not the file.
#include <algorithm>
#include <cstdint>
#include <map>
#include <ostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <d9d/state/mapper.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/state/safetensors_sharded.hpp>
#include <d9d/state/stream.hpp>

#include "tests/state/state_test_support.hpp"
#include "tests/support/error_of.hpp"

namespace d9d::state {
// GoogleTest prints groups in failure messages with this.
void PrintTo(const MapperGroup& group, std::ostream* out) {
  *out << "{inputs " << ::testing::PrintToString(group.inputs) << ", outputs "
       << ::testing::PrintToString(group.outputs) << ", op \"" << group.op << "\"}";
}
}  // namespace d9d::state

namespace {

namespace st = d9d::state;
using d9d::testing::error_of;
using d9d::testing::state::expect_same;
using d9d::testing::state::resident_bytes;
using d9d::testing::state::scratch_dir;
using st::Mapper;
using st::MapperGroup;
using st::TensorMap;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// Distinct values of a given shape.
at::Tensor values(const std::vector<int64_t>& shape, double start = 0) {
  int64_t n = 1;
  for (const auto d : shape) {
    n *= d;
  }
  return (at::arange(n, at::kFloat) + start).reshape(shape);
}

std::vector<std::string> keys_of(const TensorMap& map) {
  std::vector<std::string> keys;
  for (const auto& [key, tensor] : map) {
    keys.push_back(key);
  }
  return keys;
}

void expect_equal(const at::Tensor& got, const at::Tensor& want) {
  ASSERT_TRUE(got.defined());
  EXPECT_EQ(got.sizes(), want.sizes());
  EXPECT_EQ(got.scalar_type(), want.scalar_type());
  EXPECT_TRUE(at::equal(got, want)) << got << "\nwant\n" << want;
}

MapperGroup group(std::vector<std::string> inputs, std::vector<std::string> outputs) {
  return {.inputs = std::move(inputs), .outputs = std::move(outputs), .op = ""};
}

// The groups' (inputs, outputs), without the op names.
std::vector<MapperGroup> shapes_of(const Mapper& mapper) {
  std::vector<MapperGroup> out;
  for (const auto& g : mapper.groups()) {
    out.push_back(group(g.inputs, g.outputs));
  }
  return out;
}

// ------------------------------------------------------------------------------------ leaves

TEST(State_Mapper_Leaves, IdentityKeepsEachKeyInItsOwnGroup) {
  const Mapper m = st::identity({"b", "a"});
  EXPECT_THAT(shapes_of(m), ElementsAre(group({"a"}, {"a"}), group({"b"}, {"b"})));
  EXPECT_EQ(m.groups()[0].op, "identity");
  const at::Tensor a = values({2, 3});
  const TensorMap out = m.apply(0, {{"a", a}});
  EXPECT_THAT(keys_of(out), ElementsAre("a"));
  EXPECT_TRUE(out.at("a").is_same(a));
}

TEST(State_Mapper_Leaves, RenameOneAndMany) {
  const Mapper one = st::rename("old", "new");
  EXPECT_THAT(shapes_of(one), ElementsAre(group({"old"}, {"new"})));
  EXPECT_EQ(one.groups()[0].op, R"(rename("old" -> "new"))");
  const at::Tensor t = values({4});
  EXPECT_TRUE(one.apply(0, {{"old", t}}).at("new").is_same(t));

  const Mapper many = st::rename({{"x", "y"}, {"p", "q"}});
  // Groups come in the order of their first output key.
  EXPECT_THAT(shapes_of(many), ElementsAre(group({"p"}, {"q"}), group({"x"}, {"y"})));
  const TensorMap all = many.apply_all({{"x", t}, {"p", t * 2}, {"ignored", t}});
  EXPECT_THAT(keys_of(all), ElementsAre("q", "y"));
  expect_equal(all.at("q"), t * 2);
}

TEST(State_Mapper_Leaves, RenamePrefixAndSelectChildModules) {
  const Mapper prefix = st::rename_prefix({"model.a.w", "model.b"}, "model.", "net.");
  EXPECT_THAT(prefix.inputs(), ElementsAre("model.a.w", "model.b"));
  EXPECT_THAT(prefix.outputs(), ElementsAre("net.a.w", "net.b"));
  EXPECT_THAT(
      error_of<std::invalid_argument>([] { (void)st::rename_prefix({"x.w"}, "model.", ""); }),
      HasSubstr(R"(d9d::state::rename_prefix: key "x.w" does not start with "model.")"));

  const Mapper child = st::select_child_modules({"layers.0.w", "norm"}, "model");
  EXPECT_THAT(shapes_of(child), ElementsAre(group({"model.layers.0.w"}, {"layers.0.w"}),
                                            group({"model.norm"}, {"norm"})));
  const at::Tensor w = values({2, 2});
  EXPECT_TRUE(
      child.apply_all({{"model.layers.0.w", w}, {"model.norm", w}}).at("layers.0.w").is_same(w));
  EXPECT_THAT(st::select_child_modules({"w"}, "").outputs(), ElementsAre("w"));
}

TEST(State_Mapper_Leaves, DropReadsAndProducesNothing) {
  const Mapper m = st::drop({"rotary.inv_freq"});
  EXPECT_THAT(shapes_of(m), ElementsAre(group({"rotary.inv_freq"}, {})));
  EXPECT_THAT(keys_of(m.apply(0, {{"rotary.inv_freq", values({3})}})), IsEmpty());
}

TEST(State_Mapper_Leaves, TransposeTwiceIsTheIdentity) {
  const at::Tensor w = values({2, 3, 4});
  const Mapper m = st::transpose({"w"}, 0, -1);
  EXPECT_EQ(m.groups()[0].op, "transpose(0, -1)");
  const at::Tensor once = m.apply(0, {{"w", w}}).at("w");
  expect_equal(once, w.permute({2, 1, 0}));
  expect_equal(m.apply(0, {{"w", once}}).at("w"), w);
}

TEST(State_Mapper_Leaves, SqueezeAndUnsqueezeRoundTrip) {
  const at::Tensor w = values({2, 3});
  const at::Tensor up = st::unsqueeze({"w"}, 1).apply(0, {{"w", w}}).at("w");
  EXPECT_EQ(up.sizes().vec(), (std::vector<int64_t>{2, 1, 3}));
  expect_equal(st::squeeze({"w"}, 1).apply(0, {{"w", up}}).at("w"), w);
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              (void)st::squeeze({"w"}, 1).apply(0, {{"w", w}});
            }),
            "d9d::state::squeeze(dim 1): a tensor of shape [2, 3] has size 3, not 1, at dim 1");
}

TEST(State_Mapper_Leaves, StackAndUnstackRoundTrip) {
  const at::Tensor e0 = values({2, 3});
  const at::Tensor e1 = values({2, 3}, 100);
  const Mapper s = st::stack({"e1", "e0"}, "experts", 1);  // the order given, not sorted
  EXPECT_THAT(shapes_of(s), ElementsAre(group({"e0", "e1"}, {"experts"})));
  const at::Tensor stacked = s.apply(0, {{"e0", e0}, {"e1", e1}}).at("experts");
  expect_equal(stacked, at::stack({e1, e0}, 1));

  const Mapper u = st::unstack("experts", {"e1", "e0"}, 1);
  EXPECT_THAT(shapes_of(u), ElementsAre(group({"experts"}, {"e0", "e1"})));
  const TensorMap back = u.apply(0, {{"experts", stacked}});
  expect_equal(back.at("e0"), e0);
  expect_equal(back.at("e1"), e1);
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              (void)st::unstack("x", {"a", "b", "c"}).apply(0, {{"x", e0}});
            }),
            "d9d::state::unstack(dim 0): \"x\" [2, 3] has 2 slices at dim 0, but 3 outputs are "
            "declared");
}

TEST(State_Mapper_Leaves, ConcatenateAndChunkRoundTrip) {
  const at::Tensor q = values({4, 2});
  const at::Tensor k = values({4, 2}, 50);
  const at::Tensor v = values({3, 2}, 90);
  const at::Tensor qkv =
      st::concatenate({"q", "k", "v"}, "qkv").apply(0, {{"q", q}, {"k", k}, {"v", v}}).at("qkv");
  expect_equal(qkv, at::cat({q, k, v}, 0));
  // 11 rows in 3 parts: ceil(11/3) = 4, 4, 3 — the rule of d9d::shard_range.
  const TensorMap parts = st::chunk("qkv", {"q", "k", "v"}).apply(0, {{"qkv", qkv}});
  expect_equal(parts.at("q"), q);
  expect_equal(parts.at("k"), k);
  expect_equal(parts.at("v"), v);
  // 2 columns over 3 parts: 1, 1, and an empty last one.
  const TensorMap cols = st::chunk("q", {"a", "b", "c"}, -1).apply(0, {{"q", q}});
  EXPECT_EQ(cols.at("c").sizes().vec(), (std::vector<int64_t>{4, 0}));
}

TEST(State_Mapper_Leaves, CustomLeafIsCheckedAtApply) {
  const Mapper good = st::leaf("scale", {"w"}, {"w"}, [](TensorMap in) {
    TensorMap out;
    out.emplace("w", in.at("w") * 2);
    return out;
  });
  expect_equal(good.apply(0, {{"w", values({2})}}).at("w"), values({2}) * 2);
  const Mapper wrong = st::leaf("oops", {"w"}, {"w"}, [](const TensorMap&) {
    TensorMap out;
    out.emplace("v", values({1}));
    return out;
  });
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              (void)wrong.apply(0, {{"w", values({1})}});
            }),
            "d9d::state::oops: returned \"v\" but declares \"w\". Fix: return exactly the output "
            "keys");
  EXPECT_EQ(error_of<std::invalid_argument>([] {
              (void)st::leaf("x", {"a", "a"}, {"b"}, {});
            }),
            "d9d::state::x: the group function is empty");
  EXPECT_EQ(error_of<std::invalid_argument>([] {
              (void)st::leaf("x", {"a", "a"}, {"b"}, [](TensorMap in) { return in; });
            }),
            "d9d::state::x: input \"a\" is given twice");
}

TEST(State_Mapper_Leaves, LibTorchFailuresNameTheOperationAndInputs) {
  const std::string message = error_of<std::invalid_argument>([] {
    (void)st::transpose({"w"}, 0, 5).apply(0, {{"w", values({2, 3})}});
  });
  EXPECT_THAT(message, HasSubstr("d9d::state::transpose(0, 5): fails on \"w\" [2, 3]: "));
  EXPECT_THAT(message, HasSubstr("Dimension out of range"));
  EXPECT_THAT(error_of<std::invalid_argument>([] {
                (void)st::stack({"a", "b"}, "s").apply(0, {{"a", values({2})}, {"b", values({3})}});
              }),
              HasSubstr("d9d::state::stack(dim 0): fails on \"a\" [2], \"b\" [3]: "));
}

TEST(State_Mapper_Apply, WrongInputsAreClearErrors) {
  const Mapper m = st::stack({"a", "b"}, "s");
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              (void)m.apply(0, {{"a", values({1})}});
            }),
            "d9d::state::Mapper::apply: group stack(dim 0) needs \"b\", which the inputs given "
            "lack");
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              (void)m.apply(0, {{"a", values({1})}, {"b", values({1})}, {"c", values({1})}});
            }),
            "d9d::state::Mapper::apply: group stack(dim 0) does not read \"c\". Fix: pass exactly "
            "the group's inputs");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { (void)m.apply(3, {}); }),
            "d9d::state::Mapper::apply: group 3 of a mapper with 1 groups");
  EXPECT_THAT(error_of<std::invalid_argument>([&] { (void)m.apply(group({"x"}, {"y"}), {}); }),
              HasSubstr("is not a group of this mapper"));
  // A group given by value (a copy) is found by its keys.
  const MapperGroup copy = m.groups()[0];
  EXPECT_THAT(keys_of(m.apply(copy, {{"a", values({1})}, {"b", values({1})}})), ElementsAre("s"));
}

// ------------------------------------------------------------------------------- composition

TEST(State_Mapper_Parallel, UnionsAndRefusesTwoProducers) {
  const Mapper m = st::parallel({st::rename("a", "x"), st::transpose({"w"}, 0, 1), Mapper()});
  EXPECT_THAT(shapes_of(m), ElementsAre(group({"w"}, {"w"}), group({"a"}, {"x"})));
  EXPECT_EQ(error_of<std::invalid_argument>([] {
              (void)st::parallel({st::rename("a", "w"), st::identity({"w"})});
            }),
            "d9d::state::parallel: output \"w\" is produced twice: by parts[0] (rename(\"a\" -> "
            "\"w\")) and by parts[1] (identity). Fix: each output key must come from one group");
  EXPECT_THAT(error_of<std::invalid_argument>([] {
                (void)st::identity({"a", "a"});
              }),
              HasSubstr("d9d::state::identity: output \"a\" is produced twice"));
}

TEST(State_Mapper_Parallel, GroupsReadingOneInputMerge) {
  // Tied embeddings: one stored tensor feeds two parameters; it is read once, in one group.
  const Mapper m = st::parallel(
      {st::rename("embed", "embed_tokens.weight"), st::rename("embed", "lm_head.weight")});
  ASSERT_EQ(m.groups().size(), 1U);
  EXPECT_EQ(m.groups()[0], (MapperGroup{.inputs = {"embed"},
                                        .outputs = {"embed_tokens.weight", "lm_head.weight"},
                                        .op = R"((rename("embed" -> "embed_tokens.weight") + )"
                                              R"(rename("embed" -> "lm_head.weight")))"}));
  const at::Tensor e = values({5, 2});
  const TensorMap out = m.apply(0, {{"embed", e}});
  EXPECT_TRUE(out.at("embed_tokens.weight").is_same(e));
  EXPECT_TRUE(out.at("lm_head.weight").is_same(e));
}

TEST(State_Mapper_Sequential, ChainsAndMergesGroups) {
  // Stage 1: three renames (three groups); stage 2 stacks two of their outputs: those merge.
  const Mapper m = st::sequential({
      st::rename({{"hf.e0", "e0"}, {"hf.e1", "e1"}, {"hf.norm", "norm"}}),
      st::parallel({st::stack({"e0", "e1"}, "experts"), st::unsqueeze({"norm"}, 0)}),
      st::parallel({st::transpose({"experts"}, 1, 2), st::identity({"norm"})}),
  });
  EXPECT_THAT(shapes_of(m),
              ElementsAre(group({"hf.e0", "hf.e1"}, {"experts"}), group({"hf.norm"}, {"norm"})));
  EXPECT_EQ(m.groups()[0].op,
            R"((rename("hf.e0" -> "e0") + rename("hf.e1" -> "e1")) -> stack(dim 0) -> )"
            "transpose(1, 2)");
  EXPECT_EQ(m.groups()[1].op, R"(rename("hf.norm" -> "norm") -> unsqueeze(dim 0) -> identity)");
  const at::Tensor e0 = values({2, 3});
  const at::Tensor e1 = values({2, 3}, 10);
  const at::Tensor norm = values({3});
  const TensorMap out = m.apply_all({{"hf.e0", e0}, {"hf.e1", e1}, {"hf.norm", norm}});
  expect_equal(out.at("experts"), at::stack({e0, e1}).transpose(1, 2));
  expect_equal(out.at("norm"), norm.unsqueeze(0));
  EXPECT_THAT(shapes_of(st::sequential({})), IsEmpty());
}

TEST(State_Mapper_Sequential, MissingAndUnusedIntermediateKeysAreErrors) {
  EXPECT_EQ(error_of<std::invalid_argument>([] {
              (void)st::sequential({st::rename("a", "b"), st::transpose({"c"}, 0, 1)});
            }),
            "d9d::state::sequential: stage 2 needs \"c\" (first needed by transpose(0, 1)), which "
            "stage 1 does not produce (it produces 1 keys: \"b\")");
  EXPECT_EQ(error_of<std::invalid_argument>([] {
              (void)st::sequential({st::identity({"a", "b"}), st::identity({"a"})});
            }),
            "d9d::state::sequential: stage 1 produces \"b\" (first from identity), which stage 2 "
            "does not use. Fix: add identity or drop for them to stage 2");
  // Stage numbers count from the first stage.
  EXPECT_THAT(
      error_of<std::invalid_argument>([] {
        (void)st::sequential({st::identity({"a"}), st::identity({"a"}), st::rename("x", "y")});
      }),
      HasSubstr("stage 3 needs \"x\""));
  // A drop in stage 2 accounts for a stage-1 output.
  const Mapper ok = st::sequential(
      {st::identity({"a", "b"}), st::parallel({st::identity({"a"}), st::drop({"b"})})});
  EXPECT_THAT(ok.outputs(), ElementsAre("a"));
}

TEST(State_Mapper_Scope, PrefixesEveryKey) {
  const Mapper inner = st::sequential({st::rename("w_in", "w"), st::transpose({"w"}, 0, 1)});
  const Mapper m = st::scope("model.layers.3", inner);
  EXPECT_THAT(shapes_of(m), ElementsAre(group({"model.layers.3.w_in"}, {"model.layers.3.w"})));
  const at::Tensor w = values({2, 3});
  expect_equal(m.apply(0, {{"model.layers.3.w_in", w}}).at("model.layers.3.w"), w.t());
  EXPECT_THAT(shapes_of(st::scope("", inner)), ElementsAre(group({"w_in"}, {"w"})));
}

TEST(State_Mapper_Shard, RoundRobinOverRanksCoversEveryGroupOnce) {
  const Mapper all = st::identity({"a", "b", "c", "d", "e"});
  const Mapper r0 = st::shard(all, 0, 2);
  const Mapper r1 = st::shard(all, 1, 2);
  EXPECT_THAT(r0.outputs(), ElementsAre("a", "c", "e"));
  EXPECT_THAT(r1.outputs(), ElementsAre("b", "d"));
  EXPECT_THAT(r1.elsewhere(), ElementsAre("a", "c", "e"));
  // The other ranks' inputs are neither missing nor unused.
  EXPECT_NO_THROW(st::validate(r1, {"a", "b", "c", "d", "e"}));
  EXPECT_EQ(error_of<std::invalid_argument>([&] { (void)st::shard(all, 2, 2); }),
            "d9d::state::shard: rank 2 of world 2. Fix: need 0 <= rank < world");
  // Sharding the last stage of a chain: this rank reads only what its groups need.
  const Mapper chained = st::sequential(
      {st::rename({{"x.a", "a"}, {"x.b", "b"}}), st::shard(st::identity({"a", "b"}), 1, 2)});
  EXPECT_THAT(shapes_of(chained), ElementsAre(group({"x.b"}, {"b"})));
  EXPECT_THAT(chained.elsewhere(), ElementsAre("x.a"));
}

// -------------------------------------------------------------------------------- validation

TEST(State_Mapper_Validate, MissingAndUnusedInputs) {
  const Mapper m = st::parallel({st::rename("a", "x"), st::stack({"b", "c"}, "s")});
  EXPECT_NO_THROW(st::validate(m, {"c", "b", "a"}));
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              st::validate(m, {"a", "b"});
            }),
            "d9d::state::validate: missing input: 1 key(s) the mapper reads are not in the "
            "source: \"c\" (the first needed by stack(dim 0)). Fix: check the checkpoint's names "
            "or map them from keys it has");
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              st::validate(m, {"a", "b", "c", "z", "y"});
            }),
            "d9d::state::validate: unused input: 2 key(s) of the source are read by no group: "
            "\"y\", \"z\". Fix: map them (identity, rename, ...), drop them, or set "
            "allow_unused_inputs");
  EXPECT_NO_THROW(st::validate(m, {"a", "b", "c", "z"}, {.allow_unused_inputs = true}));
}

// ------------------------------------------------------------------------------------ streams

// A checkpoint of `layers` layers, each with q and k (64 x 32 F32, 8 KiB each), plus an embedding
// (100 x 32 F32) and a rotary table nobody loads.
st::NamedTensors checkpoint(int layers) {
  st::NamedTensors tensors;
  tensors.emplace_back("model.embed", values({100, 32}, -7));
  for (int i = 0; i < layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    tensors.emplace_back(p + "q", values({64, 32}, 1000.0 * i));
    tensors.emplace_back(p + "k", values({64, 32}, 1000.0 * i + 500));
  }
  tensors.emplace_back("model.rotary", values({16}));
  return tensors;
}

TEST(State_Stream_SingleFile, OutputsEqualAWholeLoadTransformedByHand) {
  const std::string path = scratch_dir() + "/model.safetensors";
  constexpr int kLayers = 8;
  st::save_safetensors(path, checkpoint(kLayers));
  // Per layer: q and k stacked and transposed into "layers.i.qk" [32, 64, 2]; the embedding
  // renamed.
  std::vector<Mapper> parts{st::rename("model.embed", "embed.weight"), st::drop({"model.rotary"})};
  for (int i = 0; i < kLayers; ++i) {
    const std::string p = "model.layers." + std::to_string(i);
    const std::string out = "layers." + std::to_string(i) + ".qk";
    parts.push_back(
        st::sequential({st::stack({p + ".q", p + ".k"}, out), st::transpose({out}, 0, 2)}));
  }
  const Mapper mapper = st::parallel(parts);

  std::map<std::string, at::Tensor> got;
  std::vector<std::string> order;
  const st::StreamStats stats = st::stream_state(st::StateSource::open(path), mapper,
                                                 [&](const std::string& name, const at::Tensor& t) {
                                                   order.push_back(name);
                                                   got.emplace(name, t);
                                                 });

  // By hand from the whole file.
  std::map<std::string, at::Tensor> all;
  for (auto& [name, tensor] : st::load_safetensors(path)) {
    all.emplace(name, tensor);
  }
  ASSERT_EQ(got.size(), kLayers + 1U);
  expect_same(got.at("embed.weight"), all.at("model.embed"), "embed.weight");
  for (int i = 0; i < kLayers; ++i) {
    const std::string p = "model.layers." + std::to_string(i);
    const std::string out = "layers." + std::to_string(i) + ".qk";
    expect_same(got.at(out),
                at::stack({all.at(p + ".q"), all.at(p + ".k")}).transpose(0, 2).contiguous(), out);
  }
  // In data order: the embedding first, then the layers as they lie in the file.
  EXPECT_EQ(order.front(), "embed.weight");
  EXPECT_EQ(order[1], "layers.0.qk");

  constexpr uint64_t kQ = uint64_t{64} * 32 * 4;
  constexpr uint64_t kEmbed = uint64_t{100} * 32 * 4;
  EXPECT_EQ(stats.groups, kLayers + 1U);
  EXPECT_EQ(stats.files_opened, 1U);
  EXPECT_EQ(stats.tensors_read, 2U * kLayers + 1);  // the rotary table is dropped, never read
  EXPECT_EQ(stats.bytes_read, 2 * kQ * kLayers + kEmbed);
  EXPECT_EQ(stats.outputs, kLayers + 1U);
  // The largest group: q and k in, qk out (its own copy): 4 x 8 KiB. Not the file's 128 KiB+.
  EXPECT_EQ(stats.peak_bytes, 4 * kQ);
  EXPECT_LT(stats.peak_bytes, stats.bytes_read / 4);
  // The embedding (a view of the file) and each transposed stack (a view) were copied once.
  EXPECT_EQ(stats.copied_bytes, kEmbed + 2 * kQ * kLayers);
}

TEST(State_Stream_Sharded, EachFileOpensOnceAndGroupsSpanningFilesWork) {
  const std::string dir = scratch_dir();
  constexpr int kLayers = 4;
  // 3 tensors of 8 KiB per shard at most: layers straddle shard boundaries.
  st::save_safetensors_sharded(dir, checkpoint(kLayers), uint64_t{3} * 8192);
  const st::StateSource source = st::StateSource::open(dir);
  // embed + l0.q | l0.k, l1.q, l1.k | l2.q, l2.k, l3.q | l3.k + rotary.
  ASSERT_EQ(source.files().size(), 4U);
  EXPECT_EQ(source.file_of("model.layers.0.q"), 0U);
  EXPECT_EQ(source.file_of("model.layers.0.k"), 1U);

  std::vector<Mapper> parts{st::rename("model.embed", "embed.weight"), st::drop({"model.rotary"})};
  for (int i = 0; i < kLayers; ++i) {
    parts.push_back(st::sequential(
        {st::select_child_modules(
             {"layers." + std::to_string(i) + ".q", "layers." + std::to_string(i) + ".k"}, "model"),
         st::concatenate(
             {"layers." + std::to_string(i) + ".q", "layers." + std::to_string(i) + ".k"},
             "layers." + std::to_string(i) + ".qk")}));
  }
  std::map<std::string, at::Tensor> got;
  const auto stats =
      st::stream_state(source, st::parallel(parts),
                       [&](const std::string& name, const at::Tensor& t) { got.emplace(name, t); });
  const st::NamedTensors all_list = st::load_safetensors_sharded(dir);
  std::map<std::string, at::Tensor> all(all_list.begin(), all_list.end());
  for (int i = 0; i < kLayers; ++i) {
    const std::string p = "layers." + std::to_string(i);
    expect_same(got.at(p + ".qk"),
                at::cat({all.at("model." + p + ".q"), all.at("model." + p + ".k")}), p);
  }
  expect_same(got.at("embed.weight"), all.at("model.embed"), "embed");
  EXPECT_EQ(stats.files_opened, 4U);
  EXPECT_EQ(stats.groups, kLayers + 1U);
  EXPECT_EQ(stats.peak_bytes, 4U * 8192);
}

TEST(State_Stream_Shapes, InferredFromHeadersAndCheckedBeforeAnyRead) {
  const std::string path = scratch_dir() + "/shapes.safetensors";
  st::save_safetensors(path, {{"q", values({4, 2})},
                              {"k", values({4, 2})},
                              {"v", values({3, 2})},
                              {"h", values({2}).to(at::kHalf)}});
  const auto source = st::StateSource::open(path);
  const Mapper custom = st::leaf("halve", {"h"}, {"h"}, [](TensorMap in) { return in; });
  EXPECT_FALSE(custom.runs_on_meta(0));  // custom leaves: not unless declared
  const Mapper mapper =
      st::parallel({st::sequential({st::stack({"q", "k"}, "qk", 1), st::transpose({"qk"}, 0, 2)}),
                    st::unsqueeze({"v"}, 0), custom});
  EXPECT_TRUE(mapper.runs_on_meta(1));  // "qk"
  const auto specs = st::infer_shapes(source, mapper);
  EXPECT_EQ(specs.size(), 2U) << "the custom leaf's output is not derived";
  EXPECT_EQ(specs.at("qk"), (st::TensorSpec{.dtype = at::kFloat, .shape = {2, 2, 4}}));
  EXPECT_EQ(specs.at("v"), (st::TensorSpec{.dtype = at::kFloat, .shape = {1, 3, 2}}));
  // A merged group runs on meta only when every part does.
  EXPECT_FALSE(st::sequential({st::identity({"h"}), custom}).runs_on_meta(0));

  // Tensors that do not stack: the error comes before the first read.
  int calls = 0;
  const Mapper bad = st::parallel({st::stack({"q", "v"}, "qv"), st::drop({"k", "h"})});
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                (void)st::stream_state(source, bad,
                                       [&](const std::string&, const at::Tensor&) { ++calls; });
              }),
              HasSubstr("d9d::state::stack(dim 0): fails on \"q\" [4, 2], \"v\" [3, 2]: "));
  EXPECT_EQ(calls, 0);
}

TEST(State_Stream_Memory, ResidentMemoryStaysAboutOneGroupNotTheFile) {
  // 16 tensors of 4 MiB in one 64 MiB file, each through its own group. Reading maps the pages in;
  // the stream drops them after each group, so the process's resident memory (mapped pages
  // included) grows by about one group, not by the file.
  const std::string path = scratch_dir() + "/big.safetensors";
  constexpr int kTensors = 16;
  constexpr int64_t kFloats = 1 << 20;
  const at::Tensor one = at::arange(kFloats, at::kFloat);
  st::NamedTensors tensors;
  std::vector<std::string> keys;
  for (int i = 0; i < kTensors; ++i) {
    keys.push_back("t" + std::to_string(i));
    tensors.emplace_back(keys.back(), one);  // one buffer, written 16 times
  }
  st::save_safetensors(path, tensors);
  tensors.clear();
  const auto source = st::StateSource::open(path);
  const int64_t before = resident_bytes();
  int64_t most = 0;
  int checked = 0;
  const auto stats = st::stream_state(source, st::identity(keys),
                                      [&](const std::string& name, const at::Tensor& t) {
                                        most = std::max(most, resident_bytes() - before);
                                        checked += at::equal(t, one) ? 1 : 0;
                                        EXPECT_EQ(t.nbytes(), 4U << 20) << name;
                                      });
  EXPECT_EQ(checked, kTensors);
  EXPECT_EQ(stats.tensors_released, static_cast<std::size_t>(kTensors));
  EXPECT_EQ(stats.peak_bytes, 8U << 20);  // one view in, one copy out
  EXPECT_LT(most, int64_t{24} << 20) << "the file is 64 MiB";
}

TEST(State_Stream_Errors, ValidationHappensBeforeAnyRead) {
  const std::string path = scratch_dir() + "/m.safetensors";
  st::save_safetensors(path, {{"a", values({2})}, {"b", values({2})}});
  const auto source = st::StateSource::open(path);
  int calls = 0;
  const auto count = [&](const std::string&, const at::Tensor&) { ++calls; };
  EXPECT_THAT(error_of<std::invalid_argument>(
                  [&] { (void)st::stream_state(source, st::identity({"a"}), count); }),
              HasSubstr("unused input: 1 key(s) of the source are read by no group: \"b\""));
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                (void)st::stream_state(source, st::identity({"a", "b", "c"}), count);
              }),
              HasSubstr("missing input: 1 key(s) the mapper reads are not in the source: \"c\""));
  EXPECT_EQ(calls, 0);
  const auto stats =
      st::stream_state(source, st::identity({"a"}), count, {.allow_unused_inputs = true});
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(stats.tensors_read, 1U);
  EXPECT_THAT(error_of<std::runtime_error>([&] { (void)st::StateSource::open(scratch_dir()); }),
              HasSubstr("a directory with neither model.safetensors.index.json nor "
                        "model.safetensors"));
}

// --------------------------------------------------------------------------------- load_into

struct TinyImpl : torch::nn::Module {
  TinyImpl() {
    weight = register_parameter("weight", at::zeros({3, 2}));
    bias = register_parameter("bias", at::zeros({3}));
    steps = register_buffer("steps", at::zeros({1}, at::kLong));
  }
  at::Tensor weight;
  at::Tensor bias;
  at::Tensor steps;
};

TEST(State_LoadInto, CopiesIntoParametersAndBuffersByName) {
  const std::string path = scratch_dir() + "/tiny.safetensors";
  const at::Tensor w = values({2, 3});  // stored transposed
  st::save_safetensors(
      path, {{"lin.w", w}, {"lin.b", values({3}, 5)}, {"steps", at::full({1}, 7, at::kLong)}});
  TinyImpl tiny;
  const Mapper mapper = st::parallel(
      {st::sequential({st::rename("lin.w", "weight"), st::transpose({"weight"}, 0, 1)}),
       st::rename("lin.b", "bias"), st::identity({"steps"})});
  const auto stats = st::load_into(tiny, st::StateSource::open(path), mapper);
  EXPECT_EQ(stats.outputs, 3U);
  expect_equal(tiny.weight, w.t());
  expect_equal(tiny.bias, values({3}, 5));
  EXPECT_EQ(tiny.steps.item<int64_t>(), 7);
  EXPECT_TRUE(tiny.weight.requires_grad());
}

TEST(State_LoadInto, ExtraMissingAndShapeMismatchAreErrors) {
  const std::string path = scratch_dir() + "/tiny.safetensors";
  st::save_safetensors(path, {{"weight", values({2, 3})},
                              {"bias", values({3})},
                              {"steps", at::ones({1}, at::kLong)},
                              {"extra", values({1})}});
  const auto source = st::StateSource::open(path);
  TinyImpl tiny;
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              (void)st::load_into(tiny, source, st::identity({"weight", "bias", "steps", "extra"}));
            }),
            "d9d::state::load_into: extra: the mapper produces 1 key(s) the module has no "
            "parameter or buffer for: \"extra\" (the module has 3)");
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              (void)st::load_into(
                  tiny, source,
                  st::parallel({st::identity({"weight"}), st::drop({"bias", "steps", "extra"})}));
            }),
            "d9d::state::load_into: missing: 2 parameter(s)/buffer(s) of the module are produced "
            "by no group: \"bias\", \"steps\". Fix: map them, or set allow_missing to keep their "
            "values");
  EXPECT_EQ(error_of<std::invalid_argument>([&] {
              (void)st::load_into(
                  tiny, source,
                  st::parallel({st::identity({"weight", "bias", "steps"}), st::drop({"extra"})}));
            }),
            "d9d::state::load_into: \"weight\": the mapped tensor has shape [2, 3], the module's "
            "has [3, 2]");
  // Found from the headers, before anything was read: "bias" and "steps" were not loaded either.
  EXPECT_TRUE(at::equal(tiny.bias, at::zeros({3})));
  EXPECT_EQ(tiny.steps.item<int64_t>(), 0);
  const auto stats = st::load_into(tiny, source, st::identity({"bias"}),
                                   {.allow_unused_inputs = true, .allow_missing = true});
  EXPECT_EQ(stats.outputs, 1U);
  expect_equal(tiny.bias, values({3}));
}

}  // namespace
