// File: fulgur/distributed/launchers/launcher.h
//
// A Launcher creates the worker processes of one node and runs a function on
// every rank. It is owned by its Strategy; the Trainer asks the strategy for
// it and, when there is one, calls launch(fn) instead of running the stage
// itself. Data flows down: the launcher reads where and how many ranks to
// start from its owner (RankLayout, at each launch) and never writes into
// it; a rank it forked reads its place from launched_rank(). Where the calling process goes on
// after the ranks (fork), it gets back the bytes global rank 0's fn returned: the Trainer decides
// what they hold, the launcher only carries them.
//
//   if (auto* launcher = strategy.launcher()) {
//     auto bytes = launcher->launch([&] { run(); return results_of_rank_0(); });
//     if (bytes) take(*bytes);
//   } else {
//     run();
//   }
//
// The launching process is the parent of every local rank: it forwards
// their output, reaps them all, and when one dies (exit code, signal, a
// hang) stops the others and throws DistributedError naming the rank, its
// pid, how it died and the last lines it printed.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace fulgur {

/// Where and how many ranks a launcher starts on this node, read from the
/// strategy that owns it at each launch().
struct RankLayout {
  /// Processes of this node (one per local device).
  int local_world_size = 1;
  int num_nodes = 1;
  int node_rank = 0;
  /// MASTER_ADDR.
  std::string main_address = "127.0.0.1";
  /// MASTER_PORT; 0: the launcher picks a free port for each start.
  int main_port = 0;
};

/// What a launcher that forks its ranks tells each of them (the torchrun
/// variables it sets say the same, for code that reads the environment).
struct LaunchedRank {
  int local_rank = 0;
  int global_rank = 0;
  int world_size = 1;
  /// How many times the ranks were started before this start
  /// (FULGUR_RESTART_COUNT).
  int restart_count = 0;
};

/// How a launcher watches its ranks, and what it does when one fails. The
/// strategy that creates the launcher sets the stop grace and the hang
/// timeout (its ParallelOptions); the Trainer sets the rest before each
/// launch() (TrainerOptions::max_restarts, heartbeat_timeout).
struct Supervision {
  /// Between SIGTERM and SIGKILL when stopping ranks.
  std::chrono::milliseconds stop_grace = std::chrono::seconds(5);
  /// A rank behind the others (or still running after one finished) with no
  /// progress for this long is hung (0: never).
  std::chrono::milliseconds hang_timeout = std::chrono::minutes(30);
  /// A rank that sent pulses and then none for this long is frozen; one in
  /// the training loop that made no progress and used no CPU outside any
  /// collective for this long, while a peer waited in one, is hung (0:
  /// neither is checked). On several nodes, a node whose launcher is silent
  /// this long is lost.
  std::chrono::milliseconds heartbeat_timeout = std::chrono::seconds(10);
  /// Times the launcher starts every local rank again after one died, froze
  /// or hung (a new rendezvous, the same world size). The ranks see
  /// FULGUR_RESTART_COUNT and resume from the newest checkpoint that
  /// verifies.
  int max_restarts = 0;
  /// What a restart resumes from, for its message (a quoted checkpoint
  /// path); empty: the beginning.
  std::function<std::string()> resume_point;
};

class Launcher {
 public:
  explicit Launcher(Supervision supervision = {}) : supervision_(std::move(supervision)) {}
  virtual ~Launcher() = default;
  /// "subprocess_script", "fork".
  virtual std::string_view name() const = 0;
  /// Whether it can run from an interactive session (no re-executed script).
  virtual bool is_interactive_compatible() const = 0;
  /// Whether the calling process is not one of the ranks and goes on after
  /// launch() (fork): then it has only what rank 0's fn returned, so a stage
  /// whose results cannot travel as bytes must be refused before launching.
  virtual bool returns_to_caller() const = 0;
  /// Runs `fn` on every local rank. Throws DistributedError when a rank
  /// fails. Returns, where returns_to_caller(), the bytes global rank 0's
  /// `fn` returned (nullopt on other nodes); see each launcher for the rest.
  virtual std::optional<std::string> launch(const std::function<std::string()>& fn) = 0;

  Supervision& supervision() { return supervision_; }
  const Supervision& supervision() const { return supervision_; }

  /// In a rank this launcher forked: which rank it is; null elsewhere (the
  /// launching process; a re-executed rank reads its environment).
  const LaunchedRank* launched_rank() const { return launched_rank_ ? &*launched_rank_ : nullptr; }
  /// The MASTER_PORT this launcher gave the ranks of its latest start where
  /// they run in forks of this process; nullopt otherwise.
  std::optional<int> main_port() const { return main_port_; }

 protected:
  Supervision supervision_;
  std::optional<LaunchedRank> launched_rank_;
  std::optional<int> main_port_;
};

}  // namespace fulgur
