// d9d/core/detail/watchdog.hpp — heartbeats and failure reports through the store, so that a rank
// that dies or fails stops every other rank within a bounded time, with its rank named.
//
//   detail::Watchdog dog(store, {.rank = 1, .world = 4, .prefix = "d9d/ctx0-of-4/", ...});
//   dog.report("cannot read the batch");   // tell the others, wait for the verdict
//   dog.close(/*by_exception=*/false);     // this rank is done: nobody waits for it any more
//
// DistributedContext owns one per context of a world > 1 (see distributed_context.hpp for the
// contract). Keys, under `prefix` + "watchdog/": "hb/<r>" (rank r's heartbeat count; + kDone when
// it closed), "failures" (count of records), "failure_log" (records
// "<subject>\t<kind>\t<by>\t<text>" with kind error / vanished / stopped, appended in order),
// "closed" (count of closed ranks).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Store;
}  // namespace c10d

namespace d9d::detail {

/// What a Watchdog needs to know about its rank and job.
struct WatchdogOptions {
  int rank = 0;
  int world = 1;
  std::string prefix;  ///< the context's key prefix
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  /// Rank 0's process serves the store (no launcher agent): it must outlive the other ranks'
  /// use of it, and losing the store means rank 0 is gone.
  bool rank0_serves_store = false;
  std::string store_address;                          ///< "host:port", for messages
  std::function<void(const std::string&)> log_error;  ///< one line on this rank's log
};

/// One parsed record of the failure log.
struct FailureRecord {
  int subject = -1;  ///< the rank the record is about
  std::string kind;  ///< "error" (it failed), "vanished" (found dead), "stopped" (a consequence)
  int by = -1;       ///< the rank that wrote it
  std::string text;
};

/// Parses the failure log ("<subject>\t<kind>\t<by>\t<text>\n" lines; malformed lines skipped).
[[nodiscard]] std::vector<FailureRecord> parse_failure_log(std::string_view log);
/// The record a verdict names: the first vanished rank (a death explains the others' errors),
/// else the first error, else the first record; null when there is none.
[[nodiscard]] const FailureRecord* verdict_record(const std::vector<FailureRecord>& records);
/// The verdict on a failure log: verdict_record's, as text ("rank 2 stopped heartbeating ...");
/// "" when there is none.
[[nodiscard]] std::string failure_verdict(const std::vector<FailureRecord>& records);

class Watchdog {
 public:
  /// Connects its own client (a clone of `store`, so a blocked call elsewhere never delays a
  /// heartbeat), beats once and starts the thread.
  Watchdog(const c10::intrusive_ptr<c10d::Store>& store, WatchdogOptions options);
  ~Watchdog();  ///< close(false) when not closed yet
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  Watchdog(Watchdog&&) = delete;
  Watchdog& operator=(Watchdog&&) = delete;

  [[nodiscard]] std::chrono::milliseconds timeout() const;
  void set_timeout(std::chrono::milliseconds timeout);
  /// Publishes this rank's failure (first call only) and waits for the verdict (bounded).
  std::string report(std::string_view message);
  void note(std::string_view message);
  /// This rank's context goes away: by an exception (reports the noted message and waits for the
  /// verdict), else marks the rank done (rank 0 serving the store first waits, at most the
  /// timeout, until every rank closed). Stops the thread. Never throws.
  void close(bool by_exception) noexcept;

 private:
  using Clock = std::chrono::steady_clock;
  struct Seen {
    int64_t value = -1;
    Clock::time_point changed;
  };

  [[nodiscard]] std::chrono::milliseconds interval() const;
  void run();
  void beat();
  /// The steady-state check: false when a failure is known (then handle_failure runs).
  bool watch_peers();
  /// Reads rank r's heartbeat; true when it is dead (silent for the timeout after starting).
  bool silent(int r);
  void publish(int subject, std::string_view kind, std::string_view text);
  void handle_failure();
  /// Ends the job on `verdict`: logs it (unless this rank's own error says more: see the
  /// definition) and stops the process unless its own failure is being reported. `death`: the
  /// verdict is a rank found dead (or the store lost), news even to a rank with an error of its
  /// own.
  void decide(const std::string& verdict, bool death);
  /// Sleeps `duration` unless stopped or woken; false when stopped.
  bool pause(std::chrono::milliseconds duration);
  [[nodiscard]] std::string key(std::string_view name) const;
  [[nodiscard]] std::string read_log();
  [[nodiscard]] std::string heartbeat_key(int r) const;

  WatchdogOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::thread thread_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  bool closed_ = false;
  bool reported_ = false;   ///< this rank's record is in the log
  bool waiting_ = false;    ///< the caller of report() waits for the verdict
  bool own_error_ = false;  ///< this rank's record is an error of its own (report())
  bool woken_ = false;
  std::optional<std::string> verdict_;
  std::string note_;
  std::atomic<int64_t> timeout_ms_{0};

  // The watchdog thread's own state.
  int64_t beats_ = 0;
  std::map<int, Seen> seen_;
  std::set<int> done_;
};

}  // namespace d9d::detail
