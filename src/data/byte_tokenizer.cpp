// d9d/data/byte_tokenizer.cpp — byte ids, special names.
#include <stdexcept>

#include <d9d/data/byte_tokenizer.hpp>

namespace d9d::data {

std::string_view ByteTokenizer::special_name(uint32_t id) {
  switch (id) {
    case end_of_text:
      return "<|endoftext|>";
    case pad:
      return "<|pad|>";
    default:
      return {};
  }
}

std::vector<uint32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  ids.reserve(text.size());
  for (const char c : text) {
    ids.push_back(static_cast<unsigned char>(c));
  }
  return ids;
}

std::string ByteTokenizer::decode(std::span<const uint32_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const uint32_t id = ids[i];
    if (id < 256) {
      text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    } else if (is_special(id)) {
      text += special_name(id);
    } else {
      throw std::invalid_argument(
          "d9d::data::ByteTokenizer::decode: id " + std::to_string(id) + " at position " +
          std::to_string(i) +
          " is outside the vocabulary (vocab_size() = " + std::to_string(vocab) + ")");
    }
  }
  return text;
}

}  // namespace d9d::data
