// Helpers of the tests against Hugging Face transformers (tests/hf): where the committed fixtures
// are, a tensor of a loaded safetensors file by name, and hf_check.py's run on an export.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>

#include "tests/support/subprocess.hpp"

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

/// hf_check.py (D9D_HF_CHECK) and the Python with transformers that runs it (D9D_HF_PYTHON).
struct HfCheck {
  std::string python;
  std::string script;
};

/// The check from the environment, or nullopt and a test failure when a variable is not set.
inline std::optional<HfCheck> hf_check() {
  const char* python = std::getenv("D9D_HF_PYTHON");
  const char* script = std::getenv("D9D_HF_CHECK");
  if (python == nullptr || script == nullptr) {
    ADD_FAILURE() << "D9D_HF_PYTHON and D9D_HF_CHECK must be set (tools/test passes them; "
                     "tools/setup installs transformers)";
    return std::nullopt;
  }
  return HfCheck{.python = python, .script = script};
}

/// Runs the check on our export `dir` against the logits saved in `reference` (stdout and stderr).
inline d9d::testing::CommandRun run_hf_check(const HfCheck& check, const std::string& dir,
                                             const std::string& reference) {
  return d9d::testing::run_command("'" + check.python + "' '" + check.script + "' '" + dir + "' '" +
                                   reference + "' 2>&1");
}

}  // namespace hf_test
