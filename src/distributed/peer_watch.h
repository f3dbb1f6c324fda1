// Private: ranks that no launcher of fulgur's supervises (processes made by
// srun, mpirun over Gloo, torchrun, or started by hand on each machine)
// watch each other through the group's store, so that what fulgur's
// supervisor names for its own ranks is named here too, and a wait that can
// never end ends long before the process group's timeout:
//
//  - A rank that fails says so in the store (its error's first line). A
//    peer waiting in a collective for it ends after the stop grace, naming
//    it; a peer whose collective fails because the rank left (a closed
//    connection) names it as the cause.
//  - A desync: every rank waits in a collective, not all in the same one,
//    none moving, for `desync_after`. No collective can complete then, so
//    every rank ends naming where each waits.
//
// Nothing touches the store while no collective has waited a whole
// `period`: a healthy step costs nothing. A rank that waits longer writes
// its wait once a period (a counter that shows its watch still runs, the
// collective's kind and call number); rank 0's watch, beside the store,
// reads everyone's and writes the desync verdict the others read.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "distributed/launchers/heartbeat.h"

namespace c10d {
class Store;
}

namespace fulgur::detail {

/// One rank's report of its wait, as its watch writes it.
struct WaitReport {
  /// Advances every period while the rank's watch runs: a rank frozen
  /// (SIGSTOP, a debugger) stops it.
  int64_t beat = 0;
  /// The collective it waits in ("all_reduce"); empty: it waits in none.
  std::string kind;
  int64_t seq = 0;
  int64_t bytes = 0;
};

/// "<beat> <kind> <seq> <bytes>" ("<beat> -" outside a collective), and back.
std::string encode(const WaitReport& report);
std::optional<WaitReport> decode_wait(const std::string& text);

/// Rank 0's judgement of a desync from every rank's reports.
class DesyncJudge {
 public:
  using Clock = std::chrono::steady_clock;
  /// `after`: how long every rank's wait must stay as it is; `alive`: how
  /// recent a rank's last new beat must be.
  DesyncJudge(int world, std::chrono::milliseconds after, std::chrono::milliseconds alive);
  /// Rank `rank`'s report as read at `now` (nullopt: it wrote none).
  void observe(int rank, const std::optional<WaitReport>& report, Clock::time_point now);
  /// The message when every rank has waited `after` in a collective that it
  /// has not left, its watch alive, and not every rank in the same one.
  std::optional<std::string> verdict(Clock::time_point now) const;

 private:
  struct Seen {
    std::optional<WaitReport> report;
    Clock::time_point same_since{}, beat_at{};
  };
  std::vector<Seen> seen_;
  std::chrono::milliseconds after_, alive_;
};

struct PeerWatchOptions {
  int rank = 0;
  int world = 1;
  /// How long a rank waiting in a collective has, once a peer's failure is
  /// known, before its watch ends it (ParallelOptions::stop_grace, what
  /// fulgur's launcher gives a rank it stops).
  std::chrono::milliseconds stop_grace = std::chrono::seconds(5);
  /// How long every rank waits, unmoving, in different collectives before
  /// each is ended as a desync.
  std::chrono::milliseconds desync_after = std::chrono::seconds(60);
  /// How often the watch looks; a collective waits this long before it is
  /// reported.
  std::chrono::milliseconds period = std::chrono::seconds(1);
};

/// The watch of one rank of one group: a thread, and the group's calls
/// into it. `store` is a client of the group's store of its own (bounded
/// requests); `end` ends the process with a message (tests pass another).
class PeerWatch {
 public:
  using Clock = std::chrono::steady_clock;
  using End = std::function<void(const std::string& message)>;
  PeerWatch(c10::intrusive_ptr<c10d::Store> store, PeerWatchOptions options, End end = {});
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  /// The group's main thread waits in `call` until leave().
  void enter(const CollectiveCall& call);
  void leave();
  /// This rank failed (`peer_lost`: a collective failed because a peer left
  /// or stopped answering): its peers learn it. The first call wins; after
  /// it the watch ends nothing (this rank ends by its own failure).
  void publish_failure(bool peer_lost, const CollectiveCall* call, const std::string& what);
  /// What the store knows of a peer that failed on its own, for the message
  /// of a collective that lost it: "rank 1 failed first: <its error>"; that
  /// the store (rank 0's) no longer answers; or empty (no rank said so).
  std::string known_failure();

 private:
  struct Waiting {
    bool active = false;
    CollectiveCall call;
    Clock::time_point since{};
  };
  struct Failure {
    int rank = -1;
    FailureRecord record;
  };
  void loop();
  void look(const Waiting& waiting, Clock::time_point now);
  void read_failures();
  std::optional<Failure> first_failure() const;
  std::string key(const std::string& name) const;
  void finish(const std::string& message);

  c10::intrusive_ptr<c10d::Store> store_;
  PeerWatchOptions options_;
  End end_;
  DesyncJudge judge_;

  std::mutex mutex_;  // waiting_, stop_, failed_here_
  std::condition_variable wake_;
  Waiting waiting_;
  bool stop_ = false;
  bool failed_here_ = false;

  std::mutex store_mutex_;  // the store's connection, and what is read from it
  int64_t failures_read_ = 0;
  std::vector<Failure> failures_;
  std::optional<Clock::time_point> failure_seen_;
  int64_t beat_ = 0;
  bool reported_waiting_ = false;
  bool ended_ = false;

  std::thread thread_;
};

}  // namespace fulgur::detail
