// d9d::parallel::load_state (d9d/parallel/load.hpp) on 2 and 4 Gloo ranks: a Hugging Face Qwen3
// checkpoint (float64, written by the test) streamed straight into the tensor-parallel shards
// (tp 2) and into tp 2 x FullyShard 2. Each rank's parameters equal the file's slices bit for bit
// (gathered, they are the file's tensors), each rank's stream hands out exactly its parts' bytes,
// never a whole split tensor; the model gives the one-process logits and loss, and training from
// the loaded state follows the one-process run. Also a checkpoint whose layout differs from the
// model's (gate and up stored fused, split by the mapper's chunk before the tp slice).
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <d9d/model/hf.hpp>
#include <d9d/parallel/load.hpp>
#include <d9d/peft/policies.hpp>
#include <d9d/state/safetensors.hpp>
#include <d9d/state/safetensors_sharded.hpp>
#include <d9d/util/files.hpp>

#include "tests/core/core_test_util.hpp"
#include "tests/parallel/parallel_test_util.hpp"
#include "tests/support/error_of.hpp"

namespace {

namespace st = d9d::state;
using d9d::precision::Fp64;
using d9d::testing::RankEnv;
using d9d::testing::RunOutcome;
using ::testing::HasSubstr;

using Tp = d9d::parallel::TensorParallel<>;
using TpMesh = d9d::mesh<d9d::tp<d9d::dynamic>>;
using TpShardMesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>, d9d::tp<d9d::dynamic>>;

constexpr int kLayers = 2;

d9d::model::Qwen3Config tiny_config(bool tied) {
  return d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(tied, kLayers));
}

// The checkpoint's tensors: a float64 Qwen3 from seed 11 (not the seed the tests' models start
// from, so a load that misses a parameter shows).
std::map<std::string, at::Tensor> checkpoint_tensors(bool tied) {
  torch::manual_seed(11);
  d9d::model::Qwen3ForCausalLM model(tiny_config(tied));
  model->to(at::kDouble);
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model->named_parameters()) {
    out[item.key()] = item.value().detach().clone();
  }
  return out;
}

// Rank 0 writes dir/{config.json, model.safetensors}, as transformers' save_pretrained lays it
// out; a tied checkpoint also carries the shared weight as "lm_head.weight" (some do), which the
// load ignores. Every rank returns the tensors.
std::map<std::string, at::Tensor> write_hf_checkpoint(const d9d::DistributedContext& ctx,
                                                      const std::string& dir, bool tied) {
  auto tensors = checkpoint_tensors(tied);
  if (ctx.rank() == 0) {
    st::NamedTensors file(tensors.begin(), tensors.end());
    if (tied) {
      file.emplace_back("lm_head.weight", tensors.at("model.embed_tokens.weight"));
    }
    d9d::files::create_directories(dir, "test");
    st::save_safetensors(d9d::files::join(dir, "model.safetensors"), file, {{"format", "pt"}});
  }
  ctx.barrier();
  return tensors;
}

// Bytes of the whole parameters, and of those split over tp (by the records).
struct Bytes {
  uint64_t whole = 0;
  uint64_t split = 0;
};

Bytes bytes_of(const d9d::parallel::ParallelModel& parallel) {
  Bytes out;
  for (const auto& record : parallel.parameters()) {
    const auto n = static_cast<uint64_t>(c10::multiply_integers(record.global_shape)) * 8;
    const auto dims = record.sharded_dims();
    out.whole += n;
    out.split += std::find(dims.begin(), dims.end(), "tp") != dims.end() ? n : 0;
  }
  return out;
}

// Gathered, every record is the checkpoint's tensor, bit for bit (collective).
void expect_parameters_are(const d9d::parallel::ParallelModel& parallel,
                           const std::map<std::string, at::Tensor>& want) {
  ASSERT_EQ(parallel.parameters().size(), want.size());
  for (const auto& record : parallel.parameters()) {
    EXPECT_TRUE(
        at::equal(record.sharded(parallel.mesh()).full_tensor().cpu(), want.at(record.name)))
        << record.name;
  }
}

// The one-process model of the checkpoint, by the whole-model loader.
d9d::model::Qwen3ForCausalLM one_process(const std::string& dir, bool tied) {
  d9d::model::Qwen3ForCausalLM model(tiny_config(tied));
  model->to(at::kDouble);
  d9d::model::load_hf_checkpoint(*model, dir, {"lm_head.weight"});
  return model;
}

// tp 2 from the checkpoint: each rank streams its slices; the gathered logits and the
// loss-parallel loss equal the one-process model's (the same products, the row-parallel sums
// split in two: float64 rounding, ~1e-16 of values of order 1; 1e-12 as in the tp tests).
void expect_tp_load_matches(const d9d::DistributedContext& ctx, const std::string& dir, bool tied) {
  const auto tensors = write_hf_checkpoint(ctx, dir, tied);
  torch::manual_seed(3);
  d9d::model::Qwen3ForCausalLM split(tiny_config(tied));
  const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.tp = 2});
  auto parallel = d9d::parallel::parallelize<d9d::Plan<TpMesh, Tp, Fp64>>(mesh, {split.ptr()});
  const auto stats = d9d::parallel::load_state(*parallel, st::StateSource::open(dir),
                                               {.ignore = {"lm_head.weight"}});
  expect_parameters_are(*parallel, tensors);

  // No whole copy of a split tensor on any rank: the stream's outputs (each an owned tensor, the
  // only bytes copied out of the mapped file) are exactly this rank's parts — half of every split
  // parameter, the whole replicated ones — and there is one per parameter.
  const Bytes bytes = bytes_of(*parallel);
  EXPECT_EQ(stats.outputs, tensors.size());
  EXPECT_EQ(stats.output_bytes, bytes.whole - bytes.split / 2);
  EXPECT_EQ(static_cast<int64_t>(stats.output_bytes), parallel->parameter_bytes());
  EXPECT_GT(bytes.split, bytes.whole / 2) << "most of the model is split";

  auto whole = one_process(dir, tied);
  auto generator = at::detail::createCPUGenerator(23);
  const auto ids = at::randint(64, {2, 16}, generator, at::kLong);
  const auto labels = at::randint(64, {2, 16}, generator, at::kLong);
  const at::NoGradGuard no_grad;
  const auto got_logits = split->forward(ids);
  const auto want_logits = whole->forward(ids);
  EXPECT_TRUE(at::allclose(got_logits, want_logits, 0.0, 1e-12))
      << (got_logits - want_logits).abs().max().item<double>();
  const auto got = split->loss(ids, labels);
  const auto want = whole->loss(ids, labels);
  EXPECT_NEAR(got.loss_sum.item<double>(), want.loss_sum.item<double>(),
              1e-12 * want.loss_sum.item<double>());
  EXPECT_EQ(got.tokens.item<int64_t>(), want.tokens.item<int64_t>());
}

TEST(Parallel_LoadState_tp2, HfCheckpointLoadsIntoShardsWithOneProcessLogits) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    expect_tp_load_matches(ctx, env.scratch_dir() + "/untied", false);
    expect_tp_load_matches(ctx, env.scratch_dir() + "/tied", true);
  });
}

// LoRA fine-tuning from a Hugging Face base under tp 2: the base is frozen, so tensor
// parallelism keeps its split as a layout (ParallelModel::layout) rather than a record; the load
// slices it by that layout, the adapters keep their initial values (lora_B is zero, so the model
// is the base), and the logits are the one-process base model's. Once through load_state, once
// through the trainer's "checkpoint.init_from" (which keeps the adapters by itself).
TEST(Parallel_LoadState_tp2, LoraBaseLoadsIntoTheFrozenShards) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  using LoraPlan = d9d::Plan<TpMesh, Tp, d9d::peft::Lora<4, 8>, Fp64>;
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/base";
    const auto tensors = write_hf_checkpoint(ctx, dir, /*tied=*/false);
    auto whole = one_process(dir, /*tied=*/false);
    auto generator = at::detail::createCPUGenerator(29);
    const auto ids = at::randint(64, {2, 16}, generator, at::kLong);
    const auto expect_base = [&](d9d::parallel::ParallelModel& parallel, torch::nn::Module& model,
                                 const std::string& what) {
      // Split frozen weights by their kept layout (gathered: the file's tensor); the others, whole
      // on every rank, as they are.
      const auto own = model.named_parameters();
      int64_t split = 0;
      for (const auto& [name, want] : tensors) {
        if (const auto* layout = parallel.layout(name); layout != nullptr) {
          EXPECT_TRUE(at::equal(layout->sharded(parallel.mesh()).full_tensor().cpu(), want))
              << what << ": " << name;
          split += layout->local.numel() < want.numel() ? 1 : 0;
        } else {
          ASSERT_NE(own.find(name), nullptr) << what << ": " << name;
          EXPECT_TRUE(at::equal(own[name].cpu(), want)) << what << ": " << name;
        }
      }
      EXPECT_GT(split, 0) << what << ": tensor parallelism split no frozen weight";
      int64_t adapters = 0;
      for (const auto& item : model.named_parameters()) {
        if (item.key().find("lora_B") != std::string::npos) {
          EXPECT_TRUE(at::equal(item.value(), at::zeros_like(item.value()))) << item.key();
          ++adapters;
        }
      }
      EXPECT_GT(adapters, 0) << what;
      const at::NoGradGuard no_grad;
      // On the model's device (the trainer's is the rank's GPU under NCCL), the whole model too:
      // the same kernels, so only the split sums differ (a GPU and the host differ by ~1e-12).
      const auto device = model.parameters().front().device();
      whole->to(device);
      const auto got = model.as<d9d::model::Qwen3ForCausalLMImpl>()->forward(ids.to(device)).cpu();
      const auto want = whole->forward(ids.to(device)).cpu();
      EXPECT_TRUE(at::allclose(got, want, 0.0, 1e-12))
          << what << ": " << (got - want).abs().max().item<double>();
    };

    torch::manual_seed(3);
    d9d::model::Qwen3ForCausalLM split(tiny_config(false));
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.tp = 2});
    auto parallel = d9d::parallel::parallelize<LoraPlan>(mesh, {split.ptr()});
    std::vector<std::string> adapters;
    for (const auto& item : split->named_parameters()) {
      if (item.key().find(".lora_") != std::string::npos) {
        adapters.push_back(item.key());
      }
    }
    const auto stats =
        d9d::parallel::load_state(*parallel, st::StateSource::open(dir), {.keep = adapters});
    EXPECT_EQ(stats.outputs, tensors.size());
    expect_base(*parallel, *split, "load_state");

    auto cfg = d9d::testing::tiny_run(env.scratch_dir() + "/run" + std::to_string(env.rank()), 2, 8,
                                      2, false, kLayers, R"({"tp": 2})");
    cfg.sections["model"] = d9d::testing::tiny_qwen3_json(false, kLayers);
    cfg.checkpoint.init_from = dir;
    d9d::Trainer<LoraPlan> trainer(ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{},
                                   d9d::CausalLmTask{}, cfg);
    expect_base(trainer.core().parallel(), *trainer.core().model(), "checkpoint.init_from");
  });
}

// A checkpoint laid out otherwise than the model (Phi-3 style: each layer's gate and up stored as
// one "gate_up_proj" [2I, H], in two files with an index): the mapper chunks it (a view of the
// mapped file), the tp slice of each part is taken from that view, so the rank still copies only
// its rows of gate and of up.
TEST(Parallel_LoadState_tp2, MapperOperationsComposeWithTheSlices) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(2);
  d9d::testing::run_on_ranks({.world_size = 2}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    const std::string dir = env.scratch_dir() + "/fused";
    const auto tensors = checkpoint_tensors(false);
    std::vector<st::Mapper> parts;
    std::vector<std::string> plain;
    st::NamedTensors file;
    for (const auto& [name, tensor] : tensors) {
      const auto at = name.find(".mlp.up_proj.");
      if (name.find(".mlp.gate_proj.") != std::string::npos) {
        continue;
      }
      if (at != std::string::npos) {
        const std::string layer = name.substr(0, at);
        const std::string fused = layer + ".mlp.gate_up_proj.weight";
        file.emplace_back(fused, at::cat({tensors.at(layer + ".mlp.gate_proj.weight"), tensor}, 0));
        parts.push_back(
            st::chunk(fused, {layer + ".mlp.gate_proj.weight", layer + ".mlp.up_proj.weight"}, 0));
        continue;
      }
      file.emplace_back(name, tensor);
      plain.push_back(name);
    }
    parts.push_back(st::identity(plain));
    if (ctx.rank() == 0) {
      (void)st::save_safetensors_sharded(dir, file, 40'000, {{"format", "pt"}});
    }
    ctx.barrier();
    torch::manual_seed(3);
    d9d::model::Qwen3ForCausalLM split(tiny_config(false));
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.tp = 2});
    auto parallel = d9d::parallel::parallelize<d9d::Plan<TpMesh, Tp, Fp64>>(mesh, {split.ptr()});
    const auto stats = d9d::parallel::load_state(*parallel, st::StateSource::open(dir),
                                                 {.mapper = st::parallel(parts)});
    EXPECT_GT(stats.files_opened, 1U);
    EXPECT_EQ(stats.tensors_read, file.size());
    const Bytes bytes = bytes_of(*parallel);
    EXPECT_EQ(stats.output_bytes, bytes.whole - bytes.split / 2);
    expect_parameters_are(*parallel, tensors);

    // The identity mapper does not fit this checkpoint: the error names what is missing, before
    // anything is read.
    EXPECT_THAT(d9d::testing::error_of([&] {
                  (void)d9d::parallel::load_state(*parallel, st::StateSource::open(dir));
                }),
                AllOf(HasSubstr("missing input"), HasSubstr("mlp.gate_proj.weight")));
  });
}

// tp 2 x FullyShard 2 on 4 ranks, through the trainer's "checkpoint.init_from": each rank holds
// its dp_shard rows of its tp slice and reads only those; training from there follows one process
// trained from the same checkpoint (losses, gradient norms and parameters within the float64
// tolerances of the other parallel tests). Then tp 2 x pp 2 (1F1B): each stage loads its own
// parameters (the other stages' tensors are not read; a tied head's copy of the embedding on the
// last stage loads the embedding's tp slice) and follows the same one-process run.
TEST(Parallel_LoadState_ws4, HfCheckpointIntoTpTimesFullyShardAndPipelineTrainsAsOneProcess) {
  D9D_SKIP_IF_WORLD_EXCEEDS_GPUS(4);
  d9d::testing::run_on_ranks({.world_size = 4}, [](RankEnv& env) {
    const auto ctx = d9d::testing::rank_context(env);
    for (const bool tied : {true, false}) {
      const std::string dir = env.scratch_dir() + (tied ? "/hf_tied" : "/hf_untied");
      const auto tensors = write_hf_checkpoint(ctx, dir, tied);
      const auto config = [&](const std::string& out, const std::string& mesh) {
        auto cfg =
            d9d::testing::tiny_run(env.scratch_dir() + "/" + out + (tied ? "_tied" : "_untied") +
                                       std::to_string(env.rank()),
                                   6, 8, 2, false, kLayers, mesh);
        cfg.sections["model"] = d9d::testing::tiny_qwen3_json(tied, kLayers);
        cfg.checkpoint.init_from = dir;
        return cfg;
      };

      // One process, loaded by hand (the whole model: every record whole).
      const auto local = d9d::DistributedContext::local({.device = ctx.device().str()});
      auto single_config = config("one", "");
      single_config.checkpoint.init_from.clear();
      d9d::Trainer<d9d::Plan<Fp64>> single(local, d9d::Qwen3Provider{},
                                           d9d::testing::RandomWindowsProvider{},
                                           d9d::CausalLmTask{}, single_config);
      const auto single_stats = d9d::parallel::load_state(
          single.core().parallel(), st::StateSource::open(dir), {.ignore = {"lm_head.weight"}});
      EXPECT_EQ(single_stats.output_bytes, bytes_of(single.core().parallel()).whole);
      const RunOutcome want = d9d::testing::outcome_of(single);

      d9d::Trainer<d9d::Plan<TpShardMesh, Tp, d9d::parallel::Fsdp, Fp64>> sharded(
          ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{},
          config("sharded", R"({"dp_shard": 2, "tp": 2})"));
      auto& parallel = sharded.core().parallel();
      expect_parameters_are(parallel, tensors);
      // This rank's parts only: a quarter of each tp-split parameter, half of each norm
      // (FullyShard splits those over dp_shard; they are replicated over tp).
      const Bytes bytes = bytes_of(parallel);
      EXPECT_EQ(parallel.parameter_bytes(),
                static_cast<int64_t>(bytes.split / 4 + (bytes.whole - bytes.split) / 2));
      const RunOutcome got = d9d::testing::outcome_of(sharded);
      EXPECT_TRUE(got.result.resumed_from.empty());
      d9d::testing::expect_same_run(got, want,
                                    tied ? "init_from into tp 2 x FullyShard 2, tied"
                                         : "init_from into tp 2 x FullyShard 2, untied");
      // Tied: the last stage's copy of the embedding loads the same tensor (its tp slice).
      d9d::testing::expect_same_run(
          d9d::testing::train_plan<
              d9d::Plan<d9d::mesh<d9d::pp<d9d::dynamic>, d9d::tp<d9d::dynamic>>, Tp,
                        d9d::pipeline::OneFOneB<>, Fp64>>(ctx,
                                                          config("pp", R"({"pp": 2, "tp": 2})")),
          want, tied ? "init_from into tp 2 x pp 2, tied" : "init_from into tp 2 x pp 2, untied");
    }
  });
}

// "checkpoint.init_from" errors are configuration errors naming the key, raised when the trainer
// is built: no checkpoint there; a checkpoint that does not fit the model (an untied model from a
// tied checkpoint: its head is missing).
TEST(Parallel_LoadState, InitFromErrorsNameTheKey) {
  const auto ctx = d9d::DistributedContext::local({.device = "cpu"});
  const std::string root = ::testing::TempDir() + "/d9d_init_from";
  const auto train = [&](const std::string& from) {
    auto cfg = d9d::testing::tiny_run(root + "/run", 2, 8, 8, false, kLayers);
    cfg.checkpoint.init_from = from;
    d9d::Trainer<d9d::Plan<Fp64>> trainer(
        ctx, d9d::Qwen3Provider{}, d9d::testing::RandomWindowsProvider{}, d9d::CausalLmTask{}, cfg);
  };
  EXPECT_THAT(d9d::testing::error_of<d9d::ConfigError>([&] { train(root + "/nothing"); }),
              HasSubstr("\"checkpoint.init_from\" = \"" + root + "/nothing\""));
  (void)write_hf_checkpoint(ctx, root + "/fits", /*tied=*/false);
  const std::string tied = root + "/tied_only";
  d9d::files::create_directories(tied, "test");
  auto tensors = checkpoint_tensors(true);
  st::save_safetensors(d9d::files::join(tied, "model.safetensors"),
                       st::NamedTensors(tensors.begin(), tensors.end()), {{"format", "pt"}});
  EXPECT_THAT(d9d::testing::error_of<d9d::ConfigError>([&] { train(tied); }),
              AllOf(HasSubstr("\"checkpoint.init_from\""), HasSubstr("missing input"),
                    HasSubstr("\"lm_head.weight\"")));
  EXPECT_EQ(d9d::testing::error_of<d9d::ConfigError>([&] { train(root + "/fits"); }), "no error");
}

}  // namespace
