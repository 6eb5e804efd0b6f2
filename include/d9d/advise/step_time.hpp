// d9d/advise/step_time.hpp — how long a Plan's training step will take on a machine, before
// launch: the Plan advisor's step time (docs/advise.md, "Step time"), from a machine profile that
// tools/gpu/profile-machine measures once.
//
//   const auto machine = d9d::advise::MachineProfile::from_file("docs/profiles/h200-1gpu.json");
//   const auto time = d9d::advise::predict_step_time(model_config, candidate,
//                                                    {.microbatch_size = 4,
//                                                     .sequence_length = 2048,
//                                                     .precision = rules,
//                                                     .compute = Compute::bf16_autocast},
//                                                    machine);
//   time.total; time.tokens_per_second(); time.gemm; time.bubble; ...
//
// The model (dense Qwen3 as d9d::model::Qwen3ForCausalLM runs it), per rank and microbatch:
//   gemm       every linear layer's three matmuls (forward x W^T, input gradient dy W, weight
//              gradient dy^T x) at the profile's measured time for that shape and layout (the
//              nearest measured shape's rate where the exact one was not measured); under tensor
//              parallelism each rank's slice (Megatron's layout), under context parallelism its
//              chunks' tokens; the head's on the last stage
//   attention  the causal attention kernel's forward and backward at the nearest measured shape,
//              scaled by FLOPs (a cp rank does 1/cp of the sequence's)
//   memory     the elementwise kernels (norms, rotary, SiLU-mul, residual adds, autocast's casts)
//              as bytes moved at the profile's elementwise bandwidth: the forward's bytes counted
//              from the model's code, the backward's as twice them; per microbatch the gradient
//              accumulation, and under autocast its share of the step's weight casts (each
//              weight is cast once per step); per step the optimizer (AdamW reads
//              the parameter, gradient and moments and writes three of them), the clipping norm
//              and the gradients' zeroing
//   recompute  a recomputed layer's forward matmuls, attention and elementwise bytes run again
//              in its backward (only its attention part's under recompute::Attention<K>)
// and the communication at the profile's measured collective times (scaled from the ranks it
// was measured on to the group's size by the ring's (g - 1) / g):
//   Replicate     one all-reduce of the gradients per step
//   FullyShard    all-gathers of the bfloat16 parameters (forward, and again in backward when
//                 units reshard after forward) and reduce-scatters of the gradients (every
//                 microbatch, or once with reduce_every_microbatch off); HSDP adds the replicas'
//                 all-reduce of the shards
//                 Both count whole: on two H200s the measured steps grew by about the
//                 collectives' time over one GPU's (the overlap d9d issues does not shorten the
//                 step yet; docs/measurements/2026-11-28-advisor-step-time-2xh200.txt)
//   tensor        sequence parallelism's all-gather and reduce-scatter of the residual stream
//                 around attention and the MLP (two each per layer in the forward, two each in
//                 the backward) and around the head, on the critical path
//   context       the ring's K/V exchanges (and dK/dV in the backward), hidden behind attention
//                 where they fit
//   pipeline      the schedule program simulated (d9d::pipeline::simulate) at one stage's
//                 forward, input-gradient and weight-gradient times with the activations'
//                 point-to-point transfer added to F and I; the idle time is the bubble
// The step is the microbatches' compute (under a pipeline the program's makespan) plus the
// optimizer and the exposed data-parallel communication — unless the host takes longer to issue
// it: where the profile measured the host's cost for the step's kind and compute (HostCost:
// per decoder layer and microbatch, per microbatch and per step, tools/gpu/profile-host), the
// step is the longer of the two, and under a pipeline every action takes the longer of its
// kernels and its host time. Not modelled: the data-parallel strategies' own host work, Float8.
//
// A PEFT policy (StepOptions::peft; no pipeline, tensor parallelism, FullyShard or recompute yet)
// changes the matmuls and the state the step updates, from the model's parameters under it
// (apply_peft): a frozen linear layer computes no weight gradient (the tied head none when the
// embedding is frozen); each LoRA adapter adds its six thin GEMMs (h = s x A^T, y += h B^T,
// dh = s g B, dx += dh A, A's and B's gradients), each the longer of the profile's time at its
// FLOPs and its bfloat16 operands' bytes at the elementwise bandwidth; only the trained
// parameters' gradients accumulate, are reduced and updated by AdamW (every weight is still cast
// under autocast). Not modelled: the adapters' extra host work (a profile's HostCost is full
// training's).
//
// A Qwen3-MoE (the overload taking an ExpertSplit; no pipeline, tensor or context parallelism,
// no recompute) is the dense model with each MoE layer's block in place of the MLP, per MoE layer
// and microbatch:
//   router     its [experts, hidden] matmul's three GEMMs (in gemm)
//   experts    the routed experts' grouped GEMMs and silu(gate) * up, forward and backward, at the
//              profile's grouped_experts time for the rank's experts and rows (tokens x top-k x
//              the split's load), the nearest measured shape scaled by FLOPs
//   memory     the router's float32 logits, softmax and top-k, the rows' permutation to the
//              experts and back (and under expert parallelism the received rows' into expert
//              order and back), the weighted sum of each token's k outputs; backward twice the
//              forward's bytes; float32 experts under bfloat16 parameters (ExpertSplit::
//              float32_experts) their casts and float32 gradients' accumulation
//   expert parallel   four all-to-alls of the routed rows (dispatch and combine, forward and
//              backward) at the profile's all_to_all time for tokens x top-k x hidden x the
//              activations' element x load bytes, and one of the routing's per-expert counts,
//              all on the critical path (d9d waits for them before the experts run)
// The data-parallel strategy moves the non-expert parameters as for the dense model; the experts'
// go over the ranks that hold the same experts (d9d::DeviceMesh's expert domain): FullyShard
// shards them over ep_replicate and all-reduces over the HSDP replicas, and leaves them whole,
// all-reduced, when ep_replicate is 1; Replicate all-reduces them. Not
// modelled: the MoE block's own host work (it reads the routing's counts on the host before the
// all-to-all), the auxiliary loss and the router's bias update (small elementwise work).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <d9d/advise/activation_memory.hpp>
#include <d9d/advise/candidates.hpp>
#include <d9d/advise/state_memory.hpp>

namespace d9d::model {
struct Qwen3Config;
struct Qwen3MoeConfig;
}  // namespace d9d::model

namespace d9d::advise {

/// One measured bfloat16 matmul C[m, n] = A[m, k] B[k, n] (float32 accumulation). `layout`: "nt"
/// (A row-major, B the transpose of a row-major [n, k]: a linear layer's forward), "nn" (its
/// input gradient) or "tn" (A the transpose of a row-major [k, m]: its weight gradient).
struct MeasuredGemm {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  std::string layout{};
  double seconds = 0;
};

/// One measured causal attention ([batch, heads, sequence, head_dim] queries, kv_heads keys and
/// values), forward and backward.
struct MeasuredAttention {
  int64_t batch = 0;
  int64_t sequence = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  double forward_seconds = 0;
  double backward_seconds = 0;
};

/// One measured MoE layer's routed experts (tools/gpu/profile_machine.py's grouped_experts):
/// `groups` experts over `rows` routed rows (balanced) of `hidden` into `intermediate`, the grouped
/// gate, up and down GEMMs with silu(gate) * up, forward and backward.
struct MeasuredGroupedExperts {
  int64_t groups = 0;
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  double forward_seconds = 0;
  double backward_seconds = 0;
};

/// A collective's time by the bytes each rank passes, measured on `MachineProfile::ranks`.
struct CollectiveCurve {
  std::vector<std::pair<int64_t, double>> points{};  ///< (bytes, seconds), ascending bytes

  /// Log-log interpolation between the points; below the first, the first's time (latency);
  /// above the last, the last's bandwidth. std::logic_error without points.
  [[nodiscard]] double seconds(int64_t bytes) const;
};

/// The host's time issuing a training step's work (one thread per rank dispatching operators and
/// launching kernels, which the device runs asynchronously), measured by tools/gpu/profile-host:
/// example 03's step on a model narrow enough that the device always waits for the host, at two
/// layer counts and two microbatch counts, fitted as
///   step = per_step + microbatches x (per_microbatch + layers x per_layer).
struct HostCost {
  double per_layer = 0;       ///< one decoder layer's forward and backward, one microbatch
  double per_microbatch = 0;  ///< a microbatch's other work: embedding, head and loss, batching
  double per_step = 0;        ///< the step's own: gradient norm and clipping, optimizer, metrics
};

/// What tools/gpu/profile-machine measured (its JSON: tools/gpu/profile_machine.py).
struct MachineProfile {
  std::string device{};
  int ranks = 1;  ///< the GPUs the collectives ran over
  std::vector<MeasuredGemm> gemm{};
  std::vector<MeasuredAttention> attention{};
  std::vector<MeasuredGroupedExperts> grouped_experts{};  ///< empty when not measured
  double memory_bytes_per_second = 0;  ///< an elementwise kernel's bytes read and written
  /// all_reduce, all_gather (bytes: its output), reduce_scatter (its input), all_to_all, p2p.
  std::map<std::string, CollectiveCurve, std::less<>> collectives{};
  /// The host's costs by compute ("bf16_autocast", "bf16_parameters") and step kind: "plain" (no
  /// pipeline, tp 1), "pipelined" (the pipeline executor's step) and "tensor" (tp > 1); what was
  /// not measured is absent, and such steps get no host term.
  std::map<std::string, std::map<std::string, HostCost, std::less<>>, std::less<>> host{};

  /// std::invalid_argument naming what is missing or malformed.
  [[nodiscard]] static MachineProfile from_json_text(std::string_view text);
  [[nodiscard]] static MachineProfile from_file(const std::string& path);

  /// The seconds of an (m, n, k) matmul in `layout`: the measured time of that shape, else the
  /// nearest measured shape of the layout (by the sum of |log| size ratios) at its FLOP rate.
  /// std::invalid_argument when the profile has no matmul of the layout.
  [[nodiscard]] double gemm_seconds(int64_t m, int64_t n, int64_t k, std::string_view layout) const;
  /// Forward and backward seconds of causal attention, from the nearest measured shape (by
  /// batch x heads, sequence and head_dim) scaled by FLOPs (batch x heads x sequence^2 x dim).
  [[nodiscard]] std::pair<double, double> attention_seconds(int64_t batch, int64_t sequence,
                                                            int64_t heads, int64_t kv_heads,
                                                            int64_t head_dim) const;
  /// Forward and backward seconds of `groups` routed experts over `rows` rows: the nearest measured
  /// grouped_experts entry (by the sum of |log| ratios of groups, rows, hidden and intermediate)
  /// scaled by FLOPs (rows x hidden x intermediate). std::invalid_argument when the profile has
  /// none (tools/gpu/profile-machine measures them for the Qwen3-MoE configs it is given).
  [[nodiscard]] std::pair<double, double> grouped_experts_seconds(int64_t groups, int64_t rows,
                                                                  int64_t hidden,
                                                                  int64_t intermediate) const;
  /// The seconds of collective `name` passing `bytes` per rank over `group` ranks: the measured
  /// curve scaled by (group - 1) / group over (ranks - 1) / ranks (p2p: not scaled); 0 for a
  /// group of one. std::invalid_argument when the profile did not measure it (one GPU).
  [[nodiscard]] double collective_seconds(std::string_view name, int64_t bytes, int group) const;
  /// The host's costs of a step of `kind` computing as `compute`, or null when not measured.
  [[nodiscard]] const HostCost* host_cost(Compute compute, std::string_view kind) const;
};

/// What the Plan runs, besides its shape (the Candidate).
struct StepOptions {
  int64_t microbatch_size = 1;
  int64_t sequence_length = 1;
  StateRules precision{};               ///< the parameters', gradients' and moments' dtypes
  Compute compute = Compute::float32;   ///< how the forward computes
  Recompute recompute{};                ///< which layers recompute what in backward
  bool reduce_bf16 = false;             ///< data-parallel gradients reduced in bfloat16
  bool reshard_after_forward = true;    ///< FullyShard: units gathered again for the backward
  bool reduce_every_microbatch = true;  ///< FullyShard: a reduce-scatter per microbatch
  /// A PEFT policy (d9d::peft::stack_spec<Plan::peft>()); empty: every parameter trains.
  std::optional<peft::StackSpec> peft{};
};

/// A rank's predicted step, in seconds (see the file comment).
struct StepTime {
  double gemm = 0;                   ///< matmuls of the step (all microbatches)
  double attention = 0;              ///< attention kernels of the step
  double memory = 0;                 ///< elementwise kernels, weight casts, gradient accumulation
  double optimizer = 0;              ///< AdamW, clipping, zeroing
  double tensor_parallel = 0;        ///< sequence parallelism's collectives (on the critical path)
  double context_parallel = 0;       ///< the ring's exchanges not hidden behind attention
  double pipeline_p2p = 0;           ///< activations and their gradients sent between stages
  double bubble = 0;                 ///< idle time of the pipeline program
  double data_parallel = 0;          ///< the data-parallel collectives' whole time
  double data_parallel_exposed = 0;  ///< the part on the step's time (all of it, so far)
  double experts = 0;                ///< a MoE's routed experts (grouped GEMMs, silu-mul)
  double expert_parallel = 0;        ///< a MoE's all-to-alls (on the critical path)
  /// The host's time issuing the step (0 where the profile has no HostCost for it); the step is
  /// host-bound when it is `total`.
  double host = 0;
  double total = 0;
  int64_t tokens = 0;  ///< the whole step's tokens (all ranks)

  [[nodiscard]] double tokens_per_second() const {
    return total > 0 ? static_cast<double>(tokens) / total : 0.0;
  }
};

/// The step of `candidate` for `config`'s dense Qwen3 on `machine` (see the file comment): the
/// slowest pipeline rank's. std::invalid_argument for sizes below 1 or a collective the profile
/// lacks.
[[nodiscard]] StepTime predict_step_time(const model::Qwen3Config& config,
                                         const Candidate& candidate, const StepOptions& options,
                                         const MachineProfile& machine);

/// The same with the pipeline's program given (a Plan's own schedule, Plan::pipeline::build)
/// instead of built from candidate.schedule; unused when candidate.pp is 1.
[[nodiscard]] StepTime predict_step_time(const model::Qwen3Config& config,
                                         const Candidate& candidate,
                                         const pipeline::Program& program,
                                         const StepOptions& options, const MachineProfile& machine);

/// The step of `candidate` for `config`'s Qwen3-MoE with its experts split as `experts` says
/// (ranks: the expert-parallel degree; load: the rows this rank's experts get over balanced), on
/// `machine` (see the file comment). std::invalid_argument for sizes below 1, a pipeline, tensor
/// or context parallelism, recompute, a capacity factor, experts or data-parallel ranks that do not
/// split over ep, or what the profile lacks (grouped_experts, a collective).
[[nodiscard]] StepTime predict_step_time(const model::Qwen3MoeConfig& config,
                                         const Candidate& candidate, ExpertSplit experts,
                                         const StepOptions& options, const MachineProfile& machine);
/// A Qwen3-MoE needs its ExpertSplit (the dense overload would predict dense MLPs).
StepTime predict_step_time(const model::Qwen3MoeConfig& config, const Candidate& candidate,
                           const StepOptions& options, const MachineProfile& machine) = delete;

}  // namespace d9d::advise
