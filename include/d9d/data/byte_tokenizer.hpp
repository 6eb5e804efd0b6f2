// d9d/data/byte_tokenizer.hpp — a tokenizer whose tokens are the 256 byte values plus two specials.
//
//   const d9d::data::ByteTokenizer tok;
//   std::vector<uint32_t> ids = tok.encode("hi");             // {104, 105}
//   ids.push_back(d9d::data::ByteTokenizer::end_of_text);
//   std::string text = tok.decode(ids);                        // "hi<|endoftext|>"
//
// Ids 0..255 are the bytes themselves, so every byte string (invalid UTF-8 and NUL included)
// encodes losslessly: decode(encode(s)) == s. The specials follow the bytes: `<|endoftext|>` = 256
// ends every document (and separates documents in a corpus), `<|pad|>` = 257 fills batches;
// vocab_size() = 258. encode never produces a special: the text "<|endoftext|>" in the input stays
// 13 byte tokens, so no input can forge a document boundary. decode renders a special as its name.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace d9d::data {

/// Bytes as tokens, plus `<|endoftext|>` and `<|pad|>` (see the file comment).
class ByteTokenizer {
 public:
  /// `<|endoftext|>`: the end of a document, the separator between documents.
  static constexpr uint32_t end_of_text = 256;
  /// `<|pad|>`: filler for positions that carry no token.
  static constexpr uint32_t pad = 257;
  /// 256 bytes + 2 specials.
  static constexpr uint32_t vocab = 258;

  [[nodiscard]] static constexpr uint32_t vocab_size() { return vocab; }
  [[nodiscard]] static constexpr bool is_special(uint32_t id) { return id >= 256 && id < vocab; }
  /// "<|endoftext|>", "<|pad|>"; empty for a byte id or an id outside the vocabulary.
  [[nodiscard]] static std::string_view special_name(uint32_t id);

  /// One id per byte of `text`, no specials.
  [[nodiscard]] std::vector<uint32_t> encode(std::string_view text) const;
  /// The bytes of the byte ids, specials as their names; an id >= vocab_size() is an
  /// std::invalid_argument naming it and its position.
  [[nodiscard]] std::string decode(std::span<const uint32_t> ids) const;
};

}  // namespace d9d::data
