// d9d/core/watchdog.cpp — heartbeats, failure records and verdicts through the store (see the
// header and distributed_context.hpp for the contract).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sstream>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <d9d/core/detail/watchdog.hpp>
#include <d9d/core/distributed_context.hpp>

namespace d9d::detail {
namespace {

// Added to a rank's heartbeat count when its context closes: "done", not silent.
constexpr int64_t kDone = int64_t{1} << 40;
constexpr std::size_t kMaxRecordText = 4000;

std::string sanitize(std::string_view text) {
  std::string out(text.substr(0, kMaxRecordText));
  std::replace(out.begin(), out.end(), '\n', ' ');
  std::replace(out.begin(), out.end(), '\t', ' ');
  return out;
}

std::string seconds_text(std::chrono::milliseconds ms) {
  std::ostringstream out;
  out.precision(1);
  out << std::fixed << static_cast<double>(ms.count()) / 1000.0 << " s";
  return out.str();
}

// Live watchdogs, for the terminate handler.
struct Registry {
  std::timed_mutex mutex;
  std::set<Watchdog*> live;
  std::terminate_handler previous = nullptr;
  bool installed = false;
};

Registry& registry() {
  static auto* instance = new Registry;  // NOLINT(cppcoreguidelines-owning-memory): never freed,
  return *instance;                      // so the handler works during static destruction too
}

// An uncaught exception (or std::terminate) on a rank: report it to the others, then go on
// terminating as before.
[[noreturn]] void on_terminate() {
  std::string what = "the process terminated (std::terminate)";
  if (const auto error = std::current_exception()) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      what = std::string("uncaught exception: ") + e.what();
    } catch (...) {
      what = "uncaught non-standard exception";
    }
  }
  auto& r = registry();
  std::vector<Watchdog*> live;
  if (r.mutex.try_lock_for(std::chrono::seconds(1))) {
    live.assign(r.live.begin(), r.live.end());
    r.mutex.unlock();
  }
  for (auto* dog : live) {
    (void)dog->report(what);
  }
  if (r.previous != nullptr) {
    r.previous();
  }
  std::abort();
}

}  // namespace

std::vector<FailureRecord> parse_failure_log(std::string_view log) {
  std::vector<FailureRecord> out;
  std::size_t start = 0;
  while (start < log.size()) {
    const auto end = std::min(log.find('\n', start), log.size());
    const auto line = log.substr(start, end - start);
    start = end + 1;
    std::vector<std::string_view> fields;
    std::size_t from = 0;
    for (int i = 0; i < 3; ++i) {
      const auto tab = line.find('\t', from);
      if (tab == std::string_view::npos) {
        break;
      }
      fields.push_back(line.substr(from, tab - from));
      from = tab + 1;
    }
    if (fields.size() != 3) {
      continue;
    }
    FailureRecord record;
    try {
      record.subject = std::stoi(std::string(fields[0]));
      record.by = std::stoi(std::string(fields[2]));
    } catch (const std::exception&) {
      continue;
    }
    record.kind = std::string(fields[1]);
    record.text = std::string(line.substr(from));
    out.push_back(std::move(record));
  }
  return out;
}

const FailureRecord* verdict_record(const std::vector<FailureRecord>& records) {
  for (const char* kind : {"vanished", "error"}) {
    for (const auto& r : records) {
      if (r.kind == kind) {
        return &r;
      }
    }
  }
  return records.empty() ? nullptr : &records.front();
}

namespace {

// A record as the verdict names it ("rank 2 failed: ...", "rank 2 stopped heartbeating ...").
std::string describe(const FailureRecord& r) {
  return "rank " + std::to_string(r.subject) + (r.kind == "error" ? " failed: " : " ") + r.text;
}

}  // namespace

std::string failure_verdict(const std::vector<FailureRecord>& records) {
  const auto* r = verdict_record(records);
  return r == nullptr ? "" : describe(*r);
}

Watchdog::Watchdog(const c10::intrusive_ptr<c10d::Store>& store, WatchdogOptions options)
    : options_(std::move(options)), timeout_ms_(options_.timeout.count()) {
  auto own = store->clone();
  own->setTimeout(std::max(options_.timeout, std::chrono::milliseconds(std::chrono::seconds(1))));
  store_ = c10::make_intrusive<c10d::PrefixStore>(options_.prefix + "watchdog/", own);
  beat();  // alive before any group rendezvous, so a rank dying there is found dead
  {
    auto& r = registry();
    const std::lock_guard<std::timed_mutex> lock(r.mutex);
    r.live.insert(this);
    if (!r.installed) {
      r.previous = std::set_terminate(on_terminate);
      r.installed = true;
    }
  }
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  close(/*by_exception=*/false);
  auto& r = registry();
  const std::lock_guard<std::timed_mutex> lock(r.mutex);
  r.live.erase(this);
}

std::chrono::milliseconds Watchdog::timeout() const {
  return std::chrono::milliseconds(timeout_ms_.load());
}

void Watchdog::set_timeout(std::chrono::milliseconds timeout) { timeout_ms_ = timeout.count(); }

// A tenth of the timeout, between 10 ms and 1 s: a dead rank is found within the timeout plus an
// interval, and a live one costs at most three store calls per interval.
std::chrono::milliseconds Watchdog::interval() const {
  return std::clamp(timeout() / 10, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
}

std::string Watchdog::key(std::string_view name) const { return std::string(name); }

std::string Watchdog::read_log() {
  const auto bytes = store_->get(key("failure_log"));
  return {bytes.begin(), bytes.end()};
}

std::string Watchdog::heartbeat_key(int r) const { return "hb/" + std::to_string(r); }

void Watchdog::beat() { (void)store_->add(heartbeat_key(options_.rank), 1); }

bool Watchdog::pause(std::chrono::milliseconds duration) {
  std::unique_lock<std::mutex> lock(mutex_);
  wake_.wait_for(lock, duration, [this] { return stop_ || woken_; });
  woken_ = false;
  return !stop_;
}

void Watchdog::publish(int subject, std::string_view kind, std::string_view text) {
  const std::string line = std::to_string(subject) + "\t" + std::string(kind) + "\t" +
                           std::to_string(options_.rank) + "\t" + sanitize(text) + "\n";
  store_->append(key("failure_log"), std::vector<uint8_t>(line.begin(), line.end()));
  (void)store_->add(key("failures"), 1);  // after the record: a count > 0 means the log exists
}

bool Watchdog::silent(int r) {
  const int64_t value = store_->add(heartbeat_key(r), 0);
  if (value >= kDone) {
    done_.insert(r);
    return false;
  }
  const auto now = Clock::now();
  auto [it, inserted] = seen_.try_emplace(r, Seen{.value = value, .changed = now});
  if (!inserted && it->second.value != value) {
    it->second = {.value = value, .changed = now};
  }
  // A rank that never beat has not started yet: waiting for it is the init timeout's business.
  return value > 0 && now - it->second.changed > timeout();
}

bool Watchdog::watch_peers() {
  if (store_->add(key("failures"), 0) > 0) {
    return false;
  }
  const int world = options_.world;
  std::vector<int> targets;
  // The next rank that has not closed: every rank is watched by the one before it.
  for (int step = 1; step < world; ++step) {
    const int r = (options_.rank + step) % world;
    if (done_.count(r) == 0) {
      targets.push_back(r);
      break;
    }
  }
  // Rank 0's process serves the store: knowing it closed tells a lost store from a dead rank 0.
  if (options_.rank0_serves_store && options_.rank != 0 && done_.count(0) == 0 &&
      (targets.empty() || targets.front() != 0)) {
    targets.push_back(0);
  }
  for (const int r : targets) {
    if (silent(r)) {
      publish(r, "vanished",
              "stopped heartbeating (silent for over " + seconds_text(timeout()) +
                  ": killed, crashed, or exited without closing its DistributedContext)");
      return false;
    }
  }
  return true;
}

void Watchdog::run() {
  std::string lost;
  try {
    while (pause(interval())) {
      beat();
      if (!watch_peers()) {
        handle_failure();
        break;
      }
    }
  } catch (const c10::Error& error) {
    lost = error.what_without_backtrace();  // the store client's C++ frames help nobody here
  } catch (const std::exception& error) {
    lost = error.what();
  } catch (...) {  // nothing may escape this thread (std::terminate would wait for it)
    lost = "a non-standard exception";
  }
  if (!lost.empty()) {
    // The store is gone (or refuses us): nothing can be coordinated any more.
    const bool rank0_left = options_.rank0_serves_store && done_.count(0) != 0;
    bool stopping = false;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stopping = stop_ || verdict_.has_value();
    }
    if (!rank0_left && !stopping) {
      decide(
          "lost the store at " + options_.store_address + " (" + lost + ")" +
              (options_.rank0_serves_store ? "; rank 0, whose process serves it, has probably died"
                                           : ""),
          /*death=*/true);
    }
  }
  const std::lock_guard<std::mutex> lock(mutex_);
  stop_ = true;  // nothing watches any more: report() must not wait for this thread
  wake_.notify_all();
}

void Watchdog::handle_failure() {
  bool record_self = false;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    record_self = !reported_;
    reported_ = true;
  }
  if (record_self) {
    publish(options_.rank, "stopped", "stopped because another rank failed");
  }
  // Wait until every rank is accounted for (a record about it, or closed): the ranks still alive
  // add their "stopped" record within an interval; a dead one is found silent within the timeout.
  const auto start = Clock::now();
  std::vector<FailureRecord> records;
  while (true) {
    beat();  // still alive: nobody may take this rank for dead while it waits
    records = parse_failure_log(read_log());
    std::set<int> accounted(done_.begin(), done_.end());
    accounted.insert(options_.rank);
    for (const auto& record : records) {
      accounted.insert(record.subject);
    }
    for (int r = 0; r < options_.world; ++r) {
      if (accounted.count(r) == 0 && silent(r)) {
        publish(r, "vanished",
                "stopped heartbeating (silent for over " + seconds_text(timeout()) +
                    ": killed, crashed, or exited without closing its DistributedContext)");
        accounted.insert(r);
      } else if (done_.count(r) != 0) {
        accounted.insert(r);
      }
    }
    if (static_cast<int>(accounted.size()) >= options_.world ||
        Clock::now() - start > timeout() + 2 * interval()) {
      break;
    }
    if (!pause(interval())) {
      return;  // this rank's context closed normally: it ends on its own
    }
  }
  records = parse_failure_log(read_log());
  const auto* chosen = verdict_record(records);
  decide(chosen == nullptr ? std::string("a failure was reported") : describe(*chosen),
         chosen != nullptr && chosen->kind == "vanished");
}

// What the log shows first is the root cause. A rank whose own error is reported (its context
// destroyed by an exception, or report_failure) ends with that error right after this: the
// verdict, some rank's error (often the same configuration error, or this very one), is left out,
// unless it is a death, which may explain this rank's error. A rank with no error of its own yet
// waits up to three intervals before it logs the verdict: a failing rank prints its own error as
// soon as it has the verdict, and an exception of this rank's own (its context's destructor comes
// into report()) may be on its way. Then the process stops unless its own failure is being
// reported (it may be blocked in a collective that will never complete).
void Watchdog::decide(const std::string& verdict, bool death) {
  const auto grace = 3 * interval();
  std::unique_lock<std::mutex> lock(mutex_);
  verdict_ = verdict;
  wake_.notify_all();
  if (own_error_ && !death) {
    return;
  }
  wake_.wait_for(lock, grace, [this] { return waiting_ || stop_; });
  const bool returning = waiting_ || stop_;
  lock.unlock();
  if (options_.log_error) {
    options_.log_error("job failed: " + verdict);
  }
  if (returning) {
    return;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(kPeerFailureExitCode);
}

std::string Watchdog::report(std::string_view message) {
  bool publish_now = false;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (verdict_) {
      return *verdict_;
    }
    if (stop_) {
      return "";
    }
    publish_now = !reported_;
    own_error_ = publish_now;
    reported_ = true;
    waiting_ = true;
  }
  if (publish_now) {
    try {
      publish(options_.rank, "error", message);
    } catch (const std::exception& error) {
      if (options_.log_error) {
        options_.log_error(std::string("cannot report this rank's failure to the others: ") +
                           error.what());
      }
    }
  }
  const auto deadline = Clock::now() + timeout() + 5 * interval();
  std::unique_lock<std::mutex> lock(mutex_);
  woken_ = true;
  wake_.notify_all();
  wake_.wait_until(lock, deadline, [this] { return verdict_.has_value() || stop_; });
  return verdict_.value_or("");
}

void Watchdog::note(std::string_view message) {
  const std::lock_guard<std::mutex> lock(mutex_);
  note_ = std::string(message);
}

void Watchdog::close(bool by_exception) noexcept {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) {
      return;
    }
    closed_ = true;
  }
  try {
    if (by_exception) {
      std::string note;
      {
        const std::lock_guard<std::mutex> lock(mutex_);
        note = note_.empty() ? "its DistributedContext was destroyed by an exception (the rank's "
                               "log shows it)"
                             : note_;
      }
      (void)report(note);
      if (options_.rank == 0 && options_.rank0_serves_store) {
        // The store lives in this process, which is about to end with its own error. report()
        // returned with the verdict, which handle_failure reaches only once every rank is
        // accounted for (a record, closed, or found dead); the others read it within an
        // interval: keep the store two intervals more, so that they name this rank's failure
        // rather than a lost store.
        std::this_thread::sleep_for(2 * interval());
      }
    } else {
      (void)store_->add(heartbeat_key(options_.rank), kDone);
      (void)store_->add(key("closed"), 1);
      if (options_.rank == 0 && options_.rank0_serves_store) {
        // The store lives in this process: let the others finish with it (bounded).
        const auto deadline = Clock::now() + timeout();
        while (Clock::now() < deadline && store_->add(key("closed"), 0) < options_.world &&
               store_->add(key("failures"), 0) == 0) {
          std::this_thread::sleep_for(interval());
        }
      }
    }
  } catch (...) {  // NOLINT(bugprone-empty-catch): the store may be gone; closing goes on
  }
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    wake_.notify_all();
  }
  if (thread_.joinable()) {
    thread_.join();
  }
}

}  // namespace d9d::detail
