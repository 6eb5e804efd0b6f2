// d9d/train/config.hpp — the run-time knobs of a training run, from one JSON file, validated.
//
//   auto cfg = d9d::TrainerConfig::from_file("quickstart.json");   // d9d::ConfigError on any
//   problem cfg.batch.global_batch_size;  cfg.optimizer.lr;  cfg.section("model");  // raw provider
//   section
//
// Validation happens before anything is allocated: every error names the key (as a dotted path),
// the value and what would be valid; unknown keys are errors (with the closest valid key).
// Sections "model" and "data" belong to the model and dataset providers and are kept as JSON
// text for them. The schema is documented in docs/train.md.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <d9d/optim/lr_schedule.hpp>
#include <d9d/plan/mesh.hpp>

namespace d9d {

/// A configuration problem; the message names the key, the value and the fix.
class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct RunConfig {
  std::string output_dir;   ///< logs, metrics and the exported model go here
  int64_t total_steps = 0;  ///< optimizer steps
  uint64_t seed = 0;        ///< model init (same on every rank) and data order
  int64_t log_every = 10;   ///< steps between metric records
  /// Seconds after which the other ranks stop when a rank dies or fails
  /// (DistributedContext::set_failure_timeout); unset: the context's (60 s by default).
  std::optional<double> failure_timeout_s;
};

struct BatchConfig {
  int64_t global_batch_size = 0;  ///< samples per optimizer step over all data-parallel ranks
  int64_t microbatch_size = 0;    ///< samples per forward/backward on one rank
  /// Tokens per sample, for language models (their data and pipeline stages need it); 0 (not
  /// given) for other models, whose progress then counts samples rather than tokens.
  int64_t sequence_length = 0;
};

struct OptimizerConfig {
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  ///< applied to matrices, not to norms or biases
};

struct ClippingConfig {
  std::optional<double> max_norm = 1.0;  ///< global gradient norm limit; null: no clipping
};

/// Run-time knobs of the data-parallel strategies (d9d/parallel/policies.hpp).
struct DataParallelConfig {
  double bucket_size_mb = 25.0;  ///< Replicate: gradient all-reduce bucket size
  /// Replicate: what moves the gradients' bytes: "backend" (the group's all-reduce), "copy" (the
  /// GPUs' copy engines, for CUDA groups within one node; d9d/parallel/replicate.hpp) or "auto"
  /// ("copy" where it runs: a CUDA job on one node whose data-parallel group is the whole job,
  /// without a pipeline; else "backend").
  std::string reduce_engine = "auto";
  /// Replicate: a tied embedding's last-microbatch lookup gradient is kept as rows, so the
  /// weight's all-reduce starts right after the LM head's backward and the rows of every rank are
  /// gathered and added at the end (d9d/model/embedding_rows.hpp); false: reduced whole, last.
  bool tied_embedding_rows = true;
  /// FullyShard<Reshard::from_config>: "after_forward", "never" or "all_but_last".
  std::string reshard = "after_forward";
  int64_t prefetch = 1;  ///< FullyShard: units gathered ahead of their use (0: none)
  /// FullyShard: reduce-scatter after every microbatch (false: once per step, keeping the whole
  /// gradients over the step's microbatches).
  bool reduce_every_microbatch = true;
};

struct LoggingConfig {
  bool progress = true;     ///< console progress bar on the main rank
  bool jsonl = true;        ///< <output_dir>/metrics.jsonl
  bool tensorboard = true;  ///< <output_dir>/tensorboard/events.out.tfevents.*
  bool pictures = true;     ///< <output_dir>/lr_schedule.svg and loss.svg (SVG line charts)
  /// Pipeline plans: step N (from 1) is recorded per action on every pipeline rank and drawn as
  /// it ran, under the program as planned at the measured costs, in
  /// <output_dir>/pipeline_timeline.svg; 0: never.
  int64_t pipeline_timeline_step = 0;
};

struct ExportConfig {
  bool enabled = true;            ///< write <output_dir>/model after training
  std::string dtype = "float32";  ///< "float32" or "bfloat16"
};

/// Training checkpoints (d9d/train/checkpoint.hpp).
struct CheckpointConfig {
  int64_t every = 0;   ///< save after every N optimizer steps (and after the last); 0: never
  int64_t keep = 2;    ///< complete checkpoints kept (the oldest go first)
  bool async = true;   ///< write in the background after a host snapshot
  bool resume = true;  ///< continue from the latest checkpoint in the directory, if any
  std::string dir;     ///< default <run.output_dir>/checkpoints
  /// A checkpoint directory (a step-<N> of any run, on any mesh) to start from instead of the
  /// latest one in `dir`; empty: none.
  std::string resume_from;
  /// A Hugging Face checkpoint (a directory with model.safetensors, or with
  /// model.safetensors.index.json and its shards; or a safetensors file) whose weights the run
  /// starts from when it resumes no training checkpoint. Each rank reads only its parts of the
  /// parameters (d9d::parallel::load_state). Empty: the model provider's initialisation.
  std::string init_from;
};

/// Numerical faults (docs/train.md, "Numerical faults"). A step whose global loss or gradient norm
/// is NaN or infinite never reaches the optimizer (every rank agrees on that).
struct NumericsConfig {
  /// "stop": train() throws d9d::NumericalError naming the step and the values, the parameters and
  /// the last checkpoint as they were before the step; "skip": the step is skipped (no optimizer
  /// update) and training goes on.
  std::string on_nonfinite = "stop";
  /// "skip": more skipped steps than this in a row stop the run as "stop" does.
  int64_t max_consecutive_skips = 10;
  /// A finite loss above loss_spike_factor x the mean of the previous loss_spike_window finite
  /// losses, and at least loss_spike_min_rise above that mean, is a spike: logged (warning),
  /// listed in TrainResult::loss_spikes, events::LossSpike. The floor keeps a loss near zero
  /// (3e-4 after a mean of 1e-4) from counting as a spike.
  double loss_spike_factor = 3.0;
  int64_t loss_spike_window = 20;
  double loss_spike_min_rise = 0.1;  ///< in the loss's own units (nats for a cross-entropy)
};

/// A profiler trace of chosen steps (Kineto: CPU operators and, on GPU, CUDA kernels), one Chrome
/// trace file per rank, with the step's phases named (d9d::step, d9d::forward, d9d::backward,
/// d9d::gradient_sync, d9d::optimizer), and a memory summary per rank.
struct ProfileConfig {
  int64_t start = -1;  ///< the first step traced (0-based); -1: no profiling
  int64_t steps = 1;   ///< how many steps
  std::string dir;     ///< default <run.output_dir>/profile
  /// false: record the d9d phase ranges and the device's activity only, without an event per
  /// operator and without memory events; the profiler then costs the host little, so the traced
  /// steps show where an unprofiled step's time goes (the memory summary's rises are then 0).
  bool operators = true;
};

/// CUDA graphs (docs/train.md, "CUDA graphs"): each microbatch's forward and backward is captured
/// once and replayed with the next microbatches' tensors copied into the captured ones, which
/// removes the per-kernel launch cost from the step. Single-rank plans without a pipeline schedule,
/// on a CUDA device, with microbatches of one shape.
struct CudaGraphsConfig {
  bool enabled = false;
  /// Steps run eagerly before the capture (lazy initialisation: cuBLAS, autocast, kernel caches).
  int64_t warmup_steps = 1;
};

/// Every knob of a run.
struct TrainerConfig {
  RunConfig run;
  BatchConfig batch;
  OptimizerConfig optimizer;
  std::vector<optim::Phase> lr_schedule;  ///< empty: constant learning rate
  ClippingConfig gradient_clipping;
  DataParallelConfig data_parallel;
  DynamicDegrees mesh;  ///< values for the plan's d9d::dynamic degrees
  LoggingConfig logging;
  ExportConfig export_model;
  CheckpointConfig checkpoint;
  ProfileConfig profile;
  NumericsConfig numerics;
  CudaGraphsConfig cuda_graphs;
  std::map<std::string, std::string> sections;  ///< "model", "data": raw JSON for the providers

  /// A command line's replacements, applied after parsing and before validation: a dotted key
  /// and a JSON value, e.g. {"run.output_dir", "\"runs/a\""}, {"mesh.pp", "2"}.
  using Overrides = std::vector<std::pair<std::string, std::string>>;

  /// Parses (keys given twice and numbers out of range are errors), applies `overrides` and
  /// validates; ConfigError on any problem.
  static TrainerConfig from_json_text(const std::string& text, const Overrides& overrides = {});
  /// Reads a file and parses it (ConfigError names the file when it cannot be read).
  static TrainerConfig from_file(const std::string& path, const Overrides& overrides = {});
  /// The raw JSON of a provider section ("{}" when absent).
  [[nodiscard]] std::string section(const std::string& name) const;
  /// Checks the rules that need the data-parallel degree (batch divisibility); ConfigError.
  void check_against_data_parallel(int dp_size) const;
  /// Gradient-accumulation steps per optimizer step for `dp_size` data-parallel ranks.
  [[nodiscard]] int64_t microbatches_per_step(int dp_size) const;
};

}  // namespace d9d
