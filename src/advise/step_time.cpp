// d9d::advise::MachineProfile and predict_step_time (d9d/advise/step_time.hpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include <d9d/advise/step_time.hpp>
#include <d9d/model/qwen3.hpp>
#include <d9d/model/qwen3_moe.hpp>
#include <d9d/pipeline/verify.hpp>

namespace d9d::advise {

namespace {

[[noreturn]] void bad_profile(const std::string& what) {
  throw std::invalid_argument("d9d::advise::MachineProfile: " + what);
}

// How far apart two sizes are: |log| of their ratio.
double size_distance(int64_t a, int64_t b) {
  return std::abs(std::log(static_cast<double>(a) / static_cast<double>(b)));
}

// The measured entry nearest to a shape, by `distance` (a sum of size_distance terms; infinite
// for an entry that cannot stand in, such as a matmul of another layout), or null when none can.
template <class Measured, class Distance>
const Measured* nearest(const std::vector<Measured>& measured, Distance distance) {
  const Measured* best = nullptr;
  double best_distance = std::numeric_limits<double>::infinity();
  for (const auto& entry : measured) {
    const double d = distance(entry);
    if (d < best_distance) {
      best_distance = d;
      best = &entry;
    }
  }
  return best;
}

// The ring's share of the bytes each rank moves in a collective over `group` ranks.
double ring_share(int group) {
  return group > 1 ? static_cast<double>(group - 1) / static_cast<double>(group) : 0.0;
}

}  // namespace

double CollectiveCurve::seconds(int64_t bytes) const {
  if (points.empty()) {
    throw std::logic_error("d9d::advise::CollectiveCurve: no measured points");
  }
  if (bytes <= points.front().first) {
    return points.front().second;
  }
  if (bytes >= points.back().first) {
    return points.back().second * static_cast<double>(bytes) /
           static_cast<double>(points.back().first);
  }
  const auto upper = std::lower_bound(points.begin(), points.end(), bytes,
                                      [](const auto& p, int64_t b) { return p.first < b; });
  const auto lower = upper - 1;
  const double x0 = std::log(static_cast<double>(lower->first));
  const double x1 = std::log(static_cast<double>(upper->first));
  const double t = (std::log(static_cast<double>(bytes)) - x0) / (x1 - x0);
  return std::exp(std::log(lower->second) +
                  t * (std::log(upper->second) - std::log(lower->second)));
}

namespace {

// What from_json_text read must make sense: sizes, times, layouts and the host's names.
void check_profile(const MachineProfile& p) {
  for (const auto& g : p.gemm) {
    if (g.m < 1 || g.n < 1 || g.k < 1 || g.seconds <= 0 ||
        (g.layout != "nt" && g.layout != "nn" && g.layout != "tn")) {
      bad_profile("a matmul needs sizes >= 1, seconds > 0 and layout nt, nn or tn");
    }
  }
  for (const auto& e : p.grouped_experts) {
    if (e.groups < 1 || e.rows < 1 || e.hidden < 1 || e.intermediate < 1 ||
        e.forward_seconds <= 0 || e.backward_seconds <= 0) {
      bad_profile("grouped experts need sizes >= 1 and seconds > 0");
    }
  }
  if (p.memory_bytes_per_second <= 0 || p.ranks < 1) {
    bad_profile("needs memory_bytes_per_second > 0 and ranks >= 1");
  }
  for (const auto& [compute, kinds] : p.host) {
    if (compute != "bf16_autocast" && compute != "bf16_parameters") {
      bad_profile("host costs are by compute bf16_autocast or bf16_parameters, not " + compute);
    }
    for (const auto& [kind, cost] : kinds) {
      if (kind != "plain" && kind != "pipelined" && kind != "tensor") {
        bad_profile("host costs are by step kind plain, pipelined or tensor, not " + kind);
      }
      if (cost.per_layer < 0 || cost.per_microbatch < 0 || cost.per_step < 0) {
        bad_profile("host costs must be >= 0 seconds (" + compute + ", " + kind + ")");
      }
    }
  }
}

}  // namespace

MachineProfile MachineProfile::from_json_text(std::string_view text) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    bad_profile(std::string("not JSON: ") + e.what());
  }
  MachineProfile out;
  try {
    out.device = json.value("device", std::string{});
    out.ranks = json.value("ranks", 1);
    if (!json.contains("gemm") || !json.contains("memory_bytes_per_second")) {
      bad_profile("needs \"gemm\" and \"memory_bytes_per_second\" (tools/gpu/profile-machine)");
    }
    for (const auto& g : json.at("gemm")) {
      out.gemm.push_back({.m = g.at("m"),
                          .n = g.at("n"),
                          .k = g.at("k"),
                          .layout = g.at("layout"),
                          .seconds = g.at("seconds")});
    }
    const auto attention = json.value("attention", nlohmann::json::array());
    for (const auto& a : attention) {
      out.attention.push_back({.batch = a.at("batch"),
                               .sequence = a.at("sequence"),
                               .heads = a.at("heads"),
                               .kv_heads = a.at("kv_heads"),
                               .head_dim = a.at("head_dim"),
                               .forward_seconds = a.at("forward_seconds"),
                               .backward_seconds = a.at("backward_seconds")});
    }
    const auto experts = json.value("grouped_experts", nlohmann::json::array());
    for (const auto& e : experts) {
      out.grouped_experts.push_back({.groups = e.at("groups"),
                                     .rows = e.at("rows"),
                                     .hidden = e.at("hidden"),
                                     .intermediate = e.at("intermediate"),
                                     .forward_seconds = e.at("forward_seconds"),
                                     .backward_seconds = e.at("backward_seconds")});
    }
    out.memory_bytes_per_second = json.at("memory_bytes_per_second");
    const auto host = json.value("host", nlohmann::json::object());
    for (const auto& [compute, kinds] : host.items()) {
      auto& by_kind = out.host[compute];  // named even when empty, for the check below
      for (const auto& [kind, cost] : kinds.items()) {
        by_kind[kind] = HostCost{.per_layer = cost.at("per_layer"),
                                 .per_microbatch = cost.at("per_microbatch"),
                                 .per_step = cost.at("per_step")};
      }
    }
    const auto collectives = json.value("collectives", nlohmann::json::object());
    for (const auto& [name, curve] : collectives.items()) {
      CollectiveCurve c;
      for (const auto& point : curve) {
        c.points.emplace_back(point.at(0).get<int64_t>(), point.at(1).get<double>());
      }
      std::sort(c.points.begin(), c.points.end());
      if (!c.points.empty()) {
        out.collectives.emplace(name, std::move(c));
      }
    }
  } catch (const nlohmann::json::exception& e) {
    bad_profile(std::string("malformed: ") + e.what());
  }
  check_profile(out);
  return out;
}

MachineProfile MachineProfile::from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    bad_profile("cannot read " + path);
  }
  std::stringstream text;
  text << in.rdbuf();
  return from_json_text(text.str());
}

double MachineProfile::gemm_seconds(int64_t m, int64_t n, int64_t k,
                                    std::string_view layout) const {
  const auto* best = nearest(gemm, [&](const MeasuredGemm& g) {
    return g.layout != layout
               ? std::numeric_limits<double>::infinity()
               : size_distance(g.m, m) + size_distance(g.n, n) + size_distance(g.k, k);
  });
  if (best == nullptr) {
    bad_profile("no measured matmul of layout \"" + std::string(layout) + "\"");
  }
  const double flops = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  const double measured =
      static_cast<double>(best->m) * static_cast<double>(best->n) * static_cast<double>(best->k);
  return best->seconds * flops / measured;
}

std::pair<double, double> MachineProfile::attention_seconds(int64_t batch, int64_t sequence,
                                                            int64_t heads, int64_t kv_heads,
                                                            int64_t head_dim) const {
  (void)kv_heads;  // grouped-query attention's FLOPs follow the query heads
  const auto work = [](int64_t b, int64_t h, int64_t s, int64_t d) {
    return static_cast<double>(b) * static_cast<double>(h) * static_cast<double>(s) *
           static_cast<double>(s) * static_cast<double>(d);
  };
  const auto* best = nearest(attention, [&](const MeasuredAttention& a) {
    return size_distance(a.batch * a.heads, batch * heads) + size_distance(a.sequence, sequence) +
           size_distance(a.head_dim, head_dim);
  });
  if (best == nullptr) {
    bad_profile("no measured attention");
  }
  const double scale = work(batch, heads, sequence, head_dim) /
                       work(best->batch, best->heads, best->sequence, best->head_dim);
  return {best->forward_seconds * scale, best->backward_seconds * scale};
}

std::pair<double, double> MachineProfile::grouped_experts_seconds(int64_t groups, int64_t rows,
                                                                  int64_t hidden,
                                                                  int64_t intermediate) const {
  const auto* best = nearest(grouped_experts, [&](const MeasuredGroupedExperts& e) {
    return size_distance(e.groups, groups) + size_distance(e.rows, rows) +
           size_distance(e.hidden, hidden) + size_distance(e.intermediate, intermediate);
  });
  if (best == nullptr) {
    bad_profile(
        "no measured grouped experts (tools/gpu/profile-machine measures them for the Qwen3-MoE "
        "configs it is given; profile_machine.py --only grouped_experts alone)");
  }
  const auto work = [](int64_t r, int64_t h, int64_t i) {
    return static_cast<double>(r) * static_cast<double>(h) * static_cast<double>(i);
  };
  const double scale =
      work(rows, hidden, intermediate) / work(best->rows, best->hidden, best->intermediate);
  return {best->forward_seconds * scale, best->backward_seconds * scale};
}

double MachineProfile::collective_seconds(std::string_view name, int64_t bytes, int group) const {
  if (group <= 1 || bytes <= 0) {
    return 0.0;
  }
  const auto it = collectives.find(name);
  if (it == collectives.end()) {
    bad_profile("no measured " + std::string(name) + " (profiled on " + std::to_string(ranks) +
                " GPU(s); tools/gpu/profile-machine measures collectives on two or more)");
  }
  const double t = it->second.seconds(bytes);
  if (name == "p2p" || ranks == group) {
    return t;
  }
  return ranks > 1 ? t * ring_share(group) / ring_share(ranks) : t;
}

const HostCost* MachineProfile::host_cost(Compute compute, std::string_view kind) const {
  const char* name = compute == Compute::bf16_autocast     ? "bf16_autocast"
                     : compute == Compute::bf16_parameters ? "bf16_parameters"
                                                           : "float32";
  const auto by_compute = host.find(name);
  if (by_compute == host.end()) {
    return nullptr;
  }
  const auto cost = by_compute->second.find(kind);
  return cost == by_compute->second.end() ? nullptr : &cost->second;
}

namespace {

// The forward's share of a layer's host time: in a traced plain step (0.6B, bf16 mixed, one
// H200; docs/measurements/2026-11-29-fan-out-linear-1xh200.txt) the training thread issuing the
// forwards took 253 ms and the autograd engine's thread issuing the backwards 492 ms.
constexpr double kHostForwardShare = 0.34;

// A rank's work of one microbatch on one stage (the whole model's over the stages), in seconds.
struct MicrobatchCosts {
  double forward = 0;          // F: matmuls, attention, elementwise, tp and cp communication
  double backward_input = 0;   // I: input gradients (and the recomputed forward)
  double backward_weight = 0;  // W: weight gradients and their accumulation
  double gemm = 0;
  double attention = 0;
  double memory = 0;
  double tensor_parallel = 0;
  double context_parallel = 0;
};

// A microbatch's matmuls on one rank: each phase's seconds, and the layers' forward matmuls of
// the attention and MLP parts apart (what recompute runs again).
struct MicrobatchGemms {
  double forward = 0;
  double input = 0;
  double weight = 0;
  double attention_forward = 0;
  double mlp_forward = 0;
};

// A decoder layer's q, k, v, o, gate, up, down (Megatron's slices) over `tokens`, then the head.
MicrobatchGemms microbatch_gemms(const model::Qwen3Config& c, int64_t tp, int64_t tokens,
                                 const MachineProfile& machine, double mlp_layers) {
  const int64_t h = c.hidden_size;
  const int64_t q = c.num_attention_heads * c.head_dim;
  const int64_t kv = c.num_key_value_heads * c.head_dim;
  const int64_t inter = c.intermediate_size;
  const auto layers = static_cast<double>(c.num_hidden_layers);
  MicrobatchGemms out;
  const auto linear = [&](int64_t n, int64_t k, double count) {
    const double forward = count * machine.gemm_seconds(tokens, n, k, "nt");
    out.forward += forward;
    out.input += count * machine.gemm_seconds(tokens, k, n, "nn");
    out.weight += count * machine.gemm_seconds(n, k, tokens, "tn");
    return forward;
  };
  out.attention_forward =
      linear(q / tp, h, layers) + linear(kv / tp, h, 2 * layers) + linear(h, q / tp, layers);
  out.mlp_forward = linear(inter / tp, h, 2 * mlp_layers) + linear(h, inter / tp, mlp_layers);
  linear(c.vocab_size / tp, h, 1);
  return out;
}

// Elementwise bytes per token of a layer's forward (the file comment): r the residual stream's
// element, a the activations'. (Under autocast the norms write autocast's dtype, so q, k, v, gate
// and up cast nothing: docs/design/0026.)
struct ElementwiseBytes {
  int64_t layer = 0;      // a dense layer's
  int64_t attention = 0;  // of which the attention part's: its norm, q, k, v, the rotations, output
  int64_t mlp = 0;        // of which SiLU-mul's: gate and up read, the product written
  double forward = 0;     // the microbatch's forward on one rank
};

ElementwiseBytes elementwise_bytes(const model::Qwen3Config& c, int64_t tp, int64_t tokens,
                                   Compute compute, double mlp_layers) {
  const int64_t h = c.hidden_size;
  const int64_t q = c.num_attention_heads * c.head_dim;
  const int64_t kv = c.num_key_value_heads * c.head_dim;
  const int64_t r = compute == Compute::bf16_parameters ? 2 : 4;
  const int64_t a = compute == Compute::float32 ? 4 : 2;
  ElementwiseBytes out;
  out.mlp = 3 * c.intermediate_size * a;
  out.layer = 8 * h * r + 2 * h * a + 4 * (q + kv) * a + 2 * q * a + out.mlp;
  out.attention = 4 * h * r + h * a + 4 * (q + kv) * a + 2 * q * a;
  // The loss: float32 logits written, read for the log-sum-exp, read and written for the gradient.
  const int64_t loss = 4 * c.vocab_size * 4 + 4 * h * r;
  out.forward =
      static_cast<double>(tokens) *
      (static_cast<double>(c.num_hidden_layers) * static_cast<double>(out.layer - out.mlp) +
       mlp_layers * static_cast<double>(out.mlp) + static_cast<double>(loss)) /
      static_cast<double>(tp);
  return out;
}

// Sequence parallelism: per layer two all-gathers and two reduce-scatters of [tokens, H] in the
// forward and as many in the backward; one more of each around the head.
double tensor_parallel_seconds(const model::Qwen3Config& c, const Candidate& cand, int64_t tokens,
                               Compute compute, const MachineProfile& machine) {
  if (cand.tp <= 1) {
    return 0;
  }
  const int64_t r = compute == Compute::bf16_parameters ? 2 : 4;
  const int64_t bytes = tokens * c.hidden_size * r;  // the residual stream (float32 under autocast)
  const double pair = machine.collective_seconds("all_gather", bytes, cand.tp) +
                      machine.collective_seconds("reduce_scatter", bytes, cand.tp);
  return pair * (4 * static_cast<double>(c.num_hidden_layers) + 2);
}

// Context parallelism: cp - 1 exchanges of K and V per layer forward, of K, V, dK, dV backward,
// each hidden behind the layer's attention where it is shorter: {forward, backward} seconds.
std::pair<double, double> context_parallel_seconds(const model::Qwen3Config& c,
                                                   const Candidate& cand, int64_t tokens,
                                                   Compute compute, const MachineProfile& machine,
                                                   double attention_forward,
                                                   double attention_backward) {
  if (cand.cp <= 1) {
    return {0.0, 0.0};
  }
  const int64_t a = compute == Compute::float32 ? 4 : 2;
  const auto layers = static_cast<double>(c.num_hidden_layers);
  const int64_t kv_bytes = tokens * 2 * c.num_key_value_heads * c.head_dim / cand.tp * a;
  const double hop = machine.collective_seconds("p2p", kv_bytes, 2);
  const double per_layer_forward = hop * static_cast<double>(cand.cp - 1);
  return {layers * std::max(0.0, per_layer_forward - attention_forward / layers),
          layers * std::max(0.0, 2 * per_layer_forward - attention_backward / layers)};
}

// What a PEFT policy changes in a microbatch's matmuls (seconds added; `weight` is negative when
// frozen layers skip more than the adapters add).
struct PeftGemms {
  double forward = 0;  // each adapter's h = s x A^T and y += h B^T
  double input = 0;    // its dh = s g B and dx += dh A
  double weight = 0;   // its A's and B's gradients, less each frozen layer's weight gradient
};

// One LoRA adapter of the model (apply_peft's lora_A and lora_B).
struct Adapter {
  std::string module;  // the adapted layer's name
  int64_t rank = 0;
  int64_t in = 0;
  int64_t out = 0;
  double scale = 0;
};

// The layers d9d::model::fan_out_linear runs together (they read one input): a decoder layer's
// q, k and v projections, or its gate and up projections; "" for any other layer.
std::string fan_out_group(std::string_view module) {
  const auto dot = module.rfind('.');
  const auto parent = std::string(module.substr(0, dot == std::string_view::npos ? 0 : dot));
  const auto last = module.substr(dot == std::string_view::npos ? 0 : dot + 1);
  if (last == "q_proj" || last == "k_proj" || last == "v_proj") {
    return parent + "#qkv";
  }
  if (last == "gate_proj" || last == "up_proj") {
    return parent + "#gate_up";
  }
  return "";
}

// `parameters`: the whole model's under the policy (apply_peft: each adapter's lora_A [rank, in]
// right after its layer's weight, lora_B [out, rank] after it). A frozen linear layer's weight
// gradient is not computed (a tied head's when the embedding is frozen). An adapter's GEMMs are
// thin (rank columns): each takes the longer of the profile's time at its FLOPs and its bfloat16
// operands' bytes at the elementwise bandwidth (they are bound by reading the [tokens, in] rows).
// Where every layer of a fan-out group (q, k, v; gate, up) has an adapter of one scale, d9d runs
// them as one node with the A factors stacked: one h = s x [A_1; ...]^T and one dx += dh [A_1;
// ...] over the ranks summed, instead of one of each per adapter.
PeftGemms peft_gemms(const model::Qwen3Config& c, const std::vector<ParameterShape>& parameters,
                     int64_t tokens, const MachineProfile& machine) {
  PeftGemms out;
  const auto thin = [&](int64_t m, int64_t n, int64_t k, std::string_view layout) {
    const auto bytes = static_cast<double>(2 * (m * k + k * n + m * n));
    return std::max(machine.gemm_seconds(m, n, k, layout), bytes / machine.memory_bytes_per_second);
  };
  bool head_listed = false;
  bool embedding_trains = true;
  std::vector<Adapter> adapters;
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const auto& p = parameters[i];
    if (p.name.ends_with("embed_tokens.weight")) {
      embedding_trains = p.trained;
      continue;
    }
    head_listed = head_listed || p.name == "lm_head.weight";
    if (p.name.ends_with(".lora_A.weight") && i + 1 < parameters.size()) {
      constexpr std::string_view suffix = ".lora_A.weight";
      adapters.push_back({.module = p.name.substr(0, p.name.size() - suffix.size()),
                          .rank = p.sizes[0],
                          .in = p.sizes[1],
                          .out = parameters[i + 1].sizes[0],
                          .scale = p.lora_scale});
      ++i;  // its lora_B
      continue;
    }
    if (p.sizes.size() == 2 && !p.trained) {
      out.weight -= machine.gemm_seconds(p.sizes[0], p.sizes[1], tokens, "tn");
    }
  }
  if (!head_listed && !embedding_trains) {
    out.weight -= machine.gemm_seconds(c.vocab_size, c.hidden_size, tokens, "tn");
  }
  // The fan-out groups whose every layer has an adapter of one scale: (adapters, ranks summed).
  std::map<std::string, std::pair<std::vector<const Adapter*>, int64_t>> groups;
  for (const auto& a : adapters) {
    if (const auto group = fan_out_group(a.module); !group.empty()) {
      auto& [members, ranks] = groups[group];
      members.push_back(&a);
      ranks += a.rank;
    }
  }
  std::map<std::string, bool, std::less<>> stacked;  // by module
  for (const auto& [group, entry] : groups) {
    const auto& members = entry.first;  // not a structured binding: the lambda below reads it
    const int64_t ranks = entry.second;
    const std::size_t layers = group.ends_with("#qkv") ? 3 : 2;
    const bool one_scale = std::all_of(members.begin(), members.end(), [&](const Adapter* a) {
      return a->scale == members.front()->scale;
    });
    if (members.size() != layers || !one_scale) {
      continue;
    }
    const auto in = members.front()->in;
    out.forward += thin(tokens, ranks, in, "nt");
    out.input += thin(tokens, in, ranks, "nn");
    for (const auto* a : members) {
      stacked[a->module] = true;
    }
  }
  for (const auto& a : adapters) {
    if (!stacked.contains(a.module)) {
      out.forward += thin(tokens, a.rank, a.in, "nt");
      out.input += thin(tokens, a.in, a.rank, "nn");
    }
    out.forward += thin(tokens, a.out, a.rank, "nt");
    out.input += thin(tokens, a.rank, a.out, "nn");
    out.weight += thin(a.rank, a.in, tokens, "tn") + thin(a.out, a.rank, tokens, "tn");
  }
  return out;
}

// `mlp_layers`: the decoder layers with a dense MLP (all of a dense Qwen3's; a MoE's others run
// their MoE block, moe_block_costs). `weight_elements`: the rank's parameters (cast once per step
// under autocast); `trained_elements`: those that train (their gradients accumulate).
MicrobatchCosts microbatch_costs(const model::Qwen3Config& c, const Candidate& cand,
                                 const StepOptions& o, const MachineProfile& machine,
                                 int64_t weight_elements, int64_t trained_elements,
                                 double mlp_layers, const PeftGemms& peft = {}) {
  const int64_t tp = cand.tp;
  const int64_t tokens = o.microbatch_size * o.sequence_length / cand.cp;
  const auto layers = static_cast<double>(c.num_hidden_layers);
  MicrobatchCosts out;
  auto gemms = microbatch_gemms(c, tp, tokens, machine, mlp_layers);
  gemms.forward += peft.forward;
  gemms.input += peft.input;
  gemms.weight += peft.weight;
  auto [attention_forward, attention_backward] =
      machine.attention_seconds(o.microbatch_size, o.sequence_length, c.num_attention_heads / tp,
                                c.num_key_value_heads / tp, c.head_dim);
  attention_forward *= layers / static_cast<double>(cand.cp);
  attention_backward *= layers / static_cast<double>(cand.cp);
  const auto bytes = elementwise_bytes(c, tp, tokens, o.compute, mlp_layers);
  const double bandwidth = machine.memory_bytes_per_second;
  double weight_casts = 0;
  double accumulation = 0;
  const auto elements = static_cast<double>(weight_elements);
  const auto trained = static_cast<double>(trained_elements);
  if (o.compute == Compute::bf16_autocast) {
    // Cast once per step (d9d/core/detail/weight_casts.hpp): a microbatch's share.
    weight_casts = elements * (4 + 2) / bandwidth / std::max(1, cand.microbatches);
    // The GEMM writes the float32 gradient (src/model/split_linear.cpp), added into .grad.
    accumulation = trained * (4 + 4) / bandwidth;
  } else {
    const double g = o.compute == Compute::float32 ? 4 : 2;
    accumulation = trained * 3 * g / bandwidth;
  }
  out.memory = 3 * bytes.forward / bandwidth + weight_casts + accumulation;
  out.tensor_parallel = tensor_parallel_seconds(c, cand, tokens, o.compute, machine);
  const auto [cp_forward, cp_backward] = context_parallel_seconds(
      c, cand, tokens, o.compute, machine, attention_forward, attention_backward);
  out.context_parallel = cp_forward + cp_backward;
  out.gemm = gemms.forward + gemms.input + gemms.weight;
  out.attention = attention_forward + attention_backward;
  const double forward_memory = bytes.forward / bandwidth + weight_casts;
  out.forward =
      gemms.forward + attention_forward + forward_memory + out.tensor_parallel / 2 + cp_forward;
  out.backward_input = gemms.input + attention_backward + 2 * bytes.forward / bandwidth +
                       out.tensor_parallel / 2 + cp_backward;
  if (o.recompute.any()) {
    // The recomputed layers' forward (or its attention part) once more, in I.
    const double share =
        static_cast<double>(o.recompute.layers_recomputed(c.num_hidden_layers)) / layers;
    const double per_byte =
        static_cast<double>(tokens) * layers / static_cast<double>(tp) / bandwidth;
    const double gemm =
        share * (o.recompute.attention_only ? gemms.attention_forward
                                            : gemms.attention_forward + gemms.mlp_forward);
    const double memory =
        share * per_byte *
        static_cast<double>(o.recompute.attention_only ? bytes.attention : bytes.layer);
    out.backward_input += gemm + share * attention_forward + memory;
    out.gemm += gemm;
    out.attention += share * attention_forward;
    out.memory += memory;
  }
  out.backward_weight = gemms.weight + accumulation;
  return out;
}

// The data-parallel strategy's cost of a step: its collectives' seconds and, under FullyShard,
// its own copies on the compute stream.
struct DataParallelTime {
  double collectives = 0;
  double copies = 0;
};

// Replicate over dp_replicate x cp; FullyShard over dp_shard x cp, with HSDP replicas
// all-reducing the shards. `weight_elements`: the rank's (tp-sliced) parameters;
// `shard_elements`: what it keeps of them under FullyShard.
DataParallelTime data_parallel_time(const Candidate& candidate, const StepOptions& options,
                                    const MachineProfile& machine, int64_t weight_elements,
                                    double shard_elements,
                                    std::optional<int64_t> trained_elements = std::nullopt) {
  const int m = candidate.microbatches;
  const auto& rules = options.precision;
  const auto reduce_element =
      static_cast<int64_t>(options.reduce_bf16 ? 2 : c10::elementSize(rules.gradients));
  // Only the parameters that train have gradients (a PEFT policy's; FullyShard is not predicted
  // with one).
  const int64_t gradient_bytes = trained_elements.value_or(weight_elements) * reduce_element;
  DataParallelTime out;
  if (!candidate.fully_shard) {
    out.collectives = machine.collective_seconds("all_reduce", gradient_bytes,
                                                 candidate.dp_replicate * candidate.cp);
    return out;
  }
  const int group = candidate.dp_shard * candidate.cp;
  const int64_t gather_element = options.compute == Compute::float32 ? 4 : 2;
  const double gathers = options.reshard_after_forward ? 2.0 * m : 1.0;
  const double reduces = options.reduce_every_microbatch ? m : 1.0;
  const double gather =
      machine.collective_seconds("all_gather", weight_elements * gather_element, group);
  const double reduce = machine.collective_seconds("reduce_scatter", gradient_bytes, group);
  const double replicas = machine.collective_seconds(
      "all_reduce", gradient_bytes / std::max(group, 1), candidate.dp_replicate);
  out.collectives = gathers * gather + reduces * reduce + replicas;
  // FullyShard's own copies (src/parallel/fully_shard.cpp), at any group size: each gather casts
  // the shard into the flat gather input; each reduction lays the gathered gradients out for the
  // reduce-scatter and adds its output to the shard's gradient.
  const auto parameter_element = static_cast<double>(c10::elementSize(rules.parameters));
  const double gather_copy =
      shard_elements * (parameter_element + static_cast<double>(gather_element));
  const double reduce_copy =
      static_cast<double>(weight_elements) * static_cast<double>(gather_element + reduce_element) +
      shard_elements * 3.0 * static_cast<double>(reduce_element);
  out.copies = (gathers * gather_copy + reduces * reduce_copy) / machine.memory_bytes_per_second;
  return out;
}

// The state of the pipeline rank that keeps the most: its (tp-sliced) parameters unsharded, and
// what it keeps under FullyShard; of them, those that train (all but a PEFT policy's frozen ones).
struct RankState {
  StateBytes whole;
  StateBytes sharded;
  StateBytes trained;          // unsharded
  StateBytes trained_sharded;  // what AdamW updates
};

RankState fullest_rank_state(const model::Qwen3Config& config, const Candidate& candidate,
                             const pipeline::Program& program, const StepOptions& options) {
  StateRules rules = options.precision;
  rules.tensor_ranks = candidate.tp;
  rules.shard_ranks = 1;
  StateRules shard_rules = rules;
  shard_rules.shard_ranks = candidate.fully_shard ? candidate.dp_shard * candidate.cp : 1;
  RankState out;
  for (int r = 0; r < candidate.pp; ++r) {
    auto parameters = candidate.pp > 1
                          ? qwen3_rank_parameters(config, program, r, options.sequence_length)
                          : qwen3_parameters(config);
    if (options.peft) {
      parameters = apply_peft(parameters, *options.peft);
    }
    const auto w = state_bytes(parameters, rules, 0);
    if (w.total() > out.whole.total()) {
      out.whole = w;
      out.sharded = state_bytes(parameters, shard_rules, 0);
      std::erase_if(parameters, [](const ParameterShape& p) { return !p.trained; });
      out.trained = state_bytes(parameters, rules, 0);
      out.trained_sharded = state_bytes(parameters, shard_rules, 0);
    }
  }
  return out;
}

// A rank's host time per microbatch: the microbatch's own work and its 1/pp of the layers (0
// where the profile did not measure the host for the step's kind).
double rank_host_per_microbatch(const HostCost* host, const model::Qwen3Config& config, int pp) {
  return host == nullptr ? 0.0
                         : host->per_microbatch +
                               host->per_layer * static_cast<double>(config.num_hidden_layers) /
                                   static_cast<double>(pp);
}

// What the pipeline program makes of the microbatches' costs: its makespan, the activations'
// point-to-point time and the idle time.
struct PipelineTime {
  double compute = 0;
  double p2p = 0;
  double bubble = 0;
};

PipelineTime pipelined_compute(const model::Qwen3Config& config, const Candidate& candidate,
                               const pipeline::Program& program, const StepOptions& options,
                               const MachineProfile& machine, const MicrobatchCosts& costs,
                               const HostCost* host) {
  const int stages = program.stages();
  const double share = 1.0 / static_cast<double>(stages);
  const int64_t boundary_bytes = options.microbatch_size * options.sequence_length / candidate.cp *
                                 config.hidden_size *
                                 (options.compute == Compute::bf16_parameters ? 2 : 4);
  const double hop = machine.collective_seconds("p2p", boundary_bytes, 2);
  // A stage's host time per microbatch: a rank's, over the stages it holds (pp / stages of one).
  const double stage_host = rank_host_per_microbatch(host, config, candidate.pp) *
                            static_cast<double>(candidate.pp) * share;
  const pipeline::Costs stage{
      .forward = std::max(costs.forward * share + hop, kHostForwardShare * stage_host),
      .backward_input =
          std::max(costs.backward_input * share + hop, (1 - kHostForwardShare) * stage_host),
      .backward_weight = costs.backward_weight * share};
  PipelineTime out;
  out.compute = pipeline::simulate(program, stage).makespan;
  const double actions = static_cast<double>(candidate.microbatches) * static_cast<double>(stages) /
                         static_cast<double>(candidate.pp);  // each of F, I and W
  out.p2p = actions * 2 * hop;
  out.bubble = std::max(
      0.0, out.compute - actions * (stage.forward + stage.backward_input + stage.backward_weight));
  return out;
}

// The sizes every prediction needs, and bfloat16 compute (the profile's matmuls).
void check_sizes(const Candidate& candidate, const StepOptions& options) {
  if (options.microbatch_size < 1 || options.sequence_length < 1 || candidate.microbatches < 1 ||
      candidate.tp < 1 || candidate.cp < 1 || candidate.pp < 1 || candidate.dp_shard < 1 ||
      candidate.dp_replicate < 1) {
    throw std::invalid_argument(
        "d9d::advise::predict_step_time: sizes, degrees and microbatches must be at least 1");
  }
  if (options.compute == Compute::float32) {
    throw std::invalid_argument(
        "d9d::advise::predict_step_time: float32 steps are not predicted (the machine profile "
        "measures bfloat16 matmuls)");
  }
}

// The step's end: AdamW on the rank's (sharded) state — it reads the parameter, gradient and
// both moments and writes the parameter and moments; the clipping norm reads the gradients, the
// clipping scales them, zeroing writes them — the data-parallel strategy's copies on the compute
// stream and its collectives whole (see the file comment), and the host's bound: `host_time` the
// host's time issuing the step (0 where not measured). `compute`: the microbatches' time;
// `updated`: the state AdamW updates (the rank's shards of the parameters that train).
void finish_step(StepTime& out, double compute, const StateBytes& updated,
                 const DataParallelTime& data, double host_time, const MachineProfile& machine) {
  out.optimizer =
      static_cast<double>(2 * updated.parameters + 5 * updated.gradients + 2 * updated.optimizer) /
      machine.memory_bytes_per_second;
  out.memory += data.copies;
  out.data_parallel += data.collectives;
  out.data_parallel_exposed = out.data_parallel;
  out.total = compute + data.copies + out.optimizer + out.data_parallel_exposed;
  out.host = host_time;
  out.total = std::max(out.total, out.host);
}

// A linear layer's forward and its two backward GEMMs on `tokens` rows, [n, k] weight.
std::pair<double, double> linear_seconds(const MachineProfile& machine, int64_t tokens, int64_t n,
                                         int64_t k) {
  return {machine.gemm_seconds(tokens, n, k, "nt"),
          machine.gemm_seconds(tokens, k, n, "nn") + machine.gemm_seconds(n, k, tokens, "tn")};
}

// One microbatch's MoE blocks on a rank (all its MoE layers; the file comment), in seconds.
struct MoeBlockCosts {
  double forward = 0;
  double backward = 0;
  double gemm = 0;  // the routers' and shared experts'
  double experts = 0;
  double memory = 0;
  double all_to_all = 0;
};

MoeBlockCosts moe_block_costs(const model::Qwen3MoeConfig& c, ExpertSplit split,
                              const StepOptions& o, const MachineProfile& machine) {
  const auto layers = static_cast<double>(qwen3_moe_layer_count(c));
  const int64_t tokens = o.microbatch_size * o.sequence_length;
  const int64_t h = c.hidden_size;
  const int64_t e = c.num_experts;
  const int64_t a = 2;  // bfloat16 activations (float32 steps are not predicted)
  const int64_t routed = tokens * c.num_experts_per_tok;
  const auto rows = static_cast<int64_t>(std::llround(static_cast<double>(routed) * split.load));
  const auto [router_forward, router_backward] = linear_seconds(machine, tokens, e, h);
  const auto [experts_forward, experts_backward] =
      machine.grouped_experts_seconds(e / split.ranks, rows, h, c.moe_intermediate_size);
  double gemm_forward = router_forward;
  double gemm_backward = router_backward;
  // The router's float32 logits written, softmax read and written, top-k read (12 E), its float32
  // copy of the input (H a read, 4 H written); each routing's row gathered (H a read and written)
  // and its output read for the weighted sum (H a), the token's sum written (H a).
  double bytes = static_cast<double>(tokens * (12 * e + h * (a + 4) + h * a) + routed * 3 * h * a);
  if (split.ranks > 1) {
    bytes += static_cast<double>(rows * 4 * h * a);  // received rows into expert order and back
  }
  const int64_t shared = c.shared_expert_intermediate_size;
  if (shared > 0) {  // a dense SiLU MLP and its sigmoid gate on every token
    for (const auto& [n, k, count] :
         {std::tuple{shared, h, 2}, {h, shared, 1}, {int64_t{1}, h, 1}}) {
      const auto [f, b] = linear_seconds(machine, tokens, n, k);
      gemm_forward += count * f;
      gemm_backward += count * b;
    }
    bytes += static_cast<double>(tokens * (3 * shared * a + 3 * h * a));
  }
  // Float32 experts under bfloat16 parameters (ExpertSplit::float32_experts): each layer casts
  // its experts (4 bytes read, 2 written) and the backward adds their float32 gradients (8 bytes
  // per element) where bfloat16 experts' would move 6.
  double expert_bytes_forward = 0;
  double expert_bytes_backward = 0;
  if (split.float32_experts && o.compute == Compute::bf16_parameters) {
    const int64_t local_experts = e / split.ranks;  // divides: checked by the caller
    const auto weights = static_cast<double>(3 * local_experts * c.moe_intermediate_size * h);
    expert_bytes_forward = weights * (4 + 2);
    expert_bytes_backward = weights * (8 - 6);
  }
  const double memory = bytes / machine.memory_bytes_per_second;
  const double cast = expert_bytes_forward / machine.memory_bytes_per_second;
  const double accumulate = expert_bytes_backward / machine.memory_bytes_per_second;
  MoeBlockCosts out;
  if (split.ranks > 1) {
    const auto row_bytes =
        static_cast<int64_t>(std::llround(static_cast<double>(routed * h * a) * split.load));
    const double move = machine.collective_seconds("all_to_all", row_bytes, split.ranks);
    const double counts = machine.collective_seconds("all_to_all", e * 8, split.ranks);
    out.all_to_all = layers * (4 * move + counts);
  }
  out.gemm = layers * (gemm_forward + gemm_backward);
  out.experts = layers * (experts_forward + experts_backward);
  out.memory = layers * (3 * memory + cast + accumulate);
  out.forward = layers * (gemm_forward + experts_forward + memory + cast) + out.all_to_all / 2;
  out.backward =
      layers * (gemm_backward + experts_backward + 2 * memory + accumulate) + out.all_to_all / 2;
  return out;
}

// A MoE rank's state: the experts split over ep (and under FullyShard sharded over
// ep_replicate), the rest as for the dense model; the rank's weights and, of them, its experts'.
struct MoeRankState {
  StateBytes sharded;
  int64_t weight_elements = 0;
  int64_t expert_elements = 0;
  int shard_ranks = 1;  // what the non-expert parameters are sharded over
};

MoeRankState moe_rank_state(const model::Qwen3MoeConfig& config, const Candidate& candidate,
                            const StepOptions& options, int ep, int ep_replicate) {
  const auto parameters = qwen3_parameters(config);
  StateRules rules = options.precision;
  rules.expert_parallel = true;
  rules.expert_ranks = ep;
  const auto whole = state_bytes(parameters, rules, 0);
  rules.shard_ranks = candidate.fully_shard ? candidate.dp_shard : 1;
  rules.expert_shard_ranks = candidate.fully_shard ? ep_replicate : 1;
  MoeRankState out{.sharded = state_bytes(parameters, rules, 0), .shard_ranks = rules.shard_ranks};
  for (const auto& p : parameters) {
    out.expert_elements += p.expert && p.trained ? p.numel() / ep : 0;
  }
  out.weight_elements =
      whole.parameters / static_cast<int64_t>(c10::elementSize(options.precision.parameters));
  return out;
}

// The data-parallel time of a MoE rank: its non-expert parameters over the data-parallel ranks as
// for the dense model; its experts over the ranks that hold the same experts (FullyShard: sharded
// over ep_replicate and all-reduced over the HSDP replicas, or whole and all-reduced when
// ep_replicate is 1; Replicate: all-reduced).
DataParallelTime moe_data_parallel_time(const Candidate& candidate, const StepOptions& options,
                                        const MachineProfile& machine, const MoeRankState& state,
                                        int ep_replicate, int ep_dp_replicate) {
  const int64_t dense_elements = state.weight_elements - state.expert_elements;
  auto data = data_parallel_time(
      candidate, options, machine, dense_elements,
      static_cast<double>(dense_elements) / static_cast<double>(state.shard_ranks));
  if (ep_replicate * ep_dp_replicate > 1) {
    const bool sharded_experts = candidate.fully_shard && ep_replicate > 1;
    Candidate group = candidate;
    group.fully_shard = sharded_experts;
    group.cp = 1;
    group.dp_replicate = sharded_experts ? ep_dp_replicate : ep_replicate * ep_dp_replicate;
    group.dp_shard = sharded_experts ? ep_replicate : 1;
    const auto experts = data_parallel_time(
        group, options, machine, state.expert_elements,
        static_cast<double>(state.expert_elements) / static_cast<double>(group.dp_shard));
    data.collectives += experts.collectives;
    data.copies += experts.copies;
  }
  return data;
}

}  // namespace

StepTime predict_step_time(const model::Qwen3Config& config, const Candidate& candidate,
                           const StepOptions& options, const MachineProfile& machine) {
  const auto program =
      candidate.pp > 1 && candidate.microbatches >= 1
          ? build_schedule(candidate.schedule, candidate.pp, candidate.microbatches)
          : pipeline::Program{};
  return predict_step_time(config, candidate, program, options, machine);
}

StepTime predict_step_time(const model::Qwen3Config& config, const Candidate& candidate,
                           const pipeline::Program& program, const StepOptions& options,
                           const MachineProfile& machine) {
  check_sizes(candidate, options);
  const int m = candidate.microbatches;
  const int data_ranks = candidate.dp_replicate * candidate.dp_shard;
  StepTime out;
  out.tokens =
      static_cast<int64_t>(data_ranks) * m * options.microbatch_size * options.sequence_length;

  if (candidate.pp > 1 && (program.pp != candidate.pp || program.microbatches != m)) {
    throw std::invalid_argument(
        "d9d::advise::predict_step_time: the program is for pp " + std::to_string(program.pp) +
        " and " + std::to_string(program.microbatches) + " microbatches, the Plan has pp " +
        std::to_string(candidate.pp) + " and " + std::to_string(m));
  }
  PeftGemms peft;
  if (options.peft) {
    if (candidate.pp > 1 || candidate.tp > 1 || candidate.fully_shard || options.recompute.any()) {
      throw std::invalid_argument(
          "d9d::advise::predict_step_time: a PEFT policy is predicted without a pipeline, tensor "
          "parallelism, FullyShard or recompute so far");
    }
    peft = peft_gemms(config, apply_peft(qwen3_parameters(config), *options.peft),
                      options.microbatch_size * options.sequence_length / candidate.cp, machine);
  }
  // The slowest pipeline rank's state (the per-rank figures below take the largest).
  const auto state = fullest_rank_state(config, candidate, program, options);
  const auto parameter_bytes = static_cast<int64_t>(c10::elementSize(options.precision.parameters));
  const int64_t weight_elements = state.whole.parameters / parameter_bytes;
  const int64_t trained_elements = state.trained.parameters / parameter_bytes;
  const auto costs =
      microbatch_costs(config, candidate, options, machine, weight_elements, trained_elements,
                       static_cast<double>(config.num_hidden_layers), peft);

  // Each rank runs its 1/pp of the model's work for the m microbatches; under a pipeline the
  // program decides the idle time.
  const double per_rank = static_cast<double>(m) / static_cast<double>(candidate.pp);
  double compute = (costs.forward + costs.backward_input + costs.backward_weight) * m;
  // The host's cost of the step's kind, where the profile measured it.
  const auto* host = machine.host_cost(
      options.compute, candidate.tp > 1 ? "tensor" : (candidate.pp > 1 ? "pipelined" : "plain"));
  if (candidate.pp > 1) {
    const auto piped = pipelined_compute(config, candidate, program, options, machine, costs, host);
    compute = piped.compute;
    out.pipeline_p2p = piped.p2p;
    out.bubble = piped.bubble;
  }
  out.gemm = costs.gemm * per_rank;
  out.attention = costs.attention * per_rank;
  out.memory = costs.memory * per_rank;
  out.tensor_parallel = costs.tensor_parallel * per_rank;
  out.context_parallel = costs.context_parallel * per_rank;
  const auto data = data_parallel_time(
      candidate, options, machine, weight_elements,
      static_cast<double>(state.sharded.parameters) / static_cast<double>(parameter_bytes),
      trained_elements);
  // The rank's layers and microbatches, as the host issues them one after the other.
  const double host_time =
      host == nullptr ? 0.0
                      : host->per_step + static_cast<double>(m) *
                                             rank_host_per_microbatch(host, config, candidate.pp);
  finish_step(out, compute, state.trained_sharded, data, host_time, machine);
  return out;
}

StepTime predict_step_time(const model::Qwen3MoeConfig& config, const Candidate& candidate,
                           ExpertSplit experts, const StepOptions& options,
                           const MachineProfile& machine) {
  check_sizes(candidate, options);
  const auto refuse = [](const std::string& why) {
    throw std::invalid_argument("d9d::advise::predict_step_time (Qwen3-MoE): " + why);
  };
  if (candidate.pp > 1 || candidate.tp > 1 || candidate.cp > 1 || options.recompute.any()) {
    refuse("not predicted under a pipeline, tensor or context parallelism, or recompute yet");
  }
  if (options.peft) {
    refuse("a PEFT policy is not predicted on a Qwen3-MoE yet");
  }
  if (config.moe_capacity_factor > 0) {
    refuse("token dropping (moe_capacity_factor) is not predicted; dropless routing is");
  }
  const int data_ranks = candidate.dp_replicate * candidate.dp_shard;
  if (experts.ranks < 1 || config.num_experts % experts.ranks != 0 ||
      data_ranks % experts.ranks != 0 || !(experts.load > 0)) {
    refuse("ep " + std::to_string(experts.ranks) + " must divide the " +
           std::to_string(config.num_experts) + " experts and the " + std::to_string(data_ranks) +
           " data-parallel ranks, and the load must be > 0");
  }
  const int m = candidate.microbatches;
  // The expert domain (d9d::DeviceMesh's rule): the ranks holding the same experts are the HSDP
  // replicas' (ep_dp_replicate) times, within one, ep_replicate.
  const int ep_replicate = expert_replicate_ranks({.dp_replicate = candidate.dp_replicate,
                                                   .dp_shard = candidate.dp_shard,
                                                   .ep = experts.ranks});
  const int ep_dp_replicate = data_ranks / (experts.ranks * ep_replicate);
  StepTime out;
  out.tokens =
      static_cast<int64_t>(data_ranks) * m * options.microbatch_size * options.sequence_length;
  const auto state = moe_rank_state(config, candidate, options, experts.ranks, ep_replicate);
  const auto costs = microbatch_costs(
      config, candidate, options, machine, state.weight_elements, state.weight_elements,
      static_cast<double>(config.num_hidden_layers - qwen3_moe_layer_count(config)));
  const auto moe = moe_block_costs(config, experts, options, machine);
  const double compute =
      (costs.forward + costs.backward_input + costs.backward_weight + moe.forward + moe.backward) *
      m;
  out.gemm = (costs.gemm + moe.gemm) * m;
  out.attention = costs.attention * m;
  out.memory = (costs.memory + moe.memory) * m;
  out.experts = moe.experts * m;
  out.expert_parallel = moe.all_to_all * m;
  const auto data =
      moe_data_parallel_time(candidate, options, machine, state, ep_replicate, ep_dp_replicate);
  const auto* host = machine.host_cost(options.compute, "plain");
  const double host_time =
      host == nullptr
          ? 0.0
          : host->per_step + static_cast<double>(m) * rank_host_per_microbatch(host, config, 1);
  finish_step(out, compute, state.sharded, data, host_time, machine);
  return out;
}

}  // namespace d9d::advise
