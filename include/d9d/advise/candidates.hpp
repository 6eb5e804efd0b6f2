// d9d/advise/candidates.hpp — every Plan shape a world of ranks can run a dense Qwen3 with, by the
// library's own rules, for the advisor to rank (docs/advise.md, "Candidate Plans").
//
//   const auto all = d9d::advise::enumerate_candidates(trainer_config, /*world_size=*/8);
//   for (const auto& c : all) c.describe();   // "fully_shard dp_shard 4 x tp 2, 4 microbatches"
//
// A candidate is the runtime form of a Plan's parallel slots: data parallelism (Replicate, or
// FullyShard over dp_shard x cp, with dp_replicate replicas as HSDP), context, tensor and
// pipeline degrees, the pipeline schedule and the microbatches each data-parallel rank runs per
// step. It is kept when every rule holds:
//   mesh        the degrees multiply to the world (MeshShape::validate)
//   batch       the global batch splits into microbatches over the data-parallel ranks
//               (TrainerConfig::check_against_data_parallel)
//   tp          tp divides the attention heads, the KV heads, the intermediate size and the
//               vocabulary (TensorParallel's rule), and with cp the sequence's chunks
//   cp          cp cuts each sequence into 2 cp chunks (d9d::model::check_context_length)
//   pipeline    the schedule builds a program for pp ranks and the microbatches
//               (pipeline::build_program: 1F1B needs m >= pp, DualPipeV m >= 2 pp, ...), and
//               every stage gets at least one layer
// Replicate shards nothing (dp_shard 1); FullyShard takes every candidate with dp_shard >= 1.
// Expert parallelism, recompute and precision are not enumerated (they do not change the mesh).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <d9d/pipeline/program.hpp>

namespace d9d {
struct TrainerConfig;
}  // namespace d9d

namespace d9d::advise {

/// The schedules the advisor knows by name: gpipe, 1f1b, interleaved (2 stages per rank), zbh1,
/// zbv, dualpipev.
[[nodiscard]] const std::vector<std::string>& schedule_names();

/// The program of schedule `name` for `pp` ranks and `microbatches` (pipeline::build_program of
/// its policy). std::invalid_argument for an unknown name or sizes the schedule refuses.
[[nodiscard]] pipeline::Program build_schedule(const std::string& name, int pp, int microbatches);

/// One Plan shape (see the file comment).
struct Candidate {
  bool fully_shard = false;
  int dp_replicate = 1;
  int dp_shard = 1;
  int cp = 1;  ///< context parallelism (the mesh's cp_shard)
  int tp = 1;
  int pp = 1;
  std::string schedule{};  ///< empty without a pipeline
  int microbatches = 1;    ///< per data-parallel rank and step

  /// "replicate dp 2 x pp 2 (zbh1), 4 microbatches"
  [[nodiscard]] std::string describe() const;
  bool operator==(const Candidate&) const = default;
};

/// What to enumerate.
struct CandidateOptions {
  bool tensor_parallel = true;
  bool context_parallel = true;
  bool pipelines = true;
};

/// Every candidate for `world_size` ranks that passes the rules (see the file comment) for the
/// Qwen3 model and the batch of `config`, in a fixed order: Replicate before FullyShard, then by
/// pp, tp, cp, dp_replicate and schedule. std::invalid_argument for a world below 1.
[[nodiscard]] std::vector<Candidate> enumerate_candidates(const TrainerConfig& config,
                                                          int world_size,
                                                          const CandidateOptions& options = {});

}  // namespace d9d::advise
