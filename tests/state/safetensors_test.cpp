// Tests of d9d/state/safetensors.hpp: round trips of every dtype, the byte layout, the mapped
// reader (entries, copies, zero-copy views), malformed files and their errors, and the Python
// `safetensors` package as an independent reader and writer.
#include <cstdint>
#include <cstdio>
#include <fcntl.h>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>

#include "tests/state/state_test_support.hpp"
#include "tests/support/error_of.hpp"

namespace {

using d9d::testing::error_of;
using d9d::testing::state::expect_python_saw;
using d9d::testing::state::expect_same;
using d9d::testing::state::file_exists;
using d9d::testing::state::read_file;
using d9d::testing::state::reference_tensors;
using d9d::testing::state::resident_bytes;
using d9d::testing::state::run_check;
using d9d::testing::state::scratch_dir;
using d9d::testing::state::strided_copy;
using d9d::testing::state::write_file;

using d9d::state::load_safetensors;
using d9d::state::NamedTensors;
using d9d::state::read_safetensors_metadata;
using d9d::state::SafetensorsFile;
using d9d::state::SafetensorsWriter;
using d9d::state::save_safetensors;
using ::testing::HasSubstr;

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

TEST(State_Safetensors_AllDtypes, NamesOfTheFormat) {
  const std::vector<std::pair<at::ScalarType, std::string>> names = {
      {at::kDouble, "F64"},
      {at::kFloat, "F32"},
      {at::kHalf, "F16"},
      {at::kBFloat16, "BF16"},
      {at::kLong, "I64"},
      {at::kInt, "I32"},
      {at::kShort, "I16"},
      {at::kChar, "I8"},
      {at::kByte, "U8"},
      {at::kBool, "BOOL"},
      {at::kFloat8_e4m3fn, "F8_E4M3"},
      {at::kFloat8_e5m2, "F8_E5M2"},
      {at::kFloat8_e8m0fnu, "F8_E8M0"},
      {at::kUInt16, "U16"},
      {at::kUInt32, "U32"},
      {at::kUInt64, "U64"},
      {at::kComplexFloat, "C64"},
  };
  for (const auto& [dtype, name] : names) {
    EXPECT_EQ(d9d::state::safetensors_dtype_name(dtype), name);
  }
  EXPECT_THAT(error_of<std::invalid_argument>(
                  [] { (void)d9d::state::safetensors_dtype_name(at::kComplexDouble); }),
              HasSubstr("dtype ComplexDouble has no safetensors name here (supported: F64 F32"));
}

TEST(State_Safetensors_NonContiguous, StridedTransposedAndConjugatedInputsAreWrittenByValue) {
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
  const at::Tensor complex =
      at::view_as_complex(at::tensor({1.0F, 2.0F, 3.0F, -4.0F}).view({2, 2}));
  strided.emplace_back("conj", complex.conj());  // a lazy conjugate bit, not conjugated values
  save_safetensors(path, strided);
  const auto loaded = load_safetensors(path);
  ASSERT_EQ(loaded.size(), strided.size());
  for (std::size_t i = 0; i + 1 < strided.size(); ++i) {
    expect_same(loaded[i].second, strided[i].second.contiguous(), strided[i].first);
  }
  EXPECT_TRUE(at::equal(at::view_as_real(loaded.back().second),
                        at::tensor({1.0F, -2.0F, 3.0F, 4.0F}).view({2, 2})));
  EXPECT_TRUE(read_safetensors_metadata(path).empty());
}

TEST(State_Safetensors_Layout, HeaderIsPaddedJsonAndDataFollowsInTheOrderGiven) {
  const std::string path = scratch_dir() + "/layout.safetensors";
  const NamedTensors tensors = {{"z", at::tensor({1.0F, 2.0F})},
                                {"a", at::tensor({3}, at::kByte)},
                                {"m", at::tensor({int64_t{4}})}};
  save_safetensors(path, tensors, {{"note", "hi"}});
  const std::string bytes = read_file(path);
  EXPECT_EQ(d9d::state::serialize_safetensors(tensors, {{"note", "hi"}}), bytes);
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
// The mapped reader: entries, lazy copies, zero-copy views

TEST(State_SafetensorsFile_Mapped, ListsEntriesAndCopiesOnlyWhatIsAsked) {
  const std::string path = scratch_dir() + "/lazy.safetensors";
  save_safetensors(path,
                   {{"w", at::arange(6, at::kFloat).reshape({2, 3})},
                    {"flags", at::tensor({1, 0}, at::kByte).to(at::kBool)},
                    {"b", at::tensor({int64_t{7}})}},
                   {{"k", "v"}});
  // Corrupt one BOOL byte: the header stays valid, so only materialising "flags" fails.
  std::string bytes = read_file(path);
  bytes[bytes.size() - 9] = '\x05';
  write_file(path, bytes);

  const SafetensorsFile file(path);
  EXPECT_EQ(file.path(), path);
  EXPECT_EQ(file.size(), bytes.size());
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"k", "v"}}));
  ASSERT_EQ(file.entries().size(), 3U);
  EXPECT_EQ(file.entries()[1].name, "flags");
  EXPECT_EQ(file.entries()[1].dtype, at::kBool);
  EXPECT_EQ(file.entries()[1].shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(file.entries()[1].begin, 24U);
  EXPECT_EQ(file.entries()[1].end, 26U);
  EXPECT_EQ(file.entries()[1].nbytes(), 2U);
  EXPECT_EQ(file.data_offset() + 34, file.size());
  EXPECT_TRUE(file.contains("b"));
  EXPECT_FALSE(file.contains("x"));
  EXPECT_EQ(file.entry("b").end, 34U);

  expect_same(file.tensor("w"), at::arange(6, at::kFloat).reshape({2, 3}), "w");
  expect_same(file.tensor("b"), at::tensor({int64_t{7}}), "b");
  EXPECT_THAT(error_of<std::runtime_error>([&] { (void)file.tensor("flags"); }),
              HasSubstr("d9d::state::SafetensorsFile: " + path +
                        ": tensor \"flags\": a BOOL byte is neither 0 nor 1"));
  EXPECT_THAT(error_of<std::runtime_error>([&] { (void)file.view("flags"); }),
              HasSubstr("tensor \"flags\": a BOOL byte is neither 0 nor 1"));
  EXPECT_THAT(error_of<std::out_of_range>([&] { (void)file.tensor("x"); }),
              HasSubstr(path + ": no tensor \"x\" (the file has 3: \"w\", \"flags\", \"b\")"));
  EXPECT_THAT(error_of<std::out_of_range>([&] { (void)file.entry("x"); }),
              HasSubstr("no tensor \"x\""));
  // Copies are owned: changing one changes nothing else.
  at::Tensor w = file.tensor("w");
  w.fill_(-1);
  expect_same(file.tensor("w"), at::arange(6, at::kFloat).reshape({2, 3}), "w again");
}

TEST(State_SafetensorsFile_View, SharesTheMappingOutlivesTheFileAndNeverWritesIt) {
  const std::string path = scratch_dir() + "/view.safetensors";
  const at::Tensor want = at::arange(1024, at::kFloat).reshape({32, 32});
  save_safetensors(path, {{"w", want}, {"v", at::arange(5, at::kDouble)}});
  const std::string before = read_file(path);
  at::Tensor view;
  at::Tensor copy;
  {
    const SafetensorsFile file(path);
    view = file.view("w");
    EXPECT_EQ(view.const_data_ptr(), file.view("w").const_data_ptr()) << "zero-copy";
    copy = file.tensor("w");
  }  // the file object is gone; the view keeps the mapping
  expect_same(view, want, "view");
  view.mul_(2);  // private copy-on-write pages
  expect_same(view, want * 2, "written view");
  expect_same(copy, want, "copy");
  EXPECT_EQ(read_file(path), before) << "a view must never write to the file";
  expect_same(SafetensorsFile(path).tensor("w"), want, "reopened");
}

TEST(State_SafetensorsFile_View, WritesToAViewSurviveLaterCopiesOfOtherTensors) {
  // Copies drop the pages they read; pages of a viewed tensor must be kept.
  const std::string path = scratch_dir() + "/view_pages.safetensors";
  const at::Tensor big = at::arange(1 << 20, at::kFloat);  // 4 MiB: whole pages
  save_safetensors(path, {{"a", big}, {"b", big + 1}});
  const SafetensorsFile file(path);
  at::Tensor view = file.view("a");
  view.fill_(3);
  (void)file.tensor("a");  // copies "a" (sees the private writes) and must not drop its pages
  (void)file.tensor("b");
  EXPECT_TRUE(at::equal(view, at::full_like(big, 3)));
  EXPECT_TRUE(at::equal(file.tensor("a"), at::full_like(big, 3)));
}

TEST(State_SafetensorsFile_Release, DropsTheMappedPagesOfATensorWithoutLiveViews) {
  const std::string path = scratch_dir() + "/release.safetensors";
  const at::Tensor big = at::ones({8 << 20}, at::kByte);  // 8 MiB
  save_safetensors(path, {{"a", big}, {"b", at::full({16}, 2, at::kByte)}});
  const SafetensorsFile file(path);
  const int64_t before = resident_bytes();
  {
    at::Tensor view = file.view("a");
    EXPECT_EQ(view.sum().item<int64_t>(), 8 << 20);  // every page mapped in
    EXPECT_GT(resident_bytes() - before, 6 << 20);
    EXPECT_FALSE(file.release("a")) << "a view of it is alive";
  }
  EXPECT_TRUE(file.release("a"));
  EXPECT_LT(resident_bytes() - before, 2 << 20);
  EXPECT_TRUE(at::equal(file.view("a"), big)) << "mapped from the file again";
  EXPECT_TRUE(file.release("b"));  // smaller than a page: nothing to drop, nothing wrong
  EXPECT_FALSE(SafetensorsFile::from_bytes(read_file(path)).release("a")) << "not mapped";
  EXPECT_THROW((void)file.release("c"), std::out_of_range);
}

TEST(State_SafetensorsFile_View, MisalignedDataFallsBackToACopy) {
  const std::string path = scratch_dir() + "/misaligned.safetensors";
  save_safetensors(path, {{"u", at::tensor({1}, at::kByte)}, {"w", at::tensor({1.5F, 2.5F})}});
  const SafetensorsFile file(path);
  EXPECT_EQ(file.entry("w").begin, 1U);  // not a multiple of 4
  const at::Tensor a = file.view("w");
  const at::Tensor b = file.view("w");
  EXPECT_NE(a.const_data_ptr(), b.const_data_ptr()) << "two copies";
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.const_data_ptr()) % 4, 0U);
  expect_same(a, at::tensor({1.5F, 2.5F}), "w");
  expect_same(file.view("u"), at::tensor({1}, at::kByte), "u");
}

TEST(State_SafetensorsWriter, StreamsTheSameFileAsSaveSafetensors) {
  const std::string dir = scratch_dir();
  const NamedTensors tensors = {{"w", at::arange(6, at::kFloat).view({2, 3})},
                                {"e", at::empty({0, 4}, at::kBFloat16)},
                                {"i", at::tensor({7, 8}, at::kLong)}};
  save_safetensors(dir + "/whole.safetensors", tensors, {{"format", "pt"}});
  {
    SafetensorsWriter out(dir + "/streamed.safetensors",
                          {{.name = "w", .dtype = at::kFloat, .shape = {2, 3}},
                           {.name = "e", .dtype = at::kBFloat16, .shape = {0, 4}},
                           {.name = "i", .dtype = at::kLong, .shape = {2}}},
                          {{"format", "pt"}});
    for (const auto& [name, tensor] : tensors) {
      out.write(name, tensor.t().contiguous().t());  // any layout; written contiguous
    }
    out.commit();
  }
  EXPECT_EQ(read_file(dir + "/streamed.safetensors"), read_file(dir + "/whole.safetensors"));
}

TEST(State_SafetensorsWriter, WrongOrderShapeOrCountIsAnErrorAndLeavesNoFile) {
  const std::string path = scratch_dir() + "/bad_stream.safetensors";
  const auto two = [&] {
    return std::make_unique<SafetensorsWriter>(
        path, std::vector<d9d::state::SafetensorsEntry>{
                  {.name = "a", .dtype = at::kFloat, .shape = {2}},
                  {.name = "b", .dtype = at::kFloat, .shape = {3}}});
  };
  {
    auto out = two();
    EXPECT_THAT(error_of<std::logic_error>([&] { out->write("b", at::ones({3})); }),
                HasSubstr("tensors go in the order given; expected \"a\", got \"b\""));
    EXPECT_THAT(error_of<std::invalid_argument>([&] { out->write("a", at::ones({3})); }),
                HasSubstr("tensor \"a\" must be F32 of shape [2], got F32 of shape [3]"));
    out->write("a", at::ones({2}));
    EXPECT_THAT(error_of<std::logic_error>([&] { out->commit(); }),
                HasSubstr("1 tensor(s) not written yet, the next is \"b\""));
  }
  EXPECT_FALSE(d9d::files::exists(path));
  EXPECT_FALSE(d9d::files::exists(path + ".tmp")) << "the temporary file is removed";
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                SafetensorsWriter out(path, {{.name = "x", .dtype = at::kFloat, .shape = {1}},
                                             {.name = "x", .dtype = at::kFloat, .shape = {1}}});
              }),
              HasSubstr("tensor name \"x\" is given twice"));
}

TEST(State_SafetensorsFile_Memory, FromBytesReadsTheSameAsTheFile) {
  const std::string path = scratch_dir() + "/memory.safetensors";
  save_safetensors(path, reference_tensors(), {{"a", "b"}});
  const auto file = SafetensorsFile(path);
  const auto memory = SafetensorsFile::from_bytes(read_file(path), "image");
  EXPECT_EQ(memory.path(), "image");
  EXPECT_EQ(memory.metadata(), file.metadata());
  ASSERT_EQ(memory.entries().size(), file.entries().size());
  for (const auto& entry : file.entries()) {
    expect_same(memory.tensor(entry.name), file.tensor(entry.name), entry.name);
    expect_same(memory.view(entry.name), file.tensor(entry.name), entry.name + " view");
  }
  EXPECT_THAT(error_of<std::runtime_error>([] { (void)SafetensorsFile::from_bytes("abc", "x"); }),
              HasSubstr("d9d::state::SafetensorsFile: x: only 3 bytes"));
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
                save_safetensors(path, {{"c", at::ones({2}, at::kComplexDouble)}});
              }),
              HasSubstr("tensor \"c\": dtype ComplexDouble has no safetensors name"));
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                save_safetensors(path, {{"q", at::ones({2}).to(at::kFloat8_e4m3fnuz)}});
              }),
              HasSubstr("tensor \"q\": dtype Float8_e4m3fnuz has no safetensors name"));
  EXPECT_THAT(error_of<std::invalid_argument>([&] {
                save_safetensors(path, {{"s", at::ones({2}).to_sparse()}});
              }),
              HasSubstr("tensor \"s\" is not strided (layout Sparse)"));
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
  EXPECT_THAT(error, HasSubstr("d9d::state::load_safetensors: " + path + ": "))
      << "the error must name the reader and the file";
  return error;
}

std::string entry_json(const std::string& dtype, const std::string& shape,
                       const std::string& offsets) {
  return R"({"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}";
}

TEST(State_Safetensors_Malformed, EachProblemHasItsError) {
  const std::string dir = scratch_dir();
  const std::string f32x2 = entry_json("F32", "[2]", "[0,8]");
  const std::string eight(8, '\0');
  const auto one = [&](const std::string& name, const std::string& tensor_entry,
                       const std::string& data) {
    return load_error(make_file(dir, name, R"({"w":)" + tensor_entry + "}", data));
  };

  write_file(dir + "/short.safetensors", "abc");
  EXPECT_THAT(load_error(dir + "/short.safetensors"),
              HasSubstr("only 3 bytes, shorter than the 8-byte header length"));
  EXPECT_THAT(load_error(make_file(dir, "past_end", "{}", eight, 1000)),
              HasSubstr("header length 1000 runs past the end of the file (24 bytes)"));
  EXPECT_THAT(load_error(make_file(dir, "past_end_huge", "{}", eight, INT64_MAX)),
              HasSubstr("header length 9223372036854775807 runs past the end of the file"));
  EXPECT_THAT(load_error(make_file(dir, "bad_json", R"({"w": {"dtype": )", "")),
              HasSubstr("header: bad JSON ("));
  EXPECT_THAT(load_error(make_file(dir, "trailing_json", R"({} {})", "")),
              HasSubstr("header: bad JSON ("));
  EXPECT_THAT(load_error(make_file(dir, "not_object", "[1, 2]", "")),
              HasSubstr("the JSON header is not an object"));
  EXPECT_THAT(
      load_error(make_file(dir, "duplicate", R"({"w":)" + f32x2 + R"(,"w":)" + f32x2 + "}", eight)),
      HasSubstr(": tensor \"w\": appears twice in the JSON object"));
  EXPECT_THAT(one("duplicate_field",
                  R"({"dtype":"F32","dtype":"F64","shape":[2],"data_offsets":[0,8]})", eight),
              HasSubstr(": tensor \"w\": key \"dtype\" appears twice in its JSON object"));
  EXPECT_THAT(
      load_error(make_file(dir, "duplicate_meta", R"({"__metadata__":{"a":"1","a":"2"}})", "")),
      HasSubstr(": \"__metadata__\": key \"a\" appears twice"));
  EXPECT_THAT(one("deep", entry_json("F32", "[[2]]", "[0,8]"), eight),
              HasSubstr(": tensor \"w\": nested deeper than the 3 levels this format has"));
  EXPECT_THAT(load_error(make_file(dir, "utf8", "{\"w\xff\":" + f32x2 + "}", eight)),
              HasSubstr("header: not valid UTF-8: byte 0xff at offset 3, after \"{\"w\""));
  EXPECT_THAT(load_error(make_file(dir, "surrogate", "{\"w\xed\xa0\x80\":" + f32x2 + "}", eight)),
              HasSubstr("not valid UTF-8: byte 0xed at offset 3"));
  EXPECT_THAT(load_error(make_file(dir, "overlong", "{\"w\xc0\xaf\":" + f32x2 + "}", eight)),
              HasSubstr("not valid UTF-8: byte 0xc0 at offset 3"));
  EXPECT_THAT(one("dtype", entry_json("F128", "[8]", "[0,8]"), eight),
              HasSubstr("tensor \"w\": unknown dtype \"F128\" (supported: F64 F32 F16 BF16 I64 I32 "
                        "I16 I8 U8 BOOL F8_E4M3 F8_E5M2 F8_E8M0 U16 U32 U64 C64)"));
  EXPECT_THAT(one("dtype_number", R"({"dtype":7,"shape":[8],"data_offsets":[0,8]})", eight),
              HasSubstr("tensor \"w\": unknown dtype 7 ("));
  EXPECT_THAT(one("sub_byte", entry_json("F4", "[16]", "[0,8]"), eight),
              HasSubstr("tensor \"w\": dtype \"F4\" packs several elements per byte; LibTorch has "
                        "no such type"));
  EXPECT_THAT(one("no_shape", R"({"dtype":"F32","data_offsets":[0,8]})", eight),
              HasSubstr("tensor \"w\": its header entry has no \"shape\""));
  EXPECT_THAT(one("entry_type", "[1]", eight),
              HasSubstr("tensor \"w\": its header entry is not an object"));
  EXPECT_THAT(one("shape_type", entry_json("F32", "2", "[0,8]"), eight),
              HasSubstr("tensor \"w\": \"shape\" 2 is not an array"));
  EXPECT_THAT(one("neg_shape", entry_json("F32", "[-2]", "[0,8]"), eight),
              HasSubstr("tensor \"w\": \"shape\" [-2] has an entry that is not an integer in "
                        "[0, 2^63)"));
  EXPECT_THAT(one("float_shape", entry_json("F32", "[2.0]", "[0,8]"), eight),
              HasSubstr("\"shape\" [2.0] has an entry that is not an integer"));
  EXPECT_THAT(one("big_dim", entry_json("U8", "[9223372036854775808]", "[0,8]"), eight),
              HasSubstr("has an entry that is not an integer in [0, 2^63)"));
  EXPECT_THAT(one("huge_shape", entry_json("F32", "[4611686018427387904,8]", "[0,8]"), eight),
              HasSubstr("\"shape\" [4611686018427387904,8] is too large: the product of its "
                        "dimensions passes 2^63"));
  // Zero elements, but LibTorch's strides would overflow: refused too.
  EXPECT_THAT(one("zero_huge", entry_json("U8", "[0,4294967296,4294967296]", "[0,0]"), ""),
              HasSubstr("is too large: the product of its dimensions passes 2^63"));
  EXPECT_THAT(one("bytes_overflow", entry_json("F64", "[2305843009213693952,2]", "[0,8]"), eight),
              HasSubstr("needs more than 2^64 bytes"));
  EXPECT_THAT(one("range", entry_json("F32", "[2]", "[0,100]"), eight),
              HasSubstr("tensor \"w\": \"data_offsets\" [0,100] are out of range: the data has 8 "
                        "bytes"));
  EXPECT_THAT(one("reversed", entry_json("F32", "[2]", "[8,0]"), eight),
              HasSubstr("tensor \"w\": \"data_offsets\" [8,0] are out of range"));
  EXPECT_THAT(one("neg_offset", entry_json("F32", "[2]", "[-8,0]"), eight),
              HasSubstr("tensor \"w\": \"data_offsets\" [-8,0] is not [begin, end] of integers "
                        ">= 0"));
  EXPECT_THAT(one("three_offsets", entry_json("F32", "[2]", "[0,4,8]"), eight),
              HasSubstr("\"data_offsets\" [0,4,8] is not [begin, end]"));
  EXPECT_THAT(one("size", entry_json("F32", "[3]", "[0,8]"), eight),
              HasSubstr("tensor \"w\": shape [3] of F32 needs 12 bytes, but \"data_offsets\" "
                        "[0,8] hold 8"));
  EXPECT_THAT(load_error(make_file(dir, "overlap",
                                   R"({"a":)" + entry_json("F32", "[2]", "[0,8]") + R"(,"b":)" +
                                       entry_json("F32", "[2]", "[4,12]") + "}",
                                   std::string(12, '\0'))),
              HasSubstr("tensor \"b\": its bytes [4, 12) overlap tensor \"a\" (ends at 8)"));
  EXPECT_THAT(load_error(make_file(dir, "hole",
                                   R"({"a":)" + entry_json("F32", "[1]", "[0,4]") + R"(,"b":)" +
                                       entry_json("F32", "[1]", "[8,12]") + "}",
                                   std::string(12, '\0'))),
              HasSubstr("tensor \"b\": the data bytes [4, 8) before it belong to no tensor"));
  EXPECT_THAT(load_error(make_file(dir, "trailing", R"({"w":)" + f32x2 + "}", eight + "xx")),
              HasSubstr("the data has 10 bytes but the tensors cover only 8"));
  EXPECT_THAT(one("bool", entry_json("BOOL", "[2]", "[0,2]"), std::string("\x01\x02", 2)),
              HasSubstr("tensor \"w\": a BOOL byte is neither 0 nor 1"));
  EXPECT_THAT(load_error(make_file(dir, "meta", R"({"__metadata__":{"step":12}})", "")),
              HasSubstr("\"__metadata__\" value of \"step\" is not a string but 12"));
  EXPECT_THAT(load_error(make_file(dir, "meta_type", R"({"__metadata__":["a"]})", "")),
              HasSubstr("\"__metadata__\" is not an object"));
  EXPECT_THAT(load_error(dir + "/missing.safetensors"),
              HasSubstr("cannot open (No such file or directory)"));
  EXPECT_THAT(load_error(dir), HasSubstr("not a regular file"));

  // The metadata reader checks the whole header too.
  const std::string bad = make_file(
      dir, "meta_range",
      R"({"__metadata__":{"a":"b"},"w":)" + entry_json("F32", "[2]", "[0,100]") + "}", eight);
  EXPECT_THAT(error_of<std::runtime_error>([&] { (void)read_safetensors_metadata(bad); }),
              HasSubstr("d9d::state::read_safetensors_metadata: " + bad + ": tensor \"w\""));
  // Names are printed safely: control bytes are escaped.
  EXPECT_THAT(load_error(make_file(dir, "escaped",
                                   R"({"a\nb":)" + entry_json("F9", "[2]", "[0,8]") + "}", eight)),
              HasSubstr("tensor \"a\\x0ab\": unknown dtype"));
  // An empty file of tensors is valid, as are zero-size tensors anywhere.
  EXPECT_TRUE(load_safetensors(make_file(dir, "no_tensors", "{}", "")).empty());
  EXPECT_EQ(
      load_safetensors(make_file(dir, "zero_sizes",
                                 R"({"e":)" + entry_json("F32", "[0,4]", "[8,8]") + R"(,"w":)" +
                                     f32x2 + R"(,"s":)" + entry_json("U8", "[0]", "[0,0]") + "}",
                                 eight))
          .size(),
      3U);
}

TEST(State_Safetensors_Malformed, HeaderLengthOverTheLimitIsRefusedBeforeReadingIt) {
  // A sparse file: a header length of 100,000,001 inside a file that long, of zeros.
  const std::string path = scratch_dir() + "/huge_header.safetensors";
  const uint64_t length = d9d::state::kSafetensorsMaxHeaderBytes + 1;
  std::string bytes;
  for (int i = 0; i < 8; ++i) {
    bytes.push_back(static_cast<char>((length >> (8U * static_cast<unsigned>(i))) & 0xFFU));
  }
  write_file(path, bytes);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(8 + length)), 0);
  EXPECT_THAT(load_error(path),
              HasSubstr("header length 100000001 is over the limit of 100000000 bytes"));
}

// ------------------------------------------------------------------------------------------------
// The Python `safetensors` package as an independent reader and writer

TEST(State_Safetensors_Python, PackageReadsWhatWeWrite) {
  const std::string path = scratch_dir() + "/ours.safetensors";
  NamedTensors tensors;
  for (const auto& [name, tensor] : reference_tensors()) {
    tensors.emplace_back(name, strided_copy(tensor));
  }
  save_safetensors(path, tensors, {{"step", "7"}});
  const auto run = run_check("read", path);
  ASSERT_EQ(run.status, 0) << run.err;
  const auto json = nlohmann::json::parse(run.out);
  expect_python_saw(json.at("tensors"), tensors);
  EXPECT_EQ(json.at("metadata"), nlohmann::json({{"step", "7"}}));
  std::vector<std::string> order;
  for (const auto& [name, tensor] : tensors) {
    order.push_back(name);
  }
  EXPECT_EQ(json.at("order").get<std::vector<std::string>>(), order);
  EXPECT_EQ(json.at("tensors").at("bf16").at("values"),
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
