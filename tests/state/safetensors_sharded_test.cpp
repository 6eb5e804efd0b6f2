// Tests of d9d/state/safetensors_sharded.hpp: the split by size, Hugging Face's names and index,
// round trips of everything or a subset, crash-safe rewriting, malformed indexes, and the Python
// `safetensors` package reading our shards.
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <d9d/state/safetensors_sharded.hpp>

#include "tests/state/state_test_support.hpp"
#include "tests/support/error_of.hpp"

namespace {

using d9d::testing::error_of;
using d9d::testing::state::expect_python_saw;
using d9d::testing::state::expect_same;
using d9d::testing::state::file_exists;
using d9d::testing::state::read_file;
using d9d::testing::state::reference_tensors;
using d9d::testing::state::run_check;
using d9d::testing::state::scratch_dir;
using d9d::testing::state::write_file;

using d9d::state::load_safetensors_index;
using d9d::state::load_safetensors_sharded;
using d9d::state::NamedTensors;
using d9d::state::save_safetensors_sharded;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Float tensors of `floats` elements each (4 bytes per element), distinct values.
NamedTensors float_tensors(const std::vector<std::pair<std::string, int64_t>>& sizes) {
  NamedTensors tensors;
  double start = 0;
  for (const auto& [name, floats] : sizes) {
    tensors.emplace_back(name, at::arange(floats, at::kFloat) + start);
    start += 1000;
  }
  return tensors;
}

std::vector<std::string> names_of(const NamedTensors& tensors) {
  std::vector<std::string> names;
  for (const auto& [name, tensor] : tensors) {
    names.push_back(name);
  }
  return names;
}

TEST(State_SafetensorsSharded_Names, HuggingFaceNames) {
  EXPECT_EQ(d9d::state::safetensors_shard_name(1, 3), "model-00001-of-00003.safetensors");
  EXPECT_EQ(d9d::state::safetensors_shard_name(12, 120), "model-00012-of-00120.safetensors");
  EXPECT_EQ(d9d::state::kSafetensorsIndexName, "model.safetensors.index.json");
}

TEST(State_SafetensorsSharded_limit100, SplitsInOrderAndWritesTheIndex) {
  const std::string dir = scratch_dir() + "/ckpt";  // created by the writer
  // 40 + 40 fit in 100 bytes, the third 40 does not; 100 exactly fits alone.
  const NamedTensors tensors =
      float_tensors({{"layers.0.w", 10}, {"layers.0.b", 10}, {"layers.1.w", 10}, {"head", 25}});
  const auto index = save_safetensors_sharded(dir, tensors, 100, {{"format", "pt"}});
  EXPECT_EQ(index.total_size, 4U * (10 + 10 + 10 + 25));
  EXPECT_THAT(index.files(),
              ElementsAre("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                          "model-00003-of-00003.safetensors"));
  EXPECT_EQ(index.weight_map.at("layers.0.w"), "model-00001-of-00003.safetensors");
  EXPECT_EQ(index.weight_map.at("layers.0.b"), "model-00001-of-00003.safetensors");
  EXPECT_EQ(index.weight_map.at("layers.1.w"), "model-00002-of-00003.safetensors");
  EXPECT_EQ(index.weight_map.at("head"), "model-00003-of-00003.safetensors");

  // The index file as Hugging Face writes it, and the same thing read back.
  const auto json = nlohmann::json::parse(read_file(dir + "/model.safetensors.index.json"));
  EXPECT_EQ(json.at("metadata"), nlohmann::json({{"total_size", 220}}));
  EXPECT_EQ(json.at("weight_map").size(), 4U);
  EXPECT_EQ(json.at("weight_map").at("head"), "model-00003-of-00003.safetensors");
  const auto read = load_safetensors_index(dir);
  EXPECT_EQ(read.total_size, index.total_size);
  EXPECT_EQ(read.weight_map, index.weight_map);
  EXPECT_EQ(read.path_of("head"), dir + "/model-00003-of-00003.safetensors");

  // Each shard is a plain safetensors file with the metadata, tensors in the order given.
  const d9d::state::SafetensorsFile first(dir + "/model-00001-of-00003.safetensors");
  EXPECT_EQ(first.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(first.entries().size(), 2U);
  EXPECT_EQ(first.entries()[0].name, "layers.0.w");
  EXPECT_EQ(first.entries()[1].name, "layers.0.b");
  for (const auto& name : index.files()) {
    EXPECT_FALSE(file_exists(dir + "/" + name + ".tmp"));
  }
  EXPECT_FALSE(file_exists(dir + "/model.safetensors.index.json.tmp"));

  // Everything back: shard by shard, data order within.
  const NamedTensors all = load_safetensors_sharded(dir);
  EXPECT_EQ(names_of(all), names_of(tensors));
  for (std::size_t i = 0; i < all.size(); ++i) {
    expect_same(all[i].second, tensors[i].second, tensors[i].first);
  }
  // A subset, in the order asked.
  const NamedTensors some = load_safetensors_sharded(dir, {"head", "layers.0.w"});
  EXPECT_THAT(names_of(some), ElementsAre("head", "layers.0.w"));
  expect_same(some[0].second, tensors[3].second, "head");
  expect_same(some[1].second, tensors[0].second, "layers.0.w");
}

TEST(State_SafetensorsSharded_limit100, ATensorOverTheLimitGetsItsOwnShard) {
  const std::string dir = scratch_dir();
  const NamedTensors tensors = float_tensors({{"a", 10}, {"big", 100}, {"b", 10}, {"c", 10}});
  const auto index = save_safetensors_sharded(dir, tensors, 100);
  EXPECT_EQ(index.files().size(), 3U);
  EXPECT_EQ(index.weight_map.at("a"), "model-00001-of-00003.safetensors");
  EXPECT_EQ(index.weight_map.at("big"), "model-00002-of-00003.safetensors");
  EXPECT_EQ(index.weight_map.at("b"), "model-00003-of-00003.safetensors");
  EXPECT_EQ(index.weight_map.at("c"), "model-00003-of-00003.safetensors");
  EXPECT_EQ(d9d::state::SafetensorsFile(dir + "/model-00002-of-00003.safetensors").entries().size(),
            1U);
  const NamedTensors all = load_safetensors_sharded(dir);
  EXPECT_EQ(names_of(all), names_of(tensors));
}

TEST(State_SafetensorsSharded_limitHuge, OneShardAndNoTensorsAreIndexedToo) {
  const std::string dir = scratch_dir();
  auto index = save_safetensors_sharded(dir, reference_tensors(), uint64_t{1} << 40);
  EXPECT_THAT(index.files(), ElementsAre("model-00001-of-00001.safetensors"));
  const NamedTensors all = load_safetensors_sharded(dir);
  const NamedTensors want = reference_tensors();
  ASSERT_EQ(all.size(), want.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    expect_same(all[i].second, want[i].second, want[i].first);
  }
  const std::string empty_dir = scratch_dir();
  index = save_safetensors_sharded(empty_dir, {}, 100);
  EXPECT_THAT(index.files(), ElementsAre());
  EXPECT_TRUE(index.weight_map.empty());
  EXPECT_TRUE(file_exists(empty_dir + "/model-00001-of-00001.safetensors"));
  EXPECT_TRUE(load_safetensors_sharded(empty_dir).empty());
}

TEST(State_SafetensorsSharded_Rewrite, FewerShardsRemoveTheStaleOnesAndNothingElse) {
  const std::string dir = scratch_dir();
  (void)save_safetensors_sharded(dir, float_tensors({{"a", 25}, {"b", 25}, {"c", 25}}), 100);
  EXPECT_TRUE(file_exists(dir + "/model-00003-of-00003.safetensors"));
  write_file(dir + "/model-notes.txt", "mine");
  write_file(dir + "/model-00001-of-00003.safetensors.bak", "mine too");
  (void)save_safetensors_sharded(dir, float_tensors({{"a", 25}, {"b", 25}, {"c", 25}}), 1000);
  EXPECT_FALSE(file_exists(dir + "/model-00001-of-00003.safetensors"));
  EXPECT_FALSE(file_exists(dir + "/model-00003-of-00003.safetensors"));
  EXPECT_TRUE(file_exists(dir + "/model-00001-of-00001.safetensors"));
  EXPECT_TRUE(file_exists(dir + "/model-notes.txt"));
  EXPECT_TRUE(file_exists(dir + "/model-00001-of-00003.safetensors.bak"));
  EXPECT_EQ(load_safetensors_sharded(dir).size(), 3U);
}

TEST(State_SafetensorsSharded_WriteErrors, BadInputsTouchNoFile) {
  const std::string dir = scratch_dir() + "/untouched";
  const at::Tensor x = at::ones({30});
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                (void)save_safetensors_sharded(dir, {{"w", x}, {"v", x}, {"w", x}}, 100);
              }),
              HasSubstr("d9d::state::save_safetensors_sharded: " + dir +
                        ": tensor name \"w\" is given twice"));
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                (void)save_safetensors_sharded(dir, {{"w", x}}, 0);
              }),
              HasSubstr("max_shard_bytes is 0"));
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                (void)save_safetensors_sharded(
                    dir, {{"w", x}, {"c", at::ones({2}, at::kComplexDouble)}}, 100);
              }),
              HasSubstr("tensor \"c\": d9d::state::safetensors_dtype_name: dtype ComplexDouble"));
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                (void)save_safetensors_sharded(dir, {{"w", x}}, 100, {{"k", "\xff"}});
              }),
              HasSubstr("metadata \"k\" is not valid UTF-8"));
  EXPECT_FALSE(file_exists(dir));
}

TEST(State_SafetensorsSharded_ReadErrors, EachProblemNamesTheFile) {
  const std::string dir = scratch_dir();
  const std::string index = dir + "/model.safetensors.index.json";
  EXPECT_THAT(error_of<std::runtime_error>([&] { (void)load_safetensors_index(dir); }),
              HasSubstr("d9d::state::load_safetensors_index: " + index +
                        ": cannot open (No such file or directory)"));
  const auto index_error = [&](const std::string& text) {
    write_file(index, text);
    return error_of<std::runtime_error>([&] { (void)load_safetensors_index(dir); });
  };
  EXPECT_THAT(index_error("[]"), HasSubstr(index + ": not a JSON object"));
  EXPECT_THAT(index_error("{\"metadata\":{}}"), HasSubstr("no \"weight_map\" object"));
  EXPECT_THAT(index_error(R"({"weight_map":{"a":"x","a":"y"}})"),
              HasSubstr("\"weight_map\": key \"a\" appears twice"));
  EXPECT_THAT(index_error(R"({"weight_map":{"a":3}})"),
              HasSubstr("\"weight_map\": tensor \"a\" maps to 3, not a file name"));
  EXPECT_THAT(
      index_error(R"({"weight_map":{"a":"../x.safetensors"}})"),
      HasSubstr("maps to \"../x.safetensors\", not a plain file name inside the checkpoint"));
  EXPECT_THAT(index_error(R"({"weight_map":{"a":".."}})"), HasSubstr("not a plain file name"));
  EXPECT_THAT(index_error(R"({"metadata":{"total_size":-1},"weight_map":{}})"),
              HasSubstr("\"metadata\".\"total_size\" -1 is not a whole number >= 0"));
  EXPECT_THAT(index_error("{\"weight_map\":{"), HasSubstr("bad JSON"));
  write_file(index, R"({"metadata":{"total_size":8.0,"extra":[1]},"weight_map":{}})");
  EXPECT_EQ(load_safetensors_index(dir).total_size, 8U);

  // Shards that disagree with the index.
  (void)save_safetensors_sharded(dir, float_tensors({{"a", 25}, {"b", 25}}), 100);
  const std::string first = "model-00001-of-00002.safetensors";
  const std::string second = "model-00002-of-00002.safetensors";
  write_file(index, R"({"weight_map":{"a":")" + first + R"(","b":")" + first + R"("}})");
  EXPECT_THAT(
      error_of<std::runtime_error>([&] { (void)load_safetensors_sharded(dir); }),
      HasSubstr(index + ": maps tensor \"b\" to \"" + first + "\", which does not hold it"));
  EXPECT_THAT(error_of<std::runtime_error>([&] { (void)load_safetensors_sharded(dir, {"b"}); }),
              HasSubstr("maps tensor \"b\" to " + dir + "/" + first + ", which does not hold it"));
  // One shard holding both; the index lists one of them, or maps it elsewhere.
  const std::string one = scratch_dir();
  const std::string one_index = one + "/model.safetensors.index.json";
  const std::string only = "model-00001-of-00001.safetensors";
  (void)save_safetensors_sharded(one, float_tensors({{"a", 25}, {"b", 25}}), 1000);
  write_file(one_index, R"({"weight_map":{"a":")" + only + R"("}})");
  EXPECT_THAT(error_of<std::runtime_error>([&] { (void)load_safetensors_sharded(one); }),
              HasSubstr("d9d::state::load_safetensors_sharded: " + one + "/" + only +
                        ": tensor \"b\" is in this shard, but " + one_index + " does not list it"));
  write_file(one + "/other.safetensors", read_file(one + "/" + only));
  write_file(one_index, R"({"weight_map":{"a":")" + only + R"(","b":"other.safetensors"}})");
  EXPECT_THAT(error_of<std::runtime_error>([&] { (void)load_safetensors_sharded(one); }),
              HasSubstr(": tensor \"b\" is in this shard, but " + one_index +
                        " maps it to \"other.safetensors\""));
  write_file(index, R"({"weight_map":{"a":")" + first + R"(","b":")" + second +
                        R"(","c":"gone.safetensors"}})");
  EXPECT_THAT(error_of<std::runtime_error>([&] { (void)load_safetensors_sharded(dir); }),
              HasSubstr(dir + "/gone.safetensors: cannot open (No such file or directory)"));
  EXPECT_EQ(load_safetensors_sharded(dir, {"b", "a"}).size(), 2U);
  EXPECT_THAT(error_of<std::out_of_range>([&] { (void)load_safetensors_sharded(dir, {"zz"}); }),
              HasSubstr("no tensor \"zz\" in the weight_map"));
}

TEST(State_SafetensorsSharded_Python, PackageReadsOurShardsAndIndex) {
  const std::string dir = scratch_dir();
  NamedTensors tensors = reference_tensors();
  for (auto& [name, tensor] : float_tensors({{"big.0", 64}, {"big.1", 64}})) {
    tensors.emplace_back(name, tensor);
  }
  const auto index = save_safetensors_sharded(dir, tensors, 256, {{"format", "pt"}});
  ASSERT_GE(index.files().size(), 3U);
  const auto run = run_check("read-sharded", dir);
  ASSERT_EQ(run.status, 0) << run.err;
  const auto json = nlohmann::json::parse(run.out);
  EXPECT_EQ(json.at("index").at("metadata").at("total_size"), index.total_size);
  nlohmann::json seen = nlohmann::json::object();
  for (const auto& [file, shard] : json.at("shards").items()) {
    EXPECT_EQ(shard.at("metadata"), nlohmann::json({{"format", "pt"}})) << file;
    for (const auto& [name, tensor] : shard.at("tensors").items()) {
      EXPECT_EQ(json.at("index").at("weight_map").at(name), file) << name;
      seen[name] = tensor;
    }
  }
  expect_python_saw(seen, tensors);
}

}  // namespace
