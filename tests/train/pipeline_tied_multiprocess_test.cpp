// Tied embeddings across pipeline stages and the model export of pipelined runs, on 2 and 4 Gloo
// ranks against one process without a pipeline (float64, d9d::precision::Fp64).
//
// Tolerances (tests/train/train_test_util.hpp): a pipelined run and the single process differ only
// in the order of sums — here also the tied embedding's gradient, one sum of the embedding's and
// the head's parts in the single process, the same two parts added after the reductions in the
// pipeline — so losses and gradient norms agree to kLossRtol and parameters to kParameterAtol.
// The export writes float32: each tensor of the pipelined export is its run's own parameter
// rounded to float32 (bit for bit), and it differs from the single process's export by at most
// kParameterAtol plus one float32 rounding of each (2^-24 relative each way).
// The two holders of a tied embedding get the same gradient and the same update, so they stay
// bit-identical (checked across ranks).
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <d9d/core/collectives.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/train/trainer.hpp>
#include <d9d/util/files.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/train/train_test_util.hpp"

namespace {

using d9d::precision::Fp64;
using d9d::testing::kLossRtol;
using d9d::testing::kParameterAtol;
using d9d::testing::RankEnv;

using PipelineMesh = d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_replicate<d9d::dynamic>>;
using ShardMesh = d9d::mesh<d9d::pp<d9d::dynamic>, d9d::dp_shard<d9d::dynamic>>;
using OneProcessPlan = d9d::Plan<Fp64>;
using V2 = d9d::pipeline::stages_per_rank<2>;

constexpr const char* kEmbedding = "model.embed_tokens.weight";
constexpr int kLayers = 4;
constexpr int64_t kSteps = 5;

// One float32 rounding relative error (2^-24), each way: the two exports' bound beyond
// kParameterAtol.
constexpr double kFloat32Rtol = 2.0 * 5.97e-8;

struct Run {
  std::string name;
  std::string mesh;  // the "mesh" section; "" for the single process
  bool tied = true;
  std::string model_json;  // "" for tiny_qwen3_json(tied, kLayers)
  std::string init_from;   // a Hugging Face checkpoint, or ""
};

Run tiny(const std::string& name, const std::string& mesh, bool tied = true) {
  return {.name = name, .mesh = mesh, .tied = tied, .model_json = "", .init_from = ""};
}

d9d::TrainerConfig config_of(const Run& run, const std::string& out) {
  auto cfg =
      d9d::testing::tiny_run(out, kSteps, 8, run.mesh.empty() ? 8 : 2, false, kLayers, run.mesh);
  cfg.sections["model"] =
      run.model_json.empty() ? d9d::testing::tiny_qwen3_json(run.tied, kLayers) : run.model_json;
  cfg.export_model.enabled = true;
  cfg.checkpoint.init_from = run.init_from;
  return cfg;
}

// Every trained parameter whole, by name (collective: gathers shards; a tied copy gives the same
// name as its first holder).
std::map<std::string, at::Tensor> whole_parameters(d9d::detail::TrainerCore& core) {
  std::map<std::string, at::Tensor> out;
  for (const auto& record : core.parallel().parameters()) {
    out[record.name] = record.sharded(core.mesh()).full_tensor().cpu();
  }
  return out;
}

// The holders of the tied embedding on every pipeline rank (none, one, or two stages of one rank)
// hold the same values and gradients, bit for bit. Returns how many holders the pp group has.
int64_t expect_tied_holders_identical(d9d::detail::TrainerCore& core, const std::string& what) {
  std::vector<at::Tensor> values;
  std::vector<at::Tensor> grads;
  for (const auto& record : core.parallel().parameters()) {
    if (record.name == kEmbedding) {
      values.push_back(record.local.detach().cpu());
      EXPECT_TRUE(record.local.grad().defined()) << what;
      grads.push_back(record.local.grad().cpu());
    }
  }
  for (std::size_t i = 1; i < values.size(); ++i) {
    EXPECT_TRUE(at::equal(values[i], values[0])) << what << ": holders on one rank";
    EXPECT_TRUE(at::equal(grads[i], grads[0])) << what << ": gradients on one rank";
  }
  const auto pp = core.mesh().group(d9d::MeshDomain::regular, "pp");
  const auto flat = [](const std::vector<at::Tensor>& tensors) {
    return tensors.empty() ? at::empty({0}, at::kDouble) : tensors.front().reshape({-1});
  };
  const auto all_values = d9d::all_gather_varying(pp, flat(values).to(pp.device()));
  const auto all_grads = d9d::all_gather_varying(pp, flat(grads).to(pp.device()));
  const auto count = at::tensor({static_cast<int64_t>(values.size())}, at::kLong);
  const int64_t holders = d9d::all_reduce(pp, count.to(pp.device())).cpu().item<int64_t>();
  const at::Tensor* first = nullptr;
  for (std::size_t r = 0; r < all_values.size(); ++r) {
    if (all_values[r].numel() == 0) {
      continue;
    }
    if (first == nullptr) {
      first = &all_values[r];
      continue;
    }
    EXPECT_TRUE(at::equal(all_values[r].cpu(), first->cpu())) << what << ": pp rank " << r;
  }
  const at::Tensor* first_grad = nullptr;
  for (const auto& grad : all_grads) {
    if (grad.numel() == 0) {
      continue;
    }
    if (first_grad == nullptr) {
      first_grad = &grad;
      continue;
    }
    EXPECT_TRUE(at::equal(grad.cpu(), first_grad->cpu())) << what << ": gradients across pp";
  }
  return holders;
}

double max_difference(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Trains `Plan` on this rank's stages and the same run in one process without a pipeline (each
// with its export); compares losses, gradient norms, parameters, the tied holders and the exports.
template <class Plan>
void expect_matches_one_process(RankEnv& env, const d9d::DistributedContext& ctx, const Run& run) {
  const std::string dir = env.scratch_dir() + "/" + run.name;
  d9d::Trainer<Plan> pipelined(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                               d9d::CausalLmTask{},
                               config_of(run, dir + "/pp" + std::to_string(env.rank())));
  ASSERT_GT(pipelined.mesh().size(d9d::MeshDomain::regular, "pp"), 1) << run.name;
  const auto result = pipelined.train();
  const auto got = whole_parameters(pipelined.core());
  if (run.tied) {
    EXPECT_EQ(got.count("lm_head.weight"), 0U) << run.name;
    EXPECT_EQ(expect_tied_holders_identical(pipelined.core(), run.name), 2) << run.name;
  }

  const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
  Run single_run = run;
  single_run.mesh.clear();
  d9d::Trainer<OneProcessPlan> single(
      local, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
      config_of(single_run, dir + "/one" + std::to_string(env.rank())));
  const auto reference = single.train();
  const auto want = single.core().model()->named_parameters();

  ASSERT_EQ(result.losses.size(), reference.losses.size()) << run.name;
  for (std::size_t i = 0; i < result.losses.size(); ++i) {
    EXPECT_NEAR(result.losses[i], reference.losses[i], kLossRtol * std::abs(reference.losses[i]))
        << run.name << " step " << i;
    EXPECT_NEAR(result.grad_norms[i], reference.grad_norms[i],
                kLossRtol * std::abs(reference.grad_norms[i]))
        << run.name << " step " << i;
  }
  ASSERT_FALSE(got.empty()) << run.name;
  for (const auto& [name, value] : got) {
    const auto* expected = want.find(name);
    ASSERT_NE(expected, nullptr) << run.name << ": " << name;
    EXPECT_TRUE(at::allclose(value, expected->cpu(), 0.0, kParameterAtol))
        << run.name << ": " << name << " max diff " << max_difference(value, expected->cpu());
  }

  // The exports: written by rank 0 of the pipelined run, read by every rank.
  ctx.barrier();
  const std::string exported = dir + "/pp0/model";
  const std::string one = dir + "/one" + std::to_string(env.rank()) + "/model";
  EXPECT_EQ(result.export_dir.empty(), env.rank() != 0) << run.name;
  const d9d::state::SafetensorsFile pp_file(d9d::files::join(exported, "model.safetensors"));
  const d9d::state::SafetensorsFile one_file(d9d::files::join(one, "model.safetensors"));
  std::vector<std::string> pp_keys;
  std::vector<std::string> one_keys;
  pp_keys.reserve(pp_file.entries().size());
  one_keys.reserve(one_file.entries().size());
  for (const auto& entry : pp_file.entries()) {
    pp_keys.push_back(entry.name);
  }
  for (const auto& entry : one_file.entries()) {
    one_keys.push_back(entry.name);
  }
  EXPECT_EQ(pp_keys, one_keys) << run.name;
  for (const auto& key : one_keys) {
    if (!pp_file.contains(key)) {
      continue;
    }
    const auto a = pp_file.tensor(key);
    const auto b = one_file.tensor(key);
    ASSERT_EQ(a.sizes(), b.sizes()) << run.name << ": " << key;
    EXPECT_TRUE(at::allclose(a.to(at::kDouble), b.to(at::kDouble), kFloat32Rtol, kParameterAtol))
        << run.name << ": exported " << key;
  }
  // Bit for bit: each rank's own parameters, rounded as the export rounds them.
  for (const auto& stage : pipelined.core().modules()) {
    for (const auto& item : stage->named_parameters()) {
      const auto found = got.find(item.key());
      ASSERT_NE(found, got.end()) << run.name << ": " << item.key();
      ASSERT_TRUE(pp_file.contains(item.key())) << run.name << ": " << item.key();
      EXPECT_TRUE(at::equal(pp_file.tensor(item.key()), found->second.to(at::kFloat)))
          << run.name << ": exported " << item.key() << " is not this rank's parameter";
    }
  }
  EXPECT_EQ(read_text(d9d::files::join(exported, "config.json")),
            read_text(d9d::files::join(one, "config.json")))
      << run.name;
  ctx.barrier();  // every rank is done with the files and the pipelined trainer's groups
}

// pp 2 with a tied head: the last stage's copy of the embedding on the other rank (1F1B, and the
// interleaved loop placement: stage 0 on rank 0, stage 3 on rank 1), or on the same rank as the
// first stage (ZeroBubbleV's V placement: rank 0 holds stages 0 and 3, no communication). And an
// untied run's export.
TEST(Trainer_PipelineTied_Gloo_ws2, TiedEmbeddingTrainsAndExportsAsOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string pp2 = R"({"pp": 2})";
    expect_matches_one_process<d9d::Plan<PipelineMesh, d9d::pipeline::OneFOneB<>, Fp64>>(
        env, ctx, tiny("1f1b", pp2));
    expect_matches_one_process<d9d::Plan<PipelineMesh, d9d::pipeline::Interleaved1F1B<V2>, Fp64>>(
        env, ctx, tiny("interleaved", pp2));
    expect_matches_one_process<d9d::Plan<PipelineMesh, d9d::pipeline::ZeroBubbleV<>, Fp64>>(
        env, ctx, tiny("zbv", pp2));
    expect_matches_one_process<d9d::Plan<PipelineMesh, d9d::pipeline::OneFOneB<>, Fp64>>(
        env, ctx, tiny("untied", pp2, false));
  });
}

// Data parallel next to the tied pipeline: pp 2 x Replicate 2 (split backward), pp 2 x FullyShard
// 2 (the tied gradients summed on each rank's shard, after the reduce-scatter), and pp 4, where
// the two holders (pp ranks 0 and 3) sum over a group of their own.
TEST(Trainer_PipelineTied_Gloo_ws4, DataParallelAndPp4MatchOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    expect_matches_one_process<d9d::Plan<PipelineMesh, d9d::pipeline::ZeroBubbleH1<>, Fp64>>(
        env, ctx, tiny("pp2dp2", R"({"pp": 2, "dp_replicate": 2})"));
    expect_matches_one_process<
        d9d::Plan<ShardMesh, d9d::pipeline::OneFOneB<>, d9d::parallel::Fsdp, Fp64>>(
        env, ctx, tiny("pp2fsdp2", R"({"pp": 2, "dp_shard": 2})"));
    expect_matches_one_process<d9d::Plan<PipelineMesh, d9d::pipeline::OneFOneB<>, Fp64>>(
        env, ctx, tiny("pp4", R"({"pp": 4})"));
  });
}

// A tied checkpoint saved by transformers ("checkpoint.init_from"), trained under pp 2: both
// holders of the embedding load it, and the run follows one process started from the same
// checkpoint.
TEST(Trainer_PipelineTied_Gloo_ws2, TiedHfCheckpointTrainsUnderPp2) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  const char* fixtures = std::getenv("D9D_HF_FIXTURES");
  ASSERT_NE(fixtures, nullptr);
  const std::string fixture = std::string(fixtures) + "/qwen3_tiny_tied";
  d9d::testing::run_on_ranks({.world_size = 2}, [fixture](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string model = read_text(d9d::files::join(fixture, "config.json"));
    ASSERT_FALSE(model.empty()) << fixture;
    expect_matches_one_process<d9d::Plan<PipelineMesh, d9d::pipeline::OneFOneB<>, Fp64>>(
        env, ctx,
        {.name = "hf",
         .mesh = R"({"pp": 2})",
         .tied = true,
         .model_json = model,
         .init_from = fixture});
  });
}

// Training checkpoints of a tied pipelined run: saved by ZeroBubbleV on pp 2 (rank 0 holds both
// holders of the embedding; the copy is stored once) after 2 steps, resumed in one process without
// a pipeline and by 1F1B on pp 2 (the copy on rank 1 loads the embedding and its AdamW state): the
// last 3 steps follow a straight 5-step run in one process.
TEST(Trainer_PipelineTied_Gloo_ws2, TiedCheckpointResumesOnOtherSplits) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
    const std::string dir = env.scratch_dir() + "/ckpt" + std::to_string(env.rank());
    const std::string shared = env.scratch_dir() + "/checkpoints";
    const auto config = [&](const std::string& out, const std::string& mesh, int64_t every) {
      auto cfg = config_of(tiny("ckpt", mesh), out);
      cfg.export_model.enabled = false;
      cfg.checkpoint.dir = shared;
      cfg.checkpoint.every = every;
      cfg.checkpoint.async = false;
      return cfg;
    };
    auto straight_config = config_of(tiny("straight", ""), dir + "/straight");
    straight_config.export_model.enabled = false;
    d9d::Trainer<OneProcessPlan> straight(local, d9d::Qwen3Provider{},
                                          d9d::testing::RandomWindowsProvider{},
                                          d9d::CausalLmTask{}, straight_config);
    const auto want = straight.train();
    const auto want_params = straight.core().model()->named_parameters();
    const auto check = [&](const d9d::TrainResult& got, d9d::detail::TrainerCore& core,
                           const std::string& name) {
      EXPECT_EQ(got.start_step, 2) << name;
      ASSERT_EQ(got.losses.size(), 3U) << name;
      for (std::size_t i = 0; i < 3; ++i) {
        EXPECT_NEAR(got.losses[i], want.losses[i + 2], kLossRtol * std::abs(want.losses[i + 2]))
            << name << " step " << i + 2;
      }
      for (const auto& [key, value] : whole_parameters(core)) {
        EXPECT_TRUE(at::allclose(value, want_params[key].cpu(), 0.0, kParameterAtol))
            << name << ": " << key;
      }
    };
    {
      d9d::Trainer<d9d::Plan<PipelineMesh, d9d::pipeline::ZeroBubbleV<>, Fp64>> first(
          ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
          config(dir + "/zbv", R"({"pp": 2})", 2));
      first.on<d9d::events::StepEnd>([](const d9d::events::StepEnd& e) {
        if (e.step == 2) {
          throw std::runtime_error("stopped by the test");
        }
      });
      EXPECT_THROW((void)first.train(), std::runtime_error);
    }
    ctx.barrier();
    d9d::Trainer<OneProcessPlan> whole(local, d9d::Qwen3Provider{},
                                       d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
                                       [&] {
                                         auto cfg = config(dir + "/whole", "", 0);
                                         cfg.checkpoint.resume = true;
                                         return cfg;
                                       }());
    check(whole.train(), whole.core(), "zbv pp2 -> 1");
    ctx.barrier();
    d9d::Trainer<d9d::Plan<PipelineMesh, d9d::pipeline::OneFOneB<>, Fp64>> staged(
        ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{}, [&] {
          auto cfg = config(dir + "/staged", R"({"pp": 2})", 0);
          cfg.checkpoint.resume = true;
          return cfg;
        }());
    const auto staged_result = staged.train();
    check(staged_result, staged.core(), "zbv pp2 -> 1f1b pp2");
    EXPECT_EQ(expect_tied_holders_identical(staged.core(), "resumed 1f1b"), 2);
    ctx.barrier();
  });
}

}  // namespace
