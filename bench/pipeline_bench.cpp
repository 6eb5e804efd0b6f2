// bench/pipeline_bench — step time and measured bubble of pipeline schedules on a Qwen3 stage
// model.
//
//   tools/d9drun -n 2 build/pipeline_bench --schedule 1f1b --microbatches 8 --preset 0.6b --bf16
//   tools/d9drun -n 2 bazel-bin/bench/pipeline_bench --schedule zbh1 --preset tiny   # CPU, Gloo
//
// Each rank builds only its stages (d9d::model::Qwen3Stage over d9d::pipeline::distribute_layers),
// runs warm-up steps, then times `--steps` steps of the schedule (forward + backward of every
// microbatch; no optimizer). Compute actions are timed with device events (CUDA) or the clock (CPU)
// through the executor's compute hook, so each rank's busy time is measured, not assumed:
//   measured bubble = 1 - mean over ranks of (busy time / step time)
// and printed next to the bubble the schedule's program has under the measured F, I and W costs
// and under equal costs. Results also go to --json.
//
// Stages start with the values of the whole model built after the same seed (d9d::model::
// init_qwen3_parameters initialises by name). With --check every rank then builds that whole model,
// runs the same microbatches through it without a pipeline (one device, the same precision) and
// compares its stages' gradients and the step's loss with it: the relative error
// |g - g_ref| / |g_ref| per parameter, its maximum over all ranks is printed, and the run fails
// when it exceeds --check-tolerance.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <CLI/CLI.hpp>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <nlohmann/json.hpp>

#include <d9d/core/collectives.hpp>
#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/core/distributed_context.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/model/qwen3_stage.hpp>
#include <d9d/pipeline/executor.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/pipeline/stages.hpp>

namespace {

using d9d::pipeline::Action;
using d9d::pipeline::Op;
using d9d::pipeline::Program;

Program build(const std::string& name, int pp, int m) {
  using namespace d9d::pipeline;  // NOLINT(google-build-using-namespace): policy names
  using V2 = stages_per_rank<2>;
  if (name == "gpipe") {
    return build_program<GPipe<>>(pp, m);
  }
  if (name == "1f1b") {
    return build_program<OneFOneB<>>(pp, m);
  }
  if (name == "interleaved") {
    return build_program<Interleaved1F1B<V2>>(pp, m);
  }
  if (name == "zbh1") {
    return build_program<ZeroBubbleH1<>>(pp, m);
  }
  if (name == "zbv") {
    return build_program<ZeroBubbleV<>>(pp, m);
  }
  if (name == "dualpipev") {
    return build_program<DualPipeV<>>(pp, m);
  }
  throw std::invalid_argument("pipeline_bench: unknown schedule \"" + name +
                              "\" (gpipe, 1f1b, interleaved, zbh1, zbv, dualpipev)");
}

d9d::model::Qwen3Config preset(const std::string& name) {
  d9d::model::Qwen3Config c;
  c.tie_word_embeddings = false;
  if (name == "0.6b") {  // Qwen3-0.6B's shape, untied head
    c.vocab_size = 151936;
    c.hidden_size = 1024;
    c.intermediate_size = 3072;
    c.num_hidden_layers = 28;
    c.num_attention_heads = 16;
    c.num_key_value_heads = 8;
    c.head_dim = 128;
  } else if (name == "tiny") {
    c.vocab_size = 256;
    c.hidden_size = 64;
    c.intermediate_size = 128;
    c.num_hidden_layers = 8;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 16;
  } else {
    throw std::invalid_argument("pipeline_bench: unknown preset \"" + name + "\" (0.6b, tiny)");
  }
  return c;
}

// Times compute actions: device events on CUDA (no synchronisation inside the step), the clock on
// CPU.
class ActionTimer {
 public:
  explicit ActionTimer(c10::Device device) : device_(device) {}

  void mark(const Action& action, bool done) {
    if (!done) {
      current_ = action;
    }
    if (device_.is_cuda()) {
      const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
      events_.push_back(
          std::make_unique<c10::Event>(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT));
      events_.back()->record(guard.getStream(device_));
    } else {
      times_.push_back(std::chrono::steady_clock::now());
    }
    if (done) {
      actions_.push_back(current_);
    }
  }
  void reset() {
    events_.clear();
    times_.clear();
    actions_.clear();
  }
  // Milliseconds of each timed action, in order (synchronises).
  std::vector<std::pair<Action, double>> durations() const {
    std::vector<std::pair<Action, double>> out;
    for (std::size_t i = 0; i < actions_.size(); ++i) {
      double ms = 0;
      if (device_.is_cuda()) {
        events_[2 * i + 1]->synchronize();
        ms = events_[2 * i]->elapsedTime(*events_[2 * i + 1]);
      } else {
        ms = std::chrono::duration<double, std::milli>(times_[2 * i + 1] - times_[2 * i]).count();
      }
      out.emplace_back(actions_[i], ms);
    }
    return out;
  }

 private:
  c10::Device device_;
  Action current_{};
  std::vector<std::unique_ptr<c10::Event>> events_;
  std::vector<std::chrono::steady_clock::time_point> times_;
  std::vector<Action> actions_;
};

constexpr uint64_t kModelSeed = 1234;

// The step without a pipeline on this rank: the whole model (same seed, so the same values), every
// microbatch forward and backward with the same loss weighting. Returns the loss; gradients stay
// in `model`.
double reference_step(d9d::model::Qwen3ForCausalLM& model, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& labels, double tokens, bool bf16,
                      c10::Device device) {
  double loss = 0;
  for (std::size_t mb = 0; mb < inputs.size(); ++mb) {
    at::Tensor value;
    {
      const d9d::detail::AutocastScope autocast(bf16, device.type());
      value = d9d::model::causal_lm_loss(model->forward(inputs[mb]), labels[mb]).loss_sum / tokens;
    }
    value.backward();
    loss += value.item<double>();
  }
  return loss;
}

void synchronize(c10::Device device) {
  if (device.is_cuda()) {
    const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    guard.synchronizeDevice(device.index());
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"d9d.cpp pipeline schedule benchmark"};
  std::string schedule = "1f1b";
  std::string preset_name = "tiny";
  std::string json_path;
  int microbatches = 8;
  int64_t microbatch_size = 2;
  int64_t seq = 128;
  int steps = 5;
  int warmup = 2;
  bool bf16 = false;
  bool check = false;
  double check_tolerance = 0;
  app.add_option("--schedule", schedule, "gpipe, 1f1b, interleaved, zbh1, zbv, dualpipev");
  app.add_option("--preset", preset_name, "model shape: 0.6b or tiny");
  app.add_option("--microbatches", microbatches, "microbatches per step");
  app.add_option("--microbatch-size", microbatch_size, "sequences per microbatch");
  app.add_option("--seq", seq, "tokens per sequence");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_flag("--bf16", bf16, "bf16 autocast in the stages' forward (fp32 weights)");
  app.add_option("--json", json_path, "also write the figures here (rank 0)");
  app.add_flag("--check", check,
               "compare gradients and loss with the whole model run without a pipeline");
  app.add_option("--check-tolerance", check_tolerance,
                 "largest relative gradient error --check accepts (default 2e-2 with --bf16, "
                 "1e-4 without)");
  CLI11_PARSE(app, argc, argv);

  try {
    const auto ctx = d9d::DistributedContext::from_env();
    const int pp = ctx.world_size();
    const d9d::DeviceMesh mesh(ctx, d9d::MeshShape{.pp = pp});
    const auto group = mesh.group(d9d::MeshDomain::regular, "pp");
    const int rank = group.rank();
    const auto device = ctx.device();
    const auto program = build(schedule, pp, microbatches);
    const auto config = preset(preset_name);
    const auto ranges = d9d::pipeline::distribute_layers(
        static_cast<int>(config.num_hidden_layers), program.stages(), {.embedding = 1, .head = 2});

    std::vector<d9d::model::Qwen3Stage> stages;
    std::vector<d9d::pipeline::Stage> handles;
    for (const int s :
         d9d::pipeline::rank_stages(program.placement, pp, program.stages_per_rank, rank)) {
      at::manual_seed(kModelSeed);  // each stage holds the whole model's values
      stages.emplace_back(config, s, program.stages(), ranges[static_cast<std::size_t>(s)]);
      stages.back()->to(device);
      handles.push_back(
          {.index = s,
           .forward = [stage = stages.back(), bf16, device](const at::Tensor& x) mutable {
             const d9d::detail::AutocastScope autocast(bf16, device.type());
             return stage(x);
           }});
    }
    d9d::pipeline::Executor executor(program, group, std::move(handles), [&](int) {
      return d9d::pipeline::TensorSpec{.sizes = {microbatch_size, seq, config.hidden_size},
                                       .dtype = at::kFloat};
    });
    ActionTimer timer(device);
    executor.on_compute([&](const Action& a, bool done) { timer.mark(a, done); });

    // The same tokens on every rank (the first stage reads the inputs, the last the labels).
    auto token_generator = at::detail::createCPUGenerator(kModelSeed + 1);
    std::vector<at::Tensor> inputs;
    std::vector<at::Tensor> labels;
    for (int mb = 0; mb < microbatches; ++mb) {
      const auto tokens =
          at::randint(config.vocab_size, {microbatch_size, seq + 1}, token_generator, at::kLong)
              .to(device);
      inputs.push_back(tokens.narrow(1, 0, seq).contiguous());
      labels.push_back(tokens.narrow(1, 1, seq).contiguous());
    }
    const double tokens = static_cast<double>(microbatches * microbatch_size * seq);
    const auto loss = [&](const at::Tensor& logits, int mb) {
      return d9d::model::causal_lm_loss(logits, labels[static_cast<std::size_t>(mb)]).loss_sum /
             tokens;
    };

    double last_loss = 0;  // this rank's share of the last step's loss (the last stage's rank)
    std::vector<double> step_ms;
    std::vector<double> busy_ms;
    std::map<Op, std::vector<double>> costs;
    for (int step = 0; step < warmup + steps; ++step) {
      for (auto& stage : stages) {
        stage->zero_grad();
      }
      timer.reset();
      synchronize(device);
      group.barrier();
      const auto start = std::chrono::steady_clock::now();
      const auto result = executor.run(inputs, loss);
      last_loss = 0;
      for (const auto& value : result.losses) {
        last_loss += value.defined() ? value.item<double>() : 0.0;
      }
      synchronize(device);
      group.barrier();
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      if (step < warmup) {
        continue;
      }
      step_ms.push_back(ms);
      double busy = 0;
      for (const auto& [action, duration] : timer.durations()) {
        busy += duration;
        costs[action.op].push_back(duration);
      }
      busy_ms.push_back(busy);
    }
    std::sort(step_ms.begin(), step_ms.end());
    const double median_step = step_ms[step_ms.size() / 2];
    const double mean_busy =
        std::accumulate(busy_ms.begin(), busy_ms.end(), 0.0) / static_cast<double>(busy_ms.size());
    const auto mean = [&](Op op) {
      const auto& v = costs[op];
      return v.empty() ? 0.0
                       : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
    };
    // --check: this rank's stages against the whole model run without a pipeline.
    double worst_error = 0;
    double reference_loss = 0;
    if (check) {
      at::manual_seed(kModelSeed);
      d9d::model::Qwen3ForCausalLM reference(config);
      reference->to(device);
      reference_loss = reference_step(reference, inputs, labels, tokens, bf16, device);
      const auto want = reference->named_parameters();
      for (auto& stage : stages) {
        for (const auto& item : stage->named_parameters()) {
          const auto& got = item.value().grad();
          const auto& expected = want[item.key()].grad();
          const double error =
              (got - expected).norm().item<double>() / expected.norm().item<double>();
          worst_error = std::max(worst_error, error);
        }
      }
    }
    // Every rank's busy share, compute costs and check figures, gathered on rank 0.
    const auto per_rank = d9d::all_gather_cat(
        group, at::tensor({median_step, mean_busy, mean(Op::forward), mean(Op::backward),
                           mean(Op::backward_input), mean(Op::backward_weight), worst_error,
                           last_loss, reference_loss},
                          at::kDouble)
                   .unsqueeze(0)
                   .to(group.device()));
    bool check_failed = false;
    if (rank == 0) {
      double busy_share = 0;
      double f = 0;
      double b = 0;
      double i = 0;
      double w = 0;
      double step = 0;
      double max_error = 0;
      double pipeline_loss = 0;
      double whole_loss = 0;
      for (int r = 0; r < pp; ++r) {
        const auto row = per_rank.narrow(0, r, 1).squeeze(0).cpu();
        const auto* v = row.const_data_ptr<double>();
        step = std::max(step, v[0]);
        busy_share += v[1] / v[0] / pp;
        f += v[2] / pp;
        b += v[3] / pp;
        i += v[4] / pp;
        w += v[5] / pp;
        max_error = std::max(max_error, v[6]);
        pipeline_loss += v[7];  // only the last stage's rank holds losses
        whole_loss = v[8];
      }
      const auto unit = d9d::pipeline::simulate(
          program, {.forward = 1, .backward_input = 1, .backward_weight = 1});
      // For an unsplit program B's measured cost is split evenly between I and W in the model.
      const double measured_i = program.split_backward ? i : b / 2;
      const double measured_w = program.split_backward ? w : b / 2;
      const auto modelled = d9d::pipeline::simulate(
          program, {.forward = f, .backward_input = measured_i, .backward_weight = measured_w});
      const double bubble = 1.0 - busy_share;
      std::printf(
          "pipeline_bench: %s pp=%d m=%d preset=%s microbatch=%ldx%ld %s on %s\n"
          "  step %.2f ms (median of %d), measured bubble %.2f%%\n"
          "  mean costs F %.3f ms, B %.3f ms, I %.3f ms, W %.3f ms\n"
          "  program's bubble: %.2f%% at the measured costs, %.2f%% at equal F/I/W costs\n",
          schedule.c_str(), pp, microbatches, preset_name.c_str(),
          static_cast<long>(microbatch_size), static_cast<long>(seq), bf16 ? "bf16" : "fp32",
          device.str().c_str(), step, steps, 100 * bubble, f, b, i, w,
          100 * modelled.bubble_fraction(), 100 * unit.bubble_fraction());
      const double tolerance = check_tolerance > 0 ? check_tolerance : (bf16 ? 2e-2 : 1e-4);
      if (check) {
        check_failed = !(max_error <= tolerance);
        std::printf(
            "  check against the whole model without a pipeline: loss %.6f vs %.6f, largest "
            "relative gradient error %.3e (tolerance %.1e): %s\n",
            pipeline_loss, whole_loss, max_error, tolerance, check_failed ? "FAILED" : "ok");
      }
      if (!json_path.empty()) {
        nlohmann::json out = {{"schedule", schedule},
                              {"pp", pp},
                              {"microbatches", microbatches},
                              {"preset", preset_name},
                              {"microbatch_size", microbatch_size},
                              {"seq", seq},
                              {"bf16", bf16},
                              {"step_ms", step},
                              {"measured_bubble", bubble},
                              {"cost_ms", {{"F", f}, {"B", b}, {"I", i}, {"W", w}}},
                              {"program_bubble_measured_costs", modelled.bubble_fraction()},
                              {"program_bubble_equal_costs", unit.bubble_fraction()}};
        if (check) {
          out["check"] = {{"loss", pipeline_loss},
                          {"reference_loss", whole_loss},
                          {"max_relative_gradient_error", max_error},
                          {"tolerance", tolerance},
                          {"ok", !check_failed}};
        }
        std::ofstream(json_path) << out.dump(2) << "\n";
      }
    }
    group.barrier();
    return check_failed ? 3 : 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "pipeline_bench: %s\n", error.what());
    return 1;
  }
}
