// tools/tokenize — text files to the raw token format that d9d::data::TokenDataset reads.
//
//   bazel run //tools/tokenize -- --out corpus.bin README.md docs/*.md
//   bazel run //tools/tokenize -- --out train.bin --val-out val.bin --val-fraction 0.05 a.txt b.txt
//   bazel run //tools/tokenize -- --out corpus.bin --width u32 big.txt
//
// Each file is one document, encoded with d9d::data::ByteTokenizer (one token per byte) and
// followed by <|endoftext|> (256), in the order given. The result is a flat array of little-endian
// token ids (u16 by default; the vocabulary has 258 ids). With --val-out, the last
// round(fraction * tokens) tokens of that stream go to the validation file instead (a split at a
// token, possibly inside a document; the two files together are exactly the full stream). Files
// are read in 1 MiB chunks, never whole, and written through `<out>.tmp` renamed at the end; an
// input of 64 MiB or more gets a progress line on stderr every 10%.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include <d9d/data/byte_tokenizer.hpp>

namespace {

constexpr std::size_t kChunk = std::size_t{1} << 20U;
constexpr uint64_t kLargeInput = uint64_t{64} << 20U;

// Writes token ids of one width to `<path>.tmp`; commit() renames it to `path`.
class TokenWriter {
 public:
  TokenWriter(std::string path, int width) : path_(std::move(path)), width_(width) {
    out_.open(tmp(), std::ios::binary | std::ios::trunc);
    if (!out_) {
      throw std::runtime_error("cannot create " + tmp());
    }
  }

  void put(const std::vector<uint32_t>& ids) {
    buffer_.clear();
    for (const uint32_t id : ids) {
      for (int b = 0; b < width_; ++b) {  // little-endian, whatever the host
        buffer_.push_back(static_cast<char>((id >> (8U * static_cast<unsigned>(b))) & 0xFFU));
      }
    }
    out_.write(buffer_.data(), static_cast<std::streamsize>(buffer_.size()));
    tokens_ += ids.size();
  }

  TokenWriter(const TokenWriter&) = delete;
  TokenWriter& operator=(const TokenWriter&) = delete;
  ~TokenWriter() {
    if (!committed_) {
      std::remove(tmp().c_str());
    }
  }

  void commit() {
    out_.close();
    if (!out_ || std::rename(tmp().c_str(), path_.c_str()) != 0) {
      throw std::runtime_error("cannot write " + path_);
    }
    committed_ = true;
  }

  [[nodiscard]] uint64_t tokens() const { return tokens_; }
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  [[nodiscard]] std::string tmp() const { return path_ + ".tmp"; }

  std::string path_;
  int width_;
  std::ofstream out_;
  std::vector<char> buffer_;
  uint64_t tokens_ = 0;
  bool committed_ = false;
};

// Sends the first `train_tokens` tokens of the stream to `train`, the rest to `val`.
class Splitter {
 public:
  Splitter(TokenWriter& train, TokenWriter* val, uint64_t train_tokens)
      : train_(train), val_(val), train_tokens_(train_tokens) {}

  void put(const std::vector<uint32_t>& ids) {
    const uint64_t room = train_tokens_ - std::min(train_tokens_, train_.tokens());
    if (val_ == nullptr || ids.size() <= room) {
      train_.put(ids);
      return;
    }
    const auto head = static_cast<std::ptrdiff_t>(room);
    train_.put({ids.begin(), ids.begin() + head});
    val_->put({ids.begin() + head, ids.end()});
  }

 private:
  TokenWriter& train_;
  TokenWriter* val_;
  uint64_t train_tokens_;
};

uint64_t file_size(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) {
    throw std::runtime_error("cannot open " + path);
  }
  return static_cast<uint64_t>(in.tellg());
}

std::string mib(uint64_t bytes) { return std::to_string(bytes >> 20U) + " MiB"; }

int run(const std::vector<std::string>& files, const std::string& out, const std::string& width,
        const std::string& val_out, double val_fraction) {
  const d9d::data::ByteTokenizer tokenizer;
  std::vector<uint64_t> sizes;
  uint64_t input_bytes = 0;
  for (const auto& file : files) {
    sizes.push_back(file_size(file));
    input_bytes += sizes.back();
  }
  const uint64_t total_tokens = input_bytes + files.size();  // a byte a token, plus one EOS each
  uint64_t val_tokens = 0;
  if (!val_out.empty()) {
    val_tokens =
        static_cast<uint64_t>(std::llround(val_fraction * static_cast<double>(total_tokens)));
    if (val_tokens == 0 || val_tokens == total_tokens) {
      throw std::runtime_error("--val-fraction " + std::to_string(val_fraction) + " of " +
                               std::to_string(total_tokens) +
                               " tokens leaves one of the two files empty");
    }
  }

  const int bytes_per_token = width == "u32" ? 4 : 2;
  TokenWriter train(out, bytes_per_token);
  std::optional<TokenWriter> val;
  if (!val_out.empty()) {
    val.emplace(val_out, bytes_per_token);
  }
  Splitter splitter(train, val ? &*val : nullptr, total_tokens - val_tokens);

  const bool progress = input_bytes >= kLargeInput;
  uint64_t done = 0;
  uint64_t next_report = input_bytes / 10;
  std::string chunk(kChunk, '\0');
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::ifstream in(files[i], std::ios::binary);
    if (!in) {
      throw std::runtime_error("cannot open " + files[i]);
    }
    uint64_t read = 0;
    while (in) {
      in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
      const auto got = static_cast<std::size_t>(in.gcount());
      if (got == 0) {
        break;
      }
      splitter.put(tokenizer.encode(std::string_view(chunk.data(), got)));
      read += got;
      done += got;
      if (progress && done >= next_report) {
        std::cerr << "tokenize: " << mib(done) << " / " << mib(input_bytes) << " ("
                  << (100 * done / input_bytes) << "%)\n";
        next_report += input_bytes / 10;
      }
    }
    if (read != sizes[i]) {
      throw std::runtime_error(files[i] + " changed size while being read (" +
                               std::to_string(sizes[i]) + " -> " + std::to_string(read) +
                               " bytes)");
    }
    splitter.put({d9d::data::ByteTokenizer::end_of_text});
    if (files.size() <= 20) {
      std::cout << "tokenize: " << files[i] << ": " << (sizes[i] + 1) << " tokens\n";
    }
  }
  train.commit();
  if (val) {
    val->commit();
  }
  std::cout << "tokenize: " << files.size() << " documents, " << input_bytes << " bytes -> "
            << total_tokens << " tokens (byte tokenizer, vocab "
            << d9d::data::ByteTokenizer::vocab_size() << ", " << width << ")\n";
  std::cout << "tokenize: wrote " << train.path() << ": " << train.tokens() << " tokens\n";
  if (val) {
    std::cout << "tokenize: wrote " << val->path() << ": " << val->tokens() << " tokens\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tokenize text files with the byte tokenizer into a raw token file"};
  std::vector<std::string> files;
  std::string out;
  std::string width = "u16";
  std::string val_out;
  double val_fraction = 0.05;
  app.add_option("files", files, "text files, one document each")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--out", out, "the token file to write")->required();
  app.add_option("--width", width, "bytes per token id")
      ->check(CLI::IsMember({"u16", "u32"}))
      ->capture_default_str();
  auto* val_out_option =
      app.add_option("--val-out", val_out, "also write the last tokens here, for validation");
  app.add_option("--val-fraction", val_fraction, "share of the tokens that go to --val-out")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str()
      ->needs(val_out_option);
  CLI11_PARSE(app, argc, argv);
  try {
    return run(files, out, width, val_out, val_fraction);
  } catch (const std::exception& error) {
    std::cerr << "tokenize: error: " << error.what() << "\n";
    return 1;
  }
}
