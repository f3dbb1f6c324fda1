// File: fulgur/plugins/environments/slurm.h
#pragma once

#include <optional>
#include <string>

#include "fulgur/plugins/environments/cluster_environment.h"

namespace fulgur {

/// srun created this process: world size SLURM_NTASKS, ranks SLURM_PROCID /
/// SLURM_LOCALID / SLURM_NODEID; the main address is MASTER_ADDR or the first
/// host of SLURM_NODELIST, the port MASTER_PORT or 15000 + the last 4 digits
/// of SLURM_JOB_ID (12910 without a job id), as PyTorch Lightning does. An
/// interactive allocation (SLURM_JOB_NAME "bash" or "interactive") is not
/// detected: fulgur then creates the processes itself.
class SLURMEnvironment : public ClusterEnvironment {
 public:
  /// Reads the variables now; ConfigError naming a required variable that is
  /// unset or one that is not an integer.
  explicit SLURMEnvironment(const EnvView& env = EnvView());
  /// True when this environment's variables are set in `env`.
  static bool detect(const EnvView& env);

  std::string_view name() const override { return "slurm"; }
  bool creates_processes_externally() const override { return true; }
  std::string main_address() const override;
  int main_port() const override;
  void validate_settings(int num_devices, int num_nodes) const override;

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
};

}  // namespace fulgur
