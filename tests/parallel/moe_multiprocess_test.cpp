// Expert parallelism (d9d::parallel::ExpertParallel) and the MoE router bookkeeping on 2 and 4
// Gloo ranks against one process training the same global batch, in float64 (tolerances in
// tests/train/train_test_util.hpp), 6 optimizer steps each: ep 2 (Replicate), ep 2 x FullyShard 2,
// FullyShard 4 x ep 2 (experts sharded and reduce-scattered over ep_replicate 2), ep 2 x pp 2
// (1F1B), ep 2 with recompute; losses, gradient norms and every parameter. The auxiliary loss uses
// global-batch statistics (f summed over the data-parallel ranks per microbatch), so the
// reference's microbatch is the union of the ranks' microbatches (dp x microbatch). Also the export
// under expert parallelism (transformers' per-expert tensors, equal to the gathered experts) and a
// training checkpoint saved on ep 2 resumed in one process, and token dropping by a capacity
// factor. Tensor parallelism with MoE layers (tp 2, tp 2 x ep 2, and on 4 ranks with Replicate or
// FullyShard) against one process too, and LoRA on the experts under ep 2 and ep 2 x FullyShard 2.
#include <algorithm>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <d9d/model/hf_moe.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/util/files.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/parallel/parallel_test_util.hpp"
#include "tests/support/error_of.hpp"

namespace {

using d9d::precision::Fp64;
using d9d::testing::RankEnv;
using d9d::testing::RunOutcome;

d9d::TrainerConfig moe_run(const std::string& dir, int64_t microbatch, const std::string& mesh = "",
                           bool aux = true, bool outputs = false) {
  auto config = d9d::testing::tiny_run(dir, 6, 8, microbatch, outputs, 4, mesh);
  config.sections["model"] = d9d::testing::tiny_qwen3_moe_json(aux);
  return config;
}

template <class Plan>
RunOutcome train_moe(const d9d::DistributedContext& ctx, const d9d::TrainerConfig& config,
                     const std::function<void(d9d::detail::TrainerCore&)>& inspect = {}) {
  d9d::Trainer<Plan> trainer(ctx, d9d::Qwen3MoeProvider{}, d9d::testing::RandomWindowsProvider{},
                             d9d::CausalLmTask{}, config);
  RunOutcome out;
  out.result = trainer.train();
  if (inspect) {
    inspect(trainer.core());
  }
  out.parameters = d9d::testing::full_parameters(trainer.core());
  return out;
}

// One process, the whole global batch of 8 in microbatches of `microbatch`.
RunOutcome reference(RankEnv& env, const d9d::DistributedContext& ctx, int64_t microbatch,
                     bool aux = true) {
  const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
  return train_moe<d9d::Plan<Fp64>>(
      local, moe_run(env.scratch_dir() + "/one" + std::to_string(env.rank()), microbatch, "", aux));
}

using EpMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::ep<d9d::dynamic>>;
using ShardEpMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::ep<d9d::dynamic>>;
using Ep = d9d::parallel::ExpertParallel<>;

TEST(Moe_ExpertParallel_ws2, Ep2AndEp2TimesFsdp2MatchOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    // 2 ranks x microbatches of 2 = the reference's microbatches of 4.
    const auto want = reference(env, ctx, 4);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    // The experts are split: the gathered parameters must still be the reference's.
    d9d::testing::expect_same_run(
        train_moe<d9d::Plan<EpMesh, Ep, Fp64>>(ctx, moe_run(dir + "/ep", 2, R"({"ep": 2})")), want,
        "ep 2");
    d9d::testing::expect_same_run(
        train_moe<d9d::Plan<ShardEpMesh, Ep, d9d::parallel::Fsdp, Fp64>>(
            ctx, moe_run(dir + "/fsdp", 2, R"({"dp_shard": 2, "ep": 2})")),
        want, "ep 2 x FullyShard 2");
    d9d::testing::expect_same_run(
        train_moe<d9d::Plan<EpMesh, d9d::parallel::ExpertParallel<4>, d9d::recompute::Full, Fp64>>(
            ctx, moe_run(dir + "/recompute", 2, R"({"ep": 2})")),
        want, "ep 2 with recompute (the static expert count)");
    d9d::testing::expect_same_run(
        train_moe<d9d::Plan<EpMesh, Ep, d9d::recompute::Attention<>, Fp64>>(
            ctx, moe_run(dir + "/attention", 2, R"({"ep": 2})")),
        want, "ep 2 with the attention recomputed");
  });
}

TEST(Moe_ExpertParallel_ws4, Fsdp4TimesEp2AndEp2TimesPp2MatchOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    {
      // 4 ranks x microbatches of 1; each layer's 4 experts split over ep_shard = 2, and each
      // half sharded again over ep_replicate = 2 (ZeRO-3 of the experts): one expert per rank,
      // gathered over ep_replicate per block and reduce-scattered there.
      const auto want = reference(env, ctx, 4);
      const auto expert_layout = [&](d9d::detail::TrainerCore& core) {
        int experts = 0;
        for (const auto& record : core.parallel().parameters()) {
          if (record.domain != d9d::MeshDomain::expert) {
            continue;
          }
          ++experts;
          EXPECT_EQ(record.local.size(0), 1) << record.name;
          EXPECT_EQ(record.global_shape[0], 4) << record.name;
          EXPECT_EQ(record.dims,
                    (std::vector<std::string>{"ep_dp_replicate", "ep_shard", "ep_replicate"}));
          const auto ranges = record.sharded(core.mesh()).local_ranges();
          const int shard = core.mesh().coordinate(d9d::MeshDomain::expert, "ep_shard");
          const int replica = core.mesh().coordinate(d9d::MeshDomain::expert, "ep_replicate");
          EXPECT_EQ(ranges[0].offset, 2 * shard + replica) << record.name;
        }
        EXPECT_EQ(experts, 3 * 3) << "gate, up and down of 3 sparse layers";
      };
      d9d::testing::expect_same_run(
          train_moe<d9d::Plan<ShardEpMesh, Ep, d9d::parallel::Fsdp, Fp64>>(
              ctx, moe_run(dir + "/fsdp4", 1, R"({"dp_shard": 4, "ep": 2})"), expert_layout),
          want, "FullyShard 4 x ep 2");
    }
    // Pipelines pool the auxiliary loss per stage (not the whole model's pool): compared without
    // it; the bias balancing stays on.
    const auto want = reference(env, ctx, 4, /*aux=*/false);
    using PpMesh =
        d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>, d9d::ep<d9d::dynamic>>;
    d9d::testing::expect_same_run(
        train_moe<d9d::Plan<PpMesh, Ep, d9d::parallel::Fsdp, d9d::pipeline::OneFOneB<>, Fp64>>(
            ctx, moe_run(dir + "/pp", 2, R"({"pp": 2, "dp_shard": 2, "ep": 2})", false)),
        want, "ep 2 x FullyShard 2 x pp 2");
  });
}

// HSDP of the experts: with dp_replicate 2 x dp_shard 4 and ep 2 each layer's 4 experts are split
// over ep_shard 2, each half sharded over the 2 remaining ranks of its HSDP replica (ep_replicate)
// and replicated over the 2 replicas (ep_dp_replicate), whose shard gradients are all-reduced.
// Also HSDP 2 x 2 with ep 2, where a replica's ranks are one ep group: the experts are whole
// there and all-reduced over the replicas.
TEST(Moe_ExpertParallel_ws8, HsdpOfTheExpertsMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(8);
  d9d::testing::run_on_ranks({.world_size = 8}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    using HsdpEpMesh = d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>,
                                 d9d::ep<d9d::dynamic>>;
    // 8 data-parallel ranks x microbatches of 1 = the reference's microbatches of 8.
    const auto want = reference(env, ctx, 8);
    const auto hsdp_layout = [&](d9d::detail::TrainerCore& core) {
      const auto& mesh = core.mesh();
      EXPECT_EQ(mesh.size(d9d::MeshDomain::expert, "ep_dp_replicate"), 2);
      EXPECT_EQ(mesh.size(d9d::MeshDomain::expert, "ep_replicate"), 2);
      EXPECT_EQ(mesh.coordinate(d9d::MeshDomain::expert, "ep_dp_replicate"),
                mesh.coordinate(d9d::MeshDomain::regular, "dp_replicate"));
      int experts = 0;
      for (const auto& record : core.parallel().parameters()) {
        if (record.domain != d9d::MeshDomain::expert) {
          continue;
        }
        ++experts;
        EXPECT_EQ(record.local.size(0), 1) << record.name;  // 4 experts / ep 2 / ep_replicate 2
        EXPECT_EQ(record.dims,
                  (std::vector<std::string>{"ep_dp_replicate", "ep_shard", "ep_replicate"}));
        const auto ranges = record.sharded(mesh).local_ranges();
        const int shard = mesh.coordinate(d9d::MeshDomain::expert, "ep_shard");
        const int replica = mesh.coordinate(d9d::MeshDomain::expert, "ep_replicate");
        EXPECT_EQ(ranges[0].offset, 2 * shard + replica) << record.name;
      }
      EXPECT_EQ(experts, 3 * 3) << "gate, up and down of 3 sparse layers";
    };
    d9d::testing::expect_same_run(
        train_moe<d9d::Plan<HsdpEpMesh, Ep, d9d::parallel::Fsdp, Fp64>>(
            ctx, moe_run(dir + "/hsdp", 1, R"({"dp_replicate": 2, "dp_shard": 4, "ep": 2})"),
            hsdp_layout),
        want, "HSDP 2 x 4, ep 2");
    d9d::testing::expect_same_run(
        train_moe<d9d::Plan<HsdpEpMesh, Ep, d9d::parallel::Fsdp, Fp64>>(
            ctx, moe_run(dir + "/hsdp_whole", 1, R"({"dp_replicate": 4, "dp_shard": 2, "ep": 2})")),
        want, "HSDP 4 x 2, ep 2 (the experts whole in a replica)");
  });
}

// DeepSeek-V3's sequence-wise auxiliary loss keeps per-row statistics: neither ranks, nor
// microbatches, nor pipeline stages share any, so every run matches one process with the loss on
// (pipelines too, unlike transformers' loss pooled per stage).
// Token dropping under ep 2: each rank's forward caps every expert at ceil(c * tokens * k / E) of
// its own routings, so one process with the same microbatches (single samples; no global-batch
// auxiliary loss, whose statistics would span the ranks' microbatches) drops the same routings.
TEST(Moe_ExpertParallel_ws2, CapacityFactorDropsAsOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto with_capacity = [](d9d::TrainerConfig config) {
      auto model = nlohmann::json::parse(config.sections.at("model"));
      model["moe_capacity_factor"] = 0.5;
      config.sections["model"] = model.dump();
      return config;
    };
    const auto metrics_into = [](std::map<std::string, double>& into) {
      return [&into](d9d::detail::TrainerCore& core) {
        for (const auto& [name, value] : core.parallel().metrics()) {
          into[name] = value;
        }
      };
    };
    std::map<std::string, double> one_metrics;
    std::map<std::string, double> ep_metrics;
    const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
    const auto want = train_moe<d9d::Plan<Fp64>>(
        local,
        with_capacity(moe_run(env.scratch_dir() + "/one" + std::to_string(env.rank()), 1, "",
                              /*aux=*/false)),
        metrics_into(one_metrics));
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    d9d::testing::expect_same_run(
        train_moe<d9d::Plan<EpMesh, Ep, Fp64>>(
            ctx, with_capacity(moe_run(dir + "/ep", 1, R"({"ep": 2})", /*aux=*/false)),
            metrics_into(ep_metrics)),
        want, "ep 2, capacity factor 0.5");
    EXPECT_GT(ep_metrics.at("moe/dropped"), 0.0);
    EXPECT_EQ(ep_metrics.at("moe/dropped"), one_metrics.at("moe/dropped"));
    EXPECT_EQ(ep_metrics.at("moe/dropped_fraction"), one_metrics.at("moe/dropped_fraction"));
    EXPECT_GT(ep_metrics.at("moe/dropped_fraction"), 0.2);
  });
}

TEST(Moe_ExpertParallel_ws2, SequenceWiseAuxLossMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
    const auto sequence_run = [](const std::string& dir, int64_t microbatch,
                                 const std::string& mesh) {
      auto config = moe_run(dir, microbatch, mesh);
      auto model = d9d::testing::tiny_qwen3_moe_json();
      model.insert(model.rfind('}'), R"(, "router_aux_loss_type": "sequence")");
      config.sections["model"] = model;
      return config;
    };
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    const auto want = train_moe<d9d::Plan<Fp64>>(local, sequence_run(dir + "/one", 4, ""));
    d9d::testing::expect_same_run(
        train_moe<d9d::Plan<EpMesh, Ep, Fp64>>(ctx, sequence_run(dir + "/ep", 2, R"({"ep": 2})")),
        want, "ep 2, sequence-wise loss");
    using PpMesh = d9d::mesh<d9d::pp<d9d::dynamic>>;
    d9d::testing::expect_same_run(train_moe<d9d::Plan<PpMesh, d9d::pipeline::OneFOneB<>, Fp64>>(
                                      ctx, sequence_run(dir + "/pp", 2, R"({"pp": 2})")),
                                  want, "pp 2, sequence-wise loss");
  });
}

// LoRA on the experts (every expert of each projection adapted, stacked factors) and on q_proj:
// the adapters are expert parameters, sliced and dispatched with the experts under ep 2 and
// sharded over ep_replicate under FullyShard; the runs equal one process. The frozen experts stay
// split (their layout recorded), so the export gathers them and merges each expert's adapter; the
// exported adapter holds each expert's factors under peft's per-expert keys.
using ExpertLora = d9d::peft::Lora<4, 8, "q_proj", "gate_proj", "up_proj", "down_proj">;

TEST(Moe_ExpertParallel_ws2, LoraOnExpertsMatchesOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    const auto want = train_moe<d9d::Plan<ExpertLora, Fp64>>(local, moe_run(dir + "/one", 4));
    // The adapters trained (B starts at zero) and the base did not.
    const auto& b = want.parameters.at("model.layers.0.mlp.experts.down_proj_lora_B");
    EXPECT_EQ(b.sizes(), (std::vector<int64_t>{4, 32, 4}));
    EXPECT_GT(b.abs().max().item<double>(), 0.0);
    d9d::testing::expect_same_run(train_moe<d9d::Plan<EpMesh, Ep, ExpertLora, Fp64>>(
                                      ctx, moe_run(dir + "/ep", 2, R"({"ep": 2})")),
                                  want, "ep 2, LoRA on the experts");
    // The frozen experts are split too (their layout recorded): gathered whole for the export.
    const std::string down = "model.layers.0.mlp.experts.down_proj";
    bool laid_out = false;
    at::Tensor w;
    const auto fsdp = train_moe<d9d::Plan<ShardEpMesh, Ep, d9d::parallel::Fsdp, ExpertLora, Fp64>>(
        ctx, moe_run(dir + "/fsdp", 2, R"({"dp_shard": 2, "ep": 2})", true, /*outputs=*/true),
        [&](d9d::detail::TrainerCore& core) {
          if (const auto* layout = core.parallel().layout(down)) {
            laid_out = true;
            w = layout->sharded(core.mesh()).full_tensor().cpu();
          }
        });
    d9d::testing::expect_same_run(fsdp, want, "ep 2 x FullyShard 2, LoRA on the experts");
    ASSERT_TRUE(laid_out) << down << " has no layout record";
    if (env.rank() != 0) {
      return;
    }
    // The export merges each expert's adapter: W_e + (8 / 4) B_e A_e.
    const auto merged = w + 2.0 * at::matmul(fsdp.parameters.at(down + "_lora_B"),
                                             fsdp.parameters.at(down + "_lora_A"));
    const auto exported = d9d::model::load_hf_qwen3_moe(fsdp.result.export_dir);
    const auto got = exported->named_parameters()[down].to(at::kDouble);
    EXPECT_EQ(w.sizes(), (std::vector<int64_t>{4, 32, 16}));
    EXPECT_TRUE(at::allclose(got, merged, 1e-6, 1e-7))
        << "max diff " << (got - merged).abs().max().item<double>();
    EXPECT_GT((got - w).abs().max().item<double>(), 1e-4) << "the adapter is merged in";
    ASSERT_FALSE(fsdp.result.adapter_dir.empty());
    const auto file =
        d9d::state::SafetensorsFile(fsdp.result.adapter_dir + "/adapter_model.safetensors");
    for (int64_t e = 0; e < 4; ++e) {
      const auto key = "base_model.model.model.layers.0.mlp.experts." + std::to_string(e) +
                       ".down_proj.lora_B.weight";
      ASSERT_TRUE(file.contains(key)) << key;
      const auto saved = file.tensor(key);
      EXPECT_TRUE(at::equal(saved, fsdp.parameters.at("model.layers.0.mlp.experts.down_proj_lora_B")
                                       .select(0, e)
                                       .to(saved.scalar_type())))
          << key;
    }
    EXPECT_FALSE(file.contains("base_model.model.model.layers.0.mlp.experts.down_proj_lora_B"));
  });
}

// Tensor parallelism splits attention and the dense layer by weights and the MoE layers by tokens:
// each tp rank routes its half of the sequence (to the whole experts, or dispatched over ep), so
// the routers' statistics span the tp ranks like data-parallel ones and the MoE parameters'
// gradients are partial sums over tp. The embedding and the head stay whole (the MoE model splits
// no vocabulary).
using Tp = d9d::parallel::TensorParallel<>;

TEST(Moe_TensorParallel_ws2, Tp2AndTp2TimesEp2MatchOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    // Both tp ranks train the same microbatches of 2.
    const auto want = reference(env, ctx, 2);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    using TpMesh = d9d::mesh<d9d::tp<d9d::dynamic>>;
    d9d::testing::expect_same_run(
        train_moe<d9d::Plan<TpMesh, Tp, Fp64>>(ctx, moe_run(dir + "/tp", 2, R"({"tp": 2})")), want,
        "tp 2, the experts whole");
    using TpEpMesh = d9d::mesh<d9d::tp<d9d::dynamic>, d9d::ep<d9d::dynamic>>;
    d9d::testing::expect_same_run(train_moe<d9d::Plan<TpEpMesh, Tp, Ep, Fp64>>(
                                      ctx, moe_run(dir + "/tp_ep", 2, R"({"tp": 2, "ep": 2})")),
                                  want, "tp 2 x ep 2");
    // Sequence parallelism would need the embedding to split the residual stream.
    using TpSp = d9d::parallel::TensorParallel<d9d::parallel::SequenceParallel::on>;
    EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>([&] {
                  (void)train_moe<d9d::Plan<TpMesh, TpSp, Fp64>>(
                      ctx, moe_run(dir + "/sp", 2, R"({"tp": 2})"));
                }),
                ::testing::HasSubstr("which sequence parallelism needs to split the residual "
                                     "stream. Fix: implement it"));
  });
}

TEST(Moe_TensorParallel_ws4, Tp2TimesEp2TimesReplicateOrFullyShardMatchOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    // 2 data-parallel ranks x microbatches of 2 = the reference's microbatches of 4; each
    // microbatch's 2 x 16 tokens routed by 2 tp ranks, 8 tokens each, over ep 2.
    const auto want = reference(env, ctx, 4);
    const std::string dir = env.scratch_dir() + "/r" + std::to_string(env.rank());
    using DpTpEpMesh =
        d9d::mesh<d9d::dp_replicate<d9d::dynamic>, d9d::tp<d9d::dynamic>, d9d::ep<d9d::dynamic>>;
    d9d::testing::expect_same_run(
        train_moe<d9d::Plan<DpTpEpMesh, Tp, Ep, Fp64>>(
            ctx, moe_run(dir + "/replicate", 2, R"({"dp_replicate": 2, "tp": 2, "ep": 2})")),
        want, "Replicate 2 x tp 2 x ep 2");
    using ShardTpEpMesh =
        d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<d9d::dynamic>, d9d::ep<d9d::dynamic>>;
    d9d::testing::expect_same_run(
        train_moe<d9d::Plan<ShardTpEpMesh, Tp, Ep, d9d::parallel::Fsdp, Fp64>>(
            ctx, moe_run(dir + "/fsdp", 2, R"({"dp_shard": 2, "tp": 2, "ep": 2})")),
        want, "FullyShard 2 x tp 2 x ep 2");
  });
}

// The export gathers each layer's expert shards and writes transformers' per-expert tensors.
TEST(Moe_ExpertParallel_ws2, ExportsTransformersTensors) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    auto config = moe_run(env.scratch_dir() + "/run", 2, R"({"ep": 2})", true, /*outputs=*/true);
    config.run.total_steps = 2;
    config.logging.progress = false;
    d9d::Trainer<d9d::Plan<EpMesh, Ep>> trainer(ctx, d9d::Qwen3MoeProvider{},
                                                d9d::testing::RandomWindowsProvider{},
                                                d9d::CausalLmTask{}, config);
    const auto result = trainer.train();
    const auto parameters = d9d::testing::full_parameters(trainer.core());
    if (env.rank() != 0) {
      return;
    }
    const auto file = d9d::state::SafetensorsFile(result.export_dir + "/model.safetensors");
    EXPECT_TRUE(file.contains("model.layers.3.mlp.experts.3.gate_proj.weight"));
    d9d::testing::expect_exported_equals(*d9d::model::load_hf_qwen3_moe(result.export_dir),
                                         parameters);
  });
}

// The model's buffers (the routers' selection biases), copied to the host.
std::map<std::string, at::Tensor> buffers_of(d9d::detail::TrainerCore& core) {
  std::map<std::string, at::Tensor> out;
  for (const auto& module : core.parallel().modules()) {
    for (const auto& item : module->named_buffers()) {
      out[item.key()] = item.value().detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    }
  }
  return out;
}

// The router's metrics reach the step's log; a checkpoint saved under ep 2 resumes in one process
// (the records say where each expert shard belongs), selection biases included: the resumed run
// ends with the uninterrupted run's biases.
TEST(Moe_ExpertParallel_ws2, MetricsAndACheckpointResumedInOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string root = env.scratch_dir() + "/ckpt";
    auto config = moe_run(root + "/ep", 2, R"({"ep": 2})");
    config.checkpoint.dir = root + "/ep/checkpoints";
    config.checkpoint.every = 2;
    config.checkpoint.keep = 4;
    config.checkpoint.async = false;
    config.logging.pictures = true;
    d9d::Trainer<d9d::Plan<EpMesh, Ep, Fp64>> trainer(ctx, d9d::Qwen3MoeProvider{},
                                                      d9d::testing::RandomWindowsProvider{},
                                                      d9d::CausalLmTask{}, config);
    const auto result = trainer.train();
    std::map<std::string, double> metrics;
    for (const auto& [name, value] : trainer.core().parallel().metrics()) {
      metrics[name] = value;
    }
    EXPECT_GE(metrics.at("moe/load_max_over_mean"), 1.0);
    EXPECT_EQ(metrics.at("moe/dropped"), 0.0);
    // 8 samples x 16 tokens x top 2 x 3 sparse layers, over both ranks.
    EXPECT_EQ(metrics.at("moe/routed_per_step"), 8 * 16 * 2 * 3);
    EXPECT_GT(metrics.at("moe/aux_loss"), 0.0);
    // Every sparse layer's balance in model order: the aggregate is their mean, the worst their
    // maximum; the main rank draws them with the mean and the worst in router_balance.svg.
    double mean = 0.0;
    double worst = 0.0;
    for (const std::string layer : {"0", "1", "2"}) {
      const double ratio = metrics.at("moe/load_max_over_mean/layer_" + layer);
      EXPECT_GE(ratio, 1.0) << layer;
      mean += ratio / 3.0;
      worst = std::max(worst, ratio);
    }
    EXPECT_NEAR(metrics.at("moe/load_max_over_mean"), mean, 1e-12);
    EXPECT_EQ(metrics.at("moe/load_max_over_mean_worst_layer"), worst);
    // The most loaded ep rank's rows over its half: at least balanced, at most all of them, and no
    // more than the most loaded expert's over the mean (a rank's mean expert).
    const double rank_load = metrics.at("moe/ep_rank_load_max");
    EXPECT_GE(rank_load, 1.0);
    EXPECT_LE(rank_load, 2.0);
    EXPECT_LE(rank_load, metrics.at("moe/load_max_over_mean") + 1e-12);
    EXPECT_GE(metrics.at("moe/ep_rank_load_max_worst_layer"), rank_load);
    if (ctx.is_main_process()) {
      std::ifstream file(root + "/ep/router_balance.svg");
      ASSERT_TRUE(file) << "no router_balance.svg";
      const std::string svg((std::istreambuf_iterator<char>(file)),
                            std::istreambuf_iterator<char>());
      EXPECT_THAT(svg, ::testing::HasSubstr(">mean over 3 layers</text>"));
      EXPECT_THAT(svg, ::testing::HasSubstr(">worst layer</text>"));
      std::size_t curves = 0;
      for (auto at = svg.find("<polyline"); at != std::string::npos;
           at = svg.find("<polyline", at + 1)) {
        ++curves;
      }
      EXPECT_EQ(curves, 5U);  // 3 layers, the worst, the mean
    }
    const auto biases = buffers_of(trainer.core());
    ASSERT_EQ(biases.size(), 3U);  // the 3 sparse layers' routers
    ctx.barrier();
    // The checkpoint stores the biases after 2 steps (one rank writes them), which have moved off
    // zero (a layer's +rate and -rate steps may cancel: not every one).
    const d9d::state::SafetensorsFile stored(root + "/ep/checkpoints/step-2/rank-0.safetensors");
    double moved = 0;
    for (const auto& [name, bias] : biases) {
      ASSERT_TRUE(stored.contains("buffer/" + name)) << name;
      moved += stored.tensor("buffer/" + name).abs().sum().item<double>();
    }
    EXPECT_GT(moved, 0.0);
    EXPECT_FALSE(d9d::state::SafetensorsFile(root + "/ep/checkpoints/step-2/rank-1.safetensors")
                     .contains("buffer/" + biases.begin()->first));
    const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
    auto resumed = moe_run(root + "/one" + std::to_string(env.rank()), 4);
    resumed.checkpoint.resume_from = root + "/ep/checkpoints/step-2";
    resumed.checkpoint.dir = root + "/one" + std::to_string(env.rank()) + "/checkpoints";
    std::map<std::string, at::Tensor> resumed_biases;
    const auto again = train_moe<d9d::Plan<Fp64>>(
        local, resumed, [&](d9d::detail::TrainerCore& core) { resumed_biases = buffers_of(core); });
    ASSERT_EQ(again.result.start_step, 2);
    for (std::size_t i = 0; i < again.result.losses.size(); ++i) {
      EXPECT_NEAR(again.result.losses[i], result.losses[i + 2],
                  d9d::testing::kLossRtol * result.losses[i + 2])
          << "step " << i + 2;
    }
    // Each update moves a bias by +-rate from the step's summed loads: equal loads, equal biases.
    ASSERT_EQ(resumed_biases.size(), biases.size());
    for (const auto& [name, bias] : biases) {
      EXPECT_TRUE(at::equal(resumed_biases.at(name), bias)) << name;
    }
  });
}

// A checkpoint without the model's buffers (written before checkpoints stored them; here: by a
// model without the selection bias) still resumes a model that has them: they keep their initial
// values, the log warns, and training goes on from the checkpoint's step.
TEST(Moe_Checkpoint, ResumesACheckpointWithoutBuffers) {
  const auto local = d9d::DistributedContext::local({.device = "cpu"});
  const std::string root = ::testing::TempDir() + "/d9d_moe_without_buffers";
  d9d::files::remove_tree(root);
  auto config = moe_run(root + "/no_bias", 4);
  config.sections["model"] = d9d::testing::tiny_qwen3_moe_json(true, 0.0);
  config.checkpoint.dir = root + "/no_bias/checkpoints";
  config.checkpoint.every = 2;
  config.checkpoint.keep = 4;
  config.checkpoint.async = false;
  (void)train_moe<d9d::Plan<Fp64>>(local, config);
  auto resumed = moe_run(root + "/bias", 4);  // router_bias_update_rate 0.001: the buffers exist
  resumed.checkpoint.resume_from = root + "/no_bias/checkpoints/step-2";
  resumed.checkpoint.dir = root + "/bias/checkpoints";
  std::map<std::string, at::Tensor> biases;
  const auto again = train_moe<d9d::Plan<Fp64>>(
      local, resumed, [&](d9d::detail::TrainerCore& core) { biases = buffers_of(core); });
  EXPECT_EQ(again.result.start_step, 2);
  EXPECT_EQ(again.result.losses.size(), 4U);
  ASSERT_EQ(biases.size(), 3U);
  // Four updates of +-rate from uneven loads: the biases left zero.
  EXPECT_TRUE(std::any_of(biases.begin(), biases.end(), [](const auto& item) {
    const at::Tensor& bias = item.second;
    return at::any(bias != 0).item<bool>();
  }));

  // Resumed at the checkpoint's own step (nothing left to train): the buffers it lacks hold their
  // initial values (zeros), and the log names one of them and counts the rest.
  auto at_end = moe_run(root + "/bias_at_end", 4);
  at_end.run.total_steps = 2;
  at_end.checkpoint.resume_from = root + "/no_bias/checkpoints/step-2";
  at_end.checkpoint.dir = root + "/bias_at_end/checkpoints";
  std::map<std::string, at::Tensor> initial;
  ::testing::internal::CaptureStderr();
  const auto idle = train_moe<d9d::Plan<Fp64>>(
      local, at_end, [&](d9d::detail::TrainerCore& core) { initial = buffers_of(core); });
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(idle.result.start_step, 2);
  EXPECT_TRUE(idle.result.losses.empty());
  EXPECT_THAT(log, ::testing::HasSubstr("warning: the checkpoint " + at_end.checkpoint.resume_from +
                                        " has no \"model.layers."));
  EXPECT_THAT(log, ::testing::HasSubstr(".expert_bias\" (and 2 more buffers: saved before "
                                        "checkpoints stored buffers); they keep their initial "
                                        "values"));
  ASSERT_EQ(initial.size(), 3U);
  for (const auto& [name, bias] : initial) {
    EXPECT_TRUE(at::equal(bias, at::zeros_like(bias))) << name << ": " << bias;
  }
}

}  // namespace
