// d9d/peft/policies.hpp — parameter-efficient fine-tuning policies: which parameters train, and
// which linear layers get low-rank adapters.
//
//   using Peft = d9d::peft::Lora<16, 32, "*.q_proj", "*.v_proj">;  // rank 16, alpha 32, q and v
//   using Stacked = d9d::peft::Stack<d9d::peft::Lora<8, 16, "*.q_proj">,
//   d9d::peft::Train<"*norm">>; using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>,
//   d9d::parallel::Fsdp, Peft>;
//
// Each models d9d::peft_method (a d9d::plan_policy for d9d::slot::peft) and states its facts as
// members; the component that implements them is d9d::parallel::strategy<Policy>, applied first by
// the parallelize layer (d9d/parallel/parallelize.hpp; run-time part in src/peft/):
//   - FullTune (the default, d9d/plan/defaults.hpp): every parameter trains.
//   - Freeze<patterns...>: the matched parameters are frozen, the rest train.
//   - Train<patterns...>: the matched parameters train (with LoRA: "and train the norms too").
//   - Lora<Rank, Alpha, targets...>: each matched d9d::model::Linear gets an adapter,
//     y = W x + (Alpha / Rank) * B A x, with A [Rank, in] and B [out, Rank] (parameters
//     "<module>.lora_A.weight", "<module>.lora_B.weight", as Hugging Face peft names them); the
//     base model is frozen. No targets: every linear layer but the LM head (peft's "all-linear").
//     Lora<...>::with_dropout<P> adds dropout of P percent on the adapter's input.
//   - Stack<methods...>: several at once; each pattern is claimed by one method. Parameters no
//     method claims are frozen when the stack has a Lora and no FullTune, and train otherwise.
//
// Patterns are module names of the whole model (Hugging Face names: "model.layers.0.mlp.up_proj",
// "lm_head"), written as string literals (d9d::util::fixed_string template arguments):
//   - without '*' a pattern matches a name that equals it or ends with "." + pattern: "q_proj"
//     matches every q_proj, "layers.0.self_attn.q_proj" only layer 0's (peft's target_modules);
//   - '*' matches any run of characters, dots included, and the pattern must match the whole
//     name: "*.q_proj", "model.layers.1*", "*norm";
//   - Freeze and Train match parameters: a parameter is matched when its own name or the name of
//     a module it lies in matches ("model.norm", "model.norm.weight" and "*norm" all match the
//     final norm's weight).
// At start-up a pattern that matches nothing is an error listing the model's module names.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <string_view>
#include <type_traits>

#include <d9d/plan/defaults.hpp>  // FullTune, the default
#include <d9d/plan/slots.hpp>
#include <d9d/util/fixed_string.hpp>

namespace d9d::peft {

/// What a method does with what its patterns match.
enum class MethodKind {
  full_tune,  ///< every parameter trains (no patterns)
  freeze,     ///< the matched parameters are frozen
  train,      ///< the matched parameters train
  lora,       ///< the matched linear layers get adapters; their weights are frozen
};

namespace detail {

template <class...>
inline constexpr bool peft_dependent_false = false;

/// The last dot-separated component of a pattern ("*.q_proj" -> "q_proj").
consteval std::string_view last_component(std::string_view pattern) {
  const auto dot = pattern.rfind('.');
  return dot == std::string_view::npos ? pattern : pattern.substr(dot + 1);
}

consteval bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

/// The pattern names a parameter ("*.q_proj.weight") rather than a module.
consteval bool names_a_parameter(std::string_view pattern) {
  const auto last = last_component(pattern);
  return last == "weight" || last == "bias";
}

/// The pattern can only match an embedding or a norm of d9d's models, which follow Hugging Face's
/// names (embed_tokens; norm, q_norm, k_norm, input_layernorm, post_attention_layernorm).
consteval bool names_embedding_or_norm(std::string_view pattern) {
  const auto last = last_component(pattern);
  return ends_with(last, "norm") || ends_with(last, "embed_tokens");
}

template <std::size_t N>
consteval bool none_empty(const std::array<std::string_view, N>& patterns) {
  for (const auto& pattern : patterns) {
    if (pattern.empty()) {
      return false;
    }
  }
  return true;
}

template <std::size_t N>
consteval bool all_distinct(const std::array<std::string_view, N>& patterns) {
  for (std::size_t i = 0; i < N; ++i) {
    for (std::size_t j = i + 1; j < N; ++j) {
      if (patterns[i] == patterns[j]) {
        return false;
      }
    }
  }
  return true;
}

template <std::size_t N>
consteval bool no_parameter_names(const std::array<std::string_view, N>& patterns) {
  for (const auto& pattern : patterns) {
    if (names_a_parameter(pattern)) {
      return false;
    }
  }
  return true;
}

template <std::size_t N>
consteval bool no_embedding_or_norm(const std::array<std::string_view, N>& patterns) {
  for (const auto& pattern : patterns) {
    if (names_embedding_or_norm(pattern)) {
      return false;
    }
  }
  return true;
}

}  // namespace detail

namespace detail {

// The static rules live in consteval functions that return true, so that a failed rule is one
// error (Clang drops a class whose own static_assert fails, and then reports its uses too).

template <int Rank, int Alpha, int DropoutPercent, util::fixed_string... Targets>
consteval bool check_lora() {
  static_assert(Rank >= 1,
                "d9d::peft::Lora<Rank, Alpha, targets...>: Rank must be >= 1 (a rank-0 adapter "
                "adds nothing and trains nothing). Fix: give a rank such as "
                "d9d::peft::Lora<8, 16, \"*.q_proj\">, or use d9d::peft::Freeze to train no "
                "adapter");
  static_assert(Alpha >= 1,
                "d9d::peft::Lora<Rank, Alpha, targets...>: Alpha must be >= 1 (the adapter's "
                "output is scaled by Alpha / Rank). Fix: Alpha = 2 * Rank is a common choice, "
                "e.g. d9d::peft::Lora<8, 16, ...>");
  static_assert(DropoutPercent >= 0 && DropoutPercent < 100,
                "d9d::peft::Lora<...>::with_dropout<P>: P is a percentage from 0 to 99. Fix: "
                "with_dropout<5> drops 5% of the adapter's input in training");
  constexpr std::array<std::string_view, sizeof...(Targets)> targets{Targets.view()...};
  static_assert(none_empty(targets),
                "d9d::peft::Lora: a target is the empty string, which names no module. Fix: "
                "give module-name patterns such as \"*.q_proj\", or no targets for every linear "
                "layer but the LM head");
  static_assert(all_distinct(targets),
                "d9d::peft::Lora: a target is given twice (the policy is shown with this error). "
                "Fix: give each target once");
  static_assert(no_parameter_names(targets),
                "d9d::peft::Lora: a target names a parameter (it ends in .weight or .bias), but "
                "LoRA wraps modules (the policy is shown with this error). Fix: name the module, "
                "e.g. \"*.q_proj\" rather than \"*.q_proj.weight\"");
  static_assert(no_embedding_or_norm(targets),
                "d9d::peft::Lora: a target names an embedding or a norm (embed_tokens, *norm), "
                "which LoRA cannot wrap: it wraps linear layers (d9d::model::Linear: q_proj, "
                "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head). Fix: target "
                "linear layers, and train norms or embeddings with d9d::peft::Stack<..., "
                "d9d::peft::Train<\"*norm\">>");
  return true;
}

/// Freeze's and Train's rules; `Who` is 0 for Freeze, 1 for Train.
template <int Who, util::fixed_string... Patterns>
consteval bool check_patterns() {
  if constexpr (Who == 0) {
    static_assert(sizeof...(Patterns) > 0,
                  "d9d::peft::Freeze<patterns...>: no pattern, so nothing would be frozen. Fix: "
                  "name what to freeze, e.g. d9d::peft::Freeze<\"model.embed_tokens\">, or use "
                  "d9d::peft::FullTune");
  } else {
    static_assert(sizeof...(Patterns) > 0,
                  "d9d::peft::Train<patterns...>: no pattern, so nothing would be trained. Fix: "
                  "name what to train, e.g. d9d::peft::Train<\"*norm\">, or use "
                  "d9d::peft::FullTune");
  }
  constexpr std::array<std::string_view, sizeof...(Patterns)> patterns{Patterns.view()...};
  static_assert(none_empty(patterns),
                "d9d::peft::Freeze / Train: a pattern is the empty string, which names nothing. "
                "Fix: give module or parameter names such as \"model.embed_tokens\" or "
                "\"*norm\"");
  static_assert(all_distinct(patterns),
                "d9d::peft::Freeze / Train: a pattern is given twice (the policy is shown with "
                "this error). Fix: give each pattern once");
  return true;
}

}  // namespace detail

/// LoRA with dropout: Lora<Rank, Alpha, targets...> is BasicLora<Rank, Alpha, 0, targets...>.
template <int Rank, int Alpha, int DropoutPercent, util::fixed_string... Targets>
struct BasicLora {
  static_assert(detail::check_lora<Rank, Alpha, DropoutPercent, Targets...>());
  static constexpr std::array<std::string_view, sizeof...(Targets)> targets{Targets.view()...};
  using d9d_slot = slot::peft;
  static constexpr MethodKind kind = MethodKind::lora;
  static constexpr int rank = Rank;
  static constexpr int alpha = Alpha;
  static constexpr int dropout_percent = DropoutPercent;
  /// The same adapter with dropout of P percent on its input (in training only).
  template <int P>
  using with_dropout = BasicLora<Rank, Alpha, P, Targets...>;
};

/// Low-rank adapters (LoRA) of rank `Rank`, scaled by Alpha / Rank, on the linear layers that the
/// `Targets` patterns name (none: every linear layer but the LM head); the base model is frozen.
template <int Rank, int Alpha, util::fixed_string... Targets>
using Lora = BasicLora<Rank, Alpha, 0, Targets...>;

/// The parameters the patterns match are frozen; the others train.
template <util::fixed_string... Patterns>
struct Freeze {
  static_assert(detail::check_patterns<0, Patterns...>());
  static constexpr std::array<std::string_view, sizeof...(Patterns)> patterns{Patterns.view()...};
  using d9d_slot = slot::peft;
  static constexpr MethodKind kind = MethodKind::freeze;
};

/// The parameters the patterns match train (in a Stack with Lora: trained besides the adapters).
template <util::fixed_string... Patterns>
struct Train {
  static_assert(detail::check_patterns<1, Patterns...>());
  static constexpr std::array<std::string_view, sizeof...(Patterns)> patterns{Patterns.view()...};
  using d9d_slot = slot::peft;
  static constexpr MethodKind kind = MethodKind::train;
};

template <class... Methods>
struct Stack;

namespace detail {

template <class M>
struct method_traits {
  static constexpr bool implemented = false;
};
template <>
struct method_traits<FullTune> {
  static constexpr bool implemented = true;
  static constexpr MethodKind kind = MethodKind::full_tune;
  static constexpr std::array<std::string_view, 0> patterns{};
};
template <int R, int A, int D, util::fixed_string... T>
struct method_traits<BasicLora<R, A, D, T...>> {
  static constexpr bool implemented = true;
  static constexpr MethodKind kind = MethodKind::lora;
  static constexpr auto patterns = BasicLora<R, A, D, T...>::targets;
};
template <util::fixed_string... P>
struct method_traits<Freeze<P...>> {
  static constexpr bool implemented = true;
  static constexpr MethodKind kind = MethodKind::freeze;
  static constexpr auto patterns = Freeze<P...>::patterns;
};
template <util::fixed_string... P>
struct method_traits<Train<P...>> {
  static constexpr bool implemented = true;
  static constexpr MethodKind kind = MethodKind::train;
  static constexpr auto patterns = Train<P...>::patterns;
};

template <class M>
inline constexpr bool is_stack = false;
template <class... Ms>
inline constexpr bool is_stack<Stack<Ms...>> = true;

/// A method d9d implements that may appear inside a Stack.
template <class M>
inline constexpr bool stackable = method_traits<M>::implemented;

template <class... Ms>
consteval int count_kind(MethodKind kind) {
  if constexpr ((stackable<Ms> && ...)) {
    return ((method_traits<Ms>::kind == kind ? 1 : 0) + ... + 0);
  } else {
    return 0;
  }
}

/// No two methods of a stack list the same pattern (true when some argument is not a method:
/// that has its own error).
template <class... Ms>
consteval bool claims_disjoint() {
  if constexpr ((stackable<Ms> && ...)) {
    constexpr std::size_t total = (method_traits<Ms>::patterns.size() + ... + 0);
    std::array<std::string_view, total> patterns{};
    std::array<std::size_t, total> owners{};
    std::size_t next = 0;
    std::size_t method = 0;
    const auto add = [&](const auto& list) {
      for (const auto& pattern : list) {
        patterns[next] = pattern;
        owners[next] = method;
        ++next;
      }
      ++method;
    };
    (add(method_traits<Ms>::patterns), ...);
    for (std::size_t i = 0; i < total; ++i) {
      for (std::size_t j = i + 1; j < total; ++j) {
        if (owners[i] != owners[j] && patterns[i] == patterns[j]) {
          return false;
        }
      }
    }
    return true;
  } else {
    return true;
  }
}

template <class... Ms>
consteval bool check_stack() {
  static_assert(sizeof...(Ms) > 0,
                "d9d::peft::Stack<>: an empty stack. Fix: list the methods, e.g. "
                "d9d::peft::Stack<d9d::peft::Lora<8, 16, \"*.q_proj\">, "
                "d9d::peft::Train<\"*norm\">>, or use d9d::peft::FullTune");
  static_assert(!(is_stack<Ms> || ...),
                "d9d::peft::Stack: a stack inside a stack. Fix: list every method in one "
                "d9d::peft::Stack<...>");
  static_assert(((stackable<Ms> || is_stack<Ms>)&&...),
                "d9d::peft::Stack: an argument is not a PEFT method d9d implements (the "
                "arguments are shown with this error). Fix: use d9d::peft::FullTune, "
                "Freeze<...>, Train<...> and Lora<...>");
  static_assert(count_kind<Ms...>(MethodKind::full_tune) <= 1,
                "d9d::peft::Stack: d9d::peft::FullTune is given more than once. Fix: give it "
                "once");
  static_assert(claims_disjoint<Ms...>(),
                "d9d::peft::Stack: two methods claim the same target pattern (the methods are "
                "shown with this error); a parameter can be frozen, trained or adapted, not two "
                "of these. Fix: give each pattern to one method");
  return true;
}

}  // namespace detail

/// Several methods at once, e.g. LoRA on attention and the norms trained:
/// Stack<Lora<8, 16, "*.q_proj", "*.v_proj">, Train<"*norm">>. Order-free. Each pattern belongs
/// to one method; a parameter two methods' patterns both match is an error at start-up. What no
/// method claims is frozen when the stack has a Lora and no FullTune (peft's default: only the
/// adapters train), and trains otherwise (Stack<Lora<...>, FullTune>: adapters and the rest of the
/// model train; the wrapped layers' own weights stay frozen).
template <class... Methods>
struct Stack {
  static_assert(detail::check_stack<Methods...>());
  using d9d_slot = slot::peft;
  static constexpr std::size_t size = sizeof...(Methods);
  /// Parameters no method claims train (FullTune in the stack, or no Lora in it).
  static constexpr bool rest_trains = detail::count_kind<Methods...>(MethodKind::full_tune) > 0 ||
                                      detail::count_kind<Methods...>(MethodKind::lora) == 0;
};

}  // namespace d9d::peft

namespace d9d {

/// A policy of the peft slot (d9d::peft::FullTune, Freeze, Train, Lora, Stack, or a user's own
/// with a d9d::parallel::strategy<> specialisation).
template <class P>
concept peft_method = plan_policy<P> && std::same_as<typename P::d9d_slot, slot::peft>;

}  // namespace d9d
