// examples/common/report.hpp — the figures the examples print about a run: trainable parameters,
// training FLOPs per token, MFU, peak memory.
//
//   report::print_trainable(d9d::peft::count_parameters(*trainer.core().model()));
//   const double flops = report::training_flops_per_token(
//       config, config.non_embedding_parameter_count(), cfg.batch.sequence_length);
//   report::print_mfu(tflops, ctx.world_size(), peak_tflops);  // ", MFU 41.2% of 989 TFLOP/s"
#pragma once

#include <cstdint>
#include <cstdio>

#include <d9d/model/qwen3.hpp>
#include <d9d/peft/lora.hpp>

namespace report {

/// Model FLOPs per token for training (forward + backward): 6 per matmul parameter (the
/// `non_embedding` ones given, e.g. a MoE's active ones, plus the LM head: a vocab x hidden matmul
/// whether or not it shares the embedding's weight) plus attention's 12 * layers * (heads *
/// head_dim) * sequence (causal masking not discounted). With a frozen base (LoRA) the weights'
/// gradients are not computed: 4 per parameter (the small adapters' own FLOPs are not counted).
inline double training_flops_per_token(const d9d::model::Qwen3Config& c, int64_t non_embedding,
                                       int64_t sequence_length, bool frozen_base = false) {
  const double matmul_params =
      static_cast<double>(non_embedding) + static_cast<double>(c.vocab_size * c.hidden_size);
  return (frozen_base ? 4.0 : 6.0) * matmul_params +
         12.0 * static_cast<double>(c.num_hidden_layers) *
             static_cast<double>(c.num_attention_heads * c.head_dim) *
             static_cast<double>(sequence_length);
}

/// Hugging Face peft's line: "trainable params: N || all params: M || trainable%: P".
inline void print_trainable(const d9d::peft::ParameterCount& count) {
  std::printf("trainable params: %ld || all params: %ld || trainable%%: %.4f\n",
              static_cast<long>(count.trainable), static_cast<long>(count.total),
              count.trainable_percent());
  std::fflush(stdout);
}

/// ", MFU x% of peak TFLOP/s" when a per-device peak is given, for `tflops` over `ranks` ranks
/// (no newline).
inline void print_mfu(double tflops, int ranks, double peak_tflops) {
  if (peak_tflops > 0) {
    std::printf(", MFU %.1f%% of %.0f TFLOP/s", 100.0 * tflops / ranks / peak_tflops, peak_tflops);
  }
}

/// "\npeak memory: x GiB (the most any rank allocated)" when measured (no trailing newline).
inline void print_peak_memory(int64_t bytes) {
  if (bytes > 0) {
    std::printf("\npeak memory: %.2f GiB (the most any rank allocated)",
                static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  }
}

}  // namespace report
