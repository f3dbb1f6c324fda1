// File: fulgur/plugins/environments/lsf.h
#pragma once

#include <string>
#include <vector>

#include "fulgur/plugins/environments/cluster_environment.h"

namespace fulgur {

/// IBM LSF with jsrun: LSB_JOBID, LSB_DJOB_RANKFILE (or LSB_HOSTS) and
/// JSM_NAMESPACE_SIZE / _RANK / _LOCAL_RANK. Node rank: this host's place
/// among the distinct compute hosts of LSB_DJOB_RANKFILE (its first line, the
/// launch host, left out), as PyTorch Lightning counts it; where that file
/// cannot be read, rank / local size (JSM_NAMESPACE_LOCAL_SIZE, else world
/// size / compute hosts in LSB_MCPU_HOSTS). Main address: MASTER_ADDR, else the first compute host of
/// LSB_MCPU_HOSTS ("batch 1 h1 4 h2 4" → "h1"); port MASTER_PORT, else
/// 10000 + LSB_JOBID % 1000, as PyTorch Lightning does.
class LSFEnvironment : public ClusterEnvironment {
 public:
  /// Reads the variables now; ConfigError naming a required variable that is
  /// unset or one that is not an integer.
  explicit LSFEnvironment(const EnvView& env = EnvView());
  /// True when this environment's variables are set in `env`.
  static bool detect(const EnvView& env);

  std::string_view name() const override { return "lsf"; }
  bool creates_processes_externally() const override { return true; }
  std::string main_address() const override;
  int main_port() const override;
  void validate_settings(int num_devices, int num_nodes) const override;

  /// The first compute host of LSB_MCPU_HOSTS (the batch host is skipped
  /// when there are others); empty when there is none.
  static std::string first_compute_host(const std::string& mcpu_hosts);
  /// The place of `host` among the distinct compute hosts of a rank file's
  /// lines (the first line, the launch host, left out when there are others);
  /// a host name matches with or without its domain. -1 when it is absent.
  static int node_rank_among(const std::vector<std::string>& rankfile_lines,
                             const std::string& host);
  int local_size() const { return local_size_; }

 private:
  int local_size_ = 0;  // 0: unknown
  std::string main_address_;
  int main_port_ = 0;
};

}  // namespace fulgur
