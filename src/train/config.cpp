// d9d/train/config.cpp — parsing and validation of the trainer's JSON configuration.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include <d9d/train/config.hpp>
#include <d9d/util/did_you_mean.hpp>
#include <d9d/util/files.hpp>
#include <d9d/util/json.hpp>

namespace d9d {
namespace {

using Json = nlohmann::json;

// One JSON object of the config, read key by key; finish() rejects keys nobody asked for.
class Section {
 public:
  Section(const Json& json, std::string path) : json_(json), path_(std::move(path)) {
    if (!json_.is_object()) {
      fail_at(path_.empty() ? "the configuration" : path_, json_.dump(), "expected a JSON object");
    }
  }

  [[nodiscard]] std::string key_path(const std::string& key) const {
    return path_.empty() ? key : path_ + "." + key;
  }

  [[noreturn]] static void fail_at(const std::string& key, const std::string& value,
                                   const std::string& what) {
    throw ConfigError("d9d config: \"" + key + "\" = " + value + " is invalid: " + what);
  }

  const Json* find(const std::string& key) {
    known_.insert(key);
    const auto found = json_.find(key);
    return found == json_.end() || found->is_null() ? nullptr : &*found;
  }

  [[noreturn]] void missing(const std::string& key, const std::string& what) const {
    // A required key is often missing because it is misspelled: name the likely culprit.
    for (const auto& item : json_.items()) {
      if (known_.count(item.key()) == 0 &&
          util::edit_distance(item.key(), key) <= util::kMaxSuggestionDistance) {
        throw ConfigError("d9d config: unknown key \"" + key_path(item.key()) +
                          "\" (did you mean \"" + key_path(key) + "\"?); \"" + key_path(key) +
                          "\" is required (" + what + ")");
      }
    }
    throw ConfigError("d9d config: \"" + key_path(key) + "\" is required (" + what + ")");
  }

  // An integer from `minimum` to the largest value of `Int` (and of int64_t): a value beyond is an
  // error, never truncated (4294967297 is not 1 for an int, 2^64 is not 0).
  template <class Int>
  void integer(const std::string& key, Int& out, int64_t minimum, bool required) {
    const Json* value = find(key);
    const auto maximum = static_cast<uint64_t>(
        std::min<uint64_t>(static_cast<uint64_t>(std::numeric_limits<Int>::max()),
                           static_cast<uint64_t>(std::numeric_limits<int64_t>::max())));
    const std::string what =
        "an integer from " + std::to_string(minimum) + " to " + std::to_string(maximum);
    if (value == nullptr) {
      if (required) {
        missing(key, what);
      }
      return;
    }
    // nlohmann keeps non-negative integers as uint64_t and negative ones as int64_t.
    const bool in_range = value->is_number_unsigned()
                              ? value->get<uint64_t>() <= maximum &&
                                    static_cast<int64_t>(value->get<uint64_t>()) >= minimum
                              : value->is_number_integer() && value->get<int64_t>() >= minimum;
    if (!in_range) {
      fail_at(key_path(key), value->dump(), "expected " + what);
    }
    out = static_cast<Int>(value->get<int64_t>());
  }

  void number(const std::string& key, double& out, double minimum, bool inclusive, double maximum,
              bool required = false) {
    const Json* value = find(key);
    const std::string what = std::string("a number ") + (inclusive ? ">= " : "> ") +
                             std::to_string(minimum) +
                             (std::isinf(maximum) ? "" : " and < " + std::to_string(maximum));
    if (value == nullptr) {
      if (required) {
        missing(key, what);
      }
      return;
    }
    if (!value->is_number()) {
      fail_at(key_path(key), value->dump(), "expected " + what);
    }
    const double v = value->get<double>();
    const bool low_ok = inclusive ? v >= minimum : v > minimum;
    if (!low_ok || !(v < maximum) || std::isnan(v)) {
      fail_at(key_path(key), value->dump(), "expected " + what);
    }
    out = v;
  }

  void boolean(const std::string& key, bool& out) {
    const Json* value = find(key);
    if (value == nullptr) {
      return;
    }
    if (!value->is_boolean()) {
      fail_at(key_path(key), value->dump(), "expected true or false");
    }
    out = value->get<bool>();
  }

  void string(const std::string& key, std::string& out, const std::vector<std::string>& choices,
              bool required = false) {
    const Json* value = find(key);
    std::string listing;
    for (const auto& choice : choices) {
      listing += (listing.empty() ? "" : ", ") + ("\"" + choice + "\"");
    }
    if (value == nullptr) {
      if (required) {
        missing(key, choices.empty() ? "a string" : "one of " + listing);
      }
      return;
    }
    if (!value->is_string() || value->get<std::string>().empty()) {
      fail_at(key_path(key), value->dump(), "expected a non-empty string");
    }
    const auto text = value->get<std::string>();
    if (!choices.empty() && std::find(choices.begin(), choices.end(), text) == choices.end()) {
      fail_at(key_path(key), value->dump(), "expected one of " + listing);
    }
    out = text;
  }

  // Rejects keys that were never looked up, suggesting the closest known key.
  void finish() const {
    for (const auto& item : json_.items()) {
      if (known_.count(item.key()) != 0) {
        continue;
      }
      const std::string best = util::closest_match(item.key(), known_);
      std::string listing;
      for (const auto& known : known_) {
        listing += (listing.empty() ? "" : ", ") + known;
      }
      throw ConfigError("d9d config: unknown key \"" + key_path(item.key()) + "\"" +
                        (best.empty() ? "" : " (did you mean \"" + key_path(best) + "\"?)") +
                        "; valid keys" + (path_.empty() ? "" : " in \"" + path_ + "\"") + ": " +
                        listing);
    }
  }

  Section child(const std::string& key) {
    const Json* value = find(key);
    static const Json kEmpty = Json::object();
    return {value == nullptr ? kEmpty : *value, key_path(key)};
  }

 private:
  const Json& json_;
  std::string path_;
  std::set<std::string> known_;
};

std::vector<optim::Phase> read_phases(const Json* json, const std::string& path) {
  std::vector<optim::Phase> phases;
  if (json == nullptr) {
    return phases;
  }
  if (!json->is_array()) {
    Section::fail_at(path, json->dump(), "expected a list of phases");
  }
  for (std::size_t i = 0; i < json->size(); ++i) {
    Section phase((*json)[i], path + "[" + std::to_string(i) + "]");
    optim::Phase p;
    phase.integer("steps", p.length.steps, 1, false);
    phase.number("percent", p.length.percent, 0.0, false, 100.0 + 1e-9);
    phase.boolean("rest", p.length.rest);
    std::string curve = "constant";
    phase.string("curve", curve, {"constant", "linear", "cosine", "polynomial", "exponential"});
    p.curve = optim::parse_curve(curve);
    phase.number("start", p.start, 0.0, true, INFINITY);
    p.end = p.start;
    phase.number("end", p.end, 0.0, true, INFINITY);
    phase.number("power", p.power, 0.0, false, INFINITY);
    phase.finish();
    phases.push_back(p);
  }
  return phases;
}

// Sets the dotted key `dotted` of `json` to the JSON value `value_text` (objects on the way are
// created; a non-object on the way is an error).
void apply_override(Json& json, const std::string& dotted, const std::string& value_text) {
  Json value;
  try {
    (void)util::parse_strict_json(value_text, 64);
    value = Json::parse(value_text);
  } catch (const std::exception& error) {
    throw ConfigError("d9d config: the value given for \"" + dotted + "\" (" + value_text +
                      ") is not valid JSON: " + error.what());
  }
  Json* node = &json;
  std::size_t start = 0;
  while (true) {
    const auto dot = dotted.find('.', start);
    const auto part = dotted.substr(start, dot == std::string::npos ? dot : dot - start);
    if (part.empty()) {
      throw ConfigError("d9d config: \"" + dotted + "\" is not a dotted key (e.g. run.output_dir)");
    }
    if (!node->is_object()) {
      throw ConfigError("d9d config: cannot set \"" + dotted + "\": \"" +
                        dotted.substr(0, start - 1) + "\" = " + node->dump() +
                        " is not a JSON object");
    }
    if (dot == std::string::npos) {
      (*node)[part] = std::move(value);
      return;
    }
    node = &(*node)[part];
    if (node->is_null()) {
      *node = Json::object();
    }
    start = dot + 1;
  }
}

}  // namespace

namespace {

// The config's JSON, strictly: nlohmann keeps the last of a key given twice without a word, and a
// duplicate inside "model" would silently change the model.
Json parse_config(const std::string& text) {
  Json json;
  try {
    (void)util::parse_strict_json(text, 64);
    json = Json::parse(text);
  } catch (const util::JsonError& error) {
    const std::string what = error.what();
    if (error.top_key().empty()) {
      throw ConfigError("d9d config: not valid JSON: " + what);
    }
    throw ConfigError("d9d config: \"" + error.top_key() + "\"" +
                      (what.rfind("appears twice", 0) == 0 ? " " : ": ") + what);
  }
  return json;
}

void read_run(Section& root, TrainerConfig& cfg) {
  Section run = root.child("run");
  run.string("output_dir", cfg.run.output_dir, {}, /*required=*/true);
  run.integer("total_steps", cfg.run.total_steps, 1, /*required=*/true);
  run.integer("seed", cfg.run.seed, 0, false);
  run.integer("log_every", cfg.run.log_every, 1, false);
  if (run.find("failure_timeout_s") != nullptr) {
    // Below a second a busy machine could starve a heartbeat; beyond a week, "never" is meant.
    double seconds = 0;
    run.number("failure_timeout_s", seconds, 1.0, true, 7 * 24 * 3600.0);
    cfg.run.failure_timeout_s = seconds;
  }
  run.finish();
}

// batch, optimizer, lr_schedule, gradient_clipping.
void read_training(Section& root, const Json& json, TrainerConfig& cfg) {
  Section batch = root.child("batch");
  batch.integer("global_batch_size", cfg.batch.global_batch_size, 1, true);
  batch.integer("microbatch_size", cfg.batch.microbatch_size, 1, true);
  batch.integer("sequence_length", cfg.batch.sequence_length, 1, false);  // language models
  batch.finish();

  Section optimizer = root.child("optimizer");
  optimizer.number("lr", cfg.optimizer.lr, 0.0, false, INFINITY);
  optimizer.number("beta1", cfg.optimizer.beta1, 0.0, true, 1.0);
  optimizer.number("beta2", cfg.optimizer.beta2, 0.0, true, 1.0);
  optimizer.number("eps", cfg.optimizer.eps, 0.0, false, INFINITY);
  optimizer.number("weight_decay", cfg.optimizer.weight_decay, 0.0, true, INFINITY);
  optimizer.finish();

  cfg.lr_schedule = read_phases(root.find("lr_schedule"), "lr_schedule");
  try {
    (void)optim::PiecewiseSchedule::build(cfg.lr_schedule, cfg.run.total_steps);
  } catch (const std::invalid_argument& error) {
    throw ConfigError(std::string("d9d config: \"lr_schedule\" is invalid: ") + error.what());
  }

  Section clipping = root.child("gradient_clipping");
  if (const Json* max_norm = clipping.find("max_norm")) {
    if (!max_norm->is_number() || !(max_norm->get<double>() > 0)) {
      Section::fail_at("gradient_clipping.max_norm", max_norm->dump(),
                       "expected a number > 0, or null for no clipping");
    }
    cfg.gradient_clipping.max_norm = max_norm->get<double>();
  } else if (root.find("gradient_clipping") != nullptr &&
             json.at("gradient_clipping").contains("max_norm")) {
    cfg.gradient_clipping.max_norm = std::nullopt;  // explicit null
  }
  clipping.finish();
}

// data_parallel, mesh.
void read_parallel(Section& root, TrainerConfig& cfg) {
  Section dp = root.child("data_parallel");
  dp.number("bucket_size_mb", cfg.data_parallel.bucket_size_mb, 0.0, false, INFINITY);
  dp.string("reduce_engine", cfg.data_parallel.reduce_engine, {"auto", "backend", "copy"});
  dp.boolean("tied_embedding_rows", cfg.data_parallel.tied_embedding_rows);
  dp.string("reshard", cfg.data_parallel.reshard, {"after_forward", "never", "all_but_last"});
  dp.integer("prefetch", cfg.data_parallel.prefetch, 0, false);
  dp.boolean("reduce_every_microbatch", cfg.data_parallel.reduce_every_microbatch);
  dp.finish();

  Section mesh = root.child("mesh");
  const auto degree = [&](const char* key, std::optional<int>& out) {
    int value = 0;
    bool present = mesh.find(key) != nullptr;
    mesh.integer(key, value, 1, false);
    if (present) {
      out = value;
    }
  };
  degree("pp", cfg.mesh.pp);
  degree("dp_replicate", cfg.mesh.dp_replicate);
  degree("dp_shard", cfg.mesh.dp_shard);
  degree("cp_replicate", cfg.mesh.cp_replicate);
  degree("cp_shard", cfg.mesh.cp_shard);
  degree("tp", cfg.mesh.tp);
  degree("ep", cfg.mesh.ep);
  mesh.finish();
}

// logging, export, numerics, cuda_graphs, profile.
void read_outputs(Section& root, TrainerConfig& cfg) {
  Section logging = root.child("logging");
  logging.boolean("progress", cfg.logging.progress);
  logging.boolean("jsonl", cfg.logging.jsonl);
  logging.boolean("tensorboard", cfg.logging.tensorboard);
  logging.boolean("pictures", cfg.logging.pictures);
  logging.integer("pipeline_timeline_step", cfg.logging.pipeline_timeline_step, 0, false);
  logging.finish();

  Section exporting = root.child("export");
  exporting.boolean("enabled", cfg.export_model.enabled);
  exporting.string("dtype", cfg.export_model.dtype, {"float32", "bfloat16"});
  exporting.finish();

  Section numerics = root.child("numerics");
  numerics.string("on_nonfinite", cfg.numerics.on_nonfinite, {"stop", "skip"});
  numerics.integer("max_consecutive_skips", cfg.numerics.max_consecutive_skips, 1, false);
  numerics.number("loss_spike_factor", cfg.numerics.loss_spike_factor, 1.0, false, INFINITY);
  numerics.integer("loss_spike_window", cfg.numerics.loss_spike_window, 1, false);
  numerics.number("loss_spike_min_rise", cfg.numerics.loss_spike_min_rise, 0.0, true, INFINITY);
  numerics.finish();

  Section graphs = root.child("cuda_graphs");
  graphs.boolean("enabled", cfg.cuda_graphs.enabled);
  graphs.integer("warmup_steps", cfg.cuda_graphs.warmup_steps, 0, false);
  graphs.finish();

  Section profile = root.child("profile");
  profile.integer("start", cfg.profile.start, -1, false);
  profile.integer("steps", cfg.profile.steps, 1, false);
  profile.string("dir", cfg.profile.dir, {}, false);
  profile.boolean("operators", cfg.profile.operators);
  profile.finish();
  if (cfg.profile.dir.empty()) {
    cfg.profile.dir = cfg.run.output_dir + "/profile";
  }
}

void read_checkpoint(Section& root, TrainerConfig& cfg) {
  Section checkpoint = root.child("checkpoint");
  checkpoint.integer("every", cfg.checkpoint.every, 0, false);
  checkpoint.integer("keep", cfg.checkpoint.keep, 1, false);
  checkpoint.boolean("async", cfg.checkpoint.async);
  checkpoint.boolean("resume", cfg.checkpoint.resume);
  checkpoint.string("dir", cfg.checkpoint.dir, {}, false);
  checkpoint.string("resume_from", cfg.checkpoint.resume_from, {}, false);
  checkpoint.string("init_from", cfg.checkpoint.init_from, {}, false);
  checkpoint.finish();
  if (cfg.checkpoint.dir.empty()) {
    cfg.checkpoint.dir = files::join(cfg.run.output_dir, "checkpoints");
  }
}

}  // namespace

TrainerConfig TrainerConfig::from_json_text(const std::string& text, const Overrides& overrides) {
  Json json = parse_config(text);
  for (const auto& [key, value] : overrides) {
    apply_override(json, key, value);
  }
  TrainerConfig cfg;
  Section root(json, "");
  read_run(root, cfg);
  read_training(root, json, cfg);
  read_parallel(root, cfg);
  read_outputs(root, cfg);
  read_checkpoint(root, cfg);
  for (const char* name : {"model", "data", "advise"}) {
    if (const Json* section = root.find(name)) {
      if (!section->is_object()) {
        Section::fail_at(name, section->dump(), "expected a JSON object");
      }
      cfg.sections[name] = section->dump();
    }
  }
  root.finish();
  return cfg;
}

TrainerConfig TrainerConfig::from_file(const std::string& path, const Overrides& overrides) {
  std::ifstream in(path);
  if (!in) {
    throw ConfigError("d9d config: cannot read \"" + path + "\"");
  }
  std::stringstream text;
  text << in.rdbuf();
  try {
    return from_json_text(text.str(), overrides);
  } catch (const ConfigError& error) {
    throw ConfigError(std::string(error.what()) + " (in " + path + ")");
  }
}

std::string TrainerConfig::section(const std::string& name) const {
  const auto found = sections.find(name);
  return found == sections.end() ? "{}" : found->second;
}

void TrainerConfig::check_against_data_parallel(int dp_size) const {
  const int64_t step = static_cast<int64_t>(dp_size) * batch.microbatch_size;
  if (batch.global_batch_size % step != 0) {
    const int64_t lower = std::max<int64_t>(step, batch.global_batch_size / step * step);
    throw ConfigError(
        "d9d config: \"batch.global_batch_size\" = " + std::to_string(batch.global_batch_size) +
        " is not divisible by data-parallel ranks (" + std::to_string(dp_size) +
        ") x \"batch.microbatch_size\" (" + std::to_string(batch.microbatch_size) +
        ") = " + std::to_string(step) + ". Fix: use a multiple of " + std::to_string(step) +
        ", e.g. " + std::to_string(lower) + " or " + std::to_string(lower + step));
  }
}

int64_t TrainerConfig::microbatches_per_step(int dp_size) const {
  check_against_data_parallel(dp_size);
  return batch.global_batch_size / (static_cast<int64_t>(dp_size) * batch.microbatch_size);
}

}  // namespace d9d
