// The parallelize layer in one process: parameter records, the block hooks, FullyShard over one
// rank and recompute against plain runs (float64, equal to rounding), the run-time mesh rules and
// the config keys of the data-parallel strategies.
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>

#include "tests/parallel/parallel_test_util.hpp"
#include "tests/support/error_of.hpp"

namespace {

using d9d::precision::Fp64;
using d9d::testing::tiny_run;
using d9d::testing::train_plan;
using ::testing::AllOf;
using ::testing::HasSubstr;

d9d::DistributedContext local() { return d9d::DistributedContext::local({.device = "cpu"}); }

TEST(Parallel_Records_Replicate, OneRecordPerTrainedParameterInModelOrder) {
  const auto ctx = local();
  const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{});
  d9d::model::Qwen3ForCausalLM model(
      d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json()));
  model->model->norm->weight.requires_grad_(false);  // frozen: no record
  const auto parallel = d9d::parallel::parallelize<d9d::Plan<>>(mesh, {model.ptr()});
  std::vector<std::string> want;
  for (const auto& item : model->named_parameters()) {
    if (item.value().requires_grad()) {
      want.push_back(item.key());
    }
  }
  std::vector<std::string> got;
  for (const auto& record : parallel->parameters()) {
    got.push_back(record.name);
    EXPECT_TRUE(record.local.is_same(model->named_parameters()[record.name])) << record.name;
    EXPECT_EQ(record.global_shape, record.local.sizes().vec());
    EXPECT_TRUE(record.sharded_dims().empty());
    EXPECT_EQ(record.decays(), record.local.dim() >= 2);
  }
  EXPECT_EQ(got, want);
  EXPECT_EQ(parallel->find("model.norm.weight"), nullptr);
}

TEST(Parallel_Records_FullyShard, OneRankShardsAreTheWholeParameters) {
  const auto ctx = local();
  const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{});
  d9d::model::Qwen3ForCausalLM model(
      d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json()));
  std::map<std::string, at::Tensor> before;
  for (const auto& item : model->named_parameters()) {
    before[item.key()] = item.value().detach().clone();
  }
  using Plan = d9d::Plan<d9d::mesh<d9d::dp_shard<d9d::dynamic>>, d9d::parallel::Fsdp>;
  const auto parallel = d9d::parallel::parallelize<Plan>(mesh, {model.ptr()});
  ASSERT_EQ(parallel->parameters().size(), before.size());
  for (const auto& record : parallel->parameters()) {
    EXPECT_EQ(record.sharded_dims(), std::vector<std::string>{"dp_shard"});
    EXPECT_TRUE(at::equal(record.local, before[record.name])) << record.name;
    EXPECT_TRUE(record.local.is_leaf() && record.local.requires_grad());
  }
  // Between steps nothing is gathered: the modules' parameters hold no memory.
  EXPECT_EQ(parallel->extra_bytes(), 0);
  parallel->begin_step();  // gathers the parameters outside blocks (and prefetches block 0)
  EXPECT_GT(parallel->extra_bytes(), 0);
  EXPECT_TRUE(at::equal(model->model->embed_tokens->weight, before["model.embed_tokens.weight"]));
  parallel->before_backward(0, 1);
  parallel->finish();
  EXPECT_EQ(parallel->extra_bytes(), 0);
}

TEST(Parallel_FullyShard_ws1, TrainsLikeReplicate) {
  const auto ctx = local();
  const auto want = train_plan<d9d::Plan<Fp64>>(ctx, tiny_run("/tmp/d9d_par_rep", 5, 8, 2));
  using Mesh = d9d::mesh<d9d::dp_shard<d9d::dynamic>>;
  d9d::testing::expect_same_run(train_plan<d9d::Plan<Mesh, d9d::parallel::Fsdp, Fp64>>(
                                    ctx, tiny_run("/tmp/d9d_par_fs", 5, 8, 2)),
                                want, "FullyShard over one rank");
}

TEST(Parallel_Recompute_ws1, RecomputedBlocksGiveTheSameRun) {
  const auto ctx = local();
  const auto want =
      train_plan<d9d::Plan<Fp64>>(ctx, tiny_run("/tmp/d9d_par_plain", 5, 8, 4, false, 3));
  d9d::testing::expect_same_run(train_plan<d9d::Plan<d9d::recompute::Full, Fp64>>(
                                    ctx, tiny_run("/tmp/d9d_par_full", 5, 8, 4, false, 3)),
                                want, "recompute every block");
  d9d::testing::expect_same_run(train_plan<d9d::Plan<d9d::recompute::EveryNth<2>, Fp64>>(
                                    ctx, tiny_run("/tmp/d9d_par_every2", 5, 8, 4, false, 3)),
                                want, "recompute block 1");
  d9d::testing::expect_same_run(train_plan<d9d::Plan<d9d::recompute::Attention<>, Fp64>>(
                                    ctx, tiny_run("/tmp/d9d_par_attn", 5, 8, 4, false, 3)),
                                want, "recompute every block's attention");
  d9d::testing::expect_same_run(train_plan<d9d::Plan<d9d::recompute::Attention<2>, Fp64>>(
                                    ctx, tiny_run("/tmp/d9d_par_attn2", 5, 8, 4, false, 3)),
                                want, "recompute block 1's attention");
}

// The backward graph of one loss: how many nodes, and how many of them are recompute's.
struct GraphCount {
  int nodes = 0;
  int checkpoints = 0;
};

template <class Plan>
GraphCount loss_graph(int layers) {
  const auto ctx = local();
  const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{});
  d9d::model::Qwen3ForCausalLM model(
      d9d::model::Qwen3Config::from_json_text(d9d::testing::tiny_qwen3_json(false, layers)));
  const auto parallel = d9d::parallel::parallelize<Plan>(mesh, {model.ptr()});
  const auto ids = at::randint(64, {2, 8}, at::kLong);
  const auto loss = model->loss(ids, ids).loss_sum;
  GraphCount count;
  std::set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo{loss.grad_fn().get()};
  while (!todo.empty()) {
    auto* node = todo.back();
    todo.pop_back();
    if (node == nullptr || !seen.insert(node).second) {
      continue;
    }
    ++count.nodes;
    count.checkpoints += node->name().find("Checkpoint") != std::string::npos ? 1 : 0;
    for (const auto& edge : node->next_edges()) {
      todo.push_back(edge.function.get());
    }
  }
  return count;
}

TEST(Parallel_Recompute_ws1, AttentionRecomputeKeepsTheMlpInTheGraph) {
  // A recomputed part is one node of the forward graph (its own graph is built again in
  // backward): Full leaves one per layer and nothing of the layers, Attention one per layer and
  // the MLPs' nodes, Attention<2> every second layer's.
  const auto plain = loss_graph<d9d::Plan<>>(4);
  const auto full = loss_graph<d9d::Plan<d9d::recompute::Full>>(4);
  const auto attention = loss_graph<d9d::Plan<d9d::recompute::Attention<>>>(4);
  const auto every2 = loss_graph<d9d::Plan<d9d::recompute::Attention<2>>>(4);
  EXPECT_EQ(plain.checkpoints, 0);
  EXPECT_EQ(full.checkpoints, 4);
  EXPECT_EQ(attention.checkpoints, 4);
  EXPECT_EQ(every2.checkpoints, 2);
  EXPECT_LT(full.nodes, attention.nodes);
  EXPECT_LT(attention.nodes, every2.nodes);
  EXPECT_LT(every2.nodes, plain.nodes);
  // Each layer's attention part is the same set of nodes: half the layers, half the difference.
  EXPECT_EQ(plain.nodes - every2.nodes, (plain.nodes - attention.nodes) / 2);
}

// A block of one's own: the hooks run around its body, in order, and the wrapper runs the body.
class ScaleImpl : public torch::nn::Module, public d9d::model::Block {
 public:
  at::Tensor forward(const at::Tensor& x) {
    return run_block(x, [this](const at::Tensor& in) {
      ++calls;
      return in * 2;
    });
  }
  int calls = 0;
};
TORCH_MODULE(Scale);

// A block with a named part: the part's wrapper runs only that part.
class TwoPartsImpl : public torch::nn::Module, public d9d::model::Block {
 public:
  TwoPartsImpl() { declare_part(Part::attention); }
  at::Tensor forward(const at::Tensor& x) {
    return run_block(x, [this](const at::Tensor& in) {
      return run_part(Part::attention, in, [](const at::Tensor& t) { return t * 3; }) + 1;
    });
  }
};
TORCH_MODULE(TwoParts);

TEST(Parallel_Block, APartWrapperWrapsOnlyItsPart) {
  TwoParts block;
  EXPECT_TRUE(block->has_part(d9d::model::Block::Part::attention));
  EXPECT_TRUE(at::equal(block(at::ones({2})), at::full({2}, 4.0)));
  int wrapped = 0;
  block->set_part_wrapper(d9d::model::Block::Part::attention,
                          [&](const at::Tensor& x, const d9d::model::Block::Body& body) {
                            ++wrapped;
                            return body(x) * 10;
                          });
  EXPECT_TRUE(block->has_block_hooks());
  EXPECT_TRUE(at::equal(block(at::ones({2})), at::full({2}, 31.0)));  // (1 * 3) * 10 + 1
  EXPECT_EQ(wrapped, 1);
  block->clear_block_hooks();
  EXPECT_FALSE(block->has_block_hooks());
  EXPECT_TRUE(at::equal(block(at::ones({2})), at::full({2}, 4.0)));
}

TEST(Parallel_Block, AttentionRecomputeRefusesABlockWithoutThePart) {
  Scale block;
  EXPECT_FALSE(block->has_part(d9d::model::Block::Part::attention));
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>(
                  [&] { block->set_part_wrapper(d9d::model::Block::Part::attention, nullptr); }),
              HasSubstr("declares no such part"));
  const auto ctx = local();
  const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{});
  EXPECT_THAT(d9d::testing::error_of<std::invalid_argument>([&] {
                (void)d9d::parallel::parallelize<d9d::Plan<d9d::recompute::Attention<>>>(
                    mesh, {block.ptr()});
              }),
              AllOf(HasSubstr("d9d::recompute::Attention: block '' ("),
                    HasSubstr("declares no attention part"), HasSubstr("Fix: use")));
}

TEST(Parallel_Block, HooksRunAroundTheBodyInOrder) {
  Scale block;
  std::vector<std::string> seen;
  block->add_forward_pre_hook([&] { seen.emplace_back("pre1"); });
  block->add_forward_pre_hook([&] { seen.emplace_back("pre2"); });
  block->add_forward_post_hook([&](const at::Tensor& out) {
    seen.emplace_back("post1");
    return out + 1;
  });
  block->set_body_wrapper([&](const at::Tensor& x, const d9d::model::Block::Body& body) {
    seen.emplace_back("wrap");
    return body(x) + body(x);
  });
  const auto out = block(at::ones({2}));
  EXPECT_EQ(seen, (std::vector<std::string>{"pre1", "pre2", "wrap", "post1"}));
  EXPECT_TRUE(at::equal(out, at::full({2}, 5.0)));
  EXPECT_EQ(block->calls, 2);
  EXPECT_TRUE(block->has_block_hooks());
  block->clear_block_hooks();
  EXPECT_FALSE(block->has_block_hooks());
  EXPECT_TRUE(at::equal(block(at::ones({2})), at::full({2}, 2.0)));
}

TEST(Parallel_MeshRules, DegreesNoPolicyUsesAreErrorsNamingTheKey) {
  using Dynamic = d9d::Plan<d9d::mesh<d9d::tp<d9d::dynamic>, d9d::ep<d9d::dynamic>,
                                      d9d::cp_shard<d9d::dynamic>, d9d::pp<d9d::dynamic>>>;
  EXPECT_THAT(d9d::testing::error_of(
                  [] { d9d::detail::check_composition_mesh<Dynamic>(d9d::MeshShape{.tp = 2}); }),
              HasSubstr("the mesh has tp = 2, but the plan's d9d::parallel::NoTensorParallel does "
                        "not split anything over it. Fix: set \"mesh.tp\" to 1"));
  EXPECT_THAT(d9d::testing::error_of(
                  [] { d9d::detail::check_composition_mesh<Dynamic>(d9d::MeshShape{.ep = 2}); }),
              HasSubstr("ep = 2"));
  EXPECT_THAT(d9d::testing::error_of([] {
                d9d::detail::check_composition_mesh<Dynamic>(d9d::MeshShape{.cp_shard = 2});
              }),
              HasSubstr("cp_shard = 2"));
  EXPECT_THAT(d9d::testing::error_of(
                  [] { d9d::detail::check_composition_mesh<Dynamic>(d9d::MeshShape{.pp = 2}); }),
              HasSubstr("pp = 2, but the plan's d9d::pipeline::NoPipeline"));
  EXPECT_NO_THROW(d9d::detail::check_composition_mesh<Dynamic>(d9d::MeshShape{}));
  using SequenceParallel =
      d9d::Plan<d9d::mesh<d9d::tp<d9d::dynamic>>,
                d9d::parallel::TensorParallel<d9d::parallel::SequenceParallel::on>>;
  EXPECT_THAT(d9d::testing::error_of(
                  [] { d9d::detail::check_composition_mesh<SequenceParallel>(d9d::MeshShape{}); }),
              HasSubstr("sequence parallelism needs \"mesh.tp\" > 1 (got 1)"));
  EXPECT_NO_THROW(d9d::detail::check_composition_mesh<SequenceParallel>(d9d::MeshShape{.tp = 2}));
}

TEST(Parallel_Config, DataParallelKeysAreValidated) {
  const auto with = [](const std::string& section) {
    return R"({"run": {"output_dir": "/tmp/x", "total_steps": 1},
               "batch": {"global_batch_size": 2, "microbatch_size": 1, "sequence_length": 4},
               "data_parallel": )" +
           section + "}";
  };
  const auto config = d9d::TrainerConfig::from_json_text(
      with(R"({"reshard": "never", "prefetch": 2, "reduce_every_microbatch": false,
                "reduce_engine": "copy", "tied_embedding_rows": false})"));
  EXPECT_EQ(config.data_parallel.reduce_engine, "copy");
  EXPECT_FALSE(config.data_parallel.tied_embedding_rows);
  const auto defaults = d9d::TrainerConfig::from_json_text(with("{}"));
  EXPECT_EQ(defaults.data_parallel.reduce_engine, "auto");
  EXPECT_EQ(d9d::TrainerConfig::from_json_text(with(R"({"reduce_engine": "backend"})"))
                .data_parallel.reduce_engine,
            "backend");
  EXPECT_TRUE(defaults.data_parallel.tied_embedding_rows);
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)d9d::TrainerConfig::from_json_text(with(R"({"tied_embedding_rows": 1})"));
              }),
              HasSubstr("data_parallel.tied_embedding_rows"));
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)d9d::TrainerConfig::from_json_text(with(R"({"reduce_engine": "nvlink"})"));
              }),
              HasSubstr("data_parallel.reduce_engine"));
  EXPECT_EQ(config.data_parallel.reshard, "never");
  EXPECT_EQ(config.data_parallel.prefetch, 2);
  EXPECT_FALSE(config.data_parallel.reduce_every_microbatch);
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)d9d::TrainerConfig::from_json_text(with(R"({"reshard": "sometimes"})"));
              }),
              HasSubstr("data_parallel.reshard"));
  EXPECT_THAT(d9d::testing::error_of(
                  [&] { (void)d9d::TrainerConfig::from_json_text(with(R"({"prefetch": -1})")); }),
              HasSubstr("data_parallel.prefetch"));
  EXPECT_THAT(d9d::testing::error_of([&] {
                (void)d9d::TrainerConfig::from_json_text(with(R"({"reshards": "never"})"));
              }),
              HasSubstr("did you mean \"data_parallel.reshard\""));
}

}  // namespace
