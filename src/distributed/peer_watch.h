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
//  - A desync: every rank waits in its collective of one call number, not
//    all of one kind and size, none moving, for `desync_after`. The first
//    call where the ranks' programs differ has one number on every rank (the
//    group numbers its calls), so none of them can complete: every rank ends
//    naming where each waits. Ranks stuck at different numbers are a stalled
//    transfer, not a desync: the timeout names that.
//
// A wait is seen where the main thread blocks in a collective: Gloo's, MPI's
// (NCCL's calls return at once; their waits are on the GPU).
//
// Nothing touches the store while no collective has waited a whole
// `period`: a healthy step costs nothing. A rank that waits longer writes
// its wait once a period (a counter that shows its watch still runs, the
// collective's kind, call number and size); rank 0's watch, beside the
// store, reads everyone's and writes the desync verdict the others read.
// What ranks said of their failures holds for a stage (a fit, a test): a
// rank that starts another one has recovered.
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
  /// The message when every rank has waited `after` in a collective of the
  /// same call number that it has not left, its watch alive, and not every
  /// rank's of one kind and size.
  std::optional<std::string> verdict(Clock::time_point now) const;
  void forget();

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
  /// each is ended as a desync (at least 5 periods).
  std::chrono::milliseconds desync_after = std::chrono::seconds(60);
  /// How often the watch looks; a collective waits this long before it is
  /// reported.
  std::chrono::milliseconds period = std::chrono::seconds(1);
  /// Who holds the store, for messages: "rank 0", "torchrun's agent".
  std::string store_holder = "rank 0";
  /// Whether this process holds the store (rank 0 with fulgur's own): on a
  /// failure it keeps it up a moment for the peers still to read.
  bool holds_store = false;
  /// Which of the process's groups (the same number on every rank of a
  /// program): the n-th group's keys never meet an earlier one's in a store
  /// that outlives it (torchrun's agent's).
  int64_t group = 0;
};

/// The watch of one rank of one group: a thread, and the group's calls
/// into it. `connect` makes a client of the group's store of its own
/// (bounded requests), again after a failed request; `end` ends the process
/// with a message (tests pass another).
class PeerWatch {
 public:
  using Clock = std::chrono::steady_clock;
  using Connect = std::function<c10::intrusive_ptr<c10d::Store>()>;
  using End = std::function<void(const std::string& message)>;
  /// `store`: the first connection (connect() made it).
  PeerWatch(c10::intrusive_ptr<c10d::Store> store, Connect connect, PeerWatchOptions options,
            End end = {});
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  /// The group's main thread waits in `call` until leave().
  void enter(const CollectiveCall& call);
  void leave();
  /// This rank failed (`peer_lost`: a collective failed because a peer left
  /// or stopped answering): its peers learn it. The first call of a stage
  /// wins; after it the watch ends nothing (this rank ends by its own
  /// failure, or recovers and starts another stage).
  void publish_failure(bool peer_lost, const CollectiveCall* call, const std::string& what);
  /// A stage starts here (the same number on every rank): this rank's own
  /// failure is behind it, and its peers stop counting it.
  void new_stage();
  /// What the store knows of a peer that failed on its own, for the message
  /// of a collective that lost it: "rank 1 failed first: <its error>"; that
  /// the store does not answer (naming who holds it); or empty (no rank
  /// said it failed).
  std::string known_failure();

 private:
  struct Waiting {
    bool active = false;
    uint64_t id = 0;  // which wait (each enter() a new one)
    CollectiveCall call;
    Clock::time_point since{};
  };
  struct Failure {
    int rank = -1;
    FailureRecord record;
  };
  void loop();
  void look(const Waiting& waiting, Clock::time_point now, std::unique_lock<std::mutex>& store);
  bool still_waiting(const Waiting& waiting);
  bool usable_store(Clock::time_point now);
  void lost_store();
  void read_failures();
  void keep_store_for_peers();
  std::optional<Failure> first_failure() const;
  std::string key(const std::string& name) const;
  std::string failure_text(const Failure& failure) const;
  void finish(const std::string& message);

  PeerWatchOptions options_;
  Connect connect_;
  End end_;
  const std::string prefix_;  // this group's keys

  std::mutex mutex_;  // waiting_, stop_, failed_here_, stage_
  std::condition_variable wake_;
  Waiting waiting_;
  uint64_t waits_ = 0;
  bool stop_ = false;
  bool failed_here_ = false;
  int64_t stage_ = 0;

  // The store's connection and what was read from it. Held for bounded
  // requests only (3 s each), never across a sleep.
  std::mutex store_mutex_;
  c10::intrusive_ptr<c10d::Store> store_;
  Clock::time_point reconnect_at_{};
  int64_t changes_read_ = -1;
  std::vector<Failure> failures_;
  std::optional<Clock::time_point> failure_seen_;
  DesyncJudge judge_;
  int64_t beat_ = 0;
  bool reported_waiting_ = false;
  bool ended_ = false;

  std::thread thread_;
};

}  // namespace fulgur::detail
