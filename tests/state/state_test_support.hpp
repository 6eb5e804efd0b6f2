// Helpers shared by the d9d::state tests: scratch directories, whole-file I/O, the reference
// tensors (the same values as reference() in safetensors_check.py) and the Python checker.
//
//   const std::string dir = d9d::testing::state::scratch_dir();
//   auto run = d9d::testing::state::run_check("read", dir + "/x.safetensors");  // {status, out}
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <d9d/state/safetensors.hpp>

#include "tests/support/read_file.hpp"

namespace d9d::testing::state {

inline std::string scratch_dir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/d9d_state_XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw std::runtime_error("mkdtemp failed under " + pattern);
  }
  return pattern;
}

using d9d::testing::read_file;

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline bool file_exists(const std::string& path) { return std::ifstream(path).good(); }

/// This process's resident memory in bytes, mapped file pages included: the "Rss:" line of
/// /proc/self/smaps_rollup, which the kernel computes by walking the page tables when the file is
/// read. (/proc/self/statm reads the per-process counters, which newer kernels keep per CPU and
/// sum approximately: seen 384 KiB for 8 MiB just mapped in, so tests must not use it.)
inline int64_t resident_bytes() {
  std::ifstream rollup("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(rollup, line)) {
    if (line.rfind("Rss:", 0) == 0) {
      return std::stoll(line.substr(4)) * 1024;  // "Rss:   1234 kB"
    }
  }
  ADD_FAILURE() << "no Rss line in /proc/self/smaps_rollup";
  return 0;
}

/// A tensor of `dtype` and `shape` holding exactly `bytes` (little-endian element bytes).
inline at::Tensor from_bytes(const std::vector<uint8_t>& bytes, at::ScalarType dtype,
                             at::IntArrayRef shape) {
  at::Tensor t = at::empty(shape, dtype);
  EXPECT_EQ(t.nbytes(), bytes.size());
  std::memcpy(t.mutable_data_ptr(), bytes.data(), bytes.size());
  return t;
}

/// The bytes of `t` in row-major order.
inline std::string bytes_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  if (c.nbytes() == 0) {
    return {};
  }
  return {static_cast<const char*>(c.const_data_ptr()), c.nbytes()};
}

inline std::string hex_of(const at::Tensor& t) {
  std::string hex;
  for (const char c : bytes_of(t)) {
    constexpr const char* kDigits = "0123456789abcdef";
    hex += kDigits[(static_cast<unsigned char>(c) >> 4U) & 0xFU];
    hex += kDigits[static_cast<unsigned char>(c) & 0xFU];
  }
  return hex;
}

/// One tensor of every supported dtype, plus a scalar and an empty tensor.
inline d9d::state::NamedTensors reference_tensors() {
  d9d::state::NamedTensors t;
  t.emplace_back("f32", at::arange(6, at::kFloat).reshape({2, 3}) - 2.5);
  t.emplace_back("f64", at::arange(4, at::kDouble) * 0.125);
  t.emplace_back("f16", (at::arange(6, at::kFloat) * 0.25).to(at::kHalf).reshape({3, 2}));
  t.emplace_back("bf16", at::tensor({1.0F, -2.0F, 0.5F, 3.0F}).to(at::kBFloat16).reshape({2, 2}));
  t.emplace_back("i64", at::tensor({int64_t{-3}, int64_t{1} << 40, int64_t{7}}, at::kLong));
  t.emplace_back("i32", at::tensor({-1, 2, 3, -4}, at::kInt).reshape({2, 2}));
  t.emplace_back("i16", at::tensor({-300, 300}, at::kShort));
  t.emplace_back("i8", at::tensor({-128, 127, 0}, at::kChar));
  t.emplace_back("u8", at::tensor({0, 255, 17}, at::kByte));
  t.emplace_back("bool", at::tensor({1, 0, 1}, at::kByte).to(at::kBool));
  t.emplace_back("f8_e4m3", from_bytes({0x38, 0xC0, 0x00, 0x7E}, at::kFloat8_e4m3fn, {2, 2}));
  t.emplace_back("f8_e5m2", from_bytes({0x3C, 0xC0, 0x7B}, at::kFloat8_e5m2, {3}));
  t.emplace_back("f8_e8m0", from_bytes({0x7F, 0x80, 0x00}, at::kFloat8_e8m0fnu, {3}));
  t.emplace_back("u16", from_bytes({0, 0, 0xFF, 0xFF, 0x2C, 0x01}, at::kUInt16, {3}));
  t.emplace_back("u32", from_bytes({0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0x70, 0x11, 0x01, 0x00},
                                   at::kUInt32, {3}));
  t.emplace_back("u64", from_bytes({0,    0,    0,    0,    0,    0,    0,    0,     // 0
                                    0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,  // 2^64 - 1
                                    0,    0,    0,    0,    0,    0x01, 0,    0},    // 2^40
                                   at::kUInt64, {3}));
  t.emplace_back("c64", at::view_as_complex(at::tensor({1.0F, -2.0F, 0.5F, 3.0F}).reshape({2, 2})));
  t.emplace_back("scalar", at::scalar_tensor(42.0, at::kFloat));
  t.emplace_back("empty", at::zeros({0, 3}, at::kFloat));
  return t;
}

/// The same values, laid out with every other element skipped (not contiguous).
inline at::Tensor strided_copy(const at::Tensor& t) {
  std::vector<int64_t> shape = t.sizes().vec();
  shape.push_back(2);
  at::Tensor wide = at::zeros(shape, t.options());
  at::Tensor strided = wide.select(-1, 0);
  strided.copy_(t);
  return strided;
}

/// Same dtype, shape and bytes; contiguous.
inline void expect_same(const at::Tensor& got, const at::Tensor& want, const std::string& name) {
  EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
  EXPECT_EQ(got.sizes(), want.sizes()) << name;
  EXPECT_TRUE(got.is_contiguous()) << name;
  EXPECT_EQ(hex_of(got), hex_of(want)) << name;
}

struct PythonRun {
  int status = -1;
  std::string out;
  std::string err;
};

/// Runs tests/state/safetensors_check.py with D9D_PYTHON; fails the test when that is not set.
inline PythonRun run_check(const std::string& mode, const std::string& file) {
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
  std::remove(out.c_str());
  std::remove(err.c_str());
  return run;
}

/// Checks what safetensors_check.py read ({name: {dtype, shape, values, hex}}) against `want`.
inline void expect_python_saw(const nlohmann::json& tensors, const d9d::state::NamedTensors& want) {
  ASSERT_EQ(tensors.size(), want.size()) << tensors.dump();
  for (const auto& [name, tensor] : want) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(tensors.contains(name));
    const auto& seen = tensors.at(name);
    EXPECT_EQ(seen.at("dtype"), d9d::state::safetensors_dtype_name(tensor.scalar_type()));
    EXPECT_EQ(seen.at("shape").get<std::vector<int64_t>>(), tensor.sizes().vec());
    EXPECT_EQ(seen.at("hex"), hex_of(tensor));
    const auto& values = seen.at("values");
    if (values.is_null() || tensor.is_complex()) {
      continue;  // float8 (numpy has none) and complex: the bytes above are the check
    }
    const at::Tensor flat = tensor.to(at::kDouble).contiguous().view(-1);
    ASSERT_EQ(static_cast<int64_t>(values.size()), flat.numel());
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const auto& v = values[static_cast<std::size_t>(i)];
      const double got = v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>();
      EXPECT_EQ(got, flat[i].item<double>()) << "element " << i;
    }
  }
}

}  // namespace d9d::testing::state
