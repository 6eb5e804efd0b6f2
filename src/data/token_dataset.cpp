// d9d/data/token_dataset.cpp — memory-mapped raw token files, windows as int64 tensors.
#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <mutex>
#include <stdexcept>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>

#include <ATen/ops/empty.h>

#include <d9d/data/token_dataset.hpp>

namespace d9d::data {

static_assert(std::endian::native == std::endian::little,
              "d9d::data::TokenDataset reads little-endian token files by plain loads; a "
              "big-endian host needs a byte swap here");

const char* to_string(TokenWidth width) { return width == TokenWidth::u16 ? "u16" : "u32"; }

namespace {

constexpr const char* kWho = "d9d::data::TokenDataset: ";

// One read-only mapping of a whole file; unmapped on destruction.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      throw std::runtime_error(std::string(kWho) + path + ": cannot open (" + std::strerror(errno) +
                               ")");
    }
    struct stat info {};
    if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
      ::close(fd);
      throw std::runtime_error(std::string(kWho) + path + ": not a regular file");
    }
    size_ = static_cast<std::size_t>(info.st_size);
    if (size_ > 0) {
      void* data = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (data == MAP_FAILED) {
        const int error = errno;
        ::close(fd);
        throw std::runtime_error(std::string(kWho) + path + ": mmap failed (" +
                                 std::strerror(error) + ")");
      }
      data_ = static_cast<const unsigned char*>(data);
    }
    ::close(fd);  // the mapping keeps the file
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  MappedFile& operator=(MappedFile&&) = delete;
  ~MappedFile() {
    if (data_ != nullptr) {
      ::munmap(const_cast<unsigned char*>(data_), size_);
    }
  }

  [[nodiscard]] const unsigned char* data() const { return data_; }
  [[nodiscard]] std::size_t size() const { return size_; }

 private:
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
};

// Widens `count` tokens starting at token `first` of `base` into `out`.
template <class Id>
void widen(const unsigned char* base, int64_t first, int64_t count, int64_t* out) {
  const unsigned char* from = base + first * static_cast<int64_t>(sizeof(Id));
  for (int64_t k = 0; k < count; ++k) {
    Id id = 0;
    std::memcpy(&id, from + k * static_cast<int64_t>(sizeof(Id)), sizeof(Id));
    out[k] = static_cast<int64_t>(id);
  }
}

template <class Id>
int64_t max_id(const unsigned char* base, int64_t count) {
  Id best = 0;
  for (int64_t k = 0; k < count; ++k) {
    Id id = 0;
    std::memcpy(&id, base + k * static_cast<int64_t>(sizeof(Id)), sizeof(Id));
    best = std::max(best, id);
  }
  return static_cast<int64_t>(best);
}

}  // namespace

struct TokenDataset::State {
  std::vector<std::string> paths;
  TokenWidth width = TokenWidth::u16;
  int64_t seq_len = 1;
  std::vector<MappedFile> files;
  std::vector<int64_t> tokens;        // per file
  std::vector<int64_t> first_sample;  // per file, plus the total at the end
  std::once_flag vocab_once;
  int64_t vocab_bound = 0;

  // Copies sample `index` (already checked) into `out` (seq_len + 1 values).
  void read(int64_t index, int64_t* out) const {
    const auto file =
        static_cast<std::size_t>(std::upper_bound(first_sample.begin(), first_sample.end(), index) -
                                 first_sample.begin() - 1);
    const int64_t first = (index - first_sample[file]) * seq_len;
    const unsigned char* base = files[file].data();
    if (width == TokenWidth::u16) {
      widen<uint16_t>(base, first, seq_len + 1, out);
    } else {
      widen<uint32_t>(base, first, seq_len + 1, out);
    }
  }

  void check_index(int64_t index) const {
    if (index < 0 || index >= first_sample.back()) {
      throw std::invalid_argument(std::string(kWho) + "sample index " + std::to_string(index) +
                                  " is out of range [0, " + std::to_string(first_sample.back()) +
                                  ")");
    }
  }
};

TokenDataset TokenDataset::open(std::vector<std::string> paths, TokenWidth width, int64_t seq_len) {
  if (seq_len < 1) {
    throw std::invalid_argument(std::string(kWho) + "seq_len must be >= 1 (got " +
                                std::to_string(seq_len) + ")");
  }
  if (width != TokenWidth::u16 && width != TokenWidth::u32) {
    throw std::invalid_argument(std::string(kWho) + "width must be TokenWidth::u16 or u32");
  }
  if (paths.empty()) {
    throw std::invalid_argument(std::string(kWho) + "no files given");
  }
  auto state = std::make_shared<State>();
  state->width = width;
  state->seq_len = seq_len;
  state->files.reserve(paths.size());
  state->first_sample.push_back(0);
  const auto bytes_per_token = static_cast<std::size_t>(width);
  for (const auto& path : paths) {
    MappedFile file(path);
    if (file.size() % bytes_per_token != 0) {
      throw std::runtime_error(std::string(kWho) + path + ": " + std::to_string(file.size()) +
                               " bytes is not a multiple of the token width " +
                               std::to_string(bytes_per_token) + " (" + to_string(width) +
                               "). Fix: open it with the width it was written with");
    }
    const auto tokens = static_cast<int64_t>(file.size() / bytes_per_token);
    if (tokens < seq_len + 1) {
      throw std::runtime_error(std::string(kWho) + path + ": too few tokens for one sample (" +
                               std::to_string(tokens) + " tokens; seq_len " +
                               std::to_string(seq_len) + " needs " + std::to_string(seq_len + 1) +
                               "). Fix: a smaller seq_len, or leave this file out");
    }
    state->tokens.push_back(tokens);
    state->first_sample.push_back(state->first_sample.back() + (tokens - 1) / seq_len);
    state->files.push_back(std::move(file));
  }
  state->paths = std::move(paths);
  return TokenDataset(std::move(state));
}

int64_t TokenDataset::size() const { return state_->first_sample.back(); }
int64_t TokenDataset::seq_len() const { return state_->seq_len; }
TokenWidth TokenDataset::width() const { return state_->width; }
const std::vector<std::string>& TokenDataset::paths() const { return state_->paths; }

int64_t TokenDataset::num_tokens() const {
  int64_t total = 0;
  for (const int64_t tokens : state_->tokens) {
    total += tokens;
  }
  return total;
}

at::Tensor TokenDataset::sample(int64_t index) const {
  state_->check_index(index);
  at::Tensor out = at::empty({state_->seq_len + 1}, at::kLong);
  state_->read(index, out.data_ptr<int64_t>());
  return out;
}

at::Tensor TokenDataset::batch(const std::vector<int64_t>& indices) const {
  for (const int64_t index : indices) {
    state_->check_index(index);
  }
  const int64_t row = state_->seq_len + 1;
  at::Tensor out = at::empty({static_cast<int64_t>(indices.size()), row}, at::kLong);
  int64_t* data = out.data_ptr<int64_t>();
  for (std::size_t i = 0; i < indices.size(); ++i) {
    state_->read(indices[i], data + static_cast<int64_t>(i) * row);
  }
  return out;
}

int64_t TokenDataset::vocab_bound() const {
  State& state = *state_;
  std::call_once(state.vocab_once, [&state] {
    int64_t best = 0;
    for (std::size_t f = 0; f < state.files.size(); ++f) {
      const unsigned char* base = state.files[f].data();
      best =
          std::max(best, state.width == TokenWidth::u16 ? max_id<uint16_t>(base, state.tokens[f])
                                                        : max_id<uint32_t>(base, state.tokens[f]));
    }
    state.vocab_bound = best + 1;
  });
  return state.vocab_bound;
}

void TokenDataset::check_vocab(int64_t vocab_size) const {
  if (vocab_bound() <= vocab_size) {
    return;
  }
  const State& state = *state_;
  for (std::size_t f = 0; f < state.files.size(); ++f) {
    const unsigned char* base = state.files[f].data();
    const int64_t count = state.tokens[f];
    const int64_t bytes = state.width == TokenWidth::u16 ? 2 : 4;
    for (int64_t k = 0; k < count; ++k) {
      uint32_t id = 0;
      if (state.width == TokenWidth::u16) {
        uint16_t narrow = 0;
        std::memcpy(&narrow, base + k * bytes, sizeof(narrow));
        id = narrow;
      } else {
        std::memcpy(&id, base + k * bytes, sizeof(id));
      }
      if (static_cast<int64_t>(id) >= vocab_size) {
        throw std::runtime_error(
            std::string(kWho) + state.paths[f] + ": token " + std::to_string(k) + " is id " +
            std::to_string(id) + ", not below the model's vocabulary size " +
            std::to_string(vocab_size) + " (the files' largest id is " +
            std::to_string(vocab_bound() - 1) + "; read as " + to_string(state.width) +
            "). Fix: tokenize with the model's tokenizer, or give a model with a larger "
            "vocab_size");
      }
    }
  }
}

}  // namespace d9d::data
