// The rank's side of supervision: what a process started by one of
// fulgur's launchers tells its supervisor (supervisor.h) through the pipe
// named by FULGUR_HEARTBEAT_FD (in the process named by FULGUR_HEARTBEAT_PID
// only). Two kinds of lines:
//
//  - progress: "<what>" from the training loop and every collective; a rank
//    that stops sending them while its peers go on has fallen behind.
//  - pulses: "pulse cpu=<ms> main=<state> coll=<call>" every
//    FULGUR_HEARTBEAT_INTERVAL_MS from a thread of their own, which keeps
//    running through a long step or a long collective. A process that sends
//    none for the heartbeat timeout is frozen (SIGSTOP, a debugger, a
//    machine that stopped scheduling it); `cpu` and `main` (the main
//    thread's scheduler state) tell a rank that is working from one that
//    waits on nothing; `coll` names the collective it is inside ("-": none).
//
//  - one failure record: "failure peer=<0|1> at=<ms> coll=<call> what=<text>",
//    when the process fails (report_failure below).
//
// Everything here is a no-op in a process no launcher of fulgur's started.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace fulgur::detail {

/// Writes all of `data` to `fd`, retrying on EINTR; gives up on an error.
void write_all(int fd, const char* data, size_t n);

/// The scheduler state in a /proc stat file ('R' running, 'S' sleeping,
/// 'D' uninterruptible I/O, 'T' stopped, ...); '?' when unreadable.
char proc_stat_state(const char* stat_path);

/// Whether one of fulgur's launchers started this process (and watches it).
bool has_supervisor();

/// A progress line ("train batch", "collective"). Cheap: one write.
void send_heartbeat(const char* what);

/// Starts this process's pulse thread (once per process; a forked child
/// starts its own). A no-op without a supervisor.
void start_pulse();

/// One collective as the ranks see it: the n-th call of this process's
/// group, so that the same sequence number on two ranks is the same call
/// unless the program called collectives in different orders (a desync).
struct CollectiveCall {
  const char* kind = "";  // "all_reduce", "broadcast", "all_gather", "barrier"
  int64_t seq = 0;
  int64_t bytes = 0;
};

/// Marks this process as waiting inside `call` for as long as it lives;
/// the pulses carry it. One at a time (the innermost wins).
class InCollective {
 public:
  explicit InCollective(const CollectiveCall& call);
  ~InCollective();
  InCollective(const InCollective&) = delete;
  InCollective& operator=(const InCollective&) = delete;
};

/// "all_reduce #57 (4.0 KiB)": for messages.
std::string describe(const CollectiveCall& call);

/// A duration in seconds with one decimal ("2.0"), as the launchers'
/// messages give it.
std::string seconds_text(std::chrono::steady_clock::duration d);

/// Ends the message of a collective that failed because a peer left (a
/// closed connection, a timeout), for the user who reads it. (The launcher
/// learns it from the failure record, not from this text.)
inline constexpr const char* kPeerFailedHint =
    "A peer rank probably died or stopped responding (see the launcher's message about it), or "
    "the process_group_timeout passed.";

/// Ends the message of a collective that failed because a peer left, where
/// no launcher of fulgur's supervises the ranks (srun, mpirun, by hand).
inline constexpr const char* kUnsupervisedPeerFailedHint =
    "A peer rank probably died (a signal, the OOM killer: no rank said in the store that it "
    "failed) or stopped responding, or the process_group_timeout passed.";

/// What a desync (ranks waiting in different collectives) means, for the
/// messages that name one.
inline constexpr const char* kDesyncHint =
    "The program calls collectives in a different order or number on different ranks (a metric "
    "logged with sync_dist on some ranks only, a save_checkpoint called on some ranks only "
    "(every rank must call it), a branch on the rank around a collective?).";

/// How a rank failed, as it tells its supervisor (a third kind of line,
/// "failure ...", sent once, when the failure is seen): the supervisor names
/// the rank that failed first on its own from these records, never by
/// searching what the ranks printed.
struct FailureRecord {
  /// A collective failed because a peer left or stopped answering (a closed
  /// connection, a timeout): this rank is a victim, not the cause.
  bool peer_lost = false;
  /// The collective it failed in ("" outside one).
  std::string collective;
  /// When, in milliseconds of the system clock (comparable between machines
  /// whose clocks agree).
  int64_t at_ms = 0;
  /// The error's first line.
  std::string what;
};

/// The record of a failure seen now: `call` (may be null) described, the
/// error's first line, at most 1000 bytes (a pipe takes it in one write).
FailureRecord failure_record(bool peer_lost, const CollectiveCall* call, const std::string& what);

/// The record as one line (no newline at the end), and back; nullopt for a
/// line that is not one.
std::string encode(const FailureRecord& record);
std::optional<FailureRecord> decode_failure(const std::string& line);

/// Tells the supervisor how this process failed: the first call wins (a
/// collective's failure comes before the exception it raises reaches the
/// Trainer). A no-op without a supervisor.
void report_failure(bool peer_lost, const CollectiveCall* call, const std::string& what);

}  // namespace fulgur::detail
