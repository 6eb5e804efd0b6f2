// Helpers of the tests against Hugging Face transformers (tests/hf): where the committed fixtures
// are, and a tensor of a loaded safetensors file by name.
#pragma once

#include <cstdlib>
#include <string>

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>

namespace hf_test {

/// The fixture directory `name` (D9D_HF_FIXTURES, else tests/hf/fixtures).
inline std::string fixture(const std::string& name) {
  const char* dir = std::getenv("D9D_HF_FIXTURES");
  return d9d::files::join(dir != nullptr ? dir : "tests/hf/fixtures", name);
}

/// The tensor called `name` in `tensors`; a test failure (and an undefined tensor) when none is.
inline at::Tensor named(const d9d::state::NamedTensors& tensors, const std::string& name) {
  for (const auto& [key, tensor] : tensors) {
    if (key == name) {
      return tensor;
    }
  }
  ADD_FAILURE() << "no tensor " << name;
  return {};
}

}  // namespace hf_test
