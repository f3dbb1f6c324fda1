// Private: the signal connector. While fit runs under a cluster environment
// that announces the end of a job by signals (ClusterEnvironment::
// preemption_signals(): SLURM's requeue signal and SIGTERM), their handlers
// only record the first one; the fit loop reads it at step boundaries, the
// ranks agree, and the Trainer saves a checkpoint before the process ends
// by that signal. Not installed.
#pragma once

#include <signal.h>

#include <vector>

#include "core/signals.h"

namespace fulgur::detail {

class SignalConnector {
 public:
  SignalConnector() = default;
  ~SignalConnector();
  SignalConnector(const SignalConnector&) = delete;
  SignalConnector& operator=(const SignalConnector&) = delete;

  /// Installs the recording handler for `signals` (none: a no-op).
  void arm(const std::vector<int>& signals);
  /// Puts the previous handlers back.
  void disarm();
  bool armed() const { return !saved_.empty(); }
  /// The first signal received since arm() (0: none).
  int received() const;

 private:
  struct Saved {
    int signal;
    struct sigaction action;
  };
  std::vector<Saved> saved_;
};

}  // namespace fulgur::detail
