// d9d/parallel/policies.hpp — data-parallel policies: how the dp_replicate / dp_shard ranks of the
// mesh share the model.
//
//   using MyPlan = d9d::Plan<d9d::mesh<d9d::dp_shard<8>>, d9d::parallel::FullyShard<>>;
//   static_assert(MyPlan::data_parallel::shards_parameters);
//   static_assert(std::is_same_v<d9d::Plan<>::data_parallel, d9d::parallel::Replicate>);
//
// Each models d9d::plan_policy for d9d::slot::data_parallel and states its facts as members; the
// component that implements it is d9d::parallel::strategy<Policy> (d9d/parallel/parallelize.hpp).
// Replicate (the default, d9d/plan/defaults.hpp): whole model per rank, gradients all-reduced.
// FullyShard (ZeRO-3): parameters, gradients and optimizer state sharded over dp_shard, gathered
// per unit around its use; with dp_replicate > 1 as well it is HSDP (shards all-reduced across the
// replicas). ExpertParallel (the expert_parallel slot; default NoExpertParallel): MoE experts split
// over the mesh's ep ranks. TensorParallel (the tensor_parallel slot; default NoTensorParallel):
// attention heads, the MLP's intermediate dimension and the vocabulary split over the mesh's tp
// ranks. ContextParallel (the context_parallel slot; default NoContextParallel): each sequence
// split over the mesh's cp ranks.
#pragma once

#include <d9d/plan/defaults.hpp>  // Replicate, the default; precision::Dtype
#include <d9d/plan/degrees.hpp>   // d9d::dynamic

namespace d9d::parallel {

/// When FullyShard frees a unit's gathered parameters after its forward.
enum class Reshard {
  after_forward,  ///< every unit (gathered again for its backward): least memory
  never,          ///< keep every unit gathered until the step's gradients are reduced
  all_but_last,   ///< every unit but the last (whose backward comes first)
  from_config,    ///< the config's "data_parallel.reshard" (default "after_forward")
};

/// The dtype FullyShard reduces gradients in.
enum class ReduceDtype {
  as_precision,  ///< the precision policy's `reduce` (float32 under Fp32 and Bf16Mixed)
  float32,
  bfloat16,  ///< halves the reduce-scatter traffic; needs bfloat16 compute (Bf16Mixed)
};

/// Fully sharded data parallelism (ZeRO-3) over dp_shard; HSDP when dp_replicate > 1 too.
///
/// Each parameter is split along its first dimension over the dp_shard ranks (torch.chunk's rule:
/// ceil(n / ranks) rows each, the last ranks fewer, possibly none); the optimizer updates only
/// this rank's rows. A unit (by default each decoder block — a d9d::model::Block — and one unit of
/// the parameters outside every block, e.g. embedding, final norm and head) is all-gathered before
/// its forward, with the next unit prefetched; `R` says when it is freed again. Its gradients are
/// reduce-scattered as soon as its backward is done (overlapping the rest of the backward), summed
/// into the shards' gradients, and all-reduced over dp_replicate. Under a pipeline schedule `R`
/// applies per stage (a block is gathered for its actions and freed after them, prefetching only
/// within the stage) and a stage's units are reduced once the program has run that stage's last
/// gradient action, overlapping the rest of the program. Units are gathered in the precision's
/// compute dtype: under Bf16Mixed every parameter of a unit, the norms' too, is bfloat16 in the
/// forward (where autocast in one process keeps the norms' weights float32), so the gradients
/// differ from one process's Bf16Mixed ones by a few bfloat16 roundings (measured 2.5u against
/// float32, one process 1.8u; tests/parallel/mixed_precision_multiprocess_test bounds it at 4u).
template <Reshard R = Reshard::from_config, ReduceDtype D = ReduceDtype::as_precision>
struct FullyShard {
  using d9d_slot = slot::data_parallel;
  static constexpr bool shards_parameters = true;
  static constexpr Reshard reshard = R;
  static constexpr ReduceDtype reduce_dtype = D;
};

/// FullyShard with its defaults.
using Fsdp = FullyShard<>;

/// Expert parallelism (the expert_parallel slot) over the mesh's expert domain (pp,
/// ep_dp_replicate, ep_replicate, ep_shard = ep; d9d/core/device_mesh.hpp): each mixture-of-experts
/// layer's routed experts (d9d::model::GroupedExperts) are split over the ep_shard ranks, E / ep
/// consecutive experts each; every layer sends each (token, expert) row to the rank holding the
/// expert and back by two all-to-alls with uneven splits (the per-expert counts are exchanged
/// first). The experts' gradients are summed over ep_dp_replicate x ep_replicate (the ranks holding
/// the same experts; under FullyShard sharded over ep_replicate, HSDP's replicas over
/// ep_dp_replicate), the other parameters go to the data_parallel policy (Replicate or FullyShard)
/// as usual. `NumExperts` (optional) states the model's expert count so that a static ep that does
/// not divide it fails to compile; the model's count is checked at start-up either way.
///
/// Named ExpertParallel, not ep::Experts: d9d::ep<N> is the mesh degree (d9d/plan/degrees.hpp),
/// so a namespace d9d::ep cannot exist (docs/design/0009-moe-expert-parallel.md).
template <int NumExperts = dynamic>
struct ExpertParallel {
  using d9d_slot = slot::expert_parallel;
  static constexpr int num_experts = NumExperts;
  static_assert(NumExperts == dynamic || NumExperts >= 1,
                "d9d::parallel::ExpertParallel<NumExperts>: NumExperts must be >= 1 or "
                "d9d::dynamic. Fix: d9d::parallel::ExpertParallel<> leaves it to the model");
};

/// Whether TensorParallel runs sequence parallelism (below).
enum class SequenceParallel { off, on };

/// Tensor parallelism (the tensor_parallel slot) over the regular domain's tp ranks, Megatron's
/// layout: attention q/k/v column-parallel by heads (num_heads / tp query and num_kv_heads / tp KV
/// heads per rank; the per-head q/k norms stay whole), o_proj row-parallel; the MLP's gate/up
/// column-parallel and down row-parallel; the token embedding split by vocabulary (ids outside a
/// rank's slice embed as zeros, the parts are summed) and the LM head column-parallel over the
/// vocabulary with the loss-parallel cross-entropy, which never gathers the logits (a tied head is
/// the embedding's shard). Each column-parallel block's input sums its gradient over tp and each
/// row-parallel block's output is summed over tp (Megatron's f/g autograd functions). tp must
/// divide num_attention_heads, num_key_value_heads, intermediate_size and vocab_size (checked when
/// applied). Composes with Replicate, with FullyShard (which shards the tp shards over dp_shard),
/// with LoRA (the adapters split with their layers) and with pipeline schedules (the last stage
/// gathers its logits; the loss-parallel cross-entropy is not used there yet); MoE models are not
/// supported yet (docs/design/0011-tensor-parallel.md).
///
/// `SequenceParallel::on`: the residual stream, the norms and the residual additions run on this
/// rank's B T / tp tokens of the microbatch (d9d::model::TensorParallelGroup::copy_in says which);
/// the all-reduces become an all-gather of the tokens before each
/// column-parallel block and a reduce-scatter after each row-parallel one (and the embedding), so
/// activations between blocks take 1/tp of the memory. The norms' gradients are then partial and
/// summed over tp. Needs tp > 1 and a sequence length divisible by tp; not under a pipeline
/// schedule yet (a compile-time error there).
///
/// Named TensorParallel, not tp::Tensor: d9d::tp<N> is the mesh degree (d9d/plan/degrees.hpp).
template <SequenceParallel SP = SequenceParallel::off>
struct TensorParallel {
  using d9d_slot = slot::tensor_parallel;
  static constexpr bool sequence_parallel = SP == SequenceParallel::on;
};

/// How ContextParallel brings every rank's keys and values to each rank's queries.
enum class KvRotation {
  all_gather,  ///< one all-gather of K/V per layer (Llama 3's choice; backward: reduce-scatter)
  ring,        ///< passed around the ring point-to-point, cp − 1 hops (backward: the reverse)
};

/// Context parallelism (the context_parallel slot) over the batch domain's cp ranks (cp_shard ×
/// cp_replicate): each sequence is cut into 2·cp chunks and rank r holds chunks r and 2·cp − 1 − r
/// (causal load balancing: every rank's queries see as many keys), tokens, labels, positions and
/// packed-document placements alike. Attention runs block by block over every rank's keys and
/// values, brought by `R`, the blocks merged by their log-sum-exps (online softmax). Every cp rank
/// reads the same samples; the loss sums and token counts are summed over cp and the gradients over
/// dp × cp by the data_parallel policy: Replicate all-reduces over both, FullyShard shards the
/// parameters over dp_shard × cp_shard (the dense domain's dp_cp_shard) and all-reduces the shards
/// over dp_replicate × cp_replicate. Needs a model that implements d9d::model::ContextParallelModel
/// (dense Qwen3 and its pipeline stages) and a sequence length divisible by 2·cp. Under a pipeline
/// schedule the first stage cuts its ids and the task's output_loss gets the rank's
/// d9d::SequencePart to cut its targets alike (docs/design/0018-context-parallel.md).
template <KvRotation R = KvRotation::all_gather>
struct ContextParallel {
  using d9d_slot = slot::context_parallel;
  static constexpr KvRotation rotation = R;
};

}  // namespace d9d::parallel
