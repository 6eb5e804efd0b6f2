// Tests of d9d/state/safetensors.hpp: round trips of every dtype, the byte layout, malformed files
// and their errors, and the Python `safetensors` package as an independent reader and writer.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <d9d/state/safetensors.hpp>

#include "tests/support/error_of.hpp"

namespace {

using d9d::testing::error_of;

using d9d::state::load_safetensors;
using d9d::state::NamedTensors;
using d9d::state::read_safetensors_metadata;
using d9d::state::save_safetensors;
using ::testing::HasSubstr;

std::string scratch_dir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/d9d_state_XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw std::runtime_error("mkdtemp failed under " + pattern);
  }
  return pattern;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

bool file_exists(const std::string& path) { return std::ifstream(path).good(); }

// One tensor of every supported dtype, plus a scalar and an empty tensor; the same values as
// reference() in safetensors_check.py.
NamedTensors reference_tensors(bool with_bf16 = true) {
  NamedTensors t;
  t.emplace_back("f32", at::arange(6, at::kFloat).reshape({2, 3}) - 2.5);
  t.emplace_back("f64", at::arange(4, at::kDouble) * 0.125);
  t.emplace_back("f16", (at::arange(6, at::kFloat) * 0.25).to(at::kHalf).reshape({3, 2}));
  if (with_bf16) {
    t.emplace_back("bf16", at::tensor({1.0F, -2.0F, 0.5F, 3.0F}).to(at::kBFloat16).reshape({2, 2}));
  }
  t.emplace_back("i64", at::tensor({int64_t{-3}, int64_t{1} << 40, int64_t{7}}, at::kLong));
  t.emplace_back("i32", at::tensor({-1, 2, 3, -4}, at::kInt).reshape({2, 2}));
  t.emplace_back("i16", at::tensor({-300, 300}, at::kShort));
  t.emplace_back("i8", at::tensor({-128, 127, 0}, at::kChar));
  t.emplace_back("u8", at::tensor({0, 255, 17}, at::kByte));
  t.emplace_back("bool", at::tensor({1, 0, 1}, at::kByte).to(at::kBool));
  t.emplace_back("scalar", at::scalar_tensor(42.0, at::kFloat));
  t.emplace_back("empty", at::zeros({0, 3}, at::kFloat));
  return t;
}

// The same values, laid out with every other element skipped (not contiguous).
at::Tensor strided_copy(const at::Tensor& t) { return at::stack({t, t}, -1).select(-1, 0); }

void expect_same(const at::Tensor& got, const at::Tensor& want, const std::string& name) {
  EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
  EXPECT_EQ(got.sizes(), want.sizes()) << name;
  EXPECT_TRUE(got.is_contiguous()) << name;
  EXPECT_TRUE(at::equal(got, want)) << name << ": got " << got << " want " << want;
}

// ------------------------------------------------------------------------------------------------
// Round trips and layout

TEST(State_Safetensors_AllDtypes, RoundTripKeepsNamesOrderDtypesShapesValues) {
  const std::string path = scratch_dir() + "/all.safetensors";
  const auto tensors = reference_tensors();
  save_safetensors(path, tensors, {{"step", "12"}, {"format", "pt"}});
  const auto loaded = load_safetensors(path);
  ASSERT_EQ(loaded.size(), tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(loaded[i].first, tensors[i].first);
    expect_same(loaded[i].second, tensors[i].second, tensors[i].first);
  }
  const auto metadata = read_safetensors_metadata(path);
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{{"step", "12"}, {"format", "pt"}}));
  EXPECT_FALSE(file_exists(path + ".tmp"));
}

TEST(State_Safetensors_NonContiguous, StridedAndTransposedInputsAreWrittenByValue) {
  const std::string path = scratch_dir() + "/strided.safetensors";
  NamedTensors strided;
  for (const auto& [name, tensor] : reference_tensors()) {
    strided.emplace_back(name, strided_copy(tensor));
    if (tensor.numel() > 1) {
      EXPECT_FALSE(strided.back().second.is_contiguous()) << name;
    }
  }
  const at::Tensor base = at::arange(12, at::kFloat).reshape({3, 4});
  strided.emplace_back("transposed", base.t());
  strided.emplace_back("expanded", at::arange(3, at::kLong).expand({2, 3}));
  save_safetensors(path, strided);
  const auto loaded = load_safetensors(path);
  ASSERT_EQ(loaded.size(), strided.size());
  for (std::size_t i = 0; i < strided.size(); ++i) {
    expect_same(loaded[i].second, strided[i].second.contiguous(), strided[i].first);
  }
  EXPECT_TRUE(read_safetensors_metadata(path).empty());
}

TEST(State_Safetensors_Layout, HeaderIsPaddedJsonAndDataFollowsInTheOrderGiven) {
  const std::string path = scratch_dir() + "/layout.safetensors";
  save_safetensors(path,
                   {{"z", at::tensor({1.0F, 2.0F})},
                    {"a", at::tensor({3}, at::kByte)},
                    {"m", at::tensor({int64_t{4}})}},
                   {{"note", "hi"}});
  const std::string bytes = read_file(path);
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) {
    length |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]))
              << (8U * static_cast<unsigned>(i));
  }
  EXPECT_EQ(length % 8, 0U);
  EXPECT_EQ(bytes.size(), 8 + length + 8 + 1 + 8);
  const std::string header = bytes.substr(8, length);
  EXPECT_EQ(header.find_last_not_of(' ') + 1, header.find_last_of('}') + 1);
  const auto json = nlohmann::ordered_json::parse(header);
  std::vector<std::string> keys;
  for (const auto& [key, value] : json.items()) {
    keys.push_back(key);
  }
  EXPECT_EQ(keys, (std::vector<std::string>{"__metadata__", "z", "a", "m"}));
  EXPECT_EQ(json["z"]["dtype"], "F32");
  EXPECT_EQ(json["z"]["data_offsets"], nlohmann::ordered_json::array({0, 8}));
  EXPECT_EQ(json["a"]["data_offsets"], nlohmann::ordered_json::array({8, 9}));
  EXPECT_EQ(json["m"]["data_offsets"], nlohmann::ordered_json::array({9, 17}));
  EXPECT_EQ(json["m"]["shape"], nlohmann::ordered_json::array({1}));
  EXPECT_EQ(json["__metadata__"]["note"], "hi");
  const std::string data = bytes.substr(8 + length);
  EXPECT_EQ(data.substr(0, 8), std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8));  // LE floats
}

// ------------------------------------------------------------------------------------------------
// Writer errors: checked before the file is touched

TEST(State_Safetensors_WriteErrors, BadInputsLeaveTheOldFile) {
  const std::string dir = scratch_dir();
  const std::string path = dir + "/keep.safetensors";
  save_safetensors(path, {{"w", at::ones({2})}});
  const at::Tensor x = at::ones({2});
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                save_safetensors(path, {{"w", x}, {"w", x}});
              }),
              HasSubstr("keep.safetensors: tensor name \"w\" is given twice"));
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                save_safetensors(path, {{"c", at::ones({2}, at::kComplexFloat)}});
              }),
              HasSubstr("tensor \"c\": dtype ComplexFloat has no safetensors name"));
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                save_safetensors(path, {{"u", at::ones({2}, at::kUInt32)}});
              }),
              HasSubstr("tensor \"u\": dtype UInt32 has no safetensors name"));
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                save_safetensors(path, {{"__metadata__", x}});
              }),
              HasSubstr("\"__metadata__\" is reserved"));
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                save_safetensors(path, {{"u", at::Tensor()}});
              }),
              HasSubstr("tensor \"u\" is undefined"));
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                save_safetensors(path, {{std::string("bad\xff", 4), x}});
              }),
              HasSubstr("not valid UTF-8"));
  EXPECT_THAT(
      error_of<std::runtime_error>([&] {
        save_safetensors(dir + "/no/such/dir/x.safetensors", {{"w", x}});
      }),
      HasSubstr("no/such/dir/x.safetensors.tmp: cannot create (No such file or directory)"));
  const auto still = load_safetensors(path);
  ASSERT_EQ(still.size(), 1U);
  EXPECT_EQ(still[0].first, "w");
  EXPECT_FALSE(file_exists(path + ".tmp"));
}

// ------------------------------------------------------------------------------------------------
// Reader errors: each malformed file names the file and the tensor, never crashes

// A file of an 8-byte length, `header` padded to 8, and `data`.
std::string make_file(const std::string& dir, const std::string& name, std::string header,
                      const std::string& data, int64_t length_override = -1) {
  header.append((8 - header.size() % 8) % 8, ' ');
  const auto length = length_override >= 0 ? static_cast<uint64_t>(length_override) : header.size();
  std::string bytes;
  for (int i = 0; i < 8; ++i) {
    bytes.push_back(static_cast<char>((length >> (8U * static_cast<unsigned>(i))) & 0xFFU));
  }
  const std::string path = dir + "/" + name + ".safetensors";
  write_file(path, bytes + header + data);
  return path;
}

std::string load_error(const std::string& path) {
  const std::string error = error_of<std::runtime_error>([&] { (void)load_safetensors(path); });
  EXPECT_THAT(error, HasSubstr(path)) << "the error must name the file";
  return error;
}

TEST(State_Safetensors_Malformed, EachProblemHasItsError) {
  const std::string dir = scratch_dir();
  const std::string f32x2 = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight(8, '\0');

  write_file(dir + "/short.safetensors", "abc");
  EXPECT_THAT(load_error(dir + "/short.safetensors"),
              HasSubstr("only 3 bytes, shorter than the 8-byte header length"));
  EXPECT_THAT(load_error(make_file(dir, "past_end", "{}", eight, 1000)),
              HasSubstr("header length 1000 runs past the end of the file (24 bytes)"));
  EXPECT_THAT(load_error(make_file(dir, "bad_json", R"({"w": {"dtype": )", "")),
              HasSubstr("bad JSON header"));
  EXPECT_THAT(load_error(make_file(dir, "not_object", "[1, 2]", "")),
              HasSubstr("the JSON header is not an object"));
  EXPECT_THAT(
      load_error(make_file(dir, "duplicate", R"({"w":)" + f32x2 + R"(,"w":)" + f32x2 + "}", eight)),
      HasSubstr("tensor \"w\": appears twice in the header"));
  EXPECT_THAT(
      load_error(make_file(dir, "dtype",
                           R"({"w":{"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]}})", eight)),
      HasSubstr("tensor \"w\": unknown dtype \"F8_E4M3\" (supported: F64 F32 F16 BF16 I64 I32 I16 "
                "I8 U8 BOOL)"));
  EXPECT_THAT(load_error(make_file(dir, "no_shape", R"({"w":{"dtype":"F32","data_offsets":[0,8]}})",
                                   eight)),
              HasSubstr("tensor \"w\": its header entry has no \"shape\""));
  EXPECT_THAT(
      load_error(make_file(dir, "neg_shape",
                           R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight)),
      HasSubstr("tensor \"w\": \"shape\" [-2] has an entry that is not an integer >= 0"));
  EXPECT_THAT(
      load_error(make_file(
          dir, "huge_shape",
          R"({"w":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}})", eight)),
      HasSubstr("needs more than 2^64 bytes"));
  EXPECT_THAT(
      load_error(make_file(dir, "range",
                           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,100]}})", eight)),
      HasSubstr("tensor \"w\": \"data_offsets\" [0,100] are out of range: the data has 8 bytes"));
  EXPECT_THAT(
      load_error(make_file(dir, "neg_offset",
                           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", eight)),
      HasSubstr("tensor \"w\": \"data_offsets\" [-8,0] is not [begin, end] of integers >= 0"));
  EXPECT_THAT(
      load_error(make_file(dir, "size", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
                           eight)),
      HasSubstr(
          "tensor \"w\": shape [3] of F32 needs 12 bytes, but \"data_offsets\" [0,8] hold 8"));
  EXPECT_THAT(load_error(make_file(dir, "overlap",
                                   R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                   R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                   std::string(12, '\0'))),
              HasSubstr("tensor \"b\": its bytes [4, 12) overlap tensor \"a\" (ends at 8)"));
  EXPECT_THAT(load_error(make_file(dir, "hole",
                                   R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                   R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                                   std::string(12, '\0'))),
              HasSubstr("tensor \"b\": the data bytes [4, 8) before it belong to no tensor"));
  EXPECT_THAT(load_error(make_file(dir, "trailing", R"({"w":)" + f32x2 + "}", eight + "xx")),
              HasSubstr("the data has 10 bytes but the tensors cover only 8"));
  EXPECT_THAT(load_error(make_file(dir, "bool",
                                   R"({"w":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})",
                                   std::string("\x01\x02", 2))),
              HasSubstr("tensor \"w\": a BOOL byte is neither 0 nor 1"));
  EXPECT_THAT(load_error(make_file(dir, "meta", R"({"__metadata__":{"step":12}})", "")),
              HasSubstr("\"__metadata__\" value of \"step\" is not a string"));
  EXPECT_THAT(load_error(dir + "/missing.safetensors"),
              HasSubstr("cannot open (No such file or directory)"));

  // The metadata reader checks the whole header too.
  const std::string bad = make_file(dir, "meta_range",
                                    R"({"__metadata__":{"a":"b"},)"
                                    R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,100]}})",
                                    eight);
  EXPECT_THAT(error_of<std::runtime_error>([&] { (void)read_safetensors_metadata(bad); }),
              HasSubstr("d9d::state::read_safetensors_metadata: " + bad + ": tensor \"w\""));
  // An empty file of tensors is valid.
  EXPECT_TRUE(load_safetensors(make_file(dir, "no_tensors", "{}", "")).empty());
}

// ------------------------------------------------------------------------------------------------
// The Python `safetensors` package as an independent reader and writer

struct PythonRun {
  int status = -1;
  std::string out;
  std::string err;
};

// Runs tests/state/safetensors_check.py with D9D_PYTHON; fails the test when that is not set.
PythonRun run_check(const std::string& mode, const std::string& file) {
  const char* python = std::getenv("D9D_PYTHON");
  const char* script = std::getenv("D9D_SAFETENSORS_CHECK");
  if (python == nullptr || *python == '\0') {
    ADD_FAILURE() << "D9D_PYTHON is not set: this test needs a Python with the safetensors and "
                     "numpy packages. Run `source ~/.cache/d9d/env` and pass "
                     "--test_env=D9D_PYTHON=$D9D_PYTHON to bazel (tools/test does)";
    return {};
  }
  if (script == nullptr) {
    ADD_FAILURE() << "D9D_SAFETENSORS_CHECK is not set; run this test through Bazel";
    return {};
  }
  const std::string out = file + ".out";
  const std::string err = file + ".err";
  PythonRun run;
  run.status = std::system(("'" + std::string(python) + "' '" + script + "' " + mode + " '" + file +
                            "' >'" + out + "' 2>'" + err + "'")
                               .c_str());
  run.out = read_file(out);
  run.err = read_file(err);
  return run;
}

// Checks what safetensors_check.py read against `want`.
void expect_python_saw(const std::string& json_text, const NamedTensors& want) {
  const auto json = nlohmann::json::parse(json_text);
  const auto& tensors = json.at("tensors");
  ASSERT_EQ(tensors.size(), want.size()) << json_text;
  for (const auto& [name, tensor] : want) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(tensors.contains(name));
    const auto& seen = tensors.at(name);
    EXPECT_EQ(seen.at("dtype"), d9d::state::safetensors_dtype_name(tensor.scalar_type()));
    EXPECT_EQ(seen.at("shape").get<std::vector<int64_t>>(), tensor.sizes().vec());
    const at::Tensor flat = tensor.to(at::kDouble).contiguous().view(-1);
    const auto& values = seen.at("values");
    ASSERT_EQ(static_cast<int64_t>(values.size()), flat.numel());
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const auto& v = values[static_cast<std::size_t>(i)];
      const double got = v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>();
      EXPECT_EQ(got, flat[i].item<double>()) << "element " << i;
    }
  }
}

TEST(State_Safetensors_Python, LoadFileReadsWhatWeWrite) {
  // No BF16 here, so the script reads with safetensors.numpy.load_file.
  const std::string path = scratch_dir() + "/ours.safetensors";
  NamedTensors tensors;
  for (const auto& [name, tensor] : reference_tensors(/*with_bf16=*/false)) {
    tensors.emplace_back(name, strided_copy(tensor));
  }
  save_safetensors(path, tensors, {{"step", "7"}});
  const auto run = run_check("read", path);
  ASSERT_EQ(run.status, 0) << run.err;
  expect_python_saw(run.out, tensors);
  EXPECT_EQ(nlohmann::json::parse(run.out).at("metadata"), nlohmann::json({{"step", "7"}}));
}

TEST(State_Safetensors_Python, Bf16BitsReadBackThroughDeserialize) {
  // numpy has no bfloat16: the script takes the raw bytes from safetensors.deserialize.
  const std::string path = scratch_dir() + "/bf16.safetensors";
  const NamedTensors tensors = reference_tensors(/*with_bf16=*/true);
  save_safetensors(path, tensors);
  const auto run = run_check("read", path);
  ASSERT_EQ(run.status, 0) << run.err;
  expect_python_saw(run.out, tensors);
  EXPECT_EQ(nlohmann::json::parse(run.out).at("tensors").at("bf16").at("values"),
            nlohmann::json::array({1.0, -2.0, 0.5, 3.0}));
}

TEST(State_Safetensors_Python, WeReadWhatThePackageWrites) {
  const std::string path = scratch_dir() + "/theirs.safetensors";
  const auto run = run_check("write", path);
  ASSERT_EQ(run.status, 0) << run.err;
  const auto loaded = load_safetensors(path);
  std::map<std::string, at::Tensor> by_name(loaded.begin(), loaded.end());
  const auto want = reference_tensors();
  ASSERT_EQ(by_name.size(), want.size());
  for (const auto& [name, tensor] : want) {
    ASSERT_EQ(by_name.count(name), 1U) << name;
    expect_same(by_name.at(name), tensor, name);
  }
  EXPECT_EQ(read_safetensors_metadata(path),
            (std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}));
}

}  // namespace
