// d9d/pipeline/executor.cpp — the pipeline "VM": one rank's actions over LibTorch stages, with
// its point-to-point batches in flight until compute needs what they receive (design 0015).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/autograd.h>

#include <d9d/core/collectives.hpp>
#include <d9d/core/weight_grad.hpp>
#include <d9d/pipeline/executor.hpp>
#include <d9d/pipeline/pairs.hpp>
#include <d9d/pipeline/schedules.hpp>

namespace d9d::pipeline {
namespace {

using Key = std::pair<int, int>;  // (stage, microbatch)

std::string where(const Action& action) { return " (action " + to_string(action) + ")"; }

std::string describe(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    out += (d > 0 ? ", " : "") + std::to_string(t.size(d));
  }
  return out + "] " + std::string(c10::toString(t.scalar_type()));
}

// A posted batch of sends and receives and the tensors it reads from or writes into, kept alive
// until it is waited for.
struct Pending {
  P2PRequests requests;
  std::vector<at::Tensor> tensors;
  bool done = false;
};

// Batches a failed step left in flight: neither c10d nor Gloo can cancel a posted send or
// receive, so their tensors must outlive them; they are kept until the process exits (a failed
// pipeline step normally ends the job, design 0008), at most one step's messages per failure.
void keep_until_exit(std::vector<Pending> batches) {
  static std::mutex mutex;
  static auto* kept = new std::vector<Pending>();  // NOLINT(cppcoreguidelines-owning-memory)
  const std::lock_guard<std::mutex> lock(mutex);
  for (auto& batch : batches) {
    if (!batch.done) {
      kept->push_back(std::move(batch));
    }
  }
}

// When each compute action of a step ran: the clock on the CPU, events on the current stream on
// CUDA (resolved only when asked for). Each action spans two of the recorded points; the two
// actions of a pair share theirs.
struct Recorder {
  c10::Device device{at::kCPU};
  std::chrono::steady_clock::time_point start;
  std::unique_ptr<c10::Event> start_event;
  std::vector<Action> actions;
  static constexpr std::size_t kUnfinished = static_cast<std::size_t>(-1);
  std::vector<std::pair<std::size_t, std::size_t>> spans;  // per action: its two points
  std::vector<double> seconds;                             // CPU: the points
  std::vector<std::unique_ptr<c10::Event>> events;         // CUDA: the points

  void begin(c10::Device on) {
    device = on;
    actions.clear();
    spans.clear();
    seconds.clear();
    events.clear();
    start_event = nullptr;
    if (device.is_cuda()) {
      start_event = mark_event();
    } else {
      start = std::chrono::steady_clock::now();
    }
  }
  [[nodiscard]] std::unique_ptr<c10::Event> mark_event() const {
    const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    auto event =
        std::make_unique<c10::Event>(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    event->record(guard.getStream(device));
    return event;
  }
  std::size_t point() {
    if (device.is_cuda()) {
      events.push_back(mark_event());
      return events.size() - 1;
    }
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    return seconds.size() - 1;
  }
  // Before (done = false) and after (done = true) one action, or both actions of a pair.
  void mark(const std::vector<Action>& running, bool done) {
    const std::size_t p = point();
    if (!done) {
      for (const auto& action : running) {
        actions.push_back(action);
        spans.emplace_back(p, kUnfinished);
      }
      return;
    }
    for (std::size_t i = spans.size() - running.size(); i < spans.size(); ++i) {
      spans[i].second = p;
    }
  }
  [[nodiscard]] std::vector<Timeline::Slot> slots() const {
    std::vector<Timeline::Slot> out;
    const auto at = [&](std::size_t p) {
      if (device.is_cuda()) {
        events[p]->synchronize();
        return start_event->elapsedTime(*events[p]) / 1e3;
      }
      return seconds[p];
    };
    for (std::size_t i = 0; i < actions.size() && spans[i].second != kUnfinished; ++i) {
      out.push_back(
          {.action = actions[i], .start = at(spans[i].first), .end = at(spans[i].second)});
    }
    return out;
  }
};

}  // namespace

struct Executor::Impl {
  Program program;
  ProcessGroup group;
  std::map<int, Stage> stages;
  std::function<TensorSpec(int)> activation;
  std::function<void(const Action&, bool)> hook;
  ExecutorOptions options;
  Recorder recorder;
  bool recorded = false;  // the last run() recorded its timeline
  bool trace = std::getenv("D9D_PIPELINE_TRACE") != nullptr;  // each action on stderr
  int rank = 0;

  // Per step.
  std::map<Key, at::Tensor> inputs;       // the stage's input (a leaf when it needs a gradient)
  std::map<Key, at::Tensor> outputs;      // the stage's output; the loss on the last stage
  std::map<Key, at::Tensor> received;     // activations received for (stage, mb)
  std::map<Key, at::Tensor> grad_output;  // gradients received for the output of (stage, mb)
  std::map<Key, at::Tensor> grad_input;   // the gradient of (stage, mb)'s input, after B / I
  std::map<Key, std::unique_ptr<WeightGradQueue>> queues;
  std::vector<P2POp> batch;                     // the run of sends and receives not posted yet
  std::vector<Pending> pending;                 // posted batches, in posting order
  std::map<Key, std::size_t> activation_batch;  // (stage, mb) -> the batch receiving its input
  std::map<Key, std::size_t> gradient_batch;    // (stage, mb) -> the batch receiving its grad
  StepResult result;

  [[nodiscard]] int last_stage() const { return program.stages() - 1; }
  [[nodiscard]] bool local(int stage) const {
    return stage_rank(program.placement, program.pp, stage) == rank;
  }
  // Gloo matches by tag; NCCL in order (verify() checks the order).
  [[nodiscard]] int tag(bool gradient, int receiving_stage, int mb) const {
    return 2 * (receiving_stage * program.microbatches + mb) + (gradient ? 1 : 0);
  }

  // Posts the run of sends and receives collected since the last compute action as one batch;
  // without overlap, waits for it at once.
  void post() {
    if (batch.empty()) {
      return;
    }
    RECORD_USER_SCOPE("d9d::pipeline::post");
    Pending posted{.requests = batch_isend_irecv(group, batch), .tensors = {}, .done = false};
    for (auto& op : batch) {
      posted.tensors.push_back(std::move(op.tensor));
    }
    batch.clear();
    pending.push_back(std::move(posted));
    if (!options.overlap_p2p) {
      wait_batch(pending.size() - 1);
    }
  }

  // Adds `op` to the batch not posted yet, which gets index pending.size() when posted; returns
  // that index. An NCCL group runs its operations with one peer in steps, each step the next
  // send and the next receive, so a second send (or receive) to the same peer waits for the
  // first step's receive (or send): in a group [send a, send b, receive c] with one peer, b is
  // sent only once c arrives, which deadlocks when the peer sends c only after receiving b (it
  // did with overlap_pairs, whose pairs put two sends to the same peer side by side). So a batch
  // holds at most one send and one receive per peer, and an operation that would be the second
  // posts the batch first; every operation of a batch then completes on its own, as verify()'s
  // model of a batch assumes. tests/pipeline/schedule_test.cpp (Pipeline_NcclModel) runs every
  // schedule's program, with and without pairs, through this rule and NCCL's ordering.
  std::size_t enqueue(P2POp op) {
    const bool repeats = std::any_of(batch.begin(), batch.end(), [&](const P2POp& queued) {
      return queued.kind == op.kind && queued.peer == op.peer;
    });
    if (repeats) {
      post();
    }
    batch.push_back(std::move(op));
    return pending.size();
  }

  void wait_batch(std::size_t index) {
    auto& posted = pending[index];
    if (posted.done) {
      return;
    }
    if (trace) {
      std::fprintf(stderr, "[d9d pipeline rank %d] wait for batch %zu\n", rank, index);
    }
    RECORD_USER_SCOPE("d9d::pipeline::wait");
    posted.requests.wait();
    posted.done = true;
    posted.tensors.clear();  // received tensors live on in `received` / `grad_output`
  }

  // Waits for the batch that receives what compute action `a` takes from another rank.
  void await_inputs(const Action& a) {
    const Key key{a.stage, a.microbatch};
    const std::map<Key, std::size_t>* from = nullptr;
    if (a.op == Op::forward && a.stage > 0 && !local(a.stage - 1)) {
      from = &activation_batch;
    } else if ((a.op == Op::backward || a.op == Op::backward_input) && a.stage < last_stage() &&
               !local(a.stage + 1)) {
      from = &gradient_batch;
    }
    if (from != nullptr) {
      const auto it = from->find(key);
      if (it != from->end()) {
        wait_batch(it->second);  // a missing receive is reported when the tensor is taken
      }
    }
  }

  void wait_all() {
    for (std::size_t i = 0; i < pending.size(); ++i) {
      wait_batch(i);
    }
  }

  void clear_step() {
    inputs.clear();
    outputs.clear();
    received.clear();
    grad_output.clear();
    grad_input.clear();
    queues.clear();
    batch.clear();
    keep_until_exit(std::move(pending));  // only what a failed step left in flight
    pending.clear();
    activation_batch.clear();
    gradient_batch.clear();
  }

  at::Tensor take(std::map<Key, at::Tensor>& from, const Key& key, const Action& action,
                  const char* what) {
    const auto it = from.find(key);
    if (it == from.end()) {
      throw std::logic_error("d9d::pipeline::Executor: rank " + std::to_string(rank) + " has no " +
                             what + where(action));
    }
    auto out = std::move(it->second);
    from.erase(it);
    return out;
  }

  void forward(const Action& a, const std::vector<at::Tensor>& step_inputs, const LossFn& loss) {
    const Key key{a.stage, a.microbatch};
    at::Tensor x;
    if (a.stage == 0) {
      if (a.microbatch >= static_cast<int>(step_inputs.size())) {
        throw std::invalid_argument(
            "d9d::pipeline::Executor: run() got " + std::to_string(step_inputs.size()) +
            " inputs; the program has " + std::to_string(program.microbatches) + " microbatches");
      }
      x = step_inputs[static_cast<std::size_t>(a.microbatch)];
      // On the group's device, wherever the caller made it (d9d::Inference's forward step hands
      // over the task's stage_input as it is: host tensors from the data loader).
      if (group.valid()) {
        x = x.to(group.device());
      }
    } else if (local(a.stage - 1)) {
      x = outputs.at({a.stage - 1, a.microbatch}).detach();
      if (program.forward_only) {
        outputs.erase({a.stage - 1, a.microbatch});
      }
    } else {
      x = take(received, key, a, "received activation");
    }
    const bool training = !program.forward_only;
    if (training && a.stage > 0 && x.is_floating_point()) {
      x = x.detach().requires_grad_(true);
    }
    at::Tensor out;
    {
      std::unique_ptr<RecordWeightGrads> record;
      if (program.split_backward) {
        auto& queue = queues[key];
        queue = std::make_unique<WeightGradQueue>();
        record = std::make_unique<RecordWeightGrads>(*queue);
      }
      out = stages.at(a.stage).forward(x);
    }
    if (a.stage == last_stage()) {
      if (!training) {
        result.outputs[static_cast<std::size_t>(a.microbatch)] = out;
        return;
      }
      if (!loss) {
        throw std::invalid_argument("d9d::pipeline::Executor: training needs a loss function");
      }
      auto value = loss(out, a.microbatch);
      if (value.numel() != 1) {
        throw std::invalid_argument("d9d::pipeline::Executor: the loss of microbatch " +
                                    std::to_string(a.microbatch) + " is not a scalar but " +
                                    describe(value));
      }
      result.losses[static_cast<std::size_t>(a.microbatch)] = value.detach();
      out = value;
    }
    if (training) {
      inputs[key] = x;
    }
    outputs[key] = out;
  }

  // A backward's tensors, taken from the step's maps on the executor's thread, so that the
  // autograd call itself may run on another (a pair's helper).
  struct BackwardWork {
    at::Tensor out;
    at::Tensor x;
    at::Tensor grad;                   // undefined on the last stage (out is the loss)
    WeightGradQueue* queue = nullptr;  // when the weight part is deferred (I)
  };

  BackwardWork take_backward(const Action& a) {
    const Key key{a.stage, a.microbatch};
    BackwardWork work;
    work.out = take(outputs, key, a, "forward output");
    work.x = take(inputs, key, a, "forward input");
    if (a.stage < last_stage()) {
      work.grad = local(a.stage + 1) ? take(grad_input, {a.stage + 1, a.microbatch}, a,
                                            "input gradient of the next stage")
                                     : take(grad_output, key, a, "received gradient");
    }
    if (a.op == Op::backward_input) {
      work.queue = queues.at(key).get();
    }
    return work;
  }

  static void run_backward(const BackwardWork& work) {
    if (!work.out.requires_grad()) {
      return;
    }
    std::unique_ptr<DeferWeightGrads> deferred;
    if (work.queue != nullptr) {
      deferred = std::make_unique<DeferWeightGrads>(*work.queue);
    }
    if (work.grad.defined()) {
      torch::autograd::backward({work.out}, {work.grad});
    } else {
      torch::autograd::backward({work.out});
    }
  }

  void store_backward(const Action& a, const BackwardWork& work) {
    if (a.stage > 0) {
      const auto& g = work.x.grad();
      grad_input[{a.stage, a.microbatch}] = g.defined() ? g : at::zeros_like(work.x);
    }
  }

  void backward(const Action& a) {
    const auto work = take_backward(a);
    run_backward(work);
    store_backward(a, work);
  }

  // A pair (d9d/pipeline/pairs.hpp): the backward `b` on a helper thread, with this thread's
  // autograd state and (CUDA) current stream, while this thread runs the forward `f`. The maps are
  // touched on this thread only; the two share no tensor they write.
  void pair(const Action& f, const Action& b, const std::vector<at::Tensor>& step_inputs,
            const LossFn& loss) {
    const auto work = take_backward(b);
    const at::ThreadLocalState state;
    std::optional<c10::Stream> stream;
    if (work.out.device().is_cuda()) {
      stream = c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(work.out.device());
    }
    std::exception_ptr failed;
    std::thread helper([&] {
      try {
        const at::ThreadLocalStateGuard thread_state(state);
        const c10::OptionalStreamGuard on(stream);
        RECORD_USER_SCOPE("d9d::pipeline::" + to_string(b));
        run_backward(work);
      } catch (...) {
        failed = std::current_exception();
      }
    });
    try {
      RECORD_USER_SCOPE("d9d::pipeline::" + to_string(f));
      forward(f, step_inputs, loss);
    } catch (...) {
      helper.join();
      throw;
    }
    helper.join();
    if (failed) {
      std::rethrow_exception(failed);
    }
    store_backward(b, work);
  }

  void weight(const Action& a) {
    const auto it = queues.find({a.stage, a.microbatch});
    if (it == queues.end()) {
      throw std::logic_error("d9d::pipeline::Executor: W without its F" + where(a));
    }
    it->second->drain();
    queues.erase(it);
  }

  void send(const Action& a) {
    const Key key{a.stage, a.microbatch};
    const bool gradient = a.op == Op::send_gradient;
    at::Tensor t;
    if (gradient) {
      t = take(grad_input, key, a, "input gradient to send");
    } else {
      t = outputs.at(key).detach();
      if (program.forward_only) {
        outputs.erase(key);
      }
      const auto spec = activation(a.stage + 1);
      if (t.sizes() != at::IntArrayRef(spec.sizes) || t.scalar_type() != spec.dtype) {
        throw std::invalid_argument("d9d::pipeline::Executor: stage " + std::to_string(a.stage) +
                                    " produced " + describe(t) + " but stage " +
                                    std::to_string(a.stage + 1) +
                                    " expects the activation spec's sizes and dtype" + where(a));
      }
    }
    enqueue({.kind = P2POp::Kind::send,
             .tensor = t.contiguous(),
             .peer = a.peer,
             .tag = tag(gradient, gradient ? a.stage - 1 : a.stage + 1, a.microbatch)});
  }

  void receive(const Action& a) {
    const Key key{a.stage, a.microbatch};
    const bool gradient = a.op == Op::recv_gradient;
    at::Tensor buffer;
    if (gradient) {
      const auto& out = outputs.at(key);
      buffer = at::empty(out.sizes(), out.options().device(group.device()));
      grad_output[key] = buffer;
    } else {
      const auto spec = activation(a.stage);
      buffer = at::empty(spec.sizes, at::TensorOptions().dtype(spec.dtype).device(group.device()));
      received[key] = buffer;
    }
    // The index the batch holding this receive gets when posted.
    (gradient ? gradient_batch : activation_batch)[key] =
        enqueue({.kind = P2POp::Kind::recv,
                 .tensor = buffer,
                 .peer = a.peer,
                 .tag = tag(gradient, a.stage, a.microbatch)});
  }

  [[nodiscard]] c10::Device timing_device(const std::vector<at::Tensor>& step_inputs) const {
    if (group.valid()) {
      return group.device();
    }
    for (const auto& t : step_inputs) {
      if (t.defined()) {
        return t.device();
      }
    }
    return at::kCPU;
  }

  // One compute action, or a pair, with what surrounds it: its received inputs waited for, the
  // hooks and the timeline before and after.
  void compute(const std::vector<Action>& running, const std::vector<at::Tensor>& step_inputs,
               const LossFn& loss) {
    for (const auto& r : running) {
      await_inputs(r);
    }
    for (const auto& r : running) {
      if (hook) {
        hook(r, false);
      }
    }
    if (recorded) {
      recorder.mark(running, false);
    }
    if (running.size() == 2) {
      pair(running[0], running[1], step_inputs, loss);
    } else {
      const Action& a = running.front();
      // A profiler's trace names each compute action (built only while one runs).
      RECORD_USER_SCOPE("d9d::pipeline::" + to_string(a));
      switch (a.op) {
        case Op::forward:
          forward(a, step_inputs, loss);
          break;
        case Op::backward:
        case Op::backward_input:
          backward(a);
          break;
        case Op::backward_weight:
          weight(a);
          break;
        default:
          break;
      }
    }
    if (recorded) {
      recorder.mark(running, true);
    }
    for (const auto& r : running) {
      if (hook) {
        hook(r, true);
      }
    }
  }

  StepResult run(const std::vector<at::Tensor>& step_inputs, const LossFn& loss) {
    clear_step();
    result = {};
    recorded = options.record_timeline;
    if (recorded) {
      recorder.begin(timing_device(step_inputs));
    }
    const auto m = static_cast<std::size_t>(program.microbatches);
    if (local(last_stage())) {
      (program.forward_only ? result.outputs : result.losses).resize(m);
    }
    std::unique_ptr<at::NoGradGuard> no_grad;
    if (program.forward_only) {
      no_grad = std::make_unique<at::NoGradGuard>();
    }
    try {
      const auto& actions = program.ranks[static_cast<std::size_t>(rank)];
      for (std::size_t i = 0; i < actions.size(); ++i) {
        const Action& a = actions[i];
        if (trace) {
          std::fprintf(stderr, "[d9d pipeline rank %d] %s\n", rank, to_string(a).c_str());
        }
        switch (a.op) {
          case Op::send_activation:
          case Op::send_gradient:
            send(a);
            continue;
          case Op::recv_activation:
          case Op::recv_gradient:
            receive(a);
            continue;
          default:
            break;
        }
        post();
        // This action alone, or with the next one as a pair.
        std::vector<Action> running{a};
        if (options.overlap_pairs && pair_at(actions, i)) {
          running.push_back(actions[++i]);
          if (trace) {
            std::fprintf(stderr, "[d9d pipeline rank %d] %s (with the previous)\n", rank,
                         to_string(running[1]).c_str());
          }
        }
        compute(running, step_inputs, loss);
      }
      post();
      wait_all();
    } catch (...) {
      clear_step();
      throw;
    }
    clear_step();
    return std::move(result);
  }
};

namespace {

// Each pair's receives before it and its forward's sends after it (d9d/pipeline/pairs.hpp): a new
// posting order, verified again.
Program regrouped_for_pairs(Program program) {
  program = group_pairs(std::move(program));
  const auto verdict = verify(program);
  if (!verdict.ok()) {
    throw std::invalid_argument(
        std::string("d9d::pipeline::Executor: overlap_pairs regroups the program's sends and "
                    "receives around its pairs, and the result breaks rule ") +
        to_string(verdict.rule) + " on rank " + std::to_string(verdict.rank) + " at action " +
        to_string(verdict.action) + ". Fix: run this schedule without overlap_pairs");
  }
  return program;
}

// NCCL creates a group's communicator, and the connections between two ranks, on first use, and
// both sides must set them up with the same calls: a barrier opens the communicator, then one
// symmetric batch (a send to and a receive from every peer of this rank's program, under a tag
// the steps do not use) opens the connections in both directions before the program's first,
// asymmetric, batch.
void open_connections(const ProcessGroup& group, const std::vector<Action>& actions,
                      int hello_tag) {
  group.barrier();
  std::vector<int> peers;
  for (const auto& a : actions) {
    if (!a.is_compute() && std::find(peers.begin(), peers.end(), a.peer) == peers.end()) {
      peers.push_back(a.peer);
    }
  }
  std::sort(peers.begin(), peers.end());
  std::vector<P2POp> hello;
  const auto options = at::TensorOptions().dtype(at::kFloat).device(group.device());
  for (const int peer : peers) {
    hello.push_back({.kind = P2POp::Kind::send,
                     .tensor = at::zeros({1}, options),
                     .peer = peer,
                     .tag = hello_tag});
    hello.push_back({.kind = P2POp::Kind::recv,
                     .tensor = at::empty({1}, options),
                     .peer = peer,
                     .tag = hello_tag});
  }
  if (!hello.empty()) {
    batch_isend_irecv(group, hello).wait();
  }
}

}  // namespace

Executor::Executor(Program program, ProcessGroup group, std::vector<Stage> stages,
                   std::function<TensorSpec(int stage)> activation, ExecutorOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& impl = *impl_;
  impl.options = options;
  impl.rank = group.valid() ? group.rank() : 0;
  if (group.valid() && group.size() != program.pp) {
    throw std::invalid_argument("d9d::pipeline::Executor: the program is for " +
                                std::to_string(program.pp) + " ranks, the group has " +
                                std::to_string(group.size()));
  }
  if (!group.valid() && program.pp != 1) {
    throw std::invalid_argument(
        "d9d::pipeline::Executor: a program for several ranks needs the pipeline process group");
  }
  const auto expected =
      rank_stages(program.placement, program.pp, program.stages_per_rank, impl.rank);
  for (auto& stage : stages) {
    if (!stage.forward) {
      throw std::invalid_argument("d9d::pipeline::Executor: stage " + std::to_string(stage.index) +
                                  " has no forward");
    }
    const int index = stage.index;
    if (!impl.stages.emplace(index, std::move(stage)).second) {
      throw std::invalid_argument("d9d::pipeline::Executor: stage " + std::to_string(index) +
                                  " given twice");
    }
  }
  std::vector<int> given;
  for (const auto& [index, stage] : impl.stages) {
    given.push_back(index);
  }
  if (given != expected) {
    std::string want;
    for (const int s : expected) {
      want += (want.empty() ? "" : ", ") + std::to_string(s);
    }
    throw std::invalid_argument("d9d::pipeline::Executor: rank " + std::to_string(impl.rank) +
                                " must get exactly its stages {" + want + "} of the program");
  }
  if (!activation && program.pp > 1) {
    throw std::invalid_argument(
        "d9d::pipeline::Executor: several ranks need the activation spec of each stage");
  }
  if (options.overlap_pairs) {
    program = regrouped_for_pairs(std::move(program));
  }
  impl.program = std::move(program);
  impl.group = std::move(group);
  if (impl.group.valid() && impl.group.size() > 1) {
    open_connections(impl.group, impl.program.ranks[static_cast<std::size_t>(impl.rank)],
                     2 * impl.program.stages() * impl.program.microbatches);
  }
  impl.activation = std::move(activation);
}

Executor::Executor(Executor&&) noexcept = default;
Executor& Executor::operator=(Executor&&) noexcept = default;
Executor::~Executor() = default;

StepResult Executor::run(const std::vector<at::Tensor>& inputs, const LossFn& loss) {
  return impl_->run(inputs, loss);
}

void Executor::on_compute(std::function<void(const Action&, bool)> hook) {
  impl_->hook = std::move(hook);
}

void Executor::record_timeline(bool on) { impl_->options.record_timeline = on; }

std::vector<Timeline::Slot> Executor::timeline() const {
  return impl_->recorded ? impl_->recorder.slots() : std::vector<Timeline::Slot>{};
}

const ExecutorOptions& Executor::options() const { return impl_->options; }

const Program& Executor::program() const { return impl_->program; }

int Executor::rank() const { return impl_->rank; }

namespace {

// One slot per line: op stage microbatch start end (text, so no byte order is involved).
std::string encode(const std::vector<Timeline::Slot>& slots) {
  std::ostringstream out;
  out.precision(17);
  for (const auto& slot : slots) {
    out << static_cast<int>(slot.action.op) << ' ' << slot.action.stage << ' '
        << slot.action.microbatch << ' ' << slot.start << ' ' << slot.end << '\n';
  }
  return out.str();
}

std::vector<Timeline::Slot> decode(const std::string& bytes) {
  std::istringstream in(bytes);
  std::vector<Timeline::Slot> out;
  int op = 0;
  Timeline::Slot slot;
  while (in >> op >> slot.action.stage >> slot.action.microbatch >> slot.start >> slot.end) {
    slot.action.op = static_cast<Op>(op);
    slot.action.peer = -1;
    out.push_back(slot);
  }
  return out;
}

}  // namespace

Timeline gather_timeline(const ProcessGroup& group, const std::vector<Timeline::Slot>& mine) {
  Timeline out;
  if (!group.valid() || group.size() == 1) {
    out.ranks.push_back(mine);
  } else {
    for (const auto& bytes : all_gather_bytes(group, encode(mine))) {
      out.ranks.push_back(decode(bytes));
    }
  }
  for (const auto& rank : out.ranks) {
    for (const auto& slot : rank) {
      out.makespan = std::max(out.makespan, slot.end);
    }
  }
  return out;
}

}  // namespace d9d::pipeline
