// d9d/infer/inference.cpp — the forward-only loop of d9d::Inference (include/d9d/infer/
// inference.hpp): the steps over the dataset in order, the sink, the progress file.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <d9d/core/collectives.hpp>
#include <d9d/core/detail/autocast_scope.hpp>
#include <d9d/infer/inference.hpp>
#include <d9d/util/files.hpp>
#include <d9d/util/progress.hpp>

namespace d9d {

at::Tensor CausalLmScoreTask::infer(model::Qwen3ForCausalLM& model, const CausalLmBatch& batch) {
  const auto tokens = batch.tokens.to(model->model->embed_tokens->weight.device());
  return output(model->forward(tokens.narrow(1, 0, tokens.size(1) - 1)), batch);
}

at::Tensor CausalLmScoreTask::stage_input(const CausalLmBatch& batch) {
  return batch.tokens.narrow(1, 0, batch.tokens.size(1) - 1);
}

at::Tensor CausalLmScoreTask::output(const at::Tensor& logits, const CausalLmBatch& batch) {
  const auto tokens = batch.tokens.to(logits.device());
  const int64_t length = tokens.size(1) - 1;
  const auto log_probs = at::log_softmax(logits.to(at::kDouble), -1);
  const auto chosen = log_probs.gather(-1, tokens.narrow(1, 1, length).unsqueeze(-1)).squeeze(-1);
  const auto count = at::full({tokens.size(0)}, static_cast<double>(length), chosen.options());
  return at::stack({chosen.sum(1), count}, 1);
}

namespace detail {
namespace {

constexpr const char* kProgressFile = "inference_progress.json";

int64_t read_progress(const std::string& path) {
  if (path.empty() || !files::exists(path)) {
    return 0;
  }
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const auto json = nlohmann::json::parse(text.str(), nullptr, false);
  if (!json.is_object() || !json.contains("samples_done") ||
      !json.at("samples_done").is_number_integer() || json.at("samples_done").get<int64_t>() < 0) {
    throw std::runtime_error(path +
                             " is not an inference progress file (want {\"samples_done\": "
                             "N}); delete it to start over");
  }
  return json.at("samples_done").get<int64_t>();
}

void write_progress(const std::string& path, int64_t samples_done, int64_t dataset_size) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << nlohmann::json{{"samples_done", samples_done}, {"dataset_size", dataset_size}}.dump()
        << "\n";
    if (!out) {
      throw std::runtime_error("cannot write " + tmp);
    }
  }
  files::rename(tmp, path);
}

// Where the output directory's progress file says to continue (the main rank's, for every rank;
// 0 without one), with its path in the result.
InferenceResult resume_point(const DistributedContext& context, const TrainerConfig& config,
                             int64_t size) {
  InferenceResult result;
  if (!config.run.output_dir.empty()) {
    files::create_directories(config.run.output_dir, "d9d inference");
    result.progress_path = files::join(config.run.output_dir, kProgressFile);
  }
  auto done = at::zeros({1}, at::kLong);
  if (context.is_main_process()) {
    done[0] = read_progress(result.progress_path);
  }
  done = broadcast(context.world(), done.to(context.device()), 0).cpu();
  result.resumed_at = std::min(done[0].item<int64_t>(), size);
  if (context.is_main_process() && result.resumed_at > 0) {
    context.logger().info("inference continues after " + std::to_string(result.resumed_at) +
                          " samples (" + result.progress_path + ")");
  }
  return result;
}

}  // namespace

InferenceResult run_inference(const DistributedContext& context, const DeviceMesh& mesh,
                              const TrainerConfig& config, bool bf16_autocast,
                              const ErasedData& data, ForwardStep& forward,
                              parallel::StepContributions::Share samples, int64_t microbatches,
                              const InferenceSink& sink) {
  const auto start = std::chrono::steady_clock::now();
  const int dp_rank = samples.index;
  const bool writes = mesh.coordinate(MeshDomain::regular, "tp") == 0;
  const int64_t global = config.batch.global_batch_size;
  const int64_t per_rank = global / samples.count;
  const int64_t size = data.size;

  InferenceResult result = resume_point(context, config, size);

  const int64_t remaining = size - result.resumed_at;
  const int64_t steps = (remaining + global - 1) / global;
  std::unique_ptr<util::ProgressBar> bar;
  if (context.is_main_process() && steps > 0) {
    bar = std::make_unique<util::ProgressBar>(steps, "infer");
  }
  for (auto& module : forward.parallel->modules()) {
    module->eval();
  }
  const at::NoGradGuard no_grad;
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t first = result.resumed_at + step * global + dp_rank * per_rank;
    std::vector<int64_t> indices(static_cast<std::size_t>(per_rank));
    int64_t valid = 0;
    for (int64_t i = 0; i < per_rank; ++i) {
      // Past the end the last sample fills the batch (its rows are dropped).
      indices[static_cast<std::size_t>(i)] = std::min(first + i, size - 1);
      valid += first + i < size ? 1 : 0;
    }
    const auto batch = data.load(indices);
    at::Tensor rows;
    {
      // The strategies' step brackets: FullyShard gathers the loose parameters (embedding, head)
      // for the step and reshards everything after it; no backward, so nothing is reduced.
      forward.parallel->begin_step();
      const AutocastScope autocast(bf16_autocast, context.device().type());
      rows = forward.run(data.split(batch, microbatches));
      forward.parallel->finish();
    }
    if (rows.defined() && rows.size(0) != per_rank) {
      throw std::logic_error("d9d::Inference: the task gave " + std::to_string(rows.size(0)) +
                             " rows for " + std::to_string(per_rank) +
                             " samples; it must give one per sample");
    }
    if (writes && rows.defined() && valid > 0) {
      sink(std::vector<int64_t>(indices.begin(), indices.begin() + valid),
           rows.narrow(0, 0, valid));
    }
    context.barrier();  // every rank's sink has its rows before the progress moves on
    const int64_t samples_done = std::min(size, result.resumed_at + (step + 1) * global);
    if (context.is_main_process()) {
      if (!result.progress_path.empty()) {
        write_progress(result.progress_path, samples_done, size);
      }
      bar->update(step + 1);
    }
    result.samples = samples_done - result.resumed_at;
    result.steps = step + 1;
  }
  if (bar) {
    bar->finish();
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace detail
}  // namespace d9d
