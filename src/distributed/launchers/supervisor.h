// Process supervision shared by the launchers: the launching process is the
// parent of every local rank. It forwards each rank's output, keeps the last
// lines each printed, reaps every child, and when one fails (non-zero exit,
// signal) stops the others — SIGTERM, then SIGKILL after a grace period —
// and reports one message naming the rank, its pid, how it died and what it
// printed last. Children get PR_SET_PDEATHSIG so they never outlive it.
//
// It also reads each rank's heartbeats (heartbeat.h): a rank whose pulses
// stop for `heartbeat_timeout` is frozen; one that sleeps outside any
// collective, using no CPU, while a peer waits for it in one is hung; and
// every failure report ends with what each rank was doing (the collective
// it waited in, by name and sequence number, so a desync shows as such).
// A rank that fails sends a failure record on the same pipe (a collective
// that lost a peer, or an error of its own): when ranks fail together, the
// cause named is a rank killed by a signal, else the first that failed on
// its own, else one that fell behind the victims.
//
// SIGINT / SIGTERM to the supervising process stop every rank, print which
// (by pid), and end the process by the same signal: its exit status is
// 128 + the signal, as shells and schedulers expect.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fulgur/core/errors.h"
#include "fulgur/distributed/launchers/subprocess_script.h"
#include "distributed/launchers/heartbeat.h"

namespace fulgur::detail {

/// A rank failed (died, froze, hung): `cause` is the one-line summary (for a
/// restart's message), what() the whole report.
class RankFailure : public DistributedError {
 public:
  RankFailure(std::string cause, const std::string& report, bool final = false)
      : DistributedError(report), cause_(std::move(cause)), final_(final) {}
  const std::string& cause() const { return cause_; }
  /// A restart cannot help (a lost node that did not come back).
  bool final() const { return final_; }

 private:
  std::string cause_;
  bool final_;
};

class NodeWatch;
struct NodeLoss;

class Supervisor {
 public:
  /// `supervision`: the stop grace (SIGTERM to SIGKILL), the hang timeout
  /// and the heartbeat timeout, as Supervision documents them.
  explicit Supervisor(const Supervision& supervision);
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  /// Forks a child for `rank`. In the child, stdout and stderr go to pipes
  /// read by the supervisor, FULGUR_HEARTBEAT_FD names a pipe for
  /// heartbeats, and `body` runs; it must not return (exec or _exit).
  void spawn(int local_rank, int global_rank, const std::function<void()>& body);
  /// Forwards output and reaps until every child has exited. Returns when
  /// all exited with status 0; otherwise stops the rest and throws
  /// RankFailure with the report. On SIGINT / SIGTERM it stops every rank
  /// and ends this process by that signal (it does not return).
  void wait_all();
  /// Stops and reaps every child still running (SIGTERM, grace, SIGKILL).
  void stop_all();
  /// A multi-node run: the other nodes' launchers, watched by `nodes`
  /// (node_watch.h). A lost node fails this node's ranks too (RankFailure,
  /// final when it did not come back after a restart); it hears what this
  /// node's ranks are doing.
  void watch_nodes(NodeWatch* nodes) { nodes_ = nodes; }

 private:
  /// What a rank printed: its partial lines, and the last lines kept for
  /// the failure message.
  struct Output {
    std::string partial[2];
    std::deque<std::string> tail;
  };
  /// Its progress lines ("train batch", "collective").
  struct Progress {
    std::string last;
    int64_t count = 0;
    std::chrono::steady_clock::time_point at;
    /// It reached the training loop ("train batch").
    bool in_loop = false;
  };
  /// Its pulses (heartbeat.h).
  struct Pulse {
    int64_t count = 0;
    std::chrono::steady_clock::time_point at;
    /// CPU time used when last seen working, and when that was.
    int64_t cpu_ms = -1;
    std::chrono::steady_clock::time_point cpu_changed;
    char main_state = '?';
    /// The collective it waits in (kind "" none), and since when.
    std::string kind;
    int64_t seq = 0;
    int64_t bytes = 0;
    std::chrono::steady_clock::time_point since;
    bool in_collective() const { return !kind.empty(); }
  };
  struct Child {
    int local_rank = 0;
    int global_rank = 0;
    pid_t pid = -1;
    /// Read ends of its stdout, stderr and heartbeat pipes (-1: closed).
    int fds[3] = {-1, -1, -1};
    std::string beat_partial;
    bool running = true;
    /// Reaped by someone else (SIGCHLD ignored, a waitpid(-1) elsewhere):
    /// how it ended is unknown.
    bool lost = false;
    int status = 0;
    Output output;
    Progress progress;
    Pulse pulse;
    /// How it said it failed (its first record), if it did.
    std::optional<FailureRecord> failure;
    /// It failed in a collective because a peer was lost.
    bool victim() const { return failure && failure->peer_lost; }
  };
  /// What the monitor loop found: the rank that failed (or hung) and the
  /// report of a hang; the first rank that finished, and when.
  struct Watch {
    const Child* failed = nullptr;
    std::string report;
    /// Another node was lost (a multi-node run).
    std::shared_ptr<const NodeLoss> node_loss;
    const Child* finished = nullptr;
    std::chrono::steady_clock::time_point finished_at;
  };
  void pump(int timeout_ms);
  void read_fd(Child& c, int which);
  void take_beat(Child& c, const std::string& line);
  /// One round of the monitor loop: true when every rank is done or one failed.
  bool watch_once(Watch& w);
  /// Ranks that ended: their pipes drained, the first failure and the first
  /// success noted.
  void note_exits(Watch& w);
  /// A frozen or hung rank's report (and `failed` set to it), or "".
  std::string check_liveness(const Child*& failed);
  /// hang_timeout: a rank behind the others, or still running after one
  /// finished, with no progress for that long.
  void check_progress(Watch& w);
  /// Ranks fail together: the deaths of the next moment, then the cause among
  /// them (a rank killed by a signal, else one that failed on its own first).
  const Child* settle_on_cause(const Child* failed);
  /// A victim's failure whose cause is a running rank behind it: that rank's
  /// hang report (and `failed` set to it), or "".
  std::string blame_lagging(const Child*& failed);
  /// A victim's failure whose cause is a rank that already exited with
  /// status 0 (it left the fit while its peers waited for it): that rank's
  /// report (and `failed` set to it), or "".
  std::string blame_early_exit(const Child*& failed);
  /// Stops the rest and throws the RankFailure.
  [[noreturn]] void fail(const Child* failed, std::string report);
  /// Stops every rank of this node and throws the node's loss.
  [[noreturn]] void fail_for(const NodeLoss& loss);
  /// Every rank's state on one line, for the other nodes.
  std::string ranks_line() const;
  /// Every rank's last known state, one line each, plus a desync note.
  std::string ranks_state() const;
  /// After this process itself was stopped (SIGSTOP of the whole job, a
  /// suspended laptop): every rank's clocks start again now.
  void forgive_own_pause();
  [[noreturn]] void stop_all_and_end_by(int sig);
  bool reap();
  std::string describe_death(const Child& c) const;
  std::string tail_text(const Child& c) const;
  void close_fds(Child& c);

  /// Whether `c` ended with exit status 0.
  static bool succeeded(const Child& c);

  /// Lines of each rank's output kept for the failure message.
  static constexpr size_t kTailLines = 20;
  Supervision supervision_;
  std::chrono::milliseconds heartbeat_timeout_;
  std::vector<Child> children_;
  /// The program's SIGCHLD disposition, when it ignored SIGCHLD (children
  /// would then be reaped by the kernel, unseen): restored at the end.
  struct sigaction saved_sigchld_ {};
  bool restore_sigchld_ = false;
  std::chrono::steady_clock::time_point started_;
  std::chrono::steady_clock::time_point last_look_;
  NodeWatch* nodes_ = nullptr;
};

}  // namespace fulgur::detail
