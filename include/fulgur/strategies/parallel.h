// File: fulgur/strategies/parallel.h
//
// The parallel part of the Strategy hub: ranks from the cluster environment,
// a ProcessGroup created by the first setup_environment() and kept for the
// strategy's life (fit, then test, share it), and the collectives over it. DDPStrategy adds
// gradient averaging; the `manual` strategy leaves the model to the user and keeps all of this.
// With several ranks, setup_environment() sets SIGPIPE to be ignored, as Python does at
// start-up: a write to a dead peer is then an error the rank reports, not its own death.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "fulgur/core/choice.h"
#include "fulgur/distributed/launchers/launcher.h"
#include "fulgur/strategies/strategy.h"

namespace fulgur {

/// How a strategy that launches its own ranks creates them: "popen"
/// re-executes the program once per local rank, "fork" forks the ranks at
/// fit() (the calling process gets rank 0's results).
enum class StartMethod { kPopen, kFork };
template <>
struct ChoiceNames<StartMethod> {
  static constexpr std::pair<StartMethod, const char*> kNames[] = {{StartMethod::kPopen, "popen"},
                                                                   {StartMethod::kFork, "fork"}};
};

class ProcessGroup;

/// What every strategy that runs several processes shares: its process
/// group and how its launcher stops the ranks. DDPOptions::parallel,
/// ManualOptions (the same struct) and the sharded strategies take it.
struct ParallelOptions {
  /// Bounds the rendezvous and every collective.
  std::chrono::milliseconds process_group_timeout = std::chrono::minutes(30);
  /// "gloo", "nccl" or "mpi"; empty: nccl on CUDA where available, else gloo.
  std::string process_group_backend;
  /// Between SIGTERM and SIGKILL when the launcher stops ranks.
  std::chrono::milliseconds stop_grace = std::chrono::seconds(5);
};
/// ", process_group_timeout=1800s, process_group_backend=auto, stop_grace=5s".
std::string describe_parallel_options(const ParallelOptions& options);

class ParallelStrategy : public Strategy {
 public:
  /// ConfigError naming `owner` ("DDPStrategy") for a backend that is not
  /// one of known_process_group_backends(), or a start method that is
  /// neither "popen" nor "fork".
  explicit ParallelStrategy(ParallelOptions options = {},
                            std::string_view owner = "ParallelStrategy",
                            const Choice<StartMethod>& start_method = StartMethod::kPopen);
  ~ParallelStrategy() override;
  const ParallelOptions& parallel_options() const { return parallel_; }

  /// From the cluster environment when it created the processes (or a
  /// launcher set them), else what the launcher will create.
  Ranks ranks() const override;
  /// parallel_devices()[local_rank()].
  c10::Device root_device() const override;

  /// Uses a group the program already created instead of rendezvousing at
  /// setup_environment(). Its rank and size must be this process's.
  void set_process_group(std::shared_ptr<ProcessGroup> group);

  /// The backend setup_environment() uses: ParallelOptions'
  /// process_group_backend, or when it is empty nccl on CUDA devices where
  /// this build has it, else gloo.
  std::string process_group_backend() const;

  /// Bounds the rendezvous and every collective (default 30 minutes).
  std::chrono::milliseconds process_group_timeout() const {
    return parallel_.process_group_timeout;
  }

  /// MASTER_PORT: the one the launcher gave the ranks it forked, else the
  /// cluster environment's.
  int main_port() const;

 protected:
  /// Unless the cluster environment created the processes: this process
  /// stands for local rank 0 of its node (as PyTorch Lightning's launching
  /// process does) and, with several devices, gets a fork or
  /// subprocess-script launcher (stopping ranks with
  /// ParallelOptions::stop_grace); with one device it runs in place. Then
  /// notes the process group backend when it was left to the default;
  /// ConfigError when the backend cannot run on the devices.
  void configure(std::vector<std::string>& notes) override;
  void do_setup_environment() override;
  void do_teardown() override;
  /// Every rank takes rank 0's parameters (one broadcast each), after
  /// check_same_module_on_every_rank.
  void broadcast_parameters_from_rank_zero(Module& module);
  /// ConfigError on every rank naming what differs when the ranks' modules
  /// have other parameters or buffers (names, shapes, dtypes): a broadcast
  /// or gradient exchange of unlike tensors would copy part of one, abort
  /// in the backend or wait for a peer forever. One all-gather of a hash.
  void check_same_module_on_every_rank(Module& module);
  /// sync_batchnorm: every fulgur::nn::SyncBatchNorm of `module` reduces
  /// its statistics over the process group. ConfigError naming LibTorch's
  /// own BatchNorm layers, which cannot be swapped for synchronised ones
  /// from outside the module.
  void connect_sync_batchnorm(Module& module);

  /// agree_to_stop for a strategy whose step collectives carry each rank's
  /// stop_vote() (DDP's gradient all-reduce, FSDP's agreements before the
  /// reduce-scatters): after a plain batch whose collectives carried votes
  /// (`exchanges`, their count so far, moved since the last call), the
  /// answer is `votes_say_stop()` (any rank voted to stop, read only then);
  /// after a micro-batch without a gradient sync, no (its step's
  /// collectives vote); otherwise, and at a boundary, one
  /// reduce_boolean_decision. Once agreed, it stays agreed.
  bool agree_to_stop_from_votes(bool requested, bool boundary, int64_t exchanges,
                                const std::function<bool()>& votes_say_stop);
  /// The vote-carrying collectives count from `exchanges` again, and no
  /// stop is agreed: at setup, and when DDP rebuilds its reducer mid-fit
  /// (a stop agreed by then is every rank's vote from then on, so the
  /// restart changes no answer).
  void restart_stop_votes(int64_t exchanges);

 private:
  /// What the launcher says of this process when it forked it; null
  /// otherwise (the ranks then come from the cluster environment).
  const LaunchedRank* launched_rank() const;
  /// What the launcher starts, read at each of its launches.
  RankLayout rank_layout() const;
  /// configure()'s first half: the launcher.
  void configure_launcher();

  ParallelOptions parallel_;
  StartMethod start_method_;
  // agree_to_stop_from_votes: the vote-carrying collectives counted at its
  // last call, and whether the ranks agreed to stop.
  int64_t vote_exchanges_seen_ = 0;
  bool stop_agreed_ = false;
};

}  // namespace fulgur
