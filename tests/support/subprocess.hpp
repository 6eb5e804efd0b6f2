// Test helper: runs a shell command and captures what it prints, for the tests that check a
// Python reference (transformers, peft, tensorboard, safetensors) or one of the tools.
//
//   const auto run = d9d::testing::run_command(d9d::testing::shell_quote(python) + " check.py
//   2>&1"); EXPECT_EQ(run.status, 0) << run.command << "\n" << run.output;
#pragma once

#include <array>
#include <cstdio>
#include <string>

namespace d9d::testing {

/// How a command ended: its wait status (pclose; 0 for a clean exit) and its standard output.
struct CommandRun {
  std::string command;
  int status = -1;
  std::string output;
};

/// Runs `command` through the shell (popen) and collects its standard output (end the command
/// with " 2>&1" to collect its standard error too). status -1 when it cannot be started.
inline CommandRun run_command(const std::string& command) {
  CommandRun run{.command = command, .status = -1, .output = {}};
  std::FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    return run;
  }
  std::array<char, 4096> chunk{};
  for (std::size_t n; (n = std::fread(chunk.data(), 1, chunk.size(), pipe)) > 0;) {
    run.output.append(chunk.data(), n);
  }
  run.status = pclose(pipe);
  return run;
}

/// `text` in single quotes for the shell (a quote inside becomes '\'').
inline std::string shell_quote(const std::string& text) {
  std::string out = "'";
  for (const char c : text) {
    out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  }
  return out + "'";
}

}  // namespace d9d::testing
