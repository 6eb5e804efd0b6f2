// The libFuzzer target of the safetensors reader (tools/fuzz/safetensors builds and runs it with
// clang, ASan and UBSan; //tests/state:state_test replays the committed corpus through it).
//
//   LLVMFuzzerTestOneInput(bytes, size);   // returns 0, or aborts on a bug
//
// Each input is read twice, from memory (SafetensorsFile::from_bytes) and from a file (the mmap
// path), with full validation and materialisation (copies and zero-copy views). The rules it
// enforces: only std::runtime_error may come out of the reader; both paths agree (same error, or
// same entries, metadata and bytes); an accepted file, written again by serialize_safetensors,
// reads back identical.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <optional>
#include <stdexcept>
#include <string>
#include <unistd.h>

#include <ATen/core/Tensor.h>

#include <d9d/state/safetensors.hpp>

namespace {

using d9d::state::SafetensorsFile;

[[noreturn]] void bug(const std::string& what) {
  std::fprintf(stderr, "safetensors fuzz: %s\n", what.c_str());
  std::abort();
}

// One scratch file per process, rewritten for every input.
const std::string& scratch_path() {
  static const std::string path = [] {
    const char* base = std::getenv("TEST_TMPDIR");
    return std::string(base != nullptr ? base : "/tmp") + "/d9d_safetensors_fuzz_" +
           std::to_string(::getpid()) + ".safetensors";
  }();
  static const bool cleanup = [] { return std::atexit([] { ::unlink(path.c_str()); }) == 0; }();
  (void)cleanup;
  return path;
}

void write_scratch(const std::string& bytes) {
  const int fd = ::open(scratch_path().c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    bug("cannot create " + scratch_path());
  }
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) {
      bug("cannot write " + scratch_path());
    }
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
}

std::string bytes_of(const at::Tensor& t) {
  if (t.nbytes() == 0) {
    return {};
  }
  return {static_cast<const char*>(t.const_data_ptr()), t.nbytes()};
}

// What a reader made of an input: the error (without the name of the file), or the file.
struct Outcome {
  std::optional<SafetensorsFile> file;
  std::string error;
};

Outcome read(const std::string& name, const auto& open) {
  Outcome outcome;
  try {
    outcome.file.emplace(open());
    for (const auto& entry : outcome.file->entries()) {
      // Both materialisations, checked against each other.
      const at::Tensor copy = outcome.file->tensor(entry.name);
      const at::Tensor view = outcome.file->view(entry.name);
      if (copy.sizes().vec() != entry.shape || copy.scalar_type() != entry.dtype ||
          !copy.is_contiguous() || copy.nbytes() != entry.nbytes() ||
          bytes_of(copy) != bytes_of(view)) {
        bug(name + ": tensor " + entry.name + ": copy and view disagree with the entry");
      }
    }
  } catch (const std::runtime_error& error) {
    outcome.file.reset();
    outcome.error = error.what();
    const std::size_t at = outcome.error.find(name);
    if (at == std::string::npos) {
      bug("the error does not name the file: " + outcome.error);
    }
    outcome.error.erase(at, name.size());
  }
  return outcome;
}

bool same_files(const SafetensorsFile& a, const SafetensorsFile& b) {
  if (a.metadata() != b.metadata() || a.entries().size() != b.entries().size()) {
    return false;
  }
  for (std::size_t i = 0; i < a.entries().size(); ++i) {
    const auto& x = a.entries()[i];
    const auto& y = b.entries()[i];
    if (x.name != y.name || x.dtype != y.dtype || x.shape != y.shape || x.begin != y.begin ||
        x.end != y.end || bytes_of(a.tensor(x.name)) != bytes_of(b.tensor(y.name))) {
      return false;
    }
  }
  return true;
}

}  // namespace

// NOLINTNEXTLINE(readability-identifier-naming): the name libFuzzer calls
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  const Outcome memory =
      read("<fuzz>", [&] { return SafetensorsFile::from_bytes(bytes, "<fuzz>"); });
  write_scratch(bytes);
  const Outcome file = read(scratch_path(), [] { return SafetensorsFile(scratch_path()); });
  // The file reader names itself the same way; only the path differs.
  if (memory.error != file.error || memory.file.has_value() != file.file.has_value()) {
    bug("memory and file readers disagree: \"" + memory.error + "\" vs \"" + file.error + "\"");
  }
  if (memory.file && !same_files(*memory.file, *file.file)) {
    bug("memory and file readers read different contents");
  }
  if (memory.file) {
    // Written again, an accepted file reads back the same (the data may move: we pad the header
    // to 8 bytes and lay tensors out in data order, which the input need not do).
    std::string again;
    try {
      again = d9d::state::serialize_safetensors(memory.file->tensors(), memory.file->metadata());
    } catch (const std::exception& error) {
      bug(std::string("an accepted file cannot be written again: ") + error.what());
    }
    try {
      const auto reread = SafetensorsFile::from_bytes(again, "<again>");
      const auto& want = memory.file->entries();
      const auto& got = reread.entries();
      bool same = reread.metadata() == memory.file->metadata() && got.size() == want.size();
      for (std::size_t i = 0; same && i < got.size(); ++i) {
        same = got[i].name == want[i].name && got[i].dtype == want[i].dtype &&
               got[i].shape == want[i].shape &&
               bytes_of(reread.tensor(got[i].name)) == bytes_of(memory.file->tensor(want[i].name));
      }
      if (!same) {
        bug("an accepted file, written again, reads back different");
      }
    } catch (const std::runtime_error& error) {
      bug(std::string("an accepted file, written again, is refused: ") + error.what());
    }
  }
  return 0;
}
