// File: fulgur/plugins/environments/slurm.h
#pragma once

#include <signal.h>

#include <optional>
#include <string>
#include <vector>

#include "fulgur/plugins/environments/cluster_environment.h"

namespace fulgur {

/// srun created this process: world size SLURM_NTASKS, ranks SLURM_PROCID /
/// SLURM_LOCALID / SLURM_NODEID; the main address is MASTER_ADDR or the first
/// host of SLURM_NODELIST, the port MASTER_PORT or 15000 + the last 4 digits
/// of SLURM_JOB_ID (12910 without a job id), as PyTorch Lightning does. An
/// interactive allocation (SLURM_JOB_NAME "bash" or "interactive") is not
/// detected: fulgur then creates the processes itself.
///
/// Preemption and requeue: the requeue signal (SIGUSR1 by default, as
/// `sbatch --signal=B:USR1@90` or preemption sends it) and SIGTERM (what
/// SLURM sends at the time limit or on preemption, KillWait seconds before
/// SIGKILL) make fit save a checkpoint at the next step boundary; on the
/// requeue signal global rank 0 then runs `scontrol requeue $SLURM_JOB_ID`
/// once. The requeued job (SLURM_RESTART_COUNT > 0) resumes from it.
struct SLURMOptions {
  /// Call `scontrol requeue` on the requeue signal.
  bool auto_requeue = true;
  /// The signal that asks for a checkpoint and a requeue.
  int requeue_signal = SIGUSR1;
  /// `scontrol` (found on PATH unless a path is given).
  std::string scontrol = "scontrol";
};

class SLURMEnvironment : public ClusterEnvironment {
 public:
  /// Reads the variables now; ConfigError naming a required variable that is
  /// unset or one that is not an integer.
  explicit SLURMEnvironment(const EnvView& env = EnvView(), SLURMOptions options = {});
  /// True when this environment's variables are set in `env`.
  static bool detect(const EnvView& env);

  std::string_view name() const override { return "slurm"; }
  bool creates_processes_externally() const override { return true; }
  std::string main_address() const override;
  int main_port() const override;
  void validate_settings(int num_devices, int num_nodes) const override;
  /// The requeue signal and SIGTERM.
  std::vector<int> preemption_signals() const override;
  /// `scontrol requeue $SLURM_JOB_ID` on the requeue signal (bounded: 60 s).
  std::string requeue(int signal) override;

  /// The first host of a SLURM host list: "node[001-004,7]" → "node001",
  /// "a,b" → "a", "host-[3,5]" → "host-3". ConfigError when empty or
  /// malformed.
  static std::string first_host(const std::string& nodelist);
  /// SLURM_JOB_NAME is "bash" or "interactive".
  static bool is_interactive(const EnvView& env);

 private:
  std::string main_address_;
  int main_port_ = 0;
  std::optional<int> ntasks_per_node_;
  std::string ntasks_per_node_source_;
  std::optional<int> nnodes_;
  std::string nnodes_source_;
  SLURMOptions options_;
  std::string job_id_;
};

}  // namespace fulgur
