// d9d/peft/stack.hpp — a peft policy as run-time data, for the component that applies it.
//
//   const d9d::peft::StackSpec spec = d9d::peft::stack_spec<d9d::peft::Lora<8, 16, "*.q_proj">>();
//   spec.methods[0].rank == 8;  spec.methods[0].patterns == {"*.q_proj"};  !spec.rest_trains;
//   d9d::peft::apply_stack(*model, spec, /*seed=*/0);   // d9d/peft/lora.hpp: outside a Trainer
//
// The policies (d9d/peft/policies.hpp) are types whose facts the compiler checks; the component
// (d9d::parallel::strategy<Policy>, src/peft/) reads this description of them. No LibTorch.
#pragma once

#include <string>
#include <vector>

#include <d9d/peft/policies.hpp>

namespace d9d::peft {

/// One method of a stack.
struct MethodSpec {
  MethodKind kind = MethodKind::full_tune;
  /// Freeze / Train: parameter patterns; Lora: module patterns (empty: every linear layer but the
  /// LM head).
  std::vector<std::string> patterns{};
  int rank = 0;          ///< Lora
  int alpha = 0;         ///< Lora
  double dropout = 0.0;  ///< Lora: probability of dropping an input of the adapter (training)

  /// The policy as written, for messages: d9d::peft::Lora<8, 16, "*.q_proj">.
  [[nodiscard]] std::string describe() const {
    std::string out = "d9d::peft::";
    std::vector<std::string> args;
    switch (kind) {
      case MethodKind::full_tune:
        return out + "FullTune";
      case MethodKind::freeze:
        out += "Freeze";
        break;
      case MethodKind::train:
        out += "Train";
        break;
      case MethodKind::lora:
        out += "Lora";
        args.push_back(std::to_string(rank));
        args.push_back(std::to_string(alpha));
        break;
    }
    for (const auto& pattern : patterns) {
      args.push_back("\"" + pattern + "\"");
    }
    out += "<";
    for (std::size_t i = 0; i < args.size(); ++i) {
      out += (i > 0 ? ", " : "") + args[i];
    }
    out += ">";
    if (kind == MethodKind::lora && dropout > 0.0) {
      out += "::with_dropout<" + std::to_string(static_cast<int>(dropout * 100.0 + 0.5)) + ">";
    }
    return out;
  }
};

/// A peft policy: its methods (one for a policy that is not a Stack) and what happens to the
/// parameters no method claims.
struct StackSpec {
  std::vector<MethodSpec> methods{};
  bool rest_trains = true;  ///< unclaimed parameters keep training (else they are frozen)

  [[nodiscard]] bool has_lora() const {
    for (const auto& method : methods) {
      if (method.kind == MethodKind::lora) {
        return true;
      }
    }
    return false;
  }
};

namespace detail {

template <class M>
MethodSpec method_spec() {
  using Traits = method_traits<M>;
  MethodSpec spec{.kind = Traits::kind};
  for (const auto& pattern : Traits::patterns) {
    spec.patterns.emplace_back(pattern);
  }
  if constexpr (Traits::kind == MethodKind::lora) {
    spec.rank = M::rank;
    spec.alpha = M::alpha;
    spec.dropout = M::dropout_percent / 100.0;
  }
  return spec;
}

template <class... Ms>
StackSpec stack_spec_of(const Stack<Ms...>* /*tag*/) {
  return {.methods = {method_spec<Ms>()...}, .rest_trains = Stack<Ms...>::rest_trains};
}

template <class M>
StackSpec stack_spec_of(const M* /*tag*/) {
  return {.methods = {method_spec<M>()}, .rest_trains = method_traits<M>::kind != MethodKind::lora};
}

}  // namespace detail

/// The run-time description of a peft policy (FullTune, Freeze, Train, Lora or a Stack of them).
template <class Policy>
StackSpec stack_spec() {
  return detail::stack_spec_of(static_cast<const Policy*>(nullptr));
}

}  // namespace d9d::peft
