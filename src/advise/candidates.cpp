// d9d::advise's candidate Plans (d9d/advise/candidates.hpp).
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <d9d/advise/candidates.hpp>
#include <d9d/core/mesh_shape.hpp>
#include <d9d/model/context_parallel.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/pipeline/schedules.hpp>
#include <d9d/train/config.hpp>

namespace d9d::advise {

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) {
      out.push_back(d);
    }
  }
  return out;
}

// TensorParallel's rule (src/parallel/tensor_parallel.cpp): tp divides every split size.
bool tp_divides(const model::Qwen3Config& c, int tp) {
  return c.num_attention_heads % tp == 0 && c.num_key_value_heads % tp == 0 &&
         c.intermediate_size % tp == 0 && c.vocab_size % tp == 0;
}

bool context_fits(int64_t tokens, int cp) {
  try {
    model::check_context_length(tokens, cp);
    return true;
  } catch (const std::invalid_argument&) {
    return false;
  }
}

// The microbatches per data-parallel rank, or 0 when the batch does not split.
int64_t microbatches_of(const TrainerConfig& config, int dp) {
  try {
    return config.microbatches_per_step(dp);
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names{"gpipe", "1f1b", "interleaved",
                                              "zbh1",  "zbv",  "dualpipev"};
  return names;
}

pipeline::Program build_schedule(const std::string& name, int pp, int microbatches) {
  namespace pl = pipeline;
  if (name == "gpipe") {
    return pl::build_program<pl::GPipe<>>(pp, microbatches);
  }
  if (name == "1f1b") {
    return pl::build_program<pl::OneFOneB<>>(pp, microbatches);
  }
  if (name == "interleaved") {
    return pl::build_program<pl::Interleaved1F1B<pl::stages_per_rank<2>>>(pp, microbatches);
  }
  if (name == "zbh1") {
    return pl::build_program<pl::ZeroBubbleH1<>>(pp, microbatches);
  }
  if (name == "zbv") {
    return pl::build_program<pl::ZeroBubbleV<>>(pp, microbatches);
  }
  if (name == "dualpipev") {
    return pl::build_program<pl::DualPipeV<>>(pp, microbatches);
  }
  throw std::invalid_argument(
      "d9d::advise: unknown schedule \"" + name +
      "\" (gpipe, 1f1b, interleaved (2 stages per rank), zbh1, zbv, dualpipev)");
}

std::string Candidate::describe() const {
  std::string out = fully_shard ? "fully_shard" : "replicate";
  std::string degrees;
  const auto add = [&](const char* name, int value) {
    if (value > 1) {
      degrees += (degrees.empty() ? " " : " x ") + std::string(name) + " " + std::to_string(value);
    }
  };
  add(fully_shard ? "dp_replicate" : "dp", dp_replicate);
  add("dp_shard", dp_shard);
  add("cp", cp);
  add("tp", tp);
  add("pp", pp);
  out += degrees.empty() ? " (one rank)" : degrees;
  if (!schedule.empty()) {
    out += " (" + schedule + ")";
  }
  return out + ", " + std::to_string(microbatches) + " microbatch" +
         (microbatches == 1 ? "" : "es");
}

std::vector<Candidate> enumerate_candidates(const TrainerConfig& config, int world_size,
                                            const CandidateOptions& options) {
  if (world_size < 1) {
    throw std::invalid_argument("d9d::advise::enumerate_candidates: a world of " +
                                std::to_string(world_size) + " ranks");
  }
  const auto model = model::Qwen3Config::from_json_text(config.section("model"));
  const int64_t sequence = config.batch.sequence_length;
  std::vector<Candidate> out;
  for (const bool fully_shard : {false, true}) {
    for (const int pp : options.pipelines ? divisors(world_size) : std::vector<int>{1}) {
      for (const int tp :
           options.tensor_parallel ? divisors(world_size / pp) : std::vector<int>{1}) {
        if (!tp_divides(model, tp)) {
          continue;
        }
        const int rest = world_size / pp / tp;
        for (const int cp : options.context_parallel ? divisors(rest) : std::vector<int>{1}) {
          if (cp > 1 && (sequence < 1 || !context_fits(sequence, cp))) {
            continue;
          }
          // With sequence parallelism's split and cp's chunks, tp must divide each rank's tokens.
          if (cp > 1 && tp > 1 && (sequence / cp) % tp != 0) {
            continue;
          }
          const int dp = rest / cp;
          for (const int dp_replicate : divisors(dp)) {
            const int dp_shard = dp / dp_replicate;
            if (!fully_shard && dp_shard != 1) {
              continue;
            }
            MeshShape shape;
            shape.pp = pp;
            shape.tp = tp;
            shape.dp_replicate = dp_replicate;
            shape.dp_shard = dp_shard;
            shape.cp_shard = cp;  // context parallelism is cp_shard under either strategy
            if (!shape.validate(world_size).empty()) {
              continue;
            }
            const int64_t m = microbatches_of(config, dp);
            if (m < 1) {
              continue;
            }
            Candidate c{.fully_shard = fully_shard,
                        .dp_replicate = dp_replicate,
                        .dp_shard = dp_shard,
                        .cp = cp,
                        .tp = tp,
                        .pp = pp,
                        .schedule = {},
                        .microbatches = static_cast<int>(m)};
            if (pp == 1) {
              out.push_back(c);
              continue;
            }
            for (const auto& name : schedule_names()) {
              try {
                const auto program = build_schedule(name, pp, c.microbatches);
                if (model.num_hidden_layers < program.stages()) {
                  continue;
                }
              } catch (const std::invalid_argument&) {
                continue;
              }
              c.schedule = name;
              out.push_back(c);
            }
          }
        }
      }
    }
  }
  return out;
}

}  // namespace d9d::advise
