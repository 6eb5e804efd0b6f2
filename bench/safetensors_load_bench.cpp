// bench/safetensors_load_bench — how fast d9d::state reads a safetensors file, and at what memory.
//
//   bazel-bin/bench/safetensors_load_bench --make /tmp/big.safetensors --gb 3   # write a test file
//   bazel-bin/bench/safetensors_load_bench /tmp/big.safetensors                 # load every tensor
//   bazel-bin/bench/safetensors_load_bench /tmp/big.safetensors --view --cold
//
// Loads every tensor of the file and prints one line: seconds, GB/s (tensor data bytes over the
// wall time from open to the last tensor) and the peak resident set of the process (getrusage
// ru_maxrss, which counts mapped file pages as well as copies). Modes: default copies every tensor
// (load_safetensors: owned CPU tensors); --view takes zero-copy views and reads every byte of
// them once (a checksum), so the pages are really brought in. --cold first evicts the file from
// the page cache (posix_fadvise DONTNEED; works without root on clean pages). The Python
// counterpart is bench/safetensors_load_bench.py (safetensors.numpy.load_file).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <string>
#include <sys/resource.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <d9d/state/safetensors.hpp>

#include "timing.hpp"

namespace {

volatile uint64_t sink = 0;

// Evicts `path` from the page cache.
void drop_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fdatasync(fd) != 0 || ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) {
    std::fprintf(stderr, "cannot evict %s from the page cache\n", path.c_str());
  }
  if (fd >= 0) {
    ::close(fd);
  }
}

double peak_rss_gb() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0 / 1e9;  // ru_maxrss is in KiB on Linux
}

// About `gb` GB of tensors shaped like a model's: 32 MiB matrices (F32 and F16, which numpy can
// read too) and small vectors.
void make_file(const std::string& path, double gb) {
  d9d::state::NamedTensors tensors;
  uint64_t bytes = 0;
  const auto target = static_cast<uint64_t>(gb * 1e9);
  for (int layer = 0; bytes < target; ++layer) {
    const std::string prefix = "layers." + std::to_string(layer) + ".";
    tensors.emplace_back(prefix + "w32", at::rand({4096, 2048}, at::kFloat));
    tensors.emplace_back(prefix + "w16", at::rand({4096, 4096}, at::kFloat).to(at::kHalf));
    tensors.emplace_back(prefix + "bias", at::rand({4096}, at::kFloat));
    tensors.emplace_back(prefix + "step", at::tensor({int64_t{layer}}));
    bytes += 2 * (uint64_t{32} << 20) + uint64_t{4096} * 4 + 8;
  }
  d9d::state::save_safetensors(path, tensors, {{"format", "pt"}});
  std::printf("wrote %s: %zu tensors, %.3f GB of data\n", path.c_str(), tensors.size(),
              static_cast<double>(bytes) / 1e9);
}

int usage() {
  std::fprintf(stderr,
               "usage: safetensors_load_bench FILE [--view] [--cold]\n"
               "       safetensors_load_bench --make FILE [--gb N]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string path;
  std::string make;
  double gb = 3.0;
  bool view = false;
  bool cold = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--make" && i + 1 < argc) {
      make = argv[++i];
    } else if (arg == "--gb" && i + 1 < argc) {
      gb = std::stod(argv[++i]);
    } else if (arg == "--view") {
      view = true;
    } else if (arg == "--cold") {
      cold = true;
    } else if (!arg.empty() && arg[0] != '-' && path.empty()) {
      path = arg;
    } else {
      return usage();
    }
  }
  if (!make.empty()) {
    make_file(make, gb);
    return 0;
  }
  if (path.empty()) {
    return usage();
  }
  if (cold) {
    drop_cache(path);
  }
  const d9d_bench::Stopwatch watch;
  uint64_t bytes = 0;
  std::size_t count = 0;
  uint64_t checksum = 0;
  if (view) {
    const d9d::state::SafetensorsFile file(path);
    for (const auto& entry : file.entries()) {
      const at::Tensor t = file.view(entry.name);
      const auto* data = static_cast<const unsigned char*>(t.const_data_ptr());
      for (std::size_t k = 0; k < t.nbytes(); k += 64) {  // one read per cache line
        checksum += data[k];
      }
      bytes += t.nbytes();
      ++count;
    }
  } else {
    const d9d::state::NamedTensors tensors = d9d::state::load_safetensors(path);
    for (const auto& [name, t] : tensors) {
      bytes += t.nbytes();
      ++count;
    }
  }
  const double seconds = watch.seconds();
  sink = checksum;  // keeps the reads of --view
  std::printf(
      "d9d %s %s, %d threads: %zu tensors, %.3f GB in %.3f s = %.2f GB/s, peak RSS %.2f GB\n",
      view ? "view" : "copy", cold ? "cold" : "warm", at::get_num_threads(), count,
      static_cast<double>(bytes) / 1e9, seconds, static_cast<double>(bytes) / 1e9 / seconds,
      peak_rss_gb());
  return 0;
}
