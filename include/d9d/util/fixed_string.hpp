// d9d/util/fixed_string.hpp — a string literal as a template argument.
//
//   template <d9d::util::fixed_string... Patterns> struct Freeze { ... };
//   using F = Freeze<"model.embed_tokens", "*.q_proj">;       // written as plain literals
//   static_assert(F::patterns[1] == "*.q_proj");              // read back as std::string_view
//
// A C++20 class-type non-type template parameter: a literal type whose only member is the
// characters (with the terminating NUL), so two arguments with the same text are the same
// argument and a policy that takes them stays an empty, comparable type. Plain C++20, no
// LibTorch; used by the PEFT policies' module-name patterns (d9d/peft/policies.hpp).
#pragma once

#include <cstddef>
#include <string_view>

namespace d9d::util {

template <std::size_t N>
struct fixed_string {
  // Implicit on purpose: Lora<8, 16, "*.q_proj"> deduces fixed_string<9> from the literal.
  // NOLINTNEXTLINE(google-explicit-constructor)
  constexpr fixed_string(const char (&text)[N]) {
    for (std::size_t i = 0; i < N; ++i) {
      value[i] = text[i];
    }
  }
  /// The text without the terminating NUL.
  [[nodiscard]] constexpr std::string_view view() const { return {value, N - 1}; }
  [[nodiscard]] static constexpr std::size_t size() { return N - 1; }

  char value[N]{};  ///< public: a structural type (usable as a template argument)
};

}  // namespace d9d::util
