// Process supervision shared by the launchers: the launching process is the
// parent of every local rank. It forwards each rank's output, keeps the last
// lines each printed, reaps every child, and when one fails (non-zero exit,
// signal) stops the others — SIGTERM, then SIGKILL after a grace period —
// and reports one message naming the rank, its pid, how it died and what it
// printed last. Children get PR_SET_PDEATHSIG so they never outlive it.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

namespace fulgur::detail {

class Supervisor {
 public:
  struct Options {
    /// Between SIGTERM and SIGKILL when stopping ranks.
    std::chrono::milliseconds grace{std::chrono::seconds(5)};
    /// A rank is declared hung when it sent no heartbeat for this long
    /// while another rank did, or while it is still running after another
    /// rank finished (0: never).
    std::chrono::milliseconds hang_timeout{0};
    /// Lines of each rank's output kept for the failure message.
    size_t tail_lines = 20;
  };
  explicit Supervisor(Options options);
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  /// Forks a child for `rank`. In the child, stdout and stderr go to pipes
  /// read by the supervisor, FULGUR_HEARTBEAT_FD names a pipe for
  /// heartbeats, and `body` runs; it must not return (exec or _exit).
  void spawn(int local_rank, int global_rank, const std::function<void()>& body);
  /// Forwards output and reaps until every child has exited. Returns when
  /// all exited with status 0; otherwise stops the rest and throws
  /// DistributedError with the report.
  void wait_all();
  /// Stops and reaps every child still running (SIGTERM, grace, SIGKILL).
  void stop_all();

 private:
  struct Child {
    int local_rank = 0;
    int global_rank = 0;
    pid_t pid = -1;
    int out_fd = -1;
    int err_fd = -1;
    int beat_fd = -1;
    bool running = true;
    /// Reaped by someone else (SIGCHLD ignored, a waitpid(-1) elsewhere):
    /// how it ended is unknown.
    bool lost = false;
    int status = 0;
    std::string partial[2];
    std::deque<std::string> tail;
    std::string beat_partial;
    std::string last_beat;
    int64_t beats = 0;
    std::chrono::steady_clock::time_point last_beat_time;
  };
  void pump(int timeout_ms);
  void read_fd(Child& c, int& fd, int which);
  bool reap();
  std::string describe_death(const Child& c) const;
  std::string tail_text(const Child& c) const;
  void close_fds(Child& c);

  /// Whether `c` ended with exit status 0.
  static bool succeeded(const Child& c);

  Options options_;
  std::vector<Child> children_;
  /// The program's SIGCHLD disposition, when it ignored SIGCHLD (children
  /// would then be reaped by the kernel, unseen): restored at the end.
  struct sigaction saved_sigchld_ {};
  bool restore_sigchld_ = false;
  std::chrono::steady_clock::time_point started_;
};

/// Writes a heartbeat ("<what>\n") to the supervisor, when this process was
/// started by one; a no-op otherwise. Cheap: one write to a pipe.
void send_heartbeat(const char* what);

/// Ends the message of a collective that failed because a peer left (a
/// closed connection, a timeout): the supervisor reads it in a dead rank's
/// last lines as "a victim, not the cause".
inline constexpr const char* kPeerFailedHint =
    "A peer rank probably died or stopped responding (see the launcher's message about it), or "
    "the process_group_timeout passed.";

}  // namespace fulgur::detail
