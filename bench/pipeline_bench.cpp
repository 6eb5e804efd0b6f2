// bench/pipeline_bench — step time and measured bubble of pipeline schedules on a Qwen3 stage
// model.
//
//   tools/d9drun -n 2 build/pipeline_bench --schedule 1f1b --microbatches 8 --preset 0.6b --bf16
//   tools/d9drun -n 2 bazel-bin/bench/pipeline_bench --schedule zbh1 --preset tiny   # CPU, Gloo
//
// Each rank builds only its stages (d9d::model::Qwen3Stage over d9d::model::distribute_layers),
// runs warm-up steps, then times `--steps` steps of the schedule (forward + backward of every
// microbatch; no optimizer). Compute actions are timed by the executor's timeline (device events
// on CUDA, the clock on CPU), so each rank's busy time is measured, not assumed:
//   measured bubble = 1 - mean over ranks of (busy time / step time, the median over steps)
// and printed next to the bubble the schedule's program has under the ranks' mean F, I and W
// costs (each the median over steps of its mean in a step), under equal costs, and under each
// rank's own measured costs (d9d::pipeline::simulate_stages: uneven stages are the program's
// bubble, so measured minus that is the executor's own overhead). `--overlap both` (the default)
// measures the executor with its point-to-point batches in flight until compute needs them
// (ExecutorOptions::overlap_p2p) and with each batch waited for before the next compute action, one
// after the other, and prints both. `--timeline FILE.svg` draws the last step of each as every rank
// ran it, under the program's plan (d9d/pipeline/picture.hpp). Results also go to --json.
// `--profile DIR` writes a Kineto trace of the first mode's last timed step per rank (the executor
// names each compute action, each P2P post and wait); `tools/gpu/trace_summary.py
// DIR/rank-0.trace.json 1` says where the compute stream idles and what the host was doing then.
// `--pairs` runs each forward and the other stage's backward that follows it at once (DualPipeV's
// overlap, ExecutorOptions::overlap_pairs); a pair's span then counts once as busy time and as the
// cost of both its actions.
//
// Stages start with the values of the whole model built after the same seed (d9d::model::
// init_qwen3_parameters initialises by name). With --check every rank then builds that whole model,
// runs the same microbatches through it without a pipeline (one device, the same precision) and
// compares its stages' gradients and the step's loss with it: the relative error
// |g - g_ref| / |g_ref| per parameter, its maximum over all ranks is printed, and the run fails
// when it exceeds --check-tolerance.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <CLI/CLI.hpp>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <d9d/core/collectives.hpp>
#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/core/device_mesh.hpp>
#include <d9d/core/distributed_context.hpp>
#include <d9d/model/linear_cross_entropy.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/model/qwen3_stage.hpp>
#include <d9d/model/stage_layers.hpp>
#include <d9d/pipeline/executor.hpp>
#include <d9d/pipeline/picture.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/track/svg.hpp>

#include "timing.hpp"

namespace {

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

// --stage-weights "1,2" -> {.embedding = 1, .head = 2}.
d9d::model::VirtualLayers parse_weights(const std::string& text) {
  const auto comma = text.find(',');
  if (comma == std::string::npos) {
    throw std::invalid_argument("pipeline_bench: --stage-weights \"" + text +
                                "\" is not EMBEDDING,HEAD");
  }
  return {.embedding = std::stod(text.substr(0, comma)), .head = std::stod(text.substr(comma + 1))};
}

// --profile: Kineto over one step (host and, on CUDA, device activity), saved per rank.
void start_profiler(c10::Device device) {
  namespace prof = torch::profiler::impl;
  std::set<prof::ActivityType> activities = {prof::ActivityType::CPU};
  if (device.is_cuda()) {
    activities.insert(prof::ActivityType::CUDA);
  }
  const prof::ProfilerConfig settings(prof::ProfilerState::KINETO);
  torch::autograd::profiler::prepareProfiler(settings, activities);
  torch::autograd::profiler::enableProfiler(settings, activities);
}

void stop_profiler(const std::string& dir, int rank) {
  auto result = torch::autograd::profiler::disableProfiler();
  std::filesystem::create_directories(dir);
  const auto path = dir + "/rank-" + std::to_string(rank) + ".trace.json";
  result->save(path);
  std::printf("[rank %d] profile: %s\n", rank, path.c_str());
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
  bool pairs = false;
  std::string overlap = "both";
  std::string timeline_path;
  std::string profile_dir;
  std::string stage_weights;
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
  app.add_option("--overlap", overlap,
                 "on: batches of sends/receives in flight until compute needs them; off: each "
                 "waited for before the next compute action; both (one after the other)")
      ->check(CLI::IsMember({"on", "off", "both"}));
  app.add_flag("--pairs", pairs,
               "run each forward and the other stage's backward that follows it at once "
               "(ExecutorOptions::overlap_pairs; DualPipeV's overlap)");
  app.add_option("--timeline", timeline_path,
                 "draw the last step as every rank ran it, under the program's plan (SVG)");
  app.add_option("--profile", profile_dir,
                 "a Kineto trace of the first mode's last timed step, per rank: "
                 "DIR/rank-<r>.trace.json (tools/gpu/trace_summary.py reads it)");
  app.add_option("--stage-weights", stage_weights,
                 "EMBEDDING,HEAD: the embedding's and the head's weights in decoder layers when "
                 "the layers are split over the stages (default: "
                 "d9d::model::pipeline_virtual_layers at --seq)");
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
    const auto ranges = d9d::model::distribute_layers(
        static_cast<int>(config.num_hidden_layers), program.stages(),
        stage_weights.empty() ? d9d::model::pipeline_virtual_layers(config, seq)
                              : parse_weights(stage_weights));

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
    // One executor per mode compared (constructing one is collective).
    std::vector<bool> modes;
    if (overlap != "off") {
      modes.push_back(true);
    }
    if (overlap != "on") {
      modes.push_back(false);
    }
    std::vector<d9d::pipeline::Executor> executors;
    executors.reserve(modes.size());
    for (const bool on : modes) {
      executors.emplace_back(
          program, group, handles,
          [&](int) {
            return d9d::pipeline::TensorSpec{.sizes = {microbatch_size, seq, config.hidden_size},
                                             .dtype = at::kFloat};
          },
          d9d::pipeline::ExecutorOptions{
              .overlap_p2p = on, .record_timeline = true, .overlap_pairs = pairs});
    }

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
    // The loss the Trainer's pipelined step runs (d9d::CausalLmTask::output_loss).
    const auto loss = [&](const at::Tensor& logits, int mb) {
      return d9d::model::logits_cross_entropy(logits, labels[static_cast<std::size_t>(mb)])
                 .loss_sum /
             tokens;
    };

    // What one mode measured on this rank.
    struct Measured {
      double median_step = 0;                   // ms
      double busy_share = 0;                    // the median over steps of busy time / step time
      std::map<Op, std::vector<double>> costs;  // each timed step's mean duration per action
      std::vector<d9d::pipeline::Timeline::Slot> last;  // the last step's timeline
    };
    double last_loss = 0;  // this rank's share of the last step's loss (the last stage's rank)
    const auto measure = [&](d9d::pipeline::Executor& executor, bool profile) {
      Measured out;
      std::vector<double> step_ms;
      std::vector<double> shares;
      for (int step = 0; step < warmup + steps; ++step) {
        for (auto& stage : stages) {
          stage->zero_grad();
        }
        synchronize(device);
        group.barrier();
        const bool profiled = profile && step == warmup + steps - 1;
        if (profiled) {
          start_profiler(device);
        }
        const d9d_bench::Stopwatch watch;
        const auto result = executor.run(inputs, loss);
        last_loss = 0;
        for (const auto& value : result.losses) {
          last_loss += value.defined() ? value.item<double>() : 0.0;
        }
        synchronize(device);
        group.barrier();
        const double ms = watch.seconds() * 1e3;
        if (profiled) {
          stop_profiler(profile_dir, rank);
        }
        if (step < warmup) {
          continue;
        }
        step_ms.push_back(ms);
        out.last = executor.timeline();
        double busy = 0;
        std::map<Op, std::pair<double, int>> step_costs;  // summed duration, actions
        for (std::size_t i = 0; i < out.last.size(); ++i) {
          const auto& slot = out.last[i];
          const double duration = 1e3 * (slot.end - slot.start);
          // The two actions of a pair (--pairs) share one span: busy once, and each action's
          // cost is then the pair's.
          const bool paired =
              i > 0 && out.last[i - 1].start == slot.start && out.last[i - 1].end == slot.end;
          busy += paired ? 0.0 : duration;
          auto& [sum, count] = step_costs[slot.action.op];
          sum += duration;
          ++count;
        }
        for (const auto& [op, cost] : step_costs) {
          out.costs[op].push_back(cost.first / cost.second);
        }
        shares.push_back(busy / ms);
      }
      std::sort(step_ms.begin(), step_ms.end());
      std::sort(shares.begin(), shares.end());
      out.median_step = step_ms[step_ms.size() / 2];
      out.busy_share = shares[shares.size() / 2];
      return out;
    };
    std::vector<Measured> measured;
    measured.reserve(executors.size());
    for (auto& executor : executors) {
      measured.push_back(measure(executor, !profile_dir.empty() && measured.empty()));
    }
    // An action's cost: the median over the timed steps of its mean duration in the step, the
    // statistic of the step time and the busy share (a mean over all steps let one slow step
    // raise the costs above what the median step ran).
    const auto cost = [&](Op op) {
      auto v = measured.front().costs[op];
      if (v.empty()) {
        return 0.0;
      }
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
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
    // Every rank's busy share per mode, compute costs and check figures, gathered on rank 0.
    std::vector<double> figures = {cost(Op::forward),
                                   cost(Op::backward),
                                   cost(Op::backward_input),
                                   cost(Op::backward_weight),
                                   worst_error,
                                   last_loss,
                                   reference_loss};
    for (const auto& m : measured) {
      figures.push_back(m.median_step);
      figures.push_back(m.busy_share);
    }
    const auto per_rank = d9d::all_gather_cat(
        group, at::tensor(figures, at::kDouble).unsqueeze(0).to(group.device()));
    // --timeline: every rank's last step of each mode, drawn under the plan on rank 0.
    std::vector<d9d::pipeline::TimelinePanel> panels;
    if (!timeline_path.empty()) {
      for (std::size_t i = 0; i < modes.size(); ++i) {
        panels.push_back(
            {.title = modes[i] ? "measured, P2P overlapped" : "measured, each batch waited for",
             .timeline = d9d::pipeline::gather_timeline(group, measured[i].last)});
      }
    }
    bool check_failed = false;
    if (rank == 0) {
      std::vector<double> busy_share(modes.size(), 0.0);
      std::vector<double> mode_step(modes.size(), 0.0);
      double f = 0;
      double b = 0;
      double i = 0;
      double w = 0;
      double max_error = 0;
      double pipeline_loss = 0;
      double whole_loss = 0;
      for (int r = 0; r < pp; ++r) {
        const auto row = per_rank.narrow(0, r, 1).squeeze(0).cpu();
        const auto* v = row.const_data_ptr<double>();
        f += v[0] / pp;
        b += v[1] / pp;
        i += v[2] / pp;
        w += v[3] / pp;
        max_error = std::max(max_error, v[4]);
        pipeline_loss += v[5];  // only the last stage's rank holds losses
        whole_loss = v[6];
        for (std::size_t k = 0; k < modes.size(); ++k) {
          const double step_ms = v[7 + 2 * k];
          mode_step[k] = std::max(mode_step[k], step_ms);
          busy_share[k] += v[8 + 2 * k] / pp;
        }
      }
      const double step = mode_step.front();
      // The model's F, I and W from measured F, B, I and W: for an unsplit program B's cost is
      // split evenly between I and W.
      const auto costs_of = [&](double f_ms, double b_ms, double i_ms, double w_ms) {
        return d9d::pipeline::Costs{.forward = f_ms,
                                    .backward_input = program.split_backward ? i_ms : b_ms / 2,
                                    .backward_weight = program.split_backward ? w_ms : b_ms / 2};
      };
      // Each rank's compute, to see how equal the stages are, and each of its stages at those
      // costs (the program at each rank's own costs below).
      std::string per_rank_text;
      std::vector<d9d::pipeline::Costs> stage_costs(static_cast<std::size_t>(program.stages()));
      for (int r = 0; r < pp; ++r) {
        const auto row = per_rank.narrow(0, r, 1).squeeze(0).cpu();
        const auto* v = row.const_data_ptr<double>();
        std::string layers;
        if (program.stages() == pp) {  // one stage per rank: stage r on rank r
          const auto& range = ranges[static_cast<std::size_t>(r)];
          layers =
              " layers [" + std::to_string(range.begin) + ", " + std::to_string(range.end) + "),";
        }
        char line[160];
        std::snprintf(line, sizeof line,
                      "  rank %d:%s F %.3f ms, B %.3f, I %.3f, W %.3f, busy %.1f%%\n", r,
                      layers.c_str(), v[0], v[1], v[2], v[3], 100 * v[8]);
        per_rank_text += line;
        for (const auto& a : program.ranks[static_cast<std::size_t>(r)]) {
          stage_costs[static_cast<std::size_t>(a.stage)] = costs_of(v[0], v[1], v[2], v[3]);
        }
      }
      const auto unit = d9d::pipeline::simulate(
          program, {.forward = 1, .backward_input = 1, .backward_weight = 1});
      const auto modelled = d9d::pipeline::simulate(program, costs_of(f, b, i, w));
      // The program at each rank's own costs (a stage costs what its rank measured): the stages'
      // imbalance is the program's, so measured - this is the executor's own overhead.
      const auto own_costs = d9d::pipeline::simulate_stages(program, stage_costs);
      const double bubble = 1.0 - busy_share.front();
      std::printf("pipeline_bench: %s pp=%d m=%d preset=%s microbatch=%ldx%ld %s on %s\n",
                  schedule.c_str(), pp, microbatches, preset_name.c_str(),
                  static_cast<long>(microbatch_size), static_cast<long>(seq),
                  bf16 ? "bf16" : "fp32", device.str().c_str());
      for (std::size_t k = 0; k < modes.size(); ++k) {
        std::printf("  P2P %s: step %.2f ms (median of %d), measured bubble %.2f%%\n",
                    modes[k] ? "overlapped     " : "waited at once ", mode_step[k], steps,
                    100 * (1.0 - busy_share[k]));
      }
      std::printf(
          "  mean costs F %.3f ms, B %.3f ms, I %.3f ms, W %.3f ms\n"
          "  program's bubble: %.2f%% at the measured costs, %.2f%% at equal F/I/W costs\n"
          "  program at each rank's own costs: step %.2f ms, bubble %.2f%% (measured - program: "
          "%+.2f points)\n",
          f, b, i, w, 100 * modelled.bubble_fraction(), 100 * unit.bubble_fraction(),
          own_costs.makespan, 100 * own_costs.bubble_fraction(),
          100 * (bubble - own_costs.bubble_fraction()));
      std::fputs(per_rank_text.c_str(), stdout);
      if (!timeline_path.empty()) {
        const std::string title = schedule + " pp=" + std::to_string(pp) +
                                  " m=" + std::to_string(microbatches) + " " + preset_name +
                                  " on " + device.str();
        d9d::track::write_text_file(
            timeline_path, d9d::pipeline::planned_and_measured_svg(program, panels, title));
        std::printf("  timeline: %s\n", timeline_path.c_str());
      }
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
                              {"overlap_p2p", modes.front()},
                              {"pairs", pairs},
                              {"step_ms", step},
                              {"measured_bubble", bubble},
                              {"cost_ms", {{"F", f}, {"B", b}, {"I", i}, {"W", w}}},
                              {"program_bubble_measured_costs", modelled.bubble_fraction()},
                              {"program_bubble_equal_costs", unit.bubble_fraction()},
                              {"program_bubble_rank_costs", own_costs.bubble_fraction()},
                              {"program_step_ms_rank_costs", own_costs.makespan}};
        for (std::size_t k = 0; k < modes.size(); ++k) {
          out[modes[k] ? "overlapped" : "waited_at_once"] = {
              {"step_ms", mode_step[k]}, {"measured_bubble", 1.0 - busy_share[k]}};
        }
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
